"""The generic sub-problem trainer (:class:`agents.task_episodes.EpisodeTask` through
:func:`agents.training.run_training`) end to end on a toy environment defined here (this
module is also its suite): real RLlib DDPG with demonstrations, a real local MLflow store,
and the exported ONNX actor run by ONNX Runtime."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import gymnasium as gym
import mlflow
import numpy as np
import pytest
from gymnasium.envs.registration import register, registry
from hydra import compose, initialize_config_dir
from mlflow import MlflowClient
from omegaconf import OmegaConf, open_dict

from agents.config import CONFIG_DIR
from agents.episodes import SuiteError, load_suite, run_episodes, summarize_episodes
from agents.training import run_training

TOY_ID = "smart-test/Target-v0"


class TargetEnv(gym.Env):
    """Match a random target in [-0.8, 0.8]^2 for 8 steps; reward -mean squared error."""

    def __init__(self, horizon: int = 8) -> None:
        self.horizon = horizon
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)

    def _obs(self) -> np.ndarray:
        return np.array([*self.target, self.t / self.horizon], np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.err = 0, 0.0
        self.target = self.np_random.uniform(-0.8, 0.8, 2).astype(np.float32)
        return self._obs(), {}

    def step(self, action):
        mse = float(np.mean((np.asarray(action) - self.target) ** 2))
        self.err += mse
        self.t += 1
        self.target = self.np_random.uniform(-0.8, 0.8, 2).astype(np.float32)
        done = self.t >= self.horizon
        info = {"episode_metrics": {"mse": self.err / self.t}} if done else {}
        return self._obs(), -mse, done, False, info


class DriftEnv(TargetEnv):
    """:class:`TargetEnv` whose next target is half the action plus half a uniform draw, so
    the states depend on who acts."""

    def step(self, action):
        _, r, done, trunc, info = super().step(action)
        self.target = (0.5 * np.asarray(action, np.float32) + 0.5 * self.target).astype(
            np.float32)
        return self._obs(), r, done, trunc, info


DRIFT_ID = "smart-test/Drift-v0"
if TOY_ID not in registry:
    register(id=TOY_ID, entry_point=TargetEnv)
if DRIFT_ID not in registry:
    register(id=DRIFT_ID, entry_point=DriftEnv)


class _Oracle:
    name = "oracle"

    def reset(self, env, seed):
        pass

    def act(self, obs, env):
        return env.target.copy()


class _Zero(_Oracle):
    name = "zero"

    def act(self, obs, env):
        return np.zeros(2, np.float32)


def baseline_policies(names, env_kwargs, workers=1):
    known = {"oracle": _Oracle, "zero": _Zero}
    for n in names:
        if n not in known:
            raise SuiteError(f"unknown baseline {n!r}; known: {sorted(known)}")
    return [known[n]() for n in names]


AGENT = ["agent.total_steps=400", "agent.eval_every=200", "agent.demonstrations=oracle",
         "agent.training.architecture=mlp", "agent.training.fcnet_hiddens=[32,32]",
         "agent.training.random_warmup_steps=64",
         "agent.training.num_steps_sampled_before_learning_starts=64",
         "agent.training.critic_warmup_updates=50", "agent.training.bc_pretrain_steps=400"]


def _cfg(tmp_path: Path, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "env=dsmd",  # replaced below by the toy environment
            f"paths.output_dir={tmp_path / 'out'}", f"paths.data_dir={tmp_path / 'data'}",
            f"logger.tracking_uri=sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}",
            f"logger.artifact_location={tmp_path / 'mlruns' / 'artifacts'}",
            "progress=false", "ray.num_cpus=1",
            *([] if "agent=baselines" in overrides else AGENT), *overrides])
    OmegaConf.update(cfg, "env", {"id": TOY_ID, "suite": __name__, "kwargs": {"horizon": 8},
                                  "baselines": ["oracle", "zero"], "eval_episodes": 4,
                                  "val_episodes": 2, "demo_episodes": 30,
                                  "dagger_episodes": 5}, merge=False)
    return cfg


def test_suite_contract_errors(monkeypatch):
    with pytest.raises(SuiteError, match="cannot import"):
        load_suite("no.such.module")
    with pytest.raises(SuiteError, match="no baseline_policies"):
        load_suite("json")
    with pytest.raises(SuiteError, match="unknown baseline 'x'"):
        baseline_policies(["x"], {})
    old = types.ModuleType("old_suite")  # the contract before workers
    old.baseline_policies = lambda names, env_kwargs: []  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "old_suite", old)
    with pytest.raises(SuiteError, match="takes no workers argument"):
        load_suite("old_suite")


def test_dagger_labels_the_roll_in_policys_states_with_the_teachers_actions():
    """With ``roll_in`` the states are those of the roll-in policy's own episode (here the
    action moves the next target, so the teacher's own episode has other states); each row
    holds the teacher's action there and what that action earns and leads to (the oracle's
    reward 0, its next target half its action plus the same draw), not what the roll-in
    policy did."""
    from agents.episodes import play_episode
    from agents.task_episodes import episode_demonstrations

    oracle, zero = baseline_policies(["oracle", "zero"], {})
    d = episode_demonstrations(oracle, DRIFT_ID, {"horizon": 8}, [5, 6], roll_in=zero)
    env = gym.make(DRIFT_ID, horizon=8)
    own = [(o, r) for s in (5, 6) for o, _, r, *_ in play_episode(zero, env, s)]
    teacher_own = np.stack([o for s in (5, 6) for o, *_ in play_episode(oracle, env, s)])
    np.testing.assert_array_equal(d["obs"], np.stack([o for o, _ in own]))
    assert not np.allclose(d["obs"], teacher_own)  # not the teacher's own states
    assert all(r < 0 for _, r in own)  # the roll-in policy's own rewards
    np.testing.assert_array_equal(d["rewards"], 0.0)  # the teacher's, at the same states
    np.testing.assert_array_equal(d["actions"], d["obs"][:, :2])
    for e in (0, 8):  # next target = half the oracle's action (the target) + the draw the
        for i in range(e, e + 7):  # roll-in's own next target is (its action is 0)
            np.testing.assert_allclose(d["next_obs"][i, :2],
                                       0.5 * d["obs"][i, :2] + d["obs"][i + 1, :2], atol=1e-6)
    assert d["terminateds"].tolist() == ([0.0] * 7 + [1.0]) * 2


def test_dagger_rounds_are_refused_without_a_teacher_before_training(tmp_path):
    from envs.dsmd.errors import DSMDError

    for bad in (["agent.dagger_rounds=1", "agent.demonstrations=null"],
                ["agent.dagger_rounds=-1"],
                ["agent.dagger_rounds=1", "agent.training.bc_pretrain_steps=0"]):
        with pytest.raises(DSMDError, match="dagger_rounds"):
            run_training(_cfg(tmp_path, bad))
    cfg = _cfg(tmp_path, [])
    OmegaConf.update(cfg, "env.workers", 0, force_add=True)
    with pytest.raises(SuiteError, match=r"env.workers must be >= 1 or null"):
        run_training(cfg)


def test_validation_references_are_the_named_baselines(tmp_path):
    """``env.val_baselines`` names the baselines scored on the validation episodes (a slow
    planner can be left to the test episodes); one not among ``env.baselines``, or a name
    where a list belongs, is refused by name; null scores them all, an empty list none."""
    from agents.task_episodes import EpisodeTask

    cfg = _cfg(tmp_path, [])
    assert set(EpisodeTask(cfg, tmp_path / "all").base_ret) == {"oracle", "zero"}
    with open_dict(cfg):
        cfg.env.val_baselines = ["zero"]
    task = EpisodeTask(cfg, tmp_path / "some")
    assert set(task.base_ret) == {"zero"} and len(task.baselines) == 2  # all still tested
    cfg.env.val_baselines = []  # none: nothing scored on validation
    assert EpisodeTask(cfg, tmp_path / "none").base_ret == {}
    cfg.env.val_baselines = ["zero", "planner"]
    with pytest.raises(SuiteError, match=r"env.val_baselines: \['planner'\] not among"):
        EpisodeTask(cfg, tmp_path / "bad")
    cfg.env.val_baselines = "zero"
    with pytest.raises(SuiteError, match="must be a list of baseline names or null"):
        EpisodeTask(cfg, tmp_path / "str")


def test_run_episodes_table_and_determinism():
    pols = baseline_policies(["oracle", "zero"], {})
    a = run_episodes(pols, TOY_ID, {"horizon": 8}, [1, 2, 3])
    b = run_episodes(pols, TOY_ID, {"horizon": 8}, [1, 2, 3])
    assert list(a.columns[:4]) == ["policy", "seed", "return", "steps"]
    assert np.allclose(a["return"], b["return"]) and (a["steps"] == 8).all()
    s = summarize_episodes(a)
    assert list(s["policy"]) == ["oracle", "zero"] and (s["episodes"] == 3).all()
    assert s.loc[0, "return"] == pytest.approx(0.0) and s.loc[0, "mse"] == pytest.approx(0.0)
    assert s.loc[1, "return"] < -0.5


@pytest.mark.slow  # a DDPG training run (the trainer stays covered by test_online_job.py)
def test_train_on_toy_env_end_to_end(tmp_path, capsys):
    import onnxruntime as ort

    cfg = _cfg(tmp_path, ["run_name=toy", "agent.dagger_rounds=1"])
    res = run_training(cfg)
    # one DAgger round: the oracle labels 5 episodes of the clone's own states
    assert "DAgger round 1/1: 40 states of the clone labelled by oracle (280 " in (
        capsys.readouterr().out)
    s = res["summary"].set_index("policy")
    # the cloned start is evaluated beside the selected weights on the test episodes
    assert list(s.index) == ["oracle", "zero", "learned", "clone"]
    assert s.loc["clone", "return"] > 0.5 * s.loc["zero", "return"]
    # cloned from the oracle (then DDPG): far better than doing nothing
    assert s.loc["learned", "return"] > 0.5 * s.loc["zero", "return"]
    out = res["output_dir"]
    for f in ("summary.csv", "per_episode.csv", "comparison.png", "learning_curve.csv",
              "learning_curve.png", "actor.onnx"):
        assert (out / f).stat().st_size > 0, f
    sess = ort.InferenceSession(str(out / "actor.onnx"))
    act = sess.run(None, {"obs": np.array([[0.5, -0.5, 0.0]], np.float32)})[0]
    assert act.shape == (1, 2) and np.all(np.abs(act) <= 1.0)
    client = MlflowClient(tracking_uri=str(cfg.logger.tracking_uri))
    run = client.get_run(res["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["env"] == TOY_ID
    assert "test/learned/return" in run.data.metrics and "val/return" in run.data.metrics
    assert {"tables", "plots", "policy", "config"} <= {a.path for a in
                                                       client.list_artifacts(res["run_id"])}
    mlflow.set_tracking_uri("")


def test_baselines_only(tmp_path):
    from agents.task_episodes import evaluate_env_baselines

    cfg = _cfg(tmp_path, ["agent=baselines"])
    res = evaluate_env_baselines(cfg)
    s = res["summary"].set_index("policy")
    assert list(s.index) == ["oracle", "zero"] and (s["episodes"] == 4).all()
    assert s.loc["oracle", "return"] == pytest.approx(0.0)
    assert (res["output_dir"] / "comparison.png").stat().st_size > 0
    mlflow.set_tracking_uri("")
