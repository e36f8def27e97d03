"""The delivery rig shared by the delivery tests: a controller and agents on a real broker,
a ledger of what the controller was asked to send, and the audits that judge delivery from the
agents' programming records (see ``tests/test_delivery.py``'s docstring).

The rig is secure by default (mutual TLS on every gRPC channel, Pulsar clients with their
identities, the session's development PKI of ``tests/conftest.py``); ``Rig(...,
security=Security(insecure=True))`` builds the plain one for comparisons."""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from delivery.agent import AgentConfig, read_record
from delivery.agent_host import AgentHost, host_spec
from delivery.checker import Resource, audit, lost
from delivery.controller import RPC, Controller, ControllerConfig, topic_name
from delivery.processes import AgentHostProcess
from delivery.rpc import open_channel
from delivery.store import MetadataStore
from envs.dsmd.message import Message
from envs.netutil import free_ports
from harness.broker import PulsarStandalone
from security.pulsar import admin_call, subscription_name
from security.tls import Security

from .slow_link import SlowLink
from .waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
OP = "UPDATE"


class Ledger:
    """What the controller was asked to send: node -> resource -> [(timestamp, message id)]."""

    def __init__(self) -> None:
        self.sent: dict[int, dict[Resource, list[tuple[int, int]]]] = defaultdict(
            lambda: defaultdict(list))
        self.ids = itertools.count(1)
        self.lock = threading.Lock()
        self.mq_sent = 0
        self.not_for_me: dict[int, int] = defaultdict(int)  # expected redundant MQ deliveries

    def send(self, ctl: Controller, type_id: int, resource_id: int, hosts: Iterable[int], *,
             vpc: int = 1, config: str = "SUBNET", size: int = 64) -> Message:
        hosts = tuple(hosts)
        with self.lock:
            mid = next(self.ids)
            m = Message(mid, mid, vpc, config, OP, resource_id, size, hosts, ctl.timestamp())
            for n in hosts:
                self.sent[n][(vpc, config, resource_id)].append((m.timestamp_ns, mid))
            c = ctl.channel.get(type_id, RPC)
            if c != RPC:
                self.mq_sent += 1
                for n, topics in ctl.node_topics.items():
                    if c in topics and n not in hosts:
                        self.not_for_me[n] += 1
        ctl.send(m, type_id)
        return m

    def total(self) -> int:
        return sum(len(v) for res in self.sent.values() for v in res.values())


def assert_delivered(record_dir: Path, ledger: Ledger, nodes: Iterable[int], *,
                     timeout: float = 30.0, every: bool = False,
                     pending: Callable[[], dict] | None = None) -> dict[int, list]:
    """Wait until every node's record ends, for every resource, with the newest message sent
    to it (and the controller's reprogramming queue is empty), failing at once on a
    violation. ``every``: also every message sent was applied (none superseded)."""
    nodes = list(nodes)
    state: dict = {}

    def done() -> bool:
        bad, missing, rows = audit(record_dir, ledger, nodes)
        assert not bad, "\n".join(bad[:20])
        state.update(missing=missing, rows=rows, pending=pending() if pending else {})
        return not missing and not state["pending"]

    wait_until(done, timeout, lambda: f"delivery of {ledger.total()} messages; pending "
               f"{state.get('pending')}; e.g. " + "; ".join(state.get("missing", [])[:5]))
    rows = state["rows"]
    gone = lost(rows, ledger, every=every)
    assert not gone, "\n".join(gone[:20])
    if every:
        with ledger.lock:
            for n in nodes:
                assert len(rows[n]) == sum(len(v) for v in ledger.sent[n].values()), \
                    f"node {n}: {len(rows[n])} applied rows"
    return rows


def assert_arrived(r: Rig, timeout: float = 20.0) -> None:
    """Every message sent to a node reached it: it is in the node's record (applied), or the
    node reported it OUT_OF_ORDER in a packed reply (it came after a newer one of the same
    resource that took the other channel). A redelivery of a message already applied (Pulsar
    after a crash or a broker restart, acknowledgements not yet persisted) is a DUPLICATE,
    and the controller re-sends nothing for an OUT_OF_ORDER, so no message in flight is
    superseded by a re-send."""
    def missing() -> list[str]:
        reported = {(n, mid) for n, kind, mid, _ in list(r.ctl.stats.errors)
                    if kind == "OUT_OF_ORDER"}
        out = []
        with r.ledger.lock:
            sent = {n: [mid for msgs in r.ledger.sent[n].values() for _, mid in msgs]
                    for n in r.nodes}
        for n in r.nodes:
            rows, _ = read_record(r.record_dir / f"node-{n}.record")
            applied = {x.message_id for x in rows}
            out += [f"node {n}: message {mid}" for mid in sent[n]
                    if mid not in applied and (n, mid) not in reported]
        return out

    wait_until(lambda: not missing(), timeout, lambda: "arrival (applied, or reported "
               "OUT_OF_ORDER) of " + ", ".join(missing()[:10]))


def admin_subscriptions(broker: PulsarStandalone, topic: str) -> set[str]:
    """The durable subscriptions of a topic (admin REST API, as ``admin`` over HTTPS when
    the broker is secure); empty if there is no topic."""
    path = "/admin/v2/persistent/" + topic.removeprefix("persistent://") + "/subscriptions"
    got = admin_call(broker.admin_url, "GET", path, security=broker.security, ok=(404,))
    return set(got or ())


class Rig:
    """A controller and in-process agents (one AgentHost) on a broker (a standalone one, or a
    :class:`harness.pulsar_cluster.PulsarCluster`: the rig uses its service and admin URLs
    and its security), with a fresh store, record directory and topic prefix; ``security``
    (default: secure) for all of them. ``slow_links`` (node -> bit/s): the controller
    reaches those nodes through one :class:`tests.slow_link.SlowLink` of that rate each."""

    def __init__(self, broker: PulsarStandalone, tmp: Path, nodes: Iterable[int], *,
                 ctl_kw: dict | None = None, agent_kw: dict | None = None,
                 agents_in_process: bool = True, security: Security | None = None,
                 slow_links: dict[int, float] | None = None) -> None:
        self.broker = broker
        self.security = security or Security()
        self.nodes = list(nodes)
        self.tmp = tmp
        self.store_url = f"sqlite:///{tmp / 'meta.db'}"
        self.record_dir = tmp / "records"
        self.prefix = f"persistent://public/default/td-{uuid.uuid4().hex[:10]}"
        self.ports = dict(zip(self.nodes, free_ports(len(self.nodes))))
        # producer_wait_s: a cold broker's first creation of a topic may outlast the 2-s
        # default on a busy machine (its messages would go over RPC): the tests count MQ
        kw = {"collect_period_s": 0.3, "reprogram_period_s": 0.2, "push_timeout_s": 2.0,
              "producer_wait_s": 30.0, "pulsar_admin_url": broker.admin_url}
        kw.update(ctl_kw or {})
        self.links = {n: SlowLink(self.ports[n], bps).__enter__()
                      for n, bps in (slow_links or {}).items()}
        dial = {n: self.links[n].port if n in self.links else p for n, p in self.ports.items()}
        self.ctl = Controller(ControllerConfig(broker.service_url, self.store_url,
                                               topic_prefix=self.prefix,
                                               security=self.security, **kw),
                              {n: f"127.0.0.1:{p}" for n, p in dial.items()}).start()
        self.agent_kw: dict = {"pack_period_s": 0.1}
        self.agent_kw.update(agent_kw or {})
        self.host: AgentHost | None = None
        if agents_in_process:
            cfgs = [AgentConfig(n, self.store_url, self.record_dir,
                                pulsar_url=broker.service_url,
                                controller=self.ctl.reply_address, port=p,
                                security=self.security, **self.agent_kw)
                    for n, p in self.ports.items()]
            self.host = AgentHost(cfgs, broker.service_url).start()
        self.ledger = Ledger()

    def topic(self, c: int) -> str:
        return topic_name(self.prefix, c)

    def channel(self, address: str, principal: str = "controller") -> Any:
        """A gRPC channel to ``address`` presenting ``principal``'s certificate (plain when
        the rig is insecure)."""
        return open_channel(address, self.security, principal)

    def agent_channel(self, node: int, principal: str = "controller") -> Any:
        """A channel to node ``node``'s agent, as ``principal`` (the controller's by
        default: what may push to it)."""
        return self.channel(f"127.0.0.1:{self.ports[node]}", principal)

    def send(self, type_id: int, resource_id: int, hosts: Iterable[int], **kw) -> Message:
        return self.ledger.send(self.ctl, type_id, resource_id, hosts, **kw)

    def delivered(self, timeout: float = 30.0, every: bool = False) -> dict[int, list]:
        self.ctl.flush()
        return assert_delivered(self.record_dir, self.ledger, self.nodes, timeout=timeout,
                                every=every, pending=self.ctl.pending)

    def expected_topics(self) -> dict[int, set[str]]:
        return {n: {self.topic(c) for c in self.ctl.node_topics.get(n, ())}
                for n in self.nodes}

    def wait_subscriptions(self, timeout: float = 20.0) -> None:
        """Agents, store and broker agree with the controller's subscriptions (drains done,
        drained durable subscriptions deleted)."""
        want = self.expected_topics()

        def agents_agree() -> bool:
            assert self.host is not None
            return all(self.host.agents[n].topics() == dict.fromkeys(want[n], "subscribed")
                       for n in self.nodes)

        wait_until(agents_agree, timeout, lambda: f"agents' topics "
                   f"{ {n: a.topics() for n, a in self.host.agents.items()} } == {want}")
        store = MetadataStore(self.store_url)
        try:
            active = store.active_topics()
        finally:
            store.close()
        assert {n: active.get(n, set()) for n in self.nodes} == want
        used = set().union(*want.values()) | set(self._used_topics)

        def broker_agrees() -> bool:
            return all(admin_subscriptions(self.broker, t)
                       == {subscription_name(n) for n in self.nodes if t in want[n]}
                       for t in used)

        wait_until(broker_agrees, timeout, lambda: "durable subscriptions " + str(
            {t: admin_subscriptions(self.broker, t) for t in used}) + f" vs {want}")

    @property
    def _used_topics(self) -> set[str]:
        return {self.topic(c) for c in range(1, 8)}

    def close(self) -> None:
        try:
            if self.host is not None:
                self.host.close()
        finally:
            self.ctl.close()
            for link in self.links.values():
                link.close()


@contextmanager
def rig(broker: PulsarStandalone, tmp: Path, nodes: Iterable[int], **kw) -> Iterator[Rig]:
    r = Rig(broker, tmp, nodes, **kw)
    try:
        yield r
    finally:
        r.close()


def outcomes(r: Rig) -> dict[str, int]:
    return dict(r.ctl.stats.outcomes)


class HostProcess(AgentHostProcess):
    """``python -m delivery.agent_host`` for some of the rig's nodes."""

    def __init__(self, r: Rig, nodes: Iterable[int]) -> None:
        super().__init__(r.tmp, "host", host_spec(
            {n: r.ports[n] for n in nodes}, store_url=r.store_url, record_dir=r.record_dir,
            pulsar_url=r.broker.service_url, controller=r.ctl.reply_address,
            security=r.security, **r.agent_kw))
