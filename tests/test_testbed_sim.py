"""``python testbed.py simulate=true``: the testbed's own points in the simulator, with the
hindsight oracle and IDCS with free switches beside the policies, and the measured p95 set
beside the simulated one."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from agents.config import CONFIG_DIR
from delivery.experiment import figure_points, run_testbed
from delivery.health import ConfigError
from delivery.testbed_sim import REFERENCES, simulate_point


def _cfg(tmp_path: Path, *extra: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="testbed", overrides=[
            "experiment=testbed_small", "simulate=true", "logger=none",
            "policies=[idcs,vita,online_greedy,learned]", f"out_dir={tmp_path}", *extra])


def test_the_points_are_the_testbeds_own(tmp_path: Path) -> None:
    """The simulator replays what the testbed replays: one point per Fig. 9 VPC count (a
    priming interval and ``fig9.windows`` more) and Fig. 10's windows of the scenario."""
    pts = figure_points(_cfg(tmp_path))
    assert [p.label for p in pts] == ["fig9/vpcs=6", "fig9/vpcs=12", "fig10"]
    assert [p.windows for p in pts] == [[0, 1], [0, 1], [0, 1]]
    assert [p.problems.spec.num_vpcs for p in pts[:2]] == [6, 12]
    assert pts[0].problems.spec.duration_s == 2 * pts[0].problems.spec.interval_s


def test_simulate_writes_every_point_policy_and_reference(tmp_path: Path) -> None:
    """Every policy with an online decider and both references have a row per point and
    window; ``learned`` (a static bundle) is named as not simulated; IDCS with free switches
    is never slower than IDCS, and costs no more."""
    out = run_testbed(_cfg(tmp_path))
    df = pd.read_csv(tmp_path / "sim.csv")
    expect = {"idcs", "vita", "online_greedy", *REFERENCES}
    assert set(df.policy) == expect
    assert set(df.label) == {"fig9/vpcs=6", "fig9/vpcs=12", "fig10"}
    assert (df.groupby(["label", "policy"]).size() == 2).all()  # windows 0 and 1
    s = pd.read_csv(tmp_path / "sim_summary.csv").set_index(["label", "policy"])
    for label in ("fig9/vpcs=6", "fig9/vpcs=12", "fig10"):
        assert s.loc[(label, "idcs_free_switches"), "delay_p95_ms"] <= \
            s.loc[(label, "idcs"), "delay_p95_ms"] + 1e-9
        assert s.loc[(label, "idcs_free_switches"), "cost"] <= s.loc[(label, "idcs"), "cost"]
        assert s.loc[(label, "idcs"), "p95_vs_idcs"] == pytest.approx(1.0)
    head = json.loads((tmp_path / "sim_headline.json").read_text())
    assert "learned" in head["not simulated"]
    assert set(head["fig9/vpcs=6"]["by_p95"]) == {"idcs", "vita", "online_greedy"}
    assert out["headline"] == head


def test_same_configuration_same_tables(tmp_path: Path) -> None:
    """The simulator is deterministic: a point simulated twice gives the same rows."""
    cfg = _cfg(tmp_path)
    pt = figure_points(cfg)[0]
    a = simulate_point(pt, ["idcs", "online_greedy"], {})
    b = simulate_point(pt, ["idcs", "online_greedy"], {})
    assert a == b


def test_measured_delays_are_set_beside_and_ranked(tmp_path: Path) -> None:
    """With ``simulate_measured`` (a testbed output), each point gets the measured p95's
    median beside the simulated one and Spearman's rho between them; an output without
    the tables is refused by name."""
    measured = tmp_path / "measured"
    measured.mkdir()
    rows = [{"label": f"fig9/vpcs={v}", "policy": p, "repeat": r, "delay_p95_ms": d + r}
            for v in (6, 12) for r in (0, 1)
            for p, d in (("idcs", 100.0), ("vita", 200.0), ("online_greedy", 300.0))]
    pd.DataFrame(rows).to_csv(measured / "fig9.csv", index=False)
    run_testbed(_cfg(tmp_path / "out", f"simulate_measured={measured}"))
    s = pd.read_csv(tmp_path / "out" / "sim_summary.csv").set_index(["label", "policy"])
    assert s.loc[("fig9/vpcs=6", "vita"), "measured_p95_ms"] == pytest.approx(200.5)
    assert pd.isna(s.loc[("fig9/vpcs=6", "oracle"), "measured_p95_ms"])
    head = json.loads((tmp_path / "out" / "sim_headline.json").read_text())
    assert -1.0 <= head["fig9/vpcs=6"]["spearman_measured"] <= 1.0
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"simulate_measured: .*no summary\.csv or fig9\.csv"):
        run_testbed(_cfg(tmp_path / "out2", f"simulate_measured={empty}"))
