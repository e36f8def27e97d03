"""``/v1/health/live``, ``/v1/health/ready`` and ``/v1/metrics`` (Prometheus text format,
for an admin or metrics key)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..access import require_metrics
from ..schemas import ErrorOut, HealthOut, error_responses
from ..strictjson import StrictJSONRoute
from .server import ServerDep

__all__ = ["router"]

router = APIRouter(route_class=StrictJSONRoute, tags=["health"])


@router.get("/v1/health/live", response_model=HealthOut)
async def live(server: ServerDep) -> HealthOut:
    return HealthOut(status="ok", policy_loaded=server.store.current() is not None,
                     sessions=len(server.sessions))


@router.get("/v1/health/ready", response_model=HealthOut,
            responses={503: {"model": HealthOut, "description": "No policy loaded"}})
async def ready(server: ServerDep) -> HealthOut | JSONResponse:
    loaded = server.store.current() is not None
    ok = loaded or not server.cfg.require_policy
    body = HealthOut(status="ok" if ok else "unavailable", policy_loaded=loaded,
                     sessions=len(server.sessions))
    return body if ok else JSONResponse(body.model_dump(), 503)


@router.get("/v1/metrics", response_class=Response, dependencies=[Depends(require_metrics)],
            responses={200: {"content": {"text/plain": {}},
                             "description": "Prometheus text format"},
                       **error_responses(401), 403: {"model": ErrorOut, "description":
                                                     "Not an admin or metrics key"}})
async def prometheus(server: ServerDep) -> Response:
    m = server.metrics
    m.sessions.set(len(server.sessions))
    m.session_bytes.set(server.budget.total)
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
