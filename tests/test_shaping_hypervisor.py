"""The hypervisor-processing model of the control-channel simulator (``server="hypervisor"``,
envs/shaping/hypervisor.py): I/O threads that process a channel's whole buffered batch per
visit, with Sincon's channel shaper in front of the processing (Section III-B, Fig. 3)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from envs.shaping.hypervisor import HypervisorConfig, IOThreadPool
from envs.shaping.simulator import ShapingSimulator, SimConfig, simulate
from envs.shaping.sincon import ShapingError

SMALL = {"tenants": 2, "switches_per_tenant": 5, "edge_switches": 2, "duration_s": 2.0,
         "server": "hypervisor"}
QUIET = {"setup_rate_hz": 0.0, "read": {"burst_rate_hz": 0.0}, "write": {"burst_rate_hz": 0.0}}


def _run(cfg: SimConfig, policy: str, seed: int = 0, offers=()) -> ShapingSimulator:
    sim = ShapingSimulator(cfg, policy, seed)
    for t, d, ch, size in offers:
        sim.offer(t, d, ch, size)
    sim.run_until(math.inf)
    return sim


@pytest.mark.parametrize("policy", ["none", "static", "sincon"])
def test_every_message_is_processed_once_and_in_order_per_channel(policy):
    sim = _run(SimConfig.from_dict(SMALL), policy, seed=3)
    r = sim.result()
    for d, L in enumerate(sim.links):
        assert L.delivered.sum() == pytest.approx(L.offered.sum())      # nothing dropped
        assert r.messages[d] == L.processed.sum() == L.pool.batch_messages.sum() > 0
        assert L.out_of_order == 0                                       # FIFO per channel
        assert L.pool.idle() and all(not q for q in L.queues) and not L.fifo
        assert L.link_busy_s == 0.0                                      # the link is unused
    assert r.setup_times.size > 0 and np.all(r.setup_times > 0)
    assert not np.isnan(r.setup_times).any()


def test_processing_cost_sets_the_capacity_of_each_thread():
    """A saturated channel gets one thread's capacity, size / (message_s + byte_s * size);
    two saturated channels on two threads get twice as much, on one thread the same."""
    hv = {"message_s": 1e-3, "byte_s": 1e-5}            # 200 B: 3 ms -> 66.7 kB/s
    offers = [(0.0, "read", ch, 200) for ch in (0, 1) for _ in range(2000)]
    base = dict(tenants=2, switches_per_tenant=1, edge_switches=0, duration_s=1.0,
                server="hypervisor", **QUIET)
    for threads, expected in ((1, 200 / 3e-3), (2, 2 * 200 / 3e-3)):
        cfg = SimConfig.from_dict(base, hypervisor={**hv, "io_threads": threads})
        r = _run(cfg, "none", offers=offers).result()
        tot = r.delivered[0].sum(axis=0)[:10] / cfg.period_s     # the first second
        np.testing.assert_allclose(tot, expected, rtol=0.04)   # 33-34 messages a bin


def test_an_earlier_channel_with_a_backlog_holds_the_thread_unless_shaped():
    """Section II-B's "earlier channels dominate" as the event loop produces it: channel 0
    has 100 messages buffered when channel 1's single message arrives; without shaping the
    thread processes channel 0's whole batch first (the newcomer waits ~99 ms); one message
    per visit, or a shaper that releases channel 0's messages at its limit, lets it through
    within a message time."""
    cfg = SimConfig.from_dict(tenants=2, switches_per_tenant=1, edge_switches=0,
                              duration_s=1.0, global_throughput=2e4, server="hypervisor",
                              hypervisor={"io_threads": 1, "message_s": 0.0, "byte_s": 1e-5},
                              shaper={"burst_s": 0.01}, **QUIET)
    offers = [(0.0, "read", 0, 100)] * 100 + [(0.0015, "read", 1, 100)]
    none = _run(cfg, "none", offers=offers).result()
    assert none.channel_delay_mean[0][1] > 0.09 and none.batch_mean[0] > 30
    one = SimConfig.from_dict(cfg.to_dict(), hypervisor={**cfg.to_dict()["hypervisor"],
                                                         "max_batch": 1})
    for c, pol in ((one, "none"), (cfg, "static"), (cfg, "sincon")):
        r = _run(c, pol, offers=offers).result()
        assert r.channel_delay_mean[0][1] < 0.002 and r.batch_mean[0] == 1.0


def test_shaping_keeps_the_batches_small_in_the_default_regime():
    """4 tenants of the default workload: without shaping a visit processes several
    messages (backlogs build in bursts); Sincon's and the static split's limits bound what a
    channel hands over, so the batches are smaller; the cap bounds them."""
    cfg = SimConfig.from_dict(tenants=4, server="hypervisor")
    b = {p: simulate(cfg, p, 1).batch_mean for p in ("none", "static", "sincon")}
    for d in range(2):
        assert b["none"][d] > 3.0
        assert b["sincon"][d] < 0.75 * b["none"][d] and b["static"][d] < 0.75 * b["none"][d]
    capped = SimConfig.from_dict(cfg.to_dict(), hypervisor={"max_batch": 2})
    assert max(simulate(capped, "none", 1).batch_mean) <= 2.0


def test_hypervisor_same_seed_same_result_other_seed_other_result():
    cfg = SimConfig.from_dict(SMALL)
    a, b, c = (simulate(cfg, "sincon", s) for s in (5, 5, 6))
    for d in range(2):
        np.testing.assert_array_equal(a.delivered[d], b.delivered[d])
    np.testing.assert_array_equal(a.setup_times, b.setup_times)
    assert a.batch_mean == b.batch_mean
    assert not np.array_equal(a.delivered[0], c.delivered[0])


def test_threads_are_bound_round_robin_in_connection_order():
    pool = IOThreadPool(HypervisorConfig(io_threads=2), [3, 0, 2, 1], 4)
    assert pool.members == [[3, 2], [0, 1]]
    for ch, msg in ((2, (1, 0.0, -1)), (3, (1, 0.0, -1)), (3, (1, 0.0, -1))):
        pool.hand(ch, msg)
    assert pool.take(0) == (3, [(1, 0.0, -1)] * 2)    # first in order, whole batch
    assert pool.take(0) == (2, [(1, 0.0, -1)])        # then the next one (round-robin)
    assert pool.take(0) is None and pool.take(1) is None


def test_bad_hypervisor_config_is_named():
    with pytest.raises(ShapingError, match="server must be one of"):
        SimConfig.from_dict(server="cpu")
    with pytest.raises(ShapingError, match="io_threads"):
        SimConfig.from_dict(hypervisor={"io_threads": 0})
    with pytest.raises(ShapingError, match=r"SimConfig\.hypervisor: unknown keys"):
        SimConfig.from_dict(hypervisor={"threads": 2})
    with pytest.raises(ShapingError, match="message_s or byte_s"):
        HypervisorConfig(message_s=0.0, byte_s=0.0)
    with pytest.raises(ShapingError, match="permutation"):
        IOThreadPool(HypervisorConfig(), [0, 0], 2)
    sim = ShapingSimulator(SimConfig.from_dict(SMALL), "none", 0)
    with pytest.raises(ShapingError, match="channel 10 out of range"):
        sim.offer(0.0, "read", 10, 100)


def test_env_runs_on_the_hypervisor_and_observes_what_waits_for_it():
    """``smart/Shaping-v0`` with ``sim.server = hypervisor`` passes ``check_env``; with no
    shaping (action +1) every message is handed over at once, so what the queue part of the
    observation shows is the hypervisor's backlog (non-zero in some step)."""
    from gymnasium.utils.env_checker import check_env

    from envs.shaping.env import ShapingEnv

    kw = {"tenants": 2, "switches_per_tenant": 4, "duration_s": 1.0, "period_s": 0.1,
          "sim": {"edge_switches": 2, "server": "hypervisor", "global_throughput": 2e5,
                  "hypervisor": {"io_threads": 1, "message_s": 2e-3, "byte_s": 0.0}}}
    env = ShapingEnv(**kw)
    check_env(env, skip_render_check=True)
    obs, _ = env.reset(seed=1)
    n = env.n
    seen = 0.0
    for _ in range(env.steps):
        obs, *_ = env.step(np.ones(env.action_space.shape, dtype=np.float32))
        seen = max(seen, float(obs[n:2 * n].max()), float(obs[4 * n:5 * n].max()))
        assert all(not q for L in env.sim.links for q in L.queues)   # nothing held back
    assert seen > 0.0
