"""MLflow tracking: every run records the resolved config, the command line, a
hyperparameter table, metrics, tables (CSV) and plots (PNG), and is closed even on failure.

The tracking URI is local by default (``sqlite:///<repo>/mlruns/mlflow.db``, artifacts in
``<repo>/mlruns/artifacts``); set ``logger.tracking_uri`` (or ``MLFLOW_TRACKING_URI``) to use
any MLflow server (``logger.artifact_location`` then does not apply: the server stores the
artifacts where it is configured to). ``logger.enabled=false`` turns tracking off (nothing
is written). A trained policy's bundle is registered in the same server's model registry
(:mod:`agents.model_registration`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import shlex
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import DictConfig, OmegaConf

__all__ = ["RunLogger", "tracked_run"]


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


class RunLogger:
    """What entry points log through; a no-op when tracking is disabled."""

    def __init__(self, run: Any | None) -> None:
        self.run = run
        self.run_id = run.info.run_id if run is not None else None

    @property
    def enabled(self) -> bool:
        return self.run is not None

    def metrics(self, values: Mapping[str, float], step: int | None = None) -> None:
        if self.run is None:
            return
        import mlflow

        clean = {k.replace("@", "_"): float(v) for k, v in values.items()
                 if v is not None and not math.isnan(float(v))}
        mlflow.log_metrics(clean, step=step)

    def table(self, df: pd.DataFrame, path: Path) -> None:
        """Write ``df`` as CSV at ``path`` and attach it to the run."""
        path.parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(path, index=False)
        self.artifact(path, "tables")

    def artifact(self, path: Path, folder: str | None = None) -> None:
        if self.run is None:
            return
        import mlflow

        mlflow.log_artifact(str(path), artifact_path=folder)

    def text(self, text: str, name: str) -> None:
        if self.run is None:
            return
        import mlflow

        mlflow.log_text(text, name)


def _hydra_tags() -> dict[str, str]:
    """The command-line overrides of this job and, in a ``-m`` sweep, the sweep directory
    and job number (so every run of one sweep is one query: ``tags.sweep = '...'``)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
    except (ImportError, ValueError):  # not started by @hydra.main (e.g. compose API)
        return {}
    out = {"overrides": ",".join(hc.overrides.task)}
    if str(hc.mode) == "RunMode.MULTIRUN":
        out.update(sweep=str(hc.sweep.dir), sweep_job=str(hc.job.num))
    return out


def _is_server(uri: str) -> bool:
    """Whether ``uri`` names a tracking server (not a local database or directory)."""
    return uri.split(":", 1)[0] in ("http", "https", "databricks")


@contextlib.contextmanager
def tracked_run(cfg: DictConfig, *, run_name: str, tags: Mapping[str, str] | None = None
                ) -> Iterator[RunLogger]:
    """Start an MLflow run for ``cfg`` (or a no-op logger when ``cfg.logger.enabled`` is false)."""
    lcfg = cfg.get("logger") or {}
    if not lcfg.get("enabled", False):
        yield RunLogger(None)
        return
    import mlflow
    from mlflow import MlflowClient

    for noisy in ("mlflow.store.db.utils", "alembic"):  # schema set-up lines on every new store
        logging.getLogger(noisy).setLevel(logging.WARNING)
    uri = str(lcfg.tracking_uri)
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(str(lcfg.experiment_name))
    if exp is None:
        # a server keeps artifacts where it is configured to (e.g. proxied through it): a
        # local directory is only the local store's
        loc = None if _is_server(uri) else lcfg.get("artifact_location")
        if loc:
            Path(str(loc)).mkdir(parents=True, exist_ok=True)
            loc = Path(str(loc)).resolve().as_uri()
        exp_id = client.create_experiment(str(lcfg.experiment_name), artifact_location=loc)
    else:
        exp_id = exp.experiment_id
    all_tags = {"command": shlex.join(sys.argv), **_hydra_tags(),
                **{k: str(v) for k, v in (cfg.get("tags") or {}).items()},
                **{k: str(v) for k, v in (tags or {}).items()}}
    run = mlflow.start_run(experiment_id=exp_id, run_name=run_name, tags=all_tags)
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
        mlflow.log_text(OmegaConf.to_yaml(cfg, resolve=True), "config/resolved.yaml")
        mlflow.log_text(shlex.join(sys.argv) + "\n", "config/command.txt")
        flat = {k: v for k, v in _flatten(resolved).items() if not k.startswith("paths.")}
        table = "| parameter | value |\n|---|---|\n" + "\n".join(
            f"| {k} | {v} |" for k, v in sorted(flat.items()))
        mlflow.log_text(table + "\n", "config/hyperparameters.md")
        for i in range(0, len(flat), 90):  # MLflow caps params per call
            chunk = dict(list(flat.items())[i:i + 90])
            mlflow.log_params({k: str(v)[:500] for k, v in chunk.items()})
        yield RunLogger(run)
    except BaseException:
        mlflow.end_run(status="FAILED")
        raise
    else:
        mlflow.end_run(status="FINISHED")
