"""A real Apache Pulsar standalone broker, run from Apache's own Maven Central artifacts.

It needs neither Docker nor Pulsar's download site, only Maven Central and Java 17 (see the
delivery page of the docs, ``docs/delivery.md``). This module

1. fetches ``org.apache.pulsar:pulsar-broker`` and its ~320 runtime jars once, with Maven,
   into a cache outside the repository (:func:`fetch_pulsar`; default
   ``~/.cache/smart-dsmd/pulsar-<version>``, or ``$SMART_PULSAR_CACHE``). The fetch holds a
   file lock (concurrent processes wait for one download) and writes its marker file last
   (a half-finished earlier fetch is thrown away and redone);
2. runs ``org.apache.pulsar.PulsarStandaloneStarter`` in a private work directory with a
   minimal ``standalone.conf`` on free loopback ports (:class:`PulsarStandalone`, a context
   manager), waits until it really serves, and stops it by its own PID.

Secure by default (:class:`security.tls.Security`): the broker serves only TLS, on its
binary port (``pulsar+ssl://``) and its admin port (``https://``), with the ``broker``
identity of the PKI; there is no plain-text port. Every client authenticates with its own
certificate (mutual TLS; the certificate's common name is its role), authorisation is on,
and the starter installs the project's grant model once the broker serves
(:func:`security.pulsar.grant_default_roles`: only ``controller`` produces on the
configuration topics, ``agent-<n>`` consumes only through node ``n``'s subscriptions,
``policy-server`` produces only announcements; ``broker`` and ``admin`` are the
super-users). ``Security(insecure=True)`` starts the plain-text, open broker of old and
logs a warning.

Used by the MQ channel's tests, the loopback testbed and the delivery demo::

    with PulsarStandalone() as broker:
        client = pulsar.Client(broker.service_url, **broker.client_args("controller"))

Command line (a helper script)::

    python -m harness.broker fetch
    python -m harness.broker start [--port P --web-port W --data DIR --pid-file F]
                                    [--pki-dir D | --insecure] [--nodes 0-99]
    python -m harness.broker stop --pid-file F
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from envs.netutil import free_ports
from security import pulsar as pulsar_security
from security.pki import PkiError
from security.tls import Security

DEFAULT_VERSION = "4.0.7"
"""Pulsar version fetched by default (the 4.0 LTS line). Not 4.0.8 (or 4.0.6): the Maven
Central these machines reach lacks two of its modules (``jetcd-core-shaded``,
``pulsar-opentelemetry``) in those versions."""

CACHE_ENV = "SMART_PULSAR_CACHE"
"""Environment variable naming the jar cache directory (overrides the default)."""

READY_LINE = "messaging service is ready"
"""The broker's log line once its messaging service listens (``PulsarService.start``)."""

MAIN_CLASS = "org.apache.pulsar.PulsarStandaloneStarter"

JVM_OPENS = (
    "--add-opens", "java.base/java.nio=ALL-UNNAMED",
    "--add-opens", "java.base/jdk.internal.misc=ALL-UNNAMED",
    "--add-opens", "java.base/sun.net=ALL-UNNAMED",
    "--add-opens", "java.management/sun.management=ALL-UNNAMED",
    "--add-opens", "jdk.management/com.sun.management.internal=ALL-UNNAMED",
    "--add-opens", "java.base/jdk.internal.platform=ALL-UNNAMED",
    "-Dio.netty.tryReflectionSetAccessible=true",
)

_POM = """<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0"
         xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance"
         xsi:schemaLocation="http://maven.apache.org/POM/4.0.0
                             http://maven.apache.org/xsd/maven-4.0.0.xsd">
  <modelVersion>4.0.0</modelVersion>
  <groupId>smart-dsmd</groupId>
  <artifactId>pulsar-standalone-jars</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.pulsar</groupId>
      <artifactId>pulsar-broker</artifactId>
      <version>{version}</version>
    </dependency>
  </dependencies>
</project>
"""

# Log to stdout (redirected to the instance's log file) at INFO, so the readiness line is
# there whatever logging configuration the jars carry.
_LOG4J2 = """<?xml version="1.0" encoding="UTF-8"?>
<Configuration status="WARN" shutdownHook="disable">
  <Appenders>
    <Console name="out" target="SYSTEM_OUT">
      <PatternLayout pattern="%d{ISO8601} %-5level [%t] %c{1} - %msg%n"/>
    </Console>
  </Appenders>
  <Loggers>
    <Root level="info"><AppenderRef ref="out"/></Root>
  </Loggers>
</Configuration>
"""

# Pulsar's poms name other repositories (e.g. Confluent's) that may be unreachable; fetch
# everything through Maven Central (or $SMART_MAVEN_MIRROR) instead.
_SETTINGS = """<?xml version="1.0" encoding="UTF-8"?>
<settings xmlns="http://maven.apache.org/SETTINGS/1.2.0">
  <mirrors>
    <mirror>
      <id>smart-dsmd-central</id>
      <mirrorOf>*</mirrorOf>
      <url>{url}</url>
    </mirror>
  </mirrors>
</settings>
"""

MIRROR_ENV = "SMART_MAVEN_MIRROR"
"""Environment variable naming a Maven repository URL to fetch from instead of Central."""

Progress = Callable[[str], None]


# --------------------------------------------------------------------------- errors


class BrokerError(RuntimeError):
    """Base class of everything this module raises on purpose."""


class JavaNotFoundError(BrokerError):
    """No usable ``java`` (17 or newer) on ``$JAVA_HOME/bin`` or ``$PATH``."""


class MavenNotFoundError(BrokerError):
    """No ``mvn`` on ``$PATH`` (needed once, to fetch the broker's jars)."""


class FetchError(BrokerError):
    """Maven could not fetch the broker's jars (the message carries Maven's output tail)."""


class BrokerStartError(BrokerError):
    """The broker died or did not become ready in time (the message carries its log tail)."""


class PortInUseError(BrokerStartError):
    """A port the broker needs is already taken."""


def _stderr_progress(line: str) -> None:
    print(f"[pulsar] {line}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- fetch


def default_cache_dir(version: str = DEFAULT_VERSION) -> Path:
    """The jar cache: ``$SMART_PULSAR_CACHE`` if set, else ``~/.cache/smart-dsmd/pulsar-<v>``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "smart-dsmd" / f"pulsar-{version}"


def _dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _read_marker(cache: Path) -> dict | None:
    try:
        return json.loads((cache / ".complete").read_text())
    except (OSError, ValueError):
        return None


def _tail(path: Path, lines: int = 40, width: int = 400) -> str:
    """The last ``lines`` lines of a text file, each cut to ``width`` characters."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 512 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"
    out = [ln if len(ln) <= width else ln[:width] + " ..." for ln in text.splitlines()[-lines:]]
    return "\n".join(out) if out else "(empty log)"


def fetch_pulsar(
    version: str = DEFAULT_VERSION,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    force: bool = False,
    progress: Progress | None = _stderr_progress,
    timeout_s: float = 1800.0,
) -> Path:
    """Fetch ``pulsar-broker`` ``version`` and its runtime jars once; return the jar folder.

    Safe against concurrent callers (an exclusive ``flock`` on ``<cache>/.lock``: the others
    wait, then find the jars there) and against a half-finished earlier fetch (Maven writes
    into ``lib.partial``, which is renamed to ``lib``; the marker ``.complete`` is written
    last, and without it everything is fetched again). Maven's own repository is a private
    one under the cache, deleted after success, so the jars are stored once.

    :param version: Pulsar version (Maven Central ``org.apache.pulsar:pulsar-broker``).
    :param cache_dir: where the jars go; default :func:`default_cache_dir`.
    :param force: fetch again even if the cache is complete.
    :param progress: called with one line every few seconds while Maven works (None: quiet).
    :param timeout_s: give up (and kill Maven) after this long.
    :raises MavenNotFoundError: no ``mvn``.
    :raises FetchError: Maven failed or timed out (with the tail of its output), or the
        cache directory holds another version.
    """
    say = progress or (lambda _line: None)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir(version)
    lib = cache / "lib"

    def complete() -> bool:
        marker = _read_marker(cache)
        if marker is None or not lib.is_dir():
            return False
        if marker.get("version") != version:
            raise FetchError(
                f"{cache} holds Pulsar {marker.get('version')}, not {version}; "
                f"use another cache directory (argument or ${CACHE_ENV})")
        return True

    if not force and complete():
        return lib
    mvn = shutil.which("mvn")
    if mvn is None:
        raise MavenNotFoundError(
            "Maven ('mvn') is not on PATH; it is needed once to fetch Pulsar's jars "
            "(e.g. apt-get install maven)")
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"another process is fetching into {cache}; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and complete():
            return lib
        (cache / ".complete").unlink(missing_ok=True)
        partial, m2 = cache / "lib.partial", cache / "m2"
        for stale in (partial, lib, m2):
            shutil.rmtree(stale, ignore_errors=True)
        pom = cache / "pom.xml"
        pom.write_text(_POM.format(version=version))
        settings = cache / "settings.xml"
        mirror = os.environ.get(MIRROR_ENV) or "https://repo.maven.apache.org/maven2"
        settings.write_text(_SETTINGS.format(url=mirror))
        log = cache / "fetch.log"
        cmd = [mvn, "-q", "-B", "-s", str(settings), "-f", str(pom),
               "dependency:copy-dependencies",
               f"-DoutputDirectory={partial}", "-DincludeScope=runtime",
               f"-Dmaven.repo.local={m2}"]
        say(f"fetching org.apache.pulsar:pulsar-broker:{version} with Maven into {cache} "
            "(about a minute, ~235 MB, once)")
        t0 = time.monotonic()
        with open(log, "wb") as out:
            # Maven dies with this process (a killed fetch leaves no Maven writing on).
            proc = subprocess.Popen(_pdeathsig_prefix("KILL") + cmd, stdout=out,
                                    stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=cache)
            try:
                while True:
                    try:
                        rc = proc.wait(timeout=5.0)
                        break
                    except subprocess.TimeoutExpired:
                        elapsed = time.monotonic() - t0
                        if elapsed > timeout_s:
                            proc.kill()
                            proc.wait()
                            raise FetchError(
                                f"Maven did not finish within {timeout_s:.0f} s; output tail "
                                f"({log}):\n{_tail(log)}") from None
                        got = _dir_size(m2) / 2**20
                        say(f"  ... {got:6.1f} MB downloaded, {elapsed:4.0f} s")
            except BaseException:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                raise
        if rc != 0:
            raise FetchError(f"Maven failed (exit code {rc}): {' '.join(cmd)}\n"
                             f"output tail ({log}):\n{_tail(log, 20, 2000)}")
        jars = sorted(partial.glob("*.jar"))
        if not any(j.name == f"pulsar-broker-{version}.jar" for j in jars):
            raise FetchError(f"Maven succeeded but pulsar-broker-{version}.jar is not in "
                             f"{partial} ({len(jars)} jars); output tail:\n{_tail(log)}")
        size = sum(j.stat().st_size for j in jars)
        partial.rename(lib)
        seconds = time.monotonic() - t0
        tmp = cache / ".complete.tmp"
        tmp.write_text(json.dumps({"version": version, "jars": len(jars), "bytes": size,
                                   "seconds": round(seconds, 1)}))
        os.replace(tmp, cache / ".complete")
        shutil.rmtree(m2, ignore_errors=True)
        say(f"fetched {len(jars)} jars, {size / 2**20:.0f} MB, in {seconds:.0f} s")
        return lib


# --------------------------------------------------------------------------- helpers


def find_java() -> str:
    """Path of a ``java`` of version 17 or newer (``$JAVA_HOME/bin/java`` first, then PATH).

    :raises JavaNotFoundError: none, or an older one.
    """
    home = os.environ.get("JAVA_HOME")
    java = None
    if home and os.access(os.path.join(home, "bin", "java"), os.X_OK):
        java = os.path.join(home, "bin", "java")
    java = java or shutil.which("java")
    if java is None:
        raise JavaNotFoundError(
            "Java is not installed (no 'java' on PATH or in $JAVA_HOME/bin); Pulsar 4 needs "
            "Java 17+ (e.g. apt-get install openjdk-17-jre-headless)")
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True,
                             timeout=30, check=False).stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise JavaNotFoundError(f"{java} -version failed: {exc}") from exc
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if match:
        major = int(match.group(1))
        major = int(match.group(2) or 0) if major == 1 else major
        if major < 17:
            raise JavaNotFoundError(f"{java} is Java {major}; Pulsar 4 needs Java 17+")
    return java


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a listening socket could bind ``host:port`` now (TIME_WAIT does not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _raise_if_taken(ports: dict[str, int], wait_s: float = 0.0) -> None:
    """Raise :class:`PortInUseError` naming those of ``ports`` still taken after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        taken = {k: v for k, v in ports.items() if not port_is_free(v)}
        if not taken or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if taken:
        desc = ", ".join(f"{k}={v}" for k, v in taken.items())
        raise PortInUseError(f"port already in use on 127.0.0.1: {desc}")


def _cookie_bookie_port(data_dir: Path) -> int | None:
    """The port in the bookie cookie (``bk/current/VERSION``) of a data directory, if any."""
    try:
        text = (data_dir / "bk" / "current" / "VERSION").read_text()
    except OSError:
        return None
    match = re.search(r'bookieHost:\s*"[^"]*:(\d+)"', text)
    return int(match.group(1)) if match else None


def _loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux), or None if there is none to find."""
    with contextlib.suppress(OSError):
        for _index, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    return None


def _can_connect(port: int, host: str = "127.0.0.1", timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


# ERROR lines a healthy start logs too (a new bookie's missing lastMark; the readiness poll
# asking for namespaces before the starter created the tenant).
_BENIGN = ("lastMark", "Failed to get namespaces list")


def _first_error(text: str, marks: tuple[str, ...] = (" ERROR ", "Exception", "Error:"),
                 width: int = 600) -> str | None:
    """The first line of a log with one of ``marks`` that is not a known benign one."""
    for line in text.splitlines():
        if any(m in line for m in marks) and not any(b in line for b in _BENIGN):
            return line if len(line) <= width else line[:width] + " ..."
    return None


def _pdeathsig_prefix(sig: str = "TERM") -> list[str]:
    """``setpriv --pdeathsig <sig> --`` (util-linux, Linux): the exec'd program gets ``sig``
    when the thread that started it dies. Empty where ``setpriv`` is missing. (A
    ``preexec_fn`` calling ``prctl`` would do the same but is unsafe with threads.)"""
    setpriv = shutil.which("setpriv")
    if setpriv is None or not sys.platform.startswith("linux"):
        return []
    return [setpriv, "--pdeathsig", sig, "--"]


def _is_pulsar_process(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return MAIN_CLASS.encode() in cmdline


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):  # a zombie is not alive
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return False
    return True


def stop_pid(pid: int, grace_s: float = 30.0) -> bool:
    """Stop the broker with process id ``pid``: SIGTERM, then SIGKILL after ``grace_s``.

    Only a process whose command line names ``PulsarStandaloneStarter`` is signalled (a pid
    file may be stale and its PID reused). Returns whether such a process was found.
    """
    if not _is_pulsar_process(pid):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    return True


def _terminate(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM ``proc`` by its PID, then SIGKILL after ``grace_s``; reap it."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


# --------------------------------------------------------------------------- broker


def broker_security_conf(security: Security, port: int | None, web_port: int | None
                         ) -> dict[str, str | int | bool]:
    """A broker's TLS settings (``standalone.conf`` or ``broker.conf`` keys): TLS-only
    ports ``port`` and ``web_port``, mutual-TLS authentication, authorisation, and the
    broker's own internal clients (admin calls of the starter, system topics, lookups and
    admin calls it forwards to another broker of a cluster) presenting the PKI's ``broker``
    identity. Shared by :class:`PulsarStandalone` and
    :class:`harness.pulsar_cluster.PulsarCluster`."""
    ident = security.identity("broker")
    ca, cert, key = str(ident.ca), str(ident.cert), str(ident.key)
    return {
        # no plain-text port: TLS only, and a client certificate the CA signed required
        # in the handshake (before any Pulsar command is read)
        "brokerServicePort": "", "brokerServicePortTls": port or "",
        "webServicePort": "", "webServicePortTls": web_port or "",
        "tlsCertificateFilePath": cert, "tlsKeyFilePath": key,
        "tlsTrustCertsFilePath": ca,
        "tlsRequireTrustedClientCertOnConnect": True,
        "tlsAllowInsecureConnection": False,
        "authenticationEnabled": True,
        "authenticationProviders":
            "org.apache.pulsar.broker.authentication.AuthenticationProviderTls",
        "authorizationEnabled": True,
        # agent-* (one grant for every node's agent), see security.pulsar
        "authorizationAllowWildcardsMatching": True,
        "superUserRoles": ",".join(pulsar_security.SUPER_USERS),
        # the announcement topic's grant is made before anyone produces on it
        "allowAclChangesOnNonExistentTopics": True,
        "brokerClientTlsEnabled": True,
        "brokerClientAuthenticationPlugin":
            "org.apache.pulsar.client.impl.auth.AuthenticationTls",
        "brokerClientAuthenticationParameters": json.dumps(
            {"tlsCertFile": cert, "tlsKeyFile": key}),
        "brokerClientTrustCertsFilePath": ca,
        "tlsHostnameVerificationEnabled": True,
    }


class PulsarStandalone:
    """One real Pulsar standalone broker (broker + one bookie + RocksDB metadata) in a JVM.

    Ports (broker, web/admin, bookie) are free loopback ports unless given; with security
    on (the default) the broker and web ports are TLS ports and no plain-text port is open.
    The instance's work directory (default: a fresh temporary one) holds
    ``conf/standalone.conf`` (paths to the broker's key and certificates, never a key), the empty
    ``conf/functions_worker.yml`` the starter insists on, ``conf/log4j2.xml``, ``broker.log``
    and, unless ``data_dir`` is given, ``data/`` (bookie ledgers and metadata).

    :meth:`start` returns when the broker serves: its log says ``messaging service is
    ready``, its broker port accepts a TCP connection, and the admin API lists the
    ``public/default`` namespace (the starter creates it only after the ready line, and a
    producer on ``public/default`` fails before that); a secure broker then gets its grants
    (:meth:`grant`, idempotent, again at each start). :meth:`stop` signals the JVM by its own
    PID; :meth:`restart` starts it again on the same ports and data, so what was persisted
    (messages, durable subscriptions and their cursors) survives. :meth:`close` (and leaving
    the ``with`` block) stops it and removes a temporary work directory unless ``keep``.

    :param version: Pulsar version, fetched by :func:`fetch_pulsar` if not cached yet.
    :param cache_dir: jar cache (default :func:`default_cache_dir`).
    :param port: broker (binary protocol) port; default a free one.
    :param web_port: web service (admin REST) port; default a free one.
    :param bookie_port: the local bookie's port; default a free one.
    :param data_dir: persistent data directory (default ``<work_dir>/data``).
    :param work_dir: where config and log go (default a new temporary directory, which
        :meth:`close` removes; a given one is never removed).
    :param heap: JVM ``-Xmx`` (``-Xms`` is left to the JVM). The default, 512m, carries the tests'
        and the loopback testbed's loads; the JVM's resident size grows well beyond the heap
        with large messages (direct memory, below).
    :param direct_memory: JVM ``-XX:MaxDirectMemorySize`` (bookie caches, Netty buffers).
    :param start_timeout_s: how long :meth:`start` waits for readiness.
    :param stop_grace_s: how long :meth:`stop` waits after SIGTERM before SIGKILL.
    :param keep: keep the temporary work directory (config, log, data) on :meth:`close`.
    :param extra_conf: more ``standalone.conf`` settings (override the minimal ones).
    :param jvm_args: more JVM options.
    :param die_with_parent: on Linux (with util-linux ``setpriv``), the JVM gets SIGTERM if
        the thread that started it dies, so a killed test run leaves no orphaned broker.
        Applied only when started from the main thread, since a worker thread's exit would
        stop the broker too.
    :param progress: where fetch and start progress lines go (None: quiet).
    :param security: TLS, authentication and authorisation (the default) with the PKI's
        ``broker`` identity, or ``Security(insecure=True)`` for an open plain-text broker
        (logs a warning).
    :param nodes: nodes whose subscriptions are bound to their agent's role at start
        (:func:`security.pulsar.grant_node_subscriptions`; the controller may bind others
        later).
    :param announce_topics: the topics the ``policy-server`` role may produce on.
    :param host: the address it binds and advertises (the emulated network's broker address
        inside :mod:`delivery.netem`'s broker namespace).
    :param netns: run the JVM in this network namespace (``ip netns exec``; the emulated
        network's), reached from here at ``host``.
    """

    def __init__(
        self,
        *,
        version: str = DEFAULT_VERSION,
        cache_dir: str | os.PathLike[str] | None = None,
        port: int | None = None,
        web_port: int | None = None,
        bookie_port: int | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        work_dir: str | os.PathLike[str] | None = None,
        heap: str = "512m",
        direct_memory: str = "512m",
        start_timeout_s: float = 180.0,
        stop_grace_s: float = 30.0,
        keep: bool = False,
        extra_conf: dict[str, str | int | bool] | None = None,
        jvm_args: tuple[str, ...] = (),
        die_with_parent: bool = True,
        progress: Progress | None = _stderr_progress,
        security: Security = Security(),  # noqa: B008 (immutable)
        nodes: Iterable[int] = (),
        announce_topics: Iterable[str] = (pulsar_security.ANNOUNCE_TOPIC,),
        host: str = "127.0.0.1",
        netns: str | None = None,
    ) -> None:
        self.version = version
        self.host = host
        self.netns = netns
        self.security = Security.from_mapping(security)
        self.nodes = tuple(int(n) for n in nodes)
        self.announce_topics = tuple(announce_topics)
        self.cache_dir = (Path(cache_dir).expanduser() if cache_dir is not None
                          else default_cache_dir(version))
        self._fixed_ports = port is not None or web_port is not None or bookie_port is not None
        self.port = port
        self.web_port = web_port
        self.bookie_port = bookie_port
        self._own_work_dir = work_dir is None
        self.work_dir = Path(work_dir).expanduser().resolve() if work_dir is not None else None
        self._data_arg = Path(data_dir).expanduser().resolve() if data_dir is not None else None
        self.heap = heap
        self.direct_memory = direct_memory
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        self.keep = keep
        self.extra_conf = dict(extra_conf or {})
        self.jvm_args = tuple(jvm_args)
        self.die_with_parent = die_with_parent
        self._say = progress or (lambda _line: None)
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize | None = None
        self._log_offset = 0
        self.starts = 0
        self.last_start_s: float | None = None
        self.last_grant_s: float | None = None

    # ------------------------------------------------------------------ properties

    @property
    def secure(self) -> bool:
        """Whether the broker runs with TLS, authentication and authorisation."""
        return not self.security.insecure

    @property
    def service_url(self) -> str:
        """``pulsar+ssl://<host>:<port>`` (``pulsar://`` when insecure), for
        ``pulsar.Client`` with :meth:`client_args`."""
        self._need_ports()
        return f"{'pulsar+ssl' if self.secure else 'pulsar'}://{self.host}:{self.port}"

    @property
    def admin_url(self) -> str:
        """``https://<host>:<web_port>`` (``http://`` when insecure): the admin REST API,
        ``/admin/v2/...`` (see :meth:`admin`)."""
        self._need_ports()
        return f"{'https' if self.secure else 'http'}://{self.host}:{self.web_port}"

    def client_args(self, principal: str) -> dict[str, Any]:
        """``pulsar.Client(self.service_url, **self.client_args(p))`` connects as ``p``
        (:func:`security.pulsar.client_args`)."""
        return pulsar_security.client_args(self.security, principal)

    def admin(self, method: str, path: str, body: Any = None, *, principal: str = "admin",
              timeout: float = 10.0) -> Any:
        """One admin REST call as ``principal`` (a super-user by default): the decoded JSON
        answer; :class:`security.pulsar.PulsarAdminError` on failure."""
        return pulsar_security.admin_call(self.admin_url, method, path, body,
                                          security=self.security, principal=principal,
                                          timeout=timeout)

    @property
    def pid(self) -> int | None:
        """The JVM's process id while it runs, else None."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def running(self) -> bool:
        """Whether the JVM this instance started is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path:
        """The broker's log file (stdout and stderr of the JVM, all starts appended)."""
        return self._work() / "broker.log"

    @property
    def data_dir(self) -> Path:
        """The persistent data (bookie ledgers under ``bk/``, metadata under ``metadata/``)."""
        return self._data_arg or self._work() / "data"

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the broker's log."""
        return _tail(self.log_path, lines)

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.running else "stopped"
        return f"PulsarStandalone({self.version}, port={self.port}, {state})"

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Self:
        """Start the broker (fetching the jars first if needed); return when it serves.

        :raises JavaNotFoundError, MavenNotFoundError, FetchError: see :func:`fetch_pulsar`.
        :raises PortInUseError: a given port is taken (auto-picked ports are re-picked up to
            twice if another process grabs one first).
        :raises BrokerStartError: the JVM exited during start (exit code and log tail), or
            did not become ready within ``start_timeout_s`` (log tail; the JVM is killed).
        """
        if self.running:
            return self
        if not self.starts:
            self.security.warn_if_insecure("the Pulsar broker")
        java = find_java()
        given = {k: v for k, v in self._ports().items() if v is not None}
        _raise_if_taken(given, wait_s=10.0 if self.starts else 0.0)  # before a long fetch
        lib = fetch_pulsar(self.version, self.cache_dir, progress=self._say)
        work = self._work()
        attempts = 1 if (self._fixed_ports or self.starts) else 3
        for attempt in range(attempts):
            self._prepare_ports()
            try:
                self._launch(java, lib, work)
                return self
            except PortInUseError:
                if attempt + 1 >= attempts:
                    raise
                self._say("a picked port was taken meanwhile; picking new ports")
                self.port = self.web_port = self.bookie_port = None
        raise AssertionError("unreachable")

    def stop(self, grace_s: float | None = None) -> None:
        """Stop the JVM by its own PID: SIGTERM, then SIGKILL after ``grace_s``
        (default ``stop_grace_s``). Data and ports are kept for :meth:`restart`."""
        proc, self._proc = self._proc, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if proc is not None:
            _terminate(proc, self.stop_grace_s if grace_s is None else grace_s)

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait until the JVM exits (by itself or by a signal from elsewhere); return its
        exit code, or None if it still runs after ``timeout`` seconds or was never started."""
        if self._proc is None:
            return None
        try:
            return self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def restart(self, grace_s: float | None = None) -> Self:
        """Stop and start again on the same ports and the same data directory."""
        self.stop(grace_s)
        return self.start()

    def close(self) -> None:
        """Stop the broker; remove a temporary work directory unless ``keep``."""
        self.stop()
        if self._own_work_dir and self.work_dir is not None and not self.keep:
            shutil.rmtree(self.work_dir, ignore_errors=True)
            self.work_dir = None

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()  # the work dir (log) stays for a look; close() removes it
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _need_ports(self) -> None:
        if self.port is None or self.web_port is None:
            raise BrokerError("the broker's ports are chosen at start(); start it first")

    def _work(self) -> Path:
        if self.work_dir is None:
            self.work_dir = Path(tempfile.mkdtemp(prefix="smart-pulsar-"))
        return self.work_dir

    def _prepare_ports(self) -> None:
        # A bookie that ran on this data before kept its address in its cookie, and the
        # standalone starter reuses that port whatever it is told.
        cookie_port = _cookie_bookie_port(self.data_dir)
        if cookie_port is not None and cookie_port != self.bookie_port:
            if self.bookie_port is not None:
                self._say(f"the data in {self.data_dir} belongs to a bookie on port "
                          f"{cookie_port}; using that port, not {self.bookie_port}")
            self.bookie_port = cookie_port
        missing = [name for name in ("port", "web_port", "bookie_port")
                   if getattr(self, name) is None]
        for name, value in zip(missing, free_ports(len(missing))):
            setattr(self, name, value)
        ports = {k: v for k, v in self._ports().items() if v is not None}
        if len(set(ports.values())) != 3:
            raise BrokerError(f"the broker's ports must differ: {ports}")
        # After a stop the old JVM's listening sockets may take a moment to go.
        _raise_if_taken(ports, wait_s=10.0 if self.starts else 0.0)

    def _ports(self) -> dict[str, int | None]:
        return {"port": self.port, "web_port": self.web_port, "bookie_port": self.bookie_port}

    def _write_conf(self, work: Path) -> Path:
        conf = work / "conf"
        conf.mkdir(parents=True, exist_ok=True)
        (conf / "functions_worker.yml").write_text("")
        (conf / "log4j2.xml").write_text(_LOG4J2)
        assert self.port is not None and self.web_port is not None
        settings: dict[str, str | int | bool] = {
            "clusterName": "standalone",
            "brokerServicePort": self.port,
            "webServicePort": self.web_port,
            "bindAddress": self.host,
            "advertisedAddress": self.host,
            "managedLedgerDefaultEnsembleSize": 1,
            "managedLedgerDefaultWriteQuorum": 1,
            "managedLedgerDefaultAckQuorum": 1,
            "functionsWorkerEnabled": False,
            "brokerShutdownTimeoutMs": 10000,
            # The bookie reads this file too. Without allowEphemeralPorts the standalone's
            # BKCluster ignores --bookkeeper-port and takes a random port (kept in the bookie's
            # cookie for later starts); without listeningInterface it listens on all
            # interfaces.
            "allowEphemeralPorts": True,
            # The bookie keeps one index file open per ledger (every topic and every durable
            # subscription's cursor has one) up to openFileLimit, 20,000 by default: a long
            # testbed (24 runs x 200 topics x 350 subscribers) reached the process's open-file
            # limit and the broker refused connections ("accept(..) failed: Too many open
            # files"). Above this many it closes the least recently used ones.
            "openFileLimit": 2000,
        }
        lo = _loopback_interface()
        if lo:
            settings["listeningInterface"] = lo
        if self.secure:
            settings.update(self._security_conf())
        settings.update(self.extra_conf)
        lines = [f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                 for k, v in settings.items()]
        path = conf / "standalone.conf"
        path.write_text("# written by harness.broker\n" + "\n".join(lines) + "\n")
        return path

    def _security_conf(self) -> dict[str, str | int | bool]:
        return broker_security_conf(self.security, self.port, self.web_port)

    def command(self, java: str, lib: Path, conf: Path) -> list[str]:
        """The JVM command line (the standalone starter's flags, this instance's heap and dirs)."""
        data = self.data_dir
        return [
            java, f"-Xmx{self.heap}", f"-XX:MaxDirectMemorySize={self.direct_memory}",
            *JVM_OPENS,
            f"-Dlog4j2.configurationFile={conf.parent / 'log4j2.xml'}",
            "-Dpulsar.log.level=info",
            *self.jvm_args,
            "-cp", f"{lib}/*", MAIN_CLASS,
            "--config", str(conf), "-nss", "-nfw",
            "--bookkeeper-port", str(self.bookie_port),
            "--bookkeeper-dir", str(data / "bk"),
            # The zk dir must not exist: if it does the starter switches to ZooKeeper mode.
            "--zookeeper-dir", str(data / "zk"),
            "--metadata-dir", str(data / "metadata"),
        ]

    def _launch(self, java: str, lib: Path, work: Path) -> None:
        conf = self._write_conf(work)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = self.command(java, lib, conf)
        if self.die_with_parent and threading.current_thread() is threading.main_thread():
            cmd = _pdeathsig_prefix() + cmd
        if self.netns is not None:  # the emulated network's broker namespace (delivery.netem)
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        log = self.log_path
        with open(log, "ab") as out:
            self._log_offset = out.tell()
            out.write(f"\n===== start {self.starts + 1}: {' '.join(cmd)}\n".encode())
            out.flush()
            t0 = time.monotonic()
            self._proc = subprocess.Popen(
                cmd, cwd=work, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        # Stops the JVM if this object is dropped, or at interpreter exit, while it runs.
        self._finalizer = weakref.finalize(self, _terminate, self._proc, 10.0)
        self._say(f"started Pulsar {self.version} (pid {self._proc.pid}) on "
                  f"{self.service_url}, admin {self.admin_url}; log {log}")
        try:
            self._wait_ready(t0)
            if self.secure:
                t1 = time.monotonic()
                self.grant()
                self.last_grant_s = time.monotonic() - t1
        except BaseException:
            self.stop(grace_s=5.0)
            raise
        self.starts += 1
        self.last_start_s = time.monotonic() - t0
        self._say(f"broker ready after {self.last_start_s:.1f} s")

    def _log_since_start(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def _fail(self, why: str) -> BrokerStartError:
        text = self._log_since_start()
        tail = self.log_tail(40)
        first = (_first_error(text, ("Address already in use", "BindException"))
                 or _first_error(text))
        cause = f"\nfirst error: {first}" if first else ""
        if "Address already in use" in text or "BindException" in text:
            return PortInUseError(
                f"{why}: a port is already in use (broker {self.port}, web {self.web_port}, "
                f"bookie {self.bookie_port}){cause}\nlog tail ({self.log_path}):\n{tail}")
        return BrokerStartError(f"{why}{cause}\nlog tail ({self.log_path}):\n{tail}")

    def _wait_ready(self, t0: float) -> None:
        assert self._proc is not None
        deadline = t0 + self.start_timeout_s
        stage = "log"
        next_note = t0 + 15.0
        scanned = 0
        while True:
            rc = self._proc.poll()
            if rc is not None:
                raise self._fail(f"the broker (pid {self._proc.pid}) exited with code {rc} "
                                 f"during start")
            if stage == "log":
                text = self._log_since_start()
                if READY_LINE in text[max(0, scanned - len(READY_LINE)):]:
                    stage = "tcp"
                scanned = len(text)
            if stage == "tcp" and self.port is not None and _can_connect(self.port, self.host):
                stage = "namespace"
            if stage == "namespace" and self._namespace_ready():
                return
            now = time.monotonic()
            if now >= deadline:
                raise self._fail(f"the broker did not become ready within "
                                 f"{self.start_timeout_s:.0f} s (waiting for: {stage})")
            if now >= next_note:
                self._say(f"  ... still starting ({now - t0:.0f} s, waiting for: {stage})")
                next_note = now + 15.0
            time.sleep(0.2)

    def grant(self, nodes: Iterable[int] | None = None) -> None:
        """Install the grant model (:func:`security.pulsar.grant_default_roles`) with this
        broker's ``announce_topics`` and ``nodes`` (or the ``nodes`` given). Done by
        :meth:`start`; idempotent."""
        try:
            pulsar_security.grant_default_roles(
                self.admin_url, self.security, announce_topics=self.announce_topics,
                nodes=self.nodes if nodes is None else nodes, create_topics=False)
        except pulsar_security.PulsarAdminError as exc:
            raise BrokerStartError(f"the broker serves but its grants failed: {exc}\n"
                                   f"log tail ({self.log_path}):\n{self.log_tail(20)}"
                                   ) from None

    def _namespace_ready(self) -> bool:
        return namespace_ready(self.admin_url, self.security)


def namespace_ready(admin_url: str, security: Security) -> bool:
    """Whether the broker at ``admin_url`` lists the ``public/default`` namespace (a
    producer there fails before it does); False while it does not answer."""
    url = f"{admin_url}/admin/v2/namespaces/public"
    try:
        ctx = None if security.insecure else pulsar_security.ssl_context(security)
        with urllib.request.urlopen(url, timeout=2.0, context=ctx) as resp:
            return "public/default" in json.loads(resp.read().decode())
    except (OSError, ValueError, urllib.error.URLError):
        return False


# --------------------------------------------------------------------------- CLI


def _cmd_fetch(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    lib = fetch_pulsar(args.version, args.cache, force=args.force)
    jars = list(lib.glob("*.jar"))
    size = sum(j.stat().st_size for j in jars)
    print(f"{lib}: {len(jars)} jars, {size / 2**20:.0f} MB ({time.monotonic() - t0:.1f} s)")
    return 0


def _cmd_start(args: argparse.Namespace) -> int:
    security = Security(insecure=args.insecure, pki_dir=args.pki_dir)
    broker = PulsarStandalone(version=args.version, cache_dir=args.cache, port=args.port,
                              web_port=args.web_port, bookie_port=args.bookie_port,
                              data_dir=args.data, heap=args.heap, keep=args.keep,
                              security=security, nodes=pulsar_security.parse_nodes(args.nodes))
    pid_file = Path(args.pid_file or Path(tempfile.gettempdir()) / "smart-dsmd-pulsar.pid")

    def on_term(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)  # also where a shell started us with SIGINT ignored
    pid: int | None = None
    try:
        broker.start()
        pid = broker.pid
        pid_file.write_text(f"{broker.pid}\n")
        pki = "none (insecure)" if security.insecure else str(security.pki.dir)
        print(f"service_url {broker.service_url}\nadmin_url   {broker.admin_url}\n"
              f"pki         {pki}\n"
              f"pid         {broker.pid} (pid file {pid_file})\nlog         {broker.log_path}\n"
              f"data        {broker.data_dir}\nCtrl-C stops it.", flush=True)
        rc = broker.wait()
        print(f"broker exited with code {rc}", flush=True)
        if rc not in (0, 143, -signal.SIGTERM):  # 143: the JVM's exit on SIGTERM
            print(broker.log_tail(), file=sys.stderr)
            return 1
        return 0
    except KeyboardInterrupt:
        print("stopping the broker", flush=True)
        return 0
    finally:
        broker.close()
        with contextlib.suppress(OSError):
            if pid_file.read_text().strip() == str(pid):
                pid_file.unlink()


def _cmd_stop(args: argparse.Namespace) -> int:
    try:
        pid = int(Path(args.pid_file).read_text().strip())
    except (OSError, ValueError) as exc:
        print(f"cannot read a pid from {args.pid_file}: {exc}", file=sys.stderr)
        return 1
    if not stop_pid(pid, grace_s=args.grace):
        print(f"no Pulsar broker runs with pid {pid} (stale pid file?)", file=sys.stderr)
        return 1
    print(f"stopped broker pid {pid}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.broker {fetch,start,stop}``."""
    ap = argparse.ArgumentParser(prog="python -m harness.broker", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download the broker's jars into the cache")
    s = sub.add_parser("start", help="run a broker in the foreground (Ctrl-C stops it)")
    for p in (f, s):
        p.add_argument("--version", default=DEFAULT_VERSION)
        p.add_argument("--cache", default=None, help=f"jar cache (default ${CACHE_ENV} or "
                       "~/.cache/smart-dsmd/pulsar-<version>)")
    f.add_argument("--force", action="store_true", help="fetch again")
    s.add_argument("--port", type=int, default=None, help="broker port (default: free)")
    s.add_argument("--web-port", type=int, default=None, help="admin port (default: free)")
    s.add_argument("--bookie-port", type=int, default=None, help="bookie port (default: free)")
    s.add_argument("--data", default=None, help="persistent data dir (default: temporary)")
    s.add_argument("--heap", default="512m")
    s.add_argument("--keep", action="store_true", help="keep the temporary work dir")
    s.add_argument("--pki-dir", default=None, help="PKI directory (default $SMART_PKI_DIR or "
                   "~/.cache/smart-dsmd/pki; a development PKI is created if missing)")
    s.add_argument("--insecure", action="store_true",
                   help="plain text, no authentication or authorisation (debugging only)")
    s.add_argument("--nodes", default="", help="bind these nodes' subscriptions to their "
                   "agents now, e.g. 0-349 (the controller binds the others)")
    s.add_argument("--pid-file", default=None,
                   help="where the JVM's pid goes (default $TMPDIR/smart-dsmd-pulsar.pid)")
    t = sub.add_parser("stop", help="stop the broker named by a pid file")
    t.add_argument("--pid-file", required=True)
    t.add_argument("--grace", type=float, default=30.0, help="seconds before SIGKILL")
    args = ap.parse_args(argv)
    try:
        return {"fetch": _cmd_fetch, "start": _cmd_start, "stop": _cmd_stop}[args.cmd](args)
    except (BrokerError, PkiError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
