"""The cost of the policy server's transport security: HTTPS (the default: uvicorn's TLS with
the PKI's ``policy-server`` identity) against plain HTTP (``security.insecure=true``), same
server settings otherwise, side by side in one run.

What is measured (median (min-max) over ``REPEATS`` (5) runs; the two servers' runs are
interleaved, HTTPS then HTTP, so drift of the shared machine hits both alike):

* **decide**: ``POST /v1/sessions/{id}/decide {"type": t}`` on a session of the ``tiny``
  scenario holding test window 0's rates, t cycling over the window's active types, one
  keep-alive ``httpx.Client`` sending them one after another (``DECIDE`` requests per run,
  after ``WARMUP`` untimed): requests per second and p50 / p95 latency. The server has no
  policy bundle: the greedy heuristic decides, a few microseconds, so the transport's cost
  is at its most visible (with a learned policy the same absolute cost is a smaller share).
* **create**: ``POST /v1/sessions`` with the tiny scenario's whole catalogue
  (``serving.scenario.session_body``), ``CREATE`` requests per run on the same kind of
  client (each created session deleted again after the run, untimed).
* **new connection**: ``GET /v1/health/live`` on a fresh connection each time (``CONNECT``
  per run): the TLS handshake's cost, which keep-alive clients (the adapters) pay once.

Both servers are ``serve.py`` subprocesses (:class:`serving.local.LocalServer`, uvicorn as
installed), pinned to core 0; this process, the client, to the other core. The API key's
rate limit is lifted (``rate_limit=null``) so the client is never throttled.

Usage: ``python bench/bench_security_server.py [--quick]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
ALLOWED = sorted(os.sched_getaffinity(0))
from _common import finish, fmt_stats, log, md_table, stats  # noqa: E402

REPEATS, WARMUP, DECIDE, CREATE, CONNECT = 5, 200, 2000, 200, 100
KEY = "bench-security-key-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0"
SERVER_CORE = ALLOWED[0]
CLIENT_CORE = ALLOWED[1] if len(ALLOWED) > 1 else ALLOWED[0]


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_loop(send: Any, n: int) -> dict[str, float]:
    lat = []
    t0 = time.perf_counter()
    for i in range(n):
        a = time.perf_counter()
        send(i)
        lat.append(time.perf_counter() - a)
    wall = time.perf_counter() - t0
    return {"rps": n / wall, "p50_ms": pct(lat, 0.5) * 1e3, "p95_ms": pct(lat, 0.95) * 1e3,
            "mean_ms": statistics.fmean(lat) * 1e3}


def measure(srv: Any, ps: Any) -> dict[str, dict[str, float]]:
    import httpx

    from serving.scenario import session_body

    w = ps.windows["test"][0]
    types = ps.instance(w).catalog_index.tolist()
    out = {}
    with srv.client(KEY, timeout=30) as c:
        sid = c.post("/v1/sessions", json=session_body(ps, w)).json()["session_id"]

        def decide(i: int) -> None:
            r = c.post(f"/v1/sessions/{sid}/decide", json={"type": types[i % len(types)]})
            if r.status_code != 200:
                raise RuntimeError(r.text)

        run_loop(decide, WARMUP)
        out["decide"] = run_loop(decide, DECIDE)
        body, created = session_body(ps), []

        def create(i: int) -> None:
            r = c.post("/v1/sessions", json=body)
            if r.status_code != 201:
                raise RuntimeError(r.text)
            created.append(r.json()["session_id"])

        out["create"] = run_loop(create, CREATE)
        for s in [sid, *created]:
            c.delete(f"/v1/sessions/{s}")

    def connect(i: int) -> None:
        with httpx.Client(base_url=srv.url, verify=srv.verify, timeout=30) as fresh:
            if fresh.get("/v1/health/live").status_code != 200:
                raise RuntimeError("not live")

    out["connect"] = run_loop(connect, CONNECT)
    return out


def bundle_costs(repeats: int = 7) -> dict[str, dict[str, float]]:
    """Milliseconds to verify the committed example bundle's signature
    (:func:`serving.bundles.signing.verify_bundle`: hash every file, one Ed25519 verification)
    and to load it whole (:func:`serving.bundles.static.load_bundle`, verification included),
    after one warm-up each; median (min-max) of ``repeats``."""
    from serving.bundles.signing import BundleTrust, verify_bundle
    from serving.bundles.static import load_bundle

    root = Path(__file__).resolve().parents[1]
    bundle = root / "checkpoints" / "default"
    trust = BundleTrust.from_security(keys=[root / "configs" / "keys" / "example-bundle.pub"])
    out = {}
    for name, fn in (("verify_bundle", lambda: verify_bundle(bundle, trust)),
                     ("load_bundle", lambda: load_bundle(bundle, trust=trust))):
        fn()
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        out[name] = stats(ts)
    return out


def main() -> None:
    global REPEATS, WARMUP, DECIDE, CREATE, CONNECT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 run, fewer requests")
    args = ap.parse_args()
    if args.quick:
        REPEATS, WARMUP, DECIDE, CREATE, CONNECT = 1, 50, 300, 50, 20
    t_start = time.perf_counter()
    os.sched_setaffinity(0, {CLIENT_CORE})

    from envs.dsmd.problems import build_problems
    from envs.dsmd.scenarios import load_scenario
    from security.tls import Security
    from serving.local import LocalServer

    ps = build_problems(load_scenario("tiny"), cache_dir=None)
    tmp = Path(tempfile.mkdtemp(prefix="bench-security-"))
    modes = {"https": Security(), "http": Security(insecure=True)}
    servers = {m: LocalServer(None, tmp / m, api_key=KEY, security=sec, cpu=str(SERVER_CORE),
                              overrides=["rate_limit=null"]) for m, sec in modes.items()}
    runs: dict[str, dict[str, list[dict[str, float]]]] = {m: {} for m in modes}
    log(f"bench_security_server: {REPEATS} runs; server core {SERVER_CORE}, client core "
        f"{CLIENT_CORE}")
    try:
        for s in servers.values():
            s.start()
        for r in range(REPEATS):
            for m, s in servers.items():
                res = measure(s, ps)
                for k, v in res.items():
                    runs[m].setdefault(k, []).append(v)
                log(f"  run {r + 1}/{REPEATS} {m}: " + ", ".join(
                    f"{k} {v['rps']:,.0f}/s p50 {v['p50_ms']:.2f} ms" for k, v in res.items()))
    finally:
        for s in servers.values():
            s.stop()
    bundle = bundle_costs()
    summary = {m: {k: {q: stats([x[q] for x in xs]) for q in ("rps", "p50_ms", "p95_ms")}
                   for k, xs in per.items()} for m, per in runs.items()}
    labels = {"decide": "POST .../decide (keep-alive)",
              "create": "POST /v1/sessions (keep-alive)",
              "connect": "GET /v1/health/live, new connection each"}
    rows = []
    for k, label in labels.items():
        for m in modes:
            s = summary[m][k]
            rows.append([label, m.upper(), fmt_stats(s["rps"]),
                         fmt_stats(s["p50_ms"], "{:.2f}"), fmt_stats(s["p95_ms"], "{:.2f}")])
    table = md_table(["request", "transport", "requests/s", "p50 ms", "p95 ms"], rows)
    table += "\n\n" + md_table(
        ["signed bundle (checkpoints/default)", "ms"],
        [["verify the signature (hash every file, one Ed25519 verification)",
          fmt_stats(bundle["verify_bundle"], "{:.2f}")],
         ["load the bundle, verification included", fmt_stats(bundle["load_bundle"],
                                                              "{:.2f}")]])
    notes = [f"median (min-max) of {REPEATS} runs, HTTPS and HTTP runs interleaved; one "
             f"keep-alive httpx client, one request at a time ({DECIDE} decisions, {CREATE} "
             f"session creations, {CONNECT} new connections per run)",
             "tiny scenario, no policy bundle (greedy heuristic decisions): the transport's "
             "cost at its most visible",
             f"server (serve.py, uvicorn) pinned to core {SERVER_CORE}, client to core "
             f"{CLIENT_CORE}; rate_limit=null",
             "HTTPS: TLS 1.3 with the development PKI's policy-server certificate (ECDSA "
             "P-256), verified by the client against the CA"]
    total = time.perf_counter() - t_start
    finish("bench_security_server", {"settings": {"repeats": REPEATS, "warmup": WARMUP,
                                                  "decide": DECIDE, "create": CREATE,
                                                  "connect": CONNECT, "quick": args.quick},
                                     "summary": summary, "runs": runs, "bundle_ms": bundle,
                                     "total_s": total},
           table, notes, total)


if __name__ == "__main__":
    main()
