"""Per-role identities that clients pin (:mod:`security.pki`, :mod:`security.tls`): every
certificate names its principal's identity name (``agent-3.id.smart-dsmd``), a development
certificate issued before that is issued again, and a client that expects a principal
refuses any other identity of the same PKI, whatever host it dials. Over real TLS: an HTTPS
server on loopback (sync and async clients) and the policy server's clients. The gRPC side
(the controller's channels to agents) is in ``tests/test_security_grpc.py``."""

from __future__ import annotations

import asyncio
import http.server
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from cryptography import x509

from security import pki as pki_mod
from security.pki import Pki, identity_host
from security.tls import Security, client_ssl_context
from serving.client.transport import tls_verify


def _names(cert_path) -> list[str]:
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.DNSName)


def test_every_identity_names_its_principal_and_stale_ones_are_reissued(tmp_path, monkeypatch):
    pki = Pki.ensure(tmp_path / "pki")
    for p in ("controller", "policy-server", "agent-7"):
        assert identity_host(p) in _names(pki.identity(p).cert)
    # a certificate issued before identity names (its SAN lacks one) is issued again
    monkeypatch.setattr(pki_mod, "identity_host", lambda p: f"{p}.old.example")
    old = pki.identity("agent-9").cert
    assert "agent-9.id.smart-dsmd" not in _names(old)
    monkeypatch.undo()
    assert "agent-9.id.smart-dsmd" in _names(pki.identity("agent-9").cert)


@contextmanager
def _https_server(security: Security, principal: str) -> Iterator[str]:
    """An HTTPS server on loopback presenting ``principal``'s certificate; yields its URL."""

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    ident = security.identity(principal)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(ident.cert), str(ident.key))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"https://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def _get(url: str, verify: ssl.SSLContext) -> int:
    with httpx.Client(verify=verify, timeout=5) as c:
        return c.get(url).status_code


def _aget(url: str, verify: ssl.SSLContext) -> int:
    async def go() -> int:
        async with httpx.AsyncClient(verify=verify, timeout=5) as c:
            return (await c.get(url)).status_code

    return asyncio.run(go())


@pytest.mark.parametrize("fetch", [_get, _aget], ids=["sync", "async"])
def test_a_pinned_client_refuses_another_identity_of_the_pki(tmp_path, fetch):
    sec = Security(pki_dir=str(tmp_path / "pki"))
    pinned = client_ssl_context(sec, expect="policy-server")
    with _https_server(sec, "agent-3") as url:  # a node's identity, at the server's address
        # checked by host name alone, any identity of the PKI answers
        assert fetch(url, client_ssl_context(sec)) == 200
        with pytest.raises(httpx.ConnectError, match=r"policy-server\.id\.smart-dsmd"):
            fetch(url, pinned)
    with _https_server(sec, "policy-server") as url:
        assert fetch(url, pinned) == 200


def test_the_policy_server_clients_are_pinned(tmp_path):
    sec = Security(pki_dir=str(tmp_path / "pki"))
    verify = tls_verify(sec, "https://127.0.0.1:1")
    assert isinstance(verify, ssl.SSLContext)
    with _https_server(sec, "controller") as url, pytest.raises(httpx.ConnectError):
        _get(url, verify)
    with _https_server(sec, "policy-server") as url:
        assert _get(url, verify) == 200
