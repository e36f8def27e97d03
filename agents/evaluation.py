"""Evaluate policies on DSMD instances and tabulate every metric of Section VII-B."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd

from envs.dsmd.cost import CostState, Metrics
from envs.dsmd.instance import DSMDInstance
from envs.progress import Progress

from .exact import InstanceTooLarge
from .policy import Policy, PolicyError

__all__ = ["METRIC_COLUMNS", "evaluate_policies", "format_table", "summarize"]

METRIC_COLUMNS = list(Metrics.__dataclass_fields__)


def evaluate_policies(policies: Sequence[Policy], instances: Sequence[DSMDInstance],
                      progress: bool = True, desc: str = "evaluate") -> pd.DataFrame:
    """One row per (policy, instance): status, wall time and every metric.

    A policy that cannot produce an assignment (an instance too large for the exact
    solver, or infeasible for it) gets a row with its status and NaN metrics.
    """
    rows = []
    bar = Progress(progress, len(policies) * len(instances), desc, unit="instance")
    for pol in policies:
        pol.reset()
        for inst in instances:
            t0 = time.perf_counter()
            row: dict = {"policy": pol.name, "instance": inst.name, "types": inst.num_types}
            try:
                channel = pol.assign(inst)
                row["time_s"] = time.perf_counter() - t0
                row["status"] = pol.info().get("status", "ok")
                row.update(CostState(inst, channel).metrics().as_dict())
            except InstanceTooLarge:
                row.update(time_s=np.nan, status="too_large")
            except PolicyError as e:
                row.update(time_s=time.perf_counter() - t0,
                           status=pol.info().get("status", "failed"), error=str(e))
            rows.append(row)
            bar.step(pol.name)
    bar.close()
    df = pd.DataFrame(rows)
    for c in METRIC_COLUMNS:
        if c not in df:
            df[c] = np.nan
    return df


def summarize(df: pd.DataFrame, by: Iterable[str] = ("policy",)) -> pd.DataFrame:
    """Mean of each metric over the instances a policy solved, plus counts and timing."""
    by = list(by)
    solved = df[df["total_node_traffic_bps"].notna()]
    g = solved.groupby(by, sort=False)
    out = pd.DataFrame({
        "instances": df.groupby(by, sort=False).size(),
        "solved": g.size(),
        "feasible_frac": g["feasible"].mean(),
        "ctrl_traffic_mbps": g["controller_traffic_bps"].mean() / 1e6,
        "sent_msgs_per_s": g["sent_messages_per_s"].mean(),
        "ctrl_sends": g["controller_sends"].mean(),
        "total_node_mbps": g["total_node_traffic_bps"].mean() / 1e6,
        "max_node_mbps": g["max_node_traffic_bps"].mean() / 1e6,
        "redundancy_mbps": g["redundancy_bps"].mean() / 1e6,
        "bw_violation": g["controller_bw_violation"].mean(),
        "cpu_violation": g["controller_cpu_violation"].mean(),
        "node_violation": g["node_violation"].mean(),
        "time_ms": g["time_s"].mean() * 1e3,
    })
    out["solved"] = out["solved"].fillna(0).astype(int)
    if "exact" in set(df["policy"]):
        # mean excess over the proven optimum, on the instances the exact solver solved
        keys = [*(c for c in by if c != "policy"), "instance"]
        opt = df[(df["policy"] == "exact") & (df["status"] == "optimal")][
            [*keys, "total_node_traffic_bps"]].rename(columns={"total_node_traffic_bps": "opt"})
        both = solved.merge(opt, on=keys)
        both = both.assign(gap=100.0 * (both["total_node_traffic_bps"] / both["opt"] - 1.0))
        out["gap_to_exact_pct"] = both.groupby(by, sort=False)["gap"].mean()
    status = df.groupby(by, sort=False)["status"].agg(lambda s: ",".join(sorted(set(s))))
    out["status"] = status
    order = list(dict.fromkeys(map(tuple, df[by].itertuples(index=False, name=None))))
    out = out.reindex(pd.MultiIndex.from_tuples(order, names=by) if len(by) > 1
                      else pd.Index([o[0] for o in order], name=by[0]))
    return out.reset_index()


def format_table(summary: pd.DataFrame) -> str:
    """A fixed-width table for the terminal and the logs."""
    fmt = {"feasible_frac": "{:.2f}", "ctrl_traffic_mbps": "{:.2f}", "sent_msgs_per_s": "{:.1f}",
           "ctrl_sends": "{:.0f}", "total_node_mbps": "{:.2f}", "max_node_mbps": "{:.2f}",
           "redundancy_mbps": "{:.2f}", "bw_violation": "{:.3f}", "cpu_violation": "{:.3f}",
           "node_violation": "{:.3f}", "time_ms": "{:.1f}", "gap_to_exact_pct": "{:+.2f}"}
    cols = list(summary.columns)
    cells = [[("n/a" if (isinstance(v, float) and np.isnan(v)) else fmt.get(c, "{}").format(v))
              for c, v in zip(cols, row)] for row in summary.itertuples(index=False)]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.rjust(w) for c, w in zip(cols, widths))
    body = ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join([line, "-" * len(line), *body])
