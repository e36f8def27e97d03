"""Announcements of the policy server on a Pulsar topic (Stemflow Section IV: subscribed
global knowledge).

Decision logic cached near the data plane (the cached adapters) learns of a change of global
knowledge by subscription instead of waiting for its next poll: after every policy swap the
server publishes ``{"kind": "policy", "version", "hash", "ts_ns"}`` and after every change of
a session's channel health ``{"kind": "health", "session_id", "health", "ts_ns"}`` (one JSON
object per message; :func:`encode` and :func:`decode` are the one definition of the format,
the subscriber is :mod:`serving.client.subscriber`).

An announcement is a hint, never the only path: the adapters keep polling every
``refresh_s``, so a lost announcement only delays a change to the next poll. Therefore
:class:`Announcer` never blocks or fails a request: one producer created in the background
(retried with a bounded backoff while the broker is away, so the server starts without it),
``send_async`` with ``block_if_queue_full=False``, and every outcome counted in
``smart_announcements_total{kind,outcome}`` (``sent``; ``failed``: the broker refused or the
send timed out; ``unavailable``: no producer yet, the broker away since start (the latest
policy announcement is then ``deferred`` instead: sent when the producer is created, so
adapters that outlived a server restart hear of its policy); ``dropped``: the local send
queue full).

The producer authenticates to the broker as the ``policy-server`` principal
(:func:`security.pulsar.client_args`: mutual TLS with the PKI's identity, so the URL is then
a ``pulsar+ssl://`` one) unless the server's ``security`` is insecure.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from pydantic import ValidationError

from security.pulsar import client_args
from security.tls import Security

from .schemas import ChannelHealth

__all__ = [
    "DEFAULT_TOPIC",
    "KINDS",
    "AnnounceError",
    "Announcer",
    "HealthAnnouncement",
    "MalformedAnnouncement",
    "PolicyAnnouncement",
    "check_settings",
    "decode",
    "encode",
]

log = logging.getLogger(__name__)
PRINCIPAL = "policy-server"  # the identity the producer presents to the broker

DEFAULT_TOPIC = "persistent://public/default/smart-announce"
KINDS = ("policy", "health")
POLICY_KINDS = ("static", "online")  # the stores whose swaps are announced
_SCHEMES = ("pulsar://", "pulsar+ssl://")
_MAX_ID = 256  # longest session id / hash accepted from the topic


class AnnounceError(ValueError):
    """The announcement settings are unusable (names the setting and what is wrong)."""


class MalformedAnnouncement(ValueError):
    """Bytes on the announcement topic that are not an announcement; ``kind`` is the kind it
    claimed when that is one of :data:`KINDS`, else ``"unknown"``."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind = kind


@dataclass(frozen=True)
class PolicyAnnouncement:
    version: int
    hash: str
    ts_ns: int
    policy: str = "static"   # which store swapped: "static" or "online"


@dataclass(frozen=True)
class HealthAnnouncement:
    session_id: str
    health: ChannelHealth
    ts_ns: int


def check_settings(url: str | None, topic: str, url_name: str = "announce.url",
                   topic_name: str = "announce.topic") -> None:
    """``AnnounceError`` naming the setting (``url_name`` / ``topic_name``) if the URL or
    topic is unusable, or if a URL is set where the Pulsar client is not installed."""
    if url is None:
        return
    if (not isinstance(url, str) or not url.startswith(_SCHEMES)
            or not url.split("://", 1)[1].strip()):
        raise AnnounceError(f"{url_name} must be a Pulsar service URL (pulsar://host:port "
                            f"or pulsar+ssl://host:port) or null, got {url!r}")
    if not isinstance(topic, str) or not topic.strip():
        raise AnnounceError(f"{topic_name} must be a non-empty topic name, got {topic!r}")
    if importlib.util.find_spec("pulsar") is None:
        raise AnnounceError(f"{url_name} is set ({url}) but the Pulsar client is not "
                            "installed: pip install -e '.[delivery]' (or pip install "
                            f"pulsar-client), or leave {url_name} null to announce nothing")


def encode(kind: str, **fields: Any) -> bytes:
    """One announcement as the bytes published (``ts_ns`` added if not given)."""
    if kind not in KINDS:
        raise ValueError(f"announcement kind must be one of {KINDS}, got {kind!r}")
    fields.setdefault("ts_ns", time.time_ns())
    return json.dumps({"kind": kind, **fields}, separators=(",", ":")).encode()


def _int(d: Mapping[str, Any], key: str, kind: str, low: int = 0) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not low <= v < 2**63:
        raise MalformedAnnouncement(kind, f"{kind} announcement: {key} must be an integer "
                                    f">= {low}, got {v!r}")
    return v


def _str(d: Mapping[str, Any], key: str, kind: str) -> str:
    v = d.get(key)
    if not isinstance(v, str) or not 0 < len(v) <= _MAX_ID:
        raise MalformedAnnouncement(kind, f"{kind} announcement: {key} must be a non-empty "
                                    f"string of at most {_MAX_ID} characters, got {v!r:.80}")
    return v


def decode(data: bytes) -> PolicyAnnouncement | HealthAnnouncement:
    """The announcement in ``data``; ``MalformedAnnouncement`` saying what is wrong (not
    JSON, not an object, an unknown kind, a field missing or of the wrong type). Unknown
    extra fields are ignored (a newer server may add some)."""
    try:
        d = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MalformedAnnouncement("unknown", f"not JSON ({e})") from None
    if not isinstance(d, dict):
        raise MalformedAnnouncement("unknown", f"not a JSON object but {type(d).__name__}")
    kind = d.get("kind")
    if kind not in KINDS:
        raise MalformedAnnouncement("unknown", f"unknown kind {kind!r:.40}")
    ts = _int(d, "ts_ns", kind)
    if kind == "policy":
        which = d.get("policy", "static")
        if which not in POLICY_KINDS:
            raise MalformedAnnouncement(kind, f"policy announcement: policy must be one of "
                                        f"{POLICY_KINDS}, got {which!r:.40}")
        return PolicyAnnouncement(_int(d, "version", kind, low=1), _str(d, "hash", kind), ts,
                                  which)
    sid = _str(d, "session_id", kind)
    try:
        health = ChannelHealth.model_validate(d.get("health"))
    except ValidationError as e:
        where = ", ".join(".".join(str(x) for x in err["loc"]) or "health"
                          for err in e.errors()[:3])
        raise MalformedAnnouncement(kind, f"health announcement: health: invalid "
                                    f"({where})") from None
    return HealthAnnouncement(sid, health, ts)


class Announcer:
    """The server's producer on ``topic`` at ``url`` (see the module docstring).

    ``registry``: where ``smart_announcements_total`` is counted (the server passes its
    :class:`serving.metrics.ServerMetrics` registry; None: a registry of its own)."""

    def __init__(self, url: str, topic: str = DEFAULT_TOPIC, *, send_timeout_s: float = 2.0,
                 registry: CollectorRegistry | None = None, retry_s: float = 0.5,
                 max_retry_s: float = 30.0, security: Security | None = None) -> None:
        check_settings(url, topic)
        if send_timeout_s <= 0 or retry_s <= 0 or max_retry_s < retry_s:
            raise AnnounceError("announce: send_timeout_s and retry_s must be positive and "
                                "max_retry_s >= retry_s")
        import pulsar

        self.url, self.topic, self.send_timeout_s = url, topic, send_timeout_s
        self.retry_s, self.max_retry_s = retry_s, max_retry_s
        self.counter = Counter("smart_announcements", "Announcements published by the "
                               "server, by kind and outcome", ["kind", "outcome"],
                               registry=registry if registry is not None
                               else CollectorRegistry())
        self.security = security if security is not None else Security()
        if self.security.insecure:
            self.security.warn_if_insecure("announcer")
        self._client = pulsar.Client(url, operation_timeout_seconds=max(3, int(send_timeout_s)),
                                     connection_timeout_ms=2000,
                                     logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error),
                                     **client_args(self.security, PRINCIPAL))
        self._producer: Any = None
        # the latest policy announcement of each store, made while there was no producer yet
        self._deferred: dict[str, bytes] = {}
        self._defer_lock = threading.Lock()
        self._stop = threading.Event()
        self._connected = threading.Event()
        # the producer is created in the background: the constructor returns at once
        self._thread = threading.Thread(target=self._connect, name="announce-connect",
                                        daemon=True)
        self._thread.start()

    def wait_connected(self, timeout: float) -> bool:
        """Whether the producer exists (within ``timeout`` seconds)."""
        return self._connected.wait(timeout)

    def _connect(self) -> None:
        delay, warned = self.retry_s, False
        while not self._stop.is_set():
            try:
                p = self._client.create_producer(
                    self.topic, block_if_queue_full=False, max_pending_messages=1000,
                    send_timeout_millis=int(self.send_timeout_s * 1000),
                    batching_enabled=False)
            except Exception as e:  # broker away or unreachable: retry, polling covers it
                if not warned:
                    log.warning("announce: no producer on %s at %s (%s); retrying in the "
                                "background, adapters poll meanwhile", self.topic, self.url, e)
                    warned = True
                self._stop.wait(delay)
                delay = min(2 * delay, self.max_retry_s)
                continue
            if self._stop.is_set():
                _quiet_close(p)
                return
            with self._defer_lock:
                self._producer = p
                deferred, self._deferred = self._deferred, {}
            self._connected.set()
            log.info("announce: publishing on %s at %s", self.topic, self.url)
            for data in deferred.values():
                self._send(p, "policy", data)
            return

    # ------------------------------------------------------------------ announcements
    def policy(self, policy: Any, which: str = "static") -> None:
        """Announce a swapped-in policy of store ``which`` (``"static"``: a
        :class:`serving.policy_store.LoadedPolicy`, ``"online"``: a
        :class:`serving.policy_store.LoadedOnlinePolicy`; the stores' ``add_listener``
        hook)."""
        if which not in POLICY_KINDS:
            raise ValueError(f"policy announcement: which must be one of {POLICY_KINDS}, got "
                             f"{which!r}")
        self.announce("policy", policy=which, version=int(policy.version),
                      hash=str(policy.hash))

    def online_policy(self, policy: Any) -> None:
        """:meth:`policy` of the online store (its listener)."""
        self.policy(policy, "online")

    def health(self, session_id: str, health: Mapping[str, Any]) -> None:
        """Announce a session's new channel health (a ``ChannelHealth`` dict)."""
        self.announce("health", session_id=session_id, health=dict(health))

    def announce(self, kind: str, **fields: Any) -> None:
        """Publish one announcement without waiting for it; never raises on a broker
        problem (it is counted and logged)."""
        data = encode(kind, **fields)
        p = self._producer
        if p is None:
            with self._defer_lock:
                p = self._producer
                if p is None:
                    if kind == "policy":
                        self._deferred[str(fields.get("policy", "static"))] = data
                    self._count(kind, "deferred" if kind == "policy" else "unavailable")
                    log.debug("announce: %s not sent yet: no producer (broker away)", kind)
                    return
        self._send(p, kind, data)

    def _send(self, p: Any, kind: str, data: bytes) -> None:
        try:
            p.send_async(data, lambda res, _msg_id: self._sent(kind, res))
        except Exception as e:  # queue full (block_if_queue_full=False), producer closed
            self._count(kind, "dropped")
            log.warning("announce: %s dropped: %s", kind, e)

    def _sent(self, kind: str, res: Any) -> None:
        import pulsar

        if res == pulsar.Result.Ok:
            self._count(kind, "sent")
        else:
            self._count(kind, "failed")
            log.warning("announce: %s not published: %s", kind, res)

    def _count(self, kind: str, outcome: str) -> None:
        self.counter.labels(kind, outcome).inc()

    def counts(self) -> dict[tuple[str, str], int]:
        """``(kind, outcome) -> count`` so far (the counter's values)."""
        out: dict[tuple[str, str], int] = {}
        for metric in self.counter.collect():
            for s in metric.samples:
                if s.name.endswith("_total"):
                    out[(s.labels["kind"], s.labels["outcome"])] = int(s.value)
        return out

    def close(self) -> None:
        """Stop retrying, close the producer (its pending sends wait at most the send
        timeout) and the client."""
        self._stop.set()
        p, self._producer = self._producer, None
        if p is not None:
            _quiet_close(p)
        _quiet_close(self._client)  # also ends a producer creation still waiting
        if self._thread.is_alive():
            self._thread.join(timeout=self.send_timeout_s + 5)


def _quiet_close(obj: Any) -> None:
    try:
        obj.close()
    except Exception as e:  # closing after the broker went away
        log.debug("announce: close: %s", e)
