"""Which message types will send in the next interval: intermittent-demand state per type,
the classical forecasts of it, and the features of the learned forecaster.

At an interval boundary a type that exists (its first message is in the past) either sends
in the next interval or stays silent; on ``godaddy_online`` about a third of the known types
send in a given interval, half of those that sent in the one before and a quarter of those
that did not. The online planner's gap to its hindsight oracle is almost all this
(``docs/online.md``), so this module forecasts, per type, the probability that it sends.

:class:`DemandState` is updated once per interval with what the interval realised (which
types sent, and their Algorithm 1 rates) and holds, per type:

* the occurrence level of TSB (Teunter, Syntetos and Babai, EJOR 2011): an exponentially
  weighted mean of the send indicator, updated every interval, at several smoothing
  constants (:data:`TSB_ALPHAS`); it is the probability forecast of TSB;
* Croston's (Croston, ORQ 1972) inter-demand interval level ``q`` (updated when the type
  sends): the probability forecast ``1 / q``; SBA (Syntetos and Boylan, IJF 2005) corrects
  Croston's demand rate by ``1 - alpha / 2``: ``(1 - alpha / 2) / q``;
* the last :data:`LAGS` send indicators, the intervals since it last sent, its age, its share
  of intervals with traffic, its last rate and its rate level: the exponentially weighted
  mean of its log rate over the intervals it sent in, at several constants
  (:data:`RATE_ALPHAS`; at ``CROSTON_ALPHA`` it is Croston's demand-size level);

and, per VPC, the share of its known types that sent in the last interval and the one
before (a VPC that wakes up wakes its types). :meth:`DemandState.features` is one row per
type of what a learned model reads; the same object serves the offline panels
(:func:`demand_panel`) and a live controller, so what is trained on is what is served.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .errors import DSMDError

if TYPE_CHECKING:
    from .online import OnlineTrace, OnlineView

__all__ = [
    "CROSTON_ALPHA",
    "FEATURES",
    "LAGS",
    "RATE_ALPHAS",
    "TSB_ALPHAS",
    "DemandPanel",
    "DemandState",
    "DemandTracker",
    "demand_panel",
    "trace_panel",
]

LAGS = 4
TSB_ALPHAS = (0.1, 0.3, 0.5)
CROSTON_ALPHA = 0.2
RATE_ALPHAS = (0.2, 0.5, 0.8)  # the log-rate levels; 0.5's is a feature (log_rate_level)
_CAP = 60.0  # intervals: longer gaps and ages carry no more information here

FEATURES: tuple[str, ...] = (
    *(f"sent_lag{k}" for k in range(1, LAGS + 1)),
    "log_since_last", "log_age", "sent_share",
    *(f"tsb_{a}" for a in TSB_ALPHAS),
    "croston_p", "log_last_rate", "log_rate_level", "log_destinations",
    "vpc_sent_share", "vpc_sent_share_prev", "vpc_types_log",
)


class DemandState:
    """Intermittent-demand state of ``num_types`` types (module docstring), updated once per
    interval by :meth:`update`; a type enters at its first interval with traffic.

    ``vpc`` (per type: its VPC's index) and ``destinations`` (per type: how many nodes it
    reaches) are static attributes of the type catalogue."""

    def __init__(self, vpc: np.ndarray, destinations: np.ndarray) -> None:
        self.vpc = np.asarray(vpc, np.int64)
        self.destinations = np.asarray(destinations, np.float64)
        if self.vpc.ndim != 1 or self.vpc.shape != self.destinations.shape:
            raise DSMDError(f"vpc {self.vpc.shape} and destinations "
                            f"{self.destinations.shape} must be one value per type")
        m = self.vpc.size
        self._vpcs = int(self.vpc.max()) + 1 if m else 0
        self.known = np.zeros(m, bool)
        self.lags = np.zeros((LAGS, m))  # row 0: the last interval
        self.since = np.zeros(m)
        self.age = np.zeros(m)
        self.count = np.zeros(m)
        self.tsb = np.zeros((len(TSB_ALPHAS), m))
        self.interval = np.ones(m)
        self.last_rate = np.zeros(m)
        self.rate_levels = np.zeros((len(RATE_ALPHAS), m))
        self.vpc_share = np.zeros(self._vpcs)
        self.vpc_share_prev = np.zeros(self._vpcs)
        self.vpc_types = np.zeros(self._vpcs)

    @property
    def num_types(self) -> int:
        return int(self.vpc.size)

    def grow(self, vpc: np.ndarray, destinations: np.ndarray) -> None:
        """Append types (a live catalogue grows): their VPC indices and destination counts;
        they enter unknown, as every type does until its first interval with traffic."""
        vpc = np.asarray(vpc, np.int64)
        dest = np.asarray(destinations, np.float64)
        if vpc.ndim != 1 or vpc.shape != dest.shape:
            raise DSMDError(f"vpc {vpc.shape} and destinations {dest.shape} must be one "
                            f"value per type")
        k = vpc.size
        if k == 0:
            return
        self.vpc = np.concatenate([self.vpc, vpc])
        self.destinations = np.concatenate([self.destinations, dest])
        self.known = np.concatenate([self.known, np.zeros(k, bool)])
        for name in ("since", "age", "count", "last_rate"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(k)]))
        self.interval = np.concatenate([self.interval, np.ones(k)])
        for name in ("lags", "tsb", "rate_levels"):
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.zeros((a.shape[0], k))], axis=1))
        vpcs = int(self.vpc.max()) + 1
        if vpcs > self._vpcs:
            grow = vpcs - self._vpcs
            self.vpc_share = np.concatenate([self.vpc_share, np.zeros(grow)])
            self.vpc_share_prev = np.concatenate([self.vpc_share_prev, np.zeros(grow)])
            self.vpc_types = np.concatenate([self.vpc_types, np.zeros(grow)])
            self._vpcs = vpcs

    def update(self, sent: np.ndarray, rates: np.ndarray) -> None:
        """Record one interval: ``sent`` (bool per type) and the rates of those that sent
        (bytes/s, Algorithm 1's estimate; ignored where ``sent`` is false)."""
        sent = np.asarray(sent, bool)
        if sent.shape != (self.num_types,):
            raise DSMDError(f"sent has shape {sent.shape}, expected ({self.num_types},)")
        new = sent & ~self.known
        old = self.known  # known before this interval: the types the update observes
        x = sent.astype(np.float64)
        self.lags[1:] = self.lags[:-1]
        self.lags[0] = np.where(old | new, x, 0.0)
        for i, a in enumerate(TSB_ALPHAS):
            self.tsb[i] = np.where(new, 1.0, np.where(old, a * x + (1 - a) * self.tsb[i], 0.0))
        # Croston's interval: on a send, q <- q + alpha (gap - q), the gap counted in
        # intervals since the previous send
        gap = self.since + 1.0
        upd = sent & old
        self.interval = np.where(upd, self.interval + CROSTON_ALPHA * (gap - self.interval),
                                 np.where(new, 1.0, self.interval))
        self.since = np.where(sent, 0.0, np.where(old, self.since + 1.0, 0.0))
        self.age = np.where(old, self.age + 1.0, 0.0)
        self.count += x
        r = np.log1p(np.maximum(np.asarray(rates, np.float64), 0.0))
        self.last_rate = np.where(sent, r, self.last_rate)
        for i, a in enumerate(RATE_ALPHAS):
            self.rate_levels[i] = np.where(new, r, np.where(
                upd, a * r + (1 - a) * self.rate_levels[i], self.rate_levels[i]))
        self.known = old | new
        known_per_vpc = np.bincount(self.vpc[self.known], minlength=self._vpcs)
        sent_per_vpc = np.bincount(self.vpc[sent], minlength=self._vpcs)
        self.vpc_share_prev = self.vpc_share
        self.vpc_share = sent_per_vpc / np.maximum(known_per_vpc, 1)
        self.vpc_types = known_per_vpc.astype(np.float64)

    @property
    def rate_level(self) -> np.ndarray:
        """The log-rate level at 0.5 (the feature ``log_rate_level``)."""
        level: np.ndarray = self.rate_levels[RATE_ALPHAS.index(0.5)]
        return level

    # ------------------------------------------------------------------ forecasts
    def tsb_p(self, alpha: float) -> np.ndarray:
        """TSB's probability that each type sends next interval (its occurrence level)."""
        if alpha not in TSB_ALPHAS:
            raise DSMDError(f"TSB alpha must be one of {TSB_ALPHAS}, got {alpha}")
        p: np.ndarray = self.tsb[TSB_ALPHAS.index(alpha)].copy()
        return p

    def croston_p(self, sba: bool = False) -> np.ndarray:
        """Croston's demand-occurrence probability ``1 / q`` (SBA: times
        ``1 - alpha / 2``)."""
        p = 1.0 / np.maximum(self.interval, 1.0)
        return p * (1.0 - CROSTON_ALPHA / 2.0) if sba else p

    def features(self) -> np.ndarray:
        """``[num_types, len(FEATURES)]`` float32: what the learned forecaster reads, from
        the past only (rows of unknown types are meaningless)."""
        age = np.minimum(self.age, _CAP)
        cols = [*self.lags,
                np.log1p(np.minimum(self.since, _CAP)), np.log1p(age),
                self.count / np.maximum(self.age + 1.0, 1.0),
                *self.tsb, self.croston_p(), self.last_rate, self.rate_level,
                np.log1p(self.destinations),
                self.vpc_share[self.vpc], self.vpc_share_prev[self.vpc],
                np.log1p(self.vpc_types[self.vpc])]
        return np.stack(cols, axis=1).astype(np.float32)


@dataclass(frozen=True)
class DemandPanel:
    """The forecasting problem of one trace: one row per (boundary, known type).

    ``window[i]`` is the interval forecast, ``type_id[i]`` the type, ``x[i]`` its
    features at that boundary, ``y[i]`` whether it sent, ``rate[i]`` its rate if it did
    (Algorithm 1's estimate, else 0), ``baselines`` the classical forecasts of sending
    (name -> probability) and ``rate_baselines`` the classical point forecasts of
    ``log1p(rate)`` if it sends: ``last`` (its last rate) and ``ewma_<alpha>`` (its
    log-rate levels, :data:`RATE_ALPHAS`)."""

    window: np.ndarray
    type_id: np.ndarray
    x: np.ndarray
    y: np.ndarray
    rate: np.ndarray
    baselines: dict[str, np.ndarray]
    rate_baselines: dict[str, np.ndarray]


def demand_panel(sent: np.ndarray, rates: np.ndarray, vpc: np.ndarray,
                 destinations: np.ndarray, start: int = 1) -> DemandPanel:
    """Every boundary from ``start`` on of a trace's ``sent`` ``[W, M]`` (bool) and
    ``rates`` ``[W, M]``, through one :class:`DemandState` (so exactly what a live
    controller computes)."""
    sent = np.asarray(sent, bool)
    if sent.ndim != 2 or np.shape(rates) != sent.shape:
        raise DSMDError(f"sent {sent.shape} and rates {np.shape(rates)} must be [W, M]")
    state = DemandState(vpc, destinations)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in
                                          ("window", "type", "x", "y", "rate", "last",
                                           "croston", "sba", *(f"tsb_{a}" for a in TSB_ALPHAS),
                                           "rate_last", *(f"ewma_{a}" for a in RATE_ALPHAS))}
    for w in range(sent.shape[0]):
        if w >= start:
            idx = np.flatnonzero(state.known)
            parts["window"].append(np.full(idx.size, w, np.int64))
            parts["type"].append(idx)
            parts["x"].append(state.features()[idx])
            parts["y"].append(sent[w, idx])
            parts["rate"].append(np.where(sent[w, idx], rates[w, idx], 0.0))
            parts["last"].append(state.lags[0][idx])
            parts["croston"].append(state.croston_p()[idx])
            parts["sba"].append(state.croston_p(sba=True)[idx])
            for a in TSB_ALPHAS:
                parts[f"tsb_{a}"].append(state.tsb_p(a)[idx])
            parts["rate_last"].append(state.last_rate[idx])
            for i, a in enumerate(RATE_ALPHAS):
                parts[f"ewma_{a}"].append(state.rate_levels[i][idx])
        state.update(sent[w], rates[w])
    cat = {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in parts.items()}
    x = cat["x"].reshape(-1, len(FEATURES)).astype(np.float32)
    names = ("last", "croston", "sba", *(f"tsb_{a}" for a in TSB_ALPHAS))
    return DemandPanel(cat["window"].astype(np.int64), cat["type"].astype(np.int64), x,
                       cat["y"].astype(bool), cat["rate"].astype(np.float64),
                       {k: cat[k].astype(np.float64) for k in names},
                       {"last": cat["rate_last"].astype(np.float64),
                        **{f"ewma_{a}": cat[f"ewma_{a}"].astype(np.float64)
                           for a in RATE_ALPHAS}})


def trace_panel(trace: OnlineTrace, start: int = 1) -> DemandPanel:
    """:func:`demand_panel` of a parsed trace: its per-interval message counts and
    Algorithm 1 rates, its types' VPCs and destination counts."""
    p = trace.parsed
    rates = np.stack([trace.rates(w) for w in range(trace.num_windows)]).astype(np.float64)
    vpc = np.unique(np.asarray(p.catalog.vpc, np.int64), return_inverse=True)[1]
    dest = np.array([d.size for d in p.catalog.destinations], np.float64)
    return demand_panel(p.messages > 0, rates, vpc, dest, start)


class DemandTracker:
    """A :class:`DemandState` kept in step with an online decider's boundaries: at each
    boundary, :meth:`at` takes in the types that became known and the intervals since the
    last call, from the :class:`envs.dsmd.online.OnlineView` alone (a type sent in an
    interval when its rate estimate there is positive, as ``trace_panel`` counts it), and
    returns the state. A boundary earlier than the last one starts over (a new episode).
    VPC ids are mapped to dense indices in order of appearance (the features depend only on
    which types share a VPC)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.state = DemandState(np.zeros(0, np.int64), np.zeros(0))
        self.window = 0
        self._vpc: dict[int, int] = {}

    def at(self, view: OnlineView) -> DemandState:
        if view.window < self.window:
            self.reset()
        known = view.known_types()
        m = self.state.num_types
        if known.size != (int(known[-1]) + 1 if known.size else 0):
            raise DSMDError("demand tracker: the known types must be 0..k-1 (types are "
                            "numbered in order of their first message)")
        if known.size > m:
            new = known[m:]
            raw = view.vpcs(new)
            dense = np.array([self._vpc.setdefault(int(v), len(self._vpc)) for v in raw],
                             np.int64)
            dest = np.array([view.destinations(int(t)).size for t in new], np.float64)
            self.state.grow(dense, dest)
        depth = view.window - self.window
        if depth > 0 and known.size:  # no known type: nothing to update
            for row in view.history(known, depth):
                self.state.update(row > 0, row.astype(np.float64))
        self.window = view.window
        return self.state
