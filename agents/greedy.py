"""The static baseline ``greedy``: greedy construction plus local search
(:class:`envs.dsmd.greedy.GreedyLocalSearch`, defined beside the cost model because the
online executor plans with it), re-exported for the agents."""

from __future__ import annotations

from envs.dsmd.greedy import GreedyLocalSearch, violation

__all__ = ["GreedyLocalSearch", "violation"]
