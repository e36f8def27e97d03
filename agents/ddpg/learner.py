"""The DDPG torch Learner: RLlib's hooks around :func:`agents.ddpg.update.ddpg_update`.

What an update does is in :mod:`agents.ddpg.update`. This class owns what lives across
updates: the optimizers (two fused Adams), the target networks (made at build time) and the
TD3 counter that decides which updates move the actor (``critic_warmup_updates`` critic-only
updates, then every ``policy_delay``-th). It logs each update's losses and its TD errors
(``td_error``, the new priorities the algorithm writes back to the replay).

Two ways in, one update:

* :meth:`DDPGTorchLearner.update_minibatch`, public: the algorithm's local learner
  (``num_learners=0``) calls it once per minibatch;
* RLlib's ``Learner.update`` (``learner_group.update``, a remote learner): its torch update
  runs ``forward_train``, ``compute_losses`` (one :meth:`compute_loss_for_module` per
  module), :meth:`compute_gradients`, ``postprocess_gradients`` and :meth:`apply_gradients`
  in a row; :meth:`compute_loss_for_module` runs the whole update there, the module's
  ``forward_train`` computes nothing, and the gradient hooks have nothing left to do.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from ray.rllib.core.learner.learner import Learner
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.utils.annotations import override
from ray.rllib.utils.metrics import TD_ERROR_KEY

from .graphed import GraphedUpdate
from .update import UpdateParams

__all__ = ["DDPGTorchLearner"]

logger = logging.getLogger(__name__)


def _adam(params, weight_decay: float) -> torch.optim.Adam:
    """Adam with its fused kernel (CPU and CUDA, torch >= 2.4): one call per step instead of
    a Python loop over parameters; same update rule as the default implementation. On a GPU
    it is capturable (its step counters on the device), so a CUDA graph can hold the step
    (:mod:`agents.ddpg.graphed`)."""
    params = list(params)
    cuda = bool(params) and params[0].is_cuda
    try:
        return torch.optim.Adam(params, weight_decay=weight_decay, fused=True, capturable=cuda)
    except (RuntimeError, TypeError):  # a device or dtype without the fused kernel
        return torch.optim.Adam(params, weight_decay=weight_decay, foreach=True,
                                capturable=cuda)


class DDPGTorchLearner(TorchLearner):
    @override(TorchLearner)
    def build(self) -> None:
        super().build()
        self.module.foreach_module(lambda mid, module: module.make_target_networks())
        self._updates: dict[str, int] = defaultdict(int)
        self._update_params: dict[str, UpdateParams] = {}
        graphs = bool(getattr(self.config, "cuda_graphs", True))
        self._graphed: dict[str, GraphedUpdate] = defaultdict(lambda: GraphedUpdate(graphs))
        # optimizer steps a GPU skipped for nan/inf gradients, on the device until read
        self._nonfinite: dict[str, torch.Tensor] = {}

    @override(Learner)
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

    def actor_turn(self, module_id: str) -> bool:
        """Whether ``module_id``'s next update moves the actor and the targets: after
        ``critic_warmup_updates`` critic-only updates, every ``policy_delay``-th (TD3)."""
        cfg = self.config.get_config_for_module(module_id)
        n = self._updates[module_id]
        return n >= cfg.critic_warmup_updates and n % cfg.policy_delay == 0

    def update_minibatch(self, batch: Mapping[str, Mapping[str, torch.Tensor]]
                         ) -> dict[str, torch.Tensor]:
        """One update of every module in ``batch`` (module id -> columns, tensors on this
        learner's device). Returns module id -> the loss it minimised (detached)."""
        return {mid: self.update_module(mid, columns) for mid, columns in batch.items()}

    def update_module(self, module_id: str, columns: Mapping[str, torch.Tensor]
                      ) -> torch.Tensor:
        """One update of ``module_id`` (:func:`~agents.ddpg.update.ddpg_update`), its
        metrics logged; returns the loss it minimised (detached)."""
        hp = self._update_params.get(module_id)
        if hp is None:  # once per module: the config does not change during training
            cfg = self.config.get_config_for_module(module_id)
            hp = self._update_params[module_id] = UpdateParams(
                gamma=cfg.gamma, tau=cfg.tau, target_noise=cfg.target_noise,
                target_noise_clip=cfg.target_noise_clip, bc_weight=cfg.bc_weight)
        actor = self.actor_turn(module_id)
        self._updates[module_id] += 1
        stats = self._graphed[module_id](self.module[module_id].unwrapped(), columns, hp,
                                         self.get_optimizer(module_id, "qf"),
                                         self.get_optimizer(module_id, "policy"),
                                         actor_step=actor)
        if stats.nonfinite is not None:
            acc = self._nonfinite.get(module_id)
            self._nonfinite[module_id] = (stats.nonfinite if acc is None
                                          else acc + stats.nonfinite)
        self.metrics.log_value((module_id, TD_ERROR_KEY), stats.priorities,
                               reduce="item_series")
        logs = {"critic_loss": stats.critic_loss, "q_mean": stats.q_mean}
        loss = stats.critic_loss
        if stats.actor_loss is not None:
            logs["actor_loss"] = stats.actor_loss
            loss = loss + stats.actor_loss
        if stats.bc_loss is not None:
            logs["bc_loss"] = stats.bc_loss
        self.metrics.log_dict(logs, key=module_id, window=1)
        return loss

    def report_nonfinite(self) -> int:
        """Log (a warning) and return the optimizer steps skipped on the GPU for nan/inf
        gradients since the last call: one host read, once per learner call."""
        total = 0
        for mid, acc in list(self._nonfinite.items()):
            n = int(acc.item())
            if n:
                logger.warning(f"{mid}: {n} optimizer step(s) skipped on the GPU for nan/inf "
                               "gradients")
            total += n
        self._nonfinite.clear()
        return total

    @override(TorchLearner)
    def after_gradient_based_update(self, *, timesteps: dict[str, Any]) -> None:
        super().after_gradient_based_update(timesteps=timesteps)
        self.report_nonfinite()

    @override(Learner)
    def set_state(self, state) -> None:
        """RLlib's restore, then the CUDA graphs dropped: the optimizers' state tensors were
        replaced, and the graphs hold the old ones."""
        super().set_state(state)
        for g in self._graphed.values():
            g.reset()

    # ------------------------------------------------------------------ RLlib's update hooks
    @override(Learner)
    def compute_loss_for_module(self, *, module_id, config, batch, fwd_out) -> torch.Tensor:
        """The whole update of ``module_id`` (:meth:`update_module`), for
        ``Learner.update``: DDPG's forward passes, losses, optimizer steps and target
        averaging are one sequence (:func:`~agents.ddpg.update.ddpg_update`), so they run in
        the first of RLlib's hooks that sees the batch."""
        return self.update_module(module_id, batch)

    @override(TorchLearner)
    def compute_gradients(self, loss_per_module, **kwargs) -> dict[str, Any]:
        """Nothing: :meth:`compute_loss_for_module` applied the gradients."""
        return {}

    @override(Learner)
    def postprocess_gradients(self, gradients_dict) -> dict[str, Any]:
        """Nothing (``grad_clip`` is refused by ``DDPGConfig.validate``)."""
        return gradients_dict

    @override(TorchLearner)
    def apply_gradients(self, gradients_dict) -> None:
        """Nothing: :meth:`compute_loss_for_module` applied the gradients."""
