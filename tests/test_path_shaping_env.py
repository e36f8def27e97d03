"""``smart/PathShaping-v0`` (``envs/shaping/path_env.py``) and its suite
(``agents/shaping/path_suite.py``): the gymnasium contract, determinism, the action
encoding, Little's law in the reward (the waiting accrued step by step adds up to the
deliveries' delays), the baselines, and the refusals."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import envs  # noqa: F401  (registers the ids)
from agents.shaping.path_suite import path_baseline_policies
from delivery.sending_sim import BURST, STREAM
from envs.shaping.path_env import PathShapingEnv
from envs.shaping.sincon import ShapingError

SMALL = {"tenants": 2, "duration_s": 1.0, "period_s": 0.25, "burst_rate_hz": 2.0,
         "burst_messages": 100}


def _episode(env: PathShapingEnv, policy, seed: int) -> tuple[float, list[dict], dict]:
    obs, _ = env.reset(seed=seed)
    policy.reset(env, seed)
    ret, infos, done = 0.0, [], False
    while not done:
        obs, r, done, trunc, info = env.step(policy.act(obs, env))
        assert not trunc and env.observation_space.contains(obs)
        ret += r
        infos.append(info)
    return ret, infos, infos[-1]["episode_metrics"]


def test_check_env_and_spaces():
    env = gym.make("smart/PathShaping-v0", **SMALL).unwrapped
    check_env(env, skip_render_check=True)
    assert env.action_space.shape == (4,)            # 2 burst + 2 setup classes
    assert env.observation_space.shape == (14,)
    same = PathShapingEnv(**{**SMALL, "workload": "same"})
    assert same.action_space.shape == (2,) and same.setup_vpcs == same.burst_vpcs


def test_action_encoding_round_trip():
    env = PathShapingEnv(**SMALL)
    lim = np.array([env.g, env.g / 3, env.g / 40, env.eps * env.g])
    assert np.allclose(env.decode_action(env.encode_limits(lim)), lim, rtol=1e-5)
    assert np.allclose(env.decode_action(np.full(4, -1.0)), env.eps * env.g)
    assert np.allclose(env.decode_action(np.full(4, 1.0)), env.g)
    with pytest.raises(ShapingError, match="4 finite values"):
        env.decode_action(np.zeros(3))


def test_same_seed_same_episode():
    env = PathShapingEnv(**SMALL)
    pol = path_baseline_policies(["sincon"], {})[0]
    a = _episode(env, pol, 7)
    b = _episode(env, pol, 7)
    assert a[0] == b[0] and a[2] == b[2]
    c = _episode(env, pol, 8)
    assert c[0] != a[0]


def test_the_reward_is_littles_law_over_the_episode():
    """The waiting accrued period by period (and at the end, the drain) adds up to the sum of
    every delivery's delay, per kind; the return is minus their weighted sum over
    (period x setup deliveries/s x delay_ref_s)."""
    env = PathShapingEnv(**SMALL)
    pol = path_baseline_policies(["static"], {})[0]
    ret, infos, _ = _episode(env, pol, 3)
    rec = env.sim.records()
    d = rec.applied - rec.ts
    setup = sum(i["setup_waiting_s"] for i in infos)
    burst = sum(i["burst_waiting_s"] for i in infos)
    assert setup == pytest.approx(d[rec.kind == STREAM].sum(), rel=1e-9)
    assert burst == pytest.approx(d[rec.kind == BURST].sum(), rel=1e-9)
    w = env.reward_cfg["setup_weight"]
    assert ret == pytest.approx(-(w * setup + burst) / (env.period * env.setup_rate), rel=1e-9)
    assert rec.vpc.size == len(env.sim.created)            # nothing lost


def test_baselines_set_their_limits_and_none_is_fastest_for_the_bursts():
    env = PathShapingEnv(**SMALL)
    none, static, sincon, prio = path_baseline_policies(
        ["none", "static", "sincon", "priority_0.5"], {})
    env.reset(seed=1)
    assert np.allclose(env.decode_action(none.act(None, env)), env.g)
    assert np.allclose(env.decode_action(static.act(None, env)), env.g / env.n)
    sincon.reset(env, 1)
    assert np.allclose(env.decode_action(sincon.act(None, env)), env.g * 0.5 / env.n)
    assert prio.name == "priority_0.5"
    m = {p.name: _episode(env, p, 5)[2] for p in (none, static, sincon, prio)}
    assert m["none"]["burst_mean_ms"] <= min(v["burst_mean_ms"] for v in m.values())


@pytest.mark.parametrize(("kw", "names"), [
    ({"tenants": 0}, ["tenants", "0"]),
    ({"workload": "x"}, ["workload", "'x'"]),
    ({"global_throughput_Bps": -1.0}, ["global_throughput_Bps", "-1.0"]),
    ({"burst_messages": 0}, ["burst_messages", "0"]),
    ({"min_limit_share": 1.0}, ["min_limit_share", "1.0"]),
    ({"reward": {"nope": 1.0}}, ["reward", "nope"]),
    ({"duration_s": 1.0, "period_s": 0.3}, ["duration_s", "period_s"]),
    ({"rate_hz": 0.0}, ["rate_hz", "0.0"]),
])
def test_refusals_name_the_argument(kw, names):
    with pytest.raises(ShapingError) as e:
        PathShapingEnv(**kw)
    for n in names:
        assert n in str(e.value)


def test_suite_refuses_unknown_baselines():
    with pytest.raises(ShapingError, match="'fast'"):
        path_baseline_policies(["fast"], {})
    with pytest.raises(ShapingError, match="priority_<h>"):
        path_baseline_policies(["priority_x"], {})
    with pytest.raises(ShapingError, match="headroom"):
        path_baseline_policies(["priority_2"], {})


def test_learned_table_pairs_episodes_and_finds_the_selected_step(tmp_path):
    import pandas as pd

    from agents.shaping.path_experiment import learned_table

    run, base = tmp_path / "run", tmp_path / "base"
    run.mkdir()
    base.mkdir()
    pd.DataFrame({"policy": ["none", "none", "learned", "learned"], "seed": [1, 2, 1, 2],
                  "return": [-100.0, -200.0, -90.0, -220.0]}).to_csv(run / "per_episode.csv")
    pd.DataFrame({"steps": [0, 32, 1000, 2000], "val/return": [-5.0, None, -3.0, -4.0]}
                 ).to_csv(run / "learning_curve.csv")
    pd.DataFrame({"policy": ["hindsight", "hindsight", "hindsight"], "seed": [1, 2, 3],
                  "return": [-80.0, -200.0, -1.0]}).to_csv(base / "per_episode.csv")
    t = learned_table([str(run)], [str(base)])
    r = t.iloc[0]
    assert r.episodes == 2 and r.selected_step == 1000
    assert r.return_hindsight == pytest.approx(-140.0)       # episodes 1 and 2 only
    assert r.learned_vs_none_pct == pytest.approx((10.0 - 10.0) / 2)   # +10%, -10%
    assert list(t.run) == ["run", "mean"]
    with pytest.raises(FileNotFoundError, match="not a finished"):
        learned_table([str(tmp_path)])
