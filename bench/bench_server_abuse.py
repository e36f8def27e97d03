"""One key sends the policy server the heaviest requests the limits allow (and the ones that
exhausted it before they existed); another key keeps using it. Measured: the server's memory
and the other key's latency, for this checkout's server and, with ``--before REF``, the
server of an older commit, side by side in one run.

The attacks, each for ``DURATION`` seconds on a fresh server (plain HTTP, no policy bundle,
the default limits of ``configs/serve.yaml``):

* **largest sessions**: ``POST /v1/sessions`` with N = 20,000 nodes, K = 4,096 topics and
  20,000 types of 10 destinations each (a 2.4 MB body), as many as the server accepts, then
  ``decide/batch`` of 2,000 types on each in turn;
* **heavy batches**: one session of 2,000 nodes, K = 4,096 and 20,000 types, then
  ``decide/batch`` re-planning all 20,000 types, again and again;
* **online topics**: ``POST /v1/online/sessions`` whose ``scenario.num_topics`` is 10^8
  (about 1 KB; refused by today's limits), then its first interval planned, one message
  placed on topic 1 and the interval closed (scored), again and again.

The other key (the victim) sends ``GET /v1/health/live`` and ``POST .../decide`` on its own
small session every 50 ms throughout; reported: the victim's p50 / p99 / max latency, the
server's peak RSS above its idle RSS (sampled every 50 ms from ``/proc``), and the attacker's
answers by status. A server whose RSS passes ``RSS_STOP_MB`` has the attack stopped there
(marked in the table): the machine has 24 GiB.

Usage: ``python bench/bench_server_abuse.py [--before REF] [--quick]`` (``--quick``: 10 s
attacks). The older commit runs from a temporary ``git worktree`` with this environment's
Python.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, finish, log, md_table

sys.path.insert(0, str(ROOT))
from envs.netutil import free_ports

ATTACKER, VICTIM = (f"{n}-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0"
                    for n in ("bench-abuse-attacker", "bench-abuse-victim"))
DURATION = 30.0
RSS_STOP_MB = 8000.0
PROBE_S = 0.05


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Server:
    """``serve.py`` of ``root`` on a free loopback port (plain HTTP, no bundle)."""

    def __init__(self, root: Path, log_dir: Path) -> None:
        self.root, self.port = root, free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"server-{self.port}.log"
        cmd = [sys.executable, str(root / "serve.py"), f"port={self.port}", "bundle=null",
               "watch=false",
               "log_level=warning", "security.insecure=true", "rate_limit=null",
               f"hydra.run.dir={log_dir / 'hydra'}"]
        # keys from the environment, never the command line (any local user may read it)
        env = os.environ | {"PYTHONPATH": str(root), "SMART_API_KEYS": f"{ATTACKER},{VICTIM}",
                            "SMART_ADMIN_KEYS": ""}
        with open(self.log, "a") as err:
            self.proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=err,
                                         env=env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/v1/health/live", timeout=0.5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve.py of {root} exited: {self.log.read_text()[-2000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"serve.py of {root} not ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def nodes(n: int) -> list[dict[str, int]]:
    return [{"id": i, "capacity_bps": 10**9} for i in range(n)]


def types(m: int, n: int, d: int) -> list[dict[str, Any]]:
    return [{"id": i, "destinations": [(i * 7 + j) % n for j in range(d)],
             "rate_bps": 1000 + i} for i in range(m)]


CTL = {"bandwidth_bps": 10**12, "cpu": 10**6}


def attack_largest(c: httpx.Client, stop: threading.Event, out: Counter) -> None:
    body = {"nodes": nodes(20_000), "controller": CTL, "num_topics": 4096,
            "types": types(20_000, 20_000, 10)}
    sids = []
    while not stop.is_set():
        r = c.post("/v1/sessions", json=body)
        out[f"create {r.status_code}"] += 1
        if r.status_code != 201:
            break
        sids.append(r.json()["session_id"])
    while not stop.is_set() and sids:
        for sid in sids:
            if stop.is_set():
                break
            r = c.post(f"/v1/sessions/{sid}/decide/batch", json={"types": list(range(2000))})
            out[f"decide/batch {r.status_code}"] += 1


def attack_batches(c: httpx.Client, stop: threading.Event, out: Counter) -> None:
    r = c.post("/v1/sessions", json={"nodes": nodes(2000), "controller": CTL,
                                     "num_topics": 4096, "types": types(20_000, 2000, 10)})
    out[f"create {r.status_code}"] += 1
    if r.status_code != 201:
        return
    sid = r.json()["session_id"]
    while not stop.is_set():
        r = c.post(f"/v1/sessions/{sid}/decide/batch", json={"replan": True})
        out[f"decide/batch {r.status_code}"] += 1


def attack_online(c: httpx.Client, stop: threading.Event, out: Counter) -> None:
    from envs.dsmd.message import messages_from_trace
    from envs.dsmd.problems import build_problems
    from envs.dsmd.scenarios import load_scenario
    from serving.online_schemas import MessageIn

    tiny = load_scenario("tiny")
    first = messages_from_trace(build_problems(tiny, cache_dir=None).dataset.trace)[0]
    message = MessageIn.of(first) | {"hosts": [0], "timestamp_ns": 1}
    scen = tiny.to_dict() | {"num_topics": 10**8}
    while not stop.is_set():
        r = c.post("/v1/online/sessions", json={"nodes": nodes(1), "scenario": scen,
                                                "start_ns": 0})
        out[f"create {r.status_code}"] += 1
        if r.status_code != 201:
            return
        sid = r.json()["session_id"]  # then use it: one message in an interval, scored
        r = c.put(f"/v1/online/sessions/{sid}/intervals/0/plan", json={"plan": []})
        out[f"plan {r.status_code}"] += 1
        r = c.post(f"/v1/online/sessions/{sid}/intervals/0/messages",
                   json={"messages": [message], "placements": [{"type": 0, "channel": 1}]})
        out[f"messages {r.status_code}"] += 1
        r = c.post(f"/v1/online/sessions/{sid}/intervals/0/close")
        out[f"close {r.status_code}"] += 1


ATTACKS = {"largest sessions": attack_largest, "heavy batches": attack_batches,
           "online topics": attack_online}


def measure(server: Server, attack: Any, duration: float) -> dict[str, Any]:
    """Run ``attack`` from one key while the other probes; victim latencies and RSS."""
    idle = rss_mb(server.proc.pid)
    victim = httpx.Client(base_url=server.url, headers={"X-API-Key": VICTIM}, timeout=120)
    small = victim.post("/v1/sessions", json={"nodes": nodes(10), "controller": CTL,
                                              "num_topics": 2, "types": types(5, 10, 3)})
    sid = small.json()["session_id"]
    stop, answers = threading.Event(), Counter()
    attacker = httpx.Client(base_url=server.url, headers={"X-API-Key": ATTACKER},
                            timeout=600)

    def run() -> None:
        try:
            attack(attacker, stop, answers)
        except httpx.HTTPError as e:
            answers[f"error {type(e).__name__}"] += 1

    th = threading.Thread(target=run, daemon=True)
    lat: list[float] = []
    peak, stopped = idle, False
    t_end = time.monotonic() + duration
    th.start()
    i = 0
    while time.monotonic() < t_end:
        peak = max(peak, rss_mb(server.proc.pid))
        if peak > RSS_STOP_MB:
            stopped = True
            break
        t0 = time.perf_counter()
        if i % 2 == 0:
            r = victim.get("/v1/health/live")
        else:
            r = victim.post(f"/v1/sessions/{sid}/decide", json={"type": i % 5})
        lat.append(time.perf_counter() - t0)
        assert r.status_code == 200, r.text
        i += 1
        time.sleep(PROBE_S)
    stop.set()
    if stopped:  # the server is killed: a request it is stuck in cannot finish
        server.stop()
    th.join(600)
    peak = max(peak, rss_mb(server.proc.pid))
    lat.sort()
    return {"victim_requests": len(lat),
            "victim_p50_ms": 1000 * statistics.median(lat),
            "victim_p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "victim_max_ms": 1000 * lat[-1], "rss_idle_mb": idle, "rss_peak_mb": peak,
            "rss_added_mb": peak - idle, "stopped_at_rss_limit": stopped,
            "attacker": dict(answers)}


def worktree(ref: str, where: Path) -> Path:
    d = where / "before"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(d), ref],
                   check=True, capture_output=True)
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=None, help="a git ref whose server runs beside")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    duration = 10.0 if args.quick else DURATION
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench-abuse-"))
    roots = {"this checkout": ROOT}
    before_commit = None
    try:
        if args.before:
            roots = {f"before ({args.before})": worktree(args.before, tmp), **roots}
            before_commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short",
                                            args.before], check=True, capture_output=True,
                                           text=True).stdout.strip()
        results: dict[str, dict[str, Any]] = {}
        for attack_name, attack in ATTACKS.items():
            for label, root in roots.items():  # side by side: each attack on both servers
                log(f"{attack_name}: {label}")
                srv = Server(root, tmp)
                try:
                    results[f"{attack_name} | {label}"] = r = measure(srv, attack, duration)
                finally:
                    srv.stop()
                log(f"  victim p99 {r['victim_p99_ms']:.1f} ms, max {r['victim_max_ms']:.0f} "
                    f"ms; RSS +{r['rss_added_mb']:.0f} MB; attacker {r['attacker']}")
    finally:
        if args.before:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(tmp / "before")], check=False, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for key, r in results.items():
        attack_name, label = key.split(" | ")
        rows.append([attack_name, label, f"{r['victim_p50_ms']:.1f}",
                     f"{r['victim_p99_ms']:.1f}", f"{r['victim_max_ms']:.0f}",
                     f"{r['rss_added_mb']:,.0f}" + (" (stopped)" if r["stopped_at_rss_limit"]
                                                    else ""),
                     ", ".join(f"{k}: {v}" for k, v in sorted(r["attacker"].items()))])
    table = md_table(["attack", "server", "victim p50 ms", "victim p99 ms", "victim max ms",
                      "server RSS added MB", "attacker's answers"], rows)
    notes = [f"Each attack ran {duration:.0f} s per server on a fresh `serve.py` (plain HTTP, "
             "no policy bundle, default limits); the victim alternated `GET /v1/health/live` "
             f"and a `decide` on its own 10-node session every {1000 * PROBE_S:.0f} ms.",
             f"RSS sampled every {1000 * PROBE_S:.0f} ms; an attack is stopped when the "
             f"server passes {RSS_STOP_MB:,.0f} MB ('stopped')."]
    if before_commit:
        notes.append(f"'before' is commit {before_commit}, served from a git worktree with "
                     "this environment's Python.")
    command = "python bench/bench_server_abuse.py" + (f" --before {args.before}"
                                                       if args.before else "") + (
        " --quick" if args.quick else "")
    finish("bench_server_abuse", {"command": command,
                                  "settings": {"duration_s": duration, "quick": args.quick,
                                               "before": args.before,
                                               "before_commit": before_commit},
                                  "results": results, "total_s": time.perf_counter() - t0},
           table, notes, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
