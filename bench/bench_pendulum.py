"""DDPG correctness on a known task: TD3-flavoured DDPG with prioritized replay
(:mod:`agents.ddpg`) on ``Pendulum-v1``; target: mean evaluation return >= -250 within
20,000 environment steps on each of 3 seeds (the project's correctness target).

Every 2,000 environment steps the deterministic actor (``forward_inference``, no noise) plays
10 evaluation episodes on seeded environments; the result per seed is the first step count
at which the mean evaluation return reached -250, and the evaluation curve. Settings:
batch 256, one gradient update per environment step, 1,000 random warm-up steps, actor and
critic lr 1e-3, tau 5e-3, gamma 0.99, exploration noise 0.1, TD3 flags on, PER alpha 0.6,
beta 0.4 -> 1. Runs the seeds one after another (``--parallel 2`` uses both cores).

``--settings 256x1 1024x4`` runs every seed at each ``BATCHxUTD`` setting (rows per update x
gradient updates per env step) side by side in one run, so that a larger batch and
update-to-data ratio, the ones a GPU learner makes affordable (``bench_gpu_learner.py``),
are compared on sample efficiency (env steps to the target) on the same seeds; their wall
time here is the CPU learner's. ``--gpus 1`` puts the learner on a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _common import finish, fmt_stats, log, md_table, stats  # noqa: E402

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


def parse_setting(text: str) -> tuple[int, float]:
    """``"1024x4"`` -> (1024, 4.0): rows per update x updates per env step."""
    try:
        batch, utd = text.lower().split("x")
        out = int(batch), float(utd)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not BATCHxUTD (for example 1024x4)") from None
    if out[0] < 1 or not (math.isfinite(out[1]) and out[1] > 0):
        raise argparse.ArgumentTypeError(
            f"{text!r} needs a batch >= 1 and a finite update ratio > 0")
    return out


def run_worker(seed: int, batch: int, utd: float, *, steps: int, every: int = 2_000,
               gpus: float = 0.0, max_seconds: float | None = None,
               threads: int | None = 1) -> dict[str, Any]:
    """:func:`run_seed` in a process of its own (``threads`` torch threads; None: torch's
    default), its progress lines logged as they come; the seed's result, or
    ``{"error": ...}`` naming the run if it failed."""
    cmd = [sys.executable, __file__, "--worker", str(seed), "--steps", str(steps),
           "--every", str(every), "--gpus", str(gpus), "--batch", str(batch),
           "--utd", str(utd)]
    if max_seconds is not None:
        cmd += ["--max-seconds", str(max_seconds)]
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    head = {"seed": seed, "batch": batch, "utd": utd}
    with tempfile.TemporaryFile("w+") as errf, subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=errf, text=True, env=env) as p:
        res = None
        assert p.stdout is not None
        for line in p.stdout:
            if line.startswith("RESULT "):
                res = json.loads(line[7:])
            else:
                log(line.rstrip("\n"))
        p.wait()
        errf.seek(0)
        err = errf.read()
    if p.returncode != 0 or res is None:
        return {**head, "error": f"seed {seed} (batch {batch}, update-to-data ratio "
                                 f"{utd:g}) exited with status {p.returncode}: {err[-2000:]}"}
    return {**head, **res}


def fmt_curve(curve: Sequence[Sequence[float]]) -> str:
    """``2k: -1455, 4k: -1154, ...``: the evaluation return by env steps."""
    return ", ".join(f"{int(n) // 1000}k: {r:.0f}" for n, r in curve)


def results_table(results: Sequence[dict[str, Any]], steps: int) -> str:
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["batch"], f"{r['utd']:g}", r["seed"], "failed", "-", "-", "-", "-"])
            continue
        rows.append([r["batch"], f"{r['utd']:g}", r["seed"],
                     r["reached_at"] or f"not within {steps:,}", fmt_curve(r["curve"]),
                     "-" if r["final"] is None else f"{r['final']:.1f}", r["updates"],
                     f"{r['wall_s']:.0f}"])
    return md_table(["batch", "updates per env step", "seed",
                     "steps to mean eval return >= -250", "eval return by env steps",
                     "final eval return", "gradient updates", "wall s"], rows)


def setting_notes(results: Sequence[dict[str, Any]],
                  settings: Sequence[tuple[int, float]]) -> list[str]:
    """Per setting: on how many seeds the target was met, the median env steps to it (when
    met on every seed) and the wall time, median (min-max)."""
    notes = []
    for b, u in settings:
        rs = [r for r in results if (r["batch"], r["utd"]) == (b, u) and "error" not in r]
        if not rs:
            notes.append(f"batch {b}, update-to-data ratio {u:g}: every seed failed")
            continue
        hit = [r["reached_at"] for r in rs if r["reached_at"] is not None]
        med = (f" (median {fmt_stats(stats(hit))} steps)" if len(hit) == len(rs) else "")
        notes.append(f"batch {b}, update-to-data ratio {u:g}: target met on {len(hit)} of "
                     f"{len(rs)} seeds{med}; wall {fmt_stats(stats([r['wall_s'] for r in rs]))} s")
    return notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--every", type=int, default=2_000)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--gpus", type=float, default=0.0, help="GPUs per learner (1: on the GPU)")
    ap.add_argument("--settings", nargs="+", type=parse_setting, default=[(256, 1.0)],
                    metavar="BATCHxUTD", help="settings, each run on every seed (256x1)")
    ap.add_argument("--max-seconds", type=float, default=None)
    ap.add_argument("--quick", action="store_true", help="seed 0 only, 8,000 steps")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--utd", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        batch = 256 if args.batch is None else args.batch
        utd = 1.0 if args.utd is None else args.utd
        print("RESULT " + json.dumps(run_seed(args.worker, args.steps, args.every, args.gpus,
                                              batch, utd, args.max_seconds)), flush=True)
        return
    if args.batch is not None or args.utd is not None:
        ap.error("--batch and --utd are the seed runs' own; name settings with --settings "
                 "BATCHxUTD (for example --settings 1024x4)")
    if args.quick:
        args.seeds, args.steps = [0], 8_000
    if len(set(args.settings)) != len(args.settings):
        ap.error(f"argument --settings: a setting is named twice: {args.settings}")
    t0 = time.perf_counter()
    runs = [(b, u, s) for b, u in args.settings for s in args.seeds]
    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        results = list(pool.map(lambda run: run_worker(
            run[2], run[0], run[1], steps=args.steps, every=args.every, gpus=args.gpus,
            max_seconds=args.max_seconds), runs))
    notes = setting_notes(results, args.settings)
    notes += [r["error"] for r in results if "error" in r]
    notes.append(f"10 evaluation episodes every {args.every:,} steps with the noise-free "
                 f"actor; learner on {'a GPU' if args.gpus else 'the CPU'}; "
                 f"{args.parallel} seed run(s) at a time, one torch thread each")
    gpu = None
    if args.gpus:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    finish("bench_pendulum",
           {"results": results, "target": TARGET, "gpu": gpu,
            "settings": {"batch_utd": [f"{b}x{u:g}" for b, u in args.settings],
                         "seeds": args.seeds, "steps": args.steps, "every": args.every,
                         "gpus": args.gpus, "quick": args.quick},
            "command": shlex.join(["python", "bench/bench_pendulum.py", *sys.argv[1:]])},
           results_table(results, args.steps), notes, time.perf_counter() - t0)
    if any("error" in r for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
