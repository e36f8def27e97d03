"""DDPG (+TD3 flags) with prioritized experience replay on RLlib 2.60's new API stack.

Built across the training issue; so far: :mod:`agents.ddpg.replay`, the fast prioritized
replay buffer the design note (``rllib-ddpg.md`` section 8) calls for.
"""

from .replay import PrioritizedReplay, ReplayBatch, SumTree, linear_schedule

__all__ = ["PrioritizedReplay", "ReplayBatch", "SumTree", "linear_schedule"]
