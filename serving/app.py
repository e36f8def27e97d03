"""The policy server (FastAPI): controller sessions, rate updates and decisions under ``/v1``.

A controller opens a session once (nodes and s(n), C_b, C_p, K, its message types), then
streams rate estimates and asks for channels, one type or a batch; the server keeps each
session's assignment and resources (:class:`serving.session.Session`) and decides with the
loaded policy bundle (ONNX Runtime) or, when no usable policy is there, the configured
heuristic, saying so in the response.

Failures, as a client sees them: 401 (no or wrong ``X-API-Key``), 403 (a policy swap without
an admin key), 404 (unknown session, a session another key created: the same answer, or
one expired after ``limits.idle_s`` unused), 409 (a body the schema accepts that
contradicts the session's state or itself, e.g. a destination node the session does not
have, or a bundle refused on swap; the message names the type, field or session), 413
(body larger than ``max_body_bytes``, declared or streamed), 422 (the body is not RFC 8259
JSON, :mod:`serving.strictjson`, or does not match the schema, lists included: more than
``max_batch`` types to decide, ``max_types`` types or ``limits.max_nodes`` nodes, the
limits the OpenAPI document states as ``maxItems``; ``detail`` lists each field's location
and problem), 429 (``max_sessions`` reached, this key's sessions over their memory budget,
:mod:`serving.limits`, this key over its rate limit, or this address over its rate of
requests with an invalid key: the last two with ``Retry-After``). No failed request
changes any state.

Resources (:mod:`serving.limits`): every session is charged its estimated memory before
anything is allocated, against a per-key and a server-wide budget; sessions unused for
``limits.idle_s`` are deleted; the requests of a large session, and large batches, run on a
worker thread (one at a time per session), so one client's heaviest request does not stall
another's.

Access (:mod:`serving.access`): each session belongs to the key that created it; admin keys
may also read and delete other keys' sessions, audited; admin actions and refusals are logged
on ``smart.audit`` (a key id, never the key); each key has its own token bucket
(``rate_limit``). Transport: served over TLS by ``serve.py`` (uvicorn's own TLS, the
``security`` setting; ``security.insecure`` for plain HTTP while debugging).

Signed bundles (:mod:`serving.bundles.signing`): a policy or online policy bundle is loaded only if
its signature verifies against a key of ``bundle_trust`` (the PKI's bundle-signing key and
the configured public keys); a bundle unsigned, signed by another key or changed after
signing is refused with 409 on ``PUT``, the reason (file, key id) in the message and the
log, and the policy loaded before keeps serving.

A session also holds the controller's channel health (``channel_health``: whether the MQ
channel is up, the types rerouted to RPC or waiting, the nodes whose RPC endpoint is down),
set when it is created or by ``PATCH``, read with the session or alone
(``GET /v1/sessions/{id}/health``).

With ``announce.url`` configured, the server announces every policy swap and every change of
a session's channel health on a Pulsar topic (Stemflow Section IV, subscribed global
knowledge; :mod:`serving.announce`), so cached adapters refresh at once instead of at their
next poll; announcing never delays or fails a request, and polling remains the fallback.

The online policy (a knob-setting policy planning every interval boundary from a session's
history) has its own endpoints under ``/v1/online`` (:mod:`serving.online_api`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import numpy as np
from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from envs.dsmd import kernels, online_greedy
from envs.dsmd.errors import DSMDError
from security.tls import Security as TransportSecurity

from .access import (
    ANONYMOUS,
    API_KEY_HEADER,
    DEFAULT_MIN_KEY_CHARS,
    MIN_KEY_CHARS_FLOOR,
    AdminCaller,
    AllowMiddleware,
    Caller,
    ControllerCaller,
    RateLimit,
    RateLimiter,
    allowed_methods,
    audit,
    caller_for,
    check_key_strength,
    document_contract,
    require_admin,
    require_controller,
    require_metrics,
    retry_after,
)
from .announce import DEFAULT_TOPIC, Announcer, check_settings
from .bundles.registry import (
    ModelRegistry,
    RegistryError,
    RegistryRef,
    RegistryWatcher,
    ResolvedVersion,
    is_registry_uri,
)
from .bundles.signing import BundleTrust
from .bundles.static import bundle_zip
from .limits import (
    WORKER_THREADS,
    BudgetExceeded,
    KeySlots,
    Lease,
    MemoryBudget,
    ResourceLimits,
    static_session_bytes,
)
from .metrics import MetricsMiddleware, ServerMetrics
from .online_api import add_online_routes
from .policy_store import BundleError, BundleWatcher, LoadedPolicy, OnlinePolicyStore, PolicyStore
from .schemas import (
    ERROR_RESPONSES,
    OUT_OF_RANGE,
    ChannelHealth,
    DecideBatchRequest,
    DecideRequest,
    DecisionBatchOut,
    DecisionSingleOut,
    ErrorOut,
    HealthOut,
    PolicyOut,
    PolicySwap,
    RateUpdate,
    RateUpdated,
    SessionCreate,
    SessionCreated,
    SessionHealthOut,
    SessionOut,
    SessionUpdate,
    TypeIn,
    error_responses,
)
from .session import FALLBACKS, Decision, Session, SessionError, SessionSpec
from .strictjson import StrictJSONRoute, json_safe

__all__ = ["DEFAULT_AUTH_FAILURES", "DEFAULT_RATE_LIMIT", "ServerSettings", "create_app"]

_T = TypeVar("_T")

log = logging.getLogger(__name__)
#: per key: far above what a controller, ``make run`` or the testbed sends, far below what
#: one process serves (a flooding key is refused long before it slows the others)
DEFAULT_RATE_LIMIT = RateLimit(requests_per_s=2000.0, burst=4000)
#: per client address, requests with a missing or invalid key: enough for a controller
#: whose key was rotated to notice, far too few to guess keys or flood the audit log
DEFAULT_AUTH_FAILURES = RateLimit(requests_per_s=5.0, burst=20)
#: a batch deciding more types than this runs on a worker thread whatever its session's size
THREADED_BATCH = 256


@dataclass
class ServerSettings:
    """Everything the server is configured with (``configs/serve.yaml``)."""

    bundle: str | None = None  # policy bundle directory loaded at start (None: heuristic)
    #: online policy bundle (serving.bundles.online) loaded at start; None: none until a
    #: PUT /v1/online/policy (serving/online_api.py)
    online_bundle: str | None = None
    api_keys: list[str] = field(default_factory=list, repr=False)  # controllers' keys
    admin_keys: list[str] = field(default_factory=list, repr=False)  # may swap the policy
    #: may read ``/v1/metrics`` and nothing else (a Prometheus scraper's keys)
    metrics_keys: list[str] = field(default_factory=list, repr=False)
    #: the fewest characters a configured key may have (serving.access.check_key_strength)
    min_key_chars: int = DEFAULT_MIN_KEY_CHARS
    auth: bool = True  # False only for local experiments
    fallback: str = "greedy"  # heuristic when no usable policy: greedy | rpc
    max_body_bytes: int = 4 * 1024 * 1024
    max_batch: int = 20_000
    max_sessions: int = 1_000
    max_sessions_per_key: int = 100  # one key cannot take every slot (each family)
    max_types: int = 200_000  # per session
    watch: bool = False  # reload the bundle when its files change
    watch_period_s: float = 2.0
    require_policy: bool = False  # readiness needs a loaded policy
    #: after start-up, move every object alive then out of the garbage collector's reach
    #: (``gc.freeze``): a full collection would otherwise walk the libraries' ~150,000
    #: objects (tens of milliseconds), a stall that queues every request arriving meanwhile
    freeze_gc: bool = True
    #: threads that score one batch's chunks (``serving.bundles.static.load_bundle``); None:
    #: the cores this process may use, at most 4
    batch_threads: int | None = None
    #: Pulsar service URL of the announcement topic (``announce.url``; None: no
    #: announcements, the adapters poll); the ``pulsar-client`` package is then required
    announce_url: str | None = None
    announce_topic: str = DEFAULT_TOPIC  # ``announce.topic``
    announce_send_timeout_s: float = 2.0  # an announcement not confirmed by then: failed
    #: transport security (``security: {insecure, pki_dir}``): TLS with the PKI's
    #: ``policy-server`` identity unless ``tls_certfile``/``tls_keyfile`` name others;
    #: insecure: plain HTTP (warned). Applied by ``serve.py`` (uvicorn's TLS options).
    security: TransportSecurity = field(default_factory=TransportSecurity)
    tls_certfile: str | None = None  # ``tls.certfile`` (PEM); with tls_keyfile
    tls_keyfile: str | None = None  # ``tls.keyfile`` (PEM, unencrypted)
    #: per-key token bucket (``rate_limit: {requests_per_s, burst}``); None: no limit
    rate_limit: RateLimit | None = DEFAULT_RATE_LIMIT
    #: per client address, a token bucket of requests with a missing or invalid key
    #: (``auth_failures: {requests_per_s, burst}``): over it, 429 and one audit line per run
    #: of refusals instead of one per request; None: no limit
    auth_failures: RateLimit | None = DEFAULT_AUTH_FAILURES
    #: session sizes, memory budgets and idle expiry (``limits: {...}``, serving.limits)
    limits: ResourceLimits = field(default_factory=ResourceLimits)
    #: the public keys a bundle's signature must verify against, for the policy and the
    #: online policy (``bundle_trust: {keys, pki_key}``, :mod:`serving.bundles.signing`); None: the
    #: PKI's ``bundle-signing.pub`` of ``security`` (unsigned bundles accepted, warned, when
    #: ``security.insecure``)
    bundle_trust: BundleTrust | None = None
    #: the MLflow tracking server whose model registry ``models:/`` URIs (``bundle``,
    #: ``online_bundle``, a swap's path) are looked up in (``registry.tracking_uri``; None:
    #: ``MLFLOW_TRACKING_URI`` or MLflow's default), and where their files are cached
    #: (``registry.cache_dir``; None: ``~/.cache/smart-dsmd/registry``)
    registry_uri: str | None = None
    registry_cache_dir: str | None = None

    def __post_init__(self) -> None:
        self.security = TransportSecurity.from_mapping(self.security)
        self.rate_limit = RateLimit.from_mapping(self.rate_limit)
        self.auth_failures = RateLimit.from_mapping(self.auth_failures)
        self.limits = ResourceLimits.from_mapping(self.limits)
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("tls: give both certfile and keyfile, or neither (then the "
                             "PKI's policy-server identity is used)")
        if self.security.insecure and self.tls_certfile is not None:
            raise ValueError("tls.certfile is set but security.insecure is true: choose one")
        if self.bundle_trust is not None and not isinstance(self.bundle_trust, BundleTrust):
            raise ValueError("bundle_trust: expected a serving.bundles.signing.BundleTrust "
                             f"(or None), got {type(self.bundle_trust).__name__}")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        for k in ("bundle", "online_bundle"):
            if is_registry_uri(getattr(self, k)):
                try:
                    RegistryRef.parse(getattr(self, k))
                except RegistryError as e:
                    raise ValueError(f"{k}: {e}") from None
        if self.auth and not self.api_keys:
            raise ValueError("auth is on but no api_keys are configured (set api_keys_file, "
                             "or SMART_API_KEYS=key1,key2, or auth=false for local use)")
        if isinstance(self.min_key_chars, bool) or not isinstance(self.min_key_chars, int) or (
                self.min_key_chars < MIN_KEY_CHARS_FLOOR):
            raise ValueError(f"min_key_chars must be an integer >= {MIN_KEY_CHARS_FLOOR}, got "
                             f"{self.min_key_chars!r}")
        if self.auth:
            for name in ("api_keys", "admin_keys", "metrics_keys"):
                check_key_strength(getattr(self, name), name, self.min_key_chars)
        for k in ("max_body_bytes", "max_batch", "max_sessions", "max_sessions_per_key",
                  "max_types"):
            if getattr(self, k) <= 0:
                raise ValueError(f"{k} must be positive")
        if self.batch_threads is not None and self.batch_threads < 1:
            raise ValueError(f"batch_threads must be at least 1 (or null), got "
                             f"{self.batch_threads}")
        check_settings(self.announce_url, self.announce_topic)
        if not self.announce_send_timeout_s > 0:
            raise ValueError(f"announce.send_timeout_s must be positive, got "
                             f"{self.announce_send_timeout_s}")

    def trust(self) -> BundleTrust:
        """``bundle_trust``, or the trust of ``security`` (:meth:`BundleTrust.from_security`:
        the PKI's key; ``PkiError`` if it has none)."""
        if self.bundle_trust is None:
            self.bundle_trust = BundleTrust.from_security(self.security)
        return self.bundle_trust

    def tls_files(self) -> tuple[str, str, str | None] | None:
        """(certfile, keyfile, CA file) uvicorn serves with; None when insecure (plain HTTP).
        The PKI's ``policy-server`` identity unless ``tls_certfile`` is set (CA: None)."""
        if self.security.insecure:
            return None
        if self.tls_certfile is not None and self.tls_keyfile is not None:
            return self.tls_certfile, self.tls_keyfile, None
        ident = self.security.identity("policy-server")
        return str(ident.cert), str(ident.key), str(ident.ca)




class BodyLimit:
    """Pure ASGI: 413 for a body over ``limit`` bytes, declared (``Content-Length``) or
    streamed (chunked): the body is read up to the limit before the app sees it, so the
    app never starts on a body it cannot have whole."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    too_big = int(v) > self.limit
                except ValueError:
                    too_big = False
                if too_big:
                    return await self._reject(scope, receive, send)
        chunks: list[bytes] = []
        seen = 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client left: let the app see it
                first: Message | None = msg
                break
            body = msg.get("body", b"")
            seen += len(body)
            if seen > self.limit:
                return await self._reject(scope, receive, send)
            chunks.append(body)
            if not msg.get("more_body", False):
                first = None
                break
        whole: Message = {"type": "http.request", "body": b"".join(chunks),
                          "more_body": False}
        pending = [whole] if first is None else [first]

        async def _receive() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, _receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        resp = JSONResponse({"detail": f"request body larger than {self.limit} bytes "
                                       f"(max_body_bytes)"}, 413,
                            headers={"Connection": "close"})
        await resp(scope, receive, send)


def too_many(loc: list[str | int], n: int, limit: int, setting: str) -> HTTPException:
    """The 422 of a list longer than a configured limit (its ``maxItems``)."""
    return HTTPException(422, [{"loc": ["body", *loc], "type": "too_long",
                                "msg": f"at most {limit} items ({setting}), got {n}"}])


def _check_channels(types: Iterable[TypeIn], num_topics: int) -> None:
    for i, t in enumerate(types):
        if t.channel is not None and t.channel > num_topics:
            raise HTTPException(409, [{"loc": ["body", "types", i, "channel"],
                                       "msg": f"channel {t.channel} > num_topics {num_topics}",
                                       "type": "value_error"}])


def create_app(settings: ServerSettings | None = None, *,
               store: PolicyStore | None = None) -> FastAPI:
    """The app; its lifespan loads ``settings.bundle`` (if any) and starts the watcher.
    Every bundle it loads (at start, by the watcher, on ``PUT /v1/policy`` and
    ``PUT /v1/online/policy``) must be signed by a key of ``settings.trust()``; a refused
    one is logged (key id and reason) and the current policy keeps serving (409 on a PUT).
    A ``store`` given keeps its own trust."""
    cfg = settings or ServerSettings(auth=False)
    trust = cfg.trust()
    store = store or PolicyStore(batch_threads=cfg.batch_threads, trust=trust)
    online_store = OnlinePolicyStore(trust=trust)
    metrics = ServerMetrics()
    limits = cfg.limits
    sessions: dict[str, Session] = {}
    leases: dict[str, Lease] = {}  # session id -> its account (serving.limits)
    budget = MemoryBudget(limits, on_refused=lambda which: metrics.refused.labels(
        f"memory_budget_{which}").inc())
    slots = KeySlots()  # worker threads per key
    #: each session table's expiry: (now) -> sessions expired (static here, online added)
    sweepers: list[Callable[[float], int]] = []

    def check_for(owner: str | None) -> Callable[[LoadedPolicy], list[str]]:
        """The sessions a candidate policy does not fit, for a refusal's message: every one
        when ``owner`` is None (the server's own loads, logged), else only the caller's own
        by id and the others as a count (a refusal names no other key's session)."""
        def check(cand: LoadedPolicy) -> list[str]:
            mine, others = [], 0
            for sid, s in list(sessions.items()):  # read on a worker thread: a copy
                why = s.compatibility(cand)
                if why is None:
                    continue
                if owner is None or s.owner == owner:
                    mine.append(f"session {sid}: {why}")
                else:
                    others += 1
            if others:
                mine.append(f"{others} session(s) of other keys do not fit it")
            return mine
        return check

    check = check_for(None)
    registries: list[ModelRegistry] = []  # created on first use: MLflow loads only then

    def registry() -> ModelRegistry:
        if not registries:
            registries.append(ModelRegistry(cfg.registry_uri, cfg.registry_cache_dir))
        return registries[0]

    def materialize(path: str, origin: str | None) -> tuple[str, str | None]:
        """``(path, origin)`` of a bundle setting: a directory as it is, a ``models:/`` path
        as its registry version's local copy (downloaded first) and that version's name."""
        if not is_registry_uri(path):
            return path, origin
        local, rv = registry().fetch(path)
        return str(local), rv.origin

    def load(path: str, force: bool = False, owner: str | None = None,
             origin: str | None = None, allow_rollback: bool = False) -> LoadedPolicy:
        """Install the bundle at ``path``, or the registry version a ``models:/`` path
        names (downloaded first; ``origin`` set)."""
        try:
            path, origin = materialize(path, origin)
            p = store.load(path, check_for(owner), force, origin=origin,
                           allow_rollback=allow_rollback)
        except BundleError:
            metrics.swaps.labels("refused").inc()
            raise
        metrics.swaps.labels("loaded").inc()
        metrics.policy_version.set(p.version)
        return p

    def load_online(path: str, origin: str | None = None, allow_rollback: bool = False
                    ) -> Any:
        """Install the online bundle at ``path`` or of a ``models:/`` path (as :func:`load`)."""
        where, named = materialize(path, origin)
        return online_store.load(where, origin=named, allow_rollback=allow_rollback)

    def follow(uri: str, what: str, install: Callable[[Path, ResolvedVersion], Any]
               ) -> RegistryWatcher:
        """The first load of a ``models:/`` bundle setting, and its alias followed."""
        w = RegistryWatcher(registry(), RegistryRef.parse(uri), install, cfg.watch_period_s,
                            what)
        if w.poll() is None:
            log.error("no %s loaded: %s", what, w.errors[-1] if w.errors else uri)
        return w

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watcher = None
        if cfg.announce_url is not None:  # before the first load, which it announces
            announcer = Announcer(cfg.announce_url, cfg.announce_topic,
                                  send_timeout_s=cfg.announce_send_timeout_s,
                                  registry=metrics.registry, security=cfg.security)
            app.state.announcer = announcer
            store.add_listener(announcer.policy)
            online_store.add_listener(announcer.online_policy)
        # session work runs on these threads (serving.limits.KeySlots caps one key's share)
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="session"))
        # the simulator's compiled loops (loaded from their on-disk cache, or compiled on a
        # fresh install) before the first request, not inside it
        await asyncio.to_thread(kernels.warm_up)
        await asyncio.to_thread(online_greedy.warm_up)
        followers: list[RegistryWatcher] = []
        if is_registry_uri(cfg.bundle):
            followers.append(await asyncio.to_thread(
                follow, str(cfg.bundle), "policy",
                lambda path, rv: load(str(path), origin=rv.origin)))
        elif cfg.bundle:
            try:
                load(cfg.bundle)
            except BundleError as e:  # start anyway: heuristic decisions, not ready if required
                log.error("no policy loaded: %s", e)
            if cfg.watch:
                watcher = BundleWatcher(store, cfg.bundle, cfg.watch_period_s, check).start()
        if is_registry_uri(cfg.online_bundle):
            followers.append(await asyncio.to_thread(
                follow, str(cfg.online_bundle), "online policy",
                lambda path, rv: online_store.load(path, origin=rv.origin)))
        elif cfg.online_bundle:
            try:
                await asyncio.to_thread(online_store.load, cfg.online_bundle)
            except BundleError as e:  # start anyway: online plans refused until a swap
                log.error("no online policy loaded: %s", e)
        if cfg.watch:  # an alias is followed; a version number never changes
            for f in followers:
                if f.ref.alias is not None:
                    f.start()
        app.state.watcher, app.state.registry_watchers = watcher, followers
        sweeper = asyncio.create_task(sweep_forever())
        if cfg.freeze_gc:
            gc.collect()  # garbage first: only what is alive is frozen
            gc.freeze()
        yield
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        if watcher is not None:
            watcher.stop()
        for f in followers:
            await asyncio.to_thread(f.stop)
        if app.state.announcer is not None:
            store.remove_listener(app.state.announcer.policy)
            online_store.remove_listener(app.state.announcer.online_policy)
            await asyncio.to_thread(app.state.announcer.close)
            app.state.announcer = None

    async def sweep_forever() -> None:
        period = min(60.0, max(0.05, limits.idle_s / 4))
        while True:
            await asyncio.sleep(period)
            sweep()

    def sweep(now: float | None = None) -> int:
        """Expire every session unused for ``limits.idle_s`` (a busy one is skipped)."""
        t = time.monotonic() if now is None else now
        return sum(f(t) for f in sweepers)

    def expire_static(now: float) -> int:
        gone = [sid for sid, lease in list(leases.items())
                if lease.idle_for(now) >= limits.idle_s and not lease.lock.locked()]
        for sid in gone:
            drop(sid, "expired")
        return len(gone)

    sweepers.append(expire_static)

    def drop(sid: str, why: str) -> None:
        sessions.pop(sid, None)
        lease = leases.pop(sid, None)
        if lease is not None:
            budget.release(lease)
        if why == "expired":
            metrics.expired.labels("session").inc()
            log.info("session %s expired after %.0f s unused (limits.idle_s)", sid,
                     limits.idle_s)

    app = FastAPI(title="SMART DSMD policy server", version="1.0.0", lifespan=lifespan,
                  description=__doc__)
    # every body is RFC 8259 JSON: NaN, Infinity, 1e400 and lone surrogates are refused
    # before validation (serving.strictjson)
    app.router.route_class = StrictJSONRoute
    app.state.settings, app.state.store, app.state.sessions = cfg, store, sessions
    app.state.leases, app.state.budget, app.state.sweep = leases, budget, sweep
    app.state.metrics = metrics
    app.state.announcer = None  # an Announcer while started with announce_url

    # every configured key and its caller (admin keys first: a key in both lists is admin)
    known = [(k, caller_for(k, True)) for k in cfg.admin_keys] + [
        (k, caller_for(k, False)) for k in cfg.api_keys if k not in cfg.admin_keys] + [
        (k, caller_for(k, False, scraper=True)) for k in cfg.metrics_keys
        if k not in cfg.admin_keys and k not in cfg.api_keys]

    def rate_limited(who: str) -> None:
        metrics.rate_limited.labels(who).inc()
        metrics.refused.labels("rate_limit").inc()

    limiter = (RateLimiter(cfg.rate_limit, on_refused=rate_limited)
               if cfg.auth and cfg.rate_limit is not None else None)
    # requests with a missing or invalid key, per client address (bounded: at most
    # max_keys addresses are tracked, the idle ones dropped first)
    failures = (RateLimiter(cfg.auth_failures, max_keys=10_000,
                            on_refused=lambda who: metrics.refused.labels(
                                "auth_throttled").inc())
                if cfg.auth and cfg.auth_failures is not None else None)

    def _peer(request: Request) -> str:
        c = request.client
        return f"{c.host}:{c.port}" if c is not None else "unknown-peer"

    def _host(request: Request) -> str:
        c = request.client
        return c.host if c is not None else "unknown-peer"

    def _action(request: Request) -> str:
        route = request.scope.get("route")
        return f"{request.method} {getattr(route, 'path', request.url.path)}"

    def identify(request: Request, key: str | None) -> Caller:
        """The caller of a request (401, logged with the peer's address, if none)."""
        if not cfg.auth:
            return ANONYMOUS
        if key is not None:
            match = None
            for k, c in known:  # every comparison made: the time does not say which key
                if secrets.compare_digest(key.encode("utf-8", "surrogatepass"),
                                          k.encode("utf-8", "surrogatepass")):
                    match = match or c
            if match is not None:
                return match
        metrics.refused.labels("unauthenticated").inc()
        if failures is not None:  # logs the first refusal of a run, counts the others
            wait = failures.take(_host(request), _action(request) + " (invalid key)")
            if wait > 0:
                raise HTTPException(429, "too many requests with a missing or invalid API "
                                         "key from this address",
                                    headers={"Retry-After": retry_after(wait)})
        audit(_peer(request), _action(request), "-", "refused", "401: " + (
            "no API key" if key is None else "invalid API key"), level=logging.WARNING)
        raise HTTPException(401, "missing or invalid API key",
                            headers={"WWW-Authenticate": API_KEY_HEADER})

    def throttle(request: Request, caller: Caller, body_bytes: int = 0) -> None:
        if limiter is not None:
            wait = limiter.take(caller.key_id, _action(request),
                                limiter.limit.cost(body_bytes))
            if wait > 0:
                raise HTTPException(429, f"rate limit: this key is over "
                                         f"{limiter.limit.requests_per_s:g} requests/s",
                                    headers={"Retry-After": retry_after(wait)})

    class _Gate:
        """``app.state.access``: the callers of :func:`serving.access.require_controller`
        and :func:`serving.access.require_admin`."""

        def controller(self, request: Request, key: str | None, body_bytes: int = 0
                       ) -> Caller:
            caller = identify(request, key)
            throttle(request, caller, body_bytes)
            if caller.scraper:
                refuse_role(request, caller, "a metrics key may only read /v1/metrics",
                            "a metrics key")
            return caller

        def admin(self, request: Request, key: str | None, body_bytes: int = 0) -> Caller:
            caller = identify(request, key)
            # before the role check: refusals cost tokens too
            throttle(request, caller, body_bytes)
            if not caller.admin:
                refuse_role(request, caller, "policy swaps need an admin key",
                            "not an admin key")
            return caller

        def metrics(self, request: Request, key: str | None) -> Caller:
            caller = identify(request, key)
            throttle(request, caller)
            if not (caller.admin or caller.scraper):
                refuse_role(request, caller, "the metrics need an admin or metrics key",
                            "not an admin or metrics key")
            return caller

    def refuse_role(request: Request, caller: Caller, detail: str, logged: str) -> NoReturn:
        """403 with ``detail``, audited as ``403: <logged>``."""
        metrics.refused.labels("not_admin" if not caller.scraper else "metrics_key").inc()
        audit(caller.key_id, _action(request), "-", "refused", f"403: {logged}",
              level=logging.WARNING)
        raise HTTPException(403, detail)

    app.state.access = _Gate()
    controller, admin = require_controller, require_admin
    # exposed for app.dependency_overrides (tests, embedding behind another auth layer)
    app.state.require_controller, app.state.require_admin = controller, admin
    app.state.require_metrics = require_metrics

    def owned(what: str, session_id: str, owner: str | None, caller: Caller,
              action: str) -> None:
        """Another key's session is unknown to the caller (the same 404, logged), except
        for an admin key reading or deleting it (audited)."""
        if owner is None or owner == caller.owner:
            return
        target = f"{what} {session_id}"
        if caller.admin and action in ("read", "delete"):
            audit(caller.key_id, f"{what}.{action}", target, "ok",
                  "another key's session (admin)")
            return
        metrics.refused.labels("foreign_session").inc()
        audit(caller.key_id, f"{what}.{action}", target, "refused",
              "404: another key's session", level=logging.WARNING)
        raise HTTPException(404, f"unknown {what} {session_id!r}")

    def get_session(session_id: str, caller: Caller = ANONYMOUS,
                    action: str = "use") -> tuple[Session, Lease]:
        s = sessions.get(session_id)
        if s is None:
            raise HTTPException(404, f"unknown session {session_id!r}")
        owned("session", session_id, s.owner, caller, action)
        lease = leases[session_id]
        if (lease.idle_for(time.monotonic()) >= limits.idle_s
                and not lease.lock.locked()):  # due to expire: the sweep may lag
            drop(session_id, "expired")
            raise HTTPException(404, f"unknown session {session_id!r}")
        return s, lease

    async def run_on(lease: Lease, fn: Callable[[], _T], heavy: bool = False) -> _T:
        """``fn`` on a session, one request at a time: on a worker thread for a large
        session or a ``heavy`` request (the event loop keeps serving the others), else
        inline (cheaper than the hand-off)."""
        async with lease.lock:
            lease.touch()
            try:
                if heavy or lease.threaded:
                    async with slots.of(lease.owner):
                        return await asyncio.to_thread(fn)
                return fn()
            finally:
                lease.touch()


    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        if errors and all(e.get("type") == OUT_OF_RANGE for e in errors):
            # the schema allows it (no bound a JSON number states exactly), the server
            # cannot hold it: a conflict, not a schema violation
            return JSONResponse({"detail": json_safe([
                {k: e[k] for k in ("type", "loc", "msg", "input") if k in e}
                for e in errors])}, 409)
        # what it echoes is made encodable (serving.strictjson.json_safe): never a 500
        return JSONResponse({"detail": json_safe(jsonable_encoder(errors))}, 422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 405:  # name every method of the resource, not one route's
            methods = allowed_methods(app, request.scope["path"])
            if methods is not None:
                exc.headers = {**(exc.headers or {}), "Allow": ", ".join(methods)}
        return await http_exception_handler(request, exc)

    @app.exception_handler(BudgetExceeded)
    async def _over_budget(request: Request, exc: BudgetExceeded) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, 429)

    @app.exception_handler(SessionError)
    async def _session_error(request: Request, exc: SessionError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, 409)

    def policy_out(p: LoadedPolicy | None) -> PolicyOut:
        if p is None:
            return PolicyOut(loaded=False, version=0, hash=None, fallback=cfg.fallback)
        return PolicyOut(loaded=True, version=p.version, hash=p.hash, name=p.path.name,
                         loaded_at=p.loaded_at, origin=p.origin, scenario_signature=p.metadata.get(
                             "scenario_signature", {}),
                         observation=p.layout.to_dict(), decoding=p.decoding,
                         decision_order=p.order,
                         algorithm=p.metadata.get("extra", {}).get("algorithm"),
                         fallback=cfg.fallback)

    def session_out(sid: str, s: Session) -> SessionOut:
        why = s.compatibility(store.current())
        return SessionOut(session_id=sid, version=s.version, metrics=s.metrics(),
                          policy_compatible=why is None, reason=why, **s.snapshot())

    def decision_out(d: Decision) -> dict:
        metrics.decision(d.channel, d.source, d.reason)
        out = {"type": d.type_id, "channel": d.channel, "source": d.source,
               "reason": d.reason}
        if d.observation is not None:
            out["observation"] = np.asarray(d.observation, np.float64).tolist()
            out["scores"] = np.asarray(d.scores, np.float64).tolist()
        return out

    # ------------------------------------------------------------------ health and metrics
    @app.get("/v1/health/live", response_model=HealthOut, tags=["health"])
    async def live() -> HealthOut:
        return HealthOut(status="ok", policy_loaded=store.current() is not None,
                         sessions=len(sessions))

    @app.get("/v1/health/ready", response_model=HealthOut, tags=["health"],
             responses={503: {"model": HealthOut, "description": "No policy loaded"}})
    async def ready() -> HealthOut | JSONResponse:
        loaded = store.current() is not None
        ok = loaded or not cfg.require_policy
        body = HealthOut(status="ok" if ok else "unavailable", policy_loaded=loaded,
                         sessions=len(sessions))
        return body if ok else JSONResponse(body.model_dump(), 503)

    @app.get("/v1/metrics", tags=["health"], response_class=Response,
             dependencies=[Depends(require_metrics)],
             responses={200: {"content": {"text/plain": {}},
                              "description": "Prometheus text format"},
                        **error_responses(401), 403: {"model": ErrorOut, "description":
                                              "Not an admin or metrics key"}})
    async def prometheus() -> Response:
        metrics.sessions.set(len(sessions))
        metrics.session_bytes.set(budget.total)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------ policy
    @app.get("/v1/policy", response_model=PolicyOut, tags=["policy"],
             dependencies=[Depends(controller)], responses=error_responses(401))
    async def get_policy() -> PolicyOut:
        return policy_out(store.current())

    @app.get("/v1/policy/bundle", tags=["policy"], dependencies=[Depends(controller)],
             response_class=Response,
             responses={200: {"content": {"application/zip": {}},
                              "description": "The bundle's files (zip)"},
                        404: ERROR_RESPONSES[404] | {"description": "No policy loaded"},
                        401: ERROR_RESPONSES[401]})
    async def get_bundle() -> Response:
        p = store.current()
        if p is None:
            raise HTTPException(404, "no policy is loaded")
        raw = await asyncio.to_thread(bundle_zip, p.bundle)  # the verified bytes
        return Response(raw, media_type="application/zip",
                        headers={"X-Policy-Version": str(p.version),
                                 "X-Policy-Hash": p.hash})

    @app.put("/v1/policy", response_model=PolicyOut, tags=["policy"],
             responses=error_responses(400, 401, 409, 422) | {403: {"model": ErrorOut,
                                                       "description": "Not an admin key"}})
    async def swap_policy(body: PolicySwap, caller: AdminCaller) -> PolicyOut:
        try:
            p = await asyncio.to_thread(load, body.path, body.force, caller.owner, None,
                                        body.allow_rollback)
        except BundleError as e:
            audit(caller.key_id, "policy.load", body.path, "failed", f"409: {e}",
                  level=logging.WARNING)
            raise HTTPException(409, str(e)) from None
        audit(caller.key_id, "policy.load", body.path, "ok",
              f"version {p.version} hash {p.hash[:16]}" + (" (forced)" if body.force else "")
              + (" (rollback allowed)" if body.allow_rollback else ""))
        return policy_out(p)

    # ------------------------------------------------------------------ sessions
    def check_size(num_nodes: int, num_topics: int, num_types: int,
                   num_destinations: int) -> None:
        """422 naming the first of the session limits a request's counts exceed."""
        if num_nodes > limits.max_nodes:
            raise too_many(["nodes"], num_nodes, limits.max_nodes, "limits.max_nodes")
        if num_topics > limits.max_topics:
            raise HTTPException(422, [{"loc": ["body", "num_topics"], "type": "less_than_equal",
                                       "msg": f"at most {limits.max_topics} "
                                              f"(limits.max_topics), got {num_topics}"}])
        if num_types > cfg.max_types:
            raise too_many(["types"], num_types, cfg.max_types, "max_types")
        if num_destinations > limits.max_destinations:
            raise HTTPException(422, [{"loc": ["body", "types"], "type": "too_long",
                                       "msg": f"at most {limits.max_destinations} "
                                              f"destinations in all (limits.max_destinations)"
                                              f", got {num_destinations}"}])

    def session_bytes(s: Session, new_types: int = 0, new_destinations: int = 0) -> int:
        sp = s.spec
        return static_session_bytes(sp.num_nodes, sp.num_topics, s.catalog_size + new_types,
                                    s.num_destinations + new_destinations)

    @app.post("/v1/sessions", response_model=SessionCreated, status_code=201, tags=["sessions"],
              responses=error_responses(400, 401, 409, 413, 422) | {429: {"model": ErrorOut,
                                                        "description": "Too many sessions, or "
                                                        "over the memory budget"}})
    async def create_session(body: SessionCreate,
                             caller: ControllerCaller) -> SessionCreated:
        if len(sessions) >= cfg.max_sessions:
            raise HTTPException(429, f"session limit ({cfg.max_sessions}) reached")
        if sum(s.owner == caller.owner for s in sessions.values()) >= cfg.max_sessions_per_key:
            raise HTTPException(429, f"this key holds {cfg.max_sessions_per_key} sessions "
                                     f"(max_sessions_per_key): close one first")
        dests = sum(len(t.destinations) for t in body.types)
        check_size(len(body.nodes), body.num_topics, len(body.types), dests)
        _check_channels(body.types, body.num_topics)
        health = None if body.channel_health is None else body.channel_health.model_dump()
        lease = Lease(caller.owner)
        estimate = static_session_bytes(len(body.nodes), body.num_topics, len(body.types),
                                        dests)

        def build() -> Session:
            spec = SessionSpec(np.array([n.id for n in body.nodes], np.int64),
                               np.array([n.capacity_bps for n in body.nodes], np.int64),
                               body.controller.bandwidth_bps, body.controller.cpu,
                               body.num_topics, body.interval_s, dict(body.scenario_signature))
            s = Session(spec, seed=body.seed, owner=caller.owner)
            s.add_types((t.id, t.destinations) for t in body.types)
            s.update_rates({t.id: t.rate_bps for t in body.types if t.rate_bps is not None},
                           {t.id: t.messages for t in body.types if t.messages is not None})
            s.set_assignment({t.id: t.channel for t in body.types if t.channel is not None})
            if health is not None:
                s.set_health(health)
            return s

        with budget.building(lease, estimate):
            try:
                s = await run_on(lease, build, heavy=len(body.types) > THREADED_BATCH)
            except DSMDError as e:
                raise HTTPException(409, str(e)) from None
        sid = uuid.uuid4().hex
        sessions[sid], leases[sid] = s, lease
        why = s.compatibility(store.current())
        return SessionCreated(session_id=sid, version=s.version,
                              policy_compatible=why is None, reason=why)

    async def answer(lease: Lease, make: Callable[[], SessionOut]) -> Any:
        """The answer ``make`` builds: for a large session built and serialised on a worker
        thread (a 200,000-type snapshot takes the event loop for long otherwise)."""
        if not lease.threaded:
            return make()

        def render() -> Response:
            return Response(make().model_dump_json(), media_type="application/json")
        return await run_on(lease, render)

    @app.get("/v1/sessions/{session_id}", response_model=SessionOut, tags=["sessions"],
             responses=error_responses(401, 404))
    async def read_session(session_id: str,
                           caller: ControllerCaller) -> SessionOut:
        s, lease = get_session(session_id, caller, "read")
        lease.touch()
        out: SessionOut = await answer(lease, lambda: session_out(session_id, s))
        return out

    @app.patch("/v1/sessions/{session_id}", response_model=SessionOut, tags=["sessions"],
               responses=error_responses(400, 401, 404, 409, 413, 422) | {
                   429: {"model": ErrorOut, "description": "Over the memory budget"}})
    async def update_session(session_id: str, body: SessionUpdate,
                             caller: ControllerCaller) -> SessionOut:
        s, lease = get_session(session_id, caller, "update")
        if len(body.types) > cfg.max_types:
            raise too_many(["types"], len(body.types), cfg.max_types, "max_types")
        if s.catalog_size + len(body.types) > cfg.max_types:
            raise HTTPException(409, f"types: the session would exceed max_types "
                                     f"{cfg.max_types}")
        dests = sum(len(t.destinations) for t in body.types)
        if s.num_destinations + dests > limits.max_destinations:
            raise HTTPException(409, f"types: the session would hold "
                                     f"{s.num_destinations + dests} destinations, over "
                                     f"limits.max_destinations {limits.max_destinations}")
        _check_channels(body.types, s.spec.num_topics)
        health = None if body.channel_health is None else body.channel_health.model_dump()
        if health is not None:  # checked before anything changes
            try:
                s.check_health(health)
            except SessionError as e:
                raise HTTPException(409, [{"loc": ["body", "channel_health"], "msg": str(e),
                                           "type": "value_error"}]) from None
        before = lease.charged
        budget.charge(lease, max(before, session_bytes(s, len(body.types), dests)))

        def update() -> None:
            if body.types or health is None:  # a health-only update leaves the rest alone
                s.add_types((t.id, t.destinations) for t in body.types)
                s.update_rates({t.id: t.rate_bps for t in body.types
                                if t.rate_bps is not None},
                               {t.id: t.messages for t in body.types if t.messages is not None})
                s.set_assignment({t.id: t.channel for t in body.types
                                  if t.channel is not None})

        try:
            await run_on(lease, update, heavy=len(body.types) > THREADED_BATCH)
        finally:  # what the session holds now (all or nothing: unchanged on an error)
            budget.charge(lease, max(before, session_bytes(s)))
        if health is not None:
            changed = health != s.health
            s.set_health(health)
            if changed and app.state.announcer is not None:
                app.state.announcer.health(session_id, health)
        out: SessionOut = await answer(lease, lambda: session_out(session_id, s))
        return out

    @app.get("/v1/sessions/{session_id}/health", response_model=SessionHealthOut,
             tags=["sessions"], responses=error_responses(401, 404))
    async def read_session_health(session_id: str,
                                  caller: ControllerCaller) -> SessionHealthOut:
        s, lease = get_session(session_id, caller, "read")
        lease.touch()
        return SessionHealthOut(session_id=session_id, version=s.version,
                                channel_health=None if s.health is None
                                else ChannelHealth(**s.health))

    @app.delete("/v1/sessions/{session_id}", status_code=204, tags=["sessions"],
                responses=error_responses(401, 404))
    async def delete_session(session_id: str,
                             caller: ControllerCaller) -> Response:
        get_session(session_id, caller, "delete")
        drop(session_id, "deleted")
        return Response(status_code=204)

    @app.post("/v1/sessions/{session_id}/rates", response_model=RateUpdated, tags=["sessions"],
              responses=error_responses(400, 401, 404, 409, 413, 422))
    async def update_rates(session_id: str, body: RateUpdate,
                           caller: ControllerCaller) -> RateUpdated:
        s, lease = get_session(session_id, caller, "rates")
        if len(body.rates) > cfg.max_types:
            raise too_many(["rates"], len(body.rates), cfg.max_types, "max_types")

        def update() -> RateUpdated:
            s.update_rates({r.type: r.rate_bps for r in body.rates},
                           {r.type: r.messages for r in body.rates if r.messages is not None},
                           replace=body.replace)
            return RateUpdated(version=s.version, active_types=int(s.active.size))
        return await run_on(lease, update, heavy=len(body.rates) > THREADED_BATCH)

    # ------------------------------------------------------------------ decisions
    @app.post("/v1/sessions/{session_id}/decide", response_model=DecisionSingleOut,
              tags=["decisions"],
              responses=error_responses(400, 401, 404, 409, 413, 422))
    async def decide(session_id: str, body: DecideRequest,
                     caller: ControllerCaller) -> dict[str, Any]:
        s, lease = get_session(session_id, caller, "decide")
        p = store.current()  # one version for the whole request

        def one() -> dict[str, Any]:
            (d,) = s.decide([body.type], p, fallback=cfg.fallback, explain=body.explain)
            return decision_out(d) | _versions(p, s)
        return await run_on(lease, one)

    @app.post("/v1/sessions/{session_id}/decide/batch", response_model=DecisionBatchOut,
              tags=["decisions"],
              responses=error_responses(400, 401, 404, 409, 413, 422))
    async def decide_batch(session_id: str, body: DecideBatchRequest,
                           caller: ControllerCaller) -> dict[str, Any]:
        s, lease = get_session(session_id, caller, "decide")
        if body.types is not None and len(body.types) > cfg.max_batch:
            raise too_many(["types"], len(body.types), cfg.max_batch, "max_batch")
        n = len(body.types) if body.types is not None else int(s.active.size)
        if body.types is None and n > cfg.max_batch:
            raise HTTPException(409, f"types: the session's {n} active types "
                                     f"exceed max_batch {cfg.max_batch}: list the types")
        cells = n * (s.spec.num_topics + 1)
        if body.parallel and cells > limits.max_batch_cells:
            raise HTTPException(409, f"types: a parallel batch of {n} types scores {cells} "
                                     f"channels, over limits.max_batch_cells "
                                     f"{limits.max_batch_cells}: split it or decide it "
                                     f"sequentially")
        p = store.current()

        def batch() -> dict[str, Any]:
            ds = s.decide(body.types, p, fallback=cfg.fallback, replan=body.replan,
                          explain=body.explain, parallel=body.parallel)
            return {"decisions": [decision_out(d) for d in ds]} | _versions(p, s)
        return await run_on(lease, batch, heavy=n > THREADED_BATCH)

    def _versions(p: LoadedPolicy | None, s: Session) -> dict[str, Any]:
        return {"policy_version": p.version if p is not None else 0,
                "policy_hash": p.hash if p is not None else None,
                "session_version": s.version}

    add_online_routes(app, store=online_store, load=load_online, controller=controller, admin=admin,
                      owned=owned, max_sessions=cfg.max_sessions,
                      max_sessions_per_key=cfg.max_sessions_per_key, max_batch=cfg.max_batch,
                      limits=limits, budget=budget, sweepers=sweepers, slots=slots)
    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        fresh = app.openapi_schema is None
        schema = base_openapi()
        if not fresh:
            return schema
        return document_contract(schema, limiter is not None, {
            ("SessionCreate", "types"): cfg.max_types, ("SessionUpdate", "types"): cfg.max_types,
            ("SessionCreate", "nodes"): limits.max_nodes,
            ("OnlineSessionCreate", "nodes"): limits.max_nodes,
            ("RateUpdate", "rates"): cfg.max_types,
            ("DecideBatchRequest", "types"): cfg.max_batch,
            ("MessagesIn", "messages"): cfg.max_batch})

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(AllowMiddleware, api=app)
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
