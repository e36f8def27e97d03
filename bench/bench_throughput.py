"""Training throughput, side by side with a reference off-policy implementation: this
project's DDPG/TD3 (:mod:`agents.ddpg`, RLlib 2.60, prioritized replay on and off) against
a single-file port of CleanRL's TD3 (:mod:`reference_td3`, ``td3_continuous_action.py``,
no RLlib), on the same environment, batch size and machine (the target: training
throughput at least that of a reference off-policy implementation).

Environment: ``envs.dsmd.env.DSMDEnv(scenario, observation="channel", decoding="argmax",
split="train")`` for ``tiny`` and ``godaddy`` (ours builds it through RLlib's env registry,
``smart-dsmd`` / ``agents.training.make_dsmd_env``, exactly as ``train.py`` does). Both
implementations: TD3 (twin critics, target smoothing 0.2 clip 0.5, policy delay 2, tau
0.005), batch 256, hidden [256, 256], one gradient update per environment step, actor and
critic lr 1e-3, gamma 0.95, exploration noise 0.1, replay capacity 200,000 (the
``agent=ddpg`` config values), a single environment, torch on CPU with one thread. Ours
samples through its single local env runner (``num_env_runners=0``,
``rollout_fragment_length`` as in ``configs/agent/ddpg.yaml``, 32) and learns on the driver
(``num_learners=0``), i.e. 32 env steps then 32 updates per training iteration; the
reference alternates 1 step and 1 update (CleanRL's loop). Both do one update per
environment step.

Protocol: each measurement is a fresh subprocess pinned to core 0 (one BLAS/OpenMP/torch
thread; Ray's helper processes inherit the pinning, so ours pays for them on the same core).
Untimed warm-up: 1,000 random-action steps without updates, then learning until at least
``WARMUP + BURN_IN`` steps (ours runs whole ``algo.train()`` iterations of >= 1 s, so it
may overshoot). Timed segment: at least ``SEGMENT`` further steps (3,000; ``--quick``
1,000); env steps/s and gradient updates/s = the segment's counted steps / updates (ours:
``num_env_steps_sampled_lifetime`` and ``algo.updates_done`` after each ``train()``) over its
wall time. A gradient update = one critic step (the actor and targets step on every second
one) in both. 3 repetitions (seeds 0, 1, 2) per implementation, interleaved; median (min-max).
A run whose process had less than 85% of the core (CPU time / wall time; another process
was scheduled on core 0) is re-run, up to 3 times.

Usage: ``python bench/bench_throughput.py [--quick] [--reps N] [--segment N]
[--scenarios tiny godaddy] [--profile]`` (``--profile``: one extra cProfile'd run per
implementation and scenario, top functions by own time printed, not part of the table).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _common import RESULTS_DIR, finish, fmt_stats, log, md_table, pin_one_core, stats  # noqa: E402

CORE = pin_one_core()

SCENARIOS = ("tiny", "godaddy")
IMPLS = ("ours_per", "ours_uniform", "reference")
LABELS = {"ours_per": "ours (RLlib DDPG/TD3, PER on)",
          "ours_uniform": "ours (RLlib DDPG/TD3, PER off)",
          "reference": "reference (CleanRL TD3 port)"}
WARMUP = 1_000  # random-action steps before learning
BURN_IN = 200  # learning steps before the timed segment (untimed)
BATCH = 256
HIDDEN = [256, 256]
LR = 1e-3
GAMMA = 0.95
TAU = 0.005
BUFFER = 200_000
OBSERVATION = "channel"
# ours: env steps per training iteration (then as many updates), the training config's value
FRAGMENT = int(os.environ.get("BENCH_FRAGMENT", "0")) or int(
    (HERE.parent / "configs" / "agent" / "ddpg.yaml").read_text()
    .split("rollout_fragment_length:")[1].split()[0])
CPU_SHARE_OK = 0.85  # process CPU s / wall s below this: another process took core 0
RETRIES = 3  # re-runs of a contended measurement


def _segment(step, counts, warmup_total: int, segment: int) -> dict[str, Any]:
    """Run ``step()`` until ``warmup_total`` steps (untimed), then until ``segment`` more."""
    import torch

    while counts()[0] < warmup_total:
        step()
    s0, u0 = counts()
    t0, c0 = time.perf_counter(), time.process_time()
    while counts()[0] - s0 < segment:
        step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s1, u1 = counts()
    return {"env_steps": s1 - s0, "updates": u1 - u0, "wall_s": wall,
            "steps_per_s": (s1 - s0) / wall, "updates_per_s": (u1 - u0) / wall,
            "cpu_share": cpu / wall, "steps_before": s0, "torch_threads": torch.get_num_threads()}


def run_ours(scenario: str, per: bool, seed: int, segment: int, profile: Path | None
             ) -> dict[str, Any]:
    import ray
    import torch
    from ray.tune.registry import register_env

    from agents.ddpg.algorithm import DDPGConfig
    from agents.training import RLLIB_ENV_NAME, make_dsmd_env
    from envs.dsmd.scenarios import load_scenario
    from envs.quiet import quiet

    torch.set_num_threads(1)
    quiet()  # known third-party log noise off (envs/quiet.py)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    register_env(RLLIB_ENV_NAME, make_dsmd_env)
    spec = load_scenario(scenario)
    cfg = (DDPGConfig()
           .environment(env=RLLIB_ENV_NAME,
                        env_config={"scenario_spec": spec.to_dict(), "observation": OBSERVATION,
                                    "decoding": "argmax", "split": "train"})
           .env_runners(num_env_runners=0,
                        rollout_fragment_length=FRAGMENT)
           .learners(num_learners=0)
           .training(train_batch_size_per_learner=BATCH, fcnet_hiddens=HIDDEN,
                     updates_per_step=1.0, random_warmup_steps=WARMUP,
                     num_steps_sampled_before_learning_starts=WARMUP, prioritized_replay=per,
                     actor_lr=LR, critic_lr=LR, gamma=GAMMA, tau=TAU, buffer_capacity=BUFFER,
                     exploration_noise=0.1)
           .td3().debugging(seed=seed))
    algo = cfg.build_algo()
    state = {"steps": 0}

    def step() -> None:
        res = algo.train()
        state["steps"] = int(res["env_runners"]["num_env_steps_sampled_lifetime"])

    out = _timed(step, lambda: (state["steps"], int(algo.updates_done)), segment, profile)
    algo.stop()
    ray.shutdown()
    return out


def run_reference(scenario: str, seed: int, segment: int, profile: Path | None
                  ) -> dict[str, Any]:
    from reference_td3 import TD3, Args

    from envs.dsmd.env import DSMDEnv

    env = DSMDEnv(scenario, observation=OBSERVATION, decoding="argmax", split="train")
    agent = TD3(env, Args(seed=seed, learning_rate=LR, buffer_size=BUFFER, gamma=GAMMA,
                          tau=TAU, batch_size=BATCH, learning_starts=WARMUP,
                          exploration_noise=0.1, hidden=HIDDEN[0]))
    return _timed(lambda: agent.run(8), lambda: (agent.global_step, agent.updates), segment,
                  profile)


def _timed(step, counts, segment: int, profile: Path | None) -> dict[str, Any]:
    if profile is None:
        return _segment(step, counts, WARMUP + BURN_IN, segment)
    import cProfile

    while counts()[0] < WARMUP + BURN_IN:
        step()
    prof = cProfile.Profile()
    prof.enable()
    out = _segment(step, counts, 0, segment)
    prof.disable()
    prof.dump_stats(str(profile))
    return out


def worker(impl: str, scenario: str, seed: int, segment: int, profile: Path | None) -> None:
    if impl == "reference":
        out = run_reference(scenario, seed, segment, profile)
    else:
        out = run_ours(scenario, impl == "ours_per", seed, segment, profile)
    print("RESULT " + json.dumps({"impl": impl, "scenario": scenario, "seed": seed, **out}),
          flush=True)


def spawn(impl: str, scenario: str, seed: int, segment: int, profile: Path | None = None
          ) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", impl, scenario, str(seed),
           "--segment", str(segment)]
    if profile is not None:
        cmd += ["--profile-out", str(profile)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"), check=False)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{impl}/{scenario}/{seed} failed (exit {p.returncode}):\n"
                       f"{p.stdout[-3000:]}\n{p.stderr[-6000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1,000-step segments (smoke test)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--segment", type=int, default=None, help="timed steps (default 3,000)")
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--worker", nargs=3, metavar=("IMPL", "SCENARIO", "SEED"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--profile-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    segment = args.segment or (1_000 if args.quick else 3_000)
    if args.worker:
        impl, scenario, seed = args.worker
        worker(impl, scenario, int(seed), segment, args.profile_out)
        return

    import pstats

    t0 = time.perf_counter()
    from envs.dsmd.env import DSMDEnv

    shapes = {}
    for sc in args.scenarios:  # builds / caches the dataset once, before any timing
        log(f"preparing {sc} ...")
        env = DSMDEnv(sc, observation=OBSERVATION, decoding="argmax", split="train")
        shapes[sc] = (env.observation_space.shape[0], env.action_space.shape[0])
    runs: list[dict[str, Any]] = []
    for sc in args.scenarios:
        for rep in range(args.reps):
            for impl in IMPLS:
                r = spawn(impl, sc, rep, segment)
                contended = []
                while r["cpu_share"] < CPU_SHARE_OK and len(contended) < RETRIES:
                    log(f"  {sc} {impl} seed {rep}: cpu share {r['cpu_share']:.2f} "
                        f"({r['steps_per_s']:.1f} steps/s): core 0 was shared, re-running")
                    contended.append(r)
                    r = spawn(impl, sc, rep, segment)
                r["contended_attempts"] = contended
                log(f"  {sc:8s} {impl:13s} seed {rep}: {r['steps_per_s']:7.1f} env steps/s  "
                    f"{r['updates_per_s']:7.1f} updates/s  ({r['env_steps']} steps, "
                    f"{r['updates']} updates, {r['wall_s']:.1f} s, cpu share "
                    f"{r['cpu_share']:.2f})")
                runs.append(r)
    rows, summary = [], []
    for sc in args.scenarios:
        ref = [r for r in runs if r["scenario"] == sc and r["impl"] == "reference"]
        ref_sps = stats([r["steps_per_s"] for r in ref])["median"]
        for impl in IMPLS:
            rs = [r for r in runs if r["scenario"] == sc and r["impl"] == impl]
            sps = stats([r["steps_per_s"] for r in rs])
            ups = stats([r["updates_per_s"] for r in rs])
            summary.append({"scenario": sc, "impl": impl, "steps_per_s": sps,
                            "updates_per_s": ups, "ratio_to_reference": sps["median"] / ref_sps})
            rows.append([sc, f"{shapes[sc][0]} / {shapes[sc][1]}", LABELS[impl],
                         fmt_stats(sps, "{:,.1f}"), fmt_stats(ups, "{:,.1f}"),
                         f"{sps['median'] / ref_sps:.2f}"])
    table = md_table(["scenario", "obs / action dims", "implementation", "env steps/s",
                      "gradient updates/s", "steps/s vs reference"], rows)
    meets = {sc: all(s["ratio_to_reference"] >= 1.0 for s in summary
                     if s["scenario"] == sc and s["impl"] != "reference")
             for sc in args.scenarios}
    notes = [f"median (min-max) of {args.reps} runs (seeds 0..{args.reps - 1}), each a fresh "
             f"process on core {CORE}, one torch/BLAS thread; timed segment >= {segment:,} env "
             f"steps after {WARMUP:,} random + >= {BURN_IN} learning steps (untimed)",
             "reference: single-file port of CleanRL td3_continuous_action.py "
             "(bench/reference_td3.py; numpy uniform replay, no RLlib), same env, batch "
             f"{BATCH}, hidden {HIDDEN}, 1 update per env step",
             f"ours: DDPGConfig().td3(), num_env_runners=0, rollout_fragment_length={FRAGMENT}, "
             "num_learners=0, updates_per_step=1.0; Ray helper processes share the core",
             f"a run whose process CPU time was < {CPU_SHARE_OK} of its wall time (another "
             f"process on core 0) is re-run, up to {RETRIES} times; re-runs: "
             f"{sum(len(r['contended_attempts']) for r in runs)}, still contended: "
             f"{sum(r['cpu_share'] < CPU_SHARE_OK for r in runs)}",
             "throughput >= reference (env steps/s, both PER settings): " +
             ", ".join(f"{sc} {'yes' if ok else 'NO'}" for sc, ok in meets.items())]
    profiles = {}
    if args.profile:
        for sc in args.scenarios:
            for impl in IMPLS:
                path = RESULTS_DIR / f"bench_throughput_profile_{impl}_{sc}.pstats"
                RESULTS_DIR.mkdir(parents=True, exist_ok=True)
                r = spawn(impl, sc, 0, segment, profile=path)
                profiles[f"{impl}/{sc}"] = {"pstats": str(path), **r}
                log(f"profiled {impl}/{sc} -> {path}; top functions by own time:")
                pstats.Stats(str(path)).sort_stats("tottime").print_stats(15)
    finish("bench_throughput",
           {"settings": {"quick": args.quick, "segment": segment, "reps": args.reps,
                         "warmup": WARMUP, "burn_in": BURN_IN, "batch": BATCH,
                         "hidden": HIDDEN, "buffer": BUFFER, "gamma": GAMMA, "lr": LR,
                         "observation": OBSERVATION, "scenarios": args.scenarios},
            "shapes": shapes, "runs": runs, "summary": summary, "profiles": profiles,
            "total_s": time.perf_counter() - t0},
           table, notes, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
