"""Multicast trees, their validation and their objective values (Sections V-VI of
Optimal Multicast, Zhu et al.).

A tree is a parent array over node indices with the source hypervisor ``h1`` at index 0
(``parent[0] = -1``) and a mask of which nodes are service nodes. Trees built by
Algorithm 1 use its index order ``h1, s1, ..., sk, h2, ..., hn``.

Rates propagate from the root: the source sends at ``r``; a node ``v`` with out degree
``d(v)`` and input rate ``r(v)`` sends ``f(d(v), r(v))`` on each of its output streams, so
each child receives that (Section IV's model; store-and-forward itself costs nothing, Fig. 5).

* Objective (1) (small groups, no service nodes): ``sum_v U(d(v), r(v))`` over all nodes.
* Objective (3) (service nodes): ``sum_{s in F_s} U(d(s), r(s)) - lambda sum_{s in F_s} w_s``
  over the employed service nodes ``F_s``; constraints (4)-(7): the source sends to exactly
  one service node, receiving hypervisors are leaves, the service nodes form a tree.
* ``local_delivery`` (the accounting of Section VII-A / Fig. 8): each receiving hypervisor's
  switch also sends one stream to its attached VM, so its out degree is
  ``children + 1`` and the VM receives ``f(children + 1, r(v))``.

This module does not import gymnasium.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import MulticastError
from .switch import SwitchModel

__all__ = [
    "MulticastTree",
    "TreeRates",
    "evaluate_tree",
    "kary_tree",
    "objective1",
    "objective3",
]


@dataclass(frozen=True, eq=False)
class MulticastTree:
    """A rooted multicast tree. ``service_ids[v]`` is the cluster-wide id of service node
    ``v`` (``-1`` for hypervisors); ``service`` is ``service_ids >= 0``."""

    parent: np.ndarray
    service_ids: np.ndarray

    @classmethod
    def from_parents(cls, parent: Sequence[int], service_ids: Sequence[int] | None = None
                     ) -> MulticastTree:
        p = np.asarray(parent, dtype=np.int64)
        sid = (np.full(len(p), -1, dtype=np.int64) if service_ids is None
               else np.asarray(service_ids, dtype=np.int64))
        tree = cls(p, sid)
        tree.validate()
        return tree

    @property
    def num_nodes(self) -> int:
        return len(self.parent)

    @property
    def service(self) -> np.ndarray:
        return self.service_ids >= 0

    @property
    def receivers(self) -> np.ndarray:
        """Indices of the receiving hypervisors (every hypervisor but the source)."""
        idx = np.flatnonzero(~self.service)
        out: np.ndarray = idx[idx != 0]
        return out

    def out_degrees(self) -> np.ndarray:
        return np.bincount(self.parent[1:], minlength=self.num_nodes).astype(np.int64)

    def children(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for v in range(1, self.num_nodes):
            out[int(self.parent[v])].append(v)
        return out

    def bfs_order(self) -> np.ndarray:
        """Nodes in breadth-first order from the source."""
        kids = self.children()
        order = [0]
        for v in order:
            order.extend(kids[v])
        return np.asarray(order, dtype=np.int64)

    def depths(self) -> np.ndarray:
        """Hops from the source to each node."""
        depth = np.zeros(self.num_nodes, dtype=np.int64)
        for v in self.bfs_order()[1:]:
            depth[v] = depth[self.parent[v]] + 1
        return depth

    def height(self) -> int:
        """The worst number of hops from the source to a receiving hypervisor."""
        rec = self.receivers
        return int(self.depths()[rec].max()) if len(rec) else 0

    def validate(self, *, service_tree: bool | None = None) -> None:
        """Check that this is a tree rooted at the source: ``parent[0] = -1``, every other
        node has exactly one parent among the nodes, all reachable (connected, acyclic).

        ``service_tree`` (default: whether the tree has service nodes) also checks
        constraints (4)-(7): the source's only child is a service node, receiving
        hypervisors are leaves, every receiver hangs off a service node, service-node ids
        are distinct.
        """
        n = self.num_nodes
        if self.parent.ndim != 1 or n < 2:
            raise MulticastError(f"tree: need a 1-d parent array over >= 2 nodes, got shape "
                                 f"{self.parent.shape}")
        if self.service_ids.shape != self.parent.shape:
            raise MulticastError(f"tree: service_ids has shape {self.service_ids.shape}, "
                                 f"parent has {self.parent.shape}")
        if self.parent[0] != -1:
            raise MulticastError(f"tree: the source (node 0) must have parent -1, got "
                                 f"{self.parent[0]}")
        if self.service_ids[0] >= 0:
            raise MulticastError("tree: node 0 must be the source hypervisor, not a service "
                                 "node")
        bad = np.flatnonzero((self.parent[1:] < 0) | (self.parent[1:] >= n)) + 1
        if len(bad):
            v = int(bad[0])
            raise MulticastError(f"tree: node {v} has parent {self.parent[v]}, not a node "
                                 f"index in [0, {n}) (every receiver needs exactly one "
                                 "parent)")
        if np.any(self.parent[1:] == np.arange(1, n)):
            v = int(np.flatnonzero(self.parent[1:] == np.arange(1, n))[0]) + 1
            raise MulticastError(f"tree: node {v} is its own parent")
        reached = len(self.bfs_order())
        if reached != n:
            raise MulticastError(f"tree: only {reached} of {n} nodes are reachable from the "
                                 "source (the parent array has a cycle)")
        has_sn = bool(self.service.any())
        if service_tree is None:
            service_tree = has_sn
        if not service_tree:
            return
        sids = self.service_ids[self.service]
        if len(np.unique(sids)) != len(sids):
            raise MulticastError("tree: a service node appears twice")
        deg = self.out_degrees()
        if deg[0] != 1 or not self.service[np.flatnonzero(self.parent == 0)[0]]:
            raise MulticastError("tree: with service nodes the source must send to exactly "
                                 f"one service node (it has {deg[0]} children)")
        rec = self.receivers
        if np.any(deg[rec] > 0):
            v = int(rec[deg[rec] > 0][0])
            raise MulticastError(f"tree: receiving hypervisor {v} forwards; with service "
                                 "nodes receivers must be leaves (constraint (6))")
        if np.any(~self.service[self.parent[rec]]):
            v = int(rec[~self.service[self.parent[rec]]][0])
            raise MulticastError(f"tree: receiver {v} hangs off a hypervisor, not a "
                                 "service node")


@dataclass(frozen=True)
class TreeRates:
    """Per-node rates (Gbps) of a tree for one group rate."""

    out_degree: np.ndarray     # streams sent (incl. the local VM stream with local_delivery)
    input_rate: np.ndarray     # rate each node receives (the source: r)
    output_rate: np.ndarray    # U(d, r_in) per node
    delivered: np.ndarray      # rate delivered at each receiving hypervisor (its VM)


def evaluate_tree(tree: MulticastTree, switch: SwitchModel, r: float, *,
                  local_delivery: bool = False) -> TreeRates:
    """Propagate the group rate ``r`` down ``tree`` (Section IV's f and U)."""
    if not (r >= 0 and np.isfinite(r)):
        raise MulticastError(f"group rate r must be finite and >= 0, got {r}")
    deg = tree.out_degrees()
    rec = tree.receivers
    if local_delivery:
        deg = deg.copy()
        deg[rec] += 1
    rin = np.zeros(tree.num_nodes)
    per_stream = np.zeros(tree.num_nodes)
    rin[0] = r
    for v in tree.bfs_order():
        if v:
            rin[v] = per_stream[tree.parent[v]]
        per_stream[v] = switch.f(int(deg[v]), float(rin[v]))
    out = deg * per_stream
    delivered = per_stream[rec] if local_delivery else rin[rec]
    return TreeRates(deg, rin, out, delivered)


def objective1(tree: MulticastTree, switch: SwitchModel, r: float) -> float:
    """Objective (1): the total sending rate ``sum_v U(d(v), r(v))`` of all nodes."""
    return float(evaluate_tree(tree, switch, r).output_rate.sum())


def objective3(tree: MulticastTree, switch: SwitchModel, r: float, weights: np.ndarray,
               lam: float) -> float:
    """Objective (3): service-node throughput minus ``lam`` times the employed service
    nodes' weights; ``weights`` is indexed by the cluster-wide service-node id."""
    rates = evaluate_tree(tree, switch, r)
    sn = tree.service
    return float(rates.output_rate[sn].sum() - lam * np.asarray(weights)[tree.service_ids[sn]]
                 .sum())


def kary_tree(n: int, k: int) -> MulticastTree:
    """``n`` hypervisors in a complete ``k``-ary tree in heap order (node ``v``'s parent is
    ``(v - 1) // k``): ``k = 1`` is the path of Theorem 1, ``k = n - 1`` the star,
    ``k = 2, 3`` the binary and ternary trees of Fig. 8."""
    if n < 2:
        raise MulticastError(f"a group needs the source and >= 1 receiver, got n = {n}")
    if k < 1:
        raise MulticastError(f"tree arity k must be >= 1, got {k}")
    parent = np.concatenate([[-1], (np.arange(1, n) - 1) // k])
    return MulticastTree(parent.astype(np.int64), np.full(n, -1, dtype=np.int64))
