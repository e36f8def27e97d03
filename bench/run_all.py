"""Run every benchmark (each in its own subprocess, one after another) and write
``bench/results/SUMMARY.md`` from their JSON results: machine, run time and table of each.

Usage: ``python bench/run_all.py [--quick] [--summary-only]``. ``--quick`` is passed to
every benchmark; ``--summary-only`` runs nothing and rebuilds the summary from the JSON
files already there (e.g. after re-running one benchmark; run time is then the script's
own ``total_s``). Exits non-zero if a benchmark failed; the summary still lists the rest.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, ROOT, log, machine_info

BENCHMARKS = ("bench_env", "bench_trace", "bench_exact", "bench_replay", "bench_pendulum",
              "bench_throughput", "bench_serving", "bench_testbed", "bench_trees",
              "bench_shaping", "bench_online", "bench_dataset", "bench_outbox",
              "bench_failover", "bench_fairness", "bench_fairness_fidelity",
              "bench_announce", "bench_security_grpc",
              "bench_security_server", "bench_security_testbed", "bench_netem",
              "bench_switch_cost", "bench_rpc_patterns", "bench_server_abuse",
              "bench_runners", "bench_pulsar_cluster", "bench_cern_decisions",
              "bench_serving_overhead", "bench_actor_engines")


def run(name: str, extra: list[str]) -> tuple[int, float]:
    log(f"==> {name} {' '.join(extra)}")
    t0 = time.perf_counter()
    rc = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), *extra],
                        cwd=ROOT, check=False).returncode
    wall = time.perf_counter() - t0
    log(f"<== {name}: exit {rc}, {wall:.0f} s\n")
    return rc, wall


def _load(name: str) -> dict | None:
    path = RESULTS_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def summary(results: dict[str, tuple[int, float]], quick: bool) -> str:
    """``SUMMARY.md``: this machine, versions and commit, then the shared benchmark page
    format (:func:`reporting.reproduction.format_benchmarks`, also used for the docs)."""
    from reporting.reproduction import format_benchmarks

    m = machine_info()
    v = m["versions"]
    pre = [f"{m['timestamp']} -- {m['cpu_model']} ({m['cpu_count']} CPUs), {m['uname']}",
           "", ", ".join(f"{k} {val}" for k, val in v.items()) + f"; commit {m['git_commit']}",
           ""]
    if quick:
        pre += ["**Quick run (`--quick`): smoke-test settings, not representative.**", ""]
    return format_benchmarks({n: _load(n) for n in results}, "Benchmark summary", pre,
                             status=results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--summary-only", action="store_true")
    args = ap.parse_args()
    extra = ["--quick"] if args.quick else []
    if args.summary_only:
        docs = {name: _load(name) for name in BENCHMARKS}
        results = {n: (0, d.get("total_s", 0.0)) if d else (1, 0.0) for n, d in docs.items()}
        args.quick = any(d and d["settings"].get("quick") for d in docs.values())
    else:
        results = {name: run(name, extra) for name in BENCHMARKS}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / "SUMMARY.md"
    out.write_text(summary(results, args.quick))
    log(f"wrote {out}")
    for name, (rc, wall) in results.items():
        log(f"  {name:12s} exit {rc}  {wall:5.0f} s")
    sys.exit(max(rc != 0 for rc, _ in results.values()))


if __name__ == "__main__":
    main()
