"""End to end: the real server (``serve.py`` under uvicorn, a subprocess on a free loopback
port) and the controller adapter in both modes; killing and restarting the server; a policy
hot swap under concurrent load."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from agents.learned import ActorPolicy
from serving.bundles.static import load_bundle
from serving.client.static import ControllerAdapter
from serving.local import LocalServer
from serving.scenario import adapter_for, replay_window, session_body

KEY, ADMIN = "e2e-key-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0", "e2e-admin-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0"


def Server(bundle, tmp, port=None) -> LocalServer:
    return LocalServer(bundle, tmp, api_key=KEY, admin_key=ADMIN, port=port)


@pytest.fixture()
def server(tiny_bundles, tmp_path):
    s = Server(tiny_bundles["a"], tmp_path).start()
    yield s
    s.stop()


def make_adapter(ps, url, mode, tmp_path, **kw) -> ControllerAdapter:
    return adapter_for(ps, url, mode, api_key=KEY, cache_dir=tmp_path / "cache", **kw)


@pytest.mark.parametrize("mode", ["remote", "cached"])
def test_adapter_decides_as_the_environment(server, tiny_problems, tiny_bundles, tmp_path,
                                            mode):
    ps = tiny_problems
    expected = ActorPolicy.from_bundle(load_bundle(tiny_bundles["a"]))
    log = tmp_path / "decisions.jsonl"
    with make_adapter(ps, server.url, mode, tmp_path, decision_log=log,
                      trace_log=True) as ad:
        for w in ps.windows["test"]:
            replay_window(ad, ps, w)
            ds = ad.decide(replan=True)
            inst = ps.instance(w)
            assert all(d.source == "policy" and d.policy_version == 1 for d in ds)
            got = {d.type_id: d.channel for d in ds}
            assert [got[int(c)] for c in inst.catalog_index] == expected.assign(inst).tolist()
        n = ad.flush_trace(tmp_path / "live.parquet")
    rows = log.read_text().splitlines()
    assert len(rows) == sum(ps.instance(w).num_types for w in ps.windows["test"])
    from envs.dsmd.traces import read_trace

    assert len(read_trace(tmp_path / "live.parquet")) == n > 0


@pytest.mark.slow  # waits out a server outage
def test_remote_adapter_falls_back_and_recovers(tiny_problems, tiny_bundles, tmp_path):
    ps = tiny_problems
    srv = Server(tiny_bundles["a"], tmp_path).start()
    try:
        ad = make_adapter(ps, srv.url, "remote", tmp_path, timeout_s=0.2, retries=1,
                          breaker_failures=2, breaker_reset_s=0.5)
        w0, w1 = ps.windows["test"][:2]
        replay_window(ad, ps, w0)
        assert all(d.source == "policy" for d in ad.decide(replan=True))
        srv.kill()
        replay_window(ad, ps, w1)
        t0 = time.perf_counter()
        ds = ad.decide(replan=True)
        took = time.perf_counter() - t0
        assert ds and all(d.source == "fallback" and "server unavailable" in d.reason
                          for d in ds)
        assert took < 0.2 * 2 + 0.5  # within the timeout budget (2 attempts), not hanging
        assert ad.breaker.state == "open"
        t0 = time.perf_counter()
        assert all(d.source == "fallback" for d in ad.decide(replan=True))
        assert time.perf_counter() - t0 < 0.05  # open breaker: no network wait at all
        srv.start()  # the same port: a restarted server without the old session
        time.sleep(0.6)  # breaker half-opens
        ds = ad.decide(replan=True)
        assert ds and all(d.source == "policy" for d in ds)
        assert ad.breaker.state == "closed"
        ad.close()
    finally:
        srv.stop()


def test_hot_swap_under_concurrent_load(server, tiny_problems, tiny_bundles):
    ps = tiny_problems
    w = ps.windows["test"][0]
    h = {"X-API-Key": KEY}
    hashes = {load_bundle(tiny_bundles[k]).content_hash for k in ("a", "b")}
    results, errors, stop = [], [], threading.Event()

    def load_worker():
        with httpx.Client(base_url=server.url, verify=server.verify, headers=h, timeout=10) as c:
            sid = c.post("/v1/sessions", json=session_body(ps, w)).json()["session_id"]
            while not stop.is_set():
                r = c.post(f"/v1/sessions/{sid}/decide/batch", json={"replan": True})
                if r.status_code != 200:
                    errors.append(r.text)
                else:
                    results.append(r.json())

    threads = [threading.Thread(target=load_worker) for _ in range(4)]
    for t in threads:
        t.start()
    with httpx.Client(base_url=server.url, verify=server.verify,
                      headers={"X-API-Key": ADMIN}, timeout=30) as c:
        for i in range(6):
            time.sleep(0.15)
            # back and forth between two signed bundles: every other swap is a rollback
            r = c.put("/v1/policy", json={"path": str(tiny_bundles["b" if i % 2 == 0
                                                                   else "a"]),
                                          "allow_rollback": True})
            assert r.status_code == 200, r.text
    time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors
    versions = {r["policy_version"] for r in results}
    assert len(results) > 20 and len(versions) >= 3  # requests ran across several swaps
    for r in results:  # one version per response: every decision by the same policy
        assert r["policy_hash"] in hashes
        assert all(d["source"] == "policy" for d in r["decisions"])


def test_cached_adapter_follows_a_new_policy_version(server, tiny_problems, tiny_bundles,
                                                     tmp_path):
    """Cached mode decides locally and picks up a newly published version on its next
    refresh; while the server is down it keeps deciding with the bundle it has."""
    ps = tiny_problems
    w = ps.windows["test"][0]
    with make_adapter(ps, server.url, "cached", tmp_path, refresh_s=0.2) as ad:
        replay_window(ad, ps, w)
        assert {d.policy_version for d in ad.decide(replan=True)} == {1}
        r = httpx.put(server.url + "/v1/policy", verify=server.verify,
                      json={"path": str(tiny_bundles["b"])},
                      headers={"X-API-Key": ADMIN}, timeout=30)
        assert r.status_code == 200
        time.sleep(0.3)
        ad.decide(replan=True)  # due: starts the refresh in the background
        deadline = time.monotonic() + 20
        while ad.policy.content_hash != load_bundle(tiny_bundles["b"]).content_hash:
            assert time.monotonic() < deadline, "the new version never arrived"
            time.sleep(0.05)
        ds = ad.decide(replan=True)
        assert {d.policy_version for d in ds} == {2} and all(d.source == "policy" for d in ds)
        expected = ActorPolicy.from_bundle(load_bundle(tiny_bundles["b"])).assign(
            ps.instance(w))
        got = {d.type_id: d.channel for d in ds}
        assert [got[int(c)] for c in ps.instance(w).catalog_index] == expected.tolist()
        server.proc.send_signal(signal.SIGSTOP)  # hung: the refresh will wait its timeout
        try:
            time.sleep(0.3)
            t0 = time.perf_counter()
            ds = ad.decide(replan=True)  # the refresh hangs in the background, not here
            assert time.perf_counter() - t0 < 0.2
            assert {d.policy_version for d in ds} == {2}
            assert all(d.source == "policy" for d in ds)
        finally:
            server.proc.send_signal(signal.SIGCONT)
        server.kill()
        time.sleep(0.3)
        ds = ad.decide(replan=True)  # the refresh fails; the cached policy still decides
        assert {d.policy_version for d in ds} == {2} and all(d.source == "policy" for d in ds)
