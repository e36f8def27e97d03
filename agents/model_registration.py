"""A trained run's exported, signed policy bundle registered as a model version in the MLflow
model registry of the run's tracking store (``logger.registry``), where the policy server
finds it by name and alias (``serve.py bundle=models:/<name>@<alias>``,
:mod:`serving.bundles.registry`).

The version's source is the run's ``policy_bundle`` artifact folder (the files the server
downloads and verifies), and its tags carry what a reader of the registry needs to pick one
without downloading it: the bundle's format and the SHA-256 of its actor (which the server
checks the downloaded files against), the id of the key that signed it, the scenario
signature and observation layout (a static bundle) or the features, knob map, cost and
dataset (an online one), the training facts, and the run's metrics (``metric.<name>``, as
logged, at the run's end). ``logger.registry.alias`` moves that alias to the new version
(e.g. ``production``: the server following that alias swaps to it); otherwise aliases are
moved by hand (MLflow's UI, or ``MlflowClient().set_registered_model_alias``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from envs.dsmd.errors import DSMDError

__all__ = ["RegistrationError", "bundle_tags", "default_model_name", "register_bundle"]

#: the run's artifact folder holding the bundle (what the model version's source names)
ARTIFACT_FOLDER = "policy_bundle"


class RegistrationError(DSMDError):
    """The registry refused or could not be reached (what, and where the bundle still is)."""


def _json(v: Any) -> str:
    return json.dumps(v, sort_keys=True, separators=(",", ":"), default=str)


def default_model_name(meta: dict[str, Any]) -> str:
    """``smart-dsmd-online`` for an online bundle (its observation does not depend on the
    scenario's size), ``smart-dsmd-static-<scenario>`` for a static one (its layout does)."""
    if str(meta.get("format", "")).endswith("online-policy"):
        return "smart-dsmd-online"
    scen = (meta.get("scenario_signature") or {}).get("scenario") or "unknown"
    return f"smart-dsmd-static-{scen}"


def bundle_tags(bundle_dir: Path, metrics: dict[str, float] | None = None) -> dict[str, str]:
    """The model version tags of the bundle in ``bundle_dir`` (module docstring)."""
    from serving.bundles.registry import ACTOR_TAG
    from serving.bundles.static import SIGNATURE_FILE

    meta = json.loads((bundle_dir / "metadata.json").read_text())
    sig_path = bundle_dir / SIGNATURE_FILE
    key_id = (json.loads(sig_path.read_text()).get("key_id", "?") if sig_path.is_file()
              else "unsigned")
    extra = meta.get("extra") if isinstance(meta.get("extra"), dict) else meta
    tags = {"bundle.format": str(meta.get("format")), "bundle.version": str(meta.get("version")),
            ACTOR_TAG: str(meta.get("actor_sha256")), "bundle.key_id": str(key_id)}
    for k in ("scenario_signature", "observation_layout", "decoding", "decision_order",
              "features", "knob_map", "cost", "dataset"):
        if k in meta:
            v = meta[k]
            tags[k] = v if isinstance(v, str) else _json(v)
    for k in ("algorithm", "seed", "env_steps", "gradient_updates", "selected_at_steps"):
        if extra.get(k) is not None:
            tags[f"train.{k}"] = str(extra[k])
    for k, v in sorted((metrics or {}).items()):
        tags[f"metric.{k}"] = repr(float(v))
    return tags


def register_bundle(cfg: DictConfig, log: Any, bundle_dir: Path,
                    artifact_path: str = ARTIFACT_FOLDER) -> str | None:
    """Register the bundle ``log``'s run logged at ``artifact_path`` (a copy of
    ``bundle_dir``) as a new version of ``logger.registry.model_name`` (default
    :func:`default_model_name`), with :func:`bundle_tags`, and move
    ``logger.registry.alias`` to it if set. Returns ``models:/<name>/<version>`` (None when
    tracking or registration is off); :class:`RegistrationError` if the registry fails (the
    bundle and the run's artifacts are kept)."""
    lcfg = cfg.get("logger") or {}
    reg = lcfg.get("registry") or {}
    if not log.enabled or not reg.get("enabled", True):
        return None
    import logging

    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    # "Waiting up to 300 seconds for model version to finish creation": it is ready at once
    logging.getLogger("mlflow.store.model_registry.abstract_store").setLevel(logging.WARNING)
    meta = json.loads((bundle_dir / "metadata.json").read_text())
    name = str(reg.get("model_name") or default_model_name(meta))
    alias = reg.get("alias") or None
    uri = mlflow.get_tracking_uri()
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    run_id = log.run_id
    try:
        metrics = dict(client.get_run(run_id).data.metrics)
        tags = bundle_tags(bundle_dir, metrics)
        try:
            client.get_registered_model(name)
        except MlflowException:
            client.create_registered_model(
                name, description="Policy bundles of smart-dsmd (serve.py "
                f"bundle=models:/{name}@<alias>; tags: docs/registry.md)")
        what = "online policy" if "knob_map" in meta else "policy"
        mv = client.create_model_version(
            name, source=f"runs:/{run_id}/{artifact_path}", run_id=run_id, tags=tags,
            description=f"{what} bundle of run {run_id} ({tags.get('train.algorithm', '?')}, "
                        f"seed {tags.get('train.seed', '?')}), signed by key "
                        f"{tags['bundle.key_id']}")
        if alias:
            client.set_registered_model_alias(name, str(alias), mv.version)
        client.set_tag(run_id, "registered_model", f"models:/{name}/{mv.version}")
    except MlflowException as e:
        msg = str(getattr(e, "message", e)).splitlines()[0][:500]
        raise RegistrationError(
            f"registering the bundle as a version of model {name!r} in {uri} failed: {msg}. "
            f"The bundle is kept in {bundle_dir} and as artifacts {artifact_path}/ of run "
            f"{run_id}; logger.registry.enabled=false skips registration") from None
    out = f"models:/{name}/{mv.version}"
    print(f"[train] registered the policy bundle as {out}"
          + (f" (alias {alias}: models:/{name}@{alias})" if alias else ""), flush=True)
    return out
