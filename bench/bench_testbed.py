"""The loopback testbed as a benchmark: ``testbed.py`` at GoDaddy scale (350
real agents, a real Pulsar broker, K = 200), Fig. 9 (64..1,024 VPCs) and Fig. 10 (the five
burst phases) for RPC-only, VITA, IDCS and the learned policy; the table is the measured
results beside the paper's headline factors.

Usage: ``python bench/bench_testbed.py [--quick] [extra Hydra overrides...]``. ``--quick``: two
VPC points and four intervals of the phases; the full run is several times longer (run
times: the benchmarks page, ``docs/benchmarks.md``).
Writes ``bench/results/bench_testbed.json`` and leaves the testbed's own outputs (CSV, PNG,
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
    extra = [a for a in args if a != "--quick"]
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
    cols = ["label", "policy", "messages", "controller_bytes_trace", "controller_messages",
            "controller_cpu_util", "node_bytes_total_trace", "node_bytes_max_trace",
            "delay_p95_ms", "delay_max_ms", "out_of_order"]
    rows = []
    for _, r in s.iterrows():
        rows.append([r.label, r.policy, int(r.messages),
                     f"{r.controller_bytes_trace / 1e6:,.0f}", f"{int(r.controller_messages):,}",
                     f"{100 * r.controller_cpu_util:.0f}%",
                     f"{r.node_bytes_total_trace / 1e6:,.0f}",
                     f"{r.node_bytes_max_trace / 1e6:,.1f}", f"{r.delay_p95_ms:.1f}",
                     f"{r.delay_max_ms:.1f}", int(r.out_of_order)])
    table = md_table(["run", "policy", "messages", "controller MB (trace bytes)",
                      "controller msgs", "controller CPU", "CN total MB (trace bytes)",
                      "CN max MB", "delay p95 ms", "delay max ms", "out of order"], rows)
    notes = [f"outputs: {out}",
             "trace bytes = payload bytes on the wire / payload_scale (headers excluded); "
             "CPU = controller process CPU time / wall time (100% = one core)",
             "paper (Section VII-D, 350 VMs, 22-core servers): SMART 3.1x faster than RPC and "
             "1.9x faster than VITA at 512 VPCs (p95 delay); 1.9x / 3.2x over VITA / RPC "
             "under medium-heavy load",
             "measured p95-delay speedups of the learned policy: " + json.dumps(head)]
    finish("bench_testbed", {"settings": {"quick": quick, "overrides": extra},
                             "summary": s[cols].to_dict("records"), "headline": head,
                             "total_s": total}, table, notes, total)


if __name__ == "__main__":
    main()
