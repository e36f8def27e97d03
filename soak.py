"""The fault-injection soak: `python soak.py` (Hydra; configs/soak.yaml)."""

import sys

import hydra
from omegaconf import DictConfig

import agents.config  # noqa: F401  (registers the ${project_root:} resolver)
from delivery.soak import run_soak
from envs.quiet import quiet

quiet()  # known third-party log noise off (envs/quiet.py)


@hydra.main(config_path="configs", config_name="soak", version_base="1.3")
def main(cfg: DictConfig) -> None:
    result = run_soak(cfg)
    if not result["verdict"]["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
