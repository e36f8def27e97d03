"""``smart/DSMDOnline-v0``: the online DSMD problem, one step per rate-estimation interval.

A thin gymnasium wrapper over :mod:`envs.dsmd.online` (the simulator core: intervals,
realised scoring, switching accounting), which does not import gymnasium.

## Description
An episode is a contiguous run of intervals of one trace of a trace dataset
(:mod:`envs.dsmd.dataset`), drawn from the chosen split (traces are split by seed). At each
interval boundary the agent sets the knobs of a feasible-by-construction executor (by
default :class:`agents.online.OnlineGreedy`: greedy + local search on forecast rates); the
executor sets the channel of every known type for the next interval and places the types
first seen during it. The interval is then scored on its realised rates (Eq. 1) with the
switching costs of :class:`envs.dsmd.online.OnlineCost`.

## Action space
``Box(0, 1, (3,), float32)``, mapped linearly to the executor's knobs: ``headroom`` in
``[0, max_headroom]``, ``horizon`` in ``[0, max_horizon]`` intervals (hysteresis; the top
of the range means "always re-plan"), and the forecast's level weight ``alpha`` in
``[0.05, 1]`` (EWMA; ``alpha = 1`` is the last interval's estimate).

## Observation space
``Box(-1, 1, (12,), float32)``: episode progress; the last interval's redundancy ratio - 1,
normalised violation, violated flags (C_b, C_p, s(n)), SubscribeInfos / 1,000 and moved
types / 100; the last estimate's controller demand if every type were on RPC (bandwidth /
C_b, sends / C_p, scaled by 1/4); the share of new types in the last interval; the change
of the estimated total rate against the interval before. Each is clipped to [-1, 1].

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
``max_horizon``, ``cache_dir``, ``traces`` (prebuilt :class:`OnlineTrace` list).

## Version history
* v0: initial version.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any, Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from .errors import DSMDError
from .online import OnlineCost, OnlineSimulator, OnlineTrace
from .problems import DATASETS_DIR

__all__ = ["DSMDOnlineEnv", "load_online_traces", "OBS_SIZE"]

OBS_SIZE = 12


def load_online_traces(dataset: Any, split: str, cache_dir: str | Path | None = DATASETS_DIR,
                       limit: int | None = None, batch_key: str = "hosts"
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


def _executor(path: str) -> type:
    mod, _, cls = path.partition(":")
    if not cls:
        raise DSMDError(f"executor must be 'module:Class', got {path!r}")
    try:
        return getattr(importlib.import_module(mod), cls)
    except (ImportError, AttributeError) as e:
        raise DSMDError(f"cannot load executor {path!r}: {e}") from None


class DSMDOnlineEnv(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, dataset: Any = "tiny_online", split: str = "train",
                 cost: dict | OnlineCost | None = None, max_intervals: int | None = None,
                 warmup: int = 0, executor: str = "agents.online:OnlineGreedy",
                 max_headroom: float = 0.3, max_horizon: float = 16.0,
                 cache_dir: str | Path | None = DATASETS_DIR,
                 traces: Sequence[OnlineTrace] | None = None) -> None:
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
        if not (0 <= max_headroom < 1 and max_horizon > 0):
            raise DSMDError("max_headroom must be in [0, 1) and max_horizon > 0")
        self.max_intervals = None if max_intervals is None else int(max_intervals)
        self.warmup = int(warmup)
        self._executor_cls = _executor(executor)
        self.max_headroom, self.max_horizon = float(max_headroom), float(max_horizon)
        self.observation_space = spaces.Box(-1.0, 1.0, (OBS_SIZE,), dtype=np.float32)
        self.action_space = spaces.Box(0.0, 1.0, (3,), dtype=np.float32)
        self.sim: OnlineSimulator | None = None

    # ------------------------------------------------------------------ knobs
    def knobs(self, action: np.ndarray) -> dict[str, float]:
        a = np.clip(np.asarray(action, np.float64).reshape(-1), 0.0, 1.0)
        if a.size != 3:
            raise DSMDError(f"action must have 3 values, got {a.size}")
        horizon = math.inf if a[1] >= 1.0 else float(a[1] * self.max_horizon)
        return {"headroom": float(a[0] * self.max_headroom), "horizon": horizon,
                "alpha": float(0.05 + 0.95 * a[2])}

    def _decider(self, knobs: dict[str, float]):
        fc = "last" if knobs["alpha"] >= 1.0 else "ewma"
        return self._executor_cls(cost=self.cost, forecast=fc, **knobs)

    # ------------------------------------------------------------------ API
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        i = options.get("trace")
        if i is None:
            i = int(self.np_random.integers(len(self.traces)))
        elif not 0 <= int(i) < len(self.traces):
            raise DSMDError(f"trace {i} out of range 0..{len(self.traces) - 1}")
        self.trace = self.traces[int(i)]
        self.sim = OnlineSimulator(self.trace, self.cost)
        self._last: dict[str, float] | None = None
        if self.warmup:
            default = self._decider(self.knobs(np.array([0.0, 1.0, 1.0])))
            for _ in range(self.warmup):
                self._last = self.sim.step(default).as_dict()
        self._start = self.sim.window
        self._steps = 0
        return self._observe(), {"trace": self.trace.name, "window": self.sim.window}

    def step(self, action):
        if self.sim is None:
            raise DSMDError("call reset() before step()")
        if self.sim.done:
            raise DSMDError("episode is over; call reset()")
        knobs = self.knobs(action)
        res = self.sim.step(self._decider(knobs)).as_dict()
        self._last = res
        self._steps += 1
        terminated = self.sim.done
        truncated = (not terminated and self.max_intervals is not None
                     and self._steps >= self.max_intervals)
        info = {**res, **{f"knob_{k}": v for k, v in knobs.items()}, "trace": self.trace.name}
        return self._observe(), -float(res["cost"]), terminated, truncated, info

    # ------------------------------------------------------------------ observation
    def _observe(self) -> np.ndarray:
        sim, tr = self.sim, self.trace
        o = np.zeros(OBS_SIZE, np.float64)
        w = sim.window
        span = (tr.num_windows - self._start if self.max_intervals is None
                else self.max_intervals)
        o[0] = (w - self._start) / max(span, 1)
        if self._last is not None:
            r = self._last
            o[1] = r["redundancy_ratio"] - 1.0
            o[2] = r["violation"]
            o[3:6] = (r["bw_violated"], r["cpu_violated"], r["node_violated"])
            o[6] = r["subscribe_infos"] / 1000.0
            o[7] = r["moved_types"] / 100.0
            o[10] = r["new_types"] / max(r["types"], 1)
        if w > 0:
            last, s = tr.realised(w - 1), tr.spec  # the last estimate: Algorithm 1's rates
            o[8] = last.necessary_bps / s.controller_bw_bps / 4.0  # all-RPC bandwidth
            o[9] = float(last.fanout.sum()) / s.controller_cpu / 4.0  # all-RPC sends
            if w > 1:
                prev = float(tr.realised(w - 2).rate_bps.sum())
                o[11] = (float(last.rate_bps.sum()) - prev) / max(prev, 1.0)
        return np.clip(o, -1.0, 1.0).astype(np.float32)

