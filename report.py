"""The reproduction report and the benchmark page, from result files: `python report.py`
(Hydra; configs/report.yaml). Writes docs/report/index.md and docs/benchmarks.md.

Needs neither torch nor Ray nor the simulator: it only reads result files."""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from reporting.reproduction import main as build

ROOT = Path(__file__).resolve().parent
if not OmegaConf.has_resolver("project_root"):  # agents.config's resolver, without its imports
    OmegaConf.register_new_resolver("project_root", lambda: str(ROOT))


@hydra.main(config_path="configs", config_name="report", version_base="1.3")
def main(cfg: DictConfig) -> None:
    conf = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(conf, dict)
    rc = build({str(k): v for k, v in conf.items()}, ROOT)
    if rc:
        sys.exit(rc)


if __name__ == "__main__":
    main()
