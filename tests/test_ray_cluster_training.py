"""Training on a real multi-node Ray cluster (tests/ray_cluster.py: a head and a worker node,
each a `ray start` on loopback with token authentication): `train.py ray.address=...` with
two remote env runners and a remote learner trains the online policy to a small budget, then
validates, exports and evaluates as on one machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from .ray_cluster import ray_cluster
from .test_online_job import GRID, ONLINE_AGENT

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a two-node cluster and a training run: about two minutes
def test_train_online_on_a_two_node_cluster(tmp_path):
    db = tmp_path / "mlruns" / "mlflow.db"
    agent = [o for o in ONLINE_AGENT if not o.startswith("ray.")]
    # the head has 1 CPU and the worker 2: the learner and the two env runners (1 CPU each)
    # cannot all fit on one node
    with ray_cluster([2], head_cpus=1) as cluster:
        cmd = [sys.executable, "train.py", f"hydra.run.dir={tmp_path / 'out'}",
               f"paths.data_dir={tmp_path / 'data'}",
               f"paths.checkpoint_dir={tmp_path / 'ckpt'}", "progress=false", "env=online",
               "env.dataset=tiny_online", "agent=ddpg", "env.workers=1",
               "env.tune.windows=null", *GRID, *agent,
               "env.tune.grid.online_greedy.headroom=[0.9]",
               "env.tune.grid.forecast_greedy.headroom=[0.9]",
               f"ray.address={cluster.address}", "agent.num_env_runners=2",
               "agent.num_learners=1", "run_name=cluster-train",
               f"logger.tracking_uri=sqlite:///{db}",
               f"logger.artifact_location={tmp_path / 'mlruns' / 'artifacts'}"]
        r = subprocess.run(cmd, cwd=ROOT, env=cluster.env, capture_output=True, text=True,
                           timeout=900, check=False)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    out = r.stdout
    assert "Ray: 2 node(s), 2 remote env runner(s), 1 remote learner on a CPU" in out, out
    assert "behaviour-cloning pre-training" in out  # on the remote learner
    assert "Online yardstick" in out and "ddpg" in out
    assert (tmp_path / "ckpt" / "cluster-train" / "metadata.json").is_file()
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    run = client.search_runs([client.get_experiment_by_name("smart-dsmd").experiment_id])[0]
    assert run.info.status == "FINISHED"
    m = run.data.metrics
    assert {"ddpg/cost", "val/best_cost", "train/gradient_updates"} <= set(m)
    assert m["train/gradient_updates"] > 0
    # nothing of the cluster is left running
    assert not cluster.processes()


def test_more_than_one_learner_is_refused_with_the_key():
    from agents.algorithms import algorithm_config
    from envs.dsmd.errors import DSMDError

    with pytest.raises(DSMDError, match=r"agent\.num_learners must be 0 .* or 1 .*got 2"):
        algorithm_config({"name": "ddpg", "num_learners": 2}, "Pendulum-v1", {}, seed=0)
