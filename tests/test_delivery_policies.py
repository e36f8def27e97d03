"""The live testbed's policies are the simulator's: every static baseline of the registry
(:mod:`agents.registry`) decides, through a real controller adapter's parser, exactly what the
simulator's policy assigns to the same interval's instance, and the online heuristics
(:class:`agents.online.OnlineGreedy`; an online policy bundle) place and plan exactly as the
online simulator (:class:`envs.dsmd.online.OnlineSimulator`) has them do over the same
messages. No broker: the control plane's calls are made here as
:class:`delivery.control_plane.ControlPlane` makes them, with a channel table in place of the
controller."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agents.online import OnlineGreedy
from agents.registry import make_policy_for
from delivery.policies import (
    ONLINE_DEFAULTS,
    POLICIES,
    STATIC,
    BaselinePolicy,
    OnlinePolicy,
    make_policy,
)
from envs.dsmd.message import messages_from_trace
from envs.dsmd.online import OnlineCost, OnlineSimulator, OnlineTrace
from envs.dsmd.traces import Dataset
from serving.scenario import adapter_for


class Plane:
    """The calls :class:`delivery.control_plane.ControlPlane` makes of its adapter and policy
    (``send``, ``prime``, ``close_interval``), applied to a channel table; ``sent[w]``: the
    channel each type's messages took in interval ``w``."""

    def __init__(self, ps, policy) -> None:
        self.ps, self.policy = ps, policy
        self.adapter = adapter_for(ps, None)
        self.channel: dict[int, int] = {}
        self.sent: list[dict[int, int]] = [{}]
        self.decided: list[dict[int, int]] = []

    def send(self, msg) -> int:
        t = self.adapter.submit(msg)
        route = getattr(self.policy, "route", None)
        c = route(self.adapter, msg, t) if route is not None else None
        if c is None and t not in self.channel:  # first seen: no rate of it yet
            c = self.policy.first_channel(self.adapter, t)
        if c is not None:
            self.channel[t] = c
        got = self.sent[-1].setdefault(t, self.channel[t])
        assert got == self.channel[t], f"type {t} changed channel inside an interval"
        return t

    def prime(self, messages) -> None:
        route = getattr(self.policy, "route", None)
        for m in messages:
            t = self.adapter.submit(m)
            if route is not None:
                route(self.adapter, m, t)
        self._apply(self.adapter.close_interval())

    def close_interval(self):
        est = self.adapter.close_interval()
        self._apply(est)
        self.sent.append({})
        return est

    def _apply(self, est) -> None:
        chans = self.policy.channels(self.adapter, est)
        self.decided.append(chans)
        self.channel.update(chans)

    def replay(self, windows) -> None:
        tr, win = self.ps.dataset.trace, self.ps.parsed.message_window
        for w in windows:
            for m in messages_from_trace(tr, np.flatnonzero(win == w)):
                self.send(m)
            self.close_interval()


@pytest.fixture(scope="module")
def ps(tiny_problems):
    return tiny_problems


def _windows(ps) -> list[int]:
    return list(range(ps.parsed.num_windows))


# --------------------------------------------------------------------------- static baselines


@pytest.mark.parametrize("name", STATIC)
def test_static_baseline_is_the_simulators(ps, name):
    """Each interval's channels are the simulator's policy's assignment on the instance of
    the same interval (ProblemSet.instance), type by type."""
    plane = Plane(ps, make_policy(name, ps))
    assert isinstance(plane.policy, BaselinePolicy) and plane.policy.name == name
    sim = make_policy_for(name, ps.spec, ps.dataset.topology)
    plane.replay(_windows(ps))
    for w, got in enumerate(plane.decided):
        inst = ps.instance(w)
        want = dict(zip(inst.catalog_index.tolist(), np.asarray(sim.assign(inst)).tolist()))
        assert got == want, f"{name}, interval {w}"
    assert sum(len(d) for d in plane.decided) > 0


@pytest.mark.parametrize("name", STATIC)
def test_first_channel_is_the_rule_for_a_lone_type(ps, name):
    """A type seen for the first time: the policy's rule applied to it alone (greedy, with
    no rate to plan with: RPC)."""
    pol = make_policy(name, ps)
    sim = make_policy_for(name, ps.spec, ps.dataset.topology)
    adapter = adapter_for(ps, None)
    cat = adapter.parser.catalog
    k = ps.spec.num_topics
    for t in range(len(cat)):
        c = pol.first_channel(adapter, t)
        assert 0 <= c <= k
        if name == "greedy":
            assert c == 0
            continue
        one = ps.instance(0).__class__.from_catalog(cat, np.array([t]), np.ones(1, np.int64),
                                                    k, ps.spec.controller_bw_bps,
                                                    ps.spec.controller_cpu)
        assert c == int(sim.assign(one)[0]), f"{name}: type {t}"
    if name == "rpc":
        assert all(pol.first_channel(adapter, t) == 0 for t in range(len(cat)))


def test_static_without_problems_and_unknown_names(ps):
    for name in ("rpc", "vita", "idcs", "greedy"):
        assert make_policy(name).name == name  # the registry's factories need no scenario
    with pytest.raises(ValueError, match=r"alcor.*needs the scenario"):
        make_policy("alcor")
    with pytest.raises(ValueError, match="unknown policy 'bogus'; known: rpc, vita, idcs, alcor, "
                                         "greedy, online_greedy"):
        make_policy("bogus", ps)
    with pytest.raises(ValueError, match="exact"):
        make_policy("exact", ps)  # a bound, not a controller's policy
    assert set(POLICIES) == {*STATIC, *ONLINE_DEFAULTS, "learned"}
    assert make_policy("learned").name == "learned"


# --------------------------------------------------------------------------- online heuristics


def _simulated(trace: OnlineTrace, decider, cost: OnlineCost):
    return OnlineSimulator(trace, cost).run(decider)


def _assert_same_run(plane: Plane, trace: OnlineTrace, res, id_of=lambda t: t) -> None:
    """The plane sent every interval's types on the simulator's channels, and the policy's
    scored terms are the simulator's."""
    assert len(res) == len(plane.decided) == len(plane.policy.terms)
    for w, r in enumerate(res):
        inst = trace.realised(w)
        want = {id_of(t): c for t, c in zip(inst.catalog_index.tolist(), r.channel.tolist())}
        assert plane.sent[w] == want, f"interval {w}"
        assert plane.policy.terms[w] == pytest.approx(r.as_dict()), f"interval {w}"


FORECASTER = str(Path(__file__).resolve().parents[1] / "results" / "forecaster"
                 / "send_forecaster.npz")


@pytest.mark.parametrize("name", ["online_greedy", "forecast_greedy", "forecast_drop"])
def test_online_heuristic_is_the_online_simulators(ps, name):
    """Replayed message by message through the adapter, the online heuristic places every
    new (and returning) type on its first message and plans each boundary exactly as the
    online simulator does with the same decider over the same trace; the session's scored
    terms are the simulator's. ``forecast_drop`` with the committed send forecaster."""
    cost = OnlineCost()
    extra = {"send_forecaster": FORECASTER} if name == "forecast_drop" else {}
    pol = make_policy(name, ps, extra)
    assert isinstance(pol, OnlinePolicy) and pol.relabel_topics is False
    plane = Plane(ps, pol)
    plane.replay(_windows(ps))
    trace = OnlineTrace.from_dataset(ps.dataset, ps.spec, "tiny")
    knobs = {**ONLINE_DEFAULTS[name][1], **extra}
    res = _simulated(trace, OnlineGreedy(cost=cost, name=name, **knobs), cost)
    _assert_same_run(plane, trace, res)
    assert sum(r["new_types"] for r in res) > 0  # placements happened
    assert sum(r["moved_types"] + r["subscribe_infos"] for r in res) > 0


def test_online_from_a_later_interval_maps_type_ids(ps):
    """Started at interval 4 (the adapter knows the scenario's whole catalogue, the session
    only what it has seen: other type ids), the decisions are the simulator's on the trace
    that starts there, with knobs given as parameters."""
    start = 4
    knobs = {"headroom": 0.2, "horizon": 1.0}
    cost = OnlineCost(w_subscribe=0.01, w_move=0.05)
    pol = make_policy("online_greedy", ps, {**knobs, "cost": {"w_subscribe": 0.01,
                                                              "w_move": 0.05}})
    plane = Plane(ps, pol)
    plane.replay(range(start, ps.parsed.num_windows))
    win = ps.parsed.message_window
    lo = int(np.searchsorted(win, start))
    step = round(ps.spec.interval_s * 1e9)
    meta = {**ps.dataset.meta, "start_ns": ps.parsed.t0_ns + start * step,
            "duration_s": (ps.parsed.num_windows - start) * ps.spec.interval_s}
    sub = Dataset(ps.dataset.topology, ps.dataset.trace.slice(lo, len(ps.dataset.trace)), meta)
    trace = OnlineTrace.from_dataset(sub, ps.spec, "tiny-late")
    cat, full = trace.parsed.catalog, plane.adapter.parser.catalog
    ids = {t: full.index_of_key(cat.keys[t]) for t in range(len(cat))}
    assert any(a != b for a, b in ids.items()), "the ids must differ for this test to bite"
    res = _simulated(trace, OnlineGreedy(cost=cost, **knobs), cost)
    _assert_same_run(plane, trace, res, ids.__getitem__)


def test_online_primed_like_the_testbed(ps):
    """The testbed primes with the first window's messages as the interval before, then
    replays from that window: the session sees the primed interval, its plan covers every
    type the adapter counted, and no type id is confused by the repeated messages."""
    pol = make_policy("online_greedy", ps)
    plane = Plane(ps, pol)
    tr, win = ps.dataset.trace, ps.parsed.message_window
    plane.prime(messages_from_trace(tr, np.flatnonzero(win == 2)))
    assert set(plane.decided[0]) == set(ps.instance(2).catalog_index.tolist())
    plane.replay(range(2, 6))
    assert len(pol.terms) == 5 and all(t["types"] > 0 for t in pol.terms)


def test_online_needs_every_message(ps):
    """A control plane that does not pass its messages to route() is refused at the next
    boundary, naming the problem (the decisions would not be the simulator's)."""
    pol = make_policy("online_greedy", ps)
    adapter = adapter_for(ps, None)
    tr = ps.dataset.trace
    for m in messages_from_trace(tr, np.flatnonzero(ps.parsed.message_window == 0)):
        adapter.submit(m)
    with pytest.raises(RuntimeError, match="must pass every message it counts to route"):
        pol.channels(adapter, adapter.close_interval())


def test_online_parameters_checked(ps, tmp_path):
    with pytest.raises(ValueError, match=r"online_greedy.*bad parameter.*headroom"):
        make_policy("online_greedy", ps, {"hedroom": 0.1})
    with pytest.raises(ValueError, match=r"forecast_drop.*send_forecaster"):
        make_policy("forecast_drop", ps)
    with pytest.raises(ValueError, match=r"forecast_greedy.*headroom"):
        make_policy("forecast_greedy", ps, {"headroom": 1.5})
    with pytest.raises(ValueError, match="cost"):
        make_policy("online_greedy", ps, {"cost": {"w_bogus": 1.0}})
    with pytest.raises(ValueError, match=r"online_learned.*bundle"):
        make_policy("online_learned", ps)
    with pytest.raises(ValueError, match=r"online_learned.*bundle"):
        make_policy("online_learned", ps, {"bundle": str(tmp_path / "none")})


def test_online_without_problems_plans_in_the_adapters_capacities(ps):
    """Without the scenario the decider plans in the controller adapter's C_b, C_p, K and T
    (the same here), so the decisions are the same."""
    a, b = Plane(ps, make_policy("online_greedy", ps)), Plane(ps, make_policy("online_greedy"))
    a.replay(range(4))
    b.replay(range(4))
    assert a.sent == b.sent and a.decided == b.decided


def test_online_learned_bundle_is_the_online_simulators(ps, tmp_path):
    """An online policy bundle (a seeded, untrained actor) through the same adapter class:
    the live decisions are the simulator's run of the bundle's decider."""
    torch = pytest.importorskip("torch")
    from agents.bundle_export import export_online_bundle
    from envs.dsmd.online_control import OBS_SIZE, KnobMap
    from serving.bundles.online import load_online_bundle

    torch.manual_seed(0)
    actor = torch.nn.Sequential(torch.nn.Linear(OBS_SIZE, 3), torch.nn.Tanh())
    cost = OnlineCost()
    path = export_online_bundle(actor, KnobMap(), cost, tmp_path / "bundle")
    pol = make_policy("online_learned", ps, {"bundle": str(path)})
    plane = Plane(ps, pol)
    plane.replay(_windows(ps))
    trace = OnlineTrace.from_dataset(ps.dataset, ps.spec, "tiny")
    res = _simulated(trace, load_online_bundle(path).decider("online_learned", cost), cost)
    _assert_same_run(plane, trace, res)
