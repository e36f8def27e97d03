"""Ornstein-Uhlenbeck exploration noise (Lillicrap et al., arXiv:1509.02971, Section 7:
theta = 0.15, sigma = 0.2) as a module-to-env connector.

Temporally correlated noise needs state per episode, which an RLModule does not see; the
connector does (``episodes``): each ongoing episode has its own process
``x <- x + theta (mu - x) dt + sigma sqrt(dt) N(0, I)``, started at ``mu`` when the
episode starts and dropped when it ends. The noise is added to the actor's action in
[-1, 1] (then clipped) only when exploring; evaluation (``explore=False``) is noise-free.
Selected with ``DDPGConfig.training(noise_type="ou")``, which switches the module's
Gaussian noise off.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from ray.rllib.connectors.connector_v2 import ConnectorV2
from ray.rllib.core.columns import Columns

__all__ = ["OrnsteinUhlenbeckNoise"]


class OrnsteinUhlenbeckNoise(ConnectorV2):
    def __init__(self, input_observation_space=None, input_action_space=None, *,
                 theta: float = 0.15, sigma: float = 0.2, mu: float = 0.0, dt: float = 1.0,
                 seed: int | None = None, **kwargs: Any) -> None:
        super().__init__(input_observation_space, input_action_space, **kwargs)
        if theta < 0 or sigma < 0 or dt <= 0:
            raise ValueError(f"OU noise needs theta >= 0, sigma >= 0, dt > 0 (got theta={theta}, "
                             f"sigma={sigma}, dt={dt})")
        self.theta, self.sigma, self.mu, self.dt = float(theta), float(sigma), float(mu), float(dt)
        self.rng = np.random.default_rng(seed)
        self.state: dict[str, np.ndarray] = {}

    def step(self, x: np.ndarray) -> np.ndarray:
        """One Euler-Maruyama step of the process."""
        return (x + self.theta * (self.mu - x) * self.dt
                + self.sigma * math.sqrt(self.dt) * self.rng.standard_normal(x.shape))

    def __call__(self, *, rl_module, batch, episodes, explore=None, shared_data=None,
                 metrics=None, **kwargs) -> Any:
        if not explore or Columns.ACTIONS not in batch:
            return batch
        actions = batch[Columns.ACTIONS]
        noise = np.empty(tuple(actions.shape), dtype=np.float32)
        live: dict[str, np.ndarray] = {}
        for i, ep in enumerate(episodes):
            x = self.state.get(ep.id_)
            x = self.step(np.full(noise.shape[1:], self.mu) if x is None else x)
            live[ep.id_] = noise[i] = x
        self.state = live  # finished episodes drop out
        if isinstance(actions, torch.Tensor):
            noisy = actions + torch.as_tensor(noise, device=actions.device)
            batch[Columns.ACTIONS] = noisy.clamp(-1.0, 1.0)
        else:
            batch[Columns.ACTIONS] = np.clip(actions + noise, -1.0, 1.0)
        return batch
