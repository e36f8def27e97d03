"""A learned actor behind the common :class:`~agents.policy.Policy` interface.

The actor is any callable ``obs (float32, layout.size) -> channel scores (K+1)``: a torch
module, an ONNX Runtime session wrapper, or a plain function. Decisions are made exactly as
in ``smart/DSMD-v0``: the same decision order, the same :class:`ObservationBuilder` (so the
observation is identical to the environment's for the same state) and the same decoding
(:mod:`envs.dsmd.decoding`) with random tie-breaks. A train/evaluate/serve feature
difference is then impossible by construction (``tests/test_learned.py`` checks env and
policy agree).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from envs.dsmd.cost import CostState
from envs.dsmd.decoding import check_decoding, decode
from envs.dsmd.env import decision_order
from envs.dsmd.instance import DSMDInstance
from envs.dsmd.observation import ObservationBuilder, ObservationLayout

from .policy import Policy

__all__ = ["ActorPolicy"]


class ActorPolicy(Policy):
    def __init__(self, actor: Callable[[np.ndarray], np.ndarray], layout: ObservationLayout,
                 *, name: str = "learned", order: str = "rate_desc",
                 decoding: str = "argmax", seed: int = 0) -> None:
        self.actor = actor
        self.layout = layout
        self.name = name
        self.order = order
        self.decoding = check_decoding(decoding)
        self.seed = int(seed)
        self.rng = np.random.default_rng(seed)

    @classmethod
    def from_bundle(cls, bundle, *, name: str | None = None, seed: int = 0) -> "ActorPolicy":
        """The policy of a loaded :class:`~agents.bundle.PolicyBundle` (its layout, decision
        order and decoding)."""
        return cls(bundle, bundle.layout, name=name or bundle.metadata["extra"].get(
            "algorithm", "learned"), order=bundle.order, decoding=bundle.decoding, seed=seed)

    def reset(self, seed: int | None = None) -> None:
        self.rng = np.random.default_rng(self.seed if seed is None else seed)

    def assign(self, inst: DSMDInstance) -> np.ndarray:
        state = CostState(inst)
        builder = ObservationBuilder(self.layout, inst)
        builder.reset(state)
        order = decision_order(inst, self.order, self.rng)
        n = order.size
        for i, m in enumerate(order):
            obs = builder.observe(state, int(m), i / n)
            c = decode(np.asarray(self.actor(obs)), state, int(m), self.rng, self.decoding)
            state.move(int(m), c)
            builder.on_move(int(m), c)
        return state.channel.copy()
