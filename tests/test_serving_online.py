"""Online serving (``/v1/online``, :mod:`serving.online_session`, the online adapter) against
the simulator: replaying the test traces of ``tiny_online`` message by message through the
real server (``serve.py`` under uvicorn on a free loopback port) and through the adapter in
both modes gives exactly the plans, channels and interval costs of
``OnlineSimulator(trace, cost).run(bundle.decider())``; the adapter's trace log imports as a
dataset trace that replays the same; bad requests get 4xx answers that say what is wrong."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from envs.dsmd.dataset import build_dataset, import_traces, load_dataset_spec
from envs.dsmd.message import messages_from_trace
from envs.dsmd.online import OnlineCost, OnlineSimulator, OnlineTrace
from envs.dsmd.online_control import FEATURES, OBS_SIZE, KnobMap
from envs.netutil import free_ports
from serving.app import ServerSettings, create_app
from serving.client.online import OnlineAdapter, online_session_body
from serving.local import LocalServer
from serving.online_schemas import MessageIn
from serving.online_session import OnlineSession, fallback_decider

KEY, ADMIN = (f"{n}-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0" for n in ("online-key", "online-admin"))
FORECASTER = Path(__file__).parents[1] / "results/forecaster/send_forecaster.npz"
H, HA = {"X-API-Key": KEY}, {"X-API-Key": ADMIN}


@pytest.fixture(scope="module")
def online(tmp_path_factory):
    """``tiny_online`` built into a temporary directory, its traces parsed, and an online
    bundle exported from a seeded (untrained) tanh actor, with each trace's expected run."""
    torch = pytest.importorskip("torch")
    from agents.bundle_export import export_online_bundle
    from serving.bundles.online import load_online_bundle

    root = tmp_path_factory.mktemp("online")
    ds = build_dataset(load_dataset_spec("tiny_online"), root / "datasets")
    cost = OnlineCost(w_subscribe=0.01, w_move=0.05)  # moves and subscriptions matter
    torch.manual_seed(0)
    actor = torch.nn.Sequential(torch.nn.Linear(OBS_SIZE, 3), torch.nn.Tanh())
    reads = tuple(f for f in FEATURES if f != "rpc_sends_load_q")  # the bundle's mask
    # the executor's fixed arguments: the forecaster's drop rule inside the reserve
    fixed = {"reserve_placements": True, "send_forecaster": str(FORECASTER), "drop": 0.2}
    path = export_online_bundle(actor, KnobMap(features=reads, fixed=fixed), cost,
                                root / "bundle")
    bundle = load_online_bundle(path)
    # the executor reads the forecaster from the bundle's verified private copy
    assert bundle.knob_map.fixed == {**fixed, "send_forecaster": str(bundle.verified.root
                                                                   / FORECASTER.name)}
    traces = {}
    for rec in ds.traces("all"):
        data = ds.load(rec.id)
        tr = OnlineTrace.from_dataset(data, ds.scenario, rec.id)
        traces[rec.id] = SimpleNamespace(id=rec.id, split=rec.split, data=data, trace=tr,
                                         messages=messages_from_trace(data.trace))
    assert bundle.knob_map.features == reads
    # held out: the test traces, and the validation ones for more moves and returning types
    return SimpleNamespace(ds=ds, bundle_dir=path, bundle=bundle, cost=cost, traces=traces,
                           test=[t for t in traces.values() if t.split == "test"],
                           held_out=[t for t in traces.values()
                                     if t.split in ("test", "validation")])


def expected(online, t, decider=None):
    """The simulator's run of trace ``t``: (results, knobs of every interval)."""
    dec = decider or online.bundle.decider()
    res = OnlineSimulator(t.trace, online.cost).run(dec)
    return res, getattr(dec, "knobs_used", None)


def rows_of(t, w: int) -> np.ndarray:
    return np.flatnonzero(t.trace.parsed.message_window == w)


def channel_in(res, t, w: int) -> dict[int, int]:
    """Type -> channel of the types that sent in interval ``w``, as the simulator scored it."""
    return dict(zip(t.trace.realised(w).catalog_index.tolist(), res[w].channel.tolist()))


def assert_interval(closed, res, t, w: int) -> None:
    """A closed interval (engine ``Closed`` or the server's JSON) equals the simulator's."""
    if isinstance(closed, dict):
        types, chans, terms = closed["types"], closed["channels"], closed["terms"]
        assert closed["window"] == w
    else:
        types, chans, terms = closed.types.tolist(), closed.channels.tolist(), closed.terms
        assert closed.window == w
    assert types == t.trace.realised(w).catalog_index.tolist()
    assert chans == res[w].channel.tolist(), f"{t.id} interval {w}"
    assert terms == res[w].as_dict(), f"{t.id} interval {w}"


@pytest.fixture(scope="module")
def server(online, tmp_path_factory):
    s = LocalServer(None, tmp_path_factory.mktemp("server"), api_key=KEY, admin_key=ADMIN,
                    overrides=[f"online_bundle={online.bundle_dir}"])
    try:
        yield s.start()
    finally:
        s.stop()


def test_engine_equals_the_simulator_on_every_trace(online):
    """The session engine alone, messages one by one or in chunks, on all six traces."""
    for i, t in enumerate(online.traces.values()):
        res, knobs = expected(online, t)
        s = OnlineSession(online.ds.scenario, t.data.topology, decider=online.bundle.decider(),
                          cost=online.cost, start_ns=t.data.meta["start_ns"], name=t.id)
        for w in range(t.trace.num_windows):
            if w % 2 == 0:  # else the first submit (or the close) plans it
                assert s.begin().knobs == knobs[w]
            rows = rows_of(t, w)
            for part in np.array_split(rows, 1 + (i + w) % 4):
                if part.size:
                    s.submit([t.messages[r] for r in part])
            assert_interval(s.close(), res, t, w)


def test_the_bundle_carries_its_forecaster(online, tmp_path):
    """The forecaster travels in the bundle (hashed and signed); one changed, missing, or
    named otherwise is refused, naming it; the bundle's decider is the teacher-shaped
    executor with the bundle's copy."""
    from serving.bundles.online import load_online_bundle
    from serving.bundles.signing import SignatureError, sign_bundle
    from serving.bundles.static import BundleError, sha256_file

    b = online.bundle
    assert b.metadata["version"] == 2 and "send_forecaster.npz" in b.metadata["files"]
    assert "send_forecaster.npz" in b.files
    assert b.metadata["knob_map"]["fixed"]["send_forecaster"] == "send_forecaster.npz"
    ex = b.knob_map.build(online.cost)
    assert ex.drop == 0.2 and ex.reserve_placements and ex._forecaster is not None

    def copy(name: str) -> Path:
        d = tmp_path / name
        shutil.copytree(online.bundle_dir, d)
        return d

    d = copy("changed")
    raw = bytearray((d / "send_forecaster.npz").read_bytes())
    raw[-1] ^= 1
    (d / "send_forecaster.npz").write_bytes(bytes(raw))
    with pytest.raises(SignatureError, match=r"send_forecaster\.npz"):
        load_online_bundle(d)
    d = copy("missing")
    (d / "send_forecaster.npz").unlink()
    with pytest.raises((BundleError, SignatureError), match=r"send_forecaster\.npz"):
        load_online_bundle(d)
    # signed as it is, but not a forecaster: refused on load, not at the first boundary
    d = copy("garbage")
    (d / "send_forecaster.npz").write_bytes(b"not an npz")
    meta = json.loads((d / "metadata.json").read_text())
    meta["files"]["send_forecaster.npz"] = sha256_file(d / "send_forecaster.npz")
    (d / "metadata.json").write_text(json.dumps(meta))
    sign_bundle(d)
    with pytest.raises(BundleError, match=r"executor cannot be built.*not a readable \.npz"):
        load_online_bundle(d)


def test_server_serves_the_simulators_plans_and_costs(server, online):
    with httpx.Client(base_url=server.url, verify=server.verify, headers=H, timeout=30) as c:
        for t in online.held_out:
            res, knobs = expected(online, t)
            body = online_session_body(t.data.topology, online.ds.scenario,
                                       start_ns=t.data.meta["start_ns"], name=t.id)
            r = c.post("/v1/online/sessions", json=body)
            assert r.status_code == 201, r.text
            assert r.json()["policy_version"] == 1 and r.json()["cost"] == online.cost.as_dict()
            sid = r.json()["session_id"]
            base = f"/v1/online/sessions/{sid}/intervals"
            for w in range(t.trace.num_windows):
                p = c.get(f"{base}/{w}/plan").json()
                assert p["source"] == "policy" and p["policy_version"] == 1
                assert p["knobs"] == {k: None if math.isinf(v) else v
                                      for k, v in knobs[w].items()}  # null: infinite
                assert len(p["observation"]) == OBS_SIZE
                assert c.get(f"{base}/{w}/plan").json() == p  # asked twice: the same plan
                want = channel_in(res, t, w)
                rows = rows_of(t, w)
                for part in np.array_split(rows, max(1, rows.size // 7)):
                    if not part.size:
                        continue
                    r = c.post(f"{base}/{w}/messages", json={
                        "messages": [MessageIn.of(t.messages[i]) for i in part]})
                    assert r.status_code == 200, r.text
                    out = r.json()
                    assert out["types"] == t.trace.parsed.message_type[part].tolist()
                    assert out["channels"] == [want[k] for k in out["types"]]
                    assert all(pl["source"] == "policy" for pl in out["placed"])
                r = c.post(f"{base}/{w}/close")
                assert r.status_code == 200, r.text
                assert_interval(r.json(), res, t, w)
                assert r.json()["next_window"] == w + 1
            s = c.get(f"/v1/online/sessions/{sid}").json()
            assert s["window"] == t.trace.num_windows and s["num_types"] == t.trace.num_types
            assert s["last"] == res[-1].as_dict()
            assert c.delete(f"/v1/online/sessions/{sid}").status_code == 204


def replay(ad: OnlineAdapter, t, res, knobs, source: str = "policy") -> None:
    for w in range(t.trace.num_windows):
        p = ad.plan()
        assert p.source == source and (knobs is None or p.knobs == knobs[w])
        want = channel_in(res, t, w)
        for r in rows_of(t, w):
            assert ad.submit(t.messages[r]) == want[int(t.trace.parsed.message_type[r])]
        assert_interval(ad.close_interval(), res, t, w)


def test_cached_adapter_decides_as_the_simulator_and_logs_a_dataset_trace(server, online,
                                                                         tmp_path):
    for t in online.held_out:
        res, knobs = expected(online, t)
        with OnlineAdapter(t.data.topology, online.ds.scenario, base_url=server.url,
                           api_key=KEY, mode="cached", start_ns=t.data.meta["start_ns"],
                           cache_dir=tmp_path / "cache", trace_log=True, name=t.id) as ad:
            assert ad.engine.cost == online.cost  # the fetched bundle's
            replay(ad, t, res, knobs)
            assert ad.policy_version == 1
            n = ad.flush_trace(tmp_path / "live" / t.id)
        assert n == len(t.messages)
        # the log is a dataset trace: imported, it loads as the trace the session served
        ds2 = import_traces(tmp_path / "imported", f"live-{t.id}",
                            {"test": [tmp_path / "live" / t.id]}, online.ds.scenario)
        data2 = ds2.load(t.id)
        for col in ("message_id", "timestamp_ns", "size_bytes", "vpc_id",
                    "configuration_type", "hosts_indptr", "hosts"):
            assert np.array_equal(getattr(data2.trace, col), getattr(t.data.trace, col)), col
        tr2 = OnlineTrace.from_dataset(data2, ds2.scenario, t.id)
        assert (tr2.num_windows, tr2.num_types) == (t.trace.num_windows, t.trace.num_types)
        res2 = OnlineSimulator(tr2, online.cost).run(online.bundle.decider())
        assert [r.channel.tolist() for r in res2] == [r.channel.tolist() for r in res]
        assert [r.as_dict() for r in res2] == [r.as_dict() for r in res]


def test_remote_adapter_asks_the_server(server, online):
    """Including after the server lost the session (deleted here, as a restart would): the
    adapter opens a new one, restores the history there and the policy goes on."""
    t = online.test[0]
    res, knobs = expected(online, t)
    with OnlineAdapter(t.data.topology, online.ds.scenario, base_url=server.url, api_key=KEY,
                       mode="remote", start_ns=t.data.meta["start_ns"], cost=online.cost,
                       chunk=16, name=t.id) as ad:
        first, lost = None, 10
        for w in range(t.trace.num_windows):
            if w == lost:
                first = ad.session_id
                assert httpx.delete(f"{server.url}/v1/online/sessions/{first}",
                                    verify=server.verify, headers=H).status_code == 204
            assert ad.plan().knobs == knobs[w]
            assert ad.plan().source == "policy" and ad.reason is None
            want = channel_in(res, t, w)
            for r in rows_of(t, w):
                assert ad.submit(t.messages[r]) == want[int(t.trace.parsed.message_type[r])]
            assert_interval(ad.close_interval(), res, t, w)
        assert ad.session_id != first and ad.policy_version == 1
        s = httpx.get(f"{server.url}/v1/online/sessions/{ad.session_id}", verify=server.verify,
                      headers=H).json()
        assert s["window"] == t.trace.num_windows and s["last"] == res[-1].as_dict()


class _Switch:
    """The fallback decider for the intervals before ``k``, then the policy."""

    name = "switch"

    def __init__(self, fallback, policy, k: int) -> None:
        self.fallback, self.policy, self.k, self.cur = fallback, policy, k, fallback

    def reset(self, seed=None) -> None:
        self.fallback.reset()
        self.policy.reset()

    def plan(self, view):
        self.cur = self.fallback if view.window < self.k else self.policy
        return self.cur.plan(view)

    def place(self, view, new, placement):
        return self.cur.place(view, new, placement)


def test_remote_adapter_falls_back_then_restores_the_server_session(server, online):
    """Server unreachable for the first intervals: the fallback decides (and says so); when
    it answers, the adapter restores the history there and the policy decides again, all
    exactly as the simulator with that sequence of deciders."""
    t, k = online.test[0], 6
    res, _ = expected(online, t, _Switch(fallback_decider(online.cost),
                                         online.bundle.decider(), k))
    dead = f"https://127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
    with OnlineAdapter(t.data.topology, online.ds.scenario, base_url=dead, api_key=KEY,
                       mode="remote", start_ns=t.data.meta["start_ns"], cost=online.cost,
                       timeout_s=1.0, breaker_failures=2, breaker_reset_s=0.05,
                       name=t.id) as ad:
        for w in range(t.trace.num_windows):
            if w == k:  # the server answers again
                ad._client._http.base_url = httpx.URL(server.url)
                time.sleep(0.06)  # the breaker half-opens
            p = ad.plan()
            assert p.source == ("fallback" if w < k else "policy"), w
            assert (ad.reason is None) == (w >= k)
            want = channel_in(res, t, w)
            for r in rows_of(t, w):
                assert ad.submit(t.messages[r]) == want[int(t.trace.parsed.message_type[r])]
            assert_interval(ad.close_interval(), res, t, w)
        s = httpx.get(f"{server.url}/v1/online/sessions/{ad.session_id}", verify=server.verify,
                      headers=H).json()
        assert s["window"] == t.trace.num_windows and s["last"] == res[-1].as_dict()


def test_bad_requests_say_what_is_wrong(server, online):
    t = online.test[0]
    msgs = t.messages
    body = online_session_body(t.data.topology, online.ds.scenario,
                               start_ns=t.data.meta["start_ns"])
    with httpx.Client(base_url=server.url, verify=server.verify, headers=H, timeout=30) as c:
        def err(r, code: int, *words: str) -> None:
            assert r.status_code == code, (r.status_code, r.text)
            text = str(r.json()["detail"])
            for wd in words:
                assert wd in text, (wd, text)

        err(httpx.post(f"{server.url}/v1/online/sessions", verify=server.verify,
                       json=body), 401, "API key")
        err(c.put("/v1/online/policy", json={"path": str(online.bundle_dir)}), 403, "admin")
        err(c.put("/v1/online/policy", json={"path": "/nonexistent"}, headers=HA), 409,
            "metadata.json is missing")
        err(c.get("/v1/online/sessions/nope/intervals/0/plan"), 404, "nope")
        no_scenario = {k: v for k, v in body.items() if k != "scenario"}
        err(c.post("/v1/online/sessions", json=no_scenario), 409,
            "controller, num_topics, interval_s must be given")
        err(c.post("/v1/online/sessions", json=body | {"num_topics": 5}), 409,
            "num_topics 5 disagrees with the scenario's 2")
        err(c.post("/v1/online/sessions", json=no_scenario | {"dataset": "nope"}), 409,
            "unknown dataset 'nope'")
        # a client sets weights, never the server's delay model (no file is read for it)
        err(c.post("/v1/online/sessions", json=body | {"cost": {"delay_model": 1.0}}), 409,
            "unknown online cost weights ['delay_model']")
        r = c.post("/v1/online/sessions", json=body | {"cost": {"w_delay": 2.0}})
        assert r.status_code == 201 and r.json()["cost"]["w_delay"] == 2.0
        assert r.json()["cost"]["delay"] == online.cost.delay.to_dict()
        r = c.post("/v1/online/sessions", json=no_scenario | {"dataset": "tiny_online"})
        assert r.status_code == 201 and r.json()["scenario"] == online.ds.scenario.to_dict()
        sid = c.post("/v1/online/sessions", json=body).json()["session_id"]
        base = f"/v1/online/sessions/{sid}/intervals"

        def post(w: int, *ms, **kw):
            return c.post(f"{base}/{w}/messages", json={"messages": [
                MessageIn.of(m) | kw for m in ms]})

        err(c.get(f"{base}/1/plan"), 409, "interval 1 is out of order", "interval 0")
        err(c.post(f"{base}/2/close"), 409, "interval 2 is out of order")
        first = rows_of(t, 0)
        m0 = msgs[first[0]]
        m1 = next(msgs[r] for r in first if msgs[r].timestamp_ns > m0.timestamp_ns)
        m9 = msgs[first[-1]]  # interval 0's last message, sent after interval 0 closed
        late = msgs[rows_of(t, 2)[0]]
        assert m9.message_id not in (m0.message_id, m1.message_id)
        err(post(0, m0, late), 409, "falls in interval 2; close interval 0 first",
            f"message_id {late.message_id}")
        err(post(0, m0, hosts=[999_999]), 409, "unknown destination node 999999")
        err(post(0, m0, hosts=[m0.hosts[0], m0.hosts[0]]), 409, "listed twice")
        err(post(0, m0, configuration_type="VLAN"), 422, "configuration_type must be one of")
        err(post(0, m0, m0), 409, f"message_id {m0.message_id} was already sent")
        err(post(0, m1, m0), 409, "earlier than the previous message's")
        r = c.post(f"{base}/0/messages", json={"messages": [MessageIn.of(m1)],
                                              "placements": [{"type": 7, "channel": 1}]})
        err(r, 409, "placement was given for type 7")
        # none of that changed the session: interval 0 still takes its first messages
        s = c.get(f"/v1/online/sessions/{sid}").json()
        assert s["window"] == 0 and s["num_types"] == 0
        assert post(0, m0, m1).status_code == 200
        err(post(0, m0), 409, "was already sent")
        err(c.put(f"{base}/0/plan", json={"plan": []}), 409, "interval 0 is already planned")
        assert c.post(f"{base}/0/close").status_code == 200
        err(c.put(f"{base}/1/plan", json={"plan": [{"type": 99, "channel": 0,
                                                     "expected_rate_bps": 1}]}),
            409, "planned type 99 has not been seen")
        err(c.put(f"{base}/1/plan", json={"plan": [{"type": 0, "channel": 3,
                                                     "expected_rate_bps": 1}]}),
            409, "outside 0..2")
        err(post(1, m9), 409, "falls in interval 0, which is closed")


def test_without_an_online_policy(online):
    """In process: sessions open, but nothing plans until a bundle is loaded (409 that says
    so); a PUT loads one and plans follow."""
    t = online.test[0]
    app = create_app(ServerSettings(auth=False, freeze_gc=False))
    with TestClient(app) as c:
        assert c.get("/v1/online/policy").json()["loaded"] is False
        assert c.get("/v1/online/policy/bundle").status_code == 404
        body = online_session_body(t.data.topology, online.ds.scenario,
                                   start_ns=t.data.meta["start_ns"])
        r = c.post("/v1/online/sessions", json=body)
        assert r.status_code == 201 and r.json()["policy_version"] == 0
        sid = r.json()["session_id"]
        r = c.get(f"/v1/online/sessions/{sid}/intervals/0/plan")
        assert r.status_code == 409 and "no online policy is loaded" in r.json()["detail"]
        r = c.put("/v1/online/policy", json={"path": str(online.bundle_dir)})
        assert r.status_code == 200 and r.json()["version"] == 1
        assert r.json()["features"] == list(FEATURES)
        assert "rpc_sends_load_q" not in r.json()["knob_map"]["features"]
        p = c.get(f"/v1/online/sessions/{sid}/intervals/0/plan").json()
        assert p["source"] == "policy" and p["policy_version"] == 1
