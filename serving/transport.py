"""HTTP/1.1 connection limits of the policy server, enforced below the application.

:class:`TransportLimits` holds them (``configs/serve.yaml``'s ``transport`` block):

- ``max_header_bytes``: the request line and headers of one request together. A request
  head over it is answered ``431 Request Header Fields Too Large`` (RFC 6585, section 5)
  with a small JSON body naming the limit, and the connection is closed: nothing past the
  limit is buffered or parsed.
- ``header_timeout_s``: the whole request head must arrive within this many seconds of the
  connection opening, or of the previous response finishing. Past it the connection is
  closed, after a ``408 Request Timeout`` (RFC 9110, section 15.5.9) when part of a head
  had arrived (never on a connection where the client sent nothing since its last
  response: a 408 there could be read as the answer to a request the client sends at that
  moment).
- ``idle_timeout_s``: a connection with no request in progress is closed after this many
  seconds without a byte (uvicorn's ``timeout_keep_alive``). uvicorn arms that timer only
  after a response, so a connection that opens and sends nothing would be held for ever;
  :class:`LimitedHttpToolsProtocol` arms it when the connection opens as well.

:class:`LimitedHttpToolsProtocol` enforces them on uvicorn's httptools protocol, and
:func:`uvicorn_options` gives the keyword arguments of ``uvicorn.run`` that install it.

The header bytes are counted as they arrive (``data_received``), before the parser sees
them: httptools (like llhttp below it) has no bound of its own and accumulates a header
value however long it is, so counting in its callbacks would come too late. The fast path
costs one comparison and one subtraction per read while a head is incomplete, and a
deadline set when a response finishes (the connection's one header timer is re-armed only
when it fires, at most once per ``header_timeout_s``). The count starts when the previous
request's message ends, or when the connection opens. The bytes of a pipelined head that
arrive in the same read as the end of the request before it are not charged, so such a
head may exceed the limit by at most that one read (the event loop's read buffer, about
256 KB), which bounds memory all the same.

Not covered here: the TLS handshake (before the protocol exists; asyncio and uvloop close a
connection that has not completed it within 60 s) and a slowly sent request body (the
application's body limits bound its size, not its pace)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

__all__ = ["LimitedHttpToolsProtocol", "TransportLimits", "protocol_class",
           "uvicorn_options"]

#: the smallest ``max_header_bytes`` accepted: below it ordinary requests (a request line,
#: Host, an API key, Content-Type and Content-Length) would be refused
MIN_HEADER_BYTES = 1024
#: a timer firing this close to its deadline counts as on time (event loops round delays to
#: milliseconds, and may fire a little early)
CLOCK_SLACK_S = 0.005


@dataclass(frozen=True)
class TransportLimits:
    """The connection limits of the HTTP server (module docstring): ``transport:`` of
    ``configs/serve.yaml``. Every field is positive; ``max_header_bytes`` an integer of at
    least :data:`MIN_HEADER_BYTES`."""

    #: total bytes of one request's request line and headers, CRLFs included (431 above)
    max_header_bytes: int = 16384
    #: seconds in which a whole request head must arrive, from the connection opening or the
    #: previous response finishing (the connection is closed past it, after a 408 if part of
    #: a head had arrived)
    header_timeout_s: float = 10.0
    #: seconds a connection with no request in progress may stay silent before it is closed,
    #: before its first request too (uvicorn's ``timeout_keep_alive``)
    idle_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        v = self.max_header_bytes
        if isinstance(v, bool) or not isinstance(v, int) or v < MIN_HEADER_BYTES:
            raise ValueError(f"transport.max_header_bytes must be an integer >= "
                             f"{MIN_HEADER_BYTES}, got {v!r}")
        for name in ("header_timeout_s", "idle_timeout_s"):
            t = getattr(self, name)
            if isinstance(t, bool) or not isinstance(t, int | float) or not (
                    math.isfinite(t) and t > 0):
                raise ValueError(f"transport.{name} must be a positive number of seconds, "
                                 f"got {t!r}")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any] | TransportLimits | None) -> TransportLimits:
        """``transport: {max_header_bytes, header_timeout_s, idle_timeout_s}`` (any subset;
        the rest keep their defaults); None: the defaults. Unknown keys are refused."""
        if m is None:
            return cls()
        if isinstance(m, TransportLimits):
            return m
        if not isinstance(m, Mapping):
            raise ValueError(f"transport: expected a mapping {{max_header_bytes, "
                             f"header_timeout_s, idle_timeout_s}} or null, got "
                             f"{type(m).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(m) - set(known))
        if unknown:
            raise ValueError(f"transport: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(m))


def _response(status: int, detail: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A complete ``status`` response closing the connection, body ``{"detail": detail}``
    (the application's error shape)."""
    body = json.dumps({"detail": detail}).encode()
    out = [STATUS_LINE[status]]
    for name, value in default_headers:  # server, date: as on every other response
        out += [name, b": ", value, b"\r\n"]
    out += [b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(),
            b"\r\nconnection: close\r\n\r\n", body]
    return b"".join(out)


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with :class:`TransportLimits` (module docstring). The
    limits are class attributes: :func:`protocol_class` makes a subclass holding others
    (uvicorn builds the protocol itself, with no argument to pass them). The overrides run
    on every request call uvicorn's methods directly: no ``super()`` lookup on that path."""

    limits: ClassVar[TransportLimits] = TransportLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        limits = self.limits
        # whatever the Config says (uvicorn annotates it int; it only goes to call_later)
        self.timeout_keep_alive = limits.idle_timeout_s  # type: ignore[assignment]
        #: a request head is being received: set when the connection opens and when a
        #: request's message ends, cleared when its successor's headers are complete
        self._in_head = True
        #: bytes the current head may still take (0 once refused: every read then takes the
        #: slow path, which drops it)
        self._max_head = self._head_left = limits.max_header_bytes
        #: when the current head must be complete (the loop's clock), None while a request
        #: is in progress
        self._head_deadline: float | None = None
        #: the connection's one header timer: pending at most until the deadline; when it
        #: fires early (the deadline moved on) it re-arms for the new one, so a busy
        #: connection does not start and cancel a timer per request
        self._head_timer: asyncio.TimerHandle | None = None
        self._refused = False

    # -- connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # uvicorn arms its keep-alive (idle) timer only when a response finishes: without
        # this a connection that never sends a byte is held for ever
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler)
        self._start_head_clock()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._unset_keepalive_if_required()  # uvicorn cancels it only on a clean close
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            if len(data) > self._head_left:
                self._data_over_allowance(data)
                return
            self._head_left -= len(data)
        HttpToolsProtocol.data_received(self, data)

    def _data_over_allowance(self, data: bytes) -> None:
        """A read longer than what the current head may still take: feed the parser what
        the head may take; if that completes it, go on with the rest (a body, a pipelined
        request) under the same rule, else refuse the head (431)."""
        while not self._refused and not self.transport.is_closing():
            room = self._head_left
            self._head_left = 0
            if room:
                super().data_received(data[:room])
                if self._refused or self.transport.is_closing():
                    return
            if self._in_head and self._head_left == 0:
                self._refuse_head()  # still the same head, and the rest is over the limit
                return
            data = data[room:]
            if self._in_head:
                # a request's message ended inside ``data[:room]`` and the next head starts
                # (its bytes there uncharged): the rest is charged to it
                if len(data) > self._head_left:
                    continue
                self._head_left -= len(data)
            super().data_received(data)  # a body, or a head within its allowance
            return

    def _refuse_head(self) -> None:
        """431 and close: the head is over ``max_header_bytes``. Reading stops there (a read
        still under way is dropped). If an earlier request's response is still being sent
        (pipelining), there is no answering in between: the connection is just closed."""
        self._refused = True
        self._head_left = 0
        self._in_head = True  # every further read takes the slow path, which drops it
        self._head_deadline = None
        limit = self._max_head
        if self.client is not None:
            self.logger.warning("%s:%d - request head over %d bytes (transport."
                                "max_header_bytes): 431, connection closed",
                                *self.client, limit)
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(_response(
                431, f"request line and headers over {limit} bytes (the server's limit, "
                     "transport.max_header_bytes)", self.server_state.default_headers))
        self.transport.close()

    def _start_head_clock(self) -> None:
        """The next head must be complete within ``header_timeout_s`` from now."""
        self._head_deadline = deadline = self.loop.time() + self.limits.header_timeout_s
        if self._head_timer is None:
            self._head_timer = self.loop.call_at(deadline, self._head_timer_fired)

    def _head_timer_fired(self) -> None:
        """The header timer: nothing to do if no head is awaited (the next response
        re-arms it), re-armed if the deadline moved on, else the head is late: close the
        connection, with a 408 first if part of a head had arrived."""
        self._head_timer = None
        deadline = self._head_deadline
        if deadline is None or self.transport.is_closing():
            return
        if deadline - self.loop.time() > CLOCK_SLACK_S:
            self._head_timer = self.loop.call_at(deadline, self._head_timer_fired)
            return
        if not (self.cycle is None or self.cycle.response_complete):
            return  # a request is in progress (cannot happen: its head was complete)
        if self._in_head and self._head_left < self._max_head:
            self.transport.write(_response(
                408, f"request line and headers not received within "
                     f"{self.limits.header_timeout_s:g} s (the server's limit, "
                     "transport.header_timeout_s)", self.server_state.default_headers))
        self.transport.close()

    # -- parser callbacks

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_deadline = None  # the timer, if pending, finds nothing to do
        HttpToolsProtocol.on_headers_complete(self)

    def on_message_complete(self) -> None:
        self._in_head = True
        self._head_left = self._max_head
        HttpToolsProtocol.on_message_complete(self)

    def on_response_complete(self) -> None:
        HttpToolsProtocol.on_response_complete(self)
        # the next head's deadline, unless the connection is gone or a (pipelined) request
        # whose head is complete is in progress; the request body may still be arriving
        # (an answer sent before it was read), which counts against the next head's time
        if self.cycle.response_complete and not self.transport.is_closing():
            self._start_head_clock()


def protocol_class(limits: TransportLimits) -> type[LimitedHttpToolsProtocol]:
    """:class:`LimitedHttpToolsProtocol` enforcing ``limits`` (uvicorn's ``http``)."""

    class Limited(LimitedHttpToolsProtocol):
        pass

    Limited.limits = limits
    Limited.__qualname__ = Limited.__name__ = "LimitedHttpToolsProtocol"
    return Limited


def uvicorn_options(limits: TransportLimits) -> dict[str, Any]:
    """The keyword arguments of ``uvicorn.run`` / ``uvicorn.Config`` enforcing ``limits``:
    the protocol, the keep-alive timeout and h11's buffer bound (used only if ``http`` is
    changed to ``"h11"``, which then answers an over-long head 400, not 431, and has
    neither the header deadline nor the idle bound before the first request)."""
    return {"http": protocol_class(limits),
            "timeout_keep_alive": limits.idle_timeout_s,
            "h11_max_incomplete_event_size": limits.max_header_bytes}
