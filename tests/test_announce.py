"""Subscribed global knowledge (Stemflow Section IV): the policy server announces policy swaps
and channel-health changes on a topic of a real Pulsar broker, and cached adapters act on
them at once; with the broker away the server still starts and answers, and polling carries
the change. Real components throughout: ``serve.py`` under uvicorn (``LocalServer``, HTTPS),
the secure broker of ``harness.broker`` (TLS, mutual-TLS authentication and the grants of
:mod:`security.pulsar`: the server produces as ``policy-server`` on the topics granted to it,
the adapters read as ``controller``) and the adapters' HTTP and Pulsar clients."""

from __future__ import annotations

import json
import sys
import time
import uuid
from types import SimpleNamespace

import httpx
import pytest

from envs.netutil import free_ports
from security.pulsar import client_args, grant_default_roles
from security.tls import Security
from serving.announce import (
    AnnounceError,
    HealthAnnouncement,
    MalformedAnnouncement,
    PolicyAnnouncement,
    check_settings,
    decode,
    encode,
)
from serving.app import ServerSettings
from serving.bundles.static import load_bundle
from serving.client.static import ControllerAdapter
from serving.client.transport import AdapterError
from serving.local import LocalServer
from serving.policy_store import PolicyStore
from serving.scenario import adapter_for, replay_window

from .waiting import wait_until

pytestmark = pytest.mark.xdist_group("pulsar")

KEY, ADMIN = "ann-key-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0", "ann-admin-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0"



def _topic() -> str:
    return f"persistent://public/default/announce-{uuid.uuid4().hex[:12]}"


def _server(bundle, tmp, url: str, topic: str) -> LocalServer:
    return LocalServer(bundle, tmp, api_key=KEY, admin_key=ADMIN,
                       overrides=[f"announce.url={url}", f"announce.topic={topic}"])


def _adapter(ps, server_url, mode, tmp_path, name, **kw) -> ControllerAdapter:
    return adapter_for(ps, server_url, mode, api_key=KEY, cache_dir=tmp_path / f"cache-{name}",
                       **kw)


def _put(server: LocalServer, bundle) -> httpx.Response:
    """Swap to ``bundle`` (the tests go back and forth: a rollback, asked for)."""
    return httpx.put(server.url + "/v1/policy", verify=server.verify,
                     json={"path": str(bundle), "allow_rollback": True},
                     headers={"X-API-Key": ADMIN}, timeout=30)


def _metric(server: LocalServer, kind: str, outcome: str) -> float:
    text = httpx.get(server.url + "/v1/metrics", verify=server.verify, timeout=5,
                     headers={"X-API-Key": ADMIN}).text
    want = f'smart_announcements_total{{kind="{kind}",outcome="{outcome}"}}'
    for line in text.splitlines():
        if line.startswith(want):
            return float(line.split()[-1])
    return 0.0


def _swap(server: LocalServer, bundles) -> int:
    """PUT whichever tiny bundle is not loaded now; returns the new version."""
    r = httpx.get(server.url + "/v1/policy", verify=server.verify,
                  headers={"X-API-Key": KEY}, timeout=5).json()
    other = "b" if r["hash"] == load_bundle(bundles["a"]).content_hash else "a"
    t0 = time.perf_counter()
    r = _put(server, bundles[other])
    assert r.status_code == 200, r.text
    assert time.perf_counter() - t0 < 1.0  # announcing never holds the swap up
    return int(r.json()["version"])


def _current(server: LocalServer) -> int:
    return int(httpx.get(server.url + "/v1/policy", verify=server.verify,
                         headers={"X-API-Key": KEY},
                         timeout=5).json()["version"])


def _versions(adapters: list[ControllerAdapter]) -> list[int]:
    return [min(d.policy_version for d in ad.decide(replan=True)) for ad in adapters]


def _wait_for_version(adapters: list[ControllerAdapter], version: int, t0: float,
                      limit_s: float) -> float:
    """Every adapter deciding every 50 ms until all decide with ``version``; seconds since
    ``t0`` when the last one did."""
    while True:
        got = _versions(adapters)
        now = time.perf_counter()
        if all(v == version for v in got):
            return now - t0
        assert now - t0 < limit_s, f"versions {got} after {limit_s} s, want {version}"
        time.sleep(0.05)


# ---------------------------------------------------------------------- no broker needed
def test_format_round_trip_and_malformed_messages():
    p = decode(encode("policy", version=3, hash="ab" * 32))
    assert isinstance(p, PolicyAnnouncement) and (p.version, p.hash) == (3, "ab" * 32)
    h = decode(encode("health", session_id="s1", health={"mq": "down", "rerouted": [4]}))
    assert isinstance(h, HealthAnnouncement) and h.health.mq == "down"
    assert h.health.rerouted == [4] and h.ts_ns > 0
    bad = {b"\xff\x00 not json": ("unknown", "not JSON"),
           b"[1, 2]": ("unknown", "not a JSON object"),
           json.dumps({"kind": "gossip", "ts_ns": 1}).encode(): ("unknown", "unknown kind"),
           json.dumps({"kind": "policy", "version": "x", "hash": "h", "ts_ns": 1}).encode():
               ("policy", "version"),
           json.dumps({"kind": "policy", "version": True, "hash": "h", "ts_ns": 1}).encode():
               ("policy", "version"),
           json.dumps({"kind": "policy", "version": 2, "hash": "", "ts_ns": 1}).encode():
               ("policy", "hash"),
           json.dumps({"kind": "health", "session_id": "s", "health": {"mq": "maybe"},
                       "ts_ns": 1}).encode(): ("health", "health"),
           json.dumps({"kind": "health", "health": {}, "ts_ns": 1}).encode():
               ("health", "session_id")}
    for data, (kind, what) in bad.items():
        with pytest.raises(MalformedAnnouncement, match=what) as e:
            decode(data)
        assert e.value.kind == kind


def test_a_policy_announcement_names_its_store():
    """``policy`` says which store swapped; an announcement without it (an older server) is
    the static one's; any other value is malformed."""
    p = decode(encode("policy", policy="online", version=2, hash="cd" * 32))
    assert isinstance(p, PolicyAnnouncement) and (p.policy, p.version) == ("online", 2)
    old = decode(json.dumps({"kind": "policy", "version": 1, "hash": "h", "ts_ns": 1}).encode())
    assert isinstance(old, PolicyAnnouncement) and old.policy == "static"
    with pytest.raises(MalformedAnnouncement, match="policy must be one of"):
        decode(json.dumps({"kind": "policy", "policy": "both", "version": 1, "hash": "h",
                           "ts_ns": 1}).encode())


def test_online_swaps_reach_the_listeners_and_the_announcer(tmp_path):
    """The online store has the static one's listeners (one store for both kinds): every swap
    is heard, a reload of the same bundle is not; with no producer yet the announcer keeps
    the latest announcement of each store, so neither hides the other."""
    pytest.importorskip("pulsar")
    from serving.announce import Announcer
    from serving.policy_store import OnlinePolicyStore

    from .conftest import export_tiny_online_bundle

    a = export_tiny_online_bundle(tmp_path / "a", None)
    b = export_online_bundle_seeded(tmp_path / "b")
    store, seen = OnlinePolicyStore(), []
    store.add_listener(lambda p: seen.append((p.version, p.hash)))
    store.load(a)
    store.load(b)
    store.load(b, allow_rollback=True)       # the same bundle again: the same version
    assert [v for v, _ in seen] == [1, 2] and seen[0][1] != seen[1][1]
    ann = Announcer(f"pulsar://127.0.0.1:{free_ports(1)[0]}", _topic(), retry_s=5.0,
                    max_retry_s=5.0, security=Security(insecure=True))
    try:
        ann.policy(SimpleNamespace(version=7, hash="ab" * 32))
        ann.online_policy(store.current())
        assert {k: decode(v).version for k, v in ann._deferred.items()} == {"static": 7,
                                                                             "online": 2}
        with pytest.raises(ValueError, match="which must be one of"):
            ann.policy(store.current(), "both")
    finally:
        ann.close()


def export_online_bundle_seeded(directory, seed: int = 1):
    """Another online bundle than :func:`tests.conftest.export_tiny_online_bundle`'s."""
    torch = pytest.importorskip("torch")
    from agents.bundle_export import export_online_bundle
    from envs.dsmd.online import OnlineCost
    from envs.dsmd.online_control import OBS_SIZE, KnobMap

    torch.manual_seed(seed)
    actor = torch.nn.Sequential(torch.nn.Linear(OBS_SIZE, 3), torch.nn.Tanh())
    return export_online_bundle(actor, KnobMap(), OnlineCost(), directory)


def test_a_static_adapter_ignores_an_online_swap():
    from serving.client.static import ControllerAdapter

    asked = []
    me = SimpleNamespace(mode="cached", _cached=(None, 0),
                         request_refresh=lambda: asked.append(1))
    online = PolicyAnnouncement(3, "ef" * 32, 1, "online")
    static = PolicyAnnouncement(3, "ef" * 32, 1, "static")
    assert ControllerAdapter._on_policy_announced(me, online) is False and asked == []
    assert ControllerAdapter._on_policy_announced(me, static) is True and asked == [1]


def test_settings_are_checked(monkeypatch):
    check_settings(None, "")  # no URL: nothing to check
    with pytest.raises(AnnounceError, match=r"announce\.url must be a Pulsar service URL"):
        ServerSettings(auth=False, announce_url="http://127.0.0.1:6650")
    with pytest.raises(AnnounceError, match=r"announce\.topic"):
        ServerSettings(auth=False, announce_url="pulsar://127.0.0.1:6650", announce_topic=" ")
    monkeypatch.setitem(sys.modules, "pulsar", None)  # as if the serve extra lacked it
    with pytest.raises(AnnounceError, match=r"announce\.url is set .*pip install"):
        ServerSettings(auth=False, announce_url="pulsar://127.0.0.1:6650")
    ServerSettings(auth=False)  # without a URL the client is not needed


def test_policy_listeners_never_fail_a_swap(tiny_bundles):
    store, seen = PolicyStore(), []

    def broken(p):
        raise RuntimeError("listener bug")

    store.add_listener(broken)
    store.add_listener(lambda p: seen.append(p.version))
    assert store.load(tiny_bundles["a"]).version == 1
    store.remove_listener(broken)
    store.load(tiny_bundles["b"])
    assert seen == [1, 2] and store.current().version == 2


def test_broker_away(tiny_problems, tiny_bundles, tmp_path):
    """The announcement broker is away (a closed port): the server starts, a swap answers
    quickly, and adapters subscribed to the same dead address get the new version by
    polling."""
    pytest.importorskip("pulsar")
    ps = tiny_problems
    dead = f"pulsar+ssl://127.0.0.1:{free_ports(1)[0]}"
    topic = _topic()
    srv = _server(tiny_bundles["a"], tmp_path, dead, topic).start()
    try:
        ads = [_adapter(ps, srv.url, "cached", tmp_path, i, refresh_s=0.3, announce_url=dead,
                        announce_topic=topic) for i in range(3)]
        for ad in ads:
            replay_window(ad, ps, ps.windows["test"][0])
        assert _versions(ads) == [1, 1, 1]
        t0 = time.perf_counter()
        r = _put(srv, tiny_bundles["b"])
        assert r.status_code == 200 and r.json()["version"] == 2
        assert time.perf_counter() - t0 < 1.0
        _wait_for_version(ads, 2, t0, 10.0)
        assert not any(ad.subscriber.ready for ad in ads)
        # the start-up load and the swap: held for a producer that never came
        assert _metric(srv, "policy", "deferred") == 2
        # channel health reaches a cached adapter of the session by polling too
        remote = _adapter(ps, srv.url, "remote", tmp_path, "r", timeout_s=2.0)
        ads.append(remote)
        replay_window(remote, ps, ps.windows["test"][0])
        remote.decide(replan=True)
        ads.append(_adapter(ps, srv.url, "cached", tmp_path, "h", refresh_s=0.3,
                            session_id=remote.session_id, announce_url=dead,
                            announce_topic=topic))
        health = {"mq": "down", "since_ns": 1, "rerouted": [3], "waiting": [],
                  "unreachable": [], "relayed": []}
        remote.set_channel_health(health)
        wait_until(lambda: ads[-1].decide(replan=True) and ads[-1].channel_health is not None
                   and ads[-1].channel_health.model_dump() == health, 10,
                   "the polled health at the cached adapter")
        assert _metric(srv, "health", "unavailable") == 1
        t0 = time.perf_counter()
        for ad in ads:
            ad.close()
        assert time.perf_counter() - t0 < 5.0  # closing does not wait for the broker
    finally:
        srv.stop()


# ---------------------------------------------------------------------- a real broker
@pytest.fixture(scope="module")
def announcing(pulsar_broker, tiny_bundles, tmp_path_factory):
    """One server announcing on a topic of the real broker, shared by the tests below (each
    swaps to the other tiny bundle and waits for that version): (server, broker URL,
    topic). The topic is this module's own: the ``policy-server`` role is granted produce
    on it (the broker grants the default announcement topic only)."""
    topic = _topic()
    grant_default_roles(pulsar_broker.admin_url, Security(), announce_topics=[topic])
    srv = _server(tiny_bundles["a"], tmp_path_factory.mktemp("announcing"),
                  pulsar_broker.service_url, topic).start()
    try:
        yield srv, pulsar_broker.service_url, topic
    finally:
        srv.stop()


def test_cached_adapters_refresh_on_announcement(announcing, tiny_problems, tiny_bundles,
                                                 tmp_path):
    """8 cached adapters that would poll only every 600 s decide with a swapped-in version
    within 3 s of the PUT."""
    ps = tiny_problems
    srv, url, topic = announcing
    ads: list[ControllerAdapter] = []
    try:
        ads = [_adapter(ps, srv.url, "cached", tmp_path, i, refresh_s=600, announce_url=url,
                        announce_topic=topic) for i in range(8)]
        for ad in ads:
            replay_window(ad, ps, ps.windows["test"][0])
            assert ad.subscriber.wait_ready(30)
        v = _current(srv)
        assert _versions(ads) == [v] * 8
        sent = _metric(srv, "policy", "sent")
        t0 = time.perf_counter()
        v = _swap(srv, tiny_bundles)
        took = _wait_for_version(ads, v, t0, 3.0)
        assert len({ad.policy.content_hash for ad in ads}) == 1
        assert all(ad.subscriber.counts[("policy", "applied")] == 1 for ad in ads)
        wait_until(lambda: _metric(srv, "policy", "sent") == sent + 1, 5,
                   "the announcement counted as sent")
        print(f"last of 8 adapters on v{v} {took:.2f} s after the PUT")
    finally:
        for ad in ads:
            ad.close()


def test_malformed_announcements_are_ignored(announcing, tiny_problems, tiny_bundles,
                                             tmp_path):
    """Raw bytes, an unknown kind and a version of the wrong type are ignored and counted;
    the subscriber keeps going and the next valid announcement works."""
    import pulsar

    ps = tiny_problems
    srv, url, topic = announcing
    client = pulsar.Client(url, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error),
                           **client_args(Security(), "controller"))
    ad = _adapter(ps, srv.url, "cached", tmp_path, "m", refresh_s=600, announce_url=url,
                  announce_topic=topic)
    try:
        replay_window(ad, ps, ps.windows["test"][0])
        assert ad.subscriber.wait_ready(30)
        producer = client.create_producer(topic)
        for data in (b"\x00\xff raw bytes",
                     json.dumps({"kind": "gossip", "ts_ns": 1}).encode(),
                     json.dumps({"kind": "policy", "version": "x", "hash": "h",
                                 "ts_ns": 1}).encode()):
            producer.send(data)
        producer.close()
        counts = ad.subscriber.counts
        wait_until(lambda: counts[("unknown", "malformed")] == 2
                   and counts[("policy", "malformed")] == 1, 10,
                   lambda: f"the malformed messages counted ({dict(counts)})")
        assert ad.subscriber.ready
        t0 = time.perf_counter()
        v = _swap(srv, tiny_bundles)
        _wait_for_version([ad], v, t0, 3.0)
        assert counts[("policy", "applied")] == 1
    finally:
        ad.close()
        client.close()


def test_an_online_swap_is_announced(announcing, tiny_problems, tmp_path):
    """An online policy swapped in on the server (``PUT /v1/online/policy``) is announced
    like a static one, naming its store: a subscriber hears it, and a cached static adapter
    leaves its own policy alone."""
    ps = tiny_problems
    srv, url, topic = announcing
    bundle = export_online_bundle_seeded(tmp_path / "online")
    ad = _adapter(ps, srv.url, "cached", tmp_path, "o", refresh_s=600, announce_url=url,
                  announce_topic=topic)
    try:
        replay_window(ad, ps, ps.windows["test"][0])
        assert ad.subscriber.wait_ready(30)
        before, sent = ad.policy.content_hash, _metric(srv, "policy", "sent")
        r = httpx.put(srv.url + "/v1/online/policy", verify=srv.verify, timeout=30,
                      json={"path": str(bundle), "allow_rollback": True},
                      headers={"X-API-Key": ADMIN})
        assert r.status_code == 200, r.text
        counts = ad.subscriber.counts
        wait_until(lambda: counts[("policy", "ignored")] == 1, 10,
                   lambda: f"the online announcement heard ({dict(counts)})")
        wait_until(lambda: _metric(srv, "policy", "sent") == sent + 1, 5,
                   "the announcement counted as sent")
        assert ad.policy.content_hash == before and counts[("policy", "applied")] == 0
    finally:
        ad.close()


def test_a_cached_online_adapter_refreshes_on_announcement(announcing, tmp_path):
    """A cached online adapter that would poll only every 600 s fetches an online policy
    swapped in on the server within seconds of the PUT, and decides with it from the next
    boundary."""
    from envs.dsmd.dataset import build_dataset, load_dataset_spec
    from serving.client.online import OnlineAdapter

    srv, url, topic = announcing
    ds = build_dataset(load_dataset_spec("tiny_online"), tmp_path / "datasets")
    topology = ds.load(ds.traces("test")[0].id).topology
    bundles = [export_online_bundle_seeded(tmp_path / f"b{k}", seed=10 + k) for k in (0, 1)]
    ad = OnlineAdapter(topology, ds.scenario, base_url=srv.url, api_key=KEY, mode="cached",
                       refresh_s=600, cache_dir=tmp_path / "cache", announce_url=url,
                       announce_topic=topic)
    try:
        assert ad.subscriber is not None and ad.subscriber.wait_ready(30)
        ad.plan()                                     # the first boundary
        had = ad._bundle[0]
        fresh = next(b for b in bundles
                     if had is None or json.loads((b / "metadata.json").read_text())
                     ["actor_sha256"] != had.metadata["actor_sha256"])
        want = json.loads((fresh / "metadata.json").read_text())["actor_sha256"]
        r = httpx.put(srv.url + "/v1/online/policy", verify=srv.verify, timeout=30,
                      json={"path": str(fresh), "allow_rollback": True},
                      headers={"X-API-Key": ADMIN})
        assert r.status_code == 200, r.text
        wait_until(lambda: ad._bundle[0] is not None
                   and ad._bundle[0].metadata["actor_sha256"] == want, 10,
                   "the announced online bundle fetched")
        assert ad.subscriber.counts[("policy", "applied")] == 1
        ad.close_interval()
        ad.plan()                                     # the next boundary decides with it
        assert ad.policy_version == int(r.json()["version"])
    finally:
        ad.close()


def test_channel_health_through_the_session(announcing, tiny_problems, tmp_path):
    """Health set at a remote adapter is stored with the server's session (GET) and reaches
    a cached adapter of the same session by announcement; bad input is refused naming the
    field and changes nothing."""
    ps = tiny_problems
    srv, url, topic = announcing
    w0, w1 = ps.windows["test"][:2]
    remote = _adapter(ps, srv.url, "remote", tmp_path, "r", timeout_s=2.0)
    cached = None
    try:
        replay_window(remote, ps, w0)
        remote.decide(replan=True)
        sid = remote.session_id
        cached = _adapter(ps, srv.url, "cached", tmp_path, "c", refresh_s=600, session_id=sid,
                          announce_url=url, announce_topic=topic)
        assert cached.channel_health is None and cached.subscriber.wait_ready(30)
        node = int(ps.dataset.topology.node_ids[0])
        health = {"mq": "down", "since_ns": time.time_ns(), "rerouted": [0, 1], "waiting": [2],
                  "unreachable": [node], "relayed": [node]}
        remote.set_channel_health(health)
        assert remote.channel_health.model_dump() == health
        got = httpx.get(f"{srv.url}/v1/sessions/{sid}", verify=srv.verify,
                        headers={"X-API-Key": KEY},
                        timeout=5).json()
        assert got["channel_health"] == health
        wait_until(lambda: cached.channel_health is not None, 3,
                   "the health announcement at the cached adapter")
        assert cached.channel_health.model_dump() == health
        assert cached.subscriber.counts[("health", "applied")] == 1
        wait_until(lambda: _metric(srv, "health", "sent") >= 1, 5, "the sent announcement")
        assert remote.subscriber is None  # a remote adapter needs no subscription

        for bad, field in (({"mq": "sideways"}, "channel_health.mq"),
                           ({"rerouted": [-1]}, "channel_health.rerouted.0"),
                           ({"bogus": 1}, "channel_health.bogus"),
                           ({"unreachable": [10**9]}, "channel_health.unreachable"),
                           ("down", "channel_health must be a mapping")):
            with pytest.raises(AdapterError, match=field):
                remote.set_channel_health(bad)
        assert remote.channel_health.model_dump() == health
        r = httpx.patch(f"{srv.url}/v1/sessions/{sid}", verify=srv.verify,
                        headers={"X-API-Key": KEY}, timeout=5,
                        json={"types": [{"id": 10**6, "destinations": [node]}],
                              "channel_health": {"unreachable": [10**9]}})
        assert r.status_code == 409 and "channel_health.unreachable" in r.text
        got = httpx.get(f"{srv.url}/v1/sessions/{sid}/health", verify=srv.verify,
                        headers={"X-API-Key": KEY},
                        timeout=5).json()
        assert got["channel_health"] == health  # nothing stored from the refused update
        snap = httpx.get(f"{srv.url}/v1/sessions/{sid}", verify=srv.verify,
                         headers={"X-API-Key": KEY},
                         timeout=5).json()
        assert all(t["id"] != 10**6 for t in snap["types"])

        # the next interval re-creates the server's session: the health goes with it
        replay_window(remote, ps, w1)
        remote.decide(replan=True)
        assert remote.session_id != sid
        got = httpx.get(f"{srv.url}/v1/sessions/{remote.session_id}/health", verify=srv.verify,
                        headers={"X-API-Key": KEY}, timeout=5).json()
        assert got["channel_health"] == health
    finally:
        remote.close()
        if cached is not None:
            cached.close()
