"""Typed errors of the DSMD simulator. Each names what is wrong and where."""

from __future__ import annotations

from pathlib import Path

__all__ = ["DSMDError", "DatasetError", "InstanceError", "TopologyError", "TraceError"]


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


class DatasetError(DSMDError):
    """A malformed or inconsistent trace dataset (its ``manifest.json`` or a trace it lists).

    Attributes ``path`` (the manifest or file), ``trace`` (trace id), ``field`` (manifest
    field), ``file`` (a trace's file the field is about) and ``problem`` say where and what,
    for example ``x/manifest.json: trace 'x-007', field 'sha256' of messages.parquet: does
    not match the file``.
    """

    def __init__(self, path: str | Path | None, problem: str, *, trace: str | None = None,
                 field: str | None = None, file: str | None = None) -> None:
        self.path = None if path is None else str(path)
        self.trace = trace
        self.field = field
        self.file = file
        self.problem = problem
        where = []
        if trace is not None:
            where.append(f"trace '{trace}'")
        if field is not None:
            where.append(f"field '{field}'" + (f" of {file}" if file is not None else ""))
        elif file is not None:
            where.append(f"file {file}")
        head = self.path or "<in-memory manifest>"
        super().__init__(f"{head}: {', '.join(where) + ': ' if where else ''}{problem}")
