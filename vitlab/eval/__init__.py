"""Evaluation of frozen models: the evaluator (``Evaluator.run(model) -> dict``, shared by the
trainer and `vitlab eval`), classification metrics, feature extraction, few-shot linear probes."""
from .evaluator import Evaluator
from .features import FeatureCache, class_probabilities, extract_features, file_key, predict_logits
from .fewshot import DEFAULT_L2_GRID, FewShotResult, RidgeFit, RidgeSolver, fewshot_evaluate, fit_ridge
from .metrics import (
    classification_report,
    confusion_matrix,
    expected_calibration_error,
    per_class_accuracy,
    softmax,
    topk_accuracy,
)

__all__ = [
    "Evaluator",
    "FeatureCache", "class_probabilities", "extract_features", "file_key", "predict_logits",
    "DEFAULT_L2_GRID", "FewShotResult", "RidgeFit", "RidgeSolver", "fewshot_evaluate", "fit_ridge",
    "classification_report", "confusion_matrix", "expected_calibration_error", "per_class_accuracy",
    "softmax", "topk_accuracy",
]
