"""Trace dataset build rate: one-hour ``godaddy_online`` traces per minute.

What is measured (``envs.dsmd.dataset``, spec ``configs/dataset/godaddy_online.yaml``):

* ``generate``  -- ``generate_dynamic(scenario, dynamics, seed, 3600)``: topology, the
  dynamics' schedule and the message trace of one hour (one trace seed per run);
* ``write``     -- ``write_dataset`` of that trace to a fresh directory (Parquet + topology
  + metadata, atomic rename);
* ``build``     -- ``build_dataset`` of ``--traces`` traces into a fresh root: generate,
  validate, write, sha256 of every file and the manifest, i.e. what a user waits for;
  traces per minute = traces / build time * 60;
* ``rebuild``   -- ``build_dataset`` again on the finished root (nothing generated: every
  file's sha256 checked against the manifest);
* ``open+load`` -- ``open_dataset`` and ``load`` of one trace (checksums, read, validation).

How: wall time (``time.perf_counter``); one cold run first (pays imports and scipy's root
finder for the size law), reported on its own, then ``REPEATS`` warm runs, median (min-max).
Not pinned: the project's normal (multi-threaded pyarrow) setting.

Usage: ``python bench/bench_dataset.py [--traces 4] [--quick]``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dir_bytes, finish, fmt_stats, log, md_table, timed

from envs.dsmd.dataset import build_dataset, load_dataset_spec, open_dataset
from envs.dsmd.dynamics import generate_dynamic
from envs.dsmd.traces import write_dataset

REPEATS = 3  # a one-hour godaddy trace takes well under a second to generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="godaddy_online")
    ap.add_argument("--traces", type=int, default=4, help="traces per timed build")
    ap.add_argument("--quick", action="store_true", help="1 warm run, 2 traces (smoke test)")
    args = ap.parse_args()
    repeats = 1 if args.quick else REPEATS
    n_traces = 2 if args.quick else args.traces
    t_start = time.perf_counter()
    spec = load_dataset_spec(args.dataset)
    scenario = spec.scenario_spec()
    log(f"bench_dataset: {spec.name} ({scenario.name}, {spec.duration_s:g} s per trace), "
        f"{repeats} warm runs, {n_traces} traces per build")

    stages: dict[str, dict] = {}
    seeds = [spec.trace_seed(i) for i in range(repeats + 1)]
    traces: list[Any] = []

    def gen(r: int):
        ds = generate_dynamic(scenario, spec.dynamics, seeds[r], spec.duration_s)
        traces.append(ds)
        return ds

    stages["generate"], _ = timed("generate", gen, repeats)
    msgs = [len(ds.trace) for ds in traces]
    events = [ds.meta["event_counts"] for ds in traces]
    with tempfile.TemporaryDirectory(prefix="bench_dataset.") as tmp:
        stages["write"], _ = timed(
            "write", lambda r: write_dataset(Path(tmp) / f"w{r}", traces[r]), repeats)
        disk = dir_bytes(Path(tmp) / "w0")
        sub = spec.replace(num_traces=n_traces)
        roots = [Path(tmp) / f"b{r}" for r in range(repeats + 1)]
        stages["build"], built = timed("build", lambda r: build_dataset(sub, roots[r]), repeats)
        stages["rebuild"], _ = timed("rebuild", lambda r: build_dataset(sub, roots[0]), repeats)
        first = built.traces()[0].id
        stages["open+load"], _ = timed(
            "open+load", lambda r: open_dataset(built.root).load(first), repeats)

    per_trace = {"generate": 1, "write": 1, "build": n_traces, "rebuild": n_traces,
                 "open+load": 1}
    what = {"generate": "generate_dynamic, 1 trace", "write": "write_dataset, 1 trace",
            "build": f"build_dataset, {n_traces} traces (fresh root)",
            "rebuild": f"build_dataset again, {n_traces} traces (cached)",
            "open+load": "open_dataset + load(1 trace)"}
    rate = {k: 60.0 * per_trace[k] / s["warm_s"]["median"] for k, s in stages.items()}
    table = md_table(
        ["stage", "what", "cold s (1st run)", "warm s", "traces/min (warm)"],
        [[k, what[k], f"{s['cold_s']:.3f}", fmt_stats(s["warm_s"], "{:.3f}"),
          f"{rate[k]:,.0f}"] for k, s in stages.items()])
    total = time.perf_counter() - t_start
    mean_msgs = sum(msgs) / len(msgs)
    facts = (f"{spec.name}: {spec.duration_s:g} s traces of {scenario.name} "
             f"({scenario.num_nodes} nodes, {scenario.num_vms:,} VMs, {scenario.num_vpcs} VPCs), "
             f"{mean_msgs:,.0f} messages per trace (min {min(msgs):,}, max {max(msgs):,}), "
             f"{disk / 2**20:.1f} MiB on disk per trace")
    gen_write_s = stages["generate"]["warm_s"]["median"] + stages["write"]["warm_s"]["median"]
    notes = [f"warm: median (min-max) of {repeats} runs after one cold run; wall time, "
             "not pinned",
             f"generate + write: {60.0 / gen_write_s:,.0f} traces/min; build adds validation, "
             "sha256 and the manifest", facts, f"events per generated trace: {events}"]
    finish("bench_dataset", {
        "settings": {"dataset": spec.name, "repeats": repeats, "traces_per_build": n_traces,
                     "quick": args.quick},
        "messages_per_trace": msgs, "events": events, "disk_bytes_per_trace": disk,
        "stages": stages, "traces_per_minute": rate,
        "generate_write_traces_per_minute": 60.0 / gen_write_s, "total_s": total},
        table, notes, total)


if __name__ == "__main__":
    main()
