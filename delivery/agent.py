"""The message agent of one compute node (SMART Section VI, Fig. 3).

Two listeners feed one order-preserving procedure:

* **RPC** (a gRPC ``MessageAgent`` server): configuration pushes from the controller,
  SubscribeInfo (Table II) and the controller's collection of packed replies;
* **MQ** (Apache Pulsar durable subscriptions, one consumer per subscribed topic): every
  message published on the topic, including the ones for other nodes (redundant traffic:
  counted, then dropped).

**Order preservation (VI-B).** A per-resource cache keeps the latest applied timestamp, with a
lock per resource: a message is applied only if it is newer; one the resource already took (a
redelivery: the same timestamp as one of the resource's last ``RECENT_APPLIED`` applied
messages) is dropped and reported ``DUPLICATE``, any other older one ``OUT_OF_ORDER``. "Applying"
(L2/L3 programming) is recorded, not executed: one line per applied message in the agent's
record file, written and flushed *before* the MQ acknowledgement, so a crash between the two
makes the broker redeliver a message the record already holds, and the restarted agent, which
rebuilds its cache from the record, drops it as a duplicate: applied exactly once.

**Lossless dynamic subscription (VI-A).** ``subscribe`` opens a durable subscription at once
(the controller waits for the acknowledgement before it publishes on the topic).
``unsubscribe`` does not drop the topic immediately: the agent keeps consuming it until a
message generated after the SubscribeInfo arrives on it (the controller publishes a fence on
the old topic for that), so nothing published before the switch is missed; then it records
the unsubscription and deletes the durable subscription (a crash between the two is found in
the record at the next start, which deletes it then). On start the agent reads its
subscriptions from the metadata store (step S-1), and also drains topics it was still
subscribed to according to its own record but which the store marks as unsubscribed while it
was down.

**Packed replies (VI-C).** Results are numbered and kept until the controller acknowledges
them: it collects them periodically (``Collect``); if it has not done so for
``report_after_s`` the agent sends them itself to the controller's ``ControllerReplies``
server.

A malformed message or SubscribeInfo is rejected, reported (``MALFORMED``) and the agent keeps
running. Many agents can share one process and one event loop (``delivery.agent_host``).

**Security** (``AgentConfig.security``, :class:`security.tls.Security`; secure by default).
The RPC server speaks mutual TLS with the node's identity ``agent-<n>`` and serves only the
controller: every method (``Push``, ``Subscribe``, ``Collect``) is authorised by
:class:`delivery.rpc.AioRoleGuard` for certificates of role ``controller``; any other caller
is refused before the servicer runs (``PERMISSION_DENIED``, one warning line, counted in
``Counters.refused_calls``). A client with no certificate, or one another CA signed, fails
the TLS handshake itself (it sees ``UNAVAILABLE``). Packed replies go to the controller over
mutual TLS with the same identity, and the node's Pulsar client authenticates as
``agent-<n>`` (:func:`security.pulsar.client_args`) on its own subscription
(:func:`security.pulsar.subscription_name`). ``insecure`` keeps plain channels (and warns at
every start).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from security.pulsar import client_args, subscription_name
from security.tls import Security, channel_credentials, pinned_options, server_credentials

from .health import security_setting
from .rpc import AioRoleGuard, pb, pb_grpc
from .store import MetadataStore
from .wire import WireError, check_config, check_subscribe, open_envelope, resource_key

__all__ = [
    "RECENT_APPLIED",
    "AgentConfig",
    "AppliedRow",
    "MessageAgent",
    "Record",
    "read_record",
]

log = logging.getLogger(__name__)

#: applied timestamps remembered per resource to tell a redelivery (DUPLICATE) from an older
#: message that arrived late (OUT_OF_ORDER)
RECENT_APPLIED = 16
REREPORT_S = 600.0      # at start, results of rows applied this recently are reported again
REREPORT_ROWS = 10_000  # (at most this many: the newest)

OUTCOME_NAMES = {pb.APPLIED: "applied", pb.OUT_OF_ORDER: "out_of_order",
                 pb.DUPLICATE: "duplicate", pb.MALFORMED: "malformed"}


@dataclass
class AgentConfig:
    node_id: int
    store_url: str
    record_dir: Path
    pulsar_url: str | None = None      # default MQ server (SubscribeInfo names its own url)
    controller: str | None = None      # host:port of the controller's ControllerReplies
    host: str = "127.0.0.1"
    port: int = 0
    pack_period_s: float = 0.2         # results of this period go into one packed reply
    report_after_s: float = 2.0        # send replies on its own if not collected by then
    receiver_queue: int = 100          # Pulsar consumer prefetch per topic
    fsync: bool = False                # fsync the record after each apply (slower)
    security: Security = field(default_factory=Security)  # or a {insecure, pki_dir} mapping

    def __post_init__(self) -> None:
        self.security = security_setting(self.security)

    @property
    def principal(self) -> str:
        """The node's identity (certificate common name, Pulsar role): ``agent-<n>``."""
        return f"agent-{int(self.node_id)}"


@dataclass(frozen=True)
class AppliedRow:
    """One line of the programming record: a message applied on this node."""

    message_id: int
    vpc_id: int
    configuration_type: str
    resource_id: int
    timestamp_ns: int
    channel: str
    applied_ns: int

    @property
    def resource(self) -> tuple[int, str, int]:
        return (self.vpc_id, self.configuration_type, self.resource_id)


class Record:
    """The agent's append-only record: ``A`` lines (applied messages) and ``S`` lines
    (subscription events), tab-separated, flushed per line (fsync optional)."""

    def __init__(self, path: Path, fsync: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f = open(path, "a", buffering=1 << 16)  # noqa: SIM115 kept open for appends until close()
        if self._f.tell() > 0:  # a crash mid-line: end the torn line, so that the next line
            with open(path, "rb") as f:  # is not glued to it (and lost with it)
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    self._f.write("\n")
                    self._f.flush()
        self._fsync = fsync
        self._lock = threading.Lock()

    def applied(self, cm: Any, channel: str, applied_ns: int) -> None:
        self._write(f"A\t{cm.message_id}\t{cm.vpc_id}\t{cm.configuration_type}\t"
                    f"{cm.resource_id}\t{cm.timestamp_ns}\t{channel}\t{applied_ns}\n")

    def subscription(self, topic: str, state: str, timestamp_ns: int) -> None:
        self._write(f"S\t{topic}\t{state}\t{timestamp_ns}\n")

    def _write(self, line: str) -> None:
        with self._lock:
            self._f.write(line)
            self._f.flush()
            if self._fsync:
                os.fsync(self._f.fileno())

    def close(self) -> None:
        with self._lock:
            self._f.close()


def read_record(path: Path) -> tuple[list[AppliedRow], dict[str, tuple[str, int]]]:
    """(applied rows in record order, topic -> (last subscription state, its timestamp)).
    A torn last line (a crash mid-write) is ignored."""
    rows: list[AppliedRow] = []
    subs: dict[str, tuple[str, int]] = {}
    if not path.is_file():
        return rows, subs
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break
            p = line[:-1].split("\t")
            try:
                if p[0] == "A" and len(p) == 8:
                    rows.append(AppliedRow(int(p[1]), int(p[2]), p[3], int(p[4]), int(p[5]),
                                           p[6], int(p[7])))
                elif p[0] == "S" and len(p) == 4:
                    subs[p[1]] = (p[2], int(p[3]))
            except ValueError:
                continue
    return rows, subs


@dataclass
class Counters:
    """What the node received (bytes on the wire, per channel) and what it did with it."""

    rx_bytes_rpc: int = 0
    rx_bytes_mq: int = 0
    rx_messages_rpc: int = 0
    rx_messages_mq: int = 0
    not_for_me: int = 0                # MQ messages for other nodes (redundant traffic)
    outcomes: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(OUTCOME_NAMES.values(), 0))
    subscribes: int = 0
    unsubscribes: int = 0
    replies_collected: int = 0
    replies_reported: int = 0
    refused_calls: int = 0             # RPC calls refused by the role check (mutual TLS)
    deferred_subscriptions: int = 0    # not attached at start (broker down): in the background
    rx_timeline: dict[int, int] = field(default_factory=dict)  # wall second -> bytes

    def received(self, nbytes: int) -> None:
        sec = int(time.time())
        self.rx_timeline[sec] = self.rx_timeline.get(sec, 0) + nbytes

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["outcomes"] = dict(self.outcomes)
        d["rx_timeline"] = {str(k): v for k, v in self.rx_timeline.items()}
        return d


class MessageAgent(pb_grpc.MessageAgentServicer):
    def __init__(self, cfg: AgentConfig, clients: PulsarClients) -> None:
        self.cfg = cfg
        self.node_id = int(cfg.node_id)
        self.clients = clients
        self.store = MetadataStore(cfg.store_url)
        self.record = Record(Path(cfg.record_dir) / f"node-{self.node_id}.record", cfg.fsync)
        self.counters = Counters()
        self._latest: dict[tuple, int] = {}
        self._recent: dict[tuple, set[int]] = {}  # resource -> its last applied timestamps
        self._locks: dict[tuple, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._consumers: dict[str, Any] = {}
        self._draining: dict[str, int] = {}
        self._sub_guard = threading.Lock()
        self._topic_locks: dict[str, threading.Lock] = {}  # subscribe vs finish-unsubscribe
        self._results: deque = deque()  # ProgrammingResult, numbered, until acknowledged
        self._results_guard = threading.Lock()
        # Result numbers go on across restarts (they start at the wall clock in ns): a restarted
        # agent numbering from 1 again would have its results dropped by the controller as
        # repeats (and popped by its next Collect) until it passed the old numbers.
        self._result_seq = time.time_ns()
        self._last_collect = time.monotonic()
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task] = []
        self._reply_channel: grpc.aio.Channel | None = None
        self.port = cfg.port
        self.guard: AioRoleGuard | None = None  # the role check (secure mode)
        self._creds: tuple[Any, Any] = (None, None)  # (server, channel) credentials
        self._closed = False
        # False: the broker did not answer just now (the agent host's priming); subscriptions
        # are attached in the background from the start
        self.broker_reachable = True

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> int:
        """Recover (record, then the store's subscriptions), then serve RPC. Returns the port."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._recover)
        insecure = self.cfg.security.warn_if_insecure(f"agent {self.node_id}")
        if not insecure:
            self._creds = await loop.run_in_executor(None, self._credentials)
            self.guard = AioRoleGuard(f"agent {self.node_id}", {"controller"},
                                      on_refuse=self._refused)
        await self.serve()
        if self.cfg.controller:
            self._reply_channel = (
                grpc.aio.insecure_channel(self.cfg.controller) if insecure
                else grpc.aio.secure_channel(self.cfg.controller, self._creds[1],
                                             options=pinned_options("controller")))
            self._tasks.append(asyncio.create_task(self._report_loop()))
        return self.port

    async def serve(self) -> int:
        """(Re)open the RPC server on its port (``cfg.port`` at :meth:`start`, the one bound
        then when serving again: the fault tests stop it and serve again); returns it."""
        address = f"{self.cfg.host}:{self.port}"
        if self.cfg.security.insecure:
            server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            pb_grpc.add_MessageAgentServicer_to_server(self, server)
            port = server.add_insecure_port(address)
        else:
            if self.guard is None:
                raise WireError(f"agent {self.cfg.node_id}: serve() before start(): no "
                                f"credentials or role check yet")
            server = grpc.aio.server(options=[("grpc.so_reuseport", 0)],
                                     interceptors=[self.guard])
            pb_grpc.add_MessageAgentServicer_to_server(self, server)
            port = server.add_secure_port(address, self._creds[0])
        if port == 0:
            raise OSError(f"node {self.node_id}: cannot bind {address}")
        await server.start()
        self._server, self.port = server, port
        return port

    def _credentials(self) -> tuple[Any, Any]:
        """(server, channel) credentials of this node's identity ``agent-<n>``."""
        ident = self.cfg.security.agent(self.node_id)
        return server_credentials(ident), channel_credentials(ident)

    def _refused(self) -> None:
        self.counters.refused_calls += 1

    async def stop(self, grace: float | None = 0.5) -> None:
        self._closed = True
        for t in self._tasks:
            t.cancel()
        if self._server is not None:
            await self._server.stop(grace)
        if self._reply_channel is not None:
            await self._reply_channel.close()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._close_consumers)
        self.record.close()
        self.store.close()

    def _close_consumers(self) -> None:
        with self._sub_guard:
            consumers, self._consumers = dict(self._consumers), {}
        for c in consumers.values():
            with contextlib.suppress(Exception):  # already closed by a broker restart, ...
                c.close()

    def _recover(self) -> None:
        rows, local_subs = read_record(self.record.path)
        for r in rows:
            k = r.resource
            if r.timestamp_ns > self._latest.get(k, 0):
                self._latest[k] = r.timestamp_ns
            self._remember(k, r.timestamp_ns)
        # The results of the last applies may have died with the previous process before the
        # controller collected them: reported again (as DUPLICATE: already applied), so their
        # outbox rows are confirmed now, not at the controller's next restart.
        since = time.time_ns() - int(REREPORT_S * 1e9)
        for r in rows[-REREPORT_ROWS:]:
            if r.applied_ns >= since:
                self._result(r.message_id, r.resource_id, r.vpc_id, r.configuration_type,
                             r.timestamp_ns, pb.DUPLICATE, r.channel, "applied before a restart")
        stored = self.store.subscriptions_of(self.node_id)
        active = {s.topic for s in stored if s.active}
        for topic, (state, at) in local_subs.items():
            # recorded as unsubscribed, but it crashed before deleting it (unless the store
            # has it subscribed again: that subscription may hold a backlog)
            if state == "unsubscribed" and topic not in active:
                self._delete_subscription(topic, at)
        deferred: list[tuple[str, str]] = []
        for s in stored:
            state, at = local_subs.get(s.topic, (None, 0))
            if s.active:
                self._subscribe_at_start(s.topic, s.subscription, deferred)
                if state != "subscribed":  # e.g. subscribed by the store while it was down
                    self.record.subscription(s.topic, "subscribed", s.since_ns)
            elif not (state in ("unsubscribed", "deleted") and at >= s.until_ns):
                # unsubscribed while this agent was down (and not drained since; it may never
                # have heard of the subscription: the controller created it on the broker
                # while the agent was down): drain what was published before. The drain is
                # registered and recorded before the consumer attaches: its backlog may
                # hold the fence, and the listener ends the drain (recording "deleted") as
                # soon as it reads it.
                with self._sub_guard:
                    self._drain_locked(s.topic, s.until_ns)
                self._subscribe_at_start(s.topic, s.subscription, deferred)
        if deferred:
            self.counters.deferred_subscriptions += len(deferred)
            threading.Thread(target=self._resubscribe, args=(deferred,), daemon=True,
                             name=f"agent-{self.node_id}-resubscribe").start()

    def _subscribe_at_start(self, topic: str, subscription: str,
                            deferred: list[tuple[str, str]]) -> None:
        """Attach to a durable subscription at start; if the broker does not answer (down or
        unreachable), this and the remaining ones are left to :meth:`_resubscribe`, so the
        agent serves RPC meanwhile (its durable subscriptions keep what is published)."""
        if not deferred and self.broker_reachable:
            try:
                self._subscribe(topic, subscription, self.cfg.pulsar_url)
                return
            except Exception as e:  # pulsar raises its own exception types
                log.warning("node %d: subscribing %s at start failed (%s); the broker's "
                            "subscriptions are attached in the background", self.node_id,
                            topic, e)
        deferred.append((topic, subscription))

    def _resubscribe(self, pending: list[tuple[str, str]]) -> None:
        """Attach the subscriptions the start could not (backing off to 10 s between
        rounds), unless the store no longer has one active and it is not being drained
        (a SubscribeInfo meanwhile ended it)."""
        delay = 1.0
        while pending and not self._closed:
            time.sleep(delay)
            delay = min(2 * delay, 10.0)
            try:
                active = {s.topic for s in self.store.subscriptions_of(self.node_id)
                          if s.active}
            except Exception as e:  # the store itself is unavailable: the next round
                log.warning("node %d: reading the store: %s", self.node_id, e)
                continue
            left = []
            for topic, subscription in pending:
                if self._closed:
                    return
                if topic not in active and topic not in self._draining:
                    continue
                try:
                    self._subscribe(topic, subscription, self.cfg.pulsar_url)
                    log.info("node %d: subscribed to %s after the start", self.node_id, topic)
                except Exception:
                    left.append((topic, subscription))
            pending = left

    def _drain_locked(self, topic: str, until: int) -> None:
        """Drain ``topic`` up to its fence ``until`` (the caller holds ``_sub_guard``):
        registered and recorded in one step, so the listener's "unsubscribed"/"deleted"
        (written after it takes the drain off under the same guard) always follow
        "draining" in the record."""
        self._draining[topic] = until
        self.record.subscription(topic, "draining", until)

    def _delete_subscription(self, topic: str, at: int) -> None:
        """Delete this node's durable subscription of ``topic`` (attaching to it first)."""
        import pulsar

        try:
            c = self._client(self.cfg.pulsar_url).subscribe(
                topic, subscription_name(self.node_id),
                consumer_type=pulsar.ConsumerType.Exclusive,
                receiver_queue_size=1)
            c.unsubscribe()
            self.record.subscription(topic, "deleted", at)
        except Exception as e:  # the broker is down: the next start tries again
            log.warning("node %d: deleting the subscription of %s: %s", self.node_id, topic, e)

    # ------------------------------------------------------------------ order preservation
    def _remember(self, key: tuple, ts: int) -> None:
        recent = self._recent.setdefault(key, set())
        recent.add(ts)
        if len(recent) > RECENT_APPLIED:
            recent.discard(min(recent))
    def _lock_for(self, key: tuple) -> threading.Lock:
        lock = self._locks.get(key)
        if lock is None:
            with self._locks_guard:
                lock = self._locks.setdefault(key, threading.Lock())
        return lock

    def handle(self, cm: Any, channel: str) -> int | None:
        """Apply ``cm`` if it is for this node and newer than its resource's latest; returns
        the outcome (None: not for this node)."""
        try:
            check_config(cm)
        except WireError as e:
            self._result(cm.message_id, 0, 0, "", 0, pb.MALFORMED, channel, str(e))
            return pb.MALFORMED
        if self.node_id not in cm.hosts:
            self.counters.not_for_me += 1
            return None
        key = resource_key(cm)
        with self._lock_for(key):
            last = self._latest.get(key, 0)
            if cm.timestamp_ns > last:
                now = time.time_ns()
                self.record.applied(cm, channel, now)
                self._latest[key] = cm.timestamp_ns
                self._remember(key, cm.timestamp_ns)
                outcome, detail = pb.APPLIED, ""
            elif cm.timestamp_ns in self._recent.get(key, ()):
                outcome, detail = pb.DUPLICATE, "already applied"
            else:
                outcome, detail = pb.OUT_OF_ORDER, f"resource is at {last}"
        self._result(cm.message_id, cm.resource_id, cm.vpc_id, cm.configuration_type,
                     cm.timestamp_ns, outcome, channel, detail)
        return outcome

    def _result(self, message_id: int, resource_id: int, vpc_id: int, config: str, ts: int,
                outcome: int, channel: str, detail: str) -> None:
        self.counters.outcomes[OUTCOME_NAMES[outcome]] += 1
        with self._results_guard:
            self._result_seq += 1
            self._results.append(pb.ProgrammingResult(
                message_id=message_id, resource_id=resource_id, vpc_id=vpc_id,
                configuration_type=config, timestamp_ns=ts, outcome=outcome, channel=channel,
                applied_ns=time.time_ns(), detail=detail[:200], result_seq=self._result_seq,
                node_id=self.node_id))

    # ------------------------------------------------------------------ MQ channel
    def _client(self, url: str | None) -> Any:
        """The Pulsar client of ``url`` with this node's identity."""
        return self.clients.get(url, self.cfg.security, self.cfg.principal)

    def _topic_lock(self, topic: str) -> threading.Lock:
        with self._sub_guard:
            return self._topic_locks.setdefault(topic, threading.Lock())

    def _subscribe(self, topic: str, subscription: str, url: str | None) -> None:
        with self._topic_lock(topic):  # not while a finished drain deletes the subscription
            self._subscribe_locked(topic, subscription, url)

    def _subscribe_locked(self, topic: str, subscription: str, url: str | None) -> None:
        import pulsar

        with self._sub_guard:
            if topic in self._consumers:
                return
        # The broker call runs outside _sub_guard (the topic's lock serialises it): the RPC
        # handlers take _sub_guard on the event loop that many agents share.
        client = self._client(url or self.cfg.pulsar_url)
        # Exclusive, not Failover: on the standalone broker a Failover subscription's
        # messages reach the consumer an order of magnitude later than an Exclusive one's
        # (hundreds of ms); a crashed agent's connection closes with its process,
        # so the restarted agent gets the subscription back.
        consumer = client.subscribe(
            topic, subscription, consumer_type=pulsar.ConsumerType.Exclusive,
            message_listener=lambda c, m, t=topic: self._on_mq(c, m, t),
            receiver_queue_size=self.cfg.receiver_queue,
            initial_position=pulsar.InitialPosition.Latest,
            consumer_name=f"node-{self.node_id}")
        with self._sub_guard:
            self._consumers[topic] = consumer

    def _on_mq(self, consumer: Any, msg: Any, topic: str) -> None:
        data = msg.data()
        self.counters.rx_bytes_mq += len(data)
        self.counters.received(len(data))
        self.counters.rx_messages_mq += 1
        try:
            opened = open_envelope(data)
        except WireError as e:
            self._result(0, 0, 0, "", 0, pb.MALFORMED, topic, str(e))
            consumer.acknowledge(msg)
            return
        if opened.config is not None:
            outcome = self.handle(opened.config, topic)
            # a malformed message's timestamp means nothing: it must not end a drain
            ts = 0 if outcome == pb.MALFORMED else opened.config.timestamp_ns
        else:
            ts = opened.fence_ns
        consumer.acknowledge(msg)  # after the record: a crash before this is a redelivery
        until = self._draining.get(topic)
        if until is not None and ts >= until:
            threading.Thread(target=self._finish_unsubscribe, args=(topic, until),
                             daemon=True).start()

    def _finish_unsubscribe(self, topic: str, until: int) -> None:
        # Under the topic's lock: a SubscribeInfo re-subscribing the topic meanwhile would
        # otherwise attach while the old consumer still holds the Exclusive subscription or
        # is deleting it (its subscribe then times out and the agent never reads the topic).
        with self._topic_lock(topic):
            self._finish_unsubscribe_locked(topic, until)

    def _finish_unsubscribe_locked(self, topic: str, until: int) -> None:
        with self._sub_guard:
            if self._draining.get(topic) != until:  # re-subscribed meanwhile
                return
            del self._draining[topic]
            consumer = self._consumers.pop(topic, None)
        # recorded first: a crash before the deletion below then finds "unsubscribed" (not
        # "deleted") at the next start and deletes it; the other order would leave the agent
        # draining a topic whose fence it already consumed, for ever
        self.record.subscription(topic, "unsubscribed", until)
        self.counters.unsubscribes += 1
        if consumer is not None:
            try:
                consumer.unsubscribe()  # deletes the durable subscription
                self.record.subscription(topic, "deleted", until)
            except Exception as e:
                log.warning("node %d: unsubscribe %s: %s", self.node_id, topic, e)
                with contextlib.suppress(Exception):
                    consumer.close()

    # ------------------------------------------------------------------ RPC servicer
    async def Push(self, request: Any, context: Any) -> Any:
        self.counters.rx_bytes_rpc += request.ByteSize()
        self.counters.received(request.ByteSize())
        accepted = rejected = 0
        for cm in request.messages:
            self.counters.rx_messages_rpc += 1
            if self.handle(cm, "rpc") == pb.MALFORMED:
                rejected += 1
            else:
                accepted += 1
        return pb.PushAck(accepted=accepted, rejected=rejected)

    async def Subscribe(self, request: Any, context: Any) -> Any:
        self.counters.rx_bytes_rpc += request.ByteSize()
        try:
            check_subscribe(request)
        except WireError as e:
            self._result(0, 0, 0, "", request.timestamp_ns, pb.MALFORMED, "rpc", str(e))
            return pb.SubscribeAck(ok=False, error=str(e))
        topic = request.topic
        if request.operation:
            with self._sub_guard:
                cancelled = self._draining.pop(topic, None) is not None
                present = topic in self._consumers
            if not present:
                loop = asyncio.get_running_loop()
                try:
                    await loop.run_in_executor(None, self._subscribe, topic,
                                               request.subscription, request.url)
                except Exception as e:  # broker down, bad topic name, ...
                    return pb.SubscribeAck(ok=False, error=f"subscribe {topic}: {e}")
            if not present or cancelled:
                self.counters.subscribes += 1
                self.record.subscription(topic, "subscribed", request.timestamp_ns)
        else:
            with self._sub_guard:
                if topic in self._consumers:
                    self._drain_locked(topic, request.timestamp_ns)
        return pb.SubscribeAck(ok=True)

    async def Collect(self, request: Any, context: Any) -> Any:
        self._last_collect = time.monotonic()
        self.counters.replies_collected += 1
        return self._pack(request.acknowledged)

    def _pack(self, acknowledged: int) -> Any:
        with self._results_guard:
            while self._results and self._results[0].result_seq <= acknowledged:
                self._results.popleft()
            results = list(self._results)
        return pb.PackedReply(node_id=self.node_id, results=results,
                              sequence=results[-1].result_seq if results else acknowledged,
                              sent_ns=time.time_ns())

    async def _report_loop(self) -> None:
        stub = pb_grpc.ControllerRepliesStub(self._reply_channel)
        acked = 0
        while not self._closed:
            await asyncio.sleep(self.cfg.pack_period_s)
            if time.monotonic() - self._last_collect < self.cfg.report_after_s:
                continue
            reply = self._pack(acked)
            if not reply.results:
                continue
            try:
                ack = await stub.Report(reply, timeout=2.0)
            except grpc.aio.AioRpcError:
                continue  # the controller is down: keep the results, try again later
            acked = max(acked, ack.acknowledged)
            self._pack(acked)
            self.counters.replies_reported += 1

    # ------------------------------------------------------------------ views
    def pending_results(self) -> int:
        with self._results_guard:
            return len(self._results)

    def topics(self) -> dict[str, str]:
        with self._sub_guard:
            return {t: ("draining" if t in self._draining else "subscribed")
                    for t in self._consumers}


class PulsarClients:
    """One Pulsar client per service URL and identity: shared by the agents of a process
    when insecure, one per agent when secure (each authenticates as its own node, the role
    the broker authorises for that node's subscriptions only)."""

    def __init__(self, default_url: str | None, listener_threads: int = 1,
                 per_agent: bool = False) -> None:
        self.default_url = default_url
        self.per_agent = per_agent  # one client per agent also when insecure (netem)
        self._clients: dict[tuple[str, Security, str | None], Any] = {}
        self._lock = threading.Lock()
        self._threads = listener_threads

    def get(self, url: str | None, security: Security | None = None,
            principal: str | None = None) -> Any:
        """The client of ``url`` (default: the host's) authenticated as ``principal`` under
        ``security`` (None: the secure default; insecure: one shared plain client)."""
        import pulsar

        url = url or self.default_url
        if url is None:
            raise WireError("no Pulsar URL configured for this agent")
        security = security or Security()
        if principal is None and not security.insecure:
            raise WireError("a secure Pulsar client needs the principal it authenticates as")
        key = (url, security, None if security.insecure and not self.per_agent else principal)
        with self._lock:
            c = self._clients.get(key)
            if c is None:
                if not security.insecure and not url.startswith("pulsar+ssl://"):
                    log.warning("%s: security is on but the Pulsar URL %r is not "
                                "pulsar+ssl://: neither encrypted nor authenticated",
                                principal, url)
                c = self._clients[key] = pulsar.Client(
                    url, operation_timeout_seconds=10, message_listener_threads=self._threads,
                    logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error),
                    **client_args(security, principal or ""))
            return c

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                with contextlib.suppress(Exception):
                    c.close()
            self._clients.clear()
