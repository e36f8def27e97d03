"""The SMART controller's delivery side (Fig. 1, steps P-1 to P-3 and the replies of S-4).

It receives configuration requests as Table I messages, hands them to the parser of the
controller adapter (destination-hash batching, per-interval rate estimation), and at every
interval asks a :class:`~delivery.policies.ChannelPolicy` for each type's channel (the learned
policy through the adapter in remote or cached mode, or a baseline). A change of channels is
carried out losslessly:

1. the topic mapping and the new subscriptions go to the metadata store (P-2), in one
   transaction;
2. agents that must subscribe get a SubscribeInfo over RPC, and the controller waits for their
   acknowledgement before it publishes on the topic (an agent that cannot be reached gets its
   durable subscription created by the controller instead, so it finds the backlog when it
   comes back and reads the store, and its SubscribeInfos wait in order in a per-node queue
   that the reprogramming thread sends once it answers: an agent whose RPC endpoint was
   unreachable for a while without a restart then subscribes too; a node known to be
   unreachable is not waited for at all, so it does not stall the switch);
3. the new channels take effect;
4. agents that no longer need a topic get an unsubscribing SubscribeInfo and the controller
   publishes a fence on that topic: the agent drains the topic up to the fence, then leaves
   (an unsubscribing SubscribeInfo sent late from the queue gets a fence of its own).

Messages then go out by their type's channel: RPC pushes (one ``Push`` per destination node
and flush, batched, concurrent) or one publish on the type's topic (one producer per topic,
``block_if_queue_full`` so nothing is dropped). A push that fails is retried
(``push_retries``, with backoff); then the node is marked unreachable and its RPC messages
wait, in timestamp order, in a per-node queue that a background thread re-sends
("reprogramming") until the node answers again. Packed replies are collected periodically and
also accepted when agents send them on their own (``ControllerReplies``); a ``MALFORMED``
result makes the controller re-send the resource's latest message to that node over RPC. An
``OUT_OF_ORDER`` result is recorded (``stats.errors``) and nothing is re-sent: the node
already holds a newer state of the resource, and a re-sent newest message could overtake the
MQ messages still in flight to it, which would then be dropped in turn.

The controller counts what it sends (bytes and messages per channel, SubscribeInfo and
fences), which the testbed reports beside the process CPU time.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

from envs.dsmd.message import Message

from .rpc import pb, pb_grpc
from .store import MetadataStore, SubscriptionChange
from .wire import Payloads, encode, envelope, fence_envelope, resource_key

__all__ = ["Controller", "ControllerConfig", "ControllerStats", "topic_name"]

log = logging.getLogger(__name__)
RPC = 0


def topic_name(prefix: str, t: int) -> str:
    """The Pulsar topic of MQ channel ``t`` (1..K)."""
    return f"{prefix}-t{t}"


@dataclass
class ControllerConfig:
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
    payload_scale: float = 1.0


@dataclass
class ControllerStats:
    """What the controller sent and heard back (Section VII-B metrics 1-2)."""

    rpc_bytes: int = 0
    rpc_messages: int = 0          # one per destination node
    rpc_pushes: int = 0            # Push calls (batches)
    mq_bytes: int = 0
    mq_messages: int = 0           # one per publish
    fences: int = 0
    subscribe_infos: int = 0
    subscribe_failures: int = 0
    push_failures: int = 0
    reprogrammed: int = 0          # messages re-sent to nodes after failures or errors
    republished: int = 0           # publishes that failed and were sent again
    channel_changes: int = 0
    outcomes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    errors: list[tuple[int, str, int, str]] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "errors"}
        d["outcomes"] = dict(self.outcomes)
        d["errors"] = len(self.errors)
        return d


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


class Controller(pb_grpc.ControllerRepliesServicer):
    def __init__(self, cfg: ControllerConfig, agents: dict[int, str], *,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.cfg = cfg
        self.agents = dict(agents)  # node id -> "host:port"
        self.store = MetadataStore(cfg.store_url)
        self.payloads = Payloads(cfg.payload_scale)
        self.stats = ControllerStats()
        self.channel: dict[int, int] = {}
        self.hosts: dict[int, tuple[int, ...]] = {}
        self.node_topics: dict[int, set[int]] = defaultdict(set)
        self._clock, self._last_ts = clock, 0
        self._lock = threading.RLock()
        self._dispatch = threading.RLock()  # see _dispatching
        self._outbox: dict[int, list] = defaultdict(list)     # to push at the next flush
        self._pending: dict[int, list] = defaultdict(list)    # unreachable nodes' messages
        # and the unreachable nodes' (channel, SubscribeInfo) pairs
        self._pending_infos: dict[int, list] = defaultdict(list)
        self._reprogramming: set[int] = set()                  # nodes whose queue is in flight
        self._latest: dict[tuple, Any] = {}                   # resource -> newest message
        self._acked: dict[int, int] = defaultdict(int)        # node -> last result_seq
        self._channels: dict[int, grpc.Channel] = {}
        self._stubs: dict[int, Any] = {}
        self._producers: dict[int, Any] = {}
        self._republish: list[tuple[int, bytes]] = []          # failed publishes
        self._client = None
        self._server: grpc.Server | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.reply_port = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Controller:
        import pulsar

        self._client = pulsar.Client(self.cfg.pulsar_url, operation_timeout_seconds=15,
                                     logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_ControllerRepliesServicer_to_server(self, self._server)
        self.reply_port = self._server.add_insecure_port(
            f"{self.cfg.reply_host}:{self.cfg.reply_port}")
        self._server.start()
        for target, name in ((self._reprogram_loop, "reprogram"),
                             (self._collect_loop, "collect")):
            t = threading.Thread(target=target, name=f"controller-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    @property
    def reply_address(self) -> str:
        return f"{self.cfg.reply_host}:{self.reply_port}"

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)
        for p in self._producers.values():
            try:
                p.flush()
                p.close()
            except Exception:
                pass
        if self._client is not None:
            self._client.close()
        if self._server is not None:
            self._server.stop(0.5).wait()
        for ch in self._channels.values():
            ch.close()
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

    def _stub(self, node: int) -> Any:
        s = self._stubs.get(node)
        if s is None:
            with self._lock:  # the collect, reprogram and sending threads all get stubs
                s = self._stubs.get(node)
                if s is None:
                    ch = self._channels[node] = grpc.insecure_channel(
                        self.agents[node], options=_CHANNEL_OPTIONS)
                    s = self._stubs[node] = pb_grpc.MessageAgentStub(ch)
        return s

    def _producer(self, t: int) -> Any:
        p = self._producers.get(t)
        if p is None:
            p = self._producers[t] = self._client.create_producer(
                topic_name(self.cfg.topic_prefix, t), block_if_queue_full=True,
                max_pending_messages=10_000, batching_enabled=True,
                batching_max_publish_delay_ms=1)
        return p

    # ------------------------------------------------------------------ channels
    @_dispatching
    def set_channels(self, channels: dict[int, int], hosts: dict[int, Iterable[int]]) -> dict:
        """Make ``channels`` (type -> 0 = RPC or topic 1..K) current, losslessly (see the
        module docstring); ``hosts`` gives the destinations of every type named. Returns what
        changed."""
        for t, hs in hosts.items():
            self.hosts[int(t)] = tuple(int(h) for h in hs)
        changed = {int(t): int(c) for t, c in channels.items()
                   if self.channel.get(int(t)) != int(c)}
        if not changed:
            return {"types": 0, "subscribe": 0, "unsubscribe": 0}
        new_channel = {**self.channel, **changed}
        wanted: dict[int, set[int]] = defaultdict(set)
        for t, c in new_channel.items():
            if c != RPC:
                for n in self.hosts[t]:
                    wanted[n].add(c)
        subs = [(n, c) for n in wanted for c in wanted[n] - self.node_topics.get(n, set())]
        unsubs = [(n, c) for n in list(self.node_topics)
                  for c in self.node_topics[n] - wanted.get(n, set())]
        ts = self.timestamp()
        pre = self.cfg.topic_prefix
        self.store.write_mapping([(t, c, topic_name(pre, c) if c else None, self.hosts[t])
                                  for t, c in changed.items()], ts)
        self.store.apply_changes(
            [SubscriptionChange(n, topic_name(pre, c), _subscription(n), True) for n, c in subs]
            + [SubscriptionChange(n, topic_name(pre, c), _subscription(n), False)
               for n, c in unsubs], ts)
        self._send_subscribe_infos(subs, ts, True)
        self.flush()  # messages decided under the old channels go out first
        with self._lock:
            self.channel = new_channel
            self.node_topics = defaultdict(set, {n: set(v) for n, v in wanted.items()})
            self.stats.channel_changes += len(changed)
        if unsubs:
            # Wait for the acknowledgements: a gRPC future that is dropped unanswered is
            # cancelled when garbage-collected (the agent never hears of the unsubscription),
            # and a fence that overtakes the SubscribeInfo would leave the agent draining.
            self._send_subscribe_infos(unsubs, ts, False)
            fence = fence_envelope(self.timestamp())
            for c in sorted({c for _, c in unsubs}):
                self._publish(c, fence)
                self.stats.fences += 1
        return {"types": len(changed), "subscribe": len(subs), "unsubscribe": len(unsubs)}

    def _send_subscribe_infos(self, pairs: list[tuple[int, int]], ts: int,
                              subscribe: bool) -> None:
        """Send (and wait for) the SubscribeInfos of ``pairs`` (node, channel); failures are
        queued (see the module docstring)."""
        calls, failed = [], []
        for n, c in pairs:
            info = pb.SubscribeInfo(url=self.cfg.pulsar_url, topic=topic_name(
                self.cfg.topic_prefix, c), subscription=_subscription(n), timestamp_ns=ts,
                operation=subscribe)
            self.stats.subscribe_infos += 1
            with self._lock:
                known_down = bool(self._pending.get(n) or self._pending_infos.get(n))
            if known_down:  # do not wait for it: queue it behind the node's earlier ones
                failed.append((n, c, info, "node unreachable"))
                continue
            self.stats.rpc_bytes += info.ByteSize()
            # wait_for_ready: a channel in reconnect backoff (the agent was not up at a
            # Collect a moment ago) would fail it at once, and an agent that misses a
            # SubscribeInfo while it runs never consumes the topic
            calls.append((n, c, info, self._stub(n).Subscribe.future(
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
        """Send the queued SubscribeInfos of nodes that answer again, in order (a node's queue
        stops at its first failure). An unsubscription sent this way gets a fence of its own:
        the one of its switch may have gone by. Runs under the dispatch lock, so no switch
        changes a queue meanwhile, and only for nodes whose channel is ready (a node still
        down costs a 0.2 s probe, not a blocked dispatcher). Returns the number sent."""
        with self._lock:
            nodes = [n for n, infos in self._pending_infos.items() if infos]
        sent = 0
        for n in nodes:
            self._stub(n)
            try:
                grpc.channel_ready_future(self._channels[n]).result(timeout=0.2)
            except grpc.FutureTimeoutError:
                continue
            with self._dispatch:
                while True:
                    with self._lock:
                        if not self._pending_infos[n]:
                            break
                        c, info = self._pending_infos[n][0]
                    try:
                        ack = self._stub(n).Subscribe(info, timeout=self.cfg.push_timeout_s)
                    except grpc.RpcError:
                        break
                    if not ack.ok:  # e.g. the broker is down: try again later
                        log.warning("node %d: queued SubscribeInfo %s: %s", n, info.topic,
                                    ack.error)
                        break
                    self.stats.rpc_bytes += info.ByteSize()
                    sent += 1
                    with self._lock:
                        self._pending_infos[n].pop(0)
                    if not info.operation:
                        self._publish(c, fence_envelope(self.timestamp()))
                        self.stats.fences += 1
        return sent

    def _ensure_subscription(self, topic: str, subscription: str) -> None:
        import pulsar

        try:
            c = self._client.subscribe(topic, subscription,
                                       consumer_type=pulsar.ConsumerType.Exclusive,
                                       receiver_queue_size=1,
                                       initial_position=pulsar.InitialPosition.Latest)
            c.close()
        except Exception as e:  # the agent's own consumer holds it already, ...
            log.info("durable subscription %s on %s: %s", subscription, topic, e)

    # ------------------------------------------------------------------ messages
    @_dispatching
    def send(self, msg: Message, type_id: int) -> None:
        """Dispatch one Table I message of type ``type_id`` by the type's current channel
        (RPC messages leave at the next :meth:`flush`)."""
        c = self.channel.get(int(type_id), RPC)
        if int(type_id) not in self.hosts:
            self.hosts[int(type_id)] = tuple(msg.hosts)
        cm = encode(msg, type_id, self.payloads.of(msg.size_bytes))
        with self._lock:
            self._latest[resource_key(cm)] = cm
            if c == RPC:
                for n in msg.hosts:
                    self._outbox[n].append(cm)
                return
        self._publish(c, envelope(cm))
        self.stats.mq_messages += 1

    def _publish(self, t: int, data: bytes) -> None:
        self.stats.mq_bytes += len(data)
        self._producer(t).send_async(data, lambda res, _id: self._published(res, t, data))

    def _published(self, res: Any, t: int, data: bytes) -> None:
        import pulsar

        if res != pulsar.Result.Ok:  # e.g. the broker was down past the send timeout
            log.warning("publish on topic %d failed (%s); it will be published again", t, res)
            with self._lock:
                self._republish.append((t, data))

    @_dispatching
    def flush(self) -> None:
        """Push every queued RPC message (one batch per node, all nodes concurrently) and
        flush the producers."""
        with self._lock:
            again, self._republish = self._republish, []
            outbox, self._outbox = self._outbox, defaultdict(list)
            for n in list(outbox):
                if (self._pending.get(n) or n in self._reprogramming
                        or n not in self.agents):  # unreachable: keep the order
                    self._pending[n].extend(outbox.pop(n))
        for t, data in again:
            self.stats.republished += 1
            self._publish(t, data)
        self._push_all(outbox, reprogram=False)
        for p in list(self._producers.values()):
            try:
                p.flush()
            except Exception as e:  # the broker is down: callbacks queue them again
                log.warning("flushing producer %s: %s", p.topic(), e)

    def _push_all(self, batches: dict[int, list], reprogram: bool) -> dict[int, bool]:
        ok: dict[int, bool] = {}
        todo = {n: pb.ConfigBatch(messages=ms) for n, ms in batches.items() if ms}
        for attempt in range(1 + self.cfg.push_retries):
            calls = {}
            for n, b in todo.items():
                self.stats.rpc_pushes += 1
                self.stats.rpc_bytes += b.ByteSize()
                calls[n] = self._stub(n).Push.future(b, timeout=self.cfg.push_timeout_s)
            failed = {}
            for n, fut in calls.items():
                try:
                    fut.result()
                    ok[n] = True
                    self.stats.rpc_messages += len(todo[n].messages)
                    if reprogram:
                        self.stats.reprogrammed += len(todo[n].messages)
                except grpc.RpcError:
                    self.stats.push_failures += 1
                    failed[n] = todo[n]
            todo = failed
            if not todo:
                break
            time.sleep(self.cfg.retry_backoff_s * (2 ** attempt))
        with self._lock:
            for n, b in todo.items():  # unreachable after the retries: reprogram later
                ok[n] = False
                self._pending[n] = list(b.messages) + self._pending.get(n, [])
        return ok

    def _reprogram_loop(self) -> None:
        while not self._stop.wait(self.cfg.reprogram_period_s):
            self.retry_subscribe_infos()
            self.reprogram_pending()

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
            self.collect()

    def collect(self) -> int:
        """Collect packed replies from every agent (concurrently); returns results taken."""
        calls = {n: self._stub(n).Collect.future(pb.CollectRequest(acknowledged=self._acked[n]),
                                                 timeout=self.cfg.push_timeout_s)
                 for n in list(self.agents)}
        taken = 0
        for _n, fut in calls.items():
            try:
                taken += self._on_reply(fut.result())
            except grpc.RpcError:
                continue
        return taken

    def _on_reply(self, reply: Any) -> int:
        n = int(reply.node_id)
        redo: dict[int, list] = defaultdict(list)
        taken = 0
        with self._lock:
            for r in reply.results:
                if r.result_seq <= self._acked[n]:
                    continue
                self._acked[n] = r.result_seq
                taken += 1
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


def _subscription(node: int) -> str:
    return f"node-{node}"

