"""From channel scores to a channel: the one decoder shared by the environment, evaluation,
the policy bundle and serving.

An actor outputs one score per channel (index 0 = RPC, t = MQ topic t; SMART Section V-D-2
uses the argmax of the actor's K+1 outputs). Two modes:

``argmax``   the paper's decoding: the highest score, ties broken uniformly at random.
``feasible`` a safety layer: the argmax if that move fits (:meth:`CostState.fits` with
             ``reserve=True``); otherwise the highest-scoring channel that fits (ties by
             channel index); if no channel fits, the argmax all the same (the reward's
             penalty terms then see the violation). It draws from ``rng`` exactly as
             ``argmax`` does, so both modes agree whenever the argmax fits.

A move *fits* if Eq. 1's constraints (controller bandwidth C_b and CPU C_p, node bandwidth
s(n)) still hold once every type not yet decided is counted at the least it will cost on
any channel: one publish of f(m) and one send on the controller, f(m) on each of its
destination nodes. Those costs are lower bounds, so a move that does not fit makes a
violation certain, and an episode of fitting moves ends feasible. When the first type is
decided nothing fits only if the window itself is infeasible (then the exact MILP says so
too); later, a type can still find no fitting channel because the bounds are not tight.
"""

from __future__ import annotations

import numpy as np

from . import kernels as _k
from .cost import CostState
from .errors import DSMDError

__all__ = ["DECODINGS", "check_decoding", "decode", "decode_action", "decode_actions"]

DECODINGS: tuple[str, ...] = ("argmax", "feasible")


def check_decoding(mode: str) -> str:
    if mode not in DECODINGS:
        raise DSMDError(f"decoding must be one of {DECODINGS}, got {mode!r}")
    return mode


def _draw_tie(a: np.ndarray, best: int, rng: np.random.Generator) -> int:
    """One of the channels whose score equals ``a[best]``, uniformly at random."""
    ties = np.flatnonzero(a == a[best])
    return int(ties[rng.integers(ties.size)])


def decode_action(action: np.ndarray, rng: np.random.Generator) -> int:
    """argmax over channel scores, ties broken uniformly at random."""
    a = _k.as_scores(action)
    best, count = _k.argmax_ties(a)  # NaN scores never win (np.argmax would pick them)
    return _draw_tie(a, best, rng) if count > 1 else int(best)


def decode_actions(scores: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """:func:`decode_action` of each row of ``[B, K+1]`` scores (ties drawn row by row, in
    order, as ``B`` calls would draw them)."""
    if scores.ndim != 2 or scores.shape[0] == 0:
        return np.zeros(scores.shape[0] if scores.ndim == 2 else 0, np.int64)
    a = np.ascontiguousarray(scores, dtype=scores.dtype if scores.dtype in _k._FLOATS
                             else np.float64)
    best, count = _k.argmax_ties_rows(a)
    for r in np.flatnonzero(count > 1).tolist():
        best[r] = _draw_tie(a[r], int(best[r]), rng)
    return best


def decode(action: np.ndarray, state: CostState, m: int, rng: np.random.Generator,
           mode: str = "feasible") -> int:
    """The channel for unassigned type ``m`` in ``state`` (see the module docstring)."""
    best = decode_action(action, rng)
    if mode == "argmax" or state.fits(m, best, reserve=True):
        return best
    c = state.first_fit(m, action, skip=best)  # -1 at once when the controller is full
    return best if c < 0 else c
