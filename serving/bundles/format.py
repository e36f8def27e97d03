"""The policy bundles' format: what the static (:mod:`serving.bundles.static`) and the
online (:mod:`serving.bundles.online`) bundles hold, their errors, the one metadata reader
and the one hash helper, shared by both loaders and by :mod:`serving.bundles.signing` (which
the loaders use), so no module of the three imports another that imports it back."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from envs.dsmd.online_greedy import FILE_ARGS

__all__ = [
    "BUNDLE_CONTENT",
    "BUNDLE_FILES",
    "BUNDLE_FORMAT",
    "BUNDLE_VERSION",
    "FILE_ARGS",
    "HEX_DIGEST",
    "ONLINE_BUNDLE_CONTENT",
    "ONLINE_BUNDLE_FILES",
    "ONLINE_BUNDLE_FORMAT",
    "ONLINE_BUNDLE_OPTIONAL",
    "ONLINE_BUNDLE_VERSION",
    "ONLINE_BUNDLE_VERSIONS",
    "READABLE_VERSIONS",
    "SIGNATURE_FILE",
    "BundleError",
    "online_bundle_files",
    "origin_named",
    "read_metadata",
    "same_bundle",
    "sha256_bytes",
    "sha256_file",
]

BUNDLE_FORMAT = "smart-dsmd-policy"
#: the version :mod:`agents.bundle_export` writes: the decoding mode (envs.dsmd.decoding)
#: recorded, the one-row actor file, a per-channel actor's row file taking its globals and
#: features as two inputs
BUNDLE_VERSION = 4
#: the versions :func:`load_bundle` reads
READABLE_VERSIONS = (BUNDLE_VERSION,)
#: the files the loader reads (every one covered by the signature)
BUNDLE_CONTENT = ("metadata.json", "actor.onnx", "actor_row.onnx")
#: the signature file of a signed bundle (:mod:`serving.bundles.signing`)
SIGNATURE_FILE = "SIGNATURE.json"
#: every file a bundle holds (what is copied when a bundle is published or fetched; an
#: unsigned bundle, accepted only by an insecure loader, has no SIGNATURE.json)
BUNDLE_FILES = (*BUNDLE_CONTENT, SIGNATURE_FILE)
#: a bundle's content hash as the server announces it (a SHA-256 hex digest): adapters name
#: their cache directories after it, so nothing else is accepted
HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
ONLINE_BUNDLE_FORMAT = "smart-dsmd-online-policy"
#: the version :func:`agents.bundle_export.export_online_bundle` writes
ONLINE_BUNDLE_VERSION = 2
#: the versions this runtime reads
ONLINE_BUNDLE_VERSIONS = (1, 2)
#: the files the loader always reads (every one covered by the signature)
ONLINE_BUNDLE_CONTENT = ("metadata.json", "actor.onnx")
#: every file an online bundle always holds (no SIGNATURE.json if unsigned)
ONLINE_BUNDLE_FILES = (*ONLINE_BUNDLE_CONTENT, SIGNATURE_FILE)
#: the executor's fixed arguments that name a file, and the file's name in the bundle
#: (:data:`envs.dsmd.online_greedy.FILE_ARGS`)
#: the optional files a bundle may hold (read, hashed and signed when its metadata's
#: ``files`` names them)
ONLINE_BUNDLE_OPTIONAL = tuple(FILE_ARGS.values())


def online_bundle_files(meta: dict[str, Any], where: str = "online policy bundle"
                        ) -> tuple[str, ...]:
    """The files the loader reads for ``meta`` (its ``metadata.json``): the content and the
    optional files its ``files`` names (an unknown name is a :class:`BundleError`)."""
    files = meta.get("files") or {}
    if not isinstance(files, dict):
        raise BundleError(f"{where}: metadata.json: 'files' must be an object of file name "
                          "-> SHA-256")
    unknown = sorted(set(files) - set(ONLINE_BUNDLE_OPTIONAL))
    if unknown:
        raise BundleError(f"{where}: metadata.json names unknown files {unknown[:5]}; this "
                          f"version reads {list(ONLINE_BUNDLE_OPTIONAL)}")
    return (*ONLINE_BUNDLE_CONTENT, *sorted(files))


class BundleError(ValueError):
    """A policy bundle that cannot be used (missing, corrupted, of another format or version,
    or mismatched)."""


@contextmanager
def origin_named(origin: str | None) -> Iterator[None]:
    """A :class:`BundleError` raised inside, re-raised with ``origin`` (where the bundle came
    from: a registry version) in front of its message; unchanged when ``origin`` is None."""
    try:
        yield
    except BundleError as e:
        if origin is None:
            raise
        raise type(e)(f"{origin}: {e}") from None


def sha256_bytes(data: bytes) -> str:
    """The SHA-256 of ``data`` (hex), as a bundle's metadata records it."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file's bytes (hex), as a bundle's metadata records it."""
    return sha256_bytes(Path(path).read_bytes())


def read_metadata(d: Path, fmt: str, versions: tuple[int, ...], files: tuple[str, ...],
                  what: str = "policy bundle") -> dict:
    """``d/metadata.json`` of a bundle of format ``fmt`` and one of ``versions`` whose
    ``files`` are all present, else :class:`BundleError` naming the directory or file and
    what is wrong (shared by :func:`load_bundle` and
    :func:`serving.bundles.online.load_online_bundle`)."""
    meta_path = d / "metadata.json"
    try:
        for name in ("metadata.json", *files):
            if not (d / name).is_file():
                raise BundleError(f"{what} {str(d)[:200]}: {name} is missing")
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise BundleError(f"{meta_path}: not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:  # unreadable, name too long, not text, ...
        raise BundleError(f"{what} {str(d)[:200]}: cannot be read ({e.__class__.__name__}: "
                          f"{getattr(e, 'strerror', None) or e})") from None
    if not isinstance(meta, dict):
        raise BundleError(f"{meta_path}: not a JSON object")
    if meta.get("format") != fmt:
        raise BundleError(f"{meta_path}: format {meta.get('format')!r}, expected {fmt!r}")
    if meta.get("version") not in versions:
        raise BundleError(f"{meta_path}: {what} version {meta.get('version')!r}; this "
                          f"version of the code reads version "
                          f"{' or '.join(map(str, versions))} (re-export the policy)")
    return meta


def same_bundle(a: Any, b: Any) -> bool:
    """Whether two loaded bundles are one signed bundle read twice: the same signer, the
    same serial and the same bytes (loading it again is then not a new version)."""
    va, vb = a.verified, b.verified
    return (va is not None and vb is not None and va.serial is not None
            and va.serial == vb.serial and va.signed_by == vb.signed_by
            and dict(va.blobs) == dict(vb.blobs))


