"""``smart/PathShaping-v0``: an agent sets the per-class limits of the controller's tenant
shaper on its sending path.

A thin gymnasium wrapper over :class:`delivery.sending_sim.PathSimulation`: the real
:class:`delivery.fairness.TenantShaper` on a simulated clock in front of the controller's
outbox and push rounds (constants fitted and validated on the real path:
``bench/bench_fairness_fidelity.py``), plus a link of ``G`` bytes/s from the controller to
the nodes that push rounds cross in order (the controller's egress at its capacity: the
place where shaping can pay; without it nothing on the path waits, see ``docs/shaping.md``).
Where Sincon's calculator (Section III-A) sets the class limits by its fixed rule, here a
policy sets them once per ``period_s``; the delay-based shaper of Section III-B enforces them
in both cases.

## Description
``tenants`` tenants send to ``nodes`` nodes. Each streams ``rate_hz`` small messages/s (its
setups: delay-sensitive) for ``duration_s`` s from a class of its own, and hands the
controller bursts from another class (``workload="split"``; ``"same"``: one class per tenant
for both): a Poisson number (``burst_rate_hz`` per tenant) at uniform times, each of about
``burst_messages`` messages (uniform within +-50%), all drawn from the episode's seed. An
episode is ``duration_s`` of traffic, one step per ``period_s``; at the last step what is
still queued is delivered with the limits then in force.

## Action space
``Box(-1, 1, (C,), float32)``: one value per class (``split``: the tenants' burst classes,
then their setup classes; ``same``: one per tenant). Value ``a`` sets the class's limit
``L = G * eps ** (1 - (a + 1) / 2)`` (log scale), ``eps = min_limit_share``: ``a = -1`` gives
``eps * G``, ``a = +1`` gives ``G`` (the class may take the whole link). The limits may add
up to more than ``G`` (the link then queues). :meth:`PathShapingEnv.encode_limits` is the
exact inverse.

## Observation space
``Box(0, 1, (3C + 2,), float32)``: per class the bytes released in the last period / (G x
period), the bytes queued in the shaper / (G x ``queue_ref_s``) (clipped at 1), the limit in
force (its decoded ``(a + 1) / 2``); then the deliveries accepted but not yet applied (the
outbox and the push rounds) / (G x ``queue_ref_s`` / size), clipped at 1; the elapsed
fraction of the episode.

## Reward
Per step: ``-(setup_weight * W_setup + W_burst) / (period * R * delay_ref_s)``, where ``W``
are the delivery-seconds of waiting the setups and the bursts accrued during the period
(Little's law: the sum of their delays), ``R = nodes * tenants * rate_hz`` the setup
deliveries per second. ``W_setup / (period * R)`` is the setups' mean delay, so the penalty is
about ``setup_weight * mean setup delay / delay_ref_s`` plus the bursts' queue in setup
units. The terminal step adds the waiting until everything is delivered. Defaults:
``setup_weight = 10``, ``delay_ref_s = 1``.

## Starting state
Every limit at ``G / C``.

## Episode end
Terminates after ``duration_s / period_s`` steps; never truncated. The terminal step's
``info["episode_metrics"]``: the setups' mean and p95 delay and the bursts' (ms), the bursts'
mean time to drain (s), Jain's index over the tenants of their bursts' mean delay
(fairness), and the mean penalty per step.

## Arguments
``tenants``, ``workload``, ``duration_s``, ``period_s``, ``global_throughput_Bps``,
``link`` (a link of ``G``; False: none), ``rate_hz``, ``burst_rate_hz``, ``burst_messages``,
``nodes``, ``size``, ``min_limit_share``, ``queue_ref_s``, ``reward`` (``setup_weight``,
``delay_ref_s``), ``costs`` (a path to the constants' file; None: the committed one).

## Version history
* v0: initial version.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from delivery.sending_sim import BURST, STREAM, PathSimulation, PathWorkload, SendingCosts

from .env import episode_settings, jain_index, limit_code, limits_of_action
from .sincon import ExternalLimits, ShapingError

__all__ = ["PATH_REWARD_DEFAULTS", "PathShapingEnv"]

PATH_REWARD_DEFAULTS = {"setup_weight": 10.0, "delay_ref_s": 1.0}
SETUP_VPC = 100  # tenant k's setups come from VPC 100 + k (workload "split")


class PathShapingEnv(gym.Env):
    __doc__ = __doc__
    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 as gymnasium.Env declares it

    def __init__(self, tenants: int = 4, workload: str = "split", duration_s: float = 5.0,
                 period_s: float = 0.25, global_throughput_Bps: float = 200_000.0,
                 link: bool = True, rate_hz: float = 20.0, burst_rate_hz: float = 0.4,
                 burst_messages: int = 400, nodes: int = 4, size: int = 128,
                 min_limit_share: float = 0.01, queue_ref_s: float = 1.0,
                 reward: Mapping[str, float] | None = None,
                 costs: str | None = None) -> None:
        super().__init__()
        if isinstance(tenants, bool) or not isinstance(tenants, int) or tenants < 1:
            raise ShapingError(f"PathShapingEnv: tenants must be a whole number >= 1, got "
                               f"{tenants!r}")
        if workload not in ("split", "same"):
            raise ShapingError(f"PathShapingEnv: workload must be 'split' or 'same', got "
                               f"{workload!r}")
        for name, v in (("global_throughput_Bps", global_throughput_Bps),
                        ("burst_rate_hz", burst_rate_hz), ("queue_ref_s", queue_ref_s)):
            if isinstance(v, bool) or not isinstance(v, int | float) or not (
                    v >= 0 if name == "burst_rate_hz" else v > 0) or not math.isfinite(v):
                raise ShapingError(f"PathShapingEnv: {name} must be a positive number, got "
                                   f"{v!r}")
        if isinstance(burst_messages, bool) or not isinstance(burst_messages, int) \
                or burst_messages < 1:
            raise ShapingError(f"PathShapingEnv: burst_messages must be a whole number >= 1, "
                               f"got {burst_messages!r}")
        self.reward_cfg, self.steps = episode_settings(
            "PathShapingEnv", reward, PATH_REWARD_DEFAULTS, duration_s, period_s,
            min_limit_share)
        # validates rate_hz, duration_s, size and nodes
        self._template = PathWorkload(rate_hz=rate_hz, duration_s=duration_s, size=size,
                                      nodes=nodes)
        self.costs = SendingCosts.load(costs) if costs else SendingCosts.load()
        self.tenants, self.workload = int(tenants), str(workload)
        self.period, self.duration = float(period_s), float(duration_s)
        self.g = float(global_throughput_Bps)
        self.link = bool(link)
        self.burst_rate, self.burst_messages = float(burst_rate_hz), int(burst_messages)
        self.eps, self.queue_ref_s = float(min_limit_share), float(queue_ref_s)
        t = self.tenants
        self.burst_vpcs = [k + 1 for k in range(t)]
        self.setup_vpcs = ([SETUP_VPC + k for k in range(t)] if workload == "split"
                           else list(self.burst_vpcs))
        vpcs = self.burst_vpcs + (self.setup_vpcs if workload == "split" else [])
        self.tenant_class = {v: i for i, v in enumerate(vpcs)}
        self.n = len(vpcs)
        self.setup_rate = nodes * t * float(rate_hz)   # setup deliveries per second
        self.action_space = spaces.Box(-1.0, 1.0, (self.n,), np.float32)
        self.observation_space = spaces.Box(0.0, 1.0, (3 * self.n + 2,), np.float32)
        self.sim: PathSimulation | None = None
        self.t = 0

    # ---- action <-> limits ---------------------------------------------------------------
    def decode_action(self, action: np.ndarray) -> np.ndarray:
        """The class limits (bytes/s) of an action."""
        a = np.asarray(action, dtype=np.float64).reshape(-1)
        if a.shape != (self.n,) or not np.all(np.isfinite(a)):
            raise ShapingError(f"PathShapingEnv: action must be {self.n} finite values, got "
                               f"shape {np.shape(action)}")
        return limits_of_action(a, self.g, self.eps)

    def encode_limits(self, limits: np.ndarray) -> np.ndarray:
        """The action that sets ``limits`` (clipped to ``[eps G, G]``)."""
        lim = np.asarray(limits, dtype=np.float64).reshape(-1)
        if lim.shape != (self.n,):
            raise ShapingError(f"PathShapingEnv.encode_limits: expected {self.n} limits, got "
                               f"shape {np.shape(limits)}")
        u = limit_code(lim, self.g, self.eps)
        return np.clip(2.0 * u - 1.0, -1.0, 1.0).astype(np.float32)

    # ---- the episode's workload ----------------------------------------------------------
    def _draw_workload(self) -> PathWorkload:
        g = self.np_random
        bursts = []
        for v in self.burst_vpcs:
            for _ in range(int(g.poisson(self.burst_rate * self.duration))):
                m = self.burst_messages
                n = int(g.integers(max(1, m // 2), m + m // 2 + 1))
                at = round(float(g.uniform(0.0, self.duration)), 6)
                bursts.append((v, n, at))
        bursts.sort(key=lambda b: (b[2], b[0]))
        w = self._template
        return PathWorkload(bursts=tuple(bursts), streams=tuple(self.setup_vpcs),
                            rate_hz=w.rate_hz, duration_s=w.duration_s, size=w.size,
                            nodes=w.nodes)

    # ---- gymnasium -----------------------------------------------------------------------
    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.current = self._draw_workload()
        self.sim, self.limits = self.simulation(self.current)
        self.t = 0
        self._released = np.zeros(self.n)
        self._last_released = np.zeros(self.n)
        self._pen_sum = 0.0
        return self._obs(), {"bursts": len(self.current.bursts)}

    def simulation(self, workload: PathWorkload) -> tuple[PathSimulation, ExternalLimits]:
        """``workload`` on this environment's path (its classes, cap and link), with the
        class limits set from outside (returned; every limit starts at ``G / C``)."""
        shaping = {"enabled": True, "policy": "static", "classes": self.n,
                   "tenant_class": self.tenant_class, "global_throughput_Bps": self.g}
        sim = PathSimulation(workload, shaping, self.costs,
                             link_Bps=self.g if self.link else None)
        assert sim.shaper is not None
        limits = ExternalLimits(self.n, self.g)
        sim.shaper.limits.policy = limits
        return sim, limits

    @property
    def size(self) -> int:
        """Payload bytes per message."""
        return self._template.size

    def class_bytes(self) -> tuple[np.ndarray, np.ndarray]:
        """(bytes released so far, bytes queued in the shaper) per class."""
        assert self.sim is not None and self.sim.shaper is not None
        st = self.sim.shaper.stats()
        rel = np.array([float(st[c]["bytes"]) for c in range(self.n)])
        sub = np.array([float(self.sim.submitted_bytes.get(c, 0)) for c in range(self.n)])
        return rel, np.maximum(sub - rel, 0.0)

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self.sim is None:
            raise ShapingError("PathShapingEnv: call reset() before step()")
        if self.t >= self.steps:
            raise ShapingError("PathShapingEnv: the episode has ended; call reset()")
        self.limits.set(self.decode_action(action))
        t0 = self.t * self.period
        t1 = t0 + self.period
        self.sim.run_until(t1)
        self.t += 1
        terminated = self.t >= self.steps
        w_setup = self.sim.waiting_s(t0, t1, STREAM)
        w_burst = self.sim.waiting_s(t0, t1, BURST)
        if terminated:  # what is still queued is delivered with the limits in force
            self.sim.run()
            end = max(self.sim.now, t1)
            w_setup += self.sim.waiting_s(t1, end, STREAM)
            w_burst += self.sim.waiting_s(t1, end, BURST)
        rc = self.reward_cfg
        penalty = (rc["setup_weight"] * w_setup + w_burst) / (
            self.period * self.setup_rate * rc["delay_ref_s"])
        self._pen_sum += penalty
        rel, _ = self.class_bytes()
        self._last_released, self._released = rel - self._released, rel
        info: dict[str, Any] = {"setup_waiting_s": w_setup, "burst_waiting_s": w_burst}
        if terminated:
            info["episode_metrics"] = self._episode_metrics()
        return self._obs(), -float(penalty), terminated, False, info

    def _obs(self) -> np.ndarray:
        sim = self.sim
        assert sim is not None
        _, queued = self.class_bytes()
        usage = self._last_released / (self.g * self.period)
        q = np.clip(queued / (self.g * self.queue_ref_s), 0.0, 1.0)
        lim_u = limit_code(self.limits.limits, self.g, self.eps)
        pending = len(sim.created) - sim.delivered
        pend = min(1.0, pending * self.size / (self.g * self.queue_ref_s))
        parts = [np.clip(usage, 0.0, 1.0), q, lim_u, np.array([pend, self.t / self.steps])]
        return np.asarray(np.clip(np.concatenate(parts), 0.0, 1.0), dtype=np.float32)

    def _episode_metrics(self) -> dict[str, float]:
        assert self.sim is not None
        rec = self.sim.records()
        d = (rec.applied - rec.ts) * 1e3
        st, bu = rec.kind == STREAM, rec.kind == BURST
        per_tenant = [float(d[bu & (rec.vpc == v)].mean()) for v in self.burst_vpcs
                      if np.any(bu & (rec.vpc == v))]
        drains = []
        for v, n, at in self.current.bursts:
            m = bu & (rec.vpc == v) & (rec.ts == at)
            if n and m.any():
                drains.append(float(rec.applied[m].max() - at))
        return {"setup_mean_ms": float(d[st].mean()) if st.any() else 0.0,
                "setup_p95_ms": float(np.percentile(d[st], 95)) if st.any() else 0.0,
                "burst_mean_ms": float(d[bu].mean()) if bu.any() else 0.0,
                "burst_p95_ms": float(np.percentile(d[bu], 95)) if bu.any() else 0.0,
                "burst_drain_s": float(np.mean(drains)) if drains else 0.0,
                "fairness": jain_index(np.asarray(per_tenant)) if per_tenant else 1.0,
                "penalty_mean": self._pen_sum / self.steps}
