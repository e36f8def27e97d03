"""DDPG correctness on a known task: TD3-flavoured DDPG with prioritized replay
(:mod:`agents.ddpg`) on ``Pendulum-v1``; target: mean evaluation return >= -250 within
20,000 environment steps on each of 3 seeds (the project's correctness target).

Every 2,000 environment steps the deterministic actor (``forward_inference``, no noise) plays
10 evaluation episodes on seeded environments; the result per seed is the first step count
at which the mean evaluation return reached -250, and the evaluation curve. Settings:
batch 256, one gradient update per environment step, 1,000 random warm-up steps, actor and
critic lr 1e-3, tau 5e-3, gamma 0.99, exploration noise 0.1, TD3 flags on, PER alpha 0.6,
beta 0.4 -> 1. Runs the seeds one after another (``--parallel 2`` uses both cores).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _common import finish, log, md_table  # noqa: E402

TARGET = -250.0


def evaluate(module, seed: int, episodes: int = 10) -> float:
    import gymnasium as gym
    import numpy as np
    import torch
    from ray.rllib.core.columns import Columns

    env = gym.make("Pendulum-v1")
    low, high = env.action_space.low, env.action_space.high
    dev = next(module.parameters()).device  # the learner's: the CPU or a GPU
    returns = []
    for i in range(episodes):
        obs, _ = env.reset(seed=10_000 * (seed + 1) + i)
        total, done = 0.0, False
        while not done:
            with torch.no_grad():
                a = module.forward_inference(
                    {Columns.OBS: torch.as_tensor(obs[None], dtype=torch.float32, device=dev)}
                )[Columns.ACTIONS].cpu().numpy()[0]
            obs, r, term, trunc, _ = env.step(low + (a + 1.0) * 0.5 * (high - low))
            total += r
            done = term or trunc
        returns.append(total)
    return float(np.mean(returns))


def run_seed(seed: int, steps: int, every: int, gpus: float = 0.0, batch: int = 256,
             utd: float = 1.0, max_seconds: float | None = None) -> dict:
    """One seed's curve; ``gpus`` per learner (1: on the GPU), ``batch`` rows per update,
    ``utd`` updates per env step; stops at ``steps`` or after ``max_seconds``."""
    import ray
    from ray.rllib.core import DEFAULT_MODULE_ID

    from agents.ddpg.algorithm import DDPGConfig
    from envs.quiet import quiet

    quiet()  # known third-party log noise off (envs/quiet.py)
    ray.init(num_cpus=1, num_gpus=1 if gpus else 0, include_dashboard=False,
             log_to_driver=False, logging_level="WARNING")
    cfg = (DDPGConfig().environment("Pendulum-v1")
           .env_runners(num_env_runners=0, rollout_fragment_length=8)
           .learners(num_gpus_per_learner=gpus)
           .training(train_batch_size_per_learner=batch, random_warmup_steps=1000,
                     num_steps_sampled_before_learning_starts=1000, updates_per_step=utd,
                     per_beta_steps=steps)
           .td3().debugging(seed=seed))
    algo = cfg.build_algo()
    module = algo.learner_group._learner.module[DEFAULT_MODULE_ID]
    curve, reached, next_eval, t0 = [], None, every, time.perf_counter()
    while True:
        res = algo.train()
        n = int(res["env_runners"]["num_env_steps_sampled_lifetime"])
        if n >= next_eval:
            ret = evaluate(module, seed)
            curve.append((n, ret))
            log(f"  seed {seed}: {n:>6} steps  eval return {ret:8.1f}  "
                f"({n / (time.perf_counter() - t0):.0f} env steps/s incl. updates)")
            if reached is None and ret >= TARGET:
                reached = n
            next_eval += every
        if n >= steps or (max_seconds is not None
                          and time.perf_counter() - t0 >= max_seconds):
            break
    wall = time.perf_counter() - t0
    algo.stop()
    ray.shutdown()
    return {"seed": seed, "reached_at": reached, "curve": curve, "wall_s": wall,
            "updates": algo.updates_done, "final": curve[-1][1] if curve else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--every", type=int, default=2_000)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--gpus", type=float, default=0.0, help="GPUs per learner (1: on the GPU)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--utd", type=float, default=1.0, help="updates per env step")
    ap.add_argument("--max-seconds", type=float, default=None)
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        import json

        print("RESULT " + json.dumps(run_seed(args.worker, args.steps, args.every, args.gpus,
                                              args.batch, args.utd, args.max_seconds)),
              flush=True)
        return
    import json

    t0 = time.perf_counter()
    results, procs = [], []
    pending = list(args.seeds)
    while pending or procs:
        while pending and len(procs) < args.parallel:
            s = pending.pop(0)
            env = dict(os.environ, OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--worker", str(s), "--steps", str(args.steps),
                 "--every", str(args.every)], stdout=subprocess.PIPE, text=True, env=env))
        p = procs.pop(0)
        for line in p.stdout:
            if line.startswith("RESULT "):
                results.append(json.loads(line[7:]))
            else:
                print(line, end="", flush=True)
        p.wait()
    results.sort(key=lambda r: r["seed"])
    rows = [[r["seed"], r["reached_at"] or f"not within {args.steps:,}",
             f"{r['final']:.1f}", f"{max(c[1] for c in r['curve']):.1f}", r["updates"],
             f"{r['wall_s']:.0f}"] for r in results]
    table = md_table(["seed", "steps to mean eval return >= -250", "final eval return",
                      "best eval return", "gradient updates", "wall s"], rows)
    ok = all(r["reached_at"] is not None for r in results)
    notes = [f"target met on {'every seed' if ok else 'not every seed'}; 10 evaluation "
             f"episodes every {args.every:,} steps with the noise-free actor"]
    finish("bench_pendulum", {"results": results, "target": TARGET, "steps": args.steps},
           table, notes, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
