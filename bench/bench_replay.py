"""Prioritized replay throughput: this project's numpy sum-tree buffer
(:mod:`agents.ddpg.replay`) against RLlib 2.60's ``PrioritizedEpisodeReplayBuffer``, side by
side on one core.

Both hold the same 200,000 Pendulum-sized transitions (obs 3, action 1; 1,000 episodes of
200 steps, alpha = 0.6) plus, for ours, a DSMD-sized case (obs 3,128, action 201: the
`godaddy` `paper_type` layout). One iteration = sample a batch of B with beta = 0.4, then
write back |TD errors| for exactly those transitions. Median (min-max) of 5 runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import finish, fmt_stats, log, md_table, pin_one_core, stats

CORE = pin_one_core()

import numpy as np  # noqa: E402

from agents.ddpg.replay import PrioritizedReplay  # noqa: E402

EPISODES, LENGTH = 1000, 200


def ours(obs_dim: int, act_dim: int, batch: int, iters: int, n: int) -> list[float]:
    rng = np.random.default_rng(0)
    buf = PrioritizedReplay(n, obs_dim, act_dim, alpha=0.6, seed=0)
    chunk = 10_000
    for i in range(0, n, chunk):
        k = min(chunk, n - i)
        buf.add(rng.standard_normal((k, obs_dim), dtype=np.float32),
                rng.uniform(-1, 1, (k, act_dim)).astype(np.float32), rng.random(k),
                rng.standard_normal((k, obs_dim), dtype=np.float32), np.zeros(k))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(iters):
            s = buf.sample(batch, beta=0.4)
            buf.update_priorities(s.indices, rng.random(batch))
        times.append((time.perf_counter() - t) / iters * 1e3)
    return times


def rllib(batch: int, iters: int) -> list[float]:
    import gymnasium as gym
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode
    from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import (
        PrioritizedEpisodeReplayBuffer,
    )

    rng = np.random.default_rng(0)
    obs_space = gym.spaces.Box(-10, 10, (3,), np.float32)
    act_space = gym.spaces.Box(-1, 1, (1,), np.float32)
    buf = PrioritizedEpisodeReplayBuffer(capacity=EPISODES * LENGTH, alpha=0.6)
    eps = []
    for _ in range(EPISODES):
        obs = list(rng.standard_normal((LENGTH + 1, 3)).astype(np.float32))
        eps.append(SingleAgentEpisode(
            observations=obs, actions=list(rng.uniform(-1, 1, (LENGTH, 1)).astype(np.float32)),
            rewards=list(rng.random(LENGTH)), observation_space=obs_space,
            action_space=act_space, truncated=True, len_lookback_buffer=0))
    buf.add(eps)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(iters):
            buf.sample(num_items=batch, beta=0.4, n_step=1)
            buf.update_priorities(rng.random(batch) + 1e-6)
        times.append((time.perf_counter() - t) / iters * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer iterations (smoke test)")
    args = ap.parse_args()
    core = CORE
    t0 = time.perf_counter()
    n = EPISODES * LENGTH
    rows, results = [], []
    for name, fn, kw in [
        ("numpy sum-tree (this project)", ours, {"obs_dim": 3, "act_dim": 1, "n": n}),
        ("RLlib PrioritizedEpisodeReplayBuffer", rllib, {}),
        ("numpy sum-tree, DSMD godaddy sizes", ours, {"obs_dim": 3128, "act_dim": 201,
                                                       "n": 50_000}),
    ]:
        for batch in (256, 1024):
            iters = (5 if "RLlib" in name else 50) if args.quick else (
                20 if "RLlib" in name else 400)
            log(f"{name}, B={batch} ...")
            st = stats(fn(batch=batch, iters=iters, **kw))
            results.append({"buffer": name, "batch": batch, "ms_per_iteration": st, **kw})
            rows.append([name, f"{kw.get('n', n):,}", batch, fmt_stats(st, "{:.3f}")])
    table = md_table(["buffer", "transitions", "B", "ms per sample + priority update"], rows)
    notes = [f"median (min-max) of 5 runs, one core (core {core}), alpha 0.6, beta 0.4"]
    finish("bench_replay", {"rows": results, "total_s": time.perf_counter() - t0},
           table, notes, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
