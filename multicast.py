"""The multicast reproduction (seeds/004 Figs. 8-11): `python multicast.py` (Hydra;
configs/multicast.yaml)."""

import hydra
from omegaconf import DictConfig

import agents.config  # noqa: F401  (registers the ${project_root:} resolver)
from agents.multicast.experiment import run_multicast


@hydra.main(config_path="configs", config_name="multicast", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_multicast(cfg)


if __name__ == "__main__":
    main()
