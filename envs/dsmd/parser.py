"""The message parser of SMART Section IV: destination-hash batching and rate estimation.

Algorithm 1: each incoming message is encapsulated (Table I), its destination host list
is hashed into a type id ``i = hash(m.hosts)`` (line 7), ``Counter_i += m.size`` (line 8),
and at the end of every interval ``f(m_i) = Counter_i / T`` (line 10) before the counters
are reset (line 11).

One implementation serves both uses:

* :class:`MessageParser` is the live, incremental parser (one message at a time, an
  interval closed by the caller's timer) used by the controller adapter and delivery;
* :func:`parse_trace` runs the same type lookup over a whole trace and counts every
  interval at once (vectorised), for simulation and offline training.

Type ids are stable: :func:`destination_key` hashes the sorted destination node *ids*
(optionally with the VPC id) with BLAKE2b, so the same destination set maps to the same
key in every process and on every run. Inside one :class:`TypeCatalog` the types are
numbered densely in first-seen order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from .errors import DSMDError, TraceError
from .topology import Topology
from .traces import Trace

__all__ = [
    "BATCH_KEYS",
    "BatchKey",
    "IntervalEstimate",
    "MessageParser",
    "ParsedTrace",
    "TypeCatalog",
    "count_intervals",
    "destination_key",
    "parse_trace",
]

BatchKey = Literal["hosts", "hosts+vpc", "hosts+vpc+config"]
BATCH_KEYS: tuple[str, ...] = ("hosts", "hosts+vpc", "hosts+vpc+config")


def destination_key(node_ids: np.ndarray, vpc_id: int | None = None,
                    config: int | None = None) -> int:
    """64-bit stable hash of a destination set (Algorithm 1, line 7), optionally refined by
    the VPC id and the configuration-type code."""
    ids = np.unique(np.asarray(node_ids, dtype=np.uint32)).astype("<u4")
    h = hashlib.blake2b(ids.tobytes(), digest_size=8)
    if vpc_id is not None:
        h.update(b"|vpc|" + int(vpc_id).to_bytes(4, "little"))
    if config is not None:
        h.update(b"|cfg|" + int(config).to_bytes(2, "little"))
    return int.from_bytes(h.digest(), "little")


@dataclass
class TypeCatalog:
    """Message types seen so far: key, destination node indices, and first-seen attributes.

    ``batch_key`` says what makes a type: ``"hosts"`` is the paper's destination hash;
    ``"hosts+vpc"`` also separates VPCs; ``"hosts+vpc+config"`` also separates
    configuration types. ``vpc`` and ``config`` are the VPC id and configuration-type code
    of the first message of each type, which the VPC-based baselines (VITA, IDCS's topic,
    Alcor AUTO) use: with ``"hosts"`` a type can mix VPCs and configurations, so those rules
    hold per type; with ``"hosts+vpc+config"`` they hold for every message.
    """

    topology: Topology
    batch_key: BatchKey = "hosts"
    keys: list[int] = field(default_factory=list)
    destinations: list[np.ndarray] = field(default_factory=list)  # sorted node indices
    vpc: list[int] = field(default_factory=list)
    config: list[int] = field(default_factory=list)
    _index: dict[int, int] = field(default_factory=dict, repr=False)
    _by_bytes: dict[bytes, int] = field(default_factory=dict, repr=False)
    _arrays: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.batch_key not in BATCH_KEYS:
            raise DSMDError(f"batch_key must be one of {BATCH_KEYS}, got {self.batch_key!r}")

    def __len__(self) -> int:
        return len(self.keys)

    def type_of(self, node_ids: np.ndarray, vpc_id: int = 0, config: int = 0) -> int:
        """The dense type index of a message with destinations ``node_ids`` (adds new types)."""
        ids = np.asarray(node_ids, dtype=np.uint32)
        by_vpc = self.batch_key != "hosts"
        by_cfg = self.batch_key == "hosts+vpc+config"
        raw = (ids.tobytes() + (int(vpc_id).to_bytes(4, "little") if by_vpc else b"")
               + (int(config).to_bytes(2, "little") if by_cfg else b""))
        hit = self._by_bytes.get(raw)
        if hit is not None:
            return hit
        key = destination_key(ids, vpc_id if by_vpc else None, config if by_cfg else None)
        i = self._index.get(key)
        if i is None:
            idx = self.topology.node_index(np.unique(ids))
            if idx.size == 0:
                raise DSMDError("a message must have at least one destination")
            if np.any(idx < 0):
                raise DSMDError(f"unknown destination node {int(np.unique(ids)[idx < 0][0])}")
            i = len(self.keys)
            self.keys.append(key)
            self.destinations.append(idx)
            self.vpc.append(int(vpc_id))
            self.config.append(int(config))
            self._index[key] = i
        self._by_bytes[raw] = i
        return i

    def index_of_key(self, key: int) -> int | None:
        return self._index.get(int(key))

    def arrays(self) -> dict[str, np.ndarray]:
        """The catalogue as arrays: ``ptr``/``idx`` (destinations as CSR), ``vpc``,
        ``config``; built once per catalogue size (a live catalogue only grows), read-only."""
        n = len(self.keys)
        if self._arrays.get("n") != n:
            lens = np.fromiter((d.size for d in self.destinations), dtype=np.int64, count=n)
            ptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            idx = (np.concatenate(self.destinations) if n else np.zeros(0, np.int64)
                   ).astype(np.int64)
            got = {"ptr": ptr, "idx": idx, "vpc": np.asarray(self.vpc, np.int64),
                   "config": np.asarray(self.config, np.int8)}
            for a in got.values():
                a.flags.writeable = False
            self._arrays.clear()
            self._arrays.update(got, n=n)
        return {k: v for k, v in self._arrays.items() if k != "n"}


@dataclass(frozen=True)
class IntervalEstimate:
    """Rates of one interval: ``rate_bps[j] = 8 * counter[j] / T`` for type ``types[j]``."""

    types: np.ndarray  # int64 type indices with traffic in the interval
    counter_bytes: np.ndarray  # int64 Counter_i
    messages: np.ndarray  # int64 number of messages
    interval_s: float

    @property
    def rate_bps(self) -> np.ndarray:
        return 8.0 * self.counter_bytes / self.interval_s


class MessageParser:
    """Incremental parser (Algorithm 1) for live message streams."""

    def __init__(self, topology: Topology, interval_s: float, batch_key: BatchKey = "hosts",
                 catalog: TypeCatalog | None = None) -> None:
        if interval_s <= 0:
            raise DSMDError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = float(interval_s)
        self.catalog = catalog if catalog is not None else TypeCatalog(topology, batch_key)
        self._counter: dict[int, int] = {}
        self._messages: dict[int, int] = {}

    def add(self, hosts: np.ndarray, size_bytes: int, vpc_id: int = 0, config: int = 0) -> int:
        """Lines 6-8: encapsulate, hash the destinations, count the bytes. Returns the type."""
        if size_bytes <= 0:
            raise DSMDError(f"size_bytes must be positive, got {size_bytes}")
        i = self.catalog.type_of(hosts, vpc_id, config)
        self._counter[i] = self._counter.get(i, 0) + int(size_bytes)
        self._messages[i] = self._messages.get(i, 0) + 1
        return i

    def peek(self) -> IntervalEstimate:
        """The estimate of the running interval so far, without resetting."""
        types = np.fromiter(self._counter.keys(), dtype=np.int64, count=len(self._counter))
        order = np.argsort(types)
        types = types[order]
        c = np.fromiter(self._counter.values(), dtype=np.int64, count=types.size)[order]
        m = np.fromiter(self._messages.values(), dtype=np.int64, count=types.size)[order]
        return IntervalEstimate(types, c, m, self.interval_s)

    def close_interval(self) -> IntervalEstimate:
        """Lines 10-11: ``f(m_i) = Counter_i / T`` for every type; reset the counters."""
        est = self.peek()
        self._counter.clear()
        self._messages.clear()
        return est


@dataclass(frozen=True, eq=False)
class ParsedTrace:
    """A whole trace parsed into types and per-interval counters.

    Window ``w`` covers ``[t0 + w T, t0 + (w+1) T)`` with ``t0`` the first timestamp.
    """

    catalog: TypeCatalog
    interval_s: float
    t0_ns: int
    message_type: np.ndarray  # (R,) type index of each message
    message_window: np.ndarray  # (R,) window of each message
    counter_bytes: np.ndarray  # (W, M) int64
    messages: np.ndarray  # (W, M) int64

    @property
    def num_windows(self) -> int:
        return int(self.counter_bytes.shape[0])

    @property
    def num_types(self) -> int:
        return int(self.counter_bytes.shape[1])

    def window(self, w: int) -> IntervalEstimate:
        types = np.flatnonzero(self.messages[w])
        return IntervalEstimate(types, self.counter_bytes[w, types], self.messages[w, types],
                                self.interval_s)


def parse_trace(trace: Trace, topology: Topology, interval_s: float,
                batch_key: BatchKey = "hosts", catalog: TypeCatalog | None = None,
                start_ns: int | None = None, end_ns: int | None = None) -> ParsedTrace:
    """Parse a whole trace: the same type lookup as :class:`MessageParser`, counted per window.

    Windows start at ``start_ns`` (the trace's start; default: its first message) and cover
    up to ``end_ns`` (default: the last message). Pass an existing ``catalog`` to keep type
    indices consistent with an earlier parse.
    """
    if interval_s <= 0:
        raise DSMDError(f"interval_s must be positive, got {interval_s}")
    cat = catalog if catalog is not None else TypeCatalog(topology, batch_key)
    n = len(trace)
    types = np.empty(n, dtype=np.int64)
    ptr, hosts = trace.hosts_indptr, trace.hosts
    vpc, cfg = trace.vpc_id, trace.configuration_type
    type_of = cat.type_of
    for r in range(n):
        try:
            types[r] = type_of(hosts[ptr[r]:ptr[r + 1]], vpc[r], cfg[r])
        except DSMDError as e:
            raise TraceError(None, "hosts", str(e), r) from None
    if n == 0:
        return ParsedTrace(cat, float(interval_s), 0, types, types.copy(),
                           np.zeros((0, len(cat)), np.int64), np.zeros((0, len(cat)), np.int64))
    t0 = int(trace.timestamp_ns[0]) if start_ns is None else int(start_ns)
    if trace.timestamp_ns[0] < t0:
        raise TraceError(None, "timestamp", "message before the trace's start time", 0)
    step = round(interval_s * 1e9)
    win = (trace.timestamp_ns - t0) // step
    n_win = int(win[-1]) + 1
    if end_ns is not None:
        n_win = max(n_win, -(-(int(end_ns) - t0) // step))
    counter, count = count_intervals(types, win, trace.size_bytes, n_win, len(cat))
    return ParsedTrace(cat, float(interval_s), t0, types, win, counter, count)


def count_intervals(types: np.ndarray, windows: np.ndarray, sizes: np.ndarray, num_windows: int,
                    num_types: int) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 1's counters (lines 8 and 10): the bytes and the messages of each type in
    each interval, ``[num_windows, num_types]`` int64 each, from every message's type,
    interval (0-based, relative to the first counted) and size. The one counting of a whole
    trace (:func:`parse_trace`) and of a live session's intervals as they close
    (:class:`serving.online_trace.LiveTrace`)."""
    flat = np.asarray(windows, np.int64) * num_types + np.asarray(types, np.int64)
    size = num_windows * num_types
    counter = np.bincount(flat, weights=np.asarray(sizes).astype(np.float64), minlength=size)
    if counter.size and counter.max() >= 2**53:
        raise DSMDError("per-interval byte counter exceeds 2**53; use a shorter interval")
    count = np.bincount(flat, minlength=size)
    return (np.rint(counter).astype(np.int64).reshape(num_windows, num_types),
            count.astype(np.int64).reshape(num_windows, num_types))
