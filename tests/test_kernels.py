"""The compiled loops (envs/dsmd/kernels.py) against plain NumPy statements of the same rules:
the reserve-aware channel search, the argmax with ties, the batched costs and observations,
and the pending least costs kept under moves."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.dsmd import kernels
from envs.dsmd.cost import CostState
from envs.dsmd.instance import UNASSIGNED
from envs.dsmd.observation import ObservationBuilder, ObservationLayout
from tests.conftest import instances


def _random_state(inst, rng, free_share: float = 0.5) -> CostState:
    ch = rng.integers(0, inst.num_topics + 1, inst.num_types)
    ch[rng.random(inst.num_types) < free_share] = UNASSIGNED
    return CostState(inst, ch)


def _scores(rng, k1: int) -> np.ndarray:
    sc = rng.normal(size=k1).astype(np.float32)
    if rng.random() < 0.4:
        sc = np.round(sc)  # ties
    if rng.random() < 0.2:
        sc[rng.integers(0, k1, 2)] = np.nan
    return sc


@settings(max_examples=150, deadline=None)
@given(inst=instances(tight=True, max_topics=6), seed=st.integers(0, 2**16))
def test_first_fit_is_the_best_scoring_channel_that_fits(inst, seed):
    """``first_fit`` = the first channel, in a stable descending sort of the scores, other
    than ``skip``, for which ``fits(m, c, reserve=True)`` holds (or -1)."""
    rng = np.random.default_rng(seed)
    state = _random_state(inst, rng)
    free = np.flatnonzero(state.channel == UNASSIGNED)
    if not free.size:
        return
    for _ in range(5):
        m = int(rng.choice(free))
        sc = _scores(rng, inst.num_topics + 1)
        skip = int(rng.integers(-1, inst.num_topics + 1))
        expected = next((int(c) for c in np.argsort(-sc, kind="stable")
                         if c != skip and state.fits(m, int(c), reserve=True)), -1)
        assert state.first_fit(m, sc, skip) == expected


def test_first_fit_searches_past_the_first_candidates():
    """Nodes near capacity: the search often goes past its first four candidates (where it
    switches from scans to a sort) and sometimes finds nothing."""
    from envs.dsmd.instance import DSMDInstance

    rng = np.random.default_rng(5)
    n, m, k = 30, 60, 12
    dests = [rng.choice(n, size=int(rng.integers(1, 9)), replace=False) for _ in range(m)]
    inst = DSMDInstance.from_sets(dests, rng.integers(1, 10**6, m), 10**7, k, 10**12, 10**6,
                                  num_nodes=n)
    deep = none = 0
    for _trial in range(300):
        state = _random_state(inst, rng, free_share=0.6)
        free = np.flatnonzero(state.channel == UNASSIGNED)
        m = int(rng.choice(free))
        sc = _scores(rng, inst.num_topics + 1)
        order = [int(c) for c in np.argsort(-sc, kind="stable") if c != 0]
        hits = [c for c in order if state.fits(m, c, reserve=True)]
        expected = hits[0] if hits else -1
        deep += expected >= 0 and order.index(expected) >= 4
        none += expected < 0
        assert state.first_fit(m, sc, skip=0) == expected
    assert deep > 0 and none > 0


@given(st.lists(st.sampled_from([-1.0, 0.0, 0.5, 1.0, np.nan, -np.inf]), min_size=1,
                max_size=12))
def test_argmax_ties_is_numpy_argmax_without_nan(values):
    a = np.array(values, np.float32)
    best, count = kernels.argmax_ties(a)
    ok = ~np.isnan(a)
    if not ok.any():
        assert (best, count) == (0, 0)
        return
    top = a[ok].max()
    assert best == int(np.flatnonzero(a == top)[0])
    assert count == int((a == top).sum())


@given(st.lists(st.lists(st.sampled_from([-1.0, 0.0, 0.5, 1.0, np.nan, -np.inf]),
                         min_size=5, max_size=5), min_size=1, max_size=6),
       st.sampled_from([np.float32, np.float64]))
def test_argmax_ties_rows_is_argmax_ties_of_each_row(rows, dtype):
    a = np.array(rows, dtype)
    best, count = kernels.argmax_ties_rows(a)
    assert best.dtype == count.dtype == np.int64
    assert [(int(b), int(c)) for b, c in zip(best, count)] == [kernels.argmax_ties(r)
                                                              for r in a]


@settings(max_examples=40, deadline=None)
@given(inst=instances(max_topics=5), seed=st.integers(0, 2**16),
       progress=st.floats(0.0, 1.0), cuts=st.lists(st.integers(0, 40), max_size=4))
def test_observation_rows_fill_any_split_as_observe_many(inst, seed, progress, cuts):
    """``ObservationBuilder.rows``: any split of the types into ranges, filled in any order
    (the later ranges first), gives observe_many's rows; a later observe() of another state
    leaves a filler made before it unchanged."""
    rng = np.random.default_rng(seed)
    state = _random_state(inst, rng)
    free = np.flatnonzero(state.channel == UNASSIGNED)
    layout = ObservationLayout("channel", inst.num_types, inst.num_nodes, inst.num_topics)
    builder = ObservationBuilder(layout, inst)
    want = builder.observe_many(state, free, progress)
    fill = builder.rows(state, free, progress)
    if free.size:  # the builder's own cached blocks move on; the filler keeps its copy
        other = _random_state(inst, np.random.default_rng(seed + 1))
        builder.observe(other, None, 0.0)
    edges = sorted({0, free.size, *(min(c, free.size) for c in cuts)})
    got = np.full_like(want, np.nan)
    for lo, hi in reversed(list(itertools.pairwise(edges))):
        fill(lo, hi, got[lo:hi])
    np.testing.assert_array_equal(got, want)


@settings(max_examples=80, deadline=None)
@given(inst=instances(max_topics=5), seed=st.integers(0, 2**16),
       progress=st.floats(0.0, 1.0))
def test_batched_costs_and_observations_equal_one_by_one(inst, seed, progress):
    rng = np.random.default_rng(seed)
    state = _random_state(inst, rng)
    free = np.flatnonzero(state.channel == UNASSIGNED)
    rng.shuffle(free)
    delta, fresh = state.channel_costs_many(free)
    layout = ObservationLayout("channel", inst.num_types, inst.num_nodes, inst.num_topics)
    builder = ObservationBuilder(layout, inst)
    many = builder.observe_many(state, free, progress)
    assert many.shape == (free.size, layout.size) and many.dtype == np.float32
    for i, m in enumerate(free.tolist()):
        d1, f1 = state.channel_costs(m)
        np.testing.assert_array_equal(delta[i], d1)
        np.testing.assert_array_equal(fresh[i], f1)
        np.testing.assert_array_equal(many[i], builder.observe(state, m, progress))
        assert np.all(np.abs(many[i]) <= 1.0)


@settings(max_examples=80, deadline=None)
@given(inst=instances(tight=True, max_topics=4), seed=st.integers(0, 2**16))
def test_pending_least_costs_follow_moves(inst, seed):
    """Once tracked (the first reserve test), the unassigned types' least node costs and
    rates stay equal to a recomputation from scratch after every move."""
    rng = np.random.default_rng(seed)
    state = CostState(inst)
    state.fits(0, 0, reserve=True)  # starts the tracking
    for _ in range(3 * inst.num_types):
        m = int(rng.integers(inst.num_types))
        state.move(m, int(rng.integers(-1, inst.num_topics + 1)))
        free = state.channel == UNASSIGNED
        pend = np.zeros(inst.num_nodes, np.int64)
        for t in np.flatnonzero(free):
            pend[inst.destinations(t)] += inst.rate_bps[t]
        np.testing.assert_array_equal(state.pending_node, pend)
        assert state.pending_rate == int(inst.rate_bps[free].sum())


def test_warm_up_is_idempotent():
    kernels.warm_up()
    kernels.warm_up()


@settings(max_examples=60, deadline=None)
@given(inst=instances(max_topics=5), seed=st.integers(0, 2**16))
def test_observation_blocks_kept_between_calls_never_go_stale(inst, seed):
    """A builder keeps the type-independent blocks between observations and recomputes the
    topics that changed: after any moves it observes exactly what a new builder does."""
    rng = np.random.default_rng(seed)
    layout = ObservationLayout("channel", inst.num_types, inst.num_nodes, inst.num_topics)
    state = CostState(inst)
    kept = ObservationBuilder(layout, inst)
    for _ in range(4 * inst.num_types):
        m = int(rng.integers(inst.num_types))
        state.move(m, int(rng.integers(-1, inst.num_topics + 1)))
        probe = int(rng.integers(inst.num_types))
        np.testing.assert_array_equal(kept.observe(state, probe, 0.5),
                                      ObservationBuilder(layout, inst).observe(state, probe, 0.5))


def _same_state(a: CostState, b: CostState) -> None:
    for name in ("channel", "node_traffic", "topic_rate", "topic_subscribers", "topic_types",
                 "sub_count", "sc"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    if a.pending_node is not None and b.pending_node is not None:
        np.testing.assert_array_equal(a.pending_node, b.pending_node)


@settings(max_examples=120, deadline=None)
@given(inst=instances(tight=True, max_topics=5), seed=st.integers(0, 2**16),
       mode=st.sampled_from(["feasible", "argmax"]), by_step=st.booleans())
def test_the_compiled_decision_step_is_the_checked_one(inst, seed, mode, by_step):
    """``DecisionStep.observe`` and ``apply`` (one compiled call each: take off and observe;
    decode and move) give the observation, the channel, the state and the RNG draws of the
    checked path they replace: ``CostState.move``, ``ObservationBuilder.observe`` and
    ``decoding.decode`` one after the other, on a twin state, over re-decisions of assigned
    and unassigned types with tied, NaN and infeasible scores."""
    from envs.dsmd.decision import DecisionStep
    from envs.dsmd.decoding import decode

    rng = np.random.default_rng(seed)
    ch = _random_state(inst, rng).channel
    fast, ref = CostState(inst, ch), CostState(inst, ch)
    layout = ObservationLayout("channel", inst.num_types, inst.num_nodes, inst.num_topics)
    r_fast, r_ref = np.random.default_rng(seed), np.random.default_rng(seed)
    step = DecisionStep(inst, layout, rng=r_fast, order=(), state=fast,
                        progress="step" if by_step else "decided")
    builder = ObservationBuilder(layout, inst)
    order = rng.integers(0, inst.num_types, 3 * inst.num_types).tolist()
    step.begin(order)
    out = np.zeros(layout.size, np.float32)
    for i, m in enumerate(order):
        obs = step.observe(out if i % 2 else None)
        if ref.channel[m] != UNASSIGNED:
            ref.move(m, UNASSIGNED)
        progress = i / len(order) if by_step else ref.assigned / inst.num_types
        np.testing.assert_array_equal(obs, builder.observe(ref, m, progress))
        assert (obs is out) == bool(i % 2)
        scores = _scores(rng, inst.num_topics + 1)
        if i % 3 == 0:
            scores = scores.astype(np.float64)
        c_ref = decode(scores, ref, m, r_ref, mode)
        ref.move(m, c_ref)
        assert step.apply(scores, mode) == c_ref
        _same_state(fast, ref)
    assert step.done
    obs = step.observe()  # after the last type: the final state's observation
    np.testing.assert_array_equal(obs, builder.observe(ref, None, 1.0 if by_step else
                                                       ref.assigned / inst.num_types))
    assert r_fast.integers(2**32) == r_ref.integers(2**32)


def test_the_compiled_step_refuses_what_it_would_index_unchecked():
    """The compiled calls index without bounds checks, so what they are handed is checked
    first: a type outside the instance (negative ones included) in a move or a decision
    order, and an observation buffer of another size, type or layout."""
    import pytest

    from envs.dsmd.decision import DecisionStep
    from envs.dsmd.errors import DSMDError, InstanceError
    from tests.conftest import random_instance

    inst = random_instance(3, n=6, m=5, k=2)
    state = CostState(inst)
    for m in (-1, inst.num_types):
        with pytest.raises(InstanceError, match="out of range"):
            state.move(m, 0)
    layout = ObservationLayout("channel", inst.num_types, inst.num_nodes, inst.num_topics)
    rng = np.random.default_rng(0)
    with pytest.raises(DSMDError, match="decision order"):
        DecisionStep(inst, layout, rng=rng, order=np.array([0, inst.num_types]))
    step = DecisionStep(inst, layout, rng=rng, order=[0, 1])
    with pytest.raises(DSMDError, match="decision order"):
        step.begin([2, -1])
    for bad in (np.zeros(layout.size + 1, np.float32), np.zeros(layout.size, np.float64),
                np.zeros(2 * layout.size, np.float32)[::2]):
        with pytest.raises(DSMDError, match="contiguous float32"):
            step.observe(bad)
    good = np.zeros(layout.size, np.float32)
    assert step.observe(good) is good
    np.testing.assert_array_equal(good, step.observe())
