"""The loopback testbed (SMART Figs. 9-10): `python testbed.py` (Hydra; configs/testbed.yaml)."""

import hydra
from omegaconf import DictConfig

import agents.config  # noqa: F401  (registers the ${project_root:} resolver)
from delivery.experiment import run_testbed
from envs.quiet import quiet

quiet()  # known third-party log noise off, before Ray and torch load (envs/quiet.py)


@hydra.main(config_path="configs", config_name="testbed", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_testbed(cfg)


if __name__ == "__main__":
    main()
