"""A sub-problem environment as a training task (``python train.py env=trees|shaping``,
:mod:`agents.training`): the same DDPG (RLlib, :mod:`agents.ddpg`) on a sub-problem
environment, then the learned actor against the sub-problem's baselines over whole
held-out episodes (MLflow: config, curves, tables, plots, the exported actor).

The environment and its baselines come from ``configs/env/<name>.yaml`` (``env.id``,
``env.kwargs``, ``env.suite``, ``env.baselines``; :mod:`agents.episodes` holds the contract).
Episodes are seeded from ``seed`` through disjoint streams (training episodes by RLlib from
``seed``, validation and test episodes by :func:`agents.episodes.episode_seeds`), so the
learner never sees an evaluation episode. Model selection: the actor with the best mean
validation return is evaluated and exported. ``agent.demonstrations`` names a baseline whose
episodes become DDPGfD demonstrations (behaviour-cloning pre-training and demonstration rows in
every batch, as on DSMD); ``agent.dagger_rounds`` adds, per round, the teacher's actions on
the states the cloned actor itself visits (DAgger), each with the reward and next
observation that action would have had.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from omegaconf import DictConfig

from .config import output_dir, to_dict, workers_setting
from .episodes import (
    ActorEnvPolicy,
    EnvPolicy,
    SuiteError,
    episode_seeds,
    load_suite,
    play_episode,
    run_episodes,
    summarize_episodes,
)
from .seeding import seed_everything
from .tracking import tracked_run

if TYPE_CHECKING:
    from .training import Selected

__all__ = [
    "EpisodeTask",
    "episode_demonstrations",
    "evaluate_env_baselines",
    "make_subproblem_env",
]


def make_subproblem_env(env_ctx: Any):
    """RLlib env creator (module-level, so remote env runners can unpickle it)."""
    import gymnasium as gym

    import envs  # noqa: F401  (registers the smart/* ids in this process)

    kw = dict(env_ctx)
    kw.pop("num_envs", None)
    return gym.make(kw.pop("env_id"), **kw)


def _labelled(policy: EnvPolicy, env: Any, seed: int, roll_in: EnvPolicy
              ) -> Iterator[tuple[np.ndarray, np.ndarray, float, np.ndarray, bool]]:
    """One episode that follows ``roll_in``: at every state, ``policy``'s action with the
    reward, next observation and end that action has on a copy of the environment."""
    obs, _ = env.reset(seed=int(seed))
    policy.reset(env.unwrapped, int(seed))
    roll_in.reset(env.unwrapped, int(seed))
    done = False
    while not done:
        a = policy.act(obs, env.unwrapped)
        twin = copy.deepcopy(env)  # wrappers included: the row is what env.step(a) returns
        nxt, r, term, _, _ = twin.step(a)
        yield obs, a, float(r), nxt, bool(term)
        obs, _, term, trunc, _ = env.step(roll_in.act(obs, env.unwrapped))
        done = term or trunc


def episode_demonstrations(policy: EnvPolicy, env_id: str, env_kwargs: Mapping[str, Any],
                           seeds: list[int], roll_in: EnvPolicy | None = None
                           ) -> dict[str, np.ndarray]:
    """Transitions (obs, actions, rewards, next_obs, terminateds) of ``policy``'s episodes;
    with ``roll_in``, of ``policy``'s actions on the states of ``roll_in``'s episodes
    (DAgger, Ross et al. 2011: the states a learner reaches, labelled by the teacher)."""
    env = make_subproblem_env({"env_id": env_id, **env_kwargs})
    cols: dict[str, list] = {k: [] for k in ("obs", "actions", "rewards", "next_obs",
                                            "terminateds")}
    for s in seeds:
        steps = (((obs, a, r, nxt, term) for obs, a, r, nxt, term, _, _
                  in play_episode(policy, env, s)) if roll_in is None
                 else _labelled(policy, env, s, roll_in))
        for obs, a, r, nxt, term in steps:
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
               color=[{"learned": "tab:brown", "clone": "tab:orange"}.get(p, "tab:blue")
                      for p in summary["policy"]])
        ax.set_title(c, fontsize=10)
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _export_actor(scores, obs_dim: int, out: Path) -> Path:
    """The actor as ONNX (``obs [B, obs_dim] -> action [B, d]``) for use outside RLlib."""
    from .bundle_export import export_onnx

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
    baselines = load_suite(str(e.suite)).baseline_policies(list(e.baselines), env_kwargs,
                                                           workers=_workers(e))
    test_seeds = episode_seeds(seed, "test", int(e.get("eval_episodes", 10)))
    run_name = cfg.get("run_name") or f"{str(e.id).split('/')[-1]}__baselines__{seed}"
    with tracked_run(cfg, run_name=run_name, tags={"env": str(e.id), "task": "baselines",
                                                    "seed": str(seed)}) as log:
        try:
            per_ep = run_episodes(baselines, str(e.id), env_kwargs, test_seeds,
                                  progress=bool(cfg.progress), desc="evaluate")
        finally:
            _close(baselines)
        summary = _report(log, per_ep, out, f"Baselines on {e.id} ({len(test_seeds)} test "
                          "episodes)")
    return {"summary": summary, "per_episode": per_ep, "run_id": log.run_id,
            "output_dir": out}


def _workers(env_cfg: Any) -> int:
    """``env.workers``: processes a slow (planning) baseline or teacher may use; null: the
    usable cores (at most 10, a planner's candidates)."""
    return workers_setting(env_cfg.get("workers"), "env.workers", error=SuiteError)


def _close(policies: Any) -> None:
    """Stop the worker processes of the policies that have them (a planner's)."""
    for p in policies:
        close = getattr(p, "close", None)
        if callable(close):
            close()


class EpisodeTask:
    """A sub-problem environment as a training task (module docstring)."""

    curve_panels: ClassVar[list[tuple[str, list[str]]] | None] = [
        ("Episode return", ["train/episode_return_mean", "val/return"])]

    def __init__(self, cfg: DictConfig, out: Path) -> None:
        from .algorithms import action_mode

        self.cfg, self.out = cfg, out
        self.seed = seed = int(cfg.seed)
        a, e = cfg.agent, cfg.env
        self.name = name = str(a.name)
        if action_mode(name) != "box":
            raise SuiteError(f"agent={name} needs a discrete action; {e.id} has a Box action "
                             "(use agent=ddpg, sac or ppo)")
        self.env_id, self.env_kwargs = str(e.id), dict(to_dict(e.get("kwargs")) or {})
        self.suite = load_suite(str(e.suite))
        self.workers = _workers(e)
        self.baselines = self.suite.baseline_policies(list(e.baselines), self.env_kwargs,
                                                      workers=self.workers)
        self._teachers: dict[str, EnvPolicy] = {}
        self.val_seeds = episode_seeds(seed, "validation", int(e.get("val_episodes", 3)))
        self.test_seeds = episode_seeds(seed, "test", int(e.get("eval_episodes", 10)))
        probe = make_subproblem_env({"env_id": self.env_id, **self.env_kwargs})
        self.obs_dim = int(probe.observation_space.shape[0])
        self.act_dim = int(probe.action_space.shape[0])
        probe.close()
        self.rllib_env = f"smart-{self.env_id.split('/')[-1]}"
        self.env_config = {"env_id": self.env_id, **self.env_kwargs}
        refs = self._val_references(e)
        self.base_ret: dict[str, float] = {}
        if refs:  # env.val_baselines: [] scores none
            try:
                base_val = summarize_episodes(run_episodes(refs, self.env_id,
                                                           self.env_kwargs, self.val_seeds))
            finally:
                _close(self.baselines)
            self.base_ret = dict(zip(base_val["policy"], base_val["return"]))
        self.run_name = cfg.get("run_name") or f"{self.env_id.split('/')[-1]}__{name}__{seed}"
        self.tags = {"env": self.env_id, "task": "train"}

    def _val_references(self, e: Any) -> list[EnvPolicy]:
        """The baselines scored on the validation episodes beside each check of the learner
        (``env.val_baselines``, a list from ``env.baselines``; null: all of them; empty:
        none): a reference only, which a slow planner need not be on many validation
        episodes."""
        names = e.get("val_baselines")
        if names is None:
            return list(self.baselines)
        if isinstance(names, str) or not isinstance(names, Sequence):
            raise SuiteError(f"env.val_baselines must be a list of baseline names or null, "
                             f"got {names!r}")
        wanted = [str(n) for n in names]
        known = [getattr(p, "name", None) for p in self.baselines]
        unknown = [n for n in wanted if n not in known]
        if unknown:
            raise SuiteError(f"env.val_baselines: {unknown} not among env.baselines {known}")
        return [p for p, n in zip(self.baselines, known) if n in wanted]

    def env_creator(self):
        return make_subproblem_env

    def header(self, agent: str, total: int) -> str:
        return (f"[train] {agent.upper()} on {self.env_id}: observation {self.obs_dim}, action "
                f"{self.act_dim}, {total:,} env steps; validation returns of the baselines: "
                + (", ".join(f"{k} {v:.3f}" for k, v in self.base_ret.items()) or "none"))

    def policy(self, scores: Any) -> ActorEnvPolicy:
        from .algorithms import torch_scorer

        return ActorEnvPolicy(torch_scorer(scores), name="learned")

    def _teacher(self, name: str) -> EnvPolicy:
        """The teacher ``name``: the baseline of that name, or one built once (a tuned or
        planning teacher tunes once)."""
        if name not in self._teachers:
            same = [p for p in self.baselines if getattr(p, "name", None) == name]
            self._teachers[name] = (same[0] if same else self.suite.baseline_policies(
                [name], self.env_kwargs, workers=self.workers)[0])
        return self._teachers[name]

    def demonstrations(self, teacher: str) -> dict[str, np.ndarray]:
        pol = self._teacher(teacher)
        try:
            return episode_demonstrations(pol, self.env_id, self.env_kwargs, episode_seeds(
                self.seed, "demo", int(self.cfg.env.get("demo_episodes", 20))))
        finally:
            _close([pol])

    def dagger_demonstrations(self, teacher: str, roll_in: EnvPolicy, round_: int
                              ) -> dict[str, np.ndarray]:
        """DAgger round ``round_``: ``teacher``'s actions on the states of ``roll_in``'s
        episodes (``env.dagger_episodes`` of them, their own seed stream per round)."""
        n = int(self.cfg.env.get("dagger_episodes", 4))
        pol = self._teacher(teacher)
        try:
            return episode_demonstrations(pol, self.env_id, self.env_kwargs,
                                          episode_seeds(self.seed, f"dagger-{int(round_)}", n),
                                          roll_in=roll_in)
        finally:
            _close([pol])

    def validate(self, policy: Any) -> tuple[dict[str, float], float]:
        v = summarize_episodes(run_episodes([policy], self.env_id, self.env_kwargs,
                                            self.val_seeds)).iloc[0]
        val = {f"val/{k}": float(v[k]) for k in v.index
               if k not in ("policy", "episodes", "time_s", "steps")}
        val.update({f"val/baseline/{k}": r for k, r in self.base_ret.items()})
        return val, -float(v["return"])  # the highest return

    def progress(self, last: dict[str, float]) -> str:
        return f"validation return {last.get('val/return', float('nan')):.3f}"

    def selected(self, key: Any) -> tuple[dict[str, float], str]:
        return {"val/best_return": -key}, f"validation return {-key:.3f}"

    def curve_references(self) -> dict[str, dict[str, float]]:
        return {"val/return": dict(self.base_ret)}

    def finish(self, log: Any, scores: Any, policy: Any, *, steps: int,
               best: Selected | None, updates: int | None,
               start: dict[str, Any] | None = None) -> dict[str, Any]:
        """The baselines, the learned policy and, with ``start`` (the cloned actor's weights
        before reinforcement learning), that clone as ``clone`` on the test episodes, so
        the reinforcement phase is judged on held-out episodes too."""
        out = self.out
        pols = [*self.baselines, policy]
        if start is not None:
            from .algorithms import torch_scorer

            clone = copy.deepcopy(scores)
            clone.load_state_dict(start)
            pols.append(ActorEnvPolicy(torch_scorer(clone), name="clone"))
        try:
            per_ep = run_episodes(pols, self.env_id, self.env_kwargs,
                                  self.test_seeds, progress=bool(self.cfg.progress),
                                  desc="evaluate")
        finally:
            _close(self.baselines)
        summary = _report(log, per_ep, out, f"{self.name.upper()} vs baselines on "
                          f"{self.env_id} ({len(self.test_seeds)} test episodes)")
        log.artifact(_export_actor(scores, self.obs_dim, out), "policy")
        print(f"[train] wrote {out}/summary.csv, comparison.png, actor.onnx"
              + (f"; MLflow run {log.run_id}" if log.run_id else ""), flush=True)
        return {"summary": summary, "per_episode": per_ep}
