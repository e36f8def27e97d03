"""Channel failover and reprogramming (:mod:`delivery.controller`): the MQ
health probe's verdicts, moving MQ types to RPC within C_b and C_p and back, the per-node
queues re-sent to unreachable nodes, and relaying on a topic."""

from __future__ import annotations

import functools
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import grpc

from ..health import (
    MqHealth,
    close_in_background,
    connected,
    plan_failover,
)
from ..rpc import pb
from ..wire import (
    envelope,
    open_envelope,
)
from .support import (
    RPC,
    TopicRefused,
    _dispatching,
    id_ranges,
)

__all__ = ["FailoverMixin"]

log = logging.getLogger(__package__)  # the controller's one logger, "delivery.controller"


class FailoverMixin:
    """Methods of :class:`delivery.controller.Controller` (their state is set in its
    ``__init__``)."""

    # ------------------------------------------------------------------ failover
    def set_capacities(self, controller_bw_bps: float | None,
                       controller_cpu: float | None) -> None:
        """C_b (bit/s) and C_p (messages/s) for failover planning, where the configuration
        leaves them unset (the control plane passes its scenario's)."""
        fo = self.cfg.failover
        self._capacity = (fo.controller_bw_bps if fo.controller_bw_bps is not None
                          else controller_bw_bps,
                          fo.controller_cpu if fo.controller_cpu is not None else controller_cpu)
        if self.cfg.shaping.enabled and self._client is not None:
            self._start_shaper()

    def on_health(self, listener: Callable[[dict], None]) -> None:
        """Call ``listener(self.health())`` at every change of channel health."""
        self._health_listeners.append(listener)

    def health(self) -> dict:
        """The channels' health now: the MQ channel's state and since when, the types moved
        to RPC and those waiting, and the nodes whose RPC endpoint is unreachable (and of
        those, the ones reached through a topic)."""
        with self._lock:
            return {"mq": "down" if self._mq_down else "up", "since_ns": self._down_since_ns,
                    "rerouted": sorted(self._failover_types),
                    "waiting": sorted(self._waiting_types | {t for t, _ in self._held}),
                    "unreachable": sorted(self._unreachable_since),
                    "relayed": sorted(n for n, ts in self._relayed.items() if ts)}

    def _event(self, event: str, why: str) -> None:
        """Record a health event and tell the listeners, on a thread of their own (one may
        talk to a policy server: it never holds up delivery)."""
        self.stats.health_events.append((time.time_ns(), event, why))
        if self._health_listeners and not self._stop.is_set():
            self._notifier.submit(self._notify, self.health())

    def _notify(self, h: dict) -> None:
        for f in list(self._health_listeners):
            try:
                f(h)
            except Exception as e:  # a listener must not stop delivery
                log.warning("channel-health listener %r failed: %s", f, e)

    def _probe_congested(self) -> None:
        """MqHealth's callback: a late probe excused (the link is full, the broker up)."""
        self.stats.probes_congested += 1

    def _probe_waited(self) -> None:
        """MqHealth's callback: a probe's deadline moved for the RPC pushes ahead of it."""
        self.stats.probes_waited += 1

    def _on_health_change(self, state: str, reason: str) -> None:
        """MqHealth's callback (its probe thread): note it, wake the failover thread."""
        with self._lock:
            self._mq_down = state == MqHealth.DOWN
            self._down_since_ns = time.time_ns()
            self._published_cv.notify_all()
            # the broker takes nothing while down: its publishes in flight stop holding C_p
            # units (a sender waiting for one would otherwise hold the dispatch lock that
            # the failover needs to take them over by RPC)
            freed = (sum(self._inflight_units.pop(pid) for pid in list(self._inflight_units))
                     if self._mq_down else 0)
        self._limiter.release(freed)
        log.warning("MQ channel %s (%s)", state, reason)
        self._health_wake.set()

    def _failover_loop(self) -> None:
        period = self.cfg.failover.replan_period_s
        while not self._stop.is_set():
            self._health_wake.wait(period)
            self._health_wake.clear()
            if self._stop.is_set():
                return
            try:
                if self._mq_down:
                    self._fail_over()
                elif self._failed_over:
                    self._fail_back()
            except Exception:  # keep the thread: the next period tries again
                log.exception("failover step failed")

    @_dispatching
    def _fail_over(self) -> None:
        """(Re-)plan the outage: move what fits to RPC (Eq. 1's controller constraints,
        oldest waiting type first) with its unacknowledged publishes and waiting messages,
        in timestamp order; the rest waits."""
        if not self._mq_down:
            return
        first = not self._failed_over
        self._failed_over = True
        with self._lock:
            oldest: dict[int, int] = {}
            for t, cm in self._held:
                oldest.setdefault(t, cm.timestamp_ns)
            for _, data, _ in self._inflight.values():
                cm = open_envelope(data).config
                if cm is not None:
                    oldest[cm.type_id] = min(oldest.get(cm.type_id, cm.timestamp_ns),
                                             cm.timestamp_ns)
        mq = [t for t, c in self.channel.items() if c != RPC and t not in self._failover_types]
        rpc = [t for t, c in self.channel.items() if c == RPC] + sorted(self._failover_types)
        plan = plan_failover(mq, rpc, self.hosts, self._rates.rates(), *self._capacity,
                             oldest_ns=oldest)
        moved = set(plan.moved)
        self._failover_types |= moved
        self._waiting_types = set(plan.waiting)
        taken: list[Any] = []
        freed = 0  # C_p units of the publishes taken over
        with self._lock:
            for pid, (_, data, _) in list(self._inflight.items()):
                cm = open_envelope(data).config
                if cm is not None and cm.type_id in moved:
                    del self._inflight[pid]
                    freed += self._inflight_units.pop(pid, 0)
                    taken.append(cm)
            keep = []
            for t, data in self._republish:
                cm = open_envelope(data).config
                if cm is not None and cm.type_id in moved:
                    taken.append(cm)
                else:
                    keep.append((t, data))
            self._republish = keep
            taken += [cm for t, cm in self._held if t in moved]
            self._held = [(t, cm) for t, cm in self._held if t not in moved]
            if not self._inflight:
                self._published_cv.notify_all()
            for cm in sorted(taken, key=lambda m: m.timestamp_ns):
                for n in cm.hosts:
                    self._outbox[n].append(cm)
            for n in {n for cm in taken for n in cm.hosts}:
                self._outbox[n].sort(key=lambda m: m.timestamp_ns)
        self._limiter.release(freed)
        self.stats.rerouted += len(taken)
        if first:
            self.stats.failovers += 1
        if first or moved:
            bw, cpu = self._capacity
            why = (f"types {id_ranges(self._failover_types)} -> RPC, "
                   f"{id_ranges(plan.waiting)} wait; "
                   f"RPC load {plan.controller_bw_bps:.0f} bit/s of C_b {bw}, "
                   f"{plan.controller_cpu:.0f} concurrent sends of C_p {cpu}; "
                   f"{len(taken)} messages taken over")
            log.warning("MQ down: %s", why)
            self._event("failover" if first else "replan", why)
        self._flush_locked()

    @_dispatching
    def _fail_back(self) -> None:
        """The broker is healthy again: push what RPC holds, publish what waited (oldest
        first), put the types back on their topics and apply the deferred channels."""
        if self._mq_down or not self._failed_over:
            return
        self._renew_producers()
        self._flush_locked()
        with self._lock:
            held, self._held = self._held, []
            again, self._republish = self._republish, []
        types = id_ranges(self._failover_types)
        self._failover_types.clear()
        self._waiting_types.clear()
        self._failed_over = False
        self._publish_again(again)
        for t, cm in held:  # on its type's channel, as the MQ channel is up again
            self._dispatch_one(t, cm)
        self._flush_locked()
        self.stats.failbacks += 1
        deferred, self._deferred = self._deferred, None
        why = f"types {types} back on their topics; {len(held)} waiting messages published"
        log.warning("MQ up: %s", why)
        if deferred is not None:  # queued: it needs the dispatch lock this holds
            with self._lock:  # a switch asked since (and not yet planned) has the last word
                chans = {t: c for t, c in deferred[0].items() if self._asked.get(t, c) == c}
            self.set_channels(chans, {t: deferred[1][t] for t in chans if t in deferred[1]},
                              wait=False)
        self._event("failback", why)

    def _publish_again(self, again: list[tuple[int, bytes]]) -> None:
        """Publish failed (or renewed) publishes again, in order (under the dispatch lock).
        A topic that refuses (its producer cannot be created yet) stops the run: that one
        and the rest go back to the head of the republish list for the next flush, so
        nothing is dropped and no flush is left without its push turn."""
        for i, (t, data) in enumerate(again):
            try:
                self._publish(t, data)
            except Exception as e:
                with self._lock:
                    self._republish[:0] = again[i:]
                (log.debug if isinstance(e, TopicRefused) else log.warning)(
                    "publishing %d messages again waits for the next flush: topic %d: %s",
                    len(again) - i, t, e)
                return
            self.stats.republished += 1

    def _renew_producers(self) -> None:
        """At a failback (the probe's producer is acknowledged again), replace every data
        producer that has not reconnected: one that existed through the outage reconnects
        on the client's own back-off, which can leave it disconnected long after the broker
        is back, holding its type's publishes (the probe's producer gets fresh twins for the
        same reason). Its unacknowledged publishes go again on the fresh producer, after the
        failed ones and in the order they were first published; a copy the old producer
        still delivers reaches the agents as a duplicate, which they drop. The old producer
        is closed in the background (under the dispatch lock, as every producer change).
        A creation that finished during the outage is settled too: a failure is forgotten
        (the next publish asks again), a connected producer is taken, one that is not is
        closed."""
        for t, c in list(self._creating.items()):
            if not c.future.done():
                continue
            del self._creating[t]
            if c.future.exception() is None:
                made = c.future.result()
                if connected(made) and t not in self._producers:
                    self._producers[t] = made
                    self._producer_refused.pop(t, None)
                else:
                    close_in_background(made)
        for t in [t for t, p in self._producers.items() if not connected(p)]:
            old = self._producers.pop(t)
            with self._lock:
                pids = sorted(pid for pid, e in self._inflight.items() if e[0] == t)
                entries = [self._inflight.pop(pid) for pid in pids]
                units = sum(self._inflight_units.pop(pid, 0) for pid in pids)
                self._republish.extend((t, data) for _, data, _ in entries)
                if not self._inflight:
                    self._published_cv.notify_all()
            self._limiter.release(units)
            self.stats.producers_renewed += 1
            log.warning("topic %d: its producer has not reconnected since the outage; a new "
                        "one publishes its %d unacknowledged messages again", t, len(entries))
            close_in_background(old)

    def _push_all(self, batches: dict[int, list], reprogram: bool) -> dict[int, bool]:
        ok: dict[int, bool] = {}
        todo = {n: pb.ConfigBatch(messages=ms) for n, ms in batches.items() if ms}
        for attempt in range(1 + self.cfg.push_retries):
            if self._stop.is_set():  # closing: what is left stays queued
                break
            calls = {}
            for n, b in todo.items():
                # C_p: |D| units per destination node's message, held until the call ends
                units = self._limiter.acquire(len(b.messages))
                self.stats.rpc_pushes += 1
                self.stats.rpc_bytes += b.ByteSize()
                seq = self._rpc_backlog.start()  # ahead of every probe that leaves from now
                try:
                    calls[n] = fut = self._stub(n).Push.future(b,
                                                               timeout=self.cfg.push_timeout_s)
                except (ValueError, RuntimeError):  # closed meanwhile: stays queued
                    self._push_done(units, seq, None)
                    break
                except BaseException:  # no call, no callback: its units and number end here
                    self._push_done(units, seq, None)
                    raise
                fut.add_done_callback(functools.partial(self._push_done, units, seq))
            failed = {n: b for n, b in todo.items() if n not in calls}
            for n, fut in calls.items():
                try:
                    fut.result()
                    ok[n] = True
                    self.stats.rpc_messages += len(todo[n].messages)
                    if reprogram:
                        self.stats.reprogrammed += len(todo[n].messages)
                except (grpc.RpcError, ValueError):  # ValueError: the channel was closed
                    self.stats.push_failures += 1
                    failed[n] = todo[n]
            todo = failed
            if not todo:
                break
            time.sleep(self.cfg.retry_backoff_s * (2 ** attempt))
        now = time.monotonic()
        with self._lock:
            for n, b in todo.items():  # unreachable after the retries: reprogram later
                ok[n] = False
                self._pending[n] = list(b.messages) + self._pending.get(n, [])
                if n not in self._unreachable_since:
                    self._unreachable_since[n] = now
                    log.warning("node %d: RPC endpoint unreachable; its messages wait", n)
            back = [n for n, good in ok.items() if good and n in self._unreachable_since]
            for n in back:
                del self._unreachable_since[n]
                self._relayed.pop(n, None)
        for n in todo:
            if self._unreachable_since.get(n) == now:
                self._event("unreachable", f"node {n}")
        for n in back:
            self._event("reachable", f"node {n}")
        return ok

    def _push_done(self, units: int, seq: int, _fut: Any) -> None:
        """A push call ended (answered, failed or cancelled): its C_p units go back and the
        probes behind it may be judged (:class:`delivery.health.RpcBacklog`)."""
        self._limiter.release(units)
        self._rpc_backlog.end(seq)

    def _reprogram_loop(self) -> None:
        while not self._stop.wait(self.cfg.reprogram_period_s):
            try:
                self.retry_subscribe_infos()
                self.reprogram_pending()
                self.relay_pending()
            except Exception:  # keep the thread: the next period tries again
                log.exception("reprogramming failed")

    @_dispatching
    def relay_pending(self) -> int:
        """Relay the queued messages of nodes unreachable over RPC for ``relay_after_s`` on
        the topic each is subscribed to with the fewest subscribers (a copy addressed to
        that node only: the other subscribers drop it as not for them). The originals stay
        queued (pushed later they are duplicates; a packed reply that confirms a relayed
        message removes it). Returns the messages relayed."""
        fo = self.cfg.failover
        if not (fo.enabled and fo.relay) or self._mq_down:
            return 0
        now = time.monotonic()
        subscribers: dict[int, int] = defaultdict(int)
        for topics in self.node_topics.values():
            for c in topics:
                subscribers[c] += 1
        sent = 0
        with self._lock:
            todo = {n: sorted(self._pending.get(n, []), key=lambda m: m.timestamp_ns)
                    for n, since in self._unreachable_since.items()
                    if now - since >= fo.relay_after_s and self.node_topics.get(n)}
        for n, ms in todo.items():
            c = min(self.node_topics[n], key=lambda c: (subscribers[c], c))
            if not self._relayed[n] and ms:
                log.warning("node %d: RPC endpoint unreachable for %.1f s; relaying its %d "
                            "queued messages on topic %d (%d subscribers)", n,
                            now - self._unreachable_since[n], len(ms), c, subscribers[c])
                self._event("relay", f"node {n} via topic {c}")
            for cm in ms:
                if cm.timestamp_ns in self._relayed[n]:
                    continue
                copy = pb.ConfigMessage()
                copy.CopyFrom(cm)
                del copy.hosts[:]
                copy.hosts.append(n)
                data = envelope(copy)
                self._publish(c, data)
                self._relayed[n].add(cm.timestamp_ns)
                self.stats.relayed += 1
                self.stats.relay_bytes += len(data)
                sent += 1
        return sent

    def reprogram_pending(self) -> int:
        """Re-send the queued messages of unreachable nodes (timestamp order); returns the
        number of nodes that took them."""
        with self._lock:
            batch = {n: sorted(ms, key=lambda m: m.timestamp_ns)
                     for n, ms in self._pending.items() if ms}
            self._pending.clear()
            # until this push is answered, a flush queues these nodes' new messages behind it
            # (pushed beside it, a newer message could overtake the queue: OUT_OF_ORDER drops)
            self._reprogramming.update(batch)
        if not batch:
            return 0
        for ms in batch.values():
            for m in ms:
                m.reprogram = True
        try:
            ok = self._push_all(batch, reprogram=True)
        finally:
            with self._lock:
                self._reprogramming.difference_update(batch)
        return sum(ok.values())

    def pending(self) -> dict[int, int]:
        """node -> messages queued for reprogramming."""
        with self._lock:
            return {n: len(ms) for n, ms in self._pending.items() if ms}

    def unconfirmed(self) -> int:
        """(node, message) deliveries no packed reply has confirmed yet (applied, a duplicate
        or superseded): the outbox's destination rows, or, without the outbox, the MQ
        messages awaiting confirmation."""
        if self.cfg.outbox:
            return self.store.outbox_size()[1]
        with self._lock:
            return sum(len(w) for w in self._mq_unconfirmed.values())

    def pending_subscribe_infos(self) -> dict[int, int]:
        """node -> SubscribeInfos queued until it answers."""
        with self._lock:
            return {n: len(v) for n, v in self._pending_infos.items() if v}
