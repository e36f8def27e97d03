"""``smart/MulticastOverTime-v0`` and its core (:mod:`envs.trees.timeline`): hand-computed
lifetimes and integrals, departures that release their load, the isolation bound above every
policy, the tuned and lookahead baselines, ``check_env`` and determinism."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pandas as pd
import pytest
from gymnasium.utils.env_checker import check_env

import envs  # noqa: F401  (registers smart/*)
from agents.episodes import episode_seeds, run_episodes
from agents.trees.suite import TUNED, baseline_policies, tune_knob
from envs.trees import CloningCostSwitch, MulticastError
from envs.trees.groups import ClusterSpec, ClusterState, GroupSpec
from envs.trees.solver import algorithm1
from envs.trees.timeline import (
    SharedCluster,
    Timeline,
    TimelineSpec,
    capped_weights,
    expected_weights,
    generate_timeline,
    isolation_bound,
    lifetime_weights,
)

SMALL = {"num_service_nodes": 8, "groups_per_episode": 15, "hypervisors": [5, 40],
         "arrival_rate": 2.0, "mean_duration": 5.0}
SPEC = ClusterSpec(num_service_nodes=3, background_gbps=(1.0, 4.0), capacity_gbps=32.0,
                   alpha=1.0, lam=1.0)


def _timeline(t, duration, n, r, base, amplitude=0.0, period=100.0) -> Timeline:
    m = len(base)
    return Timeline(np.asarray(t, float), np.asarray(duration, float),
                    np.asarray(n, np.int64), np.asarray(r, float), np.asarray(base, float),
                    np.zeros(m), amplitude, period)


def test_background_follows_its_diurnal_cycle() -> None:
    """``b_i(t) = base_i (1 + A sin(2 pi t / P + phase_i))``, one row per time for an array."""
    tl = Timeline(np.zeros(1), np.ones(1), np.array([3]), np.array([0.1]),
                  np.array([2.0, 4.0]), np.array([0.0, math.pi / 2]), 0.5, 100.0)
    assert tl.background(0.0) == pytest.approx([2.0, 6.0])
    assert tl.background(25.0) == pytest.approx([3.0, 4.0])
    assert np.allclose(tl.background(np.array([0.0, 25.0])), [[2.0, 6.0], [3.0, 4.0]])


def test_a_constant_background_integrates_exactly() -> None:
    """With no diurnal swing the lifetime integral of a weight is the weight times the stay,
    and the survival-weighted expectation is the weight itself."""
    tl = _timeline([0.0], [1.0], [3], [0.1], [8.0, 16.0, 0.0])
    w = capped_weights(np.array([8.0, 16.0, 0.0]), SPEC)
    assert w == pytest.approx([-math.log(0.75), -math.log(0.5), 0.0])
    assert lifetime_weights(tl, SPEC, 2.0, 5.0) == pytest.approx(3.0 * w)
    assert expected_weights(tl, SPEC, 2.0, 0.0, 7.0) == pytest.approx(w)


def test_a_group_earns_its_lifetime_value_and_leaves_with_its_load() -> None:
    """A group placed at t=1 for 2 time units on a constant background earns
    ``2 (U - lambda sum w)`` by t=10, and its load is gone after it left."""
    sw = CloningCostSwitch()
    tl = _timeline([1.0, 10.0], [2.0, 1.0], [4, 4], [0.5, 0.5], [8.0, 16.0, 4.0])
    sh = SharedCluster(SPEC, sw, tl)
    assert sh.advance(1.0) == 0.0
    res = algorithm1(4, 0.5, sh.state.weights(), sw, SPEC.lam)
    before = sh.state.loads.copy()
    p = sh.place(0, res.tree, 0.5)
    ids = res.selected
    w_after = capped_weights(sh.state.loads, SPEC)
    expect = 2.0 * (p.throughput - SPEC.lam * float(w_after[ids].sum()))
    assert len(sh.active) == 1
    assert sh.advance(10.0) == pytest.approx(expect)
    assert sh.active == [] and sh.departed == 1
    assert sh.state.loads == pytest.approx(before)
    with pytest.raises(MulticastError, match="time cannot go back"):
        sh.advance(9.0)


def test_the_isolation_bound_is_above_every_policy() -> None:
    """No policy earns more than the isolation bound, on any episode."""
    env = gym.make("smart/MulticastOverTime-v0", **SMALL)
    pols = baseline_policies(["algorithm1", "random10", "nvp", "binary", "lookahead"], SMALL)
    df = run_episodes(pols, "smart/MulticastOverTime-v0", SMALL, [0, 1, 2])
    assert (df.value <= df.bound + 1e-6).all()
    assert (df.value > 0).all()
    env.close()


def test_the_bound_of_one_group_is_algorithm1_on_its_mean_weights() -> None:
    """One group alone on a constant background: the bound is its stay times Algorithm 1's
    objective (3) on the current weights."""
    sw = CloningCostSwitch()
    tl = _timeline([0.5], [3.0], [6], [0.4], [8.0, 16.0, 4.0])
    st = ClusterState(SPEC, sw, tl.background(0.5))
    res = algorithm1(6, 0.4, st.weights(), sw, SPEC.lam)
    assert isolation_bound(tl, SPEC, sw) == pytest.approx([3.0 * res.value])


def test_bad_timelines_are_refused() -> None:
    """A background whose diurnal peak reaches the capacity, or a rate that is not > 0."""
    with pytest.raises(MulticastError, match="diurnal peak"):
        gym.make("smart/MulticastOverTime-v0", background_gbps=[4.0, 24.0],
                 background_amplitude=0.5)
    with pytest.raises(MulticastError, match="arrival_rate must be"):
        TimelineSpec(GroupSpec(), arrival_rate=0.0)
    with pytest.raises(MulticastError, match="background_amplitude"):
        TimelineSpec(GroupSpec(), background_amplitude=1.5)


def test_check_env_and_the_same_seed_gives_the_same_episode() -> None:
    check_env(gym.make("smart/MulticastOverTime-v0", **SMALL).unwrapped)
    env = gym.make("smart/MulticastOverTime-v0", **SMALL)
    pol = baseline_policies(["random10"], SMALL)[0]

    def episode(seed: int) -> tuple[list, float]:
        obs, _ = env.reset(seed=seed)
        pol.reset(env.unwrapped, seed)
        obs_seen, done, total = [obs], False, 0.0
        while not done:
            obs, r, done, _, info = env.step(pol.act(obs, env.unwrapped))
            obs_seen.append(obs)
            total += r
        assert info["episode_metrics"]["value"] == pytest.approx(
            total * env.unwrapped.reward_scale)
        return obs_seen, total

    a, b, c = episode(3), episode(3), episode(4)
    assert a[1] == b[1] and all(np.array_equal(x, y) for x, y in zip(a[0], b[0]))
    assert a[1] != c[1]
    tl = generate_timeline(env.unwrapped.timeline_spec, env.unwrapped.cluster_spec,
                           np.random.default_rng(0))
    assert np.all(np.diff(tl.t) > 0) and np.all(tl.duration > 0)


def test_tuned_baselines_tune_once_and_are_deterministic() -> None:
    """``algorithm1_tuned`` and ``lookahead`` choose their knob on tuning episodes of their
    own (the same knob every time), and unknown names are refused with the known ones."""
    assert set(TUNED) == {"algorithm1_tuned", "lookahead"}
    seeds = episode_seeds(0, "test", 2)
    one = run_episodes(baseline_policies(["lookahead"], SMALL), "smart/MulticastOverTime-v0",
                       SMALL, seeds)
    two = baseline_policies(["lookahead"], SMALL)
    again = run_episodes(two, "smart/MulticastOverTime-v0", SMALL, seeds)
    assert one["return"].tolist() == again["return"].tolist()
    assert two[0].knob in two[0].tuning and len(two[0].tuning) > 3
    with pytest.raises(ValueError, match=r"known: .*algorithm1_tuned"):
        baseline_policies(["algorithm2"], SMALL)
    with pytest.raises(ValueError, match="needs smart/MulticastOverTime-v0"):
        run_episodes(baseline_policies(["lookahead"], {}), "smart/MulticastTree-v0",
                     {"num_service_nodes": 8, "groups_per_episode": 3}, [0])


def test_overtime_tables_put_every_policy_beside_the_rollout_and_the_bound() -> None:
    """``trees.py figures=[overtime]``'s tables on a small configuration: every baseline on
    every episode, the rollout on the first, values below the bound, and the paired
    difference against ``algorithm1_tuned`` (0 for itself)."""
    from agents.trees.overtime import overtime_tables

    t = overtime_tables(2, 1, {"groups_per_episode": 6}, say=lambda _: None)
    df, summ = t["overtime"], t["overtime_summary"].set_index("policy")
    assert set(df.policy) == {"algorithm1", "algorithm1_tuned", "lookahead", "random10",
                              "nvp", "binary", "rollout"}
    assert (df.value <= df.bound + 1e-6).all()
    assert summ.loc["rollout", "episodes"] == 1 and summ.loc["nvp", "episodes"] == 2
    assert summ.loc["algorithm1_tuned", "vs_algorithm1_tuned_pct"] == pytest.approx(0.0)
    assert 0 < summ.loc["algorithm1", "of_bound"] <= 1


def test_learned_runs_are_paired_with_the_tuned_baseline_per_seed(tmp_path) -> None:
    """``overtime.learned``: each training run's learned policy against ``algorithm1_tuned``
    on that run's own test episodes, then the mean over runs with its 95% interval; a
    directory that is not a finished run is refused by name."""
    import pandas as pd

    from agents.trees.overtime import learned_table

    dirs = []
    for k, gain in enumerate((0.02, 0.04)):
        d = tmp_path / f"run{k}"
        d.mkdir()
        rows = [{"policy": p, "seed": s, "value": v * (1 + gain if p == "learned" else 1)}
                for s, v in ((1, 100.0), (2, 200.0))
                for p in ("learned", "algorithm1", "algorithm1_tuned", "lookahead")]
        pd.DataFrame(rows).to_csv(d / "per_episode.csv", index=False)
        dirs.append(d)
    t = learned_table(dirs).set_index("run")
    assert t.loc["run0", "learned_vs_algorithm1_tuned_pct"] == pytest.approx(2.0)
    assert t.loc["mean", "learned_vs_algorithm1_tuned_pct"] == pytest.approx(3.0)
    from scipy.stats import t as student

    assert t.loc["mean", "ci95_pct"] == pytest.approx(
        student.ppf(0.975, 1) * np.std([2.0, 4.0], ddof=1) / np.sqrt(2))
    with pytest.raises(FileNotFoundError, match=r"run9 has no per_episode\.csv"):
        learned_table([tmp_path / "run9"])
    assert "learned_vs_rollout_model_pct" not in t.columns
    # runs that also evaluated the planner: both paired with it (the learned policy 1% and
    # 3% below it, the planner 3% and 5% above the tuned baseline, hand-made)
    for k, (gain, plan_gain) in enumerate(((0.02, 0.03), (0.02, 0.05))):
        d = tmp_path / f"planned{k}"
        d.mkdir()
        rows = [{"policy": p, "seed": s,
                 "value": v * {"learned": 1 + gain, "rollout_model": 1 + plan_gain}.get(p, 1)}
                for s, v in ((1, 100.0), (2, 200.0))
                for p in ("learned", "algorithm1_tuned", "rollout_model")]
        pd.DataFrame(rows).to_csv(d / "per_episode.csv", index=False)
    t = learned_table([tmp_path / "planned0", tmp_path / "planned1"]).set_index("run")
    assert t.loc["planned0", "learned_vs_rollout_model_pct"] == pytest.approx(
        100 * (1.02 / 1.03 - 1))
    assert t.loc["mean", "rollout_model_vs_algorithm1_tuned_pct"] == pytest.approx(4.0)
    assert t.loc["mean", "rollout_model_vs_algorithm1_tuned_ci95_pct"] == pytest.approx(
        student.ppf(0.975, 1) * np.std([3.0, 5.0], ddof=1) / np.sqrt(2))
    assert t.loc["mean", "rollout_model"] == pytest.approx(
        np.mean([100 * 1.03, 200 * 1.03, 100 * 1.05, 200 * 1.05]))
    with pytest.raises(ValueError, match=r"some runs evaluated rollout_model .*\(run0\)"):
        learned_table([tmp_path / "run0", tmp_path / "planned1"])
    # a run that also evaluated its cloned start: the reinforcement phase paired with it
    d = tmp_path / "cloned"
    d.mkdir()
    pd.DataFrame([{"policy": p, "seed": s, "value": v * {"learned": 1.02, "clone": 1.01}.get(p, 1)}
                  for s, v in ((1, 100.0), (2, 200.0))
                  for p in ("learned", "algorithm1_tuned", "clone")]).to_csv(
        d / "per_episode.csv", index=False)
    t = learned_table([d]).set_index("run")
    assert t.loc["cloned", "learned_vs_clone_pct"] == pytest.approx(100 * (1.02 / 1.01 - 1))
    assert t.loc["cloned", "clone_vs_algorithm1_tuned_pct"] == pytest.approx(1.0)
    assert "learned_vs_rollout_model_pct" not in t.columns
    assert "clone_vs_rollout_model_pct" not in t.columns
    # the planner and the clone in the same runs: the clone paired with its teacher too
    for k, (clone_gain, plan_gain) in enumerate(((0.02, 0.01), (0.03, 0.04))):
        d = tmp_path / f"both{k}"
        d.mkdir()
        pd.DataFrame([{"policy": p, "seed": s, "value": v * {
            "learned": 1 + clone_gain, "clone": 1 + clone_gain,
            "rollout_model": 1 + plan_gain}.get(p, 1)}
            for s, v in ((1, 100.0), (2, 200.0))
            for p in ("learned", "algorithm1_tuned", "clone", "rollout_model")]).to_csv(
            d / "per_episode.csv", index=False)
    t = learned_table([tmp_path / "both0", tmp_path / "both1"]).set_index("run")
    per_run = [100 * (1.02 / 1.01 - 1), 100 * (1.03 / 1.04 - 1)]
    assert t.loc["both0", "clone_vs_rollout_model_pct"] == pytest.approx(per_run[0])
    assert t.loc["mean", "clone_vs_rollout_model_pct"] == pytest.approx(np.mean(per_run))
    assert t.loc["mean", "clone_vs_rollout_model_ci95_pct"] == pytest.approx(
        student.ppf(0.975, 1) * np.std(per_run, ddof=1) / np.sqrt(2))


def test_the_knob_coding_expresses_the_tuned_and_lookahead_baselines_exactly() -> None:
    """``action=knob``: a 2-value action (order blend, load knob); its ends are Algorithm 1's
    order and the lookahead's, so the baselines it expresses return exactly what they
    return in the node coding; the others and a bad coding are refused by name."""
    knob = SMALL | {"action": "knob"}
    env = gym.make("smart/MulticastOverTime-v0", **knob)
    assert env.action_space.shape == (2,)
    check_env(gym.make("smart/MulticastOverTime-v0", **knob).unwrapped)
    seeds = episode_seeds(0, "test", 2)
    names = ["algorithm1", "algorithm1_tuned", "lookahead"]
    a = run_episodes(baseline_policies(names, SMALL), "smart/MulticastOverTime-v0", SMALL,
                     seeds)
    b = run_episodes(baseline_policies(names, knob), "smart/MulticastOverTime-v0", knob, seeds)
    assert a["return"].tolist() == b["return"].tolist()
    assert a.value.nunique() > 1
    # the ends of the blend: ascending current weights, ascending expected weights
    u = env.unwrapped
    u.reset(seed=5)
    for _ in range(6):
        u.step(np.array([0.3, 0.0], np.float32))
    avail = u.shared.state.available(u.group[1])
    stay = expected_weights(u.timeline, u.cluster_spec, u.shared.now, u.shared.group_load,
                            u.timeline_spec.mean_duration)
    now = u.shared.state.weights()
    assert not np.array_equal(np.argsort(now[avail], kind="stable"),
                              np.argsort(stay[avail], kind="stable"))
    order, lam = u.decode(np.array([-1.0, 0.0], np.float32))
    assert order.tolist() == avail[np.argsort(now[avail], kind="stable")].tolist()
    assert lam == pytest.approx(u.cluster_spec.lam)
    order, lam = u.decode(np.array([1.0, 1.0], np.float32))
    assert order.tolist() == avail[np.argsort(stay[avail], kind="stable")].tolist()
    assert lam == pytest.approx(4.0 * u.cluster_spec.lam)
    with pytest.raises(ValueError, match="random10 baseline needs action=nodes"):
        run_episodes(baseline_policies(["random10"], knob), "smart/MulticastOverTime-v0",
                     knob, seeds[:1])
    with pytest.raises(MulticastError, match=r"action has shape \(17,\)"):
        u.decode(np.zeros(17, np.float32))
    with pytest.raises(MulticastError, match="action must be one of"):
        gym.make("smart/MulticastOverTime-v0", action="order")


def test_knob_rules_are_tuned_on_tuning_episodes_and_paired_on_test() -> None:
    """``trees.py figures=[overtime_rules]``: one row per rule feature, the threshold the
    feature's median under ``algorithm1_tuned`` on the tuning episodes, two knobs (equal
    ones allowed) of the grid and the tuned knob, and the held-out difference paired with
    ``algorithm1_tuned``; a rule whose two knobs are the tuned one is ``algorithm1_tuned``
    itself."""
    from agents.trees.overtime import RULE_FEATURES, KnobRule, rule_table
    small = SMALL | {"groups_per_episode": 8}
    t = rule_table(2, small, knobs=(0.0, 0.3), tuning_episodes=2,
                   say=lambda _: None).set_index("rule")
    assert list(t.index) == [f"knob_by_{f}" for f in RULE_FEATURES]
    assert t.visible.tolist() == [True, True, False]
    assert set(t.knob_low) | set(t.knob_high) <= {0.0, 0.3, t.tuned_knob.iloc[0]}
    assert (t.tuning_vs_algorithm1_tuned_pct >= -1e-9).all()  # the tuned knob is a rule
    assert (t.episodes == 2).all() and np.isfinite(t.vs_algorithm1_tuned_pct).all()
    from agents.trees.overtime import _Watch
    from agents.trees.suite import tuning_seeds

    watch = _Watch(t.tuned_knob.iloc[0])
    run_episodes([watch], "smart/MulticastOverTime-v0", small, tuning_seeds(2))
    for f in RULE_FEATURES:
        assert t.loc[f"knob_by_{f}", "threshold"] == pytest.approx(np.median(watch.seen[f]))
    seeds = episode_seeds(0, "test", 2)
    tuned = baseline_policies(["algorithm1_tuned"], small)
    ref = run_episodes(tuned, "smart/MulticastOverTime-v0", small, seeds)
    k = tuned[0].knob
    same = run_episodes([KnobRule("active", 3.0, k, k)], "smart/MulticastOverTime-v0", small,
                        seeds)
    assert same["return"].tolist() == ref["return"].tolist()
    with pytest.raises(ValueError, match="unknown rule feature 'hour'"):
        KnobRule("hour", 0.0, 0.0, 0.1)


def test_a_resampled_future_keeps_the_present_and_redraws_what_is_unknown() -> None:
    """``resampled``: the model-based rollout's future. The past, the arriving group's size
    and rate, the background and the active groups' loads stay; the holding times, the
    active groups' departures and the groups to come are drawn afresh (by the given RNG
    alone), and the environment itself is untouched."""
    from agents.trees.planner import resampled

    env = gym.make("smart/MulticastOverTime-v0", **SMALL).unwrapped
    env.reset(seed=2)
    for _ in range(5):
        env.step(np.zeros(env.action_space.shape, np.float32))
    tl, t = env.timeline, env.t
    before = (tl.t.copy(), tl.duration.copy(), [g.depart for g in env.shared.active])
    a = resampled(env, np.random.default_rng(1))
    b = resampled(env, np.random.default_rng(1))
    c = resampled(env, np.random.default_rng(2))
    assert np.array_equal(env.timeline.t, before[0])
    assert np.array_equal(env.timeline.duration, before[1])
    assert [g.depart for g in env.shared.active] == before[2]
    assert a.timeline is a.shared.timeline
    ta = a.timeline
    assert np.array_equal(ta.t[:t + 1], tl.t[:t + 1]) and ta.n[t] == tl.n[t]
    assert ta.rate_gbps[t] == tl.rate_gbps[t]
    assert np.array_equal(ta.base, tl.base) and np.array_equal(ta.phase, tl.phase)
    assert not np.array_equal(ta.t[t + 1:], tl.t[t + 1:])
    assert np.all(np.diff(ta.t) > 0) and ta.duration[t] != tl.duration[t]
    assert [g.ids.tolist() for g in a.shared.active] == [g.ids.tolist()
                                                         for g in env.shared.active]
    assert all(g.depart > env.shared.now for g in a.shared.active)
    assert np.array_equal(ta.t, b.timeline.t) and not np.array_equal(ta.t, c.timeline.t)
    assert np.array_equal(a.shared.state.loads, env.shared.state.loads)
    assert [g.depart for g in a.shared.active] != before[2]
    assert not np.array_equal(ta.n[t + 1:], tl.n[t + 1:])
    # nothing of the true future leaks: a twin whose unknown future differs resamples to
    # the same copy, which plays the same episode
    import copy
    import dataclasses

    twin = copy.deepcopy(env)
    g = np.random.default_rng(9)
    k = len(tl) - t - 1
    twin.timeline = twin.shared.timeline = dataclasses.replace(
        twin.timeline, t=np.concatenate([tl.t[:t + 1], tl.t[t] + np.cumsum(g.uniform(
            0.1, 1.0, k))]), duration=np.concatenate([tl.duration[:t], g.uniform(1, 9, k + 1)]),
        n=np.concatenate([tl.n[:t + 1], g.integers(5, 40, k)]),
        rate_gbps=np.concatenate([tl.rate_gbps[:t + 1], g.uniform(0.05, 0.8, k)]))
    twin.shared.active = [dataclasses.replace(x, depart=x.depart + 1.0)
                          for x in twin.shared.active]
    x, y = resampled(env, np.random.default_rng(5)), resampled(twin, np.random.default_rng(5))
    for f in ("t", "n", "rate_gbps"):
        assert np.array_equal(getattr(x.timeline, f), getattr(y.timeline, f)), f
    assert np.array_equal(x.timeline.duration[t:], y.timeline.duration[t:])
    assert [g.depart for g in x.shared.active] == [g.depart for g in y.shared.active]

    def play(e) -> float:
        total, done = 0.0, False
        while not done:
            _, r, done, _, _ = e.step(np.full(e.action_space.shape, 0.2, np.float32))
            total += r
        return total
    assert play(x) == play(y)


def test_planning_table_sets_both_rollouts_beside_the_tuned_baseline() -> None:
    """``trees.py figures=[overtime_planning]``: the clairvoyant rollout, the rollout on
    sampled futures and the lookahead, paired with ``algorithm1_tuned`` on the same
    episodes; the same seed gives the same table."""
    from agents.trees.overtime import planning_table

    small = SMALL | {"groups_per_episode": 6}
    t = planning_table(2, 2, small, say=lambda _: None).set_index("policy")
    assert list(t.index) == ["algorithm1_tuned", "lookahead", "rollout", "rollout_model"]
    assert t.sees_future.tolist() == [False, False, True, False]
    assert t.loc["rollout_model", "samples"] == 2 and (t.episodes == 2).all()
    assert t.loc["algorithm1_tuned", "vs_algorithm1_tuned_pct"] == pytest.approx(0.0)
    again = planning_table(2, 2, small, say=lambda _: None).set_index("policy")
    assert again.value.tolist() == t.value.tolist()


def test_the_signal_table_follows_rollout_model_and_measures_its_candidates() -> None:
    """``trees.py figures=[overtime_signal]``: one row per group along the planner.s
    own episode (its rewards sum to that policy's return on the same seed), the best mean
    candidate never below the base's, the returns needed computed from the row's own
    gain and noise; the same seed gives the same table; fewer than 2 futures are refused."""
    from agents.trees.overtime import signal_table
    from agents.trees.planner import ModelPlanner

    small = SMALL | {"groups_per_episode": 5}
    t = signal_table(1, 3, small, say=lambda _: None)
    g, summ = t["overtime_signal_groups"], t["overtime_signal"].iloc[0]
    assert len(g) == 5 and g.group.tolist() == [0, 1, 2, 3, 4]
    (seed,) = episode_seeds(0, "test", 1)
    planner = ModelPlanner(3, knob=tune_knob("smart/MulticastOverTime-v0", small)[0])
    ret = run_episodes([planner], "smart/MulticastOverTime-v0", small, [seed])["return"]
    assert g.reward.sum() == pytest.approx(float(ret.iloc[0]))
    assert (g.gain >= 0).all() and (g.spread >= g.gain).all() and (g.sd_return > 0).all()
    moved = g[g.gain > 0]
    assert summ.groups == 5 and summ.groups_best_not_base == len(moved)
    for r in moved.itertuples():
        assert r.returns_independent == pytest.approx((2 * np.sqrt(2) * r.sd_return / r.gain) ** 2)
        assert r.returns_paired == pytest.approx((2 * r.sd_paired / r.gain) ** 2)
    again = signal_table(1, 3, small, say=lambda _: None)["overtime_signal_groups"]
    pd.testing.assert_frame_equal(again, g)
    with pytest.raises(ValueError, match="signal_samples must be >= 2"):
        signal_table(1, 1, small, say=lambda _: None)


def test_the_model_planner_is_a_baseline_and_a_teacher() -> None:
    """``rollout_model`` by name: an ``EnvPolicy`` that plans each group on sampled futures
    (deterministic for a seed), refused outside ``smart/MulticastOverTime-v0`` and with no
    future to sample."""
    from agents.trees.planner import ModelPlanner

    small = SMALL | {"groups_per_episode": 4}
    (pol,) = baseline_policies(["rollout_model"], small)
    assert isinstance(pol, ModelPlanner) and pol.name == "rollout_model"
    a = run_episodes([pol], "smart/MulticastOverTime-v0", small, [3, 4])
    b = run_episodes(baseline_policies(["rollout_model"], small), "smart/MulticastOverTime-v0",
                     small, [3, 4])
    assert a["return"].tolist() == b["return"].tolist()
    again = run_episodes([pol], "smart/MulticastOverTime-v0", small, [4])  # reseeded per episode
    assert again["return"].tolist() == a["return"].tolist()[1:]
    assert pol.knob is not None
    with pytest.raises(ValueError, match="needs smart/MulticastOverTime-v0"):
        run_episodes(baseline_policies(["rollout_model"], {}), "smart/MulticastTree-v0",
                     {"num_service_nodes": 8, "groups_per_episode": 3}, [0])
    with pytest.raises(ValueError, match="at least one sampled future"):
        ModelPlanner(samples=0)
    with pytest.raises(ValueError, match=r"known: .*rollout_model"):
        baseline_policies(["rollout_models"], small)


def test_the_planner_chooses_the_same_with_any_number_of_workers() -> None:
    """``rollout_model`` with 2 processes scoring the candidates takes the same action at
    every group as in one process, and both are the plain one-step rollout written out here
    (every candidate on the same sampled futures, the best kept, equal ones going to the
    base's action); the trial copies
    skip the terminal metrics without changing a reward."""
    import copy

    from agents.trees.planner import ModelPlanner, candidates, resampled
    from agents.trees.suite import _with_knob

    small = SMALL | {"groups_per_episode": 5, "action": "knob"}
    base = _with_knob(0.15)

    def rollout(env, futures):
        values = []
        for cand in candidates():
            v = 0.0
            for world in futures:
                trial = copy.deepcopy(world)
                _, r, end, _, info = trial.step(cand(trial, None))
                v += r
                while not end:
                    _, r, end, _, info = trial.step(base(trial, None))
                    v += r
                assert "episode_metrics" in info  # the written-out rollout keeps them
            values.append(v)
        best = [c(env, None) for c, v in zip(candidates(), values) if v == max(values)]
        ref = base(env, None)  # among equal best: the nearest to the base's action
        return min(best, key=lambda a: float(np.abs(a - ref).sum()))

    plans = {}
    for workers in (1, 2):
        env = gym.make("smart/MulticastOverTime-v0", **small)
        pol = ModelPlanner(samples=2, knob=0.15, workers=workers)
        obs, _ = env.reset(seed=21)
        pol.reset(env.unwrapped, 21)
        twin_rng = np.random.default_rng([21, 7919])  # the planner's own futures stream
        acts, done = [], False
        while not done:
            futures = [resampled(env.unwrapped, twin_rng) for _ in range(2)]
            a = pol.act(obs, env.unwrapped)
            np.testing.assert_array_equal(a, rollout(env.unwrapped, futures))
            acts.append(a)
            obs, _, done, _, _ = env.step(a)
        plans[workers] = np.stack(acts)
        assert (pol._pool._ex is not None) == (workers > 1)  # scored in processes
        pol.close()
        assert pol._pool._ex is None
    np.testing.assert_array_equal(plans[1], plans[2])
    with pytest.raises(ValueError, match="at least one worker"):
        ModelPlanner(workers=0)


def test_equal_best_values_go_to_the_candidate_nearest_the_base_action() -> None:
    """Where candidates tie (the same trees), the planner's action (and a clone's label) is
    the one nearest the base policy's, not the first in the list: hand-made actions."""
    from agents.trees.planner import nearest_best

    def act(*a):
        return lambda env, g: np.array(a, dtype=float)

    cands = [act(-1.0, -0.5), act(-1.0, 0.0), act(-1.0, 0.15), act(1.0, 0.15), act(-1.0, 0.6)]
    base = act(-1.0, 0.15)
    # -0.5, 0.15 (both orders) tie: Algorithm 1's order with the base's knob, not -0.5
    np.testing.assert_array_equal(nearest_best(None, base, cands, [3, 1, 3, 3, 2]), [-1, 0.15])
    # the other order alone ties with -0.5: the nearer (distance 0.65 against 2.0)
    np.testing.assert_array_equal(nearest_best(None, base, cands, [3, 1, 2, 3, 2]), [-1, -0.5])
    # a single best is kept however far it is; equal distances (0.25) go to the first
    np.testing.assert_array_equal(nearest_best(None, base, cands, [0, 1, 2, 3, 9]), [-1, 0.6])
    np.testing.assert_array_equal(nearest_best(None, act(-1.0, 0.5), [
        act(-1.0, 0.75), act(-1.0, 0.25), act(-1.0, 0.0)], [5, 5, 5]), [-1, 0.75])


def test_terminal_metrics_can_be_left_out_without_changing_the_episode() -> None:
    env = gym.make("smart/MulticastOverTime-v0", **SMALL).unwrapped
    quiet = gym.make("smart/MulticastOverTime-v0", **SMALL).unwrapped
    quiet.terminal_metrics = False
    for e in (env, quiet):
        e.reset(seed=8)
    done = False
    while not done:
        a = env.action_space.sample() * 0.0
        _, r1, done, _, i1 = env.step(a)
        _, r2, _, _, i2 = quiet.step(a)
        assert r1 == r2
    assert "episode_metrics" in i1 and "episode_metrics" not in i2


def test_a_planning_pool_replaces_a_dead_worker_and_refuses_what_it_cannot_plan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker killed between two calls (out of memory, a signal) costs one restart, not
    the run; the values are those of the serial path. No candidate, or a value that is not
    finite, is refused."""
    import os
    import signal

    from agents.trees.planner import PlanningPool, candidates, plan
    from agents.trees.suite import _with_knob

    env = gym.make("smart/MulticastOverTime-v0",
                   **(SMALL | {"groups_per_episode": 3, "action": "knob"})).unwrapped
    env.reset(seed=2)
    base, cands = _with_knob(0.15), candidates()
    serial = PlanningPool(1).values(cands, base, [env])
    pool = PlanningPool(2)
    try:
        assert pool.values(cands, base, [env]) == serial
        assert pool._ex is not None
        # one worker killed: the executor then ends the others itself (so killing each in
        # turn would race with it)
        proc = next(iter(pool._ex._processes.values()))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert pool.values(cands, base, [env]) == serial
    finally:
        pool.close()
    with pytest.raises(ValueError, match="at least one candidate"):
        plan(env, base, [])
    with pytest.raises(ValueError, match="at least one worker"):
        PlanningPool(0)
    from agents.trees import planner

    monkeypatch.setattr(planner, "_value", lambda cand, base, worlds: float("nan"))
    with pytest.raises(ValueError, match="not finite"):
        plan(env, base, cands)
