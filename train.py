"""Main job: `python train.py` (Hydra; see configs/train.yaml)."""

import hydra
from omegaconf import DictConfig

import agents.config  # noqa: F401  (registers the ${project_root:} resolver)
from agents.main_job import run_main


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    if cfg.env.get("name") == "online":  # the online problem's yardstick
        from agents.online_job import run_online_main

        run_online_main(cfg)
    elif cfg.env.get("suite"):  # a sub-problem env (env=multicast|shaping): its own baselines
        from agents.env_training import run_env_training

        run_env_training(cfg)
    elif cfg.agent.name == "baselines":
        run_main(cfg)
    else:  # ddpg (default), sac, ppo, dqn
        from agents.training import run_training

        run_training(cfg)


if __name__ == "__main__":
    main()
