"""Sincon's control-channel shaping on real connections (asyncio).

The controller's RPC connections to the compute-node agents are the *control channels* of
Sincon (Yoo et al.); they share the controller's link. This module shapes them with the
logic of :mod:`envs.shaping.sincon` (not a copy):

* :class:`SharedLimits`: the limit policy shared by the connections of one link direction:
  Sincon's adaptive limit calculator (Section III-A), a static equal split or none.
  Connections register to get a channel index.
* :class:`ConnectionShaper`: one per connection, the delay-based channel shaper of Section
  III-B. :meth:`ConnectionShaper.account` is its synchronous bookkeeping: it accounts a
  message processed now (the delay to the next one as :class:`ShaperConfig` reads Section
  III-B: by default none within a burst allowance, then pacing at the limit), reports the
  channel's usage to the shared calculator (which checks it every 5 messages) and returns how
  long until the channel may process its next message. :meth:`ConnectionShaper.pace` is the
  asyncio wait around it; the threaded per-tenant shaper (:mod:`delivery.fairness`) drives
  ``account`` from its own thread, so both use the same code and calculator.
* :class:`ShapedWriter`: a byte-stream front of an :class:`asyncio.StreamWriter`: ``write``
  queues (never drops), a pump task sends the queue through :meth:`ConnectionShaper.pace`;
  ``drain`` waits until everything queued has been handed to the socket.

For a gRPC channel, call ``await shaper.pace(len(payload))`` before each call or stream write
(channel_write) and after each read of ``n`` bytes (channel_read). ``pace`` belongs to a
single event loop; ``account`` takes no lock (a threaded caller serialises the connections of
one :class:`SharedLimits` itself).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable

from envs.shaping.sincon import (
    ChannelShaper,
    LimitPolicy,
    ShaperConfig,
    ShapingError,
    SinconConfig,
    make_policy,
)

__all__ = ["ConnectionShaper", "ShapedWriter", "SharedLimits"]


class SharedLimits:
    """The limits of ``num_channels`` connections sharing ``global_throughput`` bytes/s.

    ``policy``: ``"sincon"`` (adaptive, Section III-A), ``"static"`` (``G / N`` each) or
    ``"none"``. ``sincon`` overrides :class:`SinconConfig`'s constants (not ``G``).
    """

    def __init__(self, policy: str, num_channels: int, global_throughput: float,
                 sincon: dict | None = None) -> None:
        cfg = SinconConfig(global_throughput=global_throughput, **dict(sincon or {}))
        self.policy: LimitPolicy = make_policy(policy, num_channels, global_throughput, cfg)
        self.name = policy
        self.num_channels = int(num_channels)
        self.global_throughput = float(global_throughput)
        self._next = 0

    def register(self) -> int:
        """A channel index for a new connection."""
        if self._next >= self.num_channels:
            raise ShapingError(f"SharedLimits: all {self.num_channels} channels are taken; "
                               "create it with a larger num_channels")
        self._next += 1
        return self._next - 1

    def limit(self, channel: int) -> float:
        return float(self.policy.limits[channel])

    @property
    def calculator(self):
        """The adaptive limit calculator (Sincon only, else None)."""
        return getattr(self.policy, "calculator", None)


class ConnectionShaper:
    """Section III-B for one connection (a registered channel of ``shared``).

    ``catchup_s``: timers fire late; the next delay counts from when the processing was due
    if that is at most ``catchup_s`` ago (else from now). ``bypass_at``: a limit at or above
    it means no shaping (default ``shared.global_throughput``: a channel holding the whole
    link is left to the link; pass ``math.inf`` to pace even a channel limited to ``G``).
    """

    def __init__(self, shared: SharedLimits, shaper: ShaperConfig | None = None,
                 clock: Callable[[], float] | None = None, catchup_s: float = 0.01,
                 bypass_at: float | None = None) -> None:
        self.shared = shared
        self.catchup_s = float(catchup_s)
        self.channel = shared.register()
        self.shaper = ChannelShaper(shaper, bypass_at=shared.global_throughput
                                    if bypass_at is None else bypass_at)
        self._clock = clock
        self._ready_at = 0.0
        self._lock: asyncio.Lock | None = None
        self.processed_bytes = 0
        self.processed_messages = 0
        self.last_delay = 0.0

    def _now(self) -> float:
        return self._clock() if self._clock else asyncio.get_running_loop().time()

    @property
    def usage(self) -> float:
        """The channel's measured throughput now (bytes/s)."""
        return self.shaper.meter.read(self._now())

    @property
    def limit(self) -> float:
        """The channel's current limit (bytes/s; ``inf``: none)."""
        return self.shared.limit(self.channel)

    @property
    def ready_at(self) -> float:
        """When (clock time) the channel may process its next message."""
        return self._ready_at

    def due_in(self, now: float) -> float:
        """Seconds from ``now`` until the channel may process its next message (0: at once)."""
        return max(0.0, self._ready_at - now)

    def account(self, now: float, nbytes: int) -> float:
        """Account ``nbytes`` processed at ``now`` (Section III-B: the delay before the next
        processing, ``last_delay``; the usage reported to the shared calculator, Section
        III-A; the counters). Returns the seconds until the channel may process its next
        message. The caller makes sure the channel's time has come (:meth:`due_in`)."""
        delay, usage = self.shaper.process(now, nbytes, self.shared.limit(self.channel))
        self.shared.policy.on_processed(self.channel, usage)
        # timers wake late: count the next delay from when this processing was due
        # (up to catchup_s ago), so oversleeping does not lower the throughput
        self._ready_at = max(self._ready_at, now - self.catchup_s) + delay
        self.processed_bytes += nbytes
        self.processed_messages += 1
        self.last_delay = delay
        return max(0.0, self._ready_at - now)

    async def pace(self, nbytes: int) -> float:
        """Wait for the channel's turn, then :meth:`account` ``nbytes`` processed; returns
        the delay set before the next processing."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            wait = self._ready_at - self._now()
            if wait > 0:
                await asyncio.sleep(wait)
            self.account(self._now(), nbytes)
            return self.last_delay


class ShapedWriter:
    """A shaped front of ``writer``: ``write`` queues, a pump sends through the shaper.

    Data is cut into messages of at most ``chunk_bytes`` (one ``pace`` each); nothing is
    dropped. ``queued_bytes`` is what waits; ``max_queued_bytes`` its peak.
    """

    def __init__(self, writer: asyncio.StreamWriter, shaper: ConnectionShaper,
                 chunk_bytes: int = 16384) -> None:
        if chunk_bytes < 1:
            raise ShapingError(f"ShapedWriter: chunk_bytes must be >= 1, got {chunk_bytes}")
        self.writer, self.shaper, self.chunk = writer, shaper, int(chunk_bytes)
        self._queue: deque[bytes] = deque()
        self.queued_bytes = 0
        self.max_queued_bytes = 0
        self.sent_bytes = 0
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._task = asyncio.get_running_loop().create_task(self._pump())

    def write(self, data: bytes) -> None:
        if self._error is not None:
            raise ConnectionError(f"ShapedWriter: the pump failed: {self._error!r}")
        if self._task.done():
            raise ShapingError("ShapedWriter: write() after close()")
        data = bytes(data)
        if len(data) <= self.chunk:
            self._queue.append(data)
        else:
            mv = memoryview(data)
            self._queue.extend(bytes(mv[i:i + self.chunk])
                               for i in range(0, len(mv), self.chunk))
        self.queued_bytes += len(data)
        self.max_queued_bytes = max(self.max_queued_bytes, self.queued_bytes)
        if data:
            self._idle.clear()
            self._wakeup.set()

    async def _pump(self) -> None:
        try:
            while True:
                if not self._queue:
                    self._idle.set()
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                msg = self._queue[0]
                await self.shaper.pace(len(msg))
                self._queue.popleft()
                self.writer.write(msg)
                self.queued_bytes -= len(msg)
                self.sent_bytes += len(msg)
                await self.writer.drain()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the connection broke: surface it in write()/drain()
            self._error = e
            self._idle.set()

    async def drain(self) -> None:
        """Wait until every queued byte has been handed to the socket (and drained)."""
        await self._idle.wait()
        if self._error is not None:
            raise ConnectionError(f"ShapedWriter: the pump failed: {self._error!r}")
        await self.writer.drain()

    def close(self) -> None:
        """Stop the pump (what is still queued is not sent) and close the writer."""
        self._task.cancel()
        self.writer.close()

    async def wait_closed(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()
