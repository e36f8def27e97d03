"""``python shaping.py model=controller``: Sincon's Figs. 5-6 and Section II-B on the
controller's own sending path (:mod:`delivery.sending_sim`, calibrated and validated against
the real shaper by ``bench/bench_fairness_fidelity.py``) instead of the SDN-NV channel model.

1 to 4 tenants (``tenants``) send to the same ``nodes`` nodes with the same workload (Section
II-B): each streams ``rate_hz`` small messages/s (the forwarding setups: delay-sensitive) for
``duration_s`` s and hands the controller a burst (about ``burst_messages``: uniform within
+-50% per seed) when it starts; tenant ``k`` starts at ``k * tenant_stagger_s`` (plus up to
one stagger of jitter per seed), so earlier tenants burst first. ``workloads``:

* ``same``: a tenant's setups and burst share its VPC, hence its shaping class;
* ``split``: a tenant's setups come from a VPC (class) of their own, its burst from another:
  the classes an operator would give latency-sensitive and bulk traffic.

Policies at cap ``global_throughput_Bps`` (G, payload bytes x destinations per second):
``none`` (no shaper: the controller's own path, whose capacity is far above G), ``fifo``
(one shaped FIFO at G: the unshaped OpenVirteX of the paper, a shared link of G served in
order), ``static`` (G / classes each) and ``sincon`` (a class per VPC).

Per run: the setups' mean and p95 delay (Fig. 6's forwarding setup time), the first and the
last tenant's mean setup delay (Section II-B: earlier channels dominate), the bursts' p95
delay and drain time, and Fig. 5's spread: the std across tenants of each tenant's delivered
bytes per ``period_s`` bin, averaged over the bins from the last tenant's start to the end
of the streams. Outputs: ``path_runs.csv``, ``path_summary.csv``, ``path_headline.json``,
plots ``path_fig6_setup_time.png`` and ``path_fig5_throughput_std.png``, one MLflow run.

With ``path.learned`` (``train.py env=path_shaping`` output directories) it also writes
``path_learned.csv`` (:func:`learned_table`): the learned policy of ``smart/PathShaping-v0``
per training seed against the baselines, and with ``path.baselines`` (``train.py
env=path_shaping agent=baselines`` directories) the hindsight value on the same episodes.
With ``path.bounds.seeds`` it writes ``path_bounds.csv`` and ``path_bounds_summary.csv``
(:mod:`agents.shaping.path_bounds`): on those seeds' test episodes, what a perfect priority
lane for the setups would gain over ``none``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from omegaconf import DictConfig

from delivery.sending_sim import BURST, STREAM, PathRecords, PathWorkload, simulate_path
from envs.seeding import derive_seed, rng
from envs.shaping.path_env import SETUP_VPC
from envs.shaping.sincon import ShapingError

from ..config import output_dir, to_dict
from ..tracking import tracked_run

__all__ = ["PATH_POLICIES", "WORKLOADS", "path_shaping", "path_workload", "run_path",
           "run_path_grid"]

PATH_POLICIES = ("none", "fifo", "static", "sincon")
WORKLOADS = ("same", "split")
_COLORS = {"none": "tab:red", "fifo": "tab:orange", "static": "tab:blue", "sincon": "tab:green"}


def _say(text: str) -> None:
    print(text, flush=True)


def path_workload(p: dict[str, Any], tenants: int, workload: str, seed: int
                  ) -> tuple[PathWorkload, list[int], list[float]]:
    """The workload of one run: (workload, the setup VPC of each tenant, each tenant's
    start). Tenant ``k`` is VPC ``k + 1``. The sending loop serves every tenant's setups
    from the start; those before a tenant's start are left out of the metrics."""
    if workload not in WORKLOADS:
        raise ShapingError(f"path.workloads: unknown workload {workload!r}; known: "
                           f"{list(WORKLOADS)}")
    g = rng(seed)
    stagger = float(p["tenant_stagger_s"])
    starts = [k * stagger + float(g.uniform(0, stagger)) if k else 0.0
              for k in range(tenants)]
    mean = int(p["burst_messages"])
    sizes = [int(g.integers(max(1, mean // 2), mean + mean // 2 + 1)) for _ in range(tenants)]
    setup = [k + 1 if workload == "same" else SETUP_VPC + k for k in range(tenants)]
    wl = PathWorkload(bursts=tuple((k + 1, sizes[k], starts[k]) for k in range(tenants)),
                      streams=tuple(setup), rate_hz=float(p["rate_hz"]),
                      duration_s=float(p["duration_s"]), size=int(p["size"]),
                      nodes=int(p["nodes"]))
    return wl, setup, starts


def path_shaping(policy: str, vpcs: list[int], g: float) -> dict[str, Any] | None:
    """The ``controller.shaping`` mapping of ``policy`` over the VPCs ``vpcs``."""
    if policy == "none":
        return None
    if policy == "fifo":
        return {"enabled": True, "policy": "static", "classes": 1, "global_throughput_Bps": g}
    if policy in ("static", "sincon"):
        return {"enabled": True, "policy": policy, "classes": len(vpcs),
                "tenant_class": {v: i for i, v in enumerate(vpcs)}, "global_throughput_Bps": g}
    raise ShapingError(f"path.policies: unknown policy {policy!r}; known: "
                       f"{list(PATH_POLICIES)}")


def _metrics(rec: PathRecords, setup: list[int], starts: list[float], p: dict[str, Any]
             ) -> dict[str, float]:
    """One run's numbers (see the module docstring)."""
    keep = np.ones(rec.vpc.size, dtype=bool)
    tenant_of = {v: k for k, v in enumerate(setup)}
    for v, k in tenant_of.items():  # a tenant's setups count from its start
        keep &= ~((rec.kind == STREAM) & (rec.vpc == v) & (rec.ts < starts[k]))
    d = (rec.applied - rec.ts) * 1e3
    st = keep & (rec.kind == STREAM)
    bu = rec.kind == BURST
    first = st & (rec.vpc == setup[0])
    last = st & (rec.vpc == setup[-1])
    # Fig. 5: bytes delivered per tenant and bin (setups and burst together)
    period = float(p["period_s"])
    t_from, t_to = max(starts), float(p["duration_s"])
    bins = np.arange(t_from, t_to + 1e-9, period)
    per = []
    for k in range(len(setup)):
        mine = keep & (((rec.kind == STREAM) & (rec.vpc == setup[k]))
                       | ((rec.kind == BURST) & (rec.vpc == k + 1)))
        h, _ = np.histogram(rec.applied[mine], bins=bins)
        per.append(h * float(p["size"]) / period)
    tput_std = float(np.mean(np.std(np.asarray(per), axis=0))) if len(bins) > 1 else 0.0
    drain = [float(rec.applied[bu & (rec.vpc == k + 1)].max() - starts[k])
             for k in range(len(setup)) if np.any(bu & (rec.vpc == k + 1))]
    return {"setup_mean_ms": float(d[st].mean()), "setup_p95_ms": float(np.percentile(d[st], 95)),
            "setup_first_tenant_ms": float(d[first].mean()),
            "setup_last_tenant_ms": float(d[last].mean()),
            "burst_p95_ms": float(np.percentile(d[bu], 95)) if bu.any() else float("nan"),
            "burst_drain_s": float(np.mean(drain)) if drain else float("nan"),
            "tput_std_Bps": tput_std, "setups": int(st.sum()), "pushes": rec.pushes}


def run_path_grid(p: dict[str, Any], tenants: list[int], seeds: int, seed: int
                  ) -> pd.DataFrame:
    """Every (workload, tenants, policy, seed) run of the path model; one row each."""
    policies = [str(x) for x in p["policies"]]
    workloads = [str(x) for x in p["workloads"]]
    for pol in policies:
        path_shaping(pol, [1], 1.0)  # unknown names fail before anything runs
    g = float(p["global_throughput_Bps"])
    rows = []
    total = len(workloads) * len(tenants) * seeds * len(policies)
    t0 = last = time.perf_counter()
    for wk in workloads:
        for n_t in tenants:
            for s in range(seeds):
                run_seed = derive_seed(seed, "shaping-path", s) % (2**31)
                wl, setup, starts = path_workload(p, int(n_t), wk, run_seed)
                vpcs = sorted({*setup, *(b[0] for b in wl.bursts)})
                for pol in policies:
                    rec = simulate_path(wl, path_shaping(pol, vpcs, g))
                    rows.append({"workload": wk, "tenants": int(n_t), "policy": pol,
                                 "seed": run_seed, **_metrics(rec, setup, starts, p)})
                    now = time.perf_counter()
                    if now - last > 10 or len(rows) == total:
                        last = now
                        _say(f"  {len(rows)}/{total} runs, {now - t0:.0f} s")
    return pd.DataFrame(rows)


def _summary(runs: pd.DataFrame) -> pd.DataFrame:
    metrics = [c for c in runs.columns if c not in ("workload", "tenants", "policy", "seed")]
    g = runs.groupby(["workload", "tenants", "policy"], sort=False)[metrics]
    out = g.mean().add_suffix("_mean").join(g.std(ddof=1).add_suffix("_std"))
    out.insert(0, "runs", g.size())
    return out.reset_index()


def _headline(runs: pd.DataFrame, tenants: int) -> dict[str, Any]:
    """Per workload, with ``tenants`` tenants: the setup-time factors of the paper's Fig. 6
    (``x`` over Sincon, paired by seed, mean and 95% interval), Fig. 5's spread factor, the
    growth of each policy's setup time from the fewest tenants to ``tenants``, and the last
    tenant's setups over the first's (Section II-B)."""
    out: dict[str, Any] = {"tenants": tenants}
    for wk, w in runs.groupby("workload", sort=False):
        h: dict[str, Any] = {}
        at = w[w.tenants == tenants]
        sin = at[at.policy == "sincon"].set_index("seed")
        for pol in sorted(set(at.policy) - {"sincon"}):
            other = at[at.policy == pol].set_index("seed")
            if len(sin):
                h[f"setup_{pol}_over_sincon"] = paired_ratio_ci(
                    other.setup_mean_ms, sin.setup_mean_ms)
                h[f"tput_std_{pol}_over_sincon"] = paired_ratio_ci(
                    other.tput_std_Bps, sin.tput_std_Bps)
        low = w[w.tenants == w.tenants.min()].groupby("policy").setup_mean_ms.mean()
        high = at.groupby("policy").setup_mean_ms.mean()
        h["setup_growth"] = {p: round(float(high[p] / low[p]), 3) for p in high.index}
        last_first = (at.setup_last_tenant_ms / at.setup_first_tenant_ms).groupby(
            at.policy).mean()
        h["last_over_first_tenant"] = {p: round(float(v), 3) for p, v in last_first.items()}
        out[wk] = h
    return out


def paired_ratio_ci(a: pd.Series, b: pd.Series) -> dict[str, float]:
    """The geometric mean of ``a / b`` over the seeds both have, with its 95% interval (a
    t interval on the log ratios)."""
    from envs.stats import ci95

    lr = np.log((a / b.reindex(a.index)).dropna().to_numpy(dtype=np.float64))
    m, h = (float(lr.mean()), ci95(lr)) if lr.size else (float("nan"), float("nan"))
    return {"ratio": round(float(np.exp(m)), 4), "low": round(float(np.exp(m - h)), 4),
            "high": round(float(np.exp(m + h)), 4), "seeds": int(lr.size)}


def _plots(summary: pd.DataFrame, out: Path, tenants: int) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    wks = list(dict.fromkeys(summary.workload))
    fig, axes = plt.subplots(1, len(wks), figsize=(5.0 * len(wks), 3.8), squeeze=False,
                             sharey=True)
    for ax, wk in zip(axes[0], wks):
        for pol, g in summary[summary.workload == wk].groupby("policy", sort=False):
            ax.errorbar(g.tenants, g.setup_mean_ms_mean, yerr=np.nan_to_num(g.setup_mean_ms_std),
                        marker="o", capsize=3, color=_COLORS.get(pol, "gray"), label=pol)
        ax.set_xlabel("tenants")
        ax.set_yscale("log")
        ax.set_xticks(sorted(set(summary.tenants)))
        ax.set_title(f"setups, workload {wk}", fontsize=10)
    axes[0][0].set_ylabel("mean setup delay (ms)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Fig. 6 on the controller's sending path", fontsize=11)
    fig.tight_layout()
    paths.append(out / "path_fig6_setup_time.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    at = summary[summary.tenants == tenants]
    fig, ax = plt.subplots(figsize=(5.2, 3.8))
    pols = list(dict.fromkeys(at.policy))
    width = 0.8 / max(1, len(pols))
    for i, pol in enumerate(pols):
        g = at[at.policy == pol].set_index("workload").reindex(wks)
        x = np.arange(len(wks)) + (i - (len(pols) - 1) / 2) * width
        ax.bar(x, g.tput_std_Bps_mean / 1e3, width, yerr=np.nan_to_num(g.tput_std_Bps_std) / 1e3,
               capsize=3, color=_COLORS.get(pol, "gray"), label=pol)
    ax.set_xticks(np.arange(len(wks)), [f"workload {w}" for w in wks])
    ax.set_ylabel("std of tenant throughput (kB/s)")
    ax.set_title(f"Fig. 5 on the sending path: {tenants} tenants", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "path_fig5_throughput_std.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def learned_table(run_dirs: list[str], baseline_dirs: list[str] | None = None) -> pd.DataFrame:
    """``smart/PathShaping-v0``'s learned policy per training run (its ``per_episode.csv``
    and ``learning_curve.csv``): the mean return of ``learned`` and of every baseline on the
    run's test episodes (with the baselines of any run in ``baseline_dirs`` on the same
    episodes, e.g. ``hindsight``), the learned policy's paired difference against ``none``
    (percent of ``none``'s return magnitude, 95% interval over the episodes) and the
    training step whose weights validation selected; then a ``mean`` row over the runs."""
    from envs.stats import ci95

    extra = []
    for d in baseline_dirs or []:
        f = Path(d) / "per_episode.csv"
        if not f.is_file():
            raise FileNotFoundError(f"path.baselines: {d} has no per_episode.csv")
        extra.append(pd.read_csv(f))
    more = pd.concat(extra) if extra else pd.DataFrame(columns=["policy", "seed", "return"])
    rows = []
    for d in run_dirs:
        f, lc = Path(d) / "per_episode.csv", Path(d) / "learning_curve.csv"
        if not f.is_file() or not lc.is_file():
            raise FileNotFoundError(f"path.learned: {d} is not a finished train.py "
                                    "env=path_shaping run (per_episode.csv, learning_curve.csv)")
        df = pd.read_csv(f)
        if "learned" not in set(df.policy) or "none" not in set(df.policy):
            raise ValueError(f"path.learned: {f} lacks the learned policy or none")
        df = pd.concat([df, more[more.seed.isin(df.seed) & ~more.policy.isin(df.policy)]])
        v = df.pivot_table(index="seed", columns="policy", values="return")
        diff = (v["learned"] - v["none"]) / v["none"].abs() * 100.0
        curve = pd.read_csv(lc).dropna(subset=["val/return"])
        row = {"run": Path(d).name, "episodes": len(v),
               **{f"return_{p}": float(v[p].mean()) for p in v.columns},
               "learned_vs_none_pct": float(diff.mean()),
               "learned_vs_none_ci95": ci95(diff.to_numpy()),
               "selected_step": int(curve.loc[curve["val/return"].idxmax(), "steps"])}
        rows.append(row)
    out = pd.DataFrame(rows)
    if len(out):
        mean = {"run": "mean", "episodes": int(out.episodes.sum())}
        for c in out.columns:
            if c.startswith("return_") or c == "learned_vs_none_pct":
                mean[c] = float(out[c].mean())
        mean["learned_vs_none_ci95"] = ci95(out.learned_vs_none_pct.to_numpy())
        out = pd.concat([out, pd.DataFrame([mean])], ignore_index=True)
    return out


def _bounds(b: dict[str, Any]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``path.bounds``: :mod:`agents.shaping.path_bounds` on the test episodes of the
    training seeds ``seeds`` of ``smart/PathShaping-v0`` with the settings of ``env``."""
    from omegaconf import OmegaConf

    from ..episodes import episode_seeds
    from .path_bounds import bounds_summary, bounds_table

    f = Path(str(b["env"]))
    if not f.is_file():
        raise ShapingError(f"path.bounds.env: {f} is not a file")
    kw = OmegaConf.to_container(OmegaConf.load(f).env.kwargs, resolve=True)
    n = int(b.get("episodes", 10))
    _say(f"hindsight bounds on {n} test episodes of seeds {list(b['seeds'])} ({f.name})")
    bt = bounds_table(kw, [(int(s), episode_seeds(int(s), "test", n)) for s in b["seeds"]])
    return bt, bounds_summary(bt)


def run_path(cfg: DictConfig) -> dict[str, Any]:
    """The sending-path reproduction (see the module docstring)."""
    out = output_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    p = to_dict(cfg.path) or {}
    tenants = [int(t) for t in cfg.tenants]
    t0 = time.perf_counter()
    with tracked_run(cfg, run_name=f"shaping_path__t{max(tenants)}__s{cfg.seed}",
                     tags={"task": "shaping", "model": "controller"}) as mlog:
        _say(f"shaping on the sending path: tenants {tenants}, policies {p['policies']}, "
             f"workloads {p['workloads']}, {cfg.seeds} seeds each")
        runs = run_path_grid(p, tenants, int(cfg.seeds), int(cfg.seed))
        summary = _summary(runs)
        mlog.table(runs, out / "path_runs.csv")
        mlog.table(summary, out / "path_summary.csv")
        plots = _plots(summary, out, max(tenants))
        for f in plots:
            mlog.artifact(f, "plots")
        learned = [str(x) for x in p.get("learned") or []]
        if learned:
            lt = learned_table(learned, [str(x) for x in p.get("baselines") or []])
            mlog.table(lt, out / "path_learned.csv")
            _say(lt.to_string(index=False))
        bounds = p.get("bounds") or {}
        if bounds.get("seeds"):
            bt, bs = _bounds(bounds)
            mlog.table(bt, out / "path_bounds.csv")
            mlog.table(bs, out / "path_bounds_summary.csv")
            _say(bs.to_string(index=False))
        head = _headline(runs, max(tenants))
        (out / "path_headline.json").write_text(json.dumps(head, indent=2))
        mlog.text(json.dumps(head, indent=2), "path_headline.json")
        for _, row in summary.iterrows():
            mlog.metrics({f"{row.workload}/t{row.tenants}/{row.policy}/{k}": row[f"{k}_mean"]
                          for k in ("setup_mean_ms", "setup_p95_ms", "tput_std_Bps")})
    _say(f"shaping (sending path) done in {time.perf_counter() - t0:.0f} s; results in {out}")
    _say(json.dumps(head, indent=2))
    return {"runs": runs, "summary": summary, "plots": plots, "headline": head, "out_dir": out}
