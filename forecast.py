"""The send forecaster: `python forecast.py` (Hydra; configs/forecast.yaml)."""

import hydra
from omegaconf import DictConfig

import agents.config  # noqa: F401  (registers the ${project_root:} resolver)
from agents.forecast_experiment import run_forecast
from envs.quiet import quiet

quiet()  # known third-party log noise off (envs/quiet.py)


@hydra.main(config_path="configs", config_name="forecast", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_forecast(cfg)


if __name__ == "__main__":
    main()
