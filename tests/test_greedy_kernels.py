"""The compiled planner and placement (envs/dsmd/greedy_kernels.py, CostState.least_fitting,
the compiled violation) against their plain-Python statements (tests/greedy_reference.py):
the same channels on random instances, loose and tight, and the violation to the last bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.dsmd import kernels
from envs.dsmd.cost import CostState, violation
from envs.dsmd.greedy import GreedyLocalSearch
from envs.dsmd.instance import RPC, UNASSIGNED, DSMDInstance
from envs.dsmd.online import OnlineCost
from envs.dsmd.online_greedy import OnlineGreedy
from tests import greedy_reference as ref
from tests.conftest import instances


@pytest.mark.parametrize("n", [1, 7, 8, 9, 100, 128, 129, 256, 350, 1000, 5500])
def test_violation_is_numpys_to_the_last_bit(n):
    """The node sum adds in NumPy's pairwise order: the compiled violation equals
    ``cost.violation`` exactly, over capacity or not."""
    rng = np.random.default_rng(n)
    for _ in range(20):
        cap = rng.integers(1, 10**6, n)
        b = (cap * rng.uniform(0.5, 1.5, n)).astype(np.int64)
        inst = DSMDInstance.from_sets([[0]], [1], 10**6, 2, 10**6, 10, num_nodes=n)
        want = violation(inst.with_capacities(999, 7, cap), 1234, 9, b)
        got = kernels.state_violation(b, cap, 1234, 9, 999, 7, np.empty(n))
        assert got == want


def _tight(inst: DSMDInstance, rng: np.random.Generator) -> DSMDInstance:
    """The instance with its capacities cut to a random share (constraints that bind)."""
    s = rng.uniform(0.05, 1.0, 3)
    return inst.with_capacities(max(int(inst.controller_bw_bps * s[0]), 1),
                                max(int(inst.controller_cpu * s[1]), 1),
                                np.maximum((inst.node_capacity_bps * s[2]).astype(np.int64),
                                           1))


@settings(max_examples=120, deadline=None)
@given(inst=instances(tight=True, max_topics=6), seed=st.integers(0, 2**16),
       passes=st.integers(1, 3))
def test_compiled_greedy_equals_the_python_statement(inst, seed, passes):
    rng = np.random.default_rng(seed)
    for case in (inst, _tight(inst, rng)):
        got = GreedyLocalSearch(local_search_passes=passes).assign(case)
        np.testing.assert_array_equal(got, ref.greedy_assign(case, passes))


def test_compiled_greedy_on_larger_instances():
    from tests.conftest import random_instance

    rng = np.random.default_rng(3)
    for seed in range(6):
        inst = random_instance(seed, n=150, m=200, k=20)
        for case in (inst, _tight(inst, rng)):
            np.testing.assert_array_equal(GreedyLocalSearch(2).assign(case),
                                          ref.greedy_assign(case, 2))


def test_equal_topics_go_to_the_lowest_index():
    """Candidate topics of equal added traffic are taken in topic order (a defined order,
    not np.argpartition's): a lone multicast type goes to topic 1 of three empty ones."""
    inst = DSMDInstance.from_sets([[0, 1, 2]], [10], 10**6, 3, 10**6, 10, num_nodes=3)
    assert GreedyLocalSearch().assign(inst).tolist() == [1]


@settings(max_examples=150, deadline=None)
@given(inst=instances(tight=True, max_topics=6), seed=st.integers(0, 2**16))
def test_least_fitting_equals_the_python_rule(inst, seed):
    rng = np.random.default_rng(seed)
    ch = rng.integers(0, inst.num_topics + 1, inst.num_types)
    m = int(rng.integers(inst.num_types))
    ch[m] = UNASSIGNED
    for case in (inst, _tight(inst, rng)):
        state = CostState(case, ch)
        scores = rng.normal(size=case.num_topics + 1)
        if rng.random() < 0.5:
            scores = np.round(scores)  # ties
        before = state.snapshot()
        got = state.least_fitting(m, scores)
        after = state.snapshot()
        np.testing.assert_array_equal(before.node_traffic, after.node_traffic)
        assert before.total_traffic == after.total_traffic and state.channel[m] == UNASSIGNED
        assert got == ref.least_fitting(CostState(case, ch), m, scores)


@settings(max_examples=100, deadline=None)
@given(inst=instances(tight=True, max_topics=6), seed=st.integers(0, 2**16),
       headroom=st.sampled_from([0.05, 0.2, 0.5, 0.9]))
def test_least_fitting_with_headroom_is_the_reserved_instances(inst, seed, headroom):
    """Placing inside the plan's reserve is placing on the instance whose capacities are
    ``(1 - headroom)`` of these (``DSMDInstance.reserved``, the plan's own instance)."""
    rng = np.random.default_rng(seed)
    ch = rng.integers(0, inst.num_topics + 1, inst.num_types)
    m = int(rng.integers(inst.num_types))
    ch[m] = UNASSIGNED
    scores = np.round(rng.normal(size=inst.num_topics + 1))
    got = CostState(inst, ch).least_fitting(m, scores, headroom=headroom)
    assert got == ref.least_fitting(CostState(inst.reserved(headroom), ch), m, scores)


def test_reserved_capacities():
    inst = DSMDInstance.from_sets([[0, 1]], [10], 1000, 2, 301, 7, num_nodes=2)
    r = inst.reserved(0.2)
    assert (r.controller_bw_bps, r.controller_cpu) == (240, 5)
    assert r.node_capacity_bps.tolist() == [800, 800]
    assert inst.reserved(0.0) is inst and inst.reserved(0.2) is r  # one per headroom
    with pytest.raises(Exception, match=r"headroom must be in \[0, 1\), got 1.0"):
        inst.reserved(1.0)


@settings(max_examples=120, deadline=None)
@given(inst=instances(tight=True, max_topics=6), seed=st.integers(0, 2**16),
       horizon=st.sampled_from([0.0, 0.5, 4.0, 50.0]))
def test_compiled_hysteresis_equals_the_python_statement(inst, seed, horizon):
    rng = np.random.default_rng(seed)
    cost = OnlineCost()
    for case in (inst, _tight(inst, rng)):
        fresh = rng.integers(0, case.num_topics + 1, case.num_types)
        start = rng.integers(0, case.num_topics + 1, case.num_types)
        got = OnlineGreedy(horizon=horizon, cost=cost)._lazy(case, fresh, start)
        np.testing.assert_array_equal(got, ref.lazy_switch(case, fresh, start, horizon, cost))


def test_lazy_leaves_rpc_to_rpc():
    inst = DSMDInstance.from_sets([[0, 1]], [10], 10**6, 2, 10**6, 10, num_nodes=2)
    same = np.array([RPC], np.int64)
    assert OnlineGreedy(horizon=1.0)._lazy(inst, same, same).tolist() == [RPC]
