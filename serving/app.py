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
history) has its own endpoints under ``/v1/online`` (:mod:`serving.api.online`).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute

from .access import (
    AllowMiddleware,
    document_contract,
    require_admin,
    require_controller,
    require_metrics,
)
from .api import health, online, policy, sessions
from .api.errors import BodyLimit, add_error_handlers
from .api.server import PolicyServer
from .api.settings import DEFAULT_AUTH_FAILURES, DEFAULT_RATE_LIMIT, ServerSettings
from .metrics import MetricsMiddleware
from .policy_store import PolicyStore
from .strictjson import StrictJSONRoute

__all__ = ["DEFAULT_AUTH_FAILURES", "DEFAULT_RATE_LIMIT", "ServerSettings", "add_routes",
           "create_app"]


#: the endpoints of the decision path, matched before the others (``create_app``)
HOT_ROUTES = frozenset({"decide", "decide_batch", "get_plan", "post_messages"})


def add_routes(app: FastAPI, router: APIRouter) -> None:
    """Every route of ``router`` added to ``app``'s own router, as ``include_router`` did
    before FastAPI 0.165 (no prefix, the route's own settings; ``app.dependency_overrides``
    applies). ``include_router`` now keeps an included router as one nested route resolved
    on every request, which costs the decision path about a fifth of its time in the app
    (``bench/bench_serving.py``'s ASGI figure); the OpenAPI document is the same."""
    for route in router.routes:
        if not isinstance(route, APIRoute):
            raise TypeError(f"{route!r}: only API routes are added")
        app.router.add_api_route(
            route.path, route.endpoint, response_model=route.response_model,
            status_code=route.status_code, tags=route.tags, dependencies=route.dependencies,
            summary=route.summary, description=route.description,
            response_description=route.response_description, responses=route.responses,
            deprecated=route.deprecated, methods=route.methods, operation_id=route.operation_id,
            response_model_include=route.response_model_include,
            response_model_exclude=route.response_model_exclude,
            response_model_by_alias=route.response_model_by_alias,
            response_model_exclude_unset=route.response_model_exclude_unset,
            response_model_exclude_defaults=route.response_model_exclude_defaults,
            response_model_exclude_none=route.response_model_exclude_none,
            include_in_schema=route.include_in_schema, response_class=route.response_class,
            name=route.name, route_class_override=type(route), callbacks=route.callbacks,
            openapi_extra=route.openapi_extra)


def create_app(settings: ServerSettings | None = None, *,
               store: PolicyStore | None = None) -> FastAPI:
    """The app; its lifespan loads ``settings.bundle`` (if any) and starts the watcher.
    Every bundle it loads (at start, by the watcher, on ``PUT /v1/policy`` and
    ``PUT /v1/online/policy``) must be signed by a key of ``settings.trust()``; a refused
    one is logged (key id and reason) and the current policy keeps serving (409 on a PUT).
    A ``store`` given keeps its own trust."""
    cfg = settings or ServerSettings(auth=False)
    server = PolicyServer(cfg, store)

    app = FastAPI(title="SMART DSMD policy server", version="1.0.0",
                  lifespan=asynccontextmanager(server.run),
                  description=__doc__)
    # every body is RFC 8259 JSON: NaN, Infinity, 1e400 and lone surrogates are refused
    # before validation (serving.strictjson)
    app.router.route_class = StrictJSONRoute
    st = app.state
    st.server = st.access = server  # the routers' dependency; the key check (Gate)
    st.settings, st.store, st.sessions, st.leases = cfg, server.store, server.sessions, \
        server.leases
    st.online_store, st.online_sessions = server.online_store, server.online_sessions
    st.budget, st.sweep, st.metrics, st.announcer = server.budget, server.sweep, \
        server.metrics, None
    # exposed for app.dependency_overrides (tests, embedding behind another auth layer)
    st.require_controller, st.require_admin = require_controller, require_admin
    st.require_metrics = require_metrics
    add_error_handlers(app)
    for r in (health.router, policy.router, sessions.router, online.router):
        add_routes(app, r)
    base_openapi = app.openapi
    limits = cfg.limits

    def openapi() -> dict[str, Any]:
        fresh = app.openapi_schema is None
        schema = base_openapi()
        if not fresh:
            return schema
        return document_contract(schema, server.limiter is not None, {
            ("SessionCreate", "types"): cfg.max_types, ("SessionUpdate", "types"): cfg.max_types,
            ("SessionCreate", "nodes"): limits.max_nodes,
            ("OnlineSessionCreate", "nodes"): limits.max_nodes,
            ("RateUpdate", "rates"): cfg.max_types,
            ("DecideBatchRequest", "types"): cfg.max_batch,
            ("MessagesIn", "messages"): cfg.max_batch})

    app.openapi = openapi  # type: ignore[method-assign]
    app.openapi()  # the document lists the routes in the order they were declared
    hot = [r for r in app.router.routes if isinstance(r, APIRoute) and r.name in HOT_ROUTES]
    # matched first: a request is matched against the routes in order, one regex each
    app.router.routes[:] = hot + [r for r in app.router.routes if r not in hot]
    app.add_middleware(AllowMiddleware, api=app)
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=server.metrics)
    return app
