"""Online simulator throughput: intervals per second of ``smart/DSMDOnline-v0`` and of the
online deciders on one core.

What is measured: on the first test trace of a dataset (``godaddy_online`` by default; the
trace is generated and cached before timing), whole runs of the online simulator
(:class:`envs.dsmd.online.OnlineSimulator`) under each decider: intervals per second and
seconds per interval (boundary plan + placement of the new types + realised scoring). The
environment row steps ``smart/DSMDOnline-v0`` (knob actions drawn uniformly, the default
greedy executor) through ``env.unwrapped``. Each configuration runs ``--repeats`` times over
``--windows`` intervals; the table gives the median (min-max).

Usage: ``python bench/bench_online.py [--quick] [--dataset NAME] [--windows N]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import finish, fmt_stats, log, md_table, pin_one_core, stats

CORE = pin_one_core()

import numpy as np  # noqa: E402

from agents.online import HindsightGreedy, OnlineGreedy, make_static  # noqa: E402
from envs.dsmd.dataset import build_dataset, load_dataset_spec  # noqa: E402
from envs.dsmd.online import OnlineCost, OnlineSimulator, OnlineTrace  # noqa: E402
from envs.dsmd.online_env import DSMDOnlineEnv  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dataset", default="godaddy_online")
    ap.add_argument("--windows", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    a = ap.parse_args()
    windows = a.windows or (10 if a.quick else 40)
    repeats = a.repeats or (2 if a.quick else 3)
    t_all = time.perf_counter()
    ds = build_dataset(load_dataset_spec(a.dataset))
    rec = ds.traces("test")[0]
    t0 = time.perf_counter()
    trace = OnlineTrace.from_dataset(ds.load(rec.id), ds.scenario, rec.id)
    parse_s = time.perf_counter() - t0
    cost = OnlineCost()
    topo = trace.parsed.catalog.topology
    deciders = {n: (lambda n=n: make_static(n, ds.scenario, topo, cost))
                for n in ("rpc", "idcs", "greedy")}
    deciders["online_greedy (headroom 0.1, horizon 4)"] = lambda: OnlineGreedy(
        headroom=0.1, horizon=4.0, cost=cost)
    deciders["oracle_greedy (hindsight)"] = lambda: HindsightGreedy(cost=cost)
    rows, payload = [], {"dataset": a.dataset, "trace": rec.id, "windows": windows,
                         "parse_s": parse_s, "results": {}}
    for name, make in deciders.items():
        rates = []
        for _ in range(repeats):
            sim = OnlineSimulator(trace, cost, hindsight=name.startswith("oracle"))
            t0 = time.perf_counter()
            sim.run(make(), windows)
            rates.append(windows / (time.perf_counter() - t0))
        s = stats(rates)
        payload["results"][name] = s
        rows.append([name, fmt_stats(s, "{:,.1f}"), f"{1000 / s['median']:,.0f}"])
        log(f"{name}: {fmt_stats(s, '{:,.1f}')} intervals/s")
    env = DSMDOnlineEnv(traces=[trace], max_intervals=windows)
    rng = np.random.default_rng(0)
    rates = []
    for r in range(repeats):
        env.reset(seed=r)
        t0 = time.perf_counter()
        for _ in range(windows):
            _, _, term, trunc, _ = env.step(rng.uniform(0, 1, 3).astype(np.float32))
            if term or trunc:
                break
        rates.append(windows / (time.perf_counter() - t0))
    s = stats(rates)
    payload["results"]["env"] = s
    rows.append(["smart/DSMDOnline-v0 step (greedy executor, random knobs)",
                 fmt_stats(s, "{:,.1f}"), f"{1000 / s['median']:,.0f}"])
    table = md_table(["decider", "intervals/s, median (min-max)", "ms per interval"], rows)
    notes = [f"trace {rec.id} of {a.dataset}: {trace.num_windows} intervals of "
             f"{trace.interval_s:g} s, {trace.num_types} types, parsed in {parse_s:.1f} s",
             f"{windows} intervals per run, {repeats} runs, pinned to core {CORE}"]
    finish("bench_online", payload, table, notes, time.perf_counter() - t_all)


if __name__ == "__main__":
    main()
