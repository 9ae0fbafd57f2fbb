"""Few-shot linear evaluation (paper Sec. 4.1, "Metrics"): closed-form regularised least
squares from frozen representations to {-1, 1}^K targets, as big_vision's evaluator does
(its differences: below).

Derivation.  Features X (n, d), labels y, targets T (n, K) with T_ic = +1 if y_i = c else
-1.  We fit an affine map x -> W^T x + b, W (d, K), b (K,), penalising W but not b:

    L(W, b) = || X W + 1 b^T - T ||^2 + lam || W ||^2.

dL/db = 0 gives b = t_mean - W^T x_mean.  Substituting, with centred Xc = X - 1 x_mean^T and
Tc = T - 1 t_mean^T, the problem is an ordinary ridge problem without bias,

    L(W) = || Xc W - Tc ||^2 + lam || W ||^2,   dL/dW = 0:  (Xc^T Xc + lam I) W = Xc^T Tc,

    primal (d x d solve):  W = (Xc^T Xc + lam I)^-1 Xc^T Tc.

With the push-through identity (Xc^T Xc + lam I)^-1 Xc^T = Xc^T (Xc Xc^T + lam I)^-1,

    dual   (n x n solve):  W = Xc^T A,   A = (Xc Xc^T + lam I)^-1 Tc,

which is cheaper when n < d (5 shots x 10 classes = 50 examples against d = 768).
Sweeping lam costs one eigendecomposition: if M = Xc^T Xc (or Xc Xc^T) = V diag(s) V^T,
then (M + lam I)^-1 = V diag(1 / (s + lam)) V^T for every lam.  This is exactly what
scikit-learn's Ridge(alpha=lam, fit_intercept=True) computes, which the tests use as an
independent oracle.  A test example is classified as argmax_c (x^T W + b)_c.

The regulariser is vitlab's own choice: swept over 2^-10 .. 2^19 (``DEFAULT_L2_GRID``) and chosen
on held-out *training* examples (disjoint from the k shots), never on the evaluation split; ties
go to the largest lam, the most regularised model.  The paper does not say how its regulariser
was set.

Where big_vision's evaluator differs (big_vision/evaluators/fewshot_lsr.py, with the setting of
big_vision/configs/common_fewshot.py).  It fits one fixed regulariser, l2_reg = 2^10, chosen
neither per set nor per shot count.  It first scales each feature to unit variance over the
shots (x -> (x - mean) / (std + 1e-5)), so that one lam weighs every feature alike whatever its
scale; ``standardize=True`` does the same (its 2^10 is a lam for features so scaled).  Scaling
the columns of X by S turns the problem into one in X S^-1, whose solution W' maps back to
W = S^-1 W' on the features as they are: the fit stays an affine map of the unscaled features.
It is off by default (the figures in docs/ were measured without it).  big_vision's bias is a
constant feature of 100, almost unpenalised; here it is exactly unpenalised.  The sweep of
2^-10 .. 2^19 is that of Scenic's few-shot evaluator (adapted from big_vision's), which scores
every rate on the evaluation split and reports the one best ranked over its sets; vitlab's
chooses on training examples instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from vitlab.data.splits import check_seed, few_per_class

__all__ = [
    "DEFAULT_L2_GRID",
    "RidgeFit",
    "RidgeSolver",
    "fit_ridge",
    "signed_targets",
    "check_one_label",
    "select_l2",
    "FewShotResult",
    "fewshot_evaluate",
]

# vitlab's sweep (big_vision fits 2^10 alone; module text); with few shots and wide features the best value is
# often large
DEFAULT_L2_GRID: tuple[float, ...] = tuple(2.0**p for p in range(-10, 20))


def signed_targets(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """(n,) class ids -> (n, K) float64 targets in {-1, +1}."""
    labels = np.asarray(labels, dtype=np.int64)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):  # -1 set the last class's column
        raise ValueError(f"labels: expected class ids in [0, {num_classes}), got [{labels.min()}, {labels.max()}]")
    t = -np.ones((len(labels), num_classes))
    t[np.arange(len(labels)), labels] = 1.0
    return t


@dataclass(frozen=True)
class RidgeFit:
    """An affine classifier: scores = x @ weights + bias; weights (d, K), bias (K,)."""

    weights: np.ndarray
    bias: np.ndarray
    l2: float

    def decision(self, x: np.ndarray) -> np.ndarray:
        """(m, d) -> (m, K) scores."""
        return np.asarray(x, dtype=np.float64) @ self.weights + self.bias

    def predict(self, x: np.ndarray) -> np.ndarray:
        """(m, d) -> (m,) class ids."""
        return self.decision(x).argmax(axis=1)


class RidgeSolver:
    """One eigendecomposition of X, then a closed-form fit for any regulariser.

    features (n, d), targets (n, K).  form: "primal" decomposes Xc^T Xc (d x d), "dual"
    decomposes Xc Xc^T (n x n); None the smaller of the two.  standardize: each feature scaled
    to unit variance over these examples first (big_vision's few-shot evaluator; module text);
    the fits are still of the features as given.
    """

    def __init__(self, features: np.ndarray, targets: np.ndarray, form: str | None = None,
                 standardize: bool = False) -> None:
        x = np.asarray(features, dtype=np.float64)
        t = np.asarray(targets, dtype=np.float64)
        if x.ndim != 2 or t.ndim != 2 or len(x) != len(t) or len(x) == 0:
            raise ValueError(f"expected features (n, d) and targets (n, K), got {x.shape} and {t.shape}")
        if form not in (None, "primal", "dual"):
            raise ValueError(f"form={form!r}: allowed values are 'primal', 'dual' and None (the smaller)")
        if not isinstance(standardize, bool):
            raise TypeError(f"standardize={standardize!r}: expected True or False")
        n, d = x.shape
        self.form = form or ("dual" if n < d else "primal")
        self.x_mean, self.t_mean = x.mean(axis=0), t.mean(axis=0)
        # the features' scales (S): 1, or big_vision's std + 1e-5 over the examples fitted
        self.scale = x.std(axis=0) + 1e-5 if standardize else np.ones(d)
        self.xc, tc = (x - self.x_mean) / self.scale, t - self.t_mean
        gram = self.xc.T @ self.xc if self.form == "primal" else self.xc @ self.xc.T
        s, v = np.linalg.eigh(gram)
        self.s = np.clip(s, 0.0, None)  # a Gram matrix is PSD; clip rounding noise
        self.v = v
        # project once: V^T Xc^T Tc (primal) or V^T Tc (dual)
        self.vt_rhs = v.T @ (self.xc.T @ tc if self.form == "primal" else tc)

    def fit(self, l2: float) -> RidgeFit:
        if not l2 > 0:
            raise ValueError(f"l2={l2}: the regulariser must be positive")
        solved = self.v @ (self.vt_rhs / (self.s + l2)[:, None])  # (M + lam I)^-1 rhs
        weights = (solved if self.form == "primal" else self.xc.T @ solved) / self.scale[:, None]  # S^-1 W'
        return RidgeFit(weights=weights, bias=self.t_mean - self.x_mean @ weights, l2=float(l2))


def fit_ridge(features: np.ndarray, labels: np.ndarray, num_classes: int, l2: float,
              form: str | None = None, standardize: bool = False) -> RidgeFit:
    """Least squares from features (n, d) to {-1, 1}^K targets of ``labels``, with an unpenalised bias
    (``standardize``: ``RidgeSolver``'s)."""
    return RidgeSolver(features, signed_targets(labels, num_classes), form, standardize).fit(l2)


def select_l2(solver: RidgeSolver, holdout_x: np.ndarray, holdout_y: np.ndarray,
              grid: Sequence[float] = DEFAULT_L2_GRID) -> tuple[float, np.ndarray]:
    """The regulariser of ``grid`` with the best held-out accuracy (ties: the largest),
    and the accuracy of every grid value (len(grid),)."""
    accs = np.array([np.mean(solver.fit(l2).predict(holdout_x) == holdout_y) for l2 in grid])
    best = max(i for i in range(len(grid)) if accs[i] == accs.max())  # ties: most regularised
    return float(grid[best]), accs


@dataclass
class FewShotResult:
    """Accuracies on the evaluation split, per shot count and seed."""

    shots: list[int]
    seeds: list[int]
    accuracy: dict[int, list[float]] = field(default_factory=dict)  # shot -> per seed
    l2: dict[int, list[float]] = field(default_factory=dict)  # shot -> chosen regulariser per seed

    def mean(self, shot: int) -> float:
        return float(np.mean(self.accuracy[shot]))

    def std(self, shot: int) -> float:
        """Sample standard deviation over seeds (0 for one seed)."""
        a = self.accuracy[shot]
        return float(np.std(a, ddof=1)) if len(a) > 1 else 0.0

    def to_dict(self) -> dict:
        return {
            str(k): {"mean": self.mean(k), "std": self.std(k), "per_seed": self.accuracy[k], "l2": self.l2[k]}
            for k in self.shots
        }


def several_labels(labels: np.ndarray) -> int:
    """How many rows of (N, L) labels (-1 filling a row) hold more than one label; 0 for (N,) labels."""
    labels = np.asarray(labels)
    return int(((labels >= 0).sum(axis=1) > 1).sum()) if labels.ndim == 2 else 0


def check_one_label(labels: np.ndarray, name: str) -> None:
    """Refuse the (N, L) labels of a multi-label set (each image's labels, -1 filling a row, as
    ``vitlab.data`` reads JFT-style shards): the probe is single-label, as the paper's (Sec. 4.1),
    each image's target the {-1, 1}^K row of its one class, k images drawn of every class and
    scored by top-1.  Taking each image's first label (the set's ``labels``) drew and scored a
    probe of the set that no image's other labels counted in, without a word."""
    labels = np.asarray(labels)
    if labels.ndim != 2:
        return
    raise ValueError(f"{name}: labels of shape {tuple(labels.shape)}, a multi-label set's ({several_labels(labels)} "
                     f"of these {len(labels)} images have several); the few-shot probe is single-label (paper Sec. "
                     "4.1: each image's target is one class's row of {-1, 1}^K, k images drawn of every class, scored "
                     "by top-1): give a set of one label per image (`vitlab eval` scores a multi-label set by "
                     "precision@1)")


def check_shots(pool_y: np.ndarray, shots: Sequence[int], holdout_per_class: int,
                names: tuple[str, str] = ("shots", "holdout_per_class"), eval_y: np.ndarray | None = None) -> None:
    """Refuse, before any work, shot counts that are not positive integers and a pool in which some
    class has fewer than the largest k plus ``holdout_per_class`` examples (each draw takes both
    from it); ``names`` are the two settings' names for the message.  A class of ``eval_y`` that
    the pool lacks counts as having none (it was never predicted, its examples scored wrong).  Labels
    (N, L) of a multi-label set are refused (``check_one_label``)."""
    shots_name, holdout_name = names
    parts = [(name, y) for name, y in (("the training pool", pool_y), ("the evaluation split", eval_y)) if y is not None]
    # the part with images of several labels named first: a run's multi-label data.val_data beside its training set
    for name, labels in sorted(parts, key=lambda part: -several_labels(part[1])):
        check_one_label(labels, name)
    bad = [k for k in shots if not isinstance(k, (int, np.integer)) or k < 1]
    if not shots or bad:
        raise ValueError(f"{shots_name} {' '.join(map(str, shots)) or '(none)'}: each must be a positive integer")
    if len(set(shots)) < len(shots):  # evaluated twice, the second over the first, and listed twice
        raise ValueError(f"{shots_name} {' '.join(map(str, shots))}: each must be given once")
    if not isinstance(holdout_per_class, (int, np.integer)) or holdout_per_class < 1:
        raise ValueError(f"{holdout_name} {holdout_per_class}: must be a positive integer")
    need = max(shots) + holdout_per_class
    classes, counts = np.unique(np.asarray(pool_y), return_counts=True)
    if eval_y is not None:
        unseen = np.setdiff1d(np.unique(np.asarray(eval_y)), classes)
        classes, counts = np.concatenate([classes, unseen]), np.concatenate([counts, np.zeros(len(unseen), int)])
    short = [(int(c), int(n)) for c, n in zip(classes, counts) if n < need]
    if short:
        listed = ", ".join(f"class {c}: {n}" for c, n in short[:5])
        raise ValueError(f"{shots_name} {max(shots)}: with {holdout_name} {holdout_per_class}, every class needs "
                         f"{need} examples in the training pool; {len(short)} class(es) have fewer ({listed})")


def fewshot_evaluate(
    pool_x: np.ndarray, pool_y: np.ndarray, eval_x: np.ndarray, eval_y: np.ndarray,
    shots: Sequence[int] = (1, 5, 10, 25), seeds: Sequence[int] = (0, 1, 2),
    l2_grid: Sequence[float] = DEFAULT_L2_GRID, holdout_per_class: int = 10, form: str | None = None,
    standardize: bool = False,
) -> FewShotResult:
    """k-shot linear accuracy on the evaluation split for every k in ``shots`` and seed.

    pool_x (P, d), pool_y (P,): the training pool; for each (k, seed) k examples per class
        are drawn as the training set and ``holdout_per_class`` others per class to choose
        the regulariser from ``l2_grid``.
    eval_x (E, d), eval_y (E,): the evaluation split, used only for the final accuracy.
    standardize: scale each feature to unit variance over the shots first, as big_vision's
        evaluator does (module text).
    """
    if not isinstance(standardize, bool):
        raise TypeError(f"standardize={standardize!r}: expected True or False")
    pool_x, eval_x = np.asarray(pool_x, np.float64), np.asarray(eval_x, np.float64)
    for name, labels in (("pool_y", pool_y), ("eval_y", eval_y)):
        check_one_label(labels, name)  # a multi-label set's -1 fill was refused as a class id, not as what it is
        # checked before the cast: an evaluation label -1 was scored as a class nothing predicts, 1.5 cut to 1
        labels = np.asarray(labels)
        if labels.size and (not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0):
            raise ValueError(f"{name}: expected integer class ids >= 0, got {labels.dtype} values from {labels.min()}")
    pool_y, eval_y = np.asarray(pool_y, np.int64), np.asarray(eval_y, np.int64)
    # one label per feature row, one feature size: a shorter pool_y drew from the first rows only,
    # and features of another size failed in numpy's matmul
    if (pool_x.ndim != 2 or eval_x.ndim != 2 or pool_x.shape[1] != eval_x.shape[1]
            or pool_y.shape != pool_x.shape[:1] or eval_y.shape != eval_x.shape[:1]):
        raise ValueError(f"expected pool_x (P, d), pool_y (P,), eval_x (E, d), eval_y (E,); got {pool_x.shape}, "
                         f"{pool_y.shape}, {eval_x.shape}, {eval_y.shape}")
    for name, x in (("pool_x", pool_x), ("eval_x", eval_x)):
        # a NaN among the shots ended in eigh's "Eigenvalues did not converge", elsewhere a row scored as class 0
        bad = int((~np.isfinite(x)).any(axis=1).sum())
        if bad:
            raise ValueError(f"{name}: {bad} of {len(x)} feature rows hold NaN or infinite values (a diverged "
                             "model's?); the fit and its scores need finite features")
    shots, seeds = list(shots), list(seeds)  # a numpy array of shots met check_shots' truth test
    check_shots(pool_y, shots, holdout_per_class, eval_y=eval_y)
    if len(seeds) == 0:  # no draw: every accuracy list stayed empty, and its mean NaN
        raise ValueError("seeds: none given; each is one random draw of the shots, e.g. (0, 1, 2)")
    for seed in seeds:  # a seed of 0.5 was cut to 0
        check_seed(seed, "seeds")
    if len(set(seeds)) < len(seeds):  # the same draw, counted twice in the mean and the spread
        raise ValueError(f"seeds {' '.join(map(str, seeds))}: each must be given once")
    if len(l2_grid) == 0 or not all(l2 > 0 for l2 in l2_grid):  # found at the first fit, or as max()'s empty sequence
        raise ValueError(f"l2_grid: expected regularisers > 0 to choose from, got {tuple(l2_grid)}")
    num_classes = int(max(pool_y.max(), eval_y.max())) + 1
    result = FewShotResult(shots=[int(k) for k in shots], seeds=[int(s) for s in seeds])
    for k in result.shots:
        result.accuracy[k], result.l2[k] = [], []
        for seed in result.seeds:
            train = few_per_class(pool_y, k, seed).numpy()
            rest = np.setdiff1d(np.arange(len(pool_y)), train)
            holdout = rest[few_per_class(pool_y[rest], holdout_per_class, seed).numpy()]
            solver = RidgeSolver(pool_x[train], signed_targets(pool_y[train], num_classes), form, standardize)
            l2, _ = select_l2(solver, pool_x[holdout], pool_y[holdout], l2_grid)
            acc = float(np.mean(solver.fit(l2).predict(eval_x) == eval_y))
            result.accuracy[k].append(acc)
            result.l2[k].append(l2)
    return result
