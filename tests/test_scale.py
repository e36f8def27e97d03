"""CERN scale (5,500 nodes, ~9,000 message types, K = 1,000): slow, run by CI after the
fast suite (`pytest -m slow`)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import envs  # noqa: F401
from agents.baselines import IDCS
from agents.greedy import GreedyLocalSearch
from envs.dsmd.cost import CostState, evaluate
from envs.dsmd.problems import build_problems
from envs.dsmd.scenarios import load_scenario

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cern(tmp_path_factory):
    return build_problems(load_scenario("cern"), cache_dir=tmp_path_factory.mktemp("data"))


def test_cern_env_conforms_and_is_deterministic(cern):
    for obs in ("paper_type", "channel"):
        env = gym.make("smart/DSMD-v0", problems=cern, observation=obs)
        check_env(env.unwrapped, skip_render_check=True)
        assert env.observation_space.shape[0] > 1000
    runs = []
    for _ in range(2):
        env = gym.make("smart/DSMD-v0", problems=cern, order="random")
        env.action_space.seed(3)
        obs, _ = env.reset(seed=3)
        total = 0.0
        for _ in range(300):
            obs, r, *_ = env.step(env.action_space.sample())
            total += r
        runs.append((obs, total))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]


def test_cern_incremental_equals_full(cern):
    inst = cern.instance(0)
    rng = np.random.default_rng(0)
    s = CostState(inst, rng.integers(0, inst.num_topics + 1, inst.num_types))
    for _ in range(3000):
        s.move(int(rng.integers(inst.num_types)), int(rng.integers(-1, inst.num_topics + 1)))
    snap = evaluate(inst, s.channel)
    np.testing.assert_array_equal(snap.node_traffic, s.node_traffic)
    assert snap.total_traffic == s.total_traffic and snap.controller_bw == s.controller_bw


def test_cern_greedy_feasible_and_better_than_idcs(cern):
    inst = cern.instance(1)
    g = CostState(inst, GreedyLocalSearch().assign(inst)).metrics()
    i = CostState(inst, IDCS().assign(inst)).metrics()
    assert g.feasible
    assert g.total_node_traffic_bps < i.total_node_traffic_bps
    assert g.redundancy_ratio < 1.1
