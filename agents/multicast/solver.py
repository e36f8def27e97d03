"""The exact multicast solver (Theorem 1, Algorithm 1 / Corollary 3 of ``seeds/004``), kept
beside the model in :mod:`envs.multicast.solver` because the environment's dynamics build
every tree with it (``envs`` never imports ``agents``); re-exported here with the baselines."""

from envs.multicast.solver import *  # noqa: F401,F403
from envs.multicast.solver import __all__  # noqa: F401
