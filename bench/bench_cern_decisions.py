"""Decision time at CERN scale (5,500 nodes, K = 1,000, about 3,000 sending types per 30 s
interval): seconds per full interval and microseconds per sending type of each online
decider, against the 30 s interval, on one core.

What is measured, on the first test trace of ``cern_online`` (the CERN-scale cloud with
``godaddy_online``'s dynamics; generated and cached before timing), over its first
``--windows`` intervals of :class:`envs.dsmd.online.OnlineSimulator`:

* ``simulator only``: a decider that plans nothing and places every type on RPC at once:
  the interval's work that does not depend on the policy (arrivals, the expected state of
  the placements, the realised scoring);
* each decider's interval (its boundary plan and the placements of the types its plan does
  not cover, plus the simulator's work), and its decision time: the interval minus the
  simulator's own, also per sending type of the interval;
* the deciders: ``idcs`` (the best heuristic there on validation), ``online_greedy`` and
  ``forecast_drop`` at the settings ``experiment=cern_transfer`` tuned on validation, and
  the learned online policy (a bundle, ``--bundle``; by default the one ``make run``
  exports, ``checkpoints/godaddy_online__ddpg__0``, when present): its actor's forward pass
  on the interval's observation, then its executor's plan.

Every decider runs ``--repeats`` times in this process (pinned to one core) after a warm-up
interval; each run's value is the median over its intervals after the first
(``SKIP``: the trace's caches fill there); the table gives the median (min-max) over runs.

Usage: ``python bench/bench_cern_decisions.py [--quick] [--windows N] [--bundle DIR]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, finish, fmt_stats, log, md_table, pin_one_core, stats

CORE = pin_one_core()
from bench_online import SimulatorOnly  # noqa: E402 (after the pinning, before numpy)

SKIP = 1
INTERVAL_S = 30.0


def measure(windows: int, repeats: int, bundle: Path | None) -> dict[str, Any]:
    from agents.online_eval import DeciderSpec
    from envs.dsmd.dataset import build_dataset, load_dataset_spec
    from envs.dsmd.online import OnlineCost, OnlineSimulator, OnlineTrace

    t0 = time.perf_counter()
    ds = build_dataset(load_dataset_spec("cern_online"))
    rec = ds.traces("test")[0]
    trace = OnlineTrace.from_dataset(ds.load(rec.id), ds.scenario, rec.id)
    log(f"  trace {rec.id}: {trace.num_types} types, {trace.num_windows} intervals "
        f"(ready after {time.perf_counter() - t0:.0f} s)")
    cost = OnlineCost()
    fc = str(ROOT / "results/forecaster/send_forecaster.npz")
    specs: dict[str, Any] = {
        "simulator only": SimulatorOnly,
        "idcs": DeciderSpec.make("idcs", "static", policy="idcs"),
        "online_greedy (headroom 0, horizon 1)": DeciderSpec.make(
            "online_greedy", "online_greedy", headroom=0.0, horizon=1.0, forecast="last"),
        "forecast_drop (drop 0.35, headroom 0.4, horizon 1)": DeciderSpec.make(
            "forecast_drop", "online_greedy", headroom=0.4, horizon=1.0, forecast="last",
            drop=0.35, reserve_placements=True, send_forecaster=fc),
    }
    if bundle is not None:
        specs[f"learned ({bundle.name})"] = DeciderSpec.make("learned", "learned",
                                                             bundle=str(bundle))
    sending = [int(trace.arrivals(w)[0].size) for w in range(windows)]
    out: dict[str, Any] = {"trace": {"id": rec.id, "types": trace.num_types,
                                     "nodes": int(trace.node_capacity_bps.size),
                                     "topics": ds.scenario.num_topics,
                                     "sending": sending}}
    for name, spec in specs.items():
        def make(spec: Any = spec) -> Any:
            return spec() if spec is SimulatorOnly else spec.build(trace, cost)
        OnlineSimulator(trace, cost).run(make(), 1)  # warm-up: kernels and bundle loaded
        per_run = []
        for _ in range(repeats):
            sim, dec = OnlineSimulator(trace, cost), make()
            dec.reset()
            steps = []
            for _w in range(windows):
                t = time.perf_counter()
                sim.step(dec)
                steps.append(time.perf_counter() - t)
            per_run.append(steps)
        out[name] = {"runs": per_run}
        med = statistics.median(statistics.median(r[SKIP:]) for r in per_run)
        log(f"  {name}: {med:.2f} s per interval")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 intervals, 1 run")
    ap.add_argument("--windows", type=int, default=None, help="intervals per run (default 8)")
    ap.add_argument("--repeats", type=int, default=None, help="runs (default 3)")
    ap.add_argument("--bundle", default=None,
                    help="an online policy bundle (default: make run's, if present)")
    a = ap.parse_args()
    windows = a.windows or (4 if a.quick else 8)
    repeats = a.repeats or (1 if a.quick else 3)
    default_bundle = ROOT / "checkpoints/godaddy_online__ddpg__0"
    bundle = Path(a.bundle) if a.bundle else (
        default_bundle if (default_bundle / "metadata.json").is_file() else None)
    t_all = time.perf_counter()
    log(f"bench_cern_decisions: {windows} intervals x {repeats} runs on core {CORE}; "
        f"bundle {bundle}")
    res = measure(windows, repeats, bundle)
    sending = res["trace"]["sending"]
    # the simulator's own work on each interval: the median over its runs
    sim_w = [statistics.median(y[w] for y in res["simulator only"]["runs"])
             for w in range(windows)]
    rows = []
    for name, r in res.items():
        if name == "trace":
            continue
        per_interval = [statistics.median(x[SKIP:]) for x in r["runs"]]
        share = f"{100 * statistics.median(per_interval) / INTERVAL_S:.1f}%"
        row = [name, fmt_stats(stats(per_interval), "{:.2f}") + " s"]
        if name == "simulator only":
            row += ["-", "-", share]
        else:
            dec = [[max(0.0, x[w] - sim_w[w]) for w in range(SKIP, windows)]
                   for x in r["runs"]]
            per_type = [statistics.median(d / max(1, sending[w]) * 1e6
                                          for d, w in zip(ds_, range(SKIP, windows)))
                        for ds_ in dec]
            row += [fmt_stats(stats([statistics.median(d) for d in dec]), "{:.2f}") + " s",
                    fmt_stats(stats(per_type), "{:.0f}") + " µs", share]
        rows.append(row)
    table = md_table(["decider", "interval (decision + simulator)", "decision",
                      "decision per sending type", "share of the 30 s interval"], rows)
    tr = res["trace"]
    notes = [
        f"trace {tr['id']} of cern_online: {tr['nodes']} nodes, K = {tr['topics']}, "
        f"{tr['types']} types in the trace, {min(sending[SKIP:])}-{max(sending[SKIP:])} "
        f"sending per measured interval",
        f"{windows} intervals per run (the first not counted), {repeats} run(s), median "
        f"(min-max) over runs of each run's median interval; one process pinned to core "
        f"{CORE}",
        "decision = the interval minus the simulator's own work on the same interval "
        "(the 'simulator only' row); per sending type = decision / the interval's sending "
        "types",
        "settings of online_greedy and forecast_drop: experiment=cern_transfer's tuning on "
        "cern_online's validation traces (results/cern_transfer/0/summary.txt)",
    ]
    if bundle is None:
        notes.append("no learned bundle: run `make run` first, or pass --bundle")
    command = "python bench/bench_cern_decisions.py" + (" --quick" if a.quick else "")
    finish("bench_cern_decisions", {
        "command": command, "settings": {"windows": windows, "repeats": repeats,
                                         "bundle": str(bundle) if bundle else None},
        "results": res, "total_s": time.perf_counter() - t_all},
        table, notes, time.perf_counter() - t_all)


if __name__ == "__main__":
    main()
