"""Multicast over time, measured before anything is trained: ``python trees.py
figures=[overtime]`` (``configs/trees.yaml``'s ``overtime`` block).

On held-out episodes of ``smart/MulticastOverTime-v0`` (``configs/env/trees_time.yaml``'s
arguments, the test seed stream of :func:`agents.episodes.episode_seeds`), the suite's
baselines, the isolation bound, and a **one-step rollout** (Bertsekas' rollout algorithm on
the base policy ``algorithm1_tuned``): for each arriving group, every candidate action (a
load knob of :data:`ROLLOUT_KNOBS` with Algorithm 1's order, or with the lookahead's order)
is tried on a copy of the environment, the episode is finished with the base policy, and the
best candidate is taken. The rollout sees the future (it simulates the rest of the episode),
so it is not a policy a controller could run; it is an achievable value that the base policy
and anything learned from the same actions can be measured against: its gain over
``algorithm1_tuned`` is room that a per-group choice of knob and order can take, where the
isolation bound also counts the interference no policy avoids.

Tables: ``overtime.csv`` (one row per policy and episode: the value, the bound, the return)
and ``overtime_summary.csv`` (per policy: the mean value, its share of the bound, and the
paired difference against ``algorithm1_tuned`` with its 95% interval). With
``overtime.learned`` (the output directories of ``python train.py env=trees_time`` runs, one
per training seed), ``overtime_learned.csv``: per run, the learned policy's and the tuned
baselines' mean value on that run's own test episodes (``per_episode.csv``) and the learned
policy's paired difference against ``algorithm1_tuned``; a last row ``mean`` averages the
runs, with the 95% interval over them.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pandas as pd
from omegaconf import OmegaConf

import envs  # noqa: F401  (registers smart/*)

from ..config import CONFIG_DIR
from ..episodes import episode_seeds, run_episodes
from .suite import TUNED, _with_knob, baseline_policies, tune_knob

__all__ = ["ROLLOUT_KNOBS", "learned_table", "overtime_env", "overtime_tables",
           "rollout_episode"]

ENV_ID = "smart/MulticastOverTime-v0"
#: the load knobs the rollout tries for each group, with each of the two orders
ROLLOUT_KNOBS = (-0.5, 0.0, 0.15, 0.3, 0.6)


def overtime_env(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``configs/env/trees_time.yaml``'s environment arguments, with ``overrides``."""
    cfg = OmegaConf.load(Path(CONFIG_DIR) / "env" / "trees_time.yaml")
    kw = OmegaConf.to_container(cfg.env.kwargs, resolve=True)
    assert isinstance(kw, dict)
    return {str(k): v for k, v in kw.items()} | dict(overrides or {})


def rollout_episode(env_kwargs: Mapping[str, Any], seed: int, base_knob: float,
                    knobs: Sequence[float] = ROLLOUT_KNOBS) -> dict[str, float]:
    """One episode of the one-step rollout (module docstring) on the base policy Algorithm 1
    at ``base_knob``: the episode's metrics and return."""
    env = gym.make(ENV_ID, **dict(env_kwargs)).unwrapped
    base = _with_knob(float(base_knob))
    cands = [_with_knob(float(k), rule) for rule in TUNED.values() for k in knobs]
    env.reset(seed=int(seed))
    done, total, info = False, 0.0, {}
    while not done:
        best, best_v = None, -np.inf
        for cand in cands:
            trial = copy.deepcopy(env)
            a = cand(trial, None)
            _, v, end, _, _ = trial.step(a)
            while not end:
                _, r, end, _, _ = trial.step(base(trial, None))
                v += r
            if v > best_v:
                best, best_v = a, v
        _, r, done, _, info = env.step(best)
        total += float(r)
    return {"return": total, **info["episode_metrics"]}


def overtime_tables(episodes: int, rollout_episodes: int,
                    env_overrides: Mapping[str, Any] | None = None,
                    say=print) -> dict[str, pd.DataFrame]:
    """The baselines on ``episodes`` test episodes and the rollout on the first
    ``rollout_episodes`` of them (module docstring)."""
    kw = overtime_env(env_overrides)
    seeds = episode_seeds(0, "test", int(episodes))
    names = ["algorithm1", *TUNED, "random10", "nvp", "binary"]
    t0 = time.perf_counter()
    rows = run_episodes(baseline_policies(names, kw), ENV_ID, kw, seeds)
    say(f"overtime: baselines on {len(seeds)} episodes in {time.perf_counter() - t0:.0f} s")
    knob, _ = tune_knob(ENV_ID, kw)
    ro = []
    for i, s in enumerate(seeds[:int(rollout_episodes)]):
        t1 = time.perf_counter()
        ro.append({"policy": "rollout", "seed": s, **rollout_episode(kw, s, knob)})
        say(f"overtime: rollout episode {i + 1}/{rollout_episodes} in "
            f"{time.perf_counter() - t1:.0f} s")
    df = pd.concat([rows, pd.DataFrame(ro)], ignore_index=True)
    df = df[["policy", "seed", "return", "value", "bound", "objective_gbps", "mean_k",
             "mean_active", "dropped"]]
    return {"overtime": df, "overtime_summary": _summary(df)}


def _summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per policy: episodes, mean value and share of the bound, and the paired difference
    of the value against ``algorithm1_tuned`` (percent, over the episodes both ran, with a
    95% normal interval)."""
    ref = df[df.policy == "algorithm1_tuned"].set_index("seed").value
    out = []
    for pol, d in df.groupby("policy", sort=False):
        dv = (d.set_index("seed").value / ref.reindex(d.seed).to_numpy() - 1.0).dropna()
        half = 1.96 * float(dv.std(ddof=1)) / np.sqrt(len(dv)) if len(dv) > 1 else np.nan
        out.append({"policy": pol, "episodes": len(d), "value": float(d.value.mean()),
                    "of_bound": float((d.value / d.bound).mean()),
                    "vs_algorithm1_tuned_pct": 100.0 * float(dv.mean()),
                    "vs_algorithm1_tuned_ci95_pct": 100.0 * half})
    return pd.DataFrame(out)


def learned_table(run_dirs: Sequence[str | Path]) -> pd.DataFrame:
    """Per training run (its ``per_episode.csv``): the mean value of ``learned``,
    ``algorithm1``, ``algorithm1_tuned`` and ``lookahead`` on its test episodes and the
    learned policy's paired difference against ``algorithm1_tuned`` (percent); then a
    ``mean`` row over the runs with the 95% interval of that difference across them."""
    rows = []
    for d in run_dirs:
        f = Path(d) / "per_episode.csv"
        if not f.is_file():
            raise FileNotFoundError(f"overtime.learned: {d} has no per_episode.csv (not a "
                                    "finished train.py env=trees_time run)")
        df = pd.read_csv(f)
        if "learned" not in set(df.policy) or "algorithm1_tuned" not in set(df.policy):
            raise ValueError(f"overtime.learned: {f} lacks the learned policy or "
                             "algorithm1_tuned (train with configs/env/trees_time.yaml)")
        v = df.pivot_table(index="seed", columns="policy", values="value")
        diff = v["learned"] / v["algorithm1_tuned"] - 1.0
        rows.append({"run": Path(d).name, "episodes": len(v),
                     **{p: float(v[p].mean()) for p in ("learned", "algorithm1",
                                                        "algorithm1_tuned", "lookahead")
                        if p in v.columns},
                     "learned_vs_algorithm1_tuned_pct": 100.0 * float(diff.mean())})
    out = pd.DataFrame(rows)
    d = out["learned_vs_algorithm1_tuned_pct"]
    half = 1.96 * float(d.std(ddof=1)) / np.sqrt(len(d)) if len(d) > 1 else np.nan
    mean = {"run": "mean", "episodes": int(out.episodes.sum()),
            **{c: float(out[c].mean()) for c in out.columns if c not in ("run", "episodes")},
            "ci95_pct": half}
    return pd.concat([out, pd.DataFrame([mean])], ignore_index=True)
