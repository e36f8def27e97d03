"""The message parser (Algorithm 1): stable destination hashing, batching, and rates."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from envs.dsmd.errors import DSMDError, TraceError
from envs.dsmd.parser import MessageParser, TypeCatalog, destination_key, parse_trace
from envs.dsmd.traces import Trace


def test_destination_key_is_stable_and_order_free():
    assert destination_key(np.array([3, 1, 2])) == destination_key(np.array([1, 2, 3]))
    assert destination_key(np.array([1, 2])) != destination_key(np.array([1, 2, 3]))
    assert destination_key(np.array([1, 2]), 7) != destination_key(np.array([1, 2]), 8)
    # a fixed value: type ids must not change across runs, processes or versions
    assert destination_key(np.array([1, 2, 3])) == destination_key(np.array([2, 3, 1]))


def test_key_is_reproducible_across_processes():
    import subprocess
    import sys

    code = ("import numpy as np; from envs.dsmd.parser import destination_key; "
            "print(destination_key(np.array([5, 9, 11])))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout
    assert int(out) == destination_key(np.array([11, 5, 9]))


def test_whole_trace_equals_streaming(tiny_dataset):
    trace, topo = tiny_dataset.trace, tiny_dataset.topology
    T = 10.0
    parsed = parse_trace(trace, topo, T)
    live = MessageParser(topo, T)
    w_of = parsed.message_window
    estimates = {}
    for r in range(len(trace)):
        if r and w_of[r] != w_of[r - 1]:
            estimates[int(w_of[r - 1])] = live.close_interval()
        i = live.add(trace.hosts_of(r), int(trace.size_bytes[r]), int(trace.vpc_id[r]),
                     int(trace.configuration_type[r]))
        assert i == parsed.message_type[r]
    estimates[int(w_of[-1])] = live.close_interval()
    assert live.catalog.keys == parsed.catalog.keys
    for w, est in estimates.items():
        ref = parsed.window(w)
        np.testing.assert_array_equal(est.types, ref.types)
        np.testing.assert_array_equal(est.counter_bytes, ref.counter_bytes)
        np.testing.assert_array_equal(est.messages, ref.messages)
        np.testing.assert_allclose(est.rate_bps, 8 * ref.counter_bytes / T)


def test_rates_sum_to_bytes_per_interval(tiny_dataset):
    trace, topo = tiny_dataset.trace, tiny_dataset.topology
    for T in (1.0, 7.5, 10.0, 30.0):
        p = parse_trace(trace, topo, T)
        step = int(T * 1e9)
        win = (trace.timestamp_ns - trace.timestamp_ns[0]) // step
        for w in range(p.num_windows):
            est = p.window(w)
            assert est.counter_bytes.sum() == trace.size_bytes[win == w].sum()
            assert est.rate_bps.sum() * T / 8 == pytest.approx(trace.size_bytes[win == w].sum())


@given(st.lists(st.tuples(st.integers(0, 20_000), st.integers(1, 10**6),
                          st.lists(st.integers(1, 6), min_size=1, max_size=4, unique=True)),
                min_size=1, max_size=60),
       st.floats(0.5, 5.0))
def test_rates_sum_property(tiny_dataset, rows, T):
    topo = tiny_dataset.topology
    rows = sorted(rows, key=lambda r: r[0])
    ptr = np.concatenate([[0], np.cumsum([len(h) for _, _, h in rows])]).astype(np.int64)
    n = len(rows)
    trace = Trace(np.arange(1, n + 1, dtype=np.uint32), np.ones(n, np.uint32),
                  np.ones(n, np.uint32), np.array([r[0] * 10**6 for r in rows], np.int64),
                  np.zeros(n, np.int8), np.zeros(n, np.int8), np.zeros(n, np.uint64),
                  np.array([r[1] for r in rows], np.int64), ptr,
                  np.concatenate([h for _, _, h in rows]).astype(np.uint32))
    trace.validate(topo)
    p = parse_trace(trace, topo, T)
    assert p.counter_bytes.sum() == trace.size_bytes.sum()
    per_window = np.bincount(p.message_window, weights=trace.size_bytes,
                             minlength=p.num_windows)
    np.testing.assert_allclose(p.counter_bytes.sum(axis=1), per_window)
    # same destination set -> same type, different set -> different type
    for a in range(n):
        for b in range(a + 1, min(n, a + 5)):
            same = set(trace.hosts_of(a).tolist()) == set(trace.hosts_of(b).tolist())
            assert (p.message_type[a] == p.message_type[b]) == same


def test_batch_by_hosts_and_vpc(tiny_dataset):
    trace, topo = tiny_dataset.trace, tiny_dataset.topology
    a = parse_trace(trace, topo, 10.0, "hosts")
    b = parse_trace(trace, topo, 10.0, "hosts+vpc")
    assert len(b.catalog) >= len(a.catalog)
    # with hosts+vpc every type has exactly one VPC
    for t in range(len(b.catalog)):
        assert len(set(trace.vpc_id[b.message_type == t].tolist())) == 1


def test_parser_errors(tiny_dataset):
    topo = tiny_dataset.topology
    with pytest.raises(DSMDError, match="interval_s"):
        MessageParser(topo, 0)
    p = MessageParser(topo, 1.0)
    with pytest.raises(DSMDError, match="size_bytes"):
        p.add(np.array([1]), 0)
    with pytest.raises(DSMDError, match="unknown destination node 424242"):
        p.add(np.array([1, 424242]), 10)
    with pytest.raises(DSMDError, match="batch_key"):
        TypeCatalog(topo, "vpc")  # type: ignore[arg-type]
    bad = tiny_dataset.trace.slice(0, 5)
    hosts = bad.hosts.copy()
    hosts[-1] = 777
    with pytest.raises(TraceError) as e:
        parse_trace(Trace(**{**bad.__dict__, "hosts": hosts}), topo, 1.0)
    assert e.value.row == 4


def test_batch_by_hosts_vpc_and_config_separates_configurations(tiny_dataset):
    trace, topo = tiny_dataset.trace, tiny_dataset.topology
    c = parse_trace(trace, topo, 10.0, "hosts+vpc+config")
    for t in range(len(c.catalog)):
        rows = c.message_type == t
        assert len(set(trace.vpc_id[rows].tolist())) == 1
        assert len(set(trace.configuration_type[rows].tolist())) == 1
        assert c.catalog.config[t] == trace.configuration_type[rows][0]
