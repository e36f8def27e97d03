"""``python testbed.py``: the testbed experiments of SMART Section VII-D (configs/testbed.yaml).

Fig. 9: the number of VPCs scaled (64..1,024; traffic grows linearly with them), one run per
policy and point. Fig. 10: the scenario's five burst phases (50/80/95/80/50% of 30 MB/s), one
run per policy, measured per interval. Every run starts fresh agents and a fresh metadata
store on the same broker (:func:`delivery.testbed.run_once`). Results: ``fig9.csv``,
``fig10.csv`` (per interval) and ``summary.csv`` in the run directory, PNG plots, and an MLflow
run (config, metrics, tables, plots).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from envs.dsmd.problems import problems_for
from security.tls import Security

from .health import ConfigError
from .testbed import RunResult, RunSpec, run_once

__all__ = ["run_testbed", "speedups"]


def _say(text: str) -> None:
    print(text, flush=True)


def _security(cfg: DictConfig) -> Security:
    """The ``security:`` block (every channel's: broker, agents, controller, server)."""
    block = cfg.get("security")
    return Security.from_mapping(OmegaConf.to_container(block, resolve=True)
                                 if isinstance(block, DictConfig) else block)


def _trust_keys(cfg: DictConfig) -> list[str]:
    """``bundle_trust.keys``: public keys trusted beside the PKI's (the server's and the
    adapter's), e.g. the committed example bundle's."""
    block = cfg.get("bundle_trust") or {}
    return [str(k) for k in (block.get("keys") or [])]


def _server_overrides(cfg: DictConfig) -> list[str]:
    keys = _trust_keys(cfg)
    return [f"bundle_trust.keys=[{','.join(keys)}]"] if keys else []


@contextlib.contextmanager
def _broker(cfg: DictConfig, sec: Security) -> Iterator[tuple[str, str | None]]:
    """(service URL, admin URL) of the broker: ``broker.url`` / ``broker.admin_url`` of an
    existing one, or one started here with ``sec``."""
    if cfg.broker.url:
        admin = cfg.broker.get("admin_url")
        yield str(cfg.broker.url), None if not admin else str(admin)
        return
    from .broker import PulsarStandalone

    with PulsarStandalone(heap=str(cfg.broker.heap), security=sec) as b:
        yield b.service_url, b.admin_url


@contextlib.contextmanager
def _policy_server(cfg: DictConfig, out: Path, sec: Security
                   ) -> Iterator[tuple[str | None, str | None]]:
    if "learned" not in cfg.policies:
        yield None, None
        return
    if not cfg.bundle:
        raise ValueError("the learned policy needs `bundle=<policy bundle directory>`")
    from serving.local import LocalServer

    key = secrets.token_hex(8)
    with LocalServer(str(cfg.bundle), out / "server", api_key=key, security=sec,
                     overrides=_server_overrides(cfg)) as srv:
        yield srv.url, key


def _spec(cfg: DictConfig, label: str, policy: str, problems, windows: list[int],
          server: tuple[str | None, str | None], sec: Security) -> RunSpec:
    return RunSpec(label, policy, problems, windows, time_scale=float(cfg.time_scale),
                   payload_scale=float(cfg.payload_scale), flush_ms=float(cfg.flush_ms),
                   agent_processes=int(cfg.agent_processes), adapter_mode=str(cfg.adapter_mode),
                   server_url=server[0], api_key=server[1],
                   controller=_controller_overrides(cfg), security=sec,
                   bundle_trust_keys=tuple(_trust_keys(cfg)))


def _controller_overrides(cfg: DictConfig) -> dict[str, Any]:
    """The ``delivery:`` block (ControllerConfig keys: outbox, failover, shaping, ...)."""
    block = cfg.get("delivery") or {}
    out = OmegaConf.to_container(block, resolve=True) if isinstance(block, DictConfig) \
        else dict(block)
    if not isinstance(out, dict):
        raise ConfigError(f"delivery: expected a mapping, got {out!r}")
    return {str(k): v for k, v in out.items()}


def speedups(df: pd.DataFrame, metric: str = "delay_p95_ms", of: str = "learned"
             ) -> dict[str, float]:
    """How many times lower ``of``'s ``metric`` is than each other policy's."""
    if df.empty or of not in set(df.policy):
        return {}
    mine = float(df.loc[df.policy == of, metric].iloc[0])
    return {p: float(v) / mine for p, v in zip(df.policy, df[metric]) if p != of and mine > 0}


def run_testbed(cfg: DictConfig) -> dict[str, Any]:
    from agents.tracking import tracked_run

    out = Path(str(cfg.out_dir))
    out.mkdir(parents=True, exist_ok=True)
    policies = list(cfg.policies)
    t_start = time.perf_counter()
    results: dict[str, list[RunResult]] = {"fig9": [], "fig10": []}
    sec = _security(cfg)
    with tracked_run(cfg, run_name=f"testbed__{cfg.scenario}",
                     tags={"task": "testbed"}) as mlog, _broker(cfg, sec) as (url, admin), \
            _policy_server(cfg, out, sec) as server:
        mode = "INSECURE" if sec.insecure else "mutual TLS"
        _say(f"testbed: broker {url} ({mode}); policies {policies}; figures {list(cfg.figures)}; "
             f"time x{cfg.time_scale}, payload x{cfg.payload_scale}")
        runs = []
        if "fig9" in cfg.figures:
            for v in cfg.fig9.vpcs:
                base = problems_for(str(cfg.scenario))
                iv = float(base.spec.interval_s)
                n_win = int(cfg.fig9.windows) + 1
                ps = problems_for(str(cfg.scenario), {
                    "num_vpcs": int(v), "rate_per_vpc_bps": float(cfg.fig9.rate_per_vpc_bps),
                    "peak_rate_bps": None, "phases": [], "duration_s": n_win * iv})
                runs += [("fig9", f"fig9/vpcs={v}", p, ps, list(range(n_win)), int(v))
                         for p in policies]
        if "fig10" in cfg.figures:
            ps = problems_for(str(cfg.scenario))
            runs += [("fig10", "fig10", p, ps, [int(w) for w in cfg.fig10.windows], None)
                     for p in policies]
        for i, (fig, label, pol, ps, wins, v) in enumerate(runs):
            _say(f"[{i + 1}/{len(runs)}] {label} {pol}: {ps.num_nodes} agents, windows "
                 f"{wins[0]}..{wins[-1]} ({elapsed(t_start)})")
            r = run_once(_spec(cfg, label, pol, ps, wins, server, sec), url,
                         out / "runs" / f"{label.replace('/', '_')}_{pol}", say=_say,
                         admin_url=admin)
            r.summary["figure"] = fig
            r.summary["vpcs"] = v if v is not None else int(ps.spec.num_vpcs)
            results[fig].append(r)
            s = r.summary
            _say(f"    {s['messages']} messages, applied {s['applied']}; controller "
                 f"{s['controller_bytes'] / 1e6:.2f} MB, {s['controller_messages']} msgs, "
                 f"CPU {100 * s['controller_cpu_util']:.0f}%; nodes total "
                 f"{s['node_bytes_total'] / 1e6:.2f} MB, max {s['node_bytes_max'] / 1e6:.3f} "
                 f"MB; delay p95 {s['delay_p95_ms']:.1f} ms, max {s['delay_max_ms']:.1f} ms")
            mlog.metrics({f"{label.replace('=', '')}/{pol}/{k}": float(s[k]) for k in (
                "delay_p95_ms", "delay_max_ms", "controller_bytes", "controller_messages",
                "controller_cpu_util", "node_bytes_total", "node_bytes_max")})
        tables = _tables(results, out)
        plots = _plots(tables, out, str(cfg.scenario))
        for name, df in tables.items():
            mlog.table(df, out / f"{name}.csv")
        for p in plots:
            mlog.artifact(p, "plots")
        head = _headline(tables)
        (out / "headline.json").write_text(json.dumps(head, indent=2))
        mlog.text(json.dumps(head, indent=2), "headline.json")
        mlog.text(OmegaConf.to_yaml(cfg, resolve=True), "testbed_config.yaml")
    _say(f"testbed done in {elapsed(t_start)}; results in {out}")
    _say(json.dumps(head, indent=2))
    return {"tables": tables, "plots": plots, "headline": head, "out_dir": out}


def elapsed(t0: float) -> str:
    s = time.perf_counter() - t0
    return f"{s / 60:.1f} min" if s >= 120 else f"{s:.0f} s"


def _tables(results: dict[str, list[RunResult]], out: Path) -> dict[str, pd.DataFrame]:
    tables = {}
    rows = [r.summary for fig in results.values() for r in fig]
    if rows:
        tables["summary"] = pd.DataFrame(rows)
    if results["fig9"]:
        tables["fig9"] = pd.DataFrame([r.summary for r in results["fig9"]])
    if results["fig10"]:
        tables["fig10"] = pd.DataFrame([{"policy": r.policy, **b} for r in results["fig10"]
                                        for b in r.buckets])
    for name, df in tables.items():
        df.to_csv(out / f"{name}.csv", index=False)
    return tables


def _headline(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    head: dict[str, Any] = {}
    if "fig9" in tables:
        df = tables["fig9"]
        for v in sorted(set(df.vpcs)):
            sp = speedups(df[df.vpcs == v])
            if sp:
                head[f"fig9 vpcs={v}: p95 delay speedup of learned over"] = {
                    k: round(x, 2) for k, x in sp.items()}
    if "summary" in tables:
        df = tables["summary"]
        f10 = df[df.figure == "fig10"]
        if not f10.empty:
            sp = speedups(f10)
            head["fig10 (all phases): p95 delay speedup of learned over"] = {
                k: round(x, 2) for k, x in sp.items()}
    return head


def _plots(tables: dict[str, pd.DataFrame], out: Path, scenario: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    panels = [("controller_bytes", "traffic on controller (MB)", 1e-6),
              ("controller_cpu_util", "controller CPU (% of a core)", 100.0),
              ("node_bytes_total", "total traffic on CNs (MB)", 1e-6),
              ("delay_p95_ms", "delivery delay p95 (ms)", 1.0)]
    if "fig9" in tables:
        df = tables["fig9"]
        fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
        for ax, (col, _title, k) in zip(axes, panels):
            for pol, grp in df.groupby("policy", sort=False):
                g = grp.sort_values("vpcs")
                if col == "delay_p95_ms":
                    lo = (g[col] - g["delay_p50_ms"]).clip(lower=0)
                    hi = (g["delay_max_ms"] - g[col]).clip(lower=0)
                    ax.errorbar(g.vpcs, g[col], yerr=[lo, hi], marker="o", capsize=3,
                                label=pol)
                else:
                    ax.plot(g.vpcs, g[col] * k, marker="o", label=pol)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("# of VPCs")
        paths.append(_finish(plt, fig, axes, panels, out / "fig9_testbed.png",
                             f"Fig. 9 on the loopback testbed ({scenario}; delay bars: p50 "
                             "to max)"))
    if "fig10" in tables:
        df = tables["fig10"]
        fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
        for ax, (col, _title, k) in zip(axes, panels):
            for pol, g in df.groupby("policy", sort=False):
                ax.plot(np.arange(len(g)), g[col] * k, marker="o", label=pol)
            ax.set_xlabel("interval of the replay")
        paths.append(_finish(plt, fig, axes, panels, out / "fig10_testbed.png",
                             f"Fig. 10 on the loopback testbed ({scenario}: burst phases)"))
    return paths


def _finish(plt, fig, axes, panels, path: Path, title: str) -> Path:
    """Panel titles, grid, legend and suptitle of a four-panel testbed figure; saved."""
    for ax, (_, name, _) in zip(axes, panels):
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
