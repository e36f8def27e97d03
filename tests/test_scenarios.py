"""Scenario generators: the paper's parameters, the 80/20 power law, multicast share,
burst phases, and determinism."""

from __future__ import annotations

import numpy as np
import pytest

from envs.dsmd.errors import DSMDError
from envs.dsmd.scenarios import _sizes, generate, load_scenario, pareto_params
from envs.seeding import rng


def test_cern_parameters_are_the_papers():
    s = load_scenario("cern")
    assert (s.num_nodes, s.num_vms, s.num_vpcs, s.num_topics) == (5500, 12000, 1900, 1000)
    assert s.rate_per_vpc_bps == 1e6 and s.mean_size_bytes == 512 * 1024
    assert s.multicast_share == 0.5


def test_godaddy_parameters_and_phases():
    s = load_scenario("godaddy")
    assert (s.num_nodes, s.num_vpcs, s.num_topics, s.node_bandwidth_bps) == (350, 512, 200, 10**9)
    assert [m for _, m in s.phases][:5] == [0.5, 0.8, 0.95, 0.8, 0.5]
    assert s.peak_rate_bps == 30 * 8e6


def test_unknown_scenario_and_bad_values():
    with pytest.raises(DSMDError, match="unknown scenario 'nope'"):
        load_scenario("nope")
    with pytest.raises(DSMDError, match="multicast_share"):
        load_scenario("tiny", multicast_share=1.5)
    with pytest.raises(DSMDError, match="unknown keys"):
        load_scenario("tiny", colour="red")


def test_power_law_sizes_80_20_and_mean():
    spec = load_scenario("cern")
    sizes = np.sort(_sizes(rng(0, "sizes-test"), 400_000, spec))[::-1]
    top = sizes[: sizes.size // 5].sum() / sizes.sum()
    assert top == pytest.approx(0.8, abs=0.02)
    assert sizes.mean() == pytest.approx(512 * 1024, rel=0.05)
    alpha, low, high = pareto_params(512 * 1024)
    assert 0.5 < alpha < 2 and high / low == pytest.approx(1e4)


@pytest.mark.parametrize("share", [0.0, 0.3, 0.5, 1.0])
def test_multicast_share_of_traffic(share):
    ds = generate(load_scenario("godaddy", multicast_share=share, duration_s=300.0,
                                phases=[[300.0, 1.0]]))
    t = ds.trace
    cfg_multicast = np.isin(t.configuration_type, [0, 1, 3, 4, 7])  # VPC/SUBNET/SG/ROUTER/GW
    got = t.size_bytes[cfg_multicast].sum() / t.size_bytes.sum()
    # heavy tails: the byte share of one trace is noisy; the message share is tight
    assert cfg_multicast.mean() == pytest.approx(share, abs=0.03)
    if share in (0.0, 1.0):
        assert got == share


def test_same_seed_same_trace_other_seed_differs():
    a = generate(load_scenario("tiny"))
    b = generate(load_scenario("tiny"))
    c = generate(load_scenario("tiny", seed=1))
    np.testing.assert_array_equal(a.trace.size_bytes, b.trace.size_bytes)
    np.testing.assert_array_equal(a.trace.hosts, b.trace.hosts)
    np.testing.assert_array_equal(a.trace.timestamp_ns, b.trace.timestamp_ns)
    assert (len(a.trace) != len(c.trace)
            or not np.array_equal(a.trace.size_bytes, c.trace.size_bytes))


def test_generated_trace_is_valid_and_consistent(tiny_dataset):
    t, topo = tiny_dataset.trace, tiny_dataset.topology
    t.validate(topo)
    # unicast messages go to the node hosting a VM of their VPC
    uni = np.flatnonzero(t.fanout == 1)
    for r in uni[:50]:
        node = topo.node_index(t.hosts_of(r))[0]
        assert t.vpc_id[r] in set(topo.vm_vpc[topo.vm_node == node].tolist())
    # multicast destinations are nodes hosting VMs of the message's VPC
    for r in np.flatnonzero(t.fanout > 1)[:50]:
        nodes = set(topo.node_index(t.hosts_of(r)).tolist())
        assert nodes <= set(topo.vpc_nodes(int(t.vpc_id[r])).tolist())


def test_burst_phases_shape_the_rate():
    spec = load_scenario("godaddy")
    t = generate(spec).trace
    sec = (t.timestamp_ns - t.timestamp_ns[0]) / 1e9
    counts = [np.count_nonzero((sec >= a) & (sec < a + 60)) for a in range(0, 300, 60)]
    # message counts follow 50/80/95/80/50 % (Poisson noise allowed)
    ratio = np.array(counts) / counts[2]
    np.testing.assert_allclose(ratio, np.array([0.5, 0.8, 0.95, 0.8, 0.5]) / 0.95, atol=0.1)
