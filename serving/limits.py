"""What one key may make the policy server hold: session limits, the memory estimate of a
session, the per-key and server-wide memory budget, and idle expiry.

A session's memory is dominated by the subscription counters of its cost state
(:class:`envs.dsmd.cost.CostState`: ``sub_count`` holds (K+1) x N ``int32``, the Gamma/Y
bookkeeping of SMART Eq. 1), then by its types and their destination sets, and for an
online session by its history (Algorithm 1's per-interval counters: intervals x types
``int64`` twice, and every message's row). :func:`static_session_bytes` and
:func:`online_session_bytes` estimate it from the counts a request states, *before*
anything is allocated; the coefficients are measured upper bounds (``tracemalloc`` of
real sessions, ``tests/test_serving_hostile.py`` keeps them upper bounds).

:class:`MemoryBudget` holds what every session is charged: a request that would take a
key past ``key_memory_bytes``, or all sessions past ``memory_bytes``, is refused with
:class:`BudgetExceeded` (HTTP 429, naming the limit) and nothing is allocated.
:class:`Lease` is a session's side of it: its owner, its charge, when it was last used and
the lock that runs one request at a time on it (heavy ones on a worker thread, so the event
loop keeps answering everyone else). :class:`KeySlots` caps the worker threads one key's
requests hold at once, so one key's heavy work cannot queue every other key's behind it.
Sessions unused for ``idle_s`` are expired: deleted and their charge returned (the adapters
re-create a lost session on its 404).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["BudgetExceeded", "KeySlots", "Lease", "MemoryBudget", "ResourceLimits",
           "online_session_bytes", "static_session_bytes"]

GiB = 1 << 30
#: a session charged at least this many bytes runs its requests on a worker thread: below it
#: a request costs less than the thread hand-off would add (~0.1 ms)
THREADED_BYTES = 8 << 20
#: worker threads one key's requests may hold at once (:class:`KeySlots`)
THREADS_PER_KEY = 2
#: the server's worker threads (its event loop's default executor)
WORKER_THREADS = 16


def static_session_bytes(num_nodes: int, num_topics: int, num_types: int,
                         num_destinations: int) -> int:
    """Upper estimate of a static session's resident bytes (:class:`serving.session.Session`):
    ``sub_count`` 4 (K+1) N, per-node and per-channel arrays, about 1 KB per type (its slot,
    rate, channel and dictionary entries) and 40 B per destination (the type's node array
    and the instance's CSR copy)."""
    k1 = num_topics + 1
    return (4 * k1 * num_nodes + 64 * num_nodes + 96 * k1 + 1000 * num_types
            + 40 * num_destinations + 65536)


def online_session_bytes(num_nodes: int, num_topics: int, num_types: int, windows: int,
                         messages: int, num_hosts: int) -> int:
    """Upper estimate of an online session's resident bytes
    (:class:`serving.online_session.OnlineSession`): two cost states (the simulator's and
    the planner's view), about 1 KB per type of the catalogue, 16 B per interval and type
    (Algorithm 1's byte and message counters, kept for the whole history), about 160 B per
    message (its row, its id in the duplicate check), 16 B per destination and 1 MiB for
    the decider and simulator state of any size."""
    k1 = num_topics + 1
    return (8 * k1 * num_nodes + 128 * num_nodes + 192 * k1 + 1000 * num_types
            + 16 * (windows + 1) * num_types + 160 * messages + 16 * num_hosts + (1 << 20))


@dataclass(frozen=True)
class ResourceLimits:
    """The bounds of what requests may make the server hold (``configs/serve.yaml``;
    ``docs/serving.md`` lists the answer to each). Every field is a positive number."""

    #: N: nodes of one session (422 above)
    max_nodes: int = 20_000
    #: K: MQ topics of one session (422 above; the schema's own bound is 4096)
    max_topics: int = 4096
    #: destinations of one session's types together, sum of |D(m)| (422 / 409 above)
    max_destinations: int = 2_000_000
    #: types x (K+1) of one parallel batch decision (its score matrix; 409 above)
    max_batch_cells: int = 1 << 24
    #: estimated bytes of all of one key's sessions, static and online (429 above)
    key_memory_bytes: int = 1 * GiB
    #: estimated bytes of all sessions of all keys (429 above)
    memory_bytes: int = 4 * GiB
    #: a session unused this long is deleted (its next request: 404)
    idle_s: float = 3600.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (
                    math.isfinite(v) and v > 0):
                raise ValueError(f"limits.{f.name} must be a positive number, got {v!r}")
        if self.max_topics > 4096:
            raise ValueError(f"limits.max_topics must be at most 4096 (the API's bound), got "
                             f"{self.max_topics}")
        if self.key_memory_bytes > self.memory_bytes:
            raise ValueError(f"limits.key_memory_bytes ({self.key_memory_bytes}) must not "
                             f"exceed limits.memory_bytes ({self.memory_bytes})")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any] | ResourceLimits | None) -> ResourceLimits:
        """``limits: {max_nodes, ...}`` (any subset; the rest keep their defaults); None:
        the defaults. Unknown keys are refused."""
        if m is None:
            return cls()
        if isinstance(m, ResourceLimits):
            return m
        if not isinstance(m, Mapping):
            raise ValueError(f"limits: expected a mapping, got {type(m).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(m) - set(known))
        if unknown:
            raise ValueError(f"limits: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(m))


class BudgetExceeded(Exception):
    """A charge that would take a key, or the server, past its memory budget (HTTP 429)."""


@dataclass
class Lease:
    """A session's account: owner, charged bytes, last use (monotonic seconds) and the lock
    its requests take in turn."""

    owner: str | None
    charged: int = 0
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def threaded(self) -> bool:
        """Whether its requests run on a worker thread (:data:`THREADED_BYTES`)."""
        return self.charged >= THREADED_BYTES

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def idle_for(self, now: float) -> float:
        return now - self.last_used


class MemoryBudget:
    """The estimated bytes charged to each key and to the server (module docstring). Used
    on the event loop only (no lock): every charge is decided before a request's work
    starts, and released when a session ends."""

    def __init__(self, limits: ResourceLimits,
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.limits = limits
        self.on_refused = on_refused
        self.by_owner: dict[str, int] = {}
        self.total = 0

    def used(self, owner: str | None) -> int:
        return self.by_owner.get(owner or "", 0)

    def charge(self, lease: Lease, new_bytes: int) -> None:
        """Set ``lease``'s charge to ``new_bytes`` (a session's estimate after the request),
        or raise :class:`BudgetExceeded` naming the limit and change nothing."""
        delta = int(new_bytes) - lease.charged
        owner = lease.owner or ""
        if delta > 0:
            mine = self.by_owner.get(owner, 0) + delta
            lim = self.limits
            if mine > lim.key_memory_bytes:
                self._refused("key")
                raise BudgetExceeded(
                    f"this key's sessions would hold about {_mb(mine)} (estimated), over "
                    f"its budget of {_mb(lim.key_memory_bytes)} (limits.key_memory_bytes): "
                    f"close sessions or make this one smaller")
            if self.total + delta > lim.memory_bytes:
                self._refused("server")
                raise BudgetExceeded(
                    f"the server's sessions would hold about {_mb(self.total + delta)} "
                    f"(estimated), over its budget of {_mb(lim.memory_bytes)} "
                    f"(limits.memory_bytes): retry later")
        self.by_owner[owner] = self.by_owner.get(owner, 0) + delta
        if self.by_owner[owner] <= 0:
            del self.by_owner[owner]
        self.total += delta
        lease.charged = int(new_bytes)

    def release(self, lease: Lease) -> None:
        """A session ended: its charge is returned."""
        self.charge(lease, 0)

    @contextmanager
    def building(self, lease: Lease, new_bytes: int) -> Iterator[Lease]:
        """A new session's charge for the time it is built: :meth:`charge` first (raising
        :class:`BudgetExceeded` before anything is allocated), returned if the build
        fails."""
        self.charge(lease, new_bytes)
        try:
            yield lease
        except BaseException:
            self.release(lease)
            raise

    def _refused(self, which: str) -> None:
        if self.on_refused is not None:
            self.on_refused(which)


def _mb(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


class KeySlots:
    """At most ``per_key`` requests of one key on worker threads at a time; the others of
    that key wait their turn (on the event loop, holding no thread). Used on the event loop
    only."""

    def __init__(self, per_key: int = THREADS_PER_KEY) -> None:
        self.per_key = per_key
        self._slots: dict[str, asyncio.Semaphore] = {}

    def of(self, owner: str | None) -> asyncio.Semaphore:
        key = owner or ""
        sem = self._slots.get(key)
        if sem is None:
            sem = self._slots[key] = asyncio.Semaphore(self.per_key)
        return sem
