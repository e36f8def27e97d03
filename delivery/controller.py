"""The SMART controller's delivery side (Fig. 1, steps P-1 to P-3 and the replies of S-4).

It receives configuration requests as Table I messages, hands them to the parser of the
controller adapter (destination-hash batching, per-interval rate estimation), and at every
interval asks a :class:`~delivery.policies.ChannelPolicy` for each type's channel (the learned
policy through the adapter in remote or cached mode, or a baseline). A change of channels is
carried out losslessly:

1. the topic mapping and the new subscriptions go to the metadata store (P-2), in two
   transactions (the mapping, then the subscriptions);
2. agents that must subscribe get a SubscribeInfo over RPC, and the controller waits for their
   acknowledgement before it publishes on the topic (an agent that cannot be reached gets its
   durable subscription created by the controller instead, so it finds the backlog when it
   comes back and reads the store, and its SubscribeInfos wait in order in a per-node queue
   that the reprogramming thread sends once it answers: an agent whose RPC endpoint was
   unreachable for a while without a restart then subscribes too; a node known to be
   unreachable is not waited for at all, so it does not stall the switch). SubscribeInfos
   go on a connection of their own to each agent (:meth:`Controller._stub`), so on a full
   link they do not wait behind the pushes queued for that node;
3. the new channels take effect;
4. agents that no longer need a topic get an unsubscribing SubscribeInfo and the controller
   publishes a fence on that topic: the agent drains the topic up to the fence, then leaves
   (an unsubscribing SubscribeInfo sent late from the queue gets a fence of its own).

Only the types a switch moves wait for it: from the call on, their messages are held (in
arrival order; they are already durable in the outbox) and dispatched on their new channels
once step 3 is done, while every other type's messages keep leaving during steps 1 and 2,
the store writes and the acknowledgements; step 4 holds no message (no type is left on the
pairs it ends). Switches run one at a time, in order: the control plane queues its interval
switches and placements on the controller's switch thread (``set_channels(..., wait=False)``),
so its sending path never waits for a SubscribeInfo.

Messages then go out by their type's channel: RPC pushes (one ``Push`` per destination node
and flush, batched, concurrent; a flush holds the dispatch lock only while it takes the
queued messages, so messages are accepted and published while its pushes are answered, and
flushes push in the order they took them) or one publish on the type's topic (one producer
per topic, ``block_if_queue_full`` so nothing is dropped). A push that fails is retried
(``push_retries``, with backoff); then the node is marked unreachable and its RPC messages
wait, in timestamp order, in a per-node queue that a background thread re-sends
("reprogramming") until the node answers again. Packed replies are collected periodically and
also accepted when agents send them on their own (``ControllerReplies``); a ``MALFORMED``
result makes the controller re-send the resource's latest message to that node over RPC. An
``OUT_OF_ORDER`` result is recorded (``stats.errors``) and nothing is re-sent: the node
already holds a newer state of the resource, and a re-sent newest message could overtake the
MQ messages still in flight to it, which would then be dropped in turn.

**Durable outbox** (``outbox``, on by default). :meth:`Controller.send_many` writes every
accepted message to the store's outbox (one transaction, with a CRC-32 and one row per
destination) before it returns; a destination row goes when that node's packed reply
(Section VI-C) reports the message applied, a duplicate or superseded. :meth:`Controller.start`
recovers from the store: its timestamps start above every stored one, the channels, hosts and
subscriptions come back, the SubscribeInfos of the last switch are sent again, and every
unconfirmed message is re-delivered over RPC to the nodes that have not confirmed it (agents
drop what they already hold, Section VI-B). A row whose CRC or encoding is bad is logged with
its timestamp, counted (``stats.outbox_corrupt``) and kept.

**Channel failover** (``failover``, Stemflow Section IV's fast failure reaction). A probe
thread (:class:`delivery.health.MqHealth`) declares the MQ channel down within
``FailoverConfig.detection_bound_s``. The controller then moves the MQ types to RPC as far as
the controller's capacities C_b and C_p allow (:func:`delivery.health.plan_failover`, Eq. 1's
controller constraints, oldest waiting type first), re-planning every ``replan_period_s``;
unacknowledged publishes of a moved type go over RPC in timestamp order, the other types'
messages wait, and channel changes are deferred. When the probe succeeds again it pushes what
RPC holds, publishes what waited (oldest first), applies the deferred channels and puts the
types back on their topics. In the other direction, a node whose RPC endpoint is unreachable
for ``relay_after_s`` gets its queued messages relayed on the topic it is subscribed to with
the fewest subscribers (each other subscriber receives one redundant copy, ``not_for_me``),
and MQ messages a node that still answers RPC has not confirmed for ``confirm_timeout_s``,
while no MQ result came from it, are re-sent over RPC. Every decision is a log line, a
counter in :class:`ControllerStats` and an event in :meth:`Controller.health` (passed to the
listeners of :meth:`Controller.on_health`: the control plane forwards it to the adapter's
session).

**Concurrent sends** (``max_inflight_sends``, C_p; 0 = no limit). SMART Eq. 1's third
constraint bounds the controller's concurrent sends, ``sum_m |D(m)|`` over the RPC types plus
one per MQ type (:mod:`envs.dsmd.cost`). The controller enforces it as a counting limit
(:class:`InflightLimiter`): an RPC push of a batch of ``k`` messages to a node holds
``min(k, limit)`` units from before its ``Push`` call until the call completes, and every
MQ publish (messages, fences, relayed copies) holds one unit from before ``send_async``
until the broker's acknowledgement (or a failure) comes back. A send that finds the limit
full blocks its sending thread until units return: that wait is the controller's queueing,
counted in :class:`ControllerStats` (``inflight_waits``, ``inflight_wait_s``,
``inflight_peak``). A publish the failover takes over by RPC gives its unit back, and so do
the publishes in flight when the MQ channel is declared down (the broker takes nothing
then); closing the controller releases every waiter.

**Per-tenant fairness** (``shaping``, off by default): Sincon's shaper (Section III) per
tenant class on the sending path (:class:`delivery.fairness.TenantShaper`), after the outbox.

**Security** (``ControllerConfig.security``, :class:`security.tls.Security`; secure by
default). The controller's identity is ``controller``: its pushes, SubscribeInfos and
collections reach the agents over mutual TLS, its Pulsar client authenticates as
``controller`` (:func:`security.pulsar.client_args`), and its ``ControllerReplies`` server
accepts only certificates of role ``agent`` whose node is the packed reply's
(:class:`delivery.rpc.RoleGuard` with :func:`reply_problem`: ``agent-5`` reporting for node
3 is refused with ``PERMISSION_DENIED`` and nothing of that reply is applied). A collected
reply for another node than the one asked is refused the same way. Every refusal is one
warning line and counts in ``ControllerStats.refused_calls``. ``insecure`` keeps plain
channels (and warns at every start).

The controller counts what it sends (bytes and messages per channel, SubscribeInfo and
fences), which the testbed reports beside the process CPU time.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc

from envs.dsmd.message import Message
from security.pki import agent_principal
from security.pulsar import NodeSubscriptionGrants, client_args, subscription_name
from security.tls import (
    Security,
    SecurityError,
    channel_credentials,
    pinned_options,
    server_credentials,
)

from .fairness import TenantShaper, TenantShapingConfig
from .health import (
    ConfigError,
    FailoverConfig,
    MqHealth,
    RateWindow,
    RpcBacklog,
    close_in_background,
    connected,
    plan_failover,
    security_setting,
)
from .rpc import RoleGuard, pb, pb_grpc
from .store import MetadataStore, SubscriptionChange
from .wire import (
    Payloads,
    WireError,
    check_config,
    encode,
    envelope,
    fence_envelope,
    open_envelope,
    resource_key,
)

__all__ = ["ConfigError", "Controller", "ControllerConfig", "ControllerStats", "InflightLimiter",
           "reply_problem", "topic_name"]

log = logging.getLogger(__name__)

PRODUCER_RETRY_S = 5.0   # a topic that refused a producer is not asked again sooner


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


class Controller(pb_grpc.ControllerRepliesServicer):
    def __init__(self, cfg: ControllerConfig, agents: dict[int, str], *,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.cfg = cfg
        self.agents = dict(agents)  # node id -> "host:port"
        self.store = MetadataStore(cfg.store_url,
                                   synchronous="FULL" if cfg.outbox_fsync else "NORMAL")
        self.payloads = Payloads(cfg.payload_scale)
        self.stats = ControllerStats()
        self.channel: dict[int, int] = {}
        self.hosts: dict[int, tuple[int, ...]] = {}
        self.node_topics: dict[int, set[int]] = defaultdict(set)
        self._clock, self._last_ts = clock, 0
        self._lock = threading.RLock()
        self._dispatch = threading.RLock()  # see _dispatching
        # channel switches (see set_channels): one at a time, queued on one thread; the
        # types each pending switch moves (type -> switches) and their held messages
        self._switch_lock = threading.RLock()
        self._switcher = futures.ThreadPoolExecutor(1, thread_name_prefix="controller-switch")
        self._switches: list[futures.Future] = []
        # switches asked for and not yet taken by the switch thread
        self._queued: list[tuple[dict[int, int], dict[int, tuple[int, ...]], list[int],
                                 futures.Future]] = []
        self._gated: dict[int, int] = {}
        self._gated_msgs: list[tuple[int, Any]] = []
        self._last_switch: dict = {}
        self._asked: dict[int, int] = {}  # type -> channel of the last switch asked
        self._outbox: dict[int, list] = defaultdict(list)     # to push at the next flush
        self._pending: dict[int, list] = defaultdict(list)    # unreachable nodes' messages
        # and the unreachable nodes' (channel, SubscribeInfo) pairs
        self._pending_infos: dict[int, list] = defaultdict(list)
        self._reprogramming: set[int] = set()                  # nodes whose queue is in flight
        # flushes push in the order they took the outbox (see _flush_locked): the next turn
        # to hand out and the turn whose pushes go now
        self._push_turns = itertools.count()
        self._push_turn = 0
        self._push_turn_cv = threading.Condition(threading.Lock())
        self._latest: dict[tuple, Any] = {}                   # resource -> newest message
        self._acked: dict[int, int] = defaultdict(int)        # node -> last result_seq
        self._channels: dict[int, grpc.Channel] = {}
        self._stubs: dict[int, Any] = {}
        self._control_channels: dict[int, grpc.Channel] = {}  # SubscribeInfos (see _stub)
        self._control_stubs: dict[int, Any] = {}
        self._producers: dict[int, Any] = {}
        self._creating: dict[int, _Creation] = {}   # topic -> its producer's creation
        self._producer_refused: dict[int, tuple[float, str]] = {}  # topic -> (when, why)
        self._republish: list[tuple[int, bytes]] = []          # failed publishes
        # publish id -> (topic, envelope, when): publishes not yet acknowledged by the broker
        self._inflight: dict[int, tuple[int, bytes, float]] = {}
        self._last_ack: float | None = None  # monotonic time of the latest acknowledged publish
        self._inflight_units: dict[int, int] = {}  # publish id -> C_p units it holds
        self._limiter = InflightLimiter(cfg.max_inflight_sends, self.stats)
        self._rpc_backlog = RpcBacklog()  # the pushes in flight, for the health probe
        self._publish_ids = itertools.count()
        self._published_cv = threading.Condition(self._lock)
        # channel failover (see the module docstring)
        fo = cfg.failover
        self._rates = RateWindow(fo.rate_window_s)
        self._capacity: tuple[float | None, float | None] = (fo.controller_bw_bps,
                                                             fo.controller_cpu)
        self._health: MqHealth | None = None
        self._mq_down = False          # set by the probe thread
        self._failed_over = False      # the outage has been reacted to
        self._failover_types: set[int] = set()
        self._waiting_types: set[int] = set()  # MQ types the outage plan leaves waiting
        self._held: list[tuple[int, Any]] = []                # (type, message) waiting
        self._deferred: tuple[dict[int, int], dict[int, tuple[int, ...]]] | None = None
        self._health_wake = threading.Event()
        self._health_listeners: list[Callable[[dict], None]] = []
        self._down_since_ns = 0
        self._unreachable_since: dict[int, float] = {}        # node -> monotonic time
        self._relayed: dict[int, set[int]] = defaultdict(set)  # node -> timestamps relayed
        # node -> timestamp -> (publish time, message): MQ messages it has not confirmed
        self._mq_unconfirmed: dict[int, dict[int, tuple[float, Any]]] = defaultdict(dict)
        self._last_mq_result: dict[int, float] = {}
        self._shaper: TenantShaper | None = None
        self._in_send = threading.local()
        self._notifier = futures.ThreadPoolExecutor(1, thread_name_prefix="controller-health")
        self._client = None
        self._server: grpc.Server | None = None
        self._channel_creds: Any = None  # the push channels' (identity ``controller``)
        self._grants = (NodeSubscriptionGrants(cfg.pulsar_admin_url, cfg.security,
                                               principal="controller")
                        if cfg.pulsar_admin_url and not cfg.security.insecure else None)
        if self._grants is None and not cfg.security.insecure:
            log.warning("controller: no pulsar_admin_url: nodes' subscriptions are not bound to "
                        "their agents by this controller (bind them beforehand: python -m "
                        "security.pulsar grant --nodes ...), or agent-3 may use agent-30's")
        self.guard: RoleGuard | None = None  # the reply server's role check (secure mode)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.reply_port = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Controller:
        import pulsar

        sec = self.cfg.security
        insecure = sec.warn_if_insecure("controller")
        if not insecure and not self.cfg.pulsar_url.startswith("pulsar+ssl://"):
            log.warning("controller: security is on but pulsar_url %r is not pulsar+ssl://: "
                        "the MQ channel is neither encrypted nor authenticated",
                        self.cfg.pulsar_url)
        self._client = pulsar.Client(self.cfg.pulsar_url, operation_timeout_seconds=15,
                                     logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error),
                                     **client_args(sec, "controller"))
        self.recover()
        with self._dispatch:  # the topics in use get their producers at once, side by side
            self._prepare_producers(self.channel.values())
        address = f"{self.cfg.reply_host}:{self.cfg.reply_port}"
        if insecure:
            self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            pb_grpc.add_ControllerRepliesServicer_to_server(self, self._server)
            self.reply_port = self._server.add_insecure_port(address)
        else:
            self.guard = RoleGuard("controller", {"agent"}, checks={"Report": reply_problem},
                                   on_refuse=self.count_refused)
            self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                                       interceptors=[self.guard])
            pb_grpc.add_ControllerRepliesServicer_to_server(self, self._server)
            self.reply_port = self._server.add_secure_port(
                address, server_credentials(sec.identity("controller")))
        self._server.start()
        if self.cfg.shaping.enabled and (self.cfg.shaping.global_throughput_Bps is not None
                                         or self._capacity[0] is not None):
            self._start_shaper()
        loops = [(self._reprogram_loop, "reprogram"), (self._collect_loop, "collect")]
        if self.cfg.failover.enabled:
            self._health = MqHealth(self._client, f"{self.cfg.topic_prefix}-health",
                                    self.cfg.failover, self._on_health_change,
                                    inflight_age=self._inflight_age,
                                    last_ack=lambda: self._last_ack,
                                    on_congested=self._probe_congested,
                                    rpc=self._rpc_backlog,
                                    on_waited=self._probe_waited).start()
            loops.append((self._failover_loop, "failover"))
        for target, name in loops:
            t = threading.Thread(target=target, name=f"controller-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _start_shaper(self) -> None:
        """The tenant shaper over G = ``shaping.global_throughput_Bps``, else C_b / 8."""
        if self._shaper is None:
            bw = self._capacity[0]
            self._shaper = TenantShaper(self.cfg.shaping, self._release,
                                        global_throughput_Bps=None if bw is None else bw / 8
                                        ).start()

    def recover(self) -> dict[str, int]:
        """Rebuild the state a crash lost from the store (see the module docstring); a no-op
        on an empty store. Returns what was recovered."""
        st = self.store
        with self._lock:
            self._last_ts = max(self._last_ts, st.max_timestamp())
        pre = self.cfg.topic_prefix
        for t, (c, topic, hosts) in st.mapping_rows().items():
            if c != RPC and topic != topic_name(pre, c):
                raise ConfigError(f"store {self.cfg.store_url}: type {t} is on topic "
                                  f"{topic!r}, but topic_prefix {pre!r} names channel {c} "
                                  f"{topic_name(pre, c)!r}: the store of another controller?")
            self.channel[t], self.hosts[t] = c, hosts
        rows = st.subscription_rows()
        last_since = max((s.since_ns for _, s in rows), default=0)
        last_until = max((s.until_ns or 0 for _, s in rows), default=0)
        infos = 0
        reachable = True  # a broker away at start costs one operation timeout, not one each
        for n, sub in rows:
            c = topic_channel(pre, sub.topic)
            if c is None:
                raise ConfigError(f"store {self.cfg.store_url}: node {n} subscription topic "
                                  f"{sub.topic!r} is not a topic of topic_prefix {pre!r}")
            # the SubscribeInfos of the last switch may not have gone out before the crash
            # (those of unreachable nodes waited in memory): every active subscription is
            # sent again (idempotent at the agent), the last unsubscriptions too (with a
            # fence each); the durable subscriptions of the last switch are made sure of
            if sub.active:
                self.node_topics[n].add(c)
            elif sub.until_ns != last_until:
                continue
            if n not in self.agents:
                continue
            self._pending_infos[n].append((c, pb.SubscribeInfo(
                url=self.cfg.pulsar_url, topic=sub.topic, subscription=sub.subscription,
                timestamp_ns=sub.since_ns if sub.active else int(sub.until_ns or 0),
                operation=sub.active)))
            infos += 1
            if sub.active and sub.since_ns == last_since and reachable:
                reachable = self._ensure_subscription(sub.topic, sub.subscription)
                if not reachable:
                    log.warning("recovery: the broker did not answer; the durable "
                                "subscriptions of the last switch are left to the agents")
        if self._grants is not None:
            # every node this controller serves, before any subscribes: until its binding
            # exists, another agent's role could take its subscription name (Prefix mode);
            # once per node and broker (nothing for nodes bound before)
            try:
                self._grants.ensure(set(self.agents) | {n for n, ts in self.node_topics.items()
                                                        if ts})
            except SecurityError as e:
                log.warning("binding the nodes' subscriptions to their agents: %s (bound "
                            "again when they next subscribe)", e)
        redelivered = corrupt = 0
        if self.cfg.outbox:
            for row in st.outbox_unconfirmed():
                try:
                    if not row.intact:
                        raise WireError(f"CRC-32 {row.crc32} does not match the body")
                    cm = pb.ConfigMessage.FromString(row.body)
                    check_config(cm)
                    if cm.timestamp_ns != row.ts_ns:
                        raise WireError(f"body timestamp {cm.timestamp_ns} != row {row.ts_ns}")
                except Exception as e:  # DecodeError, WireError
                    corrupt += 1
                    log.error("outbox row ts_ns=%d (type %d) refused: %s; kept in the store, "
                              "not delivered", row.ts_ns, row.type_id, e)
                    continue
                cm.reprogram = True
                self._latest[resource_key(cm)] = cm
                self.hosts.setdefault(row.type_id, tuple(cm.hosts))
                for n in row.nodes:
                    if n in self.agents:
                        self._pending[n].append(cm)
                        redelivered += 1
                    else:
                        log.warning("outbox row ts_ns=%d: node %d is not one of this "
                                    "controller's agents; kept", row.ts_ns, n)
        self.stats.outbox_redelivered += redelivered
        self.stats.outbox_corrupt += corrupt
        out = {"types": len(self.channel), "subscribe_infos": infos,
               "redelivered": redelivered, "corrupt": corrupt}
        if any(out.values()):
            log.warning("recovered from %s: %s", self.cfg.store_url, out)
        return out

    @property
    def reply_address(self) -> str:
        return f"{self.cfg.reply_host}:{self.reply_port}"

    def close(self) -> None:
        try:  # the queued switches first (each bounded by the SubscribeInfo timeout)
            self.wait_switches(timeout_s=2 * self.cfg.subscribe_timeout_s + 5)
        except Exception as e:
            log.warning("closing: a queued switch failed (%s)", e)
        self._stop.set()
        self._limiter.close()  # a send waiting for C_p units returns (nothing hangs here)
        with self._lock:
            self._published_cv.notify_all()
            # calls in flight fail now: a push or Collect retried against an agent's old
            # address must not reach whatever listens there next
            channels = [*self._channels.values(), *self._control_channels.values()]
        for ch in channels:
            ch.close()
        self._health_wake.set()
        self._switcher.shutdown(wait=False, cancel_futures=True)
        if self._shaper is not None:
            self._shaper.close()
        if self._health is not None:
            self._health.close()
        for t in self._threads:
            t.join(5)
        self._notifier.shutdown(wait=False, cancel_futures=True)
        down = self._mq_down

        def close_producers() -> None:
            made = [c.future.result() for c in list(self._creating.values())
                    if c.future.done() and c.future.exception() is None]
            for p in [*list(self._producers.values()), *made]:
                try:
                    if not down:
                        p.flush()
                    p.close()
                except Exception:
                    pass
            if self._client is not None:
                self._client.close()

        # with the broker gone, flush and close wait for the send timeout: bounded here
        closer = threading.Thread(target=close_producers, name="controller-close", daemon=True)
        closer.start()
        closer.join(10)
        if self._server is not None:
            self._server.stop(0.5).wait()
        if self._grants is not None:
            self._grants.close()
        self.store.close()

    def __enter__(self) -> Controller:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def timestamp(self) -> int:
        """Generation timestamps: wall-clock ns, unique and increasing."""
        with self._lock:
            ts = max(self._clock(), self._last_ts + 1)
            self._last_ts = ts
            return ts

    def _stub(self, node: int, control: bool = False) -> Any:
        """Node ``node``'s stub: on the data connection (pushes, collections) or, with
        ``control``, on a connection of its own for the SubscribeInfos, so that one never
        waits behind the pushes queued on the data connection (a full link)."""
        stubs = self._control_stubs if control else self._stubs
        s = stubs.get(node)
        if s is None:
            with self._lock:  # the collect, reprogram and sending threads all get stubs
                s = stubs.get(node)
                if s is None:
                    if self._stop.is_set():
                        raise RuntimeError("the controller is closed")
                    # a channel of its own: gRPC shares one connection between channels of
                    # the same target and arguments unless told otherwise
                    opts = _CHANNEL_OPTIONS + ([("grpc.use_local_subchannel_pool", 1)]
                                               if control else [])
                    if self.cfg.security.insecure:
                        ch = grpc.insecure_channel(self.agents[node], options=opts)
                    else:
                        if self._channel_creds is None:
                            self._channel_creds = channel_credentials(
                                self.cfg.security.identity("controller"))
                        # only node's own identity may answer there (pinned)
                        ch = grpc.secure_channel(
                            self.agents[node], self._channel_creds,
                            options=opts + pinned_options(agent_principal(node)))
                    (self._control_channels if control else self._channels)[node] = ch
                    s = stubs[node] = pb_grpc.MessageAgentStub(ch)
        return s

    def _control_channel(self, node: int) -> grpc.Channel:
        """Node ``node``'s control connection (see :meth:`_stub`)."""
        self._stub(node, control=True)
        return self._control_channels[node]

    def count_refused(self) -> None:
        """Count a refused call (the role checks of this controller's servers)."""
        self.stats.refused_calls += 1

    def _producer(self, t: int) -> Any:
        """Topic ``t``'s producer, created on first use on a helper thread (under the
        dispatch lock). The sending path waits for a creation at most
        ``producer_wait_s`` in all (a broker that is away makes a creation wait for the
        client's operation timeout): after that the topic raises :class:`TopicRefused` at
        once while the creation goes on, and its messages go over RPC. A topic whose
        producer could not be created is not asked again for ``PRODUCER_RETRY_S`` after the
        failure (:class:`TopicRefused` at once); a failure older than that starts a new
        creation."""
        p = self._producers.get(t)
        if p is not None:
            return p
        refused = self._producer_refused.get(t)
        if refused is not None and time.monotonic() - refused[0] < PRODUCER_RETRY_S:
            raise TopicRefused(f"topic {t}: no producer ({refused[1]}, "
                               f"{time.monotonic() - refused[0]:.1f} s ago)")
        entry = self._creating.get(t)
        if entry is not None and entry.failed_at is not None \
                and time.monotonic() - entry.failed_at >= PRODUCER_RETRY_S:
            del self._creating[t]  # an old failure (e.g. during an outage): ask again
            entry = None
        if entry is None:
            entry = self._create_in_background(t)
        fut = entry.future
        # (the client's own timeout is a TimeoutError too: the future tells them apart)
        futures.wait([fut], timeout=max(0.0, entry.started + self.cfg.producer_wait_s
                                        - time.monotonic()))
        if not fut.done():
            raise TopicRefused(f"topic {t}: its producer is still being created "
                               f"({time.monotonic() - entry.started:.1f} s)")
        del self._creating[t]
        e = fut.exception()
        if e is not None:
            assert entry.failed_at is not None
            self._producer_refused[t] = (entry.failed_at, f"{type(e).__name__}: {e}")
            raise e
        p = fut.result()
        self._producer_refused.pop(t, None)
        self._producers[t] = p
        return p

    def _prepare_producers(self, channels: Iterable[int]) -> None:
        """Start creating the producers of the topics among ``channels`` that have none and
        may be asked (under the dispatch lock), so that their creations overlap: the
        sending path then waits ``producer_wait_s`` once for all of them, not once each."""
        now = time.monotonic()
        for c in sorted(set(channels) - {RPC}):
            refused = self._producer_refused.get(c)
            if (c not in self._producers and c not in self._creating
                    and (refused is None or now - refused[0] >= PRODUCER_RETRY_S)):
                self._create_in_background(c)

    def _create_in_background(self, t: int) -> _Creation:
        """Start creating topic ``t``'s producer on a helper thread that holds no lock (see
        :meth:`_producer`); a producer created after the controller closed is closed."""
        entry = self._creating[t] = _Creation(futures.Future(), time.monotonic())

        def create() -> None:
            try:
                p = self._create_producer(t)
            except BaseException as e:
                entry.failed_at = time.monotonic()
                entry.future.set_exception(e)
                return
            entry.future.set_result(p)
            if self._stop.is_set():
                close_in_background(p)

        threading.Thread(target=create, name=f"controller-producer-{t}", daemon=True).start()
        return entry

    def _create_producer(self, t: int) -> Any:
        assert self._client is not None
        # with failover on, unacknowledged publishes never time out: the client sends them
        # again, in order, once the broker is back (those of a type moved to RPC meanwhile
        # arrive as duplicates)
        return self._client.create_producer(
            topic_name(self.cfg.topic_prefix, t), block_if_queue_full=True,
            max_pending_messages=10_000, batching_enabled=True, batching_max_publish_delay_ms=1,
            send_timeout_millis=0 if self.cfg.failover.enabled else 30_000)

    # ------------------------------------------------------------------ channels
    def set_channels(self, channels: dict[int, int], hosts: dict[int, Iterable[int]], *,
                     wait: bool = True) -> dict:
        """Make ``channels`` (type -> 0 = RPC or topic 1..K) current, losslessly (see the
        module docstring); ``hosts`` gives the destinations of every type named.

        Only the types whose channel changes wait for the switch: their messages are held
        (in arrival order, already in the outbox) from this call until the switch is done,
        then dispatched on their new channels; every other type's messages keep leaving
        while the SubscribeInfos are acknowledged (``stats.switch_held`` counts the held
        messages). Switches run one at a time, in the order they were asked for.

        With ``wait`` (the default) the switch runs in the calling thread and this returns
        what changed (``types``, ``subscribe``, ``unsubscribe``, ``deferred`` while the MQ
        channel is down). Without it the switch is queued on the controller's switch thread
        (the switches queued while one runs are then made as one) and this returns at once
        with ``{"queued": types to move}``; :meth:`wait_switches` (which :meth:`flush` does
        not do) waits for the queued switches and raises the error of one that failed
        (nothing of it was stored or sent, and its types stay on their old channels)."""
        chans = {int(t): int(c) for t, c in channels.items()}
        hs = {int(t): tuple(int(h) for h in v) for t, v in hosts.items()}
        if wait:
            self.wait_switches()  # an earlier switch's error is raised before this one starts
        # the moving types are gated before any later message of theirs. A type moves if its
        # channel differs from the one it has now or from the one it will have once the
        # queued switches are done (a type queued for topic 1 and then back to RPC must be
        # held until both are done, or what is released after the first would leave on
        # topic 1 while later messages take RPC; a switch deferred by an outage leaves the
        # asked channel ahead of the current one), or if it stays on a topic that its new
        # hosts must first subscribe to
        with self._dispatch, self._lock:
            moving = [t for t, c in chans.items()
                      if c != self.channel.get(t, RPC)
                      or c != self._asked.get(t, self.channel.get(t, RPC))
                      or (c != RPC and t in hs and set(hs[t]) - set(self.hosts.get(t, ())))]
            for t in moving:
                self._gated[t] = self._gated.get(t, 0) + 1
            self._asked.update(chans)
        if not wait:
            fut: futures.Future = futures.Future()
            with self._lock:
                self._queued.append((chans, hs, moving, fut))
                self._switches.append(fut)
            try:
                self._switcher.submit(self._run_queued)
            except RuntimeError:  # closed: nothing was stored, nothing waits
                with self._lock:
                    self._queued = [q for q in self._queued if q[3] is not fut]
                    self._switches.remove(fut)
                with self._dispatch:
                    self._release_gated(moving)
                raise
            return {"queued": len(moving)}
        return self._switch(chans, hs, moving)

    def _run_queued(self) -> None:
        """The switch thread: every switch queued so far, as one (later channels win), so a
        burst of placements pays one store transaction, one flush and one round of
        SubscribeInfos."""
        with self._lock:
            batch, self._queued = self._queued, []
        if not batch:  # an earlier run took them
            return
        chans: dict[int, int] = {}
        hs: dict[int, tuple[int, ...]] = {}
        moving: list[int] = []
        for c, h, m, _ in batch:
            chans.update(c)
            hs.update(h)
            moving.extend(m)
        try:
            out = self._switch(chans, hs, moving)
        except BaseException as e:
            for *_, f in batch:
                f.set_exception(e)
            return
        for *_, f in batch:
            f.set_result(out)

    def channel_asked(self, t: int) -> int | None:
        """Type ``t``'s channel once the queued switches are done (``None``: never given
        one)."""
        with self._lock:
            return self._asked.get(int(t), self.channel.get(int(t)))

    def wait_switches(self, timeout_s: float | None = None) -> None:
        """Wait until every switch queued by ``set_channels(..., wait=False)`` is done;
        raises the first error of one that failed (once)."""
        with self._lock:
            pending, self._switches = self._switches, []
        futures.wait(pending, timeout=timeout_s)
        for f in pending:
            if not f.done():
                with self._lock:
                    self._switches.append(f)
        errors = [f.exception() for f in pending if f.done() and not f.cancelled()
                  and f.exception() is not None]
        if errors:
            raise errors[0]

    def _switch(self, channels: dict[int, int], hosts: dict[int, tuple[int, ...]],
                moving: list[int]) -> dict:
        """One switch (one at a time): its plan under the dispatch lock, then outside it the
        store, the subscribing SubscribeInfos and a flush of what was sent under the old
        channels (only the gated types wait), the channels and the gated messages under it
        again, then the unsubscriptions (outside) and the fences."""
        with self._switch_lock:
            try:
                plan = self._switch_plan(channels, hosts)
                if plan is not None:
                    self._switch_store(plan)
                    if plan.subs:
                        self._send_subscribe_infos(plan.subs, plan.ts, True)
                    # messages sent under the old channels go out first (the moving types'
                    # are held: none comes after)
                    self._flush_locked()
                out = self._switch_apply(plan, moving)
                if out.pop("released", 0):  # their RPC copies go now, outside the lock
                    self._flush_locked()
                if plan is not None and plan.unsubs:
                    self._unsubscribe(plan.unsubs, plan.ts)
                return out
            except BaseException:
                with self._dispatch:
                    self._release_gated(moving)  # a no-op if the switch released them
                    with self._lock:  # its types stay where they were, unless a queued
                        for t in channels:  # switch still asks for a channel of theirs
                            self._asked[t] = self.channel.get(t, RPC)
                            for chans, *_ in self._queued:
                                if t in chans:
                                    self._asked[t] = chans[t]
                raise

    @_dispatching
    def _switch_plan(self, channels: dict[int, int], hosts: dict[int, tuple[int, ...]]
                     ) -> _SwitchPlan | None:
        """What the switch changes (new channels, subscriptions to make and to end, its
        timestamp; :meth:`_switch_store` writes it); ``None`` when nothing changes or the
        change is deferred until the MQ channel is back."""
        for t, hs in hosts.items():
            self.hosts[t] = hs
        if self._failed_over or self._mq_down:
            # no SubscribeInfo, durable subscription or fence can be made while the broker
            # is down: the newest channels are applied when it is back
            old_ch, old_hosts = self._deferred or ({}, {})
            self._deferred = ({**old_ch, **channels},
                              {**old_hosts, **{t: self.hosts[t] for t in hosts}})
            n = sum(self.channel.get(t) != c for t, c in channels.items())
            self.stats.deferred_channel_changes += n
            self._last_switch = {"types": 0, "subscribe": 0, "unsubscribe": 0, "deferred": n}
            return None
        changed = {t: c for t, c in channels.items() if self.channel.get(t) != c}
        if not changed:
            self._last_switch = {"types": 0, "subscribe": 0, "unsubscribe": 0}
            return None
        new_channel = {**self.channel, **changed}
        wanted: dict[int, set[int]] = defaultdict(set)
        for t, c in new_channel.items():
            if c != RPC:
                for n in self.hosts[t]:
                    wanted[n].add(c)
        subs = [(n, c) for n in wanted for c in wanted[n] - self.node_topics.get(n, set())]
        unsubs = [(n, c) for n in list(self.node_topics)
                  for c in self.node_topics[n] - wanted.get(n, set())]
        return _SwitchPlan(changed, new_channel, wanted, subs, unsubs, self.timestamp(),
                           {t: self.hosts[t] for t in changed})

    def _switch_store(self, plan: _SwitchPlan) -> None:
        """Grant the subscribing nodes their topics and write the switch to the store
        (outside the dispatch lock: the moving types are gated and nothing else reads the
        plan; the switch lock keeps switches in order). A ``PulsarAdminError`` or
        ``StoreError`` leaves nothing sent."""
        if self._grants is not None and plan.subs:
            self._grants.ensure({n for n, _ in plan.subs})
        pre = self.cfg.topic_prefix
        self.store.write_mapping([(t, c, topic_name(pre, c) if c else None, plan.hosts[t])
                                  for t, c in plan.changed.items()], plan.ts)
        self.store.apply_changes(
            [SubscriptionChange(n, topic_name(pre, c), subscription_name(n), True)
             for n, c in plan.subs]
            + [SubscriptionChange(n, topic_name(pre, c), subscription_name(n), False)
               for n, c in plan.unsubs], plan.ts)

    @_dispatching
    def _switch_apply(self, plan: _SwitchPlan | None, moving: list[int]) -> dict:
        if plan is None:
            self._release_gated(moving)
            return self._last_switch
        changed, subs, unsubs = plan.changed, plan.subs, plan.unsubs
        with self._lock:  # only switches change channels, one at a time: the plan holds
            self.channel = plan.channel
            self.node_topics = defaultdict(set, {n: set(v) for n, v in plan.wanted.items()})
            self.stats.channel_changes += len(changed)
        released = self._release_gated(moving)
        return {"types": len(changed), "subscribe": len(subs), "unsubscribe": len(unsubs),
                "released": released}

    def _unsubscribe(self, unsubs: list[tuple[int, int]], ts: int) -> None:
        """The switch's last step, after its channels took effect: the unsubscribing
        SubscribeInfos (outside the dispatch lock: no type on these (node, topic) pairs is
        left, so no message waits for them), then a fence on each topic left."""
        # Wait for the acknowledgements: a gRPC future that is dropped unanswered is
        # cancelled when garbage-collected (the agent never hears of the unsubscription),
        # and a fence that overtakes the SubscribeInfo would leave the agent draining.
        self._send_subscribe_infos(unsubs, ts, False)
        with self._dispatch:
            fence = fence_envelope(self.timestamp())
            for c in sorted({c for _, c in unsubs}):
                self._publish_fence(c, fence)

    def _release_gated(self, moving: list[int]) -> int:
        """End one switch's gate on ``moving`` (under the dispatch lock; the list is emptied,
        so a second call for the same switch releases nothing) and dispatch, in arrival
        order, the held messages of the types no other queued switch still gates. Returns
        how many were dispatched."""
        with self._lock:
            types, moving[:] = list(moving), []
            for t in types:
                left = self._gated.get(t, 0) - 1
                if left > 0:
                    self._gated[t] = left
                else:
                    self._gated.pop(t, None)
            go = [(t, cm) for t, cm in self._gated_msgs if t not in self._gated]
            self._gated_msgs = [(t, cm) for t, cm in self._gated_msgs if t in self._gated]
        # oldest first: a message that waited for the broker meanwhile (failback) may have
        # joined the held ones after newer messages of its type
        go.sort(key=lambda x: x[1].timestamp_ns)
        for t, cm in go:   # a topic that refuses them sends them over RPC (_dispatch_one)
            self._dispatch_one(t, cm, gate=False)
        return len(go)

    def _send_subscribe_infos(self, pairs: list[tuple[int, int]], ts: int,
                              subscribe: bool) -> None:
        """Send (and wait for) the SubscribeInfos of ``pairs`` (node, channel); failures are
        queued (see the module docstring)."""
        calls, failed = [], []
        for n, c in pairs:
            info = pb.SubscribeInfo(url=self.cfg.pulsar_url, topic=topic_name(
                self.cfg.topic_prefix, c), subscription=subscription_name(n), timestamp_ns=ts,
                operation=subscribe)
            self.stats.subscribe_infos += 1
            self.stats.unsubscribe_infos += not subscribe
            with self._lock:
                known_down = bool(self._pending.get(n) or self._pending_infos.get(n))
            if known_down:  # do not wait for it: queue it behind the node's earlier ones
                failed.append((n, c, info, "node unreachable"))
                continue
            self.stats.rpc_bytes += info.ByteSize()
            # wait_for_ready: a channel in reconnect backoff (the agent was not up at a
            # Collect a moment ago) would fail it at once, and an agent that misses a
            # SubscribeInfo while it runs never consumes the topic
            calls.append((n, c, info, self._stub(n, control=True).Subscribe.future(
                info, timeout=self.cfg.subscribe_timeout_s, wait_for_ready=True)))
        for n, c, info, fut in calls:
            try:
                ok = fut.result()
                if ok.ok:
                    continue
                failed.append((n, c, info, ok.error))
            except grpc.RpcError as e:
                failed.append((n, c, info, e.code().name))
        for n, c, info, err in failed:
            self.stats.subscribe_failures += 1
            log.warning("node %d: SubscribeInfo (%s %s) failed (%s); queued until it answers",
                        n, "subscribe" if subscribe else "unsubscribe", info.topic, err)
            if subscribe:  # so nothing is lost until it gets the SubscribeInfo or reads the store
                self._ensure_subscription(info.topic, info.subscription)
            with self._lock:
                q = self._pending_infos[n]
                last = next((i for i in range(len(q) - 1, -1, -1) if q[i][0] == c), None)
                if subscribe and last is not None and not q[last][1].operation:
                    # it never heard it was to leave the topic: it stays (sending the two in
                    # order would let it delete the subscription, then subscribe afresh,
                    # missing what was published in between)
                    del q[last]
                q.append((c, info))

    def retry_subscribe_infos(self) -> int:
        """Send the queued SubscribeInfos of nodes that answer again, in order: each round
        sends the first one of every such node at once and waits for the answers (each
        within ``push_timeout_s``); a node's queue stops at its first failure. An
        unsubscription sent this way gets a fence of its own: the one of its switch may have
        gone by. Runs under the switch lock, so no switch changes a queue meanwhile, but not
        under the dispatch lock: messages keep leaving while a node is slow to answer (only
        the fence takes it). Nodes whose control channel is not ready within 0.2 s (all
        probed at once) wait for the next period. Returns the number sent."""
        with self._lock:
            nodes = [] if self._mq_down else [n for n, infos in self._pending_infos.items()
                                              if infos]
        if not nodes:
            return 0
        try:
            probes = {n: grpc.channel_ready_future(self._control_channel(n)) for n in nodes}
        except RuntimeError:  # closed meanwhile
            return 0
        deadline = time.monotonic() + 0.2
        ready = []
        for n, f in probes.items():
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
                ready.append(n)
            except grpc.FutureTimeoutError:
                f.cancel()
        sent = 0
        with self._switch_lock:
            while ready:
                calls = []
                for n in ready:
                    with self._lock:
                        if not self._pending_infos[n]:
                            continue
                        c, info = self._pending_infos[n][0]
                    calls.append((n, c, info, self._stub(n, control=True).Subscribe.future(
                        info, timeout=self.cfg.push_timeout_s)))
                ready = []
                for n, c, info, fut in calls:
                    try:
                        ack = fut.result()
                    except grpc.RpcError:
                        continue
                    if not ack.ok:  # e.g. the broker is down: try again later
                        log.warning("node %d: queued SubscribeInfo %s: %s", n, info.topic,
                                    ack.error)
                        continue
                    self.stats.rpc_bytes += info.ByteSize()
                    sent += 1
                    with self._lock:
                        self._pending_infos[n].pop(0)
                    if not info.operation:
                        with self._dispatch:
                            self._publish_fence(c, fence_envelope(self.timestamp()))
                    ready.append(n)
        return sent

    def _publish_fence(self, c: int, fence: bytes) -> None:
        """Publish a fence on topic ``c`` (under the dispatch lock). A topic that refuses (its
        producer cannot be created: the broker is away and not yet known to be down) gets
        it at the next flush that can publish, in order with the other publishes waiting
        there: the switch it ends has taken effect and does not fail for it (an agent keeps
        draining the topic until it arrives; nothing of a moved type is published there)."""
        try:
            self._publish(c, fence)
        except Exception as e:
            log.warning("topic %d: its fence waits for the next flush (%s)", c, e)
            with self._lock:
                self._republish.append((c, fence))
        self.stats.fences += 1

    def _ensure_subscription(self, topic: str, subscription: str) -> bool:
        import pulsar

        if self._mq_down:  # would wait for the operation timeout; made at recovery instead
            return False
        try:
            c = self._client.subscribe(topic, subscription,
                                       consumer_type=pulsar.ConsumerType.Exclusive,
                                       receiver_queue_size=1,
                                       initial_position=pulsar.InitialPosition.Latest)
            c.close()
        except (pulsar.Timeout, pulsar.ConnectError) as e:  # the broker did not answer
            log.info("durable subscription %s on %s: %s", subscription, topic, e)
            return False
        except Exception as e:  # the agent's own consumer holds it already, ...
            log.info("durable subscription %s on %s: %s", subscription, topic, e)
        return True

    # ------------------------------------------------------------------ messages
    def send(self, msg: Message, type_id: int) -> None:
        """Accept and dispatch one Table I message of type ``type_id`` (see
        :meth:`send_many`)."""
        self.send_many([(msg, type_id)])

    def send_many(self, items: Sequence[tuple[Message, int]]) -> None:
        """Accept messages ``(message, type id)``: durable in the outbox (one transaction)
        when this returns, then dispatched by their types' current channels (RPC messages
        leave at the next :meth:`flush`), through the tenant shaper when shaping is on."""
        encoded = [(msg, int(t), encode(msg, t, self.payloads.of(msg.size_bytes)))
                   for msg, t in items]
        if not encoded:
            return
        if self.cfg.shaping.enabled and self._shaper is None:
            self._start_shaper()  # ShapingError (nothing stored) when G is unknown
        if self.cfg.outbox:
            self.store.outbox_put([(cm.timestamp_ns, t, cm.vpc_id, cm.SerializeToString(),
                                    msg.hosts) for msg, t, cm in encoded], time.time_ns())
            self.stats.outbox_stored += len(encoded)
        with self._dispatch:
            self._in_send.active = True
            try:
                if not self._mq_down:
                    self._prepare_producers(self.channel.get(t, RPC) for _, t, _ in encoded)
                for msg, t, cm in encoded:
                    if t not in self.hosts:
                        self.hosts[t] = tuple(msg.hosts)
                    self._rates.add(t, msg.size_bytes, len(msg.hosts))
                    with self._lock:
                        self._latest[resource_key(cm)] = cm
                    if self._shaper is None:
                        self._dispatch_one(t, cm)
                    else:  # Eq. 1's controller egress of the message on its channel now
                        fan = len(msg.hosts) if self.channel.get(t, RPC) == RPC else 1
                        self._shaper.submit(int(msg.vpc_id), len(cm.payload) * fan, (t, cm))
            finally:
                self._in_send.active = False

    def _dispatch_failed(self, t: int, c: int, cm: Any, e: Exception) -> None:
        """An accepted (stored) message whose topic ``c`` refused it (its producer could not
        be created while the broker is away and not yet known to be down): it goes over
        RPC, so it never waits in the outbox for a restart."""
        (log.debug if isinstance(e, TopicRefused) else log.warning)(
            "type %d: message %d could not go on topic %d (%s); it goes over RPC",
            t, cm.message_id, c, e)
        with self._lock:
            for n in cm.hosts:
                self._outbox[n].append(cm)
        self.stats.rerouted += 1

    def _release(self, items: list[tuple[int, Any]]) -> None:
        """The tenant shaper's release: dispatch (and, from its pump thread, push at once)."""
        with self._dispatch:
            for t, cm in items:
                self._dispatch_one(t, cm)
            if not getattr(self._in_send, "active", False):
                self._flush_locked()

    def _dispatch_one(self, t: int, cm: Any, gate: bool = True) -> None:
        """One accepted message onto its type's channel (under the dispatch lock); held
        while a switch moves its type (see :meth:`set_channels`)."""
        if gate and self._gated:
            with self._lock:
                if t in self._gated:
                    self._gated_msgs.append((t, cm))
                    self.stats.switch_held += 1
                    return
        c = self.channel.get(t, RPC)
        if c != RPC and self._mq_down:
            if t not in self._failover_types:  # over the capacities: waits for the broker
                with self._lock:
                    self._held.append((t, cm))
                self.stats.held += 1
                return
            c = RPC
            self.stats.rerouted += 1
        if c == RPC:
            with self._lock:
                for n in cm.hosts:
                    self._outbox[n].append(cm)
            return
        try:
            self._publish(c, envelope(cm), cm)
        except Exception as e:  # stored, whichever path dispatched it: RPC takes it
            self._dispatch_failed(t, c, cm, e)
            return
        self.stats.mq_messages += 1

    def _publish(self, t: int, data: bytes, cm: Any = None) -> None:
        # the producer first: a topic that refuses one leaves nothing behind (no unit, no
        # publish in flight, nothing awaiting the MQ's confirmation)
        producer = self._producer(t)
        # C_p: one unit, waiting for it if the limit is full (none while the MQ channel is
        # down: the broker takes nothing then)
        units = 0 if self._mq_down else self._limiter.acquire(1)
        back = 0
        now = time.monotonic()
        pid = next(self._publish_ids)
        with self._lock:
            if self._mq_down:  # declared down while this waited: see _on_health_change
                back, units = units, 0
            self._inflight[pid] = (t, data, now)
            self._inflight_units[pid] = units
            if cm is not None and self.cfg.failover.enabled:
                for n in cm.hosts:
                    self._mq_unconfirmed[n][cm.timestamp_ns] = (now, cm)
        self._limiter.release(back)
        self.stats.mq_bytes += len(data)
        try:
            producer.send_async(data, lambda res, _id: self._published(res, pid))
        except BaseException:  # no callback will come: nothing of it stays in flight
            self._release_publish(pid)
            with self._lock:
                self._inflight.pop(pid, None)
                if not self._inflight:
                    self._published_cv.notify_all()
                if cm is not None:
                    for n in cm.hosts:
                        self._mq_unconfirmed[n].pop(cm.timestamp_ns, None)
            raise

    def _release_publish(self, pid: int) -> None:
        """Give back the C_p unit of publish ``pid`` (once: whoever takes it from
        ``_inflight`` or gives up on it first)."""
        with self._lock:
            units = self._inflight_units.pop(pid, 0)
        self._limiter.release(units)

    @property
    def inflight_sends(self) -> int:
        """The units of concurrent sends held now (RPC pushes and MQ publishes in flight)."""
        return self._limiter.held

    def _published(self, res: Any, pid: int) -> None:
        import pulsar

        self._release_publish(pid)  # C_p: its unit goes back (none if already given back)
        if res == pulsar.Result.Ok:
            self._last_ack = time.monotonic()  # the broker is alive (MqHealth.last_ack)
        with self._lock:
            entry = self._inflight.pop(pid, None)
            if not self._inflight:
                self._published_cv.notify_all()
            if entry is None:  # taken over by the RPC channel during an outage
                return
            t, data, _ = entry
            if res != pulsar.Result.Ok:  # e.g. the broker was down past the send timeout
                log.warning("publish on topic %d failed (%s); it will be published again",
                            t, res)
                self._republish.append((t, data))

    def _inflight_age(self) -> float:
        with self._lock:
            first = next(iter(self._inflight.values()), None)
        return 0.0 if first is None else time.monotonic() - first[2]

    def flush(self, wait: bool = True) -> None:
        """Push every queued RPC message (one batch per node, all nodes concurrently) and,
        with ``wait``, wait until the broker acknowledged every publish (or the MQ channel
        is down)."""
        self._flush_locked()
        if not wait:
            return
        with self._lock:
            self._published_cv.wait_for(
                lambda: not self._inflight or self._mq_down or self._stop.is_set())

    def _flush_locked(self) -> None:
        """Push every queued RPC message (one batch per node, all nodes concurrently) and
        wait for the answers. The dispatch lock is held only while the outbox is taken (and
        failed publishes are published again), not while the pushes are answered, unless
        the caller holds it: a flush from the sending path or a switch leaves the
        dispatcher free meanwhile. Flushes push one after another, in the order they took
        the outbox (a node gets its batches in order)."""
        with self._dispatch:
            with self._lock:
                again: list[tuple[int, bytes]] = []
                if not self._mq_down:
                    again, self._republish = self._republish, []
                outbox, self._outbox = self._outbox, defaultdict(list)
                for n in list(outbox):
                    if (self._pending.get(n) or n in self._reprogramming
                            or n not in self.agents):  # unreachable: keep the order
                        self._pending[n].extend(outbox.pop(n))
                turn = next(self._push_turns)
            self._publish_again(again)
        cv = self._push_turn_cv
        with cv:  # the flushes that took the outbox before this one push first
            cv.wait_for(lambda: self._push_turn == turn)
        try:
            self._push_all(outbox, reprogram=False)
        finally:
            with cv:
                self._push_turn += 1
                cv.notify_all()

    # ------------------------------------------------------------------ failover
    def set_capacities(self, controller_bw_bps: float | None,
                       controller_cpu: float | None) -> None:
        """C_b (bit/s) and C_p (messages/s) for failover planning, where the configuration
        leaves them unset (the control plane passes its scenario's)."""
        fo = self.cfg.failover
        self._capacity = (fo.controller_bw_bps if fo.controller_bw_bps is not None
                          else controller_bw_bps,
                          fo.controller_cpu if fo.controller_cpu is not None else controller_cpu)
        if self.cfg.shaping.enabled and self._client is not None:
            self._start_shaper()

    def on_health(self, listener: Callable[[dict], None]) -> None:
        """Call ``listener(self.health())`` at every change of channel health."""
        self._health_listeners.append(listener)

    def health(self) -> dict:
        """The channels' health now: the MQ channel's state and since when, the types moved
        to RPC and those waiting, and the nodes whose RPC endpoint is unreachable (and of
        those, the ones reached through a topic)."""
        with self._lock:
            return {"mq": "down" if self._mq_down else "up", "since_ns": self._down_since_ns,
                    "rerouted": sorted(self._failover_types),
                    "waiting": sorted(self._waiting_types | {t for t, _ in self._held}),
                    "unreachable": sorted(self._unreachable_since),
                    "relayed": sorted(n for n, ts in self._relayed.items() if ts)}

    def _event(self, event: str, why: str) -> None:
        """Record a health event and tell the listeners, on a thread of their own (one may
        talk to a policy server: it never holds up delivery)."""
        self.stats.health_events.append((time.time_ns(), event, why))
        if self._health_listeners and not self._stop.is_set():
            self._notifier.submit(self._notify, self.health())

    def _notify(self, h: dict) -> None:
        for f in list(self._health_listeners):
            try:
                f(h)
            except Exception as e:  # a listener must not stop delivery
                log.warning("channel-health listener %r failed: %s", f, e)

    def _probe_congested(self) -> None:
        """MqHealth's callback: a late probe excused (the link is full, the broker up)."""
        self.stats.probes_congested += 1

    def _probe_waited(self) -> None:
        """MqHealth's callback: a probe's deadline moved for the RPC pushes ahead of it."""
        self.stats.probes_waited += 1

    def _on_health_change(self, state: str, reason: str) -> None:
        """MqHealth's callback (its probe thread): note it, wake the failover thread."""
        with self._lock:
            self._mq_down = state == MqHealth.DOWN
            self._down_since_ns = time.time_ns()
            self._published_cv.notify_all()
            # the broker takes nothing while down: its publishes in flight stop holding C_p
            # units (a sender waiting for one would otherwise hold the dispatch lock that
            # the failover needs to take them over by RPC)
            freed = (sum(self._inflight_units.pop(pid) for pid in list(self._inflight_units))
                     if self._mq_down else 0)
        self._limiter.release(freed)
        log.warning("MQ channel %s (%s)", state, reason)
        self._health_wake.set()

    def _failover_loop(self) -> None:
        period = self.cfg.failover.replan_period_s
        while not self._stop.is_set():
            self._health_wake.wait(period)
            self._health_wake.clear()
            if self._stop.is_set():
                return
            try:
                if self._mq_down:
                    self._fail_over()
                elif self._failed_over:
                    self._fail_back()
            except Exception:  # keep the thread: the next period tries again
                log.exception("failover step failed")

    @_dispatching
    def _fail_over(self) -> None:
        """(Re-)plan the outage: move what fits to RPC (Eq. 1's controller constraints,
        oldest waiting type first) with its unacknowledged publishes and waiting messages,
        in timestamp order; the rest waits."""
        if not self._mq_down:
            return
        first = not self._failed_over
        self._failed_over = True
        with self._lock:
            oldest: dict[int, int] = {}
            for t, cm in self._held:
                oldest.setdefault(t, cm.timestamp_ns)
            for _, data, _ in self._inflight.values():
                cm = open_envelope(data).config
                if cm is not None:
                    oldest[cm.type_id] = min(oldest.get(cm.type_id, cm.timestamp_ns),
                                             cm.timestamp_ns)
        mq = [t for t, c in self.channel.items() if c != RPC and t not in self._failover_types]
        rpc = [t for t, c in self.channel.items() if c == RPC] + sorted(self._failover_types)
        plan = plan_failover(mq, rpc, self.hosts, self._rates.rates(), *self._capacity,
                             oldest_ns=oldest)
        moved = set(plan.moved)
        self._failover_types |= moved
        self._waiting_types = set(plan.waiting)
        taken: list[Any] = []
        freed = 0  # C_p units of the publishes taken over
        with self._lock:
            for pid, (_, data, _) in list(self._inflight.items()):
                cm = open_envelope(data).config
                if cm is not None and cm.type_id in moved:
                    del self._inflight[pid]
                    freed += self._inflight_units.pop(pid, 0)
                    taken.append(cm)
            keep = []
            for t, data in self._republish:
                cm = open_envelope(data).config
                if cm is not None and cm.type_id in moved:
                    taken.append(cm)
                else:
                    keep.append((t, data))
            self._republish = keep
            taken += [cm for t, cm in self._held if t in moved]
            self._held = [(t, cm) for t, cm in self._held if t not in moved]
            if not self._inflight:
                self._published_cv.notify_all()
            for cm in sorted(taken, key=lambda m: m.timestamp_ns):
                for n in cm.hosts:
                    self._outbox[n].append(cm)
            for n in {n for cm in taken for n in cm.hosts}:
                self._outbox[n].sort(key=lambda m: m.timestamp_ns)
        self._limiter.release(freed)
        self.stats.rerouted += len(taken)
        if first:
            self.stats.failovers += 1
        if first or moved:
            bw, cpu = self._capacity
            why = (f"types {id_ranges(self._failover_types)} -> RPC, "
                   f"{id_ranges(plan.waiting)} wait; "
                   f"RPC load {plan.controller_bw_bps:.0f} bit/s of C_b {bw}, "
                   f"{plan.controller_cpu:.0f} concurrent sends of C_p {cpu}; "
                   f"{len(taken)} messages taken over")
            log.warning("MQ down: %s", why)
            self._event("failover" if first else "replan", why)
        self._flush_locked()

    @_dispatching
    def _fail_back(self) -> None:
        """The broker is healthy again: push what RPC holds, publish what waited (oldest
        first), put the types back on their topics and apply the deferred channels."""
        if self._mq_down or not self._failed_over:
            return
        self._renew_producers()
        self._flush_locked()
        with self._lock:
            held, self._held = self._held, []
            again, self._republish = self._republish, []
        types = id_ranges(self._failover_types)
        self._failover_types.clear()
        self._waiting_types.clear()
        self._failed_over = False
        self._publish_again(again)
        for t, cm in held:  # on its type's channel, as the MQ channel is up again
            self._dispatch_one(t, cm)
        self._flush_locked()
        self.stats.failbacks += 1
        deferred, self._deferred = self._deferred, None
        why = f"types {types} back on their topics; {len(held)} waiting messages published"
        log.warning("MQ up: %s", why)
        if deferred is not None:  # queued: it needs the dispatch lock this holds
            with self._lock:  # a switch asked since (and not yet planned) has the last word
                chans = {t: c for t, c in deferred[0].items() if self._asked.get(t, c) == c}
            self.set_channels(chans, {t: deferred[1][t] for t in chans if t in deferred[1]},
                              wait=False)
        self._event("failback", why)

    def _publish_again(self, again: list[tuple[int, bytes]]) -> None:
        """Publish failed (or renewed) publishes again, in order (under the dispatch lock).
        A topic that refuses (its producer cannot be created yet) stops the run: that one
        and the rest go back to the head of the republish list for the next flush, so
        nothing is dropped and no flush is left without its push turn."""
        for i, (t, data) in enumerate(again):
            try:
                self._publish(t, data)
            except Exception as e:
                with self._lock:
                    self._republish[:0] = again[i:]
                (log.debug if isinstance(e, TopicRefused) else log.warning)(
                    "publishing %d messages again waits for the next flush: topic %d: %s",
                    len(again) - i, t, e)
                return
            self.stats.republished += 1

    def _renew_producers(self) -> None:
        """At a failback (the probe's producer is acknowledged again), replace every data
        producer that has not reconnected: one that existed through the outage reconnects
        on the client's own back-off, which can leave it disconnected long after the broker
        is back, holding its type's publishes (the probe's producer gets fresh twins for the
        same reason). Its unacknowledged publishes go again on the fresh producer, after the
        failed ones and in the order they were first published; a copy the old producer
        still delivers reaches the agents as a duplicate, which they drop. The old producer
        is closed in the background (under the dispatch lock, as every producer change).
        A creation that finished during the outage is settled too: a failure is forgotten
        (the next publish asks again), a connected producer is taken, one that is not is
        closed."""
        for t, c in list(self._creating.items()):
            if not c.future.done():
                continue
            del self._creating[t]
            if c.future.exception() is None:
                made = c.future.result()
                if connected(made) and t not in self._producers:
                    self._producers[t] = made
                    self._producer_refused.pop(t, None)
                else:
                    close_in_background(made)
        for t in [t for t, p in self._producers.items() if not connected(p)]:
            old = self._producers.pop(t)
            with self._lock:
                pids = sorted(pid for pid, e in self._inflight.items() if e[0] == t)
                entries = [self._inflight.pop(pid) for pid in pids]
                units = sum(self._inflight_units.pop(pid, 0) for pid in pids)
                self._republish.extend((t, data) for _, data, _ in entries)
                if not self._inflight:
                    self._published_cv.notify_all()
            self._limiter.release(units)
            self.stats.producers_renewed += 1
            log.warning("topic %d: its producer has not reconnected since the outage; a new "
                        "one publishes its %d unacknowledged messages again", t, len(entries))
            close_in_background(old)

    def _push_all(self, batches: dict[int, list], reprogram: bool) -> dict[int, bool]:
        ok: dict[int, bool] = {}
        todo = {n: pb.ConfigBatch(messages=ms) for n, ms in batches.items() if ms}
        for attempt in range(1 + self.cfg.push_retries):
            if self._stop.is_set():  # closing: what is left stays queued
                break
            calls = {}
            for n, b in todo.items():
                # C_p: |D| units per destination node's message, held until the call ends
                units = self._limiter.acquire(len(b.messages))
                self.stats.rpc_pushes += 1
                self.stats.rpc_bytes += b.ByteSize()
                seq = self._rpc_backlog.start()  # ahead of every probe that leaves from now
                try:
                    calls[n] = fut = self._stub(n).Push.future(b,
                                                               timeout=self.cfg.push_timeout_s)
                except (ValueError, RuntimeError):  # closed meanwhile: stays queued
                    self._push_done(units, seq, None)
                    break
                except BaseException:  # no call, no callback: its units and number end here
                    self._push_done(units, seq, None)
                    raise
                fut.add_done_callback(functools.partial(self._push_done, units, seq))
            failed = {n: b for n, b in todo.items() if n not in calls}
            for n, fut in calls.items():
                try:
                    fut.result()
                    ok[n] = True
                    self.stats.rpc_messages += len(todo[n].messages)
                    if reprogram:
                        self.stats.reprogrammed += len(todo[n].messages)
                except (grpc.RpcError, ValueError):  # ValueError: the channel was closed
                    self.stats.push_failures += 1
                    failed[n] = todo[n]
            todo = failed
            if not todo:
                break
            time.sleep(self.cfg.retry_backoff_s * (2 ** attempt))
        now = time.monotonic()
        with self._lock:
            for n, b in todo.items():  # unreachable after the retries: reprogram later
                ok[n] = False
                self._pending[n] = list(b.messages) + self._pending.get(n, [])
                if n not in self._unreachable_since:
                    self._unreachable_since[n] = now
                    log.warning("node %d: RPC endpoint unreachable; its messages wait", n)
            back = [n for n, good in ok.items() if good and n in self._unreachable_since]
            for n in back:
                del self._unreachable_since[n]
                self._relayed.pop(n, None)
        for n in todo:
            if self._unreachable_since.get(n) == now:
                self._event("unreachable", f"node {n}")
        for n in back:
            self._event("reachable", f"node {n}")
        return ok

    def _push_done(self, units: int, seq: int, _fut: Any) -> None:
        """A push call ended (answered, failed or cancelled): its C_p units go back and the
        probes behind it may be judged (:class:`delivery.health.RpcBacklog`)."""
        self._limiter.release(units)
        self._rpc_backlog.end(seq)

    def _reprogram_loop(self) -> None:
        while not self._stop.wait(self.cfg.reprogram_period_s):
            try:
                self.retry_subscribe_infos()
                self.reprogram_pending()
                self.relay_pending()
            except Exception:  # keep the thread: the next period tries again
                log.exception("reprogramming failed")

    @_dispatching
    def relay_pending(self) -> int:
        """Relay the queued messages of nodes unreachable over RPC for ``relay_after_s`` on
        the topic each is subscribed to with the fewest subscribers (a copy addressed to
        that node only: the other subscribers drop it as not for them). The originals stay
        queued (pushed later they are duplicates; a packed reply that confirms a relayed
        message removes it). Returns the messages relayed."""
        fo = self.cfg.failover
        if not (fo.enabled and fo.relay) or self._mq_down:
            return 0
        now = time.monotonic()
        subscribers: dict[int, int] = defaultdict(int)
        for topics in self.node_topics.values():
            for c in topics:
                subscribers[c] += 1
        sent = 0
        with self._lock:
            todo = {n: sorted(self._pending.get(n, []), key=lambda m: m.timestamp_ns)
                    for n, since in self._unreachable_since.items()
                    if now - since >= fo.relay_after_s and self.node_topics.get(n)}
        for n, ms in todo.items():
            c = min(self.node_topics[n], key=lambda c: (subscribers[c], c))
            if not self._relayed[n] and ms:
                log.warning("node %d: RPC endpoint unreachable for %.1f s; relaying its %d "
                            "queued messages on topic %d (%d subscribers)", n,
                            now - self._unreachable_since[n], len(ms), c, subscribers[c])
                self._event("relay", f"node {n} via topic {c}")
            for cm in ms:
                if cm.timestamp_ns in self._relayed[n]:
                    continue
                copy = pb.ConfigMessage()
                copy.CopyFrom(cm)
                del copy.hosts[:]
                copy.hosts.append(n)
                data = envelope(copy)
                self._publish(c, data)
                self._relayed[n].add(cm.timestamp_ns)
                self.stats.relayed += 1
                self.stats.relay_bytes += len(data)
                sent += 1
        return sent

    def reprogram_pending(self) -> int:
        """Re-send the queued messages of unreachable nodes (timestamp order); returns the
        number of nodes that took them."""
        with self._lock:
            batch = {n: sorted(ms, key=lambda m: m.timestamp_ns)
                     for n, ms in self._pending.items() if ms}
            self._pending.clear()
            # until this push is answered, a flush queues these nodes' new messages behind it
            # (pushed beside it, a newer message could overtake the queue: OUT_OF_ORDER drops)
            self._reprogramming.update(batch)
        if not batch:
            return 0
        for ms in batch.values():
            for m in ms:
                m.reprogram = True
        try:
            ok = self._push_all(batch, reprogram=True)
        finally:
            with self._lock:
                self._reprogramming.difference_update(batch)
        return sum(ok.values())

    def pending(self) -> dict[int, int]:
        """node -> messages queued for reprogramming."""
        with self._lock:
            return {n: len(ms) for n, ms in self._pending.items() if ms}

    def pending_subscribe_infos(self) -> dict[int, int]:
        """node -> SubscribeInfos queued until it answers."""
        with self._lock:
            return {n: len(v) for n, v in self._pending_infos.items() if v}

    # ------------------------------------------------------------------ packed replies
    def Report(self, request: Any, context: Any) -> Any:
        self._on_reply(request)
        return pb.ReportAck(acknowledged=self._acked[request.node_id])

    def _collect_loop(self) -> None:
        while not self._stop.wait(self.cfg.collect_period_s):
            try:
                self.collect()
            except Exception:  # keep the thread: the next period tries again
                log.exception("collecting packed replies failed")

    def collect(self) -> int:
        """Collect packed replies from every agent (concurrently); returns results taken.
        Then MQ messages that a node answering here has not confirmed for
        ``confirm_timeout_s``, while no MQ result came from it meanwhile (its subscription
        is not working), are re-sent to it over RPC."""
        if self._stop.is_set():
            return 0
        try:
            calls = {n: self._stub(n).Collect.future(
                pb.CollectRequest(acknowledged=self._acked[n]), timeout=self.cfg.push_timeout_s)
                for n in list(self.agents)}
        except (ValueError, RuntimeError):  # closed meanwhile
            return 0
        taken = 0
        answered = []
        for n, fut in calls.items():
            try:
                reply = fut.result()
            except grpc.RpcError:
                continue
            problem = reply_problem(reply, agent_principal(n))
            if problem is not None:  # whatever answers at node n's address is not node n
                self.stats.refused_calls += 1
                log.warning("controller refused the Collect answer of node %d at %s: %s", n,
                            self.agents[n], problem)
                continue
            taken += self._on_reply(reply)
            answered.append(n)
        self._rescue_mq(answered)
        return taken

    def _rescue_mq(self, nodes: Iterable[int]) -> int:
        fo = self.cfg.failover
        if not fo.enabled or self._mq_down:
            return 0
        now = time.monotonic()
        rescued = 0
        with self._lock:
            for n in nodes:
                waiting = self._mq_unconfirmed.get(n)
                if not waiting:
                    continue
                late = [(ts, cm) for ts, (at, cm) in waiting.items()
                        if now - at >= fo.confirm_timeout_s]
                heard = self._last_mq_result.get(n)
                if not late or (heard is not None and now - heard < fo.confirm_timeout_s):
                    continue
                for ts, cm in late:
                    del waiting[ts]
                    fix = pb.ConfigMessage()
                    fix.CopyFrom(cm)
                    fix.reprogram = True
                    self._pending[n].append(fix)
                rescued += len(late)
                log.warning("node %d answers RPC but confirmed none of %d MQ messages for "
                            "%.1f s: re-sent over RPC", n, len(late), fo.confirm_timeout_s)
        self.stats.mq_rescued += rescued
        return rescued

    def _on_reply(self, reply: Any) -> int:
        """Take a packed reply: count its results, confirm the outbox rows of what the node
        holds now (before the acknowledgement goes back), and queue MALFORMED fixes."""
        n = int(reply.node_id)
        fresh = [r for r in reply.results if r.result_seq > self._acked[n]]
        held = [int(r.timestamp_ns) for r in fresh
                if r.outcome in (pb.APPLIED, pb.DUPLICATE, pb.OUT_OF_ORDER)]
        if held and self.cfg.outbox:
            self.stats.outbox_confirmed += self.store.outbox_confirm((n, ts) for ts in held)
        redo: dict[int, list] = defaultdict(list)
        taken = 0
        now = time.monotonic()
        with self._lock:
            if held:
                done = set(held)
                waiting = self._mq_unconfirmed.get(n)
                if waiting:
                    for ts in done & waiting.keys():
                        del waiting[ts]
                if self._pending.get(n) and self._relayed.get(n):
                    self._pending[n] = [m for m in self._pending[n]
                                        if m.timestamp_ns not in done]
            for r in reply.results:
                if r.result_seq <= self._acked[n]:
                    continue
                self._acked[n] = r.result_seq
                taken += 1
                if r.channel != "rpc" and r.outcome != pb.MALFORMED:
                    self._last_mq_result[n] = now
                self.stats.outcomes[pb.Outcome.Name(r.outcome)] += 1
                if r.outcome in (pb.OUT_OF_ORDER, pb.MALFORMED):
                    self.stats.errors.append((n, pb.Outcome.Name(r.outcome), r.message_id,
                                              r.detail))
                if r.outcome == pb.MALFORMED:  # see the module docstring for OUT_OF_ORDER
                    cm = self._latest.get((r.vpc_id, r.configuration_type, r.resource_id))
                    if cm is not None and n in cm.hosts:
                        fix = pb.ConfigMessage()
                        fix.CopyFrom(cm)
                        fix.reprogram = True
                        fix.payload = cm.payload
                        redo[n].append(fix)
            for node, ms in redo.items():
                self._pending[node].extend(ms)
        return taken


# gRPC's default reconnect backoff grows to 120 s: an agent that was down for a while would
# stay unreachable (every call failing at once) long after it is back.
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000)]


def reply_problem(reply: Any, principal: str) -> str | None:
    """Why a packed reply may not be taken from ``principal`` (the certificate of whoever
    sent it, or of the node it was collected from), or None: it must be for that agent's
    own node, and so must each of its results."""
    if principal != agent_principal(reply.node_id):
        return f"the packed reply is for node {reply.node_id}, not {principal}'s"
    others = sorted({int(r.node_id) for r in reply.results if r.node_id != reply.node_id})
    if others:
        return f"the packed reply holds results of node(s) {others[:5]}, not only {principal}'s"
    return None

