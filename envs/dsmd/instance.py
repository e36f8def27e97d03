"""A DSMD instance (SMART Section V-A/B): nodes with s(n), message types with D(m) and
f(m), controller capacities C_b and C_p, and K topics.

Rates are integers in bit/s (``round(8 * Counter_i / T)``, at least 1), so every sum in
the cost model is exact and an incremental update equals a full recomputation bit for
bit. Channel ``0`` is RPC, ``1..K`` are MQ topics, ``-1`` means not yet assigned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, SupportsInt, cast

import numpy as np

from .errors import InstanceError
from .parser import IntervalEstimate, TypeCatalog

__all__ = ["RPC", "UNASSIGNED", "DSMDInstance", "rates_bps"]

RPC = 0
UNASSIGNED = -1


def rates_bps(counter_bytes: np.ndarray, interval_s: float) -> np.ndarray:
    """Algorithm 1, line 10, as integers: ``f(m) = round(8 Counter_i / T)`` bit/s, at least 1
    (a type seen in the interval has a positive rate). Shared by the simulator and the
    controller adapter so both see the same rates for the same messages."""
    return np.maximum(np.rint(8.0 * np.asarray(counter_bytes) / float(interval_s)), 1
                      ).astype(np.int64)


def _sorted_within_types(ptr: np.ndarray, idx: np.ndarray) -> bool:
    """Whether every type's destinations are strictly increasing (then none repeats)."""
    up = np.diff(idx) > 0
    up[ptr[1:-1] - 1] = True  # the step from one type's last node to the next's first
    return bool(up.all())


@dataclass(frozen=True, eq=False)
class DSMDInstance:
    """One DSMD problem (Eq. 1): what must be delivered in one rate-estimation interval."""

    num_nodes: int
    num_topics: int  # K
    node_capacity_bps: np.ndarray  # int64 (N,)  s(n)
    controller_bw_bps: int  # C_b
    controller_cpu: int  # C_p
    rate_bps: np.ndarray  # int64 (M,)  f(m)
    dest_ptr: np.ndarray  # int64 (M+1,)  CSR of D(m)
    dest_idx: np.ndarray  # int64 node indices
    messages: np.ndarray | None = None  # int64 (M,) messages per interval (Fig. 6 metric)
    vpc: np.ndarray | None = None  # int64 (M,) VPC of the type's first message
    config: np.ndarray | None = None  # int8 (M,) configuration-type code of the first message
    catalog_index: np.ndarray | None = None  # (M,) index in the scenario's type catalogue
    interval_s: float = 1.0
    name: str = ""
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        m = self.rate_bps.size
        defaults = {"messages": np.ones(m, np.int64), "vpc": np.zeros(m, np.int64),
                    "config": np.zeros(m, np.int8), "catalog_index": np.arange(m)}
        for k, v in defaults.items():
            if getattr(self, k) is None:
                object.__setattr__(self, k, v)
        self.validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_sets(cls, destinations: Sequence[Sequence[int]], rates_bps: Sequence[int],
                  node_capacity_bps: Sequence[int] | int, num_topics: int,
                  controller_bw_bps: int, controller_cpu: int, num_nodes: int | None = None,
                  **kw: Any) -> DSMDInstance:
        """Build from Python lists (tests, hand-made examples)."""
        dests = [np.unique(np.asarray(d, dtype=np.int64)) for d in destinations]
        n = num_nodes if num_nodes is not None else (
            int(max((d.max() for d in dests if d.size), default=-1)) + 1)
        # of the declared types only the int is a scalar (np.isscalar narrows to numpy scalars)
        cap = (np.full(n, int(cast(SupportsInt, node_capacity_bps)), np.int64)
               if np.isscalar(node_capacity_bps) else np.asarray(node_capacity_bps, np.int64))
        lens = np.array([d.size for d in dests], dtype=np.int64)
        ptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        idx = np.concatenate(dests).astype(np.int64) if dests else np.zeros(0, np.int64)
        return cls(n, int(num_topics), cap, int(controller_bw_bps), int(controller_cpu),
                   np.asarray(rates_bps, dtype=np.int64), ptr, idx, **kw)

    @classmethod
    def from_estimate(cls, catalog: TypeCatalog, estimate: IntervalEstimate, num_topics: int,
                      controller_bw_bps: int, controller_cpu: int,
                      node_capacity_bps: np.ndarray | None = None, name: str = "") -> DSMDInstance:
        """The instance of one interval: the types with traffic in it and their rates."""
        return cls.from_catalog(catalog, estimate.types,
                                rates_bps(estimate.counter_bytes, estimate.interval_s),
                                num_topics, controller_bw_bps, controller_cpu, node_capacity_bps,
                                messages=estimate.messages, interval_s=estimate.interval_s,
                                name=name)

    @classmethod
    def from_catalog(cls, catalog: TypeCatalog, types: np.ndarray, rates: np.ndarray,
                     num_topics: int, controller_bw_bps: int, controller_cpu: int,
                     node_capacity_bps: np.ndarray | None = None,
                     messages: np.ndarray | None = None, interval_s: float = 1.0,
                     name: str = "") -> DSMDInstance:
        """The instance over catalogue ``types`` (destinations, VPC and configuration from the
        catalogue) with the given rates (measured, estimated or forecast)."""
        types = np.asarray(types, np.int64)
        arr = catalog.arrays()
        cat_ptr = arr["ptr"]
        lens = cat_ptr[types + 1] - cat_ptr[types]
        ptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        # entry j of the new CSR is entry (start of its type in the catalogue + offset)
        idx = arr["idx"][np.repeat(cat_ptr[types] - ptr[:-1], lens)
                         + np.arange(int(ptr[-1]), dtype=np.int64)]
        cap = (catalog.topology.bandwidth_bps if node_capacity_bps is None
               else np.asarray(node_capacity_bps, np.int64))
        return cls(catalog.topology.num_nodes, int(num_topics), cap.astype(np.int64),
                   int(controller_bw_bps), int(controller_cpu),
                   np.asarray(rates, np.int64), ptr, idx,
                   messages=None if messages is None else np.asarray(messages, np.int64),
                   vpc=arr["vpc"][types], config=arr["config"][types],
                   catalog_index=types, interval_s=interval_s, name=name)

    def validate(self) -> None:
        m = self.rate_bps.size
        if self.num_nodes <= 0:
            raise InstanceError("an instance needs at least one node")
        if self.num_topics < 0:
            raise InstanceError(f"num_topics must be >= 0, got {self.num_topics}")
        if self.node_capacity_bps.shape != (self.num_nodes,):
            raise InstanceError("node_capacity_bps must have one value per node")
        if np.any(self.node_capacity_bps <= 0):
            raise InstanceError("node capacities s(n) must be positive")
        if self.controller_bw_bps <= 0 or self.controller_cpu <= 0:
            raise InstanceError("controller capacities C_b and C_p must be positive")
        if self.dest_ptr.shape != (m + 1,) or self.dest_ptr[0] != 0 \
                or self.dest_ptr[-1] != self.dest_idx.size:
            raise InstanceError("destination CSR does not match the number of types")
        if np.any(np.diff(self.dest_ptr) <= 0):
            bad = int(np.flatnonzero(np.diff(self.dest_ptr) <= 0)[0])
            raise InstanceError(f"type {bad} has an empty destination set")
        if self.dest_idx.size and (self.dest_idx.min() < 0
                                   or self.dest_idx.max() >= self.num_nodes):
            raise InstanceError("destination node index out of range")
        if self.dest_idx.size and not _sorted_within_types(self.dest_ptr, self.dest_idx):
            row = np.repeat(np.arange(m), np.diff(self.dest_ptr))
            order = np.lexsort((self.dest_idx, row))
            dup = (np.diff(self.dest_idx[order]) == 0) & (np.diff(row[order]) == 0)
            if dup.any():
                bad = int(row[order][1:][dup][0])
                raise InstanceError(f"type {bad} lists a destination node twice")
        if np.any(self.rate_bps < 0):
            raise InstanceError("rates f(m) must be non-negative")
        for k in ("messages", "vpc", "config", "catalog_index"):
            if getattr(self, k).shape != (m,):
                raise InstanceError(f"{k} must have one value per type")

    # ------------------------------------------------------------------ queries
    @property
    def num_types(self) -> int:
        return int(self.rate_bps.size)

    @property
    def fanout(self) -> np.ndarray:
        if "fanout" not in self._cache:
            self._cache["fanout"] = np.diff(self.dest_ptr)
        fanout: np.ndarray = self._cache["fanout"]
        return fanout

    @property
    def type_of_entry(self) -> np.ndarray:
        """For each entry of ``dest_idx``, the type it belongs to."""
        if "row" not in self._cache:
            self._cache["row"] = np.repeat(np.arange(self.num_types), self.fanout)
        row: np.ndarray = self._cache["row"]
        return row

    def destinations(self, m: int) -> np.ndarray:
        return self.dest_idx[self.dest_ptr[m]:self.dest_ptr[m + 1]]

    def gamma(self) -> np.ndarray:
        """The dense incidence matrix Gamma[m, n] (small instances only)."""
        g = np.zeros((self.num_types, self.num_nodes), dtype=np.int8)
        g[self.type_of_entry, self.dest_idx] = 1
        return g

    @property
    def necessary_bps(self) -> int:
        """sum_m f(m) |D(m)|: the node traffic with no redundancy (a lower bound)."""
        if "necessary" not in self._cache:
            self._cache["necessary"] = int(np.dot(self.rate_bps, self.fanout))
        necessary: int = self._cache["necessary"]
        return necessary

    @property
    def destination_lists(self) -> list[np.ndarray]:
        """``D(m)`` of every type as a list of views (built once per instance; the
        incremental cost state indexes it on every move)."""
        if "dest_lists" not in self._cache:
            ptr = self.dest_ptr.tolist()
            idx = self.dest_idx
            self._cache["dest_lists"] = [idx[ptr[i]:ptr[i + 1]] for i in range(len(ptr) - 1)]
        lists: list[np.ndarray] = self._cache["dest_lists"]
        return lists

    @property
    def inv_capacity(self) -> np.ndarray:
        """1 / s(n), float64."""
        if "inv_cap" not in self._cache:
            self._cache["inv_cap"] = 1.0 / self.node_capacity_bps
        inv_cap: np.ndarray = self._cache["inv_cap"]
        return inv_cap

    @property
    def messages_per_s(self) -> np.ndarray:
        assert self.messages is not None  # filled in __post_init__
        return self.messages / self.interval_s

    def subset(self, types: np.ndarray) -> DSMDInstance:
        """The instance restricted to ``types`` (same nodes, capacities and K)."""
        types = np.asarray(types, dtype=np.int64)
        # filled in __post_init__
        assert self.messages is not None and self.vpc is not None
        assert self.config is not None and self.catalog_index is not None
        lens = self.fanout[types]
        ptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        idx = np.concatenate([self.destinations(t) for t in types]) if types.size else \
            np.zeros(0, np.int64)
        return DSMDInstance(self.num_nodes, self.num_topics, self.node_capacity_bps,
                            self.controller_bw_bps, self.controller_cpu, self.rate_bps[types],
                            ptr, idx.astype(np.int64), self.messages[types], self.vpc[types],
                            self.config[types], self.catalog_index[types], self.interval_s,
                            self.name)

    def reserved(self, headroom: float) -> DSMDInstance:
        """This instance against ``(1 - headroom)`` of C_b, C_p and every s(n) (each at
        least 1): the capacities an online plan, and the placements that respect its
        reserve, are checked against (:class:`envs.dsmd.online_greedy.OnlineGreedy`).
        ``headroom = 0`` is the instance itself; one instance per headroom is kept."""
        if not 0.0 <= headroom < 1.0:
            raise InstanceError(f"headroom must be in [0, 1), got {headroom}")
        if headroom == 0.0:
            return self
        key = f"reserved:{headroom!r}"
        if key not in self._cache:
            h = 1.0 - headroom
            self._cache[key] = self.with_capacities(
                max(int(self.controller_bw_bps * h), 1), max(int(self.controller_cpu * h), 1),
                np.maximum((self.node_capacity_bps * h).astype(np.int64), 1))
        out: DSMDInstance = self._cache[key]
        return out

    def with_capacities(self, controller_bw_bps: int | None = None,
                        controller_cpu: int | None = None,
                        node_capacity_bps: np.ndarray | int | None = None) -> DSMDInstance:
        cap = self.node_capacity_bps
        if node_capacity_bps is not None:
            # of the declared types only the int is a scalar (np.isscalar narrows to numpy scalars)
            cap = (np.full(self.num_nodes, int(cast(SupportsInt, node_capacity_bps)), np.int64)
                   if np.isscalar(node_capacity_bps) else np.asarray(node_capacity_bps, np.int64))
        return DSMDInstance(self.num_nodes, self.num_topics, cap,
                            int(controller_bw_bps or self.controller_bw_bps),
                            int(controller_cpu or self.controller_cpu), self.rate_bps,
                            self.dest_ptr, self.dest_idx, self.messages, self.vpc, self.config,
                            self.catalog_index, self.interval_s, self.name)
