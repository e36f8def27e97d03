"""The one policy interface shared by evaluation, the environment, serving and delivery.

A policy maps a DSMD instance to an assignment (channel per type: 0 = RPC, t = topic t).
Sequential policies decide one type at a time from the current :class:`CostState`, in
the same order the environment uses, so a learned actor and a heuristic are driven alike.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from envs.dsmd.cost import CostState
from envs.dsmd.env import decision_order
from envs.dsmd.instance import DSMDInstance

__all__ = ["Policy", "SequentialPolicy", "PolicyError"]


class PolicyError(RuntimeError):
    """A policy could not produce an assignment (e.g. an instance too large to solve)."""


class Policy(ABC):
    """Assigns a channel to every message type of an instance."""

    name: str = "policy"

    def reset(self, seed: int | None = None) -> None:
        """Forget state carried across instances (e.g. Alcor's hysteresis)."""

    @abstractmethod
    def assign(self, inst: DSMDInstance) -> np.ndarray:
        """Channel of every type (int64, values in 0..K)."""

    def info(self) -> dict:
        """Extra facts about the last ``assign`` (solver status, bounds, ...)."""
        return {}


class SequentialPolicy(Policy):
    """A policy that decides types one by one (largest f|D| first, as the env does)."""

    order: str = "rate_desc"

    @abstractmethod
    def decide(self, state: CostState, m: int) -> int:
        """Channel for unassigned type ``m`` given the current partial assignment."""

    def assign(self, inst: DSMDInstance) -> np.ndarray:
        state = CostState(inst)
        for m in decision_order(inst, self.order, np.random.default_rng(0)):
            state.move(int(m), self.decide(state, int(m)))
        return state.channel.copy()
