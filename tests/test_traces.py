"""Trace schema, Parquet round trip, and every bad-trace case with its clear error."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from envs.dsmd.errors import TopologyError, TraceError
from envs.dsmd.schema import MESSAGE_SCHEMA
from envs.dsmd.topology import Topology
from envs.dsmd.traces import Dataset, Trace, read_dataset, read_trace, write_dataset, write_trace


def test_round_trip_preserves_every_column(tmp_path, tiny_dataset):
    d = write_dataset(tmp_path / "tiny", tiny_dataset)
    back = read_dataset(d)
    a, b = tiny_dataset.trace, back.trace
    for name in ("message_id", "request_id", "vpc_id", "timestamp_ns", "configuration_type",
                 "operation_type", "resource_id", "size_bytes", "hosts_indptr", "hosts"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_array_equal(back.topology.node_ids, tiny_dataset.topology.node_ids)
    np.testing.assert_array_equal(back.topology.vm_node, tiny_dataset.topology.vm_node)
    assert back.meta["name"] == "tiny"
    assert pq.read_schema(d / "messages.parquet").equals(MESSAGE_SCHEMA)


def _table(trace: Trace) -> pa.Table:
    return trace.to_arrow()


def _write(tmp_path, table: pa.Table):
    p = tmp_path / "messages.parquet"
    pq.write_table(table, p)
    return p


def _replace(table: pa.Table, name: str, values: pa.Array) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, values)


@pytest.fixture()
def good(tiny_dataset):
    return tiny_dataset.trace.slice(0, 40), tiny_dataset.topology


def test_missing_column(tmp_path, good):
    trace, topo = good
    p = _write(tmp_path, _table(trace).drop_columns(["vpc_id"]))
    with pytest.raises(TraceError) as e:
        read_trace(p, topo)
    assert e.value.field == "vpc_id" and "missing column" in str(e.value)
    assert str(p) in str(e.value)


def test_wrong_type(tmp_path, good):
    trace, topo = good
    t = _replace(_table(trace), "size_bytes", pa.array([str(x) for x in trace.size_bytes]))
    with pytest.raises(TraceError) as e:
        read_trace(_write(tmp_path, t), topo)
    assert e.value.field == "size_bytes" and "expected an integer" in str(e.value)


def test_timestamp_must_be_a_timestamp(tmp_path, good):
    trace, topo = good
    t = _replace(_table(trace), "timestamp", pa.array(trace.timestamp_ns.astype(float)))
    with pytest.raises(TraceError, match="timestamp"):
        read_trace(_write(tmp_path, t), topo)


def test_unknown_node(tmp_path, good):
    trace, topo = good
    hosts = trace.hosts.copy()
    hosts[trace.hosts_indptr[7]] = 99_999
    bad = Trace(**{**trace.__dict__, "hosts": hosts})
    p = tmp_path / "m.parquet"
    write_trace(bad, p)
    with pytest.raises(TraceError) as e:
        read_trace(p, topo)
    assert (e.value.row, e.value.field) == (7, "hosts")
    assert "unknown node 99999" in str(e.value)


def test_empty_destination_list(tmp_path, good):
    trace, topo = good
    rows = [trace.hosts_of(i).tolist() for i in range(len(trace))]
    rows[5] = []
    t = _replace(_table(trace), "hosts", pa.array(rows, type=pa.list_(pa.uint32())))
    with pytest.raises(TraceError) as e:
        read_trace(_write(tmp_path, t), topo)
    assert (e.value.row, e.value.field) == (5, "hosts")
    assert "empty destination" in str(e.value)


def test_negative_size(tmp_path, good):
    trace, topo = good
    sizes = trace.size_bytes.copy()
    sizes[3] = -10
    t = _replace(_table(trace), "size_bytes", pa.array(sizes, pa.int64()))
    with pytest.raises(TraceError) as e:
        read_trace(_write(tmp_path, t), topo)
    assert (e.value.row, e.value.field) == (3, "size_bytes")


def test_zero_size_is_refused(good):
    trace, topo = good
    sizes = trace.size_bytes.copy()
    sizes[2] = 0
    with pytest.raises(TraceError) as e:
        Trace(**{**trace.__dict__, "size_bytes": sizes}).validate(topo)
    assert (e.value.row, e.value.field) == (2, "size_bytes")


def test_unsorted_timestamps(tmp_path, good):
    trace, topo = good
    ts = trace.timestamp_ns.copy()
    ts[10] = ts[9] - 1_000
    bad = Trace(**{**trace.__dict__, "timestamp_ns": ts})
    p = tmp_path / "m.parquet"
    write_trace(bad, p)
    with pytest.raises(TraceError) as e:
        read_trace(p, topo)
    assert (e.value.row, e.value.field) == (10, "timestamp")
    assert "not sorted" in str(e.value)


def test_unknown_configuration_type(tmp_path, good):
    trace, topo = good
    cfg = trace.to_arrow().column("configuration_type").to_pylist()
    cfg[4] = "TELEPORTER"
    t = _replace(_table(trace), "configuration_type", pa.array(cfg))
    with pytest.raises(TraceError) as e:
        read_trace(_write(tmp_path, t), topo)
    assert (e.value.row, e.value.field) == (4, "configuration_type")
    assert "TELEPORTER" in str(e.value)


def test_duplicate_message_id_and_host(good):
    trace, topo = good
    ids = trace.message_id.copy()
    ids[6] = ids[2]
    with pytest.raises(TraceError) as e:
        Trace(**{**trace.__dict__, "message_id": ids}).validate(topo)
    assert (e.value.row, e.value.field) == (6, "message_id")
    multi = int(np.flatnonzero(trace.fanout > 1)[0])
    hosts = trace.hosts.copy()
    lo = trace.hosts_indptr[multi]
    hosts[lo + 1] = hosts[lo]
    with pytest.raises(TraceError) as e:
        Trace(**{**trace.__dict__, "hosts": hosts}).validate(topo)
    assert (e.value.row, e.value.field) == (multi, "hosts")


def test_null_value_is_named(tmp_path, good):
    trace, topo = good
    vpc = trace.vpc_id.astype(object)
    vpc[8] = None
    t = _replace(_table(trace), "vpc_id", pa.array(vpc.tolist(), pa.uint32()))
    with pytest.raises(TraceError) as e:
        read_trace(_write(tmp_path, t), topo)
    assert (e.value.row, e.value.field) == (8, "vpc_id")


def test_not_parquet(tmp_path):
    p = tmp_path / "messages.parquet"
    p.write_text("hello")
    with pytest.raises(TraceError, match="not a readable Parquet"):
        read_trace(p)


def test_failed_overwrite_keeps_stored_dataset(tmp_path, tiny_dataset, monkeypatch):
    d = write_dataset(tmp_path / "ds", tiny_dataset)
    before = (d / "messages.parquet").read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("envs.dsmd.traces.write_trace", boom)
    with pytest.raises(OSError):
        write_dataset(d, tiny_dataset, overwrite=True)
    assert (d / "messages.parquet").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ds.")]
    with pytest.raises(FileExistsError):
        write_dataset(d, tiny_dataset)


def test_topology_errors(tmp_path):
    with pytest.raises(TopologyError, match="unknown node"):
        Topology.from_arrays([1, 2], [10, 10], [1], [3], [1])
    with pytest.raises(TopologyError, match="positive"):
        Topology.from_arrays([1, 2], [10, 0], [1], [1], [1])
    with pytest.raises(TopologyError, match="unique"):
        Topology.from_arrays([1, 1], [10, 10], [1], [1], [1])
    with pytest.raises(TopologyError, match="file not found"):
        Topology.read(tmp_path)


def test_dataset_without_files(tmp_path):
    with pytest.raises(TraceError, match="not found"):
        read_dataset(tmp_path / "nothing")
    assert isinstance(Dataset, type)


def test_edge_cases_found_in_review(tmp_path, good):
    trace, topo = good
    rows = [trace.hosts_of(i).tolist() for i in range(len(trace))]
    rows[3] = [rows[3][0], None]
    t = _replace(_table(trace), "hosts", pa.array(rows, type=pa.list_(pa.uint32())))
    with pytest.raises(TraceError) as e:
        read_trace(_write(tmp_path, t), topo)
    assert (e.value.row, e.value.field) == (3, "hosts") and "null node id" in str(e.value)
    big = pa.array([2**63 + 5, *trace.size_bytes[1:].tolist()], pa.uint64())
    with pytest.raises(TraceError) as e:
        read_trace(_write(tmp_path, _replace(_table(trace), "size_bytes", big)), topo)
    assert (e.value.row, e.value.field) == (0, "size_bytes")
    secs = pa.array([10**12] * len(trace), pa.timestamp("s", tz="UTC"))
    with pytest.raises(TraceError, match="nanoseconds"):
        read_trace(_write(tmp_path, _replace(_table(trace), "timestamp", secs)), topo)


def test_garbage_side_files(tmp_path, tiny_dataset):
    d = write_dataset(tmp_path / "ds", tiny_dataset)
    (d / "scenario.json").write_text("{not json")
    with pytest.raises(TraceError, match="not valid JSON"):
        read_dataset(d)
    (d / "nodes.parquet").write_text("garbage")
    with pytest.raises(TopologyError, match="not a readable Parquet"):
        read_dataset(d)
