"""The controller's sending path in simulation: tenants' RPC messages through the real tenant
shaper (:class:`delivery.fairness.TenantShaper`, on a simulated clock) and a queueing model of
what follows it in :class:`delivery.controller.Controller` (the outbox, the flushes and the
pushes), so that a shaping policy can be judged in seconds on the workloads the real path
was measured on (``bench/bench_fairness.py --map``).

This is the model of Sincon's Section II-B for the project's own control channel: tenants
share one ordered processing path, and one tenant's burst delays the others behind it. What
the path shares, as the controller runs it:

* **accepting** (``send_many``): encoding each message and writing it to the durable outbox
  in one SQLite transaction: a call of ``k`` messages takes ``accept_fixed_s + k *
  accept_per_message_s`` of its thread; a message's timestamp is taken before (the delay
  counts it).
* **the interpreter** (one lock, handed over every few milliseconds): while another thread
  is busy on the CPU (a ``send_many`` accepting its messages, the shaper's pump dispatching
  and pushing), each ``send_many`` and ``flush`` of a sender waits ``contention_s`` more.
* **dispatching**: under the controller's dispatch lock, each accepted message goes to its
  nodes' outbox, or, with shaping on, into its tenant class's queue of the shaper (released
  at once when the class may process it now, else later by the shaper's pump).
* **flushing**: a flush takes every node's outbox (under the dispatch lock) and pushes one
  batch per node; flushes push one after another, in the order they took the outbox. A push
  round of ``n`` nodes x ``k`` messages takes ``push_fixed_s + n * k * push_per_message_s``
  (the nodes' calls run concurrently but share one interpreter: a node's ``i``-th message is
  applied at ``push_fixed_s + n * (i + 1) * push_per_message_s`` into the round). A caller of
  ``flush`` waits until its round is done.
* **the shaper's pump** (shaping on): releases what is due (one
  :meth:`~delivery.fairness.TenantShaper.step`), then, holding the dispatch lock, dispatches
  and flushes it and waits for its push round (the pump's ``release`` does this in the
  controller, so the dispatch lock is busy meanwhile); then sleeps until the next item is
  due (at least ``tick_s``) or a new queue head wakes it.

The workload (:class:`PathWorkload`) is ``bench_fairness``'s and its generalisation: tenants
hand the controller bursts, each in one ``send_many`` from a thread of its own, while a
sending loop sends one message of each streaming tenant per round and flushes after each
round, waiting for it (a closed loop: a round that waits delays the next round's
timestamps, as the benchmark's sending loop does). At the end everything left is flushed.
Delay = applied - timestamp for every (node, message) (:class:`PathRecords`).

The five cost constants live in ``delivery/sending_costs.json`` with their source: fitted on
the unshaped cells of the committed fairness map (``bench/bench_fairness_fidelity.py
--fit``); the shaped cells are the validation. ``link_Bps`` (:class:`PathSimulation`) adds a
link between the controller and the nodes that push rounds cross in order (a modelling
choice, not part of the validated path, which has none).
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
from collections import defaultdict, deque
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from envs.shaping.sincon import ShapingError

from .fairness import TenantShaper, TenantShapingConfig

__all__ = ["BIG", "BURST", "COSTS_PATH", "SMALL", "STREAM", "PathRecords", "PathSimulation",
           "PathWorkload", "SendingCosts", "percentiles", "simulate_path"]

BIG, SMALL = 1, 2  # the VPCs of bench_fairness: the bursting tenant, the first small one
BURST, STREAM = 0, 1  # the kinds of message: handed over in a burst, sent by the loop
COSTS_PATH = Path(__file__).with_name("sending_costs.json")


@dataclass(frozen=True)
class SendingCosts:
    """The sending path's service times (seconds; see the module docstring)."""

    accept_fixed_s: float
    accept_per_message_s: float
    push_fixed_s: float
    push_per_message_s: float
    contention_s: float = 0.0
    tick_s: float = 0.001   # TenantShaper's shortest pump sleep (its default)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                    or v < 0:
                raise ShapingError(f"sending costs: {f.name} must be a finite number of "
                                   f"seconds >= 0, got {v!r}")

    @classmethod
    def load(cls, path: str | Path = COSTS_PATH) -> SendingCosts:
        """The constants of ``path`` (its ``costs`` mapping); errors name the file and key."""
        p = Path(path)
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise ShapingError(f"sending costs: cannot read {p}: {e}") from e
        costs = doc.get("costs") if isinstance(doc, Mapping) else None
        if not isinstance(costs, Mapping):
            raise ShapingError(f"sending costs: {p} has no 'costs' mapping")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(costs) - known)
        if unknown:
            raise ShapingError(f"sending costs: {p}: unknown key(s) {unknown} (known: "
                               f"{sorted(known)})")
        missing = sorted(f.name for f in fields(cls)
                         if f.default is MISSING and f.name not in costs)
        if missing:
            raise ShapingError(f"sending costs: {p}: missing key(s) {missing}")
        try:
            return cls(**{k: costs[k] for k in costs})
        except ShapingError as e:
            raise ShapingError(f"{e} (in {p})") from None

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class PathWorkload:
    """Tenants' messages to ``nodes`` nodes (``size``-byte payloads). ``bursts``: ``(vpc,
    messages, at_s)``, each one ``send_many`` from a thread of its own at ``at_s``;
    ``streams``: the VPCs the sending loop serves, one message each per round, ``rate_hz``
    rounds/s for ``duration_s`` s, a flush after each round (waited for)."""

    bursts: tuple[tuple[int, int, float], ...] = ()
    streams: tuple[int, ...] = ()
    rate_hz: float = 20.0
    duration_s: float = 5.0
    size: int = 128
    nodes: int = 4

    def __post_init__(self) -> None:
        for name in ("size", "nodes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ShapingError(f"workload: {name} must be a whole number >= 1, got {v!r}")
        for name in ("rate_hz", "duration_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) \
                    or not (v > 0 and math.isfinite(v)):
                raise ShapingError(f"workload: {name} must be a positive number, got {v!r}")
        for i, b in enumerate(self.bursts):
            ok = (isinstance(b, tuple | list) and len(b) == 3 and isinstance(b[1], int)
                  and not isinstance(b[1], bool) and b[1] >= 0
                  and isinstance(b[2], int | float) and math.isfinite(b[2]) and b[2] >= 0)
            if not ok:
                raise ShapingError(f"workload: bursts[{i}] must be (vpc, messages >= 0, "
                                   f"at_s >= 0), got {b!r}")

    @classmethod
    def burst_map(cls, burst: int = 3000, smalls: int = 1, **kw: Any) -> PathWorkload:
        """``bench_fairness``'s scenario (:func:`tests.test_fairness.burst_scenario`): VPC
        :data:`BIG` bursts ``burst`` messages at 0 while ``smalls`` small tenants (VPCs
        :data:`SMALL`, ...) stream."""
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 0:
            raise ShapingError(f"workload: burst must be a whole number >= 0, got {burst!r}")
        if isinstance(smalls, bool) or not isinstance(smalls, int) or smalls < 1:
            raise ShapingError(f"workload: smalls must be a whole number >= 1, got {smalls!r}")
        return cls(bursts=((BIG, burst, 0.0),), streams=tuple(SMALL + j for j in range(smalls)),
                   **kw)


# ----------------------------------------------------------------------------- the engine

_Proc = Generator["_Wait", None, None]
_Tag = tuple[int, int]                          # (vpc, kind)
_Msg = tuple[_Tag, float, tuple[int, ...]]      # (tag, timestamp, hosts)


class _Event:
    """Something processes wait for; ``fire`` wakes them (once)."""

    __slots__ = ("done", "waiters")

    def __init__(self) -> None:
        self.done = False
        self.waiters: list[Callable[[], None]] = []


@dataclass
class _Wait:
    """What a process waits for: ``delay`` seconds, or ``event`` (whichever comes first
    when both are given)."""

    delay: float = math.inf
    event: _Event | None = None


class _Engine:
    """A minimal process-based discrete-event engine (generators yielding :class:`_Wait`)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def fire(self, ev: _Event) -> None:
        if ev.done:
            return
        ev.done = True
        waiters, ev.waiters = ev.waiters, []
        for w in waiters:
            self.at(self.now, w)

    def spawn(self, proc: _Proc) -> None:
        self.at(self.now, lambda: self._resume(proc))

    def _resume(self, proc: _Proc) -> None:
        try:
            w = next(proc)
        except StopIteration:
            return
        woken = [False]

        def wake() -> None:
            if not woken[0]:
                woken[0] = True
                self._resume(proc)

        if w.event is not None:
            if w.event.done:
                self.at(self.now, wake)
                return
            w.event.waiters.append(wake)
        if w.delay < math.inf:
            self.at(self.now + max(0.0, w.delay), wake)
        elif w.event is None:
            raise RuntimeError("a process waits for nothing")

    def run(self, until: float = math.inf) -> None:
        """Process the events due up to ``until`` (all of them by default); the clock then
        reads ``until`` when that is finite."""
        while self._heap and self._heap[0][0] <= until:
            t, _, fn = heapq.heappop(self._heap)
            self.now = max(self.now, t)
            fn()
        if math.isfinite(until):
            self.now = max(self.now, until)


class _Lock:
    """A FIFO lock of the simulated threads (re-entrancy is the caller's business)."""

    def __init__(self, eng: _Engine) -> None:
        self.eng = eng
        self.held = False
        self._waiting: deque[_Event] = deque()

    def acquire(self) -> _Event:
        ev = _Event()
        if not self.held:
            self.held = True
            ev.done = True
        else:
            self._waiting.append(ev)
        return ev

    def release(self) -> None:
        if self._waiting:
            self.eng.fire(self._waiting.popleft())  # handed over: stays held
        else:
            self.held = False


# ----------------------------------------------------------------------------- the path

class _SendingPath:
    """The controller's path of the module docstring on the engine."""

    def __init__(self, eng: _Engine, costs: SendingCosts, shaping: Mapping[str, Any] | None,
                 record: Callable[[_Tag, float, float], None]) -> None:
        self.eng, self.costs, self.record = eng, costs, record
        self.dispatch = _Lock(eng)
        self.outbox: dict[int, list[tuple[_Tag, float]]] = defaultdict(list)
        self._rounds: deque[tuple[dict[int, list[tuple[_Tag, float]]], _Event]] = deque()
        self._pushing = False
        self._pump_items: list[_Msg] | None = None
        self._kick: _Event | None = None
        self.pushes = 0
        self._busy: dict[str, int] = defaultdict(int)   # thread -> CPU-bound steps under way
        self.shaper: TenantShaper[_Msg] | None = None
        if shaping is not None:
            cfg = TenantShapingConfig.from_mapping(shaping)
            if cfg.enabled:
                self.shaper = TenantShaper(cfg, self._release, clock=lambda: self.eng.now,
                                           tick_s=costs.tick_s)

    # a message is (tag, timestamp, hosts); the tag is (vpc, kind)
    def _to_outbox(self, tag: tuple[int, int], ts: float, hosts: tuple[int, ...]) -> None:
        for n in hosts:
            self.outbox[n].append((tag, ts))

    def _release(self, items: list[_Msg]) -> None:
        if self._pump_items is not None:  # the pump's release: dispatched by the pump process
            self._pump_items.extend(items)
        else:  # inline, on a sender that holds the dispatch lock
            for it in items:
                self._to_outbox(*it)

    def _contended(self, thread: str) -> _Proc:
        """The interpreter's hand-over wait of ``thread`` while another thread is busy."""
        if self.costs.contention_s and any(n for t, n in self._busy.items() if t != thread):
            yield _Wait(self.costs.contention_s)

    def send_many(self, msgs: list[_Msg], size: int,
                  thread: str) -> _Proc:
        """One ``send_many`` call of ``thread`` (a sub-process of it)."""
        yield from self._contended(thread)
        self._busy[thread] += 1
        yield _Wait(self.costs.accept_fixed_s + len(msgs) * self.costs.accept_per_message_s)
        self._busy[thread] -= 1
        yield _Wait(event=self.dispatch.acquire())
        for tag, ts, hosts in msgs:
            if self.shaper is None:
                self._to_outbox(tag, ts, hosts)
            else:
                had_head = self._heads()
                self.shaper.submit(tag[0], size * len(hosts), (tag, ts, hosts))
                if self._heads() > had_head and self._kick is not None:
                    self.eng.fire(self._kick)  # a new head: the pump's wake-up may be earlier
        self.dispatch.release()

    def _heads(self) -> int:
        assert self.shaper is not None
        return len(self.shaper.backlog())

    def flush(self, thread: str, hold_dispatch: bool = False) -> _Proc:
        """``thread`` takes the outbox (under the dispatch lock unless it holds it) and waits
        for its push round."""
        yield from self._contended(thread)
        if not hold_dispatch:
            yield _Wait(event=self.dispatch.acquire())
        batch, self.outbox = self.outbox, defaultdict(list)
        if not hold_dispatch:
            self.dispatch.release()
        done = _Event()
        self._rounds.append((dict(batch), done))
        if not self._pushing:
            self.eng.spawn(self._pusher())
        yield _Wait(event=done)

    def _pusher(self) -> _Proc:
        self._pushing = True
        c = self.costs
        while self._rounds:
            batch, done = self._rounds.popleft()
            if any(batch.values()):
                self.pushes += 1
                n = sum(1 for ms in batch.values() if ms)
                t0 = self.eng.now
                for ms in batch.values():
                    for i, (tag, ts) in enumerate(ms):
                        self.record(tag, ts, t0 + c.push_fixed_s
                                    + n * (i + 1) * c.push_per_message_s)
                longest = max(len(ms) for ms in batch.values())
                yield _Wait(c.push_fixed_s + n * longest * c.push_per_message_s)
            self.eng.fire(done)
        self._pushing = False

    def pump(self, until_idle: Callable[[], bool]) -> _Proc:
        """The shaper's pump thread; ends when nothing is queued and ``until_idle()``."""
        sh = self.shaper
        assert sh is not None
        while True:
            self._pump_items = []
            wait = sh.step()
            items, self._pump_items = self._pump_items, None
            if items:
                yield _Wait(event=self.dispatch.acquire())
                self._busy["pump"] += 1
                for it in items:
                    self._to_outbox(*it)
                yield from self.flush("pump", hold_dispatch=True)
                self._busy["pump"] -= 1
                self.dispatch.release()
                continue  # the real pump computes its next due time after the push
            if wait == math.inf and until_idle():
                return
            self._kick = _Event()
            yield _Wait(min(max(wait, self.costs.tick_s), 1.0), self._kick)
            self._kick = None


@dataclass
class PathRecords:
    """Every (node, message) delivery of a simulation: VPC, kind (:data:`BURST` or
    :data:`STREAM`), timestamp and application time (s), one array each."""

    vpc: np.ndarray
    kind: np.ndarray
    ts: np.ndarray
    applied: np.ndarray
    rounds: int      # rounds the sending loop sent
    pushes: int      # push rounds with something to push

    def delays_ms(self, vpc: int | None = None, kind: int | None = None) -> np.ndarray:
        """The delays (ms) of the deliveries of ``vpc`` and ``kind`` (None: any)."""
        m = np.ones(self.vpc.size, dtype=bool)
        if vpc is not None:
            m &= self.vpc == vpc
        if kind is not None:
            m &= self.kind == kind
        return np.asarray((self.applied[m] - self.ts[m]) * 1e3, dtype=np.float64)

    @property
    def end_s(self) -> float:
        return float(self.applied.max()) if self.applied.size else 0.0


class PathSimulation:
    """``workload`` through the sending path with ``shaping`` (a ``controller.shaping``
    mapping, as :func:`tests.test_fairness.arm_configs` gives; None: no shaper), steppable:
    :meth:`run_until` advances the clock, :meth:`run` to the end. ``link_Bps``: a link of
    that many payload bytes/s between the controller and the nodes (None: none; the
    measured path has none), which push rounds cross in their order: a delivery then takes
    at least ``size / link_Bps`` of its round. Deterministic."""

    def __init__(self, workload: PathWorkload, shaping: Mapping[str, Any] | None,
                 costs: SendingCosts | None = None, *, link_Bps: float | None = None) -> None:
        costs = costs or SendingCosts.load()
        if link_Bps is not None:
            if isinstance(link_Bps, bool) or not isinstance(link_Bps, int | float) \
                    or not (link_Bps > 0 and math.isfinite(link_Bps)):
                raise ShapingError(f"link_Bps must be a positive number of bytes/s, got "
                                   f"{link_Bps!r}")
            per = max(costs.push_per_message_s, workload.size / float(link_Bps))
            costs = SendingCosts(**{**costs.to_dict(), "push_per_message_s": per})
        self.workload, self.costs = workload, costs
        self.eng = eng = _Engine()
        self._rec: list[tuple[int, int, float, float]] = []
        self.created: list[tuple[int, int, float]] = []   # (vpc, kind, ts), one per delivery
        self.path = path = _SendingPath(eng, costs, shaping,
                                        lambda tag, ts, applied: self._rec.append(
                                            (*tag, ts, applied)))
        self.submitted_bytes: dict[int, int] = defaultdict(int)   # class -> bytes submitted
        hosts = tuple(range(workload.nodes))
        self.state: dict[str, Any] = {"bursts_left": sum(1 for b in workload.bursts if b[1]),
                                      "streaming": bool(workload.streams), "rounds": 0,
                                      "closed": False}
        state = self.state

        def created(vpc: int, kind: int, ts: float, n: int) -> None:
            self.created.extend([(vpc, kind, ts)] * (n * len(hosts)))
            if path.shaper is not None:
                self.submitted_bytes[path.shaper.class_of(vpc)] += n * workload.size * len(
                    hosts)

        def burst(vpc: int, n: int, at_s: float) -> _Proc:
            if at_s > eng.now:
                yield _Wait(at_s - eng.now)
            created(vpc, BURST, at_s, n)
            yield from path.send_many([((vpc, BURST), at_s, hosts)] * n, workload.size,
                                      f"burst-{vpc}-{at_s}")
            state["bursts_left"] -= 1

        def sender() -> _Proc:
            k = 0
            while (t := k / workload.rate_hz) < workload.duration_s:
                if t > eng.now:
                    yield _Wait(t - eng.now)
                for v in workload.streams:
                    created(v, STREAM, eng.now, 1)
                    yield from path.send_many([((v, STREAM), eng.now, hosts)], workload.size,
                                              "sender")
                yield from path.flush("sender")
                k += 1
            state["rounds"] = k
            state["streaming"] = False

        def closer() -> _Proc:  # the end of the run: join the threads, flush what is left
            while state["bursts_left"] or state["streaming"]:
                yield _Wait(0.001)
            yield from path.flush("sender")
            state["closed"] = True

        for vpc, n, at_s in workload.bursts:
            if n:
                eng.spawn(burst(vpc, n, float(at_s)))
        if workload.streams:
            eng.spawn(sender())
        eng.spawn(closer())
        if path.shaper is not None:
            eng.spawn(path.pump(lambda: bool(state["closed"])))

    @property
    def now(self) -> float:
        return self.eng.now

    @property
    def shaper(self) -> TenantShaper[Any] | None:
        """The tenant shaper (None: unshaped); its ``limits.policy`` may be replaced."""
        return self.path.shaper

    def run_until(self, t: float) -> None:
        """Process every event up to clock time ``t``."""
        self.eng.run(until=t)

    def run(self) -> PathRecords:
        """Run to the end (everything delivered) and return the records."""
        self.eng.run()
        p = self.path
        if any(p.outbox.values()) or (p.shaper is not None and p.shaper.backlog()):
            raise RuntimeError("sending-path simulation ended with messages undelivered")
        return self.records()

    @property
    def delivered(self) -> int:
        """Deliveries recorded so far (see :meth:`records`)."""
        return len(self._rec)

    def records(self) -> PathRecords:
        """The deliveries recorded so far (a push round records its messages when it
        starts, with their application times)."""
        a = np.asarray(self._rec, dtype=np.float64).reshape(-1, 4)
        return PathRecords(vpc=a[:, 0].astype(np.int64), kind=a[:, 1].astype(np.int64),
                           ts=a[:, 2], applied=a[:, 3], rounds=int(self.state["rounds"]),
                           pushes=self.path.pushes)

    def waiting_s(self, t0: float, t1: float, kind: int | None = None) -> float:
        """Delivery-seconds of waiting accrued between ``t0`` and ``t1`` (<= now) by the
        deliveries of ``kind`` (None: all): for each, the part of ``[t0, t1]`` after its
        timestamp and before its application (Little's law: the sum of their delays)."""
        c = np.asarray(self.created, dtype=np.float64).reshape(-1, 3)
        r = np.asarray(self._rec, dtype=np.float64).reshape(-1, 4)
        if kind is not None:
            c, r = c[c[:, 1] == kind], r[r[:, 1] == kind]
        started = np.clip(t1 - np.maximum(c[:, 2], t0), 0.0, None).sum()
        done = np.clip(t1 - np.maximum(r[:, 3], t0), 0.0, None).sum()
        return float(started - done)


def simulate_path(workload: PathWorkload, shaping: Mapping[str, Any] | None,
                  costs: SendingCosts | None = None, *,
                  link_Bps: float | None = None) -> PathRecords:
    """``workload`` through the sending path (:class:`PathSimulation`), to the end."""
    return PathSimulation(workload, shaping, costs, link_Bps=link_Bps).run()


def percentiles(xs: Sequence[float] | np.ndarray) -> dict[str, float]:
    """p50 and p95 (ms) of ``xs``."""
    a = np.asarray(xs, dtype=np.float64)
    return {"p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95))}
