"""Datasets of many traces: generated with dynamics, stored with a checked manifest.

A :class:`DatasetSpec` names a scenario (topology, traffic, capacities, K, T), the
dynamics (:class:`~envs.dsmd.dynamics.DynamicsSpec`), how many traces of how long, a base
seed and the split of the traces into train / validation / test. Named specs live in
``configs/dataset/<name>.yaml`` (a Hydra config group); :func:`load_dataset_spec` reads
them.

:func:`build_dataset` generates the traces (cached and reproducible) into
``<root>/<name>-<hash of spec>/``: one sub-directory per trace in the
:func:`~envs.dsmd.traces.write_dataset` layout, and ``manifest.json`` listing every trace
(id, seed, split, events, duration, message count, size and sha256 of every file).
Trace ``i`` has the seed ``derive_seed(seed, "dataset-trace", i)``, so no two traces (and
no two splits) share a seed. Each trace directory is written atomically and the manifest
is written last (atomically), so an interrupted build leaves no manifest that could be
read as valid; re-running it generates only the missing traces.

:func:`open_dataset` checks the manifest (keys, types, format version, splits, seeds, the
spec's ids / seeds / splits) and that every file exists with its recorded size;
:meth:`TraceDataset.load` checks a trace's sha256 and message count before any of its data
is used. Every refusal is a :class:`~envs.dsmd.errors.DatasetError` naming the file, the
trace and the field. :func:`import_traces` writes a manifest of the same schema over
existing trace directories (real traces), with the split given by the user.

``datasets/README.md`` ("Trace datasets with dynamics") documents all of it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from ..progress import Progress
from ..seeding import derive_seed
from .dynamics import EVENT_KINDS, DynamicsSpec, dynamic_trace_key, generate_dynamic
from .errors import DatasetError, DSMDError
from .problems import DATASETS_DIR, SPLITS
from .scenarios import ScenarioSpec, load_scenario
from .traces import Dataset, read_dataset, write_dataset

__all__ = [
    "DATASET_CONFIG_DIR",
    "FORMAT_VERSION",
    "MANIFEST",
    "TRACE_FILES",
    "DatasetSpec",
    "TraceDataset",
    "TraceRecord",
    "build_dataset",
    "import_traces",
    "load_dataset_spec",
    "open_dataset",
]

DATASET_CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "dataset"
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
#: The files every trace directory must have (``scenario.json`` is recorded when present).
TRACE_FILES = ("messages.parquet", "nodes.parquet", "vms.parquet")
_KINDS = ("generated", "imported")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
#: Scenario keys that a dataset sets itself (per trace), so they cannot be overridden.
_OWN_KEYS = ("name", "phases", "duration_s", "seed", "split")


# ---------------------------------------------------------------------- spec
@dataclass(frozen=True)
class DatasetSpec:
    """A dataset of ``num_traces`` traces of ``duration_s`` seconds of one scenario.

    ``overrides`` change the scenario (any :class:`ScenarioSpec` key but name, phases,
    duration_s, seed and split, which the dataset sets). ``split`` divides the *traces*
    into train / validation / test (contiguous by index); ``time_split`` is the scenario
    split for users who split each trace by time (it becomes the scenario's ``split``).
    """

    name: str
    scenario: str
    num_traces: int
    duration_s: float = 3600.0
    seed: int = 0
    split: tuple[float, float, float] = (0.6, 0.2, 0.2)
    time_split: tuple[float, float, float] = (0.6, 0.2, 0.2)
    overrides: dict[str, Any] = field(default_factory=dict)
    dynamics: DynamicsSpec = field(default_factory=DynamicsSpec)

    def __post_init__(self) -> None:
        p: list[str] = []
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            p.append(f"name must be letters, digits, '_', '.' or '-', got {self.name!r}")
        if not isinstance(self.num_traces, int) or self.num_traces < 1:
            p.append(f"num_traces must be a positive integer, got {self.num_traces!r}")
        if not self.duration_s > 0:
            p.append(f"duration_s must be positive, got {self.duration_s}")
        if not isinstance(self.seed, int) or self.seed < 0:
            p.append(f"seed must be a non-negative integer, got {self.seed!r}")
        for k in ("split", "time_split"):
            v = getattr(self, k)
            if len(v) != 3 or min(v) < 0 or abs(sum(v) - 1.0) > 1e-9:
                p.append(f"{k} must be three non-negative fractions summing to 1, got {v}")
        own = sorted(set(self.overrides) & set(_OWN_KEYS))
        if own:
            p.append(f"overrides may not set {own} (the dataset sets them)")
        if p:
            raise DSMDError(f"dataset '{self.name}': " + "; ".join(p))

    # ------------------------------------------------------------------ conversions
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DatasetSpec:
        """From a mapping (YAML / JSON); unknown or missing keys are refused."""
        d = dict(d)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise DSMDError(f"dataset '{d.get('name', '?')}': unknown keys {unknown}; known: "
                            f"{', '.join(sorted(known))}")
        for k in ("split", "time_split"):
            if k in d:
                d[k] = tuple(float(x) for x in d[k])
        if "duration_s" in d:
            d["duration_s"] = float(d["duration_s"])
        d["overrides"] = dict(d.get("overrides") or {})
        dyn = d.get("dynamics")
        d["dynamics"] = dyn if isinstance(dyn, DynamicsSpec) else DynamicsSpec.from_dict(dyn)
        try:
            return cls(**d)
        except TypeError as e:  # a required key is missing
            raise DSMDError(f"dataset '{d.get('name', '?')}': {e}") from None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["split"] = list(self.split)
        d["time_split"] = list(self.time_split)
        d["overrides"] = json.loads(json.dumps(self.overrides))  # lists, not tuples
        d["dynamics"] = self.dynamics.to_dict()
        return d

    def replace(self, **changes: Any) -> DatasetSpec:
        return DatasetSpec.from_dict({**self.to_dict(), **changes})

    # ------------------------------------------------------------------ derived
    def scenario_spec(self) -> ScenarioSpec:
        """The scenario the traces are drawn from: the named scenario with ``overrides``,
        ``duration_s`` per trace, no scripted phases, the base ``seed`` and ``time_split``."""
        base = load_scenario(self.scenario, **self.overrides)
        return base.replace(duration_s=self.duration_s, phases=[], seed=self.seed,
                            split=list(self.time_split))

    def key(self) -> str:
        """Content hash of the spec and the scenario it resolves to (the cache key)."""
        blob = json.dumps({"format": FORMAT_VERSION, "spec": self.to_dict(),
                           "scenario": self.scenario_spec().to_dict()}, sort_keys=True)
        return hashlib.blake2b(blob.encode(), digest_size=6).hexdigest()

    def trace_id(self, i: int) -> str:
        return f"{self.name}-{i:0{max(3, len(str(self.num_traces - 1)))}d}"

    def trace_seed(self, i: int) -> int:
        return derive_seed(self.seed, "dataset-trace", i)

    def trace_splits(self) -> list[str]:
        """The split of each trace (contiguous: the first traces train, then validation,
        then test); a split with a positive fraction gets at least one trace when there are
        enough."""
        counts = _split_counts(self.num_traces, self.split)
        return [s for s, c in zip(SPLITS, counts) for _ in range(c)]


def _split_counts(n: int, fractions: tuple[float, float, float]) -> list[int]:
    cuts = np.rint(np.cumsum(fractions) * n).astype(int)
    cuts[-1] = n
    counts: list[int] = np.diff(np.concatenate([[0], cuts])).tolist()
    wanted = [j for j, f in enumerate(fractions) if f > 0]
    if n >= len(wanted):
        for j in wanted:
            if counts[j] == 0:
                counts[int(np.argmax(counts))] -= 1
                counts[j] += 1
    return counts


def load_dataset_spec(name: str, **overrides: Any) -> DatasetSpec:
    """The named dataset spec of ``configs/dataset/<name>.yaml``, with overrides.

    ``dynamics={...}`` and ``overrides={...}`` are merged into the file's blocks key by
    key; other keys replace the file's values."""
    path = DATASET_CONFIG_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in DATASET_CONFIG_DIR.glob("*.yaml"))
        raise DSMDError(f"unknown dataset '{name}'; known: {', '.join(known)}")
    import yaml

    d = yaml.safe_load(path.read_text()) or {}
    for k in ("dynamics", "overrides"):
        if k in overrides and isinstance(overrides[k], Mapping):
            overrides[k] = {**(d.get(k) or {}), **overrides[k]}
    d.update(overrides)
    return DatasetSpec.from_dict(d)


# ---------------------------------------------------------------------- records
@dataclass(frozen=True)
class TraceRecord:
    """One trace of a dataset, as its manifest lists it (``seed`` is None for an imported
    trace; ``events`` counts each dynamic's events, empty when unknown)."""

    id: str
    seed: int | None
    split: str
    path: Path
    duration_s: float
    num_messages: int
    events: Mapping[str, int]


_ENTRY_KEYS = {"id": str, "seed": (int, type(None)), "split": str, "path": str,
               "duration_s": (int, float), "num_messages": int, "events": dict,
               "sha256": dict, "bytes": dict}
_TOP_KEYS = {"format_version": int, "name": str, "kind": str, "spec": dict, "scenario": dict,
             "traces": list}


class TraceDataset:
    """A checked dataset of traces: its spec, scenario, and the traces by split.

    Traces are loaded on demand (:meth:`load`): their files' sha256 and message count are
    checked first; the last ``cache_size`` loaded traces are kept in memory.
    """

    def __init__(self, manifest_path: Path, manifest: dict[str, Any], spec: DatasetSpec,
                 scenario: ScenarioSpec, cache_size: int = 4) -> None:
        self.manifest_path = manifest_path
        self.root = manifest_path.parent
        self.kind: str = manifest["kind"]
        self.spec = spec
        self.scenario = scenario
        self._entries = {t["id"]: t for t in manifest["traces"]}
        self._records = [TraceRecord(t["id"], t["seed"], t["split"], self._path(t),
                                     float(t["duration_s"]), int(t["num_messages"]),
                                     dict(t["events"])) for t in manifest["traces"]]
        self._by_id = {r.id: r for r in self._records}
        self._cache: OrderedDict[str, Dataset] = OrderedDict()
        self._cache_size = cache_size

    def entry(self, trace_id: str) -> dict[str, Any]:
        """The manifest's record of a trace (seed, split, counts, files' sha256)."""
        if trace_id not in self._entries:
            raise DatasetError(self.manifest_path, "no such trace", trace=trace_id)
        return dict(self._entries[trace_id])

    def _path(self, entry: dict[str, Any]) -> Path:
        return Path(os.path.normpath(self.root / entry["path"]))

    def __len__(self) -> int:
        return len(self._records)

    def __repr__(self) -> str:
        counts = {s: len(self.traces(s)) for s in SPLITS}
        return (f"TraceDataset({self.spec.name!r}, {self.kind}, {len(self)} traces {counts}, "
                f"root={str(self.root)!r})")

    def traces(self, split: str = "all") -> list[TraceRecord]:
        """The traces of ``split`` (``train``, ``validation``, ``test`` or ``all``)."""
        if split == "all":
            return list(self._records)
        if split not in SPLITS:
            raise DSMDError(f"unknown split '{split}'; expected one of {', '.join(SPLITS)} "
                            "or all")
        return [r for r in self._records if r.split == split]

    def record(self, trace_id: str) -> TraceRecord:
        try:
            return self._by_id[trace_id]
        except KeyError:
            raise DSMDError(f"dataset '{self.spec.name}' has no trace '{trace_id}'") from None

    def load(self, trace_id: str) -> Dataset:
        """The trace's dataset (topology, messages, metadata), checked against the manifest
        (every file's sha256 before it is parsed, then the message count and seed)."""
        rec = self.record(trace_id)
        ds = self._cache.get(trace_id)
        if ds is not None:
            self._cache.move_to_end(trace_id)
            return ds
        entry = self._entries[trace_id]
        for name, digest in entry["sha256"].items():
            f = rec.path / name
            if not f.is_file():
                raise DatasetError(self.manifest_path, f"file {f} not found", trace=rec.id,
                                   field="sha256", file=name)
            got = _sha256(f)
            if got != digest:
                raise DatasetError(self.manifest_path, f"does not match the file {f} "
                                   f"(manifest {digest[:12]}..., file {got[:12]}...)",
                                   trace=rec.id, field="sha256", file=name)
        ds = read_dataset(rec.path)
        _check_loaded(self.manifest_path, rec, ds)
        self._cache[trace_id] = ds
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return ds

    def datasets(self, split: str = "all") -> Iterable[tuple[TraceRecord, Dataset]]:
        """(record, dataset) for every trace of ``split``, loaded one at a time."""
        for rec in self.traces(split):
            yield rec, self.load(rec.id)


def _check_loaded(manifest: Path, rec: TraceRecord, ds: Dataset) -> None:
    if len(ds.trace) != rec.num_messages:
        raise DatasetError(manifest, f"manifest says {rec.num_messages}, messages.parquet has "
                           f"{len(ds.trace)} rows", trace=rec.id, field="num_messages")
    if rec.seed is not None and ds.meta.get("seed") != rec.seed:
        raise DatasetError(manifest, f"manifest says {rec.seed}, scenario.json says "
                           f"{ds.meta.get('seed')}", trace=rec.id, field="seed")
    dur = _duration(ds)
    if not math.isclose(dur, rec.duration_s, rel_tol=1e-9, abs_tol=1e-6):
        raise DatasetError(manifest, f"manifest says {rec.duration_s}, the trace has {dur}",
                           trace=rec.id, field="duration_s")


def _duration(ds: Dataset) -> float:
    """The trace's duration: ``scenario.json``'s ``duration_s``, else its time span."""
    d = ds.meta.get("duration_s")
    return float(d) if isinstance(d, (int, float)) else ds.trace.duration_s


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ---------------------------------------------------------------------- manifest checks
def _check_keys(path: Path, d: dict, want: dict[str, Any], trace: str | None = None,
                where: str = "") -> None:
    for k in d:
        if k not in want:
            raise DatasetError(path, f"unknown key{where}; known: {', '.join(want)}",
                               trace=trace, field=k)
    for k, typ in want.items():
        if k not in d:
            raise DatasetError(path, f"missing{where}", trace=trace, field=k)
        v = d[k]
        if not isinstance(v, typ) or (isinstance(v, bool) and typ is not bool):
            raise DatasetError(path, f"expected {_type_name(typ)}, got {type(v).__name__} "
                               f"{v!r:.60}", trace=trace, field=k)


def _type_name(typ: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string", dict: "an object",
             list: "a list", type(None): "null"}
    typs = typ if isinstance(typ, tuple) else (typ,)
    return " or ".join(names.get(t, t.__name__) for t in typs)


def _check_manifest(path: Path, doc: Any) -> tuple[DatasetSpec, ScenarioSpec]:
    """Every check of the manifest itself (not the files); returns its spec and scenario."""
    if not isinstance(doc, dict):
        raise DatasetError(path, f"expected a JSON object, got {type(doc).__name__}")
    _check_keys(path, doc, _TOP_KEYS)
    if doc["format_version"] != FORMAT_VERSION:
        raise DatasetError(path, f"expected {FORMAT_VERSION}, got {doc['format_version']}",
                           field="format_version")
    if doc["kind"] not in _KINDS:
        raise DatasetError(path, f"expected one of {', '.join(_KINDS)}, got {doc['kind']!r}",
                           field="kind")
    try:
        spec = DatasetSpec.from_dict(doc["spec"])
    except DSMDError as e:
        raise DatasetError(path, str(e), field="spec") from None
    try:
        scenario = ScenarioSpec.from_dict(doc["scenario"])
    except DSMDError as e:
        raise DatasetError(path, str(e), field="scenario") from None
    if spec.name != doc["name"]:
        raise DatasetError(path, f"{doc['name']!r} but the spec says {spec.name!r}",
                           field="name")
    seen: dict[str, str] = {}
    seeds: dict[int, dict[str, Any]] = {}
    for i, t in enumerate(doc["traces"]):
        _check_trace_entry(path, t, i, seen, seeds, doc["kind"])
    if doc["kind"] == "generated":
        _check_generated(path, doc["traces"], spec)
    return spec, scenario


def _check_trace_entry(path: Path, t: Any, i: int, seen: dict[str, str],
                       seeds: dict[int, dict[str, Any]], kind: str) -> None:
    if not isinstance(t, dict):
        raise DatasetError(path, f"expected an object, got {type(t).__name__}",
                           field=f"traces[{i}]")
    raw_id = t.get("id")
    tid = raw_id if isinstance(raw_id, str) else f"#{i}"
    _check_keys(path, t, _ENTRY_KEYS, trace=tid)
    if not t["id"]:
        raise DatasetError(path, "empty trace id", trace=tid, field="id")
    if t["id"] in seen:
        raise DatasetError(path, "listed twice", trace=tid, field="id")
    seen[t["id"]] = t["split"]
    if t["split"] not in SPLITS:
        raise DatasetError(path, f"unknown split {t['split']!r}; expected one of "
                           f"{', '.join(SPLITS)}", trace=tid, field="split")
    if kind == "generated" and t["seed"] is None:
        raise DatasetError(path, "a generated trace needs its seed", trace=tid, field="seed")
    if t["seed"] is not None:
        if t["seed"] < 0:
            raise DatasetError(path, f"negative seed {t['seed']}", trace=tid, field="seed")
        other = seeds.get(t["seed"])
        if other is not None and other["split"] != t["split"]:
            raise DatasetError(path, f"seed {t['seed']} is shared with trace '{other['id']}' "
                               f"of split '{other['split']}' (this trace is in "
                               f"'{t['split']}')", trace=tid, field="seed")
        seeds.setdefault(t["seed"], t)
    if t["duration_s"] < 0 or t["num_messages"] < 0:
        bad = "duration_s" if t["duration_s"] < 0 else "num_messages"
        raise DatasetError(path, f"negative value {t[bad]}", trace=tid, field=bad)
    _check_events(path, tid, t["events"], kind)
    _check_files(path, tid, t["sha256"], t["bytes"])


def _check_events(path: Path, tid: str, events: dict, kind: str) -> None:
    for k, v in events.items():
        if k not in EVENT_KINDS:
            raise DatasetError(path, f"unknown event kind {k!r}; known: "
                               f"{', '.join(EVENT_KINDS)}", trace=tid, field="events")
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise DatasetError(path, f"count of {k} must be a non-negative integer, got {v!r}",
                               trace=tid, field="events")
    missing = [k for k in EVENT_KINDS if k not in events]
    if kind == "generated" and missing:
        raise DatasetError(path, f"missing counts of {missing}", trace=tid, field="events")


def _check_files(path: Path, tid: str, sha: dict, size: dict) -> None:
    for f in TRACE_FILES:
        if f not in sha:
            raise DatasetError(path, "missing", trace=tid, field="sha256", file=f)
    for f, digest in sha.items():
        if "/" in f or f.startswith("."):
            raise DatasetError(path, "not a file name of the trace directory", trace=tid,
                               field="sha256", file=f)
        if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
            raise DatasetError(path, f"expected 64 hex digits, got {digest!r:.70}", trace=tid,
                               field="sha256", file=f)
    if set(size) != set(sha):
        odd = sorted(set(size) ^ set(sha))[0]
        raise DatasetError(path, "files of 'bytes' and 'sha256' differ", trace=tid,
                           field="bytes", file=odd)
    for f, n in size.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise DatasetError(path, f"expected a non-negative integer, got {n!r}", trace=tid,
                               field="bytes", file=f)


def _check_generated(path: Path, traces: list[dict], spec: DatasetSpec) -> None:
    """A generated dataset's traces are exactly the spec's: ids, seeds and splits."""
    if len(traces) != spec.num_traces:
        raise DatasetError(path, f"{len(traces)} traces listed, the spec has num_traces = "
                           f"{spec.num_traces}", field="traces")
    for i, (t, split) in enumerate(zip(traces, spec.trace_splits())):
        for k, want in (("id", spec.trace_id(i)), ("seed", spec.trace_seed(i)),
                        ("split", split)):
            if t[k] != want:
                raise DatasetError(path, f"{t[k]!r} but the spec gives trace {i} {want!r}",
                                   trace=t["id"], field=k)


def _check_present(path: Path, root: Path, traces: list[dict]) -> None:
    """Every file exists with its recorded size (cheap; checksums are checked on load)."""
    for t in traces:
        d = Path(os.path.normpath(root / t["path"]))
        if not d.is_dir():
            raise DatasetError(path, f"trace directory {d} not found", trace=t["id"],
                               field="path")
        for name, n in t["bytes"].items():
            f = d / name
            if not f.is_file():
                raise DatasetError(path, f"file {f} not found", trace=t["id"], field="sha256",
                                   file=name)
            got = f.stat().st_size
            if got != n:
                raise DatasetError(path, f"manifest says {n} bytes, {f} has {got}",
                                   trace=t["id"], field="bytes", file=name)


def open_dataset(path: str | Path, cache_size: int = 4) -> TraceDataset:
    """Open a dataset (its directory or its ``manifest.json``), checking the manifest and
    that every file is there with its recorded size; checksums are checked on load."""
    p = Path(path)
    manifest = p / MANIFEST if p.is_dir() or p.name != MANIFEST else p
    if not manifest.is_file():
        raise DatasetError(manifest, "file not found (no dataset here, or its build did "
                           "not finish)")
    try:
        doc = json.loads(manifest.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(manifest, f"not valid JSON ({e})") from None
    spec, scenario = _check_manifest(manifest, doc)
    _check_present(manifest, manifest.parent, doc["traces"])
    return TraceDataset(manifest, doc, spec, scenario, cache_size)


# ---------------------------------------------------------------------- writing
def _file_entries(d: Path) -> tuple[dict[str, str], dict[str, int]]:
    names = sorted(f.name for f in d.iterdir() if f.is_file() and not f.name.startswith("."))
    return ({n: _sha256(d / n) for n in names}, {n: (d / n).stat().st_size for n in names})


def _write_manifest(path: Path, doc: dict[str, Any]) -> None:
    """Write ``manifest.json`` atomically (temporary file, fsync, rename)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(doc, indent=1, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _entry(tid: str, seed: int | None, split: str, rel: str, duration_s: float,
           num_messages: int, events: dict[str, int], d: Path) -> dict[str, Any]:
    sha, size = _file_entries(d)
    return {"id": tid, "seed": seed, "split": split, "path": rel, "duration_s": duration_s,
            "num_messages": num_messages, "events": events, "sha256": sha, "bytes": size}


def build_dataset(spec: DatasetSpec, root: str | Path = DATASETS_DIR, progress: bool = False
                  ) -> TraceDataset:
    """Generate the dataset into ``<root>/<name>-<hash>/`` (or reuse what is there).

    Traces already written for this spec are kept when they check out (against the
    existing manifest's sha256 when it lists them, else, for a trace left by an interrupted
    build, by reading and validating it); only missing or changed traces are generated.
    The manifest is written last, and only when it changes.
    """
    d = Path(root) / f"{spec.name}-{spec.key()}"
    manifest = d / MANIFEST
    old = _old_entries(manifest, spec)
    d.mkdir(parents=True, exist_ok=True)
    scenario = spec.scenario_spec()
    # a bar only when something may have to be generated (a cached dataset is only checked)
    bar = Progress(progress and len(old) < spec.num_traces, spec.num_traces, spec.name)
    entries = []
    try:
        for i, split in enumerate(spec.trace_splits()):
            entry, made = _build_trace(spec, scenario, d, i, split, old.get(i))
            entries.append(entry)
            bar.step(f"{entry['id']} {'generated' if made else 'kept'} "
                     f"({entry['num_messages']:,} messages)")
    finally:
        bar.close()
    if entries != [old.get(i) for i in range(spec.num_traces)]:
        doc = {"format_version": FORMAT_VERSION, "name": spec.name, "kind": "generated",
               "spec": spec.to_dict(), "scenario": scenario.to_dict(), "traces": entries}
        _check_manifest(manifest, doc)
        _write_manifest(manifest, doc)
    return open_dataset(d)


def _old_entries(manifest: Path, spec: DatasetSpec) -> dict[int, dict]:
    """Trace index -> entry of an existing, well-formed manifest of ``spec`` ({} if none)."""
    if not manifest.is_file():
        return {}
    try:
        doc = json.loads(manifest.read_text())
        _check_manifest(manifest, doc)
    except (DatasetError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    if doc["spec"] != spec.to_dict():
        return {}
    return dict(enumerate(doc["traces"]))


def _present(manifest: Path, entry: dict) -> bool:
    try:
        _check_present(manifest, manifest.parent, [entry])
    except DatasetError:
        return False
    return True


def _build_trace(spec: DatasetSpec, scenario: ScenarioSpec, d: Path, i: int, split: str,
                 old: dict | None) -> tuple[dict[str, Any], bool]:
    """The manifest entry of trace ``i``, generating it unless a usable copy exists."""
    tid, seed = spec.trace_id(i), spec.trace_seed(i)
    td = d / tid
    key = dynamic_trace_key(scenario, spec.dynamics, seed, spec.duration_s)
    if old is not None:  # listed by the last manifest: kept only if its files are unchanged
        if _present(d / MANIFEST, old) and _file_entries(td)[0] == old["sha256"]:
            return old, False
    elif td.is_dir():  # written by an interrupted build
        kept = _reusable(td, key, seed)
        if kept is not None:
            return _entry(tid, seed, split, tid, spec.duration_s, len(kept.trace),
                          kept.meta["event_counts"], td), False
    ds = generate_dynamic(scenario, spec.dynamics, seed, spec.duration_s)
    ds.trace.validate(ds.topology, td / "messages.parquet")
    ds.meta.update(dataset=spec.name, trace_id=tid)
    write_dataset(td, ds, overwrite=True)
    return _entry(tid, seed, split, tid, spec.duration_s, len(ds.trace),
                  ds.meta["event_counts"], td), True


def _reusable(td: Path, key: str, seed: int) -> Dataset | None:
    """A trace directory left by an interrupted build of the same spec, read and
    validated (it was written atomically), or None."""
    try:
        ds = read_dataset(td)
    except DSMDError:
        return None
    ok = (ds.meta.get("trace_key") == key and ds.meta.get("seed") == seed
          and isinstance(ds.meta.get("event_counts"), dict))
    return ds if ok else None


# ---------------------------------------------------------------------- real traces
def import_traces(root: str | Path, name: str, traces: Mapping[str, Iterable[str | Path]],
                  scenario: ScenarioSpec | str) -> TraceDataset:
    """A dataset over existing trace directories (real traces), split as given.

    ``traces`` maps a split (train / validation / test) to trace directories in the
    :func:`~envs.dsmd.traces.write_dataset` layout (``messages.parquet``, e.g. a
    controller adapter's ``flush_trace`` output, with the topology's ``nodes.parquet``
    and ``vms.parquet`` beside it). Each is read and validated; the manifest is written to
    ``<root>/<name>/manifest.json`` with paths relative to it. The trace id is the
    directory's name. ``scenario`` (or its name) gives the capacities, K and T.
    """
    out = Path(root) / name
    manifest = out / MANIFEST
    scen = scenario if isinstance(scenario, ScenarioSpec) else load_scenario(scenario)
    unknown = sorted(set(traces) - set(SPLITS))
    if unknown:
        raise DatasetError(manifest, f"unknown split {unknown[0]!r}; expected one of "
                           f"{', '.join(SPLITS)}", field="split")
    entries = []
    for split in SPLITS:
        for p in traces.get(split, ()):
            entries.append(_import_one(manifest, Path(p), split, out))
    if not entries:
        raise DatasetError(manifest, "no traces given", field="traces")
    ids = [e["id"] for e in entries]
    dup = next((t for t in ids if ids.count(t) > 1), None)
    if dup is not None:
        raise DatasetError(manifest, "two trace directories have this name", trace=dup,
                           field="id")
    counts = [sum(e["split"] == s for e in entries) for s in SPLITS]
    spec = DatasetSpec(name=name, scenario=scen.name, num_traces=len(entries),
                       duration_s=max(*(e["duration_s"] for e in entries), 1e-9),
                       seed=0, split=tuple(c / len(entries) for c in counts),
                       time_split=scen.split, dynamics=DynamicsSpec.off())
    doc = {"format_version": FORMAT_VERSION, "name": name, "kind": "imported",
           "spec": spec.to_dict(), "scenario": scen.to_dict(), "traces": entries}
    out.mkdir(parents=True, exist_ok=True)
    _check_manifest(manifest, doc)
    _write_manifest(manifest, doc)
    return open_dataset(out)


def _import_one(manifest: Path, d: Path, split: str, out: Path) -> dict[str, Any]:
    if not d.is_dir():
        raise DatasetError(manifest, f"trace directory {d} not found", trace=d.name,
                           field="path")
    try:
        ds = read_dataset(d)
    except DSMDError as e:
        raise DatasetError(manifest, f"not a valid trace: {e}", trace=d.name,
                           field="path") from None
    seed = ds.meta.get("seed")
    counts = ds.meta.get("event_counts")
    events = ({k: int(counts.get(k, 0)) for k in EVENT_KINDS}
              if isinstance(counts, dict) else {})
    rel = os.path.relpath(d.resolve(), out.resolve())
    return _entry(d.name, seed if isinstance(seed, int) and seed >= 0 else None, split, rel,
                  _duration(ds), len(ds.trace), events, d)
