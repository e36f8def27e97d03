"""The exact cost model of Eq. 1 (SMART Section V-B), full and incremental.

For an assignment ``channel[m]`` (0 = RPC, t = MQ topic t, -1 = unassigned):

* controller bandwidth ``sum_m f(m) (|D(m)| if RPC else 1)``          (2nd constraint)
* controller concurrent sends ``sum_m (|D(m)| if RPC else 1)``        (3rd constraint)
* node ``n`` subscribes topic ``t`` iff some type on ``t`` has ``n`` in ``D(m)``  (z, 4th)
* node traffic ``b(n) = sum_{m RPC, n in D(m)} f(m) + sum_{t: z[n,t]} R_t`` with
  ``R_t = sum_{m on t} f(m)``                                          (5th)
* objective ``sum_n b(n) = sum_{m RPC} f(m)|D(m)| + sum_t R_t S_t`` with ``S_t`` the number
  of subscribers of ``t``; necessary traffic ``sum_m f(m)|D(m)|``; redundancy the excess.

:func:`evaluate` recomputes everything from scratch (vectorised); :class:`CostState`
keeps the same quantities under single-type moves in O(|D(m)| + N) time. Both use integer
bit/s, so they agree exactly (``tests/test_cost.py`` checks it after random move sequences).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import kernels as _k
from .errors import InstanceError
from .instance import RPC, UNASSIGNED, DSMDInstance

__all__ = [
    "CostSnapshot",
    "CostState",
    "Metrics",
    "evaluate",
    "metrics_from",
    "node_stats",
    "subscriptions",
    "violation",
]


@dataclass(frozen=True)
class Metrics:
    """Every metric of Section VII-B for one assignment, plus each constraint's violation."""

    controller_traffic_bps: float  # (1) traffic on the controller
    sent_messages_per_s: float  # (2) southbound messages sent by the controller
    controller_sends: int  # concurrent sends, the CPU model of Eq. 1 (vs C_p)
    total_node_traffic_bps: float  # (4) total traffic on compute nodes (objective)
    max_node_traffic_bps: float  # (5) maximum traffic on a compute node
    necessary_traffic_bps: float  # lower bound: no redundancy
    redundancy_bps: float  # total - necessary
    redundancy_ratio: float  # total / necessary
    controller_bw_violation: float  # [bw / C_b - 1]^+
    controller_cpu_violation: float  # [sends / C_p - 1]^+
    node_violation: float  # sum_n [b(n) / s(n) - 1]^+
    nodes_over_capacity: int
    feasible: bool
    assigned_types: int
    rpc_types: int
    mq_types: int
    topics_used: int

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in _METRIC_FIELDS}


_METRIC_FIELDS = tuple(Metrics.__dataclass_fields__)


@dataclass(frozen=True, eq=False)
class CostSnapshot:
    """Exact integer quantities of an assignment (what :class:`CostState` maintains)."""

    node_traffic: np.ndarray  # int64 (N,) b(n)
    topic_rate: np.ndarray  # int64 (K+1,) R_t (index 0 unused)
    topic_subscribers: np.ndarray  # int64 (K+1,) S_t
    controller_bw: int
    controller_cpu: int
    total_traffic: int
    necessary: int
    sent_messages: int  # per interval


def evaluate(inst: DSMDInstance, channel: np.ndarray) -> CostSnapshot:
    """Full recomputation of Eq. 1's quantities for ``channel`` (vectorised)."""
    channel = np.asarray(channel, dtype=np.int64)
    _check_channels(inst, channel)
    n, k = inst.num_nodes, inst.num_topics
    f, d, msgs = inst.rate_bps, inst.fanout, inst.messages
    assert msgs is not None  # filled in DSMDInstance.__post_init__
    rpc = channel == RPC
    mq = channel > 0
    assigned = channel >= 0
    row = inst.type_of_entry
    node = np.zeros(n, dtype=np.int64)
    e_rpc = rpc[row]
    np.add.at(node, inst.dest_idx[e_rpc], f[row[e_rpc]])
    topic_rate = np.zeros(k + 1, dtype=np.int64)
    np.add.at(topic_rate, channel[mq], f[mq])
    e_mq = mq[row]
    pairs = np.unique(channel[row[e_mq]] * n + inst.dest_idx[e_mq])
    sub_t, sub_n = pairs // n, pairs % n
    np.add.at(node, sub_n, topic_rate[sub_t])
    subs = np.bincount(sub_t, minlength=k + 1).astype(np.int64)
    fd = f * d
    return CostSnapshot(
        node_traffic=node, topic_rate=topic_rate, topic_subscribers=subs,
        controller_bw=int(fd[rpc].sum() + f[mq].sum()),
        controller_cpu=int(d[rpc].sum() + mq.sum()),
        total_traffic=int(fd[rpc].sum() + np.dot(topic_rate, subs)),
        necessary=int(fd[assigned].sum()),
        sent_messages=int((msgs * d)[rpc].sum() + msgs[mq].sum()))


def subscriptions(inst: DSMDInstance, channel: np.ndarray) -> np.ndarray:
    """Eq. 1's ``z``: ``z[t - 1, n]`` is true iff node ``n`` subscribes topic ``t`` under
    ``channel`` (some type on ``t`` has ``n`` in ``D(m)``), bool ``[K, N]``."""
    channel = np.asarray(channel, dtype=np.int64)
    _check_channels(inst, channel)
    row = inst.type_of_entry
    e = channel[row] > 0
    z = np.zeros((inst.num_topics + 1, inst.num_nodes), dtype=bool)
    z[channel[row[e]], inst.dest_idx[e]] = True
    return z[1:]


def violation(inst: DSMDInstance, controller_bw: int, controller_cpu: int,
              node_traffic: np.ndarray) -> float:
    """Total normalised violation of Eq. 1's constraints:
    ``[bw/C_b - 1]^+ + [sends/C_p - 1]^+ + sum_n [b(n)/s(n) - 1]^+``."""
    v = max(controller_bw / inst.controller_bw_bps - 1.0, 0.0)
    v += max(controller_cpu / inst.controller_cpu - 1.0, 0.0)
    over = node_traffic - inst.node_capacity_bps
    if over.size and over.max() > 0:
        v += float((np.maximum(over, 0) / inst.node_capacity_bps).sum())
    return v


def _check_channels(inst: DSMDInstance, channel: np.ndarray) -> None:
    if channel.shape != (inst.num_types,):
        raise InstanceError(f"assignment has {channel.shape} entries, expected {inst.num_types}")
    if channel.size and (channel.min() < UNASSIGNED or channel.max() > inst.num_topics):
        raise InstanceError(f"channels must be in -1..{inst.num_topics} (0 = RPC, t = topic)")


def node_stats(inst: DSMDInstance, node_traffic: np.ndarray, ratio: np.ndarray | None = None
               ) -> tuple[float, float, int, float]:
    """(max b(n), sum_n [b(n)/s(n) - 1]^+, #nodes over s(n), sum_n b(n)/s(n))."""
    if ratio is None:
        ratio = node_traffic * inst.inv_capacity
    if not node_traffic.size:
        return 0.0, 0.0, 0, 0.0
    if ratio.max() <= 1.0:
        return float(node_traffic.max()), 0.0, 0, float(ratio.sum())
    over = ratio > 1.0
    return (float(node_traffic.max()), float(ratio[over].sum()) - int(over.sum()),
            int(over.sum()), float(ratio.sum()))


def metrics_from(inst: DSMDInstance, channel: np.ndarray, node_traffic: np.ndarray,
                 controller_bw: int, controller_cpu: int, total: int, necessary: int,
                 sent_messages: int, counts: tuple[int, int, int, int] | None = None,
                 nstats: tuple[float, float, int, float] | None = None) -> Metrics:
    """Metrics in bit/s from the exact integer quantities.

    ``counts`` = (assigned, rpc, mq, topics used) and ``nstats`` (:func:`node_stats`) may be
    passed when already known (the incremental state keeps them)."""
    bw_v = max(controller_bw / inst.controller_bw_bps - 1.0, 0.0)
    cpu_v = max(controller_cpu / inst.controller_cpu - 1.0, 0.0)
    max_b, node_v, n_over, _ = nstats if nstats is not None else node_stats(inst, node_traffic)
    if counts is None:
        mq = channel > 0
        counts = (int(np.count_nonzero(channel >= 0)), int(np.count_nonzero(channel == RPC)),
                  int(np.count_nonzero(mq)), int(np.unique(channel[mq]).size))
    return Metrics(
        controller_traffic_bps=float(controller_bw),
        sent_messages_per_s=sent_messages / inst.interval_s,
        controller_sends=int(controller_cpu),
        total_node_traffic_bps=float(total),
        max_node_traffic_bps=max_b,
        necessary_traffic_bps=float(necessary),
        redundancy_bps=float(total - necessary),
        redundancy_ratio=float(total / necessary) if necessary else 1.0,
        controller_bw_violation=bw_v,
        controller_cpu_violation=cpu_v,
        node_violation=node_v,
        nodes_over_capacity=n_over,
        feasible=bool(bw_v == 0.0 and cpu_v == 0.0 and n_over == 0),
        assigned_types=counts[0],
        rpc_types=counts[1],
        mq_types=counts[2],
        topics_used=counts[3],
    )


_MOVE_ARGS = 14  # CostState.moving_arrays()[:14]: what kernels.move_type takes after (m, c)


class CostState:
    """Eq. 1's quantities under single-type moves (the simulator's hot path).

    ``move(m, c)`` costs O(|D(m)|) for RPC and O(|D(m)| + N) for a topic (every current
    subscriber of the topic receives the moved type's traffic).
    """

    def __init__(self, inst: DSMDInstance, channel: np.ndarray | None = None) -> None:
        self.inst = inst
        m, n, k = inst.num_types, inst.num_nodes, inst.num_topics
        self.channel = np.full(m, UNASSIGNED, dtype=np.int64)
        self.node_traffic = np.zeros(n, dtype=np.int64)
        self.topic_rate = np.zeros(k + 1, dtype=np.int64)
        self.topic_subscribers = np.zeros(k + 1, dtype=np.int64)
        self.topic_types = np.zeros(k + 1, dtype=np.int64)
        self.sub_count = np.zeros((k + 1, n), dtype=np.int32)  # types on t with n in D(m)
        #: the scalars, int64, at the kernels' indices (``kernels.BW`` .. ``kernels.PEND``):
        #: the kernels that move types update them in place; read them by name
        self.sc = np.zeros(8, dtype=np.int64)
        self.version = 0  # bumped by every change; keys the node-statistics cache
        self._nstats: tuple[int, tuple] | None = None
        self._ratio: tuple[int, np.ndarray] | None = None
        self._rate = inst.rate_bps.tolist()
        assert inst.messages is not None  # filled in DSMDInstance.__post_init__
        self._dest = inst.destination_lists
        # what the unassigned types will cost at least, whatever their channel: f(m) on
        # each destination node and f(m) (one publish) on the controller; tracked from the
        # first fits(reserve=True) or feasible DecisionStep.apply on (see track_pending), so
        # plain moves pay nothing for it
        self.pending_node: np.ndarray | None = None
        self._moving: tuple | None = None  # moving_arrays(), until an array is replaced
        if channel is not None:
            self.assign_all(channel)

    # ------------------------------------------------------------------ updates
    def assign_all(self, channel: np.ndarray) -> None:
        """Set the whole assignment at once (one compiled pass, :func:`envs.dsmd.kernels.
        build_state`; equals :func:`evaluate` and a sequence of moves)."""
        channel = np.asarray(channel, dtype=np.int64)
        _check_channels(self.inst, channel)
        inst = self.inst
        self.channel = channel.copy()
        self.node_traffic = np.zeros(inst.num_nodes, dtype=np.int64)
        self.topic_rate = np.zeros(inst.num_topics + 1, dtype=np.int64)
        self.topic_subscribers = np.zeros(inst.num_topics + 1, dtype=np.int64)
        self.topic_types = np.zeros(inst.num_topics + 1, dtype=np.int64)
        self.sub_count[:] = 0
        self.sc[:] = 0
        self._moving = None
        st = self.kernel_arrays()
        _k.build_state(st)
        self.sync_scalars(st[6])

    def move(self, m: int, c: int) -> None:
        """Put type ``m`` on channel ``c`` (0 = RPC, 1..K = topic, -1 = unassign): current
        subscribers of a topic get f(m), new ones the whole topic; leaving subscribers lose
        it (one compiled step, :func:`envs.dsmd.kernels.move_type`)."""
        m, c = int(m), int(c)
        if not 0 <= m < self.inst.num_types:  # the compiled move indexes with it unchecked
            raise InstanceError(f"type {m} out of range 0..{self.inst.num_types - 1}")
        old = int(self.channel[m])
        if old == c:
            return
        if not UNASSIGNED <= c <= self.inst.num_topics:
            raise InstanceError(f"channel {c} out of range -1..{self.inst.num_topics}")
        _k.move_type(m, c, *self.moving_arrays()[:_MOVE_ARGS])
        self.version += 1

    def moving_arrays(self) -> tuple:
        """What the compiled steps that move types take after the type (and, for
        :func:`envs.dsmd.kernels.decide_next`, its scores): :func:`envs.dsmd.kernels.
        move_type`'s state ``(channel, node_traffic, topic_rate, topic_subscribers,
        topic_types, sub_count, sc, dest_ptr, dest_idx, rate, fanout, messages, pend,
        track)``, then ``(inv_capacity, C_b, C_p, num_types)``. Built once and kept until an
        array of the state is replaced (:meth:`assign_all`, :meth:`track_pending`)."""
        if self._moving is not None:
            return self._moving
        inst, pend = self.inst, self.pending_node
        self._moving = (self.channel, self.node_traffic, self.topic_rate,
                        self.topic_subscribers, self.topic_types, self.sub_count, self.sc,
                        inst.dest_ptr, inst.dest_idx, inst.rate_bps, inst.fanout,
                        inst.messages, self.node_traffic if pend is None else pend,
                        pend is not None, inst.inv_capacity, int(inst.controller_bw_bps),
                        int(inst.controller_cpu), inst.num_types)
        return self._moving

    # the scalars by name (views of ``sc``)
    @property
    def controller_bw(self) -> int:
        """Controller bandwidth, sum_m f(m) (|D(m)| if RPC else 1), bit/s."""
        return int(self.sc[_k.BW])

    @property
    def controller_cpu(self) -> int:
        """Controller concurrent sends, sum_m (|D(m)| if RPC else 1)."""
        return int(self.sc[_k.CPU])

    @property
    def total_traffic(self) -> int:
        """sum_n b(n), bit/s."""
        return int(self.sc[_k.TOT])

    @property
    def necessary(self) -> int:
        """sum_m f(m) |D(m)| over the assigned types, bit/s."""
        return int(self.sc[_k.NEC])

    @property
    def sent_messages(self) -> int:
        """Messages the controller sends per interval (|D(m)| copies of an RPC type's)."""
        return int(self.sc[_k.SENT])

    @property
    def assigned(self) -> int:
        """Types on a channel."""
        return int(self.sc[_k.ASG])

    @property
    def rpc_types(self) -> int:
        """Types on RPC."""
        return int(self.sc[_k.RPCT])

    @property
    def pending_rate(self) -> int:
        """sum of f(m) over the unassigned types (kept once :attr:`pending_node` is)."""
        return int(self.sc[_k.PEND])

    def kernel_arrays(self) -> tuple:
        """The state as the state kernels (:func:`envs.dsmd.kernels.state_move`) take it, one
        tuple:
        ``(channel, node_traffic, topic_rate, topic_subscribers, topic_types, sub_count, sc,
        dest_ptr, dest_idx, rate, fanout, messages, capacity, C_b, C_p)``. The arrays are
        the state's own, ``sc`` included (changed in place); call :meth:`sync_scalars` after
        a kernel moved types."""
        inst = self.inst
        return (self.channel, self.node_traffic, self.topic_rate, self.topic_subscribers,
                self.topic_types, self.sub_count, self.sc, inst.dest_ptr, inst.dest_idx,
                inst.rate_bps, inst.fanout, inst.messages, inst.node_capacity_bps,
                int(inst.controller_bw_bps), int(inst.controller_cpu))

    def sync_scalars(self, sc: np.ndarray) -> None:
        """After state kernels moved types on :meth:`kernel_arrays`: take the scalars of
        ``sc`` if it is not the state's own, recompute the pending least costs if they are
        tracked (those kernels do not track them) and mark the state changed."""
        if sc is not self.sc:
            self.sc[:_k.PEND] = sc[:_k.PEND]
        if self.pending_node is not None:
            self.track_pending()
        self.version += 1

    # ------------------------------------------------------------------ what-ifs
    def violations_if(self, m: int, channels: np.ndarray) -> np.ndarray:
        """:meth:`violation` with unassigned ``m`` on each of ``channels`` (float64); the
        state is left as it was."""
        if self.channel[m] != UNASSIGNED:
            raise InstanceError(f"type {m} is assigned; remove it before a what-if")
        channels = np.asarray(channels, dtype=np.int64)
        if channels.size and (channels.min() < RPC or channels.max() > self.inst.num_topics):
            raise InstanceError(f"channels must be in 0..{self.inst.num_topics}")
        out: np.ndarray = _k.violations_if(int(m), channels, self.kernel_arrays())
        return out

    def channel_costs(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        """(increase of ``sum_n b(n)``, new subscribers) per channel if unassigned ``m`` went there.

        Index 0 is RPC (``f |D|``, 0 new subscribers); index ``t`` is topic ``t``:
        ``f S_t + (R_t + f) * |D(m) \\ subscribers(t)|``. Both int64, length K+1.
        """
        if self.channel[m] != UNASSIGNED:
            raise InstanceError(f"type {m} is assigned; remove it before asking for deltas")
        return _k.channel_costs(self.sub_count, self._dest[m], self._rate[m],
                                self.topic_subscribers, self.topic_rate)

    def channel_costs_many(self, ms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`channel_costs` of several unassigned types at once, each as if it were the
        only one to move: ``(delta, fresh)``, int64 ``[len(ms), K+1]``."""
        ms = np.asarray(ms, dtype=np.int64)
        if ms.size and np.any(self.channel[ms] != UNASSIGNED):
            raise InstanceError("channel_costs_many needs unassigned types")
        inst = self.inst
        return _k.channel_costs_many(self.sub_count, inst.dest_ptr, inst.dest_idx, ms,
                                     inst.rate_bps, self.topic_subscribers, self.topic_rate)

    def topic_deltas(self, m: int) -> np.ndarray:
        """The first half of :meth:`channel_costs`."""
        return self.channel_costs(m)[0]

    def node_peak_if(self, m: int, c: int) -> float:
        """max_n b(n)/s(n) over the nodes whose traffic changes if unassigned ``m`` goes to
        ``c``."""
        f, dest = self._rate[m], self._dest[m]
        cap = self.inst.node_capacity_bps
        b = self.node_traffic
        if c == RPC:
            return float(((b[dest] + f) / cap[dest]).max())
        row = self.sub_count[c]
        peak = 0.0
        subs = row > 0
        if subs.any():
            peak = float(((b[subs] + f) / cap[subs]).max())
        fresh = dest[row[dest] == 0]
        if fresh.size:
            peak = max(peak, float(((b[fresh] + self.topic_rate[c] + f) / cap[fresh]).max()))
        return peak

    def track_pending(self) -> None:
        """(Re)compute the unassigned types' least costs (:attr:`pending_node`,
        :attr:`pending_rate`) and keep them up to date from now on."""
        inst = self.inst
        free = self.channel == UNASSIGNED
        row = inst.type_of_entry
        e = free[row]
        self.pending_node = np.zeros(inst.num_nodes, dtype=np.int64)
        self._moving = None
        np.add.at(self.pending_node, inst.dest_idx[e], inst.rate_bps[row[e]])
        self.sc[_k.PEND] = int(inst.rate_bps[free].sum())

    def topic_room(self, m: int, reserve: bool = False) -> bool:
        """Whether the controller has room for unassigned ``m`` on a topic (one publish of
        f(m), one send; the same test as :meth:`fits` makes for any topic, and RPC costs the
        controller at least as much): if not, no channel fits."""
        return self._controller_fits(m, False, reserve)

    def _controller_fits(self, m: int, rpc: bool, reserve: bool) -> bool:
        """The controller's half of :meth:`fits`: bandwidth and CPU within C_b and C_p
        (:func:`envs.dsmd.kernels.controller_fits`, which the compiled decision uses too)."""
        if reserve and self.pending_node is None:
            self.track_pending()
        inst = self.inst
        return bool(_k.controller_fits(int(m), rpc, reserve, self.sc, inst.rate_bps,
                                       inst.fanout, int(inst.controller_bw_bps),
                                       int(inst.controller_cpu), inst.num_types))

    def fits(self, m: int, c: int, reserve: bool = False) -> bool:
        """Whether putting unassigned ``m`` on channel ``c`` keeps Eq. 1's constraints: the
        controller's bandwidth and CPU within C_b and C_p, and every node whose traffic the
        move changes within s(n) (the same float test as :func:`node_stats`).

        With ``reserve``, the types still unassigned after ``m`` are counted at the least
        they will cost on any channel (one publish and one send on the controller, f(m') on
        each destination node), so a move that fits leaves the rest of the episode a chance
        to fit too."""
        if not self._controller_fits(m, c == RPC, reserve):
            return False
        # with reserve, a node's traffic is counted with its pending least cost (a lower
        # bound of its final traffic, m's own f included: on a subscribed destination f
        # moves from pending to b)
        b = pend = self.node_traffic
        if reserve:
            assert self.pending_node is not None  # set by _controller_fits(reserve=True)
            pend = self.pending_node
        return _k.nodes_fit(b, pend, reserve,
                            self.inst.inv_capacity, self.sub_count[c], self._dest[m],
                            self._rate[m], c == RPC, int(self.topic_rate[c]),
                            int(self.topic_subscribers[c]))

    def least_fitting(self, m: int, scores: np.ndarray, fallback: int = 4,
                      headroom: float = 0.0) -> int:
        """The channel of least ``scores`` (float64, K+1; equal scores: lower channel first)
        that unassigned ``m`` fits on (:meth:`fits`, no reserve); if none, the least
        (violation, score) among RPC and the ``fallback`` best-scoring topics. One compiled
        pass; the state is left as it was.

        With ``headroom``, "fits" and "violation" are against ``(1 - headroom)`` of every
        capacity (:meth:`DSMDInstance.reserved`): the reserve an online plan keeps."""
        if self.channel[m] != UNASSIGNED:
            raise InstanceError(f"type {m} is assigned; remove it before a what-if")
        scores = np.asarray(scores, dtype=np.float64)
        if scores.shape != (self.inst.num_topics + 1,):
            raise InstanceError(f"scores need {self.inst.num_topics + 1} entries, got "
                                f"{scores.shape}")
        arrays = self.kernel_arrays()
        r = self.inst.reserved(headroom)
        if r is not self.inst:  # the same state against the reserved capacities
            arrays = (*arrays[:12], r.node_capacity_bps, int(r.controller_bw_bps),
                      int(r.controller_cpu))
        return int(_k.least_fitting(int(m), scores, int(fallback), r.inv_capacity, arrays))

    def first_fit(self, m: int, scores: np.ndarray, skip: int = -1) -> int:
        """The highest-scoring channel other than ``skip`` (ties: lower index first) that
        unassigned ``m`` fits on with the reserve (``fits(m, c, reserve=True)``), or -1."""
        rpc_ok = self._controller_fits(m, True, True)
        topic_ok = self._controller_fits(m, False, True)
        if not (rpc_ok or topic_ok):
            return -1
        pend = self.pending_node
        assert pend is not None  # set by _controller_fits(reserve=True)
        return int(_k.first_fit(_k.as_scores(scores), int(skip), self.node_traffic,
                                pend, self.inst.inv_capacity, self.sub_count,
                                self._dest[m], self._rate[m], self.topic_rate,
                                self.topic_subscribers, rpc_ok, topic_ok))

    # ------------------------------------------------------------------ views
    def violation(self) -> float:
        """:func:`violation` of the current state."""
        return violation(self.inst, self.controller_bw, self.controller_cpu, self.node_traffic)

    def snapshot(self) -> CostSnapshot:
        return CostSnapshot(self.node_traffic.copy(), self.topic_rate.copy(),
                            self.topic_subscribers.copy(), self.controller_bw,
                            self.controller_cpu, self.total_traffic, self.necessary,
                            self.sent_messages)

    def node_ratio(self) -> np.ndarray:
        """b(n) / s(n) of the current state (computed once per change; do not modify)."""
        if self._ratio is None or self._ratio[0] != self.version:
            self._ratio = (self.version, self.node_traffic * self.inst.inv_capacity)
        return self._ratio[1]

    def node_stats(self) -> tuple[float, float, int, float]:
        """:func:`node_stats` of the current state, computed once per change."""
        if self._nstats is None or self._nstats[0] != self.version:
            self._nstats = (self.version, node_stats(self.inst, self.node_traffic,
                                                     self.node_ratio()))
        return self._nstats[1]

    def metrics(self) -> Metrics:
        mq = self.assigned - self.rpc_types
        counts = (self.assigned, self.rpc_types, mq,
                  int(np.count_nonzero(self.topic_types)))
        return metrics_from(self.inst, self.channel, self.node_traffic, self.controller_bw,
                            self.controller_cpu, self.total_traffic, self.necessary,
                            self.sent_messages, counts, self.node_stats())
