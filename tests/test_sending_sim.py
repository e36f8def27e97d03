"""The controller's sending path in simulation (``delivery/sending_sim.py``): hand-computed
cases of the queueing model, the real tenant shaper on its clock, determinism, refusals, the
committed constants against the committed measurements, and the Fig. 6 experiment on it
(``agents/shaping/path_experiment.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from delivery.sending_sim import (
    BURST,
    STREAM,
    PathWorkload,
    SendingCosts,
    percentiles,
    simulate_path,
)
from envs.shaping.sincon import ShapingError

ROOT = Path(__file__).resolve().parent.parent
C = SendingCosts(accept_fixed_s=0.001, accept_per_message_s=0.0001, push_fixed_s=0.005,
                 push_per_message_s=0.00002, contention_s=0.01)


def test_one_message_costs_the_path_once():
    """One streamed message to 4 nodes: accepted (fixed + 1 message), flushed, pushed: node
    batches of 1 in one round of 4 -> applied at push_fixed + 4 * push_per."""
    rec = simulate_path(PathWorkload(streams=(7,), rate_hz=1.0, duration_s=1.0), None, C)
    assert rec.rounds == 1 and rec.pushes == 1 and rec.vpc.size == 4
    want = (0.001 + 0.0001 + 0.005 + 4 * 0.00002) * 1e3
    assert np.allclose(rec.delays_ms(7, STREAM), want)


def test_a_burst_is_applied_in_order_across_one_round():
    """A burst of 100 to 2 nodes, nothing else: accepted in 1 ms + 100 x 0.1 ms, then the
    final flush pushes one round of 2 x 100: message i at push_fixed + 2 (i + 1) push_per."""
    rec = simulate_path(PathWorkload(bursts=((3, 100, 0.25),), nodes=2), None, C)
    assert rec.pushes == 1 and rec.vpc.size == 200 and set(rec.kind) == {BURST}
    d = np.sort(rec.delays_ms(3))
    accept = 0.001 + 100 * 0.0001
    want = np.repeat([(accept + 0.005 + 2 * (i + 1) * 0.00002) * 1e3 for i in range(100)], 2)
    assert np.allclose(d, want)


def test_a_send_while_a_burst_is_accepted_waits_the_contention():
    """A stream round at 0 while a burst's send_many (1,000 messages: 101 ms) is under way
    from 0 as well: the round's send and flush each wait contention_s."""
    rec = simulate_path(PathWorkload(bursts=((1, 1000, 0.0),), streams=(2,), rate_hz=1.0,
                                     duration_s=1.0, nodes=1), None, C)
    first = rec.delays_ms(2, STREAM)
    assert first.size == 1
    assert first[0] == pytest.approx((0.01 + 0.0011 + 0.01 + 0.005 + 0.00002) * 1e3)
    quiet = simulate_path(PathWorkload(streams=(2,), rate_hz=1.0, duration_s=1.0, nodes=1),
                          None, C)
    assert quiet.delays_ms(2, STREAM)[0] == pytest.approx((0.0011 + 0.005 + 0.00002) * 1e3)


def test_nothing_is_lost_and_the_run_is_deterministic():
    wl = PathWorkload(bursts=((1, 700, 0.0), (2, 300, 0.4)), streams=(1, 2, 3),
                      duration_s=2.0)
    shaping = {"enabled": True, "policy": "sincon", "classes": 3,
               "tenant_class": {1: 0, 2: 1, 3: 2}, "global_throughput_Bps": 150_000.0}
    a = simulate_path(wl, shaping, C)
    b = simulate_path(wl, shaping, C)
    assert a.vpc.size == 4 * (700 + 300) + 4 * 3 * a.rounds and a.rounds == 40
    for f in ("vpc", "kind", "ts", "applied"):
        assert np.array_equal(getattr(a, f), getattr(b, f))
    assert np.all(a.applied >= a.ts)


def test_one_fifo_at_g_paces_a_burst_at_g():
    """The shaper is the real TenantShaper: one static class at G releases the burst's bytes
    past the burst allowance (0.5 s at G) at G, so the last of 2,000 x 512 B (1 MB at
    200 kB/s) is applied about (1 MB - 100 kB) / 200 kB/s = 4.5 s after it was handed over."""
    g = 200_000.0
    rec = simulate_path(PathWorkload(bursts=((1, 2000, 0.0),)),
                        {"enabled": True, "policy": "static", "classes": 1,
                         "global_throughput_Bps": g}, C)
    accept = 0.001 + 2000 * 0.0001
    assert rec.end_s - accept == pytest.approx((2000 * 512 - 0.5 * g) / g, rel=0.02)
    unshaped = simulate_path(PathWorkload(bursts=((1, 2000, 0.0),)), None, C)
    assert unshaped.end_s < 0.5


def test_sincon_releases_a_quiet_tenant_inline_past_a_burst():
    """A class per tenant: the streaming tenant's messages leave at once while the bursting
    one's class is paced; with one FIFO they wait behind the burst."""
    wl = PathWorkload(bursts=((1, 2000, 0.0),), streams=(2,), duration_s=3.0)
    g = 200_000.0
    on = simulate_path(wl, {"enabled": True, "policy": "sincon", "classes": 2,
                            "tenant_class": {1: 0, 2: 1}, "global_throughput_Bps": g}, C)
    off = simulate_path(wl, {"enabled": True, "policy": "static", "classes": 1,
                             "global_throughput_Bps": g}, C)
    assert percentiles(list(on.delays_ms(2, STREAM)))["p95"] < 100
    assert percentiles(list(off.delays_ms(2, STREAM)))["p50"] > 1000


@pytest.mark.parametrize(("kw", "names"), [
    ({"size": 0}, ["size", "0"]),
    ({"nodes": 1.5}, ["nodes", "1.5"]),
    ({"rate_hz": -1}, ["rate_hz", "-1"]),
    ({"duration_s": float("inf")}, ["duration_s", "inf"]),
    ({"bursts": ((1, -3, 0.0),)}, ["bursts[0]", "-3"]),
    ({"bursts": ((1, 3),)}, ["bursts[0]", "(1, 3)"]),
])
def test_workload_refusals_name_the_field(kw, names):
    with pytest.raises(ShapingError) as e:
        PathWorkload(**kw)
    for n in names:
        assert n in str(e.value)


def test_costs_refusals_name_the_file_and_key(tmp_path):
    with pytest.raises(ShapingError, match=r"push_fixed_s.*-1"):
        SendingCosts(0.0, 0.0, -1.0, 0.0)
    p = tmp_path / "costs.json"
    p.write_text("{not json")
    with pytest.raises(ShapingError, match=r"cannot read .*costs\.json"):
        SendingCosts.load(p)
    p.write_text(json.dumps({"costs": {"accept_fixed_s": 0.001}}))
    with pytest.raises(ShapingError, match=r"missing key\(s\) \['accept_per_message_s'"):
        SendingCosts.load(p)
    p.write_text(json.dumps({"costs": {**C.to_dict(), "bogus_s": 1}}))
    with pytest.raises(ShapingError, match=r"unknown key\(s\) \['bogus_s'\]"):
        SendingCosts.load(p)
    p.write_text(json.dumps({"costs": {**C.to_dict(), "contention_s": "x"}}))
    with pytest.raises(ShapingError, match=r"contention_s.*'x'.*costs\.json"):
        SendingCosts.load(p)
    with pytest.raises(ShapingError, match=r"shaping\.policy"):
        simulate_path(PathWorkload(streams=(1,)), {"enabled": True, "policy": "x",
                                                   "global_throughput_Bps": 1.0}, C)


def test_committed_constants_still_agree_with_the_committed_map():
    """The documented validation: with ``delivery/sending_costs.json``, the shaped cells of
    the committed real fairness map agree with the simulator (every one of a cell's four
    percentiles within 2x) in at least 18 of 24, and the Sincon / unshaped verdict on the
    small tenants' p95 is on the same side of 1 in at least 11 of 12."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    from bench_fairness_fidelity import MEASURED, STATS, load_cells, simulate_cell

    costs = SendingCosts.load()
    cells = load_cells(MEASURED)
    sims = [simulate_cell(c, costs) for c in cells]
    agree = [all(0.5 <= s[k] / c["measured"][k] <= 2.0 for k in STATS)
             for c, s in zip(cells, sims)]
    val = [a for a, c in zip(agree, cells) if c["arm"] != "unshaped"]
    assert len(val) == 24 and sum(val) >= 18

    def p95(cs, arm, b, k, src):
        for c, s in cs:
            if (c["arm"], c["burst"], c["smalls"]) == (arm, b, k) and (
                    arm == "unshaped" or c["cap_Bps"] == g):
                return (c["measured"] if src == "m" else s)["small_p95_ms"]
        raise AssertionError((arm, b, k))

    pairs = list(zip(cells, sims))
    same = 0
    for c in cells:
        if c["arm"] != "on":
            continue
        g = c["cap_Bps"]
        m = p95(pairs, "on", c["burst"], c["smalls"], "m") / p95(pairs, "unshaped", c["burst"],
                                                                 c["smalls"], "m")
        s = p95(pairs, "on", c["burst"], c["smalls"], "s") / p95(pairs, "unshaped", c["burst"],
                                                                 c["smalls"], "s")
        same += (m < 1) == (s < 1)
    assert same >= 11


def test_path_experiment_small_run(tmp_path):
    """``python shaping.py model=controller`` end to end on a small grid: tables, plots,
    headline, paired ratios."""
    import pandas as pd
    from hydra import compose, initialize_config_dir

    from agents.shaping.experiment import run_shaping

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("shaping", overrides=[
            "model=controller", "tenants=[1,2]", "seeds=2", "path.duration_s=1.5",
            "path.burst_messages=800", "path.workloads=[split]",
            f"paths.output_dir={tmp_path}", "logger=none"])
    res = run_shaping(cfg)
    out = Path(res["out_dir"])
    runs = pd.read_csv(out / "path_runs.csv")
    assert len(runs) == 2 * 2 * 4 and set(runs.policy) == {"none", "fifo", "static", "sincon"}
    assert (out / "path_fig6_setup_time.png").stat().st_size > 0
    assert (out / "path_fig5_throughput_std.png").stat().st_size > 0
    head = json.loads((out / "path_headline.json").read_text())
    r = head["split"]["setup_fifo_over_sincon"]
    assert r["seeds"] == 2 and r["low"] <= r["ratio"] <= r["high"]
    # the split workload's setups leave Sincon's classes at once; the FIFO's wait
    assert r["ratio"] > 3


def test_unknown_model_and_policy_are_refused(tmp_path):
    from hydra import compose, initialize_config_dir

    from agents.shaping.experiment import run_shaping

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("shaping", overrides=["model=nope", f"paths.output_dir={tmp_path}",
                                            "logger=none"])
        with pytest.raises(ShapingError, match="model='nope'"):
            run_shaping(cfg)
        cfg = compose("shaping", overrides=["model=controller", "path.policies=[none,x]",
                                            f"paths.output_dir={tmp_path}", "logger=none"])
        with pytest.raises(ShapingError, match=r"path\.policies: unknown policy 'x'"):
            run_shaping(cfg)
