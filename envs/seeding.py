"""One place to seed everything.

Every random stream in the project is derived from one integer seed through
:class:`numpy.random.SeedSequence` and a tuple of names, so two components never share
a stream by accident and the same seed always gives the same result (tested in
``tests/test_determinism.py``). The global states of third-party code (Python's ``random``,
numpy's legacy state, torch) are seeded from the same streams by
:func:`agents.seeding.seed_everything`, where the training stack is.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["derive_seed", "rng"]


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
