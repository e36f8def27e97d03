"""``python train.py env=multicast|shaping``: the same DDPG (RLlib, :mod:`agents.ddpg`) on a
sub-problem environment, then the learned actor against the sub-problem's baselines over whole
held-out episodes (MLflow: config, curves, tables, plots, the exported actor).

The environment and its baselines come from ``configs/env/<name>.yaml`` (``env.id``,
``env.kwargs``, ``env.suite``, ``env.baselines``; :mod:`agents.episodes` holds the contract).
Episodes are seeded from ``seed`` through disjoint streams (training episodes by RLlib from
``seed``, validation and test episodes by :func:`agents.episodes.episode_seeds`), so the
learner never sees an evaluation episode. Model selection: the actor with the best mean
validation return is evaluated and exported. ``agent.demonstrations`` names a baseline whose
episodes become DDPGfD demonstrations (behaviour-cloning pre-training and demonstration rows in
every batch, as on DSMD).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any, Mapping

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from envs.seeding import seed_everything  # noqa: E402

from .config import output_dir, to_dict  # noqa: E402
from .episodes import (ActorEnvPolicy, EnvPolicy, SuiteError, episode_seeds,  # noqa: E402
                       load_suite, play_episode, run_episodes, summarize_episodes)
from .tracking import tracked_run  # noqa: E402
from .training import train_with_selection  # noqa: E402

__all__ = ["run_env_training", "make_subproblem_env", "episode_demonstrations"]


def make_subproblem_env(env_ctx: Any):
    """RLlib env creator (module-level, so remote env runners can unpickle it)."""
    import gymnasium as gym

    import envs  # noqa: F401  (registers the smart/* ids in this process)

    kw = dict(env_ctx)
    kw.pop("num_envs", None)
    return gym.make(kw.pop("env_id"), **kw)


def episode_demonstrations(policy: EnvPolicy, env_id: str, env_kwargs: Mapping[str, Any],
                           seeds: list[int]) -> dict[str, np.ndarray]:
    """Transitions (obs, actions, rewards, next_obs, terminateds) of ``policy``'s episodes."""
    env = make_subproblem_env({"env_id": env_id, **env_kwargs})
    cols: dict[str, list] = {k: [] for k in ("obs", "actions", "rewards", "next_obs",
                                            "terminateds")}
    for s in seeds:
        for obs, a, r, nxt, term, _, _ in play_episode(policy, env, s):
            for k, v in zip(cols, (obs, np.asarray(a, np.float32), r, nxt, float(term))):
                cols[k].append(v)
    env.close()
    return {k: np.asarray(v, dtype=np.float32) for k, v in cols.items()}


def _comparison_plot(summary: pd.DataFrame, path: Path, title: str) -> Path:
    cols = [c for c in summary.columns if c not in ("policy", "episodes", "return_std",
                                                    "steps", "time_s")]
    fig, axes = plt.subplots(1, len(cols), figsize=(3.6 * len(cols), 3.4), squeeze=False)
    for ax, c in zip(axes[0], cols):
        err = summary["return_std"] if c == "return" else None
        ax.bar(summary["policy"], summary[c], yerr=err, capsize=3,
               color=["tab:brown" if p == "learned" else "tab:blue" for p in summary["policy"]])
        ax.set_title(c, fontsize=10)
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _curve_plot(curve: pd.DataFrame, path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(5.4, 3.6))
    for c, label in (("train/episode_return_mean", "training episodes"),
                     ("val/return", "validation (noise-free)")):
        if c in curve and curve[c].notna().any():
            ax.plot(curve["steps"], curve[c], marker=".", label=label)
    for c in [c for c in curve if c.startswith("val/baseline/")]:
        ax.axhline(curve[c].iloc[-1], ls="--", lw=1, color="gray")
        ax.text(curve["steps"].iloc[0], curve[c].iloc[-1], c.split("/")[-1], fontsize=7,
                va="bottom")
    ax.set_xlabel("environment steps")
    ax.set_ylabel("episode return")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _export_actor(scores, obs_dim: int, out: Path) -> Path:
    """The actor as ONNX (``obs [B, obs_dim] -> action [B, d]``) for use outside RLlib."""
    from .bundle import export_onnx

    return export_onnx(copy.deepcopy(scores).cpu().eval(), obs_dim, out / "actor.onnx",
                       output_name="action")


def _report(log, per_ep: pd.DataFrame, out: Path, title: str) -> pd.DataFrame:
    """Tables (per episode, summary), test metrics and the comparison plot of an evaluation."""
    summary = summarize_episodes(per_ep)
    log.table(per_ep, out / "per_episode.csv")
    log.table(summary, out / "summary.csv")
    for row in summary.to_dict("records"):
        log.metrics({f"test/{row['policy']}/{k}": v for k, v in row.items()
                     if k not in ("policy", "episodes")})
    log.artifact(_comparison_plot(summary, out / "comparison.png", title), "plots")
    print(summary.to_string(index=False, float_format=lambda x: f"{x:.4g}"), flush=True)
    return summary


def evaluate_env_baselines(cfg: DictConfig) -> dict[str, Any]:
    """``train.py env=<sub-problem> agent=baselines``: the baselines alone on the test
    episodes (no training)."""
    seed, e = int(cfg.seed), cfg.env
    seed_everything(seed)
    out = output_dir(cfg)
    env_kwargs = dict(to_dict(e.get("kwargs")) or {})
    baselines = load_suite(str(e.suite)).baseline_policies(list(e.baselines), env_kwargs)
    test_seeds = episode_seeds(seed, "test", int(e.get("eval_episodes", 10)))
    run_name = cfg.get("run_name") or f"{str(e.id).split('/')[-1]}__baselines__{seed}"
    with tracked_run(cfg, run_name=run_name, tags={"env": str(e.id), "task": "baselines",
                                                    "seed": str(seed)}) as log:
        per_ep = run_episodes(baselines, str(e.id), env_kwargs, test_seeds,
                              progress=bool(cfg.progress), desc="evaluate")
        summary = _report(log, per_ep, out, f"Baselines on {e.id} ({len(test_seeds)} test "
                          "episodes)")
    return {"summary": summary, "per_episode": per_ep, "run_id": log.run_id,
            "output_dir": out}


def run_env_training(cfg: DictConfig) -> dict[str, Any]:
    import ray
    from ray.rllib.core import DEFAULT_MODULE_ID
    from ray.tune.registry import register_env

    from .algorithms import action_mode, algorithm_config, score_module, torch_scorer

    seed = int(cfg.seed)
    seed_everything(seed)
    out = output_dir(cfg)
    a, e = cfg.agent, cfg.env
    name = str(a.name)
    if name == "baselines":
        return evaluate_env_baselines(cfg)
    if action_mode(name) != "box":
        raise SuiteError(f"agent={name} needs a discrete action; {e.id} has a Box action "
                         "(use agent=ddpg, sac or ppo)")
    env_id, env_kwargs = str(e.id), dict(to_dict(e.get("kwargs")) or {})
    suite = load_suite(str(e.suite))
    baselines = suite.baseline_policies(list(e.baselines), env_kwargs)
    val_seeds = episode_seeds(seed, "validation", int(e.get("val_episodes", 3)))
    test_seeds = episode_seeds(seed, "test", int(e.get("eval_episodes", 10)))
    probe = make_subproblem_env({"env_id": env_id, **env_kwargs})
    obs_dim, act_dim = int(probe.observation_space.shape[0]), int(probe.action_space.shape[0])
    probe.close()

    ray_cfg = cfg.get("ray") or {}
    ray.init(address=ray_cfg.get("address"), num_cpus=ray_cfg.get("num_cpus"),
             include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    rllib_name = f"smart-{env_id.split('/')[-1]}"
    register_env(rllib_name, make_subproblem_env)
    algo = algorithm_config(to_dict(a), rllib_name, {"env_id": env_id, **env_kwargs},
                            seed).build_algo()
    module = algo.learner_group._learner.module[DEFAULT_MODULE_ID]
    scores = score_module(name, module, act_dim)
    actor = ActorEnvPolicy(torch_scorer(scores), name="learned")
    demo = a.get("demonstrations")
    if demo:
        if name != "ddpg":
            raise SuiteError(f"agent.demonstrations is DDPG's (DDPGfD); {name} does not use it")
        teacher = suite.baseline_policies([str(demo)], env_kwargs)[0]
        d = episode_demonstrations(teacher, env_id, env_kwargs,
                                   episode_seeds(seed, "demo", int(e.get("demo_episodes", 20))))
        algo.add_demonstrations(**d)
        print(f"[train] {len(d['obs']):,} demonstration transitions from {demo}", flush=True)
        if algo.config.bc_pretrain_steps:
            loss = algo.pretrain_actor()
            print(f"[train] behaviour-cloning pre-training: {algo.config.bc_pretrain_steps:,} "
                  f"steps, loss {loss:.4f}", flush=True)
    base_val = summarize_episodes(run_episodes(baselines, env_id, env_kwargs, val_seeds))
    base_ret = dict(zip(base_val["policy"], base_val["return"]))
    run_name = cfg.get("run_name") or f"{env_id.split('/')[-1]}__{name}__{seed}"
    tags = {"env": env_id, "task": "train", "agent": name, "seed": str(seed)}
    total, t0 = int(a.total_steps), time.perf_counter()
    print(f"[train] {name.upper()} on {env_id}: observation {obs_dim}, action {act_dim}, "
          f"{total:,} env steps; validation returns of the baselines: "
          + ", ".join(f"{k} {v:.3f}" for k, v in base_ret.items()) + f"; output: {out}",
          flush=True)
    history: list[dict] = []
    try:
        with tracked_run(cfg, run_name=run_name, tags=tags) as log:
            def validate() -> tuple[dict[str, float], float]:
                v = summarize_episodes(run_episodes([actor], env_id, env_kwargs,
                                                    val_seeds)).iloc[0]
                val = {f"val/{k}": float(v[k]) for k in v.index
                       if k not in ("policy", "episodes", "time_s", "steps")}
                val.update({f"val/baseline/{k}": r for k, r in base_ret.items()})
                return val, -float(v["return"])  # the highest return

            def progress(st: int, el: float, last: dict) -> None:
                print(f"[train] {st:>8,}/{total:,} steps  {st / el:6.0f} steps/s  "
                      f"validation return {last.get('val/return', float('nan')):.3f}",
                      flush=True)

            history, best, steps = train_with_selection(
                algo, scores, log, total, int(a.eval_every), float(a.log_every_s), t0,
                validate, progress)
            algo.save_to_path(str(out / "rllib_checkpoint"))
            if best is not None and a.get("keep_best", True):
                scores.load_state_dict(best[2])
                log.metrics({"val/best_at_steps": best[1], "val/best_return": -best[0]})
                print(f"[train] selected the weights of step {best[1]:,} (validation return "
                      f"{-best[0]:.3f})", flush=True)
            per_ep = run_episodes([*baselines, actor], env_id, env_kwargs, test_seeds,
                                  progress=bool(cfg.progress), desc="evaluate")
            summary = _report(log, per_ep, out, f"{name.upper()} vs baselines on {env_id} "
                              f"({len(test_seeds)} test episodes)")
            curve = pd.DataFrame(history)
            log.table(curve, out / "learning_curve.csv")
            if len(curve):
                log.artifact(_curve_plot(curve, out / "learning_curve.png",
                                         f"{name.upper()} on {env_id}"), "plots")
            log.artifact(_export_actor(scores, obs_dim, out), "policy")
            print(f"[train] wrote {out}/summary.csv, comparison.png, actor.onnx"
                  + (f"; MLflow run {log.run_id}" if log.run_id else ""), flush=True)
    finally:
        algo.stop()
    return {"summary": summary, "per_episode": per_ep, "history": history,
            "run_id": log.run_id, "output_dir": out, "algo_steps": steps}
