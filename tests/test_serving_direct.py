"""The decision path's direct form (``serving.api.direct``) answers byte for byte as the
endpoint as declared, refusals, limits and metrics included, and skips FastAPI's dependency
solving on a plain request."""

from __future__ import annotations

import re

import fastapi.routing
import pytest
from fastapi.testclient import TestClient

from serving.access import ANONYMOUS, RateLimit
from serving.app import ServerSettings, create_app
from serving.scenario import rates_body, session_body

KEY, ADMIN = (f"{n}-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0" for n in ("controller-key", "admin-key"))
H, HA = {"X-API-Key": KEY}, {"X-API-Key": ADMIN}
#: requests a key may send before the rate limit refuses (a refill too slow to matter here)
BURST = 24


def _app(bundle, declared: bool):
    app = create_app(ServerSettings(bundle=str(bundle), api_keys=[KEY], admin_keys=[ADMIN],
                                    rate_limit=RateLimit(1e-3, BURST)))
    if declared:  # any override sends every request the declared way
        app.dependency_overrides[object] = object
    return app


def _requests(sid: str, types: list[int]) -> list[tuple[str, dict, object]]:
    """(path, headers, body): the plain cases, then every kind of refusal."""
    path = f"/v1/sessions/{sid}/decide"
    json_h = H | {"Content-Type": "application/json"}
    out: list[tuple[str, dict, object]] = []
    for i, t in enumerate(types):
        out.append((path, H, {"type": t, "explain": i % 2 == 1}))
    out += [
        (path, H | {"Content-Type": "application/json; charset=utf-8"}, b'{"type": 1}'),
        (path, {"X-API-Key": KEY}, b'{"type": 2}'),           # no content type: JSON
        (path, H, {"type": 10**9}),                             # a type the session lacks
        (path, H, {"type": -1}),
        (path, H, {"type": "3"}),
        (path, H, {"type": 1, "extra": 0}),
        (path, H, {"type": True}),
        (path, json_h, b'{"type": NaN}'),
        (path, json_h, b'{"type": 1e400}'),
        (path, json_h, b'{"type": 1'),
        (path, json_h, b""),
        (path, json_h, b"\xff\xfe"),
        (path, H | {"Content-Type": "text/plain"}, b'{"type": 1}'),
        (path, {}, {"type": 1}),                                # no key
        (path, {"X-API-Key": ""}, {"type": 1}),                 # an empty key
        (path, {"X-API-Key": "wrong"}, {"type": 1}),
        (path, {"X-API-Key": "wrong"}, {"type": -1}),           # a bad key and a bad body
        (path, HA, {"type": 1}),                                # an admin key decides too
        ("/v1/sessions/nope/decide", H, {"type": 1}),
        ("/v1/sessions/nope/decide", H, {"type": -1}),
    ]
    return out + [(path, H, {"type": types[0]})] * 6  # over the burst: 429s


def _send(c: TestClient, path: str, headers: dict, body: object):
    if isinstance(body, bytes):
        return c.post(path, content=body, headers=headers)
    return c.post(path, json=body, headers=headers)


def _metric_lines(text: str) -> list[str]:
    """The metrics' counters (not the timings) of the decision path and the refusals."""
    keep = re.compile(r"^smart_(requests_total|access_refused_total|decisions_total"
                      r"|rate_limited_total)")
    return sorted(line for line in text.splitlines() if keep.match(line))


def test_direct_decide_answers_as_the_declared_endpoint(tiny_bundles, tiny_problems,
                                                        monkeypatch) -> None:
    ps = tiny_problems
    inst = ps.instance(ps.windows["test"][0])
    types = [int(t) for t in inst.catalog_index[:12]]
    solved = {"n": 0}
    solve = fastapi.routing.solve_dependencies

    async def counting(*a, **kw):
        solved["n"] += 1
        return await solve(*a, **kw)
    monkeypatch.setattr(fastapi.routing, "solve_dependencies", counting)

    answers, metrics, solves = {}, {}, {}
    for declared in (False, True):
        with TestClient(_app(tiny_bundles["a"], declared)) as c:
            r = c.post("/v1/sessions", json=session_body(ps) | {"seed": 3}, headers=H)
            assert r.status_code == 201, r.text
            sid = r.json()["session_id"]
            assert c.post(f"/v1/sessions/{sid}/rates", json=rates_body(inst),
                          headers=H).status_code == 200
            solved["n"] = 0
            got = []
            for path, headers, body in _requests(sid, types):
                r = _send(c, path, headers, body)
                got.append((r.status_code, r.headers.get("content-type"),
                            r.headers.get("www-authenticate"), r.headers.get("retry-after"),
                            r.content.replace(sid.encode(), b"<sid>")))
            solves[declared] = solved["n"]
            answers[declared] = got
            metrics[declared] = _metric_lines(c.get("/v1/metrics", headers=HA).text)
    for i, (a, b) in enumerate(zip(answers[False], answers[True], strict=True)):
        assert a == b, (i, a, b)
    assert {a[0] for a in answers[False]} >= {200, 401, 404, 422, 429}
    assert metrics[False] == metrics[True] and metrics[False]
    # the 13 plain requests and the refusals after the body was read (key, session, rate
    # limit: 12) solved no dependency on the direct path
    assert solves[True] - solves[False] == 25, solves


@pytest.mark.parametrize("status", [200, 422])
def test_direct_decide_gives_way_to_dependency_overrides(tiny_bundles, tiny_problems,
                                                         status) -> None:
    """An embedder's override of the key check (``app.state.require_controller``) holds on
    the decision path: no key needed."""
    ps = tiny_problems
    app = _app(tiny_bundles["a"], declared=False)
    app.dependency_overrides[app.state.require_controller] = lambda: ANONYMOUS
    with TestClient(app) as c:
        sid = c.post("/v1/sessions", json=session_body(ps)).json()["session_id"]
        inst = ps.instance(ps.windows["test"][0])
        assert c.post(f"/v1/sessions/{sid}/rates", json=rates_body(inst)).status_code == 200
        t = int(inst.catalog_index[0])
        r = c.post(f"/v1/sessions/{sid}/decide", json={"type": t if status == 200 else -1})
        assert r.status_code == status, r.text


class _Refusing:
    """An embedder's key gate (``app.state.access``) that refuses every controller."""

    def controller(self, request, key, body_bytes=0):
        from fastapi import HTTPException

        raise HTTPException(403, "refused by the embedder's gate")


def test_direct_decide_checks_keys_with_the_apps_gate(tiny_bundles, tiny_problems) -> None:
    """The direct form asks the app's gate (``app.state.access``), as ``require_controller``
    does: an embedder's own gate holds on the decision path too."""
    ps = tiny_problems
    answers = []
    for declared in (False, True):
        app = _app(tiny_bundles["a"], declared)
        with TestClient(app) as c:
            sid = c.post("/v1/sessions", json=session_body(ps), headers=H).json()["session_id"]
            app.state.access = _Refusing()
            r = c.post(f"/v1/sessions/{sid}/decide", json={"type": 1}, headers=H)
            answers.append((r.status_code, r.content))
    assert answers[0] == answers[1] and answers[0][0] == 403, answers


def test_direct_decide_answers_a_client_that_left_as_declared(tiny_bundles,
                                                              tiny_problems) -> None:
    """A client that leaves while sending its body: 400, as the declared endpoint answers
    (not a 500 from the direct form's body read)."""
    import asyncio

    async def call(app, sid: str) -> list[dict]:
        path = f"/v1/sessions/{sid}/decide"
        msgs = [{"type": "http.request", "body": b'{"ty', "more_body": True},
                {"type": "http.disconnect"}]
        out: list[dict] = []

        async def receive() -> dict:
            return msgs.pop(0) if msgs else {"type": "http.disconnect"}

        async def send(m: dict) -> None:
            out.append(m)
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
                 "server": ("127.0.0.1", 80),
                 "headers": [(b"x-api-key", KEY.encode()),
                             (b"content-type", b"application/json")]}
        await app(scope, receive, send)
        return out

    got = []
    for declared in (False, True):
        app = _app(tiny_bundles["a"], declared)
        with TestClient(app) as c:
            sid = c.post("/v1/sessions", json=session_body(tiny_problems),
                         headers=H).json()["session_id"]
            out = asyncio.run(call(app, sid))
        got.append((out[0]["status"], b"".join(m.get("body", b"") for m in out[1:])))
    assert got[0] == got[1] and got[0][0] == 400, got
