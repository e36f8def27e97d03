"""The RPC-pattern study of the edge paper (Rojas Balderrama and Simonin, Sections II-IV) on
our two channels, as a benchmark: unicast, multicast and anycast as RPC pushes and as MQ
publishes (:mod:`delivery.patterns`), scaled in agents (the paper's Fig. 2 and Table II) and
under link delay and loss between the core and the agents (Fig. 3, Table III).

Usage (Hydra, ``configs/patterns.yaml``; needs root for the emulated network)::

    python bench/bench_rpc_patterns.py                       # every part, then the report
    python bench/bench_rpc_patterns.py run=[scale] out_dir=D # one part into D (resumable)
    python bench/bench_rpc_patterns.py run=[] out_dir=D      # the report of D only
    python bench/bench_rpc_patterns.py --quick               # a smoke test (run_all.py)

Writes ``D/runs.jsonl`` (one row per workload run), the report's CSV and PNG files under
``bench/results/rpc_patterns/``, ``bench/results/bench_rpc_patterns.json`` and an MLflow run.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, finish, log, md_table

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import agents.config  # noqa: F401  (registers the ${project_root:} resolver)

KEYS = ["part", "agents", "delay_ms", "loss", "workload"]
METRICS = ["p50_ms", "p95_ms", "p99_ms", "max_ms", "ack_p50_ms", "sender_cpu_util",
           "sender_cpu_s", "sender_rss_mb", "broker_cpu_util", "broker_rss_mb", "sender_tcp",
           "broker_tcp", "ctl_ns_tcp", "brk_ns_tcp", "send_loop_ms_mean", "send_s", "wall_s",
           "lost", "errors", "relay0_cpu_util", "relay1_cpu_util", "agents_cpu_s"]
ORDER = ["unicast/rpc/call", "unicast/rpc/cast", "unicast/mq/cast", "multicast/rpc/fanout",
         "multicast/mq/fanout", "anycast/rpc/call", "anycast/rpc/cast", "anycast/mq/cast"]


def load_runs(out: Path) -> pd.DataFrame:
    f = out / "runs.jsonl"
    if not f.exists():
        return pd.DataFrame()
    return pd.DataFrame([json.loads(ln) for ln in f.read_text().splitlines() if ln.strip()])


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Median, min and max over the repetitions of each point's metrics; failures counted."""
    cols = [c for c in METRICS if c in df.columns]
    g = df.groupby(KEYS, sort=False)
    med = g[cols].median()
    out = med.join(g[cols].min().add_suffix("_min")).join(g[cols].max().add_suffix("_max"))
    out["repeats"] = g.size()
    out["failed_runs"] = g["failed"].sum()
    return out.reset_index()


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares slope and intercept (NaN if fewer than two distinct x)."""
    ok = np.isfinite(x) & np.isfinite(y)
    if len(set(x[ok])) < 2:
        return float("nan"), float("nan")
    a, b = np.polyfit(x[ok], y[ok], 1)
    return float(a), float(b)


def delay_model(df: pd.DataFrame) -> dict[str, Any]:
    """The figures a delay model takes (each from the raw runs, all repetitions)."""
    out: dict[str, Any] = {}
    sc = df[df.part == "scale"]
    for w in ORDER:
        s = sc[sc.workload == w]
        if s.empty:
            continue
        dests = s.expected.astype(float)
        key = w.replace("/", "_")
        out[f"{key}: sender CPU ms per delivered message"] = float(
            np.median(1e3 * s.sender_cpu_s / dests))
        if "broker_cpu_s" in s and s.channel.iloc[0] == "mq":
            out[f"{key}: broker CPU ms per delivered message"] = float(
                np.median(1e3 * s.broker_cpu_s / dests))
        a, b = _fit(s.agents.to_numpy(float), s.p50_ms.to_numpy(float))
        out[f"{key}: p50 latency ms per agent (slope), intercept ms"] = [a, b]
        a, b = _fit(s.agents.to_numpy(float), s.p99_ms.to_numpy(float))
        out[f"{key}: p99 latency ms per agent (slope), intercept ms"] = [a, b]
    fan = sc[sc.workload == "multicast/rpc/fanout"]
    if not fan.empty:
        a, b = _fit(fan.agents.to_numpy(float), fan.send_loop_ms_mean.to_numpy(float))
        out["multicast_rpc_fanout: sender time to issue one destination's push (ms), "
            "fixed (ms)"] = [a, b]
    ns = df[df.part == "nosync"]
    for w in ORDER:
        a, b = ns[ns.workload == w], sc[(sc.workload == w) & sc.agents.isin(set(ns.agents))]
        if not a.empty and not b.empty:
            out[f"{w.replace('/', '_')}: p50 ms with the journal fsynced minus without"] = \
                float(b.p50_ms.median() - a.p50_ms.median())
    gr = df[df.part == "grid"]
    for w in ORDER:
        s = gr[gr.workload == w]
        if s.empty:
            continue
        key = w.replace("/", "_")
        direct = sc[(sc.workload == w) & sc.agents.isin(set(s.agents))]
        relayed = s[(s.delay_ms == 0) & (s.loss == 0)]
        if not direct.empty and not relayed.empty:
            out[f"{key}: p50 ms the relay itself adds (delay 0, vs the kernel path)"] = float(
                relayed.p50_ms.median() - direct.p50_ms.median())
        z = s[s.loss == 0]
        a, _ = _fit(z.delay_ms.to_numpy(float), z.p50_ms.to_numpy(float))
        out[f"{key}: added p50 latency per ms of link delay"] = a
        for d in sorted(set(s.delay_ms)):
            base = s[(s.delay_ms == d) & (s.loss == 0)]
            hi = s[(s.delay_ms == d) & (s.loss == s.loss.max())]
            if base.empty or hi.empty or s.loss.max() == 0:
                continue
            pct = 100 * float(s.loss.max())
            for q in ("p50_ms", "p95_ms", "p99_ms"):
                out[f"{key}: added {q[:3]} ms per % loss at delay {d:g} ms"] = float(
                    (hi[q].median() - base[q].median()) / pct)
    return out


def plots(df: pd.DataFrame, summ: pd.DataFrame, res: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    style = {"rpc": "-", "mq": "--"}
    colors = dict(zip(ORDER, plt.get_cmap("tab10").colors, strict=False))

    def cdf_panel(ax: Any, sub: pd.DataFrame, title: str) -> None:
        for w in ORDER:
            rows = sub[sub.workload == w]
            if rows.empty:
                continue
            vals = np.concatenate([np.asarray(c, float) for c in rows.cdf_ms if len(c)])
            if vals.size == 0:
                continue
            xs = np.sort(vals)
            ax.plot(xs, np.linspace(0, 1, xs.size), style[w.split("/")[1]], color=colors[w],
                    label=w)
        ax.set_xscale("log")
        ax.set_xlabel("latency (ms; call: round trip, else one way)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)

    sc = df[df.part == "scale"]
    if not sc.empty:
        ns = sorted(set(sc.agents))
        fig, axes = plt.subplots(1, len(ns), figsize=(4.2 * len(ns), 3.6), squeeze=False)
        for ax, n in zip(axes[0], ns, strict=True):
            cdf_panel(ax, sc[sc.agents == n], f"{n} agents, no delay, no loss")
        axes[0][0].set_ylabel("CDF")
        axes[0][-1].legend(fontsize=7)
        fig.suptitle("Latency CDFs by number of agents (all repetitions)")
        paths.append(_save(fig, res / "cdf_scale.png"))
        s = summ[summ.part == "scale"]
        panels = [("p50_ms", "p50 latency (ms)"), ("p99_ms", "p99 latency (ms)"),
                  ("sender_cpu_util", "sender CPU (cores)"),
                  ("broker_cpu_util", "broker CPU (cores)"), ("sender_tcp", "sender TCP conns"),
                  ("broker_tcp", "broker TCP conns")]
        fig, axes = plt.subplots(2, 3, figsize=(14, 7))
        for ax, (col, title) in zip(axes.flat, panels, strict=True):
            if col not in s:
                continue
            for w in ORDER:
                g = s[s.workload == w].sort_values("agents")
                if g.empty:
                    continue
                lo = (g[col] - g[f"{col}_min"]).clip(lower=0)
                hi = (g[f"{col}_max"] - g[col]).clip(lower=0)
                ax.errorbar(g.agents, g[col], yerr=[lo, hi], fmt=style[w.split("/")[1]],
                            marker="o", ms=3, capsize=2, color=colors[w], label=w)
            ax.set_xscale("log")
            if col.endswith("_ms"):
                ax.set_yscale("log")
            ax.set_xlabel("agents")
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.suptitle("Scale: metrics vs agents (median over repetitions, bars min-max)")
        paths.append(_save(fig, res / "scale.png"))
    gr = df[df.part == "grid"]
    if not gr.empty:
        s = summ[summ.part == "grid"]
        losses = sorted(set(s.loss))
        fig, axes = plt.subplots(2, len(losses), figsize=(4.5 * len(losses), 7), squeeze=False)
        for j, loss in enumerate(losses):
            for i, col in enumerate(("p50_ms", "p99_ms")):
                ax = axes[i][j]
                for w in ORDER:
                    g = s[(s.workload == w) & (s.loss == loss)].sort_values("delay_ms")
                    if g.empty:
                        continue
                    ax.plot(g.delay_ms, g[col], style[w.split("/")[1]], marker="o", ms=3,
                            color=colors[w], label=w)
                ax.set_xlabel("link delay (ms, each way)")
                ax.set_title(f"{col[:3]} latency (ms), loss {100 * loss:g}%", fontsize=9)
                ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"Delay x loss at {int(s.agents.iloc[0])} agents (median over "
                     "repetitions)")
        paths.append(_save(fig, res / "grid.png"))
        delays = sorted(set(gr.delay_ms))
        fig, axes = plt.subplots(1, len(delays), figsize=(4.2 * len(delays), 3.6),
                                 squeeze=False)
        for ax, d in zip(axes[0], delays, strict=True):
            cdf_panel(ax, gr[(gr.delay_ms == d) & (gr.loss == gr.loss.max())],
                      f"delay {d:g} ms, loss {100 * gr.loss.max():g}%")
        axes[0][-1].legend(fontsize=7)
        fig.suptitle("Latency CDFs under delay, at the highest loss")
        paths.append(_save(fig, res / "cdf_grid.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pivots(summ: pd.DataFrame) -> str:
    """Compact markdown tables: p50 / p99 (ms) per workload by agents (scale) and by delay
    and loss (grid), system metrics by agents, each cell the median over repetitions."""
    parts = []
    for part, col in (("scale", "agents"), ("nosync", "agents")):
        s = summ[summ.part == part]
        if s.empty:
            continue
        cols = sorted(set(s[col]))
        rows = [[w, *(_pq(s[(s.workload == w) & (s[col] == c)]) for c in cols)]
                for w in ORDER if w in set(s.workload)]
        parts.append(f"### {part}: p50 / p99 latency (ms) by agents\n\n"
                     + md_table(["workload", *(f"{c} agents" for c in cols)], rows))
        sysrows = []
        for c in cols:
            g = s[s[col] == c]
            rpc, mq = g[g.channel_is_rpc], g[~g.channel_is_rpc]
            sysrows.append([int(c), f"{g.sender_tcp.max():.0f}", f"{g.broker_tcp.max():.0f}",
                            f"{g.sender_rss_mb.max():.0f}", f"{g.broker_rss_mb.max():.0f}",
                            f"{100 * rpc.sender_cpu_util.max():.0f}%",
                            f"{100 * mq.sender_cpu_util.max():.0f}%",
                            f"{100 * mq.broker_cpu_util.max():.0f}%"])
        parts.append(f"### {part}: system metrics by agents (max over workloads)\n\n" + md_table(
            ["agents", "sender TCP", "broker TCP", "sender RSS MB", "broker RSS MB",
             "sender CPU (RPC runs)",
             "sender CPU (MQ runs)", "broker CPU (MQ runs)"], sysrows))
    g = summ[summ.part == "grid"]
    if not g.empty:
        pts = sorted({(d, x) for d, x in zip(g.delay_ms, g.loss, strict=True)})
        rows = [[w, *(_pq(g[(g.workload == w) & (g.delay_ms == d) & (g.loss == x)])
                      for d, x in pts)] for w in ORDER if w in set(g.workload)]
        parts.append(f"### grid ({int(g.agents.iloc[0])} agents): p50 / p99 latency (ms) by "
                     "delay and loss\n\n" + md_table(
                         ["workload", *(f"{d:g} ms, {100 * x:g}%" for d, x in pts)], rows))
    return "\n\n".join(parts) + "\n"


def _pq(r: pd.DataFrame) -> str:
    if r.empty:
        return "-"
    fails = int(r.failed_runs.sum())
    return (f"{r.p50_ms.iloc[0]:.1f} / {r.p99_ms.iloc[0]:.0f}"
            + (f" ({fails} failed)" if fails else ""))


def report(cfg: DictConfig, out: Path, total_s: float) -> None:
    from agents.tracking import tracked_run

    df = load_runs(out)
    if df.empty:
        log(f"no runs in {out}")
        return
    res = Path(str(cfg.results_dir))
    res.mkdir(parents=True, exist_ok=True)
    summ = summarize(df)
    summ["channel_is_rpc"] = summ.workload.str.contains("/rpc/")
    (res / "tables.md").write_text(pivots(summ))  # also the result JSON's table
    raw = df.drop(columns=["cdf_ms"])
    raw.to_csv(res / "runs.csv", index=False)
    summ.to_csv(res / "summary.csv", index=False)
    model = delay_model(df)
    (res / "delay_model.json").write_text(json.dumps(model, indent=2) + "\n")
    pngs = plots(df, summ, res)
    table = pivots(summ)
    machine = {"host_cpus": __import__("os").cpu_count()}
    with tracked_run(cfg, run_name="rpc_patterns", tags={"task": "rpc-patterns"}) as mlog:
        for _, r in summ.iterrows():
            key = f"{r.part}/n{int(r.agents)}/d{r.delay_ms:g}/l{r.loss:g}/{r.workload}"
            mlog.metrics({f"{key}/{m}": float(r[m]) for m in ("p50_ms", "p95_ms", "p99_ms",
                                                              "sender_cpu_util")
                          if m in r and np.isfinite(r[m])})
        mlog.table(raw, res / "runs.csv")
        mlog.table(summ, res / "summary.csv")
        for p in pngs:
            mlog.artifact(p, "plots")
        mlog.text(json.dumps(model, indent=2), "delay_model.json")
        mlog.text(OmegaConf.to_yaml(cfg, resolve=True), "patterns_config.yaml")
    notes = [f"raw runs: {out / 'runs.jsonl'}; CSV and PNG: {res}",
             "latency: call = round trip at the sender; cast / fanout = one way (receive time "
             "minus generation time, one host clock); CPU: process CPU time / run wall time "
             "(100% = one core); TCP: established connections of the process (ss)",
             "failed = runs that missed the SLA (2 x planned duration + 5 s) / repetitions",
             f"delay model (all figures: {res / 'delay_model.json'}): " + json.dumps(
                 {k: (round(v, 3) if isinstance(v, float) else [round(x, 3) for x in v])
                  for k, v in model.items() if any(s in k for s in (
                      "per ms of link delay", "issue one destination", "fsynced",
                      "relay itself", "p99 ms per % loss at delay 0 "))})]
    finish("bench_rpc_patterns", {"settings": OmegaConf.to_container(cfg.study),
                                  "parts": OmegaConf.to_container(cfg.parts),
                                  "repeats": int(cfg.repeats), "out_dir": str(out),
                                  "summary": summ.to_dict("records"), "delay_model": model,
                                  "machine_extra": machine, "total_s": total_s},
           table, notes, total_s)


@hydra.main(config_path="../configs", config_name="patterns", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from delivery.patterns import StudyConfig, run_study
    from security.tls import Security

    out = Path(str(cfg.out_dir))
    out.mkdir(parents=True, exist_ok=True)
    study = StudyConfig.from_mapping(OmegaConf.to_container(cfg.study, resolve=True))
    sec = Security.from_mapping(OmegaConf.to_container(cfg.security, resolve=True))
    parts = OmegaConf.to_container(cfg.parts, resolve=True)
    t0 = time.perf_counter()
    for part in cfg.run:
        log(f"rpc patterns: part {part} into {out}")
        run_study(parts, [str(part)], int(cfg.repeats), study, sec, out,
                  heap=str(cfg.broker.heap), say=log)
    report(cfg, out, time.perf_counter() - t0)


#: ``--quick`` (bench/run_all.py): a smoke test of every part, not representative
QUICK = ["repeats=1", "parts.scale.agents=[10,50]", "parts.grid.agents=[10]",
         "parts.grid.delay_ms=[0,10]", "parts.grid.loss=[0.0,0.01]", "parts.nosync.agents=[10]"]

if __name__ == "__main__":
    from envs.quiet import quiet

    quiet()
    if "--quick" in sys.argv:
        sys.argv = [a for a in sys.argv if a != "--quick"] + QUICK
    main()
