"""The multicast sub-problem (Zhu, Niu, Li, Li, "Optimal Multicast in Virtualized Datacenter
Networks with Software Switches"): the software-switch model (Section IV),
multicast trees and objectives (1) and (3) (Section V), the group generator of the
evaluation (Section VII-B) and ``smart/MulticastTree-v0``. Everything here except
:mod:`envs.trees.env` is gymnasium-free; the exact solver is :mod:`envs.trees.solver`
(the environment builds its trees with it), the baselines live in :mod:`agents.trees`."""

from .errors import MulticastError
from .switch import (
                     CloningCostSwitch,
                     ProfileSwitch,
                     SwitchModel,
                     fit_cloning_cost,
                     load_profile,
                     switch_from_spec,
                     write_profile,
)
from .tree import MulticastTree, TreeRates, evaluate_tree, kary_tree, objective1, objective3

__all__ = [
                     "CloningCostSwitch",
                     "MulticastError",
                     "MulticastTree",
                     "ProfileSwitch",
                     "SwitchModel",
                     "TreeRates",
                     "evaluate_tree",
                     "fit_cloning_cost",
                     "kary_tree",
                     "load_profile",
                     "objective1",
                     "objective3",
                     "switch_from_spec",
                     "write_profile",
]
