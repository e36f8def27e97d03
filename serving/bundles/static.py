"""The policy bundle runtime: what serving loads and scores with, ONNX Runtime alone (no Ray,
no torch; the exporter is :mod:`agents.bundle_export`).

A bundle is a directory::

    actor.onnx       the actor: obs (float32, [B, size]) -> scores (float32, [B, K+1]);
                     a per-channel actor in its channel-major batch form (same weights,
                     biases folded into the GEMMs), scored in cache-sized chunks across
                     threads
    actor_row.onnx   the same actor (same weights) for one observation: a per-channel actor
                     with inputs globals [G, 1] and features [P, K+1] (views of the one
                     observation, so the graph is only its fused GEMMs), any other actor
                     with obs [1, size]. The graph of a batch of one has no batch dimension
                     to broadcast over, which makes a single decision of the policy server
                     about twice as fast as on actor.onnx
    metadata.json    format and version, observation layout, scenario signature, action
                     decoding, decision order, training facts, library versions, and the
                     SHA-256 of each actor file
    SIGNATURE.json   the Ed25519 signature over the three files above, by the key that
                     exported the bundle (:mod:`serving.bundles.signing`)

:func:`load_bundle` refuses (:class:`BundleError`, naming the file and what differs) a bundle
whose files are missing or unreadable, whose format or version this runtime does not read
(:data:`READABLE_VERSIONS`), whose signature is missing or does not verify against the
trusted keys (:class:`serving.bundles.signing.SignatureError`, checked before any actor file is
opened), whose actor files do not match their recorded hashes, or whose observation layout
or scenario signature differs from what the caller expects.

The two actor files are scored by :class:`OnnxScorer`, which holds one ONNX Runtime
``InferenceSession`` for each (``ort_session`` and ``row_ort_session``).
"""

from __future__ import annotations

import io
import os
import queue
import threading
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from envs.dsmd.observation import ObservationLayout

from .format import (
    BUNDLE_CONTENT,
    BUNDLE_FILES,
    BUNDLE_FORMAT,
    BUNDLE_VERSION,
    READABLE_VERSIONS,
    SIGNATURE_FILE,
    BundleError,
    read_metadata,
    sha256_bytes,
    sha256_file,
)
from .signing import BundleTrust, verified_copy

__all__ = [
    "BUNDLE_CONTENT",
    "BUNDLE_FILES",
    "BUNDLE_FORMAT",
    "BUNDLE_VERSION",
    "DECODING",
    "READABLE_VERSIONS",
    "SIGNATURE_FILE",
    "BundleError",
    "OnnxScorer",
    "PolicyBundle",
    "load_bundle",
    "row_inputs",
    "sha256_file",
]

#: the decoding modes a bundle may record, and how each turns scores into a channel
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


class OnnxScorer:
    """Channel scores of the actor: one observation on ``row_ort_session`` (the
    ``InferenceSession`` of ``actor_row.onnx``, through per-thread bound buffers,
    :class:`_BoundRow`), a batch on ``ort_session`` (``actor.onnx``; a large batch in
    chunks across ``batch_threads`` threads, :meth:`_batch`)."""

    def __init__(self, ort_session: Any, row_ort_session: Any, size: int, num_channels: int,
                 batch_threads: int = 1) -> None:
        self.ort_session, self.row_ort_session = ort_session, row_ort_session
        self.size, self.num_channels = int(size), int(num_channels)
        #: threads that score the chunks of a batch together (see :meth:`_batch`)
        self.batch_threads = max(int(batch_threads), 1)
        self._fixed = ort_session.get_inputs()[0].shape[0]
        self._chunk = max(1, BATCH_CHUNK_ROWS // self.num_channels)
        self._bound = threading.local()  # each thread's _BoundRow (see bound_row)

    def bound_row(self) -> _BoundRow:
        """This thread's single-row runner (:class:`_BoundRow`): write an observation into
        its ``x``, then ``run()`` scores it."""
        runner: _BoundRow | None = getattr(self._bound, "runner", None)
        if runner is None:
            runner = self._bound.runner = _BoundRow(self.row_ort_session, self.size)
        return runner

    def _one(self, x: np.ndarray) -> np.ndarray:
        """Scores of one observation on the single-row session, through this thread's bound
        buffers (:class:`_BoundRow`)."""
        return self.bound_row()(x)

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        """Channel scores of one observation (``[size]`` -> ``[K+1]``) or a batch
        (``[B, size]`` -> ``[B, K+1]``)."""
        x = np.asarray(obs, dtype=np.float32)
        if x.shape[-1] != self.size:
            raise BundleError(f"observation has {x.shape[-1]} values; the bundle's layout "
                              f"expects {self.size}")
        if x.ndim == 1:
            return self._one(x)
        if x.shape[0] == 1:
            return self._one(x[0])[None]
        fixed = self._fixed
        if isinstance(fixed, int) and fixed != x.shape[0]:  # an actor exported for one row
            return np.concatenate([self.ort_session.run(_OUTPUTS, {"obs": x[i:i + fixed]})[0]
                                   for i in range(0, x.shape[0], fixed)])
        if x.shape[0] <= self._chunk:
            return cast(np.ndarray, self.ort_session.run(_OUTPUTS, {"obs": x})[0])
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
        obs = np.empty((n, self.size), np.float32)
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
        memory; ONNX Runtime's own intra-op threads do not speed these small per-sample
        GEMMs up (``bench/bench_serving.py``). With ``fill``, each chunk of ``x`` is first
        written by ``fill`` on the thread that scores it (:meth:`score_rows`). An error in a
        chunk is raised here once the other threads have stopped."""
        n, k = x.shape[0], self._chunk
        todo: queue.SimpleQueue[int] = queue.SimpleQueue()  # chunk starts, taken in order
        for i in range(0, n, k):
            todo.put(i)
        out = np.empty((n, self.num_channels), np.float32)

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
                    out[i:i + k] = self.ort_session.run(_OUTPUTS, {"obs": x[i:i + k]})[0]
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


@dataclass
class PolicyBundle:
    """A loaded bundle: call it with one observation (or a batch) to get channel scores."""

    directory: Path
    metadata: dict
    layout: ObservationLayout
    scorer: OnnxScorer
    #: the id of the key whose signature was verified (None: an unsigned bundle, accepted
    #: by an insecure loader)
    signed_by: str | None = None
    #: the bytes that were verified and loaded (:func:`serving.bundles.signing.verified_copy`)
    verified: Any = field(default=None, repr=False)

    @property
    def files(self) -> tuple[str, ...]:
        """The bundle's files (:data:`BUNDLE_FILES`; no signature file if unsigned)."""
        return BUNDLE_FILES if self.signed_by is not None else BUNDLE_CONTENT

    @property
    def serial(self) -> int | None:
        """The signed serial (None: unsigned, or signed without one)."""
        return None if self.verified is None else self.verified.serial

    @property
    def batch_threads(self) -> int:
        """Threads that score the chunks of one batch (:meth:`OnnxScorer._batch`)."""
        return self.scorer.batch_threads

    @property
    def signature(self) -> dict:
        return cast(dict, self.metadata["scenario_signature"])

    @property
    def decoding(self) -> str:
        """How scores become channels (:mod:`envs.dsmd.decoding`)."""
        return str(self.metadata["decoding"])

    @property
    def order(self) -> str:
        """The decision order the actor was trained with."""
        return str(self.metadata["decision_order"])

    @property
    def content_hash(self) -> str:
        return str(self.metadata["actor_sha256"])

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        """Channel scores of one observation (``[size]`` -> ``[K+1]``) or a batch
        (``[B, size]`` -> ``[B, K+1]``)."""
        return self.scorer(obs)

    def score_rows(self, n: int, fill: Callable[[int, int, np.ndarray], None]
                   ) -> tuple[np.ndarray, np.ndarray]:
        """``n`` observations written by ``fill`` and their scores
        (:meth:`OnnxScorer.score_rows`)."""
        return self.scorer.score_rows(n, fill)

    def bound_row(self) -> _BoundRow:
        """This thread's single-row runner (:meth:`OnnxScorer.bound_row`)."""
        return self.scorer.bound_row()


def _drain(todo: queue.SimpleQueue) -> None:
    """Empty ``todo`` (other threads may be taking from it at the same time)."""
    try:
        while True:
            todo.get_nowait()
    except queue.Empty:
        pass


def row_inputs(ort_session: Any, x: np.ndarray) -> dict[str, np.ndarray]:
    """The inputs of a single-observation ``InferenceSession``, as views of the observation
    ``x`` (``[size]``): ``obs`` ``[1, size]``, or a per-channel actor's ``globals``
    ``[G, 1]`` and ``features`` ``[P, K+1]``."""
    inputs = ort_session.get_inputs()
    if [i.name for i in inputs] == ["globals", "features"]:
        g = inputs[0].shape[0]
        p, a = inputs[1].shape
        return {"globals": x[:g].reshape(g, 1), "features": x[g:].reshape(p, a)}
    return {"obs": x.reshape(1, -1)}


class _BoundRow:
    """One observation through ONNX Runtime with its inputs and output bound once to this
    object's own buffers (an ``IOBinding``; the inputs are views of one observation buffer,
    :func:`row_inputs`), run by the ``InferenceSession``'s C++ ``run_with_iobinding``: the
    same computation as ``ort_session.run`` (tested) without building the input and output
    values and the Python wrapper's checks on every call (its WebGPU capture check alone
    costs more than the actor). If this ONNX Runtime does not offer those internals,
    ``ort_session.run``."""

    def __init__(self, ort_session: Any, size: int) -> None:
        import onnxruntime as ort

        self.x = np.zeros(size, np.float32)
        self.feeds = row_inputs(ort_session, self.x)
        self.ort_session = ort_session
        self.call: Callable[[], Any] | None = None
        k1 = ort_session.get_outputs()[0].shape[-1]
        try:
            if not isinstance(k1, int):
                raise TypeError("the output width is not fixed")
            self.y = np.zeros((1, k1), np.float32)
            self.scores = self.y[0]
            binding = ort_session.io_binding()
            for name, view in self.feeds.items():
                binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(view))
            binding.bind_output(_OUTPUTS[0], "cpu", 0, np.float32, [1, k1], self.y.ctypes.data)
            run, native = ort_session._sess.run_with_iobinding, binding._iobinding
            self.binding = binding  # keeps the bound values alive
            self.call = lambda: run(native, None)
        except (AttributeError, TypeError, RuntimeError):  # another ONNX Runtime
            self.call = None

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        """Scores of ``obs`` (``[size]`` -> a new ``[K+1]`` array)."""
        self.x[:] = obs
        return self.run().copy()

    def run(self) -> np.ndarray:
        """Scores of the observation in ``x`` (``[K+1]``; bound: a view of the output buffer,
        valid until the next run)."""
        if self.call is None:
            return cast(np.ndarray, self.ort_session.run(_OUTPUTS, self.feeds)[0][0])
        self.call()
        return cast(np.ndarray, self.scores)


def _check_hash(path: Path, data: bytes, meta: dict, key: str) -> None:
    """``data`` (the verified bytes of ``path``) against the metadata's recorded hash."""
    got = sha256_bytes(data)
    if got != meta.get(key):
        raise BundleError(f"{path}: content hash {got[:12]}... does not match the metadata's "
                          f"{str(meta.get(key))[:12]}... (corrupted or replaced)")


def inference_session(path: Path, threads: int = 1) -> Any:
    """An ONNX Runtime ``InferenceSession`` of ``path`` on the CPU with ``threads`` intra-op
    threads, one inter-op thread, sequential execution and no spinning; a file ONNX Runtime
    cannot load is a :class:`BundleError` naming it."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = int(threads)
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(str(path), sess_options=opts,
                                    providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types
        raise BundleError(f"{path}: ONNX Runtime cannot load it ({e})") from None


def load_bundle(directory: str | Path, *, expect_layout: ObservationLayout | None = None,
                expect_signature: dict | None = None, threads: int = 1,
                batch_threads: int | None = None,
                trust: BundleTrust | None = None) -> PolicyBundle:
    """Load and verify a bundle with ONNX Runtime (CPU).

    ``trust``: the public keys its signature must verify against
    (:func:`serving.bundles.signing.verify_bundle`, before any actor file is opened); None: the
    secure default, the PKI's ``bundle-signing.pub``
    (:func:`serving.bundles.signing.default_trust`).

    ``threads``: ONNX Runtime's intra-op threads. The default, 1, runs each call on the
    caller's thread without spinning: these actors are small, and ORT's default (a worker
    per core that busy-waits after every call, pinned to a core of its own choosing) doubles
    the tail latency of the policy server and burns the other cores
    (``bench/bench_serving.py``).

    ``batch_threads``: how many threads score the chunks of one batch (a whole window's
    types; :meth:`OnnxScorer._batch`), default the cores this process may use, at most 4.
    Splitting the batch among threads scales where ONNX Runtime's intra-op threads do not
    (``bench/bench_serving.py``).
    """
    d = Path(directory)
    read_metadata(d, BUNDLE_FORMAT, READABLE_VERSIONS, BUNDLE_CONTENT[1:])  # clear errors

    # every file read once: verified, then loaded from the private copy of those bytes
    vb = verified_copy(d, trust, required=BUNDLE_CONTENT)
    signed_by, root = vb.signed_by, vb.root
    with _named_as(root, d):
        meta = read_metadata(root, BUNDLE_FORMAT, READABLE_VERSIONS, BUNDLE_CONTENT[1:])
    meta_path = d / "metadata.json"
    # the bytes already read and verified, hashed in memory (not read again from the copy)
    _check_hash(d / "actor.onnx", vb.blobs["actor.onnx"], meta, "actor_sha256")
    _check_hash(d / "actor_row.onnx", vb.blobs["actor_row.onnx"], meta, "actor_row_sha256")
    if meta.get("decoding") not in DECODING:
        raise BundleError(f"{meta_path}: unknown decoding {meta.get('decoding')!r} (expected "
                          f"one of {sorted(DECODING)})")
    try:
        lay = meta["observation_layout"]
        layout = ObservationLayout(lay["variant"], lay["catalog_size"], lay["num_nodes"],
                                   lay["num_topics"])
        signature = dict(meta["scenario_signature"])
    except (KeyError, TypeError, ValueError) as e:
        raise BundleError(f"{meta_path}: observation_layout or scenario_signature is "
                          f"missing or malformed ({e.__class__.__name__}: {e})") from None
    if expect_layout is not None and expect_layout != layout:
        diffs = [f"{k}: bundle {getattr(layout, k)!r} vs expected {getattr(expect_layout, k)!r}"
                 for k in ("variant", "catalog_size", "num_nodes", "num_topics")
                 if getattr(layout, k) != getattr(expect_layout, k)]
        raise BundleError(f"{d}: observation layout mismatch ({'; '.join(diffs)})")
    if expect_signature is not None and expect_signature != signature:
        keys = sorted(set(expect_signature) | set(signature))
        diffs = [k for k in keys if expect_signature.get(k) != signature.get(k)]
        raise BundleError(f"{d}: scenario signature mismatch in {diffs}")
    if batch_threads is None:
        batch_threads = min(len(os.sched_getaffinity(0)), 4)
    with _named_as(root, d):
        scorer = OnnxScorer(inference_session(root / "actor.onnx", threads),
                            inference_session(root / "actor_row.onnx", threads), layout.size,
                            layout.num_topics + 1, batch_threads)
    return PolicyBundle(d, meta, layout, scorer, signed_by, vb)


def verified_bytes(bundle: Any) -> dict[str, bytes]:
    """Each of a loaded bundle's ``files`` (a :class:`PolicyBundle` or an
    :class:`serving.bundles.online.OnlineBundle`) as it was verified and loaded: its
    ``verified`` copy's bytes (read from its ``directory`` only for a bundle built without
    one)."""
    vb = bundle.verified
    if vb is not None:
        return {n: vb.blobs[n] for n in bundle.files}
    return {n: (bundle.directory / n).read_bytes() for n in bundle.files}


def bundle_zip(bundle: Any) -> bytes:
    """A loaded bundle's files as a zip, from the bytes that were verified and loaded (what
    ``GET /v1/policy/bundle`` and ``GET /v1/online/policy/bundle`` return)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in verified_bytes(bundle).items():
            z.writestr(name, data)
    return buf.getvalue()


@contextmanager
def _named_as(copy: Path, source: Path) -> Iterator[None]:
    """A :class:`BundleError` raised on a bundle's private copy names the bundle's own
    directory instead (what its user knows)."""
    try:
        yield
    except BundleError as e:
        if copy == source:
            raise
        raise BundleError(str(e).replace(str(copy), str(source))) from None
