"""The exported online policy: what evaluation workers and serving load, with ONNX Runtime
alone (no Ray, no torch).

A directory::

    actor.onnx      the DDPG actor: obs (float32, [B, 12]) -> action (float32, [B, 3]) in
                    [-1, 1] (tanh), unsquashed to the knobs' [0, 1] by
                    envs.dsmd.online_control.KnobPolicy
    metadata.json   format and version; the observation's feature names (the history
                    features the policy needs, computed by
                    envs.dsmd.online_control.online_features); the knob map (ranges,
                    executor); the online cost it was trained for; the dataset and
                    scenario; training facts; the SHA-256 of actor.onnx

:func:`load_online_bundle` refuses (:class:`agents.bundle.BundleError`, naming what differs)
a bundle whose files are missing or unreadable, whose actor does not match its recorded
hash, or whose features differ from this version's :data:`FEATURES`. Writing is atomic.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from envs.dsmd.online import OnlineCost
from envs.dsmd.online_control import FEATURES, OBS_SIZE, KnobMap, KnobPolicy
from envs.fsutil import atomic_directory

from .bundle import BundleError, _sha256

__all__ = ["ONLINE_BUNDLE_FORMAT", "OnlineBundle", "export_online_bundle",
           "load_online_bundle"]

ONLINE_BUNDLE_FORMAT = "smart-dsmd-online-policy"
ONLINE_BUNDLE_VERSION = 1


def export_online_bundle(actor: Any, knob_map: KnobMap, cost: OnlineCost, directory: str | Path,
                         *, dataset: dict[str, Any] | None = None, extra: dict | None = None,
                         overwrite: bool = False) -> Path:
    """Export a torch actor (``nn.Module``: obs [B, 12] -> action [B, 3] in [-1, 1])."""
    import copy

    from .bundle import export_onnx

    with atomic_directory(directory, overwrite) as tmp:
        export_onnx(copy.deepcopy(actor).eval().cpu(), OBS_SIZE, tmp / "actor.onnx",
                    output_name="action")
        import onnxruntime

        meta = {"format": ONLINE_BUNDLE_FORMAT, "version": ONLINE_BUNDLE_VERSION,
                "features": list(FEATURES), "knob_map": asdict(knob_map),
                "cost": asdict(cost), "dataset": dataset or {},
                "actor_sha256": _sha256(tmp / "actor.onnx"),
                "onnxruntime": onnxruntime.__version__, **(extra or {})}
        (tmp / "metadata.json").write_text(json.dumps(meta, indent=2, default=str))
    return Path(directory)


@dataclass
class OnlineBundle:
    directory: Path
    metadata: dict[str, Any]
    knob_map: KnobMap
    cost: OnlineCost
    _session: Any

    def act(self, obs: np.ndarray) -> np.ndarray:
        """One observation (12 values) -> the actor's action in [-1, 1]^3."""
        x = np.asarray(obs, np.float32).reshape(1, OBS_SIZE)
        return self._session.run(None, {self._input: x})[0][0]

    @property
    def _input(self) -> str:
        return self._session.get_inputs()[0].name

    def decider(self, name: str = "learned", cost: OnlineCost | None = None) -> KnobPolicy:
        """The online decider this bundle's actor drives (cost: the bundle's by default)."""
        return KnobPolicy(self.act, self.knob_map, cost or self.cost, name=name)


def load_online_bundle(directory: str | Path) -> OnlineBundle:
    """Open and check an online policy bundle (module docstring)."""
    d = Path(directory)
    meta_path, onnx_path = d / "metadata.json", d / "actor.onnx"
    for p in (meta_path, onnx_path):
        try:
            present = p.is_file()
        except OSError as e:  # a name too long, a path through a file, no permission
            raise BundleError(f"online policy bundle {str(d)[:200]}: cannot be read "
                              f"({e.strerror})") from None
        if not present:
            raise BundleError(f"online policy bundle {str(d)[:200]}: {p.name} is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise BundleError(f"online policy bundle {d}: metadata.json is unreadable ({e})") from None
    if meta.get("format") != ONLINE_BUNDLE_FORMAT:
        raise BundleError(f"online policy bundle {d}: format {meta.get('format')!r}, expected "
                          f"{ONLINE_BUNDLE_FORMAT!r}")
    if meta.get("version") != ONLINE_BUNDLE_VERSION:
        raise BundleError(f"online policy bundle {d}: version {meta.get('version')!r}, this "
                          f"code reads {ONLINE_BUNDLE_VERSION}")
    if list(meta.get("features") or []) != list(FEATURES):
        raise BundleError(f"online policy bundle {d}: observation features "
                          f"{meta.get('features')} differ from this version's {list(FEATURES)}")
    if _sha256(onnx_path) != meta.get("actor_sha256"):
        raise BundleError(f"online policy bundle {d}: actor.onnx does not match its recorded "
                          "SHA-256")
    try:
        knob_map = KnobMap(**meta["knob_map"])
        cost = OnlineCost(**meta["cost"])
    except (KeyError, TypeError, ValueError) as e:
        raise BundleError(f"online policy bundle {d}: metadata.json: {e}") from None
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    try:
        session = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types
        raise BundleError(f"online policy bundle {d}: actor.onnx cannot be loaded ({e})") from None
    return OnlineBundle(d, meta, knob_map, cost, session)
