"""``python ablation.py study=NAME``: the ablation table of the online policy, from MLflow.

An ablation study is a Hydra multirun of ``train.py`` over ``+ablation=<variant>`` (one
design choice changed per variant, ``configs/ablation/``) and seeds, every run tagged
``study=NAME`` (``make ablation``). This job queries those runs by their tags
(``tags.study``, ``tags.task = 'train_online'``, finished only), and per variant reports over
seeds the mean and 95% t-interval of the learned policy's test cost, regret against the
hindsight oracle, the share of the headroom it closes, its violated intervals and
switching, and on validation its start (the cloned actor) against the selected weights
(``improved``: seeds whose selected weights beat the start). Tables (CSV, Markdown) and a
plot go to the output directory and to an MLflow run of their own (``task =
ablation_table``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from omegaconf import DictConfig

from envs.dsmd.errors import DSMDError
from envs.stats import ci95

from .config import output_dir
from .tracking import tracked_run

__all__ = ["METRICS", "ablation_runs", "ablation_table", "run_ablation_table"]

#: table column -> MLflow metric (``{p}``: the learned policy's name, the run's agent)
METRICS = {"test_cost": "{p}/cost", "regret_pct": "{p}/regret_pct",
           "closed_pct": "{p}/closed_pct", "redundancy_ratio": "{p}/redundancy_ratio",
           "subscribe_infos": "{p}/subscribe_infos", "moved_types": "{p}/moved_types",
           "bw_violated_pct": "{p}/bw_violated_pct", "cpu_violated_pct": "{p}/cpu_violated_pct",
           "node_violated_pct": "{p}/node_violated_pct",
           "teacher_test_cost": "online_greedy/cost", "oracle_test_cost": "oracle/cost",
           "val_start_cost": "val/start/cost", "val_best_cost": "val/best_cost",
           "val_final_cost": "val/final/cost"}


def ablation_runs(tracking_uri: str, experiment: str, study: str) -> pd.DataFrame:
    """One row per finished training run of ``study``: its variant, seed and metrics."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise DSMDError(f"MLflow experiment {experiment!r} not found at {tracking_uri}")
    q = (f"tags.study = '{study}' and tags.task = 'train_online' and "
         "attributes.status = 'FINISHED'")
    runs = client.search_runs([exp.experiment_id], q, max_results=5000)
    if not runs:
        raise DSMDError(f"no finished online training run tagged study={study!r} in "
                        f"experiment {experiment!r} ({tracking_uri})")
    rows = []
    for r in runs:
        t, m = r.data.tags, r.data.metrics
        p = t.get("agent", "ddpg")
        row = {"run_id": r.info.run_id, "variant": t.get("variant", "base"),
               "seed": int(t.get("seed", -1))}
        row.update({k: m.get(v.format(p=p), math.nan) for k, v in METRICS.items()})
        rows.append(row)
    return pd.DataFrame(rows).sort_values(["variant", "seed"]).reset_index(drop=True)


def ablation_table(runs: pd.DataFrame, order: list[str] | None = None) -> pd.DataFrame:
    """Per variant: seeds, mean and 95% interval over seeds of each metric, and the seeds
    whose selected weights beat their cloned start on validation."""
    out = []
    for v, g in runs.groupby("variant", sort=False):
        row: dict[str, Any] = {"variant": v, "seeds": len(g)}
        for c in ("test_cost", "regret_pct", "closed_pct", "redundancy_ratio",
                  "subscribe_infos", "moved_types", "bw_violated_pct", "cpu_violated_pct",
                  "node_violated_pct", "val_start_cost", "val_best_cost", "teacher_test_cost"):
            x = g[c].dropna().to_numpy(np.float64)
            row[c] = float(x.mean()) if x.size else math.nan
            if c in ("test_cost", "regret_pct", "closed_pct"):
                row[f"{c}_ci95"] = ci95(x)
        row["improved"] = int((g.val_best_cost < g.val_start_cost - 1e-12).sum())
        row["final_improved"] = int((g.val_final_cost < g.val_start_cost - 1e-12).sum())
        out.append(row)
    df = pd.DataFrame(out)
    if order:
        rank = {v: i for i, v in enumerate(order)}
        df = df.sort_values("variant", key=lambda s: s.map(lambda v: rank.get(v, len(rank))))
    return df.reset_index(drop=True)


def format_ablation(table: pd.DataFrame) -> str:
    """The table as Markdown."""
    head = ("| variant | seeds | test cost | regret vs oracle % | headroom closed % | "
            "redundancy | SI / interval | C_b / C_p / s(n) violated % | "
            "val: cloned start → selected | improved on start |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in table.itertuples(index=False):
        lines.append(
            f"| {r.variant} | {r.seeds} | {r.test_cost:.4f} ± {r.test_cost_ci95:.4f} | "
            f"{r.regret_pct:+.2f} ± {r.regret_pct_ci95:.2f} | "
            f"{r.closed_pct:+.1f} ± {r.closed_pct_ci95:.1f} | {r.redundancy_ratio:.3f} | "
            f"{r.subscribe_infos:.0f} | {r.bw_violated_pct:.1f} / {r.cpu_violated_pct:.1f} / "
            f"{r.node_violated_pct:.1f} | {r.val_start_cost:.4f} → {r.val_best_cost:.4f} | "
            f"{r.improved}/{r.seeds} |")
    return head + "\n".join(lines) + "\n"


def ablation_plot(table: pd.DataFrame, runs: pd.DataFrame, path: Path, title: str) -> Path:
    """Regret against the oracle per variant (mean, 95% interval, one dot per seed), with
    the tuned teacher's regret as the reference line."""
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(table) + 2), 3.6))
    x = np.arange(len(table))
    ax.bar(x, table.regret_pct, yerr=table.regret_pct_ci95.fillna(0), capsize=4,
           color="tab:brown", alpha=0.6)
    for i, v in enumerate(table.variant):
        y = runs.loc[runs.variant == v, "regret_pct"]
        ax.plot(np.full(len(y), i), y, "k.", ms=4)
    teacher = 100 * (runs.teacher_test_cost / runs.oracle_test_cost - 1.0)
    if teacher.notna().any():
        ax.axhline(float(teacher.mean()), color="tab:blue", ls="--", lw=1,
                   label="tuned heuristic (online_greedy)")
        ax.legend(fontsize=8)
    ax.set_xticks(x, table.variant, rotation=20)
    ax.set_ylabel("test regret vs oracle (%)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_ablation_table(cfg: DictConfig) -> dict[str, Any]:
    if not cfg.get("study"):
        raise DSMDError("name the study: python ablation.py study=NAME (the tags.study of "
                        "its runs)")
    out = output_dir(cfg)
    study = str(cfg.study)
    runs = ablation_runs(str(cfg.logger.tracking_uri), str(cfg.logger.experiment_name), study)
    table = ablation_table(runs, list(cfg.get("order") or []))
    text = format_ablation(table)
    print(f"Ablation study {study!r}: {len(runs)} runs (mean ± 95% interval over seeds)\n\n"
          + text, flush=True)
    with tracked_run(cfg, run_name=f"ablation__{study}",
                     tags={"task": "ablation_table", "study_table": study}) as log:
        log.table(runs, out / "ablation_runs.csv")
        log.table(table, out / "ablation.csv")
        (out / "ablation.md").write_text(text)
        log.artifact(out / "ablation.md", "tables")
        log.artifact(ablation_plot(table, runs, out / "ablation.png",
                                   f"Ablation {study}: online DDPG, test traces"), "plots")
    return {"runs": runs, "table": table, "text": text, "output_dir": out}
