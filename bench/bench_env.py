"""Environment throughput of ``smart/DSMD-v0``, one core.

What is measured: steps per second of whole episodes (``reset()`` then ``step()`` until
``terminated``; reset time counts), for each scenario (``godaddy``, ``cern``) and
observation variant (``paper``, ``paper_type``, ``channel``), through the
``gymnasium.make`` wrapper stack and through ``env.unwrapped``.

How: the process pins itself to core 0 with one BLAS/OpenMP thread before numpy loads.
Before timing, each scenario's problem set is built (this generates and caches the trace
under ``datasets/generated/`` on first use) and the instance of every window of the
training split is built, so timing sees the steady state of a training run. Actions are
pre-generated (uniform in [-1, 1], shape (K+1,), float32) and cycled. One run = episodes
until a wall budget (3 s) is spent; steps/s = steps / elapsed. Each configuration runs
``REPEATS`` times, wrapped and unwrapped runs alternating, each run re-seeded with the
same seed so both see the same episodes; the table gives the median (min-max).

Targets (one core): >= 30,000 steps/s at ``godaddy``, >= 10,000 at ``cern``.

Usage: ``python bench/bench_env.py [--quick]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import finish, fmt_stats, log, md_table, pin_one_core, stats

CORE = pin_one_core()

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402

import envs  # noqa: E402,F401  (registers the env ids)
from envs.dsmd.problems import problems_for  # noqa: E402

SCENARIOS = ("godaddy", "cern")
OBSERVATIONS = ("paper", "paper_type", "channel")
TARGETS = {"godaddy": 30_000, "cern": 10_000}
REPEATS = 5
BUDGET_S = 3.0
ACTION_BLOCK = 8192  # pre-generated actions, cycled
SEED = 0
CPU_SHARE_OK = 0.9  # process CPU time / wall below this: another process used the core


def run_episodes(env: gym.Env, actions: np.ndarray, budget_s: float, seed: int
                 ) -> tuple[int, int, float, float]:
    """Whole episodes until ``budget_s`` is spent: (steps, episodes, elapsed seconds,
    CPU seconds / elapsed -- below ~0.9 the core was shared with another process)."""
    n_act = actions.shape[0]
    steps = episodes = 0
    env.reset(seed=seed)  # untimed: fixes the episode sequence of this run
    t0, c0 = time.perf_counter(), time.process_time()
    while True:
        env.reset()
        done = False
        while not done:
            _, _, done, _, _ = env.step(actions[steps % n_act])
            steps += 1
        episodes += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= budget_s:
            return steps, episodes, elapsed, (time.process_time() - c0) / elapsed


def bench_config(scenario: str, observation: str, repeats: int, budget_s: float,
                 decoding: str = "argmax") -> dict:
    t0 = time.perf_counter()
    env = gym.make("smart/DSMD-v0", scenario=scenario, observation=observation,
                   decoding=decoding)
    make_s = time.perf_counter() - t0
    base = env.unwrapped
    k1 = int(env.action_space.shape[0])
    actions = np.random.default_rng(SEED).uniform(-1.0, 1.0, (ACTION_BLOCK, k1)).astype(
        np.float32)
    # warm-up: one untimed episode each way (first-call checks of the wrapper stack)
    run_episodes(env, actions, 0.0, SEED)
    run_episodes(base, actions, 0.0, SEED)
    runs: dict[str, list[float]] = {"wrapped": [], "unwrapped": []}
    eps: dict[str, list[int]] = {"wrapped": [], "unwrapped": []}
    lengths: list[float] = []
    cpu_share: list[float] = []
    for r in range(repeats):
        for label, e in (("wrapped", env), ("unwrapped", base)):
            steps, episodes, elapsed, share = run_episodes(e, actions, budget_s, SEED + r)
            cpu_share.append(share)
            runs[label].append(steps / elapsed)
            eps[label].append(episodes)
            lengths.append(steps / episodes)
        log(f"  {scenario:8s} {observation:10s} run {r + 1}/{repeats}: "
            f"wrapped {runs['wrapped'][-1]:,.0f} steps/s, "
            f"unwrapped {runs['unwrapped'][-1]:,.0f} steps/s "
            f"(CPU/wall {min(cpu_share[-2:]):.2f})")
    row = {
        "scenario": scenario, "observation": observation, "decoding": decoding,
        "obs_size": int(env.observation_space.shape[0]), "action_size": k1,
        "num_nodes": base.problems.num_nodes, "num_topics": base.problems.spec.num_topics,
        "catalog_size": base.problems.catalog_size, "train_windows": len(base.windows),
        "mean_episode_length": float(np.mean(lengths)),
        "make_s": make_s, "wrappers": str(env),
        "wrapped_steps_per_s": stats(runs["wrapped"]),
        "unwrapped_steps_per_s": stats(runs["unwrapped"]),
        "episodes_per_run": eps,
        "min_cpu_share": min(cpu_share),
        "target_steps_per_s": TARGETS[scenario],
    }
    row["target_met_wrapped"] = row["wrapped_steps_per_s"]["median"] >= TARGETS[scenario]
    row["target_met_unwrapped"] = row["unwrapped_steps_per_s"]["median"] >= TARGETS[scenario]
    env.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 repeats of 0.5 s (smoke test)")
    args = ap.parse_args()
    repeats, budget = (2, 0.5) if args.quick else (REPEATS, BUDGET_S)
    t_start = time.perf_counter()
    log(f"bench_env: pinned to core {CORE}; {repeats} runs x {budget} s per configuration")
    prepare: dict[str, float] = {}
    for s in SCENARIOS:
        t0 = time.perf_counter()
        ps = problems_for(s)  # generates + caches the trace on first use
        for w in ps.windows["train"]:
            ps.instance(w)
        prepare[s] = time.perf_counter() - t0
        log(f"prepared {s}: {ps.parsed.num_windows} windows, catalogue {ps.catalog_size} "
            f"types, {ps.num_nodes} nodes, K={ps.spec.num_topics} ({prepare[s]:.1f} s)")
    rows = []
    for s in SCENARIOS:
        for o in OBSERVATIONS:
            rows.append(bench_config(s, o, repeats, budget))
    # the training configuration's decoding (the safety layer) at the main job's scale
    rows.append(bench_config("godaddy", "channel", repeats, budget, decoding="feasible"))
    yes = {True: "yes", False: "**no**"}
    table = md_table(
        ["scenario", "observation", "decoding", "obs size", "steps/episode", "wrapped steps/s",
         "unwrapped steps/s", "target", "met (wrapped / unwrapped)"],
        [[r["scenario"], r["observation"], r["decoding"], f"{r['obs_size']:,}",
          f"{r['mean_episode_length']:,.0f}", fmt_stats(r["wrapped_steps_per_s"]),
          fmt_stats(r["unwrapped_steps_per_s"]), f">= {r['target_steps_per_s']:,}",
          f"{yes[r['target_met_wrapped']]} / {yes[r['target_met_unwrapped']]}"]
         for r in rows])
    total = time.perf_counter() - t_start
    notes = [f"median (min-max) of {repeats} runs of >= {budget} s of whole episodes "
             f"(reset included), one core (core {CORE}, 1 BLAS thread)",
             "wrapped = gymnasium.make(...) wrapper stack; unwrapped = env.unwrapped"]
    shared = [f"{r['scenario']}/{r['observation']} ({r['min_cpu_share']:.2f})" for r in rows
              if r["min_cpu_share"] < CPU_SHARE_OK]
    worst = min(r["min_cpu_share"] for r in rows)
    notes.append(f"lowest process CPU time / wall of any run: {worst:.2f}"
                 + ("" if not shared else " -- core shared with other processes in: "
                    + ", ".join(shared)))
    finish("bench_env", {
        "settings": {"repeats": repeats, "budget_s": budget, "action_block": ACTION_BLOCK,
                     "seed": SEED, "pinned_core": CORE, "quick": args.quick},
        "prepare_s": prepare, "rows": rows, "total_s": total}, table, notes, total)


if __name__ == "__main__":
    main()
