"""A delaying TCP relay serving every connection of a namespace from one asyncio process, made
transparent by an nftables redirection (the edge paper's link delay between the RPC agents
and the bus, Rojas Balderrama and Simonin Section IV-B2, Table III, where ``tc netem``
set it; this kernel has no netem, so the delay is added in user space).

How a connection is delayed: a ``nat`` rule in a namespace redirects the TCP connections of
a path to the relay's port (:func:`install_redirect`); the relay reads the connection's
original destination back (``SO_ORIGINAL_DST``), connects there itself (its own sockets
carry the mark :data:`RELAY_MARK`, which the rule lets through) and copies both directions,
holding every chunk read for the delay before writing it, in order (a round trip gains
twice the delay). Clients keep the address they dialled, so TLS host names still verify.
The delay can be changed while the relay runs (``delay <ms>`` on its stdin; it answers
``ok``); chunks already held keep their due time, later ones wait behind them (order is
never changed).

Two rule shapes: ``output`` (in the sender's namespace: its connections to a port, e.g. every
agent's RPC port) and ``prerouting`` (in a server's namespace: connections arriving on its
link to a port, e.g. agents' connections to the broker, except those of one source).

CLI (what :class:`RelayProcess` starts): ``python -m delivery.relay --port P
[--delay-ms D] [--target host:port]``; it prints ``ready`` once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import struct
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path

__all__ = ["RELAY_MARK", "DelayRelayServer", "RelayError", "RelayProcess", "install_redirect",
           "remove_redirect"]

SO_ORIGINAL_DST = 80        # linux/netfilter_ipv4.h
SO_MARK = getattr(socket, "SO_MARK", 36)
RELAY_MARK = 0x5E1A         # the relay's own outgoing connections (not redirected again)
_TABLE = "smt_relay"
_EOF = b""


class RelayError(RuntimeError):
    """The relay or its redirection could not be set up (names the step)."""


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """The (address, port) a redirected connection was dialled to."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, addr = struct.unpack("!2xH4s8x", raw)
    return socket.inet_ntoa(addr), int(port)


class _Side(asyncio.Protocol):
    """One socket of a relayed connection: what it reads goes to ``peer`` after the delay."""

    def __init__(self, relay: DelayRelayServer) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.held: deque[tuple[float, bytes]] = deque()
        self.timer: asyncio.TimerHandle | None = None
        self.done = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.relay.bytes += len(data)
        self._hold(data)

    def eof_received(self) -> bool:
        self._hold(_EOF)
        return True  # half-closed: the other direction may still flow

    def connection_lost(self, exc: Exception | None) -> None:
        self.done = True
        self._hold(_EOF)  # the peer is closed once what was held before is written

    def _hold(self, data: bytes) -> None:
        loop = self.relay.loop
        assert loop is not None
        self.held.append((loop.time() + self.relay.delay_s, data))
        if self.timer is None:
            self._flush()

    def _flush(self) -> None:
        self.timer = None
        loop = self.relay.loop
        assert loop is not None
        now = loop.time()
        peer = self.peer
        while self.held and self.held[0][0] <= now:
            _, data = self.held.popleft()
            if peer is None or peer.transport is None or peer.transport.is_closing():
                continue
            if data is _EOF or not data:
                if peer.transport.can_write_eof():
                    peer.transport.write_eof()
                if self.done:
                    peer.transport.close()
            else:
                peer.transport.write(data)
        if self.held:
            self.timer = loop.call_at(self.held[0][0], self._flush)

    # back-pressure: our socket's send buffer is full -> stop reading from the peer
    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


class _Inbound(_Side):
    """The accepted socket: connects onwards, then starts relaying."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert self.transport is not None
        self.transport.pause_reading()
        self.relay.accepted += 1
        assert self.relay.loop is not None
        self.relay.loop.create_task(self._connect())

    async def _connect(self) -> None:
        assert self.transport is not None
        relay = self.relay
        loop = relay.loop
        assert loop is not None
        try:
            dst = relay.target or original_destination(self.transport.get_extra_info("socket"))
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, SO_MARK, RELAY_MARK)
            s.setblocking(False)
            await loop.sock_connect(s, dst)
            out = _Side(relay)
            await loop.create_connection(lambda: out, sock=s)
        except OSError:
            relay.failed += 1
            self.transport.close()
            return
        out.peer, self.peer = self, out
        self.transport.resume_reading()


class DelayRelayServer:
    """The relay inside a running event loop: listens on ``port`` (all addresses) and relays
    each connection to its original destination (or ``target``) with ``delay_ms`` each way."""

    def __init__(self, port: int, delay_ms: float = 0.0,
                 target: tuple[str, int] | None = None) -> None:
        self.port, self.target = port, target
        self.delay_s = 0.0
        self.set_delay(delay_ms)
        self.loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self.accepted = self.failed = self.bytes = 0
        self._server: asyncio.base_events.Server | None = None

    def set_delay(self, delay_ms: float) -> None:
        if not delay_ms >= 0:
            raise RelayError(f"relay delay must be >= 0 ms, got {delay_ms!r}")
        self.delay_s = float(delay_ms) / 1e3

    async def start(self) -> DelayRelayServer:
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(lambda: _Inbound(self), "0.0.0.0",
                                                     self.port, reuse_address=True,
                                                     backlog=4096)
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.close()


# ---------------------------------------------------------------------------- nftables
def _nft(ns: str, rules: str, check: bool = True) -> None:
    out = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=rules,
                         capture_output=True, text=True, check=False)
    if check and out.returncode != 0:
        raise RelayError(f"nft in {ns} failed: {out.stderr.strip()[:500]}")


def install_redirect(ns: str, hook: str, dport: int, to_port: int, *,
                     daddr: str | None = None, not_saddr: str | None = None) -> None:
    """Redirect TCP connections to ``dport`` in namespace ``ns`` to the relay on ``to_port``:
    ``hook="output"``: connections made in ``ns`` (to ``daddr``, a prefix, if given);
    ``hook="prerouting"``: connections arriving on its ``eth0`` (except from ``not_saddr``).
    The relay's own connections (:data:`RELAY_MARK`) pass. Replaces an earlier redirection."""
    if hook not in ("output", "prerouting"):
        raise RelayError(f"redirect hook must be output or prerouting, got {hook!r}")
    match = []
    if hook == "prerouting":
        match.append('iifname "eth0"')
    if daddr:
        match.append(f"ip daddr {daddr}")
    if not_saddr:
        match.append(f"ip saddr != {not_saddr}")
    remove_redirect(ns)
    _nft(ns, f"table ip {_TABLE} {{\n chain relay {{\n  type nat hook {hook} priority -100; "
             f"policy accept;\n  meta mark {RELAY_MARK} accept\n  {' '.join(match)} tcp dport "
             f"{int(dport)} redirect to :{int(to_port)}\n }}\n}}\n")


def remove_redirect(ns: str) -> None:
    """Remove the redirection of :func:`install_redirect` from ``ns`` (none: nothing)."""
    _nft(ns, f"delete table ip {_TABLE}\n", check=False)


# ---------------------------------------------------------------------------- process
class RelayProcess:
    """A relay process in a namespace (``prefix``: ``ip netns exec <ns>``), controlled over
    its stdin: :meth:`set_delay`; :attr:`pid` for its CPU and memory; :meth:`close`."""

    def __init__(self, prefix: Sequence[str], port: int, delay_ms: float = 0.0,
                 target: tuple[str, int] | None = None) -> None:
        self.prefix, self.port, self.delay_ms, self.target = list(prefix), port, delay_ms, target
        self._proc: subprocess.Popen[str] | None = None

    def start(self) -> RelayProcess:
        cmd = [*self.prefix, sys.executable, "-m", "delivery.relay", "--port", str(self.port),
               "--delay-ms", str(self.delay_ms)]
        if self.target:
            cmd += ["--target", f"{self.target[0]}:{self.target[1]}"]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, cwd=Path(__file__).resolve().parents[1])
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().strip()
        if line != "ready":
            self.close()
            raise RelayError(f"relay on port {self.port} did not start (said {line!r})")
        return self

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def set_delay(self, delay_ms: float) -> None:
        p = self._proc
        assert p is not None and p.stdin is not None and p.stdout is not None
        p.stdin.write(f"delay {float(delay_ms)}\n")
        p.stdin.flush()
        answer = p.stdout.readline().strip()
        if answer != "ok":
            raise RelayError(f"relay on port {self.port}: delay {delay_ms} refused: {answer!r}")
        self.delay_ms = delay_ms

    def close(self) -> None:
        p, self._proc = self._proc, None
        if p is None:
            return
        with contextlib.suppress(OSError, ValueError):
            assert p.stdin is not None
            p.stdin.close()
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def __enter__(self) -> RelayProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _control(relay: DelayRelayServer, stop: asyncio.Event) -> None:
    """Read ``delay <ms>`` lines from stdin (answer ``ok`` or ``error ...``); EOF stops."""
    loop = relay.loop
    assert loop is not None
    for line in sys.stdin:
        parts = line.split()
        try:
            if len(parts) != 2 or parts[0] != "delay":
                raise RelayError(f"unknown command {line.strip()!r} (expected: delay <ms>)")
            ms = float(parts[1])
            loop.call_soon_threadsafe(relay.set_delay, ms)
            print("ok", flush=True)
        except (RelayError, ValueError) as e:
            print(f"error {e}", flush=True)
    loop.call_soon_threadsafe(stop.set)


async def _serve(port: int, delay_ms: float, target: tuple[str, int] | None) -> None:
    relay = await DelayRelayServer(port, delay_ms, target).start()
    stop = asyncio.Event()
    print("ready", flush=True)
    threading.Thread(target=_control, args=(relay, stop), daemon=True).start()
    await stop.wait()
    relay.close()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m delivery.relay",
                                 description="a delaying transparent TCP relay")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--target", default=None, help="host:port (default: the redirected "
                    "connection's original destination)")
    args = ap.parse_args(argv)
    target = None
    if args.target:
        host, _, port = args.target.rpartition(":")
        target = (host, int(port))
    asyncio.run(_serve(args.port, args.delay_ms, target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
