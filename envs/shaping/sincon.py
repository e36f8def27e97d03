"""Sincon (Yoo et al., "Adaptive Control Channel Traffic Shaping for Virtualized SDN in
Clouds"): the adaptive limit calculator (Section III-A, Fig. 4) and the delay-based channel
shaper (Section III-B), plus the two reference policies the paper's evaluation compares with
(no shaping, the OpenVirteX baseline; a static equal split).

Pure Python/numpy: the simulator (:mod:`envs.shaping.simulator`) and the real asyncio shaper
(:mod:`delivery.shaper`) both drive these objects, so the logic exists once.

Units: throughput in bytes per second, time in seconds, sizes in bytes.

Fig. 4's flowchart, as :class:`AdaptiveLimitCalculator` implements it:

1. (1) global throughput ``G`` split ``initial_share : 1 - initial_share`` (1:1 in the paper)
   into the *global initial throughput* and the *adjustable throughput* (the pool); every
   channel starts at ``initial / N``.
2. (2) every ``check_every`` (5, footnote 2) control messages of a channel its throughput usage
   is checked.
3. (3) usage >= ``alpha`` (95%) of the channel's limit: the limit should grow.
4. (4) the pool is below ``beta`` (5%) of ``G``: (6) every limit is reset to the initial one
   and the pool refilled; otherwise (5) the limit grows by ``gamma`` taken from the pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = [
    "POLICY_NAMES",
    "SHAPER_MODELS",
    "AdaptiveLimitCalculator",
    "ChannelShaper",
    "CheckResult",
    "ExternalLimits",
    "LimitPolicy",
    "NoShaping",
    "RateMeter",
    "ShaperConfig",
    "ShapingError",
    "SinconConfig",
    "SinconLimits",
    "StaticSplit",
    "make_policy",
]


class ShapingError(ValueError):
    """Bad input to the shaping sub-problem (configuration, channel index, sizes)."""


def _positive(name: str, value: float, where: str) -> float:
    value = float(value)
    if not (value > 0 and math.isfinite(value)):
        raise ShapingError(f"{where}: {name} must be a positive finite number, got {value!r}")
    return value


def _fraction(name: str, value: float, where: str, *, open_low: bool = True) -> float:
    value = float(value)
    ok = (0 < value <= 1) if open_low else (0 <= value <= 1)
    if not ok:
        raise ShapingError(f"{where}: {name} must be in {'(0' if open_low else '[0'}, 1], "
                           f"got {value!r}")
    return value


@dataclass(frozen=True)
class SinconConfig:
    """Constants of the adaptive limit calculator (Section III-A). All are configuration.

    ``gamma`` is the growth step (5) as a fraction of the initial per-channel limit (the paper
    names gamma but gives no value). The default 0.1 is a fine step: limits never shrink
    except through the reset (6), so a coarse step hands bursting channels more than they
    use and empties the pool sooner (more resets). With the default workload and 4 tenants
    the mean setup time is lowest at the smallest step tried (0.1 / 0.25 / 0.5 / 1.0;
    ``python shaping.py sim.sincon.gamma=...`` runs the comparison).
    """

    global_throughput: float            # G, bytes/s of the link between NH and controllers
    initial_share: float = 0.5          # global initial throughput / G (1:1 split)
    check_every: int = 5                # control messages between usage checks (2)
    alpha: float = 0.95                 # usage / limit that triggers growth (3)
    beta: float = 0.05                  # reset when the pool falls under beta * G (4)
    gamma: float = 0.1                  # growth step / initial per-channel limit (5)

    def __post_init__(self) -> None:
        w = "SinconConfig"
        _positive("global_throughput", self.global_throughput, w)
        _fraction("initial_share", self.initial_share, w)
        _fraction("alpha", self.alpha, w)
        _fraction("beta", self.beta, w, open_low=False)
        _positive("gamma", self.gamma, w)
        if int(self.check_every) != self.check_every or self.check_every < 1:
            raise ShapingError(f"{w}: check_every must be a whole number >= 1, "
                               f"got {self.check_every!r}")


@dataclass(frozen=True)
class CheckResult:
    """What one usage check (2) did: ``grew`` (5), ``reset`` (6) or neither."""

    checked: bool = False
    grew: bool = False
    reset: bool = False


class AdaptiveLimitCalculator:
    """Fig. 4 for ``num_channels`` control channels sharing one link of throughput ``G``.

    ``limits`` (bytes/s per channel) and ``pool`` (the remaining adjustable throughput) are
    always consistent: ``sum(limits) + pool == G`` up to rounding, ``pool >= 0``, and so the
    limits never add up to more than ``G``.
    """

    def __init__(self, cfg: SinconConfig, num_channels: int) -> None:
        if int(num_channels) != num_channels or num_channels < 1:
            raise ShapingError(f"AdaptiveLimitCalculator: num_channels must be a whole "
                               f"number >= 1, got {num_channels!r}")
        self.cfg = cfg
        self.num_channels = int(num_channels)
        g = cfg.global_throughput
        self.global_initial = g * cfg.initial_share                        # (1)
        self.adjustable = g - self.global_initial
        self.initial_limit = self.global_initial / self.num_channels
        self.step = cfg.gamma * self.initial_limit
        self.reset_below = cfg.beta * g
        self.limits = np.full(self.num_channels, self.initial_limit, dtype=np.float64)
        self.pool = self.adjustable
        self._counts = np.zeros(self.num_channels, dtype=np.int64)
        self.checks = self.growths = self.resets = 0

    def _channel(self, channel: int) -> int:
        if not (0 <= int(channel) < self.num_channels) or int(channel) != channel:
            raise ShapingError(f"AdaptiveLimitCalculator: channel {channel!r} out of range "
                               f"0..{self.num_channels - 1}")
        return int(channel)

    def limit(self, channel: int) -> float:
        return float(self.limits[self._channel(channel)])

    def observe(self, channel: int, usage: float) -> CheckResult:
        """One control message of ``channel`` was processed; ``usage`` is the channel's
        current throughput (bytes/s). Every ``check_every``-th message runs (2)-(6)."""
        ch = self._channel(channel)
        self._counts[ch] += 1
        if self._counts[ch] % self.cfg.check_every:
            return CheckResult()
        self.checks += 1
        if usage < self.cfg.alpha * self.limits[ch]:                      # (3) no
            return CheckResult(checked=True)
        if self.pool < self.reset_below:                                  # (4) -> (6)
            self.reset()
            return CheckResult(checked=True, reset=True)
        inc = min(self.step, self.pool)                                   # (5)
        self.limits[ch] += inc
        self.pool -= inc
        self.growths += 1
        return CheckResult(checked=True, grew=True)

    def reset(self) -> None:
        """(6): every limit back to the initial one, the pool refilled."""
        self.limits.fill(self.initial_limit)
        self.pool = self.adjustable
        self.resets += 1


@dataclass(frozen=True)
class ShaperConfig:
    """Constants of the delay-based channel shaper (Section III-B). The paper omits the delay
    formula ("we omit the details"); it says only that the delay to the next processing
    grows as the throughput approaches the limit, that it is short at low usage (30 of 100
    Mbps) and that the throughput is managed to be close to the limit. Two readings:

    * ``model="bucket"`` (default): a rate shaper with a burst allowance of ``burst_s``
      seconds at the limit (one monitoring window, 0.1 s). The channel's recent usage is a
      leaky-bucket level (bytes processed, drained at the limit ``L``); the next processing
      waits ``max(0, level - L * burst_s) / L``. A channel under its limit over the last
      window sees no delay; past it the delay grows with the excess, so a backlogged channel
      runs at exactly ``L``.
    * ``model="power"`` (the alternative reading): after ``b`` bytes the next processing waits
      ``b / L * min((r / L) ** exponent, max_ratio)`` with ``r`` the metered throughput. It
      delays even a channel far under its limit (``b / L * r / L``), and a backlogged
      channel whose meter still reads above ``L`` (after its limit fell) runs *below* ``L``
      (``L ** 2 / r``) until the meter catches up.

    ``tau_s`` is the time constant of the usage meter that both report to the adaptive limit
    calculator (its "actual throughput usage", Section III-A).
    """

    model: str = "bucket"     # bucket | power
    burst_s: float = 0.5      # bucket: allowance, seconds at the limit (= tau_s)
    tau_s: float = 0.5        # exponential throughput meter (usage seen by the calculator)
    exponent: float = 1.0     # power: delay ~ (usage / limit) ** exponent
    max_ratio: float = 4.0    # power: cap of (usage / limit) ** exponent

    def __post_init__(self) -> None:
        if self.model not in SHAPER_MODELS:
            raise ShapingError(f"ShaperConfig: model must be one of {SHAPER_MODELS}, got "
                               f"{self.model!r}")
        for name in ("tau_s", "exponent", "max_ratio"):
            _positive(name, getattr(self, name), "ShaperConfig")
        if not (self.burst_s >= 0 and math.isfinite(self.burst_s)):
            raise ShapingError(f"ShaperConfig: burst_s must be >= 0, got {self.burst_s!r}")


SHAPER_MODELS = ("bucket", "power")


class RateMeter:
    """Throughput processed by one channel: an exponentially weighted rate with time
    constant ``tau`` (for a steady stream of ``R`` bytes/s it reads ``R``)."""

    __slots__ = ("rate", "t", "tau")

    def __init__(self, tau: float) -> None:
        self.tau = float(tau)
        self.rate = 0.0
        self.t = 0.0

    def read(self, now: float) -> float:
        return self.rate * math.exp(-max(0.0, now - self.t) / self.tau)

    def add(self, now: float, nbytes: float) -> float:
        self.rate = self.read(now) + nbytes / self.tau
        self.t = max(self.t, now)
        return self.rate


class ChannelShaper:
    """Section III-B for one channel, in either reading of :class:`ShaperConfig`:

    * ``bucket``: the next processing waits ``max(0, level - L * burst_s) / L``, ``level``
      the bytes processed recently (a leaky bucket drained at the limit ``L``);
    * ``power``: it waits ``b / L * min((r / L) ** p, max_ratio)`` after ``b`` bytes, ``r``
      the metered throughput (fixed point of ``r = L**2 / r`` at the limit).

    Both converge to ``L`` for a backlogged channel and delay less at low usage. Messages
    are never dropped: the caller queues them. A limit of ``inf`` (or >= ``bypass_at``)
    means no shaping (delay 0)."""

    __slots__ = ("bypass_at", "cfg", "level", "meter", "t_level")

    def __init__(self, cfg: ShaperConfig | None = None, bypass_at: float = math.inf) -> None:
        self.cfg = cfg or ShaperConfig()
        self.meter = RateMeter(self.cfg.tau_s)
        self.bypass_at = float(bypass_at)
        self.level = 0.0
        self.t_level = 0.0

    def process(self, now: float, nbytes: float, limit: float) -> tuple[float, float]:
        """Account ``nbytes`` processed at ``now``; returns ``(delay, usage)``."""
        if nbytes < 0:
            raise ShapingError(f"ChannelShaper: message size must be >= 0, got {nbytes!r}")
        usage = self.meter.add(now, nbytes)
        if limit >= self.bypass_at or math.isinf(limit):
            self.level, self.t_level = 0.0, now
            return 0.0, usage
        if not limit > 0:
            raise ShapingError(f"ChannelShaper: limit must be > 0, got {limit!r}")
        if self.cfg.model == "bucket":
            self.level = max(0.0, self.level - limit * max(0.0, now - self.t_level)) + nbytes
            self.t_level = max(self.t_level, now)
            return max(0.0, self.level - limit * self.cfg.burst_s) / limit, usage
        ratio = min((usage / limit) ** self.cfg.exponent, self.cfg.max_ratio)
        return nbytes / limit * ratio, usage


class LimitPolicy(Protocol):
    """Where a channel's current throughput limit comes from (per link direction)."""

    name: str
    limits: np.ndarray

    def on_processed(self, channel: int, usage: float) -> None:
        """A message of ``channel`` was processed; ``usage`` is its measured throughput."""


class NoShaping:
    """The OpenVirteX baseline: no limits (every channel may use the whole link)."""

    name = "none"

    def __init__(self, num_channels: int, global_throughput: float) -> None:
        self.limits = np.full(int(num_channels), math.inf)

    def on_processed(self, channel: int, usage: float) -> None:
        return None


class StaticSplit:
    """A static equal split: every channel limited to ``G / N`` for the whole run."""

    name = "static"

    def __init__(self, num_channels: int, global_throughput: float) -> None:
        self.limits = np.full(int(num_channels), float(global_throughput) / int(num_channels))

    def on_processed(self, channel: int, usage: float) -> None:
        return None


class SinconLimits:
    """Sincon's limits: an :class:`AdaptiveLimitCalculator` fed by every processed message."""

    name = "sincon"

    def __init__(self, num_channels: int, global_throughput: float,
                 cfg: SinconConfig | None = None) -> None:
        cfg = cfg or SinconConfig(global_throughput=global_throughput)
        if cfg.global_throughput != global_throughput:
            raise ShapingError(f"SinconLimits: cfg.global_throughput {cfg.global_throughput} "
                               f"!= link throughput {global_throughput}")
        self.calculator = AdaptiveLimitCalculator(cfg, num_channels)
        self.limits = self.calculator.limits  # the same array: updated in place

    def on_processed(self, channel: int, usage: float) -> None:
        self.calculator.observe(channel, usage)


class ExternalLimits:
    """Limits set from outside (the RL agent, once per monitoring period)."""

    name = "external"

    def __init__(self, num_channels: int, global_throughput: float) -> None:
        self.global_throughput = float(global_throughput)
        self.limits = np.full(int(num_channels), self.global_throughput / int(num_channels))

    def set(self, limits: np.ndarray) -> None:
        limits = np.asarray(limits, dtype=np.float64)
        if limits.shape != self.limits.shape:
            raise ShapingError(f"ExternalLimits.set: expected {self.limits.shape[0]} limits, "
                               f"got shape {limits.shape}")
        if not np.all(limits > 0):
            raise ShapingError(f"ExternalLimits.set: limits must be > 0, got min "
                               f"{limits.min()!r}")
        self.limits[:] = limits

    def on_processed(self, channel: int, usage: float) -> None:
        return None


POLICY_NAMES = ("none", "static", "sincon", "external")


def make_policy(name: str, num_channels: int, global_throughput: float,
                sincon: SinconConfig | None = None) -> LimitPolicy:
    """The limit policy called ``name`` (one of :data:`POLICY_NAMES`)."""
    if name == "none":
        return NoShaping(num_channels, global_throughput)
    if name == "static":
        return StaticSplit(num_channels, global_throughput)
    if name == "sincon":
        return SinconLimits(num_channels, global_throughput, sincon)
    if name == "external":
        return ExternalLimits(num_channels, global_throughput)
    raise ShapingError(f"unknown shaping policy {name!r}; known: {', '.join(POLICY_NAMES)}")
