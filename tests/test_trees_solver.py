"""Theorem 1, Algorithm 1 / Corollary 3 and their closed forms (Optimal Multicast, Zhu et al.,
Section VI) against brute force over every tree of small groups, plus property tests."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.trees.baselines import binary_tree_over, small_group_trees
from agents.trees.solver import (
    algorithm1,
    corollary3_tree,
    degree_distribution,
    forwarding_rules,
    k_values,
    load_weights,
    max_degree,
    parent_indices,
    theorem1_path,
)
from envs.trees import (
    CloningCostSwitch,
    MulticastError,
    MulticastTree,
    ProfileSwitch,
    objective1,
    objective3,
)

SWITCH = CloningCostSwitch()
# a measured-looking concave profile with a flat total beyond its table (another g)
TABLE = ProfileSwitch((0.9, 0.6, 0.45, 0.36, 0.3), source="test")


def all_rooted_trees(n: int):
    """Every spanning tree of ``n`` nodes rooted at node 0, as a parent array."""
    for ps in itertools.product(range(n), repeat=n - 1):
        parent = np.array([-1, *ps])
        if np.any(parent[1:] == np.arange(1, n)):
            continue
        try:
            yield MulticastTree.from_parents(parent)
        except MulticastError:  # a cycle
            continue


@pytest.mark.parametrize("switch", [SWITCH, TABLE], ids=["cloning_cost", "table"])
@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_theorem1_path_is_optimal_over_all_spanning_trees(switch, n: int) -> None:
    trees = list(all_rooted_trees(n))
    assert len(trees) == n ** (n - 2)  # Cayley: every labelled tree, rooted at node 0
    path = theorem1_path(n)
    for r in (0.1, 0.35, 0.8, 1.5):
        best = max(objective1(t, switch, r) for t in trees)
        assert objective1(path, switch, r) == pytest.approx(best, rel=1e-12)
        # the value of (8): (n - 1) U(1, r)
        assert best == pytest.approx((n - 1) * switch.U(1, r))


def test_fig8_topologies_rank_as_the_paper_says() -> None:
    for n in range(5, 15):  # at n = 4 the ternary tree is the star
        trees = small_group_trees(n)
        v = {k: objective1(t, SWITCH, 0.8) for k, t in trees.items()}
        assert v["path"] > v["binary"] > v["ternary"] > v["star"], (n, v)


# ---- problem (3): brute force over subsets, service-node trees and receiver counts ----

def _sn_trees(k: int):
    for ps in itertools.product(range(k), repeat=k - 1):
        par = [-1, *ps]
        ok = True
        for v in range(1, k):
            seen, u = set(), v
            while u != 0:
                if u in seen or par[u] == u:
                    ok = False
                    break
                seen.add(u)
                u = par[u]
            if not ok:
                break
        if ok:
            yield par


def brute_force(n: int, r: float, w: np.ndarray, lam: float):
    """(objective, height, k, sorted service-node degrees) of every tree of problem (3)."""
    m = len(w)
    out = []
    for k in range(1, m + 1):
        for subset in itertools.combinations(range(m), k):
            for root in subset:
                rest = [s for s in subset if s != root]
                order = [root, *rest]
                for par in _sn_trees(k):
                    for combo in itertools.combinations_with_replacement(range(k), n - 1):
                        parent = [-1, 0] + [1 + par[i] for i in range(1, k)] + \
                                 [1 + c for c in combo]
                        t = MulticastTree(np.array(parent),
                                          np.array([-1, *order] + [-1] * (n - 1)))
                        out.append((objective3(t, SWITCH, r, w, lam), t.height(), k,
                                    tuple(sorted(t.out_degrees()[1:k + 1]))))
    return out


def instances(count: int, seed: int):
    g = np.random.default_rng(seed)
    for _ in range(count):
        n, m = int(g.integers(2, 7)), int(g.integers(1, 4))
        r = float(g.choice([0.05, 0.3, 0.5, 0.8, 2.0]))
        lam = float(g.choice([0.0, 0.01, 0.1, 1.0]))
        yield n, r, load_weights(g.uniform(0, 30, m)), lam


@pytest.mark.parametrize("inst", list(instances(40, 7)),
                         ids=lambda i: f"n{i[0]}-m{len(i[2])}-r{i[1]}-lam{i[3]}")
def test_algorithm1_reaches_the_optimum_of_3_and_min_height(inst) -> None:
    n, r, w, lam = inst
    res = algorithm1(n, r, w, SWITCH, lam)
    trees = brute_force(n, r, w, lam)
    best = max(v for v, *_ in trees)
    got = objective3(res.tree, SWITCH, r, w, lam)
    assert got == pytest.approx(best, abs=1e-9)
    assert res.value == pytest.approx(got, abs=1e-9)  # the closed-form value is the tree's
    lemma2 = tuple(sorted(degree_distribution(n, res.k)))
    assert tuple(sorted(res.degrees)) == lemma2
    heights = [h for v, h, k, d in trees if v >= best - 1e-9 and k == res.k and d == lemma2]
    assert res.tree.height() == min(heights)
    # the paper's variant is optimal where Lemma 1's premise holds for every k
    paper = algorithm1(n, r, w, SWITCH, lam, variant="paper")
    assert objective3(paper.tree, SWITCH, r, w, lam) == pytest.approx(paper.value, abs=1e-9)
    premise = all(r <= SWITCH.g(int(max_degree(n, k))) or (n - 2) % k == 0
                  for k in range(1, len(w) + 1))
    if premise:
        assert paper.value == pytest.approx(best, abs=1e-9)
    else:
        assert paper.value <= best + 1e-9


def test_lemma1_counterexample_corollary3_is_not_optimal_when_saturated() -> None:
    w = np.zeros(2)
    paper = algorithm1(5, 0.8, w, SWITCH, 0.0, variant="paper")
    exact = algorithm1(5, 0.8, w, SWITCH, 0.0)
    assert list(paper.degrees) == [3, 2] and list(exact.degrees) == [2, 3]
    assert paper.value == pytest.approx(5 * SWITCH.g(3))
    assert exact.value == pytest.approx(2 * SWITCH.g(2) + 3 * SWITCH.g(3))
    best = max(v for v, *_ in brute_force(5, 0.8, w, 0.0))
    assert exact.value == pytest.approx(best) and paper.value < best - 0.2


def test_unsaturated_ties_can_have_lower_trees_outside_lemma2_distribution() -> None:
    """The min-height claim holds among trees with Lemma 2's degrees; with r <= g(D) other
    degree distributions tie on (3) and may be shallower (one receiver, 3 relays)."""
    w = load_weights(np.array([1.0, 2.0, 3.0]))
    res = algorithm1(2, 0.5, w, SWITCH, 0.0)
    trees = brute_force(2, 0.5, w, 0.0)
    best = max(v for v, *_ in trees)
    assert res.value == pytest.approx(best)
    assert min(h for v, h, *_ in trees if v >= best - 1e-9) < res.tree.height()


def test_k_search_beyond_m_le_n() -> None:
    """Theorem 2's 'WLOG m <= n' would miss this optimum: relays add streams."""
    w = np.zeros(6)
    res = algorithm1(3, 0.05, w, SWITCH, 0.0)
    assert res.k == 6  # more than m = 3


# ---- closed forms ----

@pytest.mark.parametrize("ascending", [False, True])
def test_forwarding_rules_and_parent_indices_describe_the_same_tree(ascending: bool) -> None:
    for n in range(2, 40):
        for k in range(1, 30):
            p = parent_indices(n, k, ascending)
            rules = forwarding_rules(n, k, ascending)
            for j, (first, last) in enumerate(rules, start=1):
                assert np.array_equal(np.flatnonzero(p == j), np.arange(first, last + 1))
            degs = np.bincount(p[1:], minlength=n + k)[1:k + 1]
            want = degree_distribution(n, k)
            assert np.array_equal(degs, want[::-1] if ascending else want)


def test_paper_parent_formula_matches_where_the_count_is_right() -> None:
    """Algorithm 1 line 7 as printed (x = (n-2) mod k, D = ceil) equals ours when k does
    not divide n - 2, and leaves k nodes without a parent when it does."""
    for n in range(3, 30):
        for k in range(1, 12):
            d, x = int(max_degree(n, k)), (n - 2) % k
            mine = parent_indices(n, k)
            if x == 0:
                assert k * (d - 1) == n - 2  # groups cover only n - 2 of n + k - 2 nodes
                continue
            for y in range(1, n + k):
                if y == 1:
                    p = 0
                elif y <= x * d + 1:
                    p = (y - 2) // d + 1
                else:
                    p = (y - (x + 2)) // (d - 1) + 1
                assert mine[y] == p


@settings(max_examples=300, deadline=None)
@given(n=st.integers(2, 600), k=st.integers(1, 120))
def test_degree_distribution_properties(n: int, k: int) -> None:
    deg = degree_distribution(n, k)
    assert deg.sum() == n + k - 2
    big = (n + k - 2) // k + 1  # the paper's count holds for floor + 1 and floor
    assert np.sum(deg == big) == (n - 2) % k
    assert np.sum(deg == big - 1) == k - (n - 2) % k
    assert deg.max() == math.ceil((n + k - 2) / k) == max_degree(n, k)
    for ascending in (False, True):
        p = parent_indices(n, k, ascending)
        # every non-source node is in exactly one forwarding range (one parent)
        covered = np.zeros(n + k, dtype=int)
        covered[1] += 1  # the source's one rule: h1 -> s1
        for first, last in forwarding_rules(n, k, ascending):
            covered[first:last + 1] += 1
        assert covered[0] == 0 and np.all(covered[1:] == 1)
        assert np.all(p[1:] < np.arange(1, n + k))  # parents come first: acyclic
        t = corollary3_tree(n, np.arange(k) + 100, ascending)
        t.validate(service_tree=True)  # connected, receivers leaves of service nodes
        assert len(t.bfs_order()) == n + k


@settings(max_examples=100, deadline=None)
@given(n=st.integers(2, 400), m=st.integers(1, 40), r=st.floats(0.001, 2.0),
       lam=st.floats(0.0, 5.0), seed=st.integers(0, 2**16))
def test_algorithm1_selects_least_weights_and_its_value_is_the_trees(n, m, r, lam, seed):
    w = load_weights(np.random.default_rng(seed).uniform(0, 31, m))
    for variant in ("exact", "paper"):
        res = algorithm1(n, r, w, SWITCH, lam, variant=variant)
        assert set(res.selected) == set(np.argsort(w, kind="stable")[:res.k])
        assert objective3(res.tree, SWITCH, r, w, lam) == pytest.approx(res.value, rel=1e-9,
                                                                        abs=1e-9)
        assert res.k == int(np.argmax(k_values(n, r, np.sort(w), SWITCH, lam, variant))) + 1
        res.tree.validate(service_tree=True)
    exact_v = algorithm1(n, r, w, SWITCH, lam).value
    assert exact_v >= algorithm1(n, r, w, SWITCH, lam, variant="paper").value - 1e-9


def test_load_weights_formula() -> None:
    loads = np.array([0.0, 8.0, 16.0, 31.0])
    w = load_weights(loads, alpha=2.0)
    assert np.allclose(w, -2.0 * np.log(1 - loads / 32.0))
    assert np.all(np.diff(w) > 0) and np.all(np.diff(w, 2)[:1] > 0)


def test_binary_heuristic_tree_shape() -> None:
    t = binary_tree_over(12, np.arange(5))
    t.validate(service_tree=True)
    deg = t.out_degrees()
    assert list(deg[1:6]) == [5, 4, 2, 2, 2]  # 2 service-node children + 2 receivers each;
    # the 11th receiver goes round-robin to s1
    assert t.receivers.size == 11


# ---- bad input ----

@pytest.mark.parametrize("call, match", [
    (lambda: algorithm1(1, 0.1, np.zeros(3), SWITCH, 1.0), "receiver"),
    (lambda: algorithm1(5, -0.1, np.zeros(3), SWITCH, 1.0), "rate"),
    (lambda: algorithm1(5, 0.1, np.zeros(3), SWITCH, -1.0), "lambda"),
    (lambda: algorithm1(5, 0.1, np.array([0.1, np.inf]), SWITCH, 1.0), "service node 1"),
    (lambda: algorithm1(5, 0.1, np.zeros(3), SWITCH, 1.0, candidates=[]), "no candidate"),
    (lambda: algorithm1(5, 0.1, np.zeros(3), SWITCH, 1.0, variant="x"), "variant"),
    (lambda: load_weights(np.array([1.0, 32.0])), "service node 1.*capacity"),
    (lambda: load_weights(np.array([-1.0])), "service node 0"),
    (lambda: theorem1_path(1), "receiver"),
    (lambda: MulticastTree.from_parents([-1, 2, 1]), "reachable"),
    (lambda: MulticastTree.from_parents([0, 0]), "source"),
    (lambda: MulticastTree.from_parents([-1, 0, 7]), "node 2"),
    (lambda: MulticastTree.from_parents([-1, 0, 0], [-1, 4, -1]), "exactly one"),
    (lambda: MulticastTree.from_parents([-1, 0, 1, 2], [-1, 4, -1, -1]), "forwards"),
])
def test_bad_input_is_refused_clearly(call, match) -> None:
    with pytest.raises(MulticastError, match=match):
        call()
