"""Channel failover's building blocks (``delivery/health.py``): the ``failover`` configuration
section, the per-type rate window, the failover plan under Eq. 1's controller constraints
(checked against a plain re-computation and ``envs.dsmd.cost.evaluate``), and the MQ health
probe against real Pulsar brokers (the shared one, an unreachable address, and one of its own
killed with SIGKILL and restarted)."""

from __future__ import annotations

import math
import os
import threading
import time

import numpy as np
import pytest

from delivery.health import (
    ConfigError,
    FailoverConfig,
    FailoverPlan,
    MqHealth,
    RateWindow,
    RpcBacklog,
    plan_failover,
)
from envs.dsmd.cost import evaluate
from envs.dsmd.instance import RPC, UNASSIGNED, DSMDInstance
from envs.netutil import free_ports

# --------------------------------------------------------------------------- configuration


def test_config_defaults():
    c = FailoverConfig()
    assert c == FailoverConfig.from_mapping(None) == FailoverConfig.from_mapping({})
    assert (c.enabled, c.probe_period_s, c.probe_timeout_s, c.fail_after, c.recover_after) == (
        True, 0.2, 1.0, 3, 3)
    assert c.publish_timeout_s == 3.0
    assert (c.replan_period_s, c.rate_window_s, c.controller_bw_bps, c.controller_cpu) == (
        1.0, 5.0, None, None)
    assert (c.relay, c.relay_after_s, c.confirm_timeout_s) == (True, 1.0, 3.0)
    assert c.detection_bound_s == pytest.approx(3 * 0.2 + 1.0)
    assert FailoverConfig.from_mapping(c) is c


def test_config_from_mapping_converts_numbers():
    c = FailoverConfig.from_mapping({"probe_period_s": 1, "controller_bw_bps": 10**6,
                                     "controller_cpu": 250.5, "fail_after": np.int64(4),
                                     "relay_after_s": 0, "enabled": False,
                                     "publish_timeout_s": np.float32(2.5)})
    assert isinstance(c.probe_period_s, float) and c.probe_period_s == 1.0
    assert type(c.publish_timeout_s) is float and c.publish_timeout_s == 2.5
    assert c.controller_bw_bps == 1e6 and c.controller_cpu == 250.5
    assert c.fail_after == 4 and type(c.fail_after) is int
    assert c.relay_after_s == 0.0 and c.enabled is False
    assert c.detection_bound_s == pytest.approx(4 * 1.0 + 1.0)  # the publish timeout: no part
    assert c.as_dict()["controller_cpu"] == 250.5


BAD = [
    ("enabled", 1, "true or false"),
    ("enabled", "yes", "true or false"),
    ("relay", None, "true or false"),
    ("probe_period_s", 0, "> 0"),
    ("probe_period_s", -0.1, "> 0"),
    ("probe_period_s", "0.2", "expected a number"),
    ("probe_period_s", True, "expected a number"),
    ("probe_period_s", None, "expected a number"),
    ("probe_period_s", float("nan"), "finite"),
    ("probe_timeout_s", 0.0, "> 0"),
    ("probe_timeout_s", float("inf"), "finite"),
    ("publish_timeout_s", 0, "> 0"),
    ("publish_timeout_s", -3.0, "> 0"),
    ("publish_timeout_s", "3", "expected a number"),
    ("publish_timeout_s", None, "expected a number"),
    ("publish_timeout_s", float("nan"), "finite"),
    ("fail_after", 0, ">= 1"),
    ("fail_after", 1.5, "integer"),
    ("fail_after", True, "integer"),
    ("recover_after", -2, ">= 1"),
    ("recover_after", "3", "integer"),
    ("replan_period_s", 0, "> 0"),
    ("rate_window_s", -5, "> 0"),
    ("controller_bw_bps", 0, "> 0"),
    ("controller_bw_bps", "1e6", "expected a number or null"),
    ("controller_bw_bps", False, "expected a number"),
    ("controller_cpu", -1, "> 0"),
    ("controller_cpu", [10], "expected a number"),
    ("relay_after_s", -0.5, ">= 0"),
    ("confirm_timeout_s", 0, "> 0"),
]


@pytest.mark.parametrize(("key", "value", "what"), BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_config_refuses_bad_values(key, value, what):
    with pytest.raises(ConfigError) as e:
        FailoverConfig.from_mapping({key: value})
    msg = str(e.value)
    assert msg.startswith(f"delivery config: failover.{key}: "), msg
    assert what in msg and repr(value) in msg, msg
    with pytest.raises(ConfigError, match=f"failover.{key}"):  # direct construction too
        FailoverConfig(**{key: value})
    with pytest.raises(ConfigError, match=f"delivery config: delivery.failover.{key}: "):
        FailoverConfig.from_mapping({key: value}, section="delivery.failover")


def test_config_refuses_unknown_key_and_non_mapping():
    with pytest.raises(ConfigError, match=r"failover\.probe_perod_s: unknown key") as e:
        FailoverConfig.from_mapping({"probe_perod_s": 0.1, "probe_timeout_s": 1})
    assert "probe_period_s" in str(e.value)  # the known keys are listed
    with pytest.raises(ConfigError, match="failover: expected a mapping, got list"):
        FailoverConfig.from_mapping([("enabled", True)])  # type: ignore[arg-type]
    assert issubclass(ConfigError, ValueError)


# --------------------------------------------------------------------------- rate window


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_rate_window_rates_and_expiry():
    clk = FakeClock()
    w = RateWindow(5.0, clock=clk)
    assert w.rates() == {}
    for _ in range(10):
        w.add(1, 100, 4)          # 10 messages, 1000 bytes at t=100
    clk.t = 102.0
    w.add(2, 50, 1)
    w.add(1, 500, 3)
    r = w.rates()
    assert r[1] == pytest.approx((8 * 1500 / 5, 11 / 5))
    assert r[2] == pytest.approx((8 * 50 / 5, 1 / 5))
    assert w.fanouts() == {1: 3, 2: 1}
    clk.t = 104.9
    assert w.rates()[1] == pytest.approx((8 * 1500 / 5, 11 / 5))
    clk.t = 105.0                 # the t=100 messages leave the window
    r = w.rates()
    assert sorted(r) == [1, 2]
    assert r[1] == pytest.approx((8 * 500 / 5, 1 / 5))
    assert r[2] == pytest.approx((8 * 50 / 5, 1 / 5))
    clk.t = 107.5
    assert w.rates() == {}
    assert w.fanouts() == {}
    with pytest.raises(ValueError, match="window_s"):
        RateWindow(0)


def test_rate_window_is_thread_safe():
    w = RateWindow(3600.0)

    def adder(t: int) -> None:
        for _ in range(2000):
            w.add(t % 3, 10, 2)

    threads = [threading.Thread(target=adder, args=(i,)) for i in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    r = w.rates()
    assert sorted(r) == [0, 1, 2]
    for t in r:
        assert r[t][1] * 3600 == pytest.approx(4000)
        assert r[t][0] * 3600 == pytest.approx(4000 * 80)


# --------------------------------------------------------------------------- the plan

HOSTS = {0: (0, 1, 2, 3), 1: (0, 1), 2: (2,), 3: (0, 1, 2, 3), 4: (3,)}


def test_plan_within_c_b():
    rates = {0: (1000.0, 1.0), 1: (500.0, 1.0), 2: (800.0, 2.0), 3: (100.0, 1.0)}
    # RPC type 0 costs 4000 bit/s; then 1 (1000), 2 (800) fit in 6000, 3 (400) does not
    p = plan_failover([1, 2, 3], [0], HOSTS, rates, 6000, None)
    assert p.moved == (1, 2) and p.waiting == (3,)
    assert p.controller_bw_bps == 4000 + 1000 + 800
    assert p.controller_cpu == 4 + 2 + 1          # |D(m)| of each RPC type, 3 waits: none
    assert p.reasons == {1: "fits", 2: "fits", 3: "over C_b (6200 > 6000 bit/s)"}


def test_plan_within_c_p():
    # Eq. 1's C_p counts concurrent sends: |D(m)| per RPC type, whatever its message rate
    # (type 2 sends 1000 messages/s to one node: one send). C_p = 7.9 admits 7 sends.
    rates = {0: (10.0, 0.1), 1: (10.0, 0.1), 2: (10.0, 1000.0), 3: (10.0, 0.1)}
    oldest = {3: 1, 1: 2, 2: 3, 4: 4}
    # RPC 0: 4 sends; 3: +4 = 8 > 7 waits; 1: +2 = 6; 2: +1 = 7; 4 (no traffic): +1 = 8
    p = plan_failover([1, 2, 3, 4], [0], HOSTS, rates, None, 7.9, oldest_ns=oldest)
    assert p.moved == (1, 2) and p.waiting == (3, 4)
    assert p.controller_cpu == 7
    assert p.controller_bw_bps == 10 * (4 + 2 + 1)
    assert p.reasons == {3: "over C_p (8 > 7.9 concurrent sends)", 1: "fits", 2: "fits",
                         4: "over C_p (8 > 7.9 concurrent sends)"}
    # the message rates only matter for being valid: any other ones give the same plan
    calm = {t: (b, 0.0) for t, (b, _) in rates.items()}
    busy = {t: (b, 1e9) for t, (b, _) in rates.items()}
    for r in (calm, busy):
        assert plan_failover([1, 2, 3, 4], [0], HOSTS, r, None, 7.9, oldest_ns=oldest) == p
    # one more send of room and type 3 (the oldest) moves first, leaving room for 1 and 2
    p = plan_failover([1, 2, 3, 4], [0], HOSTS, rates, None, 11, oldest_ns=oldest)
    assert p.moved == (3, 1, 2) and p.waiting == (4,) and p.controller_cpu == 11


def test_plan_capacities_below_one_admit_one():
    # C_b and C_p are floored to whole bit/s and sends, at least 1 (an Eq. 1 instance needs
    # positive capacities): a bound below 1 admits a type of one destination and 1 bit/s
    p = plan_failover([2, 4], [], HOSTS, {2: (1.0, 5.0), 4: (1.0, 5.0)}, 0.5, 0.5)
    assert p.moved == (2,) and p.waiting == (4,)
    assert p.reasons[4] == "over C_b (2 > 0.5 bit/s)"
    p = plan_failover([2, 4], [], HOSTS, {}, 0.5, 0.5)
    assert p.moved == (2,) and p.reasons[4] == "over C_p (2 > 0.5 concurrent sends)"


def test_plan_oldest_first_unknown_newest_ties_by_id():
    rates = dict.fromkeys(HOSTS, (100.0, 1.0))   # each of 1, 2, 4: <= 200 bit/s
    hosts = {1: (0,), 2: (1,), 4: (2,), 3: (3,)}
    # room for two of four equal types
    p = plan_failover([4, 3, 2, 1], [], hosts, rates, 250, None,
                      oldest_ns={2: 50, 4: 10})
    assert p.moved == (4, 2) and p.waiting == (1, 3)   # 1 and 3: unknown, by id
    p = plan_failover([4, 3, 2, 1], [], hosts, rates, 250, None, oldest_ns={2: 10, 4: 10})
    assert p.moved == (2, 4)                             # same age: by id
    p = plan_failover([4, 3, 2, 1], [], hosts, rates, 250, None)
    assert p.moved == (1, 2) and p.waiting == (3, 4)
    # the same order under C_p: room for two sends
    p = plan_failover([4, 3, 2, 1], [], hosts, rates, None, 2, oldest_ns={2: 50, 4: 10})
    assert p.moved == (4, 2) and p.waiting == (1, 3) and p.controller_cpu == 2


def test_plan_big_type_waits_while_a_later_small_one_fits():
    rates = {0: (1000.0, 1.0), 1: (2000.0, 1.0), 2: (50.0, 1.0)}
    p = plan_failover([1, 2], [], HOSTS, rates, 1000, None, oldest_ns={1: 1, 2: 2})
    assert p.moved == (2,) and p.waiting == (1,)
    assert p.reasons[1] == "over C_b (4000 > 1000 bit/s)"
    assert p.controller_bw_bps == 50 and p.controller_cpu == 1


def test_plan_rpc_types_consume_first_and_idle_types_fit():
    rates = {0: (10_000.0, 5.0), 1: (10.0, 1.0)}
    # the RPC type alone is over C_b: it stays, nothing with traffic moves; the types without
    # traffic still need their sends: 4 + 1 + 4 = 9 <= 10
    p = plan_failover([1, 2, 3], [0], HOSTS, rates, 1000, 10)
    assert p.moved == (2, 3) and p.waiting == (1,)      # 2, 3: no traffic in the window
    assert p.reasons == {1: "over C_b (40020 > 1000 bit/s)", 2: "fits", 3: "fits"}
    assert p.controller_bw_bps == 40_000 and p.controller_cpu == 9
    # the RPC type alone over C_p too: a type without traffic waits as well (over C_p; one
    # with traffic is over both, C_b is named)
    p = plan_failover([1, 2, 3], [0], HOSTS, rates, 1000, 3)
    assert p.moved == () and p.waiting == (1, 2, 3)
    assert p.reasons == {1: "over C_b (40020 > 1000 bit/s)",
                         2: "over C_p (5 > 3 concurrent sends)",
                         3: "over C_p (8 > 3 concurrent sends)"}
    assert p.controller_bw_bps == 40_000 and p.controller_cpu == 4


def test_plan_none_is_unbounded_and_warns_once(caplog):
    from delivery import health

    health._warned.clear()
    rates = dict.fromkeys(HOSTS, (1e12, 1e6))
    with caplog.at_level("WARNING", logger="delivery.health"):
        p = plan_failover([1, 2, 3, 4], [0], HOSTS, rates, None, None)
        plan_failover([1], [0], HOSTS, rates, None, None)
    assert p.moved == (1, 2, 3, 4) and p.waiting == ()
    assert p.controller_bw_bps == 1e12 * (4 + 2 + 1 + 4 + 1)
    assert p.controller_cpu == 4 + 2 + 1 + 4 + 1
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and any("C_b" in w for w in warnings)
    assert any("C_p" in w for w in warnings)


def test_warm_up_plans_a_tiny_outage():
    from delivery.health import warm_up

    warm_up()
    t = time.perf_counter()
    plan_failover([1, 2], [0], HOSTS, {0: (8.0, 1.0)}, 1e6, 1e3)
    assert time.perf_counter() - t < 0.5  # the compiled loops are loaded


def test_plan_edge_inputs():
    rates = {1: (100.0, 1.0)}
    # a type in both lists is on RPC; a type without known destinations moves at no cost
    p = plan_failover([1, 9, 1], [1, 0], HOSTS, rates, 150, 6)
    assert p.moved == (9,) and p.waiting == () and p.reasons == {9: "fits"}
    assert p.controller_bw_bps == 200
    assert p.controller_cpu == 2 + 4          # RPC types 1 and 0 (0: no traffic, 4 sends)
    p = plan_failover([9, 5], [], {9: (), 5: (1,)}, {}, 1, 1)  # 9: empty, 5: unknown rate
    assert p.moved == (5, 9) and p.controller_cpu == 1 and p.controller_bw_bps == 0
    assert plan_failover([], [], {}, {}, 1, 1) == FailoverPlan((), (), 0.0, 0.0, {})
    with pytest.raises(ValueError, match="type 1: rates must be finite"):
        plan_failover([1], [], HOSTS, {1: (-1.0, 1.0)}, None, None)
    with pytest.raises(ValueError, match="type 1"):
        plan_failover([1], [], HOSTS, {1: (math.nan, 1.0)}, None, None)
    # the message rate is validated although the plan does not use it
    with pytest.raises(ValueError, match=r"type 2: rates must be finite and >= 0, got "
                                         r"\(8.0, -1.0\)"):
        plan_failover([1], [2], HOSTS, {2: (8.0, -1.0)}, None, None)
    with pytest.raises(ValueError, match="type 3: rates must be finite"):
        plan_failover([3], [], HOSTS, {3: (8.0, math.inf)}, None, None)


def _floor(x):
    """A capacity as the plan applies it: whole units, at least 1 (None: unbounded)."""
    return None if x is None else max(1, math.floor(x))


def _brute_force(mq, rpc, hosts, rates, cb, cp, oldest):
    """The plan recomputed in plain arithmetic (Eq. 1's controller constraints): the RPC
    types first, then oldest first; an RPC type costs round(bit/s) |D(m)| bit/s and |D(m)|
    concurrent sends, a type without destinations nothing; a type without traffic is not
    refused by C_b."""
    fb, fp = _floor(cb), _floor(cp)
    rpc = list(dict.fromkeys(rpc))
    mq = [t for t in dict.fromkeys(mq) if t not in rpc]
    bw = sum(round(rates.get(t, (0, 0))[0]) * len(hosts.get(t, ())) for t in rpc)
    sends = sum(len(hosts.get(t, ())) for t in rpc)
    moved, waiting, reasons = [], [], {}
    for t in sorted(mq, key=lambda t: (t not in oldest, oldest.get(t, 0), t)):
        d = len(hosts.get(t, ()))
        db = round(rates.get(t, (0, 0))[0]) * d
        over_b = db > 0 and fb is not None and bw + db > fb
        over_p = fp is not None and d > 0 and sends + d > fp
        if over_b:
            reasons[t] = f"over C_b ({bw + db} > {cb:.15g} bit/s)"
        elif over_p:
            reasons[t] = f"over C_p ({sends + d} > {cp:.15g} concurrent sends)"
        else:
            reasons[t] = "fits"
            moved.append(t)
            bw, sends = bw + db, sends + d
            continue
        waiting.append(t)
    return moved, waiting, bw, sends, reasons


def _random_case(seed):
    """Random hosts and rates (some types without traffic: not in ``rates`` or 0 bit/s;
    fractional bit rates), a random RPC/MQ split, ages, and capacities (fractional, some
    below 1, some None)."""
    rng = np.random.default_rng(seed)
    n, m = int(rng.integers(1, 9)), int(rng.integers(1, 14))
    hosts = {t: tuple(int(x) for x in rng.choice(n, int(rng.integers(1, n + 1)), replace=False))
             for t in range(m)}
    rates = {t: (0.0 if rng.random() < 0.15 else float(rng.integers(1, 5000)) + rng.random(),
                 float(rng.integers(0, 400)) / 8)
             for t in range(m) if rng.random() < 0.9}
    types = rng.permutation(m).tolist()
    cut = int(rng.integers(0, m + 1))
    rpc, mq = types[:cut], types[cut:]
    oldest = {t: int(rng.integers(0, 5)) for t in mq if rng.random() < 0.7}
    total_bw = sum(round(rates.get(t, (0, 0))[0]) * len(hosts[t]) for t in range(m))
    total_sends = sum(len(hosts[t]) for t in range(m))
    cb = None if rng.random() < 0.2 else float(rng.integers(1, 4 * total_bw + 8)) / 4
    cp = None if rng.random() < 0.2 else float(rng.integers(1, 4 * total_sends + 8)) / 4
    return n, m, hosts, rates, rpc, mq, oldest, cb, cp


SEEDS = range(60)


@pytest.mark.parametrize("seed", SEEDS)
def test_plan_equals_brute_force_and_cost_model(seed):
    n, m, hosts, rates, rpc, mq, oldest, cb, cp = _random_case(seed)
    p = plan_failover(mq, rpc, hosts, rates, cb, cp, oldest_ns=oldest)
    moved, waiting, bw, sends, reasons = _brute_force(mq, rpc, hosts, rates, cb, cp, oldest)
    assert (list(p.moved), list(p.waiting)) == (moved, waiting)
    assert p.controller_bw_bps == bw
    assert p.controller_cpu == sends
    assert p.reasons == reasons
    # the message rates play no part
    other = {t: (b, k * 7 + 1) for t, (b, k) in rates.items()}
    assert plan_failover(mq, rpc, hosts, other, cb, cp, oldest_ns=oldest) == p
    # the planned load is Eq. 1's: the cost model's full recomputation agrees (the waiting
    # types unassigned: they send nothing meanwhile)
    inst = DSMDInstance.from_sets([hosts[t] for t in range(m)],
                                  [round(rates.get(t, (0, 0))[0]) for t in range(m)],
                                  10**15, 1, 10**15, 10**9, num_nodes=n)
    channel = np.full(m, UNASSIGNED)
    channel[[*rpc, *p.moved]] = RPC
    snap = evaluate(inst, channel)
    assert snap.controller_bw == p.controller_bw_bps
    assert snap.controller_cpu == p.controller_cpu
    # within the capacities, unless the RPC types alone are over them
    fb, fp = _floor(cb), _floor(cp)
    if p.moved:
        base = evaluate(inst, np.where(np.isin(np.arange(m), rpc), RPC, UNASSIGNED))
        assert fp is None or p.controller_cpu <= max(fp, base.controller_cpu)
        assert fb is None or p.controller_bw_bps <= max(fb, base.controller_bw)
    # maximal: no waiting type would fit on top of the plan
    for t in p.waiting:
        db = round(rates.get(t, (0, 0))[0]) * len(hosts[t])
        over_b = db > 0 and fb is not None and p.controller_bw_bps + db > fb
        over_p = fp is not None and p.controller_cpu + len(hosts[t]) > fp
        assert over_b or over_p, t


def test_random_plans_cover_every_outcome():
    """The random cases above reach each outcome: a type moved, one refused by C_b, one by
    C_p, one without traffic refused by C_p, one without traffic moved, and a plan where
    C_p binds while C_b does not."""
    seen = set()
    for seed in SEEDS:
        _, _, hosts, rates, rpc, mq, oldest, cb, cp = _random_case(seed)
        reasons = _brute_force(mq, rpc, hosts, rates, cb, cp, oldest)[4]
        for t, why in reasons.items():
            idle = round(rates.get(t, (0, 0))[0]) == 0
            seen.add((why.split(" (")[0], idle))
        if any(w.startswith("over C_p") for w in reasons.values()) and not any(
                w.startswith("over C_b") for w in reasons.values()):
            seen.add("C_p alone binds")
    assert seen >= {("fits", False), ("fits", True), ("over C_b", False),
                    ("over C_p", False), ("over C_p", True), "C_p alone binds"}, seen


# --------------------------------------------------------------------------- MQ health

FAST = FailoverConfig(probe_period_s=0.1, probe_timeout_s=0.5, publish_timeout_s=1.0,
                      fail_after=2, recover_after=2)


class Recorder:
    def __init__(self) -> None:
        self.changes: list[tuple[float, str, str]] = []

    def __call__(self, state: str, reason: str) -> None:
        self.changes.append((time.monotonic(), state, reason))


def _wait(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - t0


def _client(url: str, operation_timeout: int = 15):
    """A Pulsar client as the controller's (its identity: the health probe's producer)."""
    pulsar = pytest.importorskip("pulsar")
    from security.pulsar import client_args
    from security.tls import Security

    return pulsar.Client(url, operation_timeout_seconds=operation_timeout,
                         logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error),
                         **client_args(Security(), "controller"))


def test_health_broker_unreachable_from_the_start():
    """No broker at the address: the probe producer cannot be created (that fails after the
    client's operation timeout, on a helper thread), and from then on the probes fail: the
    channel is down within that timeout plus the detection bound; close never hangs."""
    client = _client(f"pulsar://127.0.0.1:{free_ports(1)[0]}", operation_timeout=2)
    rec = Recorder()
    h = MqHealth(client, "persistent://public/default/nobody-health", FAST, rec)
    try:
        t0 = time.monotonic()
        h.start()
        took = _wait(lambda: h.state == MqHealth.DOWN, 15, "DOWN")
        assert took <= 2 + FAST.detection_bound_s + 1.0
        assert rec.changes and rec.changes[0][1] == "down"
        assert "no probe producer" in rec.changes[0][2]
        assert h.events[0][1:] == ("down", rec.changes[0][2])
        assert h.last_change >= t0
    finally:
        t = time.monotonic()
        h.close()
        assert time.monotonic() - t < 2.5
        client.close()


def test_health_reason_names_every_cause():
    """A probe that fails and a stuck data publish at once: the verdict names both, so an
    operator sees the stuck publish even while the broker also answers probes badly."""
    pulsar = pytest.importorskip("pulsar")
    from delivery.health import _Probe

    now = [10.0]
    rec = Recorder()
    h = MqHealth(object(), "persistent://public/default/unused", FAST, rec,
                 inflight_age=lambda: 5.0, clock=lambda: now[0])
    for _ in range(FAST.fail_after):
        h._judge(_Probe(deadline=11.0, sent=True, result=pulsar.Result.Timeout,
                        answered=10.2))
    assert h.state == MqHealth.DOWN and h.failures == FAST.fail_after
    reason = rec.changes[-1][2]
    assert f"probe publish failed: {pulsar.Result.Timeout}" in reason
    assert "oldest unacknowledged data publish is 5.0 s old" in reason
    ok = MqHealth(object(), "t", FAST, Recorder(), inflight_age=lambda: 0.0,
                  clock=lambda: now[0])
    ok._judge(_Probe(deadline=11.0, sent=True, result=pulsar.Result.Ok, answered=10.2))
    assert ok.failures == 0 and ok.probes == 1


def test_health_tells_a_full_link_from_a_dead_broker():
    """Probes that time out while the broker keeps acknowledging data publishes (a full
    controller link: the probe waits behind the data) are excused, not failures: the channel
    stays up however long it lasts. Once the acknowledgements stop (the broker died), the
    probes sent after the last one fail and the channel goes down within the detection
    bound; a probe the broker answers with an error is a failure whatever the data does."""
    pulsar = pytest.importorskip("pulsar")
    from delivery.health import _Probe

    now, last_ack, age, excused = [10.0], [None], [0.0], []
    rec = Recorder()
    h = MqHealth(object(), "persistent://public/default/unused", FAST, rec,
                 inflight_age=lambda: age[0], clock=lambda: now[0],
                 last_ack=lambda: last_ack[0], on_congested=lambda: excused.append(now[0]))
    period, timeout = FAST.probe_period_s, FAST.probe_timeout_s
    sent = 10.0
    for _ in range(5 * FAST.fail_after):  # late probes, data acknowledged meanwhile
        sent += period
        last_ack[0], age[0] = sent + timeout / 2, FAST.publish_timeout_s + 1
        now[0] = sent + timeout
        h._judge(_Probe(deadline=sent + timeout, sent=True))
    # the probe producer's own send timeout is lateness too
    sent += period
    now[0] = sent + timeout
    h._judge(_Probe(deadline=sent + timeout, sent=True, result=pulsar.Result.Timeout,
                    answered=sent + timeout - 0.01))
    assert h.state == MqHealth.UP and h.failures == 0 and rec.changes == []
    assert h.congested == len(excused) == 5 * FAST.fail_after + 1
    # the broker dies: the last acknowledgement stays at `dead`; probes that left before it
    # are still excused, those sent after it fail: down within the detection bound
    dead = last_ack[0]
    while h.state == MqHealth.UP:
        sent += period
        now[0] = sent + timeout
        h._judge(_Probe(deadline=sent + timeout, sent=True))
        assert sent < dead + 10 * period
    assert now[0] - dead <= FAST.detection_bound_s + 1e-9, now[0] - dead
    assert "probe publish not acknowledged" in rec.changes[-1][2]
    # a probe the broker refuses is a failure even with data acknowledged
    busy = MqHealth(object(), "t", FAST, Recorder(), clock=lambda: now[0],
                    last_ack=lambda: now[0])
    busy._judge(_Probe(deadline=now[0], sent=True, result=pulsar.Result.ProducerBusy,
                       answered=now[0] - 0.1))
    assert busy.failures == 1 and busy.congested == 0
    # without last_ack (an older caller) a late probe is a failure, as before
    old = MqHealth(object(), "t", FAST, Recorder(), clock=lambda: now[0])
    old._judge(_Probe(deadline=now[0], sent=True))
    assert old.failures == 1 and old.congested == 0


def test_rpc_backlog_tells_when_the_pushes_ahead_of_a_mark_ended():
    """Pushes end in any order; a mark is drained once every push started up to it ended,
    at the time the last of them did."""
    now = [0.0]
    b = RpcBacklog(clock=lambda: now[0])
    assert b.mark() == 0 and b.drained_at(0) == -math.inf
    s1, s2, s3 = b.start(), b.start(), b.start()
    mark = b.mark()
    s4 = b.start()
    assert (mark, len(b)) == (3, 4) and b.drained_at(mark) is None
    now[0] = 1.0
    b.end(s2)                      # a younger push first: nothing drained yet
    assert b.drained_at(1) is None and b.drained_at(mark) is None
    now[0] = 2.0
    b.end(s1)                      # the oldest: 1 and 2 drained now
    assert b.drained_at(1) == b.drained_at(2) == 2.0 and b.drained_at(mark) is None
    now[0] = 3.0
    b.end(s3)
    b.end(s3)                      # twice: ignored
    assert b.drained_at(mark) == 3.0 and b.drained_at(s4) is None
    now[0] = 4.0
    b.end(s4)
    assert b.drained_at(s4) == 4.0 and len(b) == 0


def test_health_waits_for_the_rpc_pushes_ahead_of_a_probe():
    """A link full of RPC pushes and no data publish to tell by (every type on RPC): a
    probe that left behind pushes in flight is judged ``probe_timeout_s`` after the last of
    them ended, not at its own deadline, so a probe the broker answers once the bytes ahead
    of it are through is a success (no false failover). A dead broker is still declared
    down, within the detection bound plus the time the pushes ahead took (at most one
    ``push_timeout_s``); without pushes in flight a probe is judged at its own deadline."""
    pulsar = pytest.importorskip("pulsar")
    from delivery.health import _Probe

    now = [10.0]
    rpc = RpcBacklog(clock=lambda: now[0])
    rec, waited = Recorder(), []
    h = MqHealth(object(), "t", FAST, rec, clock=lambda: now[0], rpc=rpc,
                 on_waited=lambda: waited.append(now[0]))
    timeout, push_timeout = FAST.probe_timeout_s, 2.0
    for _ in range(5 * FAST.fail_after):
        sent = now[0]
        push = rpc.start()
        probe = _Probe(sent + timeout, sent=True, mark=rpc.mark())
        now[0] = sent + timeout                 # its own deadline: the push still in flight
        assert not h._due(probe, now[0]) and probe.waited
        now[0] = sent + 1.5 * timeout
        rpc.end(push)                           # the link drained the push ahead of it
        assert not h._due(probe, now[0])
        assert probe.deadline == pytest.approx(now[0] + timeout)
        probe.result, probe.answered = pulsar.Result.Ok, now[0] + timeout / 2
        now[0] = probe.answered
        assert h._due(probe, now[0])
        h._judge(probe)
    assert h.state == MqHealth.UP and h.failures == 0 and h.probes == 5 * FAST.fail_after
    assert h.waited == len(waited) == 5 * FAST.fail_after
    # the broker dies while pushes fill the link: down, late by at most one push timeout
    dead, pushes, pending = now[0], [], []
    while h.state == MqHealth.UP:
        pushes.append((now[0], rpc.start()))
        pending.append(_Probe(now[0] + timeout, sent=True, mark=rpc.mark()))
        now[0] += FAST.probe_period_s
        while pushes and pushes[0][0] + push_timeout <= now[0]:
            rpc.end(pushes.pop(0)[1])           # each push fails at its timeout
        while pending and h._due(pending[0], now[0]):
            h._judge(pending.pop(0))
        assert now[0] - dead < 60
    assert now[0] - dead <= FAST.detection_bound_s + push_timeout + FAST.probe_period_s + 1e-9
    assert "probe publish not acknowledged" in rec.changes[-1][2]
    # no push in flight: judged at its own deadline
    idle = MqHealth(object(), "t", FAST, Recorder(), clock=lambda: now[0],
                    rpc=RpcBacklog(clock=lambda: now[0]))
    probe = _Probe(now[0], sent=True, mark=0)
    assert idle._due(probe, now[0]) and not probe.waited


def test_probes_queued_behind_pushes_and_answered_together_are_in_time():
    """A 3-s push fills the link (every type on RPC, no publish to tell by); the probes sent
    meanwhile queue behind it and the broker answers them all at once when it drains. Each
    is judged against its deadline moved past the drain, not against its own: none fails,
    the channel stays up."""
    pulsar = pytest.importorskip("pulsar")
    from collections import deque

    from delivery.health import _Probe

    now = [0.0]
    rpc = RpcBacklog(clock=lambda: now[0])
    rec = Recorder()
    h = MqHealth(object(), "t", FAST, rec, clock=lambda: now[0], rpc=rpc)
    push = rpc.start()
    pending: deque = deque()
    for k in range(120):                        # 6 s in 50-ms steps
        now[0] = k * 0.05
        if k % round(FAST.probe_period_s / 0.05) == 0:
            p = _Probe(now[0] + FAST.probe_timeout_s, sent=True, sent_at=now[0],
                       mark=rpc.mark())
            if now[0] > 3.1:
                p.result, p.answered = pulsar.Result.Ok, now[0]
            pending.append(p)
        if k == 60:
            rpc.end(push)                       # the link drains at 3 s ...
        if k == 62:                             # ... the broker answers the queue at 3.1 s
            for p in pending:
                p.result, p.answered = pulsar.Result.Ok, now[0]
        while pending and h._due(pending[0], now[0]):
            h._judge(pending.popleft())
    assert h.failures == 0 and h.probes > 50 and h.state == MqHealth.UP
    assert rec.changes == [] and h.waited >= 10


def test_the_probe_thread_sleeps_while_pushes_hold_its_probes():
    """With a push in flight for longer than the probe period, the probe thread polls the
    first probe every 50 ms; the probes behind it never wake it (they were judged in order
    before it spun on their past deadlines)."""
    class Producer:
        def send_async(self, data, cb):  # never acknowledged
            pass

        def is_connected(self):
            return True

        def close(self):
            pass

    class Client:
        def create_producer(self, *a, **k):
            return Producer()

    rpc = RpcBacklog()
    seq = rpc.start()
    h = MqHealth(Client(), "t", FailoverConfig(probe_period_s=0.05, probe_timeout_s=0.1),
                 Recorder(), rpc=rpc)
    calls = [0]
    due = h._due

    def counted(p, now):
        calls[0] += 1
        return due(p, now)

    h._due = counted
    h.start()
    try:
        time.sleep(1.0)
    finally:
        rpc.end(seq)
        h.close()
    assert calls[0] < 500, f"{calls[0]} checks in 1 s: the probe thread spins"


@pytest.mark.xdist_group("pulsar")
def test_health_on_a_live_broker_and_a_stuck_publish(pulsar_broker):
    """On the shared broker the probes succeed and the channel stays up, also with a data
    publish unacknowledged for longer than the probe timeout but within
    ``publish_timeout_s``; one unacknowledged for longer than ``publish_timeout_s`` fails
    the probes (down), and the channel comes back once it is acknowledged. The shared
    broker is not harmed."""
    client = _client(pulsar_broker.service_url)
    age = [0.0]
    rec = Recorder()
    h = MqHealth(client, "persistent://public/default/health-test-probe", FAST, rec,
                 inflight_age=lambda: age[0]).start()
    try:
        _wait(lambda: h.probes >= 10, 30, "10 probes")
        assert h.state == MqHealth.UP and h.failures == 0 and rec.changes == []
        assert FAST.probe_timeout_s < 0.8 < FAST.publish_timeout_s
        age[0] = 0.8
        seen = h.probes
        _wait(lambda: h.probes >= seen + 10, 30, "10 more probes")
        assert h.state == MqHealth.UP and h.failures == 0 and rec.changes == []
        age[0] = 5.0
        _wait(lambda: h.state == MqHealth.DOWN, FAST.detection_bound_s + 2, "DOWN")
        assert "oldest unacknowledged data publish is 5.0 s old" in rec.changes[-1][2]
        age[0] = 0.0
        _wait(lambda: h.state == MqHealth.UP, 5, "UP")
        assert [s for _, s, _ in rec.changes] == ["down", "up"]
        assert [e[1] for e in h.events] == ["down", "up"]
    finally:
        t = time.monotonic()
        h.close()
        assert time.monotonic() - t < 2.5
        client.close()


@pytest.mark.slow
@pytest.mark.xdist_group("pulsar")
def test_health_broker_sigkill_and_restart(tmp_path):
    """A broker of its own, SIGKILLed: the channel is declared down within
    ``detection_bound_s`` + 1 s; restarted (same ports and data), it is declared up again;
    killed again, ``close`` returns within 2.5 s while the broker is away."""
    pytest.importorskip("pulsar")
    from harness.broker import PulsarStandalone
    from tests.conftest import start_or_skip

    cfg = FailoverConfig()  # the defaults: what the controller runs with
    broker = start_or_skip(PulsarStandalone(progress=None, work_dir=tmp_path / "broker"))
    with broker:
        client = _client(broker.service_url)
        rec = Recorder()
        h = MqHealth(client, "persistent://public/default/health-kill", cfg, rec).start()
        try:
            _wait(lambda: h.probes >= 5, 30, "5 probes")
            assert h.state == MqHealth.UP and h.failures == 0
            pid = broker.pid
            assert pid is not None
            t_kill = time.monotonic()
            os.kill(pid, 9)
            _wait(lambda: h.state == MqHealth.DOWN, cfg.detection_bound_s + 5, "DOWN")
            detected = rec.changes[-1][0] - t_kill
            assert detected <= cfg.detection_bound_s + 1.0, detected
            assert broker.wait(10) is not None
            broker.start()
            t_up = time.monotonic()
            _wait(lambda: h.state == MqHealth.UP, 90, "UP after the restart")
            print(f"down after {detected:.2f} s (bound {cfg.detection_bound_s} s); up "
                  f"{rec.changes[-1][0] - t_up:.2f} s after start() returned")
            assert [s for _, s, _ in rec.changes] == ["down", "up"]
            pid = broker.pid
            assert pid is not None
            os.kill(pid, 9)
            _wait(lambda: h.state == MqHealth.DOWN, cfg.detection_bound_s + 5, "DOWN again")
            time.sleep(1.0)  # a fresh probe producer is being created meanwhile
        finally:
            t = time.monotonic()
            h.close()
            closed = time.monotonic() - t
            client.close()
        assert closed < 2.5
