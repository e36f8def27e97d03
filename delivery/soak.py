"""``python soak.py``: the randomised fault-injection soak (configs/soak.yaml), in the manner
of Jepsen: a steady load of real configuration messages through the controller's ingress,
across the emulated network (:mod:`delivery.netem`), while a nemesis (:mod:`delivery.nemesis`)
kills and restarts the broker, the controller and agents, partitions the controller from
nodes and from the broker, drops and delays packets, fills the outbox's disk and switches
channels, in seeded random combinations and sequences; then every fault is healed, delivery
settles, and the checker (:mod:`delivery.checker`) judges the agents' programming records
against what the ingress acknowledged (:class:`delivery.ledger.IngressLedger`):

* every accepted message applied at most once at every destination that needs it, in order
  per resource, and none lost (applied, or superseded by a newer applied one);
* the final configuration of every (node, resource) the last one requested.

Parties: the broker in the network's broker namespace, the controller
(``python -m delivery.controller_host``) and this driver in the controller's namespace (the
driver reaches the ingress on its loopback), agent hosts (``python -m delivery.agent_host``,
``agent_hosts`` processes) with each agent in its node's namespace. The metadata store (the
controller's outbox) lives on a tmpfs of ``outbox_mb`` MiB of its own, so ``disk_full`` fills
only it. Security as everywhere: mutual TLS and pinned identities (the development PKI).

Output (``out_dir``): ``soak.json`` (the configuration, every fault with its times and
recovery, the verdict, delays), ``soak.png`` (delivery delay over time, faults shaded), the
processes' logs; an MLflow run with the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from omegaconf import DictConfig, OmegaConf

from envs.netutil import BROKER_ADDRESS, CONTROLLER_ADDRESS, free_ports, node_address
from security.tls import Security

from .agent_host import host_spec
from .checker import Verdict, judge, read_rows, settle_times
from .controller import RPC
from .ledger import IngressLedger
from .nemesis import INSTANT, KINDS, NETWORK, Fault, heal_network, inject_network, schedule
from .processes import AgentHostProcess, ControllerProcess
from .testbed import AGENT_PORT

__all__ = ["faults_of", "run_soak", "type_plan"]

HEAL_RETRY_S = 60.0          # a restart is retried this long, then left to the end of the load


def _say(text: str) -> None:
    print(time.strftime("%H:%M:%S ") + text, flush=True)


def type_plan(nodes: list[int]) -> dict[int, tuple[tuple[int, int], tuple[int, ...]]]:
    """The load's message types: type -> ((first channel, other channel), hosts). Type 0 goes
    to every node (RPC multicast), type 1 to the first three quarters (topic 1), type 2 to
    the second half (topic 2); type 3 is unicast to one node at a time (RPC). A
    ``channel_switch`` moves a type to its other channel."""
    k = len(nodes)
    return {0: ((RPC, 1), tuple(nodes)), 1: ((1, RPC), tuple(nodes[:max(1, 3 * k // 4)])),
            2: ((2, RPC), tuple(nodes[k // 2:])), 3: ((RPC, 2), tuple(nodes))}


# ---------------------------------------------------------------------------- outside
def run_soak(cfg: DictConfig) -> dict[str, Any]:
    """Build the emulated network, run the soak inside the controller's namespace (a child
    ``python -m delivery.soak``), remove the network (also on failure), log the result to
    MLflow and return it."""
    from agents.tracking import tracked_run

    from .broker import fetch_pulsar
    from .netem import EmulatedNetwork, NetworkSpec

    out = Path(str(cfg.out_dir))
    out.mkdir(parents=True, exist_ok=True)
    nodes = list(range(int(cfg.nodes)))
    sec = Security.from_mapping(OmegaConf.to_container(cfg.security, resolve=True))
    faults_of(cfg, nodes)  # a bad schedule or script fails here, before anything starts
    if not sec.insecure:
        sec.pki.refresh_addresses(["controller", "broker", *(f"agent-{n}" for n in nodes)])
    fetch_pulsar()  # the namespaces have no route out
    with EmulatedNetwork(NetworkSpec(nodes, queue_ms=200.0)) as net:
        inner = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(inner, dict)
        inner["inside"] = {"tag": net.tag,
                           "ports": {str(n): net.switch_port(str(n)) for n in nodes}}
        f = out / "soak_config.inner.yaml"
        OmegaConf.save(OmegaConf.create(inner), f)
        _say(f"soak: emulated network {net.tag} ({len(nodes)} nodes), seed {cfg.seed}, "
             f"{cfg.duration_s} s of load at {cfg.rate} messages/s")
        rc = subprocess.run([*net.exec_prefix(net.controller), "unshare", "--mount",
                             "--propagation", "private", sys.executable, "-m",
                             "delivery.soak", "--config", str(f)],
                            cwd=Path(__file__).resolve().parents[1], check=False).returncode
    path = out / "soak.json"
    if not path.exists():
        raise RuntimeError(f"the soak inside the emulated network failed (exit code {rc}) "
                           f"before its verdict; its output is above, its files in {out}")
    result = json.loads(path.read_text())
    plot = _plot(result, out / "soak.png")
    with tracked_run(cfg, run_name=f"soak__seed{cfg.seed}", tags={"task": "soak"}) as mlog:
        mlog.metrics({k: float(v) for k, v in _headline(result).items() if v is not None})
        mlog.artifact(path, "soak")
        if plot is not None:
            mlog.artifact(plot, "plots")
        mlog.text(OmegaConf.to_yaml(cfg, resolve=True), "soak_config.yaml")
    v = result["verdict"]
    _say(f"soak done: {result['messages']['accepted']} messages accepted, "
         f"{len(result['faults'])} faults; violations {v['violations']}, lost {v['lost']}, "
         f"stale {v['stale']}, stuck {v.get('stuck', 0)}: {'OK' if v['ok'] else 'FAILED'}; "
         f"results in {out}")
    if rc != 0 and v["ok"]:
        raise RuntimeError(f"the soak exited with {rc} although its verdict is OK "
                           f"({result.get('error') or 'see its output above'}); files in {out}")
    return result


def faults_of(cfg: DictConfig, nodes: list[int]) -> list[Fault]:
    """The run's faults: ``nemesis.script`` when given (a list of ``{kind, start_s,
    duration_s, nodes, group, level}``: a case to replay), else the seeded schedule."""
    script = cfg.nemesis.get("script") or []
    if not script:
        return schedule(int(cfg.seed), float(cfg.duration_s), nodes, **_schedule_kw(cfg))
    out = []
    fields = {"kind", "start_s", "duration_s", "nodes", "group", "level"}
    for i, item in enumerate(script):
        d = dict(item)
        if set(d) - fields or d.get("kind") not in KINDS or "start_s" not in d:
            raise ValueError(f"nemesis.script[{i}]: expected kind (one of {list(KINDS)}), "
                             f"start_s and optionally {sorted(fields - {'kind', 'start_s'})}, "
                             f"got {d}")
        f = Fault(str(d["kind"]), float(d["start_s"]),
                  0.0 if d["kind"] in INSTANT else float(d.get("duration_s", 5.0)),
                  tuple(int(n) for n in d.get("nodes") or ()), int(d.get("group", 0)),
                  float(d.get("level", 0.0)))
        if f.end_s > float(cfg.duration_s) or (f.kind in NETWORK - {"partition_broker"}
                                               and not set(f.nodes) <= set(nodes)) or \
                (f.kind in NETWORK - {"partition_broker"} and not f.nodes):
            raise ValueError(f"nemesis.script[{i}]: ends after duration_s or names no (or "
                             f"unknown) nodes: {d}")
        out.append(f)
    return sorted(out, key=lambda f: f.start_s)


def _schedule_kw(cfg: DictConfig) -> dict[str, Any]:
    n = cfg.nemesis
    return {"groups": int(cfg.agent_hosts), "types": len(type_plan([0, 1])),
            "kinds": list(n.kinds), "mean_gap_s": float(n.mean_gap_s),
            "fault_s": (float(n.fault_s[0]), float(n.fault_s[1])),
            "max_concurrent": int(n.max_concurrent), "quiet_end_s": float(n.quiet_end_s)}


def _headline(result: dict[str, Any]) -> dict[str, Any]:
    v, m, d = result["verdict"], result["messages"], result["delay_ms"]
    rec = [f["recovery_s"] for f in result["faults"] if f.get("recovery_s") is not None]
    return {"accepted": m["accepted"], "maybe": m["maybe"], "faults": len(result["faults"]),
            "violations": v["violations"], "lost": v["lost"], "stale": v["stale"],
            "recovery_p50_s": float(np.median(rec)) if rec else None,
            "recovery_max_s": max(rec) if rec else None,
            "delay_fault_p95_ms": d["fault"]["p95"], "delay_calm_p95_ms": d["calm"]["p95"]}


def _plot(result: dict[str, Any], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result.get("delays") or []
    if not pts:
        return None
    t = np.array([p[0] for p in pts])
    d = np.array([p[1] for p in pts])
    fig, ax = plt.subplots(figsize=(10, 4))
    colours = plt.get_cmap("tab10")
    kinds = sorted({f["kind"] for f in result["faults"]})
    for f in result["faults"]:
        if f["injected_s"] is None:
            continue
        c = colours(kinds.index(f["kind"]) % 10)
        end = f["healed_s"] if f["healed_s"] is not None else f["injected_s"]
        if end - f["injected_s"] < 0.2:
            ax.axvline(f["injected_s"], color=c, lw=1, ls="--")
        else:
            ax.axvspan(f["injected_s"], end, color=c, alpha=0.2)
    for k in kinds:
        ax.plot([], [], color=colours(kinds.index(k) % 10), lw=6, alpha=0.4, label=k)
    ax.scatter(t, np.maximum(d, 1e-1), s=2, color="black", label="message (node)")
    ax.set_yscale("log")
    ax.set_xlabel("generated at (s from the start of the load)")
    ax.set_ylabel("delay until in effect (ms)")
    ax.set_title(f"soak, seed {result['config']['seed']}: {len(result['faults'])} faults, "
                 f"{result['verdict']['violations']} violations, {result['verdict']['lost']} "
                 f"lost")
    ax.legend(fontsize=7, ncol=5, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- inside
class Soak:
    """The parties, the load and the nemesis of one run (inside the controller's namespace
    and a mount namespace of its own)."""

    def __init__(self, cfg: DictConfig) -> None:
        from .broker import PulsarStandalone

        self.cfg = cfg
        self.out = Path(str(cfg.out_dir))
        self.tag = str(cfg.inside.tag)
        self.port_of = {int(n): str(p) for n, p in cfg.inside.ports.items()}
        self.nodes = list(range(int(cfg.nodes)))
        self.plan = type_plan(self.nodes)
        self.sec = Security.from_mapping(OmegaConf.to_container(cfg.security, resolve=True))
        self.store_dir = self.out / "store"
        self.store_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(cfg.outbox_mb)}m",
                        "soak-store", str(self.store_dir)], check=True)
        self.store_url = f"sqlite:///{self.store_dir / 'metadata.db'}"
        self.record_dir = self.out / "records"
        self.record_dir.mkdir(parents=True, exist_ok=True)
        self.broker = PulsarStandalone(heap=str(cfg.broker_heap), security=self.sec,
                                       host=BROKER_ADDRESS, netns=f"{self.tag}-brk",
                                       work_dir=self.out / "broker", keep=True)
        self.ctl: ControllerProcess | None = None
        self.hosts: list[AgentHostProcess] = []
        self.channels = {t: chans[0] for t, (chans, _) in self.plan.items()}
        self.t0 = 0.0
        self.stop_load = threading.Event()
        self.ledger: IngressLedger | None = None
        self.notes: list[str] = []
        self.failed_at: list[tuple[float, str]] = []  # failed Configure calls: (s, why)
        self.error: str | None = None        # what stopped the nemesis, if anything did

    # parties
    def start(self) -> None:
        self.broker.start()
        _say(f"broker serving at {self.broker.service_url}")
        reply_port, ingress_port = free_ports(2)
        c = self.cfg.controller
        self.ctl = ControllerProcess(
            self.out, {n: f"{node_address(n)}:{AGENT_PORT}" for n in self.nodes},
            security=self.sec, ingress_port=ingress_port, reply_port=reply_port,
            pulsar_url=self.broker.service_url, pulsar_admin_url=self.broker.admin_url,
            store_url=self.store_url, reply_host=CONTROLLER_ADDRESS,
            topic_prefix=f"persistent://public/default/soak-{uuid.uuid4().hex[:8]}",
            **OmegaConf.to_container(c, resolve=True))  # type: ignore[arg-type]
        _say(f"controller serving after {self.ctl.start(120):.1f} s")
        k = int(self.cfg.agent_hosts)
        for i in range(k):
            part = {n: AGENT_PORT for j, n in enumerate(self.nodes) if j % k == i}
            spec = host_spec(part, store_url=self.store_url, record_dir=self.record_dir,
                             pulsar_url=self.broker.service_url,
                             controller=f"{CONTROLLER_ADDRESS}:{reply_port}",
                             security=self.sec, netns={n: f"{self.tag}-n{n}" for n in part},
                             pack_period_s=0.1)
            self.hosts.append(AgentHostProcess(self.out, f"agents-{i}", spec))
        for h in self.hosts:
            h.start(180)
        _say(f"{len(self.nodes)} agents serving in {k} processes")
        self.set_channels(self.channels)
        self.ledger = IngressLedger(self.ctl.stub)

    def set_channels(self, channels: dict[int, int], timeout: float = 60.0) -> None:
        assert self.ctl is not None
        hosts = {t: h for t, (_, h) in self.plan.items()}
        self.ctl.set_channels(channels, hosts, timeout=timeout)

    def close(self) -> None:
        for h in self.hosts:
            with contextlib.suppress(Exception):
                h.stop()
        if self.ctl is not None:
            with contextlib.suppress(Exception):
                self.ctl.close()
        with contextlib.suppress(Exception):
            self.broker.close()
        subprocess.run(["umount", "-l", str(self.store_dir)], check=False,
                       capture_output=True)

    # the load
    def load(self) -> None:
        """``rate`` messages/s in Configure calls of ``batch``, over the plan's types and
        ``resources`` resources per type, until told to stop."""
        assert self.ledger is not None
        led = self.ledger
        rng = random.Random(int(self.cfg.seed) + 1)
        batch, period = int(self.cfg.batch), int(self.cfg.batch) / float(self.cfg.rate)
        types = sorted(self.plan)
        nxt = time.monotonic()
        while not self.stop_load.is_set():
            reqs = []
            for _ in range(batch):
                t = rng.choice(types)
                hosts = self.plan[t][1]
                if t == 3:
                    hosts = (rng.choice(hosts),)
                rid = 100 * t + rng.randrange(int(self.cfg.resources))
                reqs.append(led.request(t, rid, hosts, size=int(self.cfg.size_bytes)))
            if not led.configure(reqs, timeout=float(self.cfg.call_timeout_s)):
                self.failed_at.append((round(self.now(), 3), led.last_failure[:160]))
            nxt += period
            now = time.monotonic()
            if nxt > now:
                self.stop_load.wait(nxt - now)
            else:
                nxt = now

    # the nemesis
    def now(self) -> float:
        return time.monotonic() - self.t0

    def inject(self, f: Fault) -> None:
        assert self.ctl is not None
        if f.kind in NETWORK:
            inject_network(self.tag, f, self.port_of)
        elif f.kind == "broker_kill":
            pid = self.broker.pid
            if pid is not None:
                os.kill(pid, 9)
                self.broker.wait(30)
        elif f.kind == "controller_kill":
            self.ctl.kill()
        elif f.kind == "agents_kill":
            self.hosts[f.group].kill()
        elif f.kind == "disk_full":
            self._fill(self.store_dir / "ballast")
        elif f.kind == "channel_switch":
            chans = self.plan[f.group][0]
            new = chans[1] if self.channels[f.group] == chans[0] else chans[0]
            try:
                self.set_channels({f.group: new}, timeout=15.0)
                self.channels[f.group] = new
                f.notes.append(f"type {f.group} -> channel {new}")
            except grpc.RpcError as e:
                f.notes.append(f"switch of type {f.group} not done: {e.code().name}")
        else:
            raise ValueError(f.kind)

    def _fill(self, path: Path) -> None:
        st = os.statvfs(path.parent)
        room = st.f_bavail * st.f_frsize - 16 * 1024
        with open(path, "wb") as fh:
            chunk = b"\0" * (1 << 20)
            while room > 0:
                try:
                    fh.write(chunk[:min(room, len(chunk))])
                except OSError:
                    break
                room -= len(chunk)

    def heal(self, f: Fault) -> None:
        assert self.ctl is not None
        if f.kind in NETWORK:
            heal_network(self.tag, f, self.port_of)
        elif f.kind == "disk_full":
            (self.store_dir / "ballast").unlink(missing_ok=True)
        elif f.kind == "broker_kill":
            self._retry(f, "broker", self.broker.start)
        elif f.kind == "controller_kill":
            self._retry(f, "controller", lambda: self.ctl.start(120))  # type: ignore[union-attr]
        elif f.kind == "agents_kill":
            self._retry(f, f"agents-{f.group}", lambda: self.hosts[f.group].start(180))

    def _retry(self, f: Fault, what: str, start: Any) -> None:
        """Restart a party, retried for ``HEAL_RETRY_S``; if it still fails, the nemesis goes
        on (another fault's heal may be what it waits for) and the end of the load starts
        it (:meth:`running_again`)."""
        end = time.monotonic() + HEAL_RETRY_S
        while True:
            try:
                start()
                return
            except Exception as e:  # reported, retried, then left to the end of the load
                f.notes.append(f"{what} restart failed: {str(e).splitlines()[0][:200]}")
                if time.monotonic() > end:
                    self.notes.append(f"{what} not restarted by its heal; started at the end")
                    return
                time.sleep(2.0)

    def nemesis(self, faults: list[Fault], done: threading.Event) -> None:
        """Inject and heal ``faults`` at their times (in order: a slow restart delays what
        comes after it), then heal whatever is still in place."""
        events = sorted([(f.start_s, 0, i) for i, f in enumerate(faults)]
                        + [(f.end_s, 1, i) for i, f in enumerate(faults)
                           if f.kind not in INSTANT], key=lambda e: (e[0], -e[1]))
        active: set[int] = set()
        try:
            for at, what, i in events:
                f = faults[i]
                if done.wait(max(0.0, at - self.now())):
                    break
                if what == 0:
                    _say(f"nemesis: {f.kind} {f.nodes if f.kind in NETWORK else f.group} "
                         f"{f.level or ''} for {f.duration_s:.1f} s")
                    f.injected_s = round(self.now(), 3)
                    self.inject(f)
                    if f.kind in INSTANT:
                        f.healed_s = round(self.now(), 3)
                    else:
                        active.add(i)
                else:
                    self.heal(f)
                    f.healed_s = round(self.now(), 3)
                    active.discard(i)
                    _say(f"nemesis: {f.kind} healed ({f.healed_s - f.injected_s:.1f} s)")
        except Exception as e:
            self.error = f"nemesis: {type(e).__name__}: {e}"
            _say(self.error)
        finally:
            for i in sorted(active, key=lambda i: faults[i].end_s):
                self.heal(faults[i])
                faults[i].healed_s = round(self.now(), 3)

    def running_again(self) -> None:
        """Every party serving (a fault healed late, or a process that died by itself)."""
        if not self.broker.running:
            self.notes.append("broker not running at the end: started")
            self.broker.start()
        assert self.ctl is not None
        if not self.ctl.running:
            self.notes.append("controller not running at the end: started")
            self.ctl.start(120)
        for h in self.hosts:
            if not h.running:
                self.notes.append(f"{h.log.stem} not running at the end: started")
                h.start(180)

    def settle(self, timeout_s: float) -> tuple[Verdict, float]:
        """Wait until the outbox is empty (every destination confirmed every stored message)
        and the records hold the newest of every resource; adopt the stored "maybe"
        messages; return the verdict and the seconds it took."""
        from .store import MetadataStore

        assert self.ledger is not None
        t = time.monotonic()
        end = t + timeout_s
        size = (-1, -1)
        while time.monotonic() < end:
            store = MetadataStore(self.store_url)
            try:
                size = store.outbox_size()
            finally:
                store.close()
            if size == (0, 0):
                break
            time.sleep(1.0)
        stuck: list[str] = []
        if size != (0, 0):
            stuck = self._stuck(timeout_s)
        while True:
            self.ledger.adopt(self.record_dir, self.nodes)
            v = judge(self.record_dir, self.ledger, self.nodes)
            if v.violations or not (v.stale or v.lost) or time.monotonic() > end:
                v.stuck = stuck
                return v, time.monotonic() - t
            time.sleep(1.0)

    def _stuck(self, waited_s: float) -> list[str]:
        """The messages still in the controller's outbox (stored, not confirmed by every
        destination) after delivery had ``waited_s`` to settle."""
        from .rpc import pb
        from .store import MetadataStore

        store = MetadataStore(self.store_url)
        try:
            rows = store.outbox_unconfirmed()
        finally:
            store.close()
        out = []
        for row in rows:
            try:
                mid: Any = pb.ConfigMessage.FromString(row.body).message_id
            except Exception:  # a corrupt row: reported without its id
                mid = "?"
            out.append(f"message {mid} (type {row.type_id}, ts {row.ts_ns}) not confirmed by "
                       f"nodes {list(row.nodes)} {waited_s:.0f} s after the heal")
        return out


def _quantiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"n": 0, "p50": None, "p95": None, "p99": None, "max": None}
    a = np.asarray(xs)
    return {"n": len(xs), "p50": round(float(np.percentile(a, 50)), 1),
            "p95": round(float(np.percentile(a, 95)), 1),
            "p99": round(float(np.percentile(a, 99)), 1), "max": round(float(a.max()), 1)}


def _measure(soak: Soak, faults: list[Fault], t0_ns: int) -> dict[str, Any]:
    """Delays (generation -> in effect at the node) of messages generated while a fault was
    in place and of the others (calm), and each fault's recovery: from its heal until every
    message generated while it was in place was in effect everywhere it was sent
    (overlapping faults share it)."""
    assert soak.ledger is not None
    rows = read_rows(soak.record_dir, soak.nodes)
    times = [(ts, at) for ts, _n, at in settle_times(rows, soak.ledger) if at is not None]
    times.sort()
    ts = np.array([t for t, _ in times], dtype=np.int64)
    at = np.array([a for _, a in times], dtype=np.int64)
    d_ms = (at - ts) / 1e6
    during = np.zeros(len(ts), dtype=bool)
    for f in faults:
        if f.injected_s is None or f.healed_s is None or f.kind in INSTANT:
            continue
        a, h = t0_ns + int(f.injected_s * 1e9), t0_ns + int(f.healed_s * 1e9)
        i, j = np.searchsorted(ts, a, "left"), np.searchsorted(ts, h, "right")
        during[i:j] = True
        f.recovery_s = round(max(0.0, (int(at[i:j].max()) - h) / 1e9), 3) if j > i else 0.0
    step = max(1, len(ts) // 20000)
    pts = [(round((int(t) - t0_ns) / 1e9, 3), round(float(d), 1))
           for t, d in zip(ts[::step], d_ms[::step])]
    return {"fault": _quantiles(d_ms[during].tolist()),
            "calm": _quantiles(d_ms[~during].tolist()), "points": pts}


def run_inside(cfg: DictConfig) -> int:
    """The soak itself (in the controller's namespace): start, load + nemesis for
    ``duration_s``, heal, settle, judge, write ``soak.json``. Exit status 0 when the verdict
    is OK, 1 when it is not."""
    soak = Soak(cfg)
    nodes = soak.nodes
    faults = faults_of(cfg, nodes)
    result: dict[str, Any] = {"config": OmegaConf.to_container(cfg, resolve=True)}
    try:
        soak.start()
        assert soak.ledger is not None
        soak.t0 = time.monotonic()
        t0_ns = time.time_ns()
        loader = threading.Thread(target=soak.load, name="soak-load", daemon=True)
        done = threading.Event()
        nem = threading.Thread(target=soak.nemesis, args=(faults, done), name="nemesis",
                               daemon=True)
        loader.start()
        nem.start()
        last = 0.0
        while soak.now() < float(cfg.duration_s):
            time.sleep(1.0)
            if soak.now() - last >= 15:
                last = soak.now()
                led = soak.ledger
                _say(f"load {last:.0f}/{cfg.duration_s} s: {led.acked} accepted, "
                     f"{len(led.maybe)} maybe, {led.failed} failed calls")
        done.set()
        nem.join(2 * HEAL_RETRY_S)
        soak.stop_load.set()
        loader.join(2 * float(cfg.call_timeout_s) + 10)
        load_s = soak.now()
        soak.running_again()
        _say("all faults healed; settling")
        verdict, settle_s = soak.settle(float(cfg.settle_timeout_s))
        delays = _measure(soak, faults, t0_ns)
        for f in faults:  # Configure calls that failed while it was in place (or healing)
            if f.injected_s is not None and f.healed_s is not None:
                why = Counter(w.split(":")[0] for x, w in soak.failed_at
                              if f.injected_s <= x <= f.healed_s + 1)
                f.notes.append(f"Configure calls failed: {dict(why)}")
        led = soak.ledger
        stats, channels = soak.ctl.status() if soak.ctl else ({}, {})
        result.update(
            faults=[f.as_dict() for f in faults],
            injected=dict(Counter(f.kind for f in faults if f.injected_s is not None)),
            messages={"accepted": led.acked, "maybe": len(led.maybe),
                      "failed_calls": led.failed, "failures": soak.failed_at[:200],
                      "destinations": verdict.messages, "applied_rows": verdict.applied},
            verdict=verdict.as_dict(), settle_s=round(settle_s, 1),
            delay_ms={"fault": delays["fault"], "calm": delays["calm"]},
            delays=delays["points"],
            controller={k: stats.get(k) for k in ("outbox_redelivered", "outbox_corrupt",
                                                  "outcomes", "health_events")
                        if k in stats},
            channels_end={str(k): v for k, v in channels.items()}, notes=soak.notes,
            error=soak.error, load_s=round(load_s, 1))
        ok = verdict.ok and soak.error is None
    finally:
        soak.close()
    (Path(str(cfg.out_dir)) / "soak.json").write_text(json.dumps(result, indent=1,
                                                                 default=str))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m delivery.soak --config cfg.yaml``: a resolved soak configuration run inside
    the emulated network (how :func:`run_soak` runs itself)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m delivery.soak")
    ap.add_argument("--config", required=True, help="a resolved soak configuration (YAML)")
    args = ap.parse_args(argv)
    cfg = OmegaConf.load(args.config)
    assert isinstance(cfg, DictConfig)
    return run_inside(cfg)


if __name__ == "__main__":
    from envs.quiet import quiet

    quiet()
    sys.exit(main())
