"""Class names: where a run keeps them, and where each export format has a place for them.

A training run writes ``classes.json`` beside its weights: a JSON list, class id -> name.
Exports carry the names wherever the target format has a place for them, so that the
target's own tools (and ``vitlab predict``) print names, not ids:

    format                                  place
    vitlab directory (save_model)           classes.json beside model.safetensors, and as below
    vitlab .safetensors                     the file's metadata "vitlab_classes" (a JSON list)
    Hugging Face (format="hf")              config.json's id2label and label2id
    timm (format="timm")                    label_names in the .timm.json's pretrained_cfg_overlay
    ONNX (vitlab.export.export_onnx)        the model's metadata_props id2label and label2id
    torch.export (export_program)           id2label.json and label2id.json, extra files of the .pt2
    vit_jax or big_transfer .npz            none: those files hold arrays only

``load.read_class_names`` reads them back from a file or folder of weights.  A name that more
than one class bears is written with its class id in every export but vitlab's own (``distinct_names``).

The loss the weights were trained with says what their outputs are probabilities of: a run of
``optim.loss="sigmoid_xent"`` gives each class's own sigmoid, which need not sum to 1, where a
softmax would rank and score them otherwise.  It travels where the format has a place for it:

    format                                  place
    vitlab file or directory (save_model)   the weights file's metadata "vitlab_loss"
    Hugging Face (format="hf")              config.json's problem_type: "multi_label_classification" for
                                            sigmoid_xent (what transformers' pipelines read as a sigmoid),
                                            "single_label_classification" for softmax_xent
    ONNX (vitlab.export.export_onnx)        the model's metadata_props problem_type, as Hugging Face's
    torch.export (export_program)           problem_type.json, an extra file of the .pt2 (a JSON string)
    timm (format="timm"), vit_jax .npz      none: timm's pretrained_cfg has no field for it

``load.read_loss`` reads it back (Hugging Face's problem_type of any folder or Hub model too).
"""
from __future__ import annotations

import json
import warnings
from typing import Any, Sequence

from vitlab.config import check_loss as config_check_loss

from .core import WeightsError

CLASSES_NAME = "classes.json"
CLASSES_KEY = "vitlab_classes"
LOSS_KEY = "vitlab_loss"
# a training run's optim.loss -> Hugging Face's problem_type of a model trained with it
PROBLEM_TYPES = {"softmax_xent": "single_label_classification", "sigmoid_xent": "multi_label_classification"}


def check_class_names(names: Any, num_classes: int, where: str) -> list[str]:
    """``names`` as a list of ``num_classes`` strings, else a one-line ``WeightsError`` naming ``where``."""
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise WeightsError(f"{where}: expected a list of class names (strings), one per class of the model")
    if len(names) != num_classes:
        raise WeightsError(f"{where}: {len(names)} class names for a model of {num_classes} classes")
    return list(names)


def distinct_names(names: Sequence[str]) -> list[str]:
    """``names`` with every name that more than one class bears followed by its class id, as the exports
    write them (ImageNet-1k's two classes "crane", the bird and the machine: "crane (134)", "crane (517)"),
    said in a warning.  A ``label2id`` maps a name to one class: Hugging Face's, built from ``id2label``
    as its config builds it, kept the last class of a name, and the other could not be looked up."""
    counts: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        counts.setdefault(name, []).append(i)
    shared = {name: ids for name, ids in counts.items() if len(ids) > 1}
    if not shared:
        return list(names)
    out = [f"{name} ({i})" if name in shared else name for i, name in enumerate(names)]
    if len(set(out)) < len(out):
        raise WeightsError(f"class_names: {', '.join(map(repr, shared))} name more than one class each, and with "
                           "their class ids they name another class too; give every class a name of its own")
    said = "; ".join(f"{name!r} ({', '.join(map(str, ids))})" for name, ids in shared.items())
    warnings.warn(f"class names that more than one class bears are written with their class ids, so that each "
                  f"name is one class's: {said}", stacklevel=3)
    return out


def id2label(names: Sequence[str]) -> dict[str, str]:
    """Hugging Face's ``id2label``: the class id as a string -> its name."""
    return {str(i): name for i, name in enumerate(names)}


def label2id(names: Sequence[str]) -> dict[str, int]:
    """Hugging Face's ``label2id``: a name -> its class id."""
    return {name: i for i, name in enumerate(names)}


def names_from_id2label(mapping: Any) -> list[str] | None:
    """The names of an ``id2label`` mapping whose ids are 0..K-1 (strings or ints), else None."""
    if not isinstance(mapping, dict) or not mapping:
        return None
    by_id = {str(k): v for k, v in mapping.items()}
    if set(by_id) != {str(i) for i in range(len(by_id))}:
        return None
    return [str(by_id[str(i)]) for i in range(len(by_id))]


def names_from_json(text: str, where: str) -> list[str]:
    """The list of class names a JSON text holds (``classes.json``, metadata), or a one-line error."""
    try:
        names = json.loads(text)
    except ValueError as e:
        raise WeightsError(f"{where}: not valid JSON: {e}") from e
    if not isinstance(names, list) or not all(isinstance(n, (str, int, float)) for n in names):
        raise WeightsError(f"{where}: expected a JSON list of class names")
    return [str(n) for n in names]


def check_loss(loss: Any, where: str) -> str:
    """``loss`` (a run's ``optim.loss``, ``vitlab.config.LOSSES``), else a one-line ``WeightsError`` naming
    ``where``."""
    return config_check_loss(loss, where, WeightsError)


def loss_of_problem_type(problem_type: Any, where: str) -> str | None:
    """The loss of a Hugging Face ``problem_type``: "multi_label_classification" is a sigmoid per class
    (transformers' pipelines apply one), "single_label_classification" a softmax; None where it says
    neither (absent, or "regression", whose outputs are no class probabilities).  Another value, which
    transformers refuses too, is a one-line ``WeightsError`` naming ``where``."""
    if problem_type is None or problem_type == "regression":
        return None
    for loss, kind in PROBLEM_TYPES.items():
        if kind == problem_type:
            return loss
    allowed = ", ".join(map(repr, ["regression", *PROBLEM_TYPES.values()]))
    raise WeightsError(f"{where}={problem_type!r}: allowed values are {allowed}, or none")
