"""A discrete-event simulator of SDN-NV control channels sharing one link (Sincon Section II-B
and the evaluation of Section IV).

## Model
* ``tenants`` x ``switches_per_tenant`` control channels (one per virtual switch, Section I);
  the first ``edge_switches`` switches of each tenant are edge switches and carry
  ``edge_factor`` (2) times the control traffic of the others (Section III-A, [3]).
* Two link directions, each of throughput ``G`` (``global_throughput``, bytes/s):
  ``read`` (controller -> switch: flow-mods, stats requests; Sincon's channel_read) and
  ``write`` (switch -> controller: packet-ins, stats replies; channel_write). Each direction
  has its own limit policy (one :mod:`envs.shaping.sincon` calculator per direction).
* Every channel has a FIFO queue: shaping delays messages, never drops them.
* Traffic (Section II-B: every tenant's VN carries the same workload, the control messages
  spread evenly over its switches): bursts of control messages per channel and direction
  (Poisson burst times, geometric burst sizes, uniform message sizes: statistics, echo,
  port status), plus flow setups (``setup_rate_hz`` per tenant; the default 20 stands for
  the paper's 20 TCP connections opening one new flow per second each): a flow setup is a
  packet-in on the source edge switch's write channel; once the controller has it (plus
  ``controller_delay_s``) it sends flow-mods on the read channels of the path (``edge_rules``
  rules on each edge switch, one on each of ``path_hops`` inner switches). The *forwarding
  setup time* is the packet-in's arrival to the delivery of the setup's last flow-mod.
* Tenant ``k`` starts at ``k * tenant_stagger_s`` (its channels within ``start_jitter_s``).
* Every processed message joins the link's queue, which transmits one message at a time at
  ``G``. Without shaping a channel's messages are processed as they arrive, so channels that
  send earlier take more of the link ("control channels that send messages earlier than
  other control channels dominate the network bandwidth", Section II-B, the unshaped
  OpenVirteX): with ``link_order="seniority"`` (default) the link serves the channels that
  started earlier first (established connections keep what they grabbed), with ``"fifo"`` it
  serves messages in the order they were processed (an earlier burst holds the link until it
  is out). With shaping, a channel's burst enters the link at about its limit, so other
  channels' messages interleave.
* A channel's message is *processed* (channel_read / channel_write) when it leaves the
  channel's queue for the link; the channel shaper
  (:class:`envs.shaping.sincon.ChannelShaper`) then sets the delay before the channel's next
  processing, and the limit policy sees the channel's measured usage (Sincon checks it every
  5 messages).

* ``server`` picks the channels' shared resource. ``"link"`` (default) is the above: one
  link of ``G`` per direction. ``"hypervisor"`` (:mod:`envs.shaping.hypervisor`) makes the
  network hypervisor's processing the shared resource instead: what a channel's shaper
  releases is handed to the I/O thread the channel is bound to; a thread visits its channels
  round-robin and processes a channel's whole buffered batch per visit at a per-message +
  per-byte cost; a message is delivered when processed (the link is taken as far from loaded
  and not modelled; ``G`` remains the adaptive limit calculator's global throughput).
  ``link_order`` does not apply there.

* Operating regime of the defaults: each tenant offers about 19% of ``G`` per direction, so
  the aggregate load grows with the tenants (tenants are added one by one) to about 76-80%
  with 4 tenants, when 100 ms bursts exceed the link; then the unshaped link serves the
  earlier tenants first and the last tenant's messages and setups wait several times longer
  (:meth:`SimResult.tenant_delay`, :meth:`SimResult.tenant_setup_time`).

## Measurements
Per-channel delivered bytes per ``period_s`` bin (throughput over time), per-message queueing
delay (arrival to delivery, also per channel and per tenant), forwarding setup times (also
per tenant), Section II-B's max / min channel throughput, the offered load and the share of
saturated bins (both relative to ``G``), the busy share of the shared resource (link, or the
mean over the I/O threads; over ``duration_s``, so above 1 when a backlog drains after the
traffic ends) and, on the hypervisor, the mean batch per visit. Fig. 5's metric: the standard
deviation across channels of per-channel throughput in each bin, averaged over the bins in
which every tenant has started (:meth:`SimResult.throughput_std`).

No gymnasium here (the env wraps it: :mod:`envs.shaping.env`).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from envs.seeding import rng

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

from .hypervisor import SERVERS, HypervisorConfig, IOThreadPool
from .sincon import (
    ChannelShaper,
    LimitPolicy,
    ShaperConfig,
    ShapingError,
    SinconConfig,
    make_policy,
)

__all__ = [
    "DIRECTIONS",
    "ShapingSimulator",
    "SimConfig",
    "SimResult",
    "TrafficConfig",
    "simulate",
]

DIRECTIONS = ("read", "write")
READ, WRITE = 0, 1
_ARRIVE, _DONE, _WAKE, _SETUP, _FREE = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class TrafficConfig:
    """Background control traffic of one direction on a regular switch's channel (an edge
    switch's has ``edge_factor`` times the burst rate)."""

    burst_rate_hz: float = 6.0           # bursts/s (statistics, echo, port status, ...)
    burst_messages: float = 8.0          # mean of a geometric number of messages (>= 1)
    message_bytes: tuple[int, int] = (100, 400)   # uniform, inclusive


@dataclass(frozen=True)
class SimConfig:
    """One experiment: topology, link, traffic, shaping constants. Every field is
    configuration (``SimConfig.from_dict`` builds it from plain dicts, e.g. Hydra's)."""

    tenants: int = 4
    switches_per_tenant: int = 10
    edge_switches: int = 4
    edge_factor: float = 2.0
    global_throughput: float = 1.0e6       # G per direction, bytes/s
    duration_s: float = 6.0                # traffic is generated in [0, duration_s)
    tenant_stagger_s: float = 0.5
    start_jitter_s: float = 0.05
    period_s: float = 0.1                  # throughput bins (and the env's monitoring period)
    link_order: str = "seniority"          # seniority (earlier channels first) | fifo
    server: str = "link"                   # the shared resource: link | hypervisor
    hypervisor: HypervisorConfig = field(default_factory=HypervisorConfig)
    read: TrafficConfig = field(default_factory=TrafficConfig)
    write: TrafficConfig = field(default_factory=TrafficConfig)
    setup_rate_hz: float = 20.0            # flow setups/s per tenant (20 connections x 1/s)
    packet_in_bytes: int = 200
    flow_mod_bytes: int = 180
    edge_rules: int = 2
    path_hops: tuple[int, int] = (1, 3)    # inner switches on a setup's path (inclusive)
    controller_delay_s: float = 0.001
    shaper: ShaperConfig = field(default_factory=ShaperConfig)
    sincon: Mapping[str, float] = field(default_factory=dict)   # SinconConfig but G

    @property
    def num_channels(self) -> int:
        return self.tenants * self.switches_per_tenant

    @property
    def measure_from_s(self) -> float:
        """When the last tenant has started (Fig. 5's window starts here)."""
        return (self.tenants - 1) * self.tenant_stagger_s + self.start_jitter_s

    def sincon_config(self) -> SinconConfig:
        try:
            params: dict[str, Any] = dict(self.sincon)
            return SinconConfig(global_throughput=self.global_throughput, **params)
        except TypeError as e:
            raise ShapingError(f"SimConfig.sincon: {e}; keys are SinconConfig's fields "
                               "except global_throughput") from None

    def __post_init__(self) -> None:
        w = "SimConfig"
        for name in ("tenants", "switches_per_tenant"):
            v = getattr(self, name)
            if int(v) != v or v < 1:
                raise ShapingError(f"{w}: {name} must be a whole number >= 1, got {v!r}")
        if not (0 <= self.edge_switches <= self.switches_per_tenant):
            raise ShapingError(f"{w}: edge_switches must be in 0..switches_per_tenant "
                               f"({self.switches_per_tenant}), got {self.edge_switches!r}")
        if self.setup_rate_hz > 0 and self.edge_switches < 1:
            raise ShapingError(f"{w}: flow setups need at least one edge switch")
        for name in ("global_throughput", "duration_s", "period_s", "edge_factor"):
            if not getattr(self, name) > 0:
                raise ShapingError(f"{w}: {name} must be > 0, got {getattr(self, name)!r}")
        for name in ("tenant_stagger_s", "start_jitter_s", "setup_rate_hz",
                     "controller_delay_s"):
            if getattr(self, name) < 0:
                raise ShapingError(f"{w}: {name} must be >= 0, got {getattr(self, name)!r}")
        if self.server not in SERVERS:
            raise ShapingError(f"{w}: server must be one of {SERVERS}, got {self.server!r}")
        if self.link_order not in ("seniority", "fifo"):
            raise ShapingError(f"{w}: link_order must be 'seniority' or 'fifo', got "
                               f"{self.link_order!r}")
        lo, hi = self.path_hops
        inner = self.switches_per_tenant - self.edge_switches
        if not (0 <= lo <= hi) or (self.setup_rate_hz > 0 and lo > inner):
            raise ShapingError(f"{w}: path_hops {self.path_hops!r} must be 0 <= lo <= hi with "
                               f"lo <= {inner} inner switches")
        for d in DIRECTIONS:
            t = getattr(self, d)
            a, b = t.message_bytes
            if not (t.burst_rate_hz >= 0 and t.burst_messages >= 1 and 1 <= a <= b):
                raise ShapingError(f"{w}.{d}: need burst_rate_hz >= 0, burst_messages >= 1 "
                                   f"and 1 <= message_bytes[0] <= message_bytes[1], got {t}")
        self.sincon_config()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None = None, **overrides: Any) -> SimConfig:
        """Build from plain (nested) dicts; unknown keys are an error naming them."""
        data = {**dict(d or {}), **overrides}
        return _build(cls, data, "SimConfig")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["sincon"] = dict(self.sincon)
        return out


_DC = TypeVar("_DC", bound="DataclassInstance")


def _build(cls: type[_DC], data: Mapping[str, Any], where: str) -> _DC:
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ShapingError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
    kw: dict[str, Any] = {}
    nested: dict[str, type[DataclassInstance]] = {
        "read": TrafficConfig, "write": TrafficConfig, "shaper": ShaperConfig,
        "hypervisor": HypervisorConfig}
    for k, v in data.items():
        val = v
        if k in nested and isinstance(v, Mapping):
            val = _build(nested[k], v, f"{where}.{k}")
        elif isinstance(v, (list, tuple)) and not is_dataclass(v):
            val = tuple(v)
        elif k == "sincon":
            val = dict(v or {})
        kw[k] = val
    return cls(**kw)


@dataclass
class SimResult:
    """What one run measured (``delivered[d]``: bytes per channel and ``period_s`` bin)."""

    cfg: SimConfig
    policy: str
    delivered: list[np.ndarray]
    setup_times: np.ndarray          # seconds, setups in arrival order (nan: not completed)
    queue_delay_mean: list[float]    # per direction, arrival to delivery
    queue_delay_p95: list[float]
    messages: list[int]
    max_queue_bytes: list[float]
    resets: list[int]
    growths: list[int]
    end_time: float
    offered: list[np.ndarray] = field(default_factory=list)        # bytes per channel
    channel_delay_mean: list[np.ndarray] = field(default_factory=list)  # s per channel
    setup_tenants: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    batch_mean: list[float] = field(default_factory=lambda: [math.nan, math.nan])
    server_busy: list[float] = field(default_factory=lambda: [math.nan, math.nan])

    def window(self) -> slice:
        """Bins from the last tenant's start to the end of the traffic."""
        p = self.cfg.period_s
        return slice(math.ceil(self.cfg.measure_from_s / p - 1e-9),
                     round(self.cfg.duration_s / p))

    def throughput(self, direction: str) -> np.ndarray:
        """Per-channel throughput (bytes/s) per bin of the measurement window, ``[N, bins]``."""
        d = DIRECTIONS.index(direction)
        return self.delivered[d][:, self.window()] / self.cfg.period_s

    def throughput_std(self, direction: str) -> float:
        """Fig. 5: std across channels of throughput in a bin, averaged over the window."""
        tp = self.throughput(direction)
        return float(tp.std(axis=0).mean()) if tp.shape[1] else float("nan")

    def max_min_ratio(self, direction: str) -> float:
        """Section II-B's "maximum throughput of a control channel is 242% of the minimum":
        max over min of the channels' mean throughputs over the window (channels that sent
        nothing are left out)."""
        m = self.throughput(direction).mean(axis=1)
        m = m[m > 0]
        return float(m.max() / m.min()) if m.size else float("nan")

    def offered_load(self, direction: str) -> float:
        """Mean offered bytes/s over ``G`` (all channels, the whole run's traffic)."""
        d = DIRECTIONS.index(direction)
        return float(self.offered[d].sum() / self.cfg.duration_s / self.cfg.global_throughput)

    def saturated_share(self, direction: str, level: float = 0.95) -> float:
        """Share of the window's bins in which the link delivered >= ``level`` x G."""
        tot = self.throughput(direction).sum(axis=0)
        return float((tot >= level * self.cfg.global_throughput).mean()) if tot.size else 0.0

    def tenant_delay(self, direction: str) -> np.ndarray:
        """Mean queueing delay (arrival to delivery) of each tenant's messages, seconds."""
        d = DIRECTIONS.index(direction)
        per = self.channel_delay_mean[d].reshape(self.cfg.tenants, -1)
        w = self.offered[d].reshape(self.cfg.tenants, -1)
        tot = w.sum(axis=1)
        return np.where(tot > 0, (per * w).sum(axis=1) / np.maximum(tot, 1e-300), np.nan)

    def tenant_setup_time(self) -> np.ndarray:
        """Mean forwarding setup time of each tenant's completed setups, seconds."""
        out = np.full(self.cfg.tenants, np.nan)
        for k in range(self.cfg.tenants):
            st = self.setup_times[self.setup_tenants == k]
            st = st[~np.isnan(st)]
            if st.size:
                out[k] = st.mean()
        return out

    def mean_throughput_std(self, direction: str) -> float:
        """Std across channels of each channel's mean throughput over the window."""
        tp = self.throughput(direction)
        return float(tp.mean(axis=1).std()) if tp.shape[1] else float("nan")

    def jain(self, direction: str) -> float:
        """Jain's index of the per-channel mean throughputs over the window."""
        x = self.throughput(direction).mean(axis=1)
        s2 = float((x ** 2).sum())
        return float(x.sum() ** 2 / (len(x) * s2)) if s2 > 0 else 1.0

    def summary(self) -> dict[str, float]:
        st = self.setup_times
        done = st[~np.isnan(st)]
        out: dict[str, float] = {
            "setup_time_mean_s": float(done.mean()) if done.size else float("nan"),
            "setup_time_p95_s": float(np.percentile(done, 95)) if done.size else float("nan"),
            "setups": float(st.size), "setups_completed": float(done.size)}
        ts = self.tenant_setup_time()
        out["setup_time_first_tenant_s"] = float(ts[0])
        out["setup_time_last_tenant_s"] = float(ts[-1])
        for i, d in enumerate(DIRECTIONS):
            out[f"{d}_tput_std_Bps"] = self.throughput_std(d)
            out[f"{d}_mean_tput_std_Bps"] = self.mean_throughput_std(d)
            out[f"{d}_tput_max_min"] = self.max_min_ratio(d)
            out[f"{d}_offered_load"] = self.offered_load(d)
            out[f"{d}_saturated_share"] = self.saturated_share(d)
            td = self.tenant_delay(d)
            out[f"{d}_delay_first_tenant_s"] = float(td[0])
            out[f"{d}_delay_last_tenant_s"] = float(td[-1])
            out[f"{d}_jain"] = self.jain(d)
            out[f"{d}_tput_mean_Bps"] = float(self.throughput(d).mean())
            out[f"{d}_queue_delay_mean_s"] = self.queue_delay_mean[i]
            out[f"{d}_queue_delay_p95_s"] = self.queue_delay_p95[i]
            out[f"{d}_max_queue_bytes"] = self.max_queue_bytes[i]
            out[f"{d}_messages"] = float(self.messages[i])
            out[f"{d}_resets"] = float(self.resets[i])
            out[f"{d}_growths"] = float(self.growths[i])
            out[f"{d}_batch_mean"] = float(self.batch_mean[i])
            out[f"{d}_server_busy"] = float(self.server_busy[i])
        return out


class _Link:
    """One direction: per-channel queues and shapers, the link's FIFO and its transmitter."""

    def __init__(self, n: int, g: float, policy: LimitPolicy, scfg: ShaperConfig,
                 bins: int) -> None:
        self.n, self.g, self.policy = n, g, policy
        self.queues: list[deque] = [deque() for _ in range(n)]
        self.qbytes = np.zeros(n)          # bytes waiting in each channel's queue (shaper)
        self.offered = np.zeros(n)
        self.max_q = 0.0
        self.shapers = [ChannelShaper(scfg, bypass_at=g) for _ in range(n)]
        self.ready_at = [0.0] * n
        self.wake_pending = [False] * n
        self.fifo: list[tuple] = []        # processed messages waiting for the link (heap)
        self.fifo_bytes = 0.0
        self.busy = False
        self.processed = np.zeros(n, dtype=np.int64)   # messages handed to the link
        self.delivered = np.zeros((n, bins))
        self.delays: list[float] = []
        self.delay_sum = np.zeros(n)                   # per channel, arrival to delivery
        self.delay_count = np.zeros(n, dtype=np.int64)
        self.pool: IOThreadPool | None = None          # server="hypervisor": its I/O threads
        self.last_arrival = np.full(n, -math.inf)      # per channel, of the last delivery
        self.out_of_order = 0                          # deliveries older than an earlier one
        self.link_busy_s = 0.0


class ShapingSimulator:
    """The event loop. ``policy``: a name of :data:`envs.shaping.sincon.POLICY_NAMES` (one
    policy object per direction is built) or a ``(read, write)`` pair of policy objects."""

    def __init__(self, cfg: SimConfig, policy: str | tuple[LimitPolicy, LimitPolicy],
                 seed: int) -> None:
        self.cfg = cfg
        self.seed = int(seed)
        n, g = cfg.num_channels, cfg.global_throughput
        if isinstance(policy, str):
            self.policy_name = policy
            pols = tuple(make_policy(policy, n, g, cfg.sincon_config()) for _ in DIRECTIONS)
        else:
            pols = tuple(policy)
            if len(pols) != 2:
                raise ShapingError("policy must be a name or a (read, write) pair")
            self.policy_name = pols[0].name
        self.policies = pols
        self.bins = math.ceil(cfg.duration_s / cfg.period_s) + 1
        self.links = [_Link(n, g, p, cfg.shaper, self.bins) for p in pols]
        self.now = 0.0
        self._seq = 0
        self._events: list[tuple] = []
        self.setup_t0: list[float] = []
        self.setup_left: list[int] = []
        self.setup_done: list[float] = []
        self.setup_paths: list[list[tuple[int, int]]] = []
        self.open_setups = 0
        self.open_integral = 0.0          # integral of open setups over time (Little's law)
        self._t_open = 0.0
        starts = self.channel_starts()
        self._rank = ([0.0] * n if cfg.link_order == "fifo" else
                      [float(x) for x in np.argsort(np.argsort(starts, kind="stable"))])
        self._hv = cfg.server == "hypervisor"
        if self._hv:   # connections bound to the I/O threads in the order they were opened
            for L in self.links:
                L.pool = IOThreadPool(cfg.hypervisor, np.argsort(starts, kind="stable"), n)
        self._generate()

    # ---- traffic -------------------------------------------------------------------------
    def _push(self, t: float, kind: int, d: int, ch: int, size: int = 0, tag: int = -1,
              t_arr: float = 0.0) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, d, ch, size, tag, t_arr))

    def _is_edge(self, ch: int) -> bool:
        return ch % self.cfg.switches_per_tenant < self.cfg.edge_switches

    def channel_starts(self) -> np.ndarray:
        cfg = self.cfg
        g = rng(self.seed, "shaping", "starts")
        tenant = np.arange(cfg.num_channels) // cfg.switches_per_tenant
        return tenant * cfg.tenant_stagger_s + g.uniform(0, cfg.start_jitter_s, cfg.num_channels)

    def _generate(self) -> None:
        cfg = self.cfg
        starts = self.channel_starts()
        for d, name in enumerate(DIRECTIONS):
            tc: TrafficConfig = getattr(cfg, name)
            for ch in range(cfg.num_channels):
                g = rng(self.seed, "shaping", "traffic", name, ch)
                lam = tc.burst_rate_hz * (cfg.edge_factor if self._is_edge(ch) else 1.0)
                t = starts[ch]
                while lam > 0:
                    t += g.exponential(1.0 / lam)
                    if t >= cfg.duration_s:
                        break
                    k = int(g.geometric(1.0 / tc.burst_messages))
                    for size in g.integers(tc.message_bytes[0], tc.message_bytes[1] + 1, k):
                        self._push(t, _ARRIVE, d, ch, int(size))
        spt, e = cfg.switches_per_tenant, cfg.edge_switches
        for k in range(cfg.tenants):
            g = rng(self.seed, "shaping", "setups", k)
            t = k * cfg.tenant_stagger_s + cfg.start_jitter_s
            while cfg.setup_rate_hz > 0:
                t += g.exponential(1.0 / cfg.setup_rate_hz)
                if t >= cfg.duration_s:
                    break
                ends = g.choice(e, size=min(2, e), replace=False)
                hops = int(g.integers(cfg.path_hops[0], cfg.path_hops[1] + 1))
                inner = g.choice(np.arange(e, spt), size=min(hops, spt - e), replace=False)
                path = [(k * spt + int(s), cfg.edge_rules) for s in ends]
                path += [(k * spt + int(s), 1) for s in inner]
                sid = len(self.setup_t0)
                self.setup_t0.append(float(t))
                self.setup_left.append(1)
                self.setup_done.append(math.nan)
                self.setup_paths.append(path)
                self._push(float(t), _SETUP, WRITE, path[0][0], cfg.packet_in_bytes, sid)

    def offer(self, t: float, direction: str, channel: int, nbytes: int) -> None:
        """Offer one more control message of ``nbytes`` on ``channel`` at time ``t`` (not
        before ``now``), besides the generated traffic (for tests and hand-made scenarios)."""
        if direction not in DIRECTIONS:
            raise ShapingError(f"offer: direction must be one of {DIRECTIONS}, got "
                               f"{direction!r}")
        if not (0 <= int(channel) < self.cfg.num_channels) or int(channel) != channel:
            raise ShapingError(f"offer: channel {channel!r} out of range "
                               f"0..{self.cfg.num_channels - 1}")
        if not (t >= self.now and math.isfinite(t)) or not (int(nbytes) == nbytes >= 1):
            raise ShapingError(f"offer: need now ({self.now}) <= t < inf and a whole "
                               f"nbytes >= 1, got t={t!r}, nbytes={nbytes!r}")
        self._push(float(t), _ARRIVE, DIRECTIONS.index(direction), int(channel), int(nbytes))

    # ---- event loop ----------------------------------------------------------------------
    def _track_open(self, t: float, delta: int) -> None:
        self.open_integral += self.open_setups * (t - self._t_open)
        self._t_open = t
        self.open_setups += delta

    def _arrive(self, d: int, ch: int, size: int, tag: int, t: float) -> None:
        L = self.links[d]
        q = L.queues[ch]
        q.append((size, t, tag))
        L.qbytes[ch] += size
        L.offered[ch] += size
        if L.qbytes[ch] > L.max_q:
            L.max_q = float(L.qbytes[ch])
        if len(q) == 1 and not L.wake_pending[ch]:
            if L.ready_at[ch] <= t:
                self._process(d, ch, t)
            else:
                L.wake_pending[ch] = True
                self._push(L.ready_at[ch], _WAKE, d, ch)

    def _process(self, d: int, ch: int, t: float) -> None:
        """channel_read / channel_write: hand queued messages of ``ch`` to the link until
        the shaper asks for a delay (Section III-B)."""
        L = self.links[d]
        q = L.queues[ch]
        shaper, limit = L.shapers[ch], float(L.policy.limits[ch])
        delay = 0.0
        pool = L.pool
        while q and delay <= 0.0:
            msg = q.popleft()
            L.qbytes[ch] -= msg[0]
            if pool is not None:   # to the channel's I/O thread (server="hypervisor")
                pool.hand(ch, msg)
            else:
                self._seq += 1
                heapq.heappush(L.fifo, (self._rank[ch], self._seq, ch, *msg))
                L.fifo_bytes += msg[0]
            L.processed[ch] += 1
            delay, usage = shaper.process(t, msg[0], limit)
            L.policy.on_processed(ch, usage)
            limit = float(L.policy.limits[ch])
        L.ready_at[ch] = t + delay
        if q:
            L.wake_pending[ch] = True
            self._push(t + delay, _WAKE, d, ch)
        if pool is not None:
            self._visit(d, int(pool.thread_of[ch]), t)
        else:
            self._transmit(d, t)

    def _visit(self, d: int, th: int, t: float) -> None:
        """An idle I/O thread ``th`` visits its next channel with buffered messages and
        processes the whole batch (:mod:`envs.shaping.hypervisor`); each message is
        delivered when its processing ends, the thread is free after the batch."""
        pool = self.links[d].pool
        assert pool is not None   # only with server="hypervisor"
        if pool.busy[th]:
            return
        got = pool.take(th)
        if got is None:
            return
        ch, batch = got
        pool.busy[th] = True
        tt = t
        for size, t_arr, tag in batch:
            tt += pool.cfg.cost(size)
            self._push(tt, _DONE, d, ch, size, tag, t_arr)
        pool.busy_s[th] += tt - t
        self._push(tt, _FREE, d, th)

    def _transmit(self, d: int, t: float) -> None:
        L = self.links[d]
        if L.busy or not L.fifo:
            return
        _, _, ch, size, t_arr, tag = heapq.heappop(L.fifo)
        L.fifo_bytes -= size
        L.busy = True
        L.link_busy_s += size / L.g
        self._push(t + size / L.g, _DONE, d, ch, size, tag, t_arr)

    def _done(self, d: int, ch: int, size: int, tag: int, t: float) -> None:
        L = self.links[d]
        L.busy = False
        b = int(t / self.cfg.period_s)
        if b < self.bins:
            L.delivered[ch, b] += size
        if tag >= 0:
            if d == WRITE:  # the packet-in reached the controller: it installs the rules
                tc = t + self.cfg.controller_delay_s
                for pch, rules in self.setup_paths[tag]:
                    for _ in range(rules):
                        self._push(tc, _ARRIVE, READ, pch, self.cfg.flow_mod_bytes, tag)
                        self.setup_left[tag] += 1
            self.setup_left[tag] -= 1
            if self.setup_left[tag] == 0:
                self.setup_done[tag] = t
                self._track_open(t, -1)

    def run_until(self, t_stop: float) -> None:
        """Process every event up to ``t_stop`` (inclusive); ``now`` becomes ``t_stop``."""
        ev = self._events
        links = self.links
        while ev and ev[0][0] <= t_stop:
            t, _, kind, d, ch, size, tag, t_arr = heapq.heappop(ev)
            self.now = t
            L = links[d]
            if kind == _ARRIVE:
                self._arrive(d, ch, size, tag, t)
            elif kind == _DONE:
                if t_arr < L.last_arrival[ch]:
                    L.out_of_order += 1
                else:
                    L.last_arrival[ch] = t_arr
                L.delays.append(t - t_arr)
                L.delay_sum[ch] += t - t_arr
                L.delay_count[ch] += 1
                self._done(d, ch, size, tag, t)
                self._transmit(d, t)
            elif kind == _WAKE:
                L.wake_pending[ch] = False
                if L.queues[ch]:
                    self._process(d, ch, t)
            elif kind == _FREE:   # ch holds the I/O thread (server="hypervisor")
                L.pool.busy[ch] = False
                self._visit(d, ch, t)
            else:  # _SETUP
                self._track_open(t, +1)
                self._arrive(d, ch, size, tag, t)
        if t_stop > self.now and math.isfinite(t_stop):
            self.now = t_stop
        self._track_open(self.now, 0)

    @property
    def finished(self) -> bool:
        return not self._events

    def result(self) -> SimResult:
        delays = [np.asarray(L.delays) for L in self.links]
        resets, growths = [], []
        for p in self.policies:
            calc = getattr(p, "calculator", None)
            resets.append(calc.resets if calc is not None else 0)
            growths.append(calc.growths if calc is not None else 0)
        return SimResult(
            cfg=self.cfg, policy=self.policy_name,
            delivered=[L.delivered.copy() for L in self.links],
            setup_times=np.asarray(self.setup_done) - np.asarray(self.setup_t0),
            queue_delay_mean=[float(x.mean()) if x.size else math.nan for x in delays],
            queue_delay_p95=[float(np.percentile(x, 95)) if x.size else math.nan
                             for x in delays],
            messages=[int(x.size) for x in delays],
            max_queue_bytes=[L.max_q for L in self.links], resets=resets, growths=growths,
            end_time=self.now, offered=[L.offered.copy() for L in self.links],
            channel_delay_mean=[L.delay_sum / np.maximum(L.delay_count, 1) for L in self.links],
            setup_tenants=np.asarray([p[0][0] // self.cfg.switches_per_tenant
                                      for p in self.setup_paths], dtype=np.int64),
            batch_mean=[L.pool.mean_batch() if L.pool is not None else math.nan
                        for L in self.links],
            server_busy=[self._busy_share(L) for L in self.links])

    def _busy_share(self, L: _Link) -> float:
        """Busy time of the shared resource over the traffic's duration (for the pool: the
        mean over its threads)."""
        busy = L.pool.busy_s.mean() if L.pool is not None else L.link_busy_s
        return float(busy / self.cfg.duration_s)


def simulate(cfg: SimConfig, policy: str, seed: int) -> SimResult:
    """Run ``cfg`` under ``policy`` until every message is delivered."""
    sim = ShapingSimulator(cfg, policy, seed)
    sim.run_until(math.inf)
    return sim.result()
