"""The fault-injection soak (``python soak.py``, :mod:`delivery.soak`): the nemesis' seeded
schedule, the checker's verdict on records made to break each guarantee, the network faults
measured in a real emulated network, and (slow) the short soak itself: every fault kind
injected while real messages flow through the controller's ingress to agents in their own
namespaces, then zero violations, nothing lost, and the final configuration the last one
requested."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path

import pytest

from delivery import netem
from delivery.checker import judge, read_rows, settle_times
from delivery.nemesis import KINDS, Fault, heal_network, inject_network, schedule
from delivery.netem import CONTROLLER_ADDRESS, EmulatedNetwork, NetworkSpec, node_address

ROOT = Path(__file__).resolve().parents[1]
needs_netem = pytest.mark.skipif(netem.available() is not None,
                                 reason=f"emulated network: {netem.available()}")


def test_schedule_is_seeded_covers_every_kind_and_keeps_its_limits() -> None:
    kw = {"groups": 2, "types": 4, "mean_gap_s": 6.0, "fault_s": (3.0, 10.0),
          "max_concurrent": 2, "quiet_end_s": 5.0}
    a = schedule(7, 300, range(8), **kw)
    assert [f.as_dict() for f in a] == [f.as_dict() for f in schedule(7, 300, range(8), **kw)]
    assert [f.as_dict() for f in a] != [f.as_dict() for f in schedule(8, 300, range(8), **kw)]
    assert sorted(f.kind for f in a[:len(KINDS)]) == sorted(KINDS)   # each kind first once
    for f in a:
        assert f.end_s <= 300 - 5.0 + 1e-6 and (f.duration_s == 0) == (f.kind == "channel_switch")
        live = [g for g in a if g.start_s <= f.start_s < g.end_s]
        assert len(live) <= 2 and len({g.kind for g in live}) == len(live), live
        assert set(f.nodes) <= set(range(8))
        assert bool(f.nodes) == (f.kind in ("partition_nodes", "loss", "slow_link")), f
        if f.kind == "loss":
            assert 0.05 <= f.level <= 0.3
    assert [f.start_s for f in a] == sorted(f.start_s for f in a)
    with pytest.raises(ValueError, match=r"unknown fault kind.*'reboot'"):
        schedule(1, 60, range(4), groups=1, types=4, kinds=["reboot"])
    with pytest.raises(ValueError, match="fault_s"):
        schedule(1, 60, range(4), groups=1, types=4, fault_s=(5.0, 2.0))


class _Ledger:
    def __init__(self) -> None:
        self.sent: dict = defaultdict(lambda: defaultdict(list))
        self.lock = threading.Lock()

    def add(self, node: int, rid: int, ts: int, mid: int) -> None:
        self.sent[node][(1, "SUBNET", rid)].append((ts, mid))


def _write(path: Path, rows: list[tuple[int, int, int, int]]) -> None:
    """rows: (message id, resource id, timestamp, applied at) in record order."""
    path.write_text("".join(f"A\t{m}\t1\tSUBNET\t{r}\t{ts}\trpc\t{at}\n"
                            for m, r, ts, at in rows))


def test_checker_verdict_on_records_that_break_each_guarantee(tmp_path) -> None:
    led = _Ledger()
    for mid, (rid, ts) in enumerate([(1, 10), (1, 20), (1, 30), (2, 15)], start=1):
        led.add(0, rid, ts, mid)
    good = [(1, 1, 10, 100), (3, 1, 30, 300), (4, 2, 15, 150)]  # message 2 superseded by 3
    cases = {
        "ok": (good, (0, 0, 0)),
        "applied twice": ([*good, (3, 1, 30, 310)], (1, 0, 0)),
        "out of order": ([(1, 1, 10, 100), (3, 1, 30, 300), (2, 1, 20, 320),
                          (4, 2, 15, 150)], (1, 0, 1)),
        "never sent there": ([*good, (9, 2, 40, 400)], (1, 0, 1)),
        "lost and stale": ([(1, 1, 10, 100), (4, 2, 15, 150)], (0, 2, 1)),
    }
    for name, (rows, (bad, lost, stale)) in cases.items():
        d = tmp_path / name.replace(" ", "_")
        d.mkdir()
        _write(d / "node-0.record", rows)
        v = judge(d, led, [0])
        assert (len(v.violations), len(v.lost), len(v.stale)) == (bad, lost, stale), (name, v)
        assert v.ok == (name == "ok")
    rows = read_rows(tmp_path / "ok", [0])
    # the superseded message took effect when the newer one was applied
    assert sorted(settle_times(rows, led)) == [(10, 0, 100), (15, 0, 150), (20, 0, 300),
                                               (30, 0, 300)]


def _can_connect(ns: str, host: str, port: int) -> bool:
    with netem.in_netns(ns):
        s = socket.socket()
    s.settimeout(1.0)
    try:
        s.connect((host, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


@needs_netem
def test_network_faults_cut_and_heal_the_links() -> None:
    """partition_nodes cuts the partitioned node from the controller both ways (and not the
    other node), slow_link throttles the node's link to about its rate, and each heal
    restores the link."""
    with EmulatedNetwork(NetworkSpec([0, 1])) as net:
        ports = {n: net.switch_port(str(n)) for n in (0, 1)}
        with netem.in_netns(net.controller):
            srv = socket.create_server((CONTROLLER_ADDRESS, 0))
        port = srv.getsockname()[1]
        try:
            part = Fault("partition_nodes", 0, 5, nodes=(0,))
            assert _can_connect(net.node(0), CONTROLLER_ADDRESS, port)
            inject_network(net.tag, part, ports)
            assert not _can_connect(net.node(0), CONTROLLER_ADDRESS, port)
            assert _can_connect(net.node(1), CONTROLLER_ADDRESS, port)
            heal_network(net.tag, part, ports)
            assert _can_connect(net.node(0), CONTROLLER_ADDRESS, port)
        finally:
            srv.close()
        slow = Fault("slow_link", 0, 5, nodes=(1,), level=512.0)
        fast = netem.measure_throughput(net, net.controller, net.node(1), node_address(1), 1.0)
        inject_network(net.tag, slow, ports)
        throttled = netem.measure_throughput(net, net.controller, net.node(1),
                                             node_address(1), 3.0)
        heal_network(net.tag, slow, ports)
        again = netem.measure_throughput(net, net.controller, net.node(1), node_address(1), 1.0)
        assert 0.5 * 512e3 < throttled < 1.1 * 512e3 < fast / 10, (throttled, fast)
        assert again > 10 * throttled


@needs_netem
@pytest.mark.slow  # a broker, a controller and 8 agents; about 4 minutes
@pytest.mark.xdist_group("pulsar")
def test_short_soak_every_fault_kind_nothing_lost(tmp_path) -> None:
    out = tmp_path / "soak"
    done = subprocess.run([sys.executable, "soak.py", "experiment=soak_short", "seed=7",
                           f"out_dir={out}", "logger.enabled=false"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200, check=False)
    assert (out / "soak.json").exists(), done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads((out / "soak.json").read_text())
    v = r["verdict"]
    assert v["ok"] and done.returncode == 0, (v, done.stdout[-3000:])
    assert set(r["injected"]) == set(KINDS), r["injected"]
    assert r["messages"]["accepted"] > 1000 and v["messages"] > r["messages"]["accepted"]
    assert all(f["healed_s"] is not None and f["healed_s"] >= f["injected_s"]
               for f in r["faults"]), r["faults"]
    assert (out / "soak.png").exists()
    assert not netem.list_namespaces(owner=None) or all(
        not ns.startswith(r["config"]["inside"]["tag"]) for ns in netem.list_namespaces())


@needs_netem
@pytest.mark.slow  # a broker, a controller and 8 agents; about 3 minutes
@pytest.mark.xdist_group("pulsar")
def test_restarts_during_a_broker_outage_lose_nothing(tmp_path) -> None:
    """The scripted regression case (``experiment=soak_restart_in_outage``): an agent host
    and the controller restarted while the broker is down both come back within the heal,
    and nothing is lost, stale or left in the outbox."""
    out = tmp_path / "soak"
    done = subprocess.run([sys.executable, "soak.py", "experiment=soak_restart_in_outage",
                           f"out_dir={out}", "logger.enabled=false"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200, check=False)
    assert (out / "soak.json").exists(), done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads((out / "soak.json").read_text())
    assert r["verdict"]["ok"] and r["error"] is None and done.returncode == 0, (
        r["verdict"], r["error"], r["notes"])
    assert set(r["injected"]) == {"broker_kill", "agents_kill", "controller_kill",
                                  "partition_broker", "channel_switch"}, r["faults"]
    heal_s = {f["kind"]: f["healed_s"] - f["injected_s"] for f in r["faults"]}
    # restarted while the broker is down: each serves within its heal (not after it)
    assert heal_s["agents_kill"] < 40 and heal_s["controller_kill"] < 40, heal_s
    assert not r["notes"], r["notes"]
