"""Intervals shared by the evaluations and the report: :func:`ci95`, the half-width of the
95% confidence interval of a mean (Student's t), the one every table of the project quotes
as ``±95%``."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ci95"]


def ci95(x: np.ndarray | list[float]) -> float:
    """Half-width of the 95% interval of the mean of ``x`` (Student's t with ``n - 1``
    degrees of freedom); NaN for fewer than 2 values."""
    a = np.asarray(x, np.float64)
    if a.size < 2:
        return float("nan")
    from scipy.stats import t

    return float(t.ppf(0.975, a.size - 1) * a.std(ddof=1) / math.sqrt(a.size))
