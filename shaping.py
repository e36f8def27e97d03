"""Sincon's Figs. 5-6 on the control-channel simulator: `python shaping.py` (Hydra;
configs/shaping.yaml; agents/shaping/experiment.py)."""

import hydra
from omegaconf import DictConfig

import agents.config  # noqa: F401  (registers the ${project_root:} resolver)
from agents.shaping.experiment import run_shaping
from envs.quiet import quiet

quiet()  # known third-party log noise off, before Ray and torch load (envs/quiet.py)


@hydra.main(config_path="configs", config_name="shaping", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_shaping(cfg)


if __name__ == "__main__":
    main()
