"""Export a model for serving: ONNX (for ONNX Runtime and others) or a torch.export program.

Both take a model and an image size, trace one forward pass in eval mode (the model is
given back in the modes it came in, module by module), and write one file.  The batch
dimension is left symbolic unless ``dynamic_batch=False``; the image size is fixed, because
the position embeddings are laid out for one patch grid.

The input the model reads travels with the file, for whoever runs it without vitlab
(``vitlab.weights.core.input_preprocessing``): ``image_size`` [H, W], ``input_layout`` NCHW,
``channel_order`` RGB, pixels p in 0..255 as ``(p * rescale_factor - mean) / std`` per channel
(``rescale_factor`` 1/255, ``mean`` and ``std`` 0.5: vitlab's ``p / 127.5 - 1``), after ``resize``:
the whole image to ``image_size`` with ``interpolation`` bilinear (Pillow's), as ``vitlab predict``
does, of the image decoded as ``decode`` says (EXIF orientation not applied, alpha dropped).  ONNX:
one metadata_props entry each (lists and numbers as JSON); a .pt2 archive: the extra file
``preprocessing.json``.  ``read_preprocessing`` reads either back (an earlier export's, without ``decode``, too).

Class names, when given, travel with the file in Hugging Face's terms: ONNX metadata_props
``id2label`` and ``label2id`` (JSON), and the extra files ``id2label.json`` and ``label2id.json``
of a .pt2 archive (``program_class_names`` reads them back); a name that more than one class
bears is written with its class id (``labels.distinct_names``).  So does the loss the model was
trained with, when given, as Hugging Face's ``problem_type`` (``labels.PROBLEM_TYPES``): ONNX
metadata_props ``problem_type``, the extra file ``problem_type.json`` of a .pt2 (a JSON string);
"multi_label_classification" (a ``sigmoid_xent`` run's): each class's probability is the sigmoid
of its logit, not the softmax of them all.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from .config import Pair, ViTConfig, to_pair
from .modes import evaluating
from .weights.core import input_preprocessing
from .weights.labels import (PROBLEM_TYPES, check_class_names, check_loss, distinct_names, id2label, label2id,
                             names_from_id2label)

__all__ = ["export_onnx", "export_program", "load_program", "model_img_size", "program_class_names",
           "read_preprocessing"]

PREPROCESSING_FILE = "preprocessing.json"  # the extra file of a .pt2 that states the model's input
# the entries of that record in an ONNX model's metadata_props: JSON, but for those of plain text
# (an export of before "decode" was recorded has every other)
PREPROCESSING_KEYS = ("image_size", "input_layout", "channel_order", "decode", "rescale_factor", "mean", "std",
                      "interpolation", "resize")
TEXT_KEYS = ("input_layout", "channel_order", "decode", "interpolation", "resize")


def model_img_size(model: nn.Module, img_size: int | Pair | None = None) -> Pair:
    """``img_size`` if given (one the model takes), else the size in the model's config.

    A ViT takes its config's size only, unless it has ``dynamic_img_size``, and a grid of whole
    patches: another was refused from inside the trace, by torch.onnx as a page about torch.export."""
    cfg = getattr(model, "cfg", None)
    if img_size is None:
        if cfg is None:
            raise ValueError(f"{type(model).__name__} has no cfg; pass img_size")
        return cfg.img_size
    size = to_pair(img_size, "img_size")
    if isinstance(cfg, ViTConfig) and not cfg.dynamic_img_size and size != cfg.img_size:
        raise ValueError(f"img_size={img_size!r}: the model takes {cfg.img_size[0]}x{cfg.img_size[1]} images, "
                         "the size its position embeddings are laid out for; load it at this size "
                         "(load_model(..., img_size=...)) or with dynamic_img_size=True")
    if isinstance(cfg, ViTConfig) and not cfg.divides_into_patches(size):
        raise ValueError(f"img_size={img_size!r}: not a grid of whole {cfg.patch_size[0]}x{cfg.patch_size[1]} "
                         "patches")
    return size


def _example(model: nn.Module, img_size: Pair, batch: int, dynamic_batch: bool) -> torch.Tensor:
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r}: expected a positive integer")
    if dynamic_batch and batch < 2:  # torch.export takes a dimension of size 1 for a constant
        raise ValueError(f"batch={batch}: a dynamic batch is traced on an example of 2 or more images; "
                         "pass dynamic_batch=False for a program of batch 1 only")
    param = next(model.parameters())
    in_chans = getattr(model.cfg, "in_chans", 3) if hasattr(model, "cfg") else 3
    # from a generator of its own: drawn from the global stream, an export would change what the caller draws next
    numbers = torch.Generator().manual_seed(0)
    return torch.randn(batch, in_chans, *img_size, generator=numbers).to(device=param.device, dtype=param.dtype)


def _batch_shapes(dynamic_batch: bool) -> tuple[dict, ...] | None:
    """torch.export's dynamic shapes of the one input: its batch any size (no upper bound, which a
    .pt2 program checks at every call) when ``dynamic_batch``."""
    return ({0: torch.export.Dim("batch", min=1)},) if dynamic_batch else None


def _label_maps(model: nn.Module, class_names: Sequence[str] | None) -> dict[str, str]:
    """{"id2label": JSON, "label2id": JSON} of ``class_names`` (checked against the model's head), or {}."""
    if class_names is None:
        return {}
    num_classes = getattr(getattr(model, "cfg", None), "num_classes", len(class_names))
    names = distinct_names(check_class_names(class_names, num_classes, "class_names"))
    return {"id2label": json.dumps(id2label(names)), "label2id": json.dumps(label2id(names))}


def _problem_type(loss: str | None) -> dict[str, str]:
    """{"problem_type": Hugging Face's name of what ``loss`` trained the outputs to be}, or {} for None."""
    return {} if loss is None else {"problem_type": PROBLEM_TYPES[check_loss(loss, "loss")]}


def _preprocessing(model: nn.Module, img_size: Pair) -> dict[str, object]:
    """The input the model reads at ``img_size`` (``input_preprocessing``), or {} for a model without a config."""
    cfg = getattr(model, "cfg", None)
    return {} if cfg is None else input_preprocessing(cfg, img_size)


def _as_metadata(record: dict[str, object]) -> dict[str, str]:
    """ONNX metadata_props hold strings: a string as it is, anything else as JSON."""
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in record.items()}


def export_program(model: nn.Module, path: str | os.PathLike, img_size: int | Pair | None = None,
                   dynamic_batch: bool = True, batch: int = 2, class_names: Sequence[str] | None = None,
                   loss: str | None = None) -> torch.export.ExportedProgram:
    """Trace ``model`` with ``torch.export`` and save it with ``torch.export.save`` (a .pt2 file).

    Reload with ``load_program(path)``, which gives a callable module: images (B, C, H, W)
    -> logits (B, K).  ``batch`` is the batch of the traced example, and the only one
    accepted when ``dynamic_batch`` is False.  ``class_names`` are stored beside the program,
    and ``loss`` (the ``optim.loss`` it was trained with) as its ``problem_type``.
    """
    labels = _label_maps(model, class_names)
    problem = _problem_type(loss)
    size = model_img_size(model, img_size)
    x = _example(model, size, batch, dynamic_batch)
    with torch.no_grad(), evaluating(model):
        program = torch.export.export(model, (x,), dynamic_shapes=_batch_shapes(dynamic_batch))
    extra = {f"{k}.json": v for k, v in labels.items()} | {f"{k}.json": json.dumps(v) for k, v in problem.items()}
    preprocessing = _preprocessing(model, size)
    if preprocessing:
        extra[PREPROCESSING_FILE] = json.dumps(preprocessing)
    _write_in_place_of(Path(path), lambda tmp: torch.export.save(program, tmp, extra_files=extra))
    return program


def _write_in_place_of(path: Path, write: Callable[[Path], object]) -> None:
    """``write(p)`` to ``p``, a path of ``path``'s name in a temporary folder beside it, then its
    files renamed into place, ``path`` last: an export that fails or is interrupted while writing
    leaves the file it would replace as it was (the exporters write in place, and left it cut short).
    The folder keeps the names an ONNX file gives its external data."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        write(staging / path.name)
        for written in sorted(staging.iterdir(), key=lambda f: f.name == path.name):
            os.replace(written, path.parent / written.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_program(path: str | os.PathLike) -> nn.Module:
    """The module of a program saved by ``export_program``."""
    return torch.export.load(path).module()


def program_class_names(path: str | os.PathLike) -> list[str] | None:
    """The class names saved with a program by ``export_program``, or None."""
    extra = {"id2label.json": ""}
    torch.export.load(path, extra_files=extra)
    return names_from_id2label(json.loads(extra["id2label.json"])) if extra["id2label.json"] else None


def read_preprocessing(path: str | os.PathLike) -> dict[str, object] | None:
    """The input an exported model reads, as ``export_onnx`` or ``export_program`` recorded it (a .pt2
    archive is told from an ONNX file by its content), or None where the file states none."""
    if zipfile.is_zipfile(path):
        extra = {PREPROCESSING_FILE: ""}
        torch.export.load(path, extra_files=extra)
        return json.loads(extra[PREPROCESSING_FILE]) if extra[PREPROCESSING_FILE] else None
    from .extras import require

    onnx = require("onnx", "reading an ONNX model's metadata")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except OSError:
        raise
    except Exception as err:  # protobuf's DecodeError: another kind of file
        raise ValueError(f"{path}: neither a .pt2 program nor an ONNX model ({type(err).__name__}: {err})") from None
    props = {p.key: p.value for p in model.metadata_props}
    record = {k: props[k] for k in PREPROCESSING_KEYS if k in props}
    return {k: v if k in TEXT_KEYS else json.loads(v) for k, v in record.items()} or None


def export_onnx(model: nn.Module, path: str | os.PathLike, img_size: int | Pair | None = None,
                dynamic_batch: bool = True, opset: int = 18, batch: int = 2,
                class_names: Sequence[str] | None = None, loss: str | None = None) -> Path:
    """Write ``model`` as ONNX with input "images" (B, C, H, W) and output "logits" (B, K).

    Uses the torch.export-based exporter (``dynamo=True``), which keeps
    ``scaled_dot_product_attention`` as a few matmuls and a softmax.  Weights are stored
    inside the one file (no external data) when they fit under ONNX's 2 GB limit.  ``batch``
    is the batch of the traced example, fixed in the graph when ``dynamic_batch`` is False.
    ``class_names`` go into the model's metadata (ONNX Runtime: ``custom_metadata_map``), and
    ``loss`` (the ``optim.loss`` it was trained with) as its ``problem_type``.
    """
    if isinstance(opset, bool) or not isinstance(opset, int):
        raise TypeError(f"opset={opset!r}: expected an ONNX opset version (an integer, e.g. 18)")
    require_onnx_packages()
    labels = _label_maps(model, class_names) | _problem_type(loss)
    size = model_img_size(model, img_size)
    x = _example(model, size, batch, dynamic_batch)
    path = Path(path)
    with torch.no_grad(), evaluating(model), warnings.catch_warnings(), _quiet(TORCHVISION_NOTICES):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model, (x,), dynamo=True, input_names=["images"], output_names=["logits"],
            dynamic_shapes=_batch_shapes(dynamic_batch), opset_version=opset, verbose=False,
        )
    # an opset torch.onnx cannot convert the graph to is logged, and the graph kept at the one it builds
    written = program.model.opset_imports.get("")
    if written != opset:
        raise ValueError(f"opset={opset}: torch.onnx could not write this model at that opset (it kept opset "
                         f"{written}); nothing was written, opset {written} works")
    program.model.metadata_props.update({**labels, **_as_metadata(_preprocessing(model, size))})
    _write_in_place_of(path, lambda tmp: program.save(str(tmp), external_data=_too_big_for_one_file(model)))
    return path


# Where torchvision is absent (vitlab never needs it), the exporter warns once per torchvision operator it
# cannot register, none of which a vitlab model uses.
TORCHVISION_NOTICES = "torch.onnx._internal.exporter._registration"


@contextlib.contextmanager
def _quiet(logger_name: str):
    """Only errors from the logger ``logger_name`` inside the block; its level as it was after."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def require_onnx_packages() -> None:
    """onnx and onnxscript, or ``MissingPackage``: torch.onnx imports them lazily and fails deep inside
    the exporter, so ``export_onnx`` (and a command, before it loads the model) says it up front."""
    from .extras import require

    for name in ("onnx", "onnxscript"):
        require(name, "ONNX export")


def _too_big_for_one_file(model: nn.Module) -> bool:
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return size > 1.8e9
