"""How a live controller chooses channels at each interval: the learned policy through the
controller adapter (remote or cached mode, :mod:`serving.adapter`), or a baseline of the
paper's testbed (RPC-only, VITA, IDCS; the same classes the simulator evaluates,
:mod:`agents.baselines`). All decide from the adapter's parser: its type catalogue and the
rates it estimated for the interval that just closed (Algorithm 1)."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from agents.baselines import IDCS, VITA, RPCOnly, vpc_topic
from agents.policy import Policy
from envs.dsmd.instance import DSMDInstance
from envs.dsmd.parser import IntervalEstimate
from serving.adapter import ControllerAdapter

__all__ = ["POLICIES", "AdapterPolicy", "BaselinePolicy", "ChannelPolicy", "make_policy"]

POLICIES = ("rpc", "vita", "idcs", "learned")


class ChannelPolicy(Protocol):
    name: str

    def channels(self, adapter: ControllerAdapter, est: IntervalEstimate) -> dict[int, int]:
        """type id -> channel for the types active in ``est``."""
        ...

    def first_channel(self, adapter: ControllerAdapter, type_id: int) -> int:
        """The channel of a type seen for the first time in the running interval (before
        any rate of it is known)."""
        ...


class AdapterPolicy:
    """The learned policy: ``adapter.decide(replan=True)`` on the interval's rates (remote:
    the policy server; cached: ONNX Runtime in the controller). New types go by RPC until
    their first rate is known."""

    name = "learned"
    relabel_topics = True  # it re-plans from scratch: see delivery.control_plane

    def __init__(self) -> None:
        self.sources: dict[str, int] = {}  # decisions by source (policy / fallback)

    def channels(self, adapter: ControllerAdapter, est: IntervalEstimate) -> dict[int, int]:
        ds = adapter.decide(None, replan=True)
        for d in ds:
            self.sources[d.source] = self.sources.get(d.source, 0) + 1
        return {d.type_id: d.channel for d in ds}

    def first_channel(self, adapter: ControllerAdapter, type_id: int) -> int:
        return 0


class BaselinePolicy:
    """A simulator baseline applied to the interval's instance."""

    def __init__(self, policy: Policy, name: str) -> None:
        self.policy, self.name = policy, name

    def channels(self, adapter: ControllerAdapter, est: IntervalEstimate) -> dict[int, int]:
        spec = adapter.local.spec
        inst = DSMDInstance.from_estimate(adapter.parser.catalog, est, spec.num_topics,
                                          spec.controller_bw_bps, spec.controller_cpu)
        ch = np.asarray(self.policy.assign(inst), dtype=np.int64)
        return dict(zip(inst.catalog_index.tolist(), ch.tolist()))

    def first_channel(self, adapter: ControllerAdapter, type_id: int) -> int:
        cat = adapter.parser.catalog
        k = adapter.local.spec.num_topics
        if isinstance(self.policy, VITA):
            return int(vpc_topic(np.array([cat.vpc[type_id]]), k)[0])
        if isinstance(self.policy, IDCS) and cat.destinations[type_id].size > 1:
            return int(vpc_topic(np.array([cat.vpc[type_id]]), k)[0])
        return 0


def make_policy(name: str) -> ChannelPolicy:
    if name == "learned":
        return AdapterPolicy()
    table = {"rpc": RPCOnly, "vita": VITA, "idcs": IDCS}
    if name not in table:
        raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
    return BaselinePolicy(table[name](), name)
