"""The real shaper (delivery/shaper.py) on real loopback TCP connections: real bytes, real
sockets, throughput measured where the bytes arrive. A few seconds in all."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from delivery.shaper import ConnectionShaper, ShapedWriter, SharedLimits
from envs.shaping.sincon import ShapingError


class Receiver:
    """A TCP server on a free loopback port; each connection first sends its index (1 byte),
    then data; every read is recorded as (time, bytes) and the bytes are kept."""

    def __init__(self) -> None:
        self.reads: dict[int, list[tuple[float, int]]] = {}
        self.data: dict[int, bytearray] = {}
        self.done: dict[int, asyncio.Event] = {}

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        idx = (await reader.readexactly(1))[0]
        loop = asyncio.get_running_loop()
        reads, buf = self.reads.setdefault(idx, []), self.data.setdefault(idx, bytearray())
        ev = self.done.setdefault(idx, asyncio.Event())
        while chunk := await reader.read(1 << 16):
            reads.append((loop.time(), len(chunk)))
            buf += chunk
        ev.set()
        writer.close()

    def throughput(self, idx: int, t0: float, t1: float) -> float:
        return sum(n for t, n in self.reads.get(idx, []) if t0 <= t < t1) / (t1 - t0)

    async def close(self) -> None:
        self.server.close()
        await self.server.wait_closed()


async def _connect(port: int, idx: int) -> asyncio.StreamWriter:
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(bytes([idx]))
    await writer.drain()
    return writer


async def _offer(writer, rate: float, start: float, stop: float, tick: float = 0.005) -> int:
    """Write ``rate`` bytes/s in ticks from loop time ``start`` to ``stop``; the unshaped
    writer waits for the socket (drain), the shaped one queues."""
    loop = asyncio.get_running_loop()
    payload = os.urandom(int(rate * tick))
    k, sent = 0, 0
    while (t := start + k * tick) < stop:
        await asyncio.sleep(max(0.0, t - loop.time()))
        writer.write(payload)
        sent += len(payload)
        if not isinstance(writer, ShapedWriter):
            await writer.drain()
        k += 1
    return sent


RATES = [8e6, 4e6, 1e6, 0.25e6]     # unequal senders (bytes/s offered)
STARTS = [0.0, 0.05, 0.1, 0.15]     # the greediest starts first
G = 2e6


async def _fairness_run(policy: str | None) -> np.ndarray:
    rx = Receiver()
    port = await rx.start()
    loop = asyncio.get_running_loop()
    shared = SharedLimits(policy, len(RATES), G) if policy else None
    writers = []
    for i in range(len(RATES)):
        w = await _connect(port, i)
        writers.append(ShapedWriter(w, ConnectionShaper(shared)) if shared else w)
    t0 = loop.time() + 0.05
    stop = t0 + 1.3
    await asyncio.gather(*(_offer(w, r, t0 + s, stop) for w, r, s in zip(writers, RATES, STARTS)))
    tput = np.array([rx.throughput(i, t0 + 0.3, stop) for i in range(len(RATES))])
    for w in writers:
        w.close()
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in rx.done.values())), 5)
    await rx.close()
    if shared is not None and shared.calculator is not None:
        assert shared.calculator.growths > 0  # the adaptive calculator did adapt
    return tput


def test_sincon_evens_out_unequal_senders_on_real_sockets():
    unshaped = asyncio.run(_fairness_run(None))
    sincon = asyncio.run(_fairness_run("sincon"))
    # without shaping every sender gets what it offers; with Sincon the greedy ones are held
    np.testing.assert_allclose(unshaped, RATES, rtol=0.25)
    assert sincon.sum() <= G * 1.1
    assert sincon.std() < unshaped.std() / 3, (sincon, unshaped)


async def _one_connection(policy: str, n_channels: int, total: int) -> tuple:
    rx = Receiver()
    port = await rx.start()
    shared = SharedLimits(policy, n_channels, G)
    shaped = ShapedWriter(await _connect(port, 0), ConnectionShaper(shared), chunk_bytes=8192)
    blob = os.urandom(total)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    sizes = np.random.default_rng(0).integers(1, 30000, 200)
    await asyncio.sleep(0.01)  # the receiver has registered the connection
    i = 0
    for n in sizes:  # uneven writes, all at once: the shaper queues them
        shaped.write(blob[i:i + int(n)])
        i += int(n)
        if i >= total:
            break
    shaped.write(blob[i:])
    await shaped.drain()
    elapsed = loop.time() - t0
    shaped.close()
    await shaped.wait_closed()
    await asyncio.wait_for(rx.done[0].wait(), 5)
    await rx.close()
    second_half = rx.throughput(0, t0 + elapsed / 2, t0 + elapsed)
    return blob, bytes(rx.data[0]), shaped, second_half, shared


def test_no_byte_dropped_and_queue_bounded_by_what_was_offered():
    blob, got, shaped, _, _ = asyncio.run(_one_connection("sincon", 4, 400_000))
    assert got == blob                                   # every byte, in order
    assert shaped.sent_bytes == len(blob) and shaped.queued_bytes == 0
    assert 0 < shaped.max_queued_bytes <= len(blob)


def test_real_throughput_converges_to_a_static_limit():
    blob, got, _, steady, _ = asyncio.run(_one_connection("static", 4, 800_000))
    assert got == blob
    # after the first burst (which passes within the burst allowance) the rate is the limit
    assert steady == pytest.approx(G / 4, rel=0.1)


def test_too_many_connections_is_an_error():
    shared = SharedLimits("static", 1, G)
    ConnectionShaper(shared)
    with pytest.raises(ShapingError, match="all 1 channels are taken"):
        ConnectionShaper(shared)
