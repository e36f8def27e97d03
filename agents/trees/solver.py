"""The exact multicast solver (Theorem 1, Algorithm 1 / Corollary 3 of Optimal Multicast), kept
beside the model in :mod:`envs.trees.solver` because the environment's dynamics build
every tree with it (``envs`` never imports ``agents``); re-exported here with the baselines."""

from envs.trees.solver import *  # noqa: F403
from envs.trees.solver import __all__  # noqa: F401
