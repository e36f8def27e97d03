"""The multicast sub-problem (Zhu, Niu, Li, Li, "Optimal Multicast in Virtualized Datacenter
Networks with Software Switches", ``seeds/004``): the software-switch model (Section IV),
multicast trees and objectives (1) and (3) (Section V), the session generator of the
evaluation (Section VII-B) and ``smart/Multicast-v0``. Everything here except
:mod:`envs.multicast.env` is gymnasium-free; the exact solver is :mod:`envs.multicast.solver`
(the environment builds its trees with it), the baselines live in :mod:`agents.multicast`."""

from .errors import MulticastError
from .switch import (CloningCostSwitch, ProfileSwitch, SwitchModel, fit_cloning_cost,
                     load_profile, switch_from_spec, write_profile)
from .tree import MulticastTree, TreeRates, evaluate_tree, kary_tree, objective1, objective3

__all__ = ["MulticastError", "CloningCostSwitch", "ProfileSwitch", "SwitchModel",
           "fit_cloning_cost", "load_profile", "switch_from_spec", "write_profile",
           "MulticastTree", "TreeRates", "evaluate_tree", "kary_tree", "objective1",
           "objective3"]
