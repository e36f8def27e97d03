"""One southbound message as a live controller sees it (SMART Table I), and the way back to
a trace: :func:`messages_to_trace` turns messages logged by the controller adapter into a
:class:`~envs.dsmd.traces.Trace` (the simulator's format, ``write_trace``), so live traffic
becomes training data for the next offline run."""

from __future__ import annotations

import time
from collections.abc import Sequence, Sized
from dataclasses import dataclass, field

import numpy as np

from .errors import DSMDError
from .traces import CONFIG_NAMES, OPERATION_NAMES, Trace

__all__ = ["Message", "messages_from_trace", "messages_to_trace", "table1_problem"]


def table1_problem(configuration_type: str, operation_type: str, hosts: Sized) -> str | None:
    """The first Table I field of a message that is wrong (configuration type, operation
    type, destination hosts), said in words, or None: the one rule the simulator's
    :class:`Message` and the delivery runtime's wire check (``delivery.wire``) share."""
    if configuration_type not in CONFIG_NAMES:
        return (f"configuration_type must be one of {CONFIG_NAMES}, got "
                f"{configuration_type[:40]!r}")
    if operation_type not in OPERATION_NAMES:
        return f"operation_type must be one of {OPERATION_NAMES}, got {operation_type[:40]!r}"
    if not len(hosts):
        return "at least one destination host is needed"
    return None


@dataclass(frozen=True)
class Message:
    """Table I: message id, request id, VPC id, timestamp, configuration and operation type,
    the resource it configures, its size and its destination hosts (node ids)."""

    message_id: int
    request_id: int
    vpc_id: int
    configuration_type: str
    operation_type: str
    resource_id: int
    size_bytes: int
    hosts: tuple[int, ...]
    timestamp_ns: int = field(default_factory=time.time_ns)

    def __post_init__(self) -> None:
        problem = table1_problem(self.configuration_type, self.operation_type, self.hosts)
        if problem is None and self.size_bytes <= 0:
            problem = "size_bytes must be positive"
        if problem is not None:
            raise DSMDError(f"message {self.message_id}: {problem}")
        object.__setattr__(self, "hosts", tuple(int(h) for h in self.hosts))

    @property
    def config_code(self) -> int:
        return CONFIG_NAMES.index(self.configuration_type)


def messages_to_trace(messages: Sequence[Message]) -> Trace:
    """Messages (in any order) as a validated trace sorted by timestamp."""
    ms = sorted(messages, key=lambda m: m.timestamp_ns)
    lens = np.array([len(m.hosts) for m in ms], dtype=np.int64)
    t = Trace(np.array([m.message_id for m in ms], np.uint32),
              np.array([m.request_id for m in ms], np.uint32),
              np.array([m.vpc_id for m in ms], np.uint32),
              np.array([m.timestamp_ns for m in ms], np.int64),
              np.array([m.config_code for m in ms], np.int8),
              np.array([OPERATION_NAMES.index(m.operation_type) for m in ms], np.int8),
              np.array([m.resource_id for m in ms], np.uint64),
              np.array([m.size_bytes for m in ms], np.int64),
              np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
              np.array([h for m in ms for h in m.hosts], np.uint32))
    t.validate()
    return t


def messages_from_trace(trace: Trace, rows: Sequence[int] | np.ndarray | None = None
                        ) -> list[Message]:
    """Rows of a trace as :class:`Message` objects (replaying a trace through a live path)."""
    rows = range(len(trace)) if rows is None else rows
    return [Message(int(trace.message_id[r]), int(trace.request_id[r]), int(trace.vpc_id[r]),
                    CONFIG_NAMES[int(trace.configuration_type[r])],
                    OPERATION_NAMES[int(trace.operation_type[r])], int(trace.resource_id[r]),
                    int(trace.size_bytes[r]), tuple(trace.hosts_of(int(r)).tolist()),
                    int(trace.timestamp_ns[r]))
            for r in rows]
