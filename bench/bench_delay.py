"""Calibrate the delay model (:mod:`envs.dsmd.delay`) on the emulated network.

For each constrained resource, the same workload is replayed on the testbed
(``testbed.py``: the real broker, agents, controller and shaped links) at several capacities,
so that the resource's utilisation sweeps from light to overloaded while the rest stays
light:

* ``bw`` (``C_b``): RPC only (every destination's copy crosses the controller's link), Fig. 9's
  128 VPCs, the controller's link shaped to each of ``BW_POINTS`` (wire bit/s);
* ``node`` (``s(n)``): VITA (MQ only: every node receives all of its topics), the same
  workload, every node's link shaped to each of ``NODE_POINTS``.

Each run records the measured delivery delay (p50, p95), the wire bytes and queues of the
links, the idle control traffic of the controller's link (``network.settle_s``) and, for
every decision, the delay model's input (``delay_loads.json``: the loads the simulator
computes from the same channels and rates). The fit (:func:`envs.dsmd.delay.fit_delay_model`)
chooses the model's constants to match the measured p50 and p95 in log space, with the
control traffic taken as measured, and reports each run's prediction beside its measurement.

Usage::

    python bench/bench_delay.py            # run the sweeps (about 2 min per run), then fit
    python bench/bench_delay.py --fit-only # refit the runs already under --out
    python bench/bench_delay.py --write    # and write envs/dsmd/delay_model.json
    python bench/bench_delay.py --fidelity OUT [OUT ...]   # the model against testbed outputs

Needs root (network namespaces). C_p is not swept: no testbed run has ever waited for it
(the controller's in-flight limit), so its constants stay the documented defaults.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, finish, log, md_table

BW_POINTS = [16e6, 8e6, 5.5e6, 4.5e6, 3.6e6, 3.0e6]
NODE_POINTS = [2e6, 4e5, 2e5, 1.3e5, 1e5, 7e4, 5e4]
SWEEPS = {"bw": ("rpc", "network.controller_bps", BW_POINTS),
          "node": ("vita", "network.node_bps", NODE_POINTS)}
COMMON = ["figures=[fig9]", "fig9.vpcs=[128]", "fig9.windows=1", "time_scale=1.0",
          "payload_scale=0.01", "network.settle_s=4", "repeats=1"]


def run_point(resource: str, value: float, rep: int, out: Path) -> Path:
    policy, key, _ = SWEEPS[resource]
    d = out / f"{resource}_{value:.0f}_r{rep}"
    if (d / "fig9.csv").is_file():
        log(f"  {d.name}: done before, kept")
        return d
    cmd = [sys.executable, str(ROOT / "testbed.py"), *COMMON, f"policies=[{policy}]",
           f"{key}={value:.0f}", f"out_dir={d}", f"first_repeat={rep}"]
    log(f"  {d.name}: {' '.join(cmd[2:])}")
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   stderr=(d.parent / f"{d.name}.log").open("w"))
    log(f"  {d.name}: {time.perf_counter() - t0:.0f} s")
    return d


def collect(out: Path) -> list[dict[str, Any]]:
    """One sample per finished run: its measurement, configuration and delay loads."""
    import pandas as pd

    samples = []
    for d in sorted(out.glob("*_r*")):
        if not (d / "fig9.csv").is_file():
            continue
        resource, value = d.name.split("_")[0], float(d.name.split("_")[1])
        row = pd.read_csv(d / "fig9.csv").iloc[0].to_dict()
        loads = [json.loads(f.read_text()) for f in sorted(d.glob("runs/*/delay_loads.json"))]
        if not loads:
            continue
        samples.append({"run": d.name, "resource": resource, "value": value,
                        "measured": row, "loads": loads[0]})
    return samples


def _rel(p: Path) -> str:
    """``p`` relative to the repository where it is inside it (for the recorded command)."""
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def _runs_table(testbed_out: Path):
    """A testbed output's runs: ``summary.csv`` (every figure) or a kept ``fig9.csv``."""
    import pandas as pd

    runs = [testbed_out / f for f in ("summary.csv", "fig9.csv")]
    return pd.read_csv(next((f for f in runs if f.is_file()), runs[-1]))


def fidelity(testbed_outs: Path | list[Path]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The calibrated model's p95 beside the measured one for every run of a finished
    testbed output (``summary.csv`` or ``fig9.csv``, and each run's
    ``delay_loads_realised.json``, the intervals as delivered, or, where a run has none,
    ``delay_loads.json``, the boundary decisions'), and per point (a Fig. 9 VPC count, or
    Fig. 10) Spearman's rho between them over the policies, how many are within a factor
    of 2, and whether the point is at saturation: most of its runs overflowed a shaped
    link's queue (``link_controller_drops`` or ``link_node_drops`` above 0)."""
    import numpy as np
    import pandas as pd
    from scipy.stats import spearmanr

    from envs.dsmd.delay import load_delay_model, predict_sample, testbed_sample

    model = load_delay_model()
    outs = [testbed_outs] if isinstance(testbed_outs, Path) else list(testbed_outs)
    rows = []
    for testbed_out, r in ((o, r) for o in outs for _, r in _runs_table(o).iterrows()):
        d = testbed_out / "runs" / f"{r['label'].replace('/', '_')}_{r['policy']}_r{r['repeat']}"
        # the intervals as delivered where the run kept them, else the boundary decisions'
        f = next((f for f in (d / "delay_loads_realised.json", d / "delay_loads.json")
                  if f.is_file()), None)
        if f is None:
            continue
        s = testbed_sample(r.to_dict(), json.loads(f.read_text()), d.name, "bw")
        p = predict_sample(model, s)
        drops = sum(int(r.get(k, 0) or 0) for k in ("link_controller_drops",
                                                     "link_node_drops"))
        rows.append({"point": r["label"], "policy": r["policy"], "repeat": int(r["repeat"]),
                     "measured_p95_s": s.measured_p95_s, "predicted_p95_s": p["delay_p95_s"],
                     "bw_util": p["bw_util"], "wire_util": s.wire_util,
                     "link_drops": drops, "loads": f.name})
    out: dict[str, Any] = {}
    t = pd.DataFrame(rows)
    if t.empty:
        raise SystemExit(f"no testbed run with delay loads under {[str(o) for o in outs]}")
    kind = {"delay_loads_realised.json": "as delivered",
            "delay_loads.json": "boundary decisions"}
    for (point, loads), g in t.groupby(["point", "loads"]):  # never mix the two kinds
        med = g.groupby("policy")[["measured_p95_s", "predicted_p95_s"]].median()
        ratio = med.predicted_p95_s / med.measured_p95_s
        out[f"{point} ({kind.get(str(loads), loads)})"] = {
            "spearman": float(spearmanr(med.measured_p95_s, med.predicted_p95_s).statistic)
            if len(med) > 2 else float("nan"),
            "within_2x": int(((ratio >= 0.5) & (ratio <= 2)).sum()), "policies": len(med),
            "ratio_min": float(np.min(ratio)), "ratio_max": float(np.max(ratio)),
            # a shaped link's drop-tail queue overflowed: the point is at saturation there
            "saturated_runs": int((g.link_drops > 0).sum()), "runs": len(g),
            "saturated": bool((g.link_drops > 0).sum() * 2 > len(g))}
    return rows, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "outputs" / "bench_delay"))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--resources", default="bw,node")
    ap.add_argument("--fit-only", action="store_true")
    ap.add_argument("--write", action="store_true", help="write envs/dsmd/delay_model.json")
    ap.add_argument("--fidelity", metavar="TESTBED_OUT", nargs="+",
                    help="instead: the calibrated model against finished testbed outputs")
    args = ap.parse_args(argv)
    if args.fidelity:
        rows, points = fidelity([Path(p) for p in args.fidelity])
        table = md_table(["point", "policy", "repeat", "measured p95 ms", "predicted p95 ms",
                          "link drops"],
                         [(r["point"], r["policy"], r["repeat"],
                           f"{1e3 * r['measured_p95_s']:.0f}",
                           f"{1e3 * r['predicted_p95_s']:.0f}", r["link_drops"])
                          for r in rows])
        notes = [f"{k}: Spearman {v['spearman']:.2f} over {v['policies']} policies; "
                 f"{v['within_2x']} within 2x (predicted / measured "
                 f"{v['ratio_min']:.2f}-{v['ratio_max']:.2f}); "
                 f"{'at saturation' if v['saturated'] else 'below saturation'} "
                 f"({v['saturated_runs']} of {v['runs']} runs overflowed a link's queue)"
                 for k, v in points.items()]
        finish("bench_delay_fidelity",
               {"runs": rows, "points": points,
                "testbed_out": [str(p) for p in args.fidelity],
                "command": "python bench/bench_delay.py --fidelity " + " ".join(
                    _rel(Path(p)) for p in args.fidelity)}, table, notes, 0.0)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if not args.fit_only:
        for rep in range(args.repeats):
            for res in args.resources.split(","):
                for v in SWEEPS[res][2]:
                    try:
                        run_point(res, v, rep, out)
                    except subprocess.CalledProcessError as e:
                        log(f"  {res} {v:.0f}: testbed failed ({e.returncode}); see its log")
    from envs.dsmd.delay import (
        DELAY_MODEL,
        DelayModel,
        fit_delay_model,
        measured_hold,
        testbed_sample,
    )

    raw = collect(out)
    if not raw:
        log(f"no finished runs under {out}")
        return 1
    samples = [testbed_sample(r["measured"], r["loads"], r["run"], r["resource"],
                              **{("controller_bps" if r["resource"] == "bw" else "node_bps"):
                                 r["value"]}) for r in raw]
    # the sending path's hold is measured (bench_switch_cost.py), not fitted
    model, report = fit_delay_model(samples, start=DelayModel(**measured_hold()))
    rows = [(r["run"], r["resource"], f"{r['util']:.2f}", f"{r['wire_util']:.2f}",
             f"{1e3 * r['measured_p50_s']:.0f}", f"{1e3 * r['predicted_p50_s']:.0f}",
             f"{1e3 * r['measured_p95_s']:.0f}", f"{1e3 * r['predicted_p95_s']:.0f}")
            for r in report["runs"]]
    table = md_table(["run", "resource", "model utilisation", "wire utilisation",
                      "measured p50 ms", "predicted p50 ms", "measured p95 ms",
                      "predicted p95 ms"], rows)
    m = model
    notes = [f"workload: Fig. 9's 128 VPCs (godaddy, 350 agents), 2 intervals of 30 s in real "
             f"time, payload x0.01, settled before each run; bw: RPC only, C_b shaped to "
             f"{', '.join(f'{v / 1e6:g}' for v in BW_POINTS)} Mbit/s on the wire; node: VITA, "
             f"every s(n) shaped to {', '.join(f'{v / 1e3:g}' for v in NODE_POINTS)} kbit/s; "
             f"one run per point ({args.out})",
             "utilisation: the model's (modelled load plus control traffic, over the run's "
             "capacity) and the wire's (bytes that crossed the link over the run; "
             "retransmissions included, so above 1 when the link drops)",
             f"fitted: base {1e3 * m.base_s:.0f} ms; C_b kappa {m.controller_bw.kappa:.1f}, "
             f"wait exponent {m.controller_bw.wait_exponent:.2f}, wire scale "
             f"{m.controller_bw.scale:.2f}; s(n) kappa {m.node.kappa:.1f}, wait exponent "
             f"{m.node.wait_exponent:.2f}, control traffic {m.node_control_bps:.0f} bit/s "
             f"(model units); measured: C_b control traffic "
             f"{m.control_wire_bps_per_node:.0f} bit/s per agent on the wire, at payload and "
             f"capacities x{m.calibration_scale:g}; C_p not swept",
             f"log-space RMS error: p50 {report['rms_log_p50']:.2f}, "
             f"p95 {report['rms_log_p95']:.2f}; within 2x: {report['within_2x_p95']} of "
             f"{len(samples)} p95s; Spearman (p95): {report['spearman_p95']:.2f}"]
    if args.write:
        DELAY_MODEL.write_text(json.dumps({"model": model.to_dict()}, indent=1) + "\n")
        notes.append(f"wrote {DELAY_MODEL.relative_to(ROOT)}")
    finish("bench_delay", {"runs": report["runs"], "model": model.to_dict(),
                           "fit": {k: v for k, v in report.items() if k != "runs"}},
           table, notes, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
