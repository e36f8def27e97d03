"""The trace schema: one row per southbound message (SMART paper, Table I).

A trace is a directory holding::

    messages.parquet   one row per message, columns below, sorted by timestamp
    nodes.parquet      node_id (uint32), bandwidth_bps (int64): receive bandwidth s(n)
    vms.parquet        vm_id (uint32), node_id (uint32), vpc_id (uint32): placement
    scenario.json      how it was made (generator spec, seed) and the DSMD capacities

``messages.parquet`` columns (Table I fields first, then what the simulator needs):

=====================  ==========================  =============================================
column                 Arrow type                  meaning
=====================  ==========================  =============================================
message_id             uint32                      identity of the message (unique)
request_id             uint32                      the tenant request that produced it
vpc_id                 uint32                      VPC the message belongs to
timestamp              timestamp[ns, UTC]          generation time (non-decreasing)
configuration_type     string                      one of :class:`ConfigurationType`
operation_type         string                      one of :class:`OperationType`
resource_id            uint64                      the configured resource (order key)
size_bytes             int64                       message size, > 0
hosts                  list<uint32>                destination node ids, non-empty, unique
=====================  ==========================  =============================================

Integer columns may be stored with any integer width that holds the values; they are
cast on read. ``timestamp`` may be any Arrow timestamp unit; it is read as nanoseconds.
"""

from __future__ import annotations

from enum import StrEnum

import pyarrow as pa

__all__ = [
    "MESSAGE_SCHEMA",
    "MULTICAST_CONFIGURATIONS",
    "NODE_SCHEMA",
    "VM_SCHEMA",
    "ConfigurationType",
    "OperationType",
]


class ConfigurationType(StrEnum):
    """Configuration types (Table I ``configuration_type``; Alcor GoalState resources)."""

    VPC = "VPC"
    SUBNET = "SUBNET"
    PORT = "PORT"
    SECURITY_GROUP = "SECURITY_GROUP"
    ROUTER = "ROUTER"
    NEIGHBOR = "NEIGHBOR"
    DHCP = "DHCP"
    GATEWAY = "GATEWAY"


class OperationType(StrEnum):
    """Operation types (Table I ``operation_type``)."""

    CREATE = "CREATE"
    UPDATE = "UPDATE"
    DELETE = "DELETE"
    GET = "GET"
    INFO = "INFO"


#: Configurations that address every node hosting a group of VMs (Section II-C).
MULTICAST_CONFIGURATIONS = frozenset(
    {ConfigurationType.VPC, ConfigurationType.SUBNET, ConfigurationType.SECURITY_GROUP,
     ConfigurationType.ROUTER, ConfigurationType.GATEWAY}
)

MESSAGE_SCHEMA = pa.schema(
    [
        ("message_id", pa.uint32()),
        ("request_id", pa.uint32()),
        ("vpc_id", pa.uint32()),
        ("timestamp", pa.timestamp("ns", tz="UTC")),
        ("configuration_type", pa.string()),
        ("operation_type", pa.string()),
        ("resource_id", pa.uint64()),
        ("size_bytes", pa.int64()),
        ("hosts", pa.list_(pa.uint32())),
    ]
)

NODE_SCHEMA = pa.schema([("node_id", pa.uint32()), ("bandwidth_bps", pa.int64())])

VM_SCHEMA = pa.schema([("vm_id", pa.uint32()), ("node_id", pa.uint32()), ("vpc_id", pa.uint32())])
