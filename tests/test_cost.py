"""The cost model of Eq. 1: hand-computed cases, incremental == full, and properties."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agents.baselines import VITA, RPCOnly
from envs.dsmd.cost import CostState, evaluate, metrics_from
from envs.dsmd.errors import InstanceError
from envs.dsmd.instance import DSMDInstance

from .conftest import instances, random_instance


def hand_instance() -> DSMDInstance:
    # m0 -> {0,1} at 10, m1 -> {1,2} at 20, m2 -> {3} at 5; K = 2
    return DSMDInstance.from_sets([[0, 1], [1, 2], [3]], [10, 20, 5], [40, 40, 40, 40], 2,
                                  controller_bw_bps=40, controller_cpu=3,
                                  messages=np.array([2, 1, 4]))


def test_hand_case_shared_topic():
    inst = hand_instance()
    s = CostState(inst, np.array([1, 1, 0]))
    # topic 1 carries 30 to subscribers {0,1,2}; node 3 gets m2 by RPC
    np.testing.assert_array_equal(s.node_traffic, [30, 30, 30, 5])
    assert s.total_traffic == 95 and s.necessary == 65
    assert s.controller_bw == 35 and s.controller_cpu == 3
    assert s.sent_messages == 2 + 1 + 4
    m = s.metrics()
    assert m.redundancy_bps == 30 and m.redundancy_ratio == pytest.approx(95 / 65)
    assert m.feasible and m.topics_used == 1 and m.rpc_types == 1 and m.mq_types == 2


def test_hand_case_violations():
    inst = hand_instance()
    s = CostState(inst, np.array([0, 2, 2]))
    # m0 by RPC to {0,1}; topic 2 carries 25 to {1,2,3}
    np.testing.assert_array_equal(s.node_traffic, [10, 35, 25, 25])
    assert s.total_traffic == 95 and s.controller_bw == 45 and s.controller_cpu == 4
    m = s.metrics()
    assert m.controller_bw_violation == pytest.approx(45 / 40 - 1)
    assert m.controller_cpu_violation == pytest.approx(4 / 3 - 1)
    assert not m.feasible and m.nodes_over_capacity == 0
    s2 = CostState(inst.with_capacities(node_capacity_bps=30), np.array([0, 2, 2]))
    assert s2.metrics().nodes_over_capacity == 1
    assert s2.metrics().node_violation == pytest.approx(35 / 30 - 1)


def test_rpc_only_is_necessary_traffic():
    inst = hand_instance()
    s = CostState(inst, np.zeros(3, np.int64))
    np.testing.assert_array_equal(s.node_traffic, [10, 30, 20, 5])
    assert s.total_traffic == s.necessary == 65
    assert s.controller_bw == 65 and s.controller_cpu == 5


def test_incremental_equals_full_after_random_moves():
    for seed in range(5):
        inst = random_instance(seed)
        rng = np.random.default_rng(seed)
        s = CostState(inst)
        for i in range(3000):
            s.move(int(rng.integers(inst.num_types)), int(rng.integers(-1, inst.num_topics + 1)))
            if i % 300 == 0 or i == 2999:
                snap = evaluate(inst, s.channel)
                np.testing.assert_array_equal(snap.node_traffic, s.node_traffic)
                np.testing.assert_array_equal(snap.topic_rate, s.topic_rate)
                np.testing.assert_array_equal(snap.topic_subscribers, s.topic_subscribers)
                assert (snap.controller_bw, snap.controller_cpu, snap.total_traffic,
                        snap.necessary, snap.sent_messages) == (
                    s.controller_bw, s.controller_cpu, s.total_traffic, s.necessary,
                    s.sent_messages)
                full = metrics_from(inst, s.channel, snap.node_traffic, snap.controller_bw,
                                    snap.controller_cpu, snap.total_traffic, snap.necessary,
                                    snap.sent_messages)
                assert full == s.metrics()


@given(instances(), st.lists(st.tuples(st.integers(0, 50), st.integers(-1, 3)), max_size=40))
def test_incremental_equals_full_property(inst, moves):
    s = CostState(inst)
    for m, c in moves:
        s.move(m % inst.num_types, min(c, inst.num_topics))
    snap = evaluate(inst, s.channel)
    np.testing.assert_array_equal(snap.node_traffic, s.node_traffic)
    assert snap.total_traffic == s.total_traffic == int(s.node_traffic.sum())
    assert (snap.controller_bw, snap.controller_cpu, snap.necessary) == (
        s.controller_bw, s.controller_cpu, s.necessary)
    # assign_all equals the sequence of moves
    t = CostState(inst)
    t.assign_all(s.channel)
    np.testing.assert_array_equal(t.sub_count, s.sub_count)
    assert t.metrics() == s.metrics()


@given(instances())
def test_rpc_only_has_zero_redundancy(inst):
    m = CostState(inst, RPCOnly().assign(inst)).metrics()
    assert m.redundancy_bps == 0 and m.total_node_traffic_bps == inst.necessary_bps


@given(instances())
def test_total_traffic_never_below_necessary(inst):
    rng = np.random.default_rng(0)
    ch = rng.integers(0, inst.num_topics + 1, inst.num_types)
    s = CostState(inst, ch)
    assert s.total_traffic >= s.necessary == inst.necessary_bps


@given(instances(max_topics=4))
def test_vita_controller_traffic_is_total_rate(inst):
    """VITA publishes every message once: controller traffic = sum_m f(m), whatever mix."""
    if inst.num_topics == 0:
        return
    m = CostState(inst, VITA().assign(inst)).metrics()
    assert m.controller_traffic_bps == inst.rate_bps.sum()
    assert m.controller_sends == inst.num_types


def test_topic_deltas_match_moves():
    inst = random_instance(3)
    rng = np.random.default_rng(3)
    s = CostState(inst, rng.integers(0, inst.num_topics + 1, inst.num_types))
    for m in range(0, inst.num_types, 7):
        s.move(m, -1)
        delta = s.topic_deltas(m)
        for c in range(inst.num_topics + 1):
            before = s.total_traffic
            s.move(m, c)
            assert s.total_traffic - before == delta[c]
            peak = float((s.node_traffic / inst.node_capacity_bps).max())
            s.move(m, -1)
            if c:
                assert s.node_peak_if(m, c) <= peak + 1e-12
        s.move(m, 0)


def test_bad_assignments_are_refused():
    inst = hand_instance()
    with pytest.raises(InstanceError, match="entries"):
        evaluate(inst, np.zeros(2, np.int64))
    with pytest.raises(InstanceError, match="channels must be in"):
        evaluate(inst, np.array([0, 3, 0]))
    s = CostState(inst)
    with pytest.raises(InstanceError, match="out of range"):
        s.move(0, 7)
    s.move(0, 1)
    with pytest.raises(InstanceError, match="assigned"):
        s.topic_deltas(0)
    with pytest.raises(InstanceError, match="empty destination"):
        DSMDInstance.from_sets([[0], []], [1, 1], 10, 1, 10, 10, num_nodes=2)
