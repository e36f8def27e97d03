"""How the policy server answers what it refuses: the body limit (413, before the app reads
a body), the 422 of a list over a configured limit, and the exception handlers (a schema
violation 422, or 409 for a value the schema allows but the server cannot hold; 405 with
every allowed method; a memory budget 429; a session's or an online session's conflict 409).
"""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..access import allowed_methods
from ..limits import BudgetExceeded
from ..online_trace import MessageRejected, StateConflict
from ..schemas import OUT_OF_RANGE, TypeIn
from ..session import SessionError
from ..strictjson import json_safe

__all__ = ["BodyLimit", "add_error_handlers", "check_channels", "too_many"]


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


def check_channels(types: Iterable[TypeIn], num_topics: int) -> None:
    """409 naming the first type whose given channel is over ``num_topics``."""
    for i, t in enumerate(types):
        if t.channel is not None and t.channel > num_topics:
            raise HTTPException(409, [{"loc": ["body", "types", i, "channel"],
                                       "msg": f"channel {t.channel} > num_topics {num_topics}",
                                       "type": "value_error"}])



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


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 405:  # name every method of the resource, not one route's
        methods = allowed_methods(request.app, request.scope["path"])
        if methods is not None:
            exc.headers = {**(exc.headers or {}), "Allow": ", ".join(methods)}
    return await http_exception_handler(request, exc)


async def _conflict(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, 409)


async def _over_budget(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, 429)


def add_error_handlers(app: FastAPI) -> None:
    """Install the handlers (module docstring) on ``app``."""
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(BudgetExceeded, _over_budget)
    for conflict in (SessionError, StateConflict, MessageRejected):
        app.add_exception_handler(conflict, _conflict)
