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

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from envs.dsmd.message import messages_from_trace
from envs.dsmd.problems import ProblemSet
from envs.netutil import CONTROLLER_ADDRESS, free_ports, node_address
from security.tls import Security
from serving.scenario import adapter_for

from .agent import read_record
from .agent_host import HostProcesses, cpu_seconds
from .control_plane import ControlPlane
from .controller import Controller, ControllerConfig
from .policies import ChannelPolicy, make_policy

__all__ = ["RunResult", "RunSpec", "cpu_seconds", "run_once"]

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]
QUEUED_MS = 50.0  # a run "queued" if a link's p95 queueing delay reached this (or C_p waited)
AGENT_PORT = 7100  # every agent's RPC port in the emulated network (each has its own address)


@dataclass
class RunSpec:
    """One testbed run: a policy replaying some windows of a problem set."""

    label: str                          # e.g. "fig9/vpcs=512" or "fig10"
    policy: str                         # a name of delivery.policies.POLICIES
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
    network: str | None = None          # the emulated network's tag (delivery.netem): this
    #                                     process runs in its controller namespace
    settle_s: float = 0.0               # >0 (network only): before the replay, wait until the
    #                                     controller's link carries only idle traffic
    #                                     (measured in windows of this many seconds)
    control_allowance: bool = False     # and raise C_b by that idle traffic (needs settle_s)
    queue_ms: float = 200.0             # the shaped links' queue (network only)
    policy_params: dict[str, Any] = field(default_factory=dict)  # make_policy's params


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
    if spec.network:  # every agent on its node's address, the controller on its own
        ports[:-1] = [AGENT_PORT] * len(nodes)
        agents = {n: f"{node_address(n)}:{AGENT_PORT}" for n in nodes}
        reply_host = CONTROLLER_ADDRESS
    else:
        agents = {n: f"127.0.0.1:{p}" for n, p in zip(nodes, ports)}
        reply_host = "127.0.0.1"
    prefix = f"persistent://public/default/tb-{os.getpid()}-{time.time_ns() % 10**12}"
    ccfg = ControllerConfig.from_mapping({
        "pulsar_url": pulsar_url, "store_url": store_url, "topic_prefix": prefix,
        "reply_host": reply_host, "reply_port": ports[-1],
        "payload_scale": spec.payload_scale,
        "collect_period_s": spec.collect_period_s, "security": spec.security,
        "pulsar_admin_url": admin_url, **spec.controller})
    procs = _start_agents(spec, nodes, ports, store_url, rec_dir, pulsar_url,
                          f"{reply_host}:{ports[-1]}", workdir)
    ctl = adapter = None
    base_rate = allowance = out_idle = None
    links0 = _link_counters(spec.network)
    queues = None
    try:
        ctl = Controller(ccfg, agents).start()
        policy = make_policy(spec.policy, spec.problems, spec.policy_params)
        adapter = _adapter(spec)
        procs.wait_ready(120.0 + 0.5 * len(nodes))
        if spec.network and spec.settle_s > 0:
            base_rate, idle = _settle(spec, say)
            if spec.control_allowance and base_rate > 0:
                from .netem import set_controller_rate

                set_controller_rate(spec.network, base_rate + idle, spec.queue_ms)
                allowance = idle
                _progress(say, f"  [{spec.label} {spec.policy}] C_b {base_rate / 1e6:.3f} + "
                               f"idle control traffic {idle / 1e6:.3f} Mbit/s")
            out_idle = idle
        if spec.network:
            from .netem import QueueMonitor

            queues = QueueMonitor(spec.network).start()
        out = _replay(spec, ctl, adapter, policy, say)
        _progress(say, f"  [{spec.label} {spec.policy}] replay done; draining")
        out["drain_s"] = _drain(rec_dir, spec.drain_timeout_s, ctl)
        ctl.collect()
        out["controller"] = ctl.stats.as_dict()
        out["pending_after"] = sum(ctl.pending().values())
        out["unconfirmed_after"] = ctl.unconfirmed()
        out["links"] = _link_delta(spec.network, links0, _link_counters(spec.network), nodes)
        if queues is not None:
            out["links"].update(queues.stop())
        if out_idle is not None:
            out["links"]["link_idle_bps"] = out_idle
            out["links"]["link_control_allowance_bps"] = allowance or 0.0
    finally:
        if queues is not None:
            queues.stop()
        if allowance is not None and base_rate is not None and spec.network:
            from .netem import set_controller_rate

            set_controller_rate(spec.network, base_rate, spec.queue_ms)  # the next run's C_b
        if ctl is not None:
            ctl.close()
        if adapter is not None:
            adapter.close()
        agent_cpu = procs.stop()
    return _measure(spec, out, rec_dir, nodes, agent_cpu)


# ---------------------------------------------------------------------------- processes
def _start_agents(spec: RunSpec, nodes: list[int], ports: list[int], store_url: str,
                  rec_dir: Path, pulsar_url: str, controller: str, workdir: Path
                  ) -> HostProcesses:
    rec_dir.mkdir(parents=True, exist_ok=True)
    return HostProcesses.start(dict(zip(nodes, ports)), spec.agent_processes, workdir,
                               netns_tag=spec.network, store_url=store_url,
                               record_dir=rec_dir, pulsar_url=pulsar_url,
                               controller=controller, security=spec.security,
                               pack_period_s=spec.pack_period_s,
                               report_after_s=spec.report_after_s)


def _adapter(spec: RunSpec):
    """The controller adapter (parser, rates, and for the learned policy its decisions)."""
    sig_all = {"num_nodes": spec.problems.num_nodes,
               "num_topics": int(spec.problems.spec.num_topics),
               "topology": spec.problems.dataset.topology.signature()}
    sig = {k: sig_all[k] for k in spec.signature_keys}
    if spec.policy == "learned":
        if spec.server_url is None:
            raise ValueError("the learned policy needs a policy server (server_url)")
        from serving.bundles.signing import BundleTrust

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
    lag_max = 0.0  # how far the replay fell behind the trace's schedule (s)
    # where the replay's time went (s): flushing (a flush returns when the agents answered
    # its pushes), accepting messages, and the interval boundaries
    spent = {"flush": 0.0, "send": 0.0, "boundary": 0.0}

    def timed(part: str, fn: Callable[..., Any], *args: Any) -> None:
        t0 = time.perf_counter()
        fn(*args)
        spent[part] += time.perf_counter() - t0
    gen_trace: list[tuple[int, int]] = []  # (generation ns, trace offset ns)
    for m, w in zip(msgs, wins.tolist()):
        offset = int(m.timestamp_ns) - trace_start
        due = wall0 + max(offset, 0) * 1e-9 * spec.time_scale
        if due > time.perf_counter():
            timed("flush", plane.flush)
            now = time.perf_counter()
            if due > now:
                time.sleep(due - now)
        if w != cur:  # interval boundary: rates of the closed interval -> channels
            t0 = time.perf_counter()
            plane.settle()
            timeline.append(_snapshot(ctl, cur, cpu0, wall0))
            plane.close_interval()
            spent["boundary"] += time.perf_counter() - t0
            cur = w
        lag_max = max(lag_max, time.perf_counter() - due)
        live = dataclasses.replace(m, timestamp_ns=ctl.timestamp())  # generated now
        timed("send", plane.send, live)
        gen_trace.append((live.timestamp_ns, offset))
        sent += 1
        if time.perf_counter() >= next_flush:
            timed("flush", plane.flush)
            next_flush = time.perf_counter() + spec.flush_ms / 1e3
        if time.perf_counter() - last_say > 10:
            last_say = time.perf_counter()
            el = last_say - wall0
            _progress(say, f"  [{spec.label} {spec.policy}] {sent}/{len(msgs)} messages, "
                           f"window {w}, {el:.0f} s, {sent / max(el, 1e-9):.0f} msg/s")
    plane.settle()
    timeline.append(_snapshot(ctl, cur, cpu0, wall0))
    wall = time.perf_counter() - wall0
    cpu_s = cpu_seconds() - cpu0
    plane.finish()  # after the run's measurements: it only scores the last interval
    return {"messages": sent, "wall_s": wall, "cpu_s": cpu_s,
            "decide_s": plane.decide_s, "timeline": timeline, "epoch0": epoch0,
            "predictions": plane.predictions, "delay_loads": plane.delay_loads,
            "realised": plane.realised, "realised_loads": plane.realised_loads,
            "lag_max_ms": lag_max * 1e3, "spent": spent,
            "sources": dict(getattr(policy, "sources", {})),
            "gen_trace": np.array(gen_trace, dtype=np.int64).reshape(-1, 2)}


def _snapshot(ctl: Controller, window: int, cpu0: float, wall0: float) -> dict[str, Any]:
    s = ctl.stats
    return {"window": window, "t_s": time.perf_counter() - wall0,
            "cpu_s": cpu_seconds() - cpu0, "rpc_bytes": s.rpc_bytes, "mq_bytes": s.mq_bytes,
            "rpc_messages": s.rpc_messages, "mq_messages": s.mq_messages}


DRAIN_QUIET_S = 2.0    # the records unchanged this long, everything confirmed: drained
DRAIN_COLLECT_S = 1.0  # the drain collects the agents' packed replies this often


def _drain(rec_dir: Path, timeout_s: float, ctl: Controller) -> float:
    """Wait until every accepted delivery is confirmed by its node's packed reply
    (:meth:`Controller.unconfirmed`; replies are collected here as well as on the
    controller's period), nothing waits for reprogramming, and the records have not grown for
    ``DRAIN_QUIET_S``. Records that merely stop growing are not enough: a message queued
    behind redundant MQ traffic on a slow node link can arrive seconds after the last line."""
    t0 = time.monotonic()
    last, stable_since, collected = -1, time.monotonic(), time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        size = sum(f.stat().st_size for f in rec_dir.glob("*.record"))
        if size != last or ctl.pending() or ctl.unconfirmed():
            last, stable_since = size, time.monotonic()
        elif time.monotonic() - stable_since >= DRAIN_QUIET_S:
            break
        if time.monotonic() - collected >= DRAIN_COLLECT_S:
            try:
                ctl.collect()
            except Exception as e:  # as the controller's own collect loop: logged, retried
                log.warning("drain: collecting the agents' replies failed: %s", e)
            collected = time.monotonic()
        time.sleep(0.2)
    return time.monotonic() - t0


# ---------------------------------------------------------------------------- links
def _settle(spec: RunSpec, say: Callable[[str], None] | None) -> tuple[float, float]:
    """Wait until the controller's link carries only its idle traffic: the controller polling
    every agent for replies, TLS sessions, broker probes (traffic that depends on the number
    of agents, not on the scaled trace). Connecting to every agent fills the link for a
    while after the agents are up, and a replay started then would queue behind it. The
    rate is taken over consecutive windows of ``spec.settle_s`` until one is below 80% of
    C_b and within 25% of the window before (at most ten windows; otherwise the lowest
    window, with a warning). Returns (C_b, the idle rate), bit/s; zeros if the controller's
    link is not shaped."""
    from .netem import controller_qdisc

    assert spec.network is not None
    base = 8.0 * controller_qdisc(spec.network)["rate_Bps"]
    if base <= 0:  # an unshaped controller link: nothing to settle against
        return 0.0, 0.0
    rates: list[float] = []
    q0, t0 = controller_qdisc(spec.network), time.perf_counter()
    settled = False
    for _ in range(10):
        time.sleep(spec.settle_s)
        q1, t1 = controller_qdisc(spec.network), time.perf_counter()
        rates.append(8.0 * (q1["bytes"] - q0["bytes"]) / (t1 - t0))
        q0, t0 = q1, t1
        if len(rates) >= 2 and rates[-1] < 0.8 * base and \
                abs(rates[-1] - rates[-2]) <= 0.25 * max(rates[-1], 1.0):
            settled = True
            break
    if not settled:
        log.warning("settling: the controller's link did not settle (window rates %s bit/s); "
                    "using the lowest", [round(r) for r in rates])
    idle = rates[-1] if settled else min(rates)
    _progress(say, f"  [{spec.label} {spec.policy}] controller link settled after "
                   f"{len(rates) * spec.settle_s:.0f} s: idle traffic {idle / 1e6:.3f} Mbit/s")
    return base, idle


def _link_counters(tag: str | None) -> dict[str, Any]:
    """The emulated network's per-link byte and queue counters (empty without one): the
    switch's ports (towards each node) and the controller's own shaped egress."""
    if not tag:
        return {}
    from .netem import backlog_drops, controller_qdisc, switch_counters

    return {"ports": switch_counters(tag), "controller": controller_qdisc(tag),
            "backlog_drops": backlog_drops()}


def _link_delta(tag: str | None, a: dict[str, Any], b: dict[str, Any],
                nodes: Sequence[int]) -> dict[str, float]:
    """What crossed the links during a run: bytes into each node (wire bytes: TLS, TCP/IP
    and framing included), whether a shaped link queued (its token bucket was over its
    limit) or dropped, and the packets the kernel's input queues dropped before any link
    (:func:`delivery.netem.backlog_drops`: the whole machine's)."""
    if not tag or not a or not b:
        return {}
    ports_a, ports_b = a["ports"], b["ports"]
    rx = []
    over = drops = 0
    for i, _ in enumerate(nodes):
        p = f"p{i}"
        rx.append(ports_b[p]["tx"] - ports_a[p]["tx"])
        over += int(ports_b[p]["overlimits"] - ports_a[p]["overlimits"] > 0)
        drops += ports_b[p]["drops"] - ports_a[p]["drops"]
    ca, cb = a["controller"], b["controller"]
    return {"link_node_bytes_total": float(sum(rx)), "link_node_bytes_max": float(max(rx)),
            "link_nodes_queued": over, "link_node_drops": drops,
            "link_controller_bytes": float(cb["bytes"] - ca["bytes"]),
            "link_controller_overlimits": cb["overlimits"] - ca["overlimits"],
            "link_controller_drops": cb["drops"] - ca["drops"],
            "host_backlog_drops": b.get("backlog_drops", 0) - a.get("backlog_drops", 0)}


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
    send_ms = np.asarray(delays, dtype=np.float64) / 1e6
    d_ms = _arrival_delays_ms(spec, out, np.asarray(gens, np.int64), send_ms)
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
        "send_delay_p95_ms": float(np.percentile(send_ms, 95)) if send_ms.size
        else float("nan"),
        "replay_lag_max_ms": float(out.get("lag_max_ms", 0.0)),
        **{f"replay_{k}_s": round(v, 2) for k, v in out.get("spent", {}).items()},
        "out_of_order": c["outcomes"].get("OUT_OF_ORDER", 0),
        "malformed": c["outcomes"].get("MALFORMED", 0),
        "reprogrammed": c["reprogrammed"], "pending_after": out["pending_after"],
        "unconfirmed_after": out["unconfirmed_after"],
        "decide_ms_mean": 1e3 * float(np.mean(out["decide_s"])),
        "decisions_by": json.dumps(out["sources"]) if out["sources"] else "",
        "network": spec.network or "loopback",
        **_predicted(out.get("predictions", [])), **_realised(out.get("realised", [])),
        **out.get("links", {}),
        **{k: c.get(k, 0) for k in ("inflight_waits", "inflight_wait_s", "inflight_peak",
                                    "failovers", "probes_congested", "probes_waited", "rerouted")},
    }
    summary["queued"] = bool(  # a link's queue held >= QUEUED_MS, or a send waited for C_p
        summary.get("link_controller_queue_p95_ms", 0.0) >= QUEUED_MS
        or summary.get("link_nodes_queue_p95_ms", 0.0) >= QUEUED_MS
        or summary["inflight_waits"] > 0)
    summary["controller_bytes_trace"] = summary["controller_bytes"] / spec.payload_scale
    summary["node_bytes_total_trace"] = summary["node_bytes_total"] / spec.payload_scale
    summary["node_bytes_max_trace"] = summary["node_bytes_max"] / spec.payload_scale
    buckets = _bucketise(spec, out, np.asarray(gens, np.int64), d_ms, rx_seconds)
    if out.get("delay_loads"):  # the delay model's inputs, to calibrate it (bench_delay.py)
        (rec_dir.parent / "delay_loads.json").write_text(json.dumps(out["delay_loads"]))
    if out.get("realised_loads"):  # the same per delivered interval (fidelity)
        (rec_dir.parent / "delay_loads_realised.json").write_text(
            json.dumps(out["realised_loads"]))
    return RunResult(spec.label, spec.policy, summary, buckets)


def _arrival_delays_ms(spec: RunSpec, out: dict[str, Any], gens: np.ndarray,
                       send_ms: np.ndarray) -> np.ndarray:
    """Delivery delay from each request's arrival at the controller (its due time in the
    replay: ``epoch0 + offset * time_scale``) to its application. A controller that cannot
    keep up (C_b or C_p saturated: the replay waits on sends) falls behind the schedule, and
    that wait counts, as it would for a request that arrived on time."""
    gt = out["gen_trace"]
    if not gens.size or not gt.size:
        return send_ms
    order = np.argsort(gt[:, 0])
    ts, offs = gt[order, 0], gt[order, 1]
    i = np.clip(np.searchsorted(ts, gens), 0, len(ts) - 1)
    known = ts[i] == gens
    due_ns = round(out["epoch0"] * 1e9) + offs[i] * spec.time_scale
    lag_ms = np.where(known, (gens - due_ns) / 1e6, 0.0)
    return send_ms + np.maximum(lag_ms, 0.0)


def _predicted(preds: list[dict[str, float]]) -> dict[str, Any]:
    """The simulator's verdict on the decisions the run applied: whether any interval
    violated C_b, C_p or some node's s(n) (Eq. 1), by how much at most, each resource's
    utilisation at most, and the delay model's p50 and p95 of the worst interval."""
    if not preds:
        return {}
    worst = {k: max(p[k] for p in preds) for k in preds[0]}
    return {"sim_delay_p50_ms": worst["delay_p50_ms"], "sim_delay_p95_ms": worst["delay_p95_ms"],
            "sim_bw_utilisation": worst["bw_utilisation"],
            "sim_cpu_utilisation": worst["cpu_utilisation"],
            "sim_node_utilisation": worst["node_utilisation"],
            "sim_bw_violation": worst["controller_bw_violation"],
            "sim_cpu_violation": worst["controller_cpu_violation"],
            "sim_node_violation": worst["node_violation"],
            "sim_nodes_over": int(worst["nodes_over_capacity"]),
            "sim_utilisation": worst["utilisation"],  # max of bw/C_b, sends/C_p, b(n)/s(n)
            "sim_violates": bool(worst["controller_bw_violation"] > 0
                                 or worst["controller_cpu_violation"] > 0
                                 or worst["node_violation"] > 0)}


def _realised(preds: list[dict[str, float]]) -> dict[str, Any]:
    """The delay model on the intervals as delivered (their own rates and channels,
    :meth:`ControlPlane.realise`): :func:`_predicted`'s worst interval's p50 and p95, and
    each resource's highest utilisation."""
    worst = _predicted(preds)
    return {f"sim_realised_{k}": worst[f"sim_{k}"] for k in
            ("delay_p50_ms", "delay_p95_ms", "bw_utilisation", "node_utilisation")} \
        if worst else {}


def _bucketise(spec: RunSpec, out: dict[str, Any], gens: np.ndarray, d_ms: np.ndarray,
               rx_seconds: dict[int, int]) -> list[dict[str, Any]]:
    """Per window of the replay: controller traffic and CPU (from the timeline), the bytes
    the nodes received in it (agents count per wall-clock second), the delays of the
    messages generated in it and the delay model's p50 and p95 of it as delivered."""
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
            b["delay_p50_ms"] = float(np.percentile(d, 50)) if d.size else float("nan")
            b["delay_p95_ms"] = float(np.percentile(d, 95)) if d.size else float("nan")
            b["delay_max_ms"] = float(d.max()) if d.size else float("nan")
    real = out.get("realised") or []
    if len(real) == len(res):  # one per window, in order: the delay model beside each
        for b, p in zip(res, real):
            b["sim_delay_p50_ms"], b["sim_delay_p95_ms"] = p["delay_p50_ms"], p["delay_p95_ms"]
    return res
