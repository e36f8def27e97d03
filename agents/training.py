"""``python train.py agent=ddpg``: train DDPG (+PER, TD3 flags) offline on the scenario's
training windows, validate periodically, then evaluate the learned policy against every
baseline on the held-out test windows (MLflow: config, curves, tables, plots).

Offline on traces: every episode is a training window of the scenario's trace
(``smart/DSMD-v0`` with ``split="train"``); validation and test windows are never seen by
the learner. Progress is printed every ``agent.log_every_s`` seconds with rates.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from omegaconf import DictConfig

from envs.dsmd.observation import ObservationLayout
from envs.dsmd.problems import build_problems
from envs.dsmd.scenarios import ScenarioSpec
from envs.seeding import seed_everything

from .config import output_dir, scenario_spec, to_dict
from .evaluation import evaluate_policies, summarize
from .learned import ActorPolicy
from .registry import make_policies
from .reporting import report
from .tracking import tracked_run

__all__ = ["run_training", "make_dsmd_env", "RLLIB_ENV_NAME"]

RLLIB_ENV_NAME = "smart-dsmd"


def make_dsmd_env(env_ctx: Any):
    """RLlib env creator (module-level, so remote env runners can unpickle it)."""
    from envs.dsmd.env import DSMDEnv

    kw = dict(env_ctx)
    kw.pop("num_envs", None)
    spec = ScenarioSpec.from_dict(kw.pop("scenario_spec"))
    return DSMDEnv(spec, **kw)


def _torch_actor(algo):
    import torch
    from ray.rllib.core import DEFAULT_MODULE_ID
    from ray.rllib.core.columns import Columns

    module = algo.learner_group._learner.module[DEFAULT_MODULE_ID]

    def act(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            t = torch.as_tensor(obs[None], dtype=torch.float32,
                                device=next(module.pi.parameters()).device)
            return module.forward_inference({Columns.OBS: t})[Columns.ACTIONS][0].cpu().numpy()

    return act


def run_training(cfg: DictConfig) -> dict[str, Any]:
    import ray

    from .ddpg.algorithm import DDPGConfig

    seed_everything(int(cfg.seed))
    spec = scenario_spec(cfg)
    out = output_dir(cfg)
    a = cfg.agent
    ps = build_problems(spec, cache_dir=cfg.paths.data_dir, batch_key=cfg.env.batch_key)
    env_kwargs = {"observation": str(cfg.env.observation), "action": "box",
                  "reward": to_dict(cfg.env.reward), "order": str(cfg.env.order),
                  "initial": str(cfg.env.initial), "batch_key": str(cfg.env.batch_key),
                  "cache_dir": str(cfg.paths.data_dir), "split": "train"}
    layout = ObservationLayout(str(cfg.env.observation), ps.catalog_size, ps.num_nodes,
                               spec.num_topics)
    ray_cfg = cfg.get("ray") or {}
    ray.init(address=ray_cfg.get("address"), num_cpus=ray_cfg.get("num_cpus"),
             include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    from ray.tune.registry import register_env

    register_env(RLLIB_ENV_NAME, make_dsmd_env)  # Ray's registry reaches remote runners too
    algo_cfg = (DDPGConfig()
                .environment(env=RLLIB_ENV_NAME,
                             env_config={"scenario_spec": spec.to_dict(), **env_kwargs})
                .env_runners(num_env_runners=int(a.num_env_runners),
                             rollout_fragment_length=int(a.rollout_fragment_length))
                .learners(num_learners=0, num_gpus_per_learner=float(a.num_gpus_per_learner))
                .training(**to_dict(a.training))
                .debugging(seed=int(cfg.seed)))
    if a.td3:
        algo_cfg.td3()
    algo = algo_cfg.build_algo()
    from ray.rllib.core import DEFAULT_MODULE_ID

    module = algo.learner_group._learner.module[DEFAULT_MODULE_ID]
    actor = ActorPolicy(_torch_actor(algo), layout, name="ddpg", order=str(cfg.env.order),
                        seed=int(cfg.seed))
    val = ps.instances("validation") or ps.instances("train")[-1:]
    greedy_val = evaluate_policies(make_policies(["greedy"], ps), val, progress=False)
    greedy_total = float(greedy_val["total_node_traffic_bps"].mean())
    run_name = cfg.get("run_name") or f"{spec.name}__ddpg__{cfg.seed}"
    tags = {"scenario": spec.name, "task": "train", "agent": "ddpg", "seed": str(cfg.seed),
            "td3": str(bool(a.td3)), "per": str(bool(a.training.prioritized_replay)),
            "observation": str(cfg.env.observation)}
    total_steps, t0 = int(a.total_steps), time.perf_counter()
    print(f"[train] DDPG on {spec.name}: {len(ps.windows['train'])} training windows, "
          f"observation {layout.variant} ({layout.size} values), {spec.num_topics + 1} "
          f"channels, {total_steps:,} env steps; output: {out}", flush=True)
    history = []
    try:
        with tracked_run(cfg, run_name=run_name, tags=tags) as log:
            steps, next_eval, next_log = 0, int(a.eval_every), t0 + float(a.log_every_s)
            best: tuple | None = None  # (key, steps, actor state) of the best validation
            while steps < total_steps:
                res = algo.train()
                steps = int(res["env_runners"]["num_env_steps_sampled_lifetime"])
                lrn = res.get("learners", {}).get("default_policy", {})
                metrics = {"train/episode_return_mean":
                           res["env_runners"].get("episode_return_mean", np.nan),
                           "train/critic_loss": lrn.get("critic_loss", np.nan),
                           "train/actor_loss": lrn.get("actor_loss", np.nan),
                           "train/q_mean": lrn.get("q_mean", np.nan),
                           "train/gradient_updates": algo.updates_done}
                if steps >= next_eval or steps >= total_steps:
                    next_eval += int(a.eval_every)
                    v = summarize(evaluate_policies([actor], val, progress=False)).iloc[0]
                    metrics.update({"val/total_node_mbps": v.total_node_mbps,
                                    "val/feasible_frac": v.feasible_frac,
                                    "val/gap_to_greedy_pct":
                                        100 * (v.total_node_mbps * 1e6 / greedy_total - 1)})
                    history.append({"steps": steps, **metrics})
                    # model selection on validation windows: feasibility first, then traffic
                    key = (-float(v.feasible_frac), float(v.total_node_mbps))
                    if best is None or key < best[0]:
                        best = (key, steps, copy.deepcopy(module.pi.state_dict()))
                log.metrics(metrics, step=steps)
                if time.perf_counter() >= next_log or steps >= total_steps:
                    next_log = time.perf_counter() + float(a.log_every_s)
                    el = time.perf_counter() - t0
                    last = history[-1] if history else {}
                    print(f"[train] {steps:>8,}/{total_steps:,} steps  {steps / el:6.0f} steps/s  "
                          f"{algo.updates_done / el:6.0f} updates/s  validation: "
                          f"{last.get('val/total_node_mbps', float('nan')):.2f} Mbps, "
                          f"feasible {last.get('val/feasible_frac', float('nan')):.2f}, "
                          f"vs greedy {last.get('val/gap_to_greedy_pct', float('nan')):+.1f}%",
                          flush=True)
            if best is not None and a.get("keep_best", True):
                module.pi.load_state_dict(best[2])  # evaluate and export the selected actor
                log.metrics({"val/best_at_steps": best[1],
                             "val/best_total_node_mbps": best[0][1],
                             "val/best_feasible_frac": -best[0][0]})
                print(f"[train] selected the actor of step {best[1]:,} (best validation: "
                      f"feasible {-best[0][0]:.2f}, {best[0][1]:.2f} Mbps)", flush=True)
            test = ps.instances(str(cfg.eval_split))
            pols = [*make_policies(list(cfg.baseline.policies), ps,
                                   to_dict(cfg.baseline.params)), actor]
            per_window = evaluate_policies(pols, test, progress=bool(cfg.progress))
            summary = report(log, per_window, out, spec, str(cfg.eval_split),
                             "DDPG vs baselines")
            curve = pd.DataFrame(history)
            log.table(curve, out / "learning_curve.csv")
            # the exported policy (ONNX + metadata) for serving, and a resumable checkpoint
            from .bundle import export_bundle

            bundle_dir = Path(str(cfg.paths.checkpoint_dir)) / run_name
            export_bundle(module.pi, layout, ps.signature(), bundle_dir, overwrite=True,
                          order=str(cfg.env.order),
                          extra={"run_id": log.run_id, "env_steps": steps,
                                 "selected_at_steps": None if best is None else best[1],
                                 "gradient_updates": algo.updates_done,
                                 "reward": to_dict(cfg.env.reward), "seed": int(cfg.seed)})
            for f in ("actor.onnx", "metadata.json"):
                log.artifact(bundle_dir / f, "policy_bundle")
            algo.save_to_path(str(out / "rllib_checkpoint"))
            print(f"[train] exported the policy bundle to {bundle_dir}", flush=True)
    finally:
        algo.stop()
    return {"summary": summary, "per_window": per_window, "history": history,
            "run_id": log.run_id, "output_dir": out, "algo_steps": steps,
            "bundle_dir": bundle_dir, "layout": layout, "problems": ps}
