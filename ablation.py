"""Ablation table from MLflow: `python ablation.py study=NAME`
(Hydra; configs/ablation_table.yaml)."""

import hydra
from omegaconf import DictConfig

import agents.config  # noqa: F401  (registers the ${project_root:} resolver)
from agents.ablation import run_ablation_table
from envs.quiet import quiet

quiet()  # known third-party log noise off, before Ray and torch load (envs/quiet.py)


@hydra.main(config_path="configs", config_name="ablation_table", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_ablation_table(cfg)


if __name__ == "__main__":
    main()
