"""The online yardstick job (``train.py env=online agent=baselines``) on tiny_online, in-process
with Hydra's compose API and a real local MLflow store."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
from hydra import compose, initialize_config_dir
from mlflow import MlflowClient
from omegaconf import OmegaConf

from agents.config import CONFIG_DIR
from agents.online_job import run_online_main
from envs.dsmd.errors import DSMDError
from envs.dsmd.online import OnlineCost

GRID = ["env.tune.grid={online_greedy:{forecast:[last],headroom:[0.0,0.2],horizon:[inf,1.0]},"
        "forecast_greedy:{forecast:[ewma],alpha:[0.5],headroom:[0.1],horizon:[2.0]}}"]


def _cfg(tmp_path: Path, overrides: list[str]):
    tracking = [] if "logger=none" in overrides else [
        f"logger.tracking_uri=sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}",
        f"logger.artifact_location={tmp_path / 'mlruns' / 'artifacts'}"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=[
            f"paths.output_dir={tmp_path / 'out'}", f"paths.data_dir={tmp_path / 'data'}",
            "progress=false", "env=online", "env.dataset=tiny_online",
            *([] if any(o.startswith("agent=") for o in overrides) else ["agent=baselines"]),
            "env.workers=1", "env.tune.windows=null", *tracking, *overrides])


def test_a_learned_bundle_that_is_not_one_is_named(tmp_path):
    from agents.online_job import learned_bundles

    cfg = _cfg(tmp_path, [f"+env.learned.elsewhere={tmp_path / 'nothing'}"])
    with pytest.raises(DSMDError, match=r"env\.learned\.elsewhere: .*nothing is not an online"):
        learned_bundles(cfg)


def test_online_yardstick_end_to_end(tmp_path, capsys):
    import torch

    from agents.bundle_export import export_online_bundle
    from envs.dsmd.online_control import OBS_SIZE, KnobMap

    # a policy trained elsewhere (here: a seeded untrained actor), evaluated beside them
    torch.manual_seed(0)
    export_online_bundle(torch.nn.Sequential(torch.nn.Linear(OBS_SIZE, 3), torch.nn.Tanh()),
                         KnobMap(), OnlineCost(), tmp_path / "elsewhere")
    res = run_online_main(_cfg(tmp_path, [*GRID, "run_name=test-online",
                                          "env.stress.datasets=[tiny_online]",
                                          f"+env.learned.transfer={tmp_path / 'elsewhere'}"]))
    s = res["summary"].set_index("policy")
    assert {"rpc", "vita", "idcs", "alcor", "greedy", "online_greedy", "forecast_greedy",
            "forecast_drop", "oracle", "transfer"} <= set(s.index)  # the default grid's
    # forecaster family, and the bundle
    assert s.loc["oracle", "regret_pct"] == 0.0
    # the hindsight greedy plans with a reserve too, and chooses it interval by interval
    assert {"oracle_greedy[headroom=0.2,horizon=inf]",
            "oracle_greedy[headroom per interval]"} <= set(s.index)
    per = res["per_interval"]
    assert {"delay_p50_s", "delay_p95_s", "bw_util"} <= set(per.columns)
    assert (per[per.types > 0].delay_p95_s >= per[per.types > 0].delay_p50_s).all()
    assert {"delay_p50_ms", "delay_p95_ms"} <= set(s.columns)
    # knobs were chosen on validation traces only: tuning rows name validation traces
    tuned = res["dataset"].traces("validation")
    assert set(res["per_interval"]["trace"]) == {r.id for r in res["dataset"].traces("test")}
    assert tuned and res["best"]["online_greedy"].startswith("online_greedy[")
    out = capsys.readouterr().out
    assert "Online yardstick" in out and "headroom" in out
    assert "transfer closes" in out or "transfer: no share of the headroom" in out
    # every method against the best tuned heuristic, paired by trace; the tuning's margins
    best = s.loc[res["headroom"]["best_online"]]
    assert best.vs_reference == 0.0 and "vs best" in out
    assert "beats the runner-up" in out and "distinguishable from" in out
    for f in ("summary.csv", "summary.txt", "per_interval.csv", "tuning.csv", "pareto.csv",
              "tuning_margins.csv"):
        assert (tmp_path / "out" / f).is_file()
    for f in ("pareto.png", "timeline.png"):
        assert (tmp_path / "out" / f).stat().st_size > 1000
    # the stress step: the same tuned methods on a stress dataset's test traces (here the
    # same dataset, so the same table), written beside the main one
    st = res["stress"]["tiny_online"]["summary"].set_index("policy")
    assert st.cost.to_dict() == pytest.approx(s.cost.to_dict())
    assert (tmp_path / "out" / "stress" / "tiny_online" / "summary.csv").is_file()
    assert "Stress set: dataset tiny_online" in out
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    run = client.get_run(res["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["dataset"] == "tiny_online"
    assert "headroom_pct" in run.data.metrics and "oracle/cost" in run.data.metrics
    assert "stress/tiny_online/oracle/cost" in run.data.metrics
    mlflow.set_tracking_uri("")


def test_stress_set_of_another_cloud_is_refused_before_tuning(tmp_path):
    """A stress set varies the dynamics, not the cloud: a dataset of another scenario is
    refused, naming it and the key, before any knob is evaluated."""
    with pytest.raises(DSMDError, match=r"stress\.datasets: 'godaddy_stress' has scenario "
                                        r"'godaddy'.*'tiny_online' 'tiny'"):
        run_online_main(_cfg(tmp_path, [*GRID, "logger=none",
                                        "env.stress.datasets=[godaddy_stress]"]))
    assert not (tmp_path / "out" / "tuning.csv").exists()


@pytest.mark.slow  # the yardstick twice; test_online_yardstick_end_to_end stays fast
def test_online_yardstick_same_seed_same_table(tmp_path):
    a = run_online_main(_cfg(tmp_path / "a", [*GRID, "logger=none"]))["summary"]
    b = run_online_main(_cfg(tmp_path / "b", [*GRID, "logger=none"]))["summary"]
    assert a.equals(b)


ONLINE_AGENT = ["agent.total_steps=60", "agent.eval_every=30",
                "agent.training.bc_pretrain_steps=100", "agent.training.critic_warmup_updates=20",
                "agent.training.num_steps_sampled_before_learning_starts=20",
                "agent.training.train_batch_size_per_learner=32", "ray.num_cpus=1"]


def _train(tmp_path: Path, overrides: list[str]) -> dict:
    import ray

    from agents.training import run_training

    cfg = _cfg(tmp_path, [*GRID, "agent=ddpg", f"paths.checkpoint_dir={tmp_path / 'ckpt'}",
                          *ONLINE_AGENT, *overrides])
    try:
        return {**run_training(cfg), "cfg": cfg}
    finally:
        ray.shutdown()


@pytest.mark.slow  # DDPG on tiny_online with validation and export: about a minute
def test_train_online_end_to_end(tmp_path, capsys):
    """The main job's path on tiny_online: tuning on validation, the tuned teacher's
    demonstrations (the forecaster's family, its other settings fixed), DDPG on the training
    traces with validation from the cloned start, the exported online bundle with the
    forecaster, and the yardstick on the test traces with the learned policy."""
    from envs.dsmd.online import OnlineSimulator
    from envs.dsmd.online_env import DSMDOnlineEnv, load_online_traces
    from serving.bundles.online import load_online_bundle

    # the plain families planning against 10% of every capacity: the forecaster's family
    # is the teacher, so DDPG trains on top of its fixed arguments
    res = _train(tmp_path, ["run_name=test-online-train",
                            "env.tune.grid.online_greedy.headroom=[0.9]",
                            "env.tune.grid.forecast_greedy.headroom=[0.9]"])
    s = res["summary"].set_index("policy")
    assert {"ddpg", "online_greedy", "oracle", "idcs"} <= set(s.index)
    hist = res["history"]
    assert hist[0]["steps"] == 0 and "val/cost" in hist[0]  # the cloned start
    assert len(hist) >= 3 and res["algo_steps"] >= 60
    out = capsys.readouterr().out
    assert "Online yardstick" in out
    assert "ddpg closes" in out or "ddpg: no share of the headroom" in out
    for f in ("learning_curve.png", "learning_curve.csv", "pareto.png", "timeline.png"):
        assert (tmp_path / "out" / f).stat().st_size > 0, f
    client = MlflowClient(tracking_uri=str(res["cfg"].logger.tracking_uri))
    run = client.get_run(res["run_id"])
    m = run.data.metrics
    assert run.data.tags["task"] == "train_online" and run.data.tags["agent"] == "ddpg"
    for k in ("ddpg/cost", "ddpg/regret_pct", "ddpg/closed_pct", "val/start/cost",
              "val/best_cost", "val/final/cost", "online_greedy/cost", "oracle/cost"):
        assert k in m, k
    # the bundle decides as the environment, interval by interval, on every test trace,
    # with the teacher's fixed executor arguments (and its forecaster file) where it has any
    b = load_online_bundle(res["bundle_dir"])
    assert "drop=" in run.data.tags["executor_args"]
    assert "send_forecaster.npz" in b.files and b.knob_map.fixed["reserve_placements"]
    traces = load_online_traces(res["dataset"], "test", tmp_path / "data")
    pi = res["per_interval"]
    for i, tr in enumerate(traces):
        rows = pi[(pi.policy == "ddpg") & (pi.trace == tr.name)]
        sim = [r.as_dict() for r in OnlineSimulator(tr, b.cost).run(b.decider("ddpg"))]
        env = DSMDOnlineEnv(traces=traces, cost=b.cost, features=b.knob_map.features,
                            max_headroom=b.knob_map.max_headroom,
                            max_horizon=b.knob_map.max_horizon,
                            executor_args=b.knob_map.fixed)
        obs, _ = env.reset(options={"trace": i})
        costs, done = [], False
        while not done:
            obs, r, term, trunc, _ = env.step((b.act(obs) + 1.0) / 2.0)
            costs.append(-r)
            done = term or trunc
        assert costs == [x["cost"] for x in sim] == rows["cost"].tolist()
    mlflow.set_tracking_uri("")


@pytest.mark.slow
def test_ablation_table_from_mlflow(tmp_path, capsys):
    """Two variants x two seeds tagged as one study; the table job finds them by tags."""
    from agents.ablation import run_ablation_table

    runs = []
    for variant in ("base", "no_per"):
        for seed in (0, 1):
            runs.append(_train(tmp_path, [f"+ablation={variant}", f"seed={seed}",
                                          "+tags.study=t", "progress=false"]))
    uri = str(runs[0]["cfg"].logger.tracking_uri)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="ablation_table", overrides=[
            "study=t", f"logger.tracking_uri={uri}",
            f"logger.artifact_location={tmp_path / 'mlruns' / 'artifacts'}",
            f"paths.output_dir={tmp_path / 'table'}"])
    res = run_ablation_table(cfg)
    t = res["table"].set_index("variant")
    assert list(t.index) == ["base", "no_per"] and (t.seeds == 2).all()
    base = res["runs"][res["runs"].variant == "base"]
    assert t.loc["base", "test_cost"] == pytest.approx(base.test_cost.mean())
    assert (tmp_path / "table" / "ablation.png").stat().st_size > 0
    assert "| base | 2 |" in capsys.readouterr().out
    with pytest.raises(DSMDError, match="no finished online training run"):
        run_ablation_table(OmegaConf.merge(cfg, {"study": "nope"}))
    mlflow.set_tracking_uri("")


def test_online_study_and_ablation_configs_compose(tmp_path):
    """The full protocol and every ablation variant compose and change what they say."""
    from pathlib import Path as P

    from agents.config import CONFIG_DIR as C

    full = _cfg(tmp_path, ["experiment=online_study", "agent=ddpg"])
    assert full.env.eval_traces is None and full.env.tune.traces is None
    assert len(full.env.tune.grid.online_greedy.headroom) == 5
    assert list(full.env.stress.datasets) == ["godaddy_stress"]
    variants = sorted(p.stem for p in (P(C) / "ablation").glob("*.yaml"))
    assert "base" in variants and len(variants) >= 7
    for v in variants:
        cfg = _cfg(tmp_path, [f"+ablation={v}", "agent=ddpg"])
        assert cfg.tags.variant == v
    assert _cfg(tmp_path, ["+ablation=no_per", "agent=ddpg"]
                ).agent.training.prioritized_replay is False
    assert _cfg(tmp_path, ["+ablation=no_demos", "agent=ddpg"]).agent.demonstrations is None


def test_paired_margins_by_hand():
    import pandas as pd

    from agents.online_eval import paired, tuning_margins

    pt = pd.DataFrame({"policy": ["f[a]"] * 3 + ["f[b]"] * 3 + ["f[c]"] * 3,
                       "trace": ["t0", "t1", "t2"] * 3,
                       "cost": [1.0, 2.0, 3.0, 1.1, 2.11, 3.12, 1.0, 2.5, 2.6]})
    m, h, n = paired(pt, "f[b]", "f[a]")  # differences 0.10, 0.11, 0.12
    assert (m, n) == (pytest.approx(0.11), 3)
    assert h == pytest.approx(4.302653 * 0.01 / 3 ** 0.5, rel=1e-4)  # t(0.975, 2) sd / sqrt 3
    g = tuning_margins(pt, {"f": "f[a]"}).set_index("setting")
    assert g.loc["f[b]", "distinct"] and not g.loc["f[c]", "distinct"]  # c: 0, +0.5, -0.4
    assert list(g.index) == ["f[c]", "f[b]"]  # by margin: c (+0.033) before b (+0.11)


def test_the_share_closed_is_not_claimed_on_a_headroom_within_the_noise():
    """A learned policy's share of the headroom is printed only when the headroom's 95%
    interval excludes 0; a ratio over a gap of about 0 (-183,975% on a +0.4% ± 4.5%
    headroom) says nothing, and the line says to compare 'vs best' instead."""
    from agents.online_job import closed_text

    closed = {"ddpg": {"closed_pct": -183975.0}}
    noisy = closed_text({"headroom_pct": 0.36, "headroom_ci95": 4.51}, closed)
    assert noisy == "ddpg: no share of the headroom (the headroom's 95% interval includes 0); " \
                    "compare 'vs best'\n"
    clear = closed_text({"headroom_pct": 12.0, "headroom_ci95": 3.0},
                        {"ddpg": {"closed_pct": 40.0}})
    assert clear == "ddpg closes +40.0% of it (of the summed gaps)\n"
