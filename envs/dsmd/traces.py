"""Message traces: in-memory columns, Parquet read/write, and validation.

The schema is documented in :mod:`envs.dsmd.schema` and ``datasets/README.md``. Every
check raises :class:`~envs.dsmd.errors.TraceError` naming the file, the row and the field.
Writing is atomic (a temporary directory renamed into place), so a failed write never
damages a trace that was already stored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..fsutil import atomic_directory
from .errors import TraceError
from .schema import MESSAGE_SCHEMA, ConfigurationType, OperationType
from .topology import Topology

__all__ = [
    "CONFIG_NAMES",
    "OPERATION_NAMES",
    "Dataset",
    "Trace",
    "read_dataset",
    "read_trace",
    "write_dataset",
    "write_trace",
]

CONFIG_NAMES: tuple[str, ...] = tuple(c.value for c in ConfigurationType)
OPERATION_NAMES: tuple[str, ...] = tuple(o.value for o in OperationType)
_UINT32_MAX = 2**32 - 1


@dataclass(frozen=True, eq=False)
class Trace:
    """A message trace as columns; row ``i`` is one southbound message (Table I).

    ``hosts[hosts_indptr[i]:hosts_indptr[i+1]]`` are message ``i``'s destination node ids.
    ``configuration_type`` and ``operation_type`` are codes into :data:`CONFIG_NAMES` and
    :data:`OPERATION_NAMES`.
    """

    message_id: np.ndarray  # uint32
    request_id: np.ndarray  # uint32
    vpc_id: np.ndarray  # uint32
    timestamp_ns: np.ndarray  # int64, non-decreasing
    configuration_type: np.ndarray  # int8 codes
    operation_type: np.ndarray  # int8 codes
    resource_id: np.ndarray  # uint64
    size_bytes: np.ndarray  # int64 > 0
    hosts_indptr: np.ndarray  # int64 (R+1,)
    hosts: np.ndarray  # uint32 node ids

    def __len__(self) -> int:
        return int(self.message_id.size)

    @property
    def fanout(self) -> np.ndarray:
        return np.diff(self.hosts_indptr)

    def hosts_of(self, i: int) -> np.ndarray:
        return self.hosts[self.hosts_indptr[i]:self.hosts_indptr[i + 1]]

    @property
    def duration_s(self) -> float:
        if len(self) == 0:
            return 0.0
        return float(self.timestamp_ns[-1] - self.timestamp_ns[0]) / 1e9

    def slice(self, start: int, stop: int) -> Trace:
        """Rows ``start:stop`` as a new trace (host ids are copied)."""
        lo, hi = int(self.hosts_indptr[start]), int(self.hosts_indptr[stop])
        return Trace(
            self.message_id[start:stop], self.request_id[start:stop], self.vpc_id[start:stop],
            self.timestamp_ns[start:stop], self.configuration_type[start:stop],
            self.operation_type[start:stop], self.resource_id[start:stop],
            self.size_bytes[start:stop], self.hosts_indptr[start:stop + 1] - lo,
            self.hosts[lo:hi].copy())

    # ------------------------------------------------------------------ validation
    def validate(self, topology: Topology | None = None, path: str | Path | None = None) -> None:
        """Check every invariant of the schema; raise :class:`TraceError` on the first breach."""
        n = len(self)
        for name in ("message_id", "request_id", "vpc_id", "timestamp_ns", "configuration_type",
                     "operation_type", "resource_id", "size_bytes"):
            if getattr(self, name).shape != (n,):
                raise TraceError(path, name,
                                 f"expected {n} values, got {getattr(self, name).shape}")
        if self.hosts_indptr.shape != (n + 1,) or self.hosts_indptr[0] != 0 \
                or self.hosts_indptr[-1] != self.hosts.size:
            raise TraceError(path, "hosts", "inconsistent list offsets")
        bad = np.flatnonzero((self.configuration_type < 0)
                             | (self.configuration_type >= len(CONFIG_NAMES)))
        if bad.size:
            raise TraceError(path, "configuration_type", "unknown configuration type", int(bad[0]))
        bad = np.flatnonzero((self.operation_type < 0)
                             | (self.operation_type >= len(OPERATION_NAMES)))
        if bad.size:
            raise TraceError(path, "operation_type", "unknown operation type", int(bad[0]))
        bad = np.flatnonzero(self.size_bytes <= 0)
        if bad.size:
            r = int(bad[0])
            raise TraceError(path, "size_bytes",
                             f"size must be positive, got {int(self.size_bytes[r])}", r)
        fan = self.fanout
        bad = np.flatnonzero(fan <= 0)
        if bad.size:
            raise TraceError(path, "hosts", "empty destination list", int(bad[0]))
        bad = np.flatnonzero(np.diff(self.timestamp_ns) < 0)
        if bad.size:
            r = int(bad[0]) + 1
            raise TraceError(path, "timestamp",
                             "timestamps are not sorted (earlier than the previous row)", r)
        _, first = np.unique(self.message_id, return_index=True)
        if first.size != n:
            dup = np.setdiff1d(np.arange(n), first)
            raise TraceError(path, "message_id",
                             f"duplicate message_id {int(self.message_id[dup[0]])}", int(dup[0]))
        if n:
            row_of = np.repeat(np.arange(n), fan)
            # duplicates inside one row: sort by (row, host)
            order = np.lexsort((self.hosts, row_of))
            h, hr = self.hosts[order], row_of[order]
            dup = np.flatnonzero((h[1:] == h[:-1]) & (hr[1:] == hr[:-1]))
            if dup.size:
                i = int(dup[0])
                raise TraceError(path, "hosts", f"node {int(h[i])} listed twice", int(hr[i]))
            if topology is not None:
                idx = topology.node_index(self.hosts)
                bad = np.flatnonzero(idx < 0)
                if bad.size:
                    i = int(bad[0])
                    raise TraceError(path, "hosts",
                                     f"unknown node {int(self.hosts[i])} (not in the topology)",
                                     int(row_of[i]))

    # ------------------------------------------------------------------ Arrow
    def to_arrow(self) -> pa.Table:
        hosts = pa.ListArray.from_arrays(pa.array(self.hosts_indptr.astype(np.int32)),
                                         pa.array(self.hosts, type=pa.uint32()))
        cfg = pa.DictionaryArray.from_arrays(pa.array(self.configuration_type, pa.int8()),
                                             pa.array(CONFIG_NAMES)).cast(pa.string())
        op = pa.DictionaryArray.from_arrays(pa.array(self.operation_type, pa.int8()),
                                            pa.array(OPERATION_NAMES)).cast(pa.string())
        return pa.Table.from_arrays(
            [pa.array(self.message_id, pa.uint32()), pa.array(self.request_id, pa.uint32()),
             pa.array(self.vpc_id, pa.uint32()),
             pa.array(self.timestamp_ns, pa.int64()).cast(pa.timestamp("ns", tz="UTC")),
             cfg, op, pa.array(self.resource_id, pa.uint64()),
             pa.array(self.size_bytes, pa.int64()), hosts],
            schema=MESSAGE_SCHEMA)

    @classmethod
    def from_arrow(cls, table: pa.Table, path: str | Path | None = None) -> Trace:
        """Columns from an Arrow table, with type checks naming the offending field."""
        cols: dict[str, Any] = {}
        for f in MESSAGE_SCHEMA:
            if f.name not in table.column_names:
                raise TraceError(path, f.name, "missing column")
            col = table.column(f.name)
            if col.null_count:
                nulls = np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))
                raise TraceError(path, f.name, "null value", int(nulls[0]))
            cols[f.name] = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        out: dict[str, np.ndarray] = {}
        for name, dtype, hi in (("message_id", np.uint32, _UINT32_MAX),
                                ("request_id", np.uint32, _UINT32_MAX),
                                ("vpc_id", np.uint32, _UINT32_MAX),
                                ("resource_id", np.uint64, None),
                                ("size_bytes", np.int64, None)):
            out[name] = _int_column(cols[name], name, dtype, hi, path)
        ts = cols["timestamp"]
        if not pa.types.is_timestamp(ts.type):
            raise TraceError(path, "timestamp", f"expected an Arrow timestamp, got {ts.type}")
        try:
            out["timestamp_ns"] = ts.cast(pa.timestamp("ns", tz=ts.type.tz)).cast(
                pa.int64()).to_numpy()
        except (pa.ArrowInvalid, OverflowError) as e:
            raise TraceError(path, "timestamp", f"not representable in nanoseconds ({e})") from None
        for name, names in (("configuration_type", CONFIG_NAMES),
                            ("operation_type", OPERATION_NAMES)):
            col = cols[name]
            if pa.types.is_dictionary(col.type):
                col = col.cast(col.type.value_type)
            if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
                raise TraceError(path, name, f"expected a string, got {col.type}")
            codes = pc.index_in(col, value_set=pa.array(names)).to_numpy(zero_copy_only=False)
            bad = np.flatnonzero(np.isnan(codes.astype(float)) if codes.dtype.kind == "f"
                                 else codes < 0)
            if bad.size:
                r = int(bad[0])
                raise TraceError(path, name, f"unknown value {col[r].as_py()!r}; expected one of "
                                 f"{', '.join(names)}", r)
            out[name] = codes.astype(np.int8)
        hosts = cols["hosts"]
        if not (pa.types.is_list(hosts.type) or pa.types.is_large_list(hosts.type)):
            raise TraceError(path, "hosts", f"expected a list of node ids, got {hosts.type}")
        if not pa.types.is_integer(hosts.type.value_type):
            raise TraceError(path, "hosts",
                             f"expected integer node ids, got {hosts.type.value_type}")
        offsets = hosts.offsets.to_numpy().astype(np.int64)
        inner = hosts.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        offsets = offsets - offsets[0]
        if inner.null_count:
            pos = int(np.flatnonzero(inner.is_null().to_numpy(zero_copy_only=False))[0])
            row = int(np.searchsorted(offsets, pos, side="right") - 1)
            raise TraceError(path, "hosts", "null node id in the destination list", row)
        values = inner.to_numpy(zero_copy_only=False)
        if values.size and (values.min() < 0 or values.max() > _UINT32_MAX):
            bad = np.flatnonzero((values < 0) | (values > _UINT32_MAX))
            row = int(np.searchsorted(offsets, bad[0], side="right") - 1)
            raise TraceError(path, "hosts", f"node id {int(values[bad[0]])} is not a uint32", row)
        return cls(out["message_id"], out["request_id"], out["vpc_id"], out["timestamp_ns"],
                   out["configuration_type"], out["operation_type"], out["resource_id"],
                   out["size_bytes"], offsets, values.astype(np.uint32))


def _int_column(col: pa.Array, name: str, dtype: npt.DTypeLike, hi: int | None,
                path: str | Path | None) -> np.ndarray:
    if not pa.types.is_integer(col.type):
        raise TraceError(path, name, f"expected an integer, got {col.type}")
    arr: np.ndarray = col.to_numpy()
    if arr.dtype == np.uint64 and dtype != np.uint64 and arr.size and arr.max() > 2**63 - 1:
        r = int(np.argmax(arr))
        raise TraceError(path, name, f"value {int(arr[r])} does not fit in int64", r)
    if arr.size and arr.min() < 0:
        r = int(np.argmin(arr))
        if name == "size_bytes":
            raise TraceError(path, name, f"size must be positive, got {int(arr[r])}", r)
        raise TraceError(path, name, f"negative value {int(arr[r])}", r)
    if hi is not None and arr.size and int(arr.max()) > hi:
        r = int(np.argmax(arr))
        raise TraceError(path, name, f"value {int(arr[r])} does not fit in uint32", r)
    return arr.astype(dtype)


# ---------------------------------------------------------------------- files
def write_trace(trace: Trace, path: str | Path) -> None:
    pq.write_table(trace.to_arrow(), path, compression="zstd")


def read_trace(path: str | Path, topology: Topology | None = None) -> Trace:
    """Read and fully validate ``messages.parquet``."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(p, None, "file not found")
    try:
        table = pq.read_table(p)
    except (pa.ArrowInvalid, OSError) as e:
        raise TraceError(p, None, f"not a readable Parquet file ({e})") from None
    trace = Trace.from_arrow(table, p)
    trace.validate(topology, p)
    return trace


@dataclass(frozen=True, eq=False)
class Dataset:
    """A trace with its topology and the metadata that produced it."""

    topology: Topology
    trace: Trace
    meta: dict

    @property
    def name(self) -> str:
        return str(self.meta.get("name", "unnamed"))


def write_dataset(directory: str | Path, dataset: Dataset, overwrite: bool = False) -> Path:
    """Write ``dataset`` to ``directory`` atomically (temp dir, then rename)."""
    with atomic_directory(directory, overwrite) as tmp:
        dataset.topology.write(tmp)
        write_trace(dataset.trace, tmp / "messages.parquet")
        (tmp / "scenario.json").write_text(json.dumps(dataset.meta, indent=2, sort_keys=True))
    return Path(directory)


def read_dataset(directory: str | Path) -> Dataset:
    d = Path(directory)
    if not d.is_dir():
        raise TraceError(d, None, "dataset directory not found")
    topology = Topology.read(d)
    trace = read_trace(d / "messages.parquet", topology)
    meta_path = d / "scenario.json"
    try:
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    except json.JSONDecodeError as e:
        raise TraceError(meta_path, None, f"not valid JSON ({e})") from None
    return Dataset(topology, trace, meta)
