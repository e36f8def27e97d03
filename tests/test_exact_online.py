"""The hindsight oracle of online DSMD (agents.exact_online) and its cost definition."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from agents.exact import InstanceTooLarge
from agents.exact_online import online_cost, solve_online_oracle, subscriptions
from agents.greedy import GreedyLocalSearch
from envs.dsmd.instance import DSMDInstance

CAP = [16, 100, 100]


def hand_case() -> tuple[DSMDInstance, DSMDInstance]:
    """Two intervals over 3 nodes, K = 2, C_b = 20, C_p = 3, s = (16, 100, 100).

    Interval 0: type 10 (D = {0, 1}, 10 bit/s), type 11 (D = {1, 2}, 5 bit/s).
    Interval 1: type 11 (D = {1, 2}, 5 bit/s), type 12 (D = {0}, 20 bit/s)."""
    a = DSMDInstance.from_sets([[0, 1], [1, 2]], [10, 5], CAP, 2, 20, 3, num_nodes=3,
                               catalog_index=np.array([10, 11]))
    b = DSMDInstance.from_sets([[1, 2], [0]], [5, 20], CAP, 2, 20, 3, num_nodes=3,
                               catalog_index=np.array([11, 12]))
    return a, b


def test_online_cost_by_hand():
    a, b = hand_case()
    plan = [np.array([1, 1]), np.array([2, 0])]
    w = (2.0, 0.1, 3.0)  # w_violation, w_subscribe, w_move
    # interval 0: both types on topic 1 (R = 15, subscribers {0, 1, 2}): sum b = 45,
    #   necessary 10*2 + 5*2 = 30, ratio 1.5; C_b 15 <= 20, 2 sends <= 3, nodes <= s:
    #   V = 0; no initial state: no switching terms.                          cost 1.5
    # interval 1: type 11 on topic 2 ({1, 2}: 10), type 12 by RPC to node 0 (20): sum b
    #   = 30 = necessary, ratio 1.0; C_b: 5 + 20 = 25 -> 25/20 - 1 = 0.25; node 0:
    #   20/16 - 1 = 0.25; V = 0.5. Subscriptions: topic 1 {0,1,2} -> {}, topic 2
    #   {} -> {1,2}: SI = 5. Type 11 moved 1 -> 2: 1 move; type 12 is new.
    #   cost 1.0 + 2*0.5 + 0.1*5 + 3*1 = 5.5                                  total 7.0
    assert online_cost([a, b], plan, *w) == pytest.approx(7.0, abs=1e-12)
    # from an initial state: interval b's instance with 11 on topic 2, 12 on RPC
    # (subscriptions topic 2 {1, 2}). Interval 0 now pays SI: topic 1 {} -> {0,1,2} (3),
    # topic 2 {1,2} -> {} (2) = 5 -> 0.5; type 11 moved 2 -> 1: 3. cost 1.5 + 3.5 = 5.0
    init = {11: 2, 12: 0}
    assert online_cost([a, b], plan, *w, init, b) == pytest.approx(10.5, abs=1e-12)
    # initial channels without an initial instance: nothing subscribed before, so
    # interval 0's SI = 3 (topic 1 {0,1,2}) -> 0.3, and the move 3: 1.5 + 3.3 = 4.8
    assert online_cost([a, b], plan, *w, init) == pytest.approx(10.3, abs=1e-12)
    z = subscriptions(a, plan[0])
    assert z.tolist() == [[True, False], [True, False], [True, False]]


def test_oracle_on_the_hand_case():
    a, b = hand_case()
    r = solve_online_oracle([a, b], 2.0, 0.1, 3.0)
    # each type of interval 0 alone on a topic (ratio 1), interval 1 keeps type 11 on
    # its topic and puts 12 on the other: V = 0.25 + 0.25, SI = 1 -> 1 + 1 + 1.0 + 0.1
    assert r.status == "optimal"
    assert r.objective == pytest.approx(3.1, abs=1e-12)
    assert r.objective == pytest.approx(online_cost([a, b], r.channels, 2.0, 0.1, 3.0),
                                        abs=1e-15)
    assert r.dual_bound is not None and r.dual_bound <= r.objective + r.gap_tolerance


def random_sequence(rng: np.random.Generator, intervals: int, n: int, k: int,
                    types: int = 5, per_interval: int = 3) -> list[DSMDInstance]:
    """Intervals drawing 1..per_interval types from a catalogue of fixed destination sets,
    with new rates each interval and capacities that bind."""
    dests = [rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False)
             for _ in range(types)]
    cap = rng.integers(10, 80, n)
    cb, cp = int(rng.integers(10, 80)), int(rng.integers(1, 5))
    out = []
    for _ in range(intervals):
        ids = np.sort(rng.choice(types, size=int(rng.integers(1, per_interval + 1)),
                                 replace=False))
        out.append(DSMDInstance.from_sets([dests[g] for g in ids],
                                          rng.integers(1, 40, ids.size), cap, k, cb, cp,
                                          num_nodes=n, catalog_index=ids))
    return out


def all_plans(instances: list[DSMDInstance]):
    k = instances[0].num_topics
    sizes = [inst.num_types for inst in instances]
    for a in itertools.product(range(k + 1), repeat=sum(sizes)):
        plan, p = [], 0
        for s in sizes:
            plan.append(np.array(a[p:p + s], dtype=np.int64))
            p += s
        yield plan


@pytest.mark.parametrize("seed", range(12))
def test_oracle_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(2, 5)), int(rng.integers(1, 3))
    insts = random_sequence(rng, 2, n, k, per_interval=3 if k == 2 else 4)
    w = (float(rng.choice([0.0, 0.5, 5.0])), float(rng.choice([0.0, 0.01, 0.3])),
         float(rng.choice([0.0, 0.05, 1.0])))
    init, before = None, None
    if seed % 2:  # an initial state: topics are not interchangeable any more
        before = random_sequence(rng, 1, n, k)[0]
        init = {g: int(rng.integers(0, k + 1)) for g in range(5)}
    r = solve_online_oracle(insts, *w, initial_channel=init, initial_instance=before)
    best = min(online_cost(insts, p, *w, init, before) for p in all_plans(insts))
    assert r.status == "optimal"
    assert r.objective == pytest.approx(best, rel=1e-12, abs=1e-12)
    assert r.dual_bound is not None and r.dual_bound <= best + r.gap_tolerance


def test_oracle_never_worse_than_any_plan():
    rng = np.random.default_rng(100)
    for _trial in range(6):
        n, k = int(rng.integers(2, 5)), int(rng.integers(1, 3))
        insts = random_sequence(rng, 3, n, k, per_interval=4)
        w = (float(rng.choice([0.5, 5.0])), float(rng.choice([0.01, 0.3])),
             float(rng.choice([0.05, 1.0])))
        r = solve_online_oracle(insts, *w)
        assert r.status == "optimal", r
        bound = r.objective + r.gap_tolerance
        greedy = [GreedyLocalSearch().assign(inst) for inst in insts]
        assert r.objective <= online_cost(insts, greedy, *w) + r.gap_tolerance
        rpc = [np.zeros(inst.num_types, np.int64) for inst in insts]
        assert r.objective <= online_cost(insts, rpc, *w) + r.gap_tolerance
        for _ in range(30):
            plan = [rng.integers(0, k + 1, inst.num_types) for inst in insts]
            assert r.objective <= online_cost(insts, plan, *w) + r.gap_tolerance
        assert r.dual_bound is not None and r.dual_bound <= bound


def moves_of(instances: list[DSMDInstance], channels: list[np.ndarray],
             initial: dict[int, int] | None = None) -> int:
    last = dict(initial or {})
    moves = 0
    for inst, ch in zip(instances, channels):
        for g, c in zip(inst.catalog_index.tolist(), ch.tolist()):
            moves += g in last and last[g] != c
            last[g] = c
    return moves


def test_huge_move_weight_keeps_channels():
    rng = np.random.default_rng(7)
    for _ in range(4):
        insts = random_sequence(rng, 3, 4, 2, types=4, per_interval=4)
        r = solve_online_oracle(insts, 0.5, 0.01, 1e3)
        assert r.status == "optimal"
        assert moves_of(insts, r.channels) == 0
        # free to move, the oracle does better or the same
        assert solve_online_oracle(insts, 0.5, 0.01, 0.0).objective <= r.objective


def test_initial_topics_are_not_interchangeable():
    """A type that was on topic 2 stays there under a huge move weight, although topic 1
    is as good for Eq. 1: symmetry breaking must not force the first type onto topic 1."""
    insts = [DSMDInstance.from_sets([[0, 1], [2]], [10, 5], 1000, 2, 10**6, 10**6,
                                    num_nodes=3, catalog_index=np.array([3, 4]))] * 2
    r = solve_online_oracle(insts, 1.0, 0.0, 1e3, initial_channel={3: 2})
    assert r.status == "optimal"
    assert [c[0] for c in r.channels] == [2, 2]
    assert moves_of(insts, r.channels, {3: 2}) == 0
    # with the initial subscriptions too, keeping them is free
    before = insts[0]
    r2 = solve_online_oracle(insts, 1.0, 1.0, 1e3, {3: 2, 4: 0}, before)
    assert r2.status == "optimal" and r2.objective == pytest.approx(2.0)
    assert [c.tolist() for c in r2.channels] == [[2, 0], [2, 0]]


def test_symmetry_is_broken_once_for_the_horizon():
    """Topics may be relabelled in every interval at once, not in one alone: type 5, the
    first of interval 1, keeps topic 2 from interval 0 (C_p = 2 keeps both types of
    interval 0 off RPC, and type 9 takes topic 1 there)."""
    a = DSMDInstance.from_sets([[0, 1], [1, 2]], [100, 10], 1000, 2, 10**6, 2, num_nodes=3,
                               catalog_index=np.array([9, 5]))
    b = DSMDInstance.from_sets([[1, 2]], [10], 1000, 2, 10**6, 2, num_nodes=3,
                               catalog_index=np.array([5]))
    r = solve_online_oracle([a, b], 1.0, 0.01, 1e3)
    assert r.status == "optimal"
    assert [c.tolist() for c in r.channels] == [[1, 2], [2]]
    # ratio 1 in both; interval 1 drops topic 1's subscribers {0, 1}: SI = 2
    assert r.objective == pytest.approx(2.0 + 0.01 * 2, abs=1e-12)


def test_size_limit_and_checks():
    insts = [DSMDInstance.from_sets([[i % 10] for i in range(40)], [1] * 40, 1000, 5,
                                    10**6, 10**4, num_nodes=10)] * 3
    with pytest.raises(InstanceTooLarge, match=r"needs \d+ variables"):
        solve_online_oracle(insts, 1.0, 1.0, 1.0, max_variables=1_000)
    a, b = hand_case()
    with pytest.raises(ValueError, match="initial_channel"):
        solve_online_oracle([a, b], 1.0, 1.0, 1.0, initial_instance=b)
    other = DSMDInstance.from_sets([[0]], [1], 10, 2, 10, 10, num_nodes=2)
    with pytest.raises(ValueError, match="same nodes"):
        online_cost([a, other], [np.zeros(2, np.int64), np.zeros(1, np.int64)], 1, 1, 1)
