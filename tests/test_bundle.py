"""The exported policy bundle: ONNX round trip, verification, and refusal of bad bundles."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from agents.bundle import BundleError, export_bundle, load_bundle
from agents.ddpg.networks import mlp
from agents.learned import ActorPolicy
from envs.dsmd.observation import ObservationLayout


@pytest.fixture()
def exported(tmp_path, tiny_problems):
    torch.manual_seed(0)
    layout = ObservationLayout("channel", tiny_problems.catalog_size, tiny_problems.num_nodes,
                               tiny_problems.spec.num_topics)
    actor = mlp(layout.size, [32, 32], layout.num_topics + 1, torch.nn.Tanh())
    d = export_bundle(actor, layout, tiny_problems.signature(), tmp_path / "bundle")
    return d, actor, layout, tiny_problems


def test_round_trip_same_actions(exported):
    d, actor, layout, ps = exported
    b = load_bundle(d, expect_layout=layout, expect_signature=ps.signature())
    x = np.random.default_rng(0).uniform(-1, 1, (64, layout.size)).astype(np.float32)
    with torch.no_grad():
        ref = actor(torch.as_tensor(x)).numpy()
    np.testing.assert_allclose(b(x), ref, atol=1e-5)
    np.testing.assert_allclose(b(x[0]), ref[0], atol=1e-5)
    # the same decisions through the common policy interface
    insts = ps.instances("test")

    def torch_fn(o):
        with torch.no_grad():
            return actor(torch.as_tensor(o[None]))[0].numpy()

    for inst in insts:
        np.testing.assert_array_equal(ActorPolicy(b, layout).assign(inst),
                                      ActorPolicy(torch_fn, layout).assign(inst))
    meta = json.loads((d / "metadata.json").read_text())
    assert meta["num_channels"] == layout.num_topics + 1 and "versions" in meta


def test_corrupted_or_mismatched_bundles_are_refused(exported, tmp_path):
    d, actor, layout, ps = exported
    with pytest.raises(BundleError, match="layout mismatch.*catalog_size"):
        load_bundle(d, expect_layout=ObservationLayout("channel", 999, layout.num_nodes,
                                                       layout.num_topics))
    with pytest.raises(BundleError, match="signature mismatch.*scenario"):
        load_bundle(d, expect_signature={**ps.signature(), "scenario": "other"})
    raw = bytearray((d / "actor.onnx").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (d / "actor.onnx").write_bytes(bytes(raw))
    with pytest.raises(BundleError, match="content hash"):
        load_bundle(d)
    (d / "metadata.json").write_text("{oops")
    with pytest.raises(BundleError, match="not valid JSON"):
        load_bundle(d)
    with pytest.raises(BundleError, match="missing"):
        load_bundle(tmp_path / "nowhere")
    with pytest.raises(FileExistsError):
        export_bundle(actor, layout, ps.signature(), d)


def test_per_channel_actor_exports_with_a_dynamic_batch(tmp_path, tiny_problems):
    """The per-channel actor reshapes by the batch size: the bundle must still take any batch
    (the server scores whole batches of types in one call)."""
    from agents.ddpg.networks import ChannelActor

    torch.manual_seed(0)
    ps = tiny_problems
    layout = ObservationLayout("channel", ps.catalog_size, ps.num_nodes, ps.spec.num_topics)
    actor = ChannelActor(layout.size, layout.num_topics + 1, 4, [16, 16])
    b = load_bundle(export_bundle(actor, layout, ps.signature(), tmp_path / "pc"))
    x = np.random.default_rng(1).uniform(-1, 1, (5, layout.size)).astype(np.float32)
    with torch.no_grad():
        ref = actor(torch.as_tensor(x)).numpy()
    for rows in (x[:1], x[:3], x):
        np.testing.assert_allclose(b(rows), ref[:len(rows)], atol=1e-5)
    np.testing.assert_allclose(b(x[0]), ref[0], atol=1e-5)
