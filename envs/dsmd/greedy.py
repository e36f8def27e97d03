"""A strong capacity-aware heuristic: greedy construction plus local search.

DSMD is NP-hard (Theorem 1, a weighted set cover per node), so this is a heuristic:

1. **Start from RPC only**: zero redundancy, the least node traffic possible.
2. **Free moves**: multicast types, largest controller relief first, go to MQ wherever
   that adds no node traffic at all (an empty topic, or a topic whose subscribers are
   exactly D(m)). This relieves the controller for nothing.
3. **Relieve the controller**: while ``C_b`` or ``C_p`` is exceeded, move the RPC type with
   the least added redundancy per unit of controller relief (lazy greedy over a heap;
   relief weighted by which controller constraint is violated) to its cheapest topic that
   keeps every node within s(n).
4. **Local search**: passes over the types; a type moves to another channel when that
   lowers the violation, or keeps the assignment feasible and lowers sum_n b(n).
5. **Second start**: the same local search from IDCS's assignment (unicast RPC, multicast
   on VPC topics); the better of the two results is kept (feasible first, then less
   violation, then less node traffic). Steps 2-3 hand out empty topics greedily and never
   take them back, which single-type moves cannot always undo; the IDCS start covers that.

It lives here, beside the cost model, because the online executor
(:mod:`envs.dsmd.online_greedy`) plans with it; :mod:`agents.greedy` re-exports it as the
static baseline ``greedy``.
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from .cost import CostState
from .instance import RPC, UNASSIGNED, DSMDInstance
from .policy import Policy, vpc_topic

__all__ = ["GreedyLocalSearch", "violation"]


def violation(state: CostState) -> float:
    """Total normalised violation: controller bandwidth, CPU, and every node
    (:func:`envs.dsmd.cost.violation`)."""
    return state.violation()


def _rank(state: CostState) -> tuple[bool, float, int]:
    v = violation(state)
    return (v > 1e-12, v, state.total_traffic)


class GreedyLocalSearch(Policy):
    name = "greedy"

    def __init__(self, local_search_passes: int = 3, time_limit_s: float = 30.0,
                 candidates: int = 4) -> None:
        self.passes = int(local_search_passes)
        self.time_limit_s = float(time_limit_s)
        self.candidates = int(candidates)
        self._info: dict = {}

    def info(self) -> dict:
        return dict(self._info)

    # ------------------------------------------------------------------ helpers
    def _best_topics(self, state: CostState, m: int) -> tuple[np.ndarray, np.ndarray]:
        """Topics (1..K) sorted by added node traffic, and those increases."""
        delta = state.topic_deltas(m)[1:]
        k = min(self.candidates, delta.size)
        idx = np.argpartition(delta, k - 1)[:k] if k < delta.size else np.arange(delta.size)
        idx = idx[np.argsort(delta[idx], kind="stable")]
        return idx + 1, delta[idx]

    def _ctrl_over(self, state: CostState) -> tuple[float, float]:
        inst = state.inst
        return (max(state.controller_bw / inst.controller_bw_bps - 1.0, 0.0),
                max(state.controller_cpu / inst.controller_cpu - 1.0, 0.0))

    # ------------------------------------------------------------------ algorithm
    def assign(self, inst: DSMDInstance) -> np.ndarray:
        t0 = time.perf_counter()
        state = CostState(inst, np.full(inst.num_types, RPC, dtype=np.int64))
        if inst.num_topics == 0 or inst.num_types == 0:
            self._info = {"moves": 0, "passes": 0, "time_s": time.perf_counter() - t0}
            return state.channel.copy()
        f, d = inst.rate_bps, inst.fanout
        relief_bw = f * (d - 1) / inst.controller_bw_bps
        relief_cpu = (d - 1) / inst.controller_cpu
        multicast = np.flatnonzero(d > 1)
        moves = 0
        # 2. free moves, biggest relief first
        for row in multicast[np.argsort(-(relief_bw[multicast] + relief_cpu[multicast]),
                                        kind="stable")]:
            m = int(row)
            state.move(m, UNASSIGNED)
            topics, deltas = self._best_topics(state, m)
            if deltas[0] == f[m] * d[m]:  # zero redundancy
                state.move(m, int(topics[0]))
                moves += 1
            else:
                state.move(m, RPC)
        # 3. lazy greedy relief of the controller
        bw_over, cpu_over = self._ctrl_over(state)
        if bw_over > 0 or cpu_over > 0:
            heap: list[tuple[float, int]] = []
            for row in multicast:
                if state.channel[row] == RPC:
                    heap.append((0.0, int(row)))  # optimistic score, refreshed on pop
            heapq.heapify(heap)
            while heap and (bw_over > 0 or cpu_over > 0):
                if time.perf_counter() - t0 > self.time_limit_s:
                    break
                _score, m = heapq.heappop(heap)
                w_bw, w_cpu = (1.0 if bw_over > 0 else 0.0), (1.0 if cpu_over > 0 else 0.0)
                relief = w_bw * relief_bw[m] + w_cpu * relief_cpu[m]
                if relief <= 0:
                    continue
                state.move(m, UNASSIGNED)
                topics, deltas = self._best_topics(state, m)
                cost = float(deltas[0] - f[m] * d[m])
                new_score = cost / relief
                if heap and new_score > heap[0][0] + 1e-12:
                    state.move(m, RPC)
                    heapq.heappush(heap, (new_score, m))
                    continue
                placed = False
                for t in topics:
                    if state.node_peak_if(m, int(t)) <= 1.0:
                        state.move(m, int(t))
                        placed = True
                        moves += 1
                        break
                if not placed:
                    state.move(m, RPC)
                bw_over, cpu_over = self._ctrl_over(state)
        # 4. local search
        passes = self._local_search(state, t0)
        start = "greedy"
        # 5. the same local search from IDCS's assignment; keep the better
        assert inst.vpc is not None  # filled in DSMDInstance.__post_init__
        alt = CostState(inst, np.where(inst.fanout > 1, vpc_topic(inst.vpc, inst.num_topics),
                                       RPC).astype(np.int64))
        passes += self._local_search(alt, t0)
        if _rank(alt) < _rank(state):
            state, start = alt, "idcs"
        self._info = {"moves": moves, "passes": passes, "time_s": time.perf_counter() - t0,
                      "violation": violation(state), "start": start}
        return state.channel.copy()

    def _local_search(self, state: CostState, t0: float) -> int:
        inst = state.inst
        order = np.argsort(-(inst.rate_bps * inst.fanout), kind="stable")
        passes = 0
        for _ in range(self.passes):
            passes += 1
            improved = False
            for row in order:
                if time.perf_counter() - t0 > self.time_limit_s:
                    return passes
                m = int(row)
                cur = int(state.channel[m])
                v0, t_0 = violation(state), state.total_traffic
                state.move(m, UNASSIGNED)
                topics, _ = self._best_topics(state, m)
                best_c, best_key = cur, (v0, t_0)
                for c in [RPC, *topics.tolist()]:
                    if c == cur:
                        continue
                    state.move(m, c)
                    key = (violation(state), state.total_traffic)
                    state.move(m, UNASSIGNED)
                    better = (key[0] < best_key[0] - 1e-12) or (
                        key[0] <= 1e-12 and best_key[0] <= 1e-12 and key[1] < best_key[1])
                    if better:
                        best_c, best_key = c, key
                state.move(m, best_c)
                improved |= best_c != cur
            if not improved:
                break
        return passes
