"""A controller session and the decision engine (SMART Section V-D, online execution).

One implementation, used by the policy server for each controller session and by the cached
adapter for its local copy. Every decision is made by the decision step of ``smart/DSMD-v0``
(:class:`envs.dsmd.decision.DecisionStep`), so the same state gives the same observation and
action as in the environment:

* the state is a :class:`~envs.dsmd.cost.CostState` over the session's *active* types (a
  positive rate in the latest estimate), in catalogue order, exactly the
  :class:`~envs.dsmd.instance.DSMDInstance` the simulator builds for one interval
  (``catalog_index`` = the type's slot in the session's catalogue);
* observations come from :class:`~envs.dsmd.observation.ObservationBuilder`, with progress =
  decided types / active types (the environment's ``i / n`` when types are decided in its
  order from an empty assignment);
* channels come from :func:`envs.dsmd.decoding.decode` with the policy's decoding mode.

A decision for a type that is already assigned first takes it off its channel (it is
re-decided given everything else). ``decide(replan=True)`` clears the assignment and decides
every active type in the policy's decision order, one environment episode.

When no usable policy is available (none loaded, or one whose observation layout or scenario
does not fit the session), the configured heuristic decides and every decision says so:
``greedy`` scores each channel by minus the node traffic it adds (``CostState.channel_costs``)
and decodes with ``feasible``; ``rpc`` prefers RPC, then the first topic that fits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from envs.dsmd.cost import CostState
from envs.dsmd.decision import DecisionStep, decision_order
from envs.dsmd.errors import DSMDError
from envs.dsmd.instance import UNASSIGNED, DSMDInstance
from envs.dsmd.observation import ObservationBuilder, ObservationLayout

__all__ = [
    "FALLBACKS",
    "Decision",
    "ScoringPolicy",
    "Session",
    "SessionError",
    "SessionSpec",
    "compatibility",
]

FALLBACKS: tuple[str, ...] = ("greedy", "rpc")


class SessionError(DSMDError):
    """A request that does not fit the session's state (unknown type, no rate, ...)."""


class ScoringPolicy(Protocol):
    """What the engine needs from a policy (a loaded
    :class:`serving.bundles.static.PolicyBundle`)."""

    @property
    def layout(self) -> ObservationLayout: ...

    @property
    def metadata(self) -> dict: ...

    @property
    def decoding(self) -> str: ...

    @property
    def order(self) -> str: ...

    def __call__(self, obs: np.ndarray) -> np.ndarray: ...

    def score_rows(self, n: int, fill: Callable[[int, int, np.ndarray], None]
                   ) -> tuple[np.ndarray, np.ndarray]:
        """``n`` observations written by ``fill`` and their scores
        (:meth:`serving.bundles.static.PolicyBundle.score_rows`)."""
        ...

    # optional: ``bound_row()``, this thread's single-row runner (an ``x`` buffer to observe
    # into and ``run()`` for its scores, :meth:`serving.bundles.static.PolicyBundle.
    # bound_row`); a policy that has it is scored through it, one without it by __call__


@dataclass(frozen=True)
class SessionSpec:
    """What a controller describes once: nodes and their bandwidth s(n), the controller's
    C_b and C_p, K topics, the rate-estimation interval, and optionally the scenario
    signature it was built from (compared with a policy bundle's)."""

    node_ids: np.ndarray  # int64 (N,)
    node_capacity_bps: np.ndarray  # int64 (N,)
    controller_bw_bps: int
    controller_cpu: int
    num_topics: int
    interval_s: float = 1.0
    scenario_signature: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        ids = np.asarray(self.node_ids, dtype=np.int64)
        cap = np.asarray(self.node_capacity_bps, dtype=np.int64)
        object.__setattr__(self, "node_ids", ids)
        object.__setattr__(self, "node_capacity_bps", cap)
        if ids.ndim != 1 or ids.size == 0:
            raise SessionError("nodes: at least one node is needed")
        if np.unique(ids).size != ids.size:
            raise SessionError("nodes: node ids must be unique")
        if cap.shape != ids.shape or np.any(cap <= 0):
            raise SessionError("nodes: every node needs a positive capacity_bps")
        if self.controller_bw_bps <= 0 or self.controller_cpu <= 0:
            raise SessionError("controller: bandwidth_bps and cpu must be positive")
        if self.num_topics < 0:
            raise SessionError("num_topics must be >= 0")
        if not self.interval_s > 0:
            raise SessionError("interval_s must be positive")

    @property
    def num_nodes(self) -> int:
        return int(self.node_ids.size)


class Decision(NamedTuple):
    """One channel decision (a named tuple: made once per decided type, cheaply)."""

    type_id: int
    channel: int  # 0 = RPC, t = MQ topic t
    source: str  # "policy" or "fallback"
    reason: str | None = None  # why the fallback decided
    observation: np.ndarray | None = None
    scores: np.ndarray | None = None


def compatibility(policy: ScoringPolicy | None, spec: SessionSpec, catalog_size: int
                  ) -> str | None:
    """``None`` if ``policy`` can decide for this session, else why not (one line)."""
    if policy is None:
        return "no policy is loaded"
    lay = policy.layout
    if lay.num_nodes != spec.num_nodes or lay.num_topics != spec.num_topics:
        return (f"policy layout has N={lay.num_nodes}, K={lay.num_topics}; session has "
                f"N={spec.num_nodes}, K={spec.num_topics}")
    if lay.variant != "channel" and catalog_size > lay.catalog_size:
        return (f"session has {catalog_size} types; the policy's {lay.variant!r} layout "
                f"holds {lay.catalog_size}")
    sig = policy.metadata.get("scenario_signature", {})
    diffs = sorted(k for k, v in spec.scenario_signature.items() if k in sig and sig[k] != v)
    if diffs:
        return f"scenario signature differs from the policy's in {diffs}"
    return None


class Session:
    """A controller's world as the server (or the cached adapter) keeps it."""

    def __init__(self, spec: SessionSpec, *, seed: int = 0, owner: str | None = None) -> None:
        self.spec = spec
        self.seed = int(seed)
        #: the server's owner id of the session (the SHA-256 of the key that created it,
        #: :mod:`serving.access`; never the key); not part of the snapshot
        self.owner = owner
        self.rng = np.random.default_rng(seed)
        self._node_index = {int(n): i for i, n in enumerate(spec.node_ids.tolist())}
        self.type_ids: list[int] = []  # slot -> client's type id
        self._slot: dict[int, int] = {}  # client's type id -> slot
        self._dest: list[np.ndarray] = []  # slot -> sorted node indices
        #: sum of |D(m)| over the catalogue (the server's memory estimate reads it)
        self.num_destinations = 0
        self.rates = np.zeros(0, np.int64)  # slot -> f(m) bit/s (0: inactive)
        self.messages = np.zeros(0, np.int64)
        self.channel = np.zeros(0, np.int64)  # slot -> channel, -1 undecided
        self.version = 0  # bumped by every change
        #: the controller's channel health as last reported (a
        #: :class:`serving.schemas.ChannelHealth` as a dict; None: never reported): the
        #: session's view of the channels, read by whoever decides; the heuristics and the
        #: static policies do not use it as an input (the controller applies failover itself)
        self.health: dict[str, Any] | None = None
        self._compat: tuple | None = None  # _uses()
        self._rebuild()

    # ------------------------------------------------------------------ catalogue and rates
    @property
    def catalog_size(self) -> int:
        return len(self.type_ids)

    def add_types(self, types: Iterable[tuple[int, Sequence[int]]]) -> int:
        """Register ``(type_id, destination node ids)`` pairs; an id seen before must come
        with the same destinations. All or nothing. Returns the number of new types."""
        new: list[tuple[int, np.ndarray]] = []
        seen = set()
        for raw_id, nodes in types:
            tid = int(raw_id)
            if tid < 0:
                raise SessionError(f"type {tid}: ids must be >= 0")
            try:
                idx = np.unique([self._node_index[int(n)] for n in nodes]).astype(np.int64)
            except KeyError as e:
                raise SessionError(f"type {tid}: unknown destination node {e.args[0]}") from None
            if idx.size == 0:
                raise SessionError(f"type {tid}: at least one destination is needed")
            if tid in self._slot:
                if not np.array_equal(self._dest[self._slot[tid]], idx):
                    raise SessionError(f"type {tid} is already registered with other "
                                       "destinations")
                continue
            if tid in seen:
                raise SessionError(f"type {tid} appears twice in one request")
            seen.add(tid)
            new.append((tid, idx))
        for tid, idx in new:
            self._slot[tid] = len(self.type_ids)
            self.type_ids.append(tid)
            self._dest.append(idx)
            self.num_destinations += int(idx.size)
        if new:
            k = len(new)
            self.rates = np.concatenate([self.rates, np.zeros(k, np.int64)])
            self.messages = np.concatenate([self.messages, np.ones(k, np.int64)])
            self.channel = np.concatenate([self.channel, np.full(k, UNASSIGNED, np.int64)])
            self._rebuild()
        return len(new)

    def slot(self, type_id: int) -> int:
        s = self._slot.get(int(type_id))
        if s is None:
            raise SessionError(f"type {type_id} is not registered in this session")
        return s

    def update_rates(self, rates: dict[int, int], messages: dict[int, int] | None = None,
                     replace: bool = False) -> None:
        """New rate estimates (bit/s; 0 makes a type inactive). ``replace``: the whole
        interval's estimate, every type not listed becomes inactive. All or nothing."""
        slots = {self.slot(t): int(r) for t, r in rates.items()}
        if any(r < 0 for r in slots.values()):
            raise SessionError("rates must be >= 0")
        msgs = {self.slot(t): int(c) for t, c in (messages or {}).items()}
        if any(c < 1 for c in msgs.values()):
            raise SessionError("messages must be >= 1")
        if replace:
            self.rates[:] = 0
        for s, r in slots.items():
            self.rates[s] = r
        for s, c in msgs.items():
            self.messages[s] = c
        self._rebuild()

    def check_health(self, health: Mapping[str, Any]) -> None:
        """``SessionError`` naming the field if ``health`` (a validated
        :class:`serving.schemas.ChannelHealth` dict) names a node this session does not have."""
        for key in ("unreachable", "relayed"):
            for n in health.get(key, ()):
                if int(n) not in self._node_index:
                    raise SessionError(f"channel_health.{key}: unknown node {n}")

    def set_health(self, health: Mapping[str, Any] | None) -> None:
        """Replace the channel health (:meth:`check_health` first: nothing changes if it
        fails; None: not reported)."""
        if health is not None:
            self.check_health(health)
        self.health = None if health is None else _copy_health(health)
        self.version += 1

    def set_assignment(self, channels: dict[int, int]) -> None:
        """Record channels decided elsewhere (e.g. by the adapter's fallback)."""
        slots = {self.slot(t): int(c) for t, c in channels.items()}
        bad = [c for c in slots.values() if not UNASSIGNED <= c <= self.spec.num_topics]
        if bad:
            raise SessionError(f"channel {bad[0]} out of range -1..{self.spec.num_topics}")
        for s, c in slots.items():
            self.channel[s] = c
            p = self._pos.get(s)
            if p is not None:
                self.state.move(p, c)
        self.step.drop_builder()
        self.version += 1

    def _rebuild(self) -> None:
        active = np.flatnonzero(self.rates > 0)
        lens = np.array([self._dest[s].size for s in active], dtype=np.int64)
        ptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        idx = (np.concatenate([self._dest[s] for s in active]) if active.size
               else np.zeros(0, np.int64)).astype(np.int64)
        sp = self.spec
        self.inst = DSMDInstance(sp.num_nodes, sp.num_topics, sp.node_capacity_bps,
                                 int(sp.controller_bw_bps), int(sp.controller_cpu),
                                 self.rates[active].copy(), ptr, idx,
                                 messages=self.messages[active].copy(),
                                 catalog_index=active.astype(np.int64),
                                 interval_s=sp.interval_s, name="session")
        self.active = active
        self._pos = {int(s): i for i, s in enumerate(active.tolist())}
        self.state = CostState(self.inst, self.channel[active])
        # the session's decision step: its state, the builder of the policy's layout (made
        # when a policy first decides) and the session's RNG; each decide() sets its order
        self.step = DecisionStep(self.inst, rng=self.rng, order=(), state=self.state)
        self.version += 1

    # ------------------------------------------------------------------ observation
    def builder(self, layout: ObservationLayout) -> ObservationBuilder:
        """The observation builder of ``layout`` over the session's state
        (:meth:`DecisionStep.use_layout`)."""
        return self.step.use_layout(layout)

    def compatibility(self, policy: ScoringPolicy | None) -> str | None:
        """:func:`compatibility`, cached per policy object and catalogue size (the cache
        holds the policy itself: an ``id()`` could be reused by a later object)."""
        why: str | None = self._uses(policy)[2]
        return why

    def _uses(self, policy: ScoringPolicy | None) -> tuple:
        """``(policy, catalogue size, why not, layout, decoding, bound_row)`` for ``policy``:
        :func:`compatibility` and what a decision reads of the policy (``bound_row``: the
        policy's single-row runner getter, None if it has none), kept while the policy object
        and the catalogue size stay."""
        c = self._compat
        if c is None or c[0] is not policy or c[1] != self.catalog_size:
            why = compatibility(policy, self.spec, self.catalog_size)
            usable = policy if why is None else None
            c = self._compat = (
                policy, self.catalog_size, why,
                None if usable is None else usable.layout,
                "feasible" if usable is None else usable.decoding,
                getattr(usable, "bound_row", None))
        return c

    # ------------------------------------------------------------------ decisions
    def decide(self, type_ids: Sequence[int] | None, policy: ScoringPolicy | None, *,
               fallback: str = "greedy", replan: bool = False, explain: bool = False,
               parallel: bool = False) -> list[Decision]:
        """Channels for ``type_ids`` in that order (``None``: every active type still
        undecided, or all of them with ``replan``, in the policy's decision order).

        ``parallel``: one observation per type, all from the state in which the batch's
        types are undecided, scored in one policy call; see :meth:`_decide_parallel`."""
        if fallback not in FALLBACKS:
            raise SessionError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
        _, _, why, layout, mode, bound = self._uses(policy)
        use = policy if why is None else None
        positions = self._positions(type_ids, use, replan)
        step = self.step
        if replan:
            self.state.assign_all(np.full(self.inst.num_types, UNASSIGNED, np.int64))
            self.channel[self.active] = UNASSIGNED
            step.drop_builder()
        if parallel:
            return self._decide_parallel(positions, use, why, fallback, explain)
        step.begin(positions, checked=True)
        active, channel, type_ids = self.active, self.channel, self.type_ids
        src = "policy" if use is not None else "fallback"
        out = []
        if layout is not None:
            step.use_layout(layout)
        # a policy that offers its single-row runner (serving.bundles.static._BoundRow) is
        # observed straight into the runner's bound input and decoded from its bound output
        runner = bound() if bound is not None else None
        for p in positions:
            if runner is not None:
                obs = step.observe(runner.x)  # takes p off its channel first
                scores = runner.run()
            elif use is not None:
                obs = step.observe()
                scores = use(obs)
            else:
                obs = None
                step.take_off()
                scores = self._heuristic_scores(np.array([p]), fallback)[0]
            c = step.apply(scores, mode)
            s = int(active[p])
            channel[s] = c
            if explain:
                out.append(Decision(type_ids[s], c, src, why,
                                    None if obs is None else obs.copy(),
                                    np.array(scores, np.float32).reshape(-1)))
            else:  # Decision(t, c, src, why) without its Python __new__
                out.append(tuple.__new__(Decision, (type_ids[s], c, src, why, None, None)))
        self.version += 1
        return out

    def _decide_parallel(self, positions: list[int], use: ScoringPolicy | None,
                         why: str | None, fallback: str, explain: bool) -> list[Decision]:
        """The batch's types are taken off their channels together; each is observed as if
        it were the next to be decided (``DecisionStep.rows``, equal row by row to
        ``observe``) and all are scored in one policy call (``score_rows``, which builds the
        observations chunk by chunk on the threads that score them); the argmaxes are applied
        together (``DecisionStep.apply_rows``). With ``feasible`` decoding (and for the
        heuristics), if that breaks a constraint, the types are re-decoded one by one in the
        given order with the same scores (the safety layer), so the batch ends feasible
        whenever one-by-one decoding would. The sequential mode's observations see the
        decisions made before them; these do not."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size == 0:
            self.version += 1
            return []
        step = self.step
        step.take_off_many(pos)
        obs = None
        if use is not None:
            obs, scores = use.score_rows(pos.size, step.rows(pos, use.layout))
            scores = np.asarray(scores, dtype=np.float32).reshape(pos.size, -1)
            mode = use.decoding
        else:
            scores = self._heuristic_scores(pos, fallback)
            mode = "feasible"
        chosen = step.apply_rows(pos, scores, mode)
        slots = self.active[pos]
        self.channel[slots] = chosen
        self.version += 1
        src = "policy" if use is not None else "fallback"
        tids = self.type_ids
        ids = [tids[s] for s in slots.tolist()]
        if not explain:
            make = tuple.__new__  # Decision(t, c, src, why) without its Python __new__
            return [make(Decision, (t, c, src, why, None, None))
                    for t, c in zip(ids, chosen.tolist())]
        return [Decision(t, c, src, why, obs[i] if obs is not None else None, scores[i])
                for i, (t, c) in enumerate(zip(ids, chosen.tolist()))]

    def _positions(self, type_ids: Sequence[int] | None, policy: ScoringPolicy | None,
                   replan: bool) -> list[int]:
        if type_ids is None:
            order = decision_order(self.inst, policy.order if policy is not None
                                   else "rate_desc", self.rng)
            if not replan:
                order = order[self.state.channel[order] == UNASSIGNED]
            return [int(p) for p in order]
        type_ids = list(type_ids)  # read twice on a miss (an iterator would be used up)
        slot_of, pos_of = self._slot, self._pos
        try:  # the common case in one pass; any miss is explained by the loop below
            out = [pos_of[slot_of[t]] for t in type_ids]
        except (KeyError, TypeError):
            out = self._positions_checked(type_ids)
        if len(out) > 1 and len(set(out)) != len(out):
            raise SessionError("a type is listed twice")
        return out

    def _positions_checked(self, type_ids: Sequence[int]) -> list[int]:
        out = []
        for t in type_ids:
            p = self._pos.get(self.slot(t))
            if p is None:
                raise SessionError(f"type {t} has no rate in this session (send a rate update "
                                   "first)")
            out.append(p)
        return out

    def _heuristic_scores(self, positions: np.ndarray, fallback: str) -> np.ndarray:
        """``[len(positions), K+1]`` heuristic channel scores of undecided types: ``rpc``
        prefers RPC; ``greedy`` scores minus the node traffic each channel would add."""
        if fallback == "rpc":
            s = np.zeros((len(positions), self.spec.num_topics + 1), np.float32)
            s[:, 0] = 1.0
            return s
        return -self.state.channel_costs_many(positions)[0].astype(np.float64)

    # ------------------------------------------------------------------ views
    def assignment(self) -> dict[int, int]:
        return {t: int(c) for t, c in zip(self.type_ids, self.channel.tolist())}

    def metrics(self) -> dict:
        return self.state.metrics().as_dict()

    def snapshot(self) -> dict:
        """Everything a cached adapter needs to rebuild this session (JSON-ready)."""
        sp = self.spec
        return {"nodes": [{"id": int(i), "capacity_bps": int(c)}
                          for i, c in zip(sp.node_ids.tolist(), sp.node_capacity_bps.tolist())],
                "controller": {"bandwidth_bps": int(sp.controller_bw_bps),
                               "cpu": int(sp.controller_cpu)},
                "num_topics": sp.num_topics, "interval_s": sp.interval_s,
                "scenario_signature": dict(sp.scenario_signature),
                "types": [{"id": t, "destinations": sp.node_ids[self._dest[s]].tolist(),
                           "rate_bps": int(self.rates[s]), "messages": int(self.messages[s]),
                           "channel": int(self.channel[s])}
                          for s, t in enumerate(self.type_ids)],
                "seed": self.seed,
                "channel_health": None if self.health is None else _copy_health(self.health)}

    @classmethod
    def from_snapshot(cls, snap: dict) -> Session:
        spec = SessionSpec(np.array([n["id"] for n in snap["nodes"]], np.int64),
                           np.array([n["capacity_bps"] for n in snap["nodes"]], np.int64),
                           int(snap["controller"]["bandwidth_bps"]),
                           int(snap["controller"]["cpu"]), int(snap["num_topics"]),
                           float(snap["interval_s"]), dict(snap.get("scenario_signature", {})))
        s = cls(spec, seed=int(snap.get("seed", 0)))
        types = snap.get("types", [])
        s.add_types((t["id"], t["destinations"]) for t in types)
        s.update_rates({t["id"]: t["rate_bps"] for t in types},
                       {t["id"]: t["messages"] for t in types})
        s.set_assignment({t["id"]: t["channel"] for t in types})
        if snap.get("channel_health") is not None:
            s.set_health(snap["channel_health"])
        return s


def _copy_health(health: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a channel-health dict that shares no list with it."""
    return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in health.items()}
