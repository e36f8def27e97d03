"""The RPC-pattern study of the edge paper (Rojas Balderrama and Simonin, "Scalability and
Locality Awareness of Remote Procedure Calls") on our two channels, on the emulated network
of :mod:`delivery.netem`, with the real components: the ``MessageAgent`` gRPC service and
stubs of ``delivery/protos`` over mutual TLS, and a real Pulsar broker
(:class:`harness.broker.PulsarStandalone`, authenticated and authorised) in the broker's
namespace.

**Patterns (Section II; the flavours of II-C).** A *workload* is ``pattern/channel/flavour``:

* unicast (US): ``unicast/rpc/call`` (push to one agent, wait for its reply: round-trip
  latency at the sender), ``unicast/rpc/cast`` (the same push not waited for: one-way latency
  at the receiver), ``unicast/mq/cast`` (one publish on a topic only that agent subscribes
  to). Targets rotate over the agents at a constant request rate (Table I's constant rate).
* multicast (MS): ``multicast/rpc/fanout`` (N pushes, one per agent) vs
  ``multicast/mq/fanout`` (one publish on a topic all N subscribe to), one request per round.
* anycast (AS): ``anycast/rpc/call`` and ``anycast/rpc/cast`` (one agent of the pool chosen
  round-robin by the sender) vs ``anycast/mq/cast`` (a Pulsar ``Shared`` subscription of the
  whole pool: the broker picks the consumer).

The MQ channel is one-way (the controller learns outcomes from packed replies), so it has no
``call``; its sender-side figure is the broker's acknowledgement of each publish.

**Metrics (Section III).** Latency: round trip at the sender for ``call``, one way (receive
time minus the message's generation time, one clock: every process is on this host, where the
paper needed NTP) for the others; p50/p95/p99/max and a CDF per run. System: the sender's
(controller's) and the broker's CPU (process CPU time over the run's wall time; 1.0 = one
core) and resident memory (``/proc``), the relays' and the agents' CPU, and established TCP
connections of the sender and the broker (``ss``, per process and per namespace).
**SLA (Section IV-A).** A run that does not deliver everything within ``sla.factor`` times its
planned duration plus ``sla.grace_s`` is marked failed (what arrived is still reported).

**Network (Section IV-B2, Table III).** Delay and loss are applied between the core (the
controller and the broker, same LAN) and the agents, on both channels' paths: loss by
nftables on each agent's link (:func:`delivery.netem.set_loss`), delay by a relay
(:mod:`delivery.relay`) on the RPC path (in the controller's namespace) and on the MQ path
(in the broker's namespace), transparently redirected so TLS host names still verify.

Processes: the study runs inside the controller's namespace (as the testbed does); agents run
``agents_per_process`` to a process (``python -m delivery.patterns agents``), each agent in
its own node namespace with its own gRPC server and its own Pulsar client (identity
``agent-<n>``); every measured run is a fresh sender process (``python -m delivery.patterns
sender``), whose own CPU, memory and connections are what the study reports.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from envs.netutil import BROKER_ADDRESS, CONTROLLER_ADDRESS, node_address
from security.pki import agent_principal
from security.tls import Security, pinned_options

__all__ = ["WORKLOADS", "PatternsError", "StudyConfig", "Workload", "latency_summary",
           "parse_workload", "run_study"]

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]
AGENT_PORT = 7100                 # every agent's gRPC port (on its own node address)
RPC_RELAY_PORT, MQ_RELAY_PORT = 7300, 7301
NAMESPACE = "public/patterns"     # the study's Pulsar namespace
QUANTILES = np.linspace(0.0, 1.0, 201)   # the CDF points stored per run


class PatternsError(RuntimeError):
    """A study setting is invalid or a part of the study failed (names what and where)."""


# ---------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class Workload:
    """One pattern on one channel with one flavour (Section II; II-C for the flavours)."""

    pattern: str   # unicast | multicast | anycast
    channel: str   # rpc | mq
    flavour: str   # call | cast | fanout

    @property
    def name(self) -> str:
        return f"{self.pattern}/{self.channel}/{self.flavour}"

    @property
    def round_trip(self) -> bool:
        """Latency is the sender's round trip (``call``), else one way at the receiver."""
        return self.flavour == "call"


WORKLOADS = {w.name: w for w in (
    Workload("unicast", "rpc", "call"), Workload("unicast", "rpc", "cast"),
    Workload("unicast", "mq", "cast"), Workload("multicast", "rpc", "fanout"),
    Workload("multicast", "mq", "fanout"), Workload("anycast", "rpc", "call"),
    Workload("anycast", "rpc", "cast"), Workload("anycast", "mq", "cast"))}


def parse_workload(name: str) -> Workload:
    """A workload by name; :class:`PatternsError` listing the known ones otherwise."""
    try:
        return WORKLOADS[str(name)]
    except KeyError:
        raise PatternsError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}") from None


# ---------------------------------------------------------------------------- settings
@dataclass
class StudyConfig:
    """The study's settings (``configs/patterns.yaml``; every field checked here)."""

    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    rate_per_s: float = 200.0          # unicast / anycast requests per second (all agents)
    duration_s: float = 1.5            # unicast / anycast sending time
    fanout_rounds: int = 4             # multicast: requests, each to every agent
    fanout_interval_s: float = 0.5
    payload_bytes: int = 256
    agents_per_process: int = 250
    sla_factor: float = 2.0            # Section IV-A: timeout = factor x planned + grace
    sla_grace_s: float = 5.0
    warmup_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        self.workloads = [parse_workload(w).name for w in self.workloads]
        if not self.workloads:
            raise PatternsError("patterns: workloads is empty")
        for name in ("rate_per_s", "duration_s", "fanout_interval_s", "sla_factor",
                     "warmup_timeout_s"):
            if not float(getattr(self, name)) > 0:
                raise PatternsError(f"patterns.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("fanout_rounds", "payload_bytes", "agents_per_process"):
            if int(getattr(self, name)) < 1:
                raise PatternsError(f"patterns.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.sla_grace_s < 0:
            raise PatternsError(f"patterns.sla_grace_s must be >= 0, got {self.sla_grace_s!r}")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> StudyConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(m) - known)
        if unknown:
            raise PatternsError(f"patterns: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(m))

    @property
    def uses_mq(self) -> bool:
        return any(parse_workload(w).channel == "mq" for w in self.workloads)


def latency_summary(lat_ms: Sequence[float] | np.ndarray) -> dict[str, float]:
    """p50/p95/p99/max/mean of latencies in ms (NaN when there are none)."""
    a = np.asarray(lat_ms, dtype=float)
    if a.size == 0:
        return {k: float("nan") for k in ("p50_ms", "p95_ms", "p99_ms", "max_ms", "mean_ms")}
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {"p50_ms": float(p50), "p95_ms": float(p95), "p99_ms": float(p99),
            "max_ms": float(a.max()), "mean_ms": float(a.mean())}


def _topics(prefix: str, node: int) -> dict[str, str]:
    base = f"persistent://{NAMESPACE}/{prefix}"
    return {"unicast": f"{base}-u{node}", "multicast": f"{base}-m", "anycast": f"{base}-a"}


# ---------------------------------------------------------------------------- /proc, ss
def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all threads); 0 if it is gone."""
    from .agent_host import cpu_seconds as of

    try:
        return of(pid)
    except OSError:
        return 0.0


def rss_mb(pid: int, key: str = "VmRSS") -> float:
    """Resident memory of ``pid`` in MB (``VmHWM``: its peak); NaN if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def tcp_established(ns: str | None, pids: Sequence[int] = ()) -> dict[str, int]:
    """Established TCP connections in namespace ``ns`` (None: this one): ``total`` and one
    count per pid (``pid<N>``), from ``ss -tnp``."""
    cmd = ["ss", "-tnpH", "state", "established"]
    if ns is not None:
        cmd = ["ip", "netns", "exec", ns, *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
    lines = [ln for ln in out.splitlines() if ln.strip()]
    res = {"total": len(lines)}
    for p in pids:
        res[f"pid{p}"] = sum(f"pid={p}," in ln for ln in lines)
    return res


# ---------------------------------------------------------------------------- agents
class _Receipts:
    """Receipt lines ``run msg node gen_ns recv_ns channel`` of one agent process, written
    to a file every ``period_s`` (what the sender reads)."""

    def __init__(self, path: Path, period_s: float = 0.05) -> None:
        self._f = open(path, "a", buffering=1 << 16)  # noqa: SIM115 closed by close()
        self._buf: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, args=(period_s,), daemon=True)
        self._t.start()

    def add(self, run: int, msg: int, node: int, gen_ns: int, recv_ns: int, ch: str) -> None:
        line = f"{run}\t{msg}\t{node}\t{gen_ns}\t{recv_ns}\t{ch}\n"
        with self._lock:
            self._buf.append(line)

    def _flush(self) -> None:
        with self._lock:
            buf, self._buf = self._buf, []
        if buf:
            self._f.write("".join(buf))
            self._f.flush()

    def _loop(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            self._flush()

    def close(self) -> None:
        self._stop.set()
        self._t.join(2)
        self._flush()
        self._f.close()


def _servicer(node: int, receipts: _Receipts) -> Any:
    """The ``MessageAgent`` service of one pattern agent: a ``Push`` is received (each of
    its messages noted with its receive time) and acknowledged; applying it is not part of
    the study (as the paper's benchmark servers, Section III)."""
    from .rpc import pb, pb_grpc

    class PatternAgent(pb_grpc.MessageAgentServicer):  # type: ignore[name-defined]
        async def Push(self, request: Any, context: Any) -> Any:
            now = time.time_ns()
            for m in request.messages:
                receipts.add(m.request_id, m.message_id, node, m.timestamp_ns, now, "rpc")
            return pb.PushAck(accepted=len(request.messages))

    return PatternAgent()


async def _start_server(node: int, ns: str, sec: Security, receipts: _Receipts) -> Any:
    import grpc

    from security.tls import server_credentials

    from .netem import in_netns
    from .rpc import AioRoleGuard, pb_grpc

    guards = [] if sec.insecure else [AioRoleGuard(f"pattern agent {node}", {"controller"})]
    server = grpc.aio.server(interceptors=guards, options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_MessageAgentServicer_to_server(_servicer(node, receipts), server)
    addr = f"{node_address(node)}:{AGENT_PORT}"
    with in_netns(ns):  # the listener belongs to the node's namespace
        if sec.insecure:
            server.add_insecure_port(addr)
        else:
            server.add_secure_port(addr, server_credentials(sec.agent(node)))
        await server.start()
    return server


def _subscribe(node: int, ns: str, url: str, sec: Security, prefix: str,
               patterns: Sequence[str], receipts: _Receipts) -> tuple[Any, list[Any]]:
    """Node ``node``'s Pulsar client (its own identity, created in its namespace so its
    connection crosses its link) and its consumers of the MQ patterns used."""
    import pulsar

    from security.pulsar import client_args

    from .netem import in_netns
    from .rpc import pb

    def on_message(consumer: Any, msg: Any) -> None:
        now = time.time_ns()
        try:
            c = pb.TopicEnvelope.FromString(msg.data()).config
            receipts.add(c.request_id, c.message_id, node, c.timestamp_ns, now, "mq")
        finally:
            consumer.acknowledge(msg)

    topics = _topics(prefix, node)
    with in_netns(ns):
        client = pulsar.Client(url, io_threads=1, message_listener_threads=1,
                               operation_timeout_seconds=60,
                               logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error),
                               **client_args(sec, f"agent-{node}"))
        consumers = []
        for p in patterns:
            shared = p == "anycast"
            consumers.append(client.subscribe(
                topics[p], "pool" if shared else f"agent-{node}",
                consumer_type=pulsar.ConsumerType.Shared if shared
                else pulsar.ConsumerType.Exclusive, message_listener=on_message,
                receiver_queue_size=100))
    return client, consumers


def serve_agents(spec: Mapping[str, Any]) -> None:
    """Run the agents of ``spec`` (nodes, tag, security, Pulsar URL, topic prefix, MQ
    patterns, receipts file, ready file) until SIGTERM."""
    import asyncio

    sec = Security.from_mapping(spec["security"])
    nodes = [int(n) for n in spec["nodes"]]
    tag = str(spec["tag"])
    receipts = _Receipts(Path(spec["receipts"]))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="pattern-agents", daemon=True).start()
    servers = [asyncio.run_coroutine_threadsafe(
        _start_server(n, f"{tag}-n{n}", sec, receipts), loop).result(60) for n in nodes]
    subs: list[tuple[Any, list[Any]]] = []
    if spec.get("pulsar_url") and spec.get("mq_patterns"):
        with ThreadPoolExecutor(8) as ex:
            subs = list(ex.map(lambda n: _subscribe(
                n, f"{tag}-n{n}", str(spec["pulsar_url"]), sec, str(spec["prefix"]),
                list(spec["mq_patterns"]), receipts), nodes))
    ready = Path(spec["ready"])
    ready.with_suffix(".tmp").write_text(str(os.getpid()))
    ready.with_suffix(".tmp").replace(ready)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    for client, _ in subs:
        with contextlib.suppress(Exception):
            client.close()
    for s in servers:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(s.stop(0), loop).result(10)
    receipts.close()


# ---------------------------------------------------------------------------- sender
class _ReceiptReader:
    """Reads the agents' receipt files incrementally: run -> {(msg, node): (gen, recv)}."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self.paths = [Path(p) for p in paths]
        self.offsets = dict.fromkeys(self.paths, 0)
        self.runs: dict[int, dict[tuple[int, int], tuple[int, int]]] = {}

    def poll(self) -> None:
        for p in self.paths:
            try:
                with open(p, "rb") as f:
                    f.seek(self.offsets[p])
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1
            self.offsets[p] += end
            for line in data[:end].decode().splitlines():
                run, msg, node, gen, recv, _ = line.split("\t")
                self.runs.setdefault(int(run), {}).setdefault(
                    (int(msg), int(node)), (int(gen), int(recv)))

    def count(self, run: int) -> int:
        return len(self.runs.get(run, {}))


@dataclass
class _Plan:
    """When and to whom a workload sends: (offset s, targets) per message."""

    sends: list[tuple[float, list[int]]]
    expected: int
    planned_s: float


def _plan(w: Workload, nodes: list[int], cfg: StudyConfig) -> _Plan:
    if w.pattern == "multicast":
        sends = [(i * cfg.fanout_interval_s, list(nodes)) for i in range(cfg.fanout_rounds)]
        return _Plan(sends, cfg.fanout_rounds * len(nodes),
                     cfg.fanout_rounds * cfg.fanout_interval_s)
    m = max(1, round(cfg.rate_per_s * cfg.duration_s))
    sends = [(i / cfg.rate_per_s, [nodes[i % len(nodes)]]) for i in range(m)]
    return _Plan(sends, m, cfg.duration_s)


class _Sender:
    """The controller's side of the study: real gRPC stubs over mutual TLS (one channel per
    agent, pushes issued as futures, as :class:`delivery.controller.Controller` does) and a
    Pulsar client with one producer per topic."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        import grpc

        from security.tls import channel_credentials

        from .rpc import pb_grpc

        self.spec = spec
        self.cfg = StudyConfig.from_mapping(spec["study"])
        self.sec = Security.from_mapping(spec["security"])
        self.nodes = [int(n) for n in spec["nodes"]]
        self.reader = _ReceiptReader([Path(p) for p in spec["receipts"]])
        opts = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000)]
        creds = None if self.sec.insecure else channel_credentials(
            self.sec.identity("controller"))
        self.channels = {n: (grpc.insecure_channel(f"{node_address(n)}:{AGENT_PORT}", opts)
                             if creds is None else grpc.secure_channel(
                                 f"{node_address(n)}:{AGENT_PORT}", creds,
                                 opts + pinned_options(agent_principal(n))))
                         for n in self.nodes}
        self.stubs = {n: pb_grpc.MessageAgentStub(c) for n, c in self.channels.items()}
        self.client: Any = None
        self.producers: dict[str, Any] = {}
        self.payload = os.urandom(self.cfg.payload_bytes)
        self.next_run = int(spec["first_run"])

    def warm_up(self) -> float:
        """One empty push per agent (every channel connected and its TLS session up) and
        the producers of the MQ workloads; returns the seconds it took."""
        from .rpc import pb

        t0 = time.monotonic()
        futs = [s.Push.future(pb.ConfigBatch(), timeout=self.cfg.warmup_timeout_s,
                              wait_for_ready=True) for s in self.stubs.values()]
        for f in futs:
            f.result()
        if self.cfg.uses_mq:
            import pulsar

            from security.pulsar import client_args

            self.client = pulsar.Client(
                str(self.spec["pulsar_url"]), operation_timeout_seconds=60,
                logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error),
                **client_args(self.sec, "controller"))
            topics: set[str] = set()
            for name in self.cfg.workloads:
                w = parse_workload(name)
                if w.channel == "mq":
                    topics |= ({_topics(self.spec["prefix"], n)["unicast"] for n in self.nodes}
                               if w.pattern == "unicast"
                               else {_topics(self.spec["prefix"], 0)[w.pattern]})
            with ThreadPoolExecutor(8) as ex:
                made = ex.map(lambda t: (t, self.client.create_producer(
                    t, batching_enabled=False, block_if_queue_full=True,
                    max_pending_messages=100000, send_timeout_millis=0)), sorted(topics))
                self.producers = dict(made)
            # the broker's paths warm (run 0: receipts the study ignores); a multicast
            # message reaches every agent, so only two of them
            for t, p in self.producers.items():
                kind = t.rsplit("-", 1)[-1][0]
                for i in range({"u": 1, "m": 2}.get(kind, 20)):
                    p.send_async(pb.TopicEnvelope(config=self._message(0, i)).SerializeToString(),
                                 lambda *_: None)
            for p in self.producers.values():
                p.flush()
        return time.monotonic() - t0

    def settle(self, max_s: float = 10.0, window_s: float = 0.25, idle: float = 0.2) -> float:
        """Wait until the agents' processes are idle (each below ``idle`` of a core over
        ``window_s``) and the broker nearly so (below twice that: a JVM is never quite
        idle), at most ``max_s``, so that a run does not measure the tail of the one before
        (or the warm-up's handshakes); returns the seconds waited."""
        pids = {p: idle * (2.0 if k == "broker" else 1.0) for k, p in self._pids().items()
                if k.startswith("agents") or k == "broker"}
        t0 = time.monotonic()
        while pids and time.monotonic() - t0 < max_s:
            c0 = {p: cpu_seconds(p) for p in pids}
            time.sleep(window_s)
            if all((cpu_seconds(p) - c0[p]) / window_s < lim for p, lim in pids.items()):
                break
        return time.monotonic() - t0

    def _message(self, run: int, mid: int) -> Any:
        from .rpc import pb

        return pb.ConfigMessage(message_id=mid, request_id=run, vpc_id=1,
                                timestamp_ns=time.time_ns(), configuration_type="PATTERN",
                                operation_type="UPDATE", resource_id=mid, hosts=[],
                                type_id=1, payload=self.payload)

    def run(self, w: Workload) -> dict[str, Any]:
        """One workload: send its plan, wait for every receipt (or the SLA), measure."""
        from .rpc import pb

        cfg, run = self.cfg, self.next_run
        self.next_run += 1
        plan = _plan(w, self.nodes, cfg)
        deadline_s = cfg.sla_factor * plan.planned_s + cfg.sla_grace_s
        rtt_ms: list[float] = []
        ack_ms: list[float] = []
        errors: list[str] = []
        pending: list[Any] = []
        lock = threading.Lock()
        loops: list[float] = []

        def on_reply(gen: int) -> Callable[[Any], None]:
            def cb(fut: Any) -> None:  # a gRPC future: the agent's reply (or an error)
                t = time.time_ns()
                exc = fut.exception()
                with lock:
                    if exc is None:
                        rtt_ms.append((t - gen) / 1e6)
                    else:
                        errors.append(str(fut.code()))
            return cb

        def on_ack(gen: int) -> Callable[[Any, Any], None]:
            def cb(res: Any, _msg_id: Any) -> None:  # Pulsar: the broker's acknowledgement
                t = time.time_ns()
                with lock:
                    if str(res).rsplit(".", 1)[-1] == "Ok":
                        ack_ms.append((t - gen) / 1e6)
                    else:
                        errors.append(str(res))
            return cb

        pids = self._pids()
        cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
        me0 = os.times()
        t0 = time.monotonic()
        for i, (off, targets) in enumerate(plan.sends):
            if (wait := t0 + off - time.monotonic()) > 0:
                time.sleep(wait)
            msg = self._message(run, i + 1)
            ls = time.perf_counter()
            if w.channel == "rpc":
                batch = pb.ConfigBatch(messages=[msg])
                for n in targets:
                    f = self.stubs[n].Push.future(batch, timeout=deadline_s)
                    if w.round_trip:
                        f.add_done_callback(on_reply(msg.timestamp_ns))
                    pending.append(f)
            else:
                topic = (_topics(self.spec["prefix"], targets[0])["unicast"]
                         if w.pattern == "unicast"
                         else _topics(self.spec["prefix"], 0)[w.pattern])
                data = pb.TopicEnvelope(config=msg).SerializeToString()
                self.producers[topic].send_async(data, on_ack(msg.timestamp_ns))
            loops.append(time.perf_counter() - ls)
        send_s = time.monotonic() - t0
        tcp = {"ctl": tcp_established(None, [os.getpid()]),
               "brk": tcp_established(f"{self.spec['tag']}-brk",
                                      [p for k, p in pids.items() if k == "broker"])}
        end = t0 + deadline_s
        while True:
            self.reader.poll()
            got = self.reader.count(run)
            calls_done = all(f.done() for f in pending)
            if (got >= plan.expected and calls_done) or time.monotonic() >= end:
                break
            time.sleep(0.02)
        wall = time.monotonic() - t0
        me1 = os.times()
        cpu1 = {k: cpu_seconds(p) for k, p in pids.items()}
        for f in pending:
            if not f.done():
                f.cancel()
            elif not w.round_trip and f.exception() is not None:
                errors.append(str(f.code()))
        recs = self.reader.runs.get(run, {})
        one_way = np.array([(r - g) / 1e6 for g, r in recs.values()], dtype=float)
        lat = np.asarray(rtt_ms if w.round_trip else one_way, dtype=float)
        received = len(recs)
        failed = received < plan.expected or (w.round_trip and len(rtt_ms) < plan.expected)
        row: dict[str, Any] = {
            "workload": w.name, "pattern": w.pattern, "channel": w.channel,
            "flavour": w.flavour, "agents": len(self.nodes), "run": run,
            "requests": len(plan.sends), "expected": plan.expected, "received": received,
            "lost": plan.expected - received, "errors": len(errors),
            "receivers": len({node for _, node in recs}),
            "error_kinds": ";".join(sorted(set(errors)))[:200], "failed": bool(failed),
            "planned_s": plan.planned_s, "send_s": send_s, "wall_s": wall,
            "sla_s": deadline_s, "latency": "round-trip" if w.round_trip else "one-way",
            **latency_summary(lat),
            **{f"oneway_{k}": v for k, v in latency_summary(one_way).items()},
            **{f"ack_{k}": v for k, v in latency_summary(ack_ms).items()},
            "send_loop_ms_mean": 1e3 * float(np.mean(loops)) if loops else float("nan"),
            "sender_cpu_s": (me1.user + me1.system) - (me0.user + me0.system),
            "sender_rss_mb": rss_mb(os.getpid()), "sender_rss_peak_mb": rss_mb(
                os.getpid(), "VmHWM"),
            "sender_tcp": tcp["ctl"][f"pid{os.getpid()}"], "ctl_ns_tcp": tcp["ctl"]["total"],
            "brk_ns_tcp": tcp["brk"]["total"],
        }
        row["sender_cpu_util"] = row["sender_cpu_s"] / wall
        for k, p in pids.items():
            row[f"{k}_cpu_s"] = cpu1[k] - cpu0[k]
            row[f"{k}_cpu_util"] = row[f"{k}_cpu_s"] / wall
            if k == "broker":
                row["broker_rss_mb"] = rss_mb(p)
                row["broker_tcp"] = tcp["brk"].get(f"pid{p}", 0)
        row["agents_cpu_s"] = sum(v for k, v in row.items()
                                  if k.startswith("agents") and k.endswith("_cpu_s")
                                  and k != "agents_cpu_s")
        row["cdf_ms"] = (np.quantile(lat, QUANTILES).round(3).tolist() if lat.size else [])
        return row

    def _pids(self) -> dict[str, int]:
        out = {}
        if self.spec.get("broker_pid"):
            out["broker"] = int(self.spec["broker_pid"])
        for i, p in enumerate(self.spec.get("relay_pids") or []):
            out[f"relay{i}"] = int(p)
        for i, p in enumerate(self.spec.get("agent_pids") or []):
            out[f"agents{i}"] = int(p)
        return out

    def close(self) -> None:
        for p in self.producers.values():
            with contextlib.suppress(Exception):
                p.close()
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
        for c in self.channels.values():
            c.close()


def run_sender(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Connect, then run each workload of ``spec['study']`` in turn; returns the rows."""
    s = _Sender(spec)
    try:
        connect_s = s.warm_up()
        rows = []
        for name in s.cfg.workloads:
            settle_s = s.settle()
            row = s.run(parse_workload(name))
            row["connect_s"], row["settle_s"] = connect_s, settle_s
            rows.append(row)
            print(f"    {row['workload']:22s} {row['received']}/{row['expected']} "
                  f"p50 {row['p50_ms']:.2f} p99 {row['p99_ms']:.2f} ms; sender CPU "
                  f"{100 * row['sender_cpu_util']:.0f}%{'  FAILED (SLA)' if row['failed'] else ''}",
                  flush=True)
        return {"rows": rows, "connect_s": connect_s}
    finally:
        s.close()


# ---------------------------------------------------------------------------- the study
@dataclass
class Session:
    """Agents started once for a series of points (same count, same path)."""

    part: str
    agents: int
    relay: bool
    points: list[tuple[float, float, int]]   # (delay ms, loss, repetition)


def sessions(parts: Mapping[str, Any], selected: Sequence[str], repeats: int) -> list[Session]:
    """The study's sessions, one per part and agent count: a part names ``agents`` (one or
    several counts), ``delay_ms`` and ``loss`` (one or several: every combination is a
    point), ``relay`` (route both channels through the delaying relays; needed for a delay)
    and ``broker_conf`` (``standalone.conf`` settings of the part's broker)."""
    out = []
    for name in selected:
        if name not in parts:
            raise PatternsError(f"part {name!r} is not configured; parts: {sorted(parts)}")
        p = parts[name]
        unknown = sorted(set(p) - _PART_KEYS)
        if unknown:
            raise PatternsError(f"parts.{name}: unknown key(s) {unknown}; known: "
                                f"{sorted(_PART_KEYS)}")
        delays = [float(d) for d in _as_list(p.get("delay_ms", 0.0))]
        losses = [float(x) for x in _as_list(p.get("loss", 0.0))]
        for d in delays:
            if d < 0:
                raise PatternsError(f"parts.{name}.delay_ms: must be >= 0, got {d}")
        for x in losses:
            if not 0 <= x < 1:
                raise PatternsError(f"parts.{name}.loss: a fraction in [0, 1), got {x}")
        relay = bool(p.get("relay", any(d > 0 for d in delays)))
        if not relay and any(d > 0 for d in delays):
            raise PatternsError(f"parts.{name}: a delay needs relay: true")
        for n in _as_list(p["agents"]):
            if int(n) < 1:
                raise PatternsError(f"parts.{name}.agents: must be >= 1, got {n}")
            pts = [(d, x, r) for r in range(repeats) for d in delays for x in losses]
            out.append(Session(name, int(n), relay, pts))
    return out


_PART_KEYS = {"agents", "delay_ms", "loss", "relay", "broker_conf"}


def _as_list(v: Any) -> list[Any]:
    return list(v) if isinstance(v, Sequence) and not isinstance(v, str) else [v]


def _set_loss(tag: str, nodes: Sequence[int], loss: float) -> None:
    from .netem import set_loss

    for n in nodes:
        ns = f"{tag}-n{n}"
        subprocess.run(["ip", "netns", "exec", ns, "nft", "delete", "table", "netdev",
                        "smt_loss"], capture_output=True, check=False)
        if loss > 0:
            set_loss(ns, loss)


@contextlib.contextmanager
def _relays(tag: str, on: bool) -> Iterator[list[Any]]:
    """The RPC-path relay (controller namespace) and the MQ-path relay (broker namespace),
    with their redirections, or nothing."""
    if not on:
        yield []
        return
    from .relay import RelayProcess, install_redirect, remove_redirect

    ctl, brk = f"{tag}-ctl", f"{tag}-brk"
    install_redirect(ctl, "output", AGENT_PORT, RPC_RELAY_PORT, daddr="10.211.0.0/16")
    relays: list[Any] = []
    try:
        relays.append(RelayProcess(["ip", "netns", "exec", ctl], RPC_RELAY_PORT).start())
        relays.append(RelayProcess(["ip", "netns", "exec", brk], MQ_RELAY_PORT).start())
        yield relays
    finally:
        for r in relays:
            r.close()
        remove_redirect(ctl)
        remove_redirect(brk)


def _mq_redirect(tag: str, broker_port: int) -> None:
    from .relay import install_redirect

    install_redirect(f"{tag}-brk", "prerouting", broker_port, MQ_RELAY_PORT,
                     not_saddr=CONTROLLER_ADDRESS)


@contextlib.contextmanager
def _agents(tag: str, nodes: list[int], cfg: StudyConfig, sec: Security, pulsar_url: str | None,
            prefix: str, work: Path) -> Iterator[tuple[list[int], list[Path]]]:
    """Agent processes for ``nodes`` (``agents_per_process`` each); yields (pids, receipt
    files) once every agent serves and every consumer is subscribed."""
    mq = sorted({parse_workload(w).pattern for w in cfg.workloads
                 if parse_workload(w).channel == "mq"})
    k = cfg.agents_per_process
    groups = [nodes[i:i + k] for i in range(0, len(nodes), k)]
    procs: list[tuple[subprocess.Popen[bytes], Path, Any]] = []
    receipts = []
    try:
        for i, g in enumerate(groups):
            spec = {"nodes": g, "tag": tag, "security": asdict(sec), "pulsar_url": pulsar_url,
                    "prefix": prefix, "mq_patterns": mq,
                    "receipts": str(work / f"receipts-{i}.tsv"),
                    "ready": str(work / f"agents-{i}.ready")}
            receipts.append(work / f"receipts-{i}.tsv")
            f = work / f"agents-{i}.json"
            f.write_text(json.dumps(spec))
            logf = open(work / f"agents-{i}.log", "w")  # noqa: SIM115 closed below
            p = subprocess.Popen([sys.executable, "-m", "delivery.patterns", "agents", "--spec",
                                  str(f)], cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT)
            procs.append((p, work / f"agents-{i}.ready", logf))
        end = time.monotonic() + 120 + 0.3 * len(nodes)
        for p, ready, logf in procs:
            while not ready.exists():
                if p.poll() is not None or time.monotonic() > end:
                    logf.flush()
                    raise PatternsError(f"agent process {ready.stem} did not get ready "
                                        f"(exit {p.poll()}): "
                                        f"{Path(logf.name).read_text()[-1500:]}")
                time.sleep(0.2)
        yield [p.pid for p, _, _ in procs], receipts
    finally:
        for p, _, _ in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p, _, logf in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            logf.close()


def _prepare_broker_namespace(admin: Callable[..., Any], nodes: Sequence[int]) -> None:
    """The study's namespace: agents consume (any of their subscriptions), the controller
    produces, and the anycast pool's shared subscription is bound to the pool's roles."""
    from security.pulsar import PulsarAdminError

    try:
        admin("PUT", f"/admin/v2/namespaces/{NAMESPACE}")
    except PulsarAdminError as e:
        if "409" not in str(e):
            raise
    admin("POST", f"/admin/v2/namespaces/{NAMESPACE}/permissions/agent-*", ["consume"])
    admin("POST", f"/admin/v2/namespaces/{NAMESPACE}/permissions/controller", ["produce"])
    admin("POST", f"/admin/v2/namespaces/{NAMESPACE}/permissions/subscription/pool",
          [f"agent-{n}" for n in nodes])


def run_parts(tag: str, parts: Mapping[str, Any], selected: Sequence[str], repeats: int,
              cfg: StudyConfig, sec: Security, out: Path, heap: str = "1g",
              say: Callable[[str], None] = print) -> Path:
    """Run the selected parts inside the emulated network ``tag`` (this process is in its
    controller namespace); append one row per workload run to ``out/runs.jsonl`` (points
    already there are skipped: a study can be resumed). Returns that file."""
    plan = sessions(parts, selected, repeats)
    rows_f = out / "runs.jsonl"
    done = set()
    if rows_f.exists():
        for line in rows_f.read_text().splitlines():
            r = json.loads(line)
            done.add((r["part"], r["agents"], r["delay_ms"], r["loss"], r["rep"]))
    broker_ctx: Any = contextlib.nullcontext(None)
    if cfg.uses_mq:
        from harness.broker import PulsarStandalone

        conf = {k: v for name in selected for k, v in (parts[name].get("broker_conf")
                                                         or {}).items()}
        broker_ctx = PulsarStandalone(host=BROKER_ADDRESS, netns=f"{tag}-brk", heap=heap,
                                      direct_memory=heap, security=sec, progress=None,
                                      extra_conf=conf)
    run_no = 1 + sum(1 for _ in rows_f.open()) if rows_f.exists() else 1
    with broker_ctx as broker:
        if broker is not None:
            say(f"broker {broker.service_url} (pid {broker.pid}) in {tag}-brk")
        for si, s in enumerate(plan):
            todo = [pt for pt in s.points if (s.part, s.agents, *pt) not in done]
            if not todo:
                continue
            nodes = list(range(s.agents))
            prefix = f"s{os.getpid()}x{si}x{time.time_ns() % 10**9}"
            work = out / "work" / prefix
            work.mkdir(parents=True, exist_ok=True)
            if broker is not None:
                _prepare_broker_namespace(broker.admin, nodes)
            t0 = time.monotonic()
            with _relays(tag, s.relay) as relays:
                if relays and broker is not None:
                    _mq_redirect(tag, int(broker.port))
                with _agents(tag, nodes, cfg, sec, broker.service_url if broker else None,
                             prefix, work) as (apids, receipts):
                    start_s = time.monotonic() - t0
                    say(f"[{s.part}] {s.agents} agents up in {start_s:.1f} s "
                        f"({len(apids)} processes{', through the relays' if relays else ''})")
                    for delay, loss, rep in todo:
                        for r in relays:
                            r.set_delay(delay)
                        _set_loss(tag, nodes, loss)
                        say(f"  [{s.part}] agents {s.agents} delay {delay:g} ms loss "
                            f"{100 * loss:g}% rep {rep}")
                        spec = {"study": asdict(cfg), "security": asdict(sec), "nodes": nodes,
                                "tag": tag, "prefix": prefix,
                                "receipts": [str(p) for p in receipts],
                                "pulsar_url": broker.service_url if broker else None,
                                "broker_pid": broker.pid if broker else None,
                                "relay_pids": [r.pid for r in relays], "agent_pids": apids,
                                "first_run": run_no * 100}
                        res = _run_sender_process(spec, work / f"sender-{run_no}")
                        run_no += 1
                        with rows_f.open("a") as f:
                            for row in res["rows"]:
                                row.update(part=s.part, delay_ms=delay, loss=loss, rep=rep,
                                           relay=s.relay, agents_start_s=start_s,
                                           sender_wall_s=res["wall_s"])
                                f.write(json.dumps(row) + "\n")
                    _set_loss(tag, nodes, 0.0)
    return rows_f


def _run_sender_process(spec: Mapping[str, Any], base: Path) -> dict[str, Any]:
    """One fresh sender process (in this namespace) for one point."""
    sf, rf = base.with_suffix(".json"), base.with_suffix(".out.json")
    sf.write_text(json.dumps(spec))
    t0 = time.monotonic()
    rc = subprocess.run([sys.executable, "-m", "delivery.patterns", "sender", "--spec", str(sf),
                         "--out", str(rf)], cwd=ROOT, check=False).returncode
    if rc != 0 or not rf.exists():
        raise PatternsError(f"the sender of {sf} failed (exit {rc})")
    res: dict[str, Any] = json.loads(rf.read_text())
    res["wall_s"] = time.monotonic() - t0
    return res


def run_study(parts: Mapping[str, Any], selected: Sequence[str], repeats: int,
              cfg: StudyConfig, sec: Security, out: Path, heap: str = "1g",
              say: Callable[[str], None] = print) -> Path:
    """Build the emulated network (one namespace per agent, for the largest count asked),
    run the parts inside its controller namespace, remove it; returns ``out/runs.jsonl``."""
    from . import netem

    why = netem.available()
    if why:
        raise PatternsError(f"the pattern study needs the emulated network: {why}")
    plan = sessions(parts, selected, repeats)
    if not plan:
        raise PatternsError("no part selected")
    n_max = max(s.agents for s in plan)
    out.mkdir(parents=True, exist_ok=True)
    if not sec.insecure:
        sec.pki.refresh_addresses(["controller", "broker", "admin",
                                   *(f"agent-{n}" for n in range(n_max))])
    t0 = time.monotonic()
    with netem.EmulatedNetwork(netem.NetworkSpec(list(range(n_max)))) as net:
        say(f"emulated network {net.tag}: {n_max} agent namespaces in "
            f"{time.monotonic() - t0:.1f} s")
        job = {"tag": net.tag, "parts": dict(parts), "selected": list(selected),
               "repeats": repeats, "study": asdict(cfg), "security": asdict(sec),
               "out": str(out), "heap": heap}
        f = out / f"study-{net.tag}.json"
        f.write_text(json.dumps(job))
        rc = subprocess.run([*net.exec_prefix(net.controller), sys.executable, "-m",
                             "delivery.patterns", "study", "--job", str(f)], cwd=ROOT,
                            check=False).returncode
    if rc != 0:
        raise PatternsError(f"the study inside the emulated network failed (exit {rc}); its "
                            f"output is above, its files in {out}")
    return out / "runs.jsonl"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m delivery.patterns",
                                 description="the RPC-pattern study's processes")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("agents", help="run pattern agents (spec written by the study)")
    a.add_argument("--spec", required=True)
    s = sub.add_parser("sender", help="run one point's workloads")
    s.add_argument("--spec", required=True)
    s.add_argument("--out", required=True)
    j = sub.add_parser("study", help="run parts inside the network (job written by run_study)")
    j.add_argument("--job", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if args.cmd == "agents":
        serve_agents(json.loads(Path(args.spec).read_text()))
    elif args.cmd == "sender":
        res = run_sender(json.loads(Path(args.spec).read_text()))
        Path(args.out).write_text(json.dumps(res))
    else:
        job = json.loads(Path(args.job).read_text())
        run_parts(job["tag"], job["parts"], job["selected"], int(job["repeats"]),
                  StudyConfig.from_mapping(job["study"]), Security.from_mapping(job["security"]),
                  Path(job["out"]), heap=str(job["heap"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
