"""An emulated network with the DSMD model's capacities (SMART Section V-B, Eq. 1; the testbed
of Section VII-D made physical).

Every party of the testbed gets a Linux network namespace, joined by veth links to one
software switch (a bridge in a namespace of its own):

* ``<tag>-ctl``: the controller (and the policy server, on its loopback). The egress of its
  link is shaped to ``C_b`` (Eq. 1's second constraint): RPC pushes and MQ publishes share it.
* ``<tag>-brk``: the Pulsar broker. Its link is not shaped (the model has no broker capacity).
* ``<tag>-n<id>``: compute node ``id``. The switch's side of its link is shaped to ``s(n)``
  (Eq. 1's fifth constraint), so what a node receives, from the controller (RPC) and from the
  broker (every message of its topics, VITA's redundancy included), crosses it.
* ``<tag>-sw``: the switch.

What the kernel enforces and what user space does:

* bandwidth: the kernel's token bucket filter (``tc qdisc ... tbf``) on the sending side of a
  link; a queue of ``queue_ms`` at the shaped rate, then drops (TCP backs off);
* loss: nftables (``numgen random``) in the receiving namespace's ingress hook, per link;
* delay: user space (:mod:`delivery.relay`, a TCP relay that holds every chunk for the
  delay, transparently through an nftables redirect or towards a fixed target), because this
  kernel has no ``netem``;
* ``C_p`` (concurrent sends) is the controller's own limit on in-flight sends
  (``ControllerConfig.max_inflight_sends``), not a link property.

Namespaces are always removed: by :meth:`EmulatedNetwork.close` (also on an exception), by a
guard process that removes them when the creating process dies for any reason (SIGKILL
included), and by :func:`cleanup_stale`, which removes those of dead owners.

Agents of many nodes share a process: :func:`in_netns` moves the calling *thread* into a
node's namespace, and every socket that thread (or a thread it starts) creates belongs to
that namespace (``delivery.agent_host`` starts each node's agent this way).

CLI: ``python -m delivery.netem list|cleanup|measure``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import itertools
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from envs.netutil import BROKER_ADDRESS, CONTROLLER_ADDRESS, node_address, principal_addresses
from harness.broker import _pid_alive as _alive

__all__ = [
    "BROKER_ADDRESS",
    "CONTROLLER_ADDRESS",
    "EmulatedNetwork",
    "NetemError",
    "NetworkSpec",
    "QueueMonitor",
    "available",
    "backlog_drops",
    "cleanup_stale",
    "controller_qdisc",
    "in_netns",
    "measure_loss",
    "measure_relay_rtt",
    "measure_throughput",
    "node_address",
    "principal_addresses",
    "switch_counters",
]

log = logging.getLogger(__name__)

NETNS_DIR = Path("/var/run/netns")
_CLONE_NEWNET = 0x40000000
PREFIX = "smt"                      # every namespace of ours: smt<owner pid>x<n>-<party>
_NAME = re.compile(rf"^{PREFIX}(\d+)x(\d+)-(sw|ctl|brk|n\d+)$")



class NetemError(RuntimeError):
    """The emulated network could not be built, measured or removed (names the step)."""


def _check_node(n: int) -> str:
    try:
        return node_address(n)
    except ValueError as e:
        raise NetemError(str(e)) from None


def available() -> str | None:
    """None if this process can build an emulated network, else why not."""
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) for network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (iproute2)"
    return None


def _sh(args: Sequence[str], stdin: str | None = None, check: bool = True) -> str:
    out = subprocess.run(list(args), input=stdin, capture_output=True, text=True, check=False)
    if check and out.returncode != 0:
        cmd = " ".join(args)
        raise NetemError(f"`{cmd}` failed ({out.returncode}): {out.stderr.strip()[:2000]}")
    return out.stdout


# ---------------------------------------------------------------------------- threads
@contextlib.contextmanager
def in_netns(name: str) -> Iterator[None]:
    """Run the body with the calling thread in namespace ``name`` (sockets created meanwhile,
    and threads started meanwhile, belong to it); the thread's namespace is restored after."""
    libc = ctypes.CDLL(None, use_errno=True)
    here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(NETNS_DIR / name, os.O_RDONLY)
    except OSError as e:
        os.close(here)
        raise NetemError(f"no network namespace {name!r}: {e}") from None
    try:
        if libc.setns(target, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise NetemError(f"setns({name}): {os.strerror(err)}")
        try:
            yield
        finally:
            if libc.setns(here, _CLONE_NEWNET) != 0:
                raise NetemError(f"cannot restore the thread's namespace after {name}")
    finally:
        os.close(target)
        os.close(here)


# ---------------------------------------------------------------------------- spec
@dataclass
class NetworkSpec:
    """What to emulate. Rates in bit/s on the wire (None: not shaped); ``node_bps`` is one
    rate for every node or a mapping node -> rate; ``loss`` applies to the links into the
    nodes (nftables). Delay is added by :mod:`delivery.relay`."""

    nodes: list[int]
    controller_bps: float | None = None
    node_bps: float | Mapping[int, float] | None = None
    loss: float = 0.0
    queue_ms: float = 200.0
    tag: str = ""

    def __post_init__(self) -> None:
        self.nodes = [int(n) for n in self.nodes]
        if len(set(self.nodes)) != len(self.nodes):
            raise NetemError("network: node ids must be distinct")
        for n in self.nodes:
            _check_node(n)
        rates = [self.controller_bps]
        rates += list(self.node_bps.values()) if isinstance(self.node_bps, Mapping) \
            else [self.node_bps]
        for r in rates:
            if r is not None and not r > 0:
                raise NetemError(f"network: rates must be positive bit/s, got {r!r}")
        if not 0.0 <= self.loss < 1.0:
            raise NetemError(f"network: loss must be in [0, 1), got {self.loss!r}")
        if not self.queue_ms > 0:
            raise NetemError(f"network: queue_ms must be positive, got {self.queue_ms!r}")

    def rate_of(self, n: int) -> float | None:
        if isinstance(self.node_bps, Mapping):
            return self.node_bps.get(n)
        return self.node_bps


_tags = itertools.count(1)


def _new_tag() -> str:
    return f"{PREFIX}{os.getpid()}x{next(_tags)}"


@dataclass
class EmulatedNetwork:
    """The namespaces, links and limits of a :class:`NetworkSpec` (a context manager)."""

    spec: NetworkSpec
    tag: str = ""
    _guard: subprocess.Popen | None = field(default=None, repr=False)
    _ifaces: dict[int, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.tag = self.spec.tag or _new_tag()
        if not _NAME.match(f"{self.tag}-sw"):
            raise NetemError(f"network tag {self.tag!r}: expected {PREFIX}<pid>x<n>")

    # names
    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    @property
    def controller(self) -> str:
        return f"{self.tag}-ctl"

    @property
    def broker(self) -> str:
        return f"{self.tag}-brk"

    def node(self, n: int) -> str:
        return f"{self.tag}-n{n}"

    def namespaces(self) -> list[str]:
        return [self.switch, self.controller, self.broker] + [self.node(n)
                                                               for n in self.spec.nodes]

    def exec_prefix(self, ns: str) -> list[str]:
        """The command prefix that runs a program in namespace ``ns``."""
        return ["ip", "netns", "exec", ns]

    def switch_port(self, party: str) -> str:
        """The switch's interface of a party (``ctl``, ``brk`` or a node id)."""
        return self._ifaces[-1] if party == "ctl" else self._ifaces[-2] if party == "brk" \
            else self._ifaces[int(party)]

    # life cycle
    def create(self) -> EmulatedNetwork:
        why = available()
        if why:
            raise NetemError(f"emulated network: {why}")
        cleanup_stale()
        _neighbour_room(len(self.spec.nodes) + 3)
        _backlog_room(len(self.spec.nodes) + 3)
        self._start_guard()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _start_guard(self) -> None:
        self._guard = subprocess.Popen(
            [sys.executable, "-m", "delivery.netem", "guard", "--tag", self.tag],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, cwd=Path(__file__).resolve().parents[1])

    def _build(self) -> None:
        sp = self.spec
        parties: list[tuple[str, str, str]] = [  # (namespace, address, switch port)
            (self.controller, CONTROLLER_ADDRESS, "pctl"), (self.broker, BROKER_ADDRESS, "pbrk")]
        for i, n in enumerate(sp.nodes):
            parties.append((self.node(n), node_address(n), f"p{i}"))
            self._ifaces[n] = f"p{i}"
        self._ifaces[-1], self._ifaces[-2] = "pctl", "pbrk"
        root = [f"netns add {self.switch}"] + [f"netns add {ns}" for ns, _, _ in parties]
        root += [f"link add eth0 netns {ns} type veth peer name {port} netns {self.switch}"
                 for ns, _, port in parties]
        _sh(["ip", "-batch", "-"], "\n".join(root) + "\n")
        sw = ["link set lo up", "link add br0 type bridge stp_state 0 forward_delay 0",
              "link set br0 up"]
        sw += [f"link set {port} master br0 up" for _, _, port in parties]
        _sh(["ip", "-n", self.switch, "-batch", "-"], "\n".join(sw) + "\n")
        for ns, addr, _ in parties:
            _sh(["ip", "-n", ns, "-batch", "-"],
                f"link set lo up\naddr add {addr}/16 dev eth0\nlink set eth0 up\n")
        # bandwidth: the controller's egress (inside its namespace), each node's ingress (the
        # switch's port towards it)
        if sp.controller_bps:
            _sh(["tc", "-n", self.controller, "qdisc", "add", "dev", "eth0", "root",
                 *_tbf(sp.controller_bps, sp.queue_ms)])
        lines = [f"qdisc add dev {self._ifaces[n]} root {' '.join(_tbf(r, sp.queue_ms))}"
                 for n in sp.nodes if (r := sp.rate_of(n))]
        if lines:
            _sh(["tc", "-n", self.switch, "-batch", "-"], "\n".join(lines) + "\n")
        if sp.loss > 0:
            for n in sp.nodes:
                set_loss(self.node(n), sp.loss)
        log.info("emulated network %s: %d nodes; C_b %s, s(n) %s, loss %.3g%%", self.tag,
                 len(sp.nodes), _fmt(sp.controller_bps), _fmt(sp.node_bps), 100 * sp.loss)

    def close(self) -> None:
        remove_namespaces(self.namespaces())
        if self._guard is not None:
            with contextlib.suppress(OSError, ValueError):
                assert self._guard.stdin is not None
                self._guard.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._guard.wait(10)
            self._guard = None

    def __enter__(self) -> EmulatedNetwork:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # observation
    def port_counters(self) -> dict[str, dict[str, int]]:
        return switch_counters(self.tag)

    def describe(self) -> dict[str, object]:
        sp = self.spec
        return {"tag": self.tag, "nodes": len(sp.nodes), "controller_bps": sp.controller_bps,
                "node_bps": sp.node_bps if not isinstance(sp.node_bps, Mapping)
                else "per node", "loss": sp.loss, "queue_ms": sp.queue_ms,
                "enforced_by": {"bandwidth": "kernel tbf", "loss": "nftables",
                                "delay": "user-space relay", "C_p": "controller"}}


def _qdiscs(ns: str) -> dict[str, dict[str, int]]:
    out = json.loads(_sh(["tc", "-n", ns, "-s", "-j", "qdisc", "show"]) or "[]")
    return {q["dev"]: {"bytes": int(q.get("bytes", 0)), "drops": int(q.get("drops", 0)),
                       "overlimits": int(q.get("overlimits", 0)),
                       "backlog": int(q.get("backlog", 0)),
                       "rate_Bps": int(q.get("options", {}).get("rate", 0))}
            for q in out if q.get("kind") == "tbf"}


class QueueMonitor:
    """Samples every shaped link's queue (the token bucket's backlog) every ``period_s`` on
    a thread, as queueing delay: backlog / rate. :meth:`summary` gives, for the
    controller's link and for the worst node link at each sample, the p95 and maximum
    queueing delay in ms (how long a packet arriving then waited before its link)."""

    def __init__(self, tag: str, period_s: float = 0.25) -> None:
        self.tag, self.period = tag, period_s
        self.controller_ms: list[float] = []
        self.nodes_ms: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="queue-monitor", daemon=True)

    def start(self) -> QueueMonitor:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                c = _qdiscs(f"{self.tag}-ctl").get("eth0")
                sw = _qdiscs(f"{self.tag}-sw")
            except (NetemError, ValueError):  # the network went away: stop sampling
                return
            if c and c["rate_Bps"]:
                self.controller_ms.append(1e3 * c["backlog"] / c["rate_Bps"])
            worst = max((1e3 * q["backlog"] / q["rate_Bps"] for dev, q in sw.items()
                         if dev.startswith("p") and dev[1:].isdigit() and q["rate_Bps"]),
                        default=0.0)
            self.nodes_ms.append(worst)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(5)
        return self.summary()

    def summary(self) -> dict[str, float]:
        def stats(xs: list[float], name: str) -> dict[str, float]:
            if not xs:
                return {}
            v = sorted(xs)
            return {f"{name}_queue_p95_ms": v[min(len(v) - 1, int(0.95 * len(v)))],
                    f"{name}_queue_max_ms": v[-1]}

        return {**stats(self.controller_ms, "link_controller"),
                **stats(self.nodes_ms, "link_nodes")}


def switch_counters(tag: str) -> dict[str, dict[str, int]]:
    """Per switch port (``p<i>``: towards the i-th node, ``pctl``, ``pbrk``): bytes sent
    towards its party (``tx``) and received, and its token bucket's drops and overlimits
    (packets that had to wait: the link queued)."""
    sw = f"{tag}-sw"
    links = json.loads(_sh(["ip", "-n", sw, "-s", "-j", "link", "show"]))
    q = _qdiscs(sw)
    return {ln["ifname"]: {"tx": int(ln["stats64"]["tx"]["bytes"]),
                           "rx": int(ln["stats64"]["rx"]["bytes"]),
                           "drops": q.get(ln["ifname"], {}).get("drops", 0),
                           "overlimits": q.get(ln["ifname"], {}).get("overlimits", 0)}
            for ln in links if ln["ifname"] not in ("lo", "br0")}


def controller_qdisc(tag: str) -> dict[str, int]:
    """The controller's shaped egress: bytes, drops, overlimits, backlog and its rate
    (``rate_Bps``, bytes/s); zeros if unshaped."""
    return _qdiscs(f"{tag}-ctl").get("eth0", {"bytes": 0, "drops": 0, "overlimits": 0,
                                             "backlog": 0, "rate_Bps": 0})


def set_controller_rate(tag: str, rate_bps: float, queue_ms: float) -> None:
    """Change C_b, the rate of the controller's shaped egress, in place (its token bucket,
    the same burst rule and queue as when the network was built)."""
    _sh(["tc", "-n", f"{tag}-ctl", "qdisc", "change", "dev", "eth0", "root",
         *_tbf(rate_bps, queue_ms)])


def _neighbour_room(parties: int) -> None:
    """Make room in the kernel's neighbour (ARP) table, which all namespaces share: the
    controller's and the broker's namespaces each learn every party's address, so the
    default ``gc_thresh3`` of 1,024 overflows near 500 nodes ("neighbor table overflow",
    and connections to the broker time out). The thresholds are only ever raised."""
    need = 8 * parties + 1024
    base = Path("/proc/sys/net/ipv4/neigh/default")
    for name, value in (("gc_thresh3", need), ("gc_thresh2", need * 3 // 4),
                        ("gc_thresh1", need // 4)):
        f = base / name
        try:
            if int(f.read_text()) < value:
                f.write_text(str(value))
                log.info("raised net.ipv4.neigh.default.%s to %d for %d parties", name, value,
                         parties)
        except OSError as e:
            raise NetemError(f"cannot raise net.ipv4.neigh.default.{name} to {value} "
                             f"({e}): the neighbour table would overflow") from None


def _backlog_room(parties: int) -> None:
    """Make room in the kernel's per-CPU input queue (``net.core.netdev_max_backlog``), which
    every veth link feeds: with the default 1,000 packets, a burst towards hundreds of nodes
    on a busy machine (the softirq that empties it runs late) overflows it, and the packets
    are dropped before any emulated link sees them, a loss the network does not model (TCP
    waits for a retransmission timeout, a UDP datagram is gone). The limit is only ever
    raised; :func:`backlog_drops` counts what it drops all the same."""
    need = 100 * parties + 1000
    f = Path("/proc/sys/net/core/netdev_max_backlog")
    try:
        if int(f.read_text()) < need:
            f.write_text(str(need))
            log.info("raised net.core.netdev_max_backlog to %d for %d parties", need, parties)
    except OSError as e:
        raise NetemError(f"cannot raise net.core.netdev_max_backlog to {need} ({e}): "
                         "bursts would be dropped outside the emulated links") from None


def backlog_drops() -> int:
    """Packets the kernel dropped so far because a CPU's input queue was full (the second
    column of ``/proc/net/softnet_stat``, summed over the CPUs; the kernel's, not one
    namespace's); 0 where the file is missing."""
    try:
        rows = Path("/proc/net/softnet_stat").read_text().split("\n")
    except OSError:
        return 0
    return sum(int(r.split()[1], 16) for r in rows if len(r.split()) > 1)


def _tbf(rate_bps: float, queue_ms: float) -> list[str]:
    """``tbf`` arguments: the rate, a burst of at least 2 full frames (and about 4 ms of
    rate), and a queue of ``queue_ms`` at that rate."""
    burst = max(2 * 1514 * 2, int(rate_bps / 8 * 0.004))
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency",
            f"{queue_ms:g}ms"]


def _fmt(r: object) -> str:
    if r is None:
        return "unshaped"
    if isinstance(r, int | float):
        return f"{r / 1e6:.3g} Mbit/s"
    return "per node"


def set_loss(ns: str, loss: float) -> None:
    """Drop each packet arriving in namespace ``ns`` with probability ``loss`` (nftables
    ``numgen random`` in the ingress hook of its ``eth0``); replaces an earlier setting, and
    0 removes it."""
    if shutil.which("nft") is None:
        raise NetemError("loss needs nftables (`nft`; Debian package nftables)")
    per_million = round(loss * 1_000_000)
    rules = (f"table netdev smt_loss {{\n chain ingress {{\n  type filter hook ingress device "
             f"eth0 priority 0; policy accept;\n  numgen random mod 1000000 < {per_million} "
             f"drop\n }}\n}}\n")
    _sh(["ip", "netns", "exec", ns, "nft", "delete", "table", "netdev", "smt_loss"],
        check=False)
    if loss > 0:
        _sh(["ip", "netns", "exec", ns, "nft", "-f", "-"], rules)


# ---------------------------------------------------------------------------- clean-up
def list_namespaces(owner: int | None = None) -> list[str]:
    """Our namespaces (``smt<owner pid>x<n>-<party>``), or only those process ``owner``
    made."""
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.glob(f"{PREFIX}*")
                  if (m := _NAME.match(p.name)) and (owner is None or int(m.group(1)) == owner))


def remove_namespaces(names: Sequence[str]) -> None:
    """Kill the processes left in each namespace, then delete it (its veth links go too)."""
    for ns in names:
        if not (NETNS_DIR / ns).exists():
            continue
        pids = _sh(["ip", "netns", "pids", ns], check=False).split()
        for p in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(p), signal.SIGKILL)
        _sh(["ip", "netns", "del", ns], check=False)


def cleanup_stale(tag: str | None = None) -> list[str]:
    """Remove our namespaces whose owner process is gone (or all of ``tag``'s)."""
    gone = []
    for ns in list_namespaces():
        m = _NAME.match(ns)
        assert m is not None
        if (tag is not None and ns.startswith(tag + "-")) or (tag is None
                                                               and not _alive(int(m.group(1)))):
            gone.append(ns)
    remove_namespaces(gone)
    return gone


def _guard(tag: str) -> None:
    """Wait until the owner closes our stdin (or dies), then remove ``tag``'s namespaces."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        sys.stdin.buffer.read()
    cleanup_stale(tag)


# ---------------------------------------------------------------------------- measuring
_RECEIVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", {port})); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; first = last = None
while (d := c.recv(1 << 16)):
    now = time.monotonic(); first = first or now; last = now; n += len(d)
print(n, (last or 0) - (first or 0), flush=True)
"""

_SENDER = """
import socket, time
c = socket.create_connection(("{host}", {port})); buf = b"x" * (1 << 16)
end = time.monotonic() + {seconds}
while time.monotonic() < end:
    c.sendall(buf)
c.shutdown(socket.SHUT_WR); c.recv(1)
"""


def measure_throughput(net: EmulatedNetwork, src_ns: str, dst_ns: str, dst_host: str,
                       seconds: float = 3.0, port: int = 5201) -> float:
    """An iperf-style TCP transfer from ``src_ns`` to ``dst_host`` in ``dst_ns`` for
    ``seconds``: goodput in bit/s (payload bytes over the time from first to last byte).
    TCP/IP headers are not counted, so a link shaped to R carries about 0.95 R of goodput
    with 1500-byte frames."""
    recv = subprocess.Popen([*net.exec_prefix(dst_ns), sys.executable, "-c",
                             _RECEIVER.format(port=port)], stdout=subprocess.PIPE, text=True)
    try:
        assert recv.stdout is not None
        if recv.stdout.readline().strip() != "ready":
            raise NetemError(f"receiver in {dst_ns} did not start")
        _sh([*net.exec_prefix(src_ns), sys.executable, "-c",
             _SENDER.format(host=dst_host, port=port, seconds=seconds)])
        n, dur = recv.stdout.readline().split()
    finally:
        recv.kill()
        recv.wait()
    return int(n) * 8 / max(float(dur), 1e-9)


SO_RCVBUFFORCE = 33  # <asm-generic/socket.h>: SO_RCVBUF past net.core.rmem_max (root)
SO_RXQ_OVFL = 40  # <asm-generic/socket.h>: the count of datagrams the socket dropped


def measure_loss(net: EmulatedNetwork, src_ns: str, dst_ns: str, dst_host: str,
                 packets: int = 20000, port: int = 5202) -> float:
    """The fraction of ``packets`` UDP datagrams sent from ``src_ns`` that did not arrive.
    The sender ends with 200 end markers (one of them arrives unless nearly everything is
    lost); the receiver counts the datagrams before the first marker, and gives up after
    30 s without any (the sender is a new interpreter, slow on a loaded machine, and may be
    descheduled for a while: a gap is not the end). The receiver's buffer holds every
    datagram (``SO_RCVBUFFORCE``, past ``net.core.rmem_max``: the network needs root
    anyway), so a receiver descheduled on a loaded machine does not drop them itself and
    read as loss; any it drops all the same (``SO_RXQ_OVFL``'s count) are not counted as
    lost."""
    recv_code = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                 f"s.setsockopt(socket.SOL_SOCKET, {SO_RCVBUFFORCE}, {max(packets, 1000) * 2048}); "
                 f"s.setsockopt(socket.SOL_SOCKET, {SO_RXQ_OVFL}, 1); "
                 f"s.bind(('0.0.0.0', {port})); s.settimeout(30.0); print('ready', flush=True)\n"
                 "n = drops = 0\ntry:\n    while True:\n"
                 "        data, anc, _, _ = s.recvmsg(2048, 64)\n"
                 "        for level, kind, d in anc:\n"
                 f"            if level == socket.SOL_SOCKET and kind == {SO_RXQ_OVFL}:\n"
                 "                drops = int.from_bytes(d[:4], 'little')\n"
                 "        if data == b'end':\n            break\n        n += 1\n"
                 "except TimeoutError:\n    pass\nprint(n, drops, flush=True)\n")
    send_code = ("import socket, time; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                 f"for i in range({packets}):\n    s.sendto(b'x' * 200, ('{dst_host}', {port}))\n"
                 "    time.sleep(0.001) if i % 20 == 0 else None\n"
                 "for i in range(200):\n"
                 f"    s.sendto(b'end', ('{dst_host}', {port})); time.sleep(0.001)\n")
    recv = subprocess.Popen([*net.exec_prefix(dst_ns), sys.executable, "-c", recv_code],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert recv.stdout is not None
        if recv.stdout.readline().strip() != "ready":
            raise NetemError(f"receiver in {dst_ns} did not start")
        dropped0 = backlog_drops()
        _sh([*net.exec_prefix(src_ns), sys.executable, "-c", send_code])
        got, overflowed = map(int, recv.stdout.readline().split())
        dropped = backlog_drops() - dropped0
    finally:
        recv.kill()
        recv.wait()
    # datagrams the receiving socket itself dropped (its queue full) are not the link's, and
    # neither are those the kernel's input queue dropped before the link's loss (a busy
    # machine; counted for the whole kernel, so other traffic's drops make this read low)
    return 1.0 - (got + overflowed) / max(packets - dropped, 1)


def measure_relay_rtt(net: EmulatedNetwork, node: int, delay_ms: float, rounds: int = 20,
                      port: int = 7301) -> float:
    """The median round trip (s) of 1-byte requests from the controller's namespace to an
    echo server on ``node``, through a :mod:`delivery.relay` relay (towards that server)
    adding ``delay_ms`` each way: about ``2 * delay_ms`` plus the path's own time."""
    from .relay import RelayProcess

    with in_netns(net.node(node)):
        srv = socket.create_server((node_address(node), 0))
    target = (node_address(node), srv.getsockname()[1])

    def echo() -> None:
        c, _ = srv.accept()
        while data := c.recv(100):
            c.sendall(data)
        c.close()

    threading.Thread(target=echo, daemon=True).start()
    rtts = []
    try:
        with RelayProcess(net.exec_prefix(net.controller), port, delay_ms, target=target):
            with in_netns(net.controller):
                c = socket.create_connection((CONTROLLER_ADDRESS, port))
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with c:
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    c.sendall(b"x")
                    if c.recv(10) != b"x":
                        raise NetemError("the relay's echo came back wrong")
                    rtts.append(time.perf_counter() - t0)
    finally:
        srv.close()
    return sorted(rtts)[len(rtts) // 2]


def spec_from_mapping(m: Mapping[str, object], nodes: Sequence[int]) -> NetworkSpec:
    """A :class:`NetworkSpec` from a configuration mapping (unknown keys are an error)."""
    known = {f.name for f in dataclasses.fields(NetworkSpec)} - {"nodes", "tag"}
    unknown = sorted(set(m) - known)
    if unknown:
        raise NetemError(f"network: unknown key(s) {unknown}; known: {sorted(known)}")
    return NetworkSpec(list(nodes), **m)  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m delivery.netem",
                                 description="the testbed's emulated network")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="our namespaces and whether their owner is alive")
    c = sub.add_parser("cleanup", help="remove namespaces of dead owners (--all: every one)")
    c.add_argument("--all", action="store_true")
    g = sub.add_parser("guard", help=argparse.SUPPRESS)
    g.add_argument("--tag", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "guard":
        _guard(args.tag)
        return 0
    if args.cmd == "list":
        for ns in list_namespaces():
            m = _NAME.match(ns)
            assert m is not None
            print(ns, "owner alive" if _alive(int(m.group(1))) else "stale")
        return 0
    if args.all:
        gone = list_namespaces()
        remove_namespaces(gone)
    else:
        gone = cleanup_stale()
    print(f"removed {len(gone)} namespace(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
