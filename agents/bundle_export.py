"""The policy bundle exporters (torch -> ONNX): a trained actor written as the directory the
serving runtime loads (:mod:`serving.bundles.static` for the static policy,
:mod:`serving.bundles.online` for the online one; their docstrings describe the files).
Writing is atomic (:func:`envs.fsutil.atomic_directory`), and every bundle is signed before
it appears (:func:`serving.bundles.signing.sign_bundle`) with the configured Ed25519 key
(``signing_key``; default the PKI's ``bundle-signing.key``, created with the development PKI
on first use)."""

from __future__ import annotations

import copy
import json
import logging
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from envs.dsmd.decoding import check_decoding
from envs.dsmd.observation import ObservationLayout
from envs.dsmd.online import OnlineCost
from envs.dsmd.online_control import FEATURES, OBS_SIZE, KnobMap
from envs.dsmd.online_greedy import FILE_ARGS
from envs.fsutil import atomic_directory
from serving.bundles.online import ONLINE_BUNDLE_FORMAT, ONLINE_BUNDLE_VERSION
from serving.bundles.signing import sign_bundle
from serving.bundles.static import BUNDLE_FORMAT, BUNDLE_VERSION, DECODING, sha256_file

__all__ = ["export_bundle", "export_online_bundle", "export_onnx"]


def export_onnx(module: Any, obs_dim: int, path: Path, output_name: str = "scores",
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
                  extra: dict | None = None, overwrite: bool = False,
                  signing_key: str | Path | None = None) -> Path:
    """Export a torch actor (``nn.Module``: obs -> scores in [-1, 1]) as a policy bundle of
    version :data:`serving.bundles.static.BUNDLE_VERSION`, signed with ``signing_key`` (an Ed25519
    PKCS#8 PEM file; None: the PKI's ``bundle-signing.key``)."""
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
                "extra": extra or {}, "actor_sha256": sha256_file(tmp / "actor.onnx"),
                "actor_row_sha256": sha256_file(tmp / "actor_row.onnx")}
        (tmp / "metadata.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        sign_bundle(tmp, signing_key)
    return Path(directory)


def export_online_bundle(actor: Any, knob_map: KnobMap, cost: OnlineCost, directory: str | Path,
                         *, dataset: dict[str, Any] | None = None, extra: dict | None = None,
                         overwrite: bool = False,
                         signing_key: str | Path | None = None) -> Path:
    """Export a torch actor (``nn.Module``: obs [B, 12] -> action [B, 3] in [-1, 1]) as an
    online policy bundle of version :data:`serving.bundles.online.ONLINE_BUNDLE_VERSION`
    (the files the knob map's fixed arguments name copied in, :data:`~envs.dsmd.
    online_greedy.FILE_ARGS`),
    signed with ``signing_key`` (an Ed25519 PKCS#8 PEM file; None: the PKI's
    ``bundle-signing.key``)."""
    with atomic_directory(directory, overwrite) as tmp:
        export_onnx(copy.deepcopy(actor).eval().cpu(), OBS_SIZE, tmp / "actor.onnx",
                    output_name="action")
        import onnxruntime

        km = asdict(knob_map)
        files: dict[str, str] = {}
        for arg, name in FILE_ARGS.items():  # a fixed argument's file travels in the bundle
            if km["fixed"].get(arg) is not None:
                shutil.copyfile(km["fixed"][arg], tmp / name)
                km["fixed"][arg], files[name] = name, sha256_file(tmp / name)
        meta = {"format": ONLINE_BUNDLE_FORMAT, "version": ONLINE_BUNDLE_VERSION,
                "features": list(FEATURES), "knob_map": km,
                "cost": cost.as_dict(), "dataset": dataset or {},
                "actor_sha256": sha256_file(tmp / "actor.onnx"), "files": files,
                "onnxruntime": onnxruntime.__version__, **(extra or {})}
        (tmp / "metadata.json").write_text(json.dumps(meta, indent=2, default=str))
        sign_bundle(tmp, signing_key)
    return Path(directory)
