"""The delay model (envs/dsmd/delay.py): loads, Kingman / Sakasegawa waits, the fluid backlog,
the mixture's quantiles, the constants file, the online cost's delay term and the fit."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import numpy as np
import pytest

from envs.dsmd.cost import CostState
from envs.dsmd.delay import (
    DelayLoad,
    DelayModel,
    DelaySample,
    ResourceQueue,
    _cdf,
    _cdf_integral,
    _mixture_quantile,
    fit_delay_model,
    load_delay_model,
    measured_hold,
    predict_sample,
    switching_seconds,
)
from envs.dsmd.errors import DSMDError
from envs.dsmd.instance import DSMDInstance
from envs.dsmd.online import OnlineCost


def _inst(cb: int = 10_000_000, cap: int = 1_000_000, scale: int = 1) -> DSMDInstance:
    # three types on 4 nodes: type 0 to nodes {0, 1}, type 1 to {1, 2, 3}, type 2 to {3}
    return DSMDInstance.from_sets([[0, 1], [1, 2, 3], [3]], [200_000, 100_000, 50_000], cap,
                                  2, cb, 64, num_nodes=4,
                                  messages=scale * np.array([10, 20, 5]), interval_s=10.0)


def test_load_counts_deliveries_per_node_and_channel() -> None:
    inst = _inst()
    st = CostState(inst, np.array([0, 1, 1]))  # type 0 over RPC, types 1 and 2 on topic 1
    ld = DelayLoad.from_state(st)
    assert ld.node_rpc_messages.tolist() == [10, 10, 0, 0]
    assert ld.node_mq_messages.tolist() == [0, 20, 20, 25]
    assert ld.controller_load_bps == 2 * 200_000 + 100_000 + 50_000
    assert ld.send_rate == pytest.approx((2 * 10 + 20 + 5) / 10.0)
    assert ld.mean_message_bits == pytest.approx(350_000 * 10.0 / 35)
    # batches on the controller's link: type 0's messages leave as 2 copies, the others as 1
    assert ld.batch_dispersion == pytest.approx((10 * 4 + 20 + 5) / (10 * 2 + 20 + 5))
    back = DelayLoad.from_dict(json.loads(json.dumps(ld.to_dict())))
    assert back.to_dict() == ld.to_dict()


def test_unloaded_interval_costs_the_base_delay_only() -> None:
    m = DelayModel(base_s=0.03)
    ld = DelayLoad.from_state(CostState(_inst(cb=10**12, cap=10**12), np.array([0, 1, 1])))
    q = m.quantiles(ld)
    assert q["delay_p50_s"] == pytest.approx(0.03, abs=1e-6)
    assert q["delay_p95_s"] == pytest.approx(0.03, abs=1e-4)


def test_delay_grows_with_utilisation_and_overload_is_a_fluid_backlog() -> None:
    m = DelayModel(base_s=0.0, controller_bw=ResourceQueue(kappa=5.0))
    ld = DelayLoad.from_state(CostState(_inst(scale=100), np.array([1, 1, 1])))
    p95 = [m.quantiles(ld.with_capacities(controller_bw_bps=ld.controller_load_bps / r))
           ["delay_p95_s"] for r in (0.2, 0.5, 0.8, 0.9, 1.5, 2.0)]
    assert all(a < b for a, b in itertools.pairwise(p95))
    # at rho = 2 the backlog grows by T = 10 s over the interval: waits ~ uniform on [0, 10]
    assert p95[-1] == pytest.approx(0.95 * 10.0, rel=0.06)


def test_rpc_batches_queue_longer_than_publishes_at_the_same_utilisation() -> None:
    m = DelayModel(base_s=0.0, controller_bw=ResourceQueue(kappa=2.0))
    inst = _inst(scale=100)
    rpc = DelayLoad.from_state(CostState(inst, np.array([0, 0, 0])))
    mq = DelayLoad.from_state(CostState(inst, np.array([1, 1, 1])))
    assert rpc.batch_dispersion > 1.0 == mq.batch_dispersion
    rpc = rpc.with_capacities(controller_bw_bps=rpc.controller_load_bps / 0.7)
    mq = mq.with_capacities(controller_bw_bps=mq.controller_load_bps / 0.7)
    assert m.terms(rpc)["bw"][0][0] == pytest.approx(m.terms(mq)["bw"][0][0])
    assert m.terms(rpc)["bw"][2][0] > m.terms(mq)["bw"][2][0]


def test_kingman_mean_wait_below_saturation() -> None:
    m = DelayModel(base_s=0.0, controller_bw=ResourceQueue(kappa=3.0))
    ld = DelayLoad.from_state(CostState(_inst(), np.array([1, 1, 1])))  # MQ: batches of 1
    ld = ld.with_capacities(controller_bw_bps=ld.controller_load_bps / 0.6)
    rho, wait_p, mean, span = m.terms(ld)["bw"]
    es = ld.mean_message_bits / ld.controller_bw_bps
    assert rho[0] == pytest.approx(0.6)
    assert wait_p[0] == pytest.approx(0.6)
    assert mean[0] == pytest.approx(3.0 * 0.6 / 0.4 * es)
    assert span[0] == 0.0


def test_more_servers_wait_less_at_the_same_utilisation() -> None:
    m = DelayModel()
    ld = DelayLoad.from_state(CostState(_inst(), np.array([0, 0, 0])))
    one = replace(ld, controller_cpu=1.0, send_rate=0.7 / m.cpu_service_s)
    many = replace(ld, controller_cpu=64.0, send_rate=64 * 0.7 / m.cpu_service_s)
    w1, w64 = m.terms(one)["cpu"][2][0], m.terms(many)["cpu"][2][0]
    assert m.terms(one)["cpu"][0][0] == pytest.approx(0.7)
    assert m.terms(many)["cpu"][0][0] == pytest.approx(0.7)
    assert 0 < w64 < w1


def test_mixture_quantile_matches_sampling() -> None:
    rng = np.random.default_rng(3)
    w = np.array([0.5, 0.3, 0.2])
    prob = np.array([0.3, 0.9, 1.0])
    mean = np.array([0.01, 0.2, 0.5])
    span = np.array([0.0, 0.0, 4.0])
    n = 400_000
    comp = rng.choice(3, size=n, p=w)
    theta = mean / prob
    x = np.where(rng.random(n) < prob[comp], rng.exponential(theta[comp]), 0.0)
    x += rng.random(n) * span[comp]
    for q in (0.5, 0.9, 0.95):
        assert _mixture_quantile(w, prob, mean, span, q) == pytest.approx(
            np.quantile(x, q), rel=0.02, abs=2e-3)
    # the CDF is a CDF: from P(no wait) to 1, non-decreasing
    ts = np.linspace(0, 10, 200)
    c = np.array([_cdf(t, prob, mean, span) for t in ts])
    assert (np.diff(c, axis=0) >= -1e-12).all() and np.allclose(c[-1], 1.0, atol=1e-6)


def test_sending_path_hold_matches_sampling() -> None:
    """The switches hold the sending path for H seconds at the start of the interval T: a
    message sent at t ~ U(0, T) first waits max(0, H - t), then its resources' wait. The
    quantiles of that sum (closed-form integral of the CDF) against 400,000 samples, for
    holds shorter and longer than the interval, with and without a fluid backlog."""
    rng = np.random.default_rng(5)
    w = np.array([0.5, 0.3, 0.2])
    prob = np.array([0.3, 0.9, 1.0])
    mean = np.array([0.01, 0.2, 0.5])
    n, t_int = 400_000, 30.0
    for span, hold in ((np.array([0.0, 0.0, 0.0]), 3.0), (np.array([0.0, 0.0, 4.0]), 6.0),
                       (np.array([0.0, 0.0, 4.0]), 45.0), (np.array([0.0, 0.0, 0.0]), 0.5)):
        comp = rng.choice(3, size=n, p=w)
        theta = mean / prob
        x = np.where(rng.random(n) < prob[comp], rng.exponential(theta[comp]), 0.0)
        x += rng.random(n) * span[comp]
        x += np.maximum(hold - rng.random(n) * t_int, 0.0)
        for q in (0.5, 0.9, 0.95):
            got = _mixture_quantile(w, prob, mean, span, q, hold=hold, interval_s=t_int)
            assert got == pytest.approx(np.quantile(x, q), rel=0.02, abs=5e-3), (hold, q)
    # G is the integral of the CDF (trapezoid on a fine grid), with and without fluid
    span = np.array([0.0, 0.0, 4.0])
    ys = np.linspace(0.0, 9.0, 9001)
    c = np.array([_cdf(y, prob, mean, span) for y in ys])
    num = np.concatenate([np.zeros((1, 3)), np.cumsum(0.5 * (c[1:] + c[:-1]) * np.diff(ys)[:, None],
                                                      axis=0)])
    for i in (1000, 4000, 9000):
        assert _cdf_integral(ys[i], prob, mean, span) == pytest.approx(num[i], abs=1e-5)


def test_switches_hold_the_share_of_deliveries_they_hold() -> None:
    """An interval's switches hold its moved types' deliveries (``held_share``) for the
    measured seconds per subscribing and unsubscribing SubscribeInfo and per moved type (the
    committed constants are the switching costs' split fit): with every delivery held the
    p95 is the hold's, with 2% held the p95 is almost the unheld one; a load recorded with
    one count for both directions reads as half each, which is the measured mean."""
    m = load_delay_model()
    assert {k: getattr(m, k) for k in measured_hold()} == measured_hold()
    sw = switching_seconds()
    assert m.hold_s_per_subscribe == sw["seconds_per_subscribe"] > 0
    assert m.hold_s_per_unsubscribe == sw["seconds_per_unsubscribe"] > 0
    assert (m.hold_s_per_subscribe + m.hold_s_per_unsubscribe) / 2 == pytest.approx(
        sw["seconds_per_subscribe_info"], rel=1e-6)
    ld = DelayLoad.from_state(CostState(_inst(cb=10**10, cap=10**10), np.array([0, 1, 1])))
    quiet = m.quantiles(ld)  # unloaded links: the base delay
    assert quiet["delay_p95_s"] < 0.1
    assert quiet["hold_s"] == 0.0
    held = m.quantiles(ld.with_switches(600, 10, 200))
    h = 600 * m.hold_s_per_subscribe + 200 * m.hold_s_per_unsubscribe \
        + 10 * m.hold_s_per_moved_type
    assert held["hold_s"] == pytest.approx(h)
    # 2.8 s of a 10 s interval: the 95th percentile message waited about H - 0.05 T
    assert held["delay_p95_s"] == pytest.approx(quiet["delay_p95_s"] + h - 0.5, abs=0.2)
    assert held["delay_p50_s"] == pytest.approx(quiet["delay_p50_s"], abs=0.01)
    few = m.quantiles(ld.with_switches(600, 10, 200, held_share=0.02))
    assert few["hold_s"] == pytest.approx(h)
    assert few["delay_p95_s"] == pytest.approx(quiet["delay_p95_s"], abs=0.01)
    with pytest.raises(DSMDError, match="held_share"):
        ld.with_switches(1, 1, held_share=1.5)
    back = DelayLoad.from_dict(ld.with_switches(3, 1, 2, 0.25).to_dict())
    assert (back.subscribe_infos, back.moved_types, back.unsubscribe_infos,
            back.held_share) == (3.0, 1.0, 2.0, 0.25)
    both = {k: v for k, v in ld.with_switches(1000, 10).to_dict().items()
            if k not in ("unsubscribe_infos", "held_share")}
    old = DelayLoad.from_dict(both)  # one count for both ways, every message held
    assert (old.subscribe_infos, old.unsubscribe_infos, old.held_share) == (500, 500, 1.0)
    assert m.hold_s(old) == pytest.approx(1000 * sw["seconds_per_subscribe_info"]
                                          + 10 * m.hold_s_per_moved_type, rel=1e-6)
    none = {k: v for k, v in ld.to_dict().items() if k not in (
        "subscribe_infos", "moved_types", "unsubscribe_infos", "held_share")}
    assert DelayLoad.from_dict(none).subscribe_infos == 0.0  # recorded before: no switches


def test_held_share_matches_sampling() -> None:
    """A share of the deliveries held (the rest not) against 400,000 samples."""
    rng = np.random.default_rng(6)
    w = np.array([0.6, 0.4])
    prob = np.array([0.5, 1.0])
    mean = np.array([0.02, 0.3])
    span = np.zeros(2)
    n, t_int, hold, share = 400_000, 30.0, 6.0, 0.3
    comp = rng.choice(2, size=n, p=w)
    x = np.where(rng.random(n) < prob[comp], rng.exponential((mean / prob)[comp]), 0.0)
    x += np.where(rng.random(n) < share, np.maximum(hold - rng.random(n) * t_int, 0.0), 0.0)
    for q in (0.5, 0.9, 0.95):
        got = _mixture_quantile(w, prob, mean, span, q, hold=hold, interval_s=t_int,
                                held_share=share)
        assert got == pytest.approx(np.quantile(x, q), rel=0.02, abs=5e-3), q


def test_constants_file_errors_name_the_file_and_the_field(tmp_path) -> None:
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"model": {"base_s": -1}}))
    with pytest.raises(DSMDError, match=r"m\.json.*base_s"):
        load_delay_model(f)
    f.write_text(json.dumps({"model": {"kappa": 1}}))
    with pytest.raises(DSMDError, match=r"unknown keys \['kappa'\]"):
        load_delay_model(f)
    f.write_text(json.dumps({"model": {"node": {"kappa": 0}}}))
    with pytest.raises(DSMDError, match="kappa"):
        load_delay_model(f)
    f.write_text("{")
    with pytest.raises(DSMDError, match=r"m\.json"):
        load_delay_model(f)
    with pytest.raises(DSMDError, match=r"missing\.json"):
        load_delay_model(tmp_path / "missing.json")
    assert isinstance(load_delay_model(), DelayModel)  # the committed calibration loads


def test_online_cost_reads_its_delay_model_and_round_trips(tmp_path) -> None:
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"model": {"base_s": 0.5}}))
    c = OnlineCost.from_dict({"w_delay": 2.0, "delay_model": str(f)})
    assert c.delay.base_s == 0.5 and c.w_delay == 2.0
    assert OnlineCost.from_dict(c.as_dict()) == c
    with pytest.raises(DSMDError, match="not both"):
        OnlineCost.from_dict({"delay_model": str(f), "delay": {"base_s": 1.0}})
    with pytest.raises(DSMDError, match="w_delay"):
        OnlineCost(w_delay=-1.0)


@pytest.mark.slow
def test_fit_reproduces_the_delays_it_was_given() -> None:
    truth = DelayModel(base_s=0.05, controller_bw=ResourceQueue(kappa=8.0, scale=1.5,
                                                                wait_exponent=0.6),
                       node=ResourceQueue(kappa=4.0, wait_exponent=0.8),
                       node_control_bps=20_000.0)
    base = DelayLoad.from_state(CostState(_inst(), np.array([0, 1, 1])))
    samples = []
    for i, r in enumerate((0.2, 0.5, 0.7, 0.85, 0.95, 1.2)):
        ld = base.with_capacities(controller_bw_bps=base.controller_load_bps / r)
        p = truth.quantiles(ld)
        samples.append(DelaySample(f"bw{i}", "bw", (ld,), p["delay_p50_s"], p["delay_p95_s"],
                                   0.0, 1.0, r))
    for i, r in enumerate((0.3, 0.6, 0.8, 0.95, 1.3)):
        ld = base.with_capacities(node_capacity_bps=base.node_load_bps.max() / r)
        p = truth.quantiles(ld)
        samples.append(DelaySample(f"n{i}", "node", (ld,), p["delay_p50_s"],
                                   p["delay_p95_s"], 0.0, 1.0, r))
    start = [predict_sample(DelayModel(), s)["delay_p95_s"] / s.measured_p95_s
             for s in samples]
    assert max(abs(np.log(start))) > 1.0  # the defaults are far off: the fit has work to do
    _, report = fit_delay_model(samples)
    assert report["within_2x_p95"] == len(samples)
    assert report["rms_log_p95"] < 0.2 and report["rms_log_p50"] < 0.3
    assert report["spearman_p95"] > 0.95
