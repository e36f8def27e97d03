"""A fingerprint of the project's decisions, to show a refactoring changes no behaviour.

``python scripts/behaviour_snapshot.py OUT.json`` records, for the tree it runs in:

- every decision (the channel of every message type) of every baseline and of the shipped
  static bundle (``checkpoints/default``) on every ``godaddy`` test window, and each
  window's cost terms;
- every interval's cost terms of the static re-planners, the tuned-knob heuristic, the
  hindsight oracle and an online bundle (``make run``'s, else a seeded untrained actor) on
  the first ``godaddy_online`` test trace;
- the ``tiny_exact`` table (every baseline and the exact optimum on every ``tiny`` window);
- the tables of small runs of the three reproduction entry points (``sweep.py``,
  ``trees.py``, ``shaping.py``), timing columns left out.

Two snapshots are compared with ``python scripts/behaviour_snapshot.py --diff A.json B.json``
(exit status 1 when any entry differs).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _h(a: object) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def _cfg(config: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "configs"), version_base=None):
        return compose(config, overrides=overrides)


def static_godaddy(out: dict) -> None:
    from agents.config import scenario_spec, to_dict
    from agents.learned import ActorPolicy
    from agents.registry import make_policies
    from envs.dsmd.problems import build_problems

    try:  # the bundle loader moves with the refactoring; either place will do
        from serving.bundles.static import load_bundle  # type: ignore
    except ImportError:
        from agents.bundle import load_bundle  # type: ignore

    cfg = _cfg("train", ["env=dsmd", "scenario=godaddy", "logger=none", "progress=false"])
    ps = build_problems(scenario_spec(cfg), cache_dir=cfg.paths.data_dir,
                        batch_key=cfg.env.batch_key)
    insts = ps.instances("test")
    names = [p for p in cfg.baseline.policies if p != "exact"]
    pols = make_policies(names, ps, to_dict(cfg.baseline.params))
    from serving.bundles.signing import BundleTrust

    trust = BundleTrust.from_security(keys=[ROOT / "configs/keys/example-bundle.pub"])
    pols.append(ActorPolicy.from_bundle(load_bundle(ROOT / "checkpoints/default", trust=trust),
                                        name="learned"))
    for pol in pols:
        pol.reset(0)
        for w, inst in enumerate(insts):
            ch = np.asarray(pol.assign(inst))
            out[f"godaddy/{pol.name}/w{w}/decisions"] = _h(ch)
    out["godaddy/windows"] = len(insts)


def _online_bundle() -> Path:
    """``make run``'s online bundle if there is one, else a seeded (untrained) actor over the
    default executor, exported to a temporary directory: the same weights in every run."""
    trained = ROOT / "checkpoints/godaddy_online__ddpg__0"
    if (trained / "metadata.json").is_file():
        return trained
    import tempfile

    import torch

    from agents.bundle_export import export_online_bundle
    from envs.dsmd.online import OnlineCost
    from envs.dsmd.online_control import OBS_SIZE, KnobMap

    torch.manual_seed(0)
    actor = torch.nn.Sequential(torch.nn.Linear(OBS_SIZE, 3), torch.nn.Tanh())
    return export_online_bundle(actor, KnobMap(), OnlineCost(),
                                Path(tempfile.mkdtemp(prefix="snapshot-")) / "online")


def online_godaddy(out: dict) -> None:
    from agents.config import to_dict
    from agents.online_eval import DeciderSpec, evaluate_online
    from agents.online_job import open_online_dataset
    from envs.dsmd.online import OnlineCost

    cfg = _cfg("train", ["env=online", "logger=none", "progress=false"])
    ds = open_online_dataset(cfg)
    cost = OnlineCost.from_dict(to_dict(cfg.env.cost))
    tid = ds.traces("test")[0].id
    specs = [DeciderSpec.make(n, "static") for n in ("rpc", "vita", "greedy")]
    specs.append(DeciderSpec.make("tuned", "online_greedy", headroom=0.2, horizon=4.0,
                                  alpha=0.5))
    specs.append(DeciderSpec.make("hindsight", "oracle"))
    specs.append(DeciderSpec.make("learned", "learned", bundle=str(_online_bundle())))
    df = evaluate_online(ds, [tid], specs, cost, windows=40, progress=False)
    num = df.select_dtypes("number")
    for name, g in df.groupby("policy", sort=True):
        out[f"online/{name}/intervals"] = _h(num.loc[g.index].to_numpy(np.float64))


def tiny_exact(out: dict) -> None:
    from agents.config import scenario_spec, to_dict
    from agents.evaluation import evaluate_policies
    from agents.registry import make_policies
    from envs.dsmd.problems import build_problems

    cfg = _cfg("train", ["env=dsmd", "experiment=tiny_exact", "logger=none", "progress=false"])
    ps = build_problems(scenario_spec(cfg), cache_dir=cfg.paths.data_dir,
                        batch_key=cfg.env.batch_key)
    pols = make_policies(list(cfg.baseline.policies), ps, to_dict(cfg.baseline.params))
    df = evaluate_policies(pols, ps.instances("all"), progress=False)
    cols = [c for c in df.columns if c not in ("wall_s", "decide_s", "time_s")
            and "time" not in c and "wall" not in c]
    for name, g in df.groupby("policy", sort=True):
        num = g[cols].select_dtypes("number").to_numpy(np.float64)
        out[f"tiny_exact/{name}"] = _h(np.round(num, 9))


# entry point, small overrides, and the CSV files to fingerprint as (label, file name); the
# tree sub-problem's older names (multicast.py, sessions) are used when a tree has them, so a
# snapshot of an older tree lines up with a newer one
_OLD = not (ROOT / "trees.py").exists()
TABLE_RUNS = {
    "sweep": ("evaluate.py" if (ROOT / "evaluate.py").exists() else "sweep.py",
              ["scenario=tiny", "sweep.multicast_shares=[0.0,0.5,1.0]"],
              [("summary", "sweep_summary.csv"), ("per_window", "sweep_per_window.csv")]),
    "trees": ("multicast.py" if _OLD else "trees.py",
              ["seeds=[0]", f"{'sessions.num_sessions' if _OLD else 'groups.num_groups'}=20",
               "lambdas=[1,10]"],
              [("summary", "summary.csv"), ("groups", "sessions.csv" if _OLD else "groups.csv"),
               ("fig8", "fig8.csv")]),
    "shaping": ("shaping.py", ["tenants=[1,2]", "fig5_tenants=2", "seeds=1",
                               "sim.duration_s=2"],
                [("runs", "runs.csv"), ("summary", "summary.csv")]),
}


def tables(out: dict) -> None:
    import subprocess
    import tempfile

    import pandas as pd

    for name, (script, overrides, files) in TABLE_RUNS.items():
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, str(ROOT / script), *overrides, "logger=none",
                            "++progress=false", f"hydra.run.dir={tmp}"], check=True, cwd=ROOT,
                           stdout=subprocess.DEVNULL)
            for label, f in files:
                df = pd.read_csv(Path(tmp) / f)
                keep = [c for c in df.columns
                        if not (c.endswith("_s") or "time" in c or "wall" in c)]
                # values only: a renamed column (session -> group) is the same table
                out[f"table/{name}/{label}"] = hashlib.sha256(
                    df[keep].round(9).to_csv(index=False, header=False).encode()
                ).hexdigest()[:16]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--diff"]:
        a, b = (json.loads(Path(p).read_text()) for p in argv[1:3])
        bad = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        for k in bad:
            print(f"DIFFERS {k}: {a.get(k)} != {b.get(k)}")
        print(f"{len(a.keys() | b.keys()) - len(bad)} entries identical, {len(bad)} differ")
        return 1 if bad else 0
    sys.path.insert(0, str(ROOT))
    out: dict = {}
    for part in (static_godaddy, online_godaddy, tiny_exact, tables):
        part(out)
        print(f"[snapshot] {part.__name__}: {len(out)} entries", flush=True)
    Path(argv[0]).write_text(json.dumps(out, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
