"""Gymnasium environments of the project, registered under the ``smart`` namespace.

=============================  ===================================================
id                             what
=============================  ===================================================
``smart/DSMD-v0``              channel per message type, Box(-1, 1, (K+1,)) action
``smart/DSMDDiscrete-v0``      the same with a Discrete(K+1) action (built-in
                               discrete algorithms, ablations)
=============================  ===================================================
"""

from gymnasium.envs.registration import register, registry

__all__ = ["ENV_IDS"]

ENV_IDS = ("smart/DSMD-v0", "smart/DSMDDiscrete-v0")

if "smart/DSMD-v0" not in registry:
    register(id="smart/DSMD-v0", entry_point="envs.dsmd.env:DSMDEnv")
    register(id="smart/DSMDDiscrete-v0", entry_point="envs.dsmd.env:DSMDEnv",
             kwargs={"action": "discrete"})
