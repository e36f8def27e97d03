"""How a live controller chooses channels at each interval: every policy the simulator
evaluates, decided from the controller adapter's parser (its type catalogue and the rates it
estimated for the interval that just closed, Algorithm 1).

* ``learned`` -- the learned policy through the controller adapter (remote or cached mode,
  :mod:`serving.client.static`): :class:`AdapterPolicy`.
* ``rpc``, ``vita``, ``idcs``, ``alcor``, ``greedy`` -- the static baselines of Section VII-B
  (and Alcor AUTO, and greedy with local search, the strongest simulator baseline), built by
  the simulator's own registry (:func:`agents.registry.make_policy_for`) and applied to each
  interval's instance: :class:`BaselinePolicy`.
* ``online_greedy``, ``forecast_greedy``, ``forecast_drop`` -- the online deciders of the
  online evaluation
  (Section V-D, online execution; :class:`agents.online.OnlineGreedy`, the families the
  online yardstick tunes, :mod:`agents.online_eval`), and ``online_learned``, an online
  policy bundle (:mod:`serving.bundles.online`): :class:`OnlinePolicy`, which drives the
  decider through the simulator's own live engine (:class:`serving.online_session.
  OnlineSession`: the :class:`~envs.dsmd.online.OnlineView` at each boundary, a placement for
  each type on its first message of an interval), so the live channels are exactly the
  ones the online simulator gives the decider on the same messages.

The hindsight deciders of the online evaluation (``oracle``, ``knob_oracle``) see the coming
interval's realised rates, which no live controller has: they are not here.

**The control plane's calls.** :meth:`ChannelPolicy.channels` at every interval boundary
(the channels of the types active in the interval that closed), and, for a message whose
type has no channel yet, :meth:`ChannelPolicy.first_channel`. A policy with a ``route``
method (:class:`OnlinePolicy`) is also told every message, right after the adapter counted
it, primed ones included, and may answer the channel its type takes now: an online decider
places every type its boundary plan left out on the type's first message of the interval
(new and returning types alike), from the load expected at that moment.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from agents.greedy import GreedyLocalSearch
from agents.policy import Policy
from agents.registry import POLICIES as STATIC_FACTORIES
from agents.registry import make_policy_for
from envs.dsmd.instance import DSMDInstance
from envs.dsmd.message import Message
from envs.dsmd.online import OnlineCost
from envs.dsmd.parser import IntervalEstimate
from envs.dsmd.problems import ProblemSet
from envs.dsmd.scenarios import ScenarioSpec

if TYPE_CHECKING:
    from serving.client.static import ControllerAdapter
    from serving.online_session import OnlineSession

__all__ = [
    "ONLINE_DEFAULTS",
    "POLICIES",
    "STATIC",
    "AdapterPolicy",
    "BaselinePolicy",
    "ChannelPolicy",
    "OnlinePolicy",
    "make_policy",
]

#: the static baselines, by their names in :data:`agents.registry.POLICIES` (the exact MILP
#: is a bound, not a controller's policy)
STATIC = ("rpc", "vita", "idcs", "alcor", "greedy")
#: the online deciders (:data:`agents.online_eval.DeciderSpec` kind, default parameters):
#: ``online_greedy`` re-plans every type on the last estimate (at the tuned horizon);
#: ``forecast_greedy`` is the online yardstick's EWMA family at its configured setting
#: (``configs/env/online.yaml``); ``forecast_drop`` is the learned send forecaster's planner
#: at the setting ``experiment=online_study`` tunes (it needs ``params['send_forecaster']``,
#: the forecaster's ``.npz``); ``params`` override (e.g. the knobs tuned on validation)
ONLINE_DEFAULTS: dict[str, tuple[str, dict[str, Any]]] = {
    "online_greedy": ("online_greedy", {"horizon": 1.0}),
    "forecast_greedy": ("online_greedy", {"forecast": "ewma", "alpha": 0.5, "headroom": 0.2,
                                          "horizon": 1.0}),
    "forecast_drop": ("online_greedy", {"forecast": "last", "headroom": 0.8, "horizon": 1.0,
                                        "drop": 0.5, "reserve_placements": True}),
    "online_learned": ("learned", {}),
}
POLICIES = (*STATIC, *ONLINE_DEFAULTS, "learned")
#: the static baselines that need the scenario (its ``extra`` thresholds, the topology)
_NEED_PROBLEMS = ("alcor",)


class ChannelPolicy(Protocol):
    name: str

    def channels(self, adapter: ControllerAdapter, est: IntervalEstimate) -> dict[int, int]:
        """type id -> channel for the types active in ``est``."""
        ...

    def first_channel(self, adapter: ControllerAdapter, type_id: int) -> int:
        """The channel of a type seen for the first time in the running interval (before
        any rate of it is known)."""
        ...


class AdapterPolicy:
    """The learned policy: ``adapter.decide(replan=True)`` on the interval's rates (remote:
    the policy server; cached: ONNX Runtime in the controller). New types go by RPC until
    their first rate is known."""

    name = "learned"
    relabel_topics = True  # it re-plans from scratch: see delivery.control_plane

    def __init__(self) -> None:
        self.sources: dict[str, int] = {}  # decisions by source (policy / fallback)

    def channels(self, adapter: ControllerAdapter, est: IntervalEstimate) -> dict[int, int]:
        ds = adapter.decide(None, replan=True)
        for d in ds:
            self.sources[d.source] = self.sources.get(d.source, 0) + 1
        return {d.type_id: d.channel for d in ds}

    def first_channel(self, adapter: ControllerAdapter, type_id: int) -> int:
        return 0


class BaselinePolicy:
    """A simulator baseline applied to the interval's instance (the instance
    :meth:`envs.dsmd.problems.ProblemSet.instance` builds from the same counters)."""

    def __init__(self, policy: Policy, name: str) -> None:
        self.policy, self.name = policy, name

    def _instance(self, adapter: ControllerAdapter, types: np.ndarray,
                  rates: np.ndarray) -> DSMDInstance:
        spec = adapter.local.spec
        return DSMDInstance.from_catalog(adapter.parser.catalog, types, rates, spec.num_topics,
                                         spec.controller_bw_bps, spec.controller_cpu,
                                         interval_s=spec.interval_s)

    def channels(self, adapter: ControllerAdapter, est: IntervalEstimate) -> dict[int, int]:
        spec = adapter.local.spec
        inst = DSMDInstance.from_estimate(adapter.parser.catalog, est, spec.num_topics,
                                          spec.controller_bw_bps, spec.controller_cpu)
        ch = np.asarray(self.policy.assign(inst), dtype=np.int64)
        assert inst.catalog_index is not None  # filled in DSMDInstance.__post_init__
        return dict(zip(inst.catalog_index.tolist(), ch.tolist()))

    def first_channel(self, adapter: ControllerAdapter, type_id: int) -> int:
        """What the policy does with a lone new type: its rule on a one-type instance
        (RPC-only: RPC; VITA: the VPC's topic; IDCS: the VPC's topic if multicast; Alcor:
        its VPC rule), except greedy, which has no rate to plan with: RPC."""
        if isinstance(self.policy, GreedyLocalSearch):
            return 0
        inst = self._instance(adapter, np.array([type_id], np.int64), np.ones(1, np.int64))
        return int(self.policy.assign(inst)[0])


class OnlinePolicy:
    """An online decider (:mod:`agents.online`, or an online policy bundle's) driving a live
    control plane through the simulator's live engine, :class:`serving.online_session.
    OnlineSession` (Section V-D, online execution).

    The session is fed every message the control plane counts (:meth:`route`), in order,
    and each interval is closed with the control plane's (:meth:`channels`): the decider
    plans at the boundary from the session's :class:`~envs.dsmd.online.OnlineView` (the past
    intervals' rate estimates and the current channel of every type) and places every type
    the plan leaves out on its first message of the interval, as
    :class:`~envs.dsmd.online.OnlineSimulator` has it do over the same messages. The
    session's messages carry the open interval's start as their timestamp and ids of its
    own (the control plane's intervals are closed by the control plane, and a primed
    interval repeats its messages); its type ids are mapped to the adapter's (the adapter
    may know the scenario's whole catalogue in advance). ``terms`` holds the simulator's
    terms of every closed interval (cost, SubscribeInfos, moved types, violations).

    The decider renames topics itself (against the session's channel table, which is the
    controller's), so the control plane's relabelling is off for it."""

    relabel_topics = False

    def __init__(self, name: str, kind: str, params: Mapping[str, Any] | None = None,
                 cost: OnlineCost | None = None, spec: ScenarioSpec | None = None) -> None:
        from agents.online_eval import DeciderSpec

        self.name = name
        self.decider_spec = DeciderSpec.make(name, kind, **dict(params or {}))
        self.cost = cost or OnlineCost()
        self.spec = spec
        self.session: OnlineSession | None = None
        self.terms: list[dict[str, float]] = []
        self._ids = itertools.count(1)
        self._to_adapter: dict[int, int] = {}   # session type id -> adapter type id
        self._to_session: dict[int, int] = {}   # adapter type id -> session type id
        self._planned: set[int] = set()          # adapter ids in the open interval's plan
        self._seen: set[int] = set()             # adapter ids with a message in it
        self._unsent: list[tuple[Message, int]] = []  # taken, not yet given to the session

    # ------------------------------------------------------------------ the session
    def _session(self, adapter: ControllerAdapter) -> OnlineSession:
        if self.session is None:
            from serving.online_session import OnlineSession

            cat = adapter.parser.catalog
            s = OnlineSession(self._scenario(adapter), cat.topology, cost=self.cost,
                              batch_key=cat.batch_key, start_ns=0, name=self.name)
            s.set_decider(self.decider_spec.build(s.sim.trace, self.cost))
            self.session = s
        return self.session

    def _scenario(self, adapter: ControllerAdapter) -> ScenarioSpec:
        """The scenario the decider plans in: ``spec`` (checked against the adapter's
        controller) or, without one, the adapter's controller itself."""
        from serving.online_session import signature_scenario

        loc = adapter.local.spec
        mine: dict[str, int | float] = {
            "num_topics": int(loc.num_topics), "controller_bw_bps": int(loc.controller_bw_bps),
            "controller_cpu": int(loc.controller_cpu), "interval_s": float(loc.interval_s)}
        if self.spec is None:
            topo = adapter.parser.catalog.topology
            return signature_scenario(topo.num_nodes, int(topo.bandwidth_bps.max()),
                                      int(loc.num_topics), int(loc.controller_bw_bps),
                                      int(loc.controller_cpu), float(loc.interval_s),
                                      name=f"{self.name}-controller")
        for k, v in mine.items():
            if getattr(self.spec, k) != v:
                raise ValueError(f"policy {self.name!r}: the scenario's {k} is "
                                 f"{getattr(self.spec, k)!r}, the controller adapter's {v!r}")
        return self.spec

    def _begin(self, s: OnlineSession) -> None:
        plan = s.begin()
        self._planned = {self._to_adapter[int(t)] for t in plan.types.tolist()}
        self._seen = set()

    def _submit(self, s: OnlineSession, batch: list[tuple[Message, int]]) -> np.ndarray:
        """Give the session a batch (in order); returns its channels; checks the type ids."""
        sub = s.submit([m for m, _ in batch])
        for (_, t), sid in zip(batch, sub.types.tolist()):
            if self._to_session.setdefault(t, sid) != sid or \
                    self._to_adapter.setdefault(sid, t) != t:
                raise RuntimeError(f"policy {self.name!r}: adapter type {t} is session type "
                                   f"{sid}, which is not the type it was before (the adapter "
                                   "and the session must batch messages alike)")
        return sub.channels

    def route(self, adapter: ControllerAdapter, msg: Message, type_id: int) -> int | None:
        """Take a message the adapter just counted (type ``type_id``); returns the channel
        its type takes now if it was placed on this message, else None (it keeps its
        channel)."""
        s = self._session(adapter)
        if not s.planned:
            self._begin(s)
        m = dataclasses.replace(msg, message_id=next(self._ids),
                                timestamp_ns=s.window * s.live.step_ns)
        t = int(type_id)
        if t in self._seen or t in self._planned:
            self._seen.add(t)
            self._unsent.append((m, t))
            return None
        batch, self._unsent = [*self._unsent, (m, t)], []
        chans = self._submit(s, batch)
        self._seen.add(t)
        return int(chans[-1])

    # ------------------------------------------------------------------ the control plane
    def channels(self, adapter: ControllerAdapter, est: IntervalEstimate) -> dict[int, int]:
        """Close the session's interval (scored by the simulator), then plan the next one:
        the plan's channels."""
        s = self._session(adapter)
        if self._unsent:
            batch, self._unsent = self._unsent, []
            self._submit(s, batch)
        closed = s.close()
        got = {self._to_adapter[int(t)] for t in closed.types.tolist()}
        if got != {int(t) for t in est.types.tolist()}:
            raise RuntimeError(f"policy {self.name!r}: the interval's types seen through "
                               f"route() {sorted(got)[:10]} are not the adapter's "
                               f"{sorted(est.types.tolist())[:10]}: the control plane must "
                               "pass every message it counts to route()")
        self.terms.append(closed.terms)
        self._begin(s)
        plan = s.plan
        assert plan is not None
        return {self._to_adapter[int(t)]: int(c)
                for t, c in zip(plan.types.tolist(), plan.channels.tolist())}

    def first_channel(self, adapter: ControllerAdapter, type_id: int) -> int:
        """The type's channel in the session (placed by :meth:`route`), RPC if it has none."""
        sid = self._to_session.get(int(type_id))
        if self.session is None or sid is None:
            return 0
        return max(self.session.channel_of(sid), 0)


def make_policy(name: str, problems: ProblemSet | None = None,
                params: Mapping[str, Any] | None = None) -> ChannelPolicy:
    """The policy ``name`` (:data:`POLICIES`) of a live controller. ``problems``: the
    scenario (its ``extra`` thresholds, topology and capacities), needed by ``alcor`` and
    used by the online deciders (without it they plan in the controller adapter's
    capacities). ``params``: the policy's parameters (the registry's for a static baseline;
    an online decider's knobs, ``cost`` (:class:`~envs.dsmd.online.OnlineCost` weights), and
    for ``online_learned`` its ``bundle`` directory and optional ``signing_key``)."""
    p = dict(params or {})
    if name == "learned":
        if p:
            raise ValueError(f"policy 'learned' takes no parameters, got {sorted(p)}")
        return AdapterPolicy()
    if name in STATIC:
        if problems is None and name in _NEED_PROBLEMS:
            raise ValueError(f"policy {name!r} needs the scenario: make_policy({name!r}, "
                             "problems)")
        if problems is None:  # the factories of these read neither scenario nor topology
            return BaselinePolicy(STATIC_FACTORIES[name](None, None, p),  # type: ignore[arg-type]
                                  name)
        return BaselinePolicy(make_policy_for(name, problems.spec, problems.dataset.topology, p),
                              name)
    if name in ONLINE_DEFAULTS:
        kind, defaults = ONLINE_DEFAULTS[name]
        cost = OnlineCost.from_dict(p.pop("cost", None))
        knobs = {**defaults, **p}
        _check_online(name, kind, knobs)
        return OnlinePolicy(name, kind, knobs, cost,
                            None if problems is None else problems.spec)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")


def _check_online(name: str, kind: str, knobs: Mapping[str, Any]) -> None:
    """Refuse an online decider's bad parameters now, not at the first message."""
    if kind == "learned":
        if "bundle" not in knobs or not Path(str(knobs["bundle"])).is_dir():
            raise ValueError(f"policy {name!r} needs params['bundle'], an online policy "
                             f"bundle's directory (got {knobs.get('bundle')!r})")
        return
    from agents.online import OnlineGreedy

    try:
        OnlineGreedy(**knobs)
    except TypeError as e:
        raise ValueError(f"policy {name!r}: bad parameter ({e}); known: "
                         f"{', '.join(_greedy_params())}") from None
    except ValueError as e:
        raise ValueError(f"policy {name!r}: {e}") from None


def _greedy_params() -> list[str]:
    import inspect

    from agents.online import OnlineGreedy

    return [k for k in inspect.signature(OnlineGreedy).parameters if k not in ("cost", "name")]
