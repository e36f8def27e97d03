"""Per-tenant fairness on the southbound channel: a small tenant's delivery delay while a
large tenant bursts, with Sincon's per-class shaping, one FIFO at the same cap, and no
shaping at all (a real Pulsar broker, real gRPC, real agents in process).

The scenario is the slow test's (``tests/test_fairness.py``, :func:`burst_scenario`): VPC 1
hands the controller ``BURST`` RPC messages (PORT updates of ``SIZE`` bytes to 4 nodes) in
one ``send_many`` while VPC 2 sends 20 messages/s for 5 s to the same nodes (each followed by
a flush). Arms:

* ``on``: ``policy=sincon``, two classes (VPC 1 -> 0, VPC 2 -> 1), cap ``G``;
* ``off``: ``policy=static``, one class: one FIFO paced at the same ``G``;
* ``unshaped``: shaping disabled (the controller creates no shaper).

Delay = ``applied_ns - timestamp_ns`` from the agents' programming records, every (node,
message). Each arm runs ``REPEATS`` times (arms interleaved); the table gives the median of
the runs' percentiles (min-max across runs). Also measured: the CPU cost of
``TenantShaper.submit`` on its fast path (nothing queued, released inline to a no-op), per
policy, 16 classes, ``SUBMITS`` calls.

Usage: ``python bench/bench_fairness.py [--quick]`` (``--quick``: one run each, a burst of
1,000).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import finish, fmt_stats, log, md_table, stats

REPEATS = 3
BURST = 3000
SUBMITS = 100_000
ARM_ORDER = ("on", "off", "unshaped")


def bench_submit_cost() -> dict[str, Any]:
    """Microseconds per ``submit`` that is released inline (a link so fast nothing waits)."""
    from delivery.fairness import TenantShaper, TenantShapingConfig

    res = {}
    for pol in ("none", "static", "sincon"):
        per_call = []
        for _ in range(REPEATS):
            sh: TenantShaper[int] = TenantShaper(
                TenantShapingConfig(enabled=True, policy=pol, classes=16,
                                    global_throughput_Bps=1e15), lambda items: None)
            t0 = time.perf_counter()
            for i in range(SUBMITS):
                sh.submit(i, 512, i)
            per_call.append((time.perf_counter() - t0) / SUBMITS * 1e6)
            assert not sh.backlog()
        res[pol] = stats(per_call)
        log(f"  submit() fast path, {pol}: {fmt_stats(res[pol], '{:.1f}')} us/call")
    return res


def main() -> None:
    global REPEATS, BURST, SUBMITS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 run each, a burst of 1,000")
    args = ap.parse_args()
    if args.quick:
        REPEATS, BURST, SUBMITS = 1, 1000, 10_000
    from delivery.broker import PulsarStandalone
    from tests.test_fairness import ARMS, BIG, G_BPS, SMALL, burst_scenario, percentiles

    t_start = time.perf_counter()
    log(f"bench_fairness: {REPEATS} runs per arm, burst {BURST}, G {G_BPS / 1e3:.0f} kB/s")
    submit_us = bench_submit_cost()
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in ARM_ORDER}
    with PulsarStandalone(progress=None) as broker, \
            tempfile.TemporaryDirectory(prefix="bench_fairness_") as tmp:
        for i in range(REPEATS):
            for arm in ARM_ORDER:
                res = burst_scenario(broker, Path(tmp) / f"{arm}-{i}", ARMS[arm], burst=BURST)
                row = {"small": percentiles(res["delays_ms"][SMALL]),
                       "big": percentiles(res["delays_ms"][BIG]), "wall_s": res["wall_s"]}
                runs[arm].append(row)
                log(f"  run {i + 1} {arm:8s}: small p50/p95/p99 "
                    f"{row['small']['p50']:.0f}/{row['small']['p95']:.0f}/"
                    f"{row['small']['p99']:.0f} ms; large p50/p95/p99 "
                    f"{row['big']['p50']:.0f}/{row['big']['p95']:.0f}/"
                    f"{row['big']['p99']:.0f} ms; {row['wall_s']:.1f} s")
    summary: dict[str, dict[str, Any]] = {}
    rows = []
    for arm in ARM_ORDER:
        s: dict[str, Any] = {}
        for who in ("small", "big"):
            for q in ("p50", "p95", "p99"):
                s[f"{who}_{q}_ms"] = stats([r[who][q] for r in runs[arm]])
        s["wall_s"] = stats([r["wall_s"] for r in runs[arm]])
        summary[arm] = s
        rows.append([arm] + [fmt_stats(s[f"small_{q}_ms"]) for q in ("p50", "p95", "p99")]
                    + [fmt_stats(s[f"big_{q}_ms"]) for q in ("p50", "p95", "p99")]
                    + [fmt_stats(s["wall_s"], "{:.1f}")])
    table = md_table(["shaping", "small p50 ms", "small p95 ms", "small p99 ms",
                      "large p50 ms", "large p95 ms", "large p99 ms", "run s"], rows)
    table += "\n\n" + md_table(["TenantShaper.submit, fast path", "us/call"],
                                [[pol, fmt_stats(s, "{:.1f}")] for pol, s in submit_us.items()])
    notes = [f"median (min-max) of {REPEATS} runs per arm, arms interleaved; not pinned",
             f"large tenant: {BURST} PORT updates x 4 nodes in one send_many; small tenant: "
             "20 SUBNET updates/s for 5 s to the same 4 nodes; 128-byte payloads",
             f"on: sincon, 2 classes; off: static, 1 class (one FIFO); both at G = "
             f"{G_BPS / 1e3:.0f} kB/s of controller egress (payload bytes x destinations); "
             "unshaped: no shaper",
             "delay = applied_ns - timestamp_ns over every (node, message) of the agents' "
             "records; run s = from the first send to the last message applied"]
    total = time.perf_counter() - t_start
    finish("bench_fairness", {"settings": {"repeats": REPEATS, "burst": BURST,
                                           "global_throughput_Bps": G_BPS,
                                           "submits": SUBMITS,
                                           "quick": args.quick, "arms": ARMS},
                              "runs": runs, "summary": summary, "submit_us": submit_us,
                              "total_s": total},
           table, notes, total)


if __name__ == "__main__":
    main()
