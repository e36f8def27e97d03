"""The one policy interface shared by evaluation, the environment, serving and delivery.

A policy maps a DSMD instance to an assignment (channel per type: 0 = RPC, t = topic t).
A learned actor decides one type at a time exactly as inside the environment
(:class:`agents.learned.ActorPolicy`); heuristics and the exact solver assign whole instances.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from envs.dsmd.instance import DSMDInstance

__all__ = ["Policy", "PolicyError"]


class PolicyError(RuntimeError):
    """A policy could not produce an assignment (e.g. an instance too large to solve)."""


class Policy(ABC):
    """Assigns a channel to every message type of an instance."""

    name: str = "policy"

    def reset(self, seed: int | None = None) -> None:  # noqa: B027 a no-op default, not abstract: stateless policies do not override it
        """Forget state carried across instances (e.g. Alcor's hysteresis)."""

    @abstractmethod
    def assign(self, inst: DSMDInstance) -> np.ndarray:
        """Channel of every type (int64, values in 0..K)."""

    def info(self) -> dict:
        """Extra facts about the last ``assign`` (solver status, bounds, ...)."""
        return {}
