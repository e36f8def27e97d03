"""The cost of mutual TLS on the controller's pushes to an agent (``delivery/``, gRPC).

A real message agent (``AgentHost``, one node, its record on disk) serves; a client with the
controller's channel settings (:func:`delivery.rpc.open_channel` as ``controller``: the same
credentials the controller's push channels use) pushes to it, once with mutual TLS (the
default: the agent's role check included) and once insecure, alternately, ``REPEATS`` times
each. Measured per run:

(a) connect: the first ``Push`` on a fresh channel (TCP, and the TLS handshake with both
    certificates verified when secure), ms;
(b) round trip: ``LATENCY_CALLS`` sequential ``Push`` calls of one message (64-byte payload),
    p50 and p95 in microseconds;
(c) stream: ``STREAM_MESSAGES`` messages in batches of ``BATCH`` with ``INFLIGHT`` calls in
    flight (as the controller's flush sends), messages per second.

Every message is newer than its resource's last one, so each is applied (written to the
record) like a real push. Client and agent share this process (and its GIL) in both modes;
not pinned. Reported: median (min-max) over the runs.

Usage: ``python bench/bench_security_grpc.py [--quick]``
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import finish, fmt_stats, log, md_table, stats

REPEATS = 3
LATENCY_CALLS = 2000
STREAM_MESSAGES = 40_000
BATCH = 100
INFLIGHT = 8
PAYLOAD = b"\x5a" * 64


class _Messages:
    """Fresh ConfigMessages for node 0: increasing timestamps, 64 resources per lane (the
    calls of one lane are never in flight together, so each message is newer than its
    resource's last one and is applied)."""

    def __init__(self) -> None:
        self.ids = itertools.count(1)

    def make(self, n: int, lane: int = 0) -> list[Any]:
        from delivery.rpc import pb

        out = []
        for _ in range(n):
            i = next(self.ids)
            out.append(pb.ConfigMessage(message_id=i % 2**32, vpc_id=1,
                                        timestamp_ns=time.time_ns() + i,
                                        configuration_type="SUBNET", operation_type="UPDATE",
                                        resource_id=1000 * lane + i % 64, hosts=[0],
                                        payload=PAYLOAD))
        return out


def one_run(insecure: bool, tmp: Path) -> dict[str, float]:
    from delivery.agent import AgentConfig
    from delivery.agent_host import AgentHost
    from delivery.rpc import open_channel, pb, pb_grpc
    from security.tls import Security

    sec = Security(insecure=insecure)
    tmp.mkdir(parents=True)
    msgs = _Messages()
    cfg = AgentConfig(0, f"sqlite:///{tmp / 'meta.db'}", tmp / "records", security=sec)
    with AgentHost([cfg], None) as host:
        address = f"127.0.0.1:{host.ports()[0]}"
        with open_channel(address, sec, "controller") as ch:
            stub = pb_grpc.MessageAgentStub(ch)
            t0 = time.perf_counter()
            stub.Push(pb.ConfigBatch(messages=msgs.make(1)), timeout=10)
            connect_ms = (time.perf_counter() - t0) * 1e3
            for _ in range(200):  # warm up
                stub.Push(pb.ConfigBatch(messages=msgs.make(1)), timeout=10)
            rtts = []
            for _ in range(LATENCY_CALLS):
                batch = pb.ConfigBatch(messages=msgs.make(1))
                t0 = time.perf_counter()
                stub.Push(batch, timeout=10)
                rtts.append((time.perf_counter() - t0) * 1e6)
            # batch k waits for batch k - INFLIGHT (its lane's previous one) to be answered
            batches = [pb.ConfigBatch(messages=msgs.make(BATCH, 1 + k % INFLIGHT))
                       for k in range(STREAM_MESSAGES // BATCH)]
            t0 = time.perf_counter()
            inflight: list[Any] = []
            accepted = 0
            for b in batches:
                if len(inflight) >= INFLIGHT:
                    accepted += inflight.pop(0).result().accepted
                inflight.append(stub.Push.future(b, timeout=60))
            for f in inflight:
                accepted += f.result().accepted
            stream_s = time.perf_counter() - t0
        assert accepted == STREAM_MESSAGES, accepted
        applied = host.counters()[0]["outcomes"]["applied"]
        assert applied == 1 + 200 + LATENCY_CALLS + STREAM_MESSAGES, applied
        assert host.counters()[0]["refused_calls"] == 0
    q = statistics.quantiles(rtts, n=100)
    return {"connect_ms": connect_ms, "p50_us": q[49], "p95_us": q[94],
            "stream_msgs_per_s": STREAM_MESSAGES / stream_s}


def main() -> None:
    global REPEATS, LATENCY_CALLS, STREAM_MESSAGES
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 run each, fewer messages")
    args = ap.parse_args()
    if args.quick:
        REPEATS, LATENCY_CALLS, STREAM_MESSAGES = 1, 300, 4000
    import logging
    import os

    logging.basicConfig(level=logging.ERROR)  # insecure mode's warning: once per run
    t_start = time.perf_counter()
    log(f"bench_security_grpc: {REPEATS} runs per mode, alternating")
    runs: dict[str, list[dict[str, float]]] = {"mtls": [], "insecure": []}
    with tempfile.TemporaryDirectory(prefix="bench-sec-") as d:
        os.environ.setdefault("SMART_PKI_DIR", str(Path(d) / "pki"))  # a throwaway dev PKI
        from security.pki import Pki

        Pki.ensure(None, agents=[0])  # issued before timing
        for r in range(REPEATS):
            for mode in ("mtls", "insecure"):
                out = one_run(mode == "insecure", Path(d) / f"{mode}-{r}")
                runs[mode].append(out)
                log(f"  {mode:8s} run {r + 1}/{REPEATS}: connect {out['connect_ms']:.1f} ms, "
                    f"p50 {out['p50_us']:.0f} us, p95 {out['p95_us']:.0f} us, "
                    f"{out['stream_msgs_per_s']:,.0f} msg/s")
    summary = {mode: {k: stats([x[k] for x in rs]) for k in rs[0]}
               for mode, rs in runs.items()}
    m, i = summary["mtls"], summary["insecure"]

    def ratio(k: str) -> str:
        return f"{m[k]['median'] / i[k]['median']:.2f}x"

    rows = [["first Push on a new channel (connect)", fmt_stats(m["connect_ms"], "{:.1f}"),
             fmt_stats(i["connect_ms"], "{:.1f}"), "ms", ratio("connect_ms")],
            ["Push round trip, 1 message, p50", fmt_stats(m["p50_us"]),
             fmt_stats(i["p50_us"]), "us", ratio("p50_us")],
            ["Push round trip, 1 message, p95", fmt_stats(m["p95_us"]),
             fmt_stats(i["p95_us"]), "us", ratio("p95_us")],
            [f"stream, batches of {BATCH}, {INFLIGHT} in flight",
             fmt_stats(m["stream_msgs_per_s"]), fmt_stats(i["stream_msgs_per_s"]),
             "messages/s", ratio("stream_msgs_per_s")]]
    table = md_table(["what", "mutual TLS", "insecure", "unit", "mTLS / insecure"], rows)
    notes = [f"median (min-max) of {REPEATS} runs per mode, modes alternating; not pinned",
             f"round trips: {LATENCY_CALLS} sequential calls after 200 warm-up calls; stream: "
             f"{STREAM_MESSAGES} messages, 64-byte payloads, each applied to the record",
             "one agent (AgentHost) and the client in one process; mutual TLS includes the "
             "agent's role check on every call"]
    total = time.perf_counter() - t_start
    finish("bench_security_grpc", {
        "settings": {"repeats": REPEATS, "latency_calls": LATENCY_CALLS,
                     "stream_messages": STREAM_MESSAGES, "batch": BATCH,
                     "inflight": INFLIGHT, "quick": args.quick},
        "runs": runs, "summary": summary, "total_s": total}, table, notes, total)


if __name__ == "__main__":
    main()
