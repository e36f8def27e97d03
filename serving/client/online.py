"""The controller's side of online serving: at every interval boundary the plan, during the
interval a channel for every message (``docs/serving-online.md``).

The controller calls :meth:`OnlineAdapter.plan` at the boundary, :meth:`OnlineAdapter.submit`
for every message (it returns the message's channel, placing a type the plan does not cover
on its first message) and :meth:`OnlineAdapter.close_interval` at the end. The adapter
keeps a local :class:`serving.online_session.OnlineSession`, the server's engine, fed with
the same messages. Two modes, as :class:`serving.client.static.ControllerAdapter`'s:

``cached``  fetches the online bundle (``GET /v1/online/policy/bundle``) and decides
            locally with ONNX Runtime and the same engine; every ``refresh_s`` it checks,
            on a background thread, whether the server publishes another version, which
            then decides from the next boundary. Without a bundle (none published, server
            down) the fallback decider decides (``source="fallback"``).
``remote``  asks the server: the plan at each boundary, and a placement when a message's
            type needs one (the messages before it, which need none, are sent with it or at
            the close, in chunks); the local engine records the server's decisions
            (``given``) and checks it agrees on every type id. While the server is
            unavailable (timeouts, errors, an open circuit breaker) the local engine decides
            with the fallback decider, and each decision says so (``source="fallback"``,
            ``reason``); at the next boundary the server answers, the adapter opens a new
            session there and restores the history (every closed interval's plan, messages
            and placements, as decisions given) before it asks again; a session the server
            lost (404, a restart) is restored so at once when the adapter asks for a plan.
            To restore, remote mode keeps every message and decision of the session.

With ``announce_url`` (cached mode) the adapter also follows the server's announcements
(:mod:`serving.client.subscriber`, as :class:`serving.client.static.ControllerAdapter`
does): an online policy swap (``{"kind": "policy", "policy": "online"}``) whose hash differs
from the bundle here starts the refresh at once instead of at the next due boundary; polling
every ``refresh_s`` stays as the fallback. Static swaps and channel health are not its business
(counted ``ignored``).

``security`` (secure by default) is the server's TLS check, as for
:class:`serving.client.static.ControllerAdapter`: an ``https://`` URL verified against the PKI's
CA; ``Security(insecure=True)`` for a plain ``http://`` URL (debugging; warned). In cached
mode a fetched bundle is used only if its signature verifies against ``bundle_trust``
(:class:`serving.bundles.signing.BundleTrust`; default: the PKI's bundle-signing key): one the
server offers that does not is refused (logged once with the key id and the reason) and the
adapter keeps the bundle it has.

The fallback decider is :func:`serving.online_session.fallback_decider` (the knob executor
re-planning on the last estimate). With ``trace_log`` every submitted message is kept and
:meth:`OnlineAdapter.flush_trace` writes a trace directory (``messages.parquet``, the
topology, ``scenario.json`` with the session's ``start_ns`` and the closed intervals'
duration) that :func:`envs.dsmd.dataset.import_traces` takes, and whose trace loads as the
:class:`envs.dsmd.online.OnlineTrace` the session served.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from envs.dsmd.message import Message, messages_to_trace
from envs.dsmd.online import OnlineCost
from envs.dsmd.parser import BatchKey
from envs.dsmd.scenarios import ScenarioSpec
from envs.dsmd.topology import Topology
from envs.dsmd.traces import Dataset, write_dataset
from security.tls import Security

from ..announce import DEFAULT_TOPIC, PolicyAnnouncement
from ..bundles.online import (
    ONLINE_BUNDLE_FILES,
    ONLINE_BUNDLE_OPTIONAL,
    OnlineBundle,
    load_online_bundle,
)
from ..bundles.signing import BundleTrust
from ..online_schemas import (
    OnlineSessionCreate,
    PlanIn,
    PlannedIn,
    ScenarioIn,
    messages_body,
)
from ..online_session import Closed, OnlineSession, Plan, fallback_decider
from ..schemas import NodeIn, request_body
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

__all__ = ["OnlineAdapter", "online_session_body"]

log = logging.getLogger(__name__)


def online_session_body(topology: Topology, scenario: ScenarioSpec, *,
                        start_ns: int | None = None, batch_key: BatchKey = "hosts",
                        cost: OnlineCost | None = None, name: str = "live") -> dict[str, Any]:
    """``POST /v1/online/sessions`` body (:class:`~serving.online_schemas.OnlineSessionCreate`)
    for a controller with this topology and scenario."""
    fields: dict[str, Any] = {} if cost is None else {"cost": cost.weights()}
    return request_body(OnlineSessionCreate(
        nodes=[NodeIn(id=int(i), capacity_bps=int(c))
               for i, c in zip(topology.node_ids.tolist(), topology.bandwidth_bps.tolist())],
        scenario=ScenarioIn.model_validate(scenario.to_dict()), start_ns=start_ns,
        batch_key=batch_key, name=name, **fields))



class _Lost(Exception):
    """The server does not know the session (it restarted)."""


class OnlineAdapter:
    """The online controller adapter (module docstring)."""

    def __init__(self, topology: Topology, scenario: ScenarioSpec, *,
                 base_url: str | None = None, api_key: str | None = None,
                 mode: str = "remote", batch_key: BatchKey = "hosts",
                 start_ns: int | None = None, cost: OnlineCost | None = None,
                 timeout_s: float = 2.0, retries: int = 1, breaker_failures: int = 3,
                 breaker_reset_s: float = 2.0, refresh_s: float = 30.0,
                 cache_dir: str | Path | None = None, trace_log: bool = False,
                 name: str = "live", chunk: int = 1000,
                 security: Security | None = None,
                 bundle_trust: BundleTrust | None = None,
                 announce_url: str | None = None,
                 announce_topic: str = DEFAULT_TOPIC) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.mode, self.topology, self.scenario = mode, topology, scenario
        self.batch_key, self.name, self.chunk = batch_key, name, chunk
        self.timeout_s, self.retries, self.refresh_s = timeout_s, retries, refresh_s
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.breaker = CircuitBreaker(breaker_failures, breaker_reset_s)
        self.security = security if security is not None else Security()
        # cached mode: the keys a fetched bundle must be signed by
        self.bundle_trust = (bundle_trust if bundle_trust is not None or mode != "cached"
                             else BundleTrust.from_security(self.security))
        self._client = ServerClient(base_url, api_key, timeout_s=timeout_s, retries=retries,
                                    breaker=self.breaker, security=self.security,
                                    component="online adapter")
        self._bundle: tuple[OnlineBundle | None, int] = (None, 0)  # cached: (bundle, version)
        self._deciding = 0  # cached: the version the engine decides with (0: fallback)
        self._refresher = BackgroundRefresh(self.refresh, "online-refresh")
        self._source = BundleSource(
            "online policy", "/v1/online/policy", "/v1/online/policy/bundle",
            (*ONLINE_BUNDLE_FILES, *ONLINE_BUNDLE_OPTIONAL), "online-bundles",
            lambda d: load_online_bundle(d, self.bundle_trust))
        self.subscriber: AnnouncementSubscriber | None = None
        if mode == "cached":
            self.refresh(force=True)
        if announce_url is not None:
            from .subscriber import AnnouncementSubscriber

            self.subscriber = AnnouncementSubscriber(
                announce_url, announce_topic, on_policy=self._on_policy_announced,
                on_health=lambda _a: False, security=self.security)
        b = self._bundle[0]
        self.engine = OnlineSession(scenario, topology,
                                    cost=cost or (b.cost if b is not None else OnlineCost()),
                                    batch_key=batch_key, start_ns=start_ns, name=name)
        self._fallback = fallback_decider(self.engine.cost)
        self.engine.set_decider(self._fallback, "fallback")
        self.session_id: str | None = None
        self._synced = False  # remote: the server's session has the whole history
        self.reason: str | None = None  # why the last decisions were the fallback's
        self.policy_version = 0
        self._plan: Plan | None = None
        self._messages: list[Message] | None = [] if trace_log else None
        # remote: the history to restore, the open interval's record, the unsent messages
        self._history: list[tuple[Plan, list[Message], dict[int, tuple[int, int]]]] = []
        self._interval: tuple[list[Message], dict[int, tuple[int, int]]] = ([], {})
        self._unsent: list[Message] = []

    # ------------------------------------------------------------------ the interval
    @property
    def window(self) -> int:
        return self.engine.window

    def plan(self) -> Plan:
        """The open interval's boundary plan (asked once; the same afterwards)."""
        if self._plan is not None:
            return self._plan
        e = self.engine
        if self.mode == "cached":
            self._install()
            p = e.begin()
            self.reason = None if p.source == "policy" else "no online policy fetched"
        else:
            p = self._remote_plan()
        self._plan = p
        return p

    def submit(self, msg: Message) -> int:
        """One message of the open interval (in time order); returns its channel (0 = RPC,
        t = topic t)."""
        self.plan()
        e = self.engine
        e.live.check([msg])  # a bad message is the caller's: refused before any request
        if self.mode == "cached":
            ch = int(e.submit([msg]).channels[0])
        else:
            ch = self._remote_submit(msg)
        if self._messages is not None:
            self._messages.append(msg)
        return ch

    def close_interval(self) -> Closed:
        """Close the open interval: its realised terms and the channels of its types."""
        self.plan()
        if self.mode == "remote" and self._synced:
            try:
                self._send_unsent()
                r = self._request("POST", self._path("close"), None)
            except (ServerUnavailable, _Lost) as e:
                self._lose(e)
                r = None
        else:
            r = None
        c = self.engine.close()
        if r is not None and r["terms"] != c.terms:  # pragma: no cover - one engine
            log.error("interval %d: the server scored %s, the local copy %s", c.window,
                      r["terms"], c.terms)
        if self.mode == "remote":
            assert self._plan is not None
            self._history.append((self._plan, *self._interval))
            self._interval = ([], {})
        self._plan = None
        return c

    # ------------------------------------------------------------------ remote mode
    def _path(self, what: str) -> str:
        return f"/v1/online/sessions/{self.session_id}/intervals/{self.engine.window}/{what}"

    def _remote_plan(self) -> Plan:
        e = self.engine
        try:
            try:
                self._ensure_session()
                r = self._request("GET", self._path("plan"), None)
            except _Lost:  # the server restarted: a new session with the history, at once
                self._synced = False
                self._ensure_session()
                r = self._request("GET", self._path("plan"), None)
        except (ServerUnavailable, _Lost) as err:
            self._lose(err)
            return e.begin()
        types = [p["type"] for p in r["plan"]]
        chans = [p["channel"] for p in r["plan"]]
        rates = [p["expected_rate_bps"] for p in r["plan"]]
        e.begin(given=(types, chans, rates))
        self.policy_version, self.reason = int(r["policy_version"]), None
        obs = None if r["observation"] is None else np.asarray(r["observation"], np.float32)
        knobs = None if r["knobs"] is None else {
            k: math.inf if v is None else float(v) for k, v in r["knobs"].items()}
        return Plan(e.window, np.asarray(types, np.int64), np.asarray(chans, np.int64),
                    np.asarray(rates, np.int64), r["source"], knobs, obs)

    def _remote_submit(self, msg: Message) -> int:
        e = self.engine
        need = e.to_place([msg])
        sub = None
        if self._synced and not need:
            sub = e.submit([msg])
            self._unsent.append(msg)
            if len(self._unsent) >= self.chunk:
                try:
                    self._send_unsent()
                except (ServerUnavailable, _Lost) as err:
                    self._lose(err)
        elif self._synced:
            try:
                r = self._send([*self._unsent, msg], {})
                self._unsent = []
                placed = {p["type"]: p["channel"] for p in r["placed"]}
                if r["types"][-1] != need[0] or set(placed) != set(need):
                    self._synced = False
                    raise AdapterError(f"the server placed {placed} where the local copy "
                                       f"places types {need}: the copies differ")
                sub = e.submit([msg], given=placed)
            except (ServerUnavailable, _Lost) as err:
                self._lose(err)
        if sub is None:  # the server is not deciding: the fallback decider places
            sub = e.submit([msg], decider=self._fallback)
        msgs, placed_here = self._interval
        msgs.append(msg)
        for p in sub.placed:
            placed_here[p.type_id] = (p.channel, p.message_id)
        return int(sub.channels[0])

    def _send_unsent(self) -> None:
        if self._unsent:
            self._send(self._unsent, {})
            self._unsent = []

    def _send(self, msgs: list[Message], given: dict[int, int]) -> Any:
        return self._request("POST", self._path("messages"), messages_body(msgs, given))

    def _lose(self, err: Exception) -> None:
        """The server stops deciding for this session until the next boundary it answers."""
        self._synced = False
        self.reason = f"server unavailable: {err}"
        self._unsent = []

    def _ensure_session(self) -> None:
        """(Re-)open the server's session and restore the history there, when it may lack
        any of it (module docstring)."""
        if self._synced:
            return
        e = self.engine
        body = online_session_body(self.topology, self.scenario, start_ns=e.live.t0,
                                   batch_key=self.batch_key, cost=e.cost, name=self.name)
        old = self.session_id
        self.session_id = self._request("POST", "/v1/online/sessions", body)["session_id"]
        if old is not None:
            with contextlib.suppress(ServerUnavailable, _Lost, AdapterError):
                self._request("DELETE", f"/v1/online/sessions/{old}", None, expect_json=False)
        for w, (plan, msgs, placed) in enumerate(self._history):
            self._restore(w, plan, msgs, placed)
        self._synced = True

    def _restore(self, w: int, plan: Plan, msgs: list[Message],
                 placed: dict[int, tuple[int, int]]) -> None:
        """Interval ``w`` of the history on the server, as decisions given."""
        base = f"/v1/online/sessions/{self.session_id}/intervals/{w}"
        self._request("PUT", f"{base}/plan", request_body(PlanIn(plan=[
            PlannedIn(type=t, channel=c, expected_rate_bps=r)
            for t, c, r in zip(plan.types.tolist(), plan.channels.tolist(),
                               plan.rates.tolist())])))
        by_message = {mid: (t, c) for t, (c, mid) in placed.items()}
        for i in range(0, len(msgs), self.chunk):
            part = msgs[i:i + self.chunk]
            given = dict(by_message[m.message_id] for m in part if m.message_id in by_message)
            self._request("POST", f"{base}/messages", messages_body(part, given))
        self._request("POST", f"{base}/close", None)

    def _request(self, method: str, path: str, body: Any, expect_json: bool = True) -> Any:
        """One request with retries and the circuit breaker: ``ServerUnavailable`` (timeouts,
        5xx, open breaker), ``_Lost`` (404: the server lost the session),
        :class:`AdapterError` (another 4xx: the request is wrong)."""
        r = self._client.send(method, path, body)
        if r.status_code == 404 and "/sessions/" in path:
            raise _Lost(f"{method} {path}: the server does not know the session")
        if r.status_code >= 400:
            raise AdapterError(f"{method} {path}: HTTP {r.status_code}: {r.text[:500]}")
        return r.json() if expect_json else None

    # ------------------------------------------------------------------ cached mode
    def _install(self) -> None:
        """At a boundary: decide with the newest fetched bundle (a refresh is started when
        one is due)."""
        if self._refresher.due(self.refresh_s):
            self._refresher.start()
        bundle, version = self._bundle  # one read: bundle and version agree
        if bundle is not None and version != self._deciding:
            self.engine.set_decider(bundle.decider(f"online-v{version}"), "policy")
            self._deciding = self.policy_version = version

    def _on_policy_announced(self, a: PolicyAnnouncement) -> bool:
        """The subscriber's callback: refresh now for an online swap whose bundle is not the
        one here (it decides from the next boundary)."""
        current = self._bundle[0]
        if self.mode != "cached" or a.policy != "online" or (
                current is not None and current.metadata.get("actor_sha256") == a.hash):
            return False
        self._refresher.start(again=True)
        return True

    def refresh(self, force: bool = False) -> bool:
        """Cached mode: fetch the online bundle if the server publishes another version.
        Returns whether one was fetched (it decides from the next boundary); a failure
        keeps the current one."""
        self._refresher.last = time.monotonic()
        cur = self._bundle[0]
        got = fetch_bundle(self._client, self._source, None if cur is None
                           else str(cur.metadata.get("actor_sha256")), self._bundle[1],
                           self.cache_dir, force)
        if got is None:
            return False
        self._bundle = got
        return True

    # ------------------------------------------------------------------ logs
    def flush_trace(self, directory: str | Path, overwrite: bool = False) -> int:
        """Write the messages submitted so far as a trace directory (module docstring);
        returns how many."""
        if self._messages is None:
            raise ValueError("trace_log=False: messages are not kept")
        e = self.engine
        meta: dict[str, Any] = {"name": Path(directory).name, "source": "online adapter",
                                "scenario": self.scenario.name,
                                "interval_s": float(self.scenario.interval_s),
                                "duration_s": e.window * float(self.scenario.interval_s)}
        if e.live.t0 is not None:
            meta["start_ns"] = int(e.live.t0)
        write_dataset(directory, Dataset(self.topology, messages_to_trace(self._messages),
                                         meta), overwrite=overwrite)
        return len(self._messages)

    def close(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
        self._client.close()

    def __enter__(self) -> OnlineAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
