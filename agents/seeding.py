"""Seeding the global states of third-party code from the project's one seed.

Every random stream of the simulator is derived from one integer seed
(:func:`envs.seeding.derive_seed`); this seeds, from streams of the same seed, the global
states that third-party code (RLlib, torch) reads: Python's ``random``, numpy's legacy
state and torch. It lives with the training stack so that the simulator never imports torch.
"""

from __future__ import annotations

import os
import random

import numpy as np

from envs.seeding import derive_seed

__all__ = ["seed_everything"]


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, numpy's legacy global state and torch (if importable).

    Simulator code never uses global state (it takes explicit Generators); this is for
    third-party code (RLlib, torch) that does.
    """
    os.environ.setdefault("PYTHONHASHSEED", str(seed))
    random.seed(seed)
    np.random.seed(derive_seed(seed, "numpy-global") % (2**32))
    try:  # torch is optional for the simulator
        import torch
    except ImportError:  # pragma: no cover - torch is a declared dependency
        return
    torch.manual_seed(derive_seed(seed, "torch"))
