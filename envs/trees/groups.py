"""The evaluation setup of Section VII-B of Optimal Multicast (Zhu et al.): a cluster of
service nodes with background load, multicast groups (a source hypervisor with its
receiving hypervisors; the paper calls a group a "session") joining one after another, and
the bookkeeping of each placement (objective (3), per-stream rates, service-node workloads).

Paper defaults (:class:`GroupSpec`, :class:`ClusterSpec`): 100 service nodes "with some
initial background flows" (the amount is not given; here uniform in 0-16 Gbps, half of the
capacity ``Omega = 32`` Gbps), 100 groups, rates uniform in 0-100 Mbps, 10-200 hypervisors
each (uniform). A service node's workload ``omega`` is its total input rate (Section VII-B):
employing it in a group adds the rate it receives in that group's tree.

This module does not import gymnasium.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import MulticastError
from .switch import SwitchModel
from .tree import MulticastTree, evaluate_tree

__all__ = [
    "ClusterSpec",
    "ClusterState",
    "GroupSpec",
    "Groups",
    "Placement",
    "background_loads",
    "generate_groups",
]


def _check_range(name: str, lo: float, hi: float, minimum: float) -> None:
    if not (minimum <= lo <= hi):
        raise MulticastError(f"{name} must satisfy {minimum} <= low <= high, got "
                             f"({lo}, {hi})")


@dataclass(frozen=True)
class GroupSpec:
    """How groups are drawn: ``num_groups``, hypervisors per group (inclusive
    range, the source included) and rates (Gbps, uniform)."""

    num_groups: int = 100
    hypervisors: tuple[int, int] = (10, 200)
    rate_gbps: tuple[float, float] = (0.0, 0.1)

    def __post_init__(self) -> None:
        if self.num_groups < 1:
            raise MulticastError(f"num_groups must be >= 1, got {self.num_groups}")
        _check_range("hypervisors", *self.hypervisors, minimum=2)
        _check_range("rate_gbps", *self.rate_gbps, minimum=0.0)


@dataclass(frozen=True)
class ClusterSpec:
    """The service-node cluster: how many, background load range (Gbps), capacity
    ``Omega``, weight coefficient ``alpha`` and the trade-off ``lam`` of (3)."""

    num_service_nodes: int = 100
    background_gbps: tuple[float, float] = (0.0, 16.0)
    capacity_gbps: float = 32.0
    alpha: float = 1.0
    lam: float = 0.1

    def __post_init__(self) -> None:
        if self.num_service_nodes < 1:
            raise MulticastError("num_service_nodes must be >= 1, got "
                                 f"{self.num_service_nodes}")
        _check_range("background_gbps", *self.background_gbps, minimum=0.0)
        if self.background_gbps[1] >= self.capacity_gbps:
            raise MulticastError(f"background_gbps high {self.background_gbps[1]} must be "
                                 f"below the capacity {self.capacity_gbps}")
        if self.alpha <= 0 or self.lam < 0:
            raise MulticastError(f"need alpha > 0 and lam >= 0, got {self.alpha}, {self.lam}")


@dataclass(frozen=True)
class Groups:
    """A sequence of groups: hypervisor counts ``n`` and rates ``rate_gbps``."""

    n: np.ndarray
    rate_gbps: np.ndarray

    def __len__(self) -> int:
        return len(self.n)


def generate_groups(spec: GroupSpec, rng: np.random.Generator) -> Groups:
    """Draw ``spec.num_groups`` groups (Section VII-B)."""
    lo, hi = spec.hypervisors
    n = rng.integers(lo, hi + 1, size=spec.num_groups)
    r = rng.uniform(*spec.rate_gbps, size=spec.num_groups)
    return Groups(n.astype(np.int64), r)


def background_loads(spec: ClusterSpec, rng: np.random.Generator) -> np.ndarray:
    """Initial workload (Gbps) of every service node."""
    return rng.uniform(*spec.background_gbps, size=spec.num_service_nodes)


@dataclass(frozen=True)
class Placement:
    """What one group's tree achieved."""

    objective: float        # objective (3): service-node throughput - lam * weights
    throughput: float       # sum of U over the employed service nodes (Gbps)
    penalty: float          # lam * sum of their weights
    ratio: float            # mean per-stream receiving rate / r (Fig. 9)
    min_ratio: float        # worst receiver's rate / r
    k: int                  # service nodes employed
    height: int             # worst hops from the source to a receiver


@dataclass
class ClusterState:
    """Service-node workloads evolving as groups are placed."""

    spec: ClusterSpec
    switch: SwitchModel
    loads: np.ndarray
    initial: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.loads = np.asarray(self.loads, dtype=float).copy()
        if self.loads.shape != (self.spec.num_service_nodes,):
            raise MulticastError(f"loads has shape {self.loads.shape}, expected "
                                 f"({self.spec.num_service_nodes},)")
        self.initial = self.loads.copy()

    def weights(self) -> np.ndarray:
        """``w_i = -alpha log(1 - omega_i / Omega)``; ``inf`` for a full node."""
        frac = np.minimum(self.loads / self.spec.capacity_gbps, 1.0)
        with np.errstate(divide="ignore"):
            return -self.spec.alpha * np.log1p(-frac)

    def available(self, r: float) -> np.ndarray:
        """Ids of the service nodes whose remaining capacity exceeds ``r``."""
        return np.flatnonzero(self.loads + r < self.spec.capacity_gbps)

    def place(self, tree: MulticastTree, r: float) -> Placement:
        """Evaluate ``tree`` at rate ``r`` (objective (3)) and add each employed service
        node's input rate to its workload."""
        tree.validate(service_tree=True)
        rates = evaluate_tree(tree, self.switch, r)
        sn = np.flatnonzero(tree.service)
        ids = tree.service_ids[sn]
        if np.any(self.loads[ids] + rates.input_rate[sn] >= self.spec.capacity_gbps):
            full = ids[self.loads[ids] + rates.input_rate[sn] >= self.spec.capacity_gbps]
            raise MulticastError(f"service node {int(full[0])} would reach its capacity "
                                 f"{self.spec.capacity_gbps} Gbps")
        thr = float(rates.output_rate[sn].sum())
        pen = float(self.spec.lam * self.weights()[ids].sum())
        self.loads[ids] += rates.input_rate[sn]
        rec = rates.delivered
        ratio = float(rec.mean() / r) if r > 0 else 1.0
        return Placement(objective=thr - pen, throughput=thr, penalty=pen, ratio=ratio,
                         min_ratio=float(rec.min() / r) if r > 0 else 1.0, k=len(sn),
                         height=tree.height())
