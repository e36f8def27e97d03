"""``python shaping.py``: Sincon's evaluation (Section IV, Figs. 5-6) on the control-channel
simulator (:mod:`envs.shaping.simulator`); configuration ``configs/shaping.yaml``.

1 to 4 tenants of 10 virtual switches each; per point and policy (no shaping = the
OpenVirteX baseline, static equal split, Sincon) ``seeds`` runs with different traffic.

* Fig. 5: standard deviation of the control channel throughputs (channel_read and
  channel_write) with ``fig5_tenants`` (4) tenants: per ``period_s`` bin the std across
  channels, averaged over the bins after the last tenant started.
* Fig. 6: average forwarding setup time against the number of tenants.

Outputs in the run directory: ``runs.csv`` (one row per run), ``summary.csv`` (mean and std
over seeds per policy and tenants), ``fig5.csv``, ``fig6.csv``, ``headline.json`` (the
no-shaping / Sincon factors beside the paper's 3.8x and 2.9x), PNG plots (Figs. 5, 6 and the
per-channel throughput over time of one 4-tenant run), and an MLflow run with all of them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from omegaconf import DictConfig

from envs.seeding import derive_seed
from envs.shaping.simulator import DIRECTIONS, SimConfig, simulate
from envs.shaping.sincon import POLICY_NAMES, ShapingError

from ..config import output_dir, to_dict
from ..tracking import tracked_run

__all__ = ["PAPER", "headline", "run_grid", "run_shaping", "summarize"]

#: the paper's numbers: factors no shaping / Sincon with 4 tenants (Figs. 5-6), growth of the
#: unshaped setup time from 1 to 4 tenants and max / min channel throughput (Section II-B)
PAPER = {"tput_std_factor": 3.8, "setup_time_factor": 2.9, "none_setup_growth": 3.6,
         "none_tput_max_min": 2.42}
_COLORS = {"none": "tab:red", "static": "tab:blue", "sincon": "tab:green"}


def _say(text: str) -> None:
    print(text, flush=True)


def run_grid(sim: dict[str, Any], tenants: list[int], policies: list[str], seeds: int,
             seed: int) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Every (tenants, policy, seed) run; one row each, plus the delivered-bytes matrices of
    the first seed's runs with the most tenants (for the throughput-over-time plot)."""
    bad = [p for p in policies if p not in POLICY_NAMES or p == "external"]
    if bad:
        raise ShapingError(f"shaping experiment: unknown policies {bad}; known: none, "
                           "static, sincon")
    rows, traces = [], {}
    total = len(tenants) * len(policies) * seeds
    t0 = time.perf_counter()
    last = t0
    done = 0
    for n_t in tenants:
        cfg = SimConfig.from_dict(sim, tenants=int(n_t))
        for s in range(seeds):
            run_seed = derive_seed(seed, "shaping-experiment", s) % (2**31)
            for pol in policies:
                r = simulate(cfg, pol, run_seed)
                rows.append({"tenants": int(n_t), "channels": cfg.num_channels,
                             "policy": pol, "seed": run_seed, **r.summary()})
                if s == 0 and n_t == max(tenants):
                    traces[pol] = r
                done += 1
                now = time.perf_counter()
                if now - last > 10 or done == total:
                    last = now
                    _say(f"  {done}/{total} runs, {done / (now - t0):.1f} runs/s, "
                         f"{now - t0:.0f} s")
    return pd.DataFrame(rows), traces


def summarize(runs: pd.DataFrame) -> pd.DataFrame:
    """Mean and std over seeds of every metric, per (tenants, policy)."""
    metrics = [c for c in runs.columns if c not in ("tenants", "channels", "policy", "seed")]
    g = runs.groupby(["tenants", "policy"], sort=False)[metrics]
    out = g.mean().add_suffix("_mean").join(g.std(ddof=1).add_suffix("_std"))
    out.insert(0, "runs", g.size())
    return out.reset_index()


def _factor(summary: pd.DataFrame, tenants: int, col: str, of: str, over: str) -> float:
    def val(p: str) -> float:
        v = summary.loc[(summary.tenants == tenants) & (summary.policy == p), f"{col}_mean"]
        return float(v.iloc[0]) if len(v) else float("nan")
    mine = val(over)
    return val(of) / mine if mine > 0 else float("nan")


def headline(summary: pd.DataFrame, tenants: int) -> dict[str, Any]:
    """How many times lower Sincon's (and the static split's) throughput std and setup time
    are than without shaping, with ``tenants`` tenants, beside the paper's factors; and the
    unshaped baseline's Section II-B numbers (setup-time growth, max / min channel
    throughput, how much longer the last tenant's setups take than the first's, the link's
    offered load and the share of saturated bins)."""
    out: dict[str, Any] = {"tenants": tenants, "paper": PAPER}
    for pol in ("sincon", "static"):
        if pol not in set(summary.policy) or "none" not in set(summary.policy):
            continue
        out[pol] = {f"{d}_tput_std_factor": round(_factor(summary, tenants, f"{d}_tput_std_Bps",
                                                          "none", pol), 3)
                    for d in DIRECTIONS}
        out[pol]["setup_time_factor"] = round(_factor(summary, tenants, "setup_time_mean_s",
                                                      "none", pol), 3)
    setup = summary.pivot(index="tenants", columns="policy", values="setup_time_mean_s_mean")
    if len(setup) > 1:
        for pol in setup.columns:
            out[f"{pol}_setup_growth_first_to_last"] = round(
                float(setup[pol].iloc[-1] / setup[pol].iloc[0]), 3)
    row = summary[(summary.tenants == tenants) & (summary.policy == "none")]
    if len(row):
        r = row.iloc[0]
        out["none_at_tenants"] = {
            "read_tput_max_min": round(float(r["read_tput_max_min_mean"]), 3),
            "write_tput_max_min": round(float(r["write_tput_max_min_mean"]), 3),
            "setup_last_over_first_tenant": round(float(
                r["setup_time_last_tenant_s_mean"] / r["setup_time_first_tenant_s_mean"]), 3),
            "read_offered_load": round(float(r["read_offered_load_mean"]), 3),
            "read_saturated_share": round(float(r["read_saturated_share_mean"]), 3),
            "read_server_busy": round(float(r.get("read_server_busy_mean", np.nan)), 3)}
        batches = summary[summary.tenants == tenants].set_index("policy")
        if "read_batch_mean_mean" in batches and batches["read_batch_mean_mean"].notna().all():
            out["read_batch_mean"] = {p: round(float(v), 3) for p, v in
                                      batches["read_batch_mean_mean"].items()}
    return out


def _plots(summary: pd.DataFrame, traces: dict[str, Any], out: Path, fig5_tenants: int
           ) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    f5 = summary[summary.tenants == fig5_tenants]
    if len(f5):
        fig, ax = plt.subplots(figsize=(5.2, 3.8))
        width = 0.8 / len(f5)
        for i, (_, row) in enumerate(f5.iterrows()):
            x = np.arange(len(DIRECTIONS)) + (i - (len(f5) - 1) / 2) * width
            ax.bar(x, [row[f"{d}_tput_std_Bps_mean"] / 1e3 for d in DIRECTIONS], width,
                   yerr=[np.nan_to_num(row[f"{d}_tput_std_Bps_std"]) / 1e3 for d in DIRECTIONS],
                   capsize=3, color=_COLORS.get(row.policy, "gray"), label=row.policy)
        ax.set_xticks(np.arange(len(DIRECTIONS)), [f"channel_{d}" for d in DIRECTIONS])
        ax.set_ylabel("std of channel throughput (kB/s)")
        ax.legend()
        ax.set_title(f"Fig. 5: {fig5_tenants} tenants ({int(f5.runs.iloc[0])} runs)")
        fig.tight_layout()
        paths.append(out / "fig5_throughput_std.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(5.2, 3.8))
    for pol, g in summary.groupby("policy", sort=False):
        ax.errorbar(g.tenants, 1e3 * g.setup_time_mean_s_mean,
                    yerr=1e3 * np.nan_to_num(g.setup_time_mean_s_std), marker="o", capsize=3,
                    color=_COLORS.get(pol, "gray"), label=pol)
    ax.set_xlabel("tenants (10 virtual switches each)")
    ax.set_ylabel("average forwarding setup time (ms)")
    ax.set_yscale("log")
    ax.set_xticks(sorted(set(summary.tenants)))
    ax.legend()
    ax.set_title("Fig. 6: forwarding setup time")
    fig.tight_layout()
    paths.append(out / "fig6_setup_time.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    if traces:
        fig, axes = plt.subplots(1, len(traces), figsize=(4.2 * len(traces), 3.4),
                                 sharey=True, squeeze=False)
        for ax, (pol, r) in zip(axes[0], traces.items()):
            p = r.cfg.period_s
            tp = r.delivered[DIRECTIONS.index("write")] / p / 1e3
            tt = np.arange(tp.shape[1]) * p
            for row in tp:
                ax.plot(tt, row, lw=0.6, alpha=0.6)
            ax.axvline(r.cfg.measure_from_s, color="gray", ls="--", lw=1)
            ax.set_title(f"{pol}: channel_write per channel", fontsize=10)
            ax.set_xlabel("time (s)")
        axes[0][0].set_ylabel("throughput (kB/s)")
        fig.tight_layout()
        paths.append(out / "throughput_over_time.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def run_shaping(cfg: DictConfig) -> dict[str, Any]:
    """The whole reproduction (see the module docstring); returns tables, plots, headline.
    ``model=controller`` runs it on the controller's sending path instead
    (:func:`agents.shaping.path_experiment.run_path`)."""
    model = str(cfg.get("model", "switches"))
    if model == "controller":
        from .path_experiment import run_path

        return run_path(cfg)
    if model != "switches":
        raise ShapingError(f"model={model!r}: known models are 'switches' (the SDN-NV "
                           "control channels) and 'controller' (the sending path)")
    out = output_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    sim = to_dict(cfg.sim) or {}
    tenants = [int(t) for t in cfg.tenants]
    policies = [str(p) for p in cfg.policies]
    fig5_t = int(cfg.fig5_tenants)
    if fig5_t not in tenants:
        raise ShapingError(f"fig5_tenants={fig5_t} is not among tenants {tenants}")
    t0 = time.perf_counter()
    with tracked_run(cfg, run_name=f"shaping__t{max(tenants)}__s{cfg.seed}",
                     tags={"task": "shaping"}) as mlog:
        _say(f"shaping: tenants {tenants}, policies {policies}, {cfg.seeds} seeds each")
        runs, traces = run_grid(sim, tenants, policies, int(cfg.seeds), int(cfg.seed))
        summary = summarize(runs)
        fig5 = summary[summary.tenants == fig5_t][
            ["policy", "runs"] + [f"{d}_tput_std_Bps_{s}" for d in DIRECTIONS
                                  for s in ("mean", "std")]]
        fig6 = summary[["tenants", "policy", "runs", "setup_time_mean_s_mean",
                        "setup_time_mean_s_std", "setup_time_p95_s_mean"]]
        tables = {"runs": runs, "summary": summary, "fig5": fig5, "fig6": fig6}
        for name, df in tables.items():
            mlog.table(df, out / f"{name}.csv")
        plots = _plots(summary, traces, out, fig5_t)
        for p in plots:
            mlog.artifact(p, "plots")
        head = headline(summary, fig5_t)
        (out / "headline.json").write_text(json.dumps(head, indent=2))
        mlog.text(json.dumps(head, indent=2), "headline.json")
        for _, row in summary.iterrows():
            mlog.metrics({f"t{row.tenants}/{row.policy}/{k}": row[f"{k}_mean"] for k in (
                "setup_time_mean_s", "read_tput_std_Bps", "write_tput_std_Bps")})
        mlog.metrics({f"headline/{p}/{k}": v for p in ("sincon", "static")
                      for k, v in head.get(p, {}).items()})
    _say(f"shaping done in {time.perf_counter() - t0:.0f} s; results in {out}")
    _say(json.dumps(head, indent=2))
    return {"tables": tables, "plots": plots, "headline": head, "out_dir": out}
