"""A learned actor behind the common :class:`~agents.policy.Policy` interface.

The actor is any callable ``obs (float32, layout.size) -> channel scores (K+1)``: a torch
module, an ONNX Runtime session wrapper, or a plain function. Decisions are made by the
decision step of ``smart/DSMD-v0`` and the policy server (:class:`envs.dsmd.decision.
DecisionStep`: the same decision order, observation builder and decoding, with random
tie-breaks), so a train/evaluate/serve feature difference is impossible by construction
(``tests/test_learned.py`` checks env and policy agree).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from envs.dsmd.decision import DecisionStep
from envs.dsmd.decoding import check_decoding
from envs.dsmd.instance import DSMDInstance
from envs.dsmd.observation import ObservationLayout

from .policy import Policy

__all__ = ["ActorPolicy"]


class ActorPolicy(Policy):
    def __init__(self, actor: Callable[[np.ndarray], np.ndarray], layout: ObservationLayout,
                 *, name: str = "learned", order: str = "rate_desc",
                 decoding: str = "feasible", seed: int = 0) -> None:
        self.actor = actor
        self.layout = layout
        self.name = name
        self.order = order
        self.decoding = check_decoding(decoding)
        self.seed = int(seed)
        self.rng = np.random.default_rng(seed)

    @classmethod
    def from_bundle(cls, bundle, *, name: str | None = None, seed: int = 0) -> ActorPolicy:
        """The policy of a loaded :class:`~serving.bundles.static.PolicyBundle` (its layout,
        decision order and decoding)."""
        return cls(bundle, bundle.layout, name=name or bundle.metadata["extra"].get(
            "algorithm", "learned"), order=bundle.order, decoding=bundle.decoding, seed=seed)

    def reset(self, seed: int | None = None) -> None:
        self.rng = np.random.default_rng(self.seed if seed is None else seed)

    def assign(self, inst: DSMDInstance) -> np.ndarray:
        step = DecisionStep(inst, self.layout, rng=self.rng, order=self.order,
                            decoding=self.decoding)
        actor = self.actor
        while not step.done:
            step.apply(np.asarray(actor(step.observe())))
        return step.state.channel.copy()
