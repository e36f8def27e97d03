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

With ``--map``, the same scenario over a grid instead (``--repeats`` runs per cell, the
grid run through once per repetition; written as ``bench_fairness_map``): the burst
(:data:`MAP_BURSTS` messages), the number of small tenants (:data:`MAP_SMALLS`, each sending
20 messages/s) and the cap G (:data:`MAP_CAPS`); Sincon (``on``, a class per tenant) and one
FIFO (``off``) at each cap, and the unshaped controller once per burst and tenant count. Per
cell: each tenant kind's p50 and p95 (the small tenants' pooled; median, min-max over the
repetitions), and the median of Sincon's p95 over the unshaped one's for both, paired by
repetition: where shaping pays the small tenants and what it costs the bursting one.

Usage: ``python bench/bench_fairness.py [--quick | --map [--repeats N]]`` (``--quick``: one
run each, a burst of 1,000).
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
MAP_BURSTS = (300, 1000, 3000)
MAP_SMALLS = (1, 3)
MAP_CAPS = (200_000.0, 800_000.0)  # G, bytes/s of controller egress


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


def _pooled(delays: dict[int, list[float]], vpcs: list[int]) -> dict[str, float]:
    from tests.test_fairness import percentiles

    return percentiles([d for v in vpcs for d in delays[v]])


def bench_map(repeats: int) -> None:
    """The grid of the module docstring, ``repeats`` runs per cell."""
    from harness.broker import PulsarStandalone
    from tests.test_fairness import BIG, SMALL, arm_configs, burst_scenario

    t_start = time.perf_counter()
    cells = [(b, k, g, arm) for b in MAP_BURSTS for k in MAP_SMALLS
             for g in (*MAP_CAPS, None) for arm in (("unshaped",) if g is None else ("on", "off"))]
    log(f"bench_fairness --map: {len(cells)} cells x {repeats} runs")
    runs = []
    with PulsarStandalone(progress=None) as broker, \
            tempfile.TemporaryDirectory(prefix="bench_fairness_map_") as tmp:
        for rep in range(repeats):
            for i, (b, k, g, arm) in enumerate(cells):
                cfg = arm_configs(g or 0.0, k)[arm]
                res = burst_scenario(broker, Path(tmp) / f"{rep}-{i}", cfg, burst=b, smalls=k)
                small = _pooled(res["delays_ms"], [SMALL + j for j in range(k)])
                big = _pooled(res["delays_ms"], [BIG])
                runs.append({"repeat": rep, "burst": b, "smalls": k, "cap_Bps": g, "arm": arm,
                             "small": small, "big": big, "wall_s": res["wall_s"]})
                log(f"  run {rep + 1} [{i + 1}/{len(cells)}] burst {b}, {k} small, G "
                    f"{'-' if g is None else f'{g / 1e3:.0f} kB/s'}, {arm}: small p50/p95 "
                    f"{small['p50']:.0f}/{small['p95']:.0f} ms, large p50/p95 "
                    f"{big['p50']:.0f}/{big['p95']:.0f} ms, {res['wall_s']:.1f} s")

    def of(b: int, k: int, g: float | None, arm: str) -> list[dict[str, Any]]:
        return [r for r in runs if (r["burst"], r["smalls"], r["cap_Bps"], r["arm"])
                == (b, k, g, arm)]

    rows, verdict, summary = [], [], []
    for b, k, g, arm in cells:
        rs = of(b, k, g, arm)
        s = {f"{who}_{q}_ms": stats([r[who][q] for r in rs]) for who in ("small", "big")
             for q in ("p50", "p95")}
        summary.append({"burst": b, "smalls": k, "cap_Bps": g, "arm": arm, **s})
        rows.append([b, k, "-" if g is None else f"{g / 1e3:.0f}", arm,
                     *(fmt_stats(s[c]) for c in ("small_p50_ms", "small_p95_ms",
                                                 "big_p50_ms", "big_p95_ms"))])
    for b in MAP_BURSTS:
        for k in MAP_SMALLS:
            un = of(b, k, None, "unshaped")
            for g in MAP_CAPS:
                on = of(b, k, g, "on")
                ratio = {who: stats([o[who]["p95"] / u[who]["p95"] for o, u in zip(on, un)])
                         for who in ("small", "big")}
                verdict.append([b, k, f"{g / 1e3:.0f}", fmt_stats(ratio["small"], "{:.2f}"),
                                fmt_stats(ratio["big"], "{:.2f}")])
    table = md_table(["burst", "small tenants", "G kB/s", "shaping", "small p50 ms",
                      "small p95 ms", "large p50 ms", "large p95 ms"], rows)
    table += "\n\n" + md_table(["burst", "small tenants", "G kB/s",
                                 "small p95, Sincon / unshaped",
                                 "large p95, Sincon / unshaped"], verdict)
    notes = [f"median (min-max) of {repeats} runs per cell, the grid run through once per "
             "repetition; not pinned; the broker shared by every run",
             "large tenant: the burst of PORT updates x 4 nodes in one send_many; each small "
             "tenant: 20 SUBNET updates/s for 5 s to the same 4 nodes; 128-byte payloads",
             "on: sincon, a class per tenant; off: static, 1 class (one FIFO); both at G "
             "(payload bytes x destinations per second); unshaped: no shaper",
             "small: the small tenants' deliveries pooled; ratios paired by repetition, "
             "below 1: Sincon's p95 is lower than the unshaped controller's"]
    total = time.perf_counter() - t_start
    finish("bench_fairness_map", {"command": f"python bench/bench_fairness.py --map --repeats "
                                             f"{repeats}",
                                  "settings": {"bursts": MAP_BURSTS, "smalls": MAP_SMALLS,
                                               "caps_Bps": MAP_CAPS, "repeats": repeats},
                                  "runs": runs, "summary": summary, "total_s": total},
           table, notes, total)


def main() -> None:
    global REPEATS, BURST, SUBMITS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 run each, a burst of 1,000")
    ap.add_argument("--map", action="store_true",
                    help="the grid of bursts, small tenants and caps")
    ap.add_argument("--repeats", type=int, default=3, help="--map: runs per cell")
    args = ap.parse_args()
    if args.map:
        bench_map(args.repeats)
        return
    if args.quick:
        REPEATS, BURST, SUBMITS = 1, 1000, 10_000
    from harness.broker import PulsarStandalone
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
