"""Request bodies parsed as RFC 8259 JSON, and error answers that always encode.

Python's :func:`json.loads` accepts more than JSON: ``NaN``, ``Infinity`` and ``-Infinity``,
numbers such as ``1e400`` that become an infinite float, and ``"\\ud800"`` escapes that
become a lone surrogate, a string no UTF-8 encoder can write back. Such a value, accepted,
breaks the answer that echoes it (a 422 listing the input, a session read returning a
stored string) into a 500. Here every request body of the API is parsed by
:func:`strict_loads`, which refuses them with a :class:`json.JSONDecodeError` that names
the value and its position; FastAPI answers it as any malformed body (422, ``json_invalid``,
the reason in ``ctx.error``). The accepted language is RFC 8259 exactly: UTF-8 text, finite
numbers, strings of Unicode scalar values, nesting within the interpreter's recursion limit.

:func:`json_safe` is the second line: whatever an error answer echoes is made encodable
(a non-finite float as its text, a lone surrogate as U+FFFD) before it is rendered.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

__all__ = ["StrictJSONRequest", "StrictJSONRoute", "json_safe", "strict_loads"]

#: a ``\\uD800``-``\\uDFFF`` escape: only then can the parsed text hold a lone surrogate
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class _Refused(ValueError):
    def __init__(self, what: str, token: str | None = None) -> None:
        super().__init__(what)
        self.what, self.token = what, token


def _constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number (RFC 8259): send a finite number", name)


def _float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise _Refused(f"the number {text[:40]} is out of range (larger than a double "
                       "holds)", text)
    return v


def _lone_surrogate(obj: Any) -> str | None:
    """The first string (key or value) of ``obj`` that UTF-8 cannot encode, or None."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, str):
            try:
                o.encode("utf-8")
            except UnicodeEncodeError:
                return o
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)
    return None


def strict_loads(body: bytes | str) -> Any:
    """``body`` parsed as RFC 8259 JSON; anything else raises :class:`json.JSONDecodeError`
    with a message naming what is wrong (module docstring)."""
    if isinstance(body, bytes | bytearray):
        try:
            text = bytes(body).decode("utf-8")
        except UnicodeDecodeError as e:
            raise json.JSONDecodeError(f"the body is not UTF-8 text (byte {e.start}: "
                                       f"{e.reason})", "", e.start) from None
        raw = bytes(body)
    else:
        text, raw = body, body.encode("utf-8", "surrogatepass")
    if text.startswith("\ufeff"):
        raise json.JSONDecodeError("a byte order mark is not allowed in JSON text", text, 0)
    try:
        # (no parse_int hook: one Python call per integer would cost more than the parse)
        obj = json.loads(text, parse_constant=_constant, parse_float=_float)
    except _Refused as e:
        pos = max(text.find(e.token), 0) if e.token else 0
        raise json.JSONDecodeError(e.what, text, pos) from None
    except json.JSONDecodeError:
        raise
    except ValueError as e:  # an integer of more digits than int() converts (sys.int_info)
        raise json.JSONDecodeError(f"a number is out of range ({str(e)[:80]})", text,
                                   0) from None
    except RecursionError:
        raise json.JSONDecodeError("the body is nested too deeply", text, 0) from None
    if _SURROGATE_ESCAPE.search(raw):
        bad = _lone_surrogate(obj)
        if bad is not None:
            pos = max(text.find("\\u"), 0)
            raise json.JSONDecodeError("a string holds a lone UTF-16 surrogate escape "
                                       "(not a Unicode character)", text, pos)
    return obj


class StrictJSONRequest(Request):
    """A request whose :meth:`json` is :func:`strict_loads` of its body."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = strict_loads(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """The API's route class: its endpoints read their bodies with :class:`StrictJSONRequest`
    (FastAPI's documented way to customise the request of a route)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict


def json_safe(obj: Any) -> Any:
    """``obj`` (what an error answer echoes) with every value JSON can carry: non-finite
    floats as their text, strings UTF-8 cannot encode with U+FFFD for each lone surrogate,
    tuples as lists, anything else unknown as its ``repr`` (bounded)."""
    if obj is None or isinstance(obj, bool | int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
            return obj
        except UnicodeEncodeError:
            return "".join("\ufffd" if 0xD800 <= ord(ch) <= 0xDFFF else ch for ch in obj)
    if isinstance(obj, dict):
        return {json_safe(k) if isinstance(k, str) else str(k): json_safe(v)
                for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return repr(obj)[:200]
