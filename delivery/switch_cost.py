"""What a change of channels really costs: the lossless switch of SMART Section VI-A measured
under load, and the switching weights of the online cost (Section V-D) fitted to it.

A switch (:meth:`delivery.controller.Controller.set_channels`) writes the store, sends the
SubscribeInfos of the new subscriptions and waits for every acknowledgement (each agent
creates its durable subscription on the broker before it answers), pushes what was decided
under the old channels, makes the new channels current, sends the unsubscribing
SubscribeInfos and publishes the fences. The messages of the types it moves wait until the
new channels are current. After it returns, each agent that left a topic drains it up to
the fence and deletes its durable subscription on the broker (off the sending path).

:class:`SwitchBench` measures that with real components: a broker, agents (in their own
processes, on the emulated network's node links or on loopback), the controller, and a
steady stream of messages (:class:`LoadSpec`: background types on RPC and on topics, plus
the types being switched). For each :class:`SwitchPoint` (``k`` types, ``d`` destinations
each, on a topic of their own or all on one) it switches the ``k`` types RPC -> topics,
topics -> other topics, and topics -> RPC, and records per switch (:data:`SAMPLE_FIELDS`):

* ``block_s``: how long ``set_channels`` took (called to wait for it), split into ``store_s``,
  ``subscribe_s`` (the subscribing SubscribeInfos, sent concurrently, until the last
  acknowledgement), ``flush_s``, ``unsubscribe_s`` and the rest (fences);
* ``sender_lag_s``: how far the message stream fell behind its schedule during the switch;
* ``drain_s``: from the switch's return until every node that left a topic recorded its
  durable subscription deleted (fence consumed, subscription removed on the broker);
* the delivery delay of every message (schedule -> applied at its last destination, from
  the agents' records) due from the switch on until ``settle_s`` after it returned, against
  the messages due in the ``pre_s`` before it (the same load without a switch):
  ``added_delay_mean_s`` (the difference of the means), ``added_delay_total_s`` (that times
  the messages: message-seconds) and the p95 before and during.

:func:`fit_costs` fits ``block_s = c0 + a SubscribeInfos + b moved types`` (least squares on
the medians over the repetitions of each point and direction; residual spread reported),
the same with subscribing and unsubscribing SubscribeInfos apart, ``drain_s`` on the
unsubscriptions and moved types, and ``added_delay_mean_s``. :func:`costs_document` makes the
document ``envs/dsmd/switching_costs.json`` holds (:func:`check_costs` is its schema) and
:func:`online_weights` the weights it implies for an interval of ``T`` seconds.

The whole measurement of one network is one process (``python -m delivery.switch_cost run
--spec``), started inside the emulated network's controller namespace by :func:`measure`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import itertools
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .agent_host import HostProcesses

__all__ = [
    "DIRECTIONS",
    "SAMPLE_FIELDS",
    "SCHEMA_KEYS",
    "CostsError",
    "LoadSpec",
    "SwitchBench",
    "SwitchPoint",
    "check_costs",
    "costs_document",
    "default_points",
    "fit_costs",
    "least_squares",
    "load_costs",
    "measure",
    "online_weights",
]

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]
RPC = 0
DIRECTIONS = ("rpc->mq", "mq->mq", "mq->rpc")
AGENT_PORT = 7100               # every agent's port in the emulated network (own address each)
TOPIC_B = 1000                  # the second topic set of a point starts here (mq->mq)
BACKGROUND_TOPIC = 2001         # background MQ types' topics start here
SAMPLE_FIELDS = ("point", "direction", "rep", "types", "dests", "shared", "subscribe",
                 "unsubscribe", "subscribe_infos", "deferred", "fences", "block_s", "store_s",
                 "subscribe_s", "flush_s", "unsubscribe_s", "other_s", "sender_lag_s",
                 "drain_s", "delay_p50_before_s", "delay_p95_before_s", "delay_p95_during_s",
                 "delay_max_during_s", "added_delay_mean_s", "added_delay_total_s",
                 "messages_during", "missing")
SCHEMA_KEYS = ("seconds_per_subscribe_info", "seconds_per_moved_type", "fit", "network",
               "machine", "date", "command")


class CostsError(ValueError):
    """A switching-cost document or measurement setting is wrong (names the key)."""


# ---------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class SwitchPoint:
    """``types`` types with ``dests`` destination nodes each, switched together: each on a
    topic of its own (``shared=False``: ``types * dests`` (node, topic) subscriptions) or all
    on one topic with the same destinations (``shared=True``: ``dests`` subscriptions)."""

    name: str
    types: int
    dests: int
    shared: bool = False

    def __post_init__(self) -> None:
        if self.types < 0 or self.dests < 1:
            raise CostsError(f"switch point {self.name!r}: types must be >= 0 and dests >= 1, "
                             f"got {self.types}, {self.dests}")

    def hosts(self, nodes: Sequence[int]) -> list[tuple[int, ...]]:
        """The destinations of each of the point's types (consecutive blocks of nodes)."""
        if self.dests > len(nodes):
            raise CostsError(f"switch point {self.name!r}: {self.dests} destinations, but only "
                             f"{len(nodes)} nodes")
        out = []
        for i in range(self.types):
            start = 0 if self.shared else i * self.dests
            out.append(tuple(nodes[(start + j) % len(nodes)] for j in range(self.dests)))
        return out

    def topics(self, second: bool) -> list[int]:
        """The topic of each type in the first (A) or second (B) topic set."""
        base = TOPIC_B if second else 1
        return [base if self.shared else base + i for i in range(self.types)]


def default_points(max_dests: int) -> list[SwitchPoint]:
    """The measured grid: 1..100 types, 1..400 SubscribeInfos per direction (800 for
    topic -> topic), with the number of types and of SubscribeInfos varied apart."""
    pts = [SwitchPoint("k1-d1", 1, 1), SwitchPoint("k1-d8", 1, 8), SwitchPoint("k1-d32", 1, 32),
           SwitchPoint("k8-d4", 8, 4), SwitchPoint("k8-d16", 8, 16),
           SwitchPoint("k32-d8", 32, 8), SwitchPoint("k100-d4", 100, 4),
           SwitchPoint("k16-d4-shared", 16, 4, True), SwitchPoint("k100-d2-shared", 100, 2, True)]
    return [p for p in pts if p.dests <= max_dests]


@dataclass(frozen=True)
class LoadSpec:
    """The steady stream: ``background_rate`` messages/s over ``background_rpc`` RPC types
    (``rpc_dests`` destinations each) and ``background_mq`` types on topics of their own
    (``mq_dests`` each), and ``switched_rate`` messages/s over the types being switched.
    RPC messages are pushed every ``flush_ms``."""

    background_rate: float = 40.0
    switched_rate: float = 10.0
    background_rpc: int = 4
    background_mq: int = 4
    rpc_dests: int = 8
    mq_dests: int = 16
    size_bytes: int = 256
    flush_ms: float = 100.0


# ---------------------------------------------------------------------------- the stream
class Stream(threading.Thread):
    """Messages on a schedule (message ``i`` is due at ``start + i / rate``), alternating
    between the background types and the types being switched; each message has a resource
    of its own, so every one is applied at each destination (none is superseded) and its
    delivery delay is ``applied - due``. A send blocked by a switch makes the stream fall
    behind; it catches up as fast as it can."""

    def __init__(self, ctl: Any, load: LoadSpec, background: Sequence[tuple[int, tuple]]
                 ) -> None:
        super().__init__(name="switch-cost-stream", daemon=True)
        self.ctl, self.load, self.background = ctl, load, list(background)
        self.switched: list[tuple[int, tuple]] = []
        self.due: dict[int, tuple[int, int, int]] = {}  # message id -> (due ns, sent ns, type)
        self.error: BaseException | None = None
        self._stop_evt = threading.Event()
        self._ids = itertools.count(1)

    def run(self) -> None:
        from envs.dsmd.message import Message

        try:
            ld = self.load
            rate = ld.background_rate + ld.switched_rate
            share = ld.switched_rate / rate if rate else 0.0
            p0, w0 = time.perf_counter(), time.time_ns()
            next_flush = p0
            acc = 0.0
            i = 0
            bg = itertools.cycle(self.background)
            sw_i = 0
            while not self._stop_evt.is_set():
                due = p0 + i / rate
                now = time.perf_counter()
                if due > now:
                    time.sleep(min(due - now, 0.05))
                    continue
                acc += share
                sw = self.switched
                if acc >= 1.0 and sw:
                    acc -= 1.0
                    t, hosts = sw[sw_i % len(sw)]
                    sw_i += 1
                else:
                    acc = min(acc, 1.0)
                    t, hosts = next(bg)
                mid = next(self._ids)
                msg = Message(mid, mid, 1, "SUBNET", "UPDATE", mid, ld.size_bytes, hosts,
                              self.ctl.timestamp())
                sent = time.time_ns()
                self.ctl.send(msg, t)
                self.due[mid] = (w0 + round((due - p0) * 1e9), sent, t)
                i += 1
                if time.perf_counter() >= next_flush:
                    self.ctl.flush(wait=False)
                    next_flush = time.perf_counter() + ld.flush_ms / 1e3
        except BaseException as e:  # reported by stop()
            self.error = e

    def stop(self) -> None:
        self._stop_evt.set()
        self.join(30)
        if self.error is not None:
            raise RuntimeError(f"the message stream failed: {self.error!r}") from self.error


# ---------------------------------------------------------------------------- records
class RecordWatch:
    """Reads the agents' records as they grow: subscription events as they appear (with the
    wall time they were seen) and applied rows (message id -> latest applied ns per node)."""

    def __init__(self, rec_dir: Path) -> None:
        self.rec_dir = rec_dir
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}
        self.deleted: dict[tuple[int, str], int] = {}  # (node, topic) -> seen ns (latest)
        self.applied: dict[int, int] = {}  # message id -> latest applied ns over its nodes
        self.applied_rows = 0

    def poll(self) -> None:
        now = time.time_ns()
        for f in self.rec_dir.glob("node-*.record"):
            node = int(f.stem.split("-")[1])
            off = self._offsets.get(f, 0)
            try:
                with open(f) as fh:
                    fh.seek(off)
                    chunk = fh.read()
                    self._offsets[f] = fh.tell()
            except OSError:
                continue
            text = self._partial.pop(f, "") + chunk
            lines = text.split("\n")
            if lines[-1]:
                self._partial[f] = lines[-1]
            for ln in lines[:-1]:
                p = ln.split("\t")
                if p[0] == "A" and len(p) == 8:
                    mid, ap = int(p[1]), int(p[7])
                    self.applied_rows += 1
                    if ap > self.applied.get(mid, 0):
                        self.applied[mid] = ap
                elif p[0] == "S" and len(p) == 4 and p[2] == "deleted":
                    self.deleted[(node, p[1])] = now


# ---------------------------------------------------------------------------- the bench
@dataclass
class _Phases:
    store_s: float = 0.0
    subscribe_s: float = 0.0
    flush_s: float = 0.0
    unsubscribe_s: float = 0.0
    subscribe_n: int = 0
    unsubscribe_n: int = 0
    thread: int = 0   # the switching thread (a sender's flush meanwhile is not the switch's)


class SwitchBench:
    """Agents, a controller and the stream on a broker; :meth:`run_point` measures one
    point's three switches. ``network``: the emulated network's tag (this process runs in
    its controller namespace; agents listen on their node addresses), None for loopback.
    ``agent_processes = 0`` runs the agents in this process (tests)."""

    def __init__(self, pulsar_url: str, admin_url: str | None, nodes: Sequence[int],
                 workdir: Path, *, security: Any = None, network: str | None = None,
                 load: LoadSpec = LoadSpec(), agent_processes: int = 1,
                 controller: Mapping[str, Any] | None = None, pre_s: float = 1.5,
                 settle_s: float = 2.0, drain_timeout_s: float = 60.0,
                 say: Callable[[str], None] = print) -> None:
        from security.tls import Security

        self.pulsar_url, self.admin_url = pulsar_url, admin_url
        self.nodes = [int(n) for n in nodes]
        self.workdir = Path(workdir)
        self.security = Security.from_mapping(security)
        self.network, self.load = network, load
        self.agent_processes = int(agent_processes)
        self.controller_kw = dict(controller or {})
        self.pre_s, self.settle_s, self.drain_timeout_s = pre_s, settle_s, drain_timeout_s
        self.say = say
        self.samples: list[dict[str, Any]] = []
        self._windows: list[dict[str, Any]] = []  # per sample: t0, t1, index
        self._procs: HostProcesses | None = None
        self._host: Any = None
        self.ctl: Any = None
        self.stream: Stream | None = None
        self.watch = RecordWatch(self.workdir / "records")
        self._phases = _Phases()
        self._bg: list[tuple[int, tuple]] = []
        self._points = itertools.count(1)

    # life cycle
    def start(self) -> SwitchBench:
        from envs.netutil import CONTROLLER_ADDRESS, free_ports, node_address

        from .controller import Controller, ControllerConfig

        rec = self.workdir / "records"
        rec.mkdir(parents=True, exist_ok=True)
        store_url = f"sqlite:///{self.workdir / 'metadata.db'}"
        ports = free_ports(len(self.nodes) + 1)
        if self.network:
            ports[:-1] = [AGENT_PORT] * len(self.nodes)
            agents = {n: f"{node_address(n)}:{AGENT_PORT}" for n in self.nodes}
            reply_host = CONTROLLER_ADDRESS
        else:
            agents = {n: f"127.0.0.1:{p}" for n, p in zip(self.nodes, ports)}
            reply_host = "127.0.0.1"
        prefix = f"persistent://public/default/sw-{os.getpid()}-{time.time_ns() % 10**12}"
        kw = {"collect_period_s": 1.0, "reprogram_period_s": 0.5, **self.controller_kw}
        cfg = ControllerConfig(self.pulsar_url, store_url, topic_prefix=prefix,
                               reply_host=reply_host, reply_port=ports[-1],
                               security=self.security, pulsar_admin_url=self.admin_url, **kw)
        reply = f"{reply_host}:{ports[-1]}"
        node_ports = dict(zip(self.nodes, ports[:-1]))
        if self.agent_processes <= 0:
            self._start_agents_here(store_url, rec, reply, node_ports)
        else:
            self._start_agent_processes(store_url, rec, reply, node_ports)
        self.ctl = Controller(cfg, agents).start()
        self._wait_agents()
        self._instrument()
        ld = self.load
        n = self.nodes
        bg_rpc = [(1 + i, tuple(n[(i * ld.rpc_dests + j) % len(n)]
                                for j in range(min(ld.rpc_dests, len(n)))))
                  for i in range(ld.background_rpc)]
        bg_mq = [(100 + i, tuple(n[(i * ld.mq_dests + j) % len(n)]
                                 for j in range(min(ld.mq_dests, len(n)))))
                 for i in range(ld.background_mq)]
        self._bg = bg_rpc + bg_mq
        chans = {t: RPC for t, _ in bg_rpc} | {t: BACKGROUND_TOPIC + i
                                               for i, (t, _) in enumerate(bg_mq)}
        self.ctl.set_channels(chans, dict(self._bg))
        self.stream = Stream(self.ctl, ld, self._bg)
        self.stream.start()
        return self

    def _start_agents_here(self, store_url: str, rec: Path, reply: str,
                           ports: Mapping[int, int]) -> None:
        from envs.netutil import node_address

        from .agent import AgentConfig
        from .agent_host import AgentHost

        netns = {n: f"{self.network}-n{n}" for n in self.nodes} if self.network else None
        cfgs = [AgentConfig(n, store_url, rec, pulsar_url=self.pulsar_url, controller=reply,
                            port=p, security=self.security, pack_period_s=0.5,
                            report_after_s=5.0,
                            host=node_address(n) if self.network else "127.0.0.1")
                for n, p in ports.items()]
        self._host = AgentHost(cfgs, self.pulsar_url, netns=netns).start()

    def _start_agent_processes(self, store_url: str, rec: Path, reply: str,
                               ports: Mapping[int, int]) -> None:
        from .agent_host import HostProcesses

        self._procs = HostProcesses.start(ports, self.agent_processes, self.workdir,
                                          netns_tag=self.network, store_url=store_url,
                                          record_dir=rec, pulsar_url=self.pulsar_url,
                                          controller=reply, security=self.security,
                                          pack_period_s=0.5, report_after_s=5.0)

    def _wait_agents(self, timeout_s: float = 300.0) -> None:
        if self._procs is not None:
            self._procs.wait_ready(timeout_s)

    def _instrument(self) -> None:
        """Time the phases of ``set_channels`` (wrappers around the controller's own
        methods, on this instance only: the switch itself is unchanged)."""
        ctl, ph = self.ctl, self._phases

        def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def run(*a: Any, **kw: Any) -> Any:
                if threading.get_ident() != ph.thread:
                    return fn(*a, **kw)
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    setattr(ph, name, getattr(ph, name) + time.perf_counter() - t0)
            return run

        subscribe_infos = ctl._send_subscribe_infos

        def infos(pairs: list, ts: int, subscribe: bool) -> None:
            t0 = time.perf_counter()
            try:
                subscribe_infos(pairs, ts, subscribe)
            finally:
                dt = time.perf_counter() - t0
                if subscribe:
                    ph.subscribe_s += dt
                    ph.subscribe_n += len(pairs)
                else:
                    ph.unsubscribe_s += dt
                    ph.unsubscribe_n += len(pairs)

        ctl._send_subscribe_infos = infos
        ctl._flush_locked = timed("flush_s", ctl._flush_locked)
        ctl.store.write_mapping = timed("store_s", ctl.store.write_mapping)
        ctl.store.apply_changes = timed("store_s", ctl.store.apply_changes)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.stream is not None and self.stream.is_alive():
                self.stream.stop()
        try:
            if self._host is not None:
                self._host.close()
            if self._procs is not None:
                self._procs.stop()
        finally:
            if self.ctl is not None:
                self.ctl.close()

    def __enter__(self) -> SwitchBench:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # measuring
    def _topics_now(self) -> dict[int, set[int]]:
        with self.ctl._lock:
            return {n: set(ts) for n, ts in self.ctl.node_topics.items()}

    def switch(self, point: SwitchPoint, direction: str, rep: int,
               channels: Mapping[int, int], hosts: Mapping[int, Sequence[int]]) -> dict:
        """One measured switch: ``set_channels(channels)`` while the stream runs, then wait
        for the drains and ``settle_s``. Returns the sample (delays are filled in by
        :meth:`finish`)."""
        from .controller import topic_name

        before = self._topics_now()
        ph = self._phases
        for f in ph.__dataclass_fields__:
            setattr(ph, f, type(getattr(ph, f))())
        ph.thread = threading.get_ident()
        fences0 = self.ctl.stats.fences
        t0 = time.time_ns()
        p0 = time.perf_counter()
        res = self.ctl.set_channels(dict(channels), {t: tuple(h) for t, h in hosts.items()})
        block = time.perf_counter() - p0
        t1 = time.time_ns()
        after = self._topics_now()
        pre = self.ctl.cfg.topic_prefix
        left = {(n, topic_name(pre, c)) for n, ts in before.items()
                for c in ts - after.get(n, set())}
        drain = 0.0
        end = time.monotonic() + self.drain_timeout_s
        while left:
            self.watch.poll()
            done = {x for x in left if self.watch.deleted.get(x, 0) >= t1}
            if done == left:
                drain = (max(self.watch.deleted[x] for x in left) - t1) / 1e9
                break
            if time.monotonic() > end:
                drain = float("nan")
                self.say(f"    {point.name} {direction}: {len(left - done)} of {len(left)} "
                         f"drains not done after {self.drain_timeout_s:.0f} s")
                break
            time.sleep(0.02)
        rest = self.settle_s - (time.time_ns() - t1) / 1e9
        if rest > 0:
            time.sleep(rest)
        other = block - ph.store_s - ph.subscribe_s - ph.flush_s - ph.unsubscribe_s
        sample = {"point": point.name, "direction": direction, "rep": rep,
                  "types": int(res["types"]), "dests": point.dests, "shared": point.shared,
                  "subscribe": int(res["subscribe"]), "unsubscribe": int(res["unsubscribe"]),
                  "subscribe_infos": int(res["subscribe"]) + int(res["unsubscribe"]),
                  "deferred": int(res.get("deferred", 0)),
                  "fences": self.ctl.stats.fences - fences0, "block_s": block,
                  "store_s": ph.store_s, "subscribe_s": ph.subscribe_s, "flush_s": ph.flush_s,
                  "unsubscribe_s": ph.unsubscribe_s, "other_s": max(other, 0.0),
                  "drain_s": drain}
        self.samples.append(sample)
        self._windows.append({"t0": t0, "t1": t1})
        self.say(f"    {point.name:>16} {direction:8} r{rep}: {sample['subscribe_infos']:4d} "
                 f"SubscribeInfos, {sample['types']:3d} types: blocked {1e3 * block:7.1f} ms "
                 f"(subscribe {1e3 * ph.subscribe_s:.1f}, unsubscribe "
                 f"{1e3 * ph.unsubscribe_s:.1f}, flush {1e3 * ph.flush_s:.1f}); drain "
                 f"{1e3 * drain:.0f} ms")
        return sample

    def run_point(self, point: SwitchPoint, reps: int) -> list[dict]:
        """The point's types (declared on RPC, carrying traffic) switched RPC -> topics A,
        A -> topics B, B -> RPC, ``reps`` times; ``types = 0`` is the control (the stream
        alone, the same waits, no switch)."""
        assert self.stream is not None
        base = 10_000 * next(self._points)
        hs = point.hosts(self.nodes)
        types = [base + i for i in range(point.types)]
        hosts = dict(zip(types, hs))
        if types:
            self.ctl.set_channels(dict.fromkeys(types, RPC), hosts)
        self.stream.switched = list(hosts.items())
        time.sleep(self.pre_s)
        out = []
        a, b = point.topics(False), point.topics(True)
        plan = [("rpc->mq", dict(zip(types, a))), ("mq->mq", dict(zip(types, b))),
                ("mq->rpc", dict.fromkeys(types, RPC))]
        for rep in range(reps):
            for direction, chans in plan:
                out.append(self.switch(point, direction if types else "none", rep, chans,
                                       hosts))
                time.sleep(self.pre_s)
        self.stream.switched = []
        return out

    def finish(self, wait_s: float = 30.0) -> list[dict]:
        """Stop the stream, wait until the records stop growing, and fill in every
        sample's delays; returns the samples."""
        assert self.stream is not None
        self.stream.stop()
        self.ctl.flush()
        last, stable = -1, time.monotonic()
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            self.watch.poll()
            if self.watch.applied_rows != last:
                last, stable = self.watch.applied_rows, time.monotonic()
            elif time.monotonic() - stable > 2.0:
                break
            time.sleep(0.2)
        due = self.stream.due
        for s, w in zip(self.samples, self._windows):
            s.update(_delays(due, self.watch.applied, w["t0"], w["t1"], self.pre_s,
                             self.settle_s))
            sent = [v[1] - v[0] for v in due.values() if w["t0"] <= v[0] <= w["t1"]]
            s["sender_lag_s"] = max(sent, default=0) / 1e9
        return self.samples


def _delays(due: Mapping[int, tuple[int, int, int]], applied: Mapping[int, int], t0: int,
            t1: int, pre_s: float, settle_s: float) -> dict[str, Any]:
    """Delivery delays (due -> applied at its last destination) of the messages due in the
    ``pre_s`` before the switch and of those due from its start until ``settle_s`` after it
    returned."""
    before: list[float] = []
    during: list[float] = []
    missing = 0
    lo, hi = t0 - round(pre_s * 1e9), t1 + round(settle_s * 1e9)
    for mid, (d, _, _) in due.items():
        if not lo <= d < hi:
            continue
        ap = applied.get(mid)
        if ap is None:
            missing += 1
            continue
        (before if d < t0 else during).append((ap - d) / 1e9)
    added = (statistics.fmean(during) - statistics.fmean(before)) if during and before \
        else 0.0
    return {"delay_p50_before_s": _pct(before, 0.5), "delay_p95_before_s": _pct(before, 0.95),
            "delay_p95_during_s": _pct(during, 0.95),
            "delay_max_during_s": max(during) if during else None,
            "added_delay_mean_s": added, "added_delay_total_s": added * len(during),
            "messages_during": len(during), "missing": missing}


def _pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# ---------------------------------------------------------------------------- fitting
def least_squares(rows: Sequence[Mapping[str, Any]], y: str,
                  x: Sequence[str] = ("subscribe_infos", "types")) -> dict[str, Any]:
    """``y = c0 + sum_j beta_j x_j`` by least squares over ``rows`` (NaN rows skipped):
    coefficients, their standard errors, and the residuals' spread (sd, median absolute,
    max absolute) and R^2."""
    import numpy as np

    pts = [(r, float(r[y])) for r in rows
           if r.get(y) is not None and math.isfinite(float(r[y]))]
    if len(pts) < len(x) + 2:
        raise CostsError(f"fit of {y}: {len(pts)} points, need at least {len(x) + 2}")
    a = np.array([[1.0, *(float(r[k]) for k in x)] for r, _ in pts])
    b = np.array([v for _, v in pts])
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    res = b - a @ coef
    dof = max(len(b) - a.shape[1], 1)
    s2 = float(res @ res) / dof
    cov = s2 * np.linalg.pinv(a.T @ a)
    tot = float(((b - b.mean()) ** 2).sum())
    return {"y": y, "x": list(x), "intercept_s": float(coef[0]),
            "coef": {k: float(c) for k, c in zip(x, coef[1:])},
            "stderr": {k: float(math.sqrt(max(cov[i + 1, i + 1], 0.0)))
                       for i, k in enumerate(x)},
            "intercept_stderr": float(math.sqrt(max(cov[0, 0], 0.0))),
            "points": len(b), "residual_sd_s": float(math.sqrt(s2)),
            "residual_median_abs_s": float(np.median(np.abs(res))),
            "residual_max_abs_s": float(np.abs(res).max()),
            "r2": 1.0 - float(res @ res) / tot if tot > 0 else 1.0}


def medians(samples: Iterable[Mapping[str, Any]], keys: Sequence[str] = (
        "block_s", "drain_s", "added_delay_mean_s", "added_delay_total_s", "sender_lag_s",
        "subscribe_s", "unsubscribe_s", "flush_s", "store_s", "other_s", "delay_p95_during_s",
        "delay_p95_before_s")) -> list[dict[str, Any]]:
    """One row per (point, direction): the counts, and each of ``keys``' median, min and max
    over the repetitions."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for s in samples:
        if _valid(s):
            groups[(s["point"], s["direction"])].append(s)
    out = []
    for (p, d), ss in groups.items():
        row: dict[str, Any] = {"point": p, "direction": d, "reps": len(ss)}
        for k in ("types", "dests", "shared", "subscribe", "unsubscribe", "subscribe_infos",
                  "fences"):
            row[k] = ss[0][k]
        for k in keys:
            v = [float(s[k]) for s in ss if s.get(k) is not None
                 and math.isfinite(float(s[k]))]
            row[k] = statistics.median(v) if v else None
            row[k + "_min"] = min(v) if v else None
            row[k + "_max"] = max(v) if v else None
        out.append(row)
    return out


def _valid(s: Mapping[str, Any]) -> bool:
    """False for a switch the controller deferred (the MQ channel was down: failover),
    which measured nothing."""
    return not s.get("deferred") and (s["direction"] == "none" or s["types"] > 0)


def fit_costs(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The fits of the medians (per point and direction, controls excluded): the sending
    path's block, the drains, and the added delay per message due around a switch; also the
    block per direction."""
    rows = [r for r in medians(samples) if r["direction"] != "none"]
    fits: dict[str, Any] = {"block": least_squares(rows, "block_s"), "drain": least_squares(
        [r for r in rows if r["unsubscribe"]], "drain_s", ("unsubscribe", "types")),
        "added_delay": least_squares(rows, "added_delay_mean_s"),
        # subscribing and unsubscribing SubscribeInfos apart (the first wait for a durable
        # subscription created on the broker, the second only for the agent's answer)
        "block_split": least_squares(rows, "block_s", ("subscribe", "unsubscribe", "types"))}
    by_dir = {}
    for d in DIRECTIONS:
        sub = [r for r in rows if r["direction"] == d]
        with contextlib.suppress(CostsError):
            by_dir[d] = least_squares(sub, "block_s")
    fits["block_by_direction"] = by_dir
    fits["excluded_deferred"] = sum(not _valid(s) for s in samples)
    ctl = [s for s in samples if s["direction"] == "none"]
    if ctl:
        fits["control"] = {k: statistics.median(float(s[k]) for s in ctl)
                           for k in ("block_s", "added_delay_mean_s", "sender_lag_s")}
    return fits


# ---------------------------------------------------------------------------- the document
def costs_document(fits: Mapping[str, Any], network: str, machine: Mapping[str, Any] | str,
                   command: str, *, setup: Mapping[str, Any] | None = None,
                   comparison: Mapping[str, Any] | None = None,
                   points: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The switching-cost document: the block fit's seconds per SubscribeInfo and per moved
    type (clipped at 0; the raw fit is under ``fit``), how and where it was measured."""
    blk = fits["block"]
    doc = {"seconds_per_subscribe_info": max(blk["coef"]["subscribe_infos"], 0.0),
           "seconds_per_moved_type": max(blk["coef"]["types"], 0.0),
           "fit": dict(fits), "network": network, "machine": machine,
           "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
           "command": command, "setup": dict(setup or {}), "points": list(points)}
    if comparison:
        doc["comparison"] = dict(comparison)
    check_costs(doc)
    return doc


def check_costs(doc: Any, where: str = "switching costs") -> dict[str, Any]:
    """Check a switching-cost document's schema; returns it. A :class:`CostsError` names
    the key that is missing or wrong."""
    if not isinstance(doc, Mapping):
        raise CostsError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    missing = [k for k in SCHEMA_KEYS if k not in doc]
    if missing:
        raise CostsError(f"{where}: missing key(s) {missing}")
    for k in ("seconds_per_subscribe_info", "seconds_per_moved_type"):
        v = doc[k]
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                or v < 0:
            raise CostsError(f"{where}: {k} must be a finite number >= 0 (seconds), got {v!r}")
    if doc["network"] not in ("emulated", "loopback"):
        raise CostsError(f"{where}: network must be 'emulated' or 'loopback', got "
                         f"{doc['network']!r}")
    if not isinstance(doc["fit"], Mapping) or "block" not in doc["fit"]:
        raise CostsError(f"{where}: fit must be an object with the 'block' fit")
    blk = doc["fit"]["block"]
    for k in ("coef", "residual_sd_s", "points"):
        if not isinstance(blk, Mapping) or k not in blk:
            raise CostsError(f"{where}: fit.block: missing key {k!r}")
    for k in ("date", "command"):
        if not isinstance(doc[k], str) or not doc[k]:
            raise CostsError(f"{where}: {k} must be a non-empty string, got {doc[k]!r}")
    return dict(doc)


def load_costs(path: str | Path) -> dict[str, Any]:
    """Read and check a switching-cost document (:func:`check_costs`)."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except OSError as e:
        raise CostsError(f"switching costs {p}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise CostsError(f"switching costs {p}: not JSON: {e}") from None
    return check_costs(doc, str(p))


def online_weights(doc: Mapping[str, Any], interval_s: float) -> dict[str, float]:
    """The online cost's switching weights (:class:`envs.dsmd.online.OnlineCost`) implied by
    a switching-cost document for intervals of ``interval_s``: a switch that holds the
    sending path for ``tau`` seconds delays the interval's delivery by ``tau / T`` of the
    interval, priced as that fraction more node traffic (the redundancy ratio's unit):
    ``w_subscribe = seconds_per_subscribe_info / T``, ``w_move = seconds_per_moved_type / T``."""
    if not (isinstance(interval_s, int | float) and interval_s > 0):
        raise CostsError(f"interval_s must be positive seconds, got {interval_s!r}")
    check_costs(doc)
    return {"w_subscribe": float(doc["seconds_per_subscribe_info"]) / interval_s,
            "w_move": float(doc["seconds_per_moved_type"]) / interval_s}


# ---------------------------------------------------------------------------- one network
def machine_facts() -> dict[str, Any]:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpu_model": cpu, "cpu_count": os.cpu_count(), "uname": " ".join(platform.uname()),
            "python": platform.python_version(), "loadavg": [round(x, 2)
                                                             for x in os.getloadavg()]}


def run_spec(spec: Mapping[str, Any], say: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure every point of ``spec`` on one broker (started here: in the emulated network's
    broker namespace when ``spec['network']`` names one). Returns the samples."""
    from envs.netutil import BROKER_ADDRESS
    from harness.broker import PulsarStandalone
    from security.tls import Security

    sec = Security.from_mapping(spec.get("security"))
    tag = spec.get("network")
    where: dict[str, Any] = {"host": BROKER_ADDRESS, "netns": f"{tag}-brk"} if tag else {}
    workdir = Path(spec["workdir"])
    load = LoadSpec(**spec.get("load", {}))
    points = [SwitchPoint(**p) for p in spec["points"]]
    t0 = time.perf_counter()
    with PulsarStandalone(heap=str(spec.get("heap", "512m")), security=sec, progress=None,
                          **where) as broker:
        say(f"broker {broker.service_url} ready in {time.perf_counter() - t0:.0f} s")
        bench = SwitchBench(broker.service_url, broker.admin_url, spec["nodes"], workdir,
                            security=sec, network=tag, load=load,
                            agent_processes=int(spec.get("agent_processes", 1)),
                            controller=spec.get("controller"), say=say,
                            pre_s=float(spec.get("pre_s", 1.5)),
                            settle_s=float(spec.get("settle_s", 2.0)))
        try:
            bench.start()
            say(f"{len(spec['nodes'])} agents and the controller ready "
                f"({time.perf_counter() - t0:.0f} s); stream {load.background_rate:g} + "
                f"{load.switched_rate:g} msg/s")
            warm = spec.get("warmup")
            if warm:  # topics and producers exist before the measured switches
                wp = SwitchPoint(**warm)
                bench.run_point(wp, 1)
                bench.samples.clear()
                bench._windows.clear()
            for p in points:
                bench.run_point(p, int(spec.get("reps", 3)))
            samples = bench.finish()
            stats = bench.ctl.stats.as_dict()
        finally:
            bench.close()
    return {"samples": samples, "controller": stats, "wall_s": time.perf_counter() - t0}


def measure(network: str, nodes: Sequence[int], workdir: Path, *, points: Sequence[SwitchPoint],
            reps: int = 3, load: LoadSpec = LoadSpec(), security: Any = None,
            controller_bps: float | None = None, node_bps: float | None = None,
            max_inflight_sends: int = 0, agent_processes: int = 1,
            say: Callable[[str], None] = print, timeout_s: float = 1500.0) -> dict[str, Any]:
    """Measure on the emulated network (``network='emulated'``: namespaces, C_b and s(n)
    shaped, this measurement in the controller's namespace) or on loopback; returns the
    samples (:func:`run_spec`)."""
    from security.tls import Security

    if network not in ("emulated", "loopback"):
        raise CostsError(f"network must be 'emulated' or 'loopback', got {network!r}")
    sec = Security.from_mapping(security)
    workdir.mkdir(parents=True, exist_ok=True)
    ctl: dict[str, Any] = {}
    if max_inflight_sends:
        ctl["max_inflight_sends"] = int(max_inflight_sends)
    spec: dict[str, Any] = {
        "nodes": [int(n) for n in nodes], "workdir": str(workdir), "reps": reps,
        "load": asdict(load), "points": [asdict(p) for p in points],
        "security": {"insecure": sec.insecure, "pki_dir": None if sec.pki_dir is None
                     else str(sec.pki_dir)},
        "agent_processes": agent_processes, "controller": ctl,
        "warmup": asdict(SwitchPoint("warmup", max(p.types for p in points), 1))}
    out = workdir / "samples.json"
    cmd = [sys.executable, "-m", "delivery.switch_cost", "run", "--spec",
           str(workdir / "spec.json"), "--out", str(out)]
    if network == "loopback":
        (workdir / "spec.json").write_text(json.dumps(spec))
        subprocess.run(cmd, cwd=ROOT, check=True, timeout=timeout_s)
        res: dict[str, Any] = json.loads(out.read_text())
        return res
    from .netem import EmulatedNetwork, NetworkSpec

    if not sec.insecure:  # certificates naming the emulated addresses (dev PKI)
        sec.pki.refresh_addresses(["controller", "broker",
                                   *(f"agent-{n}" for n in nodes)])
    nspec = NetworkSpec(list(nodes), controller_bps=controller_bps, node_bps=node_bps)
    with EmulatedNetwork(nspec) as net:
        spec["network"] = net.tag
        spec["controller"].setdefault("push_timeout_s", 30.0)
        (workdir / "spec.json").write_text(json.dumps(spec))
        say(f"emulated network {net.tag}: {len(nodes)} node namespaces; C_b "
            f"{_mbit(controller_bps)}, s(n) {_mbit(node_bps)}")
        subprocess.run([*net.exec_prefix(net.controller), *cmd], cwd=ROOT, check=True,
                       timeout=timeout_s)
    res = json.loads(out.read_text())
    return res


def _mbit(r: float | None) -> str:
    return "unshaped" if r is None else f"{r / 1e6:.3g} Mbit/s"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m delivery.switch_cost",
                                 description="measure what channel switches cost")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure the points of a spec (one network)")
    r.add_argument("--spec", required=True)
    r.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    spec = json.loads(Path(args.spec).read_text())
    res = run_spec(spec, say=lambda s: print(s, flush=True))
    Path(args.out).write_text(json.dumps(res, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
