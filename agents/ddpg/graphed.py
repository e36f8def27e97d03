"""DDPG updates replayed from CUDA graphs, for a learner on a GPU.

One update of this project's networks is a few hundred small kernels (forward and backward
passes of the actor and the twin critics, two fused Adam steps, the Polyak averaging); on a
GPU each launch costs more host time than the kernel, so an eager update is bound by the
host, not by the device. PyTorch's CUDA graphs record the whole update once, backward passes
and optimizer steps included ("whole-network capture", PyTorch docs, *CUDA semantics: CUDA
Graphs*; ``torch.cuda.graph``), and replay it with one launch: the minibatch is copied into
the captured input tensors, the graph is replayed, its outputs are cloned.

What is captured is :func:`agents.ddpg.update.ddpg_update` itself, so the arithmetic is the
eager update's. There are two graphs per batch layout: the critic-only update and the one
that also moves the actor and the targets (TD3's delay picks one per update). The optimizers
must be capturable (:func:`agents.ddpg.learner._adam` makes them so on a GPU) and the
non-finite check must not sync (``found_inf``, see :func:`agents.ddpg.update._step`).

Capture needs warm-up updates on a side stream (they create Adam's state and the libraries'
workspaces); the parameters and the optimizer state are put back as they were afterwards, so
a capture changes nothing but the random stream. On a CPU learner, with ``cuda_graphs`` off,
or after a capture failed (a warning, once), the update runs eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import nn

from .update import DDPGNetworks, UpdateParams, UpdateStats, ddpg_update

__all__ = ["GraphedUpdate"]

logger = logging.getLogger(__name__)

WARMUP = 3  # eager updates on a side stream before a capture (PyTorch's example uses 3)


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    outputs: UpdateStats

    def run(self, batch: Mapping[str, torch.Tensor]) -> UpdateStats:
        for k, v in batch.items():
            self.inputs[k].copy_(v)
        self.graph.replay()
        out = self.outputs
        return replace(out, **{f.name: getattr(out, f.name).clone()
                               for f in fields(out) if getattr(out, f.name) is not None})


def _optimizer_state(opts: tuple[torch.optim.Optimizer, ...]
                     ) -> list[tuple[dict[str, Any], dict[str, torch.Tensor] | None]]:
    out = []
    for opt in opts:
        for g in opt.param_groups:
            for p in g["params"]:
                st = opt.state.get(p)
                out.append((st, None if not st else {k: v.clone() for k, v in st.items()
                                                     if torch.is_tensor(v)}))
    return out


class GraphedUpdate:
    """``ddpg_update`` for one module, from CUDA graphs where the batch is on a GPU."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._graphs: dict[tuple, _Graph] = {}
        self._failed = False

    def reset(self) -> None:
        """Forget the graphs (after the optimizers' state was replaced, e.g. a restore)."""
        self._graphs.clear()

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def __call__(self, nets: DDPGNetworks, batch: Mapping[str, torch.Tensor],
                 hp: UpdateParams, critic_opt: torch.optim.Optimizer,
                 actor_opt: torch.optim.Optimizer, *, actor_step: bool) -> UpdateStats:
        first = next(iter(batch.values()))
        if not self.enabled or self._failed or first.device.type != "cuda":
            return ddpg_update(nets, batch, hp, critic_opt, actor_opt, actor_step=actor_step)
        key = (actor_step, hp, tuple(sorted((k, tuple(v.shape), v.dtype)
                                            for k, v in batch.items())))
        g = self._graphs.get(key)
        if g is None:
            try:
                g = self._graphs[key] = self._capture(nets, batch, hp, critic_opt, actor_opt,
                                                      actor_step)
            except Exception as e:  # any capture failure: train on, eagerly
                logger.warning(f"CUDA graph capture of the DDPG update failed ({type(e).__name__}"
                               f": {e}); updates run eagerly")
                self._failed = True
                self._graphs.clear()
                torch.cuda.synchronize()
                return ddpg_update(nets, batch, hp, critic_opt, actor_opt,
                                   actor_step=actor_step)
        return g.run(batch)

    @staticmethod
    def _capture(nets: DDPGNetworks, batch: Mapping[str, torch.Tensor], hp: UpdateParams,
                 critic_opt: torch.optim.Optimizer, actor_opt: torch.optim.Optimizer,
                 actor_step: bool) -> _Graph:
        assert isinstance(nets, nn.Module)
        inputs = {k: v.clone() for k, v in batch.items()}
        params = list(nets.parameters())
        saved_params = [p.detach().clone() for p in params]
        saved_opt = _optimizer_state((critic_opt, actor_opt))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                ddpg_update(nets, inputs, hp, critic_opt, actor_opt, actor_step=actor_step)
        torch.cuda.current_stream().wait_stream(side)
        with torch.no_grad():  # undo the warm-up, in place (the graph keeps these tensors)
            torch._foreach_copy_([p.detach() for p in params], saved_params)
            for opt in (critic_opt, actor_opt):
                for group in opt.param_groups:
                    for p in group["params"]:
                        st = opt.state.get(p)
                        if st:  # created by the warm-up: Adam's fresh state is all zeros
                            for v in st.values():
                                if torch.is_tensor(v):
                                    v.zero_()
            for st, snap in saved_opt:
                if st and snap:
                    for k, v in snap.items():
                        st[k].copy_(v)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = ddpg_update(nets, inputs, hp, critic_opt, actor_opt,
                                  actor_step=actor_step)
        return _Graph(graph, inputs, outputs)
