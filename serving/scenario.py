"""Session requests for a simulator scenario: what a controller running that scenario would
send (tests, benchmarks, the README's first query and the delivery testbed use it)."""

from __future__ import annotations

import numpy as np

from envs.dsmd.instance import DSMDInstance
from envs.dsmd.message import messages_from_trace
from envs.dsmd.parser import TypeCatalog
from envs.dsmd.problems import ProblemSet

__all__ = ["session_body", "rates_body", "adapter_for", "replay_window"]


def session_body(problems: ProblemSet, window: int | None = None, seed: int = 0) -> dict:
    """``POST /v1/sessions`` body: the scenario's nodes, capacities, K and its whole type
    catalogue (type id = catalogue index), with the rates of ``window`` if given."""
    topo, cat, spec = problems.dataset.topology, problems.parsed.catalog, problems.spec
    body = {"nodes": [{"id": int(i), "capacity_bps": int(c)}
                      for i, c in zip(topo.node_ids.tolist(), topo.bandwidth_bps.tolist())],
            "controller": {"bandwidth_bps": int(spec.controller_bw_bps),
                           "cpu": int(spec.controller_cpu)},
            "num_topics": int(spec.num_topics), "interval_s": float(spec.interval_s),
            "types": [{"id": t, "destinations": topo.node_ids[cat.destinations[t]].tolist()}
                      for t in range(len(cat))],
            "scenario_signature": {"num_nodes": problems.num_nodes,
                                   "num_topics": int(spec.num_topics),
                                   "topology": topo.signature()},
            "seed": seed}
    if window is not None:
        rates = {r["type"]: r for r in rates_body(problems.instance(window))["rates"]}
        for t in body["types"]:
            if t["id"] in rates:
                t["rate_bps"] = rates[t["id"]]["rate_bps"]
                t["messages"] = rates[t["id"]]["messages"]
    return body


def rates_body(inst: DSMDInstance, replace: bool = True) -> dict:
    """``POST /v1/sessions/{id}/rates`` body: the instance's rates by catalogue index."""
    return {"rates": [{"type": int(c), "rate_bps": int(r), "messages": int(m)}
                      for c, r, m in zip(inst.catalog_index.tolist(), inst.rate_bps.tolist(),
                                         inst.messages.tolist())],
            "replace": replace}


def adapter_for(problems: ProblemSet, base_url: str | None, mode: str = "remote", **kw):
    """A :class:`~serving.adapter.ControllerAdapter` for the scenario's controller: its
    topology and capacities, and its known types in the scenario's catalogue order (so the
    adapter's type ids are the simulator's catalogue indices)."""
    from .adapter import ControllerAdapter

    topo, spec = problems.dataset.topology, problems.spec
    src = problems.parsed.catalog
    cat = TypeCatalog(topo, src.batch_key)
    for d, v, c in zip(src.destinations, src.vpc, src.config):  # first-seen VPC and config too
        cat.type_of(topo.node_ids[d], v, c)
    return ControllerAdapter(topo, num_topics=spec.num_topics,
                             controller_bw_bps=spec.controller_bw_bps,
                             controller_cpu=spec.controller_cpu, interval_s=spec.interval_s,
                             base_url=base_url, mode=mode, catalog=cat, **kw)


def replay_window(adapter, problems: ProblemSet, window: int) -> int:
    """Submit the trace's messages of ``window`` through the adapter (Table I messages, in
    trace order), then close the interval; returns the number of messages."""
    rows = np.flatnonzero(problems.parsed.message_window == window)
    for msg in messages_from_trace(problems.dataset.trace, rows):
        adapter.submit(msg)
    adapter.close_interval()
    return int(rows.size)
