"""A policy server on a free loopback port, in a subprocess (``serve.py``): started, awaited
until ready, killed or stopped by its process. Used by the end-to-end tests, the serving
benchmark and the delivery testbed."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from envs.netutil import free_ports

__all__ = ["LocalServer"]

ROOT = Path(__file__).resolve().parents[1]


class LocalServer:
    """``python serve.py`` with ``bundle``, keys and extra Hydra overrides; ``cpu`` pins it
    to those cores (``taskset``), ``log_dir`` keeps its stderr."""

    def __init__(self, bundle: str | Path | None, log_dir: str | Path, *, api_key: str,
                 admin_key: str | None = None, port: int | None = None,
                 overrides: list[str] | None = None, cpu: str | None = None,
                 python_args: list[str] | None = None) -> None:
        self.bundle, self.log_dir = bundle, Path(log_dir)
        self.api_key, self.admin_key = api_key, admin_key
        self.port = port or free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.overrides, self.cpu = list(overrides or []), cpu
        self.python_args = list(python_args or [])  # e.g. ["-c", launcher]
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None  # process start to ready, seconds

    @property
    def log_file(self) -> Path:
        return self.log_dir / f"server-{self.port}.log"

    def start(self, timeout_s: float = 60.0) -> LocalServer:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, *self.python_args, str(ROOT / "serve.py"), f"port={self.port}",
               f"bundle={self.bundle if self.bundle is not None else 'null'}",
               f"api_keys={self.api_key}", f"admin_keys={self.admin_key or ''}",
               "watch=false", "log_level=warning", f"hydra.run.dir={self.log_dir / 'hydra'}",
               *self.overrides]
        if self.cpu is not None:
            cmd = ["taskset", "-c", self.cpu, *cmd]
        t0 = time.perf_counter()
        with open(self.log_file, "a") as err:  # the child keeps its own copy of the file
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/v1/health/ready", timeout=0.5).status_code == 200:
                    self.start_s = time.perf_counter() - t0
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve.py exited with {self.proc.returncode}:\n"
                                   f"{self.log_file.read_text()[-3000:]}")
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"serve.py not ready within {timeout_s} s (log: {self.log_file})")

    def kill(self) -> None:
        """SIGKILL: the crash case (no shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
