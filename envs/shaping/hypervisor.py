"""The network hypervisor's processing as the shared resource of the control channels
(``SimConfig.server = "hypervisor"`` in :mod:`envs.shaping.simulator`).

What the paper gives (Sincon, Yoo et al., "Adaptive Control Channel Traffic Shaping for
Virtualized SDN in Clouds"):

* Sincon is "a part of the NH" (Section III); "a control channel is a TCP connection with a
  queue" and the NH has two operations per channel, channel_read (packets from the tenant
  controllers) and channel_write (packets to them) (Section III, Fig. 3).
* The channel shaper shapes "by providing a delay between control channel processing"; it
  "calculates the throughput processed" and "sets a delay to the next processing"
  (Section III-B): the shaper sits in front of the NH's processing of a channel.
* The NH is OpenVirteX (OVX, OpenFlow 1.3; Sections II-B and IV); without Sincon "control
  channels that send messages earlier than other control channels dominate" (Section II-B).

Modelling assumptions (not in the paper):

* OVX runs its channels on Netty's NIO event loops: a small pool of I/O threads
  (``io_threads``, one pool per direction: OVX's controller-side and switch-side channel
  factories each have their own worker pool), each connection bound to one thread for its
  life, round-robin in connection order (Netty's worker chooser).
* A thread loops over its channels in registration order (round-robin, from the one after
  the channel it served last) and on each visit reads and processes *everything the channel
  has buffered* (up to ``max_batch`` messages; 0 = all, as a Netty read loop does up to its
  max messages per read) before it moves on; messages that arrive meanwhile wait for the next
  visit. Processing costs ``message_s + byte_s * size`` seconds of the thread per message
  (decoding and virtualisation, then the copy); a message is delivered when its processing
  ends (the 1,400 Mbps link of Section III-A is taken as far from loaded: no queue on it).
* A shaped channel hands the hypervisor only what its shaper releases (the release rate is
  bounded by the channel's limit), so its batches stay small; without shaping a channel hands
  over everything it received, so a channel that keeps a backlog gets big batches and the
  other channels of its thread wait behind them.

No gymnasium, no event loop here: the simulator schedules the events, this module holds the
pool's state (which thread serves which channel, what each channel has buffered, where each
thread's round-robin is).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .sincon import ShapingError

__all__ = ["SERVERS", "HypervisorConfig", "IOThreadPool"]

#: the shared resource of the channels of one direction: the link (transmission at ``G``)
#: or the hypervisor's I/O threads (this module)
SERVERS = ("link", "hypervisor")


@dataclass(frozen=True)
class HypervisorConfig:
    """The hypervisor's I/O threads of one direction (every field is configuration).

    Defaults: 2 threads; 0.4 ms per message plus 0.4 us per byte, i.e. 0.5 ms for the
    workload's mean message of 250 B, so each thread processes ~500 kB/s and the pool of 2
    about ``G`` = 1 MB/s of the default configuration: the unshaped hypervisor then carries
    the same load as the link model (~77% with 4 tenants, saturated in bursts; the regime
    chosen for Section II-B), and only the way the shared resource serves the channels
    differs. The split between per-message and per-byte cost is an assumption (OpenFlow
    processing is dominated by per-message work).
    """

    io_threads: int = 2
    message_s: float = 4.0e-4
    byte_s: float = 4.0e-7
    max_batch: int = 0           # messages per visit; 0 = everything buffered

    def __post_init__(self) -> None:
        w = "HypervisorConfig"
        for name in ("io_threads", "max_batch"):
            v = getattr(self, name)
            low = 1 if name == "io_threads" else 0
            if int(v) != v or v < low:
                raise ShapingError(f"{w}: {name} must be a whole number >= {low}, got {v!r}")
        for name in ("message_s", "byte_s"):
            v = float(getattr(self, name))
            if not (v >= 0 and math.isfinite(v)):
                raise ShapingError(f"{w}: {name} must be >= 0, got {v!r}")
        if self.message_s <= 0 and self.byte_s <= 0:
            raise ShapingError(f"{w}: message_s or byte_s must be > 0")

    def cost(self, nbytes: float) -> float:
        """Seconds of one thread to process a message of ``nbytes``."""
        return self.message_s + self.byte_s * nbytes


class IOThreadPool:
    """One direction's I/O threads. ``order``: the channels in connection order (channel
    ``order[i]`` is bound to thread ``i % io_threads``)."""

    def __init__(self, cfg: HypervisorConfig, order: Sequence[int] | np.ndarray,
                 num_channels: int) -> None:
        order = [int(c) for c in order]
        if sorted(order) != list(range(num_channels)):
            raise ShapingError(f"IOThreadPool: order must be a permutation of "
                               f"0..{num_channels - 1}")
        self.cfg = cfg
        k = int(cfg.io_threads)
        self.members: list[list[int]] = [order[i::k] for i in range(k)]
        self.thread_of = np.empty(num_channels, dtype=np.int64)
        for th, chans in enumerate(self.members):
            self.thread_of[chans] = th
        self.cursor = [-1] * k                   # index (in members) of the last visit
        self.busy = [False] * k
        self.ready: list[deque] = [deque() for _ in range(num_channels)]   # handed over
        self.ready_bytes = np.zeros(num_channels)
        self.visits = np.zeros(num_channels, dtype=np.int64)
        self.batch_messages = np.zeros(num_channels, dtype=np.int64)
        self.busy_s = np.zeros(k)                # processing time per thread

    def hand(self, channel: int, msg: tuple) -> int:
        """The channel's shaper released ``msg`` (``(size, arrival, tag)``); returns the
        thread that serves it."""
        self.ready[channel].append(msg)
        self.ready_bytes[channel] += msg[0]
        return int(self.thread_of[channel])

    def take(self, thread: int) -> tuple[int, list[tuple]] | None:
        """The next visit of ``thread``: the first channel after its last one (round-robin)
        with something buffered, and its batch; ``None`` when no channel has anything."""
        chans = self.members[thread]
        m = len(chans)
        start = self.cursor[thread]
        cap = int(self.cfg.max_batch)
        for j in range(1, m + 1):
            idx = (start + j) % m
            ch = chans[idx]
            q = self.ready[ch]
            if q:
                self.cursor[thread] = idx
                k = len(q) if cap <= 0 else min(cap, len(q))
                batch = [q.popleft() for _ in range(k)]
                self.ready_bytes[ch] -= sum(b[0] for b in batch)
                self.visits[ch] += 1
                self.batch_messages[ch] += k
                return ch, batch
        return None

    def mean_batch(self) -> float:
        """Messages per visit, over every visit."""
        v = int(self.visits.sum())
        return float(self.batch_messages.sum() / v) if v else math.nan

    def idle(self) -> bool:
        return not any(self.busy) and not any(self.ready)
