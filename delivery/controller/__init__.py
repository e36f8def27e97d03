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

import itertools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Any

import grpc

from security.pki import agent_principal
from security.pulsar import NodeSubscriptionGrants, client_args
from security.tls import (
    SecurityError,
    channel_credentials,
    pinned_options,
    server_credentials,
)

from ..fairness import TenantShaper
from ..health import (
    ConfigError,
    MqHealth,
    RateWindow,
    RpcBacklog,
    close_in_background,
)
from ..rpc import RoleGuard, pb, pb_grpc
from ..store import MetadataStore
from ..wire import (
    Payloads,
    WireError,
    check_config,
    resource_key,
)
from .failover import FailoverMixin
from .replies import RepliesMixin, reply_problem
from .sending import SendingMixin
from .support import (
    RPC,
    ControllerConfig,
    ControllerStats,
    InflightLimiter,
    TopicRefused,
    _Creation,
    id_ranges,
    topic_channel,
    topic_name,
)
from .switching import SwitchingMixin

__all__ = ["RPC", "ConfigError", "Controller", "ControllerConfig", "ControllerStats",
           "InflightLimiter", "TopicRefused", "id_ranges", "reply_problem", "topic_channel",
           "topic_name"]

log = logging.getLogger(__name__)

PRODUCER_RETRY_S = 5.0   # a topic that refused a producer is not asked again sooner
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000)]


class Controller(SwitchingMixin, SendingMixin, FailoverMixin, RepliesMixin,
                 pb_grpc.ControllerRepliesServicer):
    """The controller's delivery side (module docstring): its state and life (start,
    recovery, close), its connections to the agents and its producers; switching,
    sending, failover and replies are the mixins' (:mod:`.switching`, :mod:`.sending`,
    :mod:`.failover`, :mod:`.replies`)."""

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
