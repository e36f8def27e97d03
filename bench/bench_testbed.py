"""The testbed as a benchmark: ``testbed.py`` at GoDaddy scale (350 real agents, each in
its own namespace of the emulated network with the model's capacities, a real Pulsar broker,
K = 200), Fig. 9 (64..1,024 VPCs) and Fig. 10 (the five burst phases) for every policy; the
table is the measured results (median and range over ``repeats``) beside the paper's
headline factors.

Usage: ``python bench/bench_testbed.py [--quick] [--name NAME] [extra Hydra overrides...]``.
``--quick``: two VPC points and four intervals of the phases; the full run is several times
longer (run times: the benchmarks page, ``docs/benchmarks.md``). ``--name``: the result's
name (default ``bench_testbed``). A long grid can be run point by point and combined:
``merge=[dir,...]`` (completed testbed outputs) tabulates them without running anything,
and the total time is then the sum of their runs' wall times.
Writes ``bench/results/<name>.json`` and leaves the testbed's own outputs (CSV, PNG,
MLflow run) in ``outputs/testbed/<time>/``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, finish, log, md_table

QUICK = ["fig9.vpcs=[128,512]", "fig10.windows=[2,3,4,5]"]


def main() -> None:
    args = sys.argv[1:]
    quick = "--quick" in args
    name = "bench_testbed"
    if "--name" in args:
        i = args.index("--name")
        if i + 1 >= len(args):
            sys.exit("bench_testbed: --name needs a value")
        name = args[i + 1]
        del args[i:i + 2]
    extra = [a for a in args if a != "--quick"]
    merged = any(a.startswith("merge=") for a in extra)
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    out = ROOT / "outputs" / "testbed" / f"bench_{stamp}"
    cmd = [sys.executable, str(ROOT / "testbed.py"), f"out_dir={out}",
           *(QUICK if quick else []), *extra]
    log("bench_testbed: " + " ".join(cmd[1:]))
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, cwd=ROOT, check=False).returncode
    total = time.perf_counter() - t0
    if rc != 0:
        sys.exit(rc)
    s = pd.read_csv(out / "summary.csv")
    head = json.loads((out / "headline.json").read_text())
    if merged:  # the merged runs' replay and drain time (their set-up excluded)
        total = float(s.wall_s.sum() + s.drain_s.sum())
    table = results_table(s)
    net = "emulated network (namespaces, shaped links)" if "network" in s and \
        str(s.network.iloc[0]).startswith("smt") else "loopback"
    sources = json.loads((out / "merged_from.json").read_text()) if merged else []
    notes = [f"outputs: {out}" + (f" (merged from {', '.join(sources)})" if merged else ""),
             f"network: {net}",
             *(["total time: the merged runs' replay and drain time, set-up excluded"]
               if merged else []),
             "each cell: median over the repetitions [min, max]; delay = arrival at the "
             "controller (its due time in the replay) to application on the node",
             "sim: the simulator's verdict (Eq. 1) on the decisions the run applied: a "
             "violated constraint (bw = C_b, cpu = C_p, node = some s(n)) and the highest "
             "utilisation; queued: a shaped link's p95 queueing delay reached 50 ms or a "
             "send waited for C_p",
             "trace bytes = payload bytes on the wire / payload_scale (headers excluded); "
             "CPU = controller process CPU time / wall time (100% = one core)",
             "paper (Section VII-D, 350 VMs, 22-core servers): SMART 3.1x faster than RPC and "
             "1.9x faster than VITA at 512 VPCs (p95 delay); 1.9x / 3.2x over VITA / RPC "
             "under medium-heavy load",
             "measured p95-delay speedups: " + json.dumps(head)]
    keep = [c for c in s.columns if s[c].dtype != object or c in ("label", "policy",
                                                                   "network")]
    command = " ".join(["python bench/bench_testbed.py", *(["--quick"] if quick else []),
                        *([f"--name {name}"] if name != "bench_testbed" else []), *extra])
    finish(name, {"settings": {"quick": quick, "overrides": extra},
                             "command": command,
                             "summary": s[keep].to_dict("records"), "headline": head,
                             "total_s": total}, table, notes, total)


def _cell(g: pd.DataFrame, col: str, fmt: str, k: float = 1.0) -> str:
    v = g[col].astype(float) * k
    if len(v) == 1:
        return fmt.format(v.iloc[0])
    return f"{fmt.format(v.median())} [{fmt.format(v.min())}, {fmt.format(v.max())}]"


def results_table(s: pd.DataFrame) -> str:
    """One row per (run, policy): medians over the repetitions with their range."""
    rows = []
    has_net = "link_controller_queue_p95_ms" in s
    for (label, pol), g in s.groupby(["label", "policy"], sort=False):
        sim = g.iloc[0]
        verdict = ",".join(k for k, c in (("bw", "sim_bw_violation"),
                                          ("cpu", "sim_cpu_violation"),
                                          ("node", "sim_node_violation"))
                           if c in g and float(g[c].max()) > 0) or "-"
        row = [label, pol, len(g), _cell(g, "delay_p50_ms", "{:.0f}"),
               _cell(g, "delay_p95_ms", "{:.0f}"), _cell(g, "delay_max_ms", "{:.0f}"),
               _cell(g, "controller_bytes_trace", "{:,.0f}", 1e-6),
               _cell(g, "controller_messages", "{:,.0f}"),
               _cell(g, "controller_cpu_util", "{:.0f}%", 100.0),
               _cell(g, "node_bytes_total_trace", "{:,.0f}", 1e-6),
               _cell(g, "node_bytes_max_trace", "{:,.1f}", 1e-6),
               _cell(g, "subscribe_infos", "{:,.0f}"),
               int(g.out_of_order.sum()), int((g.applied + g.out_of_order).min())]
        if has_net:
            row += [f"{verdict} ({float(sim.get('sim_utilisation', float('nan'))):.2f})",
                    _cell(g, "link_controller_queue_p95_ms", "{:.0f}"),
                    _cell(g, "link_nodes_queue_p95_ms", "{:.0f}"),
                    _cell(g, "inflight_waits", "{:,.0f}"),
                    "yes" if bool(g.queued.any()) else "no"]
        rows.append(row)
    cols = ["run", "policy", "reps", "delay p50 ms", "delay p95 ms", "delay max ms",
            "controller MB (trace)", "controller msgs", "controller CPU", "CN total MB (trace)",
            "CN max MB", "SubscribeInfos", "out of order", "applied"]
    if has_net:
        cols += ["sim violates (max util.)", "C_b link queue p95 ms",
                 "worst CN link queue p95 ms", "C_p waits", "queued"]
    return md_table(cols, rows)


if __name__ == "__main__":
    main()
