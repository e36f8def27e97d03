"""``python forecast.py``: fit the send forecaster and judge it against the classical
forecasts of intermittent demand, on held-out traces (``configs/forecast.yaml``).

Protocol: the demand panels (:func:`envs.dsmd.demand.trace_panel`) of the dataset's
training, validation and test traces; the gradient-boosted forecaster and a logistic
regression on the same features are fitted on the training traces, and the family with the
lower validation log loss is the one exported. The classical forecasts are tuned on
validation too: TSB's smoothing constant (the best of :data:`envs.dsmd.demand.TSB_ALPHAS`) and
the last-interval forecast's two probabilities (after traffic, after silence: fitted on the
training traces). Every method is scored on the test traces by log loss, Brier score and
calibration error, and the exported forecaster's log loss is compared, paired by trace, to
the best classical forecast on validation, with a 95% t-interval over the test traces.

Rates, on the rows where the type sends: the quantile forecaster (one gradient-boosted
quantile-loss model per level of ``rates.quantiles``, fitted on the training traces) against
the last rate and the EWMA of the log rate (its constant chosen on validation), each made a
quantile forecast with its training residuals' quantiles; scored on the test traces by the
pinball loss per level and averaged, and the coverage of the outer levels, with the same
paired comparison.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from omegaconf import DictConfig

from envs.dsmd.demand import RATE_ALPHAS, TSB_ALPHAS, DemandPanel, trace_panel
from envs.dsmd.online_env import load_online_traces
from envs.stats import ci95
from reporting.reproduction import machine_summary

from .forecaster import (
    calibrated_last,
    fit_rate_forecaster,
    fit_send_forecaster,
    pinball_scores,
    probability_scores,
    rate_target,
    residual_quantiles,
)
from .plots import pinball_plot, reliability_plot

__all__ = ["run_forecast"]

CLASSICAL = ("last", "croston", "sba", "tsb")


def _say(msg: str) -> None:
    print(msg, flush=True)


def _panels(dataset: str, split: str, limit: Any, cache_dir: str) -> list[DemandPanel]:
    traces = load_online_traces(dataset, split, cache_dir=cache_dir,
                                limit=None if limit is None else int(limit))
    return [trace_panel(t) for t in traces]


def _classical(panel: DemandPanel, method: str, tsb_alpha: float,
               last_p: tuple[float, float]) -> np.ndarray:
    if method == "last":
        return np.where(panel.baselines["last"] > 0.5, *last_p)
    if method == "tsb":
        return panel.baselines[f"tsb_{tsb_alpha}"]
    return panel.baselines[method]


def _t_interval(d: np.ndarray) -> tuple[float, float, float]:
    """(mean, lower, upper) of the 95% t-interval of ``d`` (nan bounds for one value)."""
    m, h = float(d.mean()), ci95(d)
    return m, m - h, m + h


def run_forecast(cfg: DictConfig) -> dict[str, Any]:
    """The whole protocol of the module docstring for ``cfg``."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from .tracking import tracked_run

    out = Path(str(cfg.out_dir))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tracked_run(cfg, run_name=f"forecast__{cfg.dataset_name}",
                     tags={"task": "forecast"}) as mlog:
        splits = {}
        for split, limit in (("train", cfg.train_traces), ("validation", cfg.validation_traces),
                             ("test", cfg.test_traces)):
            panels = _panels(str(cfg.dataset_name), split, limit, str(cfg.paths.data_dir))
            splits[split] = panels
            _say(f"[forecast] {split}: {len(panels)} traces, "
                 f"{sum(p.y.size for p in panels):,} (interval, known type) rows "
                 f"({time.perf_counter() - t0:.0f} s)")
        train, val, test = (splits[s] for s in ("train", "validation", "test"))
        m = cfg.model
        gbt = fit_send_forecaster(train, max_iter=int(m.max_iter),
                                  learning_rate=float(m.learning_rate),
                                  max_leaf_nodes=int(m.max_leaf_nodes), seed=int(cfg.seed))
        _say(f"[forecast] gradient-boosted trees fitted ({time.perf_counter() - t0:.0f} s)")
        x = np.concatenate([p.x for p in train])
        y = np.concatenate([p.y for p in train])
        logit = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000)).fit(x, y)
        _say(f"[forecast] logistic regression fitted ({time.perf_counter() - t0:.0f} s)")
        last_p = calibrated_last(train)
        yv = np.concatenate([p.y for p in val])

        def learned(name: str, p: DemandPanel) -> np.ndarray:
            if name == "gbt":
                return gbt.probability(p.x)
            out: np.ndarray = logit.predict_proba(p.x)[:, 1]
            return out

        def val_loss(fn: Any) -> float:
            return probability_scores(np.concatenate([fn(p) for p in val]), yv)["log_loss"]

        tsb_alpha = min(TSB_ALPHAS, key=lambda a: val_loss(
            lambda p: _classical(p, "tsb", a, last_p)))
        val_scores = {meth: val_loss(lambda p, k=meth: _classical(p, k, tsb_alpha, last_p))
                      for meth in CLASSICAL}
        val_scores |= {meth: val_loss(lambda p, k=meth: learned(k, p))
                       for meth in ("gbt", "logistic")}
        family = min(("gbt", "logistic"), key=val_scores.__getitem__)
        best_classical = min(CLASSICAL, key=val_scores.__getitem__)
        _say("[forecast] validation log loss: "
             + ", ".join(f"{k} {v:.4f}" for k, v in val_scores.items())
             + f" (TSB alpha {tsb_alpha}); chosen family: {family}")

        methods = {**{k: (lambda p, k=k: _classical(p, k, tsb_alpha, last_p))
                      for k in CLASSICAL},
                   "gbt": lambda p: learned("gbt", p),
                   "logistic": lambda p: learned("logistic", p)}
        preds = {k: [fn(p) for p in test] for k, fn in methods.items()}
        yt = np.concatenate([p.y for p in test])
        rows = []
        for k, per_trace in preds.items():
            s = probability_scores(np.concatenate(per_trace), yt)
            rows.append({"method": k, **s, "validation_log_loss": val_scores[k]})
        table = pd.DataFrame(rows).sort_values("log_loss")
        per_trace = np.array([
            probability_scores(preds[family][i], test[i].y)["log_loss"]
            - probability_scores(preds[best_classical][i], test[i].y)["log_loss"]
            for i in range(len(test))])
        mean, lo, hi = _t_interval(per_trace)
        # the exported forecaster is the gradient-boosted one (NumPy at run time); the
        # logistic family is reported beside it
        path = gbt.save(out / "send_forecaster.npz")
        mlog.table(table, out / "scores.csv")
        mlog.artifact(path, "model")
        plot = reliability_plot({k: np.concatenate(v) for k, v in preds.items()
                                  if k in ("gbt", "logistic", best_classical, "last")},
                                 yt, out / "reliability.png")
        mlog.artifact(plot, "plots")
        mlog.metrics({f"{r['method']}/{c}": r[c] for r in rows
                      for c in ("log_loss", "brier", "ece")})
        rates = _rate_study(cfg, train, val, test, out, mlog)
        _say(f"[forecast] rates done ({time.perf_counter() - t0:.0f} s)")
        head = {"generated": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
                "machine": machine_summary(),
                "command": shlex.join(["python", "forecast.py", *sys.argv[1:]]),
                "dataset": str(cfg.dataset_name),
                "traces": {s: len(splits[s]) for s in splits},
                "tsb_alpha": tsb_alpha, "family": family, "best_classical": best_classical,
                "paired_log_loss_difference": {"mean": mean, "ci95": [lo, hi],
                                               "of": f"{family} - {best_classical}"},
                "scores": table.round(5).to_dict(orient="records"),
                "rates": rates}
        (out / "headline.json").write_text(json.dumps(head, indent=2))
        mlog.text(json.dumps(head, indent=2), "headline.json")
        md = _summary_md(table, head)
        (out / "summary.md").write_text(md)
        mlog.text(md, "summary.md")
    _say(md)
    _say(f"[forecast] done in {time.perf_counter() - t0:.0f} s; results in {out}")
    return head


def _summary_md(table: pd.DataFrame, head: dict[str, Any]) -> str:
    d = head["paired_log_loss_difference"]
    lines = [f"Generated {head['generated']} on {head['machine']} by `{head['command']}`.", "",
             f"Send forecaster on `{head['dataset']}` "
             f"({head['traces']['train']} training, {head['traces']['validation']} "
             f"validation, {head['traces']['test']} test traces)", "",
             "| method | log loss | Brier | ECE | validation log loss |", "|---|---|---|---|---|"]
    for _, r in table.iterrows():
        lines.append(f"| {r.method} | {r.log_loss:.4f} | {r.brier:.4f} | {r.ece:.4f} | "
                     f"{r.validation_log_loss:.4f} |")
    lines += ["", f"TSB's alpha (validation): {head['tsb_alpha']}; best classical forecast on "
              f"validation: {head['best_classical']}; family chosen on validation: "
              f"{head['family']}.",
              f"Paired by test trace, log loss of {d['of']}: {d['mean']:+.4f} "
              f"(95% interval {d['ci95'][0]:+.4f} to {d['ci95'][1]:+.4f}).", ""]
    r = head["rates"]
    levels = [f"{q:g}" for q in r["quantiles"]]
    lines += [f"Rate quantiles of `log1p(rate)` where the type sends "
              f"({r['rows']['test']:,} test rows), levels {', '.join(levels)}", "",
              "| method | pinball (mean) | " + " | ".join(f"pinball {q}" for q in levels)
              + " | coverage | validation pinball |",
              "|---|---|" + "---|" * len(levels) + "---|---|"]
    for x in r["scores"]:
        lines.append(f"| {x['method']} | {x['pinball']:.4f} | "
                     + " | ".join(f"{x[f'pinball_{q}']:.4f}" for q in levels)
                     + f" | {x['coverage']:.3f} | {x['validation_pinball']:.4f} |")
    pd_ = r["paired_pinball_difference"]
    lines += ["", f"EWMA's alpha (validation): {r['ewma_alpha']}; best classical rate forecast "
              f"on validation: {r['best_classical']}.",
              f"Paired by test trace, pinball loss of {pd_['of']}: {pd_['mean']:+.4f} "
              f"(95% interval {pd_['ci95'][0]:+.4f} to {pd_['ci95'][1]:+.4f}).", ""]
    return "\n".join(lines)


RATE_CLASSICAL = ("last", "ewma")


def _rate_study(cfg: DictConfig, train: list[DemandPanel], val: list[DemandPanel],
                test: list[DemandPanel], out: Path, mlog: Any) -> dict[str, Any]:
    """The rate half of the module docstring's protocol; returns its headline."""
    qs = tuple(float(q) for q in cfg.rates.quantiles)
    m = cfg.model
    model = fit_rate_forecaster(train, qs, max_iter=int(m.max_iter),
                                learning_rate=float(m.learning_rate),
                                max_leaf_nodes=int(m.max_leaf_nodes), seed=int(cfg.seed))

    def point(p: DemandPanel, method: str, alpha: float) -> np.ndarray:
        rows, _ = rate_target(p)
        key = "last" if method == "last" else f"ewma_{alpha}"
        return p.rate_baselines[key][rows]

    def residuals(method: str, alpha: float) -> np.ndarray:
        return residual_quantiles(np.concatenate([point(p, method, alpha) for p in train]),
                                  np.concatenate([rate_target(p)[1] for p in train]), qs)

    def classical(method: str, alpha: float) -> Any:
        r = residuals(method, alpha)
        return lambda p: point(p, method, alpha)[:, None] + r[None, :]

    def learned(p: DemandPanel) -> np.ndarray:
        rows, _ = rate_target(p)
        return model.log_rate(p.x[rows])

    def loss(fn: Any, panels: list[DemandPanel]) -> float:
        return pinball_scores(np.concatenate([fn(p) for p in panels]),
                              np.concatenate([rate_target(p)[1] for p in panels]), qs)["pinball"]

    alpha = min(RATE_ALPHAS, key=lambda a: loss(classical("ewma", a), val))
    methods = {"last": classical("last", 0.0), "ewma": classical("ewma", alpha), "gbt": learned}
    val_scores = {k: loss(fn, val) for k, fn in methods.items()}
    best = min(RATE_CLASSICAL, key=val_scores.__getitem__)
    zt = np.concatenate([rate_target(p)[1] for p in test])
    preds = {k: [fn(p) for p in test] for k, fn in methods.items()}
    rows = [{"method": k, **pinball_scores(np.concatenate(v), zt, qs),
             "validation_pinball": val_scores[k]} for k, v in preds.items()]
    table = pd.DataFrame(rows).sort_values("pinball")
    diff = np.array([pinball_scores(preds["gbt"][i], rate_target(p)[1], qs)["pinball"]
                     - pinball_scores(preds[best][i], rate_target(p)[1], qs)["pinball"]
                     for i, p in enumerate(test)])
    mean, lo, hi = _t_interval(diff)
    path = model.save(out / "rate_forecaster.npz")
    mlog.table(table, out / "rate_scores.csv")
    mlog.artifact(path, "model")
    plot = pinball_plot(table, qs, out / "rate_pinball.png")
    mlog.artifact(plot, "plots")
    mlog.metrics({f"rate/{r['method']}/{c}": r[c] for r in rows
                  for c in ("pinball", "coverage")})
    _say("[forecast] rate pinball loss on validation: "
         + ", ".join(f"{k} {v:.4f}" for k, v in val_scores.items()) + f" (EWMA alpha {alpha})")
    return {"quantiles": list(qs), "ewma_alpha": alpha, "best_classical": best,
            "rows": {"test": int(zt.size)},
            "paired_pinball_difference": {"mean": mean, "ci95": [lo, hi],
                                          "of": f"gbt - {best}"},
            "scores": table.round(5).to_dict(orient="records")}
