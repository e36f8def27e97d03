"""DDPG (+TD3 flags) with prioritized experience replay on RLlib 2.60's new API stack.

* :mod:`agents.ddpg.replay` -- proportional prioritized replay on a numpy sum-tree;
* :mod:`agents.ddpg.module` -- the RLModule (actor, critic(s), targets);
* :mod:`agents.ddpg.update` -- one gradient update, top to bottom (:func:`ddpg_update`);
* :mod:`agents.ddpg.learner` -- the torch Learner: RLlib's hooks around that update, the
  optimizers, the target networks and the TD3 delay counter;
* :mod:`agents.ddpg.algorithm` -- ``DDPGConfig`` / ``DDPG`` with a training step that feeds
  the fast replay straight to the learner group.
* :mod:`agents.ddpg.rllib_internals` -- every private RLlib attribute the above reach, each
  behind a documented function.

The algorithm modules import Ray; this package's ``__init__`` does not.
"""

from .replay import PrioritizedReplay, ReplayBatch, SumTree, linear_schedule

__all__ = ["PrioritizedReplay", "ReplayBatch", "SumTree", "linear_schedule"]
