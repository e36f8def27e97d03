"""The delivery plane's parts as processes of their own, started, crashed and restarted like
real ones: the controller with its ingress (``python -m delivery.controller_host``) and a
group of agents (``python -m delivery.agent_host``). SIGKILL is a real crash; ``start`` again
with the same spec is the restart (the controller recovers from its metadata store, agents
from their programming records).

Used by the controller-crash tests and by the fault-injection soak (:mod:`delivery.soak`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from security.tls import Security

from .controller_host import controller_spec
from .rpc import open_channel, pb, pb_grpc

__all__ = ["ROOT", "AgentHostProcess", "ControllerProcess", "ModuleProcess"]

ROOT = Path(__file__).resolve().parents[1]


class ModuleProcess:
    """``python -m <module> --spec <spec> --ready <ready>`` in a child process (SIGKILL is a
    real crash); ``start`` returns once the ready file is written."""

    module = ""

    def __init__(self, spec: Path, ready: Path, log: Path) -> None:
        self.spec, self.ready, self.log = spec, ready, log
        self.proc: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 60.0) -> float:
        """Start it; returns the seconds until it was ready. Raises ``RuntimeError`` with the
        log's tail when it exits first, ``TimeoutError`` when it is not ready in time."""
        self.ready.unlink(missing_ok=True)
        t0 = time.monotonic()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module, "--spec", str(self.spec),
                 "--ready", str(self.ready)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL)
        proc = self.proc
        while not self.ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"{self.module} exited ({proc.returncode}):\n"
                                   + self.log.read_text()[-3000:])
            if time.monotonic() - t0 > timeout:
                self.kill()
                raise TimeoutError(f"{self.module} not serving after {timeout:.0f} s (log "
                                   f"{self.log})")
            time.sleep(0.05)
        return time.monotonic() - t0

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            self.proc.wait(30)

    def stop(self) -> int | None:
        """SIGTERM (a clean close), SIGKILL after 30 s; returns its exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        rc, self.proc = self.proc.returncode, None
        return rc


class ControllerProcess(ModuleProcess):
    """``python -m delivery.controller_host`` and a client of its ingress (the management
    plane's: the ``admin`` identity). ``config``: the ``ControllerConfig`` mapping
    (``pulsar_url``, ``store_url``, ...); the reply and ingress ports are fixed here, so a
    restarted controller is found where the crashed one was."""

    module = "delivery.controller_host"

    def __init__(self, tmp: Path, agents: Mapping[int, str], *,
                 security: Security | None = None, ingress_port: int, reply_port: int,
                 **config: Any) -> None:
        super().__init__(tmp / "controller-spec.json", tmp / "controller-ready.json",
                         tmp / "controller.log")
        security = security or Security()
        self.reply_port, self.ingress_port = reply_port, ingress_port
        self.spec.write_text(json.dumps(controller_spec(
            agents, ingress_port=self.ingress_port, reply_port=self.reply_port,
            security=security, **config)))
        self.channel = open_channel(f"127.0.0.1:{self.ingress_port}", security, "admin", [
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 500)])
        self.stub = pb_grpc.ControllerIngressStub(self.channel)

    @property
    def reply_address(self) -> str:
        return f"127.0.0.1:{self.reply_port}"

    def recovered(self) -> dict:
        return json.loads(self.ready.read_text())["recovered"]

    # both are called while the controller serves: wait_for_ready rides out a connection
    # attempt that timed out on a loaded machine (the TLS handshake behind other work)
    # instead of failing at once with UNAVAILABLE
    def status(self, timeout: float = 10.0) -> tuple[dict, dict[int, int]]:
        s = self.stub.Status(pb.StatusRequest(), timeout=timeout, wait_for_ready=True)
        return json.loads(s.stats_json), dict(s.channels)

    def set_channels(self, channels: Mapping[int, int],
                     hosts: Mapping[int, Iterable[int]], timeout: float = 60.0) -> Any:
        return self.stub.SetChannels(pb.ChannelsRequest(types=[
            pb.TypeChannel(type_id=t, channel=c, hosts=hosts.get(t, ()))
            for t, c in channels.items()]), timeout=timeout, wait_for_ready=True)

    def close(self) -> None:
        self.stop()
        self.channel.close()


class AgentHostProcess(ModuleProcess):
    """``python -m delivery.agent_host`` for a group of nodes (its spec written by
    :func:`delivery.agent_host.host_spec`)."""

    module = "delivery.agent_host"

    def __init__(self, workdir: Path, name: str, spec: dict) -> None:
        super().__init__(workdir / f"{name}-spec.json", workdir / f"{name}-ready.json",
                         workdir / f"{name}.log")
        self.nodes = [int(n) for n in spec["nodes"]]
        self.spec.write_text(json.dumps(spec))
