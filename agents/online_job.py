"""The online yardstick job: ``python train.py env=online agent=baselines``.

1. Build (or open, cached) the trace dataset of ``env.dataset``.
2. Tune the online heuristics' knobs on the **validation** traces (a grid per family),
   and evaluate every static baseline there too; the best online heuristic is chosen there.
3. On the **test** traces: every static baseline re-planned each interval, each tuned
   family at its chosen knobs, the hindsight greedy variants, the oracle (per trace the
   best of the hindsight variants and every online method) and, where the multi-period
   MILP fits, its certified lower bound (``agents.exact_online``).
4. Print the yardstick table, write CSVs and plots, record an MLflow run.
5. With ``env.stress.datasets``: step 3 again, at the same tuned settings, on each stress
   dataset's test traces (dynamics nothing was trained or tuned on).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import DictConfig

from envs.dsmd.dataset import DatasetSpec, TraceDataset, build_dataset, load_dataset_spec
from envs.dsmd.errors import DSMDError
from envs.dsmd.online import OnlineCost

from .config import default_workers, output_dir, to_dict
from .online_eval import (
    DeciderSpec,
    ci95,
    compose_oracle,
    evaluate_online,
    exact_bounds,
    format_online_table,
    knob_grid,
    knob_oracle,
    margins_text,
    oracle_specs,
    pareto_front,
    per_trace,
    summarize_online,
    tune,
    tuning_margins,
)
from .plots import online_timeline_plot, pareto_plot
from .seeding import seed_everything
from .tracking import tracked_run

__all__ = ["Tuning", "open_online_dataset", "run_online_main", "stress_test", "test_online",
           "tune_online"]


def _bound_text(bounds: pd.DataFrame, pt: pd.Series, best: str, horizon: int) -> str:
    """The exact lower bound's line of the summary: where it was solved, how far the greedy
    oracle and the best online heuristic are above it."""
    ok = bounds[bounds.status.isin(["chunks_optimal", "bound"])]
    if ok.empty:
        why = bounds.detail.iloc[0] if len(bounds) else "no test trace"
        return f"exact lower bound (multi-period MILP): not computed ({why})\n"
    b = ok.set_index("trace")["bound"]
    ora = 100 * (pt.loc["oracle"].loc[b.index] / b - 1.0)
    on = 100 * (pt.loc[best].loc[b.index] / b - 1.0)
    return (f"exact lower bound (multi-period MILP, chunks of {horizon} intervals, "
            f"{len(ok)}/{len(bounds)} traces, every chunk solved to optimality on "
            f"{int((ok.status == 'chunks_optimal').sum())}): oracle {ora.mean():+.2f}% ± "
            f"{ci95(ora.values):.2f}%, "
            f"{best} {on.mean():+.2f}% ± {ci95(on.values):.2f}% above it\n")


@dataclass
class Tuning:
    """Step 2's outcome: what the test phase and a trainer need from the validation traces."""

    dataset: TraceDataset
    cost: OnlineCost
    workers: int
    val_ids: list[str]
    test_ids: list[str]
    statics: list[DeciderSpec]
    families: dict[str, list[DeciderSpec]]
    points: pd.DataFrame  # per policy: mean of the per-trace terms on validation
    val_per_trace: pd.DataFrame  # per (policy, trace): the terms on validation
    best: dict[str, str]  # family -> its best setting's name
    best_online: str      # the best online method on validation (a family or a static name)
    knob_ceiling: pd.DataFrame | None = None  # per trace: the knob oracle on validation
    margins: pd.DataFrame | None = None  # every setting against its family's chosen one

    @property
    def tuned(self) -> dict[str, DeciderSpec]:
        return {fam: next(s for s in self.families[fam] if s.name == name)
                for fam, name in self.best.items()}

    def best_knobs(self) -> dict[str, Any]:
        """The knobs of the best tuned ``online_greedy``-kind family (the teacher)."""
        fams = sorted(self.tuned.items(), key=lambda kv: self.points.set_index("policy")
                      .loc[kv[1].name, "cost"])
        if not fams:
            raise DSMDError("no tuned knob family (env.tune.grid is empty)")
        return fams[0][1].kw


def _cache_dir(cfg: DictConfig) -> Path | None:
    """Where non-learned deciders' rows are reused across runs (``env.cache``; null: off)."""
    c = cfg.env.get("cache")
    return None if not c else Path(str(c))


def open_online_dataset(cfg: DictConfig) -> TraceDataset:
    e = cfg.env
    spec = load_dataset_spec(str(e.dataset), **(to_dict(e.get("dataset_overrides")) or {}))
    return build_dataset(spec, cfg.paths.data_dir, progress=bool(cfg.progress))


def tune_online(cfg: DictConfig, ds: TraceDataset) -> Tuning:
    """Steps 1-2: every static baseline and every knob setting on the validation traces."""
    e = cfg.env
    stress_specs(cfg, ds)  # refused now, not after the test traces
    cost = OnlineCost.from_dict(to_dict(e.cost))
    workers = int(e.workers or default_workers())
    val_ids = [r.id for r in ds.traces("validation")][:e.tune.traces or None]
    test_ids = [r.id for r in ds.traces("test")][:e.eval_traces or None]
    if not val_ids or not test_ids:
        raise DSMDError(f"dataset '{ds.spec.name}' needs validation and test traces "
                        f"(has {len(val_ids)} and {len(test_ids)})")
    statics = [DeciderSpec.make(n, "static", **(to_dict(e.static_params).get(n) or {}))
               for n in e.baselines]
    families = {fam: knob_grid(fam, to_dict(grid)) for fam, grid in to_dict(e.tune.grid).items()
                if grid is not None}  # a family set to null is left out
    sc = ds.scenario
    print(f"[online] dataset {ds.spec.name}: {len(ds.traces('all'))} traces of "
          f"{ds.spec.duration_s:g}s ({len(val_ids)} validation, {len(test_ids)} test used), "
          f"scenario {sc.name}: N={sc.num_nodes}, K={sc.num_topics}, T={sc.interval_s:g}s; "
          f"{sum(len(v) for v in families.values())} knob settings", flush=True)
    val = evaluate_online(ds, val_ids, statics + [s for v in families.values() for s in v],
                          cost, e.tune.windows, workers, bool(cfg.progress), "tune (validation)",
                          _cache_dir(cfg))
    vpt = per_trace(val)
    points = vpt.groupby("policy", sort=False).mean(numeric_only=True).reset_index()
    best = tune(val, families)
    means = points.set_index("policy")["cost"]
    candidates = [s.name for s in statics] + list(best.values())
    best_online = str(means[candidates].idxmin())
    fam_of = {name: fam for fam, name in best.items()}
    for _fam, name in best.items():
        print(f"[online] tuned on validation: {name} (cost {means[name]:.4f})", flush=True)
    margins = tuning_margins(vpt, best)
    if len(margins):
        print("\n".join(f"[online] {line}" for line in margins_text(margins).splitlines()),
              flush=True)
    ceiling = None
    settings = [s for v in families.values() for s in v]
    if e.tune.get("knob_oracle", True) and settings:
        ceiling = per_trace(knob_oracle(ds, val_ids, settings, cost, e.tune.windows, workers))
        top = float(means[list(best.values())].min())
        print(f"[online] knob-setting ceiling on validation (the best of the {len(settings)} "
              f"settings chosen per interval in hindsight): cost {ceiling.cost.mean():.4f}, "
              f"{100 * (ceiling.cost.mean() / top - 1):+.2f}% against the best fixed setting",
              flush=True)
    return Tuning(ds, cost, workers, val_ids, test_ids, statics, families, points, vpt, best,
                  fam_of.get(best_online, best_online), ceiling, margins)


def test_online(cfg: DictConfig, tuning: Tuning, log: Any, out: Path,
                learned: Sequence[DeciderSpec] = (),
                learned_val: pd.DataFrame | None = None) -> dict[str, Any]:
    """Steps 3-4 on the test traces, with the ``learned`` deciders beside the baselines
    (``learned_val``: their points on the validation intervals, for the Pareto plot)."""
    e, ds, cost, workers = cfg.env, tuning.dataset, tuning.cost, tuning.workers
    test_ids, name = tuning.test_ids, ds.spec.name
    best_test = tuning.best_online
    df = _evaluate_test(cfg, tuning, ds, test_ids, learned, e.eval_windows, "evaluate (test)")
    summary, headroom, closed = _verdict(df, best_test, learned)
    pt = per_trace(df).set_index(["policy", "trace"])["cost"]
    ex = e.oracle.exact
    bounds = exact_bounds(ds, test_ids, cost, int(ex.horizon), float(ex.time_limit_s),
                          int(ex.max_variables), e.eval_windows, workers)
    log.table(bounds, out / "bounds.csv")
    table = format_online_table(summary)
    text = (f"Online yardstick: dataset {name}, {len(test_ids)} test traces "
            f"(mean over traces, 95% interval over traces; regret against the hindsight "
            f"oracle; 'vs best': cost minus {best_test}'s, paired by trace)\n\n{table}\n\n"
            f"headroom (best online heuristic on validation: "
            f"{best_test}) = {headroom['headroom_pct']:+.2f}% ± "
            f"{headroom['headroom_ci95']:.2f}% over the oracle\n"
            + closed_text(headroom, closed)
            + _bound_text(bounds, pt, best_test, int(ex.horizon)))
    if tuning.margins is not None and len(tuning.margins):
        text += "tuning on validation:\n" + margins_text(tuning.margins) + "\n"
    print("\n" + text, flush=True)
    (out / "summary.txt").write_text(text)
    log.text(text, "summary.txt")
    log.table(summary, out / "summary.csv")
    log.table(df, out / "per_interval.csv")
    points = tuning.points
    log.table(points, out / "tuning.csv")
    if tuning.margins is not None and len(tuning.margins):
        log.table(tuning.margins, out / "tuning_margins.csv")
    if tuning.knob_ceiling is not None:
        log.table(tuning.knob_ceiling, out / "knob_ceiling.csv")
        log.metrics({"val/knob_oracle_cost": float(tuning.knob_ceiling.cost.mean())})
    knobs = points[points.policy.str.contains(r"\[")]
    front = pareto_front(knobs, "redundancy_ratio", "subscribe_infos")
    log.table(front, out / "pareto.csv")
    others = points[~points.policy.str.contains(r"\[")]
    if learned_val is not None and len(learned_val):
        others = pd.concat([others, learned_val], ignore_index=True)
    figs = [pareto_plot(knobs, front, out / "pareto.png",
                        f"{name}: knob settings on validation", others),
            online_timeline_plot(df[(df.trace == test_ids[0]) & (df.types > 0)
                                    & ~df.policy.str.startswith("oracle_")],
                                 out / "timeline.png", f"{name}: test trace {test_ids[0]}")]
    for f in figs:
        log.artifact(f, "plots")
    for row in summary.itertuples(index=False):
        key = re.sub(r"[^A-Za-z0-9_.\-/ ]", "_", str(row.policy))  # MLflow's charset
        log.metrics({f"{key}/cost": row.cost, f"{key}/subscribe_infos": row.subscribe_infos,
                     f"{key}/redundancy_ratio": row.redundancy_ratio,
                     f"{key}/moved_types": row.moved_types,
                     f"{key}/regret_pct": row.regret_pct,
                     f"{key}/bw_violated_pct": row.bw_violated_pct,
                     f"{key}/cpu_violated_pct": row.cpu_violated_pct,
                     f"{key}/node_violated_pct": row.node_violated_pct})
    log.metrics({"headroom_pct": headroom["headroom_pct"],
                 **{f"{k}/closed_pct": v["closed_pct"] for k, v in closed.items()}})
    stress = stress_test(cfg, tuning, log, out, learned)
    return {"summary": summary, "per_interval": df, "tuning": points, "best": tuning.best,
            "bounds": bounds, "headroom": headroom, "closed": closed, "dataset": ds,
            "stress": stress}


def _evaluate_test(cfg: DictConfig, tuning: Tuning, ds: TraceDataset, ids: Sequence[str],
                   learned: Sequence[DeciderSpec], windows: int | None, desc: str
                   ) -> pd.DataFrame:
    """Step 3 on ``ids`` of ``ds``: the static baselines, each tuned family at its setting,
    the ``learned`` deciders, the hindsight greedy variants (every oracle horizon and
    headroom, and with several headrooms the choice among them per interval) and the
    composed ``oracle``: one row per (policy, trace, interval)."""
    e, cost, workers = cfg.env, tuning.cost, tuning.workers
    tuned = tuning.tuned
    specs = tuning.statics + [DeciderSpec(fam, s.kind, s.params) for fam, s in tuned.items()]
    specs += list(learned)
    horizons = [*e.oracle.horizons, *(s.kw.get("horizon", math.inf) for s in tuned.values())]
    headrooms = list(e.oracle.get("headrooms") or [0.0])
    specs += oracle_specs(horizons, headrooms)
    df = evaluate_online(ds, ids, specs, cost, windows, workers, bool(cfg.progress), desc,
                         _cache_dir(cfg))
    if len(headrooms) > 1:  # the hindsight greedy choosing its reserve interval by interval
        per = knob_oracle(ds, ids, oracle_specs([math.inf], headrooms), cost, windows,
                          workers, name="oracle_greedy[headroom per interval]")
        df = pd.concat([df, per.drop(columns="knob_setting")], ignore_index=True)
    return compose_oracle(df)


def _verdict(df: pd.DataFrame, best: str, learned: Sequence[DeciderSpec]
             ) -> tuple[pd.DataFrame, dict[str, Any], dict[str, Any]]:
    """The summary table (paired against ``best``, the best heuristic on validation), the
    headroom of ``best`` over the oracle, and the share of it each learned policy closes,
    trace by trace."""
    summary = summarize_online(df, "oracle", reference=best)
    pt = per_trace(df).set_index(["policy", "trace"])["cost"]
    head = 100 * (pt.loc[best] / pt.loc["oracle"] - 1.0)
    headroom = {"best_online": best, "headroom_pct": float(head.mean()),
                "headroom_ci95": ci95(head.values), "traces": int(head.size)}
    closed = {}
    for s in learned:
        gain = pt.loc[best] - pt.loc[s.name]
        gap = pt.loc[best] - pt.loc["oracle"]
        share = 100 * gain / gap.where(gap > 0)
        closed[s.name] = {"closed_pct": float(100 * gain.sum() / max(gap.sum(), 1e-12)),
                          "closed_pct_per_trace_ci95": ci95(share.dropna().values)}
    return summary, headroom, closed


def closed_text(headroom: dict[str, Any], closed: dict[str, Any]) -> str:
    """One line per learned policy: the share of the headroom it closes, or, when the
    headroom's 95% interval includes 0 (the best heuristic is within the noise of the
    oracle), that the share is not defined (a ratio over a gap of about 0 says nothing; the
    'vs best' column is the comparison then)."""
    if headroom["headroom_pct"] <= headroom["headroom_ci95"]:
        return "".join(f"{k}: no share of the headroom (the headroom's 95% interval includes "
                       f"0); compare 'vs best'\n" for k in closed)
    return "".join(f"{k} closes {v['closed_pct']:+.1f}% of it (of the summed gaps)\n"
                   for k, v in closed.items())


def stress_specs(cfg: DictConfig, ds: TraceDataset) -> list[DatasetSpec]:
    """The specs of ``env.stress.datasets``, refused (naming the dataset and the key) unless
    each describes the same cloud as ``ds``: the same scenario with the same overrides. A
    stress set varies the dynamics, not the cloud the methods were tuned for."""
    out = []
    for name in (cfg.env.get("stress") or {}).get("datasets") or []:
        spec = load_dataset_spec(str(name))
        for k in ("scenario", "overrides"):
            if getattr(spec, k) != getattr(ds.spec, k):
                raise DSMDError(f"env.stress.datasets: '{name}' has {k} "
                                f"{getattr(spec, k)!r}, the tuned dataset '{ds.spec.name}' "
                                f"{getattr(ds.spec, k)!r}: a stress set varies the "
                                "dynamics, not the cloud")
        out.append(spec)
    return out


def stress_test(cfg: DictConfig, tuning: Tuning, log: Any, out: Path,
                learned: Sequence[DeciderSpec] = ()) -> dict[str, Any]:
    """The same methods, at the settings tuned on the main dataset's validation traces, on
    the test traces of each ``env.stress.datasets`` (traces whose dynamics differ from the
    ones anything was trained or tuned on): per dataset, ``stress/<name>/summary.csv``,
    ``summary.txt`` and ``per_interval.csv``, and MLflow metrics ``stress/<name>/...``."""
    st = cfg.env.get("stress") or {}
    res: dict[str, Any] = {}
    for spec in stress_specs(cfg, tuning.dataset):
        name = spec.name
        ds = build_dataset(spec, cfg.paths.data_dir, progress=bool(cfg.progress))
        ids = [r.id for r in ds.traces("test")][:st.get("traces") or None]
        if not ids:
            raise DSMDError(f"env.stress.datasets: '{name}' has no test traces")
        df = _evaluate_test(cfg, tuning, ds, ids, learned, st.get("windows"),
                            f"stress ({name})")
        best = tuning.best_online
        summary, headroom, closed = _verdict(df, best, learned)
        text = (f"Stress set: dataset {name}, {len(ids)} test traces, methods at the settings "
                f"tuned on {tuning.dataset.spec.name}'s validation traces ('vs best': cost "
                f"minus {best}'s, paired by trace)\n\n{format_online_table(summary)}\n\n"
                f"headroom ({best}) = {headroom['headroom_pct']:+.2f}% ± "
                f"{headroom['headroom_ci95']:.2f}% over the oracle\n"
                + closed_text(headroom, closed))
        print("\n" + text, flush=True)
        d = out / "stress" / str(name)
        d.mkdir(parents=True, exist_ok=True)
        (d / "summary.txt").write_text(text)
        log.table(summary, d / "summary.csv")
        log.table(df, d / "per_interval.csv")
        for row in summary.itertuples(index=False):
            key = re.sub(r"[^A-Za-z0-9_.\-/ ]", "_", str(row.policy))
            log.metrics({f"stress/{name}/{key}/cost": row.cost})
        res[str(name)] = {"summary": summary, "headroom": headroom, "closed": closed,
                          "per_interval": df}
    return res


def learned_bundles(cfg: DictConfig) -> list[DeciderSpec]:
    """``env.learned`` (name -> online bundle directory): policies trained elsewhere (e.g.
    on another dataset or scale, for transfer) evaluated beside the baselines; each bundle
    must verify against the PKI's key (:func:`serving.bundles.online.load_online_bundle`)."""
    out = []
    for name, path in (cfg.env.get("learned") or {}).items():
        p = Path(str(path)).expanduser()
        if not (p / "metadata.json").is_file():
            raise DSMDError(f"env.learned.{name}: {p} is not an online policy bundle "
                            "(no metadata.json)")
        out.append(DeciderSpec.make(str(name), "learned", bundle=str(p.resolve())))
    return out


def run_online_main(cfg: DictConfig) -> dict[str, Any]:
    """``train.py env=online agent=baselines``: the yardstick, with the policies of
    ``env.learned`` (trained elsewhere) if any."""
    seed_everything(int(cfg.seed))
    out = output_dir(cfg)
    t0 = time.perf_counter()
    ds = open_online_dataset(cfg)
    run_name = cfg.get("run_name") or f"{ds.spec.name}__online_baselines__{cfg.seed}"
    tags = {"scenario": ds.scenario.name, "dataset": ds.spec.name, "task": "online_baselines",
            "seed": str(cfg.seed)}
    with tracked_run(cfg, run_name=run_name, tags=tags) as log:
        learned = learned_bundles(cfg)  # before the tuning: a wrong path fails at once
        tuning = tune_online(cfg, ds)
        res = test_online(cfg, tuning, log, out, learned)
    print(f"[online] done in {time.perf_counter() - t0:.0f}s; wrote {out}/summary.csv, "
          "summary.txt, per_interval.csv, tuning.csv, pareto.csv, bounds.csv, pareto.png, "
          "timeline.png" + (f"; MLflow run {log.run_id}" if log.run_id else ""), flush=True)
    return {**res, "output_dir": out, "run_id": log.run_id}
