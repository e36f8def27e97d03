"""The exact optimum of DSMD (Eq. 1) as a mixed-integer linear program, solved by HiGHS.

Eq. 1 is bilinear (``y[m,t] * z[n,t]`` in b(n)); the model linearises only what can be
redundant. For ``n in D(m)`` a type on topic t forces ``z[n,t] = 1`` and its traffic to
n is necessary; for ``n not in D(m)`` a continuous ``u[n,m,t] >= y[m,t] + z[n,t] - 1``
carries the redundant copy. Then

    min  sum_m f(m)|D(m)|  +  sum_{m,t,n not in D(m)} f(m) u[n,m,t]
    s.t. x[m] + sum_t y[m,t] = 1                                  (channel)
         sum_m f(m)(|D(m)| x[m] + sum_t y[m,t]) <= C_b            (controller bandwidth)
         sum_m (|D(m)| x[m] + sum_t y[m,t]) <= C_p                (controller CPU)
         z[n,t] >= y[m,t]                 for n in D(m)           (subscription)
         u[n,m,t] >= y[m,t] + z[n,t] - 1  for n not in D(m)       (redundant copy)
         sum_{m: n in D(m)} f(m)(x[m] + sum_t y[m,t])
             + sum_{m: n not in D(m), t} f(m) u[n,m,t] <= s(n)    (node bandwidth)

with x, y, z binary and u in [0, 1]. Topics are interchangeable, so symmetry is broken by
allowing the i-th type (largest f|D| first) only topics 1..i+1 (relabel the topics in the
order in which the types, taken in that order, first use them).

**Units and proof.** The objective is in bit/s (cost coefficients ``f(m)``, integers), so
one bit/s is a million times HiGHS's absolute tolerances (``mip_feasibility_tolerance``
and ``mip_abs_gap``, 1e-6, both in objective units). Were one bit/s as small as those
tolerances, HiGHS would prune a node holding an assignment one bit/s better than its
incumbent and report the incumbent as the dual bound; with integer costs it detects the
objective's integrality and prunes only nodes that cannot hold a better integer value.
Capacity rows are normalised by their capacity. A status ``optimal`` is a certificate in
exact arithmetic: the assignment's ``sum_n b(n)`` from :func:`envs.dsmd.cost.evaluate` (an
integer) is less than the dual bound of the first solve, less a margin for its
floating-point error (:func:`bound_slack`), plus one; no integer lies strictly between.
Otherwise the status is ``time_limit`` (HiGHS stopped at the time limit) or ``unproven``
(e.g. a re-solve with tightened capacities, below, found a costlier assignment than the
first solve's bound), and ``info()["lower_bound_bps"]`` is the proven integer bound.

Size: ``M (1 + K) + N K`` binaries and ``K sum_m (N - |D(m)|)`` continuous variables.
``bench/bench_exact.py`` measures solve time against size. The solver refuses instances
above ``max_variables`` (default 5,000); large ones usually stop at the time limit with
their best assignment, status ``time_limit`` and the lower bound in ``info()``.

:func:`add_interval` builds one instance's variables and rows into a :class:`SparseMILP`;
the multi-period oracle (:mod:`agents.exact_online`) stacks one block per interval.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, OptimizeResult, milp
from scipy.sparse import coo_matrix, csr_matrix, vstack

from envs.dsmd.cost import evaluate
from envs.dsmd.instance import DSMDInstance

from .policy import Policy, PolicyError

__all__ = ["ExactMILP", "InstanceTooLarge", "IntervalBlock", "SparseMILP", "add_interval",
           "bound_slack", "milp_size", "symmetry_mask"]

#: Capacity rows are normalised by their capacity C. Loads are integers (bit/s), so
#: "load <= C" equals "load <= C + 0.5"; the first solve uses exactly that. HiGHS's row
#: tolerance (1e-6 for MIPs) is relative to a normalised row, so it may accept a load up to
#: about 1e-6 C over capacity, which the exact integer cost model rejects. Then each
#: violated row first gets a copy in bit/s, ``load <= C + 0.5``, where the same tolerance
#: is 1e-6 bit/s: the model stays a relaxation of Eq. 1 (its bound and an ``infeasible``
#: stay valid). A row violated again is tightened by these relative margins, in turn; a
#: tightened model may cut feasible loads just below C, so its bound proves nothing and
#: its infeasibility is reported as ``unproven``. All within the same time limit.
_RETRY_MARGINS = (2e-6, 2e-5)


def _rhs(capacity_bps: int, margin: float) -> float:
    return 1.0 + 0.5 / capacity_bps - margin


def bound_slack(bound: float, variables: int) -> float:
    """How far a HiGHS dual bound (objective units) may lie above the model's true bound.

    LP bounds are exact up to the dual feasibility tolerance (1e-7) per column of range at
    most 1: at most ``1e-7 * variables`` in all, covered ten times by ``1e-6 * variables``;
    the bound is also a floating-point sum, whose rounding ``1e-12 |bound|`` covers
    thousands of times over. Below one objective unit as long as ``variables < 10**5`` and
    ``|bound| < 10**11``."""
    return 1e-6 * variables + 1e-12 * abs(bound)


class InstanceTooLarge(PolicyError):
    """The MILP would exceed the configured size limit."""


def milp_size(inst: DSMDInstance) -> dict[str, int]:
    m, n, k = inst.num_types, inst.num_nodes, inst.num_topics
    return {"binaries": m * (1 + k) + n * k,
            "continuous": int(k * (n * m - inst.fanout.sum())),
            "variables": m * (1 + k) + n * k + int(k * (n * m - inst.fanout.sum()))}


# ---------------------------------------------------------------------- model building
@dataclass
class SparseMILP:
    """A MILP under construction: columns (cost, bounds, integrality) and rows (COO)."""

    cost: list[float] = field(default_factory=list)
    lb: list[float] = field(default_factory=list)
    ub: list[float] = field(default_factory=list)
    integer: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    cols: list[int] = field(default_factory=list)
    vals: list[float] = field(default_factory=list)
    lo: list[float] = field(default_factory=list)
    hi: list[float] = field(default_factory=list)

    @property
    def num_columns(self) -> int:
        return len(self.cost)

    @property
    def num_rows(self) -> int:
        return len(self.lo)

    def columns(self, count: int, cost: float = 0.0, lb: float = 0.0, ub: float = 1.0,
                integer: bool = False) -> int:
        """Append ``count`` columns alike; returns the index of the first."""
        first = len(self.cost)
        self.cost.extend([float(cost)] * count)
        self.lb.extend([float(lb)] * count)
        self.ub.extend([float(ub)] * count)
        self.integer.extend([int(integer)] * count)
        return first

    def row(self, entries: Iterable[tuple[int, float]], lo: float, hi: float) -> int:
        """Append the row ``lo <= sum(val * x[col]) <= hi``; returns its index."""
        r = len(self.lo)
        for col, val in entries:
            self.rows.append(r)
            self.cols.append(col)
            self.vals.append(val)
        self.lo.append(lo)
        self.hi.append(hi)
        return r

    def matrix(self) -> csr_matrix:
        return coo_matrix((self.vals, (self.rows, self.cols)),
                          shape=(self.num_rows, self.num_columns)).tocsr()

    def solve(self, time_limit_s: float, mip_rel_gap: float = 0.0,
              matrix: csr_matrix | None = None, lo: np.ndarray | None = None,
              hi: np.ndarray | None = None) -> OptimizeResult:
        """HiGHS (``scipy.optimize.milp``); ``matrix``, ``lo`` and ``hi`` replace the rows
        (the same columns; more rows allowed)."""
        return milp(np.asarray(self.cost), integrality=np.asarray(self.integer),
                    bounds=Bounds(np.asarray(self.lb), np.asarray(self.ub)),
                    constraints=LinearConstraint(
                        self.matrix() if matrix is None else matrix,
                        np.asarray(self.lo) if lo is None else lo,
                        np.asarray(self.hi) if hi is None else hi),
                    options={"time_limit": max(float(time_limit_s), 1.0),
                             "mip_rel_gap": float(mip_rel_gap), "disp": False})


@dataclass
class IntervalBlock:
    """The columns and rows of one instance's Eq. 1 model inside a :class:`SparseMILP`.

    Columns: ``x[m]`` at ``x0 + m``, ``y[m,t]`` at ``y0 + m K + t - 1``, ``z[n,t]`` at
    ``z0 + n K + t - 1``, ``u`` at ``u0 + j`` for ``u_index[j] = (m, t, n)``. Capacity rows:
    ``bw_row`` (C_b), ``cpu_row`` (C_p), ``node_rows[n]`` (s(n)); -1 where absent."""

    inst: DSMDInstance
    x0: int
    y0: int
    z0: int
    u0: int
    u_index: list[tuple[int, int, int]]
    bw_row: int
    cpu_row: int
    node_rows: list[int]

    @property
    def num_topics(self) -> int:
        return self.inst.num_topics

    def y(self, m: int, t: int) -> int:
        """Column of ``y[m,t]``, ``t`` in 1..K."""
        return self.y0 + m * self.num_topics + (t - 1)

    def z(self, n: int, t: int) -> int:
        """Column of ``z[n,t]``, ``t`` in 1..K."""
        return self.z0 + n * self.num_topics + (t - 1)

    def channel_columns(self, m: int) -> list[int]:
        """The one-hot columns of type ``m``'s channel: ``[x[m], y[m,1], ..., y[m,K]]``."""
        return [self.x0 + m] + [self.y(m, t) for t in range(1, self.num_topics + 1)]

    def capacity_rows(self) -> list[tuple[int, int]]:
        """(row, capacity in bit/s) of the bandwidth rows: C_b first, then every s(n)."""
        inst = self.inst
        return [(self.bw_row, inst.controller_bw_bps)] + [
            (r, int(inst.node_capacity_bps[n])) for n, r in enumerate(self.node_rows)]

    def decode(self, values: np.ndarray) -> np.ndarray:
        """The channel of every type from a solution vector (rounded)."""
        m_, k = self.inst.num_types, self.num_topics
        channel = np.zeros(m_, dtype=np.int64)
        if k and m_:
            ys = np.rint(values[self.y0:self.y0 + m_ * k]).reshape(m_, k)
            on = ys.max(axis=1) > 0.5
            channel[on] = np.argmax(ys[on], axis=1) + 1
        return channel


def symmetry_mask(inst: DSMDInstance, free_topics: Iterable[int] | None = None,
                  offset: int = 0) -> tuple[np.ndarray, int]:
    """Which topics each type may use when the topics in ``free_topics`` (default: all) are
    interchangeable: taking the types by decreasing ``f|D|`` (ties: lower index) and
    counting from ``offset``, the ``r``-th may use only the first ``r + 1`` free topics.

    Valid because relabelling the free topics in the order in which the types, taken in
    that order, first use them changes no cost. Returns ``(allowed[M, K], offset + M)``; a
    later block continuing the same order passes the returned offset."""
    m_, k = inst.num_types, inst.num_topics
    free = list(range(1, k + 1)) if free_topics is None else sorted(free_topics)
    allowed = np.ones((m_, k), dtype=bool)
    order = np.argsort(-(inst.rate_bps * inst.fanout), kind="stable")
    for r, m in enumerate(order):
        for t in free[offset + r + 1:]:
            allowed[m, t - 1] = False
    return allowed, offset + m_


def add_interval(model: SparseMILP, inst: DSMDInstance, traffic_cost: float = 1.0,
                 allowed: np.ndarray | None = None, slack_cost: float | None = None,
                 exact_subscriptions: bool = False) -> IntervalBlock:
    """Append Eq. 1's variables and rows for ``inst`` to ``model`` (module docstring).

    ``traffic_cost``: objective coefficient per bit/s of redundant traffic (the ``u``
    columns cost ``traffic_cost f(m)``; the necessary ``sum_m f(m)|D(m)|`` is a constant
    left to the caller). ``allowed[m, t-1]`` False fixes ``y[m,t] = 0``.

    ``slack_cost None``: hard capacities. The bandwidth rows (``capacity_rows()``) read
    ``load / C <= 1`` (the caller sets their right-hand sides), the CPU row
    ``sends <= C_p``. Otherwise soft capacities: each row gets a slack ``v >= 0`` and the
    objective ``slack_cost * v`` with ``v >= load / C - 1`` (CPU: ``sends / C_p - 1``), the
    normalised violation. Rows and slack are both scaled by
    ``lam = min(max(1, slack_cost), 1e6)``, so that the solver's absolute row tolerance
    (1e-6) is worth at most ``max(1e-6, slack_cost 1e-12)`` objective units.

    ``exact_subscriptions``: also ``z[n,t] <= sum_{m: n in D(m)} y[m,t]`` (``z`` is exactly
    the subscriptions the assignment implies, not only at least them), and ``z[n,t] = 0``
    where no type has ``n`` in ``D(m)``."""
    M, N, K = inst.num_types, inst.num_nodes, inst.num_topics
    f = inst.rate_bps.astype(np.float64)
    d = inst.fanout.astype(np.float64)
    gamma = inst.gamma().astype(bool)
    x0 = model.columns(M, integer=True)
    y0 = model.columns(M * K, integer=True)
    z0 = model.columns(N * K, integer=True)
    blk = IntervalBlock(inst, x0, y0, z0, -1, [], -1, -1, [])
    if allowed is not None:
        for m, t0 in zip(*np.nonzero(~np.asarray(allowed, dtype=bool))):
            model.ub[blk.y(int(m), int(t0) + 1)] = 0.0
    for m in range(M):
        outside = np.flatnonzero(~gamma[m])
        for t in range(1, K + 1):
            for n in outside:
                blk.u_index.append((m, t, int(n)))
    blk.u0 = model.num_columns
    for m, _, _ in blk.u_index:
        model.columns(1, cost=traffic_cost * f[m])
    soft = slack_cost is not None
    lam = min(max(1.0, float(slack_cost)), 1e6) if soft else 1.0

    def capacity(entries: list[tuple[int, float]], cap: float) -> int:
        """``sum entries <= cap``, hard (normalised) or soft (with a slack, scaled)."""
        if not soft:
            return model.row([(c, v / cap) for c, v in entries], -np.inf, 1.0)
        v = model.columns(1, cost=float(slack_cost) / lam, ub=np.inf)
        return model.row([(c, lam * val / cap) for c, val in entries] + [(v, -1.0)],
                         -np.inf, lam)

    for m in range(M):
        model.row([(c, 1.0) for c in blk.channel_columns(m)], 1.0, 1.0)
    bw_terms = ([(x0 + m, f[m] * d[m]) for m in range(M)]
                + [(blk.y(m, t), f[m]) for m in range(M) for t in range(1, K + 1)])
    blk.bw_row = capacity(bw_terms, float(inst.controller_bw_bps))
    cpu_terms = ([(x0 + m, d[m]) for m in range(M)]
                 + [(blk.y(m, t), 1.0) for m in range(M) for t in range(1, K + 1)])
    if soft:
        blk.cpu_row = capacity(cpu_terms, float(inst.controller_cpu))
    else:
        blk.cpu_row = model.row(cpu_terms, -np.inf, float(inst.controller_cpu))
    members: list[list[int]] = [[] for _ in range(N)]  # types with n in D(m)
    for m in range(M):
        for n in inst.destinations(m):
            members[int(n)].append(m)
            for t in range(1, K + 1):
                model.row([(blk.y(m, t), 1.0), (blk.z(int(n), t), -1.0)], -np.inf, 0.0)
    if exact_subscriptions:
        for n in range(N):
            for t in range(1, K + 1):
                if members[n]:
                    model.row([(blk.z(n, t), 1.0)] + [(blk.y(m, t), -1.0) for m in members[n]],
                              -np.inf, 0.0)
                else:
                    model.ub[blk.z(n, t)] = 0.0
    node_terms: list[list[tuple[int, float]]] = [[] for _ in range(N)]
    for n in range(N):
        for m in members[n]:
            node_terms[n].append((x0 + m, f[m]))
            node_terms[n].extend((blk.y(m, t), f[m]) for t in range(1, K + 1))
    for j, (m, t, n) in enumerate(blk.u_index):
        col = blk.u0 + j
        model.row([(blk.y(m, t), 1.0), (blk.z(n, t), 1.0), (col, -1.0)], -np.inf, 1.0)
        node_terms[n].append((col, f[m]))
    blk.node_rows = [capacity(node_terms[n], float(inst.node_capacity_bps[n]))
                     for n in range(N)]
    return blk


# ---------------------------------------------------------------------- the policy
class ExactMILP(Policy):
    name = "exact"

    def __init__(self, time_limit_s: float = 60.0, max_variables: int = 5_000,
                 mip_rel_gap: float = 0.0) -> None:
        self.time_limit_s = float(time_limit_s)
        self.max_variables = int(max_variables)
        self.mip_rel_gap = float(mip_rel_gap)
        self._info: dict = {}

    def info(self) -> dict:
        return dict(self._info)

    def assign(self, inst: DSMDInstance) -> np.ndarray:
        size = milp_size(inst)
        if size["variables"] > self.max_variables:
            self._info = {"status": "too_large", **size}
            raise InstanceTooLarge(
                f"exact MILP for {inst.name or 'instance'} needs {size['variables']} variables "
                f"(> max_variables={self.max_variables}): M={inst.num_types}, "
                f"N={inst.num_nodes}, K={inst.num_topics}")
        t0 = time.perf_counter()
        model = SparseMILP()
        allowed, _ = symmetry_mask(inst)
        blk = add_interval(model, inst, traffic_cost=1.0, allowed=allowed)
        necessary = float(inst.necessary_bps)
        cap_rows = blk.capacity_rows()
        A = model.matrix()
        lo_arr = np.array(model.lo, dtype=np.float64)
        hi_arr = np.array(model.hi, dtype=np.float64)
        margin = {row: 0.0 for row, _ in cap_rows}
        capacity = dict(cap_rows)
        node_row = {row: n for n, (row, _) in enumerate(cap_rows[1:])}
        in_bps: set[int] = set()  # capacity rows with a copy in bit/s
        deadline = t0 + self.time_limit_s
        bound: float | None = None  # the best dual bound of a relaxation of Eq. 1, bit/s
        relaxed = True
        for attempt in range(2 + len(_RETRY_MARGINS)):  # plain, bit/s copies, margins
            for row, cap in cap_rows:
                hi_arr[row] = _rhs(cap, margin[row])
            res = model.solve(deadline - time.perf_counter(), self.mip_rel_gap, A, lo_arr,
                              hi_arr)
            elapsed = time.perf_counter() - t0
            status = {0: "optimal", 1: "time_limit", 2: "infeasible", 3: "unbounded"}.get(
                res.status, f"status_{res.status}")
            dual = getattr(res, "mip_dual_bound", None)
            if relaxed and dual is not None and np.isfinite(dual):
                bound = max(float(dual) + necessary, bound if bound is not None else -np.inf)
            if status == "infeasible" and not relaxed:
                # only the tightening made it infeasible: a solution may exist within the
                # solver's tolerance of a capacity, which HiGHS cannot certify
                status = "unproven"
            self._info = {"status": status, "time_s": elapsed, **size,
                          "mip_gap": getattr(res, "mip_gap", None), "attempts": attempt + 1}
            if res.x is None:
                raise PolicyError(f"exact MILP for {inst.name or 'instance'}: {status} "
                                  f"({res.message}) after {elapsed:.2f}s")
            channel = blk.decode(res.x)
            snap = evaluate(inst, channel)
            over = [row for row, cap in cap_rows
                    if (snap.controller_bw if row not in node_row
                        else int(snap.node_traffic[node_row[row]])) > cap]
            if not over:
                break
            # HiGHS accepted a load over capacity within its tolerance (see _RETRY_MARGINS)
            fresh = [row for row in over if row not in in_bps]
            if fresh:
                copies = A[fresh].multiply(np.array([[capacity[r]] for r in fresh],
                                                    dtype=np.float64)).tocsr()
                A = vstack([A, copies]).tocsr()
                lo_arr = np.concatenate([lo_arr, np.full(len(fresh), -np.inf)])
                hi_arr = np.concatenate([hi_arr, [capacity[r] + 0.5 for r in fresh]])
                in_bps.update(fresh)
            for row in over:
                if row in fresh:
                    continue
                step = _RETRY_MARGINS.index(margin[row]) + 1 if margin[row] else 0
                margin[row] = _RETRY_MARGINS[min(step, len(_RETRY_MARGINS) - 1)]
                relaxed = False
        else:
            self._info["status"] = "unproven"
            raise PolicyError(f"exact MILP for {inst.name or 'instance'}: every solution the "
                              "solver returned violates a capacity in exact arithmetic")
        objective = snap.total_traffic
        # Certificate: the objective is an integer and no feasible assignment costs less
        # than the bound of a relaxation (less its float error), so ``objective`` is optimal
        # iff ``objective - 1 < bound - slack``. With mip_rel_gap > 0 or at the time limit
        # this can still hold; otherwise HiGHS's own "optimal" is not enough.
        proven = (bound is not None and status in ("optimal", "time_limit")
                  and objective - 1 < bound - bound_slack(bound, size["variables"]))
        if proven:
            self._info["status"] = "optimal"
        elif status == "optimal":
            self._info["status"] = "unproven"
        self._info["objective_bps"] = objective
        self._info["solver_objective_bps"] = float(res.fun) + necessary
        self._info["lower_bound_bps"] = (None if bound is None
                                         else max(float(math.ceil(
                                             bound - bound_slack(bound, size["variables"]))),
                                             necessary))
        self._info["dual_bound_bps"] = bound
        return channel
