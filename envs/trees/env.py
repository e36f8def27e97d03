"""``smart/MulticastTree-v0``: one step places one multicast group (a source hypervisor with
its receivers; the paper calls it a "session") on a service-node cluster.

A thin gymnasium wrapper over :mod:`envs.trees.groups` (cluster state, group generator) and
the solver of :mod:`envs.trees.solver` (Optimal Multicast, Zhu et al., Section VI).

## Description
Groups join one after another (Section VII-B) and load the service nodes they employ
(a node's workload grows by the rate it receives). Algorithm 1 is optimal for each group
given the current loads (objective (3)), but a choice also changes the weights
``w = -alpha log(1 - omega / Omega)`` every later group pays, so the per-group optimum is
not necessarily the best over the sequence. The agent picks which service nodes the group
may use, in which order, and how strongly to penalise load; the tree is then built by
Algorithm 1 over that order (``k*`` by objective (3)'s value, the min-height optimal tree).

## Action space
``Box(-1, 1, (M + 1,), float32)``: a score per service node and a load knob ``a``.
Nodes with a score ``<= exclude_below`` (-0.9) or without room for the group's rate are
left out (if that leaves none, the available node with the highest score is used); the rest
are taken in descending score (ties by id) and Algorithm 1 chooses how many of the first
ones to employ with ``lambda_eff = lambda (1 + a) 2^a`` (``a = 0``: the paper's ``lambda``;
``a = -1``: no load penalty). :meth:`MulticastTreeEnv.encode` turns an ordered node list and a
knob into an action (Algorithm 1 itself: nodes by ascending weight, ``a = 0``).

## Observation space
``Box(0, 1, (M + 3,), float32)``: each node's workload over ``Omega``, then the group's
hypervisor count and rate scaled to their ranges, and the fraction of the episode done.

## Reward
Objective (3) of the group's tree with the configured ``lambda`` (service-node throughput
in Gbps minus ``lambda`` times the employed nodes' weights), divided by ``reward_scale``
(default: largest hypervisor count times largest rate, so rewards are O(1)). A group no
node has room for is dropped with reward 0.

## Starting state
Background workloads uniform in ``background_gbps``; a fresh group sequence. Both are drawn
from ``self.np_random``.

## Episode end
Terminates after ``groups_per_episode`` groups; never truncated. The terminal ``info``
holds ``episode_metrics``: ``objective_gbps`` (sum of (3)), ``mean_ratio``,
``full_ratio_frac``, ``mean_k``, ``dropped``, ``load_std_gbps``, ``load_max_frac``,
``mean_penalty``.

## Arguments
``num_service_nodes`` (16), ``groups_per_episode`` (30), ``hypervisors`` ((10, 100)),
``rate_gbps`` ((0.05, 0.8)), ``background_gbps`` ((8, 24)), ``capacity_gbps`` (32),
``alpha`` (1), ``lam`` (1), ``switch`` (``"cloning_cost"`` or ``"profile:<name>"``),
``variant`` (``"exact"`` or ``"paper"``), ``exclude_below`` (-0.9), ``reward_scale``.

## Version history
* v0: initial version.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from .errors import MulticastError
from .groups import (
    ClusterSpec,
    ClusterState,
    Groups,
    GroupSpec,
    Placement,
    background_loads,
    generate_groups,
)
from .solver import algorithm1_ordered
from .switch import switch_from_spec
from .tree import MulticastTree

__all__ = ["MulticastTreeEnv", "lam_multiplier"]


def lam_multiplier(a: float) -> float:
    """``(1 + a) 2^a``: 0 at ``a = -1``, 1 at ``a = 0``, 4 at ``a = 1`` (increasing)."""
    m: float = (1.0 + a) * 2.0 ** a
    return m


class MulticastTreeEnv(gym.Env):
    __doc__ = __doc__
    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 as gymnasium.Env declares it

    def __init__(self, num_service_nodes: int = 16, groups_per_episode: int = 30,
                 hypervisors: Sequence[int] = (10, 100),
                 rate_gbps: Sequence[float] = (0.05, 0.8),
                 background_gbps: Sequence[float] = (8.0, 24.0), capacity_gbps: float = 32.0,
                 alpha: float = 1.0, lam: float = 1.0, switch: str = "cloning_cost",
                 variant: str = "exact", exclude_below: float = -0.9,
                 reward_scale: float | None = None) -> None:
        super().__init__()
        # the specs check that each range is a (low, high) pair
        self.cluster_spec = ClusterSpec(int(num_service_nodes),
                                        cast("tuple[float, float]", tuple(background_gbps)),
                                        float(capacity_gbps), float(alpha), float(lam))
        self.group_spec = GroupSpec(int(groups_per_episode),
                                    cast("tuple[int, int]", tuple(hypervisors)),
                                    cast("tuple[float, float]", tuple(rate_gbps)))
        if variant not in ("exact", "paper"):
            raise MulticastError(f"variant must be 'exact' or 'paper', got {variant!r}")
        if not -1.0 <= exclude_below < 1.0:
            raise MulticastError(f"exclude_below must lie in [-1, 1), got {exclude_below}")
        self.switch = switch_from_spec(switch)
        self.variant, self.exclude_below = variant, float(exclude_below)
        self.reward_scale = float(reward_scale if reward_scale is not None
                                  else hypervisors[1] * rate_gbps[1])
        if not self.reward_scale > 0:
            raise MulticastError(f"reward_scale must be > 0, got {self.reward_scale}")
        m = self.cluster_spec.num_service_nodes
        self.action_space = spaces.Box(-1.0, 1.0, (m + 1,), np.float32)
        self.observation_space = spaces.Box(0.0, 1.0, (m + 3,), np.float32)
        self.cluster: ClusterState | None = None
        self.groups: Groups | None = None
        self.t = 0
        self._log: list[Placement | None] = []

    # -- the group being decided ---------------------------------------------------------
    @property
    def group(self) -> tuple[int, float]:
        """``(n, r)`` of the group the next action places."""
        assert self.groups is not None, "call reset() first"
        return int(self.groups.n[self.t]), float(self.groups.rate_gbps[self.t])

    def _get_obs(self) -> np.ndarray:
        assert self.cluster is not None and self.groups is not None
        s = self.group_spec
        t = min(self.t, len(self.groups) - 1)
        (nlo, nhi), (rlo, rhi) = s.hypervisors, s.rate_gbps
        n, r = float(self.groups.n[t]), float(self.groups.rate_gbps[t])
        extra = [(n - nlo) / max(nhi - nlo, 1), (r - rlo) / max(rhi - rlo, 1e-12),
                 self.t / len(self.groups)]
        obs = np.concatenate([self.cluster.loads / self.cluster_spec.capacity_gbps, extra])
        out: np.ndarray = np.clip(obs, 0.0, 1.0).astype(np.float32)
        return out

    # -- action coding ---------------------------------------------------------------------
    def encode(self, ordered_ids: Sequence[int], knob: float = 0.0) -> np.ndarray:
        """The action that makes the env use ``ordered_ids`` (first = most preferred) and
        no other node, with load knob ``knob``."""
        m = self.cluster_spec.num_service_nodes
        ids = np.asarray(ordered_ids, dtype=np.int64)
        a = np.full(m + 1, -1.0, dtype=np.float32)
        lo = self.exclude_below + 0.05
        a[ids] = np.linspace(1.0, lo, max(len(ids), 2))[:len(ids)]
        a[m] = knob
        return a

    def decode(self, action: np.ndarray) -> tuple[np.ndarray, float]:
        """``(ordered candidate ids, lambda_eff)`` for ``action`` (see the docstring)."""
        assert self.cluster is not None
        a = np.clip(np.asarray(action, dtype=float).reshape(-1), -1.0, 1.0)
        if a.shape != self.action_space.shape:
            raise MulticastError(f"action has shape {a.shape}, expected "
                                 f"{self.action_space.shape}")
        scores, knob = a[:-1], float(a[-1])
        avail = self.cluster.available(self.group[1])
        if len(avail) == 0:
            return avail, 0.0
        cand = avail[scores[avail] > self.exclude_below]
        if len(cand) == 0:
            cand = avail[[int(np.argmax(scores[avail]))]]
        order = cand[np.argsort(-scores[cand], kind="stable")]
        return order, self.cluster_spec.lam * lam_multiplier(knob)

    # -- gymnasium API -----------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None
              ) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.cluster = ClusterState(self.cluster_spec, self.switch,
                                    background_loads(self.cluster_spec, self.np_random))
        self.groups = generate_groups(self.group_spec, self.np_random)
        self.t = 0
        self._log = []
        return self._get_obs(), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        if self.cluster is None or self.groups is None or self.t >= len(self.groups):
            raise MulticastError("step() called before reset() or after the episode ended")
        placement, info = self._place_group(action)
        reward = 0.0 if placement is None else placement.objective / self.reward_scale
        self.t += 1
        done = self.t >= len(self.groups)
        if done:
            info["episode_metrics"] = self._episode_metrics()
        return self._get_obs(), float(reward), done, False, info

    def _place_group(self, action: np.ndarray) -> tuple[Placement | None, dict[str, Any]]:
        """The group of step ``self.t`` placed as ``action`` says (Algorithm 1 over the
        decoded order at the current weights; None when no node has room), logged, and the
        step's ``info`` so far."""
        assert self.cluster is not None
        n, r = self.group
        order, lam_eff = self.decode(action)
        info: dict[str, Any] = {"group": self.t, "hypervisors": n, "rate_gbps": r,
                                "lam_eff": lam_eff}
        placement: Placement | None = None
        if len(order) == 0:
            info.update(dropped=True, k=0)
        else:
            res = algorithm1_ordered(n, r, order, self.cluster.weights(), self.switch,
                                     lam_eff, self.variant)
            placement = self._place_tree(res.tree, r)
            info.update(dropped=False, k=placement.k, objective_gbps=placement.objective,
                        ratio=placement.ratio)
        self._log.append(placement)
        return placement, info

    def _place_tree(self, tree: MulticastTree, r: float) -> Placement:
        """Put ``tree`` on the cluster (its loads stay for the episode)."""
        assert self.cluster is not None
        return self.cluster.place(tree, r)

    def _episode_metrics(self) -> dict[str, float]:
        assert self.cluster is not None
        placed = [p for p in self._log if p is not None]
        loads = self.cluster.loads

        def mean(values: list[float]) -> float:
            return float(np.mean(values)) if values else 0.0

        return {"objective_gbps": float(sum(p.objective for p in placed)),
                "mean_ratio": mean([p.ratio for p in placed]),
                "full_ratio_frac": mean([float(p.ratio >= 1 - 1e-9) for p in placed]),
                "mean_k": mean([float(p.k) for p in placed]),
                "mean_penalty": mean([p.penalty for p in placed]),
                "dropped": float(len(self._log) - len(placed)),
                "load_std_gbps": float(loads.std()),
                "load_max_frac": float(loads.max() / self.cluster_spec.capacity_gbps)}
