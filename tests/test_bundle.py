"""The policy bundle: the exporter (:mod:`agents.bundle_export`, torch -> ONNX) and the
runtime (:mod:`serving.bundles.static`, ONNX Runtime): round trip, verification, refusal of bad
bundles, and batch and single-row scoring."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from agents.bundle_export import export_bundle
from agents.ddpg.networks import mlp
from agents.learned import ActorPolicy
from envs.dsmd.observation import ObservationLayout
from serving.bundles.static import BundleError, load_bundle


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
    with pytest.raises(BundleError, match=r"layout mismatch.*catalog_size"):
        load_bundle(d, expect_layout=ObservationLayout("channel", 999, layout.num_nodes,
                                                       layout.num_topics))
    with pytest.raises(BundleError, match=r"signature mismatch.*scenario"):
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


def _chunked_bundle(tmp_path, ps, monkeypatch, threads: int):
    """A per-channel actor's bundle whose batches are scored in chunks of 3 observations on
    ``threads`` threads: (bundle, its directory, the actor, the layout)."""
    import serving.bundles.static as bundle_mod
    from agents.ddpg.networks import ChannelActor

    torch.manual_seed(0)
    layout = ObservationLayout("channel", ps.catalog_size, ps.num_nodes, ps.spec.num_topics)
    actor = ChannelActor(layout.size, layout.num_topics + 1, 4, [16, 16])
    d = export_bundle(actor, layout, ps.signature(), tmp_path / "pc")
    monkeypatch.setattr(bundle_mod, "BATCH_CHUNK_ROWS", 3 * (layout.num_topics + 1))
    b = load_bundle(d, batch_threads=threads)
    assert b.scorer._chunk == 3 and b.batch_threads == threads
    return b, d, actor, layout


@pytest.mark.parametrize("threads", [1, 3])
def test_batches_are_scored_in_chunks_across_threads(tmp_path, tiny_problems, monkeypatch,
                                                     threads):
    """A batch larger than a chunk is scored chunk by chunk, shared out among
    ``batch_threads`` threads: the same scores as each row on its own, in order, for a
    batch that does not divide into whole chunks; the per-channel actor's batch file is its
    channel-major form (no Add node: the biases are folded into the GEMMs)."""
    import onnx

    b, d, actor, layout = _chunked_bundle(tmp_path, tiny_problems, monkeypatch, threads)
    ops = [n.op_type for n in onnx.load(d / "actor.onnx").graph.node]
    assert ops.count("MatMul") == 3 and "Add" not in ops
    x = np.random.default_rng(4).uniform(-1, 1, (20, layout.size)).astype(np.float32)
    with torch.no_grad():
        ref = actor(torch.as_tensor(x)).numpy()
    for n in (2, 3, 4, 20):
        got = b(x[:n])
        assert got.shape == (n, layout.num_topics + 1) and got.dtype == np.float32
        np.testing.assert_allclose(got, ref[:n], atol=1e-5)
    one_by_one = [b.scorer.ort_session.run(["scores"], {"obs": r[None]})[0][0] for r in x]
    np.testing.assert_array_equal(b(x), np.stack(one_by_one))  # chunking changes no bit


@pytest.mark.parametrize("threads", [1, 3])
def test_score_rows_fills_each_chunk_on_the_thread_that_scores_it(tmp_path, tiny_problems,
                                                                  monkeypatch, threads):
    """``PolicyBundle.score_rows``: ``fill`` writes every row once, a chunk at a time on the
    threads that score (all of them used for a batch of many chunks), and the observations
    and scores are those of filling the whole batch first and scoring it; a batch of one
    chunk or less is filled in one call."""
    import threading

    b, _, _, layout = _chunked_bundle(tmp_path, tiny_problems, monkeypatch, threads)
    main = threading.get_ident()
    x = np.random.default_rng(5).uniform(-1, 1, (40, layout.size)).astype(np.float32)
    for n in (1, 3, 4, 40):
        calls: list[tuple[int, int, int]] = []
        lock, shared = threading.Lock(), threading.Event()

        def fill(lo, hi, out, calls=calls, lock=lock, shared=shared, n=n):
            with lock:
                calls.append((lo, hi, threading.get_ident()))
                if len({c[2] for c in calls}) > 1:
                    shared.set()
            if threads > 1 and n == 40:  # no thread goes on alone: whichever starts waits
                assert shared.wait(10), "no second thread took a chunk"
            out[...] = x[lo:hi]

        obs, scores = b.score_rows(n, fill)
        np.testing.assert_array_equal(obs, x[:n])
        np.testing.assert_array_equal(scores, b(x[:n]))
        assert sorted(c[:2] for c in calls) == ([(0, n)] if n <= 3 else
                                                [(i, min(i + 3, n)) for i in range(0, n, 3)])
        if n == 40 and threads == 3:
            assert len({c[2] for c in calls}) > 1
        elif threads == 1:
            assert {c[2] for c in calls} == {main}


def test_a_batch_does_not_wait_for_a_busy_pool(tmp_path, tiny_problems, monkeypatch):
    """The batch threads take chunks as they come: with the pool's helper busy elsewhere
    (another request's batch), the caller scores every chunk itself and returns at once."""
    import threading

    import serving.bundles.static as bundle_mod

    b, _, _, layout = _chunked_bundle(tmp_path, tiny_problems, monkeypatch, 2)
    x = np.random.default_rng(6).uniform(-1, 1, (20, layout.size)).astype(np.float32)
    want = b(x)
    release = threading.Event()
    busy = bundle_mod._batch_pool(1).submit(release.wait, 30)
    try:
        done = threading.Event()
        got = []
        t = threading.Thread(target=lambda: (got.append(b(x)), done.set()), daemon=True)
        t.start()
        assert done.wait(10), "the batch waited for the busy helper"
        np.testing.assert_array_equal(got[0], want)
    finally:
        release.set()
        busy.result()


def test_an_error_in_a_helper_stops_every_thread_before_it_is_raised(tmp_path, tiny_problems,
                                                                    monkeypatch):
    """With three threads, a helper's failing chunk stops the others: once the error is
    raised, no thread fills or scores another chunk of that batch."""
    import threading
    import time

    b, _, _, layout = _chunked_bundle(tmp_path, tiny_problems, monkeypatch, 3)
    main = threading.get_ident()
    x = np.random.default_rng(8).uniform(-1, 1, (60, layout.size)).astype(np.float32)
    calls, lock = [], threading.Lock()
    failed = threading.Event()

    def fill(lo, hi, out):
        with lock:
            calls.append(lo)
            first_helper = threading.get_ident() != main and not failed.is_set()
            if first_helper:
                failed.set()
        if first_helper:
            raise RuntimeError("bad chunk")
        time.sleep(0.002)  # slow chunks, so the batch is still running when it fails
        out[...] = x[lo:hi]

    with pytest.raises(RuntimeError, match="bad chunk"):
        b.score_rows(60, fill)
    seen = len(calls)
    time.sleep(0.1)
    assert len(calls) == seen < 20


@pytest.mark.parametrize("where", ["caller", "helper"])
def test_an_error_in_a_chunk_reaches_the_caller(tmp_path, tiny_problems, monkeypatch, where):
    """A chunk that fails (its observations here), on the caller's thread or a helper's, fails
    the batch with that error; the pool still scores the next batch."""
    import threading

    b, _, _, layout = _chunked_bundle(tmp_path, tiny_problems, monkeypatch, 2)
    main = threading.get_ident()
    x = np.random.default_rng(7).uniform(-1, 1, (30, layout.size)).astype(np.float32)

    helper_in, main_in = threading.Event(), threading.Event()

    def fill(lo, hi, out):
        # each side waits for the other to hold a chunk before the one meant to fail does, so
        # a thread that starts first cannot take every chunk and leave the other none
        on_main = threading.get_ident() == main
        if not on_main:
            helper_in.set()
            if where == "caller":
                main_in.wait(10)
        else:
            main_in.set()
            if where == "helper":
                helper_in.wait(10)
        if on_main == (where == "caller"):
            raise RuntimeError(f"bad chunk at {lo}")
        out[...] = x[lo:hi]

    with pytest.raises(RuntimeError, match="bad chunk"):
        b.score_rows(30, fill)
    np.testing.assert_array_equal(b.score_rows(30, lambda lo, hi, out: out.__setitem__(
        Ellipsis, x[lo:hi]))[1], b(x))


def test_one_row_actor_file_and_unreadable_versions(exported, tmp_path):
    """A bundle holds the actor twice (any batch, and one observation); both are verified,
    both must be there. A bundle of a version this runtime does not read (an older format
    without the one-row file, or an unknown one) is refused naming the file, the version
    found and the versions read."""
    import shutil

    d, _, layout, _ = exported
    b = load_bundle(d)
    assert b.files == ("metadata.json", "actor.onnx", "actor_row.onnx", "SIGNATURE.json")
    assert b.signed_by is not None
    x = np.random.default_rng(2).uniform(-1, 1, (4, layout.size)).astype(np.float32)
    batch = b(x)
    for i, row in enumerate(x):
        np.testing.assert_array_equal(b(row), b(row[None])[0])
        np.testing.assert_allclose(b(row), batch[i], atol=1e-5)
    for version in (2, 3, 9, "4"):
        old = tmp_path / f"v{version}"
        shutil.copytree(d, old)
        meta = json.loads((old / "metadata.json").read_text())
        meta["version"] = version
        (old / "metadata.json").write_text(json.dumps(meta))
        with pytest.raises(BundleError, match=rf"{old / 'metadata.json'}: policy bundle "
                           rf"version {version!r}; .* reads version 4 "):
            load_bundle(old)
    (d / "actor_row.onnx").unlink()
    with pytest.raises(BundleError, match=r"actor_row\.onnx is missing"):
        load_bundle(d)
    shutil.copy(d / "actor.onnx", d / "actor_row.onnx")  # the wrong file in its place
    with pytest.raises(BundleError, match=r"actor_row\.onnx: content hash"):
        load_bundle(d)
    meta = json.loads((d / "metadata.json").read_text())
    (d / "metadata.json").write_text(json.dumps(meta | {"format": "other"}))
    with pytest.raises(BundleError, match="format 'other', expected 'smart-dsmd-policy'"):
        load_bundle(d)


@pytest.fixture()
def per_channel_exported(tmp_path, tiny_problems):
    from agents.ddpg.networks import ChannelActor

    torch.manual_seed(0)
    ps = tiny_problems
    layout = ObservationLayout("channel", ps.catalog_size, ps.num_nodes, ps.spec.num_topics)
    actor = ChannelActor(layout.size, layout.num_topics + 1, 4, [16, 16])
    d = export_bundle(actor, layout, ps.signature(), tmp_path / "pc")
    return d, actor, layout, ps


def test_per_channel_row_file_takes_globals_and_features(per_channel_exported):
    """A per-channel actor's actor_row.onnx (bundle version 4) takes the observation as its
    globals ``[G, 1]`` and feature blocks ``[P, K+1]``, views of one buffer, and is only its
    GEMMs; it scores as the torch actor and the batch file do."""
    import onnx

    from serving.bundles.static import row_inputs

    d, actor, layout, _ps = per_channel_exported
    assert json.loads((d / "metadata.json").read_text())["version"] == 4
    ops = [n.op_type for n in onnx.load(d / "actor_row.onnx").graph.node]
    assert ops == ["Gemm", "Gemm", "Relu", "Gemm", "Relu", "Gemm", "Tanh"]
    b = load_bundle(d)
    x = np.random.default_rng(5).uniform(-1, 1, (6, layout.size)).astype(np.float32)
    feeds = row_inputs(b.scorer.row_ort_session, x[0])
    assert [(k, v.shape) for k, v in feeds.items()] == [
        ("globals", (actor.g, 1)), ("features", (4, layout.num_topics + 1))]
    assert all(np.shares_memory(v, x[0]) for v in feeds.values())
    with torch.no_grad():
        ref = actor(torch.as_tensor(x)).numpy()
    batch = b(x)
    for i, r in enumerate(x):
        np.testing.assert_allclose(b(r), ref[i], atol=1e-5)
        np.testing.assert_allclose(b(r), batch[i], atol=1e-5)


@pytest.mark.parametrize("kind", ["exported", "per_channel_exported"])
def test_single_rows_through_bound_buffers_equal_session_run(kind, request):
    """One observation goes through per-thread IOBinding buffers: the same scores as a plain
    ``session.run``, from several threads at once, and a session without the internals it
    uses falls back to ``session.run``; for a row file with one input (``obs``) and one
    with two (a per-channel actor's globals and features)."""
    import threading

    from serving.bundles.static import _BoundRow, row_inputs

    d, _actor, layout, _ps = request.getfixturevalue(kind)
    b = load_bundle(d)
    x = np.random.default_rng(3).uniform(-1, 1, (40, layout.size)).astype(np.float32)
    row = b.scorer.row_ort_session
    ref = np.stack([row.run(["scores"], row_inputs(row, r))[0][0] for r in x])
    out: dict[int, np.ndarray] = {}

    def work(i: int) -> None:
        out[i] = np.stack([b(r) for r in x])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 4 and all(np.array_equal(v, ref) for v in out.values())
    first = b(x[0])
    b(x[1])
    np.testing.assert_array_equal(first, ref[0])  # a returned row is not overwritten

    class Plain:  # a session with only the public API
        def __init__(self, s):
            self.s = s

        def get_inputs(self):
            return self.s.get_inputs()

        def get_outputs(self):
            return self.s.get_outputs()

        def io_binding(self):
            return self.s.io_binding()

        def run(self, *a):
            return self.s.run(*a)

    plain = _BoundRow(Plain(row), layout.size)
    assert plain.call is None
    np.testing.assert_array_equal(plain(x[2]), ref[2])


def test_a_downloaded_bundle_is_written_file_by_file_whole(tmp_path):
    """Both adapters write a downloaded bundle into their cache through one function: only
    the bundle's files, each replaced whole (no temporary file left behind, an old copy of a
    file overwritten, a file the zip does not name untouched)."""
    import io
    import zipfile

    from serving.client.transport import unzip_files

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("metadata.json", "{\"new\": 1}")
        z.writestr("actor.onnx", b"\x00\x01")
        z.writestr("../evil.txt", "outside")
    d = tmp_path / "cache" / "abcd"
    d.mkdir(parents=True)
    (d / "metadata.json").write_text("{\"old\": 1, \"longer than the new one\": true}")
    (d / "keep.txt").write_text("mine")
    out = unzip_files(buf.getvalue(), d, ("metadata.json", "actor.onnx"))
    assert out == d
    assert sorted(p.name for p in d.iterdir()) == ["actor.onnx", "keep.txt", "metadata.json"]
    assert (d / "metadata.json").read_text() == "{\"new\": 1}"
    assert not (tmp_path / "cache" / "evil.txt").exists()
