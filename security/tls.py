""":class:`Security`, the one security setting every component takes, and gRPC's mutual TLS.

Secure is the default: ``Security()`` is the development PKI of :mod:`security.pki`
(created on first use), ``Security(pki_dir=D)`` a deployment's own directory of the same
layout, and ``Security(insecure=True)`` plain text for debugging, which logs a warning
naming the component each time a component starts with it.

gRPC: :func:`server_credentials` asks every client for a certificate the CA signed;
:func:`channel_credentials` presents this component's and verifies the server's;
:func:`peer_principal` reads the peer's (role, principal) back from a call's auth context,
for the servicer's role check.

Pinning: a client that dials a principal (the controller dialling ``agent-3``, an agent
dialling ``controller``, an adapter dialling ``policy-server``) checks the server's
certificate against that principal's identity name (:func:`security.pki.identity_host`)
instead of the dialled address (:func:`pinned_options` for gRPC, ``expect`` of
:func:`client_ssl_context` for HTTPS): another identity of the same PKI cannot answer there.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from security.pki import SPIFFE_PREFIX, Pki, PkiError, TlsIdentity, identity_host, role_of

log = logging.getLogger("smart.security")


class SecurityError(PkiError):
    """A security setting is invalid (the message names the key)."""


@dataclass(frozen=True)
class Security:
    """``insecure``: plain-text channels, no authentication (debugging only: warns).
    ``pki_dir``: the PKI directory (default: the development PKI, created on first use)."""

    insecure: bool = False
    pki_dir: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.insecure, bool):
            raise SecurityError(f"security.insecure: expected true or false, got "
                                f"{self.insecure!r}")
        if self.pki_dir is not None and not isinstance(self.pki_dir, str | Path):
            raise SecurityError(f"security.pki_dir: expected a path, got {self.pki_dir!r}")
        if self.pki_dir is not None:
            object.__setattr__(self, "pki_dir", str(self.pki_dir))

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any] | Security | None,
                     section: str = "security") -> Security:
        """From a config block ``{insecure: bool, pki_dir: path|null}``; an unknown key is a
        :class:`SecurityError` naming it. ``None`` is the secure default."""
        if m is None:
            return cls()
        if isinstance(m, Security):
            return m
        if not isinstance(m, Mapping):
            raise SecurityError(f"{section}: expected a mapping, got {type(m).__name__}")
        unknown = sorted(set(m) - {"insecure", "pki_dir"})
        if unknown:
            raise SecurityError(f"{section}: unknown key(s) {unknown}; known: "
                                f"['insecure', 'pki_dir']")
        ins = m.get("insecure", False)
        if not isinstance(ins, bool):
            raise SecurityError(f"{section}.insecure: expected true or false, got {ins!r}")
        d = m.get("pki_dir")
        return cls(insecure=ins, pki_dir=None if d in (None, "") else str(d))

    @property
    def pki(self) -> Pki:
        """The PKI (created as a development PKI if the directory has none yet)."""
        if self.insecure:
            raise SecurityError("security.insecure is set: there is no PKI to use")
        return Pki.ensure(self.pki_dir)

    def identity(self, principal: str) -> TlsIdentity:
        return self.pki.identity(principal)

    def agent(self, node: int) -> TlsIdentity:
        return self.pki.agent(node)

    def warn_if_insecure(self, component: str) -> bool:
        """Log the debugging warning if insecure; returns ``self.insecure``."""
        if self.insecure:
            log.warning("SECURITY OFF: %s runs without TLS or authentication "
                        "(security.insecure=true); anyone who reaches its ports can use it",
                        component)
        return self.insecure


# --------------------------------------------------------------------------- HTTPS


class _PinnedContext(ssl.SSLContext):
    """A client context that checks every server's certificate against one identity name
    (:attr:`pinned`) whatever host it dials (module docstring)."""

    pinned: str

    def wrap_socket(self, sock: Any, *args: Any, **kw: Any) -> Any:
        kw["server_hostname"] = self.pinned
        return super().wrap_socket(sock, *args, **kw)

    def wrap_bio(self, incoming: Any, outgoing: Any, server_side: bool = False,
                 server_hostname: Any = None, session: Any = None) -> Any:
        return super().wrap_bio(incoming, outgoing, server_side, self.pinned, session)


def client_ssl_context(security: Security, principal: str | None = None, *,
                       expect: str | None = None) -> ssl.SSLContext:
    """An HTTPS client context trusting only the PKI's CA, presenting ``principal``'s
    certificate if one is given (mutual TLS). ``expect``: the principal the server must be
    (its certificate must carry ``identity_host(expect)``, whatever host is dialled); None:
    the dialled host name is checked."""
    if expect is None:
        ctx = ssl.create_default_context(cafile=str(security.pki.ca_cert))
    else:
        ctx = _PinnedContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.pinned = identity_host(expect)
        ctx.load_verify_locations(cafile=str(security.pki.ca_cert))
    if principal is not None:
        ident = security.identity(principal)
        ctx.load_cert_chain(str(ident.cert), str(ident.key))
    return ctx


# --------------------------------------------------------------------------- gRPC


def server_credentials(ident: TlsIdentity) -> Any:
    """Server credentials presenting ``ident`` and requiring a client certificate signed by
    its CA."""
    import grpc

    ca, cert, key = ident.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=True)


def pinned_options(expect: str) -> list[tuple[str, str]]:
    """gRPC channel options that check the server's certificate against ``expect``'s
    identity name instead of the dialled address (module docstring)."""
    return [("grpc.ssl_target_name_override", identity_host(expect))]


def channel_credentials(ident: TlsIdentity) -> Any:
    """Channel credentials presenting ``ident`` and verifying the server against its CA."""
    import grpc

    ca, cert, key = ident.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                        certificate_chain=cert)


def peer_principal(context: Any) -> tuple[str, str] | None:
    """(role, principal) of a gRPC call's authenticated peer, from its certificate's
    ``spiffe://smart-dsmd/<role>/<principal>`` name (the common name if there is none);
    ``None`` for a plain-text or unauthenticated call."""
    try:
        auth = context.auth_context()
    except Exception:
        return None
    for raw in auth.get("x509_subject_alternative_name", []) + auth.get("peer_spiffe_id", []):
        s = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        if s.startswith(SPIFFE_PREFIX):
            role, _, principal = s[len(SPIFFE_PREFIX):].partition("/")
            if role and principal:
                return role, principal
    cn = auth.get("x509_common_name", [])
    if cn:
        principal = cn[0].decode(errors="replace") if isinstance(cn[0], bytes) else str(cn[0])
        return role_of(principal), principal
    return None
