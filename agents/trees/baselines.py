"""Baselines of Section VII of Optimal Multicast (Zhu et al.).

Small groups without service nodes (Fig. 8): the path of Theorem 1 against a star (the
source sends to every receiver), a binary and a ternary tree (heap order,
:func:`envs.trees.tree.kary_tree`).

Groups through the service-node cluster (Figs. 9-11), each a :data:`Scheme`: a function of
the cluster's current state, the group and a random stream that returns the tree:

* ``algorithm1``: Algorithm 1 over every service node with room for the group (the exact
  variant, :func:`envs.trees.solver.algorithm1`); ``algorithm1_paper``: the paper's
  Theorem 2 / Corollary 3 as written.
* ``random10``: Algorithm 1 over 10 service nodes sampled uniformly.
* ``nvp``: Baseline 1 (VMware NVP): the least-loaded service node alone sends to every
  receiver.
* ``binary``: Baseline 2: the 50 least-loaded service nodes, of which those with enough
  remaining capacity for the group's rate, connected in a binary tree (heap order), each
  handling two receiving hypervisors in breadth-first order; when there are more than two
  receivers per node the rest are dealt round-robin in the same order.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from envs.trees.errors import MulticastError
from envs.trees.groups import ClusterState
from envs.trees.tree import MulticastTree, kary_tree

from .solver import algorithm1, check_group, theorem1_path

__all__ = [
    "SCHEMES",
    "Scheme",
    "algorithm1_scheme",
    "binary_heuristic",
    "binary_tree_over",
    "nvp",
    "random_sampling",
    "small_group_trees",
]

#: (cluster state, hypervisors n, rate r, random stream) -> tree
Scheme = Callable[[ClusterState, int, float, np.random.Generator], MulticastTree]


def small_group_trees(n: int) -> dict[str, MulticastTree]:
    """Fig. 8's topologies over ``n`` hypervisors."""
    check_group(n, 0.0)
    return {"path": theorem1_path(n), "star": kary_tree(n, max(n - 1, 1)),
            "binary": kary_tree(n, 2), "ternary": kary_tree(n, 3)}


def _candidates(state: ClusterState, r: float) -> np.ndarray:
    ids = state.available(r)
    if len(ids) == 0:
        raise MulticastError(f"no service node has {r:g} Gbps of capacity left")
    return ids


def algorithm1_scheme(variant: str = "exact") -> Scheme:
    def scheme(state: ClusterState, n: int, r: float, rng: np.random.Generator
               ) -> MulticastTree:
        return algorithm1(n, r, state.weights(), state.switch, state.spec.lam,
                          _candidates(state, r), variant).tree
    return scheme


def random_sampling(sample: int = 10) -> Scheme:
    """Algorithm 1 with random sampling of ``sample`` service nodes."""
    def scheme(state: ClusterState, n: int, r: float, rng: np.random.Generator
               ) -> MulticastTree:
        ids = _candidates(state, r)
        pick = rng.choice(ids, size=min(sample, len(ids)), replace=False)
        return algorithm1(n, r, state.weights(), state.switch, state.spec.lam,
                          np.sort(pick)).tree
    return scheme


def nvp(state: ClusterState, n: int, r: float, rng: np.random.Generator) -> MulticastTree:
    """Baseline 1: the least-loaded service node serves every receiver."""
    ids = _candidates(state, r)
    best = ids[np.argmin(state.loads[ids])]
    return binary_tree_over(n, np.array([best]))


def binary_tree_over(n: int, service_ids: np.ndarray, per_node: int = 2) -> MulticastTree:
    """Service nodes in a binary heap; receivers ``per_node`` each in breadth-first order,
    the rest round-robin. Node order: ``h1, s1..sk, h2..hn``."""
    check_group(n, 0.0)
    sid = np.asarray(service_ids, dtype=np.int64)
    k = len(sid)
    parent = np.empty(n + k, dtype=np.int64)
    parent[0], parent[1] = -1, 0
    j = np.arange(2, k + 1)
    parent[j] = (j - 2) // 2 + 1        # s_j's parent in a binary heap over s_1..s_k
    rec = np.arange(n - 1)
    parent[k + 1:] = np.where(rec < per_node * k, rec // per_node, rec % k) + 1
    labels = np.full(n + k, -1, dtype=np.int64)
    labels[1:k + 1] = sid
    return MulticastTree(parent, labels)


def binary_heuristic(pool: int = 50) -> Scheme:
    """Baseline 2: the ``pool`` least-loaded nodes with room for ``r``, in a binary tree."""
    def scheme(state: ClusterState, n: int, r: float, rng: np.random.Generator
               ) -> MulticastTree:
        least = np.argsort(state.loads, kind="stable")[:pool]
        ok = least[state.loads[least] + r < state.spec.capacity_gbps]
        if len(ok) == 0:
            raise MulticastError(f"binary heuristic: none of the {pool} least-loaded service "
                                 f"nodes has {r:g} Gbps left")
        return binary_tree_over(n, ok)
    return scheme


SCHEMES: dict[str, Callable[[], Scheme]] = {
    "algorithm1": lambda: algorithm1_scheme("exact"),
    "algorithm1_paper": lambda: algorithm1_scheme("paper"),
    "random10": lambda: random_sampling(10),
    "nvp": lambda: nvp,
    "binary": lambda: binary_heuristic(50),
}
