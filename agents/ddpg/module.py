"""The DDPG RLModule (torch): Lillicrap et al. actor and critic(s), TD3 twin critic and
target policy smoothing as options. Networks (:mod:`agents.ddpg.networks`): the paper's
(SMART Section VII-A: two fully connected ReLU layers for actor and critic, tanh on the
actor's output) or the same layers shared across channels (``architecture="per_channel"``)."""

from __future__ import annotations

from typing import Any

import torch
from ray.rllib.core.columns import Columns
from ray.rllib.core.learner.utils import make_target_network
from ray.rllib.core.rl_module.apis import InferenceOnlyAPI
from ray.rllib.core.rl_module.rl_module import RLModule
from ray.rllib.core.rl_module.torch import TorchRLModule
from ray.rllib.utils.annotations import override
from torch import nn

from .networks import ChannelActor, ChannelCritic, MLPCritic, mlp

__all__ = ["ARCHITECTURES", "DDPGTorchRLModule", "mlp"]

ARCHITECTURES = ("mlp", "per_channel")


class DDPGTorchRLModule(TorchRLModule, InferenceOnlyAPI):
    """``pi`` (obs -> tanh action), ``qf`` (and ``qf_twin``) (obs, action -> Q), and their
    target copies (``target_pi``, ...) on the learner."""

    @override(RLModule)
    def setup(self) -> None:
        mc = self.model_config
        obs_dim = int(self.observation_space.shape[0])
        act_dim = int(self.action_space.shape[0])
        hidden = list(mc.get("fcnet_hiddens", [256, 256]))
        self.twin_q = bool(mc.get("twin_q", False))
        self.noise_start = float(mc.get("exploration_noise", 0.1))
        self.noise_end = float(mc.get("exploration_noise_final", self.noise_start))
        self.noise_steps = int(mc.get("exploration_noise_steps", 0))
        self.target_noise = float(mc.get("target_noise", 0.0))
        self.target_noise_clip = float(mc.get("target_noise_clip", 0.5))
        arch = mc.get("architecture", "mlp")
        if arch == "mlp":
            self.pi = mlp(obs_dim, hidden, act_dim, nn.Tanh())

            def critic() -> nn.Module:
                return MLPCritic(obs_dim, act_dim, hidden)
        elif arch == "per_channel":
            blocks = int(mc.get("channel_blocks", 4))
            hidden = list(mc.get("per_channel_hiddens", [64, 64]))
            self.pi = ChannelActor(obs_dim, act_dim, blocks, hidden)

            def critic() -> nn.Module:
                return ChannelCritic(obs_dim, act_dim, blocks, hidden)
        else:
            raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {arch!r}")
        if not self.inference_only:
            self.qf = critic()
            if self.twin_q:
                self.qf_twin = critic()

    # ------------------------------------------------------------------ forward passes
    @override(TorchRLModule)
    def forward_exploration(self, batch: dict[str, Any], **kw) -> dict[str, Any]:
        """As :class:`TorchRLModule`'s, without its per-call ``eval()``/``train()`` walks
        over every submodule: these networks have no dropout or batch norm, so the mode
        changes nothing but costs a walk over the submodules per call (one per env step)."""
        return self._forward_exploration(batch, **kw)

    @override(TorchRLModule)
    def forward_inference(self, batch: dict[str, Any], **kw) -> dict[str, Any]:
        return self._forward_inference(batch, **kw)

    @override(TorchRLModule)
    def forward_train(self, batch: dict[str, Any], **kw) -> dict[str, Any]:
        """As :class:`TorchRLModule`'s, but switching to training mode only when needed
        (it walked every submodule on every gradient update)."""
        if not self.training:
            self.train()
        return self._forward_train(batch, **kw)

    @override(RLModule)
    def _forward_inference(self, batch: dict[str, Any], **kw) -> dict[str, Any]:
        with torch.no_grad():
            return {Columns.ACTIONS: self.pi(batch[Columns.OBS])}

    @override(RLModule)
    def _forward_exploration(self, batch: dict[str, Any], t: int = 0, **kw) -> dict[str, Any]:
        with torch.no_grad():
            a = self.pi(batch[Columns.OBS])
            sigma = self.noise_sigma(t)
            if sigma > 0:
                a = (a + sigma * torch.randn_like(a)).clamp(-1.0, 1.0)
            return {Columns.ACTIONS: a}

    def noise_sigma(self, t: int) -> float:
        """Gaussian exploration noise, linearly annealed over ``exploration_noise_steps``."""
        if self.noise_steps <= 0:
            return self.noise_start
        frac = min(max(t, 0) / self.noise_steps, 1.0)
        return self.noise_start + (self.noise_end - self.noise_start) * frac

    @override(RLModule)
    def _forward_train(self, batch: dict[str, Any], **kw) -> dict[str, Any]:
        """Nothing: :func:`agents.ddpg.update.ddpg_update` runs the networks it needs, in its
        order (RLlib's torch update calls ``forward_train`` before the learner's hooks)."""
        return {}

    # ------------------------------------------------------------------ target networks
    def make_target_networks(self) -> None:
        """Frozen copies of the actor and the critic(s) (the learner makes them at build)."""
        self.target_pi = make_target_network(self.pi)
        self.target_qf = make_target_network(self.qf)
        if self.twin_q:
            self.target_qf_twin = make_target_network(self.qf_twin)

    def get_target_network_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        """(main, target) pairs, for the Polyak averaging of
        :func:`~agents.ddpg.update.ddpg_update`."""
        pairs = [(self.pi, self.target_pi), (self.qf, self.target_qf)]
        if self.twin_q:
            pairs.append((self.qf_twin, self.target_qf_twin))
        return pairs

    # ------------------------------------------------------------------ other APIs
    @override(InferenceOnlyAPI)
    def get_non_inference_attributes(self) -> list[str]:
        return ["qf", "qf_twin", "target_pi", "target_qf", "target_qf_twin"]
