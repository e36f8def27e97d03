"""The learned send forecaster at run time: gradient-boosted trees evaluated in NumPy.

:class:`TreeEnsemble` holds an additive ensemble of binary regression trees (Friedman,
"Greedy function approximation: a gradient boosting machine", Ann. Stat. 2001) as flat
arrays, every tree's nodes side by side, and evaluates all trees on all rows together, one
NumPy step per tree level: the environment, an online bundle and the policy server run it
with NumPy alone (no scikit-learn, no torch). :mod:`agents.forecaster` fits it (scikit-learn's
histogram gradient boosting) and converts it.

:class:`SendForecaster` is the probability that each known type sends in the next interval
(``sigmoid`` of the ensemble's raw score on :meth:`envs.dsmd.demand.DemandState.features`).
:class:`RateForecaster` is the conditional quantiles of its rate if it sends: one ensemble
per quantile level of ``log1p(rate)``, each fitted by the pinball (quantile) loss (Koenker
and Bassett, Econometrica 1978), sorted across levels so that they never cross
(Chernozhukov, Fernandez-Val and Galichon, Econometrica 2010).
Each is stored as one ``.npz`` file (``save`` / ``load``) that records the feature names it
was trained on; loading refuses a file whose features are not this version's
:data:`envs.dsmd.demand.FEATURES`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

from .demand import FEATURES, DemandState
from .errors import DSMDError

__all__ = ["RateForecaster", "SendForecaster", "TreeEnsemble"]


@njit(cache=True, nogil=True)
def _ensemble_raw(baseline: float, roots: np.ndarray, feature: np.ndarray,
                  threshold: np.ndarray, nan_left: np.ndarray, left: np.ndarray,
                  right: np.ndarray, leaf: np.ndarray, value: np.ndarray, depth: int,
                  x: np.ndarray) -> np.ndarray:  # pragma: no cover (compiled)
    out = np.empty(x.shape[0])
    for r in range(x.shape[0]):
        acc = 0.0
        for t in range(roots.size):
            n = roots[t]
            for _ in range(depth):  # bounded: a malformed file cannot loop
                if leaf[n]:
                    break
                v = x[r, feature[n]]
                if np.isnan(v):
                    n = left[n] if nan_left[n] else right[n]
                elif v <= threshold[n]:
                    n = left[n]
                else:
                    n = right[n]
            acc += value[n]
        out[r] = baseline + acc
    return out


@dataclass(frozen=True, eq=False)
class TreeEnsemble:
    """``raw(x) = baseline + sum_t tree_t(x)``; tree ``t``'s nodes are
    ``roots[t] ..`` in the flat arrays. At an inner node a row goes to ``left`` when
    ``x[feature] <= threshold`` (a NaN goes where ``nan_left`` says), else to ``right``
    (node indices are global); a leaf's output is ``value``."""

    baseline: float
    roots: np.ndarray  # (T,) int64
    feature: np.ndarray  # (N,) int64
    threshold: np.ndarray  # (N,) float64
    nan_left: np.ndarray  # (N,) bool
    left: np.ndarray  # (N,) int64
    right: np.ndarray  # (N,) int64
    leaf: np.ndarray  # (N,) bool
    value: np.ndarray  # (N,) float64
    depth: int

    def __post_init__(self) -> None:
        n = self.feature.size
        for name in ("threshold", "nan_left", "left", "right", "leaf", "value"):
            if getattr(self, name).shape != (n,):
                raise DSMDError(f"tree ensemble: {name} has shape {getattr(self, name).shape}"
                                f", expected ({n},)")
        inner = ~self.leaf
        if n and (self.roots.min(initial=0) < 0 or self.roots.max(initial=0) >= n
                  or (inner.any() and (self.left[inner].min() < 0 or self.left[inner].max() >= n
                                       or self.right[inner].min() < 0
                                       or self.right[inner].max() >= n))):
            raise DSMDError("tree ensemble: a node index is out of range")

    @functools.cached_property
    def _width(self) -> int:
        """The number of columns a row needs (found once, checked at every call)."""
        return int(self.feature[~self.leaf].max(initial=-1)) + 1

    def raw(self, x: np.ndarray) -> np.ndarray:
        """The raw score of every row of ``x`` ``[rows, features]`` (a compiled loop: each
        row walks each tree, at most ``depth`` levels, the leaves summed in tree order)."""
        x = np.ascontiguousarray(x, np.float64)
        if x.ndim != 2:
            raise DSMDError(f"tree ensemble: rows must be 2-D, got shape {x.shape}")
        if x.shape[0] and self._width > x.shape[1]:
            raise DSMDError(f"tree ensemble: a tree reads feature {self._width - 1}, rows "
                            f"have {x.shape[1]}")
        out: np.ndarray = _ensemble_raw(self.baseline, self.roots, self.feature,
                                        self.threshold, self.nan_left, self.left, self.right,
                                        self.leaf, self.value, self.depth, x)
        return out

    def arrays(self) -> dict[str, np.ndarray]:
        return {"baseline": np.array(self.baseline), "roots": self.roots,
                "feature": self.feature, "threshold": self.threshold,
                "nan_left": self.nan_left, "left": self.left, "right": self.right,
                "leaf": self.leaf, "value": self.value, "depth": np.array(self.depth)}

    @classmethod
    def from_arrays(cls, a: dict[str, np.ndarray]) -> TreeEnsemble:
        return cls(float(a["baseline"]), a["roots"].astype(np.int64),
                   a["feature"].astype(np.int64), a["threshold"].astype(np.float64),
                   a["nan_left"].astype(bool), a["left"].astype(np.int64),
                   a["right"].astype(np.int64), a["leaf"].astype(bool),
                   a["value"].astype(np.float64), int(a["depth"]))


@dataclass(frozen=True, eq=False)
class SendForecaster:
    """The probability that each type sends in the next interval (module docstring)."""

    trees: TreeEnsemble

    def probability(self, features: np.ndarray) -> np.ndarray:
        """``P(sends next interval)`` for each row of ``features`` (``FEATURES`` columns)."""
        f = _rows(features, "send forecaster")
        p: np.ndarray = 1.0 / (1.0 + np.exp(-self.trees.raw(f)))
        return p

    def __call__(self, state: DemandState) -> np.ndarray:
        """The probability of every type of ``state`` (unknown types: 0)."""
        return np.where(state.known, self.probability(state.features()), 0.0)

    def save(self, path: str | Path) -> Path:
        return _save(path, self.trees.arrays())

    @classmethod
    def load(cls, path: str | Path) -> SendForecaster:
        a = _load(path, "send forecaster", TreeEnsemble.__dataclass_fields__)
        return cls(TreeEnsemble.from_arrays(a))


@dataclass(frozen=True, eq=False)
class RateForecaster:
    """Quantiles of ``log1p(rate)`` in the next interval of a type that sends then (module
    docstring): ``trees[j]`` is level ``quantiles[j]`` (increasing)."""

    quantiles: tuple[float, ...]
    trees: tuple[TreeEnsemble, ...]

    def __post_init__(self) -> None:
        q = np.asarray(self.quantiles, np.float64)
        if (q.size == 0 or len(self.trees) != q.size or np.any(np.diff(q) <= 0)
                or q[0] <= 0 or q[-1] >= 1):
            raise DSMDError(f"rate forecaster: quantile levels {list(self.quantiles)} must be "
                            f"increasing in (0, 1), one ensemble each ({len(self.trees)} given)")

    def log_rate(self, features: np.ndarray) -> np.ndarray:
        """``[rows, len(quantiles)]``: the quantiles of ``log1p(rate)`` for each row of
        ``features`` (``FEATURES`` columns), non-decreasing along each row."""
        f = _rows(features, "rate forecaster")
        return np.sort(np.stack([t.raw(f) for t in self.trees], axis=1), axis=1)

    def rate(self, features: np.ndarray) -> np.ndarray:
        """:meth:`log_rate` in the rate's own unit, at least 0."""
        out: np.ndarray = np.maximum(np.expm1(self.log_rate(features)), 0.0)
        return out

    def __call__(self, state: DemandState) -> np.ndarray:
        """The rate quantiles of every type of ``state`` (unknown types: 0)."""
        return np.where(state.known[:, None], self.rate(state.features()), 0.0)

    def save(self, path: str | Path) -> Path:
        arrays: dict[str, Any] = {"quantiles": np.asarray(self.quantiles, np.float64)}
        for j, t in enumerate(self.trees):
            arrays |= {f"q{j}_{k}": v for k, v in t.arrays().items()}
        return _save(path, arrays)

    @classmethod
    def load(cls, path: str | Path) -> RateForecaster:
        a = _load(path, "rate forecaster", ("quantiles",))
        q = tuple(float(x) for x in np.ravel(a["quantiles"]))
        trees = []
        for j in range(len(q)):
            part = {k: a.get(f"q{j}_{k}") for k in TreeEnsemble.__dataclass_fields__}
            missing = sorted(f"q{j}_{k}" for k, v in part.items() if v is None)
            if missing:
                raise DSMDError(f"rate forecaster {path}: missing arrays {missing}")
            trees.append(TreeEnsemble.from_arrays(part))  # type: ignore[arg-type]
        return cls(q, tuple(trees))


def _rows(features: np.ndarray, who: str) -> np.ndarray:
    f = np.asarray(features)
    if f.ndim != 2 or f.shape[1] != len(FEATURES):
        raise DSMDError(f"{who}: features have shape {f.shape}, expected "
                        f"[rows, {len(FEATURES)}]")
    return f


def _save(path: str | Path, arrays: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:  # np.savez would append .npz to a name without it
        np.savez(fh, features=np.array(FEATURES), **arrays)
    return path


def _load(path: str | Path, who: str, required: Any) -> dict[str, np.ndarray]:
    """The arrays of a forecaster file, its feature names checked against this version's."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            a = {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise DSMDError(f"{who} {path}: not a readable .npz file ({e})") from e
    missing = {"features", *required} - set(a)
    if missing:
        raise DSMDError(f"{who} {path}: missing arrays {sorted(missing)}")
    names = tuple(str(s) for s in a.pop("features"))
    if names != FEATURES:
        raise DSMDError(f"{who} {path}: trained on features {list(names)}, "
                        f"this version computes {list(FEATURES)}: retrain it")
    return a
