"""Typed errors of the DSMD simulator. Each names what is wrong and where."""

from __future__ import annotations

from pathlib import Path

__all__ = ["DSMDError", "TraceError", "TopologyError", "InstanceError"]


class DSMDError(ValueError):
    """Base class: bad input to the DSMD simulator."""


class TraceError(DSMDError):
    """A malformed or inconsistent trace.

    Attributes ``path``, ``row`` (0-based row of ``messages.parquet``, or None for a
    whole-column problem) and ``field`` say where; the message says what.
    """

    def __init__(self, path: str | Path | None, field: str | None, problem: str,
                 row: int | None = None) -> None:
        self.path = None if path is None else str(path)
        self.row = row
        self.field = field
        self.problem = problem
        where = [self.path or "<in-memory trace>"]
        if row is not None:
            where.append(f"row {row}")
        if field is not None:
            where.append(f"field '{field}'")
        super().__init__(f"{', '.join(where)}: {problem}")


class TopologyError(DSMDError):
    """A malformed topology (nodes / VM placement)."""


class InstanceError(DSMDError):
    """An inconsistent DSMD instance or assignment."""
