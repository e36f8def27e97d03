"""The learning contract's suite for ``smart/Shaping-v0`` (``configs/env/shaping.yaml``).

Baselines (each returns the action that makes the env apply its limits, through
:meth:`envs.shaping.env.ShapingEnv.encode_limits`):

* ``none``: every limit at ``G``, which the env treats as unshaped (the OpenVirteX baseline).
* ``static``: every limit at the fair share ``G / N`` (static equal split).
* ``sincon``: Sincon's adaptive limit calculator (Section III-A), one per direction, fed at
  the env's granularity: each step, for every message a channel processed during the last
  period, one ``observe(channel, usage)`` with the channel's measured throughput (the
  simulator's shaper meter), so a check still happens every 5 messages; only the limits'
  *application* waits for the period boundary (the figure reproduction,
  :mod:`agents.shaping.experiment`, applies them per message).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from envs.shaping.sincon import AdaptiveLimitCalculator, ShapingError

__all__ = [
    "BASELINES",
    "NoShapingPolicy",
    "SinconPolicy",
    "StaticSplitPolicy",
    "baseline_policies",
]


class NoShapingPolicy:
    name = "none"

    def reset(self, env: Any, seed: int) -> None:
        return None

    def act(self, obs: np.ndarray, env: Any) -> np.ndarray:
        return env.encode_limits(np.full((2, env.n), env.g))


class StaticSplitPolicy:
    name = "static"

    def reset(self, env: Any, seed: int) -> None:
        return None

    def act(self, obs: np.ndarray, env: Any) -> np.ndarray:
        return env.encode_limits(np.full((2, env.n), env.g / env.n))


class SinconPolicy:
    name = "sincon"

    def reset(self, env: Any, seed: int) -> None:
        cfg = env.cfg.sincon_config()
        self.calcs = [AdaptiveLimitCalculator(cfg, env.n) for _ in range(2)]
        self.seen = [np.zeros(env.n, dtype=np.int64) for _ in range(2)]

    def act(self, obs: np.ndarray, env: Any) -> np.ndarray:
        sim = env.sim
        for d, (calc, L) in enumerate(zip(self.calcs, sim.links)):
            new = L.processed - self.seen[d]
            self.seen[d] = L.processed.copy()
            for ch in np.flatnonzero(new):
                usage = L.shapers[ch].meter.read(sim.now)
                for _ in range(int(new[ch])):
                    calc.observe(int(ch), usage)
        return env.encode_limits(np.stack([c.limits for c in self.calcs]))


BASELINES = {"none": NoShapingPolicy, "static": StaticSplitPolicy, "sincon": SinconPolicy}


def baseline_policies(names: Sequence[str], env_kwargs: Mapping[str, Any], workers: int = 1
                      ) -> list[Any]:
    """The baselines called ``names`` (``env_kwargs`` is not needed: they read the env;
    ``workers`` neither: none of them plans)."""
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise ShapingError(f"unknown shaping baselines {unknown}; known: "
                           f"{', '.join(BASELINES)}")
    return [BASELINES[n]() for n in names]
