"""From a scenario to DSMD instances: generate (or read) the trace, parse it into types
and per-interval rates (Algorithm 1), and split the intervals by time into train /
validation / test windows (offline training never sees the test windows)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from .errors import DSMDError
from .instance import DSMDInstance
from .parser import BatchKey, ParsedTrace, parse_trace
from .scenarios import ScenarioSpec, load_scenario, scenario_dataset
from .traces import Dataset

__all__ = ["DATASETS_DIR", "SPLITS", "ProblemSet", "build_problems", "problems_for"]

SPLITS = ("train", "validation", "test")
DATASETS_DIR = Path(os.environ.get("SMART_DATASETS",
                                   Path(__file__).resolve().parents[2] / "datasets" / "generated"))


def split_windows(windows: list[int], fractions: tuple[float, float, float]
                  ) -> dict[str, list[int]]:
    """Contiguous, time-ordered split of ``windows``; every split gets one when there are >= 3.

    Only windows with at least one message are split (an interval in which nothing was sent
    is not a DSMD instance, and would be an episode without a step)."""
    n = len(windows)
    if n <= 0:
        raise DSMDError("the trace has no interval with messages to split")
    cuts = np.rint(np.cumsum(fractions) * n).astype(int)
    a, b = int(cuts[0]), int(cuts[1])
    if n >= 3:
        a = min(max(a, 1), n - 2)
        b = min(max(b, a + 1), n - 1)
    ws = list(windows)
    return {"train": ws[:a], "validation": ws[a:b], "test": ws[b:]}


@dataclass(frozen=True, eq=False)
class ProblemSet:
    """A scenario's dataset, its parse, and one DSMD instance per interval."""

    spec: ScenarioSpec
    dataset: Dataset
    parsed: ParsedTrace
    windows: dict[str, list[int]]
    _instances: dict[int, DSMDInstance] = field(default_factory=dict, repr=False)

    @property
    def catalog_size(self) -> int:
        return len(self.parsed.catalog)

    @property
    def num_nodes(self) -> int:
        return self.dataset.topology.num_nodes

    def instance(self, w: int) -> DSMDInstance:
        if not 0 <= w < self.parsed.num_windows:
            raise DSMDError(f"window {w} out of range 0..{self.parsed.num_windows - 1}")
        inst = self._instances.get(w)
        if inst is None:
            s = self.spec
            inst = DSMDInstance.from_estimate(
                self.parsed.catalog, self.parsed.window(w), s.num_topics, s.controller_bw_bps,
                s.controller_cpu, name=f"{s.name}/w{w}")
            self._instances[w] = inst
        return inst

    def split_windows(self, split: str) -> list[int]:
        """Windows of ``split`` (``train``, ``validation``, ``test``, or ``all`` of them)."""
        if split == "all":
            return [w for s in SPLITS for w in self.windows[s]]
        if split not in self.windows:
            raise DSMDError(f"unknown split '{split}'; expected one of "
                            f"{', '.join(SPLITS)} or all")
        return list(self.windows[split])

    def instances(self, split: str) -> list[DSMDInstance]:
        return [self.instance(w) for w in self.split_windows(split)]

    def signature(self) -> dict:
        """What a policy trained on this problem set depends on (observation layout)."""
        return {"scenario": self.spec.name, "trace_key": self.spec.trace_key(),
                "topology": self.dataset.topology.signature(), "num_nodes": self.num_nodes,
                "num_topics": self.spec.num_topics, "catalog_size": self.catalog_size,
                "interval_s": self.spec.interval_s}


def build_problems(spec: ScenarioSpec, cache_dir: str | Path | None = DATASETS_DIR,
                   batch_key: BatchKey = "hosts") -> ProblemSet:
    ds = scenario_dataset(spec, cache_dir)
    start = ds.meta.get("start_ns")
    end = None if start is None else int(start) + round(float(ds.meta["duration_s"]) * 1e9)
    parsed = parse_trace(ds.trace, ds.topology, spec.interval_s, batch_key, start_ns=start,
                         end_ns=end)
    busy = np.flatnonzero(parsed.messages.sum(axis=1) > 0).tolist()
    return ProblemSet(spec, ds, parsed, split_windows(busy, spec.split))


@lru_cache(maxsize=8)
def _cached(name: str, overrides: tuple, cache_dir: str | None,
            batch_key: BatchKey) -> ProblemSet:
    return build_problems(load_scenario(name, **dict(overrides)), cache_dir, batch_key)


def problems_for(scenario: str | ScenarioSpec, overrides: dict | None = None,
                 cache_dir: str | Path | None = DATASETS_DIR,
                 batch_key: BatchKey = "hosts") -> ProblemSet:
    """A (process-wide cached) problem set for a named scenario or a spec."""
    if isinstance(scenario, ScenarioSpec):
        spec = scenario.replace(**(overrides or {}))
        return build_problems(spec, cache_dir, batch_key)
    items = tuple(sorted((k, tuple(map(tuple, v)) if isinstance(v, list) else v)
                         for k, v in (overrides or {}).items()))
    return _cached(scenario, items, None if cache_dir is None else str(cache_dir), batch_key)
