"""Prometheus metrics of the policy server (one registry per app, so tests can run several)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["MetricsMiddleware", "ServerMetrics"]

_LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,
                    0.25, 1.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("smart_requests", "HTTP requests by route and status",
                                ["route", "method", "status"], registry=r)
        self.latency = Histogram("smart_request_latency_seconds", "Request latency by route",
                                 ["route", "method"], buckets=_LATENCY_BUCKETS, registry=r)
        self.decisions = Counter("smart_decisions", "Decisions by channel and source",
                                 ["channel", "source"], registry=r)
        self.fallbacks = Counter("smart_fallbacks", "Decisions taken by the heuristic, by reason",
                                 ["reason"], registry=r)
        self.swaps = Counter("smart_policy_loads", "Policy loads by outcome", ["outcome"],
                             registry=r)
        self.policy_version = Gauge("smart_policy_version", "Loaded policy version (0: none)",
                                    registry=r)
        self.sessions = Gauge("smart_sessions", "Live controller sessions", registry=r)
        self.refused = Counter("smart_access_refused", "Requests refused by access control, "
                               "by reason (unauthenticated, auth_throttled, not_admin, "
                               "metrics_key, foreign_session, rate_limit, memory_budget_key, "
                               "memory_budget_server)", ["reason"], registry=r)
        self.rate_limited = Counter("smart_rate_limited", "Requests refused by the per-key "
                                    "rate limit, by key id", ["key"], registry=r)
        self.expired = Counter("smart_sessions_expired", "Sessions deleted after limits.idle_s "
                               "unused, by family (session, online)", ["family"], registry=r)
        self.session_bytes = Gauge("smart_session_bytes", "Estimated bytes held by all "
                                   "sessions (serving.limits)", registry=r)
        # each label set's child, looked up once (``labels`` checks and locks on every call)
        self._requests: dict[tuple[str, str, str], Any] = {}
        self._latency: dict[tuple[str, str], Any] = {}
        self._decisions: dict[tuple[int, str], Any] = {}

    def request(self, route: str, method: str, status: int, seconds: float) -> None:
        """One HTTP request answered (``MetricsMiddleware``)."""
        key = (route, method, str(status))
        c = self._requests.get(key)
        if c is None:
            c = self._requests[key] = self.requests.labels(*key)
        c.inc()
        h = self._latency.get(key[:2])
        if h is None:
            h = self._latency[key[:2]] = self.latency.labels(route, method)
        h.observe(seconds)

    def decision(self, channel: int, source: str, reason: str | None) -> None:
        c = self._decisions.get((channel, source))
        if c is None:
            c = self._decisions[channel, source] = self.decisions.labels(
                "rpc" if channel == 0 else f"topic_{channel}", source)
        c.inc()
        if source == "fallback":
            self.fallbacks.labels(_reason_label(reason)).inc()


def _reason_label(reason: str | None) -> str:
    """A bounded label: the kind of reason, not its text."""
    if not reason:
        return "unknown"
    if reason.startswith("no policy"):
        return "no_policy"
    if "signature" in reason:
        return "signature_mismatch"
    return "layout_mismatch"


class MetricsMiddleware:
    """Pure ASGI: counts and times every HTTP request by its route template."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = {"code": 500}

        async def _send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            route = scope.get("route")
            self.metrics.request(getattr(route, "path", None) or "unmatched", scope["method"],
                                 status["code"], time.perf_counter() - t0)
