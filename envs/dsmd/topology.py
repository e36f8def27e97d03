"""Topology: compute nodes with receive bandwidth s(n), VMs placed on nodes, VMs in VPCs.

Section V-A of the SMART paper: nodes N with bandwidth s(n). Node ids are arbitrary
uint32 values; the simulator works on dense indices ``0..N-1`` in ``node_ids`` order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from .errors import TopologyError
from .schema import NODE_SCHEMA, VM_SCHEMA

__all__ = ["Topology"]


@dataclass(frozen=True, eq=False)
class Topology:
    """Nodes (sorted unique ids, receive bandwidth in bit/s) and VM placement."""

    node_ids: np.ndarray  # uint32 (N,), strictly increasing
    bandwidth_bps: np.ndarray  # int64 (N,), > 0
    vm_ids: np.ndarray  # uint32 (V,)
    vm_node: np.ndarray  # int64 (V,), node *index* of each VM
    vm_vpc: np.ndarray  # uint32 (V,)
    _vpc_cache: dict[str, dict[int, int]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        ids = np.asarray(self.node_ids)
        if ids.ndim != 1 or ids.size == 0:
            raise TopologyError("topology has no nodes")
        if np.any(np.diff(ids.astype(np.int64)) <= 0):
            raise TopologyError("node_id values must be unique (and are kept sorted)")
        if self.bandwidth_bps.shape != ids.shape:
            raise TopologyError("bandwidth_bps must have one value per node")
        bad = np.flatnonzero(self.bandwidth_bps <= 0)
        if bad.size:
            raise TopologyError(
                f"node {int(ids[bad[0]])}: bandwidth_bps must be positive, "
                f"got {int(self.bandwidth_bps[bad[0]])}")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_arrays(cls, node_ids: npt.ArrayLike, bandwidth_bps: npt.ArrayLike,
                    vm_ids: npt.ArrayLike, vm_node_ids: npt.ArrayLike,
                    vm_vpc: npt.ArrayLike) -> Topology:
        node_ids = np.asarray(node_ids, dtype=np.uint32)
        order = np.argsort(node_ids, kind="stable")
        node_ids = node_ids[order]
        bw = np.asarray(bandwidth_bps, dtype=np.int64)[order]
        vm_node_ids = np.asarray(vm_node_ids, dtype=np.uint32)
        idx = np.searchsorted(node_ids, vm_node_ids)
        idx_c = np.minimum(idx, node_ids.size - 1)
        bad = np.flatnonzero(node_ids[idx_c] != vm_node_ids)
        if bad.size:
            raise TopologyError(
                f"vm {int(np.asarray(vm_ids)[bad[0]])} is placed on unknown node "
                f"{int(vm_node_ids[bad[0]])}")
        vm_ids = np.asarray(vm_ids, dtype=np.uint32)
        if np.unique(vm_ids).size != vm_ids.size:
            raise TopologyError("vm_id values must be unique")
        return cls(node_ids, bw, vm_ids, idx.astype(np.int64), np.asarray(vm_vpc, np.uint32))

    # ------------------------------------------------------------------ queries
    @property
    def num_nodes(self) -> int:
        return int(self.node_ids.size)

    @property
    def num_vms(self) -> int:
        return int(self.vm_ids.size)

    @property
    def vpc_ids(self) -> np.ndarray:
        return np.unique(self.vm_vpc)

    def node_index(self, node_ids: np.ndarray) -> np.ndarray:
        """Dense indices of ``node_ids``; -1 for ids not in the topology."""
        node_ids = np.asarray(node_ids, dtype=np.uint32)
        idx = np.searchsorted(self.node_ids, node_ids)
        idx_c = np.minimum(idx, self.num_nodes - 1)
        return np.where(self.node_ids[idx_c] == node_ids, idx_c, -1).astype(np.int64)

    def vpc_ports(self) -> dict[int, int]:
        """Number of ports (VMs) per VPC, used by the Alcor AUTO rule."""
        if "ports" not in self._vpc_cache:
            v, c = np.unique(self.vm_vpc, return_counts=True)
            self._vpc_cache["ports"] = dict(zip(v.tolist(), c.tolist()))
        return self._vpc_cache["ports"]

    def vpc_nodes(self, vpc: int) -> np.ndarray:
        """Sorted node indices hosting VMs of ``vpc``."""
        return np.unique(self.vm_node[self.vm_vpc == vpc])

    def signature(self) -> str:
        """A content hash of the topology (node ids, bandwidths, placement)."""
        import hashlib

        h = hashlib.blake2b(digest_size=12)
        for a in (self.node_ids, self.bandwidth_bps, self.vm_ids, self.vm_node, self.vm_vpc):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()

    # ------------------------------------------------------------------ I/O
    def write(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"node_id": self.node_ids, "bandwidth_bps": self.bandwidth_bps},
                                schema=NODE_SCHEMA), d / "nodes.parquet")
        pq.write_table(pa.table({"vm_id": self.vm_ids,
                                 "node_id": self.node_ids[self.vm_node],
                                 "vpc_id": self.vm_vpc}, schema=VM_SCHEMA), d / "vms.parquet")

    @classmethod
    def read(cls, directory: str | Path) -> Topology:
        d = Path(directory)
        nodes = _read_checked(d / "nodes.parquet", NODE_SCHEMA)
        vms = _read_checked(d / "vms.parquet", VM_SCHEMA)
        try:
            return cls.from_arrays(nodes["node_id"], nodes["bandwidth_bps"], vms["vm_id"],
                                   vms["node_id"], vms["vpc_id"])
        except TopologyError as e:
            raise TopologyError(f"{d}: {e}") from None


def _read_checked(path: Path, schema: pa.Schema) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise TopologyError(f"{path}: file not found")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise TopologyError(f"{path}: not a readable Parquet file ({e})") from None
    out = {}
    for f in schema:
        if f.name not in table.column_names:
            raise TopologyError(f"{path}: missing column '{f.name}'")
        col = table.column(f.name)
        if not pa.types.is_integer(col.type):
            raise TopologyError(f"{path}: column '{f.name}' must be an integer, got {col.type}")
        if col.null_count:
            raise TopologyError(f"{path}: column '{f.name}' has {col.null_count} null values")
        arr = col.to_numpy()
        if arr.size and arr.min() < 0:
            raise TopologyError(f"{path}: column '{f.name}' has a negative value")
        out[f.name] = arr
    return out
