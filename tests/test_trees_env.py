"""``smart/MulticastTree-v0``, its suite, the switch model and profile tables, and the Figs. 8-11
experiment on a tiny configuration."""

from __future__ import annotations

import math
from pathlib import Path

import gymnasium as gym
import numpy as np
import pandas as pd
import pytest
from gymnasium.utils.env_checker import check_env
from hydra import compose, initialize_config_dir
from mlflow import MlflowClient

import envs  # noqa: F401  (registers smart/*)
from agents.config import CONFIG_DIR
from agents.episodes import run_episodes
from agents.trees.experiment import run_trees
from agents.trees.solver import algorithm1
from agents.trees.suite import baseline_policies
from envs.trees import (
    CloningCostSwitch,
    MulticastError,
    ProfileSwitch,
    load_profile,
    switch_from_spec,
    write_profile,
)
from envs.trees.env import lam_multiplier
from envs.trees.switch import PAPER_FACTS, PROFILES_DIR

SMALL = {"num_service_nodes": 8, "groups_per_episode": 12, "hypervisors": [5, 40]}


def rollout(env: gym.Env, seed: int, policy) -> tuple[list, list, dict]:
    obs, _ = env.reset(seed=seed)
    pol = policy
    pol.reset(env.unwrapped, seed)
    obss, rews, done, info = [obs], [], False, {}
    while not done:
        obs, r, term, trunc, info = env.step(pol.act(obs, env.unwrapped))
        obss.append(obs)
        rews.append(r)
        done = term or trunc
    return obss, rews, info


# ---- the switch model ----

def test_parametric_g_fits_the_papers_facts_and_has_the_model_properties() -> None:
    sw = CloningCostSwitch()
    assert sw.g(1) == pytest.approx(0.8)
    for d, ratio in PAPER_FACTS:
        assert sw.g(d) / sw.g(1) == pytest.approx(ratio, rel=0.015)
    d = np.arange(1, 2001)
    g = sw.g_many(d)
    u = np.concatenate([[0.0], d * g])
    assert np.all(np.diff(g) < 0) and np.all(np.diff(u) > 0) and np.all(np.diff(u, 2) < 0)
    assert sw.f(3, 0.1) == 0.1 and sw.f(3, 0.8) == pytest.approx(sw.g(3))
    assert sw.U(0, 0.5) == 0.0 and sw.U(1, 0.5) == 0.5  # Theorem 1's assumptions


def test_shipped_fit_table_matches_the_parametric_model() -> None:
    table = switch_from_spec("profile:cloning_cost_fit")
    sw = CloningCostSwitch()
    assert table.max_degree >= 256
    d = np.arange(1, table.max_degree + 1)
    assert np.allclose(table.g_many(d), sw.g_many(d), rtol=1e-8)
    assert table.concave


def test_measured_profile_is_shipped_and_valid() -> None:
    path = PROFILES_DIR / "linux_bridge.csv"
    assert path.is_file(), f"the measured Linux-bridge profile {path} is missing"
    sw = load_profile(path)
    assert sw.max_degree >= 2 and sw.g(1) > 0


def test_profile_table_round_trip_and_extrapolation(tmp_path: Path) -> None:
    p = write_profile(tmp_path / "t.csv", [0.8, 0.5, 0.4], header=["made by a test"])
    sw = load_profile(p)
    assert sw.g(2) == 0.5 and sw.g(6) == pytest.approx(3 * 0.4 / 6)  # flat total beyond
    assert np.allclose(sw.g_many(np.array([1, 3, 6])), [0.8, 0.4, 0.2])


@pytest.mark.parametrize("text, match", [
    ("d,g_gbps\n1,0.8\n2,0.9\n", r"non-increasing, but g\(2\)"),
    ("d,g_gbps\n1,0.8\n2,0.0\n", r"g\(2\) = 0.0 is not a positive rate"),
    ("d,g_gbps\n1,0.8\n2,-1\n", "not a positive rate"),
    ("d,g_gbps\n1,0.8\n2,0.3\n", r"d g\(d\) must be non-decreasing"),
    ("d,g_gbps\n1,0.8\n3,0.5\n", "row 3 has d = 3, expected 2"),
    ("d,rate\n1,0.8\n", "columns d,g_gbps"),
    ("d,g_gbps\n1,abc\n", "not a number pair"),
    ("d,g_gbps\n", "empty table"),
])
def test_bad_profile_tables_are_refused(tmp_path: Path, text: str, match: str) -> None:
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(MulticastError, match=match):
        load_profile(p)


def test_bad_switch_specs() -> None:
    with pytest.raises(MulticastError, match="does not exist"):
        switch_from_spec("profile:no_such_profile")
    with pytest.raises(MulticastError, match="cloning_cost"):
        switch_from_spec("ovs")
    with pytest.raises(MulticastError, match="rho"):
        CloningCostSwitch(rho=0.0)
    with pytest.raises(MulticastError, match="non-increasing"):
        ProfileSwitch((0.5, 0.6))


# ---- the environment ----

def test_check_env_default_and_small() -> None:
    check_env(gym.make("smart/MulticastTree-v0").unwrapped)
    check_env(gym.make("smart/MulticastTree-v0", **SMALL).unwrapped)


def test_same_seed_same_episode_other_seed_differs() -> None:
    pol = baseline_policies(["random10"], SMALL)[0]
    a = rollout(gym.make("smart/MulticastTree-v0", **SMALL), 3, pol)
    b = rollout(gym.make("smart/MulticastTree-v0", **SMALL), 3, pol)
    c = rollout(gym.make("smart/MulticastTree-v0", **SMALL), 4, pol)
    assert all(np.array_equal(x, y) for x, y in zip(a[0], b[0])) and a[1] == b[1]
    assert a[2]["episode_metrics"] == b[2]["episode_metrics"]
    assert a[1] != c[1]


def test_algorithm1_baseline_is_algorithm1_and_reward_is_objective3() -> None:
    env = gym.make("smart/MulticastTree-v0", **SMALL)
    u = env.unwrapped
    pol = baseline_policies(["algorithm1"], SMALL)[0]
    obs, _ = env.reset(seed=0)
    pol.reset(u, 0)
    done = False
    while not done:
        n, r = u.group
        avail = u.cluster.available(r)
        want = algorithm1(n, r, u.cluster.weights(), u.switch, u.cluster_spec.lam, avail)
        _order, lam_eff = u.decode(pol.act(obs, u))
        assert lam_eff == u.cluster_spec.lam
        loads = u.cluster.loads.copy()
        obs, rew, done, _, info = env.step(pol.act(obs, u))
        assert info["k"] == want.k
        assert rew * u.reward_scale == pytest.approx(want.value, rel=1e-9)
        # the employed nodes' workloads grew, nothing else did
        grew = np.flatnonzero(u.cluster.loads > loads)
        assert set(grew) == set(want.selected)


def test_action_decoding() -> None:
    env = gym.make("smart/MulticastTree-v0", **SMALL)
    u = env.unwrapped
    env.reset(seed=1)
    a = u.encode([5, 2, 7], knob=0.5)
    order, lam_eff = u.decode(a)
    assert list(order) == [5, 2, 7]
    assert lam_eff == pytest.approx(u.cluster_spec.lam * lam_multiplier(0.5))
    none = -np.ones(u.action_space.shape, np.float32)
    none[3] = -0.95  # every score excluded: the best-scoring available node alone
    assert list(u.decode(none)[0]) == [3]
    assert lam_multiplier(-1.0) == 0.0 and lam_multiplier(0.0) == 1.0
    with pytest.raises(MulticastError, match="shape"):
        u.decode(np.zeros(3))


def test_suite_baselines_run_and_unknown_names_are_refused() -> None:
    names = ["algorithm1", "random10", "nvp", "binary"]
    df = run_episodes(baseline_policies(names, SMALL), "smart/MulticastTree-v0", SMALL, [0, 1])
    assert list(df.policy.unique()) == names
    for col in ("objective_gbps", "mean_ratio", "mean_k", "load_std_gbps", "dropped"):
        assert col in df.columns
    assert (df[df.policy == "nvp"].mean_k == 1.0).all()
    by = df.groupby("policy")["return"].mean()
    assert by["algorithm1"] > by["nvp"]  # the per-group optimum beats NVP in sum
    with pytest.raises(ValueError, match="known: algorithm1"):
        baseline_policies(["ovs"], SMALL)


def test_bad_env_arguments() -> None:
    with pytest.raises(MulticastError, match="hypervisors"):
        gym.make("smart/MulticastTree-v0", hypervisors=[1, 5])
    with pytest.raises(MulticastError, match="capacity"):
        gym.make("smart/MulticastTree-v0", background_gbps=[0, 40])
    env = gym.make("smart/MulticastTree-v0", **SMALL)
    with pytest.raises(MulticastError, match="before reset"):
        env.unwrapped.step(np.zeros(env.action_space.shape, np.float32))


# ---- the Figs. 8-11 experiment ----

def test_experiment_tiny(tmp_path: Path) -> None:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="trees", overrides=[
            "seeds=[0]", "groups.num_groups=8", "cluster.num_service_nodes=30",
            "lambdas=[1.0,30.0]", "fig8.hypervisors=[2,4,6,8]", f"out_dir={tmp_path / 'out'}",
            f"logger.tracking_uri=sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}",
            f"logger.artifact_location={tmp_path / 'mlruns' / 'artifacts'}"])
    res = run_trees(cfg)
    out = Path(res["out_dir"])
    for name in ("fig8.csv", "groups.csv", "workloads.csv", "summary.csv",
                 "fig11_summary.csv", "fig8_point_to_point.png", "fig9_ratio_cdf.png",
                 "fig10_workload_cdf.png", "fig11a_lambda.png", "fig11b_lambda.png"):
        assert (out / name).is_file(), name
    fig8 = pd.read_csv(out / "fig8.csv").pivot(index="hypervisors", columns="topology",
                                               values="receiving_rate_gbps")
    assert (fig8["path"] >= fig8["binary"] - 1e-12).all()
    assert (fig8.loc[8, "path"] > fig8.loc[8, "star"])
    summ = pd.read_csv(out / "summary.csv").set_index("scheme")
    assert set(summ.index) == {"algorithm1", "algorithm1_paper", "random10", "nvp", "binary"}
    assert summ.loc["nvp", "mean_k"] == 1.0
    assert summ.loc["algorithm1", "mean_objective"] >= summ.loc["nvp", "mean_objective"]
    grp = pd.read_csv(out / "groups.csv")
    assert len(grp) == 5 * 8 and grp.ratio.between(0, 1 + 1e-9).all()
    f11 = pd.read_csv(out / "fig11_summary.csv").set_index("lam")
    assert f11.loc[1.0, "mean_k"] >= f11.loc[30.0, "mean_k"]  # small lambda: more nodes
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("smart-dsmd-trees")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    arts = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert "plots/fig9_ratio_cdf.png" in arts and "plots/fig8_point_to_point.png" in arts
    assert math.isfinite(run.data.metrics["algorithm1/mean_ratio"])


def test_experiment_refuses_unknown_figures_and_unread_learned_runs(tmp_path: Path) -> None:
    """A figure name that is not one of ``FIGURES`` and ``overtime.learned`` without a
    figure that reads it are refused by name before anything runs."""
    def cfg(*overrides: str):
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return compose(config_name="trees", overrides=[
                f"out_dir={tmp_path / 'out'}", *overrides,
                f"logger.tracking_uri=sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"])
    with pytest.raises(ValueError, match=r"figures: unknown \['fig12'\]; known: fig8"):
        run_trees(cfg("figures=[fig8,fig12]"))
    with pytest.raises(ValueError, match=r"overtime.learned is read by figures=.overtime.,"):
        run_trees(cfg("figures=[fig8]", f"overtime.learned=[{tmp_path}]"))
    with pytest.raises(ValueError, match=r"figures=\[overtime_learned\] tabulates "):
        run_trees(cfg("figures=[overtime_learned]"))
    with pytest.raises(ValueError, match=r"overtime.workers must be >= 1 or null"):
        run_trees(cfg("figures=[fig8]", "overtime.workers=0"))
    with pytest.raises(ValueError, match=r"overtime.signal_samples must be >= 2"):
        run_trees(cfg("figures=[overtime_signal]", "overtime.signal_samples=1"))
    assert not (tmp_path / "out" / "fig8.csv").exists()
