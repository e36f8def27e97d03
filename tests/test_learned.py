"""A learned actor as a Policy decides exactly as it would inside the environment."""

from __future__ import annotations

import numpy as np
import pytest

from agents.learned import ActorPolicy
from envs.dsmd.env import DSMDEnv


def linear_actor(size: int, k1: int, seed: int = 0):
    w = np.random.default_rng(seed).standard_normal((size, k1)).astype(np.float32)
    return lambda obs: np.tanh(obs @ w)


@pytest.mark.parametrize("decoding", ["feasible", "argmax"])
@pytest.mark.parametrize("observation", ["paper", "paper_type", "channel"])
def test_policy_and_env_agree(tiny_problems, observation, decoding):
    windows = tiny_problems.windows["test"] + tiny_problems.windows["validation"]
    env = DSMDEnv(problems=tiny_problems, windows=windows, observation=observation,
                  decoding=decoding)
    actor = linear_actor(env.layout.size, env.action_space.shape[0])
    pol = ActorPolicy(actor, env.layout, decoding=decoding)
    for w in windows:
        obs, _ = env.reset(seed=0, options={"window": w})
        done = False
        while not done:
            obs, _, done, _, _ = env.step(actor(obs))
        channel = pol.assign(env.inst)
        np.testing.assert_array_equal(channel, env.state.channel)


def test_policy_observations_match_the_env(tiny_problems):
    env = DSMDEnv(problems=tiny_problems, split="test", observation="paper_type")
    env_obs, pol_obs = [], []
    actor = linear_actor(env.layout.size, env.action_space.shape[0], seed=1)

    def recording_actor(obs):
        pol_obs.append(obs.copy())
        return actor(obs)

    w = tiny_problems.windows["test"][0]
    obs, _ = env.reset(seed=0, options={"window": w})
    done = False
    while not done:
        env_obs.append(obs)
        obs, _, done, _, _ = env.step(actor(obs))
    ActorPolicy(recording_actor, env.layout).assign(env.inst)
    assert len(env_obs) == len(pol_obs)
    for a, b in zip(env_obs, pol_obs):
        np.testing.assert_array_equal(a, b)
