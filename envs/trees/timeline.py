"""Multicast over time: groups that arrive and depart on a shared service-node cluster whose
background load evolves (the dynamics of ``smart/MulticastOverTime-v0``).

Optimal Multicast (Zhu et al.) places each group on the service nodes' current workloads
(Section VII-B: groups join one after another and never leave) and scores it by objective
(3) at that moment: service-node throughput minus ``lambda`` times the employed nodes' load
weights ``w = -alpha log(1 - omega / Omega)``. Here the groups also leave, the background
flows change with the time of day, and a group is scored over its **lifetime**:

    value_g = integral over [arrival, departure) of ( U_g - lambda sum_{i in g} w_i(t) ) dt

with ``U_g`` its service nodes' throughput (constant: it does not depend on the loads) and
``w_i(t)`` node ``i``'s weight at time ``t`` under the background then and the groups active
then. A placement's load is only borrowed, and what a node costs depends on its load over
the group's whole stay, not on the moment of arrival. Algorithm 1 stays optimal for objective
(3) at the arrival; it sees neither where the background is heading nor the groups to come.
The sequence objective is the sum of the values.

The process (every constant is a modelling choice, documented here and in the docs):

* **Arrivals.** A Poisson process of ``arrival_rate`` groups per unit of time; each group
  has ``n`` hypervisors and rate ``r`` drawn as in :class:`envs.trees.groups.GroupSpec`
  (uniform) and a holding time drawn from an exponential distribution of mean
  ``mean_duration`` (unknown to the policies). In steady state ``arrival_rate *
  mean_duration`` groups are active (Little's law).
* **Background.** Service node ``i`` carries ``b_i(t) = base_i (1 + amplitude
  sin(2 pi t / period + phase_i))``, ``base_i`` uniform in ``background_gbps`` and
  ``phase_i`` uniform in ``[0, 2 pi)``: a diurnal cycle per node, out of phase across nodes,
  known to the operator (:meth:`Timeline.background`).
* **Workload.** ``omega_i(t) = b_i(t) +`` the input rates of the active groups that employ
  ``i`` (as :meth:`envs.trees.groups.ClusterState.place` adds them). A group's load leaves
  with it. A node is available to a new group when ``omega_i + r < Omega``. The background
  growing under active groups is not checked against ``Omega`` (their streams keep their
  rates); a weight is capped at that of a node at ``weight_cap_frac`` of ``Omega``.
* **Integration.** Between two events (an arrival or a departure) the active set is fixed
  and only the background moves; the integral uses the midpoint rule on sub-steps of at
  most ``period / 200``.

:func:`isolation_bound` bounds any policy's sequence objective: each group placed alone on
the background of its lifetime, by Algorithm 1 on its nodes' lifetime-mean weights. The
value is linear in the weights' time integrals, so that tree is optimal for the group alone;
other groups only add load, which raises every weight and removes candidates.

This module does not import gymnasium.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .errors import MulticastError
from .groups import ClusterSpec, ClusterState, GroupSpec, Placement, _check_range
from .solver import algorithm1
from .switch import SwitchModel
from .tree import MulticastTree

__all__ = ["ActiveGroup", "SharedCluster", "Timeline", "TimelineSpec", "capped_weights",
           "check_peak", "expected_weights", "generate_timeline", "isolation_bound",
           "lifetime_weights"]

#: a weight is capped at that of a node loaded to this fraction of Omega (a background that
#: grows under active groups may take a node past its capacity; the model does not drop them)
WEIGHT_CAP_FRAC = 0.999
#: sub-steps per diurnal period, at least, in the integrals
STEPS_PER_PERIOD = 200


@dataclass(frozen=True)
class TimelineSpec:
    """How a group sequence over time is drawn (module docstring)."""

    groups: GroupSpec = field(default_factory=GroupSpec)
    arrival_rate: float = 1.0
    mean_duration: float = 10.0
    background_amplitude: float = 0.5
    period: float = 100.0

    def __post_init__(self) -> None:
        for name in ("arrival_rate", "mean_duration", "period"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise MulticastError(f"{name} must be a finite number > 0, got {v!r}")
        if not 0.0 <= self.background_amplitude <= 1.0:
            raise MulticastError(f"background_amplitude must be in [0, 1], got "
                                 f"{self.background_amplitude!r}")


@dataclass(frozen=True)
class Timeline:
    """One episode's groups (arrival times ``t``, holding times ``duration``, hypervisors
    ``n``, rates ``rate_gbps``) and each service node's background ``base`` and ``phase``."""

    t: np.ndarray
    duration: np.ndarray
    n: np.ndarray
    rate_gbps: np.ndarray
    base: np.ndarray
    phase: np.ndarray
    amplitude: float
    period: float

    def __len__(self) -> int:
        return len(self.t)

    def background(self, t: float | np.ndarray) -> np.ndarray:
        """Every service node's background (Gbps) at time ``t`` (an array of times: one row
        per time)."""
        tt = np.asarray(t, dtype=float)[..., None]
        out: np.ndarray = self.base * (1.0 + self.amplitude * np.sin(
            2.0 * math.pi * tt / self.period + self.phase))
        return out

    def midpoints(self, a: float, b: float) -> tuple[np.ndarray, float]:
        """The midpoint rule's times on ``[a, b]`` and the width of each sub-step."""
        if b <= a:
            return np.zeros(0), 0.0
        k = max(1, math.ceil((b - a) * STEPS_PER_PERIOD / self.period))
        h = (b - a) / k
        return a + h * (np.arange(k) + 0.5), h


def check_peak(spec: TimelineSpec, cluster: ClusterSpec) -> None:
    """Refuse a background whose diurnal peak reaches the capacity ``Omega``."""
    _check_range("background_gbps", *cluster.background_gbps, minimum=0.0)
    peak = cluster.background_gbps[1] * (1 + spec.background_amplitude)
    if peak >= cluster.capacity_gbps:
        raise MulticastError(
            f"background_gbps high {cluster.background_gbps[1]} at its diurnal peak "
            f"(x{1 + spec.background_amplitude} = {peak:g}) must stay below the capacity "
            f"{cluster.capacity_gbps}")


def generate_timeline(spec: TimelineSpec, cluster: ClusterSpec,
                      rng: np.random.Generator) -> Timeline:
    """Draw one episode (module docstring) from ``rng``."""
    check_peak(spec, cluster)
    g = spec.groups
    gaps = rng.exponential(1.0 / spec.arrival_rate, size=g.num_groups)
    dur = rng.exponential(spec.mean_duration, size=g.num_groups)
    lo, hi = g.hypervisors
    n = rng.integers(lo, hi + 1, size=g.num_groups).astype(np.int64)
    r = rng.uniform(*g.rate_gbps, size=g.num_groups)
    m = cluster.num_service_nodes
    base = rng.uniform(*cluster.background_gbps, size=m)
    phase = rng.uniform(0.0, 2.0 * math.pi, size=m)
    return Timeline(np.cumsum(gaps), dur, n, r, base, phase,
                    float(spec.background_amplitude), float(spec.period))


def capped_weights(loads: np.ndarray, spec: ClusterSpec) -> np.ndarray:
    """``-alpha log(1 - omega / Omega)``, ``omega`` capped at :data:`WEIGHT_CAP_FRAC`."""
    frac = np.minimum(loads / spec.capacity_gbps, WEIGHT_CAP_FRAC)
    out: np.ndarray = -spec.alpha * np.log1p(-frac)
    return out


def lifetime_weights(timeline: Timeline, spec: ClusterSpec, start: float, end: float,
                     extra_gbps: np.ndarray | float = 0.0) -> np.ndarray:
    """Each node's weight integrated over ``[start, end)`` with ``extra_gbps`` on top of the
    background (divide by ``end - start`` for the mean)."""
    ts, h = timeline.midpoints(start, end)
    if ts.size == 0:
        return np.zeros(spec.num_service_nodes)
    out: np.ndarray = h * capped_weights(timeline.background(ts) + extra_gbps, spec).sum(axis=0)
    return out


def expected_weights(timeline: Timeline, spec: ClusterSpec, now: float,
                     extra_gbps: np.ndarray | float, mean_duration: float,
                     points: int = 40) -> np.ndarray:
    """Each node's weight averaged over the stay of a group arriving at ``now`` whose
    holding time is exponential with mean ``mean_duration``, with ``extra_gbps`` on top of
    the background throughout: ``integral e^(-s / D) w(now + s) ds / D``, the expected
    lifetime integral over the expected stay (the survival function weighs each moment),
    on ``points`` midpoints of ``[0, 4 D)``."""
    d = float(mean_duration)
    s = (np.arange(points) + 0.5) * (4.0 * d / points)
    p = np.exp(-s / d)
    w = capped_weights(timeline.background(now + s) + extra_gbps, spec)
    out: np.ndarray = (p[:, None] * w).sum(axis=0) / p.sum()
    return out


@dataclass(frozen=True)
class ActiveGroup:
    """A placed group while it is active: when it leaves, its service nodes' throughput, and
    the load it put on each of its service nodes."""

    index: int
    depart: float
    throughput: float
    ids: np.ndarray
    load_gbps: np.ndarray


class SharedCluster:
    """The cluster at the current time: the background, the active groups' loads, and
    :attr:`state` (a :class:`~envs.trees.groups.ClusterState` whose ``loads`` are the
    workloads ``omega`` now: what Algorithm 1 and the policies read). :meth:`advance`
    moves the clock and returns the active groups' value earned meanwhile."""

    def __init__(self, spec: ClusterSpec, switch: SwitchModel, timeline: Timeline) -> None:
        self.spec, self.switch, self.timeline = spec, switch, timeline
        self.now = 0.0
        self.group_load = np.zeros(spec.num_service_nodes)
        self.active: list[ActiveGroup] = []
        self.state = ClusterState(spec, switch, timeline.background(0.0))
        self.departed = 0

    def _earn(self, a: float, b: float) -> float:
        """The active groups' value over ``[a, b)`` (no arrival or departure inside)."""
        if b <= a or not self.active:
            return 0.0
        w = lifetime_weights(self.timeline, self.spec, a, b, self.group_load)
        return sum((b - a) * g.throughput - self.spec.lam * float(w[g.ids].sum())
                   for g in self.active)

    def advance(self, t: float) -> float:
        """Move the clock to ``t`` (not backwards), the groups leaving at their departure
        times, and return the value the active groups earned on the way."""
        if t < self.now:
            raise MulticastError(f"time cannot go back: {t} < {self.now}")
        value = 0.0
        while True:
            leaving = [g for g in self.active if g.depart <= t]
            nxt = min((g.depart for g in leaving), default=t)
            value += self._earn(self.now, nxt)
            self.now = max(self.now, nxt)
            if not leaving:
                break
            for g in [g for g in self.active if g.depart <= nxt]:
                np.subtract.at(self.group_load, g.ids, g.load_gbps)
                self.departed += 1
            self.active = [g for g in self.active if g.depart > nxt]
            np.maximum(self.group_load, 0.0, out=self.group_load)  # rounding only
        self.now = float(t)
        self.state.loads = self.timeline.background(self.now) + self.group_load
        return value

    def drain(self) -> float:
        """Run the clock until every active group has left; their value on the way."""
        end = max((g.depart for g in self.active), default=self.now)
        return self.advance(end)

    def place(self, index: int, tree: MulticastTree, r: float) -> Placement:
        """Place group ``index`` now (objective (3) on the current loads) until its
        departure."""
        before = self.state.loads.copy()
        p = self.state.place(tree, r)
        delta = self.state.loads - before
        ids = np.asarray(tree.service_ids[np.flatnonzero(tree.service)], np.int64)
        self.group_load[ids] += delta[ids]
        tl = self.timeline
        self.active.append(ActiveGroup(int(index), float(tl.t[index] + tl.duration[index]),
                                       p.throughput, ids, delta[ids]))
        return p


def isolation_bound(timeline: Timeline, spec: ClusterSpec, switch: SwitchModel,
                    variant: str = "exact") -> np.ndarray:
    """Per group, its value placed alone on the background of its lifetime by Algorithm 1
    on the nodes' lifetime-mean weights (0 where no node has room at its arrival): their
    sum bounds any policy's sequence objective (module docstring)."""
    out = np.zeros(len(timeline))
    for i in range(len(timeline)):
        t0, d = float(timeline.t[i]), float(timeline.duration[i])
        r = float(timeline.rate_gbps[i])
        st = ClusterState(spec, switch, timeline.background(t0))
        cand = st.available(r)
        if len(cand) == 0 or d <= 0:
            continue
        w = lifetime_weights(timeline, spec, t0, t0 + d)
        res = algorithm1(int(timeline.n[i]), r, w / d, switch, spec.lam, cand, variant)
        out[i] = d * res.value
    return out
