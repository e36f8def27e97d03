"""DDPG + PER on RLlib (agents.ddpg): module, learner and the algorithm's replay loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from ray.rllib.core import DEFAULT_MODULE_ID  # noqa: E402
from ray.rllib.core.columns import Columns  # noqa: E402

from agents.ddpg.algorithm import DDPGConfig  # noqa: E402

# one worker builds the module's Ray algorithm once, rather than every worker its own
pytestmark = pytest.mark.xdist_group("ddpg")


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
    names = {type(t).__name__ for _, t in m.get_target_network_pairs()}
    assert len(m.get_target_network_pairs()) == 3 and names == {"Sequential", "MLPCritic"}
    assert all(not p.requires_grad for _, t in m.get_target_network_pairs()
               for p in t.parameters())


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
    # one write-back per learner call of n updates: n x 32 sampled transitions
    assert td.shape == idx.shape and idx.size % 32 == 0 and np.all(td >= 0)
    leaves = algo.replay.tree.leaves(idx)
    # the stored priority of every sampled transition is (|td| + eps)^alpha (the last
    # occurrence wins for a transition sampled twice)
    last = dict(zip(idx, td))
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
        actor_turn = learner.actor_turn(DEFAULT_MODULE_ID)
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
        if actor_turn:  # Polyak averaging with tau, after the critic's step
            tau = algo.config.tau
            for old, t, q_new in zip(tq, m.target_qf.parameters(), m.qf.parameters()):
                torch.testing.assert_close(t.detach(), (1 - tau) * old + tau * q_new.detach())
        seen.add(actor_turn)
    assert seen == {True, False}


def test_config_validation():
    with pytest.raises(ValueError, match="policy_delay"):
        DDPGConfig().environment("Pendulum-v1").training(policy_delay=0).validate()
    with pytest.raises(ValueError, match="noise_type"):
        DDPGConfig().environment("Pendulum-v1").training(noise_type="pink").validate()


def test_config_refuses_what_the_update_does_not_apply():
    base = DDPGConfig().environment("Pendulum-v1")
    with pytest.raises(ValueError, match="grad_clip"):
        base.training(grad_clip=1.0).validate()
    with pytest.raises(ValueError, match="num_learners must be 0 or 1, got 2"):
        DDPGConfig().environment("Pendulum-v1").learners(num_learners=2).validate()


def test_every_config_field_is_documented():
    """SB3-style: every field DDPGConfig sets has a ``:param name:`` entry in its docstring
    (``rollout_fragment_length`` is RLlib's env-runner setting)."""
    import inspect
    import re

    own = set(re.findall(r"self\.(\w+) =", inspect.getsource(DDPGConfig.__init__)))
    assert {"twin_q", "per_alpha", "tau", "n_step"} <= own
    doc = DDPGConfig.__doc__ or ""
    missing = sorted(f for f in own - {"rollout_fragment_length"}
                     if f":param {f}:" not in doc)
    assert not missing, f"DDPGConfig fields without a :param entry: {missing}"


def test_checkpoint_restores_the_replay_buffer(algo, tmp_path):
    """An RLlib checkpoint of DDPG carries its replay (transitions, priorities, cursor, RNG)
    and update counters, so a restored run continues on the same data."""
    while algo.updates_done == 0:
        algo.train()
    path = algo.save_to_path(str(tmp_path / "ckpt"))
    cfg = algo.config.copy(copy_frozen=False)
    other = cfg.build_algo()
    try:
        other.restore_from_path(path)
        a, b = algo.replay, other.replay
        assert len(b) == len(a) > 0 and b.pos == a.pos and b.added == a.added
        n = len(a)
        np.testing.assert_array_equal(b.obs[:n], a.obs[:n])
        np.testing.assert_array_equal(b.actions[:n], a.actions[:n])
        np.testing.assert_array_equal(b.priorities(), a.priorities())
        assert other.updates_done == algo.updates_done > 0
        np.testing.assert_array_equal(a.sample(16).indices, b.sample(16).indices)
        wa = algo.learner_group._learner.module[DEFAULT_MODULE_ID].pi[0].weight
        wb = other.learner_group._learner.module[DEFAULT_MODULE_ID].pi[0].weight
        torch.testing.assert_close(wa, wb)
    finally:
        other.stop()


def test_ou_noise_is_per_episode_correlated_and_off_in_evaluation():
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    from agents.ddpg.noise import OrnsteinUhlenbeckNoise

    ou = OrnsteinUhlenbeckNoise(theta=0.15, sigma=0.2, seed=0)
    e1, e2 = SingleAgentEpisode(), SingleAgentEpisode()
    zeros = torch.zeros(2, 3)
    assert ou(rl_module=None, batch={Columns.ACTIONS: zeros.clone()}, episodes=[e1, e2],
              explore=False)[Columns.ACTIONS].abs().sum() == 0
    xs = []
    for _ in range(2000):
        out = ou(rl_module=None, batch={Columns.ACTIONS: zeros.clone()}, episodes=[e1, e2],
                 explore=True)[Columns.ACTIONS]
        assert out.abs().max() <= 1.0
        xs.append(ou.state[e1.id_].copy())
    x = np.array(xs)[:, 0]
    lag1 = np.corrcoef(x[:-1], x[1:])[0, 1]
    assert 0.75 < lag1 < 0.95  # theory: 1 - theta = 0.85 (not white noise)
    assert abs(x.mean()) < 0.15  # mean-reverting to mu = 0
    e3 = SingleAgentEpisode()  # e2 ended, e3 starts fresh
    ou(rl_module=None, batch={Columns.ACTIONS: torch.zeros(2, 3)}, episodes=[e1, e3],
       explore=True)
    assert set(ou.state) == {e1.id_, e3.id_}
    assert np.abs(ou.state[e3.id_]).max() < 1.0  # one step from mu, not the old state


def _small_pendulum_algo(**training):
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    return (DDPGConfig().environment("Pendulum-v1")
            .env_runners(num_env_runners=0, rollout_fragment_length=8)
            .training(train_batch_size_per_learner=16, random_warmup_steps=16,
                      num_steps_sampled_before_learning_starts=16, fcnet_hiddens=[16, 16],
                      **training)
            .debugging(seed=0).build_algo())


def test_ddpg_trains_with_ou_noise():
    a = _small_pendulum_algo(noise_type="ou", ou_sigma=0.3)
    try:
        names = [type(c).__name__ for c in a.env_runner._module_to_env.connectors]
        assert names[0] == "OrnsteinUhlenbeckNoise"
        m = a.learner_group._learner.module[DEFAULT_MODULE_ID]
        assert m.noise_sigma(0) == 0.0  # the module's Gaussian noise is off
        while a.updates_done == 0:
            a.train()
        assert a.updates_done > 0 and a.env_runner._module_to_env.connectors[0].state
    finally:
        a.stop()


def test_per_channel_networks_are_permutation_equivariant():
    """Relabelling the channels permutes the actor's scores and leaves Q unchanged."""
    from agents.ddpg.networks import ChannelActor, ChannelCritic

    g, blocks, a = 8, 4, 7
    torch.manual_seed(0)
    actor = ChannelActor(g + blocks * a, a, blocks, [16, 16])
    critic = ChannelCritic(g + blocks * a, a, blocks, [16, 16])
    obs = torch.randn(5, g + blocks * a)
    act = torch.rand(5, a) * 2 - 1
    perm = torch.randperm(a)
    pobs = torch.cat([obs[:, :g], obs[:, g:].reshape(5, blocks, a)[:, :, perm].reshape(5, -1)], 1)
    torch.testing.assert_close(actor(pobs), actor(obs)[:, perm])
    torch.testing.assert_close(critic(pobs, act[:, perm]), critic(obs, act))
    assert actor(obs).abs().max() <= 1.0 and critic(obs, act).shape == (5,)
    with pytest.raises(ValueError, match="per_channel"):
        ChannelActor(10, a, blocks, [16])


@pytest.mark.parametrize("hidden", [[], [16], [16, 8]])
def test_per_channel_actor_paths_equal_the_reference_formulation(hidden):
    """The actor's batched path, its one-observation path (``_one``, what a bundle's
    actor_row.onnx is exported from) and its channel-major batch form with folded biases
    (``ChannelActorBatch``, what actor.onnx is exported from) all equal ``net`` applied to
    each channel's ``[globals, features_c]`` row, the textbook statement of the
    architecture."""
    from agents.ddpg.networks import ChannelActor, ChannelActorBatch, _per_channel

    g, blocks, a = 8, 4, 7
    torch.manual_seed(1)
    actor = ChannelActor(g + blocks * a, a, blocks, hidden)
    obs = torch.randn(6, g + blocks * a)
    with torch.no_grad():
        ref = actor.net(_per_channel(obs, g, blocks, a)).squeeze(-1)
        torch.testing.assert_close(actor(obs), ref)
        for i in range(obs.shape[0]):
            torch.testing.assert_close(actor(obs[i:i + 1]), ref[i:i + 1])
        if not hidden:
            with pytest.raises(ValueError, match="hidden layer"):
                ChannelActorBatch(actor)
            return
        batch_form = ChannelActorBatch(actor)
        torch.testing.assert_close(batch_form(obs), ref)
        torch.testing.assert_close(batch_form(obs[:1]), ref[:1])
        actor.net[0].weight.add_(1.0)  # a copy: later training does not reach it
        torch.testing.assert_close(batch_form(obs), ref)


def test_per_channel_architecture_needs_the_channel_observation():
    with pytest.raises(ValueError, match="architecture"):
        DDPGConfig().environment("Pendulum-v1").training(architecture="cnn").validate()


def test_demonstrations_enter_every_batch_with_behaviour_cloning():
    a = _small_pendulum_algo(demo_fraction=0.25, bc_weight=1.0)
    try:
        rng = np.random.default_rng(0)
        n = 40
        obs = rng.standard_normal((n, 3)).astype(np.float32)
        a.add_demonstrations(obs, np.full((n, 1), 0.5, np.float32), np.zeros(n, np.float32),
                             obs, np.zeros(n, np.float32))
        res = None
        while a.updates_done == 0:
            res = a.train()
        assert "bc_loss" in res["learners"][DEFAULT_MODULE_ID]
        cols, idx, rows = a._batch(16, 0.4, n=2)  # two minibatches of 12 replay + 4 demo rows
        assert cols["demo"].tolist() == ([0.0] * 12 + [1.0] * 4) * 2 and idx.size == 24
        assert rows.tolist() == [*range(12), *range(16, 28)]
        assert (cols[Columns.ACTIONS][cols["demo"] == 1] == 0.5).all()
        np.testing.assert_array_equal(cols[Columns.OBS][rows], a.replay.obs[idx])
        a.replay.update_priorities(idx, np.ones(24))  # the replay rows are one PER sample
    finally:
        a.stop()


def _trained_weights(seed: int) -> tuple[list[torch.Tensor], np.ndarray]:
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    from ray.tune.registry import register_env

    from agents.training import RLLIB_ENV_NAME, make_dsmd_env
    from envs.dsmd.scenarios import load_scenario

    register_env(RLLIB_ENV_NAME, make_dsmd_env)
    cfg = (DDPGConfig()
           .environment(RLLIB_ENV_NAME, env_config={
               "scenario_spec": load_scenario("tiny").to_dict(), "observation": "channel",
               "cache_dir": None})
           .env_runners(num_env_runners=0, rollout_fragment_length=8)
           .training(train_batch_size_per_learner=16, random_warmup_steps=32,
                     num_steps_sampled_before_learning_starts=32, fcnet_hiddens=[16, 16])
           .reporting(min_time_s_per_iteration=None, min_sample_timesteps_per_iteration=40)
           .td3().debugging(seed=seed))
    a = cfg.build_algo()
    try:
        for _ in range(3):  # a fixed amount of work (iterations are not time-bound)
            a.train()
        m = a.learner_group._learner.module[DEFAULT_MODULE_ID]
        weights = [p.detach().clone() for p in m.pi.parameters()]
        return weights, a.replay.rewards[:a.replay.count].copy()
    finally:
        a.stop()


@pytest.mark.slow  # two DDPG trainings; test_ddpg.py's other tests stay fast
def test_same_seed_same_training():
    """Two DDPG runs on the DSMD env with one seed give the same actor and the same data."""
    w0, r0 = _trained_weights(3)
    w1, r1 = _trained_weights(3)
    w2, _ = _trained_weights(4)
    np.testing.assert_array_equal(r0, r1)
    assert all(torch.equal(x, y) for x, y in zip(w0, w1))
    assert not all(torch.equal(x, y) for x, y in zip(w0, w2))


@pytest.mark.parametrize("noise_type", ["gaussian", "ou"])
def test_fast_connectors_match_rllibs_pipelines(noise_type):
    """The lean env-runner connectors sample exactly what RLlib's default pipelines sample
    (same seed: same observations, module actions stored in the episodes, rewards), on an
    action space that is not [-1, 1] so unsquashing matters, and with the learner stepping
    in between (weights synced to the runner)."""
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    stored = {}
    for fast in (True, False):
        cfg = (DDPGConfig().environment("Pendulum-v1")  # actions in [-2, 2]
               .env_runners(num_env_runners=0, rollout_fragment_length=16)
               .training(train_batch_size_per_learner=16, random_warmup_steps=32,
                         num_steps_sampled_before_learning_starts=32, fcnet_hiddens=[16],
                         noise_type=noise_type, fast_connectors=fast)
               .td3().debugging(seed=3))
        algo = cfg.build_algo()
        pipe = type(algo.env_runner._module_to_env.connectors[-1]).__name__
        assert (pipe == "ActionsToEnv") == fast
        for _ in range(6):  # one training step each: 16 env steps (+ updates after 32)
            algo.training_step()
        n = len(algo.replay)
        stored[fast] = (n, algo.replay.obs[:n].copy(), algo.replay.actions[:n].copy(),
                        algo.replay.rewards[:n].copy())
        algo.stop()
    (n1, o1, a1, r1), (n2, o2, a2, r2) = stored[True], stored[False]
    assert n1 == n2 == 96
    np.testing.assert_allclose(o1, o2, rtol=1e-6)
    np.testing.assert_allclose(a1, a2, rtol=1e-6)
    np.testing.assert_allclose(r1, r2, rtol=1e-6)
    assert np.abs(a1[32:]).max() <= 1.0  # module actions in [-1, 1] are what is stored
