"""The static policy: ``GET /v1/policy`` (what is loaded), ``GET /v1/policy/bundle`` (its
verified files, for cached adapters) and ``PUT /v1/policy`` (a swap, admin keys only)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Depends, HTTPException, Response

from ..access import AdminCaller, audit, require_controller
from ..bundles.static import bundle_zip
from ..policy_store import BundleError, LoadedPolicy
from ..schemas import ERROR_RESPONSES, ErrorOut, PolicyOut, PolicySwap, error_responses
from ..strictjson import StrictJSONRoute
from .server import PolicyServer, ServerDep

__all__ = ["policy_out", "router"]

router = APIRouter(route_class=StrictJSONRoute, tags=["policy"])


def policy_out(p: LoadedPolicy | None, fallback: str) -> PolicyOut:
    if p is None:
        return PolicyOut(loaded=False, version=0, hash=None, fallback=fallback)
    return PolicyOut(loaded=True, version=p.version, hash=p.hash, name=p.path.name,
                     loaded_at=p.loaded_at, origin=p.origin, scenario_signature=p.metadata.get(
                         "scenario_signature", {}),
                     observation=p.layout.to_dict(), decoding=p.decoding,
                     decision_order=p.order,
                     algorithm=p.metadata.get("extra", {}).get("algorithm"),
                     fallback=fallback)


@router.get("/v1/policy", response_model=PolicyOut,
            dependencies=[Depends(require_controller)], responses=error_responses(401))
async def get_policy(server: ServerDep) -> PolicyOut:
    return policy_out(server.store.current(), server.cfg.fallback)


@router.get("/v1/policy/bundle", dependencies=[Depends(require_controller)],
            response_class=Response,
            responses={200: {"content": {"application/zip": {}},
                             "description": "The bundle's files (zip)"},
                       404: ERROR_RESPONSES[404] | {"description": "No policy loaded"},
                       401: ERROR_RESPONSES[401]})
async def get_bundle(server: ServerDep) -> Response:
    p = server.store.current()
    if p is None:
        raise HTTPException(404, "no policy is loaded")
    raw = await asyncio.to_thread(bundle_zip, p.bundle)  # the verified bytes
    return Response(raw, media_type="application/zip",
                    headers={"X-Policy-Version": str(p.version), "X-Policy-Hash": p.hash})


@router.put("/v1/policy", response_model=PolicyOut,
            responses=error_responses(400, 401, 409, 422) | {403: {"model": ErrorOut,
                                                      "description": "Not an admin key"}})
async def swap_policy(body: PolicySwap, caller: AdminCaller, server: ServerDep) -> PolicyOut:
    try:
        p = await asyncio.to_thread(_load, server, body, caller.owner)
    except BundleError as e:
        audit(caller.key_id, "policy.load", body.path, "failed", f"409: {e}",
              level=logging.WARNING)
        raise HTTPException(409, str(e)) from None
    audit(caller.key_id, "policy.load", body.path, "ok",
          f"version {p.version} hash {p.hash[:16]}" + (" (forced)" if body.force else "")
          + (" (rollback allowed)" if body.allow_rollback else ""))
    return policy_out(p, server.cfg.fallback)


def _load(server: PolicyServer, body: PolicySwap, owner: str | None) -> LoadedPolicy:
    return server.load(body.path, body.force, owner, None, body.allow_rollback)
