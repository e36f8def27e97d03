"""The learning contract's suite for ``smart/MulticastTree-v0`` (``configs/env/trees.yaml``):
the baselines the learned policy is compared with over whole group sequences.

Every baseline returns an action (most through
:meth:`envs.trees.env.MulticastTreeEnv.encode`), so the environment builds the same trees it
would build for a learned policy:

* ``algorithm1``: every node by ascending weight (scores falling linearly with workload),
  knob 0: the per-group optimum of (3) given the current loads (Algorithm 1 itself; the
  DDPGfD demonstrations).
* ``random10``: Algorithm 1 over 10 nodes sampled uniformly (Section VII-B).
* ``nvp``: the least-loaded node alone (Baseline 1).
* ``binary``: Baseline 2's node set (the 50 least-loaded nodes with room for the group,
  ``ceil((n - 1) / 2)`` of them so that each handles two receivers) with knob -1 so that all
  are employed; the environment builds its optimal tree over them (it cannot build the
  binary heuristic's own tree; ``python trees.py`` evaluates that tree, Figs. 9-10).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from envs.seeding import rng

__all__ = ["BASELINES", "TreePolicy", "baseline_policies"]


def _algorithm1(env: Any, g: np.random.Generator) -> np.ndarray:
    """Scores falling linearly from 1 (idle) to just above ``exclude_below`` (full): the
    weight order (``w`` increases with ``omega``; equal loads tie and fall back to the id,
    as in Algorithm 1's stable sort), and a linear function of the observation, which makes
    the demonstrations easy to imitate."""
    a = np.zeros(env.action_space.shape, np.float32)
    span = 1.0 - (env.exclude_below + 0.05)
    a[:-1] = 1.0 - span * env.cluster.loads / env.cluster_spec.capacity_gbps
    return a


def _random10(env: Any, g: np.random.Generator) -> np.ndarray:
    ids = env.cluster.available(env.group[1])
    if len(ids) == 0:
        return env.encode([], 0.0)
    pick = g.choice(ids, size=min(10, len(ids)), replace=False)
    w = env.cluster.weights()[pick]
    return env.encode(pick[np.argsort(w, kind="stable")], 0.0)


def _nvp(env: Any, g: np.random.Generator) -> np.ndarray:
    ids = env.cluster.available(env.group[1])
    if len(ids) == 0:
        return env.encode([], 0.0)
    return env.encode([ids[np.argmin(env.cluster.loads[ids])]], 0.0)


def _binary(env: Any, g: np.random.Generator) -> np.ndarray:
    n, r = env.group
    loads = env.cluster.loads
    least = np.argsort(loads, kind="stable")[:50]
    ok = least[loads[least] + r < env.cluster_spec.capacity_gbps]
    return env.encode(ok[:max(1, math.ceil((n - 1) / 2))], -1.0)


BASELINES: dict[str, Callable[[Any, np.random.Generator], np.ndarray]] = {
    "algorithm1": _algorithm1, "random10": _random10, "nvp": _nvp, "binary": _binary}


class TreePolicy:
    """One of :data:`BASELINES` as an ``EnvPolicy`` (``agents.episodes``)."""

    def __init__(self, name: str) -> None:
        if name not in BASELINES:
            raise ValueError(f"unknown tree baseline {name!r}; known: "
                             f"{', '.join(BASELINES)}")
        self.name = name
        self._act = BASELINES[name]
        self._rng = rng(0, "multicast-baseline", name)

    def reset(self, env: gym.Env, seed: int) -> None:
        self._rng = rng(int(seed), "multicast-baseline", self.name)

    def act(self, obs: np.ndarray, env: gym.Env) -> np.ndarray:
        return self._act(env, self._rng)


def baseline_policies(names: Sequence[str], env_kwargs: Mapping[str, Any]
                      ) -> list[TreePolicy]:
    """The baselines called ``names`` (unknown names: a ValueError listing the known)."""
    return [TreePolicy(str(n)) for n in names]
