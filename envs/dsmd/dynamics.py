"""Traces with the dynamics of a real cloud, on top of a scenario (SMART Section VII-D).

The static generator (:func:`envs.dsmd.scenarios.generate`) draws one stationary (or
phase-scripted) trace. :func:`generate_dynamic` draws a trace of any length whose load,
VPC population and VM placement change over time, as they do in a production cloud:

* **Bursts** (SMART Fig. 10, Section VII-D): the five-phase burst (0.5 / 0.8 / 0.95 /
  0.8 / 0.5 of the peak rate, each phase ``burst_phase_s`` long) starts at the times of a
  Poisson process (``bursts_per_hour``). Between bursts the load multiplier is
  ``base_load``; during a burst it is the larger of ``base_load`` and the burst's phase
  multiplier (overlapping bursts: the largest phase multiplier).
* **Diurnal cycle**: the load is multiplied by ``1 + A sin(2 pi (t0 + t) / P)`` with
  amplitude ``diurnal_amplitude`` and period ``diurnal_period_s``; the start time of day
  ``t0`` is drawn per trace (and is the time of day of the trace's first timestamp).
* **Flash crowds**: Poisson events (``flash_crowds_per_hour``); each multiplies the
  request rate of ``flash_vpcs`` (1..3) random active VPCs by ``flash_factor`` for a
  duration uniform in ``flash_duration_s``.
* **VPC life cycles**: a fraction ``inactive_fraction`` of the VPCs does not exist yet at
  the start. VPC creations (Poisson, ``creations_per_hour``) activate one of them: its VMs
  are placed on random nodes (so its destination sets are new) and for ``creation_s`` its
  request rate is multiplied by ``creation_boost`` and its messages are mostly
  (``lifecycle_share``) CREATE operations on SUBNET (multicast) or PORT (unicast)
  configuration (the tenant building the VPC, Section II-C). VPC deletions (Poisson,
  ``deletions_per_hour``) pick an active VPC (past its creation burst): for ``deletion_s``
  its rate is multiplied by ``deletion_boost`` and its messages are mostly DELETE, then it
  sends nothing for the rest of the trace (a deleted VPC is not created again).
* **VM migrations**: each VM moves to a uniformly random other node at
  ``migrations_per_vm_hour``; every group containing it (whole VPC, subnet, security
  group) then has a new node set, so new message types appear (Section V-D).

Every dynamic has a switch (``bursts``, ``diurnal``, ``flash_crowds``, ``lifecycles``,
``migrations``); with all of them off the trace is a stationary Poisson process at
``base_load`` (:meth:`DynamicsSpec.off`). Each dynamic draws from its own seeded stream
(:func:`envs.seeding.rng`), so switching one off leaves the others' events unchanged.

The dynamics are evaluated on epochs of ``epoch_s``: per-VPC request rates and the VM
placement are constant within an epoch. An event is in force in an epoch when the epoch's
midpoint lies in the event's interval; a placement change (creation, migration) takes
effect from the first epoch whose midpoint is at or after the event time (events after the
last midpoint are dropped). Messages are then made exactly as the static generator makes
them (same size law, multicast share, groups, configuration and operation codes, ids),
by the same function.

The returned dataset's :class:`~envs.dsmd.topology.Topology` is the *initial* placement:
migrations and creations move VMs during the trace (``meta["events"]`` lists every move).

Nothing here imports gymnasium.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, fields
from itertools import groupby
from typing import Any, NamedTuple

import numpy as np

from ..seeding import rng
from .errors import DSMDError
from .scenarios import (
    _TRACE_KEYS,
    PHASE_CREATE,
    PHASE_DELETE,
    TRACE_EPOCH_NS,
    ScenarioSpec,
    _emit_messages,
    _group_members,
    _messages_per_request,
    _Placement,
    _topology,
)
from .topology import Topology
from .traces import Dataset

__all__ = [
    "EVENT_KINDS",
    "DynamicsSpec",
    "Schedule",
    "dynamic_trace_key",
    "generate_dynamic",
    "schedule",
]

#: Bumped when the dynamic generator's output changes (part of every dynamic trace key).
_DYNAMIC_FORMAT = 1

#: The event kinds of ``meta["events"]`` and of a dataset manifest's ``events`` summary.
EVENT_KINDS = ("bursts", "flash_crowds", "creations", "deletions", "migrations")


@dataclass(frozen=True)
class DynamicsSpec:
    """Seeded dynamics of a trace (module docstring); rates are per hour of trace time.

    Multipliers scale the scenario's rate at multiplier 1 (``peak_rate_bps`` or
    ``rate_per_vpc_bps`` times the VPCs), shared equally by the VPCs.
    """

    epoch_s: float = 10.0  # rates and placement are piecewise constant on epochs
    base_load: float = 0.5  # load multiplier between bursts (Fig. 10's low phase)
    # bursts: SMART Fig. 10, Section VII-D
    bursts: bool = True
    bursts_per_hour: float = 2.0
    burst_phase_s: float = 60.0
    burst_profile: tuple[float, ...] = (0.5, 0.8, 0.95, 0.8, 0.5)
    # diurnal cycle
    diurnal: bool = True
    diurnal_amplitude: float = 0.2
    diurnal_period_s: float = 86_400.0
    # flash crowds
    flash_crowds: bool = True
    flash_crowds_per_hour: float = 2.0
    flash_factor: float = 5.0
    flash_vpcs: tuple[int, int] = (1, 3)
    flash_duration_s: tuple[float, float] = (30.0, 300.0)
    # VPC life cycles
    lifecycles: bool = True
    inactive_fraction: float = 0.1
    creations_per_hour: float = 6.0
    deletions_per_hour: float = 4.0
    creation_s: float = 60.0
    creation_boost: float = 10.0
    deletion_s: float = 30.0
    deletion_boost: float = 10.0
    lifecycle_share: float = 0.9  # share of CREATE (DELETE) messages in a creation (deletion)
    # VM migrations
    migrations: bool = True
    migrations_per_vm_hour: float = 0.05

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise DSMDError("dynamics: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        p: list[str] = []
        positive = ("epoch_s", "base_load", "burst_phase_s", "diurnal_period_s", "flash_factor",
                    "creation_s", "creation_boost", "deletion_s", "deletion_boost")
        p += [f"{f} must be positive, got {getattr(self, f)}" for f in positive
              if not getattr(self, f) > 0]
        rates = ("bursts_per_hour", "flash_crowds_per_hour", "creations_per_hour",
                 "deletions_per_hour", "migrations_per_vm_hour")
        p += [f"{f} must be >= 0, got {getattr(self, f)}" for f in rates
              if not getattr(self, f) >= 0]
        if not self.burst_profile or min(self.burst_profile) < 0:
            p.append(f"burst_profile must be non-negative multipliers, got {self.burst_profile}")
        if not 0 <= self.diurnal_amplitude < 1:
            p.append(f"diurnal_amplitude must be in [0, 1), got {self.diurnal_amplitude}")
        if not 0 <= self.inactive_fraction < 1:
            p.append(f"inactive_fraction must be in [0, 1), got {self.inactive_fraction}")
        if not 0 <= self.lifecycle_share <= 1:
            p.append(f"lifecycle_share must be in [0, 1], got {self.lifecycle_share}")
        lo, hi = self.flash_vpcs
        if not 1 <= lo <= hi:
            p.append(f"flash_vpcs must be (lo, hi) with 1 <= lo <= hi, got {self.flash_vpcs}")
        lo_s, hi_s = self.flash_duration_s
        if not self.epoch_s <= lo_s <= hi_s:
            p.append(f"flash_duration_s must be (lo, hi) with epoch_s <= lo <= hi, "
                     f"got {self.flash_duration_s}")
        for f in ("burst_phase_s", "creation_s", "deletion_s"):  # never shorter than an epoch
            if getattr(self, f) < self.epoch_s:
                p.append(f"{f} ({getattr(self, f)}) must be >= epoch_s ({self.epoch_s})")
        return p

    # ------------------------------------------------------------------ helpers
    @classmethod
    def off(cls, **changes: Any) -> DynamicsSpec:
        """Every dynamic switched off (a stationary trace at ``base_load``), with changes."""
        d: dict[str, Any] = {"bursts": False, "diurnal": False, "flash_crowds": False,
                             "lifecycles": False, "migrations": False}
        d.update(changes)
        return cls(**d)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> DynamicsSpec:
        """From a mapping (a YAML / JSON ``dynamics:`` block); unknown keys are refused."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise DSMDError(f"dynamics: unknown keys {unknown}; known: {', '.join(sorted(known))}")
        for k in ("burst_profile", "flash_duration_s"):
            if k in d:
                d[k] = tuple(float(x) for x in d[k])
        if "flash_vpcs" in d:
            d["flash_vpcs"] = tuple(int(x) for x in d["flash_vpcs"])
        try:
            return cls(**d)
        except TypeError as e:
            raise DSMDError(f"dynamics: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("burst_profile", "flash_vpcs", "flash_duration_s"):
            d[k] = list(d[k])
        return d

    def replace(self, **changes: Any) -> DynamicsSpec:
        return DynamicsSpec.from_dict({**self.to_dict(), **changes})


# ---------------------------------------------------------------------- schedule
@dataclass(frozen=True, eq=False)
class Schedule:
    """The dynamics of one trace evaluated on its epochs.

    ``multiplier[e, v]`` multiplies VPC ``v``'s (index) request rate in epoch ``e``;
    ``phase[e, v]`` is its life-cycle phase (:data:`~envs.dsmd.scenarios.PHASE_CREATE`,
    ``PHASE_DELETE`` or 0); ``vm_node[version[e]]`` is the VM placement (VM index -> node
    index) in force in epoch ``e``. ``events`` lists every event that took effect.
    """

    start_s: np.ndarray  # float (E,)
    length_s: np.ndarray  # float (E,)
    multiplier: np.ndarray  # float (E, num_vpcs)
    phase: np.ndarray  # int8 (E, num_vpcs)
    version: np.ndarray  # int64 (E,)
    vm_node: np.ndarray  # int64 (P, num_vms)
    time_of_day_s: float  # t0 of the diurnal cycle, also the trace's start time of day
    initially_inactive: np.ndarray  # VPC indices inactive at the start
    events: dict[str, list[dict[str, Any]]]

    @property
    def mid_s(self) -> np.ndarray:
        return self.start_s + self.length_s / 2

    def event_counts(self) -> dict[str, int]:
        return {k: len(self.events[k]) for k in EVENT_KINDS}


def _epochs(duration_s: float, epoch_s: float) -> tuple[np.ndarray, np.ndarray]:
    n = max(math.ceil(duration_s / epoch_s - 1e-9), 1)
    start = np.arange(n) * epoch_s
    return start, np.minimum(epoch_s, duration_s - start)


def _poisson_times(g: np.random.Generator, per_hour: float, duration_s: float) -> np.ndarray:
    k = int(g.poisson(per_hour * duration_s / 3600.0))
    return np.sort(g.random(k) * duration_s)


def _window(mid: np.ndarray, start: float, length: float) -> np.ndarray:
    """Epochs whose midpoint lies in ``[start, start + length)``."""
    return (mid >= start) & (mid < start + length)


def _load(dyn: DynamicsSpec, seed: int, name: str, mid: np.ndarray, duration_s: float,
          t0: float, events: dict) -> np.ndarray:
    """Total load multiplier per epoch: ``base_load``, Fig. 10 bursts, diurnal cycle."""
    m = np.full(mid.size, dyn.base_load)
    if dyn.bursts:
        g = rng(seed, name, "dynamics", "bursts")
        burst = np.zeros(mid.size)
        for s in _poisson_times(g, dyn.bursts_per_hour, duration_s):
            if s > mid[-1]:
                continue
            for j, mult in enumerate(dyn.burst_profile):
                w = _window(mid, s + j * dyn.burst_phase_s, dyn.burst_phase_s)
                burst[w] = np.maximum(burst[w], mult)
            events["bursts"].append({"start_s": float(s)})
        m = np.maximum(m, burst)
    if dyn.diurnal:
        m = m * (1.0 + dyn.diurnal_amplitude
                 * np.sin(2 * np.pi * (t0 + mid) / dyn.diurnal_period_s))
    return m


class _Move(NamedTuple):
    """A placement change: VMs ``vms`` go to ``nodes`` (a VPC's creation) or, for a
    migration (``nodes`` None), one VM goes to ``(current + offset) % N``."""

    time_s: float
    epoch: int
    vms: np.ndarray
    nodes: np.ndarray | None
    offset: int = 0


def _lifecycles(dyn: DynamicsSpec, seed: int, spec: ScenarioSpec, topo: Topology,
                members: list[np.ndarray], mid: np.ndarray, duration_s: float, events: dict,
                changes: list[_Move]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-(epoch, VPC) life-cycle multiplier and phase, and the initially inactive VPCs."""
    num_vpcs = spec.num_vpcs
    mult = np.ones((mid.size, num_vpcs))
    phase = np.zeros((mid.size, num_vpcs), dtype=np.int8)
    if not dyn.lifecycles:
        return mult, phase, np.zeros(0, dtype=np.int64)
    g = rng(seed, spec.name, "dynamics", "lifecycles")
    n_off = min(round(dyn.inactive_fraction * num_vpcs), num_vpcs - 1)
    inactive = np.sort(g.choice(num_vpcs, size=n_off, replace=False)).astype(np.int64)
    mult[:, inactive] = 0.0
    unborn = inactive.tolist()
    born = {int(v): -math.inf for v in np.setdiff1d(np.arange(num_vpcs), inactive)}
    todo = sorted([(float(t), 0) for t in _poisson_times(g, dyn.creations_per_hour, duration_s)]
                  + [(float(t), 1) for t in _poisson_times(g, dyn.deletions_per_hour,
                                                            duration_s)])
    vpc_id = topo.vm_vpc[[m[0] for m in members]]
    for t, kind in todo:
        e = int(np.searchsorted(mid, t))
        if e >= mid.size:
            continue
        if kind == 0:
            if not unborn:
                continue
            v = unborn.pop(int(g.integers(len(unborn))))
            born[v] = t
            w = _window(mid, t, dyn.creation_s)
            mult[mid >= t, v] = 1.0
            mult[w, v] = dyn.creation_boost
            phase[w, v] = PHASE_CREATE
            nodes = g.integers(0, spec.num_nodes, members[v].size)
            changes.append(_Move(t, e, members[v], nodes))
            events["creations"].append({"time_s": t, "vpc_id": int(vpc_id[v])})
        else:
            ready = sorted(v for v, since in born.items() if since + dyn.creation_s <= t)
            if not ready:
                continue
            v = ready[int(g.integers(len(ready)))]
            del born[v]
            w = _window(mid, t, dyn.deletion_s)
            mult[w, v] *= dyn.deletion_boost
            phase[w, v] = PHASE_DELETE
            mult[mid >= t + dyn.deletion_s, v] = 0.0
            events["deletions"].append({"time_s": t, "vpc_id": int(vpc_id[v])})
    return mult, phase, inactive


def _flash_crowds(dyn: DynamicsSpec, seed: int, spec: ScenarioSpec, topo: Topology,
                  members: list[np.ndarray], mid: np.ndarray, duration_s: float,
                  alive: np.ndarray, events: dict) -> np.ndarray:
    """Per-(epoch, VPC) flash-crowd multiplier; a crowd hits VPCs active at its start."""
    mult = np.ones((mid.size, spec.num_vpcs))
    if not dyn.flash_crowds:
        return mult
    g = rng(seed, spec.name, "dynamics", "flash_crowds")
    starts = _poisson_times(g, dyn.flash_crowds_per_hour, duration_s)
    lengths = g.uniform(*dyn.flash_duration_s, starts.size)
    counts = g.integers(dyn.flash_vpcs[0], dyn.flash_vpcs[1] + 1, starts.size)
    vpc_id = topo.vm_vpc[[m[0] for m in members]]
    for t, length, c in zip(starts, lengths, counts):
        e = int(np.searchsorted(mid, t))
        if e >= mid.size:
            continue
        cand = np.flatnonzero(alive[e] > 0)
        if cand.size == 0:
            continue
        hit = np.sort(g.choice(cand, size=min(int(c), cand.size), replace=False))
        mult[np.ix_(_window(mid, t, length), hit)] *= dyn.flash_factor
        events["flash_crowds"].append({"start_s": float(t), "duration_s": float(length),
                                       "factor": dyn.flash_factor,
                                       "vpc_ids": [int(x) for x in vpc_id[hit]]})
    return mult


def _migrations(dyn: DynamicsSpec, seed: int, spec: ScenarioSpec, members: list[np.ndarray],
                mid: np.ndarray, duration_s: float, alive: np.ndarray,
                changes: list[_Move]) -> None:
    """Each VM of an existing VPC moves to a uniformly random other node at
    ``migrations_per_vm_hour`` (draws for VMs of VPCs that do not exist are dropped)."""
    if not dyn.migrations or spec.num_nodes < 2:
        return
    g = rng(seed, spec.name, "dynamics", "migrations")
    times = _poisson_times(g, dyn.migrations_per_vm_hour * spec.num_vms, duration_s)
    vms = g.integers(0, spec.num_vms, times.size)
    offsets = g.integers(1, spec.num_nodes, times.size)  # target = (current + offset) % N
    vpc_of = np.empty(spec.num_vms, dtype=np.int64)
    for v, m in enumerate(members):
        vpc_of[m] = v
    for t, vm, off in zip(times, vms, offsets):
        e = int(np.searchsorted(mid, t))
        if e < mid.size and alive[e, vpc_of[vm]] > 0:
            changes.append(_Move(float(t), e, np.array([vm]), None, int(off)))


def _placements(topo: Topology, changes: list[_Move], num_epochs: int, events: dict
                ) -> tuple[np.ndarray, np.ndarray]:
    """Placement versions (one per epoch with changes) and the version in force in each
    epoch, applying ``changes`` in time order."""
    cur = topo.vm_node.astype(np.int64).copy()
    versions = [cur.copy()]
    version = np.zeros(num_epochs, dtype=np.int64)
    for e, moves in groupby(sorted(changes, key=lambda c: (c.epoch, c.time_s)),
                            key=lambda c: c.epoch):
        for mv in moves:
            if mv.nodes is not None:  # a VPC created: its VMs placed anew
                cur[mv.vms] = mv.nodes
                continue
            vm = int(mv.vms[0])
            new = (int(cur[vm]) + mv.offset) % topo.num_nodes
            events["migrations"].append({"time_s": mv.time_s, "vm_id": int(topo.vm_ids[vm]),
                                         "from_node": int(topo.node_ids[cur[vm]]),
                                         "to_node": int(topo.node_ids[new])})
            cur[vm] = new
        versions.append(cur.copy())
        version[e:] = len(versions) - 1
    return np.stack(versions), version


def schedule(spec: ScenarioSpec, dyn: DynamicsSpec, seed: int, duration_s: float,
             topo: Topology, members: list[np.ndarray]) -> Schedule:
    """Draw the dynamics of one trace (``seed``) and evaluate them on its epochs."""
    start, length = _epochs(duration_s, dyn.epoch_s)
    mid = start + length / 2
    events: dict[str, list[dict[str, Any]]] = {k: [] for k in EVENT_KINDS}
    t0 = float(np.floor(rng(seed, spec.name, "dynamics", "diurnal").random()
                        * dyn.diurnal_period_s))
    load = _load(dyn, seed, spec.name, mid, duration_s, t0, events)
    changes: list[_Move] = []
    life, phase, inactive = _lifecycles(dyn, seed, spec, topo, members, mid, duration_s,
                                        events, changes)
    flash = _flash_crowds(dyn, seed, spec, topo, members, mid, duration_s, life, events)
    _migrations(dyn, seed, spec, members, mid, duration_s, life, changes)
    vm_node, version = _placements(topo, changes, mid.size, events)
    return Schedule(start, length, load[:, None] * life * flash, phase, version, vm_node, t0,
                    inactive, events)


# ---------------------------------------------------------------------- trace
def dynamic_trace_key(spec: ScenarioSpec, dyn: DynamicsSpec, seed: int, duration_s: float
                      ) -> str:
    """Content hash of everything that shapes a dynamic trace."""
    d = spec.to_dict()
    keys = [k for k in _TRACE_KEYS if k not in ("phases", "duration_s", "seed")]
    blob = json.dumps({"format": _DYNAMIC_FORMAT, "name": spec.name,
                       "scenario": {k: d[k] for k in keys}, "dynamics": dyn.to_dict(),
                       "seed": int(seed), "duration_s": float(duration_s)}, sort_keys=True)
    return hashlib.blake2b(blob.encode(), digest_size=6).hexdigest()


def generate_dynamic(spec: ScenarioSpec, dyn: DynamicsSpec, seed: int, duration_s: float
                     ) -> Dataset:
    """One trace of ``duration_s`` seconds of ``spec``'s cloud under the dynamics ``dyn``.

    Deterministic in (``spec``, ``dyn``, ``seed``, ``duration_s``). The scenario's
    topology / traffic / message-mix parameters are used; its ``phases``, ``duration_s``
    and ``seed`` are replaced by the dynamics, ``duration_s`` and ``seed``. The topology
    (VM placement, groups) is drawn as :func:`~envs.dsmd.scenarios.generate` draws it for
    ``spec.replace(seed=seed)``; the returned topology is the initial placement.
    """
    if seed < 0:
        raise DSMDError(f"seed must be non-negative, got {seed}")
    if not duration_s > 0:
        raise DSMDError(f"duration_s must be positive, got {duration_s}")
    topo, members = _topology(spec, rng(seed, spec.name, "topology"))
    groups = _group_members(spec, members, rng(seed, spec.name, "groups"))
    sched = schedule(spec, dyn, seed, duration_s, topo, members)
    place = _Placement.of(groups, sched.vm_node)
    g = rng(seed, spec.name, "dynamics", "arrivals")
    rt, req_epoch, req_vpc = _arrivals(spec, sched, g)
    per_req = _messages_per_request(g, rt.size, spec)
    start_ns = TRACE_EPOCH_NS + int(sched.time_of_day_s) * 10**9
    trace = _emit_messages(spec, g, rt, per_req, req_vpc, topo, members, groups, place,
                           start_ns=start_ns, req_version=sched.version[req_epoch],
                           req_phase=sched.phase[req_epoch, req_vpc],
                           lifecycle_share=dyn.lifecycle_share)
    used = spec.replace(seed=int(seed), duration_s=float(duration_s), phases=[])
    vpc_id = topo.vm_vpc[[m[0] for m in members]]
    meta = {"name": spec.name, "generator": "envs.dsmd.dynamics.generate_dynamic",
            "trace_key": dynamic_trace_key(spec, dyn, seed, duration_s),
            "spec": used.to_dict(), "dynamics": dyn.to_dict(), "seed": int(seed),
            "start_ns": start_ns, "duration_s": float(duration_s),
            "time_of_day_s": sched.time_of_day_s,
            "initially_inactive_vpc_ids": [int(x) for x in vpc_id[sched.initially_inactive]],
            "topology_is": "the initial VM placement; events.migrations and events.creations "
                           "move VMs during the trace",
            "event_counts": sched.event_counts(), "events": sched.events}
    return Dataset(topo, trace, meta)


def _arrivals(spec: ScenarioSpec, sched: Schedule, g: np.random.Generator
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Request times (sorted), their epochs and VPC indices: a Poisson process per VPC
    whose rate is piecewise constant on the epochs."""
    mean_msgs = max(spec.messages_per_request, 1.0)
    per_vpc = spec.total_rate_bps() / (8.0 * spec.mean_size_bytes) / mean_msgs / spec.num_vpcs
    counts = g.poisson(per_vpc * sched.multiplier * sched.length_s[:, None]).ravel()
    cell = np.repeat(np.arange(counts.size), counts)
    epoch, vpc = np.divmod(cell, spec.num_vpcs)
    rt = sched.start_s[epoch] + g.random(cell.size) * sched.length_s[epoch]
    order = np.argsort(rt, kind="stable")
    return rt[order], epoch[order], vpc[order]
