"""Network helpers shared by the policy server's launcher (:mod:`serving.local`), the
delivery runtime and testbed (:mod:`delivery`) and the tests: standard library only, so every
install group has them (``envs`` is the core package)."""

from __future__ import annotations

import re
import socket

__all__ = ["BROKER_ADDRESS", "CONTROLLER_ADDRESS", "MAX_NODE", "free_ports", "node_address",
           "principal_addresses"]

# The emulated network's address plan (delivery.netem): one /16, the controller and the broker
# first, then node n at 10.211.<1 + n // 250>.<1 + n % 250>. The development PKI names these
# addresses in its certificates, so TLS host names verify inside the emulated network.
CONTROLLER_ADDRESS = "10.211.0.2"
BROKER_ADDRESS = "10.211.0.3"
MAX_NODE = 250 * 254 - 1


def node_address(n: int) -> str:
    """The emulated-network address of compute node ``n``."""
    if not 0 <= n <= MAX_NODE:
        raise ValueError(f"node id {n} outside 0..{MAX_NODE} (the emulated address plan)")
    return f"10.211.{1 + n // 250}.{1 + n % 250}"


def principal_addresses(principal: str) -> list[str]:
    """The emulated-network addresses of a principal (``controller`` and ``policy-server``
    share the controller's namespace; ``agent-<n>`` is node n's)."""
    if principal in ("controller", "policy-server"):
        return [CONTROLLER_ADDRESS]
    if principal == "broker":
        return [BROKER_ADDRESS]
    m = re.fullmatch(r"agent-(\d+)", principal)
    if m and int(m.group(1)) <= MAX_NODE:
        return [node_address(int(m.group(1)))]
    return []


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
