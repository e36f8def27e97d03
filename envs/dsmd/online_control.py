"""What a knob-setting online controller sees and sets: one implementation for the
environment (``smart/DSMDOnline-v0``), evaluation, training and serving.

The learned online policy is DDPG whose continuous action sets the knobs of a
feasible-by-construction executor each interval (``docs/online.md``, "The learned online
policy"; the design in the manner of RLScale-Bench's calibrated executors): the executor
(:class:`envs.dsmd.online_greedy.OnlineGreedy`, named in :data:`~envs.dsmd.online_greedy.
EXECUTORS`) decides every channel, the action only sets how. Three pieces:

* :func:`online_features` -- the observation at an interval boundary, from what the
  controller knows then (:class:`envs.dsmd.online.OnlineView`: the past intervals' rate
  estimates and the realised terms of the interval that just ended). :data:`FEATURES`
  names each value.
* :class:`KnobMap` -- the action ``[0, 1]^3`` to the executor's knobs: ``headroom`` in
  ``[0, max_headroom]``, ``horizon`` in ``[0, max_horizon]`` intervals (an action of
  :data:`TOP` or more: re-plan every type) and the forecast's level weight ``alpha`` in
  ``[0.05, 1]`` (:data:`TOP` or more: the last estimate), and the executor built with them
  and with the map's ``fixed`` arguments (those the action does not set, such as
  ``reserve_placements`` or a ``send_forecaster`` and its ``drop``).
* :class:`KnobPolicy` -- an :class:`envs.dsmd.online.OnlineDecider` that asks an actor
  (observation -> action in ``[-1, 1]^3``, a DDPG actor's tanh output, unsquashed as
  RLlib's module-to-env connector does) for the knobs at every boundary. One executor
  serves the whole episode (its knobs set at every boundary), so that what it keeps
  between boundaries (the forecaster's demand state) is the executor's own.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import DSMDError
from .online import NewType, OnlineCost, OnlineDecider, OnlineView, Placement
from .online_greedy import DEFAULT_EXECUTOR, OnlineGreedy, executor_class

__all__ = [
    "DEFAULT_EXECUTOR",
    "FEATURES",
    "OBS_SIZE",
    "SET_BY_ACTION",
    "KnobMap",
    "KnobPolicy",
    "online_features",
]

#: The observation's values, in order; each is clipped to [-1, 1].
FEATURES: tuple[str, ...] = (
    "returning_share",        # returning types / types of the last interval
    "redundancy_ratio_m1",    # last interval: node traffic / necessary - 1
    "violation",              # last interval: normalised violation V
    "bw_violated", "cpu_violated", "node_violated",  # last interval: flags
    "subscribe_infos_k",      # last interval: SubscribeInfos / 1,000
    "moved_types_c",          # last interval: moved types / 100
    "rpc_bw_load_q",          # last estimate, all on RPC: bandwidth / C_b / 4
    "rpc_sends_load_q",       # last estimate, all on RPC: sends / C_p / 4
    "new_share",              # new types / types of the last interval
    "rate_change",            # change of the estimated total rate against the interval before
    "delay_p95_q",            # last interval: the delay model's p95 / 10 s
    "bw_util",                # last interval: C_b's utilisation (control traffic included)
)
OBS_SIZE = len(FEATURES)
#: an action value at or above this sets the top of its knob's range (horizon: re-plan
#: every type; alpha: the last estimate), so that a tanh actor can reach it
TOP = 0.95
#: the knobs' grid: headroom, horizon (intervals), alpha
STEPS = (0.005, 0.25, 0.05)
#: the executor arguments the action sets (``forecast`` follows ``alpha``)
SET_BY_ACTION = frozenset({"headroom", "horizon", "forecast", "alpha"})
#: executor arguments that are never fixed by a knob map (given by the caller)
_NOT_FIXED = frozenset({"cost", "name"})


def _snap(x: float, step: float) -> float:
    return float(round(round(x / step) * step, 10))


def online_features(view: OnlineView) -> np.ndarray:
    """The observation at the boundary of ``view`` (:data:`FEATURES`), float32."""
    o = np.zeros(OBS_SIZE, np.float64)
    r = view.last
    if r is not None and r.get("types", 0):
        n = max(float(r["types"]), 1.0)
        o[0] = r["returning_types"] / n
        o[1] = r["redundancy_ratio"] - 1.0
        o[2] = r["violation"]
        o[3:6] = (r["bw_violated"], r["cpu_violated"], r["node_violated"])
        o[6] = r["subscribe_infos"] / 1000.0
        o[7] = r["moved_types"] / 100.0
        o[10] = r["new_types"] / n
        o[12] = r.get("delay_p95_s", 0.0) / 10.0
        o[13] = r.get("bw_util", 0.0)
    w = view.window
    if w > 0:
        last, s = view.estimate(w - 1), view.spec  # Algorithm 1's rates of the last interval
        o[8] = last.necessary_bps / s.controller_bw_bps / 4.0
        o[9] = float(last.fanout.sum()) / s.controller_cpu / 4.0
        if w > 1:
            prev = float(view.estimate(w - 2).rate_bps.sum())
            o[11] = (float(last.rate_bps.sum()) - prev) / max(prev, 1.0)
    return np.clip(o, -1.0, 1.0).astype(np.float32)


@dataclass(frozen=True)
class KnobMap:
    """Action ``[0, 1]^3`` -> the executor's knobs (module docstring)."""

    max_headroom: float = 0.9
    max_horizon: float = 16.0
    #: the executor's name (:data:`envs.dsmd.online_greedy.EXECUTORS`)
    executor: str = DEFAULT_EXECUTOR
    #: the observation values the policy reads (:data:`FEATURES` names; the others are 0);
    #: ``None``: all of them
    features: tuple[str, ...] | None = None
    #: the executor's keyword arguments fixed for every interval (not in
    #: :data:`SET_BY_ACTION`): the tuned teacher's other settings, e.g.
    #: ``{"reserve_placements": True, "send_forecaster": "f.npz", "drop": 0.2}``
    fixed: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (0 <= self.max_headroom < 1 and self.max_horizon > 0):
            raise DSMDError("max_headroom must be in [0, 1) and max_horizon > 0, got "
                            f"{self.max_headroom}, {self.max_horizon}")
        if self.features is not None:
            unknown = sorted(set(self.features) - set(FEATURES))
            if unknown:
                raise DSMDError(f"unknown observation features {unknown}; known: "
                                f"{list(FEATURES)}")
            object.__setattr__(self, "features", tuple(self.features))
        cls = executor_class(self.executor)  # an unknown executor is refused here, naming it
        fixed = dict(self.fixed or {})
        params = set(inspect.signature(cls).parameters) - SET_BY_ACTION - _NOT_FIXED
        bad = sorted(set(fixed) - params)
        if bad:
            why = ("set by the action" if set(bad) <= SET_BY_ACTION else
                   "not arguments it takes")
            raise DSMDError(f"knob map: fixed arguments {bad} of executor {self.executor!r} "
                            f"are {why}; it may fix {sorted(params)}")
        object.__setattr__(self, "fixed", fixed)

    def observe(self, view: OnlineView) -> np.ndarray:
        """:func:`online_features` with the features this policy does not read set to 0."""
        o = online_features(view)
        if self.features is not None:
            o[[i for i, f in enumerate(FEATURES) if f not in self.features]] = 0.0
        return o

    def knobs(self, action: np.ndarray) -> dict[str, float]:
        """The knobs of ``action``, each rounded to its step (:data:`STEPS`): the executor's
        cost is a rugged function of its knobs (a change of 0.001 in headroom can move an
        interval's plan), so knobs live on a fine grid and an actor that is within half a
        step of a setting runs exactly that setting."""
        a = np.clip(np.asarray(action, np.float64).reshape(-1), 0.0, 1.0)
        if a.size != 3:
            raise DSMDError(f"action must have 3 values, got {a.size}")
        top = TOP
        hs, zs, fs = STEPS
        horizon = (math.inf if a[1] >= top
                   else _snap(a[1] / top * self.max_horizon, zs))
        alpha = 1.0 if a[2] >= top else min(max(_snap(0.05 + 0.95 * a[2] / top, fs), 0.05),
                                            1.0)
        return {"headroom": min(_snap(a[0] * self.max_headroom, hs), self.max_headroom),
                "horizon": horizon, "alpha": alpha}

    def action(self, headroom: float, horizon: float, alpha: float = 1.0) -> np.ndarray:
        """An action in ``[0, 1]^3`` that sets these knobs (the inverse of :meth:`knobs`; a
        value in a top band is its middle, which a tanh actor reaches)."""
        mid = (1.0 + TOP) / 2
        h = mid if math.isinf(horizon) else min(horizon / self.max_horizon, 1.0) * TOP
        f = mid if alpha >= 1.0 else (alpha - 0.05) / 0.95 * TOP
        return np.array([min(headroom / self.max_headroom, 1.0), h, f],
                        np.float32).clip(0.0, 1.0)

    def build(self, cost: OnlineCost) -> OnlineGreedy:
        """A fresh executor with the ``fixed`` arguments, its knobs at their defaults until
        :meth:`set` sets them."""
        return executor_class(self.executor)(cost=cost, **self.fixed)

    @staticmethod
    def set(executor: OnlineGreedy, knobs: dict[str, float]) -> None:
        """Set the knobs of :meth:`knobs` on ``executor`` (``alpha`` 1: the last estimate,
        else the EWMA)."""
        fc = "last" if knobs["alpha"] >= 1.0 else "ewma"
        executor.set_knobs(forecast=fc, **knobs)

    def decider(self, knobs: dict[str, float], cost: OnlineCost) -> OnlineDecider:
        """A fresh executor with these knobs (and the ``fixed`` arguments)."""
        executor = self.build(cost)
        self.set(executor, knobs)
        return executor


class KnobPolicy:
    """An online decider whose knobs an actor sets at every boundary (module docstring).

    ``act(obs) -> action in [-1, 1]^3``. ``knobs_used`` holds the knobs of every interval
    since :meth:`reset`."""

    def __init__(self, act: Callable[[np.ndarray], np.ndarray], knob_map: KnobMap,
                 cost: OnlineCost | None = None, name: str = "learned") -> None:
        self.act, self.map, self.cost, self.name = act, knob_map, cost or OnlineCost(), name
        self._exec: OnlineGreedy | None = None
        self.knobs_used: list[dict[str, float]] = []

    def reset(self, seed: int | None = None) -> None:
        self._exec = None
        self.knobs_used = []

    def knobs(self, view: OnlineView) -> dict[str, float]:
        a = np.asarray(self.act(self.map.observe(view)), np.float64).reshape(-1)
        return self.map.knobs((np.clip(a, -1.0, 1.0) + 1.0) / 2.0)

    def plan(self, view: OnlineView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        k = self.knobs(view)
        self.knobs_used.append(k)
        if self._exec is None:
            self._exec = self.map.build(self.cost)
        self.map.set(self._exec, k)
        return self._exec.plan(view)

    def place(self, view: OnlineView, new: NewType, placement: Placement) -> int:
        if self._exec is None:
            raise DSMDError(f"{self.name}: place() before plan()")
        return self._exec.place(view, new, placement)
