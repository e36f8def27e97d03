"""Build policies by name from configuration (one place, used by every entry point)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from envs.dsmd.problems import ProblemSet

from .baselines import IDCS, VITA, AlcorAuto, RPCOnly
from .exact import ExactMILP
from .greedy import GreedyLocalSearch
from .policy import Policy

__all__ = ["POLICIES", "make_policy", "make_policies"]


def _alcor(ps: ProblemSet, p: Mapping[str, Any]) -> Policy:
    extra = ps.spec.extra
    return AlcorAuto(ps.dataset.topology.vpc_ports(),
                     upper=int(p.get("upper") or extra.get("alcor_upper", 1000)),
                     lower=int(p.get("lower") or extra.get("alcor_lower", 100)))


POLICIES: dict[str, Callable[[ProblemSet, Mapping[str, Any]], Policy]] = {
    "rpc": lambda ps, p: RPCOnly(),
    "vita": lambda ps, p: VITA(),
    "idcs": lambda ps, p: IDCS(),
    "alcor": _alcor,
    "greedy": lambda ps, p: GreedyLocalSearch(**dict(p)),
    "exact": lambda ps, p: ExactMILP(**dict(p)),
}


def make_policy(name: str, ps: ProblemSet, params: Mapping[str, Any] | None = None) -> Policy:
    if name not in POLICIES:
        raise KeyError(f"unknown policy '{name}'; known: {', '.join(POLICIES)}")
    return POLICIES[name](ps, params or {})


def make_policies(names, ps: ProblemSet, params: Mapping[str, Mapping] | None = None
                  ) -> list[Policy]:
    params = params or {}
    return [make_policy(n, ps, params.get(n)) for n in names]
