"""Plain-Python statements of the online executor's planner and placement rules, move by move
on :class:`envs.dsmd.cost.CostState`: the oracles the compiled loops of
:mod:`envs.dsmd.greedy_kernels` and ``CostState.least_fitting`` are checked against
(``tests/test_greedy_kernels.py``). Slow by design; never imported by the package."""

from __future__ import annotations

import heapq
import math

import numpy as np

from envs.dsmd.cost import CostState
from envs.dsmd.instance import RPC, UNASSIGNED, DSMDInstance
from envs.dsmd.online import OnlineCost
from envs.dsmd.policy import vpc_topic


def _best_topics(state: CostState, m: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k topics of least added node traffic, equal additions in topic order."""
    delta = state.topic_deltas(m)[1:]
    idx = np.argsort(delta, kind="stable")[:k]
    return idx + 1, delta[idx]


def _rank(state: CostState) -> tuple[bool, float, int]:
    v = state.violation()
    return (v > 1e-12, v, state.total_traffic)


def _local_search(state: CostState, passes: int, k: int) -> None:
    inst = state.inst
    order = np.argsort(-(inst.rate_bps * inst.fanout), kind="stable")
    for _ in range(passes):
        improved = False
        for row in order:
            m = int(row)
            cur = int(state.channel[m])
            best_c, best_key = cur, (state.violation(), state.total_traffic)
            state.move(m, UNASSIGNED)
            topics, _ = _best_topics(state, m, k)
            for c in [RPC, *topics.tolist()]:
                if c == cur:
                    continue
                state.move(m, c)
                key = (state.violation(), state.total_traffic)
                state.move(m, UNASSIGNED)
                if (key[0] < best_key[0] - 1e-12) or (
                        key[0] <= 1e-12 and best_key[0] <= 1e-12 and key[1] < best_key[1]):
                    best_c, best_key = c, key
            state.move(m, best_c)
            improved |= best_c != cur
        if not improved:
            return


def greedy_assign(inst: DSMDInstance, passes: int = 3, candidates: int = 4) -> np.ndarray:
    """Steps 1-5 of :class:`envs.dsmd.greedy.GreedyLocalSearch`."""
    state = CostState(inst, np.full(inst.num_types, RPC, dtype=np.int64))
    if inst.num_topics == 0 or inst.num_types == 0:
        return state.channel.copy()
    k = max(min(candidates, inst.num_topics), 1)
    f, d = inst.rate_bps, inst.fanout
    relief_bw = f * (d - 1) / inst.controller_bw_bps
    relief_cpu = (d - 1) / inst.controller_cpu
    multicast = np.flatnonzero(d > 1)
    for row in multicast[np.argsort(-(relief_bw[multicast] + relief_cpu[multicast]),
                                    kind="stable")]:
        m = int(row)
        state.move(m, UNASSIGNED)
        topics, deltas = _best_topics(state, m, k)
        state.move(m, int(topics[0]) if deltas[0] == f[m] * d[m] else RPC)

    def over() -> tuple[float, float]:
        return (max(state.controller_bw / inst.controller_bw_bps - 1.0, 0.0),
                max(state.controller_cpu / inst.controller_cpu - 1.0, 0.0))

    bw_over, cpu_over = over()
    if bw_over > 0 or cpu_over > 0:
        heap = [(0.0, int(r)) for r in multicast if state.channel[r] == RPC]
        heapq.heapify(heap)
        while heap and (bw_over > 0 or cpu_over > 0):
            _, m = heapq.heappop(heap)
            relief = ((1.0 if bw_over > 0 else 0.0) * relief_bw[m]
                      + (1.0 if cpu_over > 0 else 0.0) * relief_cpu[m])
            if relief <= 0:
                continue
            state.move(m, UNASSIGNED)
            topics, deltas = _best_topics(state, m, k)
            score = float(deltas[0] - f[m] * d[m]) / relief
            if heap and score > heap[0][0] + 1e-12:
                state.move(m, RPC)
                heapq.heappush(heap, (score, m))
                continue
            for t in topics.tolist():
                if state.node_peak_if(m, t) <= 1.0:
                    state.move(m, t)
                    break
            else:
                state.move(m, RPC)
            bw_over, cpu_over = over()
    _local_search(state, passes, k)
    alt = CostState(inst, np.where(d > 1, vpc_topic(inst.vpc, inst.num_topics), RPC)
                    .astype(np.int64))
    _local_search(alt, passes, k)
    return (alt if _rank(alt) < _rank(state) else state).channel.copy()


def least_fitting(state: CostState, m: int, scores: np.ndarray, fallback: int = 4) -> int:
    """The least-score channel that fits, else the least (violation, score) among RPC and
    the ``fallback`` best-scoring topics."""
    order = np.argsort(scores, kind="stable").tolist()
    for c in order:
        if state.fits(m, c):
            return int(c)

    def violation_if(c: int) -> float:
        state.move(m, c)
        try:
            return state.violation()
        finally:
            state.move(m, UNASSIGNED)

    cand = [RPC, *[c for c in order if c != RPC][:fallback]]
    return int(min(cand, key=lambda c: (violation_if(c), float(scores[c]))))


def lazy_switch(inst: DSMDInstance, fresh: np.ndarray, start: np.ndarray, horizon: float,
                cost: OnlineCost) -> np.ndarray:
    """OnlineGreedy's hysteresis: take the fresh plan's channel type by type when it pays
    within ``horizon`` intervals or removes violation."""
    st = CostState(inst, start)
    nec = max(inst.necessary_bps, 1)
    order = np.argsort(-(inst.rate_bps * inst.fanout), kind="stable")
    for _ in range(2):
        changed = False
        for m in order[fresh[order] != st.channel[order]].tolist():
            a, b = int(st.channel[m]), int(fresh[m])
            dest = inst.destinations(m)
            infos = 0
            if a > 0:
                infos += int(np.count_nonzero(st.sub_count[a][dest] == 1))
            if b > 0:
                infos += int(np.count_nonzero(st.sub_count[b][dest] == 0))
            v0, t0 = st.violation(), st.total_traffic
            st.move(m, b)
            v1 = st.violation()
            gain = (t0 - st.total_traffic) / nec + cost.plan_violation_price * (v0 - v1)
            price = cost.w_move + cost.w_subscribe * infos
            if v1 < v0 - 1e-12 or (not math.isnan(gain * horizon) and gain * horizon > price):
                changed = True
            else:
                st.move(m, a)
        if not changed:
            break
    return st.channel.copy()
