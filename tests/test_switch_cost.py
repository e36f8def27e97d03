"""What a switch costs (delivery.switch_cost): one point's switches measured with real
components (a secure broker, real agents, the controller and a steady stream), the fit, and
the schema of the switching-cost document the online environment reads
(``envs/dsmd/switching_costs.json``)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from delivery import switch_cost as sc

ROOT = Path(__file__).resolve().parents[1]
COSTS = ROOT / "envs" / "dsmd" / "switching_costs.json"


@pytest.mark.xdist_group("pulsar")
def test_one_point_measured_with_real_components(pulsar_broker, tmp_path: Path) -> None:
    """One type to two nodes, RPC -> topic -> other topic -> RPC under a stream: the
    SubscribeInfos and fences each switch makes, its block on the sending path and its
    phases, the drains done (durable subscriptions deleted), and every message delivered."""
    load = sc.LoadSpec(background_rate=20.0, switched_rate=10.0, background_rpc=1,
                       background_mq=1, rpc_dests=2, mq_dests=2, flush_ms=50.0)
    bench = sc.SwitchBench(pulsar_broker.service_url, pulsar_broker.admin_url, [0, 1, 2],
                           tmp_path, load=load, agent_processes=0, pre_s=0.5, settle_s=0.5,
                           say=lambda _s: None)
    with bench:
        bench.run_point(sc.SwitchPoint("k1-d2", 1, 2), 1)
        samples = bench.finish()
        left = {t.rsplit("-t", 1)[1] for t in bench._host.agents[0].topics()}
        assert left == {str(sc.BACKGROUND_TOPIC)}  # the switched type's topics were left
    by = {s["direction"]: s for s in samples}
    assert list(by) == list(sc.DIRECTIONS)
    assert (by["rpc->mq"]["subscribe"], by["rpc->mq"]["unsubscribe"]) == (2, 0)
    assert (by["mq->mq"]["subscribe"], by["mq->mq"]["unsubscribe"]) == (2, 2)
    assert (by["mq->rpc"]["subscribe"], by["mq->rpc"]["unsubscribe"]) == (0, 2)
    assert [by[d]["fences"] for d in sc.DIRECTIONS] == [0, 1, 1]
    for s in samples:
        assert set(sc.SAMPLE_FIELDS) <= set(s)
        assert s["types"] == 1 and s["missing"] == 0 and s["messages_during"] > 0
        assert 0 < s["subscribe_s"] + s["unsubscribe_s"] <= s["block_s"] < 15
        assert s["sender_lag_s"] >= 0
    assert by["rpc->mq"]["drain_s"] == 0.0
    assert all(0 < by[d]["drain_s"] < 30 for d in ("mq->mq", "mq->rpc"))


def _synthetic(seed: int = 0) -> list[dict]:
    """Samples of a known cost: block = 10 ms + 2 ms per SubscribeInfo + 1 ms per type."""
    rnd = random.Random(seed)
    out = []
    for p in sc.default_points(64):
        for d in sc.DIRECTIONS:
            per = p.dests if p.shared else p.types * p.dests
            sub = per if d != "mq->rpc" else 0
            unsub = per if d != "rpc->mq" else 0
            for rep in range(3):
                block = 0.010 + 0.002 * (sub + unsub) + 0.001 * p.types + rnd.gauss(0, 1e-4)
                out.append({"point": p.name, "direction": d, "rep": rep, "types": p.types,
                            "dests": p.dests, "shared": p.shared, "subscribe": sub,
                            "unsubscribe": unsub, "subscribe_infos": sub + unsub,
                            "fences": int(bool(unsub)), "block_s": block,
                            "drain_s": 0.05 + 0.001 * unsub if unsub else 0.0,
                            "added_delay_mean_s": block / 2, "sender_lag_s": block})
    out.append({**out[0], "point": "control", "direction": "none", "types": 0})
    return out


def test_fit_recovers_a_known_cost_and_the_document_loads(tmp_path: Path) -> None:
    fits = sc.fit_costs(_synthetic())
    blk = fits["block"]
    assert blk["coef"]["subscribe_infos"] == pytest.approx(0.002, rel=0.02)
    assert blk["coef"]["types"] == pytest.approx(0.001, rel=0.1)
    assert blk["intercept_s"] == pytest.approx(0.010, abs=5e-4)
    assert blk["r2"] > 0.999 and blk["residual_sd_s"] < 1e-3
    assert fits["drain"]["coef"]["unsubscribe"] == pytest.approx(0.001, rel=0.05)
    assert set(fits["block_by_direction"]) == set(sc.DIRECTIONS)
    doc = sc.costs_document(fits, "emulated", {"cpu_model": "x"}, "python bench/x.py")
    assert set(sc.SCHEMA_KEYS) <= set(doc)
    f = tmp_path / "costs.json"
    f.write_text(json.dumps(doc))
    back = sc.load_costs(f)
    assert back["seconds_per_subscribe_info"] == pytest.approx(0.002, rel=0.02)
    w = sc.online_weights(back, 30.0)
    assert w["w_subscribe"] == pytest.approx(back["seconds_per_subscribe_info"] / 30.0)
    assert w["w_move"] == pytest.approx(back["seconds_per_moved_type"] / 30.0)


@pytest.mark.parametrize(("change", "match"), [
    ({"seconds_per_subscribe_info": -1.0}, "seconds_per_subscribe_info"),
    ({"seconds_per_moved_type": float("nan")}, "seconds_per_moved_type"),
    ({"seconds_per_moved_type": True}, "seconds_per_moved_type"),
    ({"network": "lan"}, "network"),
    ({"fit": {}}, "fit"),
    ({"fit": {"block": {"coef": {}}}}, "residual_sd_s"),
    ({"command": ""}, "command"),
])
def test_a_bad_document_names_its_key(change: dict, match: str) -> None:
    doc = sc.costs_document(sc.fit_costs(_synthetic()), "loopback", "m", "cmd")
    with pytest.raises(sc.CostsError, match=match):
        sc.check_costs({**doc, **change})
    del doc["date"]
    with pytest.raises(sc.CostsError, match="date"):
        sc.check_costs(doc)
    with pytest.raises(sc.CostsError, match="interval_s"):
        sc.online_weights(sc.costs_document(sc.fit_costs(_synthetic()), "loopback", "m",
                                            "cmd"), 0)


def test_bad_settings_are_named(tmp_path: Path) -> None:
    with pytest.raises(sc.CostsError, match="dests"):
        sc.SwitchPoint("p", 1, 0)
    with pytest.raises(sc.CostsError, match="only 2 nodes"):
        sc.SwitchPoint("p", 1, 3).hosts([0, 1])
    with pytest.raises(sc.CostsError, match="need at least"):
        sc.least_squares([{"block_s": 1.0, "subscribe_infos": 1, "types": 1}], "block_s")
    with pytest.raises(sc.CostsError, match="not JSON"):
        (tmp_path / "x.json").write_text("{")
        sc.load_costs(tmp_path / "x.json")
    with pytest.raises(sc.CostsError, match="network"):
        sc.measure("lan", [0], tmp_path, points=[])


def test_points_hosts_and_topics() -> None:
    own, shared = sc.SwitchPoint("o", 3, 2), sc.SwitchPoint("s", 3, 2, True)
    assert own.hosts(list(range(4))) == [(0, 1), (2, 3), (0, 1)]
    assert shared.hosts(list(range(4))) == [(0, 1)] * 3
    assert own.topics(False) == [1, 2, 3] and shared.topics(True) == [sc.TOPIC_B] * 3
    assert all(p.dests <= 8 for p in sc.default_points(8))


@pytest.mark.skipif(not COSTS.is_file(), reason="no measured switching costs yet")
def test_the_measured_costs_load() -> None:
    doc = sc.load_costs(COSTS)
    assert doc["network"] in ("emulated", "loopback")
    assert math.isfinite(doc["seconds_per_subscribe_info"])
    assert doc["fit"]["block"]["points"] >= 10


def test_online_cost_defaults_are_the_measured_switching_costs() -> None:
    """The online environment's switching weights (OnlineCost's defaults and
    configs/env/online.yaml) are the committed measurement over the GoDaddy T = 30 s."""
    from omegaconf import OmegaConf

    from agents.config import CONFIG_DIR
    from envs.dsmd.online import OnlineCost

    m = OnlineCost.measured(30.0)
    conf = OmegaConf.load(Path(CONFIG_DIR) / "env" / "online.yaml").env.cost
    for w in ("w_subscribe", "w_move"):
        for v in (getattr(OnlineCost(), w), float(conf[w])):
            assert abs(v - getattr(m, w)) <= 0.03 * getattr(m, w) + 1e-9, (w, v, m)
