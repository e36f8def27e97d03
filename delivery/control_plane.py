"""The controller's message path end to end (SMART Fig. 1, P-1 to P-3): configuration requests
in, Table I messages out on the chosen channels.

:class:`ControlPlane` joins the three pieces a live controller has: the controller adapter
(:class:`serving.adapter.ControllerAdapter`: the parser's destination-hash batching and rate
estimation, and the learned policy in remote or cached mode), a
:class:`~delivery.policies.ChannelPolicy` (the adapter's policy or a baseline) and the
:class:`~delivery.controller.Controller` (metadata store, SubscribeInfo, dispatch, replies).

* :meth:`request` encapsulates one configuration request as a Table I message (a message id,
  the request id, and the generation timestamp), counts it in the parser, gives a type seen
  for the first time its policy's first channel, and dispatches it.
* :meth:`close_interval` ends the running interval (Algorithm 1, lines 10-11: rates from the
  counters) and applies the policy's channels for the next one.
"""

from __future__ import annotations

import itertools
import time
from typing import Sequence

from envs.dsmd.message import Message
from envs.dsmd.parser import IntervalEstimate

from .controller import Controller
from .policies import ChannelPolicy

__all__ = ["ControlPlane"]


class ControlPlane:
    def __init__(self, controller: Controller, adapter, policy: ChannelPolicy) -> None:
        self.controller, self.adapter, self.policy = controller, adapter, policy
        cat = adapter.parser.catalog
        ids = cat.topology.node_ids
        self._hosts_of = lambda t: ids[cat.destinations[t]].tolist()
        self._ids = itertools.count(1)
        self.decide_s: list[float] = []

    def request(self, *, vpc_id: int, configuration_type: str, operation_type: str,
                resource_id: int, size_bytes: int, hosts: Sequence[int],
                request_id: int | None = None, message_id: int | None = None) -> Message:
        """One configuration request: encapsulate (Table I), batch, dispatch. Raises
        :class:`envs.dsmd.errors.DSMDError` naming the field of a bad request."""
        mid = next(self._ids) if message_id is None else int(message_id)
        msg = Message(mid, mid if request_id is None else int(request_id), int(vpc_id),
                      configuration_type, operation_type, int(resource_id), int(size_bytes),
                      tuple(hosts), self.controller.timestamp())
        self.send(msg)
        return msg

    def send(self, msg: Message) -> int:
        """Dispatch an encapsulated message (its timestamp is its generation time); returns
        its type."""
        t = self.adapter.submit(msg)
        if t not in self.controller.channel:  # first seen: no rate of it yet
            self.controller.set_channels({t: self.policy.first_channel(self.adapter, t)},
                                         {t: self._hosts_of(t)})
        self.controller.send(msg, t)
        return t

    def close_interval(self) -> IntervalEstimate:
        """Rates of the interval that ends now -> every active type's channel."""
        self.controller.flush()
        return self._apply(self.adapter.close_interval())

    def prime(self, messages: Sequence[Message]) -> IntervalEstimate:
        """Count ``messages`` as the interval before (without sending them), then decide."""
        for m in messages:
            self.adapter.submit(m)
        return self._apply(self.adapter.close_interval())

    def _apply(self, est: IntervalEstimate) -> IntervalEstimate:
        t0 = time.perf_counter()
        chans = self.policy.channels(self.adapter, est)
        self.controller.set_channels(chans, {t: self._hosts_of(t) for t in chans})
        self.decide_s.append(time.perf_counter() - t0)
        return est

    def flush(self) -> None:
        self.controller.flush()
