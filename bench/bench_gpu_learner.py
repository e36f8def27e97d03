"""DDPG learner speed on a GPU against the CPU, on the project's own networks and batches,
and the learning curve of a GPU learner.

**Learner updates/s** (``--part speed``). For each network below and each learner device
(the CPU; ``cuda`` when torch sees a GPU), the trainer's DDPG (:mod:`agents.ddpg`: TD3 flags,
prioritized replay, a quarter of every batch from demonstrations with the Q-filtered cloning
term, exactly the agent configuration ``train.py`` resolves) is built with
``agent.num_gpus_per_learner`` 0 or 1 and its update loop is timed:
:meth:`agents.ddpg.algorithm.DDPG.run_updates`, the code ``train.py`` runs after each
rollout (prioritized sampling, the learner's updates, the new priorities written back, the
weights to the env runner). The replay and the demonstrations hold random transitions of the
environment's shapes: the cost of an update depends on the shapes, not on the values.

=============  ==========================================================================
online         the main job's networks: ``smart/DSMDOnline-v0`` (14 observation values,
               3 knobs), MLP 64x64 (``configs/env/online.yaml``)
static         the static problem's default: ``smart/DSMD-v0`` at ``godaddy`` with the
               channel observation (8 + 4 x 201 values, 201 channels), the per-channel
               networks 32x32 (``configs/agent/ddpg.yaml``)
static_mlp     the same observation with the paper's MLP 256x256
               (``agent.training.architecture=mlp``)
=============  ==========================================================================

Each cell: a warm-up, then ``--repeats`` timed windows of ``--seconds`` each; median
(min-max) of updates/s. The GPU/CPU column is the ratio of the medians. Both learners run in
this process one after the other, on the same machine: the CPU learner uses torch's default
threads (every core).

**Learning curve** (``--part curve``): ``Pendulum-v1`` (the correctness task of
``bench/bench_pendulum.py``, target -250) trained with the learner on the GPU, at the
CPU settings (batch 256, one update per env step) and at a larger batch and update-to-data
ratio, each for ``--curve-steps`` env steps or ``--curve-seconds``, whichever ends first.

Usage: ``python bench/bench_gpu_learner.py [--part speed curve] [--quick]``. Without a GPU
the speed part measures the CPU learner alone and the curve part is skipped (the result
says so). Not in ``run_all.py``: its numbers need a GPU machine; the committed result is
``results/bench/bench_gpu_learner.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, finish, fmt_stats, log, md_table, stats
from bench_pendulum import fmt_curve, run_worker

NETWORKS: dict[str, dict[str, Any]] = {
    "online": {"obs": 14, "act": 3, "training": {"architecture": "mlp",
                                                 "fcnet_hiddens": [64, 64]}},
    "static": {"obs": 8 + 4 * 201, "act": 201, "training": {"architecture": "per_channel",
                                                           "per_channel_hiddens": [32, 32]}},
    "static_mlp": {"obs": 8 + 4 * 201, "act": 201, "training": {"architecture": "mlp",
                                                               "fcnet_hiddens": [256, 256]}},
}
ENV = "bench-learner-shapes"
REPLAY_ROWS = 20_000


class ShapesEnv(gym.Env):
    """An environment with only the spaces of the measured one (random observations, zero
    reward, 100-step episodes): the local env runner needs one to build the module."""

    def __init__(self, env_config: dict) -> None:
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (int(env_config["obs"]),),
                                                np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (int(env_config["act"]),), np.float32)
        self._t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        self._t += 1
        return self.observation_space.sample(), 0.0, False, self._t >= 100, {}


def agent_config(net: str, batch: int, gpus: float, graphs: bool = True) -> dict[str, Any]:
    """``configs/agent/ddpg.yaml`` (with ``configs/env/online.yaml``'s agent overrides for
    ``online``), the network of ``net``, ``batch`` rows per update, ``gpus`` per learner,
    CUDA graphs on or off."""
    from omegaconf import OmegaConf

    agent = OmegaConf.load(ROOT / "configs" / "agent" / "ddpg.yaml")
    if net == "online":
        online = OmegaConf.load(ROOT / "configs" / "env" / "online.yaml")
        agent = OmegaConf.merge(agent, online.agent)
    agent = OmegaConf.merge(agent, {"training": NETWORKS[net]["training"]})
    agent.training.per_beta_steps = 100_000  # ${agent.total_steps} outside Hydra
    agent.training.train_batch_size_per_learner = int(batch)
    agent.training.critic_warmup_updates = 0  # every other update moves the actor (TD3)
    agent.training.cuda_graphs = bool(graphs)
    agent.num_gpus_per_learner = float(gpus)
    return OmegaConf.to_container(agent, resolve=True)  # type: ignore[return-value]


def _fill(algo: Any, obs: int, act: int, seed: int) -> None:
    g = np.random.default_rng(seed)

    def rows(n: int) -> dict[str, np.ndarray]:
        return {"obs": g.uniform(-1, 1, (n, obs)).astype(np.float32),
                "actions": g.uniform(-1, 1, (n, act)).astype(np.float32),
                "rewards": g.normal(size=n).astype(np.float32),
                "next_obs": g.uniform(-1, 1, (n, obs)).astype(np.float32),
                "terminateds": (g.uniform(size=n) < 0.01).astype(np.float32)}

    r = rows(REPLAY_ROWS)
    algo.replay.add(r["obs"], r["actions"], r["rewards"], r["next_obs"], r["terminateds"])
    algo.add_demonstrations(**rows(REPLAY_ROWS // 4))


def speed_cell(algo: Any, batch: int, seconds: float, repeats: int) -> dict[str, Any]:
    """Updates/s of ``algo.run_updates`` at ``batch`` rows: ``repeats`` windows."""
    t = time.perf_counter()
    algo.run_updates(2, REPLAY_ROWS, batch)  # warm-up: kernels, allocator, the fused Adam state
    per = max((time.perf_counter() - t) / 2, 1e-5)
    chunk = int(min(max(0.2 / per, 1), 64))
    rates = []
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while (el := time.perf_counter() - t0) < seconds:
            algo.run_updates(chunk, REPLAY_ROWS, batch)  # ends with the priorities on the host
            n += chunk
        rates.append(n / el)
    return stats(rates)


def measure_speed(batches: list[int], seconds: float, repeats: int, nets: list[str]
                  ) -> list[dict[str, Any]]:
    import ray
    import torch
    from ray.rllib.core import DEFAULT_MODULE_ID
    from ray.tune.registry import register_env

    from agents.algorithms import algorithm_config
    from agents.ddpg.rllib_internals import local_learner
    from envs.quiet import quiet

    quiet()
    cuda = torch.cuda.is_available()
    devices = ["cpu"] + (["cuda eager", "cuda graphs"] if cuda else [])
    ray.init(num_cpus=2, num_gpus=1 if cuda else 0, include_dashboard=False,
             log_to_driver=False, logging_level="WARNING", ignore_reinit_error=True)
    register_env(ENV, ShapesEnv)
    rows = []
    for net in nets:
        shape = NETWORKS[net]
        for dev in devices:
            agent = agent_config(net, batches[0], 0.0 if dev == "cpu" else 1.0,
                                 graphs=dev == "cuda graphs")
            t = time.perf_counter()
            try:
                algo = algorithm_config(agent, ENV, {"obs": shape["obs"], "act": shape["act"]},
                                        seed=0).build_algo()
            except Exception as e:  # reported in the table; the others go on
                log(f"[{net} {dev}] build failed: {type(e).__name__}: {e}")
                rows.append({"net": net, "device": dev, "error": f"{type(e).__name__}: {e}"})
                continue
            learner_dev = str(local_learner(algo).device)
            _fill(algo, shape["obs"], shape["act"], 0)
            module = local_learner(algo).module[DEFAULT_MODULE_ID]
            params = sum(p.numel() for p in module.parameters())
            log(f"[{net} {dev}] built in {time.perf_counter() - t:.1f} s; learner on "
                f"{learner_dev}; {params:,} parameters (with targets)")
            for b in batches:
                try:
                    s = speed_cell(algo, b, seconds, repeats)
                except Exception as e:  # e.g. out of memory at one batch
                    log(f"[{net} {dev}] batch {b}: {type(e).__name__}: {e}")
                    rows.append({"net": net, "device": dev, "batch": b,
                                 "error": f"{type(e).__name__}: {e}"})
                    continue
                log(f"[{net} {dev}] batch {b:>6}: {fmt_stats(s)} updates/s "
                    f"({s['median'] * b:,.0f} rows/s)")
                rows.append({"net": net, "device": dev, "learner_device": learner_dev,
                             "batch": b, "updates_per_s": s, "parameters": params,
                             "torch_threads": torch.get_num_threads()})
            algo.stop()
    ray.shutdown()
    return rows


def speed_table(rows: list[dict[str, Any]]) -> str:
    cells: dict[tuple[str, int], dict[str, dict]] = {}
    for r in rows:
        if "updates_per_s" in r:
            cells.setdefault((r["net"], r["batch"]), {})[r["device"]] = r["updates_per_s"]
    out = []
    for (net, b), d in cells.items():
        cpu, eager, graphs = d.get("cpu"), d.get("cuda eager"), d.get("cuda graphs")
        best = graphs or eager

        ratios = [f"{x['median'] / cpu['median']:.1f}x" if cpu and x else "-"
                  for x in (eager, graphs)]
        out.append([net, f"{b:,}", *(fmt_stats(x) if x else "-" for x in (cpu, eager, graphs)),
                    *ratios,
                    f"{best['median'] * b:,.0f}" if best else "-"])
    return md_table(["network", "batch", "CPU learner updates/s", "GPU eager updates/s",
                     "GPU CUDA graphs updates/s", "eager / CPU", "graphs / CPU",
                     "GPU rows/s"], out)


CURVES = [("cpu settings", 256, 1.0), ("larger batch and UTD", 1024, 4.0)]


def measure_curves(steps: int, seconds: float) -> list[dict[str, Any]]:
    """``bench/bench_pendulum.py``'s seed run with the learner on the GPU, at each of
    :data:`CURVES`."""
    out = []
    for label, batch, utd in CURVES:
        log(f"[curve] {label}: batch {batch}, {utd:g} updates per env step")
        res = run_worker(0, batch, utd, steps=steps, gpus=1, max_seconds=seconds,
                         threads=None)
        if "error" in res:
            log(f"[curve] {label} failed: {res['error']}")
        out.append({"label": label, **res})
    return out


def curve_table(curves: list[dict[str, Any]]) -> str:
    rows = []
    for c in curves:
        if "error" in c:
            rows.append([c["label"], c["batch"], c["utd"], "failed", "-", "-", "-"])
            continue
        rows.append([c["label"], c["batch"], f"{c['utd']:g}", fmt_curve(c["curve"]),
                     c["reached_at"] or "not reached", c["updates"], f"{c['wall_s']:.0f}"])
    return md_table(["GPU learner", "batch", "updates per env step",
                     "eval return by env steps", "steps to -250", "updates", "wall s"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--part", nargs="+", choices=["speed", "curve"], default=["speed", "curve"])
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    ap.add_argument("--nets", nargs="+", choices=list(NETWORKS), default=list(NETWORKS))
    ap.add_argument("--seconds", type=float, default=1.5, help="per timed window")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--curve-steps", type=int, default=20_000)
    ap.add_argument("--curve-seconds", type=float, default=120.0)
    ap.add_argument("--quick", action="store_true",
                    help="batches 256 and 4096, 0.5 s windows, 8,000-step curves")
    args = ap.parse_args()
    if args.quick:
        args.batches, args.seconds, args.curve_steps = [256, 4096], 0.5, 8_000
    import torch

    t0 = time.perf_counter()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    log(f"torch {torch.__version__}; GPU: {gpu or 'none'}; {torch.get_num_threads()} CPU "
        "threads for the CPU learner")
    payload: dict[str, Any] = {"gpu": gpu, "torch": torch.__version__,
                               "torch_threads": torch.get_num_threads(),
                               "settings": {"batches": args.batches, "seconds": args.seconds,
                                            "repeats": args.repeats},
                               "command": "python bench/bench_gpu_learner.py "
                                          + " ".join(sys.argv[1:])}
    tables, notes = [], []
    if "speed" in args.part:
        payload["speed"] = measure_speed(args.batches, args.seconds, args.repeats, args.nets)
        tables.append(speed_table(payload["speed"]))
        failed = [r for r in payload["speed"] if "error" in r]
        notes += [f"{r['net']} {r['device']} {r.get('batch', '')}: {r['error']}"
                  for r in failed]
    if "curve" in args.part:
        if gpu is None:
            notes.append("no GPU: the learning curve of the GPU learner was not measured")
        else:
            payload["curves"] = measure_curves(args.curve_steps, args.curve_seconds)
            tables.append(curve_table(payload["curves"]))
    notes.append(f"GPU: {gpu or 'none'}; CPU learner: {torch.get_num_threads()} torch "
                 f"threads on {os.cpu_count()} cores; median (min-max) of {args.repeats} "
                 f"windows of {args.seconds:g} s after a warm-up")
    finish("bench_gpu_learner", payload, "\n\n".join(tables), notes, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
