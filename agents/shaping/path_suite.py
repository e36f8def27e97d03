"""The learning contract's suite for ``smart/PathShaping-v0`` (``configs/env/path_shaping.yaml``).

Baselines (each returns the action that makes the env apply its class limits, through
:meth:`envs.shaping.path_env.PathShapingEnv.encode_limits`):

* ``none``: every class at ``G`` (each may take the whole link: no shaping below the link).
* ``static``: every class at ``G / C`` (static equal split).
* ``sincon``: Sincon's adaptive limit calculator (Section III-A) over the classes, fed at the
  env's granularity: each step, for every message a class released during the last period,
  one ``observe(class, usage)`` with the class's throughput over the period (so a check
  still happens every 5 messages); the limits apply from the next period.
* ``priority``: a work-conserving heuristic an operator would write with the env's state in
  hand: every setup class at ``G`` (setups are small and latency-sensitive), and the link
  left after the setups' rate (``headroom`` of it) shared equally by the burst classes that
  have something queued; a burst class with nothing queued at the fair share. Its
  ``headroom`` is set by its name (``priority_0.5``; ``priority``: 0.9); with ``workload="same"``
  it has no setup classes to favour and is the equal split of the busy classes.
* ``hindsight``: not a policy but a value the action can reach: for each episode, every
  constant setting of a grid (the burst classes at each of :data:`HINDSIGHT_BURST` x G, the
  setup classes at each of :data:`HINDSIGHT_SETUP` x G) is played on a twin of the episode,
  and the best return's setting is then played. It sees the future; its margin over ``none``
  is the room constant class limits leave.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from envs.shaping.sincon import AdaptiveLimitCalculator, ShapingError, SinconConfig

__all__ = ["PATH_BASELINES", "HindsightConstant", "PriorityPolicy", "path_baseline_policies"]


class _Fixed:
    name = "none"

    def __init__(self, share: float | None) -> None:
        self.share = share

    def reset(self, env: Any, seed: int) -> None:
        return None

    def act(self, obs: np.ndarray, env: Any) -> np.ndarray:
        per = env.g if self.share is None else env.g * self.share / env.n
        return env.encode_limits(np.full(env.n, per))


class SinconPathPolicy:
    name = "sincon"

    def reset(self, env: Any, seed: int) -> None:
        self.calc = AdaptiveLimitCalculator(SinconConfig(global_throughput=env.g), env.n)
        self.seen_msgs = np.zeros(env.n, dtype=np.int64)
        self.seen_bytes = np.zeros(env.n)

    def act(self, obs: np.ndarray, env: Any) -> np.ndarray:
        st = env.sim.shaper.stats()
        msgs = np.array([st[c]["messages"] for c in range(env.n)], dtype=np.int64)
        byts = np.array([float(st[c]["bytes"]) for c in range(env.n)])
        new, usage = msgs - self.seen_msgs, (byts - self.seen_bytes) / env.period
        self.seen_msgs, self.seen_bytes = msgs, byts
        for c in np.flatnonzero(new):
            for _ in range(int(new[c])):
                self.calc.observe(int(c), float(usage[c]))
        return env.encode_limits(self.calc.limits)


class PriorityPolicy:
    """See the module docstring; ``headroom`` is the share of the link's rest the busy burst
    classes share."""

    def __init__(self, headroom: float = 0.9) -> None:
        if not 0 < headroom <= 1:
            raise ShapingError(f"priority: headroom must be in (0, 1], got {headroom!r}")
        self.headroom = float(headroom)
        self.name = "priority" if self.headroom == 0.9 else f"priority_{headroom:g}"

    def reset(self, env: Any, seed: int) -> None:
        return None

    def act(self, obs: np.ndarray, env: Any) -> np.ndarray:
        _, queued = env.class_bytes()
        bursts = len(env.burst_vpcs)
        setup_Bps = env.setup_rate * env.size
        rest = max(env.g - (setup_Bps if env.workload == "split" else 0.0), env.eps * env.g)
        busy = [c for c in range(bursts) if queued[c] > 0]
        lim = np.full(env.n, env.g)
        for c in range(bursts):
            lim[c] = (self.headroom * rest / len(busy)) if c in busy else env.g / env.n
        return env.encode_limits(lim)


class HindsightConstant:
    """See the module docstring."""

    name = "hindsight"

    def __init__(self, env_kwargs: Mapping[str, Any]) -> None:
        self.env_kwargs = dict(env_kwargs)

    def reset(self, env: Any, seed: int) -> None:
        from envs.shaping.path_env import PathShapingEnv

        twin = PathShapingEnv(**self.env_kwargs)
        bursts = len(env.burst_vpcs)
        best, best_ret = None, -np.inf
        for x in HINDSIGHT_BURST:
            for y in (HINDSIGHT_SETUP if env.n > bursts else (1.0,)):
                lim = np.r_[np.full(bursts, x * env.g), np.full(env.n - bursts, y * env.g)]
                act = env.encode_limits(lim)
                twin.reset(seed=seed)
                ret, done = 0.0, False
                while not done:
                    _, r, done, _, _ = twin.step(act)
                    ret += r
                if ret > best_ret:
                    best, best_ret = act, ret
        self.action = best
        self.setting_return = best_ret

    def act(self, obs: np.ndarray, env: Any) -> np.ndarray:
        return self.action


HINDSIGHT_BURST = (1.0, 0.7, 0.5, 0.3, 0.15)
HINDSIGHT_SETUP = (1.0, 0.3, 0.1)
PATH_BASELINES = ("none", "static", "sincon", "priority", "hindsight")


def path_baseline_policies(names: Sequence[str], env_kwargs: Mapping[str, Any],
                          workers: int = 1) -> list[Any]:
    """The baselines called ``names``; ``priority_<h>`` sets the headroom (``priority``:
    0.9). ``workers`` is the suite contract's; none of these plans."""
    out: list[Any] = []
    for n in names:
        if n == "none":
            out.append(_Fixed(None))
        elif n == "static":
            p = _Fixed(1.0)
            p.name = "static"
            out.append(p)
        elif n == "sincon":
            out.append(SinconPathPolicy())
        elif n == "priority":
            out.append(PriorityPolicy())
        elif n == "hindsight":
            out.append(HindsightConstant(env_kwargs))
        elif n.startswith("priority_"):
            try:
                h = float(n[len("priority_"):])
            except ValueError:
                raise ShapingError(f"unknown path-shaping baseline {n!r}: priority_<h> needs "
                                   "a number h in (0, 1]") from None
            out.append(PriorityPolicy(h))
        else:
            raise ShapingError(f"unknown path-shaping baselines [{n!r}]; known: "
                               f"{', '.join(PATH_BASELINES)}, priority_<h>")
    return out


#: the suite contract's entry point (``env.suite: agents.shaping.path_suite``)
baseline_policies = path_baseline_policies
