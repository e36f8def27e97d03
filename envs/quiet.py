"""Silence known third-party noise, so that a job's log shows the job.

Every entry point (``train.py``, ``sweep.py``, ``trees.py``, ``shaping.py``, ``testbed.py``,
``serve.py``, ``ablation.py``, ``bench/run_all.py``) calls :func:`quiet` once, before Ray,
torch or MLflow do any work. Each filter names one known message of one library's logger;
every other warning and log line still shows. Ray's own INFO
lines (``Started a local Ray instance``, ``Trainable.setup took ...``) are kept out by the
``logging_level="WARNING"`` of the ``ray.init`` call in :mod:`agents.training`, and the Ray
workers' output by its ``log_to_driver=False``.
"""

from __future__ import annotations

import logging
import re

__all__ = ["DROPPED_LOG_MESSAGES", "quiet"]

#: (logger name, message pattern matched at the start): the log records dropped, each with why
DROPPED_LOG_MESSAGES: tuple[tuple[str, str], ...] = (
    # Ray, on every local cluster: advice on token authentication (a local cluster's business)
    ("ray._private.authentication.authentication_token_setup", "Token authentication is"),
    # RLlib, once per algorithm: the new API stack is the default (the project uses it)
    ("ray.rllib.algorithms.algorithm_config", r"You are running \w+ on the new API stack"),
    # RLlib's SAC config, which agents.ddpg's DDPGConfig extends: the same notice
    ("ray.rllib.algorithms.sac.sac", "You are running SAC on the new API stack"),
    # RLlib's own RLModule constructor builds the deprecated RLModuleConfig it warns about
    ("ray._common.deprecation", r"DeprecationWarning: `RLModule\(config="),
    # Ray Tune's utilisation monitor, started by every RLlib Algorithm: GPUtil is not used
    ("ray.tune.utils.util", "Install gputil"),
    # torch's ONNX exporter: one line per torchvision operator it skips (torchvision unused)
    ("torch.onnx._internal.exporter._registration", "torchvision is not installed"),
    # httpx, at INFO under Hydra's logging set-up: one line per request of the testbed's
    # adapter polling its policy server (the testbed prints its own progress)
    ("httpx", "HTTP Request: "),
)


class _Drop(logging.Filter):
    """Drops the records of one logger whose message matches ``pattern`` at its start."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.match(record.getMessage()) is None


def quiet() -> None:
    """Install the filters above in this process (once: a second call adds nothing).

    Processes forked later (the evaluation workers) inherit them."""
    for name, pattern in DROPPED_LOG_MESSAGES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.pattern.pattern == pattern
                   for f in logger.filters):
            logger.addFilter(_Drop(pattern))
