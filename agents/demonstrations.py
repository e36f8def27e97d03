"""Demonstration transitions for DDPG from demonstrations (DDPGfD, Vecerik et al.,
arXiv:1707.08817): a baseline policy's decisions on the *training* windows, replayed through
``smart/DSMD-v0`` so that observations, rewards and decision order are exactly the
environment's.

The demonstrated action for type ``m`` is the Box action ``+1`` on the baseline's channel
and ``-1`` elsewhere. Under the ``feasible`` decoding the replay reproduces the baseline's
assignment exactly whenever it is feasible: the reserve of :meth:`CostState.fits` counts
lower bounds of what the undecided types will cost, so every prefix of a feasible
assignment fits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from envs.dsmd.env import DSMDEnv
from envs.dsmd.problems import ProblemSet

from .policy import Policy

__all__ = ["demonstrations"]


def demonstrations(policy: Policy, problems: ProblemSet, env_kwargs: dict[str, Any],
                   split: str = "train") -> dict[str, np.ndarray]:
    """Transitions (obs, actions, rewards, next_obs, terminateds) of ``policy`` on every
    window of ``split``; ``env_kwargs`` are the training environment's settings."""
    kw = {k: v for k, v in env_kwargs.items() if k not in ("split", "cache_dir", "batch_key")}
    kw["action"] = "box"
    env = DSMDEnv(problems=problems, split=split, **kw)
    k1 = env.action_space.shape[0]
    cols: dict[str, list] = {k: [] for k in ("obs", "actions", "rewards", "next_obs",
                                            "terminateds")}
    policy.reset()
    for w in env.windows:
        channel = policy.assign(problems.instance(w))
        obs, _ = env.reset(seed=0, options={"window": w})
        done = False
        while not done:
            m = env.next_type
            a = -np.ones(k1, np.float32)
            a[int(channel[m])] = 1.0
            nxt, r, done, _, _ = env.step(a)
            for k, v in zip(cols, (obs, a, r, nxt, float(done))):
                cols[k].append(v)
            obs = nxt
    return {k: np.asarray(v, dtype=np.float32) for k, v in cols.items()}
