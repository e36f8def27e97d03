"""The policy server's keys: where they come from (mode-600 key files, never the command
line), how strong they must be, what each role may do (controller, admin, metrics: the
metrics behind a key), and a rate limit that charges by work (the body's size), not one
token per request whatever the batch. Each test fails on a server that takes keys in argv,
accepts any key, serves ``/v1/metrics`` to anyone or charges a 20,000-type batch one token.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from security.tls import Security
from serving.access import (
    RateLimit,
    caller_for,
    check_key_strength,
    read_key_file,
    write_key_file,
)
from serving.app import ServerSettings, create_app
from serving.local import LocalServer

KEY, ADMIN, SCRAPER = (f"{n}-Zq81vB5tXw3nY0kR6mC2hL9pD4sF7gJ" for n in ("ctl", "adm", "prom"))
H, HA, HM = ({"X-API-Key": k} for k in (KEY, ADMIN, SCRAPER))


def make_app(**kw):
    kw.setdefault("security", Security(insecure=True))
    kw.setdefault("api_keys", [KEY])
    kw.setdefault("admin_keys", [ADMIN])
    kw.setdefault("metrics_keys", [SCRAPER])
    return create_app(ServerSettings(**kw))


# --------------------------------------------------------------------------- strength


@pytest.mark.parametrize("weak,why", [("short-key-1234", "has 14 characters"),
                                      ("ab" * 20, "2 distinct characters")])
def test_a_weak_key_stops_the_start_naming_it_by_id_not_text(weak, why):
    with pytest.raises(ValueError) as e:
        ServerSettings(api_keys=[KEY], admin_keys=[ADMIN, weak])
    msg = str(e.value)
    assert msg.startswith(f"admin_keys[1] ({caller_for(weak, True).key_id}) is too weak")
    assert why in msg and weak not in msg and "token_urlsafe" in msg


def test_key_strength_bounds():
    check_key_strength([KEY, ADMIN], "api_keys")  # strong keys pass
    with pytest.raises(ValueError, match="fewer than min_key_chars=64"):
        ServerSettings(api_keys=[KEY], min_key_chars=64)
    with pytest.raises(ValueError, match="min_key_chars must be an integer >= 16"):
        ServerSettings(api_keys=[KEY], min_key_chars=8)
    with pytest.raises(ValueError, match=r"metrics_keys\[0\]"):
        ServerSettings(api_keys=[KEY], metrics_keys=["prom"])
    # without authentication no key is used, so none is checked
    assert ServerSettings(auth=False, api_keys=["x"]).auth is False


# --------------------------------------------------------------------------- key files


def test_key_files_round_trip_and_refuse_what_others_can_read(tmp_path: Path):
    f = tmp_path / "controller.keys"
    f.write_text("old")
    f.chmod(0o644)
    write_key_file(f, [KEY, ADMIN])  # an existing, readable file is made private
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    f.write_text(f"# controllers\n{KEY}\n\n  {ADMIN}  \n")
    assert read_key_file(f, "api_keys_file") == [KEY, ADMIN]
    f.chmod(0o640)
    with pytest.raises(ValueError, match=r"api_keys_file: .*controller.keys has mode 640, so "
                                         r"other users may read or change its keys; run "
                                         r"chmod 600"):
        read_key_file(f, "api_keys_file")
    with pytest.raises(ValueError, match=r"admin_keys_file: cannot read .*nowhere"):
        read_key_file(tmp_path / "nowhere", "admin_keys_file")
    with pytest.raises(ValueError, match="line break"):
        write_key_file(tmp_path / "bad", ["two\nkeys-in-one"])


def test_serve_config_reads_key_files_and_warns_of_keys_in_argv(tmp_path: Path):
    from hydra import compose, initialize_config_dir

    import serve

    files = {r: write_key_file(tmp_path / f"{r}.keys", [k])
             for r, k in (("api", KEY), ("admin", ADMIN), ("metrics", SCRAPER))}
    root = Path(serve.__file__).parent
    with initialize_config_dir(str(root / "configs"), version_base="1.3"):
        cfg = compose("serve", overrides=[f"{r}_keys_file={p}" for r, p in files.items()]
                      + ["api_keys=[]", "admin_keys=[]", "metrics_keys=[]"])
        s = serve.settings_from(cfg)
        assert (s.api_keys, s.admin_keys, s.metrics_keys) == ([KEY], [ADMIN], [SCRAPER])
        os.chmod(files["admin"], 0o604)
        with pytest.raises(ValueError, match=r"admin_keys_file: .* has mode 604"):
            serve.settings_from(cfg)
    assert serve.keys_on_command_line(["serve.py", f"api_keys=[{KEY}]", "+admin_keys=a",
                                       "metrics_keys=[]", "api_keys_file=/k"]) == [
        "api_keys", "admin_keys"]


def test_a_local_server_never_puts_a_key_on_its_command_line(tmp_path: Path):
    with LocalServer(None, tmp_path, api_key=KEY, admin_key=ADMIN, metrics_key=SCRAPER,
                     security=Security(insecure=True)) as srv:
        assert srv.proc is not None
        cmdline = Path(f"/proc/{srv.proc.pid}/cmdline").read_bytes().decode()
        assert "keys_file=" in cmdline
        for k in (KEY, ADMIN, SCRAPER):
            assert k not in cmdline
        with srv.client(KEY) as c:  # and the keys work
            assert c.get("/v1/policy").status_code == 200
        with srv.client(SCRAPER) as c:
            assert c.get("/v1/metrics").status_code == 200
            assert c.get("/v1/policy").status_code == 403
        assert "keys given on the command line" not in srv.log_file.read_text()


# --------------------------------------------------------------------------- metrics


def test_metrics_need_an_admin_or_metrics_key(caplog):
    with TestClient(make_app()) as c, caplog.at_level(logging.WARNING, "smart.audit"):
        assert c.get("/v1/metrics").status_code == 401
        r = c.get("/v1/metrics", headers=H)
        assert r.status_code == 403 and "admin or metrics key" in r.json()["detail"]
        assert c.get("/v1/metrics", headers=HA).status_code == 200
        assert "smart_requests_total" in c.get("/v1/metrics", headers=HM).text
        bearer = {"Authorization": f"Bearer {SCRAPER}"}  # Prometheus's `authorization`
        assert c.get("/v1/metrics", headers=bearer).status_code == 200
        # a metrics key reads the metrics and nothing else
        r = c.get("/v1/policy", headers=HM)
        assert r.status_code == 403 and "only read /v1/metrics" in r.json()["detail"]
        assert c.post("/v1/sessions", json={}, headers=HM).status_code == 403
        assert c.put("/v1/policy", json={"path": "/x"}, headers=HM).status_code == 403
        text = c.get("/v1/metrics", headers=HA).text
    assert 'smart_access_refused_total{reason="metrics_key"} 3.0' in text
    assert 'smart_access_refused_total{reason="not_admin"} 1.0' in text
    for k in (KEY, ADMIN, SCRAPER):
        assert k not in text and k not in caplog.text
    assert "403: not an admin or metrics key" in caplog.text
    spec = make_app().openapi()["paths"]["/v1/metrics"]["get"]
    assert spec["security"] and {"401", "403"} <= set(spec["responses"])


# --------------------------------------------------------------------------- rate by work


def test_rate_limit_cost_follows_the_body():
    lim = RateLimit(100.0, 50, bytes_per_token=1000)
    assert [lim.cost(n) for n in (0, 999, 1000, 20_500, 10**9)] == [1, 1, 2, 21, 50]
    with pytest.raises(ValueError, match="bytes_per_token"):
        RateLimit(1.0, 1, bytes_per_token=0)
    assert RateLimit.from_mapping({"requests_per_s": 1, "burst": 2, "bytes_per_token": 8}) == \
        RateLimit(1, 2, 8)


def test_a_large_batch_costs_its_size_not_one_token():
    """Burst 10, 1 KiB a token: ten small requests pass, but only two 4.5 KiB ones (5 tokens
    each). One token per request would have let ten large ones through."""
    app = make_app(rate_limit=RateLimit(0.01, 10, bytes_per_token=1024))
    big = b'{"rates": [' + b",".join(b'{"type": 1, "rate_bps": 1.0}' for _ in range(160)) + b"]}"
    assert 4 * 1024 < len(big) < 5 * 1024
    with TestClient(app) as c:
        codes = [c.post("/v1/sessions/nope/rates", content=big,
                        headers={**H, "content-type": "application/json"}).status_code
                 for _ in range(3)]
        assert codes == [404, 404, 429]
        # another key's bucket is its own; its small requests take one token each
        assert [c.get("/v1/policy", headers=HA).status_code for _ in range(10)] == [200] * 10
        assert c.get("/v1/policy", headers=HA).status_code == 429
