"""The DDPG torch Learner: critic regression to the (n-step) TD target, deterministic policy
gradient for the actor, importance-sampling weights from prioritized replay, TD3's delayed
actor and target updates (Fujimoto et al.) as an option, and, with demonstrations, a
behaviour-cloning term with a Q-filter (Nair et al., arXiv:1709.10089; DDPGfD, Vecerik et
al., arXiv:1707.08817)."""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import torch
from ray.rllib.algorithms.dqn.dqn_learner import DQNLearner
from ray.rllib.algorithms.sac.sac_learner import (
    QF_LOSS_KEY,
    QF_PREDS,
    QF_TARGET_NEXT,
    QF_TWIN_LOSS_KEY,
    QF_TWIN_PREDS,
)
from ray.rllib.algorithms.sac.torch.sac_torch_learner import SACTorchLearner
from ray.rllib.core.columns import Columns
from ray.rllib.core.learner.learner import POLICY_LOSS_KEY, Learner
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.utils.annotations import override
from ray.rllib.utils.metrics import ALL_MODULES, TD_ERROR_KEY

from .rllib_internals import has_grad_scalers_or_lr_schedulers, learner_params, module_optimizers

__all__ = ["DEMO", "DDPGTorchLearner"]

DEMO = "demo"  # batch column: 1.0 for demonstration transitions

logger = logging.getLogger(__name__)


def _adam(params, weight_decay: float) -> torch.optim.Adam:
    """Adam with its fused kernel (CPU and CUDA, torch >= 2.4): one call per step instead of
    a Python loop over parameters; same update rule as the default implementation."""
    try:
        return torch.optim.Adam(params, weight_decay=weight_decay, fused=True)
    except (RuntimeError, TypeError):  # a device or dtype without the fused kernel
        return torch.optim.Adam(params, weight_decay=weight_decay, foreach=True)


class DDPGTorchLearner(SACTorchLearner):
    @override(SACTorchLearner)
    def build(self) -> None:
        super().build()
        self._updates: dict[str, int] = defaultdict(int)
        self._actor_step: dict[str, bool] = {}

    @override(SACTorchLearner)
    def configure_optimizers_for_module(self, module_id, config=None) -> None:
        """Two Adams: ``qf`` over the critic(s) (the twin critic's parameters join the
        first's: Adam is per parameter, so this is the same update with one optimizer call
        fewer per gradient step) and ``policy`` over the actor."""
        module = self.module[module_id]
        critics = [module.qf, *((module.qf_twin,) if config.twin_q else ())]
        for name, params, lr, wd in (
                ("qf", [p for net in critics for p in self.get_parameters(net)],
                 config.critic_lr, config.critic_weight_decay),
                ("policy", self.get_parameters(module.pi), config.actor_lr, 0.0)):
            self.register_optimizer(module_id=module_id, optimizer_name=name,
                                    optimizer=_adam(params, wd),
                                    params=params, lr_or_lr_schedule=lr)

    @override(SACTorchLearner)
    def compute_loss_for_module(self, *, module_id, config, batch, fwd_out) -> torch.Tensor:
        r = batch[Columns.REWARDS]
        done = batch[Columns.TERMINATEDS].float()
        w = batch.get("weights", torch.ones_like(r))
        y = (r + config.gamma * (1.0 - done) * fwd_out[QF_TARGET_NEXT]).detach()
        td = y - fwd_out[QF_PREDS]
        losses = {QF_LOSS_KEY: (w * td.pow(2)).mean()}
        td_abs = td.abs()
        if config.twin_q:
            td2 = y - fwd_out[QF_TWIN_PREDS]
            losses[QF_TWIN_LOSS_KEY] = (w * td2.pow(2)).mean()
            td_abs = 0.5 * (td_abs + td2.abs())
        # critic-only updates first (critic_warmup_updates), then the actor every
        # policy_delay-th update (TD3); its forward pass runs only when it is updated
        n = self._updates[module_id]
        actor = n >= config.critic_warmup_updates and n % config.policy_delay == 0
        self._actor_step[module_id] = actor
        self._updates[module_id] = n + 1
        logs = {"critic_loss": losses[QF_LOSS_KEY], "q_mean": fwd_out[QF_PREDS].mean()}
        if actor:
            pi, q_pi = self.module[module_id].unwrapped().actor_objective(batch[Columns.OBS])
            policy_loss = -q_pi.mean()
            logs["actor_loss"] = policy_loss
            if config.bc_weight > 0 and DEMO in batch:
                # behaviour cloning on demonstration rows, with Nair et al.'s Q-filter
                # (only where the critic rates the demonstrated action above the actor's)
                demo = batch[DEMO].float()
                keep = demo * (fwd_out[QF_PREDS] > q_pi).float().detach()
                err = (pi - batch[Columns.ACTIONS]).pow(2).sum(-1)
                bc = (keep * err).sum() / demo.sum().clamp(min=1.0)
                policy_loss = policy_loss + config.bc_weight * bc
                logs["bc_loss"] = bc
            losses[POLICY_LOSS_KEY] = policy_loss
        self.metrics.log_value((module_id, TD_ERROR_KEY), td_abs.detach(),
                               reduce="item_series")
        self.metrics.log_dict(logs, key=module_id, window=1)
        return sum(losses.values())

    @override(TorchLearner)
    def compute_gradients(self, loss_per_module, **kwargs) -> dict[str, Any]:
        """One backward pass per module: the critic losses reach only the critics (the
        actions come from the batch, the target under no_grad) and the actor loss only the
        actor (:meth:`DDPGTorchRLModule.actor_objective`), so their sum separates."""
        grads: dict[str, Any] = {}
        for mid in set(loss_per_module) - {ALL_MODULES}:
            optimizers = self.get_optimizers_for_module(mid)
            for _, opt in optimizers:
                # set_to_none: apply_gradients steps every optimizer, and a skipped actor step
                # must leave grad=None (Adam then skips those parameters; zero gradients would
                # still move them through Adam's momentum)
                opt.zero_grad(set_to_none=True)
            loss_per_module[mid].backward()
            for _, opt in optimizers:
                grads.update({k: p.grad for k, p in self.filter_param_dict_for_optimizer(
                    learner_params(self), opt).items()})
        return grads

    @override(TorchLearner)
    def apply_gradients(self, gradients_dict) -> None:
        """The optimizer steps, then (on actor steps: TD3 delays them with the actor) the
        Polyak averaging of every target network, once per gradient update, so several
        updates can share one ``learner_group.update`` call (minibatches).

        RLlib's ``TorchLearner.apply_gradients`` checks every gradient tensor for nan/inf
        twice, one small kernel and one host sync each, per update. This does the
        same guard once per optimizer, on the fused norms of its gradients: an optimizer whose
        gradients are not all finite does not step (RLlib's ``torch_skip_nan_gradients=False``
        would zero them instead; skipping keeps Adam's moments clean) and a warning says so."""
        if has_grad_scalers_or_lr_schedulers(self):
            super().apply_gradients(gradients_dict)  # mixed precision / lr schedulers
        else:
            params = learner_params(self)
            for pid, grad in gradients_dict.items():
                params[pid].grad = grad
            for module_id, names in module_optimizers(self).items():
                for name in names:
                    optim = self.get_optimizer(module_id, name)
                    grads = [p.grad for g in optim.param_groups for p in g["params"]
                             if p.grad is not None]
                    if not grads:
                        continue
                    if bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()):
                        optim.step()
                    else:
                        logger.warning(f"{module_id}/{name}: nan/inf gradients, step skipped")
        for mid, actor in self._actor_step.items():
            if not actor:
                continue
            tau = self.config.get_config_for_module(mid).tau
            with torch.no_grad():  # target <- target + tau (main - target), fused
                for main, target in self.module[mid].unwrapped().get_target_network_pairs():
                    torch._foreach_lerp_(list(target.parameters()), list(main.parameters()),
                                         tau)

    @override(Learner)
    def after_gradient_based_update(self, *, timesteps: dict[str, Any]) -> None:
        # learning-rate schedules only (Learner's, skipping DQNLearner's target-network
        # update): the targets moved in apply_gradients
        super(DQNLearner, self).after_gradient_based_update(timesteps=timesteps)
