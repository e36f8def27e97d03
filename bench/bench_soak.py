"""The long fault-injection soak: ``python soak.py`` (configs/soak.yaml) for several seeds,
each ``--minutes`` of load and faults, and one table of what the nemesis did and what the
checker found.

Per seed: faults injected (by kind), messages accepted through the ingress and "maybe"
(a call that failed: stored or not), (node, message) destinations, violations (applied
twice or out of order, applied where never sent), lost, stale final configurations (the
goal of all three is 0), recovery per fault (heal -> every message generated while it was in
place in effect at every destination), and delivery delay of the messages generated during
faults vs calm. Each soak runs its own broker, controller and 8 agents in an emulated
network (needs root); they share this machine with nothing else of the benchmark.

Usage: ``python bench/bench_soak.py [--seeds 1,2,3] [--minutes 60] [--quick] [--name N]
[--out DIR [--resume]]`` (``--quick``: 3 minutes per seed, for a try; ``--name``: the
result's name, default ``bench_soak``, so runs of different lengths keep their own section;
``--resume``: a seed whose ``DIR/seed<N>/soak.json`` already holds a verdict of the same
length is read, not run again, so an interrupted multi-seed run goes on where it stopped;
each seed's commit is kept beside it in ``bench_run.json`` and in the result).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import finish, log, machine_info, md_table

ROOT = Path(__file__).resolve().parents[1]


def _resumed(seed: int, minutes: float, out: Path) -> dict | None:
    """The finished soak of ``seed`` under ``out``, or None if it has to run (``--resume``)."""
    path = out / "soak.json"
    if not path.exists():
        return None
    r = json.loads(path.read_text())
    if "verdict" not in r:
        raise SystemExit(f"{path} holds a soak that failed before its verdict: move it away "
                         f"to run seed {seed} again (nothing was run)")
    if int(r["config"]["duration_s"]) != int(minutes * 60) or int(r["config"]["seed"]) != seed:
        raise SystemExit(f"{path} is seed {r['config']['seed']} for "
                         f"{r['config']['duration_s']} s, not seed {seed} for "
                         f"{int(minutes * 60)} s (nothing was run)")
    meta = out / "bench_run.json"
    r |= json.loads(meta.read_text()) if meta.exists() else {"commit": "unknown"}
    log(f"soak seed {seed}: read from {path} (measured at {r['commit']})")
    return r


def _one(seed: int, minutes: float, out: Path) -> dict:
    if (out / "soak.json").exists():
        raise SystemExit(f"{out} holds an earlier soak's soak.json: give --out a new or empty "
                         f"directory (nothing was run)")
    log(f"soak seed {seed}: {minutes:g} min of load and faults")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "soak.py", f"seed={seed}",
                           f"duration_s={int(minutes * 60)}", f"out_dir={out}",
                           "logger.enabled=false"], cwd=ROOT, check=False)
    path = out / "soak.json"
    if not path.exists():
        raise SystemExit(f"soak seed {seed} failed (exit {done.returncode}) without a verdict; "
                         f"see {out}")
    r = json.loads(path.read_text())
    if "verdict" not in r:
        raise SystemExit(f"soak seed {seed} failed before its verdict: {r.get('error')}; "
                         f"see {out}")
    r["wall_s"] = time.perf_counter() - t0
    r["commit"] = machine_info()["git_commit"]
    (out / "bench_run.json").write_text(json.dumps({"commit": r["commit"],
                                                    "wall_s": r["wall_s"]}))
    return r


def _fmt(x: float | None, f: str = "{:.1f}") -> str:
    return "-" if x is None else f.format(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="where the soaks write (default: a temp dir)")
    ap.add_argument("--resume", action="store_true",
                    help="read the seeds --out already holds instead of running them again")
    ap.add_argument("--name", default="bench_soak",
                    help="the result's name (bench/results/<name>.json)")
    args = ap.parse_args()
    minutes = 3.0 if args.quick else args.minutes
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.resume and not args.out:
        ap.error("--resume reads the seeds of an earlier --out: give it")
    base = Path(args.out or tempfile.mkdtemp(prefix="bench_soak_"))
    t0 = time.perf_counter()
    runs = {}
    for s in seeds:
        runs[s] = ((_resumed(s, minutes, base / f"seed{s}") if args.resume else None)
                   or _one(s, minutes, base / f"seed{s}"))
    commits = {str(s): r["commit"] for s, r in runs.items()}
    rows, kinds_total = [], Counter()
    recovery: dict[str, list[float]] = {}
    for s, r in runs.items():
        v, m, d = r["verdict"], r["messages"], r["delay_ms"]
        kinds_total.update(r["injected"])
        for f in r["faults"]:
            if f.get("recovery_s") is not None:
                recovery.setdefault(f["kind"], []).append(f["recovery_s"])
        rows.append([s, f"{r['load_s'] / 60:.0f}", sum(r["injected"].values()),
                     f"{m['accepted']:,}", m["maybe"], f"{v['messages']:,}",
                     f"{v['violations']} / {v['lost']} / {v['stale']} / {v.get('stuck', 0)}",
                     len(r.get("errors") or []),
                     f"{_fmt(d['calm']['p50'])} / {_fmt(d['calm']['p99'])}",
                     f"{_fmt(d['fault']['p50'])} / {_fmt(d['fault']['p95'])} / "
                     f"{_fmt(d['fault']['p99'])} / {_fmt(d['fault']['max'])}",
                     f"{r['settle_s']:.0f}"])
    table = md_table(["seed", "load min", "faults", "accepted", "maybe", "destinations",
                      "violations / lost / stale / stuck", "errors", "calm delay p50 / p99 ms",
                      "fault delay p50 / p95 / p99 / max ms", "settle s"], rows)
    rec_rows = [[k, kinds_total.get(k, 0), len(xs), f"{statistics.median(xs):.1f}",
                 f"{max(xs):.1f}"] for k, xs in sorted(recovery.items())]
    table += "\n\n" + md_table(["fault kind", "injected", "measured", "recovery p50 s",
                                "recovery max s"], rec_rows)
    notes = [f"{len(seeds)} seed(s) x {minutes:g} min of load (20 messages/s in Configure calls "
             f"of 5, 4 types over 8 nodes, 6 resources per type); nemesis: a fault every "
             f"10 s on average (exponential gaps), each 3-20 s, at most 2 at once, never "
             f"two of a kind",
             "violations = applied twice or out of order or where never sent; lost = neither "
             "applied nor superseded by a newer applied message; stale = a final "
             "configuration not the last one requested (each over every (node, message) of "
             "the accepted and the stored 'maybe' requests); stuck = stored by the controller "
             "and still unconfirmed after the settle timeout",
             "recovery = heal -> every message generated while the fault was in place in "
             "effect at every destination (overlapping faults share it; no figure when no "
             "message was generated during the fault, as for most controller kills, or "
             "when one never took effect)",
             "errors (the goal is 0) = a restart that failed for a minute, an injection or "
             "heal that failed, a load that died",
             "delay = generation -> in effect at the node (its own apply, or a newer "
             "message's of the same resource); 'fault' = generated while a fault was in "
             "place",
             "broker, controller, 8 agents and the driver share this 2-core machine; not "
             "pinned"]
    if len(set(commits.values())) > 1:
        notes.append("seeds measured at different commits: " + ", ".join(
            f"seed {s} at {c}" for s, c in commits.items()))
    cmd = (f"python bench/bench_soak.py --seeds {args.seeds} --minutes {minutes:g}"
           + (f" --name {args.name}" if args.name != "bench_soak" else ""))
    cmd += (f" --out {args.out} --resume" if args.resume else "")
    payload = {"seeds": seeds, "minutes": minutes, "command": cmd, "commits": commits,
               "runs": {str(s): {k: r.get(k) for k in ("injected", "messages", "verdict",
                                                       "delay_ms", "settle_s", "load_s",
                                                       "notes", "error", "errors")}
                        | {"faults": r["faults"]} for s, r in runs.items()}}
    finish(args.name, payload, table, notes, time.perf_counter() - t0)
    if not all(r["verdict"]["ok"] and not r.get("error") for r in runs.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
