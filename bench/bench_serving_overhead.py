"""The policy server's ``decide`` against a bare FastAPI endpoint on the same core: how much
of a request the project's server adds (authentication, rate limits, ownership, limits,
metrics, the decision itself) over FastAPI and uvicorn alone.

Every server runs in a subprocess pinned to core 0 (``taskset``); the load generator runs in
this process pinned to core 1. Closed loop: ``conns`` keep-alive connections each send
``POST /v1/sessions/{id}/decide {"type": t}`` back to back (``t`` cycling over test window
0's active types at ``godaddy``), for ``seconds`` after 1 s of warm-up; the figure is
completed requests per second, every answer checked (200, and for the project's server a
decision taken by the policy).

- **ours**: ``serve.py`` with the committed default bundle (``checkpoints/default``), API
  keys, the rate limiter and every other default on, as deployed
  (``serving.local.LocalServer``), one session created first; only the key's rate is raised
  (``LIMIT_LIFTED``: the deployed 2,000 requests/s per key would refuse most of this load).
- **bare**: FastAPI and uvicorn with the same protocol (httptools) and event loop, one
  route at the same path taking the same body (a pydantic model of ``type`` and
  ``explain``) and answering a JSON object of the same fields (a fixed decision): no
  middleware, no dependency, no decision.
- **bare + ONNX Runtime**: the bare route that also runs the policy's actor once through
  ONNX Runtime (the bundle's single-row runner, ``PolicyBundle.bound_row``, on one
  recorded observation) before answering the fixed decision: what a server on FastAPI's
  request path spends at least to decide with this actor through ONNX Runtime, with no
  observation, decoding or state of its own.

Every bare variant loads the same bundle and session at start (the same process
footprint), so that they differ only by what their route runs.
- **bare + decision**: the bare route deciding with the project's ``Session.decide`` and
  the same bundle (no key, limit, metric or ownership check).

Each is measured over HTTP and over HTTPS (TLS 1.3 with the PKI's ``policy-server``
identity for both; the client checks it against the PKI's CA), with 1 and with 8
connections; ``repeats`` alternating runs of each, median (min-max). The ratio is ours /
bare of the medians (target: at least 0.9x everywhere).

Usage: ``python bench/bench_serving_overhead.py [--quick]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, finish, fmt_stats, log, md_table, stats

sys.path.insert(0, str(ROOT / "bench"))

import bench_serving as bs
import httpx

from envs.netutil import free_ports
from security.tls import Security, client_ssl_context
from serving.local import LocalServer

TICKS_S = os.sysconf("SC_CLK_TCK")
#: the key's token bucket stays in the path (its cost is measured) but never refuses: as
#: deployed it allows 2,000 requests/s per key, below what one core serves here
LIMIT_LIFTED = ["rate_limit.requests_per_s=1000000", "rate_limit.burst=1000000"]

BARE = r'''
import json
import sys

port, cert, key, session_file = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
mode = sys.argv[5]  # "fixed", "onnx" or "decide"
if session_file != "-":  # every mode loads the project's Session and bundle (the same
    # process footprint), so that the modes differ only by what their route runs
    sys.path.insert(0, "bench")
    import bench_serving as bs  # first: it pins numpy's threads before numpy is imported

    policy = bs.LoadedPolicy(bs.load_bundle(bs.BUNDLE, trust=bs.TRUST), 1, 0.0)
    with open(session_file) as f:
        session = bs.fresh_session(json.load(f), policy)
    runner = policy.bound_row()  # holds the last observation fresh_session's decisions made

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel

class DecideRequest(BaseModel):
    type: int
    explain: bool = False

app = FastAPI()

if mode == "fixed":  # bare: a fixed decision
    @app.post("/v1/sessions/{session_id}/decide")
    async def decide(session_id: str, body: DecideRequest) -> dict:
        return {"type": body.type, "channel": 3, "source": "policy", "reason": None,
                "policy_version": 1, "policy_hash": "0" * 64, "session_version": 7}
elif mode == "onnx":  # bare + ONNX Runtime: the actor run once, the decision fixed
    @app.post("/v1/sessions/{session_id}/decide")
    async def decide(session_id: str, body: DecideRequest) -> dict:
        runner.run()
        return {"type": body.type, "channel": 3, "source": "policy", "reason": None,
                "policy_version": 1, "policy_hash": "0" * 64, "session_version": 7}
else:
    @app.post("/v1/sessions/{session_id}/decide")
    async def decide(session_id: str, body: DecideRequest) -> dict:
        (d,) = session.decide([body.type], policy, fallback="greedy", explain=body.explain)
        return {"type": d.type_id, "channel": d.channel, "source": d.source,
                "reason": d.reason, "policy_version": policy.version,
                "policy_hash": policy.hash, "session_version": session.version}

tls = {"ssl_certfile": cert, "ssl_keyfile": key} if cert != "-" else {}
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", http="httptools",
            access_log=False, **tls)
'''


class BareServer:
    """The bare FastAPI endpoint (module docstring) in a subprocess pinned to ``core``;
    ``mode`` "fixed" (bare), "onnx" (bare + ONNX Runtime) or "decide" (bare + decision),
    the last two on the session of ``session_file`` (a ``Session.from_snapshot``
    document)."""

    def __init__(self, core: int, tls: tuple[str, str] | None, mode: str = "fixed",
                 session_file: Path | None = None) -> None:
        self.port = free_ports(1)[0]
        cert, key = tls or ("-", "-")
        self.proc = subprocess.Popen(
            ["taskset", "-c", str(core), sys.executable, "-c", BARE, str(self.port), cert,
             key, str(session_file or "-"), mode], cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with socket_to(self.port):
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("the bare server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def socket_to(port: int) -> Any:
    import socket

    return socket.create_connection(("127.0.0.1", port), timeout=0.5)


async def closed_loop(port: int, reqs: list[bytes], tls: ssl.SSLContext | None, conns: int,
                      seconds: float, check: bool) -> dict[str, float]:
    """``conns`` connections sending back to back: completed requests/s after 1 s."""
    streams = [await asyncio.open_connection("127.0.0.1", port, ssl=tls,
                                             server_hostname="127.0.0.1" if tls else None)
               for _ in range(conns)]
    done = bad = total = 0
    start = time.perf_counter() + 1.0
    end = start + seconds

    async def worker(k: int) -> None:
        nonlocal done, bad, total
        reader, writer = streams[k]
        i = k
        while True:
            now = time.perf_counter()
            if now >= end:
                writer.close()
                return
            status, body = await bs.roundtrip(reader, writer, reqs[i % len(reqs)])
            i += conns
            total += 1
            if now >= start:
                done += 1
                if status != 200 or (check and not bs.policy_decided(body)):
                    bad += 1

    await asyncio.gather(*(worker(k) for k in range(conns)))
    return {"req_s": done / seconds, "errors": bad, "requests": total}


def _us(v: float) -> str:
    return str(round(v))  # no "-0"


def requests_for(port: int, sid: str, types: list[int]) -> list[bytes]:
    return [bs.request_bytes(port, f"/v1/sessions/{sid}/decide", {"type": t}) for t in types]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 s per run, 2 repeats")
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    seconds = args.seconds or (2.0 if args.quick else 5.0)
    repeats = args.repeats or (2 if args.quick else 3)
    server_core, client_core = bs.SERVER_CORE, bs.CLIENT_CORE  # bench_serving pinned core 0
    if server_core == client_core:
        raise SystemExit("needs 2 cores: the server on one, the load generator on the other")
    os.sched_setaffinity(0, {client_core})
    t0 = time.perf_counter()
    ps = bs.problems_for(bs.SCENARIO)
    body_w = bs.session_body(ps, next(iter(ps.windows["test"])))
    secure = Security()
    ident = secure.identity("policy-server")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in ("http", "https"):
            sec = bs.PLAIN if scheme == "http" else secure
            ctx = None if scheme == "http" else client_ssl_context(secure,
                                                                   expect="policy-server")
            ours = LocalServer(bs.BUNDLE, Path(tmp), api_key=bs.KEY, admin_key=bs.ADMIN,
                               cpu=str(server_core), security=sec, overrides=LIMIT_LIFTED)
            ours.start(timeout_s=90)
            try:
                with httpx.Client(base_url=ours.url, verify=ours.verify, timeout=30,
                                  headers={"X-API-Key": bs.KEY}) as c:
                    sid = c.post("/v1/sessions", json=body_w).json()["session_id"]
                    r = c.post(f"/v1/sessions/{sid}/decide/batch", json={"replan": True})
                    types = sorted(d["type"] for d in r.json()["decisions"])
                ours_reqs = requests_for(ours.port, sid, types)
                snap_file = Path(tmp) / "session.json"
                snap_file.write_text(json.dumps(bs.snapshot_of(body_w)))
                tls = None if scheme == "http" else (str(ident.cert), str(ident.key))
                bares: list[BareServer] = []
                try:
                    for mode in ("fixed", "onnx", "decide"):
                        bares.append(BareServer(server_core, tls, mode, snap_file))
                    bare, onnx, decided = bares
                    assert ours.proc is not None
                    servers = (("bare", bare.port, requests_for(bare.port, sid, types), False,
                                bare.proc.pid),
                               ("bare + ONNX Runtime", onnx.port,
                                requests_for(onnx.port, sid, types), False, onnx.proc.pid),
                               ("bare + decision", decided.port,
                                requests_for(decided.port, sid, types), True,
                                decided.proc.pid),
                               ("ours", ours.port, ours_reqs, True, ours.proc.pid))
                    for conns in (1, 8):
                        runs: dict[str, list[float]] = {name: [] for name, *_ in servers}
                        cpu: dict[str, list[float]] = {name: [] for name, *_ in servers}
                        errors = 0
                        for _ in range(repeats):
                            for name, port, reqs, check, pid in servers:
                                t_before = bs.proc_ticks(pid)
                                res = asyncio.run(closed_loop(port, reqs, ctx, conns, seconds,
                                                              check))
                                cpu[name].append((bs.proc_ticks(pid) - t_before) / TICKS_S * 1e6
                                                 / res["requests"])
                                runs[name].append(res["req_s"])
                                errors += int(res["errors"])
                        key = f"{scheme}, {conns} connection{'s' if conns > 1 else ''}"
                        results[key] = {name: stats(v) for name, v in runs.items()}
                        results[key]["cpu_us"] = {name: stats(v) for name, v in cpu.items()}
                        results[key]["errors"] = errors
                        log(f"[{key}] " + ", ".join(f"{name} {fmt_stats(results[key][name])}"
                                                    for name in runs) + " req/s; server CPU "
                            "per request " + ", ".join(
                                f"{name} {fmt_stats(results[key]['cpu_us'][name])}"
                                for name in runs) + f" us; errors {errors}")
                finally:
                    for server in bares:
                        server.stop()
            finally:
                ours.stop()
    rows, cpu_rows = [], []
    for key, r in results.items():
        ours, bare, onnx, ceiling = (r[k]["median"] for k in
                                     ("ours", "bare", "bare + ONNX Runtime", "bare + decision"))
        r["ratio"], r["ceiling"], r["ratio_to_ceiling"] = ours / bare, ceiling / bare, \
            ours / ceiling
        r["onnx_ceiling"] = onnx / bare
        med = {k: r["cpu_us"][k]["median"] for k in r["cpu_us"]}
        cpu_rows.append([key, *(f"{med[k]:.0f}" for k in ("bare", "bare + ONNX Runtime",
                                                          "bare + decision", "ours")),
                         _us(med["bare + ONNX Runtime"] - med["bare"]),
                         _us(med["bare + decision"] - med["bare"]),
                         _us(med["ours"] - med["bare + decision"]),
                         _us(1e6 / (9 * bare))])
        rows.append([key, fmt_stats(r["ours"]), fmt_stats(r["bare"]),
                     fmt_stats(r["bare + ONNX Runtime"]), fmt_stats(r["bare + decision"]),
                     f"**{r['ratio']:.2f}x**", f"{r['onnx_ceiling']:.2f}x",
                     f"{r['ceiling']:.2f}x", f"{r['ratio_to_ceiling']:.2f}x", str(r["errors"])])
    table = md_table(["transport, load", "ours (req/s)", "bare FastAPI (req/s)",
                      "bare + ONNX Runtime (req/s)", "bare + decision (req/s)",
                      "ours / bare", "bare + ONNX Runtime / bare", "bare + decision / bare",
                      "ours / (bare + decision)", "errors"], rows)
    table += "\n\n" + md_table(
        ["transport, load", "server CPU per request (us): bare", "bare + ONNX Runtime",
         "bare + decision", "ours", "ONNX Runtime adds", "the decision (actor included) adds",
         "ours adds over bare + decision", "0.9x allows over bare"], cpu_rows)
    notes = [f"server pinned to core {server_core}, load generator to core {client_core}; "
             f"closed loop, {seconds:g} s per run after 1 s of warm-up, {repeats} alternating "
             "runs of each server, median (min-max)",
             "ours: serve.py with the committed default bundle, API keys and every default "
             "on but the key's rate limit raised to 10^6 requests/s (the limiter still runs); "
             "bare: one FastAPI route taking the same body and answering the same fields "
             "with a fixed decision; bare + ONNX Runtime: the same route running the "
             "policy's actor once through ONNX Runtime (the bundle's single-row runner on "
             "one recorded observation) before the fixed answer; bare + decision: the same "
             "route deciding with the project's Session.decide and the same bundle (no key, "
             "limit, metric or ownership check)",
             "every bare variant loads the same bundle and session at start, so they differ "
             "only by what their route runs",
             "server CPU per request: the server process's user + system time (all its "
             "threads, /proc) over each run, warm-up and connection set-up included, "
             "divided by the requests it answered, median over the runs; '0.9x allows' is "
             "the time per request a server may add to bare's and still answer 0.9x its "
             "requests in this closed loop, 1 / (9 x bare's requests/s) (CPU where the "
             "core is the bottleneck, latency where it is not)",
             "target: ours / bare at least 0.9x in every row; 'bare + ONNX Runtime / bare' "
             "bounds it for a server on FastAPI's request path that runs this actor "
             "through ONNX Runtime, 'bare + decision / bare' for one that decides as the "
             "project does with no overhead of its own"]
    finish("bench_serving_overhead", {"results": results,
                                      "settings": {"seconds": seconds, "repeats": repeats,
                                                   "quick": args.quick}},
           table, notes, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
