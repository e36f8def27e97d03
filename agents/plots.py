"""Plots (PNG) of evaluations and of the multicast-share sweep (Figs. 5-8)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

__all__ = [
    "DSMD_CURVE_PANELS",
    "SWEEP_FIGURES",
    "comparison_plot",
    "learning_curve_plot",
    "online_timeline_plot",
    "pareto_plot",
    "pinball_plot",
    "reliability_plot",
    "sweep_plots",
]

_STYLE = {"rpc": ("tab:red", "o"), "vita": ("tab:blue", "s"), "idcs": ("tab:green", "^"),
          "alcor": ("tab:purple", "v"), "greedy": ("tab:orange", "D"), "exact": ("black", "*"),
          "ddpg": ("tab:brown", "P"), "sac": ("tab:pink", "X"), "ppo": ("tab:olive", "h"),
          "dqn": ("tab:cyan", "d")}

#: file name, column of the sweep summary, scale, y label, paper figure
SWEEP_FIGURES = [
    ("fig5_controller_traffic.png", "ctrl_traffic_mbps", 1e-3, "Traffic on controller (Gbps)",
     "Fig. 5"),
    ("fig6_sent_messages.png", "sent_msgs_per_s", 1.0, "Sent messages (per s)", "Fig. 6"),
    ("fig7_total_node_traffic.png", "total_node_mbps", 1e-3, "Total traffic on CNs (Gbps)",
     "Fig. 7"),
    ("fig8_max_node_traffic.png", "max_node_mbps", 1.0, "Max. traffic on a CN (Mbps)", "Fig. 8"),
    ("controller_sends.png", "ctrl_sends", 1.0, "Controller concurrent sends (vs C_p)", "CPU"),
    ("redundancy.png", "redundancy_mbps", 1e-3, "Redundant traffic on CNs (Gbps)", "redundancy"),
    ("violations.png", "violation_total", 1.0, "Mean constraint violation (sum of terms)",
     "violations"),
]


def _save(fig, path: Path, title: str) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def comparison_plot(summary: pd.DataFrame, path: Path, title: str,
                    limits: dict[str, float] | None = None) -> Path:
    """Bars per policy; ``limits`` maps a column to its capacity (drawn dashed)."""
    limits = limits or {}
    cols = [("total_node_mbps", "Total traffic on CNs (Mbps)"),
            ("ctrl_traffic_mbps", "Traffic on controller (Mbps)"),
            ("ctrl_sends", "Controller sends"),
            ("feasible_frac", "Feasible fraction of windows")]
    fig, axes = plt.subplots(1, len(cols), figsize=(4.2 * len(cols), 3.6))
    for ax, (c, label) in zip(axes, cols):
        names = summary["policy"].tolist()
        colors = [_STYLE.get(n, ("gray", "o"))[0] for n in names]
        ax.bar(names, summary[c].fillna(0.0), color=colors)
        for i, v in enumerate(summary[c]):
            if pd.isna(v):  # the policy could not solve these instances
                ax.text(i, 0, "n/a", ha="center", va="bottom", fontsize=8)
        if c in limits:
            ax.axhline(limits[c], color="gray", ls="--", lw=1)
            ax.text(len(names) - 0.5, limits[c], " limit", va="bottom", ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", rotation=30)
    return _save(fig, path, title)


def sweep_plots(summary: pd.DataFrame, outdir: Path, scenario: str) -> list[Path]:
    """One PNG per metric: the metric against the multicast share, a line per policy."""
    outdir.mkdir(parents=True, exist_ok=True)
    summary = summary.copy()
    summary["violation_total"] = (summary["bw_violation"] + summary["cpu_violation"]
                                  + summary["node_violation"])
    paths = []
    for fname, col, scale, label, fig_name in SWEEP_FIGURES:
        fig, ax = plt.subplots(figsize=(5.2, 3.8))
        for pol, g in summary.groupby("policy", sort=False):
            color, marker = _STYLE.get(pol, ("gray", "o"))
            ax.plot(100 * g["multicast_share"], g[col] * scale, marker=marker, color=color,
                    label=pol)
        ax.set_xlabel("Multicast share of traffic (%)")
        ax.set_ylabel(label)
        ax.set_title(f"{fig_name}: {scenario}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = outdir / fname
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths


#: the static DSMD trainer's learning-curve panels: (title, columns)
DSMD_CURVE_PANELS: list[tuple[str, list[str]]] = [
    ("Training episode return", ["train/episode_return_mean"]),
    ("Validation node traffic vs greedy (%)", ["val/gap_to_greedy_pct"]),
    ("Validation: feasible fraction / violations",
     ["val/feasible_frac", "val/bw_violation", "val/cpu_violation", "val/node_violation"]),
    ("Training episodes: Eq. 2 terms",
     ["train/dsmd/reward_objective", "train/dsmd/reward_controller_bw_penalty",
      "train/dsmd/reward_controller_cpu_penalty", "train/dsmd/reward_node_penalty"]),
]


def learning_curve_plot(curve: pd.DataFrame, path: Path, title: str,
                        panels: list[tuple[str, list[str]]] | None = None,
                        references: dict[str, dict[str, float]] | None = None) -> Path:
    """Training curves against environment steps, a panel per ``(title, columns)`` of
    ``panels`` (default: the static DSMD trainer's :data:`DSMD_CURVE_PANELS`); a panel with
    no data is left out. ``references[column]`` draws labelled horizontal lines (a
    baseline's validation value) in the panel of ``column``."""
    panels = [(label, [c for c in cols if c in curve and curve[c].notna().any()])
              for label, cols in (panels or DSMD_CURVE_PANELS)]
    panels = [p for p in panels if p[1]] or [("(no curve recorded)", [])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.4), squeeze=False)
    for ax, (label, cols) in zip(axes[0], panels):
        for c in cols:
            pts = curve[["steps", c]].dropna()
            ax.plot(pts["steps"], pts[c], marker=".", label=c.split("/")[-1])
            for name, v in ((references or {}).get(c) or {}).items():
                ax.axhline(v, color="gray", ls="--", lw=1)
                ax.text(curve["steps"].iloc[0], v, name, fontsize=7, va="bottom")
        if label.startswith("Validation node"):
            ax.axhline(0.0, color="gray", ls="--", lw=1)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("environment steps")
        if len(cols) > 1:
            ax.legend(fontsize=7)
    return _save(fig, path, title)


def online_timeline_plot(df: pd.DataFrame, path: Path, title: str) -> Path:
    """One test trace, a line per policy: interval cost, redundancy ratio, violation and
    SubscribeInfos per interval (``df``: per-interval rows of that trace)."""
    cols = [("cost", "Interval cost"), ("redundancy_ratio", "Node traffic / necessary"),
            ("violation", "Normalised violation"), ("subscribe_infos", "SubscribeInfos")]
    fig, axes = plt.subplots(len(cols), 1, figsize=(9, 2.3 * len(cols)), sharex=True)
    for pol, g in df.groupby("policy", sort=False):
        for ax, (c, _) in zip(axes, cols):
            ax.plot(g["window"], g[c], lw=1.2, label=pol)
    for ax, (_, label) in zip(axes, cols):
        ax.set_ylabel(label, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[-1].set_xlabel("interval")
    axes[0].legend(fontsize=7, ncol=3, loc="upper right")
    return _save(fig, path, title)


def pareto_plot(points: pd.DataFrame, front: pd.DataFrame, path: Path, title: str,
                others: pd.DataFrame | None = None) -> Path:
    """The tunable heuristics' knob settings as points of (node traffic / necessary,
    SubscribeInfos per interval), the non-dominated ones joined; ``others`` (one point per
    fixed policy) drawn as labelled markers."""
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    feas = points["any_violated"] <= 0.0
    ax.scatter(points.loc[feas, "redundancy_ratio"], points.loc[feas, "subscribe_infos"],
               s=14, c="tab:blue", alpha=0.6, label="knob setting, no violated interval")
    ax.scatter(points.loc[~feas, "redundancy_ratio"], points.loc[~feas, "subscribe_infos"],
               s=14, c="tab:red", alpha=0.6, marker="x", label="knob setting with violations")
    ax.plot(front["redundancy_ratio"], front["subscribe_infos"], "k-", lw=1, label="Pareto front")
    if others is not None:
        for _, r in others.iterrows():
            ax.scatter([r["redundancy_ratio"]], [r["subscribe_infos"]], marker="s", s=30)
            ax.annotate(r["policy"], (r["redundancy_ratio"], r["subscribe_infos"]), fontsize=7)
    ax.set_xlabel("node traffic / necessary traffic")
    ax.set_ylabel("SubscribeInfos per interval")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path, title)


def reliability_plot(preds: dict[str, np.ndarray], y: np.ndarray, path: Path) -> Path:
    """Forecast probability against observed frequency (ten equal bins), per method."""
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
    edges = np.linspace(0, 1, 11)
    for name, p in preds.items():
        b = np.clip(np.digitize(p, edges) - 1, 0, 9)
        n = np.bincount(b, minlength=10)
        keep = n > 0
        ax.plot((np.bincount(b, p, 10)[keep] / n[keep]), (np.bincount(b, y, 10)[keep] / n[keep]),
                marker="o", ms=3, label=name)
    ax.set_xlabel("forecast probability of sending")
    ax.set_ylabel("observed frequency")
    ax.legend(fontsize=8)
    return _save(fig, path, "Reliability on the test traces")


def pinball_plot(table: pd.DataFrame, qs: tuple[float, ...], path: Path) -> Path:
    """Pinball loss per quantile level and method (grouped bars; coverage in the legend)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(len(table), 1)
    for i, (_, r) in enumerate(table.iterrows()):
        ax.bar(np.arange(len(qs)) + i * width, [r[f"pinball_{q:g}"] for q in qs], width,
               label=f"{r.method} (coverage {r.coverage:.3f})")
    ax.set_xticks(np.arange(len(qs)) + width * (len(table) - 1) / 2)
    ax.set_xticklabels([f"q = {q:g}" for q in qs])
    ax.set_ylabel("pinball loss of log1p(rate) (lower is better)")
    ax.legend(fontsize=8)
    return _save(fig, path, "Rate quantiles on the test traces")
