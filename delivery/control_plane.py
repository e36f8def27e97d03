"""The controller's message path end to end (SMART Fig. 1, P-1 to P-3): configuration requests
in, Table I messages out on the chosen channels.

:class:`ControlPlane` joins the three pieces a live controller has: the controller adapter
(:class:`serving.client.static.ControllerAdapter`: the parser's destination-hash batching and rate
estimation, and the learned policy in remote or cached mode), a
:class:`~delivery.policies.ChannelPolicy` (the adapter's policy or a baseline) and the
:class:`~delivery.controller.Controller` (metadata store, SubscribeInfo, dispatch, replies).

* :meth:`request` encapsulates one configuration request as a Table I message (a message id,
  the request id, and the generation timestamp), counts it in the parser, gives a type seen
  for the first time its policy's first channel, and dispatches it.
* :meth:`close_interval` ends the running interval (Algorithm 1, lines 10-11: rates from the
  counters) and applies the policy's channels for the next one.

**Topic relabelling.** The K MQ topics are interchangeable in the cost model (Eq. 1 depends
on which types share a topic, not on its number), but a policy that re-plans every interval
may put the same group of types on another topic number each time, and every such move costs
real subscriptions (SubscribeInfo, a durable subscription created and one drained and
deleted). Before a new assignment is applied its topics are renamed (:func:`relabel_topics`,
a maximum-weight matching) so that as many (node, topic) subscriptions as possible stay; the
assignment's cost is unchanged. It is on for policies that re-plan from scratch and say so
(``relabel_topics = True``: the learned policy); a baseline whose topic numbers mean something
(VITA's and IDCS's per-VPC topics, which ``first_channel`` also uses for new types) keeps
them: renaming its topics gives more SubscribeInfos in the Fig. 10 scenario, not fewer.
``relabel=True/False`` overrides the policy's choice.

**Channel health.** The controller's failover planning uses the scenario's C_b and C_p, and
every change of channel health (:meth:`delivery.controller.Controller.health`) is set on the
adapter's session, so the policy server and the adapter see it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

import numpy as np

from envs.dsmd.cost import CostState
from envs.dsmd.delay import DelayLoad, DelayModel, delivery_share, load_delay_model
from envs.dsmd.instance import DSMDInstance
from envs.dsmd.message import Message
from envs.dsmd.online import relabel_topics as relabel_topics_matrix
from envs.dsmd.parser import IntervalEstimate

from .controller import Controller
from .policies import ChannelPolicy

__all__ = ["ControlPlane", "relabel_topics"]


def relabel_topics(new: Mapping[int, int], subscribed: Mapping[int, Iterable[int]],
                   hosts_of: Callable[[int], Sequence[int]], num_topics: int
                   ) -> dict[int, int]:
    """``new`` (type -> 0 = RPC or topic 1..K) with its topics renamed by a permutation of
    1..K that keeps as many of the nodes' current subscriptions (``subscribed``: node ->
    topics) as possible: new topic ``a`` becomes ``b`` maximising the sum over ``a`` of
    |nodes that will need ``a``  and already have ``b``| (Hungarian method). Which types share
    a topic, and so the assignment's cost, does not change."""
    used = sorted({int(c) for c in new.values() if c})
    if not used:
        return {int(t): int(c) for t, c in new.items()}
    if used[-1] > num_topics:
        raise ValueError(f"topic {used[-1]} is above K = {num_topics}")
    nodes = sorted(set().union(*(map(int, hosts_of(t)) for t, c in new.items() if c))
                   | {int(n) for n in subscribed})
    col = {n: i for i, n in enumerate(nodes)}
    need = np.zeros((num_topics, len(nodes)), bool)
    for t, c in new.items():
        if c:
            need[int(c) - 1, [col[int(n)] for n in hosts_of(t)]] = True
    have = np.zeros((num_topics, len(nodes)), bool)
    for n, topics in subscribed.items():
        for b in topics:
            have[int(b) - 1, col[int(n)]] = True
    to = relabel_topics_matrix(need, have)
    return {int(t): (int(to[int(c)]) if c else 0) for t, c in new.items()}


class ControlPlane:
    def __init__(self, controller: Controller, adapter, policy: ChannelPolicy, *,
                 relabel: bool | None = None) -> None:
        self.controller, self.adapter, self.policy = controller, adapter, policy
        self.relabel = bool(getattr(policy, "relabel_topics", False)
                            if relabel is None else relabel)
        spec = adapter.local.spec
        # failover plans within the scenario's C_b and C_p where the controller's failover
        # configuration leaves them unset, and the channel health reaches the session
        controller.set_capacities(float(spec.controller_bw_bps), float(spec.controller_cpu))
        if hasattr(adapter, "set_channel_health"):
            controller.on_health(adapter.set_channel_health)
        cat = adapter.parser.catalog
        ids = cat.topology.node_ids
        self._hosts_of = lambda t: ids[cat.destinations[t]].tolist()
        self._ids = itertools.count(1)
        self.decide_s: list[float] = []
        self.predictions: list[dict[str, float]] = []  # per decision: Eq. 1's violations
        self.delay_loads: list[dict] = []  # per decision: the delay model's input (DelayLoad)
        # per delivered interval: the same on its own counted rates and the channels its
        # types had when it closed (placements during the interval included)
        self.realised: list[dict[str, float]] = []
        self.realised_loads: list[dict] = []
        # SubscribeInfos (both ways, unsubscribing) at the last close
        self._infos = (controller.stats.subscribe_infos, controller.stats.unsubscribe_infos)
        self._delivered_on: dict[int, int] = {}  # each type's channel at the last close
        self.delay_model: DelayModel = load_delay_model()

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
        route = getattr(self.policy, "route", None)  # an online policy places every message
        c = route(self.adapter, msg, t) if route is not None else None
        asked = self.controller.channel_asked(t)  # with the queued switches done
        if c is None and asked is None:  # first seen: no rate of it yet
            c = self.policy.first_channel(self.adapter, t)
        if c is not None and asked != c:
            # queued: this message (and the type's next ones) wait for it, nothing else does
            self.controller.set_channels({t: c}, {t: self._hosts_of(t)}, wait=False)
        self.controller.send(msg, t)
        return t

    def close_interval(self) -> IntervalEstimate:
        """Rates of the interval that ends now -> every active type's channel (the switch
        is queued: only the types it moves wait for it)."""
        self.settle()
        est = self.adapter.close_interval()
        self.realise(est)
        return self._apply(est)

    def finish(self) -> None:
        """Close the last interval of a replay without deciding: its realised prediction."""
        self.settle()
        self.realise(self.adapter.close_interval())

    def realise(self, est: IntervalEstimate) -> dict[str, float]:
        """The simulator's verdict on an interval as it was delivered (:meth:`predict` on
        its own counted rates, with each type's channel at the interval's close, which is
        where a type placed on its first message went), kept in :attr:`realised` and its
        delay model input in :attr:`realised_loads`. Unlike :attr:`predictions`, made at the
        boundary on the closed interval's rates for the next one, this is what the
        delivered messages' delays are compared with."""
        ch = self.controller.channel
        chans = {int(t): int(ch.get(int(t), 0)) for t in est.types.tolist()}
        st = self.controller.stats
        infos = (st.subscribe_infos, st.unsubscribe_infos)
        moved = sum(1 for t, c in ch.items() if self._delivered_on.get(t, c) != c)
        # the controller held these types' messages for the subscribing SubscribeInfos:
        # moved, or placed on a topic
        held = {t for t, c in ch.items() if self._delivered_on.get(t, 0) != c}
        made = (infos[0] - infos[1]) - (self._infos[0] - self._infos[1])
        p = self.predict(est, chans, self.realised_loads, switches=(made, moved), held=held)
        self._infos, self._delivered_on = infos, dict(ch)
        self.realised.append(p)
        return p

    def prime(self, messages: Sequence[Message]) -> IntervalEstimate:
        """Count ``messages`` as the interval before (without sending them), then decide."""
        route = getattr(self.policy, "route", None)
        for m in messages:
            t = self.adapter.submit(m)
            if route is not None:
                route(self.adapter, m, t)
        est = self._apply(self.adapter.close_interval())
        self.controller.wait_switches()
        # the priming switch happens before any message is due: it holds none of them
        st = self.controller.stats
        self._infos = (st.subscribe_infos, st.unsubscribe_infos)
        self._delivered_on = dict(self.controller.channel)
        return est

    def _apply(self, est: IntervalEstimate) -> IntervalEstimate:
        t0 = time.perf_counter()
        chans = self.policy.channels(self.adapter, est)
        if self.relabel:
            chans = relabel_topics(chans, self.controller.node_topics, self._hosts_of,
                                   int(self.adapter.local.spec.num_topics))
        self.controller.set_channels(chans, {t: self._hosts_of(t) for t in chans}, wait=False)
        self.decide_s.append(time.perf_counter() - t0)
        self.predictions.append(self.predict(est, chans))
        return est

    def predict(self, est: IntervalEstimate, chans: Mapping[int, int],
                loads: list[dict] | None = None, switches: tuple[int, int] = (0, 0),
                held: Collection[int] = ()) -> dict[str, float]:
        """What the simulator's cost model (Eq. 1, :class:`envs.dsmd.cost.CostState`) says of
        the channels ``chans`` (a type not in it: RPC) for the interval's rates: each
        constraint's violation, each resource's utilisation and the delay model's p50 and p95
        (:class:`envs.dsmd.delay.DelayModel`, whose input is appended to ``loads``, by
        default :attr:`delay_loads`), with ``switches`` (subscribing SubscribeInfos, types
        moved) holding the messages of the types ``held``."""
        spec = self.adapter.local.spec
        inst = DSMDInstance.from_estimate(self.adapter.parser.catalog, est, spec.num_topics,
                                          spec.controller_bw_bps, spec.controller_cpu)
        ch = np.array([chans.get(int(t), 0) for t in inst.catalog_index], dtype=np.int64)
        state = CostState(inst, ch)
        m = state.metrics()
        node_util = float(np.max(state.node_traffic / np.maximum(inst.node_capacity_bps, 1))) \
            if inst.node_capacity_bps.size else 0.0
        share = delivery_share(inst, np.isin(inst.catalog_index, list(held)))
        load = DelayLoad.from_state(state).with_switches(*switches, held_share=share)
        (self.delay_loads if loads is None else loads).append(load.to_dict())
        delay = self.delay_model.quantiles(load)
        bw_util = m.controller_traffic_bps / inst.controller_bw_bps
        cpu_util = m.controller_sends / inst.controller_cpu
        return {"utilisation": max(bw_util, cpu_util, node_util),
                "bw_utilisation": bw_util, "cpu_utilisation": cpu_util,
                "node_utilisation": node_util,
                "delay_p50_ms": 1e3 * delay["delay_p50_s"],
                "delay_p95_ms": 1e3 * delay["delay_p95_s"],
                "controller_bw_violation": m.controller_bw_violation,
                "controller_cpu_violation": m.controller_cpu_violation,
                "node_violation": m.node_violation, "nodes_over_capacity": m.nodes_over_capacity,
                "controller_traffic_bps": m.controller_traffic_bps,
                "controller_sends": m.controller_sends,
                "max_node_traffic_bps": m.max_node_traffic_bps}

    def flush(self) -> None:
        """Push what RPC holds and wait for the broker's acknowledgements (queued switches
        go on)."""
        self.controller.flush()

    def settle(self) -> None:
        """Wait for the queued switches (their held messages dispatched), then :meth:`flush`."""
        self.controller.wait_switches()
        self.controller.flush()
