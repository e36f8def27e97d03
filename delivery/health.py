"""MQ-channel health and the failover plan (Stemflow Section IV's fast reaction to failures;
SMART Eq. 1's controller constraints, Section V-B).

* :class:`FailoverConfig`: the ``failover`` section of the delivery configuration, validated
  (a bad key, type or range is a :class:`ConfigError` naming ``section.key`` and the value).
* :func:`security_setting`: the ``security`` section (:class:`security.tls.Security`) of the
  agent's and the controller's configuration, validated the same way.
* :class:`MqHealth`: a thread that publishes a one-byte probe on a topic nobody subscribes
  (the broker drops it at once) every ``probe_period_s`` through the controller's own Pulsar
  client. A probe fails when the broker does not acknowledge it within ``probe_timeout_s``, or
  when the controller's oldest unacknowledged data publish is older than
  ``publish_timeout_s``. A late probe, or an old unacknowledged publish, is not a failure
  while the broker keeps acknowledging data publishes: if one was acknowledged after the
  probe left, the broker is alive and the controller's link is full (its queue holds the
  probe behind the data), so the probe is counted as ``congested`` and judged neither way
  (a broker that dies stops acknowledging, and the probes sent after that fail as
  before). The channel is
  declared DOWN after ``fail_after`` consecutive failures and UP again after
  ``recover_after`` consecutive successes. Probes are pipelined (one leaves every period
  whatever the previous one's fate), so a broker that dies is declared down within
  :attr:`FailoverConfig.detection_bound_s` = ``fail_after * probe_period_s +
  probe_timeout_s``, plus at most one ``push_timeout_s`` while RPC pushes fill the link.
  While down, a probe producer that lost its connection gets a fresh
  twin (another one every 5 s while none has connected, at most 3 creations in flight), and
  the first to be connected is probed with: an existing producer reconnects on the client's
  own back-off, which can leave it disconnected long after the broker is back, and a
  creation that began while the broker was away waits for its own lookup back-off.
  Producers are created on helper threads that hold no lock: creating one blocks for the
  client's operation timeout while the broker is away, so a broker that is already away
  when probing starts is declared down only once that first creation has failed.
* :class:`RateWindow`: each type's traffic (bit/s, messages/s) over the last
  ``rate_window_s`` seconds.
* :func:`plan_failover`: which MQ types move to RPC while the broker is down. The current RPC
  types keep their channel and use the controller's capacity first; then each MQ type, oldest
  waiting message first, moves if the controller stays within C_b and C_p, else it waits.
  The cost is :class:`envs.dsmd.cost.CostState`'s: an RPC type costs ``f(m) |D(m)|`` bit/s
  and ``|D(m)|`` sends per message.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from envs.dsmd.cost import CostState
from envs.dsmd.instance import RPC, DSMDInstance
from security.tls import Security, SecurityError

__all__ = ["ConfigError", "FailoverConfig", "FailoverPlan", "MqHealth", "RateWindow",
           "RpcBacklog",
           "close_in_background", "connected", "plan_failover", "security_setting", "warm_up"]

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A bad delivery configuration: ``delivery config: <section>.<key>: <what is wrong>``."""


def security_setting(value: Any) -> Security:
    """The ``security`` setting of an agent or controller (:class:`security.tls.Security`)
    from itself, a ``{insecure, pki_dir}`` mapping or None (the secure default); a bad value
    is a :class:`ConfigError` naming ``delivery config: security.<key>``."""
    try:
        return Security.from_mapping(value, "delivery config: security")
    except SecurityError as e:
        msg = str(e)
        if not msg.startswith("delivery config: "):
            msg = f"delivery config: {msg}"
        raise ConfigError(msg) from None


# ---------------------------------------------------------------------------- configuration

# key -> (kind, lower bound, whether the bound itself is allowed)
_RULES: dict[str, tuple[str, float, bool]] = {
    "enabled": ("bool", 0, True),
    "probe_period_s": ("float", 0, False),
    "probe_timeout_s": ("float", 0, False),
    "publish_timeout_s": ("float", 0, False),
    "fail_after": ("int", 1, True),
    "recover_after": ("int", 1, True),
    "replan_period_s": ("float", 0, False),
    "rate_window_s": ("float", 0, False),
    "controller_bw_bps": ("float?", 0, False),
    "controller_cpu": ("float?", 0, False),
    "relay": ("bool", 0, True),
    "relay_after_s": ("float", 0, True),
    "confirm_timeout_s": ("float", 0, False),
}


def _checked(section: str, key: str, v: Any) -> Any:
    """``v`` as the value of ``key``, or a :class:`ConfigError` naming ``section.key``."""
    kind, low, inclusive = _RULES[key]
    where = f"delivery config: {section}.{key}"
    if kind == "bool":
        if not isinstance(v, bool):
            raise ConfigError(f"{where}: expected true or false, got {v!r}")
        return v
    if kind == "float?" and v is None:
        return None
    if kind == "int":
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise ConfigError(f"{where}: expected an integer, got {v!r}")
        v = int(v)
    else:
        if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating):
            none = " or null (unbounded)" if kind == "float?" else ""
            raise ConfigError(f"{where}: expected a number{none}, got {v!r}")
        v = float(v)
        if not math.isfinite(v):
            raise ConfigError(f"{where}: expected a finite number, got {v!r}")
    if v < low or (v == low and not inclusive):
        bound = f">= {low:g}" if inclusive else f"> {low:g}"
        raise ConfigError(f"{where}: must be {bound}, got {v!r}")
    return v


@dataclass(frozen=True)
class FailoverConfig:
    """How the controller watches the MQ channel and reacts when it fails (see the module
    docstring). ``controller_bw_bps`` (C_b, bit/s) and ``controller_cpu`` (C_p, Eq. 1's
    concurrent sends: ``|D(m)|`` per RPC type) bound what failover may move to RPC; None
    leaves that bound to the caller (unbounded if it has none either). ``relay``: a node
    whose RPC endpoint has been down for ``relay_after_s`` is reached through a topic it is
    subscribed to. ``confirm_timeout_s``: an MQ message that a
    node answering RPC has not confirmed in that time is re-sent over RPC.
    ``publish_timeout_s``: a data publish unacknowledged that long fails the probe (the broker
    takes connections but does not persist)."""

    enabled: bool = True
    probe_period_s: float = 0.2
    probe_timeout_s: float = 1.0
    publish_timeout_s: float = 3.0
    fail_after: int = 3
    recover_after: int = 3
    replan_period_s: float = 1.0
    rate_window_s: float = 5.0
    controller_bw_bps: float | None = None
    controller_cpu: float | None = None
    relay: bool = True
    relay_after_s: float = 1.0
    confirm_timeout_s: float = 3.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _checked("failover", f.name,
                                                      getattr(self, f.name)))

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any] | FailoverConfig | None,
                     section: str = "failover") -> FailoverConfig:
        """Build from a mapping (a YAML/Hydra ``failover:`` block); None gives the defaults
        and a :class:`FailoverConfig` is returned as it is. An unknown key, a value of the
        wrong type (a boolean or a string is not a number) or out of range is a
        :class:`ConfigError` naming ``section.key`` and the value."""
        if m is None:
            return cls()
        if isinstance(m, FailoverConfig):
            return m
        if not isinstance(m, Mapping):
            raise ConfigError(f"delivery config: {section}: expected a mapping, got "
                              f"{type(m).__name__} {m!r}")
        unknown = sorted(str(k) for k in m if k not in _RULES)
        if unknown:
            raise ConfigError(f"delivery config: {section}.{unknown[0]}: unknown key "
                              f"(unknown: {unknown}; known: {sorted(_RULES)})")
        return cls(**{str(k): _checked(section, str(k), v) for k, v in m.items()})

    @property
    def detection_bound_s(self) -> float:
        """How long after the broker stops answering the channel is declared down at the
        latest: ``fail_after`` probe periods, plus the last probe's timeout."""
        return self.fail_after * self.probe_period_s + self.probe_timeout_s

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------- rates

class RateWindow:
    """Each type's traffic over the last ``window_s`` seconds (thread-safe): ``add`` one
    message as it is sent, ``rates`` gives type -> (bit/s, messages/s), the window's totals
    divided by its length. Types with no message in the window are left out."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not (isinstance(window_s, int | float) and window_s > 0 and math.isfinite(window_s)):
            raise ValueError(f"window_s must be a positive number, got {window_s!r}")
        self.window_s = float(window_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: deque[tuple[float, int, int]] = deque()  # (time, type, bytes)
        self._bytes: dict[int, int] = defaultdict(int)
        self._count: dict[int, int] = defaultdict(int)
        self._fanout: dict[int, int] = {}

    def add(self, type_id: int, nbytes: int, fanout: int) -> None:
        """One message of ``type_id``, ``nbytes`` long, for ``fanout`` destination nodes."""
        t, b = int(type_id), int(nbytes)
        with self._lock:
            now = self._clock()
            self._expire(now)
            self._seen.append((now, t, b))
            self._bytes[t] += b
            self._count[t] += 1
            self._fanout[t] = int(fanout)

    def rates(self) -> dict[int, tuple[float, float]]:
        """type -> (bit/s, messages/s) over the window."""
        with self._lock:
            self._expire(self._clock())
            w = self.window_s
            return {t: (8.0 * self._bytes[t] / w, c / w) for t, c in self._count.items()}

    def fanouts(self) -> dict[int, int]:
        """type -> the destination count of its last message (types seen in the window)."""
        with self._lock:
            self._expire(self._clock())
            return {t: self._fanout[t] for t in self._count}

    def _expire(self, now: float) -> None:
        old = now - self.window_s
        seen = self._seen
        while seen and seen[0][0] <= old:
            _, t, b = seen.popleft()
            self._bytes[t] -= b
            self._count[t] -= 1
            if not self._count[t]:
                del self._count[t], self._bytes[t]


# ---------------------------------------------------------------------------- the plan

_HUGE = 2 ** 62          # "unbounded": no capacity of Eq. 1 binds
_warned: set[str] = set()


@dataclass(frozen=True)
class FailoverPlan:
    """Which MQ types go over RPC while the broker is down (``moved``) and which wait
    (``waiting``, oldest waiting message first); the RPC load the plan puts on the controller
    (bit/s, Eq. 1's concurrent sends), and each MQ type's reason: ``"fits"``,
    ``"over C_b (x > y)"`` or ``"over C_p (x > y)"``."""

    moved: tuple[int, ...]
    waiting: tuple[int, ...]
    controller_bw_bps: float
    controller_cpu: float
    reasons: dict[int, str]


def _unbounded(what: str) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning("failover: no %s configured; moving MQ types to RPC unbounded by it", what)


def plan_failover(mq_types: Sequence[int], rpc_types: Sequence[int],
                  hosts: Mapping[int, Sequence[int]], rates: Mapping[int, tuple[float, float]],
                  controller_bw_bps: float | None, controller_cpu: float | None,
                  oldest_ns: Mapping[int, int] | None = None) -> FailoverPlan:
    """Plan an MQ outage under Eq. 1's controller constraints (SMART Section V-B).

    The instance has one entry per type of ``rpc_types`` + ``mq_types`` (destinations =
    ``hosts``, f(m) = the bit/s of ``rates`` rounded to an integer);
    the types of ``rpc_types`` are put on RPC first (they are there already, whatever they
    cost), then each type of ``mq_types`` in the order of its oldest waiting message
    (``oldest_ns``; a type without one counts as newest; ties by type id) goes to RPC if
    :meth:`CostState.fits` allows it: ``f(m) |D(m)|`` bit/s within C_b and ``|D(m)|``
    concurrent sends within C_p, on top of the RPC types' (the types that wait are
    unassigned: they send nothing meanwhile). Otherwise it waits. A type without traffic in
    the window is not refused by C_b (it adds nothing to it; it still counts its sends); a
    type without known destinations has no node to send to and moves at no cost. None for a
    capacity means unbounded (a warning, once)."""
    order: dict[int, None] = {}
    for t in rpc_types:
        order.setdefault(int(t), None)
    rpc = list(order)
    mq: list[int] = []
    for t in mq_types:
        if int(t) not in order:
            order[int(t)] = None
            mq.append(int(t))
    old = oldest_ns or {}
    mq.sort(key=lambda t: (0, int(old[t]), t) if t in old else (1, 0, t))
    if controller_bw_bps is None:
        _unbounded("controller bandwidth C_b (failover.controller_bw_bps)")
    if controller_cpu is None:
        _unbounded("controller CPU C_p (failover.controller_cpu)")
    cb = _HUGE if controller_bw_bps is None else max(1, math.floor(controller_bw_bps))
    cp = _HUGE if controller_cpu is None else max(1, math.floor(controller_cpu))

    types = [t for t in order if hosts.get(t)]  # a type nobody needs costs nothing anywhere
    idx = {t: i for i, t in enumerate(types)}
    bits = []
    for t in types:
        b, n = rates.get(t, (0.0, 0.0))
        if not (math.isfinite(b) and math.isfinite(n) and b >= 0 and n >= 0):
            raise ValueError(f"failover plan: type {t}: rates must be finite and >= 0, got "
                             f"({b!r}, {n!r})")
        bits.append(round(b))
    state: CostState | None = None
    if types:
        inst = DSMDInstance.from_sets([hosts[t] for t in types], bits, _HUGE, 1, cb, cp)
        state = CostState(inst)
        for t in rpc:
            if t in idx:
                state.move(idx[t], RPC)
    moved, waiting, reasons = [], [], {}
    for t in mq:
        why = "fits"
        if state is not None and t in idx:
            why = _fit_reason(state, idx[t], controller_bw_bps, controller_cpu)
        reasons[t] = why
        if why == "fits":
            moved.append(t)
            if state is not None and t in idx:
                state.move(idx[t], RPC)
        else:
            waiting.append(t)
    bw = float(state.controller_bw) if state is not None else 0.0
    sends = float(state.controller_cpu) if state is not None else 0.0
    return FailoverPlan(tuple(moved), tuple(waiting), bw, sends, reasons)


def warm_up() -> None:
    """Plan a tiny outage once, so that the compiled loops of the cost model
    (:mod:`envs.dsmd.kernels`) are loaded before a real outage needs them: the first plan
    of a process otherwise pays about 2 s for that, at the worst moment.
    :meth:`MqHealth.start` runs it on a thread of its own."""
    plan_failover([1], [0], {0: (0, 1), 1: (1,)}, {0: (8.0, 1.0), 1: (8.0, 1.0)}, 1e9, 1e9)


def _fit_reason(state: CostState, m: int, cb: float | None, cp: float | None) -> str:
    """``"fits"`` if type ``m`` can go to RPC on top of ``state`` (Eq. 1's controller
    constraints, :meth:`CostState.fits`), else which bound it would break."""
    inst = state.inst
    d = int(inst.fanout[m])
    f = int(inst.rate_bps[m])
    if f > 0:
        if state.fits(m, RPC):
            return "fits"
    elif state.controller_cpu + d <= inst.controller_cpu:
        return "fits"  # no traffic: a bandwidth bound it adds nothing to does not refuse it
    bw = state.controller_bw + f * d
    if f > 0 and bw > inst.controller_bw_bps:
        return f"over C_b ({bw} > {cb:.15g} bit/s)"
    return f"over C_p ({state.controller_cpu + d} > {cp:.15g} concurrent sends)"


# ---------------------------------------------------------------------------- health

_RECREATE_S = 5.0     # while down, a fresh probe producer is tried at most this often
_MAX_CREATING = 3     # and at most this many creations are in flight

class RpcBacklog:
    """The controller's RPC pushes in flight, in the order they started, for the probe
    (module docstring): :meth:`start` numbers a push, :meth:`end` ends it (answered, failed
    or cancelled), :meth:`mark` is the number of the latest push started and
    :meth:`drained_at` the clock time by which every push up to a mark had ended (None: not
    yet). Thread-safe; keeps the drain times of the last ``memory_s`` seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 memory_s: float = 120.0) -> None:
        self._clock = clock
        self._memory_s = memory_s
        self._lock = threading.Lock()
        self._next = 1
        self._open: dict[int, None] = {}   # insertion order = start order
        # the lowest push still open after each drain, and since when (both increasing)
        self._lows: list[int] = []
        self._times: list[float] = []

    def start(self) -> int:
        with self._lock:
            seq, self._next = self._next, self._next + 1
            self._open[seq] = None
            return seq

    def end(self, seq: int) -> None:
        with self._lock:
            if seq not in self._open:  # unknown or ended twice
                return
            oldest = next(iter(self._open))
            del self._open[seq]
            if seq != oldest:  # an older push is still in flight: nothing more has drained
                return
            now = self._clock()
            self._lows.append(next(iter(self._open), self._next))
            self._times.append(now)
            old = bisect.bisect_left(self._times, now - self._memory_s)
            if old > len(self._times) // 2:  # forget in bulk: amortised O(1) per drain
                del self._lows[:old], self._times[:old]

    def mark(self) -> int:
        with self._lock:
            return self._next - 1

    def drained_at(self, mark: int) -> float | None:
        with self._lock:
            if next(iter(self._open), self._next) <= mark:
                return None
            i = bisect.bisect_right(self._lows, mark)
            return self._times[i] if i < len(self._lows) else -math.inf

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)


@dataclass(eq=False)
class _Probe:
    """One probe: due at ``deadline``; ``sent`` unless there was no producer to send it;
    ``mark``: the RPC pushes ahead of it (:class:`RpcBacklog`)."""

    deadline: float
    sent: bool = False
    result: Any = None
    sent_at: float = -math.inf   # when it left (clock time)
    answered: float | None = None
    error: str = ""   # why the publish was refused
    mark: int | None = None
    waited: bool = False   # its deadline moved for the pushes ahead of it


class MqHealth:
    """The MQ channel's health, probed through the controller's Pulsar client (see the
    module docstring). ``on_change(state, reason)`` is called on the probe thread, outside
    every lock of this class, at each change between :attr:`UP` and :attr:`DOWN`;
    ``inflight_age()`` gives the age (s) of the controller's oldest unacknowledged data
    publish (0 when there is none); ``last_ack()`` the clock time of its latest
    acknowledged data publish (None: none yet), which tells a full link from a dead broker;
    ``on_congested()`` is called for each late probe so excused; ``rpc`` is the
    controller's :class:`RpcBacklog`, whose pushes ahead of a probe move its deadline
    (``on_waited()`` is called once for each probe so moved).
    ``events`` lists the changes as (clock, state, reason); ``probes`` and ``failures``
    count the probes judged and those that failed, ``congested`` the late probes excused
    because data publishes were acknowledged meanwhile, ``waited`` the probes whose
    deadline moved for the RPC pushes ahead of them."""

    UP, DOWN = "up", "down"

    def __init__(self, client: Any, topic: str, cfg: FailoverConfig,
                 on_change: Callable[[str, str], None],
                 inflight_age: Callable[[], float] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 last_ack: Callable[[], float | None] | None = None,
                 on_congested: Callable[[], None] | None = None,
                 rpc: RpcBacklog | None = None,
                 on_waited: Callable[[], None] | None = None) -> None:
        self.client = client
        self._rpc = rpc
        self._on_waited = on_waited
        self.topic = topic
        self.cfg = cfg
        self._on_change = on_change
        self._inflight_age = inflight_age
        self._last_ack = last_ack
        self._on_congested = on_congested
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._state = self.UP
        self._last_change = clock()
        self.events: list[tuple[float, str, str]] = []
        self.probes = 0
        self.failures = 0
        self.congested = 0
        self.waited = 0
        self._fails = self._oks = 0
        self._producer: Any = None
        self._spare: Any = None                    # a fresh producer created while down
        self._missing_since: float | None = None  # no producer since then
        self._creating = 0                         # creations in flight
        self._create_started = 0.0                 # clock time of the latest
        self._create_error = ""
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ public
    def start(self) -> MqHealth:
        """Start probing (and load the failover plan's compiled loops: :func:`warm_up`)."""
        if self._thread is None:
            threading.Thread(target=_quietly, args=(warm_up,), name="mq-health-warm-up",
                             daemon=True).start()
            self._thread = threading.Thread(target=self._run, name="mq-health", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop probing and close the probe producer; returns within about 2 s whatever the
        broker does (a producer still being created is closed by its helper thread)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(1.5)
        with self._lock:
            producers = [p for p in (self._producer, self._spare) if p is not None]
            self._producer = self._spare = None
        for p in producers:
            _bounded(p.close, 0.5 / len(producers))

    @property
    def state(self) -> str:
        return self._state

    @property
    def last_change(self) -> float:
        """The clock time of the last change of state (construction time if none)."""
        return self._last_change

    def __enter__(self) -> MqHealth:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ the probe thread
    def _run(self) -> None:
        period = self.cfg.probe_period_s
        pending: deque[_Probe] = deque()
        next_send = self._clock()
        while not self._stop.is_set():
            now = self._clock()
            if now >= next_send:
                pending.append(self._send(now))
                next_send = max(next_send + period, now)  # no burst after a stall
            while pending and self._due(pending[0], self._clock()):
                self._judge(pending.popleft())
            # probes are judged in order: only the first one's deadline can wake the thread
            wake = min(next_send, pending[0].deadline) if pending else next_send
            self._wake.wait(max(0.0, wake - self._clock()))
            self._wake.clear()

    def _due(self, probe: _Probe, now: float) -> bool:
        """Whether ``probe`` can be judged now: refused, answered, or past its deadline,
        which is ``probe_timeout_s`` after the RPC pushes ahead of it ended (module
        docstring; polled every 50 ms while one of them is in flight). An answer that came
        after the probe's own deadline but within that later one is in time."""
        if probe.error:
            return True
        if probe.answered is None and now < probe.deadline:
            return False
        if self._rpc is not None and probe.mark is not None:
            drained = self._rpc.drained_at(probe.mark)
            if probe.answered is not None:
                if probe.answered > probe.deadline:  # late by its own deadline only?
                    self._extend(probe, probe.answered if drained is None
                                 else drained + self.cfg.probe_timeout_s)
                return True
            if self._extend(probe, now + 0.05 if drained is None
                            else drained + self.cfg.probe_timeout_s):
                return now >= probe.deadline
        return probe.answered is not None or now >= probe.deadline

    def _extend(self, probe: _Probe, deadline: float) -> bool:
        """Move ``probe``'s deadline to ``deadline`` if that is later (counted once per
        probe in :attr:`waited`); whether it moved."""
        if deadline <= probe.deadline:
            return False
        probe.deadline = deadline
        if not probe.waited:
            probe.waited = True
            self.waited += 1
            if self._on_waited is not None:
                self._on_waited()
        return True

    def _send(self, now: float) -> _Probe:
        probe = _Probe(now + self.cfg.probe_timeout_s, sent_at=now,
                       mark=None if self._rpc is None else self._rpc.mark())
        producer = self._ensure_producer(now)
        if producer is None:
            return probe  # judged at its deadline (no producer yet)

        def answered(res: Any, _msg_id: Any) -> None:
            probe.result, probe.answered = res, self._clock()
            self._wake.set()

        try:
            producer.send_async(b"\x00", answered)
            probe.sent = True
        except Exception as e:  # queue full, closed, ...
            probe.error = f"probe publish refused: {e!r}"
        return probe

    def _judge(self, probe: _Probe) -> None:
        import pulsar

        timeout = self.cfg.probe_timeout_s
        why = ""
        late = False  # failed by time alone: the probe, or a data publish, is late
        if probe.error:
            why = probe.error
        elif not probe.sent:
            with self._lock:
                since, err = self._missing_since, self._create_error
            if not err and self._state == self.UP:
                return  # the first producer is on its way: no verdict until it fails
            missing = self._clock() - since if since is not None else 0.0
            why = f"no probe producer on {self.topic} for {missing:.1f} s" + (
                f" ({err})" if err else "")
        elif probe.answered is None or probe.answered > probe.deadline:
            why, late = f"probe publish not acknowledged within {timeout:g} s", True
        elif probe.result != pulsar.Result.Ok:
            why = f"probe publish failed: {probe.result}"
            late = probe.result == pulsar.Result.Timeout  # its send timeout: late, no more
        if self._inflight_age is not None:
            # judged on every probe, also a failed one: the reason names every cause seen
            age = float(self._inflight_age())
            if age > self.cfg.publish_timeout_s:
                stuck = f"oldest unacknowledged data publish is {age:.1f} s old"
                late = late or not why
                why = f"{why}; {stuck}" if why else stuck
        if why and late and self._acked_since(
                probe.sent_at if probe.sent_at > -math.inf else probe.deadline - timeout):
            # the broker acknowledged data after this probe left: a full link, not a dead
            # broker (module docstring)
            self.congested += 1
            if self._on_congested is not None:
                self._on_congested()
            if self.congested == 1 or self.congested % 100 == 0:
                log.info("MQ probe late (%s) while data publishes are acknowledged: the "
                         "controller's link is congested, the broker is up (%d such "
                         "probes)", why, self.congested)
            return
        self.probes += 1
        self.failures += bool(why)
        self._count(not why, why)

    def _acked_since(self, t: float) -> bool:
        """Whether a data publish was acknowledged at or after clock time ``t``."""
        if self._last_ack is None:
            return False
        last = self._last_ack()
        return last is not None and last >= t

    def _count(self, ok: bool, why: str) -> None:
        change = None
        with self._lock:
            if ok:
                self._oks, self._fails = self._oks + 1, 0
                if self._state == self.DOWN and self._oks >= self.cfg.recover_after:
                    change = (self.UP, f"{self._oks} consecutive probes acknowledged")
            else:
                self._fails, self._oks = self._fails + 1, 0
                if self._state == self.UP and self._fails >= self.cfg.fail_after:
                    change = (self.DOWN, f"{self._fails} consecutive probes failed: {why}")
            if change is not None:
                self._state, self._last_change = change[0], self._clock()
                self.events.append((self._last_change, *change))
        if change is not None:
            log.warning("MQ channel %s: %s", *change)
            try:
                self._on_change(*change)
            except Exception:  # the probe thread must go on
                log.exception("MQ health listener failed")

    # ------------------------------------------------------------------ the producer
    def _ensure_producer(self, now: float) -> Any:
        """The producer to probe with, or None while a helper thread creates the first one
        (creation blocks up to the client's operation timeout when the broker is away; no
        lock is held meanwhile). While down, a current producer that is disconnected is
        kept (it reconnects on the client's back-off) and a fresh one is created beside it
        (it connects as soon as the broker serves again): whichever is connected first is
        probed with, the other closed."""
        with self._lock:
            producer, spare = self._producer, self._spare
            create = False
            if producer is None:
                if self._missing_since is None:
                    self._missing_since = now
                create = self._may_create(now)
        if producer is None:
            if create:
                self._start_create()
            return None
        if spare is None and self._state == self.UP:
            return producer
        is_up = connected(producer)
        drop = None
        with self._lock:
            if spare is not None and self._spare is spare:
                self._spare = None
                if is_up:
                    drop = spare
                else:  # the fresh one serves: the old one goes
                    drop, self._producer = producer, spare
                    producer = spare
            elif not is_up and self._state == self.DOWN:
                create = self._may_create(now)
        if drop is not None:
            _bounded(drop.close, 0.5)
        if create:
            self._start_create()
        return producer

    def _may_create(self, now: float) -> bool:
        """Whether to start one more creation (under the lock): none in flight, or the
        latest began over ``_RECREATE_S`` ago and fewer than ``_MAX_CREATING`` are in flight
        (a creation that began while the broker was away waits for its lookup back-off once
        the broker is back: a later one connects sooner)."""
        if self._creating and (self._creating >= _MAX_CREATING
                               or now - self._create_started < _RECREATE_S):
            return False
        self._creating += 1
        self._create_started = now
        return True

    def _start_create(self) -> None:
        threading.Thread(target=self._create, name="mq-health-create", daemon=True).start()

    def _create(self) -> None:
        producer, err = None, ""
        t0 = self._clock()
        try:
            producer = self.client.create_producer(
                self.topic, send_timeout_millis=max(1, round(self.cfg.probe_timeout_s * 1000)),
                block_if_queue_full=False, batching_enabled=False, max_pending_messages=1000)
        except Exception as e:
            err = f"creating it failed: {e!r}"
        log.debug("MQ health: probe producer on %s: %s after %.2f s", self.topic,
                  err or "created", self._clock() - t0)
        unused = None
        with self._lock:
            self._creating -= 1
            self._create_error = err
            if producer is not None:
                if self._stop.is_set() or self._spare is not None:
                    unused = producer
                elif self._producer is None:
                    self._producer, self._missing_since = producer, None
                else:
                    self._spare = producer
        if unused is not None:
            _bounded(unused.close, 0.5)
        self._wake.set()


def connected(producer: Any) -> bool:
    """Whether a Pulsar producer is connected to its broker now (False if it cannot say)."""
    try:
        return bool(producer.is_connected())
    except Exception:
        return False


def close_in_background(producer: Any) -> None:
    """Close a producer on a daemon thread (a close can wait on a broker that is away)."""
    def run() -> None:
        try:
            producer.close()
        except Exception as e:  # it is being dropped: nothing depends on a clean close
            log.debug("closing a replaced producer failed: %s", e)

    threading.Thread(target=run, name="producer-close", daemon=True).start()


def _quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:
        log.exception("MQ health: %r failed", fn)


def _bounded(fn: Callable[[], Any], limit_s: float) -> None:
    """Call ``fn`` on a daemon thread and wait for it at most ``limit_s`` (a Pulsar close
    should return at once, but must never hold up a caller)."""
    def run() -> None:
        try:
            fn()
        except Exception as e:
            log.debug("MQ health: %r failed: %s", fn, e)

    t = threading.Thread(target=run, name="mq-health-close", daemon=True)
    t.start()
    t.join(limit_s)
