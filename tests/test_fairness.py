"""Per-tenant fairness on the southbound channel (``delivery/fairness.py``).

Fast tests drive :class:`TenantShaper` with a fake clock and :meth:`TenantShaper.step` (no
threads), ``release`` collecting into a list; a few use the real pump thread. The slow test
runs the controller with shaping on a real broker with real agents: a large tenant bursts
while a small one sends a steady trickle to the same nodes, with one FIFO at the same cap
(off) and with Sincon's per-class limits (on); the small tenant's p95 delay is judged from
the agents' programming records.
"""

from __future__ import annotations

import math
import random
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from delivery.fairness import TenantShaper, TenantShapingConfig
from delivery.shaper import ConnectionShaper, SharedLimits
from envs.dsmd.message import Message
from envs.shaping.sincon import ShapingError


class Clock:
    """A fake clock (seconds)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _shaper(clk: Clock, out: list, **cfg) -> TenantShaper:
    """A shaper whose release records (time, item)."""
    kw = {"enabled": True, "global_throughput_Bps": 1e6, **cfg}
    return TenantShaper(TenantShapingConfig(**kw),
                        lambda items: out.extend((clk.t, x) for x in items), clock=clk)


def _run(sh: TenantShaper, clk: Clock, until: float = math.inf,
         on_step=None) -> None:
    """Step the shaper, moving the fake clock to each next due time, until nothing is queued
    (or ``until``)."""
    while clk.t < until:
        wait = sh.step()
        if on_step is not None:
            on_step()
        if wait == math.inf:
            return
        clk.t += max(wait, 1e-4)


# ----------------------------------------------------------------------------- configuration


def test_config_defaults():
    cfg = TenantShapingConfig()
    assert (cfg.enabled, cfg.policy, cfg.global_throughput_Bps, cfg.classes) == \
        (False, "sincon", None, 16)
    assert cfg.tenant_class == {} and cfg.sincon == {} and cfg.shaper == {}
    assert cfg.class_of(17) == 1 and cfg.class_of(16) == 0
    assert TenantShapingConfig.from_mapping(None) == cfg
    assert TenantShapingConfig.from_mapping(cfg) is cfg
    # YAML/JSON forms: string VPC keys, an integral float G
    got = TenantShapingConfig.from_mapping(
        {"enabled": True, "classes": 2, "tenant_class": {"7": 1, 8: 0},
         "global_throughput_Bps": 1000, "sincon": {"gamma": 0.5}, "shaper": {"burst_s": 0.1}})
    assert got.tenant_class == {7: 1, 8: 0} and got.class_of(7) == 1 and got.class_of(9) == 1
    assert got.global_throughput_Bps == 1000.0 and isinstance(got.global_throughput_Bps, float)
    assert got.sincon == {"gamma": 0.5} and got.shaper == {"burst_s": 0.1}


@pytest.mark.parametrize(("m", "names"), [
    ({"classes": 0}, ["shaping.classes", "0"]),
    ({"classes": 1.5}, ["shaping.classes", "1.5"]),
    ({"classes": True}, ["shaping.classes", "True"]),
    ({"policy": "x"}, ["shaping.policy", "'x'"]),
    ({"policy": "external"}, ["shaping.policy", "'external'"]),
    ({"bogus": 3}, ["shaping.bogus", "unknown key", "3"]),
    ({"classes": 2, "tenant_class": {1: 2}}, ["shaping.tenant_class[1]", "2", "0..1"]),
    ({"tenant_class": {1: -1}}, ["shaping.tenant_class[1]", "-1"]),
    ({"tenant_class": {"x": 0}}, ["shaping.tenant_class", "'x'"]),
    ({"tenant_class": [1, 2]}, ["shaping.tenant_class", "[1, 2]"]),
    ({"global_throughput_Bps": -5}, ["shaping.global_throughput_Bps", "-5"]),
    ({"global_throughput_Bps": float("inf")}, ["shaping.global_throughput_Bps", "inf"]),
    ({"global_throughput_Bps": "1e6"}, ["shaping.global_throughput_Bps", "'1e6'"]),
    ({"enabled": "yes"}, ["shaping.enabled", "'yes'"]),
    ({"sincon": {"alpha": 2.0}}, ["shaping.sincon.alpha", "2.0"]),
    ({"sincon": {"nope": 1}}, ["shaping.sincon.nope", "unknown key"]),
    ({"sincon": {"global_throughput": 5}}, ["shaping.sincon.global_throughput",
                                            "shaping.global_throughput_Bps"]),
    ({"shaper": {"model": "x"}}, ["shaping.shaper.model", "'x'"]),
    ({"shaper": {"burst_s": "a"}}, ["shaping.shaper.burst_s", "'a'"]),
    ({"shaper": 3}, ["shaping.shaper", "3"]),
])
def test_config_refusals_name_the_key_and_value(m, names):
    with pytest.raises(ShapingError) as e:
        TenantShapingConfig.from_mapping(m)
    for n in names:
        assert n in str(e.value), (n, str(e.value))


def test_config_refusals_direct_and_other_sections():
    with pytest.raises(ShapingError, match=r"shaping\.classes"):
        TenantShapingConfig(classes=0)
    with pytest.raises(ShapingError, match=r"controller\.shaping\.classes"):
        TenantShapingConfig.from_mapping({"classes": 0}, section="controller.shaping")
    with pytest.raises(ShapingError, match="must be a mapping"):
        TenantShapingConfig.from_mapping(["enabled"])  # type: ignore[arg-type]


def test_link_throughput_from_the_config_or_the_controller():
    with pytest.raises(ShapingError, match=r"shaping\.global_throughput_Bps is not set"):
        TenantShaper(TenantShapingConfig(enabled=True), lambda items: None)
    sh = TenantShaper(TenantShapingConfig(enabled=True, classes=4, policy="static"),
                      lambda items: None, global_throughput_Bps=4e6)
    assert sh.global_throughput == 4e6 and sh.stats()[0]["limit_Bps"] == 1e6
    sh = TenantShaper(TenantShapingConfig(enabled=True, global_throughput_Bps=1e3),
                      lambda items: None, global_throughput_Bps=4e6)
    assert sh.global_throughput == 1e3  # the configured G wins


# ----------------------------------------------------------------------------- shaping


def test_account_is_the_bookkeeping_of_pace():
    """``account`` (used by the threaded shaper) paces a backlogged channel at its limit, as
    ``pace`` does: a static limit of 1000 B/s, 100-byte messages past the burst allowance."""
    ch = ConnectionShaper(SharedLimits("static", 1, 1000.0), bypass_at=math.inf)
    t, waits = 0.0, []
    for _ in range(20):
        t += ch.due_in(t)
        waits.append(ch.account(t, 100))
    assert ch.processed_messages == 20 and ch.processed_bytes == 2000
    assert waits[:5] == [0.0] * 5                     # 500 B burst allowance (0.5 s)
    assert waits[5:] == pytest.approx([0.1] * 15)     # then 100 B / 1000 B/s
    assert t == pytest.approx(1.4)
    # by default a channel holding the whole link is not paced (as before)
    free = ConnectionShaper(SharedLimits("static", 1, 1000.0))
    assert all(free.account(0.0, 100) == 0.0 for _ in range(50))


def test_backlogged_class_converges_to_its_limit():
    clk, out = Clock(), []
    sh = _shaper(clk, out, policy="static", classes=4)
    for i in range(8000):
        sh.submit(0, 500, i)                            # 4 MB at once into class 0
    _run(sh, clk)
    limit = 1e6 / 4
    t0, t1 = 1.0, 5.0                                   # past the burst allowance
    rate = sum(500 for t, _ in out if t0 <= t < t1) / (t1 - t0)
    assert rate == pytest.approx(limit, rel=0.1)
    assert [x for _, x in out] == list(range(8000))
    st = sh.stats()[0]
    assert st["messages"] == 8000 and st["bytes"] == 4_000_000 and st["max_queue"] >= 7000
    assert clk.t == pytest.approx((4e6 - limit * 0.5) / limit, rel=0.01)


def test_sincon_limits_grow_for_a_burst_and_never_exceed_g():
    clk, out = Clock(), []
    sh = _shaper(clk, out, policy="sincon", classes=4)
    g = sh.global_throughput
    sums = []
    for i in range(3000):
        sh.submit(i % 3, 400, i)                        # three classes backlogged
    _run(sh, clk, on_step=lambda: sums.append(float(sh.limits.policy.limits.sum())))
    calc = sh.limits.calculator
    assert calc.growths > 0
    assert max(sums) <= g * (1 + 1e-9)
    assert len(out) == 3000


def test_small_class_released_inline_while_a_large_class_is_backlogged():
    clk, out = Clock(), []
    sh = _shaper(clk, out, policy="sincon", classes=2, tenant_class={1: 0, 2: 1})
    for i in range(5000):
        sh.submit(1, 1024, ("big", i))                  # 5 MB: several seconds at G = 1 MB/s
    small_at = [0.05 * k for k in range(1, 80)]         # 20/s for 4 s
    for k, t in enumerate(small_at):
        _run(sh, clk, until=t)
        clk.t = t
        n = len(out)
        sh.submit(2, 256, ("small", k))
        assert out[n:] == [(t, ("small", k))]           # inline, at once
        assert sh.backlog().get(0, 0) > 0               # while the big one waits
    st = sh.stats()
    assert st[1]["inline"] == st[1]["messages"] == len(small_at)
    assert st[1]["max_queue"] == 0
    _run(sh, clk)
    assert [x for _, x in out if x[0] == "big"] == [("big", i) for i in range(5000)]


def test_one_class_at_g_queues_the_small_behind_the_large():
    """The 'off' arm of the integration test: one FIFO at the cap G; a small item waits
    behind the burst."""
    clk, out = Clock(), []
    sh = _shaper(clk, out, policy="static", classes=1)
    for i in range(3000):
        sh.submit(1, 1000, ("big", i))                  # 3 MB at 1 MB/s
    _run(sh, clk, until=0.1)
    sh.submit(2, 100, ("small", 0))
    assert sh.backlog() == {0: sum(1 for x in sh.queued())}
    _run(sh, clk)
    t_small = next(t for t, x in out if x == ("small", 0))
    assert t_small == pytest.approx(2.5, rel=0.05)      # 3 MB - 0.5 s allowance at G


def test_policy_none_releases_everything_inline():
    clk, out = Clock(), []
    sh = _shaper(clk, out, policy="none", classes=2)
    for i in range(1000):
        sh.submit(i, 10_000, i)
    assert [x for _, x in out] == list(range(1000))
    assert sh.backlog() == {} and sh.step() == math.inf
    assert sh.stats()[0]["limit_Bps"] == math.inf


def test_fifo_per_class_with_many_tenants():
    clk, out = Clock(), []
    sh = _shaper(clk, out, policy="sincon", classes=3, global_throughput_Bps=2e5)
    rng = random.Random(0)
    sent = []
    for i in range(3000):
        vpc = rng.randrange(10)
        sent.append((vpc, i))
        sh.submit(vpc, rng.randrange(1, 2000), (vpc, i))
        if i % 100 == 0:
            clk.t += 0.01
            sh.step()
    _run(sh, clk)
    assert sorted(x for _, x in out) == sorted(sent)    # nothing lost, nothing twice
    for c in range(3):
        mine = [x for x in sent if x[0] % 3 == c]
        assert [x for _, x in out if x[0] % 3 == c] == mine


def test_backlog_drain_and_queued_without_a_pump():
    clk, out = Clock(), []
    sh = _shaper(clk, out, policy="static", classes=2, global_throughput_Bps=1e3)
    for i in range(20):
        sh.submit(i % 2, 100, i)  # 250 B allowance per class: 3 each at once
    assert sh.backlog() == {0: 7, 1: 7}
    assert sh.queued() == [6, 8, 10, 12, 14, 16, 18, 7, 9, 11, 13, 15, 17, 19]
    assert sh.drain(0.05) is False                      # nobody pumps
    _run(sh, clk)
    assert sh.backlog() == {} and sh.queued() == [] and sh.drain(0.0) is True
    assert sh.stats()[0]["max_wait_s"] > 1.0


def test_pump_thread_releases_and_drains():
    out: list = []
    sh = TenantShaper(TenantShapingConfig(enabled=True, policy="static", classes=2,
                                          global_throughput_Bps=2e6, shaper={"burst_s": 0.01}),
                      out.extend).start()
    try:
        for i in range(2000):
            sh.submit(i % 2, 1000, i)                   # 2 MB: about 1 s at 2 x 1 MB/s
        assert sh.backlog()
        assert sh.drain(10.0)
        assert sh.backlog() == {} and sorted(out) == list(range(2000))
        assert [x for x in out if x % 2] == list(range(1, 2000, 2))
    finally:
        sh.close()


def test_close_does_not_hang_with_items_queued():
    out: list = []
    sh = TenantShaper(TenantShapingConfig(enabled=True, policy="static", classes=1,
                                          global_throughput_Bps=100.0), out.extend).start()
    for i in range(100):
        sh.submit(1, 100, i)                            # 100 s of work
    t0 = time.monotonic()
    sh.close(timeout=2.0)
    assert time.monotonic() - t0 < 1.0
    left = sh.queued()
    assert left and out + left == list(range(100))      # what did not leave is still there
    with pytest.raises(ShapingError, match="after close"):
        sh.submit(1, 1, "late")


def test_a_failed_release_loses_nothing():
    clk, out, failed = Clock(), [], []

    def flaky(items):
        if 10 in items and not failed:  # a pump release (item 10 is queued)
            failed.append(list(items))
            raise RuntimeError("the outbox is busy")
        out.extend(items)

    sh = TenantShaper(TenantShapingConfig(enabled=True, policy="static", classes=1,
                                          global_throughput_Bps=1e3), flaky, clock=clk,
                      retry_s=0.25)
    for i in range(30):
        sh.submit(0, 100, i)
    _run(sh, clk)
    assert out == list(range(30)) and sh.release_errors == 1 and failed


def test_release_taking_the_callers_lock_does_not_deadlock():
    """The controller's pattern: senders hold a re-entrant dispatch lock while they submit,
    and release takes it too (inline: re-entrant; from the pump: it waits)."""
    dispatch = threading.RLock()
    out: list = []

    def release(items):
        with dispatch:
            out.extend(items)

    sh = TenantShaper(TenantShapingConfig(enabled=True, policy="static", classes=4,
                                          global_throughput_Bps=4e6), release).start()
    errors: list = []

    def sender(vpc: int) -> None:
        try:
            for i in range(800):
                with dispatch:
                    sh.submit(vpc, 1000 if vpc == 0 else 50, (vpc, i))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=sender, args=(v,)) for v in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads) and not errors
        assert sh.drain(30.0), sh.backlog()
        st = sh.stats()
        assert st[0]["inline"] < st[0]["messages"] == 800   # the pump released some
    finally:
        sh.close()
    for v in range(4):
        assert [x for x in out if x[0] == v] == [(v, i) for i in range(800)]


def test_stats_report_the_class_limits():
    clk, out = Clock(), []
    sh = _shaper(clk, out, policy="sincon", classes=2)
    st = sh.stats()
    assert set(st) == {0, 1}
    assert st[0]["limit_Bps"] == pytest.approx(1e6 / 2 / 2)   # initial share 1:1, N = 2
    assert np.isclose(sum(s["limit_Bps"] for s in st.values()) + sh.limits.calculator.pool,
                      1e6)


# ----------------------------------------------------------------------------- integration

BIG, SMALL = 1, 2                       # the VPCs: a large tenant bursting, a small one
# the same cap G for both arms: one FIFO at G (off) vs Sincon over two classes (on)
G_BPS = 400_000.0


def arm_configs(g_bps: float = G_BPS, smalls: int = 1) -> dict[str, dict | None]:
    """The three arms at cap ``g_bps`` with ``smalls`` small tenants (VPCs ``SMALL``,
    ``SMALL + 1``, ...): ``off`` one FIFO at G, ``on`` Sincon with a class per tenant,
    ``unshaped`` no shaper at all."""
    classes = {BIG: 0, **{SMALL + j: 1 + j for j in range(smalls)}}
    return {"off": {"enabled": True, "policy": "static", "classes": 1,
                    "global_throughput_Bps": g_bps},
            "on": {"enabled": True, "policy": "sincon", "classes": 1 + smalls,
                   "tenant_class": classes, "global_throughput_Bps": g_bps},
            "unshaped": None}


ARMS: dict[str, dict | None] = arm_configs()


def _send_many(r: Any, type_id: int, vpc: int, config: str, resource_ids: range,
               hosts: tuple[int, ...], size: int) -> None:
    """One ``send_many`` (one outbox transaction) of a message per resource, in the ledger
    first (as ``Ledger.send`` does for one)."""
    from .delivery_rig import OP

    msgs = []
    with r.ledger.lock:
        for rid in resource_ids:
            mid = next(r.ledger.ids)
            m = Message(mid, mid, vpc, config, OP, rid, size, hosts, r.ctl.timestamp())
            for n in hosts:
                r.ledger.sent[n][(vpc, config, rid)].append((m.timestamp_ns, mid))
            msgs.append((m, type_id))
    r.ctl.send_many(msgs)


def burst_scenario(broker: Any, tmp: Path, shaping: dict | None, *, burst: int = 3000,
                   size: int = 128, small_rate: float = 20.0, small_s: float = 5.0,
                   nodes: int = 4, smalls: int = 1) -> dict[str, Any]:
    """VPC ``BIG`` sends ``burst`` RPC messages to ``nodes`` nodes in one go while each of
    ``smalls`` small tenants (VPCs ``SMALL``, ``SMALL + 1``, ...) sends ``small_rate``
    messages/s for ``small_s`` s to the same nodes; every message must be delivered
    (:func:`assert_delivered`). Returns the delays (applied_ns - timestamp_ns, ms, every
    node's record) of each tenant and the run's wall time."""
    from .delivery_rig import rig

    tmp.mkdir(parents=True, exist_ok=True)
    hosts = tuple(range(nodes))
    ctl_kw = {} if shaping is None else {"shaping": shaping}
    with rig(broker, tmp, hosts, ctl_kw=ctl_kw) as r:
        t0 = time.monotonic()
        # the burst: PORT updates of the big tenant, from another thread (so the small
        # tenant's first messages are not behind the call that hands the burst over)
        big = threading.Thread(target=_send_many, args=(r, 0, BIG, "PORT",
                                                        range(burst), hosts, size))
        big.start()
        k = 0
        while (t := t0 + k / small_rate) < t0 + small_s:
            time.sleep(max(0.0, t - time.monotonic()))
            for j in range(smalls):
                r.send(0, resource_id=k, hosts=hosts, vpc=SMALL + j, config="SUBNET",
                       size=size)
            r.ctl.flush()
            k += 1
        big.join(60)
        assert not big.is_alive(), "the burst's send_many did not return"
        rows = r.delivered(timeout=120.0)
        wall = time.monotonic() - t0
    delays: dict[int, list[float]] = {BIG: [], **{SMALL + j: [] for j in range(smalls)}}
    for rs in rows.values():
        for row in rs:
            delays[row.vpc_id].append((row.applied_ns - row.timestamp_ns) / 1e6)
    return {"delays_ms": delays, "wall_s": wall, "small_sent": k, "burst": burst}


def percentiles(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs, dtype=np.float64)
    return {f"p{q}": float(np.percentile(a, q)) for q in (50, 95, 99)} | {
        "max": float(a.max()), "n": int(a.size)}


@pytest.mark.slow
@pytest.mark.xdist_group("pulsar")
def test_small_tenant_p95_delay_with_and_without_shaping(pulsar_broker, tmp_path):
    """The large tenant bursts ~3000 RPC messages to 4 nodes while the small tenant sends
    20/s to the same nodes, at the same cap G: one FIFO (off) vs Sincon's per-class limits
    (on). Nothing is lost (every node's record ends with the newest of every resource, in
    order, nothing applied twice) and the small tenant's p95 delay is lower with shaping."""
    got = {}
    for arm in ("off", "on"):
        res = burst_scenario(pulsar_broker, tmp_path / arm, ARMS[arm])
        got[arm] = {vpc: percentiles(d) for vpc, d in res["delays_ms"].items()}
        assert got[arm][SMALL]["n"] == 4 * res["small_sent"]
        assert got[arm][BIG]["n"] == 4 * res["burst"]
        print(f"shaping {arm}: small tenant p50/p95/p99 "
              f"{got[arm][SMALL]['p50']:.0f}/{got[arm][SMALL]['p95']:.0f}/"
              f"{got[arm][SMALL]['p99']:.0f} ms, large tenant p50/p95 "
              f"{got[arm][BIG]['p50']:.0f}/{got[arm][BIG]['p95']:.0f} ms, "
              f"wall {res['wall_s']:.1f} s")
    assert got["on"][SMALL]["p95"] < got["off"][SMALL]["p95"], got
