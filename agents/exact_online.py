"""The hindsight oracle of online DSMD: one MILP over a whole horizon of realised intervals.

Intervals ``i = 0..H-1`` are realised instances over the same nodes and K; a type is the
same across intervals when its ``catalog_index`` is. A plan gives every interval's types a
channel (0 = RPC, t = topic t). The online cost, to minimise, is ``sum_i cost_i`` with

    cost_i = sum_n b_i(n) / sum_m f_i(m)|D(m)|                     (redundancy ratio, Eq. 1)
             + w_violation V_i                                     (V: agents.greedy.violation)
             + w_subscribe SI_i + w_move MOVES_i

* ``V_i = [bw/C_b - 1]^+ + [sends/C_p - 1]^+ + sum_n [b(n)/s(n) - 1]^+``;
* ``SI_i``: the (node, topic) pairs whose subscription ``z[n,t]`` differs from interval
  ``i-1``'s; the subscriptions of an interval are those its own types on topics imply
  (``z[n,t] = 1`` iff a type on ``t`` has ``n`` in ``D(m)``);
* ``MOVES_i``: the types of interval ``i`` whose channel differs from the one they had the
  last time they appeared (earlier in the horizon, else in ``initial_channel``); a type
  never seen before is not a move.

Interval 0 pays no switching term without an initial state. With ``initial_channel``
(type id -> channel) it pays moves against it, and subscription changes against the
subscriptions of ``initial_instance`` under ``initial_channel`` (none subscribed when no
``initial_instance`` is given). :func:`online_cost` is the reference of this definition,
computed with the exact integer cost model (:func:`envs.dsmd.cost.evaluate`).

**The MILP.** One :func:`agents.exact.add_interval` block per interval (Eq. 1's x, y, z, u),
with ``z`` exact (``z[n,t] <= sum_{m: n in D(m)} y[m,t]``) and soft capacities (a slack
per capacity row, so every plan is feasible and the oracle is at most the cost of any
plan, feasible or not), plus

    d[n,t] >= z_i[n,t] - z_{i-1}[n,t],  d[n,t] >= z_{i-1}[n,t] - z_i[n,t]      (SI)
    mv >= a_i(m)[c] - a_j(m')[c]  for every channel c                          (MOVES)

with ``a(m) = (x[m], y[m,1..K])`` one-hot and ``(j, m')`` the type's last appearance;
against a constant (the initial state) both terms are linear in ``z`` and ``a``. The
objective is scaled by ``sigma = max_i sum_m f_i(m)|D(m)|``: one bit/s of redundancy in any
interval is then at least one objective unit, far above HiGHS's absolute tolerances (1e-6
units; see :mod:`agents.exact` for what a unit too small does).

**Symmetry.** A topic is *free* when no initial subscription uses it and no type of the
horizon had it as initial channel. Relabelling free topics consistently in every interval
changes no term (SI compares the same relabelled pairs, a move stays a move), so taking the
types interval by interval, each by decreasing ``f|D|``, the ``r``-th may use only the first
``r + 1`` free topics. Topics that are not free are never restricted, and no restriction
is per interval: relabelling one interval alone would change SI and MOVES.

**Status.** The online cost is not an integer (ratios, normalised violations, real
weights), so no integrality argument closes the gap as in :mod:`agents.exact`. ``optimal``
means: the exact cost of the returned plan (:func:`online_cost`) exceeds HiGHS's dual bound
by at most ``gap_tolerance = (0.01 + bound_slack) / sigma``, a hundredth of one bit/s of
redundancy in the interval with the most necessary traffic plus the bound's float error
(:func:`agents.exact.bound_slack`); HiGHS's own pruning tolerance is 1e-6 units. Otherwise
the status is ``time_limit`` (HiGHS stopped at the time limit) or ``unproven``, with the
bound in ``dual_bound``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from envs.dsmd.cost import CostState, evaluate
from envs.dsmd.cost import subscriptions as cost_subscriptions
from envs.dsmd.instance import DSMDInstance

from .exact import (
    InstanceTooLarge,
    IntervalBlock,
    SparseMILP,
    add_interval,
    bound_slack,
    milp_size,
    symmetry_mask,
)
from .greedy import violation
from .policy import PolicyError

__all__ = ["OracleResult", "online_cost", "online_milp_size", "solve_online_oracle",
           "subscriptions"]

_PROOF_UNITS = 0.01  # objective units (<= 1 bit/s of redundancy) a proven plan may exceed


@dataclass(frozen=True)
class OracleResult:
    """The oracle's plan and what is proven about it (module docstring)."""

    channels: list[np.ndarray]  # one per interval, aligned with the instance's rows
    objective: float  # online_cost of ``channels``, exact
    dual_bound: float | None  # no plan costs less than this (up to gap_tolerance)
    status: str  # "optimal", "time_limit" or "unproven"
    time_s: float
    variables: int
    gap_tolerance: float = 0.0  # what "optimal" allows above dual_bound, cost units


# ---------------------------------------------------------------------- the definition
def subscriptions(inst: DSMDInstance, channel: np.ndarray) -> np.ndarray:
    """Eq. 1's ``z`` as a bool matrix ``[N, K]`` (topic ``t`` is column ``t - 1``): the
    transpose of :func:`envs.dsmd.cost.subscriptions`."""
    return cost_subscriptions(inst, channel).T


def _initial_channels(inst: DSMDInstance, initial_channel: dict[int, int]) -> np.ndarray:
    missing = [int(g) for g in inst.catalog_index if int(g) not in initial_channel]
    if missing:
        raise ValueError(f"initial_instance has types {missing[:5]} without an initial channel")
    return np.array([initial_channel[int(g)] for g in inst.catalog_index], dtype=np.int64)


def _check(instances: Sequence[DSMDInstance], initial_channel: dict[int, int] | None,
           initial_instance: DSMDInstance | None) -> None:
    if initial_instance is not None and initial_channel is None:
        raise ValueError("initial_instance needs initial_channel (its types' channels)")
    every = list(instances) + ([initial_instance] if initial_instance is not None else [])
    if not instances:
        raise ValueError("the horizon needs at least one interval")
    n, k = every[0].num_nodes, every[0].num_topics
    for inst in every:
        if (inst.num_nodes, inst.num_topics) != (n, k):
            raise ValueError("every interval must have the same nodes and K")
        if np.unique(inst.catalog_index).size != inst.num_types:
            raise ValueError(f"{inst.name or 'an interval'} lists a type id twice")
    if initial_channel and any(not 0 <= int(c) <= k for c in initial_channel.values()):
        raise ValueError(f"initial channels must be in 0..{k}")


def online_cost(instances: Sequence[DSMDInstance], channels: Sequence[np.ndarray],
                w_violation: float, w_subscribe: float, w_move: float,
                initial_channel: dict[int, int] | None = None,
                initial_instance: DSMDInstance | None = None) -> float:
    """The online cost of a plan (module docstring), from the exact integer cost model."""
    _check(instances, initial_channel, initial_instance)
    if len(channels) != len(instances):
        raise ValueError(f"{len(channels)} channel vectors for {len(instances)} intervals")
    last: dict[int, int] = {int(g): int(c) for g, c in (initial_channel or {}).items()}
    prev_z: np.ndarray | None = None
    if initial_instance is not None:
        prev_z = subscriptions(initial_instance,
                               _initial_channels(initial_instance, initial_channel or {}))
    elif initial_channel is not None:
        prev_z = np.zeros((instances[0].num_nodes, instances[0].num_topics), dtype=bool)
    total = 0.0
    for inst, plan in zip(instances, channels):
        ch = np.asarray(plan, dtype=np.int64)
        if ch.size and ch.min() < 0:
            raise ValueError("a plan assigns every type a channel (no -1)")
        snap = evaluate(inst, ch)
        ratio = snap.total_traffic / snap.necessary if snap.necessary else 1.0
        z = subscriptions(inst, ch)
        si = int(np.count_nonzero(z != prev_z)) if prev_z is not None else 0
        moves = 0
        for g, c in zip(inst.catalog_index.tolist(), ch.tolist()):
            if g in last and last[g] != c:
                moves += 1
            last[g] = c
        total += (ratio + w_violation * violation(CostState(inst, ch))
                  + w_subscribe * si + w_move * moves)
        prev_z = z
    return total


# ---------------------------------------------------------------------- the MILP
def _last_seen(instances: Sequence[DSMDInstance]) -> list[list[tuple[int, int] | None]]:
    """For each interval and row, (interval, row) of the type's previous appearance."""
    where: dict[int, tuple[int, int]] = {}
    out = []
    for i, inst in enumerate(instances):
        out.append([where.get(g) for g in inst.catalog_index.tolist()])
        for m, g in enumerate(inst.catalog_index.tolist()):
            where[g] = (i, m)
    return out


def online_milp_size(instances: Sequence[DSMDInstance], w_violation: float = 1.0,
                     w_subscribe: float = 1.0, w_move: float = 1.0) -> dict[str, int]:
    """Columns of the oracle's MILP: Eq. 1's per interval, slacks, SI and move variables
    (a zero weight drops its variables; switching terms against the initial state need
    none)."""
    size = {"intervals": len(instances), "eq1": 0, "slacks": 0, "subscribe": 0, "moves": 0}
    prev_free: np.ndarray | None = None
    for inst, seen in zip(instances, _last_seen(instances)):
        size["eq1"] += milp_size(inst)["variables"]
        if w_violation > 0:
            size["slacks"] += 2 + inst.num_nodes
        free = np.zeros((inst.num_nodes, inst.num_topics), dtype=bool)
        free[np.unique(inst.dest_idx)] = True  # z[n,t] not fixed to 0
        if w_subscribe > 0 and prev_free is not None:
            size["subscribe"] += int(np.count_nonzero(free & prev_free))
        if w_move > 0:
            size["moves"] += sum(s is not None for s in seen)
        prev_free = free
    size["variables"] = size["eq1"] + size["slacks"] + size["subscribe"] + size["moves"]
    return size


def solve_online_oracle(instances: Sequence[DSMDInstance], w_violation: float,
                        w_subscribe: float, w_move: float,
                        initial_channel: dict[int, int] | None = None,
                        initial_instance: DSMDInstance | None = None,
                        time_limit_s: float = 60.0, max_variables: int = 20_000) -> OracleResult:
    """The plan of least online cost over ``instances`` in hindsight (module docstring).

    ``initial_channel`` maps type ids to the channel they had before interval 0;
    ``initial_instance`` is the interval before 0 (its subscriptions under
    ``initial_channel`` are interval 0's previous ones). Raises :class:`InstanceTooLarge`
    above ``max_variables`` columns. Without a plan at the time limit, the plan is all RPC
    (status ``time_limit``)."""
    t0 = time.perf_counter()
    instances = list(instances)
    _check(instances, initial_channel, initial_instance)
    for k, w in (("w_violation", w_violation), ("w_subscribe", w_subscribe),
                 ("w_move", w_move)):
        if not (np.isfinite(w) and w >= 0):
            raise ValueError(f"{k} must be a finite number >= 0, got {w!r}")
    size = online_milp_size(instances, w_violation, w_subscribe, w_move)
    if size["variables"] > max_variables:
        raise InstanceTooLarge(
            f"online oracle MILP over {len(instances)} intervals needs {size['variables']} "
            f"variables (> max_variables={max_variables}): {size['eq1']} for Eq. 1, "
            f"{size['slacks']} slacks, {size['subscribe']} subscription changes, "
            f"{size['moves']} moves")
    N, K = instances[0].num_nodes, instances[0].num_topics
    peak = max(inst.necessary_bps for inst in instances)
    sigma = float(max(1, peak))
    initial = {int(g): int(c) for g, c in (initial_channel or {}).items()}
    z_init: np.ndarray | None = None
    if initial_instance is not None:
        z_init = subscriptions(initial_instance, _initial_channels(initial_instance, initial))
    elif initial_channel is not None:
        z_init = np.zeros((N, K), dtype=bool)
    # free (interchangeable) topics: no initial subscription, no initial channel in use
    ids = {g for inst in instances for g in inst.catalog_index.tolist()}
    used = {c for g, c in initial.items() if g in ids and c > 0}
    if z_init is not None:
        used |= {int(t) + 1 for t in np.flatnonzero(z_init.any(axis=0))}
    free = [t for t in range(1, K + 1) if t not in used]

    model = SparseMILP()
    const = sigma * len(instances)  # the ratio's 1 (necessary / necessary) per interval
    blocks: list[IntervalBlock] = []
    offset = 0
    for i, (inst, seen) in enumerate(zip(instances, _last_seen(instances))):
        allowed, offset = symmetry_mask(inst, free, offset)
        nec = inst.necessary_bps
        blk = add_interval(model, inst, traffic_cost=sigma / nec if nec else 0.0,
                           allowed=allowed,
                           slack_cost=sigma * w_violation if w_violation > 0 else None,
                           exact_subscriptions=True)
        if w_violation == 0:  # no capacity term at all: drop the hard rows' limits
            for row, _ in blk.capacity_rows():
                model.hi[row] = np.inf
            model.hi[blk.cpu_row] = np.inf
        ws, wm = sigma * w_subscribe, sigma * w_move
        if ws > 0 and (i > 0 or z_init is not None):
            for n in range(N):
                for t in range(1, K + 1):
                    col = blk.z(n, t)
                    if i == 0:  # |z - z0| with z0 constant
                        assert z_init is not None
                        if z_init[n, t - 1]:
                            model.cost[col] -= ws
                            const += ws
                        else:
                            model.cost[col] += ws
                        continue
                    pcol = blocks[-1].z(n, t)
                    fixed, pfixed = model.ub[col] == 0.0, model.ub[pcol] == 0.0
                    if fixed and pfixed:
                        continue
                    if fixed or pfixed:  # |z - 0| = z
                        model.cost[pcol if fixed else col] += ws
                        continue
                    dv = model.columns(1, cost=ws)
                    model.row([(col, 1.0), (pcol, -1.0), (dv, -1.0)], -np.inf, 0.0)
                    model.row([(pcol, 1.0), (col, -1.0), (dv, -1.0)], -np.inf, 0.0)
        if wm > 0:
            for m, g in enumerate(inst.catalog_index.tolist()):
                cols = blk.channel_columns(m)
                if seen[m] is not None:
                    j, mj = seen[m]
                    pcols = blocks[j].channel_columns(mj)
                    mv = model.columns(1, cost=wm)
                    for c, pc in zip(cols, pcols):
                        model.row([(c, 1.0), (pc, -1.0), (mv, -1.0)], -np.inf, 0.0)
                elif g in initial:  # 1 - a[c0]
                    model.cost[cols[initial[g]]] -= wm
                    const += wm
        blocks.append(blk)
    nvar = model.num_columns
    assert nvar == size["variables"], (nvar, size)
    res = model.solve(max(time_limit_s - (time.perf_counter() - t0), 1.0), 0.0)
    if res.x is not None:
        channels = [blk.decode(res.x) for blk in blocks]
    else:  # no plan within the time limit (soft capacities: every plan is feasible)
        if res.status != 1:
            raise PolicyError(f"online oracle: HiGHS status {res.status} ({res.message})")
        channels = [np.zeros(inst.num_types, dtype=np.int64) for inst in instances]
    objective = online_cost(instances, channels, w_violation, w_subscribe, w_move,
                            initial_channel, initial_instance)
    bound_units = getattr(res, "mip_dual_bound", None)
    dual_bound: float | None = None
    tol = 0.0
    proven = False
    if bound_units is not None and np.isfinite(bound_units):
        total_units = float(bound_units) + const
        tol = (_PROOF_UNITS + bound_slack(total_units, nvar)) / sigma
        dual_bound = total_units / sigma
        proven = res.status in (0, 1) and objective <= dual_bound + tol
    status = "optimal" if proven else ("time_limit" if res.status == 1 else "unproven")
    return OracleResult(channels, float(objective), dual_bound, status,
                        time.perf_counter() - t0, nvar, tol)
