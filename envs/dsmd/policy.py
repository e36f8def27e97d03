"""The one policy interface shared by evaluation, the environment, serving and delivery.

A policy maps a DSMD instance to an assignment (channel per type: 0 = RPC, t = topic t).
A learned actor decides one type at a time exactly as inside the environment
(:class:`agents.learned.ActorPolicy`); heuristics and the exact solver assign whole
instances. The interface lives beside the instance it reads, so that the simulator's own
planners (:mod:`envs.dsmd.greedy`) implement it without the training package;
:mod:`agents.policy` re-exports it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from .instance import DSMDInstance

__all__ = ["Policy", "PolicyError", "vpc_topic"]


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


def vpc_topic(vpc: np.ndarray, num_topics: int) -> np.ndarray:
    """VITA's topic of a VPC: ``1 + (vpc - 1) mod K`` (VPC ids start at 1)."""
    if num_topics <= 0:
        raise PolicyError("this policy needs at least one MQ topic (K >= 1)")
    return 1 + (np.asarray(vpc, dtype=np.int64) - 1) % num_topics
