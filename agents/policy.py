"""The one policy interface shared by evaluation, the environment, serving and delivery:
:class:`envs.dsmd.policy.Policy` (defined beside the instance it reads, so the simulator's
own planners implement it), re-exported for the agents."""

from __future__ import annotations

from envs.dsmd.policy import Policy, PolicyError

__all__ = ["Policy", "PolicyError"]
