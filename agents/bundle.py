"""The exported policy bundle: what serving loads, with ONNX Runtime alone (no Ray, no torch).

A bundle is a directory::

    actor.onnx       the actor: obs (float32, [B, size]) -> scores (float32, [B, K+1]);
                     a per-channel actor in its channel-major batch form
                     (agents.ddpg.networks.ChannelActorBatch: same weights, biases folded
                     into the GEMMs), scored in cache-sized chunks across threads
    actor_row.onnx   the same actor (same weights) exported for one observation
                     ([1, size] -> [1, K+1]; a per-channel actor's from version 4 on as
                     globals [G, 1] and features [P, K+1] -> [1, K+1], views of the one
                     observation, so the graph is only its fused GEMMs): the graph of a
                     batch of one has no batch dimension to broadcast over, so ONNX Runtime
                     runs it in about half the time (a single decision of the policy
                     server); from version 3 on
    metadata.json    format and version, observation layout, scenario signature, action
                     decoding, decision order, training facts, library versions, and the
                     SHA-256 of each actor file

:func:`load_bundle` refuses (``BundleError``, naming what differs) a bundle whose files are
missing or unreadable, whose actor does not match its recorded hash, or whose observation
layout or scenario signature differs from what the caller expects. Writing is atomic.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from envs.dsmd.decoding import check_decoding
from envs.dsmd.observation import ObservationLayout
from envs.fsutil import atomic_directory

__all__ = ["BundleError", "PolicyBundle", "export_bundle", "export_onnx", "load_bundle",
           "row_inputs", "BUNDLE_FORMAT", "BUNDLE_FILES"]

BUNDLE_FORMAT = "smart-dsmd-policy"
#: 2: the decoding mode (envs.dsmd.decoding) is recorded; 3: actor_row.onnx; 4: a per-channel
#: actor's actor_row.onnx takes the observation as two inputs, its globals and its features
BUNDLE_VERSION = 4
READABLE_VERSIONS = (2, 3, 4)
#: every file a bundle may hold (what is copied when a bundle is published or fetched)
BUNDLE_FILES = ("metadata.json", "actor.onnx", "actor_row.onnx")
DECODING = {"argmax": "argmax over the K+1 channel scores (0 = RPC, t = MQ topic t); ties "
                      "broken uniformly at random",
            "feasible": "the highest-scoring channel (0 = RPC, t = MQ topic t) that keeps "
                        "Eq. 1's constraints, the argmax if none does; ties broken uniformly "
                        "at random (envs.dsmd.decoding)"}


_OUTPUTS = ["scores"]
#: a batch is scored in chunks of about this many channel rows (observations x (K+1)):
#: 49 observations of 201 channels, whose widest activations (1.3 MB) stay in cache
BATCH_CHUNK_ROWS = 10_000
_POOL: dict[tuple[int, int], Any] = {}
_POOL_LOCK = threading.Lock()


def _batch_pool(workers: int) -> Any:
    """The process-wide pool of ``workers`` threads that score batch chunks (created once
    per size and process: a forked child has none of its parent's threads; they idle
    between batches)."""
    from concurrent.futures import ThreadPoolExecutor

    key = (os.getpid(), workers)
    with _POOL_LOCK:
        pool = _POOL.get(key)
        if pool is None:
            pool = _POOL[key] = ThreadPoolExecutor(workers, thread_name_prefix="bundle-batch")
        return pool


class BundleError(ValueError):
    """A policy bundle that cannot be used (missing, corrupted or mismatched)."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def export_onnx(module, obs_dim: int, path: Path, output_name: str = "scores",
                one_row: bool = False, inputs: dict[str, tuple[int, ...]] | None = None
                ) -> Path:
    """``module`` (``obs [B, obs_dim] -> [B, d]``) as one ONNX file with a dynamic batch, or
    for exactly one observation with ``one_row``, or with the fixed-shape ``inputs`` (name ->
    shape, in the order ``module`` takes them) instead of ``obs`` (torch.export-based
    exporter, weights embedded), its optimiser's INFO logs silenced."""
    import torch

    quiet = [logging.getLogger(n) for n in ("onnxscript", "onnx_ir",
                                            "torch.onnx._internal.exporter._registration")]
    levels = [lg.level for lg in quiet]
    for lg in quiet[:2]:  # the exporter's optimiser logs every pass at INFO
        lg.setLevel(logging.WARNING)
    quiet[2].setLevel(logging.ERROR)  # "torchvision is not installed" for each of its ops
    if inputs is not None:
        names, example, dynamic = list(inputs), tuple(torch.zeros(s) for s in inputs.values()), \
            None
    else:
        # an example batch of 2: torch.export specialises a dimension of size 1, which
        # would fix the exported batch to 1 wherever the network reshapes by it
        names, example = ["obs"], (torch.zeros(1 if one_row else 2, obs_dim),)
        dynamic = None if one_row else ({0: torch.export.Dim("batch")},)
    try:
        torch.onnx.export(module, example, str(path), input_names=names,
                          output_names=[output_name], dynamic_shapes=dynamic, dynamo=True,
                          external_data=False, verbose=False)
    finally:
        for lg, lv in zip(quiet, levels):
            lg.setLevel(lv)
    return path


def _batch_form(actor: Any) -> Any:
    """What ``actor.onnx`` is exported from: a per-channel actor's channel-major batch form
    (:class:`agents.ddpg.networks.ChannelActorBatch`), any other actor as it is."""
    from agents.ddpg.networks import ChannelActor, ChannelActorBatch

    if isinstance(actor, ChannelActor):
        try:
            return ChannelActorBatch(actor).eval()
        except ValueError:  # no hidden layer: nothing to fold
            pass
    return actor


def _export_row(actor: Any, obs_dim: int, path: Path) -> None:
    """``actor_row.onnx``: a per-channel actor with inputs ``globals`` ``[G, 1]`` and
    ``features`` ``[P, K+1]`` (:class:`agents.ddpg.networks.ChannelActorRow`: four fused
    GEMMs in ONNX Runtime), any other actor with ``obs`` ``[1, size]``."""
    from agents.ddpg.networks import ChannelActor, ChannelActorRow

    if isinstance(actor, ChannelActor):
        export_onnx(ChannelActorRow(actor).eval(), obs_dim, path, output_name="scores",
                    inputs={"globals": (actor.g, 1), "features": (actor.blocks, actor.a)})
    else:
        export_onnx(actor, obs_dim, path, output_name="scores", one_row=True)


def export_bundle(actor: Any, layout: ObservationLayout, signature: dict, directory: str | Path,
                  *, order: str = "rate_desc", decoding: str = "feasible",
                  extra: dict | None = None,
                  overwrite: bool = False) -> Path:
    """Export a torch actor (``nn.Module``: obs -> scores in [-1, 1]) as a bundle."""
    import torch

    with atomic_directory(directory, overwrite) as tmp:
        actor = actor.eval().cpu()
        # weights embedded in one file so the content hash covers the whole actor
        export_onnx(_batch_form(actor), layout.size, tmp / "actor.onnx", output_name="scores")
        _export_row(actor, layout.size, tmp / "actor_row.onnx")
        import onnx
        import onnxruntime

        meta = {"format": BUNDLE_FORMAT, "version": BUNDLE_VERSION,
                "observation_layout": layout.to_dict(), "scenario_signature": signature,
                "action_decoding": DECODING[check_decoding(decoding)],
                "decoding": decoding, "decision_order": order,
                "num_channels": layout.num_topics + 1,
                "versions": {"torch": torch.__version__, "onnx": onnx.__version__,
                             "onnxruntime": onnxruntime.__version__,
                             "numpy": np.__version__},
                "extra": extra or {}, "actor_sha256": _sha256(tmp / "actor.onnx"),
                "actor_row_sha256": _sha256(tmp / "actor_row.onnx")}
        (tmp / "metadata.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    return Path(directory)


@dataclass
class PolicyBundle:
    """A loaded bundle: call it with one observation (or a batch) to get channel scores."""

    directory: Path
    metadata: dict
    layout: ObservationLayout
    session: Any
    #: threads that score the chunks of a batch together (see :meth:`_batch`)
    batch_threads: int = 1
    #: the single-observation session (``actor_row.onnx``), or None (a version 2 bundle)
    row_session: Any = None

    def __post_init__(self) -> None:
        self._size = self.layout.size
        self._fixed = self.session.get_inputs()[0].shape[0]
        self._chunk = max(1, BATCH_CHUNK_ROWS // (self.layout.num_topics + 1))
        self._row = self.row_session if self.row_session is not None else self.session
        self._bound = threading.local()  # each thread's _BoundRow (see _one)

    def _one(self, x: np.ndarray) -> np.ndarray:
        """Scores of one observation on the single-row session, through this thread's bound
        buffers (:class:`_BoundRow`)."""
        runner = getattr(self._bound, "runner", None)
        if runner is None:
            runner = self._bound.runner = _BoundRow(self._row, self._size)
        return runner(x)

    @property
    def files(self) -> tuple[str, ...]:
        """The bundle's files (:data:`BUNDLE_FILES` it has)."""
        return tuple(n for n in BUNDLE_FILES
                     if n != "actor_row.onnx" or self.row_session is not None)

    @property
    def signature(self) -> dict:
        return self.metadata["scenario_signature"]

    @property
    def decoding(self) -> str:
        """How scores become channels (:mod:`envs.dsmd.decoding`)."""
        return self.metadata["decoding"]

    @property
    def order(self) -> str:
        """The decision order the actor was trained with."""
        return self.metadata["decision_order"]

    @property
    def content_hash(self) -> str:
        return self.metadata["actor_sha256"]

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        """Channel scores of one observation (``[size]`` -> ``[K+1]``) or a batch
        (``[B, size]`` -> ``[B, K+1]``)."""
        x = np.asarray(obs, dtype=np.float32)
        if x.shape[-1] != self._size:
            raise BundleError(f"observation has {x.shape[-1]} values; the bundle's layout "
                              f"expects {self._size}")
        if x.ndim == 1:
            return self._one(x)
        if x.shape[0] == 1:
            return self._one(x[0])[None]
        fixed = self._fixed
        if isinstance(fixed, int) and fixed != x.shape[0]:  # an actor exported for one row
            return np.concatenate([self.session.run(_OUTPUTS, {"obs": x[i:i + fixed]})[0]
                                   for i in range(0, x.shape[0], fixed)])
        if x.shape[0] <= self._chunk:
            return self.session.run(_OUTPUTS, {"obs": x})[0]
        return self._batch(x)

    def score_rows(self, n: int, fill: Callable[[int, int, np.ndarray], None]
                   ) -> tuple[np.ndarray, np.ndarray]:
        """A batch of ``n`` observations written by ``fill(lo, hi, out)`` (rows ``lo:hi`` into
        ``out``; :meth:`envs.dsmd.observation.ObservationBuilder.rows`) and their scores:
        ``([n, size], [n, K+1])``. In a chunked batch (:meth:`_batch`) each chunk is filled
        by the thread that scores it, just before it scores it: building the observations is
        shared among the batch threads too, and each chunk is scored while it is in that
        core's cache. ``fill`` must allow calls for disjoint rows on several threads at once.
        """
        obs = np.empty((n, self._size), np.float32)
        if n <= self._chunk or isinstance(self._fixed, int):
            fill(0, n, obs)
            return obs, self(obs)
        return obs, self._batch(obs, fill)

    def _batch(self, x: np.ndarray, fill: Callable[[int, int, np.ndarray], None] | None = None
               ) -> np.ndarray:
        """Scores of a batch in chunks of ``BATCH_CHUNK_ROWS // (K+1)`` observations, the
        chunks taken one at a time by ``batch_threads`` threads (this one and a process-wide
        pool; ONNX Runtime and the observation kernels release the GIL while they run). A
        chunk's activations stay in the core's cache, where one call on the whole batch
        streams every layer's ``[B, H, K+1]`` tensor (26 MB at 1,000 x 201 x 32) through
        memory; and ONNX Runtime's own intra-op threads did not speed these small
        per-sample GEMMs up (``bench/bench_serving.py``). With ``fill``, each chunk of ``x``
        is first written by ``fill`` on the thread that scores it (:meth:`score_rows`). An
        error in a chunk is raised here once the other threads have stopped."""
        n, k = x.shape[0], self._chunk
        todo: queue.SimpleQueue[int] = queue.SimpleQueue()  # chunk starts, taken in order
        for i in range(0, n, k):
            todo.put(i)
        out = np.empty((n, self.layout.num_topics + 1), np.float32)

        def run() -> None:
            # each thread takes the next chunk until none is left, so a thread that is late
            # to start, slowed down or busy with another batch leaves its share to the others
            try:
                while True:
                    try:
                        i = todo.get_nowait()
                    except queue.Empty:
                        return
                    if fill is not None:
                        fill(i, min(i + k, n), x[i:i + k])
                    out[i:i + k] = self.session.run(_OUTPUTS, {"obs": x[i:i + k]})[0]
            except BaseException:
                _drain(todo)  # the other threads stop after their current chunk
                raise

        helpers = min(self.batch_threads, -(-n // k)) - 1
        futures = [_batch_pool(helpers).submit(run) for _ in range(helpers)] if helpers else []
        try:
            run()
        finally:
            # every helper that started has finished before this returns or raises; one still
            # queued behind other work (another batch) is cancelled, not waited for
            errors = [f.exception() for f in futures if not f.cancel()]
        for e in errors:
            if e is not None:
                raise e
        return out


def _drain(todo: queue.SimpleQueue) -> None:
    """Empty ``todo`` (other threads may be taking from it at the same time)."""
    try:
        while True:
            todo.get_nowait()
    except queue.Empty:
        pass


def row_inputs(session: Any, x: np.ndarray) -> dict[str, np.ndarray]:
    """The inputs of a single-observation session, as views of the observation ``x``
    (``[size]``): ``obs`` ``[1, size]``, or a per-channel actor's ``globals`` ``[G, 1]`` and
    ``features`` ``[P, K+1]`` (bundle version 4)."""
    names = [i.name for i in session.get_inputs()]
    if names == ["globals", "features"]:
        g = session.get_inputs()[0].shape[0]
        p, a = session.get_inputs()[1].shape
        return {"globals": x[:g].reshape(g, 1), "features": x[g:].reshape(p, a)}
    return {"obs": x.reshape(1, -1)}


class _BoundRow:
    """One observation through ONNX Runtime with its inputs and output bound once to this
    object's own buffers (an ``IOBinding``; the inputs are views of one observation buffer,
    :func:`row_inputs`), run by the session's C++ ``run_with_iobinding``: the same
    computation as ``session.run`` (tested) without building the input and output values and
    the Python wrapper's checks on every call (its WebGPU capture check alone costs more
    than the actor), which took a quarter of a single decision's time. If this ONNX Runtime
    does not offer those internals, ``session.run``."""

    def __init__(self, session: Any, size: int) -> None:
        import onnxruntime as ort

        self.x = np.zeros(size, np.float32)
        self.feeds = row_inputs(session, self.x)
        self.session = session
        self.call = None
        k1 = session.get_outputs()[0].shape[-1]
        try:
            if not isinstance(k1, int):
                raise TypeError("the output width is not fixed")
            self.y = np.zeros((1, k1), np.float32)
            binding = session.io_binding()
            for name, view in self.feeds.items():
                binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(view))
            binding.bind_output(_OUTPUTS[0], "cpu", 0, np.float32, [1, k1], self.y.ctypes.data)
            run, native = session._sess.run_with_iobinding, binding._iobinding
            self.binding = binding  # keeps the bound values alive
            self.call = lambda: run(native, None)
        except (AttributeError, TypeError, RuntimeError):  # another ONNX Runtime
            self.call = None

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        self.x[:] = obs
        if self.call is None:
            return self.session.run(_OUTPUTS, self.feeds)[0][0]
        self.call()
        return self.y[0].copy()


def load_bundle(directory: str | Path, *, expect_layout: ObservationLayout | None = None,
                expect_signature: dict | None = None, threads: int = 1,
                batch_threads: int | None = None) -> PolicyBundle:
    """Load and verify a bundle with ONNX Runtime (CPU).

    ``threads``: ONNX Runtime's intra-op threads. The default, 1, runs each call on the
    caller's thread without spinning: these actors are small, and ORT's default (a worker
    per core that busy-waits after every call, pinned to a core of its own choosing) doubled
    the tail latency of the policy server and burned the other core (``bench/bench_serving.py``).

    ``batch_threads``: how many threads score the chunks of one batch (a whole window's
    types; :meth:`PolicyBundle._batch`), default the cores this process may use, at most 4.
    Splitting the batch among threads scales where ONNX Runtime's intra-op threads did not:
    a batch of 1,000 observations of the default actor took the same time on a two-thread
    session as on one (``bench/bench_serving.py``).
    """
    d = Path(directory)
    meta_path, onnx_path, row_path = d / "metadata.json", d / "actor.onnx", d / "actor_row.onnx"
    try:
        for p in (meta_path, onnx_path):
            if not p.is_file():
                raise BundleError(f"{d}: missing {p.name}")
        meta = json.loads(meta_path.read_text())
        digest = _sha256(onnx_path)
        row_digest = _sha256(row_path) if row_path.is_file() else None
    except json.JSONDecodeError as e:
        raise BundleError(f"{meta_path}: not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:  # unreadable, name too long, not text, ...
        raise BundleError(f"{str(d)[:200]}: cannot read the bundle ({e.__class__.__name__}: "
                          f"{getattr(e, 'strerror', None) or e})") from None
    if not isinstance(meta, dict):
        raise BundleError(f"{meta_path}: not a JSON object")
    if meta.get("format") != BUNDLE_FORMAT or meta.get("version") not in READABLE_VERSIONS:
        raise BundleError(f"{d}: not a {BUNDLE_FORMAT} bundle of version "
                          f"{', '.join(map(str, READABLE_VERSIONS[:-1]))} or "
                          f"{READABLE_VERSIONS[-1]} "
                          f"(format={meta.get('format')!r}, version={meta.get('version')!r})")
    checks = [(onnx_path, digest, "actor_sha256")]
    if meta["version"] >= 3:
        if row_digest is None:
            raise BundleError(f"{d}: missing actor_row.onnx")
        checks.append((row_path, row_digest, "actor_row_sha256"))
    for path, got, key in checks:
        if got != meta.get(key):
            raise BundleError(f"{path}: content hash {got[:12]}... does not match the "
                              f"metadata's {str(meta.get(key))[:12]}... (corrupted or "
                              "replaced)")
    if meta.get("decoding") not in DECODING:
        raise BundleError(f"{meta_path}: unknown decoding {meta.get('decoding')!r} (expected "
                          f"one of {sorted(DECODING)})")
    lay = meta["observation_layout"]
    layout = ObservationLayout(lay["variant"], lay["catalog_size"], lay["num_nodes"],
                               lay["num_topics"])
    if expect_layout is not None and expect_layout != layout:
        diffs = [f"{k}: bundle {getattr(layout, k)!r} vs expected {getattr(expect_layout, k)!r}"
                 for k in ("variant", "catalog_size", "num_nodes", "num_topics")
                 if getattr(layout, k) != getattr(expect_layout, k)]
        raise BundleError(f"{d}: observation layout mismatch ({'; '.join(diffs)})")
    if expect_signature is not None and expect_signature != meta["scenario_signature"]:
        keys = sorted(set(expect_signature) | set(meta["scenario_signature"]))
        diffs = [k for k in keys
                 if expect_signature.get(k) != meta["scenario_signature"].get(k)]
        raise BundleError(f"{d}: scenario signature mismatch in {diffs}")
    import onnxruntime as ort

    if batch_threads is None:
        batch_threads = min(len(os.sched_getaffinity(0)), 4)

    def make(n: int, path: Path = onnx_path) -> Any:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = int(n)
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return ort.InferenceSession(str(path), sess_options=opts,
                                    providers=["CPUExecutionProvider"])

    path = onnx_path
    try:
        session = make(threads)
        path = row_path
        row = make(threads, row_path) if meta["version"] >= 3 else None
    except Exception as e:  # onnxruntime raises its own exception types
        raise BundleError(f"{path}: ONNX Runtime cannot load it ({e})") from None
    return PolicyBundle(d, meta, layout, session, max(int(batch_threads), 1), row)
