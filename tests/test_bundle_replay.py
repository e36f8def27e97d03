"""What a signed bundle's bytes and serial guarantee (:mod:`serving.bundles.signing`): the bytes
that are verified are the bytes loaded and served (a writer who swaps a file after the check
changes nothing), an older signed bundle is not loaded over a newer one (rollback) unless an
admin asks for it, loading the current bundle again is not a new version, and a revoked
key or bundle is refused whatever its signature. Each test fails on loaders that verify
and load in two reads, serve the files on disk or take any validly signed bundle."""

from __future__ import annotations

import io
import json
import logging
import shutil
import zipfile

import numpy as np
import pytest
from fastapi.testclient import TestClient

from security.pki import PkiError
from security.tls import Security
from serving.bundles import static as bundle_mod
from serving.bundles.signing import (
    SIGNATURE_FILE,
    BundleTrust,
    SignatureError,
    generate_key_pair,
    main,
    sign_bundle,
)
from serving.bundles.static import load_bundle
from serving.policy_store import PolicyStore

KEY, ADMIN = (f"{n}-Zq81vB5tXw3nY0kR6mC2hL9pD4sF7gJ" for n in ("ctl", "adm"))
H, HA = {"X-API-Key": KEY}, {"X-API-Key": ADMIN}


@pytest.fixture()
def signer(tmp_path):
    """A key pair of this test and the trust of its public key: (private key, trust, id)."""
    key, pub, kid = generate_key_pair(tmp_path / "keys" / "release.key")
    return key, BundleTrust.from_files([pub]), kid


@pytest.fixture()
def pair(tiny_bundles, tmp_path, signer):
    """Copies of the two tiny bundles (different weights), signed by ``signer``: a with
    serial 100, b with serial 200."""
    key = signer[0]
    out = {}
    for name, serial in (("a", 100), ("b", 200)):
        d = out[name] = tmp_path / name
        shutil.copytree(tiny_bundles[name], d)
        sign_bundle(d, key, serial=serial)
    return out


def _scores(bundle, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).random((4, bundle.layout.size), dtype=np.float32)
    return bundle(x)


def test_a_file_swapped_after_the_check_is_not_what_loads(pair, signer, monkeypatch):
    """The loader reads the bundle once: the actor ONNX Runtime opens is the one whose hash
    was checked, even when a writer replaces ``actor.onnx`` right after the check."""
    a, b = pair["a"], pair["b"]
    want = _scores(load_bundle(a, trust=signer[1]))
    other = _scores(load_bundle(b, trust=signer[1]))
    assert not np.allclose(want, other)
    real = bundle_mod.inference_session

    def swap_then_open(path, threads=1):  # the writer strikes between check and load
        shutil.copyfile(b / path.name, a / path.name)
        return real(path, threads)

    monkeypatch.setattr(bundle_mod, "inference_session", swap_then_open)
    loaded = load_bundle(a, trust=signer[1])
    np.testing.assert_allclose(_scores(loaded), want)
    # and what is served is the verified bytes, not the (now swapped) files on disk
    served = zipfile.ZipFile(io.BytesIO(bundle_mod.bundle_zip(loaded)))
    assert served.read("actor.onnx") != (a / "actor.onnx").read_bytes()
    assert served.read(SIGNATURE_FILE) == loaded.verified.blobs[SIGNATURE_FILE]
    assert loaded.directory == a and loaded.verified.root != a
    assert oct(loaded.verified.root.stat().st_mode & 0o777) == "0o700"


def test_an_older_signed_bundle_is_not_loaded_over_a_newer_one(pair, signer, tmp_path):
    a, b = pair["a"], pair["b"]
    store = PolicyStore(trust=signer[1])
    va = store.load(a)
    vb = store.load(b)
    assert (va.version, vb.version, store.serials.highest) == (1, 2, 200)
    with pytest.raises(SignatureError, match=r"serial 100 is below 200.*rollback"):
        store.load(a)  # the replay of an already-served bundle
    assert store.current() is vb
    # the current bundle loaded again is the same version, not a new one
    assert store.load(b) is vb
    # on purpose: asked for, or re-signed (a new serial)
    assert store.load(a, allow_rollback=True).version == 3
    assert store.serials.highest == 200
    sign_bundle(a, signer[0], serial=300)
    assert store.load(a).version == 4 and store.serials.highest == 300
    assert json.loads((b / SIGNATURE_FILE).read_text())["signed"]["serial"] == 200


def test_rollback_over_http_needs_allow_rollback_and_is_audited(pair, signer, caplog):
    from serving.app import ServerSettings, create_app

    app = create_app(ServerSettings(api_keys=[KEY], admin_keys=[ADMIN], bundle_trust=signer[1],
                                    security=Security(insecure=True)))
    with TestClient(app) as c, caplog.at_level(logging.INFO, "smart.audit"):
        assert c.put("/v1/policy", json={"path": str(pair["b"])}, headers=HA).status_code == 200
        r = c.put("/v1/policy", json={"path": str(pair["a"])}, headers=HA)
        assert r.status_code == 409 and "rollback" in r.json()["detail"]
        r = c.put("/v1/policy", json={"path": str(pair["a"]), "allow_rollback": True},
                  headers=HA)
        assert r.status_code == 200 and r.json()["version"] == 2
        z = zipfile.ZipFile(io.BytesIO(c.get("/v1/policy/bundle", headers=H).content))
        assert json.loads(z.read(SIGNATURE_FILE))["signed"]["serial"] == 100
    assert "(rollback allowed)" in caplog.text


def test_revoked_keys_and_bundles_are_refused(pair, signer):
    _, trust, kid = signer
    a = pair["a"]
    assert load_bundle(a, trust=trust).signed_by == kid
    with pytest.raises(SignatureError, match=f"key id {kid}, which is revoked"):
        load_bundle(a, trust=trust.revoking([kid]))
    content = json.loads((a / "metadata.json").read_text())["actor_sha256"]
    with pytest.raises(SignatureError, match=r"content hash .* is revoked"):
        load_bundle(a, trust=trust.revoking([content.upper()]))
    assert load_bundle(pair["b"], trust=trust.revoking([content])).signed_by == kid
    with pytest.raises(PkiError, match="neither a key id"):
        trust.revoking(["not a hash!"])
    got = BundleTrust.from_mapping({"keys": list(trust.key_files), "pki_key": False,
                                    "revoked": [kid]}, Security())
    assert kid in got.revoked
    with pytest.raises(PkiError, match="revoked: expected a list"):
        BundleTrust.from_mapping({"revoked": kid}, Security())


def test_the_online_store_refuses_rollback_too(tmp_path, signer):
    from serving.policy_store import OnlinePolicyStore

    from .conftest import export_tiny_online_bundle

    key, trust, _ = signer
    old = export_tiny_online_bundle(tmp_path / "old", key)
    new = export_tiny_online_bundle(tmp_path / "new", key)  # signed later: a larger serial
    store = OnlinePolicyStore(trust=trust)
    v = store.load(new)
    with pytest.raises(SignatureError, match="rollback"):
        store.load(old)
    assert store.current() is v and store.load(new) is v
    assert store.load(old, allow_rollback=True).version == 2
    # its executor reads the verified copy, not the exported directory
    assert v.bundle.verified.root != new


def test_the_cli_signs_with_a_serial(pair, signer, capsys):
    assert main(["sign", str(pair["a"]), "--key", str(signer[0]), "--serial", "42"]) == 0
    assert "serial 42" in capsys.readouterr().out
    assert json.loads((pair["a"] / SIGNATURE_FILE).read_text())["signed"]["serial"] == 42
    assert main(["sign", str(pair["a"]), "--key", str(signer[0]), "--serial", "-1"]) == 1
    assert "serial must be a non-negative integer" in capsys.readouterr().err
