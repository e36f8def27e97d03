"""What an attacker sends the policy server, and what it must answer: non-standard numbers,
lone surrogates, bad encodings and deep nesting (a clear 4xx, never a 500); paths in the
online ``dataset`` field (no file is ever reached); sessions sized to exhaust memory (the
per-key and server budgets, charged before anything is allocated); idle sessions (expired);
a session that outgrows the policy's layout; a chunked body over the limit (413); floods of
invalid keys (throttled, and so are their audit lines); log lines forged through a bundle's
key id; file-system paths and other keys' session ids in answers (none).

In process (``TestClient``) and fast; the live memory and latency check under the largest
requests the limits allow is ``test_the_heaviest_allowed_requests_stall_no_one`` (slow)."""

from __future__ import annotations

import json
import logging
import threading
import time
import tracemalloc

import numpy as np
import pytest
from fastapi.testclient import TestClient

from envs.dsmd.observation import ObservationBuilder, ObservationLayout
from envs.dsmd.online import OnlineCost
from envs.dsmd.scenarios import load_scenario
from security.tls import Security
from serving import logsafe
from serving.app import ServerSettings, create_app
from serving.client.online import online_session_body
from serving.limits import ResourceLimits, online_session_bytes, static_session_bytes
from serving.local import LocalServer
from serving.online_schemas import MessageIn
from serving.online_session import OnlineSession, fallback_decider
from serving.scenario import session_body
from serving.session import Session, SessionSpec

KEY, OTHER, ADMIN = (f"{n}-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0"
                     for n in ("hostile-key-1", "hostile-key-2", "hostile-admin"))
H, HO, HA = {"X-API-Key": KEY}, {"X-API-Key": OTHER}, {"X-API-Key": ADMIN}
JSON = {"content-type": "application/json"}


def make_app(**kw):
    kw.setdefault("security", Security(insecure=True))
    return create_app(ServerSettings(api_keys=[KEY, OTHER], admin_keys=[ADMIN], **kw))


@pytest.fixture(scope="module")
def client(tiny_bundles):
    app = make_app()
    with TestClient(app, raise_server_exceptions=False) as c:
        app.state.store.load(tiny_bundles["a"])
        yield c


def nodes_body(n: int, start: int = 0) -> list[dict]:
    return [{"id": start + i, "capacity_bps": 10**9} for i in range(n)]


def raw(c, method: str, url: str, text: str | bytes, headers=H):
    return c.request(method, url, content=text, headers=headers | JSON)


# ------------------------------------------------------------------------------ bodies
NON_STANDARD = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1" + "0" * 5000]


@pytest.mark.parametrize("number", NON_STANDARD)
def test_non_standard_numbers_are_a_4xx_naming_the_value(client, tiny_problems, number):
    body = json.dumps(session_body(tiny_problems, tiny_problems.windows["test"][0]))
    sid = client.post("/v1/sessions", content=body, headers=H | JSON).json()["session_id"]
    cases = [
        ("POST", "/v1/sessions", body.replace('"interval_s": ', f'"interval_s": {number}, '
                                              '"_x": ', 1)),
        ("POST", "/v1/sessions", json.dumps({"nodes": [{"id": 0, "capacity_bps": 1}],
                                             "controller": {"bandwidth_bps": 1, "cpu": 1},
                                             "num_topics": 1}).replace(
            '"num_topics": 1', f'"num_topics": 1, "interval_s": {number}')),
        ("POST", f"/v1/sessions/{sid}/rates",
         f'{{"rates": [{{"type": 0, "rate_bps": {number}}}]}}'),
        ("POST", f"/v1/sessions/{sid}/decide", f'{{"type": {number}}}'),
        ("POST", "/v1/online/sessions", '{"nodes": [{"id": 0, "capacity_bps": 1}], '
         f'"num_topics": 1, "interval_s": {number}, '
         '"controller": {"bandwidth_bps": 1, "cpu": 1}}'),
        ("POST", "/v1/online/sessions", '{"nodes": [{"id": 0, "capacity_bps": 1}], '
         '"num_topics": 1, "interval_s": 1, "controller": {"bandwidth_bps": 1, "cpu": 1}, '
         f'"cost": {{"w_move": {number}}}}}'),
    ]
    for method, url, text in cases:
        r = raw(client, method, url, text)
        assert 400 <= r.status_code < 500, (url, text[:200], r.status_code, r.text[:300])
        detail = json.dumps(r.json())  # the answer itself is valid JSON
        if number != "1" + "0" * 5000 or "rates" in url:
            assert "json_invalid" in detail or "range" in detail, detail[:300]


def test_lone_surrogates_are_refused_and_pairs_kept(client, tiny_problems):
    body = session_body(tiny_problems)
    for sig in ('{"x": "\\ud800"}', '{"\\udfff": "y"}', '{"x": "a\\ud83d"}'):
        text = json.dumps(body)[:-1] + ', "scenario_signature": ' + sig + "}"
        r = raw(client, "POST", "/v1/sessions", text)
        assert r.status_code == 422, r.text
        assert "surrogate" in r.text
    text = json.dumps(body)[:-1] + ', "scenario_signature": {"x": "\\ud83d\\ude00"}}'
    r = raw(client, "POST", "/v1/sessions", text)
    assert r.status_code == 201, r.text
    got = client.get(f"/v1/sessions/{r.json()['session_id']}", headers=H)
    assert got.status_code == 200 and got.json()["scenario_signature"] == {"x": "\U0001F600"}


@pytest.mark.parametrize("text", [b"\xff\xfe{}", b'{"nodes": "\xe9"}',
                                  "\ufeff{}".encode(), b"[" * 200_000 + b"]" * 200_000,
                                  b'{"a":' * 50_000 + b"1" + b"}" * 50_000, b"{",
                                  b'{"nodes": [' + b"{}," * 1000 + b"{}]}"])
def test_malformed_bodies_are_a_4xx(client, text):
    for url in ("/v1/sessions", "/v1/online/sessions"):
        r = raw(client, "POST", url, text)
        assert 400 <= r.status_code < 500, (url, r.status_code, r.text[:300])
        json.loads(r.text)


def test_a_validation_error_echoing_any_value_renders(client):
    """The 422 renderer encodes whatever it echoes (second line behind the strict parser)."""
    from serving.strictjson import json_safe

    assert json.dumps(json_safe({"a": [float("nan"), float("inf"), "\ud800x", (1, 2)]}),
                      allow_nan=False).encode("utf-8")


# ------------------------------------------------------------------------------ datasets
@pytest.mark.parametrize("name", ["../serve", "..", "/etc/passwd", "tiny_online/../serve",
                                  "serve", "train", "../../configs/serve", "%2e%2e/serve",
                                  "tiny_online\x00", "TINY_ONLINE", "a" * 101])
def test_the_dataset_field_reaches_no_path(client, name):
    r = client.post("/v1/online/sessions", json={"nodes": nodes_body(3), "dataset": name},
                    headers=H)
    assert r.status_code in (409, 422), r.text
    said = r.text.replace(json.dumps(name)[1:-1], "")  # less the caller's own input
    for leak in ("admin_keys", "api_keys", "max_body_bytes", "/configs", "yaml", "root"):
        assert leak not in said, r.text


def test_a_known_dataset_name_works(client):
    r = client.post("/v1/online/sessions", json={"nodes": nodes_body(10),
                                                 "dataset": "tiny_online"}, headers=H)
    assert r.status_code == 201, r.text
    client.delete(f"/v1/online/sessions/{r.json()['session_id']}", headers=H)


def test_an_online_scenario_is_typed_and_bounded(client):
    base = load_scenario("tiny").to_dict()
    for change in ({"num_topics": 10**8}, {"num_topics": 5000}, {"phases": [1]},
                   {"phases": [[1, 2, 3]]}, {"split": ["x", 1, 2]}, {"extra": 5},
                   {"extra": {"a": {"b": [1]}}}, {"seed": -1}, {"what": 1},
                   {"num_nodes": 10**30}, {"interval_s": 0}):
        r = client.post("/v1/online/sessions",
                        json={"nodes": nodes_body(3), "scenario": base | change}, headers=H)
        assert r.status_code in (409, 422), (change, r.status_code, r.text[:300])
    r = client.post("/v1/online/sessions", json={"nodes": nodes_body(3), "scenario": base},
                    headers=H)
    assert r.status_code == 201, r.text
    client.delete(f"/v1/online/sessions/{r.json()['session_id']}", headers=H)


# ------------------------------------------------------------------------------ sizes
def test_session_size_limits_name_the_limit(tiny_problems):
    lim = ResourceLimits(max_nodes=50, max_topics=8, max_destinations=100)
    app = make_app(limits=lim)
    ctl = {"bandwidth_bps": 10**9, "cpu": 100}
    with TestClient(app) as c:
        r = c.post("/v1/sessions", json={"nodes": nodes_body(51), "controller": ctl,
                                         "num_topics": 2}, headers=H)
        assert r.status_code == 422 and "limits.max_nodes" in r.text
        r = c.post("/v1/sessions", json={"nodes": nodes_body(5), "controller": ctl,
                                         "num_topics": 9}, headers=H)
        assert r.status_code == 422 and "limits.max_topics" in r.text
        types = [{"id": i, "destinations": list(range(40))} for i in range(3)]
        r = c.post("/v1/sessions", json={"nodes": nodes_body(50), "controller": ctl,
                                         "num_topics": 2, "types": types}, headers=H)
        assert r.status_code == 422 and "limits.max_destinations" in r.text
        r = c.post("/v1/sessions", json={"nodes": nodes_body(50), "controller": ctl,
                                         "num_topics": 2, "types": types[:2]}, headers=H)
        assert r.status_code == 201
        sid = r.json()["session_id"]
        r = c.patch(f"/v1/sessions/{sid}", json={"types": [{"id": 9, "destinations": list(
            range(40))}]}, headers=H)
        assert r.status_code == 409 and "limits.max_destinations" in r.text
        assert len(c.get(f"/v1/sessions/{sid}", headers=H).json()["types"]) == 2
        for k in (9, 5000):
            r = c.post("/v1/online/sessions", json={"nodes": nodes_body(3), "num_topics": k,
                                                    "interval_s": 1, "controller": ctl},
                       headers=H)
            assert r.status_code == 422, r.text
        r = c.post("/v1/online/sessions", json={"nodes": nodes_body(51), "num_topics": 2,
                                                "interval_s": 1, "controller": ctl}, headers=H)
        assert r.status_code == 422 and "limits.max_nodes" in r.text
        doc = c.get("/openapi.json").json()["components"]["schemas"]
        assert doc["SessionCreate"]["properties"]["nodes"]["maxItems"] == 50


def test_a_keys_sessions_are_held_to_its_memory_budget(tiny_problems):
    """Each session is charged its estimate before it is built; past the key's budget the
    answer is 429 naming limits.key_memory_bytes, another key is unaffected, and a deleted
    session gives its charge back."""
    one = static_session_bytes(1000, 256, 0, 0)
    app = make_app(limits=ResourceLimits(key_memory_bytes=3 * one + one // 2,
                                         memory_bytes=5 * one + one // 2))
    ctl = {"bandwidth_bps": 10**9, "cpu": 100}
    big = {"nodes": nodes_body(1000), "controller": ctl, "num_topics": 256}
    with TestClient(app) as c:
        mine = [c.post("/v1/sessions", json=big, headers=H) for _ in range(4)]
        assert [r.status_code for r in mine] == [201, 201, 201, 429], [r.text for r in mine]
        assert "limits.key_memory_bytes" in mine[3].text
        assert app.state.budget.used(_owner(KEY)) == 3 * one
        theirs = [c.post("/v1/sessions", json=big, headers=HO) for _ in range(3)]
        assert [r.status_code for r in theirs] == [201, 201, 429]
        assert "limits.memory_bytes" in theirs[2].text
        online = c.post("/v1/online/sessions", json=big | {"interval_s": 1}, headers=HO)
        assert online.status_code == 429, online.text
        c.delete(f"/v1/sessions/{mine[0].json()['session_id']}", headers=H)
        assert c.post("/v1/sessions", json=big, headers=H).status_code == 201
        assert len(app.state.sessions) == 5 and app.state.budget.total == 5 * one


def _owner(key: str) -> str:
    from serving.access import caller_for

    return caller_for(key, False).owner


def test_an_online_sessions_history_is_charged_as_it_grows(tiny_problems):
    """Every batch of messages is charged (at most: each message a new type) before it is
    taken: a key whose session history outgrows its budget gets 429 and the session keeps
    what it had."""
    from envs.dsmd.message import messages_from_trace

    spec, topo = tiny_problems.spec, tiny_problems.dataset.topology
    msgs = messages_from_trace(tiny_problems.dataset.trace)
    create = online_session_body(topo, spec, start_ns=int(msgs[0].timestamp_ns))
    start = online_session_bytes(topo.num_nodes, spec.num_topics, 0, 0, 0, 0)
    app = make_app(limits=ResourceLimits(key_memory_bytes=start + 12 * 1024))
    with TestClient(app) as c:
        sid = c.post("/v1/online/sessions", json=create, headers=H).json()["session_id"]
        step = int(spec.interval_s * 1e9)
        first = [m for m in msgs if m.timestamp_ns < msgs[0].timestamp_ns + step]
        # no online policy here: the placements come from a local copy, as a restoring
        # adapter sends them
        local = OnlineSession(spec, topo, cost=OnlineCost(),
                              start_ns=int(msgs[0].timestamp_ns))
        local.set_decider(fallback_decider())
        plan = local.begin()
        r = c.put(f"/v1/online/sessions/{sid}/intervals/0/plan", json={"plan": [
            {"type": t, "channel": ch, "expected_rate_bps": rate} for t, ch, rate in zip(
                plan.types.tolist(), plan.channels.tolist(), plan.rates.tolist())]},
                  headers=H)
        assert r.status_code == 200, r.text
        codes = []
        for i in range(0, len(first), 5):
            batch = first[i:i + 5]
            placed = {p.type_id: p.channel for p in local.submit(batch).placed}
            r = c.post(f"/v1/online/sessions/{sid}/intervals/0/messages",
                       json={"messages": [MessageIn.of(m) for m in batch],
                             "placements": [{"type": t, "channel": ch}
                                            for t, ch in placed.items()]}, headers=H)
            codes.append(r.status_code)
            if r.status_code == 429:
                assert "limits.key_memory_bytes" in r.text
                break
        assert codes[0] == 200 and codes[-1] == 429, (codes, r.text)
        e = app.state.online_sessions[sid]
        assert e.messages == min(len(first), 5 * (len(codes) - 1))
        assert app.state.budget.used(_owner(KEY)) == e.estimate()


def test_estimates_bound_what_sessions_hold(tiny_problems):
    """The estimates are upper bounds of the bytes a session really allocates."""
    rng = np.random.default_rng(0)
    for n, k, m, d in [(300, 100, 500, 5), (2000, 256, 300, 30), (50, 4, 3000, 3)]:
        dests = [rng.choice(n, d, replace=False) for _ in range(m)]
        tracemalloc.start()
        s = Session(SessionSpec(np.arange(n), np.full(n, 10**9), 10**12, 10**9, k))
        s.add_types((i, dests[i]) for i in range(m))
        s.update_rates(dict.fromkeys(range(m), 1000))
        s.decide(None, None)
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert held <= static_session_bytes(n, k, m, m * d), (n, k, m, d, held)
    from envs.dsmd.message import messages_from_trace

    msgs = messages_from_trace(tiny_problems.dataset.trace)
    spec, topo = tiny_problems.spec, tiny_problems.dataset.topology
    tracemalloc.start()
    s = OnlineSession(spec, topo, cost=OnlineCost(), start_ns=int(msgs[0].timestamp_ns))
    s.set_decider(fallback_decider())
    step = int(spec.interval_s * 1e9)
    t0 = msgs[0].timestamp_ns
    w = 0
    for w in range(6):
        s.begin()
        batch = [m for m in msgs if t0 + w * step <= m.timestamp_ns < t0 + (w + 1) * step]
        if batch:
            s.submit(batch)
        s.close()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    sent = [m for m in msgs if m.timestamp_ns < t0 + (w + 1) * step]
    est = online_session_bytes(topo.num_nodes, spec.num_topics, len(s.live.catalog), w + 1,
                               len(sent), sum(len(m.hosts) for m in sent))
    assert held <= est, (held, est)


def test_idle_sessions_expire_and_return_their_charge(tiny_problems):
    app = make_app(limits=ResourceLimits(idle_s=30.0))
    with TestClient(app) as c:
        sid = c.post("/v1/sessions", json=session_body(tiny_problems), headers=H
                     ).json()["session_id"]
        oid = c.post("/v1/online/sessions", json={"nodes": nodes_body(10),
                                                  "dataset": "tiny_online"},
                     headers=H).json()["session_id"]
        assert app.state.budget.total > 0
        assert app.state.sweep(time.monotonic() + 10) == 0  # not yet
        assert c.get(f"/v1/sessions/{sid}", headers=H).status_code == 200
        assert app.state.sweep(time.monotonic() + 31) == 2
        assert app.state.budget.total == 0 and not app.state.sessions
        assert c.get(f"/v1/sessions/{sid}", headers=H).status_code == 404
        assert c.get(f"/v1/online/sessions/{oid}", headers=H).status_code == 404
        metrics = c.get("/v1/metrics", headers=HA).text
        assert 'smart_sessions_expired_total{family="session"} 1.0' in metrics
        assert 'smart_sessions_expired_total{family="online"} 1.0' in metrics


def test_an_expired_session_is_gone_even_before_the_sweep(tiny_problems):
    app = make_app(limits=ResourceLimits(idle_s=0.2))
    with TestClient(app) as c:
        sid = c.post("/v1/sessions", json=session_body(tiny_problems), headers=H
                     ).json()["session_id"]
        time.sleep(0.3)
        assert c.get(f"/v1/sessions/{sid}", headers=H).status_code == 404
        assert app.state.budget.total == 0


# ------------------------------------------------------------------------------ layout
def test_a_session_that_outgrows_the_layout_is_decided_by_the_policy(client, tiny_problems):
    """The ``channel`` observation holds any catalogue: a session with more types than the
    policy was trained on is compatible and decided by it (was: reported compatible, then a
    500 on the first decision)."""
    body = session_body(tiny_problems, tiny_problems.windows["test"][0])
    sid = client.post("/v1/sessions", json=body, headers=H).json()["session_id"]
    nodes = [n["id"] for n in body["nodes"]]
    extra = [{"id": 10_000 + i, "destinations": nodes[:2], "rate_bps": 1000}
             for i in range(tiny_problems.catalog_size + 5)]
    r = client.patch(f"/v1/sessions/{sid}", json={"types": extra}, headers=H)
    assert r.status_code == 200 and r.json()["policy_compatible"], r.text
    for mode in ({"replan": True}, {"replan": True, "parallel": True}):
        r = client.post(f"/v1/sessions/{sid}/decide/batch", json=mode, headers=H)
        assert r.status_code == 200, r.text
        assert {d["source"] for d in r.json()["decisions"]} == {"policy"}
    r = client.post(f"/v1/sessions/{sid}/decide", json={"type": 10_003}, headers=H)
    assert r.status_code == 200 and r.json()["source"] == "policy"


def test_paper_layouts_still_bound_the_catalogue(tiny_problems):
    inst = tiny_problems.instances("test")[0]
    small = ObservationLayout("paper", int(inst.catalog_index.max()), inst.num_nodes,
                              inst.num_topics)
    with pytest.raises(Exception, match="outside the observation layout"):
        ObservationBuilder(small, inst)
    ObservationBuilder(ObservationLayout("channel", 1, inst.num_nodes, inst.num_topics), inst)


# ------------------------------------------------------------------------------ transport
def test_a_chunked_body_over_the_limit_is_413():
    app = make_app(max_body_bytes=10_000)
    with TestClient(app) as c:
        def chunks():
            for _ in range(30):
                yield b" " * 1000

        r = c.post("/v1/sessions", content=chunks(), headers=H | JSON)
        assert r.status_code == 413, r.text
        assert "max_body_bytes" in r.text
        r = c.post("/v1/sessions", content=iter([b"{", b"}"]), headers=H | JSON)
        assert r.status_code == 422  # a small chunked body still reaches validation


def test_invalid_keys_are_throttled_per_address(caplog):
    app = make_app()
    caplog.set_level(logging.INFO, logger="smart.audit")
    with TestClient(app) as c:
        codes = [c.get("/v1/policy", headers={"X-API-Key": f"guess-{i}"}).status_code
                 for i in range(60)]
        assert codes[:20] == [401] * 20 and codes[-1] == 429, codes
        r = c.get("/v1/policy", headers={"X-API-Key": "guess"})
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert c.get("/v1/policy", headers=H).status_code == 200  # valid keys are served
    lines = [r for r in caplog.records if r.name == "smart.audit"]
    assert 20 <= len(lines) <= 22, len(lines)  # 20 refusals, one line for the throttled run


def test_the_address_table_is_bounded():
    from serving.access import RateLimit, RateLimiter

    lim = RateLimiter(RateLimit(1.0, 2), max_keys=100)
    for i in range(10_000):
        lim.take(f"10.0.{i // 256}.{i % 256}", "x")
    assert len(lim._buckets) <= 100


# ------------------------------------------------------------------------------ answers
def test_no_file_system_path_in_policy_answers(client, tiny_bundles):
    r = client.get("/v1/policy", headers=H)
    assert r.status_code == 200 and "path" not in r.json()
    assert r.json()["name"] == tiny_bundles["a"].name
    assert str(tiny_bundles["a"].parent) not in r.text
    r = client.get("/v1/online/policy", headers=H)
    assert "path" not in r.json()


def test_a_refused_swap_names_only_the_callers_sessions(tiny_bundles, tiny_problems):
    app = make_app()
    with TestClient(app) as c:
        theirs = c.post("/v1/sessions", json=session_body(tiny_problems),
                        headers=H).json()["session_id"]
        mine = c.post("/v1/sessions", json=session_body(tiny_problems),
                      headers=HA).json()["session_id"]
        r = c.put("/v1/policy", json={"path": str(tiny_bundles["mismatched"])}, headers=HA)
        assert r.status_code == 409, r.text
        assert mine in r.text and theirs not in r.text
        assert "1 session(s) of other keys" in r.text


def test_a_key_id_cannot_forge_a_log_line(tiny_bundles, tmp_path, caplog):
    import shutil

    from serving.bundles.signing import SIGNATURE_FILE, verify_bundle

    d = tmp_path / "forged"
    shutil.copytree(tiny_bundles["a"], d)
    doc = json.loads((d / SIGNATURE_FILE).read_text())
    doc["key_id"] = "abc\naudit who=key-admin action=policy.load outcome=ok"
    (d / SIGNATURE_FILE).write_text(json.dumps(doc))
    caplog.set_level(logging.DEBUG)
    with pytest.raises(Exception, match="key_id must be a key id"):
        verify_bundle(d)
    assert caplog.records and all("\n" not in r.getMessage() for r in caplog.records)


def test_every_record_of_the_server_is_one_line():
    old = logging.getLogRecordFactory()
    try:
        logsafe.install()
        logsafe.install()  # idempotent
        rec = logging.getLogger("x").makeRecord("x", logging.INFO, "f", 1,
                                                "bundle %s: %s", ("a\nb", "c\r\x1b"), None)
        assert rec.getMessage() == "bundle a\\nb: c\\r\\x1b"
    finally:
        logging.setLogRecordFactory(old)


# ------------------------------------------------------------------------------ live
def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.slow
def test_the_heaviest_allowed_requests_stall_no_one(tmp_path, tiny_bundles):
    """One key sends the largest requests the limits allow (the largest sessions, batch
    decisions and rate rebuilds, back to back) while another key probes the server: the
    server's memory stays within the key's budget and the probe is never held up for long
    (was: seconds per request, gigabytes per session)."""
    budget_mb = 512
    srv = LocalServer(tiny_bundles["a"], tmp_path, api_key=[KEY, OTHER], admin_key=ADMIN,
                      security=Security(insecure=True),
                      overrides=[f"limits.key_memory_bytes={budget_mb << 20}"])
    with srv:
        base = _rss_mb(srv.proc.pid)
        stop, waits, codes = threading.Event(), [], []

        def attack() -> None:
            n, k = 20000, 1023  # 82 MB of counters a session
            nodes = nodes_body(n)
            types = [{"id": i, "destinations": [(i * 7 + j) % n for j in range(10)],
                      "rate_bps": 1000 + i} for i in range(20000)]
            body = {"nodes": nodes, "controller": {"bandwidth_bps": 10**12, "cpu": 10**6},
                    "num_topics": k, "types": types}
            sids = []
            with srv.client(KEY, timeout=300) as c:
                while not stop.is_set():  # as many of the largest sessions as it may hold
                    r = c.post("/v1/sessions", json=body)
                    codes.append(r.status_code)
                    if r.status_code != 201:
                        break
                    sids.append(r.json()["session_id"])
                while not stop.is_set() and sids:  # then the heaviest work on them
                    for sid in sids:
                        codes.append(c.post(f"/v1/sessions/{sid}/rates", json={
                            "rates": [{"type": t["id"], "rate_bps": t["rate_bps"] + 1}
                                      for t in types], "replace": True}).status_code)
                        codes.append(c.post(f"/v1/sessions/{sid}/decide/batch", json={
                            "types": list(range(2000))}).status_code)

        t = threading.Thread(target=attack, daemon=True)
        t.start()
        with srv.client(OTHER, timeout=30) as probe:
            t_end = time.monotonic() + 40
            while time.monotonic() < t_end:
                t0 = time.perf_counter()
                assert probe.get("/v1/health/live").status_code == 200
                waits.append(time.perf_counter() - t0)
                time.sleep(0.02)
        peak = _rss_mb(srv.proc.pid)
        stop.set()
        t.join(180)
    assert 201 in codes and 429 in codes, codes  # the budget was reached, and refused
    assert peak - base < budget_mb * 1.5 + 200, (base, peak)
    waits.sort()
    assert waits[int(0.99 * len(waits))] < 0.5, waits[-10:]


def test_one_key_holds_at_most_its_share_of_the_worker_threads():
    import asyncio

    from serving.limits import KeySlots

    async def scenario() -> list[str]:
        slots, order = KeySlots(per_key=2), []

        async def job(owner: str, name: str, hold: float) -> None:
            async with slots.of(owner):
                order.append(f"start {name}")
                await asyncio.sleep(hold)

        await asyncio.gather(job("a", "a1", 0.2), job("a", "a2", 0.2), job("a", "a3", 0.01),
                             job("b", "b1", 0.01))
        return order

    order = asyncio.run(scenario())
    # a's third job waits for one of its own; b's starts at once
    assert order.index("start b1") < order.index("start a3"), order


def test_the_wire_scenario_is_the_scenario_spec():
    """``ScenarioIn`` (the online API's typed scenario) has exactly ``ScenarioSpec``'s fields,
    and every shipped scenario passes through it unchanged."""
    from dataclasses import fields

    from envs.dsmd.scenarios import ScenarioSpec
    from serving.online_schemas import ScenarioIn

    assert set(ScenarioIn.model_fields) == {f.name for f in fields(ScenarioSpec)}
    for name in ("tiny", "godaddy", "cern"):
        spec = load_scenario(name)
        assert ScenarioSpec.from_dict(ScenarioIn.model_validate(spec.to_dict()).model_dump()) \
            == spec, name
