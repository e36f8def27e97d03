"""Signed bundles where they are served, against the real thing: ``serve.py`` under uvicorn
(:class:`serving.local.LocalServer`, HTTPS with the test run's PKI) and the controller
adapters over HTTP.

The server refuses a policy swap (``PUT /v1/policy``) to a bundle that is unsigned, changed
after signing or signed by a key it does not trust, with 409 naming why, even when forced;
the policy it has keeps serving (same version and hash, decisions from it); each refusal is
logged once with the bundle and the key id, never key material. A cached adapter trusts its
own keys: a bundle the server offers that is signed by a key the adapter does not trust, or
changed on the server's disk after signing, is refused and the adapter keeps deciding with
the bundle it has; an adapter that trusts the key takes it."""

from __future__ import annotations

import json
import logging
import shutil

import httpx
import pytest

from serving.bundles.signing import SIGNATURE_FILE, BundleTrust, generate_key_pair, sign_bundle
from serving.bundles.static import load_bundle
from serving.local import LocalServer
from serving.scenario import adapter_for, replay_window

KEY, ADMIN = (f"{n}-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0" for n in ("signed-key", "signed-admin"))
LOGGER = "smart.security.bundle"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Two key pairs beside the PKI's: ``served`` (the server trusts it, the default adapter
    does not) and ``stranger`` (nobody trusts it): name -> (private, public, key id)."""
    root = tmp_path_factory.mktemp("signing-keys")
    return {n: generate_key_pair(root / f"{n}.key") for n in ("served", "stranger")}


@pytest.fixture(scope="module")
def server(tiny_bundles, keys, tmp_path_factory):
    """The server with tiny bundle ``a`` (signed by the PKI's key), trusting the PKI's key
    and ``served``."""
    s = LocalServer(tiny_bundles["a"], tmp_path_factory.mktemp("signed-server"), api_key=KEY,
                    admin_key=ADMIN, bundle_trust_keys=[keys["served"][1]])
    with s:
        yield s
    text = server_log(s)
    assert "PRIVATE KEY" not in text and KEY not in text and ADMIN not in text


def server_log(s: LocalServer) -> str:
    """Everything the server wrote: its Python log (Hydra's file) and its stderr."""
    return "".join(p.read_text() for p in (s.log_dir / "hydra" / "serve.log", s.log_file)
                   if p.exists())


def _policy(s: LocalServer) -> dict:
    r = httpx.get(s.url + "/v1/policy", verify=s.verify, headers={"X-API-Key": KEY}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _put(s: LocalServer, path, force: bool = False) -> httpx.Response:
    return httpx.put(s.url + "/v1/policy", verify=s.verify, headers={"X-API-Key": ADMIN},
                     json={"path": str(path), "force": force}, timeout=30)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _retouch(d) -> None:
    """Change a bundle's metadata as an attacker would (the decisions' inputs), not its
    actor: its content hash stays, its signature no longer covers it."""
    meta = json.loads((d / "metadata.json").read_text())
    meta["extra"] = {**meta.get("extra", {}), "algorithm": "retouched"}
    (d / "metadata.json").write_text(json.dumps(meta, indent=2))


def _retouch_copy(src, dst):
    d = _copy(src, dst)
    _retouch(d)
    return d


def _bundle_refusals(s: LocalServer, d) -> list[str]:
    return [ln for ln in server_log(s).splitlines()
            if f"[{LOGGER}]" in ln and f"bundle {d} " in ln and "refused" in ln]


def test_a_refused_swap_keeps_the_policy_serving(server, tiny_bundles, tiny_problems, keys,
                                                 tmp_path):
    ps = tiny_problems
    v1 = _policy(server)  # the start-up bundle, or another test's swap
    assert v1["loaded"] and v1["version"] >= 1
    version = v1["version"]
    remote = adapter_for(ps, server.url, "remote", api_key=KEY, timeout_s=10.0)
    try:
        replay_window(remote, ps, ps.windows["test"][0])
        before = remote.decide(replan=True)
        assert {(d.source, d.policy_version) for d in before} == {("policy", version)}

        unsigned = _copy(tiny_bundles["b"], tmp_path / "unsigned")
        (unsigned / SIGNATURE_FILE).unlink()
        retouched = _retouch_copy(tiny_bundles["b"], tmp_path / "retouched")
        stranger = _copy(tiny_bundles["b"], tmp_path / "stranger")
        sign_bundle(stranger, keys["stranger"][0])
        kid = keys["stranger"][2]
        pki_kid = json.loads((tiny_bundles["b"] / SIGNATURE_FILE).read_text())["key_id"]
        for d, why, by in ((unsigned, "it is not signed", "-"),
                           (retouched, "changed after signing", pki_kid),
                           (stranger, f"signed by key id {kid}, which is not trusted", kid)):
            for force in (False, True):  # forcing skips the session checks, not the signature
                r = _put(server, d, force)
                assert r.status_code == 409, r.text
                assert why in r.json()["detail"] and str(d) in r.json()["detail"]
                now = _policy(server)
                assert (now["version"], now["hash"], now["name"]) == \
                       (version, v1["hash"], v1["name"])
                after = remote.decide(replan=True)
                assert {(x.source, x.policy_version) for x in after} == {("policy", version)}
                assert [x.channel for x in after] == [x.channel for x in before]
            # logged once per bundle and reason (the second PUT is not logged again)
            lines = _bundle_refusals(server, d)
            assert len(lines) == 1 and "WARNING" in lines[0], lines
            assert f"(key id {by})" in lines[0] and why in lines[0], lines
        audit = [ln for ln in server_log(server).splitlines()
                 if "smart.audit" in ln and "policy.load" in ln and "failed" in ln]
        assert len(audit) == 6, audit  # every refused PUT, forced or not
    finally:
        remote.close()


def test_the_cached_adapter_keeps_its_bundle_when_the_offer_is_refused(
        server, tiny_bundles, tiny_problems, keys, tmp_path, caplog):
    """The server swaps to bundle ``b`` signed by ``served`` (it trusts that key): an adapter
    trusting only the PKI's key refuses it and keeps deciding with ``a``; one trusting
    ``served`` takes it. Then the served files are changed on the server's disk: the server
    goes on serving the bytes it verified, and the second adapter keeps ``b``."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    ps = tiny_problems
    w = ps.windows["test"][0]
    hash_a = load_bundle(tiny_bundles["a"]).content_hash
    pki_only = adapter_for(ps, server.url, "cached", api_key=KEY, refresh_s=600,
                           cache_dir=tmp_path / "cache-pki")
    trusting = None
    try:
        replay_window(pki_only, ps, w)
        assert pki_only.policy is not None and pki_only.policy.content_hash == _policy(
            server)["hash"]
        start = _policy(server)["version"]

        served = _copy(tiny_bundles["b"], tmp_path / "served")
        sign_bundle(served, keys["served"][0])
        r = _put(server, served)
        assert r.status_code == 200, r.text
        v2 = r.json()["version"]
        assert v2 == start + 1 and r.json()["hash"] == load_bundle(tiny_bundles["b"]).content_hash

        kept = pki_only.policy
        for _ in range(2):  # polled again: refused again, logged once
            assert pki_only.refresh() is False
        assert pki_only.policy is kept and kept.content_hash == hash_a
        decisions = pki_only.decide(replan=True)
        assert {(d.source, d.policy_version) for d in decisions} == {("policy", start)}
        refusals = [rec.getMessage() for rec in caplog.records
                    if rec.name == LOGGER and rec.levelno == logging.WARNING]
        kid = keys["served"][2]
        assert len(refusals) == 1 and f"key id {kid}" in refusals[0], refusals
        assert "not trusted" in refusals[0] and "PRIVATE KEY" not in refusals[0]

        trust = BundleTrust.from_security(keys=[keys["served"][1]])
        trusting = adapter_for(ps, server.url, "cached", api_key=KEY, refresh_s=600,
                               cache_dir=tmp_path / "cache-trusting", bundle_trust=trust)
        replay_window(trusting, ps, w)
        got = trusting.policy
        assert got is not None and got.signed_by == kid
        assert {(d.source, d.policy_version) for d in trusting.decide(replan=True)} == \
               {("policy", v2)}

        # the server's copy is changed on its disk after loading: the server still offers
        # the bytes it verified and loaded, so the adapter gets the signed bundle again
        _retouch(served)
        trusting.refresh(force=True)
        assert trusting.policy is not None and trusting.policy.content_hash == got.content_hash
        assert {(d.source, d.policy_version) for d in trusting.decide(replan=True)} == \
               {("policy", v2)}
        assert not any("changed after signing" in rec.getMessage() for rec in caplog.records
                       if rec.name == LOGGER)
    finally:
        pki_only.close()
        if trusting is not None:
            trusting.close()
