"""What the controller's ingress acknowledged (``ControllerIngress.Configure``: durable in the
controller's outbox), in the shape :mod:`delivery.checker` judges: the client side of the
delivery guarantee. A call that failed (a crash, an unreachable controller, a store that
could not write) leaves its requests "maybe": stored or not, the client cannot know; one
that reaches any agent's record was stored, and is adopted (owed to all its hosts) before
the verdict.
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import grpc

from .agent import AppliedRow
from .checker import Resource
from .rpc import pb

__all__ = ["OP", "IngressLedger"]

OP = "UPDATE"


class IngressLedger:
    """What the ingress acknowledged, in ``tests.delivery_rig.Ledger``'s shape (``sent``:
    node -> resource -> [(timestamp, message id)], ``lock``) so ``audit`` and
    ``assert_delivered`` judge it; ``maybe``: message id -> (hosts, resource) of requests
    whose call failed (stored or not, unknown)."""

    def __init__(self, stub: Any) -> None:
        self.stub = stub
        self.sent: dict[int, dict[Resource, list[tuple[int, int]]]] = defaultdict(
            lambda: defaultdict(list))
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.acked = 0
        self.maybe: dict[int, tuple[tuple[int, ...], Resource]] = {}
        self.failures: list[str] = []          # the Configure calls that failed, and why
        self.failed = 0
        self.last_failure = ""

    def request(self, type_id: int, resource_id: int, hosts: Iterable[int], *, vpc: int = 1,
                config: str = "SUBNET", size: int = 64) -> Any:
        mid = next(self.ids)
        return pb.ConfigRequest(message_id=mid, request_id=mid, vpc_id=vpc,
                                configuration_type=config, operation_type=OP,
                                resource_id=resource_id, size_bytes=size, hosts=tuple(hosts),
                                type_id=type_id)

    def configure(self, requests: list[Any], timeout: float = 60.0) -> bool:
        """One Configure call; True if acknowledged, False if it failed (the requests are
        then "maybe"). A refusal (INVALID_ARGUMENT) is raised."""
        try:
            acc = self.stub.Configure(pb.ConfigRequests(requests=requests), timeout=timeout,
                                      wait_for_ready=True)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise
            with self.lock:
                self.failed += 1
                self.last_failure = f"{e.code().name}: {e.details()}"
                if len(self.failures) < 100:
                    self.failures.append(f"{e.code().name}: {e.details()}")
                for r in requests:
                    self.maybe[r.message_id] = (
                        tuple(r.hosts), (r.vpc_id, r.configuration_type, r.resource_id))
            return False
        assert list(acc.message_ids) == [r.message_id for r in requests]
        with self.lock:
            for r, ts in zip(requests, acc.timestamps_ns):
                for n in r.hosts:
                    self.sent[n][(r.vpc_id, r.configuration_type, r.resource_id)].append(
                        (ts, r.message_id))
            self.acked += len(requests)
        return True

    def adopt(self, rows_of: dict[int, list[AppliedRow]]) -> dict[int, int]:
        """Take into ``sent`` the "maybe" messages that reached a record: one applied anywhere
        was stored, so the controller owes it to every host it named, not only to those
        whose record already shows it (a host that never got it is then lost, or stale).
        ``rows_of``: node -> its applied rows (:func:`delivery.checker.read_rows`), read
        once and judged as read. Returns node -> how many rows of maybe messages it holds."""
        seen: dict[int, int] = defaultdict(int)
        stamp: dict[int, int] = {}                 # adopted maybe message -> its timestamp
        for n, rows in rows_of.items():
            for x in rows:
                m = self.maybe.get(x.message_id)
                if m is None or n not in m[0] or x.resource != m[1]:
                    continue                       # not this message (the checker says so)
                seen[n] += 1
                stamp.setdefault(x.message_id, x.timestamp_ns)
        with self.lock:
            for mid, ts in stamp.items():
                hosts, res = self.maybe[mid]
                for n in hosts:
                    got = self.sent[n][res]
                    if (ts, mid) not in got:
                        got.append((ts, mid))
        return seen
