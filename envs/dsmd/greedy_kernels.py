"""Compiled loops of the greedy + local search planner (:mod:`envs.dsmd.greedy`).

The planner's steps 2-4 (free moves, the lazy greedy relief of the controller, the local
search passes) move one type at a time and read Eq. 1's quantities after each move; these
functions run them on the arrays of a :class:`~envs.dsmd.cost.CostState`
(``CostState.kernel_arrays``) with the cost model's compiled move and violation
(:func:`envs.dsmd.kernels.state_move`, :func:`envs.dsmd.kernels.state_violation`), so they
compute the integers and floats the Python state does.

Candidate topics are the ``candidates`` topics of least added node traffic, equal
additions in ascending topic order (:func:`_best_topics`): a defined order, which
``np.argpartition`` does not give.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .kernels import BW, CPU, TOT, state_move, violation_of

__all__ = ["greedy_construct", "lazy_switch", "local_search_pass"]


@njit(cache=True, nogil=True)
def _move(m: int, c: int, sub_t: np.ndarray, st: tuple) -> None:
    """:func:`envs.dsmd.kernels.state_move` on the state ``st``
    (``CostState.kernel_arrays``), keeping ``sub_t`` (``sub_count`` transposed, node-major)
    in step."""
    ch, dest_ptr, dest_idx = st[0], st[7], st[8]
    old = ch[m]
    if old == c:
        return
    state_move(m, c, st)
    for i in range(dest_ptr[m], dest_ptr[m + 1]):
        n = dest_idx[i]
        if old > 0:
            sub_t[n, old] -= 1
        if c > 0:
            sub_t[n, c] += 1


@njit(cache=True, nogil=True)
def _best_topics(m: int, k: int, sub_t: np.ndarray, st: tuple, covered: np.ndarray,
                 top: np.ndarray, top_delta: np.ndarray) -> int:
    """The ``k`` topics (1..K) of least added node traffic for unassigned ``m``, ascending
    (equal additions: lower topic first), into ``top`` / ``top_delta``; returns how many
    (``min(k, K)``). The addition is ``CostState.channel_costs``'s; the destinations a topic
    reaches already are counted from the node-major ``sub_t`` (``covered``: int64 scratch
    of K+1 zeros, left zero)."""
    trate, tsubs, dest_ptr, dest_idx, rate = st[2], st[3], st[7], st[8], st[9]
    lo, hi = dest_ptr[m], dest_ptr[m + 1]
    f, d = rate[m], hi - lo
    k1 = tsubs.shape[0]
    for i in range(lo, hi):
        row = sub_t[dest_idx[i]]
        for t in range(1, k1):
            if row[t] > 0:
                covered[t] += 1
    got = 0
    for t in range(1, k1):
        fresh = d - covered[t]
        covered[t] = 0
        delta = f * tsubs[t] + (trate[t] + f) * fresh
        if got < k:
            j = got
            got += 1
        elif delta < top_delta[k - 1]:
            j = k - 1  # the last entry drops out
        else:
            continue
        while j > 0 and top_delta[j - 1] > delta:  # after every entry <= delta: stable
            top[j] = top[j - 1]
            top_delta[j] = top_delta[j - 1]
            j -= 1
        top[j] = t
        top_delta[j] = delta
    return got


@njit(cache=True, nogil=True)
def _node_peak_if(m: int, c: int, st: tuple) -> float:
    """``CostState.node_peak_if``: max_n b(n)/s(n) over the nodes whose traffic changes if
    unassigned ``m`` goes to ``c``."""
    b, trate, sub, dest_ptr, dest_idx, rate, cap = st[1], st[2], st[5], st[7], st[8], st[9], st[12]
    dest = dest_idx[dest_ptr[m]:dest_ptr[m + 1]]
    f = rate[m]
    peak = 0.0
    first = True
    if c == 0:
        for i in range(dest.shape[0]):
            n = dest[i]
            x = (b[n] + f) / cap[n]
            if first or x > peak:
                peak, first = x, False
        return peak
    row = sub[c]
    for n in range(b.shape[0]):
        if row[n] > 0:
            x = (b[n] + f) / cap[n]
            if first or x > peak:
                peak, first = x, False
    whole = trate[c] + f
    for i in range(dest.shape[0]):
        n = dest[i]
        if row[n] == 0:
            x = (b[n] + whole) / cap[n]
            if first or x > peak:
                peak, first = x, False
    return peak


@njit(cache=True, nogil=True)
def _heap_less(s: np.ndarray, r: np.ndarray, i: int, j: int) -> bool:
    return bool(s[i] < s[j] or (s[i] == s[j] and r[i] < r[j]))


@njit(cache=True, nogil=True)
def _heap_push(s: np.ndarray, r: np.ndarray, size: int, score: float, m: int) -> int:
    i = size
    s[i], r[i] = score, m
    while i > 0:
        p = (i - 1) // 2
        if not _heap_less(s, r, i, p):
            break
        s[i], s[p] = s[p], s[i]
        r[i], r[p] = r[p], r[i]
        i = p
    return size + 1


@njit(cache=True, nogil=True)
def _heap_pop(s: np.ndarray, r: np.ndarray, size: int) -> int:
    """Remove the least (score, row) entry (read it from ``s[0], r[0]`` before); returns
    the new size."""
    size -= 1
    s[0], r[0] = s[size], r[size]
    i = 0
    while True:
        a, z = 2 * i + 1, 2 * i + 2
        best = i
        if a < size and _heap_less(s, r, a, best):
            best = a
        if z < size and _heap_less(s, r, z, best):
            best = z
        if best == i:
            break
        s[i], s[best] = s[best], s[i]
        r[i], r[best] = r[best], r[i]
        i = best
    return size


@njit(cache=True, nogil=True)
def _controller_over(st: tuple) -> tuple[float, float]:
    """([bw / C_b - 1]^+, [sends / C_p - 1]^+) of the state."""
    sc, bw_cap, cpu_cap = st[6], st[13], st[14]
    return max(sc[BW] / bw_cap - 1.0, 0.0), max(sc[CPU] / cpu_cap - 1.0, 0.0)


@njit(cache=True, nogil=True)
def greedy_construct(free_order: np.ndarray, multicast: np.ndarray, relief_bw: np.ndarray,
                     relief_cpu: np.ndarray, k: int, sub_t: np.ndarray, st: tuple) -> int:
    """Steps 2 and 3 of :class:`envs.dsmd.greedy.GreedyLocalSearch` from the all-RPC state
    ``st`` (``CostState.kernel_arrays``): free moves (``free_order``: the multicast rows,
    largest relief first), then, while C_b or C_p is exceeded, the lazy greedy over a heap
    of (added redundancy per unit of relief, row), equal scores in row order. Returns the
    number of moves."""
    ch, rate, fan = st[0], st[9], st[10]
    top = np.empty(k, np.int64)
    top_delta = np.empty(k, np.int64)
    covered = np.zeros(st[3].shape[0], np.int64)
    moves = 0
    for i in range(free_order.shape[0]):
        m = free_order[i]
        _move(m, -1, sub_t, st)
        _best_topics(m, k, sub_t, st, covered, top, top_delta)
        if top_delta[0] == rate[m] * fan[m]:  # zero redundancy
            _move(m, top[0], sub_t, st)
            moves += 1
        else:
            _move(m, 0, sub_t, st)
    bw_over, cpu_over = _controller_over(st)
    if not (bw_over > 0 or cpu_over > 0):
        return moves
    hs = np.empty(multicast.shape[0] + 1, np.float64)
    hr = np.empty(multicast.shape[0] + 1, np.int64)
    size = 0
    for i in range(multicast.shape[0]):
        if ch[multicast[i]] == 0:
            size = _heap_push(hs, hr, size, 0.0, multicast[i])
    while size > 0 and (bw_over > 0 or cpu_over > 0):
        m = hr[0]
        size = _heap_pop(hs, hr, size)
        w_bw = 1.0 if bw_over > 0 else 0.0
        w_cpu = 1.0 if cpu_over > 0 else 0.0
        relief = w_bw * relief_bw[m] + w_cpu * relief_cpu[m]
        if relief <= 0:
            continue
        _move(m, -1, sub_t, st)
        got = _best_topics(m, k, sub_t, st, covered, top, top_delta)
        new_score = float(top_delta[0] - rate[m] * fan[m]) / relief
        if size > 0 and new_score > hs[0] + 1e-12:
            _move(m, 0, sub_t, st)
            size = _heap_push(hs, hr, size, new_score, m)
            continue
        placed = False
        for j in range(got):
            if _node_peak_if(m, top[j], st) <= 1.0:
                _move(m, top[j], sub_t, st)
                placed = True
                moves += 1
                break
        if not placed:
            _move(m, 0, sub_t, st)
        bw_over, cpu_over = _controller_over(st)
    return moves


@njit(cache=True, nogil=True)
def _min_slack(b: np.ndarray, cap: np.ndarray) -> int:
    """min_n s(n) - b(n) (negative: some node is over its capacity)."""
    low = cap[0] - b[0] if b.shape[0] else 0
    for n in range(1, b.shape[0]):
        low = min(low, cap[n] - b[n])
    return low


@njit(cache=True, nogil=True)
def _would_overflow(c: int, dest: np.ndarray, f: int, st: tuple, slack: int) -> bool:
    """Whether some node would exceed s(n) with the unassigned type (destinations ``dest``,
    rate ``f``) on channel ``c``: the nodes :func:`envs.dsmd.kernels.state_move` changes,
    read without moving (RPC: each destination gets f; topic: its subscribers f, its new
    subscribers the whole topic). ``slack``: :func:`_min_slack` of the state (no subscriber
    can overflow when f is within it)."""
    b, trate, tsubs, sub, cap = st[1], st[2], st[3], st[5], st[12]
    if c == 0:
        for i in range(dest.shape[0]):
            n = dest[i]
            if b[n] + f > cap[n]:
                return True
        return False
    row = sub[c]
    if tsubs[c] != 0 and f > slack:
        for n in range(b.shape[0]):
            if row[n] > 0 and b[n] + f > cap[n]:
                return True
    whole = trate[c] + f
    for i in range(dest.shape[0]):
        n = dest[i]
        if row[n] == 0 and b[n] + whole > cap[n]:
            return True
    return False


@njit(cache=True, nogil=True)
def local_search_pass(order: np.ndarray, k: int, sub_t: np.ndarray, st: tuple) -> bool:
    """One pass of step 4 over the rows of ``order``: each type moves to RPC or one of its
    ``k`` best topics when that lowers the violation (by more than 1e-12), or keeps it
    (near) zero and lowers sum_n b(n). Returns whether any type moved.

    A candidate is scored without moving when no node is over s(n) and none would be: the
    violation is then the controller's terms alone and the node traffic grows by the
    channel's addition (the integers and floats the move would give); otherwise it is
    moved there and back."""
    ch, b, sc, dest_ptr, dest_idx, rate, fan = st[0], st[1], st[6], st[7], st[8], st[9], st[10]
    cap, bw_cap, cpu_cap = st[12], st[13], st[14]
    top = np.empty(k, np.int64)
    top_delta = np.empty(k, np.int64)
    covered = np.zeros(st[3].shape[0], np.int64)
    tmp = np.empty(b.shape[0], np.float64)
    improved = False
    # the state's violation, carried from type to type: after each type's final move the
    # state is the one its chosen candidate was scored on (or the one it started from)
    v_now = violation_of(st, tmp)
    for i in range(order.shape[0]):
        m = order[i]
        cur = ch[m]
        best_v, best_t, best_c = v_now, sc[TOT], cur
        _move(m, -1, sub_t, st)
        got = _best_topics(m, k, sub_t, st, covered, top, top_delta)
        dest = dest_idx[dest_ptr[m]:dest_ptr[m + 1]]
        f, d = rate[m], fan[m]
        slack = _min_slack(b, cap)
        for j in range(-1, got):
            c = 0 if j < 0 else top[j]
            if c == cur:
                continue
            if slack >= 0 and not _would_overflow(c, dest, f, st, slack):
                if c == 0:
                    bw, cpu, t = sc[BW] + f * d, sc[CPU] + d, sc[TOT] + f * d
                else:
                    bw, cpu, t = sc[BW] + f, sc[CPU] + 1, sc[TOT] + top_delta[j]
                v = max(bw / bw_cap - 1.0, 0.0)
                v += max(cpu / cpu_cap - 1.0, 0.0)
            else:
                _move(m, c, sub_t, st)
                v = violation_of(st, tmp)
                t = sc[TOT]
                _move(m, -1, sub_t, st)
            if (v < best_v - 1e-12) or (v <= 1e-12 and best_v <= 1e-12 and t < best_t):
                best_c, best_v, best_t = c, v, t
        _move(m, best_c, sub_t, st)
        v_now = best_v
        if best_c != cur:
            improved = True
    return improved


@njit(cache=True, nogil=True)
def lazy_switch(fresh: np.ndarray, order: np.ndarray, necessary: int, horizon: float,
                w_violation: float, w_move: float, w_subscribe: float, sweeps: int,
                st: tuple) -> None:
    """The hysteresis of :class:`envs.dsmd.online_greedy.OnlineGreedy` (lazy capacity
    provisioning) on the state ``st``: in ``order``, each type whose channel differs from
    the fresh plan's takes it when that removes violation or when its gain per interval
    (node traffic saved over ``necessary``, plus ``w_violation`` x violation removed) times
    ``horizon`` exceeds its price (``w_move`` + ``w_subscribe`` x the SubscribeInfos it
    causes); up to ``sweeps`` sweeps, until one changes nothing."""
    ch, b, sub, sc, dest_ptr, dest_idx = st[0], st[1], st[5], st[6], st[7], st[8]
    tmp = np.empty(b.shape[0], np.float64)
    for _ in range(sweeps):
        changed = False
        for i in range(order.shape[0]):
            m = order[i]
            a, c = ch[m], fresh[m]
            if a == c:
                continue
            lo, hi = dest_ptr[m], dest_ptr[m + 1]
            infos = 0
            if a > 0:
                row = sub[a]
                for j in range(lo, hi):
                    if row[dest_idx[j]] == 1:
                        infos += 1
            if c > 0:
                row = sub[c]
                for j in range(lo, hi):
                    if row[dest_idx[j]] == 0:
                        infos += 1
            v0 = violation_of(st, tmp)
            t0 = sc[TOT]
            state_move(m, c, st)
            v1 = violation_of(st, tmp)
            gain = (t0 - sc[TOT]) / necessary + w_violation * (v0 - v1)
            price = w_move + w_subscribe * infos
            if v1 < v0 - 1e-12 or gain * horizon > price:
                changed = True
            else:
                state_move(m, a, st)
        if not changed:
            break
