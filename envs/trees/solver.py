"""Exact multicast trees of Optimal Multicast (Zhu et al.) Section VI: Theorem 1 (a path for
small groups without service nodes) and Theorem 2 / Corollary 3 / Algorithm 1 (service nodes
sorted by weight, the optimal ``k*`` in one linear pass, the unique degree distribution, the
min-height ``D``-ary tree and its closed-form forwarding rules and parent indices), with the
load-balancing weights of Section VII-B.

Three corrections to the paper's text, each checked by brute force in
``tests/test_trees_solver.py``:

* **The count of degree-``D`` nodes.** Lemma 2 / Algorithm 1 set ``x = (n - 2) mod k`` nodes
  to degree ``D = ceil((n + k - 2)/k)`` and the rest to ``D - 1``. When ``k`` divides
  ``n - 2`` (always when ``k = 1``) that gives ``x = 0`` and degrees summing to
  ``n - 2 < n + k - 2``: ``k`` nodes would be left without a parent. The paper's count is right
  for the degrees ``floor((n + k - 2)/k) + 1`` and ``floor((n + k - 2)/k)``, which equal
  ``D`` and ``D - 1`` except in that case, where every node has degree ``D``. Here
  ``x = (n + k - 2) - k (D - 1)`` (``= (n - 2) mod k`` unless that is 0, then ``k``), which
  makes lines 6-7 of Algorithm 1 describe a spanning tree in every case.
* **The range of ``k``.** Theorem 2 assumes ``m <= n`` "without loss of generality". It is
  not: every employed service node adds one stream to objective (3) (``n + k - 2`` streams in
  all), so when ``lambda w`` is small a chain of extra relays can pay. The search runs over
  all ``k = 1..m``, still one linear pass.
* **Lemma 1's order of degrees.** Lemma 1 says out degrees must not increase along a path
  from the root, so that every stream runs at ``f(D, r)`` and a tree over ``k`` nodes is
  worth ``(n + k - 2) f(D, r)`` (Lemma 2). With ``f = min(g(d), r)`` the opposite order is
  better whenever the group saturates at degree ``D`` (``r > g(D)``) and not all degrees
  are equal: a degree-``(D - 1)`` node above the degree-``D`` ones sends
  ``min(g(D - 1), r) > f(D, r)`` per stream, and the tree is worth
  ``x U(D, r) + (k - x) U(D - 1, r)``, which is also an upper bound for any tree over ``k``
  nodes (``U(d, r_v) <= U(d, r)`` and Jensen on the concave ``U(., r)``, as in Theorem 1's
  proof). Smallest counterexample: ``n = 5``, ``k = 2``, ``r = 0.8``: Corollary 3 gives
  degrees (3, 2) worth ``5 g(3) = 2.116`` Gbps, degrees (2, 3) give
  ``2 g(2) + 3 g(3) = 2.377``. :func:`algorithm1` implements both (``variant="paper"``,
  ``variant="exact"``, the default); the exact one differs from the paper's only in
  saturated groups.

Rates are in Gbps. The functions take plain arrays so the environment, the baselines and the
benchmark share them. The solver lives beside the model (gymnasium-free) because
``smart/MulticastTree-v0``'s dynamics build every tree with it; :mod:`agents.trees.solver`
is its public name among the solvers and baselines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import overload

import numpy as np

from .errors import MulticastError
from .switch import SwitchModel
from .tree import MulticastTree, kary_tree

__all__ = [
    "CAPACITY_GBPS",
    "VARIANTS",
    "Algorithm1Result",
    "algorithm1",
    "algorithm1_ordered",
    "check_group",
    "corollary3_tree",
    "degree_distribution",
    "forwarding_rules",
    "k_values",
    "load_weights",
    "max_degree",
    "parent_indices",
    "theorem1_path",
]

#: Omega of Section VII-B: the highest input rate a service node supports (Gbps).
CAPACITY_GBPS = 32.0


def check_group(n: int, r: float) -> None:
    """Refuse a group without receivers or with a negative / non-finite rate."""
    if int(n) != n or n < 2:
        raise MulticastError(f"a group needs the source and at least one receiver "
                             f"(n >= 2 hypervisors), got n = {n}")
    if not (np.isfinite(r) and r >= 0):
        raise MulticastError(f"group rate r must be finite and >= 0 Gbps, got {r}")


def load_weights(loads_gbps: np.ndarray, alpha: float = 1.0,
                 capacity_gbps: float = CAPACITY_GBPS) -> np.ndarray:
    """Section VII-B: ``w_i = -alpha log(1 - omega_i / Omega)`` for existing workloads
    ``omega_i`` (Gbps). A load at or above ``Omega``, or a negative one, is refused."""
    w = np.asarray(loads_gbps, dtype=float)
    if not alpha > 0:
        raise MulticastError(f"alpha must be > 0, got {alpha}")
    if not capacity_gbps > 0:
        raise MulticastError(f"capacity Omega must be > 0 Gbps, got {capacity_gbps}")
    bad = np.flatnonzero(~np.isfinite(w) | (w < 0))
    if len(bad):
        raise MulticastError(f"service node {int(bad[0])}: workload {w[bad[0]]} Gbps is not "
                             "a finite non-negative rate")
    full = np.flatnonzero(w >= capacity_gbps)
    if len(full):
        i = int(full[0])
        raise MulticastError(f"service node {i}: workload {w[i]:g} Gbps is at or above the "
                             f"capacity Omega = {capacity_gbps:g} Gbps (its weight would be "
                             "infinite); leave it out of the candidates")
    return -alpha * np.log1p(-w / capacity_gbps)


def theorem1_path(n: int) -> MulticastTree:
    """Theorem 1: without service nodes the path ``h1 -> h2 -> ... -> hn`` maximises (1)."""
    check_group(n, 0.0)
    return kary_tree(n, 1)


@overload
def max_degree(n: int, k: np.ndarray) -> np.ndarray: ...
@overload
def max_degree(n: int, k: int) -> np.integer: ...
def max_degree(n: int, k: np.ndarray | int) -> np.ndarray | np.integer:
    """``D = ceil((n + k - 2) / k)`` (Lemma 2), elementwise (a NumPy integer for an int
    ``k``)."""
    d: np.ndarray | np.integer = -(-(n + np.asarray(k) - 2) // np.asarray(k))
    return d


def _plan(n: int, k: int) -> tuple[int, int]:
    """``(D, x)``: max degree and how many service nodes have it (see the module note)."""
    if k < 1:
        raise MulticastError(f"k must be >= 1 service node, got {k}")
    check_group(n, 0.0)
    d = int(max_degree(n, k))
    return d, (n + k - 2) - k * (d - 1)


def degree_distribution(n: int, k: int) -> np.ndarray:
    """Out degrees of ``s1..sk`` in the optimal tree (Lemma 2): ``x`` nodes of degree ``D``
    then ``k - x`` of degree ``D - 1``; they sum to ``n + k - 2``."""
    d, x = _plan(n, k)
    return np.concatenate([np.full(x, d), np.full(k - x, d - 1)]).astype(np.int64)


def _groups(n: int, k: int, ascending: bool) -> tuple[int, int, int]:
    """``(d_first, n_first, d_rest)``: the first ``n_first`` service nodes (in index order)
    get ``d_first`` children each, the others ``d_rest``."""
    d, x = _plan(n, k)
    return (d - 1, k - x, d) if ascending else (d, x, d - 1)


def forwarding_rules(n: int, k: int, ascending: bool = False) -> np.ndarray:
    """Algorithm 1 line 6: row ``j - 1`` = ``(first, last)`` node index that service node
    ``j`` (index ``j``) forwards to, inclusive (``first > last``: none). Node indices follow
    the order ``h1, s1, ..., sk, h2, ..., hn`` (0 .. n + k - 1). ``ascending``: the
    degree-``(D - 1)`` nodes come first (:func:`algorithm1`'s exact arrangement)."""
    a, x, b = _groups(n, k, ascending)
    j = np.arange(1, k + 1)
    first = np.where(j <= x, (j - 1) * a + 2, x * a + (j - 1 - x) * b + 2)
    last = np.where(j <= x, j * a + 1, x * a + (j - x) * b + 1)
    return np.stack([first, last], axis=1).astype(np.int64)


def parent_indices(n: int, k: int, ascending: bool = False) -> np.ndarray:
    """Algorithm 1 line 7: the closed-form parent index ``p(y)`` of every node
    ``y = 0 .. n + k - 1`` (``p(0) = -1``); with the paper's groups
    (``a = D``, ``b = D - 1``): ``p(y) = floor((y - 2)/D) + 1`` for ``2 <= y <= xD + 1`` and
    ``floor((y - (x + 2))/(D - 1)) + 1`` after (written here as
    ``floor((y - 2 - xD)/(D - 1)) + x + 1``, the same)."""
    a, x, b = _groups(n, k, ascending)
    y = np.arange(n + k, dtype=np.int64)
    p = np.empty(n + k, dtype=np.int64)
    p[0], p[1] = -1, 0
    head = (y >= 2) & (y <= x * a + 1)
    tail = y >= x * a + 2
    if head.any():  # empty when no node has degree a (x = 0)
        p[head] = (y[head] - 2) // a + 1
    if tail.any():  # empty when every node has degree a (then b may be 0)
        p[tail] = (y[tail] - 2 - x * a) // b + x + 1
    return p


def corollary3_tree(n: int, service_ids: np.ndarray, ascending: bool = False
                    ) -> MulticastTree:
    """Corollary 3: the min-height ``D``-ary tree over ``service_ids`` (in order
    ``s1..sk``); ``ascending`` puts the degree-``(D - 1)`` nodes above the degree-``D``
    ones."""
    sid = np.asarray(service_ids, dtype=np.int64)
    k = len(sid)
    labels = np.full(n + k, -1, dtype=np.int64)
    labels[1:k + 1] = sid
    return MulticastTree(parent_indices(n, k, ascending), labels)


VARIANTS = ("exact", "paper")


def k_values(n: int, r: float, sorted_weights: np.ndarray, switch: SwitchModel, lam: float,
             variant: str = "exact") -> np.ndarray:
    """Objective (3) of the best tree over the ``k`` least-weight service nodes, for every
    ``k = 1..m``, in one linear pass over the cumulative weights ``W_k`` (Theorem 2).

    ``variant="paper"``: Lemma 2's value ``(n + k - 2) f(D, r) - lam W_k``.
    ``variant="exact"``: ``x U(D, r) + (k - x) U(D - 1, r) - lam W_k`` (see the module note).
    """
    if variant not in VARIANTS:
        raise MulticastError(f"variant must be one of {VARIANTS}, got {variant!r}")
    ks = np.arange(1, len(sorted_weights) + 1)
    d = max_degree(n, ks)
    x = (n + ks - 2) - ks * (d - 1)
    f_d = np.minimum(switch.g_many(d), r)
    if variant == "paper":
        thr = (n + ks - 2) * f_d
    else:
        f_d1 = np.where(d > 1, np.minimum(switch.g_many(np.maximum(d - 1, 1)), r), 0.0)
        thr = x * d * f_d + (ks - x) * (d - 1) * f_d1
    objective: np.ndarray = thr - lam * np.cumsum(sorted_weights)
    return objective


@dataclass(frozen=True, eq=False)
class Algorithm1Result:
    """Algorithm 1's decision for one group."""

    k: int                      # k*: service nodes employed
    D: int                      # max out degree ceil((n + k* - 2) / k*)
    x: int                      # service nodes with degree D
    selected: np.ndarray        # their ids s1..sk* (least weight first)
    degrees: np.ndarray         # out degrees of s1..sk*
    rules: np.ndarray           # forwarding_rules(n, k*)
    tree: MulticastTree
    ascending: bool             # degree-(D-1) nodes above degree-D ones (exact, saturated)
    value: float                # objective (3) of ``tree`` (k_values at k*)
    values: np.ndarray          # k_values for every k = 1..m


def algorithm1(n: int, r: float, weights: np.ndarray, switch: SwitchModel, lam: float,
               candidates: np.ndarray | None = None, variant: str = "exact"
               ) -> Algorithm1Result:
    """Algorithm 1 for a group of ``n`` hypervisors (``h1`` the source) at rate ``r``.

    ``variant="paper"``: Theorem 2's ``k*`` and Corollary 3's tree (degree-``D`` nodes
    nearest the root), with the count fix of the module note. ``variant="exact"``: ``k*``
    by the exact value, and when the group is saturated at degree ``D``
    (``r > g(D)``, ``x < k``) the degree-``(D - 1)`` nodes placed above the degree-``D``
    ones, otherwise Corollary 3's tree. The exact variant reaches the optimum of (3) and the
    minimum height among optimal trees with Lemma 2's degree distribution (brute force).

    ``weights[i]`` is service node ``i``'s load weight (:func:`load_weights`); only
    ``candidates`` (default: all) may be employed. Ties in weight are broken by id (a stable
    sort) and ties in value by the smaller ``k``.
    """
    check_group(n, r)
    w = np.asarray(weights, dtype=float)
    ids = np.arange(len(w)) if candidates is None else np.asarray(candidates, dtype=np.int64)
    if len(ids) == 0:
        raise MulticastError("no candidate service nodes: Algorithm 1 needs at least one")
    cw = w[ids]
    bad = np.flatnonzero(~np.isfinite(cw) | (cw < 0))
    if len(bad):
        raise MulticastError(f"service node {int(ids[bad[0]])}: weight {cw[bad[0]]} is not "
                             "finite and >= 0 (is its workload at or above the capacity?)")
    return algorithm1_ordered(n, r, ids[np.argsort(cw, kind="stable")], w, switch, lam,
                              variant)


def algorithm1_ordered(n: int, r: float, ordered_ids: np.ndarray, weights: np.ndarray,
                       switch: SwitchModel, lam: float, variant: str = "exact"
                       ) -> Algorithm1Result:
    """Algorithm 1 with the candidates taken in the given order instead of by weight: ``k*``
    maximises the value of the first ``k`` of ``ordered_ids`` (the environment's action
    supplies the order). With ids sorted by weight this is :func:`algorithm1`."""
    check_group(n, r)
    if lam < 0 or not np.isfinite(lam):
        raise MulticastError(f"lambda must be finite and >= 0, got {lam}")
    ids = np.asarray(ordered_ids, dtype=np.int64)
    if len(ids) == 0:
        raise MulticastError("no candidate service nodes: Algorithm 1 needs at least one")
    vals = k_values(n, r, np.asarray(weights, dtype=float)[ids], switch, lam, variant)
    k = int(np.argmax(vals)) + 1
    selected = ids[:k]
    d, x = _plan(n, k)
    asc = variant == "exact" and x < k and r > switch.g(d)
    degrees = degree_distribution(n, k)
    return Algorithm1Result(k=k, D=d, x=x, selected=selected,
                            degrees=degrees[::-1].copy() if asc else degrees,
                            rules=forwarding_rules(n, k, asc),
                            tree=corollary3_tree(n, selected, asc), ascending=asc,
                            value=float(vals[k - 1]), values=vals)
