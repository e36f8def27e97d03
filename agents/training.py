"""``python train.py``: train an agent (DDPG + PER with TD3 flags by default; RLlib's SAC, PPO
or DQN with ``agent=sac|ppo|dqn``, :mod:`agents.algorithms`) offline on the scenario's
training windows, validate periodically, then evaluate the learned policy against every
baseline on the held-out test windows (MLflow: config, curves, tables, plots, the bundle).

Offline on traces: every episode is a training window of the scenario's trace
(``smart/DSMD-v0`` with ``split="train"``); validation and test windows are never seen by
the learner. Progress is printed every ``agent.log_every_s`` seconds with rates.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
from omegaconf import DictConfig

from envs.dsmd.errors import DSMDError
from envs.dsmd.observation import ObservationLayout
from envs.dsmd.problems import build_problems
from envs.dsmd.scenarios import ScenarioSpec
from envs.seeding import seed_everything

from .config import output_dir, scenario_spec, to_dict
from .evaluation import evaluate_policies, summarize
from .demonstrations import demonstrations
from .learned import ActorPolicy
from .plots import learning_curve_plot
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


def ablation_tags(agent: DictConfig) -> dict[str, str]:
    """Tags that make an ablation one MLflow query (``tags.per = 'False'``, ...)."""
    t = agent.get("training") or {}
    tags = {}
    if agent.name == "ddpg":
        tags.update(td3=str(bool(agent.get("td3"))),
                    per=str(bool(t.get("prioritized_replay", True))),
                    noise=str(t.get("noise_type", "gaussian")))
    return tags


def _train_metrics(res: dict, algo: Any) -> dict[str, float]:
    """Every scalar learner metric and the per-episode DSMD metrics, as ``train/*``."""
    runners = res.get("env_runners", {})
    out = {"train/episode_return_mean": runners.get("episode_return_mean", np.nan)}
    for group in ("dsmd", "episode"):  # DSMD's Eq. 2 terms; a sub-problem's episode_metrics
        for k, v in runners.get(group, {}).items():
            out[f"train/{group}/{k}"] = float(v)
    for k, v in res.get("learners", {}).get("default_policy", {}).items():
        if isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool):
            out[f"train/{k}"] = float(v)
    if hasattr(algo, "updates_done"):
        out["train/gradient_updates"] = algo.updates_done
    return out


def train_with_selection(algo: Any, scores: Any, log: Any, total: int, eval_every: int,
                         log_every_s: float, t0: float,
                         validate: Callable[[], tuple[dict[str, float], Any]],
                         progress: Callable[[int, float, dict], None]
                         ) -> tuple[list[dict], tuple | None, int]:
    """The training loop of both trainers (the DSMD one here and ``agents.env_training``):
    one ``algo.train()`` step at a time until ``total`` env steps; every ``eval_every`` steps
    and at the end, ``validate()`` gives the validation metrics and a selection key (lower is
    better) and the weights with the best key so far are kept; every step's metrics go to
    MLflow; ``progress(steps, elapsed, last validation row)`` prints a line every
    ``log_every_s`` seconds and at the end. Returns ``(history, best, steps)``, ``best`` =
    ``(key, steps, state_dict)`` or None."""
    history: list[dict] = []
    best: tuple | None = None
    steps, next_eval, next_log = 0, 0, t0 + log_every_s
    while steps < total:
        res = algo.train()
        steps = int(res["env_runners"]["num_env_steps_sampled_lifetime"])
        metrics = _train_metrics(res, algo)
        if steps >= next_eval or steps >= total:
            next_eval += eval_every
            val, key = validate()
            metrics.update(val)
            history.append({"steps": steps, **metrics})
            if best is None or key < best[0]:
                best = (key, steps, copy.deepcopy(scores.state_dict()))
        log.metrics(metrics, step=steps)
        if time.perf_counter() >= next_log or steps >= total:
            next_log = time.perf_counter() + log_every_s
            progress(steps, time.perf_counter() - t0, history[-1] if history else {})
    return history, best, steps


def _progress(steps: int, total: int, elapsed: float, algo: Any, last: dict) -> None:
    upd = getattr(algo, "updates_done", None)
    rate = f"{upd / elapsed:6.0f} updates/s  " if upd is not None else ""
    print(f"[train] {steps:>8,}/{total:,} steps  {steps / elapsed:6.0f} steps/s  {rate}"
          f"validation: {last.get('val/total_node_mbps', float('nan')):.2f} Mbps, "
          f"feasible {last.get('val/feasible_frac', float('nan')):.2f}, "
          f"vs greedy {last.get('val/gap_to_greedy_pct', float('nan')):+.1f}%", flush=True)


def run_training(cfg: DictConfig) -> dict[str, Any]:
    import ray
    from ray.rllib.core import DEFAULT_MODULE_ID

    from .algorithms import action_mode, algorithm_config, score_module, torch_scorer

    seed_everything(int(cfg.seed))
    spec = scenario_spec(cfg)
    out = output_dir(cfg)
    a = cfg.agent
    name = str(a.name)
    mode = action_mode(name)
    # a discrete action is applied as chosen; evaluate it the same way (argmax of its scores)
    decoding = str(cfg.env.decoding) if mode == "box" else "argmax"
    ps = build_problems(spec, cache_dir=cfg.paths.data_dir, batch_key=cfg.env.batch_key)
    env_kwargs = {"observation": str(cfg.env.observation), "action": mode,
                  "reward": to_dict(cfg.env.reward), "order": str(cfg.env.order),
                  "decoding": str(cfg.env.decoding),
                  "initial": str(cfg.env.initial), "batch_key": str(cfg.env.batch_key),
                  "cache_dir": str(cfg.paths.data_dir), "split": "train"}
    layout = ObservationLayout(str(cfg.env.observation), ps.catalog_size, ps.num_nodes,
                               spec.num_topics)
    ray_cfg = cfg.get("ray") or {}
    ray.init(address=ray_cfg.get("address"), num_cpus=ray_cfg.get("num_cpus"),
             include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    from ray.tune.registry import register_env

    register_env(RLLIB_ENV_NAME, make_dsmd_env)  # Ray's registry reaches remote runners too
    algo = algorithm_config(to_dict(a), RLLIB_ENV_NAME,
                            {"scenario_spec": spec.to_dict(), **env_kwargs},
                            int(cfg.seed)).build_algo()
    module = algo.learner_group._learner.module[DEFAULT_MODULE_ID]
    scores = score_module(name, module, spec.num_topics + 1)
    actor = ActorPolicy(torch_scorer(scores), layout, name=name, order=str(cfg.env.order),
                        decoding=decoding, seed=int(cfg.seed))
    demo = a.get("demonstrations")
    if demo:
        if name != "ddpg":
            raise DSMDError(f"agent.demonstrations is DDPG's (DDPGfD); {name} does not use it")
        d = demonstrations(make_policies([str(demo)], ps)[0], ps, env_kwargs)
        algo.add_demonstrations(**d)
        print(f"[train] {len(d['obs']):,} demonstration transitions from {demo} on the "
              f"training windows (behaviour cloning weight "
              f"{a.training.get('bc_weight', 0.0)})", flush=True)
        if algo.config.bc_pretrain_steps:
            t = time.perf_counter()
            loss = algo.pretrain_actor()
            print(f"[train] behaviour-cloning pre-training: {algo.config.bc_pretrain_steps:,} "
                  f"steps in {time.perf_counter() - t:.0f} s, loss {loss:.3f}", flush=True)
    val = ps.instances("validation") or ps.instances("train")[-1:]
    greedy_val = evaluate_policies(make_policies(["greedy"], ps), val, progress=False)
    greedy_total = float(greedy_val["total_node_traffic_bps"].mean())
    run_name = cfg.get("run_name") or f"{spec.name}__{name}__{cfg.seed}"
    tags = {"scenario": spec.name, "task": "train", "agent": name, "seed": str(cfg.seed),
            "observation": str(cfg.env.observation), "decoding": decoding,
            "reward_form": str(cfg.env.reward.form), **ablation_tags(a)}
    total_steps, t0 = int(a.total_steps), time.perf_counter()
    print(f"[train] {name.upper()} on {spec.name}: {len(ps.windows['train'])} training windows, "
          f"observation {layout.variant} ({layout.size} values), {spec.num_topics + 1} "
          f"channels, {total_steps:,} env steps; output: {out}", flush=True)
    history: list[dict] = []
    try:
        with tracked_run(cfg, run_name=run_name, tags=tags) as log:
            def validate() -> tuple[dict[str, float], tuple[float, float]]:
                v = summarize(evaluate_policies([actor], val, progress=False)).iloc[0]
                # model selection on validation windows: feasibility first, then traffic
                return ({"val/total_node_mbps": v.total_node_mbps,
                         "val/feasible_frac": v.feasible_frac,
                         "val/bw_violation": v.bw_violation,
                         "val/cpu_violation": v.cpu_violation,
                         "val/node_violation": v.node_violation,
                         "val/gap_to_greedy_pct":
                             100 * (v.total_node_mbps * 1e6 / greedy_total - 1)},
                        (-float(v.feasible_frac), float(v.total_node_mbps)))

            history, best, steps = train_with_selection(
                algo, scores, log, total_steps, int(a.eval_every), float(a.log_every_s), t0,
                validate, lambda st, el, last: _progress(st, total_steps, el, algo, last))
            # a resumable checkpoint of the final training state (with DDPG's replay buffer)
            algo.save_to_path(str(out / "rllib_checkpoint"))
            if best is not None and a.get("keep_best", True):
                scores.load_state_dict(best[2])  # evaluate and export the selected weights
                log.metrics({"val/best_at_steps": best[1],
                             "val/best_total_node_mbps": best[0][1],
                             "val/best_feasible_frac": -best[0][0]})
                print(f"[train] selected the weights of step {best[1]:,} (best validation: "
                      f"feasible {-best[0][0]:.2f}, {best[0][1]:.2f} Mbps)", flush=True)
            test = ps.instances(str(cfg.eval_split))
            pols = [*make_policies(list(cfg.baseline.policies), ps,
                                   to_dict(cfg.baseline.params)), actor]
            per_window = evaluate_policies(pols, test, progress=bool(cfg.progress))
            summary = report(log, per_window, out, spec, str(cfg.eval_split),
                             f"{name.upper()} vs baselines")
            curve = pd.DataFrame(history)
            log.table(curve, out / "learning_curve.csv")
            if len(curve):
                log.artifact(learning_curve_plot(curve, out / "learning_curve.png",
                                                 f"{name.upper()} on {spec.name}"), "plots")
            # the exported policy (ONNX + metadata) for serving
            from .bundle import BUNDLE_FILES, export_bundle

            bundle_dir = Path(str(cfg.paths.checkpoint_dir)) / run_name
            export_bundle(scores, layout, ps.signature(), bundle_dir, overwrite=True,
                          order=str(cfg.env.order), decoding=decoding,
                          extra={"run_id": log.run_id, "algorithm": name, "env_steps": steps,
                                 "selected_at_steps": None if best is None else best[1],
                                 "gradient_updates": getattr(algo, "updates_done", None),
                                 "reward": to_dict(cfg.env.reward), "seed": int(cfg.seed)})
            for f in BUNDLE_FILES:
                log.artifact(bundle_dir / f, "policy_bundle")
            print(f"[train] exported the policy bundle to {bundle_dir}", flush=True)
    finally:
        algo.stop()
    return {"summary": summary, "per_window": per_window, "history": history,
            "run_id": log.run_id, "output_dir": out, "algo_steps": steps,
            "bundle_dir": bundle_dir, "layout": layout, "problems": ps}
