"""Actor and critic networks of the DDPG module.

``mlp`` -- the paper's networks (SMART Section VII-A): two fully connected ReLU layers,
tanh on the actor's output; the critic reads ``[obs, action]``.

``per_channel`` -- the same two-layer networks applied to each channel with shared weights
(a Deep Sets / permutation-equivariant design, Zaheer et al., arXiv:1703.06114), for the
``channel`` observation (:mod:`envs.dsmd.observation`): ``G`` global values followed by
``P`` blocks of ``K+1`` per-channel values. The actor scores channel ``c`` from
``[globals, features_c]``; the critic reads the globals and the features of the channel
the action picks, softly: their average weighted by a softmax of the action with a learned
temperature (the channel the decoder picks weighs most). Parameters do not grow with K, a
topic's score does not depend on its index (which is arbitrary), and the critic costs
O(K) per sample instead of an MLP over all K+1 channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ChannelActor",
    "ChannelActorBatch",
    "ChannelActorRow",
    "ChannelCritic",
    "MLPCritic",
    "channel_split",
    "mlp",
]


def mlp(inp: int, hidden: list[int], out: int, out_act: nn.Module | None = None) -> nn.Sequential:
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [nn.Linear(inp, h), nn.ReLU()]
        inp = h
    layers.append(nn.Linear(inp, out))
    if out_act is not None:
        layers.append(out_act)
    return nn.Sequential(*layers)


class MLPCritic(nn.Module):
    """``Q(s, a) = mlp([s, a])``."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: list[int]) -> None:
        super().__init__()
        self.net = mlp(obs_dim + act_dim, hidden, 1)

    def forward(self, obs: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([obs, act], dim=-1)).squeeze(-1)


def channel_split(obs_dim: int, num_channels: int, blocks: int) -> int:
    """The number of global values of a per-channel observation (raises if it does not fit)."""
    g = obs_dim - blocks * num_channels
    if g < 0:
        raise ValueError(
            f"architecture 'per_channel' needs an observation of G globals + {blocks} blocks "
            f"of {num_channels} per-channel values (env.observation=channel); got "
            f"{obs_dim} values")
    return g


def _per_channel(obs: torch.Tensor, g: int, blocks: int, a: int) -> torch.Tensor:
    """``[B, G + P*A] -> [B, A, G + P]``: each channel's row is [globals, its features]."""
    b = obs.shape[0]
    feats = obs[:, g:].reshape(b, blocks, a).transpose(1, 2)
    return torch.cat([obs[:, None, :g].expand(b, a, g), feats], dim=-1)


class ChannelActor(nn.Module):
    def __init__(self, obs_dim: int, num_channels: int, blocks: int, hidden: list[int]) -> None:
        super().__init__()
        self.g, self.blocks, self.a = channel_split(obs_dim, num_channels, blocks), blocks, \
            num_channels
        self.net = mlp(self.g + blocks, hidden, 1, nn.Tanh())

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """``net([globals, features_c])`` for every channel c (training and inference in
        torch), computed without repeating the globals: the first layer's global half
        ``W_g g + b`` once per sample, its channel half ``W_c x_c`` on ``[B*A, P]`` rows, then
        the rest of ``net`` on ``[B*A, H]`` rows; one observation goes through :meth:`_one`.
        Equal to ``net(_per_channel(obs, ...))`` up to float rounding. (A bundle exports the
        batch as :class:`ChannelActorBatch` and one observation as :class:`ChannelActorRow`.)"""
        if len(self.net) < 4:  # no hidden layer: net[0] is the output layer
            return self.net(_per_channel(obs, self.g, self.blocks, self.a)).squeeze(-1)
        b = obs.shape[0]
        if b == 1:
            return self._one(obs[0])
        first = self.net[0]
        w = first.weight
        gh = F.linear(obs[:, :self.g], w[:, :self.g], first.bias)  # [B, H]
        feats = obs[:, self.g:].reshape(b, self.blocks, self.a).transpose(1, 2)
        h = F.linear(feats.reshape(b * self.a, self.blocks), w[:, self.g:])  # [B*A, H]
        h = torch.relu(h.reshape(b, self.a, -1) + gh[:, None, :]).reshape(b * self.a, -1)
        return self.net[2:](h).reshape(b, self.a)

    def _one(self, x: torch.Tensor) -> torch.Tensor:
        """One observation: :meth:`row` of its globals and its feature blocks."""
        return self.row(x[:self.g, None], x[self.g:].reshape(self.blocks, self.a))

    def row(self, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One observation given as its globals ``g`` (``[G, 1]``) and its feature blocks
        ``x`` (``[P, A]``), channel-major: ``h = act(W h + b)`` on ``[H, A]`` columns, so each
        layer is one GEMM whose bias is a column (the first layer's is ``W_g g + b``, the
        globals' half) and the last one gives the ``[1, A]`` scores without a transpose
        (a bundle's ``actor_row.onnx``: a handful of fused GEMMs)."""
        first = self.net[0]
        w = first.weight
        col = torch.addmm(first.bias[:, None], w[:, :self.g], g)  # [H, 1]
        h = torch.addmm(col, w[:, self.g:], x)
        for layer in self.net[1:]:
            h = torch.addmm(layer.bias[:, None], layer.weight, h) \
                if isinstance(layer, nn.Linear) else layer(h)
        return h  # [1, A]


class ChannelActorRow(nn.Module):
    """A :class:`ChannelActor` for one observation as a bundle's ``actor_row.onnx`` holds it:
    inputs ``globals`` ``[G, 1]`` and ``features`` ``[P, A]`` (views of one observation
    buffer, so nothing is sliced, reshaped or copied inside the graph), output ``[1, A]``
    (:meth:`ChannelActor.row`)."""

    def __init__(self, actor: ChannelActor) -> None:
        super().__init__()
        self.actor = actor

    def forward(self, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.actor.row(g, x)


class ChannelActorBatch(nn.Module):
    """A :class:`ChannelActor`'s batch forward as a policy bundle's ``actor.onnx`` holds it:
    channel-major and without a separate bias pass. Each sample's channels are the columns
    of an ``[H+1, A]`` matrix; every hidden layer carries one extra unit fixed at 1
    (weight row ``e_last``, ``relu(1) = 1``), so the next layer's bias is one more column of
    its weight and each layer is a single batched GEMM followed by its activation. The
    first layer's extra column is the sample's own ``W_g g + b`` (the globals' half) against
    a row of ones appended to the features. Equal to ``actor(obs)`` up to float rounding
    (tested); built from a copy of the actor's weights, for export only.

    ONNX Runtime's broadcast additions and its ``[B*A, H]`` layout made the batch graph of
    :meth:`ChannelActor.forward` memory-bound: on 1,000 x 201 channel rows this form takes
    about 0.6x the time (``bench/bench_serving.py``)."""

    def __init__(self, actor: ChannelActor) -> None:
        super().__init__()
        linears = [m for m in actor.net if isinstance(m, nn.Linear)]
        acts = [m for m in actor.net if not isinstance(m, nn.Linear)]
        if len(linears) < 2 or [type(m) for m in acts] != [nn.ReLU] * (len(linears) - 1) \
                + [nn.Tanh]:
            raise ValueError("ChannelActorBatch needs net = (Linear, ReLU)* Linear, Tanh with "
                             "at least one hidden layer")
        self.g, self.blocks, self.a = actor.g, actor.blocks, actor.a
        with torch.no_grad():
            first = linears[0]
            h = first.out_features
            wg = torch.zeros(h + 1, self.g)
            wg[:h] = first.weight[:, :self.g]
            bg = torch.zeros(h + 1)
            bg[:h], bg[h] = first.bias, 1.0
            wc = torch.zeros(1, h + 1, self.blocks)
            wc[0, :h] = first.weight[:, self.g:]
            self.register_buffer("wg", wg)
            self.register_buffer("bg", bg)
            self.register_buffer("wc", wc)
            self.register_buffer("ones", torch.ones(1, 1, self.a))
            self.hidden = nn.ParameterList()
            for layer in linears[1:]:
                o, i = layer.out_features, layer.in_features
                last = layer is linears[-1]
                w = torch.zeros(o + (0 if last else 1), i + 1)
                w[:o, :i], w[:o, i] = layer.weight, layer.bias
                if not last:
                    w[o, i] = 1.0
                self.hidden.append(nn.Parameter(w, requires_grad=False))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        b = obs.shape[0]
        u = F.linear(obs[:, :self.g], self.wg, self.bg)  # [B, H+1]: W_g g + b, then 1
        w1 = torch.cat([self.wc.expand(b, -1, -1), u[:, :, None]], dim=2)  # [B, H+1, P+1]
        x = torch.cat([obs[:, self.g:].reshape(b, self.blocks, self.a),
                       self.ones.expand(b, -1, -1)], dim=1)  # [B, P+1, A]
        h = torch.relu(torch.matmul(w1, x))
        for i, w in enumerate(self.hidden):
            h = torch.matmul(w, h)
            h = torch.tanh(h) if i == len(self.hidden) - 1 else torch.relu(h)
        return h.reshape(b, self.a)


class ChannelCritic(nn.Module):
    """``Q(s, a) = mlp([globals, sum_c softmax(a / T)_c features_c])``: the features of the
    channel the action picks (softly, with a learned temperature), and the globals."""

    def __init__(self, obs_dim: int, num_channels: int, blocks: int, hidden: list[int]) -> None:
        super().__init__()
        self.g, self.blocks, self.a = channel_split(obs_dim, num_channels, blocks), blocks, \
            num_channels
        self.head = mlp(self.g + blocks, hidden, 1)
        self.log_inv_temp = nn.Parameter(torch.tensor(2.3))  # 1/T = e^2.3 ~ 10

    def forward(self, obs: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        b = obs.shape[0]
        feats = obs[:, self.g:].reshape(b, self.blocks, self.a)  # [B, P, A]
        w = torch.softmax(act * self.log_inv_temp.exp(), dim=-1)  # [B, A]
        picked = torch.bmm(feats, w[..., None]).squeeze(-1)  # [B, P]
        return self.head(torch.cat([obs[:, :self.g], picked], dim=-1)).squeeze(-1)
