"""Reference off-policy implementation for the throughput comparison: a single-file port of
CleanRL's TD3, ``cleanrl/td3_continuous_action.py`` (https://github.com/vwxyzjn/cleanrl,
read at commit 004f8a086a892a2a180f4dd332b90d83a968aa7a,
https://github.com/vwxyzjn/cleanrl/blob/004f8a086a892a2a180f4dd332b90d83a968aa7a/cleanrl/td3_continuous_action.py).

No RLlib. The algorithm is CleanRL's, line for line:

* ``Actor``: obs -> 256 -> 256 -> act, ReLU, tanh output rescaled to the action bounds;
  ``QNetwork``: (obs, act) -> 256 -> 256 -> 1, ReLU; twin critics and three target networks;
  one Adam over both critics, one over the actor;
* exploration: random actions while ``global_step < learning_starts``, then
  ``actor(obs) + N(0, action_scale * exploration_noise)`` clipped to the bounds;
* one gradient update per environment step once ``global_step > learning_starts``: critic
  regression to ``r + gamma (1 - done) min(Q1', Q2')(s', clip(pi'(s') + clip(0.2 eps, +-0.5)))``;
  every ``policy_frequency`` (2) steps the actor step ``-Q1(s, pi(s))`` and the Polyak
  update (tau 0.005) of all three targets;
* replay: uniform, with replacement, over the stored transitions.

Departures, none of which changes the computation per step: (1) the replay is plain numpy
arrays (:class:`ReplayBuffer`) instead of CleanRL's ``cleanrl_utils.buffers.ReplayBuffer``
(Stable-Baselines3's), with the same layout (obs, next_obs, action, reward, done =
termination) and the same sampling (``randint(0, size, batch)``), drawn from a seeded
``numpy.random.Generator``; (2) one environment instead of a ``SyncVectorEnv`` of one, so a
finished episode is reset explicitly (CleanRL's vector env auto-resets; its stored
``next_obs`` for a *terminated* step is masked by ``done`` anyway, and for a truncated one
it stores ``final_observation``, which is what is stored here); (3) CPU only,
``torch.set_num_threads(1)``; no TensorBoard / W&B logging, no ``tyro`` CLI; (4) the state
lives in :class:`TD3` so that a benchmark can run untimed and timed segments
(:meth:`TD3.run`); :func:`train` is the script's main loop as one call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn, optim

__all__ = ["TD3", "Actor", "Args", "QNetwork", "ReplayBuffer", "train"]


@dataclass
class Args:
    """CleanRL's algorithm arguments (its defaults), minus the experiment plumbing."""

    seed: int = 1
    total_timesteps: int = 1_000_000
    learning_rate: float = 3e-4
    buffer_size: int = 1_000_000
    gamma: float = 0.99
    tau: float = 0.005
    batch_size: int = 256
    policy_noise: float = 0.2
    exploration_noise: float = 0.1
    learning_starts: int = 25_000
    policy_frequency: int = 2
    noise_clip: float = 0.5
    hidden: int = 256  # CleanRL hard-codes 256 (two hidden layers)


class QNetwork(nn.Module):
    def __init__(self, obs_dim: int, act_dim: int, hidden: int = 256) -> None:
        super().__init__()
        self.fc1 = nn.Linear(obs_dim + act_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        x = torch.cat([x, a], 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class Actor(nn.Module):
    def __init__(self, obs_dim: int, space: gym.spaces.Box, hidden: int = 256) -> None:
        super().__init__()
        self.fc1 = nn.Linear(obs_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc_mu = nn.Linear(hidden, int(np.prod(space.shape)))
        self.register_buffer("action_scale", torch.tensor((space.high - space.low) / 2.0,
                                                          dtype=torch.float32))
        self.register_buffer("action_bias", torch.tensor((space.high + space.low) / 2.0,
                                                         dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = torch.tanh(self.fc_mu(x))
        return x * self.action_scale + self.action_bias


@dataclass(frozen=True)
class Batch:
    observations: torch.Tensor
    actions: torch.Tensor
    next_observations: torch.Tensor
    dones: torch.Tensor
    rewards: torch.Tensor


class ReplayBuffer:
    """Uniform ring buffer in numpy arrays (the layout of SB3's ``ReplayBuffer`` with one env)."""

    def __init__(self, size: int, obs_dim: int, act_dim: int, seed: int = 0) -> None:
        self.size = int(size)
        self.observations = np.zeros((size, obs_dim), dtype=np.float32)
        self.next_observations = np.zeros((size, obs_dim), dtype=np.float32)
        self.actions = np.zeros((size, act_dim), dtype=np.float32)
        self.rewards = np.zeros(size, dtype=np.float32)
        self.dones = np.zeros(size, dtype=np.float32)
        self.pos = 0
        self.full = False
        self.rng = np.random.default_rng(seed)

    def add(self, obs: np.ndarray, next_obs: np.ndarray, action: np.ndarray, reward: float,
            done: bool) -> None:
        self.observations[self.pos] = obs
        self.next_observations[self.pos] = next_obs
        self.actions[self.pos] = action
        self.rewards[self.pos] = reward
        self.dones[self.pos] = done
        self.pos += 1
        if self.pos == self.size:
            self.full, self.pos = True, 0

    def sample(self, batch_size: int) -> Batch:
        upper = self.size if self.full else self.pos
        idx = self.rng.integers(0, upper, size=batch_size)
        return Batch(*(torch.from_numpy(a[idx]) for a in (
            self.observations, self.actions, self.next_observations, self.dones[:, None],
            self.rewards[:, None])))


class TD3:
    """CleanRL's TD3 state (networks, optimizers, replay, env, step counter)."""

    def __init__(self, env: gym.Env, args: Args) -> None:
        if not isinstance(env.action_space, gym.spaces.Box):
            raise TypeError("only continuous action space is supported")
        torch.set_num_threads(1)
        torch.manual_seed(args.seed)
        self.env, self.args = env, args
        space = env.action_space
        obs_dim = int(np.prod(env.observation_space.shape))
        act_dim = int(np.prod(space.shape))
        self.low, self.high = space.low, space.high
        space.seed(args.seed)
        self.actor = Actor(obs_dim, space, args.hidden)
        self.qf1 = QNetwork(obs_dim, act_dim, args.hidden)
        self.qf2 = QNetwork(obs_dim, act_dim, args.hidden)
        self.qf1_target = QNetwork(obs_dim, act_dim, args.hidden)
        self.qf2_target = QNetwork(obs_dim, act_dim, args.hidden)
        self.target_actor = Actor(obs_dim, space, args.hidden)
        self.target_actor.load_state_dict(self.actor.state_dict())
        self.qf1_target.load_state_dict(self.qf1.state_dict())
        self.qf2_target.load_state_dict(self.qf2.state_dict())
        self.q_optimizer = optim.Adam(list(self.qf1.parameters()) + list(self.qf2.parameters()),
                                      lr=args.learning_rate)
        self.actor_optimizer = optim.Adam(list(self.actor.parameters()), lr=args.learning_rate)
        self.rb = ReplayBuffer(args.buffer_size, obs_dim, act_dim, seed=args.seed)
        self.obs, _ = env.reset(seed=args.seed)
        self.global_step = 0
        self.updates = 0  # critic updates (the actor steps on every policy_frequency-th)
        self.episode_returns: list[float] = []
        self._ret = 0.0

    def run(self, steps: int) -> None:
        """``steps`` iterations of CleanRL's main loop (one env step + at most one update)."""
        a, env = self.args, self.env
        for _ in range(steps):
            gs = self.global_step
            if gs < a.learning_starts:
                actions = self.env.action_space.sample()
            else:
                with torch.no_grad():
                    act = self.actor(torch.Tensor(self.obs[None]))[0]
                    act += torch.normal(0, self.actor.action_scale * a.exploration_noise)
                    actions = act.numpy().clip(self.low, self.high)
            next_obs, reward, term, trunc, _ = env.step(actions)
            self.rb.add(self.obs, next_obs, actions, float(reward), bool(term))
            self._ret += float(reward)
            if term or trunc:
                self.episode_returns.append(self._ret)
                self._ret = 0.0
                next_obs, _ = env.reset()
            self.obs = next_obs
            if gs > a.learning_starts:
                self._update(gs)
            self.global_step += 1

    def _update(self, global_step: int) -> None:
        a = self.args
        data = self.rb.sample(a.batch_size)
        with torch.no_grad():
            clipped_noise = (torch.randn_like(data.actions) * a.policy_noise).clamp(
                -a.noise_clip, a.noise_clip) * self.target_actor.action_scale
            next_state_actions = (self.target_actor(data.next_observations)
                                  + clipped_noise).clamp(float(self.low[0]), float(self.high[0]))
            qf1_next_target = self.qf1_target(data.next_observations, next_state_actions)
            qf2_next_target = self.qf2_target(data.next_observations, next_state_actions)
            min_qf_next_target = torch.min(qf1_next_target, qf2_next_target)
            next_q_value = (data.rewards.flatten()
                            + (1 - data.dones.flatten()) * a.gamma * min_qf_next_target.view(-1))
        qf1_a_values = self.qf1(data.observations, data.actions).view(-1)
        qf2_a_values = self.qf2(data.observations, data.actions).view(-1)
        qf_loss = F.mse_loss(qf1_a_values, next_q_value) + F.mse_loss(qf2_a_values,
                                                                      next_q_value)
        self.q_optimizer.zero_grad()
        qf_loss.backward()
        self.q_optimizer.step()
        self.updates += 1
        if global_step % a.policy_frequency == 0:
            actor_loss = -self.qf1(data.observations, self.actor(data.observations)).mean()
            self.actor_optimizer.zero_grad()
            actor_loss.backward()
            self.actor_optimizer.step()
            for net, target in ((self.actor, self.target_actor), (self.qf1, self.qf1_target),
                                (self.qf2, self.qf2_target)):
                for param, target_param in zip(net.parameters(), target.parameters()):
                    target_param.data.copy_(a.tau * param.data + (1 - a.tau) * target_param.data)


def train(env: gym.Env, args: Args | None = None) -> dict[str, Any]:
    """CleanRL's main loop for ``args.total_timesteps`` steps; returns counts and rates."""
    args = args or Args()
    agent = TD3(env, args)
    t0 = time.perf_counter()
    agent.run(args.total_timesteps)
    wall = time.perf_counter() - t0
    return {"agent": agent, "env_steps": agent.global_step, "updates": agent.updates,
            "wall_s": wall, "episode_returns": agent.episode_returns}
