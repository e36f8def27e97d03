"""The real Pulsar standalone broker of :mod:`harness.broker`, driven by the official client.

No mocks: one real broker (JVM) is shared by the module and started on first use; the tests
that run a JVM of their own stop it first, so at most one broker runs at a time. The first
run fetches Pulsar's jars with Maven (about a minute and a half, once per machine). The
brokers are secure (the default; clients connect as ``admin``), except the command line's
first start, which checks the ``--insecure`` broker too. Roles and refusals:
``tests/test_security_pulsar.py``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import broker as broker_mod
from harness.broker import (
    BrokerStartError,
    JavaNotFoundError,
    MavenNotFoundError,
    PortInUseError,
    PulsarStandalone,
)
from security.pulsar import client_args
from security.tls import Security
from tests.conftest import no_broker

pulsar = pytest.importorskip("pulsar")

# one Pulsar broker JVM at a time: every broker test runs on the same xdist worker
pytestmark = pytest.mark.xdist_group("pulsar")

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def shared_broker() -> Iterator[PulsarStandalone]:
    """One broker for the module (not started here: see :func:`broker`)."""
    b = PulsarStandalone(progress=log.info)
    try:
        yield b
    finally:
        b.close()


@pytest.fixture
def broker(shared_broker: PulsarStandalone) -> PulsarStandalone:
    """The shared broker, running (started, or started again after a test stopped it)."""
    if not shared_broker.running:
        try:
            shared_broker.start()
        except (JavaNotFoundError, MavenNotFoundError) as exc:
            no_broker(str(exc))
    return shared_broker


@pytest.fixture
def one_broker_at_a_time(shared_broker: PulsarStandalone) -> None:
    """For tests that start a JVM of their own: stop the shared broker first."""
    shared_broker.stop()


def _client(b: PulsarStandalone) -> pulsar.Client:
    return pulsar.Client(b.service_url, operation_timeout_seconds=30,
                         logger=logging.getLogger("pulsar-client"), **b.client_args("admin"))


def _topic() -> str:
    return f"persistent://public/default/test-{uuid.uuid4().hex[:12]}"


def _backlog(b: PulsarStandalone, topic: str, subscription: str) -> int:
    path = topic.removeprefix("persistent://")
    stats = b.admin("GET", f"/admin/v2/persistent/{path}/stats")
    return int(stats["subscriptions"][subscription]["msgBacklog"])


def _receive_all(consumer: pulsar.Consumer, n: int, timeout_ms: int = 20000) -> list[int]:
    """Receive and acknowledge ``n`` messages; then check that nothing more comes."""
    got = []
    for _ in range(n):
        msg = consumer.receive(timeout_millis=timeout_ms)
        got.append(int(msg.data()))
        consumer.acknowledge(msg)
    try:
        extra = consumer.receive(timeout_millis=1500)
    except pulsar.Timeout:
        return got
    raise AssertionError(f"a message beyond the {n} sent: {extra.data()!r} (after {got[-5:]})")


# ------------------------------------------------------------------ bad configurations
# These come first: they start no broker or stop the shared one (one JVM at a time).


def test_port_in_use_is_reported_before_java_starts() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        b = PulsarStandalone(port=port, progress=None)
        t0 = time.monotonic()
        try:
            with pytest.raises(PortInUseError, match=rf"port={port}\b"):
                b.start()
        except (JavaNotFoundError, MavenNotFoundError) as exc:
            no_broker(str(exc))
        finally:
            b.close()
        assert time.monotonic() - t0 < 10
        assert b.pid is None


def start_failure(b: PulsarStandalone, expected: type[Exception]) -> Exception:
    """The ``expected`` error ``b.start()`` raises (the broker closed either way)."""
    try:
        with pytest.raises(expected) as err:
            b.start()
    except (JavaNotFoundError, MavenNotFoundError) as exc:
        no_broker(str(exc))
    finally:
        b.close()
    return err.value


@pytest.mark.slow  # starts a JVM of its own
@pytest.mark.timeout(240)
def test_port_taken_during_start_is_reported_from_the_log(one_broker_at_a_time, monkeypatch
                                                          ) -> None:
    """The JVM itself fails to bind (the pre-check is bypassed, as in a race)."""
    monkeypatch.setattr(broker_mod, "port_is_free", lambda *a, **k: True)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        b = PulsarStandalone(port=holder.getsockname()[1], progress=None)
        text = str(start_failure(b, PortInUseError))
    assert "exited with code" in text
    assert "Address already in use" in text
    assert "log tail" in text
    assert not b.running


@pytest.mark.timeout(240)
def test_invalid_setting_reports_exit_code_and_log(one_broker_at_a_time) -> None:
    b = PulsarStandalone(extra_conf={"managedLedgerDefaultEnsembleSize": "two"}, progress=None)
    error = start_failure(b, BrokerStartError)
    text = str(error)
    assert not isinstance(error, PortInUseError)
    assert "exited with code 1" in text
    assert "managedLedgerDefaultEnsembleSize" in text


# ------------------------------------------------------------------ messaging


@pytest.mark.timeout(300)
def test_500_messages_exactly_once_in_order(broker: PulsarStandalone) -> None:
    topic, sub = _topic(), "durable-order"
    client = _client(broker)
    try:
        consumer = client.subscribe(topic, sub, consumer_type=pulsar.ConsumerType.Exclusive,
                                    initial_position=pulsar.InitialPosition.Earliest)
        # send_async drops what does not fit in the pending queue unless it blocks
        # (the Pulsar client's documented behaviour); check every callback's result as well.
        producer = client.create_producer(topic, block_if_queue_full=True,
                                          max_pending_messages=100, batching_enabled=False)
        results: list[pulsar.Result] = []
        for i in range(500):
            producer.send_async(str(i).encode(), lambda res, _mid: results.append(res))
        producer.flush()
        deadline = time.monotonic() + 30
        while len(results) < 500 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert results == [pulsar.Result.Ok] * 500

        assert _receive_all(consumer, 500) == list(range(500))
        assert not broker_mod.port_is_free(broker.bookie_port)  # the bookie took its port
        producer.close()
        consumer.close()
    finally:
        client.close()


@pytest.mark.slow  # restarts the broker JVM
@pytest.mark.timeout(300)
def test_restart_keeps_unacknowledged_messages(broker: PulsarStandalone) -> None:
    """Broker stop/restart fault: same ports, same data; the durable subscription's cursor
    and the messages it has not acknowledged survive."""
    topic, sub = _topic(), "durable-restart"
    port, web_port, data, pid = broker.port, broker.web_port, broker.data_dir, broker.pid
    client = _client(broker)
    try:
        consumer = client.subscribe(topic, sub, initial_position=pulsar.InitialPosition.Earliest)
        producer = client.create_producer(topic, batching_enabled=False)
        for i in range(200):
            producer.send(str(i).encode())  # returns once the bookie has persisted it
        for i in range(50):
            msg = consumer.receive(timeout_millis=20000)
            assert int(msg.data()) == i
            consumer.acknowledge(msg)
        deadline = time.monotonic() + 15  # acknowledgements are grouped and sent async
        while _backlog(broker, topic, sub) != 150 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _backlog(broker, topic, sub) == 150
        producer.close()
        consumer.close()
    finally:
        client.close()

    broker.restart()

    assert (broker.port, broker.web_port, broker.data_dir) == (port, web_port, data)
    assert broker.pid != pid
    assert _backlog(broker, topic, sub) == 150
    client = _client(broker)
    try:
        consumer = client.subscribe(topic, sub)
        assert _receive_all(consumer, 150) == list(range(50, 200))
        consumer.close()
    finally:
        client.close()


# ------------------------------------------------------------------ command line


def _cli_start(pid_file: Path, data: Path, *flags: str
               ) -> tuple[subprocess.Popen[str], str, int]:
    cmd = [sys.executable, "-m", "harness.broker", "start", "--pid-file", str(pid_file),
           "--data", str(data), *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("service_url"):
            return proc, line.split()[1], int(pid_file.read_text())
    proc.wait(timeout=60)
    raise AssertionError("broker CLI did not start:\n" + "".join(lines))


def _cli_stop(proc: subprocess.Popen[str], pid_file: Path, pid: int) -> None:
    stop = subprocess.run([sys.executable, "-m", "harness.broker", "stop", "--pid-file",
                           str(pid_file)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert proc.wait(timeout=60) == 0
    assert not Path(f"/proc/{pid}").exists()
    assert not pid_file.exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_start_stop_and_data_kept(one_broker_at_a_time, tmp_path: Path) -> None:
    """``start --data DIR`` twice: what the first run stored, the second run delivers. The
    first run is ``--insecure`` (plain text, open); the second, on the same data, secure
    with ``--pki-dir``."""
    pid_file, data, topic = tmp_path / "broker.pid", tmp_path / "data", _topic()
    sec = Security(pki_dir=os.environ.get("SMART_PKI_DIR") or str(tmp_path / "pki"))
    procs = []
    try:
        proc, url, pid = _cli_start(pid_file, data, "--insecure")
        procs.append(proc)
        assert url.startswith("pulsar://")
        client = pulsar.Client(url, logger=logging.getLogger("pulsar-client"))
        try:
            client.subscribe(topic, "cli").close()  # a durable subscription, nothing consumed
            client.create_producer(topic).send(b"7")
        finally:
            client.close()
        _cli_stop(proc, pid_file, pid)
        assert (data / "bk").is_dir()

        proc, url, pid = _cli_start(pid_file, data, "--pki-dir", str(sec.pki_dir))
        procs.append(proc)
        assert url.startswith("pulsar+ssl://")
        client = pulsar.Client(url, logger=logging.getLogger("pulsar-client"),
                               **client_args(sec, "admin"))
        try:
            consumer = client.subscribe(topic, "cli")
            assert int(consumer.receive(timeout_millis=20000).data()) == 7
        finally:
            client.close()
        _cli_stop(proc, pid_file, pid)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                p.wait(timeout=60)
