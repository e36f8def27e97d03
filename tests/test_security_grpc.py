"""Mutual TLS and role checks on every gRPC channel of ``delivery/`` (issue: secure by
default), with real components: real agents (``AgentHost``), a real controller and its real
ingress, real gRPC clients presenting real certificates of the session's development PKI
(``tests/conftest.py``) or of a second, foreign CA. No mocks.

* An agent serves only the ``controller`` role: a caller with another role's certificate
  from the right CA is refused (``PERMISSION_DENIED``) on every method, before the servicer
  runs; one without a certificate, or with one a foreign CA signed, or in plain text, fails
  the TLS handshake (``UNAVAILABLE``); nothing of a refused call reaches the record.
* The controller's reply server takes a packed reply only from the certificate of the
  reply's own node (``agent-5`` reporting for node 3, or the controller reporting, is
  refused, and nothing of it is applied: the outbox and the counters stay as they were);
  a collected reply for another node than the one asked is refused too.
* The ingress serves only ``admin``.
* Each refusal is one warning line naming the principal and the method, with no key text.
* ``insecure`` gives plain channels and warns once per component start.

Most tests need no broker; the last runs the secure and the insecure rig on the broker.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import grpc
import pytest

from delivery.agent import AgentConfig, read_record
from delivery.agent_host import AgentHost, host_spec
from delivery.controller import RPC, ConfigError, Controller, ControllerConfig
from delivery.controller_host import Ingress, controller_spec, load_spec
from delivery.rpc import open_channel, pb, pb_grpc
from envs.dsmd.message import Message
from envs.netutil import free_ports
from security.pki import Pki
from security.tls import Security, channel_credentials

from .delivery_rig import OP, rig, wait_until

SEC = Security()
PUSH, SUBSCRIBE, COLLECT = (f"/smart.delivery.v1.MessageAgent/{m}"
                            for m in ("Push", "Subscribe", "Collect"))
REPORT = "/smart.delivery.v1.ControllerReplies/Report"
KEY_TEXT = ("PRIVATE KEY", "BEGIN", "END CERTIFICATE")


# --------------------------------------------------------------------------- helpers


def _code(call, *args, **kw) -> grpc.StatusCode:
    """The status code of one call (OK if it succeeded)."""
    try:
        call(*args, timeout=5, **kw)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _foreign_channel(address: str, tmp: Path) -> grpc.Channel:
    """Trusts the right CA, but presents a ``controller`` certificate of another CA."""
    other = Pki.ensure(tmp / "other-ca").identity("controller")
    _, cert, key = other.read()
    ca = SEC.pki.ca_cert.read_bytes()
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert))


def _anonymous_channel(address: str) -> grpc.Channel:
    """TLS with the right CA, but no client certificate."""
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(
        root_certificates=SEC.pki.ca_cert.read_bytes()))


def _handshake_failures(address: str, tmp: Path) -> dict[str, grpc.Channel]:
    return {"no certificate": _anonymous_channel(address),
            "another CA's certificate": _foreign_channel(address, tmp),
            "plain text": grpc.insecure_channel(address)}


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and " refused " in r.getMessage()]


def _no_key_text(text: str) -> None:
    for k in KEY_TEXT:
        assert k not in text, f"{k!r} in {text[:300]!r}"


def _message(node: int, ts: int, mid: int = 1, resource: int = 1) -> pb.ConfigMessage:
    return pb.ConfigMessage(message_id=mid, vpc_id=1, timestamp_ns=ts,
                            configuration_type="SUBNET", operation_type=OP,
                            resource_id=resource, hosts=[node])


def _agents(tmp: Path, nodes: tuple[int, ...], security: Security = SEC) -> AgentHost:
    cfgs = [AgentConfig(n, f"sqlite:///{tmp / 'meta.db'}", tmp / "records",
                        security=security) for n in nodes]
    return AgentHost(cfgs, None)


def _controller(tmp: Path, agents: dict[int, str], security: Security = SEC) -> Controller:
    """A controller with no broker behind it (nothing here publishes) and its periodic
    collection and reprogramming out of the way."""
    cfg = ControllerConfig(f"pulsar://127.0.0.1:{free_ports(1)[0]}",
                           f"sqlite:///{tmp / 'meta.db'}", collect_period_s=3600,
                           reprogram_period_s=3600, push_timeout_s=1.0,
                           failover={"enabled": False}, security=security)
    return Controller(cfg, agents)


# --------------------------------------------------------------------------- agents


def test_agent_serves_only_the_controller(tmp_path, caplog):
    """Push, Subscribe and Collect from an agent's, the admin's and the policy server's
    certificates (right CA, wrong role) are refused with PERMISSION_DENIED, each logged once
    with the principal and the method; without a certificate, with a foreign CA's or in
    plain text the handshake fails (UNAVAILABLE, before any Python code runs); nothing of a
    refused call is applied, subscribed or acknowledged. The controller's certificate
    pushes."""
    caplog.set_level(logging.WARNING)
    with _agents(tmp_path, (3,)) as host:
        agent = host.agents[3]
        address = f"127.0.0.1:{agent.port}"
        ts = time.time_ns()
        batch = pb.ConfigBatch(messages=[_message(3, ts)])
        info = pb.SubscribeInfo(url="pulsar://127.0.0.1:6650", topic="persistent://p/d/t",
                                subscription="node-3", timestamp_ns=ts, operation=True)
        # a result the controller has not collected yet: a refused Collect must not take it
        agent._result(7, 1, 1, "SUBNET", ts, pb.MALFORMED, "rpc", "kept")
        wrong = ("agent-5", "admin", "policy-server")
        for principal in wrong:
            with open_channel(address, SEC, principal) as ch:
                stub = pb_grpc.MessageAgentStub(ch)
                assert _code(stub.Push, batch) == grpc.StatusCode.PERMISSION_DENIED
                assert _code(stub.Subscribe, info) == grpc.StatusCode.PERMISSION_DENIED
                assert _code(stub.Collect, pb.CollectRequest(acknowledged=2**63)) == \
                    grpc.StatusCode.PERMISSION_DENIED
        lines = _refusals(caplog)
        assert len(lines) == 3 * len(wrong), lines
        for principal in wrong:
            for method in (PUSH, SUBSCRIBE, COLLECT):
                assert sum(f"{method} from {principal} " in x for x in lines) == 1, lines
        assert agent.counters.refused_calls == 3 * len(wrong)

        for what, ch in _handshake_failures(address, tmp_path).items():
            with ch:
                stub = pb_grpc.MessageAgentStub(ch)
                assert _code(stub.Push, batch) == grpc.StatusCode.UNAVAILABLE, what
                assert _code(stub.Subscribe, info) == grpc.StatusCode.UNAVAILABLE, what
        assert len(_refusals(caplog)) == 3 * len(wrong)  # the handshake is gRPC's own
        assert agent.counters.refused_calls == 3 * len(wrong)

        # nothing was applied, subscribed, or taken from the results
        assert read_record(agent.record.path) == ([], {})
        assert agent.counters.rx_messages_rpc == 0 and agent.counters.subscribes == 0
        assert agent.topics() == {} and agent.pending_results() == 1
        _no_key_text(caplog.text)

        with open_channel(address, SEC, "controller") as ch:
            ack = pb_grpc.MessageAgentStub(ch).Push(batch, timeout=5)
        assert (ack.accepted, ack.rejected) == (1, 0)
        wait_until(lambda: len(read_record(agent.record.path)[0]) == 1, 5, "the push applied")
        assert agent.counters.refused_calls == 3 * len(wrong)


# --------------------------------------------------------------------------- the controller


def _report(node: int, ts: int, seq: int, *, result_node: int | None = None
            ) -> pb.PackedReply:
    return pb.PackedReply(node_id=node, sequence=seq, results=[pb.ProgrammingResult(
        message_id=1, resource_id=1, vpc_id=1, configuration_type="SUBNET", timestamp_ns=ts,
        outcome=pb.APPLIED, channel="rpc", result_seq=seq,
        node_id=node if result_node is None else result_node)])


def test_controller_takes_replies_only_from_their_own_node(tmp_path, caplog):
    """A packed reply for node 3 confirming a stored message: refused from agent-5's, the
    controller's and the admin's certificates, and when agent-3's reply carries a result of
    node 4; the handshake fails without a certificate or with a foreign CA's. Nothing of a
    refused reply is applied (the outbox row stays, no outcome is counted, the
    acknowledgement does not move). Agent-3's own reply then confirms it."""
    caplog.set_level(logging.WARNING)
    ctl = _controller(tmp_path, {3: f"127.0.0.1:{free_ports(1)[0]}",
                                 4: f"127.0.0.1:{free_ports(1)[0]}"}).start()
    try:
        msg = Message(1, 1, 1, "SUBNET", OP, 1, 64, (3,), ctl.timestamp())
        ctl.send_many([(msg, 0)])                     # stored; not pushed (no flush)
        assert ctl.store.outbox_size() == (1, 1)
        ts = msg.timestamp_ns
        forged = _report(3, ts, seq=10)
        for principal in ("agent-5", "controller", "admin"):
            with open_channel(ctl.reply_address, SEC, principal) as ch:
                stub = pb_grpc.ControllerRepliesStub(ch)
                assert _code(stub.Report, forged) == grpc.StatusCode.PERMISSION_DENIED
        with open_channel(ctl.reply_address, SEC, "agent-3") as ch:
            mixed = _report(3, ts, seq=10, result_node=4)
            assert _code(pb_grpc.ControllerRepliesStub(ch).Report, mixed) == \
                grpc.StatusCode.PERMISSION_DENIED
        for what, ch in _handshake_failures(ctl.reply_address, tmp_path).items():
            with ch:
                assert _code(pb_grpc.ControllerRepliesStub(ch).Report, forged) == \
                    grpc.StatusCode.UNAVAILABLE, what
        lines = _refusals(caplog)
        assert len(lines) == 4, lines
        for principal in ("agent-5", "controller", "admin", "agent-3"):
            assert sum(f"{REPORT} from {principal} " in x for x in lines) == 1, lines
        assert "the packed reply is for node 3, not agent-5's" in "\n".join(lines)
        _no_key_text(caplog.text)
        assert ctl.stats.refused_calls == 4
        assert ctl.store.outbox_size() == (1, 1)      # nothing confirmed
        assert dict(ctl.stats.outcomes) == {}

        with open_channel(ctl.reply_address, SEC, "agent-3") as ch:
            ack = pb_grpc.ControllerRepliesStub(ch).Report(_report(3, ts, seq=1), timeout=5)
        assert ack.acknowledged == 1                  # seq 10 was never taken
        assert ctl.store.outbox_size() == (0, 0)
        assert dict(ctl.stats.outcomes) == {"APPLIED": 1}
        assert ctl.stats.refused_calls == 4
    finally:
        ctl.close()


def test_another_node_cannot_answer_at_a_nodes_address(tmp_path, caplog):
    """The agent of node 5 answers at the address the controller has for node 3. Its
    certificate is the CA's and names the host, but the controller's channel to node 3 is
    pinned to ``agent-3``'s identity name (``agent-3.id.smart-dsmd``), which agent-5's
    certificate does not carry: the handshake fails, nothing is collected and the agent
    keeps its result. (A reply for another node that did get through would still be
    refused: the Report tests above.)"""
    caplog.set_level(logging.WARNING)
    (tmp_path / "a").mkdir()
    with _agents(tmp_path / "a", (5,)) as host:
        agent = host.agents[5]
        with open_channel(f"127.0.0.1:{agent.port}", SEC, "controller") as ch:
            pb_grpc.MessageAgentStub(ch).Push(pb.ConfigBatch(messages=[
                _message(5, time.time_ns())]), timeout=5)
        assert agent.pending_results() == 1
        address = f"127.0.0.1:{agent.port}"
        with open_channel(address, SEC, "controller", expect="agent-3") as ch:
            assert _code(pb_grpc.MessageAgentStub(ch).Collect, pb.CollectRequest()) == \
                grpc.StatusCode.UNAVAILABLE
        ctl = _controller(tmp_path, {3: address}).start()
        try:
            assert ctl.collect() == 0
            assert dict(ctl.stats.outcomes) == {}
        finally:
            ctl.close()
        assert agent.pending_results() == 1
        assert agent.counters.replies_collected == 0
        with open_channel(address, SEC, "controller", expect="agent-5") as ch:
            assert _code(pb_grpc.MessageAgentStub(ch).Collect, pb.CollectRequest()) == \
                grpc.StatusCode.OK


def test_ingress_serves_only_admin(tmp_path, caplog):
    """The controller's ingress: Status, Configure and SetChannels from the admin's
    certificate work; from the controller's or an agent's they are refused
    (PERMISSION_DENIED, logged once each, counted in the controller's refused_calls) and
    nothing is stored or switched; without a certificate the handshake fails."""
    caplog.set_level(logging.WARNING)
    ctl = _controller(tmp_path, {0: f"127.0.0.1:{free_ports(1)[0]}"}).start()
    ingress = Ingress(ctl).start()
    address = f"127.0.0.1:{ingress.port}"
    configure = pb.ConfigRequests(requests=[pb.ConfigRequest(
        message_id=1, request_id=1, vpc_id=1, configuration_type="SUBNET", operation_type=OP,
        resource_id=1, size_bytes=10, hosts=[0], type_id=0)])
    switch = pb.ChannelsRequest(types=[pb.TypeChannel(type_id=0, channel=RPC, hosts=[0])])
    try:
        for principal in ("controller", "agent-0"):
            with open_channel(address, SEC, principal) as ch:
                stub = pb_grpc.ControllerIngressStub(ch)
                for call, req in ((stub.Configure, configure), (stub.SetChannels, switch),
                                  (stub.Status, pb.StatusRequest())):
                    assert _code(call, req) == grpc.StatusCode.PERMISSION_DENIED
        with _anonymous_channel(address) as ch:
            assert _code(pb_grpc.ControllerIngressStub(ch).Status, pb.StatusRequest()) == \
                grpc.StatusCode.UNAVAILABLE
        assert ctl.store.outbox_size() == (0, 0) and ctl.channel == {}
        assert ctl.stats.refused_calls == 6
        lines = _refusals(caplog)
        assert len(lines) == 6 and all("controller ingress refused" in x for x in lines)
        assert sum("ControllerIngress/Configure from agent-0 " in x for x in lines) == 1
        _no_key_text(caplog.text)
        with open_channel(address, SEC, "admin") as ch:
            stub = pb_grpc.ControllerIngressStub(ch)
            assert stub.SetChannels(switch, timeout=5).types == 1
            assert len(stub.Configure(configure, timeout=5).timestamps_ns) == 1
            assert '"refused_calls": 6' in stub.Status(pb.StatusRequest(), timeout=5).stats_json
    finally:
        ingress.stop(0)
        ctl.close()


# --------------------------------------------------------------------------- settings


def test_insecure_is_plain_and_warns_once_per_start(tmp_path, caplog):
    """``insecure``: the agent, the controller and the ingress serve plain gRPC (a TLS
    client cannot reach them), and each warns once when it starts, not per call."""
    caplog.set_level(logging.WARNING)
    plain = Security(insecure=True)
    (tmp_path / "a").mkdir()
    with _agents(tmp_path / "a", (3,), plain) as host:
        address = f"127.0.0.1:{host.agents[3].port}"
        with open_channel(address, plain, "controller") as ch:
            stub = pb_grpc.MessageAgentStub(ch)
            for k in range(3):
                stub.Push(pb.ConfigBatch(messages=[_message(3, time.time_ns(), k + 1, k)]),
                          timeout=5)
        with open_channel(address, SEC, "controller") as ch:
            assert _code(pb_grpc.MessageAgentStub(ch).Push, pb.ConfigBatch()) == \
                grpc.StatusCode.UNAVAILABLE
        host.stop_agent(3)
        host.start_agent(3)
        assert len(read_record(host.agents[3].record.path)[0]) == 3
    ctl = _controller(tmp_path, {3: address}, plain).start()
    ingress = Ingress(ctl).start()
    try:
        with open_channel(f"127.0.0.1:{ingress.port}", plain, "admin") as ch:
            for _ in range(3):
                pb_grpc.ControllerIngressStub(ch).Status(pb.StatusRequest(), timeout=5)
    finally:
        ingress.stop(0)
        ctl.close()
    warned = [r.getMessage() for r in caplog.records if "SECURITY OFF" in r.getMessage()]
    assert sorted(w.split(" runs ")[0] for w in warned) == [
        "SECURITY OFF: agent 3", "SECURITY OFF: agent 3", "SECURITY OFF: controller",
        "SECURITY OFF: controller ingress"], warned
    assert not _refusals(caplog)


def test_security_settings_are_checked_and_carried(tmp_path):
    """The ``security`` block of the agent and controller configs, the agent-host spec and
    the controller-host spec: a mapping or a :class:`Security`, the secure default when left
    out, a bad value a ConfigError naming ``delivery config: security...``; no key text in
    any representation."""
    store = f"sqlite:///{tmp_path / 'm.db'}"
    assert AgentConfig(1, store, tmp_path).security == SEC
    assert AgentConfig(1, store, tmp_path, security={"insecure": True}).security.insecure
    for bad, match in (({"insecure": "no"}, r"delivery config: security\.insecure"),
                       ({"pki": "/x"}, r"delivery config: security: unknown key"),
                       (5, "delivery config: security: expected a mapping")):
        with pytest.raises(ConfigError, match=match):
            AgentConfig(1, store, tmp_path, security=bad)
        with pytest.raises(ConfigError, match=match):
            ControllerConfig.from_mapping({"pulsar_url": "pulsar://x:1", "store_url": store,
                                           "security": bad})
    cfg = ControllerConfig.from_mapping({"pulsar_url": "pulsar://x:1", "store_url": store,
                                         "security": {"pki_dir": str(tmp_path / "p")}})
    assert cfg.security == Security(pki_dir=str(tmp_path / "p"))
    spec = host_spec({1: 7000}, store_url=store, record_dir=tmp_path, pulsar_url="pulsar://x:1",
                     controller=None, security=Security(insecure=True))
    assert spec["security"] == {"insecure": True, "pki_dir": None}
    assert host_spec({1: 7000}, store_url=store, record_dir=tmp_path,
                     pulsar_url="pulsar://x:1", controller=None)["security"]["insecure"] is False
    cspec = controller_spec({0: "127.0.0.1:7000"}, ingress_port=7001, pulsar_url="pulsar://x:1",
                            store_url=store, reply_port=7002, security=SEC)
    assert load_spec(cspec)[0].security == SEC
    ident = SEC.agent(1)
    text = repr(AgentConfig(1, store, tmp_path)) + repr(cfg) + repr(ident) + repr(SEC.pki)
    _no_key_text(text)
    channel_credentials(ident)  # builds from the files; its key is never in a repr


# --------------------------------------------------------------------------- on the broker


def _deliver(broker, tmp: Path, security: Security) -> None:
    """RPC and MQ messages through the rig, applied exactly once, with the packed replies
    reported by the agents themselves (the controller's collection off); no call refused
    anywhere."""
    nodes = (0, 1, 2)
    hosts = {0: nodes, 1: (1, 2)}
    with rig(broker, tmp, nodes, security=security, ctl_kw={"collect_period_s": 3600},
             agent_kw={"report_after_s": 0.3, "pack_period_s": 0.05}) as r:
        r.ctl.set_channels({0: RPC, 1: 1}, hosts)
        for k in range(30):
            r.send(k % 2, resource_id=10 * (k % 2) + k % 3, hosts=hosts[k % 2])
        r.delivered(every=True)
        total = r.ledger.total()
        wait_until(lambda: r.ctl.stats.outcomes.get("APPLIED", 0) >= total, 15,
                   "every result reported")
        # an agent counts its report once the controller has answered it, after the
        # controller counted the results: wait for the counters, not only the outcomes
        wait_until(lambda: all(c["replies_reported"] > 0 for c in r.host.counters().values()),
                   5, lambda: f"every agent to count a report, got {r.host.counters()}")
        assert r.ctl.stats.refused_calls == 0
        assert all(c["refused_calls"] == 0 for c in r.host.counters().values())


@pytest.mark.xdist_group("pulsar")
def test_secure_rig_delivers(pulsar_broker, tmp_path, caplog):
    """The delivery rig as every delivery test runs it (secure, the default) on the secure
    broker: mutual TLS both ways and on Pulsar, nothing refused, nothing insecure."""
    caplog.set_level(logging.WARNING)
    assert pulsar_broker.service_url.startswith("pulsar+ssl://")
    _deliver(pulsar_broker, tmp_path, SEC)
    assert not _refusals(caplog)
    assert not [r for r in caplog.records if "SECURITY OFF" in r.getMessage()]


@pytest.mark.slow
@pytest.mark.xdist_group("pulsar")
def test_insecure_rig_delivers_and_warns(tmp_path, caplog):
    """``insecure`` end to end, on an insecure broker of its own: plain gRPC and Pulsar
    deliver as before, and each component warns once when it starts."""
    pytest.importorskip("pulsar")
    from harness.broker import PulsarStandalone
    from tests.conftest import start_or_skip

    caplog.set_level(logging.WARNING)
    plain = Security(insecure=True)
    broker = start_or_skip(PulsarStandalone(progress=None, work_dir=tmp_path / "broker",
                                            security=plain))
    with broker:
        (tmp_path / "rig").mkdir()
        _deliver(broker, tmp_path / "rig", plain)
    warned = sorted(r.getMessage().split(" runs ")[0] for r in caplog.records
                    if "SECURITY OFF" in r.getMessage())
    assert warned == ["SECURITY OFF: agent 0", "SECURITY OFF: agent 1",
                      "SECURITY OFF: agent 2", "SECURITY OFF: controller",
                      "SECURITY OFF: the Pulsar broker"], warned
