"""Configuration helpers shared by the Hydra entry points (``train.py``, ``sweep.py``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from envs.dsmd.scenarios import ScenarioSpec

__all__ = ["CONFIG_DIR", "PROJECT_ROOT", "default_workers", "output_dir", "scenario_spec",
           "to_dict", "workers_setting"]

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = PROJECT_ROOT / "configs"

if not OmegaConf.has_resolver("project_root"):
    OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT))


def default_workers(cap: int = 4) -> int:
    """The processes a ``workers: null`` setting means: the usable cores, at most ``cap``."""
    return max(1, min(len(os.sched_getaffinity(0)), int(cap)))


def workers_setting(value: Any, key: str, cap: int = 10,
                    error: type[Exception] = ValueError) -> int:
    """A ``workers`` setting named ``key``: a count >= 1, or null for
    :func:`default_workers` (``cap``); anything below 1 raises ``error`` naming ``key``."""
    if value is None:
        return default_workers(cap)
    if int(value) < 1:
        raise error(f"{key} must be >= 1 or null (the usable cores), got {value}")
    return int(value)


def to_dict(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def scenario_spec(cfg: DictConfig) -> ScenarioSpec:
    """The :class:`ScenarioSpec` of ``cfg.scenario`` (validated; unknown keys refused)."""
    return ScenarioSpec.from_dict(to_dict(cfg.scenario))


def output_dir(cfg: DictConfig) -> Path:
    """Hydra's run directory when running under ``@hydra.main``, else ``cfg.paths.output_dir``."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return Path(HydraConfig.get().runtime.output_dir)
    except ImportError:  # pragma: no cover
        pass
    out = Path(str(cfg.paths.output_dir))
    out.mkdir(parents=True, exist_ok=True)
    return out
