"""A live session's trace: Algorithm 1 over the controller's messages as they arrive, kept as
an :class:`envs.dsmd.online.OnlineTrace` of the intervals closed so far.

:func:`envs.dsmd.parser.parse_trace` parses a whole trace at once; a live session receives
it interval by interval. :class:`LiveTrace` runs the same two parts of Algorithm 1: the type
lookup (:meth:`envs.dsmd.parser.TypeCatalog.type_of`, types numbered densely in first-seen
order) as each message arrives, and the per-interval counters (lines 8 and 10,
:func:`envs.dsmd.parser.count_intervals`) as each interval closes, so that after ``w``
closed intervals :meth:`LiveTrace.trace` equals ``OnlineTrace.from_dataset`` over the
same messages with ``duration_s = w T``: the same type ids, rates, arrivals and realised
instances. Interval ``w`` covers ``[t0 + w T, t0 + (w + 1) T)``; ``t0`` is the session's
``start_ns`` or, without one, the time of its first message, taken as the start of the
interval then open.

Every message is checked before any of a batch is taken (no failed batch changes the
state): its fields fit the trace schema, its destinations are nodes of the topology (each
listed once), its timestamp is not earlier than the previous message's and falls in the
open interval, and its ``message_id`` is new. A batch that passes is always a valid
continuation of the trace the adapter's ``flush_trace`` writes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from envs.dsmd.errors import DSMDError
from envs.dsmd.message import Message
from envs.dsmd.online import OnlineTrace
from envs.dsmd.parser import BatchKey, ParsedTrace, TypeCatalog, count_intervals
from envs.dsmd.scenarios import ScenarioSpec
from envs.dsmd.topology import Topology

__all__ = ["LiveTrace", "MessageRejected", "StateConflict"]

_UINT32, _UINT64 = 2**32 - 1, 2**64 - 1


class StateConflict(DSMDError):
    """A request that does not fit the session's state now (an interval out of order, a
    message of another interval, no plan yet...): HTTP 409."""


class MessageRejected(DSMDError):
    """A message (or a value sent with it) that can never be valid here: HTTP 422."""


class _Grow:
    """An int64 array that grows by doubling (views of its filled part are handed out)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.a = np.zeros(tuple(max(s, 1) for s in shape), np.int64)

    def fit(self, *shape: int) -> None:
        if all(n <= s for n, s in zip(shape, self.a.shape)):
            return
        new = np.zeros(tuple(max(n, 2 * s) if n > s else s
                             for n, s in zip(shape, self.a.shape)), np.int64)
        new[tuple(slice(0, s) for s in self.a.shape)] = self.a
        self.a = new


class LiveTrace:
    """The messages of a live session, interval by interval (module docstring)."""

    def __init__(self, spec: ScenarioSpec, topology: Topology, batch_key: BatchKey = "hosts",
                 start_ns: int | None = None, name: str = "live") -> None:
        self.spec, self.topology, self.name = spec, topology, name
        self.catalog = TypeCatalog(topology, batch_key)
        self.interval_s = float(spec.interval_s)
        self.step_ns = round(self.interval_s * 1e9)
        self.t0: int | None = None if start_ns is None else int(start_ns)
        self.closed = 0  # intervals closed; the open one is ``closed``
        self.last_ns: int | None = None
        self._ids: set[int] = set()
        self._rows = 0  # messages of the closed intervals
        self._type, self._win, self._size = _Grow((1024,)), _Grow((1024,)), _Grow((1024,))
        self._bytes, self._count = _Grow((16, 16)), _Grow((16, 16))
        self._first = _Grow((16,))
        self._types_closed = 0  # types seen in the closed intervals (ids 0..n-1)
        self._open: list[tuple[int, int]] = []  # (type, size) of the open interval's messages
        self._trace: OnlineTrace | None = None

    # ------------------------------------------------------------------ messages
    def window_of(self, timestamp_ns: int) -> int:
        """The interval a message of this time belongs to (the open one before ``t0``)."""
        if self.t0 is None:
            return self.closed
        return (int(timestamp_ns) - self.t0) // self.step_ns

    def check(self, messages: Sequence[Message]) -> None:
        """Raise :class:`MessageRejected` or :class:`StateConflict` (naming the message) if
        any message of the batch cannot be taken now (module docstring)."""
        last, t0, ids = self.last_ns, self.t0, set()
        for i, m in enumerate(messages):
            what = f"messages[{i}] (message_id {m.message_id})"
            for f, hi in (("message_id", _UINT32), ("request_id", _UINT32),
                          ("vpc_id", _UINT32), ("resource_id", _UINT64)):
                v = getattr(m, f)
                if not 0 <= int(v) <= hi:
                    raise MessageRejected(f"{what}: {f} {v} is outside 0..{hi}")
            hosts = np.asarray(m.hosts, np.int64)
            if hosts.min() < 0 or hosts.max() > _UINT32:
                raise MessageRejected(f"{what}: a destination node id is outside 0..{_UINT32}")
            idx = self.topology.node_index(hosts)
            if (idx < 0).any():
                raise MessageRejected(f"{what}: unknown destination node "
                                      f"{int(hosts[idx < 0][0])} (not in the session's nodes)")
            if np.unique(idx).size != idx.size:
                raise MessageRejected(f"{what}: a destination node is listed twice")
            if m.message_id in self._ids or m.message_id in ids:
                raise MessageRejected(f"{what}: message_id {m.message_id} was already sent")
            ids.add(m.message_id)
            ts = int(m.timestamp_ns)
            if last is not None and ts < last:
                raise StateConflict(f"{what}: timestamp {ts} is earlier than the previous "
                                    f"message's ({last}); send messages in time order")
            last = ts
            if t0 is None:  # the first message starts the open interval
                t0 = ts - self.closed * self.step_ns
            w = (ts - t0) // self.step_ns
            if w < self.closed:
                raise StateConflict(f"{what}: timestamp {ts} falls in interval {w}, which is "
                                    f"closed (interval {self.closed} is open)")
            if w > self.closed:
                raise StateConflict(f"{what}: timestamp {ts} falls in interval {w}; close "
                                    f"interval {self.closed} first")

    def add(self, messages: Sequence[Message]) -> np.ndarray:
        """Take a batch (:meth:`check` first); returns each message's type id."""
        self.check(messages)
        out = np.empty(len(messages), np.int64)
        type_of = self.catalog.type_of
        for i, m in enumerate(messages):
            if self.t0 is None:
                self.t0 = int(m.timestamp_ns) - self.closed * self.step_ns
            t = type_of(np.asarray(m.hosts, np.uint32), int(m.vpc_id), int(m.config_code))
            out[i] = t
            self._open.append((t, int(m.size_bytes)))
            self._ids.add(int(m.message_id))
            self.last_ns = int(m.timestamp_ns)
        return out

    @property
    def open_messages(self) -> int:
        return len(self._open)

    # ------------------------------------------------------------------ intervals
    def close(self) -> OnlineTrace:
        """Close the open interval (Algorithm 1, lines 10-11); returns :meth:`trace`."""
        w, n = self.closed, len(self._open)
        m = len(self.catalog)
        self._bytes.fit(w + 1, m)
        self._count.fit(w + 1, m)
        self._first.fit(m)
        for g in (self._type, self._win, self._size):
            g.fit(self._rows + n)
        if n:
            types = np.fromiter((t for t, _ in self._open), np.int64, n)
            sizes = np.fromiter((s for _, s in self._open), np.int64, n)
            # the interval's counters: the same counting as a whole trace's parse
            counter, count = count_intervals(types, np.zeros(n, np.int64), sizes, 1, m)
            lo = self._rows
            self._type.a[lo:lo + n], self._size.a[lo:lo + n] = types, sizes
            self._win.a[lo:lo + n] = w
            self._bytes.a[w, :m], self._count.a[w, :m] = counter[0], count[0]
            self._first.a[self._types_closed:m] = w
            self._rows += n
        self._types_closed = m
        self._open = []
        self.closed = w + 1
        self._trace = None
        return self.trace()

    def trace(self) -> OnlineTrace:
        """The :class:`OnlineTrace` of the closed intervals (shares the live catalogue, whose
        types beyond ``num_types`` are the open interval's new ones)."""
        if self._trace is None:
            w, m, r = self.closed, self._types_closed, self._rows
            parsed = ParsedTrace(self.catalog, self.interval_s, self.t0 or 0,
                                 self._type.a[:r], self._win.a[:r], self._bytes.a[:w, :m],
                                 self._count.a[:w, :m])
            self._trace = OnlineTrace(self.name, self.spec, parsed, self._first.a[:m],
                                      self._size.a[:r],
                                      self.topology.bandwidth_bps.astype(np.int64))
        return self._trace
