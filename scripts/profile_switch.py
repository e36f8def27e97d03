"""Profile a real software switch the way Section IV of Optimal Multicast (Zhu et al.)
profiles Open vSwitch: per-copy output rate of a saturating input flow against the number
of copies ``d``.

The switch is a Linux bridge in its own network namespace; a source namespace sends UDP
broadcast packets (so the bridge floods every packet to all its other ports) over a veth
pair, and ``d`` veth pairs lead from the bridge to a receiver namespace. For each ``d`` the
script sends as fast as one Python sender can for ``--seconds`` and reads the bridge ports'
packet counters (``ip -s -j link``): the per-copy output rate is the mean of the ``d``
output ports' transmitted bytes over the time, the input rate the source port's received
bytes. Namespaces and links are created and removed by this script (names ``mcp_*``); it
needs root and ``ip``.

On a shared machine the runs are noisy (other work takes the CPU the sender and the bridge
need), so each degree keeps its best run (the least disturbed), and the table written is the
least-squares fit of the cloning-cost model of :mod:`envs.trees.switch` to those,
``1 / g(d) = a + b d`` (``a``: per input packet, here the Python sender's own cost included;
``b``: per copy), for ``d = 1..256``, which is a valid profile by construction. The raw runs,
the best and median per degree and the fit are kept in the JSON beside the table.

Writes ``envs/trees/profiles/linux_bridge.csv`` (``d,g_gbps``, checked by
:func:`envs.trees.switch.load_profile`) and ``linux_bridge.json``.

Usage: ``python scripts/profile_switch.py [--max-degree 14] [--seconds 1] [--repeats 5]``
(``--refit``: only refit the runs already in the JSON).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from envs.trees.switch import PROFILES_DIR, load_profile, write_profile  # noqa: E402

NS_BR, NS_SRC, NS_DST = "mcp_br", "mcp_src", "mcp_dst"
PAYLOAD = 1400  # bytes of UDP payload (iperf's default datagram is 1470)
FRAME = PAYLOAD + 8 + 20 + 14  # on the wire inside the host (UDP + IPv4 + Ethernet)

SENDER = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
buf, end, dst = b"x" * {payload}, time.perf_counter() + {seconds}, ("10.77.0.255", 9)
n = 0
while time.perf_counter() < end:
    for _ in range(64):
        try:
            s.sendto(buf, dst)
            n += 1
        except OSError:
            pass
print(n)
"""


def sh(*args: str, check: bool = True) -> str:
    out = subprocess.run(list(args), capture_output=True, text=True, check=False)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def teardown() -> None:
    for ns in (NS_SRC, NS_DST, NS_BR):
        sh("ip", "netns", "del", ns, check=False)


def setup(d: int) -> None:
    teardown()
    for ns in (NS_BR, NS_SRC, NS_DST):
        sh("ip", "netns", "add", ns)
    sh("ip", "-n", NS_BR, "link", "add", "br0", "type", "bridge", "stp_state", "0")
    sh("ip", "-n", NS_BR, "link", "set", "br0", "up")
    sh("ip", "link", "add", "mcps", "netns", NS_SRC, "type", "veth", "peer", "name", "mcpsb",
       "netns", NS_BR)
    sh("ip", "-n", NS_BR, "link", "set", "mcpsb", "master", "br0", "up")
    sh("ip", "-n", NS_SRC, "addr", "add", "10.77.0.1/24", "dev", "mcps")
    sh("ip", "-n", NS_SRC, "link", "set", "mcps", "up")
    for i in range(1, d + 1):
        sh("ip", "link", "add", f"mcpd{i}", "netns", NS_DST, "type", "veth", "peer", "name",
           f"mcpb{i}", "netns", NS_BR)
        sh("ip", "-n", NS_BR, "link", "set", f"mcpb{i}", "master", "br0", "up")
        sh("ip", "-n", NS_DST, "link", "set", f"mcpd{i}", "up")


def counters() -> dict[str, dict[str, int]]:
    links = json.loads(sh("ip", "-n", NS_BR, "-s", "-j", "link", "show"))
    return {ln["ifname"]: {"rx": ln["stats64"]["rx"]["bytes"], "tx": ln["stats64"]["tx"]["bytes"]}
            for ln in links}


def measure(d: int, seconds: float) -> dict[str, float]:
    time.sleep(0.2)  # let the ports come up
    before = counters()
    t0 = time.perf_counter()
    sent = sh("ip", "netns", "exec", NS_SRC, sys.executable, "-c",
              SENDER.format(payload=PAYLOAD, seconds=seconds))
    elapsed = time.perf_counter() - t0
    time.sleep(0.1)  # drain the backlog
    after = counters()
    outs = [(after[f"mcpb{i}"]["tx"] - before[f"mcpb{i}"]["tx"]) for i in range(1, d + 1)]
    inp = after["mcpsb"]["rx"] - before["mcpsb"]["rx"]
    return {"d": d, "seconds": seconds, "elapsed_s": elapsed, "sent_packets": int(sent),
            "input_gbps": inp * 8 / seconds / 1e9,
            "per_copy_gbps": statistics.mean(outs) * 8 / seconds / 1e9,
            "per_copy_min_gbps": min(outs) * 8 / seconds / 1e9,
            "total_out_gbps": sum(outs) * 8 / seconds / 1e9}


def fit(runs: list[dict[str, float]], max_degree: int) -> dict[str, object]:
    """Best run per degree and the least-squares fit ``1 / g(d) = a + b d``."""
    ds = list(range(1, max_degree + 1))
    best = [max(r["per_copy_gbps"] for r in runs if r["d"] == d) for d in ds]
    med = [statistics.median(r["per_copy_gbps"] for r in runs if r["d"] == d) for d in ds]
    n = len(ds)
    y = [1.0 / v for v in best]
    mx, my = sum(ds) / n, sum(y) / n
    b = sum((d - mx) * (v - my) for d, v in zip(ds, y)) / sum((d - mx) ** 2 for d in ds)
    a = my - b * mx
    return {"best_per_copy_gbps": best, "median_per_copy_gbps": med, "a": a, "b": b,
            "g1_gbps": 1.0 / (a + b), "rho": a / b if b > 0 else None,
            "cap_total_gbps": 1.0 / b if b > 0 else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-degree", type=int, default=14)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--refit", action="store_true", help="refit the runs in the JSON")
    ap.add_argument("--out", default=str(PROFILES_DIR / "linux_bridge.csv"))
    args = ap.parse_args()
    out = Path(args.out)
    raw = out.with_suffix(".json")
    if args.refit:
        doc = json.loads(raw.read_text())
        runs, info = doc["runs"], doc["machine"]
        args.max_degree = max(int(r["d"]) for r in runs)
    else:
        if os.geteuid() != 0:
            raise SystemExit("profile_switch.py needs root (network namespaces)")
        runs = []
        t_start = time.perf_counter()
        try:
            for d in range(1, args.max_degree + 1):
                setup(d)
                for rep in range(args.repeats):
                    r = measure(d, args.seconds)
                    r["repeat"] = rep
                    runs.append(r)
                    print(f"d={d:2d} rep {rep}: input {r['input_gbps']:.3f} Gbps, per copy "
                          f"{r['per_copy_gbps']:.3f} Gbps, total {r['total_out_gbps']:.3f} "
                          f"Gbps ({time.perf_counter() - t_start:.0f} s)", flush=True)
        finally:
            teardown()
        info = {"timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "uname": " ".join(os.uname()), "cpu_count": os.cpu_count(),
                "loadavg": os.getloadavg(), "payload_bytes": PAYLOAD, "frame_bytes": FRAME,
                "args": vars(args)}
    model = fit(runs, args.max_degree)
    raw.write_text(json.dumps({"machine": info, "fit": model, "runs": runs}, indent=2) + "\n")
    print(f"best per copy (Gbps): {[round(v, 3) for v in model['best_per_copy_gbps']]}")
    print(f"fit 1/g = {model['a']:.4f} + {model['b']:.4f} d: g(1) = {model['g1_gbps']:.3f} Gbps, "
          f"rho = {model['rho']}, total cap = {model['cap_total_gbps']} Gbps")
    if not model["b"] > 0:
        print("no cloning cost detected (b <= 0): no profile table written")
        return
    a, b = float(model["a"]), float(model["b"])
    write_profile(out, [1.0 / (a + b * d) for d in range(1, 257)], header=[
        "Linux bridge in a network namespace, UDP broadcast flooded to d veth ports",
        f"fit 1/g(d) = a + b d to the best of {args.repeats} runs of {args.seconds} s per d "
        f"(d = 1..{args.max_degree}): a = {a:.5f}, b = {b:.5f} (1/Gbps)",
        f"measured {info['timestamp']} by scripts/profile_switch.py; raw runs: {raw.name}",
        f"machine: {info['uname']}; {info['cpu_count']} CPUs; loadavg {info['loadavg']}"])
    sw = load_profile(out)
    print(f"wrote {out}: valid profile, d g(d) concave: {sw.concave}")


if __name__ == "__main__":
    main()
