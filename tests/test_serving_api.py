"""The policy server's API in-process (TestClient in a ``with`` block: the lifespan runs)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from fastapi.testclient import TestClient

from agents.learned import ActorPolicy
from envs.dsmd.env import DSMDEnv
from serving.app import ServerSettings, create_app
from serving.bundles.static import load_bundle
from serving.scenario import rates_body, session_body

KEY, ADMIN = (f"{n}-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0" for n in ("controller-key", "admin-key"))
H, HA = {"X-API-Key": KEY}, {"X-API-Key": ADMIN}
K2 = "k2-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0"


def app_with(bundle=None, **kw):
    s = ServerSettings(bundle=None if bundle is None else str(bundle), api_keys=[KEY],
                       admin_keys=[ADMIN], **kw)
    return create_app(s)


@pytest.fixture()
def client(tiny_bundles):
    with TestClient(app_with(tiny_bundles["a"])) as c:
        yield c


def new_session(c, ps, window=None):
    r = c.post("/v1/sessions", json=session_body(ps, window), headers=H)
    assert r.status_code == 201, r.text
    return r.json()


def test_auth_required_and_overridable(tiny_bundles, tiny_problems):
    app = app_with(tiny_bundles["a"])
    with TestClient(app) as c:
        assert c.get("/v1/policy").status_code == 401
        assert c.get("/v1/policy", headers={"X-API-Key": "wrong"}).status_code == 401
        assert c.get("/v1/policy", headers=H).json()["loaded"] is True
        # health and metrics need no key (probes, scrapers)
        assert c.get("/v1/health/live").status_code == 200
        assert c.get("/v1/health/ready").json()["policy_loaded"] is True
        # a controller key cannot swap the policy
        r = c.put("/v1/policy", json={"path": str(tiny_bundles["b"])}, headers=H)
        assert r.status_code == 403
        app.dependency_overrides[app.state.require_controller] = lambda: None
        assert c.get("/v1/policy").status_code == 200


def test_server_decides_as_the_environment(client, tiny_problems, tiny_bundles):
    """Same state, same observation and action: the server's replan equals an env episode
    with the bundle's actor, observation by observation."""
    ps = tiny_problems
    bundle = load_bundle(tiny_bundles["a"])
    env = DSMDEnv(problems=ps, split="test", observation="channel", decoding="feasible")
    sid = new_session(client, ps)["session_id"]
    for w in ps.windows["test"]:
        r = client.post(f"/v1/sessions/{sid}/rates", json=rates_body(ps.instance(w)), headers=H)
        assert r.status_code == 200 and r.json()["active_types"] == ps.instance(w).num_types
        r = client.post(f"/v1/sessions/{sid}/decide/batch",
                        json={"replan": True, "explain": True}, headers=H)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["policy_version"] == 1 and all(d["source"] == "policy"
                                                   for d in out["decisions"])
        obs, _ = env.reset(seed=0, options={"window": w})
        inst = env.inst
        for d in out["decisions"]:
            np.testing.assert_allclose(np.asarray(d["observation"], np.float32), obs)
            obs, *_ = env.step(bundle(obs))
            m = int(np.flatnonzero(inst.catalog_index == d["type"])[0])
            assert env.state.channel[m] == d["channel"]
        expected = ActorPolicy.from_bundle(bundle).assign(inst)
        got = {d["type"]: d["channel"] for d in out["decisions"]}
        assert [got[int(c)] for c in inst.catalog_index] == expected.tolist()
        # the session's view agrees
        s = client.get(f"/v1/sessions/{sid}", headers=H).json()
        chan = {t["id"]: t["channel"] for t in s["types"]}
        assert all(chan[t] == c for t, c in got.items())
        assert s["metrics"]["feasible"] in (True, False)


def test_single_decision_redecides_given_the_rest(client, tiny_problems):
    ps = tiny_problems
    w = ps.windows["test"][0]
    sid = new_session(client, ps, w)["session_id"]
    inst = ps.instance(w)
    t = int(inst.catalog_index[0])
    r = client.post(f"/v1/sessions/{sid}/decide", json={"type": t}, headers=H)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["type"] == t and 0 <= d["channel"] <= ps.spec.num_topics
    assert d["policy_version"] == 1 and d["source"] == "policy"


def test_errors_name_what_is_wrong(tiny_problems, tiny_bundles):
    ps = tiny_problems
    with TestClient(app_with(tiny_bundles["a"], max_batch=2, max_body_bytes=200_000)) as c:
        body = session_body(ps)
        body["nodes"][0]["capacity_bps"] = -5
        r = c.post("/v1/sessions", json=body, headers=H)
        assert r.status_code == 422
        assert any(e["loc"][-1] == "capacity_bps" for e in r.json()["detail"])
        body = session_body(ps)
        body["types"][0]["destinations"] = [10**9]
        r = c.post("/v1/sessions", json=body, headers=H)
        assert r.status_code == 409 and "unknown destination node" in r.json()["detail"]
        r = c.post("/v1/sessions/nope/decide", json={"type": 0}, headers=H)
        assert r.status_code == 404 and "nope" in r.json()["detail"]
        sid = new_session(c, ps)["session_id"]
        r = c.post(f"/v1/sessions/{sid}/decide", json={"type": 0}, headers=H)
        assert r.status_code == 409 and "no rate" in r.json()["detail"]
        r = c.post(f"/v1/sessions/{sid}/rates", json={"rates": [{"type": 10**6,
                                                                 "rate_bps": 5}]}, headers=H)
        assert r.status_code == 409 and "not registered" in r.json()["detail"]
        r = c.post(f"/v1/sessions/{sid}/decide/batch", json={"types": [0, 1, 2]}, headers=H)
        assert r.status_code == 422 and "at most 2 items (max_batch)" in r.text  # maxItems
        busy = new_session(c, ps, ps.windows["test"][0])["session_id"]  # > 2 active types
        r = c.post(f"/v1/sessions/{busy}/decide/batch", json={"replan": True}, headers=H)
        assert r.status_code == 409 and "exceed max_batch 2" in r.text  # the session's state
        spec = c.get("/openapi.json").json()["components"]["schemas"]
        assert spec["DecideBatchRequest"]["properties"]["types"]["anyOf"][0]["maxItems"] == 2
        r = c.post(f"/v1/sessions/{sid}/rates", content=b"x" * 300_000,
                   headers=H | {"content-type": "application/json"})
        assert r.status_code == 413
        # nothing above changed the session
        s = c.get(f"/v1/sessions/{sid}", headers=H).json()
        assert all(t["rate_bps"] == 0 and t["channel"] == -1 for t in s["types"])
        assert c.delete(f"/v1/sessions/{sid}", headers=H).status_code == 204
        assert c.get(f"/v1/sessions/{sid}", headers=H).status_code == 404


def test_heuristic_when_no_usable_policy(tiny_problems, tiny_bundles):
    ps = tiny_problems
    w = ps.windows["test"][0]
    for bundle, reason in ((None, "no policy is loaded"),
                           (tiny_bundles["mismatched"], "policy layout has")):
        with TestClient(app_with(bundle)) as c:
            created = new_session(c, ps, w)
            assert created["policy_compatible"] is False and reason in created["reason"]
            r = c.post(f"/v1/sessions/{created['session_id']}/decide/batch", json={},
                       headers=H).json()
            assert r["decisions"] and all(d["source"] == "fallback" and reason in d["reason"]
                                          for d in r["decisions"])
            assert 'smart_fallbacks_total' in c.get("/v1/metrics", headers=HA).text


def test_hot_swap_and_refusal(client, tiny_problems, tiny_bundles):
    ps = tiny_problems
    w = ps.windows["test"][0]
    sid = new_session(client, ps, w)["session_id"]
    h1 = client.get("/v1/policy", headers=H).json()["hash"]
    r = client.put("/v1/policy", json={"path": str(tiny_bundles["mismatched"])}, headers=HA)
    # another key's session: counted, never named (tests/test_serving_hostile.py)
    assert r.status_code == 409 and sid not in r.json()["detail"]
    assert "1 session(s) of other keys do not fit it" in r.json()["detail"]
    assert client.get("/v1/policy", headers=H).json()["hash"] == h1  # the old one stays
    r = client.put("/v1/policy", json={"path": "/nowhere"}, headers=HA)
    assert r.status_code == 409 and "missing" in r.json()["detail"]
    r = client.put("/v1/policy", json={"path": str(tiny_bundles["b"])}, headers=HA)
    assert r.status_code == 200 and r.json()["version"] == 2 and r.json()["hash"] != h1
    d = client.post(f"/v1/sessions/{sid}/decide/batch", json={"replan": True},
                    headers=H).json()
    assert d["policy_version"] == 2 and d["policy_hash"] == r.json()["hash"]
    z = client.get("/v1/policy/bundle", headers=H)
    assert z.status_code == 200 and z.headers["x-policy-version"] == "2"
    text = client.get("/v1/metrics", headers=HA).text
    assert 'smart_policy_loads_total{outcome="refused"} 2.0' in text
    assert "smart_request_latency_seconds_bucket" in text and "smart_decisions_total" in text


def test_settings_refuse_unsafe_defaults():
    with pytest.raises(ValueError, match="no api_keys"):
        ServerSettings()
    with pytest.raises(ValueError, match="fallback"):
        ServerSettings(auth=False, fallback="coin")
    with pytest.raises(ValueError, match="batch_threads"):
        ServerSettings(auth=False, batch_threads=0)


def test_server_loads_bundles_with_its_batch_threads(tiny_bundles):
    """``batch_threads`` reaches every bundle the server loads, at start and when swapped;
    the command line's setting reaches the app (``serve.settings_from``)."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from serve import settings_from

    app = create_app(ServerSettings(bundle=str(tiny_bundles["a"]), auth=False,
                                    batch_threads=3))
    with TestClient(app):
        store = app.state.store
        assert store.current().bundle.batch_threads == 3
        store.load(tiny_bundles["b"])
        assert store.current().bundle.batch_threads == 3
    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "configs"),
                               version_base="1.3"):
        for over, want in (([], None), (["batch_threads=2"], 2)):
            assert settings_from(compose("serve", overrides=["auth=false", *over])
                                 ).batch_threads == want


def test_parallel_batch(client, tiny_problems, tiny_bundles):
    """Parallel mode: every observation is the environment's observation of that type in the
    batch's starting state; one-type batches decide as sequential mode does; the batch ends
    feasible wherever one-by-one decoding does."""
    from envs.dsmd.cost import CostState
    from envs.dsmd.observation import ObservationBuilder

    ps = tiny_problems
    bundle = load_bundle(tiny_bundles["a"])
    for w in ps.windows["test"] + ps.windows["validation"]:
        inst = ps.instance(w)
        seq = client.post("/v1/sessions", json=session_body(ps, w), headers=H).json()
        par = client.post("/v1/sessions", json=session_body(ps, w), headers=H).json()
        r_seq = client.post(f"/v1/sessions/{seq['session_id']}/decide/batch",
                            json={"replan": True}, headers=H).json()
        r_par = client.post(f"/v1/sessions/{par['session_id']}/decide/batch",
                            json={"replan": True, "parallel": True, "explain": True},
                            headers=H).json()
        state = CostState(inst)
        builder = ObservationBuilder(bundle.layout, inst)
        builder.reset(state)
        for d in r_par["decisions"]:
            m = int(np.flatnonzero(inst.catalog_index == d["type"])[0])
            np.testing.assert_array_equal(np.asarray(d["observation"], np.float32),
                                          builder.observe(state, m, 0.0))
        feas = [client.get(f"/v1/sessions/{x['session_id']}", headers=H).json()["metrics"]
                ["feasible"] for x in (seq, par)]
        assert feas[1] or not feas[0]
        assert {d["type"] for d in r_par["decisions"]} == {d["type"] for d in r_seq["decisions"]}
        t = int(inst.catalog_index[0])
        one = [client.post(f"/v1/sessions/{x['session_id']}/decide/batch",
                           json={"types": [t], "parallel": p}, headers=H).json()
               ["decisions"][0]["channel"] for x, p in ((seq, False), (seq, True))]
        assert one[0] == one[1]


def _undecided_snapshot(ps, **controller) -> dict:
    """A session snapshot of the first test window with every type undecided (``controller``:
    fields of the controller to change)."""
    body = session_body(ps, ps.windows["test"][0])
    snap = {k: body[k] for k in ("nodes", "num_topics", "interval_s", "scenario_signature",
                                 "seed")}
    snap["controller"] = dict(body["controller"], **controller)
    snap["types"] = [{"rate_bps": 0, "messages": 1} | t | {"channel": -1}
                     for t in body["types"]]
    return snap


def test_parallel_batch_without_controller_room_keeps_the_argmax(tiny_problems, tiny_bundles):
    """When the controller cannot carry the batch even before its first type is placed
    (here C_p = 1 send for many types), no channel ever fits, so the safety layer is skipped:
    every type keeps its highest-scoring channel, as one-by-one decoding would give it."""
    from serving.policy_store import PolicyStore
    from serving.session import Session

    ps = tiny_problems
    snap = _undecided_snapshot(ps, cpu=1)
    s = Session.from_snapshot(snap)
    policy = PolicyStore().load(tiny_bundles["a"])
    ds = s.decide(None, policy, parallel=True, explain=True)
    assert len(ds) == s.active.size > 1 and not s.metrics()["feasible"]
    for d in ds:
        assert d.source == "policy" and d.scores[d.channel] == d.scores.max()
    seq = Session.from_snapshot(snap).decide(None, policy, explain=True)
    for d in seq:
        assert d.scores[d.channel] == d.scores.max()


def test_parallel_batch_in_chunks_across_threads_decides_as_one_chunk(tiny_problems,
                                                                      tiny_bundles,
                                                                      monkeypatch):
    """A parallel batch whose observations are built and scored chunk by chunk on three
    threads (``PolicyBundle.score_rows``) gives the observations, scores and channels of one
    chunk on one thread."""
    import serving.bundles.static as bundle_mod
    from serving.policy_store import PolicyStore
    from serving.session import Session

    ps = tiny_problems
    snap = _undecided_snapshot(ps)
    runs = []
    for rows, threads in ((10**6, 1), (2, 3)):
        monkeypatch.setattr(bundle_mod, "BATCH_CHUNK_ROWS", rows * (ps.spec.num_topics + 1))
        policy = PolicyStore(batch_threads=threads).load(tiny_bundles["a"])
        s = Session.from_snapshot(snap)
        ds = s.decide(None, policy, parallel=True, explain=True)
        assert len(ds) == s.active.size > 4
        runs.append(ds)
    for a, b in zip(*runs):
        assert (a.type_id, a.channel, a.source) == (b.type_id, b.channel, b.source)
        np.testing.assert_array_equal(a.observation, b.observation)
        np.testing.assert_array_equal(a.scores, b.scores)


def test_session_positions_name_what_is_wrong(tiny_problems):
    """The batch's type list: an unregistered type, a type without a rate and a repeated
    type are refused with the reason, and nothing is decided."""
    from serving.session import Session, SessionError

    ps = tiny_problems
    snap = _undecided_snapshot(ps)
    s = Session.from_snapshot(snap)
    idle = s.type_ids[int(s.active[-1])]
    s.update_rates({idle: 0})
    active = [s.type_ids[i] for i in s.active.tolist()]
    assert idle not in active and len(active) > 1
    cases = [([active[0], 10**9], "not registered"), ([active[0], active[0]], "listed twice"),
             ([active[0], idle], "has no rate")]
    for types, why in cases:
        for parallel in (False, True):
            for given in (list, iter):  # an iterator is read whole first
                with pytest.raises(SessionError, match=why):
                    s.decide(given(types), None, parallel=parallel)
    assert (s.channel == -1).all()
    assert [d.type_id for d in s.decide([np.int64(active[1]), active[0]], None,
                                        parallel=True)] == [active[1], active[0]]


def test_parallel_argmax_passes_over_nan_scores_as_decode_does():
    """The parallel batch's row-wise argmax is ``decode_action`` row by row: a NaN score
    never wins, and ties are drawn row by row in order with the session's generator."""
    from envs.dsmd.decoding import decode_action, decode_actions

    scores = np.array([[0.1, np.nan, 0.3], [np.nan, 0.5, 0.5], [0.2, 0.2, 0.2],
                       [np.nan, np.nan, np.nan]], np.float32)
    got = decode_actions(scores, np.random.default_rng(3))
    rng = np.random.default_rng(3)
    assert got.tolist() == [decode_action(r, rng) for r in scores]
    assert got[0] == 2 and got[1] in (1, 2) and got[3] == 0


def test_serving_imports_neither_rllib_nor_torch():
    import subprocess
    import sys

    code = ("import sys, serving.app, serving.client.static, serving.local, serve; "
            "bad = [m for m in ('ray', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stderr


def test_compatibility_is_not_confused_by_a_reused_object_id(tiny_problems, tiny_bundles):
    """The session's compatibility cache holds the policy itself: a new policy object that
    reuses a freed one's id() gets its own verdict (a review found the stale one returned)."""
    from serving.policy_store import PolicyStore
    from serving.session import Session, SessionSpec

    ps = tiny_problems
    body = session_body(ps)
    spec = SessionSpec(np.array([n["id"] for n in body["nodes"]]),
                       np.array([n["capacity_bps"] for n in body["nodes"]]),
                       body["controller"]["bandwidth_bps"], body["controller"]["cpu"],
                       body["num_topics"], body["interval_s"])
    s = Session(spec)
    for _ in range(20):
        bad = PolicyStore().load(tiny_bundles["mismatched"])
        assert s.compatibility(bad) is not None
        del bad
        good = PolicyStore().load(tiny_bundles["a"])
        assert s.compatibility(good) is None
        del good


# --------------------------------------------------------------------------- the contract


def test_integers_are_json_integers(client, tiny_problems):
    """Where the schema says integer, only a JSON integer passes (not ``false`` or "1"), as
    for numbers and booleans; an integral number (``3.0``) is an integer, as JSON Schema
    says."""
    ps = tiny_problems
    body = session_body(ps)
    for bad in (False, True, "1", 1.5):
        r = client.post("/v1/sessions", json=body | {"seed": bad}, headers=H)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "seed"], bad
    assert client.post("/v1/sessions", json=body | {"seed": 3.0}, headers=H).json()["version"]
    for bad in ({"interval_s": True}, {"interval_s": "1"}):
        assert client.post("/v1/sessions", json=body | bad, headers=H).status_code == 422
    sid = new_session(client, ps)["session_id"]
    for bad in ({"type": True}, {"type": "0"}, {"type": 0, "explain": 1},
                {"type": 0, "explain": "true"}):
        r = client.post(f"/v1/sessions/{sid}/decide", json=bad, headers=H)
        assert r.status_code == 422, bad
    node = body["nodes"][0]
    for bad in ({"id": False}, {"capacity_bps": "5"}):
        r = client.post("/v1/sessions", json=body | {"nodes": [node | bad]}, headers=H)
        assert r.status_code == 422, bad


def test_integer_bounds_are_exact_json_numbers():
    """Every bound of the OpenAPI document is a number a JSON client (an IEEE double) holds
    exactly: ids, counts and rates at most 2**53 - 1; nanosecond times and resource ids are
    64-bit, bounded by powers of two (or the largest double below 2**64)."""
    spec = create_app(ServerSettings(auth=False)).openapi()
    bounds = []

    def walk(x):
        if isinstance(x, dict):
            bounds.extend(v for k, v in x.items() if k in ("maximum", "exclusiveMaximum",
                                                            "minimum", "exclusiveMinimum"))
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(spec)
    assert bounds and all(float(b) == b for b in bounds)
    assert 2**53 - 1 in bounds and 2**63 - 1 not in bounds and 2**64 - 1 not in bounds


def test_options_and_405_name_every_method(client):
    for path, methods in (("/v1/sessions/abc", "DELETE, GET, OPTIONS, PATCH"),
                          ("/v1/policy", "GET, OPTIONS, PUT"),
                          ("/v1/online/sessions/abc/intervals/0/plan", "GET, OPTIONS, PUT")):
        r = client.options(path)
        assert r.status_code == 204 and r.headers["allow"] == methods, path
    r = client.put("/v1/sessions/abc", headers=H)
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET, OPTIONS, PATCH"
    assert client.options("/v1/nowhere").status_code == 404


def test_openapi_links_lead_from_creation_to_every_session_operation():
    spec = create_app(ServerSettings(api_keys=[KEY])).openapi()
    paths = spec["paths"]
    for create, prefix in (("/v1/sessions", "/v1/sessions/{session_id}"),
                           ("/v1/online/sessions", "/v1/online/sessions/{session_id}")):
        links = paths[create]["post"]["responses"]["201"]["links"]
        ops = {op["operationId"] for p, item in paths.items() if p.startswith(prefix)
               for op in item.values()}
        assert {ln["operationId"] for ln in links.values()} == ops and len(ops) >= 4
        for ln in links.values():
            assert ln["parameters"]["session_id"] == "$response.body#/session_id"
    # every operation taking a key documents the rate limit's 429 and Retry-After
    for item in paths.values():
        for op in item.values():
            if op.get("security"):
                assert "Retry-After" in op["responses"]["429"]["headers"]


def test_sessions_belong_to_their_key_in_process(tiny_problems, caplog):
    """The ownership rule and the audit lines, in process (the real server:
    tests/test_security_server.py)."""
    other, admin_log = "other-controller-key-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0", "smart.audit"
    app = create_app(ServerSettings(api_keys=[KEY, other], admin_keys=[ADMIN]))
    with TestClient(app) as c, caplog.at_level("INFO", logger=admin_log):
        sid = new_session(c, tiny_problems)["session_id"]
        r = c.get(f"/v1/sessions/{sid}", headers={"X-API-Key": other})
        assert r.status_code == 404 and r.json() == {"detail": f"unknown session {sid!r}"}
        assert c.delete(f"/v1/sessions/{sid}", headers={"X-API-Key": other}).status_code == 404
        assert c.get(f"/v1/sessions/{sid}", headers=H).status_code == 200
        assert c.delete(f"/v1/sessions/{sid}", headers=HA).status_code == 204
    from serving.access import key_id

    lines = [r.getMessage() for r in caplog.records if r.name == admin_log]
    assert sum(f"who={key_id(other)}" in ln and "outcome=refused" in ln for ln in lines) == 2
    assert sum(f"who={key_id(ADMIN)}" in ln and "session.delete" in ln and "outcome=ok" in ln
               for ln in lines) == 1
    assert not any(k in caplog.text for k in (KEY, other, ADMIN))


def test_rate_limit_settings(tiny_problems):
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from serve import settings_from
    from serving.access import RateLimit
    from serving.app import DEFAULT_RATE_LIMIT

    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "configs"),
                               version_base="1.3"):
        def settings(*over):
            return settings_from(compose("serve", overrides=["auth=false", *over]))

        assert settings().rate_limit == DEFAULT_RATE_LIMIT
        assert settings("rate_limit=null").rate_limit is None
        assert settings("rate_limit.burst=7").rate_limit == RateLimit(
            DEFAULT_RATE_LIMIT.requests_per_s, 7)
        assert settings("security.insecure=true").security.insecure is True
        with pytest.raises(ValueError, match=r"rate_limit\.requests_per_s"):
            settings("rate_limit.requests_per_s=0")
        with pytest.raises(ValueError, match="tls: give both"):
            settings("tls.certfile=/x.pem")
    # in process: a burst of 3, then 429 with Retry-After for that key only
    app = create_app(ServerSettings(api_keys=[KEY, K2], admin_keys=[ADMIN],
                                    rate_limit=RateLimit(0.5, 3)))
    with TestClient(app) as c:
        codes = [c.get("/v1/policy", headers=H).status_code for _ in range(5)]
        assert codes == [200, 200, 200, 429, 429]
        r = c.get("/v1/policy", headers=H)
        assert r.headers["retry-after"] == "2" and "rate limit" in r.json()["detail"]
        assert c.get("/v1/policy", headers={"X-API-Key": K2}).status_code == 200
        assert 'smart_access_refused_total{reason="rate_limit"} 3.0' in c.get(
            "/v1/metrics", headers=HA).text


def test_settings_left_out_of_the_config_take_the_settings_defaults():
    """``serve.settings_from``: a config file without ``min_key_chars``,
    ``max_sessions_per_key`` or the announcement's topic and timeout gets
    ``ServerSettings``' own defaults (written once, there), not copies of them."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from serve import settings_from

    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "configs"),
                               version_base="1.3"):
        cfg = compose("serve", overrides=["auth=false", "~min_key_chars",
                                          "~max_sessions_per_key", "~announce.topic",
                                          "~announce.send_timeout_s"])
    got = settings_from(cfg)
    want = ServerSettings.defaults()
    for name in ("min_key_chars", "max_sessions_per_key", "announce_topic",
                 "announce_send_timeout_s"):
        assert getattr(got, name) == want[name], name


def test_serve_yaml_restates_only_the_settings_defaults(monkeypatch):
    """``configs/serve.yaml`` lists every setting so that each can be set on the command line;
    where it gives a value it is ``ServerSettings``' default, except the settings it sets on
    purpose for ``serve.py`` (the default bundle, watching it, its trust, the keys)."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from serve import settings_from

    for k in list(os.environ):
        if k.startswith("SMART_"):
            monkeypatch.delenv(k)
    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "configs"),
                               version_base="1.3"):
        s = settings_from(compose("serve", overrides=["auth=false"]))
    want = ServerSettings.defaults()
    got = {k: getattr(s, k) for k in want}
    on_purpose = {"bundle", "watch", "bundle_trust", "auth", "registry_uri"}
    differ = sorted(k for k in want if k not in on_purpose and got[k] != want[k])
    assert not differ, {k: (got[k], want[k]) for k in differ}


def test_settings_from_the_environment_and_their_errors(monkeypatch, tmp_path):
    """``ServerSettings`` reads what it is not given from ``SMART_<NAME>`` (``null`` as
    null: no rate limit), takes a ``Path`` for a path setting, and refuses a wrong setting
    with a ValueError naming it, in ``serve.py`` by its path in the config file, and never
    carrying the input (keys are settings) in its context."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from serve import settings_from

    monkeypatch.setenv("SMART_RATE_LIMIT", "null")
    monkeypatch.setenv("SMART_MAX_BATCH", "7")
    monkeypatch.setenv("SMART_API_KEYS", f" {KEY} , {K2},")
    s = ServerSettings(bundle=tmp_path)
    assert s.rate_limit is None and s.max_batch == 7 and s.api_keys == [KEY, K2]
    assert s.bundle == str(tmp_path) and KEY not in repr(s)
    monkeypatch.delenv("SMART_API_KEYS")
    with pytest.raises(ValueError, match=r"^max_batch: Input should be a valid integer") as e:
        ServerSettings(api_keys=[KEY], max_batch="many")
    assert e.value.__context__ is None and e.value.__cause__ is None
    with pytest.raises(ValueError, match=r"admin_keys\[0\]") as e:
        ServerSettings(api_keys=[KEY], admin_keys=["weak-key"])
    assert "weak-key" not in str(e.value) and e.value.__context__ is None
    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "configs"),
                               version_base="1.3"):
        def settings(*over):
            return settings_from(compose("serve", overrides=["auth=false", *over]))

        with pytest.raises(ValueError, match=r"^announce\.send_timeout_s: Input should be"):
            settings("announce.send_timeout_s=soon")
        with pytest.raises(ValueError, match=r"announce\.url"):
            settings("announce.url=''")  # an empty URL is a mistake, not "no announcements"
        assert settings("announce.topic=null").announce_topic == \
            ServerSettings.defaults()["announce_topic"]
        assert settings("tls.certfile=''", "tls.keyfile=''").tls_certfile is None
