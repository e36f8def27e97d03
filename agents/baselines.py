"""Rule baselines of Section VII-B plus the Alcor AUTO rule (the public Alcor
controller, futurewei-cloud/alcor).

* :class:`RPCOnly` -- every type over RPC (no redundancy, highest controller load).
* :class:`VITA` -- everything over MQ, the topic chosen by VPC id (Zhao et al. [34]):
  topic ``1 + (vpc - 1) mod K``.
* :class:`IDCS` -- the intuitive dual channel: unicast types (|D| = 1) over RPC,
  multicast types over MQ with VITA's VPC topic.
* :class:`AlcorAuto` -- Alcor's ``path.mode = AUTO``: per VPC, MQ when it has more than
  ``upper`` ports, back to RPC below ``lower`` (hysteresis, remembered across instances);
  neighbor and router configuration always over RPC; one topic per VPC (mod K).

Types carry the VPC and configuration type of their first message (the parser's
catalogue), which is what the VPC-based rules use.
"""

from __future__ import annotations

import numpy as np

from envs.dsmd.instance import RPC, DSMDInstance
from envs.dsmd.policy import vpc_topic
from envs.dsmd.schema import ConfigurationType
from envs.dsmd.traces import CONFIG_NAMES

from .policy import Policy

__all__ = ["IDCS", "VITA", "AlcorAuto", "RPCOnly", "vpc_topic"]


class RPCOnly(Policy):
    name = "rpc"

    def assign(self, inst: DSMDInstance) -> np.ndarray:
        return np.full(inst.num_types, RPC, dtype=np.int64)


class VITA(Policy):
    name = "vita"

    def assign(self, inst: DSMDInstance) -> np.ndarray:
        return vpc_topic(inst.vpc, inst.num_topics)


class IDCS(Policy):
    name = "idcs"

    def assign(self, inst: DSMDInstance) -> np.ndarray:
        return np.where(inst.fanout > 1, vpc_topic(inst.vpc, inst.num_topics), RPC)


_ALWAYS_RPC = np.array([CONFIG_NAMES.index(ConfigurationType.NEIGHBOR.value),
                        CONFIG_NAMES.index(ConfigurationType.ROUTER.value)])


class AlcorAuto(Policy):
    """Alcor's AUTO rule with thresholds ``upper`` (UPPER_VPC_SIZE) and ``lower``."""

    name = "alcor"

    def __init__(self, vpc_ports: dict[int, int], upper: int = 1000, lower: int = 100) -> None:
        if lower > upper:
            raise ValueError(f"alcor: lower ({lower}) must not exceed upper ({upper})")
        self.vpc_ports = dict(vpc_ports)
        self.upper, self.lower = int(upper), int(lower)
        self._mq: dict[int, bool] = {}

    def reset(self, seed: int | None = None) -> None:
        self._mq.clear()

    def update_ports(self, vpc: int, ports: int) -> None:
        self.vpc_ports[int(vpc)] = int(ports)

    def _vpc_on_mq(self, vpc: int) -> bool:
        ports = self.vpc_ports.get(vpc, 0)
        was = self._mq.get(vpc)
        if was is None:
            now = ports > self.upper
        elif was:
            now = ports >= self.lower  # MQ -> gRPC only below LOWER_VPC_SIZE
        else:
            now = ports > self.upper
        self._mq[vpc] = now
        return now

    def assign(self, inst: DSMDInstance) -> np.ndarray:
        vpcs = np.unique(inst.vpc)
        on_mq = {int(v): self._vpc_on_mq(int(v)) for v in vpcs}
        mq = np.array([on_mq[int(v)] for v in inst.vpc], dtype=bool)
        mq &= ~np.isin(inst.config, _ALWAYS_RPC)
        return np.where(mq, vpc_topic(inst.vpc, inst.num_topics), RPC).astype(np.int64)
