"""The delivery runtime end to end: a real Pulsar standalone broker (``pulsar_broker``, one per
session; the broker-restart test runs its own), real gRPC, real agents (in process on one
asyncio loop, or a ``python -m delivery.agent_host`` subprocess for the crash test) and the
real controller. No mocks.

Every test judges delivery from the agents' programming records (``read_record``), against a
ledger of what the controller was asked to send: for every (node, resource) the applied
timestamps strictly increase (nothing applied twice, nothing applied out of order), every
applied message is one that was sent to that node for that resource, and the last applied is
the newest sent, so every message sent to a node is either applied or superseded by a newer
applied one. Where each resource is carried by one channel at a time and the test waits
between channel switches, it also asserts that every message was applied (exactly once).
"""

from __future__ import annotations

import itertools
import json
import threading
import time

import pulsar
import pytest

from delivery.agent import AgentConfig, read_record
from delivery.controller import RPC
from delivery.rpc import pb, pb_grpc
from delivery.store import MetadataStore
from delivery.wire import envelope
from envs.dsmd.message import Message
from harness.broker import PulsarStandalone
from security.pulsar import client_args, subscription_name

from .delivery_rig import (
    OP,
    HostProcess,
    admin_subscriptions,
    assert_arrived,
    audit,
    outcomes,
    rig,
    wait_until,
)

# one Pulsar broker JVM at a time: every broker test runs on the same xdist worker
pytestmark = pytest.mark.xdist_group("pulsar")



# --------------------------------------------------------------------------- 1. mixed channels


def test_mixed_channels_with_switches(pulsar_broker, tmp_path):
    """Several types (RPC and MQ on different topics; unicast and multicast), bursts of
    messages between switches RPC->MQ, MQ->MQ (another topic) and MQ->RPC: every message a
    node needs is applied exactly once, in timestamp order per resource; redundant MQ
    messages are counted as not_for_me; agents, store and broker agree on subscriptions."""
    nodes = range(6)
    hosts = {0: (0, 1, 2, 3), 1: (4,), 2: (2, 3, 4, 5), 3: (1,), 4: (0, 5)}
    with rig(pulsar_broker, tmp_path, nodes) as r:
        phases = [
            {0: RPC, 1: RPC, 2: 1, 3: 1, 4: 2},        # T2 and T3 share topic 1
            {0: 2, 1: RPC, 2: 1, 3: 1, 4: 2},          # T0 RPC -> MQ
            {0: 2, 1: 3, 2: 3, 3: 1, 4: 2},            # T2 MQ 1 -> MQ 3, T1 RPC -> MQ
            {0: RPC, 1: 3, 2: 3, 3: RPC, 4: 1},        # MQ -> RPC (T0, T3), T4 MQ 2 -> 1
        ]
        for i, channels in enumerate(phases):
            change = r.ctl.set_channels(channels, hosts)
            if i:
                assert change["types"] > 0
            r.wait_subscriptions()
            for k in range(80):
                t = k % len(hosts)
                # each type its own resources, 3 per type, so each burst updates them often
                r.send(t, resource_id=100 * t + k % 3, hosts=hosts[t])
            r.delivered(every=True)
        r.ctl.collect()
        counters = r.host.counters()
        assert {n: c["not_for_me"] for n, c in counters.items()} == \
            {n: r.ledger.not_for_me.get(n, 0) for n in nodes}
        assert sum(r.ledger.not_for_me.values()) > 0
        assert all(c["outcomes"]["out_of_order"] == 0 and c["outcomes"]["malformed"] == 0
                   for c in counters.values()), counters
        assert r.ctl.stats.fences >= 2 and r.ctl.stats.channel_changes >= 6
        # the topic mapping of the store is the controller's
        store = MetadataStore(r.store_url)
        try:
            mapping = store.mapping()
        finally:
            store.close()
        assert {t: c for t, (c, _) in mapping.items()} == phases[-1]
        assert all(tp == (r.topic(c) if c else None) for c, tp in mapping.values())
        # the drained topic 2 (T0 left it, then T4): no durable subscription is left on it
        assert admin_subscriptions(pulsar_broker, r.topic(2)) == set()
        total = r.ledger.total()
        assert sum(len(rows) for rows in r.delivered(every=True).values()) == total


# --------------------------------------------------------------------------- 2. race


def test_one_resource_alternating_rpc_and_mq(pulsar_broker, tmp_path):
    """One resource updated alternately over RPC and MQ (two types sharing it, and a third
    type whose channel flips back and forth without waiting): every node ends with the
    newest message, and nothing is applied twice or out of order."""
    nodes = (0, 1, 2, 3)
    hosts = {0: nodes, 1: nodes, 2: (1, 2, 3)}
    with rig(pulsar_broker, tmp_path, nodes) as r:
        r.ctl.set_channels({0: RPC, 1: 1, 2: RPC}, hosts)
        for k in range(120):
            r.send(k % 2, resource_id=7, hosts=hosts[k % 2])
            if k % 5 == 4:
                r.ctl.flush()
        r.delivered()
        for c in (1, RPC, 2, 1, RPC, 2):
            r.ctl.set_channels({2: c}, hosts)
            for k in range(15):
                r.send(2, resource_id=7, hosts=hosts[2])
                r.send(k % 2, resource_id=7, hosts=hosts[k % 2])
            r.ctl.flush()
        rows = r.delivered()
        newest = max(r.ledger.sent[1][(1, "SUBNET", 7)])
        for n in nodes:
            assert (rows[n][-1].timestamp_ns, rows[n][-1].message_id) == newest
        # OUT_OF_ORDER reports (the older of two racing messages) are recorded, and nothing
        # is re-sent for them: the nodes hold the newest state already
        r.ctl.collect()
        reprogrammed = r.ctl.stats.reprogrammed
        r.delivered()
        assert r.ctl.stats.reprogrammed == reprogrammed


def test_a_switch_holds_only_the_types_it_moves(pulsar_broker, tmp_path):
    """A queued switch (``wait=False``) whose SubscribeInfos are not yet acknowledged holds
    the messages of the type it moves, and only those: another type's messages are applied
    meanwhile. Once the acknowledgements come, the held messages leave on the new channel
    (one publish each), and every message is applied exactly once, in order."""
    nodes = (0, 1, 2, 3)
    hosts = {0: (0, 1), 1: nodes, 2: (2, 3), 3: (0, 3)}
    with rig(pulsar_broker, tmp_path, nodes) as r:
        r.ctl.set_channels({0: RPC, 1: RPC}, hosts)
        r.send(1, resource_id=1, hosts=hosts[1])
        r.delivered(every=True)
        acks_may_come = threading.Event()
        infos, switch = r.ctl._send_subscribe_infos, r.ctl._switch
        switches = []

        def slow_acks(pairs, ts, subscribe):  # the agents answer once the test says so
            if subscribe:
                assert acks_may_come.wait(30)
            return infos(pairs, ts, subscribe)

        def counted(chans, hs, moving):
            switches.append(sorted(chans))
            return switch(chans, hs, moving)

        r.ctl._send_subscribe_infos, r.ctl._switch = slow_acks, counted
        assert r.ctl.set_channels({1: 1}, hosts, wait=False) == {"queued": 1}
        wait_until(lambda: switches, 10, lambda: "the switch thread takes the switch")
        # two placements queued behind it: made as one switch once it is done
        r.ctl.set_channels({2: 2}, hosts, wait=False)
        r.ctl.set_channels({3: 1}, hosts, wait=False)
        r.send(2, resource_id=3, hosts=hosts[2])
        mq0 = r.ctl.stats.mq_messages
        moved = [r.send(1, resource_id=1, hosts=hosts[1]) for _ in range(5)]
        other = [r.send(0, resource_id=2, hosts=hosts[0]) for _ in range(5)]
        r.ctl.flush()

        def applied(n: int, msgs) -> bool:
            rows, _ = read_record(r.record_dir / f"node-{n}.record")
            return {m.message_id for m in msgs} <= {row.message_id for row in rows}

        wait_until(lambda: all(applied(n, other) for n in hosts[0]), 20,
                   lambda: "the unmoved type's messages while the switch waits")
        assert not any(applied(n, moved[:1]) for n in nodes)
        assert r.ctl.stats.switch_held == 6 and r.ctl.channel[1] == RPC
        assert r.ctl.channel_asked(1) == 1 and r.ctl.channel_asked(0) == RPC
        assert r.ctl.channel_asked(99) is None
        acks_may_come.set()
        r.ctl.wait_switches()
        assert r.ctl.channel[1] == 1 and r.ctl.channel[2] == 2 and r.ctl.channel[3] == 1
        assert switches == [[1], [2, 3]]
        assert r.ctl.stats.mq_messages - mq0 == 6  # the held messages went on the topics
        r.delivered(every=True)
        r.wait_subscriptions()


def test_a_flush_waiting_for_answers_leaves_the_dispatcher_free(pulsar_broker, tmp_path):
    """While a flush waits for its pushes to be answered (held here until the test says so),
    messages are still accepted and dispatched: an MQ type's message is published at once.
    A second flush meanwhile pushes only after the first one's answers (a node gets its
    batches in order), and every message is applied exactly once, in order."""
    nodes = (0, 1)
    hosts = {0: nodes, 1: nodes}
    with rig(pulsar_broker, tmp_path, nodes) as r:
        r.ctl.set_channels({0: RPC, 1: 1}, hosts)
        answers_may_come = threading.Event()
        push_all, calls = r.ctl._push_all, []

        def slow(batches, reprogram):
            calls.append(sum(len(b) for b in batches.values()))
            if len(calls) == 1:
                assert answers_may_come.wait(30)
            return push_all(batches, reprogram)

        r.ctl._push_all = slow
        r.send(0, resource_id=1, hosts=hosts[0])
        first = threading.Thread(target=r.ctl.flush)
        first.start()
        wait_until(lambda: calls, 10, lambda: "the first flush pushes")
        mq0 = r.ctl.stats.mq_messages
        accepted = threading.Thread(target=lambda: [r.send(1, resource_id=2, hosts=hosts[1]),
                                                    r.send(0, resource_id=1, hosts=hosts[0])])
        accepted.start()
        accepted.join(10)
        assert not accepted.is_alive(), "accepting waited for the flush's answers"
        assert r.ctl.stats.mq_messages == mq0 + 1
        second = threading.Thread(target=r.ctl.flush)
        second.start()
        second.join(1)
        assert second.is_alive() and calls == [2], "the second flush pushed before the first"
        answers_may_come.set()
        first.join(30)
        second.join(30)
        assert calls == [2, 2]
        r.delivered(every=True)


def test_a_switch_writing_its_store_leaves_the_dispatcher_free(pulsar_broker, tmp_path):
    """While a queued switch writes its channels and subscriptions to the store (held here
    until the test says so), another type's messages are accepted and published; the moving
    type's message waits for the switch and goes on its new topic. Nothing is lost."""
    nodes = (0, 1)
    hosts = {0: nodes, 1: nodes}
    with rig(pulsar_broker, tmp_path, nodes) as r:
        r.ctl.set_channels({0: RPC, 1: 1}, hosts)
        may_go = threading.Event()
        writing = threading.Event()
        write_mapping = r.ctl.store.write_mapping

        def slow(rows, ts):
            writing.set()
            assert may_go.wait(30)
            return write_mapping(rows, ts)

        r.ctl.store.write_mapping = slow  # type: ignore[method-assign]
        r.ctl.set_channels({0: 2}, hosts, wait=False)
        assert writing.wait(10)
        mq0, held0 = r.ctl.stats.mq_messages, r.ctl.stats.switch_held
        accepted = threading.Thread(target=lambda: [r.send(1, resource_id=2, hosts=hosts[1]),
                                                    r.send(0, resource_id=1, hosts=hosts[0])])
        accepted.start()
        accepted.join(10)
        assert not accepted.is_alive(), "accepting waited for the switch's store writes"
        assert r.ctl.stats.mq_messages == mq0 + 1  # type 1's, on its topic
        assert r.ctl.stats.switch_held == held0 + 1  # type 0's waits for its switch
        may_go.set()
        r.ctl.wait_switches()
        assert r.ctl.channel[0] == 2 and r.ctl.store.mapping()[0][0] == 2
        r.ctl.flush()
        r.delivered(every=True)


def test_queued_switches_in_order_lose_nothing(pulsar_broker, tmp_path):
    """Switches queued back to back (RPC -> topic 1 -> topic 2 -> RPC -> topic 1 ...) with
    messages of the moving type and of a steady one between them: the switches take effect in
    the order asked, and every message is applied exactly once, in order."""
    nodes = (0, 1, 2)
    hosts = {0: nodes, 1: (1, 2)}
    with rig(pulsar_broker, tmp_path, nodes) as r:
        r.ctl.set_channels({0: RPC, 1: 1}, hosts)
        plan = (1, 2, RPC, 1, RPC, 2)
        for k, c in enumerate(plan):
            r.ctl.set_channels({0: c}, hosts, wait=False)
            for i in range(6):
                r.send(0, resource_id=k * 10 + i % 3, hosts=hosts[0])
                r.send(1, resource_id=100 + i, hosts=hosts[1])
            r.ctl.flush()
        r.ctl.wait_switches()
        assert r.ctl.channel[0] == plan[-1]
        assert r.ctl.stats.switch_held > 0
        r.delivered(every=True)
        r.wait_subscriptions()


def _parked_controller(tmp_path):
    """A controller with no broker and no agents whose switch thread never runs: the queued
    switches stay queued."""
    from delivery.controller import Controller, ControllerConfig
    from envs.netutil import free_ports
    from security.tls import Security

    class _Parked:
        def submit(self, fn):
            return None

    ctl = Controller(ControllerConfig(f"pulsar://127.0.0.1:{free_ports(1)[0]}",
                                      f"sqlite:///{tmp_path / 'meta.db'}",
                                      collect_period_s=3600, reprogram_period_s=3600,
                                      security=Security(insecure=True)), {0: "127.0.0.1:1"})
    ctl._switcher = _Parked()
    ctl.channel, ctl.hosts = {0: RPC}, {0: (0,)}
    return ctl


def test_a_type_queued_away_and_back_is_held_until_both_switches_are_done(tmp_path):
    """Type 0 on RPC, queued to topic 1 and then back to RPC: both switches gate it (the
    second compares with the channel the first asked for, not the one in effect), so a
    message sent after them cannot be released onto topic 1 when the first is done while
    the second sends later messages over RPC (they would overtake it: its resource then
    skips it)."""
    ctl = _parked_controller(tmp_path)
    try:
        assert ctl.set_channels({0: 1}, {0: (0,)}, wait=False) == {"queued": 1}
        assert ctl.set_channels({0: RPC}, {0: (0,)}, wait=False) == {"queued": 1}
        assert ctl.set_channels({0: RPC}, {0: (0,)}, wait=False) == {"queued": 0}
        assert ctl._gated == {0: 2}
        assert ctl.channel_asked(0) == RPC
        ctl._in_send.active = True
        ctl.send_many([(Message(1, 1, 1, "SUBNET", "UPDATE", 1, 64, (0,)), 0)])
        assert [cm.message_id for _, cm in ctl._gated_msgs] == [1]
        with ctl._dispatch:
            ctl._release_gated([0])          # the first switch done: still held
        assert [cm.message_id for _, cm in ctl._gated_msgs] == [1]
    finally:
        ctl.store.close()


def test_a_switch_deferred_by_an_outage_holds_its_type_when_applied(tmp_path):
    """A switch asked while the MQ channel is down is deferred (the asked channel runs ahead
    of the current one); the failback's switch that applies it still holds the type."""
    ctl = _parked_controller(tmp_path)
    try:
        ctl._mq_down = True
        assert ctl.set_channels({0: 1}, {0: (0,)})["deferred"] == 1
        assert ctl.channel[0] == RPC and ctl.channel_asked(0) == 1 and not ctl._gated
        ctl._mq_down = False
        assert ctl.set_channels({0: 1}, {0: (0,)}, wait=False) == {"queued": 1}
        assert ctl._gated == {0: 1}
    finally:
        ctl.store.close()


def test_a_failed_switch_leaves_the_channel_a_queued_one_asks_for(tmp_path, monkeypatch):
    """Switch A (type 0 to topic 1) fails while B, asking the same, is queued: the asked
    channel stays topic 1 (what B will make it), and B holds the type on its own."""
    from delivery.store import StoreError

    ctl = _parked_controller(tmp_path)
    try:
        ctl.set_channels({0: 1}, {0: (0,)}, wait=False)
        a = ctl._queued.pop(0)            # the switch thread took A and runs it
        assert ctl.set_channels({0: 1}, {0: (0,)}, wait=False) == {"queued": 1}

        def broken(*_):
            raise StoreError("disk full")

        monkeypatch.setattr(ctl, "_switch_plan", broken)
        with pytest.raises(StoreError):
            ctl._switch(a[0], a[1], a[2])
        assert ctl.channel_asked(0) == 1 and ctl._gated == {0: 1}
    finally:
        ctl.store.close()


# --------------------------------------------------------------------------- 3. crash


def test_agent_crash_and_restart(pulsar_broker, tmp_path):
    """Agents in a subprocess, SIGKILLed mid-stream; messages keep coming on MQ and RPC while
    it is down; restarted with the same spec and ports it recovers (record + store), gets the
    MQ backlog from its durable subscriptions, and the controller reprograms the RPC messages:
    nothing applied twice or out of order, the newest of every resource applied, every
    message arrived (applied, or reported OUT_OF_ORDER after a redelivery, see
    assert_arrived); a record line torn by the crash does not swallow the next one; the
    results of the restarted agents are all counted by the controller."""
    nodes = (0, 1, 2)
    hosts = {0: nodes, 1: nodes, 2: (1,), 3: (0, 2)}
    # relaying (failover.relay_after_s) would carry the queued RPC messages on a topic when
    # the restart takes long (a loaded machine): off here, so they are reprogrammed
    with rig(pulsar_broker, tmp_path, nodes, agents_in_process=False,
             ctl_kw={"push_retries": 1, "retry_backoff_s": 0.02,
                     "failover": {"relay_after_s": 600.0}}) as r:
        proc = HostProcess(r, nodes)
        try:
            proc.start()
            r.ctl.set_channels({0: 1, 1: RPC, 2: RPC, 3: 2}, hosts)

            def burst(k0: int, n: int) -> None:
                for k in range(k0, k0 + n):
                    t = k % 4
                    r.send(t, resource_id=10 * t + (k // 4) % 3, hosts=hosts[t])
                    if k % 8 == 7:
                        r.ctl.flush()
                r.ctl.flush()

            burst(0, 80)
            r.delivered(every=True)
            burst(80, 40)          # some of these are still in flight when it dies
            proc.kill()
            with open(r.record_dir / "node-1.record", "a") as f:
                f.write("A\t424242\t1\tSUB")   # as if it died in the middle of a line
            burst(120, 80)         # while it is down: MQ backlog and RPC reprogramming queue
            wait_until(r.ctl.pending, 10, "RPC messages queued for reprogramming")
            assert r.ctl.stats.push_failures > 0
            restarted_ns = time.time_ns()
            collected_before = r.ctl.stats.outcomes.get("APPLIED", 0)
            proc.start()
            burst(200, 40)
            rows = r.delivered(timeout=60, every=True)   # one channel per resource here
            assert_arrived(r)
            wait_until(lambda: r.ctl.stats.reprogrammed > 0, 10, "the reprogrammed count")
            # every result of the restarted agents reaches the controller once: their result
            # numbering goes on across the restart, so none is taken for a repeat (rows applied
            # since the restart are exactly the APPLIED results collected since the kill)
            after = sum(1 for rs in rows.values() for x in rs if x.applied_ns >= restarted_ns)
            assert after > 0

            def collected() -> int:
                return r.ctl.stats.outcomes.get("APPLIED", 0) - collected_before

            wait_until(lambda: collected() >= after, 15, lambda: f"replies after the restart: "
                       f"{collected()} APPLIED results collected, {after} applied")
            time.sleep(0.5)
            assert collected() == after
        finally:
            proc.stop()
        counters = {n: json.loads((r.record_dir / f"node-{n}.counters.json").read_text())
                    for n in nodes}
        assert all(c["outcomes"]["malformed"] == 0 for c in counters.values())


# --------------------------------------------------------------------------- 4. broker restart


@pytest.mark.slow  # stops and restarts a broker JVM
def test_broker_stop_and_restart(tmp_path):
    """A broker of its own, stopped and restarted (same ports and data): what was published
    before the stop and what was published while it is down and restarting all arrive; the
    newest message of every resource is applied; nothing applied twice or out of order.

    Every message sent from the stop on is applied. One the broker acknowledged before the
    stop but had not yet dispatched to the node reaches it only after the restart, possibly
    after a newer message of its resource went by RPC during the failover: it is then
    superseded (reported ``OUT_OF_ORDER``, not applied), and only such messages may be."""
    nodes = (0, 1)
    hosts = {0: nodes, 1: (1,), 2: nodes}
    with PulsarStandalone(progress=None, work_dir=tmp_path / "broker") as broker, \
            rig(broker, tmp_path, nodes) as r:
        r.ctl.set_channels({0: 1, 1: 2, 2: RPC}, hosts)
        before = {r.send(k % 3, resource_id=k % 5, hosts=hosts[k % 3], vpc=k % 3).message_id
                  for k in range(60)}
        r.ctl.flush()   # on the broker (the producers' acks), not necessarily consumed
        broker.stop()
        back = threading.Event()
        sent = []

        def sender() -> None:   # sends while the broker is down and while it starts
            k = 60
            while not back.is_set() or k < 90:
                r.send(k % 3, resource_id=k % 5, hosts=hosts[k % 3], vpc=k % 3)
                sent.append(k)
                k += 1
                time.sleep(0.05)
            r.ctl.flush()   # returns once the broker took them (or they were queued again)

        th = threading.Thread(target=sender, daemon=True)
        th.start()
        try:
            broker.start()
        finally:
            back.set()
        th.join(90)
        assert not th.is_alive(), "flush did not return after the broker came back"
        assert len(sent) >= 30
        for k in range(1000, 1030):
            r.send(k % 3, resource_id=k % 5, hosts=hosts[k % 3], vpc=k % 3)
        rows = r.delivered(timeout=90)
        assert_arrived(r)   # applied, or reported OUT_OF_ORDER
        with r.ledger.lock:
            sent = {n: {mid for msgs in r.ledger.sent[n].values() for _, mid in msgs}
                    for n in nodes}
        superseded = {(n, mid) for n in nodes
                      for mid in sent[n] - {x.message_id for x in rows[n]}}
        assert all(mid in before for _, mid in superseded), (
            f"sent after the stop, yet not applied: {sorted(superseded)}")
        assert broker.starts == 2


# --------------------------------------------------------------------------- 5. switch under load


def test_subscription_switch_under_load(pulsar_broker, tmp_path):
    """A sender thread keeps sending one type's messages while the type's channel switches
    MQ -> MQ -> RPC -> MQ -> MQ ...: nothing is lost; then quick flips between two topics,
    no SubscribeInfo fails."""
    nodes = (0, 1, 2, 3)
    hosts = {0: nodes, 1: (2,)}
    with rig(pulsar_broker, tmp_path, nodes) as r:
        r.ctl.set_channels({0: 1, 1: 3}, hosts)
        stop = threading.Event()
        errors: list[BaseException] = []

        def sender() -> None:
            try:
                k = 0
                while not stop.is_set():
                    r.send(0, resource_id=k % 6, hosts=hosts[0])
                    if k % 3 == 0:
                        r.send(1, resource_id=50, hosts=hosts[1])
                    if k % 10 == 9:
                        r.ctl.flush()
                    k += 1
                    time.sleep(0.001)
            except Exception as e:
                errors.append(e)

        th = threading.Thread(target=sender, daemon=True)
        th.start()
        try:
            for c in (2, 1, RPC, 2, 3, 1, RPC, 1, 3, 2):
                time.sleep(0.15)
                r.ctl.set_channels({0: c}, hosts)
        finally:
            time.sleep(0.2)
            # a loaded machine sends fewer per second: keep the load going to 500 messages
            deadline = time.monotonic() + 60
            while r.ledger.total() <= 500 and time.monotonic() < deadline and not errors:
                time.sleep(0.05)
            stop.set()
            th.join(30)
        assert not errors, errors
        r.delivered(timeout=40)
        r.wait_subscriptions()
        assert r.ledger.total() > 500
        # quick flips between two topics: a SubscribeInfo can come back for a topic whose
        # drained durable subscription the agent is just deleting; it must not fail
        for i in range(24):
            r.send(0, resource_id=i % 6, hosts=hosts[0])
            r.ctl.set_channels({0: 1 + i % 2}, hosts)
            time.sleep((i % 7) * 0.003)
        r.delivered()
        r.wait_subscriptions()
        assert r.ctl.stats.subscribe_failures == 0


# --------------------------------------------------------------------------- 6. RPC down


def test_rpc_endpoint_down_then_back(pulsar_broker, tmp_path):
    """One agent's RPC endpoint goes away (stop_agent) and comes back (start_agent): the
    controller retries, queues its messages, reprograms them when it answers; exactly once,
    in order."""
    nodes = (0, 1, 2)
    hosts = {0: nodes, 1: (1,), 2: nodes}
    # relaying (failover.relay_after_s) would carry node 1's queue on a topic when the
    # reprogramming rounds take long (a loaded machine): off here, so they are reprogrammed
    with rig(pulsar_broker, tmp_path, nodes,
             ctl_kw={"push_retries": 2, "retry_backoff_s": 0.02,
                     "failover": {"relay_after_s": 600.0}}) as r:
        r.ctl.set_channels({0: RPC, 1: RPC, 2: 1}, hosts)
        for k in range(30):
            r.send(k % 3, resource_id=k % 4, hosts=hosts[k % 3], vpc=k % 3)
        r.delivered(every=True)
        r.host.stop_agent(1)
        failures = r.ctl.stats.push_failures
        for k in range(30, 90):
            r.send(k % 3, resource_id=k % 4, hosts=hosts[k % 3], vpc=k % 3)
            if k % 10 == 9:
                r.ctl.flush()
        r.ctl.flush()
        assert r.ctl.stats.push_failures >= failures + 3   # first try and the retries
        wait_until(lambda: r.ctl.pending().get(1, 0) > 0, 5, "node 1's reprogramming queue")
        time.sleep(0.5)                                      # a few reprogramming rounds fail
        wait_until(lambda: r.ctl.pending().get(1, 0) > 0, 5, "node 1's reprogramming queue")
        # the others got theirs meanwhile
        bad, _, _ = audit(r.record_dir, r.ledger, (0, 2))
        assert not bad
        r.host.start_agent(1)
        for k in range(90, 120):
            r.send(k % 3, resource_id=k % 4, hosts=hosts[k % 3], vpc=k % 3)
        r.delivered(every=True, timeout=40)
        # the agent has applied them; the controller counts them once the push's answer is in
        wait_until(lambda: r.ctl.stats.reprogrammed > 0, 10, "the reprogrammed count")


def test_subscribe_info_retried_after_rpc_outage(pulsar_broker, tmp_path):
    """A live agent's RPC endpoint is unreachable (its gRPC server stopped, its consumers and
    state kept, no restart) across two switches of its type (RPC -> MQ 1 -> MQ 2): the first
    waits subscribe_timeout_s for it, then creates its durable subscription and queues the
    SubscribeInfo; the second does not wait for a node known to be unreachable. When the
    endpoint is back the queued SubscribeInfos go out in order (the unsubscription with a
    fence of its own): the agent subscribes, drains topic 1 and leaves it; nothing is lost,
    applied twice or out of order."""
    nodes = (0, 1)
    hosts = {0: nodes}
    with rig(pulsar_broker, tmp_path, nodes,
             ctl_kw={"subscribe_timeout_s": 1.0, "retry_backoff_s": 0.02}) as r:
        r.ctl.set_channels({0: RPC}, hosts)
        for k in range(10):
            r.send(0, resource_id=k % 3, hosts=nodes)
        r.delivered(every=True)
        agent = r.host.agents[1]
        r.host.call(agent._server.stop(0))
        r.ctl.set_channels({0: 1}, hosts)           # node 1 cannot hear the SubscribeInfo
        assert r.ctl.pending_subscribe_infos() == {1: 1}
        for k in range(10, 30):
            r.send(0, resource_id=k % 3, hosts=nodes)
        r.ctl.flush()
        t0 = time.monotonic()
        r.ctl.set_channels({0: 2}, hosts)           # MQ 1 -> MQ 2
        assert time.monotonic() - t0 < 1.0, "the switch waited for an unreachable node"
        assert r.ctl.pending_subscribe_infos() == {1: 3}
        for k in range(30, 50):
            r.send(0, resource_id=k % 3, hosts=nodes)
        r.ctl.flush()
        assert agent.topics() == {}

        port = agent.port
        assert r.host.call(agent.serve()) == port      # the same (mutual TLS) endpoint again
        wait_until(lambda: not r.ctl.pending_subscribe_infos(), 15, "queued SubscribeInfos")
        assert r.host.agents[1] is agent             # the same agent, never restarted
        # it reads the backlogs of topics 1 and 2 at once: an older message of topic 1 may come
        # after a newer one of topic 2 (superseded, reported OUT_OF_ORDER), none is lost
        r.delivered()
        assert_arrived(r)
        r.wait_subscriptions()
        _, subs = read_record(r.record_dir / "node-1.record")
        assert subs[r.topic(1)][0] == "deleted" and subs[r.topic(2)][0] == "subscribed"


def test_subscribe_info_does_not_wait_behind_a_full_link(pulsar_broker, tmp_path):
    """The controller's link to a node is full: 4 MB of pushes on a 2 Mbit/s link (a 16-s
    drain). A switch that moves another of the node's types to a topic gets its SubscribeInfo
    through long before the pushes are: it travels on a connection of its own, not behind
    them. The moved type's messages all arrive, nothing is lost or applied twice."""
    nodes = (0,)
    with rig(pulsar_broker, tmp_path, nodes, slow_links={0: 2e6},
             ctl_kw={"push_timeout_s": 60.0}) as r:
        r.ctl.set_channels({0: RPC, 1: RPC}, {0: nodes, 1: nodes})
        r.send(0, resource_id=0, hosts=nodes)
        r.send(1, resource_id=100, hosts=nodes)
        r.delivered(every=True)
        for k in range(64):
            r.send(0, resource_id=k % 8, hosts=nodes, size=64 * 1024)
        flushing = threading.Thread(target=r.ctl.flush, daemon=True)
        flushing.start()
        wait_until(lambda: r.links[0].forwarded > 256 * 1024, 20, "the pushes on the link")
        switch = threading.Thread(target=r.ctl.set_channels, args=({1: 1}, {1: nodes}),
                                  daemon=True)
        t0 = time.monotonic()
        switch.start()
        agent = r.host.agents[0]
        wait_until(lambda: r.topic(1) in agent.topics() or not flushing.is_alive(), 30,
                   "node 0's subscription or the end of the pushes")
        took = time.monotonic() - t0
        assert r.topic(1) in agent.topics() and flushing.is_alive() and took < 8.0, (
            f"the SubscribeInfo waited {took:.1f} s, behind the pushes")
        assert r.links[0].forwarded < 3 * 1024 * 1024
        for k in range(10):
            r.send(1, resource_id=100 + k % 3, hosts=nodes)
        flushing.join(60)
        switch.join(60)
        assert not switch.is_alive()
        r.delivered(every=True, timeout=60)
        assert_arrived(r)


def test_a_node_slow_to_answer_its_queued_subscribe_info_holds_up_no_message(
        pulsar_broker, tmp_path):
    """A node whose queued SubscribeInfo is retried but answered only after
    ``push_timeout_s`` (its subscription is slow to make): messages keep being accepted and
    pushed to the other node meanwhile (the retry holds no lock of the sending path), and
    once the node answers in time its queue empties and nothing is lost."""
    nodes = (0, 1)
    with rig(pulsar_broker, tmp_path, nodes,
             ctl_kw={"subscribe_timeout_s": 3.0, "retry_backoff_s": 0.02}) as r:
        r.ctl.set_channels({0: RPC, 1: RPC}, {0: nodes, 1: (0,)})
        r.send(0, resource_id=0, hosts=nodes)
        r.delivered(every=True)
        agent = r.host.agents[1]
        r.host.call(agent._server.stop(0))
        r.ctl.set_channels({0: 1}, {0: nodes})       # node 1 cannot hear the SubscribeInfo
        # (node 0's may outlast the timeout on a cold broker: retried until here)
        wait_until(lambda: r.ctl.pending_subscribe_infos() == {1: 1}, 20,
                   "only node 1's SubscribeInfo queued")
        slow, tried = [True], []
        subscribe = agent._subscribe

        def slow_subscribe(*a):
            if slow[0]:
                tried.append(time.monotonic())
                time.sleep(3.0)                        # > push_timeout_s (2 s)
                raise RuntimeError("a slow broker lookup")
            return subscribe(*a)

        agent._subscribe = slow_subscribe
        assert r.host.call(agent.serve()) == agent.port
        wait_until(lambda: len(tried) >= 1, 15, "the queued SubscribeInfo retried")
        worst, t_end = 0.0, time.monotonic() + 4.0
        k = 0
        while time.monotonic() < t_end:
            t = time.monotonic()
            r.send(1, resource_id=10 + k % 4, hosts=(0,))
            r.ctl.flush(wait=False)
            worst = max(worst, time.monotonic() - t)
            k += 1
            time.sleep(0.05)
        assert len(tried) >= 2 and r.ctl.pending_subscribe_infos() == {1: 1}
        assert worst < 1.0, f"a send waited {worst:.2f} s for the retried SubscribeInfo"
        slow[0] = False
        wait_until(lambda: not r.ctl.pending_subscribe_infos(), 20, "queued SubscribeInfos")
        r.send(0, resource_id=1, hosts=nodes)
        r.delivered(every=True)
        assert_arrived(r)


def test_crash_between_leaving_a_topic_and_deleting_its_subscription(pulsar_broker, tmp_path):
    """An agent that recorded leaving a topic but died before deleting its durable
    subscription (the record's last word on the topic is "unsubscribed", not "deleted")
    deletes it at its next start instead of draining for a fence that went by."""
    nodes = (0, 1)
    hosts = {0: nodes}
    with rig(pulsar_broker, tmp_path, nodes, ctl_kw={"subscribe_timeout_s": 1.0}) as r:
        r.ctl.set_channels({0: 1}, hosts)
        for k in range(5):
            r.send(0, resource_id=k, hosts=nodes)
        r.delivered(every=True)
        r.host.stop_agent(1)
        r.ctl.set_channels({0: RPC}, hosts)
        store = MetadataStore(r.store_url)
        until = next(s.until_ns for s in store.subscriptions_of(1) if s.topic == r.topic(1))
        store.close()
        with open(r.record_dir / "node-1.record", "a") as f:   # as if it died right there
            f.write(f"S\t{r.topic(1)}\tunsubscribed\t{until}\n")
        assert subscription_name(1) in admin_subscriptions(r.broker, r.topic(1))
        r.host.start_agent(1)
        wait_until(lambda: subscription_name(1) not in admin_subscriptions(r.broker,
                                                                       r.topic(1)), 15,
                   "the leftover durable subscription deleted")
        _, subs = read_record(r.record_dir / "node-1.record")
        assert subs[r.topic(1)] == ("deleted", until)
        assert r.host.agents[1].topics() == {}
        for k in range(5, 10):
            r.send(0, resource_id=k % 5, hosts=nodes)
        r.delivered(every=True)


def test_redelivery_is_a_duplicate_not_out_of_order(tmp_path):
    """An old message the resource already took (a redelivery after a crash or a broker
    restart, arriving after newer ones) is DUPLICATE, also after a restart that rebuilds the
    cache from the record; an old message it never took is OUT_OF_ORDER; neither is
    applied."""
    from delivery.agent import RECENT_APPLIED, MessageAgent, PulsarClients
    from delivery.wire import encode

    def agent() -> MessageAgent:
        a = MessageAgent(AgentConfig(0, f"sqlite:///{tmp_path / 'meta.db'}", tmp_path),
                         PulsarClients(None))
        a._recover()
        return a

    def cm(ts: int):
        return encode(Message(ts, ts, 1, "SUBNET", OP, 7, 64, (0,), ts), 0, b"")

    a = agent()
    stamps = [100 * (i + 1) for i in range(RECENT_APPLIED + 2)]
    for ts in stamps:
        assert a.handle(cm(ts), "rpc") == pb.APPLIED
    assert a.handle(cm(stamps[-1]), "t1") == pb.DUPLICATE
    assert a.handle(cm(stamps[-3]), "t1") == pb.DUPLICATE
    assert a.handle(cm(stamps[-1] - 50), "t1") == pb.OUT_OF_ORDER   # never applied
    assert a.handle(cm(stamps[0]), "t1") == pb.OUT_OF_ORDER         # beyond the memory
    a.record.close()
    b = agent()                                                      # restarted
    assert b.handle(cm(stamps[-2]), "t1") == pb.DUPLICATE
    assert b.handle(cm(stamps[-1] - 50), "t1") == pb.OUT_OF_ORDER
    b.record.close()
    rows, _ = read_record(tmp_path / "node-0.record")
    assert [r.timestamp_ns for r in rows] == stamps


def test_channel_switches_while_agent_down(pulsar_broker, tmp_path):
    """While an agent is down its types switch RPC -> MQ -> RPC and MQ -> another topic: it
    never heard of the new subscriptions (the controller creates the durable one on the
    broker and the store holds it). Restarted, it recovers from the store: drains the topics
    it was unsubscribed from while down, subscribes to the new one, gets the reprogrammed RPC
    messages; every message applied once, in order, and the subscriptions agree."""
    nodes = (0, 1, 2)
    hosts = {0: nodes, 1: nodes}
    with rig(pulsar_broker, tmp_path, nodes,
             ctl_kw={"subscribe_timeout_s": 1.0, "retry_backoff_s": 0.02}) as r:
        r.ctl.set_channels({0: RPC, 1: 1}, hosts)
        phase = itertools.count()

        def burst(n: int = 20) -> None:
            p = next(phase)   # each phase its own resources: one channel each
            for k in range(n):
                r.send(k % 2, resource_id=100 * p + 10 * (k % 2) + k % 3, hosts=nodes)
            r.ctl.flush()

        burst()
        r.delivered(every=True)
        r.wait_subscriptions()   # a cold broker may outlast the 1 s timeout: retried until here
        failures = r.ctl.stats.subscribe_failures
        r.host.stop_agent(2)
        burst()
        r.ctl.set_channels({0: 2}, hosts)            # RPC -> MQ 2: node 2 cannot hear it
        assert r.ctl.stats.subscribe_failures - failures == 1
        burst()
        r.ctl.set_channels({0: RPC, 1: 3}, hosts)    # MQ 2 -> RPC, MQ 1 -> MQ 3
        burst()
        wait_until(lambda: r.ctl.pending().get(2, 0) > 0, 5, "node 2's reprogramming queue")
        r.host.start_agent(2)
        burst()
        r.delivered(every=True, timeout=40)
        r.wait_subscriptions()

        def recorded() -> dict:  # the agent records a deletion once the broker confirmed it
            return read_record(r.record_dir / "node-2.record")[1]

        wait_until(lambda: recorded()[r.topic(2)][0] == recorded()[r.topic(1)][0] == "deleted",
                   10, lambda: f"node 2's record: {recorded()}")
        rows, subs = read_record(r.record_dir / "node-2.record")
        assert subs[r.topic(3)][0] == "subscribed"
        assert {x.channel for x in rows} >= {"rpc", r.topic(1), r.topic(2), r.topic(3)}


# --------------------------------------------------------------------------- 7. bad input


def test_malformed_input_is_rejected_and_reported(pulsar_broker, tmp_path):
    """A malformed ConfigMessage over RPC, garbage bytes on a subscribed topic and malformed
    SubscribeInfos are rejected, reported as MALFORMED in the packed replies the controller
    collects, and the agents keep working; a malformed MQ message (even with a timestamp
    from the future) does not end the drain of a topic the agent is leaving."""
    nodes = (0, 1)
    hosts = {0: nodes, 1: nodes}
    with rig(pulsar_broker, tmp_path, nodes, ctl_kw={"collect_period_s": 3600}) as r, \
            r.agent_channel(0) as ch:
        r.ctl.set_channels({0: RPC, 1: 1}, hosts)
        stub = pb_grpc.MessageAgentStub(ch)
        ok = pb.ConfigMessage(message_id=9001, vpc_id=1, timestamp_ns=r.ctl.timestamp(),
                              configuration_type="SUBNET", operation_type=OP,
                              resource_id=1, hosts=[0])
        unknown_type = pb.ConfigMessage()
        unknown_type.CopyFrom(ok)
        unknown_type.message_id, unknown_type.configuration_type = 9002, "WORMHOLE"
        no_hosts = pb.ConfigMessage()
        no_hosts.CopyFrom(ok)
        no_hosts.message_id = 9003
        del no_hosts.hosts[:]
        ack = stub.Push(pb.ConfigBatch(messages=[unknown_type, no_hosts]), timeout=5)
        assert (ack.accepted, ack.rejected) == (0, 2)
        for info in (pb.SubscribeInfo(url="http://nowhere", topic=r.topic(1),
                                      subscription=subscription_name(0), timestamp_ns=1,
                                      operation=True),
                     pb.SubscribeInfo(url=pulsar_broker.service_url, topic="",
                                      subscription=subscription_name(0), timestamp_ns=1,
                                      operation=True)):
            sack = stub.Subscribe(info, timeout=5)
            assert not sack.ok and sack.error
        # node 0 is told to leave topic 1 (as in a switch, before the controller's fence): it
        # drains the topic; garbage, a malformed message stamped far in the future, then a
        # good message published before the switch arrive on it
        good = pb.ConfigMessage()
        good.CopyFrom(ok)
        good.message_id, good.resource_id, good.timestamp_ns = 9100, 5, r.ctl.timestamp()
        r.ledger.sent[0][(1, "SUBNET", 5)].append((good.timestamp_ns, 9100))
        leave = pb.SubscribeInfo(url=pulsar_broker.service_url, topic=r.topic(1),
                                 subscription=subscription_name(0),
                                 timestamp_ns=r.ctl.timestamp(),
                                 operation=False)
        assert stub.Subscribe(leave, timeout=5).ok
        assert r.host.agents[0].topics() == {r.topic(1): "draining"}
        client = pulsar.Client(pulsar_broker.service_url,
                               **client_args(r.security, "controller"))
        try:
            producer = client.create_producer(r.topic(1))
            producer.send(b"\xff\xfe garbage, not a TopicEnvelope \x00\x01")
            bad_env = pb.ConfigMessage()
            bad_env.CopyFrom(no_hosts)
            bad_env.timestamp_ns = 2**62
            producer.send(envelope(bad_env))
            producer.send(envelope(good))
            producer.close()
        finally:
            client.close()
        wait_until(lambda: any(x.message_id == 9100 for x in read_record(
            r.record_dir / "node-0.record")[0]), 10, "the good message on the draining topic")
        assert r.host.agents[0].topics() == {r.topic(1): "draining"}
        back = pb.SubscribeInfo()
        back.CopyFrom(leave)
        back.operation, back.timestamp_ns = True, r.ctl.timestamp()
        assert stub.Subscribe(back, timeout=5).ok   # the controller's view again
        # both agents got both MQ messages (subscribed to topic 1); node 0 also the rest
        expected = 2 + 2 + 2 * 2
        wait_until(lambda: r.ctl.collect() >= 0 and
                   r.ctl.stats.outcomes.get("MALFORMED", 0) >= expected, 10,
                   lambda: f"{expected} MALFORMED results, got {outcomes(r)}")
        assert r.ctl.stats.outcomes["MALFORMED"] == expected
        errs = [(n, kind, mid) for n, kind, mid, _ in r.ctl.stats.errors]
        assert (0, "MALFORMED", 9002) in errs and (0, "MALFORMED", 9003) in errs
        assert sum(1 for n, k, _ in errs if n == 1 and k == "MALFORMED") == 2
        # still running: good messages on both channels are applied
        assert r.host.agents[0].topics() == {r.topic(1): "subscribed"}
        for k in range(20):
            r.send(k % 2, resource_id=10 * (k % 2) + k % 3, hosts=hosts[k % 2])
        r.delivered(every=True)
        wait_until(lambda: r.ctl.collect() >= 0 and
                   r.ctl.stats.outcomes.get("APPLIED", 0) >= r.ledger.total(), 10,
                   lambda: f"{r.ledger.total()} APPLIED results, got {outcomes(r)}")
        assert r.ctl.stats.outcomes["APPLIED"] == r.ledger.total()


# --------------------------------------------------------------------------- 8. packed replies


def test_packed_replies_collected(pulsar_broker, tmp_path):
    """The controller collects packed replies periodically; acknowledged results leave the
    agents; every result is counted once."""
    nodes = (0, 1, 2)
    hosts = {0: nodes, 1: (0,), 2: (1, 2)}
    with rig(pulsar_broker, tmp_path, nodes, ctl_kw={"collect_period_s": 0.2},
             agent_kw={"report_after_s": 3600}) as r:
        r.ctl.set_channels({0: RPC, 1: 1, 2: 2}, hosts)
        for k in range(60):
            r.send(k % 3, resource_id=k % 4, hosts=hosts[k % 3], vpc=k % 3)
        r.delivered(every=True)
        total = r.ledger.total()
        wait_until(lambda: r.ctl.stats.outcomes.get("APPLIED", 0) >= total, 10,
                   lambda: f"{total} APPLIED results, got {outcomes(r)}")
        wait_until(lambda: all(a.pending_results() == 0 for a in r.host.agents.values()), 5,
                   "acknowledged results to leave the agents")
        assert outcomes(r) == {"APPLIED": total}
        counters = r.host.counters()
        assert all(c["replies_collected"] > 0 and c["replies_reported"] == 0
                   for c in counters.values())


def test_packed_replies_reported_by_agents(pulsar_broker, tmp_path):
    """With the controller's collection effectively off, agents send their packed replies on
    their own after report_after_s to the controller's Report; a repeated reply, and a later
    collection, are not counted twice (result_seq)."""
    nodes = (0, 1, 2)
    hosts = {0: nodes, 1: (2,)}
    with rig(pulsar_broker, tmp_path, nodes, ctl_kw={"collect_period_s": 3600},
             agent_kw={"report_after_s": 0.3, "pack_period_s": 0.05}) as r:
        r.ctl.set_channels({0: RPC, 1: 1}, hosts)
        for k in range(40):
            r.send(k % 2, resource_id=10 * (k % 2) + k % 4, hosts=hosts[k % 2])
        r.delivered(every=True)
        total = r.ledger.total()
        wait_until(lambda: r.ctl.stats.outcomes.get("APPLIED", 0) >= total, 10,
                   lambda: f"{total} APPLIED results reported, got {outcomes(r)}")
        wait_until(lambda: all(a.pending_results() == 0 for a in r.host.agents.values()), 5,
                   "reported results to be acknowledged")
        wait_until(lambda: all(c["replies_reported"] > 0 for c in r.host.counters().values()),
                   5, "every agent to count its acknowledged report")
        counters = r.host.counters()
        assert all(c["replies_reported"] > 0 and c["replies_collected"] == 0
                   for c in counters.values()), counters
        assert sum(c["replies_reported"] for c in counters.values()) < total
        # a repeated (old) reply and a collection now add nothing
        old = pb.PackedReply(node_id=0, sequence=1, results=[pb.ProgrammingResult(
            message_id=1, outcome=pb.APPLIED, result_seq=1, node_id=0)])
        with r.channel(r.ctl.reply_address, "agent-0") as ch:
            ack = pb_grpc.ControllerRepliesStub(ch).Report(old, timeout=5)
        assert ack.acknowledged >= 1
        assert r.ctl.collect() == 0
        assert outcomes(r) == {"APPLIED": total}
        # more traffic: reported again, still counted once
        for k in range(40, 60):
            r.send(k % 2, resource_id=10 * (k % 2) + k % 4, hosts=hosts[k % 2])
        r.delivered(every=True)
        total = r.ledger.total()
        wait_until(lambda: r.ctl.stats.outcomes.get("APPLIED", 0) >= total, 10,
                   lambda: f"{total} APPLIED results reported, got {outcomes(r)}")
        time.sleep(0.5)
        assert outcomes(r) == {"APPLIED": total}
