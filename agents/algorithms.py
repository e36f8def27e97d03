"""The algorithms ``train.py`` trains, all through RLlib 2.60's new API stack.

``ddpg`` is this project's DDPG with prioritized replay and TD3's flags
(:mod:`agents.ddpg`, SMART Section V-D); ``sac``, ``ppo`` and ``dqn`` are RLlib's built-in
SAC, PPO and DQN, for comparison through the same entry point, data and evaluation. DQN
acts on ``smart/DSMDDiscrete-v0`` (``Discrete(K+1)``), the others on the Box action.

Every algorithm's RLModule is reduced to one torch ``nn.Module`` from observations to K+1
channel scores (:func:`score_module`), which the shared decoder turns into channels
(:mod:`envs.dsmd.decoding`) for evaluation and which the policy bundle exports to ONNX:

=====  ===========================================================================
ddpg   the actor ``pi`` (tanh output)
sac    ``tanh`` of the mean of the squashed Gaussian (its deterministic action)
ppo    the mean of the diagonal Gaussian, clipped to [-1, 1] as the env runner does
dqn    the Q-values (argmax = the greedy action)
=====  ===========================================================================
"""

from __future__ import annotations

import numpy as np
import torch
from ray.rllib.algorithms.dqn.dqn_learner import QF_PREDS
from ray.rllib.callbacks.callbacks import RLlibCallback
from ray.rllib.core.columns import Columns
from ray.rllib.core.models.base import ACTOR, ENCODER_OUT
from ray.rllib.utils.annotations import override
from torch import nn

from envs.dsmd.errors import DSMDError

__all__ = [
    "ALGORITHMS",
    "DSMDEpisodeMetrics",
    "action_mode",
    "algorithm_config",
    "score_module",
    "torch_scorer",
]

ALGORITHMS: dict[str, str] = {"ddpg": "box", "sac": "box", "ppo": "box", "dqn": "discrete"}


def action_mode(name: str) -> str:
    """The env action space an algorithm trains on (``box`` or ``discrete``)."""
    if name not in ALGORITHMS:
        raise DSMDError(f"agent.name must be one of {sorted(ALGORITHMS)} (or 'baselines'), "
                        f"got {name!r}")
    return ALGORITHMS[name]


class DSMDEpisodeMetrics(RLlibCallback):
    """Per training episode (one trace window): each Eq. 2 term, the violations and the node
    traffic of the final assignment, as env-runner metrics ``dsmd/*``; on a sub-problem
    environment, its terminal ``info["episode_metrics"]`` as ``episode/*``."""

    KEYS = ("reward/objective", "reward/controller_bw_penalty", "reward/controller_cpu_penalty",
            "reward/node_penalty", "controller_bw_violation", "controller_cpu_violation",
            "node_violation", "feasible", "total_node_traffic_bps")

    @override(RLlibCallback)
    def on_episode_end(self, *, episode, metrics_logger=None, **kw) -> None:
        if metrics_logger is None:
            return
        info = episode.get_infos(-1)
        for k, v in info.get("episode_metrics", {}).items():  # a sub-problem env's summary
            metrics_logger.log_value(("episode", k), float(v), window=50)
        for k in self.KEYS:
            if k in info:
                metrics_logger.log_value(("dsmd", k.replace("reward/", "reward_")),
                                         float(info[k]), window=50)


def algorithm_config(agent: dict, env_name: str, env_config: dict, seed: int):
    """The RLlib ``AlgorithmConfig`` for ``agent`` (the resolved ``configs/agent/*.yaml``)."""
    name = agent["name"]
    action_mode(name)
    training = dict(agent.get("training") or {})
    if name == "ddpg":
        from .ddpg.algorithm import DDPGConfig

        cfg = DDPGConfig()
        if agent.get("td3", False):
            cfg.td3()  # first, so explicit training keys below override its defaults
    else:
        from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

        if name == "sac":
            from ray.rllib.algorithms.sac import SACConfig as cls
        elif name == "ppo":
            from ray.rllib.algorithms.ppo import PPOConfig as cls
        else:
            from ray.rllib.algorithms.dqn import DQNConfig as cls
        cfg = cls()
        hidden = list(training.pop("fcnet_hiddens", [256, 256]))
        cfg.rl_module(model_config=DefaultModelConfig(fcnet_hiddens=hidden,
                                                      fcnet_activation="relu"))
    cfg.environment(env=env_name, env_config=env_config)
    cfg.env_runners(num_env_runners=int(agent.get("num_env_runners", 0)),
                    rollout_fragment_length=agent.get("rollout_fragment_length", "auto"))
    num_learners = int(agent.get("num_learners", 0))
    if num_learners not in (0, 1):
        raise DSMDError(f"agent.num_learners must be 0 (the learner in the driver) or 1 (a "
                        f"remote learner), got {num_learners}")
    cfg.learners(num_learners=num_learners,
                 num_gpus_per_learner=float(agent.get("num_gpus_per_learner", 0)))
    try:
        cfg.training(**training)
    except TypeError as e:  # an unknown key in agent.training
        raise DSMDError(f"agent.training for {name}: {e}") from None
    cfg.callbacks(DSMDEpisodeMetrics)
    # one training step per algo.train() (RLlib's default repeats it for at least 1 s): the
    # validation points and so model selection then depend on env steps, not on the
    # machine's speed
    cfg.reporting(min_time_s_per_iteration=0, min_sample_timesteps_per_iteration=0,
                  min_train_timesteps_per_iteration=0)
    cfg.debugging(seed=int(seed))
    return cfg


class _Scores(nn.Module):
    def __init__(self, module: nn.Module, name: str, num_channels: int) -> None:
        super().__init__()
        self.module, self.name, self.k1 = module, name, num_channels

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        m = self.module
        if self.name == "ddpg":
            return m.pi(obs)
        if self.name == "sac":
            out = m.pi(m.pi_encoder({Columns.OBS: obs})[ENCODER_OUT])
            return torch.tanh(out[..., :self.k1])
        if self.name == "ppo":
            out = m.pi(m.encoder({Columns.OBS: obs})[ENCODER_OUT][ACTOR])
            return out[..., :self.k1].clamp(-1.0, 1.0)
        return m.compute_q_values({Columns.OBS: obs})[QF_PREDS]  # dqn


def score_module(name: str, module: nn.Module, num_channels: int) -> nn.Module:
    """``obs [B, size] -> channel scores [B, K+1]`` for the algorithm's RLModule."""
    action_mode(name)
    return _Scores(module, name, num_channels)


def torch_scorer(scores: nn.Module):
    """A numpy callable (one observation -> scores) around :func:`score_module`'s output."""
    device = next(scores.parameters()).device

    def act(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            t = torch.as_tensor(obs[None], dtype=torch.float32, device=device)
            return scores(t)[0].cpu().numpy()

    return act
