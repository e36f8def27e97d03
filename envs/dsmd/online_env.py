"""``smart/DSMDOnline-v0``: the online DSMD problem, one step per rate-estimation interval.

A thin gymnasium wrapper over :mod:`envs.dsmd.online` (the simulator core: intervals,
realised scoring, switching accounting), which does not import gymnasium.

## Description
An episode is a contiguous run of intervals of one trace of a trace dataset
(:mod:`envs.dsmd.dataset`), drawn from the chosen split (traces are split by seed). At each
interval boundary the agent sets the knobs of a feasible-by-construction executor (by
default :class:`envs.dsmd.online_greedy.OnlineGreedy`: greedy + local search on forecast
rates); the
executor sets the channel of every known type for the next interval and places the types
first seen during it. The interval is then scored on its realised rates (Eq. 1) with the
switching costs of :class:`envs.dsmd.online.OnlineCost`.

## Action space
``Box(0, 1, (3,), float32)``, mapped linearly to the executor's knobs
(:class:`envs.dsmd.online_control.KnobMap`): ``headroom`` in ``[0, max_headroom]``,
``horizon`` in ``[0, max_horizon]`` intervals (hysteresis; 0.95 and above: "always
re-plan"), and the forecast's level weight ``alpha`` in ``[0.05, 1]`` (EWMA; 0.95 and
above: ``alpha = 1``, the last interval's estimate).

## Observation space
``Box(-1, 1, (14,), float32)``: :func:`envs.dsmd.online_control.online_features` (names in
``FEATURES``): the last interval's shares of returning and new types, redundancy ratio - 1,
normalised violation, violated flags (C_b, C_p, s(n)), SubscribeInfos / 1,000 and moved
types / 100; the last estimate's controller demand if every type were on RPC (bandwidth /
C_b, sends / C_p, scaled by 1/4); the change of the estimated total rate against the
interval before; the last interval's p95 delay / 10 s and C_b utilisation (the delay
model's). Each is clipped to [-1, 1]. Only what a controller knows at the boundary:
serving computes the same values from a live session's history.

## Reward
``-cost_i`` of the interval (:mod:`envs.dsmd.online`).

## Starting state
Before the first interval of the episode, no type assigned (that interval pays no
switching terms), or, with ``warmup > 0``, after ``warmup`` intervals run by the executor
at its default knobs (they are not part of the episode).

## Episode end
Terminates after the trace's last interval, or truncates after ``max_intervals``.

## Info
Every term of the interval (:data:`envs.dsmd.online.INTERVAL_FIELDS`), the knobs used and
the trace id.

## Arguments
``dataset`` (a name in ``configs/dataset`` or a :class:`TraceDataset`), ``split``,
``cost`` (dict of :class:`OnlineCost`), ``max_intervals``, ``warmup``, ``executor``
(``"module:Class"``, constructed with ``cost=`` and the knobs), ``max_headroom``,
``max_horizon``, ``features`` (the observation values read; the others are 0), ``cache_dir``,
``traces`` (prebuilt :class:`OnlineTrace` list), ``executor_args`` (the executor's arguments
fixed for every interval, ``KnobMap.fixed``: e.g. ``reserve_placements``, ``send_forecaster``
and ``drop``). One executor serves an episode; the action sets its knobs at every step.

## Version history
* v0: initial version.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from .errors import DSMDError
from .online import OnlineCost, OnlineSimulator, OnlineTrace
from .online_control import OBS_SIZE, KnobMap
from .online_greedy import DEFAULT_EXECUTOR
from .parser import BatchKey
from .problems import DATASETS_DIR

__all__ = ["OBS_SIZE", "DSMDOnlineEnv", "load_online_traces"]

def load_online_traces(dataset: Any, split: str, cache_dir: str | Path | None = DATASETS_DIR,
                       limit: int | None = None, batch_key: BatchKey = "hosts"
                       ) -> list[OnlineTrace]:
    """The parsed traces of ``split`` of a dataset (a name, a path or a TraceDataset)."""
    from .dataset import TraceDataset, build_dataset, load_dataset_spec, open_dataset

    if isinstance(dataset, TraceDataset):
        ds = dataset
    elif isinstance(dataset, (str, Path)) and Path(dataset).is_dir():
        ds = open_dataset(Path(dataset))
    else:
        ds = build_dataset(load_dataset_spec(str(dataset)),
                           DATASETS_DIR if cache_dir is None else cache_dir)
    recs = ds.traces(split)
    if limit is not None:
        recs = recs[:int(limit)]
    return [OnlineTrace.from_dataset(ds.load(r.id), ds.scenario, r.id, batch_key)
            for r in recs]


class DSMDOnlineEnv(gym.Env):
    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 (gym.Env: not a ClassVar)

    def __init__(self, dataset: Any = "tiny_online", split: str = "train",
                 cost: dict | OnlineCost | None = None, max_intervals: int | None = None,
                 warmup: int = 0, executor: str = DEFAULT_EXECUTOR,
                 max_headroom: float = 0.9, max_horizon: float = 16.0,
                 features: Sequence[str] | None = None,
                 cache_dir: str | Path | None = DATASETS_DIR,
                 traces: Sequence[OnlineTrace] | None = None,
                 executor_args: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.cost = cost if isinstance(cost, OnlineCost) else OnlineCost.from_dict(cost)
        self.traces = list(traces) if traces is not None else load_online_traces(
            dataset, split, cache_dir)
        if not self.traces:
            raise DSMDError(f"split '{split}' of dataset {dataset!r} has no traces")
        if max_intervals is not None and int(max_intervals) <= 0:
            raise DSMDError(f"max_intervals must be positive, got {max_intervals}")
        if warmup < 0:
            raise DSMDError(f"warmup must be >= 0, got {warmup}")
        short = [t.name for t in self.traces if t.num_windows <= warmup]
        if short:
            raise DSMDError(f"traces {short[:3]} have no interval left after warmup={warmup}")
        self.max_intervals = None if max_intervals is None else int(max_intervals)
        self.warmup = int(warmup)
        self.knob_map = KnobMap(float(max_headroom), float(max_horizon), executor,
                                None if features is None else tuple(features),
                                dict(executor_args or {}))
        self.observation_space = spaces.Box(-1.0, 1.0, (OBS_SIZE,), dtype=np.float32)
        self.action_space = spaces.Box(0.0, 1.0, (3,), dtype=np.float32)
        self.sim: OnlineSimulator | None = None

    def knobs(self, action: np.ndarray) -> dict[str, float]:
        return self.knob_map.knobs(action)

    # ------------------------------------------------------------------ API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        options = options or {}
        i = options.get("trace")
        if i is None:
            i = int(self.np_random.integers(len(self.traces)))
        elif not 0 <= int(i) < len(self.traces):
            raise DSMDError(f"trace {i} out of range 0..{len(self.traces) - 1}")
        self.trace = self.traces[int(i)]
        self.sim = OnlineSimulator(self.trace, self.cost)
        self.executor = self.knob_map.build(self.cost)  # one per episode: its state carries
        if self.warmup:
            self.knob_map.set(self.executor, self.knobs(np.array([0.0, 1.0, 1.0])))
            for _ in range(self.warmup):
                self.sim.step(self.executor)
        self._steps = 0
        return self._observe(), {"trace": self.trace.name, "window": self.sim.window}

    def step(self, action: np.ndarray
             ) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self.sim is None:
            raise DSMDError("call reset() before step()")
        if self.sim.done:
            raise DSMDError("episode is over; call reset()")
        knobs = self.knobs(action)
        self.knob_map.set(self.executor, knobs)
        res = self.sim.step(self.executor).as_dict()
        self._steps += 1
        terminated = self.sim.done
        truncated = (not terminated and self.max_intervals is not None
                     and self._steps >= self.max_intervals)
        info = {**res, **{f"knob_{k}": v for k, v in knobs.items()}, "trace": self.trace.name}
        return self._observe(), -float(res["cost"]), terminated, truncated, info

    def _observe(self) -> np.ndarray:
        assert self.sim is not None  # set by reset()
        return self.knob_map.observe(self.sim.view())
