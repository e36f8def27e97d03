"""Algorithm 1 (Optimal Multicast, Zhu et al., Section VI-B) against group size: the
paper's linear-time claim, measured.

What is measured (wall time, one pinned core, median of ``REPEATS`` runs after one warm-up):

* ``algorithm1``: :func:`envs.trees.solver.algorithm1` end to end on ``n`` hypervisors
  and ``m`` service nodes with random load weights: the stable sort of the weights
  (``O(m log m)``; Theorem 2 assumes sorted weights), the ``k*`` search over every
  ``k = 1..m`` (Theorem 2, ``O(m)``), the degree distribution, the forwarding rules and the
  closed-form parent index of every node (Algorithm 1 lines 6-7, ``O(n + k*)``).
* ``k_search``: the ``k*`` search alone on already sorted weights.
* ``parents``: the closed-form parent indices alone (``parent_indices(n, k*)``).

The headline size: 10,000 hypervisors and 1,000 service nodes. Growth is
shown by doubling ``n`` and ``m`` together from 1,250 / 125 to 1,280,000 / 128,000; the
log-log slope of time against ``n + m`` over the larger half of the sizes (where the fixed
per-call overhead of numpy no longer dominates) says how the time grows (1 = linear).
``lambda = 0.1``, rate 0.05 Gbps and loads uniform in 0-16 Gbps make ``k*`` a large share of
``m`` at every size (the nodes whose ``lambda w`` is below the rate of one more stream), so
the tree part is not trivially small.

Usage: ``python bench/bench_trees.py [--quick]``; writes ``bench/results/bench_trees.json``
and ``bench/results/trees_growth.png``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, finish, fmt_stats, log, md_table, pin_one_core, stats

CORE = pin_one_core()

import numpy as np  # noqa: E402

from agents.trees.solver import algorithm1, k_values, load_weights, parent_indices  # noqa: E402
from envs.trees.switch import CloningCostSwitch  # noqa: E402

REPEATS = 7
HEADLINE = (10_000, 1_000)
SIZES = [(1_250 * 2 ** i, 125 * 2 ** i) for i in range(11)]  # up to 1,280,000 / 128,000
RATE, LAM, SEED = 0.05, 0.1, 0


def timed(fn: Callable[[], Any], repeats: int) -> dict[str, Any]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return stats(times)


def measure(n: int, m: int, repeats: int) -> dict[str, Any]:
    sw = CloningCostSwitch()
    w = load_weights(np.random.default_rng([SEED, n, m]).uniform(0.0, 16.0, m))
    res = algorithm1(n, RATE, w, sw, LAM)
    ws = np.sort(w)
    return {"n": n, "m": m, "k_star": res.k, "D": res.D, "height": res.tree.height(),
            "algorithm1_s": timed(lambda: algorithm1(n, RATE, w, sw, LAM), repeats),
            "k_search_s": timed(lambda: int(np.argmax(k_values(n, RATE, ws, sw, LAM))),
                                repeats),
            "parents_s": timed(lambda: parent_indices(n, res.k), repeats)}


def slope(rows: list[dict[str, Any]], key: str) -> float:
    big = rows[len(rows) // 2:]
    x = np.log([r["n"] + r["m"] for r in big])
    y = np.log([r[key]["median"] for r in big])
    return float(np.polyfit(x, y, 1)[0])


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib.pyplot as plt

    from agents.plots import _save  # sets the Agg backend

    size = np.array([r["n"] + r["m"] for r in rows], dtype=float)
    fig, ax = plt.subplots(figsize=(6.0, 4.2))
    for key, label in (("algorithm1_s", "Algorithm 1 (sort + k* + tree)"),
                       ("k_search_s", "k* search (sorted weights)"),
                       ("parents_s", "closed-form parent indices")):
        t = np.array([r[key]["median"] for r in rows])
        ax.loglog(size, t * 1e3, marker="o", label=label)
    ref = np.array([r["algorithm1_s"]["median"] for r in rows])[-1] * 1e3 * size / size[-1]
    ax.loglog(size, ref, "k--", lw=0.8, label="linear reference")
    ax.set_xlabel("n + m (hypervisors + service nodes)")
    ax.set_ylabel("time (ms), median")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path, "Algorithm 1: time against group size")


def main() -> None:
    global REPEATS, SIZES
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 runs, sizes up to 80,000 / 8,000")
    args = ap.parse_args()
    if args.quick:
        REPEATS, SIZES = 3, SIZES[:7]
    t_start = time.perf_counter()
    log(f"bench_trees: core {CORE}, {REPEATS} runs per size")
    head = measure(*HEADLINE, repeats=max(REPEATS, 11))
    log(f"  headline n={HEADLINE[0]:,} m={HEADLINE[1]:,}: k*={head['k_star']}, "
        f"{fmt_stats(head['algorithm1_s'], '{:.6f}')} s")
    rows = []
    for n, m in SIZES:
        r = measure(n, m, REPEATS)
        rows.append(r)
        log(f"  n={n:>9,} m={m:>7,}: k*={r['k_star']:>6,} D={r['D']:>4} "
            f"algorithm1 {r['algorithm1_s']['median'] * 1e3:9.3f} ms, k-search "
            f"{r['k_search_s']['median'] * 1e3:8.3f} ms, parents "
            f"{r['parents_s']['median'] * 1e3:8.3f} ms")
    slopes = {k: slope(rows, k) for k in ("algorithm1_s", "k_search_s", "parents_s")}
    png = plot(rows, RESULTS_DIR / "trees_growth.png")

    def ms(s: dict[str, Any]) -> str:
        return fmt_stats({k: (v * 1e3 if k in ("median", "min", "max") else v)
                          for k, v in s.items()}, "{:.3f}")

    table = md_table(
        ["n", "m", "k*", "D", "Algorithm 1 ms", "k* search ms", "parent indices ms",
         "us per (n + m)"],
        [[f"{r['n']:,}", f"{r['m']:,}", f"{r['k_star']:,}", r["D"], ms(r["algorithm1_s"]),
          ms(r["k_search_s"]), ms(r["parents_s"]),
          f"{r['algorithm1_s']['median'] * 1e6 / (r['n'] + r['m']):.4f}"] for r in rows])
    notes = [f"headline (issue): n = 10,000 hypervisors, m = 1,000 service nodes: Algorithm 1 "
             f"{ms(head['algorithm1_s'])} ms median (min-max) of "
             f"{head['algorithm1_s']['runs']} runs, k* = {head['k_star']}",
             "log-log slope of median time against n + m over the larger half of the sizes: "
             + ", ".join(f"{k[:-2]} {v:.2f}" for k, v in slopes.items())
             + " (1.0 = linear)",
             f"one pinned core ({CORE}), OMP/BLAS threads 1; median (min-max) of {REPEATS} runs "
             "after a warm-up; rate 0.05 Gbps, lambda 0.1, weights from loads U(0, 16) Gbps",
             f"plot: {png.relative_to(RESULTS_DIR.parents[1])}"]
    total = time.perf_counter() - t_start
    finish("bench_trees", {"settings": {"repeats": REPEATS, "sizes": SIZES, "rate_gbps": RATE,
                                        "lam": LAM, "seed": SEED, "quick": args.quick},
                           "headline": head, "rows": rows, "slopes": slopes,
                           "total_s": total}, table, notes, total)


if __name__ == "__main__":
    main()
