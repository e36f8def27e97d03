"""The online DSMD problem as a training task (``train.py``, ``env=online``,
:mod:`agents.training`).

DDPG sets the knobs of the feasible-by-construction executor at every interval boundary
(:mod:`envs.dsmd.online_control`; ``docs/online.md``, "The learned online policy"):

1. The yardstick's tuning step (:func:`agents.online_job.tune_online`) runs first, on the
   validation traces only: every static baseline and every knob setting of the grid. Its
   best knob setting is the *teacher*: its decisions on training traces are the DDPGfD
   demonstrations (behaviour-cloning pre-training, demonstration rows in every batch), so
   the reinforcement phase starts from the best tuned heuristic.
2. RLlib trains on ``smart/DSMDOnline-v0`` over the training traces (one step per interval,
   reward ``-cost``).
3. Model selection on the tuning traces and intervals: the cloned start is validated before
   the first step, then every ``agent.eval_every`` steps; the weights with the least mean
   interval cost are kept. The teacher's cost on the same intervals is the reference line.
4. The actor is exported as an online policy bundle (:mod:`agents.bundle_export`, read by
   :mod:`serving.bundles.online`), and the
   yardstick's test step (:func:`agents.online_job.test_online`) runs it beside every
   baseline, the tuned heuristics and the oracle on the test traces.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import pandas as pd
from omegaconf import DictConfig

from envs.dsmd.errors import DSMDError
from envs.dsmd.online import OnlineSimulator
from envs.dsmd.online_control import SET_BY_ACTION, KnobMap, KnobPolicy
from envs.dsmd.online_greedy import FILE_ARGS, executor_class

from .config import to_dict
from .online_eval import DeciderSpec, knob_text, per_trace
from .online_job import Tuning, open_online_dataset, test_online, tune_online

if TYPE_CHECKING:
    from .training import Selected

__all__ = ["OnlineTask", "make_online_env", "teacher_fixed_args"]


def make_online_env(env_ctx: Any):
    """RLlib env creator (module-level, so remote env runners can unpickle it)."""
    from envs.dsmd.online_env import DSMDOnlineEnv

    kw = dict(env_ctx)
    kw.pop("num_envs", None)
    return DSMDOnlineEnv(**kw)


def teacher_fixed_args(executor: str, knobs: dict[str, Any]) -> dict[str, Any]:
    """The tuned teacher's ``knobs`` that a knob action does not set and that differ from
    the executor's defaults: the learned policy's executor keeps them fixed
    (``KnobMap.fixed``), so that its cloned start is the teacher (the tuning grid may name
    any argument of the executor). A file argument's path is made absolute
    (:data:`envs.dsmd.online_greedy.FILE_ARGS`; the bundle exporter copies the file). A
    forecast the action cannot choose (it chooses ``last`` or ``ewma`` through ``alpha``)
    is refused."""
    if knobs.get("forecast", "last") not in ("last", "ewma"):
        raise DSMDError(f"the best tuned setting uses forecast={knobs['forecast']!r}, which "
                        "the knob action cannot choose (last or ewma): drop it from "
                        "env.tune.grid to train")
    defaults = {k: p.default for k, p in
                inspect.signature(executor_class(executor)).parameters.items()}
    fixed = {k: v for k, v in knobs.items()
             if k not in SET_BY_ACTION and defaults.get(k, inspect.Parameter.empty) != v}
    return {k: str(Path(str(v)).resolve()) if k in FILE_ARGS and v else v
            for k, v in fixed.items()}


class OnlineTask:
    rllib_env = "smart-dsmd-online"
    act_dim = 3
    curve_panels: ClassVar[list[tuple[str, list[str]]] | None] = [
        ("Training episode return", ["train/episode_return_mean"]),
        ("Validation: mean interval cost", ["val/cost"]),
        ("Validation: node traffic / necessary", ["val/redundancy_ratio"]),
        ("Validation: switching per interval", ["val/subscribe_infos_k", "val/moved_types_c"]),
        ("Validation: violated intervals", ["val/any_violated"]),
        ("Validation: knobs chosen", ["val/knob_headroom", "val/knob_horizon_q",
                                     "val/knob_alpha"]),
    ]

    def __init__(self, cfg: DictConfig, out: Path) -> None:
        self.cfg, self.out = cfg, out
        e = cfg.env
        self.name = str(cfg.agent.name)
        self.ds = open_online_dataset(cfg)
        self.tuning: Tuning = tune_online(cfg, self.ds)
        c = e.control
        feats = c.get("features")
        self.cost = self.tuning.cost
        self.teacher = self.tuning.best_knobs()
        fixed = teacher_fixed_args(str(c.executor), self.teacher)
        self.knob_map = KnobMap(float(c.max_headroom), float(c.max_horizon), str(c.executor),
                                None if feats is None else tuple(feats), fixed)
        h, z = float(self.teacher.get("headroom", 0.0)), float(self.teacher.get("horizon", 0.0))
        if h > self.knob_map.max_headroom or (math.isfinite(z) and z > self.knob_map.max_horizon):
            raise DSMDError(f"the best tuned setting {self._teacher_name()} has headroom {h:g} "
                            f"and horizon {z:g}, outside the knob action's range "
                            f"(env.control.max_headroom={self.knob_map.max_headroom:g}, "
                            f"max_horizon={self.knob_map.max_horizon:g}): raise them to train")
        t = e.train
        # the training reward's cost (an ablation may weigh switching differently); every
        # evaluation uses env.cost
        train_cost = {**to_dict(e.cost), **(to_dict(t.get("reward_cost")) or {})}
        self.env_config = {"dataset": str(self.ds.root), "split": "train",
                           "cost": train_cost, "max_intervals": t.max_intervals,
                           "warmup": int(t.warmup), "executor": str(c.executor),
                           "max_headroom": float(c.max_headroom),
                           "max_horizon": float(c.max_horizon),
                           "features": None if feats is None else list(feats),
                           "executor_args": fixed,
                           "cache_dir": str(cfg.paths.data_dir)}
        from envs.dsmd.online_env import load_online_traces

        ids = self.tuning.val_ids[:int(t.val_traces)]  # the first validation traces
        self.val_traces = load_online_traces(self.ds, "validation", limit=len(ids))
        self.val_windows = e.tune.windows  # the tuning's intervals: the teacher's cost is known
        v = self.tuning.val_per_trace
        ref = v[(v.policy == self._teacher_name()) & v.trace.isin(ids)]
        self.reference = {"teacher": float(ref.cost.mean())}
        kc = self.tuning.knob_ceiling
        if kc is not None:  # what a knob policy could reach with hindsight, same intervals
            self.reference["knob oracle"] = float(kc[kc.trace.isin(ids)].cost.mean())
        self.run_name = cfg.get("run_name") or f"{self.ds.spec.name}__{self.name}__{cfg.seed}"
        self.tags = {"scenario": self.ds.scenario.name, "dataset": self.ds.spec.name,
                     "task": "train_online",
                     "features": "all" if feats is None else ",".join(feats),
                     "reward_cost": ",".join(
                         f"{k}={v:g}" if isinstance(v, int | float) else f"{k}={v}"
                         for k, v in train_cost.items() if v is not None),
                     "action": "knobs",
                     "executor_args": self._fixed_text() or "none"}

    def _fixed_text(self) -> str:
        return ", ".join(knob_text(k, v) for k, v in sorted(self.knob_map.fixed.items()))

    def _teacher_name(self) -> str:
        tuned = self.tuning.tuned
        return next(s.name for s in tuned.values() if s.kw == self.teacher)

    def env_creator(self) -> Callable[[Any], Any]:
        return make_online_env

    def header(self, agent: str, total: int) -> str:
        return (f"[train] {agent.upper()} on {self.ds.spec.name}: "
                f"{len(self.ds.traces('train'))} training traces, one step per interval, "
                f"action = the knobs of {self.knob_map.executor}"
                + (f" (fixed: {self._fixed_text()})" if self.knob_map.fixed else "")
                + f", {total:,} env steps; "
                f"teacher {self._teacher_name()} (validation cost "
                f"{self.reference['teacher']:.4f}"
                + (f"; knob oracle {self.reference['knob oracle']:.4f}"
                   if "knob oracle" in self.reference else "") + ")")

    def policy(self, scores: Any) -> KnobPolicy:
        from .algorithms import torch_scorer

        return KnobPolicy(torch_scorer(scores), self.knob_map, self.cost, name=self.name)

    def demonstrations(self, teacher: str) -> dict[str, np.ndarray]:
        """The teacher's transitions on the first ``env.train.demo_traces`` training traces
        (``teacher``: ``tuned``, the best tuned knob setting on validation)."""
        if teacher != "tuned":
            raise DSMDError(f"agent.demonstrations for env=online must be 'tuned' (the best "
                            f"knob setting on validation), got {teacher!r}")
        env = make_online_env(self.env_config)
        a01 = self.knob_map.action(**{k: self.teacher[k] for k in ("headroom", "horizon")},
                                   alpha=1.0 if self.teacher.get("forecast", "last") == "last"
                                   else float(self.teacher.get("alpha", 0.5)))
        cols: dict[str, list] = {k: [] for k in ("obs", "actions", "rewards", "next_obs",
                                                 "terminateds")}
        for i in range(min(int(self.cfg.env.train.demo_traces), len(env.traces))):
            obs, _ = env.reset(options={"trace": i})
            done = False
            while not done:
                nxt, r, term, trunc, _ = env.step(a01)
                for k, v in zip(cols, (obs, 2.0 * a01 - 1.0, r, nxt, float(term))):
                    cols[k].append(v)
                obs, done = nxt, term or trunc
        return {k: np.asarray(v, np.float32) for k, v in cols.items()}

    def _run(self, decider: Any) -> pd.DataFrame:
        rows = []
        for tr in self.val_traces:
            sim = OnlineSimulator(tr, self.cost)
            for r in sim.run(decider, self.val_windows):
                rows.append({"policy": decider.name, "trace": tr.name, **r.as_dict()})
        return pd.DataFrame(rows)

    def validate(self, policy: KnobPolicy) -> tuple[dict[str, float], float]:
        df = self._run(policy)
        v = per_trace(df).mean(numeric_only=True)
        k = pd.DataFrame(policy.knobs_used)
        horizon_q = (k.horizon.clip(upper=self.knob_map.max_horizon)
                     / self.knob_map.max_horizon)
        return ({"val/cost": float(v.cost), "val/redundancy_ratio": float(v.redundancy_ratio),
                 "val/subscribe_infos_k": float(v.subscribe_infos) / 1000.0,
                 "val/moved_types_c": float(v.moved_types) / 100.0,
                 "val/any_violated": float(v.any_violated),
                 "val/gap_to_teacher_pct": 100 * (float(v.cost) / self.reference["teacher"] - 1),
                 "val/knob_headroom": float(k.headroom.mean()),
                 "val/knob_horizon_q": float(horizon_q.mean()),
                 "val/knob_alpha": float(k.alpha.mean())},
                float(v.cost))

    def progress(self, last: dict[str, float]) -> str:
        return (f"validation cost {last.get('val/cost', float('nan')):.4f} "
                f"({last.get('val/gap_to_teacher_pct', float('nan')):+.2f}% vs the teacher), "
                f"knobs: headroom {last.get('val/knob_headroom', float('nan')):.2f}, "
                f"horizon {last.get('val/knob_horizon_q', float('nan')):.2f}, "
                f"alpha {last.get('val/knob_alpha', float('nan')):.2f}")

    def selected(self, key: Any) -> tuple[dict[str, float], str]:
        return {"val/best_cost": float(key)}, f"validation cost {key:.4f}"

    def curve_references(self) -> dict[str, dict[str, float]]:
        return {"val/cost": dict(self.reference)}

    def finish(self, log: Any, scores: Any, policy: Any, *, steps: int,
               best: Selected | None, updates: int | None,
               start: dict[str, Any] | None = None) -> dict[str, Any]:
        import ray

        from serving.bundles.online import online_bundle_files
        from serving.bundles.static import SIGNATURE_FILE

        from .bundle_export import export_online_bundle
        from .model_registration import register_bundle

        cfg = self.cfg
        if ray.is_initialized() and not (cfg.get("ray") or {}).get("address"):
            ray.shutdown()  # the evaluation forks worker processes
        bundle_dir = Path(str(cfg.paths.checkpoint_dir)) / self.run_name
        export_online_bundle(
            scores, self.knob_map, self.cost, bundle_dir, overwrite=True,
            signing_key=cfg.get("signing_key"),
            dataset={"name": self.ds.spec.name, "scenario": self.ds.scenario.name},
            extra={"run_id": log.run_id, "algorithm": self.name, "env_steps": steps,
                   "selected_at_steps": None if best is None else best.steps,
                   "gradient_updates": updates, "seed": int(cfg.seed),
                   "teacher": {k: str(v) for k, v in self.teacher.items()}})
        meta = json.loads((bundle_dir / "metadata.json").read_text())
        for f in (*online_bundle_files(meta), SIGNATURE_FILE):
            if (bundle_dir / f).is_file():
                log.artifact(bundle_dir / f, "policy_bundle")
        print(f"[train] exported the online policy bundle to {bundle_dir}", flush=True)
        val = self._run(policy)  # the selected weights' validation point, for the Pareto plot
        vpt = per_trace(val).mean(numeric_only=True).to_frame().T.assign(policy=self.name)
        key = cfg.get("signing_key")  # the run's own evaluation trusts the key it signed with
        spec = DeciderSpec.make(self.name, "learned", bundle=str(bundle_dir),
                                **({"signing_key": str(key)} if key else {}))
        res = test_online(cfg, self.tuning, log, self.out, [spec], vpt)
        registered = register_bundle(cfg, log, bundle_dir)  # last: with the test metrics
        return {**res, "bundle_dir": bundle_dir, "registered": registered}

