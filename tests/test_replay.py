"""The prioritized replay buffer (Schaul et al. proportional variant)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agents.ddpg.replay import PrioritizedReplay, SumTree, linear_schedule


def filled(n: int = 8, capacity: int | None = None, **kw) -> PrioritizedReplay:
    b = PrioritizedReplay(capacity or n, obs_dim=3, action_dim=2, **kw)
    obs = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    b.add(obs, np.ones((n, 2)), np.arange(n), obs + 1, np.zeros(n))
    return b


@given(st.lists(st.floats(0.0, 100.0), min_size=1, max_size=70),
       st.lists(st.floats(0.0, 0.999999), min_size=1, max_size=20))
def test_sum_tree_matches_brute_force(values, fractions):
    t = SumTree(len(values))
    t.set(np.arange(len(values)), np.array(values))
    assert t.total == pytest.approx(sum(values))
    if t.total == 0:
        return
    mass = np.array(fractions) * t.total
    got = t.find(mass)
    cum = np.cumsum(values)
    want = np.minimum(np.searchsorted(cum, mass, side="right"), len(values) - 1)
    # ties at segment boundaries may go either way only if the neighbour has zero mass
    for g, w, m in zip(got, want, mass):
        assert g == w or values[g] == 0 or abs(cum[min(g, w)] - m) < 1e-9 * t.total


def test_sum_tree_partial_updates_keep_sums():
    rng = np.random.default_rng(0)
    t = SumTree(1000)
    vals = rng.random(1000)
    t.set(np.arange(1000), vals)
    for _ in range(50):
        idx = rng.integers(0, 1000, 37)
        new = rng.random(37)
        t.set(idx, new)
        vals[idx] = new  # last write wins for repeats, as in the tree
        for i, v in zip(idx, new):
            vals[i] = v
        np.testing.assert_allclose(t.leaves(), vals)
    assert t.total == pytest.approx(vals.sum())
    with pytest.raises(ValueError):
        t.set(np.array([1]), np.array([-1.0]))
    with pytest.raises(IndexError):
        t.set(np.array([1000]), np.array([1.0]))


def test_sampling_is_proportional_to_priority_alpha():
    b = filled(4, alpha=1.0, seed=1)
    b.tree.set(np.arange(4), np.array([1.0, 2.0, 3.0, 4.0]))
    counts = np.zeros(4)
    for _ in range(400):
        s = b.sample(100)
        counts += np.bincount(s.indices, minlength=4)
        b.update_priorities(s.indices, (np.array([1.0, 2.0, 3.0, 4.0]) - b.eps)[s.indices])
    np.testing.assert_allclose(counts / counts.sum(), [0.1, 0.2, 0.3, 0.4], atol=0.01)


def test_importance_weights_follow_schaul():
    b = filled(4, alpha=1.0)
    b.tree.set(np.arange(4), np.array([1.0, 2.0, 3.0, 4.0]))
    s = b.sample(64, beta=0.5)
    p = np.array([0.1, 0.2, 0.3, 0.4])[s.indices]
    w = (4 * p) ** -0.5
    np.testing.assert_allclose(s.weights, w / w.max(), rtol=1e-6)
    assert s.weights.max() == pytest.approx(1.0)


def test_priorities_updated_for_exactly_the_sampled_transitions():
    b = filled(16, alpha=0.6, seed=3)
    before = b.priorities()
    s = b.sample(5)
    td = np.array([0.5, -2.0, 0.0, 3.0, 1.0])
    b.update_priorities(s.indices, td)
    after = b.priorities()
    expected = before.copy()
    for i, d in zip(s.indices, td):  # last write wins for repeats
        expected[i] = (abs(d) + b.eps) ** 0.6
    np.testing.assert_allclose(after, expected)
    # the batch's rows are the stored transitions of those indices
    np.testing.assert_array_equal(s.obs, b.obs[s.indices])
    np.testing.assert_array_equal(s.rewards, np.arange(16)[s.indices])
    # only the indices of the last sample, once
    with pytest.raises(ValueError, match="without a preceding sample"):
        b.update_priorities(s.indices, td)
    s = b.sample(5)
    with pytest.raises(ValueError, match="exactly the indices"):
        b.update_priorities((s.indices + 1) % 16, td)
    with pytest.raises(ValueError, match="TD errors"):
        b.update_priorities(s.indices, td[:3])


def test_new_transitions_enter_with_max_priority():
    b = filled(8, capacity=32, alpha=1.0)
    s = b.sample(4)
    b.update_priorities(s.indices, np.array([7.0, 0.1, 0.1, 0.1]))
    slots = b.add(np.zeros((2, 3)), np.zeros((2, 2)), np.zeros(2), np.zeros((2, 3)), np.zeros(2))
    np.testing.assert_allclose(b.tree.leaves(slots), 7.0 + b.eps)


def test_uniform_switch_and_wraparound():
    b = filled(10, capacity=10, prioritized=False, seed=0)
    s = b.sample(20000)
    assert np.all(s.weights == 1.0)
    np.testing.assert_allclose(np.bincount(s.indices, minlength=10) / 20000, 0.1, atol=0.01)
    b.update_priorities(s.indices, np.ones(20000))  # accepted, changes nothing
    s = b.sample(4)
    b.add(np.full((3, 3), 99.0), np.zeros((3, 2)), np.zeros(3), np.zeros((3, 3)), np.zeros(3))
    assert len(b) == 10 and b.pos == 3 and (b.obs[:3] == 99).all()
    b.add(np.zeros((7, 3)), np.zeros((7, 2)), np.zeros(7), np.zeros((7, 3)), np.zeros(7))
    with pytest.raises(ValueError, match="overwritten"):  # every slot was rewritten
        b.update_priorities(s.indices, np.ones(4))


def test_partially_filled_buffer_never_samples_empty_slots():
    b = filled(5, capacity=1000, alpha=0.6, seed=2)
    for _ in range(100):
        s = b.sample(64)
        assert s.indices.max() < 5
        b.update_priorities(s.indices, np.random.default_rng(0).random(64))


def test_same_seed_same_samples_and_beta_schedule():
    a, c = filled(50, seed=9), filled(50, seed=9)
    np.testing.assert_array_equal(a.sample(32).indices, c.sample(32).indices)
    beta = linear_schedule(0.4, 1.0, 100)
    assert (beta(0), beta(50), beta(100), beta(10_000)) == (0.4, pytest.approx(0.7), 1.0, 1.0)
    with pytest.raises(ValueError):
        PrioritizedReplay(4, 1, 1, alpha=-1)
    with pytest.raises(ValueError, match="empty"):
        PrioritizedReplay(4, 1, 1).sample(2)
