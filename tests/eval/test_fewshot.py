"""The closed-form few-shot solver against scikit-learn's Ridge as an independent oracle."""
import numpy as np
import pytest
from sklearn.linear_model import Ridge

from vitlab.eval.fewshot import (
    DEFAULT_L2_GRID,
    RidgeSolver,
    check_shots,
    fewshot_evaluate,
    fit_ridge,
    select_l2,
    signed_targets,
)


def blobs(n_per_class, num_classes, dim, seed, spread=1.0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(num_classes, dim)) * 3
    y = np.repeat(np.arange(num_classes), n_per_class)
    x = centres[y] + spread * rng.normal(size=(len(y), dim))
    return x, y


@pytest.mark.parametrize("form,n,d", [("primal", 60, 8), ("dual", 12, 40), (None, 12, 40), (None, 60, 8)])
@pytest.mark.parametrize("l2", [1e-3, 0.5, 30.0])
def test_matches_sklearn_ridge(form, n, d, l2):
    rng = np.random.default_rng(n + d)
    x = rng.normal(size=(n, d)) + 2.0  # an offset, so the bias matters
    y = np.arange(n) % 4
    fit = fit_ridge(x, y, 4, l2, form=form)
    oracle = Ridge(alpha=l2, fit_intercept=True, solver="cholesky").fit(x, signed_targets(y, 4))
    np.testing.assert_allclose(fit.weights, oracle.coef_.T, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(fit.bias, oracle.intercept_, rtol=1e-6, atol=1e-8)
    x_new = rng.normal(size=(7, d))
    np.testing.assert_allclose(fit.decision(x_new), oracle.predict(x_new), rtol=1e-6, atol=1e-8)
    np.testing.assert_array_equal(fit.predict(x_new), oracle.predict(x_new).argmax(axis=1))


def test_primal_and_dual_agree():
    x, y = blobs(3, 5, 30, seed=1)  # n = 15 < d = 30
    a = RidgeSolver(x, signed_targets(y, 5), "primal").fit(0.1)
    b = RidgeSolver(x, signed_targets(y, 5), "dual").fit(0.1)
    np.testing.assert_allclose(a.weights, b.weights, atol=1e-8)
    np.testing.assert_allclose(a.bias, b.bias, atol=1e-8)


def test_the_form_left_open_decomposes_the_smaller_gram_matrix_and_no_other_is_read():
    x, y = blobs(3, 5, 30, seed=1)  # n = 15 < d = 30
    tall_x, tall_y = blobs(10, 5, 6, seed=1)  # n = 50 > d = 6
    targets = signed_targets(y, 5)
    assert RidgeSolver(x, targets).form == "dual"
    assert RidgeSolver(tall_x, signed_targets(tall_y, 5)).form == "primal"
    with pytest.raises(ValueError, match="form='auto': allowed values are 'primal', 'dual' and None"):
        RidgeSolver(x, targets, "auto")


def test_l2_chosen_on_holdout_only():
    x, y = blobs(8, 3, 6, seed=2)
    solver = RidgeSolver(x, signed_targets(y, 3))
    hx, hy = blobs(5, 3, 6, seed=2)
    grid = [1e-2, 1.0, 1e2]
    l2, accs = select_l2(solver, hx, hy, grid)
    assert accs.shape == (3,) and l2 in grid and accs[grid.index(l2)] == accs.max()
    # ties go to the largest regulariser
    l2_tie, _ = select_l2(solver, hx[:1], hy[:1] * 0 + solver.fit(1e2).predict(hx[:1]), grid)
    assert l2_tie == 1e2


def test_fewshot_evaluate_on_separable_blobs():
    pool_x, pool_y = blobs(40, 4, 16, seed=3, spread=0.5)
    eval_x, eval_y = blobs(20, 4, 16, seed=3, spread=0.5)
    res = fewshot_evaluate(pool_x, pool_y, eval_x, eval_y, shots=(1, 5), seeds=(0, 1, 2), holdout_per_class=5)
    assert set(res.accuracy) == {1, 5} and all(len(v) == 3 for v in res.accuracy.values())
    assert res.mean(5) > 0.95
    d = res.to_dict()
    assert set(d["5"]) == {"mean", "std", "per_seed", "l2"}
    # the evaluation split never influences the regulariser: shuffled eval labels, same choice
    res2 = fewshot_evaluate(pool_x, pool_y, eval_x, np.random.default_rng(0).permutation(eval_y),
                            shots=(1, 5), seeds=(0, 1, 2), holdout_per_class=5)
    assert res2.l2 == res.l2


def test_too_few_examples_is_a_clear_error():
    x, y = blobs(3, 2, 4, seed=0)
    with pytest.raises(ValueError, match=r"shots 5: with holdout_per_class 10, every class needs 15 examples in the "
                                         r"training pool; 2 class\(es\) have fewer \(class 0: 3, class 1: 3\)"):
        fewshot_evaluate(x, y, x, y, shots=(5,), seeds=(0,))
    with pytest.raises(ValueError, match="shots 2 0: each must be a positive integer"):
        fewshot_evaluate(x, y, x, y, shots=(2, 0), seeds=(0,), holdout_per_class=1)
    fewshot_evaluate(x, y, x, y, shots=(2,), seeds=(0,), holdout_per_class=1)  # 3 a class: 2 shots + 1 held out
    with pytest.raises(ValueError, match=r"^seeds: none given"):  # no draw at all: every mean was NaN
        fewshot_evaluate(x, y, x, y, shots=(2,), seeds=(), holdout_per_class=1)


def test_features_and_labels_that_do_not_pair_up_are_refused_by_name():
    """30 labels for 40 pool features drew the shots from the first 30 rows without a word; an
    evaluation split of another feature size failed in numpy's matmul."""
    rng = np.random.default_rng(0)
    pool_x, pool_y = rng.normal(size=(40, 3)), np.arange(40) % 2
    eval_x, eval_y = rng.normal(size=(4, 3)), np.arange(4) % 2
    for args in ((pool_x, pool_y[:30], eval_x, eval_y), (pool_x, pool_y, eval_x[:, :2], eval_y),
                 (pool_x, pool_y, eval_x, eval_y[:3]), (pool_x[:, :, None], pool_y, eval_x, eval_y)):
        with pytest.raises(ValueError, match=r"^expected pool_x \(P, d\), pool_y \(P,\), eval_x \(E, d\), eval_y \(E,\); got"):
            fewshot_evaluate(*args, shots=(1,), holdout_per_class=2)


def test_a_multi_label_sets_labels_are_refused_not_probed_by_their_first():
    """The (N, L) labels of a multi-label set (-1 filling a row): the probe is single-label, and its
    -1 was refused as a class id >= 0, not as what it is."""
    x, y = blobs(6, 2, 4, seed=0)
    sets = np.stack([y, np.where(np.arange(len(y)) % 3 == 0, 1 - y, -1)], axis=1)  # every third image: both classes
    fit = dict(shots=(2,), seeds=(0,), holdout_per_class=1)
    for pool_y, eval_y, name in ((sets, y, "pool_y"), (y, sets, "eval_y")):
        with pytest.raises(ValueError, match=rf"^{name}: labels of shape \(12, 2\), a multi-label set's \(4 of these 12 "
                                             r"images have several\); the few-shot probe is single-label"):
            fewshot_evaluate(x, pool_y, x, eval_y, **fit)
    with pytest.raises(ValueError, match=r"^the evaluation split: labels of shape \(12, 2\)"):
        check_shots(y, (2,), 1, eval_y=sets)
    # a single-label pool beside a multi-label evaluation set, both (N, L) as a run's data and its val_data join:
    # named is the part whose images have several labels
    single = np.stack([y, np.full_like(y, -1)], axis=1)
    with pytest.raises(ValueError, match=r"^the evaluation split: .* \(4 of these 12 images have several\)"):
        check_shots(single, (2,), 1, eval_y=sets)


def test_labels_seeds_and_regularisers_that_cannot_be_are_refused_by_name():
    """Evaluation labels of -1 were scored as a class no prediction matches, fractional labels and
    seeds were cut to integers, fit_ridge's label -1 trained the last class (numpy's index from
    the end), and an empty regulariser grid ended in max()'s "empty sequence" after the first fit."""
    x, y = blobs(6, 2, 4, seed=0)
    fit = dict(shots=(2,), seeds=(0,), holdout_per_class=1)
    for pool_y, eval_y, name in ((y, y - 1, "eval_y"), (y + 0.5, y, "pool_y"), (y, y.astype(bool), "eval_y")):
        with pytest.raises(ValueError, match=rf"^{name}: expected integer class ids >= 0"):
            fewshot_evaluate(x, pool_y, x, eval_y, **fit)
    for seeds in ((0.5,), (-1,)):
        with pytest.raises(ValueError, match=rf"^seeds={seeds[0]}: must be an integer >= 0"):
            fewshot_evaluate(x, y, x, y, **{**fit, "seeds": seeds})
    # the same seed twice is one draw counted twice (a spread of 0 between them); a shot count twice ran twice
    for name, values in (("seeds", (0, 0)), ("shots", (2, 2))):
        with pytest.raises(ValueError, match=rf"^{name} {values[0]} {values[1]}: each must be given once$"):
            fewshot_evaluate(x, y, x, y, **{**fit, name: values})
    # numpy's counts as a Python sequence's: an array met check_shots' truth test
    assert fewshot_evaluate(x, y, x, y, **{**fit, "shots": np.array([1, 2]), "seeds": np.arange(2)}).shots == [1, 2]
    for grid in ((), (1.0, 0.0), (float("nan"),)):
        with pytest.raises(ValueError, match=r"^l2_grid: expected regularisers > 0"):
            fewshot_evaluate(x, y, x, y, l2_grid=grid, **fit)
    for labels in (y - 1, y + 1):
        with pytest.raises(ValueError, match=r"^labels: expected class ids in \[0, 2\), got"):
            fit_ridge(x, labels, 2, 1.0)


@pytest.mark.parametrize("form,n,d", [("primal", 60, 8), ("dual", 12, 40)])
def test_standardized_fit_is_sklearn_ridge_on_big_visions_scaled_features(form, n, d):
    # big_vision's few-shot evaluator divides each feature by its std over the shots (+1e-5) before the
    # ridge: the fit must equal Ridge on those features, mapped back to the features as given
    rng = np.random.default_rng(n * d)
    x = (rng.normal(size=(n, d)) + 2.0) * rng.uniform(0.01, 100.0, size=d)  # features of very different scales
    y = np.arange(n) % 4
    scale = x.std(axis=0) + 1e-5
    fit = fit_ridge(x, y, 4, 3.0, form=form, standardize=True)
    oracle = Ridge(alpha=3.0, fit_intercept=True, solver="cholesky").fit(x / scale, signed_targets(y, 4))
    x_new = rng.normal(size=(7, d)) * 50
    np.testing.assert_allclose(fit.decision(x_new), oracle.predict(x_new / scale), rtol=1e-6, atol=1e-8)
    # and no longer the unscaled fit, which one lam weighs by the features' scales
    assert not np.allclose(fit.decision(x_new), fit_ridge(x, y, 4, 3.0, form=form).decision(x_new), rtol=1e-3)


def test_standardized_fewshot_is_blind_to_each_features_scale():
    pool_x, pool_y = blobs(20, 3, 12, seed=5, spread=3.0)
    eval_x, eval_y = blobs(10, 3, 12, seed=6, spread=3.0)
    scales = np.random.default_rng(7).uniform(1e-3, 1e3, size=12)
    kw = dict(shots=(2, 5), seeds=(0, 1), holdout_per_class=5, standardize=True)
    plain = fewshot_evaluate(pool_x, pool_y, eval_x, eval_y, **kw)
    scaled = fewshot_evaluate(pool_x * scales, pool_y, eval_x * scales, eval_y, **kw)
    assert plain.accuracy == scaled.accuracy and plain.l2 == scaled.l2
    with pytest.raises(TypeError, match="standardize='yes': expected True or False"):
        fewshot_evaluate(pool_x, pool_y, eval_x, eval_y, standardize="yes")


def test_a_class_the_pool_lacks_is_refused_not_scored_wrong():
    """An evaluation class with no example in the pool is one with 0 shots: its column's targets
    were all -1, so it was never predicted and its examples counted wrong (0.75 here), without a word."""
    x, y = blobs(12, 4, 6, seed=0)
    pool = y < 3
    with pytest.raises(ValueError, match=r"every class needs 5 examples in the training pool; 1 class\(es\) have "
                                         r"fewer \(class 3: 0\)"):
        fewshot_evaluate(x[pool], y[pool], x, y, shots=(2,), seeds=(0,), holdout_per_class=3)
    assert fewshot_evaluate(x[pool], y[pool], x[pool], y[pool], shots=(2,), seeds=(0,),
                            holdout_per_class=3).mean(2) > 0.9  # a pool without one class scores the others


def numpy_ridge(x, y, num_classes, l2):
    """An independent reference: the normal equations of [X 1] against {-1, 1}^K targets, the
    penalty on the weights only (no centring, no eigendecomposition)."""
    x = np.asarray(x, np.float64)
    targets = np.where(np.arange(num_classes) == np.asarray(y)[:, None], 1.0, -1.0)
    a = np.hstack([x, np.ones((len(x), 1))])
    solution = np.linalg.solve(a.T @ a + np.diag(np.r_[np.full(x.shape[1], l2), 0.0]), a.T @ targets)
    return solution[:-1], solution[-1], targets


@pytest.mark.parametrize("form", ["primal", "dual", None])
def test_matches_a_numpy_reference(form):
    x, y = blobs(10, 4, 6, seed=3)  # n 40 > d 6
    x = x * np.array([0.01, 0.1, 1.0, 10.0, 100.0, 1.0]) + 5.0  # features of different scales, off centre
    for l2 in (DEFAULT_L2_GRID[0], 0.3, 50.0, DEFAULT_L2_GRID[-1]):
        w, b, _ = numpy_ridge(x, y, 4, l2)
        fit = fit_ridge(x, y, 4, l2, form=form)
        np.testing.assert_allclose(fit.weights, w, rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(fit.bias, b, rtol=1e-6, atol=1e-12)
    # more features than examples (5 shots x 3 classes, 40-d): the reference's (d + 1)-square system
    x, y = blobs(5, 3, 40, seed=4)
    for l2 in (DEFAULT_L2_GRID[0], 2.0):
        w, b, _ = numpy_ridge(x, y, 3, l2)
        fit = fit_ridge(x, y, 3, l2, form=form)
        np.testing.assert_allclose(fit.weights, w, rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(fit.bias, b, rtol=1e-6, atol=1e-12)


def test_without_the_regulariser_it_is_least_squares():
    """l2 -> 0 with more examples than features: ordinary least squares with a bias, which lstsq
    solves another way (an orthogonal factorisation of [X 1])."""
    x, y = blobs(10, 4, 6, seed=3)
    x = x * np.array([0.01, 0.1, 1.0, 10.0, 100.0, 1.0]) + 5.0
    ols = np.linalg.lstsq(np.hstack([x, np.ones((len(x), 1))]), signed_targets(y, 4), rcond=None)[0]
    fit = fit_ridge(x, y, 4, 1e-9)
    np.testing.assert_allclose(fit.weights, ols[:-1], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(fit.bias, ols[-1], rtol=1e-6, atol=1e-7)


def test_float32_features_far_from_zero_are_fitted_to_the_optimum():
    """float32 features of spread 1e-3 around 1e4: X^T X of the raw features loses every digit of
    the spread, and the reference's normal equations with it; the fit meets the optimum's
    conditions (zero gradient in W and b) on the features as given, and separates the classes."""
    x, y = blobs(10, 3, 8, seed=5)
    x32 = (x * 1e-3 + 1e4).astype(np.float32)
    fit = fit_ridge(x32, y, 3, 1e-6)
    x64 = x32.astype(np.float64)
    residual = x64 @ fit.weights + fit.bias - signed_targets(y, 3)
    centred = x64 - x64.mean(axis=0)
    assert np.abs(residual.sum(axis=0)).max() < 1e-6  # d/db
    assert np.abs(centred.T @ residual + 1e-6 * fit.weights).max() < 1e-9  # d/dW, in the features' own scale
    assert (fit.predict(x32) == y).all()


def test_features_that_are_not_finite_are_refused_by_name():
    """A NaN among the shots ended in numpy's "Eigenvalues did not converge"; one in the evaluation
    split was scored as class 0, the argmax of a row of NaN, without a word."""
    x, y = blobs(12, 3, 4, seed=0)
    for name, row in (("pool_x", 0), ("eval_x", 1)):
        pool_x, eval_x = x.copy(), x.copy()
        (pool_x if name == "pool_x" else eval_x)[row, 2] = np.inf if row else np.nan
        with pytest.raises(ValueError, match=rf"^{name}: 1 of 36 feature rows hold NaN or infinite values"):
            fewshot_evaluate(pool_x, y, eval_x, y, shots=(2,), seeds=(0,), holdout_per_class=3)
