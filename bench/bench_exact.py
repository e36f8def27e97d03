"""Exact MILP solve time against instance size, and the greedy heuristic's gap to it.

What is measured: wall time of ``agents.exact.ExactMILP(time_limit_s=60).assign(inst)``
(model building + HiGHS), the model size (``milp_size``) and solver status, and the
objective sum_n b(n) of the MILP's and of ``agents.greedy.GreedyLocalSearch``'s
assignment, both evaluated with ``envs.dsmd.cost.CostState(inst, channel).total_traffic``.
Greedy's gap = (greedy - MILP) / MILP in %. When the MILP stops at the time limit its
assignment is only the incumbent: the gap is then relative to the incumbent and the
solver's lower bound is reported too.

Instances:

(a) every window of the ``tiny`` scenario (``build_problems(load_scenario("tiny"),
    cache_dir=None)``, ``ps.instance(w)``);
(b) synthetic instances from ``DSMDInstance.from_sets`` of growing (M types, N nodes,
    K topics): destination sets of 1..5 distinct random nodes, log-uniform rates in
    [1e5, 1e7] bit/s (seeded ``numpy`` Generator per size), controller bandwidth and node
    capacities of 1e12 (never binding) and ``C_p = round(M + 0.3 (sum_m |D(m)| - M))``, so
    RPC-only (``sum |D|`` sends) violates the CPU limit while all-MQ (``M`` sends) meets
    it: the instance is feasible and the CPU constraint binds.

How: up to ``REPEATS`` (3) solves per instance, median (min-max). Repeats stop early when
a solve hits the time limit (repeating it would only re-measure the limit) or the
instance's solves have used ``REPEAT_BUDGET_S``. Growing stops after the first size whose
median exceeds ``TIME_LIMIT_S`` or that hits the time limit, or once the script has used
``TOTAL_BUDGET_S``. Infeasible instances (``PolicyError``) are reported with a simple
certificate where one exists (sum_m f(m) > C_b or M > C_p: no assignment can meet it).
Not pinned (HiGHS runs its MIP search on one thread).

Usage: ``python bench/bench_exact.py [--quick]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np
from _common import finish, fmt_stats, log, md_table, stats

from agents.exact import ExactMILP, milp_size
from agents.greedy import GreedyLocalSearch
from agents.policy import PolicyError
from envs.dsmd.cost import CostState
from envs.dsmd.instance import DSMDInstance
from envs.dsmd.problems import build_problems
from envs.dsmd.scenarios import load_scenario

SIZES: list[tuple[int, int, int]] = [(8, 8, 2), (12, 10, 2), (16, 12, 3), (20, 16, 3),
                                     (24, 18, 3), (30, 20, 4), (40, 30, 5), (60, 40, 6)]
TIME_LIMIT_S = 60.0
REPEATS = 3
REPEAT_BUDGET_S = 120.0  # per instance: no further repeat once its solves used this much
TOTAL_BUDGET_S = 420.0  # no new synthetic size after this much script time
SEED = 0
BIG = 10**12  # controller bandwidth and node capacity that never bind


def synthetic(m: int, n: int, k: int, seed: int = SEED) -> DSMDInstance:
    g = np.random.default_rng([seed, m, n, k])
    dests = [g.choice(n, size=int(g.integers(1, 6)), replace=False) for _ in range(m)]
    rates = np.rint(10.0 ** g.uniform(5.0, 7.0, m)).astype(np.int64)
    fanout_sum = sum(len(d) for d in dests)
    cpu = round(m + 0.3 * (fanout_sum - m))
    return DSMDInstance.from_sets(dests, rates, BIG, k, BIG, cpu, num_nodes=n,
                                  name=f"synthetic M={m} N={n} K={k}")


def infeasibility_certificate(inst: DSMDInstance) -> str | None:
    """A reason no assignment can be feasible, if a simple bound shows it."""
    if int(inst.rate_bps.sum()) > inst.controller_bw_bps:
        return (f"sum f(m) = {inst.rate_bps.sum() / 1e6:.2f} Mbps > C_b = "
                f"{inst.controller_bw_bps / 1e6:.2f} Mbps even with every type on MQ")
    if inst.num_types > inst.controller_cpu:
        return f"M = {inst.num_types} > C_p = {inst.controller_cpu} even with every type on MQ"
    return None


def solve(inst: DSMDInstance) -> dict[str, Any]:
    """Repeated MILP solves plus greedy on ``inst``; one result row."""
    size = milp_size(inst)
    row: dict[str, Any] = {"name": inst.name, "M": inst.num_types, "N": inst.num_nodes,
                           "K": inst.num_topics, **size,
                           "rpc_only_sends": int(inst.fanout.sum()),
                           "controller_cpu": inst.controller_cpu}
    times: list[float] = []
    objectives: set[int] = set()
    info: dict[str, Any] = {}
    channel: np.ndarray | None = None
    error: str | None = None
    while len(times) < REPEATS:
        ex = ExactMILP(time_limit_s=TIME_LIMIT_S)
        t0 = time.perf_counter()
        try:
            channel = ex.assign(inst)
        except PolicyError as e:
            error = str(e)
        times.append(time.perf_counter() - t0)
        info = ex.info()
        if channel is not None:
            objectives.add(CostState(inst, channel).total_traffic)
        if info.get("status") in ("time_limit", "too_large") or sum(times) >= REPEAT_BUDGET_S:
            break
    row.update(status=info.get("status", "error"), time_s=stats(times),
               hit_time_limit=info.get("status") == "time_limit", error=error,
               mip_gap=info.get("mip_gap"), lower_bound_bps=info.get("lower_bound_bps"),
               solver_objective_bps=info.get("solver_objective_bps"))
    if len(objectives) > 1:
        row["note"] = f"objective differs across repeats: {sorted(objectives)}"
    greedy_times: list[float] = []
    for _ in range(REPEATS):
        gp = GreedyLocalSearch()
        t0 = time.perf_counter()
        g_channel = gp.assign(inst)
        greedy_times.append(time.perf_counter() - t0)
    g_state = CostState(inst, g_channel)
    row.update(greedy_bps=g_state.total_traffic, greedy_feasible=g_state.metrics().feasible,
               greedy_violation=gp.info().get("violation"), greedy_time_s=stats(greedy_times))
    if channel is not None:
        opt = CostState(inst, channel)
        row.update(milp_bps=opt.total_traffic, milp_feasible=opt.metrics().feasible,
                   greedy_gap_pct=100.0 * (g_state.total_traffic - opt.total_traffic)
                   / opt.total_traffic)
        if row["solver_objective_bps"] is not None:
            row["objective_mismatch_rel"] = abs(row["solver_objective_bps"]
                                                - opt.total_traffic) / opt.total_traffic
    else:
        row.update(milp_bps=None, milp_feasible=None, greedy_gap_pct=None,
                   infeasibility_certificate=infeasibility_certificate(inst))
    return row


def describe(row: dict[str, Any]) -> str:
    out = (f"{row['status']}, {row['variables']:,} vars, "
           f"{fmt_stats(row['time_s'], '{:.2f}')} s [{row['time_s']['runs']} runs]")
    if row["greedy_gap_pct"] is not None:
        out += f", greedy gap {row['greedy_gap_pct']:+.2f}%"
    if row.get("infeasibility_certificate"):
        out += f" -- {row['infeasibility_certificate']}"
    return out


def table_rows(rows: list[dict[str, Any]], label: str) -> list[list[str]]:
    out = []
    for r in rows:
        if r.get("skipped"):
            out.append([r[label], "", "", "skipped", r["skipped"], "", "", "", ""])
            continue
        gap = "-" if r["greedy_gap_pct"] is None else f"{r['greedy_gap_pct']:+.2f}%"
        if not r["greedy_feasible"]:
            gap += " (greedy infeasible)"
        lb = (f" (LB {r['lower_bound_bps'] / 1e6:,.2f})"
              if r["hit_time_limit"] and r["lower_bound_bps"] is not None else "")
        obj = "-" if r["milp_bps"] is None else f"{r['milp_bps'] / 1e6:,.2f}{lb}"
        out.append([r[label], f"{r['binaries']:,} + {r['continuous']:,}",
                    f"{r['controller_cpu']} / {r['rpc_only_sends']}", r["status"],
                    f"{fmt_stats(r['time_s'], '{:.3f}')} [{r['time_s']['runs']}]",
                    "yes" if r["hit_time_limit"] else "no", obj,
                    f"{r['greedy_bps'] / 1e6:,.2f}", gap])
    return out


HEADERS = ["instance", "binaries + continuous", "C_p / RPC-only sends", "status",
           "MILP s median (min-max) [runs]", "hit limit", "MILP obj Mbps", "greedy obj Mbps",
           "greedy gap"]


def main() -> None:
    global REPEATS, SIZES
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 run, first 3 sizes (smoke test)")
    args = ap.parse_args()
    if args.quick:
        REPEATS, SIZES = 1, SIZES[:3]
    t_start = time.perf_counter()
    log(f"bench_exact: time limit {TIME_LIMIT_S:g} s, up to {REPEATS} solves per instance")

    ps = build_problems(load_scenario("tiny"), cache_dir=None)
    tiny: list[dict[str, Any]] = []
    for w in range(ps.parsed.num_windows):
        row = solve(ps.instance(w))
        row["instance"] = f"tiny w{w} (M={row['M']}, N={row['N']}, K={row['K']})"
        tiny.append(row)
        log(f"  tiny w{w}: {describe(row)}")

    synth: list[dict[str, Any]] = []
    stop: str | None = None
    for m, n, k in SIZES:
        label = f"M={m}, N={n}, K={k}"
        if stop is not None:
            synth.append({"instance": label, "skipped": stop})
            log(f"  {label}: skipped ({stop})")
            continue
        row = solve(synthetic(m, n, k))
        row["instance"] = label
        synth.append(row)
        log(f"  {label}: {describe(row)}")
        if row["hit_time_limit"] or row["time_s"]["median"] > TIME_LIMIT_S:
            stop = f"a smaller size reached the {TIME_LIMIT_S:g} s limit"
        elif time.perf_counter() - t_start > TOTAL_BUDGET_S:
            stop = f"script budget of {TOTAL_BUDGET_S:g} s used"

    table = ("**(a) tiny scenario, every window**\n\n" + md_table(HEADERS,
                                                                  table_rows(tiny, "instance"))
             + "\n\n**(b) synthetic instances**\n\n" + md_table(HEADERS,
                                                               table_rows(synth, "instance")))
    gaps = [r["greedy_gap_pct"] for r in tiny + synth
            if r.get("greedy_gap_pct") is not None and r["status"] == "optimal"]
    notes = [f"MILP time: median (min-max) of [runs] solves, wall time of ExactMILP.assign "
             f"(model build + HiGHS), time limit {TIME_LIMIT_S:g} s; not pinned",
             "objectives: sum_n b(n) from CostState(inst, channel).total_traffic; "
             "greedy gap = (greedy - MILP) / MILP; LB = solver lower bound when time-limited",
             f"greedy vs proven optimum: gap 0 on {sum(abs(g) < 1e-9 for g in gaps)} of "
             f"{len(gaps)} instances, worst {max(gaps, default=float('nan')):+.2f}%"]
    for r in tiny + synth:
        if r.get("error"):
            cert = r.get("infeasibility_certificate") or "no simple certificate"
            notes.append(f"{r['instance']}: {r['status']} -- {cert}; greedy violation "
                         f"{r['greedy_violation']:.3f}")
        if r.get("objective_mismatch_rel", 0.0) > 1e-6:
            notes.append(f"{r['instance']}: solver objective differs from CostState by "
                         f"{100 * r['objective_mismatch_rel']:.4f}%")
        if r.get("note"):
            notes.append(f"{r['instance']}: {r['note']}")
    total = time.perf_counter() - t_start
    finish("bench_exact", {
        "settings": {"time_limit_s": TIME_LIMIT_S, "repeats": REPEATS,
                     "repeat_budget_s": REPEAT_BUDGET_S, "total_budget_s": TOTAL_BUDGET_S,
                     "sizes": SIZES, "seed": SEED, "quick": args.quick},
        "tiny": tiny, "synthetic": synth, "total_s": total}, table, notes, total)

if __name__ == "__main__":
    main()
