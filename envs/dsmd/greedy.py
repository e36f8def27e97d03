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

import time

import numpy as np

from . import greedy_kernels as _gk
from .cost import CostState
from .instance import RPC, DSMDInstance
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
        # 2. free moves, biggest relief first; 3. lazy greedy relief of the controller
        free_order = multicast[np.argsort(-(relief_bw[multicast] + relief_cpu[multicast]),
                                          kind="stable")]
        st, sub_t = state.kernel_arrays(), _node_major(state)
        moves = int(_gk.greedy_construct(free_order, multicast, relief_bw, relief_cpu,
                                         self._k(inst), sub_t, st))
        state.sync_scalars(st[6])
        # 4. local search (its kernel keeps sub_t in step with the state)
        order = np.argsort(-(f * d), kind="stable")
        passes = self._local_search(state, t0, order, sub_t)
        start = "greedy"
        # 5. the same local search from IDCS's assignment; keep the better
        assert inst.vpc is not None  # filled in DSMDInstance.__post_init__
        alt = CostState(inst, np.where(d > 1, vpc_topic(inst.vpc, inst.num_topics),
                                       RPC).astype(np.int64))
        passes += self._local_search(alt, t0, order, _node_major(alt))
        if _rank(alt) < _rank(state):
            state, start = alt, "idcs"
        self._info = {"moves": moves, "passes": passes, "time_s": time.perf_counter() - t0,
                      "violation": violation(state), "start": start}
        return state.channel.copy()

    def _k(self, inst: DSMDInstance) -> int:
        return max(min(self.candidates, inst.num_topics), 1)

    def _local_search(self, state: CostState, t0: float, order: np.ndarray,
                      sub_t: np.ndarray) -> int:
        """Step 4: passes over ``order`` (descending f(m)|D(m)|) until one moves nothing (at
        most ``local_search_passes``; the time limit is checked between passes). ``sub_t``:
        the state's subscription table, node-major (:func:`_node_major`)."""
        st = state.kernel_arrays()
        passes = 0
        try:
            for _ in range(self.passes):
                if time.perf_counter() - t0 > self.time_limit_s:
                    break
                passes += 1
                if not _gk.local_search_pass(order, self._k(state.inst), sub_t, st):
                    break
        finally:
            state.sync_scalars(st[6])
        return passes


def _node_major(state: CostState) -> np.ndarray:
    """``state.sub_count`` transposed, node-major (the planner kernels keep it in step):
    the topics a type's destinations reach are then rows, not columns, of the table."""
    return np.ascontiguousarray(state.sub_count.T)
