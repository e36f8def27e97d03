"""The sending-path simulator against the real shaper: every cell of the measured fairness
map (``bench_fairness_map``: a real controller, real gRPC, a real broker and agents) run
through :func:`delivery.sending_sim.simulate_burst` with the same workload and the same
shaping configuration, each tenant kind's p50 and p95 side by side.

The simulator's cost constants (``delivery/sending_costs.json``) are fitted on the
*unshaped* cells only (``--fit``: least squares on the log of the four percentiles, Nelder-
Mead over the log of the constants); the shaped cells (Sincon ``on``, one FIFO ``off``) are
the validation. A cell agrees when every one of its four percentiles is within a factor of 2
of the measured median. The verdict table puts the measured and simulated Sincon / unshaped
p95 ratios side by side: where shaping pays the small tenants, and what it costs the
bursting one.

Usage: ``python bench/bench_fairness_fidelity.py [--fit] [--measured PATH]`` (``--quick``
is accepted and changes nothing) (default: the
committed ``results/bench/bench_fairness_map.json``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import finish, log, md_table

ROOT = Path(__file__).resolve().parent.parent
MEASURED = ROOT / "results" / "bench" / "bench_fairness_map.json"
STATS = ("small_p50_ms", "small_p95_ms", "big_p50_ms", "big_p95_ms")
FIT_START = (0.003, 1.2e-4, 0.003, 3e-5, 0.01)
FACTOR = 2.0


def load_cells(path: Path) -> list[dict[str, Any]]:
    """The measured cells of a ``bench_fairness_map`` result: burst, smalls, cap, arm and the
    median of each of :data:`STATS`."""
    try:
        doc = json.loads(path.read_text())
        summary = doc["summary"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"bench_fairness_fidelity: {path} is not a bench_fairness_map "
                         f"result ({e!r})") from None
    return [{"burst": int(c["burst"]), "smalls": int(c["smalls"]), "cap_Bps": c["cap_Bps"],
             "arm": c["arm"], "measured": {s: float(c[s]["median"]) for s in STATS}}
            for c in summary]


def simulate_cell(cell: dict[str, Any], costs: Any) -> dict[str, float]:
    """The four percentiles of ``cell``'s workload and arm in the simulator."""
    from delivery.sending_sim import BURST, STREAM, PathWorkload, percentiles, simulate_path
    from tests.test_fairness import arm_configs

    cfg = arm_configs(cell["cap_Bps"] or 0.0, cell["smalls"])[cell["arm"]]
    rec = simulate_path(PathWorkload.burst_map(cell["burst"], cell["smalls"]), cfg, costs)
    small = percentiles(rec.delays_ms(kind=STREAM))
    big = percentiles(rec.delays_ms(kind=BURST))
    return {"small_p50_ms": small["p50"], "small_p95_ms": small["p95"],
            "big_p50_ms": big["p50"], "big_p95_ms": big["p95"]}


def _costs(x: Any) -> Any:
    from delivery.sending_sim import SendingCosts

    a0, a1, p0, p1, c = (math.exp(v) for v in x)
    return SendingCosts(accept_fixed_s=a0, accept_per_message_s=a1, push_fixed_s=p0,
                        push_per_message_s=p1, contention_s=c)


def fit(cells: list[dict[str, Any]]) -> tuple[Any, float]:
    """Nelder-Mead over the log of the five constants: the squared log ratios of the unshaped
    cells' percentiles."""
    from scipy.optimize import minimize

    train = [c for c in cells if c["arm"] == "unshaped"]

    def loss(x: Any) -> float:
        costs = _costs(x)
        return sum(math.log(sim[s] / c["measured"][s]) ** 2
                   for c in train for sim in [simulate_cell(c, costs)] for s in STATS)

    x0 = [math.log(v) for v in FIT_START]
    res = minimize(loss, x0, method="Nelder-Mead",
                   options={"maxiter": 400, "xatol": 1e-3, "fatol": 1e-4})
    log(f"  fit: loss {res.fun:.4f} after {res.nfev} evaluations")
    return _costs(res.x), float(res.fun)


def write_costs(costs: Any, loss: float, measured: Path, cells: int) -> Path:
    from delivery.sending_sim import COSTS_PATH

    doc = {
        "about": "Service times of the controller's sending path for delivery/sending_sim.py "
                 "(seconds). Fitted, not measured one by one: least squares on the log of "
                 "each tenant's p50 and p95 in the unshaped cells of the real fairness map; "
                 "the shaped cells are the validation (bench/bench_fairness_fidelity.py).",
        "source": {"measured": str(measured.relative_to(ROOT)) if measured.is_relative_to(ROOT)
                   else str(measured),
                   "cells": cells, "loss": round(loss, 6),
                   "command": "python bench/bench_fairness_fidelity.py --fit",
                   "date": dt.date.today().isoformat()},
        "choices": {"tick_s": "TenantShaper's default pump tick (delivery/fairness.py)"},
        "costs": {k: float(f"{v:.6g}") for k, v in costs.to_dict().items()},
    }
    COSTS_PATH.write_text(json.dumps(doc, indent=2) + "\n")
    return COSTS_PATH


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if v >= 10 else f"{v:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true",
                    help="fit the constants on the unshaped cells and write them first")
    ap.add_argument("--quick", action="store_true",
                    help="accepted for bench/run_all.py; the benchmark is quick already")
    ap.add_argument("--measured", type=Path, default=MEASURED,
                    help="a bench_fairness_map result (default: the committed one)")
    args = ap.parse_args()
    from delivery.sending_sim import SendingCosts

    t0 = time.perf_counter()
    cells = load_cells(args.measured)
    log(f"bench_fairness_fidelity: {len(cells)} cells of {args.measured}")
    if args.fit:
        costs, loss = fit(cells)
        log(f"  wrote {write_costs(costs, loss, args.measured, len(cells))}")
    costs = SendingCosts.load()
    rows, out = [], []
    for c in cells:
        sim = simulate_cell(c, costs)
        ratios = {s: sim[s] / c["measured"][s] for s in STATS}
        agree = all(1 / FACTOR <= r <= FACTOR for r in ratios.values())
        role = "fit" if c["arm"] == "unshaped" else "validation"
        out.append({**c, "simulated": sim, "ratio": ratios, "agree": agree, "role": role})
        rows.append([c["burst"], c["smalls"], "-" if c["cap_Bps"] is None
                     else f"{c['cap_Bps'] / 1e3:.0f}", c["arm"],
                     *(f"{_fmt(c['measured'][s])} / {_fmt(sim[s])}" for s in STATS),
                     "yes" if agree else "no"])
    verdict = []
    for c in out:
        if c["arm"] != "on":
            continue
        un = next(u for u in out if u["arm"] == "unshaped" and u["burst"] == c["burst"]
                  and u["smalls"] == c["smalls"])
        m = {w: c["measured"][f"{w}_p95_ms"] / un["measured"][f"{w}_p95_ms"]
             for w in ("small", "big")}
        s = {w: c["simulated"][f"{w}_p95_ms"] / un["simulated"][f"{w}_p95_ms"]
             for w in ("small", "big")}
        verdict.append([c["burst"], c["smalls"], f"{c['cap_Bps'] / 1e3:.0f}",
                        f"{m['small']:.2f} / {s['small']:.2f}",
                        f"{m['big']:.1f} / {s['big']:.1f}",
                        "yes" if (m["small"] < 1) == (s["small"] < 1) else "no"])
    n_fit = [c for c in out if c["role"] == "fit"]
    n_val = [c for c in out if c["role"] == "validation"]
    within = {role: {s: sum(1 for c in group if 1 / FACTOR <= c["ratio"][s] <= FACTOR)
                     for s in STATS} for role, group in (("fit", n_fit), ("validation", n_val))}
    table = md_table(["burst", "small tenants", "G kB/s", "shaping",
                      "small p50 ms, real / sim", "small p95 ms, real / sim",
                      "large p50 ms, real / sim", "large p95 ms, real / sim",
                      f"all within {FACTOR:g}x"], rows)
    table += "\n\n" + md_table(
        ["cells", "cells agreeing", *(f"{s} within {FACTOR:g}x" for s in STATS)],
        [[f"{role} ({len(g)})", sum(c["agree"] for c in g),
          *(within[role][s] for s in STATS)] for role, g in (("fit", n_fit),
                                                              ("validation", n_val))])
    table += "\n\n" + md_table(["burst", "small tenants", "G kB/s",
                                 "small p95, Sincon / unshaped: real / sim",
                                 "large p95, Sincon / unshaped: real / sim",
                                 "same side of 1 (small)"], verdict)
    notes = [f"real: the median over the repetitions of {args.measured.name} (a real "
             "controller, gRPC, broker and agents); sim: delivery/sending_sim.py, "
             "deterministic, with the constants of delivery/sending_costs.json: "
             + ", ".join(f"{k} {v:.3g}" for k, v in costs.to_dict().items()),
             "fit: the unshaped cells the constants were fitted on; validation: the shaped "
             "cells (on: Sincon, a class per tenant; off: one FIFO at G)",
             f"a cell agrees when each of its four percentiles is within {FACTOR:g}x of the "
             "real one"]
    total = time.perf_counter() - t0
    finish("bench_fairness_fidelity",
           {"command": "python bench/bench_fairness_fidelity.py" + (" --fit" if args.fit
                                                                    else ""),
            "settings": {"quick": False, "fit": args.fit, "factor": FACTOR},
            "measured": str(args.measured.relative_to(ROOT) if args.measured.is_relative_to(ROOT)
                            else args.measured), "costs": costs.to_dict(), "cells": out,
            "within": within, "total_s": total}, table, notes, total)


if __name__ == "__main__":
    main()
