"""Sincon's adaptive limit calculator (Section III-A), the delay-based channel shaper
(Section III-B) and the control-channel simulator (envs/shaping)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from envs.shaping.simulator import ShapingSimulator, SimConfig, simulate
from envs.shaping.sincon import (
    AdaptiveLimitCalculator,
    ChannelShaper,
    ShaperConfig,
    ShapingError,
    SinconConfig,
    make_policy,
)

G = 1400.0  # the paper's example: 1,400 Mbps, 7 channels -> 100 each


def _calc(n: int = 7, **kw) -> AdaptiveLimitCalculator:
    return AdaptiveLimitCalculator(SinconConfig(global_throughput=G, **kw), n)


def test_initial_split_is_the_papers_example():
    c = _calc()
    assert c.global_initial == pytest.approx(700.0) and c.pool == pytest.approx(700.0)
    np.testing.assert_allclose(c.limits, 100.0)


def test_usage_is_checked_every_fifth_message_and_grows_at_alpha():
    c = _calc(gamma=0.25)
    for _ in range(4):  # below the check interval: nothing happens even at full usage
        assert not c.observe(0, 100.0).checked
    r = c.observe(0, 95.0)  # 5th message, usage exactly alpha * limit
    assert r.checked and r.grew and not r.reset
    assert c.limits[0] == pytest.approx(125.0) and c.pool == pytest.approx(675.0)
    for _ in range(5):
        c.observe(0, 0.94 * 125.0)  # just under alpha: no growth
    assert c.limits[0] == pytest.approx(125.0) and c.growths == 1
    np.testing.assert_allclose(c.limits[1:], 100.0)


def test_reset_when_pool_falls_under_beta():
    c = _calc(gamma=1.0)  # +100 per growth; pool 700; beta * G = 70
    grown = 0
    while c.pool >= c.reset_below:
        for _ in range(5):
            r = c.observe(grown % 7, 1e9)
        assert r.grew
        grown += 1
    assert grown == 7 and c.pool == pytest.approx(0.0) and c.resets == 0
    for _ in range(5):
        r = c.observe(3, 1e9)
    assert r.reset and not r.grew and c.resets == 1
    np.testing.assert_allclose(c.limits, 100.0)
    assert c.pool == pytest.approx(700.0)


def test_growth_never_takes_more_than_the_pool():
    c = _calc(n=2, gamma=0.7, beta=0.0)  # initial 350 each, step 245, pool 700
    for _ in range(3 * 5):
        c.observe(0, 1e9)
    assert c.pool == pytest.approx(0.0) and c.limits[0] == pytest.approx(1050.0)
    for _ in range(5):  # pool 0 < beta * G = 0 is false: growth by 0, still no negative pool
        c.observe(1, 1e9)
    assert c.pool >= 0 and c.limits.sum() == pytest.approx(G)


@given(n=st.integers(1, 12), gamma=st.floats(0.01, 3.0), beta=st.floats(0.0, 0.5),
       share=st.floats(0.05, 1.0),
       events=st.lists(st.tuples(st.integers(0, 11), st.floats(0.0, 2000.0)), max_size=300))
def test_pool_and_limits_stay_consistent(n, gamma, beta, share, events):
    c = _calc(n=n, gamma=gamma, beta=beta, initial_share=share)
    for ch, usage in events:
        c.observe(ch % n, usage)
        assert c.pool >= -1e-9
        assert c.limits.sum() <= G * (1 + 1e-9)
        assert c.limits.sum() + c.pool == pytest.approx(G, rel=1e-9)
        assert np.all(c.limits >= c.initial_limit * (1 - 1e-12))


@pytest.mark.parametrize("bad", [{"alpha": 0.0}, {"alpha": 1.5}, {"beta": -0.1},
                                 {"gamma": 0.0}, {"check_every": 0}, {"initial_share": 0},
                                 {"global_throughput": -1.0}])
def test_bad_constants_are_named(bad):
    kw = {"global_throughput": G, **bad}
    with pytest.raises(ShapingError, match=next(iter(bad))):
        SinconConfig(**kw)


def test_bad_channel_and_policy_names():
    with pytest.raises(ShapingError, match="channel 7 out of range"):
        _calc().observe(7, 1.0)
    with pytest.raises(ShapingError, match="unknown shaping policy 'fast'"):
        make_policy("fast", 3, G)


def _backlogged(limit: float, size: float, seconds: float, cfg: ShaperConfig | None = None
                ) -> tuple[float, list[float]]:
    """A channel that always has a message waiting: process, wait the delay, repeat."""
    sh = ChannelShaper(cfg)
    t, sent = 0.0, []
    while t < seconds:
        delay, _ = sh.process(t, size, limit)
        sent.append(t)
        t += delay
    times = np.asarray(sent)
    half = times >= seconds / 2
    return size * half.sum() / (seconds / 2), sent


@pytest.mark.parametrize("model", ["bucket", "power"])
@pytest.mark.parametrize("limit,size", [(1e5, 200.0), (1e6, 1500.0), (5e3, 100.0)])
def test_shaper_throughput_converges_to_the_limit(limit, size, model):
    tput, _ = _backlogged(limit, size, seconds=20.0, cfg=ShaperConfig(model=model))
    assert tput == pytest.approx(limit, rel=0.05)


def test_bucket_shaper_passes_a_burst_within_the_allowance_then_paces_at_the_limit():
    cfg = ShaperConfig(model="bucket", burst_s=0.5)
    sh = ChannelShaper(cfg)
    limit, size = 1000.0, 100.0                 # allowance: 0.5 s x 1000 B/s = 500 B
    delays = [sh.process(0.0, size, limit)[0] for _ in range(5)]
    assert delays == [0.0] * 5                  # 500 B at once: within the allowance
    assert sh.process(0.0, size, limit)[0] == pytest.approx(0.1)   # 100 B over: 0.1 s
    # after a quiet second the bucket has drained: a channel under its limit waits for nothing
    assert sh.process(1.6, size, limit)[0] == 0.0
    # a channel at 30% of its limit never waits (the paper's "shorter delay at low usage")
    sh3, t = ChannelShaper(cfg), 0.0
    for _ in range(200):
        assert sh3.process(t, 30.0, 100.0)[0] == 0.0
        t += 1.0
    assert ChannelShaper(cfg, bypass_at=100.0).process(0.0, 1e9, 100.0)[0] == 0.0


def test_power_shaper_delay_is_short_at_low_usage_and_long_near_the_limit():
    sh = ChannelShaper(ShaperConfig(model="power", tau_s=1.0))
    low, _ = sh.process(0.0, 30.0, 100.0)       # usage 30 of a limit of 100
    sh2 = ChannelShaper(ShaperConfig(model="power", tau_s=1.0))
    sh2.meter.rate = 65.0
    high, _ = sh2.process(0.0, 30.0, 100.0)     # usage 95
    assert low == pytest.approx(0.3 * 30 / 100) and high == pytest.approx(0.95 * 30 / 100)
    assert ChannelShaper(bypass_at=100.0).process(0.0, 30.0, 100.0)[0] == 0.0


# ---- simulator ---------------------------------------------------------------------------
SMALL = {"tenants": 2, "switches_per_tenant": 5, "edge_switches": 2, "duration_s": 2.0}


@pytest.mark.parametrize("policy", ["none", "static", "sincon"])
def test_simulator_delivers_every_message(policy):
    sim = ShapingSimulator(SimConfig.from_dict(SMALL), policy, seed=3)
    sim.run_until(math.inf)
    r = sim.result()
    for d, L in enumerate(sim.links):
        assert L.delivered.sum() == pytest.approx(L.offered.sum())  # nothing dropped
        assert r.messages[d] == L.processed.sum() > 0
        assert L.max_q <= L.offered.max()  # a queue never holds more than was offered
        assert not L.fifo and all(not q for q in L.queues)
    assert r.setup_times.size > 0 and np.all(r.setup_times > 0)


def test_static_limit_caps_a_saturated_channel():
    cfg = SimConfig.from_dict(tenants=1, switches_per_tenant=4, edge_switches=0,
                              setup_rate_hz=0.0, duration_s=6.0, global_throughput=1e5,
                              read={"burst_rate_hz": 20.0, "burst_messages": 20.0},
                              write={"burst_rate_hz": 0.0})
    r = simulate(cfg, "static", seed=1)
    offered = 20 * 20 * 250.0  # bytes/s per channel, above the limit of 25,000
    assert offered > 1e5 / 4
    tp = r.throughput("read")[:, 20:].mean(axis=1)  # after the first 2 s
    np.testing.assert_allclose(tp, 1e5 / 4, rtol=0.08)


def test_unshaped_link_favours_earlier_starters_and_sincon_evens_it():
    cfg = SimConfig.from_dict(tenants=2, switches_per_tenant=1, edge_switches=0,
                              setup_rate_hz=0.0, duration_s=4.0, tenant_stagger_s=1.0,
                              global_throughput=2e4,
                              read={"burst_rate_hz": 20.0, "burst_messages": 10.0},
                              write={"burst_rate_hz": 0.0})
    none = simulate(cfg, "none", seed=0).throughput("read").mean(axis=1)
    sincon = simulate(cfg, "sincon", seed=0).throughput("read").mean(axis=1)
    assert none[1] < 0.2 * none[0]                     # the first tenant's channel dominates
    # Sincon shares the link (the first channel's head start in the pool lasts until the
    # first reset, so the split is not exactly even)
    assert sincon.min() > 0.6 * sincon.max()


def _mean_summary(cfg: SimConfig, policy: str, seeds=(0, 1, 2)) -> dict[str, float]:
    rows = [simulate(cfg, policy, s).summary() for s in seeds]
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def test_default_regime_unshaped_link_saturates_and_earlier_tenants_dominate():
    """Section II-B with the default workload: adding tenants adds load until the link is
    saturated in bursts; then the unshaped (OpenVirteX, seniority) link serves the tenants
    that started earlier first: the last tenant's messages and setups wait much longer."""
    one = _mean_summary(SimConfig.from_dict(tenants=1), "none")
    four = _mean_summary(SimConfig.from_dict(tenants=4), "none")
    fifo = _mean_summary(SimConfig.from_dict(tenants=4, link_order="fifo"), "none")
    assert one["read_saturated_share"] == 0.0 and four["read_saturated_share"] > 0.05
    assert 0.5 < four["read_offered_load"] < 1.0          # saturated in bursts, not overloaded
    assert four["setup_time_mean_s"] > 2.0 * one["setup_time_mean_s"]   # interference
    for d in ("read", "write"):
        assert four[f"{d}_delay_last_tenant_s"] > 3.0 * four[f"{d}_delay_first_tenant_s"]
        # the same load without seniority: no tenant is favoured
        assert fifo[f"{d}_delay_last_tenant_s"] < 1.5 * fifo[f"{d}_delay_first_tenant_s"]
    assert four["setup_time_last_tenant_s"] > 3.0 * four["setup_time_first_tenant_s"]
    # everything offered is delivered eventually: std of throughput *means* about unchanged
    assert fifo["read_mean_tput_std_Bps"] == pytest.approx(four["read_mean_tput_std_Bps"],
                                                           rel=0.02)


def test_same_seed_same_result_other_seed_other_result():
    cfg = SimConfig.from_dict(SMALL)
    a, b = simulate(cfg, "sincon", 5), simulate(cfg, "sincon", 5)
    c = simulate(cfg, "sincon", 6)
    for d in range(2):
        np.testing.assert_array_equal(a.delivered[d], b.delivered[d])
    np.testing.assert_array_equal(a.setup_times, b.setup_times)
    assert not np.array_equal(a.delivered[0], c.delivered[0])


def test_bad_simulator_config_is_named():
    with pytest.raises(ShapingError, match="unknown keys \\['tenant'\\]"):
        SimConfig.from_dict(tenant=3)
    with pytest.raises(ShapingError, match="edge_switches"):
        SimConfig.from_dict(switches_per_tenant=3, edge_switches=4)
    with pytest.raises(ShapingError, match=r"SimConfig\.sincon"):
        SimConfig.from_dict(sincon={"delta": 1.0})
    with pytest.raises(ShapingError, match=r"SimConfig\.read: unknown keys"):
        SimConfig.from_dict(read={"rate": 1.0})
    with pytest.raises(ShapingError, match="model must be one of"):
        SimConfig.from_dict(shaper={"model": "leaky"})


def test_sincon_adds_no_delay_to_channels_well_under_their_limits():
    """One tenant of the default workload uses ~19% of G and every channel stays well under
    its initial limit G / (2N) over the burst allowance: Sincon must then be invisible (the
    paper: a short delay at low usage). The earlier reading (``power``) is not."""
    cfg = SimConfig.from_dict(tenants=1)
    none, sincon = simulate(cfg, "none", 4), simulate(cfg, "sincon", 4)
    np.testing.assert_allclose(sincon.setup_times, none.setup_times)
    power = simulate(SimConfig.from_dict(tenants=1, shaper={"model": "power"}), "sincon", 4)
    assert np.nanmean(power.setup_times) > 2 * np.nanmean(none.setup_times)
