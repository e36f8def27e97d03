"""Reproduction of Figs. 5-8 (Section VII-C): sweep the multicast share of traffic from 0%
to 100% and record, for every policy, the traffic on the controller, the number of sent
messages, the controller's concurrent sends, the total and maximum traffic on compute
nodes, redundancy and constraint violations (CSV, PNG, MLflow)."""

from __future__ import annotations

import time
from typing import Any

import pandas as pd
from omegaconf import DictConfig

from envs.dsmd.problems import build_problems

from .config import output_dir, scenario_spec, to_dict
from .evaluation import evaluate_policies, format_table, summarize
from .plots import sweep_plots
from .registry import make_policies
from .seeding import seed_everything
from .tracking import tracked_run

__all__ = ["run_sweep"]


def run_sweep(cfg: DictConfig) -> dict[str, Any]:
    seed_everything(int(cfg.seed))
    base = scenario_spec(cfg)
    out = output_dir(cfg)
    shares = [float(s) for s in cfg.sweep.multicast_shares]
    run_name = cfg.get("run_name") or f"{base.name}__multicast_sweep__{cfg.seed}"
    tags = {"scenario": base.name, "task": "multicast_sweep", "seed": str(cfg.seed)}
    frames = []
    t_start = time.perf_counter()
    with tracked_run(cfg, run_name=run_name, tags=tags) as log:
        for i, share in enumerate(shares):
            spec = base.replace(multicast_share=share)
            ps = build_problems(spec, cache_dir=cfg.paths.data_dir, batch_key=cfg.env.batch_key)
            windows = ps.split_windows(str(cfg.sweep.split))
            if cfg.sweep.get("max_windows"):
                windows = windows[:int(cfg.sweep.max_windows)]
            instances = [ps.instance(w) for w in windows]
            policies = make_policies(list(cfg.sweep.policies), ps, to_dict(cfg.baseline.params))
            df = evaluate_policies(policies, instances, progress=bool(cfg.progress),
                                   desc=f"share {share:.0%}")
            df.insert(0, "multicast_share", share)
            frames.append(df)
            elapsed = time.perf_counter() - t_start
            print(f"[sweep] {i + 1}/{len(shares)} shares done (multicast {share:.0%}), "
                  f"{elapsed:.0f}s elapsed, ~{elapsed / (i + 1) * (len(shares) - i - 1):.0f}s left",
                  flush=True)
        per_window = pd.concat(frames, ignore_index=True)
        summary = summarize(per_window, by=("multicast_share", "policy"))
        log.table(per_window, out / "sweep_per_window.csv")
        log.table(summary, out / "sweep_summary.csv")
        for p in sweep_plots(summary, out / "plots", base.name):
            log.artifact(p, "plots")
        for row in summary.itertuples(index=False):
            log.metrics({f"{row.policy}/total_node_mbps": row.total_node_mbps,
                         f"{row.policy}/ctrl_traffic_mbps": row.ctrl_traffic_mbps,
                         f"{row.policy}/sent_msgs_per_s": row.sent_msgs_per_s,
                         f"{row.policy}/max_node_mbps": row.max_node_mbps},
                        step=round(100 * row.multicast_share))
        mid = summary[(summary["multicast_share"] - 0.5).abs() < 1e-9]
        if len(mid):
            text = format_table(mid.drop(columns=["multicast_share"]))
            print(f"\n{base.name} at 50% multicast (mean per window):\n{text}\n", flush=True)
            (out / "sweep_50pct.txt").write_text(text + "\n")
            log.artifact(out / "sweep_50pct.txt", "tables")
    print(f"[sweep] wrote {out}/sweep_summary.csv and plots/ in "
          f"{time.perf_counter() - t_start:.0f}s", flush=True)
    return {"summary": summary, "per_window": per_window, "run_id": log.run_id,
            "output_dir": out}
