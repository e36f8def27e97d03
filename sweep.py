"""Multicast-share sweep (Figs. 5-8): `python sweep.py` (Hydra; configs/sweep.yaml)."""

import hydra
from omegaconf import DictConfig

import agents.config  # noqa: F401  (registers the ${project_root:} resolver)
from agents.sweep import run_sweep
from envs.quiet import quiet

quiet()  # known third-party log noise off, before Ray and torch load (envs/quiet.py)


@hydra.main(config_path="configs", config_name="sweep", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_sweep(cfg)


if __name__ == "__main__":
    main()
