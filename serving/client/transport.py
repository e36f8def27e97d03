"""The adapters' one way to the policy server, shared by the static
(:class:`serving.client.static.ControllerAdapter`) and the online
(:class:`serving.client.online.OnlineAdapter`) adapter.

- :class:`ServerClient`: one keep-alive HTTP client (TLS pinned to the ``policy-server``
  identity, :func:`tls_verify`; the API key header), a timeout per request, bounded retries
  and a :class:`CircuitBreaker` (``failures`` consecutive failures open it for ``reset_s``;
  then one trial request half-opens it). An outage is :class:`ServerUnavailable`, which the
  adapters ride out with their fallback; a request the server refuses as wrong (4xx) is
  :class:`AdapterError`.
- :func:`fetch_bundle`: cached mode's download of a policy bundle (either kind,
  :class:`BundleSource`): the server's version and hash, the zip only when the hash differs
  from the bundle held, the files written into the bundle cache each one whole
  (:func:`unzip_files`: adapters may share a cache directory), then the loader, which
  verifies the signature. Whatever fails is logged and the adapter keeps the bundle it has.
- :class:`BackgroundRefresh`: the refresh on a daemon thread, so a slow or hung server never
  delays a decision; a refresh asked for while one runs runs again after it.
"""

from __future__ import annotations

import io
import logging
import os
import ssl
import threading
import time
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from security.tls import Security, client_ssl_context

from ..bundles.format import HEX_DIGEST, BundleError
from ..bundles.signing import SignatureError

if TYPE_CHECKING:
    import httpx

__all__ = ["MODES", "AdapterError", "BackgroundRefresh", "BundleSource", "CircuitBreaker",
           "ServerClient", "ServerUnavailable", "fetch_bundle", "tls_verify", "unzip_files"]

log = logging.getLogger(__name__)
#: an adapter's modes: ask the server (``remote``) or decide with a fetched bundle (``cached``)
MODES = ("remote", "cached")
#: where fetched bundles are cached when the adapter names no ``cache_dir``
CACHE_ROOT = Path.home() / ".cache" / "smart-dsmd"

B = TypeVar("B")


class AdapterError(RuntimeError):
    """A request the server refused as wrong (4xx): a bug in the caller, not an outage."""


class ServerUnavailable(Exception):
    """The policy server could not answer (no client, an open circuit, timeouts, refused
    connections, 5xx): an outage, which the adapters ride out with their fallback."""


def tls_verify(security: Security, url: str, component: str = "controller adapter"
               ) -> ssl.SSLContext | bool:
    """How a client of the policy server at ``url`` checks it (httpx's ``verify``): secure,
    an ``https://`` URL and a context trusting only the PKI's CA, pinned to the
    ``policy-server`` identity (its certificate must name ``policy-server.id.smart-dsmd``);
    a plain ``http://`` URL is then refused (ValueError naming it). Insecure: no check
    (warned, once per client)."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in ("http", "https"):
        raise ValueError(f"base_url {url!r}: expected an http(s):// URL")
    if security.warn_if_insecure(component):
        return False
    if scheme != "https":
        raise ValueError(f"base_url {url!r}: the policy server is reached over TLS when "
                         "security is on (use https://, or security.insecure=true to debug "
                         "over plain HTTP)")
    # only the policy-server identity may answer, whatever host the URL names (pinned)
    return client_ssl_context(security, expect="policy-server")


class CircuitBreaker:
    """closed -> (``failures`` consecutive failures) -> open -> (``reset_s``) -> half-open ->
    one trial: success closes it, failure opens it again."""

    def __init__(self, failures: int = 3, reset_s: float = 2.0) -> None:
        if failures < 1 or reset_s <= 0:
            raise ValueError("circuit breaker needs failures >= 1 and reset_s > 0")
        self.threshold, self.reset_s = failures, reset_s
        self.failures = 0
        self.opened_at: float | None = None

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if time.monotonic() - self.opened_at >= self.reset_s else "open"

    def allow(self) -> bool:
        return self.state != "open"

    def success(self) -> None:
        self.failures, self.opened_at = 0, None

    def failure(self) -> None:
        self.failures += 1
        if self.failures >= self.threshold or self.opened_at is not None:
            self.opened_at = time.monotonic()


class ServerClient:
    """One adapter's connection to the policy server (module docstring). ``base_url`` None:
    no server; every request is then :class:`ServerUnavailable`."""

    def __init__(self, base_url: str | None, api_key: str | None, *, timeout_s: float,
                 retries: int, breaker: CircuitBreaker, security: Security,
                 component: str = "controller adapter") -> None:
        if retries < 0 or timeout_s <= 0:
            raise ValueError("retries must be >= 0 and timeout_s > 0")
        self.timeout_s, self.retries, self.breaker = timeout_s, retries, breaker
        self._http: httpx.Client | None = None
        if base_url is not None:
            import httpx

            self._http = httpx.Client(base_url=base_url, timeout=timeout_s,
                                      verify=tls_verify(security, base_url, component),
                                      headers={"X-API-Key": api_key} if api_key else {})

    @property
    def configured(self) -> bool:
        """Whether a server was named."""
        return self._http is not None

    def send(self, method: str, path: str, body: Any,
             retries: int | None = None) -> httpx.Response:
        """One request with ``retries`` retries (default: the client's) through the circuit
        breaker: the first answer below 500 (the breaker counts it a success), else
        :class:`ServerUnavailable` (no server, open circuit, timeouts, refused connections,
        5xx)."""
        import httpx

        if self._http is None:
            raise ServerUnavailable("no server configured")
        breaker = self.breaker
        if not breaker.allow():
            raise ServerUnavailable("circuit open")
        err = "?"
        for _ in range(1 + (self.retries if retries is None else retries)):
            try:
                r = self._http.request(method, path, json=body)
            except httpx.HTTPError as e:  # timeouts, refused connections, broken streams
                err = f"{type(e).__name__}"
                breaker.failure()
                if not breaker.allow():
                    break
                continue
            if r.status_code >= 500:
                err = f"HTTP {r.status_code}"
                breaker.failure()
                if not breaker.allow():
                    break
                continue
            breaker.success()
            return r
        raise ServerUnavailable(err)

    def json(self, method: str, path: str, body: Any = None) -> Any:
        """:meth:`send`, then the answer's JSON; :class:`AdapterError` on a 4xx."""
        r = self.send(method, path, body)
        if r.status_code >= 400:
            raise AdapterError(f"{method} {path}: HTTP {r.status_code}: {r.text[:500]}")
        return r.json()

    def get_bytes(self, path: str) -> bytes:
        """``GET path`` once (a bundle download: at least 5 s to arrive): the body,
        :class:`AdapterError` on an answer other than 200, :class:`ServerUnavailable` when
        there is no server or it cannot be reached."""
        import httpx

        if self._http is None:
            raise ServerUnavailable("no server configured")
        try:
            r = self._http.get(path, timeout=max(self.timeout_s, 5.0))
        except httpx.HTTPError as e:
            raise ServerUnavailable(type(e).__name__) from None
        if r.status_code != 200:
            raise AdapterError(f"GET {path}: HTTP {r.status_code}")
        return r.content

    def close(self) -> None:
        if self._http is not None:
            self._http.close()


def unzip_files(raw: bytes, directory: str | Path, names: Iterable[str]) -> Path:
    """Write the files ``names`` of a downloaded bundle zip
    (:func:`serving.bundles.static.bundle_zip`) into ``directory`` (an adapter's cache), each
    one whole: written beside it, then renamed, so adapters sharing a cache directory never
    load a half-written file."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        for name in set(z.namelist()) & set(names):
            tmp = d / f".{name}.{os.getpid()}.{threading.get_ident()}"
            tmp.write_bytes(z.read(name))
            os.replace(tmp, d / name)
    return d


@dataclass(frozen=True)
class BundleSource(Generic[B]):
    """Where cached mode fetches one kind of policy bundle, and how it loads one."""

    #: in the logs: "policy" (static) or "online policy"
    kind: str
    #: ``GET``: ``{"loaded", "hash", "version"}`` of the bundle the server serves
    info_path: str
    #: ``GET``: that bundle's files as a zip
    bundle_path: str
    #: the bundle's file names (what is taken from the zip)
    files: tuple[str, ...]
    #: the cache's folder under :data:`CACHE_ROOT` when the adapter names no ``cache_dir``
    cache_name: str
    #: a directory to a loaded, verified bundle (raises BundleError or SignatureError)
    load: Callable[[Path], B]


def fetch_bundle(client: ServerClient, source: BundleSource[B], current_hash: str | None,
                 current_version: int, cache_dir: Path | None, force: bool = False
                 ) -> tuple[B, int] | None:
    """Cached mode's download (module docstring): the new bundle and its server version, or
    None when the server has none, serves the one held (``current_hash``; unless ``force``)
    or anything fails (logged; the caller keeps version ``current_version``)."""
    try:
        info = client.json("GET", source.info_path)
        if not info["loaded"] or (not force and current_hash == info["hash"]):
            return None
        raw = client.get_bytes(source.bundle_path)
    except (ServerUnavailable, AdapterError) as e:
        log.warning("%s refresh failed (%s); keeping version %d", source.kind, e,
                    current_version)
        return None
    digest = info.get("hash")
    if not isinstance(digest, str) or not HEX_DIGEST.fullmatch(digest):
        log.warning("%s refresh: the server's bundle hash %r is not a hex digest; keeping "
                    "version %d", source.kind, digest, current_version)
        return None
    root = cache_dir or CACHE_ROOT / source.cache_name
    try:
        bundle = source.load(unzip_files(raw, root / digest[:16], source.files))
    except SignatureError:  # logged once by the verification, with the key id
        return None
    except BundleError as e:
        log.error("downloaded %s bundle refused: %s", source.kind, e)
        return None
    return bundle, int(info["version"])


class BackgroundRefresh:
    """Runs ``refresh`` on a daemon thread when asked (:meth:`start`) unless it is running
    already; ``again=True`` while it runs runs it once more after it (that run may have read
    the server's version before the change that asked). A failure is logged and never stops
    later refreshes."""

    def __init__(self, refresh: Callable[[], Any], name: str) -> None:
        self._refresh, self._name = refresh, name
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._again = False
        self.last = -float("inf")  # time.monotonic() of the last start

    def due(self, period_s: float) -> bool:
        """Whether ``period_s`` has passed since the last start."""
        return time.monotonic() - self.last >= period_s

    def start(self, again: bool = False) -> bool:
        """Start a refresh; whether one was started (False: one is running)."""
        with self._lock:
            if self._thread is not None:
                self._again = self._again or again
                return False
            self.last = time.monotonic()
            self._again = False
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
            return True

    def _loop(self) -> None:
        while True:
            try:
                self._refresh()
            except Exception:  # a daemon thread's failure must not stop later refreshes
                log.exception("%s failed", self._name)
            with self._lock:
                if not self._again:
                    self._thread = None
                    return
                self._again = False
