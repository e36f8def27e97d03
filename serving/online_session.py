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
* at the boundary of interval ``w`` (:meth:`OnlineSession.begin`) the decider (for a served
  policy: :class:`envs.dsmd.online_control.KnobPolicy` over the bundle's actor, whose
  observation is the environment's ``KnobMap.observe``) plans from the simulator's view,
  as ``OnlineSimulator.step`` asks it;
* during the interval (:meth:`OnlineSession.submit`) every type the plan does not cover is
  placed on its first message, with what ``OnlineSimulator._place`` gives the decider: the
  view, the type (:class:`~envs.dsmd.online.NewType`: its destinations, the size of that
  message, the rate estimate ``8 size / T``, its current channel) and the expected load of
  the plan and the types placed before it (:class:`~envs.dsmd.online.Placement`);
* at the end (:meth:`OnlineSession.close`) the interval is scored by the simulator itself:
  ``OnlineSimulator.step`` over the grown trace, with a decider that replays the plan and
  the placements made live and checks that the simulator asks for exactly those (the same
  types, in the same order, with the same facts), so scoring and the state carried to the
  next interval are the simulator's, never a copy of it.

Decisions taken elsewhere (the server's, recorded by a remote adapter; a history restored
on a new server session) enter the same way: ``begin(given=...)`` and
``submit(..., given=...)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from envs.dsmd.cost import CostState
from envs.dsmd.instance import UNASSIGNED
from envs.dsmd.message import Message
from envs.dsmd.online import (
    NewType,
    OnlineCost,
    OnlineDecider,
    OnlineSimulator,
    OnlineView,
    Placement,
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
    """The open interval's decisions so far."""

    plan: Plan
    view: OnlineView
    channel: np.ndarray  # the view's channel table (plan and placements applied)
    decider: OnlineDecider | None
    placed: dict[int, int] = field(default_factory=dict)  # type -> channel, in order
    facts: list[NewType] = field(default_factory=list)  # what each placement was told
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
        iv = self._open
        if iv is not None and t in iv.placed:
            return iv.placed[t]
        ch = iv.channel if iv is not None else self.sim.channel
        return int(ch[t]) if 0 <= t < ch.size else UNASSIGNED

    # ------------------------------------------------------------------ boundary
    def begin(self, given: tuple[Sequence[int], Sequence[int], Sequence[int]] | None = None
              ) -> Plan:
        """Plan the open interval: the decider's plan from the view at the boundary, or the
        ``given`` one (types, channels, expected rates) decided elsewhere."""
        if self._open is not None:
            raise StateConflict(f"interval {self.window} is already planned")
        sim, w = self.sim, self.window
        channel = sim.channel.copy()  # the view's table: the plan and placements go here
        view = OnlineView(sim.trace, w, channel, sim.hindsight, sim.last)
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
        self._check_plan(types, chans, rates, source)
        channel[types] = chans
        plan = Plan(w, types, chans, rates, source, knobs, obs)
        self._open = _Interval(plan, view, channel, decider)
        return plan

    def _check_plan(self, types: np.ndarray, chans: np.ndarray, rates: np.ndarray,
                    source: str) -> None:
        """The checks ``OnlineSimulator.step`` makes of a plan, made before it is served."""
        err = StateConflict if source != "given" else MessageRejected
        if not types.shape == chans.shape == rates.shape or types.ndim != 1:
            raise err("a plan needs types, channels and rates of one length")
        if np.unique(types).size != types.size:
            raise err("a plan lists a type twice")
        tr, k = self.sim.trace, self.spec.num_topics
        bad = np.flatnonzero((types < 0) | (types >= tr.num_types))
        if bad.size:
            raise err(f"planned type {int(types[bad[0]])} has not been seen (types 0.."
                      f"{tr.num_types - 1} are known)")
        bad = np.flatnonzero((chans < 0) | (chans > k))
        if bad.size:
            raise err(f"planned type {int(types[bad[0]])} on channel {int(chans[bad[0]])} "
                      f"outside 0..{k}")
        if (rates < 0).any():
            raise err("expected rates must be >= 0")

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

    def _place(self, iv: _Interval, todo: list[tuple[int, int]], messages: Sequence[Message],
               given: dict[int, int], who: OnlineDecider | None,
               label: DecisionSource) -> list[Placed]:
        """``OnlineSimulator._place`` for this batch's types: the expected load is the plan
        at its expected rates plus the types placed before (this interval), each new one
        at ``8 size / T`` of its first message; the types still to come are not in it (the
        simulator's are there unassigned, which no :class:`Placement` query reads)."""
        if not todo:
            return []
        tr, cat = self.sim.trace, self.live.catalog
        plan = iv.plan
        before = list(iv.placed.items())
        size = np.array([messages[i].size_bytes for _, i in todo], np.int64)
        est = np.maximum(np.rint(8.0 * size / tr.interval_s), 1).astype(np.int64)
        old_est = np.array([f.rate_bps for f in iv.facts], np.int64)
        types = np.concatenate([plan.types, np.array([t for t, _ in before], np.int64),
                                np.array([t for t, _ in todo], np.int64)])
        rates = np.concatenate([np.maximum(plan.rates, 1), old_est, est])
        start = np.concatenate([plan.channels, np.array([c for _, c in before], np.int64),
                                np.full(len(todo), UNASSIGNED, np.int64)])
        state = CostState(tr.instance(types, rates), start)
        k = self.spec.num_topics
        out = []
        src: DecisionSource
        for j, (t, i) in enumerate(todo):
            row = plan.types.size + len(before) + j
            prev = int(iv.channel[t]) if t < iv.channel.size else UNASSIGNED
            nt = NewType(t, cat.destinations[t], int(size[j]), int(est[j]), int(cat.vpc[t]),
                         int(cat.config[t]), prev)
            if t in given:
                c, src = given[t], "given"
            else:
                assert who is not None  # checked by submit before any change
                c, src = int(who.place(iv.view, nt, Placement(state, row))), label
                if not 0 <= c <= k:
                    raise StateConflict(f"{getattr(who, 'name', 'decider')}: placed type {t} "
                                        f"on channel {c} outside 0..{k}")
            state.move(row, c)
            if t < iv.channel.size:
                iv.channel[t] = c
            iv.placed[t] = c
            iv.facts.append(nt)
            out.append(Placed(t, c, int(messages[i].message_id), prev, int(est[j]), src))
        return out

    # ------------------------------------------------------------------ scoring
    def close(self) -> Closed:
        """Close and score the open interval (planning it first if it was not: a boundary
        always plans, even before an interval with no message)."""
        if self._open is None:
            self.begin()
        iv = self._open
        assert iv is not None
        self.sim.extend(self.live.close())
        replay = _Replay(iv)
        res = self.sim.step(replay)
        replay.finish()
        self._open = None
        inst = self.sim.trace.realised(iv.plan.window)
        assert inst.catalog_index is not None  # filled in DSMDInstance.__post_init__
        terms = {k: (int(v) if isinstance(v, (int, np.integer)) else float(v))
                 for k, v in res.as_dict().items()}
        return Closed(iv.plan.window, terms, inst.catalog_index.copy(),
                      np.asarray(res.channel, np.int64).copy())


class _Replay:
    """The decider ``OnlineSimulator.step`` scores an interval with: it returns the plan
    and the placements made live, and checks it is asked for exactly those."""

    name = "live-session"

    def __init__(self, iv: _Interval) -> None:
        self.iv, self.i = iv, 0

    def reset(self, seed: int | None = None) -> None:
        pass

    def plan(self, view: OnlineView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        p = self.iv.plan
        return p.types, p.channels, p.rates

    def place(self, view: OnlineView, new: NewType, placement: Placement) -> int:
        facts, placed = self.iv.facts, self.iv.placed
        if self.i >= len(facts):
            raise AssertionError(f"the simulator places type {new.type_id}, which the session "
                                 "never placed")
        f = facts[self.i]
        self.i += 1
        same = (f.type_id == new.type_id and f.size_bytes == new.size_bytes
                and f.rate_bps == new.rate_bps and f.vpc == new.vpc and f.config == new.config
                and f.previous_channel == new.previous_channel
                and np.array_equal(f.destinations, new.destinations))
        if not same:
            raise AssertionError(f"the simulator places {new} where the session placed {f}")
        return placed[f.type_id]

    def finish(self) -> None:
        if self.i != len(self.iv.facts):
            raise AssertionError("the session placed types the simulator does not place")

