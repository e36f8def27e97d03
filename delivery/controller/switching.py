"""Channel switches (steps 1 to 4 of :mod:`delivery.controller`): the store's
writes, SubscribeInfos and their acknowledgements, fences, and the per-node queue of
SubscribeInfos not yet delivered."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable
from concurrent import futures

import grpc

from security.pulsar import subscription_name

from ..rpc import pb
from ..store import SubscriptionChange
from ..wire import (
    fence_envelope,
)
from .support import (
    RPC,
    _dispatching,
    _SwitchPlan,
    topic_name,
)

__all__ = ["SwitchingMixin"]

log = logging.getLogger(__package__)  # the controller's one logger, "delivery.controller"


class SwitchingMixin:
    """Methods of :class:`delivery.controller.Controller` (their state is set in its
    ``__init__``)."""

    # ------------------------------------------------------------------ channels
    def set_channels(self, channels: dict[int, int], hosts: dict[int, Iterable[int]], *,
                     wait: bool = True) -> dict:
        """Make ``channels`` (type -> 0 = RPC or topic 1..K) current, losslessly (see the
        module docstring); ``hosts`` gives the destinations of every type named.

        Only the types whose channel changes wait for the switch: their messages are held
        (in arrival order, already in the outbox) from this call until the switch is done,
        then dispatched on their new channels; every other type's messages keep leaving
        while the SubscribeInfos are acknowledged (``stats.switch_held`` counts the held
        messages). Switches run one at a time, in the order they were asked for.

        With ``wait`` (the default) the switch runs in the calling thread and this returns
        what changed (``types``, ``subscribe``, ``unsubscribe``, ``deferred`` while the MQ
        channel is down). Without it the switch is queued on the controller's switch thread
        (the switches queued while one runs are then made as one) and this returns at once
        with ``{"queued": types to move}``; :meth:`wait_switches` (which :meth:`flush` does
        not do) waits for the queued switches and raises the error of one that failed
        (nothing of it was stored or sent, and its types stay on their old channels)."""
        chans = {int(t): int(c) for t, c in channels.items()}
        hs = {int(t): tuple(int(h) for h in v) for t, v in hosts.items()}
        if wait:
            self.wait_switches()  # an earlier switch's error is raised before this one starts
        # the moving types are gated before any later message of theirs. A type moves if its
        # channel differs from the one it has now or from the one it will have once the
        # queued switches are done (a type queued for topic 1 and then back to RPC must be
        # held until both are done, or what is released after the first would leave on
        # topic 1 while later messages take RPC; a switch deferred by an outage leaves the
        # asked channel ahead of the current one), or if it stays on a topic that its new
        # hosts must first subscribe to
        with self._dispatch, self._lock:
            moving = [t for t, c in chans.items()
                      if c != self.channel.get(t, RPC)
                      or c != self._asked.get(t, self.channel.get(t, RPC))
                      or (c != RPC and t in hs and set(hs[t]) - set(self.hosts.get(t, ())))]
            for t in moving:
                self._gated[t] = self._gated.get(t, 0) + 1
            self._asked.update(chans)
        if not wait:
            fut: futures.Future = futures.Future()
            with self._lock:
                self._queued.append((chans, hs, moving, fut))
                self._switches.append(fut)
            try:
                self._switcher.submit(self._run_queued)
            except RuntimeError:  # closed: nothing was stored, nothing waits
                with self._lock:
                    self._queued = [q for q in self._queued if q[3] is not fut]
                    self._switches.remove(fut)
                with self._dispatch:
                    self._release_gated(moving)
                raise
            return {"queued": len(moving)}
        return self._switch(chans, hs, moving)

    def _run_queued(self) -> None:
        """The switch thread: every switch queued so far, as one (later channels win), so a
        burst of placements pays one store transaction, one flush and one round of
        SubscribeInfos."""
        with self._lock:
            batch, self._queued = self._queued, []
        if not batch:  # an earlier run took them
            return
        chans: dict[int, int] = {}
        hs: dict[int, tuple[int, ...]] = {}
        moving: list[int] = []
        for c, h, m, _ in batch:
            chans.update(c)
            hs.update(h)
            moving.extend(m)
        try:
            out = self._switch(chans, hs, moving)
        except BaseException as e:
            for *_, f in batch:
                f.set_exception(e)
            return
        for *_, f in batch:
            f.set_result(out)

    def channel_asked(self, t: int) -> int | None:
        """Type ``t``'s channel once the queued switches are done (``None``: never given
        one)."""
        with self._lock:
            return self._asked.get(int(t), self.channel.get(int(t)))

    def wait_switches(self, timeout_s: float | None = None) -> None:
        """Wait until every switch queued by ``set_channels(..., wait=False)`` is done;
        raises the first error of one that failed (once)."""
        with self._lock:
            pending, self._switches = self._switches, []
        futures.wait(pending, timeout=timeout_s)
        for f in pending:
            if not f.done():
                with self._lock:
                    self._switches.append(f)
        errors = [f.exception() for f in pending if f.done() and not f.cancelled()
                  and f.exception() is not None]
        if errors:
            raise errors[0]

    def _switch(self, channels: dict[int, int], hosts: dict[int, tuple[int, ...]],
                moving: list[int]) -> dict:
        """One switch (one at a time): its plan under the dispatch lock, then outside it the
        store, the subscribing SubscribeInfos and a flush of what was sent under the old
        channels (only the gated types wait), the channels and the gated messages under it
        again, then the unsubscriptions (outside) and the fences."""
        with self._switch_lock:
            try:
                plan = self._switch_plan(channels, hosts)
                if plan is not None:
                    self._switch_store(plan)
                    if plan.subs:
                        self._send_subscribe_infos(plan.subs, plan.ts, True)
                    # messages sent under the old channels go out first (the moving types'
                    # are held: none comes after)
                    self._flush_locked()
                out = self._switch_apply(plan, moving)
                if out.pop("released", 0):  # their RPC copies go now, outside the lock
                    self._flush_locked()
                if plan is not None and plan.unsubs:
                    self._unsubscribe(plan.unsubs, plan.ts)
                return out
            except BaseException:
                with self._dispatch:
                    self._release_gated(moving)  # a no-op if the switch released them
                    with self._lock:  # its types stay where they were, unless a queued
                        for t in channels:  # switch still asks for a channel of theirs
                            self._asked[t] = self.channel.get(t, RPC)
                            for chans, *_ in self._queued:
                                if t in chans:
                                    self._asked[t] = chans[t]
                raise

    @_dispatching
    def _switch_plan(self, channels: dict[int, int], hosts: dict[int, tuple[int, ...]]
                     ) -> _SwitchPlan | None:
        """What the switch changes (new channels, subscriptions to make and to end, its
        timestamp; :meth:`_switch_store` writes it); ``None`` when nothing changes or the
        change is deferred until the MQ channel is back."""
        for t, hs in hosts.items():
            self.hosts[t] = hs
        if self._failed_over or self._mq_down:
            # no SubscribeInfo, durable subscription or fence can be made while the broker
            # is down: the newest channels are applied when it is back
            old_ch, old_hosts = self._deferred or ({}, {})
            self._deferred = ({**old_ch, **channels},
                              {**old_hosts, **{t: self.hosts[t] for t in hosts}})
            n = sum(self.channel.get(t) != c for t, c in channels.items())
            self.stats.deferred_channel_changes += n
            self._last_switch = {"types": 0, "subscribe": 0, "unsubscribe": 0, "deferred": n}
            return None
        changed = {t: c for t, c in channels.items() if self.channel.get(t) != c}
        if not changed:
            self._last_switch = {"types": 0, "subscribe": 0, "unsubscribe": 0}
            return None
        new_channel = {**self.channel, **changed}
        wanted: dict[int, set[int]] = defaultdict(set)
        for t, c in new_channel.items():
            if c != RPC:
                for n in self.hosts[t]:
                    wanted[n].add(c)
        subs = [(n, c) for n in wanted for c in wanted[n] - self.node_topics.get(n, set())]
        unsubs = [(n, c) for n in list(self.node_topics)
                  for c in self.node_topics[n] - wanted.get(n, set())]
        return _SwitchPlan(changed, new_channel, wanted, subs, unsubs, self.timestamp(),
                           {t: self.hosts[t] for t in changed})

    def _switch_store(self, plan: _SwitchPlan) -> None:
        """Grant the subscribing nodes their topics and write the switch to the store
        (outside the dispatch lock: the moving types are gated and nothing else reads the
        plan; the switch lock keeps switches in order). A ``PulsarAdminError`` or
        ``StoreError`` leaves nothing sent."""
        if self._grants is not None and plan.subs:
            self._grants.ensure({n for n, _ in plan.subs})
        pre = self.cfg.topic_prefix
        self.store.write_mapping([(t, c, topic_name(pre, c) if c else None, plan.hosts[t])
                                  for t, c in plan.changed.items()], plan.ts)
        self.store.apply_changes(
            [SubscriptionChange(n, topic_name(pre, c), subscription_name(n), True)
             for n, c in plan.subs]
            + [SubscriptionChange(n, topic_name(pre, c), subscription_name(n), False)
               for n, c in plan.unsubs], plan.ts)

    @_dispatching
    def _switch_apply(self, plan: _SwitchPlan | None, moving: list[int]) -> dict:
        if plan is None:
            self._release_gated(moving)
            return self._last_switch
        changed, subs, unsubs = plan.changed, plan.subs, plan.unsubs
        with self._lock:  # only switches change channels, one at a time: the plan holds
            self.channel = plan.channel
            self.node_topics = defaultdict(set, {n: set(v) for n, v in plan.wanted.items()})
            self.stats.channel_changes += len(changed)
        released = self._release_gated(moving)
        return {"types": len(changed), "subscribe": len(subs), "unsubscribe": len(unsubs),
                "released": released}

    def _unsubscribe(self, unsubs: list[tuple[int, int]], ts: int) -> None:
        """The switch's last step, after its channels took effect: the unsubscribing
        SubscribeInfos (outside the dispatch lock: no type on these (node, topic) pairs is
        left, so no message waits for them), then a fence on each topic left."""
        # Wait for the acknowledgements: a gRPC future that is dropped unanswered is
        # cancelled when garbage-collected (the agent never hears of the unsubscription),
        # and a fence that overtakes the SubscribeInfo would leave the agent draining.
        self._send_subscribe_infos(unsubs, ts, False)
        with self._dispatch:
            fence = fence_envelope(self.timestamp())
            for c in sorted({c for _, c in unsubs}):
                self._publish_fence(c, fence)

    def _release_gated(self, moving: list[int]) -> int:
        """End one switch's gate on ``moving`` (under the dispatch lock; the list is emptied,
        so a second call for the same switch releases nothing) and dispatch, in arrival
        order, the held messages of the types no other queued switch still gates. Returns
        how many were dispatched."""
        with self._lock:
            types, moving[:] = list(moving), []
            for t in types:
                left = self._gated.get(t, 0) - 1
                if left > 0:
                    self._gated[t] = left
                else:
                    self._gated.pop(t, None)
            go = [(t, cm) for t, cm in self._gated_msgs if t not in self._gated]
            self._gated_msgs = [(t, cm) for t, cm in self._gated_msgs if t in self._gated]
        # oldest first: a message that waited for the broker meanwhile (failback) may have
        # joined the held ones after newer messages of its type
        go.sort(key=lambda x: x[1].timestamp_ns)
        for t, cm in go:   # a topic that refuses them sends them over RPC (_dispatch_one)
            self._dispatch_one(t, cm, gate=False)
        return len(go)

    def _send_subscribe_infos(self, pairs: list[tuple[int, int]], ts: int,
                              subscribe: bool) -> None:
        """Send (and wait for) the SubscribeInfos of ``pairs`` (node, channel); failures are
        queued (see the module docstring)."""
        calls, failed = [], []
        for n, c in pairs:
            info = pb.SubscribeInfo(url=self.cfg.pulsar_url, topic=topic_name(
                self.cfg.topic_prefix, c), subscription=subscription_name(n), timestamp_ns=ts,
                operation=subscribe)
            self.stats.subscribe_infos += 1
            self.stats.unsubscribe_infos += not subscribe
            with self._lock:
                known_down = bool(self._pending.get(n) or self._pending_infos.get(n))
            if known_down:  # do not wait for it: queue it behind the node's earlier ones
                failed.append((n, c, info, "node unreachable"))
                continue
            self.stats.rpc_bytes += info.ByteSize()
            # wait_for_ready: a channel in reconnect backoff (the agent was not up at a
            # Collect a moment ago) would fail it at once, and an agent that misses a
            # SubscribeInfo while it runs never consumes the topic
            calls.append((n, c, info, self._stub(n, control=True).Subscribe.future(
                info, timeout=self.cfg.subscribe_timeout_s, wait_for_ready=True)))
        for n, c, info, fut in calls:
            try:
                ok = fut.result()
                if ok.ok:
                    continue
                failed.append((n, c, info, ok.error))
            except grpc.RpcError as e:
                failed.append((n, c, info, e.code().name))
        for n, c, info, err in failed:
            self.stats.subscribe_failures += 1
            log.warning("node %d: SubscribeInfo (%s %s) failed (%s); queued until it answers",
                        n, "subscribe" if subscribe else "unsubscribe", info.topic, err)
            if subscribe:  # so nothing is lost until it gets the SubscribeInfo or reads the store
                self._ensure_subscription(info.topic, info.subscription)
            with self._lock:
                q = self._pending_infos[n]
                last = next((i for i in range(len(q) - 1, -1, -1) if q[i][0] == c), None)
                if subscribe and last is not None and not q[last][1].operation:
                    # it never heard it was to leave the topic: it stays (sending the two in
                    # order would let it delete the subscription, then subscribe afresh,
                    # missing what was published in between)
                    del q[last]
                q.append((c, info))

    def retry_subscribe_infos(self) -> int:
        """Send the queued SubscribeInfos of nodes that answer again, in order: each round
        sends the first one of every such node at once and waits for the answers (each
        within ``push_timeout_s``); a node's queue stops at its first failure. An
        unsubscription sent this way gets a fence of its own: the one of its switch may have
        gone by. Runs under the switch lock, so no switch changes a queue meanwhile, but not
        under the dispatch lock: messages keep leaving while a node is slow to answer (only
        the fence takes it). Nodes whose control channel is not ready within 0.2 s (all
        probed at once) wait for the next period. Returns the number sent."""
        with self._lock:
            nodes = [] if self._mq_down else [n for n, infos in self._pending_infos.items()
                                              if infos]
        if not nodes:
            return 0
        try:
            probes = {n: grpc.channel_ready_future(self._control_channel(n)) for n in nodes}
        except RuntimeError:  # closed meanwhile
            return 0
        deadline = time.monotonic() + 0.2
        ready = []
        for n, f in probes.items():
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
                ready.append(n)
            except grpc.FutureTimeoutError:
                f.cancel()
        sent = 0
        with self._switch_lock:
            while ready:
                calls = []
                for n in ready:
                    with self._lock:
                        if not self._pending_infos[n]:
                            continue
                        c, info = self._pending_infos[n][0]
                    calls.append((n, c, info, self._stub(n, control=True).Subscribe.future(
                        info, timeout=self.cfg.push_timeout_s)))
                ready = []
                for n, c, info, fut in calls:
                    try:
                        ack = fut.result()
                    except grpc.RpcError:
                        continue
                    if not ack.ok:  # e.g. the broker is down: try again later
                        log.warning("node %d: queued SubscribeInfo %s: %s", n, info.topic,
                                    ack.error)
                        continue
                    self.stats.rpc_bytes += info.ByteSize()
                    sent += 1
                    with self._lock:
                        self._pending_infos[n].pop(0)
                    if not info.operation:
                        with self._dispatch:
                            self._publish_fence(c, fence_envelope(self.timestamp()))
                    ready.append(n)
        return sent

    def _publish_fence(self, c: int, fence: bytes) -> None:
        """Publish a fence on topic ``c`` (under the dispatch lock). A topic that refuses (its
        producer cannot be created: the broker is away and not yet known to be down) gets
        it at the next flush that can publish, in order with the other publishes waiting
        there: the switch it ends has taken effect and does not fail for it (an agent keeps
        draining the topic until it arrives; nothing of a moved type is published there)."""
        try:
            self._publish(c, fence)
        except Exception as e:
            log.warning("topic %d: its fence waits for the next flush (%s)", c, e)
            with self._lock:
                self._republish.append((c, fence))
        self.stats.fences += 1

    def _ensure_subscription(self, topic: str, subscription: str) -> bool:
        import pulsar

        if self._mq_down:  # would wait for the operation timeout; made at recovery instead
            return False
        try:
            c = self._client.subscribe(topic, subscription,
                                       consumer_type=pulsar.ConsumerType.Exclusive,
                                       receiver_queue_size=1,
                                       initial_position=pulsar.InitialPosition.Latest)
            c.close()
        except (pulsar.Timeout, pulsar.ConnectError) as e:  # the broker did not answer
            log.info("durable subscription %s on %s: %s", subscription, topic, e)
            return False
        except Exception as e:  # the agent's own consumer holds it already, ...
            log.info("durable subscription %s on %s: %s", subscription, topic, e)
        return True
