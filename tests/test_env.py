"""smart/DSMD-v0: gymnasium conventions, determinism, reward variants, and errors."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import envs
from envs.dsmd.cost import CostState
from envs.dsmd.decoding import decode_action
from envs.dsmd.env import DSMDEnv
from envs.dsmd.errors import DSMDError
from envs.dsmd.observation import VARIANTS, ObservationBuilder, ObservationLayout
from envs.dsmd.reward import RewardConfig, eq2_terms


@pytest.mark.parametrize("env_id", envs.DSMD_ENV_IDS)
@pytest.mark.parametrize("observation", VARIANTS)
def test_check_env(env_id, observation, tiny_problems):
    env = gym.make(env_id, problems=tiny_problems, observation=observation)
    check_env(env.unwrapped, skip_render_check=True)
    assert env.observation_space.dtype == np.float32


def rollout(env_id: str, seed: int, problems, steps: int = 200, **kw):
    env = gym.make(env_id, problems=problems, **kw)
    env.action_space.seed(seed)
    obs, _ = env.reset(seed=seed)
    out = [obs]
    for _ in range(steps):
        obs, r, term, trunc, info = env.step(env.action_space.sample())
        out += [obs, np.array([r]), np.array([info["channel"], info["window"]])]
        if term or trunc:
            obs, _ = env.reset()
            out.append(obs)
    return out


@pytest.mark.parametrize("env_id", envs.DSMD_ENV_IDS)
def test_same_seed_same_rollout(env_id, tiny_problems):
    a = rollout(env_id, 7, tiny_problems, order="random")
    b = rollout(env_id, 7, tiny_problems, order="random")
    c = rollout(env_id, 8, tiny_problems, order="random")
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_ties_are_broken_at_random_not_towards_rpc():
    rng = np.random.default_rng(0)
    picks = [decode_action(np.ones(4, np.float32), rng) for _ in range(400)]
    assert set(picks) == {0, 1, 2, 3}
    assert decode_action(np.array([-1, 0.5, 0.2], np.float32), rng) == 1


def test_episode_decides_every_type_and_reports_metrics(tiny_problems):
    env = DSMDEnv(problems=tiny_problems, split="test", decoding="argmax")  # all on RPC
    _, info = env.reset(seed=0)
    n = info["num_types"]
    for i in range(n):
        _, _, term, trunc, info = env.step(np.eye(env.action_space.shape[0])[0])
        assert term == (i == n - 1) and not trunc
    assert info["assigned_types"] == n and info["rpc_types"] == n
    for key in ("controller_traffic_bps", "total_node_traffic_bps", "max_node_traffic_bps",
                "redundancy_bps", "controller_cpu_violation", "node_violation", "feasible",
                "reward/objective", "reward/value"):
        assert key in info
    with pytest.raises(DSMDError, match="episode is over"):
        env.step(np.zeros(env.action_space.shape, np.float32))


@pytest.mark.parametrize("form", ["delta", "dense", "terminal"])
def test_reward_forms(form, tiny_problems):
    cfg = RewardConfig(form=form)
    env = DSMDEnv(problems=tiny_problems, reward={"form": form})
    env.reset(seed=1)
    rng = np.random.default_rng(1)
    rewards, done = [], False
    while not done:
        action = rng.uniform(-1, 1, env.action_space.shape).astype(np.float32)
        _, r, done, _, _ = env.step(action)
        rewards.append(r)
    final = eq2_terms(env.state, cfg)["value"]
    if form == "delta":  # telescopes: return = Eq. 2 of the final assignment - Eq. 2 of empty
        assert sum(rewards) == pytest.approx(final - cfg.kappa)
    elif form == "terminal":
        assert rewards[-1] == pytest.approx(final) and all(r == 0 for r in rewards[:-1])
    else:
        assert rewards[-1] == pytest.approx(final)


def test_reward_terms_follow_eq2(tiny_problems):
    inst = tiny_problems.instance(0)
    s = CostState(inst, np.zeros(inst.num_types, np.int64))
    t = eq2_terms(s, RewardConfig(objective="gbps", node_term="aggregate"))
    assert t["objective"] == pytest.approx(100 / (1 + s.total_traffic / 1e9))
    assert t["controller_cpu_penalty"] == pytest.approx(
        50 * max(s.controller_cpu / inst.controller_cpu - 1, 0))
    ratio = s.node_traffic / inst.node_capacity_bps
    assert t["node_penalty"] == pytest.approx(50 * max(ratio.sum() - inst.num_nodes, 0))
    t2 = eq2_terms(s, RewardConfig())
    assert t2["objective"] == pytest.approx(100 / (1 + 1.0))  # RPC-only: total == necessary
    assert t2["node_penalty"] == pytest.approx(50 * np.maximum(ratio - 1, 0).sum())
    with pytest.raises(DSMDError, match=r"reward\.form"):
        RewardConfig(form="sometimes")


def test_paper_observation_layout(tiny_problems):
    env = DSMDEnv(problems=tiny_problems, observation="paper_type", decoding="argmax")
    obs, _ = env.reset(seed=0, options={"window": 3})
    sl = env.layout.slices()
    inst = env.inst
    first = int(env.order[0])
    gamma = obs[sl["gamma"]]
    np.testing.assert_array_equal(np.flatnonzero(gamma), inst.destinations(first))
    assert obs[sl["x"]].sum() == 0 and obs[sl["controller"]].tolist() == [1.0, 1.0]
    k = inst.num_topics
    a = -np.ones(k + 1, np.float32)
    a[k] = 1.0
    obs, *_ = env.step(a)
    assert obs[sl["y"]][inst.catalog_index[first]] == pytest.approx(1.0)
    a = -np.ones(k + 1, np.float32)
    a[0] = 1.0
    second = int(env.order[1])
    obs, *_ = env.step(a)
    assert obs[sl["x"]][inst.catalog_index[second]] == 1.0
    nodes = obs[sl["nodes"]]
    np.testing.assert_allclose(
        nodes, np.maximum(1 - env.state.node_traffic / inst.node_capacity_bps, -1), rtol=1e-6)


def test_observation_builder_is_shared_with_policies(tiny_problems):
    """The builder gives the env's observation from any CostState (serving uses this)."""
    env = DSMDEnv(problems=tiny_problems, observation="channel")
    obs, _ = env.reset(seed=0, options={"window": 2})
    b = ObservationBuilder(env.layout, env.inst)
    s = CostState(env.inst)
    b.reset(s)
    np.testing.assert_array_equal(b.observe(s, int(env.order[0]), 0.0), obs)


def test_initial_rpc_and_errors(tiny_problems):
    env = DSMDEnv(problems=tiny_problems, initial="rpc")
    env.reset(seed=0)
    assert env.state.assigned == env.inst.num_types - 1  # the type being decided is open
    for bad in ({"action": "dial"}, {"initial": "chaos"}, {"order": "alphabetical"},
                {"observation": "everything"}, {"split": "holdout"}):
        with pytest.raises(DSMDError):
            DSMDEnv(problems=tiny_problems, **bad)
    with pytest.raises(DSMDError, match="layout expects"):
        ObservationBuilder(ObservationLayout("paper", 5, 3, 1), tiny_problems.instance(0))
