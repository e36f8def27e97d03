"""The static DSMD problem as a training task (``train.py env=dsmd``,
:mod:`agents.training`): ``smart/DSMD-v0`` (one step per message type) on the training
windows of the scenario's trace, validated on its validation windows against greedy,
evaluated against every baseline on the test windows, exported as a policy bundle."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from omegaconf import DictConfig

from envs.dsmd.observation import ObservationLayout
from envs.dsmd.problems import build_problems
from envs.dsmd.scenarios import ScenarioSpec

from .algorithms import action_mode, torch_scorer
from .config import scenario_spec, to_dict
from .demonstrations import demonstrations
from .evaluation import evaluate_policies, summarize
from .learned import ActorPolicy
from .registry import make_policies
from .reporting import report

if TYPE_CHECKING:
    from .training import Selected

__all__ = ["DSMDTask", "make_dsmd_env"]


def make_dsmd_env(env_ctx: Any):
    """RLlib env creator (module-level, so remote env runners can unpickle it)."""
    from envs.dsmd.env import DSMDEnv

    kw = dict(env_ctx)
    kw.pop("num_envs", None)
    spec = ScenarioSpec.from_dict(kw.pop("scenario_spec"))
    return DSMDEnv(spec, **kw)


class DSMDTask:
    rllib_env = "smart-dsmd"  # agents.training.RLLIB_ENV_NAME
    # None: the static trainer's panels (agents.plots.DSMD_CURVE_PANELS)
    curve_panels: ClassVar[list[tuple[str, list[str]]] | None] = None

    def __init__(self, cfg: DictConfig, out: Path) -> None:
        self.cfg, self.out = cfg, out
        self.spec = spec = scenario_spec(cfg)
        self.name = name = str(cfg.agent.name)
        mode = action_mode(name)
        # a discrete action is applied as chosen; evaluate it the same way (argmax)
        self.decoding = str(cfg.env.decoding) if mode == "box" else "argmax"
        self.ps = ps = build_problems(spec, cache_dir=cfg.paths.data_dir,
                                      batch_key=cfg.env.batch_key)
        self.env_kwargs = {"observation": str(cfg.env.observation), "action": mode,
                           "reward": to_dict(cfg.env.reward), "order": str(cfg.env.order),
                           "decoding": str(cfg.env.decoding),
                           "initial": str(cfg.env.initial), "batch_key": str(cfg.env.batch_key),
                           "cache_dir": str(cfg.paths.data_dir), "split": "train"}
        self.env_config = {"scenario_spec": spec.to_dict(), **self.env_kwargs}
        self.layout = ObservationLayout(str(cfg.env.observation), ps.catalog_size, ps.num_nodes,
                                        spec.num_topics)
        self.act_dim = spec.num_topics + 1
        self.val = ps.instances("validation") or ps.instances("train")[-1:]
        greedy_val = evaluate_policies(make_policies(["greedy"], ps), self.val, progress=False)
        self.greedy_total = float(greedy_val["total_node_traffic_bps"].mean())
        self.run_name = cfg.get("run_name") or f"{spec.name}__{name}__{cfg.seed}"
        self.tags = {"scenario": spec.name, "task": "train",
                     "observation": str(cfg.env.observation), "decoding": self.decoding,
                     "reward_form": str(cfg.env.reward.form)}

    def env_creator(self) -> Callable[[Any], Any]:
        return make_dsmd_env

    def header(self, agent: str, total: int) -> str:
        return (f"[train] {agent.upper()} on {self.spec.name}: {len(self.ps.windows['train'])} "
                f"training windows, observation {self.layout.variant} ({self.layout.size} "
                f"values), {self.act_dim} channels, {total:,} env steps")

    def policy(self, scores: Any) -> ActorPolicy:
        return ActorPolicy(torch_scorer(scores), self.layout, name=self.name,
                           order=str(self.cfg.env.order), decoding=self.decoding,
                           seed=int(self.cfg.seed))

    def demonstrations(self, teacher: str) -> dict[str, np.ndarray]:
        return demonstrations(make_policies([teacher], self.ps)[0], self.ps, self.env_kwargs)

    def validate(self, policy: Any) -> tuple[dict[str, float], tuple[float, float]]:
        v = summarize(evaluate_policies([policy], self.val, progress=False)).iloc[0]
        # model selection on validation windows: feasibility first, then traffic
        return ({"val/total_node_mbps": v.total_node_mbps, "val/feasible_frac": v.feasible_frac,
                 "val/bw_violation": v.bw_violation, "val/cpu_violation": v.cpu_violation,
                 "val/node_violation": v.node_violation,
                 "val/gap_to_greedy_pct": 100 * (v.total_node_mbps * 1e6 / self.greedy_total - 1)},
                (-float(v.feasible_frac), float(v.total_node_mbps)))

    def progress(self, last: dict[str, float]) -> str:
        return (f"validation: {last.get('val/total_node_mbps', float('nan')):.2f} Mbps, "
                f"feasible {last.get('val/feasible_frac', float('nan')):.2f}, "
                f"vs greedy {last.get('val/gap_to_greedy_pct', float('nan')):+.1f}%")

    def selected(self, key: Any) -> tuple[dict[str, float], str]:
        return ({"val/best_total_node_mbps": key[1], "val/best_feasible_frac": -key[0]},
                f"best validation: feasible {-key[0]:.2f}, {key[1]:.2f} Mbps")

    def curve_references(self) -> dict[str, dict[str, float]]:
        return {}

    def finish(self, log: Any, scores: Any, policy: Any, *, steps: int,
               best: Selected | None, updates: int | None,
               start: dict[str, Any] | None = None) -> dict[str, Any]:
        cfg, out, spec, ps = self.cfg, self.out, self.spec, self.ps
        test = ps.instances(str(cfg.eval_split))
        pols = [*make_policies(list(cfg.baseline.policies), ps, to_dict(cfg.baseline.params)),
                policy]
        per_window = evaluate_policies(pols, test, progress=bool(cfg.progress))
        summary = report(log, per_window, out, spec, str(cfg.eval_split),
                         f"{self.name.upper()} vs baselines")
        from serving.bundles.static import BUNDLE_FILES

        from .bundle_export import export_bundle
        from .model_registration import register_bundle

        bundle_dir = Path(str(cfg.paths.checkpoint_dir)) / self.run_name
        export_bundle(scores, self.layout, ps.signature(), bundle_dir, overwrite=True,
                      signing_key=cfg.get("signing_key"),
                      order=str(cfg.env.order), decoding=self.decoding,
                      extra={"run_id": log.run_id, "algorithm": self.name, "env_steps": steps,
                             "selected_at_steps": None if best is None else best.steps,
                             "gradient_updates": updates,
                             "reward": to_dict(cfg.env.reward), "seed": int(cfg.seed)})
        for f in BUNDLE_FILES:
            log.artifact(bundle_dir / f, "policy_bundle")
        print(f"[train] exported the policy bundle to {bundle_dir}", flush=True)
        registered = register_bundle(cfg, log, bundle_dir)
        return {"summary": summary, "per_window": per_window, "bundle_dir": bundle_dir,
                "registered": registered,
                "layout": self.layout, "problems": ps}
