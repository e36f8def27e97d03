"""Signed policy bundles (:mod:`serving.bundles.signing`): the exporters sign what they write
with the configured key, the loaders (:func:`serving.bundles.static.load_bundle`,
:func:`serving.bundles.online.load_online_bundle`, and the policy stores over them) refuse a
bundle whose signature is missing, malformed, by a key not trusted, or does not verify, and a
store keeps serving the policy it has."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import os
import shutil
import time
import zipfile

import numpy as np
import pytest

from security.pki import PkiError, default_pki_dir
from security.tls import Security
from serving.bundles.signing import (
    SIGNATURE_FILE,
    BundleTrust,
    SignatureError,
    generate_key_pair,
    key_id_of,
    load_public_key,
    load_signing_key,
    main,
    sign_bundle,
    verify_bundle,
)
from serving.bundles.static import BUNDLE_FILES, BundleError, load_bundle
from serving.policy_store import BundleWatcher, PolicyStore

LOGGER = "smart.security.bundle"


@pytest.fixture()
def bundle(tiny_bundles, tmp_path):
    """A copy of a tiny bundle (signed by the test run's PKI key), free to tamper with."""
    d = tmp_path / "bundle"
    shutil.copytree(tiny_bundles["a"], d)
    return d


@pytest.fixture()
def other_key(tmp_path):
    """A key pair the loaders do not trust by default: (private key, public key, key id)."""
    return generate_key_pair(tmp_path / "keys" / "other.key")


def _pki_key_id() -> str:
    return key_id_of(load_public_key(default_pki_dir() / "bundle-signing.pub"))


def _flip(path, where: int | None = None) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2 if where is None else where] ^= 0x01
    path.write_bytes(bytes(raw))


def _refusals(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_exported_bundles_are_signed_and_verify(bundle):
    """What the exporter wrote is signed by the PKI's key over every file the loader reads;
    it verifies and loads, and says by which key."""
    doc = json.loads((bundle / SIGNATURE_FILE).read_text())
    assert doc["algorithm"] == "ed25519" and doc["key_id"] == _pki_key_id()
    assert len(base64.b64decode(doc["signature"])) == 64
    meta = json.loads((bundle / "metadata.json").read_text())
    assert doc["signed"]["format"] == meta["format"]
    assert doc["signed"]["version"] == meta["version"]
    assert doc["signed"]["content_hash"] == meta["actor_sha256"]
    assert sorted(doc["signed"]["files"]) == ["actor.onnx", "actor_row.onnx", "metadata.json"]
    assert verify_bundle(bundle) == _pki_key_id()
    b = load_bundle(bundle)
    assert b.signed_by == _pki_key_id() and b.files == BUNDLE_FILES
    assert np.isfinite(b(np.zeros(b.layout.size, np.float32))).all()


@pytest.mark.parametrize("name", ["actor.onnx", "actor_row.onnx", "metadata.json"])
def test_a_file_changed_after_signing_is_refused(bundle, name, caplog):
    """One byte of any signed file (a metadata change that is still valid JSON of the right
    format and version) makes the bundle refused, naming the file."""
    if name == "metadata.json":
        meta = json.loads((bundle / name).read_text())
        meta["decision_order"] = "rate_asc" if meta["decision_order"] != "rate_asc" else "x"
        (bundle / name).write_text(json.dumps(meta, indent=2, sort_keys=True))
    else:
        _flip(bundle / name)
    caplog.set_level(logging.WARNING, LOGGER)
    with pytest.raises(SignatureError,
                       match=rf"{name}: content hash .* \(changed after signing\)"):
        load_bundle(bundle)
    (rec,) = _refusals(caplog)
    assert str(bundle) in rec.getMessage() and _pki_key_id() in rec.getMessage()


def test_a_forged_signature_is_refused_even_when_insecure(bundle, caplog):
    """A signature that does not verify (the files untouched, the signature bytes or the
    signed statement changed) is refused, by a secure and by an insecure trust."""
    doc = json.loads((bundle / SIGNATURE_FILE).read_text())
    sig = bytearray(base64.b64decode(doc["signature"]))
    sig[0] ^= 0x01
    (bundle / SIGNATURE_FILE).write_text(json.dumps(doc | {
        "signature": base64.b64encode(bytes(sig)).decode()}))
    insecure = BundleTrust.from_security(Security(insecure=True))
    for trust in (None, insecure):
        with pytest.raises(SignatureError, match="does not verify with key id"):
            load_bundle(bundle, trust=trust)
    # the statement altered to match altered files: the signature no longer covers it
    _flip(bundle / "actor.onnx")
    doc["signed"]["files"]["actor.onnx"] = hashlib.sha256(
        (bundle / "actor.onnx").read_bytes()).hexdigest()
    (bundle / SIGNATURE_FILE).write_text(json.dumps(doc))
    with pytest.raises(SignatureError, match="does not verify"):
        load_bundle(bundle)


def test_a_signature_by_an_unknown_key_is_refused(bundle, other_key, caplog):
    """Signed by a key the loader does not trust: refused, naming the key id and the
    configured key files; trusted once its public key is configured (several keys: key
    rotation), or when it is the only key."""
    key, pub, kid = other_key
    info = sign_bundle(bundle, key)
    assert info.key_id == kid and (bundle / SIGNATURE_FILE) == info.path
    caplog.set_level(logging.WARNING, LOGGER)
    pki_pub = str(default_pki_dir() / "bundle-signing.pub")
    with pytest.raises(SignatureError) as e:
        load_bundle(bundle)
    assert f"key id {kid}, which is not trusted" in str(e.value)
    assert _pki_key_id() in str(e.value) and pki_pub in str(e.value)
    assert len(_refusals(caplog)) == 1
    both = BundleTrust.from_security(Security(), keys=[pub])  # the PKI's key and this one
    assert set(both.keys) == {_pki_key_id(), kid}
    assert load_bundle(bundle, trust=both).signed_by == kid
    only = BundleTrust.from_files([pub])
    assert load_bundle(bundle, trust=only).signed_by == kid
    assert load_bundle(bundle, trust=BundleTrust.from_signing_key(key)).signed_by == kid
    assert BundleTrust.from_security(Security(), [pub], pki_key=False).keys.keys() == {kid}


def test_a_missing_signature_is_refused_unless_insecure(bundle, caplog):
    """Unsigned: refused by default; an insecure trust accepts it with a warning (and the
    debugging warning for the component), and serves it without a signature file."""
    (bundle / SIGNATURE_FILE).unlink()
    caplog.set_level(logging.WARNING)
    with pytest.raises(SignatureError, match=r"it is not signed \(SIGNATURE\.json is missing"):
        load_bundle(bundle)
    trust = BundleTrust.from_security(Security(insecure=True))
    assert any("SECURITY OFF: bundle verification" in r.getMessage() for r in caplog.records)
    b = load_bundle(bundle, trust=trust)
    assert b.signed_by is None and SIGNATURE_FILE not in b.files
    assert any(r.name == LOGGER and "unsigned bundle accepted" in r.getMessage()
               for r in caplog.records)


def test_an_untrusted_key_is_accepted_only_when_insecure_and_intact(bundle, other_key):
    """Insecure: a signature by a key not configured is accepted unverified, but a file
    changed after signing is still refused."""
    key, _pub, kid = other_key
    sign_bundle(bundle, key)
    trust = BundleTrust.from_security(Security(insecure=True))
    assert load_bundle(bundle, trust=trust).signed_by == kid
    _flip(bundle / "actor_row.onnx")
    with pytest.raises(SignatureError, match="changed after signing"):
        load_bundle(bundle, trust=trust)


@pytest.mark.parametrize("content, why", [
    ("{oops", "not readable JSON"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"algorithm": "rsa", "key_id": "x", "signature": "", "signed": {}}),
     "algorithm 'rsa'"),
    (json.dumps({"algorithm": "ed25519", "key_id": 7, "signature": "", "signed": {}}),
     "key_id must be a key id"),
    (json.dumps({"algorithm": "ed25519", "key_id": "ab", "signature": "!!", "signed": {}}),
     "signature must be the base64 of 64 bytes"),
    (json.dumps({"algorithm": "ed25519", "key_id": "ab",
                 "signature": base64.b64encode(bytes(64)).decode(), "signed": {"files": 1}}),
     "'signed' must be an object"),
])
def test_a_malformed_signature_file_is_refused_naming_it(bundle, content, why):
    (bundle / SIGNATURE_FILE).write_text(content)
    for trust in (None, BundleTrust.from_security(Security(insecure=True))):
        with pytest.raises(SignatureError) as e:
            load_bundle(bundle, trust=trust)
        assert f"{bundle / SIGNATURE_FILE} is malformed" in str(e.value) and why in str(e.value)


def test_the_policy_store_keeps_serving_after_a_refused_bundle(tiny_bundles, tmp_path, caplog):
    """The real store: v1 loaded; a tampered, an unsigned and a foreign-signed bundle are each
    refused; v1 is still current and scores; the watcher's reload of a refused bundle keeps it
    too, and the refusal is logged once (by the verifier, not again by the watcher)."""
    bad = tmp_path / "bad"
    shutil.copytree(tiny_bundles["b"], bad)
    store = PolicyStore(batch_threads=1)
    v1 = store.load(tiny_bundles["a"])
    x = np.zeros(v1.layout.size, np.float32)
    before = v1(x)
    _flip(bad / "actor.onnx")
    with pytest.raises(SignatureError):
        store.load(bad)
    (bad / SIGNATURE_FILE).unlink()
    with pytest.raises(SignatureError):
        store.load(bad)
    assert store.current() is v1 and v1.version == 1
    np.testing.assert_array_equal(store.current()(x), before)
    # the watcher sees the bundle change on disk and reloads it: refused, v1 stays
    caplog.set_level(logging.WARNING)
    live, staged = tmp_path / "live", tmp_path / "staged"
    shutil.copytree(tiny_bundles["a"], live)
    shutil.copytree(tiny_bundles["a"], staged)
    key, _, _ = generate_key_pair(tmp_path / "k" / "foreign.key")
    meta = json.loads((staged / "metadata.json").read_text())
    (staged / "metadata.json").write_text(json.dumps(meta | {"extra": {"x": 1}}, indent=2))
    sign_bundle(staged, key)  # consistent, but by a key not trusted
    watcher = BundleWatcher(store, live, period_s=0.05).start()
    try:
        # the signature first, then the metadata the watcher looks at, each in one rename
        for name in (SIGNATURE_FILE, "metadata.json"):
            shutil.copy(staged / name, tmp_path / name)
            os.replace(tmp_path / name, live / name)
        deadline = time.monotonic() + 10
        while not watcher.errors:
            assert time.monotonic() < deadline, "the watcher never tried the new bundle"
            time.sleep(0.02)
    finally:
        watcher.stop()
    assert "not trusted" in watcher.errors[0]
    assert store.current() is v1
    assert [r.name for r in caplog.records if str(live) in r.getMessage()] == [LOGGER]


def test_the_cached_adapters_copy_is_verified_too(tiny_bundles, tmp_path):
    """What a cached adapter loads: the files the server zips (``PolicyBundle.files``, the
    signature included), written into the adapter's cache (the files of
    :data:`serving.bundles.static.BUNDLE_FILES`) and opened with ``load_bundle``: a genuine copy
    loads; a copy whose actor was replaced in transit, or whose signature was dropped, is
    refused."""
    served = load_bundle(tiny_bundles["a"])

    def zipped(change=None) -> bytes:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            for name in served.files:
                data = (served.directory / name).read_bytes()
                z.writestr(name, change(name, data) if change else data)
        return buf.getvalue()

    def cache(raw: bytes, name: str):
        d = tmp_path / name
        d.mkdir()
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            for n in set(z.namelist()) & set(BUNDLE_FILES):
                (d / n).write_bytes(z.read(n))
        return d

    assert load_bundle(cache(zipped(), "good")).signed_by == _pki_key_id()
    other = load_bundle(tiny_bundles["b"]).directory / "actor.onnx"
    swapped = zipped(lambda n, b: other.read_bytes() if n == "actor.onnx" else b)
    with pytest.raises(SignatureError, match="changed after signing"):
        load_bundle(cache(swapped, "swapped"))
    d = cache(zipped(), "unsigned")
    (d / SIGNATURE_FILE).unlink()
    with pytest.raises(SignatureError, match="not signed"):
        load_bundle(d)


def test_online_bundles_are_signed_and_verified(tmp_path, other_key):
    """The online exporter signs with the configured key; the online store refuses a bundle
    signed by an untrusted key or changed after signing, keeping the one it has; the zip the
    server sends and the adapter's cache copy carry the signature."""
    from serving.bundles.online import (
        ONLINE_BUNDLE_FILES,
        ONLINE_BUNDLE_OPTIONAL,
        load_online_bundle,
    )
    from serving.bundles.static import bundle_zip
    from serving.client.transport import unzip_files
    from serving.policy_store import OnlinePolicyStore

    from .conftest import export_tiny_online_bundle

    key, pub, kid = other_key
    d = export_tiny_online_bundle(tmp_path / "online", key)
    assert json.loads((d / SIGNATURE_FILE).read_text())["key_id"] == kid
    with pytest.raises(SignatureError, match=f"key id {kid}, which is not trusted"):
        load_online_bundle(d)
    trust = BundleTrust.from_security(Security(), keys=[pub])
    store = OnlinePolicyStore(trust=trust)
    v1 = store.load(d)
    assert v1.signed_by == kid
    copy = unzip_files(bundle_zip(v1.bundle), tmp_path / "cache",
                       (*ONLINE_BUNDLE_FILES, *ONLINE_BUNDLE_OPTIONAL))
    assert (copy / SIGNATURE_FILE).is_file()
    assert load_online_bundle(copy, trust).signed_by == kid
    _flip(copy / "actor.onnx")
    with pytest.raises(SignatureError, match="changed after signing"):
        store.load(copy)
    assert store.current() is v1


def test_refusals_are_logged_once_without_key_material(bundle, other_key, caplog):
    key, pub, kid = other_key
    sign_bundle(bundle, key)
    caplog.set_level(logging.DEBUG, LOGGER)
    for _ in range(3):  # e.g. an adapter polling the same bad bundle
        with pytest.raises(SignatureError):
            verify_bundle(bundle)
    (rec,) = _refusals(caplog)
    assert kid in rec.getMessage() and str(bundle) in rec.getMessage()
    pem = key.read_text()
    body = "".join(pem.splitlines()[1:-1])
    secret = load_signing_key(key).private_bytes_raw().hex()
    text = caplog.text
    assert body not in text and secret not in text and pub.read_text().splitlines()[1] not in text


def test_key_files_and_trust_settings_are_checked(tmp_path, other_key):
    key, pub, kid = other_key
    bad = tmp_path / "bad.pub"
    bad.write_text("not a key")
    with pytest.raises(PkiError, match=f"bundle verification key {bad}: not a PEM public key"):
        BundleTrust.from_files([bad])
    with pytest.raises(PkiError, match="cannot be read"):
        BundleTrust.from_files([tmp_path / "nowhere.pub"])
    with pytest.raises(PkiError, match=r"bundle signing key .*controller\.key: a .*expected an "
                                       r"Ed25519 key"):
        load_signing_key(Security().pki.identity("controller").key)
    with pytest.raises(PkiError, match="no trusted bundle-signing public key"):
        BundleTrust.from_files([])
    assert BundleTrust.from_mapping(None).keys.keys() == {_pki_key_id()}
    assert BundleTrust.from_mapping({"keys": [str(pub)], "pki_key": False}).keys.keys() == {kid}
    with pytest.raises(PkiError, match=r"bundle_trust: unknown key\(s\) \['key'\]"):
        BundleTrust.from_mapping({"key": str(pub)})
    with pytest.raises(PkiError, match=r"bundle_trust\.keys: expected a list of paths"):
        BundleTrust.from_mapping({"keys": str(pub)})
    with pytest.raises(PkiError, match=r"bundle_trust\.pki_key: expected true or false"):
        BundleTrust.from_mapping({"pki_key": "yes"})
    with pytest.raises(FileExistsError):
        generate_key_pair(key)
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    assert "PRIVATE" not in repr(BundleTrust.from_files([pub]))


def test_cli_signs_and_verifies(bundle, other_key, capsys):
    key, pub, kid = other_key
    assert main(["sign", str(bundle), "--key", str(key)]) == 0
    assert kid in capsys.readouterr().out
    assert main(["verify", str(bundle), "--key", str(pub)]) == 0
    assert f"trusted key id {kid}" in capsys.readouterr().out
    assert main(["verify", str(bundle)]) == 1  # the PKI's key only
    assert "not trusted" in capsys.readouterr().err
    assert main(["sign", str(bundle)]) == 0  # re-signed with the PKI's key
    assert main(["verify", str(bundle)]) == 0
    _flip(bundle / "metadata.json", where=0)  # '{' -> 'z': not even JSON any more
    assert main(["verify", str(bundle)]) == 1
    assert "metadata.json" in capsys.readouterr().err


def test_the_committed_bundle_verifies_with_its_committed_key():
    """``checkpoints/default`` is signed by a key whose public half is committed
    (``configs/keys/example-bundle.pub``; its private half was not kept), so it verifies on
    any clone once that key is trusted, and not by the PKI's key alone."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    d, pub = root / "checkpoints" / "default", root / "configs" / "keys" / "example-bundle.pub"
    trust = BundleTrust.from_security(Security(), keys=[pub])
    assert verify_bundle(d, trust) == key_id_of(load_public_key(pub))
    with pytest.raises(BundleError, match="not trusted"):
        verify_bundle(d)
