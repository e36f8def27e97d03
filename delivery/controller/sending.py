"""Sending (:mod:`delivery.controller`): the durable outbox, RPC pushes and MQ
publishes under the dispatch lock, C_p's in-flight limit, and flushes."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from envs.dsmd.message import Message

from ..wire import (
    encode,
    envelope,
    resource_key,
)
from .support import (
    RPC,
    TopicRefused,
)

__all__ = ["SendingMixin"]

log = logging.getLogger(__package__)  # the controller's one logger, "delivery.controller"


class SendingMixin:
    """Methods of :class:`delivery.controller.Controller` (their state is set in its
    ``__init__``)."""

    # ------------------------------------------------------------------ messages
    def send(self, msg: Message, type_id: int) -> None:
        """Accept and dispatch one Table I message of type ``type_id`` (see
        :meth:`send_many`)."""
        self.send_many([(msg, type_id)])

    def send_many(self, items: Sequence[tuple[Message, int]]) -> None:
        """Accept messages ``(message, type id)``: durable in the outbox (one transaction)
        when this returns, then dispatched by their types' current channels (RPC messages
        leave at the next :meth:`flush`), through the tenant shaper when shaping is on."""
        encoded = [(msg, int(t), encode(msg, t, self.payloads.of(msg.size_bytes)))
                   for msg, t in items]
        if not encoded:
            return
        if self.cfg.shaping.enabled and self._shaper is None:
            self._start_shaper()  # ShapingError (nothing stored) when G is unknown
        if self.cfg.outbox:
            self.store.outbox_put([(cm.timestamp_ns, t, cm.vpc_id, cm.SerializeToString(),
                                    msg.hosts) for msg, t, cm in encoded], time.time_ns())
            self.stats.outbox_stored += len(encoded)
        with self._dispatch:
            self._in_send.active = True
            try:
                if not self._mq_down:
                    self._prepare_producers(self.channel.get(t, RPC) for _, t, _ in encoded)
                for msg, t, cm in encoded:
                    if t not in self.hosts:
                        self.hosts[t] = tuple(msg.hosts)
                    self._rates.add(t, msg.size_bytes, len(msg.hosts))
                    with self._lock:
                        self._latest[resource_key(cm)] = cm
                    if self._shaper is None:
                        self._dispatch_one(t, cm)
                    else:  # Eq. 1's controller egress of the message on its channel now
                        fan = len(msg.hosts) if self.channel.get(t, RPC) == RPC else 1
                        self._shaper.submit(int(msg.vpc_id), len(cm.payload) * fan, (t, cm))
            finally:
                self._in_send.active = False

    def _dispatch_failed(self, t: int, c: int, cm: Any, e: Exception) -> None:
        """An accepted (stored) message whose topic ``c`` refused it (its producer could not
        be created while the broker is away and not yet known to be down): it goes over
        RPC, so it never waits in the outbox for a restart."""
        (log.debug if isinstance(e, TopicRefused) else log.warning)(
            "type %d: message %d could not go on topic %d (%s); it goes over RPC",
            t, cm.message_id, c, e)
        with self._lock:
            for n in cm.hosts:
                self._outbox[n].append(cm)
        self.stats.rerouted += 1

    def _release(self, items: list[tuple[int, Any]]) -> None:
        """The tenant shaper's release: dispatch (and, from its pump thread, push at once)."""
        with self._dispatch:
            for t, cm in items:
                self._dispatch_one(t, cm)
            if not getattr(self._in_send, "active", False):
                self._flush_locked()

    def _dispatch_one(self, t: int, cm: Any, gate: bool = True) -> None:
        """One accepted message onto its type's channel (under the dispatch lock); held
        while a switch moves its type (see :meth:`set_channels`)."""
        if gate and self._gated:
            with self._lock:
                if t in self._gated:
                    self._gated_msgs.append((t, cm))
                    self.stats.switch_held += 1
                    return
        c = self.channel.get(t, RPC)
        if c != RPC and self._mq_down:
            if t not in self._failover_types:  # over the capacities: waits for the broker
                with self._lock:
                    self._held.append((t, cm))
                self.stats.held += 1
                return
            c = RPC
            self.stats.rerouted += 1
        if c == RPC:
            with self._lock:
                for n in cm.hosts:
                    self._outbox[n].append(cm)
            return
        try:
            self._publish(c, envelope(cm), cm)
        except Exception as e:  # stored, whichever path dispatched it: RPC takes it
            self._dispatch_failed(t, c, cm, e)
            return
        self.stats.mq_messages += 1

    def _publish(self, t: int, data: bytes, cm: Any = None) -> None:
        # the producer first: a topic that refuses one leaves nothing behind (no unit, no
        # publish in flight, nothing awaiting the MQ's confirmation)
        producer = self._producer(t)
        # C_p: one unit, waiting for it if the limit is full (none while the MQ channel is
        # down: the broker takes nothing then)
        units = 0 if self._mq_down else self._limiter.acquire(1)
        back = 0
        now = time.monotonic()
        pid = next(self._publish_ids)
        with self._lock:
            if self._mq_down:  # declared down while this waited: see _on_health_change
                back, units = units, 0
            self._inflight[pid] = (t, data, now)
            self._inflight_units[pid] = units
            if cm is not None and self.cfg.failover.enabled:
                for n in cm.hosts:
                    self._mq_unconfirmed[n][cm.timestamp_ns] = (now, cm)
        self._limiter.release(back)
        self.stats.mq_bytes += len(data)
        try:
            producer.send_async(data, lambda res, _id: self._published(res, pid))
        except BaseException:  # no callback will come: nothing of it stays in flight
            self._release_publish(pid)
            with self._lock:
                self._inflight.pop(pid, None)
                if not self._inflight:
                    self._published_cv.notify_all()
                if cm is not None:
                    for n in cm.hosts:
                        self._mq_unconfirmed[n].pop(cm.timestamp_ns, None)
            raise

    def _release_publish(self, pid: int) -> None:
        """Give back the C_p unit of publish ``pid`` (once: whoever takes it from
        ``_inflight`` or gives up on it first)."""
        with self._lock:
            units = self._inflight_units.pop(pid, 0)
        self._limiter.release(units)

    @property
    def inflight_sends(self) -> int:
        """The units of concurrent sends held now (RPC pushes and MQ publishes in flight)."""
        return self._limiter.held

    def _published(self, res: Any, pid: int) -> None:
        import pulsar

        self._release_publish(pid)  # C_p: its unit goes back (none if already given back)
        if res == pulsar.Result.Ok:
            self._last_ack = time.monotonic()  # the broker is alive (MqHealth.last_ack)
        with self._lock:
            entry = self._inflight.pop(pid, None)
            if not self._inflight:
                self._published_cv.notify_all()
            if entry is None:  # taken over by the RPC channel during an outage
                return
            t, data, _ = entry
            if res != pulsar.Result.Ok:  # e.g. the broker was down past the send timeout
                log.warning("publish on topic %d failed (%s); it will be published again",
                            t, res)
                self._republish.append((t, data))

    def _inflight_age(self) -> float:
        with self._lock:
            first = next(iter(self._inflight.values()), None)
        return 0.0 if first is None else time.monotonic() - first[2]

    def flush(self, wait: bool = True) -> None:
        """Push every queued RPC message (one batch per node, all nodes concurrently) and,
        with ``wait``, wait until the broker acknowledged every publish (or the MQ channel
        is down)."""
        self._flush_locked()
        if not wait:
            return
        with self._lock:
            self._published_cv.wait_for(
                lambda: not self._inflight or self._mq_down or self._stop.is_set())

    def _flush_locked(self) -> None:
        """Push every queued RPC message (one batch per node, all nodes concurrently) and
        wait for the answers. The dispatch lock is held only while the outbox is taken (and
        failed publishes are published again), not while the pushes are answered, unless
        the caller holds it: a flush from the sending path or a switch leaves the
        dispatcher free meanwhile. Flushes push one after another, in the order they took
        the outbox (a node gets its batches in order)."""
        with self._dispatch:
            with self._lock:
                again: list[tuple[int, bytes]] = []
                if not self._mq_down:
                    again, self._republish = self._republish, []
                outbox, self._outbox = self._outbox, defaultdict(list)
                for n in list(outbox):
                    if (self._pending.get(n) or n in self._reprogramming
                            or n not in self.agents):  # unreachable: keep the order
                        self._pending[n].extend(outbox.pop(n))
                turn = next(self._push_turns)
            self._publish_again(again)
        cv = self._push_turn_cv
        with cv:  # the flushes that took the outbox before this one push first
            cv.wait_for(lambda: self._push_turn == turn)
        try:
            self._push_all(outbox, reprogram=False)
        finally:
            with cv:
                self._push_turn += 1
                cv.notify_all()
