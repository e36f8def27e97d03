"""The development PKI: a certificate authority and one identity per component.

``python -m security.pki create [--dir D] [--agents 0-99]`` (or ``make pki``) creates, in a
directory outside the repository (default ``~/.cache/smart-dsmd/pki``, or
``$SMART_PKI_DIR``):

* ``ca.crt`` / ``ca.key``: the development CA (ECDSA P-256, ten years);
* ``<principal>.crt`` / ``<principal>.key`` for ``controller``, ``broker``,
  ``policy-server`` and ``admin``, and ``agent-<n>`` for each agent asked for (agents'
  identities are also issued on first use, :meth:`Pki.identity`);
* ``bundle-signing.key`` / ``bundle-signing.pub``: the Ed25519 key pair that signs policy
  bundles (:mod:`serving.bundles.signing`).

Every certificate carries its principal as common name (Pulsar's TLS authentication takes it
as the role), ``spiffe://smart-dsmd/<role>/<principal>`` as URI subject alternative name (the
role gRPC services check), and ``localhost`` / ``127.0.0.1`` so the loopback deployments of
tests, the testbed and ``make run`` verify host names. Keys are PKCS#8 PEM files of mode
0600 in a directory of mode 0700; no function here returns or logs key material.

A production deployment points its configs at a directory of the same layout holding its
own CA certificate and identities (no ``ca.key``): identities are then read, never issued.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import fcntl
import ipaddress
import logging
import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from envs.netutil import principal_addresses

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

log = logging.getLogger("smart.security")

PKI_ENV = "SMART_PKI_DIR"
"""Environment variable naming the PKI directory (overrides the default)."""

SPIFFE_PREFIX = "spiffe://smart-dsmd/"
#: the DNS name suffix of identity names: every certificate names ``<principal>.`` this, and
#: clients that dial a role check the server's certificate against that name
#: (:func:`identity_host`), so only that principal's certificate can answer there
IDENTITY_DOMAIN = "id.smart-dsmd"
STANDARD_PRINCIPALS = ("controller", "broker", "policy-server", "admin")
SIGNING_KEY, VERIFY_KEY = "bundle-signing.key", "bundle-signing.pub"
_PRINCIPAL = re.compile(r"^[a-z][a-z0-9-]{0,62}$")
_VALIDITY = dt.timedelta(days=3650)
_RESERVED = frozenset({"ca", "bundle-signing"})  # file stems of the CA and the signing key


class PkiError(ValueError):
    """A PKI directory or identity is missing, malformed or unusable (the message names the
    file)."""


def default_pki_dir() -> Path:
    """``$SMART_PKI_DIR`` or ``~/.cache/smart-dsmd/pki``."""
    env = os.environ.get(PKI_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "smart-dsmd" / "pki"


def identity_host(principal: str) -> str:
    """The DNS name every certificate of ``principal`` carries and that a client expecting
    ``principal`` checks the server's certificate against (``agent-3.id.smart-dsmd``)."""
    return f"{principal}.{IDENTITY_DOMAIN}"


def role_of(principal: str) -> str:
    """The role of a principal: ``agent`` for ``agent-<n>``, the principal itself otherwise."""
    return "agent" if re.fullmatch(r"agent-\d+", principal) else principal


def agent_principal(node: int) -> str:
    """The principal of node ``node``'s agent."""
    return f"agent-{int(node)}"


@dataclass(frozen=True)
class TlsIdentity:
    """Where one component's certificate, key and trusted CA are (paths only: the key is
    read by :meth:`read` when a credential is built, and never printed)."""

    principal: str
    ca: Path
    cert: Path
    key: Path

    @property
    def role(self) -> str:
        return role_of(self.principal)

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(ca, cert, key) PEM bytes; :class:`PkiError` naming a missing or unreadable file."""
        out = []
        for what, p in (("CA certificate", self.ca), ("certificate", self.cert),
                        ("private key", self.key)):
            try:
                out.append(p.read_bytes())
            except OSError as exc:
                raise PkiError(f"{self.principal}: cannot read its {what} {p}: "
                               f"{exc.strerror or exc}") from None
        return out[0], out[1], out[2]

    def __repr__(self) -> str:
        return f"TlsIdentity({self.principal!r}, cert={str(self.cert)!r})"


class Pki:
    """A PKI directory (see the module docstring). With ``ca.key`` present it is a
    development CA and issues missing identities on demand; without, it only reads."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.dir = Path(directory).expanduser() if directory else default_pki_dir()

    def __repr__(self) -> str:
        return f"Pki({str(self.dir)!r})"

    @property
    def ca_cert(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def can_issue(self) -> bool:
        return (self.dir / "ca.key").exists()

    @property
    def signing_key(self) -> Path:
        return self.dir / SIGNING_KEY

    @property
    def verify_key(self) -> Path:
        return self.dir / VERIFY_KEY

    # ------------------------------------------------------------------ creation

    @classmethod
    def ensure(cls, directory: str | Path | None = None, *,
               agents: Iterable[int] = ()) -> Pki:
        """The PKI at ``directory``, created as a development PKI if it does not exist yet
        (CA, standard identities, bundle-signing key pair, and ``agents``' identities).
        Safe to call from concurrent processes (a file lock)."""
        pki = cls(directory)
        if pki.ca_cert.exists() and not pki.can_issue:
            for p in STANDARD_PRINCIPALS:
                pki.identity(p)  # checks the files exist
            return pki
        with pki._lock():
            if not pki.ca_cert.exists():
                pki._create_ca()
                log.warning("created a DEVELOPMENT PKI in %s (its CA key is beside it: for "
                            "development and tests only; deployments use their own PKI "
                            "directory without ca.key)", pki.dir)
            for p in STANDARD_PRINCIPALS:
                pki._issue_if_missing(p)
            for n in agents:
                pki._issue_if_missing(agent_principal(n))
            if not pki.signing_key.exists():
                pki._create_signing_key()
        return pki

    def identity(self, principal: str) -> TlsIdentity:
        """The identity of ``principal`` (issued now if this is a development CA and it does
        not exist yet); :class:`PkiError` if its files are missing and cannot be issued."""
        if not _PRINCIPAL.match(principal) or principal in _RESERVED:
            raise PkiError(f"invalid principal {principal!r}: lower-case letters, digits and "
                           f"'-', starting with a letter, not 'ca' or 'bundle-signing'")
        ident = TlsIdentity(principal, self.ca_cert, self.dir / f"{principal}.crt",
                            self.dir / f"{principal}.key")
        if ident.cert.exists() and ident.key.exists():
            if self.can_issue and not _names_identity(ident.cert, principal):
                # a development certificate issued before identity names: issued again
                with self._lock():
                    if not _names_identity(ident.cert, principal):
                        ident.cert.unlink(missing_ok=True)
                        self._issue_if_missing(principal)
                log.info("re-issued the development identity %s with its identity name %s",
                         principal, identity_host(principal))
            return ident
        if not self.can_issue:
            missing = ident.cert if not ident.cert.exists() else ident.key
            raise PkiError(f"{principal}: no {missing} in the PKI directory {self.dir} (and no "
                           f"ca.key to issue one: run `python -m security.pki create --dir "
                           f"{self.dir}` for a development PKI, or provide the file)")
        with self._lock():
            self._issue_if_missing(principal)
        return ident

    def refresh_addresses(self, principals: Iterable[str]) -> list[str]:
        """Re-issue the development identities whose certificate lacks one of the
        emulated network's addresses (:func:`envs.netutil.principal_addresses`; a PKI
        created before they were named). Returns the principals re-issued; a PKI without
        ``ca.key`` is left alone (its operator names the addresses)."""
        if not self.can_issue:
            return []
        from cryptography import x509

        stale = []
        for p in principals:
            want = principal_addresses(p)
            crt = self.dir / f"{p}.crt"
            if not want or not crt.exists():
                continue
            cert = x509.load_pem_x509_certificate(crt.read_bytes())
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            have = {str(a) for a in san.get_values_for_type(x509.IPAddress)}
            if not set(want) <= have:
                stale.append(p)
        if stale:
            with self._lock():
                for p in stale:
                    (self.dir / f"{p}.crt").unlink(missing_ok=True)
                    self._issue_if_missing(p)
            log.info("re-issued %d development identities with their emulated-network "
                     "addresses", len(stale))
        return stale

    def agent(self, node: int) -> TlsIdentity:
        return self.identity(agent_principal(node))

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.dir / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _create_ca(self) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "smart-dsmd development CA"),
                          x509.NameAttribute(NameOID.ORGANIZATION_NAME, "smart-dsmd")])
        now = dt.datetime.now(dt.UTC)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + _VALIDITY)
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(False, False, False, False, False, True, True,
                                             False, False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                               critical=False)
                .sign(key, hashes.SHA256()))
        _write_key(self.dir / "ca.key", key)
        _write(self.dir / "ca.crt", _pem_cert(cert), 0o644)

    def _issue_if_missing(self, principal: str) -> None:
        crt, keyp = self.dir / f"{principal}.crt", self.dir / f"{principal}.key"
        if crt.exists() and keyp.exists():
            return
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        try:
            ca_key = serialization.load_pem_private_key((self.dir / "ca.key").read_bytes(), None)
            ca = x509.load_pem_x509_certificate(self.ca_cert.read_bytes())
        except (OSError, ValueError) as exc:
            raise PkiError(f"cannot load the development CA in {self.dir}: {exc}") from None
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        san = x509.SubjectAlternativeName([
            x509.UniformResourceIdentifier(f"{SPIFFE_PREFIX}{role_of(principal)}/{principal}"),
            x509.DNSName(identity_host(principal)),
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            *(x509.IPAddress(ipaddress.ip_address(a)) for a in principal_addresses(principal)),
        ])
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, principal),
                                         x509.NameAttribute(NameOID.ORGANIZATION_NAME,
                                                            "smart-dsmd")]))
                .issuer_name(ca.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + _VALIDITY)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(True, False, True, False, False, False, False,
                                             False, False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .add_extension(san, critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                    ca_key.public_key()), critical=False)
                .sign(ca_key, hashes.SHA256()))
        _write_key(keyp, key)
        _write(crt, _pem_cert(cert), 0o644)

    def _create_signing_key(self) -> None:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        key = Ed25519PrivateKey.generate()
        _write_key(self.signing_key, key)
        _write(self.verify_key, key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo), 0o644)


_NAMED: dict[tuple[str, int, int, str], bool] = {}


def _names_identity(cert_path: Path, principal: str) -> bool:
    """Whether the certificate file names ``identity_host(principal)`` (cached per file
    version: identities are looked up on every channel built)."""
    try:
        st = cert_path.stat()
    except OSError:
        return False
    name = identity_host(principal)
    key = (str(cert_path), st.st_mtime_ns, st.st_ino, name)
    got = _NAMED.get(key)
    if got is None:
        from cryptography import x509

        try:
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            got = name in san.get_values_for_type(x509.DNSName)
        except (OSError, ValueError, x509.ExtensionNotFound):
            got = False
        _NAMED[key] = got
    return got


def _pem_cert(cert: x509.Certificate) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | Ed25519PrivateKey) -> None:
    from cryptography.hazmat.primitives import serialization

    _write(path, key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()), 0o600)


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write atomically (a temporary file renamed), created with ``mode`` from the start."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def parse_ranges(text: str, option: str) -> list[int]:
    """``"0-99,200"`` -> ``[0, ..., 99, 200]`` (a command-line node list; ``SystemExit``
    naming ``option`` if malformed)."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        try:
            out.extend(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise SystemExit(f"{option}: expected a list like 0-99,200, got {text!r}") from None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m security.pki", description=__doc__.split(
        "\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("create", help="create (or complete) a development PKI")
    c.add_argument("--dir", default=None, help=f"directory (default {default_pki_dir()})")
    c.add_argument("--agents", default="", help="agent identities to issue now, e.g. 0-99")
    s = sub.add_parser("show", help="list the identities of a PKI directory")
    s.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    if args.cmd == "create":
        pki = Pki.ensure(args.dir, agents=parse_ranges(args.agents, "--agents"))
        print(f"development PKI in {pki.dir} (CA {pki.ca_cert}, signing key {pki.signing_key})")
        return 0
    pki = Pki(args.dir)
    if not pki.ca_cert.exists():
        print(f"no PKI in {pki.dir}", file=sys.stderr)
        return 1
    for crt in sorted(pki.dir.glob("*.crt")):
        print(crt.stem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
