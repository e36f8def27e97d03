"""Per-tenant fairness on the controller's southbound channel: Sincon's shaper (Yoo et al.,
Section III) on the controller's sending path, one shaped channel per tenant class.

Sincon shapes the control channels of the tenants that share one link: the adaptive limit
calculator (Section III-A, Fig. 4) splits the link's throughput ``G`` into per-channel limits
that grow for channels using what they have and reset when the pool runs dry, and the
delay-based channel shaper (Section III-B) delays a channel's next processing as its
throughput approaches its limit. Here the link is the controller's egress and a channel is a
tenant class (the VPCs mapped to it): a large tenant's burst is paced at its class's limit
while a small tenant's updates leave at once.

* :class:`TenantShapingConfig`: the configuration (off by default), validated with errors
  naming ``shaping.<key>`` and the value.
* :class:`TenantShaper`: one FIFO per class in front of a ``release`` callback. The shaping
  logic is :class:`delivery.shaper.ConnectionShaper` (one per class, all registered with one
  :class:`delivery.shaper.SharedLimits`), driven through its synchronous
  :meth:`~delivery.shaper.ConnectionShaper.account` from threads: the controller is
  threaded. Nothing is dropped: an item waits in its class's queue until its class may
  process it.

Order: a class's items leave in submission order, and a resource belongs to one VPC (one
class), so the order per resource holds. Items of different classes may overtake each other.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Generic, TypeVar

from envs.shaping.sincon import ShaperConfig, ShapingError, SinconConfig

from .shaper import ConnectionShaper, SharedLimits

__all__ = ["TENANT_POLICIES", "TenantShaper", "TenantShapingConfig"]

log = logging.getLogger(__name__)
T = TypeVar("T")

TENANT_POLICIES = ("sincon", "static", "none")


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _whole(v: Any) -> int | None:
    """``v`` as an int if it is a whole number (not a bool), else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            return None
    return None


def _overrides(value: Any, cls: type, section: str, key: str, **fixed: Any) -> dict[str, Any]:
    """``value`` as keyword overrides of the dataclass ``cls``, each checked on its own so an
    error names the key (``<section>.<key>.<field>``)."""
    where = f"{section}.{key}"
    if not isinstance(value, Mapping):
        raise ShapingError(f"{where} must be a mapping of {cls.__name__} fields, got "
                           f"{value!r}")
    known = [f.name for f in fields(cls) if f.name not in fixed]
    out: dict[str, Any] = {}
    for k, v in value.items():
        if k in fixed:
            raise ShapingError(f"{where}.{k}: not settable here (set "
                               f"{section}.global_throughput_Bps), got {v!r}")
        if k not in known:
            raise ShapingError(f"{where}.{k}: unknown key (known: {', '.join(known)}), "
                               f"got {v!r}")
        try:
            cls(**fixed, **{k: v})
        except (ShapingError, TypeError, ValueError) as e:
            raise ShapingError(f"{where}.{k}: bad value {v!r}: {e}") from None
        out[str(k)] = v
    return out


def _checked(values: Mapping[str, Any], section: str) -> dict[str, Any]:
    """The fields of :class:`TenantShapingConfig` in ``values``, validated and normalised."""
    known = [f.name for f in fields(TenantShapingConfig)]
    for k in values:
        if k not in known:
            raise ShapingError(f"{section}.{k}: unknown key (known: {', '.join(known)}), "
                               f"got {values[k]!r}")
    out = dict(values)
    if "enabled" in out and not isinstance(out["enabled"], bool):
        raise ShapingError(f"{section}.enabled must be true or false, got {out['enabled']!r}")
    if "policy" in out and out["policy"] not in TENANT_POLICIES:
        raise ShapingError(f"{section}.policy must be one of {', '.join(TENANT_POLICIES)}, "
                           f"got {out['policy']!r}")
    g = out.get("global_throughput_Bps")
    if g is not None:
        if not (_is_number(g) and g > 0 and math.isfinite(g)):
            raise ShapingError(f"{section}.global_throughput_Bps must be a positive finite "
                               f"number of bytes/s (or null: the controller's C_b / 8), "
                               f"got {g!r}")
        out["global_throughput_Bps"] = float(g)
    classes = out.get("classes", 16)
    n = _whole(classes) if not isinstance(classes, str) else None
    if n is None or n < 1:
        raise ShapingError(f"{section}.classes must be a whole number >= 1, got {classes!r}")
    out["classes"] = n
    tc = out.get("tenant_class", {})
    if not isinstance(tc, Mapping):
        raise ShapingError(f"{section}.tenant_class must be a mapping vpc -> class, got "
                           f"{tc!r}")
    norm: dict[int, int] = {}
    for vpc, c in tc.items():
        vpc_id, idx = _whole(vpc), (_whole(c) if not isinstance(c, str) else None)
        if vpc_id is None:
            raise ShapingError(f"{section}.tenant_class: the key {vpc!r} is not a VPC id "
                               f"(a whole number)")
        if idx is None or not 0 <= idx < n:
            raise ShapingError(f"{section}.tenant_class[{vpc!r}]: class {c!r} out of range "
                               f"0..{n - 1} ({section}.classes = {n})")
        norm[vpc_id] = idx
    out["tenant_class"] = norm
    out["sincon"] = _overrides(out.get("sincon", {}), SinconConfig, section, "sincon",
                               global_throughput=1.0)
    out["shaper"] = _overrides(out.get("shaper", {}), ShaperConfig, section, "shaper")
    return out


@dataclass(frozen=True)
class TenantShapingConfig:
    """Per-tenant shaping of the controller's egress (off by default).

    ``policy``: ``"sincon"`` (adaptive limits, Section III-A), ``"static"`` (``G / classes``
    each) or ``"none"`` (no limits: a pass-through with the bookkeeping). ``classes`` tenant
    classes share ``global_throughput_Bps`` (``G``; None: the controller's ``C_b / 8``); VPC
    ``v`` belongs to ``tenant_class[v]``, by default ``v % classes``. ``sincon`` and
    ``shaper`` override :class:`~envs.shaping.sincon.SinconConfig` (not ``G``) and
    :class:`~envs.shaping.sincon.ShaperConfig` (Section III-B's delay).
    """

    enabled: bool = False
    policy: str = "sincon"
    global_throughput_Bps: float | None = None
    classes: int = 16
    tenant_class: dict[int, int] = field(default_factory=dict)
    sincon: dict[str, Any] = field(default_factory=dict)
    shaper: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        checked = _checked({f.name: getattr(self, f.name) for f in fields(self)}, "shaping")
        for k, v in checked.items():
            object.__setattr__(self, k, v)

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any] | TenantShapingConfig | None,
                     section: str = "shaping") -> TenantShapingConfig:
        """The configuration of ``m`` (a mapping such as a YAML section, a config, or None
        for the defaults). Unknown keys, bad types and out-of-range values raise
        :class:`~envs.shaping.sincon.ShapingError` naming ``<section>.<key>`` and the value."""
        if m is None:
            return cls()
        if isinstance(m, TenantShapingConfig):
            return m
        if not isinstance(m, Mapping):
            raise ShapingError(f"{section} must be a mapping (or a TenantShapingConfig), got "
                               f"{m!r}")
        return cls(**_checked({str(k): v for k, v in m.items()}, section))

    def class_of(self, tenant: int) -> int:
        """The class of VPC ``tenant``."""
        c = self.tenant_class.get(int(tenant))
        return int(tenant) % self.classes if c is None else c


@dataclass
class _ClassStats:
    messages: int = 0          # released (accounted)
    bytes: int = 0
    inline: int = 0            # released at once on the submitting thread
    max_queue: int = 0
    max_wait_s: float = 0.0    # longest an item waited in the queue


class TenantShaper(Generic[T]):
    """One shaped FIFO per tenant class in front of ``release`` (see the module docstring).

    ``max_batch``: most items per ``release`` call; ``retry_s``: the pause after a failed
    ``release`` (its items go back to the head of their queues).

    ``submit`` never blocks on the shaper and never drops: an item whose class may process
    now (queue empty, the class's delay elapsed) is accounted and released at once on the
    caller's thread; otherwise it waits in its class's queue, and the pump thread
    (:meth:`start`) releases the heads of the classes whose time has come, in order of
    readiness, in one ``release(list)`` call per round. The pump never holds the shaper's
    lock while it calls ``release`` (which may take the caller's locks). ``clock`` is in
    seconds; a fake clock and :meth:`step` drive it without threads.
    """

    def __init__(self, cfg: TenantShapingConfig, release: Callable[[list[T]], None], *,
                 global_throughput_Bps: float | None = None,
                 clock: Callable[[], float] = time.monotonic, max_batch: int = 1024,
                 retry_s: float = 0.1, tick_s: float = 0.001) -> None:
        g = cfg.global_throughput_Bps if cfg.global_throughput_Bps is not None \
            else global_throughput_Bps
        if g is None:
            raise ShapingError("shaping.global_throughput_Bps is not set and no link "
                               "throughput was given (the controller's C_b / 8)")
        if not (_is_number(g) and g > 0 and math.isfinite(g)):
            raise ShapingError(f"TenantShaper: global_throughput_Bps must be a positive "
                               f"finite number of bytes/s, got {g!r}")
        if max_batch < 1:
            raise ShapingError(f"TenantShaper: max_batch must be >= 1, got {max_batch!r}")
        self.cfg = cfg
        self.global_throughput = float(g)
        self.limits = SharedLimits(cfg.policy, cfg.classes, self.global_throughput,
                                   cfg.sincon)
        shaper_cfg = ShaperConfig(**cfg.shaper)
        # bypass_at=inf: a class limited to the whole of G (one class, static) is still paced
        self._channels = [ConnectionShaper(self.limits, shaper_cfg, clock=clock,
                                           bypass_at=math.inf) for _ in range(cfg.classes)]
        self._release = release
        self._clock = clock
        self._max_batch = int(max_batch)
        self._retry_s = float(retry_s)
        # the pump sleeps at least tick_s: waking late by less than the shaper's catch-up
        # (ConnectionShaper.catchup_s) costs no throughput, and batches what is due meanwhile
        self._tick_s = float(tick_s)
        self._queues: list[deque[tuple[int, T, float]]] = [deque() for _ in self._channels]
        self._inflight = [0] * cfg.classes   # taken by the pump, release() not returned yet
        self._stats = [_ClassStats() for _ in self._channels]
        self._cond = threading.Condition(threading.Lock())
        self._kick = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.release_errors = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> TenantShaper[T]:
        """Start the pump thread."""
        with self._cond:
            if self._closed:
                raise ShapingError("TenantShaper: start() after close()")
            if self._thread is None:
                self._thread = threading.Thread(target=self._pump, name="tenant-shaper",
                                                daemon=True)
                self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop the pump (waiting at most ``timeout`` s for a release in progress). What is
        still queued stays queued (:meth:`queued`)."""
        with self._cond:
            self._closed = True
            self._kick = True
            self._cond.notify_all()
            t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
            if t.is_alive():
                log.warning("tenant shaper: the pump is still in a release() after %.1f s",
                            timeout)

    # ------------------------------------------------------------------ submitting
    def class_of(self, tenant: int) -> int:
        return self.cfg.class_of(tenant)

    def submit(self, tenant: int, nbytes: int, item: T) -> None:
        """Queue ``item`` (``nbytes`` of controller egress) for VPC ``tenant``; released at
        once, on this thread, if its class may process it now."""
        if nbytes < 0:
            raise ShapingError(f"TenantShaper.submit: nbytes must be >= 0, got {nbytes!r}")
        c = self.cfg.class_of(tenant)
        with self._cond:
            if self._closed:
                raise ShapingError("TenantShaper: submit() after close()")
            q, ch, st = self._queues[c], self._channels[c], self._stats[c]
            now = self._clock()
            if not q and not self._inflight[c] and ch.ready_at <= now:
                ch.account(now, nbytes)
                st.messages += 1
                st.bytes += nbytes
                st.inline += 1
                inline = True
            else:
                q.append((nbytes, item, now))
                st.max_queue = max(st.max_queue, len(q))
                if len(q) == 1:  # a new head: the pump's next wake-up may be earlier
                    self._kick = True
                    self._cond.notify_all()
                inline = False
        if inline:
            self._release([item])

    # ------------------------------------------------------------------ releasing
    def step(self) -> float:
        """Release what is ready now (one ``release`` call); returns the seconds until the
        next queued item is due (``inf``: nothing queued). The pump thread loops on it."""
        batch: list[T] = []
        taken: list[tuple[int, int, T, float]] = []
        with self._cond:
            now = self._clock()
            while len(batch) < self._max_batch:
                best, best_at = -1, math.inf
                for c, q in enumerate(self._queues):
                    if q:
                        at = self._channels[c].ready_at
                        if at <= now and at < best_at:
                            best, best_at = c, at
                if best < 0:
                    break
                nbytes, item, t_in = self._queues[best].popleft()
                self._channels[best].account(now, nbytes)
                st = self._stats[best]
                st.messages += 1
                st.bytes += nbytes
                st.max_wait_s = max(st.max_wait_s, now - t_in)
                self._inflight[best] += 1
                batch.append(item)
                taken.append((best, nbytes, item, t_in))
        if batch:
            try:
                self._release(batch)
            except Exception:
                # nothing is dropped: back at the head of their queues, in order
                log.exception("tenant shaper: release of %d items failed; retrying in "
                              "%.2f s", len(batch), self._retry_s)
                with self._cond:
                    self.release_errors += 1
                    for c, nbytes, item, t_in in reversed(taken):
                        self._queues[c].appendleft((nbytes, item, t_in))
                        self._inflight[c] -= 1
                    self._cond.notify_all()
                return self._retry_s
            with self._cond:
                for c, *_ in taken:
                    self._inflight[c] -= 1
                self._cond.notify_all()
        return self._next_due()

    def _next_due(self) -> float:
        with self._cond:
            now = self._clock()
            due = [self._channels[c].due_in(now) for c, q in enumerate(self._queues) if q]
            return min(due) if due else math.inf

    def _pump(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
            try:
                wait = self.step()
            except Exception:  # a bug: keep the pump alive, nothing is dropped
                log.exception("tenant shaper: pump step failed")
                wait = self._retry_s
            with self._cond:
                if self._closed:
                    return
                if wait > 0 and not self._kick:
                    self._cond.wait(min(max(wait, self._tick_s), 1.0))
                self._kick = False

    # ------------------------------------------------------------------ state
    def drain(self, timeout: float) -> bool:
        """Wait until every queue is empty and every release returned; False on timeout.
        Do not call it holding a lock that ``release`` takes."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not any(self._queues) and not any(self._inflight), timeout)

    def queued(self) -> list[T]:
        """The items still queued, class by class, each class in order."""
        with self._cond:
            return [item for q in self._queues for _, item, _ in q]

    def backlog(self) -> dict[int, int]:
        """class -> queued items (classes with a queue only)."""
        with self._cond:
            return {c: len(q) for c, q in enumerate(self._queues) if q}

    def stats(self) -> dict[int, dict[str, Any]]:
        """class -> messages and bytes released, inline (released at once), max_queue,
        max_wait_s, queued and limit_Bps (the class's current limit; inf: none)."""
        with self._cond:
            return {c: {"messages": s.messages, "bytes": s.bytes, "inline": s.inline,
                        "max_queue": s.max_queue, "max_wait_s": s.max_wait_s,
                        "queued": len(self._queues[c]),
                        "limit_Bps": self._channels[c].limit}
                    for c, s in enumerate(self._stats)}
