"""The main job (``python train.py``): at this stage, evaluate every baseline and the exact
optimum (where it is solvable) on the held-out windows of the default scenario, print the
comparison table, write CSV and PNG, and record an MLflow run."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from envs.dsmd.errors import DSMDError
from envs.dsmd.problems import build_problems

from .config import output_dir, scenario_spec, to_dict
from .evaluation import evaluate_policies
from .registry import make_policies
from .reporting import report
from .seeding import seed_everything
from .tracking import tracked_run

__all__ = ["run_main"]


def run_main(cfg: DictConfig) -> dict[str, Any]:
    seed_everything(int(cfg.seed))
    spec = scenario_spec(cfg)
    out = output_dir(cfg)
    ps = build_problems(spec, cache_dir=cfg.paths.data_dir, batch_key=cfg.env.batch_key)
    split = str(cfg.eval_split)
    instances = ps.instances(split)
    if not instances:
        raise DSMDError(f"split '{split}' of scenario '{spec.name}' has no windows "
                        f"({ps.parsed.num_windows} in the trace); lengthen duration_s or use "
                        "eval_split=all")
    policies = make_policies(list(cfg.baseline.policies), ps, to_dict(cfg.baseline.params))
    run_name = cfg.get("run_name") or f"{spec.name}__baselines__{cfg.seed}"
    tags = {"scenario": spec.name, "task": "baselines", "split": split, "seed": str(cfg.seed)}
    print(f"[main] scenario={spec.name}: {len(ps.dataset.trace)} messages, "
          f"{ps.parsed.num_windows} windows of {spec.interval_s:g}s "
          f"({len(instances)} in '{split}'), {ps.catalog_size} message types, "
          f"N={ps.num_nodes}, K={spec.num_topics}; output: {out}", flush=True)
    with tracked_run(cfg, run_name=run_name, tags=tags) as log:
        per_window = evaluate_policies(policies, instances, progress=bool(cfg.progress))
        summary = report(log, per_window, out, spec, split, "Baselines")
        for row in summary.itertuples(index=False):
            log.metrics({f"{row.policy}/total_node_mbps": row.total_node_mbps,
                         f"{row.policy}/ctrl_traffic_mbps": row.ctrl_traffic_mbps,
                         f"{row.policy}/ctrl_sends": row.ctrl_sends,
                         f"{row.policy}/feasible_frac": row.feasible_frac})
    print(f"[main] wrote {out}/summary.csv, comparison.png"
          + (f"; MLflow run {log.run_id}" if log.run_id else ""), flush=True)
    return {"summary": summary, "per_window": per_window, "run_id": log.run_id,
            "output_dir": out, "problems": ps}
