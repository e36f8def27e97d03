"""An online controller session: the online policy served interval by interval from the
session's own history (SMART Section V-D, online execution; the simulator is
:mod:`envs.dsmd.online`).

One implementation, used by the policy server for each online session and by the online
adapter for its local copy (``cached`` mode, and ``remote`` mode's fallback), so that the
same messages give the same plans, placements and interval costs as
``OnlineSimulator(trace, cost).run(decider)`` over the trace those messages make:

* the history is a :class:`serving.online_trace.LiveTrace` (Algorithm 1 over the messages
  so far), whose closed intervals form an :class:`envs.dsmd.online.OnlineTrace`; an
  :class:`envs.dsmd.online.OnlineSimulator` over it holds the channel table and the last
  interval's realised terms, and grows with it (``OnlineSimulator.extend``);
* each interval is one :class:`envs.dsmd.online.OpenInterval` of that simulator, the same
  three phases ``OnlineSimulator.step`` runs in a row, here run as the requests arrive:
  at the boundary of interval ``w`` (:meth:`OnlineSession.begin`) the decider (for a
  served policy: :class:`envs.dsmd.online_control.KnobPolicy` over the bundle's actor,
  whose observation is the environment's ``KnobMap.observe``) plans from the interval's
  view and ``OpenInterval.begin`` checks and applies the plan; during the interval
  (:meth:`OnlineSession.submit`) ``OpenInterval.place`` places every type the plan does
  not cover on its first message (the decider is told its destinations, the size of that
  message, the rate estimate ``8 size / T`` and its current channel, and sees the expected
  load of the plan and the types placed before it); at the end
  (:meth:`OnlineSession.close`) the simulator's trace grows by the closed interval and
  ``OpenInterval.score`` scores it, which also checks that the placements match the
  trace's arrivals. Scoring and the state carried to the next interval are the
  simulator's, never a copy of it.

Decisions taken elsewhere (the server's, recorded by a remote adapter; a history restored
on a new server session) enter the same way: ``begin(given=...)`` and
``submit(..., given=...)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from envs.dsmd.instance import UNASSIGNED
from envs.dsmd.message import Message
from envs.dsmd.online import (
    NewType,
    OnlineCost,
    OnlineDecider,
    OnlineSimulator,
    OpenInterval,
    Placement,
    PlanError,
)
from envs.dsmd.online_control import KnobMap, KnobPolicy
from envs.dsmd.parser import BatchKey, destination_key
from envs.dsmd.scenarios import ScenarioSpec
from envs.dsmd.topology import Topology

from .online_trace import LiveTrace, MessageRejected, StateConflict

__all__ = [
    "Closed",
    "MessageRejected",
    "OnlineSession",
    "Placed",
    "Plan",
    "StateConflict",
    "Submitted",
    "fallback_decider",
    "signature_scenario",
]

#: who decided a plan or a placement: the session's decider (labelled "policy" or
#: "fallback" by :meth:`OnlineSession.set_decider`) or a decision made elsewhere ("given")
DecisionSource = Literal["policy", "fallback", "given"]

#: the knobs of the fallback decider: the knob executor with no headroom, re-planning
#: every type on the last estimate (the online greedy)
FALLBACK_KNOBS = {"headroom": 0.0, "horizon": float("inf"), "alpha": 1.0}


def fallback_decider(cost: OnlineCost | None = None, knob_map: KnobMap | None = None
                     ) -> OnlineDecider:
    """The decider used where no online policy is available (the adapter's fallback): the
    knob executor with :data:`FALLBACK_KNOBS`."""
    d: OnlineDecider = (knob_map or KnobMap()).decider(dict(FALLBACK_KNOBS),
                                                       cost or OnlineCost())
    d.name = "fallback"
    return d


def signature_scenario(num_nodes: int, node_capacity_bps: int, num_topics: int,
                       controller_bw_bps: int, controller_cpu: int, interval_s: float,
                       name: str = "online-session") -> ScenarioSpec:
    """A :class:`ScenarioSpec` from what a controller knows of itself (its nodes, K, C_b,
    C_p and T), for a session that has no dataset scenario; the trace generator's fields,
    which no decision reads, keep their defaults."""
    return ScenarioSpec(name=name, num_nodes=int(num_nodes), num_vms=int(num_nodes),
                        num_vpcs=1, num_topics=int(num_topics),
                        node_bandwidth_bps=int(node_capacity_bps),
                        controller_bw_bps=int(controller_bw_bps),
                        controller_cpu=int(controller_cpu), interval_s=float(interval_s))


@dataclass(frozen=True, eq=False)
class Plan:
    """The boundary plan of one interval: ``channels[i]`` for ``types[i]``, planned at the
    expected rate ``rates[i]``; every other known type keeps its channel."""

    window: int
    types: np.ndarray
    channels: np.ndarray
    rates: np.ndarray
    source: DecisionSource  # "policy", "fallback" or "given" (decided elsewhere)
    knobs: dict[str, float] | None = None
    observation: np.ndarray | None = None

    def assignment(self) -> dict[int, int]:
        return dict(zip(self.types.tolist(), self.channels.tolist()))


@dataclass(frozen=True)
class Placed:
    """A type placed on its first message of the interval (``previous_channel`` -1: a new
    type; otherwise a returning one)."""

    type_id: int
    channel: int
    message_id: int
    previous_channel: int
    rate_bps: int
    source: DecisionSource


@dataclass(frozen=True, eq=False)
class Submitted:
    """What a batch of messages got: each message's type and channel, and the placements
    it caused."""

    types: np.ndarray
    channels: np.ndarray
    placed: list[Placed]


@dataclass(frozen=True, eq=False)
class Closed:
    """A scored interval: the simulator's terms (``INTERVAL_FIELDS``) and the channel of
    every type that sent in it."""

    window: int
    terms: dict[str, float]
    types: np.ndarray
    channels: np.ndarray

    def assignment(self) -> dict[int, int]:
        return dict(zip(self.types.tolist(), self.channels.tolist()))


@dataclass
class _Interval:
    """The open interval: the simulator's :class:`OpenInterval` and what the session adds to
    it (the plan as served, who decides the placements, the types that sent so far)."""

    plan: Plan
    iv: OpenInterval
    decider: OnlineDecider | None
    seen: set[int] = field(default_factory=set)  # types with a message in the interval


class OnlineSession:
    """A live online session (module docstring). ``decider``: the one that plans (and, in
    its interval, places) when no decision is given; ``source`` labels its decisions."""

    def __init__(self, spec: ScenarioSpec, topology: Topology, *,
                 decider: OnlineDecider | None = None, cost: OnlineCost | None = None,
                 batch_key: BatchKey = "hosts", start_ns: int | None = None,
                 name: str = "live", source: DecisionSource = "policy") -> None:
        self.spec, self.topology = spec, topology
        self.live = LiveTrace(spec, topology, batch_key, start_ns, name)
        self.cost = cost or OnlineCost()
        self.sim = OnlineSimulator(self.live.trace(), self.cost)
        self.decider, self.source = decider, source
        if decider is not None:
            decider.reset()
        self._open: _Interval | None = None

    # ------------------------------------------------------------------ state
    @property
    def window(self) -> int:
        """The open interval (or the next one to open)."""
        return self.sim.window

    @property
    def planned(self) -> bool:
        return self._open is not None

    @property
    def plan(self) -> Plan | None:
        return None if self._open is None else self._open.plan

    @property
    def last(self) -> dict[str, float] | None:
        """The realised terms of the last closed interval."""
        return self.sim.last

    def set_decider(self, decider: OnlineDecider | None,
                    source: DecisionSource = "policy") -> None:
        """Decide with ``decider`` from the next boundary on (a policy swap)."""
        if decider is not None:
            decider.reset()
        self.decider, self.source = decider, source

    def check_window(self, window: int) -> None:
        if window != self.window:
            state = "open" if self.planned else "next"
            raise StateConflict(f"interval {window} is out of order: interval {self.window} is "
                                f"the {state} one")

    def channel_of(self, type_id: int) -> int:
        """The channel type ``type_id`` is on now (-1: none yet)."""
        t = int(type_id)
        op = self._open
        if op is not None and t in op.iv.placed:
            return op.iv.placed[t]
        ch = op.iv.channel if op is not None else self.sim.channel
        return int(ch[t]) if 0 <= t < ch.size else UNASSIGNED

    # ------------------------------------------------------------------ boundary
    def begin(self, given: tuple[Sequence[int], Sequence[int], Sequence[int]] | None = None
              ) -> Plan:
        """Plan the open interval: the decider's plan from the view at the boundary, or the
        ``given`` one (types, channels, expected rates) decided elsewhere."""
        if self._open is not None:
            raise StateConflict(f"interval {self.window} is already planned")
        w = self.window
        iv = self.sim.open()  # the interval's view: the plan and placements go there
        view = iv.view
        knobs = obs = None
        source: DecisionSource
        if given is not None:
            types, chans, rates = (np.asarray(a, np.int64) for a in given)
            source, decider = "given", None
        else:
            decider = self.decider
            if decider is None:
                raise StateConflict("no online policy is loaded: nothing can plan interval "
                                    f"{w}")
            types, chans, rates = (np.asarray(a, np.int64) for a in decider.plan(view))
            source = self.source
            if isinstance(decider, KnobPolicy):
                knobs = dict(decider.knobs_used[-1])
                obs = decider.map.observe(view)
        try:  # the simulator's checks, before the plan is served
            iv.begin(types, chans, rates, who=source)
        except PlanError as e:  # a given plan is the caller's error, a decider's a conflict
            raise (MessageRejected if source == "given" else StateConflict)(str(e)) from None
        plan = Plan(w, iv.types, iv.channels, iv.rates, source, knobs, obs)
        self._open = _Interval(plan, iv, decider)
        return plan

    # ------------------------------------------------------------------ the interval
    def submit(self, messages: Sequence[Message], given: Mapping[int, int] | None = None,
               decider: OnlineDecider | None = None) -> Submitted:
        """Messages of the open interval, in time order (the interval is planned first if it
        was not, as at its boundary): each type the plan does not cover
        is placed on its first message (by ``given[type]`` if there, else by ``decider``,
        whose placements say ``"fallback"``, else by the decider that planned the interval).
        All or nothing: a refused batch changes nothing."""
        self.live.check(messages)
        if self._open is None:  # the boundary has passed: its plan is due
            self.begin()
        iv = self._open
        assert iv is not None
        given = {int(t): int(c) for t, c in (given or {}).items()}
        k = self.spec.num_topics
        for t, c in given.items():
            if not 0 <= c <= k:
                raise MessageRejected(f"type {t}: channel {c} outside 0..{k}")
        label: DecisionSource
        who, label = (decider, "fallback") if decider is not None else (iv.decider,
                                                                         iv.plan.source)
        types, todo = self._todo(iv, messages)
        for t, _ in todo:
            if t not in given and who is None:
                raise MessageRejected(f"type {t} needs a placement (the plan does not cover "
                                      "it) and none was given")
        extra = sorted(set(given) - {t for t, _ in todo})
        if extra:
            raise MessageRejected(f"a placement was given for type {extra[0]}, which this "
                                  "batch does not place (it is planned, already placed, or "
                                  "sends no message here)")
        got = self.live.add(messages)
        if not np.array_equal(got, types):  # pragma: no cover - _peek_types is the lookup
            raise AssertionError("type lookup changed between check and add")
        placed = self._place(iv, todo, messages, given, who, label)
        iv.seen.update(types.tolist())
        chans = np.array([self.channel_of(t) for t in types.tolist()], np.int64)
        return Submitted(types, chans, placed)

    def to_place(self, messages: Sequence[Message]) -> list[int]:
        """The types :meth:`submit` would place for this batch, in order (none if the
        interval is not planned yet: see :attr:`planned`); changes nothing."""
        return [] if self._open is None else [t for t, _ in self._todo(self._open, messages)[1]]

    def _todo(self, iv: _Interval, messages: Sequence[Message]
              ) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """Each message's type, and (type, index of its first message) of every type the
        batch places: not planned and not seen before in the interval."""
        types = self._peek_types(messages)
        planned = set(iv.plan.types.tolist())
        todo: list[tuple[int, int]] = []
        seen = set(iv.seen)
        for i, t in enumerate(types.tolist()):
            if t not in seen:
                seen.add(t)
                if t not in planned:
                    todo.append((t, i))
        return types, todo

    def _peek_types(self, messages: Sequence[Message]) -> np.ndarray:
        """The type id each message will get, without adding types to the catalogue."""
        cat = self.live.catalog
        out = np.empty(len(messages), np.int64)
        fresh: dict[int, int] = {}
        by_vpc, by_cfg = cat.batch_key != "hosts", cat.batch_key == "hosts+vpc+config"
        for i, m in enumerate(messages):
            key = destination_key(np.asarray(m.hosts, np.uint32),
                                  int(m.vpc_id) if by_vpc else None,
                                  m.config_code if by_cfg else None)
            t = cat.index_of_key(key)
            if t is None:
                t = fresh.setdefault(key, len(cat) + len(fresh))
            out[i] = t
        return out

    def _place(self, op: _Interval, todo: list[tuple[int, int]], messages: Sequence[Message],
               given: dict[int, int], who: OnlineDecider | None,
               label: DecisionSource) -> list[Placed]:
        """``OpenInterval.place`` for this batch's types (each at the size of its first
        message here), by ``given`` where it has the type, else by ``who``."""
        view = op.iv.view
        sources: list[DecisionSource] = []

        def decide(new: NewType, at: Placement) -> int:
            if new.type_id in given:
                sources.append("given")
                return given[new.type_id]
            assert who is not None  # checked by submit before any change
            sources.append(label)
            return int(who.place(view, new, at))

        try:
            done = op.iv.place([(t, int(messages[i].size_bytes)) for t, i in todo], decide)
        except PlanError as e:
            raise StateConflict(f"{getattr(who, 'name', 'decider')}: {e}") from None
        return [Placed(nt.type_id, c, int(messages[i].message_id), nt.previous_channel,
                       nt.rate_bps, src)
                for (nt, c), (_, i), src in zip(done, todo, sources)]

    # ------------------------------------------------------------------ scoring
    def close(self) -> Closed:
        """Close and score the open interval (planning it first if it was not: a boundary
        always plans, even before an interval with no message)."""
        if self._open is None:
            self.begin()
        op = self._open
        assert op is not None
        self.sim.extend(self.live.close())
        res = op.iv.score()  # also checks the placements against the trace's arrivals
        self._open = None
        inst = self.sim.trace.realised(op.plan.window)
        assert inst.catalog_index is not None  # filled in DSMDInstance.__post_init__
        terms = {k: (int(v) if isinstance(v, (int, np.integer)) else float(v))
                 for k, v in res.as_dict().items()}
        return Closed(op.plan.window, terms, inst.catalog_index.copy(),
                      np.asarray(res.channel, np.int64).copy())
