"""Many message agents in one process, on one asyncio loop (the testbed runs 350 nodes on a
2-core machine; a node's agent is still a separate gRPC endpoint, Pulsar subscriber and
record, exactly as on its own host).

In process: ``AgentHost(configs, pulsar_url).start()`` runs the loop on a thread;
``stop_agent``/``start_agent`` take one node's endpoint down and up (the fault tests).
As a process: ``python -m delivery.agent_host --spec spec.json`` (what the testbed and the
crash tests start and kill); the spec names the nodes, their ports, the store, the record
directory and the controller; SIGTERM stops it cleanly and writes each agent's counters to
``<record_dir>/node-<id>.counters.json``; SIGKILL is a crash.

Security: each agent runs with its own :class:`security.tls.Security` (``AgentConfig.security``,
secure by default: its own identity ``agent-<n>`` for mutual TLS and for Pulsar, so agents
sharing a process do not share a Pulsar client); the spec's ``security`` block
(``{insecure, pki_dir}``, written by :func:`host_spec`) sets it for every node of the process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envs.netutil import node_address
from security.pulsar import ANNOUNCE_TOPIC
from security.tls import Security

from .agent import AgentConfig, MessageAgent, PulsarClients
from .health import security_setting

__all__ = ["AgentHost", "HostProcesses", "cpu_seconds", "host_spec", "main"]

log = logging.getLogger(__name__)


class AgentHost:
    def __init__(self, configs: Sequence[AgentConfig], pulsar_url: str | None,
                 listener_threads: int = 1, netns: Mapping[int, str] | None = None) -> None:
        self.configs = {c.node_id: c for c in configs}
        self.netns = {int(n): ns for n, ns in (netns or {}).items()}
        self.clients = PulsarClients(pulsar_url, listener_threads, per_agent=bool(self.netns))
        self.agents: dict[int, MessageAgent] = {}
        self.loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._unreachable: set[int] = set()   # nodes whose priming the broker did not answer

    # ------------------------------------------------------------------ in process
    def start(self) -> AgentHost:
        self._thread = threading.Thread(target=self.loop.run_forever, name="agent-host",
                                        daemon=True)
        self._thread.start()
        # every node's client primed at once (each in its namespace): with the broker down
        # each priming waits for the client's operation timeout, in parallel, not in turn
        primes = {n: threading.Thread(target=self._prime_client, args=(self.configs[n], ns),
                                      name=f"netns-{n}")
                  for n, ns in self.netns.items() if n in self.configs}
        for t in primes.values():
            t.start()
        for t in primes.values():
            t.join()
        for n in self.configs:
            self.start_agent(n, primed=n in primes)
        return self

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def start_agent(self, node_id: int, primed: bool = False) -> int:
        """Start (or restart, recovering from its record and the store) one node's agent
        (``primed``: its client was primed by :meth:`start`)."""
        cfg = self.configs[node_id]
        agent = MessageAgent(cfg, self.clients)
        ns = self.netns.get(node_id)
        if ns is None:
            port = self.call(agent.start())
        else:
            if not primed:
                self._prime_client(cfg, ns)
            # the broker did not answer the priming: the agent attaches its subscriptions in
            # the background instead of waiting for each at start
            agent.broker_reachable = node_id not in self._unreachable
            port = self.call(_start_in(ns, agent))
        cfg.port = port  # a restart binds the same port
        self.agents[node_id] = agent
        return port

    def _prime_client(self, cfg: AgentConfig, ns: str) -> None:
        """Create the node's Pulsar client from a thread in the node's namespace and make it
        connect once: its I/O thread starts there, so every connection of that client (and
        the broker's traffic to the node) crosses the node's link."""
        import pulsar

        from .netem import in_netns

        def prime() -> None:
            with in_netns(ns):
                client = self.clients.get(cfg.pulsar_url, cfg.security, cfg.principal)
                try:
                    client.get_topic_partitions(ANNOUNCE_TOPIC)
                    self._unreachable.discard(cfg.node_id)
                except (pulsar.Timeout, pulsar.ConnectError) as e:
                    log.warning("node %d: the broker does not answer (%s)", cfg.node_id, e)
                    self._unreachable.add(cfg.node_id)
                except Exception as e:  # the connection is made before any refusal
                    log.debug("node %d: priming lookup: %s", cfg.node_id, e)
                    self._unreachable.discard(cfg.node_id)

        t = threading.Thread(target=prime, name=f"netns-{cfg.node_id}")
        t.start()
        t.join()

    def stop_agent(self, node_id: int) -> None:
        agent = self.agents.pop(node_id)
        self.call(agent.stop(0))

    def ports(self) -> dict[int, int]:
        return {n: a.port for n, a in self.agents.items()}

    def counters(self) -> dict[int, dict]:
        return {n: a.counters.as_dict() for n, a in self.agents.items()}

    def close(self) -> None:
        for n in list(self.agents):
            try:
                self.stop_agent(n)
            except Exception as e:
                log.warning("stopping node %d: %s", n, e)
        self.clients.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> AgentHost:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


async def _start_in(ns: str, agent: MessageAgent) -> int:
    """``agent.start()`` with the loop's thread in namespace ``ns``: the agent's RPC server
    listens there (:func:`delivery.netem.in_netns`)."""
    from .netem import in_netns

    with in_netns(ns):
        return await agent.start()


def host_spec(nodes: dict[int, int], *, store_url: str, record_dir: str | Path,
              pulsar_url: str, controller: str | None,
              security: Security | Mapping[str, Any] | None = None,
              netns: Mapping[int, str] | None = None, **agent_kw: Any) -> dict:
    """The JSON spec of an agent-host process: node id -> port, and the shared settings
    (``security``: a :class:`Security` or its mapping; None is the secure default;
    ``netns``: node id -> the emulated network's namespace of the node, where its agent
    listens on the node's address, :func:`envs.netutil.node_address`)."""
    sec = security_setting(security)
    return {"nodes": {str(n): int(p) for n, p in nodes.items()}, "store_url": store_url,
            "record_dir": str(record_dir), "pulsar_url": pulsar_url, "controller": controller,
            "security": dataclasses.asdict(sec), "agent": agent_kw,
            "netns": {str(n): ns for n, ns in (netns or {}).items()}}


@dataclass
class HostProcesses:
    """Agent-host processes (``python -m delivery.agent_host``) over which nodes are spread
    round-robin: started by :meth:`start`, waited for by :meth:`wait_ready`, stopped by
    :meth:`stop` (SIGTERM, each agent writes its counters; SIGKILL after a grace). The
    testbed and the switch-cost bench run their agents this way."""

    workdir: Path
    procs: list[tuple[subprocess.Popen, Path, Any]] = field(default_factory=list)

    @classmethod
    def start(cls, ports: Mapping[int, int], processes: int, workdir: Path,
              netns_tag: str | None = None, **spec_kw: Any) -> HostProcesses:
        """``ports``: node -> RPC port; ``netns_tag``: the emulated network whose node
        namespaces the agents start in; ``spec_kw``: :func:`host_spec`'s settings."""
        hosts = cls(Path(workdir))
        nodes = list(ports)
        k = max(1, min(processes, len(nodes)))
        root = Path(__file__).resolve().parents[1]
        for i in range(k):
            part = {n: ports[n] for j, n in enumerate(nodes) if j % k == i}
            netns = {n: f"{netns_tag}-n{n}" for n in part} if netns_tag else None
            f = hosts.workdir / f"agents-{i}.json"
            f.write_text(json.dumps(host_spec(part, netns=netns, **spec_kw)))
            ready = hosts.workdir / f"agents-{i}.ready"
            logf = open(hosts.workdir / f"agents-{i}.log", "w")  # noqa: SIM115 closed by stop()
            p = subprocess.Popen([sys.executable, "-m", "delivery.agent_host", "--spec", str(f),
                                  "--ready", str(ready)], cwd=root, stdout=logf,
                                 stderr=subprocess.STDOUT)
            hosts.procs.append((p, ready, logf))
        return hosts

    def wait_ready(self, timeout_s: float) -> None:
        """Until every host serves all its agents; an exited host raises with its log's
        tail, a timeout names the log directory."""
        end = time.monotonic() + timeout_s
        for p, ready, logf in self.procs:
            while not ready.exists():
                if p.poll() is not None:
                    logf.flush()
                    tail = Path(logf.name).read_text()[-2000:]
                    raise RuntimeError(f"agent host exited with {p.returncode}:\n{tail}")
                if time.monotonic() > end:
                    raise TimeoutError(f"agent hosts not ready after {timeout_s:.0f} s "
                                       f"(logs in {self.workdir})")
                time.sleep(0.1)

    def stop(self, grace_s: float = 60.0) -> float:
        """Stop every host; returns their CPU seconds (user + system) just before."""
        cpu = 0.0
        for p, _, _ in self.procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    cpu += cpu_seconds(p.pid)
                p.send_signal(signal.SIGTERM)
        for p, _, logf in self.procs:
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            logf.close()
        self.procs = []
        return cpu


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (all threads; this process if None)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="run message agents (delivery.agent_host)")
    ap.add_argument("--spec", required=True, help="JSON spec written by host_spec()")
    ap.add_argument("--ready", help="file written (ports as JSON) once every agent serves")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    spec = json.loads(Path(args.spec).read_text())
    security = security_setting(spec.get("security"))
    netns = {int(n): str(ns) for n, ns in (spec.get("netns") or {}).items()}
    configs = [AgentConfig(int(n), spec["store_url"], Path(spec["record_dir"]),
                           pulsar_url=spec["pulsar_url"], controller=spec["controller"],
                           port=int(p), security=security,
                           **({"host": node_address(int(n))} if int(n) in netns else {}),
                           **spec.get("agent", {}))
               for n, p in spec["nodes"].items()]
    host = AgentHost(configs, spec["pulsar_url"], netns=netns).start()
    if args.ready:
        tmp = Path(args.ready + ".tmp")
        tmp.write_text(json.dumps({str(n): p for n, p in host.ports().items()}))
        tmp.replace(args.ready)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    counters = host.counters()
    host.close()
    for n, c in counters.items():
        (Path(spec["record_dir"]) / f"node-{n}.counters.json").write_text(json.dumps(c))


if __name__ == "__main__":
    main()
