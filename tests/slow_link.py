"""A full link for tests: a TCP proxy whose connections share one rate in the client ->
server direction, each with its own queue, served in turn (as a link whose queueing
discipline is fair per flow, the Linux default ``fq_codel``). A connection's bytes wait behind
its own earlier bytes; a new connection's first bytes wait for one chunk of each busy one.
The server -> client direction is not limited.

``SlowLink(target_port, rate_bps)`` listens on a free loopback port (:attr:`SlowLink.port`),
runs its own event loop on a thread, and is a context manager (closing ends every
connection)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

from envs.netutil import free_ports

CHUNK = 16 * 1024


class SlowLink:
    def __init__(self, target_port: int, rate_bps: float) -> None:
        self.target_port = target_port
        self.rate = rate_bps / 8.0  # bytes/s
        self.port = free_ports(1)[0]
        self.forwarded = 0          # client -> server bytes
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slow-link", daemon=True)
        self._next_free = 0.0
        self._turn: asyncio.Lock | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    def __enter__(self) -> SlowLink:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("slow link did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._turn = asyncio.Lock()   # FIFO: the busy connections take turns
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            for t in list(self._tasks):
                t.cancel()
            self._server.close()
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

    async def _pace(self, n: int) -> None:
        assert self._turn is not None
        async with self._turn:
            now = time.monotonic()
            start = max(now, self._next_free)
            self._next_free = start + n / self.rate
            await asyncio.sleep(self._next_free - now)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return

        async def copy(r: asyncio.StreamReader, w: asyncio.StreamWriter, paced: bool) -> None:
            try:
                while data := await r.read(CHUNK):
                    if paced:
                        await self._pace(len(data))
                        self.forwarded += len(data)
                    w.write(data)
                    await w.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    w.close()

        tasks = [asyncio.ensure_future(copy(reader, up_w, True)),
                 asyncio.ensure_future(copy(up_r, writer, False))]
        self._tasks.update(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.difference_update(tasks)
