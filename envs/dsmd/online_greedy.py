"""The online executor: greedy + local search with the three knobs of an online expert, and
the least-cost placement of the types that appear during an interval (the deciders of
:mod:`envs.dsmd.online`; the knob policy of :mod:`envs.dsmd.online_control` sets its knobs).

* :class:`OnlineGreedy` -- greedy + local search (:class:`envs.dsmd.greedy.GreedyLocalSearch`)
  with

  - ``headroom``: plan against ``(1 - headroom)`` of C_b, C_p and every s(n), a reserve
    against estimation error and the types that will appear during the interval;
  - ``horizon``: hysteresis in the manner of lazy capacity provisioning (Lin et al.,
    INFOCOM 2011; ski rental): a type moves to the fresh plan's channel only when its
    estimated gain per interval times ``horizon`` exceeds its switching cost (one move plus
    the SubscribeInfos it causes); ``horizon = inf`` re-plans every type, ``0`` moves only
    to remove a violation;
  - ``forecast``: the rates planned for: ``last`` (Algorithm 1's estimate), ``ewma``
    (level ``alpha``), ``holt`` (level ``alpha``, trend ``beta``) over the last
    ``memory`` intervals: receding-horizon control on a forecast (Chen et al., 2015).

  Fresh plans have their topics renamed to keep current subscriptions
  (:func:`envs.dsmd.online.relabel_topics`), which changes no cost of Eq. 1. New types, and
  returning ones (seen before, not in the plan), are placed on their first message by
  :func:`place_least_cost` (``replace_returning=False`` keeps a returning type's channel;
  ``reserve_placements=True`` checks them against the plan's reserved capacities, not the
  full ones, so that they do not fill the headroom the plan kept).
* With ``send_forecaster`` (a :class:`envs.dsmd.forecaster.SendForecaster` file) and
  ``drop``, the boundary plan leaves out the types whose probability of sending next
  interval is below ``drop``; those that do send are placed on their first message. The
  forecaster reads a :class:`envs.dsmd.demand.DemandTracker` fed from the view alone.
  Dropping pays with ``reserve_placements``: the dropped types that send are then placed
  inside the reserve (the measurements are in ``docs/online.md``).
* :data:`EXECUTORS` -- the executors a knob policy may name (``KnobMap.executor``, an online
  bundle's metadata), by name: configurations and bundles name an executor, never a module.

It lives in the simulator's package so that the environment, an online bundle and the
policy server run it without the training package; :mod:`agents.online` re-exports it
beside the agents' own online deciders (the static re-planners and the hindsight oracle).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import greedy_kernels as _gk
from .cost import CostState, subscriptions
from .demand import DemandTracker
from .errors import DSMDError
from .forecaster import SendForecaster, TreeEnsemble
from .greedy import GreedyLocalSearch
from .instance import RPC, DSMDInstance
from .online import NewType, OnlineCost, OnlineView, Placement, relabel_topics

__all__ = [
    "DEFAULT_EXECUTOR",
    "EXECUTORS",
    "FILE_ARGS",
    "FORECASTS",
    "OnlineGreedy",
    "executor_class",
    "forecast",
    "place_least_cost",
    "warm_up",
]

FORECASTS = ("last", "ewma", "holt")


def forecast(history: np.ndarray, method: str, alpha: float = 0.5, beta: float = 0.2
             ) -> np.ndarray:
    """Next-interval rates from ``history`` ``[depth, types]`` (oldest first), float64.

    ``last`` is Algorithm 1's estimate; ``ewma`` the exponentially weighted level; ``holt``
    Holt's linear method (level + trend, clipped at 0). A type's level starts at its first
    non-zero estimate in the history (before it, the type did not exist yet: those zeros
    are not observations); zeros after it are."""
    h = np.asarray(history, np.float64)
    if h.shape[0] == 0:
        return np.zeros(h.shape[1])
    if method == "last":
        last: np.ndarray = h[-1].copy()
        return last
    if method not in FORECASTS:
        raise DSMDError(f"forecast must be one of {FORECASTS}, got {method!r}")
    level = np.zeros(h.shape[1])
    trend = np.zeros_like(level)
    seen = np.zeros(h.shape[1], bool)
    for x in h:
        start = ~seen & (x > 0)
        prev = level
        if method == "ewma":
            level = np.where(seen, alpha * x + (1 - alpha) * level, 0.0)
        else:
            level = np.where(seen, alpha * x + (1 - alpha) * (level + trend), 0.0)
            trend = np.where(seen, beta * (level - prev) + (1 - beta) * trend, 0.0)
        level = np.where(start, x, level)
        seen |= start
    out: np.ndarray = np.maximum(level + trend, 0.0)
    return out


def place_least_cost(placement: Placement, new: NewType, cost: OnlineCost,
                     headroom: float = 0.0) -> int:
    """A new or returning type's channel from the expected load: among the channels that
    keep every expected load within capacity (``(1 - headroom)`` of it: the plan's
    reserve), the least ``added node traffic / necessary traffic + w_subscribe * new
    subscriptions (+ w_move off a returning type's channel)`` (RPC on ties); if none fits,
    the least added violation, then that score, among RPC and the four best topics."""
    delta, fresh = placement.costs()
    nec = max(placement.necessary_bps + new.rate_bps * new.destinations.size, 1)
    score = delta / nec + cost.w_subscribe * fresh
    if new.previous_channel >= 0:  # a returning type: leaving its channel is a move
        score = score + cost.w_move
        score[new.previous_channel] -= cost.w_move
    return placement.choose(score, fallback=4, headroom=headroom)


class OnlineGreedy:
    """Greedy with headroom, hysteresis (``horizon``) and a forecaster (module docstring)."""

    KNOBS = ("headroom", "horizon", "forecast", "alpha", "beta")

    def __init__(self, headroom: float = 0.0, horizon: float = math.inf,
                 forecast: str = "last", alpha: float = 0.5, beta: float = 0.2,
                 memory: int = 4, cost: OnlineCost | None = None,
                 relabel: bool = True, local_search_passes: int = 2,
                 time_limit_s: float = 30.0, replace_returning: bool = True,
                 reserve_placements: bool = False, send_forecaster: str | None = None,
                 drop: float = 0.0, name: str | None = None) -> None:
        if int(memory) < 1:
            raise DSMDError(f"memory must be >= 1 interval, got {memory}")
        self._memory = int(memory)
        self.set_knobs(headroom=headroom, horizon=horizon, forecast=forecast, alpha=alpha,
                       beta=beta)
        self.cost = cost or OnlineCost()
        self.relabel = relabel
        self.replace_returning = bool(replace_returning)
        self.reserve_placements = bool(reserve_placements)
        if not 0.0 <= drop < 1.0:
            raise DSMDError(f"drop must be in [0, 1), got {drop}")
        if drop > 0 and send_forecaster is None:
            raise DSMDError("drop needs a send_forecaster (the probabilities it thresholds)")
        self.send_forecaster, self.drop = send_forecaster, float(drop)
        self._forecaster = None if send_forecaster is None else \
            SendForecaster.load(send_forecaster)
        self._demand = DemandTracker()
        self.greedy = GreedyLocalSearch(local_search_passes=local_search_passes,
                                        time_limit_s=time_limit_s)
        self.name = name or "online_greedy"

    def knobs(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.KNOBS}

    def set_knobs(self, headroom: float = 0.0, horizon: float = math.inf,
                  forecast: str = "last", alpha: float = 0.5, beta: float = 0.2) -> None:
        """Set the knobs (:attr:`KNOBS`; the others are left as they are): a knob policy
        sets them at every boundary of one executor, whose demand tracker and forecaster
        live for the episode."""
        if not 0.0 <= headroom < 1.0:
            raise DSMDError(f"headroom must be in [0, 1), got {headroom}")
        if horizon < 0:
            raise DSMDError(f"horizon must be >= 0, got {horizon}")
        if forecast not in FORECASTS:
            raise DSMDError(f"forecast must be one of {FORECASTS}, got {forecast!r}")
        if not (0 < alpha <= 1 and 0 <= beta <= 1):
            raise DSMDError(f"alpha must be in (0, 1] and beta in [0, 1], got {alpha}, {beta}")
        self.headroom, self.horizon = float(headroom), float(horizon)
        self.forecast, self.alpha, self.beta = forecast, float(alpha), float(beta)
        self.memory = 1 if forecast == "last" else max(self._memory, 2)

    def reset(self, seed: int | None = None) -> None:
        self._demand.reset()

    # ------------------------------------------------------------------ boundary
    def _expected(self, view: OnlineView) -> tuple[np.ndarray, np.ndarray]:
        known = view.known_types()
        hist = view.history(known, self.memory)
        f = forecast(hist, self.forecast, self.alpha, self.beta)
        keep = (f >= 0.5) | (hist[-1] > 0)
        if self._forecaster is not None and self.drop > 0:  # unlikely senders: placed later
            rows = known[keep]  # only the candidates are scored (the trees are the cost)
            p = self._forecaster.probability(self._demand.at(view).features()[rows])
            keep[keep] = p >= self.drop
        return known[keep], np.maximum(np.rint(f[keep]), 1).astype(np.int64)

    def plan(self, view: OnlineView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        types, rates = self._expected(view)
        if types.size == 0:
            return types, types.copy(), rates
        return types, self._decide(view, view.instance(types, rates), view.channel(types)), rates

    def _decide(self, view: OnlineView, inst: DSMDInstance, current: np.ndarray) -> np.ndarray:
        plan_inst = inst.reserved(self.headroom)
        fresh = self.greedy.assign(plan_inst)
        have = current >= 0
        if self.relabel and inst.num_topics and have.any():
            fresh = self._relabel(plan_inst, fresh, np.where(have, current, RPC))
        if math.isinf(self.horizon) or not have.any():
            return fresh
        return self._lazy(plan_inst, fresh, np.where(have, current, fresh))

    @staticmethod
    def _relabel(inst: DSMDInstance, fresh: np.ndarray, current: np.ndarray) -> np.ndarray:
        out: np.ndarray = relabel_topics(subscriptions(inst, fresh),
                                         subscriptions(inst, current))[fresh]
        return out

    def _lazy(self, inst: DSMDInstance, fresh: np.ndarray, start: np.ndarray) -> np.ndarray:
        """From the current channels, take the fresh plan's channel type by type when it pays
        within ``horizon`` intervals (or removes violation)."""
        st = CostState(inst, start)
        cfg = self.cost
        order = np.argsort(-(inst.rate_bps * inst.fanout), kind="stable")
        arrays = st.kernel_arrays()
        _gk.lazy_switch(np.asarray(fresh, np.int64), order, max(int(inst.necessary_bps), 1),
                        float(self.horizon), float(cfg.plan_violation_price), float(cfg.w_move),
                        float(cfg.w_subscribe), 2, arrays)
        st.sync_scalars(arrays[6])
        return st.channel.copy()

    # ------------------------------------------------------------------ new types
    def place(self, view: OnlineView, new: NewType, placement: Placement) -> int:
        if new.previous_channel >= 0 and not self.replace_returning:
            return new.previous_channel
        return place_least_cost(placement, new, self.cost,
                                self.headroom if self.reserve_placements else 0.0)


#: the executor arguments whose value is a file, and the file's name where it is copied (an
#: online bundle): a setting's name shows the file's name, the evaluation cache keys on its
#: content, training makes its path absolute and the bundle exporter copies it
FILE_ARGS = {"send_forecaster": "send_forecaster.npz"}
#: the executors a knob policy may name (``KnobMap.executor``), by name
EXECUTORS: dict[str, type[OnlineGreedy]] = {"online_greedy": OnlineGreedy}
#: the executor of a knob policy that names none
DEFAULT_EXECUTOR = "online_greedy"
#: the classes of :data:`EXECUTORS`, for the ``module:Class`` import paths that older online
#: bundles and configurations stored: read by the class name alone, never imported
_BY_CLASS = {cls.__name__: name for name, cls in EXECUTORS.items()}


def executor_class(name: str) -> type[OnlineGreedy]:
    """The executor named ``name`` (:data:`EXECUTORS`); an import path ``module:Class``
    (what older bundles stored) is read as the name of its class, never imported."""
    key = _BY_CLASS.get(name.rpartition(":")[2], name) if ":" in name else name
    cls = EXECUTORS.get(key)
    if cls is None:
        raise DSMDError(f"unknown executor {name!r}; known: {sorted(EXECUTORS)}")
    return cls


def warm_up() -> None:
    """Compile (or load from numba's on-disk cache) every compiled loop of the planner
    (:mod:`envs.dsmd.greedy_kernels`, and the send forecaster's trees) on a three-type
    instance, so that the first real
    interval does not pay for it: the policy server calls this while starting, after
    :func:`envs.dsmd.kernels.warm_up` (the cost state and the placement what-ifs). Loading
    from the cache is much faster than compiling on a fresh install."""
    inst = DSMDInstance(num_nodes=3, num_topics=2,
                        node_capacity_bps=np.full(3, 100, np.int64), controller_bw_bps=30,
                        controller_cpu=3, rate_bps=np.array([5, 7, 9], np.int64),
                        dest_ptr=np.array([0, 2, 3, 5], np.int64),
                        dest_idx=np.array([0, 1, 2, 0, 2], np.int64))
    fresh = GreedyLocalSearch(local_search_passes=1).assign(inst)
    current = np.array([RPC, 1, 2], np.int64)
    OnlineGreedy._relabel(inst, fresh, current)
    OnlineGreedy(horizon=1.0)._lazy(inst, fresh, current)
    z = np.zeros(1, np.int64)  # the send forecaster's trees: one leaf
    TreeEnsemble(0.0, z, z, np.zeros(1), np.zeros(1, bool), z, z, np.ones(1, bool),
                 np.zeros(1), 1).raw(np.zeros((1, 1)))
