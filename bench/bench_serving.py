"""Decision latency of the policy server: in process, over HTTP on loopback,
and through the controller adapter, at ``godaddy`` with the committed default bundle
(``checkpoints/default``: DDPG, ``channel`` observation, ``feasible`` decoding).

What is measured (latencies in ms; every measurement is repeated ``REPEATS`` (3) times and
the table gives the median (min-max) over the runs of each run's percentile; sample counts
are the ``FULL`` settings, ``--quick`` uses ``QUICK``):

1. **In process, one decision**: ``Session.decide([t], policy)`` on a ``Session`` holding a
   test window's rates (``serving.scenario.session_body``), after one untimed decision of the
   whole window (so every call re-decides one type given the rest, as a controller asking
   again would). Types are cycled in catalogue order; each run uses a fresh session for each
   of the 4 test windows, ``warmup`` untimed calls, then ``single`` / 4 timed calls per
   window (pooled). **Split**: the same loop with the body of ``Session.decide`` inlined and
   each stage timed on its own (finding the type and the policy's single-row runner; taking
   the type off its channel and observing it into the runner's bound input,
   ``DecisionStep.observe``, one compiled call; ONNX Runtime, the runner's ``run``; decoding
   and moving the type, ``DecisionStep.apply``, one compiled call); before timing, the inlined
   copy is checked to make the same decisions as ``Session.decide`` on a twin session. The
   raw ``InferenceSession.run`` on recorded observations in a tight loop (weights and code
   hot in cache) is timed as well, and, for the ratio target, ``Session.decide`` and the raw
   call alternately (each decision followed by one raw call), so that both see the machine
   in the same state. Target: p99 <= 0.1 ms. **Paced**: the same call on test
   window 0's session once every ``PACED_GAP_S`` (10 ms), the process sleeping in between
   (``paced`` samples after 20 untimed), i.e. caches and branch predictors no longer warm
   from the previous call, as for a controller that asks now and then.
   **ASGI**: ``POST /v1/sessions/{id}/decide`` on test window 0 through the FastAPI app of
   ``serving.app.create_app`` called directly (middleware, auth, validation, the decision,
   the JSON response; no HTTP server), ``asgi`` calls after ``warmup`` untimed ones: the
   server's in-app cost without uvicorn.
2. **In process, batch of 1,000 types**: a session whose first 1,000 catalogue types (ids
   0..999) have rates: each type's rate and message count from the latest window (of all
   20, train/validation/test, in time order) in which it is active (every godaddy type is
   active in some window). ``decide(types_1000)`` with the 1,000 ids in the policy's decision
   order (rate x fan-out descending), after one untimed full decision, so each call
   re-decides every type given the rest; and ``decide(None, replan=True)`` (one episode from
   an empty assignment). ``batch`` timed calls per run after 2 untimed ones. Target: <= 10 ms.
   Also timed, to show what bounds the parallel batch: the policy call alone on its 1,000
   observations, and the actor's widest layer (32 -> 32 on 1,000 x (K+1) rows) as one
   NumPy float32 GEMM. **On every core**: the parallel batch and its policy call again with
   this process allowed all cores (``ALLOWED_CORES``) and the bundle loaded as an unpinned
   server loads it (``load_bundle(batch_threads=<cores>)``: the batch's chunks scored on
   that many threads), then the process is pinned back.
3. **HTTP on loopback**: ``serve.py`` (uvicorn as installed: asyncio loop, h11) in a fresh
   subprocess per run, pinned to one core (core 0, as ``taskset -c 0``); this process, the
   load generator, pinned to the other core (core 1). One session with test window 0's
   rates (``POST /v1/sessions``); ``POST /v1/sessions/{id}/decide {"type": t}`` with t
   cycling over the window's active types. Open loop at 100 and at 1,000 requests/s for
   ``http_s`` seconds each (after 1 s at 500/s, discarded): request i is scheduled at
   t0 + i / rate and handed to the first free one of ``CONNS`` keep-alive connections;
   latency = response received - scheduled time, so queueing in the client counts
   (no coordinated omission). The client is a minimal asyncio HTTP/1.1 client (pre-built
   request bytes, Content-Length framing) rather than httpx, to keep the client's own
   per-request CPU time small; the scheduler sleeps until 1 ms before each send time and
   spins the event loop for the rest (its lag behind the schedule is recorded). Errors =
   non-200 answers, broken connections, or a decision not taken by the policy. Also
   measured: the server's CPU time per request, main thread and all threads
   (``/proc/<pid>/task/*/stat``), and its mean in-app time (Prometheus histogram of the
   route, from ``/v1/metrics``). Batch over HTTP: ``POST .../decide/batch`` with the 1,000
   types of (2) on a second session, ``batch_http`` sequential calls (one in flight).
   Target: p99 <= 5 ms at 1,000 requests/s.
4. **Adapter**: ``ControllerAdapter.decide([t])`` (one type) after replaying test window 0's
   messages through ``submit``/``close_interval`` and one untimed ``decide(replan=True)``, as
   ``tests/test_serving_e2e.py`` builds it, in ``cached`` mode (local ``Session`` + ONNX
   Runtime; it polls ``GET /v1/policy`` every ``refresh_s`` = 5 s inside ``decide``) and in
   ``remote`` mode (one ``POST .../decide/batch`` per call over its httpx keep-alive client),
   against the same server as (3), the adapter running in this process on core 1, with a
   2 s request timeout (``ADAPTER_TIMEOUT_S``; the default 0.25 s only matters when a
   request is that slow, which the initial whole-window replan can be on a busy machine).

ONNX Runtime sessions: ``bundle`` is the session as ``serving.bundles.static.load_bundle`` creates
it (the server, the cached adapter and this benchmark's in-process runs all load through
it); ``ort_default`` is the same bundle with ONNX Runtime's default ``SessionOptions``
(``intra_op_num_threads=0``: one intra-op thread per physical core, the extra worker pinned
by ONNX Runtime to a core of its own choosing whatever the process's affinity, and
busy-waiting after every run), obtained by wrapping ``onnxruntime.InferenceSession`` so that
it drops the options it is given (in this process for the in-process and cached-adapter
runs; in the server through ``LAUNCHER``, which wraps it and then runs ``serve.py``); no
project code is changed. The single decisions, the HTTP open loops and the adapter are
measured with both; the batches with ``bundle`` only.

Garbage collection: after the set-up, the harness's own objects (traces, request bodies)
are frozen (``gc.freeze``), so collections during the in-process runs see about what a
server process holds; the load generator disables collection during an open loop.

Contention: the CPU time other processes used during each run (the machine's busy time in
``/proc/stat`` minus this process's and the server's) is recorded; a run where it exceeds
``FOREIGN_OK`` (0.1 cores) is re-run once (``RETRIES`` = 2 attempts), and the notes list the
re-runs. In-process and adapter runs whose process had less than 85% of its core (CPU time
/ wall time) are flagged in the notes, as is the load average.

Security: the server of the HTTP phase serves plain HTTP (``Security(insecure=True)``; the
load generator speaks raw HTTP/1.1), as do the adapters reaching it; this measures serving,
and the cost of TLS is measured by ``bench/bench_security_server.py``. Every bundle load
still verifies the bundle's signature (the committed example key, ``TRUST``).

Usage: ``python bench/bench_serving.py [--quick]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
ALLOWED_CORES = sorted(os.sched_getaffinity(0))  # before pin_one_core() narrows it
from _common import ROOT, finish, fmt_stats, log, md_table, pin_one_core, stats  # noqa: E402

CORE = pin_one_core()
SERVER_CORE = CORE
CLIENT_CORE = next((c for c in ALLOWED_CORES if c != CORE), CORE)

import asyncio  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from envs.dsmd.decision import decision_order  # noqa: E402
from envs.dsmd.instance import UNASSIGNED  # noqa: E402
from envs.dsmd.problems import ProblemSet, problems_for  # noqa: E402
from security.tls import Security  # noqa: E402
from serving.access import RateLimit  # noqa: E402
from serving.app import ServerSettings, create_app  # noqa: E402
from serving.bundles.signing import BundleTrust  # noqa: E402
from serving.bundles.static import load_bundle, row_inputs  # noqa: E402
from serving.client.static import ControllerAdapter  # noqa: E402
from serving.local import LocalServer  # noqa: E402
from serving.policy_store import LoadedPolicy, PolicyStore  # noqa: E402
from serving.scenario import adapter_for, replay_window, session_body  # noqa: E402
from serving.session import Session  # noqa: E402

SCENARIO = "godaddy"
BUNDLE = ROOT / "checkpoints" / "default"
# the committed example bundle is signed by the key whose public half is committed beside it
TRUST = BundleTrust.from_security(keys=[ROOT / "configs" / "keys" / "example-bundle.pub"])
# the HTTP phase's server and adapters: plain HTTP (the module docstring's Security)
PLAIN = Security(insecure=True)
REPEATS = 3
#: the key's token bucket in the ASGI run: it stays in the path (its cost is measured) but
#: never refuses (as deployed, 2,000 requests/s per key is below what the app serves here)
UNLIMITED = RateLimit(requests_per_s=1e6, burst=10**6)
KEY, ADMIN = "bench-key-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0", "bench-admin-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0"
BATCH_TYPES = 1000
RATES = (100, 1000)  # open-loop requests/s
CONNS = 16  # keep-alive connections of the load generator
CPU_SHARE_OK = 0.85
FOREIGN_OK = 0.1  # other processes' CPU (cores) during a run above this: re-run it
RETRIES = 2  # attempts of a contended run
# the adapter's request timeout: its default, 0.25 s, leaves little headroom for a remote
# decide(replan=True) of a whole window, so a busy machine would turn it into fallbacks
ADAPTER_TIMEOUT_S = 2.0
TARGET_SINGLE_MS = 0.1
TARGET_BATCH_MS = 10.0
TARGET_HTTP_MS = 5.0
ORT_CONFIGS = ("bundle", "ort_default")
ORT_LABEL = {"bundle": "load_bundle", "ort_default": "ORT defaults"}
PACED_GAP_S = 0.01
FULL = {"single": 20_000, "split": 10_000, "warmup": 1_000, "paced": 300, "asgi": 5_000,
        "batch": 15, "http_s": 10.0, "batch_http": 15, "cached": 5_000, "remote": 2_000}
QUICK = {"single": 6_000, "split": 3_000, "warmup": 500, "paced": 100, "asgi": 1_500,
         "batch": 5, "http_s": 3.0, "batch_http": 5, "cached": 1_500, "remote": 600}
# the server with ONNX Runtime's default session options: wrap InferenceSession so that it
# drops the options load_bundle gives it, then run serve.py
LAUNCHER = """
import runpy, sys
import onnxruntime as ort
_orig = ort.InferenceSession
def _default_options(path, sess_options=None, providers=None, **kw):
    return _orig(path, ort.SessionOptions(), providers=providers, **kw)
ort.InferenceSession = _default_options
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@contextmanager
def ort_config(config: str) -> Iterator[None]:
    """ONNX Runtime sessions created inside are ``config`` (see the module docstring)."""
    import onnxruntime as ort

    if config == "bundle":
        yield
        return
    orig = ort.InferenceSession

    def default_options(path, sess_options=None, providers=None, **kw):
        return orig(path, ort.SessionOptions(), providers=providers, **kw)

    ort.InferenceSession = default_options
    try:
        yield
    finally:
        ort.InferenceSession = orig


def _busy_ticks() -> int:
    """Busy clock ticks of the whole machine (/proc/stat: user, nice, system, irq, softirq)."""
    f = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(f[1]) + int(f[2]) + int(f[3]) + int(f[6]) + int(f[7])


def proc_ticks(pid: int) -> int:
    """User + system clock ticks of process ``pid`` (all its threads) so far."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])


def _own_ticks(pids: Sequence[int]) -> int:
    return sum(proc_ticks(pid) for pid in (os.getpid(), *pids))


class Contention:
    """Other processes' CPU over a block, in cores: the machine's busy time minus this
    process's and ``pids``' (a run above ``FOREIGN_OK`` shared its cores and is re-run)."""

    def __init__(self, pids: Sequence[int] = ()) -> None:
        self.pids = list(pids)
        self.t0, self.busy0, self.own0 = time.perf_counter(), _busy_ticks(), _own_ticks(pids)

    def cores(self) -> float:
        busy = _busy_ticks() - self.busy0
        own = _own_ticks(self.pids) - self.own0
        wall = time.perf_counter() - self.t0
        return max(busy - own, 0) / os.sysconf("SC_CLK_TCK") / max(wall, 1e-9)


def describe_session(policy) -> str:
    """The ONNX Runtime options of a loaded policy's session."""
    o = policy.bundle.scorer.ort_session.get_session_options()
    try:
        spin = o.get_session_config_entry("session.intra_op.allow_spinning")
    except Exception:  # not set: ORT's default
        spin = "default (1)"
    return (f"intra_op_num_threads={o.intra_op_num_threads}, inter_op_num_threads="
            f"{o.inter_op_num_threads}, allow_spinning={spin}")


def thread_affinities(pid: int) -> list[str]:
    """``name:allowed cores`` of each thread of ``pid``."""
    out = []
    for t in sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda x: int(x.name)):
        try:
            name = (t / "comm").read_text().strip()
            allowed = next(ln.split(":", 1)[1].strip() for ln in
                           (t / "status").read_text().splitlines()
                           if ln.startswith("Cpus_allowed_list"))
        except (OSError, StopIteration):
            continue
        out.append(f"{name}:{allowed}")
    return out


def _loop_and_parser() -> str:
    """What uvicorn's ``loop="auto"`` and ``http="auto"`` choose in this environment."""
    import importlib.util

    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return f"{loop} + {http}"


def pct(ms: np.ndarray) -> dict[str, float]:
    """p50 / p99 / max / mean / count of latencies in ms."""
    ms = np.asarray(ms, dtype=np.float64)
    return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)),
            "max": float(ms.max()), "mean": float(ms.mean()), "n": int(ms.size)}


class Timer:
    """Wall and process CPU time of a block: ``cpu_share`` below ~0.85 means the core was
    shared with another process."""

    def __enter__(self) -> Timer:
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self.t0
        self.cpu_share = (time.process_time() - self.c0) / max(self.wall, 1e-9)


# ---------------------------------------------------------------------------- sessions
def snapshot_of(body: dict) -> dict:
    """A ``Session.from_snapshot`` document from a ``POST /v1/sessions`` body."""
    snap = {k: body[k] for k in ("nodes", "controller", "num_topics", "interval_s",
                                 "scenario_signature", "seed")}
    snap["types"] = [{"id": t["id"], "destinations": t["destinations"],
                      "rate_bps": t.get("rate_bps", 0), "messages": t.get("messages", 1),
                      "channel": UNASSIGNED} for t in body["types"]]
    return snap


def batch_body(ps: ProblemSet) -> dict:
    """Session body whose types 0..BATCH_TYPES-1 have rates: each type's rate and message
    count of the latest window in which it is active."""
    latest: dict[int, tuple[int, int]] = {}
    for w in sorted(w for ws in ps.windows.values() for w in ws):
        inst = ps.instance(w)
        for c, r, m in zip(inst.catalog_index.tolist(), inst.rate_bps.tolist(),
                           inst.messages.tolist()):
            latest[int(c)] = (int(r), int(m))
    missing = [t for t in range(BATCH_TYPES) if t not in latest]
    if missing:
        raise RuntimeError(f"{len(missing)} of the first {BATCH_TYPES} types never active")
    body = session_body(ps)
    for t in body["types"]:
        if t["id"] < BATCH_TYPES:
            t["rate_bps"], t["messages"] = latest[t["id"]]
    return body


def active_ids(s: Session) -> list[int]:
    return [s.type_ids[int(i)] for i in s.active]


def fresh_session(snap: dict, policy) -> Session:
    """A session from ``snap`` with every active type decided once (untimed)."""
    s = Session.from_snapshot(snap)
    if s.compatibility(policy) is not None:
        raise RuntimeError(f"policy does not fit the session: {s.compatibility(policy)}")
    ds = s.decide(None, policy)
    if not ds or any(d.source != "policy" for d in ds):
        raise RuntimeError("the initial decisions were not all taken by the policy")
    return s


# ---------------------------------------------------------------------------- in process
def run_single(snaps: list[dict], policy, samples: int, warmup: int) -> dict[str, Any]:
    per = samples // len(snaps)
    lat: list[np.ndarray] = []
    cpu = []
    pc = time.perf_counter_ns
    for snap in snaps:
        s = fresh_session(snap, policy)
        types = active_ids(s)
        for i in range(warmup):
            s.decide([types[i % len(types)]], policy)
        out = np.empty(per, np.int64)
        with Timer() as tm:
            for i in range(per):
                t = types[i % len(types)]
                a = pc()
                s.decide([t], policy)
                out[i] = pc() - a
        cpu.append(tm.cpu_share)
        lat.append(out)
    ms = np.concatenate(lat) / 1e6
    return pct(ms) | {"cpu_share": min(cpu)}


def run_paced(snap: dict, policy, samples: int, gap_s: float) -> dict[str, Any]:
    """One decision every ``gap_s`` (sleeping between): what a controller that asks now and
    then sees (caches and branch predictors cold, the core idle)."""
    s = fresh_session(snap, policy)
    types = active_ids(s)
    lat = np.empty(samples, np.int64)
    for i in range(-20, samples):
        a = time.perf_counter_ns()
        s.decide([types[i % len(types)]], policy)
        if i >= 0:
            lat[i] = time.perf_counter_ns() - a
        time.sleep(gap_s)
    return pct(lat / 1e6)


async def _asgi(app, method: str, path: str, body: dict) -> tuple[int, bytes]:
    """One request through the ASGI app, no HTTP server: (status, body)."""
    raw = json.dumps(body, separators=(",", ":")).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80),
             "headers": [(b"x-api-key", KEY.encode()), (b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())]}
    pending = [{"type": "http.request", "body": raw, "more_body": False}]
    out: list[dict] = []

    async def receive() -> dict:
        if pending:
            return pending.pop()
        await asyncio.sleep(3600)  # not reached: the app reads the body once
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        out.append(message)

    await app(scope, receive, send)
    return out[0]["status"], b"".join(m.get("body", b"") for m in out[1:])


def run_asgi(body_w: dict, samples: int, warmup: int) -> dict[str, Any]:
    """``POST /v1/sessions/{id}/decide`` through the FastAPI app called directly (its
    middleware, validation, dependencies, Session.decide and JSON response; no uvicorn)."""
    app = create_app(ServerSettings(bundle=str(BUNDLE), api_keys=[KEY], admin_keys=[ADMIN],
                                    bundle_trust=TRUST, rate_limit=UNLIMITED))

    async def main() -> dict[str, Any]:
        async with app.router.lifespan_context(app):
            st, raw = await _asgi(app, "POST", "/v1/sessions", body_w)
            sid = json.loads(raw)["session_id"]
            st, raw = await _asgi(app, "POST", f"/v1/sessions/{sid}/decide/batch",
                                  {"replan": True})
            types = sorted(d["type"] for d in json.loads(raw)["decisions"])
            path = f"/v1/sessions/{sid}/decide"
            for i in range(warmup):
                await _asgi(app, "POST", path, {"type": types[i % len(types)]})
            lat = np.empty(samples, np.int64)
            bad, first_bad = 0, ""
            for i in range(samples):
                a = time.perf_counter_ns()
                st, raw = await _asgi(app, "POST", path, {"type": types[i % len(types)]})
                lat[i] = time.perf_counter_ns() - a
                if st != 200 or not policy_decided(raw):
                    bad += 1
                    first_bad = first_bad or f"status {st}: {raw[:200]!r}"
            if bad:  # a refusal is faster than a decision: the figure would be wrong
                raise RuntimeError(f"ASGI run: {bad} of {samples} answers were not a "
                                   f"decision by the policy (first: {first_bad})")
            return pct(lat / 1e6) | {"errors": bad}

    return asyncio.run(main())


STAGES = ("lookup", "observe", "onnx", "apply")


def _inlined(s: Session, t: int, policy, clock: Callable[[], int]) -> tuple[int, tuple, Any]:
    """``Session.decide([t], policy)`` inlined (usable policy, one type), each stage timed:
    finding the type and the policy's runner; taking it off its channel and observing it
    into the runner's input (``DecisionStep.observe``, one compiled call); ONNX Runtime
    (the runner's ``run``); decoding and moving it (``DecisionStep.apply``, one compiled
    call)."""
    a = clock()
    p = s._pos[s.slot(t)]
    slot = int(s.active[p])
    step = s.step
    step.begin([p])
    step.use_layout(policy.layout)
    runner = policy.bound_row()
    t1 = clock()
    obs = step.observe(runner.x)
    t2 = clock()
    scores = runner.run()
    t3 = clock()
    c = step.apply(scores, policy.decoding)
    t4 = clock()
    s.channel[slot] = c
    s.version += 1
    return c, (t1 - a, t2 - t1, t3 - t2, t4 - t3, t4 - a), (obs.copy(), scores.copy())


def check_inlined(snap: dict, policy) -> int:
    """The inlined copy decides exactly as ``Session.decide`` (twin sessions, same seed)."""
    s1, s2 = fresh_session(snap, policy), fresh_session(snap, policy)
    types = active_ids(s1)
    n = 0
    for i in range(2 * len(types)):
        t = types[(7 * i) % len(types)]
        (d,) = s1.decide([t], policy)
        c, _, _ = _inlined(s2, t, policy, time.perf_counter_ns)
        if d.channel != c:
            raise RuntimeError(f"inlined decide differs from Session.decide at call {i}")
        n += 1
    if not np.array_equal(s1.channel, s2.channel):
        raise RuntimeError("inlined decide left another assignment")
    return n


def run_split(snaps: list[dict], policy, samples: int, warmup: int) -> dict[str, Any]:
    per = samples // len(snaps)
    rows, obs_kept = [], []
    not_argmax = 0
    pc = time.perf_counter_ns
    for snap in snaps:
        s = fresh_session(snap, policy)
        types = active_ids(s)
        for i in range(warmup):
            _inlined(s, types[i % len(types)], policy, pc)
        out = np.empty((per, len(STAGES) + 1), np.int64)
        for i in range(per):
            c, tt, (obs, scores) = _inlined(s, types[i % len(types)], policy, pc)
            out[i] = tt
            not_argmax += c != int(scores.argmax())
            if len(obs_kept) < 2000 and i % 3 == 0:
                obs_kept.append(obs)
        rows.append(out)
    us = np.concatenate(rows) / 1e3
    res = {name: pct(us[:, j]) for j, name in enumerate((*STAGES, "total"))}  # in us
    res["not_argmax_share"] = not_argmax / us.shape[0]
    # raw ONNX Runtime in a tight loop: the floor of the policy call
    sess = policy.bundle.scorer.row_ort_session  # what a single row runs on
    x = [row_inputs(sess, o) for o in obs_kept]
    for i in range(500):
        sess.run(["scores"], x[i % len(x)])
    raw = np.empty(per * 2, np.int64)
    for i in range(raw.size):
        a = pc()
        sess.run(["scores"], x[i % len(x)])
        raw[i] = pc() - a
    res["ort_run_hot"] = pct(raw / 1e3)
    # the ratio target side by side: each Session.decide([t]) followed by one raw call on a
    # recorded observation, so both see the same state of the machine (its speed drifts)
    dec, raw2 = [], []
    for snap in snaps:
        s = fresh_session(snap, policy)
        types = active_ids(s)
        for i in range(warmup + per):
            t = types[i % len(types)]
            a = pc()
            s.decide([t], policy)
            b = pc()
            sess.run(["scores"], x[i % len(x)])
            if i >= warmup:
                dec.append(b - a)
                raw2.append(pc() - b)
    res["paired_decide"] = pct(np.array(dec) / 1e3)
    res["paired_raw"] = pct(np.array(raw2) / 1e3)
    res["paired_ratio"] = res["paired_decide"]["p50"] / res["paired_raw"]["p50"]
    # the same graph cut to one channel: what ONNX Runtime spends per call whatever the size
    one = one_channel_session(sess)
    if one is not None:
        x1 = [{k: v[..., :1] if k == "features" else v for k, v in xi.items()} for xi in x[:50]]
        for i in range(500):
            one.run(["scores"], x1[i % len(x1)])
        for i in range(raw.size):
            a = pc()
            one.run(["scores"], x1[i % len(x1)])
            raw[i] = pc() - a
        res["ort_fixed_hot"] = pct(raw / 1e3)
    return res


def floors_note(inproc: list[dict]) -> str:
    """The in-process targets against what bounds them (medians over the runs of each run's
    p50, ``load_bundle``'s session): ``Session.decide`` over the raw ONNX Runtime call, and
    the sequential batch of 1,000 against 1,000 raw calls, which it cannot beat."""
    dec = stats([r["single"]["bundle"]["p50"] * 1e3 for r in inproc])["median"]
    raw = stats([r["split"]["bundle"]["ort_run_hot"]["p50"] for r in inproc])["median"]
    sp = [r["split"]["bundle"] for r in inproc]
    ratio = stats([x["paired_ratio"] for x in sp])
    out = (f"floors: side by side (each Session.decide followed by one raw ONNX Runtime call), "
           f"Session.decide p50 {stats([x['paired_decide']['p50'] for x in sp])['median']:.1f}"
           f" us is {ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f}) the raw "
           f"call's {stats([x['paired_raw']['p50'] for x in sp])['median']:.1f} us (target "
           f"1.5x; the two run apart, as in the tables: {dec:.1f} and {raw:.1f} us, "
           f"{dec / raw:.2f}x); a sequential batch of {BATCH_TYPES:,} makes "
           f"{BATCH_TYPES:,} policy calls in order, each observed after the decision before "
           f"it, so it cannot take less than {BATCH_TYPES:,} raw calls, "
           f"{BATCH_TYPES * raw / 1e3:.1f} ms (target {TARGET_BATCH_MS:g} ms)")
    if all("ort_fixed_hot" in r["split"]["bundle"] for r in inproc):
        fixed = stats([r["split"]["bundle"]["ort_fixed_hot"]["p50"] for r in inproc])["median"]
        out += (f"; of each raw call, {fixed:.1f} us is ONNX Runtime's own cost (the same "
                f"graph on one channel) and {raw - fixed:.1f} us the actor's arithmetic")
    return out


def one_channel_session(sess) -> Any:
    """The committed bundle's single-row graph (``actor_row.onnx``) with its channel dimension
    cut to one, loaded with ``sess``'s session options: the per-call cost of ONNX Runtime
    (binding, dispatch of each node, output allocation) with almost no arithmetic. None for a
    graph that has no ``features`` input of ``[P, K+1]`` (the ``mlp`` architecture)."""
    import onnx
    import onnxruntime as ort

    if [i.name for i in sess.get_inputs()] != ["globals", "features"]:
        return None
    m = onnx.load(str(BUNDLE / "actor_row.onnx"))
    k1 = sess.get_inputs()[1].shape[1]
    for v in [*m.graph.input, *m.graph.output, *m.graph.value_info]:
        for d in v.type.tensor_type.shape.dim:
            if d.dim_value == k1:
                d.dim_value = 1
    return ort.InferenceSession(m.SerializeToString(), sess_options=sess.get_session_options(),
                                providers=sess.get_providers())


def _timed(call: Callable[[], Any], runs: int) -> tuple[dict[str, float], Any]:
    """``runs`` timed calls after 2 untimed ones: percentiles (ms) and this process's CPU
    share over the timed calls (``Timer``), and the last call's result."""
    for _ in range(2):
        call()
    lat = []
    with Timer() as tm:
        for _ in range(runs):
            a = time.perf_counter_ns()
            res = call()
            lat.append(time.perf_counter_ns() - a)
    return pct(np.array(lat) / 1e6) | {"cpu_share": tm.cpu_share}, res


def _batch_session(snap: dict, policy) -> tuple[Session, list[int]]:
    """The batch session, every type decided once, and its 1,000 type ids in the policy's
    decision order."""
    s = fresh_session(snap, policy)
    if s.active.size != BATCH_TYPES:
        raise RuntimeError(f"batch session has {s.active.size} active types")
    order = decision_order(s.inst, policy.order, s.rng)
    return s, [s.type_ids[int(s.active[p])] for p in order]


def _timed_batch(label: str, call: Callable[[], list], runs: int) -> dict[str, float]:
    """:func:`_timed` of a batch decision, checked to decide all types by the policy."""
    res, ds = _timed(call, runs)
    if len(ds) != BATCH_TYPES or any(d.source != "policy" for d in ds):
        raise RuntimeError(f"batch {label}: {len(ds)} decisions, not all by the policy")
    return res


def _batch_observations(s: Session, types: list[int], policy) -> np.ndarray:
    """The observations a parallel batch of ``types`` scores (the session is left with
    those types undecided)."""
    pos = np.array([s._pos[s.slot(t)] for t in types])
    ch = s.state.channel.copy()
    ch[pos] = UNASSIGNED
    s.state.assign_all(ch)
    return s.builder(policy.layout).observe_many(s.state, pos, 0.0)


def run_batch_cores(snap: dict, policy, runs: int) -> dict[str, Any]:
    """The parallel batch and its policy call with this process allowed every core
    (``ALLOWED_CORES``) and ``policy`` scoring the batch's chunks on as many threads, as a
    policy server that is not pinned runs it; the affinity is restored afterwards."""
    os.sched_setaffinity(0, set(ALLOWED_CORES))
    try:
        s, types = _batch_session(snap, policy)
        out = {"parallel": _timed_batch(f"parallel on {len(ALLOWED_CORES)} cores",
                                        lambda: s.decide(types, policy, parallel=True), runs)}
        obs = _batch_observations(s, types, policy)
        out["ort_batch"], _ = _timed(lambda: policy(obs), runs)
        return out
    finally:
        os.sched_setaffinity(0, {CORE})


def run_batch(snap: dict, policy, runs: int) -> dict[str, Any]:
    s, types = _batch_session(snap, policy)
    out: dict[str, Any] = {}
    for label, call in (("list", lambda: s.decide(types, policy)),
                        ("replan", lambda: s.decide(None, policy, replan=True)),
                        ("parallel", lambda: s.decide(types, policy, parallel=True))):
        out[label] = _timed_batch(label, call, runs)
    out["feasible_after"] = bool(s.metrics()["feasible"])
    # what bounds the parallel batch: the policy call alone on the batch's observations,
    # and, below it, the actor's widest layer alone as one NumPy GEMM ([1,000 x (K+1)] rows
    # of 32 -> 32, float32: the multiply-adds no actor run can skip)
    obs = _batch_observations(s, types, policy)
    rows = np.random.default_rng(0).random((obs.shape[0] * (s.spec.num_topics + 1), 32),
                                           dtype=np.float32)
    w = np.random.default_rng(1).random((32, 32), dtype=np.float32)
    h = np.empty_like(rows)
    out["ort_batch"], _ = _timed(lambda: policy(obs), runs)
    out["gemm_floor"], _ = _timed(lambda: np.matmul(rows, w, out=h), runs)
    return out


# ---------------------------------------------------------------------------- server
class Server(LocalServer):
    """``serve.py`` in a subprocess pinned to ``core`` (:class:`serving.local.LocalServer`),
    with ONNX Runtime's default session options when ``config == "ort_default"``."""

    def __init__(self, tmp: Path, core: int, config: str) -> None:
        super().__init__(BUNDLE, tmp, api_key=KEY, admin_key=ADMIN, cpu=str(core),
                         python_args=["-c", LAUNCHER] if config == "ort_default" else [],
                         security=PLAIN)
        self.tmp, self.core, self.config = tmp, core, config

    def start(self) -> Server:
        super().start(timeout_s=90)
        return self

    def cpu_s(self) -> tuple[float, float]:
        """(main thread, all threads) utime + stime of the server, seconds."""
        main = total = 0
        for t in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                f = (t / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ticks = int(f[11]) + int(f[12])
            total += ticks
            if t.name == str(self.proc.pid):
                main = ticks
        hz = os.sysconf("SC_CLK_TCK")
        return main / hz, total / hz


def route_time(client: httpx.Client, route: str) -> tuple[float, float]:
    """(sum of seconds, count) of the server's latency histogram for POST ``route``."""
    text = client.get("/v1/metrics", headers={"X-API-Key": ADMIN}).text
    tot = cnt = 0.0
    for line in text.splitlines():
        if f'route="{route}"' in line and 'method="POST"' in line:
            name, _, value = line.rpartition(" ")
            if name.startswith("smart_request_latency_seconds_sum"):
                tot = float(value)
            elif name.startswith("smart_request_latency_seconds_count"):
                cnt = float(value)
    return tot, cnt


# ---------------------------------------------------------------------------- load generator
def request_bytes(port: int, path: str, body: dict) -> bytes:
    raw = json.dumps(body, separators=(",", ":")).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-API-Key: {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
            ).encode() + raw


async def roundtrip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: bytes
                    ) -> tuple[int, bytes]:
    writer.write(req)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v)
    return status, (await reader.readexactly(length) if length else b"")


def policy_decided(body: bytes) -> bool:
    doc = json.loads(body)
    ds = doc.get("decisions", [doc])
    return all(d["source"] == "policy" for d in ds)


async def open_loop(port: int, reqs: Sequence[bytes], rate: float, duration: float,
                    conns: int) -> dict[str, Any]:
    """Open-loop load: request i scheduled at t0 + i / rate, sent on the first free
    keep-alive connection; latency from the scheduled time."""
    n = max(1, round(rate * duration))
    sched, sent, done = np.zeros(n), np.full(n, np.nan), np.full(n, np.nan)
    ok = np.zeros(n, bool)
    failures: list[str] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    streams = [await asyncio.open_connection("127.0.0.1", port) for _ in range(conns)]
    pc = time.perf_counter

    async def worker(k: int) -> None:
        reader, writer = streams[k]
        while True:
            i = await queue.get()
            if i < 0:
                writer.close()
                return
            sent[i] = pc()
            try:
                status, body = await roundtrip(reader, writer, reqs[i % len(reqs)])
                ok[i] = status == 200 and policy_decided(body)
                if not ok[i] and len(failures) < 5:
                    failures.append(f"{status}: {body[:200]!r}")
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                    ValueError) as e:
                if len(failures) < 5:
                    failures.append(repr(e))
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            done[i] = pc()

    tasks = [asyncio.create_task(worker(k)) for k in range(conns)]
    gc.disable()  # a collection in the load generator would stall every request in flight
    c0 = time.process_time()
    t0 = pc() + 0.01
    period = 1.0 / rate
    for i in range(n):
        t = sched[i] = t0 + i * period
        while True:
            d = t - pc()
            if d <= 0:
                break
            await asyncio.sleep(d - 0.001 if d > 0.002 else 0)
        queue.put_nowait(i)
    for _ in tasks:
        queue.put_nowait(-1)
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=duration + 60)
    finally:
        gc.enable()
    wall = np.nanmax(done) - t0
    lat = (done - sched) * 1e3
    return (pct(lat[ok]) if ok.any() else {"p50": np.nan, "p99": np.nan, "max": np.nan}) | {
        "requests": n, "errors": int(n - ok.sum()), "failures": failures,
        "achieved_rate": float(ok.sum() / wall), "offered_rate": rate,
        "service_ms": pct((done - sent)[ok] * 1e3) if ok.any() else None,
        "dispatch_lag_ms": pct((sent - sched) * 1e3),
        "client_cpu_share": (time.process_time() - c0) / wall}


async def closed_loop(port: int, req: bytes, runs: int, warm: int) -> dict[str, Any]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    lat, size = [], 0
    for i in range(warm + runs):
        a = time.perf_counter()
        status, body = await roundtrip(reader, writer, req)
        b = time.perf_counter()
        if status != 200 or not policy_decided(body):
            raise RuntimeError(f"batch over HTTP failed: {status} {body[:300]!r}")
        size = len(body)
        if i >= warm:
            lat.append((b - a) * 1e3)
    writer.close()
    return pct(np.array(lat)) | {"response_bytes": size}


# ---------------------------------------------------------------------------- adapter
def make_adapter(ps: ProblemSet, url: str, mode: str, tmp: Path) -> ControllerAdapter:
    return adapter_for(ps, url, mode, api_key=KEY, cache_dir=tmp / "cache",
                       timeout_s=ADAPTER_TIMEOUT_S, security=PLAIN, bundle_trust=TRUST)


def run_adapter(ps: ProblemSet, url: str, mode: str, tmp: Path, w: int, samples: int,
                warmup: int, config: str) -> dict[str, Any]:
    with ort_config(config):  # the cached adapter loads its bundle when it is created
        ad = make_adapter(ps, url, mode, tmp)
    try:
        replay_window(ad, ps, w)
        ds = ad.decide(replan=True)
        if not ds or any(d.source != "policy" for d in ds):
            raise RuntimeError(f"adapter ({mode}): initial decisions not by the policy")
        types = active_ids(ad.local)
        for i in range(warmup):
            ad.decide([types[i % len(types)]])
        lat = np.empty(samples)
        errors = 0
        with Timer() as tm:
            for i in range(samples):
                a = time.perf_counter_ns()
                (d,) = ad.decide([types[i % len(types)]])
                lat[i] = time.perf_counter_ns() - a
                errors += d.source != "policy"
        return pct(lat / 1e6) | {"errors": errors, "cpu_share": tm.cpu_share,
                                 "types": len(types)}
    finally:
        ad.close()


# ---------------------------------------------------------------------------- HTTP phase
def http_run(ps: ProblemSet, tmp: Path, cfg: dict, body_w: dict, body_b: dict, w: int,
             types_b: list[int], config: str) -> dict[str, Any]:
    srv = Server(tmp, SERVER_CORE, config).start()
    try:
        cont = Contention([srv.proc.pid])
        out: dict[str, Any] = {"server_start_s": srv.start_s,
                               "server_threads": thread_affinities(srv.proc.pid)}
        with httpx.Client(base_url=srv.url, verify=srv.verify, headers={"X-API-Key": KEY},
                          timeout=60) as c:
            sid = c.post("/v1/sessions", json=body_w).json()["session_id"]
            r = c.post(f"/v1/sessions/{sid}/decide/batch", json={"replan": True})
            r.raise_for_status()
            types = sorted(d["type"] for d in r.json()["decisions"])
            path = f"/v1/sessions/{sid}/decide"
            reqs = [request_bytes(srv.port, path, {"type": t}) for t in types]
            route = "/v1/sessions/{session_id}/decide"
            asyncio.run(open_loop(srv.port, reqs, 500, 1.0, CONNS))  # warm-up
            for rate in RATES:
                s0, n0 = route_time(c, route)
                cpu0 = srv.cpu_s()
                res = asyncio.run(open_loop(srv.port, reqs, rate, cfg["http_s"], CONNS))
                cpu1 = srv.cpu_s()
                s1, n1 = route_time(c, route)
                res["server_main_cpu_ms_per_request"] = (cpu1[0] - cpu0[0]) * 1e3 / res["requests"]
                res["server_cpu_ms_per_request"] = (cpu1[1] - cpu0[1]) * 1e3 / res["requests"]
                res["server_in_app_ms_mean"] = (s1 - s0) * 1e3 / max(n1 - n0, 1)
                out[f"http_{rate}"] = res
                log(f"    {rate:5d} req/s: achieved {res['achieved_rate']:,.0f}/s, p50 "
                    f"{res['p50']:.2f} ms, p99 {res['p99']:.2f} ms, max {res['max']:.1f} ms, "
                    f"errors {res['errors']}; server CPU main thread "
                    f"{res['server_main_cpu_ms_per_request']:.3f} / all threads "
                    f"{res['server_cpu_ms_per_request']:.3f} ms/req, in-app "
                    f"{res['server_in_app_ms_mean']:.3f} ms; client CPU "
                    f"{res['client_cpu_share']:.2f}, dispatch lag p99 "
                    f"{res['dispatch_lag_ms']['p99']:.3f} ms")
            if config == "bundle":
                sid_b = c.post("/v1/sessions", json=body_b).json()["session_id"]
                # untimed: the session's first full decision
                c.post(f"/v1/sessions/{sid_b}/decide/batch", json={"replan": True})
                req_b = request_bytes(srv.port, f"/v1/sessions/{sid_b}/decide/batch",
                                      {"types": types_b, "replan": False})
                out["http_batch"] = hb = asyncio.run(closed_loop(srv.port, req_b,
                                                                 cfg["batch_http"], 2))
                log(f"    batch {BATCH_TYPES} over HTTP: p50 {hb['p50']:.1f} ms, p99 "
                    f"{hb['p99']:.1f} ms ({hb['response_bytes']:,} B response)")
        for mode in ("cached", "remote"):
            out[f"adapter_{mode}"] = res = run_adapter(ps, srv.url, mode, tmp, w, cfg[mode],
                                                       cfg["warmup"] // 2, config)
            log(f"    adapter {mode}: p50 {res['p50']:.3f} ms, p99 {res['p99']:.3f} ms, "
                f"max {res['max']:.1f} ms, errors {res['errors']}, CPU share "
                f"{res['cpu_share']:.2f}")
        if srv.proc.poll() is not None:
            raise RuntimeError("the server died during the run")
        out["foreign_cores"] = cont.cores()
        return out
    finally:
        srv.stop()


# ---------------------------------------------------------------------------- report
def across(runs: list[dict], *keys: str) -> dict[str, Any]:
    """``stats`` over runs of ``runs[i][k0][k1]...``."""
    vals = []
    for r in runs:
        v = r
        for k in keys:
            v = v[k]
        vals.append(v)
    return stats(vals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples, 3 s per HTTP rate")
    args = ap.parse_args()
    cfg = QUICK if args.quick else FULL
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench_serving_"))
    log(f"bench_serving: in-process on core {CORE}; HTTP server on core {SERVER_CORE}, load "
        f"generator on core {CLIENT_CORE}; {REPEATS} runs; settings {cfg}")
    ps = problems_for(SCENARIO)
    policies, inproc_threads = {}, {}
    for conf in ORT_CONFIGS:  # each load adds its session's threads (if any) to this process
        with ort_config(conf):
            policies[conf] = PolicyStore(trust=TRUST).load(BUNDLE)
        inproc_threads[conf] = thread_affinities(os.getpid())
    sessions_desc = {c: describe_session(policies[c]) for c in ORT_CONFIGS}
    log(f"ONNX Runtime sessions: {sessions_desc}")
    policy = policies["bundle"]
    # the same bundle as a server that is not pinned loads it: batch chunks on every core
    policy_cores = None if len(ALLOWED_CORES) < 2 else LoadedPolicy(
        load_bundle(BUNDLE, batch_threads=len(ALLOWED_CORES), trust=TRUST), 0, time.time())
    test = list(ps.windows["test"])
    snaps = [snapshot_of(session_body(ps, w)) for w in test]
    body_b = batch_body(ps)
    snap_b = snapshot_of(body_b)
    body_w = session_body(ps, test[0])
    checked = check_inlined(snaps[0], policy)
    gc.collect()
    gc.freeze()  # the harness's own objects (traces, bodies): not scanned by later collections
    log(f"prepared: test windows {test} ({[ps.instance(w).num_types for w in test]} types), "
        f"batch session {BATCH_TYPES} types; inlined decide == Session.decide on {checked} "
        f"calls; this process's threads (name:cores) after each load {inproc_threads}")

    inproc: list[dict] = []
    reruns: list[str] = []
    for r in range(REPEATS):
        for attempt in range(RETRIES):
            cont = Contention()
            res: dict[str, Any] = {"single": {}, "split": {}, "paced": {}}
            for conf in ORT_CONFIGS:
                res["paced"][conf] = run_paced(snaps[0], policies[conf], cfg["paced"],
                                               PACED_GAP_S)
                res["single"][conf] = run_single(snaps, policies[conf], cfg["single"],
                                                 cfg["warmup"])
                res["split"][conf] = run_split(snaps, policies[conf], cfg["split"],
                                               cfg["warmup"])
            res["batch"] = run_batch(snap_b, policy, cfg["batch"])
            if policy_cores is not None:
                res["batch_cores"] = run_batch_cores(snap_b, policy_cores, cfg["batch"])
            res["asgi"] = run_asgi(body_w, cfg["asgi"], cfg["warmup"])
            res["foreign_cores"] = cont.cores()
            if res["foreign_cores"] <= FOREIGN_OK or attempt == RETRIES - 1:
                break
            reruns.append(f"in-process run {r + 1} ({res['foreign_cores']:.2f} cores)")
            log(f"  in-process run {r + 1}: other processes used {res['foreign_cores']:.2f} "
                "cores; re-running it")
        inproc.append(res)
        for conf in ORT_CONFIGS:
            si, sp = res["single"][conf], res["split"][conf]
            log(f"  in-process run {r + 1}/{REPEATS}, ORT {ORT_LABEL[conf]}: single p50 "
                f"{si['p50']:.3f} ms p99 {si['p99']:.3f} ms max {si['max']:.2f} ms; split p50 us "
                + ", ".join(f"{k} {sp[k]['p50']:.1f}" for k in (*STAGES, "total"))
                + f"; paced p50 {res['paced'][conf]['p50']:.3f} ms p99 "
                f"{res['paced'][conf]['p99']:.3f} ms")
        log(f"  in-process run {r + 1}/{REPEATS}: batch list p50 "
            f"{res['batch']['list']['p50']:.1f} ms, replan p50 "
            f"{res['batch']['replan']['p50']:.1f} ms; other processes "
            f"{res['foreign_cores']:.2f} cores")

    os.sched_setaffinity(0, {CLIENT_CORE})  # the load generator's core
    s = Session.from_snapshot(snap_b)
    types_b = [s.type_ids[int(s.active[p])] for p in decision_order(s.inst, policy.order)]
    http: list[dict] = []
    for r in range(REPEATS):
        run: dict[str, Any] = {}
        for conf in ORT_CONFIGS:
            for attempt in range(RETRIES):
                log(f"  HTTP run {r + 1}/{REPEATS}, fresh server, ORT {ORT_LABEL[conf]}")
                run[conf] = out = http_run(ps, tmp, cfg, session_body(ps, test[0]), body_b,
                                           test[0], types_b, conf)
                if out["foreign_cores"] <= FOREIGN_OK or attempt == RETRIES - 1:
                    break
                reruns.append(f"HTTP run {r + 1} {conf} ({out['foreign_cores']:.2f} cores)")
                log(f"    other processes used {out['foreign_cores']:.2f} cores; re-running")
        http.append(run)
    shutil.rmtree(tmp, ignore_errors=True)

    # ------------------------------------------------------------------ table
    rows, summary = [], {}

    def add(key: str, label: str, runs: list[dict], keys: tuple, conf: str, samples: str,
            target: float | None, rate: str = "-", errors: str = "-") -> None:
        st = {q: across(runs, *keys, q) for q in ("p50", "p99", "max")}
        met = "-" if target is None else ("yes" if st["p99"]["median"] <= target
                                          else "**no**")
        f = "{:,.3f}" if st["p50"]["median"] < 1 else "{:,.1f}"
        rows.append([label, ORT_LABEL[conf], samples, rate, fmt_stats(st["p50"], f),
                     fmt_stats(st["p99"], f), fmt_stats(st["max"], "{:,.1f}"), errors,
                     "-" if target is None else f"p99 <= {target:g}", met])
        summary[key] = st | ({"target_ms": target, "met": met == "yes"} if target else {})

    for conf in ORT_CONFIGS:
        add(f"single_{conf}", "in-process, 1 decision (Session.decide)", inproc,
            ("single", conf), conf, f"{cfg['single']:,}", TARGET_SINGLE_MS)
    for conf in ORT_CONFIGS:
        add(f"paced_{conf}", f"in-process, 1 decision every {PACED_GAP_S * 1e3:g} ms (sleeping "
            "between)", inproc, ("paced", conf), conf, f"{cfg['paced']:,}", None)
    add("asgi", "in-process ASGI call of POST .../decide (FastAPI app, no HTTP server)",
        inproc, ("asgi",), "bundle", f"{cfg['asgi']:,}", None,
        errors=str(sum(r["asgi"]["errors"] for r in inproc)))
    add("batch_list", f"in-process, batch of {BATCH_TYPES:,} (re-decide list)", inproc,
        ("batch", "list"), "bundle", f"{cfg['batch']}", TARGET_BATCH_MS)
    add("batch_replan", f"in-process, batch of {BATCH_TYPES:,} (replan from empty)", inproc,
        ("batch", "replan"), "bundle", f"{cfg['batch']}", TARGET_BATCH_MS)
    add("batch_parallel", f"in-process, batch of {BATCH_TYPES:,} (parallel: one policy call)",
        inproc, ("batch", "parallel"), "bundle", f"{cfg['batch']}", TARGET_BATCH_MS)
    if policy_cores is not None:
        add("batch_parallel_cores", f"in-process, batch of {BATCH_TYPES:,} (parallel), "
            f"{len(ALLOWED_CORES)} cores: chunks on {len(ALLOWED_CORES)} threads", inproc,
            ("batch_cores", "parallel"), "bundle", f"{cfg['batch']}", TARGET_BATCH_MS)
    for rate in RATES:
        for conf in ORT_CONFIGS:
            k = f"http_{rate}"
            ach = across(http, conf, k, "achieved_rate")
            err = sum(h[conf][k]["errors"] for h in http)
            add(f"{k}_{conf}", f"HTTP POST .../decide, open loop {rate:,}/s", http, (conf, k),
                conf, f"{int(rate * cfg['http_s']):,}",
                TARGET_HTTP_MS if rate == 1000 else None, rate=fmt_stats(ach),
                errors=f"{err} of {sum(h[conf][k]['requests'] for h in http):,}")
    add("http_batch", f"HTTP POST .../decide/batch, {BATCH_TYPES:,} types (1 in flight)", http,
        ("bundle", "http_batch"), "bundle", f"{cfg['batch_http']}", None)
    for mode in ("cached", "remote"):
        for conf in ORT_CONFIGS:
            k = f"adapter_{mode}"
            add(f"{k}_{conf}", f"adapter decide([t]), {mode} mode", http, (conf, k), conf,
                f"{cfg[mode]:,}", None, errors=str(sum(h[conf][k]["errors"] for h in http)))
    table = md_table(["measurement (godaddy, default bundle)", "ORT session", "samples/run",
                      "achieved req/s", "p50 ms", "p99 ms", "max ms", "errors", "target ms",
                      "met"], rows)

    split_rows, split_summary = [], {}
    mean_total = {c: stats([r["single"][c]["mean"] * 1e3 for r in inproc])["median"]
                  for c in ORT_CONFIGS}
    for name, label in (("lookup", "find the type and the policy's single-row runner"),
                        ("observe", "take it off its channel and observe it into the "
                                    "runner's input (DecisionStep.observe, one compiled call)"),
                        ("onnx", "ONNX Runtime (the runner's run, bound buffers)"),
                        ("apply", "decode (feasible) and move it (DecisionStep.apply, one "
                                  "compiled call)"),
                        ("total", "all four stages (inlined, timed)"),
                        ("ort_run_hot", "raw InferenceSession.run in a tight loop (extra)"),
                        ("ort_fixed_hot", "the same graph on one channel: ONNX Runtime's own "
                                          "cost per call (extra)")):
        if any(name not in r["split"][c] for r in inproc for c in ORT_CONFIGS):
            continue
        cells = [label]
        for conf in ORT_CONFIGS:
            st = {q: across(inproc, "split", conf, name, q) for q in ("p50", "p99", "mean")}
            split_summary[f"{name}_{conf}"] = st
            cells += [fmt_stats(st["p50"], "{:.1f}"), fmt_stats(st["p99"], "{:.1f}"),
                      f"{st['mean']['median']:.1f} "
                      f"({100 * st['mean']['median'] / mean_total[conf]:.0f}%)"]
        split_rows.append(cells)
    cells = ["rest of Session.decide (checks, Decision), by difference of means"]
    for conf in ORT_CONFIGS:
        rest = mean_total[conf] - split_summary[f"total_{conf}"]["mean"]["median"]
        cells += ["-", "-", f"{rest:.1f} ({100 * rest / mean_total[conf]:.0f}%)"]
    split_rows.append(cells)
    cells = ["Session.decide, stages not timed (first row of the table above)"]
    for conf in ORT_CONFIGS:
        cells += [fmt_stats(stats([r["single"][conf]["p50"] * 1e3 for r in inproc]), "{:.1f}"),
                  fmt_stats(stats([r["single"][conf]["p99"] * 1e3 for r in inproc]), "{:.1f}"),
                  f"{mean_total[conf]:.1f} (100%)"]
    split_rows.append(cells)
    table += "\n\n" + md_table(
        ["one in-process decision, by stage (us)", "p50", "p99", "mean (share)",
         "p50, ORT defaults", "p99, ORT defaults", "mean (share), ORT defaults"], split_rows)

    # ------------------------------------------------------------------ notes
    def med(conf: str, *keys: str) -> float:
        return across(http, conf, *keys)["median"]

    notes = [
        f"median (min-max) over {REPEATS} runs of each run's percentile; in process: fresh "
        f"sessions each run, core {CORE}, 1 BLAS thread; HTTP: a fresh `serve.py` process "
        f"per run and configuration, pinned to core {SERVER_CORE}; load generator and adapter "
        f"in this process on core {CLIENT_CORE}",
        f"ORT session 'load_bundle' = serving.bundles.static.load_bundle's, as the server and the "
        f"cached adapter use it ({sessions_desc['bundle']}; server threads name:cores "
        f"{', '.join(http[0]['bundle']['server_threads'])}); 'ORT defaults' = the same bundle "
        f"with ONNX Runtime's default SessionOptions ({sessions_desc['ort_default']}): ORT "
        f"adds an intra-op worker pinned to a core of its own choosing whatever the process "
        f"affinity (server pinned to core {SERVER_CORE}: "
        f"{', '.join(http[0]['ort_default']['server_threads'])}), which busy-waits after "
        f"every run",
        f"single decisions: 4 test windows "
        f"({', '.join(str(ps.instance(w).num_types) for w in test)} active types), types "
        f"cycled in catalogue order, each call re-decides one type given the rest; "
        f"{cfg['warmup']} untimed calls per window first. Paced: test window "
        f"{test[0]}, one call every {PACED_GAP_S * 1e3:g} ms with the process sleeping in "
        f"between, as a controller asking now and then sees it (cold caches: several times "
        f"the back-to-back latency)",
        f"where one decision's time goes (second table): the {len(STAGES)} stages timed "
        f"separately on an inlined copy of Session.decide (checked to decide identically); "
        f"{100 * stats([r['split']['bundle']['not_argmax_share'] for r in inproc])['median']:.0f}"
        f"% of the decisions took another channel than the argmax (the feasible decoding "
        f"searched further)",
        floors_note(inproc),
        f"batch: types 0..{BATCH_TYPES - 1} with the rate of the latest of the 20 windows in "
        f"which each is active; 'list' = decide(the 1,000 ids in rate x fan-out order) on a "
        f"fully decided session, 'replan' = decide(None, replan=True) from an empty "
        f"assignment; assignment feasible after the runs: "
        f"{all(r['batch']['feasible_after'] for r in inproc)} (no assignment can be: "
        f"1,000 types need at least 1,000 sends against the scenario's C_p of "
        f"{snap_b['controller']['cpu']}, so the safety layer finds no room and keeps each "
        f"argmax); 'parallel' takes the 1,000 types off their channels together, so every "
        f"topic is empty when they are observed (an empty topic's new subscribers are all "
        f"of a type's destinations, counted without a scan), and builds the observations "
        f"chunk by chunk on the threads that score them",
        f"what bounds the parallel batch (medians over the runs of each run's p50): the "
        f"policy call alone on the 1,000 observations "
        f"{stats([r['batch']['ort_batch']['p50'] for r in inproc])['median']:.1f} ms; the "
        f"actor's widest layer alone as one NumPy GEMM "
        f"({BATCH_TYPES:,} x {snap_b['num_topics'] + 1} rows, 32 -> 32, float32) "
        f"{stats([r['batch']['gemm_floor']['p50'] for r in inproc])['median']:.1f} ms"
        + ("" if policy_cores is None else
           f"; the policy call on {len(ALLOWED_CORES)} cores (its chunks of "
           f"{policy_cores.bundle.scorer._chunk} observations on {len(ALLOWED_CORES)} threads) "
           f"{stats([r['batch_cores']['ort_batch']['p50'] for r in inproc])['median']:.1f} "
           "ms"),
        f"HTTP: {CONNS} keep-alive connections, minimal asyncio HTTP/1.1 client; latency from "
        f"the scheduled send time. At 1,000/s, service time (from the actual send) p50/p99 "
        f"{med('bundle', 'http_1000', 'service_ms', 'p50'):.2f}/"
        f"{med('bundle', 'http_1000', 'service_ms', 'p99'):.2f} ms (ORT defaults: "
        f"{med('ort_default', 'http_1000', 'service_ms', 'p50'):.2f}/"
        f"{med('ort_default', 'http_1000', 'service_ms', 'p99'):.2f} ms); the client's "
        f"dispatch lag behind the schedule p99 "
        f"{med('bundle', 'http_1000', 'dispatch_lag_ms', 'p99'):.3f} ms (ORT defaults: "
        f"{med('ort_default', 'http_1000', 'dispatch_lag_ms', 'p99'):.3f} ms, the server's "
        f"spinning ORT worker sharing the client's core)",
        f"server CPU per single-decision request at 1,000/s: "
        f"{med('bundle', 'http_1000', 'server_cpu_ms_per_request'):.3f} ms (all threads), so "
        f"one core saturates near "
        f"{1e3 / med('bundle', 'http_1000', 'server_cpu_ms_per_request'):,.0f} req/s; of it, "
        f"inside the app (Prometheus route histogram, mean) "
        f"{med('bundle', 'http_1000', 'server_in_app_ms_mean'):.3f} ms, the rest uvicorn's "
        f"HTTP handling (uvicorn picks {_loop_and_parser()}); the app "
        f"called directly (ASGI row) takes p50 "
        f"{across(inproc, 'asgi', 'p50')['median']:.3f} ms per request, of which "
        f"Session.decide p50 {across(inproc, 'single', 'bundle', 'p50')['median']:.3f} ms. "
        f"At 100/s: "
        f"{med('bundle', 'http_100', 'server_cpu_ms_per_request'):.3f} ms per request (in-app "
        f"{med('bundle', 'http_100', 'server_in_app_ms_mean'):.3f} ms: cold caches between "
        f"requests). With ORT defaults, all threads / main thread: "
        f"{med('ort_default', 'http_1000', 'server_cpu_ms_per_request'):.3f} / "
        f"{med('ort_default', 'http_1000', 'server_main_cpu_ms_per_request'):.3f} ms at "
        f"1,000/s, {med('ort_default', 'http_100', 'server_cpu_ms_per_request'):.3f} / "
        f"{med('ort_default', 'http_100', 'server_main_cpu_ms_per_request'):.3f} ms at 100/s "
        f"(the worker spinning on the other core)",
        f"HTTP batch response: {http[0]['bundle']['http_batch']['response_bytes']:,} bytes; "
        f"the event loop is blocked for the whole batch, so single decisions queue behind it",
        "adapter remote mode: one POST .../decide/batch per decide() through httpx (sync); "
        "cached mode polls GET /v1/policy every 5 s inside decide()",
        f"server start (process to ready): "
        f"{fmt_stats(stats([h[c]['server_start_s'] for h in http for c in ORT_CONFIGS]), '{:.1f}')}"
        f" s",
    ]
    shares = ([(f"in-process single ({c})", r["single"][c]["cpu_share"]) for r in inproc
               for c in ORT_CONFIGS]
              + [("in-process batch", r["batch"]["list"]["cpu_share"]) for r in inproc]
              + [(f"adapter cached ({c})", h[c]["adapter_cached"]["cpu_share"]) for h in http
                 for c in ORT_CONFIGS]
              + [(f"HTTP client 1,000/s ({c})", h[c]["http_1000"]["client_cpu_share"])
                 for h in http for c in ORT_CONFIGS])
    low = [f"{k} {v:.2f}" for k, v in shares if v < CPU_SHARE_OK and "HTTP client" not in k]
    foreign = [r["foreign_cores"] for r in inproc] + [h[c]["foreign_cores"] for h in http
                                                       for c in ORT_CONFIGS]
    notes.append(f"other processes' CPU during the kept runs: at most {max(foreign):.2f} "
                 f"cores (runs above {FOREIGN_OK} are re-run, up to {RETRIES} attempts); "
                 + (f"re-run: {', '.join(reruns)}" if reruns else "none re-run"))
    notes.append(f"load average at the end: {os.getloadavg()[0]:.2f}; "
                 + ("no in-process or adapter run had less than 85% of its core" if not low
                    else "runs with less than 85% of their core (CPU time / wall; another "
                    "thread or process shared it): " + ", ".join(low)))
    total = time.perf_counter() - t_start
    finish("bench_serving", {
        "settings": {**cfg, "repeats": REPEATS, "batch_types": BATCH_TYPES, "rates": RATES,
                     "connections": CONNS, "scenario": SCENARIO, "bundle": str(BUNDLE),
                     "bundle_hash": policy.hash, "test_windows": test, "pinned_core": CORE,
                     "server_core": SERVER_CORE, "client_core": CLIENT_CORE,
                     "ort_configs": ORT_CONFIGS, "quick": args.quick},
        "summary": summary, "split": split_summary, "cpu_shares": shares, "reruns": reruns,
        "in_process_threads": inproc_threads, "ort_sessions": sessions_desc,
        "targets_ms": {"single_p99": TARGET_SINGLE_MS, "batch_p99": TARGET_BATCH_MS,
                       "http_1000_p99": TARGET_HTTP_MS},
        "in_process_runs": inproc, "http_runs": http, "total_s": total}, table, notes, total)


if __name__ == "__main__":
    main()
