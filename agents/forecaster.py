"""Fitting and scoring the send and rate forecasters (:mod:`envs.dsmd.forecaster`).

:func:`fit_send_forecaster` fits scikit-learn's histogram gradient boosting (a binary
log-loss model) on the demand panels of the training traces and converts it to the NumPy
:class:`~envs.dsmd.forecaster.TreeEnsemble` that runs everywhere else.
:func:`probability_scores` are the proper scoring rules it is judged by against the
classical forecasts of :mod:`envs.dsmd.demand` (Croston, SBA, TSB, last interval).

:func:`fit_rate_forecaster` fits one quantile-loss model per level on the rows where the type
sends; :func:`pinball_scores` judge it against the classical point forecasts of the rate
(last, EWMA) made quantile forecasts by adding their training residuals' quantiles
(:func:`residual_quantiles`), the usual way a point forecast gets an interval.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from envs.dsmd.demand import DemandPanel
from envs.dsmd.errors import DSMDError
from envs.dsmd.forecaster import RateForecaster, SendForecaster, TreeEnsemble

__all__ = ["calibrated_last", "fit_rate_forecaster", "fit_send_forecaster", "from_sklearn",
           "pinball_scores", "probability_scores", "rate_target", "residual_quantiles"]

EPS = 1e-4  # probabilities are clipped to [EPS, 1 - EPS] for the log loss


def from_sklearn(model: Any) -> TreeEnsemble:
    """A fitted binary ``HistGradientBoostingClassifier`` (its raw score, the log-odds) or a
    ``HistGradientBoostingRegressor`` (its prediction) as a :class:`TreeEnsemble`.

    Reads the model's fitted trees (``_predictors``, ``_baseline_prediction``: scikit-learn
    has no public accessor for them); ``tests/test_forecaster.py`` checks that the converted
    ensemble reproduces ``predict_proba``, so a scikit-learn that moves them fails there."""
    if getattr(model, "n_trees_per_iteration_", None) != 1:
        raise DSMDError("from_sklearn: a regressor or a binary classifier (one tree per "
                        "iteration) is needed")
    if getattr(model, "is_categorical_", None) is not None and np.any(model.is_categorical_):
        raise DSMDError("from_sklearn: categorical features are not supported")
    roots, parts, offset, depth = [], [], 0, 0
    for (tree,) in model._predictors:
        nodes = tree.nodes
        roots.append(offset)
        leaf = nodes["is_leaf"].astype(bool)
        parts.append((nodes["feature_idx"].astype(np.int64),
                      nodes["num_threshold"].astype(np.float64),
                      nodes["missing_go_to_left"].astype(bool),
                      np.where(leaf, 0, nodes["left"].astype(np.int64) + offset),
                      np.where(leaf, 0, nodes["right"].astype(np.int64) + offset),
                      leaf, nodes["value"].astype(np.float64)))
        depth = max(depth, int(nodes["depth"].max()) + 1)
        offset += nodes.size
    cols = [np.concatenate([p[i] for p in parts]) for i in range(7)]
    return TreeEnsemble(float(np.ravel(model._baseline_prediction)[0]),
                        np.asarray(roots, np.int64), *cols, depth=depth)


def fit_send_forecaster(panels: Sequence[DemandPanel], *, max_iter: int = 200,
                        learning_rate: float = 0.1, max_leaf_nodes: int = 31,
                        seed: int = 0) -> SendForecaster:
    """Fit the send forecaster on ``panels`` (the training traces')."""
    from sklearn.ensemble import HistGradientBoostingClassifier

    if not panels or sum(p.y.size for p in panels) == 0:
        raise DSMDError("fit_send_forecaster: no training rows")
    x = np.concatenate([p.x for p in panels])
    y = np.concatenate([p.y for p in panels])
    if y.all() or not y.any():
        raise DSMDError("fit_send_forecaster: the training rows are all of one class")
    model = HistGradientBoostingClassifier(max_iter=max_iter, learning_rate=learning_rate,
                                           max_leaf_nodes=max_leaf_nodes, random_state=seed,
                                           early_stopping=False)
    model.fit(x, y)
    return SendForecaster(from_sklearn(model))


def rate_target(panel: DemandPanel) -> tuple[np.ndarray, np.ndarray]:
    """(rows where the type sends, ``log1p(rate)`` there): what the rate forecaster fits."""
    rows = np.flatnonzero(panel.y)
    return rows, np.log1p(panel.rate[rows])


def fit_rate_forecaster(panels: Sequence[DemandPanel], quantiles: Sequence[float], *,
                        max_iter: int = 200, learning_rate: float = 0.1,
                        max_leaf_nodes: int = 31, seed: int = 0) -> RateForecaster:
    """One quantile-loss gradient-boosted model per level of ``quantiles`` on the rows of
    ``panels`` where the type sends (target ``log1p(rate)``)."""
    from sklearn.ensemble import HistGradientBoostingRegressor

    parts = [rate_target(p) for p in panels]
    if sum(z.size for _, z in parts) == 0:
        raise DSMDError("fit_rate_forecaster: no training rows where a type sends")
    x = np.concatenate([p.x[rows] for p, (rows, _) in zip(panels, parts)])
    z = np.concatenate([zz for _, zz in parts])
    trees = []
    for q in quantiles:
        model = HistGradientBoostingRegressor(loss="quantile", quantile=float(q),
                                              max_iter=max_iter, learning_rate=learning_rate,
                                              max_leaf_nodes=max_leaf_nodes, random_state=seed,
                                              early_stopping=False)
        trees.append(from_sklearn(model.fit(x, z)))
    return RateForecaster(tuple(float(q) for q in quantiles), tuple(trees))


def residual_quantiles(point: np.ndarray, z: np.ndarray, quantiles: Sequence[float]
                       ) -> np.ndarray:
    """The ``quantiles`` of ``z - point`` (a point forecast's residuals): added to the point
    forecast they make it a quantile forecast."""
    out: np.ndarray = np.quantile(np.asarray(z) - np.asarray(point), np.asarray(quantiles))
    return out


def pinball_scores(pred: np.ndarray, z: np.ndarray, quantiles: Sequence[float]
                   ) -> dict[str, float]:
    """The pinball loss ``mean rho_q(z - pred_q)``, ``rho_q(u) = u (q - [u < 0])``, per
    level (``pinball_<q>``) and averaged over the levels (``pinball``), and the share of
    ``z`` inside the outermost levels (``coverage``) for ``pred`` ``[rows, levels]``."""
    pred = np.asarray(pred, np.float64)
    z = np.asarray(z, np.float64)
    q = np.asarray(quantiles, np.float64)
    u = z[:, None] - pred
    loss = np.mean(u * (q[None, :] - (u < 0)), axis=0)
    out = {f"pinball_{qq:g}": float(v) for qq, v in zip(q, loss)}
    out["pinball"] = float(loss.mean())
    out["coverage"] = float(np.mean((z >= pred[:, 0]) & (z <= pred[:, -1])))
    return out


def calibrated_last(train: Sequence[DemandPanel]) -> tuple[float, float]:
    """The last-interval forecast made a probability: the training rows' send frequency
    after an interval with traffic and after a silent one."""
    last = np.concatenate([p.baselines["last"] for p in train]) > 0.5
    y = np.concatenate([p.y for p in train])
    return float(y[last].mean()), float(y[~last].mean())


def probability_scores(p: np.ndarray, y: np.ndarray, bins: int = 10) -> dict[str, float]:
    """Log loss, Brier score and expected calibration error (``bins`` equal-width bins) of
    probabilities ``p`` for outcomes ``y``."""
    p = np.asarray(p, np.float64)
    y = np.asarray(y, np.float64)
    q = np.clip(p, EPS, 1 - EPS)
    b = np.minimum((p * bins).astype(np.int64), bins - 1)
    n = np.bincount(b, minlength=bins)
    gap = np.abs(np.bincount(b, p, bins) - np.bincount(b, y, bins))
    return {"log_loss": float(-np.mean(y * np.log(q) + (1 - y) * np.log(1 - q))),
            "brier": float(np.mean((p - y) ** 2)),
            "ece": float(gap.sum() / max(n.sum(), 1))}
