"""The multicast reproduction (Optimal Multicast, Zhu et al., Figs. 8-11): `python trees.py`
(Hydra; configs/trees.yaml)."""

import hydra
from omegaconf import DictConfig

import agents.config  # noqa: F401  (registers the ${project_root:} resolver)
from agents.trees.experiment import run_trees
from envs.quiet import quiet

quiet()  # known third-party log noise off, before Ray and torch load (envs/quiet.py)


@hydra.main(config_path="configs", config_name="trees", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_trees(cfg)


if __name__ == "__main__":
    main()
