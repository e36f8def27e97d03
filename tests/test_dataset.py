"""Trace datasets with dynamics: the dynamic generator (each dynamic does what it says),
the static generator unchanged, datasets of many traces (determinism, cache, manifest)
and every refusal naming its file and field."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import envs.dsmd.dataset as dataset_mod
from envs.dsmd.dataset import (
    MANIFEST,
    DatasetSpec,
    TraceRecord,
    build_dataset,
    import_traces,
    load_dataset_spec,
    open_dataset,
)
from envs.dsmd.dynamics import DynamicsSpec, generate_dynamic
from envs.dsmd.errors import DatasetError, DSMDError
from envs.dsmd.scenarios import TRACE_EPOCH_NS, generate, load_scenario
from envs.dsmd.schema import ConfigurationType as CT
from envs.dsmd.schema import OperationType as OT
from envs.dsmd.traces import CONFIG_NAMES, OPERATION_NAMES, write_trace

UNICAST = np.uint64(2) << np.uint64(56)
OP = {o: OPERATION_NAMES.index(o.value) for o in OT}
CFG = {c: CONFIG_NAMES.index(c.value) for c in CT}


# ---------------------------------------------------------------------- helpers
def _columns_hash(ds) -> str:
    """sha256 over every trace and topology column (name, dtype, bytes)."""
    arrs = {f"trace.{k}": getattr(ds.trace, k) for k in ds.trace.__dataclass_fields__}
    arrs.update({f"topo.{k}": getattr(ds.topology, k)
                 for k in ("node_ids", "bandwidth_bps", "vm_ids", "vm_node", "vm_vpc")})
    h = hashlib.sha256()
    for k in sorted(arrs):
        h.update(k.encode())
        h.update(str(arrs[k].dtype).encode())
        h.update(np.ascontiguousarray(arrs[k]).tobytes())
    return h.hexdigest()


def _tiny(**changes):
    return load_scenario("tiny", **changes)


def _seconds(ds) -> np.ndarray:
    return (ds.trace.timestamp_ns - ds.meta["start_ns"]) / 1e9


def _request_counts(ds, bin_s: float) -> np.ndarray:
    """Requests per time bin (each request's first message)."""
    t = ds.trace
    _, first = np.unique(t.request_id, return_index=True)
    sec = _seconds(ds)[first]
    return np.bincount((sec // bin_s).astype(int),
                       minlength=int(np.ceil(ds.meta["duration_s"] / bin_s)))


def _small_spec(**changes) -> DatasetSpec:
    return load_dataset_spec("tiny_online", **{"num_traces": 3, "duration_s": 120.0, **changes})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A small tiny_online dataset (3 traces of 120 s) built once; tests copy it."""
    root = tmp_path_factory.mktemp("datasets")
    return build_dataset(_small_spec(), root)


@pytest.fixture
def copy(built, tmp_path):
    """A private copy of the built dataset's directory."""
    dst = tmp_path / built.root.name
    shutil.copytree(built.root, dst)
    return dst


def _edit_manifest(d: Path, edit) -> Path:
    p = d / MANIFEST
    doc = json.loads(p.read_text())
    edit(doc)
    p.write_text(json.dumps(doc))
    return p


def _refused(fn, *fragments: str) -> DatasetError:
    with pytest.raises(DatasetError) as exc:
        fn()
    for f in fragments:
        assert f in str(exc.value), (f, str(exc.value))
    return exc.value


# ---------------------------------------------------------------------- static unchanged
# Recorded from the static generator before generate() and generate_dynamic() shared their
# message construction (every column of the trace and the topology).
STATIC_HASHES = {
    "tiny": "a9ed5d136be045b482bed918be86e4acbf6dccf9aea93f29b8d3fe35d03b71b1",
    "godaddy": "e21d5f7e25b8a99a729c4f653caeddb162e07748886a884be6e587f66ea7c500",
}


@pytest.mark.parametrize("name", sorted(STATIC_HASHES))
def test_static_generator_is_unchanged(name):
    assert _columns_hash(generate(load_scenario(name))) == STATIC_HASHES[name]


# ---------------------------------------------------------------------- dynamics
def test_dynamics_spec_refuses_bad_values_and_keys():
    with pytest.raises(DSMDError, match="diurnal_amplitude"):
        DynamicsSpec(diurnal_amplitude=1.5)
    with pytest.raises(DSMDError, match="creation_s"):
        DynamicsSpec(creation_s=5.0)  # shorter than an epoch
    with pytest.raises(DSMDError, match="unknown keys"):
        DynamicsSpec.from_dict({"tornadoes": True})
    d = DynamicsSpec()
    assert DynamicsSpec.from_dict(d.to_dict()) == d


def test_dynamic_trace_is_deterministic_and_seeds_differ():
    spec, dyn = _tiny(), DynamicsSpec()
    a = generate_dynamic(spec, dyn, 3, 300.0)
    b = generate_dynamic(spec, dyn, 3, 300.0)
    c = generate_dynamic(spec, dyn, 4, 300.0)
    assert _columns_hash(a) == _columns_hash(b) and a.meta == b.meta
    assert _columns_hash(a) != _columns_hash(c)
    a.trace.validate(a.topology)
    assert np.array_equal(np.unique(a.trace.message_id), a.trace.message_id)


def test_all_off_is_stationary():
    ds = generate_dynamic(_tiny(rate_per_vpc_bps=3e6), DynamicsSpec.off(), 1, 600.0)
    assert all(v == 0 for v in ds.meta["event_counts"].values())
    counts = _request_counts(ds, 10.0)
    # Poisson: index of dispersion near 1 (60 bins), both halves at the same rate
    assert 0.6 < counts.var(ddof=1) / counts.mean() < 1.5
    half = counts.size // 2
    a, b = counts[:half].sum(), counts[half:].sum()
    assert abs(a - b) < 4 * np.sqrt(a + b)
    # unicast messages go to their VM's node of the (unchanged) topology
    t, topo = ds.trace, ds.topology
    uni = t.resource_id >= UNICAST
    vm = (t.resource_id[uni] - UNICAST).astype(np.int64)
    hosts = t.hosts[t.hosts_indptr[:-1][uni]]
    np.testing.assert_array_equal(hosts, topo.node_ids[topo.vm_node[vm]])


def test_bursts_raise_the_load_as_fig10():
    spec = _tiny(rate_per_vpc_bps=3e6)
    dyn = DynamicsSpec.off(bursts=True, bursts_per_hour=12.0, burst_phase_s=60.0)
    base = generate_dynamic(spec, DynamicsSpec.off(), 2, 1200.0)
    burst = generate_dynamic(spec, dyn, 2, 1200.0)
    starts = [b["start_s"] for b in burst.meta["events"]["bursts"]]
    assert starts, "no burst drawn"
    s = starts[0]

    def peak(ds):
        return np.count_nonzero((_seconds(ds) >= s + 130) & (_seconds(ds) < s + 170))

    # the 0.95 phase against the 0.5 base load
    assert 1.5 < peak(burst) / peak(base) < 2.5

    def requests(ds):  # Poisson counts (messages of one request are not independent)
        sec = _seconds(ds)
        inside = (sec >= s + 130) & (sec < s + 170)
        return np.unique(ds.trace.request_id[inside]).size

    a, b = requests(base), requests(burst)
    ratio = b / a
    sigma = ratio * np.sqrt(1 / a + 1 / b)
    assert abs(ratio - 0.95 / 0.5) < 3 * sigma, (ratio, sigma)
    assert len(burst.trace) > len(base.trace)


def test_diurnal_cycle_modulates_the_load():
    dyn = DynamicsSpec.off(diurnal=True, diurnal_amplitude=0.6, diurnal_period_s=600.0)
    ds = generate_dynamic(_tiny(rate_per_vpc_bps=3e6), dyn, 5, 600.0)
    t0 = ds.meta["time_of_day_s"]
    assert ds.meta["start_ns"] == TRACE_EPOCH_NS + int(t0) * 10**9  # time of day = t0
    counts = _request_counts(ds, 30.0)
    mid = np.arange(counts.size) * 30.0 + 15.0
    expected = 1 + 0.6 * np.sin(2 * np.pi * (t0 + mid) / 600.0)
    assert np.corrcoef(counts, expected)[0, 1] > 0.8


def test_flash_crowd_multiplies_its_vpcs_rate():
    dyn = DynamicsSpec.off(flash_crowds=True, flash_crowds_per_hour=30.0, flash_factor=10.0,
                           flash_duration_s=(60.0, 60.0), flash_vpcs=(1, 1))
    ds = generate_dynamic(_tiny(rate_per_vpc_bps=1e6), dyn, 0, 600.0)
    sec = _seconds(ds)
    events = ds.meta["events"]["flash_crowds"]
    assert events
    ev = events[0]
    vpc = ev["vpc_ids"][0]
    mine = ds.trace.vpc_id == vpc
    inside = (sec >= ev["start_s"] + 10) & (sec < ev["start_s"] + ev["duration_s"] - 10)
    rate_in = np.count_nonzero(mine & inside) / (ev["duration_s"] - 20)
    rate_all = np.count_nonzero(mine) / 600.0
    assert rate_in > 3 * rate_all


def test_migrations_move_vms_and_make_new_destination_sets():
    spec, seed = _tiny(), 7
    off = generate_dynamic(spec, DynamicsSpec.off(), seed, 300.0)
    dyn = DynamicsSpec.off(migrations=True, migrations_per_vm_hour=20.0)
    ds = generate_dynamic(spec, dyn, seed, 300.0)
    moves = ds.meta["events"]["migrations"]
    assert len(moves) > 5 and ds.meta["event_counts"]["migrations"] == len(moves)
    # only destinations change (common random numbers), and new destination sets appear
    t, t0 = ds.trace, off.trace
    np.testing.assert_array_equal(t.timestamp_ns, t0.timestamp_ns)
    np.testing.assert_array_equal(t.resource_id, t0.resource_id)

    def sets(tr):
        return {tuple(tr.hosts_of(i)) for i in range(len(tr))}

    assert sets(t) - sets(t0)
    # every unicast message goes to its VM's node at that time, replaying the events
    topo = ds.topology
    node = {int(v): int(n) for v, n in zip(topo.vm_ids, topo.node_ids[topo.vm_node])}
    sec = _seconds(ds)

    def epoch_start(x):  # first epoch with mid >= x
        return np.ceil((x - 5.0) / 10.0) * 10.0

    order = sorted(moves, key=lambda m: m["time_s"])
    k = 0
    for i in np.flatnonzero(t.resource_id >= UNICAST):
        while k < len(order) and epoch_start(order[k]["time_s"]) <= sec[i]:
            assert node[order[k]["vm_id"]] == order[k]["from_node"]
            node[order[k]["vm_id"]] = order[k]["to_node"]
            k += 1
        vm_id = int(t.resource_id[i] - UNICAST) + 1
        assert int(t.hosts_of(i)[0]) == node[vm_id]


def test_deletion_ends_with_delete_burst_then_silence():
    dyn = DynamicsSpec.off(lifecycles=True, inactive_fraction=0.0, creations_per_hour=0.0,
                           deletions_per_hour=30.0, deletion_s=30.0)
    ds = generate_dynamic(_tiny(), dyn, 1, 600.0)
    dels = ds.meta["events"]["deletions"]
    assert dels
    sec, t = _seconds(ds), ds.trace
    for ev in dels:
        mine = t.vpc_id == ev["vpc_id"]
        after = mine & (sec >= ev["time_s"] + 30.0 + 10.0)
        assert not after.any(), f"VPC {ev['vpc_id']} sent after its deletion"
        burst = mine & (sec >= ev["time_s"] + 10.0) & (sec < ev["time_s"] + 30.0)
        assert burst.sum() >= 5
        assert np.mean(t.operation_type[burst] == OP[OT.DELETE]) > 0.7


def test_creation_burst_is_create_of_ports_and_subnets_on_new_nodes():
    dyn = DynamicsSpec.off(lifecycles=True, inactive_fraction=0.5, creations_per_hour=30.0,
                           deletions_per_hour=0.0, creation_s=60.0, creation_boost=10.0)
    ds = generate_dynamic(_tiny(), dyn, 2, 600.0)
    made = ds.meta["events"]["creations"]
    assert made and {e["vpc_id"] for e in made} <= set(ds.meta["initially_inactive_vpc_ids"])
    sec, t, topo = _seconds(ds), ds.trace, ds.topology
    moved = 0
    for ev in made:
        mine = t.vpc_id == ev["vpc_id"]
        assert not (mine & (sec < ev["time_s"] - 10.0)).any(), "traffic before its creation"
        burst = mine & (sec >= ev["time_s"] + 10.0) & (sec < ev["time_s"] + 50.0)
        later = mine & (sec >= ev["time_s"] + 70.0)
        if later.any():  # boosted rate during the creation burst
            assert burst.sum() / 40.0 > 3 * later.sum() / (600.0 - ev["time_s"] - 70.0)
        assert np.mean(t.operation_type[burst] == OP[OT.CREATE]) > 0.7
        cfg = t.configuration_type[burst]
        assert np.mean(np.isin(cfg, [CFG[CT.PORT], CFG[CT.SUBNET]])) > 0.7
        # unicast messages go to the VMs' new nodes
        uni = np.flatnonzero(mine & (t.resource_id >= UNICAST))
        vm = (t.resource_id[uni] - UNICAST).astype(np.int64)
        initial = topo.node_ids[topo.vm_node[vm]]
        moved += int(np.count_nonzero(t.hosts[t.hosts_indptr[uni]] != initial))
    assert moved > 0


# ---------------------------------------------------------------------- specs
def test_named_specs_and_overrides():
    g = load_dataset_spec("godaddy_online")
    assert (g.scenario, g.num_traces, g.duration_s) == ("godaddy", 50, 3600.0)
    assert [g.trace_splits().count(s) for s in ("train", "validation", "test")] == [30, 10, 10]
    scn = g.scenario_spec()
    assert (scn.num_topics, scn.interval_s, scn.controller_cpu) == (200, 30.0, 640)
    assert scn.duration_s == 3600.0 and scn.phases == ()
    t = load_dataset_spec("tiny_online", dynamics={"bursts": False})
    assert not t.dynamics.bursts and t.dynamics.diurnal  # merged key by key
    assert len({t.trace_seed(i) for i in range(100)}) == 100
    with pytest.raises(DSMDError, match="unknown dataset"):
        load_dataset_spec("nope")
    with pytest.raises(DSMDError, match="unknown keys"):
        load_dataset_spec("tiny_online", colour="red")
    with pytest.raises(DSMDError, match="overrides may not set"):
        load_dataset_spec("tiny_online", overrides={"seed": 3})


# ---------------------------------------------------------------------- datasets
def test_same_spec_same_bytes_other_seed_differs(built, tmp_path):
    again = build_dataset(_small_spec(), tmp_path / "a")
    other = build_dataset(_small_spec(seed=1), tmp_path / "b")

    def sha(ds):
        return [json.loads(ds.manifest_path.read_text())["traces"][i]["sha256"]
                for i in range(len(ds))]

    assert sha(again) == sha(built)
    assert again.root.name == built.root.name
    assert other.root.name != built.root.name
    assert all(a["messages.parquet"] != b["messages.parquet"]
               for a, b in zip(sha(other), sha(built)))
    assert not {r.seed for r in other.traces()} & {r.seed for r in built.traces()}


def test_manifest_round_trip(built):
    ds = open_dataset(built.root)
    assert ds.spec == _small_spec() and ds.scenario == built.scenario
    assert ds.scenario.num_topics == 2 and ds.scenario.duration_s == 120.0
    assert [r.split for r in ds.traces()] == ["train", "validation", "test"]
    assert ds.traces("train") + ds.traces("validation") + ds.traces("test") == ds.traces()
    for rec in ds.traces():
        assert isinstance(rec, TraceRecord)
        d = ds.load(rec.id)
        assert len(d.trace) == rec.num_messages and d.meta["seed"] == rec.seed
        assert d.meta["event_counts"] == rec.events and d.meta["trace_id"] == rec.id
        assert rec.duration_s == 120.0 and rec.path.parent == ds.root
    assert ds.load(rec.id) is ds.load(rec.id)  # cached
    with pytest.raises(DSMDError, match="unknown split 'training'"):
        ds.traces("training")


def test_cached_rebuild_and_interrupted_build(tmp_path, monkeypatch):
    calls = []
    real = dataset_mod.generate_dynamic

    def counting(*a, **k):
        calls.append(a[2])
        if fail_at and len(calls) == fail_at:
            raise KeyboardInterrupt("interrupted")
        return real(*a, **k)

    fail_at = 2
    monkeypatch.setattr(dataset_mod, "generate_dynamic", counting)
    spec = _small_spec()
    with pytest.raises(KeyboardInterrupt):
        build_dataset(spec, tmp_path)
    d = tmp_path / f"{spec.name}-{spec.key()}"
    _refused(lambda: open_dataset(d), "manifest.json", "not found")  # nothing reads as valid
    fail_at, calls[:] = 0, []
    ds = build_dataset(spec, tmp_path)
    assert len(calls) == 2  # the first trace was kept
    calls.clear()
    build_dataset(spec, tmp_path)
    assert calls == []  # fully cached
    shutil.rmtree(ds.traces()[1].path)
    build_dataset(spec, tmp_path, progress=True)
    assert calls == [ds.traces()[1].seed]  # only the missing trace
    # a tampered trace is regenerated, not blessed
    calls.clear()
    f = ds.traces()[2].path / "scenario.json"
    f.write_text(f.read_text().replace('"tiny"', '"tinY"'))
    rebuilt = build_dataset(spec, tmp_path)
    assert calls == [ds.traces()[2].seed]
    rebuilt.load(ds.traces()[2].id)


def test_progress_lines_without_a_terminal(tmp_path, capsys):
    build_dataset(_small_spec(num_traces=1), tmp_path, progress=True)
    err = capsys.readouterr().err
    assert "tiny_online: 1/1 tiny_online-000 generated" in err


# ---------------------------------------------------------------------- refusals
def test_refuses_missing_file(copy):
    (copy / "tiny_online-001" / "nodes.parquet").unlink()
    _refused(lambda: open_dataset(copy), str(copy / MANIFEST), "trace 'tiny_online-001'",
             "field 'sha256' of nodes.parquet", "not found")


def test_refuses_checksum_mismatch_before_use(copy):
    f = copy / "tiny_online-000" / "messages.parquet"
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0xFF  # same size: found on load, before the data is used
    f.write_bytes(bytes(b))
    ds = open_dataset(copy)
    _refused(lambda: ds.load("tiny_online-000"), str(copy / MANIFEST),
             "trace 'tiny_online-000'", "field 'sha256' of messages.parquet",
             "does not match the file")
    ds.load("tiny_online-001")  # the others are fine


def test_refuses_truncated_file(copy):
    f = copy / "tiny_online-002" / "vms.parquet"
    f.write_bytes(f.read_bytes()[:-10])
    _refused(lambda: open_dataset(copy), "trace 'tiny_online-002'", "field 'bytes' of vms.parquet")


@pytest.mark.parametrize("field,value,fragment", [
    ("num_messages", "12", "expected an integer"),
    ("duration_s", None, "expected an integer or a number"),
    ("events", [], "expected an object"),
])
def test_refuses_wrong_types(copy, field, value, fragment):
    def edit(doc):
        doc["traces"][1][field] = value
    p = _edit_manifest(copy, edit)
    _refused(lambda: open_dataset(copy), str(p), "trace 'tiny_online-001'", f"field '{field}'",
             fragment)


def test_refuses_tampered_message_count_on_load(copy):
    def edit(doc):
        doc["traces"][0]["num_messages"] += 1
    p = _edit_manifest(copy, edit)
    ds = open_dataset(copy)
    _refused(lambda: ds.load("tiny_online-000"), str(p), "trace 'tiny_online-000'",
             "field 'num_messages'")


def test_refuses_tampered_seed_and_spec(copy):
    def edit(doc):
        doc["traces"][1]["seed"] += 1
    p = _edit_manifest(copy, edit)
    _refused(lambda: open_dataset(copy), str(p), "trace 'tiny_online-001'", "field 'seed'")

    def edit2(doc):
        doc["traces"][1]["seed"] -= 1
        doc["spec"]["num_traces"] = 4
    _edit_manifest(copy, edit2)
    _refused(lambda: open_dataset(copy), str(p), "field 'traces'", "num_traces = 4")


@pytest.mark.parametrize("where", ["top", "trace", "events"])
def test_refuses_unknown_keys(copy, where):
    def edit(doc):
        if where == "top":
            doc["colour"] = "red"
        elif where == "trace":
            doc["traces"][2]["colour"] = "red"
        else:
            doc["traces"][2]["events"]["tornadoes"] = 1
    p = _edit_manifest(copy, edit)
    err = _refused(lambda: open_dataset(copy), str(p))
    if where == "events":
        assert "field 'events'" in str(err) and "tornadoes" in str(err)
    else:
        assert "field 'colour'" in str(err) and "unknown key" in str(err)
    if where != "top":
        assert "trace 'tiny_online-002'" in str(err)


def test_refuses_missing_key_and_format_version(copy):
    def edit(doc):
        del doc["traces"][0]["events"]
    p = _edit_manifest(copy, edit)
    _refused(lambda: open_dataset(copy), str(p), "trace 'tiny_online-000'", "field 'events'",
             "missing")

    def edit2(doc):
        doc["traces"][0]["events"] = {}
        doc["format_version"] = 99
    _edit_manifest(copy, edit2)
    _refused(lambda: open_dataset(copy), str(p), "field 'format_version'", "expected 1")


def test_refuses_seed_shared_across_splits(copy):
    def edit(doc):
        doc["traces"][2]["seed"] = doc["traces"][0]["seed"]  # test reuses a train seed
    p = _edit_manifest(copy, edit)
    _refused(lambda: open_dataset(copy), str(p), "trace 'tiny_online-002'", "field 'seed'",
             "shared with trace 'tiny_online-000' of split 'train'")


def test_refuses_bad_split_name(copy, built, tmp_path):
    def edit(doc):
        doc["traces"][1]["split"] = "training"
    p = _edit_manifest(copy, edit)
    _refused(lambda: open_dataset(copy), str(p), "trace 'tiny_online-001'", "field 'split'",
             "unknown split 'training'")
    dirs = [r.path for r in built.traces()]
    _refused(lambda: import_traces(tmp_path, "real", {"training": dirs}, "tiny"),
             str(tmp_path / "real" / MANIFEST), "field 'split'")


def test_refuses_missing_or_invalid_manifest(tmp_path):
    _refused(lambda: open_dataset(tmp_path), str(tmp_path / MANIFEST), "not found")
    (tmp_path / MANIFEST).write_text("{not json")
    _refused(lambda: open_dataset(tmp_path), str(tmp_path / MANIFEST), "not valid JSON")


# ---------------------------------------------------------------------- real traces
def test_import_real_traces(built, tmp_path):
    # a live capture: the adapter's flush_trace output (messages.parquet) + the topology
    src = built.load(built.traces()[0].id)
    live = tmp_path / "captures" / "live-0001"
    live.mkdir(parents=True)
    write_trace(src.trace, live / "messages.parquet")
    src.topology.write(live)
    recs = built.traces()
    ds = import_traces(tmp_path / "imported", "real", {"train": [live, recs[1].path],
                                                        "test": [recs[2].path]}, "tiny")
    assert ds.kind == "imported" and ds.scenario == load_scenario("tiny")
    assert [r.split for r in ds.traces()] == ["train", "train", "test"]
    assert ds.traces()[0].seed is None and ds.traces()[1].seed == recs[1].seed
    again = open_dataset(tmp_path / "imported" / "real")
    assert len(again.load("live-0001").trace) == len(src.trace)
    assert again.load(recs[2].id).meta["seed"] == recs[2].seed
    # a capture changed after the import is refused on load
    f = live / "messages.parquet"
    b = bytearray(f.read_bytes())
    b[100] ^= 0xFF
    f.write_bytes(bytes(b))
    _refused(lambda: open_dataset(tmp_path / "imported" / "real").load("live-0001"),
             "trace 'live-0001'", "field 'sha256' of messages.parquet")
    # a directory without a valid trace is refused at import
    (tmp_path / "empty").mkdir()
    _refused(lambda: import_traces(tmp_path / "imported", "bad", {"train": [tmp_path / "empty"]},
                                   "tiny"), "trace 'empty'", "field 'path'")
