"""Pulsar with TLS, authentication and authorisation (:mod:`security.pulsar`), against the
real broker of :mod:`harness.broker` (the session's ``pulsar_broker``, secure by default).

Every refusal is checked three ways: the client's error, nothing delivered, and the
broker's own log naming the role (or, for a refused handshake, the peer address) and the
topic, with no key material in it.
"""

from __future__ import annotations

import http.client
import logging
import ssl
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from harness import broker as broker_mod
from harness.broker import PulsarStandalone
from security import pulsar as sp
from security.pki import Pki
from security.tls import Security
from tests.waiting import wait_until

pulsar = pytest.importorskip("pulsar")

pytestmark = pytest.mark.xdist_group("pulsar")

log = logging.getLogger(__name__)
OP_TIMEOUT_S = 3  # a refused TLS handshake shows as a timeout after this (the client retries)


def _client(b: PulsarStandalone, principal: str | None, timeout: int = 30,
            **tls: object) -> pulsar.Client:
    args = b.client_args(principal) if principal else {}
    args.update(tls)
    return pulsar.Client(b.service_url, operation_timeout_seconds=timeout,
                         connection_timeout_ms=3000,
                         logger=logging.getLogger(f"pulsar-client.{principal}"), **args)


def _topic() -> str:
    """A configuration topic as the controller names them (``<prefix>-t<k>``)."""
    return f"persistent://public/default/sec-{uuid.uuid4().hex[:10]}-t1"


def _log_since(b: PulsarStandalone, offset: int) -> str:
    with open(b.log_path, "rb") as f:
        f.seek(offset)
        return f.read().decode("utf-8", "replace")


def _log_size(b: PulsarStandalone) -> int:
    return b.log_path.stat().st_size


def _assert_logged(b: PulsarStandalone, offset: int, *parts: str) -> str:
    """Wait until one line of the broker's log (after ``offset``) holds all ``parts``."""
    def line() -> str | None:
        return next((ln for ln in _log_since(b, offset).splitlines()
                     if all(p in ln for p in parts)), None)
    wait_until(line, 10, lambda: f"a broker log line with {parts}")
    found = line()
    assert found is not None
    return found


def _assert_no_secrets(b: PulsarStandalone) -> None:
    text = b.log_path.read_text(errors="replace")
    assert "PRIVATE KEY" not in text
    for principal in ("broker", "admin", "controller", "agent-3", "policy-server"):
        key = b.security.identity(principal).key.read_text().splitlines()
        body = [ln for ln in key if ln and not ln.startswith("-----")]
        assert all(ln not in text for ln in body), f"{principal}'s key is in the broker log"


# --------------------------------------------------------------------------- no broker


def test_client_args_and_subscription_name(tmp_path: Path) -> None:
    sec = Security(pki_dir=str(tmp_path / "pki"))
    args = sp.client_args(sec, "agent-7")
    assert isinstance(args["authentication"], pulsar.AuthenticationTLS)
    assert args["tls_trust_certs_file_path"] == str(sec.identity("agent-7").ca)
    assert args["tls_validate_hostname"] is True
    assert args["tls_allow_insecure_connection"] is False
    assert sp.client_args(Security(insecure=True), "agent-7") == {}
    assert sp.subscription_name(7) == "agent-7"
    # the Prefix mode alone would let agent-3 use these: hence the subscription permissions
    assert sp.subscription_name(30).startswith("agent-3")
    assert sp.parse_nodes("0-2,7") == [0, 1, 2, 7]


def test_secure_and_insecure_settings(tmp_path: Path, caplog, monkeypatch) -> None:
    """The broker's settings, without starting it: TLS ports only, mutual TLS, authorisation;
    insecure is the old plain broker and says so."""
    sec = Security(pki_dir=str(tmp_path / "pki"))
    b = PulsarStandalone(port=6651, web_port=8443, bookie_port=3181, work_dir=tmp_path / "w",
                         security=sec, progress=None)
    conf = dict(ln.split("=", 1) for ln in
                b._write_conf(tmp_path / "w").read_text().splitlines()[1:])
    assert conf["brokerServicePort"] == "" and conf["webServicePort"] == ""
    assert conf["brokerServicePortTls"] == "6651" and conf["webServicePortTls"] == "8443"
    assert conf["authenticationEnabled"] == "true" and conf["authorizationEnabled"] == "true"
    assert conf["tlsRequireTrustedClientCertOnConnect"] == "true"
    assert conf["superUserRoles"] == "broker,admin"
    assert conf["tlsKeyFilePath"] == str(sec.identity("broker").key)
    assert "PRIVATE KEY" not in (tmp_path / "w" / "conf" / "standalone.conf").read_text()
    assert (b.service_url, b.admin_url) == ("pulsar+ssl://127.0.0.1:6651",
                                            "https://127.0.0.1:8443")

    ins = PulsarStandalone(port=6650, web_port=8080, bookie_port=3181, work_dir=tmp_path / "i",
                           security=Security(insecure=True), progress=None)
    text = ins._write_conf(tmp_path / "i").read_text()
    assert "Tls" not in text and "authenticationEnabled" not in text
    assert "brokerServicePort=6650" in text
    assert (ins.service_url, ins.admin_url) == ("pulsar://127.0.0.1:6650",
                                                "http://127.0.0.1:8080")
    # the warning comes first thing in start(), before Java is even looked for
    def no_java() -> str:
        raise broker_mod.JavaNotFoundError("not looked for in this test")

    monkeypatch.setattr(broker_mod, "find_java", no_java)
    with caplog.at_level(logging.WARNING, logger="smart.security"), \
            pytest.raises(broker_mod.JavaNotFoundError):
        ins.start()
    assert "SECURITY OFF: the Pulsar broker" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="smart.security"), \
            pytest.raises(broker_mod.JavaNotFoundError):
        b.start()
    assert "SECURITY OFF" not in caplog.text
    ins.close()
    b.close()


# --------------------------------------------------------------------------- real broker


@pytest.mark.timeout(300)
def test_without_a_trusted_certificate_nothing_connects(pulsar_broker: PulsarStandalone,
                                                        tmp_path: Path) -> None:
    """No client certificate, one from another CA, or plain text: the handshake is refused
    (the client times out retrying); the admin API refuses them too."""
    b = pulsar_broker
    topic, ca = _topic(), str(b.security.identity("admin").ca)
    foreign = Pki.ensure(tmp_path / "other-ca").identity("controller")
    trust = {"tls_trust_certs_file_path": ca, "tls_validate_hostname": True}
    cases = {
        "no certificate": (trust, "PEER_DID_NOT_RETURN_A_CERTIFICATE"),
        "another CA": (trust | {"authentication": pulsar.AuthenticationTLS(
            str(foreign.cert), str(foreign.key))},
            "Path does not chain with any of the trust anchors"),
    }
    for what, (tls, mark) in cases.items():
        offset = _log_size(b)
        c = _client(b, None, OP_TIMEOUT_S, **tls)
        try:
            with pytest.raises(pulsar.Timeout):
                c.create_producer(topic)
        finally:
            c.close()
        _assert_logged(b, offset, mark)
        log.info("%s: refused", what)
    offset = _log_size(b)
    plain = pulsar.Client(b.service_url.replace("pulsar+ssl://", "pulsar://"),
                          operation_timeout_seconds=OP_TIMEOUT_S, connection_timeout_ms=3000)
    try:
        with pytest.raises(pulsar.Timeout):
            plain.create_producer(topic)
    finally:
        plain.close()
    _assert_logged(b, offset, "NotSslRecordException")

    ctx = ssl.create_default_context(cafile=ca)  # verifies the broker, presents nothing
    with pytest.raises(ssl.SSLError, match="CERTIFICATE"):
        urllib.request.urlopen(f"{b.admin_url}/admin/v2/tenants", context=ctx, timeout=10)
    with pytest.raises((urllib.error.URLError, http.client.HTTPException)):  # no plain HTTP
        urllib.request.urlopen(f"{b.admin_url.replace('https', 'http')}/admin/v2/tenants",
                               timeout=10)
    # nothing was created on the topic by any of them
    assert b.admin("GET", "/admin/v2/persistent/public/default") is not None
    assert topic not in b.admin("GET", "/admin/v2/persistent/public/default")


@pytest.mark.timeout(300)
def test_roles_on_a_configuration_topic(pulsar_broker: PulsarStandalone) -> None:
    """controller produces; agent-3 consumes through its own subscription only; agent-3 and
    policy-server cannot produce; agent-3 cannot use node 4's, node 30's or an invented
    subscription; each refusal is an AuthorizationError and a broker log line naming the
    role and the topic."""
    b = pulsar_broker
    topic = _topic()
    b.grant(nodes=[3, 4, 30])  # what the controller does lazily (NodeSubscriptionGrants)
    controller, agent3, agent30, server = (_client(b, p) for p in
                                           ("controller", "agent-3", "agent-30",
                                            "policy-server"))
    try:
        own = agent3.subscribe(topic, sp.subscription_name(3),
                               consumer_type=pulsar.ConsumerType.Exclusive)
        # the controller creates a node's durable subscription before the node subscribes
        controller.subscribe(topic, sp.subscription_name(30),
                             consumer_type=pulsar.ConsumerType.Exclusive).close()
        producer = controller.create_producer(topic)
        producer.send(b"config-1")
        assert own.receive(timeout_millis=10000).data() == b"config-1"

        refusals = [
            ("agent-3", "PRODUCE", lambda: agent3.create_producer(topic)),
            ("policy-server", "LOOKUP", lambda: server.create_producer(topic)),
            # another node's subscription: its subscription permission (agent-30 is also
            # prefixed by agent-3, so Prefix mode alone would have let this through)
            ("agent-3", "CONSUME", lambda: agent3.subscribe(topic, sp.subscription_name(30))),
            ("agent-3", "CONSUME", lambda: agent3.subscribe(topic, sp.subscription_name(4))),
            # a name of its own invention: the Prefix mode
            ("agent-3", "prefix", lambda: agent3.subscribe(topic, "mine")),
            ("agent-3", "prefix", lambda: agent3.create_reader(topic,
                                                               pulsar.MessageId.earliest)),
        ]
        for role, op, attempt in refusals:
            offset = _log_size(b)
            with pytest.raises(pulsar.AuthorizationError):
                attempt()
            if op == "prefix":
                line = _assert_logged(b, offset, "operation=subscribe", f"principal={role}",
                                      f"topic={topic}")
                _assert_logged(b, offset, "subscription name needs to be prefixed by the "
                               f"authentication role, like {role}-xxxx for topic: {topic}")
            else:
                line = _assert_logged(b, offset, f"Role {role} ", f"operation {op} ",
                                      f"on topic {topic}")
            log.info("refused and logged: %s", line)
        offset = _log_size(b)
        with pytest.raises(pulsar.AuthorizationError):
            agent3.subscribe(topic, sp.subscription_name(30))
        _assert_logged(b, offset, f"[agent-3] is not authorized to subscribe on {topic}-agent-30")

        # node 30's agent still finds everything in its subscription: nothing was taken
        mine30 = agent30.subscribe(topic, sp.subscription_name(30))
        assert mine30.receive(timeout_millis=10000).data() == b"config-1"
        # the controller deletes a node's subscription (recovery, draining)
        mine30.close()
        controller.subscribe(topic, sp.subscription_name(30)).unsubscribe()
        subs = b.admin("GET", f"/admin/v2/persistent/{topic.removeprefix('persistent://')}"
                              "/subscriptions")
        assert sp.subscription_name(30) not in subs and sp.subscription_name(3) in subs
    finally:
        for c in (controller, agent3, agent30, server):
            c.close()
    _assert_no_secrets(b)


@pytest.mark.timeout(300)
def test_announcement_topic_roles(pulsar_broker: PulsarStandalone) -> None:
    """policy-server produces announcements, the controller (adapters) reads them; an agent
    cannot announce."""
    b = pulsar_broker
    server, controller, agent = (_client(b, p) for p in ("policy-server", "controller",
                                                          "agent-5"))
    try:
        reader = controller.create_reader(sp.ANNOUNCE_TOPIC, pulsar.MessageId.latest)
        server.create_producer(sp.ANNOUNCE_TOPIC).send(b"bundle v2")
        assert reader.read_next(timeout_millis=10000).data() == b"bundle v2"
        offset = _log_size(b)
        with pytest.raises(pulsar.AuthorizationError):
            agent.create_producer(sp.ANNOUNCE_TOPIC)
        _assert_logged(b, offset, "Role agent-5 ", "operation PRODUCE ",
                       f"on topic {sp.ANNOUNCE_TOPIC}")
    finally:
        for c in (server, controller, agent):
            c.close()


@pytest.mark.timeout(300)
def test_lazy_node_grants_and_admin_refusals(pulsar_broker: PulsarStandalone) -> None:
    """The controller binds nodes' subscriptions on first need (once: a new instance finds
    them bound); agents and the policy server may not touch the admin API's grants."""
    b = pulsar_broker
    grants = sp.NodeSubscriptionGrants(b.admin_url, b.security, principal="controller")
    assert grants.ensure([41, 42]) == 2
    assert grants.ensure([41, 42]) == 0
    again = sp.NodeSubscriptionGrants(b.admin_url, b.security, principal="controller")
    assert again.ensure([41, 42, 43]) == 1
    bound = sp.node_subscription_grants(b.admin_url, b.security)
    assert bound["agent-41"] == ["agent-41"] and bound["agent-43"] == ["agent-43"]

    topic = _topic()
    agent4 = _client(b, "agent-4")
    try:
        offset = _log_size(b)
        with pytest.raises(pulsar.AuthorizationError):
            agent4.subscribe(topic, sp.subscription_name(41))
        _assert_logged(b, offset, "[agent-4] is not authorized to subscribe on",
                       f"{topic}-agent-41")
    finally:
        agent4.close()
    for principal in ("agent-4", "policy-server"):
        with pytest.raises(sp.PulsarAdminError, match=rf"as '{principal}': HTTP 403"):
            sp.grant_node_subscriptions(b.admin_url, b.security, [4], principal=principal)
    with pytest.raises(sp.PulsarAdminError, match="HTTP 403"):
        b.admin("POST", "/admin/v2/namespaces/public/default/permissions/agent-4",
                ["produce"], principal="agent-4")
    # the grant model is idempotent (an operator may run it again on a live broker, here
    # with its command line)
    assert sp.main(["grant", "--admin-url", b.admin_url, "--nodes", "50-51"]) == 0
    assert sp.node_subscription_grants(b.admin_url, b.security)["agent-51"] == ["agent-51"]
    assert sp.main(["grant", "--admin-url", b.admin_url.replace("https", "http")]) == 2
    assert b.admin("GET", "/admin/v2/namespaces/public/default/permissions") == {
        sp.AGENT_ROLES: ["consume"]}
