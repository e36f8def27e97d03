"""Compiled inner loops of the cost model (SMART Eq. 1) and of the ``channel`` observation.

These are the only implementations of the loops they hold: :class:`~envs.dsmd.cost.CostState`
(the simulator, the evaluation, the policy server and the cached adapter all use it),
:class:`~envs.dsmd.observation.ObservationBuilder` and
:class:`~envs.dsmd.decision.DecisionStep` (one decision in two calls) call them, so every
path computes the same integers and the same float32 values. Each function works on plain
arrays (numba ``njit``, compiled on first use and cached on disk next to this file); the
arithmetic is the one the docstrings of ``cost.py`` state, in int64 bit/s, and the float
tests are the ones of :func:`envs.dsmd.cost.node_stats` (``b(n) * (1 / s(n)) > 1.0`` in
float64).

A type's destinations ``dest`` are sorted and unique (``DSMDInstance`` builds them so); a
topic's ``row`` is ``CostState.sub_count[t]``, the number of types on ``t`` with node ``n``
among their destinations.

Why compiled: one decision of the policy server is a few dozen small array operations, and
NumPy's fixed cost per call, not the arithmetic, would dominate the in-process decision time
(``bench/bench_serving.py`` measures it); each loop here visits |D(m)|, K+1 or N entries once.
"""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt
from numba import njit

__all__ = [
    "argmax_ties",
    "argmax_ties_rows",
    "as_scores",
    "build_state",
    "channel_costs",
    "channel_costs_many",
    "channel_observation",
    "channel_observation_rows",
    "controller_fits",
    "decide_next",
    "first_fit",
    "first_fit_in",
    "least_fitting",
    "max_ratio",
    "move_type",
    "nodes_fit",
    "observation_shared",
    "observe_next",
    "rpc_shift",
    "state_move",
    "state_violation",
    "topic_add",
    "topic_remove",
    "violation_of",
    "violations_if",
    "warm_up",
]

_LOG_RATE_SCALE = 12.0  # the observation's log10(1 + f) / 12 (envs.dsmd.observation)
#: indices of ``CostState``'s scalars in its int64 ``sc`` (``CostState.sc``): controller
#: bandwidth and CPU, total and necessary node traffic, messages sent, assigned types, RPC
#: types and the pending least controller bandwidth of the unassigned types
BW, CPU, TOT, NEC, SENT, ASG, RPCT, PEND = range(8)
_PW_BLOCK = 128  # NumPy's PW_BLOCKSIZE (its pairwise summation)


@njit(cache=True, nogil=True)
def topic_add(b: np.ndarray, row: np.ndarray, dest: np.ndarray, f: int, r_old: int,
              s_old: int, pend: np.ndarray, track: bool) -> int:
    """Put a type of rate ``f`` on topic ``t`` (rate ``r_old``, ``s_old`` subscribers before):
    every current subscriber receives ``f``; each destination not yet subscribed subscribes
    and receives the whole topic, ``r_old + f``. Updates ``b`` (node traffic), ``row`` and,
    with ``track``, the pending least costs ``pend``. Returns the number of new subscribers."""
    if s_old != 0 and f != 0:
        for n in range(b.shape[0]):
            if row[n] > 0:
                b[n] += f
    fresh = 0
    whole = r_old + f
    for i in range(dest.shape[0]):
        n = dest[i]
        if row[n] == 0:
            b[n] += whole
            fresh += 1
        row[n] += 1
        if track:
            pend[n] -= f
    return fresh


@njit(cache=True, nogil=True)
def topic_remove(b: np.ndarray, row: np.ndarray, dest: np.ndarray, f: int, r_old: int,
                 pend: np.ndarray, track: bool) -> int:
    """Take a type of rate ``f`` off topic ``t`` (rate ``r_old`` before): destinations left
    with no type on ``t`` unsubscribe and lose the whole topic, the remaining subscribers lose
    ``f``. Returns the number of nodes that unsubscribed."""
    gone = 0
    for i in range(dest.shape[0]):
        n = dest[i]
        row[n] -= 1
        if row[n] == 0:
            b[n] -= r_old
            gone += 1
        if track:
            pend[n] += f
    if f != 0:
        for n in range(b.shape[0]):
            if row[n] > 0:
                b[n] -= f
    return gone


@njit(cache=True, nogil=True)
def rpc_shift(b: np.ndarray, dest: np.ndarray, f: int, pend: np.ndarray, track: bool) -> None:
    """RPC adds ``f`` (or removes it, ``f < 0``) on each destination, nothing elsewhere."""
    for i in range(dest.shape[0]):
        n = dest[i]
        b[n] += f
        if track:
            pend[n] -= f


@njit(cache=True, nogil=True)
def _fresh(row: np.ndarray, dest: np.ndarray) -> int:
    """How many of ``dest`` a topic's ``row`` does not reach yet (its new subscribers)."""
    c = 0
    for i in range(dest.shape[0]):
        if row[dest[i]] == 0:
            c += 1
    return c


@njit(cache=True, nogil=True)
def _costs_into(delta: np.ndarray, fresh: np.ndarray, sub_count: np.ndarray, dest: np.ndarray,
                f: int, subscribers: np.ndarray, rate: np.ndarray) -> None:
    delta[0] = f * dest.shape[0]
    fresh[0] = 0
    for t in range(1, subscribers.shape[0]):
        c = _fresh(sub_count[t], dest) if subscribers[t] else dest.shape[0]
        fresh[t] = c
        delta[t] = f * subscribers[t] + (rate[t] + f) * c


@njit(cache=True, nogil=True)
def channel_costs(sub_count: np.ndarray, dest: np.ndarray, f: int,
                  subscribers: np.ndarray, rate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(increase of ``sum_n b(n)``, new subscribers) per channel for an unassigned type:
    RPC ``f |D|`` and 0; topic ``t``: ``f S_t + (R_t + f) |D \\ subscribers(t)|``."""
    k1 = subscribers.shape[0]
    delta = np.empty(k1, np.int64)
    fresh = np.empty(k1, np.int64)
    _costs_into(delta, fresh, sub_count, dest, f, subscribers, rate)
    return delta, fresh


@njit(cache=True, nogil=True)
def channel_costs_many(sub_count: np.ndarray, dest_ptr: np.ndarray, dest_idx: np.ndarray,
                       types: np.ndarray, rate_bps: np.ndarray, subscribers: np.ndarray,
                       rate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`channel_costs` of each of ``types`` from the same state, ``[len(types), K+1]``."""
    k1 = subscribers.shape[0]
    delta = np.empty((types.shape[0], k1), np.int64)
    fresh = np.empty((types.shape[0], k1), np.int64)
    for i in range(types.shape[0]):
        m = types[i]
        _costs_into(delta[i], fresh[i], sub_count, dest_idx[dest_ptr[m]:dest_ptr[m + 1]],
                    rate_bps[m], subscribers, rate)
    return delta, fresh


@njit(cache=True, nogil=True)
def _refresh_blocks(subscribers: np.ndarray, rate: np.ndarray, num_nodes: int,
                    seen: np.ndarray, blocks: np.ndarray) -> None:
    """The observation's type-independent blocks, ``blocks[0] = S_t / N`` and ``blocks[1] =
    min(log10(1 + R_t) / 12, 1)`` (float32), recomputed only where S_t or R_t differ from
    what they were computed from (``seen[0]``, ``seen[1]``; -1 at first): a decision moves
    one type, so one or two topics change between two observations."""
    scale = np.float32(1.0 / _LOG_RATE_SCALE)
    for t in range(subscribers.shape[0]):
        if seen[0, t] != subscribers[t]:
            blocks[0, t] = np.float64(subscribers[t]) / np.float64(num_nodes)
            seen[0, t] = subscribers[t]
        if seen[1, t] != rate[t]:
            x = np.float32(np.log10(1.0 + np.float64(rate[t]))) * scale
            blocks[1, t] = min(x, np.float32(1.0))
            seen[1, t] = rate[t]


@njit(cache=True, nogil=True)
def _observation_into(out: np.ndarray, sub_count: np.ndarray, dest: np.ndarray, f: int,
                      d: int, subscribers: np.ndarray, rate: np.ndarray, num_nodes: int,
                      undecided: bool, cb: float, cp: float, progress: float, peak: float,
                      bw_cap: int, cpu_cap: int, blocks: np.ndarray) -> None:
    # globals: available bandwidth and CPU, log-rate, |D|/N, progress, peak node load, RPC
    # bandwidth and CPU shares (0 for the type features when no type is being decided)
    out[0] = cb
    out[1] = cp
    if d > 0:
        out[2] = min(np.log10(1.0 + np.float64(f)) / _LOG_RATE_SCALE, 1.0)
        out[3] = np.float64(d) / np.float64(num_nodes)
        out[6] = min(np.float64(f * d) / np.float64(bw_cap), 1.0)
        out[7] = min(np.float64(d) / np.float64(cpu_cap), 1.0)
    else:
        out[2] = 0.0
        out[3] = 0.0
        out[6] = 0.0
        out[7] = 0.0
    out[4] = progress
    out[5] = peak
    k1 = subscribers.shape[0]
    base = 8
    for t in range(k1):
        if undecided:
            if t == 0:
                c = 0
                delta = f * d
            else:
                # a topic no node subscribes to gives every destination a new subscription
                c = _fresh(sub_count[t], dest) if subscribers[t] else d
                delta = f * subscribers[t] + (rate[t] + f) * c
            out[base + t] = np.float64(f * d) / np.float64(max(delta, 1))
            out[base + k1 + t] = np.float64(c) / np.float64(d)
        else:
            out[base + t] = 0.0
            out[base + k1 + t] = 0.0
        out[base + 2 * k1 + t] = blocks[0, t]
        out[base + 3 * k1 + t] = blocks[1, t]


@njit(cache=True, nogil=True)
def channel_observation(out: np.ndarray, sub_count: np.ndarray, dest: np.ndarray, f: int,
                        d: int, subscribers: np.ndarray, rate: np.ndarray, num_nodes: int,
                        undecided: bool, cb: float, cp: float, progress: float,
                        node_traffic: np.ndarray, inv_capacity: np.ndarray, bw_cap: int,
                        cpu_cap: int, seen: np.ndarray, blocks: np.ndarray) -> None:
    """The ``channel`` observation (:mod:`envs.dsmd.observation`) into the float32 ``out``:
    8 globals (``cb``, ``cp``, min(log10(1 + f) / 12, 1), |D| / N, ``progress``, the peak
    node load min(max_n b(n)/s(n), 1), min(f|D| / C_b, 1), min(|D| / C_p, 1)), then four
    blocks of K+1 values: ``efficiency`` f|D| / max(delta, 1), ``fresh`` new subscribers /
    |D| (both 0 when no type is being decided: ``undecided`` false), ``subscribers``
    S_t / N and ``load`` min(log10(1 + R_t) / 12, 1) (kept between calls in ``blocks``, an
    int64 ``seen[2, K+1]`` and float32 ``blocks[2, K+1]`` pair the caller holds; see
    :func:`_refresh_blocks`)."""
    peak = min(max_ratio(node_traffic, inv_capacity), 1.0)
    _refresh_blocks(subscribers, rate, num_nodes, seen, blocks)
    _observation_into(out, sub_count, dest, f, d, subscribers, rate, num_nodes, undecided,
                      cb, cp, progress, peak, bw_cap, cpu_cap, blocks)


@njit(cache=True, nogil=True)
def observation_shared(subscribers: np.ndarray, rate: np.ndarray, num_nodes: int,
                       node_traffic: np.ndarray, inv_capacity: np.ndarray, seen: np.ndarray,
                       blocks: np.ndarray) -> float:
    """What every ``channel`` observation of one state shares: brings ``blocks`` up to date
    (:func:`_refresh_blocks`) and returns the peak node load min(max_n b(n)/s(n), 1)."""
    _refresh_blocks(subscribers, rate, num_nodes, seen, blocks)
    return min(max_ratio(node_traffic, inv_capacity), 1.0)


@njit(cache=True, nogil=True)
def channel_observation_rows(out: np.ndarray, sub_count: np.ndarray, dest_ptr: np.ndarray,
                             dest_idx: np.ndarray, types: np.ndarray, rate_bps: np.ndarray,
                             subscribers: np.ndarray, rate: np.ndarray, num_nodes: int,
                             cb: float, cp: float, progress: float, peak: float, bw_cap: int,
                             cpu_cap: int, blocks: np.ndarray) -> None:
    """:func:`channel_observation` of each unassigned type of ``types`` into row ``i`` of
    the float32 ``out[len(types), size]``, all from the same state, given what they share
    (``peak`` and ``blocks`` from :func:`observation_shared`). It only reads its other
    arguments, so calls on disjoint ``out`` rows may run on several threads at once."""
    for i in range(types.shape[0]):
        m = types[i]
        dest = dest_idx[dest_ptr[m]:dest_ptr[m + 1]]
        _observation_into(out[i], sub_count, dest, rate_bps[m], dest.shape[0], subscribers,
                          rate, num_nodes, True, cb, cp, progress, peak, bw_cap, cpu_cap,
                          blocks)


@njit(cache=True, nogil=True)
def nodes_fit(b: np.ndarray, pend: np.ndarray, reserve: bool, inv: np.ndarray,
              row: np.ndarray, dest: np.ndarray, f: int, rpc: bool, r_t: int, s_t: int) -> bool:
    """The node half of ``CostState.fits``: every node whose traffic the move changes stays
    within s(n). ``reserve``: node traffic is counted with the pending least costs ``pend``
    (which already hold the moved type's own ``f`` on its destinations)."""
    own = 0 if reserve else f
    if rpc:  # each destination receives f
        return _dests_fit(b, pend, reserve, inv, dest, own, row, False)
    if f != 0 and s_t != 0:  # the topic's current subscribers receive f
        j = 0
        nd = dest.shape[0]
        for n in range(b.shape[0]):
            if row[n] > 0:
                x = b[n] + f
                if reserve:
                    while j < nd and dest[j] < n:
                        j += 1
                    if j < nd and dest[j] == n:  # f is in its pending cost already
                        continue
                    x += pend[n]
                if x * inv[n] > 1.0:
                    return False
    # new subscribers receive the whole topic
    return _dests_fit(b, pend, reserve, inv, dest, r_t + own, row, True)


@njit(cache=True, nogil=True)
def _dests_fit(b: np.ndarray, pend: np.ndarray, reserve: bool, inv: np.ndarray,
               dest: np.ndarray, add: int, row: np.ndarray, only_new: bool) -> bool:
    """Whether every destination (``only_new``: every one ``row`` does not reach yet) stays
    within s(n) once it receives ``add`` more."""
    for i in range(dest.shape[0]):
        n = dest[i]
        if only_new and row[n] != 0:
            continue
        x = b[n] + add
        if reserve:
            x += pend[n]
        if x * inv[n] > 1.0:
            return False
    return True


@njit(cache=True, nogil=True)
def _fits_reserved(c: int, b: np.ndarray, pend: np.ndarray, inv: np.ndarray,
                   sub_count: np.ndarray, dest: np.ndarray, f: int, topic_rate: np.ndarray,
                   topic_subscribers: np.ndarray, rpc_ok: bool, topic_ok: bool) -> bool:
    if c == 0:
        return rpc_ok and nodes_fit(b, pend, True, inv, sub_count[0], dest, f, True, 0, 0)
    return topic_ok and nodes_fit(b, pend, True, inv, sub_count[c], dest, f, False,
                                  topic_rate[c], topic_subscribers[c])


@njit(cache=True, nogil=True)
def first_fit(scores: np.ndarray, skip: int, b: np.ndarray, pend: np.ndarray, inv: np.ndarray,
              sub_count: np.ndarray, dest: np.ndarray, f: int, topic_rate: np.ndarray,
              topic_subscribers: np.ndarray, rpc_ok: bool, topic_ok: bool) -> int:
    """The highest-scoring channel other than ``skip`` (equal scores: lower index first) on
    which the type fits with the reserve (:func:`nodes_fit`; ``rpc_ok`` / ``topic_ok``: the
    controller's half of the test for RPC / for any topic), or -1 if none does."""
    k1 = scores.shape[0]
    tried = np.zeros(k1, np.bool_)
    if 0 <= skip < k1:
        tried[skip] = True
    # the first candidates one by one (a scan each: the first or second usually fits), then
    # the rest in a stable descending sort (NaN last in both)
    for i in range(k1):
        if i < 4:
            c: int = -1
            for t in range(k1):
                if not tried[t] and (c < 0 or scores[t] > scores[c]
                                     or (scores[c] != scores[c] and scores[t] == scores[t])):
                    c = t
            if c < 0:
                return -1
            tried[c] = True
            if _fits_reserved(c, b, pend, inv, sub_count, dest, f, topic_rate,
                              topic_subscribers, rpc_ok, topic_ok):
                return c
        else:
            order = np.argsort(-scores, kind="mergesort")
            for j in range(k1):
                c = order[j]
                if not tried[c] and _fits_reserved(c, b, pend, inv, sub_count, dest, f,
                                                   topic_rate, topic_subscribers, rpc_ok,
                                                   topic_ok):
                    return c
            return -1
    return -1


@njit(cache=True, nogil=True)
def first_fit_in(order: np.ndarray, b: np.ndarray, inv: np.ndarray, sub_count: np.ndarray,
                 dest: np.ndarray, f: int, topic_rate: np.ndarray,
                 topic_subscribers: np.ndarray, rpc_ok: bool, topic_ok: bool) -> int:
    """The first channel of ``order`` on which the type fits without the reserve
    (:func:`nodes_fit`; ``rpc_ok`` / ``topic_ok``: the controller's half of the test for RPC
    / for any topic), or -1 if none does. A topic's current subscribers are checked through
    the nodes that ``f`` more would put over s(n) (found once, by the same float test), not
    by a scan of every node per topic."""
    tight = np.empty(b.shape[0], np.int64)
    nt = 0
    if f != 0:
        for n in range(b.shape[0]):
            x = b[n] + f
            if x * inv[n] > 1.0:
                tight[nt] = n
                nt += 1
    for i in range(order.shape[0]):
        c = order[i]
        if c == 0:
            if rpc_ok and nodes_fit(b, b, False, inv, sub_count[0], dest, f, True, 0, 0):
                return 0
        elif topic_ok:
            row = sub_count[c]
            ok = True
            if f != 0 and topic_subscribers[c] != 0:
                for j in range(nt):
                    if row[tight[j]] > 0:
                        ok = False
                        break
            if ok and _dests_fit(b, b, False, inv, dest, topic_rate[c] + f, row, True):
                return int(c)
    return -1


@njit(cache=True, nogil=True)
def _block_sum(a: np.ndarray, lo: int, n: int) -> float:
    """NumPy's pairwise sum of ``a[lo:lo + n]`` for ``n <= 128``: sequential below 8,
    else eight accumulators, combined as ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)),
    then the rest."""
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    stop = n - n % 8
    while i < stop:
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return float(res)


@njit(cache=True, nogil=True)
def _pairwise_sum(a: np.ndarray, lo: int, n: int) -> float:
    """``a[lo:lo + n].sum()`` in NumPy's pairwise order: blocks of at most 128
    (:func:`_block_sum`), above that the two halves (the first a multiple of 8) summed
    apart and added. An explicit stack, not recursion (numba's on-disk cache does not
    reload recursive functions safely)."""
    if n <= _PW_BLOCK:
        return _block_sum(a, lo, n)
    s_lo = np.empty(96, np.int64)
    s_n = np.empty(96, np.int64)
    s_join = np.empty(96, np.bool_)
    res = np.empty(64, np.float64)
    top, rtop = 1, 0
    s_lo[0], s_n[0], s_join[0] = lo, n, False
    while top > 0:
        top -= 1
        lo_i, n_i, join = s_lo[top], s_n[top], s_join[top]
        if join:  # both halves done: left below right
            res[rtop - 2] = res[rtop - 2] + res[rtop - 1]
            rtop -= 1
        elif n_i <= _PW_BLOCK:
            res[rtop] = _block_sum(a, lo_i, n_i)
            rtop += 1
        else:
            n2 = n_i // 2
            n2 -= n2 % 8
            s_lo[top], s_n[top], s_join[top] = lo_i, n_i, True
            s_lo[top + 1], s_n[top + 1], s_join[top + 1] = lo_i + n2, n_i - n2, False
            s_lo[top + 2], s_n[top + 2], s_join[top + 2] = lo_i, n2, False
            top += 3
    return float(res[0])


@njit(cache=True, nogil=True)
def _array_sum(a: np.ndarray) -> float:
    """``float(a.sum())`` as NumPy computes it for a contiguous float64 array: the pairwise
    sum of every element, added to the identity 0."""
    return 0.0 + _pairwise_sum(a, 0, a.shape[0])


@njit(cache=True, nogil=True)
def state_violation(b: np.ndarray, cap: np.ndarray, bw: int, cpu: int, bw_cap: int, cpu_cap: int,
              tmp: np.ndarray) -> float:
    """:func:`envs.dsmd.cost.violation`: ``[bw/C_b - 1]^+ + [sends/C_p - 1]^+ +
    sum_n [b(n)/s(n) - 1]^+`` (``tmp``: float64 scratch of N entries)."""
    v = max(bw / bw_cap - 1.0, 0.0)
    v += max(cpu / cpu_cap - 1.0, 0.0)
    over = False
    for n in range(b.shape[0]):
        if b[n] > cap[n]:
            over = True
            break
    if over:
        for n in range(b.shape[0]):
            x = b[n] - cap[n]
            tmp[n] = (x if x > 0 else 0) / cap[n]
        v += _array_sum(tmp)
    return v


@njit(cache=True, nogil=True)
def _count_rpc(sc: np.ndarray, f: int, d: int, msgs: int, sign: int) -> None:
    """The scalars an RPC type adds (``sign`` 1) or takes back (-1): f|D| of controller
    bandwidth and of node traffic, |D| sends, |D| copies of its messages, one RPC type."""
    sc[BW] += sign * f * d
    sc[CPU] += sign * d
    sc[TOT] += sign * f * d
    sc[SENT] += sign * msgs * d
    sc[RPCT] += sign


@njit(cache=True, nogil=True)
def move_type(m: int, c: int, ch: np.ndarray, b: np.ndarray, trate: np.ndarray,
              tsubs: np.ndarray, ttypes: np.ndarray, sub: np.ndarray, sc: np.ndarray,
              dest_ptr: np.ndarray, dest_idx: np.ndarray, rate: np.ndarray, fan: np.ndarray,
              msgs: np.ndarray, pend: np.ndarray, track: bool) -> None:
    """``CostState.move(m, c)``: type ``m`` from its channel to ``c`` (0 = RPC, 1..K = topic,
    -1 = unassigned) on the state's arrays and its scalars ``sc`` (indices ``BW`` ..
    ``PEND``). With ``track``, the pending least costs (``pend`` per node and ``sc[PEND]``)
    follow: an unassigned type counts f(m) on each destination and on the controller."""
    old = ch[m]
    if old == c:
        return
    f, d = rate[m], fan[m]
    dest = dest_idx[dest_ptr[m]:dest_ptr[m + 1]]
    if old != -1:
        if old == 0:
            rpc_shift(b, dest, -f, pend, track)
            _count_rpc(sc, f, d, msgs[m], -1)
        else:  # leaving subscribers lose the whole topic, the remaining ones f
            r_old, s_old = trate[old], tsubs[old]
            gone = topic_remove(b, sub[old], dest, f, r_old, pend, track)
            trate[old] = r_old - f
            tsubs[old] = s_old - gone
            ttypes[old] -= 1
            sc[TOT] -= f * (s_old - gone) + r_old * gone
            sc[BW] -= f
            sc[CPU] -= 1
            sc[SENT] -= msgs[m]
        sc[NEC] -= f * d
        sc[ASG] -= 1
        if track:
            sc[PEND] += f
        ch[m] = -1
    if c != -1:
        if c == 0:
            rpc_shift(b, dest, f, pend, track)
            _count_rpc(sc, f, d, msgs[m], 1)
        else:  # current subscribers get f, new subscribers the whole topic
            r_old, s_old = trate[c], tsubs[c]
            fresh = topic_add(b, sub[c], dest, f, r_old, s_old, pend, track)
            trate[c] = r_old + f
            tsubs[c] = s_old + fresh
            ttypes[c] += 1
            sc[TOT] += f * s_old + (r_old + f) * fresh
            sc[BW] += f
            sc[CPU] += 1
            sc[SENT] += msgs[m]
        sc[NEC] += f * d
        sc[ASG] += 1
        if track:
            sc[PEND] -= f
        ch[m] = c


@njit(cache=True, nogil=True)
def state_move(m: int, c: int, st: tuple) -> None:
    """:func:`move_type` on the state ``st`` (``CostState.kernel_arrays``); the pending least
    costs are not tracked (a what-if that moves back leaves them right)."""
    ch, b, trate, tsubs, ttypes, sub, sc, dest_ptr, dest_idx, rate, fan, msgs = st[:12]
    move_type(m, c, ch, b, trate, tsubs, ttypes, sub, sc, dest_ptr, dest_idx, rate, fan, msgs,
              b, False)


@njit(cache=True, nogil=True)
def controller_fits(m: int, rpc: bool, reserve: bool, sc: np.ndarray, rate: np.ndarray,
                    fan: np.ndarray, bw_cap: int, cpu_cap: int, num_types: int) -> bool:
    """The controller's half of ``CostState.fits``: unassigned ``m`` on RPC (``rpc``) or a
    topic keeps bandwidth and CPU within C_b and C_p; with ``reserve``, every other
    unassigned type counted at one publish of its rate and one send (the pending least
    costs must be tracked)."""
    f = rate[m]
    if rpc:
        bw, cpu = f * fan[m], fan[m]
    else:
        bw, cpu = f, 1
    if reserve:
        bw += sc[PEND] - f
        cpu += num_types - sc[ASG] - 1
    return bool(sc[BW] + bw <= bw_cap and sc[CPU] + cpu <= cpu_cap)


@njit(cache=True, nogil=True)
def observe_next(m: int, out: np.ndarray, ch: np.ndarray, b: np.ndarray, trate: np.ndarray,
                 tsubs: np.ndarray, ttypes: np.ndarray, sub: np.ndarray, sc: np.ndarray,
                 dest_ptr: np.ndarray, dest_idx: np.ndarray, rate: np.ndarray,
                 fan: np.ndarray, msgs: np.ndarray, pend: np.ndarray, track: bool,
                 inv: np.ndarray, bw_cap: int, cpu_cap: int, num_types: int,
                 progress: float, seen: np.ndarray, blocks: np.ndarray) -> bool:
    """The first half of one decision (``DecisionStep.observe``) in one call: type ``m``
    (-1: none, after the last one) is taken off its channel if it is on one
    (:func:`move_type`), then its ``channel`` observation is written into ``out``
    (:func:`channel_observation`) with the controller's available bandwidth and CPU
    ``max(1 - x / cap, -1)`` and ``progress`` (negative: the share of decided types,
    assigned / ``num_types``). Returns whether ``m`` was moved."""
    moved = False
    if m >= 0 and ch[m] != -1:
        move_type(m, -1, ch, b, trate, tsubs, ttypes, sub, sc, dest_ptr, dest_idx, rate, fan,
                  msgs, pend, track)
        moved = True
    cb = max(1.0 - sc[BW] / bw_cap, -1.0)
    cp = max(1.0 - sc[CPU] / cpu_cap, -1.0)
    if progress < 0:
        progress = sc[ASG] / max(num_types, 1)
    if m >= 0:
        dest = dest_idx[dest_ptr[m]:dest_ptr[m + 1]]
        f, d = rate[m], fan[m]
    else:
        dest = dest_idx[0:0]
        f, d = 0, 0
    channel_observation(out, sub, dest, f, d, tsubs, trate, b.shape[0], m >= 0, cb, cp,
                        progress, b, inv, bw_cap, cpu_cap, seen, blocks)
    return moved


@njit(cache=True, nogil=True)
def decide_next(m: int, scores: np.ndarray, best: int, feasible: bool, ch: np.ndarray,
                b: np.ndarray, trate: np.ndarray, tsubs: np.ndarray, ttypes: np.ndarray,
                sub: np.ndarray, sc: np.ndarray, dest_ptr: np.ndarray, dest_idx: np.ndarray,
                rate: np.ndarray, fan: np.ndarray, msgs: np.ndarray, pend: np.ndarray,
                track: bool, inv: np.ndarray, bw_cap: int, cpu_cap: int,
                num_types: int) -> int:
    """The second half of one decision (``DecisionStep.apply``) in one call: the channel of
    unassigned ``m`` from its ``scores`` (:func:`envs.dsmd.decoding.decode`), then ``m`` is
    moved there (:func:`move_type`); returns the channel. ``best``: the argmax, or -1 to
    take it here (:func:`argmax_ties`), when it is unique; if several channels tie, nothing
    is moved and ``-2 - count`` is returned (the caller draws among them with its RNG and
    calls again with that ``best``). ``feasible``: the safety layer (``CostState.fits`` with
    the reserve, else :func:`first_fit`; the pending least costs must be tracked)."""
    if best < 0:
        best, count = argmax_ties(scores)
        if count > 1:
            return -2 - count
    c = best
    if feasible:
        dest = dest_idx[dest_ptr[m]:dest_ptr[m + 1]]
        f = rate[m]
        rpc_ok = controller_fits(m, True, True, sc, rate, fan, bw_cap, cpu_cap, num_types)
        topic_ok = controller_fits(m, False, True, sc, rate, fan, bw_cap, cpu_cap, num_types)
        if not _fits_reserved(best, b, pend, inv, sub, dest, f, trate, tsubs, rpc_ok,
                              topic_ok) and (rpc_ok or topic_ok):
            alt = first_fit(scores, best, b, pend, inv, sub, dest, f, trate, tsubs, rpc_ok,
                            topic_ok)
            if alt >= 0:
                c = alt
    move_type(m, c, ch, b, trate, tsubs, ttypes, sub, sc, dest_ptr, dest_idx, rate, fan, msgs,
              pend, track)
    return c


@njit(cache=True, nogil=True)
def violation_of(st: tuple, tmp: np.ndarray) -> float:
    """:func:`state_violation` of the state ``st``."""
    sc = st[6]
    return state_violation(st[1], st[12], sc[BW], sc[CPU], st[13], st[14], tmp)


@njit(cache=True, nogil=True)
def violations_if(m: int, channels: np.ndarray, st: tuple) -> np.ndarray:
    """:func:`state_violation` with unassigned ``m`` on each of ``channels`` in turn (the
    state ``st`` is left as it was)."""
    out = np.empty(channels.shape[0], np.float64)
    tmp = np.empty(st[1].shape[0], np.float64)
    for i in range(channels.shape[0]):
        state_move(m, channels[i], st)
        out[i] = violation_of(st, tmp)
        state_move(m, -1, st)
    return out


@njit(cache=True, nogil=True)
def build_state(st: tuple) -> None:
    """Eq. 1's quantities of the whole assignment ``ch`` of ``st`` into its zeroed arrays
    and ``sc`` (``CostState.assign_all``): RPC types on their destinations, topic rates and
    the subscription counts, then every subscriber receives its topic's whole rate."""
    ch, b, trate, tsubs, ttypes, sub, sc, dest_ptr, dest_idx, rate, fan, msgs = st[:12]
    for m in range(ch.shape[0]):
        c = ch[m]
        if c < 0:
            continue
        f, d = rate[m], fan[m]
        if c == 0:
            for i in range(dest_ptr[m], dest_ptr[m + 1]):
                b[dest_idx[i]] += f
            _count_rpc(sc, f, d, msgs[m], 1)
        else:
            row = sub[c]
            for i in range(dest_ptr[m], dest_ptr[m + 1]):
                row[dest_idx[i]] += 1
            trate[c] += f
            ttypes[c] += 1
            sc[BW] += f
            sc[CPU] += 1
            sc[SENT] += msgs[m]
        sc[NEC] += f * d
        sc[ASG] += 1
    for t in range(1, trate.shape[0]):
        if ttypes[t] == 0:
            continue
        row = sub[t]
        r = trate[t]
        s = 0
        for n in range(b.shape[0]):
            if row[n] > 0:
                b[n] += r
                s += 1
        tsubs[t] = s
        sc[TOT] += r * s


@njit(cache=True, nogil=True)
def least_fitting(m: int, scores: np.ndarray, fallback: int, inv: np.ndarray,
                  st: tuple) -> int:
    """The channel of least score (equal scores: lower channel first) on which unassigned
    ``m`` fits (``CostState.fits``, no reserve); if none does, the least (violation,
    score) among RPC and the ``fallback`` best-scoring topics (earlier first on equal
    pairs). The state ``st`` is left as it was."""
    b, trate, tsubs, sub, sc, dest_ptr, dest_idx = st[1], st[2], st[3], st[5], st[6], st[7], st[8]
    rate, fan, bw_cap, cpu_cap = st[9], st[10], st[13], st[14]
    f, d = rate[m], fan[m]
    dest = dest_idx[dest_ptr[m]:dest_ptr[m + 1]]
    rpc_ok = sc[BW] + f * d <= bw_cap and sc[CPU] + d <= cpu_cap
    topic_ok = sc[BW] + f <= bw_cap and sc[CPU] + 1 <= cpu_cap
    order = np.argsort(scores, kind="mergesort")
    if rpc_ok or topic_ok:
        c = first_fit_in(order, b, inv, sub, dest, f, trate, tsubs, rpc_ok, topic_ok)
        if c >= 0:
            return c
    tmp = np.empty(b.shape[0], np.float64)
    best = 0
    state_move(m, 0, st)
    best_v = violation_of(st, tmp)
    state_move(m, -1, st)
    taken = 0
    for i in range(order.shape[0]):
        c = order[i]
        if c == 0:
            continue
        if taken == fallback:
            break
        taken += 1
        state_move(m, c, st)
        v = violation_of(st, tmp)
        state_move(m, -1, st)
        if v < best_v or (v == best_v and scores[c] < scores[best]):
            best, best_v = c, v
    return best


@njit(cache=True, nogil=True)
def max_ratio(b: np.ndarray, inv: np.ndarray) -> float:
    """max_n b(n) / s(n) (0 for no nodes)."""
    top = 0.0
    for n in range(b.shape[0]):
        r = b[n] * inv[n]
        if n == 0 or r > top:
            top = r
    return top


@njit(cache=True, nogil=True)
def argmax_ties(a: np.ndarray) -> tuple[int, int]:
    """(first index of the maximum, how many entries equal it) of a 1-D float array; NaN
    entries are passed over ((0, 0) if every entry is NaN)."""
    best = -1
    for i in range(a.shape[0]):
        x = a[i]
        if x == x and (best < 0 or x > a[best]):  # noqa: PLR0124 (x == x is False for NaN)
            best = i
    if best < 0:
        return 0, 0
    top = a[best]
    count = 0
    for i in range(a.shape[0]):
        if a[i] == top:
            count += 1
    return best, count


@njit(cache=True, nogil=True)
def argmax_ties_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`argmax_ties` of each row of a 2-D float array: (first indices of the row
    maxima, how many entries of each row equal its maximum)."""
    best = np.zeros(a.shape[0], np.int64)
    count = np.zeros(a.shape[0], np.int64)
    for r in range(a.shape[0]):
        best[r], count[r] = argmax_ties(a[r])
    return best, count


_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def as_scores(a: npt.ArrayLike) -> np.ndarray:
    """Channel scores as a contiguous 1-D float32/float64 array (what the kernels take)."""
    a = np.asarray(a).reshape(-1)
    if a.dtype not in _FLOATS or not a.flags.c_contiguous:
        a = np.ascontiguousarray(a, dtype=np.float64)
    return a


@functools.cache
def warm_up() -> None:
    """Compile (or load from the on-disk cache) every kernel with the argument types the
    simulator uses, so that the first real call does not pay for it (the policy server calls
    this while starting, the controller adapter when it is made). Loading from the cache is
    much faster than compiling on a fresh install; later calls return at once."""
    i64 = np.zeros(3, np.int64)
    row = np.zeros((2, 3), np.int32)
    dest = np.array([0, 2], np.int64)
    inv = np.ones(3, np.float64)
    out = np.zeros((1, 16), np.float32)
    topic_add(i64.copy(), row[1], dest, 1, 0, 0, i64.copy(), True)
    topic_remove(i64.copy(), row[1].copy() + 1, dest, 1, 1, i64.copy(), False)
    rpc_shift(i64.copy(), dest, 1, i64.copy(), True)
    s, r = np.zeros(2, np.int64), np.zeros(2, np.int64)
    channel_costs(row, dest, 1, s, r)
    channel_costs_many(row, np.array([0, 2], np.int64), dest, np.array([0], np.int64),
                       np.ones(1, np.int64), s, r)
    seen, blocks = np.full((2, 2), -1, np.int64), np.zeros((2, 2), np.float32)
    channel_observation(out[0], row, dest, 1, 2, s, r, 3, True, 0.5, 0.5, 0.0, i64, inv, 10, 10,
                        seen, blocks)
    peak = observation_shared(s, r, 3, i64, inv, seen, blocks)
    channel_observation_rows(out[0:1], row, np.array([0, 2], np.int64), dest,
                             np.array([0], np.int64)[0:1], np.ones(1, np.int64), s, r, 3, 0.5,
                             0.5, 0.0, peak, 10, 10, blocks)
    nodes_fit(i64, i64, True, inv, row[1], dest, 1, False, 0, 0)
    for sc in (np.zeros(2, np.float32), np.zeros(2, np.float64)):
        first_fit(sc, 0, i64, i64, inv, row, dest, 1, s, r, True, True)
    first_fit_in(np.array([1, 0], np.int64), i64, inv, row, dest, 1, s, r, True, True)
    # a two-type state: build it, then a what-if on each channel (state_move, the violation)
    one = np.ones(2, np.int64)
    st = (np.array([0, -1], np.int64), np.zeros(3, np.int64), np.zeros(2, np.int64),
          np.zeros(2, np.int64), np.zeros(2, np.int64), np.zeros((2, 3), np.int32),
          np.zeros(7, np.int64), np.array([0, 2, 3], np.int64), np.array([0, 2, 1], np.int64),
          one, np.array([2, 1], np.int64), one, np.full(3, 10, np.int64), 10, 10)
    build_state(st)
    # the decision step's calls, with the arguments CostState.moving_arrays() gives
    moving = (*st[:6], np.zeros(8, np.int64), *st[7:12], np.zeros(3, np.int64), True, inv,
              10, 10, 2)
    move_type(1, 1, *moving[:14])
    controller_fits(1, True, True, moving[6], one, moving[10], 10, 10, 2)
    observe_next(1, out[0], *moving, -1.0, seen, blocks)
    for sc in (np.zeros(2, np.float32), np.zeros(2, np.float64)):
        decide_next(1, sc, -1, True, *moving)
    violations_if(1, np.array([0, 1], np.int64), st)
    least_fitting(1, np.zeros(2), 1, inv, st)
    max_ratio(i64, inv)
    argmax_ties(np.zeros(3, np.float32))
    argmax_ties(np.zeros(3, np.float64))
    argmax_ties_rows(np.zeros((2, 3), np.float32))
    argmax_ties_rows(np.zeros((2, 3), np.float64))
