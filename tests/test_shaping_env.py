"""``smart/Shaping-v0`` (envs/shaping/env.py), its suite (agents/shaping/suite.py) and the
Figs. 5-6 reproduction (agents/shaping/experiment.py) on a tiny configuration."""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hydra import compose, initialize_config_dir

import envs  # noqa: F401  (registers smart/*)
from agents.config import CONFIG_DIR
from agents.episodes import run_episodes
from agents.shaping.suite import baseline_policies
from envs.shaping.env import ShapingEnv, jain_index
from envs.shaping.simulator import ShapingSimulator
from envs.shaping.sincon import ShapingError

KW = {"tenants": 2, "switches_per_tenant": 4, "duration_s": 1.0, "period_s": 0.1,
      "sim": {"edge_switches": 2}}


def test_check_env():
    env = gym.make("smart/Shaping-v0", **KW)
    check_env(env.unwrapped, skip_render_check=True)
    assert env.action_space.shape == (16,) and env.observation_space.shape == (49,)


def _rollout(seed: int, actions: np.ndarray):
    env = gym.make("smart/Shaping-v0", **KW)
    obs, _ = env.reset(seed=seed)
    out = [obs]
    rewards = []
    for a in actions:
        obs, r, term, trunc, info = env.step(a)
        out.append(obs)
        rewards.append(r)
    assert term and not trunc
    return np.array(out), np.array(rewards), info["episode_metrics"]


def test_same_seed_same_episode():
    acts = np.random.default_rng(0).uniform(-1, 1, (10, 16)).astype(np.float32)
    o1, r1, m1 = _rollout(7, acts)
    o2, r2, m2 = _rollout(7, acts)
    o3, _, _ = _rollout(8, acts)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(r1, r2)
    assert m1 == m2
    assert not np.array_equal(o1, o3)
    assert all(isinstance(v, float) and np.isfinite(v) for v in m1.values())


def test_action_encoding_is_exact_and_unshaped_at_plus_one():
    env = ShapingEnv(**KW)
    limits = np.stack([np.geomspace(env.eps * env.g, env.g, env.n)] * 2)
    np.testing.assert_allclose(env.decode_action(env.encode_limits(limits)), limits, rtol=1e-6)
    assert np.all(env.decode_action(np.ones(2 * env.n)) == env.g)
    with pytest.raises(ShapingError, match="action must be 16 finite values"):
        env.decode_action(np.zeros(3))


def test_none_baseline_is_the_unshaped_simulator():
    """The ``none`` baseline's actions make the env run exactly the unshaped simulator."""
    env = ShapingEnv(**KW)
    (pol,) = baseline_policies(["none"], KW)
    obs, info = env.reset(seed=3)
    pol.reset(env, 3)
    done = False
    while not done:
        obs, _, done, _, _ = env.step(pol.act(obs, env))
    ref = ShapingSimulator(env.cfg, "none", info["episode_seed"])
    ref.run_until(env.cfg.duration_s)
    for d in range(2):
        np.testing.assert_array_equal(env.sim.links[d].delivered, ref.links[d].delivered)


def test_baselines_run_through_the_contract_and_differ():
    kw = {**KW, "sim": {"edge_switches": 2, "global_throughput": 2e5}}  # limits bind
    pols = baseline_policies(["sincon", "static", "none"], kw)
    df = run_episodes(pols, "smart/Shaping-v0", kw, seeds=[1, 2])
    assert list(df.policy.unique()) == ["sincon", "static", "none"]
    assert {"setup_time_mean_s", "read_tput_std_Bps", "fairness_mean"} <= set(df.columns)
    assert df.groupby("policy")["return"].mean().nunique() == 3
    with pytest.raises(ShapingError, match="unknown shaping baselines \\['vita'\\]"):
        baseline_policies(["vita"], KW)


def test_sincon_baseline_adapts_limits():
    kw = {**KW, "sim": {"edge_switches": 2, "global_throughput": 2e5}}  # limits bind
    env = ShapingEnv(**kw)
    (pol,) = baseline_policies(["sincon"], kw)
    obs, _ = env.reset(seed=0)
    pol.reset(env, 0)
    for _ in range(10):
        obs, *_ = env.step(pol.act(obs, env))
    calc = pol.calcs[0]
    assert calc.checks > 0 and (calc.growths > 0 or calc.resets > 0)
    np.testing.assert_allclose(env.policies[0].limits, calc.limits, rtol=1e-6)


def test_bad_env_arguments_are_named():
    with pytest.raises(ShapingError, match="unknown reward keys"):
        ShapingEnv(reward={"kappa": 1.0})
    with pytest.raises(ShapingError, match="multiple of period_s"):
        ShapingEnv(duration_s=1.05, period_s=0.1)
    with pytest.raises(ShapingError, match="min_limit_share"):
        ShapingEnv(min_limit_share=0.0)
    assert jain_index(np.zeros(3)) == 1.0 and jain_index(np.array([1.0, 0.0])) == 0.5


def test_experiment_on_a_tiny_config(tmp_path):
    from agents.shaping.experiment import run_shaping

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="shaping", overrides=[
            "logger=none", "tenants=[1,2]", "fig5_tenants=2", "seeds=2",
            "sim.duration_s=2.0", f"paths.output_dir={tmp_path}"])
    out = run_shaping(cfg)
    runs = out["tables"]["runs"]
    assert len(runs) == 2 * 3 * 2 and set(runs.policy) == {"none", "static", "sincon"}
    for name in ("runs", "summary", "fig5", "fig6"):
        assert (tmp_path / f"{name}.csv").is_file()
    for p in out["plots"]:
        assert p.is_file() and p.stat().st_size > 1000
    head = json.loads((tmp_path / "headline.json").read_text())
    assert head["paper"]["tput_std_factor"] == 3.8
    assert np.isfinite(head["sincon"]["read_tput_std_factor"])
