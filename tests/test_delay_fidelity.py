"""bench/bench_delay.py --fidelity: the delay model's p95 beside a testbed output's measured
one, per point, with the point's saturation (a shaped link dropped packets)."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from envs.dsmd.delay import DelayLoad

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench_delay():
    spec = importlib.util.spec_from_file_location("bench_delay_under_test",
                                                  ROOT / "bench" / "bench_delay.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def _load(util: float) -> dict:
    n = 4
    cb = 1e6
    return DelayLoad(30.0, cb, 64.0, util * cb, 10.0, 2.0, 1.0, 8_000.0,
                     np.full(n, 1e7), np.full(n, 1e5), np.full(n, 30.0),
                     np.zeros(n)).to_dict()


def _output(tmp: Path, label: str, runs: list[tuple[str, float, float, int]]) -> Path:
    """A testbed output: summary.csv and each run's delay_loads_realised.json."""
    rows = []
    for policy, util, p95_ms, drops in runs:
        d = tmp / "runs" / f"{label.replace('/', '_')}_{policy}_r0"
        d.mkdir(parents=True)
        (d / "delay_loads_realised.json").write_text(json.dumps([_load(util)]))
        rows.append({"label": label, "policy": policy, "repeat": 0, "payload_scale": 1.0,
                     "time_scale": 1.0, "wall_s": 30.0, "delay_p50_ms": p95_ms / 2,
                     "delay_p95_ms": p95_ms, "link_controller_bytes": util * 1e6 * 30 / 8,
                     "subscribe_infos": 0, "link_controller_drops": drops,
                     "link_node_drops": 0})
    with (tmp / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return tmp


def test_fidelity_ranks_the_policies_and_flags_a_saturated_point(bench_delay, tmp_path
                                                                 ) -> None:
    below = _output(tmp_path / "a", "fig9/vpcs=64",
                    [("p1", 0.2, 100.0, 0), ("p2", 0.5, 200.0, 0), ("p3", 0.8, 400.0, 0)])
    at = _output(tmp_path / "b", "fig9/vpcs=512",
                 [("p1", 0.2, 300.0, 12), ("p2", 0.5, 200.0, 40), ("p3", 0.8, 100.0, 0)])
    rows, points = bench_delay.fidelity([below, at])
    assert len(rows) == 6 and {r["link_drops"] for r in rows} == {0, 12, 40}
    lo, hi = points["fig9/vpcs=64 (as delivered)"], points["fig9/vpcs=512 (as delivered)"]
    # the model's p95 grows with C_b's utilisation: it ranks the first point's policies
    assert lo["spearman"] == pytest.approx(1.0) and hi["spearman"] == pytest.approx(-1.0)
    assert (lo["saturated"], lo["saturated_runs"], lo["runs"]) == (False, 0, 3)
    assert (hi["saturated"], hi["saturated_runs"], hi["runs"]) == (True, 2, 3)


def test_fidelity_without_loads_names_the_outputs(bench_delay, tmp_path) -> None:
    out = _output(tmp_path, "fig10", [("p1", 0.2, 100.0, 0)])
    (out / "runs" / "fig10_p1_r0" / "delay_loads_realised.json").unlink()
    with pytest.raises(SystemExit, match="no testbed run with delay loads"):
        bench_delay.fidelity(out)
