"""A Pulsar cluster's broker killed under load: how long the moved topics go without delivery,
the delays of their messages, and whether anything was lost, applied twice or out of order.

Scenario (each run): a real secure cluster of its own (``harness.pulsar_cluster``: one
ZooKeeper, two bookies with two copies of each message, two brokers, each a JVM), the real
controller (``delivery.controller``, its channel failover off so that only the cluster
carries the MQ types) and 8 message agents in process (``delivery.agent_host``). Type 0 goes
over RPC, types 1-6 on topics 1-6, each to 4-6 nodes; a sender thread sends ``RATE``
messages/s round-robin over the seven types (5 resources per type), each followed by a
non-waiting flush. After ``WARM_S`` the broker that owns the most of the six topics is
stopped, by mode:

* ``crash``: SIGKILL; its topics stay its own until its metadata-store session expires
  (``PulsarCluster.session_timeout_ms``), then the clients' lookups give them to the other
  broker;
* ``shutdown``: SIGTERM, a graceful stop: the broker unloads its topics before it exits.

The sender goes on for ``AFTER_S``, then the run waits until every node's record holds the
newest message of each of its resources. Measured from the agents' records
(``delivery.agent.read_record``):

* time without delivery: the longest interval, from the kill on, between two rows of one
  type applied on one node, the worst (node, moved type) pair's, and the same for the types
  on the surviving broker;
* moved: kill -> every moved topic's lookup answers the surviving broker;
* delay ``applied_ns - timestamp_ns`` of the moved types' rows generated after the kill;
* duplicates, out of order, lost (as ``bench_failover``).

Not pinned to a core: five JVMs, the controller and the agents share the machine. The
cluster's own start time is reported.

Usage: ``python bench/bench_pulsar_cluster.py [--quick] [--runs N] [--modes crash,shutdown]``
"""

from __future__ import annotations

import argparse
import itertools
import logging
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import finish, fmt_stats, log, md_table, stats
from bench_failover import (
    NODES,
    SIZE,
    Ledger,
    _dist,
    drain,
    sender,
    set_channels,
    start_delivery,
)

RATE = 50.0          # messages/s, all types
WARM_S = 8.0
AFTER_S = 25.0       # kill -> sender stops
RUNS = 3
TYPES = tuple(range(7))
HOSTS = {t: tuple(n for n in NODES if (n + t) % 4 != 0) if t % 2 else
         tuple(n for n in NODES if (n + t) % 2 == 0) for t in TYPES}
CHANNELS = {t: t for t in TYPES}    # 0 = RPC, t = topic t
SIGNALS = {"crash": signal.SIGKILL, "shutdown": signal.SIGTERM}


def _gap(rows_by_node: dict[int, list], types: set[int], since_ns: int) -> float | None:
    """The longest time a node went without an applied row of one of ``types`` from
    ``since_ns`` on: the worst (node, type) pair's (s). Each agent's consumer reconnects on
    its own, so one node may wait longer than another for the same type."""
    gaps = []
    for rows in rows_by_node.values():
        for t in types:
            ts = sorted(r.applied_ns for r in rows
                        if r.vpc_id - 1 == t and r.applied_ns >= since_ns)
            if ts:
                gaps.append(max(b - a for a, b in itertools.pairwise([since_ns, *ts])) / 1e9)
    return max(gaps) if gaps else None


def one_run(mode: str, run: int, work: Path) -> dict[str, Any]:
    from harness.pulsar_cluster import PulsarCluster

    tmp = work / f"{mode}-{run}"
    tmp.mkdir(parents=True)
    res: dict[str, Any] = {"mode": mode, "run": run}
    t0 = time.monotonic()
    with PulsarCluster(progress=None, work_dir=tmp / "cluster") as cluster:
        res["cluster_start_s"] = time.monotonic() - t0
        res["session_timeout_s"] = cluster.session_timeout_ms / 1000
        ctl, host, record_dir, prefix = start_delivery(cluster.service_url, cluster.admin_url,
                                                       tmp, {"enabled": False})
        ledger = Ledger()
        stop = threading.Event()
        errors: list[BaseException] = []
        try:
            set_channels(ctl, host, CHANNELS, HOSTS)
            topics = {t: f"{prefix}-t{t}" for t in TYPES if t}
            owners = {t: cluster.owner(tp) for t, tp in topics.items()}
            victim = max((0, 1), key=lambda b: sum(o == b for o in owners.values()))
            moved = {t for t, o in owners.items() if o == victim}
            res["moved_types"], res["victim"] = sorted(moved), victim

            th = threading.Thread(target=sender, daemon=True,
                                  args=(ctl, ledger, stop, errors, HOSTS, 5, RATE))
            th.start()
            time.sleep(WARM_S)
            kill_ns = time.time_ns()
            cluster.kill_broker(victim, SIGNALS[mode])
            log(f"  [{mode} {run}] broker {victim} (topics {sorted(moved)}) stopped")
            res["moved_s"] = None
            while (time.time_ns() - kill_ns) / 1e9 < AFTER_S:
                if res["moved_s"] is None:
                    try:
                        if all(cluster.owner(topics[t]) != victim for t in moved):
                            res["moved_s"] = (time.time_ns() - kill_ns) / 1e9
                    except Exception:  # no owner yet: the lookup fails
                        pass
                time.sleep(0.2)
            stop.set()
            th.join(30)
            if errors:
                raise RuntimeError(f"sender failed: {errors[0]!r}") from errors[0]
            a = drain(ctl, record_dir, ledger, res)
        finally:
            stop.set()
            host.close()
            ctl.close()
    rows = [r for rs in a["rows"].values() for r in rs]
    kept = {t for t in TYPES if t and t not in moved}
    res["gap_moved_s"] = _gap(a["rows"], moved, kill_ns)
    res["gap_kept_s"] = _gap(a["rows"], kept, kill_ns)
    res["gap_rpc_s"] = _gap(a["rows"], {0}, kill_ns)
    res["delay_moved_after_s"] = _dist([(r.applied_ns - r.timestamp_ns) / 1e9 for r in rows
                                        if r.vpc_id - 1 in moved and r.timestamp_ns >= kill_ns])
    res["delay_before_s"] = _dist([(r.applied_ns - r.timestamp_ns) / 1e9 for r in rows
                                   if r.vpc_id > 1 and r.timestamp_ns < kill_ns])
    res["moved_by_rpc"] = sum(1 for r in rows if r.vpc_id - 1 in moved and r.channel == "rpc")
    res.update({k: a[k] for k in ("duplicates", "out_of_order", "not_applied", "superseded",
                                  "resources_behind", "sent")})
    res["applied_rows"] = len(rows)
    return res


def _cell(runs: list[dict], get, fmt: str = "{:.2f}") -> str:
    vals = [v for v in (get(r) for r in runs) if v is not None]
    return fmt_stats(stats(vals), fmt) if vals else "-"


def summarize(results: dict[str, list[dict]], failed: list[dict[str, Any]]
              ) -> tuple[str, list[str]]:
    rows = []
    for mode, runs in results.items():
        rows.append([
            mode,
            _cell(runs, lambda r: r["gap_moved_s"], "{:.1f}"),
            _cell(runs, lambda r: r["moved_s"], "{:.1f}"),
            _cell(runs, lambda r: r["gap_kept_s"]),
            " / ".join(_cell(runs, lambda r, q=q: r["delay_moved_after_s"][q], "{:.2f}")
                       for q in ("p50", "p99", "max")),
            _cell(runs, lambda r: r["delay_before_s"]["p99"], "{:.3f}"),
            " / ".join(str(sum(r[k] for r in runs))
                       for k in ("duplicates", "out_of_order", "not_applied")),
            _cell(runs, lambda r: r["cluster_start_s"], "{:.0f}"),
        ])
    table = md_table(["stop", "moved types without delivery s", "topics moved s",
                      "other types without delivery s", "moved delay after p50 / p99 / max s",
                      "delay before p99 s", "dup / ooo / lost", "cluster start s"], rows)
    runs0 = next(iter(results.values()))
    notes = [
        f"median (min-max) over {len(runs0)} run(s) per mode; a secure cluster of one "
        f"ZooKeeper, two bookies (two copies of each message) and two brokers per run, "
        f"metadata session timeout {runs0[0]['session_timeout_s']:.0f} s; the controller's "
        "channel failover off (only the cluster carries the MQ types)",
        f"{RATE:.0f} msg/s round-robin over type 0 (RPC) and types 1-6 (topics 1-6), {SIZE} B, "
        "8 agents in process; the broker owning the most topics is stopped after "
        f"{WARM_S:.0f} s (crash: SIGKILL; shutdown: SIGTERM), the sender goes on "
        f"{AFTER_S:.0f} s after the stop",
        "without delivery: the longest interval from the stop on between two rows of one "
        "type applied on one node, the worst (node, type) pair's; topics moved: stop -> every "
        "moved "
        "topic's lookup answers the other broker; moved delay after: applied - generated, "
        "of the moved types' messages generated after the stop",
        "dup / ooo / lost summed over the runs (as bench_failover); not pinned",
    ]
    for mode, runs in results.items():
        notes.append(f"{mode}: moved topics per run {[r['moved_types'] for r in runs]}; all "
                     f"delivered {[r['complete'] for r in runs]}; rows "
                     f"{[r['applied_rows'] for r in runs]}")
    if failed:
        notes.append(f"runs repeated after a failure: {[(f['mode'], f['run']) for f in failed]}"
                     f" ({failed[0]['error'][:120]})")
    return table, notes


def main() -> None:
    global AFTER_S, RUNS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 run per mode, 15 s after the stop")
    ap.add_argument("--runs", type=int, default=None, help=f"runs per mode (default {RUNS})")
    ap.add_argument("--modes", default="crash,shutdown", help="comma-separated: crash, shutdown")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    if args.quick:
        AFTER_S, RUNS = 15.0, 1
    if args.runs is not None:
        RUNS = args.runs
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in SIGNALS for m in modes):
        ap.error(f"--modes: expected crash and/or shutdown, got {args.modes!r}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    t_all = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-pulsar-cluster-"))
    log(f"bench_pulsar_cluster: {RUNS} run(s) per mode {modes}; warm {WARM_S:.0f} s, "
        f"after {AFTER_S:.0f} s, {RATE:.0f} msg/s; work dir {work}")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    failed: list[dict[str, Any]] = []
    try:
        for run in range(RUNS):
            for mode in modes:
                for attempt in range(2):
                    try:
                        r = one_run(mode, run, work / f"try{attempt}")
                        break
                    except Exception as e:  # e.g. a port taken meanwhile: run it again
                        log(f"  [{mode} {run}] failed ({type(e).__name__}: {e}); again")
                        failed.append({"mode": mode, "run": run, "error": repr(e)[:500]})
                else:
                    raise RuntimeError(f"{mode} run {run} failed twice")
                results[mode].append(r)
                d = r["delay_moved_after_s"]
                log(f"  [{mode} {run}] moved types without delivery {r['gap_moved_s']:.1f} s, "
                    f"topics moved after {r['moved_s']} s, delay p99 {d['p99']} max "
                    f"{d['max']}; dup {r['duplicates']} ooo {r['out_of_order']} lost "
                    f"{r['not_applied']}; complete {r['complete']}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    table, notes = summarize(results, failed)
    total = time.perf_counter() - t_all
    finish("bench_pulsar_cluster", {
        "settings": {"rate": RATE, "warm_s": WARM_S, "after_s": AFTER_S, "runs": RUNS,
                     "modes": modes, "hosts": HOSTS, "channels": CHANNELS, "size": SIZE,
                     "quick": args.quick},
        "runs": results, "failed_attempts": failed, "total_s": total}, table, notes, total)


if __name__ == "__main__":
    main()
