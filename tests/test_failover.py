"""Delivery through failures, end to end on a real broker, real gRPC and real agents: the
controller's durable outbox and its recovery from the store, channel failover when the
broker is killed (SIGKILL), a node reached through a topic while its RPC endpoint is down,
and over RPC while its subscription is not working. Delivery is judged from the agents'
programming records against the ledger (``tests/delivery_rig.py``): for every (node,
resource) applied timestamps strictly increase, every applied message was sent there, and
the newest sent is applied."""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time

import pytest

from delivery.agent import read_record
from delivery.controller import RPC, ConfigError, Controller, ControllerConfig, id_ranges
from delivery.store import MetadataStore
from envs.netutil import free_ports
from harness.broker import PulsarStandalone
from security.pulsar import subscription_name

from .delivery_rig import assert_arrived, assert_delivered, rig, wait_until

pytestmark = pytest.mark.xdist_group("pulsar")


# --------------------------------------------------------------------------- configuration


def test_failover_log_lines_give_type_ranges() -> None:
    """A failover of hundreds of types is one readable line: runs of three or more ids are
    ranges, shorter runs stay single ids."""
    assert id_ranges([]) == "[]"
    assert id_ranges([2, 1]) == "[1, 2]"
    assert id_ranges([*range(396), 397]) == "[0-395, 397]"
    assert id_ranges([5, 3, 4, 9, 10, 11, 20, 4]) == "[3-5, 9-11, 20]"



@pytest.mark.parametrize(("mapping", "key"), [
    ({"failover": {"probe_period_s": -1}}, "probe_period_s"),
    ({"failover": {"fail_after": "two"}}, "fail_after"),
    ({"failover": {"relay_after": 1}}, "relay_after"),
    ({"failover": {"controller_bw_bps": True}}, "controller_bw_bps"),
    ({"push_timeout_s": 0}, "push_timeout_s"),
    ({"outbox": "yes"}, "outbox"),
    ({"bogus": 1}, "bogus"),
])
def test_bad_delivery_config_refused_before_the_store_opens(tmp_path, mapping, key):
    """A malformed controller or failover configuration is a ConfigError that names the key;
    it is raised before the metadata store is opened, so nothing stored changes."""
    url = f"sqlite:///{tmp_path / 'meta.db'}"
    store = MetadataStore(url)
    store.write_mapping([(3, 1, "persistent://public/default/x-t1", [0, 1])], 5)
    store.outbox_put([(7, 3, 1, b"body", [0, 1])], 7)
    store.close()
    before = (tmp_path / "meta.db").read_bytes()
    with pytest.raises(ConfigError, match=key):
        ControllerConfig.from_mapping({"pulsar_url": "pulsar://127.0.0.1:1",
                                       "store_url": url, **mapping})
    assert (tmp_path / "meta.db").read_bytes() == before
    store = MetadataStore(url)
    try:
        assert [r.ts_ns for r in store.outbox_unconfirmed()] == [7]
    finally:
        store.close()


# --------------------------------------------------------------------------- durable outbox


def test_outbox_confirmed_by_packed_replies(pulsar_broker, tmp_path):
    """Every accepted message is in the outbox before send returns; the packed replies
    confirm every destination, and the outbox empties."""
    nodes = (0, 1, 2)
    hosts = {0: nodes, 1: (1,), 2: (0, 2)}
    with rig(pulsar_broker, tmp_path, nodes) as r:
        r.ctl.set_channels({0: 1, 1: RPC, 2: 2}, hosts)
        r.send(1, resource_id=99, hosts=hosts[1])
        assert r.ctl.store.outbox_size() == (1, 1)   # durable before anything was pushed
        for k in range(60):
            r.send(k % 3, resource_id=10 * (k % 3) + k % 4, hosts=hosts[k % 3])
        r.delivered(every=True)
        wait_until(lambda: r.ctl.store.outbox_size() == (0, 0), 15,
                   lambda: f"outbox confirmed: {r.ctl.store.outbox_size()} left")
        assert r.ctl.stats.outbox_stored == 61
        assert r.ctl.stats.outbox_confirmed == sum(len(hosts[k % 3]) for k in range(60)) + 1


def test_restart_rebuilds_state_from_store(pulsar_broker, tmp_path):
    """Controller A is abandoned with node 1 unreachable (its messages queued) and a switch
    made; controller B on the same store rebuilds channels, hosts, node topics and the
    queue of node 1, issues larger timestamps, and delivers everything once node 1 is back;
    the re-delivered messages other nodes already held come back as duplicates."""
    nodes = (0, 1, 2)
    hosts = {0: nodes, 1: (1, 2), 2: (0,)}
    reply_port = free_ports(1)[0]
    ctl_kw = {"reply_port": reply_port, "push_retries": 1, "retry_backoff_s": 0.02,
              "subscribe_timeout_s": 1.0}
    with rig(pulsar_broker, tmp_path, nodes, ctl_kw=ctl_kw) as r:
        a = r.ctl
        a.set_channels({0: 1, 1: RPC, 2: 2}, hosts)
        for k in range(30):
            r.send(k % 3, resource_id=10 * (k % 3) + k % 4, hosts=hosts[k % 3])
        r.delivered(every=True)
        assert r.host is not None
        r.host.stop_agent(1)
        for k in range(30, 60):
            r.send(k % 3, resource_id=10 * (k % 3) + k % 4, hosts=hosts[k % 3])
        a.flush()
        wait_until(lambda: a.pending().get(1), 10, "node 1's queue")
        channels, topics = dict(a.channel), {n: set(v) for n, v in a.node_topics.items()}
        last_ts = a.timestamp()
        # "crash": A stops without confirming anything more (its threads and server end)
        a._stop.set()
        if a._server is not None:
            a._server.stop(0).wait()
        for t in a._threads:
            t.join(5)
        b = Controller(ControllerConfig(pulsar_broker.service_url, r.store_url,
                                        topic_prefix=r.prefix, collect_period_s=0.3,
                                        reprogram_period_s=0.2, security=r.security,
                                        pulsar_admin_url=pulsar_broker.admin_url,
                                        **ctl_kw),
                       dict(a.agents)).start()
        try:
            r.ctl = b
            assert b.channel == channels
            assert {n: v for n, v in b.node_topics.items() if v} == \
                {n: v for n, v in topics.items() if v}
            assert b.hosts[1] == (1, 2)
            assert b.pending().get(1), "node 1's unconfirmed messages are queued again"
            assert b.timestamp() > last_ts
            assert b.stats.outbox_redelivered > 0
            r.host.start_agent(1)
            for k in range(60, 75):
                r.send(k % 3, resource_id=10 * (k % 3) + k % 4, hosts=hosts[k % 3])
            r.delivered(timeout=60)
            assert_arrived(r)
            wait_until(lambda: b.store.outbox_size() == (0, 0), 20,
                       lambda: f"outbox confirmed: {b.store.outbox_size()} left")
        finally:
            r.ctl = a
            b.close()


def test_corrupt_outbox_row_refused_others_delivered(pulsar_broker, tmp_path):
    """One outbox row's body damaged on disk: the restarted controller refuses it (logged
    with its timestamp, counted), keeps it in the store, and delivers every other row."""
    nodes = (0, 1)
    hosts = {0: nodes}
    with rig(pulsar_broker, tmp_path, nodes, ctl_kw={"push_retries": 0}) as r:
        r.ctl.set_channels({0: RPC}, hosts)
        assert r.host is not None
        r.host.stop_agent(1)
        sent = [r.send(0, resource_id=k, hosts=nodes) for k in range(6)]
        r.ctl.flush()
        wait_until(lambda: r.ctl.store.outbox_size()[1] == 6, 10,
                   "node 0's confirmations")   # node 1's six remain
        r.ctl.close()
        bad = sent[2].timestamp_ns
        with sqlite3.connect(tmp_path / "meta.db") as db:
            db.execute("UPDATE outbox SET body = X'00ff00ff' WHERE ts_ns = ?", (bad,))
        r.ctl = Controller(ControllerConfig(pulsar_broker.service_url, r.store_url,
                                            topic_prefix=r.prefix, collect_period_s=0.3,
                                            reprogram_period_s=0.2, security=r.security,
                                            pulsar_admin_url=pulsar_broker.admin_url),
                           dict(r.ctl.agents)).start()
        assert r.ctl.stats.outbox_corrupt == 1
        r.host.start_agent(1)
        rows = {}

        def applied() -> set[int]:
            rows[1], _ = read_record(r.record_dir / "node-1.record")
            return {x.message_id for x in rows[1]}

        want = {m.message_id for m in sent} - {sent[2].message_id}
        wait_until(lambda: want <= applied(), 30, lambda: f"node 1 applied {applied()}")
        assert sent[2].message_id not in applied()
        left = {row.ts_ns: row for row in r.ctl.store.outbox_unconfirmed()}
        wait_until(lambda: set(r.ctl.store.outbox_size()) == {1}, 15, "the others confirmed")
        left = {row.ts_ns: row for row in r.ctl.store.outbox_unconfirmed()}
        assert list(left) == [bad] and not left[bad].intact   # kept, never deleted


# --------------------------------------------------------------------------- node faults


def test_rpc_endpoint_down_relayed_through_topic(pulsar_broker, tmp_path):
    """Node 1's RPC endpoint is down (its gRPC server stopped, the agent and its topic
    subscription kept): after relay_after_s its queued RPC messages are relayed on its
    topic (the other subscriber, node 0, receives them as not-for-me), and they are applied
    while the endpoint is still down; the packed replies the agent sends on its own confirm
    them, which empties its reprogramming queue."""
    nodes = (0, 1)
    hosts = {0: nodes, 1: (1,)}
    with rig(pulsar_broker, tmp_path, nodes,
             ctl_kw={"push_retries": 0, "retry_backoff_s": 0.02,
                     "failover": {"relay_after_s": 0.5}}) as r:
        r.ctl.set_channels({0: 1, 1: RPC}, hosts)
        r.wait_subscriptions()
        assert r.host is not None
        agent = r.host.agents[1]
        r.host.call(agent._server.stop(0))
        t0 = time.monotonic()
        for k in range(20):
            r.send(1, resource_id=k % 5, hosts=(1,))
        r.ctl.flush()

        def via_topic() -> int:
            rows, _ = read_record(r.record_dir / "node-1.record")
            return sum(1 for x in rows if x.channel == r.topic(1))

        wait_until(lambda: via_topic() >= 20, 20, lambda: f"{via_topic()} relayed rows")
        took = time.monotonic() - t0
        print(f"\nrelayed 20 messages to node 1 in {took:.2f} s")
        assert r.ctl.stats.relayed >= 20
        assert 1 in r.ctl.health()["unreachable"] and 1 in r.ctl.health()["relayed"]
        wait_until(lambda: r.host.agents[0].counters.not_for_me >= 20, 10,
                   "node 0's not-for-me copies")
        r.delivered(every=True)   # the relayed copies were applied: queue confirmed away
        wait_until(lambda: not r.ctl.pending(), 15, "node 1's queue confirmed away")
        assert_arrived(r)


def test_node_subscription_down_rpc_up(pulsar_broker, tmp_path):
    """Node 1 answers RPC but its consumer of topic 1 is gone: the MQ messages it does not
    confirm within confirm_timeout_s are re-sent over RPC and applied; when it subscribes
    again the backlog arrives as duplicates (or superseded), nothing is applied twice."""
    nodes = (0, 1)
    hosts = {0: nodes}
    with rig(pulsar_broker, tmp_path, nodes,
             ctl_kw={"failover": {"confirm_timeout_s": 1.0}}) as r:
        r.ctl.set_channels({0: 1}, hosts)
        r.wait_subscriptions()
        assert r.host is not None
        agent = r.host.agents[1]
        consumer = agent._consumers[r.topic(1)]
        consumer.close()
        t0 = time.monotonic()
        for k in range(15):
            r.send(0, resource_id=k % 3, hosts=nodes)
        r.ctl.flush()

        def via_rpc() -> int:
            rows, _ = read_record(r.record_dir / "node-1.record")
            return sum(1 for x in rows if x.channel == "rpc")

        wait_until(lambda: via_rpc() >= 15, 20, lambda: f"{via_rpc()} rescued rows")
        print(f"\nnode 1 got 15 MQ messages over RPC after {time.monotonic() - t0:.2f} s")
        assert r.ctl.stats.mq_rescued >= 15
        r.delivered(every=True)
        with agent._sub_guard:
            agent._consumers.pop(r.topic(1))
        agent._subscribe(r.topic(1), subscription_name(1), pulsar_broker.service_url)
        for k in range(15, 20):
            r.send(0, resource_id=k % 3, hosts=nodes)
        r.delivered(every=True)
        assert_arrived(r)
        wait_until(lambda: r.ctl.stats.outcomes.get("DUPLICATE", 0) > 0, 15,
                   "the backlog's duplicates")


# --------------------------------------------------------------------------- broker failure


@pytest.mark.slow  # kills and restarts a broker JVM of its own
@pytest.mark.timeout(600)
def test_broker_sigkill_failover_and_back(tmp_path):
    """A broker of its own is SIGKILLed for 30 s under load. Types 1 and 2 (MQ) move to RPC
    within the controller's capacity and keep arriving (p99 delay bounded, printed); type 3,
    whose RPC cost is above C_b, waits and arrives after the restart, in order; after
    recovery types 1 and 2 are back on their topics; nothing lost, applied twice or out of
    order."""
    nodes = (0, 1, 2, 3)
    hosts = {0: (0,), 1: (0, 1), 2: (2, 3), 3: nodes}
    size = {0: 100, 1: 100, 2: 100, 3: 20_000}
    # type 3: 10 msg/s * 20 kB * 8 * 4 hosts = 6.4 Mbit/s over RPC (1.6 Mbit/s should a loaded
    # machine slow the sender to a quarter), above C_b; the others, 16 kbit/s each, fit
    fo = {"controller_bw_bps": 600_000, "controller_cpu": 1e6, "rate_window_s": 4.0}
    with PulsarStandalone(progress=None, work_dir=tmp_path / "broker") as broker, \
            rig(broker, tmp_path, nodes, ctl_kw={"failover": fo}) as r:
        r.ctl.set_channels({0: RPC, 1: 1, 2: 2, 3: 3}, hosts)
        r.wait_subscriptions()
        stop = threading.Event()
        sent: list[tuple[float, int, int]] = []   # (monotonic, type, timestamp)

        def sender() -> None:
            k = 0
            while not stop.is_set():
                t = k % 4
                m = r.send(t, resource_id=k % 7, hosts=hosts[t], size=size[t], vpc=t + 1)
                sent.append((time.monotonic(), t, m.timestamp_ns))
                if k % 4 == 3:
                    r.ctl.flush()
                k += 1
                time.sleep(0.025)

        th = threading.Thread(target=sender, daemon=True)
        th.start()
        try:
            time.sleep(8)
            # a loaded machine may have flapped the probe while the broker was young
            wait_until(lambda: r.ctl.health()["mq"] == "up" and r.ctl.stats.failovers
                       == r.ctl.stats.failbacks, 30, "MQ up before the kill")
            failovers = r.ctl.stats.failovers
            killed_ns, killed = time.time_ns(), time.monotonic()
            assert broker.pid is not None
            os.kill(broker.pid, signal.SIGKILL)
            broker.wait(30)
            wait_until(lambda: r.ctl.health()["mq"] == "down", 10, "MQ declared down")
            detected = time.monotonic() - killed
            wait_until(lambda: r.ctl.stats.failovers == failovers + 1, 10, "the failover")
            health = r.ctl.health()
            assert health["rerouted"] == [1, 2] and health["waiting"] == [3], health
            time.sleep(max(0.0, 30 - (time.monotonic() - killed)))
            restart = time.monotonic()
            broker.start()
            restarted_ns = time.time_ns()
            wait_until(lambda: r.ctl.stats.failbacks == failovers + 1, 60, "the failback")
            back = time.monotonic() - restart
            time.sleep(10)
        finally:
            stop.set()
            th.join(30)
        assert r.ctl.channel == {0: RPC, 1: 1, 2: 2, 3: 3}
        r.ctl.flush()
        assert_delivered(r.record_dir, r.ledger, r.nodes, timeout=120,
                         pending=r.ctl.pending)
        assert_arrived(r, timeout=60)
        # delays during the outage, from the records
        rows = {n: read_record(r.record_dir / f"node-{n}.record")[0] for n in nodes}
        outage = [x for rs in rows.values() for x in rs
                  if killed_ns + detected * 1e9 <= x.timestamp_ns < restarted_ns]
        moved = sorted((x.applied_ns - x.timestamp_ns) / 1e9 for x in outage
                       if x.configuration_type == "SUBNET" and x.vpc_id in (2, 3))
        assert moved, "no message of a moved type was applied during the outage"
        assert all(x.channel == "rpc" for x in outage if x.vpc_id in (2, 3))
        p99 = moved[int(0.99 * (len(moved) - 1))]
        waited = [x for x in outage if x.vpc_id == 4]
        assert waited and all(x.applied_ns >= restarted_ns for x in waited)
        print(f"\nMQ down detected after {detected:.2f} s; moved types' outage delays: "
              f"p50 {moved[len(moved) // 2]:.3f} s, p99 {p99:.3f} s, max {moved[-1]:.3f} s "
              f"({len(moved)} rows); failback {back:.1f} s after the restart; "
              f"{len(waited)} type-3 rows waited")
        assert detected <= r.ctl.cfg.failover.detection_bound_s + 1.0
        assert p99 <= 5.0
