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
import dataclasses
import json
import logging
import signal
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from security.tls import Security

from .agent import AgentConfig, MessageAgent, PulsarClients
from .health import security_setting

__all__ = ["AgentHost", "host_spec", "main"]

log = logging.getLogger(__name__)


class AgentHost:
    def __init__(self, configs: Sequence[AgentConfig], pulsar_url: str | None,
                 listener_threads: int = 1) -> None:
        self.configs = {c.node_id: c for c in configs}
        self.clients = PulsarClients(pulsar_url, listener_threads)
        self.agents: dict[int, MessageAgent] = {}
        self.loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ in process
    def start(self) -> AgentHost:
        self._thread = threading.Thread(target=self.loop.run_forever, name="agent-host",
                                        daemon=True)
        self._thread.start()
        for n in self.configs:
            self.start_agent(n)
        return self

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def start_agent(self, node_id: int) -> int:
        """Start (or restart, recovering from its record and the store) one node's agent."""
        cfg = self.configs[node_id]
        agent = MessageAgent(cfg, self.clients)
        port = self.call(agent.start())
        cfg.port = port  # a restart binds the same port
        self.agents[node_id] = agent
        return port

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


def host_spec(nodes: dict[int, int], *, store_url: str, record_dir: str | Path,
              pulsar_url: str, controller: str | None,
              security: Security | Mapping[str, Any] | None = None, **agent_kw: Any) -> dict:
    """The JSON spec of an agent-host process: node id -> port, and the shared settings
    (``security``: a :class:`Security` or its mapping; None is the secure default)."""
    sec = security_setting(security)
    return {"nodes": {str(n): int(p) for n, p in nodes.items()}, "store_url": store_url,
            "record_dir": str(record_dir), "pulsar_url": pulsar_url, "controller": controller,
            "security": dataclasses.asdict(sec), "agent": agent_kw}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="run message agents (delivery.agent_host)")
    ap.add_argument("--spec", required=True, help="JSON spec written by host_spec()")
    ap.add_argument("--ready", help="file written (ports as JSON) once every agent serves")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    spec = json.loads(Path(args.spec).read_text())
    security = security_setting(spec.get("security"))
    configs = [AgentConfig(int(n), spec["store_url"], Path(spec["record_dir"]),
                           pulsar_url=spec["pulsar_url"], controller=spec["controller"],
                           port=int(p), security=security, **spec.get("agent", {}))
               for n, p in spec["nodes"].items()]
    host = AgentHost(configs, spec["pulsar_url"]).start()
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
