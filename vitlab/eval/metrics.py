"""Classification metrics as pure functions of arrays: scores (N, K) and labels (N,).

``scores`` may be logits or probabilities wherever only their ranking matters (top-k,
confusion); calibration needs probabilities, which ``softmax`` gives, or ``sigmoid`` of a model
trained with a per-class sigmoid loss (sigmoid_xent).  Everything is
numpy so that the functions are easy to check by hand and run anywhere.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .features import check_loss

__all__ = [
    "softmax",
    "sigmoid",
    "topk_accuracy",
    "confusion_matrix",
    "per_class_accuracy",
    "expected_calibration_error",
    "classification_report",
]


def _check(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scores, labels = np.asarray(scores), np.asarray(labels)
    if scores.ndim != 2 or labels.ndim != 1 or scores.shape[0] != labels.shape[0]:
        raise ValueError(f"expected scores (N, K) and labels (N,), got {scores.shape} and {labels.shape}")
    if scores.shape[0] == 0:
        raise ValueError("no examples to score")
    if labels.min() < 0 or labels.max() >= scores.shape[1]:
        raise ValueError(f"labels must lie in [0, {scores.shape[1]}), got [{labels.min()}, {labels.max()}]")
    return scores, labels.astype(np.int64)


def softmax(logits: np.ndarray) -> np.ndarray:
    """(N, K) logits -> (N, K) probabilities, computed stably in float64."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def sigmoid(logits: np.ndarray) -> np.ndarray:
    """(N, K) logits -> (N, K) each class's own probability, 1 / (1 + exp(-z)), stably in float64."""
    return np.exp(-np.logaddexp(0.0, -np.asarray(logits, dtype=np.float64)))


def topk_accuracy(scores: np.ndarray, labels: np.ndarray, ks: Sequence[int] = (1, 5)) -> dict[int, float]:
    """Fraction of examples whose label is among the k highest scores, for each k.

    Ties are broken by the lower class index (a stable sort), so the answer is
    deterministic; NaN counts above every number, as argmax (``confusion_matrix``'s predictions)
    and the evaluator rank it (numpy's sort put it below every number: a label scored 0.3 beside
    a NaN was a top-1 hit that the confusion matrix of the same report counted as an error).
    k larger than the number of classes counts every example as correct.
    """
    scores, labels = _check(scores, labels)
    rank = label_rank(torch.from_numpy(np.ascontiguousarray(scores)), torch.from_numpy(labels)).numpy()  # the evaluator's ranking
    return {int(k): float(np.mean(rank < k)) for k in ks}


def confusion_matrix(labels: np.ndarray, predictions: np.ndarray, num_classes: int) -> np.ndarray:
    """(K, K) int64 counts; row = true class, column = predicted class."""
    labels, predictions = np.asarray(labels, dtype=np.int64), np.asarray(predictions, dtype=np.int64)
    if labels.shape != predictions.shape:
        raise ValueError(f"labels {labels.shape} and predictions {predictions.shape} differ in shape")
    for name, values in (("labels", labels), ("predictions", predictions)):
        # an index outside [0, K) landed in another cell, or failed in the reshape below
        if values.size and (values.min() < 0 or values.max() >= num_classes):
            raise ValueError(f"{name} must lie in [0, {num_classes}), got [{values.min()}, {values.max()}]")
    flat = labels * num_classes + predictions
    return np.bincount(flat, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def per_class_accuracy(confusion: np.ndarray) -> np.ndarray:
    """(K,) recall of each class from a confusion matrix; NaN for a class with no examples."""
    confusion = np.asarray(confusion)
    support = confusion.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(support > 0, np.diag(confusion) / np.maximum(support, 1), np.nan)


def check_num_bins(num_bins, name: str = "num_bins") -> None:
    """ECE's bins: a positive integer (numpy's bincount refused 0 and negatives with a message
    about its own arguments, and only after every example had been scored)."""
    if not isinstance(num_bins, (int, np.integer)) or isinstance(num_bins, bool) or num_bins < 1:
        raise ValueError(f"{name}={num_bins!r}: must be a positive integer (confidence bins of the calibration error)")


def expected_calibration_error(probs: np.ndarray, labels: np.ndarray, num_bins: int = 15) -> float:
    """ECE with ``num_bins`` equal-width confidence bins (Guo et al. 2017; Naeini et al. 2015).

    confidence_i = max_k p_ik, correct_i = [argmax_k p_ik == y_i].  Bin b holds the examples
    with confidence in ((b-1)/M, b/M] (the first bin also takes 0), and

        ECE = sum_b |B_b| / N * | mean(correct in B_b) - mean(confidence in B_b) |.
    """
    check_num_bins(num_bins)
    probs, labels = _check(probs, labels)
    confidence = probs.max(axis=1)
    correct = (probs.argmax(axis=1) == labels).astype(np.float64)
    # right-closed bins: ceil(c * M) - 1, with c = 0 placed in the first bin
    bins = np.clip(np.ceil(confidence * num_bins).astype(np.int64) - 1, 0, num_bins - 1)
    acc_sum = np.bincount(bins, weights=correct, minlength=num_bins)
    conf_sum = np.bincount(bins, weights=confidence, minlength=num_bins)
    return float(np.sum(np.abs(acc_sum - conf_sum)) / len(labels))  # |B|*|acc-conf| = |sum acc - sum conf|


def classification_report(logits: np.ndarray, labels: np.ndarray, num_classes: int | None = None,
                          num_bins: int = 15, loss: str = "softmax_xent") -> dict:
    """All metrics of ``vitlab eval`` from logits (N, K) and labels (N,).

    Returns a JSON-ready dict: ``top1``, ``top5`` (fractions), ``per_class_accuracy`` (K,),
    ``confusion_matrix`` (K, K), ``ece`` (``num_bins`` bins), ``n``.  ``loss``: the probabilities
    whose calibration ECE measures, those the model was trained to give: "softmax_xent" the
    logits' softmax, "sigmoid_xent" each class's sigmoid (a run's ``optim.loss``).
    """
    check_loss(loss)
    logits, labels = _check(logits, labels)
    k = num_classes or logits.shape[1]
    top = topk_accuracy(logits, labels, (1, 5))
    confusion = confusion_matrix(labels, logits.argmax(axis=1), k)
    return {
        "n": int(len(labels)),
        "top1": top[1],
        "top5": top[5],
        "ece": expected_calibration_error((sigmoid if loss == "sigmoid_xent" else softmax)(logits), labels, num_bins),
        "per_class_accuracy": [None if np.isnan(a) else float(a) for a in per_class_accuracy(confusion)],
        "confusion_matrix": confusion.tolist(),
    }


def label_rank(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(N,) the place of each row's label among its (N, K) ``logits`` from the highest, 0 first, as
    a stable sort (descending) places it: equal scores go to the lower class index, as argmax (the
    confusion matrix, the evaluator's nested sets) and ``topk_accuracy`` give them, and NaN, which
    torch's sort puts above every number, counts above them too.  Counted, not sorted: a sort of
    an ImageNet-21k head's 21,843 classes held indices and values of every class of the batch
    (``torch.topk`` is light but orders equal scores its own way)."""
    labels = labels.long()[:, None]  # any integer type the evaluator takes
    own = logits.gather(1, labels)
    nan, own_nan = logits.isnan(), own.isnan()
    above = (logits > own) | (nan & ~own_nan)
    lower = torch.arange(logits.shape[-1], device=logits.device) < labels
    return (above | (((logits == own) | (nan & own_nan)) & lower)).sum(-1)
