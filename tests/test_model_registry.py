"""The model registry path against a real MLflow registry (a SQLite tracking store, no
server: the slow round trip through ``mlflow server`` is ``test_registry_serving.py``):
bundles registered with their metadata by :func:`agents.model_registration.register_bundle`,
fetched by alias and by version into the cache and checked against the registered hash,
every missing piece named; the alias followed by :class:`serving.bundles.registry.RegistryWatcher`
and by the app (swaps, refusals that keep the serving policy, ``PUT`` with ``models:/``)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from omegaconf import OmegaConf

from serving.bundles.registry import (
    ACTOR_TAG,
    ModelRegistry,
    RegistryError,
    RegistryRef,
    RegistryWatcher,
    is_registry_uri,
)
from serving.bundles.static import BUNDLE_FILES, BundleError, load_bundle

from .waiting import wait_until

NAME = "reg-test-policy"


def _cfg(uri: str, root: Path, alias: str | None = None, name: str = NAME):
    return OmegaConf.create({
        "tags": {}, "logger": {"enabled": True, "tracking_uri": uri, "experiment_name": "reg",
                               "artifact_location": str(root / "artifacts"),
                               "registry": {"enabled": True, "model_name": name,
                                            "alias": alias}}})


def register(uri: str, root: Path, bundle_dir: Path, alias: str | None = None,
             name: str = NAME, files=BUNDLE_FILES) -> str:
    """A run that logs ``bundle_dir`` and a metric, registered as the trainer registers."""
    from agents.model_registration import register_bundle
    from agents.tracking import tracked_run

    cfg = _cfg(uri, root, alias, name)
    with tracked_run(cfg, run_name=bundle_dir.name) as log:
        log.metrics({"test/cost": 1.25})
        for f in files:
            log.artifact(bundle_dir / f, "policy_bundle")
        out = register_bundle(cfg, log, bundle_dir)
    assert out is not None
    return out


@pytest.fixture(scope="module")
def reg(tmp_path_factory, tiny_bundles):
    """A SQLite registry holding bundle a as version 1 (alias production) and b as 2."""
    root = tmp_path_factory.mktemp("registry")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    v1 = register(uri, root, tiny_bundles["a"], alias="production")
    v2 = register(uri, root, tiny_bundles["b"])
    assert (v1, v2) == (f"models:/{NAME}/1", f"models:/{NAME}/2")
    return uri, root


def test_registry_uris_parse_and_malformed_ones_say_the_forms():
    assert RegistryRef.parse("models:/a-b.c@production") == RegistryRef("a-b.c", "production")
    assert RegistryRef.parse("models:/pol/12") == RegistryRef("pol", version="12")
    assert RegistryRef.parse("models:/pol/12").uri == "models:/pol/12"
    assert is_registry_uri("models:/x@y") and not is_registry_uri("/tmp/models")
    for bad in ("models:/", "models:/pol", "models:/pol@", "models:/pol/0", "models:/pol/x",
                "models:/pol@9lives", "models:/@prod", "/dir"):
        with pytest.raises(RegistryError, match=r"models:/<name>@<alias>|not a registry URI"):
            RegistryRef.parse(bad)
    from serving.app import ServerSettings

    with pytest.raises(ValueError, match="online_bundle: 'models:/pol'"):
        ServerSettings(auth=False, online_bundle="models:/pol")


def test_a_registered_version_carries_the_bundles_metadata(reg, tiny_bundles):
    from mlflow import MlflowClient

    uri, _ = reg
    mv = MlflowClient(tracking_uri=uri, registry_uri=uri).get_model_version_by_alias(
        NAME, "production")
    meta = json.loads((tiny_bundles["a"] / "metadata.json").read_text())
    sig = json.loads((tiny_bundles["a"] / "SIGNATURE.json").read_text())
    t = mv.tags
    assert str(mv.version) == "1" and mv.source.endswith("/policy_bundle")
    assert t[ACTOR_TAG] == meta["actor_sha256"] and t["bundle.key_id"] == sig["key_id"]
    assert json.loads(t["scenario_signature"]) == meta["scenario_signature"]
    assert json.loads(t["observation_layout"]) == meta["observation_layout"]
    assert t["train.algorithm"] == "test-seed0" and float(t["metric.test/cost"]) == 1.25
    assert "signed by key " + sig["key_id"] in mv.description


def test_fetch_by_alias_and_version_into_the_cache(reg, tmp_path, tiny_bundles):
    uri, _ = reg
    r = ModelRegistry(uri, tmp_path / "cache")
    path, rv = r.fetch(f"models:/{NAME}@production")
    assert rv.version == "1" and rv.origin == f"models:/{NAME}/1 (alias production)"
    assert path.parent == tmp_path / "cache" / NAME
    assert load_bundle(path).content_hash == load_bundle(tiny_bundles["a"]).content_hash
    stamp = (path / "actor.onnx").stat().st_mtime_ns
    again, _ = r.fetch(f"models:/{NAME}@production")  # cached: not downloaded again
    assert again == path and (path / "actor.onnx").stat().st_mtime_ns == stamp
    p2, rv2 = r.fetch(f"models:/{NAME}/2")
    assert rv2.origin == f"models:/{NAME}/2" and p2 != path
    # a damaged cache is downloaded again (the registered actor hash does not match it)
    meta = json.loads((path / "metadata.json").read_text())
    (path / "metadata.json").write_text(json.dumps({**meta, "actor_sha256": "0" * 64}))
    fixed, _ = r.fetch(f"models:/{NAME}/1")
    assert json.loads((fixed / "metadata.json").read_text()) == meta


def test_whatever_is_missing_is_named(reg, tmp_path, tiny_bundles):
    from mlflow import MlflowClient

    uri, root = reg
    r = ModelRegistry(uri, tmp_path / "cache")
    for source, what in ((f"models:/{NAME}@staging", f"model '{NAME}' has no alias 'staging'"),
                         (f"models:/{NAME}/99", f"model '{NAME}' has no version 99"),
                         ("models:/no-such-model@production",
                          "no registered model named 'no-such-model'")):
        with pytest.raises(RegistryError, match=what) as e:
            r.fetch(source)
        assert source in str(e.value) and uri in str(e.value)
    dead = ModelRegistry("http://127.0.0.1:9", tmp_path / "cache2")
    with pytest.raises(RegistryError, match="did not answer"):
        dead.fetch(f"models:/{NAME}@production")
    # a version whose registered actor hash is not its files': refused after the download
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    v = register(uri, root, tiny_bundles["b"], name=NAME + "-changed").rsplit("/", 1)[1]
    client.set_model_version_tag(NAME + "-changed", v, ACTOR_TAG, "f" * 64)
    with pytest.raises(RegistryError, match="is not the one registered"):
        r.fetch(f"models:/{NAME}-changed/{v}")
    # a version whose source holds no bundle
    v = register(uri, root, tiny_bundles["b"], name=NAME + "-empty",
                 files=("actor.onnx",)).rsplit("/", 1)[1]
    with pytest.raises(RegistryError, match="holds no policy bundle"):
        r.fetch(f"models:/{NAME}-empty/{v}")


def test_the_watcher_follows_the_alias_and_keeps_the_policy_on_refusal(reg, tmp_path,
                                                                         caplog):
    from mlflow import MlflowClient

    uri, _ = reg
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    r = ModelRegistry(uri, tmp_path / "cache")
    installed: list[str] = []
    refuse = {"2"}

    def install(path: Path, rv) -> None:
        if rv.version in refuse:
            raise BundleError(f"{path}: not this one")
        installed.append(rv.version)

    alias = "watch-test"
    client.set_registered_model_alias(NAME, alias, "1")
    w = RegistryWatcher(r, RegistryRef(NAME, alias), install, period_s=60)
    assert w.poll().version == "1" and installed == ["1"]
    assert w.poll().version == "1" and installed == ["1"]  # unchanged: nothing installed
    client.set_registered_model_alias(NAME, alias, "2")
    with caplog.at_level(logging.ERROR, logger="serving.bundles.registry"):
        assert w.poll().version == "1"  # refused: version 1 stays
        assert w.poll().version == "1"  # and not tried again while the alias stays
    assert installed == ["1"] and len(w.errors) == 1 and "refused" in w.errors[0]
    assert sum("not this one" in rec.getMessage() for rec in caplog.records) == 1
    refuse.clear()
    client.delete_registered_model_alias(NAME, alias)
    assert w.poll().version == "1" and "has no alias" in w.errors[-1]
    client.set_registered_model_alias(NAME, alias, "2")  # back: tried again, installed
    assert w.poll().version == "2" and installed == ["1", "2"]


def test_the_server_serves_and_follows_a_registry_alias(reg, tmp_path, tiny_bundles):
    from mlflow import MlflowClient

    from serving.app import ServerSettings, create_app
    from serving.bundles.signing import generate_key_pair, sign_bundle

    uri, root = reg
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    alias = "serve-test"
    client.set_registered_model_alias(NAME, alias, "1")
    # a copy of bundle b signed by a key the server does not trust, registered as a version
    rogue = tmp_path / "rogue"
    shutil.copytree(tiny_bundles["b"], rogue)
    key, _, _ = generate_key_pair(tmp_path / "rogue.key")
    sign_bundle(rogue, key)
    v_rogue = register(uri, root, rogue).rsplit("/", 1)[1]
    hashes = {v: load_bundle(tiny_bundles[k]).content_hash for v, k in (("1", "a"), ("2", "b"))}
    app = create_app(ServerSettings(auth=False, bundle=f"models:/{NAME}@{alias}", watch=True,
                                    watch_period_s=0.1, registry_uri=uri,
                                    registry_cache_dir=str(tmp_path / "cache")))
    with TestClient(app) as c:
        p = c.get("/v1/policy").json()
        assert p["origin"] == f"models:/{NAME}/1 (alias {alias})" and p["hash"] == hashes["1"]
        client.set_registered_model_alias(NAME, alias, "2")
        wait_until(lambda: c.get("/v1/policy").json()["hash"] == hashes["2"], 30,
                   "the server swapped to version 2")
        assert c.get("/v1/policy").json()["origin"] == f"models:/{NAME}/2 (alias {alias})"
        client.set_registered_model_alias(NAME, alias, v_rogue)  # refused: 2 stays
        w = app.state.registry_watchers[0]
        wait_until(lambda: w.errors, 30, "the watcher tried the untrusted version")
        assert "refused" in w.errors[-1] and f"models:/{NAME}/{v_rogue}" in w.errors[-1]
        assert c.get("/v1/policy").json()["hash"] == hashes["2"]
        assert 'smart_policy_loads_total{outcome="refused"} 1.0' in c.get("/v1/metrics").text
        # a swap by URI: a version, then a missing model (409, naming it; 1 stays)
        # version 1 was signed before version 2: going back is a rollback, asked for
        r = c.put("/v1/policy", json={"path": f"models:/{NAME}/1", "allow_rollback": True})
        assert r.status_code == 200 and r.json()["origin"] == f"models:/{NAME}/1"
        r = c.put("/v1/policy", json={"path": "models:/no-such-model@production"})
        assert r.status_code == 409 and "no registered model named" in r.json()["detail"]
        assert c.get("/v1/policy").json()["hash"] == hashes["1"]
    # the thread stopped with the app
    wait_until(lambda: not w._thread.is_alive(), 10, "the watcher stopped")


def test_a_server_whose_alias_is_missing_starts_without_that_policy(reg, tmp_path, caplog):
    from serving.app import ServerSettings, create_app

    uri, _ = reg
    app = create_app(ServerSettings(auth=False, bundle=f"models:/{NAME}@nobody", watch=False,
                                    registry_uri=uri, registry_cache_dir=str(tmp_path)))
    with caplog.at_level(logging.ERROR), TestClient(app) as c:
        assert c.get("/v1/policy").json()["loaded"] is False
    assert any(f"model '{NAME}' has no alias 'nobody'" in r.getMessage()
               for r in caplog.records)
    # nothing left running: no watcher was started (watch=false)
    assert not any(w._thread.is_alive() for w in app.state.registry_watchers)
