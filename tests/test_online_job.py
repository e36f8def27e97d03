"""The online yardstick job (``train.py env=online agent=baselines``) on tiny_online, in-process
with Hydra's compose API and a real local MLflow store."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
from hydra import compose, initialize_config_dir
from mlflow import MlflowClient

from agents.config import CONFIG_DIR
from agents.online_job import run_online_main
from envs.dsmd.errors import DSMDError

GRID = ["env.tune.grid={online_greedy:{forecast:[last],headroom:[0.0,0.2],horizon:[inf,1.0]},"
        "forecast_greedy:{forecast:[ewma],alpha:[0.5],headroom:[0.1],horizon:[2.0]}}"]


def _cfg(tmp_path: Path, overrides: list[str]):
    tracking = [] if "logger=none" in overrides else [
        f"logger.tracking_uri=sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}",
        f"logger.artifact_location={tmp_path / 'mlruns' / 'artifacts'}"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=[
            f"paths.output_dir={tmp_path / 'out'}", f"paths.data_dir={tmp_path / 'data'}",
            "progress=false", "env=online", "agent=baselines", "env.dataset=tiny_online",
            "env.workers=1", "env.tune.windows=null", *tracking, *overrides])


def test_online_yardstick_end_to_end(tmp_path, capsys):
    res = run_online_main(_cfg(tmp_path, [*GRID, "run_name=test-online"]))
    s = res["summary"].set_index("policy")
    assert {"rpc", "vita", "idcs", "alcor", "greedy", "online_greedy", "forecast_greedy",
            "oracle"} <= set(s.index)
    assert s.loc["oracle", "regret_pct"] == 0.0
    # knobs were chosen on validation traces only: tuning rows name validation traces
    tuned = res["dataset"].traces("validation")
    assert set(res["per_interval"]["trace"]) == {r.id for r in res["dataset"].traces("test")}
    assert tuned and res["best"]["online_greedy"].startswith("online_greedy[")
    out = capsys.readouterr().out
    assert "Online yardstick" in out and "headroom" in out
    for f in ("summary.csv", "summary.txt", "per_interval.csv", "tuning.csv", "pareto.csv"):
        assert (tmp_path / "out" / f).is_file()
    for f in ("pareto.png", "timeline.png"):
        assert (tmp_path / "out" / f).stat().st_size > 1000
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    run = client.get_run(res["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["dataset"] == "tiny_online"
    assert "headroom_pct" in run.data.metrics and "oracle/cost" in run.data.metrics
    mlflow.set_tracking_uri("")


def test_online_yardstick_same_seed_same_table(tmp_path):
    a = run_online_main(_cfg(tmp_path / "a", [*GRID, "logger=none"]))["summary"]
    b = run_online_main(_cfg(tmp_path / "b", [*GRID, "logger=none"]))["summary"]
    assert a.equals(b)


def test_online_yardstick_refuses_a_learning_agent(tmp_path):
    with pytest.raises(DSMDError, match="agent=ddpg"):
        run_online_main(_cfg(tmp_path, ["agent=ddpg", "logger=none"]))
