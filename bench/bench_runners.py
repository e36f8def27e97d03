"""Training throughput by layout: environment steps/s and learner updates/s of the main job's
DDPG on ``smart/DSMDOnline-v0`` with 0, 1 and 2 remote env runners and with a remote learner,
side by side in one run on this machine.

Each layout is the trainer's own algorithm (:func:`agents.algorithms.algorithm_config` with
the main job's agent settings: ``configs/agent/ddpg.yaml`` and ``configs/env/online.yaml``),
on the training traces of ``--dataset`` (``godaddy_online``), on a local Ray with ``--cpus``
logical CPUs:

=========================  ====================================================================
driver, fast sync          sampling in the driver, the learner in the driver, the actor's
                           weights copied tensor to tensor after every batch of updates (the
                           trainer's default)
driver, RLlib sync         the same with RLlib's ``sync_weights`` (what the trainer does in
                           every other layout): the cost the fast path saves
1 remote runner            one remote env runner, the learner in the driver
2 remote runners           two remote env runners, the learner in the driver
2 runners, remote learner  two remote env runners and a remote learner (``agent.num_learners=1``)
=========================  ====================================================================

The first layout runs again at the end: the difference between its two rows is the drift over
the run (the traces' caches filling, other work on the machine), the noise floor of the table.

Per layout: one warm-up iteration after learning starts, then ``--repeats`` windows of
``--seconds`` of ``algo.train()``; median (min-max) env steps/s and updates/s over the
windows. Every layout samples ``rollout_fragment_length`` steps per runner per iteration and
makes ``updates_per_step`` updates per sampled step, so updates/s follows env steps/s.

Usage: ``python bench/bench_runners.py [--quick] [--dataset NAME] [--cpus N]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, finish, fmt_stats, log, md_table, stats

LAYOUTS: dict[str, dict[str, Any]] = {
    "driver, fast sync": {"num_env_runners": 0, "num_learners": 0},
    "driver, RLlib sync": {"num_env_runners": 0, "num_learners": 0, "rllib_sync": True},
    "1 remote runner": {"num_env_runners": 1, "num_learners": 0},
    "2 remote runners": {"num_env_runners": 2, "num_learners": 0},
    "2 runners, remote learner": {"num_env_runners": 2, "num_learners": 1},
    # the first layout again: what changed over the run (the traces' caches, the machine)
    "driver, fast sync (again)": {"num_env_runners": 0, "num_learners": 0},
}
ENV = "bench-runners-online"


def main_job_agent() -> dict[str, Any]:
    """The main job's DDPG settings, as ``train.py`` resolves them (without Hydra)."""
    from omegaconf import OmegaConf

    agent = OmegaConf.merge(OmegaConf.load(ROOT / "configs" / "agent" / "ddpg.yaml"),
                            OmegaConf.load(ROOT / "configs" / "env" / "online.yaml").agent)
    agent.training.per_beta_steps = int(agent.total_steps)
    return OmegaConf.to_container(agent, resolve=True)  # type: ignore[return-value]


def env_config(dataset: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from envs.dsmd.dataset import build_dataset, load_dataset_spec

    online = OmegaConf.load(ROOT / "configs" / "env" / "online.yaml").env
    data_dir = ROOT / "datasets" / "generated"
    ds = build_dataset(load_dataset_spec(dataset), data_dir)
    cost = OmegaConf.to_container(online.cost)
    return {"dataset": str(ds.root), "split": "train", "cost": cost, "max_intervals": None,
            "warmup": 0, "executor": str(online.control.executor),
            "max_headroom": float(online.control.max_headroom),
            "max_horizon": float(online.control.max_horizon), "features": None,
            "executor_args": {}, "cache_dir": str(data_dir)}


def measure(layout: dict[str, Any], env_cfg: dict[str, Any], seconds: float,
            repeats: int) -> dict[str, Any]:
    from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME

    from agents.algorithms import algorithm_config

    agent = {**main_job_agent(), **{k: v for k, v in layout.items() if k != "rllib_sync"}}
    agent["training"]["num_steps_sampled_before_learning_starts"] = 64
    t = time.perf_counter()
    algo = algorithm_config(agent, ENV, env_cfg, seed=0).build_algo()
    build_s = time.perf_counter() - t
    if layout.get("rllib_sync"):
        algo._sync_local_weights = lambda: False  # the trainer's other layouts' path

    def steps() -> int:
        return int(algo.metrics.peek((ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME),
                                     default=0))

    try:
        while algo.updates_done == 0:  # warm-up: sampling, learning starts, first sync
            algo.train()
        algo.train()
        sps, ups = [], []
        for _ in range(repeats):
            s0, u0, t0 = steps(), algo.updates_done, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                algo.train()
            el = time.perf_counter() - t0
            sps.append((steps() - s0) / el)
            ups.append((algo.updates_done - u0) / el)
    finally:
        algo.stop()
    return {"build_s": build_s, "env_steps_per_s": stats(sps), "updates_per_s": stats(ups)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", default="godaddy_online")
    ap.add_argument("--cpus", type=int, default=4, help="logical CPUs of the local Ray")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="3 s windows, 2 repeats")
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.repeats = 3.0, 2
    import os

    import ray
    from ray.tune.registry import register_env

    from agents.task_online import make_online_env
    from envs.quiet import quiet

    quiet()
    t0 = time.perf_counter()
    env_cfg = env_config(args.dataset)
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False,
             logging_level="WARNING")
    register_env(ENV, make_online_env)
    results: dict[str, Any] = {}
    for name, layout in LAYOUTS.items():
        log(f"[{name}] ...")
        results[name] = r = measure(layout, env_cfg, args.seconds, args.repeats)
        log(f"[{name}] {fmt_stats(r['env_steps_per_s'], '{:,.1f}')} env steps/s, "
            f"{fmt_stats(r['updates_per_s'], '{:,.0f}')} updates/s (built in "
            f"{r['build_s']:.1f} s)")
    ray.shutdown()
    base = results["driver, fast sync"]["env_steps_per_s"]["median"]
    rows = [[name, fmt_stats(r["env_steps_per_s"], "{:,.1f}"),
             fmt_stats(r["updates_per_s"], "{:,.0f}"),
             f"{r['env_steps_per_s']['median'] / base:.2f}x", f"{r['build_s']:.1f}"]
            for name, r in results.items()]
    table = md_table(["layout", "env steps/s", "learner updates/s", "vs driver, fast sync",
                      "build s"], rows)
    agent = main_job_agent()
    tr = agent["training"]
    notes = [f"{args.dataset} training traces, the main job's DDPG "
             f"({tr['updates_per_step']:g} updates per env step, batch "
             f"{tr['train_batch_size_per_learner']}, "
             f"{agent['rollout_fragment_length']} steps per runner per iteration); local Ray "
             f"with {args.cpus} logical CPUs on {os.cpu_count()} cores; median (min-max) of "
             f"{args.repeats} windows of {args.seconds:g} s"]
    finish("bench_runners", {"results": results,
                             "settings": {"dataset": args.dataset, "cpus": args.cpus,
                                          "seconds": args.seconds, "repeats": args.repeats,
                                          "quick": args.quick}},
           table, notes, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
