"""The controller as a process (``python -m delivery.controller_host``) on a real Pulsar broker
(``pulsar_broker``), reached through its real gRPC ingress, with real agents in this process
reporting to its fixed reply port. No mocks.

Delivery is judged as in ``tests/test_delivery.py``, from the agents' programming records,
against a ledger of what the ingress acknowledged (``Accepted``: durable in the controller's
outbox): nothing applied twice or out of order per resource, and every acknowledged message
applied or superseded by a newer applied one. A request whose call a crash interrupted is
"maybe": it may have been stored (then it is delivered, at most once) or not.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from delivery.agent import AgentConfig
from delivery.agent_host import AgentHost
from delivery.checker import read_rows
from delivery.controller import RPC
from delivery.controller_host import controller_spec, load_spec
from delivery.ledger import IngressLedger
from delivery.processes import ControllerProcess
from delivery.rpc import pb
from delivery.store import MetadataStore
from envs.netutil import free_ports
from harness.broker import PulsarStandalone
from security.tls import Security

from .delivery_rig import ROOT, assert_delivered, wait_until

# one Pulsar broker JVM at a time: every broker test runs on the same xdist worker
pytestmark = pytest.mark.xdist_group("pulsar")


class CrashRig:
    """A controller process and in-process agents on a broker, with a fresh store, record
    directory and topic prefix."""

    def __init__(self, broker: PulsarStandalone, tmp: Path, nodes: Iterable[int],
                 **ctl_kw: Any) -> None:
        self.nodes = list(nodes)
        self.store_url = f"sqlite:///{tmp / 'meta.db'}"
        self.record_dir = tmp / "records"
        self.prefix = f"persistent://public/default/tc-{uuid.uuid4().hex[:10]}"
        ports = dict(zip(self.nodes, free_ports(len(self.nodes))))
        reply_port, ingress_port = free_ports(2)
        self.ctl = ControllerProcess(
            tmp, {n: f"127.0.0.1:{p}" for n, p in ports.items()},
            reply_port=reply_port, ingress_port=ingress_port,
            pulsar_url=broker.service_url, pulsar_admin_url=broker.admin_url,
            store_url=self.store_url, topic_prefix=self.prefix,
            **{"collect_period_s": 0.3, "reprogram_period_s": 0.2, "push_timeout_s": 2.0,
               **ctl_kw})
        self.restart_s = [self.ctl.start()]
        self.host = AgentHost([AgentConfig(n, self.store_url, self.record_dir,
                                           pulsar_url=broker.service_url,
                                           controller=self.ctl.reply_address, port=p,
                                           pack_period_s=0.1)
                               for n, p in ports.items()], broker.service_url).start()
        self.ledger = IngressLedger(self.ctl.stub)

    def outbox_size(self) -> tuple[int, int]:
        store = MetadataStore(self.store_url)
        try:
            return store.outbox_size()
        finally:
            store.close()

    def settled(self, timeout: float = 60.0) -> dict[int, list]:
        """Wait until the outbox is empty (every destination confirmed every stored message,
        so every message that will ever be applied is in the records), take the stored
        "maybe" messages into the ledger, then check: nothing applied twice or out of order,
        the newest of every resource applied, every acknowledged message applied or
        superseded. Returns the rows per node."""
        wait_until(lambda: self.outbox_size() == (0, 0), timeout,
                   lambda: f"an empty outbox (every destination confirmed), have "
                   f"{self.outbox_size()} (messages, destinations)")
        self.ledger.adopt(read_rows(self.record_dir, self.nodes))
        return assert_delivered(self.record_dir, self.ledger, self.nodes, timeout=timeout)

    def close(self) -> None:
        try:
            self.host.close()
        finally:
            self.ctl.stop()
            self.ctl.channel.close()


@contextmanager
def crash_rig(broker: PulsarStandalone, tmp: Path, nodes: Iterable[int],
              **ctl_kw: Any) -> Iterator[CrashRig]:
    r = CrashRig(broker, tmp, nodes, **ctl_kw)
    try:
        yield r
    finally:
        r.close()


NODES = (0, 1, 2, 3)
HOSTS = {0: NODES, 1: (0, 1, 2), 2: (3,), 3: (2,)}
CHANNELS = {0: RPC, 1: 1, 2: 2, 3: RPC}  # RPC multicast, topic 1, topic 2 unicast, RPC unicast


def _set_channels(r: CrashRig) -> None:
    """CHANNELS over the ingress, and wait until they are current (a switch asked for while
    the MQ channel is down is deferred until it is back) and the agents subscribed."""
    changed = r.ctl.set_channels(CHANNELS, HOSTS)
    assert changed.types + changed.deferred == len(CHANNELS), changed
    wait_until(lambda: r.ctl.status()[1] == CHANNELS, 30,
               lambda: f"channels {r.ctl.status()[1]} == {CHANNELS}")
    want = {n: {f"{r.prefix}-t{c}" for t, c in CHANNELS.items() if c != RPC and n in HOSTS[t]}
            for n in NODES}
    wait_until(lambda: all(r.host.agents[n].topics() == dict.fromkeys(want[n], "subscribed")
                           for n in NODES), 20, f"agents subscribed to {want}")


def test_controller_sigkill_mid_stream_loses_nothing(pulsar_broker, tmp_path):
    """Configure batches of 10 stream in from a client thread over four types (RPC multicast,
    topic 1 multicast, topic 2 unicast, RPC unicast); the controller process is SIGKILLed at
    about 150 acknowledged messages and restarted with the same spec while the client goes
    on; 100 more are acknowledged after the restart. Every acknowledged message is applied or
    superseded, nothing is applied twice or out of order, a request whose call the kill
    interrupted is applied at most once; the restarted controller re-delivered its
    unconfirmed outbox, agents reported duplicates of what they already had, and the
    channels it recovered are the ones set before the crash."""
    with crash_rig(pulsar_broker, tmp_path, NODES) as r:
        led = r.ledger
        _set_channels(r)
        _, before = r.ctl.status()
        assert before == CHANNELS

        stop = threading.Event()
        errors: list[BaseException] = []

        def stream() -> None:
            try:
                for k0 in itertools.count(0, 10):
                    if stop.is_set():
                        return
                    led.configure([led.request(t, 10 * t + (k // 4) % 3, HOSTS[t])
                                   for k in range(k0, k0 + 10) for t in [k % 4]])
            except BaseException as e:
                errors.append(e)

        client = threading.Thread(target=stream, name="ingress-client", daemon=True)
        client.start()
        try:
            wait_until(lambda: led.acked >= 150 or errors, 60, "150 acknowledged messages")
            r.ctl.kill()
            killed_at = led.acked
            r.restart_s.append(r.ctl.start())
            recovered = r.ctl.recovered()
            wait_until(lambda: led.acked >= killed_at + 100 or errors, 60,
                       "100 more acknowledged messages after the restart")
        finally:
            stop.set()
            client.join(90)
        assert not errors, errors
        assert not client.is_alive()
        # the call in flight at the kill fails; one made as the old connection breaks may
        # fail too (gRPC reports the reset before it waits for the restarted ingress)
        assert len(led.failures) <= 3, led.failures

        rows = r.settled()
        maybe_rows = led.adopt(read_rows(r.record_dir, NODES))
        for n in NODES:  # applied at most once (audit also holds timestamps increasing)
            mids = [x.message_id for x in rows[n] if x.message_id in led.maybe]
            assert len(mids) == len(set(mids)), f"node {n}: maybe messages {mids}"
        stats, after = r.ctl.status()
        assert after == before
        assert recovered["types"] == len(CHANNELS)
        assert recovered["outbox_redelivered"] > 0 and stats["outbox_redelivered"] > 0
        assert stats["outbox_corrupt"] == 0

        def duplicates() -> int:
            return r.ctl.status()[0]["outcomes"].get("DUPLICATE", 0)

        wait_until(lambda: duplicates() > 0, 20, "DUPLICATE results of the re-delivery")
        agents_dup = sum(c["outcomes"]["duplicate"] for c in r.host.counters().values())
        assert agents_dup > 0
        print(f"\nacknowledged {led.acked}, maybe {len(led.maybe)} (rows {dict(maybe_rows)}), "
              f"controller start {r.restart_s[0]:.2f} s, restart to serving "
              f"{r.restart_s[1]:.2f} s, re-delivered {stats['outbox_redelivered']}, "
              f"duplicates at agents {agents_dup}")


def test_ingress_refuses_bad_requests(pulsar_broker, tmp_path):
    """Every bad field of a Configure call (Table I types, hosts empty, unknown or repeated,
    size 0) and of a SetChannels call is refused with INVALID_ARGUMENT naming the request
    index and the field; nothing of a refused call is stored (outbox, counters, records)
    although its other requests were good; the channels stay as they were."""
    with crash_rig(pulsar_broker, tmp_path, NODES) as r:
        led = r.ledger
        _set_channels(r)
        assert led.configure([led.request(t, 10 * t, HOSTS[t]) for t in CHANNELS])
        r.settled()
        stats0, channels0 = r.ctl.status()

        good = led.request(0, 1, HOSTS[0])
        refused = {good.message_id}
        cases = [({"configuration_type": "NOPE"}, "configuration_type"),
                 ({"operation_type": "FROB"}, "operation_type"),
                 ({"hosts": ()}, "hosts"),
                 ({"hosts": (0, 99)}, "hosts"),
                 ({"hosts": (1, 1)}, "hosts"),
                 ({"size_bytes": 0}, "size_bytes")]
        for change, field in cases:
            bad = led.request(1, 11, HOSTS[1])
            refused.add(bad.message_id)
            for k, v in change.items():
                if k == "hosts":
                    del bad.hosts[:]
                    bad.hosts.extend(v)
                else:
                    setattr(bad, k, v)
            with pytest.raises(grpc.RpcError) as e:
                led.configure([good, bad])
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, change
            assert e.value.details().startswith(f"requests[1].{field}: "), e.value.details()

        bad_channels = [([pb.TypeChannel(type_id=9, channel=1)], "types[0].hosts"),
                        ([pb.TypeChannel(type_id=1, channel=2, hosts=(0, 42))],
                         "types[0].hosts"),
                        ([pb.TypeChannel(type_id=0, channel=2),
                          pb.TypeChannel(type_id=0, channel=1)], "types[1].type_id")]
        for types, where in bad_channels:
            with pytest.raises(grpc.RpcError) as e:
                r.ctl.stub.SetChannels(pb.ChannelsRequest(types=types), timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith(f"{where}: "), e.value.details()

        stats1, channels1 = r.ctl.status()
        assert channels1 == channels0 == CHANNELS
        keys = ("rpc_messages", "mq_messages", "outbox_redelivered", "outcomes")
        assert {k: stats1[k] for k in keys} == {k: stats0[k] for k in keys}
        assert r.outbox_size() == (0, 0)

        # the ingress still works, and the refused requests never reach a node
        assert led.configure([led.request(t, 10 * t + 1, HOSTS[t]) for t in CHANNELS])
        rows = r.settled()
        assert not [x.message_id for n in NODES for x in rows[n] if x.message_id in refused]
        assert r.ctl.stop() == 0, "SIGTERM closes it cleanly:\n" + r.ctl.log.read_text()[-3000:]


def test_controller_spec_refused_naming_the_key(tmp_path):
    """A bad controller-host spec fails where it is written (``controller_spec``) and where
    it is read (the process exits 2 naming the key), before anything is stored."""
    base = {"pulsar_url": "pulsar://127.0.0.1:1", "store_url": f"sqlite:///{tmp_path / 'm.db'}",
            "reply_port": 6650}
    agents = {0: "127.0.0.1:7000"}
    cases = [({"bogus": 1}, "bogus"), ({"reply_port": 0}, "reply_port"),
             ({"push_timeout_s": "fast"}, "push_timeout_s"),
             ({"security": {"insecure": "yes"}}, r"delivery config: security\.insecure"),
             ({"security": {"pki": "/x"}}, r"delivery config: security: unknown key")]
    for change, key in cases:
        with pytest.raises(ValueError, match=key):
            controller_spec(agents, ingress_port=7001, **{**base, **change})
    with pytest.raises(ValueError, match=r"agents\.0"):
        controller_spec({0: "no-port"}, ingress_port=7001, **base)
    with pytest.raises(ValueError, match="ingress_port"):
        controller_spec(agents, ingress_port=70000, **base)
    spec = controller_spec(agents, ingress_port=7001, **base)
    assert load_spec(spec)[0].security == Security()          # secure by default
    debug = controller_spec(agents, ingress_port=7001, security=Security(insecure=True),
                            **base)
    assert json.loads(json.dumps(debug))["controller"]["security"] == {"insecure": True,
                                                                        "pki_dir": None}
    assert load_spec(debug)[0].security.insecure
    with pytest.raises(ValueError, match="extra"):
        load_spec({**spec, "extra": 1})

    path = tmp_path / "spec.json"
    path.write_text(json.dumps({**spec, "controller": {**base, "colect_period_s": 1}}))
    done = subprocess.run([sys.executable, "-m", "delivery.controller_host", "--spec",
                           str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 2 and "colect_period_s" in done.stderr, done.stderr
    assert not (tmp_path / "m.db").exists()
