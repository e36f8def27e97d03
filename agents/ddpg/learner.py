"""The DDPG torch Learner: critic regression to the (n-step) TD target, deterministic policy
gradient for the actor, importance-sampling weights from prioritized replay, TD3's delayed
actor and target updates (Fujimoto et al.) as an option."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict

import torch

from ray.rllib.algorithms.dqn.dqn_learner import DQNLearner
from ray.rllib.algorithms.sac.sac_learner import (QF_LOSS_KEY, QF_PREDS, QF_TARGET_NEXT,
                                                  QF_TWIN_LOSS_KEY, QF_TWIN_PREDS)
from ray.rllib.algorithms.sac.torch.sac_torch_learner import SACTorchLearner
from ray.rllib.core.columns import Columns
from ray.rllib.core.learner.learner import POLICY_LOSS_KEY
from ray.rllib.utils.metrics import ALL_MODULES, TD_ERROR_KEY

from .module import Q_PI

__all__ = ["DDPGTorchLearner"]


class DDPGTorchLearner(SACTorchLearner):
    def build(self) -> None:
        super().build()
        self._updates: Dict[str, int] = defaultdict(int)
        self._actor_step: Dict[str, bool] = {}

    def configure_optimizers_for_module(self, module_id, config=None) -> None:
        module = self._module[module_id]
        for name, net, lr in (("qf", module.qf, config.critic_lr),
                              *((("qf_twin", module.qf_twin, config.critic_lr),)
                                if config.twin_q else ()),
                              ("policy", module.pi, config.actor_lr)):
            params = self.get_parameters(net)
            wd = config.critic_weight_decay if name != "policy" else 0.0
            self.register_optimizer(module_id=module_id, optimizer_name=name,
                                    optimizer=torch.optim.Adam(params, weight_decay=wd),
                                    params=params, lr_or_lr_schedule=lr)

    def compute_loss_for_module(self, *, module_id, config, batch, fwd_out) -> torch.Tensor:
        r = batch[Columns.REWARDS]
        done = batch[Columns.TERMINATEDS].float()
        w = batch.get("weights", torch.ones_like(r))
        y = (r + config.gamma * (1.0 - done) * fwd_out[QF_TARGET_NEXT]).detach()
        td = y - fwd_out[QF_PREDS]
        self._temp_losses[(module_id, QF_LOSS_KEY)] = (w * td.pow(2)).mean()
        td_abs = td.abs()
        if config.twin_q:
            td2 = y - fwd_out[QF_TWIN_PREDS]
            self._temp_losses[(module_id, QF_TWIN_LOSS_KEY)] = (w * td2.pow(2)).mean()
            td_abs = 0.5 * (td_abs + td2.abs())
        self._temp_losses[(module_id, POLICY_LOSS_KEY)] = -fwd_out[Q_PI].mean()
        self.metrics.log_value((module_id, TD_ERROR_KEY), td_abs.detach(),
                               reduce="item_series")
        self.metrics.log_dict({"critic_loss": self._temp_losses[(module_id, QF_LOSS_KEY)],
                               "actor_loss": self._temp_losses[(module_id, POLICY_LOSS_KEY)],
                               "q_mean": fwd_out[QF_PREDS].mean()}, key=module_id,
                              window=1)
        return sum(v for (m, _), v in self._temp_losses.items() if m == module_id)

    def compute_gradients(self, loss_per_module, **kwargs) -> Dict[str, Any]:
        grads: Dict[str, Any] = {}
        for mid in set(loss_per_module) - {ALL_MODULES}:
            delay = self.config.get_config_for_module(mid).policy_delay
            actor = self._updates[mid] % delay == 0
            self._actor_step[mid] = actor
            self._updates[mid] += 1
            for name, opt in self.get_optimizers_for_module(mid):
                # always clear: apply_gradients steps every optimizer, so a skipped actor
                # step must leave grad=None (Adam then skips those parameters entirely;
                # zero gradients would still move them through Adam's momentum)
                opt.zero_grad(set_to_none=True)
                loss = self._temp_losses.pop((mid, name + "_loss"))
                if name == "policy" and not actor:
                    continue
                loss.backward(retain_graph=True)
                grads.update({k: p.grad for k, p in
                              self.filter_param_dict_for_optimizer(self._params, opt).items()})
        assert not self._temp_losses
        return grads

    def after_gradient_based_update(self, *, timesteps: Dict[str, Any]) -> None:
        if all(self._actor_step.values()):  # polyak-average targets with the actor (TD3)
            super().after_gradient_based_update(timesteps=timesteps)
        else:  # learning-rate schedules only
            super(DQNLearner, self).after_gradient_based_update(timesteps=timesteps)
