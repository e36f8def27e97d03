"""The shared decoder (envs/dsmd/decoding.py): the feasibility test and the safety layer."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from envs.dsmd.cost import CostState
from envs.dsmd.decoding import decode, decode_action
from envs.dsmd.env import DSMDEnv
from envs.dsmd.errors import DSMDError
from tests.conftest import instances


def _bound_ok(state: CostState) -> bool:
    """The reserve's invariant, from scratch: the state plus the least the unassigned types
    will cost is within every limit."""
    inst = state.inst
    free = state.channel < 0
    pending = np.zeros(inst.num_nodes, np.int64)
    for m in np.flatnonzero(free):
        d = inst.dest_idx[inst.dest_ptr[m]:inst.dest_ptr[m + 1]]
        pending[d] += inst.rate_bps[m]
    return bool(state.controller_bw + inst.rate_bps[free].sum() <= inst.controller_bw_bps
                and state.controller_cpu + free.sum() <= inst.controller_cpu
                and ((state.node_traffic + pending) * inst.inv_capacity <= 1.0).all())


@given(inst=instances(tight=True), seed=st.integers(0, 2**16), reserve=st.booleans())
def test_fits_is_exactly_the_feasibility_of_the_move(inst, seed, reserve):
    """From a state that fits, ``fits(m, c)`` says whether the state after the move is
    feasible (Eq. 1: controller bandwidth and CPU, every node's bandwidth), and with
    ``reserve`` whether it still is once every unassigned type is counted at its least."""
    rng = np.random.default_rng(seed)
    state = CostState(inst)
    check = _bound_ok if reserve else (lambda s: s.metrics().feasible)
    if not check(state):
        return
    for row in rng.permutation(inst.num_types):
        m = int(row)
        for c in range(inst.num_topics + 1):
            state.move(m, c)
            ok = check(state)
            state.move(m, -1)
            assert state.fits(m, c, reserve) == ok, (m, c)
        ok = [c for c in range(inst.num_topics + 1) if state.fits(m, c, reserve)]
        if not state.topic_room(m, reserve):  # the decoder's shortcut: then nothing fits
            assert not ok
        if not ok:
            return
        state.move(m, int(rng.choice(ok)))


@given(inst=instances(tight=True), seed=st.integers(0, 2**16))
def test_feasible_decoding_picks_the_best_fitting_channel(inst, seed):
    rng = np.random.default_rng(seed)
    state = CostState(inst)
    for m in range(inst.num_types):
        scores = rng.uniform(-1, 1, inst.num_topics + 1).astype(np.float32)
        r1, r2 = np.random.default_rng(seed), np.random.default_rng(seed)
        c = decode(scores, state, m, r1, "feasible")
        best = decode_action(scores, r2)
        assert r1.bit_generator.state == r2.bit_generator.state  # same RNG use as argmax
        fitting = [k for k in range(inst.num_topics + 1) if state.fits(m, k, True)]
        if fitting:
            assert c in fitting and scores[c] == max(scores[k] for k in fitting)
        else:
            assert c == best  # nothing fits: the plain argmax
        if state.fits(m, best, True):
            assert c == best
        assert decode(scores, state, m, np.random.default_rng(seed), "argmax") == best
        state.move(m, c)


def test_safety_layer_removes_violations_of_a_random_actor(tiny_problems):
    """The same random scores, decoded both ways, on every tiny window."""
    def violations(decoding):
        env = DSMDEnv(problems=tiny_problems, decoding=decoding,
                      windows=sorted(w for ws in tiny_problems.windows.values() for w in ws))
        rng = np.random.default_rng(0)
        bad = 0
        for w in env.windows:
            env.reset(seed=0, options={"window": w})
            done = False
            while not done:
                _, _, done, _, info = env.step(rng.uniform(-1, 1, env.action_space.shape))
            bad += not info["feasible"]
        return bad, len(env.windows)

    plain, n = violations("argmax")
    safe, _ = violations("feasible")
    assert plain > 0 and safe < plain, (plain, safe, n)


def test_unknown_decoding_is_refused(tiny_problems):
    with pytest.raises(DSMDError, match="decoding must be one of"):
        DSMDEnv(problems=tiny_problems, decoding="softmax")
