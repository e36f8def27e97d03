"""One DDPG / TD3 gradient update, top to bottom.

:func:`ddpg_update` is the whole update, in the order of CleanRL's
``td3_continuous_action.py``: a batch sampled with priorities, the TD target with target
policy smoothing, the importance-weighted critic loss, the new priorities, the delayed actor
with the demonstration term, the optimizer steps and the Polyak averaging of the targets.

* DDPG: Lillicrap et al., arXiv:1509.02971, Algorithm 1 (target, critic regression,
  deterministic policy gradient, soft target updates).
* TD3: Fujimoto et al., arXiv:1802.09477, Algorithm 1 (clipped double Q, target policy
  smoothing, delayed actor and target updates).
* Prioritized replay: Schaul et al., arXiv:1511.05952, Algorithm 1 lines 9-12 (importance
  weights in the loss, ``|delta|`` as the new priority).
* Demonstrations: DDPGfD (Vecerik et al., arXiv:1707.08817) with Nair et al.'s Q-filter
  (arXiv:1709.10089, Section 4): behaviour cloning on the demonstration rows of the batch
  where the critic rates the demonstrated action above the actor's.

The learner (:class:`agents.ddpg.learner.DDPGTorchLearner`) calls it from RLlib's hooks and
keeps the TD3 delay counter; this module holds no state and needs no Ray runtime.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from ray.rllib.core.columns import Columns
from torch import nn

__all__ = ["DEMO", "WEIGHTS", "DDPGNetworks", "UpdateParams", "UpdateStats", "ddpg_update"]

DEMO = "demo"  # batch column: 1.0 for demonstration rows, 0.0 for replay rows
WEIGHTS = "weights"  # batch column: the importance-sampling weights of prioritized replay

logger = logging.getLogger(__name__)


class DDPGNetworks(Protocol):
    """What :func:`ddpg_update` reads of the RL module: ``pi(s)`` (tanh action),
    ``qf(s, a)`` (and ``qf_twin`` when ``twin_q``), their target copies, and the
    (main, target) pairs for Polyak averaging."""

    twin_q: bool
    pi: nn.Module
    qf: nn.Module
    qf_twin: nn.Module
    target_pi: nn.Module
    target_qf: nn.Module
    target_qf_twin: nn.Module

    def get_target_network_pairs(self) -> list[tuple[nn.Module, nn.Module]]: ...


@dataclass(frozen=True)
class UpdateParams:
    """The hyperparameters of one update (the fields of ``DDPGConfig`` of the same names)."""

    gamma: float = 0.99
    tau: float = 5e-3
    target_noise: float = 0.0
    target_noise_clip: float = 0.5
    bc_weight: float = 0.0


@dataclass(frozen=True)
class UpdateStats:
    """What an update reports, as detached tensors (no host sync): the losses it minimised,
    the critic's mean Q on the batch, and the new priorities ``|delta|`` of the batch's rows
    (the mean over the twin critics with ``twin_q``). ``actor_loss`` and ``bc_loss`` are
    ``None`` on critic-only updates (and ``bc_loss`` without demonstration rows)."""

    critic_loss: torch.Tensor
    q_mean: torch.Tensor
    priorities: torch.Tensor
    actor_loss: torch.Tensor | None = None
    bc_loss: torch.Tensor | None = None
    #: on a GPU with fused Adam: how many of this update's optimizer steps the device skipped
    #: for nan/inf gradients (a tensor, read by the learner once per call); None elsewhere
    #: (there a skipped step is logged as it happens)
    nonfinite: torch.Tensor | None = None


def ddpg_update(nets: DDPGNetworks, batch: Mapping[str, torch.Tensor], hp: UpdateParams,
                critic_opt: torch.optim.Optimizer, actor_opt: torch.optim.Optimizer, *,
                actor_step: bool) -> UpdateStats:
    """One gradient update of ``nets`` on ``batch`` (columns ``obs``, ``actions`` in
    [-1, 1], ``rewards``, ``new_obs``, ``terminateds``, optionally ``weights`` and ``demo``).
    ``critic_opt`` holds every critic's parameters, ``actor_opt`` the actor's. With
    ``actor_step`` (every ``policy_delay``-th update, TD3) the actor and the targets move too.
    Both losses are taken from the networks as they were before this update's steps."""
    # 1. the batch was sampled with priorities: its importance-sampling weights
    s, a, r = batch[Columns.OBS], batch[Columns.ACTIONS], batch[Columns.REWARDS]
    s2, done = batch[Columns.NEXT_OBS], batch[Columns.TERMINATEDS].float()
    w = batch[WEIGHTS] if WEIGHTS in batch else torch.ones_like(r)

    # 2. the TD target, with target policy smoothing and clipped double Q (TD3)
    with torch.no_grad():
        a2 = nets.target_pi(s2)
        if hp.target_noise > 0:
            eps = (hp.target_noise * torch.randn_like(a2)).clamp(-hp.target_noise_clip,
                                                                  hp.target_noise_clip)
            a2 = (a2 + eps).clamp(-1.0, 1.0)
        q2 = nets.target_qf(s2, a2)
        if nets.twin_q:
            q2 = torch.min(q2, nets.target_qf_twin(s2, a2))
        y = r + hp.gamma * (1.0 - done) * q2

    # 3. the critic(s): importance-weighted squared TD error
    q = nets.qf(s, a)
    td = y - q
    critic_loss = (w * td.pow(2)).mean()
    if nets.twin_q:
        td_twin = y - nets.qf_twin(s, a)
        critic_loss = critic_loss + (w * td_twin.pow(2)).mean()

    # 4. the new priorities of the sampled rows: |delta|, the mean over the twins (the replay
    #    adds its epsilon)
    priorities = td.detach().abs()
    if nets.twin_q:
        priorities = 0.5 * (priorities + td_twin.detach().abs())

    # 5. the actor (delayed): deterministic policy gradient through the critic, plus the
    #    Q-filtered behaviour cloning on demonstration rows
    actor_loss = bc = None
    if actor_step:
        pi = nets.pi(s)
        with _frozen(nets.qf):  # the gradient reaches the actor only
            q_pi = nets.qf(s, pi)
        actor_loss = -q_pi.mean()
        if hp.bc_weight > 0 and DEMO in batch:
            demo = batch[DEMO].float()
            keep = demo * (q.detach() > q_pi.detach()).float()
            bc = (keep * (pi - a).pow(2).sum(-1)).sum() / demo.sum().clamp(min=1.0)
            actor_loss = actor_loss + hp.bc_weight * bc

    # 6. the gradient steps
    _backward(critic_opt, critic_loss)
    if actor_loss is not None:
        _backward(actor_opt, actor_loss)
    skipped = [_step(critic_opt, "critic")]
    if actor_loss is not None:
        skipped.append(_step(actor_opt, "actor"))
    on_device = [f for f in skipped if f is not None]

    # 7. Polyak averaging of every target network, with the actor: target += tau (main - target)
    if actor_step:
        with torch.no_grad():
            for main, target in nets.get_target_network_pairs():
                torch._foreach_lerp_(list(target.parameters()), list(main.parameters()),
                                     hp.tau)

    return UpdateStats(critic_loss=critic_loss.detach(), q_mean=q.detach().mean(),
                       priorities=priorities,
                       actor_loss=None if actor_loss is None else actor_loss.detach(),
                       bc_loss=None if bc is None else bc.detach(),
                       nonfinite=torch.stack(on_device).sum() if on_device else None)


@contextmanager
def _frozen(net: nn.Module) -> Iterator[None]:
    """``net``'s parameters out of autograd for the block (its forward pass still
    propagates gradients to its inputs)."""
    params = list(net.parameters())
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, f in zip(params, flags):
            p.requires_grad_(f)


def _backward(opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    """Fresh gradients of ``loss`` for ``opt``'s parameters (``set_to_none``: a parameter
    the loss does not reach keeps ``grad=None`` and Adam leaves it and its moments alone)."""
    opt.zero_grad(set_to_none=True)
    loss.backward()


def _step(opt: torch.optim.Optimizer, name: str) -> torch.Tensor | None:
    """``opt.step()`` unless a gradient is nan or inf (one fused norm per optimizer): a
    non-finite step is skipped, keeping Adam's moments clean. On a GPU with fused Adam the
    skip happens on the device (the kernel's ``found_inf``, as in AMP's gradient scaler): no
    host sync, and the flag is returned for the caller to count; elsewhere the check syncs
    and a skip is logged at once (returns None)."""
    grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
    if not grads:
        return None
    bad = ~torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()
    if grads[0].is_cuda and opt.defaults.get("fused"):
        opt.found_inf = bad.float()  # type: ignore[attr-defined]
        try:
            opt.step()
        finally:
            opt.found_inf = None  # type: ignore[attr-defined]
        return bad.float()
    if bool(bad):
        logger.warning(f"{name}: nan/inf gradients, optimizer step skipped")
    else:
        opt.step()
    return None
