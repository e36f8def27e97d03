"""The HTTP connection limits of the policy server (:mod:`serving.transport`), against the
real thing: ``serve.py`` under uvicorn (:class:`serving.local.LocalServer`), raw sockets.

An over-long request head gets 431 and the connection is closed without the server reading
on (its memory stays flat under 64 MB of header bytes); a head trickled in is cut off at the
header deadline (408); a connection that sends nothing is closed at the idle timeout, before
its first request too; ordinary requests, keep-alive and pipelining are unaffected. The byte
count at the limit's edge (however the head is split into reads, pipelined or followed by a
body) is checked in process, on the protocol with a stand-in transport. Of the two servers,
one serves HTTPS with the test run's PKI, one plain HTTP (where TLS does not matter); both
have 1 s deadlines so the tests stay short."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import time

import pytest
from uvicorn.config import Config
from uvicorn.server import ServerState

from security.tls import Security, client_ssl_context
from serving.local import LocalServer
from serving.transport import (
    LimitedHttpToolsProtocol,
    TransportLimits,
    protocol_class,
    uvicorn_options,
)

KEY = "ctl-transport-test-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0"
HEADER_TIMEOUT_S = IDLE_TIMEOUT_S = 1.0
SLACK_S = 3.0  # a shared 2-core machine: a close is "in time" within the limit + this
LIMIT = TransportLimits().max_header_bytes  # the default, which the servers keep
OVERRIDES = [f"++transport.header_timeout_s={HEADER_TIMEOUT_S}",
             f"++transport.idle_timeout_s={IDLE_TIMEOUT_S}"]

tls_group = pytest.mark.xdist_group("transport-tls")  # one server per group and worker
plain_group = pytest.mark.xdist_group("transport-plain")


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    with LocalServer(None, tmp_path_factory.mktemp("transport-tls"), api_key=KEY,
                     overrides=OVERRIDES) as s:
        yield s


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    with LocalServer(None, tmp_path_factory.mktemp("transport-plain"), api_key=KEY,
                     security=Security(insecure=True), overrides=OVERRIDES) as s:
        yield s


class Conn:
    """A raw HTTP/1.1 connection to ``srv`` (TLS unless it is insecure): bytes out,
    responses in."""

    def __init__(self, srv: LocalServer, timeout: float = 10.0) -> None:
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=timeout)
        if not srv.security.insecure:
            sock = client_ssl_context(srv.security).wrap_socket(
                sock, server_hostname="127.0.0.1")
        self.sock, self.buf = sock, b""
        self.opened = time.monotonic()

    def send(self, data: bytes) -> bool:
        """Send ``data``; False if the server had closed the connection."""
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            return False
        return True

    def response(self) -> tuple[int, dict[str, str], bytes]:
        """The next response (status, headers, body): Content-Length framed."""
        while b"\r\n\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError(f"closed after {self.buf!r}")
            self.buf += chunk
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(ln.lower().split(": ", 1) for ln in lines[1:])
        n = int(headers["content-length"])
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError("closed inside a body")
            self.buf += chunk
        body, self.buf = self.buf[:n], self.buf[n:]
        return int(lines[0].split()[1]), headers, body

    def until_closed(self, timeout: float, trickle: bytes = b"") -> tuple[bool, bytes]:
        """Read until the server closes the connection (True) or ``timeout`` s after it was
        opened (False), sending ``trickle`` one byte every 0.25 s meanwhile; and what was
        read."""
        self.sock.settimeout(0.25)
        got, sent = self.buf, 0
        while time.monotonic() - self.opened < timeout:
            if sent < len(trickle):
                if not self.send(trickle[sent:sent + 1]):
                    return True, got + self._rest()
                sent += 1
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                continue
            except (ConnectionResetError, ssl.SSLError):
                return True, got
            if not chunk:
                return True, got
            got += chunk
        return False, got

    def _rest(self) -> bytes:
        """Whatever the server sent before closing (after a failed send)."""
        try:
            self.sock.settimeout(2.0)
            out = b""
            while chunk := self.sock.recv(65536):
                out += chunk
            return out
        except OSError:
            return b""

    def close(self) -> None:
        self.sock.close()


def head(path: str = "/v1/health/live", extra: bytes = b"") -> bytes:
    return (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: {KEY}\r\n".encode()
            + extra + b"\r\n")


def rss_kib(srv: LocalServer) -> int:
    assert srv.proc is not None
    with open(f"/proc/{srv.proc.pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))


# --------------------------------------------------------------------------- settings


def test_limits_are_validated_and_unknown_keys_refused():
    assert TransportLimits.from_mapping(None) == TransportLimits()
    got = TransportLimits.from_mapping({"max_header_bytes": 8192, "idle_timeout_s": 2})
    assert (got.max_header_bytes, got.header_timeout_s, got.idle_timeout_s) == (8192, 10.0, 2)
    with pytest.raises(ValueError, match=r"transport: unknown key\(s\) \['header_bytes'\]"):
        TransportLimits.from_mapping({"header_bytes": 8192})
    for bad in ({"max_header_bytes": 100}, {"max_header_bytes": 16384.0},
                {"max_header_bytes": True}, {"header_timeout_s": 0},
                {"idle_timeout_s": float("inf")}, {"idle_timeout_s": "5"}):
        with pytest.raises(ValueError, match=r"transport\.\w+ must be"):
            TransportLimits.from_mapping(bad)
    opts = uvicorn_options(TransportLimits(idle_timeout_s=3.0))
    assert issubclass(opts["http"], LimitedHttpToolsProtocol)
    assert opts["http"].limits.idle_timeout_s == opts["timeout_keep_alive"] == 3.0
    assert opts["h11_max_incomplete_event_size"] == LIMIT


# --------------------------------------------------------------------------- header size


async def _echo_app(scope, receive, send):
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


class _Transport(asyncio.Transport):
    """What the protocol writes, and whether it closed."""

    def __init__(self) -> None:
        super().__init__()
        self.out, self.closing = b"", False

    def write(self, data) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 1), "peername": ("127.0.0.1", 2)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _request(head_bytes: int, body: bytes = b"") -> bytes:
    """A POST whose request line and headers take exactly ``head_bytes``."""
    start = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nX-Pad: " % len(body)
    return start + b"p" * (head_bytes - len(start) - 4) + b"\r\n\r\n" + body


@pytest.mark.parametrize(("reads", "answers"), [
    pytest.param([_request(LIMIT)], 1, id="at-limit"),
    pytest.param([_request(LIMIT + 1)], 0, id="over"),
    pytest.param([_request(LIMIT, b"b" * 100_000)], 1, id="at-limit-with-body"),
    pytest.param([_request(LIMIT + 1, b"b" * 100_000)], 0, id="over-with-body"),
    pytest.param([_request(LIMIT)[:7000], _request(LIMIT)[7000:]], 1, id="at-limit-split"),
    pytest.param([_request(LIMIT + 1)[:-1], _request(LIMIT + 1)[-1:]], 0, id="over-by-a-byte"),
    pytest.param([_request(LIMIT), _request(LIMIT)], 2, id="keep-alive"),
    pytest.param([_request(LIMIT) * 3], 3, id="pipelined-at-limit"),
    pytest.param([_request(60) * 400], 400, id="pipelined-small"),
    pytest.param([b"GET / HTTP/1.1\r\nX: "] + [b"a" * 1000] * 20, 0, id="trickled-over"),
])
def test_head_bytes_are_counted_at_the_limit(reads, answers):
    async def run() -> _Transport:
        config = Config(app=_echo_app, log_config=None)  # the test run's logging kept
        config.load()
        p = protocol_class(TransportLimits())(config=config, server_state=ServerState(),
                                              app_state={})
        t = _Transport()
        p.connection_made(t)
        for data in reads:
            p.data_received(data)
            for _ in range(5):
                await asyncio.sleep(0)
        for _ in range(2000):  # the application's tasks, the pipelined ones one by one
            if t.out.count(b"HTTP/1.1 200 OK") == answers or t.closing:
                break
            await asyncio.sleep(0)
        if t.closing:
            p.data_received(b"x" * 100_000)  # what arrives after a refusal: dropped
        closed = t.closing
        p.connection_lost(None)
        t.closing = closed
        return t

    t = asyncio.run(run())
    assert t.out.count(b"HTTP/1.1 200 OK") == answers
    refused = answers == 0
    assert t.out.count(b"HTTP/1.1 431 ") == int(refused) and t.closing == refused


@tls_group
def test_over_long_head_gets_431_and_the_connection_closes(tls_server):
    c = Conn(tls_server)
    try:
        c.send(head(extra=b"X-Big: " + b"a" * (1 << 20) + b"\r\n"))  # may fail: closed
        closed, got = c.until_closed(10.0)
    finally:
        c.close()
    assert closed, "the connection stayed open after an over-long head"
    status_line, _, rest = got.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 431 Request Header Fields Too Large", got[:300]
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert str(LIMIT) in body["detail"] and "max_header_bytes" in body["detail"]
    # the server goes on serving
    c = Conn(tls_server)
    try:
        c.send(head())
        assert c.response()[0] == 200
    finally:
        c.close()


@plain_group
def test_64_mib_of_header_bytes_are_not_read(plain_server):
    def flood(total: int) -> tuple[int, bool]:
        """Send a head of ``total`` header bytes; bytes sent before the server closed."""
        c = Conn(plain_server, timeout=3.0)
        try:
            sent, chunk = 0, b"a" * 65536
            c.send(b"GET /v1/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
            while sent < total:
                try:
                    c.sock.sendall(chunk)
                except TimeoutError:
                    return sent, False  # the server neither reads nor closes
                except (BrokenPipeError, ConnectionResetError):
                    return sent, True
                sent += len(chunk)
            return sent, False
        finally:
            c.close()

    flood(1 << 20)  # the refusal's own first-use allocations, before the baseline
    before = rss_kib(plain_server)
    sent, closed = flood(64 << 20)
    time.sleep(0.2)
    grown = rss_kib(plain_server) - before
    assert closed, f"the server neither closed nor refused after {sent >> 20} MiB"
    assert sent < 16 << 20, f"{sent >> 20} MiB of header bytes taken"  # socket buffers
    assert grown < 4096, f"the server's RSS grew by {grown} KiB"


# --------------------------------------------------------------------------- deadlines


@plain_group
def test_a_trickled_head_is_cut_off_at_the_header_deadline(plain_server):
    c = Conn(plain_server)
    try:
        c.send(b"GET /v1/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        closed, got = c.until_closed(HEADER_TIMEOUT_S + SLACK_S, trickle=b"X-Slow: " * 100)
    finally:
        c.close()
    assert closed, f"a head trickled in stayed open {HEADER_TIMEOUT_S + SLACK_S} s"
    assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), got[:300]
    assert b"header_timeout_s" in got


@plain_group
def test_a_connection_that_sends_nothing_is_closed(plain_server):
    c = Conn(plain_server)
    try:
        closed, got = c.until_closed(IDLE_TIMEOUT_S + SLACK_S)
    finally:
        c.close()
    assert closed and got == b"", f"a silent connection: closed={closed}, got {got[:200]!r}"


@tls_group
def test_silent_tls_connections_are_closed_before_and_after_a_request(tls_server):
    first = Conn(tls_server)  # handshake done, no request
    second = Conn(tls_server)
    try:
        second.send(head())
        assert second.response()[0] == 200
        second.opened = time.monotonic()  # idle from the end of its response
        for c in (first, second):
            closed, got = c.until_closed(IDLE_TIMEOUT_S + SLACK_S)
            assert closed and got == b"", f"closed={closed}, got {got[:200]!r}"
    finally:
        first.close()
        second.close()


# --------------------------------------------------------------------------- normal use


@tls_group
def test_keep_alive_pipelining_and_bodies_still_work(tls_server):
    c = Conn(tls_server)
    try:
        for _ in range(3):  # one connection, several requests in turn
            c.send(head())
            status, headers, body = c.response()
            assert status == 200 and headers.get("connection") != "close", body
        c.send(head() + head("/v1/health/ready"))  # pipelined, in one write
        assert [c.response()[0] for _ in range(2)] == [200, 200]
        # a body far larger than the header limit, arriving with its head in one write
        big = b"[" + b"0," * (64 * 1024) + b"0]"
        c.send(f"POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: {KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(big)}\r\n\r\n"
               .encode() + big)
        status, _, body = c.response()
        assert status == 422, body[:300]
        # a head just under the limit: served, on the same connection
        pad = LIMIT - len(head()) - len(b"X-Pad: \r\n") - 1
        c.send(head(extra=b"X-Pad: " + b"p" * pad + b"\r\n"))
        assert c.response()[0] == 200
    finally:
        c.close()
