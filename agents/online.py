"""Online deciders for :mod:`envs.dsmd.online`: the baselines an expert would deploy.

* :class:`StaticReplan` -- any static policy (RPC, VITA, IDCS, Alcor AUTO, greedy) applied
  at every boundary to the last interval's estimates (Algorithm 1), re-planned from scratch;
  new types get the policy's own rule (greedy: :func:`place_least_cost`).
* :class:`OnlineGreedy` -- greedy + local search with the three knobs of an online expert
  (headroom, hysteresis, forecast): the executor of :mod:`envs.dsmd.online_greedy`,
  re-exported here with :func:`forecast` and :func:`place_least_cost`.
* :class:`HindsightGreedy` -- the greedy oracle: the same machinery given the interval's
  realised instance (every type, new ones included, at its realised rate).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from envs.dsmd.errors import DSMDError
from envs.dsmd.greedy import GreedyLocalSearch
from envs.dsmd.instance import UNASSIGNED, DSMDInstance
from envs.dsmd.online import NewType, OnlineCost, OnlineView, Placement
from envs.dsmd.online_greedy import FORECASTS, OnlineGreedy, forecast, place_least_cost
from envs.dsmd.policy import Policy
from envs.dsmd.scenarios import ScenarioSpec
from envs.dsmd.topology import Topology

from .registry import make_policy_for

__all__ = [
    "FORECASTS",
    "HindsightGreedy",
    "OnlineGreedy",
    "StaticReplan",
    "forecast",
    "make_static",
    "place_least_cost",
]


def _one_type_instance(view: OnlineView, new: NewType) -> DSMDInstance:
    s = view.spec
    return DSMDInstance.from_sets([new.destinations], [new.rate_bps], view.node_capacity_bps,
                                  s.num_topics, s.controller_bw_bps, s.controller_cpu,
                                  num_nodes=view.num_nodes,
                                  vpc=np.array([new.vpc], np.int64),
                                  config=np.array([new.config], np.int8),
                                  catalog_index=np.array([new.type_id], np.int64),
                                  interval_s=view.interval_s)


class StaticReplan:
    """A static policy re-applied at every boundary to the last interval's estimates."""

    def __init__(self, policy: Policy, cost: OnlineCost | None = None,
                 least_cost_placement: bool | None = None, name: str | None = None) -> None:
        self.policy = policy
        self.cost = cost or OnlineCost()
        self.name = name or policy.name
        self.least_cost = (isinstance(policy, GreedyLocalSearch) if least_cost_placement is None
                           else least_cost_placement)

    def reset(self, seed: int | None = None) -> None:
        self.policy.reset(seed)

    def plan(self, view: OnlineView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        known = view.known_types()
        last = view.history(known, 1)[0]
        types = known[last > 0]
        if types.size == 0:
            return types, types.copy(), types.copy()
        rates = last[last > 0]
        return types, self.policy.assign(view.instance(types, rates)), rates

    def place(self, view: OnlineView, new: NewType, placement: Placement) -> int:
        if self.least_cost:
            return place_least_cost(placement, new, self.cost)
        return int(self.policy.assign(_one_type_instance(view, new))[0])


class HindsightGreedy(OnlineGreedy):
    """The greedy oracle: plans each interval on its realised instance (run it in a
    hindsight simulator); ``horizon`` and ``headroom`` as in :class:`OnlineGreedy` (under a
    delay cost a full link is slow, so the oracle plans with a reserve too)."""

    def __init__(self, horizon: float = math.inf, cost: OnlineCost | None = None,
                 name: str | None = None, headroom: float = 0.0, **kw: Any) -> None:
        super().__init__(headroom=headroom, horizon=horizon, cost=cost,
                         name=name or "oracle_greedy", **kw)

    def plan(self, view: OnlineView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        inst = view.realised()
        types = inst.catalog_index
        current = _channels_or_unassigned(view, types)
        return types, self._decide(view, inst, current), inst.rate_bps


def _channels_or_unassigned(view: OnlineView, types: np.ndarray) -> np.ndarray:
    """Current channels of ``types`` where known (hindsight: new types are unassigned)."""
    known = np.isin(types, view.known_types())
    out = np.full(types.size, UNASSIGNED, np.int64)
    out[known] = view.channel(types[known])
    return out


def make_static(name: str, spec: ScenarioSpec, topology: Topology, cost: OnlineCost,
                params: Mapping[str, Any] | None = None) -> StaticReplan:
    """A static policy of :mod:`agents.registry` (``rpc``, ``vita``, ``idcs``, ``alcor``,
    ``greedy``) re-planned every interval."""
    if name == "exact":
        raise DSMDError("the exact solver is no online policy; the hindsight bound is "
                        "agents.exact_online")
    try:
        pol = make_policy_for(name, spec, topology, params)
    except KeyError as e:
        raise DSMDError(str(e.args[0])) from None
    return StaticReplan(pol, cost, name=name)
