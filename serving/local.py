"""A policy server on a free loopback port, in a subprocess (``serve.py``): started, awaited
until ready, killed or stopped by its process. Used by the end-to-end tests, the serving
benchmark and the delivery testbed.

Secure by default: the server serves HTTPS with the PKI's ``policy-server`` identity
(``security``, :class:`security.tls.Security`; the subprocess inherits ``$SMART_PKI_DIR``
and is told ``security.pki_dir`` if one is set), :attr:`LocalServer.url` is ``https://``, and
:attr:`LocalServer.verify` / :meth:`LocalServer.client` check it against the PKI's CA.
``Security(insecure=True)``: plain HTTP (the server warns). ``bundle_trust_keys``: the
bundle-signing public keys the server trusts beside the PKI's (``bundle_trust.keys``; None:
``configs/serve.yaml``'s, the committed example bundle's key)."""

from __future__ import annotations

import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from envs.netutil import free_ports
from security.tls import Security, client_ssl_context
from serving.access import write_key_file

__all__ = ["LocalServer"]

ROOT = Path(__file__).resolve().parents[1]


class LocalServer:
    """``python serve.py`` with ``bundle``, keys (``api_key``: one controller key or
    several; ``admin_key``, ``metrics_key``) and extra Hydra overrides; ``cpu`` pins it to
    those cores (``taskset``), ``log_dir`` keeps its stderr. The keys reach the server in
    key files of ``log_dir/keys`` (mode 600), never on its command line."""

    def __init__(self, bundle: str | Path | None, log_dir: str | Path, *,
                 api_key: str | Sequence[str], admin_key: str | Sequence[str] | None = None,
                 metrics_key: str | Sequence[str] | None = None,
                 port: int | None = None, overrides: list[str] | None = None,
                 cpu: str | None = None,
                 python_args: list[str] | None = None,
                 security: Security | None = None,
                 bundle_trust_keys: Sequence[str | Path] | None = None) -> None:
        self.bundle, self.log_dir = bundle, Path(log_dir)
        self.bundle_trust_keys = (None if bundle_trust_keys is None
                                  else [str(k) for k in bundle_trust_keys])
        self.api_key, self.admin_key, self.metrics_key = api_key, admin_key, metrics_key
        self.security = security if security is not None else Security()
        self.port = port or free_ports(1)[0]
        scheme = "http" if self.security.insecure else "https"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.overrides, self.cpu = list(overrides or []), cpu
        self.python_args = list(python_args or [])  # e.g. ["-c", launcher]
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None  # process start to ready, seconds
        self._verify: ssl.SSLContext | bool | None = None

    @property
    def log_file(self) -> Path:
        return self.log_dir / f"server-{self.port}.log"

    @property
    def verify(self) -> ssl.SSLContext | bool:
        """httpx's ``verify`` for this server: a context trusting the PKI's CA (False when
        insecure: plain HTTP)."""
        if self._verify is None:
            self._verify = (False if self.security.insecure else
                            client_ssl_context(self.security, expect="policy-server"))
        return self._verify

    def client(self, key: str | None = None, **kw: Any) -> httpx.Client:
        """A keep-alive client of this server verifying it (``key``: its ``X-API-Key``)."""
        headers = dict(kw.pop("headers", {}))
        if key is not None:
            headers["X-API-Key"] = key
        return httpx.Client(base_url=self.url, verify=self.verify, headers=headers, **kw)

    def _security_overrides(self) -> list[str]:
        sec = self.security
        out = [f"security.insecure={'true' if sec.insecure else 'false'}"]
        if sec.pki_dir is not None:
            out.append(f"security.pki_dir={sec.pki_dir}")
        if self.bundle_trust_keys is not None:
            out.append(f"bundle_trust.keys={_keys(self.bundle_trust_keys)}")
        return out

    def _key_overrides(self) -> list[str]:
        """``<role>_keys_file=<file>`` of each role's keys (written mode 600 under
        ``log_dir/keys``) and ``<role>_keys=[]`` (so the environment's do not add to them)."""
        kdir = self.log_dir / "keys"
        kdir.mkdir(mode=0o700, exist_ok=True)
        out = []
        for role, keys in (("api", self.api_key), ("admin", self.admin_key),
                           ("metrics", self.metrics_key)):
            items = [] if keys is None else [keys] if isinstance(keys, str) else list(keys)
            path = write_key_file(kdir / f"{role}_keys.{self.port}", items)
            out += [f"{role}_keys_file={_quoted(path)}", f"{role}_keys=[]"]
        return out

    def start(self, timeout_s: float = 60.0) -> LocalServer:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        verify = self.verify  # the PKI exists (created if a development one) before the child
        cmd = [sys.executable, *self.python_args, str(ROOT / "serve.py"), f"port={self.port}",
               f"bundle={self.bundle if self.bundle is not None else 'null'}",
               *self._key_overrides(), "watch=false", "log_level=warning",
               f"hydra.run.dir={self.log_dir / 'hydra'}",
               *self._security_overrides(), *self.overrides]
        if self.cpu is not None:
            cmd = ["taskset", "-c", self.cpu, *cmd]
        t0 = time.perf_counter()
        with open(self.log_file, "a") as err:  # the child keeps its own copy of the file
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/v1/health/ready", timeout=0.5,
                             verify=verify).status_code == 200:
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


def _quoted(s: str) -> str:
    """A Hydra override value: a quoted string (it may hold ``,`` or ``=``)."""
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _keys(keys: str | Sequence[str]) -> str:
    """A Hydra override value: a list of quoted strings."""
    items = [keys] if isinstance(keys, str) else list(keys)
    return "[" + ",".join(_quoted(k) for k in items) + "]"
