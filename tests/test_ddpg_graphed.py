"""The DDPG update from CUDA graphs (agents/ddpg/graphed.py): eager where there is no GPU,
and on a GPU the same parameters as the eager update after the same batches (the GPU tests
run where torch sees one: `python -m pytest tests/test_ddpg_graphed.py` on a GPU machine)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("ray")

from agents.ddpg.graphed import GraphedUpdate
from agents.ddpg.learner import _adam
from agents.ddpg.networks import MLPCritic, mlp
from agents.ddpg.update import DEMO, WEIGHTS, UpdateParams, ddpg_update

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Nets(nn.Module):
    """Actor, twin critics and their targets, as the RL module holds them."""

    twin_q = True

    def __init__(self, obs: int = 6, act: int = 3) -> None:
        super().__init__()
        self.pi = mlp(obs, [32, 32], act, nn.Tanh())
        self.qf, self.qf_twin = MLPCritic(obs, act, [32, 32]), MLPCritic(obs, act, [32, 32])
        self.target_pi = copy.deepcopy(self.pi)
        self.target_qf, self.target_qf_twin = copy.deepcopy(self.qf), copy.deepcopy(self.qf_twin)

    def get_target_network_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        return [(self.pi, self.target_pi), (self.qf, self.target_qf),
                (self.qf_twin, self.target_qf_twin)]


def _batches(n: int, device: str, rows: int = 64, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        b = {"obs": torch.rand(rows, 6, generator=g), "actions": torch.rand(rows, 3, generator=g),
             "rewards": torch.randn(rows, generator=g),
             "new_obs": torch.rand(rows, 6, generator=g),
             "terminateds": (torch.rand(rows, generator=g) < 0.1).float(),
             WEIGHTS: torch.rand(rows, generator=g),
             DEMO: (torch.arange(rows) >= rows * 3 // 4).float()}
        out.append({k: v.to(device) for k, v in b.items()})
    return out


def _optimizers(nets: Nets) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    return (_adam([*nets.qf.parameters(), *nets.qf_twin.parameters()], 0.0),
            _adam(nets.pi.parameters(), 0.0))


HP = UpdateParams(gamma=0.9, tau=0.05, target_noise=0.0, bc_weight=1.0)


def test_eager_on_the_cpu():
    torch.manual_seed(0)
    a = Nets()
    b = copy.deepcopy(a)
    oa, ob = _optimizers(a), _optimizers(b)
    graphed = GraphedUpdate()
    for i, batch in enumerate(_batches(4, "cpu")):
        sa = ddpg_update(a, batch, HP, *oa, actor_step=i % 2 == 0)
        sb = graphed(b, batch, HP, *ob, actor_step=i % 2 == 0)
        torch.testing.assert_close(sa.priorities, sb.priorities, rtol=0, atol=0)
    assert graphed.captured == 0
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


@gpu
def test_graphs_match_the_eager_update_on_the_gpu():
    torch.manual_seed(0)
    a = Nets().cuda()
    b = copy.deepcopy(a)
    oa, ob = _optimizers(a), _optimizers(b)
    graphed = GraphedUpdate()
    for i, batch in enumerate(_batches(8, "cuda")):
        actor = i >= 2 and i % 2 == 0  # critic-only first (no actor state yet), then TD3
        sa = ddpg_update(a, batch, HP, *oa, actor_step=actor)
        sb = graphed(b, batch, HP, *ob, actor_step=actor)
        torch.testing.assert_close(sa.priorities, sb.priorities, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(sa.critic_loss, sb.critic_loss, rtol=1e-4, atol=1e-5)
    assert graphed.captured == 2  # the critic-only and the actor update
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-5)


@gpu
def test_a_non_finite_gradient_skips_the_step_on_the_device():
    torch.manual_seed(0)
    nets = Nets().cuda()
    opts = _optimizers(nets)
    graphed = GraphedUpdate()
    good, bad = _batches(2, "cuda")
    graphed(nets, good, HP, *opts, actor_step=False)  # captured and replayed once
    before = [p.detach().clone() for p in nets.qf.parameters()]
    bad["rewards"][0] = float("nan")
    stats = graphed(nets, bad, HP, *opts, actor_step=False)
    assert graphed.captured == 1 and int(stats.nonfinite.item()) == 1
    for p, q in zip(nets.qf.parameters(), before, strict=True):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0)
    stats = graphed(nets, good, HP, *opts, actor_step=False)  # and the next one steps
    assert int(stats.nonfinite.item()) == 0
    assert any(not torch.equal(p.detach(), q) for p, q in zip(nets.qf.parameters(), before,
                                                                strict=True))
