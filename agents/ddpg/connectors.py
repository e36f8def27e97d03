"""Lean env-runner connectors for DDPG's case: one agent, a ``Box`` observation, a ``Box``
action and a stateless deterministic actor.

RLlib's default pipelines are general: per item, they add observations episode by episode,
batch individual items, convert nested structures, unbatch them again, map module to agent
ids and listify for the vector env, which costs more Python per env step than the actor's
forward pass (``bench/bench_throughput.py --profile`` shows the split). For the case
above, the whole transformation is "stack the latest observations into one tensor" and
"move the actions to numpy, unsquash them into the action space's bounds and clip". These two
connectors do exactly that, with RLlib's semantics: the episode stores the module's action in
[-1, 1]; the env receives ``unsquash_action`` of it (``normalize_actions=True``) or the action
clipped to the bounds (``clip_actions=True``). :meth:`DDPGConfig.build_env_to_module_connector`
and ``build_module_to_env_connector`` use them when ``fast_connectors`` is on (the default)
and the spaces allow it, and RLlib's pipelines otherwise.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
from ray.rllib.connectors.connector_v2 import ConnectorV2
from ray.rllib.core.columns import Columns

__all__ = ["ActionsToEnv", "LatestObservationsToTensor", "supports_fast_connectors"]


def supports_fast_connectors(obs_space: Any, act_space: Any) -> bool:
    """Single-agent flat ``Box`` spaces, both bounded in the action's case."""
    return (isinstance(obs_space, gym.spaces.Box) and len(obs_space.shape) == 1
            and isinstance(act_space, gym.spaces.Box) and len(act_space.shape) == 1
            and bool(np.all(act_space.bounded_below)) and bool(np.all(act_space.bounded_above)))


class LatestObservationsToTensor(ConnectorV2):
    """Env-to-module: ``{OBS: float32 tensor (num_envs, obs_dim)}`` from the latest
    observation of every ongoing episode (RLlib's ``AddObservationsFromEpisodesToBatch`` +
    ``BatchIndividualItems`` + ``NumpyToTensor`` for this case)."""

    def __init__(self, input_observation_space=None, input_action_space=None, *,
                 device: Any = None, **kwargs: Any) -> None:
        super().__init__(input_observation_space, input_action_space, **kwargs)
        self.device = device

    def __call__(self, *, rl_module, batch, episodes, explore=None, shared_data=None,
                 metrics=None, **kwargs) -> Any:
        if Columns.OBS in batch:
            return batch
        obs = np.stack([np.asarray(ep.get_observations(-1), dtype=np.float32)
                        for ep in episodes])
        t = torch.from_numpy(obs)
        batch[Columns.OBS] = t if self.device is None else t.to(self.device)
        return batch


class ActionsToEnv(ConnectorV2):
    """Module-to-env: ``ACTIONS`` as a numpy array (what the episode stores) and
    ``ACTIONS_FOR_ENV`` unsquashed from [-1, 1] into the bounds and clipped
    (``normalize=True``) or only clipped (``normalize=False, clip=True``) (RLlib's
    ``GetActions`` + ``TensorToNumpy`` + ``UnBatchToIndividualItems`` +
    ``NormalizeAndClipActions`` + ``ListifyDataForVectorEnv`` for this case)."""

    def __init__(self, input_observation_space=None, input_action_space=None, *,
                 normalize: bool = True, clip: bool = False, **kwargs: Any) -> None:
        super().__init__(input_observation_space, input_action_space, **kwargs)
        space = self.input_action_space
        self.low = np.asarray(space.low, dtype=space.dtype)
        self.high = np.asarray(space.high, dtype=space.dtype)
        self.normalize, self.clip = bool(normalize), bool(clip)

    def __call__(self, *, rl_module, batch, episodes, explore=None, shared_data=None,
                 metrics=None, **kwargs) -> Any:
        a = batch[Columns.ACTIONS]
        if isinstance(a, torch.Tensor):
            a = a.detach().cpu().numpy()
        batch[Columns.ACTIONS] = a
        if self.normalize:
            env_a = np.clip(self.low + (a + 1.0) * (self.high - self.low) / 2.0,
                            self.low, self.high)
        elif self.clip:
            env_a = np.clip(a, self.low, self.high)
        else:
            env_a = a
        batch[Columns.ACTIONS_FOR_ENV] = env_a.astype(self.low.dtype, copy=False)
        return batch
