"""Speed of the shaping sub-problem: the control-channel simulator, ``smart/Shaping-v0`` and
the real asyncio shaper on loopback TCP.

What is measured (median (min-max) of ``REPEATS`` runs each):

(a) simulator: wall time of ``simulate(SimConfig(tenants=4), policy, seed)`` (the Figs. 5-6
    configuration: 40 channels, 6 s of traffic, run until drained) per policy, with the link
    and with the hypervisor's I/O threads as the shared resource (``server``); messages
    simulated per wall second (both directions) and simulated seconds per wall second;
(b) env: ``smart/Shaping-v0`` with its default arguments (``configs/env/shaping.yaml``:
    4 tenants x 10 switches, 50 steps), uniform random actions: steps per second;
(c) real shaper: ``ConnectionShaper.pace`` CPU cost per call with the limit bypassed (policy
    ``none``) and with Sincon's limits (a limit so large that no call sleeps); one loopback TCP
    connection pushing ``PUSH_MB`` MB in 64 KiB writes, raw ``StreamWriter`` vs
    ``ShapedWriter`` (policy ``none``: the shaper's own overhead on a fast stream), and a
    static limit of 4 MB/s: throughput reached vs the limit.

Not pinned to a core (the loopback test needs the receiver and sender on the event loop);
the machine's load average is recorded in the result.

Usage: ``python bench/bench_shaping.py [--quick]``
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import finish, fmt_stats, log, md_table, stats

REPEATS = 5
PUSH_MB = 64
PACE_CALLS = 100_000


def bench_simulator() -> list[dict[str, Any]]:
    from envs.shaping.simulator import SimConfig, simulate

    rows = []
    for server in ("link", "hypervisor"):
        cfg = SimConfig(tenants=4, server=server)
        for pol in ("none", "static", "sincon"):
            times, msgs = [], 0
            for i in range(REPEATS):
                t0 = time.perf_counter()
                r = simulate(cfg, pol, seed=i)
                times.append(time.perf_counter() - t0)
                msgs = sum(r.messages)
            s = stats(times)
            rows.append({"policy": pol, "server": server, "time_s": s, "messages": msgs,
                         "messages_per_s": msgs / s["median"],
                         "sim_s_per_wall_s": cfg.duration_s / s["median"]})
            log(f"  simulator {server} {pol}: {fmt_stats(s, '{:.3f}')} s, "
                f"{msgs / s['median']:,.0f} msg/s")
    return rows


def bench_env() -> dict[str, Any]:
    import gymnasium as gym
    import yaml

    import envs  # noqa: F401

    kwargs = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "env" /
                             "shaping.yaml").read_text())["env"]["kwargs"]
    env = gym.make("smart/Shaping-v0", **kwargs)
    rates = []
    for i in range(REPEATS):
        env.reset(seed=i)
        env.action_space.seed(i)
        n, done = 0, False
        t0 = time.perf_counter()
        while not done:
            _, _, term, trunc, _ = env.step(env.action_space.sample())
            n += 1
            done = term or trunc
        rates.append(n / (time.perf_counter() - t0))
    s = stats(rates)
    log(f"  env: {fmt_stats(s)} steps/s")
    return {"steps_per_s": s, "kwargs": kwargs}


async def _pace_cost(policy: str) -> float:
    from delivery.shaper import ConnectionShaper, SharedLimits

    sh = ConnectionShaper(SharedLimits(policy, 4, 1e15))
    t0 = time.perf_counter()
    for _ in range(PACE_CALLS):
        await sh.pace(1000)
    return (time.perf_counter() - t0) / PACE_CALLS * 1e6


async def _push(mode: str, limit_policy: str = "none", total: int = PUSH_MB << 20,
                g: float = 16e6) -> tuple[float, float]:
    """Bytes/s of one loopback push: over the whole push, and over its second half."""
    from delivery.shaper import ConnectionShaper, ShapedWriter, SharedLimits

    marks: list[tuple[float, int]] = []
    done = asyncio.Event()

    async def handle(reader, writer):
        got = 0
        while chunk := await reader.read(1 << 18):
            got += len(chunk)
            marks.append((time.perf_counter(), got))
        writer.close()
        done.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, w = await asyncio.open_connection("127.0.0.1", port)
    out = ShapedWriter(w, ConnectionShaper(SharedLimits(limit_policy, 4, g)), 1 << 16) \
        if mode == "shaped" else w
    block = bytes(1 << 16)
    t0 = time.perf_counter()
    for _ in range(total // len(block)):
        out.write(block)
        if mode == "raw":
            await w.drain()
    await out.drain()
    out.close()
    await done.wait()
    server.close()
    await server.wait_closed()
    t_end, n_end = marks[-1]
    t_mid = (t0 + t_end) / 2
    n_mid = next(n for t, n in marks if t >= t_mid)
    return n_end / (t_end - t0), (n_end - n_mid) / (t_end - t_mid)


def bench_real() -> dict[str, Any]:
    res: dict[str, Any] = {}
    for pol in ("none", "sincon"):
        s = stats([asyncio.run(_pace_cost(pol)) for _ in range(REPEATS)])
        res[f"pace_us_{pol}"] = s
        log(f"  pace() {pol}: {fmt_stats(s, '{:.2f}')} us/call")
    for mode in ("raw", "shaped"):
        s = stats([asyncio.run(_push(mode))[0] / 1e6 for _ in range(REPEATS)])
        res[f"loopback_MBps_{mode}"] = s
        log(f"  loopback {mode}: {fmt_stats(s, '{:.0f}')} MB/s")
    limit = 4e6  # static split of 16 MB/s over 4 channels
    s = stats([asyncio.run(_push("shaped", "static", total=8 << 20))[1] / 1e6
               for _ in range(max(2, REPEATS // 2))])
    res["static_limit_MBps"] = limit / 1e6
    res["static_reached_MBps"] = s
    log(f"  static limit {limit / 1e6:.0f} MB/s: reached {fmt_stats(s, '{:.2f}')} MB/s")
    return res


def main() -> None:
    global REPEATS, PUSH_MB, PACE_CALLS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 run each, smaller pushes")
    args = ap.parse_args()
    if args.quick:
        REPEATS, PUSH_MB, PACE_CALLS = 1, 8, 10_000
    t_start = time.perf_counter()
    log(f"bench_shaping: {REPEATS} runs each")
    sim = bench_simulator()
    env = bench_env()
    real = bench_real()
    rows = [[f"simulator ({r['server']}), 4 tenants, {r['policy']}",
             fmt_stats(r["time_s"], "{:.3f}") + " s",
             f"{r['messages_per_s']:,.0f} msg/s, {r['sim_s_per_wall_s']:.1f} sim-s/s"]
            for r in sim]
    rows.append(["Shaping-v0 (default kwargs), random actions",
                 fmt_stats(env["steps_per_s"]) + " steps/s", ""])
    for pol in ("none", "sincon"):
        rows.append([f"ConnectionShaper.pace(), {pol}",
                     fmt_stats(real[f"pace_us_{pol}"], "{:.2f}") + " us/call", "no sleep"])
    for mode in ("raw", "shaped"):
        rows.append([f"loopback TCP {PUSH_MB} MiB, {mode} writer",
                     fmt_stats(real[f"loopback_MBps_{mode}"], "{:.0f}") + " MB/s",
                     "policy none" if mode == "shaped" else "StreamWriter + drain"])
    rows.append(["loopback TCP 8 MiB, static limit 4 MB/s",
                 fmt_stats(real["static_reached_MBps"], "{:.2f}") + " MB/s",
                 "reached, second half of the push"])
    table = md_table(["what", "median (min-max)", "note"], rows)
    notes = [f"median (min-max) of {REPEATS} runs; not pinned",
             "simulator: SimConfig(tenants=4) defaults, run until every message is delivered",
             "static limit: the rate at the receiver over the second half of the push (the "
             "first burst passes within the shaper's burst allowance)",
             "loopback pushes: bytes at the receiver / time from the first write to the last "
             "byte received"]
    total = time.perf_counter() - t_start
    finish("bench_shaping", {"settings": {"repeats": REPEATS, "push_mb": PUSH_MB,
                                    "pace_calls": PACE_CALLS, "quick": args.quick},
                       "simulator": sim, "env": env, "real": real, "total_s": total},
           table, notes, total)


if __name__ == "__main__":
    main()
