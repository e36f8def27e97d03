"""Every private attribute of RLlib that this project reaches, in one place.

Written against RLlib 2.60 (``ray[rllib]==2.60.*``, the version ``requirements.lock`` pins),
new API stack. Each function says which private attribute it reads and what public API is
missing. ``tests/test_rllib_internals.py`` checks that every attribute still exists on the
installed RLlib's classes and fails with the installed version and the attribute that moved;
when it fails after an upgrade, this module is the one to change.

Why the trainer needs them: :meth:`agents.ddpg.algorithm.DDPG.training_step` runs several
gradient updates per learner call on the local learner (``num_learners=0``) without
``Learner.update``'s per-minibatch machinery, copies the actor's weights to the local env
runner tensor by tensor, and :meth:`agents.ddpg.learner.DDPGTorchLearner.apply_gradients`
replaces ``TorchLearner.apply_gradients``' per-tensor nan/inf checks with one check per
optimizer. RLlib's hooks that our classes override (``Learner.compute_gradients``,
``AlgorithmConfig._model_config_auto_includes``, ``RLModule._forward_train``, ...) are marked
``@override`` where they are overridden.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "PRIVATE_ATTRIBUTES",
    "bump_weights_seq_no",
    "has_grad_scalers_or_lr_schedulers",
    "learner_params",
    "learner_update",
    "local_learner",
    "log_steps_trained",
    "module_optimizers",
    "sample_episodes",
]

RLLIB_VERSION = "2.60"

# (class path, attribute, how it is looked for): "class" = defined on the class (a method),
# "instance" = set by the class's ``__init__`` (read from its source), "parameter" = a
# keyword of the function; every entry is checked by tests/test_rllib_internals.py
PRIVATE_ATTRIBUTES: tuple[tuple[str, str, str], ...] = (
    ("ray.rllib.core.learner.learner_group.LearnerGroup", "_learner", "instance"),
    ("ray.rllib.core.learner.learner.Learner", "_update", "class"),
    ("ray.rllib.core.learner.learner.Learner", "_weights_seq_no", "instance"),
    ("ray.rllib.core.learner.learner.Learner", "_log_steps_trained_metrics", "class"),
    ("ray.rllib.core.learner.learner.Learner", "_module_optimizers", "instance"),
    ("ray.rllib.core.learner.learner.Learner", "_params", "instance"),
    ("ray.rllib.core.learner.torch.torch_learner.TorchLearner", "_grad_scalers", "instance"),
    ("ray.rllib.core.learner.torch.torch_learner.TorchLearner", "_lr_scheduler_classes",
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


def learner_update(learner: Any, batch: dict[str, Any]) -> tuple[Any, Any, Any]:
    """One gradient update of ``learner`` on ``batch`` (module id -> dict of tensors already on
    the learner's device): forward, losses, gradients, optimizer steps. Returns
    ``(fwd_out, loss_per_module, tensor_metrics)``.

    Calls ``Learner._update``: the public ``Learner.update`` also converts the batch to
    tensors, splits it into minibatches and logs per minibatch, for each call; RLlib 2.60 has
    no public single-update method."""
    return learner._update(batch)


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


def module_optimizers(learner: Any) -> dict[str, list[str]]:
    """Module id -> the names of the optimizers registered for it, in registration order.

    Reads ``Learner._module_optimizers``: ``Learner.get_optimizers_for_module`` returns the
    optimizers of one module, but RLlib 2.60 has no public list of the modules that have
    optimizers, nor of their full registration names that ``get_optimizer`` takes."""
    return learner._module_optimizers


def learner_params(learner: Any) -> dict[Any, Any]:
    """Parameter reference -> parameter tensor of every optimized parameter of ``learner``
    (the keys of the gradient dicts ``compute_gradients`` returns).

    Reads ``Learner._params``: RLlib 2.60 exposes it to subclasses only through
    ``filter_param_dict_for_optimizer``, which filters a dict the caller must already have."""
    return learner._params


def has_grad_scalers_or_lr_schedulers(learner: Any) -> bool:
    """Whether a torch ``learner`` uses mixed-precision gradient scalers or learning-rate
    schedulers (then only ``TorchLearner.apply_gradients`` applies gradients correctly).

    Reads ``TorchLearner._grad_scalers`` and ``_lr_scheduler_classes``: RLlib 2.60 sets them
    from the config in ``TorchLearner.__init__`` and has no public flag for either."""
    return learner._grad_scalers is not None or learner._lr_scheduler_classes is not None


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
