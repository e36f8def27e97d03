"""The development PKI (security/pki.py) and the Security setting (security/tls.py)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import stat
import subprocess
import sys
from concurrent import futures

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from security.pki import Pki, PkiError, agent_principal, role_of
from security.tls import Security, SecurityError, peer_principal


def test_create_layout_and_permissions(tmp_path):
    pki = Pki.ensure(tmp_path / "pki", agents=[0, 7])
    names = {p.name for p in pki.dir.iterdir()}
    for p in ("ca", "controller", "broker", "policy-server", "admin", "agent-0", "agent-7"):
        assert {f"{p}.crt", f"{p}.key"} <= names
    assert {"bundle-signing.key", "bundle-signing.pub"} <= names
    assert stat.S_IMODE(pki.dir.stat().st_mode) == 0o700
    for key in pki.dir.glob("*.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key


def test_certificate_names_roles_and_chain(tmp_path):
    pki = Pki.ensure(tmp_path)
    ident = pki.agent(12)
    cert = x509.load_pem_x509_certificate(ident.cert.read_bytes())
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    cert.verify_directly_issued_by(ca)
    assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == "agent-12"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "spiffe://smart-dsmd/agent/agent-12" in san.get_values_for_type(
        x509.UniformResourceIdentifier)
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert role_of("agent-12") == "agent" and role_of("controller") == "controller"
    assert agent_principal(3) == "agent-3"


def test_ensure_is_idempotent(tmp_path):
    pki = Pki.ensure(tmp_path)
    before = pki.ca_cert.read_bytes(), pki.identity("controller").cert.read_bytes()
    Pki.ensure(tmp_path)
    assert (pki.ca_cert.read_bytes(), pki.identity("controller").cert.read_bytes()) == before


def _ensure(d: str) -> str:
    return Pki.ensure(d, agents=range(20)).ca_cert.read_text()


def test_concurrent_creation_gives_one_ca(tmp_path):
    with mp.get_context("spawn").Pool(3) as pool:
        cas = pool.map(_ensure, [str(tmp_path)] * 3)
    assert len(set(cas)) == 1


def test_deployment_directory_reads_never_issues(tmp_path):
    Pki.ensure(tmp_path)
    (tmp_path / "ca.key").unlink()
    pki = Pki(tmp_path)
    assert pki.identity("controller").cert.exists()
    with pytest.raises(PkiError, match=r"agent-4: no .*agent-4\.crt.*no ca\.key"):
        pki.agent(4)
    with pytest.raises(PkiError, match="invalid principal"):
        pki.identity("../etc/passwd")


def test_identity_repr_and_errors_carry_no_key(tmp_path):
    ident = Pki.ensure(tmp_path).identity("controller")
    key = ident.key.read_text()
    assert "PRIVATE" not in repr(ident) and key not in repr(ident)
    ident.key.unlink()
    with pytest.raises(PkiError, match="controller: cannot read its private key"):
        ident.read()


def test_security_from_mapping():
    assert Security.from_mapping(None) == Security()
    assert Security.from_mapping({"insecure": True}).insecure
    assert Security.from_mapping({"pki_dir": "/x"}).pki_dir == "/x"
    with pytest.raises(SecurityError, match=r"security: unknown key\(s\) \['tls'\]"):
        Security.from_mapping({"tls": 1})
    with pytest.raises(SecurityError, match=r"security\.insecure: expected true or false"):
        Security.from_mapping({"insecure": "yes"})
    with pytest.raises(SecurityError, match="no PKI"):
        _ = Security(insecure=True).pki


def test_insecure_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="smart.security"):
        assert Security(insecure=True).warn_if_insecure("unit test")
        assert not Security().warn_if_insecure("unit test")
    assert [r.getMessage() for r in caplog.records if "SECURITY OFF" in r.getMessage()] == [
        "SECURITY OFF: unit test runs without TLS or authentication (security.insecure=true); "
        "anyone who reaches its ports can use it"]


def test_cli_creates(tmp_path):
    out = subprocess.run([sys.executable, "-m", "security.pki", "create", "--dir",
                          str(tmp_path), "--agents", "0-2,5"], capture_output=True, text=True,
                         check=True)
    assert str(tmp_path) in out.stdout and "PRIVATE" not in out.stdout + out.stderr
    assert (tmp_path / "agent-5.crt").exists() and not (tmp_path / "agent-3.crt").exists()


def test_grpc_mutual_tls_and_peer_principal(tmp_path):
    """A real gRPC server with the helpers: the peer's role and principal come back; a client
    without a certificate or from another CA never reaches the handler."""
    grpc = pytest.importorskip("grpc")
    from security.tls import channel_credentials, server_credentials

    sec = Security(pki_dir=str(tmp_path / "a"))
    seen = []

    def echo(req, ctx):
        seen.append(peer_principal(ctx))
        return req

    handler = grpc.method_handlers_generic_handler(
        "t.T", {"E": grpc.unary_unary_rpc_method_handler(echo)})
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(sec.agent(3)))
    server.start()
    try:
        target = f"127.0.0.1:{port}"
        with grpc.secure_channel(target, channel_credentials(sec.identity("controller"))) as ch:
            assert ch.unary_unary("/t.T/E")(b"hi", timeout=10) == b"hi"
        assert seen == [("controller", "controller")]
        other = Security(pki_dir=str(tmp_path / "b")).identity("controller")
        for ch in (grpc.insecure_channel(target),
                   grpc.secure_channel(target, channel_credentials(other))):
            with ch, pytest.raises(grpc.RpcError) as err:
                ch.unary_unary("/t.T/E")(b"x", timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert len(seen) == 1
    finally:
        server.stop(0)


def test_reserved_names_are_not_principals(tmp_path):
    pki = Pki.ensure(tmp_path)
    for name in ("ca", "bundle-signing"):
        with pytest.raises(PkiError, match="invalid principal"):
            pki.identity(name)
