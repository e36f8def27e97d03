"""A small real Apache Pulsar cluster on one machine: one ZooKeeper server (the metadata and
configuration store), ``bookies`` BookKeeper bookies and ``brokers`` brokers, each its own
JVM from the same jars as the standalone broker (:func:`harness.broker.fetch_pulsar`), on
free loopback ports, with the standalone's security: TLS-only ports, mutual-TLS
authentication, authorisation and the project's grant model
(:func:`harness.broker.broker_security_conf`, :func:`security.pulsar.grant_default_roles`).

What it is for: the delivery path against a cluster rather than one standalone broker, and
a broker's failure under load. Each topic belongs to one broker at a time (its namespace
bundle's owner, recorded in the metadata store under the broker's session); when that
broker dies its session expires after ``session_timeout_ms``, the other brokers take its
bundles on the next lookup, and the clients, which know every broker from the multi-host
service URL (``pulsar+ssl://127.0.0.1:p1,127.0.0.1:p2``), reconnect their producers and
consumers there. Messages are in the bookies (``replicas`` copies each), so nothing
acknowledged is lost; a producer re-sends what was not acknowledged, and the agents drop
what they already applied. ``tests/test_pulsar_cluster.py`` and
``bench/bench_pulsar_failover.py`` kill a broker under load and measure the time without
delivery.

Start order (:meth:`PulsarCluster.start`): ZooKeeper
(``org.apache.zookeeper.server.ZooKeeperServerMain``), the cluster's metadata
(``org.apache.pulsar.PulsarClusterMetadataSetup``: the cluster, the ``public/default``
namespace, BookKeeper's ledger root), the bookies (``org.apache.bookkeeper.server.Main``),
then the brokers (``org.apache.pulsar.PulsarBrokerStarter``); each waits for the one before
to serve. Every process logs to ``<work_dir>/<name>.log``.

Use::

    with PulsarCluster(brokers=2, bookies=2) as cluster:
        client = pulsar.Client(cluster.service_url, **cluster.client_args("controller"))
        cluster.kill_broker(cluster.owner(topic))
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from envs.netutil import free_ports
from security import pulsar as pulsar_security
from security.tls import Security

from .broker import (
    _LOG4J2,
    DEFAULT_VERSION,
    JVM_OPENS,
    READY_LINE,
    BrokerError,
    BrokerStartError,
    Progress,
    _can_connect,
    _first_error,
    _pdeathsig_prefix,
    _stderr_progress,
    _tail,
    _terminate,
    broker_security_conf,
    default_cache_dir,
    fetch_pulsar,
    find_java,
    namespace_ready,
)

ZOOKEEPER_MAIN = "org.apache.zookeeper.server.ZooKeeperServerMain"
SETUP_MAIN = "org.apache.pulsar.PulsarClusterMetadataSetup"
BOOKIE_MAIN = "org.apache.bookkeeper.server.Main"
BROKER_MAIN = "org.apache.pulsar.PulsarBrokerStarter"
BOOKIE_READY_LINE = "Started component bookie-server"
"""A bookie's log line once it serves and is registered in the metadata store."""


def _conf_text(settings: dict[str, Any]) -> str:
    return "# written by harness.pulsar_cluster\n" + "".join(
        f"{k}={str(v).lower() if isinstance(v, bool) else v}\n" for k, v in settings.items())


class ClusterProcess:
    """One JVM of the cluster (ZooKeeper, a bookie or a broker): its command, its log file
    (every start appended) and its process, stopped by its own PID."""

    def __init__(self, name: str, cmd: list[str], work: Path, ready_line: str | None,
                 port: int) -> None:
        self.name = name
        self.cmd = cmd
        self.work = work
        self.ready_line = ready_line
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None
        self._offset = 0
        self._finalizer: weakref.finalize | None = None

    @property
    def log_path(self) -> Path:
        return self.work / f"{self.name}.log"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None

    def log_since_start(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._offset)
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def launch(self, die_with_parent: bool) -> None:
        cmd = self.cmd
        if die_with_parent and threading.current_thread() is threading.main_thread():
            cmd = _pdeathsig_prefix() + cmd
        with open(self.log_path, "ab") as out:
            self._offset = out.tell()
            out.write(f"\n===== start: {' '.join(cmd)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(cmd, cwd=self.work, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self._finalizer = weakref.finalize(self, _terminate, self.proc, 10.0)

    def ready(self) -> bool:
        """Its ready line is in its log since this start (if it has one) and its port
        accepts a TCP connection."""
        if self.ready_line is not None and self.ready_line not in self.log_since_start():
            return False
        return _can_connect(self.port)

    def failure(self, why: str) -> BrokerStartError:
        first = _first_error(self.log_since_start())
        cause = f"\nfirst error: {first}" if first else ""
        return BrokerStartError(f"{self.name}: {why}{cause}\nlog tail ({self.log_path}):\n"
                                f"{_tail(self.log_path, 30)}")

    def stop(self, grace_s: float) -> None:
        proc, self.proc = self.proc, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if proc is not None:
            _terminate(proc, grace_s)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the JVM (SIGKILL: a crash, nothing flushed or handed over) and reap it."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        proc.wait(timeout=60)
        self.stop(0.0)


class PulsarCluster:
    """A real Pulsar cluster on loopback (see the module docstring).

    :param brokers: how many brokers (at least 1; 2 to survive one's failure).
    :param bookies: how many bookies; each message is stored on ``replicas`` of them.
    :param replicas: BookKeeper's ensemble, write and acknowledgement quorum (at most
        ``bookies``).
    :param session_timeout_ms: the brokers' metadata-store (ZooKeeper) session timeout: how
        long a dead broker keeps its topics before another broker may take them. ZooKeeper
        accepts 4,000 to 40,000 ms here (2 and 20 ticks of 2 s); Pulsar's default is 30,000.
    :param heap: each broker's and bookie's JVM ``-Xmx`` (ZooKeeper gets 128m).
    :param security: as :class:`harness.broker.PulsarStandalone` (TLS and authorisation by
        default; ``Security(insecure=True)`` for a plain-text, open cluster).
    :param nodes: nodes whose subscriptions are bound to their agent's role at start.
    :param cluster_name: the Pulsar cluster's name.
    :param work_dir: config, logs and data (default a new temporary directory, removed by
        :meth:`close` unless ``keep``).
    :param extra_broker_conf: more ``broker.conf`` settings for every broker.
    """

    def __init__(
        self,
        *,
        brokers: int = 2,
        bookies: int = 2,
        replicas: int = 2,
        session_timeout_ms: int = 6000,
        version: str = DEFAULT_VERSION,
        cache_dir: str | os.PathLike[str] | None = None,
        work_dir: str | os.PathLike[str] | None = None,
        keep: bool = False,
        heap: str = "384m",
        start_timeout_s: float = 240.0,
        stop_grace_s: float = 15.0,
        security: Security = Security(),  # noqa: B008 (immutable)
        nodes: Iterable[int] = (),
        announce_topics: Iterable[str] = (pulsar_security.ANNOUNCE_TOPIC,),
        cluster_name: str = "smart",
        extra_broker_conf: dict[str, str | int | bool] | None = None,
        die_with_parent: bool = True,
        progress: Progress | None = _stderr_progress,
    ) -> None:
        for name, value, low in (("brokers", brokers, 1), ("bookies", bookies, 1),
                                 ("replicas", replicas, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise BrokerError(f"PulsarCluster: {name} must be an integer >= {low}, "
                                  f"got {value!r}")
        if replicas > bookies:
            raise BrokerError(f"PulsarCluster: replicas ({replicas}) must not exceed bookies "
                              f"({bookies}): each message is stored on that many bookies")
        if not 4000 <= session_timeout_ms <= 40000:
            raise BrokerError(f"PulsarCluster: session_timeout_ms must be within 4000..40000 "
                              f"(ZooKeeper's 2 to 20 ticks of 2 s), got {session_timeout_ms}")
        self.n_brokers, self.n_bookies, self.replicas = brokers, bookies, replicas
        self.session_timeout_ms = session_timeout_ms
        self.version = version
        self.cache_dir = (Path(cache_dir).expanduser() if cache_dir is not None
                          else default_cache_dir(version))
        self._own_work_dir = work_dir is None
        self.work_dir = Path(work_dir).expanduser().resolve() if work_dir is not None else None
        self.keep = keep
        self.heap = heap
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        self.security = Security.from_mapping(security)
        self.nodes = tuple(int(n) for n in nodes)
        self.announce_topics = tuple(announce_topics)
        self.cluster_name = cluster_name
        self.extra_broker_conf = dict(extra_broker_conf or {})
        self.die_with_parent = die_with_parent
        self._say: Callable[[str], None] = progress or (lambda _line: None)
        self.zookeeper: ClusterProcess | None = None
        self.bookies: list[ClusterProcess] = []
        self.brokers: list[ClusterProcess] = []
        self.broker_ports: list[tuple[int, int]] = []  # (binary, web) per broker
        self.last_start_s: float | None = None

    # ------------------------------------------------------------------ addresses

    @property
    def secure(self) -> bool:
        return not self.security.insecure

    def _need_started(self) -> None:
        if not self.broker_ports:
            raise BrokerError("the cluster's ports are chosen at start(); start it first")

    @property
    def service_url(self) -> str:
        """Every broker in one multi-host URL (``pulsar+ssl://127.0.0.1:p1,127.0.0.1:p2``):
        a client looks topics up on any broker that answers."""
        self._need_started()
        scheme = "pulsar+ssl" if self.secure else "pulsar"
        return f"{scheme}://" + ",".join(f"127.0.0.1:{p}" for p, _ in self.broker_ports)

    def broker_url(self, i: int) -> str:
        """Broker ``i``'s own service URL."""
        self._need_started()
        return f"{'pulsar+ssl' if self.secure else 'pulsar'}://127.0.0.1:{self.broker_ports[i][0]}"

    def admin_url_of(self, i: int) -> str:
        """Broker ``i``'s admin REST API."""
        self._need_started()
        return f"{'https' if self.secure else 'http'}://127.0.0.1:{self.broker_ports[i][1]}"

    @property
    def admin_url(self) -> str:
        """The admin REST API of the first broker that runs (any broker answers for the
        whole cluster; a topic's calls are redirected to its owner)."""
        self._need_started()
        alive = [i for i, b in enumerate(self.brokers) if b.running] or [0]
        return self.admin_url_of(alive[0])

    def client_args(self, principal: str) -> dict[str, Any]:
        """``pulsar.Client(self.service_url, **self.client_args(p))`` connects as ``p``."""
        return pulsar_security.client_args(self.security, principal)

    def admin(self, method: str, path: str, body: Any = None, *, principal: str = "admin",
              timeout: float = 10.0) -> Any:
        """One admin REST call on :attr:`admin_url` (see
        :meth:`harness.broker.PulsarStandalone.admin`)."""
        return pulsar_security.admin_call(self.admin_url, method, path, body,
                                          security=self.security, principal=principal,
                                          timeout=timeout)

    def owner(self, topic: str) -> int:
        """The index of the broker that owns ``topic`` now (a lookup; it assigns an owner to a
        topic that has none yet)."""
        path = "/lookup/v2/topic/" + topic.replace("://", "/", 1)
        got = self.admin("GET", path)
        url = got.get("brokerUrlTls") or got.get("brokerUrl") or ""
        port = int(url.rsplit(":", 1)[-1]) if url else -1
        for i, (p, _) in enumerate(self.broker_ports):
            if p == port:
                return i
        raise BrokerError(f"lookup of {topic} answered {got!r}, which is none of the brokers "
                          f"{self.broker_ports}")

    def __repr__(self) -> str:
        up = sum(b.running for b in self.brokers)
        return (f"PulsarCluster({self.version}, {up}/{self.n_brokers} brokers up, "
                f"{self.n_bookies} bookies)")

    # ------------------------------------------------------------------ lifecycle

    def _work(self) -> Path:
        if self.work_dir is None:
            self.work_dir = Path(tempfile.mkdtemp(prefix="smart-pulsar-cluster-"))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        return self.work_dir

    def start(self) -> Self:
        """Start ZooKeeper, write the cluster's metadata, start the bookies, then the brokers;
        return when every broker serves and the grants are installed.

        :raises BrokerStartError: a process exited during start, or did not serve within
            ``start_timeout_s`` (which process, its first error and its log tail).
        """
        if self.brokers and all(b.running for b in self.brokers):
            return self
        if self.brokers:
            raise BrokerError("the cluster was started and is partly down: start_broker(i) "
                              "starts a broker again, close() stops everything")
        self.security.warn_if_insecure("the Pulsar cluster")
        java = find_java()
        lib = fetch_pulsar(self.version, self.cache_dir, progress=self._say)
        work = self._work()
        (work / "log4j2.xml").write_text(_LOG4J2)
        t0 = time.monotonic()
        deadline = t0 + self.start_timeout_s
        ports = iter(free_ports(1 + self.n_bookies + 2 * self.n_brokers))
        zk_port = next(ports)
        bookie_ports = [next(ports) for _ in range(self.n_bookies)]
        self.broker_ports = [(next(ports), next(ports)) for _ in range(self.n_brokers)]
        try:
            self.zookeeper = self._zookeeper(java, lib, work, zk_port)
            self._wait([self.zookeeper], deadline)
            self._setup_metadata(java, lib, work, zk_port, deadline)
            self.bookies = [self._bookie(java, lib, work, i, zk_port, port)
                            for i, port in enumerate(bookie_ports)]
            self._wait(self.bookies, deadline)
            self.brokers = [self._broker(java, lib, work, i, zk_port)
                            for i in range(self.n_brokers)]
            self._wait(self.brokers, deadline)
            self._wait_namespace(deadline)
            if self.secure:
                self.grant()
        except BaseException:
            self.stop()
            raise
        self.last_start_s = time.monotonic() - t0
        self._say(f"Pulsar cluster ready after {self.last_start_s:.1f} s: {self.service_url}")
        return self

    def _jvm(self, java: str, lib: Path, work: Path, heap: str, main: str,
             *args: str) -> list[str]:
        return [java, f"-Xmx{heap}", f"-XX:MaxDirectMemorySize={heap}", *JVM_OPENS,
                f"-Dlog4j2.configurationFile={work / 'log4j2.xml'}",
                "-Dzookeeper.admin.enableServer=false",
                "-cp", f"{lib}/*", main, *args]

    def _zookeeper(self, java: str, lib: Path, work: Path, port: int) -> ClusterProcess:
        cfg = work / "zookeeper.cfg"
        cfg.write_text(_conf_text({
            "tickTime": 2000, "dataDir": work / "data" / "zookeeper", "clientPort": port,
            "clientPortAddress": "127.0.0.1", "admin.enableServer": False,
            "maxClientCnxns": 0, "maxSessionTimeout": 40000,
        }))
        p = ClusterProcess("zookeeper", self._jvm(java, lib, work, "128m", ZOOKEEPER_MAIN,
                                                  str(cfg)), work, None, port)
        p.launch(self.die_with_parent)
        self._say(f"started ZooKeeper (pid {p.pid}) on 127.0.0.1:{port}")
        return p

    def _metadata_url(self, zk_port: int) -> str:
        return f"zk:127.0.0.1:{zk_port}"

    def _setup_metadata(self, java: str, lib: Path, work: Path, zk_port: int,
                        deadline: float) -> None:
        p0, w0 = self.broker_ports[0]
        # the cluster's URLs in the metadata (the setup requires the web one; a client of
        # this cluster finds brokers from its own service URL instead)
        web = f"{'https' if self.secure else 'http'}://127.0.0.1:{w0}"
        urls = ["--web-service-url", web]
        urls += (["--web-service-url-tls", web,
                  "--broker-service-url-tls", f"pulsar+ssl://127.0.0.1:{p0}"] if self.secure
                 else ["--broker-service-url", f"pulsar://127.0.0.1:{p0}"])
        cmd = self._jvm(java, lib, work, "256m", SETUP_MAIN, "--cluster", self.cluster_name,
                        "--metadata-store", self._metadata_url(zk_port),
                        "--configuration-metadata-store", self._metadata_url(zk_port), *urls)
        log = work / "metadata-setup.log"
        with open(log, "ab") as out:
            try:
                rc = subprocess.run(cmd, check=False, cwd=work, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    timeout=max(10.0, deadline - time.monotonic())).returncode
            except subprocess.TimeoutExpired:
                rc = None
        if rc != 0:
            why = "timed out" if rc is None else f"exited with code {rc}"
            raise BrokerStartError(f"the cluster metadata setup ({SETUP_MAIN}) {why}\n"
                                   f"log tail ({log}):\n{_tail(log, 30)}")

    def _bookie(self, java: str, lib: Path, work: Path, i: int, zk_port: int,
                port: int) -> ClusterProcess:
        data = work / "data" / f"bookie-{i}"
        conf = work / f"bookie-{i}.conf"
        conf.write_text(_conf_text({
            "bookiePort": port, "advertisedAddress": "127.0.0.1", "allowLoopback": True,
            "useHostNameAsBookieID": False, "allowEphemeralPorts": True,
            "journalDirectories": data / "journal", "ledgerDirectories": data / "ledgers",
            "metadataServiceUri": f"zk+hierarchical://127.0.0.1:{zk_port}/ledgers",
            "zkTimeout": self.session_timeout_ms,
            "enableStatistics": False, "httpServerEnabled": False,
            # one index file per ledger stays open up to this many (see PulsarStandalone)
            "openFileLimit": 2000,
        }))
        p = ClusterProcess(f"bookie-{i}", self._jvm(java, lib, work, self.heap, BOOKIE_MAIN,
                                                    "--conf", str(conf)),
                           work, BOOKIE_READY_LINE, port)
        p.launch(self.die_with_parent)
        self._say(f"started bookie {i} (pid {p.pid}) on 127.0.0.1:{port}")
        return p

    def _broker_conf(self, i: int, zk_port: int) -> dict[str, Any]:
        port, web = self.broker_ports[i]
        settings: dict[str, Any] = {
            "clusterName": self.cluster_name,
            "metadataStoreUrl": self._metadata_url(zk_port),
            "configurationMetadataStoreUrl": self._metadata_url(zk_port),
            "metadataStoreSessionTimeoutMillis": self.session_timeout_ms,
            "brokerServicePort": port, "webServicePort": web,
            "bindAddress": "127.0.0.1", "advertisedAddress": "127.0.0.1",
            "managedLedgerDefaultEnsembleSize": self.replicas,
            "managedLedgerDefaultWriteQuorum": self.replicas,
            "managedLedgerDefaultAckQuorum": self.replicas,
            # every broker takes a share of the namespace's bundles from the start
            "loadBalancerDistributeBundlesEvenlyEnabled": True,
            "functionsWorkerEnabled": False,
            "brokerShutdownTimeoutMs": 10000,
        }
        if self.secure:
            settings.update(broker_security_conf(self.security, port, web))
        settings.update(self.extra_broker_conf)
        return settings

    def _broker(self, java: str, lib: Path, work: Path, i: int,
                zk_port: int) -> ClusterProcess:
        conf = work / f"broker-{i}.conf"
        conf.write_text(_conf_text(self._broker_conf(i, zk_port)))
        p = ClusterProcess(f"broker-{i}", self._jvm(java, lib, work, self.heap, BROKER_MAIN,
                                                    "--broker-conf", str(conf)),
                           work, READY_LINE, self.broker_ports[i][0])
        p.launch(self.die_with_parent)
        self._say(f"started broker {i} (pid {p.pid}) on {self.broker_url(i)}, admin "
                  f"{self.admin_url_of(i)}")
        return p

    def _wait(self, procs: list[ClusterProcess], deadline: float) -> None:
        waiting = list(procs)
        next_note = time.monotonic() + 15.0
        while waiting:
            for p in list(waiting):
                rc = p.proc.poll() if p.proc is not None else -1
                if rc is not None:
                    raise p.failure(f"exited with code {rc} during start")
                if p.ready():
                    waiting.remove(p)
            now = time.monotonic()
            if waiting and now >= deadline:
                raise waiting[0].failure(f"did not serve within {self.start_timeout_s:.0f} s "
                                         f"of the cluster's start")
            if waiting and now >= next_note:
                self._say(f"  ... waiting for {', '.join(p.name for p in waiting)}")
                next_note = now + 15.0
            time.sleep(0.2)

    def _wait_namespace(self, deadline: float) -> None:
        while not namespace_ready(self.admin_url, self.security):
            if time.monotonic() >= deadline:
                raise self.brokers[0].failure("serves, but its admin API does not list the "
                                              "public/default namespace")
            time.sleep(0.2)

    def grant(self, nodes: Iterable[int] | None = None) -> None:
        """Install the grant model (as :meth:`harness.broker.PulsarStandalone.grant`); the
        cluster's brokers share it through the configuration store."""
        try:
            pulsar_security.grant_default_roles(
                self.admin_url, self.security, announce_topics=self.announce_topics,
                nodes=self.nodes if nodes is None else nodes, create_topics=False)
        except pulsar_security.PulsarAdminError as exc:
            raise BrokerStartError(f"the cluster serves but its grants failed: {exc}") from None

    def kill_broker(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Kill broker ``i`` (SIGKILL by default: a crash; SIGTERM: a graceful shutdown that
        hands its topics over) and wait until it is gone."""
        self.brokers[i].kill(sig)
        self._say(f"broker {i} killed ({signal.Signals(sig).name})")

    def start_broker(self, i: int) -> None:
        """Start broker ``i`` again on its ports; return when it serves."""
        b = self.brokers[i]
        if b.running:
            return
        b.launch(self.die_with_parent)
        self._wait([b], time.monotonic() + self.start_timeout_s)

    def stop(self) -> None:
        """Stop every process (brokers first, ZooKeeper last); data and logs stay."""
        for p in [*self.brokers, *self.bookies, *([self.zookeeper] if self.zookeeper else [])]:
            p.stop(self.stop_grace_s)

    def close(self) -> None:
        """Stop everything; remove a temporary work directory unless ``keep``."""
        self.stop()
        if self._own_work_dir and self.work_dir is not None and not self.keep:
            shutil.rmtree(self.work_dir, ignore_errors=True)
            self.work_dir = None

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
