"""The reproduction of Figs. 8-11 of Optimal Multicast (Zhu et al., Section VII):
``python trees.py`` (Hydra, ``configs/trees.yaml``; MLflow experiment ``smart-dsmd-trees``).

* Fig. 8: total receiving rate against the number of hypervisors (2..14) for the path of
  Theorem 1, a star, a binary and a ternary tree, at the profiled input rate (0.8 Gbps). Two
  accountings: objective (1) (tunnel streams only, Theorem 1's model) and the paper's
  evaluation accounting, where each receiving hypervisor's switch also sends one stream to
  its local VM (Section VII-A: "at most two output streams for each OvS: one to the host
  attached to it and the other to the next OvS") and the VMs' rates are summed.
* Figs. 9-10: the cluster of Section VII-B (100 service nodes with background load, 100
  groups joining one after another); per scheme, the CDF of each group's mean per-stream
  receiving rate over its input rate (Fig. 9) and the CDF of the service nodes' workloads
  after all groups (Fig. 10; the group-added part is plotted beside the total).
* Fig. 11: the same two CDFs for Algorithm 1 under several ``lambda``.
* ``overtime`` (not a figure of the paper): ``smart/MulticastOverTime-v0``'s baselines, its
  isolation bound and a one-step rollout on held-out episodes (:mod:`agents.trees.overtime`).
* ``overtime_rules`` (not a figure of the paper): two-level load-knob rules on the same
  episodes, whether the knob has room a policy could see (:func:`agents.trees.overtime.rule_table`).
* ``overtime_planning`` (not a figure of the paper): the one-step rollout on the episode's
  own future and on sampled futures, what planning with the model can take
  (:func:`agents.trees.overtime.planning_table`).
* ``overtime_signal`` (not a figure of the paper): what a critic would have to resolve, the
  candidates' gains against the noise of one return over sampled futures
  (:func:`agents.trees.overtime.signal_table`).
* ``overtime_learned`` (not a figure of the paper): only the ``overtime.learned`` training
  runs, each paired with the baselines on its own test episodes
  (:func:`agents.trees.overtime.learned_table`), in seconds.

Each run writes CSV tables (``fig8.csv``, ``groups.csv``, ``workloads.csv``,
``summary.csv``), PNG plots and an MLflow run (metrics ``<scheme>/<metric>``).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from envs.seeding import rng
from envs.trees.groups import (
    ClusterSpec,
    ClusterState,
    GroupSpec,
    background_loads,
    generate_groups,
)
from envs.trees.switch import SwitchModel, switch_from_spec
from envs.trees.tree import evaluate_tree, objective1

from ..config import workers_setting
from ..plots import _save
from .baselines import SCHEMES, small_group_trees

__all__ = ["cluster_tables", "fig8_table", "run_sequence", "run_trees", "summarize"]


#: what ``figures`` may list (the module docstring)
FIGURES = ("fig8", "fig9", "fig10", "fig11", "overtime", "overtime_rules", "overtime_planning",
           "overtime_learned", "overtime_signal")
#: the tables of ``headline.json`` and of the closing printout
HEADLINE = ("summary", "fig11_summary", "overtime_summary", "overtime_learned", "overtime_rules",
            "overtime_planning", "overtime_signal")


def _say(msg: str) -> None:
    print(msg, flush=True)


def fig8_table(switch: SwitchModel, hypervisors: Sequence[int], rate_gbps: float
               ) -> pd.DataFrame:
    """Fig. 8: one row per (topology, n)."""
    rows = []
    for n in hypervisors:
        for name, tree in small_group_trees(int(n)).items():
            vm = evaluate_tree(tree, switch, rate_gbps, local_delivery=True).delivered
            rows.append({"topology": name, "hypervisors": int(n),
                         "receiving_rate_gbps": float(vm.sum()),
                         "objective1_gbps": objective1(tree, switch, rate_gbps),
                         "height": tree.height()})
    return pd.DataFrame(rows)


def run_sequence(scheme: str, cluster: ClusterSpec, groups: GroupSpec,
                 switch: SwitchModel, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Place one seed's group sequence with ``scheme``; per-group rows and per-node
    workloads. Background loads and groups depend on ``seed`` only, so every scheme sees
    the same sequence."""
    if scheme not in SCHEMES:
        raise KeyError(f"unknown scheme {scheme!r}; known: {sorted(SCHEMES)}")
    state = ClusterState(cluster, switch, background_loads(cluster, rng(seed, "background")))
    seq = generate_groups(groups, rng(seed, "sessions"))  # the stream name seeds the draws
    pick = rng(seed, "scheme", scheme)
    make = SCHEMES[scheme]()
    rows = []
    for i, (n, r) in enumerate(zip(seq.n, seq.rate_gbps)):
        p = state.place(make(state, int(n), float(r), pick), float(r))
        rows.append({"scheme": scheme, "seed": seed, "group": i, "hypervisors": int(n),
                     "rate_gbps": float(r), **dataclasses.asdict(p)})
    loads = pd.DataFrame({"scheme": scheme, "seed": seed,
                          "service_node": np.arange(cluster.num_service_nodes),
                          "background_gbps": state.initial, "workload_gbps": state.loads,
                          "added_gbps": state.loads - state.initial})
    return pd.DataFrame(rows), loads


def cluster_tables(schemes: Sequence[str], cluster: ClusterSpec, groups: GroupSpec,
                   switch: SwitchModel, seeds: Sequence[int], label: str = ""
                   ) -> tuple[pd.DataFrame, pd.DataFrame]:
    grp, loads = [], []
    for s in seeds:
        for name in schemes:
            t0 = time.perf_counter()
            a, b = run_sequence(name, cluster, groups, switch, int(s))
            grp.append(a.assign(setting=label))
            loads.append(b.assign(setting=label))
            _say(f"  {label or name} seed {s}: {len(a)} groups in "
                 f"{time.perf_counter() - t0:.2f} s, mean ratio {a.ratio.mean():.3f}, "
                 f"mean k {a.k.mean():.1f}")
    return pd.concat(grp, ignore_index=True), pd.concat(loads, ignore_index=True)


def summarize(groups: pd.DataFrame, loads: pd.DataFrame, by: str) -> pd.DataFrame:
    """Per ``by`` (scheme or lambda): the numbers behind Figs. 9-11."""
    g = groups.groupby(by, sort=False)
    out = pd.DataFrame({
        "mean_ratio": g.ratio.mean(), "full_ratio_frac": g.ratio.apply(lambda x: (
            x >= 1 - 1e-9).mean()), "median_ratio": g.ratio.median(),
        "mean_objective": g.objective.mean(), "mean_throughput_gbps": g.throughput.mean(),
        "mean_k": g.k.mean(), "mean_height": g.height.mean()})
    lg = loads.groupby(by, sort=False)
    out["workload_std_gbps"] = lg.workload_gbps.std(ddof=0)
    out["workload_max_gbps"] = lg.workload_gbps.max()
    out["added_std_gbps"] = lg.added_gbps.std(ddof=0)
    out["added_max_gbps"] = lg.added_gbps.max()
    return out.reset_index()


def _cdf(ax: Any, values: np.ndarray, label: str) -> None:
    v = np.sort(np.asarray(values, dtype=float))
    ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=label)


def _cdf_figure(frames: dict[str, pd.DataFrame], cols: Sequence[tuple[str, str]], path: Path,
                title: str) -> Path:
    fig, axes = plt.subplots(1, len(cols), figsize=(5.2 * len(cols), 3.8), squeeze=False)
    for ax, (col, xlabel) in zip(axes[0], cols):
        for label, df in frames.items():
            _cdf(ax, df[col].to_numpy(), label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path, title)


def fig8_plot(df: pd.DataFrame, path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(10.4, 3.8))
    for ax, col, ylabel in ((axes[0], "receiving_rate_gbps",
                             "Total receiving rate at VMs (Gbps)"),
                            (axes[1], "objective1_gbps", "Objective (1): total sending (Gbps)")):
        for name, g in df.groupby("topology", sort=False):
            ax.plot(g.hypervisors, g[col], marker="o", label=name)
        ax.set_xlabel("Number of hypervisors")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path, "Fig. 8: point-to-point logical multicast")


def _overtime_plot(df: pd.DataFrame, path: Path) -> Path:
    """Each policy's value per episode as a share of the episode's isolation bound."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    order = list(dict.fromkeys(df.policy))
    for i, pol in enumerate(order):
        d = df[df.policy == pol]
        share = (d.value / d.bound).to_numpy()
        ax.scatter(np.full(share.size, i), share, s=14, alpha=0.7)
        ax.hlines(share.mean(), i - 0.3, i + 0.3, color="k")
    ax.set_xticks(range(len(order)), order, rotation=20)
    ax.set_ylabel("value / isolation bound")
    return _save(fig, path, "smart/MulticastOverTime-v0: held-out episodes")


def _signal_plot(groups: pd.DataFrame, path: Path) -> Path:
    """The CDF over the groups of the returns per action that would tell the best candidate
    from the base's at 2 standard deviations, from independent and from common futures."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    moved = groups[groups.gain > 0]
    for col, label in (("returns_independent", "independent futures (a critic's returns)"),
                       ("returns_paired", "common futures (the planner's comparison)")):
        v = np.sort(moved[col].to_numpy())
        ax.step(v, np.arange(1, v.size + 1) / max(v.size, 1), where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("returns per action to tell the best candidate from the base's (2 sd)")
    ax.set_ylabel("share of the groups")
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, path, "smart/MulticastOverTime-v0: the signal a critic would resolve")


def _tuples(node: DictConfig) -> dict[str, Any]:
    """A config group as keyword arguments, lists as tuples (the specs are frozen)."""
    return {k: tuple(v) if isinstance(v, list) else v
            for k, v in OmegaConf.to_container(node, resolve=True).items()}


def run_trees(cfg: DictConfig) -> dict[str, Any]:
    """The whole reproduction for ``cfg`` (``configs/trees.yaml``)."""
    from agents.tracking import tracked_run

    out = Path(str(cfg.out_dir))
    out.mkdir(parents=True, exist_ok=True)
    switch = switch_from_spec(str(cfg.switch))
    cluster = ClusterSpec(**_tuples(cfg.cluster))
    groups = GroupSpec(**_tuples(cfg.groups))
    seeds = [int(s) for s in cfg.seeds]
    figures = set(cfg.figures)
    unknown = sorted(figures - set(FIGURES))
    if unknown:
        raise ValueError(f"figures: unknown {unknown}; known: {', '.join(FIGURES)}")
    ot = cfg.overtime
    env_over = (cast("dict[str, Any]", OmegaConf.to_container(ot.env)) if ot.get("env")
                else None)
    workers = workers_setting(ot.get("workers"), "overtime.workers")
    if "overtime_planning" in figures and int(ot.model_samples) < 1:
        raise ValueError(f"overtime.model_samples must be >= 1 (sampled futures per group), "
                         f"got {ot.model_samples}")
    if "overtime_signal" in figures and int(ot.signal_samples) < 2:
        raise ValueError(f"overtime.signal_samples must be >= 2 (a standard deviation over "
                         f"the futures), got {ot.signal_samples}")
    readers = {"overtime", "overtime_rules", "overtime_planning", "overtime_learned"}
    if ot.get("learned") and not figures & readers:
        raise ValueError("overtime.learned is read by figures=[overtime], [overtime_rules], "
                         "[overtime_planning] or [overtime_learned]; none is listed")
    if "overtime_learned" in figures and not ot.get("learned"):
        raise ValueError("figures=[overtime_learned] tabulates overtime.learned (train.py "
                         "env=trees_time* output directories), which is empty")
    t0 = time.perf_counter()
    tables: dict[str, pd.DataFrame] = {}
    plots: list[Path] = []
    with tracked_run(cfg, run_name=f"trees__{cfg.switch}",
                     tags={"task": "trees"}) as mlog:
        _say(f"trees: switch {cfg.switch}; figures {sorted(figures)}; seeds {seeds}")
        if "fig8" in figures:
            df = fig8_table(switch, list(cfg.fig8.hypervisors), float(cfg.fig8.rate_gbps))
            tables["fig8"] = df
            plots.append(fig8_plot(df, out / "fig8_point_to_point.png"))
            last = df[df.hypervisors == df.hypervisors.max()].set_index("topology")
            mlog.metrics({f"fig8/{t}/receiving_rate_gbps": float(v)
                          for t, v in last.receiving_rate_gbps.items()})
        if figures & {"fig9", "fig10"}:
            grp, loads = cluster_tables(list(cfg.schemes), cluster, groups, switch, seeds)
            tables["groups"], tables["workloads"] = grp, loads
            summ = summarize(grp, loads, "scheme")
            tables["summary"] = summ
            frames = {s: grp[grp.scheme == s] for s in cfg.schemes}
            lframes = {s: loads[loads.scheme == s] for s in cfg.schemes}
            plots.append(_cdf_figure(frames, [("ratio", "Output rate per stream / input rate")],
                                     out / "fig9_ratio_cdf.png",
                                     f"Fig. 9 (lambda = {cluster.lam:g})"))
            plots.append(_cdf_figure(lframes, [("workload_gbps", "Workload per service node "
                                                "(Gbps)"), ("added_gbps", "Added by the "
                                                "groups (Gbps)")],
                                     out / "fig10_workload_cdf.png", "Fig. 10"))
            for _, row in summ.iterrows():
                mlog.metrics({f"{row.scheme}/{c}": float(row[c]) for c in summ.columns
                              if c != "scheme"})
        if "fig11" in figures:
            parts_s, parts_l = [], []
            for lam in cfg.lambdas:
                c = dataclasses.replace(cluster, lam=float(lam))
                a, b = cluster_tables(["algorithm1"], c, groups, switch, seeds,
                                      label=f"lambda={float(lam):g}")
                parts_s.append(a.assign(lam=float(lam)))
                parts_l.append(b.assign(lam=float(lam)))
            s11, l11 = pd.concat(parts_s), pd.concat(parts_l)
            tables["fig11_groups"], tables["fig11_workloads"] = s11, l11
            summ11 = summarize(s11, l11, "lam")
            tables["fig11_summary"] = summ11
            plots.append(_cdf_figure(
                {f"lambda={v:g}": s11[s11.lam == v] for v in s11.lam.unique()},
                [("ratio", "Output rate per stream / input rate")], out / "fig11a_lambda.png",
                "Fig. 11(a): Algorithm 1 under lambda"))
            plots.append(_cdf_figure(
                {f"lambda={v:g}": l11[l11.lam == v] for v in l11.lam.unique()},
                [("workload_gbps", "Workload per service node (Gbps)"),
                 ("added_gbps", "Added by the groups (Gbps)")], out / "fig11b_lambda.png",
                "Fig. 11(b): Algorithm 1 under lambda"))
            for _, row in summ11.iterrows():
                mlog.metrics({f"lambda{row.lam:g}/{c}": float(row[c]) for c in summ11.columns
                              if c != "lam"})
        if ot.get("learned"):
            from .overtime import learned_table

            tables["overtime_learned"] = learned_table([str(d) for d in ot.learned])
        if "overtime_rules" in figures:
            from .overtime import rule_table

            tables["overtime_rules"] = rule_table(int(ot.episodes), env_over, say=_say)
            for _, row in tables["overtime_rules"].iterrows():
                mlog.metrics({f"overtime_rules/{row.rule}/vs_algorithm1_tuned_pct":
                              float(row.vs_algorithm1_tuned_pct)})
        if "overtime_planning" in figures:
            from .overtime import planning_table

            tables["overtime_planning"] = planning_table(
                int(ot.planning_episodes), int(ot.model_samples), env_over, say=_say,
                workers=workers)
            for _, row in tables["overtime_planning"].iterrows():
                mlog.metrics({f"overtime_planning/{row.policy}/vs_algorithm1_tuned_pct":
                              float(row.vs_algorithm1_tuned_pct)})
        if "overtime_signal" in figures:
            from .overtime import signal_table

            tables.update(signal_table(int(ot.signal_episodes), int(ot.signal_samples),
                                       env_over, say=_say, workers=workers))
            plots.append(_signal_plot(tables["overtime_signal_groups"],
                                      out / "overtime_signal.png"))
            row = tables["overtime_signal"].iloc[0]
            mlog.metrics({f"overtime_signal/{c}": float(row[c])
                          for c in ("gain_pct", "sd_return_pct", "returns_independent",
                                    "returns_paired")})
        if "overtime" in figures:
            from .overtime import overtime_tables

            over = overtime_tables(int(ot.episodes), int(ot.rollout_episodes), env_over,
                                   say=_say, workers=workers)
            tables.update(over)
            plots.append(_overtime_plot(over["overtime"], out / "overtime.png"))
            for _, row in over["overtime_summary"].iterrows():
                mlog.metrics({f"overtime/{row.policy}/{c}": float(row[c])
                              for c in ("value", "of_bound", "vs_algorithm1_tuned_pct")})
        for name, df in tables.items():
            mlog.table(df, out / f"{name}.csv")
        for p in plots:
            mlog.artifact(p, "plots")
        head = {name: tables[name].round(4).to_dict(orient="records")
                for name in HEADLINE
                if name in tables}
        (out / "headline.json").write_text(json.dumps(head, indent=2))
        mlog.text(json.dumps(head, indent=2), "headline.json")
    _say(f"trees done in {time.perf_counter() - t0:.1f} s; results in {out}")
    for name in HEADLINE:
        if name in tables:
            _say(tables[name].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return {"tables": tables, "plots": plots, "out_dir": out}
