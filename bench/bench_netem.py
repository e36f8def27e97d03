"""The emulated network's limits at the testbed's rates (:mod:`delivery.netem`).

What is measured (median (min-max) of ``REPEATS`` runs each):

(a) bandwidth: an iperf-style TCP transfer (goodput) through the controller's link shaped to
    the GoDaddy C_b scaled like the testbed (8 Mbit/s on the wire), and through a node's
    link shaped to s(n) (20 Mbit/s), from the broker's namespace; goodput / (0.95 x rate)
    (TCP/IP headers take about 5% of 1500-byte frames);
(b) loss: UDP datagrams through a node link with 0.1% and 1% loss (nftables);
(c) delay: request/response round trips through the user-space relay (:mod:`delivery.relay`)
    at 10 and 50 ms one
    way (a round trip gains twice the delay);
(d) size: building and removing the network for the GoDaddy 350 nodes and for 1,000 nodes
    (time, and the kernel memory it takes: MemAvailable before and after).

Usage: ``python bench/bench_netem.py [--quick]`` (needs root).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import finish, fmt_stats, log, md_table, stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from delivery import netem
from delivery.netem import (
    BROKER_ADDRESS,
    EmulatedNetwork,
    NetworkSpec,
    measure_loss,
    measure_throughput,
    node_address,
)

REPEATS = 3
C_B, S_N = 8e6, 20e6  # GoDaddy's 400 Mbit/s and 1 Gbit/s x payload_scale / time_scale (0.02)


def _mem_available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bench_bandwidth(repeats: int) -> list[dict[str, Any]]:
    rows = []
    with EmulatedNetwork(NetworkSpec([0], controller_bps=C_B, node_bps=S_N)) as net:
        for name, src, dst, host, rate in (
                ("C_b (controller egress)", net.controller, net.broker, BROKER_ADDRESS, C_B),
                ("s(n) (node ingress)", net.broker, net.node(0), node_address(0), S_N)):
            got = [measure_throughput(net, src, dst, host, 3.0) for _ in range(repeats)]
            s = stats([g / (0.95 * rate) for g in got])
            rows.append({"limit": name, "setting": f"{rate / 1e6:g} Mbit/s", "ratio": s,
                         "goodput_mbps": stats([g / 1e6 for g in got])})
            log(f"  {name}: goodput {fmt_stats(rows[-1]['goodput_mbps'], '{:.2f}')} Mbit/s")
    return rows


def bench_loss(repeats: int, packets: int) -> list[dict[str, Any]]:
    rows = []
    for p in (0.001, 0.01):
        with EmulatedNetwork(NetworkSpec([0], loss=p)) as net:
            got = [measure_loss(net, net.broker, net.node(0), node_address(0), packets)
                   for _ in range(repeats)]
        s = stats([g / p for g in got])
        rows.append({"limit": "loss", "setting": f"{100 * p:g}%", "ratio": s,
                     "measured": stats(got)})
        log(f"  loss {p}: measured {fmt_stats(stats(got), '{:.4f}')}")
    return rows


def bench_delay(repeats: int) -> list[dict[str, Any]]:
    rows = []
    with EmulatedNetwork(NetworkSpec([0])) as net:
        for d in (10.0, 50.0):
            meds = [1e3 * netem.measure_relay_rtt(net, 0, d, rounds=30, port=7302)
                    for _ in range(repeats)]
            s = stats([m / (2 * d) for m in meds])
            rows.append({"limit": "delay (relay)", "setting": f"{d:g} ms one way", "ratio": s,
                         "rtt_ms": stats(meds)})
            log(f"  delay {d} ms: round trip {fmt_stats(stats(meds), '{:.1f}')} ms")
    return rows


def bench_size(sizes: list[int]) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        mem0 = _mem_available_mb()
        t0 = time.perf_counter()
        net = EmulatedNetwork(NetworkSpec(list(range(n)), controller_bps=C_B, node_bps=S_N))
        net.create()
        build = time.perf_counter() - t0
        mem1 = _mem_available_mb()
        t1 = time.perf_counter()
        net.close()
        rows.append({"nodes": n, "build_s": build, "remove_s": time.perf_counter() - t1,
                     "kernel_mb": mem0 - mem1,
                     "left": sum(ns.startswith(net.tag + "-") for ns in netem.list_namespaces())})
        log(f"  {n} nodes: built in {build:.1f} s, removed in {rows[-1]['remove_s']:.1f} s, "
            f"{mem0 - mem1:.0f} MB")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    why = netem.available()
    if why:
        sys.exit(f"bench_netem: {why}")
    repeats = 1 if args.quick else REPEATS
    t0 = time.perf_counter()
    limits = (bench_bandwidth(repeats) + bench_loss(repeats, 20000 if args.quick else 100000)
              + bench_delay(repeats))
    sizes = bench_size([50] if args.quick else [350, 1000])
    rows = [[r["limit"], r["setting"], fmt_stats(r["ratio"], "{:.3f}")] for r in limits]
    table = md_table(["limit", "setting", "measured / setting (median (min-max))"], rows)
    table += "\n\n" + md_table(
        ["nodes (namespaces)", "build s", "remove s", "kernel memory MB", "left behind"],
        [[r["nodes"], f"{r['build_s']:.1f}", f"{r['remove_s']:.1f}",
          f"{r['kernel_mb']:.0f}", r["left"]] for r in sizes])
    notes = ["bandwidth: TCP goodput / (0.95 x the shaped wire rate); loss: UDP datagrams "
             "lost / the setting; delay: median request/response time through the relay / "
             "(2 x the one-way delay)",
             "kernel memory: MemAvailable before minus after building (noisy on a shared "
             "machine)"]
    finish("bench_netem", {"limits": limits, "sizes": sizes}, table, notes,
           time.perf_counter() - t0)


if __name__ == "__main__":
    main()
