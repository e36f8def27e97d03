"""What a channel switch costs (SMART Section VI-A's lossless switch; the switching terms of the
online cost, Section V-D): measured under load on the emulated network and on loopback, and
fitted to seconds per SubscribeInfo and per moved type (:mod:`delivery.switch_cost`).

Each network: a secure Pulsar broker, ``--nodes`` agents in ``--agent-processes`` processes,
the controller, and a steady stream (40 msg/s on 4 RPC and 4 topic background types, 10
msg/s on the types being switched). For each point of
:func:`delivery.switch_cost.default_points` (1..100 types, 1..400 SubscribeInfos per
direction) its types go RPC -> topics -> other topics -> RPC, ``--reps`` times. The
emulated network has the ``godaddy`` scenario's capacities scaled as the testbed scales
them (``payload_scale / time_scale`` = 0.02: C_b 8 Mbit/s, s(n) 20 Mbit/s, C_p 640
concurrent sends).

Writes ``bench/results/bench_switch_cost.json`` (samples, medians, fits per network) and
``envs/dsmd/switching_costs.json`` (the emulated network's fit, loopback's beside it).

Usage: ``python bench/bench_switch_cost.py [--quick] [--networks emulated,loopback]
[--reps 3] [--nodes 64]``. Each network's samples are kept in
``bench/results/switch_cost/<network>.json``; ``--fit-only`` refits those.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, finish, log, machine_info, md_table

from delivery import switch_cost as sc

SCALE = 0.01 / 0.5            # the testbed's payload_scale / time_scale
COSTS = Path(__file__).resolve().parents[1] / "envs" / "dsmd" / "switching_costs.json"
SAMPLES = RESULTS_DIR / "switch_cost"


def _network_args(quick: bool) -> dict:
    from envs.dsmd.scenarios import load_scenario

    s = load_scenario("godaddy")
    return {"controller_bps": s.controller_bw_bps * SCALE,
            "node_bps": s.node_bandwidth_bps * SCALE,
            "max_inflight_sends": int(s.controller_cpu)}


def _points(quick: bool, nodes: int) -> list[sc.SwitchPoint]:
    if quick:
        return [sc.SwitchPoint("k1-d1", 1, 1), sc.SwitchPoint("k4-d2", 4, 2),
                sc.SwitchPoint("k1-d4", 1, 4), sc.SwitchPoint("k8-d1-shared", 8, 1, True)]
    return [sc.SwitchPoint("control", 0, 1), *sc.default_points(nodes)]


def _table(rows: list[dict]) -> str:
    def ms(r: dict, k: str) -> str:
        v, lo, hi = r.get(k), r.get(k + "_min"), r.get(k + "_max")
        if v is None:
            return "-"
        return f"{1e3 * v:.1f} ({1e3 * lo:.1f}-{1e3 * hi:.1f})"

    return md_table(
        ["network", "point", "direction", "types", "SubscribeInfos", "block ms",
         "subscribe ms", "unsubscribe ms", "drain ms", "added delay/msg ms", "p95 during ms"],
        [[r["network"], r["point"], r["direction"], r["types"], r["subscribe_infos"],
          ms(r, "block_s"), ms(r, "subscribe_s"), ms(r, "unsubscribe_s"), ms(r, "drain_s"),
          ms(r, "added_delay_mean_s"), ms(r, "delay_p95_during_s")] for r in rows])


def _fit_line(net: str, f: dict) -> str:
    b = f["block"]
    return (f"{net}: block = {1e3 * b['intercept_s']:.1f} ms + "
            f"{1e3 * b['coef']['subscribe_infos']:.3f} ms/SubscribeInfo "
            f"(+-{1e3 * b['stderr']['subscribe_infos']:.3f}) + "
            f"{1e3 * b['coef']['types']:.3f} ms/moved type (+-{1e3 * b['stderr']['types']:.3f}); "
            f"residual sd {1e3 * b['residual_sd_s']:.1f} ms, R^2 {b['r2']:.3f}, "
            f"{b['points']} medians")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 nodes, 4 small points, 1 rep")
    ap.add_argument("--networks", default="emulated,loopback")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--agent-processes", type=int, default=1)
    ap.add_argument("--fit-only", action="store_true", help="refit the kept samples")
    ap.add_argument("--no-costs", action="store_true",
                    help="do not write envs/dsmd/switching_costs.json")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    nets = [n.strip() for n in args.networks.split(",") if n.strip()]
    nodes = list(range(8 if args.quick else args.nodes))
    reps = 1 if args.quick else args.reps
    points = _points(args.quick, len(nodes))
    load = sc.LoadSpec()
    SAMPLES.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    command = "python bench/bench_switch_cost.py " + shlex.join(argv if argv is not None
                                                                 else sys.argv[1:])
    for net in nets if not args.fit_only else []:
        log(f"== {net}: {len(nodes)} agents, {len(points)} points x {reps} reps")
        with tempfile.TemporaryDirectory(prefix=f"switch-cost-{net}-") as tmp:
            kw = _network_args(args.quick) if net == "emulated" else {}
            res = sc.measure(net, nodes, Path(tmp), points=points, reps=reps, load=load,
                             agent_processes=args.agent_processes, say=log, **kw)
        res.update(network=net, nodes=len(nodes), reps=reps, quick=args.quick,
                   load=load.__dict__, capacities=kw, command=command,
                   machine=sc.machine_facts())
        (SAMPLES / f"{net}{suffix}.json").write_text(json.dumps(res, indent=1, default=float))
    fits, rows, kept = {}, [], {}
    for net in ("emulated", "loopback"):
        f = SAMPLES / f"{net}{suffix}.json"
        if not f.is_file():
            continue
        kept[net] = json.loads(f.read_text())
        fits[net] = sc.fit_costs(kept[net]["samples"])
        rows += [{"network": net, **r} for r in sc.medians(kept[net]["samples"])]
    if not fits:
        log("no samples to fit")
        return 1
    primary = "emulated" if "emulated" in fits else "loopback"
    p = kept[primary]
    setup = {"nodes": p["nodes"], "reps": p["reps"], "load": p["load"],
             "capacities": p["capacities"], "security": "mutual TLS (secure default)",
             "wall_s": p.get("wall_s")}
    setup["runs"] = {n: k["command"] for n, k in kept.items()}
    again = (f"python bench/bench_switch_cost.py --networks {','.join(kept)} --reps "
             f"{p['reps']} --nodes {p['nodes']}")
    doc = sc.costs_document(
        fits[primary], primary, p["machine"], again, setup=setup,
        comparison={n: {"seconds_per_subscribe_info": max(f["block"]["coef"]
                                                          ["subscribe_infos"], 0.0),
                        "seconds_per_moved_type": max(f["block"]["coef"]["types"], 0.0),
                        "fit": f} for n, f in fits.items() if n != primary},
        points=[r for r in rows if r["network"] == primary])
    doc["proposed_weights"] = {"interval_s": 30.0, **sc.online_weights(doc, 30.0),
                               "rule": "seconds / T: a switch holding the sending path tau "
                                       "seconds costs tau / T, priced as that fraction more "
                                       "node traffic"}
    if not args.no_costs and not args.quick:
        COSTS.write_text(json.dumps(doc, indent=1, default=float) + "\n")
        log(f"wrote {COSTS}")
    notes = [_fit_line(n, f) for n, f in fits.items()]
    notes += [f"proposed OnlineCost weights (T = 30 s): w_subscribe "
              f"{doc['proposed_weights']['w_subscribe']:.3g}, w_move "
              f"{doc['proposed_weights']['w_move']:.3g}"]
    finish("bench_switch_cost" + suffix.replace("-", "_"),
           {"fits": fits, "medians": rows, "costs": doc, "machine_run": machine_info()},
           _table(rows), notes, time.perf_counter() - t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
