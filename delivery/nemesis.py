"""The fault-injection soak's nemesis (in the manner of Jepsen): a seeded schedule of faults
over the emulated network (:mod:`delivery.netem`) and the delivery plane's processes, and the
network faults themselves.

Fault kinds (``KINDS``):

* ``broker_kill``: the Pulsar broker's JVM SIGKILLed, started again (same data) at the heal;
* ``controller_kill``: the controller process SIGKILLed, restarted with the same spec (it
  recovers its channels, subscriptions and unconfirmed outbox from the metadata store);
* ``agents_kill``: one agent-host process (a group of nodes) SIGKILLed, restarted (its
  agents recover from their programming records);
* ``partition_nodes``: the controller cut off from a subset of nodes, both ways (nftables in
  each node's namespace drops every packet from and to the controller's address);
* ``partition_broker``: the controller cut off from the broker (nftables in the controller's
  namespace);
* ``loss``: a share of the packets into a subset of nodes dropped (nftables ``numgen``);
* ``slow_link``: a subset of nodes' links throttled (kernel ``tbf`` at a few hundred kbit/s
  with a 2 s queue): queueing delay and, past the queue, drops;
* ``disk_full``: the filesystem under the controller's outbox (a tmpfs of its own) filled
  to the last few KiB;
* ``channel_switch``: one message type moved to its other channel (RPC <-> a topic) through
  the ingress, at once (no heal).

:func:`schedule` draws every kind once in a seeded order, then kinds at random; faults start
at exponential gaps, last a uniform duration, overlap (at most ``max_concurrent`` at a time,
never two of a kind), and all are healed by the end of the load. :class:`Nemesis` carries a
schedule out: each party's injections and heals in order on a worker of its own, so a slow
restart delays only what comes after it on the same party (a broker restart can wait for
the heal of a partition that keeps it from answering).
"""

from __future__ import annotations

import random
import subprocess
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from envs.netutil import BROKER_ADDRESS, CONTROLLER_ADDRESS

from .netem import _sh, _tbf, set_loss

__all__ = ["KINDS", "Fault", "Nemesis", "heal_network", "inject_network", "party_of",
           "schedule"]

KINDS = ("broker_kill", "controller_kill", "agents_kill", "partition_nodes",
         "partition_broker", "loss", "slow_link", "disk_full", "channel_switch")
INSTANT = frozenset({"channel_switch"})
NETWORK = frozenset({"partition_nodes", "partition_broker", "loss", "slow_link"})
NODE_FAULTS = frozenset({"partition_nodes", "loss", "slow_link"})     # on a subset of nodes
HEAL_FIRST = NETWORK | {"disk_full"}      # at the end, healed before any party restarts


@dataclass
class Fault:
    """One scheduled fault; the times it was injected and healed (seconds from the start of
    the load) are filled in by the soak."""

    kind: str
    start_s: float
    duration_s: float
    nodes: tuple[int, ...] = ()       # the nodes it touches (network faults)
    group: int = 0                    # the agent host (agents_kill) or type (channel_switch)
    level: float = 0.0                # loss share, or slow_link's rate in kbit/s
    injected_s: float | None = None
    healed_s: float | None = None     # when the heal finished (a restart: serving again)
    recovery_s: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["nodes"] = list(self.nodes)
        return d


def schedule(seed: int, duration_s: float, nodes: Sequence[int], *, groups: int, types: int,
             kinds: Sequence[str] = KINDS, mean_gap_s: float = 8.0,
             fault_s: tuple[float, float] = (3.0, 15.0), max_concurrent: int = 2,
             quiet_end_s: float = 5.0) -> list[Fault]:
    """The faults of a run, in start order: the same seed gives the same schedule."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ValueError(f"nemesis: unknown fault kind(s) {unknown} (known: {list(KINDS)})"
                         if unknown else "nemesis: no fault kinds given")
    if not 0 < fault_s[0] <= fault_s[1]:
        raise ValueError(f"nemesis: fault_s must be 0 < low <= high, got {list(fault_s)}")
    if mean_gap_s <= 0 or max_concurrent < 1:
        raise ValueError("nemesis: mean_gap_s must be > 0 and max_concurrent >= 1")
    rng = random.Random(seed)
    first = list(kinds)
    rng.shuffle(first)
    out: list[Fault] = []
    t = rng.expovariate(1.0 / mean_gap_s)
    last = duration_s - quiet_end_s
    nodes = list(nodes)
    while t < last - fault_s[0]:
        kind = first[0] if first else rng.choice(list(kinds))
        active = [f for f in out if f.start_s <= t < f.end_s]
        if len(active) >= max_concurrent or any(f.kind == kind for f in active):
            t = min(f.end_s for f in active) + 0.5
            continue
        if first:
            first.pop(0)
        dur = 0.0 if kind in INSTANT else min(rng.uniform(*fault_s), last - t)
        subset = tuple(sorted(rng.sample(nodes, rng.randint(1, max(1, len(nodes) // 2)))))
        level = (rng.uniform(0.05, 0.3) if kind == "loss"
                 else float(rng.choice((128, 256, 512))) if kind == "slow_link" else 0.0)
        group = rng.randrange(types if kind == "channel_switch" else groups)
        out.append(Fault(kind, round(t, 3), round(dur, 3),
                         subset if kind in NODE_FAULTS else (), group, round(level, 3)))
        t += rng.expovariate(1.0 / mean_gap_s)
    return out


def party_of(f: Fault) -> str:
    """What a fault acts on: its injections and heals run in order on one worker per party
    (``broker``, ``controller``, ``agents-<g>``, ``disk``, ``switch``: channel switches,
    which fail on their own deadline while the controller restarts instead of delaying
    it, or the network fault's kind)."""
    return {"broker_kill": "broker", "controller_kill": "controller",
            "channel_switch": "switch", "agents_kill": f"agents-{f.group}",
            "disk_full": "disk"}.get(f.kind, f.kind)


class Actions(Protocol):
    """The soak's side of the nemesis: put a fault in place, take it away (a heal that
    cannot restart its party raises)."""

    def inject(self, f: Fault) -> None: ...

    def heal(self, f: Fault) -> None: ...


class Nemesis:
    """Carries out a schedule against ``actions`` at the times it names (``now``: seconds
    since the start of the load).

    * Each party's actions run in order on a worker of its own (:func:`party_of`): a
      restart that takes long delays that party's later faults only.
    * A fault counts as in place from the moment its injection starts, so one that fails
      halfway (a partition applied to some nodes) is still healed.
    * When ``done`` is set (or the schedule ends), nothing more is injected (an injection
      still queued behind a slow restart is dropped: ``injected_s`` stays None) and every
      fault in place is healed: network faults and the full disk first, then the restarts;
      a heal that fails is reported and the others still run. :meth:`run` returns when
      every worker is idle.
    * ``errors``: every injection or heal that failed (a fault whose heal failed keeps
      ``healed_s`` None).
    """

    def __init__(self, faults: list[Fault], actions: Actions, now: Callable[[], float],
                 say: Callable[[str], None] = print) -> None:
        self.faults = faults
        self.actions = actions
        self.now = now
        self.say = say
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._workers: dict[str, ThreadPoolExecutor] = {}
        self._ended = threading.Event()     # the load ended: inject nothing more
        lasting = [f for f in faults if f.kind not in INSTANT and f.duration_s <= 0]
        if lasting:
            raise ValueError(f"nemesis: a {lasting[0].kind} fault must last more than 0 s")

    def _submit(self, f: Fault, job: Callable[[Fault], None]) -> Future[None]:
        party = party_of(f)
        if party not in self._workers:
            self._workers[party] = ThreadPoolExecutor(1, thread_name_prefix=f"nemesis-{party}")
        return self._workers[party].submit(job, f)

    def _fail(self, f: Fault, what: str, e: BaseException) -> None:
        text = f"{f.kind} {what} at {self.now():.1f} s: {type(e).__name__}: " \
               f"{str(e).splitlines()[0][:300] if str(e) else ''}"
        f.notes.append(text)
        with self._lock:
            self.errors.append(text)
        self.say(f"nemesis: {text}")

    def _inject(self, f: Fault) -> None:
        if self._ended.is_set():  # queued behind a slow restart past the end of the load
            f.notes.append("not injected: the load had ended")
            return
        self.say(f"nemesis: {f.kind} {f.nodes if f.kind in NETWORK else f.group} "
                 f"{f.level or ''} for {f.duration_s:.1f} s")
        f.injected_s = round(self.now(), 3)
        try:
            self.actions.inject(f)
        except Exception as e:  # reported; the heal still runs (it is idempotent)
            self._fail(f, "injection", e)
        if f.kind in INSTANT:
            f.healed_s = round(self.now(), 3)

    def _heal(self, f: Fault) -> None:
        if f.injected_s is None:  # never injected: nothing to heal
            return
        try:
            self.actions.heal(f)
        except Exception as e:  # reported; healed_s stays None
            self._fail(f, "heal", e)
            return
        f.healed_s = round(self.now(), 3)
        self.say(f"nemesis: {f.kind} healed ({f.healed_s - (f.injected_s or 0):.1f} s)")

    def run(self, done: threading.Event) -> None:
        self._ended = done
        try:
            self._run(done)
        except Exception as e:  # reported like a failed action; every worker is idle
            with self._lock:
                self.errors.append(f"nemesis: {type(e).__name__}: {e}")

    def _run(self, done: threading.Event) -> None:
        events = sorted([(f.start_s, 0, i) for i, f in enumerate(self.faults)]
                        + [(f.end_s, 1, i) for i, f in enumerate(self.faults)
                           if f.kind not in INSTANT], key=lambda e: (e[0], -e[1]))
        injected: set[int] = set()
        healed: set[int] = set()
        try:
            for at, what, i in events:
                if done.wait(max(0.0, at - self.now())):
                    break
                if what == 0:
                    injected.add(i)
                    self._submit(self.faults[i], self._inject)
                else:
                    healed.add(i)
                    self._submit(self.faults[i], self._heal)
            left = [self.faults[i] for i in sorted(injected - healed)
                    if self.faults[i].kind not in INSTANT]
            first = [f for f in left if f.kind in HEAL_FIRST]
            wait([self._submit(f, self._heal) for f in first])
            for f in left:
                if f.kind not in HEAL_FIRST:
                    self._submit(f, self._heal)
        finally:
            for w in self._workers.values():
                w.shutdown(wait=True)


# ------------------------------------------------------------------ network faults
_PART = "smt_part"


def _partition(ns: str, peer: str) -> None:
    rules = (f"table inet {_PART} {{\n"
             f" chain input {{ type filter hook input priority 0; policy accept;\n"
             f"  ip saddr {peer} drop\n }}\n"
             f" chain output {{ type filter hook output priority 0; policy accept;\n"
             f"  ip daddr {peer} drop\n }}\n}}\n")
    _sh(["ip", "netns", "exec", ns, "nft", "-f", "-"], rules)


def _unpartition(ns: str) -> None:
    _sh(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", _PART], check=False)


def inject_network(tag: str, f: Fault, port_of: dict[int, str]) -> None:
    """Put a network fault in place (``tag``: the emulated network; ``port_of``: node -> its
    switch port)."""
    if f.kind == "partition_nodes":
        for n in f.nodes:
            _partition(f"{tag}-n{n}", CONTROLLER_ADDRESS)
    elif f.kind == "partition_broker":
        _partition(f"{tag}-ctl", BROKER_ADDRESS)
    elif f.kind == "loss":
        for n in f.nodes:
            set_loss(f"{tag}-n{n}", f.level)
    elif f.kind == "slow_link":
        lines = [f"qdisc replace dev {port_of[n]} root "
                 f"{' '.join(_tbf(f.level * 1000, 2000.0))}" for n in f.nodes]
        _sh(["tc", "-n", f"{tag}-sw", "-batch", "-"], "\n".join(lines) + "\n")
    else:
        raise ValueError(f"not a network fault: {f.kind}")


def heal_network(tag: str, f: Fault, port_of: dict[int, str]) -> None:
    """Take a network fault away (idempotent)."""
    if f.kind == "partition_nodes":
        for n in f.nodes:
            _unpartition(f"{tag}-n{n}")
    elif f.kind == "partition_broker":
        _unpartition(f"{tag}-ctl")
    elif f.kind == "loss":
        for n in f.nodes:
            set_loss(f"{tag}-n{n}", 0.0)
    elif f.kind == "slow_link":
        for n in f.nodes:
            subprocess.run(["tc", "-n", f"{tag}-sw", "qdisc", "del", "dev", port_of[n],
                            "root"], capture_output=True, check=False)
    else:
        raise ValueError(f"not a network fault: {f.kind}")
