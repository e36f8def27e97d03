"""The observation builder: one implementation for the environment, evaluation, the policy
server and the controller adapter (a train/serve feature difference is a bug).

Variants (``variant``), every value in [-1, 1], float32:

``paper`` -- the state of SMART Section V-D-1, ``S_i = (X, Y, C_b(i), C_p(i), S(i))``:

=================  ===========  ==========================================================
slice              length       value
=================  ===========  ==========================================================
``x``              M_cat        1 if catalogue type m is on RPC, else 0
``y``              M_cat        t / K if type m is on topic t, else 0 (Y as a topic index:
                                the paper's one-hot Y would be M_cat x K values)
``controller``     2            available bandwidth 1 - bw / C_b and CPU 1 - sends / C_p
``nodes``          N            available node bandwidth 1 - b(n) / s(n)
=================  ===========  ==========================================================

``paper_type`` -- ``paper`` plus the features of the type being decided (the paper's state
does not say which type that is): ``type`` = [log-rate, |D| / N, RPC bandwidth share
f|D|/C_b, RPC CPU share |D|/C_p] and ``gamma`` = Gamma[m, :] (N values, 1 for a destination).

``channel`` -- a compact, size-independent state for large K and N: 8 globals
(available bandwidth, CPU, log-rate, |D|/N, progress through the episode, peak node load,
RPC bandwidth and CPU shares) and, per channel c in 0..K, four blocks of K+1 values:
``efficiency`` f|D| / (increase of sum_n b(n)) (1 = no redundancy), ``fresh`` fraction of
D(m) that would newly subscribe, ``subscribers`` S_t / N and ``load`` log-rate of R_t.

Values outside [-1, 1] (a heavily overloaded controller or node) are clipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np

from . import kernels as _k
from .cost import CostState
from .errors import DSMDError
from .instance import DSMDInstance

__all__ = ["VARIANTS", "ObsVariant", "ObservationBuilder", "ObservationLayout"]

ObsVariant = Literal["paper", "paper_type", "channel"]
VARIANTS: tuple[str, ...] = ("paper", "paper_type", "channel")
_LOG_RATE_SCALE = _k._LOG_RATE_SCALE  # log10(1 + f) / 12 in [0, 1] for f < 1 Tbit/s
_NO_NODES = np.zeros(0, np.int64)


@dataclass(frozen=True)
class ObservationLayout:
    """The fixed observation layout of a scenario (part of the policy's contract)."""

    variant: str
    catalog_size: int
    num_nodes: int
    num_topics: int

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise DSMDError(f"observation variant must be one of {VARIANTS}, got {self.variant!r}")

    def fields(self) -> list[tuple[str, int]]:
        mc, n, k1 = self.catalog_size, self.num_nodes, self.num_topics + 1
        if self.variant == "channel":
            return [("globals", 8), ("efficiency", k1), ("fresh", k1), ("subscribers", k1),
                    ("load", k1)]
        out = [("x", mc), ("y", mc), ("controller", 2), ("nodes", n)]
        if self.variant == "paper_type":
            out += [("type", 4), ("gamma", n)]
        return out

    def slices(self) -> dict[str, slice]:
        out, pos = {}, 0
        for name, length in self.fields():
            out[name] = slice(pos, pos + length)
            pos += length
        return out

    @property
    def size(self) -> int:
        return sum(length for _, length in self.fields())

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        return (np.full(self.size, -1.0, np.float32), np.full(self.size, 1.0, np.float32))

    def to_dict(self) -> dict:
        return asdict(self) | {"size": self.size, "fields": self.fields()}


class ObservationBuilder:
    """Builds observations for one instance from a :class:`CostState`."""

    def __init__(self, layout: ObservationLayout, inst: DSMDInstance) -> None:
        if inst.num_nodes != layout.num_nodes or inst.num_topics != layout.num_topics:
            raise DSMDError(
                f"instance has N={inst.num_nodes}, K={inst.num_topics} but the observation "
                f"layout expects N={layout.num_nodes}, K={layout.num_topics}")
        assert inst.catalog_index is not None  # filled in DSMDInstance.__post_init__
        # the channel variant reads no per-type slot: any catalogue fits it (the paper
        # variants' X and Y have one slot per catalogue type)
        if (layout.variant != "channel" and inst.num_types
                and int(inst.catalog_index.max()) >= layout.catalog_size):
            raise DSMDError(
                f"instance type {int(inst.catalog_index.max())} is outside the observation "
                f"layout's catalogue of {layout.catalog_size} types")
        self.layout = layout
        self.inst = inst
        self._sl = layout.slices()
        self.buffer = np.zeros(layout.size, dtype=np.float32)
        self._cat = inst.catalog_index.astype(np.int64)
        self._rate = inst.rate_bps.tolist()
        self._fan = inst.fanout.tolist()
        self._last_type: int | None = None
        # the channel variant's type-independent blocks and the S_t, R_t they were computed
        # from (envs.dsmd.kernels._refresh_blocks)
        k1 = layout.num_topics + 1
        if layout.variant == "channel" and (self._sl["globals"] != slice(0, 8)
                                            or self._sl["efficiency"].start != 8):
            raise DSMDError("the channel kernels write 8 globals, then the 4 blocks")
        self.seen = np.full((2, k1), -1, np.int64)
        self.blocks = np.zeros((2, k1), np.float32)
        #: whether :meth:`DecisionStep.observe` observes with one compiled call
        #: (:func:`envs.dsmd.kernels.observe_next`, the ``channel`` layout): it hands that
        #: call ``buffer``, ``seen`` and ``blocks``
        self.compiled = layout.variant == "channel"

    # ------------------------------------------------------------------ state tracking
    def reset(self, state: CostState) -> None:
        """Re-read the whole assignment (X, Y) from ``state``."""
        self.buffer[:] = 0.0
        self._last_type = None
        if self.layout.variant == "channel":
            return
        ch = state.channel
        x = self.buffer[self._sl["x"]]
        y = self.buffer[self._sl["y"]]
        x[self._cat] = (ch == 0)
        y[self._cat] = np.where(ch > 0, ch / max(self.layout.num_topics, 1), 0.0)

    def on_move(self, m: int, c: int) -> None:
        """Record that type ``m`` moved to channel ``c`` (O(1))."""
        if self.layout.variant == "channel":
            return
        i = int(self._cat[m])
        self.buffer[self._sl["x"].start + i] = 1.0 if c == 0 else 0.0
        self.buffer[self._sl["y"].start + i] = (c / max(self.layout.num_topics, 1) if c > 0
                                                  else 0.0)

    # ------------------------------------------------------------------ observation
    def observe_many(self, state: CostState, ms: np.ndarray, progress: float = 0.0
                     ) -> np.ndarray:
        """``[len(ms), size]``: the observation before deciding each unassigned type of ``ms``
        from the same state (each as if it were the next one). Equal, row by row, to
        :meth:`observe` (vectorised for the ``channel`` variant)."""
        ms = np.asarray(ms, dtype=np.int64)
        out = np.empty((ms.size, self.layout.size), dtype=np.float32)
        self.rows(state, ms, progress)(0, ms.size, out)
        return out

    def rows(self, state: CostState, ms: np.ndarray, progress: float = 0.0
             ) -> Callable[[int, int, np.ndarray], None]:
        """:meth:`observe_many` in parts: ``fill(lo, hi, out)`` writes the observations of
        ``ms[lo:hi]`` into ``out`` (``[hi - lo, size]`` float32). For the ``channel``
        variant, what the rows share is computed here, and ``fill`` only reads the state and
        that, so calls for disjoint ranges may run on several threads at once (how
        :meth:`serving.bundles.static.PolicyBundle.score_rows` builds a batch's observations on the
        threads that score them). Valid until ``state`` changes."""
        ms = np.asarray(ms, dtype=np.int64)
        if self.layout.variant != "channel":
            done = (np.stack([self.observe(state, int(m), progress) for m in ms]) if ms.size
                    else np.zeros((0, self.layout.size), np.float32))

            def copy(lo: int, hi: int, out: np.ndarray) -> None:
                out[...] = done[lo:hi]
            return copy
        inst = self.inst
        if ms.size and np.any(state.channel[ms] != -1):
            raise DSMDError("observe_many needs unassigned types (take them off their "
                            "channels first)")
        cb, cp = self._controller(state)
        peak = _k.observation_shared(state.topic_subscribers, state.topic_rate, inst.num_nodes,
                                     state.node_traffic, inst.inv_capacity, self.seen,
                                     self.blocks)
        blocks = self.blocks.copy()  # a later observe() refreshes the builder's own
        sub_count, dest_ptr, dest_idx = state.sub_count, inst.dest_ptr, inst.dest_idx
        rate_bps, subscribers, rate = inst.rate_bps, state.topic_subscribers, state.topic_rate
        num_nodes, prog = inst.num_nodes, float(progress)
        bw_cap, cpu_cap = inst.controller_bw_bps, inst.controller_cpu

        def fill(lo: int, hi: int, out: np.ndarray) -> None:
            # every row by the kernel observe() uses: the same float32 values
            _k.channel_observation_rows(out, sub_count, dest_ptr, dest_idx, ms[lo:hi], rate_bps,
                                        subscribers, rate, num_nodes, cb, cp, prog, peak,
                                        bw_cap, cpu_cap, blocks)
        return fill

    def _controller(self, state: CostState) -> tuple[float, float]:
        """Available controller bandwidth and CPU, 1 - bw / C_b and 1 - sends / C_p (>= -1)."""
        inst = self.inst
        return (max(1.0 - state.controller_bw / inst.controller_bw_bps, -1.0),
                max(1.0 - state.controller_cpu / inst.controller_cpu, -1.0))

    def observe(self, state: CostState, m: int | None, progress: float = 0.0) -> np.ndarray:
        """The observation before deciding type ``m`` (None after the last type)."""
        inst, buf, sl = self.inst, self.buffer, self._sl
        cb, cp = self._controller(state)
        if self.layout.variant == "channel":
            if m is None:
                f = d = 0
                dest, undecided = _NO_NODES, False
            else:
                f, d, dest = self._rate[m], self._fan[m], inst.destinations(m)
                undecided = state.channel[m] < 0
            _k.channel_observation(buf, state.sub_count, dest, f, d, state.topic_subscribers,
                                   state.topic_rate, inst.num_nodes, undecided, cb, cp,
                                   float(progress), state.node_traffic, inst.inv_capacity,
                                   inst.controller_bw_bps, inst.controller_cpu, self.seen,
                                   self.blocks)
            return buf.copy()
        if m is not None:
            f = self._rate[m]
            d = self._fan[m]
            tfeat = (min(math.log10(1.0 + f) / _LOG_RATE_SCALE, 1.0), d / inst.num_nodes,
                     min(f * d / inst.controller_bw_bps, 1.0), min(d / inst.controller_cpu, 1.0))
        else:
            tfeat = (0.0, 0.0, 0.0, 0.0)
        buf[sl["controller"]] = (cb, cp)
        nodes = buf[sl["nodes"]]
        np.subtract(1.0, state.node_ratio(), out=nodes, casting="same_kind")
        np.maximum(nodes, -1.0, out=nodes)
        if self.layout.variant == "paper_type":
            buf[sl["type"]] = tfeat
            gamma = buf[sl["gamma"]]
            if self._last_type is not None:
                gamma[inst.destinations(self._last_type)] = 0.0
            if m is not None:
                gamma[inst.destinations(m)] = 1.0
            self._last_type = m
        return buf.copy()
