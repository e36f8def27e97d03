"""The testbed's result tables without running it: medians over the repetitions, the
headline's speedups and rank agreement, and completed outputs merged into one."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from agents.config import CONFIG_DIR
from delivery.experiment import (
    best_dual,
    check_policies,
    merge_outputs,
    network_spec,
    policy_params,
    rank_agreement,
    speedups,
)
from delivery.health import ConfigError
from envs.dsmd.problems import problems_for

POLICIES = {"rpc": 3000.0, "vita": 2000.0, "idcs": 800.0, "learned": 1000.0}  # p95 delay ms


def _output(root: Path, name: str, vpcs: list[int], repeats: int, fig10: bool = False
            ) -> Path:
    """A completed testbed output as the testbed writes it (summary.csv, fig10.csv)."""
    rows, buckets = [], []
    for v in vpcs:
        for rep in range(repeats):
            for pol, delay in POLICIES.items():
                rows.append({"label": f"fig9/vpcs={v}", "policy": pol, "figure": "fig9",
                             "repeat": rep, "vpcs": v, "network": "smt1x1", "messages": 10 * v,
                             "delay_p95_ms": delay * v / 512 + rep,
                             "controller_bytes": 1e6 * v, "controller_cpu_util": 0.1,
                             "node_bytes_total": 2e6 * v, "sim_utilisation": delay / 1000})
    if fig10:
        for pol, delay in POLICIES.items():
            rows.append({"label": "fig10", "policy": pol, "figure": "fig10", "repeat": 0,
                         "vpcs": 512, "network": "smt1x1", "messages": 1000,
                         "delay_p95_ms": delay,
                         "controller_bytes": 1e6, "controller_cpu_util": 0.1,
                         "node_bytes_total": 2e6, "sim_utilisation": delay / 1000})
            buckets += [{"policy": pol, "window": w, "repeat": 0, "delay_p95_ms": delay,
                         "controller_bytes": 1e5, "controller_cpu_util": 0.1,
                         "node_bytes_total": 2e5} for w in range(3)]
    d = root / name
    d.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(d / "summary.csv", index=False)
    if buckets:
        pd.DataFrame(buckets).to_csv(d / "fig10.csv", index=False)
    return d


def test_headline_helpers_rank_by_the_median_over_repetitions() -> None:
    df = pd.DataFrame([{"policy": p, "delay_p95_ms": d + r, "sim_utilisation": d / 1000,
                        "controller_bytes": -d} for p, d in POLICIES.items() for r in (0, 1, 100)])
    assert speedups(df)["rpc"] == pytest.approx(3001 / 1001)
    assert best_dual(df) == "idcs"                       # RPC-only is never "dual"
    fast_vita = df.assign(delay_p95_ms=df.delay_p95_ms.where(df.policy != "vita", 1.0))
    assert best_dual(fast_vita) == "idcs"                # nor is VITA (MQ only)
    rank = rank_agreement(df)
    assert rank["measured"] == ["idcs", "learned", "vita", "rpc"]
    assert rank["spearman"] == 1.0
    assert rank["spearman_controller_bytes"] == -1.0
    assert "spearman_delay_model" not in rank             # no delay model column: no rank
    model = df.assign(sim_delay_p95_ms=df.policy.map({"rpc": 9.0, "vita": 1.0, "idcs": 2.0,
                                                      "learned": 3.0}))
    rank = rank_agreement(model)
    assert rank["delay_model"] == ["vita", "idcs", "learned", "rpc"]
    assert rank["spearman_delay_model"] == pytest.approx(0.4)
    # the intervals as delivered, where the runs have them, before the boundary decisions
    real = model.assign(sim_realised_delay_p95_ms=model.delay_p95_ms)
    assert rank_agreement(real)["spearman_delay_model"] == 1.0


def test_policies_and_their_parameters_are_checked_before_anything_starts() -> None:
    """The testbed's policies come with their parameters (``policy_params``): the tuned
    online deciders' knobs, the send forecaster of ``forecast_drop``. An unknown policy, a
    parameter a policy does not take, or ``forecast_drop`` without its forecaster is refused
    by name before the broker or any agent starts."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="testbed",
                      overrides=["policies=[idcs,online_greedy,forecast_drop]"])
        typo = compose(config_name="testbed", overrides=["policies=[idcs,forcast_drop]"])
        bad = compose(config_name="testbed", overrides=[
            "policies=[online_greedy]", "+policy_params.online_greedy.hedroom=0.2"])
        nofile = compose(config_name="testbed", overrides=[
            "policies=[forecast_drop]", "policy_params.forecast_drop.send_forecaster=null"])
        learned = compose(config_name="testbed", overrides=[
            "policies=[learned]", "+policy_params.learned.headroom=0.2"])
        greedy = compose(config_name="testbed", overrides=[
            "policies=[greedy]", "+policy_params.greedy.pases=2"])
    assert policy_params(cfg, "online_greedy") == {}
    assert Path(policy_params(cfg, "forecast_drop")["send_forecaster"]).is_file()
    assert policy_params(cfg, "idcs") == {}
    check_policies(cfg)
    with pytest.raises(ConfigError, match=r"policies: unknown policy 'forcast_drop'"):
        check_policies(typo)
    with pytest.raises(ConfigError, match=r"policy_params\.online_greedy: .*bad parameter"):
        check_policies(bad)
    with pytest.raises(ConfigError, match=r"policy_params\.forecast_drop: .*send_forecaster"):
        check_policies(nofile)
    with pytest.raises(ConfigError, match=r"policy_params\.learned: .*no parameters"):
        check_policies(learned)
    with pytest.raises(ConfigError, match=r"policy_params\.greedy: .*pases"):
        check_policies(greedy)


def test_merge_outputs_rebuilds_tables_medians_headline_and_plots(tmp_path: Path) -> None:
    a = _output(tmp_path, "a", [64], repeats=3)
    b = _output(tmp_path, "b", [1024], repeats=3, fig10=True)
    before = {p: p.read_bytes() for p in (a / "summary.csv", b / "summary.csv")}
    res = merge_outputs([a, b], tmp_path / "merged", "godaddy")
    out = tmp_path / "merged"
    med = pd.read_csv(out / "fig9_median.csv")
    assert sorted(set(med.vpcs)) == [64, 1024] and set(med.repeats) == {3}
    row = med[(med.vpcs == 64) & (med.policy == "rpc")].iloc[0]
    assert row.delay_p95_ms == pytest.approx(3000 * 64 / 512 + 1)   # the middle repetition
    assert row.delay_p95_ms_min == pytest.approx(3000 * 64 / 512)
    assert row.delay_p95_ms_max == pytest.approx(3000 * 64 / 512 + 2)
    assert len(pd.read_csv(out / "summary.csv")) == 3 * 4 + 3 * 4 + 4
    assert len(pd.read_csv(out / "fig10.csv")) == 4 * 3
    head = json.loads((out / "headline.json").read_text())
    assert "fig9 vpcs=64: p95 delay speedup of the best dual-channel policy (idcs) over" in head
    assert "fig9 vpcs=1024: p95 delay speedup of learned over" in head
    assert "fig10 (all phases): p95 delay speedup of learned over" in head
    assert "fig10 (all phases): p95 delay speedup of the best dual-channel policy (idcs) " \
        "over" in head
    assert "fig10 (all phases): ranking by measured p95 delay vs by the simulator's " \
        "utilisation" in head
    f10 = pd.read_csv(out / "fig10_median.csv")
    assert sorted(f10.policy) == sorted(POLICIES) and set(f10.repeats) == {1}
    assert {p.name for p in res["plots"]} == {"fig9_testbed.png", "fig10_testbed.png"}
    assert json.loads((out / "merged_from.json").read_text()) == [str(a), str(b)]
    assert before == {p: p.read_bytes() for p in before}       # the sources only read


def test_merge_adds_repetitions_to_a_kept_fig9_result(tmp_path: Path) -> None:
    """A kept result (only ``fig9.csv``) plus added repetitions numbered from 1
    (``first_repeat=1``) gives three repetitions per point."""
    kept = _output(tmp_path, "kept", [512], repeats=1)
    (kept / "summary.csv").rename(kept / "fig9.csv")
    more = _output(tmp_path, "more", [512], repeats=2)
    s = pd.read_csv(more / "summary.csv")
    s["repeat"] += 1
    s.to_csv(more / "summary.csv", index=False)
    merge_outputs([kept, more], tmp_path / "merged", "godaddy")
    med = pd.read_csv(tmp_path / "merged" / "fig9_median.csv")
    assert set(med.repeats) == {3} and len(med) == len(POLICIES)


def test_merge_orders_rows_as_one_run_would(tmp_path: Path) -> None:
    """A point run after the others (128 VPCs added to 64 and 1,024), and repetitions added
    to a point, land where one invocation would have written them: Fig. 9 before Fig. 10,
    points ascending, repetitions ascending, policies in their order."""
    first = _output(tmp_path, "first", [64, 1024], repeats=1, fig10=True)
    late = _output(tmp_path, "late", [128], repeats=2)
    more = _output(tmp_path, "more", [64], repeats=1)
    s = pd.read_csv(more / "summary.csv")
    s["repeat"] += 1
    s.to_csv(more / "summary.csv", index=False)
    merge_outputs([first, late, more], tmp_path / "merged", "godaddy")
    summary = pd.read_csv(tmp_path / "merged" / "summary.csv")
    order = list(zip(summary.figure, summary.vpcs, summary.repeat, summary.policy))
    pols = list(POLICIES)
    assert order == ([("fig9", 64, r, p) for r in (0, 1) for p in pols]
                     + [("fig9", 128, r, p) for r in (0, 1) for p in pols]
                     + [("fig9", 1024, 0, p) for p in pols]
                     + [("fig10", 512, 0, p) for p in pols])
    med = pd.read_csv(tmp_path / "merged" / "fig9_median.csv")
    assert list(dict.fromkeys(med.vpcs)) == [64, 128, 1024]


def test_merge_outputs_refuses_overlaps_and_incomplete_outputs(tmp_path: Path) -> None:
    a = _output(tmp_path, "a", [64], repeats=1)
    b = _output(tmp_path, "b", [64, 128], repeats=1)
    with pytest.raises(ValueError, match=r"fig9/vpcs=64 rpc repetition 0 is in both .*a and .*b"):
        merge_outputs([a, b], tmp_path / "merged", "godaddy")
    c = _output(tmp_path, "c", [64], repeats=1)           # the same point, another trace
    s = pd.read_csv(c / "summary.csv")
    s["repeat"], s["messages"] = 1, 999
    s.to_csv(c / "summary.csv", index=False)
    with pytest.raises(ValueError, match=r"fig9/vpcs=64 replays 640 messages in .*a but 999 "
                                         r"in .*c"):
        merge_outputs([a, c], tmp_path / "merged", "godaddy")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty has no summary\.csv or fig9\.csv"):
        merge_outputs([a, tmp_path / "empty"], tmp_path / "merged", "godaddy")
    with pytest.raises(ValueError, match="no testbed outputs"):
        merge_outputs([], tmp_path / "merged", "godaddy")
    assert not (tmp_path / "merged").exists()          # nothing written on a refusal


def test_network_spec_scales_capacities_and_checks_the_allowance() -> None:
    """C_b and s(n) scaled like the traffic; the control-traffic allowance is measured while
    the link settles, so it is refused without settling, before any network is built."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="testbed", overrides=["time_scale=1.0"])
        bad = compose(config_name="testbed", overrides=["network.control_allowance=true"])
    ps = problems_for("godaddy")
    spec = network_spec(cfg, ps)
    assert spec.controller_bps == pytest.approx(ps.spec.controller_bw_bps * 0.01)
    assert spec.node_bps == pytest.approx(ps.spec.node_bandwidth_bps * 0.01)
    with pytest.raises(ConfigError, match=r"control_allowance needs network\.settle_s"):
        network_spec(bad, ps)


def test_broker_jars_fetched_before_the_network_is_built(tmp_path: Path, monkeypatch) -> None:
    """Nothing inside the emulated network reaches Maven Central, so a testbed that starts
    its own broker fetches the jars first; one given ``broker.url`` fetches nothing."""
    import delivery.netem
    import harness.broker
    from delivery.experiment import _run_in_network

    calls: list[str] = []

    class Stop(Exception):
        pass

    class NoNetwork:
        def __init__(self, spec) -> None:
            calls.append("network")
            raise Stop

    monkeypatch.setattr(harness.broker, "fetch_pulsar", lambda *a, **k: calls.append("fetch"))
    monkeypatch.setattr(delivery.netem, "EmulatedNetwork", NoNetwork)
    over = ["security.insecure=true", f"out_dir={tmp_path}"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        own = compose(config_name="testbed", overrides=over)
        given = compose(config_name="testbed",
                        overrides=[*over, "broker.url=pulsar+ssl://10.0.0.9:6651"])
    with pytest.raises(Stop):
        _run_in_network(own)
    assert calls == ["fetch", "network"]
    calls.clear()
    with pytest.raises(Stop):
        _run_in_network(given)
    assert calls == ["network"]


class _Unconfirmed:
    """A controller whose nodes confirm their last delivery only once it collects twice."""

    def __init__(self) -> None:
        self.collects = 0

    def pending(self) -> dict[int, int]:
        return {}

    def unconfirmed(self) -> int:
        return 0 if self.collects >= 2 else 1

    def collect(self) -> int:
        self.collects += 1
        return 1


def test_drain_waits_for_every_delivery_to_be_confirmed(tmp_path: Path, monkeypatch) -> None:
    """Records that stopped growing are not drained while a node has not confirmed a
    delivery (a message queued behind redundant MQ traffic on its link): the drain collects
    replies until the controller holds no unconfirmed delivery."""
    from delivery import testbed

    monkeypatch.setattr(testbed, "DRAIN_QUIET_S", 0.3)
    monkeypatch.setattr(testbed, "DRAIN_COLLECT_S", 0.2)
    (tmp_path / "node-0.record").write_bytes(b"x")
    ctl = _Unconfirmed()
    testbed._drain(tmp_path, 10.0, ctl)  # type: ignore[arg-type]
    assert ctl.unconfirmed() == 0 and ctl.collects >= 2
