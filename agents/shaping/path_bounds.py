"""How much any action on the controller's sending path could gain on an episode of
``smart/PathShaping-v0``, measured in hindsight before a design is trained (the room a
priority lane for the setups would have).

The return of an episode is minus the weighted delivery-seconds of waiting (Little's law: the
sum of the deliveries' delays), ``-(w * W_setup + W_burst) / (period * R * delay_ref)``
(:class:`envs.shaping.path_env.PathShapingEnv`). Per episode, on the same workload and path
(the shaper's classes at ``G``, the link of ``G``), :func:`episode_bounds` gives:

* ``none``: the episode played with every class at ``G`` (the best baseline);
* ``lane``: the setups as if they were alone on the path (the same workload without its
  bursts), the bursts as under ``none``: a perfect priority lane for the setups that costs
  the bursts nothing. Nothing on the path makes the setups faster than being alone on it.

``lane - none`` is the room of a setup lane: an upper bound for what such a lane could gain,
not a policy (it sees the episode whole). The bursts have no such floor here: alone, they
lose the sending loop's flushes, which push what the shaper releases inline, so they are
slower alone than beside the setups in some episodes. Deterministic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd

from delivery.sending_sim import BURST, STREAM, PathRecords
from envs.shaping.path_env import PathShapingEnv

__all__ = ["bounds_summary", "bounds_table", "episode_bounds"]


def _setups_alone(env: PathShapingEnv) -> PathRecords:
    """The episode's workload without its bursts, through the same path with every class
    at ``G``."""
    sim, limits = env.simulation(replace(env.current, bursts=()))
    limits.set(np.full(env.n, env.g))
    return sim.run()


def _waiting_s(rec: PathRecords, kind: int) -> float:
    m = rec.kind == kind
    return float((rec.applied[m] - rec.ts[m]).sum())


def episode_bounds(env_kwargs: Mapping[str, Any], seed: int) -> dict[str, float]:
    """``none`` and ``lane`` (module docstring) on the episode of ``seed``: their returns,
    ``none``'s recomputed from its records (the environment's accounting), and the setups'
    mean delay (ms) under ``none`` and alone, the bursts' under ``none``."""
    env = PathShapingEnv(**dict(env_kwargs))
    env.reset(seed=seed)
    act = env.encode_limits(np.full(env.n, env.g))
    done = False
    ret = 0.0
    while not done:
        _, r, done, _, _ = env.step(act)
        ret += r
    assert env.sim is not None
    none = env.sim.records()
    setups = _setups_alone(env)
    norm = env.period * env.setup_rate * env.reward_cfg["delay_ref_s"]
    w = env.reward_cfg["setup_weight"]

    def ret_of(s: PathRecords, b: PathRecords) -> float:
        return -(w * _waiting_s(s, STREAM) + _waiting_s(b, BURST)) / norm

    def mean_ms(rec: PathRecords, kind: int) -> float:
        m = rec.kind == kind
        return float((rec.applied[m] - rec.ts[m]).mean() * 1e3) if m.any() else 0.0

    return {"seed": seed, "bursts": len(env.current.bursts),
            "return_none": ret, "return_none_check": ret_of(none, none),
            "return_lane": ret_of(setups, none),
            "setup_mean_ms_none": mean_ms(none, STREAM),
            "setup_mean_ms_alone": mean_ms(setups, STREAM),
            "burst_mean_ms_none": mean_ms(none, BURST)}


def bounds_table(env_kwargs: Mapping[str, Any], runs: Sequence[tuple[int, Sequence[int]]]
                 ) -> pd.DataFrame:
    """:func:`episode_bounds` on every episode seed of every ``(run seed, episode seeds)``,
    one row each, with the room ``lane_vs_none_pct`` (percent of ``none``'s return
    magnitude)."""
    rows = []
    for run, seeds in runs:
        for s in seeds:
            rows.append({"run": run, **episode_bounds(env_kwargs, int(s))})
    df = pd.DataFrame(rows)
    df["lane_vs_none_pct"] = ((df["return_lane"] - df["return_none"])
                              / df["return_none"].abs() * 100.0)
    return df


def bounds_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per run seed the mean returns, room and delays of :func:`bounds_table`'s episodes,
    then a ``mean`` row over the runs with the room's 95% interval across them."""
    from envs.stats import ci95

    cols = [c for c in df.columns if c.startswith(("return_", "setup_mean", "burst_mean"))
            or c.endswith("_vs_none_pct")]
    per = df.groupby("run")[cols].mean().reset_index()
    per.insert(1, "episodes", df.groupby("run").size().to_numpy())
    mean = {"run": "mean", "episodes": int(per.episodes.sum()),
            **{c: float(per[c].mean()) for c in cols}}
    mean["lane_vs_none_ci95"] = ci95(per["lane_vs_none_pct"].to_numpy())
    per["run"] = per["run"].astype(str)
    return pd.concat([per, pd.DataFrame([mean])], ignore_index=True)
