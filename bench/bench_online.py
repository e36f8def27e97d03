"""Online simulator throughput: seconds per interval of the online deciders, of the
simulator's own work, of ``smart/DSMDOnline-v0`` and of one interval at CERN scale, on one
core; with ``--before REF``, the same measurements of another commit in the same run, and
the speed-ups.

What is measured, on the first test trace of a dataset (``godaddy_online`` by default; the
trace is generated and cached before timing):

* each online decider over ``--windows`` intervals of :class:`envs.dsmd.online.OnlineSimulator`
  (boundary plan + placement of the types the plan does not cover + realised scoring),
  ``forecast_drop`` with the committed send forecaster (``results/forecaster``);
* ``simulator only``: a decider that plans nothing and places every type on RPC at once,
  i.e. the work of an interval that does not depend on the policy (the interval's arrivals,
  the expected state of the placements, the realised scoring);
* ``smart/DSMDOnline-v0`` stepped through ``env.unwrapped`` with knob actions drawn
  uniformly (the default greedy executor);
* ``cern``: ``online_greedy`` (headroom 0.1, horizon 4) on a trace of the CERN scenario
  (5,500 nodes, K = 1,000) with the ``godaddy_online`` dynamics, 300 s (10 intervals):
  seconds per interval after the first two (which fill the trace's caches).

Every row is timed after a warm-up interval (compiled kernels loaded), ``--repeats`` runs,
median (min-max). With ``--before REF`` each configuration runs first in a git worktree of
``REF`` and then in this checkout, each in a fresh process pinned to the same core, and the
table gives both and their ratio.

Usage: ``python bench/bench_online.py [--quick] [--before REF] [--dataset NAME]
[--windows N] [--no-cern]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, finish, fmt_stats, log, md_table, pin_one_core, stats

CORE = pin_one_core()

CERN_WINDOWS = 10
CERN_SKIP = 2  # intervals that fill the trace's caches


class SimulatorOnly:
    """Plans nothing, places every type on RPC: the simulator's own work."""

    name = "simulator only"

    def reset(self, seed: int | None = None) -> None:
        pass

    def plan(self, view: Any) -> tuple[Any, Any, Any]:
        import numpy as np

        z = np.zeros(0, np.int64)
        return z, z.copy(), z.copy()

    def place(self, view: Any, new: Any, placement: Any) -> int:
        return 0


def measure(dataset: str, windows: int, repeats: int, cern: bool) -> dict[str, Any]:
    """Every row of the module docstring, for the code this process imports."""
    import numpy as np

    from agents.online import HindsightGreedy, OnlineGreedy, make_static
    from envs.dsmd.dataset import build_dataset, load_dataset_spec
    from envs.dsmd.online import OnlineCost, OnlineSimulator, OnlineTrace
    from envs.dsmd.online_env import DSMDOnlineEnv

    out: dict[str, Any] = {}
    ds = build_dataset(load_dataset_spec(dataset))
    rec = ds.traces("test")[0]
    t0 = time.perf_counter()
    trace = OnlineTrace.from_dataset(ds.load(rec.id), ds.scenario, rec.id)
    out["trace"] = {"id": rec.id, "parse_s": time.perf_counter() - t0,
                    "windows": trace.num_windows, "types": trace.num_types,
                    "interval_s": trace.interval_s}
    cost = OnlineCost()
    topo = trace.parsed.catalog.topology
    deciders: dict[str, Any] = {n: (lambda n=n: make_static(n, ds.scenario, topo, cost))
                                for n in ("rpc", "idcs", "greedy")}
    deciders["online_greedy (headroom 0.1, horizon 4)"] = lambda: OnlineGreedy(
        headroom=0.1, horizon=4.0, cost=cost)
    forecaster = ROOT / "results/forecaster/send_forecaster.npz"
    try:  # a commit before the drop rule has no such executor: no row
        OnlineGreedy(send_forecaster=str(forecaster), drop=0.35, reserve_placements=True)
        deciders["forecast_drop (drop 0.35, headroom 0.3, horizon 1)"] = lambda: OnlineGreedy(
            headroom=0.3, horizon=1.0, cost=cost, reserve_placements=True,
            send_forecaster=str(forecaster), drop=0.35)
    except (TypeError, ValueError):
        pass
    deciders["oracle_greedy (hindsight)"] = lambda: HindsightGreedy(cost=cost)
    deciders["simulator only"] = SimulatorOnly
    for name, make in deciders.items():
        hind = name.startswith("oracle")
        OnlineSimulator(trace, cost, hindsight=hind).run(make(), 1)  # warm-up
        runs = []
        for _ in range(repeats):
            sim = OnlineSimulator(trace, cost, hindsight=hind)
            t0 = time.perf_counter()
            sim.run(make(), windows)
            runs.append((time.perf_counter() - t0) / windows)
        out[name] = stats(runs)
        log(f"  {name}: {1000 * out[name]['median']:.1f} ms per interval")
    env = DSMDOnlineEnv(traces=[trace], max_intervals=windows)
    rng = np.random.default_rng(0)
    env.reset(seed=0)
    env.step(rng.uniform(0, 1, 3).astype(np.float32))  # warm-up
    runs = []
    for r in range(repeats):
        env.reset(seed=r)
        t0 = time.perf_counter()
        n = 0
        for _ in range(windows):
            _, _, term, trunc, _ = env.step(rng.uniform(0, 1, 3).astype(np.float32))
            n += 1
            if term or trunc:
                break
        runs.append((time.perf_counter() - t0) / n)
    out["env"] = stats(runs)
    log(f"  env: {1 / out['env']['median']:.1f} steps/s")
    if cern:
        spec = load_dataset_spec(dataset, scenario="cern", num_traces=1,
                                 duration_s=30.0 * CERN_WINDOWS,
                                 split=[1.0, 0.0, 0.0]).replace(name=f"{dataset}_cern_bench")
        cds = build_dataset(spec)
        crec = cds.traces("all")[0]
        ctrace = OnlineTrace.from_dataset(cds.load(crec.id), cds.scenario, crec.id)
        sim = OnlineSimulator(ctrace, cost)
        dec = OnlineGreedy(headroom=0.1, horizon=4.0, cost=cost)
        dec.reset()
        per = []
        while not sim.done:
            t0 = time.perf_counter()
            sim.step(dec)
            per.append(time.perf_counter() - t0)
        out["cern"] = stats(per[CERN_SKIP:])
        out["cern_trace"] = {"types": ctrace.num_types,
                             "nodes": int(ctrace.node_capacity_bps.size),
                             "topics": cds.scenario.num_topics,
                             "types_per_interval": [int(ctrace.arrivals(w)[0].size)
                                                    for w in range(ctrace.num_windows)]}
        log(f"  cern: {out['cern']['median']:.2f} s per interval")
    return out


def _child(root: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Run :func:`measure` in a fresh process importing the code under ``root``."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    # the traces this checkout generated (envs.dsmd.problems.DATASETS_DIR), not a copy
    env.setdefault("SMART_DATASETS", str(ROOT / "datasets" / "generated"))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(out),
           "--root", str(root), "--dataset", args.dataset, "--windows", str(args.windows),
           "--repeats", str(args.repeats)] + (["--no-cern"] if args.no_cern else [])
    subprocess.run(cmd, check=True, cwd=root, env=env)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _git(*a: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *a], check=True, capture_output=True,
                          text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--before", default=None, help="a git ref measured beside this checkout")
    ap.add_argument("--dataset", default="godaddy_online")
    ap.add_argument("--windows", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--no-cern", action="store_true", help="skip the CERN-scale interval")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--root", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.windows = a.windows or (10 if a.quick else 40)
    a.repeats = a.repeats or (2 if a.quick else 3)
    if a.child:  # measure the code under --root (first on the path)
        sys.path.insert(0, a.root)
        Path(a.child).write_text(json.dumps(measure(a.dataset, a.windows, a.repeats,
                                                    not a.no_cern)))
        return
    t_all = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench-online-"))
    results: dict[str, dict[str, Any]] = {}
    before_commit = None
    try:
        if a.before:
            before_commit = _git("rev-parse", "--short", a.before)
            wt = tmp / "before"
            _git("worktree", "add", "--detach", str(wt), a.before)
            log(f"before ({before_commit}):")
            results["before"] = _child(wt, a, tmp / "before.json")
        log("this checkout:")
        results["now"] = _child(ROOT, a, tmp / "now.json")
    finally:
        if a.before:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(tmp / "before")], check=False, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    now = results["now"]
    before = results.get("before")
    rows = []
    keys = [k for k in now if k not in ("trace", "cern_trace")]
    for k in keys:
        unit, scale, fmt = (("s", 1.0, "{:,.2f}") if k == "cern" else ("ms", 1000.0, "{:,.1f}"))
        label = {"env": "smart/DSMDOnline-v0 step (greedy executor, random knobs)",
                 "cern": "cern: online_greedy, one interval"}.get(k, k)
        s = {f: (v * scale if f in ("median", "min", "max") else v)
             for f, v in now[k].items() if f != "values"}
        row = [label, f"{fmt_stats(s, fmt)} {unit}"]
        if before is not None:
            if k in before:
                b = {f: (v * scale if f in ("median", "min", "max") else v)
                     for f, v in before[k].items() if f != "values"}
                row += [f"{fmt_stats(b, fmt)} {unit}",
                        f"{before[k]['median'] / now[k]['median']:.1f}x"]
            else:
                row += ["-", "-"]
        if k == "env":
            row[1] += f" ({1 / now[k]['median']:.0f} steps/s)"
            if before is not None and k in before:
                row[2] += f" ({1 / before[k]['median']:.0f} steps/s)"
        rows.append(row)
    headers = ["what", "this checkout, per interval"] + (
        [f"before ({before_commit})", "speed-up"] if before is not None else [])
    table = md_table(headers, rows)
    tr = now["trace"]
    notes = [f"trace {tr['id']} of {a.dataset}: {tr['windows']} intervals of "
             f"{tr['interval_s']:g} s, {tr['types']} types",
             f"{a.windows} intervals per run, {a.repeats} runs after a warm-up interval, "
             f"each side in a fresh process pinned to core {CORE}"]
    if "cern_trace" in now:
        ct = now["cern_trace"]
        notes.append(f"cern: {ct['nodes']} nodes, K = {ct['topics']}, {ct['types']} types "
                     f"in the trace, {min(ct['types_per_interval'])}-"
                     f"{max(ct['types_per_interval'])} sending per interval; the median of "
                     f"intervals {CERN_SKIP + 1}-{CERN_WINDOWS}")
    if before_commit:
        notes.append(f"'before' is commit {before_commit}, run from a git worktree with this "
                     "environment's Python")
    command = "python bench/bench_online.py" + (" --quick" if a.quick else "") + (
        f" --before {a.before}" if a.before else "") + (" --no-cern" if a.no_cern else "")
    finish("bench_online", {"command": command,
                            "settings": {"quick": a.quick, "dataset": a.dataset,
                                         "windows": a.windows, "repeats": a.repeats,
                                         "cern": not a.no_cern, "before": a.before,
                                         "before_commit": before_commit},
                            "results": results, "total_s": time.perf_counter() - t_all},
           table, notes, time.perf_counter() - t_all)


if __name__ == "__main__":
    main()
