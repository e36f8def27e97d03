"""Typed error of the multicast sub-problem (Optimal Multicast, Zhu et al.). Each names
what is wrong."""

from __future__ import annotations

__all__ = ["MulticastError"]


class MulticastError(ValueError):
    """Bad input to the multicast model, solver or environment (the message says what and
    where)."""
