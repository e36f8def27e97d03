"""C_p as a real limit on the controller's concurrent sends (SMART Eq. 1's third constraint,
``ControllerConfig.max_inflight_sends``): an RPC push of ``k`` messages to a node holds
``min(k, limit)`` units until the call ends, an MQ publish one until the broker answers, and
a send that finds the limit full waits. End to end on a real broker, real gRPC and real
agents (``tests/delivery_rig.py``): everything is delivered in order, the peak never passes
the limit, the waits are counted, and the units all come back, also after failures."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from delivery.controller import RPC, ConfigError, ControllerConfig, ControllerStats, InflightLimiter
from harness.broker import PulsarStandalone

from .delivery_rig import Rig, assert_arrived, assert_delivered, rig, wait_until

pytestmark = pytest.mark.xdist_group("pulsar")

NODES = (0, 1, 2, 3)
HOSTS = {0: NODES, 1: (0,), 2: (1, 2), 3: (2, 3)}
CHANNELS = {0: 1, 1: RPC, 2: RPC, 3: 2}  # two MQ types, two RPC types


def _load(r: Rig, count: int, flush_every: int = 8) -> None:
    """``count`` messages over the four types (each type its own VPC, so each resource
    stays on one channel), flushed in bursts: several nodes' pushes and several publishes
    are due at once."""
    for k in range(count):
        t = k % 4
        r.send(t, resource_id=k % 5, hosts=HOSTS[t], vpc=t + 1)
        if k % flush_every == flush_every - 1:
            r.ctl.flush(wait=False)


def _units_back(r: Rig, timeout: float = 15.0) -> None:
    wait_until(lambda: r.ctl.inflight_sends == 0, timeout,
               lambda: f"C_p units back to 0 (held: {r.ctl.inflight_sends})")
    assert r.ctl.inflight_sends == 0  # never below: no unit was given back twice


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("value", [-1, 2.5, "4", True])
def test_bad_limit_refused_naming_the_key(tmp_path, value):
    with pytest.raises(ConfigError, match="max_inflight_sends"):
        ControllerConfig.from_mapping({"pulsar_url": "pulsar://127.0.0.1:1",
                                       "store_url": f"sqlite:///{tmp_path / 'm.db'}",
                                       "max_inflight_sends": value})


def test_limit_defaults_to_none():
    cfg = ControllerConfig("pulsar://127.0.0.1:1", "sqlite://")
    assert cfg.max_inflight_sends == 0


# --------------------------------------------------------------------------- the limiter


def test_limiter_blocks_counts_and_close_releases_waiters():
    """A full limiter blocks the next send until units return; a batch larger than the
    limit holds the whole limit; close() wakes a waiter, which gets no unit."""
    stats = ControllerStats()
    lim = InflightLimiter(2, stats)
    assert lim.acquire(5) == 2  # a batch of 5 holds min(5, limit) units
    got: list[int] = []
    th = threading.Thread(target=lambda: got.append(lim.acquire(1)))
    th.start()
    time.sleep(0.2)
    assert th.is_alive() and not got, "a send must wait while the limit is full"
    lim.release(2)
    th.join(5)
    assert got == [1] and lim.held == 1
    assert stats.inflight_waits >= 1 and stats.inflight_wait_s >= 0.15
    assert stats.inflight_peak == 2
    lim.acquire(1)  # full again
    th = threading.Thread(target=lambda: got.append(lim.acquire(1)))
    th.start()
    time.sleep(0.1)
    assert th.is_alive()
    lim.close()
    th.join(5)
    assert not th.is_alive() and got[-1] == 0
    assert lim.acquire(1) == 0  # closed: nothing waits any more


def test_limiter_without_limit_counts_only():
    stats = ControllerStats()
    lim = InflightLimiter(0, stats)
    assert [lim.acquire(3) for _ in range(4)] == [3, 3, 3, 3]
    assert stats.inflight_peak == 12 and stats.inflight_waits == 0
    for _ in range(4):
        lim.release(3)
    assert lim.held == 0


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("limit", [2, 0])
def test_limit_holds_and_everything_arrives_in_order(pulsar_broker, tmp_path, limit):
    """With C_p = 2 the controller never has more than two units of sends in flight, many
    of its sends wait (counted), and every message is applied, in order, exactly once; the
    units all come back. With no limit (0) nothing waits and delivery is as before."""
    with rig(pulsar_broker, tmp_path, NODES, ctl_kw={"max_inflight_sends": limit}) as r:
        r.ctl.set_channels(CHANNELS, HOSTS)
        r.wait_subscriptions()
        t0 = time.monotonic()
        _load(r, 240)
        r.delivered(every=True)
        took = time.monotonic() - t0
        _units_back(r)
        s = r.ctl.stats
        print(f"\nC_p limit {limit}: 240 messages delivered in {took:.2f} s; "
              f"peak {s.inflight_peak} units, {s.inflight_waits} waits, "
              f"{s.inflight_wait_s:.2f} s waited")
        if limit:
            assert 1 <= s.inflight_peak <= limit
            assert s.inflight_waits > 0 and s.inflight_wait_s > 0
        else:
            assert s.inflight_waits == 0 and s.inflight_wait_s == 0
            assert s.inflight_peak >= 1
        assert_arrived(r)


def test_units_come_back_after_push_failures_and_relays(pulsar_broker, tmp_path):
    """Node 1's RPC endpoint is down under C_p = 2: its pushes fail (their units come back
    with the failed calls), its queue is relayed on its topic (publishes, one unit each)
    and confirmed away; everything arrives and no unit is left held."""
    nodes = (0, 1)
    hosts = {0: nodes, 1: (1,), 2: (0,)}
    with rig(pulsar_broker, tmp_path, nodes,
             ctl_kw={"max_inflight_sends": 2, "push_retries": 1, "retry_backoff_s": 0.02,
                     "failover": {"relay_after_s": 0.5}}) as r:
        r.ctl.set_channels({0: 1, 1: RPC, 2: RPC}, hosts)
        r.wait_subscriptions()
        assert r.host is not None
        r.host.call(r.host.agents[1]._server.stop(0))
        for k in range(60):
            t = k % 3
            r.send(t, resource_id=k % 4, hosts=hosts[t], vpc=t + 1)
            if k % 6 == 5:
                r.ctl.flush(wait=False)
        r.ctl.flush()
        wait_until(lambda: r.ctl.stats.relayed >= 20, 20,
                   lambda: f"node 1's queue relayed ({r.ctl.stats.relayed})")
        assert r.ctl.stats.push_failures > 0
        r.delivered(every=True)
        wait_until(lambda: not r.ctl.pending(), 15, "node 1's queue confirmed away")
        _units_back(r)
        assert 1 <= r.ctl.stats.inflight_peak <= 2
        assert_arrived(r)


# --------------------------------------------------------------------------- broker failure


@pytest.mark.slow  # a broker JVM of its own, frozen (SIGSTOP) twice
@pytest.mark.timeout(600)
def test_broker_frozen_units_released_and_close_does_not_hang(tmp_path):
    """A broker of its own is frozen (SIGSTOP) under load with C_p = 2: its publishes in
    flight give their units back when the MQ channel is declared down, the failover takes
    them over by RPC, and after it is thawed everything arrives and no unit is held. Then,
    with failover off and C_p = 1, a sender blocked on the frozen broker's unacknowledged
    publish is released by close(), which returns promptly."""
    with PulsarStandalone(progress=None, work_dir=tmp_path / "broker") as broker:
        assert broker.pid is not None
        frozen = False

        def freeze(on: bool) -> None:
            nonlocal frozen
            assert broker.pid is not None
            os.kill(broker.pid, signal.SIGSTOP if on else signal.SIGCONT)
            frozen = on

        for sub in ("a", "b"):
            (tmp_path / sub).mkdir()
        try:
            with rig(broker, tmp_path / "a", NODES, ctl_kw={"max_inflight_sends": 2}) as r:
                r.ctl.set_channels(CHANNELS, HOSTS)
                r.wait_subscriptions()
                _load(r, 40)
                r.ctl.flush()
                freeze(True)
                stop = threading.Event()
                errors: list[BaseException] = []

                def sender() -> None:
                    try:
                        k = 0
                        while not stop.is_set():
                            t = k % 4
                            r.send(t, resource_id=k % 5, hosts=HOSTS[t], vpc=t + 1)
                            if k % 4 == 3:
                                r.ctl.flush(wait=False)
                            k += 1
                            time.sleep(0.02)
                    except BaseException as e:  # reported by the test
                        errors.append(e)

                th = threading.Thread(target=sender, daemon=True)
                th.start()
                wait_until(lambda: r.ctl.stats.failovers >= 1, 20, "the failover")
                time.sleep(2)
                assert th.is_alive(), "the sender must not stay blocked while MQ is down"
                freeze(False)
                wait_until(lambda: r.ctl.stats.failbacks >= 1, 60, "the failback")
                time.sleep(2)
                stop.set()
                th.join(30)
                assert not errors, errors
                r.ctl.flush()
                assert_delivered(r.record_dir, r.ledger, r.nodes, timeout=120,
                                 pending=r.ctl.pending)
                assert_arrived(r, timeout=60)
                _units_back(r, 30)
                assert 1 <= r.ctl.stats.inflight_peak <= 2
                print(f"\nfrozen broker: {r.ctl.stats.rerouted} messages taken over by RPC, "
                      f"{r.ctl.stats.inflight_waits} waits, peak {r.ctl.stats.inflight_peak}")

            b = Rig(broker, tmp_path / "b", (0,),
                    ctl_kw={"max_inflight_sends": 1, "failover": {"enabled": False}})
            try:
                b.ctl.set_channels({0: 1}, {0: (0,)})
                b.wait_subscriptions()
                b.send(0, resource_id=0, hosts=(0,))  # the topic's producer exists
                b.delivered(every=True)
                freeze(True)
                done = threading.Event()

                def blocked_sender() -> None:
                    try:
                        for k in range(1, 4):
                            b.send(0, resource_id=k, hosts=(0,))
                    except BaseException:  # the store is closed under it
                        pass
                    finally:
                        done.set()

                th = threading.Thread(target=blocked_sender, daemon=True)
                th.start()
                wait_until(lambda: b.ctl.stats.inflight_waits >= 1, 10,
                           "a publish waiting for the unit of the unacknowledged one")
                assert not done.is_set()
                t0 = time.monotonic()
                b.ctl.close()
                closed_in = time.monotonic() - t0
                assert done.wait(10), "close() must release the sender waiting for C_p"
                print(f"close() with a sender waiting for C_p returned in {closed_in:.1f} s")
                assert closed_in < 30
            finally:
                if frozen:
                    freeze(False)
                if b.host is not None:
                    b.host.close()
        finally:
            if frozen:
                freeze(False)
