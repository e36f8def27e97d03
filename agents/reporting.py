"""The evaluation report shared by the entry points: summary table on the terminal, CSV
tables, the comparison plot, and their MLflow artifacts."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from envs.dsmd.scenarios import ScenarioSpec

from .evaluation import format_table, summarize
from .plots import comparison_plot
from .tracking import RunLogger

__all__ = ["report"]


def report(log: RunLogger, per_window: pd.DataFrame, out: Path, spec: ScenarioSpec,
           split: str, heading: str) -> pd.DataFrame:
    """Summarise ``per_window``, print it, write CSV/TXT/PNG under ``out`` and attach them."""
    summary = summarize(per_window)
    table = format_table(summary)
    print(f"\n{heading} on {spec.name} ({split} windows, mean per window):\n{table}\n",
          flush=True)
    log.table(per_window, out / "per_window.csv")
    log.table(summary, out / "summary.csv")
    (out / "summary.txt").write_text(table + "\n")
    log.artifact(out / "summary.txt", "tables")
    png = comparison_plot(summary, out / "comparison.png", f"{spec.name}: {split} windows",
                          limits={"ctrl_traffic_mbps": spec.controller_bw_bps / 1e6,
                                  "ctrl_sends": spec.controller_cpu})
    log.artifact(png, "plots")
    return summary
