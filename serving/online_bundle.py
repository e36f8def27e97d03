"""The online policy bundle runtime: what evaluation workers and serving load, with ONNX
Runtime alone (no Ray, no torch; the exporter is :mod:`agents.bundle_export`).

A directory::

    actor.onnx      the DDPG actor: obs (float32, [B, 12]) -> action (float32, [B, 3]) in
                    [-1, 1] (tanh), unsquashed to the knobs' [0, 1] by
                    envs.dsmd.online_control.KnobPolicy
    metadata.json   format and version; the observation's feature names (the history
                    features the policy needs, computed by
                    envs.dsmd.online_control.online_features); the knob map (ranges,
                    executor); the online cost it was trained for; the dataset and
                    scenario; training facts; the SHA-256 of actor.onnx
    SIGNATURE.json  the Ed25519 signature over the two files above, by the key that
                    exported the bundle (:mod:`serving.signing`)

:func:`load_online_bundle` refuses (:class:`serving.bundle.BundleError`, naming what differs)
a bundle whose files are missing or unreadable, whose format or version this runtime does
not read, whose signature is missing or does not verify against the trusted keys
(:class:`serving.signing.SignatureError`, checked before the actor is opened), whose actor
does not match its recorded hash, or whose features differ from this version's
:data:`~envs.dsmd.online_control.FEATURES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from envs.dsmd.online import OnlineCost
from envs.dsmd.online_control import FEATURES, OBS_SIZE, KnobMap, KnobPolicy

from .bundle import SIGNATURE_FILE, BundleError, read_metadata, sha256_file

if TYPE_CHECKING:
    from .signing import BundleTrust

__all__ = ["ONLINE_BUNDLE_CONTENT", "ONLINE_BUNDLE_FILES", "ONLINE_BUNDLE_FORMAT",
           "ONLINE_BUNDLE_VERSION", "OnlineBundle", "load_online_bundle"]

ONLINE_BUNDLE_FORMAT = "smart-dsmd-online-policy"
#: the version :func:`agents.bundle_export.export_online_bundle` writes and this runtime reads
ONLINE_BUNDLE_VERSION = 1
#: the files the loader reads (every one covered by the signature)
ONLINE_BUNDLE_CONTENT = ("metadata.json", "actor.onnx")
#: every file an online bundle holds (no SIGNATURE.json if unsigned)
ONLINE_BUNDLE_FILES = (*ONLINE_BUNDLE_CONTENT, SIGNATURE_FILE)


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

    @property
    def files(self) -> tuple[str, ...]:
        """The bundle's files (no signature file if unsigned)."""
        return ONLINE_BUNDLE_FILES if self.signed_by is not None else ONLINE_BUNDLE_CONTENT

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
    its signature must verify against (:func:`serving.signing.verify_bundle`); None: the
    secure default, the PKI's ``bundle-signing.pub``."""
    d = Path(directory)
    what = "online policy bundle"
    meta = read_metadata(d, ONLINE_BUNDLE_FORMAT, (ONLINE_BUNDLE_VERSION,), ("actor.onnx",),
                         what)
    from .signing import verify_bundle

    signed_by = verify_bundle(d, trust, required=ONLINE_BUNDLE_CONTENT)
    onnx_path = d / "actor.onnx"
    if list(meta.get("features") or []) != list(FEATURES):
        raise BundleError(f"{what} {d}: observation features "
                          f"{meta.get('features')} differ from this version's {list(FEATURES)}")
    try:
        digest = sha256_file(onnx_path)
    except OSError as e:
        raise BundleError(f"{what} {str(d)[:200]}: actor.onnx cannot be read "
                          f"({e.strerror or e})") from None
    if digest != meta.get("actor_sha256"):
        raise BundleError(f"{what} {d}: actor.onnx does not match its recorded SHA-256")
    try:
        knob_map = KnobMap(**meta["knob_map"])
        cost = OnlineCost(**meta["cost"])
    except (KeyError, TypeError, ValueError) as e:
        raise BundleError(f"{what} {d}: metadata.json: {e}") from None
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    try:
        ort_session = ort.InferenceSession(str(onnx_path), opts,
                                           providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types
        raise BundleError(f"{what} {d}: actor.onnx cannot be loaded ({e})") from None
    return OnlineBundle(d, meta, knob_map, cost, ort_session, signed_by)
