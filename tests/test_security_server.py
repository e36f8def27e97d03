"""The policy server secure by default, against the real thing: ``serve.py`` under uvicorn
(:class:`serving.local.LocalServer`) over HTTPS with the test run's PKI, real clients.

TLS (plain HTTP and a client that does not trust the CA fail, the CA's clients and the
adapters work), sessions owned by the key that created them (another key gets the 404 of an
unknown id, logged once), the audit log of admin actions, the per-key rate limit (a flooding
key gets 429 with Retry-After while another key is served), no key text in any log, and the
insecure debugging mode (plain HTTP, one warning)."""

from __future__ import annotations

import re
import secrets
import ssl
import threading
import time

import httpx
import pytest

from security.pki import Pki
from security.tls import Security
from serving.access import key_id
from serving.client.online import online_session_body
from serving.client.static import ControllerAdapter
from serving.local import LocalServer
from serving.scenario import adapter_for, rates_body, replay_window, session_body

# distinctive keys: any occurrence of one in a log is a leak
A, B, FLOOD = (f"ctl-{n}-{secrets.token_hex(16)}" for n in ("a", "b", "flood"))
ADMIN = f"adm-{secrets.token_hex(16)}"
#: keys of the in-process apps
KA, KB, KADM = (f"{n}-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0" for n in ("key-a", "key-b", "adm"))
KEYS = (A, B, FLOOD, ADMIN)
RATE = {"requests_per_s": 40, "burst": 40}  # far above what A and B send here


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_bundles):
    s = LocalServer(tiny_bundles["a"], tmp_path_factory.mktemp("secure-server"),
                    api_key=[A, B, FLOOD], admin_key=ADMIN,
                    overrides=[f"rate_limit.requests_per_s={RATE['requests_per_s']}",
                               f"rate_limit.burst={RATE['burst']}", "log_level=info"])
    with s:
        yield s
    leaked = [k for k in KEYS if k in server_log(s)]  # whatever ran in this module
    assert not leaked, "an API key appears in the server's logs"


def server_log(s: LocalServer) -> str:
    """Everything the server wrote: its Python log (Hydra's file) and its stderr."""
    return "".join(p.read_text() for p in (s.log_dir / "hydra" / "serve.log", s.log_file)
                   if p.exists())


def audit_lines(s: LocalServer, *words: str) -> list[str]:
    return [ln for ln in server_log(s).splitlines()
            if "smart.audit" in ln and all(w in ln for w in words)]


def wait_for_lines(s: LocalServer, n: int, *words: str, timeout: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        got = audit_lines(s, *words)
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


# --------------------------------------------------------------------------- TLS


def test_only_clients_trusting_the_ca_reach_it(server, tmp_path):
    assert server.url.startswith("https://")
    with server.client(A, timeout=10) as c:
        assert c.get("/v1/policy").json()["loaded"] is True
    plain = server.url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port: no answer
        httpx.get(plain + "/v1/health/live", timeout=5)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(server.url + "/v1/health/live", timeout=5)  # the system's CAs only
    other = Pki.ensure(tmp_path / "other-pki")  # a CA that did not sign the server's cert
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(server.url + "/v1/health/live", timeout=5,
                  verify=ssl.create_default_context(cafile=str(other.ca_cert)))
    assert httpx.get(server.url + "/v1/health/live", timeout=5,
                     verify=server.verify).status_code == 200  # still serving


def test_adapters_verify_the_server(server, tiny_problems, tmp_path):
    ps = tiny_problems
    w = ps.windows["test"][0]
    with adapter_for(ps, server.url, "remote", api_key=A, timeout_s=5.0) as ad:
        replay_window(ad, ps, w)
        ds = ad.decide(replan=True)
        assert ds and all(d.source == "policy" for d in ds)
    # an adapter trusting another CA never talks to this server: the fallback decides
    other = Security(pki_dir=str(tmp_path / "other-pki"))
    with adapter_for(ps, server.url, "remote", api_key=A, timeout_s=5.0, retries=0,
                     security=other) as ad:
        replay_window(ad, ps, w)
        ds = ad.decide(replan=True)
        assert all(d.source == "fallback" and "ConnectError" in d.reason for d in ds)
    with pytest.raises(ValueError, match=r"https://.*security\.insecure"):
        ControllerAdapter(ps.dataset.topology, num_topics=2, controller_bw_bps=10**9,
                          controller_cpu=100, base_url=server.url.replace("https", "http"))


# --------------------------------------------------------------------------- ownership


def test_another_keys_session_does_not_exist_for_it(server, tiny_problems, tiny_dataset):
    ps = tiny_problems
    w = ps.windows["test"][0]
    with server.client(A, timeout=30) as a, server.client(B, timeout=30) as b:
        sid = a.post("/v1/sessions", json=session_body(ps, w)).json()["session_id"]
        gone = "0" * 32
        calls = [("GET", "", None), ("GET", "/health", None),
                 ("PATCH", "", {"channel_health": {"mq": "down"}}),
                 ("POST", "/rates", rates_body(ps.instance(w))),
                 ("POST", "/decide", {"type": 0}), ("POST", "/decide/batch", {}),
                 ("DELETE", "", None)]
        for method, tail, body in calls:
            rb = b.request(method, f"/v1/sessions/{sid}{tail}", json=body)
            ru = b.request(method, f"/v1/sessions/{gone}{tail}", json=body)
            assert rb.status_code == ru.status_code == 404, (method, tail, rb.text)
            assert rb.json() == {"detail": f"unknown session {sid!r}"}
            assert ru.json() == {"detail": f"unknown session {gone!r}"}  # the same shape
        s = a.get(f"/v1/sessions/{sid}")  # untouched: B's PATCH and DELETE did nothing
        assert s.status_code == 200 and s.json()["channel_health"] is None
        assert a.post(f"/v1/sessions/{sid}/decide/batch", json={}).status_code == 200

        # the online sessions: the same rule
        from envs.dsmd.scenarios import load_scenario

        body = online_session_body(tiny_dataset.topology, load_scenario("tiny"))
        oid = a.post("/v1/online/sessions", json=body).json()["session_id"]
        for method, tail in (("GET", ""), ("GET", "/intervals/0/plan"),
                             ("POST", "/intervals/0/close"), ("DELETE", "")):
            r = b.request(method, f"/v1/online/sessions/{oid}{tail}")
            assert r.status_code == 404 and r.json() == {
                "detail": f"unknown online session {oid!r}"}, (method, tail, r.text)
        assert a.get(f"/v1/online/sessions/{oid}").status_code == 200

    who = key_id(B)
    lines = wait_for_lines(server, len(calls) + 4, f"who={who}", "outcome=refused")
    assert len(lines) == len(calls) + 4  # once per refused request
    for action in ("session.read", "session.update", "session.rates", "session.decide",
                   "session.delete", "online", "plan", "close"):
        assert any(action in ln for ln in lines), action
    assert all(sid in ln or oid in ln for ln in lines)
    assert not audit_lines(server, f"who={key_id(A)}", "refused")  # A was never refused


def test_admin_reads_and_deletes_any_session_audited(server, tiny_problems):
    ps = tiny_problems
    with server.client(A, timeout=30) as a, server.client(ADMIN, timeout=30) as adm:
        sid = a.post("/v1/sessions", json=session_body(ps)).json()["session_id"]
        assert adm.get(f"/v1/sessions/{sid}").status_code == 200
        assert adm.patch(f"/v1/sessions/{sid}", json={}).status_code == 404  # not change it
        assert adm.delete(f"/v1/sessions/{sid}").status_code == 204
        assert a.get(f"/v1/sessions/{sid}").status_code == 404
    who = f"who={key_id(ADMIN)}"
    assert len(wait_for_lines(server, 1, who, "session.read", sid, "outcome=ok")) == 1
    assert len(wait_for_lines(server, 1, who, "session.delete", sid, "outcome=ok")) == 1
    assert len(wait_for_lines(server, 1, who, "session.update", sid, "refused")) == 1


def test_admin_actions_are_audited(server, tiny_bundles):
    with server.client(A, timeout=60) as a, server.client(ADMIN, timeout=60) as adm:
        assert a.put("/v1/policy", json={"path": str(tiny_bundles["b"])}).status_code == 403
        r = adm.put("/v1/policy", json={"path": str(tiny_bundles["b"])})
        assert r.status_code == 200
        version = r.json()["version"]
        assert adm.put("/v1/policy", json={"path": "/nonexistent"}).status_code == 409
        assert adm.put("/v1/policy", json={"path": str(tiny_bundles["a"]),
                                           "allow_rollback": True}).status_code == 200
        assert httpx.put(server.url + "/v1/policy", json={"path": "/x"}, timeout=10,
                         verify=server.verify).status_code == 401
    ok = wait_for_lines(server, 1, f"who={key_id(ADMIN)}", "action=policy.load",
                        f"target={tiny_bundles['b']}", "outcome=ok")
    assert len(ok) == 1 and f"version {version}" in ok[0]
    assert len(wait_for_lines(server, 1, f"who={key_id(ADMIN)}", "action=policy.load",
                              "target=/nonexistent", "outcome=failed",
                              "metadata.json is missing")) == 1
    assert len(wait_for_lines(server, 1, f"who={key_id(A)}", "PUT /v1/policy",
                              "outcome=refused", "403")) == 1
    assert wait_for_lines(server, 1, "who=127.0.0.1:", "PUT /v1/policy", "refused", "401")


# --------------------------------------------------------------------------- rate limit


def test_a_flooding_key_cannot_starve_another(server):
    stop, flood = threading.Event(), {"ok": 0, "limited": 0, "retry": set()}

    def flooder() -> None:
        with server.client(FLOOD, timeout=10) as c:
            while not stop.is_set():
                r = c.get("/v1/policy")
                if r.status_code == 429:
                    flood["limited"] += 1
                    flood["retry"].add(r.headers.get("retry-after"))
                else:
                    assert r.status_code == 200
                    flood["ok"] += 1

    threads = [threading.Thread(target=flooder) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        codes, lat = [], []
        with server.client(A, timeout=10) as a:
            for _ in range(20):  # 10 requests/s: well under A's own limit
                t0 = time.perf_counter()
                codes.append(a.get("/v1/policy").status_code)
                lat.append(time.perf_counter() - t0)
                time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert codes == [200] * 20  # A is served throughout
    assert flood["limited"] > 0 and flood["ok"] >= RATE["burst"]
    assert flood["retry"] and all(v is not None and int(v) >= 1 for v in flood["retry"])
    with server.client(ADMIN, timeout=10) as a:
        metrics = a.get("/v1/metrics").text
    line = f'smart_rate_limited_total{{key="{key_id(FLOOD)}"}} '
    m = re.search(re.escape(line) + r"(\S+)", metrics)
    assert m and float(m.group(1)) == flood["limited"]
    assert f'key="{key_id(A)}"' not in metrics
    # one line when the flood starts, not one per refusal
    assert len(wait_for_lines(server, 1, f"who={key_id(FLOOD)}", "429")) == 1


def test_no_key_text_in_any_log(server, tiny_problems):
    """Refusals of every kind and admin actions are logged; no key, valid or not, is."""
    wrong = f"{A}x"  # a near miss of a real key
    with server.client(A, timeout=30) as a, server.client(B, timeout=30) as b, \
            server.client(wrong, timeout=30) as w, server.client(ADMIN, timeout=30) as adm:
        sid = a.post("/v1/sessions", json=session_body(tiny_problems)).json()["session_id"]
        assert b.get(f"/v1/sessions/{sid}").status_code == 404
        assert w.get(f"/v1/sessions/{sid}").status_code == 401
        assert a.put("/v1/policy", json={"path": "/x"}).status_code == 403
        assert adm.delete(f"/v1/sessions/{sid}").status_code == 204
    wait_for_lines(server, 1, f"who={key_id(ADMIN)}", "session.delete", sid)
    text = server_log(server)
    assert "smart.audit" in text
    for k in (*KEYS, wrong):
        assert k not in text


# --------------------------------------------------------------------------- insecure


def test_insecure_mode_is_plain_http_and_warns_once(tmp_path):
    with LocalServer(None, tmp_path / "plain", api_key=A,
                     security=Security(insecure=True)) as s:
        assert s.url.startswith("http://")
        r = httpx.get(s.url + "/v1/policy", headers={"X-API-Key": A}, timeout=10)
        assert r.status_code == 200
        with pytest.raises(httpx.HTTPError):  # no TLS on that port
            httpx.get(s.url.replace("http://", "https://") + "/v1/health/live", timeout=5,
                      verify=False)
    log = server_log(s)
    assert log.count("SECURITY OFF") == 1 and "policy server" in log


def test_one_key_cannot_take_every_session_slot(tiny_problems):
    """``max_sessions_per_key``: a key holding its quota gets 429 for one more session;
    another key still opens its own; closing one frees a slot of the first key's."""
    from fastapi.testclient import TestClient

    from serving.app import ServerSettings, create_app

    app = create_app(ServerSettings(api_keys=[KA, KB], admin_keys=[KADM], max_sessions=10,
                                    max_sessions_per_key=2))
    body = session_body(tiny_problems)
    with TestClient(app) as c:
        a = {"X-API-Key": KA}
        sids = [c.post("/v1/sessions", json=body, headers=a).json()["session_id"]
                for _ in range(2)]
        r = c.post("/v1/sessions", json=body, headers=a)
        assert r.status_code == 429 and "max_sessions_per_key" in r.json()["detail"]
        assert c.post("/v1/sessions", json=body,
                      headers={"X-API-Key": KB}).status_code == 201
        assert c.delete(f"/v1/sessions/{sids[0]}", headers=a).status_code == 204
        assert c.post("/v1/sessions", json=body, headers=a).status_code == 201


def test_refused_admin_calls_are_rate_limited_too():
    """A controller key calling an admin endpoint is throttled before it is refused, so
    refusals cannot flood the server or its audit log."""
    from fastapi.testclient import TestClient

    from serving.access import RateLimit
    from serving.app import ServerSettings, create_app

    app = create_app(ServerSettings(api_keys=[KA], admin_keys=[KADM],
                                    rate_limit=RateLimit(requests_per_s=0.01, burst=3)))
    with TestClient(app) as c:
        codes = [c.put("/v1/policy", json={"path": "/nowhere"},
                       headers={"X-API-Key": KA}).status_code for _ in range(5)]
    assert codes == [403, 403, 403, 429, 429]
