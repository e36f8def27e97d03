"""Main job: `python train.py` (Hydra; see configs/train.yaml)."""

import hydra
from omegaconf import DictConfig

import agents.config  # noqa: F401  (registers the ${project_root:} resolver)
from envs.quiet import quiet

quiet()  # known third-party log noise off, before Ray and torch load (envs/quiet.py)


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    if cfg.agent.name == "baselines":  # no learning: the task's yardstick
        if cfg.env.get("name") == "online":
            from agents.online_job import run_online_main

            run_online_main(cfg)
        elif cfg.env.get("suite"):  # a sub-problem env (env=trees|shaping)
            from agents.task_episodes import evaluate_env_baselines

            evaluate_env_baselines(cfg)
        else:
            from agents.main_job import run_main

            run_main(cfg)
    else:  # ddpg (default), sac, ppo, dqn: the one trainer (agents/training.py)
        from agents.training import run_training

        run_training(cfg)


if __name__ == "__main__":
    main()
