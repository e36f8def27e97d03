"""Whole-episode evaluation on the sub-problem environments (``smart/MulticastTree-v0``,
``smart/Shaping-v0``): the policy interface their baselines and the learned actor share, and
the per-episode table every comparison is built from.

A sub-problem's *suite* is a module named by ``env.suite`` in its ``configs/env/*.yaml``
exposing ``baseline_policies(names, env_kwargs, workers=1) -> list[EnvPolicy]`` (``workers``:
the processes a slow, planning baseline may use). A baseline acts on the
*unwrapped* environment, so it may read the simulator's state (service-node loads, queues)
that the observation only summarises; the learned actor sees the observation alone.

At the terminal step the environment's ``info["episode_metrics"]`` is a ``dict[str, float]``
of the episode's summary metrics; they become columns of the table beside the return.
"""

from __future__ import annotations

import importlib
import inspect
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

import gymnasium as gym
import numpy as np
import pandas as pd

from envs.progress import Progress
from envs.seeding import derive_seed

__all__ = [
    "ActorEnvPolicy",
    "EnvPolicy",
    "SuiteError",
    "episode_seeds",
    "load_suite",
    "play_episode",
    "run_episodes",
    "summarize_episodes",
]


class SuiteError(ValueError):
    """A sub-problem suite that is missing or does not follow the contract above."""


@runtime_checkable
class EnvPolicy(Protocol):
    """What acts in a sub-problem environment for a whole episode."""

    name: str

    def reset(self, env: gym.Env, seed: int) -> None:
        """Called after ``env.reset(seed=seed)``; ``env`` is the unwrapped environment."""

    def act(self, obs: np.ndarray, env: gym.Env) -> np.ndarray:
        """An action in ``env.action_space`` for observation ``obs``."""


class ActorEnvPolicy:
    """A deterministic actor (``obs -> action`` in ``[-1, 1]``) as an :class:`EnvPolicy`."""

    def __init__(self, actor: Callable[[np.ndarray], np.ndarray], name: str = "ddpg") -> None:
        self.actor, self.name = actor, name

    def reset(self, env: gym.Env, seed: int) -> None:  # stateless
        return None

    def act(self, obs: np.ndarray, env: gym.Env) -> np.ndarray:
        a = np.asarray(self.actor(np.asarray(obs, np.float32)), np.float32)
        return np.clip(a, env.action_space.low, env.action_space.high)


def load_suite(module: str) -> ModuleType:
    """The suite module ``module`` (checked for ``baseline_policies``)."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise SuiteError(f"env.suite: cannot import suite module {module!r}: {e}") from None
    fn = getattr(mod, "baseline_policies", None)
    if not callable(fn):
        raise SuiteError(f"env.suite: module {module!r} has no baseline_policies(names, "
                         "env_kwargs, workers=1) function")
    params = inspect.signature(fn).parameters
    if "workers" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise SuiteError(f"env.suite: {module}.baseline_policies takes no workers argument "
                         "(the contract is baseline_policies(names, env_kwargs, workers=1))")
    return mod


def episode_seeds(seed: int, purpose: str, n: int) -> list[int]:
    """``n`` episode seeds for ``purpose`` (``train``, ``validation``, ``test``, ``demo``):
    disjoint streams of one root seed, so evaluation never replays a training episode."""
    return [derive_seed(seed, "episodes", purpose, i) % (2**31) for i in range(int(n))]


def play_episode(policy: EnvPolicy, env: gym.Env, seed: int
                 ) -> Iterator[tuple[np.ndarray, np.ndarray, float, np.ndarray, bool, bool, dict]]:
    """One episode of ``policy`` in ``env`` from ``env.reset(seed=seed)``: yields
    ``(obs, action, reward, next_obs, terminated, truncated, info)`` per step."""
    obs, _ = env.reset(seed=int(seed))
    policy.reset(env.unwrapped, int(seed))
    done = False
    while not done:
        action = policy.act(obs, env.unwrapped)
        nxt, r, term, trunc, info = env.step(action)
        yield obs, action, float(r), nxt, bool(term), bool(trunc), info
        obs, done = nxt, term or trunc


def run_episodes(policies: Sequence[EnvPolicy], env_id: str, env_kwargs: Mapping[str, Any],
                 seeds: Sequence[int], *, progress: bool = False, desc: str = "episodes"
                 ) -> pd.DataFrame:
    """One row per (policy, seed): return, steps, wall time and ``episode_metrics``."""
    rows = []
    bar = Progress(progress, len(policies) * len(seeds), desc, unit="episode")
    env = gym.make(env_id, **dict(env_kwargs))
    try:
        for pol in policies:
            if not isinstance(pol, EnvPolicy):
                raise SuiteError(f"{pol!r} is not an EnvPolicy (name, reset(env, seed), "
                                 "act(obs, env))")
            for s in seeds:
                t0 = time.perf_counter()
                ret, steps, info = 0.0, 0, {}
                for _, _, r, _, _, _, step_info in play_episode(pol, env, s):
                    ret += r
                    steps += 1
                    info = step_info  # the last step's info carries the episode metrics
                row = {"policy": pol.name, "seed": int(s), "return": ret, "steps": steps,
                       "time_s": time.perf_counter() - t0}
                row.update({k: float(v) for k, v in info.get("episode_metrics", {}).items()})
                rows.append(row)
                bar.step(pol.name)
    finally:
        env.close()
        bar.close()
    return pd.DataFrame(rows)


def summarize_episodes(per_episode: pd.DataFrame) -> pd.DataFrame:
    """Mean of every numeric column per policy (in first-seen order), with the return's
    standard deviation and the number of episodes."""
    num = per_episode.drop(columns=["seed"]).select_dtypes("number").columns
    g = per_episode.groupby("policy", sort=False)
    out = g[list(num)].mean()
    out.insert(1, "return_std", g["return"].std(ddof=0))
    out.insert(0, "episodes", g.size())
    return out.reset_index()
