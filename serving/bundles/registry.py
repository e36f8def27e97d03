"""Policy bundles from an MLflow model registry: ``models:/<name>@<alias>`` or
``models:/<name>/<version>`` wherever the server takes a bundle directory (``bundle``,
``online_bundle``, ``PUT /v1/policy``, ``PUT /v1/online/policy``).

:meth:`ModelRegistry.fetch` resolves the URI to one model version (the alias's current
version, or the version named), downloads that version's files (the bundle a training run
logged and registered: ``logger.registry`` of ``train.py``) into a local cache,
``<cache_dir>/<name>/<version>-<run id>``, written atomically and reused while the version
stays the same, and checks that the files are the ones registered (the version's
``bundle.actor_sha256`` tag against ``metadata.json``). The caller then loads the directory
with the loader it uses for a directory (:func:`serving.bundles.static.load_bundle`,
:func:`serving.bundles.online.load_online_bundle`), which verifies the bundle's signature
against the trusted keys as for any other bundle: the registry is a place to find bundles,
never a reason to trust one.

:class:`RegistryWatcher` follows an alias: it polls the registry every ``period_s`` and
installs the version the alias points at whenever that changes. Everything that can go wrong
(no such model, alias or version, an unreachable server, a missing or changed artifact, a
signature that fails) is a :class:`RegistryError` or
:class:`serving.bundles.format.BundleError` that names the URI and the version: at start the
server logs it and starts without that policy, at run time the swap is refused and the serving
policy stays. A version that was refused is not tried again while the alias stays on it (an
alias deleted and set again, or moved away and back, is tried again); an unreachable server is
retried on every poll.

MLflow is imported only when a registry URI is used; its HTTP client is told to give up
after 2 retries and a 10 s timeout unless ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` and
``MLFLOW_HTTP_REQUEST_TIMEOUT`` say otherwise (its defaults retry for minutes).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .static import BundleError

__all__ = ["REGISTRY_SCHEME", "ModelRegistry", "RegistryError", "RegistryRef",
           "RegistryWatcher", "ResolvedVersion", "is_registry_uri"]

log = logging.getLogger(__name__)

REGISTRY_SCHEME = "models:/"
#: the model version tag holding the SHA-256 of the bundle's actor (written at registration)
ACTOR_TAG = "bundle.actor_sha256"
_NAME = re.compile(r"^[^/@\s][^/@]{0,255}$")
_ALIAS = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,254}$")


class RegistryError(BundleError):
    """A registry URI that cannot be resolved or fetched (what, and for which URI)."""


def is_registry_uri(source: str | os.PathLike[str] | None) -> bool:
    """Whether ``source`` names a registered model (``models:/...``) rather than a directory."""
    return isinstance(source, str) and source.startswith(REGISTRY_SCHEME)


@dataclass(frozen=True)
class RegistryRef:
    """A parsed ``models:/<name>@<alias>`` (``alias``) or ``models:/<name>/<version>``."""

    name: str
    alias: str | None = None
    version: str | None = None

    @property
    def uri(self) -> str:
        tail = f"@{self.alias}" if self.alias is not None else f"/{self.version}"
        return f"{REGISTRY_SCHEME}{self.name}{tail}"

    @classmethod
    def parse(cls, uri: str) -> RegistryRef:
        if not is_registry_uri(uri):
            raise RegistryError(f"{uri!r}: not a registry URI (models:/<name>@<alias> or "
                                "models:/<name>/<version>)")
        rest = uri[len(REGISTRY_SCHEME):]
        if "@" in rest:
            name, alias = rest.rsplit("@", 1)
            if _NAME.match(name) and _ALIAS.match(alias):
                return cls(name, alias=alias)
        elif "/" in rest:
            name, version = rest.rsplit("/", 1)
            if _NAME.match(name) and version.isdigit() and int(version) > 0:
                return cls(name, version=str(int(version)))
        raise RegistryError(f"{uri!r}: expected models:/<name>@<alias> (an alias: a letter or "
                            "_ then letters, digits, _ or -) or models:/<name>/<version> (a "
                            "version number from 1)")


@dataclass(frozen=True)
class ResolvedVersion:
    """The model version a :class:`RegistryRef` points at now."""

    ref: RegistryRef
    version: str
    run_id: str | None
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def origin(self) -> str:
        """``models:/<name>/<version>``, with the alias it was reached by."""
        via = f" (alias {self.ref.alias})" if self.ref.alias is not None else ""
        return f"{REGISTRY_SCHEME}{self.ref.name}/{self.version}{via}"


def _quiet_client_defaults() -> None:
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def _reason(e: Exception) -> str:
    """An MLflow exception's message without its traceback-sized tail."""
    msg = str(getattr(e, "message", None) or e).strip().splitlines()
    return (msg[0] if msg else type(e).__name__)[:500]


class ModelRegistry:
    """One MLflow tracking server's registry (``tracking_uri``: ``http(s)://...``,
    ``sqlite:///...``; None: ``MLFLOW_TRACKING_URI`` or MLflow's default) and the local
    cache its bundles are downloaded into (None: ``$XDG_CACHE_HOME`` or ``~/.cache``,
    ``smart-dsmd/registry``)."""

    def __init__(self, tracking_uri: str | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> None:
        _quiet_client_defaults()
        try:
            from mlflow import MlflowClient
        except ImportError:
            raise RegistryError("serving from a model registry (models:/...) needs MLflow's "
                                "client: pip install -e '.[serve,registry]'") from None

        self.tracking_uri = tracking_uri or None
        self.client = MlflowClient(tracking_uri=self.tracking_uri,
                                   registry_uri=self.tracking_uri)
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        self.cache_dir = Path(cache_dir) if cache_dir else Path(base) / "smart-dsmd" / "registry"

    def __repr__(self) -> str:
        return f"ModelRegistry({self.tracking_uri!r}, cache_dir={str(self.cache_dir)!r})"

    def resolve(self, ref: RegistryRef) -> ResolvedVersion:
        """The version ``ref`` points at now (:class:`RegistryError`: no such model, alias
        or version, or the server cannot be reached)."""
        from mlflow.exceptions import MlflowException

        try:
            if ref.alias is not None:
                mv = self.client.get_model_version_by_alias(ref.name, ref.alias)
            else:
                mv = self.client.get_model_version(ref.name, str(ref.version))
        except MlflowException as e:
            code = getattr(e, "error_code", "")
            if code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                what = self._missing(ref)
                raise RegistryError(f"{ref.uri}: {what} in the registry at "
                                    f"{self._where()}") from None
            raise RegistryError(f"{ref.uri}: the registry at {self._where()} did not answer: "
                                f"{_reason(e)}") from None
        except Exception as e:  # a connection refused, a bad URI scheme, ...
            raise RegistryError(f"{ref.uri}: the registry at {self._where()} did not answer: "
                                f"{type(e).__name__}: {_reason(e)}") from None
        return ResolvedVersion(ref, str(mv.version), mv.run_id or None, dict(mv.tags or {}))

    def _where(self) -> str:
        return self.tracking_uri or "the default tracking URI"

    def _missing(self, ref: RegistryRef) -> str:
        """Which part of ``ref`` the registry does not have (for the error message)."""
        try:
            self.client.get_registered_model(ref.name)
        except Exception:
            return f"no registered model named {ref.name!r}"
        if ref.alias is not None:
            return f"model {ref.name!r} has no alias {ref.alias!r}"
        return f"model {ref.name!r} has no version {ref.version}"

    def fetch(self, source: str | RegistryRef) -> tuple[Path, ResolvedVersion]:
        """Resolve ``source`` and download its version's files (once per version): the
        local directory and the version (:class:`RegistryError` on failure)."""
        ref = source if isinstance(source, RegistryRef) else RegistryRef.parse(source)
        rv = self.resolve(ref)
        return self.download(rv), rv

    def download(self, rv: ResolvedVersion) -> Path:
        """``rv``'s files in the cache (downloaded unless already there), checked against
        the version's recorded actor hash."""
        run = (rv.run_id or "norun")[:12]
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", rv.ref.name)
        dest = self.cache_dir / safe / f"{rv.version}-{run}"
        if (dest / "metadata.json").is_file():
            try:
                self._check_files(rv, dest)
                return dest
            except RegistryError:  # a damaged cache: download it again
                shutil.rmtree(dest, ignore_errors=True)
        self._download_into(rv, dest)
        self._check_files(rv, dest)
        return dest

    def _download_into(self, rv: ResolvedVersion, dest: Path) -> None:
        import mlflow.artifacts

        name = f"{REGISTRY_SCHEME}{rv.ref.name}/{rv.version}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
        try:
            try:
                uri = self.client.get_model_version_download_uri(rv.ref.name, rv.version)
                got = Path(mlflow.artifacts.download_artifacts(
                    artifact_uri=uri, dst_path=str(tmp), tracking_uri=self.tracking_uri))
            except Exception as e:
                raise RegistryError(f"{name}: its files could not be downloaded: "
                                    f"{type(e).__name__}: {_reason(e)}") from None
            if not got.is_dir():
                raise RegistryError(f"{name}: its artifact ({uri}) is a file, not a bundle "
                                    "directory")
            if not (got / "metadata.json").is_file():
                raise RegistryError(f"{name}: its artifact ({uri}) holds no policy bundle "
                                    "(no metadata.json)")
            try:
                got.rename(dest)  # atomic: a reader never sees half a bundle
            except OSError:
                if not (dest / "metadata.json").is_file():  # not a concurrent download's
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def _check_files(rv: ResolvedVersion, d: Path) -> None:
        want = rv.tags.get(ACTOR_TAG)
        if want is None:
            return  # registered by hand: the signature alone vouches for the files
        try:
            got = json.loads((d / "metadata.json").read_text()).get("actor_sha256")
        except (OSError, ValueError) as e:
            raise RegistryError(f"{rv.origin}: metadata.json unreadable: {e}") from None
        if got != want:
            raise RegistryError(f"{rv.origin}: the downloaded bundle's actor ({str(got)[:16]}"
                                f"...) is not the one registered ({want[:16]}...)")


class RegistryWatcher:
    """Follows ``ref`` (an alias) in ``registry``: every ``period_s`` it resolves the alias
    and, when the version changed, downloads it and calls ``install(path, version)``; what
    fails is logged once (``on_refused(reason)`` is called for a refused swap) and the
    installed policy stays (module docstring)."""

    def __init__(self, registry: ModelRegistry, ref: RegistryRef,
                 install: Callable[[Path, ResolvedVersion], Any], period_s: float = 2.0,
                 what: str = "policy",
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.registry, self.ref, self.install = registry, ref, install
        self.period_s, self.what, self.on_refused = period_s, what, on_refused
        self.errors: list[str] = []
        self.current: ResolvedVersion | None = None  # the version installed last
        self._tried: tuple[str, str | None] | None = None  # (version, run) tried last
        self._last_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"registry-{what}",
                                        daemon=True)

    def poll(self) -> ResolvedVersion | None:
        """One look at the registry: the version installed now (None: none yet)."""
        try:
            rv = self.registry.resolve(self.ref)
        except RegistryError as e:
            self._error(str(e))
            self._tried = None  # the alias set again later is a new decision: tried again
            return self.current
        key = (rv.version, rv.run_id)
        if key == self._tried:
            return self.current
        try:
            path = self.registry.download(rv)
        except RegistryError as e:  # a network failure is retried on the next poll
            self._error(str(e))
            return self.current
        self._tried = key
        try:
            self.install(path, rv)
        except BundleError as e:
            detail = str(e).removeprefix(f"{rv.origin}: ")  # the store's loads name it
            self._error(f"{rv.origin}: refused: {detail}")
            if self.on_refused is not None:
                self.on_refused(str(e))
            return self.current
        self.current, self._last_error = rv, None
        log.info("%s from %s installed", self.what, rv.origin)
        return rv

    def _error(self, msg: str) -> None:
        if msg != self._last_error:  # once per distinct failure, not once per poll
            self._last_error = msg
            self.errors.append(msg)
            log.error("%s (the serving %s stays)", msg, self.what)

    def start(self) -> RegistryWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.poll()
            except Exception:  # never let the thread die: the next poll tries again
                log.exception("%s: registry poll failed", self.ref.uri)
