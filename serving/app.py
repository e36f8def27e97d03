"""The policy server (FastAPI): controller sessions, rate updates and decisions under ``/v1``.

A controller opens a session once (nodes and s(n), C_b, C_p, K, its message types), then
streams rate estimates and asks for channels, one type or a batch; the server keeps each
session's assignment and resources (:class:`serving.session.Session`) and decides with the
loaded policy bundle (ONNX Runtime) or, when no usable policy is there, the configured
heuristic, saying so in the response.

Failures, as a client sees them: 401 (no or wrong ``X-API-Key``), 403 (a policy swap without
an admin key), 404 (unknown session), 409 (a request that contradicts the session's state, or
a bundle refused on swap; the message names the type, field or session), 413 (body larger
than ``max_body_bytes`` or a batch over ``max_batch``), 422 (validation: ``detail`` lists each
field's location and problem), 429 (``max_sessions`` reached). No failed request changes
any state.

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
import gc
import io
import logging
import secrets
import uuid
import zipfile
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import Depends, FastAPI, HTTPException, Request, Response, Security
from fastapi.responses import JSONResponse
from fastapi.security import APIKeyHeader
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from envs.dsmd import kernels
from envs.dsmd.errors import DSMDError

from .announce import DEFAULT_TOPIC, Announcer, check_settings
from .metrics import MetricsMiddleware, ServerMetrics
from .online_api import add_online_routes
from .online_policy import OnlinePolicyStore
from .policy_store import BundleError, BundleWatcher, LoadedPolicy, PolicyStore
from .schemas import (
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
)
from .session import FALLBACKS, Decision, Session, SessionError, SessionSpec

__all__ = ["ServerSettings", "create_app"]

log = logging.getLogger(__name__)
API_KEY_HEADER = "X-API-Key"


@dataclass
class ServerSettings:
    """Everything the server is configured with (``configs/serve.yaml``)."""

    bundle: str | None = None  # policy bundle directory loaded at start (None: heuristic)
    #: online policy bundle (serving.online_bundle) loaded at start; None: none until a
    #: PUT /v1/online/policy (serving/online_api.py)
    online_bundle: str | None = None
    api_keys: list[str] = field(default_factory=list)  # controllers' keys
    admin_keys: list[str] = field(default_factory=list)  # may swap the policy over the API
    auth: bool = True  # False only for local experiments
    fallback: str = "greedy"  # heuristic when no usable policy: greedy | rpc
    max_body_bytes: int = 4 * 1024 * 1024
    max_batch: int = 20_000
    max_sessions: int = 1_000
    max_types: int = 200_000  # per session
    watch: bool = False  # reload the bundle when its files change
    watch_period_s: float = 2.0
    require_policy: bool = False  # readiness needs a loaded policy
    #: after start-up, move every object alive then out of the garbage collector's reach
    #: (``gc.freeze``): a full collection would otherwise walk the libraries' ~150,000
    #: objects (tens of milliseconds), a stall that queues every request arriving meanwhile
    freeze_gc: bool = True
    #: threads that score one batch's chunks (``serving.bundle.load_bundle``); None: the cores
    #: this process may use, at most 4
    batch_threads: int | None = None
    #: Pulsar service URL of the announcement topic (``announce.url``; None: no
    #: announcements, the adapters poll); the ``pulsar-client`` package is then required
    announce_url: str | None = None
    announce_topic: str = DEFAULT_TOPIC  # ``announce.topic``
    announce_send_timeout_s: float = 2.0  # an announcement not confirmed by then: failed

    def __post_init__(self) -> None:
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        if self.auth and not self.api_keys:
            raise ValueError("auth is on but no api_keys are configured (set serve.api_keys, "
                             "e.g. SMART_API_KEYS=key1,key2, or auth=false for local use)")
        for k in ("max_body_bytes", "max_batch", "max_sessions", "max_types"):
            if getattr(self, k) <= 0:
                raise ValueError(f"{k} must be positive")
        if self.batch_threads is not None and self.batch_threads < 1:
            raise ValueError(f"batch_threads must be at least 1 (or null), got "
                             f"{self.batch_threads}")
        check_settings(self.announce_url, self.announce_topic)
        if not self.announce_send_timeout_s > 0:
            raise ValueError(f"announce.send_timeout_s must be positive, got "
                             f"{self.announce_send_timeout_s}")


_ERRORS = {400: {"model": ErrorOut, "description": "Body is not parseable (not JSON)"},
           401: {"model": ErrorOut, "description": "Missing or invalid API key"},
           404: {"model": ErrorOut, "description": "Unknown session"},
           409: {"model": ErrorOut, "description": "Conflicts with the session's state"},
           413: {"model": ErrorOut, "description": "Body or batch too large"},
           422: {"model": ErrorOut, "description": "Validation error (field and problem)"}}


def _errors(*codes: int) -> dict:
    return {c: _ERRORS[c] for c in codes}


class BodyLimit:
    """Pure ASGI: 413 for a body over ``limit`` bytes (declared or streamed)."""

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
        seen = 0

        async def _receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge()
            return msg

        try:
            await self.app(scope, _receive, send)
        except _TooLarge:
            await self._reject(scope, receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        resp = JSONResponse({"detail": f"request body larger than {self.limit} bytes"}, 413)
        await resp(scope, receive, send)


class _TooLarge(Exception):
    pass


def _check_channels(types: Iterable[TypeIn], num_topics: int) -> None:
    for i, t in enumerate(types):
        if t.channel is not None and t.channel > num_topics:
            raise HTTPException(422, [{"loc": ["body", "types", i, "channel"],
                                       "msg": f"channel {t.channel} > num_topics {num_topics}",
                                       "type": "value_error"}])


def create_app(settings: ServerSettings | None = None, *,
               store: PolicyStore | None = None) -> FastAPI:
    """The app; its lifespan loads ``settings.bundle`` (if any) and starts the watcher."""
    cfg = settings or ServerSettings(auth=False)
    store = store or PolicyStore(batch_threads=cfg.batch_threads)
    online_store = OnlinePolicyStore()
    metrics = ServerMetrics()
    sessions: dict[str, Session] = {}

    def check(cand: LoadedPolicy) -> list[str]:
        return [f"session {sid}: {why}" for sid, s in sessions.items()
                if (why := s.compatibility(cand)) is not None]

    def load(path: str, force: bool = False) -> LoadedPolicy:
        try:
            p = store.load(path, check, force)
        except BundleError:
            metrics.swaps.labels("refused").inc()
            raise
        metrics.swaps.labels("loaded").inc()
        metrics.policy_version.set(p.version)
        return p

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watcher = None
        if cfg.announce_url is not None:  # before the first load, which it announces
            announcer = Announcer(cfg.announce_url, cfg.announce_topic,
                                  send_timeout_s=cfg.announce_send_timeout_s,
                                  registry=metrics.registry)
            app.state.announcer = announcer
            store.add_listener(announcer.policy)
        # the simulator's compiled loops (loaded from their on-disk cache, or compiled on a
        # fresh install) before the first request, not inside it
        await asyncio.to_thread(kernels.warm_up)
        if cfg.bundle:
            try:
                load(cfg.bundle)
            except BundleError as e:  # start anyway: heuristic decisions, not ready if required
                log.error("no policy loaded: %s", e)
            if cfg.watch:
                watcher = BundleWatcher(store, cfg.bundle, cfg.watch_period_s, check).start()
        if cfg.online_bundle:
            try:
                await asyncio.to_thread(online_store.load, cfg.online_bundle)
            except BundleError as e:  # start anyway: online plans refused until a swap
                log.error("no online policy loaded: %s", e)
        app.state.watcher = watcher
        if cfg.freeze_gc:
            gc.collect()  # garbage first: only what is alive is frozen
            gc.freeze()
        yield
        if watcher is not None:
            watcher.stop()
        if app.state.announcer is not None:
            store.remove_listener(app.state.announcer.policy)
            await asyncio.to_thread(app.state.announcer.close)
            app.state.announcer = None

    app = FastAPI(title="SMART DSMD policy server", version="1.0.0", lifespan=lifespan,
                  description=__doc__)
    app.state.settings, app.state.store, app.state.sessions = cfg, store, sessions
    app.state.metrics = metrics
    app.state.announcer = None  # an Announcer while started with announce_url

    api_key = APIKeyHeader(name=API_KEY_HEADER, auto_error=False,
                           description="A controller's API key")

    def _valid(key: str | None, keys: list[str]) -> bool:
        return key is not None and any(secrets.compare_digest(key, k) for k in keys)

    async def controller(key: str | None = Security(api_key)) -> None:
        if cfg.auth and not _valid(key, cfg.api_keys + cfg.admin_keys):
            raise HTTPException(401, "missing or invalid API key",
                                headers={"WWW-Authenticate": API_KEY_HEADER})

    async def admin(key: str | None = Security(api_key)) -> None:
        if cfg.auth and not _valid(key, cfg.admin_keys):
            if _valid(key, cfg.api_keys):
                raise HTTPException(403, "policy swaps need an admin key")
            raise HTTPException(401, "missing or invalid API key",
                                headers={"WWW-Authenticate": API_KEY_HEADER})

    # exposed for app.dependency_overrides (tests, embedding behind another auth layer)
    app.state.require_controller, app.state.require_admin = controller, admin

    def get_session(session_id: str) -> Session:
        s = sessions.get(session_id)
        if s is None:
            raise HTTPException(404, f"unknown session {session_id!r}")
        return s

    @app.exception_handler(SessionError)
    async def _session_error(request: Request, exc: SessionError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, 409)

    def policy_out(p: LoadedPolicy | None) -> PolicyOut:
        if p is None:
            return PolicyOut(loaded=False, version=0, hash=None, fallback=cfg.fallback)
        return PolicyOut(loaded=True, version=p.version, hash=p.hash, path=str(p.path),
                         loaded_at=p.loaded_at, scenario_signature=p.metadata.get(
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
             responses={200: {"content": {"text/plain": {}},
                              "description": "Prometheus text format"}})
    async def prometheus() -> Response:
        metrics.sessions.set(len(sessions))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------ policy
    @app.get("/v1/policy", response_model=PolicyOut, tags=["policy"],
             dependencies=[Depends(controller)], responses=_errors(401))
    async def get_policy() -> PolicyOut:
        return policy_out(store.current())

    @app.get("/v1/policy/bundle", tags=["policy"], dependencies=[Depends(controller)],
             response_class=Response,
             responses={200: {"content": {"application/zip": {}},
                              "description": "The bundle's files (zip)"},
                        404: _ERRORS[404] | {"description": "No policy loaded"},
                        401: _ERRORS[401]})
    async def get_bundle() -> Response:
        p = store.current()
        if p is None:
            raise HTTPException(404, "no policy is loaded")
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
            for name in p.bundle.files:
                z.write(p.path / name, name)
        return Response(buf.getvalue(), media_type="application/zip",
                        headers={"X-Policy-Version": str(p.version),
                                 "X-Policy-Hash": p.hash})

    @app.put("/v1/policy", response_model=PolicyOut, tags=["policy"],
             dependencies=[Depends(admin)],
             responses=_errors(400, 401, 409, 422) | {403: {"model": ErrorOut,
                                                       "description": "Not an admin key"}})
    async def swap_policy(body: PolicySwap) -> PolicyOut:
        try:
            p = await asyncio.to_thread(load, body.path, body.force)
        except BundleError as e:
            raise HTTPException(409, str(e)) from None
        return policy_out(p)

    # ------------------------------------------------------------------ sessions
    @app.post("/v1/sessions", response_model=SessionCreated, status_code=201, tags=["sessions"],
              dependencies=[Depends(controller)],
              responses=_errors(400, 401, 413, 422) | {429: {"model": ErrorOut,
                                                        "description": "Too many sessions"}})
    async def create_session(body: SessionCreate) -> SessionCreated:
        if len(sessions) >= cfg.max_sessions:
            raise HTTPException(429, f"session limit ({cfg.max_sessions}) reached")
        if len(body.types) > cfg.max_types:
            raise HTTPException(413, f"types: {len(body.types)} > max_types {cfg.max_types}")
        _check_channels(body.types, body.num_topics)
        health = None if body.channel_health is None else body.channel_health.model_dump()
        try:
            spec = SessionSpec(np.array([n.id for n in body.nodes], np.int64),
                               np.array([n.capacity_bps for n in body.nodes], np.int64),
                               body.controller.bandwidth_bps, body.controller.cpu,
                               body.num_topics, body.interval_s, dict(body.scenario_signature))
            s = Session(spec, seed=body.seed)
            s.add_types((t.id, t.destinations) for t in body.types)
            s.update_rates({t.id: t.rate_bps for t in body.types if t.rate_bps is not None},
                           {t.id: t.messages for t in body.types if t.messages is not None})
            s.set_assignment({t.id: t.channel for t in body.types if t.channel is not None})
            if health is not None:
                s.set_health(health)
        except DSMDError as e:
            raise HTTPException(422, str(e)) from None
        sid = uuid.uuid4().hex
        sessions[sid] = s
        why = s.compatibility(store.current())
        return SessionCreated(session_id=sid, version=s.version,
                              policy_compatible=why is None, reason=why)

    @app.get("/v1/sessions/{session_id}", response_model=SessionOut, tags=["sessions"],
             dependencies=[Depends(controller)], responses=_errors(401, 404))
    async def read_session(session_id: str) -> SessionOut:
        return session_out(session_id, get_session(session_id))

    @app.patch("/v1/sessions/{session_id}", response_model=SessionOut, tags=["sessions"],
               dependencies=[Depends(controller)], responses=_errors(400, 401, 404, 409, 413, 422))
    async def update_session(session_id: str, body: SessionUpdate) -> SessionOut:
        s = get_session(session_id)
        if s.catalog_size + len(body.types) > cfg.max_types:
            raise HTTPException(413, f"types: the session would exceed max_types "
                                     f"{cfg.max_types}")
        _check_channels(body.types, s.spec.num_topics)
        health = None if body.channel_health is None else body.channel_health.model_dump()
        if health is not None:  # checked before anything changes
            try:
                s.check_health(health)
            except SessionError as e:
                raise HTTPException(422, [{"loc": ["body", "channel_health"], "msg": str(e),
                                           "type": "value_error"}]) from None
        if body.types or health is None:  # a health-only update leaves the rest alone
            s.add_types((t.id, t.destinations) for t in body.types)
            s.update_rates({t.id: t.rate_bps for t in body.types if t.rate_bps is not None},
                           {t.id: t.messages for t in body.types if t.messages is not None})
            s.set_assignment({t.id: t.channel for t in body.types if t.channel is not None})
        if health is not None:
            changed = health != s.health
            s.set_health(health)
            if changed and app.state.announcer is not None:
                app.state.announcer.health(session_id, health)
        return session_out(session_id, s)

    @app.get("/v1/sessions/{session_id}/health", response_model=SessionHealthOut,
             tags=["sessions"], dependencies=[Depends(controller)], responses=_errors(401, 404))
    async def read_session_health(session_id: str) -> SessionHealthOut:
        s = get_session(session_id)
        return SessionHealthOut(session_id=session_id, version=s.version,
                                channel_health=None if s.health is None
                                else ChannelHealth(**s.health))

    @app.delete("/v1/sessions/{session_id}", status_code=204, tags=["sessions"],
                dependencies=[Depends(controller)], responses=_errors(401, 404))
    async def delete_session(session_id: str) -> Response:
        get_session(session_id)
        del sessions[session_id]
        return Response(status_code=204)

    @app.post("/v1/sessions/{session_id}/rates", response_model=RateUpdated, tags=["sessions"],
              dependencies=[Depends(controller)], responses=_errors(400, 401, 404, 409, 413, 422))
    async def update_rates(session_id: str, body: RateUpdate) -> RateUpdated:
        s = get_session(session_id)
        if len(body.rates) > cfg.max_types:
            raise HTTPException(413, f"rates: {len(body.rates)} > max_types {cfg.max_types}")
        s.update_rates({r.type: r.rate_bps for r in body.rates},
                       {r.type: r.messages for r in body.rates if r.messages is not None},
                       replace=body.replace)
        return RateUpdated(version=s.version, active_types=int(s.active.size))

    # ------------------------------------------------------------------ decisions
    @app.post("/v1/sessions/{session_id}/decide", response_model=DecisionSingleOut,
              tags=["decisions"], dependencies=[Depends(controller)],
              responses=_errors(400, 401, 404, 409, 413, 422))
    async def decide(session_id: str, body: DecideRequest) -> dict[str, Any]:
        s = get_session(session_id)
        p = store.current()  # one version for the whole request
        (d,) = s.decide([body.type], p, fallback=cfg.fallback, explain=body.explain)
        return decision_out(d) | _versions(p, s)

    @app.post("/v1/sessions/{session_id}/decide/batch", response_model=DecisionBatchOut,
              tags=["decisions"], dependencies=[Depends(controller)],
              responses=_errors(400, 401, 404, 409, 413, 422))
    async def decide_batch(session_id: str, body: DecideBatchRequest) -> dict[str, Any]:
        s = get_session(session_id)
        n = len(body.types) if body.types is not None else int(s.active.size)
        if n > cfg.max_batch:
            raise HTTPException(413, f"types: a batch of {n} exceeds max_batch {cfg.max_batch}")
        p = store.current()
        ds = s.decide(body.types, p, fallback=cfg.fallback, replan=body.replan,
                      explain=body.explain, parallel=body.parallel)
        return {"decisions": [decision_out(d) for d in ds]} | _versions(p, s)

    def _versions(p: LoadedPolicy | None, s: Session) -> dict[str, Any]:
        return {"policy_version": p.version if p is not None else 0,
                "policy_hash": p.hash if p is not None else None,
                "session_version": s.version}

    add_online_routes(app, store=online_store, controller=controller, admin=admin,
                      max_sessions=cfg.max_sessions, max_batch=cfg.max_batch)
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
