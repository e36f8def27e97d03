"""Agents and the controller restarting while the broker is down or unreachable (the
fault-injection soak's ``experiment=soak_restart_in_outage`` combines them):

* an agent starts, serves RPC, and attaches the subscriptions its store holds in the
  background;
* the controller takes the client's ``TimeOut`` for "no answer", so its recovery waits one
  operation timeout, not one per durable subscription;
* a restarted agent reports its recent applies again from its record, so results that died
  with the previous process still confirm the controller's outbox rows;
* a broker that takes connections but never answers costs the sending path at most
  ``producer_wait_s`` per topic, not the client's operation timeout."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures

import pulsar
import pytest

from delivery import controller as controller_mod
from delivery.agent import AgentConfig
from delivery.agent_host import AgentHost
from delivery.controller import Controller, ControllerConfig
from delivery.store import MetadataStore, SubscriptionChange
from delivery.wire import encode
from envs.dsmd.message import Message
from envs.netutil import free_ports
from security.tls import Security

from .waiting import wait_until


def test_an_agent_starts_and_serves_while_the_broker_is_down(tmp_path) -> None:
    store_url = f"sqlite:///{tmp_path / 'meta.db'}"
    store = MetadataStore(store_url)
    topic = "persistent://public/default/t-start-1"
    store.apply_changes([SubscriptionChange(0, topic, "agent-0", True)], time.time_ns())
    store.close()
    dead, port = free_ports(2)                  # nothing listens on `dead`
    url = f"pulsar://127.0.0.1:{dead}"
    cfg = AgentConfig(0, store_url, tmp_path / "records", pulsar_url=url, port=port,
                      security=Security(insecure=True))
    t0 = time.monotonic()
    host = AgentHost([cfg], url).start()
    try:
        took = time.monotonic() - t0
        agent = host.agents[0]
        assert took < 30, f"start took {took:.1f} s"
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass                                # it serves RPC
        assert agent.counters.deferred_subscriptions == 1
        assert agent.topics() == {}
        retry = [t for t in threading.enumerate() if t.name == "agent-0-resubscribe"]
        assert retry and retry[0].is_alive()
    finally:
        host.close()
    retry[0].join(15)
    assert not retry[0].is_alive(), "the background attach stops with the agent"


def test_the_controller_takes_a_broker_timeout_for_no_answer(tmp_path) -> None:
    dead, = free_ports(1)
    url = f"pulsar://127.0.0.1:{dead}"
    ctl = Controller(ControllerConfig(url, f"sqlite:///{tmp_path / 'meta.db'}",
                                      security=Security(insecure=True)), {0: "127.0.0.1:1"})
    ctl._client = pulsar.Client(url, operation_timeout_seconds=1,
                                logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    try:
        assert ctl._ensure_subscription("persistent://public/default/t-x-1", "agent-0") is False
    finally:
        ctl._client.close()
        ctl.store.close()


def test_a_restarted_agent_reports_its_last_applies_again(tmp_path) -> None:
    """Results that died with an agent before the controller collected them (the soak's
    'stuck' outbox rows) are reported again at the restart, as DUPLICATE, from the record:
    the recent rows only."""
    from delivery.agent import read_record
    from delivery.rpc import pb

    rec = tmp_path / "records"
    rec.mkdir()
    now = time.time_ns()
    old = now - int(3600e9)
    (rec / "node-0.record").write_text(
        f"A\t1\t1\tSUBNET\t5\t{old}\trpc\t{old}\n"
        f"A\t2\t1\tSUBNET\t5\t{now - 5}\tt1\t{now - 4}\n"
        f"A\t3\t1\tPORT\t6\t{now - 3}\trpc\t{now - 2}\n")
    _, port = free_ports(2)
    cfg = AgentConfig(0, f"sqlite:///{tmp_path / 'meta.db'}", rec, port=port,
                      security=Security(insecure=True))
    host = AgentHost([cfg], None).start()
    try:
        got = [(r.message_id, r.outcome, r.channel, r.timestamp_ns)
               for r in host.agents[0]._results]
    finally:
        host.close()
    assert got == [(2, pb.DUPLICATE, "t1", now - 5), (3, pb.DUPLICATE, "rpc", now - 3)]
    assert len(read_record(rec / "node-0.record")[0]) == 3   # the record is not rewritten


class _RefusingClient:
    """The controller's Pulsar client while the broker is away and not yet known to be
    down: creating a producer fails (after the operation timeout, in life)."""

    def __init__(self) -> None:
        self.attempts = 0

    def create_producer(self, topic: str, **_: object) -> None:
        self.attempts += 1
        raise pulsar.ConnectError("Pulsar error: ConnectError")


def _offline_controller(tmp_path, client: object) -> Controller:
    """A controller with ``client`` for its Pulsar client, two nodes that never answer, and
    its periodic collection and reprogramming out of the way."""
    dead, = free_ports(1)
    ctl = Controller(ControllerConfig(f"pulsar://127.0.0.1:{dead}",
                                      f"sqlite:///{tmp_path / 'meta.db'}",
                                      collect_period_s=3600, reprogram_period_s=3600,
                                      security=Security(insecure=True)),
                     {0: "127.0.0.1:1", 1: "127.0.0.1:1"})
    ctl._client = client
    return ctl


def _message(mid: int) -> tuple[Message, int]:
    return Message(mid, mid, 1, "SUBNET", "UPDATE", mid, 64, (0, 1)), 1


def test_a_message_its_topic_refuses_goes_over_rpc_on_every_dispatch_path(tmp_path,
                                                                          monkeypatch) -> None:
    """Wherever a stored message is dispatched (accepted, released by the tenant shaper,
    released by a channel switch), a topic whose producer cannot be created sends it over
    RPC at once: nothing is left half-published (in flight, or awaiting the MQ's
    confirmation) and nothing escapes into the shaper's pump thread. The topic is asked
    for a producer once, not once per message, while it keeps refusing."""
    monkeypatch.setattr(controller_mod, "PRODUCER_RETRY_S", 3600.0)  # however slow this is
    client = _RefusingClient()
    ctl = _offline_controller(tmp_path, client)
    ctl.channel = {1: 1}                      # type 1 on topic 1
    try:
        ctl.send_many([_message(1)])          # accepted
        ctl._in_send.active = True            # no push from _release (no agents here)
        ctl._release([(1, ctl._latest[(1, "SUBNET", 1)])])   # the tenant shaper's release
        ctl._gated = {1: 1}                   # a switch moving type 1 holds its messages
        ctl.send_many([_message(2), _message(3)])
        assert len(ctl._gated_msgs) == 2
        assert ctl._release_gated([1]) == 2
        assert [m.message_id for m in ctl._outbox[0]] == [1, 1, 2, 3]
        assert [m.message_id for m in ctl._outbox[1]] == [1, 1, 2, 3]
        assert ctl.stats.rerouted == 4 and ctl.stats.mq_messages == 0
        assert not ctl._inflight and not ctl._inflight_units
        assert not any(ctl._mq_unconfirmed.values())
        assert ctl.inflight_sends == 0
        assert client.attempts == 1
    finally:
        ctl._client = None
        ctl.store.close()


def test_a_broker_that_never_answers_costs_the_sending_path_one_short_wait(tmp_path) -> None:
    """A controller (restarted) while the broker's port takes connections and never answers:
    the first messages of three topics wait for their producers (created side by side) at
    most ``producer_wait_s`` in all, not the client's operation timeout each, and go over
    RPC; later ones go over RPC at once while the creations go on; once a creation failed
    its topic is not asked again for ``PRODUCER_RETRY_S``."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)                                    # accepts (the kernel), never answers
    url = f"pulsar://127.0.0.1:{hung.getsockname()[1]}"
    client = pulsar.Client(url, operation_timeout_seconds=3, connection_timeout_ms=3000,
                           logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    ctl = _offline_controller(tmp_path, client)
    ctl.cfg.producer_wait_s = 0.5
    ctl.channel = {1: 1, 2: 2, 3: 3}
    ctl._in_send.active = True                         # no push (no agents here)
    try:
        t0 = time.monotonic()
        ctl.send_many([(_message(k)[0], k) for k in (1, 2, 3)])
        first = time.monotonic() - t0
        t1 = time.monotonic()
        ctl.send_many([(_message(3 + k)[0], k) for k in (1, 2, 3)])
        later = time.monotonic() - t1
        assert first < 1.5, f"the first messages waited {first:.1f} s for their producers"
        assert later < 0.5, f"later messages waited {later:.1f} s"
        assert ctl.stats.rerouted == 6 and ctl.stats.mq_messages == 0
        assert len(ctl._outbox[0]) == len(ctl._outbox[1]) == 6
        wait_until(ctl._creating[1].future.done, 15, "the creation's failure")
        t2 = time.monotonic()
        ctl.send_many([(_message(7)[0], 1)])
        assert time.monotonic() - t2 < 0.5
        assert "ConnectError" in ctl._producer_refused[1][1] and 1 not in ctl._creating
        assert ctl.stats.rerouted == 7
    finally:
        ctl._stop.set()
        ctl._client = None
        client.close()
        ctl.store.close()
        hung.close()


class _Producer:
    """A data producer: records its sends (callbacks kept, never called unless told)."""

    def __init__(self, connected: bool = True) -> None:
        self.connected, self.sent, self.closed = connected, [], threading.Event()

    def is_connected(self) -> bool:
        return self.connected

    def send_async(self, data: bytes, callback) -> None:
        self.sent.append((data, callback))

    def close(self) -> None:
        self.closed.set()


class _Client:
    def __init__(self) -> None:
        self.producers: list[_Producer] = []

    def create_producer(self, topic: str, **_: object) -> _Producer:
        self.producers.append(_Producer())
        return self.producers[-1]


def test_failback_replaces_a_data_producer_that_has_not_reconnected(tmp_path) -> None:
    """At the failback, topic 1's producer (disconnected since the outage, holding two
    unacknowledged publishes) is replaced: the two go again on a fresh producer, in order,
    and the old one's late callbacks change nothing; topic 2's connected producer stays."""
    client = _Client()
    ctl = _offline_controller(tmp_path, client)
    try:
        ctl.channel = {1: 1, 2: 2}
        ctl._in_send.active = True
        ctl.send_many([_message(1), _message(2), (_message(3)[0], 2)])
        old, keep = client.producers
        assert [len(p.sent) for p in (old, keep)] == [2, 1]
        old_pids = set(ctl._inflight)
        old.connected = False                       # the broker came back; it did not
        ctl._failed_over = True                     # an outage was reacted to
        ctl._fail_back()
        assert len(client.producers) == 3 and ctl._producers[2] is keep
        fresh = client.producers[2]
        assert ctl._producers[1] is fresh and old.closed.wait(5)
        assert [d for d, _ in fresh.sent] == [d for d, _ in old.sent]
        assert ctl.stats.producers_renewed == 1 and ctl.stats.republished == 2
        for _, callback in old.sent:                # the old producer's late answers
            callback(pulsar.Result.Ok, None)
        assert len(ctl._inflight) == 3 and len(old_pids & set(ctl._inflight)) == 1
        assert len(keep.sent) == 1                  # topic 2's publish, still in flight
        for _, callback in fresh.sent + keep.sent:
            callback(pulsar.Result.Ok, None)
        assert not ctl._inflight and ctl.inflight_sends == 0
    finally:
        ctl._client = None
        ctl.store.close()


def test_a_republish_its_topic_refuses_waits_for_the_next_flush(tmp_path) -> None:
    """Publishes to go again on a topic that still refuses a producer (the failback's renewed
    ones, say) stay queued, in order, for the next flush; the flush goes on and pushes, and
    later flushes are not left waiting for its turn."""
    ctl = _offline_controller(tmp_path, _RefusingClient())
    try:
        ctl._republish = [(1, b"a"), (1, b"b")]
        ctl._flush_locked()
        assert ctl._republish == [(1, b"a"), (1, b"b")]
        done = threading.Event()
        threading.Thread(target=lambda: (ctl._flush_locked(), done.set()), daemon=True).start()
        assert done.wait(10), "the next flush waits for a push turn that never comes"
        assert ctl._republish == [(1, b"a"), (1, b"b")] and ctl.stats.republished == 0
    finally:
        ctl._client = None
        ctl.store.close()


def test_a_fence_its_topic_refuses_waits_and_the_switch_stands(tmp_path) -> None:
    """The fence that ends a switch (agents leave topic 1) cannot be published while topic 1
    refuses a producer: it waits for the next flush, and the switch, already in effect, does
    not fail for it."""
    ctl = _offline_controller(tmp_path, _RefusingClient())
    try:
        with ctl._lock:
            ctl._pending[0] = [object()]      # node 0 known unreachable: its info is queued
        ctl._unsubscribe([(0, 1)], ctl.timestamp())
        assert [c for c, _ in ctl._republish] == [1] and ctl.stats.fences == 1
        assert [c for c, _ in ctl._pending_infos[0]] == [1]
    finally:
        ctl._client = None
        ctl.store.close()


class _FlakyClient(_Client):
    """Refuses the first producer (the broker away), creates the later ones."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts = 0

    def create_producer(self, topic: str, **kw: object) -> _Producer:
        self.attempts += 1
        if self.attempts == 1:
            raise pulsar.ConnectError("Pulsar error: ConnectError")
        return super().create_producer(topic, **kw)


def test_a_creation_that_failed_long_ago_is_asked_again(tmp_path, monkeypatch) -> None:
    """A producer creation started at the controller's start failed during an outage and
    nobody asked for the topic until later: the old failure does not refuse the topic
    again (its message goes on MQ through a fresh creation, not over RPC)."""
    monkeypatch.setattr(controller_mod, "PRODUCER_RETRY_S", 0.2)
    client = _FlakyClient()
    ctl = _offline_controller(tmp_path, client)
    ctl.channel = {1: 1}
    ctl._in_send.active = True
    try:
        with ctl._dispatch:
            ctl._prepare_producers([1])           # as start() does
        wait_until(ctl._creating[1].future.done, 10, "the first creation's failure")
        time.sleep(0.3)                           # older than PRODUCER_RETRY_S
        ctl.send_many([_message(1)])
        assert client.attempts == 2 and ctl.stats.rerouted == 0
        assert len(client.producers[0].sent) == 1 and 1 not in ctl._creating
    finally:
        ctl._client = None
        ctl.store.close()


def test_the_failback_settles_creations_that_finished_during_the_outage(tmp_path) -> None:
    """Creations that finished while the broker was away are settled at the failback: a
    connected producer is taken, a disconnected one closed, a failure forgotten."""
    client = _Client()
    ctl = _offline_controller(tmp_path, client)
    try:
        with ctl._dispatch:
            ctl._prepare_producers([1, 2, 3])
        wait_until(lambda: all(c.future.done() for c in ctl._creating.values()), 10,
                   "the creations")
        made = {t: c.future.result() for t, c in ctl._creating.items()}
        made[2].connected = False
        failed: futures.Future = futures.Future()
        failed.set_exception(pulsar.ConnectError("Pulsar error: ConnectError"))
        ctl._creating[3] = controller_mod._Creation(failed, time.monotonic(), time.monotonic())
        with ctl._dispatch:
            ctl._renew_producers()
        assert ctl._creating == {} and ctl._producers == {1: made[1]}
        assert made[2].closed.wait(5) and not made[1].closed.is_set()
    finally:
        ctl._client = None
        ctl.store.close()


def test_a_push_that_cannot_start_leaves_no_push_in_flight(tmp_path) -> None:
    """A push to a node the controller has no address for raises, and ends its number and
    C_p units (a number left open would hold every health probe forever)."""
    ctl = _offline_controller(tmp_path, _Client())
    try:
        msg, t = _message(1)
        with pytest.raises(KeyError):
            ctl._push_all({7: [encode(msg, t, b"")]}, reprogram=True)
        assert len(ctl._rpc_backlog) == 0 and ctl._rpc_backlog.mark() == 1
        assert ctl._rpc_backlog.drained_at(1) is not None
        assert ctl.inflight_sends == 0
    finally:
        ctl._client = None
        ctl.store.close()
