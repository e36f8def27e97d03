"""DDPG + PER on RLlib (agents.ddpg): module, learner and the algorithm's replay loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from ray.rllib.core import DEFAULT_MODULE_ID  # noqa: E402
from ray.rllib.core.columns import Columns  # noqa: E402

from agents.ddpg.algorithm import DDPGConfig  # noqa: E402


@pytest.fixture(scope="module")
def algo():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    cfg = (DDPGConfig().environment("Pendulum-v1")
           .env_runners(num_env_runners=0, rollout_fragment_length=8)
           .training(train_batch_size_per_learner=32, random_warmup_steps=64,
                     num_steps_sampled_before_learning_starts=64, fcnet_hiddens=[32, 32])
           .td3().debugging(seed=0))
    a = cfg.build_algo()
    yield a
    a.stop()
    ray.shutdown()


def test_module_shapes_bounds_and_targets(algo):
    learner = algo.learner_group._learner
    m = learner.module[DEFAULT_MODULE_ID]
    obs = torch.randn(5, 3) * 10
    act = m.forward_inference({Columns.OBS: obs})[Columns.ACTIONS]
    assert act.shape == (5, 1) and act.abs().max() <= 1.0
    expl = m.forward_exploration({Columns.OBS: obs}, t=0)[Columns.ACTIONS]
    assert expl.abs().max() <= 1.0
    out = m.forward_train({Columns.OBS: obs, Columns.ACTIONS: act,
                           Columns.NEXT_OBS: obs})
    assert {"qf_preds", "qf_twin_preds", "q_target_next", "q_pi"} <= set(out)
    names = {type(t).__name__ for _, t in m.get_target_network_pairs()}
    assert len(m.get_target_network_pairs()) == 3 and names == {"Sequential"}


def test_priorities_follow_td_errors_of_the_sampled_transitions(algo):
    calls = []
    real = algo.replay.update_priorities

    def spy(indices, td):
        calls.append((np.array(indices), np.array(td)))
        real(indices, td)

    algo.replay.update_priorities = spy
    try:
        while not calls:
            algo.train()
    finally:
        algo.replay.update_priorities = real
    idx, td = calls[-1]
    assert td.shape == idx.shape == (32,) and np.all(td >= 0)
    leaves = algo.replay.tree.leaves(idx)
    # the stored priority of every sampled transition is (|td| + eps)^alpha (the last
    # occurrence wins for a transition sampled twice)
    last = {i: t for i, t in zip(idx, td)}
    expected = np.array([(last[i] + algo.replay.eps) ** algo.replay.alpha for i in idx])
    np.testing.assert_allclose(leaves, expected, rtol=1e-6)
    assert algo.updates_done >= 1


def test_td3_delays_actor_and_target_updates(algo):
    from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
    from ray.rllib.utils.metrics import NUM_ENV_STEPS_SAMPLED_LIFETIME, TD_ERROR_KEY

    while algo.updates_done == 0:
        algo.train()
    learner = algo.learner_group._learner
    m = learner.module[DEFAULT_MODULE_ID]
    seen = set()
    for _ in range(4):
        b = algo.replay.sample(32)
        batch = MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch({
            Columns.OBS: b.obs, Columns.ACTIONS: b.actions, Columns.REWARDS: b.rewards,
            Columns.NEXT_OBS: b.next_obs, Columns.TERMINATEDS: b.terminateds,
            "weights": b.weights})}, env_steps=32)
        actor_turn = learner._updates[DEFAULT_MODULE_ID] % 2 == 0
        pi = [p.detach().clone() for p in m.pi.parameters()]
        q = [p.detach().clone() for p in m.qf.parameters()]
        tq = [p.detach().clone() for p in m.target_qf.parameters()]
        res = algo.learner_group.update(batch=batch,
                                        timesteps={NUM_ENV_STEPS_SAMPLED_LIFETIME: 10**6})
        algo.replay.update_priorities(
            b.indices, np.asarray(res[0][DEFAULT_MODULE_ID].pop(TD_ERROR_KEY).peek()).ravel())
        moved = lambda old, net: any(not torch.equal(x, y)  # noqa: E731
                                     for x, y in zip(old, net.parameters()))
        assert moved(q, m.qf)  # the critic learns on every update
        assert moved(pi, m.pi) == actor_turn  # the actor every second one (policy_delay=2)
        assert moved(tq, m.target_qf) == actor_turn  # and the targets with it
        seen.add(actor_turn)
    assert seen == {True, False}


def test_config_validation():
    with pytest.raises(ValueError, match="policy_delay"):
        DDPGConfig().environment("Pendulum-v1").training(policy_delay=0).validate()
