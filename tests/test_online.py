"""The online simulator core (envs/dsmd/online.py) and the online deciders (agents/online.py)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from agents.baselines import IDCS
from agents.online import HindsightGreedy, OnlineGreedy, StaticReplan, forecast, make_static
from envs.dsmd.errors import DSMDError
from envs.dsmd.online import OnlineCost, OnlineSimulator, OnlineTrace, relabel_topics, run_online
from envs.dsmd.online_control import KnobMap, KnobPolicy
from envs.dsmd.scenarios import load_scenario
from envs.dsmd.topology import Topology
from envs.dsmd.traces import Dataset, Trace

EPOCH = 1_767_225_600 * 10**9
SEC = 10**9


def _dataset(messages: list[tuple[float, list[int], int]], num_nodes: int = 4,
             duration_s: float = 3.0) -> Dataset:
    """(time s, destination node ids, size bytes) per message; T = 1 s."""
    n = len(messages)
    hosts = [np.asarray(h, np.uint32) for _, h, _ in messages]
    ptr = np.concatenate([[0], np.cumsum([h.size for h in hosts])]).astype(np.int64)
    trace = Trace(message_id=np.arange(1, n + 1, dtype=np.uint32),
                  request_id=np.arange(1, n + 1, dtype=np.uint32),
                  vpc_id=np.ones(n, np.uint32),
                  timestamp_ns=np.array([EPOCH + int(t * SEC) for t, _, _ in messages], np.int64),
                  configuration_type=np.zeros(n, np.int8), operation_type=np.zeros(n, np.int8),
                  resource_id=np.arange(n, dtype=np.uint64),
                  size_bytes=np.array([s for _, _, s in messages], np.int64),
                  hosts_indptr=ptr, hosts=np.concatenate(hosts))
    ids = np.arange(1, num_nodes + 1, dtype=np.uint32)
    topo = Topology.from_arrays(ids, np.full(num_nodes, 10**9, np.int64), ids, ids,
                                np.ones(num_nodes, np.uint32))
    return Dataset(topo, trace, {"name": "hand", "start_ns": EPOCH, "duration_s": duration_s})


def _hand_trace() -> OnlineTrace:
    # types by first appearance: A = {1,2} (id 0), B = {2,3} (id 1), C = {4} (id 2)
    msgs = [(0.1, [1, 2], 100), (0.2, [2, 3], 50),
            (1.1, [1, 2], 100), (1.2, [2, 3], 50), (1.3, [4], 10),
            (2.2, [2, 3], 50), (2.3, [4], 10)]
    spec = load_scenario("tiny", interval_s=1.0, num_topics=2, duration_s=3.0,
                         controller_bw_bps=10**9, controller_cpu=100)
    return OnlineTrace.from_dataset(_dataset(msgs), spec, "hand")


class Scripted:
    """Plans and places from fixed tables (window -> {type: channel})."""

    name = "scripted"

    def __init__(self, plans: dict[int, dict[int, int]], places: dict[int, int]) -> None:
        self.plans, self.places = plans, places

    def reset(self, seed=None) -> None:
        pass

    def plan(self, view):
        p = self.plans.get(view.window, {})
        t = np.array(sorted(p), np.int64)
        return t, np.array([p[k] for k in t.tolist()], np.int64), np.ones(t.size, np.int64)

    def place(self, view, new, placement):
        return self.places[new.type_id]


def test_switching_cost_accounting_by_hand():
    tr = _hand_trace()
    assert tr.num_windows == 3 and tr.num_types == 3
    assert tr.new_types(0).tolist() == [0, 1] and tr.new_types(1).tolist() == [2]
    cost = OnlineCost(w_violation=10.0, w_subscribe=0.01, w_move=0.1, w_delay=0.0)
    dec = Scripted({1: {0: 1, 1: 2}, 2: {1: 1, 2: 1}}, {0: 1, 1: 1, 2: 0})
    r = run_online(tr, dec, cost)
    # w0: A (800 bit/s) and B (400) on topic 1, subscribers {1,2,3}: 3 x 1,200 = 3,600
    #     over necessary 2 x 800 + 2 x 400 = 2,400; the first interval pays no switching
    assert r[0]["total_node_traffic_bps"] == 3600 and r[0]["necessary_traffic_bps"] == 2400
    assert (r[0]["subscribe_infos"], r[0]["moved_types"]) == (0, 0)
    assert r[0]["cost"] == pytest.approx(1.5)
    # w1: B moves to topic 2, C (80) is new on RPC: no redundancy; subscriptions
    #     t1 {1,2,3} -> {1,2} and t2 {} -> {2,3}: 3 changes; one move (B)
    assert r[1]["redundancy_ratio"] == pytest.approx(1.0)
    assert (r[1]["subscribe_infos"], r[1]["moved_types"], r[1]["new_types"]) == (3, 1, 1)
    assert r[1]["cost"] == pytest.approx(1.0 + 0.03 + 0.1)
    # w2: B back to topic 1 with C: (400 + 80) x 3 subscribers {2,3,4} = 1,440 over 880;
    #     A is silent but keeps its place on topic 1 and its nodes' subscriptions, as the
    #     controller does: t1 {1,2} -> {1,2,3,4} (2 changes), t2 {2,3} -> {} (2); moves:
    #     B (2 -> 1), C (0 -> 1)
    assert r[2]["total_node_traffic_bps"] == 1440 and r[2]["necessary_traffic_bps"] == 880
    assert (r[2]["subscribe_infos"], r[2]["moved_types"]) == (4, 2)
    assert r[2]["subscriptions"] == 4
    assert r[2]["cost"] == pytest.approx(1440 / 880 + 0.04 + 0.2)


def test_a_move_counts_when_the_type_next_carries_traffic():
    tr = _hand_trace()
    # A is moved at boundary 2 but sends nothing in interval 2: no move is counted there
    dec = Scripted({2: {0: 2}}, {0: 1, 1: 1, 2: 0})
    r = run_online(tr, dec, OnlineCost())
    assert [x["moved_types"] for x in r] == [0, 0, 0]


def test_deciders_cannot_see_the_future():
    tr = _hand_trace()

    class Peek(Scripted):
        def plan(self, view):
            view.destinations(2)  # C is first seen in interval 1
            return super().plan(view)

    with pytest.raises(DSMDError, match="not been seen"):
        run_online(tr, Peek({}, {0: 1, 1: 1, 2: 0}))

    class Early(Scripted):
        pass

    with pytest.raises(DSMDError, match="before it was seen"):
        run_online(tr, Early({0: {2: 0}}, {0: 1, 1: 1, 2: 0}))
    sim = OnlineSimulator(tr)
    with pytest.raises(DSMDError, match="hindsight"):
        sim.view().realised()


def test_bad_placement_and_weights_are_refused():
    tr = _hand_trace()
    with pytest.raises(DSMDError, match=r"outside 0\.\.2"):
        run_online(tr, Scripted({}, {0: 3, 1: 1, 2: 0}))
    with pytest.raises(DSMDError, match="w_move"):
        OnlineCost(w_move=-1)
    with pytest.raises(DSMDError, match="unknown online cost keys"):
        OnlineCost.from_dict({"w_moves": 1})


def test_relabel_keeps_subscriptions():
    have = np.array([[1, 1, 0, 0], [0, 0, 1, 1]], bool)
    need = np.array([[0, 0, 1, 1], [1, 1, 0, 0]], bool)
    perm = relabel_topics(need, have)
    assert perm.tolist() == [0, 2, 1]


def test_forecasts():
    h = np.array([[0, 10], [10, 20], [20, 30]], float)
    assert forecast(h, "last").tolist() == [20, 30]
    e = forecast(h, "ewma", alpha=0.5)
    # type 0 did not exist in the first interval: its level starts at 10, not at 0
    assert e[0] == pytest.approx(0.5 * 20 + 0.5 * 10)
    assert e[1] == pytest.approx(0.5 * 30 + 0.25 * 20 + 0.25 * 10)
    assert forecast(np.array([[0.0], [0.0], [40.0]]), "ewma", 0.3)[0] == 40.0  # just appeared
    assert (forecast(h, "holt", 0.5, 0.5) >= e).all()  # a rising series: the trend adds
    with pytest.raises(DSMDError):
        forecast(h, "arima")


@pytest.fixture(scope="module")
def tiny_trace() -> OnlineTrace:
    from envs.dsmd.scenarios import generate

    spec = load_scenario("tiny", duration_s=200.0)
    return OnlineTrace.from_dataset(generate(spec), spec, "tiny")


def test_deciders_run_and_oracle_is_ahead(tiny_trace):
    cost = OnlineCost(w_violation=10.0, w_delay=0.0)  # Eq. 1's verdict
    topo = tiny_trace.parsed.catalog.topology
    res = {}
    for d in [make_static(n, tiny_trace.spec, topo, cost)
              for n in ("rpc", "vita", "idcs", "alcor", "greedy")] + [
            OnlineGreedy(headroom=0.1, horizon=2.0, cost=cost),
            OnlineGreedy(forecast="holt", memory=3, cost=cost, name="holt")]:
        r = run_online(tiny_trace, d, cost)
        assert len(r) == tiny_trace.num_windows
        assert all(math.isfinite(x["cost"]) for x in r)
        res[d.name] = _static_part(r, cost)
    idcs = run_online(tiny_trace, StaticReplan(IDCS(), cost), cost)
    assert all(x["moved_types"] == 0 for x in idcs)  # IDCS's channel depends on the type only
    # on the realised Eq. 1 terms (switching aside), planning on the realised instance is
    # ahead of every decider that only knows the past
    oracle = run_online(tiny_trace, HindsightGreedy(cost=cost), cost, hindsight=True)
    assert _static_part(oracle, cost) <= min(res.values()) + 1e-9


def _static_part(rows, cost):
    """Mean over intervals of the redundancy ratio plus the weighted violation."""
    return np.mean([x["redundancy_ratio"] + cost.w_violation * x["violation"] for x in rows])


def test_same_decider_same_result(tiny_trace):
    a = run_online(tiny_trace, OnlineGreedy(headroom=0.1, horizon=2.0), OnlineCost())
    b = run_online(tiny_trace, OnlineGreedy(headroom=0.1, horizon=2.0), OnlineCost())
    assert a == b


def test_hysteresis_moves_less(tiny_trace):
    eager = run_online(tiny_trace, OnlineGreedy(horizon=math.inf), OnlineCost())
    lazy = run_online(tiny_trace, OnlineGreedy(horizon=0.0), OnlineCost())
    assert sum(x["moved_types"] for x in lazy) <= sum(x["moved_types"] for x in eager)


# ---------------------------------------------------------------------- smart/DSMDOnline-v0
def _env(tiny_trace, **kw):
    from envs.dsmd.online_env import DSMDOnlineEnv

    return DSMDOnlineEnv(traces=[tiny_trace, tiny_trace], **kw)


def test_online_env_passes_check_env(tiny_trace):
    from gymnasium.utils.env_checker import check_env

    env = _env(tiny_trace, max_intervals=4)
    check_env(env, skip_render_check=True)


def test_online_env_same_seed_same_rollout(tiny_trace):
    def rollout(seed):
        env = _env(tiny_trace, max_intervals=6)
        env.action_space.seed(seed)
        obs, _ = env.reset(seed=seed)
        out = [obs]
        done = False
        while not done:
            obs, r, term, trunc, info = env.step(env.action_space.sample())
            out += [obs, r, info["cost"], info["subscribe_infos"]]
            done = term or trunc
        return out

    a, b = rollout(3), rollout(3)
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_online_env_episode_info_and_knobs(tiny_trace):
    env = _env(tiny_trace, warmup=2)
    obs, info = env.reset(seed=0, options={"trace": 1})
    assert info["window"] == 2 and obs.shape == (14,)
    steps, total = 0, 0.0
    while True:
        obs, r, term, trunc, info = env.step(np.array([0.5, 1.0, 1.0], np.float32))
        steps += 1
        total += r
        assert r == -info["cost"] and info["knob_horizon"] == math.inf
        assert info["knob_headroom"] == pytest.approx(0.5 * env.knob_map.max_headroom)
        # the next observation reads the delay model's terms of the interval just scored
        if info["types"]:
            assert obs[12] == pytest.approx(min(info["delay_p95_s"] / 10.0, 1.0), abs=1e-6)
            assert obs[13] == pytest.approx(min(info["bw_util"], 1.0), abs=1e-6)
        if term or trunc:
            break
    assert term and steps == tiny_trace.num_windows - 2
    with pytest.raises(DSMDError, match="episode is over"):
        env.step(np.zeros(3))


def test_online_env_refuses_bad_arguments(tiny_trace):
    from envs.dsmd.online_env import DSMDOnlineEnv

    with pytest.raises(DSMDError, match="warmup"):
        _env(tiny_trace, warmup=10_000)
    with pytest.raises(DSMDError, match="executor"):
        _env(tiny_trace, executor="nowhere")
    with pytest.raises(DSMDError, match="max_intervals"):
        _env(tiny_trace, max_intervals=0)
    env = _env(tiny_trace)
    with pytest.raises(DSMDError, match="reset"):
        env.step(np.zeros(3))
    with pytest.raises(DSMDError, match="out of range"):
        env.reset(options={"trace": 5})
    assert DSMDOnlineEnv.metadata["render_modes"] == []


def test_online_env_is_registered():
    import gymnasium as gym

    import envs  # noqa: F401

    assert "smart/DSMDOnline-v0" in gym.registry


# ---------------------------------------------------------------------- the exact oracle
@pytest.fixture(scope="module")
def tiny_online_trace(tmp_path_factory) -> OnlineTrace:
    from envs.dsmd.dataset import build_dataset, load_dataset_spec

    ds = build_dataset(load_dataset_spec("tiny_online"), tmp_path_factory.mktemp("ds"))
    rec = ds.traces("test")[0]
    return OnlineTrace.from_dataset(ds.load(rec.id), ds.scenario, rec.id)


def _run(trace, decider, cost, hindsight=False):
    sim = OnlineSimulator(trace, cost, hindsight)
    return sim.run(decider)


def test_simulator_cost_is_the_oracle_definition(tiny_online_trace):
    """The simulator's switching accounting equals agents.exact_online.online_cost, the
    MILP's reference definition, on the same plan (empty intervals skipped by both)."""
    from agents.exact_online import online_cost

    tr, cost = tiny_online_trace, OnlineCost(w_subscribe=0.01, w_move=0.05)
    res = _run(tr, OnlineGreedy(headroom=0.1, horizon=2.0, cost=cost), cost)
    busy = [w for w in range(tr.num_windows) if tr.realised(w).num_types]
    total = online_cost([tr.realised(w) for w in busy], [res[w].channel for w in busy],
                        cost.w_violation, cost.w_subscribe, cost.w_move)
    # plus the delay term, which the MILP's objective does not have
    total += cost.w_delay * sum(res[w]["delay_p95_s"] for w in busy)
    assert sum(r["cost"] for r in res) == pytest.approx(total, rel=1e-9)


def test_exact_bound_is_below_every_policy(tiny_online_trace):
    from agents.online_eval import exact_bound

    tr, cost = tiny_online_trace, OnlineCost(w_subscribe=0.01, w_move=0.05)
    bound = exact_bound(tr, cost, horizon=6, time_limit_s=30, max_variables=200_000)
    assert bound["status"] == "chunks_optimal"
    topo = tr.parsed.catalog.topology
    deciders = [make_static(n, tr.spec, topo, cost)
                for n in ("rpc", "vita", "idcs", "alcor", "greedy")]
    deciders += [OnlineGreedy(horizon=h, headroom=hr, cost=cost)
                 for h in (0.0, 2.0, math.inf) for hr in (0.0, 0.2)]
    for d in deciders:
        res = [r for r in _run(tr, d, cost) if r["types"] > 0]
        assert bound["bound"] <= np.mean([r["cost"] for r in res]) + 1e-9, d.name
    ora = [r for r in _run(tr, HindsightGreedy(cost=cost), cost, True) if r["types"] > 0]
    assert bound["bound"] <= np.mean([r["cost"] for r in ora]) + 1e-9
    too_big = exact_bound(tr, cost, horizon=6, time_limit_s=30, max_variables=10)
    assert too_big["status"] == "too_large" and "variables" in too_big["detail"]


def test_returning_types_are_placed_again():
    # A = {1,2} sends in 0, is silent in 1 and returns in 2; B = {2,3} sends in all three
    msgs = [(0.1, [1, 2], 100), (0.2, [2, 3], 50), (1.2, [2, 3], 50),
            (2.1, [2, 3], 50), (2.5, [1, 2], 100)]
    spec = load_scenario("tiny", interval_s=1.0, num_topics=2, duration_s=3.0,
                         controller_bw_bps=10**9, controller_cpu=100)
    tr = OnlineTrace.from_dataset(_dataset(msgs), spec, "returning")
    assert tr.arrivals(2)[0].tolist() == [1, 0]  # B first, then A

    seen = []

    class Recorder(Scripted):
        def place(self, view, new, placement):
            seen.append((view.window, new.type_id, new.previous_channel, new.size_bytes))
            return 2 if view.window == 2 else 1

    # boundary 2 plans only B (the type of interval 1): A is placed again on its return
    r = run_online(tr, Recorder({1: {1: 1}, 2: {1: 1}}, {}), OnlineCost())
    assert seen == [(0, 0, -1, 100), (0, 1, -1, 50), (2, 0, 1, 100)]
    assert (r[2]["returning_types"], r[2]["new_types"], r[2]["moved_types"]) == (1, 0, 1)
    assert r[0]["new_types"] == 2 and r[0]["returning_types"] == 0


def test_online_greedy_can_keep_returning_types(tiny_trace):
    keep = run_online(tiny_trace, OnlineGreedy(replace_returning=False), OnlineCost())
    again = run_online(tiny_trace, OnlineGreedy(), OnlineCost())
    assert sum(r["returning_types"] for r in keep) == sum(r["returning_types"] for r in again)
    assert sum(r["returning_types"] for r in keep) > 0
    with pytest.raises(DSMDError, match="memory"):
        OnlineGreedy(memory=0)


def test_evaluation_cache_reuses_only_unchanged_rows(tmp_path):
    """Cached rows of a deterministic decider equal a fresh run; a learned decider, another
    cost or other intervals are never served from the cache."""
    from agents.online_eval import DeciderSpec, evaluate_online
    from envs.dsmd.dataset import build_dataset, load_dataset_spec

    ds = build_dataset(load_dataset_spec("tiny_online"), tmp_path / "ds")
    ids = [r.id for r in ds.traces("validation")]
    specs = [DeciderSpec.make("idcs", "static"),
             DeciderSpec.make("og", "online_greedy", headroom=0.1, horizon=1.0)]
    cost, cache = OnlineCost(), tmp_path / "cache"
    fresh = evaluate_online(ds, ids, specs, cost, 12, progress=False)
    first = evaluate_online(ds, ids, specs, cost, 12, progress=False, cache=cache)
    files = sorted(cache.iterdir())
    assert len(files) == len(ids) * len(specs)
    again = evaluate_online(ds, ids, specs, cost, 12, progress=False, cache=cache)
    assert fresh.equals(first) and first.equals(again)
    assert sorted(cache.iterdir()) == files  # nothing recomputed
    evaluate_online(ds, ids, specs, OnlineCost(w_move=0.5), 12, progress=False, cache=cache)
    evaluate_online(ds, ids, specs, cost, 6, progress=False, cache=cache)
    assert len(list(cache.iterdir())) == 3 * len(files)


def test_clone_is_independent_and_knob_oracle_takes_the_cheapest(tmp_path):
    from agents.online import OnlineGreedy
    from agents.online_eval import knob_grid, knob_oracle
    from envs.dsmd.dataset import build_dataset, load_dataset_spec

    ds = build_dataset(load_dataset_spec("tiny_online"), tmp_path / "ds")
    rec = ds.traces("validation")[0]
    tr = OnlineTrace.from_dataset(ds.load(rec.id), ds.scenario, rec.id)
    sim = OnlineSimulator(tr, OnlineCost())
    sim.step(OnlineGreedy())
    before = (sim.window, sim.channel.copy(), dict(sim.last))
    c = sim.clone()
    c.step(OnlineGreedy(horizon=0.0))
    assert c.window == sim.window + 1
    assert sim.window == before[0] and np.array_equal(sim.channel, before[1])
    assert sim.last == before[2]
    grid = knob_grid("og", {"headroom": [0.0, 0.2], "horizon": ["inf", 1.0]})
    rows = knob_oracle(ds, [rec.id], grid, OnlineCost(), 8)
    assert len(rows) == 8 and set(rows.knob_setting) <= {s.name for s in grid}
    first = [OnlineSimulator(tr, OnlineCost()).step(s.build(tr, OnlineCost()))["cost"]
             for s in grid]
    assert rows.cost.iloc[0] == min(first)


def test_placements_can_respect_the_plans_reserve():
    """C_p = 10, the plan sends 7 per interval over RPC; a new type for 3 nodes fits over RPC
    (10 sends) against the full C_p but not against the reserve of headroom 0.2 (8 sends):
    placed against the full capacities it takes RPC (no new subscriptions), inside the
    reserve it takes a topic (one send)."""
    from envs.dsmd.cost import CostState
    from envs.dsmd.instance import RPC, UNASSIGNED, DSMDInstance
    from envs.dsmd.online import NewType, Placement

    inst = DSMDInstance.from_sets([[0, 1, 2], [0, 1, 2], [0], [0, 1, 2]], [5, 5, 5, 5],
                                  10**6, 1, 10**6, 10)
    new = NewType(3, np.array([0, 1, 2]), 1, 5, 0, 0)

    def placed(reserve: bool) -> int:
        state = CostState(inst, np.array([RPC, RPC, RPC, UNASSIGNED]))
        return OnlineGreedy(headroom=0.2, reserve_placements=reserve).place(
            None, new, Placement(state, 3))

    assert placed(False) == RPC
    assert placed(True) == 1


def test_the_teachers_other_settings_are_fixed_in_the_knob_map(tmp_path):
    from agents.task_online import teacher_fixed_args

    assert teacher_fixed_args("online_greedy", {"headroom": 0.2, "horizon": 1.0,
                                                "forecast": "last"}) == {}
    assert teacher_fixed_args("online_greedy", {"headroom": 0.2,
                                                "reserve_placements": False}) == {}
    assert teacher_fixed_args("online_greedy", {"headroom": 0.2, "reserve_placements": True,
                                                "memory": 6}) == {
        "reserve_placements": True, "memory": 6}
    got = teacher_fixed_args("online_greedy", {"send_forecaster": "f.npz", "drop": 0.2})
    assert got == {"send_forecaster": str(Path("f.npz").resolve()), "drop": 0.2}
    with pytest.raises(DSMDError, match="forecast='holt'"):
        teacher_fixed_args("online_greedy", {"forecast": "holt"})
    with pytest.raises(DSMDError, match=r"\['headroom'\].*set by the action"):
        KnobMap(fixed={"headroom": 0.1})
    with pytest.raises(DSMDError, match=r"\['bogus'\].*not arguments it takes"):
        KnobMap(fixed={"bogus": 1})


def test_knob_policy_with_fixed_arguments_is_its_teacher(tiny_trace):
    """A knob policy whose actor always asks for the teacher's knobs, over a knob map that
    fixes the teacher's other settings (forecaster and drop included), decides exactly as
    the teacher, interval by interval: one executor serves the episode, so the demand state
    the forecaster reads carries across boundaries."""
    path = str(Path(__file__).parents[1] / "results/forecaster/send_forecaster.npz")
    fixed = {"reserve_placements": True, "send_forecaster": path, "drop": 0.2}
    teacher = OnlineGreedy(headroom=0.2, horizon=1.0, **fixed)
    km = KnobMap(fixed=fixed)
    a = 2.0 * km.action(0.2, 1.0) - 1.0
    pol = KnobPolicy(lambda _obs: a, km)
    want = OnlineSimulator(tiny_trace, OnlineCost()).run(teacher)
    got = OnlineSimulator(tiny_trace, OnlineCost()).run(pol)
    assert pol.knobs_used[0] == {"headroom": 0.2, "horizon": 1.0, "alpha": 1.0}
    assert [r.as_dict() for r in got] == [r.as_dict() for r in want]
    assert [r.channel.tolist() for r in got] == [r.channel.tolist() for r in want]
    plain = run_online(tiny_trace, OnlineGreedy(headroom=0.2, horizon=1.0), OnlineCost())
    assert plain != [r.as_dict() for r in want]  # the drop acts


def test_demand_tracker_sees_what_the_panel_sees(tiny_trace):
    """Fed from the online view alone, boundary by boundary (and catching up several
    intervals at once), the tracker's features equal the offline panel's rows: the
    forecaster reads in the simulator what it was trained on."""
    from envs.dsmd.demand import DemandTracker, trace_panel
    from envs.dsmd.online import OnlineView

    panel = trace_panel(tiny_trace)
    channel = np.full(tiny_trace.num_types, -1, np.int64)
    for step in (1, 3):
        tracker = DemandTracker()
        for w in range(1, tiny_trace.num_windows, step):
            state = tracker.at(OnlineView(tiny_trace, w, channel))
            rows = panel.window == w
            np.testing.assert_array_equal(np.flatnonzero(state.known), panel.type_id[rows])
            np.testing.assert_array_equal(state.features()[state.known], panel.x[rows])
    assert tracker.at(OnlineView(tiny_trace, 1, channel)).num_types <= tiny_trace.num_types


def test_online_greedy_drops_unlikely_senders(tiny_trace, tmp_path):
    """drop = 0 plans as the plain executor; a drop above every probability plans nothing
    (every type is placed on arrival); a drop without a forecaster, or a file that is not
    one, is refused."""
    from pathlib import Path

    path = str(Path(__file__).parents[1] / "results/forecaster/send_forecaster.npz")
    plain = run_online(tiny_trace, OnlineGreedy(headroom=0.2, horizon=1.0), OnlineCost())
    same = run_online(tiny_trace, OnlineGreedy(headroom=0.2, horizon=1.0, send_forecaster=path),
                      OnlineCost())
    assert [r["cost"] for r in same] == [r["cost"] for r in plain]
    none = run_online(tiny_trace, OnlineGreedy(send_forecaster=path, drop=0.999,
                                               reserve_placements=True), OnlineCost())
    assert sum(r["planned_types"] for r in none) == 0
    assert sum(r["new_types"] + r["returning_types"] for r in none) > 0
    with pytest.raises(DSMDError, match="drop needs a send_forecaster"):
        OnlineGreedy(drop=0.2)
    (tmp_path / "x.npz").write_bytes(b"junk")
    with pytest.raises(DSMDError, match="not a readable"):
        OnlineGreedy(send_forecaster=str(tmp_path / "x.npz"), drop=0.2)
