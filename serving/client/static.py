"""The thin controller adapter: the library a live controller imports to ask which channel
each message type takes.

It reuses the simulator's pieces: :class:`~envs.dsmd.message.Message` (Table I) and
:class:`~envs.dsmd.parser.MessageParser` (destination-hash batching, Algorithm 1's rate
estimation, with :func:`~envs.dsmd.instance.rates_bps`), and it keeps a local copy of the
session (:class:`serving.session.Session`, the same engine as the server's). Two modes:

``remote``  asks the policy server: one keep-alive HTTP client, a timeout per request,
            bounded retries, and a circuit breaker (``failures`` consecutive failures open
            it for ``reset_s``; then one trial request half-opens it). While the server is
            slow or down, the local copy decides with the configured heuristic and every
            decision says ``source="fallback"`` with the reason. When the server answers
            again the adapter re-creates its session there from the local copy (assignment
            included) and asks it again.
``cached``  (Stemflow-style, decision logic near the data plane) fetches the policy bundle
            and the session knowledge once, decides locally with ONNX Runtime, and checks
            every ``refresh_s`` whether the server publishes a new policy version; if so it
            downloads and swaps it, on a background thread: a server that is slow or down
            only delays the refresh, never a decision.

With ``announce_url`` the adapter also subscribes to the server's announcements (Stemflow
Section IV, subscribed global knowledge; :mod:`serving.client.subscriber`): a new policy version
starts the same background refresh at once instead of at the next poll, and a change of the
channel health of this adapter's session (``session_id``) is applied to the local copy.
Polling stays as the fallback: while the broker is away, versions arrive every ``refresh_s``
as before (and a cached adapter of a server session also polls that session's health).

**Channel health.** :meth:`ControllerAdapter.set_channel_health` records the controller's
channel health (:class:`serving.schemas.ChannelHealth`: MQ up or down, the types rerouted to
RPC or waiting, the nodes whose RPC endpoint is down) on the local session and, in remote
mode, on the server's session, which announces it. The observation layout does not include
it: the static policies and the learned bundles do not take it as an input (the controller
applies failover itself); a policy may read it from the session.

**Transport security.** ``security`` (:class:`security.tls.Security`, secure by default):
the server's URL must be ``https://`` and its certificate must verify against the PKI's CA
(``security.pki_dir``), host name included; ``Security(insecure=True)`` accepts a plain
``http://`` URL (debugging; warned). The announcement subscriber connects to the broker with
the ``controller`` identity (:func:`security.pulsar.client_args`). In cached mode a
downloaded bundle is installed only if its signature verifies against ``bundle_trust``
(:class:`serving.bundles.signing.BundleTrust`; default: the PKI's bundle-signing key of
``security``): a bundle the server offers unsigned, signed by another key or changed after
signing is refused (logged once, with the key id and the reason) and the adapter keeps
deciding with the bundle it has.

With ``decision_log`` every decision is appended as one JSON line (time, type, destinations,
rate, channel, source, policy version, mode, latency); with ``trace_log`` every submitted
message is kept and written as a trace (``messages.parquet``, the simulator's format) by
:meth:`ControllerAdapter.flush_trace`, so live traffic is training data for the next run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import ValidationError

from envs.dsmd import kernels
from envs.dsmd.instance import rates_bps
from envs.dsmd.message import Message, messages_to_trace
from envs.dsmd.parser import BatchKey, IntervalEstimate, MessageParser, TypeCatalog
from envs.dsmd.topology import Topology
from envs.dsmd.traces import write_trace
from security.tls import Security

from ..announce import DEFAULT_TOPIC, HealthAnnouncement, PolicyAnnouncement
from ..bundles.signing import BundleTrust
from ..bundles.static import BUNDLE_FILES, PolicyBundle, load_bundle
from ..schemas import (
    ChannelHealth,
    ControllerIn,
    DecideBatchRequest,
    NodeIn,
    SessionCreate,
    SessionUpdate,
    TypeIn,
    request_body,
)
from ..session import Decision, Session, SessionError, SessionSpec
from .transport import (
    MODES,
    AdapterError,
    BackgroundRefresh,
    BundleSource,
    CircuitBreaker,
    ServerClient,
    ServerUnavailable,
    fetch_bundle,
)

if TYPE_CHECKING:
    from .subscriber import AnnouncementSubscriber

__all__ = ["AdapterDecision", "ControllerAdapter"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterDecision:
    type_id: int
    channel: int
    source: str  # "policy" | "fallback"
    reason: str | None
    policy_version: int


class ControllerAdapter:
    def __init__(self, topology: Topology, *, num_topics: int, controller_bw_bps: int,
                 controller_cpu: int, interval_s: float = 1.0, base_url: str | None = None,
                 api_key: str | None = None, mode: str = "remote", batch_key: BatchKey = "hosts",
                 timeout_s: float = 0.25, retries: int = 1, breaker_failures: int = 3,
                 breaker_reset_s: float = 2.0, fallback: str = "greedy",
                 refresh_s: float = 5.0, cache_dir: str | Path | None = None,
                 scenario_signature: dict | None = None, seed: int = 0,
                 decision_log: str | Path | None = None, trace_log: bool = False,
                 session_id: str | None = None, catalog: TypeCatalog | None = None,
                 announce_url: str | None = None, announce_topic: str = DEFAULT_TOPIC,
                 security: Security | None = None,
                 bundle_trust: BundleTrust | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode, self.base_url, self.fallback = mode, base_url, fallback
        self.timeout_s, self.retries, self.refresh_s = timeout_s, retries, refresh_s
        # a known catalogue (e.g. the controller's types before a restart) keeps type ids
        self.parser = MessageParser(topology, interval_s, batch_key, catalog=catalog)
        self.local = Session(SessionSpec(topology.node_ids.astype(np.int64),
                                         topology.bandwidth_bps, int(controller_bw_bps),
                                         int(controller_cpu), int(num_topics), float(interval_s),
                                         dict(scenario_signature or {})), seed=seed)
        self.breaker = CircuitBreaker(breaker_failures, breaker_reset_s)
        self.session_id: str | None = None
        self._synced = False  # the server's session equals the local copy
        self._registered = 0  # catalogue types known to the local copy
        # cached mode: (loaded bundle, its version), swapped whole
        self._cached: tuple[PolicyBundle | None, int] = (None, 0)
        self.policy_version = 0  # remote mode: the version of the last server answer
        self._refresher = BackgroundRefresh(self.refresh, "policy-refresh")
        self._source = BundleSource("policy", "/v1/policy", "/v1/policy/bundle", BUNDLE_FILES,
                                    "bundles", self._load)
        self._health_dirty = False  # remote mode: the server has not seen the local health
        self.subscriber: AnnouncementSubscriber | None = None
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self._log = open(decision_log, "a") if decision_log else None  # noqa: SIM115 till close()
        self._messages: list[Message] | None = [] if trace_log else None
        self.security = security if security is not None else Security()
        # cached mode: the keys a downloaded bundle must be signed by
        self.bundle_trust = (bundle_trust if bundle_trust is not None or mode != "cached"
                             else BundleTrust.from_security(self.security))
        self._client = ServerClient(base_url, api_key, timeout_s=timeout_s, retries=retries,
                                    breaker=self.breaker, security=self.security)
        kernels.warm_up()  # the local session's compiled loops, before the first decision
        if session_id is not None:
            self.attach(session_id)
        if mode == "cached":
            self.refresh(force=True)
        if announce_url is not None:
            from .subscriber import AnnouncementSubscriber

            self.subscriber = AnnouncementSubscriber(
                announce_url, announce_topic, on_policy=self._on_policy_announced,
                on_health=self._on_health_announced, security=self.security)

    def attach(self, session_id: str) -> None:
        """Take the server's session ``session_id`` as this adapter's (its types must have
        dense ids 0..M-1, as an adapter registers them): the local copy is rebuilt from the
        server's snapshot and the parser learns the same types in the same order."""
        snap = self._request("GET", f"/v1/sessions/{session_id}", None)
        types = sorted(snap["types"], key=lambda t: t["id"])
        if [t["id"] for t in types] != list(range(len(types))):
            raise AdapterError(f"session {session_id}: type ids are not 0..{len(types) - 1}")
        for t in types:
            if self.parser.catalog.type_of(np.asarray(t["destinations"])) != t["id"]:
                raise AdapterError(f"session {session_id}: type {t['id']} collides with "
                                   "another's destinations under this batch key")
        self.local = Session.from_snapshot(snap)
        self._registered = len(types)
        self.session_id, self._synced = session_id, True

    # ------------------------------------------------------------------ messages and rates
    def submit(self, msg: Message) -> int:
        """A Table I message (Algorithm 1, lines 6-8). Returns its type id."""
        t = self.parser.add(np.asarray(msg.hosts), msg.size_bytes, msg.vpc_id, msg.config_code)
        if self._messages is not None:
            self._messages.append(msg)
        return t

    def _register_new_types(self) -> None:
        cat = self.parser.catalog
        if len(cat) > self._registered:
            ids = self.parser.catalog.topology.node_ids
            self.local.add_types((t, ids[cat.destinations[t]].tolist())
                                 for t in range(self._registered, len(cat)))
            self._registered = len(cat)
            self._synced = False

    def close_interval(self) -> IntervalEstimate:
        """Lines 10-11: the interval's rates become the session's (every type not seen in
        the interval becomes inactive)."""
        est = self.parser.close_interval()
        self._register_new_types()
        rates = rates_bps(est.counter_bytes, est.interval_s)
        self.local.update_rates(dict(zip(est.types.tolist(), rates.tolist())),
                                dict(zip(est.types.tolist(), est.messages.tolist())),
                                replace=True)
        self._synced = False
        return est

    # ------------------------------------------------------------------ decisions
    def decide(self, types: Sequence[int] | None = None, replan: bool = False,
               parallel: bool = False) -> list[AdapterDecision]:
        """Channels for ``types`` (None: every active undecided type, or all with ``replan``);
        ``parallel``: the batch scored in one policy call (``Session.decide``)."""
        t0 = time.perf_counter()
        self._register_new_types()
        if self.mode == "cached":
            if self._refresher.due(self.refresh_s):
                self._refresher.start()
            policy, version = self._cached  # one read: decisions and version agree
            ds = self.local.decide(types, policy, fallback=self.fallback, replan=replan,
                                   parallel=parallel)
            out = [_from(d, version if d.source == "policy" else 0) for d in ds]
        else:
            out = self._decide_remote(types, replan, parallel)
        self._write_log(out, time.perf_counter() - t0)
        return out

    def channel_of(self, type_id: int) -> int:
        return int(self.local.channel[self.local.slot(type_id)])

    def _decide_remote(self, types: Sequence[int] | None, replan: bool,
                       parallel: bool) -> list[AdapterDecision]:
        try:
            self._ensure_session()
            if self._health_dirty:
                try:
                    self._push_health()
                except AdapterError as e:  # refused: said once, never in a decision's way
                    log.error("%s", e)
            body = request_body(DecideBatchRequest(
                types=None if types is None else [int(t) for t in types], replan=replan,
                parallel=parallel))
            r = self._request("POST", f"/v1/sessions/{self.session_id}/decide/batch", body)
        except ServerUnavailable as e:
            ds = self.local.decide(types, None, fallback=self.fallback, replan=replan,
                                   parallel=parallel)
            self._synced = False  # the server has not seen these decisions
            return [AdapterDecision(d.type_id, d.channel, "fallback",
                                    f"server unavailable: {e}", 0) for d in ds]
        self.local.set_assignment({d["type"]: d["channel"] for d in r["decisions"]})
        self.policy_version = int(r["policy_version"])
        return [AdapterDecision(d["type"], d["channel"], d["source"], d.get("reason"),
                                self.policy_version) for d in r["decisions"]]

    def _ensure_session(self) -> str:
        """(Re-)create the server's session from the local copy when they may differ;
        returns the server's session id."""
        if self._synced and self.session_id is not None:
            return self.session_id
        health = self.local.health  # the one the new session gets
        snap = self.local.snapshot()
        body = request_body(SessionCreate(
            nodes=[NodeIn(**n) for n in snap["nodes"]],
            controller=ControllerIn(**snap["controller"]), num_topics=snap["num_topics"],
            interval_s=snap["interval_s"], scenario_signature=snap["scenario_signature"],
            seed=snap["seed"],
            types=[TypeIn(id=t["id"], destinations=t["destinations"], rate_bps=t["rate_bps"],
                          messages=t["messages"], channel=t["channel"])
                   for t in snap["types"]],
            **({} if health is None else {"channel_health": ChannelHealth(**health)})))
        old = self.session_id
        r = self._request("POST", "/v1/sessions", body)
        sid: str = r["session_id"]
        self.session_id, self._synced = sid, True
        if self.local.health is health:
            self._health_dirty = False
        if old is not None:
            with contextlib.suppress(ServerUnavailable, AdapterError):
                self._request("DELETE", f"/v1/sessions/{old}", None, expect_json=False)
        return sid

    def _request(self, method: str, path: str, body: Any, expect_json: bool = True) -> Any:
        r = self._client.send(method, path, body)
        if r.status_code == 404 and "/sessions/" in path and method != "DELETE":
            self._synced = False  # the server lost the session (restart): re-create it
            sid = self._ensure_session()
            return self._request(method, path.replace(path.split("/")[3], sid), body,
                                 expect_json)
        if r.status_code >= 400:
            raise AdapterError(f"{method} {path}: HTTP {r.status_code}: {r.text[:500]}")
        return r.json() if expect_json else None

    # ------------------------------------------------------------------ cached mode
    def request_refresh(self) -> None:
        """Cached mode: refresh now, on the background thread of the periodic refresh (what
        a policy announcement does); a no-op in remote mode (the server decides)."""
        if self.mode == "cached":
            self._refresher.start(again=True)

    def _on_policy_announced(self, a: PolicyAnnouncement) -> bool:
        """The subscriber's callback: refresh unless the announced bundle is the one here
        (an online policy's swap is not this adapter's)."""
        current = self._cached[0]
        if self.mode != "cached" or a.policy != "static" or (
                current is not None and current.content_hash == a.hash):
            return False
        self.request_refresh()
        return True

    def _on_health_announced(self, a: HealthAnnouncement) -> bool:
        """The subscriber's callback: another adapter's (or the server's) new channel health
        of this adapter's session, applied to the local copy only."""
        if self.session_id is None or a.session_id != self.session_id:
            return False
        self.local.set_health(a.health.model_dump())
        return True

    def refresh(self, force: bool = False) -> bool:
        """Cached mode: fetch the bundle if the server publishes another version. Returns
        whether a new policy was installed; a failure keeps the current one."""
        self._refresher.last = time.monotonic()
        if self.session_id is not None:
            self._poll_health()
        current = self._cached[0]
        got = fetch_bundle(self._client, self._source, None if current is None
                           else current.content_hash, self._cached[1], self.cache_dir, force)
        if got is None:
            return False
        self._cached = got
        return True

    def _load(self, directory: Path) -> PolicyBundle:
        return load_bundle(directory, trust=self.bundle_trust)

    def _poll_health(self) -> None:
        """Cached mode, a server session attached: take its channel health (the polling
        fallback of the health announcements); failures are logged and change nothing."""
        sid = self.session_id
        try:
            r = self._client.send("GET", f"/v1/sessions/{sid}/health", None, retries=0)
            if r.status_code != 200:
                raise AdapterError(f"HTTP {r.status_code}")
            raw = r.json()["channel_health"]
            if raw is None:
                return
            health = ChannelHealth.model_validate(raw).model_dump()
            if health != self.local.health:
                self.local.set_health(health)
        except (ServerUnavailable, AdapterError, ValidationError, SessionError, KeyError,
                ValueError) as e:
            log.warning("channel health of session %s not polled: %s", sid, e)

    # ------------------------------------------------------------------ channel health
    def set_channel_health(self, health: Mapping[str, Any] | ChannelHealth) -> None:
        """Record the controller's channel health (:class:`serving.schemas.ChannelHealth`
        or a mapping of its fields) on the local session; in remote mode also on the
        server's session (a ``PATCH``, one attempt within ``timeout_s``; on failure it is
        logged and sent again at the next decision or health change, and a re-created
        server session gets it anyway). ``AdapterError`` naming the field for bad input
        (nothing is changed then). Safe to call from another thread than :meth:`decide`."""
        h = _health_model(health).model_dump()
        try:
            self.local.set_health(h)
        except SessionError as e:
            raise AdapterError(str(e)) from None
        if self.mode == "remote":
            self._health_dirty = True
            self._push_health()

    @property
    def channel_health(self) -> ChannelHealth | None:
        """The channel health of this adapter's session (None: never reported)."""
        h = self.local.health
        return None if h is None else ChannelHealth(**h)

    def _push_health(self) -> None:
        """PATCH the local health onto the server's session, one attempt; ``AdapterError``
        if the server refuses it (4xx other than an unknown session)."""
        sid, health = self.session_id, self.local.health
        if sid is None or health is None or not self._client.configured:
            return  # the session is created with it (_ensure_session)
        body = request_body(SessionUpdate(channel_health=ChannelHealth(**health)))
        try:
            r = self._client.send("PATCH", f"/v1/sessions/{sid}", body, retries=0)
        except ServerUnavailable as e:
            log.warning("channel health not sent to the server (%s); sent again at the next "
                        "call", e)
            return
        if r.status_code == 404:  # the server lost the session: re-created with the health
            self._synced = False
            return
        if r.status_code >= 400:
            self._health_dirty = False
            raise AdapterError(f"PATCH /v1/sessions/{sid} (channel_health): HTTP "
                               f"{r.status_code}: {r.text[:500]}")
        if self.local.health is health:
            self._health_dirty = False

    @property
    def policy(self) -> PolicyBundle | None:
        """Cached mode: the bundle deciding now (None: none yet, heuristic decisions)."""
        return self._cached[0]

    # ------------------------------------------------------------------ logs
    def _write_log(self, ds: list[AdapterDecision], seconds: float) -> None:
        if self._log is None:
            return
        now = time.time_ns()
        for d in ds:
            s = self.local.slot(d.type_id)
            row = {"time_ns": now, "type": d.type_id, "destinations":
                   self.local.spec.node_ids[self.local._dest[s]].tolist(),
                   "rate_bps": int(self.local.rates[s]), "messages": int(self.local.messages[s]),
                   "channel": d.channel, "source": d.source, "reason": d.reason,
                   "policy_version": d.policy_version, "mode": self.mode,
                   "latency_s": seconds / max(len(ds), 1)}
            self._log.write(json.dumps(row) + "\n")
        self._log.flush()

    def flush_trace(self, path: str | Path) -> int:
        """Write the messages submitted so far as a trace; returns how many."""
        if self._messages is None:
            raise ValueError("trace_log=False: messages are not kept")
        write_trace(messages_to_trace(self._messages), path)
        return len(self._messages)

    def close(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
        self._client.close()
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> ControllerAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _from(d: Decision, version: int) -> AdapterDecision:
    return AdapterDecision(d.type_id, d.channel, d.source, d.reason, version)


def _health_model(health: Mapping[str, Any] | ChannelHealth) -> ChannelHealth:
    """``health`` validated as a :class:`ChannelHealth`; ``AdapterError`` naming the first
    bad field."""
    if isinstance(health, ChannelHealth):
        health = health.model_dump()
    if not isinstance(health, Mapping):
        raise AdapterError(f"channel_health must be a mapping or a ChannelHealth, got "
                           f"{type(health).__name__}")
    try:
        return ChannelHealth.model_validate(dict(health))
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise AdapterError(f"channel_health.{where}: {err['msg']} (got "
                           f"{err.get('input')!r:.80})") from None
