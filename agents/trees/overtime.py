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

**Planning** (``python trees.py figures=[overtime_planning]``): the one-step rollout on the
episode's own future (clairvoyant) and on futures drawn from the model
(:class:`agents.trees.planner.ModelPlanner`, ``rollout_model``: a policy that uses only what
a controller knows), beside ``algorithm1_tuned`` and ``lookahead`` on the same held-out
episodes; ``overtime_planning.csv``: per policy, the mean value and the paired difference
against ``algorithm1_tuned`` with its 95% interval.

**Knob rules** (``python trees.py figures=[overtime_rules]``): whether the knob has room that
depends on what a controller sees. Each rule is Algorithm 1's order with one of two load
knobs, switched on one feature of the arriving group's moment: the mean background over
``Omega`` or the number of active groups (both visible to a policy, both in the
observation), or the group's own holding time (not visible: a clairvoyant rule that bounds
what knowing it would give). The threshold is the feature's median under
``algorithm1_tuned`` on the tuning episodes; the two knobs are the best pair on those
episodes of :data:`RULE_KNOBS` and the tuned knob (equal pairs included, so a rule is never
worse than the tuned knob there). ``overtime_rules.csv``: per rule, the tuning episodes'
gain and the held-out episodes' paired difference against ``algorithm1_tuned`` with its 95%
interval.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pandas as pd
from omegaconf import OmegaConf

import envs  # noqa: F401  (registers smart/*)
from envs.stats import ci95

from ..config import CONFIG_DIR
from ..episodes import episode_seeds, run_episodes
from .planner import ROLLOUT_KNOBS, ModelPlanner, PlanningPool, candidates, plan
from .suite import (
    TUNED,
    TUNING_EPISODES,
    TUNING_GRID,
    _with_knob,
    baseline_policies,
    tune_knob,
    tuning_seeds,
)

__all__ = ["ROLLOUT_KNOBS", "RULE_FEATURES", "RULE_KNOBS", "KnobRule", "learned_table",
           "overtime_env", "overtime_tables", "planning_table", "rollout_episode", "rule_table",
           "signal_table"]

ENV_ID = "smart/MulticastOverTime-v0"


def overtime_env(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``configs/env/trees_time.yaml``'s environment arguments, with ``overrides``."""
    cfg = OmegaConf.load(Path(CONFIG_DIR) / "env" / "trees_time.yaml")
    kw = OmegaConf.to_container(cfg.env.kwargs, resolve=True)
    assert isinstance(kw, dict)
    return {str(k): v for k, v in kw.items()} | dict(overrides or {})


def rollout_episode(env_kwargs: Mapping[str, Any], seed: int, base_knob: float,
                    knobs: Sequence[float] = ROLLOUT_KNOBS, workers: int = 1
                    ) -> dict[str, float]:
    """One episode of the one-step rollout (module docstring) on the base policy Algorithm 1
    at ``base_knob``, each group planned on the episode's own future
    (:func:`agents.trees.planner.plan`, its candidates scored in ``workers`` processes):
    the episode's metrics and return."""
    env = gym.make(ENV_ID, **dict(env_kwargs)).unwrapped
    base, cands = _with_knob(float(base_knob)), candidates(knobs)
    pool = PlanningPool(workers)
    env.reset(seed=int(seed))
    done, total, info = False, 0.0, {}
    try:
        while not done:
            _, r, done, _, info = env.step(plan(env, base, cands, pool=pool))
            total += float(r)
    finally:
        pool.close()
    return {"return": total, **info["episode_metrics"]}


def _paired_pct(values: pd.Series, ref: pd.Series) -> tuple[float, float, int]:
    """The paired difference of ``values`` against ``ref`` (both indexed by episode seed),
    as a percent of ``ref``, over the seeds both have: its mean, the half-width of its 95%
    interval (Student's t, :func:`envs.stats.ci95`) and the number of pairs."""
    d = (values / ref.reindex(values.index).to_numpy() - 1.0).dropna().to_numpy()
    return 100.0 * float(d.mean()), 100.0 * ci95(d), int(d.size)


def planning_table(episodes: int, samples: int, env_overrides: Mapping[str, Any] | None = None,
                   say=print, workers: int = 1) -> pd.DataFrame:
    """The one-step rollout on the episode's own future (clairvoyant) and on ``samples``
    sampled futures (:class:`agents.trees.planner.ModelPlanner`: what a controller that
    knows the model can plan), both on ``algorithm1_tuned``, beside ``algorithm1_tuned`` and
    ``lookahead`` on ``episodes`` test episodes; per policy the mean value and the paired
    difference against ``algorithm1_tuned`` (95% interval). Both rollouts score their
    candidates in ``workers`` processes (the same table with any number)."""
    kw = overtime_env(env_overrides)
    seeds = episode_seeds(0, "test", int(episodes))
    knob, _ = tune_knob(ENV_ID, kw)
    rows = [{"policy": r.policy, "seed": int(r.seed), "value": float(r.value)}
            for r in run_episodes(baseline_policies(["algorithm1_tuned", "lookahead"], kw),
                                  ENV_ID, kw, seeds).itertuples()]
    planner = ModelPlanner(samples, knob=knob, workers=workers)
    try:
        for i, s in enumerate(seeds):
            t0 = time.perf_counter()
            rows.append({"policy": "rollout", "seed": int(s),
                         "value": rollout_episode(kw, s, knob, workers=workers)["value"]})
            model = run_episodes([planner], ENV_ID, kw, [s])
            rows.append({"policy": "rollout_model", "seed": int(s),
                         "value": float(model.value.iloc[0])})
            say(f"overtime planning: episode {i + 1}/{len(seeds)} in "
                f"{time.perf_counter() - t0:.0f} s")
    finally:
        planner.close()
    df = pd.DataFrame(rows)
    ref = df[df.policy == "algorithm1_tuned"].set_index("seed").value
    out = []
    for pol, d in df.groupby("policy", sort=False):
        pct, half, n = _paired_pct(d.set_index("seed").value, ref)
        out.append({"policy": pol, "sees_future": pol == "rollout",
                    "samples": int(samples) if pol == "rollout_model" else 0,
                    "episodes": n, "value": float(d.value.mean()),
                    "vs_algorithm1_tuned_pct": pct, "vs_algorithm1_tuned_ci95_pct": half})
    return pd.DataFrame(out)


def signal_table(episodes: int, samples: int, env_overrides: Mapping[str, Any] | None = None,
                 say=print, workers: int = 1) -> dict[str, pd.DataFrame]:
    """What a critic would have to resolve on ``smart/MulticastOverTime-v0``: along
    the one-step rollout's path (below) on ``episodes`` test episodes, every candidate of the
    one-step rollout (:func:`agents.trees.planner.candidates`) is played, then
    ``algorithm1_tuned`` to the episode's end, on each of ``samples`` futures drawn from
    the model (:func:`agents.trees.planner.resampled`): one Monte Carlo return-to-go per
    candidate and future. Per group (``overtime_signal_groups``): ``gain``, the best mean
    candidate over the base policy's (the tuned knob with Algorithm 1's order);
    ``spread``, best minus worst; ``sd_return``, one return's standard deviation over the
    futures (mean over the candidates); ``sd_paired``, that of the best-minus-base
    difference on the same futures; and the returns per action that would tell the best
    from the base at 2 standard deviations, from independent futures
    (``(2 sqrt(2) sd_return / gain)^2``) and from common ones (``(2 sd_paired / gain)^2``).
    ``overtime_signal``: their medians over the groups where the best is not the base's.
    The path follows the best mean candidate (ties to the one nearest the base's action) on
    these futures, drawn from ``rollout_model``'s stream: ``rollout_model``'s rule on
    ``samples`` futures (``reward``: each group's reward along it). The best is chosen and
    scored on the same futures, so its gain is biased upwards."""
    from .planner import nearest_best, resampled

    if int(samples) < 2:
        raise ValueError(f"overtime.signal_samples must be >= 2 (a standard deviation over "
                         f"the futures), got {samples}")
    kw = overtime_env(env_overrides)
    knob, _ = tune_knob(ENV_ID, kw)
    base, cands = _with_knob(knob), candidates()
    # the base's candidate: the rollout knob nearest the tuned one, with Algorithm 1's order
    ib = int(np.argmin([abs(k - knob) for k in ROLLOUT_KNOBS]))
    pool = PlanningPool(workers)
    rows = []
    try:
        for i, seed in enumerate(episode_seeds(0, "test", int(episodes))):
            t0 = time.perf_counter()
            env = gym.make(ENV_ID, **kw).unwrapped
            env.reset(seed=int(seed))
            futures_rng = np.random.default_rng([int(seed), 7919])  # rollout_model's stream
            done, t = False, 0
            while not done:
                worlds = [resampled(env, futures_rng) for _ in range(int(samples))]
                q = np.array([pool.values(cands, base, [w]) for w in worlds]).T
                qm = q.mean(axis=1)
                b = int(np.argmax(qm))
                gain = float(qm[b] - qm[ib])
                sd = float(q.std(axis=1, ddof=1).mean())
                sd_pair = float((q[b] - q[ib]).std(ddof=1))
                rows.append({"seed": int(seed), "group": t, "return_to_go": float(qm[b]),
                             "gain": gain, "gain_pct": 100.0 * gain / abs(float(qm[b])),
                             "spread": float(qm.max() - qm.min()), "sd_return": sd,
                             "sd_return_pct": 100.0 * sd / abs(float(qm[b])),
                             "sd_paired": sd_pair,
                             "returns_independent": (2.0 * np.sqrt(2.0) * sd / gain) ** 2
                             if gain > 0 else np.nan,
                             "returns_paired": (2.0 * sd_pair / gain) ** 2
                             if gain > 0 else np.nan})
                _, r, done, _, _ = env.step(nearest_best(env, base, cands, list(q.sum(axis=1))))
                rows[-1]["reward"] = float(r)
                t += 1
            env.close()
            say(f"overtime signal: episode {i + 1}/{episodes} ({t} groups) in "
                f"{time.perf_counter() - t0:.0f} s")
    finally:
        pool.close()
    groups = pd.DataFrame(rows)
    moved = groups[groups.gain > 0]
    summary = pd.DataFrame([{
        "episodes": int(episodes), "samples": int(samples), "groups": len(groups),
        "groups_best_not_base": len(moved),
        "gain_pct": float(moved.gain_pct.median()) if len(moved) else 0.0,
        "spread": float(groups.spread.median()),
        "return_to_go": float(groups.return_to_go.median()),
        "sd_return_pct": float(groups.sd_return_pct.median()),
        # an empty selection's median and quantiles are NaN
        "returns_independent": float(moved.returns_independent.median()),
        "returns_independent_q25": float(moved.returns_independent.quantile(0.25)),
        "returns_independent_q75": float(moved.returns_independent.quantile(0.75)),
        "returns_paired": float(moved.returns_paired.median())}])
    return {"overtime_signal_groups": groups, "overtime_signal": summary}


def overtime_tables(episodes: int, rollout_episodes: int,
                    env_overrides: Mapping[str, Any] | None = None,
                    say=print, workers: int = 1) -> dict[str, pd.DataFrame]:
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
        ro.append({"policy": "rollout", "seed": s,
                   **rollout_episode(kw, s, knob, workers=workers)})
        say(f"overtime: rollout episode {i + 1}/{rollout_episodes} in "
            f"{time.perf_counter() - t1:.0f} s")
    df = pd.concat([rows, pd.DataFrame(ro)], ignore_index=True)
    df = df[["policy", "seed", "return", "value", "bound", "objective_gbps", "mean_k",
             "mean_active", "dropped"]]
    return {"overtime": df, "overtime_summary": _summary(df)}


def _summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per policy: episodes, mean value and share of the bound, and the paired difference
    of the value against ``algorithm1_tuned`` (percent, over the episodes both ran, with a
    95% interval, Student's t)."""
    ref = df[df.policy == "algorithm1_tuned"].set_index("seed").value
    out = []
    for pol, d in df.groupby("policy", sort=False):
        pct, half, _ = _paired_pct(d.set_index("seed").value, ref)
        out.append({"policy": pol, "episodes": len(d), "value": float(d.value.mean()),
                    "of_bound": float((d.value / d.bound).mean()),
                    "vs_algorithm1_tuned_pct": pct, "vs_algorithm1_tuned_ci95_pct": half})
    return pd.DataFrame(out)


#: policies a training run may also have evaluated on its test episodes, and the paired
#: differences (name -> (policy, reference)) each adds to :func:`learned_table`
OPTIONAL_PAIRS: dict[str, dict[str, tuple[str, str]]] = {
    "rollout_model": {"learned_vs_rollout_model_pct": ("learned", "rollout_model"),
                      "rollout_model_vs_algorithm1_tuned_pct": ("rollout_model",
                                                                "algorithm1_tuned")},
    "clone": {"learned_vs_clone_pct": ("learned", "clone"),
              "clone_vs_algorithm1_tuned_pct": ("clone", "algorithm1_tuned")},
}
#: the pairs of two optional policies, where a run evaluated both: the cloned start against
#: the planner it was cloned from
JOINT_PAIRS: dict[str, tuple[str, str]] = {"clone_vs_rollout_model_pct": ("clone",
                                                                          "rollout_model")}


def learned_table(run_dirs: Sequence[str | Path]) -> pd.DataFrame:
    """Per training run (its ``per_episode.csv``): the mean value of ``learned``,
    ``algorithm1``, ``algorithm1_tuned``, ``lookahead`` and, where the run evaluated them,
    ``rollout_model`` and ``clone`` (the cloned start before reinforcement learning) on its
    test episodes; the learned policy's paired difference against ``algorithm1_tuned``
    (percent) and those of :data:`OPTIONAL_PAIRS` and :data:`JOINT_PAIRS`; then a ``mean``
    row over the runs with the 95% interval of each difference across them (``ci95_pct``
    for the first, ``<name>_ci95_pct`` for a difference ``<name>_pct``). The runs must all
    have evaluated an optional policy or none."""
    rows = []
    for d in run_dirs:
        f = Path(d) / "per_episode.csv"
        if not f.is_file():
            raise FileNotFoundError(f"overtime.learned: {d} has no per_episode.csv (not a "
                                    "finished train.py env=trees_time* run)")
        df = pd.read_csv(f)
        if "learned" not in set(df.policy) or "algorithm1_tuned" not in set(df.policy):
            raise ValueError(f"overtime.learned: {f} lacks the learned policy or "
                             "algorithm1_tuned (train with env=trees_time or env=trees_time_knob)")
        v = df.pivot_table(index="seed", columns="policy", values="value")
        pct = {"learned_vs_algorithm1_tuned_pct": ("learned", "algorithm1_tuned")}
        for pol, pairs in OPTIONAL_PAIRS.items():
            if pol in v.columns:
                pct |= pairs
        pct |= {k: ab for k, ab in JOINT_PAIRS.items() if set(ab) <= set(v.columns)}
        rows.append({"run": Path(d).name, "episodes": len(v),
                     **{p: float(v[p].mean()) for p in ("learned", "algorithm1",
                                                        "algorithm1_tuned", "lookahead",
                                                        *OPTIONAL_PAIRS)
                        if p in v.columns},
                     **{k: 100.0 * float((v[a] / v[b] - 1.0).mean())
                        for k, (a, b) in pct.items()}})
    for pol in OPTIONAL_PAIRS:
        lacking = [r["run"] for r in rows if pol not in r]
        if 0 < len(lacking) < len(rows):
            raise ValueError(f"overtime.learned: some runs evaluated {pol} and some did not "
                             f"({', '.join(lacking)}); tabulate them separately")
    out = pd.DataFrame(rows)
    half = ci95(out["learned_vs_algorithm1_tuned_pct"].to_numpy())
    mean = {"run": "mean", "episodes": int(out.episodes.sum()),
            **{c: float(out[c].mean()) for c in out.columns if c not in ("run", "episodes")},
            "ci95_pct": half}
    for c in [*(c for pairs in OPTIONAL_PAIRS.values() for c in pairs), *JOINT_PAIRS]:
        if c in out.columns:
            mean[c.replace("_pct", "_ci95_pct")] = ci95(out[c].to_numpy())
    return pd.concat([out, pd.DataFrame([mean])], ignore_index=True)


#: the knobs a rule's two levels are chosen from: ``algorithm1_tuned``'s grid, so that the
#: rules include the tuned single knob (both levels equal)
RULE_KNOBS = TUNING_GRID


def _background(env: Any) -> float:
    return float(env.timeline.background(env.shared.now).mean()) / env.cluster_spec.capacity_gbps


def _active(env: Any) -> float:
    return float(len(env.shared.active))


def _holding_time(env: Any) -> float:
    return float(env.timeline.duration[env.t])


#: a rule's feature: name -> (its value at the arriving group's moment, visible to a policy)
RULE_FEATURES: dict[str, tuple[Callable[[Any], float], bool]] = {
    "background": (_background, True), "active": (_active, True),
    "holding_time": (_holding_time, False)}


class KnobRule:
    """Algorithm 1's order with load knob ``low`` while ``feature`` is at most ``threshold``,
    ``high`` above it (an ``EnvPolicy`` of ``smart/MulticastOverTime-v0``, either action
    coding)."""

    def __init__(self, feature: str, threshold: float, low: float, high: float) -> None:
        if feature not in RULE_FEATURES:
            raise ValueError(f"unknown rule feature {feature!r}; known: "
                             f"{', '.join(RULE_FEATURES)}")
        self.name = f"knob_by_{feature}"
        self.feature, self.threshold = feature, float(threshold)
        self._value = RULE_FEATURES[feature][0]
        self.knobs = (float(low), float(high))
        self._low, self._high = _with_knob(float(low)), _with_knob(float(high))

    def reset(self, env: Any, seed: int) -> None:
        pass

    def act(self, obs: np.ndarray, env: Any) -> np.ndarray:
        rule = self._high if self._value(env) > self.threshold else self._low
        return rule(env, None)


class _Watch:
    """``algorithm1_tuned`` at ``knob``, recording each rule feature before every action."""

    name = "watch"

    def __init__(self, knob: float) -> None:
        self.seen: dict[str, list[float]] = {f: [] for f in RULE_FEATURES}
        self._act = _with_knob(float(knob))

    def reset(self, env: Any, seed: int) -> None:
        pass

    def act(self, obs: np.ndarray, env: Any) -> np.ndarray:
        for f, (value, _) in RULE_FEATURES.items():
            self.seen[f].append(value(env))
        return self._act(env, None)


def rule_table(episodes: int, env_overrides: Mapping[str, Any] | None = None,
               knobs: Sequence[float] = RULE_KNOBS, tuning_episodes: int = TUNING_EPISODES,
               say=print) -> pd.DataFrame:
    """The knob rules (module docstring) tuned on ``tuning_episodes`` tuning episodes (the
    seed stream ``algorithm1_tuned`` tunes on) and measured on ``episodes`` test episodes,
    paired with ``algorithm1_tuned``."""
    kw = overtime_env(env_overrides)
    tuning = tuning_seeds(tuning_episodes)
    test = episode_seeds(0, "test", int(episodes))
    knob, _ = tune_knob(ENV_ID, kw, episodes=int(tuning_episodes))
    knobs = sorted({float(k) for k in knobs} | {float(knob)})  # the tuned knob is a rule
    watch = _Watch(knob)
    ref_tune = float(run_episodes([watch], ENV_ID, kw, tuning)["return"].mean())
    ref = run_episodes([_Watch(knob)], ENV_ID, kw, test).set_index("seed").value
    # one knob for both levels first: a tie goes to the simpler rule
    pairs = [(k, k) for k in knobs] + [(lo, hi) for lo in knobs for hi in knobs if lo != hi]
    rows = []
    for feature, (_, visible) in RULE_FEATURES.items():
        t0 = time.perf_counter()
        thr = float(np.median(watch.seen[feature]))
        cands = [KnobRule(feature, thr, lo, hi) for lo, hi in pairs]
        means = [float(run_episodes([c], ENV_ID, kw, tuning)["return"].mean()) for c in cands]
        best = cands[int(np.argmax(means))]
        got = run_episodes([best], ENV_ID, kw, test).set_index("seed").value
        pct, half, n = _paired_pct(got, ref)
        rows.append({"rule": best.name, "visible": visible, "threshold": thr,
                     "knob_low": best.knobs[0], "knob_high": best.knobs[1],
                     "tuned_knob": float(knob),
                     "tuning_vs_algorithm1_tuned_pct": 100.0 * (max(means) / ref_tune - 1.0),
                     "episodes": n, "value": float(got.mean()),
                     "vs_algorithm1_tuned_pct": pct, "vs_algorithm1_tuned_ci95_pct": half})
        say(f"overtime rules: {best.name} tuned and measured in "
            f"{time.perf_counter() - t0:.0f} s")
    return pd.DataFrame(rows)
