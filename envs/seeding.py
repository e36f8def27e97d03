"""One place to seed everything.

Every random stream in the project is derived from one integer seed through
:class:`numpy.random.SeedSequence` and a tuple of names, so two components never share
a stream by accident and the same seed always gives the same result (tested in
``tests/test_determinism.py``).
"""

from __future__ import annotations

import hashlib
import os
import random

import numpy as np

__all__ = ["derive_seed", "rng", "seed_everything"]


def derive_seed(seed: int, *names: str | int) -> int:
    """A 63-bit child seed of ``seed`` for the stream called ``names``.

    Stable across processes and Python versions (it does not use ``hash()``).
    """
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    tag = "/".join(str(n) for n in names).encode()
    words = np.frombuffer(hashlib.blake2b(tag, digest_size=16).digest(), dtype=np.uint32)
    ss = np.random.SeedSequence([seed, *words.tolist()])
    return int(ss.generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def rng(seed: int, *names: str | int) -> np.random.Generator:
    """A numpy Generator for the stream ``names`` under ``seed``."""
    return np.random.default_rng(derive_seed(seed, *names))


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
