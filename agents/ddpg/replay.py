"""Proportional prioritized experience replay (Schaul et al., 2016, arXiv:1511.05952).

RLlib 2.60's ``PrioritizedEpisodeReplayBuffer`` builds one ``SingleAgentEpisode`` per sampled
transition in Python, per sampled batch; with one update per environment step that, not
the network, bounds training (see the benchmarks page, ``docs/benchmarks.md``). This buffer stores
transitions in preallocated numpy arrays and keeps priorities in a sum-tree whose batched
prefix-sum search and updates are vectorised over the batch (O(B log N) numpy work, no
Python loop over transitions).

Schaul et al., Section 3.3 and Algorithm 1:

* transition i is sampled with probability ``P(i) = p_i^alpha / sum_k p_k^alpha``
  (stratified: one uniform draw in each of B equal segments of the total mass);
* its importance-sampling weight is ``w_i = (N P(i))^-beta / max_j w_j``, with beta
  annealed from ``beta0`` to 1 over training (:func:`linear_schedule`);
* new transitions enter with the maximal priority seen so far;
* after a learner update, ``p_i = |delta_i| + eps`` for exactly the sampled transitions
  (:meth:`PrioritizedReplay.update_priorities` refuses any other index set).

``alpha = 0`` (or ``prioritized=False``) gives uniform replay with unit weights, the
ablation switch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["PrioritizedReplay", "ReplayBatch", "SumTree", "linear_schedule"]


def linear_schedule(start: float, end: float, steps: int):
    """``t -> start + (end - start) * min(t / steps, 1)`` (beta annealing)."""
    if steps <= 0:
        return lambda t: end
    return lambda t: start + (end - start) * min(max(t, 0) / steps, 1.0)


class SumTree:
    """A complete binary tree over ``capacity`` leaves; each node holds the sum of its leaves.

    Leaves live at ``[size, 2 size)`` with ``size`` the next power of two; node ``i`` has
    children ``2i`` and ``2i + 1``; the total is ``tree[1]``.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = int(capacity)
        self.size = 1 << max(int(np.ceil(np.log2(capacity))), 0)
        self.depth = int(np.log2(self.size))
        self.tree = np.zeros(2 * self.size, dtype=np.float64)

    @property
    def total(self) -> float:
        return float(self.tree[1])

    def leaves(self, idx: np.ndarray | None = None) -> np.ndarray:
        base = self.tree[self.size:self.size + self.capacity]
        return base if idx is None else self.tree[self.size + np.asarray(idx)]

    def set(self, idx: np.ndarray, values: np.ndarray) -> None:
        """Set leaves ``idx`` to ``values`` and repair the sums on their paths (vectorised)."""
        idx = np.asarray(idx, dtype=np.int64)
        values = np.broadcast_to(np.asarray(values, dtype=np.float64), idx.shape)
        if idx.size == 0:
            return
        if idx.min() < 0 or idx.max() >= self.capacity:
            raise IndexError(f"leaf index out of range 0..{self.capacity - 1}")
        if np.any(values < 0) or not np.all(np.isfinite(values)):
            raise ValueError("priorities must be finite and non-negative")
        nodes = idx + self.size
        self.tree[nodes] = values  # for repeated indices the last value wins
        nodes = np.unique(nodes >> 1)
        while nodes.size and nodes[0] >= 1:
            self.tree[nodes] = self.tree[2 * nodes] + self.tree[2 * nodes + 1]
            if nodes[0] == 1:
                break
            nodes = np.unique(nodes >> 1)

    def find(self, mass: np.ndarray) -> np.ndarray:
        """Leaf index of each prefix mass in ``[0, total)`` (vectorised descent)."""
        mass = np.array(mass, dtype=np.float64, copy=True)
        node = np.ones(mass.shape, dtype=np.int64)
        for _ in range(self.depth):
            left = 2 * node
            left_sum = self.tree[left]
            go_right = mass >= left_sum
            mass -= np.where(go_right, left_sum, 0.0)
            node = left + go_right
        leaf = node - self.size
        # float round-off can land on an empty leaf at the right edge: step back to a live one
        return np.minimum(leaf, self.capacity - 1)


@dataclass(frozen=True)
class ReplayBatch:
    """A sampled batch; ``indices`` must come back with the TD errors."""

    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    next_obs: np.ndarray
    terminateds: np.ndarray
    weights: np.ndarray  # importance-sampling weights, max 1
    indices: np.ndarray


class PrioritizedReplay:
    """A ring buffer of transitions with proportional prioritized sampling."""

    def __init__(self, capacity: int, obs_dim: int, action_dim: int, *, alpha: float = 0.6,
                 beta: float | None = 0.4, eps: float = 1e-6, prioritized: bool = True,
                 seed: int = 0, obs_dtype=np.float32) -> None:
        if alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        if eps <= 0:
            raise ValueError(f"eps must be positive, got {eps}")
        self.capacity = int(capacity)
        self.alpha = float(alpha) if prioritized else 0.0
        self.beta = beta
        self.eps = float(eps)
        self.prioritized = bool(prioritized) and self.alpha > 0
        self.rng = np.random.default_rng(seed)
        self.obs = np.zeros((capacity, obs_dim), dtype=obs_dtype)
        self.next_obs = np.zeros((capacity, obs_dim), dtype=obs_dtype)
        self.actions = np.zeros((capacity, action_dim), dtype=np.float32)
        self.rewards = np.zeros(capacity, dtype=np.float32)
        self.terminateds = np.zeros(capacity, dtype=np.float32)
        self.tree = SumTree(capacity)
        self.max_priority = 1.0
        self.pos = 0
        self.count = 0
        self.added = 0
        self._pending: np.ndarray | None = None

    def __len__(self) -> int:
        return self.count

    # ------------------------------------------------------------------ writing
    def add(self, obs: np.ndarray, actions: np.ndarray, rewards: np.ndarray,
            next_obs: np.ndarray, terminateds: np.ndarray) -> np.ndarray:
        """Append a batch of transitions (leading axis = transitions); returns their slots."""
        obs = np.asarray(obs)
        n = obs.shape[0]
        if n > self.capacity:
            raise ValueError(f"cannot add {n} transitions to a buffer of {self.capacity}")
        slots = (self.pos + np.arange(n)) % self.capacity
        self.obs[slots] = obs
        self.next_obs[slots] = next_obs
        self.actions[slots] = np.asarray(actions).reshape(n, -1)
        self.rewards[slots] = rewards
        self.terminateds[slots] = terminateds
        self.tree.set(slots, self.max_priority ** self.alpha if self.prioritized else 1.0)
        if self._pending is not None and np.isin(self._pending, slots).any():
            self._pending = None  # overwritten before their TD errors came back
        self.pos = int((self.pos + n) % self.capacity)
        self.count = min(self.count + n, self.capacity)
        self.added += n
        return slots

    # ------------------------------------------------------------------ sampling
    def sample(self, batch_size: int, beta: float | None = None) -> ReplayBatch:
        """Stratified proportional sample of ``batch_size`` transitions with IS weights."""
        if self.count == 0:
            raise ValueError("cannot sample from an empty buffer")
        beta = self.beta if beta is None else beta
        if self.prioritized:
            total = self.tree.total
            seg = total / batch_size
            mass = (np.arange(batch_size) + self.rng.random(batch_size)) * seg
            idx = self.tree.find(np.minimum(mass, np.nextafter(total, 0)))
            idx = np.minimum(idx, self.count - 1) if self.count < self.capacity else idx
            p = self.tree.leaves(idx) / total
            if beta is None or beta == 0:
                weights = np.ones(batch_size, dtype=np.float32)
            else:
                w = (self.count * p) ** (-beta)
                weights = (w / w.max()).astype(np.float32)
        else:
            idx = self.rng.integers(0, self.count, batch_size)
            weights = np.ones(batch_size, dtype=np.float32)
        self._pending = idx
        return ReplayBatch(self.obs[idx], self.actions[idx], self.rewards[idx],
                           self.next_obs[idx], self.terminateds[idx], weights, idx)

    def update_priorities(self, indices: np.ndarray, td_errors: np.ndarray) -> None:
        """``p_i = |delta_i| + eps`` for exactly the transitions of the last :meth:`sample`."""
        indices = np.asarray(indices, dtype=np.int64)
        td = np.abs(np.asarray(td_errors, dtype=np.float64)).reshape(-1)
        if self._pending is None:
            raise ValueError("update_priorities() without a preceding sample() (or the "
                             "sampled transitions were overwritten meanwhile)")
        if indices.shape != self._pending.shape or not np.array_equal(indices, self._pending):
            raise ValueError("update_priorities() must receive exactly the indices of the last "
                             "sample(), in order")
        if td.shape != indices.shape:
            raise ValueError(f"{td.size} TD errors for {indices.size} sampled transitions")
        if not np.all(np.isfinite(td)):
            raise ValueError("TD errors must be finite")
        self._pending = None
        if not self.prioritized:
            return
        pri = td + self.eps
        self.max_priority = max(self.max_priority, float(pri.max()))
        self.tree.set(indices, pri ** self.alpha)

    def priorities(self) -> np.ndarray:
        """``p_i^alpha`` of the stored transitions (for tests and diagnostics)."""
        return self.tree.leaves()[:self.count].copy()

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | Path) -> None:
        """Write the stored transitions, priorities, cursor and RNG state to ``path`` (.npz;
        atomic: a crash leaves the previous file)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        n = self.count
        with open(tmp, "wb") as fh:
            np.savez(fh, obs=self.obs[:n], next_obs=self.next_obs[:n],
                     actions=self.actions[:n], rewards=self.rewards[:n],
                     terminateds=self.terminateds[:n], leaves=self.tree.leaves()[:n],
                     meta=np.array(json.dumps({
                         "capacity": self.capacity, "pos": self.pos, "count": n,
                         "added": self.added, "max_priority": self.max_priority,
                         "alpha": self.alpha, "prioritized": self.prioritized,
                         "rng": self.rng.bit_generator.state})))
        os.replace(tmp, path)

    def load(self, path: str | Path) -> None:
        """Restore what :meth:`save` wrote; the buffer's shapes and capacity must match."""
        with np.load(Path(path)) as z:
            meta = json.loads(str(z["meta"]))
            if meta["capacity"] != self.capacity or z["obs"].shape[1:] != self.obs.shape[1:] \
                    or z["actions"].shape[1:] != self.actions.shape[1:]:
                raise ValueError(
                    f"{path}: replay of capacity {meta['capacity']}, obs {z['obs'].shape[1:]}, "
                    f"actions {z['actions'].shape[1:]} does not fit this buffer (capacity "
                    f"{self.capacity}, obs {self.obs.shape[1:]}, actions "
                    f"{self.actions.shape[1:]})")
            n = int(meta["count"])
            for name in ("obs", "next_obs", "actions", "rewards", "terminateds"):
                getattr(self, name)[:n] = z[name]
            self.tree.set(np.arange(n), z["leaves"])
        self.pos, self.count, self.added = int(meta["pos"]), n, int(meta["added"])
        self.max_priority = float(meta["max_priority"])
        self.rng.bit_generator.state = meta["rng"]
        self._pending = None
