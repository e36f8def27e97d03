"""DDPG with prioritized experience replay as an RLlib 2.60 algorithm (new API stack).

Lillicrap et al. (arXiv:1509.02971) with TD3's three tricks as flags (Fujimoto et al.,
arXiv:1802.09477: ``twin_q``, ``target_noise``, ``policy_delay``) and Schaul et al.'s
proportional prioritized replay (arXiv:1511.05952) -- the combination SMART Section V-D
uses ([31], [32]).

Built like RLlib's TQC on SAC, with one departure: RLlib's episode replay path builds one
episode object per sampled transition, which bounds training at one update per step, so
:meth:`DDPG.training_step` stores transitions in :class:`agents.ddpg.replay.PrioritizedReplay`
and feeds ``learner_group.update(batch=...)`` directly, with an exact update-to-data ratio,
random warm-up and beta annealed from ``per_beta`` to ``per_beta_final``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig, NotProvided
from ray.rllib.algorithms.sac.sac import SAC, SACConfig
from ray.rllib.connectors.env_to_module import EnvToModulePipeline
from ray.rllib.connectors.module_to_env import ModuleToEnvPipeline
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.multi_rl_module import MultiRLModule
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.env import INPUT_ENV_SINGLE_SPACES
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.annotations import override
from ray.rllib.utils.metrics import (
    ENV_RUNNER_RESULTS,
    LEARNER_RESULTS,
    NUM_ENV_STEPS_SAMPLED_LIFETIME,
    TD_ERROR_KEY,
)

from .connectors import ActionsToEnv, LatestObservationsToTensor, supports_fast_connectors
from .learner import DDPGTorchLearner
from .module import ARCHITECTURES, DDPGTorchRLModule
from .noise import OrnsteinUhlenbeckNoise
from .replay import PrioritizedReplay, linear_schedule
from .rllib_internals import (
    bump_weights_seq_no,
    local_learner,
    log_steps_trained,
    sample_episodes,
    uses_grad_scaler_or_lr_schedulers,
)
from .update import DEMO, WEIGHTS

__all__ = ["DDPG", "DDPGConfig"]

_MODULE_KEYS = ("twin_q", "exploration_noise", "exploration_noise_final",
                "exploration_noise_steps", "target_noise", "target_noise_clip", "fcnet_hiddens")


class DDPGConfig(SACConfig):
    """Configuration of :class:`DDPG`: DDPG (Lillicrap et al.) with TD3's tricks as flags
    (:meth:`td3` sets all three), proportional prioritized replay (Schaul et al.) and
    learning from demonstrations (DDPGfD). Set fields with :meth:`training`; what one gradient
    update does with them is :func:`agents.ddpg.update.ddpg_update`.

    Networks and exploration

    :param architecture: ``"mlp"``: the paper's networks, fully connected ReLU layers of
        sizes ``fcnet_hiddens``, tanh on the actor's output, the critic on ``[obs, action]``;
        ``"per_channel"``: one small network shared by every channel
        (:mod:`agents.ddpg.networks`, needs the environment's ``observation="channel"``)
    :param fcnet_hiddens: hidden layer sizes of the ``mlp`` actor and critic
    :param per_channel_hiddens: hidden layer sizes of the ``per_channel`` networks
    :param channel_blocks: feature blocks per channel in the ``per_channel`` observation
    :param noise_type: ``"gaussian"``: ``N(0, exploration_noise)`` added to the actor's
        action, clipped to [-1, 1]; ``"ou"``: Ornstein-Uhlenbeck noise per episode (Lillicrap
        et al., Section 7), a module-to-env connector
    :param exploration_noise: standard deviation of the Gaussian exploration noise
    :param exploration_noise_final: the Gaussian noise's standard deviation after
        ``exploration_noise_steps`` (linear annealing); ``None``: no annealing
    :param exploration_noise_steps: environment steps over which the noise anneals
    :param ou_theta: mean reversion of the Ornstein-Uhlenbeck noise
    :param ou_sigma: scale of the Ornstein-Uhlenbeck noise
    :param random_warmup_steps: environment steps with uniformly random actions before the
        actor acts

    The update

    :param actor_lr: Adam learning rate of the actor
    :param critic_lr: Adam learning rate of the critic(s)
    :param critic_weight_decay: L2 weight decay of the critic(s) (Lillicrap et al. used
        1e-2)
    :param gamma: discount factor
    :param tau: Polyak coefficient of the soft target updates,
        ``target <- target + tau (main - target)``
    :param twin_q: two critics and the minimum of their targets (TD3's clipped double Q)
    :param target_noise: standard deviation of the noise on the target action (TD3's
        target policy smoothing); 0: none
    :param target_noise_clip: the target noise is clipped to ``[-clip, clip]``
    :param policy_delay: the actor and the targets move every ``policy_delay``-th update
        (TD3: 2); the critic on every one
    :param critic_warmup_updates: critic-only updates before the actor's first
    :param train_batch_size_per_learner: rows per gradient update
    :param updates_per_step: gradient updates per environment step sampled (exact over
        time: fractional credit carries over)
    :param num_steps_sampled_before_learning_starts: environment steps before the first
        update

    Replay

    :param buffer_capacity: transitions kept (the oldest are overwritten)
    :param prioritized_replay: proportional prioritized replay; ``False``: uniform, unit
        weights
    :param per_alpha: priority exponent (0: uniform)
    :param per_beta: importance-sampling exponent at the start
    :param per_beta_final: the exponent after ``per_beta_steps`` environment steps (linear)
    :param per_beta_steps: environment steps over which beta anneals
    :param per_eps: added to ``|TD error|`` so no priority is zero
    :param n_step: must be 1: the replay stores one-step transitions

    Demonstrations (:meth:`DDPG.add_demonstrations`)

    :param demo_fraction: share of every batch drawn, uniformly, from the demonstrations
    :param bc_weight: weight of the Q-filtered behaviour-cloning term in the actor's loss
        (Nair et al.); 0: none
    :param bc_pretrain_steps: supervised actor steps on the demonstrations before
        reinforcement learning (:meth:`DDPG.pretrain_actor`)

    Sampling

    :param fast_connectors: the lean env-runner connectors of :mod:`agents.ddpg.connectors`
        in place of RLlib's default pipelines (same samples, fewer calls per step), where
        they apply

    Learner

    :param cuda_graphs: on a GPU learner (``num_gpus_per_learner=1``), each update replays a
        captured CUDA graph of the eager update (:mod:`agents.ddpg.graphed`); off: eager
        updates. No effect on a CPU learner

    Other fields of ``SACConfig`` (its entropy settings, its replay buffer config) are not
    read. ``grad_clip``, torch learning-rate schedulers and gradient scalers are refused by
    :meth:`validate`, as is more than one learner (``num_learners > 1``).
    """

    def __init__(self, algo_class=None) -> None:
        super().__init__(algo_class=algo_class or DDPG)
        self.twin_q = False
        self.policy_delay = 1
        self.noise_type = "gaussian"
        self.ou_theta = 0.15
        self.ou_sigma = 0.2
        self.exploration_noise = 0.1
        self.exploration_noise_final = None
        self.exploration_noise_steps = 0
        self.target_noise = 0.0
        self.target_noise_clip = 0.5
        self.actor_lr = 1e-3
        self.critic_lr = 1e-3
        self.critic_weight_decay = 0.0
        self.tau = 5e-3
        self.gamma = 0.99
        self.fcnet_hiddens = [256, 256]
        self.architecture = "mlp"
        self.demo_fraction = 0.25
        self.bc_weight = 0.0
        self.bc_pretrain_steps = 0
        self.critic_warmup_updates = 0
        self.per_channel_hiddens = [64, 64]
        self.channel_blocks = 4
        self.prioritized_replay = True
        self.per_alpha = 0.6
        self.per_beta = 0.4
        self.per_beta_final = 1.0
        self.per_beta_steps = 100_000
        self.per_eps = 1e-6
        self.buffer_capacity = 1_000_000
        self.random_warmup_steps = 1_000
        self.num_steps_sampled_before_learning_starts = 1_000
        self.updates_per_step = 1.0
        self.train_batch_size_per_learner = 256
        self.rollout_fragment_length = 32
        self.n_step = 1
        self.fast_connectors = True
        self.cuda_graphs = True

    @override(SACConfig)
    def training(self, *, twin_q=NotProvided, policy_delay=NotProvided,
                 noise_type=NotProvided, ou_theta=NotProvided, ou_sigma=NotProvided,
                 architecture=NotProvided, per_channel_hiddens=NotProvided,
                 demo_fraction=NotProvided, bc_weight=NotProvided,
                 bc_pretrain_steps=NotProvided, critic_warmup_updates=NotProvided,
                 channel_blocks=NotProvided,
                 exploration_noise=NotProvided, exploration_noise_final=NotProvided,
                 exploration_noise_steps=NotProvided, target_noise=NotProvided,
                 target_noise_clip=NotProvided, critic_weight_decay=NotProvided,
                 fcnet_hiddens=NotProvided, prioritized_replay=NotProvided,
                 per_alpha=NotProvided, per_beta=NotProvided, per_beta_final=NotProvided,
                 per_beta_steps=NotProvided, per_eps=NotProvided, buffer_capacity=NotProvided,
                 random_warmup_steps=NotProvided, updates_per_step=NotProvided,
                 fast_connectors=NotProvided, cuda_graphs=NotProvided,
                 **kwargs) -> DDPGConfig:
        super().training(**kwargs)
        settings = {"twin_q": twin_q, "policy_delay": policy_delay, "noise_type": noise_type,
                    "ou_theta": ou_theta, "ou_sigma": ou_sigma, "architecture": architecture,
                    "demo_fraction": demo_fraction, "bc_weight": bc_weight,
                    "bc_pretrain_steps": bc_pretrain_steps,
                    "critic_warmup_updates": critic_warmup_updates,
                    "per_channel_hiddens": per_channel_hiddens, "channel_blocks": channel_blocks,
                    "exploration_noise": exploration_noise,
                    "exploration_noise_final": exploration_noise_final,
                    "exploration_noise_steps": exploration_noise_steps,
                    "target_noise": target_noise, "target_noise_clip": target_noise_clip,
                    "critic_weight_decay": critic_weight_decay, "fcnet_hiddens": fcnet_hiddens,
                    "prioritized_replay": prioritized_replay, "per_alpha": per_alpha,
                    "per_beta": per_beta, "per_beta_final": per_beta_final,
                    "per_beta_steps": per_beta_steps, "per_eps": per_eps,
                    "buffer_capacity": buffer_capacity, "random_warmup_steps": random_warmup_steps,
                    "updates_per_step": updates_per_step, "fast_connectors": fast_connectors,
                    "cuda_graphs": cuda_graphs}
        for k, v in settings.items():
            if v is not NotProvided:
                setattr(self, k, v)
        return self

    def td3(self) -> DDPGConfig:
        """TD3's defaults: twin critics, target smoothing (0.2, clip 0.5), actor delay 2."""
        return self.training(twin_q=True, target_noise=0.2, target_noise_clip=0.5,
                             policy_delay=2)

    @override(SACConfig)
    def validate(self) -> None:
        super().validate()
        problems = []
        if self.policy_delay < 1:
            problems.append(f"policy_delay must be >= 1, got {self.policy_delay}")
        if self.architecture not in ARCHITECTURES:
            problems.append(f"architecture must be one of {ARCHITECTURES}, got "
                            f"{self.architecture!r}")
        if not 0 <= self.demo_fraction < 1 or self.bc_weight < 0:
            problems.append("demo_fraction must be in [0, 1) and bc_weight >= 0")
        if self.noise_type not in ("gaussian", "ou"):
            problems.append(f"noise_type must be 'gaussian' or 'ou', got {self.noise_type!r}")
        if self.n_step != 1:
            problems.append("n_step > 1 is not supported by this replay (use 1)")
        if self.updates_per_step <= 0:
            problems.append(f"updates_per_step must be positive, got {self.updates_per_step}")
        if not 0 <= self.per_beta <= 1 or not 0 <= self.per_beta_final <= 1:
            problems.append("per_beta and per_beta_final must be in [0, 1]")
        if self.grad_clip is not None:
            problems.append(f"grad_clip is not supported (got {self.grad_clip}): leave it None")
        if uses_grad_scaler_or_lr_schedulers(self):
            problems.append("torch gradient scalers and learning-rate schedulers are not "
                            "supported: leave them unset")
        if self.num_learners > 1:
            problems.append(f"num_learners must be 0 or 1, got {self.num_learners}: one "
                            "learner runs the update (a GPU learner: num_gpus_per_learner=1)")
        if problems:
            raise ValueError("DDPGConfig: " + "; ".join(problems))

    def _single_spaces(self, env, spaces) -> tuple[Any, Any]:
        if env is not None:
            return (getattr(env, "single_observation_space", env.observation_space),
                    getattr(env, "single_action_space", env.action_space))
        if spaces is not None and INPUT_ENV_SINGLE_SPACES in spaces:
            return tuple(spaces[INPUT_ENV_SINGLE_SPACES])
        return self.observation_space, self.action_space

    def _fast(self, custom: Any, default_on: bool, obs_space: Any, act_space: Any) -> bool:
        """Whether the lean connectors (:mod:`agents.ddpg.connectors`) replace RLlib's
        default pipeline: on by ``fast_connectors``, with no user connector, RLlib's defaults
        on, one agent and flat Box spaces."""
        return (self.fast_connectors and custom is None and default_on
                and not self.is_multi_agent and supports_fast_connectors(obs_space, act_space))

    @override(SACConfig)
    def build_env_to_module_connector(self, env=None, spaces=None, device=None):
        """RLlib's pipeline, or :class:`LatestObservationsToTensor` (see :meth:`_fast`)."""
        obs_space, act_space = self._single_spaces(env, spaces)
        if not self._fast(self._env_to_module_connector,
                          self.add_default_connectors_to_env_to_module_pipeline,
                          obs_space, act_space):
            return super().build_env_to_module_connector(env, spaces, device)
        return EnvToModulePipeline(
            input_observation_space=obs_space, input_action_space=act_space,
            connectors=[LatestObservationsToTensor(obs_space, act_space, device=device)])

    @override(SACConfig)
    def build_module_to_env_connector(self, env=None, spaces=None):
        """RLlib's pipeline or :class:`ActionsToEnv` (see :meth:`_fast`), led by
        :class:`OrnsteinUhlenbeckNoise` when ``noise_type='ou'``."""
        obs_space, act_space = self._single_spaces(env, spaces)
        if self._fast(self._module_to_env_connector,
                      self.add_default_connectors_to_module_to_env_pipeline,
                      obs_space, act_space):
            pipeline = ModuleToEnvPipeline(
                input_observation_space=obs_space, input_action_space=act_space,
                connectors=[ActionsToEnv(obs_space, act_space,
                                         normalize=self.normalize_actions,
                                         clip=self.clip_actions)])
        else:
            pipeline = super().build_module_to_env_connector(env, spaces)
        if self.noise_type == "ou":
            pipeline.prepend(OrnsteinUhlenbeckNoise(theta=self.ou_theta, sigma=self.ou_sigma,
                                                    seed=self.seed))
        return pipeline

    @override(SACConfig)
    def get_default_rl_module_spec(self) -> RLModuleSpec:
        return RLModuleSpec(module_class=DDPGTorchRLModule)

    @override(SACConfig)
    def get_default_learner_class(self):
        return DDPGTorchLearner

    @property
    @override(AlgorithmConfig)
    def _model_config_auto_includes(self) -> dict[str, Any]:
        final = (self.exploration_noise if self.exploration_noise_final is None
                 else self.exploration_noise_final)
        if self.noise_type != "gaussian":
            final = 0.0
        return super()._model_config_auto_includes | {
            "twin_q": self.twin_q,
            # with OU noise (a connector) the module's Gaussian noise is off
            "exploration_noise": self.exploration_noise if self.noise_type == "gaussian" else 0.0,
            "exploration_noise_final": final,
            "exploration_noise_steps": self.exploration_noise_steps,
            "target_noise": self.target_noise, "target_noise_clip": self.target_noise_clip,
            "fcnet_hiddens": list(self.fcnet_hiddens), "architecture": self.architecture,
            "per_channel_hiddens": list(self.per_channel_hiddens),
            "channel_blocks": self.channel_blocks}


def clone_actor(learner: Any, obs: np.ndarray, actions: np.ndarray, rows: np.ndarray,
                lr: float) -> float:
    """The behaviour-cloning steps of :meth:`DDPG.pretrain_actor` on ``learner``'s module:
    one Adam step per row of ``rows`` (indices into the demonstrations ``obs``, ``actions``),
    then the target actor set to the actor. Returns the last loss."""
    module = learner.module[DEFAULT_MODULE_ID]
    dev = next(module.pi.parameters()).device
    opt = torch.optim.Adam(module.pi.parameters(), lr=lr)
    loss = torch.zeros(())
    for idx in rows:
        out = module.pi(torch.as_tensor(obs[idx], device=dev))
        loss = (out - torch.as_tensor(actions[idx], device=dev)).pow(2).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    module.target_pi.load_state_dict(module.pi.state_dict())
    return float(loss.detach())


class DDPG(SAC):
    """DDPG / TD3 with fast prioritized replay (see the module docstring)."""

    MAX_UPDATES_PER_CALL = 32

    @classmethod
    @override(SAC)
    def get_default_config(cls) -> DDPGConfig:
        return DDPGConfig()

    @override(SAC)
    def setup(self, config) -> None:
        super().setup(config)
        cfg = self.config
        env = self.env_runner.env if self.env_runner else None
        obs_space = env.single_observation_space if env is not None else None
        act_space = env.single_action_space if env is not None else None
        if obs_space is None:  # remote runners sample: read the spaces from the module spec
            spaces = self.env_runner_group.get_spaces()
            obs_space, act_space = spaces["__env_single__"]
        self._act_low = np.asarray(act_space.low, dtype=np.float32)
        self._act_high = np.asarray(act_space.high, dtype=np.float32)
        self.replay = PrioritizedReplay(
            int(cfg.buffer_capacity), int(np.prod(obs_space.shape)),
            int(np.prod(act_space.shape)), alpha=cfg.per_alpha, beta=cfg.per_beta,
            eps=cfg.per_eps, prioritized=cfg.prioritized_replay, seed=int(cfg.seed or 0))
        self.demos: PrioritizedReplay | None = None  # see add_demonstrations
        self._beta = linear_schedule(cfg.per_beta, cfg.per_beta_final, cfg.per_beta_steps)
        self._update_credit = 0.0
        self.updates_done = 0
        if cfg.seed is not None:  # RLlib does not seed the spaces its random warm-up samples
            seed = int(cfg.seed)

            def seed_spaces(runner) -> None:
                if runner.env is None:  # the driver's runner when remote runners sample
                    return
                i = int(getattr(runner, "worker_index", 0))
                runner.env.action_space.seed(seed + i)
                runner.env.single_action_space.seed(seed + i)

            self.env_runner_group.foreach_env_runner(seed_spaces, local_env_runner=True)

    # ------------------------------------------------------------------ checkpoints
    REPLAY_FILE = "replay.npz"

    @override(SAC)
    def save_to_path(self, path=None, *args, **kwargs) -> str:
        """RLlib's checkpoint plus the replay buffer (``replay.npz``) and the update counters,
        so a restored run continues with the same data and priorities."""
        path = super().save_to_path(path, *args, **kwargs)
        self.replay.save(Path(path) / self.REPLAY_FILE)
        (Path(path) / "ddpg_counters.json").write_text(json.dumps(
            {"updates_done": self.updates_done, "update_credit": self._update_credit}))
        return path

    @override(SAC)
    def restore_from_path(self, path, *args, **kwargs) -> None:
        super().restore_from_path(path, *args, **kwargs)
        replay = Path(path) / self.REPLAY_FILE
        if replay.is_file():
            self.replay.load(replay)
            c = json.loads((Path(path) / "ddpg_counters.json").read_text())
            self.updates_done, self._update_credit = c["updates_done"], c["update_credit"]

    # ------------------------------------------------------------------ demonstrations
    def add_demonstrations(self, obs: np.ndarray, actions: np.ndarray, rewards: np.ndarray,
                           next_obs: np.ndarray, terminateds: np.ndarray) -> None:
        """Keep demonstration transitions (actions in the module's [-1, 1] space) apart from
        the replay: every batch then draws ``demo_fraction`` of its rows from them,
        uniformly, for the critic's TD loss and the actor's behaviour-cloning term
        (DDPGfD, Vecerik et al.; ``bc_weight``)."""
        n = int(np.asarray(obs).shape[0])
        if n == 0:
            raise ValueError("no demonstration transitions")
        self.demos = PrioritizedReplay(n, self.replay.obs.shape[1], self.replay.actions.shape[1],
                                       prioritized=False, seed=int(self.config.seed or 0) + 1)
        self.demos.add(obs, np.clip(actions, -1.0, 1.0), rewards, next_obs, terminateds)

    def pretrain_actor(self, steps: int | None = None, lr: float | None = None) -> float:
        """Behaviour cloning before reinforcement learning: ``steps`` Adam steps of the
        actor on the demonstrations (squared error to the demonstrated action), then the
        target actor and the env runners get the new weights. Returns the last loss. The
        batches are drawn here; the steps run where the learner is, in this process or in a
        remote learner (``LearnerGroup.foreach_learner``)."""
        if self.demos is None:
            raise ValueError("pretrain_actor() needs add_demonstrations() first")
        steps = int(self.config.bc_pretrain_steps if steps is None else steps)
        bs = int(self.config.train_batch_size_per_learner)
        rows = [self.demos.sample(bs).indices for _ in range(steps)]  # uniform: nothing back
        n = self.demos.count
        args = (self.demos.obs[:n], self.demos.actions[:n], np.stack(rows) if rows else
                np.zeros((0, bs), np.int64), float(lr or self.config.actor_lr))
        # the local learner, or the remote one (the call's error, if any, raised here)
        loss = float(next(iter(self.learner_group.foreach_learner(
            lambda learner: clone_actor(learner, *args)))).get())
        self.env_runner_group.sync_weights(from_worker_or_learner_group=self.learner_group,
                                           policies=[DEFAULT_MODULE_ID], inference_only=True)
        return loss

    def _batch(self, batch_size: int, beta: float, n: int = 1
               ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """``n`` training minibatches of ``batch_size`` rows, concatenated: each is replay rows
        (one PER sample for all ``n``) then demonstration rows. Returns the columns, the
        replay indices, and the rows of the columns that hold them (for the TD errors)."""
        n_demo = (round(batch_size * self.config.demo_fraction)
                  if self.demos is not None else 0)
        n_rep = batch_size - n_demo
        b = self.replay.sample(n_rep * n, beta=beta)
        keys = (Columns.OBS, Columns.ACTIONS, Columns.REWARDS, Columns.NEXT_OBS,
                Columns.TERMINATEDS, WEIGHTS)
        rep = dict(zip(keys, (b.obs, b.actions, b.rewards, b.next_obs, b.terminateds,
                              b.weights)))
        rows = (np.arange(n)[:, None] * batch_size + np.arange(n_rep)).reshape(-1)
        if self.demos is None:
            return rep, b.indices, rows
        d = self.demos.sample(n_demo * n) if n_demo else None  # uniform: nothing to write back
        dem = dict(zip(keys, (d.obs, d.actions, d.rewards, d.next_obs, d.terminateds,
                              d.weights))) if d is not None else None
        cols = {}
        for k in keys:
            r = rep[k].reshape(n, n_rep, *rep[k].shape[1:])
            if dem is not None:
                r = np.concatenate([r, dem[k].reshape(n, n_demo, *dem[k].shape[1:])], axis=1)
            cols[k] = r.reshape(n * batch_size, *rep[k].shape[1:])
        cols[DEMO] = np.tile(np.r_[np.zeros(n_rep, np.float32), np.ones(n_demo, np.float32)], n)
        return cols, b.indices, rows

    # ------------------------------------------------------------------ replay I/O
    def _store(self, episodes, random_actions: bool) -> int:
        n = 0
        for ep in episodes:
            t = len(ep)
            if t == 0:
                continue
            obs = np.asarray(ep.get_observations(), dtype=np.float32).reshape(t + 1, -1)
            act = np.asarray(ep.get_actions(), dtype=np.float32).reshape(t, -1)
            if random_actions:  # env-space samples -> the module's [-1, 1] space
                act = 2.0 * (act - self._act_low) / (self._act_high - self._act_low) - 1.0
            term = np.zeros(t, dtype=np.float32)
            if ep.is_terminated:
                term[-1] = 1.0
            self.replay.add(obs[:-1], np.clip(act, -1.0, 1.0),
                            np.asarray(ep.get_rewards(), dtype=np.float32), obs[1:], term)
            n += t
        return n

    @override(SAC)
    def training_step(self) -> None:
        cfg = self.config
        steps = self.metrics.peek((ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME),
                                  default=0)
        random_actions = steps < cfg.random_warmup_steps
        episodes, runner_metrics = sample_episodes(self, random_actions=random_actions)
        self.metrics.aggregate(runner_metrics, key=ENV_RUNNER_RESULTS)
        new = self._store(episodes, random_actions)
        steps = self.metrics.peek((ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME),
                                  default=0)
        if steps < cfg.num_steps_sampled_before_learning_starts or len(self.replay) == 0:
            return
        self._update_credit += new * cfg.updates_per_step
        n_updates = int(self._update_credit)
        self._update_credit -= n_updates
        self.run_updates(n_updates, steps)

    def run_updates(self, n_updates: int, steps: int, batch_size: int | None = None) -> None:
        """``n_updates`` gradient updates of ``batch_size`` rows each (default
        ``train_batch_size_per_learner``: prioritized samples, the learner's update, the new
        priorities written back), then the actor's weights to the env runners; ``steps``: env
        steps sampled so far (the PER beta schedule and the learner's timesteps)."""
        batch_size = int(batch_size or self.config.train_batch_size_per_learner)
        done = 0
        while done < n_updates:
            # up to MAX_UPDATES_PER_CALL updates in one learner call, one minibatch each (in
            # order, not shuffled): the learner's per-call overhead is paid once; the
            # priorities of all their transitions are written back after the call
            n = min(n_updates - done, self.MAX_UPDATES_PER_CALL)
            cols, indices, rows = self._batch(batch_size, self._beta(steps), n)
            timesteps = {NUM_ENV_STEPS_SAMPLED_LIFETIME: steps}
            if self.learner_group.is_local:
                results = self._local_update(cols, n, batch_size, timesteps)
            else:
                batch = MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch(cols)},
                                        env_steps=batch_size * n)
                results = self.learner_group.update(
                    batch=batch, minibatch_size=batch_size, num_epochs=1,
                    shuffle_batch_per_epoch=False, timesteps=timesteps)
            # one float32 array per call (the series is a list of per-update lists; RLlib's
            # convert_to_numpy walks it element by element)
            td = np.concatenate([np.asarray(r[DEFAULT_MODULE_ID].pop(TD_ERROR_KEY).peek(),
                                            dtype=np.float32).reshape(-1) for r in results])
            self.replay.update_priorities(indices, td[rows])
            self.metrics.aggregate(results, key=LEARNER_RESULTS)
            self.updates_done += n
            done += n
        if n_updates and not self._sync_local_weights():
            self.env_runner_group.sync_weights(from_worker_or_learner_group=self.learner_group,
                                               policies=[DEFAULT_MODULE_ID],
                                               inference_only=True)

    def _local_update(self, cols: dict[str, np.ndarray], n: int, batch_size: int,
                      timesteps: dict[str, Any]) -> list[dict]:
        """``Learner.update`` for a local learner (``num_learners=0``), without its
        per-minibatch machinery: the ``n`` minibatches become tensors on the learner's device
        once and go through :meth:`DDPGTorchLearner.update_minibatch` one after another, in
        order. What ``update`` logs per minibatch (trained-step counters) is logged once for
        the call, summed; ``before/after_gradient_based_update`` run once, as in ``update``.
        Returns the reduced metrics in ``learner_group.update``'s format."""
        learner = local_learner(self)
        learner.before_gradient_based_update(timesteps=timesteps)
        bump_weights_seq_no(learner)
        dev = learner.device
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v)).to(dev)
                   for k, v in cols.items()}
        losses: dict = {}
        for i in range(n):
            mb = {k: v[i * batch_size:(i + 1) * batch_size] for k, v in tensors.items()}
            losses = learner.update_minibatch({DEFAULT_MODULE_ID: mb})
        log_steps_trained(learner, MultiAgentBatch(
            {DEFAULT_MODULE_ID: SampleBatch({Columns.REWARDS: cols[Columns.REWARDS]})},
            env_steps=n * batch_size))
        for mid, loss in losses.items():
            learner.metrics.log_value((mid, learner.TOTAL_LOSS_KEY), loss, window=1)
        learner.after_gradient_based_update(timesteps=timesteps)
        return [learner.metrics.reduce()]

    def _sync_local_weights(self) -> bool:
        """With a local learner and only the local env runner (``num_learners=0``,
        ``num_env_runners=0``), copy the actor's weights tensor to tensor, in place. RLlib's
        ``sync_weights`` converts the state to numpy, puts it in the object store even with no
        remote runner, and converts it back, on every call. Returns False (nothing done)
        in any other layout, where ``sync_weights`` is the way."""
        runner = self.env_runner_group.local_env_runner
        if (runner is None or self.env_runner_group.num_remote_workers() > 0
                or not self.learner_group.is_local):
            return False
        dst = runner.module
        if isinstance(dst, MultiRLModule):
            dst = dst[DEFAULT_MODULE_ID]
        src = dict(local_learner(self).module[DEFAULT_MODULE_ID].unwrapped()
                   .named_parameters())
        dst_params = list(dst.unwrapped().named_parameters())
        if not dst_params or any(name not in src for name, _ in dst_params):
            return False
        with torch.no_grad():
            torch._foreach_copy_([p for _, p in dst_params], [src[n] for n, _ in dst_params])
        return True
