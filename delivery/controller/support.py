"""The controller's configuration, counters and small parts: :class:`ControllerConfig`,
:class:`ControllerStats`, the C_p limiter (:class:`InflightLimiter`), topic names, and the
dispatch lock's decorator (:mod:`delivery.controller`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from concurrent import futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from security.tls import (
    Security,
)

from ..fairness import TenantShapingConfig
from ..health import (
    ConfigError,
    FailoverConfig,
    security_setting,
)

if TYPE_CHECKING:
    from . import Controller

__all__ = ["RPC", "ControllerConfig", "ControllerStats", "InflightLimiter", "TopicRefused",
           "id_ranges", "topic_channel", "topic_name"]

log = logging.getLogger(__package__)  # the controller's one logger, "delivery.controller"


class TopicRefused(RuntimeError):
    """A topic whose producer could not be created moments ago (not asked again yet)."""


@dataclasses.dataclass(eq=False)
class _Creation:
    """A data producer being created on a helper thread (:meth:`Controller._producer`)."""

    future: futures.Future
    started: float                   # monotonic
    failed_at: float | None = None   # monotonic, when the creation failed


RPC = 0


def topic_name(prefix: str, t: int) -> str:
    """The Pulsar topic of MQ channel ``t`` (1..K)."""
    return f"{prefix}-t{t}"


def topic_channel(prefix: str, topic: str) -> int | None:
    """The MQ channel of a topic name of ``prefix`` (the inverse of :func:`topic_name`)."""
    m = re.fullmatch(re.escape(prefix) + r"-t(\d+)", topic)
    return int(m.group(1)) if m else None


@dataclass
class ControllerConfig:
    """The controller's settings. ``max_inflight_sends``: C_p, the most units of concurrent
    sends (SMART Eq. 1's third constraint: ``|D(m)|`` per RPC push, one per MQ publish) the
    controller has in flight; 0 = no limit (see the module docstring). ``failover`` and
    ``shaping`` take a mapping or their
    config class (validated: :class:`ConfigError` / ``ShapingError`` name the key).
    ``outbox``: accepted messages are durable before :meth:`Controller.send_many` returns;
    ``outbox_fsync``: SQLite ``synchronous=FULL`` (survives a power loss, not only a crash of
    the process). ``security``: a :class:`~security.tls.Security` or its mapping
    ``{insecure, pki_dir}`` (the secure default when left out). ``pulsar_admin_url``: the
    broker's admin REST API (``https://``); when set (and secure) the controller binds each
    node's subscription to that node's agent (:class:`security.pulsar.NodeSubscriptionGrants`,
    as the tenant admin ``controller``) before the node first subscribes; when null an
    operator binds them (``python -m security.pulsar grant --nodes ...``)."""

    pulsar_url: str
    store_url: str
    topic_prefix: str = "persistent://public/default/smart"
    reply_host: str = "127.0.0.1"
    reply_port: int = 0
    push_timeout_s: float = 2.0
    push_retries: int = 2
    retry_backoff_s: float = 0.05
    reprogram_period_s: float = 0.5
    collect_period_s: float = 1.0
    subscribe_timeout_s: float = 15.0
    producer_wait_s: float = 2.0   # the sending path's wait for a topic's producer (_producer)
    payload_scale: float = 1.0
    outbox: bool = True
    outbox_fsync: bool = False
    failover: FailoverConfig = field(default_factory=FailoverConfig)
    shaping: TenantShapingConfig = field(default_factory=TenantShapingConfig)
    security: Security = field(default_factory=Security)
    pulsar_admin_url: str | None = None
    max_inflight_sends: int = 0

    def __post_init__(self) -> None:
        k = self.max_inflight_sends
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError(f"delivery config: max_inflight_sends: expected an integer >= 0 "
                              f"(0 = no limit), got {k!r}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "str" and not isinstance(v, str):
                raise ConfigError(f"delivery config: {f.name}: expected a string, got {v!r}")
            if f.type == "bool" and not isinstance(v, bool):
                raise ConfigError(f"delivery config: {f.name}: expected true or false, got {v!r}")
            if f.type in ("int", "float"):
                if isinstance(v, bool) or not isinstance(v, int | float):
                    raise ConfigError(f"delivery config: {f.name}: expected a number, got {v!r}")
                if v < 0 or (f.name.endswith("_s") and f.name != "retry_backoff_s" and v <= 0):
                    raise ConfigError(f"delivery config: {f.name}: must be positive, got {v!r}")
        url = self.pulsar_admin_url
        if url is not None and not (isinstance(url, str) and url.startswith(("http://",
                                                                               "https://"))):
            raise ConfigError(f"delivery config: pulsar_admin_url: expected an http(s):// URL "
                              f"or null, got {url!r}")
        if not 0 < self.payload_scale <= 1:
            raise ConfigError(f"delivery config: payload_scale: must be in (0, 1], got "
                              f"{self.payload_scale!r}")
        self.failover = FailoverConfig.from_mapping(self.failover)
        self.shaping = TenantShapingConfig.from_mapping(self.shaping)
        self.security = security_setting(self.security)

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> ControllerConfig:
        """Build from a mapping (a Hydra/YAML ``delivery:`` block); an unknown or missing key
        is a :class:`ConfigError` naming it."""
        if not isinstance(m, Mapping):
            raise ConfigError(f"delivery config: expected a mapping, got {type(m).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(m) - names)
        if unknown:
            raise ConfigError(f"delivery config: unknown key(s) {unknown}; known: "
                              f"{sorted(names)}")
        missing = [k for k in ("pulsar_url", "store_url") if k not in m]
        if missing:
            raise ConfigError(f"delivery config: missing key(s) {missing}")
        return cls(**dict(m))


@dataclass
class ControllerStats:
    """What the controller sent and heard back (Section VII-B metrics 1-2)."""

    rpc_bytes: int = 0
    rpc_messages: int = 0          # one per destination node
    rpc_pushes: int = 0            # Push calls (batches)
    mq_bytes: int = 0
    mq_messages: int = 0           # one per publish
    fences: int = 0
    subscribe_infos: int = 0       # both ways
    unsubscribe_infos: int = 0     # of which unsubscribing
    subscribe_failures: int = 0
    push_failures: int = 0
    reprogrammed: int = 0          # messages re-sent to nodes after failures or errors
    republished: int = 0           # publishes that failed and were sent again
    producers_renewed: int = 0     # data producers replaced at a failback (not reconnected)
    channel_changes: int = 0
    outbox_stored: int = 0         # messages made durable before they were acknowledged
    outbox_confirmed: int = 0      # destination rows confirmed by packed replies
    outbox_redelivered: int = 0    # (message, node) pairs re-delivered after a restart
    outbox_corrupt: int = 0        # stored rows refused at recovery (kept in the store)
    failovers: int = 0             # MQ outages reacted to
    probes_congested: int = 0      # late health probes excused: data acknowledged meanwhile
    probes_waited: int = 0         # health probes judged after the RPC pushes ahead of them
    failbacks: int = 0             # recoveries (types back on their topics)
    rerouted: int = 0              # MQ-type messages sent over RPC during an outage
    held: int = 0                  # MQ-type messages that waited for the broker
    relayed: int = 0               # messages relayed on a topic to a node whose RPC is down
    relay_bytes: int = 0
    mq_rescued: int = 0            # MQ messages re-sent over RPC to a node that missed them
    deferred_channel_changes: int = 0
    switch_held: int = 0           # messages held while a switch moved their type
    refused_calls: int = 0         # calls and collected replies refused (mutual TLS roles)
    inflight_waits: int = 0        # sends that waited for C_p units (max_inflight_sends)
    inflight_wait_s: float = 0.0   # seconds sending threads waited for them, in all
    inflight_peak: int = 0         # the most units of concurrent sends held at once
    outcomes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    errors: list[tuple[int, str, int, str]] = field(default_factory=list)
    health_events: list[tuple[int, str, str]] = field(default_factory=list)  # (ns, event, why)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("errors", "health_events")}
        d["outcomes"] = dict(self.outcomes)
        d["errors"] = len(self.errors)
        d["health_events"] = len(self.health_events)
        return d


class InflightLimiter:
    """A counting limit on the controller's concurrent sends: SMART Eq. 1's third constraint
    (``sum_m |D(m)|`` over RPC types plus one per MQ type <= C_p) made physical.

    :meth:`acquire` takes ``min(units, limit)`` units, blocking the calling thread while
    they are not free; :meth:`release` gives them back. ``limit = 0`` blocks nothing (the
    units are still counted, for ``inflight_peak``). Waits, seconds waited and the peak go
    to ``stats``. :meth:`close` wakes every waiter and makes later calls return at once
    with no unit (a closing controller must not hang on a send)."""

    def __init__(self, limit: int, stats: ControllerStats) -> None:
        self.limit, self.stats = int(limit), stats
        self.held = 0
        self._cv = threading.Condition()
        self._closed = False

    def acquire(self, units: int) -> int:
        """Take the units of one send (``min(units, limit)``); returns how many were taken
        (0 once closed)."""
        u = max(int(units), 0)
        if self.limit:
            u = min(u, self.limit)
        with self._cv:
            if self._closed:
                return 0
            if self.limit and self.held + u > self.limit:
                t0 = time.monotonic()
                self.stats.inflight_waits += 1
                self._cv.wait_for(lambda: self._closed or self.held + u <= self.limit)
                self.stats.inflight_wait_s += time.monotonic() - t0
                if self._closed:
                    return 0
            self.held += u
            self.stats.inflight_peak = max(self.stats.inflight_peak, self.held)
            return u

    def release(self, units: int) -> None:
        if units <= 0:
            return
        with self._cv:
            self.held -= units
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


def id_ranges(ids: Iterable[int]) -> str:
    """Type ids for a log line, runs of three or more as ranges: ``[0-395, 397]``."""
    xs = sorted(set(ids))
    parts: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts += [f"{xs[i]}-{xs[j]}"] if j - i >= 2 else [str(x) for x in xs[i:j + 1]]
        i = j + 1
    return "[" + ", ".join(parts) + "]"


def _dispatching(method: Callable) -> Callable:
    """Run ``method`` under the controller's dispatch lock. ``send`` reads a type's channel
    and then publishes: without the lock a sender thread could read the old topic, then a
    concurrent ``set_channels`` switch, unsubscribe and fence it, and the message would land
    on the old topic behind the fence, after the agents left it (lost). The lock also keeps
    one producer per topic and ``flush``'s re-publishes ahead of a switch's fence."""
    @functools.wraps(method)
    def locked(self: Controller, *args: Any, **kw: Any) -> Any:
        with self._dispatch:
            return method(self, *args, **kw)
    return locked


class _SwitchPlan(NamedTuple):
    """What one switch changes (:meth:`Controller._switch_plan`): the types whose channel
    changes, every type's channel after it, each node's topics after it, the subscriptions to
    make and to end (node, topic), and its timestamp."""

    changed: dict[int, int]
    channel: dict[int, int]
    wanted: dict[int, set[int]]
    subs: list[tuple[int, int]]
    unsubs: list[tuple[int, int]]
    ts: int
    hosts: dict[int, tuple[int, ...]]  # the changed types' destinations
