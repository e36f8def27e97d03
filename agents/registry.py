"""Build policies by name from configuration (one place, used by every entry point)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from envs.dsmd.problems import ProblemSet
from envs.dsmd.scenarios import ScenarioSpec
from envs.dsmd.topology import Topology

from .baselines import IDCS, VITA, AlcorAuto, RPCOnly
from .exact import ExactMILP
from .greedy import GreedyLocalSearch
from .policy import Policy

__all__ = ["POLICIES", "make_policies", "make_policy", "make_policy_for"]


def _alcor(spec: ScenarioSpec, topology: Topology, p: Mapping[str, Any]) -> Policy:
    extra = spec.extra
    return AlcorAuto(topology.vpc_ports(),
                     upper=int(p.get("upper") or extra.get("alcor_upper", 1000)),
                     lower=int(p.get("lower") or extra.get("alcor_lower", 100)))


PolicyFactory = Callable[[ScenarioSpec, Topology, Mapping[str, Any]], Policy]

POLICIES: dict[str, PolicyFactory] = {
    "rpc": lambda s, t, p: RPCOnly(),
    "vita": lambda s, t, p: VITA(),
    "idcs": lambda s, t, p: IDCS(),
    "alcor": _alcor,
    "greedy": lambda s, t, p: GreedyLocalSearch(**dict(p)),
    "exact": lambda s, t, p: ExactMILP(**dict(p)),
}


def make_policy_for(name: str, spec: ScenarioSpec, topology: Topology,
                    params: Mapping[str, Any] | None = None) -> Policy:
    """The policy ``name`` for a scenario (its ``extra`` parameters) and topology."""
    if name not in POLICIES:
        raise KeyError(f"unknown policy '{name}'; known: {', '.join(POLICIES)}")
    return POLICIES[name](spec, topology, params or {})


def make_policy(name: str, ps: ProblemSet, params: Mapping[str, Any] | None = None) -> Policy:
    return make_policy_for(name, ps.spec, ps.dataset.topology, params)


def make_policies(names, ps: ProblemSet, params: Mapping[str, Mapping] | None = None
                  ) -> list[Policy]:
    params = params or {}
    return [make_policy(n, ps, params.get(n)) for n in names]
