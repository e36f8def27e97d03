"""Planning the per-group choice on ``smart/MulticastOverTime-v0`` with the model (Bertsekas'
one-step rollout): for the arriving group, every candidate (a load knob of
:data:`ROLLOUT_KNOBS` with Algorithm 1's order or with the lookahead's) is tried on copies of
the environment whose rest of the episode is played by a base policy (``algorithm1_tuned``),
and the candidate with the best mean return is taken (among equal ones, the one nearest the
base policy's action).

* On the episode's own future (``futures=None`` in :func:`plan`) the rollout is clairvoyant:
  an achievable value, not a policy a controller could run
  (:func:`agents.trees.overtime.rollout_episode`).
* On futures drawn from the model (:func:`resampled`: the arriving group's holding time,
  the active groups' remaining stays and the groups to come drawn afresh; the present and
  the known background kept) it is a policy: :class:`ModelPlanner` (``rollout_model``),
  which uses only what a controller knows. The same futures score every candidate of a
  group (common random numbers).

A group's candidates can be scored in ``workers`` processes (:class:`PlanningPool`); each
candidate's value is summed in one process in the same order, so the choice is the same
with any number of workers.
"""

from __future__ import annotations

import copy
import dataclasses
import multiprocessing as mp
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np

from .suite import TUNED, _with_knob, tune_knob

__all__ = ["ROLLOUT_KNOBS", "ModelPlanner", "PlanningPool", "candidates", "nearest_best", "plan",
           "resampled"]

#: the load knobs the rollout tries for each group, with each of the two orders
ROLLOUT_KNOBS = (-0.5, 0.0, 0.15, 0.3, 0.6)

Rule = Callable[[Any, Any], np.ndarray]


def candidates(knobs: Sequence[float] = ROLLOUT_KNOBS) -> list[Rule]:
    """The rollout's candidates: each knob with Algorithm 1's order, then with the
    lookahead's (either action coding)."""
    return [_with_knob(float(k), rule) for rule in TUNED.values() for k in knobs]


def resampled(env: Any, rng: np.random.Generator) -> Any:
    """A copy of ``env`` (unwrapped, before placing group ``env.t``) whose unknown future is
    drawn afresh from the model a controller knows, not the episode's own: the arriving
    group's holding time, the active groups' remaining ones (exponential, hence memoryless)
    and the groups after it (arrival gaps, sizes, rates, holding times); the known
    background is kept. The past groups' holding times stay as they were: only the copy's
    terminal ``bound`` metric reads them, never a decision."""
    trial = copy.deepcopy(env)
    tl, spec, t = trial.timeline, trial.timeline_spec, trial.t
    k = len(tl) - t - 1
    d = spec.mean_duration
    lo, hi = spec.groups.hypervisors
    arrive = tl.t.copy()
    arrive[t + 1:] = tl.t[t] + np.cumsum(rng.exponential(1.0 / spec.arrival_rate, size=k))
    dur = tl.duration.copy()
    dur[t:] = rng.exponential(d, size=k + 1)
    n, r = tl.n.copy(), tl.rate_gbps.copy()
    n[t + 1:] = rng.integers(lo, hi + 1, size=k)
    r[t + 1:] = rng.uniform(*spec.groups.rate_gbps, size=k)
    new = dataclasses.replace(tl, t=arrive, duration=dur, n=n, rate_gbps=r)
    sh = trial.shared
    trial.timeline = sh.timeline = new
    sh.active = [dataclasses.replace(g, depart=sh.now + float(rng.exponential(d)))
                 for g in sh.active]
    return trial


def _value(cand: Rule, base: Rule, worlds: Sequence[Any]) -> float:
    """``cand`` for this group, then ``base`` to the episode's end, summed over ``worlds``."""
    v = 0.0
    for world in worlds:
        trial = copy.deepcopy(world)
        trial.terminal_metrics = False  # a trial reads only its rewards
        _, r, end, _, _ = trial.step(cand(trial, None))
        v += r
        while not end:
            _, r, end, _, _ = trial.step(base(trial, None))
            v += r
    return v


def _values(job: tuple[Sequence[Rule], Rule, Sequence[Any]]) -> list[float]:
    cands, base, worlds = job
    return [_value(c, base, worlds) for c in cands]


class PlanningPool:
    """``workers`` processes that score a group's candidates for :func:`plan`, started at
    the first use (spawned: safe beside Ray's and torch's threads) and stopped by
    :meth:`close` (a later use starts them again). A pool whose process died is replaced
    once per call."""

    def __init__(self, workers: int) -> None:
        if int(workers) < 1:
            raise ValueError(f"a planning pool needs at least one worker, got {workers}")
        self.workers = int(workers)
        self._ex: ProcessPoolExecutor | None = None

    def values(self, cands: Sequence[Rule], base: Rule, worlds: Sequence[Any]) -> list[float]:
        """Each candidate's value (:func:`_value`), in ``workers`` contiguous shares."""
        if self.workers <= 1 or len(cands) <= 1:
            return [_value(c, base, worlds) for c in cands]
        k = -(-len(cands) // self.workers)
        jobs = [(list(cands[i:i + k]), base, worlds) for i in range(0, len(cands), k)]
        try:
            return self._map(jobs)
        except BrokenProcessPool:
            self.close()  # a worker died (killed, out of memory): start afresh, once
            return self._map(jobs)

    def _map(self, jobs: list[tuple[Sequence[Rule], Rule, Sequence[Any]]]) -> list[float]:
        if self._ex is None:
            self._ex = ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"))
        return [v for part in self._ex.map(_values, jobs) for v in part]

    def close(self) -> None:
        if self._ex is not None:
            self._ex.shutdown(wait=True, cancel_futures=True)
            self._ex = None


def plan(env: Any, base: Rule, cands: Sequence[Rule], futures: Sequence[Any] | None = None,
         pool: PlanningPool | None = None) -> np.ndarray:
    """The action of the candidate whose return, this group's reward plus the rest of the
    episode under ``base``, is best on average over ``futures`` (copies of ``env`` before
    this group; None: ``env``'s own future). Equal best values (frequent: several knobs
    often build the same trees) go to the candidate whose action is nearest ``base``'s
    (L1), so where the choice makes no difference the action, and the label a clone
    learns from it, is the base policy's, or the candidate nearest it. With ``pool``, the
    candidates are scored in its processes (``base`` and ``cands`` must pickle:
    :func:`agents.trees.suite._with_knob`'s do), with the same values."""
    if not cands:
        raise ValueError("plan needs at least one candidate")
    worlds = [env] if futures is None else list(futures)
    values = (pool or PlanningPool(1)).values(cands, base, worlds)
    if not np.all(np.isfinite(values)):
        raise ValueError(f"plan: a candidate's value is not finite: {values}")
    return nearest_best(env, base, cands, values)


def nearest_best(env: Any, base: Rule, cands: Sequence[Rule], values: Sequence[float]
                 ) -> np.ndarray:
    """The action of the best of ``values``; among equal best, the one nearest ``base``'s
    action (L1 distance; the first of exactly equal distances)."""
    top = max(values)
    acts = [cands[i](env, None) for i, v in enumerate(values) if v == top]
    if len(acts) == 1:
        return acts[0]
    ref = base(env, None)
    return min(acts, key=lambda a: float(np.abs(np.asarray(a) - ref).sum()))


class ModelPlanner:
    """``rollout_model``: the one-step rollout on ``samples`` futures drawn from the model
    (:func:`resampled`) with ``algorithm1_tuned`` as the base policy, as an ``EnvPolicy``.
    The base knob is ``knob`` or, if None, tuned as ``algorithm1_tuned``'s (once, at the
    first episode); the futures are drawn from a stream of the episode's seed. ``workers``
    processes score each group's candidates (the same choices with any number)."""

    def __init__(self, samples: int = 4, knobs: Sequence[float] = ROLLOUT_KNOBS,
                 name: str = "rollout_model", knob: float | None = None,
                 workers: int = 1) -> None:
        if int(samples) < 1:
            raise ValueError(f"rollout_model needs at least one sampled future, got {samples}")
        if int(workers) < 1:
            raise ValueError(f"rollout_model needs at least one worker, got {workers}")
        self.name, self.samples, self.workers = name, int(samples), int(workers)
        self._pool = PlanningPool(self.workers)
        self._cands = candidates(knobs)
        #: the base policy's knob (``knob``: one a caller already tuned the same way)
        self.knob: float | None = None if knob is None else float(knob)
        self._base: Rule | None = None if knob is None else _with_knob(float(knob))
        self._rng = np.random.default_rng(0)

    def reset(self, env: Any, seed: int) -> None:
        if not hasattr(env, "shared"):
            raise ValueError("rollout_model needs smart/MulticastOverTime-v0")
        if self._base is None:
            spec = env.spec
            if spec is None:
                raise ValueError("rollout_model needs an environment made by gym.make")
            self.knob, _ = tune_knob(spec.id, spec.kwargs)
            self._base = _with_knob(self.knob)
        # the futures' own stream under the episode seed (7919 names it; the policy's
        # demonstrations and tables were drawn from this stream)
        self._rng = np.random.default_rng([int(seed), 7919])

    def act(self, obs: np.ndarray, env: Any) -> np.ndarray:
        if self._base is None:
            raise ValueError("rollout_model: reset(env, seed) before act")
        futures = [resampled(env, self._rng) for _ in range(self.samples)]
        return plan(env, self._base, self._cands, futures, self._pool)

    def close(self) -> None:
        """Stop the worker processes (a later episode starts them again)."""
        self._pool.close()
