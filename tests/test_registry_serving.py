"""The registry round trip with real processes on free loopback ports: a real ``mlflow server``
(SQL backend store, proxied artifact root; :mod:`tests.mlflow_server`), ``train.py
logger.tracking_uri=http://...`` training the online policy and registering its signed
bundle with the alias ``production``, ``serve.py online_bundle=models:/...@production``
serving it, the alias moved to a new version and the server swapping to it, a version
signed by an untrusted key refused with the serving policy kept, a rollback by version
through ``PUT``, the registry server gone with the policy still served, and a server started
on a model that does not exist saying so."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from serving.bundles.registry import ACTOR_TAG
from serving.local import LocalServer

from .mlflow_server import mlflow_server
from .test_online_job import GRID, ONLINE_AGENT
from .waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smart-dsmd-online"
KEY, ADMIN = "reg-key-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0", "reg-admin-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0"


def _register(url: str, bundle_dir: Path, name: str = MODEL) -> str:
    """``bundle_dir`` logged by a run on the server and registered as the trainer does."""
    from agents.model_registration import register_bundle
    from agents.tracking import tracked_run
    from serving.bundles.online import online_bundle_files

    cfg = OmegaConf.create({"tags": {}, "logger": {
        "enabled": True, "tracking_uri": url, "experiment_name": "smart-dsmd",
        "artifact_location": None, "registry": {"enabled": True, "model_name": name}}})
    meta = json.loads((bundle_dir / "metadata.json").read_text())
    with tracked_run(cfg, run_name=bundle_dir.name) as log:
        for f in (*online_bundle_files(meta), "SIGNATURE.json"):
            log.artifact(bundle_dir / f, "policy_bundle")
        out = register_bundle(cfg, log, bundle_dir)
    assert out is not None
    return out.rsplit("/", 1)[1]


def _export(directory: Path, seed: int, signing_key: Path | None = None) -> str:
    """An online bundle from a seeded (untrained) actor; its actor's SHA-256."""
    import torch

    from agents.bundle_export import export_online_bundle
    from envs.dsmd.online import OnlineCost
    from envs.dsmd.online_control import OBS_SIZE, KnobMap

    torch.manual_seed(seed)
    actor = torch.nn.Sequential(torch.nn.Linear(OBS_SIZE, 3), torch.nn.Tanh())
    export_online_bundle(actor, KnobMap(), OnlineCost(), directory,
                         signing_key=None if signing_key is None else str(signing_key))
    return json.loads((directory / "metadata.json").read_text())["actor_sha256"]


@pytest.mark.slow  # an MLflow server, a training run and two policy servers: about 4 minutes
def test_train_register_serve_and_follow_the_alias(tmp_path):
    from mlflow import MlflowClient

    from serving.bundles.signing import generate_key_pair

    with mlflow_server(tmp_path / "mlflow") as ml:
        cmd = [sys.executable, "train.py", f"hydra.run.dir={tmp_path / 'out'}",
               f"paths.data_dir={tmp_path / 'data'}",
               f"paths.checkpoint_dir={tmp_path / 'ckpt'}", "progress=false", "env=online",
               "env.dataset=tiny_online", "agent=ddpg", "env.workers=1",
               "env.tune.windows=null", *GRID, *ONLINE_AGENT,
               "env.tune.grid.online_greedy.headroom=[0.9]",
               "env.tune.grid.forecast_greedy.headroom=[0.9]", "run_name=registry-train",
               f"logger.tracking_uri={ml.url}", "logger.registry.alias=production"]
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                           check=False, env=env)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        assert (f"registered the policy bundle as models:/{MODEL}/1 (alias production"
                in r.stdout), r.stdout[-3000:]
        client = MlflowClient(tracking_uri=ml.url, registry_uri=ml.url)
        mv = client.get_model_version_by_alias(MODEL, "production")
        trained = json.loads((tmp_path / "ckpt" / "registry-train" / "metadata.json"
                              ).read_text())
        sig = json.loads((tmp_path / "ckpt" / "registry-train" / "SIGNATURE.json").read_text())
        assert mv.version == "1" and mv.tags[ACTOR_TAG] == trained["actor_sha256"]
        assert mv.tags["bundle.key_id"] == sig["key_id"]
        assert json.loads(mv.tags["features"]) == trained["features"]
        assert "metric.ddpg/cost" in mv.tags and "metric.val/best_cost" in mv.tags
        run = client.get_run(mv.run_id)
        assert run.info.status == "FINISHED"
        assert run.data.tags["registered_model"] == f"models:/{MODEL}/1"
        # the artifacts went through the server into its artifact root, not a local store
        assert list((tmp_path / "mlflow" / "artifacts").rglob("actor.onnx"))
        assert not (tmp_path / "mlruns").exists()

        v2_hash = _export(tmp_path / "v2", seed=1)
        v2 = _register(ml.url, tmp_path / "v2")
        key, _, _ = generate_key_pair(tmp_path / "rogue.key")
        _export(tmp_path / "rogue", seed=2, signing_key=key)
        rogue = _register(ml.url, tmp_path / "rogue")

        server = LocalServer(None, tmp_path / "server", api_key=KEY, admin_key=ADMIN,
                             overrides=[f"online_bundle=models:/{MODEL}@production",
                                        f"registry.tracking_uri={ml.url}",
                                        f"registry.cache_dir={tmp_path / 'cache'}",
                                        "watch=true", "watch_period_s=0.5",
                                        "log_level=info"])
        server.start(timeout_s=180)
        try:
            def log() -> str:  # the server's log (Hydra's job log file)
                return (tmp_path / "server" / "hydra" / "serve.log").read_text()

            with server.client(KEY) as c, server.client(ADMIN) as admin:
                def online() -> dict:
                    return c.get("/v1/online/policy").json()

                p = online()
                assert p["loaded"] and p["hash"] == trained["actor_sha256"]
                assert p["origin"] == f"models:/{MODEL}/1 (alias production)"
                # the alias moves: the server swaps at its next poll
                client.set_registered_model_alias(MODEL, "production", v2)
                wait_until(lambda: online()["hash"] == v2_hash, 60, "the swap to version 2")
                assert online()["origin"] == f"models:/{MODEL}/{v2} (alias production)"
                # a version signed by a key the server does not trust: refused, v2 stays
                client.set_registered_model_alias(MODEL, "production", rogue)
                wait_until(lambda: f"models:/{MODEL}/{rogue} (alias production): refused"
                           in log(), 60, "the refusal in the log")
                assert "not trusted" in log()
                assert online()["hash"] == v2_hash
                # the alias deleted: nothing to follow, v2 stays
                client.delete_registered_model_alias(MODEL, "production")
                wait_until(lambda: "has no alias 'production'" in log(),
                           60, "the missing alias in the log")
                assert online()["hash"] == v2_hash
                # a rollback by version number through the API: version 1 was signed before
                # version 2, so it is refused (409) unless asked for; a missing one refused
                r = admin.put("/v1/online/policy", json={"path": f"models:/{MODEL}/1"})
                assert r.status_code == 409 and "rollback" in r.json()["detail"], r.text
                assert online()["hash"] == v2_hash
                r = admin.put("/v1/online/policy", json={"path": f"models:/{MODEL}/1",
                                                         "allow_rollback": True})
                assert r.status_code == 200, r.text
                assert r.json()["origin"] == f"models:/{MODEL}/1"
                r = admin.put("/v1/online/policy", json={"path": f"models:/{MODEL}/99"})
                assert r.status_code == 409 and "has no version 99" in r.json()["detail"]
                assert online()["hash"] == trained["actor_sha256"]
                # the registry server gone: the server keeps serving what it has
                os.killpg(ml.proc.pid, signal.SIGKILL)
                ml.proc.wait(timeout=30)
                wait_until(lambda: "did not answer" in log(), 60,
                           "the unreachable registry in the log")
                assert c.get("/v1/health/ready").status_code == 200
                assert online()["hash"] == trained["actor_sha256"]
        finally:
            server.stop()

    # a server started on a model the registry does not have starts, says so, serves none
    with mlflow_server(tmp_path / "mlflow2") as ml2:
        s2 = LocalServer(None, tmp_path / "server2", api_key=KEY,
                         overrides=[f"online_bundle=models:/{MODEL}@production",
                                    f"registry.tracking_uri={ml2.url}",
                                    f"registry.cache_dir={tmp_path / 'cache2'}"])
        s2.start(timeout_s=180)
        try:
            with s2.client(KEY) as c:
                assert c.get("/v1/online/policy").json()["loaded"] is False
            assert (f"no registered model named '{MODEL}'"
                    in (tmp_path / "server2" / "hydra" / "serve.log").read_text())
        finally:
            s2.stop()
