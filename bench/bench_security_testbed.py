"""What security costs on the loopback testbed: the same testbed run (``delivery.testbed.
run_once``: real agents in child processes, the controller, a real Pulsar broker) with every
channel secure (mutual TLS on gRPC, TLS + mutual-TLS authentication + authorisation on
Pulsar) and with ``security.insecure``, alternating, several pairs, each mode on its own
broker started for it. Delay = generation at the controller to application on the node.

Usage: ``python bench/bench_security_testbed.py [--scenario godaddy] [--vpcs 256]
[--windows 2] [--pairs 3] [--policy idcs]``. Writes ``bench/results/bench_security_testbed.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import finish, log, md_table

from delivery.testbed import RunSpec, run_once
from envs.dsmd.problems import problems_for
from harness.broker import PulsarStandalone
from security.tls import Security

METRICS = ("delay_p50_ms", "delay_p95_ms", "delay_max_ms", "controller_cpu_util")


def _problems(scenario: str, vpcs: int | None, windows: int):
    base = problems_for(scenario)
    if vpcs is None:
        return base, list(range(windows))
    iv = float(base.spec.interval_s)
    ps = problems_for(scenario, {"num_vpcs": vpcs, "rate_per_vpc_bps": 375000.0,
                                 "peak_rate_bps": None, "phases": [],
                                 "duration_s": windows * iv})
    return ps, list(range(windows))


def _cell(vals: list[float], fmt: str) -> str:
    return (f"{fmt.format(statistics.median(vals))} "
            f"({fmt.format(min(vals))}-{fmt.format(max(vals))})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="godaddy")
    ap.add_argument("--vpcs", type=int, default=256, help="Fig. 9-style VPC count (0: the "
                    "scenario as it is)")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--policy", default="idcs")
    ap.add_argument("--time-scale", type=float, default=0.5)
    ap.add_argument("--payload-scale", type=float, default=0.01)
    args = ap.parse_args()
    ps, wins = _problems(args.scenario, args.vpcs or None, args.windows)
    modes = {"secure": Security(), "insecure": Security(insecure=True)}
    t0 = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="bench-sec-tb-") as tmp:
        brokers = {m: PulsarStandalone(progress=None, security=s, heap="512m",
                                       work_dir=Path(tmp) / f"broker-{m}").start()
                   for m, s in modes.items()}
        starts = {m: b.last_start_s for m, b in brokers.items()}
        try:
            for i in range(args.pairs):
                order = list(modes) if i % 2 == 0 else list(modes)[::-1]
                for m in order:
                    b = brokers[m]
                    spec = RunSpec(f"{m}-{i}", args.policy, ps, wins,
                                   time_scale=args.time_scale,
                                   payload_scale=args.payload_scale, security=modes[m])
                    r = run_once(spec, b.service_url, Path(tmp) / f"run-{m}-{i}", say=None,
                                 admin_url=b.admin_url)
                    s = r.summary
                    runs[m].append(s)
                    log(f"pair {i + 1}/{args.pairs} {m}: {s['messages']} messages, applied "
                        f"{s['applied']}, out of order {s['out_of_order']}, delay p50 "
                        f"{s['delay_p50_ms']:.1f} ms p95 {s['delay_p95_ms']:.1f} ms max "
                        f"{s['delay_max_ms']:.1f} ms, controller CPU "
                        f"{100 * s['controller_cpu_util']:.0f}%")
        finally:
            for b in brokers.values():
                b.close()
    render(runs, vars(args), starts, ps.num_nodes, int(ps.spec.num_topics),
           int(args.vpcs or ps.spec.num_vpcs), wins, time.perf_counter() - t0)


def render(runs: dict[str, list[dict[str, Any]]], settings: dict[str, Any],
           starts: dict[str, float], nodes: int, topics: int, vpcs: int, wins: list[int],
           total_s: float) -> None:
    """The table and notes of the runs (written by :func:`_common.finish`)."""
    rows = []
    for m, rs in runs.items():
        rows.append([m, f"{rs[0]['messages']:,}", f"{rs[0]['applied']:,}",
                     sum(int(r["pending_after"]) for r in rs),
                     sum(int(r["out_of_order"]) for r in rs),
                     _cell([r["delay_p50_ms"] for r in rs], "{:.1f}"),
                     _cell([r["delay_p95_ms"] for r in rs], "{:.1f}"),
                     _cell([r["delay_max_ms"] for r in rs], "{:.0f}"),
                     _cell([100 * r["controller_cpu_util"] for r in rs], "{:.0f}%")])
    p95 = {m: statistics.median(r["delay_p95_ms"] for r in rs) for m, rs in runs.items()}
    table = md_table(["mode", "messages per run", "applied per run (all destinations)",
                      "unconfirmed after drain (all runs)", "out of order (all runs)",
                      "delay p50 ms", "delay p95 ms", "delay max ms", "controller CPU"], rows)
    notes = [f"{settings['scenario']}, {nodes} agents, K = {topics}, {vpcs} VPCs, windows "
             f"{wins}, policy {settings['policy']}, time x{settings['time_scale']}, payload "
             f"x{settings['payload_scale']}; {settings['pairs']} alternating pairs, median "
             f"(min-max)",
             "secure: gRPC mutual TLS with role checks, Pulsar over TLS with mutual-TLS "
             "authentication and authorisation; insecure: security.insecure=true",
             f"p95 delay secure / insecure: {p95['secure'] / p95['insecure']:.2f}x",
             "broker start until it serves (one start each; secure includes its grants): "
             + ", ".join(f"{m} {v:.1f} s" for m, v in starts.items())]
    finish("bench_security_testbed", {"settings": settings, "runs": runs,
                                      "p95_ratio": p95["secure"] / p95["insecure"],
                                      "broker_start_s": starts, "nodes": nodes,
                                      "topics": topics, "vpcs": vpcs, "windows": wins,
                                      "total_s": total_s},
           table, notes, total_s)

if __name__ == "__main__":
    main()
