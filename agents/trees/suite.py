"""The learning contract's suite for ``smart/MulticastTree-v0`` (``configs/env/trees.yaml``) and
``smart/MulticastOverTime-v0`` (``configs/env/trees_time.yaml``, ``trees_time_knob.yaml``,
``trees_time_planner.yaml``): the baselines the learned policy is compared with over whole
group sequences, and the teachers of its demonstrations.

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
* ``algorithm1_tuned``: Algorithm 1 with one load knob for every group (``lambda`` times
  :func:`envs.trees.env.lam_multiplier`), the knob of :data:`TUNING_GRID` with the highest
  mean return over :data:`TUNING_EPISODES` tuning episodes (their own seed stream, disjoint
  from the validation and test episodes), chosen at the policy's first episode on a fresh
  copy of the environment. On a shared cluster a heavier load penalty than the paper's
  leaves room for the groups to come.
* ``lookahead`` (``smart/MulticastOverTime-v0`` only): the service nodes taken in the order
  of their expected weight over the arriving group's stay
  (:func:`envs.trees.timeline.expected_weights`: the known diurnal background, the current
  groups' load, the mean holding time, not the group's own), with the load knob tuned as
  ``algorithm1_tuned``'s.
* ``rollout_model`` (``smart/MulticastOverTime-v0`` only,
  :class:`agents.trees.planner.ModelPlanner`): each group's knob and order planned by the
  one-step rollout on futures drawn from the model; tens of seconds an episode.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from envs.seeding import derive_seed, rng
from envs.trees.timeline import expected_weights

__all__ = ["BASELINES", "PLANNERS", "TUNED", "TUNING_EPISODES", "TUNING_GRID", "TreePolicy",
           "baseline_policies", "tune_knob", "tuning_seeds"]

#: the load knobs ``algorithm1_tuned`` chooses from (``a``: lambda x (1 + a) 2^a)
TUNING_GRID = (-0.3, -0.15, 0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.45, 0.6)
#: episodes per knob when ``algorithm1_tuned`` tunes
TUNING_EPISODES = 8


def _knob_coded(env: Any, name: str, order: float | None) -> np.ndarray | None:
    """The action of ``name`` in ``smart/MulticastOverTime-v0``'s ``knob`` coding (order
    blend ``order``, knob 0), None in the node coding; a ValueError for a baseline whose
    node order that coding cannot express (``order`` None)."""
    if getattr(env, "action_mode", "nodes") != "knob":
        return None
    if order is None:
        raise ValueError(f"the {name} baseline needs action=nodes: action=knob only "
                         "expresses Algorithm 1's and the lookahead's orders")
    return np.array([order, 0.0], np.float32)


def _algorithm1(env: Any, g: np.random.Generator) -> np.ndarray:
    """Scores falling linearly from 1 (idle) to just above ``exclude_below`` (full): the
    weight order (``w`` increases with ``omega``; equal loads tie and fall back to the id,
    as in Algorithm 1's stable sort), and a linear function of the observation, which makes
    the demonstrations easy to imitate (``knob`` coding: the order blend -1)."""
    coded = _knob_coded(env, "algorithm1", -1.0)
    if coded is not None:
        return coded
    a = np.zeros(env.action_space.shape, np.float32)
    span = 1.0 - (env.exclude_below + 0.05)
    a[:-1] = 1.0 - span * env.cluster.loads / env.cluster_spec.capacity_gbps
    return a


def _random10(env: Any, g: np.random.Generator) -> np.ndarray:
    _knob_coded(env, "random10", None)
    ids = env.cluster.available(env.group[1])
    if len(ids) == 0:
        return env.encode([], 0.0)
    pick = g.choice(ids, size=min(10, len(ids)), replace=False)
    w = env.cluster.weights()[pick]
    return env.encode(pick[np.argsort(w, kind="stable")], 0.0)


def _nvp(env: Any, g: np.random.Generator) -> np.ndarray:
    _knob_coded(env, "nvp", None)
    ids = env.cluster.available(env.group[1])
    if len(ids) == 0:
        return env.encode([], 0.0)
    return env.encode([ids[np.argmin(env.cluster.loads[ids])]], 0.0)


def _binary(env: Any, g: np.random.Generator) -> np.ndarray:
    _knob_coded(env, "binary", None)
    n, r = env.group
    loads = env.cluster.loads
    least = np.argsort(loads, kind="stable")[:50]
    ok = least[loads[least] + r < env.cluster_spec.capacity_gbps]
    return env.encode(ok[:max(1, math.ceil((n - 1) / 2))], -1.0)


BASELINES: dict[str, Callable[[Any, np.random.Generator], np.ndarray]] = {
    "algorithm1": _algorithm1, "random10": _random10, "nvp": _nvp, "binary": _binary}


def _lookahead(env: Any, g: np.random.Generator) -> np.ndarray:
    """The nodes with room, by their expected weight over the group's stay (module
    docstring), knob 0 (``knob`` coding: the order blend 1)."""
    if not hasattr(env, "shared"):
        raise ValueError("the lookahead baseline needs smart/MulticastOverTime-v0")
    coded = _knob_coded(env, "lookahead", 1.0)
    if coded is not None:
        return coded
    sh = env.shared
    w = expected_weights(env.timeline, env.cluster_spec, sh.now, sh.group_load,
                         env.timeline_spec.mean_duration)
    ids = sh.state.available(env.group[1])
    return env.encode(ids[np.argsort(w[ids], kind="stable")], 0.0)


#: the baselines whose load knob is tuned (name -> the rule it tunes)
TUNED: dict[str, Callable[[Any, np.random.Generator], np.ndarray]] = {
    "algorithm1_tuned": _algorithm1, "lookahead": _lookahead}


@dataclasses.dataclass(frozen=True)
class _Knobbed:
    """``rule``'s action with its load knob set to ``knob`` (a module-level rule and a
    float: it pickles, so a planner's candidates can be scored in other processes)."""

    knob: float
    rule: Callable[[Any, np.random.Generator], np.ndarray]

    def __call__(self, env: Any, g: np.random.Generator) -> np.ndarray:
        a = self.rule(env, g)
        a[-1] = self.knob
        return a


def _with_knob(knob: float, rule: Callable[[Any, np.random.Generator], np.ndarray] = _algorithm1
               ) -> Callable[[Any, np.random.Generator], np.ndarray]:
    return _Knobbed(float(knob), rule)


def tuning_seeds(episodes: int = TUNING_EPISODES) -> list[int]:
    """The tuning episodes' seeds (their own stream, disjoint from validation and test)."""
    return [derive_seed(0, "multicast-tuning", i) % (2**31) for i in range(int(episodes))]


def tune_knob(env_id: str, env_kwargs: Mapping[str, Any], grid: Sequence[float] = TUNING_GRID,
              episodes: int = TUNING_EPISODES,
              rule: Callable[[Any, np.random.Generator], np.ndarray] = _algorithm1
              ) -> tuple[float, dict[float, float]]:
    """The load knob of ``rule`` (default: Algorithm 1's order) with the highest mean return
    over ``episodes`` tuning episodes of ``env_id`` (seeds from their own stream); returns it
    and every knob's mean."""
    seeds = tuning_seeds(episodes)
    env = gym.make(env_id, **dict(env_kwargs))
    means: dict[float, float] = {}
    try:
        for knob in grid:
            act, total = _with_knob(float(knob), rule), 0.0
            for s in seeds:
                env.reset(seed=s)
                done = False
                while not done:
                    _, r, term, trunc, _ = env.step(act(env.unwrapped, rng(s, "tuning")))
                    total += float(r)
                    done = term or trunc
            means[float(knob)] = total / len(seeds)
    finally:
        env.close()
    best = max(means, key=lambda k: (means[k], -abs(k)))  # ties: the knob nearest 0
    return best, means


class TreePolicy:
    """One of :data:`BASELINES` or :data:`TUNED` as an ``EnvPolicy`` (``agents.episodes``)."""

    def __init__(self, name: str) -> None:
        if name not in BASELINES and name not in TUNED:
            hint = " (a planner: ask baseline_policies for it)" if name in PLANNERS else ""
            raise ValueError(f"unknown tree baseline {name!r}{hint}; known: "
                             f"{', '.join([*BASELINES, *TUNED, *PLANNERS])}")
        self.name = name
        self._act = BASELINES.get(name)
        self._rng = rng(0, "multicast-baseline", name)
        self.knob: float | None = None
        self.tuning: dict[float, float] = {}

    def reset(self, env: gym.Env, seed: int) -> None:
        self._rng = rng(int(seed), "multicast-baseline", self.name)
        if self._act is None:  # a tuned baseline: tune once, on a fresh copy of env
            spec = env.spec
            if spec is None:
                raise ValueError(f"{self.name} needs an environment made by gym.make")
            rule = TUNED[self.name]
            self.knob, self.tuning = tune_knob(spec.id, spec.kwargs, rule=rule)
            self._act = _with_knob(self.knob, rule)

    def act(self, obs: np.ndarray, env: gym.Env) -> np.ndarray:
        if self._act is None:
            raise ValueError(f"{self.name}: reset(env, seed) before act")
        return self._act(env, self._rng)


#: policies that plan with the model (:mod:`agents.trees.planner`), slow (tens of seconds an
#: episode): usable as a baseline or as the teacher of demonstrations
PLANNERS = ("rollout_model",)


def baseline_policies(names: Sequence[str], env_kwargs: Mapping[str, Any], workers: int = 1
                      ) -> list[Any]:
    """The baselines called ``names`` (unknown names: a ValueError listing the known); a
    planner scores its candidates in ``workers`` processes."""
    out: list[Any] = []
    for n in names:
        if str(n) in PLANNERS:
            from .planner import ModelPlanner  # it imports this module

            out.append(ModelPlanner(workers=workers))
        else:
            out.append(TreePolicy(str(n)))
    return out
