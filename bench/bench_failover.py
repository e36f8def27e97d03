"""Channel failover under a broker SIGKILL: detection, time-to-reroute, delivery delays by
phase and failback, with failover enabled vs disabled.

Scenario (each run): a Pulsar standalone broker of its own, the real controller
(``delivery.controller``) and 8 message agents in process (``delivery.agent_host``, real gRPC
endpoints and Pulsar consumers, each writing its programming record). Type 0 goes over RPC to
nodes 0-3, type 1 on topic 1 to nodes 0-5, type 2 on topic 2 to nodes 4-7; a sender thread
sends ``RATE`` messages/s round-robin over the three types (10 resources per type), each
followed by a non-waiting flush. After ``WARM_S`` the broker JVM is SIGKILLed; ``OUTAGE_S``
later ``PulsarStandalone.start()`` restarts it (same ports and data; the JVM's own start time
is measured and reported); ``AFTER_S`` after it serves (with failover, and at least 3 s
after the failback) the sender stops, and the run waits until every node's record holds the
newest message of each of its resources.

Measured from the agents' records (``delivery.agent.read_record``: one row per applied
message with its generation ``timestamp_ns``, the channel it came by and ``applied_ns``):

* detection: kill -> the controller's MQ health is down (``Controller.health()["since_ns"]``);
* reroute: kill -> the first row of an MQ type (1, 2) applied over ``rpc``;
* delay ``applied_ns - timestamp_ns`` of the MQ types' rows, p50/p95/p99/max, per phase of
  the generation time: before the kill, outage (kill to the broker serving again), after;
* failback: the broker serving again -> the controller's ``failback`` health event; and
  -> the first MQ-type row applied from a topic again;
* duplicates (a node applied a message twice), out of order (a resource's applied timestamps
  not increasing), lost (a message neither applied nor superseded by a newer applied one).

With failover disabled (``failover={"enabled": False}``) the MQ types' messages wait for the
broker. Controller capacities: C_b 100 Mbit/s and C_p 10 000 concurrent sends (both types
fit).

Not pinned to a core (broker JVM, controller and agents share the machine); the load
average is recorded in the result.

Usage: ``python bench/bench_failover.py [--quick] [--runs N] [--modes enabled,disabled]``
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import finish, fmt_stats, log, md_table, stats

RATE = 50.0          # messages/s, all types
WARM_S = 10.0
OUTAGE_S = 30.0      # kill -> start() called
AFTER_S = 20.0       # broker serving again -> sender stops
RUNS = 3
NODES = tuple(range(8))
HOSTS = {0: (0, 1, 2, 3), 1: (0, 1, 2, 3, 4, 5), 2: (4, 5, 6, 7)}
CHANNELS = {0: 0, 1: 1, 2: 2}    # 0 = RPC, t = topic t
MQ_TYPES = (1, 2)
SIZE = 200
CAPACITY = {"controller_bw_bps": 100e6, "controller_cpu": 10_000.0}


def _pct(xs: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of sorted ``xs``, None if empty."""
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _dist(xs: list[float]) -> dict[str, Any]:
    xs = sorted(xs)
    return {"n": len(xs), "p50": _pct(xs, 0.5), "p95": _pct(xs, 0.95), "p99": _pct(xs, 0.99),
            "max": xs[-1] if xs else None}


class Ledger:
    """What the sender asked the controller to deliver: (node, resource) -> [(ts, id)]."""

    def __init__(self) -> None:
        self.sent: dict[tuple[int, tuple], list[tuple[int, int]]] = defaultdict(list)
        self.lock = threading.Lock()


def _audit(record_dir: Path, ledger: Ledger) -> dict[str, Any]:
    """Rows per node and the delivery verdict from the agents' records."""
    from delivery.agent import read_record

    rows = {n: read_record(record_dir / f"node-{n}.record")[0] for n in NODES}
    with ledger.lock:
        sent = {k: list(v) for k, v in ledger.sent.items()}
    dups = ooo = lost = superseded = behind = 0
    for n, rs in rows.items():
        seen: set[int] = set()
        last: dict[tuple, int] = {}
        for r in rs:
            if r.message_id in seen:
                dups += 1
            seen.add(r.message_id)
            if r.timestamp_ns <= last.get(r.resource, -1):
                ooo += 1
            last[r.resource] = max(last.get(r.resource, -1), r.timestamp_ns)
        applied = {(r.timestamp_ns, r.message_id) for r in rs}
        for (node, res), msgs in sent.items():
            if node != n:
                continue
            newest = last.get(res, -1)
            if max(msgs)[0] != newest:
                behind += 1
            for m in msgs:
                if m in applied:
                    continue
                if m[0] < newest:
                    superseded += 1
                else:
                    lost += 1
    return {"rows": rows, "duplicates": dups, "out_of_order": ooo, "not_applied": lost,
            "superseded": superseded, "resources_behind": behind,
            "sent": sum(len(v) for v in sent.values())}


def start_delivery(service_url: str, admin_url: str, tmp: Path, failover: dict[str, Any]
                   ) -> tuple[Any, Any, Path, str]:
    """The real controller (its store in ``tmp``, a fresh topic prefix) and the agents of
    ``NODES`` in process on the broker or cluster at ``service_url``: ``(controller, agent
    host, record directory, topic prefix)``."""
    from delivery.agent import AgentConfig
    from delivery.agent_host import AgentHost
    from delivery.controller import Controller, ControllerConfig
    from envs.netutil import free_ports

    store_url = f"sqlite:///{tmp / 'meta.db'}"
    record_dir = tmp / "records"
    prefix = f"persistent://public/default/bf-{uuid.uuid4().hex[:8]}"
    ports = dict(zip(NODES, free_ports(len(NODES))))
    ctl = Controller(ControllerConfig(service_url, store_url, topic_prefix=prefix,
                                      collect_period_s=0.3, reprogram_period_s=0.2,
                                      failover=failover, pulsar_admin_url=admin_url),
                     {n: f"127.0.0.1:{p}" for n, p in ports.items()}).start()
    try:
        host = AgentHost([AgentConfig(n, store_url, record_dir, pulsar_url=service_url,
                                      controller=ctl.reply_address, port=p, pack_period_s=0.1)
                          for n, p in ports.items()], service_url).start()
    except BaseException:
        ctl.close()
        raise
    return ctl, host, record_dir, prefix


def set_channels(ctl: Any, host: Any, channels: dict[int, int],
                 hosts: dict[int, tuple[int, ...]], timeout: float = 90.0) -> None:
    """Apply ``channels`` and wait until every agent is subscribed to its topics."""
    ctl.set_channels(channels, hosts)
    want = {n: sum(1 for t, c in channels.items() if c and n in hosts[t]) for n in NODES}
    deadline = time.monotonic() + timeout
    while any(len(host.agents[n].topics()) != want[n] for n in NODES):
        if time.monotonic() > deadline:
            raise RuntimeError(f"agents did not subscribe within {timeout:.0f} s")
        time.sleep(0.05)


def sender(ctl: Any, ledger: Ledger, stop: threading.Event, errors: list[BaseException],
           hosts: dict[int, tuple[int, ...]], resources: int, rate: float) -> None:
    """Send ``rate`` messages/s round-robin over the types of ``hosts`` (``resources`` per
    type, type ``t`` as VPC ``t + 1``), each followed by a non-waiting flush, until
    ``stop``; every message in ``ledger``; an error ends it and is kept in ``errors``."""
    from envs.dsmd.message import Message

    ids = itertools.count(1)
    t0, k = time.monotonic(), 0
    try:
        while not stop.is_set():
            t = k % len(hosts)
            mid = next(ids)
            m = Message(mid, mid, t + 1, "SUBNET", "UPDATE", (k // len(hosts)) % resources,
                        SIZE, hosts[t], ctl.timestamp())
            with ledger.lock:
                for n in hosts[t]:
                    ledger.sent[(n, (t + 1, "SUBNET", m.resource_id))].append(
                        (m.timestamp_ns, mid))
            ctl.send(m, t)
            ctl.flush(wait=False)
            k += 1
            time.sleep(max(0.0, t0 + k / rate - time.monotonic()))
    except BaseException as e:  # reported, and the run fails
        errors.append(e)


def drain(ctl: Any, record_dir: Path, ledger: Ledger, res: dict[str, Any],
          timeout: float = 180.0) -> dict[str, Any]:
    """Once the sender stopped: flush until every node's record holds the newest message of
    each of its resources (or ``timeout``); the last audit, with ``res["drained_s"]`` and
    ``res["complete"]`` set."""
    t0, deadline = time.monotonic(), time.monotonic() + timeout
    while True:
        ctl.flush(wait=False)
        a = _audit(record_dir, ledger)
        done = a["not_applied"] == 0 and a["resources_behind"] == 0
        if done or time.monotonic() > deadline:
            res["drained_s"], res["complete"] = time.monotonic() - t0, done
            return a
        time.sleep(0.5)


def one_run(mode: str, run: int, work: Path) -> dict[str, Any]:
    from harness.broker import PulsarStandalone

    tmp = work / f"{mode}-{run}"
    tmp.mkdir(parents=True)
    failover = {"enabled": mode == "enabled", **CAPACITY}
    res: dict[str, Any] = {"mode": mode, "run": run}
    with PulsarStandalone(progress=None, work_dir=tmp / "broker") as broker:
        ctl, host, record_dir, _ = start_delivery(broker.service_url, broker.admin_url, tmp,
                                                  failover)
        ledger = Ledger()
        stop = threading.Event()
        errors: list[BaseException] = []
        try:
            set_channels(ctl, host, CHANNELS, HOSTS, timeout=60)

            down_ns: list[int] = []

            def watch() -> None:
                while not stop.is_set():
                    h = ctl.health()
                    if h["mq"] == "down" and not down_ns:
                        down_ns.append(int(h["since_ns"]))
                    time.sleep(0.02)

            send = threading.Thread(target=sender, daemon=True,
                                    args=(ctl, ledger, stop, errors, HOSTS, 10, RATE))
            threads = [send, threading.Thread(target=watch, daemon=True)]
            for th in threads:
                th.start()
            time.sleep(WARM_S)
            pid = broker.pid
            assert pid is not None
            kill_ns = time.time_ns()
            os.kill(pid, signal.SIGKILL)
            broker.wait(30)
            log(f"  [{mode} {run}] broker killed")
            time.sleep(max(0.0, OUTAGE_S - (time.time_ns() - kill_ns) / 1e9))
            t_start = time.monotonic()
            broker.start()
            up_ns = time.time_ns()
            res["broker_restart_s"] = time.monotonic() - t_start
            log(f"  [{mode} {run}] broker serving again after {res['broker_restart_s']:.1f} s")
            time.sleep(AFTER_S)
            if mode == "enabled":  # run on until the types are back on their topics
                deadline = time.monotonic() + 90
                while not ctl.stats.failbacks and time.monotonic() < deadline:
                    time.sleep(0.1)
                time.sleep(3.0)
            stop.set()
            for th in threads:
                th.join(30)
            if errors:
                raise RuntimeError(f"sender failed: {errors[0]!r}") from errors[0]
            end_ns = time.time_ns()
            a = drain(ctl, record_dir, ledger, res)
            stats_ = ctl.stats.as_dict()
            events = list(ctl.stats.health_events)
        finally:
            stop.set()
            host.close()
            ctl.close()
    rows = [r for rs in a["rows"].values() for r in rs]
    mq_rows = [r for r in rows if r.vpc_id - 1 in MQ_TYPES]
    phases = {"before": (0, kill_ns), "outage": (kill_ns, up_ns), "after": (up_ns, end_ns)}
    res["delay_s"] = {p: _dist([(r.applied_ns - r.timestamp_ns) / 1e9 for r in mq_rows
                                if lo <= r.timestamp_ns < hi])
                       for p, (lo, hi) in phases.items()}
    res["delay_rpc_type_s"] = _dist([(r.applied_ns - r.timestamp_ns) / 1e9 for r in rows
                                     if r.vpc_id == 1])
    outage = [r for r in mq_rows if kill_ns <= r.timestamp_ns < up_ns]
    res["outage_rows_by_channel"] = {c: sum(1 for r in outage if (r.channel == "rpc") == (
        c == "rpc")) for c in ("rpc", "topic")}
    rerouted = [r.applied_ns for r in mq_rows if r.channel == "rpc" and r.applied_ns >= kill_ns]
    res["reroute_s"] = (min(rerouted) - kill_ns) / 1e9 if rerouted else None
    res["detection_s"] = (down_ns[0] - kill_ns) / 1e9 if down_ns else None
    fb = [ns for ns, ev, _ in events if ev == "failback" and ns >= up_ns]
    res["failback_s"] = (fb[0] - up_ns) / 1e9 if fb else None
    again = [r.applied_ns for r in mq_rows if r.channel != "rpc" and r.applied_ns >= up_ns]
    res["mq_again_s"] = (min(again) - up_ns) / 1e9 if again else None
    res.update({k: a[k] for k in ("duplicates", "out_of_order", "not_applied", "superseded",
                                  "resources_behind", "sent")})
    res["applied_rows"] = len(rows)
    res["controller"] = {k: stats_[k] for k in (
        "failovers", "failbacks", "rerouted", "held", "republished", "mq_rescued",
        "reprogrammed", "rpc_messages", "mq_messages", "outcomes")}
    res["events"] = [(round((ns - kill_ns) / 1e9, 3), ev, why) for ns, ev, why in events]
    return res


def _cell(runs: list[dict], get, fmt: str = "{:.2f}") -> str:
    vals = [v for v in (get(r) for r in runs) if v is not None]
    if not vals:
        return "-"
    return fmt_stats(stats(vals), fmt)


def summarize(results: dict[str, list[dict]], failed: list[dict[str, Any]], runs_per_mode: int,
              outage_s: float) -> tuple[str, list[str]]:
    """The result table (median (min-max) over the runs of each mode) and its notes."""
    rows = []
    for mode, runs in results.items():
        rows.append([
            mode,
            _cell(runs, lambda r: r["detection_s"]),
            _cell(runs, lambda r: r["reroute_s"]),
            _cell(runs, lambda r: r["delay_s"]["before"]["p99"], "{:.3f}"),
            " / ".join(_cell(runs, lambda r, q=q: r["delay_s"]["outage"][q], "{:.2f}")
                       for q in ("p50", "p95", "p99", "max")),
            _cell(runs, lambda r: r["delay_s"]["after"]["p99"]),
            _cell(runs, lambda r: r["broker_restart_s"], "{:.1f}"),
            _cell(runs, lambda r: r["failback_s"]),
            _cell(runs, lambda r: r["mq_again_s"]),
            " / ".join(str(sum(r[k] for r in runs))
                       for k in ("duplicates", "out_of_order", "not_applied", "superseded")),
        ])
    table = md_table(["failover", "detection s", "reroute s", "before p99 s",
                      "outage p50 / p95 / p99 / max s", "after p99 s", "JVM restart s",
                      "failback s", "MQ again s", "dup / ooo / lost / superseded"], rows)
    notes = [
        f"median (min-max) over {runs_per_mode} run(s) per mode; delays of the MQ types' (1, "
        "2) rows in the agents' records, applied_ns - timestamp_ns, by the phase of the "
        "message's generation; outage = from the SIGKILL until the restarted broker serves",
        f"{RATE:.0f} msg/s over types 0 (RPC, 4 nodes), 1 (topic, 6 nodes), 2 (topic, "
        f"4 nodes); {SIZE} B each; 8 agents in process; outage = {outage_s:.0f} s + the "
        "JVM's restart (its own column)",
        "detection: kill -> MQ health down; reroute: kill -> first MQ-type row applied over "
        "RPC; failback: broker serving -> failback event; MQ again: broker serving -> first "
        "MQ-type row applied from a topic",
        "dup / ooo / lost / superseded, summed over runs: dup = a node applied a message "
        "twice, ooo = applied out of timestamp order, lost = neither applied nor superseded "
        "once the run drained, superseded = never applied because a newer message of the "
        "resource was applied first (the agent dropped the older one as OUT_OF_ORDER)",
        "not pinned; the broker JVM, the controller and the agents share the machine",
    ]
    for mode, runs in results.items():
        med = [r["delay_s"]["outage"]["n"] for r in runs]
        notes.append(f"{mode}: outage rows per run {med}, by channel "
                     f"{[r['outage_rows_by_channel'] for r in runs]}; all delivered: "
                     f"{[r['complete'] for r in runs]}; drained "
                     f"{[round(r['drained_s'], 1) for r in runs]} s after the sender stopped")
    if failed:
        notes.append(f"runs repeated after a failure: {[(f['mode'], f['run']) for f in failed]}"
                     f" ({failed[0]['error'][:120]})")
    return table, notes


def main() -> None:
    global WARM_S, OUTAGE_S, AFTER_S, RUNS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="1 run per mode, 5 s warm-up, 10 s outage, 10 s after")
    ap.add_argument("--runs", type=int, default=None, help=f"runs per mode (default {RUNS})")
    ap.add_argument("--modes", default="enabled,disabled",
                    help="comma-separated: enabled, disabled")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    if args.quick:
        WARM_S, OUTAGE_S, AFTER_S, RUNS = 5.0, 10.0, 10.0, 1
    if args.runs is not None:
        RUNS = args.runs
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("enabled", "disabled") for m in modes):
        ap.error(f"--modes: expected enabled and/or disabled, got {args.modes!r}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    t_all = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-failover-"))
    log(f"bench_failover: {RUNS} run(s) per mode {modes}; warm {WARM_S:.0f} s, outage "
        f"{OUTAGE_S:.0f} s + the JVM's restart, after {AFTER_S:.0f} s, {RATE:.0f} msg/s; "
        f"work dir {work}")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    failed: list[dict[str, Any]] = []
    try:
        for run in range(RUNS):
            for mode in modes:
                for attempt in range(3):
                    try:
                        r = one_run(mode, run, work / f"try{attempt}")
                        break
                    except Exception as e:  # e.g. another process took a port of the broker
                        # while it was down (PortInUseError at the restart): run it again
                        log(f"  [{mode} {run}] failed ({type(e).__name__}: {e}); again")
                        failed.append({"mode": mode, "run": run, "error": repr(e)[:500]})
                else:
                    raise RuntimeError(f"{mode} run {run} failed 3 times")
                results[mode].append(r)
                d = r["delay_s"]["outage"]
                log(f"  [{mode} {run}] detection {r['detection_s']}, reroute "
                    f"{r['reroute_s']}, failback {r['failback_s']}, outage delay p99 "
                    f"{d['p99']} max {d['max']} (n={d['n']}); dup {r['duplicates']} ooo "
                    f"{r['out_of_order']} lost {r['not_applied']}; complete {r['complete']}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    table, notes = summarize(results, failed, RUNS, OUTAGE_S)
    total = time.perf_counter() - t_all
    finish("bench_failover", {
        "settings": {"rate": RATE, "warm_s": WARM_S, "outage_s": OUTAGE_S, "after_s": AFTER_S,
                     "runs": RUNS, "modes": modes, "hosts": HOSTS, "channels": CHANNELS,
                     "size": SIZE, "capacity": CAPACITY, "quick": args.quick},
        "runs": results, "failed_attempts": failed,
        "summary": {m: {"outage_p99_median": statistics.median(
            [r["delay_s"]["outage"]["p99"] for r in runs
             if r["delay_s"]["outage"]["p99"] is not None] or [float("nan")])}
            for m, runs in results.items()},
        "total_s": total}, table, notes, total)


if __name__ == "__main__":
    main()
