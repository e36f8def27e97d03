"""Direct handlers for the decision path: the plain request served without FastAPI's
dependency solving, the rest exactly as declared.

A decision request is a few dozen bytes and a policy call of tens of microseconds; solving
an endpoint's dependencies (the server, the caller, its ``X-API-Key`` header, the body
model) took about twice the decision itself (``bench/bench_serving_overhead.py``). An
endpoint may carry a *direct form* (:func:`direct`): a coroutine taking the request, its
body bytes and the route, that returns the response or ``None``. A :class:`DirectRoute`
tries the direct form first and falls back to the endpoint as declared when it returns
``None`` (the body is not JSON the model accepts, an unusual content type), when reading
the body fails (the client left), when the route has ``dependencies`` of its own, or when
the app has ``dependency_overrides`` (an embedder's auth layer, tests), with the body
replayed. The direct form must therefore return ``None`` only *before* any side effect (a
key checked, a token charged): the declared endpoint then runs from the start and answers
as it always did, errors included. Its answers are the route's own: the same key gate
(``app.state.access``, :class:`~serving.access.Gate`, as ``require_controller`` uses), the
same exceptions and handlers, and the response rendered through the route's
``response_model`` as FastAPI renders it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.types import Message

from ..strictjson import StrictJSONRoute

__all__ = ["DirectForm", "DirectRoute", "direct", "render"]

#: a direct form: (request, body bytes, route) -> the response, or None for the declared path
DirectForm = Callable[[Request, bytes, APIRoute], Awaitable[Response | None]]

_E = TypeVar("_E", bound=Callable[..., Any])

#: the content type the direct forms take; the others (FastAPI parses ``application/*+json``
#: as JSON too, and refuses a body without a type) go the declared way
_JSON_TYPE = b"application/json"


def direct(form: DirectForm) -> Callable[[_E], _E]:
    """Decorator: ``form`` is the endpoint's direct form (module docstring)."""
    def mark(endpoint: _E) -> _E:
        endpoint.direct = form  # type: ignore[attr-defined]
        return endpoint
    return mark


def render(route: APIRoute, content: Any) -> Response:
    """``content`` validated against the route's ``response_model`` and serialised to JSON
    as FastAPI does for a route with the default response class (the same bytes)."""
    field = route.response_field
    assert field is not None, f"{route.path}: a direct route needs a response_model"
    value, errors = field.validate(content, {}, loc=("response",))
    if errors:  # a bug in the direct form: the declared path would raise the same
        from fastapi.exceptions import ResponseValidationError

        raise ResponseValidationError(errors=errors, body=content)
    return Response(field.serialize_json(value, by_alias=True), status_code=route.status_code
                    or 200, media_type="application/json")


def _plain_json(request: Request) -> bool:
    ctype = None
    for k, v in request.scope["headers"]:
        if k == b"content-type":
            ctype = v
            break
    return ctype is not None and ctype.split(b";", 1)[0].strip().lower() == _JSON_TYPE


def _replay(body: bytes) -> Callable[[], Awaitable[Message]]:
    """A receive channel that yields ``body`` once, then a disconnect."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}
    return receive


async def _disconnected() -> Message:
    return {"type": "http.disconnect"}


class DirectRoute(StrictJSONRoute):
    """A route whose endpoint may have a direct form (module docstring); without one, a
    :class:`~serving.strictjson.StrictJSONRoute`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        declared = super().get_route_handler()
        form: DirectForm | None = getattr(self.endpoint, "direct", None)
        if form is None or self.dependencies:  # route-level dependencies: the declared way
            return declared
        route = self

        async def handler(request: Request) -> Response:
            if request.app.dependency_overrides or not _plain_json(request):
                return await declared(request)
            try:
                body = await request.body()
            except Exception:  # the client left mid-body: answered as declared (400)
                return await declared(Request(request.scope, _disconnected))
            answer = await form(request, body, route)
            if answer is not None:
                return answer
            return await declared(Request(request.scope, _replay(body)))
        return handler
