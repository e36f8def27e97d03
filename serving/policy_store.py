"""The server's current policies, static and online, each swapped atomically by one store
(:class:`VersionedStore`).

A request reads :meth:`PolicyStore.current` once and uses that one object for all of its
decisions, so a swap never mixes versions inside a response and never fails a request in
flight: the old bundle stays alive until the last request holding it finishes. A new bundle
is loaded and verified (:func:`serving.bundles.static.load_bundle`: files, signature against the
store's trusted keys, content hash, format) and checked against the live sessions before it
replaces the old one; a bundle that fails either check is refused and the old one stays.

The online policy (a :mod:`serving.bundles.online` bundle, :class:`OnlinePolicyStore`) is
swapped the same way. An online session takes the policy current at each interval boundary
(its plan and that interval's placements come from one version), so a swap takes effect at
every session's next boundary and never inside an interval. Listeners hear of every swap of
either store (the server announces it, :mod:`serving.announce`).

:class:`BundleWatcher` reloads the bundle when its ``metadata.json`` changes on disk (the
exporter writes bundles atomically, so a half-written bundle is never seen).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from envs.dsmd.observation import ObservationLayout
from envs.dsmd.online_control import KnobPolicy

from .bundles.format import origin_named
from .bundles.online import OnlineBundle, load_online_bundle
from .bundles.signing import BundleTrust, SerialGuard, SignatureError
from .bundles.static import BUNDLE_FILES, BundleError, PolicyBundle, load_bundle

__all__ = ["BundleError", "BundleWatcher", "LoadedOnlinePolicy", "LoadedPolicy",
           "OnlinePolicyStore", "PolicyStore", "VersionedStore"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class LoadedPolicy:
    """A verified bundle with the server's version number (the engine's ScoringPolicy)."""

    bundle: PolicyBundle
    version: int
    loaded_at: float
    #: where it came from when not a directory named by the caller: the registry version
    #: (``models:/<name>/<version> (alias ...)``, :mod:`serving.bundles.registry`)
    origin: str | None = None

    @property
    def layout(self) -> ObservationLayout:
        return self.bundle.layout

    @property
    def metadata(self) -> dict:
        return self.bundle.metadata

    @property
    def decoding(self) -> str:
        return self.bundle.decoding

    @property
    def order(self) -> str:
        return self.bundle.order

    @property
    def hash(self) -> str:
        return self.bundle.content_hash

    @property
    def path(self) -> Path:
        return self.bundle.directory

    @property
    def signed_by(self) -> str | None:
        """The id of the key that signed it (None: unsigned, accepted as insecure)."""
        return self.bundle.signed_by

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        return self.bundle(obs)

    def score_rows(self, n: int, fill: Callable[[int, int, np.ndarray], None]
                   ) -> tuple[np.ndarray, np.ndarray]:
        return self.bundle.score_rows(n, fill)

    def bound_row(self) -> Any:
        """This thread's single-row runner (:meth:`serving.bundles.static.PolicyBundle.
        bound_row`)."""
        return self.bundle.bound_row()


class _Bundle(Protocol):
    @property
    def verified(self) -> Any: ...


class _Loaded(Protocol):
    @property
    def bundle(self) -> Any: ...
    @property
    def hash(self) -> str: ...


B = TypeVar("B", bound=_Bundle)    # a verified bundle (static or online)
L = TypeVar("L", bound=_Loaded)    # its loaded policy (the bundle with the server's version)


class VersionedStore(Generic[B, L]):
    """The server's current policy of one kind, swapped atomically (the module docstring):
    the one store of both policy kinds. ``read(path)`` loads and verifies a bundle (raising
    ``BundleError``); ``make(bundle, version, loaded_at, origin)`` wraps it as the loaded
    policy (which has ``version`` and ``hash``); ``kind`` names the policies in log lines."""

    def __init__(self, read: Callable[[str | Path], B],
                 make: Callable[[B, int, float, str | None], L], kind: str = "policy") -> None:
        self._read, self._make, self.kind = read, make, kind
        self._current: L | None = None
        self._lock = threading.Lock()  # serialises loads, not reads
        self._version = 0
        self.serials = SerialGuard()
        self._listeners: list[Callable[[L], None]] = []

    def current(self) -> L | None:
        return self._current

    def add_listener(self, listener: Callable[[L], None]) -> None:
        """Call ``listener(policy)`` after every successful swap (the ``PUT`` endpoints, the
        start-up load, the registry follower and :class:`BundleWatcher` all load through
        :meth:`load`), in load order, on the loading thread: it must not block (e.g.
        :meth:`serving.announce.Announcer.policy`). A listener's exception is logged and
        neither refuses the load nor stops the other listeners."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[L], None]) -> None:
        """Stop calling ``listener`` (a no-op if it is not registered)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def load(self, path: str | Path, check: Callable[[L], list[str]] | None = None,
             force: bool = False, origin: str | None = None,
             allow_rollback: bool = False) -> L:
        """Load, verify and install the bundle at ``path``. ``check`` returns the problems
        the candidate would cause (e.g. live sessions it does not fit); any problem refuses
        it (``BundleError``) unless ``force``. ``origin``: where ``path`` came from (a
        registry version), named in messages and kept on the policy. A bundle whose signed
        serial is below the highest loaded is refused unless ``allow_rollback``
        (:class:`serving.bundles.signing.SerialGuard`); the bundle loaded now, loaded again, is the
        same version (no listener is called)."""
        where = origin or str(path)
        with self._lock:
            with origin_named(origin):
                bundle = self._read(path)
            cur = self._current
            with origin_named(origin):
                same = self.serials.admit(None if cur is None else cur.bundle, bundle,
                                          where, allow_rollback)
            if same and cur is not None:
                return cur
            cand = self._make(bundle, self._version + 1, time.time(), origin)
            problems = check(cand) if check is not None else []
            if problems and not force:
                raise BundleError(f"{where}: refused: " + "; ".join(problems))
            self._version += 1
            self._current = cand  # one reference assignment: atomic for readers
            self.serials.loaded(bundle.verified)
            log.info("%s v%d loaded from %s (actor %s...)", self.kind, self._version, where,
                     cand.hash[:12])
            for listener in list(self._listeners):
                try:
                    listener(cand)
                except Exception:  # a listener never undoes or fails a swap
                    log.exception("%s listener %r failed on v%d", self.kind, listener,
                                  self._version)
            return cand

    def unload(self) -> None:
        with self._lock:
            self._current = None


class PolicyStore(VersionedStore[PolicyBundle, LoadedPolicy]):
    """The server's current static policy. ``batch_threads`` and ``trust`` (the public keys a
    bundle's signature must verify against): passed to :func:`serving.bundles.static.load_bundle`
    for every bundle it loads (None: its defaults; the PKI's key for ``trust``)."""

    def __init__(self, batch_threads: int | None = None,
                 trust: BundleTrust | None = None) -> None:
        self.batch_threads = batch_threads
        self.trust = trust
        super().__init__(lambda path: load_bundle(path, batch_threads=self.batch_threads,
                                                  trust=self.trust),
                         LoadedPolicy, "policy")


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
    :class:`VersionedStore`, listeners included). ``trust``: the public
    keys a bundle's signature must verify against (None:
    :func:`serving.bundles.signing.default_trust`, the PKI's key)."""

    def __init__(self, trust: BundleTrust | None = None) -> None:
        self.trust = trust
        super().__init__(lambda path: load_online_bundle(path, self.trust),
                         LoadedOnlinePolicy, "online policy")


class BundleWatcher:
    """Polls a bundle directory and reloads it when its metadata changes."""

    def __init__(self, store: PolicyStore, path: str | Path, period_s: float = 2.0,
                 check: Callable[[LoadedPolicy], list[str]] | None = None) -> None:
        self.store, self.path, self.period_s, self.check = store, Path(path), period_s, check
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bundle-watch", daemon=True)
        self._seen = self._stamp()
        self.errors: list[str] = []

    def _stamp(self) -> tuple | None:
        """The files' (mtime, size, inode): a re-signed bundle (only ``SIGNATURE.json``
        changed) is loaded again too."""
        out: list[tuple[int, int, int] | None] = []
        for name in BUNDLE_FILES:
            try:
                st = (self.path / name).stat()
            except OSError:
                out.append(None)
                continue
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return None if all(x is None for x in out) else tuple(out)

    def start(self) -> BundleWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            stamp = self._stamp()
            if stamp is None or stamp == self._seen:
                continue
            self._seen = stamp
            try:
                self.store.load(self.path, self.check)
            except BundleError as e:  # keep serving the old one, say why
                self.errors.append(str(e))
                if not isinstance(e, SignatureError):  # that one logged it already
                    log.error("bundle watch: %s", e)
