"""Trace pipeline timings for one scenario (default ``cern``).

What is measured, each stage on the same in-memory dataset:

* ``generate``   -- ``envs.dsmd.scenarios.generate(spec)``: topology + message trace;
* ``write``      -- ``envs.dsmd.traces.write_dataset`` to a fresh temporary directory
  (Parquet + topology + metadata, atomic rename);
* ``read``       -- ``read_dataset`` of that directory (reads and validates everything);
* ``parse``      -- ``envs.dsmd.parser.parse_trace(trace, topology, spec.interval_s)``:
  Algorithm 1's type lookup per message and the per-window counters;
* ``instances``  -- ``DSMDInstance.from_estimate`` for every window of the parse (what
  ``ProblemSet.instance(w)`` does on a cache miss).

How: wall time (``time.perf_counter``) of one cold run per stage (the first call in the
process pays one-time imports and caches: scipy's root finder for the size law, pyarrow's
Parquet writer), reported on its own, then ``REPEATS`` warm runs, median (min-max);
messages/s = trace messages / warm median. Not pinned: the project's normal
(multi-threaded pyarrow) setting.

Usage: ``python bench/bench_trace.py [--scenario cern] [--quick]``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dir_bytes, finish, fmt_stats, log, md_table, timed

from envs.dsmd.instance import DSMDInstance
from envs.dsmd.parser import parse_trace
from envs.dsmd.scenarios import generate, load_scenario
from envs.dsmd.traces import read_dataset, write_dataset

REPEATS = 5  # stages take well under 2 s on cern, so 5 runs are cheap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="cern")
    ap.add_argument("--quick", action="store_true", help="1 run per stage (smoke test)")
    args = ap.parse_args()
    repeats = 1 if args.quick else REPEATS
    t_start = time.perf_counter()
    spec = load_scenario(args.scenario)
    log(f"bench_trace: scenario {spec.name}, {repeats} runs per stage")

    stages: dict[str, dict] = {}
    stages["generate"], ds = timed("generate", lambda r: generate(spec), repeats)
    n_msgs = len(ds.trace)
    n_hosts = int(ds.trace.hosts.size)
    log(f"  {n_msgs:,} messages, {n_hosts:,} destination entries, "
        f"{ds.topology.num_nodes:,} nodes")

    with tempfile.TemporaryDirectory(prefix="bench_trace.") as tmp:
        dirs = [Path(tmp) / f"{spec.name}-{r}" for r in range(repeats + 1)]
        stages["write"], _ = timed("write", lambda r: write_dataset(dirs[r], ds), repeats)
        disk = dir_bytes(dirs[0])
        stages["read"], back = timed("read", lambda r: read_dataset(dirs[r]), repeats)
    if len(back.trace) != n_msgs:
        raise SystemExit(f"read back {len(back.trace)} messages, wrote {n_msgs}")

    stages["parse"], parsed = timed(
        "parse", lambda r: parse_trace(ds.trace, ds.topology, spec.interval_s), repeats)

    def build_all(r: int) -> list[DSMDInstance]:
        return [DSMDInstance.from_estimate(parsed.catalog, parsed.window(w), spec.num_topics,
                                           spec.controller_bw_bps, spec.controller_cpu)
                for w in range(parsed.num_windows)]

    stages["instances"], insts = timed("instances", build_all, repeats)
    types_per_window = [i.num_types for i in insts]

    what = {"generate": "generate(spec)", "write": "write_dataset (Parquet)",
            "read": "read_dataset (+ validation)", "parse": "parse_trace",
            "instances": f"from_estimate x {parsed.num_windows} windows"}
    table = md_table(
        ["stage", "what", "cold s (1st run)", "warm s", "messages/s (warm)"],
        [[k, what[k], f"{s['cold_s']:.3f}", fmt_stats(s["warm_s"], "{:.3f}"),
          f"{n_msgs / s['warm_s']['median']:,.0f}"] for k, s in stages.items()])
    total = time.perf_counter() - t_start
    facts = (f"{spec.name}: {n_msgs:,} messages ({n_hosts:,} destination entries), "
             f"{parsed.num_types:,} catalogue types, {parsed.num_windows} windows of "
             f"{spec.interval_s:g} s, {sum(types_per_window) / len(types_per_window):,.0f} "
             f"types per window, {disk / 2**20:.1f} MiB on disk")
    notes = [f"warm: median (min-max) of {repeats} runs after one cold run; wall time, "
             "not pinned", facts]
    finish("bench_trace", {
        "settings": {"scenario": spec.name, "repeats": repeats, "quick": args.quick},
        "messages": n_msgs, "destination_entries": n_hosts,
        "catalog_types": parsed.num_types, "windows": parsed.num_windows,
        "types_per_window": types_per_window, "disk_bytes": disk,
        "stages": stages,
        "messages_per_s": {k: n_msgs / s["warm_s"]["median"] for k, s in stages.items()},
        "total_s": total}, table, notes, total)


if __name__ == "__main__":
    main()
