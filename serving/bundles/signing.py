"""Signed policy bundles: who made a bundle, not only that it is intact.

A bundle's metadata records the SHA-256 of its actor files, which says the files are the
ones exported together; it does not say who exported them. Training therefore signs every
bundle it writes (:func:`sign_bundle`, Ed25519) and the loaders
(:func:`serving.bundles.static.load_bundle`, :func:`serving.bundles.online.load_online_bundle`)
check the signature against the configured public keys (:class:`BundleTrust`) before they read
anything else of the bundle (:func:`verify_bundle`).

``SIGNATURE.json``, next to the bundle's files::

    {"algorithm": "ed25519",
     "key_id":    the first 16 hex digits of the SHA-256 of the raw public key,
     "signature": base64 of the Ed25519 signature,
     "signed":    {"format", "version": the metadata's, "content_hash": its actor_sha256,
                   "files": {name: SHA-256 hex} for every file the loader reads,
                   "serial": an integer that grows with every signing (microseconds since
                   the epoch unless given)}}

The signature is over a fixed domain prefix followed by ``signed`` as canonical JSON
(sorted keys, no spaces, ASCII). The metadata's own content hash covers ``actor.onnx``
alone; the loader also reads ``metadata.json`` (layout, scenario signature, decoding,
decision order, knob map and cost) and ``actor_row.onnx``, so ``files`` lists every file of
the bundle's format (:func:`bundle_files`) and each is hashed when the bundle is verified.

**The same bytes.** A loader reads each file of a bundle once (:func:`verified_copy`),
checks the signature and every hash against those bytes, and writes them to a private
directory (mode 700) that it then loads from; a server serves a bundle's files from the
same bytes. A writer who swaps a file of the bundle's directory after the check changes
nothing that is loaded or served.

**Rollback and revocation.** The signed ``serial`` orders a signer's bundles: a policy
store refuses a bundle whose serial is below the highest it has loaded
(:class:`SerialGuard`), so an old signed bundle cannot be replayed; an operator who means
to go back re-signs the old bundle (a new serial) or asks for the rollback explicitly (an
admin's swap with ``allow_rollback``, audited). A bundle signed without a serial is
accepted as before, with no such protection. ``BundleTrust.revoked`` lists key ids and
bundle content hashes that are refused whatever their signature.

Key rotation: a :class:`BundleTrust` holds any number of public keys; trust the new and the
old key while bundles signed by both are in use, then drop the old one. A signing key is a
PKCS#8 PEM Ed25519 private key (``bundle-signing.key`` of the PKI, :mod:`security.pki`, or
one of ``python -m serving.bundles.signing keygen``); a public key a SubjectPublicKeyInfo PEM file.

``python -m serving.bundles.signing sign DIR [--key K]`` signs (re-signs) a bundle,
``python -m serving.bundles.signing verify DIR [--key PUB ...]`` checks one.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from security.pki import PkiError
from security.tls import Security

from ..logsafe import log_field
from .format import (
    BUNDLE_CONTENT,
    BUNDLE_FORMAT,
    ONLINE_BUNDLE_CONTENT,
    ONLINE_BUNDLE_FORMAT,
    SIGNATURE_FILE,
    BundleError,
    online_bundle_files,
    same_bundle,
)

__all__ = [
    "ALGORITHM",
    "SIGNATURE_FILE",
    "BundleTrust",
    "SerialGuard",
    "SignatureError",
    "SignatureInfo",
    "VerifiedBundle",
    "bundle_files",
    "default_trust",
    "generate_key_pair",
    "key_id_of",
    "load_public_key",
    "load_signing_key",
    "sign_bundle",
    "verified_copy",
    "verify_bundle",
]

log = logging.getLogger("smart.security.bundle")

ALGORITHM = "ed25519"
#: prefixed to the signed bytes, so a signing key's signature means nothing elsewhere
_DOMAIN = b"smart-dsmd policy bundle signature v1\n"
#: what a key id may be (``key_id_of`` writes 16 hex digits)
_KEY_ID = re.compile(r"[0-9A-Za-z._-]{1,64}")
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
#: the largest file of a bundle: each is read whole into memory to be verified and loaded
MAX_FILE_BYTES = 1 << 30
_LOGGED: OrderedDict[tuple[str, str, str], None] = OrderedDict()
_LOGGED_LOCK = threading.Lock()
_DEFAULT: dict[tuple[str, int, int], BundleTrust] = {}


class SignatureError(BundleError):
    """A bundle whose signature is missing, malformed, by a key not trusted, or does not
    verify (the message names the file, the key id and the reason)."""


@dataclass(frozen=True)
class SignatureInfo:
    """A bundle's signature: where it is, the signing key's id and what it signs."""

    path: Path
    key_id: str
    signed: dict[str, Any] = field(hash=False)


def bundle_files(fmt: object, meta: dict | None = None) -> tuple[str, ...]:
    """The files the loader of bundle format ``fmt`` reads (all signed); with the bundle's
    ``meta`` (its metadata), the optional files it names too."""
    table = {BUNDLE_FORMAT: BUNDLE_CONTENT, ONLINE_BUNDLE_FORMAT: ONLINE_BUNDLE_CONTENT}
    if fmt not in table:
        raise BundleError(f"unknown bundle format {fmt!r} (expected one of {sorted(table)})")
    if fmt == ONLINE_BUNDLE_FORMAT and meta is not None:
        return online_bundle_files(meta)
    return table[str(fmt)]


# --------------------------------------------------------------------------- keys


def _raw_public(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


def key_id_of(public_key: Any) -> str:
    """A public key's id: the first 16 hex digits of the SHA-256 of its 32 raw bytes."""
    return hashlib.sha256(_raw_public(public_key)).hexdigest()[:16]


def load_signing_key(path: str | Path) -> Any:
    """The Ed25519 private key of a PKCS#8 PEM file (:class:`PkiError` naming the file,
    never quoting it)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    p = Path(path).expanduser()
    try:
        key = serialization.load_pem_private_key(p.read_bytes(), password=None)
    except OSError as e:
        raise PkiError(f"bundle signing key {p}: cannot be read ({e.strerror or e})") from None
    except (ValueError, TypeError, UnicodeError):
        raise PkiError(f"bundle signing key {p}: not an unencrypted PKCS#8 PEM private "
                       f"key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise PkiError(f"bundle signing key {p}: a {type(key).__name__}, expected an "
                       f"Ed25519 key")
    return key


def load_public_key(path: str | Path) -> Any:
    """The Ed25519 public key of a SubjectPublicKeyInfo PEM file (:class:`PkiError` naming
    the file)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    p = Path(path).expanduser()
    try:
        key = serialization.load_pem_public_key(p.read_bytes())
    except OSError as e:
        raise PkiError(f"bundle verification key {p}: cannot be read "
                       f"({e.strerror or e})") from None
    except (ValueError, TypeError, UnicodeError):
        raise PkiError(f"bundle verification key {p}: not a PEM public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise PkiError(f"bundle verification key {p}: a {type(key).__name__}, expected an "
                       f"Ed25519 key")
    return key


def generate_key_pair(key_path: str | Path) -> tuple[Path, Path, str]:
    """A new Ed25519 key pair: ``key_path`` (PKCS#8 PEM, mode 0600, refused if it exists)
    and the public key beside it with suffix ``.pub``; returns (key, pub, key id)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    kp = Path(key_path).expanduser()
    pub = kp.with_suffix(".pub")
    for p in (kp, pub):
        if p.exists():
            raise FileExistsError(f"{p} exists: not overwriting a key")
    key = Ed25519PrivateKey.generate()
    kp.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(kp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    pub.write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return kp, pub, key_id_of(key.public_key())


# --------------------------------------------------------------------------- trust


@dataclass(frozen=True)
class BundleTrust:
    """The public keys a loader accepts bundle signatures from (``keys``: key id -> key,
    read once from ``key_files``). ``insecure`` (debugging): an unsigned bundle, or one
    signed by a key not in ``keys``, is accepted with a warning; a signature that is present
    but malformed or does not verify is still refused. ``revoked``: key ids and bundle
    content hashes (the metadata's ``actor_sha256``) refused whatever their signature."""

    keys: Mapping[str, Any] = field(default_factory=dict, hash=False)
    key_files: tuple[str, ...] = ()
    insecure: bool = False
    revoked: frozenset[str] = frozenset()

    def __repr__(self) -> str:
        return (f"BundleTrust(key_ids={sorted(self.keys)}, key_files={list(self.key_files)}, "
                f"insecure={self.insecure}, revoked={sorted(self.revoked)})")

    def revoking(self, revoked: Iterable[str]) -> BundleTrust:
        """This trust with ``revoked`` (key ids or content hashes) refused too; a name that
        is neither a key id nor a SHA-256 hex digest is a :class:`PkiError`."""
        out = set(self.revoked)
        for r in revoked:
            if not isinstance(r, str) or not (_KEY_ID.fullmatch(r) or _HEX64.fullmatch(r)):
                raise PkiError(f"bundle_trust.revoked: {str(r)[:80]!r} is neither a key id "
                               f"(16 hex digits) nor a bundle content hash (64 hex digits)")
            out.add(r.lower())
        return BundleTrust(self.keys, self.key_files, self.insecure, frozenset(out))

    @classmethod
    def from_files(cls, paths: Iterable[str | Path], *, insecure: bool = False) -> BundleTrust:
        """The public keys of ``paths`` (PEM files; :class:`PkiError` naming a bad one)."""
        keys: dict[str, Any] = {}
        files: list[str] = []
        for p in paths:
            key = load_public_key(p)
            keys[key_id_of(key)] = key
            files.append(str(Path(p).expanduser()))
        if not keys and not insecure:
            raise PkiError("no trusted bundle-signing public key is configured: a loader "
                           "would refuse every bundle")
        return cls(keys, tuple(files), insecure)

    @classmethod
    def from_signing_key(cls, key_path: str | Path) -> BundleTrust:
        """The trust of exactly the public half of the signing key ``key_path`` (what a
        training run's own evaluation of the bundle it just signed needs)."""
        key = load_signing_key(key_path).public_key()
        return cls({key_id_of(key): key}, (f"{Path(key_path).expanduser()} (public half)",))

    @classmethod
    def from_security(cls, sec: Security | None = None,
                      keys: Sequence[str | Path] | None = None, *,
                      pki_key: bool = True, warn: bool = True) -> BundleTrust:
        """The trust of a component configured with ``sec``: the PKI's
        ``bundle-signing.pub`` (unless ``pki_key`` is false; the development PKI is created
        on first use) and the public key files ``keys`` (e.g. a release key, or the previous
        key while rotating). ``sec.insecure``: unsigned bundles are accepted with a warning
        (logged here, once per trust, unless ``warn`` is false: a component that warned for
        itself already)."""
        sec = sec or Security()
        paths: list[str | Path] = list(keys or [])
        if sec.warn_if_insecure("bundle verification") if warn else sec.insecure:
            if pki_key:
                from security.pki import Pki

                pub = Pki(sec.pki_dir).verify_key  # only if there is one: nothing created
                if pub.is_file():
                    paths.insert(0, pub)
            return cls.from_files(paths, insecure=True)
        if pki_key:
            pub = sec.pki.verify_key
            if pub.is_file():
                paths.insert(0, pub)
            elif not paths:
                raise PkiError(f"no trusted bundle-signing public key: {pub} does not exist "
                               f"and no other key is configured")
        return cls.from_files(paths)

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any] | None, sec: Security | None = None,
                     section: str = "bundle_trust", *, warn: bool = True) -> BundleTrust:
        """From a config block ``{keys: [pem paths] | null, pki_key: bool, revoked: [key ids
        or content hashes]}`` (all optional: the PKI's key alone); an unknown key or a wrong
        type is a :class:`PkiError` naming it. ``warn``: see :meth:`from_security`."""
        m = m or {}
        if not isinstance(m, Mapping):
            raise PkiError(f"{section}: expected a mapping, got {type(m).__name__}")
        unknown = sorted(set(m) - {"keys", "pki_key", "revoked"})
        if unknown:
            raise PkiError(f"{section}: unknown key(s) {unknown}; known: ['keys', 'pki_key', "
                           f"'revoked']")
        revoked = m.get("revoked") or []
        if isinstance(revoked, str) or not isinstance(revoked, Iterable):
            raise PkiError(f"{section}.revoked: expected a list of key ids or content "
                           f"hashes, got {revoked!r}")
        keys = m.get("keys") or []
        if isinstance(keys, str | Path) or not all(isinstance(k, str | Path) for k in keys):
            raise PkiError(f"{section}.keys: expected a list of paths, got {keys!r}")
        pki_key = m.get("pki_key", True)
        if not isinstance(pki_key, bool):
            raise PkiError(f"{section}.pki_key: expected true or false, got {pki_key!r}")
        return cls.from_security(sec, list(keys), pki_key=pki_key, warn=warn).revoking(
            list(revoked))


def default_trust() -> BundleTrust:
    """``BundleTrust.from_security(Security())``: the secure default, the PKI's key (the
    development PKI of ``$SMART_PKI_DIR`` or ``~/.cache/smart-dsmd/pki``), read again only
    when that key file changes."""
    from security.pki import Pki

    pub = Pki(None).verify_key
    try:
        st = pub.stat()
        stamp = (str(pub), st.st_mtime_ns, st.st_ino)
    except OSError:
        return BundleTrust.from_security(Security())
    with _LOGGED_LOCK:
        trust = _DEFAULT.get(stamp)
    if trust is None:
        trust = BundleTrust.from_security(Security())
        with _LOGGED_LOCK:
            _DEFAULT.clear()
            _DEFAULT[stamp] = trust
    return trust


# --------------------------------------------------------------------------- sign / verify


def _canonical(signed: Mapping[str, Any]) -> bytes:
    return _DOMAIN + json.dumps(signed, sort_keys=True, separators=(",", ":"),
                                ensure_ascii=True).encode()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _metadata(d: Path) -> dict[str, Any]:
    try:
        raw = (d / "metadata.json").read_bytes()
    except FileNotFoundError:
        raise BundleError(f"bundle {d}: metadata.json is missing") from None
    except OSError as e:
        raise BundleError(f"{d / 'metadata.json'}: cannot be read ({e})") from None
    return _metadata_of(d, raw)


def _metadata_of(d: Path, raw: bytes | None) -> dict[str, Any]:
    """The metadata of bundle ``d`` from the bytes of its ``metadata.json``."""
    p = d / "metadata.json"
    if raw is None:
        raise BundleError(f"bundle {d}: metadata.json is missing")
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{p}: cannot be read as JSON ({e})") from None
    if not isinstance(meta, dict):
        raise BundleError(f"{p}: not a JSON object")
    return meta


def sign_bundle(directory: str | Path, key_path: str | Path | None = None, *,
                serial: int | None = None) -> SignatureInfo:
    """Sign the bundle in ``directory`` with the Ed25519 key ``key_path`` (default: the
    PKI's ``bundle-signing.key``, :class:`security.tls.Security`): write ``SIGNATURE.json``
    (replacing one there) over its format, version, content hash, every file its loader
    reads and ``serial`` (default: microseconds since the epoch, so a later signing has a
    larger one; module docstring)."""
    if serial is None:
        serial = time.time_ns() // 1000
    if isinstance(serial, bool) or not isinstance(serial, int) or serial < 0:
        raise ValueError(f"serial must be a non-negative integer, got {serial!r}")
    d = Path(directory)
    key = load_signing_key(key_path if key_path is not None else Security().pki.signing_key)
    meta = _metadata(d)
    names = bundle_files(meta.get("format"), meta)
    files: dict[str, str] = {}
    for name in names:
        try:
            files[name] = _sha256(d / name)
        except OSError as e:
            raise BundleError(f"bundle {d}: {name} cannot be read ({e.strerror or e})") from None
    signed = {"format": meta.get("format"), "version": meta.get("version"),
              "content_hash": meta.get("actor_sha256"), "files": files, "serial": serial}
    kid = key_id_of(key.public_key())
    doc = {"algorithm": ALGORITHM, "key_id": kid,
           "signature": base64.b64encode(key.sign(_canonical(signed))).decode(),
           "signed": signed}
    out = d / SIGNATURE_FILE
    tmp = d / f".{SIGNATURE_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out)
    return SignatureInfo(out, kid, signed)


def _log_once(level: int, d: Path, key_id: str | None, reason: str) -> None:
    """Log a refusal (or an insecure acceptance) once per bundle, key and reason: a loader
    polling a bundle it refuses does not repeat it at WARNING."""
    k = (str(d), key_id or "-", reason)
    with _LOGGED_LOCK:
        seen = k in _LOGGED
        _LOGGED[k] = None
        _LOGGED.move_to_end(k)
        while len(_LOGGED) > 512:
            _LOGGED.popitem(last=False)
    log.log(logging.DEBUG if seen else level, "bundle %s (key id %s): %s", log_field(d),
            log_field(key_id or "-"), log_field(reason, 1000))


def _refuse(d: Path, key_id: str | None, reason: str) -> SignatureError:
    _log_once(logging.WARNING, d, key_id, f"refused: {reason}")
    return SignatureError(f"bundle {d} refused: {reason}")


def _read_signature(d: Path, path: Path, raw: bytes) -> tuple[str, bytes, dict[str, Any]]:
    """(key id, signature bytes, signed) of ``SIGNATURE.json``'s bytes ``raw``, or a
    refusal naming it."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _refuse(d, None, f"{path} is malformed: not readable JSON ({e})") from None
    if not isinstance(doc, dict):
        raise _refuse(d, None, f"{path} is malformed: not a JSON object")
    kid = doc.get("key_id")
    # a key id is a name, never text to log as is (a newline would forge a log line)
    kid_s = kid if isinstance(kid, str) and _KEY_ID.fullmatch(kid) else None
    if doc.get("algorithm") != ALGORITHM:
        raise _refuse(d, kid_s, f"{path} is malformed: algorithm "
                      f"{str(doc.get('algorithm'))[:40]!r}, expected {ALGORITHM!r}")
    if kid_s is None:
        raise _refuse(d, None, f"{path} is malformed: key_id must be a key id (1-64 letters, "
                      f"digits, '.', '_' or '-'), got {log_field(repr(kid), 80)}")
    sig_b64 = doc.get("signature")
    try:
        if not isinstance(sig_b64, str):
            raise ValueError
        sig = base64.b64decode(sig_b64, validate=True)
        if len(sig) != 64:
            raise ValueError
    except (ValueError, binascii.Error):
        raise _refuse(d, kid_s, f"{path} is malformed: signature must be the base64 of "
                      f"64 bytes") from None
    signed = doc.get("signed")
    if (not isinstance(signed, dict) or not isinstance(signed.get("files"), dict)
            or not all(isinstance(v, str) for v in signed["files"].values())):
        raise _refuse(d, kid_s, f"{path} is malformed: 'signed' must be an object with a "
                      f"'files' object of SHA-256 hex digests")
    serial = signed.get("serial")
    if serial is not None and (isinstance(serial, bool) or not isinstance(serial, int)
                               or serial < 0):
        raise _refuse(d, kid_s, f"{path} is malformed: serial must be a non-negative "
                      f"integer, got {log_field(repr(serial), 40)}")
    return kid_s, sig, signed


def _read_whole(d: Path, name: str, kid: str | None) -> bytes:
    """The bytes of ``d/name``, read once (at most :data:`MAX_FILE_BYTES`), or a refusal."""
    path = d / name
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise _refuse(d, kid, f"{name} cannot be read ({e.strerror or e})") from None
    if len(data) > MAX_FILE_BYTES:
        raise _refuse(d, kid, f"{name} is larger than {MAX_FILE_BYTES} bytes")
    return data


@dataclass(frozen=True, eq=False)
class VerifiedBundle:
    """A bundle's files as they were verified (:func:`verified_copy`): ``blobs`` (name ->
    bytes, ``SIGNATURE.json`` included when signed), each read once; ``root``: a private
    directory (mode 700) holding exactly those bytes, which the loader opens, removed when
    this object is collected; ``signed_by`` (None: unsigned, accepted by an insecure trust)
    and the signed ``serial`` (None: signed without one)."""

    source: Path
    root: Path
    blobs: Mapping[str, bytes] = field(repr=False)
    signed_by: str | None
    serial: int | None
    _owner: Any = field(default=None, repr=False)


def verified_copy(directory: str | Path, trust: BundleTrust | None = None, *,
                  required: Sequence[str], snapshot: bool = True) -> VerifiedBundle:
    """Read the bundle in ``directory`` once and check, on the bytes read, that its
    signature is by a key of ``trust`` (default: :func:`default_trust`), verifies, is not
    revoked, covers ``required`` (the files the loader reads) and that every file it covers
    is unchanged. With ``snapshot``, the bytes are written to a private directory the
    loader opens (:class:`VerifiedBundle`), so what is loaded is what was verified. A
    refusal is a :class:`SignatureError` naming the bundle, the key id and the reason,
    logged once at WARNING (no key material)."""
    d = Path(directory)
    trust = trust if trust is not None else default_trust()
    path = d / SIGNATURE_FILE
    blobs: dict[str, bytes] = {}
    kid: str | None = None
    serial: int | None = None
    if not path.is_file():
        if not trust.insecure:
            raise _refuse(d, None, f"it is not signed ({SIGNATURE_FILE} is missing; sign it "
                          f"with `python -m serving.bundles.signing sign {d}`)")
        _log_once(logging.WARNING, d, None, "unsigned bundle accepted (security.insecure "
                  "is set: signatures are not required)")
        for name in required:
            blobs[name] = _read_whole(d, name, None)
    else:
        raw = _read_whole(d, SIGNATURE_FILE, None)
        kid, sig, signed = _read_signature(d, path, raw)
        blobs[SIGNATURE_FILE] = raw
        if kid.lower() in trust.revoked:
            raise _refuse(d, kid, f"signed by key id {kid}, which is revoked "
                          f"(bundle_trust.revoked)")
        key = trust.keys.get(kid)
        if key is None and not trust.insecure:
            raise _refuse(d, kid, f"signed by key id {kid}, which is not trusted (trusted: "
                          f"{', '.join(f'{k} ({f})' for k, f in _named_keys(trust)) or 'none'})")
        if key is not None:
            from cryptography.exceptions import InvalidSignature

            try:
                key.verify(sig, _canonical(signed))
            except InvalidSignature:
                raise _refuse(d, kid, f"the signature in {path} does not verify with key id "
                              f"{kid} (forged, or {SIGNATURE_FILE} was altered)") from None
        files: dict[str, str] = signed["files"]
        unsigned = [n for n in required if n not in files]
        if unsigned:
            raise _refuse(d, kid, f"{SIGNATURE_FILE} does not cover {unsigned}, which the "
                          f"loader reads")
        for name, want in sorted(files.items()):
            if Path(name).name != name or name in (SIGNATURE_FILE, "", ".", ".."):
                raise _refuse(d, kid, f"{path} is malformed: file name {name[:80]!r}")
            data = blobs[name] = _read_whole(d, name, kid)
            got = hashlib.sha256(data).hexdigest()
            if got != want:
                raise _refuse(d, kid, f"{d / name}: content hash {got[:12]}... differs from "
                              f"the signed {want[:12]}... (changed after signing)")
        meta = _metadata_of(d, blobs.get("metadata.json"))  # its hash was just checked
        for k in ("format", "version"):
            if meta.get(k) != signed.get(k):
                raise _refuse(d, kid, f"the signed {k} {signed.get(k)!r} is not the "
                              f"metadata's {meta.get(k)!r}")
        content = str(signed.get("content_hash") or meta.get("actor_sha256") or "").lower()
        if content in trust.revoked:
            raise _refuse(d, kid, f"its content hash {content[:16]}... is revoked "
                          f"(bundle_trust.revoked)")
        serial = signed.get("serial")
        if key is None:
            _log_once(logging.WARNING, d, kid, "signed by an untrusted key, accepted "
                      "unverified (security.insecure is set)")
    if not snapshot:
        return VerifiedBundle(d, d, blobs, kid, serial)
    tmp = tempfile.TemporaryDirectory(prefix="smart-bundle-")  # mode 700
    root = Path(tmp.name)
    for name, data in blobs.items():
        (root / name).write_bytes(data)
    return VerifiedBundle(d, root, blobs, kid, serial, tmp)


def verify_bundle(directory: str | Path, trust: BundleTrust | None = None, *,
                  required: Sequence[str] | None = None) -> str | None:
    """Check the signature of the bundle in ``directory`` (:func:`verified_copy` without
    the private copy; ``required`` default: every file of the bundle's format). Returns the
    signing key's id (``None``: an unsigned bundle accepted by an insecure trust)."""
    d = Path(directory)
    if required is None:
        try:
            fmt = _metadata(d).get("format")
        except BundleError:
            fmt = None
        required = bundle_files(fmt) if fmt is not None else ()
    return verified_copy(d, trust, required=required, snapshot=False).signed_by


class SerialGuard:
    """The highest bundle serial a policy store has loaded: a bundle with a lower one is an
    old bundle replayed (module docstring) and refused unless the rollback is asked for.
    Thread-safe: a store calls it under its load lock."""

    def __init__(self) -> None:
        self.highest: int | None = None

    def check(self, vb: VerifiedBundle | None, what: str, allow_rollback: bool = False
              ) -> None:
        """Raise :class:`SignatureError` if ``vb``'s serial is below :attr:`highest` (and
        ``allow_rollback`` is false)."""
        if vb is None or vb.serial is None or self.highest is None or vb.serial >= self.highest:
            return
        if allow_rollback:
            log.warning("%s: rollback to serial %d (below the loaded %d), as asked",
                        log_field(what), vb.serial, self.highest)
            return
        raise _refuse(vb.source, vb.signed_by,
                      f"its serial {vb.serial} is below {self.highest}, the highest this "
                      f"server has loaded: an older bundle (rollback). Re-sign it (`python -m "
                      f"serving.bundles.signing sign DIR`) or swap with allow_rollback")

    def admit(self, current: Any, bundle: Any, what: str, allow_rollback: bool = False
              ) -> bool:
        """A store's step before installing ``bundle`` (a loaded policy or online bundle)
        over ``current`` (the one it holds, or None): True if ``bundle`` is ``current``
        read again (the store keeps its version), False if it may be installed;
        :meth:`check`'s refusal otherwise."""
        if current is not None and same_bundle(current, bundle):
            return True
        self.check(bundle.verified, what, allow_rollback)
        return False

    def loaded(self, vb: VerifiedBundle | None) -> None:
        """Record ``vb`` as loaded."""
        if vb is not None and vb.serial is not None and (self.highest is None
                                                         or vb.serial > self.highest):
            self.highest = vb.serial


def _named_keys(trust: BundleTrust) -> list[tuple[str, str]]:
    files = list(trust.key_files)
    ids = list(trust.keys)
    if len(files) == len(ids):
        return list(zip(ids, files, strict=True))
    return [(k, "?") for k in ids]


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving.bundles.signing",
                                 description="Sign and verify policy bundles (Ed25519).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sign", help="sign (or re-sign) a bundle directory")
    s.add_argument("dir")
    s.add_argument("--key", default=None, help="Ed25519 private key, PKCS#8 PEM (default: the "
                   "PKI's bundle-signing.key)")
    s.add_argument("--pki-dir", default=None, help="PKI directory (default $SMART_PKI_DIR "
                   "or ~/.cache/smart-dsmd/pki)")
    s.add_argument("--serial", type=int, default=None, help="the bundle's serial (default: "
                   "microseconds since the epoch, above every earlier signing's)")
    v = sub.add_parser("verify", help="check a bundle's signature")
    v.add_argument("dir")
    v.add_argument("--key", action="append", default=None, metavar="PUB",
                   help="trusted public key (PEM; repeat for several); default: the PKI's "
                   "bundle-signing.pub")
    v.add_argument("--pki-dir", default=None)
    g = sub.add_parser("keygen", help="create a new signing key pair (KEY and KEY.pub)")
    g.add_argument("key")
    args = ap.parse_args(argv)
    log.addHandler(logging.NullHandler())  # the refusal is printed below, once
    try:
        if args.cmd == "sign":
            key = args.key or Security(pki_dir=args.pki_dir).pki.signing_key
            info = sign_bundle(args.dir, key, serial=args.serial)
            print(f"signed {args.dir} with key id {info.key_id} "
                  f"({len(info.signed['files'])} files, serial {info.signed['serial']})")
        elif args.cmd == "verify":
            sec = Security(pki_dir=args.pki_dir)
            trust = (BundleTrust.from_files(args.key) if args.key
                     else BundleTrust.from_security(sec))
            kid = verify_bundle(args.dir, trust)
            print(f"ok: {args.dir} is signed by trusted key id {kid}")
        else:
            kp, pub, kid = generate_key_pair(args.key)
            print(f"key id {kid}: private key {kp}, public key {pub}")
    except (BundleError, PkiError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
