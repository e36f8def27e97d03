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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from envs.dsmd.problems import problems_for
from envs.netutil import BROKER_ADDRESS
from security.tls import Security

from .health import ConfigError
from .netem import NetworkSpec
from .testbed import RunResult, RunSpec, run_once

__all__ = ["FigurePoint", "figure_points", "run_testbed", "speedups"]


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
    existing one, or one started here with ``sec`` (in the emulated network's broker
    namespace when there is one)."""
    tag = _network_tag(cfg)
    if cfg.broker.url and not tag:
        admin = cfg.broker.get("admin_url")
        yield str(cfg.broker.url), None if not admin else str(admin)
        return
    from harness.broker import PulsarStandalone

    where = {"host": BROKER_ADDRESS, "netns": f"{tag}-brk"} if tag else {}
    with PulsarStandalone(heap=str(cfg.broker.heap), security=sec, **where) as b:
        yield b.service_url, b.admin_url


def _network_tag(cfg: DictConfig) -> str | None:
    """The emulated network this process runs in (set by :func:`_run_in_network`)."""
    net = cfg.get("network") or {}
    return str(net.get("inside")) if net.get("inside") else None


def network_spec(cfg: DictConfig, problems) -> NetworkSpec:
    """The emulated network of a testbed configuration: the scenario's capacities (C_b,
    s(n)) scaled like the traffic (``payload_scale / time_scale``, or
    ``network.capacity_scale``), unless ``network.controller_bps`` / ``node_bps`` give them
    in wire bit/s."""
    net = cfg.network
    if net.get("control_allowance") and float(net.get("settle_s") or 0.0) <= 0:
        raise ConfigError("network.control_allowance needs network.settle_s > 0 (the idle "
                          "traffic is measured while the link settles)")
    spec = problems.spec
    scale = net.get("capacity_scale")
    scale = float(cfg.payload_scale) / float(cfg.time_scale) if scale is None else float(scale)
    c_b = net.get("controller_bps")
    s_n = net.get("node_bps")
    return NetworkSpec(
        problems.dataset.topology.node_ids.astype(int).tolist(),
        controller_bps=float(c_b) if c_b is not None else spec.controller_bw_bps * scale,
        node_bps=float(s_n) if s_n is not None else spec.node_bandwidth_bps * scale,
        loss=float(net.get("loss") or 0.0), queue_ms=float(net.get("queue_ms") or 200.0))


def _run_in_network(cfg: DictConfig) -> dict[str, Any]:
    """Fetch the broker's jars when it is started here (once; the namespaces cannot reach
    Maven Central), build the emulated network, run this testbed inside its controller
    namespace (a child ``python -m delivery.experiment``), remove the network (also on
    failure), and return what the child wrote."""
    import subprocess
    import sys

    from .netem import EmulatedNetwork

    out = Path(str(cfg.out_dir))
    out.mkdir(parents=True, exist_ok=True)
    ps = problems_for(str(cfg.scenario))
    spec = network_spec(cfg, ps)
    sec = _security(cfg)
    if not sec.insecure:  # certificates naming the emulated addresses (dev PKI)
        sec.pki.refresh_addresses(["controller", "broker", "policy-server",
                                   *(f"agent-{n}" for n in spec.nodes)])
    if not cfg.broker.url:  # the namespaces have no route out: fetch the broker's jars here
        from harness.broker import fetch_pulsar
        fetch_pulsar()
    with EmulatedNetwork(spec) as net:
        inner = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(inner, dict)
        inner["network"]["inside"] = net.tag
        inner["network"]["description"] = net.describe()
        f = out / "testbed_config.inner.yaml"
        OmegaConf.save(OmegaConf.create(inner), f)
        _say(f"emulated network {net.tag}: {len(spec.nodes)} node namespaces; C_b "
             f"{spec.controller_bps / 1e6:.3g} Mbit/s, s(n) {spec.node_bps / 1e6:.3g} Mbit/s "
             f"(wire), loss {spec.loss:g}; C_p {ps.spec.controller_cpu} in-flight sends")
        rc = subprocess.run([*net.exec_prefix(net.controller), sys.executable, "-m",
                             "delivery.experiment", "--config", str(f)],
                            cwd=Path(__file__).resolve().parents[1], check=False).returncode
    if rc != 0:
        raise RuntimeError(f"the testbed inside the emulated network failed (exit code {rc}); "
                           f"its output is above, its files in {out}")
    tables = {p.stem: pd.read_csv(p) for p in out.glob("*.csv")}
    head = json.loads((out / "headline.json").read_text())
    return {"tables": tables, "plots": sorted(out.glob("*.png")), "headline": head,
            "out_dir": out}


@contextlib.contextmanager
def _policy_server(cfg: DictConfig, out: Path, sec: Security
                   ) -> Iterator[tuple[str | None, str | None]]:
    if "learned" not in cfg.policies:
        yield None, None
        return
    if not cfg.bundle:
        raise ValueError("the learned policy needs `bundle=<policy bundle directory>`")
    from serving.local import LocalServer

    key = secrets.token_urlsafe(32)
    with LocalServer(str(cfg.bundle), out / "server", api_key=key, security=sec,
                     overrides=_server_overrides(cfg)) as srv:
        yield srv.url, key


def _spec(cfg: DictConfig, label: str, policy: str, problems, windows: list[int],
          server: tuple[str | None, str | None], sec: Security) -> RunSpec:
    return RunSpec(label, policy, problems, windows, time_scale=float(cfg.time_scale),
                   payload_scale=float(cfg.payload_scale), flush_ms=float(cfg.flush_ms),
                   agent_processes=int(cfg.agent_processes), adapter_mode=str(cfg.adapter_mode),
                   server_url=server[0], api_key=server[1],
                   controller=_controller_overrides(cfg, problems), security=sec,
                   bundle_trust_keys=tuple(_trust_keys(cfg)), network=_network_tag(cfg),
                   policy_params=policy_params(cfg, policy), **_network_run_options(cfg))


def policy_params(cfg: DictConfig, policy: str) -> dict[str, Any]:
    """``policy_params.<policy>`` (:func:`delivery.policies.make_policy`'s ``params``: an
    online decider's knobs, ``forecast_drop``'s ``send_forecaster``, ``online_learned``'s
    ``bundle``), ``{}`` when it has none."""
    got = (cfg.get("policy_params") or {}).get(policy)
    if got is None:
        return {}
    out = OmegaConf.to_container(got, resolve=True) if isinstance(got, DictConfig) else got
    if not isinstance(out, dict):
        raise ConfigError(f"policy_params.{policy}: a mapping of parameters, got {got!r}")
    return dict(out)


def check_policies(cfg: DictConfig) -> None:
    """Refuse, before any process starts, an unknown policy in ``policies`` or
    ``policy_params`` and a selected policy that refuses its parameters (an online decider,
    ``greedy`` or ``alcor`` with a key it does not take, ``learned`` with any, ``forecast_drop``
    without its forecaster; ``rpc``, ``vita`` and ``idcs`` take none and ignore them)."""
    from .policies import POLICIES, make_policy

    for where, names in (("policies", list(cfg.policies)),
                         ("policy_params", list((cfg.get("policy_params") or {}).keys()))):
        bad = [str(n) for n in names if n not in POLICIES]
        if bad:
            raise ConfigError(f"{where}: unknown polic{'ies' if len(bad) > 1 else 'y'} "
                              f"{', '.join(map(repr, bad))}; known: {', '.join(POLICIES)}")
    problems = None
    for name in cfg.policies:
        params = policy_params(cfg, str(name))
        if not params and name != "forecast_drop":
            continue  # the defaults are valid
        if problems is None:
            problems = problems_for(str(cfg.scenario))
        try:
            make_policy(str(name), problems, params)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"policy_params.{name}: {e}") from None


def _network_run_options(cfg: DictConfig) -> dict[str, Any]:
    """What each run does with the emulated network before its replay: wait for the
    controller's link to settle (``network.settle_s``) and raise C_b by its idle traffic
    (``network.control_allowance``)."""
    net = cfg.get("network") or {}
    if not _network_tag(cfg):
        return {}
    return {"settle_s": float(net.get("settle_s") or 0.0),
            "control_allowance": bool(net.get("control_allowance")),
            "queue_ms": float(net.get("queue_ms") or 200.0)}


def _controller_overrides(cfg: DictConfig, problems=None) -> dict[str, Any]:
    """The ``delivery:`` block (ControllerConfig keys: outbox, failover, shaping, ...). In the
    emulated network the controller also holds at most C_p sends in flight (Eq. 1's third
    constraint made real) and waits longer for a push crossing a full link, unless the
    block says otherwise."""
    block = cfg.get("delivery") or {}
    out = OmegaConf.to_container(block, resolve=True) if isinstance(block, DictConfig) \
        else dict(block)
    if not isinstance(out, dict):
        raise ConfigError(f"delivery: expected a mapping, got {out!r}")
    res = {str(k): v for k, v in out.items()}
    if _network_tag(cfg) and problems is not None:
        net = cfg.network
        if net.get("enforce_cpu", True):
            res.setdefault("max_inflight_sends", int(problems.spec.controller_cpu))
        res.setdefault("push_timeout_s", float(net.get("push_timeout_s") or 30.0))
    return res


def speedups(df: pd.DataFrame, metric: str = "delay_p95_ms", of: str = "learned"
             ) -> dict[str, float]:
    """How many times lower ``of``'s ``metric`` is than each other policy's."""
    if df.empty or of not in set(df.policy):
        return {}
    med = df.groupby("policy", sort=False)[metric].median()  # over the repetitions
    mine = float(med[of])
    return {str(p): float(v) / mine for p, v in med.items() if p != of and mine > 0}


def rank_agreement(df: pd.DataFrame) -> dict[str, Any]:
    """The policies ranked by measured p95 delay (medians over the repetitions) and by the
    simulator's prediction for the decisions they applied (the highest utilisation of C_b,
    C_p or an s(n), Eq. 1), with Spearman's rank correlation of the two; and, beside it, the
    correlation of the delay with the payload bytes each policy put on the controller's link
    (its share of C_b), which tells whether that link is what the delays follow."""
    if "sim_utilisation" not in df or df.policy.nunique() < 2:
        return {}
    cols = ["delay_p95_ms", "sim_utilisation"] + (["controller_bytes"]
                                                  if "controller_bytes" in df else [])
    med = df.groupby("policy")[cols].median()
    by_delay = med.delay_p95_ms.sort_values().index.tolist()
    by_sim = med.sim_utilisation.sort_values().index.tolist()

    def rho(col: str) -> float | None:
        r = med.delay_p95_ms.rank().corr(med[col].rank())
        return None if pd.isna(r) else round(float(r), 2)

    out: dict[str, Any] = {"measured": by_delay, "simulator": by_sim,
                           "spearman": rho("sim_utilisation")}
    # the delay model's p95 (envs.dsmd.delay) of the intervals as delivered, else of the
    # boundary decisions
    col = next((c for c in ("sim_realised_delay_p95_ms", "sim_delay_p95_ms")
                if c in df and df[c].notna().any()), None)
    if col is not None:
        med[col] = df.groupby("policy")[col].median()
        out["delay_model"] = med[col].dropna().sort_values().index.tolist()
        out["spearman_delay_model"] = rho(col)
    if "controller_bytes" in med:
        out["spearman_controller_bytes"] = rho("controller_bytes")
    return out


def best_dual(df: pd.DataFrame, metric: str = "delay_p95_ms") -> str | None:
    """The dual-channel policy (neither RPC-only nor VITA, which is MQ-only) with the
    lowest median ``metric``."""
    med = df[~df.policy.isin(["rpc", "vita"])].groupby("policy")[metric].median().dropna()
    return None if med.empty else str(med.idxmin())


@dataclass(frozen=True)
class FigurePoint:
    """One point of a testbed configuration: a Fig. 9 VPC count or Fig. 10, its scenario's
    problems (the trace every policy replays) and the windows replayed (the first is also
    the priming interval)."""

    figure: str
    label: str
    problems: Any  # envs.dsmd.problems.ProblemSet
    windows: list[int]
    vpcs: int | None


def figure_points(cfg: DictConfig) -> list[FigurePoint]:
    """The points of ``cfg.figures``, in order: Fig. 9's ``fig9.vpcs`` (traffic
    ``fig9.rate_per_vpc_bps`` per VPC, ``fig9.windows`` intervals after one priming interval)
    and Fig. 10's ``fig10.windows`` of the scenario itself."""
    out: list[FigurePoint] = []
    if "fig9" in cfg.figures:
        iv = float(problems_for(str(cfg.scenario)).spec.interval_s)
        n_win = int(cfg.fig9.windows) + 1
        for v in cfg.fig9.vpcs:
            ps = problems_for(str(cfg.scenario), {
                "num_vpcs": int(v), "rate_per_vpc_bps": float(cfg.fig9.rate_per_vpc_bps),
                "peak_rate_bps": None, "phases": [], "duration_s": n_win * iv})
            out.append(FigurePoint("fig9", f"fig9/vpcs={v}", ps, list(range(n_win)), int(v)))
    if "fig10" in cfg.figures:
        out.append(FigurePoint("fig10", "fig10", problems_for(str(cfg.scenario)),
                                [int(w) for w in cfg.fig10.windows], None))
    return out


def run_testbed(cfg: DictConfig) -> dict[str, Any]:
    from agents.tracking import tracked_run

    if cfg.get("merge"):
        return merge_outputs(list(cfg.merge), Path(str(cfg.out_dir)), str(cfg.scenario))
    if cfg.get("simulate"):
        check_policies(cfg)
        from .testbed_sim import simulate_testbed

        return simulate_testbed(cfg)
    net = cfg.get("network") or {}
    if not net.get("inside"):
        check_policies(cfg)
    if net.get("enabled") and not net.get("inside"):
        return _run_in_network(cfg)

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
        runs = [(pt.figure, pt.label, p, pt.problems, pt.windows, pt.vpcs)
                for pt in figure_points(cfg) for p in policies]
        reps = int(cfg.get("repeats") or 1)
        first = int(cfg.get("first_repeat") or 0)  # > 0: more repetitions for a merge
        runs = [(rep, *r) for rep in range(first, first + reps) for r in runs]
        for i, (rep, fig, label, pol, ps, wins, v) in enumerate(runs):
            _say(f"[{i + 1}/{len(runs)}] {label} {pol}: {ps.num_nodes} agents, windows "
                 f"{wins[0]}..{wins[-1]} ({elapsed(t_start)})")
            r = run_once(_spec(cfg, label, pol, ps, wins, server, sec), url,
                         out / "runs" / f"{label.replace('/', '_')}_{pol}_r{rep}", say=_say,
                         admin_url=admin)
            r.summary["figure"] = fig
            r.summary["repeat"] = rep
            for b in r.buckets:
                b["repeat"] = rep
            r.summary["vpcs"] = v if v is not None else int(ps.spec.num_vpcs)
            results[fig].append(r)
            s = r.summary
            _say(f"    {s['messages']} messages, applied {s['applied']}; controller "
                 f"{s['controller_bytes'] / 1e6:.2f} MB, {s['controller_messages']} msgs, "
                 f"CPU {100 * s['controller_cpu_util']:.0f}%; nodes total "
                 f"{s['node_bytes_total'] / 1e6:.2f} MB, max {s['node_bytes_max'] / 1e6:.3f} "
                 f"MB; delay p95 {s['delay_p95_ms']:.1f} ms, max {s['delay_max_ms']:.1f} ms")
            mlog.metrics({f"{label.replace('=', '')}/{pol}/r{rep}/{k}": float(s[k]) for k in (
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
    rows = [r.summary for fig in results.values() for r in fig]
    buckets = [{"policy": r.policy, **b} for r in results["fig10"] for b in r.buckets]
    return _write_tables(pd.DataFrame(rows), pd.DataFrame(buckets), out)


def _write_tables(summary: pd.DataFrame, fig10: pd.DataFrame, out: Path
                  ) -> dict[str, pd.DataFrame]:
    """The result tables from the per-run summaries and Fig. 10's per-interval buckets:
    ``summary``, ``fig9`` (its Fig. 9 rows), ``fig9_median`` (median, min and max over the
    repetitions per point and policy), ``fig10_median`` (the same over each policy's Fig. 10
    runs) and ``fig10`` (the per-interval buckets); each written as ``<name>.csv``."""
    tables: dict[str, pd.DataFrame] = {}
    if not summary.empty:
        tables["summary"] = summary
        f9 = summary[summary.figure == "fig9"].reset_index(drop=True)
        if not f9.empty:
            tables["fig9"] = f9
            tables["fig9_median"] = _median_table(f9, ["vpcs", "policy"])
        f10 = summary[summary.figure == "fig10"].reset_index(drop=True)
        if not f10.empty:
            tables["fig10_median"] = _median_table(f10, ["policy"])
    if not fig10.empty:
        tables["fig10"] = fig10
    for name, df in tables.items():
        df.to_csv(out / f"{name}.csv", index=False)
    return tables


def merge_outputs(sources: list[str | Path], out: Path, scenario: str) -> dict[str, Any]:
    """Combine completed testbed outputs (one per Fig. 9 point, say, run one after the other)
    into one: their runs' summaries and Fig. 10 buckets concatenated, and the tables, the
    medians over the repetitions, the headline and the plots rebuilt in ``out`` as if one
    run had produced them, rows in the order one run writes them. A source without
    ``summary.csv`` may give its Fig. 9 runs as ``fig9.csv``. Nothing is re-run and the
    sources are only read; the same (run, policy, repetition) in two sources, or one run
    label replaying different traces (another scenario or windows), is an error naming
    both."""
    if not sources:
        raise ValueError("merge: no testbed outputs given")
    summaries, buckets, seen = [], [], {}
    trace: dict[str, tuple[int, Path]] = {}
    for src in map(Path, sources):
        f = src / "summary.csv"
        if not f.is_file() and (src / "fig9.csv").is_file():
            f = src / "fig9.csv"  # a Fig. 9 result kept without the summary
        if not f.is_file():
            raise FileNotFoundError(f"merge: {src} has no summary.csv or fig9.csv (not a "
                                    "completed testbed output)")
        s = pd.read_csv(f)
        missing = {"label", "policy", "repeat", "figure", "vpcs"} - set(s.columns)
        if missing:
            raise ValueError(f"merge: {f} lacks the columns {sorted(missing)}")
        for key in zip(s.label, s.policy, s.repeat):
            if key in seen:
                raise ValueError(f"merge: run {key[0]} {key[1]} repetition {key[2]} is in "
                                 f"both {seen[key]} and {src} (run added repetitions "
                                 "with first_repeat=N)")
            seen[key] = src
        if "messages" in s:  # one label replays one trace: the same messages in every run
            for label, n in s.groupby("label").messages.first().items():
                first = trace.setdefault(label, (int(n), src))
                if first[0] != int(n):
                    raise ValueError(f"merge: run {label} replays {first[0]} messages in "
                                     f"{first[1]} but {int(n)} in {src} (another scenario, "
                                     "VPC count or windows)")
        summaries.append(s)
        if (src / "fig10.csv").is_file():
            buckets.append(pd.read_csv(src / "fig10.csv"))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = pd.concat(summaries, ignore_index=True)
    # as one invocation orders its runs: figure by figure, point by point, then repetition
    # (stable, so the policies keep their order); a point added later is not left at the end
    fig_rank = {f: i for i, f in enumerate(dict.fromkeys(summary.figure))}
    summary = summary.assign(_fig=summary.figure.map(fig_rank)).sort_values(
        ["_fig", "vpcs", "repeat"], kind="stable").drop(columns="_fig").reset_index(drop=True)
    fig10 = pd.concat(buckets, ignore_index=True) if buckets else pd.DataFrame()
    tables = _write_tables(summary, fig10, out)
    plots = _plots(tables, out, scenario)
    head = _headline(tables)
    (out / "headline.json").write_text(json.dumps(head, indent=2))
    (out / "merged_from.json").write_text(json.dumps(
        [str(Path(s).resolve()) for s in sources], indent=2) + "\n")
    _say(f"testbed: {len(summary)} runs from {len(sources)} outputs merged into {out}")
    return {"tables": tables, "plots": plots, "headline": head, "out_dir": out}


def _median_table(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Median, min and max over the repetitions of every numeric column."""
    num = [c for c in df.columns if c not in by and c != "repeat"
           and pd.api.types.is_numeric_dtype(df[c])]
    g = df.groupby(by, sort=False)[num]
    med, lo, hi = g.median(), g.min(), g.max()
    out = pd.concat([med, lo.add_suffix("_min"), hi.add_suffix("_max"),
                     g.size().rename("repeats")], axis=1)
    return out.copy().reset_index()  # copy: one block, not one per column


def _comparisons(df: pd.DataFrame, name: str) -> dict[str, Any]:
    """One point's headline entries: the learned policy's speedups, the measured ranking
    beside the simulator's, and the best dual-channel policy's speedups."""
    head: dict[str, Any] = {}
    sp = speedups(df)
    if sp:
        head[f"{name}: p95 delay speedup of learned over"] = {
            k: round(x, 2) for k, x in sp.items()}
    rank = rank_agreement(df)
    if rank:
        head[f"{name}: ranking by measured p95 delay vs by the simulator's utilisation"] = rank
    best = best_dual(df)
    if best:
        head[f"{name}: p95 delay speedup of the best dual-channel policy ({best}) over"] = {
            k: round(x, 2) for k, x in speedups(df, of=best).items()}
    return head


def _headline(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    head: dict[str, Any] = {}
    if "fig9" in tables:
        df = tables["fig9"]
        for v in sorted(set(df.vpcs)):
            head.update(_comparisons(df[df.vpcs == v], f"fig9 vpcs={v}"))
    if "summary" in tables:
        df = tables["summary"]
        f10 = df[df.figure == "fig10"]
        if not f10.empty:
            head.update(_comparisons(f10, "fig10 (all phases)"))
    return head


def _plots(tables: dict[str, pd.DataFrame], out: Path, scenario: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    summary = tables.get("summary", pd.DataFrame())
    where = ("emulated network" if "network" in summary and not summary.empty
             and str(summary.network.iloc[0]) != "loopback" else "loopback")
    panels = [("controller_bytes", "traffic on controller (MB)", 1e-6),
              ("controller_cpu_util", "controller CPU (% of a core)", 100.0),
              ("node_bytes_total", "total traffic on CNs (MB)", 1e-6),
              ("delay_p95_ms", "delivery delay p95 (ms)", 1.0)]
    if "fig9_median" in tables:
        df = tables["fig9_median"]  # medians over the repetitions, bars: their range
        fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
        for ax, (col, _title, k) in zip(axes, panels):
            for pol, grp in df.groupby("policy", sort=False):
                g = grp.sort_values("vpcs")
                lo = ((g[col] - g[f"{col}_min"]) * k).clip(lower=0)
                hi = ((g[f"{col}_max"] - g[col]) * k).clip(lower=0)
                ax.errorbar(g.vpcs, g[col] * k, yerr=[lo, hi], marker="o", capsize=3,
                            label=pol)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("# of VPCs")
            if col == "delay_p95_ms":  # from tens of milliseconds to a minute
                ax.set_yscale("log")
        paths.append(_finish(plt, fig, axes, panels, out / "fig9_testbed.png",
                             f"Fig. 9 on the testbed ({scenario}; {where}; median over the "
                             "repetitions, bars: their range)"))
    if "fig10" in tables:
        df = tables["fig10"]
        fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
        for ax, (col, _title, k) in zip(axes, panels):
            for pol, grp in df.groupby("policy", sort=False):
                g = grp.groupby("window", sort=True)[col].median()  # over the repetitions
                ax.plot(g.index.to_numpy(), g.to_numpy() * k, marker="o", label=pol)
            ax.set_xlabel("interval of the trace")
            if col == "delay_p95_ms":
                ax.set_yscale("log")
        paths.append(_finish(plt, fig, axes, panels, out / "fig10_testbed.png",
                             f"Fig. 10 on the testbed ({scenario}: burst phases; {where}; "
                             "median over the repetitions)"))
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


def main(argv: list[str] | None = None) -> int:
    """``python -m delivery.experiment --config cfg.yaml``: a resolved testbed configuration
    run as is (how the testbed runs itself inside the emulated network's controller
    namespace)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m delivery.experiment")
    ap.add_argument("--config", required=True, help="a resolved testbed configuration (YAML)")
    args = ap.parse_args(argv)
    cfg = OmegaConf.load(args.config)
    assert isinstance(cfg, DictConfig)
    run_testbed(cfg)
    return 0


if __name__ == "__main__":
    import sys

    from envs.quiet import quiet

    quiet()
    sys.exit(main())
