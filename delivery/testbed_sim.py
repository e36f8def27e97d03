"""``python testbed.py simulate=true``: a testbed configuration's points in the simulator.

Every policy of the configuration runs through the online simulator
(:class:`envs.dsmd.online.OnlineSimulator`) on the very traces the testbed replays (Fig. 9's
VPC counts, Fig. 10's windows: :func:`delivery.experiment.figure_points`), and each interval
is scored by the online cost: node traffic, the calibrated delay model's p50 and p95 (C_b,
C_p and every s(n) queueing, plus the hold of each switch's SubscribeInfos) and the switching
terms. No broker, agent or network is started; a point takes seconds.

Two references sit beside the policies, so that a point says how much delay there is to win:

* ``oracle``: the greedy hindsight oracle (:class:`agents.online.HindsightGreedy`, horizon 1),
  which plans each interval on its realised rates and types;
* ``idcs_free_switches``: IDCS's channels scored with every switch free (no hold, no
  switching terms). IDCS sends each message once over the controller's link (unicast types
  by RPC, the others published once), so its controller load is the least any channel
  table can have; with the switches free as well, its p95 is the delay model's floor for
  the point wherever the node links are far from full (``node_util_max``).

The testbed's first window is primed (decided on its own rates before it is replayed); the
simulator starts it cold instead (every type placed on its first message), so compare the
later windows. Output in the run directory: ``sim.csv`` (one row per point, policy and
window), ``sim_summary.csv`` (per point and policy: the mean cost, the worst window's p95,
the SubscribeInfos, and with ``simulate_measured``, one or more testbed outputs, the
measured p95 beside them) and
``sim_headline.json``; an MLflow run like the testbed's.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from envs.dsmd.online import OnlineCost, OnlineSimulator, OnlineTrace

from .experiment import FigurePoint, figure_points, policy_params
from .health import ConfigError

__all__ = ["REFERENCES", "simulate_point", "simulate_testbed"]

#: the reference rows of every point (module docstring)
REFERENCES = ("oracle", "idcs_free_switches")
#: the columns kept per window
COLUMNS = ("cost", "redundancy_ratio", "delay_p50_s", "delay_p95_s", "hold_s",
           "subscribe_infos", "moved_types", "controller_traffic_bps", "bw_util",
           "node_util_max", "violation", "types")


def _decider(name: str, params: dict[str, Any]):
    """A testbed policy as the simulator's decider, with the cost it plans with (None for
    ``learned``: the static bundle the policy server runs has no online decider)."""
    from agents.online_eval import DeciderSpec

    from .policies import ONLINE_DEFAULTS, STATIC

    p = dict(params)
    if name in STATIC:
        return DeciderSpec.make(name, "static", policy=name, **p), None
    if name in ONLINE_DEFAULTS:
        kind, defaults = ONLINE_DEFAULTS[name]
        cost = OnlineCost.from_dict(p.pop("cost", None))
        return DeciderSpec.make(name, kind, **{**defaults, **p}), cost
    return None, None


def _free_switches(cost: OnlineCost) -> OnlineCost:
    """The same cost with every switch free: no hold, no switching terms."""
    model = dataclasses.replace(cost.delay, hold_s_per_subscribe=0.0,
                                hold_s_per_unsubscribe=0.0, hold_s_per_moved_type=0.0)
    return dataclasses.replace(cost, w_subscribe=0.0, w_move=0.0, delay=model)


def simulate_point(point: FigurePoint, policies: list[str],
                   params: dict[str, dict[str, Any]], cost: OnlineCost | None = None
                   ) -> list[dict[str, Any]]:
    """One row per (policy or reference, window) of ``point``: :data:`COLUMNS` of the
    simulator's interval, scored with ``cost`` (the calibrated online cost by default)."""
    from agents.online_eval import DeciderSpec

    score = cost or OnlineCost()
    ps = point.problems
    trace = OnlineTrace.from_dataset(ps.dataset, ps.spec, point.label)
    last = max(point.windows) + 1
    if last > trace.num_windows:
        raise ConfigError(f"{point.label}: windows up to {last - 1}, the trace has "
                          f"{trace.num_windows}")
    runs: list[tuple[str, Any, OnlineCost, OnlineCost, bool]] = []
    for name in policies:
        spec, plan_cost = _decider(name, params.get(name, {}))
        if spec is not None:
            runs.append((name, spec, plan_cost or score, score, False))
    runs.append(("oracle", DeciderSpec.make("oracle", "oracle", horizon=1.0), score, score,
                 True))
    free = _free_switches(score)
    runs.append(("idcs_free_switches", DeciderSpec.make("idcs", "static", policy="idcs"),
                 free, free, False))
    rows = []
    keep = set(point.windows)
    for name, spec, plan_cost, scoring, hindsight in runs:
        sim = OnlineSimulator(trace, scoring, hindsight=hindsight)
        for r in sim.run(spec.build(trace, plan_cost), last):
            d = r.as_dict()
            if int(d["window"]) not in keep:
                continue
            rows.append({"figure": point.figure, "label": point.label, "vpcs": point.vpcs,
                         "policy": name, "window": int(d["window"]),
                         **{k: float(d.get(k, math.nan)) for k in COLUMNS}})
    return rows


def _summary(df: pd.DataFrame, first: dict[str, int]) -> pd.DataFrame:
    """Per point and policy, over the windows after each point's first (primed) one: the
    mean cost and redundancy, the worst window's p95 (ms, as the testbed's ``sim_*``
    columns), the mean p95, the SubscribeInfos, and the p95 against IDCS's."""
    later = df[df.window > df.label.map(first)]
    if later.empty:  # one window per point: nothing but the first to compare
        later = df
    g = later.groupby(["figure", "label", "policy"], sort=False)
    out = pd.DataFrame({
        "vpcs": g.vpcs.first(), "cost": g.cost.mean(),
        "redundancy_ratio": g.redundancy_ratio.mean(),
        "delay_p95_ms": 1e3 * g.delay_p95_s.max(), "delay_p95_mean_ms": 1e3 * g.delay_p95_s.mean(),
        "delay_p50_ms": 1e3 * g.delay_p50_s.max(), "subscribe_infos": g.subscribe_infos.sum(),
        "moved_types": g.moved_types.sum(), "bw_util_max": g.bw_util.max(),
        "node_util_max": g.node_util_max.max()}).reset_index()
    idcs = out[out.policy == "idcs"].set_index("label")
    if not idcs.empty:
        out["p95_vs_idcs"] = out.delay_p95_ms / out.label.map(idcs.delay_p95_ms)
        out["cost_vs_idcs"] = out.cost - out.label.map(idcs.cost)
    return out


def _with_measured(summary: pd.DataFrame, measured: list[Path]) -> pd.DataFrame:
    """The measured p95 (median over repetitions) beside the simulator's, from testbed
    outputs' ``summary.csv`` or ``fig9.csv`` (a point measured in several: all its runs)."""
    frames = []
    for src in measured:
        f = src / "summary.csv" if (src / "summary.csv").is_file() else src / "fig9.csv"
        if not f.is_file():
            raise ConfigError(f"simulate_measured: {src} has no summary.csv or fig9.csv")
        m = pd.read_csv(f)
        if "label" not in m.columns or "delay_p95_ms" not in m.columns:
            raise ConfigError(f"simulate_measured: {f} lacks the label or delay_p95_ms column")
        frames.append(m[["label", "policy", "delay_p95_ms"]])
    med = pd.concat(frames).groupby(["label", "policy"]).delay_p95_ms.median()
    return summary.join(med.rename("measured_p95_ms"), on=["label", "policy"])


def _headline(summary: pd.DataFrame) -> dict[str, Any]:
    """Per point: the policies by the simulator's worst-window p95 and by mean cost, the
    floor's share of IDCS's p95, and (with measurements) Spearman's rho of the simulated
    against the measured p95."""
    head: dict[str, Any] = {}
    for label, d in summary.groupby("label", sort=False):
        pol = d[~d.policy.isin(REFERENCES)]
        entry: dict[str, Any] = {
            "by_p95": pol.sort_values("delay_p95_ms").policy.tolist(),
            "by_cost": pol.sort_values("cost").policy.tolist()}
        ref = d.set_index("policy")
        if "idcs" in ref.index:
            for r in REFERENCES:
                if r in ref.index:
                    entry[f"{r}_p95_vs_idcs"] = round(
                        float(ref.delay_p95_ms[r] / ref.delay_p95_ms["idcs"]), 3)
        if "measured_p95_ms" in d.columns:
            both = pol.dropna(subset=["measured_p95_ms"])
            if len(both) >= 3:
                rho = both.delay_p95_ms.rank().corr(both.measured_p95_ms.rank())
                entry["spearman_measured"] = None if np.isnan(rho) else round(float(rho), 2)
        head[str(label)] = entry
    return head


def simulate_testbed(cfg: DictConfig) -> dict[str, Any]:
    """Every point of ``cfg`` (module docstring) in the simulator; tables in ``cfg.out_dir``."""
    from agents.tracking import tracked_run

    out = Path(str(cfg.out_dir))
    out.mkdir(parents=True, exist_ok=True)
    policies = [str(p) for p in cfg.policies]
    params = {p: policy_params(cfg, p) for p in policies}
    skipped = [p for p in policies if _decider(p, params[p])[0] is None]
    points = figure_points(cfg)
    with tracked_run(cfg, run_name=f"testbed_sim__{cfg.scenario}",
                     tags={"task": "testbed_sim"}) as mlog:
        rows: list[dict[str, Any]] = []
        for i, pt in enumerate(points):
            print(f"[{i + 1}/{len(points)}] {pt.label}: {len(policies) - len(skipped)} "
                  f"policies and {len(REFERENCES)} references in the simulator", flush=True)
            rows += simulate_point(pt, policies, params)
        df = pd.DataFrame(rows)
        summary = _summary(df, {pt.label: pt.windows[0] for pt in points})
        measured = cfg.get("simulate_measured")
        if measured:
            srcs = [measured] if isinstance(measured, str) else list(measured)
            summary = _with_measured(summary, [Path(str(m)) for m in srcs])
        head = _headline(summary)
        if skipped:
            head["not simulated"] = dict.fromkeys(
                skipped, "a static bundle served by the policy server: no online decider")
        mlog.table(df, out / "sim.csv")
        mlog.table(summary, out / "sim_summary.csv")
        (out / "sim_headline.json").write_text(json.dumps(head, indent=2))
        mlog.text(json.dumps(head, indent=2), "sim_headline.json")
        mlog.text(OmegaConf.to_yaml(cfg, resolve=True), "testbed_config.yaml")
        for label, d in summary.groupby("label", sort=False):
            print(f"{label}: " + ", ".join(
                f"{r.policy} p95 {r.delay_p95_ms:.0f} ms cost {r.cost:.3f}"
                for r in d.sort_values("delay_p95_ms").itertuples()), flush=True)
    print(f"testbed in the simulator: results in {out}", flush=True)
    return {"tables": {"sim": df, "sim_summary": summary}, "headline": head, "out_dir": out}
