"""The main job and the Figs. 5-8 sweep, in-process with Hydra's compose API and a real
local MLflow store."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from mlflow import MlflowClient

from agents.config import CONFIG_DIR
from agents.main_job import run_main
from agents.sweep import run_sweep
from envs.dsmd.cost import CostState


def _cfg(name: str, tmp_path: Path, overrides: list[str]):
    tracking = [] if "logger=none" in overrides else [
        f"logger.tracking_uri=sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}",
        f"logger.artifact_location={tmp_path / 'mlruns' / 'artifacts'}"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        # these tests are the static problem's: env=dsmd (the main job's default is online)
        env = ["env=dsmd"] if name == "train" and not any(o.startswith("env=")
                                                            for o in overrides) else []
        return compose(config_name=name, overrides=[*env,
            f"paths.output_dir={tmp_path / 'out'}", f"paths.data_dir={tmp_path / 'data'}",
            "progress=false", *tracking, *overrides])


def test_main_job_tiny_end_to_end(tmp_path, capsys):
    cfg = _cfg("train", tmp_path, ["scenario=tiny", "run_name=test-main"])
    res = run_main(cfg)
    summary = res["summary"]
    assert list(summary["policy"]) == ["rpc", "vita", "idcs", "alcor", "greedy", "exact"]
    assert (tmp_path / "out" / "summary.csv").is_file()
    assert (tmp_path / "out" / "comparison.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "Baselines on tiny" in out and "greedy" in out
    # the exact optimum solved the tiny windows and is never worse than a feasible heuristic
    pw = res["per_window"]
    ex = pw[pw.policy == "exact"].set_index("instance")
    assert (ex["status"] == "optimal").any()
    for _, row in pw[(pw.policy != "exact") & (pw.feasible == True)].iterrows():  # noqa: E712
        if row["instance"] in ex.index and ex.loc[row["instance"], "status"] == "optimal":
            assert (ex.loc[row["instance"], "total_node_traffic_bps"]
                    <= row["total_node_traffic_bps"])
    # the MLflow run holds the config, command line, tables and plot
    client = MlflowClient(tracking_uri=str(cfg.logger.tracking_uri))
    run = client.get_run(res["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["scenario"] == "tiny"
    arts = {a.path for a in client.list_artifacts(res["run_id"])}
    assert {"config", "tables", "plots"} <= arts
    cfg_files = {a.path for a in client.list_artifacts(res["run_id"], "config")}
    assert {"config/resolved.yaml", "config/command.txt", "config/hyperparameters.md"} <= cfg_files
    assert "greedy/total_node_mbps" in run.data.metrics
    mlflow.set_tracking_uri("")


def test_main_job_same_seed_same_table(tmp_path):
    a = run_main(_cfg("train", tmp_path / "a", ["scenario=tiny", "logger=none",
                                                "baseline.policies=[rpc,vita,idcs,greedy]"]))
    b = run_main(_cfg("train", tmp_path / "b", ["scenario=tiny", "logger=none",
                                                "baseline.policies=[rpc,vita,idcs,greedy]"]))
    cols = ["policy", "total_node_mbps", "ctrl_traffic_mbps", "ctrl_sends", "feasible_frac"]
    pd.testing.assert_frame_equal(a["summary"][cols], b["summary"][cols])


def test_failed_run_is_marked_failed(tmp_path):
    cfg = _cfg("train", tmp_path, ["scenario=tiny", "eval_split=holdout"])
    with pytest.raises(Exception, match="unknown split"):
        run_main(cfg)
    client = MlflowClient(tracking_uri=str(cfg.logger.tracking_uri))
    exp = client.get_experiment_by_name("smart-dsmd")
    runs = client.search_runs([exp.experiment_id]) if exp else []
    assert all(r.info.status != "RUNNING" for r in runs)
    mlflow.set_tracking_uri("")


def test_sweep_writes_figures(tmp_path):
    cfg = _cfg("sweep", tmp_path, ["scenario=tiny", "sweep.multicast_shares=[0.0,0.5,1.0]",
                                   "sweep.max_windows=3", "logger=none"])
    res = run_sweep(cfg)
    s = res["summary"]
    assert set(s["multicast_share"]) == {0.0, 0.5, 1.0}
    for f in ("fig5_controller_traffic.png", "fig6_sent_messages.png",
              "fig7_total_node_traffic.png", "fig8_max_node_traffic.png"):
        assert (tmp_path / "out" / "plots" / f).stat().st_size > 1000
    pw = pd.read_csv(tmp_path / "out" / "sweep_per_window.csv")
    assert len(pw) == 3 * 3 * len(cfg.sweep.policies)
    # RPC-only never has redundancy; at 0% multicast RPC and IDCS coincide
    assert (s[s.policy == "rpc"]["redundancy_mbps"] == 0).all()
    z = s[s.multicast_share == 0.0].set_index("policy")
    assert z.loc["idcs", "total_node_mbps"] == pytest.approx(z.loc["rpc", "total_node_mbps"])


def test_bad_scenario_override_is_clear(tmp_path):
    cfg = _cfg("train", tmp_path, ["scenario=tiny", "+scenario.colour=red", "logger=none"])
    with pytest.raises(Exception, match="unknown keys"):
        run_main(cfg)


@pytest.mark.slow  # a DDPG training run; test_online_job.py's training run stays fast
def test_train_ddpg_tiny_budget_end_to_end(tmp_path):
    """`train.py agent=ddpg` in-process: trains, validates, compares with every baseline and
    records the learning curve in MLflow."""
    import ray

    from agents.training import run_training

    cfg = _cfg("train", tmp_path, [
        f"paths.checkpoint_dir={tmp_path / 'ckpt'}", "scenario=tiny", "agent=ddpg",
        "env.observation=channel", "agent.total_steps=400",
        "agent.eval_every=200", "agent.training.random_warmup_steps=100",
        "agent.training.num_steps_sampled_before_learning_starts=100",
        "agent.training.train_batch_size_per_learner=32",
        "agent.training.per_channel_hiddens=[16,16]",
        "agent.training.bc_pretrain_steps=50", "agent.training.critic_warmup_updates=0",
        "baseline.policies=[rpc,idcs,greedy]", "ray.num_cpus=1"])
    try:
        res = run_training(cfg)
    finally:
        ray.shutdown()
    assert list(res["summary"]["policy"]) == ["rpc", "idcs", "greedy", "ddpg"]
    assert res["algo_steps"] >= 400 and len(res["history"]) >= 2
    assert (tmp_path / "out" / "learning_curve.csv").is_file()
    client = MlflowClient(tracking_uri=str(cfg.logger.tracking_uri))
    run = client.get_run(res["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["agent"] == "ddpg"
    hist = client.get_metric_history(res["run_id"], "val/total_node_mbps")
    assert len(hist) >= 2 and "train/critic_loss" in run.data.metrics
    # the exported bundle loads with ONNX Runtime and decides like the trained policy
    from agents.learned import ActorPolicy
    from serving.bundles.static import load_bundle

    b = load_bundle(res["bundle_dir"], expect_layout=res["layout"],
                    expect_signature=res["problems"].signature())
    pw = res["per_window"]
    for inst in res["problems"].instances("test"):
        m = CostState(inst, ActorPolicy.from_bundle(b).assign(inst)).metrics()
        row = pw[(pw.policy == "ddpg") & (pw.instance == inst.name)].iloc[0]
        assert m.total_node_traffic_bps == row["total_node_traffic_bps"]
    assert {a.path for a in client.list_artifacts(res["run_id"], "policy_bundle")} == {
        "policy_bundle/actor.onnx", "policy_bundle/actor_row.onnx", "policy_bundle/SIGNATURE.json",
        "policy_bundle/metadata.json"}
    assert (tmp_path / "out" / "rllib_checkpoint").is_dir()
    mlflow.set_tracking_uri("")


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["sac", "ppo", "dqn"])
def test_train_builtin_algorithms_tiny_budget(tmp_path, algo):
    """RLlib's SAC, PPO and DQN (Discrete variant) through the same entry point: trained,
    evaluated against the baselines, exported, and the bundle decides like the policy."""
    import ray

    from agents.learned import ActorPolicy
    from agents.training import run_training
    from serving.bundles.static import load_bundle

    budget = {"sac": ["agent.training.num_steps_sampled_before_learning_starts=100",
                      "agent.training.train_batch_size_per_learner=32"],
              "ppo": ["agent.training.train_batch_size_per_learner=200",
                      "agent.training.minibatch_size=50", "agent.training.num_epochs=2"],
              "dqn": ["agent.training.num_steps_sampled_before_learning_starts=100",
                      "agent.training.train_batch_size_per_learner=32"]}[algo]
    cfg = _cfg("train", tmp_path, [
        f"paths.checkpoint_dir={tmp_path / 'ckpt'}", "scenario=tiny", f"agent={algo}",
        "agent.total_steps=400", "agent.eval_every=200", "agent.training.fcnet_hiddens=[32,32]",
        "baseline.policies=[rpc,greedy]", "ray.num_cpus=1", *budget])
    try:
        res = run_training(cfg)
    finally:
        ray.shutdown()
    assert list(res["summary"]["policy"]) == ["rpc", "greedy", algo]
    b = load_bundle(res["bundle_dir"], expect_layout=res["layout"])
    assert b.decoding == ("argmax" if algo == "dqn" else "feasible")
    pw = res["per_window"]
    for inst in res["problems"].instances("test"):
        m = CostState(inst, ActorPolicy.from_bundle(b).assign(inst)).metrics()
        row = pw[(pw.policy == algo) & (pw.instance == inst.name)].iloc[0]
        assert m.total_node_traffic_bps == row["total_node_traffic_bps"]
    run = MlflowClient(tracking_uri=str(cfg.logger.tracking_uri)).get_run(res["run_id"])
    assert run.data.tags["agent"] == algo and "val/total_node_mbps" in run.data.metrics
    mlflow.set_tracking_uri("")


@pytest.mark.slow  # a Hydra multirun of several jobs
def test_multirun_sweep_is_one_query(tmp_path):
    """`train.py -m ...` runs one job per combination; every run carries the sweep's tag and
    its own overrides, so the whole ablation is one MLflow query."""
    import subprocess
    import sys

    from agents.config import PROJECT_ROOT

    uri = f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"
    cmd = [sys.executable, "train.py", "-m", "env=dsmd", "scenario=tiny", "agent=baselines",
           "baseline.policies=[rpc,greedy]", "seed=0,1", "progress=false",
           f"logger.tracking_uri={uri}", f"logger.artifact_location={tmp_path / 'art'}",
           f"paths.data_dir={tmp_path / 'data'}",
           f"hydra.sweep.dir={tmp_path / 'sweep'}", "+tags.study=seeds"]
    r = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600,
                       check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("smart-dsmd")
    runs = client.search_runs([exp.experiment_id], f"tags.sweep = '{tmp_path / 'sweep'}'")
    assert sorted(r.data.tags["seed"] for r in runs) == ["0", "1"]
    assert all(r.data.tags["study"] == "seeds" and r.info.status == "FINISHED" for r in runs)
    assert {r.data.tags["sweep_job"] for r in runs} == {"0", "1"}
    assert any("seed=1" in r.data.tags["overrides"] for r in runs)
