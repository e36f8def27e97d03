"""The online policy bundle runtime: what evaluation workers and serving load, with ONNX
Runtime alone (no Ray, no torch; the exporter is :mod:`agents.bundle_export`).

A directory::

    actor.onnx      the DDPG actor: obs (float32, [B, 12]) -> action (float32, [B, 3]) in
                    [-1, 1] (tanh), unsquashed to the knobs' [0, 1] by
                    envs.dsmd.online_control.KnobPolicy
    metadata.json   format and version; the observation's feature names (the history
                    features the policy needs, computed by
                    envs.dsmd.online_control.online_features); the knob map (ranges,
                    executor, the executor's fixed arguments); the online cost it was
                    trained for; the dataset and scenario; training facts; the SHA-256 of
                    actor.onnx and of every optional file ("files")
    send_forecaster.npz
                    optional (version 2): the send forecaster the executor's plan reads
                    (envs.dsmd.forecaster.SendForecaster, NumPy only), named by the knob
                    map's fixed argument ``send_forecaster``
    SIGNATURE.json  the Ed25519 signature over the files above, by the key that exported
                    the bundle (:mod:`serving.bundles.signing`)

:func:`load_online_bundle` refuses (:class:`serving.bundles.format.BundleError`, naming what
differs) a bundle whose files are missing or unreadable, whose format or version this runtime does
not read, whose signature is missing or does not verify against the trusted keys
(:class:`serving.bundles.signing.SignatureError`, checked before the actor is opened), whose actor
does not match its recorded hash, whose optional files are unknown, missing, unsigned or
changed, or whose features differ from this version's
:data:`~envs.dsmd.online_control.FEATURES`. A version-1 bundle (no optional files, no
fixed arguments) is read as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from envs.dsmd.online import OnlineCost
from envs.dsmd.online_control import FEATURES, OBS_SIZE, KnobMap, KnobPolicy

from .format import (
    FILE_ARGS,
    ONLINE_BUNDLE_CONTENT,
    ONLINE_BUNDLE_FILES,
    ONLINE_BUNDLE_FORMAT,
    ONLINE_BUNDLE_OPTIONAL,
    ONLINE_BUNDLE_VERSION,
    ONLINE_BUNDLE_VERSIONS,
    SIGNATURE_FILE,
    BundleError,
    online_bundle_files,
    read_metadata,
    sha256_bytes,
)
from .signing import BundleTrust, verified_copy
from .static import inference_session

__all__ = ["FILE_ARGS", "ONLINE_BUNDLE_CONTENT", "ONLINE_BUNDLE_FILES", "ONLINE_BUNDLE_FORMAT",
           "ONLINE_BUNDLE_OPTIONAL", "ONLINE_BUNDLE_VERSION", "OnlineBundle",
           "load_online_bundle", "online_bundle_files"]

@dataclass
class OnlineBundle:
    """A loaded online bundle: its actor (``ort_session``, an ONNX Runtime
    ``InferenceSession`` of ``actor.onnx``), knob map and cost."""

    directory: Path
    metadata: dict[str, Any]
    knob_map: KnobMap
    cost: OnlineCost
    ort_session: Any
    #: the id of the key whose signature was verified (None: unsigned, insecure loader)
    signed_by: str | None = None
    #: the bytes that were verified and loaded (:func:`serving.bundles.signing.verified_copy`); the
    #: executor's files are read from its private copy
    verified: Any = field(default=None, repr=False)

    @property
    def serial(self) -> int | None:
        """The signed serial (None: unsigned, or signed without one)."""
        return None if self.verified is None else self.verified.serial

    @property
    def files(self) -> tuple[str, ...]:
        """The bundle's files (no signature file if unsigned)."""
        read = online_bundle_files(self.metadata)
        return (*read, SIGNATURE_FILE) if self.signed_by is not None else read

    def __post_init__(self) -> None:
        self._input = self.ort_session.get_inputs()[0].name

    def act(self, obs: np.ndarray) -> np.ndarray:
        """One observation (12 values) -> the actor's action in [-1, 1]^3."""
        x = np.asarray(obs, np.float32).reshape(1, OBS_SIZE)
        return cast(np.ndarray, self.ort_session.run(None, {self._input: x})[0][0])

    def decider(self, name: str = "learned", cost: OnlineCost | None = None) -> KnobPolicy:
        """The online decider this bundle's actor drives (cost: the bundle's by default)."""
        return KnobPolicy(self.act, self.knob_map, cost or self.cost, name=name)


def load_online_bundle(directory: str | Path,
                       trust: BundleTrust | None = None) -> OnlineBundle:
    """Open and check an online policy bundle (module docstring). ``trust``: the public keys
    its signature must verify against (:func:`serving.bundles.signing.verify_bundle`); None: the
    secure default, the PKI's ``bundle-signing.pub``."""
    src = Path(directory)
    what = "online policy bundle"
    meta = read_metadata(src, ONLINE_BUNDLE_FORMAT, ONLINE_BUNDLE_VERSIONS, ("actor.onnx",),
                         what)
    read = online_bundle_files(meta, f"{what} {str(src)[:200]}")

    # every file read once: verified, then loaded from the private copy of those bytes
    vb = verified_copy(src, trust, required=read)
    signed_by, d = vb.signed_by, vb.root
    meta = read_metadata(d, ONLINE_BUNDLE_FORMAT, ONLINE_BUNDLE_VERSIONS, ("actor.onnx",),
                         what)
    missing = [n for n in online_bundle_files(meta, what) if n not in vb.blobs]
    if missing:  # the metadata verified names files the check did not read: refuse
        raise BundleError(f"{what} {src}: {missing} changed while it was read")
    onnx_path = d / "actor.onnx"
    if list(meta.get("features") or []) != list(FEATURES):
        raise BundleError(f"{what} {src}: observation features "
                          f"{meta.get('features')} differ from this version's {list(FEATURES)}")
    # the bytes already read and verified, hashed in memory (not read again from the copy)
    if sha256_bytes(vb.blobs["actor.onnx"]) != meta.get("actor_sha256"):
        raise BundleError(f"{what} {src}: actor.onnx does not match its recorded SHA-256")
    for name, want in (meta.get("files") or {}).items():
        if sha256_bytes(vb.blobs[name]) != want:
            raise BundleError(f"{what} {src}: {name} does not match its recorded SHA-256")
    try:
        km = dict(meta["knob_map"])
        km["fixed"] = _bundle_paths(d, dict(km.get("fixed") or {}), meta.get("files") or {})
        knob_map = KnobMap(**km)
        cost = OnlineCost.from_dict(meta["cost"])
    except (KeyError, TypeError, ValueError) as e:
        raise BundleError(f"{what} {src}: metadata.json: {e}") from None
    try:  # the executor once, so that a file it reads is checked now, not at a boundary
        knob_map.build(cost)
    except (OSError, ValueError) as e:
        raise BundleError(f"{what} {src}: its executor cannot be built ({e})") from None
    try:  # the static bundles' session builder: one thread, sequential, no spinning
        ort_session = inference_session(onnx_path)
    except BundleError as e:
        raise BundleError(f"{what} {src}: actor.onnx cannot be loaded ({e})") from None
    return OnlineBundle(src, meta, knob_map, cost, ort_session, signed_by, vb)


def _bundle_paths(d: Path, fixed: dict[str, Any], files: dict[str, str]) -> dict[str, Any]:
    """The knob map's fixed arguments with each file argument (:data:`FILE_ARGS`) resolved
    to its file in the bundle, which the metadata's ``files`` must name (hashed, signed)."""
    for arg, name in FILE_ARGS.items():
        if fixed.get(arg) is None:
            continue
        if fixed[arg] != name or name not in files:
            raise ValueError(f"knob_map.fixed.{arg} must be {name!r}, a file the bundle "
                             f"holds and 'files' names, got {str(fixed[arg])[:200]!r}")
        fixed[arg] = str(d / name)
    return fixed
