"""The server's current online policy (a :mod:`serving.bundles.online` bundle), swapped
atomically as :class:`serving.policy_store.PolicyStore` swaps the static one.

A request reads :meth:`OnlinePolicyStore.current` once. An online session takes the policy
current at each interval boundary (its plan and that interval's placements come from one
version), so a swap takes effect at every session's next boundary and never inside an
interval. A bundle that fails :func:`serving.bundles.online.load_online_bundle`'s checks is
refused (:class:`serving.bundles.static.BundleError`; a bad or missing signature,
:class:`serving.bundles.signing.SignatureError`) and the old one stays. Listeners hear of every swap
(the server announces it, :mod:`serving.announce`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from envs.dsmd.online_control import KnobPolicy

from .bundles.online import (
    ONLINE_BUNDLE_FILES,
    ONLINE_BUNDLE_OPTIONAL,
    OnlineBundle,
    load_online_bundle,
)
from .bundles.signing import BundleTrust
from .bundles.static import BundleError, bundle_zip, unzip_files
from .policy_store import VersionedStore

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
    #: (``models:/<name>/<version> (alias ...)``, :mod:`serving.bundles.registry`)
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


class OnlinePolicyStore(VersionedStore[OnlineBundle, LoadedOnlinePolicy]):
    """The server's current online policy (module docstring; the one store of
    :class:`serving.policy_store.VersionedStore`, listeners included). ``trust``: the public
    keys a bundle's signature must verify against (None:
    :func:`serving.bundles.signing.default_trust`, the PKI's key)."""

    def __init__(self, trust: BundleTrust | None = None) -> None:
        self.trust = trust
        super().__init__(lambda path: load_online_bundle(path, self.trust),
                         LoadedOnlinePolicy, "online policy")


def unzip_bundle(raw: bytes, directory: str | Path) -> Path:
    """Write a downloaded online bundle zip's files into ``directory`` (the adapter's cache),
    each one whole (:func:`serving.bundles.static.unzip_files`)."""
    return unzip_files(raw, directory, (*ONLINE_BUNDLE_FILES, *ONLINE_BUNDLE_OPTIONAL))
