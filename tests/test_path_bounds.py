"""The hindsight bounds of ``smart/PathShaping-v0`` (``agents/shaping/path_bounds.py``): the
episode's own accounting, the order of the bounds, the case with nothing to separate, and
determinism."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agents.shaping.path_bounds import bounds_summary, bounds_table, episode_bounds
from agents.shaping.path_experiment import _bounds
from envs.shaping.sincon import ShapingError

SMALL = {"tenants": 2, "duration_s": 1.0, "period_s": 0.25, "burst_rate_hz": 2.0,
         "burst_messages": 100}


def test_the_bounds_are_ordered_and_account_as_the_environment_does():
    """``none`` recomputed from the records equals the return the environment paid (Little's
    law); a lane cannot lose to ``none``, and the setups alone are faster than under
    ``none`` whenever a burst shared the path with them."""
    for seed in range(4):
        b = episode_bounds(SMALL, seed)
        assert b["bursts"] > 0
        assert b["return_none_check"] == pytest.approx(b["return_none"], rel=1e-9)
        assert b["return_none"] < b["return_lane"]
        assert b["setup_mean_ms_alone"] < b["setup_mean_ms_none"]


def test_without_bursts_there_is_nothing_to_separate():
    b = episode_bounds({**SMALL, "burst_rate_hz": 0.0}, 0)
    assert b["bursts"] == 0
    assert b["return_lane"] == pytest.approx(b["return_none"], rel=1e-12)
    assert b["setup_mean_ms_alone"] == pytest.approx(b["setup_mean_ms_none"])


def test_same_seeds_same_table_and_a_summary_per_run():
    runs = [(0, [5, 6]), (1, [7])]
    a, b = bounds_table(SMALL, runs), bounds_table(SMALL, runs)
    assert a.equals(b)
    s = bounds_summary(a)
    assert list(s.run) == ["0", "1", "mean"] and list(s.episodes) == [2, 1, 3]
    per = a.groupby("run").lane_vs_none_pct.mean().to_numpy()
    assert s.lane_vs_none_pct.iloc[-1] == pytest.approx(per.mean())
    assert np.isfinite(s.lane_vs_none_ci95.iloc[-1])


def test_a_missing_environment_file_is_named(tmp_path: Path):
    with pytest.raises(ShapingError, match=r"path\.bounds\.env: .*nope\.yaml"):
        _bounds({"seeds": [0], "env": str(tmp_path / "nope.yaml")})
