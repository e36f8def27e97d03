"""A multi-node Ray cluster on loopback for tests: a head and worker nodes, each a real
``ray start`` process tree with its own CPUs, custom resource and ports, stopped (every
process of the cluster, found by its GCS address and its temp dir) however the test ends."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from envs.netutil import free_ports

RAY = str(Path(sys.executable).parent / "ray")


@dataclass
class RayCluster:
    address: str  # host:port of the head's GCS (``ray.address`` / ``RAY_ADDRESS``)
    temp_dir: Path
    env: dict[str, str]  # the environment a client of the cluster needs (its auth token)
    nodes: list[dict] = field(default_factory=list)  # what each ``ray start`` was given

    def processes(self) -> list[int]:
        """The pids of the cluster's processes (GCS, raylets, agents, workers): every process
        whose command line names its GCS address or its temp dir."""
        port = self.address.rsplit(":", 1)[1]
        marks = (self.address, f"--gcs_server_port={port}", str(self.temp_dir))
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if any(m in cmd for m in marks):
                out.append(int(d.name))
        return out

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.processes()
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 10
            while pids and time.monotonic() < deadline:
                pids = [p for p in pids if Path(f"/proc/{p}").exists()
                        and not _zombie(p)]
                time.sleep(0.2)
            if not pids:
                return


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True


def _start(args: list[str], env: dict[str, str]) -> None:
    r = subprocess.run([RAY, "start", *args], env=env, capture_output=True, text=True,
                       timeout=180, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"ray start {' '.join(args)} failed ({r.returncode}):\n"
                           f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


@contextlib.contextmanager
def ray_cluster(worker_cpus: list[int], head_cpus: int = 1) -> Iterator[RayCluster]:
    """A head with ``head_cpus`` CPUs and one worker node per entry of ``worker_cpus``, on
    127.0.0.1; custom resources ``head`` and ``worker<i>`` name the nodes."""
    # a short temp dir: Ray's unix sockets live under it (a path limit of ~107 bytes)
    temp = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))
    # token authentication, as a shared cluster has it: every node and client the same token
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env.pop("RAY_ADDRESS", None)
    ports = iter(free_ports(1 + 5 * (1 + len(worker_cpus))))
    cluster = RayCluster(address=f"127.0.0.1:{next(ports)}", temp_dir=temp, env=env)
    common = ["--node-ip-address=127.0.0.1", "--num-gpus=0", "--disable-usage-stats"]
    try:
        for i, cpus in enumerate([head_cpus, *worker_cpus]):
            name = "head" if i == 0 else f"worker{i}"
            own = [f"--num-cpus={cpus}", f"--resources={json.dumps({name: 1})}",
                   f"--node-manager-port={next(ports)}", f"--object-manager-port={next(ports)}",
                   f"--dashboard-agent-listen-port={next(ports)}",
                   f"--dashboard-agent-grpc-port={next(ports)}",
                   f"--metrics-export-port={next(ports)}"]
            where = ([f"--port={cluster.address.rsplit(':', 1)[1]}", "--head",
                      "--include-dashboard=false", f"--temp-dir={temp}"] if i == 0
                     else [f"--address={cluster.address}"])
            _start([*where, *common, *own], env)
            cluster.nodes.append({"name": name, "cpus": cpus})
        _wait_nodes(cluster, 1 + len(worker_cpus), env)
        yield cluster
    finally:
        cluster.stop()


_COUNT_NODES = """
import sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
deadline, n = time.monotonic() + float(sys.argv[3]), 0
while time.monotonic() < deadline:
    n = sum(1 for x in ray.nodes() if x["Alive"])
    if n >= int(sys.argv[2]):
        break
    time.sleep(0.5)
print(n)
"""


def _wait_nodes(cluster: RayCluster, n: int, env: dict[str, str], timeout: float = 60) -> None:
    r = subprocess.run([sys.executable, "-c", _COUNT_NODES, cluster.address, str(n),
                        str(timeout)], env=env, capture_output=True, text=True,
                       timeout=timeout + 120, check=False)
    seen = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else "?"
    if seen != "?" and int(seen) >= n:
        return
    raise RuntimeError(f"the Ray cluster at {cluster.address} has {seen} of {n} nodes alive "
                       f"after {timeout:.0f} s: {r.stderr[-2000:]}")
