"""The RPC-pattern study (delivery.patterns) and its delaying relay (delivery.relay): settings
checked with clear errors, the relay transparent and delaying, and the study's machinery end
to end with real components on the emulated network (real gRPC agents over mutual TLS; a real
Pulsar broker in the slow test), delay and loss on."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from delivery import netem
from delivery.patterns import (
    WORKLOADS,
    PatternsError,
    StudyConfig,
    latency_summary,
    parse_workload,
    run_study,
    sessions,
)
from security.tls import Security

needs_netns = pytest.mark.skipif(netem.available() is not None,
                                 reason=f"emulated network: {netem.available()}")


def test_workloads_and_settings_are_checked() -> None:
    w = parse_workload("multicast/mq/fanout")
    assert (w.pattern, w.channel, w.flavour, w.round_trip) == ("multicast", "mq", "fanout",
                                                               False)
    assert parse_workload("unicast/rpc/call").round_trip
    assert len(WORKLOADS) == 8 and not any(k.endswith("mq/call") for k in WORKLOADS)
    with pytest.raises(PatternsError, match="unknown workload 'unicast/mq/call'"):
        parse_workload("unicast/mq/call")
    with pytest.raises(PatternsError, match="unknown key"):
        StudyConfig.from_mapping({"rate": 10})
    with pytest.raises(PatternsError, match="rate_per_s must be > 0"):
        StudyConfig(rate_per_s=0)
    with pytest.raises(PatternsError, match="workloads is empty"):
        StudyConfig(workloads=[])
    assert not StudyConfig(workloads=["unicast/rpc/cast"]).uses_mq


def test_sessions_of_the_parts() -> None:
    parts = {"scale": {"agents": [2, 4], "delay_ms": 0, "loss": 0.0, "relay": False},
             "grid": {"agents": [3], "delay_ms": [0, 10], "loss": [0, 0.01]}}
    ss = sessions(parts, ["scale", "grid"], repeats=2)
    assert [(s.part, s.agents, s.relay, len(s.points)) for s in ss] == [
        ("scale", 2, False, 2), ("scale", 4, False, 2), ("grid", 3, True, 8)]
    with pytest.raises(PatternsError, match="a delay needs relay: true"):
        sessions({"x": {"agents": 2, "delay_ms": 10, "relay": False}}, ["x"], 1)
    with pytest.raises(PatternsError, match=r"parts.x.loss"):
        sessions({"x": {"agents": 2, "loss": 2.0}}, ["x"], 1)
    with pytest.raises(PatternsError, match="part 'y' is not configured"):
        sessions(parts, ["y"], 1)


def test_latency_summary() -> None:
    s = latency_summary(list(range(1, 101)))
    assert s["p50_ms"] == pytest.approx(50.5) and s["max_ms"] == 100
    assert s["p99_ms"] == pytest.approx(99.01)
    assert all(v != v for v in latency_summary([]).values())  # NaN when nothing arrived


@needs_netns
def test_relay_is_transparent_delays_and_keeps_order() -> None:
    """A connection dialled to a node's address from the controller's namespace is
    redirected through the relay: it adds its delay each way (changed while it runs), the
    server still sees the controller's address, and a large transfer arrives intact."""
    from delivery.netem import EmulatedNetwork, NetworkSpec, in_netns, node_address
    from delivery.relay import RelayProcess, install_redirect, remove_redirect

    with EmulatedNetwork(NetworkSpec([1])) as net:
        with in_netns(net.node(1)):
            srv = socket.create_server((node_address(1), 7100))
        peers = []

        def serve() -> None:
            while True:
                try:
                    c, a = srv.accept()
                except OSError:
                    return
                peers.append(a[0])

                def echo(c: socket.socket = c) -> None:
                    while d := c.recv(65536):
                        c.sendall(d)
                    c.close()

                threading.Thread(target=echo, daemon=True).start()

        threading.Thread(target=serve, daemon=True).start()
        install_redirect(net.controller, "output", 7100, 7300, daddr="10.211.0.0/16")
        with RelayProcess(net.exec_prefix(net.controller), 7300, 20.0) as relay:
            for delay in (20.0, 5.0):
                relay.set_delay(delay)
                with in_netns(net.controller):
                    c = socket.create_connection((node_address(1), 7100))
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                rtts = []
                for _ in range(10):
                    t0 = time.perf_counter()
                    c.sendall(b"x")
                    assert c.recv(1) == b"x"
                    rtts.append(time.perf_counter() - t0)
                med = sorted(rtts)[5]
                assert 2 * delay / 1e3 <= med <= 2 * delay / 1e3 + 0.015, (delay, med)
                blob = bytes(range(256)) * 4096  # 1 MiB, echoed back in order
                got = bytearray()
                threading.Thread(target=c.sendall, args=(blob,), daemon=True).start()
                while len(got) < len(blob):
                    got += c.recv(1 << 16)
                assert bytes(got) == blob
                c.close()
        remove_redirect(net.controller)
        srv.close()
        assert peers and set(peers) == {netem.CONTROLLER_ADDRESS}


def _rows(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "runs.jsonl").read_text().splitlines()]


@needs_netns
def test_rpc_patterns_with_delay_and_loss(tmp_path: Path) -> None:
    """The machinery with real gRPC agents (mutual TLS, one namespace each) and a real
    sender: a call and a fan-out through the relay at 10 ms delay and 1% loss deliver
    everything, and the latencies carry the delay (a call twice, a fan-out once)."""
    def mine() -> set[str]:  # this process's networks (another test may run one meanwhile)
        return set(netem.list_namespaces(owner=os.getpid()))

    before = mine()
    cfg = StudyConfig(workloads=["unicast/rpc/call", "multicast/rpc/fanout"], rate_per_s=100,
                      duration_s=0.5, fanout_rounds=2, fanout_interval_s=0.2, sla_grace_s=5)
    parts = {"grid": {"agents": [3], "delay_ms": [10], "loss": [0.01], "relay": True}}
    rows = _rows(run_study(parts, ["grid"], 1, cfg, Security(), tmp_path, say=lambda _: None)
                 .parent)
    by = {r["workload"]: r for r in rows}
    assert set(by) == {"unicast/rpc/call", "multicast/rpc/fanout"}
    for r in rows:
        assert not r["failed"] and r["lost"] == 0 and r["errors"] == 0, r
        assert (r["delay_ms"], r["loss"], r["agents"]) == (10, 0.01, 3)
        # CPU time counts in clock ticks (10 ms): 50 calls that mostly wait on the relay's
        # delay can take less than one
        assert r["sender_tcp"] >= 3 and r["sender_cpu_s"] >= 0 and len(r["cdf_ms"]) == 201
    assert by["unicast/rpc/call"]["received"] == 50
    assert by["unicast/rpc/call"]["p50_ms"] >= 20.0       # 2 x 10 ms
    assert by["multicast/rpc/fanout"]["received"] == 6     # 2 rounds x 3 agents
    assert by["multicast/rpc/fanout"]["p50_ms"] >= 10.0
    assert mine() <= before


@pytest.mark.slow  # a Pulsar broker of its own in the emulated network
@pytest.mark.xdist_group("pulsar")
@needs_netns
def test_both_channels_with_delay_and_loss(tmp_path: Path) -> None:
    """One workload per pattern and channel on a real broker in the broker's namespace:
    everything delivered at 10 ms delay and 1% loss, MQ through the broker's relay (one-way
    latency at least the delay), the anycast pool's messages spread by the broker."""
    cfg = StudyConfig(workloads=["unicast/rpc/cast", "unicast/mq/cast", "multicast/mq/fanout",
                                 "anycast/mq/cast"], rate_per_s=60, duration_s=0.5,
                      fanout_rounds=2, fanout_interval_s=0.2, sla_grace_s=10)
    parts = {"grid": {"agents": [3], "delay_ms": [10], "loss": [0.01], "relay": True}}
    rows = _rows(run_study(parts, ["grid"], 1, cfg, Security(), tmp_path, heap="512m",
                           say=lambda _: None).parent)
    by = {r["workload"]: r for r in rows}
    for r in rows:
        assert not r["failed"] and r["lost"] == 0, r
        assert r["p50_ms"] >= 10.0, r
    for w in ("unicast/mq/cast", "multicast/mq/fanout", "anycast/mq/cast"):
        assert by[w]["broker_tcp"] >= 3 and by[w]["broker_rss_mb"] > 0
        assert by[w]["ack_p50_ms"] > 0
    assert by["multicast/mq/fanout"]["received"] == 6
    assert by["anycast/mq/cast"]["receivers"] >= 2  # the broker picked among the pool
