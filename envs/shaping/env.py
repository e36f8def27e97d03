"""``smart/Shaping-v0``: an agent sets the control channels' throughput limits.

A thin gymnasium wrapper over :class:`envs.shaping.simulator.ShapingSimulator` (no gymnasium
there). Where Sincon's adaptive limit calculator (Section III-A) sets the limits by its
fixed rule, here a policy sets them once per monitoring period; the delay-based channel
shaper of Section III-B enforces them in both cases.

## Description
``tenants`` x ``switches_per_tenant`` control channels (N) in two directions (read, write)
share a link of ``G`` bytes/s per direction; traffic is the simulator's (bursty background
control messages, edge switches x2, flow setups; tenants start staggered). An episode is
``duration_s`` of traffic, one step per ``period_s``.

## Action space
``Box(-1, 1, (2N,), float32)``: one value per channel, read channels first. Value ``a`` sets
the channel's limit ``L = G * eps ** (1 - (a + 1) / 2)`` (log scale), ``eps =
min_limit_share``: ``a = -1`` gives ``eps * G``, ``a = +1`` gives ``G``, which means *no
shaping* for that channel (no limit can exceed what the link carries). The sum of the limits
may exceed ``G`` (over-subscription, as without shaping). :meth:`ShapingEnv.encode_limits`
is the exact inverse (the baselines use it).

## Observation space
``Box(0, 1, (6N + 1,), float32)``: for each direction (read, write) and channel: usage (bytes
delivered in the last period / period / fair share ``G / N``, clipped at ``usage_cap`` and
divided by it), queue (bytes waiting in the channel's queue, and with ``sim.server =
hypervisor`` also those handed over but not yet processed, / (fair share x ``queue_ref_s``),
clipped at 1), limit (the decoded ``(a + 1) / 2`` of the limit in force);
then the elapsed fraction of the episode.

## Reward
Per step: ``J - w * min(max_penalty, S / (period * tenants * setup_rate_hz * setup_ref_s))``
where ``J`` is Jain's fairness index of the per-channel throughputs of the period (mean of
the two directions; 1 when nothing was sent) and ``S`` the setup-seconds accrued during
the period by open flow setups (by Little's law the penalty is about ``w * mean setup time /
setup_ref_s``; unfinished setups count too, so throttling everything does not pay).
Defaults: ``w = setup_weight = 0.5``, ``setup_ref_s = 0.1``, ``max_penalty = 5``.

## Starting state
Every limit at the fair share ``G / N``; the simulator's traffic is drawn from the episode's
seed (``self.np_random``).

## Episode end
Terminates after ``duration_s / period_s`` steps; never truncated. The terminal step's
``info["episode_metrics"]``: mean and p95 setup time of completed setups, fraction
completed, Fig. 5's throughput standard deviation per direction (bytes/s, window from the
last tenant's start), Jain's index per direction, mean fairness and penalty per step (setup
times are the episode's duration when no setup completed).

## Arguments
``tenants``, ``switches_per_tenant``, ``duration_s``, ``period_s``, ``sim`` (any other
:class:`SimConfig` field, nested dicts allowed), ``min_limit_share``, ``usage_cap``,
``queue_ref_s``, ``reward`` (``setup_weight``, ``setup_ref_s``, ``max_penalty``).

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

from .simulator import DIRECTIONS, ShapingSimulator, SimConfig
from .sincon import ExternalLimits, ShapingError

__all__ = ["REWARD_DEFAULTS", "ShapingEnv", "episode_settings", "jain_index", "limit_code",
           "limits_of_action"]

REWARD_DEFAULTS = {"setup_weight": 0.5, "setup_ref_s": 0.1, "max_penalty": 5.0}


def episode_settings(env: str, reward: Mapping[str, float] | None,
                     defaults: Mapping[str, float],
                     duration_s: float, period_s: float, min_limit_share: float
                     ) -> tuple[dict[str, float], int]:
    """What both shaping environments check and derive alike: ``min_limit_share`` in (0, 1),
    ``reward``'s keys among ``defaults`` (the reward settings, defaults filled in), and the
    number of steps, ``duration_s`` a positive multiple of ``period_s``. ``env`` names the
    environment in the errors."""
    if not 0 < min_limit_share < 1:
        raise ShapingError(f"{env}: min_limit_share must be in (0, 1), got "
                           f"{min_limit_share!r}")
    unknown = sorted(set(reward or {}) - set(defaults))
    if unknown:
        raise ShapingError(f"{env}: unknown reward keys {unknown}; known: {sorted(defaults)}")
    steps = round(duration_s / period_s)
    if steps < 1 or not math.isclose(steps * period_s, duration_s):
        raise ShapingError(f"{env}: duration_s {duration_s} must be a positive multiple of "
                           f"period_s {period_s}")
    return {**defaults, **dict(reward or {})}, steps


def limits_of_action(a: np.ndarray, g: float, eps: float) -> np.ndarray:
    """The log-scale limit of each action value: ``G * eps ** (1 - (a + 1) / 2)`` (``a``
    clipped to ``[-1, 1]``: -1 gives ``eps * G``, +1 gives ``G``)."""
    u = (np.clip(np.asarray(a, dtype=np.float64), -1.0, 1.0) + 1.0) / 2.0
    return np.asarray(g * eps ** (1.0 - u), dtype=np.float64)


def limit_code(limits: np.ndarray, g: float, eps: float) -> np.ndarray:
    """``(a + 1) / 2`` of each limit (clipped to ``[eps G, G]``): the inverse of
    :func:`limits_of_action` on ``[0, 1]``, also the observation's limit block."""
    lim = np.clip(np.asarray(limits, dtype=np.float64), eps * g, g)
    return np.asarray(1.0 - np.log(lim / g) / math.log(eps), dtype=np.float64)


def jain_index(x: np.ndarray) -> float:
    """Jain's fairness index ``(sum x)^2 / (n sum x^2)`` (1 for all-zero input)."""
    x = np.asarray(x, dtype=np.float64)
    s2 = float((x * x).sum())
    return float(x.sum() ** 2 / (x.size * s2)) if s2 > 0 else 1.0


class ShapingEnv(gym.Env):
    __doc__ = __doc__
    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 as gymnasium.Env declares it

    def __init__(self, tenants: int = 4, switches_per_tenant: int = 10,
                 duration_s: float = 5.0, period_s: float = 0.1,
                 sim: Mapping[str, Any] | None = None, min_limit_share: float = 1e-3,
                 usage_cap: float = 4.0, queue_ref_s: float = 1.0,
                 reward: Mapping[str, float] | None = None) -> None:
        super().__init__()
        self.cfg = SimConfig.from_dict(sim, tenants=tenants,
                                       switches_per_tenant=switches_per_tenant,
                                       duration_s=duration_s, period_s=period_s)
        if not (usage_cap > 0 and queue_ref_s > 0):
            raise ShapingError("ShapingEnv: usage_cap and queue_ref_s must be > 0")
        self.reward_cfg, self.steps = episode_settings(
            "ShapingEnv", reward, REWARD_DEFAULTS, duration_s, period_s, min_limit_share)
        self.n = self.cfg.num_channels
        self.g = self.cfg.global_throughput
        self.fair = self.g / self.n
        self.eps = float(min_limit_share)
        self.usage_cap, self.queue_ref_s = float(usage_cap), float(queue_ref_s)
        self.action_space = spaces.Box(-1.0, 1.0, (2 * self.n,), np.float32)
        self.observation_space = spaces.Box(0.0, 1.0, (6 * self.n + 1,), np.float32)
        self.sim: ShapingSimulator | None = None
        self.t = 0

    # ---- action <-> limits ---------------------------------------------------------------
    def decode_action(self, action: np.ndarray) -> np.ndarray:
        """Limits ``[2, N]`` (bytes/s; read, write) of an action."""
        a = np.asarray(action, dtype=np.float64).reshape(-1)
        if a.shape != (2 * self.n,) or not np.all(np.isfinite(a)):
            raise ShapingError(f"ShapingEnv: action must be {2 * self.n} finite values, got "
                               f"shape {np.shape(action)}")
        return limits_of_action(a, self.g, self.eps).reshape(2, self.n)

    def encode_limits(self, limits: np.ndarray) -> np.ndarray:
        """The action that sets ``limits`` ``[2, N]`` (clipped to ``[eps G, G]``; ``inf``
        means no shaping, i.e. ``G``)."""
        lim = np.asarray(limits, dtype=np.float64).reshape(-1)
        if lim.shape != (2 * self.n,):
            raise ShapingError(f"ShapingEnv.encode_limits: expected {2 * self.n} limits, got "
                               f"shape {np.shape(limits)}")
        u = limit_code(lim, self.g, self.eps)
        return np.clip(2.0 * u - 1.0, -1.0, 1.0).astype(np.float32)

    # ---- gymnasium -----------------------------------------------------------------------
    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        episode_seed = int(self.np_random.integers(0, 2**31 - 1))
        self.policies = (ExternalLimits(self.n, self.g), ExternalLimits(self.n, self.g))
        self.sim = ShapingSimulator(self.cfg, self.policies, episode_seed)
        self.t = 0
        self._fair_sum = self._pen_sum = 0.0
        self._last_open = 0.0
        return self._obs(), {"episode_seed": episode_seed}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self.sim is None:
            raise ShapingError("ShapingEnv: call reset() before step()")
        if self.t >= self.steps:
            raise ShapingError("ShapingEnv: the episode has ended; call reset()")
        limits = self.decode_action(action)
        for d in range(2):
            self.policies[d].set(limits[d])
        p = self.cfg.period_s
        self.sim.run_until((self.t + 1) * p)
        b = self.t
        self.t += 1
        tput = [L.delivered[:, b] / p for L in self.sim.links]
        fairness = float(np.mean([jain_index(x) for x in tput]))
        accrued = self.sim.open_integral - self._last_open
        self._last_open = self.sim.open_integral
        rc = self.reward_cfg
        ref = p * self.cfg.tenants * max(self.cfg.setup_rate_hz, 1e-9) * rc["setup_ref_s"]
        penalty = min(rc["max_penalty"], accrued / ref)
        reward = fairness - rc["setup_weight"] * penalty
        self._fair_sum += fairness
        self._pen_sum += penalty
        terminated = self.t >= self.steps
        info: dict[str, Any] = {"fairness": fairness, "setup_penalty": penalty,
                                "open_setups": self.sim.open_setups}
        if terminated:
            info["episode_metrics"] = self._episode_metrics()
        return self._obs(), float(reward), terminated, False, info

    def _obs(self) -> np.ndarray:
        sim = self.sim
        assert sim is not None
        p = self.cfg.period_s
        parts = []
        for d, L in enumerate(sim.links):
            usage = (L.delivered[:, self.t - 1] / p if self.t > 0 else np.zeros(self.n))
            parts.append(np.clip(usage / self.fair, 0, self.usage_cap) / self.usage_cap)
            waiting = L.qbytes if L.pool is None else L.qbytes + L.pool.ready_bytes
            parts.append(np.clip(waiting / (self.fair * self.queue_ref_s), 0, 1))
            parts.append(limit_code(self.policies[d].limits, self.g, self.eps))
        parts.append(np.array([self.t / self.steps]))
        return np.clip(np.concatenate(parts), 0.0, 1.0).astype(np.float32)

    def _episode_metrics(self) -> dict[str, float]:
        assert self.sim is not None
        s = self.sim.result().summary()
        nan_to = self.cfg.duration_s  # no setup completed: count the whole episode
        out = {"setup_time_mean_s": np.nan_to_num(s["setup_time_mean_s"], nan=nan_to),
               "setup_time_p95_s": np.nan_to_num(s["setup_time_p95_s"], nan=nan_to),
               "setups_completed_frac": (s["setups_completed"] / s["setups"]
                                         if s["setups"] else 1.0),
               "fairness_mean": self._fair_sum / self.steps,
               "setup_penalty_mean": self._pen_sum / self.steps}
        for d in DIRECTIONS:
            out[f"{d}_tput_std_Bps"] = s[f"{d}_tput_std_Bps"]
            out[f"{d}_jain"] = s[f"{d}_jain"]
        return {k: float(v) for k, v in out.items()}
