"""The delivery checker: the agents' programming records judged against what the controller
was asked to send (a ledger), per node and per resource (Section VI-B's guarantees).

* **violations** (permanent): a resource's applied generation timestamps not strictly
  increasing at a node (a message applied twice, or an older one after a newer one), or a
  message applied at a node it was never sent to;
* **lost**: a message sent to a node that is neither applied there nor superseded by a newer
  applied message of the same resource;
* **stale** (final configuration): a resource whose last applied message at a node is not
  the newest sent to it. While delivery is still under way this only means "not yet";
* **stuck** (set by the caller): messages the controller stored that some destination never
  confirmed, although delivery had all the time it needed (the soak reads the outbox).

A ledger is anything with ``sent`` (node -> resource -> [(timestamp ns, message id)]) and a
``lock``: the in-process test rig's, or :class:`delivery.ledger.IngressLedger` (what the
controller's ingress acknowledged). Used by the delivery tests and the fault-injection soak
(:mod:`delivery.soak`).
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .agent import AppliedRow, read_record

__all__ = ["Ledger", "Resource", "Verdict", "audit", "judge", "lost", "settle_times"]

Resource = tuple[int, str, int]        # (VPC, configuration type, resource id)


class Ledger(Protocol):
    sent: Any       # node -> resource -> [(timestamp ns, message id)]
    lock: Any


def _sent(ledger: Ledger, nodes: Iterable[int]) -> dict[int, dict[Resource, list]]:
    with ledger.lock:
        return {n: {r: list(v) for r, v in ledger.sent[n].items()} for n in nodes}


def _audit(rows_of: dict[int, list[AppliedRow]], sent: dict[int, dict[Resource, list]]
           ) -> tuple[list[str], list[str]]:
    bad: list[str] = []
    missing: list[str] = []
    for n, rows in rows_of.items():
        applied: dict[Resource, list] = defaultdict(list)
        for r in rows:
            applied[r.resource].append(r)
        for res, rs in applied.items():
            ts = [r.timestamp_ns for r in rs]
            if any(b <= a for a, b in itertools.pairwise(ts)):
                bad.append(f"node {n} {res}: applied timestamps not strictly increasing "
                           f"(applied twice or out of order): {[r.message_id for r in rs]}")
            known = set(sent[n].get(res, ()))
            for r in rs:
                if (r.timestamp_ns, r.message_id) not in known:
                    bad.append(f"node {n} {res}: applied message {r.message_id} that was never "
                               f"sent to it")
        for res, msgs in sent[n].items():
            newest = max(msgs)
            got = applied.get(res)
            last = (got[-1].timestamp_ns, got[-1].message_id) if got else None
            if last != newest:
                missing.append(f"node {n} {res}: last applied {last}, newest sent {newest}")
    return bad, missing


def read_rows(record_dir: Path, nodes: Iterable[int]) -> dict[int, list[AppliedRow]]:
    """Each node's applied rows (``node-<id>.record``; a torn last line is ignored)."""
    return {n: read_record(record_dir / f"node-{n}.record")[0] for n in nodes}


def audit(record_dir: Path, ledger: Ledger, nodes: Iterable[int]
          ) -> tuple[list[str], list[str], dict[int, list]]:
    """(violations, stale, rows per node) of the agents' records vs the ledger: violations are
    permanent (out of order, applied twice, applied but never sent there); stale lists the
    resources whose last applied message is not the newest sent (not yet delivered)."""
    nodes = list(nodes)
    sent = _sent(ledger, nodes)
    rows_of = read_rows(record_dir, nodes)
    bad, missing = _audit(rows_of, sent)
    return bad, missing, rows_of


def lost(rows_of: dict[int, list[AppliedRow]], ledger: Ledger, *, every: bool = False
         ) -> list[str]:
    """The messages sent to a node that are neither applied there nor superseded by a newer
    applied one of the same resource (``every``: not applied, superseded or not)."""
    out: list[str] = []
    sent = _sent(ledger, rows_of)
    for n, rows in rows_of.items():
        applied = {(r.timestamp_ns, r.message_id) for r in rows}
        newest: dict[Resource, int] = {}
        for r in rows:
            newest[r.resource] = max(newest.get(r.resource, 0), r.timestamp_ns)
        for res, msgs in sent[n].items():
            for m in msgs:
                if not (m in applied if every else m in applied or newest.get(res, 0) > m[0]):
                    out.append(f"node {n} {res}: message {m} lost")
    return out


def settle_times(rows_of: dict[int, list[AppliedRow]], ledger: Ledger
                 ) -> list[tuple[int, int, int | None]]:
    """For every (node, message) of the ledger: (generation timestamp ns, node, the time it
    took effect at the node: its own ``applied_ns``, or that of the first newer message of
    the resource applied there, None if neither). What recovery and delay are measured
    from."""
    sent = _sent(ledger, rows_of)
    out: list[tuple[int, int, int | None]] = []
    for n, rows in rows_of.items():
        by_res: dict[Resource, list[AppliedRow]] = defaultdict(list)
        for r in rows:
            by_res[r.resource].append(r)
        for res, msgs in sent[n].items():
            applied = sorted(by_res.get(res, ()), key=lambda r: r.timestamp_ns)
            stamps = [r.timestamp_ns for r in applied]
            for ts, _mid in msgs:
                i = bisect.bisect_left(stamps, ts)
                out.append((ts, n, applied[i].applied_ns if i < len(applied) else None))
    return out


@dataclass
class Verdict:
    """The checker's verdict over a finished run (every fault healed, delivery settled)."""

    messages: int                      # (node, message) pairs in the ledger
    applied: int                       # rows applied, all nodes
    violations: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    stuck: list[str] = field(default_factory=list)  # stored, never confirmed (the outbox)

    @property
    def ok(self) -> bool:
        return not (self.violations or self.lost or self.stale or self.stuck)

    def as_dict(self, keep: int = 50) -> dict[str, Any]:
        return {"messages": self.messages, "applied": self.applied, "ok": self.ok,
                "violations": len(self.violations), "lost": len(self.lost),
                "stale": len(self.stale), "stuck": len(self.stuck),
                "examples": (self.violations + self.lost + self.stale + self.stuck)[:keep]}


def judge(rows_of: dict[int, list[AppliedRow]], ledger: Ledger) -> Verdict:
    """Every accepted message applied at most once at every destination, in order per
    resource, none lost, and the final configuration the last one requested. ``rows_of``:
    node -> its applied rows (:func:`read_rows`), the same read the ledger adopted from: a
    second read could hold rows applied in between, judged against a ledger that never
    adopted them."""
    sent = _sent(ledger, rows_of)
    bad, stale = _audit(rows_of, sent)
    return Verdict(messages=sum(len(v) for s in sent.values() for v in s.values()),
                   applied=sum(len(r) for r in rows_of.values()), violations=bad,
                   lost=lost(rows_of, ledger), stale=stale)
