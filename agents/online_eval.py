"""The online yardstick: run deciders over the traces of a dataset split, tune the online
heuristics' knobs on the validation traces, bound with the hindsight oracle, and tabulate.

Evaluation protocol (``docs/online.md``): traces are split by seed; every knob is chosen on
the validation traces only; the test traces are the same for every method; each method is
reported with its mean and 95% interval over test traces, as a point of (realised node
traffic, SubscribeInfos per interval) with its violated intervals, and with its regret
against the hindsight oracle. ``headroom`` = best tuned online heuristic minus oracle.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from envs.dsmd.dataset import TraceDataset, open_dataset
from envs.dsmd.errors import DSMDError
from envs.dsmd.online import OnlineCost, OnlineSimulator, OnlineTrace
from envs.dsmd.online_greedy import FILE_ARGS
from envs.progress import Progress
from envs.stats import ci95

from .online import HindsightGreedy, OnlineGreedy, make_static

__all__ = [
    "DeciderSpec",
    "as_horizon",
    "compose_oracle",
    "evaluate_online",
    "exact_bound",
    "exact_bounds",
    "format_online_table",
    "knob_grid",
    "knob_oracle",
    "oracle_specs",
    "pareto_front",
    "per_trace",
    "summarize_online",
    "tune",
]


@dataclass(frozen=True)
class DeciderSpec:
    """A decider by kind and parameters (picklable, built inside worker processes).

    ``kind``: ``static`` (``params.policy`` re-planned every interval), ``online_greedy``
    (:class:`agents.online.OnlineGreedy` knobs in ``params``), ``oracle`` (hindsight) or
    ``learned`` (``params.bundle``: an online policy bundle's directory,
    :mod:`serving.bundles.online`)."""

    name: str
    kind: str
    params: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def make(cls, name: str, kind: str, **params: Any) -> DeciderSpec:
        if kind not in ("static", "online_greedy", "oracle", "learned"):
            raise DSMDError(f"unknown decider kind {kind!r}")
        return cls(name, kind, tuple(sorted(params.items())))

    @property
    def kw(self) -> dict[str, Any]:
        return dict(self.params)

    def build(self, trace: OnlineTrace, cost: OnlineCost):
        p = self.kw
        if self.kind == "static":
            pol = p.pop("policy", self.name)
            return make_static(pol, trace.spec, trace.parsed.catalog.topology, cost, p)
        if self.kind == "online_greedy":
            return OnlineGreedy(cost=cost, name=self.name, **p)
        if self.kind == "learned":
            from serving.bundles.online import load_online_bundle
            from serving.bundles.signing import BundleTrust

            # the run's own export: trusted because its signing key is (None: the PKI's)
            key = p.get("signing_key")
            trust = BundleTrust.from_signing_key(key) if key else None
            return load_online_bundle(p["bundle"], trust).decider(self.name, cost)
        return HindsightGreedy(cost=cost, name=self.name, **p)


# ---------------------------------------------------------------------- workers
_TRACES: dict[tuple[str, str], OnlineTrace] = {}


def _trace(root: str, trace_id: str) -> OnlineTrace:
    key = (root, trace_id)
    if key not in _TRACES:
        ds = open_dataset(Path(root))
        _TRACES.clear()  # one trace per worker at a time keeps memory flat
        _TRACES[key] = OnlineTrace.from_dataset(ds.load(trace_id), ds.scenario, trace_id)
    return _TRACES[key]


#: the modules whose code decides a non-learned decider's rows (their source is in the key)
_CACHE_SOURCES = ("agents/online.py", "agents/greedy.py", "agents/baselines.py",
                  "agents/registry.py", "envs/dsmd/online.py", "envs/dsmd/cost.py",
                  "envs/dsmd/instance.py", "envs/dsmd/kernels.py", "envs/dsmd/parser.py",
                  "envs/dsmd/online_greedy.py", "envs/dsmd/greedy.py",
                  "envs/dsmd/greedy_kernels.py", "envs/dsmd/demand.py",
                  "envs/dsmd/forecaster.py")
_SOURCE_HASH: list[str] = []


def _source_hash() -> str:
    if not _SOURCE_HASH:
        root = Path(__file__).resolve().parent.parent
        h = hashlib.sha256()
        for f in _CACHE_SOURCES:
            h.update((root / f).read_bytes())
        _SOURCE_HASH.append(h.hexdigest())
    return _SOURCE_HASH[0]


def _cache_path(cache: str, digest: Any, trace_id: str, spec: DeciderSpec, cost: OnlineCost,
                windows: int | None) -> Path | None:
    """Where the rows of a deterministic (non-learned) decider on one trace are cached: the
    key is the trace files' sha256, the decider, the cost, the intervals and the code."""
    if not cache or spec.kind == "learned":
        return None
    files = [hashlib.sha256(Path(str(v)).read_bytes()).hexdigest()  # a forecaster's content
             for k, v in spec.params if k in FILE_ARGS and v]
    key = json.dumps([digest, trace_id, spec.name, spec.kind, repr(spec.params),
                      repr(cost), windows, _source_hash(), files], sort_keys=True)
    return Path(cache) / f"{trace_id}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.pkl"


def _run_job(args: tuple) -> list[dict[str, Any]]:
    root, trace_id, specs, cost, windows, cache = args
    digest = open_dataset(Path(root)).entry(trace_id)["sha256"] if cache else None
    rows = []
    for spec in specs:
        path = _cache_path(cache, digest, trace_id, spec, cost, windows)
        if path is not None and path.is_file():
            rows.extend(pd.read_pickle(path))
            continue
        tr = _trace(root, trace_id)
        sim = OnlineSimulator(tr, cost, hindsight=spec.kind == "oracle")
        mine = [{"policy": spec.name, "trace": trace_id, **r.as_dict()}
                for r in sim.run(spec.build(tr, cost), windows)]
        if path is not None:  # atomic: a concurrent or interrupted writer leaves no half file
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            pd.to_pickle(mine, tmp)
            os.replace(tmp, path)
        rows.extend(mine)
    return rows


def evaluate_online(dataset: TraceDataset, trace_ids: Sequence[str],
                    specs: Sequence[DeciderSpec], cost: OnlineCost, windows: int | None = None,
                    workers: int = 1, progress: bool = True, desc: str = "online",
                    cache: str | Path | None = None) -> pd.DataFrame:
    """One row per (policy, trace, interval) with every term of the interval.

    Jobs are one trace each (every decider on it), spread over ``workers`` processes. With
    ``cache`` (a directory), a non-learned decider's rows on a trace are reused when the
    trace, the decider, the cost, the intervals and the deciding code are unchanged."""
    jobs = [(str(dataset.root), t, tuple(specs), cost, windows, str(cache or ""))
            for t in trace_ids]
    rows: list[dict[str, Any]] = []
    with Progress(progress, len(jobs), desc) as bar:
        for j, out in zip(jobs, _map(_run_job, jobs, workers)):
            rows.extend(out)
            bar.step(j[1])
    return pd.DataFrame(rows)


def _map(fn: Callable[[tuple], Any], jobs: list[tuple], workers: int) -> Iterator[Any]:
    """``fn`` over ``jobs`` in order: in this process, or in ``workers`` forked processes."""
    if workers <= 1 or len(jobs) <= 1:
        yield from map(fn, jobs)
        return
    import multiprocessing as mp

    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)),
                             mp_context=mp.get_context("fork")) as ex:
        yield from ex.map(fn, jobs)


def _knob_oracle_job(args: tuple) -> list[dict[str, Any]]:
    root, trace_id, specs, cost, windows, name = args
    tr = _trace(root, trace_id)
    sim = OnlineSimulator(tr, cost, hindsight=any(s.kind == "oracle" for s in specs))
    end = tr.num_windows if windows is None else min(tr.num_windows, int(windows))
    rows = []
    while sim.window < end:
        best = None
        for spec in specs:  # every setting from the same state; keep the cheapest outcome
            trial = sim.clone()
            r = trial.step(spec.build(tr, cost)).as_dict()
            if best is None or r["cost"] < best[0]["cost"]:
                best = (r, trial, spec.name)
        r, sim, chosen = best
        rows.append({"policy": name, "trace": trace_id, **r, "knob_setting": chosen})
    return rows


def knob_oracle(dataset: TraceDataset, trace_ids: Sequence[str], specs: Sequence[DeciderSpec],
                cost: OnlineCost, windows: int | None = None, workers: int = 1,
                name: str = "knob_oracle") -> pd.DataFrame:
    """The knob-setting design's hindsight ceiling: at every boundary, run each of ``specs``
    (the knob grid's settings) from the same state over the coming interval and keep the
    one whose realised cost is least (myopic, one interval ahead, with hindsight). What a
    policy that only sets these knobs could reach if it always guessed right; rows as
    :func:`evaluate_online`'s, with the setting chosen in ``knob_setting``."""
    jobs = [(str(dataset.root), t, tuple(specs), cost, windows, name) for t in trace_ids]
    return pd.DataFrame([r for out in _map(_knob_oracle_job, jobs, workers) for r in out])


# ---------------------------------------------------------------------- tuning
def compose_oracle(df: pd.DataFrame, name: str = "oracle") -> pd.DataFrame:
    """Rows of a policy named ``name``: per trace, whichever run had the least mean cost over
    the trace's busy intervals, among the hindsight variants (``oracle_*``) and every online
    method evaluated. Hindsight may pick per trace, so no method has negative regret; the
    greedy variants alone are heuristics, not bounds (the exact bound is
    :func:`exact_bound`)."""
    pt = per_trace(df)
    best = pt.loc[pt.groupby("trace", sort=False)["cost"].idxmin(), ["trace", "policy"]]
    pick = df.merge(best, on=["trace", "policy"])
    pick = pick.assign(oracle_source=pick.policy, policy=name)
    return pd.concat([df, pick], ignore_index=True)


def knob_grid(family: str, grid: Mapping[str, Sequence[Any]]) -> list[DeciderSpec]:
    """Every combination of ``grid`` as an ``online_greedy`` decider named after its knobs."""
    keys = sorted(grid)
    out = []
    for combo in itertools.product(*(list(grid[k]) for k in keys)):
        kw = {k: (as_horizon(v) if k == "horizon" else v) for k, v in zip(keys, combo)}
        label = ",".join(knob_text(k, v) for k, v in kw.items())
        out.append(DeciderSpec.make(f"{family}[{label}]", "online_greedy", **kw))
    return out


def knob_text(k: str, v: Any) -> str:
    """``k=v`` as a setting's name shows it (a file argument: the file's name, not its
    path)."""
    return f"{k}={Path(str(v)).name if k in FILE_ARGS and v else _fmt(v)}"


def _fmt(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def per_trace(df: pd.DataFrame) -> pd.DataFrame:
    """Per (policy, trace) means of the interval terms, and violated-interval shares."""
    g = df[df["types"] > 0].groupby(["policy", "trace"], sort=False)
    cols = ["cost", "redundancy_ratio", "violation", "subscribe_infos", "moved_types",
            "total_node_traffic_bps", "bw_violated", "cpu_violated", "node_violated",
            "new_types", "types", "delay_p50_s", "delay_p95_s", "bw_util"]
    out = g[[c for c in cols if c in df]].mean()
    out["any_violated"] = g["feasible"].apply(lambda s: 1.0 - s.mean())
    return out.reset_index()


def tune(df: pd.DataFrame, families: Iterable[str]) -> dict[str, str]:
    """The best decider of each family (lowest mean cost over the validation traces)."""
    pt = per_trace(df)
    means = pt.groupby("policy")["cost"].mean()
    best = {}
    for fam in families:
        cand = means[[p for p in means.index if p.startswith(fam + "[")]]
        if cand.empty:
            raise DSMDError(f"no decider of family '{fam}' was evaluated")
        best[fam] = str(cand.idxmin())
    return best


def paired(pt: pd.DataFrame, policy: str, reference: str) -> tuple[float, float, int]:
    """(mean, 95% half-width, traces) of ``policy``'s cost minus ``reference``'s, paired
    trace by trace over the traces both ran (``pt``: :func:`per_trace` rows)."""
    c = pt.set_index(["policy", "trace"])["cost"]
    a, b = c.loc[policy], c.loc[reference]
    d = (a - b.reindex(a.index)).dropna().to_numpy()
    return (float(d.mean()) if d.size else float("nan")), ci95(d), int(d.size)


def tuning_margins(pt: pd.DataFrame, best: dict[str, str]) -> pd.DataFrame:
    """For every setting of every tuned family: its validation cost minus the family's
    chosen setting's, paired by trace, with the 95% interval; ``distinct`` when the
    interval excludes 0 (the chosen setting is then distinguishable from it)."""
    rows = []
    for fam, name in best.items():
        for pol in pt.policy[pt.policy.str.startswith(fam + "[")].unique():
            if pol == name:
                continue
            m, h, n = paired(pt, pol, name)
            rows.append({"family": fam, "chosen": name, "setting": pol, "margin": m,
                         "margin_ci95": h, "traces": n,
                         "distinct": bool(np.isfinite(h) and m - h > 0)})
    cols = ["family", "chosen", "setting", "margin", "margin_ci95", "traces", "distinct"]
    return pd.DataFrame(rows, columns=cols).sort_values(["family", "margin"]).reset_index(
        drop=True)


def margins_text(margins: pd.DataFrame) -> str:
    """One line per family: its runner-up's paired margin and how many settings the chosen
    one is distinguishable from."""
    lines = []
    for fam, g in margins.groupby("family", sort=False):
        top = g.iloc[0]
        lines.append(f"{fam}: {top.chosen} beats the runner-up {top.setting} by "
                     f"{top.margin:+.4f} ± {top.margin_ci95:.4f} (paired, {top.traces} "
                     f"validation traces); distinguishable from {int(g.distinct.sum())} of "
                     f"{len(g)} other settings at 95%")
    return "\n".join(lines)


def pareto_front(points: pd.DataFrame, x: str, y: str) -> pd.DataFrame:
    """The points not dominated in (x, y), both minimised, sorted by x."""
    p = points.sort_values([x, y]).reset_index(drop=True)
    keep, best_y = [], math.inf
    for i, r in p.iterrows():
        if r[y] < best_y - 1e-12:
            keep.append(i)
            best_y = r[y]
    return p.loc[keep]


def as_horizon(h: Any) -> float:
    """A hysteresis horizon from config: a number, or ``inf`` / ``null`` for "always"."""
    return math.inf if h is None or str(h).lower() in ("inf", "infinity") else float(h)


def oracle_specs(horizons: Sequence[Any], headrooms: Sequence[float] = (0.0,)
                 ) -> list[DeciderSpec]:
    """One hindsight greedy per distinct horizon and headroom."""
    hs = list(dict.fromkeys(as_horizon(h) for h in horizons))
    out = []
    for r in dict.fromkeys(float(x) for x in headrooms):
        for h in hs:
            if r == 0.0:
                out.append(DeciderSpec.make(f"oracle_greedy[horizon={_fmt(h)}]", "oracle",
                                            horizon=h))
            else:
                out.append(DeciderSpec.make(f"oracle_greedy[headroom={_fmt(r)},horizon="
                                            f"{_fmt(h)}]", "oracle", horizon=h, headroom=r))
    return out


# ---------------------------------------------------------------------- summary
def summarize_online(df: pd.DataFrame, oracle: str = "oracle",
                     reference: str | None = None) -> pd.DataFrame:
    """Per policy: means over test traces with 95% intervals, violated intervals per
    constraint, switching per interval, regret against ``oracle`` (a policy name in
    ``df``) computed trace by trace, and (with ``reference``, e.g. the best tuned heuristic)
    the cost difference to it paired by trace, with its 95% interval."""
    pt = per_trace(df)
    ref = pt[pt.policy == oracle].set_index("trace")["cost"] if oracle in set(pt.policy) else None
    rows = []
    for pol, g in pt.groupby("policy", sort=False):
        row = {"policy": pol, "traces": len(g), "cost": g.cost.mean(), "cost_ci95": ci95(g.cost),
               "node_traffic_mbps": g.total_node_traffic_bps.mean() / 1e6,
               "redundancy_ratio": g.redundancy_ratio.mean(),
               "bw_violated_pct": 100 * g.bw_violated.mean(),
               "cpu_violated_pct": 100 * g.cpu_violated.mean(),
               "node_violated_pct": 100 * g.node_violated.mean(),
               "subscribe_infos": g.subscribe_infos.mean(),
               "moved_types": g.moved_types.mean()}
        if "delay_p95_s" in g:  # the delay model's, mean over intervals
            row["delay_p50_ms"] = 1e3 * g.delay_p50_s.mean()
            row["delay_p95_ms"] = 1e3 * g.delay_p95_s.mean()
            row["bw_util"] = g.bw_util.mean()
        if ref is not None:
            reg = 100 * (g.set_index("trace").cost / ref.loc[g.trace].values - 1.0)
            row["regret_pct"], row["regret_ci95"] = float(reg.mean()), ci95(reg.values)
        if reference is not None and reference in set(pt.policy):
            row["vs_reference"], row["vs_reference_ci95"], _ = paired(pt, str(pol), reference)
        rows.append(row)
    return pd.DataFrame(rows).sort_values("cost").reset_index(drop=True)


def format_online_table(summary: pd.DataFrame) -> str:
    cols = [("policy", "policy", "{}"), ("cost", "cost", "{:.4f}"), ("cost_ci95", "±95%", "{:.4f}"),
            ("node_traffic_mbps", "node Mbps", "{:.1f}"), ("redundancy_ratio", "redund.", "{:.3f}"),
            ("delay_p50_ms", "p50 ms", "{:.0f}"), ("delay_p95_ms", "p95 ms", "{:.0f}"),
            ("bw_util", "C_b util", "{:.2f}"),
            ("bw_violated_pct", "C_b viol%", "{:.1f}"), ("cpu_violated_pct", "C_p viol%", "{:.1f}"),
            ("node_violated_pct", "s(n) viol%", "{:.1f}"), ("subscribe_infos", "SI/int", "{:.0f}"),
            ("moved_types", "moves/int", "{:.1f}"), ("regret_pct", "regret%", "{:+.1f}"),
            ("regret_ci95", "±95%", "{:.1f}"), ("vs_reference", "vs best", "{:+.4f}"),
            ("vs_reference_ci95", "±95%", "{:.4f}")]
    cols = [c for c in cols if c[0] in summary]
    head = [c[1] for c in cols]
    body = [[("nan" if isinstance(r[c[0]], float) and math.isnan(r[c[0]]) else c[2].format(r[c[0]]))
             for c in cols] for _, r in summary.iterrows()]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda xs: "  ".join(x.rjust(w) if i else x.ljust(w)  # noqa: E731
                                for i, (x, w) in enumerate(zip(xs, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


# ---------------------------------------------------------------------- exact bound
def exact_bound(trace: OnlineTrace, cost: OnlineCost, horizon: int, time_limit_s: float,
                max_variables: int, windows: int | None = None) -> dict[str, Any]:
    """A certified lower bound on the mean interval cost of any plan for ``trace``.

    The trace is cut into chunks of ``horizon`` intervals, each solved by the multi-period
    MILP (:func:`agents.exact_online.solve_online_oracle`) from a free start (its first
    interval pays no switching terms). Dropping those terms only lowers the cost, so the sum
    of the chunks' dual bounds (less each one's float tolerance) bounds the whole trace's
    optimum from below; it is a bound, not the optimum, even when every chunk is solved.
    ``status`` is ``chunks_optimal`` when every chunk was solved to optimality, ``bound``
    when some stopped at the time limit (their dual bound still counts), ``too_large`` when
    a chunk exceeds ``max_variables``, ``empty`` when no interval carries traffic.

    The MILP has no delay term (the delay model is not linear). Every interval's p95 delay is
    at least the model's ``base_s``, so ``w_delay * base_s`` is added to each interval's
    bound, which stays a bound (loose where queues form)."""
    from .exact import InstanceTooLarge
    from .exact_online import solve_online_oracle

    horizon = int(horizon)
    if horizon < 1:
        raise DSMDError(f"the exact bound's horizon must be >= 1 interval, got {horizon}")
    n = trace.num_windows if windows is None else min(trace.num_windows, int(windows))
    insts = [trace.realised(w) for w in range(n)]
    insts = [i for i in insts if i.num_types]  # an empty interval changes nothing
    total, statuses, t = 0.0, [], 0.0
    if not insts:
        return {"trace": trace.name, "status": "empty", "bound": float("nan"), "intervals": 0,
                "detail": "no interval carries traffic"}
    for a in range(0, len(insts), horizon):
        chunk = insts[a:a + horizon]
        if not chunk:
            continue
        try:
            r = solve_online_oracle(chunk, cost.w_violation, cost.w_subscribe, cost.w_move,
                                    time_limit_s=time_limit_s, max_variables=max_variables)
        except InstanceTooLarge as e:
            return {"trace": trace.name, "status": "too_large", "bound": float("nan"),
                    "intervals": n, "detail": str(e)}
        if r.dual_bound is None:
            return {"trace": trace.name, "status": r.status, "bound": float("nan"),
                    "intervals": n, "detail": "no dual bound"}
        total += r.dual_bound - r.gap_tolerance  # the bound's float error, conservatively
        statuses.append(r.status)
        t += r.time_s
    status = "chunks_optimal" if all(s == "optimal" for s in statuses) else "bound"
    total += cost.w_delay * cost.delay.base_s * len(insts)
    return {"trace": trace.name, "status": status, "bound": total / max(len(insts), 1),
            "intervals": len(insts),
            "chunks": len(statuses), "time_s": t, "detail": ""}


def _bound_job(args: tuple) -> dict[str, Any]:
    root, trace_id, cost, horizon, time_limit_s, max_variables, windows = args
    return exact_bound(_trace(root, trace_id), cost, horizon, time_limit_s, max_variables,
                       windows)


def exact_bounds(dataset: TraceDataset, trace_ids: Sequence[str], cost: OnlineCost,
                 horizon: int, time_limit_s: float, max_variables: int,
                 windows: int | None = None, workers: int = 1) -> pd.DataFrame:
    """:func:`exact_bound` of every trace (one row each)."""
    jobs = [(str(dataset.root), t, cost, horizon, time_limit_s, max_variables, windows)
            for t in trace_ids]
    return pd.DataFrame(list(_map(_bound_job, jobs, workers)))
