"""Packed replies (Section VI-C, :mod:`delivery.controller`): collected and
received, applied to the outbox, and what a MALFORMED or missing result re-sends."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import grpc

from security.pki import agent_principal

from ..rpc import pb

__all__ = ["RepliesMixin", "reply_problem"]

log = logging.getLogger(__package__)  # the controller's one logger, "delivery.controller"


class RepliesMixin:
    """Methods of :class:`delivery.controller.Controller` (their state is set in its
    ``__init__``)."""

    # ------------------------------------------------------------------ packed replies
    def Report(self, request: Any, context: Any) -> Any:
        self._on_reply(request)
        return pb.ReportAck(acknowledged=self._acked[request.node_id])

    def _collect_loop(self) -> None:
        while not self._stop.wait(self.cfg.collect_period_s):
            try:
                self.collect()
            except Exception:  # keep the thread: the next period tries again
                log.exception("collecting packed replies failed")

    def collect(self) -> int:
        """Collect packed replies from every agent (concurrently); returns results taken.
        Then MQ messages that a node answering here has not confirmed for
        ``confirm_timeout_s``, while no MQ result came from it meanwhile (its subscription
        is not working), are re-sent to it over RPC."""
        if self._stop.is_set():
            return 0
        try:
            calls = {n: self._stub(n).Collect.future(
                pb.CollectRequest(acknowledged=self._acked[n]), timeout=self.cfg.push_timeout_s)
                for n in list(self.agents)}
        except (ValueError, RuntimeError):  # closed meanwhile
            return 0
        taken = 0
        answered = []
        for n, fut in calls.items():
            try:
                reply = fut.result()
            except grpc.RpcError:
                continue
            problem = reply_problem(reply, agent_principal(n))
            if problem is not None:  # whatever answers at node n's address is not node n
                self.stats.refused_calls += 1
                log.warning("controller refused the Collect answer of node %d at %s: %s", n,
                            self.agents[n], problem)
                continue
            taken += self._on_reply(reply)
            answered.append(n)
        self._rescue_mq(answered)
        return taken

    def _rescue_mq(self, nodes: Iterable[int]) -> int:
        fo = self.cfg.failover
        if not fo.enabled or self._mq_down:
            return 0
        now = time.monotonic()
        rescued = 0
        with self._lock:
            for n in nodes:
                waiting = self._mq_unconfirmed.get(n)
                if not waiting:
                    continue
                late = [(ts, cm) for ts, (at, cm) in waiting.items()
                        if now - at >= fo.confirm_timeout_s]
                heard = self._last_mq_result.get(n)
                if not late or (heard is not None and now - heard < fo.confirm_timeout_s):
                    continue
                for ts, cm in late:
                    del waiting[ts]
                    fix = pb.ConfigMessage()
                    fix.CopyFrom(cm)
                    fix.reprogram = True
                    self._pending[n].append(fix)
                rescued += len(late)
                log.warning("node %d answers RPC but confirmed none of %d MQ messages for "
                            "%.1f s: re-sent over RPC", n, len(late), fo.confirm_timeout_s)
        self.stats.mq_rescued += rescued
        return rescued

    def _on_reply(self, reply: Any) -> int:
        """Take a packed reply: count its results, confirm the outbox rows of what the node
        holds now (before the acknowledgement goes back), and queue MALFORMED fixes."""
        n = int(reply.node_id)
        fresh = [r for r in reply.results if r.result_seq > self._acked[n]]
        held = [int(r.timestamp_ns) for r in fresh
                if r.outcome in (pb.APPLIED, pb.DUPLICATE, pb.OUT_OF_ORDER)]
        if held and self.cfg.outbox:
            self.stats.outbox_confirmed += self.store.outbox_confirm((n, ts) for ts in held)
        redo: dict[int, list] = defaultdict(list)
        taken = 0
        now = time.monotonic()
        with self._lock:
            if held:
                done = set(held)
                waiting = self._mq_unconfirmed.get(n)
                if waiting:
                    for ts in done & waiting.keys():
                        del waiting[ts]
                if self._pending.get(n) and self._relayed.get(n):
                    self._pending[n] = [m for m in self._pending[n]
                                        if m.timestamp_ns not in done]
            for r in reply.results:
                if r.result_seq <= self._acked[n]:
                    continue
                self._acked[n] = r.result_seq
                taken += 1
                if r.channel != "rpc" and r.outcome != pb.MALFORMED:
                    self._last_mq_result[n] = now
                self.stats.outcomes[pb.Outcome.Name(r.outcome)] += 1
                if r.outcome in (pb.OUT_OF_ORDER, pb.MALFORMED):
                    self.stats.errors.append((n, pb.Outcome.Name(r.outcome), r.message_id,
                                              r.detail))
                if r.outcome == pb.MALFORMED:  # see the module docstring for OUT_OF_ORDER
                    cm = self._latest.get((r.vpc_id, r.configuration_type, r.resource_id))
                    if cm is not None and n in cm.hosts:
                        fix = pb.ConfigMessage()
                        fix.CopyFrom(cm)
                        fix.reprogram = True
                        fix.payload = cm.payload
                        redo[n].append(fix)
            for node, ms in redo.items():
                self._pending[node].extend(ms)
        return taken


# gRPC's default reconnect backoff grows to 120 s: an agent that was down for a while would
# stay unreachable (every call failing at once) long after it is back.


def reply_problem(reply: Any, principal: str) -> str | None:
    """Why a packed reply may not be taken from ``principal`` (the certificate of whoever
    sent it, or of the node it was collected from), or None: it must be for that agent's
    own node, and so must each of its results."""
    if principal != agent_principal(reply.node_id):
        return f"the packed reply is for node {reply.node_id}, not {principal}'s"
    others = sorted({int(r.node_id) for r in reply.results if r.node_id != reply.node_id})
    if others:
        return f"the packed reply holds results of node(s) {others[:5]}, not only {principal}'s"
    return None
