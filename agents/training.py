"""``python train.py``: the one trainer. An agent (DDPG + PER with TD3 flags by default;
RLlib's SAC, PPO or DQN with ``agent=sac|ppo|dqn``, :mod:`agents.algorithms`) is trained
offline through RLlib on a task's training data, validated periodically (the weights with
the best validation score are kept), then evaluated on held-out data and exported
(MLflow: config, curves, tables, plots, the policy).

What differs between problems is a :class:`TrainingTask` (the environment, validation,
demonstrations, the held-out evaluation and the export), chosen from ``env``:

============================  ==============================================================
``env=online`` (default)      :class:`agents.task_online.OnlineTask`: the online problem
                              (``smart/DSMDOnline-v0``), training traces; the yardstick on
                              the test traces (:mod:`agents.online_job`) with the learned
                              policy in it; the online policy bundle
``env=dsmd``                  :class:`agents.task_dsmd.DSMDTask`: the static problem
                              (``smart/DSMD-v0``), training windows of the scenario's trace;
                              every baseline on the test windows; the policy bundle
``env=trees|shaping``         :class:`agents.task_episodes.EpisodeTask`: a sub-problem
                              environment, seeded episodes; its baselines; ``actor.onnx``
============================  ==============================================================

With ``agent.demonstrations`` the actor starts as a clone of the teacher (DDPGfD); with
``agent.dagger_rounds`` (a task with ``dagger_demonstrations``: the sub-problems), each
round labels the clone's own states with the teacher's actions and clones again (DAgger,
Ross et al. 2011) before reinforcement learning starts.

The learner never sees a validation or test trace, window or episode. Progress is printed
every ``agent.log_every_s`` seconds with rates.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
import pandas as pd
from omegaconf import DictConfig

from envs.dsmd.errors import DSMDError

from .config import output_dir, to_dict
from .plots import learning_curve_plot
from .seeding import seed_everything
from .tracking import tracked_run

__all__ = [
    "RLLIB_ENV_NAME",
    "Selected",
    "TrainingTask",
    "ablation_tags",
    "make_dsmd_env",
    "make_task",
    "run_training",
    "train_with_selection",
]


@dataclass(frozen=True, eq=False)
class Selected:
    """The weights model selection keeps: those with the lowest validation key so far."""

    key: Any  # the task's selection key (TrainingTask.validate; lower is better)
    steps: int  # env steps trained when they were validated
    weights: dict[str, Any]  # a copy of the score module's state_dict


class TrainingTask(Protocol):
    """What the trainer needs from a problem (module docstring)."""

    rllib_env: str        # the name the env creator is registered under
    env_config: dict      # passed to the creator by every env runner
    act_dim: int          # the action's width (the score module's output)
    run_name: str
    tags: dict[str, str]
    curve_panels: ClassVar[list[tuple[str, list[str]]] | None]

    def env_creator(self) -> Callable[[Any], Any]: ...

    def header(self, agent: str, total: int) -> str: ...

    def policy(self, scores: Any) -> Any: ...

    def demonstrations(self, teacher: str) -> dict[str, np.ndarray]: ...

    def validate(self, policy: Any) -> tuple[dict[str, float], Any]: ...

    def progress(self, last: dict[str, float]) -> str: ...

    def selected(self, key: Any) -> tuple[dict[str, float], str]: ...

    def curve_references(self) -> dict[str, dict[str, float]]: ...

    def finish(self, log: Any, scores: Any, policy: Any, *, steps: int,
               best: Selected | None, updates: int | None,
               start: dict[str, Any] | None = None) -> dict[str, Any]: ...


def make_task(cfg: DictConfig, out: Path) -> TrainingTask:
    """The task of ``cfg.env`` (module docstring)."""
    if cfg.env.get("name") == "online":
        from .task_online import OnlineTask

        return OnlineTask(cfg, out)
    if cfg.env.get("suite"):
        from .task_episodes import EpisodeTask

        return EpisodeTask(cfg, out)
    from .task_dsmd import DSMDTask

    return DSMDTask(cfg, out)


def make_dsmd_env(env_ctx: Any):  # kept here: tests and benchmarks register it by this name
    from .task_dsmd import make_dsmd_env as make

    return make(env_ctx)


RLLIB_ENV_NAME = "smart-dsmd"


def ablation_tags(agent: DictConfig) -> dict[str, str]:
    """Tags that make an ablation one MLflow query (``tags.per = 'False'``, ...)."""
    t = agent.get("training") or {}
    tags = {}
    if agent.name == "ddpg":
        tags.update(td3=str(bool(agent.get("td3"))),
                    per=str(bool(t.get("prioritized_replay", True))),
                    noise=str(t.get("noise_type", "gaussian")),
                    demonstrations=str(agent.get("demonstrations")),
                    dagger_rounds=str(int(agent.get("dagger_rounds") or 0)))
    return tags


def _train_metrics(res: dict, algo: Any) -> dict[str, float]:
    """Every scalar learner metric and the per-episode task metrics, as ``train/*``."""
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
                         ) -> tuple[list[dict], Selected | None, int]:
    """The training loop: one ``algo.train()`` step at a time until ``total`` env steps;
    before the first step (the start: the cloned actor when there are demonstrations), every
    ``eval_every`` steps and at the end, ``validate()`` gives the validation metrics and a
    selection key (lower is better) and the weights with the best key so far are kept; every
    step's metrics go to MLflow; ``progress(steps, elapsed, last validation row)`` prints a
    line every ``log_every_s`` seconds and at the end. Returns ``(history, best, steps)``,
    ``best`` the :class:`Selected` weights (None when nothing was validated)."""
    history: list[dict] = []  # validation points, and training points between them
    best: Selected | None = None
    steps, next_log = 0, t0 + log_every_s

    def check(metrics: dict) -> None:
        nonlocal best
        val, key = validate()
        metrics.update(val)
        history.append({"steps": steps, **metrics})
        if best is None or key < best.key:
            best = Selected(key, steps, copy.deepcopy(scores.state_dict()))

    if eval_every > 0:
        start: dict[str, float] = {}
        check(start)
        log.metrics(start, step=0)
        progress(0, max(time.perf_counter() - t0, 1e-9), history[-1])
    next_eval = eval_every
    while steps < total:
        res = algo.train()
        steps = int(res["env_runners"]["num_env_steps_sampled_lifetime"])
        metrics = _train_metrics(res, algo)
        if (eval_every > 0 and steps >= next_eval) or steps >= total:
            next_eval += eval_every
            check(metrics)
        elif np.isfinite(metrics.get("train/episode_return_mean", np.nan)):
            history.append({"steps": steps, **metrics})  # the training curve between checks
        log.metrics(metrics, step=steps)
        if time.perf_counter() >= next_log or steps >= total:
            next_log = time.perf_counter() + log_every_s
            last = next((h for h in reversed(history) if any(k.startswith("val/") for k in h)),
                        {})
            progress(steps, time.perf_counter() - t0, last)
    return history, best, steps


def _rate_text(steps: int, elapsed: float, algo: Any) -> str:
    upd = getattr(algo, "updates_done", None)
    rate = f"{upd / elapsed:6.0f} updates/s  " if upd is not None else ""
    return f"{steps / elapsed:6.1f} steps/s  {rate}"


def _layout_text(algo: Any) -> str:
    """Where the run samples and learns: the Ray nodes, the env runners, the learner."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    runners = algo.env_runner_group.num_remote_env_runners()
    c = algo.config
    learner = ("in the driver" if algo.learner_group.is_local else "1 remote learner")
    learner += " on a GPU" if c.num_gpus_per_learner else " on a CPU"
    return (f"Ray: {len(nodes)} node(s), {runners or 'no'} remote env runner(s)"
            f"{'' if runners else ' (sampling in the driver)'}, {learner}")


def run_training(cfg: DictConfig) -> dict[str, Any]:
    import ray
    from ray.rllib.core import DEFAULT_MODULE_ID
    from ray.tune.registry import register_env

    from .algorithms import algorithm_config, score_module
    from .ddpg.rllib_internals import local_learner

    seed = int(cfg.seed)
    seed_everything(seed)
    out = output_dir(cfg)
    a = cfg.agent
    name = str(a.name)
    rounds = int(a.get("dagger_rounds") or 0)  # checked before the task's set-up runs
    if rounds < 0 or (rounds and not (a.get("demonstrations") and name == "ddpg"
                                      and a.training.get("bc_pretrain_steps")
                                      and cfg.env.get("suite"))):
        raise DSMDError(f"agent.dagger_rounds={rounds}: DAgger rounds (>= 0) need agent=ddpg "
                        "with agent.demonstrations, agent.training.bc_pretrain_steps > 0 and "
                        "a sub-problem env (env.suite) whose teacher labels the learner's "
                        "states")
    task = make_task(cfg, out)
    dagger = getattr(task, "dagger_demonstrations", None)  # the sub-problems' teachers
    ray_cfg = cfg.get("ray") or {}
    ray.init(address=ray_cfg.get("address"), num_cpus=ray_cfg.get("num_cpus"),
             include_dashboard=False, log_to_driver=False, logging_level="WARNING",
             ignore_reinit_error=True)
    register_env(task.rllib_env, task.env_creator())  # Ray's registry reaches remote runners
    # RLlib registers its single-agent env wrapper with gymnasium at every build: the second
    # run in one process (a Hydra multirun) made gymnasium warn that it overrides it
    warnings.filterwarnings("ignore", message=".*Overriding environment rllib-single-agent-env",
                            category=UserWarning)
    algo = algorithm_config(to_dict(a), task.rllib_env, task.env_config, seed).build_algo()
    stopped = False
    try:
        print(f"[train] {_layout_text(algo)}", flush=True)
        # the weights validated and exported: the local learner's, or with a remote learner
        # the local env runner's copy (synced after every batch of updates)
        module = (local_learner(algo).module[DEFAULT_MODULE_ID] if algo.learner_group.is_local
                  else algo.get_module(DEFAULT_MODULE_ID))
        scores = score_module(name, module, task.act_dim)
        policy = task.policy(scores)
        demo = a.get("demonstrations")
        cloned: list[dict[str, float]] = []  # validation of the clone before each DAgger round
        if demo:
            if name != "ddpg":
                raise DSMDError(f"agent.demonstrations is DDPG's (DDPGfD); {name} does not "
                                "use it")
            d = task.demonstrations(str(demo))
            algo.add_demonstrations(**d)
            print(f"[train] {len(d['obs']):,} demonstration transitions from {demo} "
                  f"(behaviour cloning weight {a.training.get('bc_weight', 0.0)})", flush=True)
            if algo.config.bc_pretrain_steps:
                t = time.perf_counter()
                loss = algo.pretrain_actor()
                print(f"[train] behaviour-cloning pre-training: "
                      f"{algo.config.bc_pretrain_steps:,} steps in "
                      f"{time.perf_counter() - t:.0f} s, loss {loss:.4f}", flush=True)
            for k in range(1, rounds + 1):  # DAgger: the teacher on the clone's own states
                t = time.perf_counter()
                clone_val, _ = task.validate(policy)  # the clone before this round
                cloned.append({f"val/dagger{k - 1}/{c.removeprefix('val/')}": v
                               for c, v in clone_val.items() if "/baseline/" not in c})
                print(f"[train] DAgger round {k}/{rounds}, the clone before it: "
                      + task.progress(clone_val), flush=True)
                assert dagger is not None  # checked with rounds above
                more = dagger(str(demo), policy, k)
                d = {c: np.concatenate([d[c], more[c]]) for c in d}
                algo.add_demonstrations(**d)
                loss = algo.pretrain_actor()
                print(f"[train] DAgger round {k}/{rounds}: {len(more['obs']):,} states of the "
                      f"clone labelled by {demo} ({len(d['obs']):,} demonstration transitions), "
                      f"re-cloned in {time.perf_counter() - t:.0f} s, loss {loss:.4f}",
                      flush=True)
        total, t0 = int(a.total_steps), time.perf_counter()
        print(task.header(name, total) + f"; output: {out}", flush=True)
        with tracked_run(cfg, run_name=task.run_name,
                         tags={**task.tags, "agent": name, "seed": str(seed),
                               **ablation_tags(a)}) as log:
            def progress(st: int, el: float, last: dict) -> None:
                print(f"[train] {st:>8,}/{total:,} steps  {_rate_text(st, el, algo)}"
                      + task.progress(last), flush=True)

            for row in cloned:
                log.metrics(row)
            # the cloned start's weights, which a task may also evaluate on held-out data
            start = copy.deepcopy(scores.state_dict()) if demo else None
            history, best, steps = train_with_selection(
                algo, scores, log, total, int(a.eval_every), float(a.log_every_s), t0,
                lambda: task.validate(policy), progress)
            checks = [h for h in history if any(k.startswith("val/") for k in h)]
            if checks:  # the start (the cloned actor with demonstrations) and the end
                log.metrics({f"{k.replace('val/', 'val/start/', 1)}": v
                             for k, v in checks[0].items() if k.startswith("val/")})
                log.metrics({f"{k.replace('val/', 'val/final/', 1)}": v
                             for k, v in checks[-1].items() if k.startswith("val/")})
            # a resumable checkpoint of the final training state (with DDPG's replay buffer)
            algo.save_to_path(str(out / "rllib_checkpoint"))
            updates = getattr(algo, "updates_done", None)
            if best is not None and a.get("keep_best", True):
                scores.load_state_dict(best.weights)  # evaluate and export the selected weights
                metrics, text = task.selected(best.key)
                log.metrics({"val/best_at_steps": best.steps, **metrics})
                print(f"[train] selected the weights of step {best.steps:,} ({text})", flush=True)
            curve = pd.DataFrame(history)
            log.table(curve, out / "learning_curve.csv")
            if len(curve):
                log.artifact(learning_curve_plot(curve, out / "learning_curve.png",
                                                 f"{name.upper()}: {task.run_name}",
                                                 task.curve_panels, task.curve_references()),
                             "plots")
            algo.stop()  # the held-out evaluation needs no Ray
            stopped = True
            result = task.finish(log, scores, policy, steps=steps, best=best, updates=updates,
                                 start=start)
    finally:
        if not stopped:
            algo.stop()
    return {"history": history, "run_id": log.run_id, "output_dir": out, "algo_steps": steps,
            **result}
