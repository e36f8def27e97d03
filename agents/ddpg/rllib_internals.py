"""Every private attribute of RLlib that this project reaches, in one place.

Written against RLlib 2.60 (``ray[rllib]==2.60.*``, the version ``requirements.lock`` pins),
new API stack. Each function says which private attribute it reads and what public API is
missing. ``tests/test_rllib_internals.py`` checks that every attribute still exists on the
installed RLlib's classes and fails with the installed version and the attribute that moved;
when it fails after an upgrade, this module is the one to change.

Why the trainer needs them: :meth:`agents.ddpg.algorithm.DDPG.training_step` runs several
gradient updates per learner call on the local learner (``num_learners=0``) without
``Learner.update``'s per-minibatch machinery, and copies the actor's weights to the local env
runner tensor by tensor; ``DDPGConfig.validate`` refuses the torch options that its update
(:func:`agents.ddpg.update.ddpg_update`) does not apply. RLlib's hooks that our classes
override (``Learner.compute_gradients``,
``AlgorithmConfig._model_config_auto_includes``, ``RLModule._forward_train``, ...) are marked
``@override`` where they are overridden.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "PRIVATE_ATTRIBUTES",
    "bump_weights_seq_no",
    "local_learner",
    "log_steps_trained",
    "sample_episodes",
    "uses_grad_scaler_or_lr_schedulers",
]

RLLIB_VERSION = "2.60"

# (class path, attribute, how it is looked for): "class" = defined on the class (a method),
# "instance" = set by the class's ``__init__`` (read from its source), "parameter" = a
# keyword of the function; every entry is checked by tests/test_rllib_internals.py
PRIVATE_ATTRIBUTES: tuple[tuple[str, str, str], ...] = (
    ("ray.rllib.core.learner.learner_group.LearnerGroup", "_learner", "instance"),
    ("ray.rllib.core.learner.learner.Learner", "_weights_seq_no", "instance"),
    ("ray.rllib.core.learner.learner.Learner", "_log_steps_trained_metrics", "class"),
    ("ray.rllib.algorithms.algorithm_config.AlgorithmConfig", "_torch_grad_scaler_class",
     "instance"),
    ("ray.rllib.algorithms.algorithm_config.AlgorithmConfig", "_torch_lr_scheduler_classes",
     "instance"),
    ("ray.rllib.execution.rollout_ops.synchronous_parallel_sample", "_uses_new_env_runners",
     "parameter"),
    ("ray.rllib.execution.rollout_ops.synchronous_parallel_sample", "_return_metrics",
     "parameter"),
    # private hooks our classes override (with @override)
    ("ray.rllib.algorithms.algorithm_config.AlgorithmConfig", "_model_config_auto_includes",
     "class"),
    ("ray.rllib.core.rl_module.rl_module.RLModule", "_forward_inference", "class"),
    ("ray.rllib.core.rl_module.rl_module.RLModule", "_forward_exploration", "class"),
    ("ray.rllib.core.rl_module.rl_module.RLModule", "_forward_train", "class"),
)


def local_learner(algo: Any) -> Any:
    """The learner of ``algo``'s learner group when it runs in this process
    (``num_learners=0``; ``None`` with remote learners).

    Reads ``LearnerGroup._learner``: RLlib 2.60 has no public accessor for the local learner
    (``LearnerGroup.is_local`` says whether there is one; ``foreach_learner`` runs a function
    on it but returns results, not the object)."""
    return algo.learner_group._learner


def bump_weights_seq_no(learner: Any) -> None:
    """Count one weights change of ``learner``, as ``Learner.update`` does once per call.

    Increments ``Learner._weights_seq_no``: RLlib 2.60 bumps it only inside ``update``; env
    runners compare it to skip weight syncs that change nothing."""
    learner._weights_seq_no += 1


def log_steps_trained(learner: Any, batch: Any) -> None:
    """Log the trained-step counters of ``batch`` (a ``MultiAgentBatch``) on ``learner``, as
    ``Learner.update`` does per minibatch.

    Calls ``Learner._log_steps_trained_metrics``: RLlib 2.60 logs these counters only from
    inside ``update``."""
    learner._log_steps_trained_metrics(batch)


def uses_grad_scaler_or_lr_schedulers(config: Any) -> bool:
    """Whether an algorithm ``config`` asks for a torch mixed-precision gradient scaler or
    torch learning-rate schedulers.

    Reads ``AlgorithmConfig._torch_grad_scaler_class`` and ``_torch_lr_scheduler_classes``:
    RLlib 2.60 sets them through ``AlgorithmConfig.experimental`` and has no public getter."""
    return (config._torch_grad_scaler_class is not None
            or bool(config._torch_lr_scheduler_classes))


def sample_episodes(algo: Any, *, random_actions: bool) -> tuple[list, list]:
    """One round of sampling on ``algo``'s env runners: ``(episodes, runner metrics)``.

    Calls ``synchronous_parallel_sample`` with its private keywords ``_uses_new_env_runners``
    (the new API stack's env runners) and ``_return_metrics`` (their metrics with the
    episodes): in RLlib 2.60 the new stack's own algorithms pass them the same way, and no
    public sampling function returns both."""
    from ray.rllib.execution.rollout_ops import synchronous_parallel_sample

    return synchronous_parallel_sample(
        worker_set=algo.env_runner_group, concat=True,
        sample_timeout_s=algo.config.sample_timeout_s, random_actions=random_actions,
        _uses_new_env_runners=True, _return_metrics=True)
