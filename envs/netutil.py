"""Network helpers shared by the policy server's launcher (:mod:`serving.local`), the
delivery runtime and testbed (:mod:`delivery`) and the tests: standard library only, so every
install group has them (``envs`` is the core package)."""

from __future__ import annotations

import socket

__all__ = ["free_ports"]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that were free on ``host`` a moment ago (bound together,
    so they differ, then released; another process may take one before the caller does)."""
    if count < 0:
        raise ValueError(f"free_ports: count must be >= 0, got {count}")
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
