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
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from agents.config import CONFIG_DIR
from delivery import netem, soak
from delivery.checker import judge, read_rows, settle_times
from delivery.ledger import IngressLedger
from delivery.nemesis import KINDS, Fault, Nemesis, heal_network, inject_network, schedule
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
        v = judge(read_rows(d, [0]), led)
        assert (len(v.violations), len(v.lost), len(v.stale)) == (bad, lost, stale), (name, v)
        assert v.ok == (name == "ok")
    rows = read_rows(tmp_path / "ok", [0])
    # the superseded message took effect when the newer one was applied
    assert sorted(settle_times(rows, led)) == [(10, 0, 100), (15, 0, 150), (20, 0, 300),
                                               (30, 0, 300)]


# ------------------------------------------------------------ the checker's inputs
class _Stub:
    """The ingress as IngressLedger sees it: acknowledges every request (timestamp = its
    id * 10), or fails the calls whose first message id is in ``fail``."""

    def __init__(self, fail: set[int] = frozenset(), die_after: int | None = None) -> None:
        self.fail, self.die_after, self.calls = fail, die_after, 0

    def Configure(self, reqs: Any, timeout: float, wait_for_ready: bool) -> Any:
        import grpc
        self.calls += 1
        if self.die_after is not None and self.calls > self.die_after:
            raise KeyError("a bug in the client")
        mids = [r.message_id for r in reqs.requests]
        if mids[0] in self.fail:
            class _Unavailable(grpc.RpcError):
                def code(self) -> grpc.StatusCode:
                    return grpc.StatusCode.UNAVAILABLE

                def details(self) -> str:
                    return "the controller is gone"
            raise _Unavailable()
        return SimpleNamespace(message_ids=mids, timestamps_ns=[10 * m for m in mids])


def _maybe_ledger() -> IngressLedger:
    """Message 1 acknowledged to nodes 0 and 1; message 2's call failed ("maybe")."""
    led = IngressLedger(_Stub(fail={2}))
    assert led.configure([led.request(1, 7, (0, 1))])
    assert not led.configure([led.request(1, 8, (0, 1))])
    return led


def test_a_stored_maybe_message_is_owed_to_every_host(tmp_path) -> None:
    """A "maybe" message applied at node 0 was stored: node 1, which never got it, has lost
    it (adopting it only where it was seen judged that OK)."""
    led = _maybe_ledger()
    _write(tmp_path / "node-0.record", [(1, 7, 10, 100), (2, 8, 20, 200)])
    _write(tmp_path / "node-1.record", [(1, 7, 10, 110)])
    rows = read_rows(tmp_path, [0, 1])
    assert led.adopt(rows) == {0: 1}
    v = judge(rows, led)
    assert not v.violations and not v.ok
    assert any("node 1" in x and "8)" in x for x in v.lost), v.lost
    assert any(x.startswith("node 1 ") for x in v.stale), v.stale
    # applied at both: in order, nothing lost
    _write(tmp_path / "node-1.record", [(1, 7, 10, 110), (2, 8, 20, 210)])
    rows = read_rows(tmp_path, [0, 1])
    led.adopt(rows)
    assert judge(rows, led).ok


def test_the_verdict_judges_the_records_it_adopted_from(tmp_path, monkeypatch) -> None:
    """A maybe message applied at node 1 between the read the ledger adopted from and the
    read the verdict judged was reported as a violation (applied but never sent there)."""
    led = _maybe_ledger()
    _write(tmp_path / "node-0.record", [(1, 7, 10, 100), (2, 8, 20, 200)])
    _write(tmp_path / "node-1.record", [(1, 7, 10, 110)])
    real = soak.read_rows

    def read_then_apply(record_dir: Path, nodes: Any) -> dict:
        rows = real(record_dir, nodes)
        with open(tmp_path / "node-1.record", "a") as fh:   # the agent goes on applying
            fh.write("A\t2\t1\tSUBNET\t8\t20\trpc\t210\n")
        return rows

    monkeypatch.setattr(soak, "read_rows", read_then_apply)
    box = SimpleNamespace(record_dir=tmp_path, nodes=[0, 1], ledger=led,
                          _stuck=lambda waited_s: [])
    v, _ = soak.Soak.settle(box, timeout_s=0.0)  # type: ignore[arg-type]
    assert not v.violations, v.violations
    assert v.stale and not v.ok   # node 1 was not there yet when read


def test_recovery_is_unknown_when_nothing_of_the_fault_took_effect(tmp_path) -> None:
    """A fault's recovery is None (not 0) when no message was generated while it was in
    place, when one of them never took effect, or when it was never healed."""
    led = IngressLedger(_Stub())
    for rid in (1, 2, 3):           # generated at 10, 20, 30 ns after t0 = 0
        led.configure([led.request(1, rid, (0,))])
    _write(tmp_path / "node-0.record", [(1, 1, 10, 50), (3, 3, 30, 90)])   # 2 never applied
    rows = read_rows(tmp_path, [0])
    s = 1e-9
    faults = [Fault("loss", 0, 1, (0,), injected_s=5 * s, healed_s=12 * s),      # 1: took
              Fault("slow_link", 0, 1, (0,), injected_s=15 * s, healed_s=25 * s),  # 2: never
              Fault("disk_full", 0, 1, injected_s=31 * s, healed_s=40 * s),       # none
              Fault("partition_nodes", 0, 1, (0,), injected_s=28 * s)]            # not healed
    d = soak._measure(rows, led, faults, 0)
    assert faults[0].recovery_s == pytest.approx(38e-9, abs=1e-3)
    assert [f.recovery_s for f in faults[1:]] == [None, None, None]
    assert d["calm"]["n"] + d["fault"]["n"] == 2


# ------------------------------------------------------------------ the nemesis
class _Parties:
    """Actions that record what happened when; ``slow``: kind -> seconds its heal takes;
    ``broken``: kinds whose injection or heal raises."""

    def __init__(self, t0: float, slow: dict[str, float] | None = None,
                 broken: dict[str, str] | None = None) -> None:
        self.t0, self.slow, self.broken = t0, slow or {}, broken or {}
        self.log: list[tuple[str, str, float]] = []
        self.lock = threading.Lock()

    def _note(self, what: str, f: Fault) -> None:
        with self.lock:
            self.log.append((what, f.kind, time.monotonic() - self.t0))

    def inject(self, f: Fault) -> None:
        self._note("inject", f)
        if self.broken.get(f.kind) == "inject":
            raise OSError("nft: applied to half the nodes")

    def heal(self, f: Fault) -> None:
        time.sleep(self.slow.get(f.kind, 0.0))
        if self.broken.get(f.kind) == "heal":
            raise RuntimeError("broker not serving 60 s after its heal began")
        self._note("heal", f)


def _run(faults: list[Fault], parties: _Parties, stop_after: float | None = None) -> Nemesis:
    nem = Nemesis(faults, parties, lambda: time.monotonic() - parties.t0, say=lambda _: None)
    done = threading.Event()
    if stop_after is not None:
        threading.Timer(stop_after, done.set).start()
    nem.run(done)
    return nem


def test_a_slow_restart_delays_only_its_own_party() -> None:
    """The broker's restart takes 1.5 s (it cannot answer while the controller is
    partitioned from it); the partition's heal, due meanwhile, happens on time."""
    p = _Parties(time.monotonic(), slow={"broker_kill": 1.5})
    faults = [Fault("broker_kill", 0.0, 0.1), Fault("partition_broker", 0.2, 0.3),
              Fault("broker_kill", 1.0, 0.1)]
    _run(faults, p)
    t = {(w, k, i): at for i, (w, k, at) in enumerate(p.log)}
    heal_part = next(at for (w, k, _), at in t.items() if (w, k) == ("heal", "partition_broker"))
    assert heal_part < 1.0, p.log
    broker = [(w, round(at, 1)) for w, k, at in p.log if k == "broker_kill"]
    # the second kill waits for the first restart, in order, on the broker's worker
    assert [w for w, _ in broker] == ["inject", "heal", "inject", "heal"], broker
    assert broker[1][1] >= 1.5 and broker[2][1] >= broker[1][1]
    assert all(f.healed_s is not None for f in faults)


def test_the_end_heals_everything_in_place_network_first_whatever_fails() -> None:
    """Stopped with three faults in place: the partition (whose injection failed halfway)
    and the full disk are healed before the agents restart; the broker's failed restart is
    reported and leaves it unhealed without stopping the others."""
    p = _Parties(time.monotonic(), broken={"partition_nodes": "inject", "broker_kill": "heal"})
    faults = [Fault("broker_kill", 0.0, 30), Fault("agents_kill", 0.0, 30, group=1),
              Fault("partition_nodes", 0.05, 30, nodes=(2,)), Fault("disk_full", 0.05, 30)]
    nem = _run(faults, p, stop_after=0.3)
    heals = [k for w, k, _ in p.log if w == "heal"]
    assert set(heals[:2]) == {"partition_nodes", "disk_full"} and heals[2:] == ["agents_kill"]
    assert [f.healed_s is None for f in faults] == [True, False, False, False]
    assert len(nem.errors) == 2, nem.errors
    assert any("partition_nodes injection" in e for e in nem.errors)
    assert any("broker_kill heal" in e and "60 s" in e for e in nem.errors)


def test_nothing_is_injected_after_the_load_ends() -> None:
    """A broker kill queued behind the broker's slow restart when the load ends is not
    injected (and so not healed); a fault that lasts no time is refused."""
    p = _Parties(time.monotonic(), slow={"broker_kill": 1.0})
    faults = [Fault("broker_kill", 0.0, 0.1), Fault("broker_kill", 0.3, 0.1)]
    nem = _run(faults, p, stop_after=0.5)
    assert [(w, k) for w, k, _ in p.log] == [("inject", "broker_kill"), ("heal", "broker_kill")]
    assert faults[1].injected_s is None and faults[1].healed_s is None and not nem.errors
    assert faults[1].notes == ["not injected: the load had ended"]
    with pytest.raises(ValueError, match="loss fault must last more than 0 s"):
        Nemesis([Fault("loss", 1.0, 0.0, (0,), level=0.1)], p, time.monotonic)


def test_a_restart_that_gives_up_raises(monkeypatch) -> None:
    monkeypatch.setattr(soak, "HEAL_RETRY_S", 0.0)
    f = Fault("broker_kill", 0, 1)

    def start() -> None:
        raise TimeoutError("broker not serving in 120 s")

    with pytest.raises(RuntimeError, match="broker not serving 0 s after its heal"):
        soak.Soak._retry(None, f, "broker", start)  # type: ignore[arg-type]
    assert f.notes == ["broker restart failed: broker not serving in 120 s"]


# ------------------------------------------------------------ the soak's own inputs
def _cfg(*overrides: str) -> Any:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="soak", overrides=list(overrides))


@pytest.mark.parametrize(("item", "match"), [
    ({"kind": "agents_kill", "start_s": 1, "group": 2}, r"script\[0\].*group.*0\.\.1"),
    ({"kind": "channel_switch", "start_s": 1, "group": 4}, r"group must be in 0\.\.3"),
    ({"kind": "loss", "start_s": 1, "nodes": [0]}, r"loss needs level"),
    ({"kind": "slow_link", "start_s": 1, "nodes": [0], "level": 0}, r"slow_link needs level"),
    ({"kind": "partition_nodes", "start_s": 1, "nodes": [8]}, r"needs nodes, a subset"),
    ({"kind": "disk_full", "start_s": 58}, r"end by duration_s"),
    ({"kind": "loss", "start_s": 1, "duration_s": 0, "nodes": [0], "level": 0.1},
     r"last more than 0 s"),
])
def test_a_bad_script_is_refused_naming_the_item(item: dict, match: str) -> None:
    cfg = _cfg("duration_s=60", "out_dir=/nonexistent")
    cfg.nemesis.script = [item]
    with pytest.raises(ValueError, match=match):
        soak.faults_of(cfg, list(range(8)))


def test_overlapping_faults_of_a_kind_are_refused() -> None:
    cfg = _cfg("duration_s=60", "out_dir=/nonexistent")
    cfg.nemesis.script = [{"kind": "disk_full", "start_s": 1, "duration_s": 10},
                          {"kind": "broker_kill", "start_s": 2, "duration_s": 10},
                          {"kind": "disk_full", "start_s": 5, "duration_s": 2}]
    with pytest.raises(ValueError, match="two disk_full faults overlap"):
        soak.faults_of(cfg, list(range(8)))
    cfg.nemesis.script[2]["start_s"] = 11
    assert [f.kind for f in soak.faults_of(cfg, list(range(8)))] == [
        "disk_full", "broker_kill", "disk_full"]


def test_a_used_out_dir_is_refused_untouched(tmp_path) -> None:
    (tmp_path / "records").mkdir()
    (tmp_path / "soak.json").write_text('{"verdict": {"ok": true}}')
    cfg = _cfg(f"out_dir={tmp_path}")
    with pytest.raises(ValueError, match=r"previous soak's soak.json, records.*nothing was"):
        soak.run_soak(cfg)
    assert (tmp_path / "soak.json").read_text() == '{"verdict": {"ok": true}}'


class _FakeSoak:
    """The soak's parties without processes: an ingress that acknowledges (or whose client
    dies), records that stay empty, a controller whose status cannot be read."""

    die_after: int | None = None

    def __init__(self, cfg: Any) -> None:
        self.out = Path(str(cfg.out_dir))
        self.record_dir = self.out / "records"
        self.record_dir.mkdir(parents=True)
        self.nodes = list(range(int(cfg.nodes)))
        self.plan = soak.type_plan(self.nodes)
        self.notes: list[str] = []
        self.ledger: IngressLedger | None = None
        self.t0 = 0.0
        self.ctl = SimpleNamespace(status=self._status)
        self.closed = False

    def _status(self) -> Any:
        raise ConnectionError("the controller's status port refused")

    def start(self) -> None:
        self.ledger = IngressLedger(_Stub(die_after=self.die_after))

    def now(self) -> float:
        return time.monotonic() - self.t0

    def inject(self, f: Fault) -> None: ...

    def heal(self, f: Fault) -> None: ...

    def running_again(self) -> None: ...

    def settle(self, timeout_s: float) -> Any:
        assert self.ledger is not None
        return judge(read_rows(self.record_dir, self.nodes), self.ledger), 0.0

    def close(self) -> None:
        self.closed = True


def _inside(tmp_path: Path, monkeypatch, die_after: int | None) -> tuple[int, dict, float]:
    monkeypatch.setattr(soak, "Soak", type("S", (_FakeSoak,), {"die_after": die_after}))
    cfg = _cfg("duration_s=4", "rate=50", f"out_dir={tmp_path}", "nodes=4")
    cfg.nemesis.script = [{"kind": "disk_full", "start_s": 0.5, "duration_s": 1}]
    t = time.monotonic()
    rc = soak.run_inside(OmegaConf.create(OmegaConf.to_container(cfg, resolve=False)))
    return rc, json.loads((tmp_path / "soak.json").read_text()), time.monotonic() - t


def test_the_verdict_is_kept_when_the_controller_status_fails(tmp_path, monkeypatch) -> None:
    rc, r, _ = _inside(tmp_path, monkeypatch, die_after=None)
    assert rc == 1 and r["messages"]["accepted"] > 50       # nothing applied: lost, stale
    assert r["verdict"]["lost"] > 0 and r["error"] is None
    assert any("controller status not read: ConnectionError" in n for n in r["notes"])
    assert r["faults"][0]["healed_s"] is not None


def test_a_load_that_dies_fails_the_soak_at_once(tmp_path, monkeypatch) -> None:
    rc, r, took = _inside(tmp_path, monkeypatch, die_after=3)
    assert rc == 1 and took < 3.5, took
    assert r["error"].startswith("load: KeyError"), r["error"]
    assert len(r["errors"]) == 1
    assert r["messages"]["accepted"] == 15


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
