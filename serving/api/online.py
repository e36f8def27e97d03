"""The online endpoints of the policy server (``/v1/online``): the online policy served at
every interval boundary from each session's own history (``docs/serving-online.md``).

A controller opens an online session (its nodes and a scenario: K, C_b, C_p, T), then for
each interval ``w`` in turn: ``GET .../intervals/{w}/plan`` (the boundary plan and the
policy's knobs), ``POST .../intervals/{w}/messages`` (its messages in time order; the
response places every type the plan does not cover, on its first message, and gives each
message's channel), ``POST .../intervals/{w}/close`` (the interval's realised terms). The
engine is :class:`serving.online_session.OnlineSession`, the same as the online adapter's.

Failures: 401 / 403 (keys, as for the static endpoints), 404 (unknown session, or one
another key created: each session belongs to the key that created it, as for the static
endpoints, :mod:`serving.access`), 409 (a request out of order with the session: an
interval that is not the open one, a message of another interval or out of time order, no
online policy loaded when one must plan, a plan already made, a bundle refused on swap; and
a body the schema accepts that contradicts itself or the session: an unknown dataset or
destination node, a message id sent before, a placement for a type the batch does not
place), 413 (a body over ``max_body_bytes``), 422 (a body the schema refuses, more than
``max_batch`` messages or ``limits.max_nodes`` nodes included, or K over
``limits.max_topics``), 429 (``max_sessions`` online sessions open, or this key's sessions
over their memory budget: a session's history grows with every interval, and each batch
of messages and each close is charged before it is taken, :mod:`serving.limits`). A
``dataset`` is the name of a dataset config the server ships, never a path. A session
unused for ``limits.idle_s`` is deleted (404 afterwards). Every message names what is
wrong; a failed request changes nothing but, at most, the open interval's plan (due at its
boundary anyway: the same plan whenever it is made).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, TypeVar

import numpy as np
from fastapi import APIRouter, Depends, HTTPException, Path, Response

from envs.dsmd.dataset import DATASET_CONFIG_DIR, load_dataset_spec
from envs.dsmd.errors import DSMDError
from envs.dsmd.online import OnlineCost
from envs.dsmd.online_control import FEATURES
from envs.dsmd.scenarios import ScenarioSpec
from envs.dsmd.topology import Topology

from ..access import AdminCaller, Caller, ControllerCaller, audit, require_controller
from ..bundles.static import bundle_zip
from ..limits import Lease, online_session_bytes
from ..online_schemas import (
    IntervalOut,
    MessagesIn,
    MessagesOut,
    OnlinePolicyOut,
    OnlineSessionCreate,
    OnlineSessionCreated,
    OnlineSessionOut,
    PlacedOut,
    PlanIn,
    PlannedOut,
    PlanOut,
)
from ..online_session import MessageRejected, OnlineSession, Plan, signature_scenario
from ..policy_store import BundleError, LoadedOnlinePolicy
from ..schemas import MAX_JSON_INT, ErrorOut, PolicySwap, error_responses
from ..strictjson import StrictJSONRoute
from .server import PolicyServer, ServerDep

__all__ = ["OnlineEntry", "known_datasets", "router"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass
class OnlineEntry:
    """A server-side online session, its lock (one request at a time) and the version of
    the policy that decides in it."""

    session: OnlineSession
    lock: threading.Lock
    policy_version: int = 0
    owner: str | None = None  # the owner id of the key that created it (serving.access)
    #: its memory charge, last use and request lock (serving.limits)
    lease: Lease | None = None
    messages: int = 0  # messages accepted so far
    hosts: int = 0  # their destinations, together

    def estimate(self, new_messages: int = 0, new_hosts: int = 0, new_windows: int = 0
                 ) -> int:
        """Its estimated bytes (:func:`serving.limits.online_session_bytes`) after taking
        that much more (each new message counted as a possible new type)."""
        s = self.session
        return online_session_bytes(s.live.topology.num_nodes, s.spec.num_topics,
                                    len(s.live.catalog) + new_messages,
                                    s.live.closed + new_windows, self.messages + new_messages,
                                    self.hosts + new_hosts)


#: an interval index in a path (a JSON-safe integer: the same bound as every id)
WindowParam = Annotated[int, Path(ge=0, le=MAX_JSON_INT, description="The interval index.")]


def known_datasets() -> list[str]:
    """The dataset configs the server ships (``configs/dataset/<name>.yaml``), by name."""
    return sorted(p.stem for p in DATASET_CONFIG_DIR.glob("*.yaml"))


def _scenario(body: OnlineSessionCreate) -> ScenarioSpec:
    """The session's scenario (409 naming the field that is missing or disagrees). A
    dataset is looked up by name among :func:`known_datasets`: no request reaches a path."""
    if body.scenario is not None and body.dataset is not None:
        raise MessageRejected("give a scenario or a dataset, not both")
    if body.scenario is not None:
        spec = ScenarioSpec.from_dict(body.scenario.model_dump())
    elif body.dataset is not None:
        known = known_datasets()
        if body.dataset not in known:
            raise MessageRejected(f"dataset: unknown dataset {body.dataset!r}; known: "
                                  f"{', '.join(known)}")
        spec = load_dataset_spec(body.dataset).scenario_spec()
    else:
        missing = [k for k in ("controller", "num_topics", "interval_s")
                   if getattr(body, k) is None]
        if missing:
            raise MessageRejected(f"without a scenario or dataset, {', '.join(missing)} "
                                  "must be given")
        assert body.controller is not None and body.num_topics is not None
        return signature_scenario(len(body.nodes), max(n.capacity_bps for n in body.nodes),
                                  body.num_topics, body.controller.bandwidth_bps,
                                  body.controller.cpu, float(body.interval_s or 0))
    for field_, mine, theirs in (
            ("num_topics", body.num_topics, spec.num_topics),
            ("interval_s", body.interval_s, spec.interval_s),
            ("controller.bandwidth_bps", body.controller and body.controller.bandwidth_bps,
             spec.controller_bw_bps),
            ("controller.cpu", body.controller and body.controller.cpu, spec.controller_cpu)):
        if mine is not None and mine != theirs:
            raise MessageRejected(f"{field_} {mine} disagrees with the scenario's {theirs}")
    return spec


router = APIRouter(route_class=StrictJSONRoute, tags=["online"])


def _entry(server: PolicyServer, session_id: str, caller: Caller,
           action: str = "use") -> OnlineEntry:
    """The caller's online session ``session_id`` (404 otherwise), its use recorded."""
    e = server.online_sessions.get(session_id)
    if e is None:
        raise HTTPException(404, f"unknown online session {session_id!r}")
    server.owned("online session", session_id, e.owner, caller, action)
    if e.lease is not None:
        if (e.lease.idle_for(time.monotonic()) >= server.limits.idle_s
                and not e.lock.locked()):
            server.expire_online(time.monotonic())  # due: the sweep may lag
            raise HTTPException(404, f"unknown online session {session_id!r}")
        e.lease.touch()
    return e


def _at_boundary(server: PolicyServer, e: OnlineEntry) -> None:
    """Before a boundary: decide with the policy loaded now (a swap takes effect here)."""
    s = e.session
    if s.planned:
        return
    p = server.online_store.current()
    if p is None:
        if s.decider is not None:
            s.set_decider(None)
        e.policy_version = 0
    elif p.version != e.policy_version or s.decider is None:
        s.set_decider(p.decider())
        e.policy_version = p.version


async def _locked(server: PolicyServer, e: OnlineEntry, fn: Callable[[], _T]) -> _T:
    def run() -> _T:
        with e.lock:
            return fn()
    async with server.slots.of(e.owner):  # one key holds at most its share of the threads
        return await asyncio.to_thread(run)


def _policy_out(p: LoadedOnlinePolicy | None) -> OnlinePolicyOut:
    if p is None:
        return OnlinePolicyOut(loaded=False, version=0, hash=None)
    m = p.bundle.metadata
    return OnlinePolicyOut(loaded=True, version=p.version, hash=p.hash, name=p.path.name,
                           loaded_at=p.loaded_at, origin=p.origin,
                           features=list(m.get("features", [])),
                           knob_map=m.get("knob_map"), cost=m.get("cost"),
                           dataset=m.get("dataset"))


def _plan_out(e: OnlineEntry, p: Plan) -> PlanOut:
    return PlanOut(window=p.window, plan=[PlannedOut(type=t, channel=c, expected_rate_bps=r)
                                          for t, c, r in zip(p.types.tolist(),
                                                             p.channels.tolist(),
                                                             p.rates.tolist())],
                   source=p.source, knobs=None if p.knobs is None
                   else {k: None if math.isinf(v) else v for k, v in p.knobs.items()},
                   observation=None if p.observation is None
                   else np.asarray(p.observation, np.float64).tolist(),
                   features=None if p.observation is None else list(FEATURES),
                   policy_version=e.policy_version if p.source == "policy" else 0)


# ---------------------------------------------------------------------- policy
@router.get("/v1/online/policy", response_model=OnlinePolicyOut,
            dependencies=[Depends(require_controller)], responses=error_responses(401))
async def get_online_policy(server: ServerDep) -> OnlinePolicyOut:
    return _policy_out(server.online_store.current())


@router.get("/v1/online/policy/bundle", dependencies=[Depends(require_controller)],
            response_class=Response,
            responses={200: {"content": {"application/zip": {}},
                             "description": "the bundle's files (zip)"},
                       404: {"model": ErrorOut, "description": "No online policy loaded"},
                       **error_responses(401)})
async def get_online_bundle(server: ServerDep) -> Response:
    p = server.online_store.current()
    if p is None:
        raise HTTPException(404, "no online policy is loaded")
    raw = await asyncio.to_thread(bundle_zip, p.bundle)
    return Response(raw, media_type="application/zip",
                    headers={"X-Policy-Version": str(p.version), "X-Policy-Hash": p.hash})


@router.put("/v1/online/policy", response_model=OnlinePolicyOut,
            responses=error_responses(400, 401, 403, 409, 422))
async def swap_online_policy(body: PolicySwap, caller: AdminCaller,
                             server: ServerDep) -> OnlinePolicyOut:
    try:
        p = await asyncio.to_thread(server.load_online, body.path, None, body.allow_rollback)
    except BundleError as e:
        audit(caller.key_id, "online_policy.load", body.path, "failed", f"409: {e}",
              level=logging.WARNING)
        raise HTTPException(409, str(e)) from None
    audit(caller.key_id, "online_policy.load", body.path, "ok",
          f"version {p.version} hash {p.hash[:16]}"
          + (" (rollback allowed)" if body.allow_rollback else ""))
    return _policy_out(p)


# ---------------------------------------------------------------------- sessions
@router.post("/v1/online/sessions", response_model=OnlineSessionCreated, status_code=201,
             responses=error_responses(400, 401, 409, 413, 422, 429))
async def create_online_session(body: OnlineSessionCreate, caller: ControllerCaller,
                                server: ServerDep) -> OnlineSessionCreated:
    lim, sessions, cfg = server.limits, server.online_sessions, server.cfg
    if len(body.nodes) > lim.max_nodes:
        raise HTTPException(422, [{"loc": ["body", "nodes"], "type": "too_long",
                                   "msg": f"at most {lim.max_nodes} items "
                                          f"(limits.max_nodes), got {len(body.nodes)}"}])
    for where, k in ((["body", "num_topics"], body.num_topics),
                     (["body", "scenario", "num_topics"],
                      body.scenario.num_topics if body.scenario is not None else None)):
        if k is not None and k > lim.max_topics:
            raise HTTPException(422, [{"loc": where, "type": "less_than_equal",
                                       "msg": f"at most {lim.max_topics} "
                                              f"(limits.max_topics), got {k}"}])
    if len(sessions) >= cfg.max_sessions:
        raise HTTPException(429, f"online session limit ({cfg.max_sessions}) reached")
    if sum(e.owner == caller.owner for e in sessions.values()) >= cfg.max_sessions_per_key:
        raise HTTPException(429, f"this key holds {cfg.max_sessions_per_key} online sessions "
                                 f"(max_sessions_per_key): close one first")
    p = server.online_store.current()
    try:
        spec = _scenario(body)
        ids = np.array([n.id for n in body.nodes], np.int64)
        if np.unique(ids).size != ids.size or ids.max() > 2**32 - 1:
            raise MessageRejected("nodes: node ids must be unique and at most 2**32 - 1")
        topo = Topology.from_arrays(ids, [n.capacity_bps for n in body.nodes], [], [], [])
        if spec.num_topics > lim.max_topics:  # a dataset's scenario
            raise MessageRejected(f"the scenario's K = {spec.num_topics} is over "
                                  f"limits.max_topics {lim.max_topics}")
        base = p.bundle.cost if p is not None else OnlineCost()
        cost = base.with_weights(body.cost) if body.cost is not None else base
    except MessageRejected:
        raise
    except DSMDError as e:
        raise HTTPException(409, str(e)) from None
    lease = Lease(caller.owner)
    with server.budget.building(lease, online_session_bytes(len(body.nodes), spec.num_topics,
                                                            0, 0, 0, 0)):
        try:
            s = await asyncio.to_thread(OnlineSession, spec, topo, cost=cost,
                                        batch_key=body.batch_key, start_ns=body.start_ns,
                                        name=body.name)
        except DSMDError as e:
            raise HTTPException(409, str(e)) from None
    sid = uuid.uuid4().hex
    sessions[sid] = OnlineEntry(s, threading.Lock(), owner=caller.owner, lease=lease)
    return OnlineSessionCreated(session_id=sid, window=s.window, start_ns=s.live.t0,
                                scenario=spec.to_dict(), cost=cost.as_dict(),
                                policy_version=0 if p is None else p.version)


@router.get("/v1/online/sessions/{session_id}", response_model=OnlineSessionOut,
            responses=error_responses(401, 404))
async def read_online_session(session_id: str, caller: ControllerCaller,
                              server: ServerDep) -> OnlineSessionOut:
    e = _entry(server, session_id, caller, "read")
    s = e.session
    cur = server.online_store.current()
    return OnlineSessionOut(session_id=session_id, window=s.window, planned=s.planned,
                            start_ns=s.live.t0, num_types=len(s.live.catalog),
                            last=s.last, scenario=s.spec.to_dict(), cost=s.cost.as_dict(),
                            batch_key=s.live.catalog.batch_key,
                            policy_version=e.policy_version if s.planned
                            else (cur.version if cur is not None else 0))


@router.delete("/v1/online/sessions/{session_id}", status_code=204,
               responses=error_responses(401, 404))
async def delete_online_session(session_id: str, caller: ControllerCaller,
                                server: ServerDep) -> Response:
    _entry(server, session_id, caller, "delete")
    server.drop_online(session_id)
    return Response(status_code=204)


# ---------------------------------------------------------------------- intervals
@router.get("/v1/online/sessions/{session_id}/intervals/{window}/plan",
            response_model=PlanOut, responses=error_responses(401, 404, 409))
async def get_plan(session_id: str, window: WindowParam, caller: ControllerCaller,
                   server: ServerDep) -> PlanOut:
    e = _entry(server, session_id, caller, "plan")

    def run() -> Plan:
        s = e.session
        s.check_window(window)
        if s.plan is not None:  # planned once; the same answer afterwards
            return s.plan
        _at_boundary(server, e)
        return s.begin()
    return _plan_out(e, await _locked(server, e, run))


@router.put("/v1/online/sessions/{session_id}/intervals/{window}/plan",
            response_model=PlanOut, responses=error_responses(400, 401, 404, 409, 413, 422))
async def put_plan(session_id: str, window: WindowParam, body: PlanIn,
                   caller: ControllerCaller, server: ServerDep) -> PlanOut:
    e = _entry(server, session_id, caller, "plan")

    def run() -> Plan:
        s = e.session
        s.check_window(window)
        p = body.plan
        return s.begin(given=([x.type for x in p], [x.channel for x in p],
                              [x.expected_rate_bps for x in p]))
    return _plan_out(e, await _locked(server, e, run))


@router.post("/v1/online/sessions/{session_id}/intervals/{window}/messages",
             response_model=MessagesOut,
             responses=error_responses(400, 401, 404, 409, 413, 422))
async def post_messages(session_id: str, window: WindowParam, body: MessagesIn,
                        caller: ControllerCaller, server: ServerDep) -> MessagesOut:
    e = _entry(server, session_id, caller, "messages")
    max_batch, budget = server.cfg.max_batch, server.budget
    if len(body.messages) > max_batch:
        raise HTTPException(422, [{"loc": ["body", "messages"], "type": "too_long",
                                   "msg": f"at most {max_batch} items (max_batch), got "
                                          f"{len(body.messages)}"}])
    given: dict[int, int] = {}
    for i, pl in enumerate(body.placements):
        if pl.type in given:
            raise MessageRejected(f"placements[{i}]: type {pl.type} is listed twice")
        given[pl.type] = pl.channel
    msgs = [m.to_message() for m in body.messages]
    hosts = sum(len(m.hosts) for m in msgs)
    lease = e.lease
    if lease is not None:  # the most this batch can add (each message a new type)
        budget.charge(lease, max(lease.charged, e.estimate(len(msgs), hosts)))

    def run() -> MessagesOut:
        s = e.session
        s.check_window(window)
        _at_boundary(server, e)
        r = s.submit(msgs, given=given)
        e.messages += len(msgs)
        e.hosts += hosts
        return MessagesOut(window=window, types=r.types.tolist(),
                           channels=r.channels.tolist(),
                           placed=[PlacedOut(type=p.type_id, channel=p.channel,
                                             message_id=p.message_id,
                                             previous_channel=p.previous_channel,
                                             rate_bps=p.rate_bps, source=p.source)
                                   for p in r.placed],
                           policy_version=e.policy_version)
    try:
        return await _locked(server, e, run)
    finally:
        if lease is not None:  # what it holds now
            budget.charge(lease, e.estimate())


@router.post("/v1/online/sessions/{session_id}/intervals/{window}/close",
             response_model=IntervalOut, responses=error_responses(401, 404, 409))
async def close_interval(session_id: str, window: WindowParam, caller: ControllerCaller,
                         server: ServerDep) -> IntervalOut:
    e = _entry(server, session_id, caller, "close")
    budget = server.budget
    if e.lease is not None:  # one more interval of history
        budget.charge(e.lease, max(e.lease.charged, e.estimate(new_windows=1)))

    def run() -> IntervalOut:
        s = e.session
        s.check_window(window)
        _at_boundary(server, e)
        c = s.close()
        return IntervalOut(window=c.window, types=c.types.tolist(),
                           channels=c.channels.tolist(), terms=c.terms,
                           next_window=s.window)
    try:
        return await _locked(server, e, run)
    finally:
        if e.lease is not None:
            budget.charge(e.lease, e.estimate())
