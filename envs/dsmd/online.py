"""The online DSMD problem (SMART Section V-D, "online execution"; Fig. 10): the simulator core.

The static problem (:mod:`envs.dsmd.env`) gives a policy one interval with its true rates.
Online, a controller commits the channels for the next interval knowing only what it has
measured (Algorithm 1 estimates ``f(m)`` from the interval that just ended), types first
seen during an interval need a channel on their first message, and every change costs.

One interval ``i`` of a trace runs as follows, in three phases of one
:class:`OpenInterval` (:meth:`OnlineSimulator.open`), which the simulator runs in a row
(:meth:`OnlineSimulator.step`) and a live session runs as a controller's requests arrive
(:class:`serving.online_session.OnlineSession`), so that what is trained is what is served:

1. **Boundary.** The decider's :meth:`OnlineDecider.plan` sees an :class:`OnlineView`: the
   types seen before ``i`` (destinations, VPC, configuration), the per-interval rate
   estimates of the intervals before ``i`` and the current channel of every type. It
   returns a channel (and the rate it expects) for the types it wants to (re)plan; every
   other type keeps its channel.
2. **During the interval.** Each type the plan did not cover and that sends in ``i`` is
   placed, in the order of its first message in ``i``, by :meth:`OnlineDecider.place` from
   what is known then: its destinations, the size of that message (its rate estimate is
   ``8 size / T``), its current channel if it had one (a *returning* type: seen before,
   not in the plan, typically silent in the interval before the boundary; a *new* type has
   none) and the controller's expected load
   (the plan at the expected rates plus the types placed so far), through a
   :class:`Placement` handle.
3. **Scoring on the realised rates.** The interval's realised instance (the same instance
   as the static problem's window ``i``: every type with traffic in it, Eq. 1) is scored
   with the channels in force (:func:`envs.dsmd.cost.evaluate` through ``CostState``), plus
   the switching terms:

   * ``subscribe_infos``: the (node, topic) subscriptions that differ from the previous
     interval's (each is one SubscribeInfo to an agent and one subscription created or
     deleted on the broker); the subscriptions are the ones the controller holds
     (:meth:`OnlineTrace.held_subscriptions`): those of every type on a topic, silent
     types included, since the controller ends a subscription only when a move leaves no
     type on the topic that needs it;
   * ``moved_types``: the types of the interval whose channel differs from the channel
     they had when they last carried traffic (a type never seen before is not a move);
     each move opens a window in which the agent restores order across the two channels.

   The interval's cost (lower is better) is

       cost_i = sum_n b(n) / sum_m f(m)|D(m)|  +  w_delay p95_i  +  w_violation V_i
                + w_subscribe subscribe_infos_i  +  w_move moved_types_i

   with ``p95_i`` the 95th percentile of the interval's delivery delay in seconds, from the
   queueing model of C_b, C_p and every s(n) calibrated on the emulated network
   (:mod:`envs.dsmd.delay`), and ``V_i`` the normalised violation of the same constraints
   (Eq. 1's verdict, :func:`envs.dsmd.cost.violation`). The weights are :class:`OnlineCost`;
   every term is reported whatever its weight (``delay_p50_s``, ``delay_p95_s``, each
   resource's utilisation, each constraint's violation).

The first interval of a run without an initial state pays no switching terms. An interval
in which nothing is sent costs nothing and changes nothing (its subscriptions are those of
the interval before); summaries average over the intervals that carry traffic.

Nothing here imports gymnasium; :mod:`envs.dsmd.online_env` is the thin wrapper.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .cost import CostState
from .delay import (
    SWITCHING_COSTS,
    DelayLoad,
    DelayModel,
    delivery_share,
    load_delay_model,
    switching_seconds,
)
from .errors import DSMDError
from .instance import UNASSIGNED, DSMDInstance, rates_bps
from .parser import BatchKey, ParsedTrace, parse_trace
from .scenarios import ScenarioSpec
from .traces import Dataset

__all__ = [
    "INTERVAL_FIELDS",
    "SWITCHING_COSTS",
    "IntervalResult",
    "NewType",
    "OnlineCost",
    "OnlineDecider",
    "OnlineSimulator",
    "OnlineTrace",
    "OnlineView",
    "OpenInterval",
    "Placement",
    "PlanError",
    "relabel_topics",
    "run_online",
]


@dataclass(frozen=True)
class OnlineCost:
    """Weights of the online interval cost (module docstring) and the delay model it uses.

    The node-traffic term is the redundancy ratio (1.0 = no redundant traffic).
    ``w_delay`` prices a second of the interval's p95 delivery delay (``delay``: the
    calibrated :class:`envs.dsmd.delay.DelayModel`, ``envs/dsmd/delay_model.json`` by
    default; ``w_delay = 1``: a p95 of 100 ms costs as much as 10% more node traffic).
    ``w_violation`` prices Eq. 1's normalised violation (a violation of 1% of a capacity
    costs ``w_violation / 100``; 0 by default, 10 with ``w_delay = 0`` scores by Eq. 1).
    The switching weights are measured (:meth:`measured`, ``envs/dsmd/switching_costs.json``,
    written by ``bench/bench_switch_cost.py`` on the emulated network): a switch takes the
    controller about ``seconds_per_subscribe_info`` per SubscribeInfo and
    ``seconds_per_moved_type`` per moved type, and tau seconds of it are priced as tau / T
    more node traffic (that much of the interval T's sending work). The delay its moved
    types' messages wait is in the p95 term (:mod:`envs.dsmd.delay`). At the GoDaddy T = 30 s
    that is ``w_subscribe = 9.4e-5`` and ``w_move = 2.8e-5`` (the defaults).
    """

    w_violation: float = 0.0
    w_subscribe: float = 9.4e-5
    w_move: float = 2.8e-5
    w_delay: float = 1.0
    delay: DelayModel = field(default_factory=load_delay_model)

    #: the weights (what a client may set: :meth:`with_weights`)
    WEIGHTS = ("w_violation", "w_subscribe", "w_move", "w_delay")

    @classmethod
    def measured(cls, interval_s: float, path: str | Path | None = None,
                 w_violation: float = 0.0, w_delay: float = 1.0) -> OnlineCost:
        """The switching weights from the measured costs (``path``: default
        :data:`SWITCHING_COSTS`): seconds per SubscribeInfo and per moved type over the
        interval ``interval_s``."""
        if not interval_s > 0:
            raise DSMDError(f"interval_s must be positive, got {interval_s!r}")
        vals = switching_seconds(path)
        return cls(w_violation, vals["seconds_per_subscribe_info"] / interval_s,
                   max(vals["seconds_per_moved_type"], 0.0) / interval_s, w_delay)

    def __post_init__(self) -> None:
        for k in ("w_violation", "w_subscribe", "w_move", "w_delay"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0):
                raise DSMDError(f"online cost weight {k} must be a finite number >= 0, got {v!r}")
        if not isinstance(self.delay, DelayModel):
            raise DSMDError(f"online cost: delay must be a DelayModel, got {self.delay!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> OnlineCost:
        """From a config or a bundle's metadata: the weights, and ``delay_model`` (a path to
        the constants; null: the calibrated default) or ``delay`` (the constants)."""
        d = dict(d or {})
        path = d.pop("delay_model", None)
        delay = d.pop("delay", None)
        keys = set(cls.__dataclass_fields__) - {"delay"}
        unknown = sorted(set(d) - keys)
        if unknown:
            raise DSMDError(f"unknown online cost keys {unknown}; expected some of "
                            f"{sorted(keys | {'delay', 'delay_model'})}")
        if delay is not None and path is not None:
            raise DSMDError("online cost: give delay_model (a file) or delay (its constants), "
                            "not both")
        model = (DelayModel.from_dict(dict(delay), where="online cost delay")
                 if delay is not None else load_delay_model(path))
        return cls(**{k: float(v) for k, v in d.items()}, delay=model)

    def weights(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in self.WEIGHTS}

    def with_weights(self, d: dict[str, Any]) -> OnlineCost:
        """These weights over this cost (the delay model kept): a remote session's cost,
        whose client sets weights but not the server's delay model."""
        unknown = sorted(set(d) - set(self.WEIGHTS))
        if unknown:
            raise DSMDError(f"unknown online cost weights {unknown}; expected some of "
                            f"{list(self.WEIGHTS)}")
        w = self.weights() | {k: float(v) for k, v in d.items()}
        return replace(self, w_violation=w["w_violation"], w_subscribe=w["w_subscribe"],
                       w_move=w["w_move"], w_delay=w["w_delay"])

    @property
    def plan_violation_price(self) -> float:
        """The price a planner's hysteresis puts on a unit of expected Eq. 1 violation:
        ``w_violation``, or 10 when the score prices delay instead (``w_violation = 0``): a
        plan's expected loads say where it overloads a resource, not how long messages
        would wait."""
        return self.w_violation if self.w_violation > 0 or self.w_delay == 0 else 10.0

    def as_dict(self) -> dict[str, Any]:
        """What :meth:`from_dict` reads back (a bundle's ``cost``)."""
        return {"w_violation": self.w_violation, "w_subscribe": self.w_subscribe,
                "w_move": self.w_move, "w_delay": self.w_delay, "delay": self.delay.to_dict()}


def relabel_topics(need: np.ndarray, have: np.ndarray) -> np.ndarray:
    """A permutation of topics that keeps as many current subscriptions as possible.

    ``need[a, n]``: node ``n`` will need (new) topic ``a + 1``; ``have[b, n]``: it is
    subscribed to topic ``b + 1`` now. Returns ``perm`` (length K+1, ``perm[0] = 0``) with
    ``perm[a]`` the topic that new topic ``a`` becomes, maximising the kept subscriptions
    (Hungarian method). Which types share a topic, and so Eq. 1's cost, does not change.
    """
    from scipy.optimize import linear_sum_assignment
    from scipy.sparse import csr_matrix

    k = need.shape[0]
    perm = np.arange(k + 1, dtype=np.int64)
    if k == 0:
        return perm
    # sparse: a node subscribes a few of the K topics; the counts are exact in a double
    overlap = (csr_matrix(need, dtype=np.float64)
               @ csr_matrix(have, dtype=np.float64).T).toarray()
    rows, cols = linear_sum_assignment(overlap, maximize=True)
    perm[rows + 1] = cols + 1
    return perm


# ---------------------------------------------------------------------- the trace
@dataclass(frozen=True, eq=False)
class OnlineTrace:
    """One trace parsed once (Algorithm 1) over one type catalogue: the realised instance of
    every interval, each type's first interval, and each interval's types in the order of
    their first message in it."""

    name: str
    spec: ScenarioSpec
    parsed: ParsedTrace
    first_window: np.ndarray  # (M,) interval of each type's first message
    sizes: np.ndarray  # (R,) bytes of every message of the trace
    node_capacity_bps: np.ndarray
    _cache: dict[tuple[str, int], Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dataset(cls, dataset: Dataset, spec: ScenarioSpec, name: str = "",
                     batch_key: BatchKey = "hosts") -> OnlineTrace:
        start = dataset.meta.get("start_ns")
        dur = dataset.meta.get("duration_s")
        end = (None if start is None or dur is None
               else int(start) + round(float(dur) * 1e9))
        parsed = parse_trace(dataset.trace, dataset.topology, spec.interval_s, batch_key,
                             start_ns=start, end_ns=end)
        seen, first_row = np.unique(parsed.message_type, return_index=True)
        if seen.size != parsed.num_types:  # pragma: no cover - the parse made the catalogue
            raise DSMDError("a catalogued type has no message")
        return cls(name or dataset.name, spec, parsed,
                   parsed.message_window[first_row].astype(np.int64),
                   dataset.trace.size_bytes.astype(np.int64),
                   dataset.topology.bandwidth_bps.astype(np.int64))

    def held_subscriptions(self, channel: np.ndarray) -> np.ndarray:
        """(K, N) the (topic, node) subscriptions a controller holds under ``channel`` (each
        catalogued type's channel, -1: never placed): the nodes of every type on a topic,
        sending or silent. ``Controller.set_channels`` subscribes a type's nodes when it puts
        the type on a topic and ends a subscription only when no type on the topic needs
        it, so a type that falls silent keeps its subscriptions, and its return costs none."""
        key = ("destinations", self.num_types)
        if key not in self._cache:
            dests = self.parsed.catalog.destinations[:self.num_types]
            ptr = np.zeros(len(dests) + 1, np.int64)
            ptr[1:] = np.cumsum([d.size for d in dests])
            idx = (np.concatenate(dests).astype(np.int64) if dests
                   else np.zeros(0, np.int64))
            self._cache[key] = (np.diff(ptr), idx)
        fan, idx = self._cache[key]
        ch = np.repeat(np.asarray(channel, np.int64)[:fan.size], fan)
        on = ch > 0
        out = np.zeros((int(self.spec.num_topics), self.node_capacity_bps.size), bool)
        out[ch[on] - 1, idx[on]] = True
        return out

    @property
    def num_windows(self) -> int:
        return self.parsed.num_windows

    @property
    def num_types(self) -> int:
        return self.parsed.num_types

    @property
    def interval_s(self) -> float:
        return self.parsed.interval_s

    def realised(self, w: int) -> DSMDInstance:
        """The instance of interval ``w`` with its realised rates (rows: types with traffic
        in ``w``, ``catalog_index`` their type ids)."""
        key = ("realised", w)
        if key not in self._cache:
            s = self.spec
            self._cache[key] = DSMDInstance.from_estimate(
                self.parsed.catalog, self.parsed.window(w), s.num_topics, s.controller_bw_bps,
                s.controller_cpu, self.node_capacity_bps, name=f"{self.name}/w{w}")
        inst: DSMDInstance = self._cache[key]
        return inst

    def rates(self, w: int) -> np.ndarray:
        """Algorithm 1's estimate of interval ``w`` for every type (0 where it sent nothing)."""
        key = ("rates", w)
        if key not in self._cache:
            row = self.parsed.counter_bytes[w]
            r = np.zeros(row.size, np.int64)
            on = self.parsed.messages[w] > 0
            r[on] = rates_bps(row[on], self.interval_s)
            self._cache[key] = r
        rates: np.ndarray = self._cache[key]
        return rates

    def arrivals(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        """(types with traffic in interval ``w`` in the order of their first message in it,
        the trace rows of those messages)."""
        key = ("arrivals", w)
        if key not in self._cache:
            win = self.parsed.message_window
            lo, hi = np.searchsorted(win, [w, w + 1])
            types, first = np.unique(self.parsed.message_type[lo:hi], return_index=True)
            order = np.argsort(first, kind="stable")
            self._cache[key] = (types[order], lo + first[order])
        arrivals: tuple[np.ndarray, np.ndarray] = self._cache[key]
        return arrivals

    def new_types(self, w: int) -> np.ndarray:
        """Types first seen in interval ``w``, in the order of their first message."""
        types = self.arrivals(w)[0]
        new: np.ndarray = types[self.first_window[types] == w]
        return new

    def instance(self, types: np.ndarray, rates: np.ndarray, name: str = "") -> DSMDInstance:
        """An instance over catalogue ``types`` with the given rates (estimates, forecasts)."""
        s = self.spec
        return DSMDInstance.from_catalog(self.parsed.catalog, types, rates, s.num_topics,
                                         s.controller_bw_bps, s.controller_cpu,
                                         self.node_capacity_bps, interval_s=self.interval_s,
                                         name=name)


# ---------------------------------------------------------------------- what deciders see
class OnlineView:
    """What a decider knows at the boundary before interval ``window``: nothing of the future.

    ``hindsight=True`` (the oracle only) also exposes the realised instance of ``window``.
    """

    def __init__(self, trace: OnlineTrace, window: int, channel: np.ndarray,
                 hindsight: bool = False, last: dict[str, float] | None = None) -> None:
        self._trace, self.window, self._hindsight = trace, int(window), hindsight
        self._channel = channel
        #: the realised terms of the interval that just ended (``None`` before the first)
        self.last = last

    @property
    def spec(self) -> ScenarioSpec:
        return self._trace.spec

    @property
    def num_topics(self) -> int:
        return self._trace.spec.num_topics

    @property
    def interval_s(self) -> float:
        return self._trace.interval_s

    @property
    def num_nodes(self) -> int:
        return int(self._trace.node_capacity_bps.size)

    @property
    def node_capacity_bps(self) -> np.ndarray:
        return self._trace.node_capacity_bps

    def _require_seen(self, types: np.ndarray, what: str) -> None:
        if types.size and (self._trace.first_window[types] >= self.window).any():
            raise DSMDError(f"a decider {what} a type that has not been seen yet")

    def known_types(self) -> np.ndarray:
        """Every type seen before this interval (ascending ids)."""
        return np.flatnonzero(self._trace.first_window < self.window)

    def channel(self, types: np.ndarray | None = None) -> np.ndarray:
        """Current channel of ``types`` (default: every known type); -1 = never assigned."""
        known = self.known_types() if types is None else np.asarray(types, np.int64)
        self._require_seen(known, "asked for the channel of")
        channel: np.ndarray = self._channel[known].copy()
        return channel

    def history(self, types: np.ndarray, depth: int) -> np.ndarray:
        """Rate estimates (bit/s) of ``types`` in the ``depth`` intervals before this one,
        oldest first: ``[depth, len(types)]``; intervals before the trace's start are 0."""
        types = np.asarray(types, np.int64)
        self._require_seen(types, "asked for the history of")
        out = np.zeros((depth, types.size), np.int64)
        for j in range(depth):
            w = self.window - depth + j
            if w >= 0:
                out[j] = self._trace.rates(w)[types]
        return out

    def destinations(self, t: int) -> np.ndarray:
        self._require_seen(np.array([t], np.int64), "asked for the destinations of")
        return self._trace.parsed.catalog.destinations[int(t)]

    def vpcs(self, types: np.ndarray) -> np.ndarray:
        """The VPC of each of known ``types`` (the catalogue's VPC ids)."""
        types = np.asarray(types, np.int64)
        self._require_seen(types, "asked for the VPC of")
        out: np.ndarray = np.asarray(self._trace.parsed.catalog.vpc, np.int64)[types]
        return out

    def instance(self, types: np.ndarray, rates: np.ndarray, name: str = "") -> DSMDInstance:
        """A DSMD instance over known ``types`` with the given (expected) rates."""
        types = np.asarray(types, np.int64)
        self._require_seen(types, "built an instance with")
        return self._trace.instance(types, np.maximum(np.asarray(rates, np.int64), 1),
                                    name or f"{self._trace.name}/plan{self.window}")

    def estimate(self, w: int) -> DSMDInstance:
        """Algorithm 1's estimate of past interval ``w`` (``w < window``): its instance."""
        if not 0 <= w < self.window:
            raise DSMDError(f"interval {w} is not in the past of interval {self.window}")
        return self._trace.realised(w)

    def realised(self) -> DSMDInstance:
        """The realised instance of this interval (hindsight deciders only)."""
        if not self._hindsight:
            raise DSMDError("only a hindsight (oracle) run can see the realised rates")
        return self._trace.realised(self.window)


@dataclass(frozen=True)
class NewType:
    """A type whose first message of the interval just arrived and that the boundary plan did
    not cover: a new type (never seen) or a returning one (seen before); what the
    controller knows of it."""

    type_id: int
    destinations: np.ndarray  # node indices
    size_bytes: int  # of the first message
    rate_bps: int  # the estimate 8 size / T
    vpc: int
    config: int
    previous_channel: int = UNASSIGNED  # a returning type's channel; -1 for a new type


class Placement:
    """What a decider may ask while it places one new type: the controller's expected load
    (the plan at its expected rates plus the types placed so far), never the types still to
    come (they are in the simulator's state, unassigned, and not reachable from here)."""

    def __init__(self, state: CostState, row: int) -> None:
        self.__state, self.__row = state, row

    @property
    def necessary_bps(self) -> int:
        """Expected necessary node traffic of the planned and placed types."""
        return int(self.__state.necessary)

    def costs(self) -> tuple[np.ndarray, np.ndarray]:
        """(added node traffic, new subscribers) per channel 0..K for the new type."""
        return self.__state.channel_costs(self.__row)

    def fits(self, c: int) -> bool:
        """Whether channel ``c`` keeps every expected load within Eq. 1's capacities."""
        return self.__state.fits(self.__row, int(c))

    def choose(self, scores: Sequence[float] | np.ndarray, fallback: int = 4,
               headroom: float = 0.0) -> int:
        """The channel of least ``scores`` (K+1 values; equal scores: lower channel first)
        that :meth:`fits`; if none does, the least (:meth:`violation_if`, score) among RPC
        and the ``fallback`` best-scoring topics. One compiled pass. With ``headroom``,
        fitting and violation are judged against ``(1 - headroom)`` of every capacity, the
        reserve a plan with that headroom keeps."""
        return self.__state.least_fitting(self.__row, np.asarray(scores, np.float64),
                                          int(fallback), float(headroom))

    def violation_if(self, c: int) -> float:
        """The expected normalised violation (:func:`envs.dsmd.cost.violation`) with the new
        type on channel ``c``."""
        return float(self.__state.violations_if(self.__row, np.array([c], np.int64))[0])


class OnlineDecider(Protocol):
    """What the simulator needs of a decider (an online policy)."""

    name: str

    def reset(self, seed: int | None = None) -> None: ...

    def plan(self, view: OnlineView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(types, channels, expected_rates_bps)`` for the types to (re)plan."""

    def place(self, view: OnlineView, new: NewType, placement: Placement) -> int:
        """The channel of a type whose first message just arrived."""


# ---------------------------------------------------------------------- the simulator
INTERVAL_FIELDS = ("window", "cost", "redundancy_ratio", "violation", "subscribe_infos",
                   "moved_types", "new_types", "returning_types", "planned_types", "types",
                   "total_node_traffic_bps", "necessary_traffic_bps",
                   "controller_traffic_bps", "controller_sends", "max_node_ratio",
                   "controller_bw_violation", "controller_cpu_violation", "node_violation",
                   "nodes_over_capacity", "bw_violated", "cpu_violated", "node_violated",
                   "feasible", "mq_types", "topics_used", "subscriptions",
                   "delay_p50_s", "delay_p95_s", "bw_util", "cpu_util", "node_util_max")


@dataclass(frozen=True, eq=False)
class IntervalResult:
    """Every term of one scored interval (``as_dict`` is the environment's ``info``) and the
    channels in force (aligned with the rows of the interval's realised instance)."""

    values: dict[str, float]
    channel: np.ndarray

    def __getitem__(self, k: str) -> float:
        return self.values[k]

    def as_dict(self) -> dict[str, float]:
        return dict(self.values)


class PlanError(DSMDError):
    """A boundary plan or a placement that cannot be applied (the message names the type,
    the channel or the field)."""


class OpenInterval:
    """One interval of an :class:`OnlineSimulator` between its boundary and its score: the
    three phases of the module docstring, each called once in order (:meth:`begin`, then
    :meth:`place` for each batch of types whose first message arrived, then :meth:`score`).

    ``view`` is what the deciders see (:class:`OnlineView`); its channel table is this
    interval's own copy, with the plan and the placements applied as they are made, and it
    becomes the simulator's when the interval is scored. The trace may grow while the
    interval is open (a live session's: :meth:`OnlineSimulator.extend`); the interval is
    scored on the trace that holds it."""

    def __init__(self, sim: OnlineSimulator) -> None:
        self.sim, self.window = sim, sim.window
        self.channel = sim.channel.copy()
        self.view = OnlineView(sim.trace, self.window, self.channel, sim.hindsight, sim.last)
        self.types = self.channels = self.rates = np.zeros(0, np.int64)
        self.begun = False
        #: type -> channel of every type placed so far, in placement order
        self.placed: dict[int, int] = {}
        self._est: list[int] = []  # each placed type's rate estimate, in order

    # ------------------------------------------------------------------ 1. boundary
    def begin(self, types: Sequence[int] | np.ndarray, channels: Sequence[int] | np.ndarray,
              rates: Sequence[int] | np.ndarray, who: str = "plan") -> None:
        """Apply the boundary plan: ``channels[i]`` for ``types[i]``, expected at
        ``rates[i]`` bit/s (every other type keeps its channel). :class:`PlanError`, naming
        ``who`` and the problem, if the plan lists a type twice, a type not seen before the
        interval (the oracle may plan the interval's own), a channel outside 0..K or a
        negative rate; nothing is applied then."""
        if self.begun:
            raise PlanError(f"{who}: interval {self.window} is already planned")
        t, c, r = (np.asarray(a, np.int64).reshape(-1) for a in (types, channels, rates))
        if not (np.shape(types) == np.shape(channels) == np.shape(rates) and t.ndim == 1):
            raise PlanError(f"{who}: a plan needs types, channels and rates of one length")
        if np.unique(t).size != t.size:
            raise PlanError(f"{who}: a plan lists a type twice")
        tr, k = self.sim.trace, self.sim.trace.spec.num_topics
        bad = np.flatnonzero((t < 0) | (t >= tr.num_types))
        if bad.size:
            raise PlanError(f"{who}: planned type {int(t[bad[0]])} has not been seen (types "
                            f"0..{tr.num_types - 1} are known)")
        seen = tr.first_window[t] < self.window
        if self.sim.hindsight:
            seen |= tr.first_window[t] == self.window
        if not seen.all():
            raise PlanError(f"{who}: planned type {int(t[~seen][0])} before it was seen")
        bad = np.flatnonzero((c < 0) | (c > k))
        if bad.size:
            raise PlanError(f"{who}: planned type {int(t[bad[0]])} on channel "
                            f"{int(c[bad[0]])} outside 0..{k}")
        if (r < 0).any():
            raise PlanError(f"{who}: expected rates must be >= 0")
        self.types, self.channels, self.rates = t, c, r
        self.channel[t] = c
        self.begun = True

    # ------------------------------------------------------------------ 2. the interval
    def place(self, todo: Sequence[tuple[int, int]],
              decide: Callable[[NewType, Placement], int]) -> list[tuple[NewType, int]]:
        """Place types the plan does not cover, in the order of their first message:
        ``todo`` holds (type, size in bytes of that message); ``decide(new, placement)``
        gives each one's channel from what is known then (:class:`NewType`: its rate
        estimate ``8 size / T``, its previous channel if it is a returning type) and the
        expected load of the plan at its expected rates and of the types placed before it
        (:class:`Placement`). Returns what each was told and its channel."""
        if not self.begun:
            raise PlanError(f"interval {self.window} is not planned yet")
        if not todo:
            return []
        tr = self.sim.trace
        cat = tr.parsed.catalog
        size = np.array([s for _, s in todo], np.int64)
        est = np.maximum(np.rint(8.0 * size / tr.interval_s), 1).astype(np.int64)
        new = np.array([t for t, _ in todo], np.int64)
        before = np.array(list(self.placed), np.int64)
        types = np.concatenate([self.types, before, new])
        rates = np.concatenate([np.maximum(self.rates, 1), np.array(self._est, np.int64), est])
        start = np.concatenate([self.channels, np.array(list(self.placed.values()), np.int64),
                                np.full(new.size, UNASSIGNED, np.int64)])
        state = CostState(tr.instance(types, rates), start)
        k = tr.spec.num_topics
        out = []
        for j, t in enumerate(new.tolist()):
            row = self.types.size + before.size + j
            prev = int(self.channel[t]) if t < self.channel.size else UNASSIGNED
            nt = NewType(t, cat.destinations[t], int(size[j]), int(est[j]), int(cat.vpc[t]),
                         int(cat.config[t]), prev)
            c = int(decide(nt, Placement(state, row)))
            if not 0 <= c <= k:
                raise PlanError(f"placed type {t} on channel {c} outside 0..{k}")
            state.move(row, c)
            if t < self.channel.size:
                self.channel[t] = c
            self.placed[t] = c
            self._est.append(int(est[j]))
            out.append((nt, c))
        return out

    def arrivals_to_place(self) -> list[tuple[int, int]]:
        """(type, size of its first message) of every type of this interval that the plan
        does not cover, in the order of their first messages: what :meth:`place` must be
        given, read from the trace (the simulator's whole interval at once)."""
        tr = self.sim.trace
        arrived, rows = tr.arrivals(self.window)
        todo = ~np.isin(arrived, self.types)
        return list(zip(arrived[todo].tolist(), tr.sizes[rows[todo]].tolist()))

    # ------------------------------------------------------------------ 3. scoring
    def score(self) -> IntervalResult:
        """Score the interval on its realised rates (the trace must hold it now), make its
        channels the simulator's and move the simulator to the next interval. Every type
        that sent in it must have been planned or placed, in the order of its first message
        (:class:`PlanError` otherwise: the decisions do not match the trace)."""
        sim, w = self.sim, self.window
        if not self.begun:
            raise PlanError(f"interval {w} is not planned yet")
        if sim.window != w or sim.trace.num_windows <= w:
            raise PlanError(f"interval {w} cannot be scored (the simulator is at interval "
                            f"{sim.window} of {sim.trace.num_windows})")
        want = [t for t, _ in self.arrivals_to_place()]
        if want != list(self.placed):
            raise PlanError(f"interval {w}: types {want[:5]} sent without a plan, in that "
                            f"order, but {list(self.placed)[:5]} were placed")
        n = self.channel.size
        sim.channel[:n] = self.channel
        for t, c in self.placed.items():
            sim.channel[t] = c
        placed = np.array(want, np.int64)
        returning = int(np.count_nonzero(sim.trace.first_window[placed] < w))
        result = sim._score(w, self.types.size, placed.size - returning, returning)
        sim.last = result.as_dict()
        sim.window += 1
        return result


class OnlineSimulator:
    """Runs a decider over the intervals of one :class:`OnlineTrace` (module docstring)."""

    def __init__(self, trace: OnlineTrace, cost: OnlineCost | None = None,
                 hindsight: bool = False) -> None:
        self.trace = trace
        self.cost = cost or OnlineCost()
        self.hindsight = hindsight
        self.reset()

    def reset(self, start: int = 0, channel: np.ndarray | None = None) -> None:
        """Start before interval ``start`` with channel table ``channel`` (default: none
        assigned; the first interval then pays no switching terms)."""
        if not 0 <= start <= self.trace.num_windows:
            raise DSMDError(f"start {start} out of range 0..{self.trace.num_windows}")
        if start > 0 and channel is None:
            raise DSMDError(f"a run that starts at interval {start} needs the channel table of "
                            "the types seen before it (channel=...)")
        m = self.trace.num_types
        self.window = int(start)
        self.channel = (np.full(m, UNASSIGNED, np.int64) if channel is None
                        else np.asarray(channel, np.int64).copy())
        self.last_used = self.channel.copy()
        self._subs: np.ndarray | None = None
        self._fresh = channel is None
        self.last: dict[str, float] | None = None  # the last interval's terms

    def extend(self, trace: OnlineTrace) -> None:
        """Go on over ``trace``: the current trace grown by later messages (a live session's
        trace, re-built as its intervals close: the same catalogue and intervals, more of
        them). The state is kept; the types first seen since have no channel yet."""
        old = self.trace
        m = old.num_types
        if (trace.num_types < m or trace.num_windows < old.num_windows
                or trace.parsed.catalog.keys[:m] != old.parsed.catalog.keys[:m]):
            raise DSMDError(f"trace {trace.name!r} does not extend {old.name!r} (its types and "
                            "intervals must start with the current ones)")
        pad = np.full(trace.num_types - m, UNASSIGNED, np.int64)
        self.channel = np.concatenate([self.channel, pad])
        self.last_used = np.concatenate([self.last_used, pad])
        self.trace = trace

    @property
    def done(self) -> bool:
        return self.window >= self.trace.num_windows

    def clone(self) -> OnlineSimulator:
        """An independent copy of the run so far (the trace is shared): to try a decision
        and keep or drop its outcome (:func:`agents.online_eval.knob_oracle`)."""
        c = copy.copy(self)
        c.channel, c.last_used = self.channel.copy(), self.last_used.copy()
        c._subs = None if self._subs is None else self._subs.copy()
        c.last = None if self.last is None else dict(self.last)
        return c

    def view(self) -> OnlineView:
        return OnlineView(self.trace, self.window, self.channel, self.hindsight, self.last)

    def open(self) -> OpenInterval:
        """The next interval, at its boundary (:class:`OpenInterval`); the trace need not
        hold it yet (a live session's grows when it closes), only when it is scored."""
        return OpenInterval(self)

    def step(self, decider: OnlineDecider) -> IntervalResult:
        """Plan at the boundary, place new types during the interval, score it: the three
        phases of :class:`OpenInterval`, in a row."""
        if self.done:
            raise DSMDError("the trace is over; reset() the simulator")
        iv = self.open()
        iv.begin(*decider.plan(iv.view), who=decider.name)
        view = iv.view
        try:
            iv.place(iv.arrivals_to_place(), lambda new, at: decider.place(view, new, at))
        except PlanError as e:
            raise PlanError(f"{decider.name}: {e}") from None
        return iv.score()

    def _score(self, w: int, planned: int, placed: int, returning: int) -> IntervalResult:
        tr, cfg = self.trace, self.cost
        inst = tr.realised(w)
        ids = inst.catalog_index
        assert ids is not None  # filled in DSMDInstance.__post_init__
        chan = self.channel[ids]
        if (chan < 0).any():  # pragma: no cover - every realised type is planned or placed
            raise DSMDError(f"interval {w}: type {int(ids[chan < 0][0])} has no channel")
        if inst.num_types == 0:  # nothing sent: nothing decided, nothing paid, state kept
            vals: dict[str, float] = dict.fromkeys(INTERVAL_FIELDS, 0)
            vals.update(window=w, cost=0.0, redundancy_ratio=1.0, feasible=1,
                        planned_types=planned, subscriptions=0 if self._subs is None
                        else int(self._subs.sum()))
            return IntervalResult(vals, chan)
        state = CostState(inst, chan)
        met = state.metrics()
        subs = tr.held_subscriptions(self.channel)
        prev = self.last_used[ids]
        if self._fresh and self._subs is None:
            infos = made = moved = 0
            share = 0.0
        else:
            old = self._subs if self._subs is not None else np.zeros_like(subs)
            infos = int(np.count_nonzero(subs != old))
            made = int(np.count_nonzero(subs & ~old))
            moving = (prev >= 0) & (prev != chan)
            moved = int(np.count_nonzero(moving))
            # the controller holds the messages of the types a switch moves (or places on a
            # topic) until its subscribing SubscribeInfos are acknowledged, and no others
            share = delivery_share(inst, moving | ((prev < 0) & (chan > 0)))
        self._subs = subs
        self.last_used[ids] = chan
        v = state.violation()
        ratio = met.redundancy_ratio
        delay = cfg.delay.quantiles(DelayLoad.from_state(state).with_switches(
            made, moved, held_share=share))
        cost = (ratio + cfg.w_delay * delay["delay_p95_s"] + cfg.w_violation * v
                + cfg.w_subscribe * infos + cfg.w_move * moved)
        vals = {"window": w, "cost": cost, "redundancy_ratio": ratio, "violation": v,
                "subscribe_infos": infos, "moved_types": moved, "new_types": placed,
                "returning_types": returning,
                "planned_types": planned, "types": inst.num_types,
                "total_node_traffic_bps": met.total_node_traffic_bps,
                "necessary_traffic_bps": met.necessary_traffic_bps,
                "controller_traffic_bps": met.controller_traffic_bps,
                "controller_sends": met.controller_sends,
                "max_node_ratio": float(state.node_ratio().max()),
                "controller_bw_violation": met.controller_bw_violation,
                "controller_cpu_violation": met.controller_cpu_violation,
                "node_violation": met.node_violation,
                "nodes_over_capacity": met.nodes_over_capacity,
                "bw_violated": int(met.controller_bw_violation > 0),
                "cpu_violated": int(met.controller_cpu_violation > 0),
                "node_violated": int(met.node_violation > 0),
                "feasible": int(met.feasible), "mq_types": met.mq_types,
                "topics_used": met.topics_used, "subscriptions": int(subs.sum()), **delay}
        return IntervalResult(vals, chan)

    def run(self, decider: OnlineDecider, windows: int | None = None) -> list[IntervalResult]:
        """Run ``decider`` from the current interval to the end (or ``windows`` intervals)."""
        decider.reset()
        out: list[IntervalResult] = []
        end = self.trace.num_windows if windows is None else min(
            self.trace.num_windows, self.window + int(windows))
        while self.window < end:
            out.append(self.step(decider))
        return out


def run_online(trace: OnlineTrace, decider: OnlineDecider, cost: OnlineCost | None = None,
               hindsight: bool = False, windows: int | None = None) -> list[dict[str, float]]:
    """Every interval of ``trace`` under ``decider``: a list of per-interval terms."""
    sim = OnlineSimulator(trace, cost, hindsight)
    return [r.as_dict() for r in sim.run(decider, windows)]
