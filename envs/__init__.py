"""Gymnasium environments of the project, registered under the ``smart`` namespace.

=============================  ===================================================
id                             what
=============================  ===================================================
``smart/DSMD-v0``              channel per message type, Box(-1, 1, (K+1,)) action
``smart/DSMDDiscrete-v0``      the same with a Discrete(K+1) action (built-in
                               discrete algorithms, ablations)
``smart/DSMDOnline-v0``        the online problem: one step per interval sets the
                               knobs of a greedy executor (:mod:`envs.dsmd.online`)
``smart/MulticastTree-v0``     service-node choice per arriving multicast group
                               (:mod:`envs.trees`)
``smart/MulticastOverTime-v0`` the same with groups that depart and a background
                               that follows the time of day (:mod:`envs.trees.timeline`)
``smart/Shaping-v0``           per-channel rate limits of the controller's control
                               channels (:mod:`envs.shaping`)
``smart/PathShaping-v0``       per-class limits of the tenant shaper on the
                               controller's sending path (:mod:`envs.shaping.path_env`)
=============================  ===================================================
"""

try:  # the simulator alone (the core install, the policy server) needs no gymnasium
    from gymnasium.envs.registration import register, registry
except ImportError:  # pragma: no cover - exercised by tests/test_install_groups.py
    registry = None  # type: ignore[assignment]

__all__ = ["DSMD_ENV_IDS", "ENV_IDS"]

DSMD_ENV_IDS = ("smart/DSMD-v0", "smart/DSMDDiscrete-v0")
ENV_IDS = (*DSMD_ENV_IDS, "smart/DSMDOnline-v0", "smart/MulticastTree-v0",
           "smart/MulticastOverTime-v0", "smart/Shaping-v0", "smart/PathShaping-v0")

if registry is not None and "smart/DSMD-v0" not in registry:
    register(id="smart/DSMD-v0", entry_point="envs.dsmd.env:DSMDEnv")
    register(id="smart/DSMDDiscrete-v0", entry_point="envs.dsmd.env:DSMDEnv",
             kwargs={"action": "discrete"})
    register(id="smart/DSMDOnline-v0", entry_point="envs.dsmd.online_env:DSMDOnlineEnv")
    register(id="smart/MulticastTree-v0", entry_point="envs.trees.env:MulticastTreeEnv")
    register(id="smart/MulticastOverTime-v0",
             entry_point="envs.trees.env_time:MulticastOverTimeEnv")
    register(id="smart/Shaping-v0", entry_point="envs.shaping.env:ShapingEnv")
    register(id="smart/PathShaping-v0", entry_point="envs.shaping.path_env:PathShapingEnv")
