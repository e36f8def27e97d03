"""``smart/MulticastOverTime-v0``: one step places one arriving multicast group on a shared
service-node cluster where earlier groups are still active or have left, and the background
load follows the time of day.

A thin gymnasium wrapper over :mod:`envs.trees.timeline` (the arrivals, departures and
background) with the action coding of ``smart/MulticastTree-v0``
(:class:`envs.trees.env.MulticastTreeEnv`, which stays the per-group benchmark) or a compact
one (``action="knob"``).

## Description
Groups arrive as a Poisson process and stay for an exponential holding time the policy does
not know (Little's law: ``arrival_rate * mean_duration`` groups active on average). Before
each decision the clock moves to the group's arrival: the groups that left release their
load and every node's background follows its diurnal cycle. A group is scored over its
lifetime, ``integral (U_g - lambda sum_i w_i(t)) dt`` over its employed service nodes
(:mod:`envs.trees.timeline`): Algorithm 1 is optimal for the arriving group at the loads it
sees, not over the loads its nodes will carry while it stays.

## Action space
``action="nodes"`` (default), as ``smart/MulticastTree-v0``: ``Box(-1, 1, (M + 1,), float32)``,
a score per service node and a load knob ``a`` (``lambda_eff = lambda (1 + a) 2^a``); nodes
scored at or below ``exclude_below`` or without room are left out, the rest taken in
descending score by Algorithm 1.

``action="knob"``: ``Box(-1, 1, (2,), float32)``, the per-group choices of the one-step
rollout (:mod:`agents.trees.planner`) made continuous: ``a[0]`` blends the order, ``a[1]``
is the load knob. Every node with room is a candidate, taken by ascending
``(1 - u) w_now + u w_stay`` with ``u = (1 + a[0]) / 2``: ``w_now`` the current weights
(``a[0] = -1``: Algorithm 1's order), ``w_stay`` the expected weights over a stay of the mean
holding time (:func:`envs.trees.timeline.expected_weights`; ``a[0] = 1``: the ``lookahead``
baseline's order). Algorithm 1 then chooses how many of the first ones to employ with
``lambda_eff``. Per-node orders other than these blends cannot be expressed, so the
``random10``, ``nvp`` and ``binary`` baselines do not run in this mode.

## Observation space
``Box(0, 1, (M + 7,), float32)``: each node's workload over ``Omega``; the group's hypervisor
count and rate scaled to their ranges; the active groups over twice their steady-state mean
(clipped); the time of day as ``(1 + sin) / 2`` and ``(1 + cos) / 2`` of its phase; the mean
background over ``Omega``; and the fraction of the episode done.

## Reward
The value the active groups earn from this arrival to the next (to the last departure after
the last arrival), divided by ``reward_scale`` (default: largest hypervisor count times
largest rate times ``mean_duration``, so rewards are O(1)); the return is the sequence
objective over ``reward_scale``. A group no node has room for is dropped and earns nothing.

## Starting state
An empty cluster (no active group) at time 0 with fresh backgrounds and a fresh sequence,
drawn from ``self.np_random``.

## Episode end
Terminates after ``groups_per_episode`` arrivals; never truncated. The terminal ``info``
holds ``episode_metrics``: those of ``smart/MulticastTree-v0`` (``objective_gbps`` there is
objective (3) at each arrival, summed), ``value`` (the sequence objective, Gbps x time),
``bound`` (:func:`envs.trees.timeline.isolation_bound`, the same unit) and ``mean_active``.

## Arguments
Those of ``smart/MulticastTree-v0`` (here 60 groups per episode and a 4-16 Gbps background
by default) and ``arrival_rate`` (3 groups per unit of time),
``mean_duration`` (10), ``background_amplitude`` (0.5), ``period`` (100) and ``action``
(``"nodes"`` or ``"knob"``, above).

## Version history
* v0: initial version.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from gymnasium import spaces

from .env import MulticastTreeEnv, lam_multiplier
from .errors import MulticastError
from .groups import Placement
from .timeline import (
    SharedCluster,
    Timeline,
    TimelineSpec,
    check_peak,
    expected_weights,
    generate_timeline,
    isolation_bound,
)
from .tree import MulticastTree

__all__ = ["ACTIONS", "MulticastOverTimeEnv"]

#: the action codings (module docstring)
ACTIONS: tuple[str, ...] = ("nodes", "knob")


class MulticastOverTimeEnv(MulticastTreeEnv):
    __doc__ = __doc__

    def __init__(self, num_service_nodes: int = 16, groups_per_episode: int = 60,
                 hypervisors: Sequence[int] = (10, 100),
                 rate_gbps: Sequence[float] = (0.05, 0.8),
                 background_gbps: Sequence[float] = (4.0, 16.0), capacity_gbps: float = 32.0,
                 alpha: float = 1.0, lam: float = 1.0, switch: str = "cloning_cost",
                 variant: str = "exact", exclude_below: float = -0.9,
                 reward_scale: float | None = None, arrival_rate: float = 3.0,
                 mean_duration: float = 10.0, background_amplitude: float = 0.5,
                 period: float = 100.0, action: str = "nodes") -> None:
        scale = (reward_scale if reward_scale is not None
                 else float(hypervisors[1]) * float(rate_gbps[1]) * float(mean_duration))
        super().__init__(num_service_nodes, groups_per_episode, hypervisors, rate_gbps,
                         background_gbps, capacity_gbps, alpha, lam, switch, variant,
                         exclude_below, scale)
        self.timeline_spec = TimelineSpec(self.group_spec, float(arrival_rate),
                                          float(mean_duration), float(background_amplitude),
                                          float(period))
        check_peak(self.timeline_spec, self.cluster_spec)
        m = self.cluster_spec.num_service_nodes
        if action not in ACTIONS:
            raise MulticastError(f"action must be one of {ACTIONS}, got {action!r}")
        self.action_mode = action
        if action == "knob":
            self.action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.observation_space = spaces.Box(0.0, 1.0, (m + 7,), np.float32)
        self.timeline: Timeline | None = None
        self.shared: SharedCluster | None = None
        #: False: the terminal ``info`` carries no ``episode_metrics`` (a planner's trial
        #: copies read only the rewards; the isolation bound is most of a trial's last step)
        self.terminal_metrics = True

    @property
    def group(self) -> tuple[int, float]:
        assert self.timeline is not None, "call reset() first"
        return int(self.timeline.n[self.t]), float(self.timeline.rate_gbps[self.t])

    def _get_obs(self) -> np.ndarray:
        assert self.shared is not None and self.timeline is not None
        tl, s, cap = self.timeline, self.group_spec, self.cluster_spec.capacity_gbps
        t = min(self.t, len(tl) - 1)
        (nlo, nhi), (rlo, rhi) = s.hypervisors, s.rate_gbps
        steady = self.timeline_spec.arrival_rate * self.timeline_spec.mean_duration
        angle = 2.0 * math.pi * self.shared.now / tl.period
        extra = [(float(tl.n[t]) - nlo) / max(nhi - nlo, 1),
                 (float(tl.rate_gbps[t]) - rlo) / max(rhi - rlo, 1e-12),
                 len(self.shared.active) / (2.0 * steady),
                 (1.0 + math.sin(angle)) / 2.0, (1.0 + math.cos(angle)) / 2.0,
                 float(tl.background(self.shared.now).mean()) / cap, self.t / len(tl)]
        obs = np.concatenate([self.shared.state.loads / cap, extra])
        out: np.ndarray = np.clip(obs, 0.0, 1.0).astype(np.float32)
        return out

    def reset(self, *, seed: int | None = None, options: dict | None = None
              ) -> tuple[np.ndarray, dict]:
        super(MulticastTreeEnv, self).reset(seed=seed)
        self.timeline = generate_timeline(self.timeline_spec, self.cluster_spec,
                                          self.np_random)
        self.shared = SharedCluster(self.cluster_spec, self.switch, self.timeline)
        self.shared.advance(float(self.timeline.t[0]))
        self.cluster = self.shared.state
        self.groups = None
        self.t = 0
        self._log = []
        self._active_seen: list[int] = []
        self._value = 0.0
        return self._get_obs(), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        if self.shared is None or self.timeline is None or self.t >= len(self.timeline):
            raise MulticastError("step() called before reset() or after the episode ended")
        now, active = self.shared.now, len(self.shared.active)
        self._active_seen.append(active)
        _, info = self._place_group(action)
        info.update(time=now, active=active)
        self.t += 1
        done = self.t >= len(self.timeline)
        before = self.shared.departed
        value = (self.shared.drain() if done
                 else self.shared.advance(float(self.timeline.t[self.t])))
        self._value += value
        info.update(value=value, departed=self.shared.departed - before)
        if done and self.terminal_metrics:
            info["episode_metrics"] = self._episode_metrics()
        return self._get_obs(), float(value / self.reward_scale), done, False, info

    def decode(self, action: np.ndarray) -> tuple[np.ndarray, float]:
        """``(ordered candidate ids, lambda_eff)`` for ``action`` in either coding (module
        docstring)."""
        if self.action_mode == "nodes":
            return super().decode(action)
        assert self.shared is not None and self.timeline is not None
        a = np.clip(np.asarray(action, dtype=float).reshape(-1), -1.0, 1.0)
        if a.shape != self.action_space.shape:
            raise MulticastError(f"action has shape {a.shape}, expected "
                                 f"{self.action_space.shape}")
        avail = self.shared.state.available(self.group[1])
        lam_eff = self.cluster_spec.lam * lam_multiplier(float(a[1]))
        if len(avail) == 0:
            return avail, 0.0
        u = (1.0 + float(a[0])) / 2.0
        key = self.shared.state.weights()[avail]
        if u > 0.0:
            sh = self.shared
            stay = expected_weights(self.timeline, self.cluster_spec, sh.now, sh.group_load,
                                    self.timeline_spec.mean_duration)[avail]
            key = stay if u >= 1.0 else (1.0 - u) * key + u * stay
        return avail[np.argsort(key, kind="stable")], lam_eff

    def _place_tree(self, tree: MulticastTree, r: float) -> Placement:
        """Put ``tree`` on the shared cluster until the group's departure."""
        assert self.shared is not None
        return self.shared.place(self.t, tree, r)

    def _episode_metrics(self) -> dict[str, float]:
        assert self.timeline is not None
        out = super()._episode_metrics()
        out["value"] = self._value
        out["bound"] = float(isolation_bound(self.timeline, self.cluster_spec, self.switch,
                                             self.variant).sum())
        out["mean_active"] = float(np.mean(self._active_seen)) if self._active_seen else 0.0
        return out
