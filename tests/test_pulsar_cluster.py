"""Delivery through a real Pulsar cluster (``harness.pulsar_cluster``: one ZooKeeper, two
bookies, two brokers, TLS and authorisation as the standalone broker), and a broker killed
under load: the topics it owned move to the other broker and delivery goes on, exactly once
and in order per resource. Delivery is judged from the agents' programming records against
the ledger (``tests/delivery_rig.py``)."""

from __future__ import annotations

import http.server
import itertools
import json
import signal
import threading
import time

import pytest

from delivery.agent import read_record
from delivery.controller import RPC
from harness.broker import BrokerError, BrokerStartError
from harness.pulsar_cluster import PulsarCluster
from security.pulsar import admin_call
from security.tls import Security

from .delivery_rig import rig, wait_until

pytestmark = pytest.mark.xdist_group("pulsar")


@pytest.mark.parametrize(("kw", "name"), [
    ({"brokers": 0}, "brokers"),
    ({"bookies": True}, "bookies"),
    ({"bookies": 1, "replicas": 2}, "replicas"),
    ({"session_timeout_ms": 1000}, "session_timeout_ms"),
])
def test_bad_cluster_shape_refused_before_anything_starts(tmp_path, kw, name):
    """A cluster that cannot work (no broker, more replicas than bookies, a session timeout
    ZooKeeper refuses) is a BrokerError naming the parameter, raised at construction, before
    a process or a directory exists."""
    with pytest.raises(BrokerError, match=name):
        PulsarCluster(work_dir=tmp_path / "cluster", progress=None, **kw)
    assert not (tmp_path / "cluster").exists()


def test_admin_calls_follow_a_brokers_redirect():
    """A cluster's broker answers a call on a topic it does not own with a redirect to the
    owner; the admin client follows it with the same method and body (and gives up after
    three hops, naming the call)."""
    seen: list[tuple[str, str, bytes]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def do_PUT(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            seen.append((self.server.server_port, self.path, body))
            if self.path.startswith("/loop"):
                self.send_response(307)
                self.send_header("Location", f"http://127.0.0.1:{owner.server_port}/loop")
            elif self.server is not owner:
                self.send_response(307)
                self.send_header("Location", f"http://127.0.0.1:{owner.server_port}{self.path}")
            else:
                self.send_response(200)
                out = json.dumps({"owner": True}).encode()
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
                return
            self.send_header("Content-Length", "0")
            self.end_headers()

    owner = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    for s in (owner, other):
        threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        insecure = Security(insecure=True)
        got = admin_call(f"http://127.0.0.1:{other.server_port}", "PUT", "/admin/v2/x",
                         {"a": 1}, security=insecure)
        assert got == {"owner": True}
        assert [(p, path) for p, path, _ in seen] == [(other.server_port, "/admin/v2/x"),
                                                      (owner.server_port, "/admin/v2/x")]
        assert seen[1][2] == b'{"a": 1}'
        with pytest.raises(Exception, match="307"):
            admin_call(f"http://127.0.0.1:{other.server_port}", "PUT", "/loop", {},
                       security=insecure)
    finally:
        for s in (owner, other):
            s.shutdown()
            s.server_close()


@pytest.mark.slow  # starts ZooKeeper and the metadata setup
@pytest.mark.timeout(300)
def test_a_process_that_fails_to_start_is_named_and_the_rest_stopped(tmp_path):
    """A bookie whose JVM cannot start (a heap too small to boot) fails the cluster's start
    with a BrokerStartError naming that bookie, its exit and its log; ZooKeeper, already
    serving, is stopped, and nothing of the cluster is left running."""
    cluster = PulsarCluster(work_dir=tmp_path / "cluster", progress=None, heap="1k")
    with pytest.raises(BrokerStartError, match=r"bookie-\d: exited with code") as err:
        cluster.start()
    assert "log tail" in str(err.value)
    assert cluster.zookeeper is not None and not cluster.zookeeper.running
    assert not any(p.running for p in cluster.bookies)
    assert (tmp_path / "cluster" / "zookeeper.log").stat().st_size > 0
    cluster.close()


@pytest.mark.slow  # a cluster of five JVMs of its own
@pytest.mark.timeout(600)
def test_a_broker_killed_under_load_its_topics_move_and_delivery_goes_on(tmp_path):
    """Six MQ types on six topics and one RPC type to four nodes through a secure two-broker
    cluster; the broker that owns most of the topics is SIGKILLed under load. The topics it
    owned move to the other broker (after its metadata session expires), the controller's
    producers and the agents' consumers follow them there from the multi-host service URL,
    and every message is applied exactly once and in order (the controller's channel
    failover is off: the cluster alone carries the MQ types through). The time without
    delivery of the moved types is printed."""
    nodes = (0, 1, 2, 3)
    types = range(7)
    hosts = {t: tuple(n for n in nodes if (n + t) % 3 != 0) or nodes for t in types}
    channels = {0: RPC, **{t: t for t in types if t}}
    with PulsarCluster(work_dir=tmp_path / "cluster", progress=None) as cluster, \
            rig(cluster, tmp_path, nodes, ctl_kw={"failover": {"enabled": False}}) as r:
        r.ctl.set_channels(channels, hosts)
        r.wait_subscriptions(timeout=60)
        owners = {t: cluster.owner(r.topic(t)) for t in types if t}
        counts = [sum(1 for o in owners.values() if o == b) for b in range(2)]
        victim = max(range(2), key=lambda b: counts[b])
        moved = sorted(t for t, o in owners.items() if o == victim)
        stop = threading.Event()
        errors: list[BaseException] = []

        def sender() -> None:
            k = 0
            try:
                while not stop.is_set():
                    t = k % 7
                    r.send(t, resource_id=(k // 7) % 5, hosts=hosts[t], vpc=t + 1)
                    r.ctl.flush(wait=False)
                    k += 1
                    time.sleep(0.02)
            except BaseException as e:
                errors.append(e)

        th = threading.Thread(target=sender, daemon=True)
        th.start()
        try:
            time.sleep(5)
            killed_ns = time.time_ns()
            cluster.kill_broker(victim, signal.SIGKILL)
            survivor = 1 - victim
            # the moved topics' messages reach the agents again from the survivor
            wait_until(lambda: all(cluster.owner(r.topic(t)) == survivor for t in moved), 60,
                       "the killed broker's topics owned by the survivor")
            time.sleep(15)
        finally:
            stop.set()
            th.join(30)
        assert not errors, errors
        r.delivered(timeout=120, every=True)
    by_node = {n: read_record(r.record_dir / f"node-{n}.record")[0] for n in nodes}
    rows = [x for rs in by_node.values() for x in rs]
    assert all(x.channel != "rpc" for x in rows if x.vpc_id - 1 in moved)

    def gap(ts: set[int]) -> float:
        """The longest time one node went without an applied row of one type of ``ts`` from
        the kill on (each agent's consumer reconnects on its own)."""
        worst = 0.0
        for rs in by_node.values():
            for t in ts:
                applied = sorted(x.applied_ns for x in rs
                                 if x.vpc_id - 1 == t and x.applied_ns >= killed_ns)
                worst = max([worst] + [(b - a) / 1e9 for a, b
                                       in itertools.pairwise([killed_ns, *applied])])
        return worst

    kept = {t for t in owners if t not in moved}
    after = sorted((x.applied_ns - x.timestamp_ns) / 1e9 for x in rows
                   if x.vpc_id - 1 in moved and x.timestamp_ns >= killed_ns)
    print(f"\nbroker {victim} (of topics {moved}) SIGKILLed; moved types' time without "
          f"delivery {gap(set(moved)):.1f} s (session timeout "
          f"{cluster.session_timeout_ms / 1000:.0f} s), kept types' "
          f"{gap(kept) if kept else float('nan'):.2f} s; delays of moved-type messages sent "
          f"after the kill: p50 {after[len(after) // 2]:.2f} s, max {after[-1]:.2f} s "
          f"({len(after)} rows); {len(rows)} rows applied")
    assert gap(set(moved)) < cluster.session_timeout_ms / 1000 + 45
    assert not kept or gap(kept) < gap(set(moved))  # the survivor's topics went on
