"""The server's current online policy (a :mod:`serving.online_bundle` bundle), swapped
atomically as :class:`serving.policy_store.PolicyStore` swaps the static one.

A request reads :meth:`OnlinePolicyStore.current` once. An online session takes the policy
current at each interval boundary (its plan and that interval's placements come from one
version), so a swap takes effect at every session's next boundary and never inside an
interval. A bundle that fails :func:`serving.online_bundle.load_online_bundle`'s checks is
refused (:class:`serving.bundle.BundleError`; a bad or missing signature,
:class:`serving.signing.SignatureError`) and the old one stays.
"""

from __future__ import annotations

import io
import logging
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from envs.dsmd.online_control import KnobPolicy

from .bundle import BundleError, bundle_zip, origin_named
from .online_bundle import (
    ONLINE_BUNDLE_FILES,
    ONLINE_BUNDLE_OPTIONAL,
    OnlineBundle,
    load_online_bundle,
)
from .signing import BundleTrust, SerialGuard

__all__ = [
    "ONLINE_BUNDLE_FILES",
    "BundleError",
    "LoadedOnlinePolicy",
    "OnlinePolicyStore",
    "bundle_zip",
    "unzip_bundle",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class LoadedOnlinePolicy:
    """A verified online bundle with the server's version number."""

    bundle: OnlineBundle
    version: int
    loaded_at: float
    #: where it came from when not a directory named by the caller: the registry version
    #: (``models:/<name>/<version> (alias ...)``, :mod:`serving.model_registry`)
    origin: str | None = None

    @property
    def hash(self) -> str:
        """SHA-256 of the actor (recorded in, and checked against, ``metadata.json``)."""
        return str(self.bundle.metadata["actor_sha256"])

    @property
    def path(self) -> Path:
        return self.bundle.directory

    @property
    def signed_by(self) -> str | None:
        """The id of the key that signed it (None: unsigned, accepted as insecure)."""
        return self.bundle.signed_by

    def decider(self) -> KnobPolicy:
        """A fresh decider over this bundle's actor, knob map and cost."""
        return self.bundle.decider(f"online-v{self.version}")


class OnlinePolicyStore:
    """The server's current online policy (module docstring). ``trust``: the public keys a
    bundle's signature must verify against (None: :func:`serving.signing.default_trust`,
    the PKI's key)."""

    def __init__(self, trust: BundleTrust | None = None) -> None:
        self.trust = trust
        self._current: LoadedOnlinePolicy | None = None
        self._lock = threading.Lock()  # serialises loads, not reads
        self._version = 0
        self.serials = SerialGuard()

    def current(self) -> LoadedOnlinePolicy | None:
        return self._current

    def load(self, path: str | Path, origin: str | None = None,
             allow_rollback: bool = False) -> LoadedOnlinePolicy:
        """Load, verify and install the online bundle at ``path`` (``BundleError`` if
        refused; the current one stays). ``origin``: where ``path`` came from (a registry
        version), named in messages and kept on the policy. A bundle whose signed serial is
        below the highest loaded is refused unless ``allow_rollback``
        (:class:`serving.signing.SerialGuard`); the bundle loaded now, loaded again, is
        the same version."""
        with self._lock:
            with origin_named(origin):
                bundle = load_online_bundle(path, self.trust)
            cur = self._current
            with origin_named(origin):
                same = self.serials.admit(None if cur is None else cur.bundle, bundle,
                                          origin or str(path), allow_rollback)
            if same and cur is not None:
                return cur
            cand = LoadedOnlinePolicy(bundle, self._version + 1, time.time(), origin)
            self._version = cand.version
            self._current = cand  # one reference assignment: atomic for readers
            self.serials.loaded(bundle.verified)
            log.info("online policy v%d loaded from %s (actor %s...)", cand.version,
                     origin or path, cand.hash[:12])
            return cand


def unzip_bundle(raw: bytes, directory: str | Path) -> Path:
    """Write a downloaded bundle zip's files into ``directory`` (the adapter's cache)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        for name in set(z.namelist()) & {*ONLINE_BUNDLE_FILES, *ONLINE_BUNDLE_OPTIONAL}:
            (d / name).write_bytes(z.read(name))
    return d

