"""Seeded trace generators for the named scenarios of the SMART paper (Section VII-C/D).

A scenario is a :class:`ScenarioSpec`: topology size, traffic, message mix and the DSMD
capacities. The named specs live in ``configs/scenario/<name>.yaml`` (one source of
truth, also used by Hydra); :func:`load_scenario` reads them.

Traffic model (documented in ``datasets/README.md``):

* VMs are placed on nodes uniformly at random; every VPC has at least one VM and the
  remaining VMs go to VPCs with log-normal weights (``vpc_size_sigma``).
* Each VPC has multicast *groups*: the whole VPC, its subnets (a random partition of its
  VMs) and security groups (random subsets). A multicast message addresses every node that
  hosts a VM of one group (subnet / security-group configuration, Section II-C); a unicast
  message addresses the node of one VM (per-port configuration).
* Requests arrive as a Poisson process whose rate follows ``phases`` (the five-phase burst
  of Fig. 10 for ``godaddy``); each request yields 1+Geometric messages of one VPC.
* A message is multicast with probability ``multicast_share``, independently of its size,
  so multicast carries that share of the traffic in expectation. The same seed gives the
  same arrivals, sizes and uniforms at every share (common random numbers for sweeps).
* Sizes follow a bounded power law (Pareto on [L, H], H/L = ``size_range``) whose exponent
  is solved so that the largest 20% of messages carry 80% of the bytes, scaled to the mean.

Groups are kept as VM membership (:class:`_Groups`) and resolved to node sets under a VM
placement (:class:`_Placement`), so :func:`envs.dsmd.dynamics.generate_dynamic` can move VMs
during a trace. Both generators turn requests into messages with one function
(:func:`_emit_messages`) and share the topology and group helpers.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from ..seeding import rng
from .errors import DSMDError
from .schema import ConfigurationType as CT
from .schema import OperationType as OT
from .topology import Topology
from .traces import CONFIG_NAMES, OPERATION_NAMES, Dataset, Trace, read_dataset, write_dataset

__all__ = [
    "CONFIG_DIR",
    "TRACE_EPOCH_NS",
    "ScenarioSpec",
    "generate",
    "load_scenario",
    "pareto_params",
    "scenario_dataset",
]

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "scenario"
TRACE_EPOCH_NS = 1_767_225_600 * 10**9  # 2026-01-01T00:00:00Z

#: Bumped when the generator's output or metadata changes, so stale caches are not reused.
_DATASET_FORMAT = 2

#: Keys of a scenario that change the generated trace (the cache key hashes only these).
_TRACE_KEYS = ("num_nodes", "num_vms", "num_vpcs", "node_bandwidth_bps", "rate_per_vpc_bps",
               "peak_rate_bps", "phases", "duration_s", "mean_size_bytes", "top_share",
               "size_range", "multicast_share", "max_subnets", "max_security_groups",
               "vpc_size_sigma", "messages_per_request", "seed")


@dataclass(frozen=True)
class ScenarioSpec:
    """Everything that defines a scenario: trace generator parameters and DSMD capacities."""

    name: str
    num_nodes: int
    num_vms: int
    num_vpcs: int
    num_topics: int  # K
    node_bandwidth_bps: int  # s(n)
    controller_bw_bps: int  # C_b
    controller_cpu: int  # C_p (concurrent sends)
    interval_s: float = 10.0  # rate-estimation interval T (Algorithm 1)
    duration_s: float = 60.0
    rate_per_vpc_bps: float | None = 1e6  # message traffic per VPC (cern: 1 Mbps)
    peak_rate_bps: float | None = None  # or: total traffic at multiplier 1 (godaddy)
    phases: tuple[tuple[float, float], ...] = ()  # (duration_s, multiplier); () = constant
    mean_size_bytes: float = 512 * 1024
    top_share: float = 0.8  # the top 20% of messages carry this share of bytes
    size_range: float = 1e4  # H / L of the bounded power law
    multicast_share: float = 0.5
    max_subnets: int = 3
    max_security_groups: int = 2
    vpc_size_sigma: float = 1.0
    messages_per_request: float = 1.5
    seed: int = 0
    split: tuple[float, float, float] = (0.6, 0.2, 0.2)  # train / validation / test, by time
    extra: dict[str, Any] = field(default_factory=dict)  # per-scenario baseline parameters

    def __post_init__(self) -> None:
        problems = []
        for f in ("num_nodes", "num_vms", "num_vpcs", "num_topics", "node_bandwidth_bps",
                  "controller_bw_bps", "controller_cpu"):
            if getattr(self, f) <= 0:
                problems.append(f"{f} must be positive, got {getattr(self, f)}")
        if self.num_vms < self.num_vpcs:
            problems.append(f"num_vms ({self.num_vms}) must be >= num_vpcs ({self.num_vpcs})")
        if not 0.0 <= self.multicast_share <= 1.0:
            problems.append(f"multicast_share must be in [0, 1], got {self.multicast_share}")
        if (self.rate_per_vpc_bps is None) == (self.peak_rate_bps is None):
            problems.append("give exactly one of rate_per_vpc_bps and peak_rate_bps")
        if self.interval_s <= 0 or self.duration_s <= 0:
            problems.append("interval_s and duration_s must be positive")
        if not 0.2 < self.top_share < 1.0:
            problems.append(f"top_share must be in (0.2, 1), got {self.top_share}")
        if abs(sum(self.split) - 1.0) > 1e-9 or min(self.split) < 0:
            problems.append("split must be three non-negative fractions summing to 1: "
                            f"{self.split}")
        if self.phases and abs(sum(d for d, _ in self.phases) - self.duration_s) > 1e-6:
            problems.append("phase durations must add up to duration_s")
        if problems:
            raise DSMDError(f"scenario '{self.name}': " + "; ".join(problems))

    # ------------------------------------------------------------------ helpers
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ScenarioSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        d = {k: v for k, v in d.items() if k in known}
        if "phases" in d and d["phases"] is not None:
            d["phases"] = tuple((float(a), float(b)) for a, b in d["phases"])
        if "split" in d:
            d["split"] = tuple(float(x) for x in d["split"])
        d["extra"] = dict(d.get("extra") or {})
        problems = [f"unknown keys {unknown}"] if unknown else []
        try:
            spec = cls(**d)
        except DSMDError as e:
            problems.append(str(e).split(": ", 1)[-1])
        except TypeError as e:  # a required key is missing
            problems.append(str(e))
        if problems:
            raise DSMDError(f"scenario '{d.get('name', '?')}': " + "; ".join(problems))
        return spec

    def replace(self, **changes: Any) -> ScenarioSpec:
        d = asdict(self)
        d.update(changes)
        return ScenarioSpec.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["phases"] = [list(p) for p in self.phases]
        d["split"] = list(self.split)
        return d

    def trace_key(self) -> str:
        """Content hash of the parameters that shape the trace (the cache key)."""
        d = self.to_dict()
        blob = json.dumps({"format": _DATASET_FORMAT, **{k: d[k] for k in _TRACE_KEYS}},
                          sort_keys=True).encode()
        return hashlib.blake2b(blob, digest_size=6).hexdigest()

    def total_rate_bps(self) -> float:
        if self.rate_per_vpc_bps is not None:
            return self.rate_per_vpc_bps * self.num_vpcs
        assert self.peak_rate_bps is not None  # __post_init__: exactly one of the two is given
        return float(self.peak_rate_bps)

    def phase_table(self) -> list[tuple[float, float]]:
        return list(self.phases) if self.phases else [(self.duration_s, 1.0)]


def load_scenario(name: str, **overrides: Any) -> ScenarioSpec:
    """The named scenario from ``configs/scenario/<name>.yaml``, with overrides."""
    path = CONFIG_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise DSMDError(f"unknown scenario '{name}'; known: {', '.join(known)}")
    import yaml

    d = yaml.safe_load(path.read_text())
    d.update(overrides)
    return ScenarioSpec.from_dict(d)


# ---------------------------------------------------------------------- sizes
@lru_cache(maxsize=64)
def pareto_params(mean: float, top_share: float = 0.8, size_range: float = 1e4,
                  top_frac: float = 0.2) -> tuple[float, float, float]:
    """(alpha, L, H) of a Pareto law bounded to [L, H] with H = size_range * L whose top
    ``top_frac`` of draws carry ``top_share`` of the mass, scaled to ``mean``.

    The 80/20 rule of [35] (Kandula et al.) cited in Section VII-C.
    """
    from scipy.optimize import brentq

    r = float(size_range)

    def moments(a: float) -> tuple[float, float]:  # with L = 1
        c = 1.0 - r ** (-a)
        xq = (1.0 - (1.0 - top_frac) * c) ** (-1.0 / a)  # quantile at 1 - top_frac
        if abs(a - 1.0) < 1e-9:
            partial = (math.log(r) - math.log(xq)) / c
            total = math.log(r) / c
        else:
            partial = a / c * (xq ** (1 - a) - r ** (1 - a)) / (a - 1)
            total = a / c * (1 - r ** (1 - a)) / (a - 1)
        return partial / total, total

    alpha = brentq(lambda a: moments(a)[0] - top_share, 0.05, 20.0, xtol=1e-12)
    m1 = moments(alpha)[1]
    low = mean / m1
    return alpha, low, low * r


def _sizes(g: np.random.Generator, n: int, spec: ScenarioSpec) -> np.ndarray:
    alpha, low, high = pareto_params(spec.mean_size_bytes, spec.top_share, spec.size_range)
    u = g.random(n)
    x = low * (1.0 - u * (1.0 - (low / high) ** alpha)) ** (-1.0 / alpha)
    sizes: np.ndarray = np.maximum(np.rint(x), 1).astype(np.int64)
    return sizes


# ---------------------------------------------------------------------- topology
def _topology(spec: ScenarioSpec, g: np.random.Generator
              ) -> tuple[Topology, list[np.ndarray]]:
    """Topology plus each VPC's VM indices, drawn from ``g`` (the ``topology`` stream)."""
    node_ids = np.arange(1, spec.num_nodes + 1, dtype=np.uint32)  # ids != indices on purpose
    bw = np.full(spec.num_nodes, int(spec.node_bandwidth_bps), dtype=np.int64)
    weights = g.lognormal(0.0, spec.vpc_size_sigma, spec.num_vpcs)
    extra = g.choice(spec.num_vpcs, size=spec.num_vms - spec.num_vpcs, p=weights / weights.sum())
    vm_vpc_idx = np.concatenate([np.arange(spec.num_vpcs), extra])
    g.shuffle(vm_vpc_idx)
    vpc_ids = np.arange(1, spec.num_vpcs + 1, dtype=np.uint32)
    vm_node = g.integers(0, spec.num_nodes, spec.num_vms)
    vm_ids = np.arange(1, spec.num_vms + 1, dtype=np.uint32)
    topo = Topology.from_arrays(node_ids, bw, vm_ids, node_ids[vm_node], vpc_ids[vm_vpc_idx])
    order = np.argsort(vm_vpc_idx, kind="stable")
    bounds = np.searchsorted(vm_vpc_idx[order], np.arange(spec.num_vpcs + 1))
    members = [order[bounds[i]:bounds[i + 1]] for i in range(spec.num_vpcs)]
    return topo, members


@dataclass(frozen=True, eq=False)
class _Groups:
    """Multicast groups by VM membership, so a moved VM moves every group it is in.

    VPC ``v``'s groups are rows ``start[v]:start[v+1]``: the whole VPC (kind 0), then its
    subnets (kind 1), then its security groups (kind 2). Group ``i``'s VMs (indices) are
    ``vms[vm_ptr[i]:vm_ptr[i+1]]``.
    """

    kind: np.ndarray  # int8 (G,)
    vm_ptr: np.ndarray  # int64 (G+1,)
    vms: np.ndarray  # int64 VM indices
    start: np.ndarray  # int64 (num_vpcs+1,)

    @property
    def size(self) -> int:
        return int(self.kind.size)

    def subnets(self) -> np.ndarray:
        """Number of subnets of each VPC."""
        return np.add.reduceat((self.kind == 1).astype(np.int64), self.start[:-1])

    def nodes(self, vm_node: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """CSR (indptr, node indices) of each group's sorted distinct nodes under the
        placement ``vm_node`` (VM index -> node index), or under several placements at
        once when ``vm_node`` is ``(P, V)``: then row ``p * G + i`` is group ``i`` under
        placement ``p``."""
        vm_node = np.atleast_2d(np.asarray(vm_node, dtype=np.int64))
        reps = vm_node.shape[0]
        width = int(vm_node.max()) + 1 if vm_node.size else 1
        row = (np.arange(reps, dtype=np.int64)[:, None] * self.size
               + np.repeat(np.arange(self.size, dtype=np.int64), np.diff(self.vm_ptr))[None, :])
        key = np.sort((row * width + vm_node[:, self.vms]).ravel())  # by (row, node)
        keep = np.ones(key.size, dtype=bool)
        keep[1:] = key[1:] != key[:-1]
        key = key[keep]
        counts = np.bincount(key // width, minlength=reps * self.size)
        return np.concatenate([[0], np.cumsum(counts)]), key % width


def _group_members(spec: ScenarioSpec, members: list[np.ndarray], g: np.random.Generator
                   ) -> _Groups:
    """Per VPC: the whole VPC, 1..``max_subnets`` subnets (a random partition of its VMs)
    and 0..``max_security_groups`` security groups (random halves), drawn from ``g``."""
    kinds: list[int] = []
    vms_of: list[np.ndarray] = []
    start = np.zeros(spec.num_vpcs + 1, dtype=np.int64)
    for v, vms in enumerate(members):
        start[v] = len(kinds)
        kinds.append(0)
        vms_of.append(vms)
        n_sub = int(g.integers(1, min(spec.max_subnets, vms.size) + 1))
        labels = g.integers(0, n_sub, vms.size)
        labels[:n_sub] = np.arange(n_sub)  # every subnet non-empty
        for s in range(n_sub):
            kinds.append(1)
            vms_of.append(vms[labels == s])
        for _ in range(int(g.integers(0, spec.max_security_groups + 1))):
            pick = g.random(vms.size) < 0.5
            pick[int(g.integers(vms.size))] = True
            kinds.append(2)
            vms_of.append(vms[pick])
    start[-1] = len(kinds)
    lens = np.array([a.size for a in vms_of], dtype=np.int64)
    return _Groups(np.array(kinds, dtype=np.int8), np.concatenate([[0], np.cumsum(lens)]),
                   np.concatenate(vms_of).astype(np.int64), start)


@dataclass(frozen=True, eq=False)
class _Placement:
    """Where the VMs are: ``P`` versions of the placement (one for a static trace; one per
    change for a trace with migrations), each with every group's node set.

    ``vm_node[p]`` maps VM index -> node index under version ``p``; group ``i``'s nodes
    under version ``p`` are row ``p * G + i`` of the CSR (``group_ptr``, ``group_nodes``).
    """

    vm_node: np.ndarray  # int64 (P, V)
    group_ptr: np.ndarray  # int64 (P*G + 1,)
    group_nodes: np.ndarray  # int64 node indices

    @classmethod
    def of(cls, groups: _Groups, vm_node: np.ndarray) -> _Placement:
        vm_node = np.atleast_2d(np.asarray(vm_node, dtype=np.int64))
        ptr, nodes = groups.nodes(vm_node)
        return cls(vm_node, ptr, nodes)


def _gather_csr(indptr: np.ndarray, values: np.ndarray, rows: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    lens = indptr[rows + 1] - indptr[rows]
    out_ptr = np.concatenate([[0], np.cumsum(lens)])
    idx = np.repeat(indptr[rows] - out_ptr[:-1], lens) + np.arange(out_ptr[-1])
    return out_ptr, values[idx]


# ---------------------------------------------------------------------- messages
#: Per-request life-cycle phase (dynamic traces): ordinary traffic, a VPC's creation burst
#: (mostly CREATE of PORT / SUBNET) or its deletion burst (mostly DELETE).
PHASE_NORMAL, PHASE_CREATE, PHASE_DELETE = 0, 1, 2


def _messages_per_request(g: np.random.Generator, n_req: int, spec: ScenarioSpec) -> np.ndarray:
    """1 + Geometric messages per request, mean ``messages_per_request``."""
    mean_msgs = max(spec.messages_per_request, 1.0)
    return (g.geometric(1.0 / mean_msgs, n_req) if mean_msgs > 1
            else np.ones(n_req, dtype=np.int64))


def _op_codes(u: np.ndarray) -> np.ndarray:
    """Operation mix: CREATE 40%, UPDATE 40%, DELETE 15%, GET 2.5%, INFO 2.5%."""
    opc = {o: OPERATION_NAMES.index(o.value) for o in OT}
    return np.select([u < 0.4, u < 0.8, u < 0.95, u < 0.975],
                     [opc[OT.CREATE], opc[OT.UPDATE], opc[OT.DELETE], opc[OT.GET]],
                     opc[OT.INFO]).astype(np.int8)


def _lifecycle_ops(op: np.ndarray, u_op: np.ndarray, phase: np.ndarray, share: float) -> None:
    """In a creation (deletion) burst a message is CREATE (DELETE) with probability
    ``share``, else it follows the ordinary mix (drawn from the rest of the same uniform)."""
    opc = {o: OPERATION_NAMES.index(o.value) for o in OT}
    life = phase != PHASE_NORMAL
    if not life.any():
        return
    rest = _op_codes(np.clip((u_op[life] - share) / max(1.0 - share, 1e-12), 0.0, 1.0))
    forced = np.where(phase[life] == PHASE_CREATE, opc[OT.CREATE], opc[OT.DELETE])
    op[life] = np.where(u_op[life] < share, forced, rest).astype(np.int8)


def _emit_messages(spec: ScenarioSpec, g: np.random.Generator, rt: np.ndarray,
                   per_req: np.ndarray, req_vpc: np.ndarray, topo: Topology,
                   members: list[np.ndarray], groups: _Groups, place: _Placement, *,
                   start_ns: int = TRACE_EPOCH_NS, req_version: np.ndarray | None = None,
                   req_phase: np.ndarray | None = None, lifecycle_share: float = 0.9
                   ) -> Trace:
    """Requests -> messages, shared by the static and the dynamic generator.

    ``rt`` are request times (seconds after ``start_ns``, sorted), ``per_req`` their message
    counts and ``req_vpc`` their VPC indices. Draws sizes and the kind / pick / configuration
    / operation uniforms from ``g``. Optional per request: ``req_version``, the placement
    version in force (default 0), and ``req_phase``, the VPC's life-cycle phase
    (:data:`PHASE_CREATE` messages are CREATE of SUBNET (multicast) or PORT (unicast) with
    probability ``lifecycle_share``; :data:`PHASE_DELETE` messages are DELETE with that
    probability). Message ids are ``1..n``, request ids ``1..len(rt)``.
    """
    n_req = rt.size
    n = int(per_req.sum())
    req_of = np.repeat(np.arange(n_req), per_req)
    within = np.arange(n) - np.repeat(np.cumsum(per_req) - per_req, per_req)
    ts = start_ns + np.rint(rt[req_of] * 1e9).astype(np.int64) + within  # +1 ns each
    order = np.argsort(ts, kind="stable")
    req_of, ts = req_of[order], ts[order]
    vpc = req_vpc[req_of]
    sizes = _sizes(g, n, spec)
    u_kind = g.random(n)
    u_pick = g.random(n)
    u_cfg = g.random(n)
    u_op = g.random(n)
    multicast = u_kind < spec.multicast_share
    phase = None if req_phase is None else req_phase[req_of]

    # multicast: whole VPC w.p. 1/3, else a subnet or security group
    gstart = groups.start
    n_groups = gstart[vpc + 1] - gstart[vpc]
    rest = np.maximum(n_groups - 1, 1)
    sub = np.minimum((u_pick - 1 / 3) * 1.5 * rest, rest - 1).astype(np.int64)
    grp = np.where((u_pick < 1 / 3) | (n_groups == 1), gstart[vpc],
                   gstart[vpc] + 1 + np.maximum(sub, 0))
    creating = None
    if phase is not None:  # a creation burst configures subnets and ports
        creating = phase == PHASE_CREATE
        n_sub = groups.subnets()[vpc]
        subnet = gstart[vpc] + 1 + np.minimum((u_pick * n_sub).astype(np.int64), n_sub - 1)
        grp = np.where(creating & (u_cfg < lifecycle_share), subnet, grp)
    # unicast: one VM of the VPC
    vpc_sizes = np.array([m.size for m in members])
    vm_pos = np.minimum((u_pick * vpc_sizes[vpc]).astype(np.int64), vpc_sizes[vpc] - 1)
    vm_flat = np.concatenate(members)
    vm_start = np.concatenate([[0], np.cumsum(vpc_sizes)])
    vm = vm_flat[vm_start[vpc] + vm_pos]

    code = {c: CONFIG_NAMES.index(c.value) for c in CT}
    cfg = np.empty(n, dtype=np.int8)
    kind = groups.kind[grp]
    cfg_whole = np.where(u_cfg < 0.6, code[CT.VPC], np.where(u_cfg < 0.85, code[CT.ROUTER],
                                                             code[CT.GATEWAY]))
    cfg_multi = np.where(kind == 0, cfg_whole,
                         np.where(kind == 1, code[CT.SUBNET], code[CT.SECURITY_GROUP]))
    cfg_uni = np.where(u_cfg < 0.7, code[CT.PORT], np.where(u_cfg < 0.9, code[CT.NEIGHBOR],
                                                            code[CT.DHCP]))
    if creating is not None:
        cfg_uni = np.where(creating & (u_cfg < lifecycle_share), code[CT.PORT], cfg_uni)
    cfg[:] = np.where(multicast, cfg_multi, cfg_uni)
    op = _op_codes(u_op)
    if phase is not None:
        _lifecycle_ops(op, u_op, phase, lifecycle_share)
    resource = np.where(multicast, (np.uint64(1) << np.uint64(56)) + grp.astype(np.uint64),
                        (np.uint64(2) << np.uint64(56)) + vm.astype(np.uint64)).astype(np.uint64)
    version = (np.zeros(n, dtype=np.int64) if req_version is None
               else req_version[req_of].astype(np.int64))
    hosts_ptr, hosts = _destinations(place, groups.size, grp + version * groups.size, vm,
                                     version, multicast)
    return Trace(
        message_id=np.arange(1, n + 1, dtype=np.uint32),
        request_id=(req_of + 1).astype(np.uint32),
        vpc_id=topo.vm_vpc[vm_flat[vm_start[vpc]]].astype(np.uint32),
        timestamp_ns=ts,
        configuration_type=cfg,
        operation_type=op,
        resource_id=resource,
        size_bytes=sizes,
        hosts_indptr=hosts_ptr,
        hosts=topo.node_ids[hosts],
    )


def _destinations(place: _Placement, num_groups: int, group_row: np.ndarray, vm: np.ndarray,
                  version: np.ndarray, multicast: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Destination CSR (indptr, node indices): a multicast message goes to its group's
    nodes (row ``group_row`` of the placement's group CSR), a unicast one to its VM's node."""
    g_ptr, g_vals = _gather_csr(place.group_ptr, place.group_nodes, group_row)
    lens = np.where(multicast, np.diff(g_ptr), 1)
    hosts_ptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    hosts = np.empty(hosts_ptr[-1], dtype=np.int64)
    mc_rows = np.flatnonzero(multicast)
    if mc_rows.size:
        src_ptr, src_vals = _gather_csr(g_ptr, g_vals, mc_rows)
        dst = np.repeat(hosts_ptr[mc_rows] - src_ptr[:-1], np.diff(src_ptr)) + np.arange(
            src_ptr[-1])
        hosts[dst] = src_vals
    uc_rows = np.flatnonzero(~multicast)
    hosts[hosts_ptr[uc_rows]] = place.vm_node[version[uc_rows], vm[uc_rows]]
    return hosts_ptr, hosts


# ---------------------------------------------------------------------- trace
def generate(spec: ScenarioSpec) -> Dataset:
    """Generate the scenario's topology and message trace (deterministic in ``spec.seed``)."""
    topo, members = _topology(spec, rng(spec.seed, spec.name, "topology"))
    groups = _group_members(spec, members, rng(spec.seed, spec.name, "groups"))
    place = _Placement.of(groups, topo.vm_node)
    g = rng(spec.seed, spec.name, "arrivals")
    mean_msgs = max(spec.messages_per_request, 1.0)
    req_times: list[np.ndarray] = []
    t0 = 0.0
    for dur, mult in spec.phase_table():
        lam = spec.total_rate_bps() * mult / (8.0 * spec.mean_size_bytes) / mean_msgs
        k = int(g.poisson(lam * dur))
        req_times.append(np.sort(t0 + g.random(k) * dur))
        t0 += dur
    rt = np.concatenate(req_times) if req_times else np.zeros(0)
    per_req = _messages_per_request(g, rt.size, spec)
    req_vpc = g.integers(0, spec.num_vpcs, rt.size)  # equal traffic per VPC
    trace = _emit_messages(spec, g, rt, per_req, req_vpc, topo, members, groups, place)
    meta = {"name": spec.name, "generator": "envs.dsmd.scenarios.generate",
            "trace_key": spec.trace_key(), "spec": spec.to_dict(),
            "start_ns": TRACE_EPOCH_NS, "duration_s": spec.duration_s}
    return Dataset(topo, trace, meta)


def scenario_dataset(spec: ScenarioSpec, cache_dir: str | Path | None = None) -> Dataset:
    """The scenario's dataset, generated once and cached as Parquet under ``cache_dir``.

    With ``cache_dir=None`` the dataset is generated in memory and not written.
    """
    if cache_dir is None:
        return generate(spec)
    d = Path(cache_dir) / f"{spec.name}-{spec.trace_key()}"
    if (d / "messages.parquet").is_file():
        return read_dataset(d)
    ds = generate(spec)
    write_dataset(d, ds, overwrite=True)
    return ds
