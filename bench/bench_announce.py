"""Time from a policy hot swap to the last of many cached adapters deciding with the new
version: subscribed announcements (Stemflow Section IV, ``serving/announce.py`` and
``serving/client/subscriber.py``) vs polling alone.

Set-up: a real Pulsar standalone broker (``harness.broker``), the policy server
(``serve.py`` under uvicorn, ``announce.url`` on that broker) and ``ADAPTERS`` cached
adapters of the tiny scenario (one per thread, as independent controllers), each deciding
its interval (``decide(replan=True)``) every ``PERIOD_S``. Two bundles with different
weights are exported once; each run PUTs the other one and measures, per adapter, the time
from sending the PUT to its first decision with the new version.

* ``subscription``: ``refresh_s=600`` (no poll during the run) and ``announce_url`` set: the
  announcement starts the adapter's refresh at once;
* ``polling``: ``refresh_s=POLL_S``, no subscription (the fallback when the broker is away).

Reported (median (min-max) of ``RUNS`` runs): the last adapter's time (all adapters on the
new version) and the median adapter's. Between runs the next swap waits a random 0-1 s, so
the polls' phase differs from run to run.

Secure, as deployed: the broker with TLS, mutual-TLS authentication and the grants of
``security.pulsar`` (the server produces as ``policy-server`` on the run's topic, granted
to it at start; the adapters read as ``controller``), the server over HTTPS, the bundles
signed with the PKI's key and verified by the server and by every adapter.

Usage: ``python bench/bench_announce.py [--quick]`` (needs Java and Maven for the broker,
and torch to export the two bundles).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import finish, fmt_stats, log, md_table, stats

ADAPTERS, RUNS, PERIOD_S, POLL_S = 20, 5, 0.05, 5.0
QUICK = {"adapters": 8, "runs": 3}
KEY, ADMIN = "bench-key-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0", "bench-admin-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0"


def export_bundles(root: Path, problems: Any) -> dict[str, Path]:
    """Two tiny-scenario bundles with different (seeded, untrained) weights."""
    import torch

    from agents.bundle_export import export_bundle
    from agents.ddpg.networks import mlp
    from envs.dsmd.observation import ObservationLayout

    out = {}
    k = problems.spec.num_topics
    layout = ObservationLayout("channel", problems.catalog_size, problems.num_nodes, k)
    for name, seed in (("a", 0), ("b", 1)):
        torch.manual_seed(seed)
        actor = mlp(layout.size, [32, 32], k + 1, torch.nn.Tanh())
        out[name] = root / name
        export_bundle(actor, layout, problems.signature() | {"num_topics": k}, out[name],
                      decoding="feasible", extra={"algorithm": f"bench-seed{seed}"})
    return out


class Driver:
    """One thread per adapter deciding every ``PERIOD_S``; records each adapter's first
    decision with the awaited version."""

    def __init__(self, adapters: list[Any], problems: Any) -> None:
        self.adapters, self.ps = adapters, problems
        self.want = 0
        self.first: list[float | None] = [None] * len(adapters)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(len(adapters))]

    def start(self) -> Driver:
        for t in self.threads:
            t.start()
        return self

    def expect(self, version: int) -> None:
        with self.lock:
            self.want, self.first = version, [None] * len(self.adapters)

    def _run(self, i: int) -> None:
        ad = self.adapters[i]
        nxt = time.perf_counter()
        while not self.stop.is_set():
            try:
                v = min(d.policy_version for d in ad.decide(replan=True))
            except Exception as e:  # reported, never silently lost
                self.errors.append(f"adapter {i}: {e!r}")
                v = -1
            now = time.perf_counter()
            with self.lock:
                if v == self.want and self.first[i] is None:
                    self.first[i] = now
            nxt += PERIOD_S
            time.sleep(max(0.0, nxt - time.perf_counter()))

    def wait_all(self, timeout: float) -> list[float]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if all(f is not None for f in self.first):
                    return [f for f in self.first if f is not None]
            time.sleep(0.01)
        raise TimeoutError(f"not every adapter reached v{self.want} in {timeout} s")

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)


def run_mode(mode: str, server: Any, problems: Any, bundles: dict[str, Path], url: str,
             topic: str, n_adapters: int, runs: int, tmp: Path) -> dict[str, Any]:
    import httpx

    from serving.scenario import adapter_for, replay_window

    kw: dict[str, Any] = ({"refresh_s": 600.0, "announce_url": url, "announce_topic": topic}
                          if mode == "subscription" else {"refresh_s": POLL_S})
    ads = [adapter_for(problems, server.url, "cached", api_key=KEY,
                       cache_dir=tmp / f"{mode}-{i}", **kw) for i in range(n_adapters)]
    for ad in ads:
        replay_window(ad, problems, problems.windows["test"][0])
        if ad.subscriber is not None and not ad.subscriber.wait_ready(60):
            raise RuntimeError("an adapter's subscription never connected")
    from serving.bundles.static import load_bundle

    hash_a = load_bundle(bundles["a"]).content_hash
    drv = Driver(ads, problems).start()
    last, median = [], []
    try:
        with httpx.Client(base_url=server.url, verify=server.verify,
                          headers={"X-API-Key": ADMIN}, timeout=30) as c:
            for r in range(runs):
                cur = c.get("/v1/policy").json()
                other = "b" if cur["hash"] == hash_a else "a"
                drv.expect(int(cur["version"]) + 1)
                time.sleep(random.uniform(0.0, 1.0))
                t0 = time.perf_counter()
                resp = c.put("/v1/policy", json={"path": str(bundles[other]),
                                                 "allow_rollback": True})
                put_s = time.perf_counter() - t0
                if resp.status_code != 200 or resp.json()["version"] != drv.want:
                    raise RuntimeError(f"swap refused: {resp.text}")
                got = [f - t0 for f in drv.wait_all(3 * POLL_S + 30)]
                last.append(max(got))
                median.append(statistics.median(got))
                log(f"  {mode:12s} run {r + 1}/{runs}: last adapter {max(got):.3f} s, median "
                    f"{statistics.median(got):.3f} s (PUT answered in {put_s * 1e3:.0f} ms)")
    finally:
        drv.close()
        for ad in ads:
            ad.close()
    if drv.errors:
        raise RuntimeError(f"decisions failed: {drv.errors[:3]}")
    out = {"last_s": stats(last), "median_adapter_s": stats(median)}
    if mode == "subscription":
        out["announcements"] = {f"{k}/{o}": n for ad in ads[:1]
                                for (k, o), n in ad.subscriber.counts.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK['adapters']} adapters, {QUICK['runs']} runs per mode")
    args = ap.parse_args()
    n, runs = (QUICK["adapters"], QUICK["runs"]) if args.quick else (ADAPTERS, RUNS)
    t_start = time.perf_counter()

    from envs.dsmd.problems import build_problems
    from envs.dsmd.scenarios import load_scenario
    from harness.broker import PulsarStandalone
    from serving.local import LocalServer

    ps = build_problems(load_scenario("tiny"), cache_dir=None)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-announce-") as d:
        tmp = Path(d)
        bundles = export_bundles(tmp / "bundles", ps)
        topic = f"persistent://public/default/bench-announce-{uuid.uuid4().hex[:8]}"
        # the policy server's role may produce on this run's topic (granted at start)
        broker = PulsarStandalone(progress=None, announce_topics=(topic,))
        with broker, LocalServer(bundles["a"], tmp / "server", api_key=KEY, admin_key=ADMIN,
                                 overrides=[f"announce.url={broker.service_url}",
                                            f"announce.topic={topic}"]) as server:
            for mode in ("subscription", "polling"):
                log(f"{mode}: {n} cached adapters")
                results[mode] = run_mode(mode, server, ps, bundles, broker.service_url,
                                         topic, n, runs, tmp)
    rows = [[mode, f"{n}", fmt_stats(r["last_s"], "{:.3f}"),
             fmt_stats(r["median_adapter_s"], "{:.3f}")] for mode, r in results.items()]
    table = md_table(["cached adapters learn of a swap by", "adapters",
                      "PUT -> last adapter on the new version, s",
                      "PUT -> median adapter, s"], rows)
    notes = [f"tiny scenario, {n} cached adapters each deciding its interval every "
             f"{PERIOD_S * 1e3:.0f} ms on a thread of its own; median (min-max) of {runs} "
             "swaps per mode, each to the other of two bundles",
             f"subscription: refresh_s=600 and announce_url (a non-durable reader on the "
             f"server's announcement topic of a local Pulsar standalone); polling: "
             f"refresh_s={POLL_S:g}, no subscription",
             "the time includes the adapter's GET /v1/policy, the bundle download, its "
             "signature check and its ONNX Runtime load; the server, the broker and the "
             "adapters share this machine",
             "secure: broker TLS with mutual-TLS authentication and grants, server HTTPS, "
             "signed bundles"]
    total = time.perf_counter() - t_start
    finish("bench_announce", {"settings": {"adapters": n, "runs": runs, "period_s": PERIOD_S,
                                           "poll_s": POLL_S, "quick": args.quick},
                              "results": results, "total_s": total}, table, notes, total)


if __name__ == "__main__":
    main()
