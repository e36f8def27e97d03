"""What one policy server holds and does between its endpoints: :class:`PolicyServer`.

The routers (:mod:`serving.api.health`, :mod:`serving.api.policy`,
:mod:`serving.api.sessions`, :mod:`serving.api.online`) take it as a dependency
(:data:`ServerDep`, ``app.state.server``): the policy stores, the session tables with their
leases, memory budget and expiry, the key check and rate limits (it is also the app's
``app.state.access``, :class:`serving.access.Gate`), the metrics, the model registry and the
announcer.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

from fastapi import Depends, FastAPI, HTTPException, Request

from envs.dsmd import kernels, online_greedy

from ..access import (
    ANONYMOUS,
    API_KEY_HEADER,
    Caller,
    RateLimiter,
    audit,
    caller_for,
    retry_after,
)
from ..announce import Announcer
from ..bundles.registry import (
    ModelRegistry,
    RegistryRef,
    RegistryWatcher,
    ResolvedVersion,
    is_registry_uri,
)
from ..limits import WORKER_THREADS, KeySlots, Lease, MemoryBudget
from ..metrics import ServerMetrics
from ..policy_store import (
    BundleError,
    BundleWatcher,
    LoadedOnlinePolicy,
    LoadedPolicy,
    OnlinePolicyStore,
    PolicyStore,
)
from ..session import Session
from .settings import ServerSettings

if TYPE_CHECKING:
    from .online import OnlineEntry

__all__ = ["PolicyServer", "ServerDep", "get_server"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class PolicyServer:
    """The state and the shared steps of one server (module docstring). ``store`` given
    keeps its own trust; otherwise both stores trust ``settings.trust()``."""

    def __init__(self, settings: ServerSettings, store: PolicyStore | None = None) -> None:
        cfg = self.cfg = settings
        trust = cfg.trust()
        self.store = store or PolicyStore(batch_threads=cfg.batch_threads, trust=trust)
        self.online_store = OnlinePolicyStore(trust=trust)
        self.metrics = metrics = ServerMetrics()
        self.limits = cfg.limits
        self.sessions: dict[str, Session] = {}
        self.leases: dict[str, Lease] = {}  # session id -> its account (serving.limits)
        self.online_sessions: dict[str, OnlineEntry] = {}
        self.budget = MemoryBudget(self.limits, on_refused=lambda which: metrics.refused.labels(
            f"memory_budget_{which}").inc())
        self.slots = KeySlots()  # worker threads per key
        self.announcer: Announcer | None = None  # while started with announce_url
        self.watcher: BundleWatcher | None = None
        self.registry_watchers: list[RegistryWatcher] = []
        self._registry: ModelRegistry | None = None  # on first use: MLflow loads only then
        # every configured key and its caller (admin keys first: a key in both is admin)
        self.known = [(k, caller_for(k, True)) for k in cfg.admin_keys] + [
            (k, caller_for(k, False)) for k in cfg.api_keys if k not in cfg.admin_keys] + [
            (k, caller_for(k, False, scraper=True)) for k in cfg.metrics_keys
            if k not in cfg.admin_keys and k not in cfg.api_keys]
        self.limiter = (RateLimiter(cfg.rate_limit, on_refused=self._rate_limited)
                        if cfg.auth and cfg.rate_limit is not None else None)
        # requests with a missing or invalid key, per client address (bounded: at most
        # max_keys addresses are tracked, the idle ones dropped first)
        self.failures = (RateLimiter(cfg.auth_failures, max_keys=10_000,
                                     on_refused=lambda who: metrics.refused.labels(
                                         "auth_throttled").inc())
                         if cfg.auth and cfg.auth_failures is not None else None)

    # ------------------------------------------------------------------ policies
    def check_for(self, owner: str | None) -> Callable[[LoadedPolicy], list[str]]:
        """The sessions a candidate policy does not fit, for a refusal's message: every one
        when ``owner`` is None (the server's own loads, logged), else only the caller's own
        by id and the others as a count (a refusal names no other key's session)."""
        def check(cand: LoadedPolicy) -> list[str]:
            mine, others = [], 0
            for sid, s in list(self.sessions.items()):  # read on a worker thread: a copy
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

    def registry(self) -> ModelRegistry:
        if self._registry is None:
            self._registry = ModelRegistry(self.cfg.registry_uri, self.cfg.registry_cache_dir)
        return self._registry

    def materialize(self, path: str, origin: str | None) -> tuple[str, str | None]:
        """``(path, origin)`` of a bundle setting: a directory as it is, a ``models:/`` path
        as its registry version's local copy (downloaded first) and that version's name."""
        if not is_registry_uri(path):
            return path, origin
        local, rv = self.registry().fetch(path)
        return str(local), rv.origin

    def load(self, path: str, force: bool = False, owner: str | None = None,
             origin: str | None = None, allow_rollback: bool = False) -> LoadedPolicy:
        """Install the bundle at ``path``, or the registry version a ``models:/`` path
        names (downloaded first; ``origin`` set)."""
        try:
            path, origin = self.materialize(path, origin)
            p = self.store.load(path, self.check_for(owner), force, origin=origin,
                                allow_rollback=allow_rollback)
        except BundleError:
            self.metrics.swaps.labels("refused").inc()
            raise
        self.metrics.swaps.labels("loaded").inc()
        self.metrics.policy_version.set(p.version)
        return p

    def load_online(self, path: str, origin: str | None = None, allow_rollback: bool = False
                    ) -> LoadedOnlinePolicy:
        """Install the online bundle at ``path`` or of a ``models:/`` path (as :meth:`load`)."""
        where, named = self.materialize(path, origin)
        return self.online_store.load(where, origin=named, allow_rollback=allow_rollback)

    def follow(self, uri: str, what: str, install: Callable[[Path, ResolvedVersion], Any]
               ) -> RegistryWatcher:
        """The first load of a ``models:/`` bundle setting, and its alias followed."""
        w = RegistryWatcher(self.registry(), RegistryRef.parse(uri), install,
                            self.cfg.watch_period_s, what)
        if w.poll() is None:
            log.error("no %s loaded: %s", what, w.errors[-1] if w.errors else uri)
        return w

    # ------------------------------------------------------------------ life
    async def run(self, app: FastAPI) -> AsyncIterator[None]:
        """The app's lifespan: the announcer, the worker threads, the compiled loops, the
        bundles of the settings (and their watchers), the expiry sweep; all stopped after."""
        cfg, store, online_store = self.cfg, self.store, self.online_store
        if cfg.announce_url is not None:  # before the first load, which it announces
            self.announcer = Announcer(cfg.announce_url, cfg.announce_topic,
                                       send_timeout_s=cfg.announce_send_timeout_s,
                                       registry=self.metrics.registry, security=cfg.security)
            app.state.announcer = self.announcer
            store.add_listener(self.announcer.policy)
            online_store.add_listener(self.announcer.online_policy)
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
                self.follow, str(cfg.bundle), "policy",
                lambda path, rv: self.load(str(path), origin=rv.origin)))
        elif cfg.bundle:
            try:
                self.load(cfg.bundle)
            except BundleError as e:  # start anyway: heuristic decisions, not ready if required
                log.error("no policy loaded: %s", e)
            if cfg.watch:
                self.watcher = BundleWatcher(store, cfg.bundle, cfg.watch_period_s,
                                             self.check_for(None)).start()
        if is_registry_uri(cfg.online_bundle):
            followers.append(await asyncio.to_thread(
                self.follow, str(cfg.online_bundle), "online policy",
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
        self.registry_watchers = followers
        app.state.watcher, app.state.registry_watchers = self.watcher, followers
        sweeper = asyncio.create_task(self._sweep_forever())
        if cfg.freeze_gc:
            gc.collect()  # garbage first: only what is alive is frozen
            gc.freeze()
        yield
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        if self.watcher is not None:
            self.watcher.stop()
        for f in followers:
            await asyncio.to_thread(f.stop)
        if self.announcer is not None:
            store.remove_listener(self.announcer.policy)
            online_store.remove_listener(self.announcer.online_policy)
            await asyncio.to_thread(self.announcer.close)
            self.announcer = app.state.announcer = None

    async def _sweep_forever(self) -> None:
        period = min(60.0, max(0.05, self.limits.idle_s / 4))
        while True:
            await asyncio.sleep(period)
            self.sweep()

    # ------------------------------------------------------------------ session tables
    def sweep(self, now: float | None = None) -> int:
        """Expire every session, static or online, unused for ``limits.idle_s`` (a busy
        one is skipped); how many."""
        t = time.monotonic() if now is None else now
        return self._expire_static(t) + self.expire_online(t)

    def _expire_static(self, now: float) -> int:
        gone = [sid for sid, lease in list(self.leases.items())
                if lease.idle_for(now) >= self.limits.idle_s and not lease.lock.locked()]
        for sid in gone:
            self.drop(sid, "expired")
        return len(gone)

    def drop(self, sid: str, why: str) -> None:
        """Forget static session ``sid`` and release its memory charge."""
        self.sessions.pop(sid, None)
        lease = self.leases.pop(sid, None)
        if lease is not None:
            self.budget.release(lease)
        if why == "expired":
            self.metrics.expired.labels("session").inc()
            log.info("session %s expired after %.0f s unused (limits.idle_s)", sid,
                     self.limits.idle_s)

    def drop_online(self, session_id: str) -> OnlineEntry | None:
        """Forget online session ``session_id`` and release its memory charge."""
        e = self.online_sessions.pop(session_id, None)
        if e is not None and e.lease is not None:
            self.budget.release(e.lease)
        return e

    def expire_online(self, now: float) -> int:
        gone = [sid for sid, e in list(self.online_sessions.items())
                if e.lease is not None and e.lease.idle_for(now) >= self.limits.idle_s
                and not e.lock.locked()]
        for sid in gone:
            self.drop_online(sid)
            log.info("online session %s expired after %.0f s unused (limits.idle_s)", sid,
                     self.limits.idle_s)
            self.metrics.expired.labels("online").inc()
        return len(gone)

    def owned(self, what: str, session_id: str, owner: str | None, caller: Caller,
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
        self.metrics.refused.labels("foreign_session").inc()
        audit(caller.key_id, f"{what}.{action}", target, "refused",
              "404: another key's session", level=logging.WARNING)
        raise HTTPException(404, f"unknown {what} {session_id!r}")

    def session(self, session_id: str, caller: Caller = ANONYMOUS,
                action: str = "use") -> tuple[Session, Lease]:
        """The caller's static session ``session_id`` and its lease (404 otherwise)."""
        s = self.sessions.get(session_id)
        if s is None:
            raise HTTPException(404, f"unknown session {session_id!r}")
        self.owned("session", session_id, s.owner, caller, action)
        lease = self.leases[session_id]
        if (lease.idle_for(time.monotonic()) >= self.limits.idle_s
                and not lease.lock.locked()):  # due to expire: the sweep may lag
            self.drop(session_id, "expired")
            raise HTTPException(404, f"unknown session {session_id!r}")
        return s, lease

    async def run_on(self, lease: Lease, fn: Callable[[], _T], heavy: bool = False) -> _T:
        """``fn`` on a session, one request at a time: on a worker thread for a large
        session or a ``heavy`` request (the event loop keeps serving the others), else
        inline (cheaper than the hand-off)."""
        async with lease.lock:
            lease.touch()
            try:
                if heavy or lease.threaded:
                    async with self.slots.of(lease.owner):
                        return await asyncio.to_thread(fn)
                return fn()
            finally:
                lease.touch()

    # ------------------------------------------------------------------ access
    def _rate_limited(self, who: str) -> None:
        self.metrics.rate_limited.labels(who).inc()
        self.metrics.refused.labels("rate_limit").inc()

    def identify(self, request: Request, key: str | None) -> Caller:
        """The caller of a request (401, logged with the peer's address, if none)."""
        if not self.cfg.auth:
            return ANONYMOUS
        if key is not None:
            match = None
            for k, c in self.known:  # every comparison made: the time does not say which
                if secrets.compare_digest(key.encode("utf-8", "surrogatepass"),
                                          k.encode("utf-8", "surrogatepass")):
                    match = match or c
            if match is not None:
                return match
        self.metrics.refused.labels("unauthenticated").inc()
        if self.failures is not None:  # logs the first refusal of a run, counts the others
            wait = self.failures.take(_host(request), _action(request) + " (invalid key)")
            if wait > 0:
                raise HTTPException(429, "too many requests with a missing or invalid API "
                                         "key from this address",
                                    headers={"Retry-After": retry_after(wait)})
        audit(_peer(request), _action(request), "-", "refused", "401: " + (
            "no API key" if key is None else "invalid API key"), level=logging.WARNING)
        raise HTTPException(401, "missing or invalid API key",
                            headers={"WWW-Authenticate": API_KEY_HEADER})

    def throttle(self, request: Request, caller: Caller, body_bytes: int = 0) -> None:
        limiter = self.limiter
        if limiter is not None:
            wait = limiter.take(caller.key_id, _action(request),
                                limiter.limit.cost(body_bytes))
            if wait > 0:
                raise HTTPException(429, f"rate limit: this key is over "
                                         f"{limiter.limit.requests_per_s:g} requests/s",
                                    headers={"Retry-After": retry_after(wait)})

    def refuse_role(self, request: Request, caller: Caller, detail: str,
                    logged: str) -> NoReturn:
        """403 with ``detail``, audited as ``403: <logged>``."""
        self.metrics.refused.labels("not_admin" if not caller.scraper else "metrics_key").inc()
        audit(caller.key_id, _action(request), "-", "refused", f"403: {logged}",
              level=logging.WARNING)
        raise HTTPException(403, detail)

    # serving.access.Gate: the callers of require_controller, require_admin, require_metrics
    def controller(self, request: Request, key: str | None, body_bytes: int = 0) -> Caller:
        caller = self.identify(request, key)
        self.throttle(request, caller, body_bytes)
        if caller.scraper:
            self.refuse_role(request, caller, "a metrics key may only read /v1/metrics",
                             "a metrics key")
        return caller

    def admin(self, request: Request, key: str | None, body_bytes: int = 0) -> Caller:
        caller = self.identify(request, key)
        self.throttle(request, caller, body_bytes)  # before the role check: refusals cost too
        if not caller.admin:
            self.refuse_role(request, caller, "policy swaps need an admin key",
                             "not an admin key")
        return caller

    def metrics_reader(self, request: Request, key: str | None) -> Caller:
        caller = self.identify(request, key)
        self.throttle(request, caller)
        if not (caller.admin or caller.scraper):
            self.refuse_role(request, caller, "the metrics need an admin or metrics key",
                             "not an admin or metrics key")
        return caller


def _peer(request: Request) -> str:
    c = request.client
    return f"{c.host}:{c.port}" if c is not None else "unknown-peer"


def _host(request: Request) -> str:
    c = request.client
    return c.host if c is not None else "unknown-peer"


def _action(request: Request) -> str:
    route = request.scope.get("route")
    return f"{request.method} {getattr(route, 'path', request.url.path)}"


async def get_server(request: Request) -> PolicyServer:
    """The dependency of every endpoint: the app's :class:`PolicyServer`."""
    server: PolicyServer = request.app.state.server
    return server


#: an endpoint parameter: the app's server
ServerDep = Annotated[PolicyServer, Depends(get_server)]
