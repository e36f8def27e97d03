"""The exported policy bundle: what serving loads, with ONNX Runtime alone (no Ray, no torch).

A bundle is a directory::

    actor.onnx       the actor: obs (float32, [B, size]) -> scores (float32, [B, K+1])
    metadata.json    format and version, observation layout, scenario signature, action
                     decoding, decision order, training facts, library versions, and the
                     SHA-256 of actor.onnx

:func:`load_bundle` refuses (``BundleError``, naming what differs) a bundle whose files are
missing or unreadable, whose actor does not match its recorded hash, or whose observation
layout or scenario signature differs from what the caller expects. Writing is atomic.
"""

from __future__ import annotations

import hashlib
import json
import os
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from envs.dsmd.decoding import check_decoding
from envs.dsmd.observation import ObservationLayout
from envs.fsutil import atomic_directory

__all__ = ["BundleError", "PolicyBundle", "export_bundle", "export_onnx", "load_bundle",
           "BUNDLE_FORMAT"]

BUNDLE_FORMAT = "smart-dsmd-policy"
BUNDLE_VERSION = 2  # 2: the decoding mode (envs.dsmd.decoding) is recorded
DECODING = {"argmax": "argmax over the K+1 channel scores (0 = RPC, t = MQ topic t); ties "
                      "broken uniformly at random",
            "feasible": "the highest-scoring channel (0 = RPC, t = MQ topic t) that keeps "
                        "Eq. 1's constraints, the argmax if none does; ties broken uniformly "
                        "at random (envs.dsmd.decoding)"}


_OUTPUTS = ["scores"]


class BundleError(ValueError):
    """A policy bundle that cannot be used (missing, corrupted or mismatched)."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def export_onnx(module, obs_dim: int, path: Path, output_name: str = "scores") -> Path:
    """``module`` (``obs [B, obs_dim] -> [B, d]``) as one ONNX file with a dynamic batch
    (torch.export-based exporter, weights embedded), its optimiser's INFO logs silenced."""
    import torch

    quiet = [logging.getLogger(n) for n in ("onnxscript", "onnx_ir")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:  # the exporter's optimiser logs every pass at INFO
        lg.setLevel(logging.WARNING)
    try:
        # an example batch of 2: torch.export specialises a dimension of size 1, which
        # would fix the exported batch to 1 wherever the network reshapes by it
        torch.onnx.export(module, (torch.zeros(2, obs_dim),), str(path),
                          input_names=["obs"], output_names=[output_name],
                          dynamic_shapes=({0: torch.export.Dim("batch")},), dynamo=True,
                          external_data=False, verbose=False)
    finally:
        for lg, lv in zip(quiet, levels):
            lg.setLevel(lv)
    return path


def export_bundle(actor: Any, layout: ObservationLayout, signature: dict, directory: str | Path,
                  *, order: str = "rate_desc", decoding: str = "feasible",
                  extra: dict | None = None,
                  overwrite: bool = False) -> Path:
    """Export a torch actor (``nn.Module``: obs -> scores in [-1, 1]) as a bundle."""
    import torch

    with atomic_directory(directory, overwrite) as tmp:
        actor = actor.eval().cpu()
        # weights embedded in one file so the content hash covers the whole actor
        export_onnx(actor, layout.size, tmp / "actor.onnx", output_name="scores")
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
                "extra": extra or {}, "actor_sha256": _sha256(tmp / "actor.onnx")}
        (tmp / "metadata.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    return Path(directory)


@dataclass
class PolicyBundle:
    """A loaded bundle: call it with one observation (or a batch) to get channel scores."""

    directory: Path
    metadata: dict
    layout: ObservationLayout
    session: Any
    #: a second session with ``batch_threads`` intra-op threads for calls of at least
    #: ``batch_rows`` observations (a whole-window batch), or None
    batch_session: Any = None
    batch_rows: int = 64

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
        single = x.ndim == 1
        if x.shape[-1] != self.layout.size:
            raise BundleError(f"observation has {x.shape[-1]} values; the bundle's layout "
                              f"expects {self.layout.size}")
        if single:
            return self.session.run(_OUTPUTS, {"obs": x.reshape(1, -1)})[0][0]
        fixed = self.session.get_inputs()[0].shape[0]
        if isinstance(fixed, int) and fixed != x.shape[0]:  # an actor exported for one row
            return np.concatenate([self.session.run(_OUTPUTS, {"obs": x[i:i + fixed]})[0]
                                   for i in range(0, x.shape[0], fixed)])
        if self.batch_session is not None and x.shape[0] >= self.batch_rows:
            return self.batch_session.run(_OUTPUTS, {"obs": x})[0]
        return self.session.run(_OUTPUTS, {"obs": x})[0]


def load_bundle(directory: str | Path, *, expect_layout: ObservationLayout | None = None,
                expect_signature: dict | None = None, threads: int = 1,
                batch_threads: int | None = None, batch_rows: int = 64) -> PolicyBundle:
    """Load and verify a bundle with ONNX Runtime (CPU).

    ``threads``: ONNX Runtime's intra-op threads. The default, 1, runs each call on the
    caller's thread without spinning: these actors are small, and ORT's default (a worker
    per core that busy-waits after every call, pinned to a core of its own choosing) doubled
    the tail latency of the policy server and burned the other core (``bench/bench_serving.py``).

    ``batch_threads``: calls with at least ``batch_rows`` observations (a batch of a whole
    window's types) go to a second session with that many threads (default: the cores this
    process may use, at most 4; 1 turns the second session off). A batch of 1,000 rows of
    the default per-channel actor takes about 20 ms on one core and 15 ms on two here, while
    one row is 30% slower on a two-thread session, hence two sessions.
    """
    d = Path(directory)
    meta_path, onnx_path = d / "metadata.json", d / "actor.onnx"
    try:
        for p in (meta_path, onnx_path):
            if not p.is_file():
                raise BundleError(f"{d}: missing {p.name}")
        meta = json.loads(meta_path.read_text())
        digest = _sha256(onnx_path)
    except json.JSONDecodeError as e:
        raise BundleError(f"{meta_path}: not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:  # unreadable, name too long, not text, ...
        raise BundleError(f"{str(d)[:200]}: cannot read the bundle ({e.__class__.__name__}: "
                          f"{getattr(e, 'strerror', None) or e})") from None
    if not isinstance(meta, dict):
        raise BundleError(f"{meta_path}: not a JSON object")
    if meta.get("format") != BUNDLE_FORMAT or meta.get("version") != BUNDLE_VERSION:
        raise BundleError(f"{d}: not a {BUNDLE_FORMAT} v{BUNDLE_VERSION} bundle "
                          f"(format={meta.get('format')!r}, version={meta.get('version')!r})")
    if digest != meta.get("actor_sha256"):
        raise BundleError(f"{onnx_path}: content hash {digest[:12]}... does not match the "
                          f"metadata's {str(meta.get('actor_sha256'))[:12]}... (corrupted or "
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

    def make(n: int) -> Any:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = int(n)
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return ort.InferenceSession(str(onnx_path), sess_options=opts,
                                    providers=["CPUExecutionProvider"])

    try:
        session = make(threads)
        batch = make(batch_threads) if batch_threads > max(int(threads), 1) else None
    except Exception as e:  # onnxruntime raises its own exception types
        raise BundleError(f"{onnx_path}: ONNX Runtime cannot load it ({e})") from None
    return PolicyBundle(d, meta, layout, session, batch, int(batch_rows))
