"""The loopback testbed of SMART Section VII-D (Figs. 9-10): a real Pulsar broker, N message
agents (the GoDaddy scale by default: 350, several per process), the controller with its
adapter, and a scenario trace replayed in (scaled) real time, once per channel policy.

Measured, not modelled (Section VII-B's metrics):

* controller: bytes and messages it sent (RPC pushes, one per destination; MQ publishes, one
  per message; SubscribeInfo and fences), and its CPU utilisation (the controller process's
  CPU time over the run's wall time, all threads: the parser, the decisions, gRPC and the
  Pulsar client);
* nodes: bytes each agent received on the wire (RPC request bytes and MQ message bytes,
  including the messages of its topics meant for other nodes), total and maximum;
* the delivery delay of every applied message: generation (the controller's timestamp when
  it encapsulates the request) to application (the agent's record); 95th percentile and
  maximum.

Scaling for a 2-core loopback machine (configuration, reported with every result):
``time_scale`` replays trace time faster or slower (0.5: a 30 s interval takes 15 s), and
``payload_scale`` sends ``size * payload_scale`` payload bytes per message. Byte counts are
reported as sent on the wire and also rescaled to trace bytes (``/ payload_scale``, payload
only) so they compare with the simulator.

The controller runs in this process; agents run in ``agent_processes`` child processes
(``python -m delivery.agent_host``). The learned policy is asked through the controller
adapter (``adapter_mode``: ``cached`` decides in the controller with ONNX Runtime; ``remote``
asks the policy server), with a policy server (``serve.py``) started for the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from envs.dsmd.message import messages_from_trace
from envs.dsmd.problems import ProblemSet
from envs.netutil import free_ports
from security.tls import Security
from serving.scenario import adapter_for

from .agent import read_record
from .agent_host import host_spec
from .control_plane import ControlPlane
from .controller import Controller, ControllerConfig
from .policies import ChannelPolicy, make_policy

__all__ = ["RunResult", "RunSpec", "cpu_seconds", "run_once"]

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (all threads; this process if None)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class RunSpec:
    """One testbed run: a policy replaying some windows of a problem set."""

    label: str                          # e.g. "fig9/vpcs=512" or "fig10"
    policy: str                         # rpc | vita | idcs | learned
    problems: ProblemSet
    windows: list[int]
    time_scale: float = 0.5
    payload_scale: float = 0.01
    flush_ms: float = 20.0
    agent_processes: int = 2
    adapter_mode: str = "cached"
    server_url: str | None = None       # policy server for the learned policy
    api_key: str | None = None
    signature_keys: tuple[str, ...] = ("num_nodes", "num_topics")
    drain_timeout_s: float = 60.0
    pack_period_s: float = 0.5
    report_after_s: float = 5.0
    collect_period_s: float = 2.0
    buckets: list[float] = field(default_factory=list)  # trace-time bucket edges (Fig. 10)
    controller: dict[str, Any] = field(default_factory=dict)  # ControllerConfig overrides
    security: Security = field(default_factory=Security)  # every channel's (secure default)
    bundle_trust_keys: tuple[str, ...] = ()  # bundle-signing keys the adapter trusts (+ PKI's)


@dataclass
class RunResult:
    label: str
    policy: str
    summary: dict[str, Any]
    buckets: list[dict[str, Any]]


def _progress(say: Callable[[str], None] | None, text: str) -> None:
    if say is not None:
        say(text)


def run_once(spec: RunSpec, pulsar_url: str, workdir: Path,
             say: Callable[[str], None] | None = print, *,
             admin_url: str | None = None) -> RunResult:
    """Start agents and a controller, replay ``spec.windows``, measure, stop everything.
    ``admin_url``: the broker's admin API, where the controller binds each node's
    subscription to its agent (secure mode; None: bound beforehand by the operator)."""
    ps = spec.problems
    topo = ps.dataset.topology
    nodes = topo.node_ids.astype(int).tolist()
    workdir.mkdir(parents=True, exist_ok=True)
    rec_dir = workdir / "records"
    store_url = f"sqlite:///{workdir / 'metadata.db'}"
    ports = free_ports(len(nodes) + 1)
    agents = {n: f"127.0.0.1:{p}" for n, p in zip(nodes, ports)}
    prefix = f"persistent://public/default/tb-{os.getpid()}-{time.time_ns() % 10**12}"
    ccfg = ControllerConfig.from_mapping({
        "pulsar_url": pulsar_url, "store_url": store_url, "topic_prefix": prefix,
        "reply_port": ports[-1], "payload_scale": spec.payload_scale,
        "collect_period_s": spec.collect_period_s, "security": spec.security,
        "pulsar_admin_url": admin_url, **spec.controller})
    procs = _start_agents(spec, nodes, ports, store_url, rec_dir, pulsar_url,
                          f"127.0.0.1:{ports[-1]}", workdir)
    ctl = adapter = None
    try:
        ctl = Controller(ccfg, agents).start()
        policy = make_policy(spec.policy)
        adapter = _adapter(spec)
        _wait_ready(procs, workdir, 120.0)
        out = _replay(spec, ctl, adapter, policy, say)
        _progress(say, f"  [{spec.label} {spec.policy}] replay done; draining")
        out["drain_s"] = _drain(rec_dir, spec.drain_timeout_s, ctl)
        ctl.collect()
        out["controller"] = ctl.stats.as_dict()
        out["pending_after"] = sum(ctl.pending().values())
    finally:
        if ctl is not None:
            ctl.close()
        if adapter is not None:
            adapter.close()
        agent_cpu = _stop_agents(procs)
    return _measure(spec, out, rec_dir, nodes, agent_cpu)


# ---------------------------------------------------------------------------- processes
def _start_agents(spec: RunSpec, nodes: list[int], ports: list[int], store_url: str,
                  rec_dir: Path, pulsar_url: str, controller: str, workdir: Path) -> list:
    rec_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    k = max(1, min(spec.agent_processes, len(nodes)))
    for i in range(k):
        part = {n: p for j, (n, p) in enumerate(zip(nodes, ports)) if j % k == i}
        sp = host_spec(part, store_url=store_url, record_dir=rec_dir, pulsar_url=pulsar_url,
                       controller=controller, security=spec.security,
                       pack_period_s=spec.pack_period_s,
                       report_after_s=spec.report_after_s)
        f = workdir / f"agents-{i}.json"
        f.write_text(json.dumps(sp))
        ready = workdir / f"agents-{i}.ready"
        logf = open(workdir / f"agents-{i}.log", "w")  # noqa: SIM115 the host's log; _stop_agents closes it
        p = subprocess.Popen([sys.executable, "-m", "delivery.agent_host", "--spec", str(f),
                              "--ready", str(ready)], cwd=ROOT, stdout=logf,
                             stderr=subprocess.STDOUT)
        procs.append((p, ready, logf))
    return procs


def _wait_ready(procs: list, workdir: Path, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    for p, ready, logf in procs:
        while not ready.exists():
            if p.poll() is not None:
                logf.flush()
                tail = Path(logf.name).read_text()[-2000:]
                raise RuntimeError(f"agent host exited with {p.returncode}:\n{tail}")
            if time.monotonic() > end:
                raise TimeoutError(f"agent hosts not ready after {timeout_s:.0f} s "
                                   f"(logs in {workdir})")
            time.sleep(0.1)


def _stop_agents(procs: list) -> float:
    cpu = 0.0
    for p, _, _ in procs:
        if p.poll() is None:
            with contextlib.suppress(OSError):
                cpu += cpu_seconds(p.pid)
            p.send_signal(signal.SIGTERM)
    for p, _, logf in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        logf.close()
    return cpu


def _adapter(spec: RunSpec):
    """The controller adapter (parser, rates, and for the learned policy its decisions)."""
    sig_all = {"num_nodes": spec.problems.num_nodes,
               "num_topics": int(spec.problems.spec.num_topics),
               "topology": spec.problems.dataset.topology.signature()}
    sig = {k: sig_all[k] for k in spec.signature_keys}
    if spec.policy == "learned":
        if spec.server_url is None:
            raise ValueError("the learned policy needs a policy server (server_url)")
        from serving.signing import BundleTrust

        trust = BundleTrust.from_security(spec.security, keys=list(spec.bundle_trust_keys))
        return adapter_for(spec.problems, spec.server_url, spec.adapter_mode,
                           api_key=spec.api_key, scenario_signature=sig, timeout_s=2.0,
                           security=spec.security, bundle_trust=trust)
    return adapter_for(spec.problems, None, "remote", scenario_signature=sig,
                       security=spec.security)


# ---------------------------------------------------------------------------- replay
def _replay(spec: RunSpec, ctl: Controller, adapter, policy: ChannelPolicy,
            say: Callable[[str], None] | None) -> dict[str, Any]:
    ps = spec.problems
    tr, parsed = ps.dataset.trace, ps.parsed
    plane = ControlPlane(ctl, adapter, policy)
    # priming: the first window's traffic as the interval before (the same for every policy)
    first = spec.windows[0]
    plane.prime(messages_from_trace(tr, np.flatnonzero(parsed.message_window == first)))

    rows = np.flatnonzero(np.isin(parsed.message_window, spec.windows))
    msgs = messages_from_trace(tr, rows)
    wins = parsed.message_window[rows]
    trace_start = parsed.t0_ns + first * round(parsed.interval_s * 1e9)
    cpu0, wall0, epoch0 = cpu_seconds(), time.perf_counter(), time.time()
    timeline: list[dict[str, Any]] = []
    next_flush = last_say = wall0
    cur = first
    sent = 0
    gen_trace: list[tuple[int, int]] = []  # (generation ns, trace offset ns)
    for m, w in zip(msgs, wins.tolist()):
        offset = int(m.timestamp_ns) - trace_start
        due = wall0 + max(offset, 0) * 1e-9 * spec.time_scale
        if due > time.perf_counter():
            plane.flush()
            now = time.perf_counter()
            if due > now:
                time.sleep(due - now)
        if w != cur:  # interval boundary: rates of the closed interval -> channels
            plane.flush()
            timeline.append(_snapshot(ctl, cur, cpu0, wall0))
            plane.close_interval()
            cur = w
        live = dataclasses.replace(m, timestamp_ns=ctl.timestamp())  # generated now
        plane.send(live)
        gen_trace.append((live.timestamp_ns, offset))
        sent += 1
        if time.perf_counter() >= next_flush:
            plane.flush()
            next_flush = time.perf_counter() + spec.flush_ms / 1e3
        if time.perf_counter() - last_say > 10:
            last_say = time.perf_counter()
            el = last_say - wall0
            _progress(say, f"  [{spec.label} {spec.policy}] {sent}/{len(msgs)} messages, "
                           f"window {w}, {el:.0f} s, {sent / max(el, 1e-9):.0f} msg/s")
    plane.flush()
    timeline.append(_snapshot(ctl, cur, cpu0, wall0))
    wall = time.perf_counter() - wall0
    return {"messages": sent, "wall_s": wall, "cpu_s": cpu_seconds() - cpu0,
            "decide_s": plane.decide_s, "timeline": timeline, "epoch0": epoch0,
            "sources": dict(getattr(policy, "sources", {})),
            "gen_trace": np.array(gen_trace, dtype=np.int64).reshape(-1, 2)}


def _snapshot(ctl: Controller, window: int, cpu0: float, wall0: float) -> dict[str, Any]:
    s = ctl.stats
    return {"window": window, "t_s": time.perf_counter() - wall0,
            "cpu_s": cpu_seconds() - cpu0, "rpc_bytes": s.rpc_bytes, "mq_bytes": s.mq_bytes,
            "rpc_messages": s.rpc_messages, "mq_messages": s.mq_messages}


def _drain(rec_dir: Path, timeout_s: float, ctl: Controller) -> float:
    """Wait until the records stop growing for 2 s and nothing waits for reprogramming."""
    t0 = time.monotonic()
    last, stable_since = -1, time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        size = sum(f.stat().st_size for f in rec_dir.glob("*.record"))
        if size != last or ctl.pending():
            last, stable_since = size, time.monotonic()
        elif time.monotonic() - stable_since >= 2.0:
            break
        time.sleep(0.2)
    return time.monotonic() - t0


# ---------------------------------------------------------------------------- measures
def _measure(spec: RunSpec, out: dict[str, Any], rec_dir: Path, nodes: Sequence[int],
             agent_cpu: float) -> RunResult:
    delays, gens = [], []
    applied = 0
    rx = []
    rx_seconds: dict[int, int] = {}
    for n in nodes:
        rows, _ = read_record(rec_dir / f"node-{n}.record")
        applied += len(rows)
        for r in rows:
            delays.append(r.applied_ns - r.timestamp_ns)
            gens.append(r.timestamp_ns)
        cf = rec_dir / f"node-{n}.counters.json"
        c = json.loads(cf.read_text()) if cf.is_file() else {}
        rx.append(c.get("rx_bytes_rpc", 0) + c.get("rx_bytes_mq", 0))
        for sec, b in c.get("rx_timeline", {}).items():
            rx_seconds[int(sec)] = rx_seconds.get(int(sec), 0) + int(b)
    d_ms = np.asarray(delays, dtype=np.float64) / 1e6
    rx_arr = np.asarray(rx, dtype=np.float64)
    c = out["controller"]
    wall = out["wall_s"]
    summary = {
        "label": spec.label, "policy": spec.policy, "messages": out["messages"],
        "applied": applied, "wall_s": round(wall, 2), "drain_s": round(out["drain_s"], 2),
        "time_scale": spec.time_scale, "payload_scale": spec.payload_scale,
        "controller_bytes": c["rpc_bytes"] + c["mq_bytes"],
        "controller_rpc_bytes": c["rpc_bytes"], "controller_mq_bytes": c["mq_bytes"],
        "controller_messages": c["rpc_messages"] + c["mq_messages"],
        "controller_rpc_messages": c["rpc_messages"], "controller_mq_messages":
            c["mq_messages"], "subscribe_infos": c["subscribe_infos"],
        "controller_cpu_util": out["cpu_s"] / max(wall, 1e-9),
        "agents_cpu_s": round(agent_cpu, 2),
        "node_bytes_total": float(rx_arr.sum()), "node_bytes_max": float(rx_arr.max(initial=0)),
        "delay_p50_ms": float(np.percentile(d_ms, 50)) if d_ms.size else float("nan"),
        "delay_p95_ms": float(np.percentile(d_ms, 95)) if d_ms.size else float("nan"),
        "delay_max_ms": float(d_ms.max()) if d_ms.size else float("nan"),
        "out_of_order": c["outcomes"].get("OUT_OF_ORDER", 0),
        "malformed": c["outcomes"].get("MALFORMED", 0),
        "reprogrammed": c["reprogrammed"], "pending_after": out["pending_after"],
        "decide_ms_mean": 1e3 * float(np.mean(out["decide_s"])),
        "decisions_by": json.dumps(out["sources"]) if out["sources"] else "",
    }
    summary["controller_bytes_trace"] = summary["controller_bytes"] / spec.payload_scale
    summary["node_bytes_total_trace"] = summary["node_bytes_total"] / spec.payload_scale
    summary["node_bytes_max_trace"] = summary["node_bytes_max"] / spec.payload_scale
    buckets = _bucketise(spec, out, np.asarray(gens, np.int64), d_ms, rx_seconds)
    return RunResult(spec.label, spec.policy, summary, buckets)


def _bucketise(spec: RunSpec, out: dict[str, Any], gens: np.ndarray, d_ms: np.ndarray,
               rx_seconds: dict[int, int]) -> list[dict[str, Any]]:
    """Per window of the replay: controller traffic and CPU (from the timeline), the bytes
    the nodes received in it (agents count per wall-clock second) and the delays of the
    messages generated in it."""
    tl = out["timeline"]
    gt = out["gen_trace"]
    res = []
    prev = {"t_s": 0.0, "cpu_s": 0.0, "rpc_bytes": 0, "mq_bytes": 0, "rpc_messages": 0,
            "mq_messages": 0}
    for snap in tl:
        res.append({"window": snap["window"],
                    "controller_bytes": snap["rpc_bytes"] + snap["mq_bytes"]
                    - prev["rpc_bytes"] - prev["mq_bytes"],
                    "controller_messages": snap["rpc_messages"] + snap["mq_messages"]
                    - prev["rpc_messages"] - prev["mq_messages"],
                    "controller_cpu_util": (snap["cpu_s"] - prev["cpu_s"])
                    / max(snap["t_s"] - prev["t_s"], 1e-9),
                    "node_bytes_total": sum(
                        b for sec, b in rx_seconds.items()
                        if out["epoch0"] + prev["t_s"] <= sec + 0.5 < out["epoch0"] + snap["t_s"])})
        prev = snap
    if gt.size and gens.size:
        # the window of each applied message from its generation time
        ends = np.array([0] + [s["t_s"] for s in tl])
        t_rel = (gens - gt[0, 0]) / 1e9
        idx = np.clip(np.searchsorted(ends[1:], t_rel, side="right"), 0, len(res) - 1)
        for i, b in enumerate(res):
            d = d_ms[idx == i]
            b["applied"] = int(d.size)
            b["delay_p95_ms"] = float(np.percentile(d, 95)) if d.size else float("nan")
            b["delay_max_ms"] = float(d.max()) if d.size else float("nan")
    return res
