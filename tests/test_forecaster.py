"""The send forecaster: intermittent-demand state and baselines (envs.dsmd.demand), the NumPy
tree ensemble and its file (envs.dsmd.forecaster), fitting and scoring (agents.forecaster)."""

from __future__ import annotations

import numpy as np
import pytest

from envs.dsmd.demand import CROSTON_ALPHA, FEATURES, RATE_ALPHAS, DemandState, demand_panel
from envs.dsmd.errors import DSMDError
from envs.dsmd.forecaster import RateForecaster, SendForecaster

T, F = True, False


def test_demand_state_by_hand():
    s = DemandState(vpc=np.array([0, 0, 1]), destinations=np.array([3, 1, 7]))
    for sent in ([T, F, F], [F, F, F], [T, T, F]):
        s.update(np.array(sent), np.array([100.0, 50.0, 0.0]))
    # type 0: sent, silent, sent; type 1 first sent in the last interval; type 2 never
    assert s.known.tolist() == [T, T, F]
    assert s.lags[:3, 0].tolist() == [1.0, 0.0, 1.0] and s.lags[:3, 1].tolist() == [1, 0, 0]
    assert s.since.tolist() == [0.0, 0.0, 0.0] and s.age.tolist() == [2.0, 0.0, 0.0]
    # TSB at alpha 0.1: 1 -> 0.9 -> 0.1 + 0.9 * 0.9; a new type starts at 1
    assert s.tsb_p(0.1) == pytest.approx([0.1 + 0.81, 1.0, 0.0])
    # Croston: type 0's gap was 2 intervals: q = 1 + alpha (2 - 1)
    assert s.croston_p()[0] == pytest.approx(1 / (1 + CROSTON_ALPHA))
    assert s.croston_p(sba=True)[0] == pytest.approx((1 - CROSTON_ALPHA / 2) / (1 + CROSTON_ALPHA))
    # VPC 0: both known types sent in the last interval, none of its one type in the one before
    f = dict(zip(FEATURES, s.features()[0]))
    assert f["vpc_sent_share"] == 1.0 and f["vpc_sent_share_prev"] == 0.0
    assert f["sent_share"] == pytest.approx(2 / 3)
    with pytest.raises(DSMDError, match="sent has shape"):
        s.update(np.array([T, F]), np.zeros(2))


def test_panel_rows_are_known_types_with_features_of_the_past():
    rng = np.random.default_rng(0)
    sent = rng.random((12, 6)) < 0.4
    sent[0] = False
    sent[1, :3] = True  # types 3..5 appear later (or never)
    rates = np.where(sent, rng.integers(1, 1000, sent.shape), 0).astype(float)
    vpc, dest = np.array([0, 0, 1, 1, 2, 2]), np.arange(1, 7)
    panel = demand_panel(sent, rates, vpc, dest)
    state = DemandState(vpc, dest)
    for w in range(12):
        rows = panel.window == w
        known = np.flatnonzero(state.known)
        assert panel.type_id[rows].tolist() == known.tolist()
        np.testing.assert_array_equal(panel.x[rows], state.features()[known])
        assert panel.y[rows].tolist() == sent[w, known].tolist()
        np.testing.assert_array_equal(panel.baselines["tsb_0.3"][rows], state.tsb_p(0.3)[known])
        np.testing.assert_array_equal(panel.rate_baselines["last"][rows],
                                      state.last_rate[known])
        np.testing.assert_array_equal(panel.rate_baselines["ewma_0.2"][rows],
                                      state.rate_levels[0][known])
        state.update(sent[w], rates[w])


def test_rate_levels_by_hand():
    s = DemandState(vpc=np.array([0, 0]), destinations=np.array([1, 1]))
    for sent, r in (([T, F], [np.e - 1, 0.0]), ([F, F], [0.0, 0.0]), ([T, T], [0.0, 5.0])):
        s.update(np.array(sent), np.array(r))
    # type 0: log1p rates 1 then 0 (a silent interval changes nothing): a * 0 + (1 - a) * 1
    assert s.rate_levels[:, 0] == pytest.approx([1 - a for a in RATE_ALPHAS])
    assert s.last_rate.tolist() == [0.0, pytest.approx(np.log1p(5.0))]
    assert s.rate_level[0] == pytest.approx(0.5)


def test_rate_forecaster_reproduces_sklearn_and_refuses_bad_files(tmp_path):
    pytest.importorskip("sklearn")
    from sklearn.ensemble import HistGradientBoostingRegressor

    from agents.forecaster import from_sklearn

    rng = np.random.default_rng(2)
    x = rng.standard_normal((2000, len(FEATURES))).astype(np.float32)
    z = 3 + x[:, 0] + rng.standard_normal(2000) * (1 + (x[:, 1] > 0))
    models = [HistGradientBoostingRegressor(loss="quantile", quantile=q, max_iter=20,
                                            random_state=0).fit(x, z) for q in (0.1, 0.5, 0.9)]
    f = RateForecaster((0.1, 0.5, 0.9), tuple(from_sklearn(m) for m in models))
    want = np.sort(np.stack([m.predict(x) for m in models], axis=1), axis=1)
    np.testing.assert_allclose(f.log_rate(x), want, rtol=1e-9, atol=1e-9)
    assert np.all(np.diff(f.log_rate(x), axis=1) >= 0)
    path = f.save(tmp_path / "rate.npz")
    np.testing.assert_array_equal(RateForecaster.load(path).log_rate(x), f.log_rate(x))
    s = DemandState(vpc=np.array([0, 0]), destinations=np.array([1, 1]))
    s.update(np.array([T, F]), np.array([10.0, 0.0]))
    q = f(s)
    assert q.shape == (2, 3) and q[1].tolist() == [0, 0, 0] and np.all(q[0] >= 0)
    with pytest.raises(DSMDError, match="increasing in"):
        RateForecaster((0.5, 0.1), f.trees[:2])
    arrays = dict(np.load(path))
    del arrays["q2_value"]
    np.savez(tmp_path / "cut.npz", **arrays)
    with pytest.raises(DSMDError, match=r"missing arrays \['q2_value'\]"):
        RateForecaster.load(tmp_path / "cut.npz")
    with pytest.raises(DSMDError, match="rate forecaster: features have shape"):
        f.log_rate(x[:, :3])


def test_pinball_scores_by_hand():
    pytest.importorskip("sklearn")
    from agents.forecaster import pinball_scores, residual_quantiles

    pred = np.array([[0.0, 1.0], [0.0, 1.0]])
    s = pinball_scores(pred, np.array([2.0, -1.0]), (0.2, 0.8))
    # z = 2: above both: 0.2 * 2 and 0.8 * 1; z = -1: below both: 0.8 * 1 and 0.2 * 2
    assert s["pinball_0.2"] == pytest.approx((0.4 + 0.8) / 2)
    assert s["pinball_0.8"] == pytest.approx((0.8 + 0.4) / 2)
    assert s["pinball"] == pytest.approx(0.6) and s["coverage"] == 0.0
    r = residual_quantiles(np.zeros(5), np.arange(5.0), (0.5,))
    assert r.tolist() == [2.0]


def test_tree_ensemble_reproduces_sklearn(tmp_path):
    pytest.importorskip("sklearn")
    from sklearn.ensemble import HistGradientBoostingClassifier

    from agents.forecaster import fit_send_forecaster, from_sklearn

    rng = np.random.default_rng(1)
    x = rng.standard_normal((3000, len(FEATURES))).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 3] * x[:, 5] + 0.3 * rng.standard_normal(3000)) > 0
    x[rng.random(x.shape) < 0.02] = np.nan  # missing values take the learned side
    model = HistGradientBoostingClassifier(max_iter=30, random_state=0).fit(x, y)
    trees = from_sklearn(model)
    np.testing.assert_allclose(SendForecaster(trees).probability(x),
                               model.predict_proba(x)[:, 1], rtol=1e-9, atol=1e-12)
    # a saved forecaster loads to the same probabilities; a file of other features is refused
    f = SendForecaster(trees)
    path = f.save(tmp_path / "send.npz")
    np.testing.assert_array_equal(SendForecaster.load(path).probability(x), f.probability(x))
    arrays = dict(np.load(path))
    arrays["features"] = np.array(["lag1"])
    np.savez(tmp_path / "old.npz", **arrays)
    with pytest.raises(DSMDError, match="retrain it"):
        SendForecaster.load(tmp_path / "old.npz")
    (tmp_path / "junk.npz").write_bytes(b"not numpy")
    with pytest.raises(DSMDError, match=r"junk\.npz: not a readable"):
        SendForecaster.load(tmp_path / "junk.npz")
    with pytest.raises(DSMDError, match="all of one class"):
        sent = np.ones((5, 2), bool)
        fit_send_forecaster([demand_panel(sent, sent * 1.0, np.zeros(2, int), np.ones(2))])


def test_probability_scores_by_hand():
    pytest.importorskip("sklearn")
    from agents.forecaster import probability_scores

    s = probability_scores(np.array([0.8, 0.2, 0.5, 0.5]), np.array([1, 0, 1, 0]))
    assert s["log_loss"] == pytest.approx(-(2 * np.log(0.8) + 2 * np.log(0.5)) / 4)
    assert s["brier"] == pytest.approx((0.04 + 0.04 + 0.25 + 0.25) / 4)
    # bins: 0.2 -> (p 0.2, y 0), 0.5 -> (p 1.0, y 1), 0.8 -> (p 0.8, y 1)
    assert s["ece"] == pytest.approx((0.2 + 0.0 + 0.2) / 4)


def test_forecast_job_end_to_end(tmp_path):
    """``python forecast.py`` on tiny_online, in-process, with a real local MLflow store: the
    exported forecaster loads and scores like the table says."""
    pytest.importorskip("sklearn")
    from hydra import compose, initialize_config_dir
    from mlflow import MlflowClient

    from agents.config import CONFIG_DIR
    from agents.forecast_experiment import run_forecast

    db = f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="forecast", overrides=[
            "dataset_name=tiny_online", f"out_dir={tmp_path / 'out'}",
            f"paths.data_dir={tmp_path / 'data'}", "train_traces=2", "model.max_iter=20",
            f"logger.tracking_uri={db}", f"logger.artifact_location={tmp_path / 'art'}"])
    head = run_forecast(cfg)
    methods = {r["method"] for r in head["scores"]}
    assert {"gbt", "logistic", "last", "croston", "sba", "tsb"} == methods
    f = SendForecaster.load(tmp_path / "out" / "send_forecaster.npz")
    assert f.trees.roots.size == 20
    assert (tmp_path / "out" / "reliability.png").stat().st_size > 0
    assert "Paired by test trace" in (tmp_path / "out" / "summary.md").read_text()
    assert {r["method"] for r in head["rates"]["scores"]} == {"gbt", "last", "ewma"}
    rf = RateForecaster.load(tmp_path / "out" / "rate_forecaster.npz")
    assert rf.quantiles == (0.1, 0.5, 0.9) and rf.trees[0].roots.size == 20
    assert "pinball" in (tmp_path / "out" / "summary.md").read_text()
    client = MlflowClient(tracking_uri=db)
    (run,) = client.search_runs([client.get_experiment_by_name("smart-dsmd-forecast")
                                 .experiment_id])
    assert run.info.status == "FINISHED" and "gbt/log_loss" in run.data.metrics
    assert "rate/gbt/pinball" in run.data.metrics


def test_committed_forecaster_loads_and_is_a_probability():
    """The committed forecaster (results/forecaster) matches this version's features."""
    from pathlib import Path

    f = SendForecaster.load(Path(__file__).parents[1] / "results/forecaster/send_forecaster.npz")
    s = DemandState(vpc=np.array([0, 0, 1]), destinations=np.array([3, 1, 7]))
    s.update(np.array([T, F, T]), np.array([100.0, 0.0, 10.0]))
    p = f(s)
    assert p.shape == (3,) and p[1] == 0.0 and np.all((p[[0, 2]] > 0) & (p[[0, 2]] < 1))


def test_demand_state_grows():
    s = DemandState(vpc=np.array([0]), destinations=np.array([2]))
    s.update(np.array([T]), np.array([10.0]))
    s.grow(np.array([3, 0]), np.array([1, 4]))
    assert s.num_types == 3 and s.known.tolist() == [T, F, F] and s.lags.shape == (4, 3)
    s.update(np.array([T, T, F]), np.array([10.0, 5.0, 0.0]))
    f = dict(zip(FEATURES, s.features()[1]))
    assert f["vpc_sent_share"] == 1.0 and f["log_destinations"] == pytest.approx(np.log1p(1))
    with pytest.raises(DSMDError, match="one value per type"):
        s.grow(np.array([1, 2]), np.array([1]))
