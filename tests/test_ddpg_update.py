"""``agents.ddpg.update.ddpg_update`` on a hand-made batch against hand-computed targets,
losses, priorities, steps and target averaging.

The networks are one weight each, so every number below is worked out by hand:
``pi(s) = tanh(w s)``, ``Q(s, a) = c1 s + c2 a``; plain SGD with learning rate 1, so an
optimizer step is ``param -= grad``.
"""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("ray")

from agents.ddpg.update import UpdateParams, ddpg_update


class LinearQ(nn.Module):
    """``Q(s, a) = c1 s + c2 a`` (recording the actions it is asked about)."""

    def __init__(self, c1: float, c2: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([c1, c2]))
        self.seen: list[torch.Tensor] = []

    def forward(self, s: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        self.seen.append(a.detach().clone())
        return self.w[0] * s[:, 0] + self.w[1] * a[:, 0]


class TanhPolicy(nn.Module):
    def __init__(self, w: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(w))

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.w * s)


def _nets(twin: bool = False) -> SimpleNamespace:
    n = SimpleNamespace(twin_q=twin, pi=TanhPolicy(-1.0), qf=LinearQ(0.5, 1.0),
                        target_pi=TanhPolicy(0.5), target_qf=LinearQ(1.0, 2.0))
    pairs = [(n.pi, n.target_pi), (n.qf, n.target_qf)]
    if twin:
        n.qf_twin, n.target_qf_twin = LinearQ(0.0, 1.0), LinearQ(1.0, 0.0)
        pairs.append((n.qf_twin, n.target_qf_twin))
    n.get_target_network_pairs = lambda: pairs
    return n


def _batch(**extra) -> dict[str, torch.Tensor]:
    t = torch.tensor
    return {"obs": t([[1.0], [2.0]]), "actions": t([[0.5], [-0.5]]), "rewards": t([1.0, 0.0]),
            "new_obs": t([[0.0], [1.0]]), "terminateds": t([0.0, 1.0]),
            "weights": t([1.0, 0.5]), **extra}


def _sgd(*nets: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD([p for n in nets for p in n.parameters()], lr=1.0)


def _run(nets, batch, hp, actor_step):
    return ddpg_update(nets, batch, hp, _sgd(nets.qf, *([nets.qf_twin] if nets.twin_q else [])),
                       _sgd(nets.pi), actor_step=actor_step)


def test_critic_update_by_hand():
    nets = _nets()
    stats = _run(nets, _batch(), UpdateParams(gamma=0.9, tau=0.1), actor_step=False)
    # target: row 1 r + gamma Q'(0, tanh(0)) = 1 + 0.9 * 0 = 1; row 2 is terminal: y = 0
    # Q(s, a) = [0.5 + 0.5, 1.0 - 0.5] = [1.0, 0.5]; td = y - Q = [0, -0.5]
    # loss = mean(w td^2) = (1 * 0 + 0.5 * 0.25) / 2
    assert stats.critic_loss.item() == pytest.approx(0.0625)
    assert stats.q_mean.item() == pytest.approx(0.75)
    torch.testing.assert_close(stats.priorities, torch.tensor([0.0, 0.5]))
    # dL/dc1 = mean(w 2 td (-s)) = (0.5 * 2 * -0.5 * -2) / 2 = 0.5
    # dL/dc2 = mean(w 2 td (-a)) = (0.5 * 2 * -0.5 * 0.5) / 2 = -0.125
    torch.testing.assert_close(nets.qf.w.detach(), torch.tensor([0.0, 1.125]))
    # a critic-only update: no actor loss, the actor and every target stay
    assert stats.actor_loss is None and stats.bc_loss is None
    assert nets.pi.w.item() == -1.0 and nets.target_pi.w.item() == 0.5
    torch.testing.assert_close(nets.target_qf.w.detach(), torch.tensor([1.0, 2.0]))


def test_actor_step_with_q_filtered_cloning_and_polyak_by_hand():
    nets = _nets()
    batch = _batch(demo=torch.tensor([0.0, 1.0]))
    stats = _run(nets, batch, UpdateParams(gamma=0.9, tau=0.1, bc_weight=2.0), actor_step=True)
    t1, t2 = math.tanh(1.0), math.tanh(2.0)
    # pi(s) = tanh(-s) = [-t1, -t2]; Q(s, pi(s)) with the critic before its step:
    q_pi = [0.5 - t1, 1.0 - t2]
    # the demonstration row (2): Q(s, a) = 0.5 > Q(s, pi(s)) = 1 - t2, so it is kept
    bc = (-t2 + 0.5) ** 2
    assert stats.bc_loss.item() == pytest.approx(bc, rel=1e-6)
    assert stats.actor_loss.item() == pytest.approx(-(q_pi[0] + q_pi[1]) / 2 + 2.0 * bc,
                                                    rel=1e-6)
    # d/dw of -mean(0.5 s + tanh(w s)) at w = -1: -mean(s (1 - tanh^2(s)))
    # d/dw of 2 (tanh(w s2) - a2)^2: 2 * 2 (-t2 + 0.5) s2 (1 - t2^2)
    grad = (-(1.0 * (1 - t1 ** 2) + 2.0 * (1 - t2 ** 2)) / 2
            + 4.0 * (-t2 + 0.5) * 2.0 * (1 - t2 ** 2))
    w_pi = -1.0 - grad
    assert nets.pi.w.item() == pytest.approx(w_pi, rel=1e-6)
    # the critic's step is its own loss's (the actor's loss does not reach it)
    torch.testing.assert_close(nets.qf.w.detach(), torch.tensor([0.0, 1.125]))
    # Polyak with tau = 0.1 toward the stepped networks
    assert nets.target_pi.w.item() == pytest.approx(0.5 + 0.1 * (w_pi - 0.5), rel=1e-6)
    torch.testing.assert_close(nets.target_qf.w.detach(),
                               torch.tensor([1.0 + 0.1 * (0.0 - 1.0), 2.0 + 0.1 * (1.125 - 2.0)]))
    assert all(p.requires_grad for p in nets.qf.parameters())  # unfrozen after the actor pass


def test_q_filter_drops_demonstrations_the_critic_rates_below_the_actor():
    nets = _nets()
    nets.pi.w.data.fill_(1.0)  # pi(s) = tanh(s): Q(s, pi(s)) = [0.5 + t1, 1 + t2] > Q(s, a)
    stats = _run(nets, _batch(demo=torch.tensor([1.0, 1.0])),
                 UpdateParams(gamma=0.9, tau=0.1, bc_weight=2.0), actor_step=True)
    assert stats.bc_loss.item() == 0.0


def test_twin_critics_and_target_smoothing():
    nets = _nets(twin=True)
    hp = UpdateParams(gamma=0.9, tau=0.1, target_noise=100.0, target_noise_clip=0.3)
    torch.manual_seed(0)
    stats = _run(nets, _batch(), hp, actor_step=False)
    # target actions: tanh(0.5 s2) = [0, tanh(0.5)] moved by exactly +-0.3 (the clip),
    # then clamped to [-1, 1]
    base = torch.tensor([0.0, math.tanh(0.5)])
    a2 = nets.target_qf.seen[0][:, 0]
    assert torch.allclose((a2 - base).abs(), torch.full((2,), 0.3))
    torch.testing.assert_close(nets.target_qf_twin.seen[0], nets.target_qf.seen[0])
    # row 1's target: 1 + 0.9 min(Q1'(0, a), Q2'(0, a)) = 1 + 0.9 min(2a, 0)
    y1 = 1.0 + 0.9 * min(2.0 * a2[0].item(), 0.0)
    # td of the two critics: Q1 = [1.0, 0.5], Q2 = c2 a = [0.5, -0.5]; row 2's y is 0
    td1, td2 = [y1 - 1.0, -0.5], [y1 - 0.5, 0.5]
    torch.testing.assert_close(stats.priorities, torch.tensor(
        [(abs(td1[0]) + abs(td2[0])) / 2, (abs(td1[1]) + abs(td2[1])) / 2]))
    w = [1.0, 0.5]
    loss = sum(w[i] * (td1[i] ** 2 + td2[i] ** 2) for i in range(2)) / 2
    assert stats.critic_loss.item() == pytest.approx(loss, rel=1e-6)


def test_non_finite_gradients_skip_the_step(caplog):
    nets = _nets()
    batch = _batch()
    batch["rewards"] = torch.tensor([float("nan"), 0.0])
    with caplog.at_level(logging.WARNING, logger="agents.ddpg.update"):
        _run(nets, batch, UpdateParams(), actor_step=False)
    torch.testing.assert_close(nets.qf.w.detach(), torch.tensor([0.5, 1.0]))
    assert "critic: nan/inf gradients" in caplog.text
