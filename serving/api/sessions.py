"""The static problem's sessions and decisions: ``/v1/sessions`` (create, read, update
with types or channel health, delete), ``/v1/sessions/{id}/rates`` and
``/v1/sessions/{id}/decide`` (one type) and ``/decide/batch``."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError

from envs.dsmd.errors import DSMDError

from ..access import API_KEY_HEADER, Caller, ControllerCaller, Gate
from ..limits import Lease, static_session_bytes
from ..policy_store import LoadedPolicy
from ..schemas import (
    ChannelHealth,
    DecideBatchRequest,
    DecideRequest,
    DecisionBatchOut,
    DecisionSingleOut,
    ErrorOut,
    RateUpdate,
    RateUpdated,
    SessionCreate,
    SessionCreated,
    SessionHealthOut,
    SessionOut,
    SessionUpdate,
    error_responses,
)
from ..session import Decision, Session, SessionError, SessionSpec
from ..strictjson import strict_loads
from .direct import DirectRoute, direct, render
from .errors import check_channels, too_many
from .server import PolicyServer, ServerDep

__all__ = ["THREADED_BATCH", "router"]

#: a batch deciding more types than this runs on a worker thread whatever its session's size
THREADED_BATCH = 256

router = APIRouter(route_class=DirectRoute)


def _check_size(server: PolicyServer, num_nodes: int, num_topics: int, num_types: int,
                num_destinations: int) -> None:
    """422 naming the first of the session limits a request's counts exceed."""
    limits, max_types = server.limits, server.cfg.max_types
    if num_nodes > limits.max_nodes:
        raise too_many(["nodes"], num_nodes, limits.max_nodes, "limits.max_nodes")
    if num_topics > limits.max_topics:
        raise HTTPException(422, [{"loc": ["body", "num_topics"], "type": "less_than_equal",
                                   "msg": f"at most {limits.max_topics} "
                                          f"(limits.max_topics), got {num_topics}"}])
    if num_types > max_types:
        raise too_many(["types"], num_types, max_types, "max_types")
    if num_destinations > limits.max_destinations:
        raise HTTPException(422, [{"loc": ["body", "types"], "type": "too_long",
                                   "msg": f"at most {limits.max_destinations} "
                                          f"destinations in all (limits.max_destinations)"
                                          f", got {num_destinations}"}])


def _session_bytes(s: Session, new_types: int = 0, new_destinations: int = 0) -> int:
    sp = s.spec
    return static_session_bytes(sp.num_nodes, sp.num_topics, s.catalog_size + new_types,
                                s.num_destinations + new_destinations)


def _session_out(server: PolicyServer, sid: str, s: Session) -> SessionOut:
    why = s.compatibility(server.store.current())
    return SessionOut(session_id=sid, version=s.version, metrics=s.metrics(),
                      policy_compatible=why is None, reason=why, **s.snapshot())


async def _answer(server: PolicyServer, lease: Lease, make: Callable[[], SessionOut]) -> Any:
    """The answer ``make`` builds: for a large session built and serialised on a worker
    thread (a 200,000-type snapshot takes the event loop for long otherwise)."""
    if not lease.threaded:
        return make()

    def render() -> Response:
        return Response(make().model_dump_json(), media_type="application/json")
    return await server.run_on(lease, render)


def _decision_out(server: PolicyServer, d: Decision) -> dict:
    server.metrics.decision(d.channel, d.source, d.reason)
    out = {"type": d.type_id, "channel": d.channel, "source": d.source, "reason": d.reason}
    if d.observation is not None:
        out["observation"] = np.asarray(d.observation, np.float64).tolist()
        out["scores"] = np.asarray(d.scores, np.float64).tolist()
    return out


def _versions(p: LoadedPolicy | None, s: Session) -> dict[str, Any]:
    return {"policy_version": p.version if p is not None else 0,
            "policy_hash": p.hash if p is not None else None,
            "session_version": s.version}


# ---------------------------------------------------------------------- sessions
@router.post("/v1/sessions", response_model=SessionCreated, status_code=201, tags=["sessions"],
             responses=error_responses(400, 401, 409, 413, 422) | {429: {"model": ErrorOut,
                                                       "description": "Too many sessions, or "
                                                       "over the memory budget"}})
async def create_session(body: SessionCreate, caller: ControllerCaller,
                         server: ServerDep) -> SessionCreated:
    cfg, sessions = server.cfg, server.sessions
    if len(sessions) >= cfg.max_sessions:
        raise HTTPException(429, f"session limit ({cfg.max_sessions}) reached")
    if sum(s.owner == caller.owner for s in sessions.values()) >= cfg.max_sessions_per_key:
        raise HTTPException(429, f"this key holds {cfg.max_sessions_per_key} sessions "
                                 f"(max_sessions_per_key): close one first")
    dests = sum(len(t.destinations) for t in body.types)
    _check_size(server, len(body.nodes), body.num_topics, len(body.types), dests)
    check_channels(body.types, body.num_topics)
    health = None if body.channel_health is None else body.channel_health.model_dump()
    lease = Lease(caller.owner)
    estimate = static_session_bytes(len(body.nodes), body.num_topics, len(body.types), dests)

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

    with server.budget.building(lease, estimate):
        try:
            s = await server.run_on(lease, build, heavy=len(body.types) > THREADED_BATCH)
        except DSMDError as e:
            raise HTTPException(409, str(e)) from None
    sid = uuid.uuid4().hex
    sessions[sid], server.leases[sid] = s, lease
    why = s.compatibility(server.store.current())
    return SessionCreated(session_id=sid, version=s.version, policy_compatible=why is None,
                          reason=why)


@router.get("/v1/sessions/{session_id}", response_model=SessionOut, tags=["sessions"],
            responses=error_responses(401, 404))
async def read_session(session_id: str, caller: ControllerCaller,
                       server: ServerDep) -> SessionOut:
    s, lease = server.session(session_id, caller, "read")
    lease.touch()
    out: SessionOut = await _answer(server, lease,
                                    lambda: _session_out(server, session_id, s))
    return out


@router.patch("/v1/sessions/{session_id}", response_model=SessionOut, tags=["sessions"],
              responses=error_responses(400, 401, 404, 409, 413, 422) | {
                  429: {"model": ErrorOut, "description": "Over the memory budget"}})
async def update_session(session_id: str, body: SessionUpdate, caller: ControllerCaller,
                         server: ServerDep) -> SessionOut:
    cfg, limits, budget = server.cfg, server.limits, server.budget
    s, lease = server.session(session_id, caller, "update")
    if len(body.types) > cfg.max_types:
        raise too_many(["types"], len(body.types), cfg.max_types, "max_types")
    if s.catalog_size + len(body.types) > cfg.max_types:
        raise HTTPException(409, f"types: the session would exceed max_types {cfg.max_types}")
    dests = sum(len(t.destinations) for t in body.types)
    if s.num_destinations + dests > limits.max_destinations:
        raise HTTPException(409, f"types: the session would hold "
                                 f"{s.num_destinations + dests} destinations, over "
                                 f"limits.max_destinations {limits.max_destinations}")
    check_channels(body.types, s.spec.num_topics)
    health = None if body.channel_health is None else body.channel_health.model_dump()
    if health is not None:  # checked before anything changes
        try:
            s.check_health(health)
        except SessionError as e:
            raise HTTPException(409, [{"loc": ["body", "channel_health"], "msg": str(e),
                                       "type": "value_error"}]) from None
    before = lease.charged
    budget.charge(lease, max(before, _session_bytes(s, len(body.types), dests)))

    def update() -> None:
        if body.types or health is None:  # a health-only update leaves the rest alone
            s.add_types((t.id, t.destinations) for t in body.types)
            s.update_rates({t.id: t.rate_bps for t in body.types if t.rate_bps is not None},
                           {t.id: t.messages for t in body.types if t.messages is not None})
            s.set_assignment({t.id: t.channel for t in body.types if t.channel is not None})

    try:
        await server.run_on(lease, update, heavy=len(body.types) > THREADED_BATCH)
    finally:  # what the session holds now (all or nothing: unchanged on an error)
        budget.charge(lease, max(before, _session_bytes(s)))
    if health is not None:
        changed = health != s.health
        s.set_health(health)
        if changed and server.announcer is not None:
            server.announcer.health(session_id, health)
    out: SessionOut = await _answer(server, lease,
                                    lambda: _session_out(server, session_id, s))
    return out


@router.get("/v1/sessions/{session_id}/health", response_model=SessionHealthOut,
            tags=["sessions"], responses=error_responses(401, 404))
async def read_session_health(session_id: str, caller: ControllerCaller,
                              server: ServerDep) -> SessionHealthOut:
    s, lease = server.session(session_id, caller, "read")
    lease.touch()
    return SessionHealthOut(session_id=session_id, version=s.version,
                            channel_health=None if s.health is None
                            else ChannelHealth(**s.health))


@router.delete("/v1/sessions/{session_id}", status_code=204, tags=["sessions"],
               responses=error_responses(401, 404))
async def delete_session(session_id: str, caller: ControllerCaller,
                         server: ServerDep) -> Response:
    server.session(session_id, caller, "delete")
    server.drop(session_id, "deleted")
    return Response(status_code=204)


@router.post("/v1/sessions/{session_id}/rates", response_model=RateUpdated, tags=["sessions"],
             responses=error_responses(400, 401, 404, 409, 413, 422))
async def update_rates(session_id: str, body: RateUpdate, caller: ControllerCaller,
                       server: ServerDep) -> RateUpdated:
    s, lease = server.session(session_id, caller, "rates")
    max_types = server.cfg.max_types
    if len(body.rates) > max_types:
        raise too_many(["rates"], len(body.rates), max_types, "max_types")

    def update() -> RateUpdated:
        s.update_rates({r.type: r.rate_bps for r in body.rates},
                       {r.type: r.messages for r in body.rates if r.messages is not None},
                       replace=body.replace)
        return RateUpdated(version=s.version, active_types=int(s.active.size))
    return await server.run_on(lease, update, heavy=len(body.rates) > THREADED_BATCH)


# ---------------------------------------------------------------------- decisions
async def _decide(server: PolicyServer, session_id: str, body: DecideRequest,
                  caller: Caller) -> dict[str, Any]:
    s, lease = server.session(session_id, caller, "decide")
    p = server.store.current()  # one version for the whole request
    fallback = server.cfg.fallback

    def one() -> dict[str, Any]:
        (d,) = s.decide([body.type], p, fallback=fallback, explain=body.explain)
        return _decision_out(server, d) | _versions(p, s)
    return await server.run_on(lease, one)


async def _decide_direct(request: Request, raw: bytes, route: APIRoute) -> Response | None:
    """``decide``'s direct form (:mod:`serving.api.direct`): a body the model refuses goes
    the declared way, before the key is checked."""
    try:
        body = DecideRequest.model_validate(strict_loads(raw))
    except (ValueError, ValidationError):  # JSONDecodeError is a ValueError
        return None
    server: PolicyServer = request.app.state.server
    key = request.headers.get(API_KEY_HEADER) or None  # an empty header: no key, as declared
    gate: Gate = request.app.state.access  # require_controller's gate (an embedder's own)
    caller = gate.controller(request, key, len(raw))
    return render(route, await _decide(server, request.path_params["session_id"], body,
                                       caller))


@router.post("/v1/sessions/{session_id}/decide", response_model=DecisionSingleOut,
             tags=["decisions"], responses=error_responses(400, 401, 404, 409, 413, 422))
@direct(_decide_direct)
async def decide(session_id: str, body: DecideRequest, caller: ControllerCaller,
                 server: ServerDep) -> dict[str, Any]:
    return await _decide(server, session_id, body, caller)


@router.post("/v1/sessions/{session_id}/decide/batch", response_model=DecisionBatchOut,
             tags=["decisions"], responses=error_responses(400, 401, 404, 409, 413, 422))
async def decide_batch(session_id: str, body: DecideBatchRequest, caller: ControllerCaller,
                       server: ServerDep) -> dict[str, Any]:
    cfg, limits = server.cfg, server.limits
    s, lease = server.session(session_id, caller, "decide")
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
    p = server.store.current()

    def batch() -> dict[str, Any]:
        ds = s.decide(body.types, p, fallback=cfg.fallback, replan=body.replan,
                      explain=body.explain, parallel=body.parallel)
        return {"decisions": [_decision_out(server, d) for d in ds]} | _versions(p, s)
    return await server.run_on(lease, batch, heavy=n > THREADED_BATCH)
