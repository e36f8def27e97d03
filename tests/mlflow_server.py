"""A real ``mlflow server`` on a free loopback port for the tests: a SQL (SQLite) backend
store, a proxied artifact root (``--artifacts-destination``: clients read and write
artifacts through the server, as on a shared server), started in its own process group and
killed with it on the way out, failure included."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from envs.netutil import free_ports

__all__ = ["MlflowServer", "mlflow_server"]


@dataclass
class MlflowServer:
    url: str
    root: Path
    proc: subprocess.Popen

    @property
    def log(self) -> str:
        return (self.root / "server.log").read_text(errors="replace")


@contextlib.contextmanager
def mlflow_server(root: Path, timeout_s: float = 180.0) -> Iterator[MlflowServer]:
    """``mlflow server`` with its database and artifacts under ``root``, up and answering
    ``/health`` (importing MLflow's server takes tens of seconds on a small machine)."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_ports(1)[0]
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
           "--artifacts-destination", str(root / "artifacts")]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    with open(root / "server.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=root, env=env,
                                start_new_session=True)
    server = MlflowServer(f"http://127.0.0.1:{port}", root, proc)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(server.url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {proc.returncode}:\n"
                                   f"{server.log[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server not up after {timeout_s:.0f} s:\n"
                                   f"{server.log[-3000:]}")
            time.sleep(0.5)
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)
        with contextlib.suppress(ProcessLookupError):  # workers left in the group
            os.killpg(proc.pid, signal.SIGKILL)
