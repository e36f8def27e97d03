"""Gymnasium environments of the project, registered under the ``smart`` namespace.

=============================  ===================================================
id                             what
=============================  ===================================================
``smart/DSMD-v0``              channel per message type, Box(-1, 1, (K+1,)) action
``smart/DSMDDiscrete-v0``      the same with a Discrete(K+1) action (built-in
                               discrete algorithms, ablations)
``smart/DSMDOnline-v0``        the online problem: one step per interval sets the
                               knobs of a greedy executor (:mod:`envs.dsmd.online`)
``smart/Multicast-v0``         service-node choice per arriving multicast session
                               (:mod:`envs.multicast`)
``smart/Shaping-v0``           per-channel rate limits of the controller's control
                               channels (:mod:`envs.shaping`)
=============================  ===================================================
"""

from gymnasium.envs.registration import register, registry

__all__ = ["ENV_IDS", "DSMD_ENV_IDS"]

DSMD_ENV_IDS = ("smart/DSMD-v0", "smart/DSMDDiscrete-v0")
ENV_IDS = (*DSMD_ENV_IDS, "smart/DSMDOnline-v0", "smart/Multicast-v0", "smart/Shaping-v0")

if "smart/DSMD-v0" not in registry:
    register(id="smart/DSMD-v0", entry_point="envs.dsmd.env:DSMDEnv")
    register(id="smart/DSMDDiscrete-v0", entry_point="envs.dsmd.env:DSMDEnv",
             kwargs={"action": "discrete"})
    register(id="smart/DSMDOnline-v0", entry_point="envs.dsmd.online_env:DSMDOnlineEnv")
    register(id="smart/Multicast-v0", entry_point="envs.multicast.env:MulticastEnv")
    register(id="smart/Shaping-v0", entry_point="envs.shaping.env:ShapingEnv")
