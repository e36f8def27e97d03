"""Session requests for a simulator scenario: what a controller running that scenario would
send (tests, benchmarks, the quick start's first query and the delivery testbed use it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from envs.dsmd.instance import DSMDInstance
from envs.dsmd.message import messages_from_trace
from envs.dsmd.parser import TypeCatalog
from envs.dsmd.problems import ProblemSet

from .schemas import ControllerIn, NodeIn, RateIn, RateUpdate, SessionCreate, TypeIn, request_body

if TYPE_CHECKING:
    from .client.static import ControllerAdapter

__all__ = ["adapter_for", "rates_body", "replay_window", "session_body"]


def session_body(problems: ProblemSet, window: int | None = None, seed: int = 0) -> dict:
    """``POST /v1/sessions`` body (:class:`~serving.schemas.SessionCreate`): the scenario's
    nodes, capacities, K and its whole type catalogue (type id = catalogue index), with the
    rates of ``window`` if given."""
    topo, cat, spec = problems.dataset.topology, problems.parsed.catalog, problems.spec
    rates = ({r.type: r for r in _rates(problems.instance(window))} if window is not None
             else {})

    def type_in(t: int) -> TypeIn:
        dest = topo.node_ids[cat.destinations[t]].tolist()
        r = rates.get(t)
        if r is None:
            return TypeIn(id=t, destinations=dest)
        return TypeIn(id=t, destinations=dest, rate_bps=r.rate_bps, messages=r.messages)

    return request_body(SessionCreate(
        nodes=[NodeIn(id=int(i), capacity_bps=int(c))
               for i, c in zip(topo.node_ids.tolist(), topo.bandwidth_bps.tolist())],
        controller=ControllerIn(bandwidth_bps=int(spec.controller_bw_bps),
                                cpu=int(spec.controller_cpu)),
        num_topics=int(spec.num_topics), interval_s=float(spec.interval_s),
        types=[type_in(t) for t in range(len(cat))],
        scenario_signature={"num_nodes": problems.num_nodes,
                            "num_topics": int(spec.num_topics),
                            "topology": topo.signature()},
        seed=seed))


def _rates(inst: DSMDInstance) -> list[RateIn]:
    if inst.catalog_index is None or inst.messages is None:
        raise ValueError("rates of an instance without catalogue indices or message counts "
                         "(take it from ProblemSet.instance)")
    return [RateIn(type=int(c), rate_bps=int(r), messages=int(m))
            for c, r, m in zip(inst.catalog_index.tolist(), inst.rate_bps.tolist(),
                               inst.messages.tolist())]


def rates_body(inst: DSMDInstance, replace: bool = True) -> dict:
    """``POST /v1/sessions/{id}/rates`` body (:class:`~serving.schemas.RateUpdate`): the
    instance's rates by catalogue index."""
    return request_body(RateUpdate(rates=_rates(inst), replace=replace))


def adapter_for(problems: ProblemSet, base_url: str | None, mode: str = "remote",
                **kw: Any) -> ControllerAdapter:
    """A :class:`~serving.client.static.ControllerAdapter` for the scenario's controller: its
    topology and capacities, and its known types in the scenario's catalogue order (so the
    adapter's type ids are the simulator's catalogue indices). ``kw`` goes to the adapter
    (e.g. ``api_key``, ``refresh_s``, ``announce_url`` / ``announce_topic`` for the
    server's announcements, :mod:`serving.client.subscriber`, ``security`` for the server's TLS
    and ``bundle_trust`` for the keys a cached bundle must be signed by)."""
    from .client.static import ControllerAdapter

    topo, spec = problems.dataset.topology, problems.spec
    src = problems.parsed.catalog
    cat = TypeCatalog(topo, src.batch_key)
    for d, v, c in zip(src.destinations, src.vpc, src.config):  # first-seen VPC and config too
        cat.type_of(topo.node_ids[d], v, c)
    return ControllerAdapter(topo, num_topics=spec.num_topics,
                             controller_bw_bps=spec.controller_bw_bps,
                             controller_cpu=spec.controller_cpu, interval_s=spec.interval_s,
                             base_url=base_url, mode=mode, catalog=cat, **kw)


def replay_window(adapter: ControllerAdapter, problems: ProblemSet, window: int) -> int:
    """Submit the trace's messages of ``window`` through the adapter (Table I messages, in
    trace order), then close the interval; returns the number of messages."""
    rows = np.flatnonzero(problems.parsed.message_window == window)
    for msg in messages_from_trace(problems.dataset.trace, rows):
        adapter.submit(msg)
    adapter.close_interval()
    return int(rows.size)
