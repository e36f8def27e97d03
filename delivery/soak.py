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
import itertools
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

from .agent import AppliedRow
from .agent_host import host_spec
from .checker import Verdict, judge, read_rows, settle_times
from .controller import RPC
from .ledger import IngressLedger
from .nemesis import (
    INSTANT,
    KINDS,
    NETWORK,
    NODE_FAULTS,
    Fault,
    Nemesis,
    heal_network,
    inject_network,
    schedule,
)
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
    from harness.broker import fetch_pulsar

    from .netem import EmulatedNetwork, NetworkSpec

    out = Path(str(cfg.out_dir))
    old = [p.name for p in (out / "soak.json", out / "records", out / "store", out / "broker")
           if p.exists()]
    if old:
        raise ValueError(f"out_dir {out} holds a previous soak's {', '.join(old)}: its "
                         f"records and verdict would be judged as this run's. Give a new "
                         f"out_dir (the default is a fresh one per run) or remove them; "
                         f"nothing was changed")
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
    if "verdict" not in result:
        raise RuntimeError(f"the soak inside the emulated network failed (exit code {rc}) "
                           f"before its verdict: {result.get('error')}; its files in {out}")
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
    if result.get("error"):
        _say(f"soak: {result['error']}")
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
    groups = {"agents_kill": range(int(cfg.agent_hosts)),
              "channel_switch": range(len(type_plan(nodes)))}
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
        if f.start_s < 0 or f.end_s > float(cfg.duration_s) or (
                f.kind not in INSTANT and f.duration_s <= 0):
            raise ValueError(f"nemesis.script[{i}]: must start at or after 0, last more than "
                             f"0 s and end by duration_s ({cfg.duration_s}): {d}")
        if f.kind in NODE_FAULTS and not (f.nodes and set(f.nodes) <= set(nodes)):
            raise ValueError(f"nemesis.script[{i}]: {f.kind} needs nodes, a subset of "
                             f"0..{len(nodes) - 1}: {d}")
        if f.kind in groups and f.group not in groups[f.kind]:
            what = "agent_hosts" if f.kind == "agents_kill" else "message types"
            raise ValueError(f"nemesis.script[{i}]: {f.kind} group must be in "
                             f"0..{len(groups[f.kind]) - 1} (the {what}): {d}")
        if (f.kind == "loss" and not 0 < f.level <= 1) or (f.kind == "slow_link"
                                                           and f.level <= 0):
            raise ValueError(f"nemesis.script[{i}]: {f.kind} needs level (loss: a share in "
                             f"(0, 1]; slow_link: a rate in kbit/s > 0): {d}")
        out.append(f)
    out.sort(key=lambda f: f.start_s)
    for k in {f.kind for f in out} - INSTANT:
        same = [f for f in out if f.kind == k]
        for a, b in itertools.pairwise(same):
            if b.start_s < a.end_s:
                raise ValueError(f"nemesis.script: two {k} faults overlap ({a.start_s} s for "
                                 f"{a.duration_s} s and {b.start_s} s): the heal of one "
                                 f"would take the other away")
    return out


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
class Load:
    """The steady load: ``rate`` messages/s in Configure calls of ``batch`` through the
    ingress (``ledger``), over the plan's types and ``resources`` resources per type, from
    :meth:`run` (a thread) until :meth:`halt`. A load that dies (an exception in the
    client) records why in ``error``; the soak then stops and fails instead of judging a
    run that had no load."""

    def __init__(self, ledger: IngressLedger, plan: dict[int, tuple[Any, tuple[int, ...]]],
                 *, seed: int, rate: float, batch: int, resources: int, size_bytes: int,
                 call_timeout_s: float, now: Any) -> None:
        self.ledger, self.plan, self.now = ledger, plan, now
        self.seed, self.rate, self.batch = seed, rate, batch
        self.resources, self.size, self.call_timeout_s = resources, size_bytes, call_timeout_s
        self.failed_at: list[tuple[float, str]] = []  # failed Configure calls: (s, why)
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.run, name="soak-load", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def halt(self, timeout: float) -> bool:
        """Stop; True if the load thread ended within ``timeout``."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # the load died: the soak fails with the reason
            self.error = f"load: {type(e).__name__}: {e} at {self.now():.1f} s"
            _say(self.error)

    def _run(self) -> None:
        led = self.ledger
        rng = random.Random(self.seed + 1)
        period = self.batch / self.rate
        types = sorted(self.plan)
        nxt = time.monotonic()
        while not self._stop.is_set():
            reqs = []
            for _ in range(self.batch):
                t = rng.choice(types)
                hosts = self.plan[t][1]
                if t == 3:
                    hosts = (rng.choice(hosts),)
                rid = 100 * t + rng.randrange(self.resources)
                reqs.append(led.request(t, rid, hosts, size=self.size))
            if not led.configure(reqs, timeout=self.call_timeout_s):
                self.failed_at.append((round(self.now(), 3), led.last_failure[:160]))
            nxt += period
            now = time.monotonic()
            if nxt > now:
                self._stop.wait(nxt - now)
            else:
                nxt = now


class Soak:
    """The parties, the load and the nemesis of one run (inside the controller's namespace
    and a mount namespace of its own)."""

    def __init__(self, cfg: DictConfig) -> None:
        from harness.broker import PulsarStandalone

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
        self.ledger: IngressLedger | None = None
        self.notes: list[str] = []

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
        """Restart a party, retried for ``HEAL_RETRY_S``; raises if it still fails (the
        nemesis reports the fault unhealed and goes on; :meth:`running_again` starts the
        party at the end of the load)."""
        end = time.monotonic() + HEAL_RETRY_S
        while True:
            try:
                start()
                return
            except Exception as e:  # noted, retried, then raised
                why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                f.notes.append(f"{what} restart failed: {why}")
                if time.monotonic() > end:
                    raise RuntimeError(f"{what} not serving {HEAL_RETRY_S:.0f} s after its "
                                       f"heal began: {why}") from e
                time.sleep(2.0)

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
            rows = read_rows(self.record_dir, self.nodes)   # one read, adopted and judged
            self.ledger.adopt(rows)
            v = judge(rows, self.ledger)
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


def _measure(rows: dict[int, list[AppliedRow]], ledger: IngressLedger, faults: list[Fault],
             t0_ns: int) -> dict[str, Any]:
    """Delays (generation -> in effect at the node) of messages generated while a fault was
    in place and of the others (calm), and each fault's recovery: from its heal until every
    message generated while it was in place was in effect everywhere it was sent
    (overlapping faults share it). A fault has no recovery (None) when no message was
    generated while it was in place, when one of them never took effect, or when it was
    never healed."""
    times = sorted(settle_times(rows, ledger))
    ts = np.array([t for t, _n, _a in times], dtype=np.int64)
    at = np.array([-1 if a is None else a for _t, _n, a in times], dtype=np.int64)
    took = at >= 0
    d_ms = (at - ts) / 1e6
    during = np.zeros(len(ts), dtype=bool)
    for f in faults:
        if f.injected_s is None or f.kind in INSTANT:
            continue
        h_s = f.healed_s if f.healed_s is not None else f.injected_s + f.duration_s
        a, h = t0_ns + int(f.injected_s * 1e9), t0_ns + int(h_s * 1e9)
        i, j = np.searchsorted(ts, a, "left"), np.searchsorted(ts, h, "right")
        during[i:j] = True
        if f.healed_s is None or j == i or not took[i:j].all():
            f.recovery_s = None
        else:
            f.recovery_s = round(max(0.0, (int(at[i:j].max()) - h) / 1e9), 3)
    step = max(1, len(ts) // 20000)
    pts = [(round((int(t) - t0_ns) / 1e9, 3), round(float(d), 1))
           for t, d, ok in zip(ts[::step], d_ms[::step], took[::step]) if ok]
    return {"fault": _quantiles(d_ms[during & took].tolist()),
            "calm": _quantiles(d_ms[~during & took].tolist()), "points": pts}


def run_inside(cfg: DictConfig) -> int:
    """The soak itself (in the controller's namespace): start, load + nemesis for
    ``duration_s``, heal, settle, judge, write ``soak.json`` (also when something fails on
    the way: with what is known and ``error``). Exit status 0 when the verdict is OK and
    nothing failed, 1 when not."""
    soak = Soak(cfg)
    faults = faults_of(cfg, soak.nodes)
    result: dict[str, Any] = {"config": OmegaConf.to_container(cfg, resolve=True)}
    errors: list[str] = []
    out = Path(str(cfg.out_dir)) / "soak.json"
    ok = False
    done = threading.Event()
    load: Load | None = None
    nem: threading.Thread | None = None
    try:
        soak.start()
        assert soak.ledger is not None
        led = soak.ledger
        soak.t0 = time.monotonic()
        t0_ns = time.time_ns()
        load = Load(led, soak.plan, seed=int(cfg.seed), rate=float(cfg.rate),
                    batch=int(cfg.batch), resources=int(cfg.resources),
                    size_bytes=int(cfg.size_bytes), call_timeout_s=float(cfg.call_timeout_s),
                    now=soak.now)
        nemesis = Nemesis(faults, soak, soak.now, say=_say)
        nem = threading.Thread(target=nemesis.run, args=(done,), name="nemesis", daemon=True)
        load.start()
        nem.start()
        last = 0.0
        while soak.now() < float(cfg.duration_s) and load.alive:
            time.sleep(1.0)
            if soak.now() - last >= 15:
                last = soak.now()
                _say(f"load {last:.0f}/{cfg.duration_s} s: {led.acked} accepted, "
                     f"{len(led.maybe)} maybe, {led.failed} failed calls")
        done.set()
        nem.join()            # every fault healed or reported (each heal is bounded)
        if not load.halt(2 * float(cfg.call_timeout_s) + 10):
            errors.append("load: still in a Configure call after the end of the load")
        errors.extend([*([load.error] if load.error else []), *nemesis.errors])
        load_s = soak.now()
        soak.running_again()
        _say("all faults healed; settling")
        verdict, settle_s = soak.settle(float(cfg.settle_timeout_s))
        delays = _measure(read_rows(soak.record_dir, soak.nodes), led, faults, t0_ns)
        for f in faults:  # Configure calls that failed while it was in place (or healing)
            if f.injected_s is not None:
                until = f.healed_s if f.healed_s is not None else load_s
                why = Counter(w.split(":")[0] for x, w in load.failed_at
                              if f.injected_s <= x <= until + 1)
                f.notes.append(f"Configure calls failed: {dict(why)}")
        result.update(
            faults=[f.as_dict() for f in faults],
            injected=dict(Counter(f.kind for f in faults if f.injected_s is not None)),
            messages={"accepted": led.acked, "maybe": len(led.maybe),
                      "failed_calls": led.failed, "failures": load.failed_at[:200],
                      "destinations": verdict.messages, "applied_rows": verdict.applied},
            verdict=verdict.as_dict(), settle_s=round(settle_s, 1),
            delay_ms={"fault": delays["fault"], "calm": delays["calm"]},
            delays=delays["points"], notes=soak.notes, load_s=round(load_s, 1))
        try:
            stats, channels = soak.ctl.status() if soak.ctl else ({}, {})
            result.update(
                controller={k: stats.get(k) for k in ("outbox_redelivered", "outbox_corrupt",
                                                      "outcomes", "health_events")
                            if k in stats},
                channels_end={str(k): v for k, v in channels.items()})
        except Exception as e:  # the verdict stands; the controller's counters are missing
            soak.notes.append(f"controller status not read: {type(e).__name__}: {e}")
        ok = verdict.ok and not errors
    except Exception as e:
        errors.append(f"soak: {type(e).__name__}: {e}")
        done.set()            # stop injecting and heal before the parties are torn down
        if nem is not None:
            nem.join()
        if load is not None:
            load.halt(2 * float(cfg.call_timeout_s) + 10)
        raise
    finally:
        result["error"] = "; ".join(errors) or None
        result["errors"] = errors
        result.setdefault("faults", [f.as_dict() for f in faults])
        soak.close()
        out.write_text(json.dumps(result, indent=1, default=str))
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
