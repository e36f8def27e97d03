"""Benchmark: what the controller's durable outbox costs when it accepts messages.

``Controller.send_many`` with the outbox on (one SQLite transaction per call, WAL,
``synchronous=NORMAL``; and ``outbox_fsync``: ``FULL``) and off, for batches of 1, 10 and 100
messages of an RPC type: accepted messages per second (the time until ``send_many`` returns,
i.e. until they are durable and queued for their channel; nothing is pushed). Then the
confirmation path: ``MetadataStore.outbox_confirm`` of one packed reply's worth of results.
No broker is needed (the controller's Pulsar client never connects: no MQ type is used).

    .venv/bin/python bench/bench_outbox.py [--quick]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from _common import finish, fmt_stats, log, md_table, stats

from delivery.controller import Controller, ControllerConfig
from delivery.store import MetadataStore
from envs.dsmd.message import Message

REPEATS = 5
MESSAGES = 3000


def _accept_rate(tmp: Path, batch: int, outbox: bool, fsync: bool, run: int) -> float:
    cfg = ControllerConfig("pulsar://127.0.0.1:1", f"sqlite:///{tmp / f'm{run}-{batch}.db'}",
                           outbox=outbox, outbox_fsync=fsync, failover={"enabled": False})
    ctl = Controller(cfg, {n: f"127.0.0.1:{1 + n}" for n in range(4)}).start()
    try:
        ctl.set_channels({0: 0}, {0: (0, 1, 2, 3)})
        msgs = [Message(k, k, 1, "SUBNET", "UPDATE", k % 50, 200, (0, 1, 2, 3),
                        ctl.timestamp()) for k in range(1, MESSAGES + 1)]
        t0 = time.perf_counter()
        for i in range(0, len(msgs), batch):
            ctl.send_many([(m, 0) for m in msgs[i:i + batch]])
        dt = time.perf_counter() - t0
        ctl._outbox.clear()   # nothing is pushed: the agents are not running
    finally:
        ctl.close()
    return MESSAGES / dt


def _confirm_rate(tmp: Path, run: int, per_reply: int = 100) -> float:
    store = MetadataStore(f"sqlite:///{tmp / f'c{run}.db'}")
    try:
        store.outbox_put([(ts, 0, 1, b"x" * 100, (0, 1, 2, 3)) for ts in range(1, MESSAGES + 1)],
                         0)
        t0 = time.perf_counter()
        for n in range(4):
            for i in range(1, MESSAGES + 1, per_reply):
                store.outbox_confirm((n, ts) for ts in range(i, i + per_reply))
        dt = time.perf_counter() - t0
        assert store.outbox_size() == (0, 0)
    finally:
        store.close()
    return 4 * MESSAGES / dt


def main() -> None:
    global REPEATS, MESSAGES
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 run each, fewer messages")
    args = ap.parse_args()
    if args.quick:
        REPEATS, MESSAGES = 1, 500
    t_start = time.perf_counter()
    log(f"bench_outbox: {REPEATS} runs each, {MESSAGES} messages of 4 destinations")
    res: dict[str, dict] = {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-outbox-") as d:
        tmp = Path(d)
        for batch in (1, 10, 100):
            for label, outbox, fsync in (("off", False, False), ("on", True, False),
                                         ("on, fsync", True, True)):
                vals = [_accept_rate(tmp, batch, outbox, fsync, r) for r in range(REPEATS)]
                s = res[f"accept_batch{batch}_{label}"] = stats(vals)
                log(f"  batch {batch:3d}, outbox {label:9s}: {fmt_stats(s)} msg/s")
                rows.append([f"send_many, batch {batch}", f"outbox {label}",
                             fmt_stats(s) + " msg/s"])
        s = res["confirm"] = stats([_confirm_rate(tmp, r) for r in range(REPEATS)])
        rows.append(["outbox_confirm, 100 results per reply", "", fmt_stats(s) + " rows/s"])
    table = md_table(["what", "outbox", "median (min-max)"], rows)
    notes = [f"median (min-max) of {REPEATS} runs; not pinned",
             "accepted = durable in the outbox (when on) and queued for the RPC channel; "
             "SQLite in a temporary directory (WAL)",
             "fsync: synchronous=FULL (survives a power loss); the default NORMAL survives "
             "a crash of the process"]
    total = time.perf_counter() - t_start
    finish("bench_outbox", {"settings": {"repeats": REPEATS, "messages": MESSAGES,
                                         "quick": args.quick}, "results": res,
                            "total_s": total}, table, notes, total)


if __name__ == "__main__":
    main()
