"""The reward of Eq. 2 (SMART Section V-D) and its documented variants.

``r = kappa / (1 + O) - beta [bw / C_b - 1]^+ - beta [sends / C_p - 1]^+ - beta * node_term``

* ``objective``: ``"gbps"`` takes ``O = sum_n b(n)`` in Gbit/s (the paper's raw form);
  ``"normalized"`` takes ``O = sum_n b(n) / sum_m f(m)|D(m)|`` (total over necessary
  traffic of the whole instance), which is scale-free and lets one setting work from
  ``tiny`` to ``cern``.
* ``node_term``: ``"aggregate"`` is the paper's literal ``[sum_n (b(n) - s(n)) / s(n)]^+``
  (one overloaded node is hidden by idle ones); ``"per_node"`` is
  ``sum_n [b(n) / s(n) - 1]^+`` (every overloaded node is penalised).
* ``form``: how Eq. 2 becomes a per-step reward when one step assigns one type.
  ``"delta"`` gives ``R(s_{i+1}) - R(s_i)`` so the episode return telescopes to Eq. 2 of the
  final assignment minus a constant; ``"dense"`` gives ``R(s_{i+1})`` every step;
  ``"terminal"`` gives Eq. 2 of the final assignment on the last step only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .cost import CostState
from .errors import DSMDError

__all__ = ["RewardConfig", "eq2_terms"]


@dataclass(frozen=True)
class RewardConfig:
    kappa: float = 100.0
    beta: float = 50.0
    objective: Literal["normalized", "gbps"] = "normalized"
    node_term: Literal["per_node", "aggregate"] = "per_node"
    form: Literal["delta", "dense", "terminal"] = "delta"

    def __post_init__(self) -> None:
        if self.objective not in ("normalized", "gbps"):
            raise DSMDError("reward.objective must be 'normalized' or 'gbps', "
                            f"got {self.objective!r}")
        if self.node_term not in ("per_node", "aggregate"):
            raise DSMDError("reward.node_term must be 'per_node' or 'aggregate', "
                            f"got {self.node_term!r}")
        if self.form not in ("delta", "dense", "terminal"):
            raise DSMDError("reward.form must be 'delta', 'dense' or 'terminal', "
                            f"got {self.form!r}")


def eq2_terms(state: CostState, cfg: RewardConfig) -> dict[str, float]:
    """Each term of Eq. 2 for the current (possibly partial) assignment, and their sum."""
    inst = state.inst
    if cfg.objective == "gbps":
        obj = state.total_traffic / 1e9
    else:
        nec = inst.necessary_bps
        obj = state.total_traffic / nec if nec else 0.0
    _, per_node, _, ratio_sum = state.node_stats()
    if cfg.node_term == "per_node":
        node = per_node
    else:
        node = max(ratio_sum - inst.num_nodes, 0.0)
    terms = {
        "objective": cfg.kappa / (1.0 + obj),
        "controller_bw_penalty":
            cfg.beta * max(state.controller_bw / inst.controller_bw_bps - 1.0, 0.0),
        "controller_cpu_penalty":
            cfg.beta * max(state.controller_cpu / inst.controller_cpu - 1.0, 0.0),
        "node_penalty": cfg.beta * node,
    }
    terms["value"] = (terms["objective"] - terms["controller_bw_penalty"]
                      - terms["controller_cpu_penalty"] - terms["node_penalty"])
    return terms
