"""``load_model``: one entry point for every weight format vitlab reads.

The format is recognised from what the source holds, never from a flag:

    source                                           format
    directory with model.safetensors                 vitlab if the file or config.json holds a vitlab config,
                                                     else by keys (an HF config.json gives heads, eps, GELU)
    directory with pytorch_model.bin                 Hugging Face, as above
    *.safetensors                                    vitlab if its metadata has a config, else by keys
    *.npz                                            official vit_jax
    *.pt, *.pth, *.bin                               by keys; read with torch.load(weights_only=True)
    (any of these with <stem>.timm.json beside it: timm create_model arguments, as save_model(format="timm") writes)
    (an input scaling stated beside the weights, a Hugging Face folder's preprocessor_config.json or timm's
    pretrained_cfg mean and std, is taken into the weights: ``core.take_input_scaling``)
    a Hugging Face Hub name, org/name[@revision]     its snapshot in the local Hugging Face cache, else downloaded
                                                     with huggingface_hub (``hub.py``); then as a directory
    a dict in memory                                 by keys

    keys                                             format
    'embedding/kernel' (Flax tree, '/' separators)   official vit_jax (AugReg too: its file name is checked)
    'params/[img/]embedding/kernel'                  big_vision ViT
    'resnet/root_block/standardized_conv2d/kernel'   BiT (big_transfer)
    '[vit.]embeddings.patch_embeddings.projection.weight'   Hugging Face
    'patch_embed.proj.weight'                        timm
    'patch_embed.weight'                             a bare vitlab state dict (vitlab's default conventions)
"""
from __future__ import annotations

import json
import os
import re
import zipfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from ..config import Architecture, Pair
from ..models.registry import canonical_name, has_name_form, list_models, unknown_model
from .core import InputScaling, WeightsError, build_loaded, check_named, infer_config, take_input_scaling, to_tensor
from .bigvision import is_big_vision, load_big_vision
from .bit import is_bit, load_bit
from .hub import not_looked_up, resolve_hub_name
from .huggingface import PROCESSOR_NAME, is_huggingface, load_huggingface, processor_scaling
from .labels import (CLASSES_KEY, CLASSES_NAME, LOSS_KEY, check_loss, loss_of_problem_type, names_from_id2label,
                     names_from_json)
from .native import (CONFIG_KEY, CONFIG_NAME, WEIGHTS_NAME, check_recorded, is_native, load_native,
                     read_native_config, read_safetensors, read_safetensors_metadata)
from .official import KNOWN_PREFIXES, load_official_npz, read_npz
from .timm import is_timm, load_timm, pretrained_cfg_scaling
from .timm import sidecar_path as timm_sidecar

HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
# Checkpoints saved by training scripts often wrap the state dict under one of these.
WRAPPERS = ("state_dict", "model")
# The name `vitlab train` gives its checkpoints (vitlab.train.checkpoint.PATTERN), which hold random
# states that torch.load(weights_only=True) refuses: given as weights, the file is named for what it is.
TRAINING_CHECKPOINT = re.compile(r"^ckpt-\d+\.pt$")


def _torch_load(path: Path) -> dict[str, Any]:
    """A state dict from a torch pickle, allowing tensors and containers only (no code)."""
    _check_zip(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (FileNotFoundError, PermissionError):
        raise
    except Exception as e:  # UnpicklingError (forbidden objects), OSError/RuntimeError (damaged zip), EOFError
        if TRAINING_CHECKPOINT.match(path.name):
            raise WeightsError(
                f"{path} is a training checkpoint of `vitlab train` (model, optimiser and random states, which "
                f"--resume reads); the run's weights are {path.parent.parent / WEIGHTS_NAME}, written when it ends "
                "(an interrupted run: finish it with --resume)") from e
        raise WeightsError(
            f"{path} could not be read by torch.load(weights_only=True): the file is truncated or corrupt, "
            f"or it pickles objects other than tensors, which vitlab never unpickles: {torch_load_reason(e)}"
        ) from e
    for key in WRAPPERS:
        if isinstance(obj, Mapping) and isinstance(obj.get(key), Mapping):
            obj = obj[key]
    if not isinstance(obj, Mapping):
        raise WeightsError(f"{path} holds a {type(obj).__name__}, not a state dict")
    return dict(obj)


def torch_load_reason(err: Exception) -> str:
    """Why torch.load refused a file, in one line: PyTorch's own message runs over several, with
    advice to unpickle the file anyway, which vitlab never does; the line after "WeightsUnpickler
    error:" says what the file holds."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))  # its bold face
    reason = text.split("WeightsUnpickler error:", 1)[-1].split("Check the documentation of torch.load")[0]
    reason = reason.split(" Please use `torch.serialization")[0]
    return " ".join(reason.split()) or type(err).__name__


def _check_zip(path: Path) -> None:
    """torch.save's zip format records a CRC-32 per entry that torch.load does not check:
    check them, so that a flipped bit is an error rather than a silently different weight."""
    try:
        if not zipfile.is_zipfile(path):
            return  # the legacy format (or garbage): torch.load(weights_only=True) judges it
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (FileNotFoundError, PermissionError):
        raise
    except Exception as e:  # BadZipFile, zlib.error, EOFError, ...
        raise WeightsError(f"{path} could not be read as a zip archive: the file is truncated or corrupt: {e}") from e
    if bad is not None:
        raise WeightsError(f"{path}: entry {bad!r} fails its CRC-32 check: the file is truncated or corrupt")


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path`` (config.json, .timm.json), or a one-line WeightsError."""
    try:
        obj = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as e:
        raise WeightsError(f"{path} is not valid UTF-8 JSON: {e}") from e
    if not isinstance(obj, dict):
        raise WeightsError(f"{path} holds a JSON {type(obj).__name__}; expected an object of fields")
    return obj


def detect_format(keys: Any) -> str:
    """'official', 'big_vision', 'bit', 'huggingface', 'timm' or 'vitlab', from a state dict's keys."""
    keys = set(keys)
    if any(p + "embedding/kernel" in keys for p in ("",) + KNOWN_PREFIXES):
        return "official"
    if is_big_vision(keys):
        return "big_vision"
    if is_bit(keys):
        return "bit"
    if is_huggingface(keys):
        return "huggingface"
    if is_timm(keys):
        return "timm"
    if "patch_embed.weight" in keys:
        return "vitlab"
    some = ", ".join(sorted(keys)[:6])
    raise WeightsError(
        f"unrecognised weights (first keys: {some}); vitlab reads official vit_jax / AugReg .npz, big_vision ViT, "
        "BiT (big_transfer) .npz, Hugging Face ViT, timm vision_transformer (plain and hybrid) and its own state dicts"
    )


def _load_state_dict(sd: Mapping[str, Any], hf_config: Mapping[str, Any] | None, file: Path | None = None,
                     timm_kwargs: Mapping[str, Any] | None = None,
                     scaling: Mapping[str, InputScaling] | None = None, **kw: Any) -> nn.Module:
    """``scaling``: per format, the input scaling its config beside the weights states (a Hugging Face
    image processor's, timm's pretrained_cfg), taken into the weights of that format's model."""
    fmt = detect_format(sd.keys())
    # where the arrays define the architecture, a name is only checked against them
    if fmt == "official":
        return load_official_npz(sd, file_name=file, **kw)
    if fmt == "bit":
        kw.pop("keep_pre_logits")
        return load_bit(sd, file_name=file, **kw)
    if fmt == "big_vision":
        return load_big_vision(sd, file_name=file, **kw)
    if fmt == "huggingface":
        return take_input_scaling(load_huggingface(sd, hf_config, **kw), (scaling or {}).get(fmt))
    if fmt == "timm":
        return take_input_scaling(load_timm(sd, timm_kwargs=timm_kwargs, **kw), (scaling or {}).get(fmt))
    # a bare vitlab state dict: no config, so vitlab's defaults (the official conventions) apply
    img_size, num_classes, keep = kw.pop("img_size"), kw.pop("num_classes"), kw.pop("keep_pre_logits")
    sd = {k: to_tensor(v) for k, v in sd.items()}
    cfg = infer_config(sd, img_size_hint=img_size, **kw)  # the size asked for tells a non-square grid, as timm's
    return build_loaded(sd, cfg, img_size=img_size, num_classes=num_classes, keep_pre_logits=keep)


def _load_dir(path: Path, **kw: Any) -> nn.Module:
    if is_native(path):  # the saved config is authoritative; a name is checked against it
        return load_native(path, **kw)
    config = path / CONFIG_NAME
    # a config.json is Hugging Face's only if it says so (a training run keeps its own there)
    folder_config = _read_json(config) if config.is_file() else {}
    hf_config = folder_config if "model_type" in folder_config else None
    if hf_config is not None and hf_config["model_type"] != "vit":
        raise WeightsError(f"{config} describes a {hf_config['model_type']!r} model; vitlab reads 'vit' models")
    for weights in HF_WEIGHTS:
        if (path / weights).is_file():
            return _load_file(path / weights, hf_config=hf_config, scaling=_folder_scaling(path, folder_config), **kw)
    raise WeightsError(f"{path} holds no weights: expected {', '.join(HF_WEIGHTS)}")


def _folder_scaling(path: Path, folder_config: Mapping[str, Any]) -> dict[str, InputScaling]:
    """The input scaling a model folder states beside its weights: a Hugging Face folder's image
    processor (``preprocessor_config.json``), a timm Hub folder's ``pretrained_cfg`` (its config.json)."""
    processor = path / PROCESSOR_NAME
    if "model_type" in folder_config and processor.is_file():
        return {"huggingface": processor_scaling(_read_json(processor), str(processor))}
    timm = pretrained_cfg_scaling(folder_config.get("pretrained_cfg"), f"pretrained_cfg in {path / CONFIG_NAME}")
    return {"timm": timm} if timm is not None else {}


def _load_file(path: Path, hf_config: Mapping[str, Any] | None = None,
               scaling: Mapping[str, InputScaling] | None = None, **kw: Any) -> nn.Module:
    suffix = path.suffix.lower()
    if suffix == ".npz":
        return _load_state_dict(read_npz(path), hf_config, file=path, **kw)
    # timm exports carry their create_model arguments and input scaling beside the weights (timm.save_timm)
    sidecar, spec = timm_sidecar(path), _timm_spec(path)
    timm_kwargs = spec.get("kwargs")
    overlay = pretrained_cfg_scaling(spec.get("pretrained_cfg_overlay"), f"pretrained_cfg_overlay in {sidecar}")
    if overlay is not None:
        scaling = {**(scaling or {}), "timm": overlay}
    if suffix == ".safetensors":
        if CONFIG_KEY in read_safetensors_metadata(path):
            return load_native(path, **kw)
        tensors, _ = read_safetensors(path)
        return _load_state_dict(tensors, hf_config, timm_kwargs=timm_kwargs, scaling=scaling, **kw)
    if suffix in (".pt", ".pth", ".bin"):
        return _load_state_dict(_torch_load(path), hf_config, timm_kwargs=timm_kwargs, scaling=scaling, **kw)
    raise WeightsError(f"{path}: unknown file type {suffix!r}; expected .safetensors, .npz, .pt, .pth or .bin")


def load_model(source: str | os.PathLike | Mapping[str, Any], name: str | None = None,
               img_size: Pair | int | None = None, num_classes: int | None = None,
               keep_pre_logits: bool = False, weights_img_size: Pair | int | None = None,
               **overrides: Any) -> nn.Module:
    """Load weights of any supported format into a vitlab model, returned in eval mode.

    source: a path (see the module docstring), a Hugging Face Hub name ("google/vit-base-patch16-224",
        found in the local Hugging Face cache or downloaded) or an in-memory state dict / dict of arrays.
    name: a registry name (e.g. "ViT-B/16"); needed only for Hugging Face, timm and bare
        vitlab state dicts without a config, whose shapes do not show the number of heads
        (``num_heads=`` works too).  Where the format defines the architecture, it must be that one.
    img_size: resample the position embeddings to this resolution, by the convention of
        the weights' source (official: bilinear zoom; Hugging Face and timm: bicubic).
    num_classes: a different value gives a zero-initialised head; the pre-logits layer is
        dropped too unless ``keep_pre_logits`` (vit_jax's fine-tuning default).
    weights_img_size: the resolution the weights were trained at, where they do not record it (an official
        .npz not named as AugReg names its files, a state dict without its config, a timm file without its
        .timm.json) and their patch count does not tell the grid.  None: the size the weights record, else the
        grid of ``img_size`` where it has their patch count, else a square grid: a square count that the
        non-square grid of ``img_size`` has too (16: 4x4, or 2x8 at 32x128) is refused, and without
        ``img_size`` a non-square grid of a square count (2x8) is read as a square one (4x4), unseen.
    overrides: ViTConfig fields, e.g. dropout=0.1, dynamic_img_size=True, ln_eps=1e-12.
    """
    kw = dict(name=name, img_size=img_size, num_classes=num_classes, keep_pre_logits=keep_pre_logits, **overrides)
    if weights_img_size is not None:  # passed on as None, it stood before the size a file records (an AugReg name)
        kw["weights_img_size"] = weights_img_size
    if isinstance(source, np.lib.npyio.NpzFile):
        source = {k: source[k] for k in source.files}
    if isinstance(source, Mapping):
        return _load_state_dict(source, None, **kw)
    path = Path(source)
    if not path.exists():
        snapshot = resolve_hub_name(str(source))  # "google/vit-base-patch16-224": the Hugging Face cache
        if snapshot is None:
            if has_name_form(str(source)):
                raise WeightsError(_model_name_given(str(source)))
            raise FileNotFoundError(f"no such file or directory: {path}{not_looked_up(str(source))}")
        path = snapshot
    return _load_dir(path, **kw) if path.is_dir() else _load_file(path, **kw)


def _model_name_given(text: str) -> str:
    """Why a registry name (or one of its form, mistyped) given for weights that are not there is none."""
    if canonical_name(text) in list_models():
        return (f"{text!r} names a model of the registry, not weights, and is no file or folder: weights are a "
                "file or folder (a run's model.safetensors) or a Hugging Face Hub name (org/name)")
    return f"{text}: no such file or folder, and {unknown_model(text)}"


def _names_in_file(path: Path) -> list[str] | None:
    """The class names a weights file carries itself: a vitlab file's metadata, a timm export's sidecar."""
    if path.suffix.lower() == ".safetensors":
        metadata = read_safetensors_metadata(path)
        if CLASSES_KEY in metadata:
            return names_from_json(metadata[CLASSES_KEY], f"the {CLASSES_KEY} metadata of {path}")
    overlay = _timm_spec(path).get("pretrained_cfg_overlay")
    names = overlay.get("label_names") if isinstance(overlay, Mapping) else None
    if names is not None:
        return names_from_json(json.dumps(names), f"label_names in {timm_sidecar(path)}")
    return None


def _timm_spec(path: Path) -> dict[str, Any]:
    """What ``timm.save_timm`` wrote beside the weights file ``path`` (``<stem>.timm.json``), or {} where there
    is none or it describes another file there: its ``pretrained_cfg_overlay`` names the weights it was written
    with, and x.pth and x.safetensors share x.timm.json, the later export's; read for the other file, its
    heads, size and names made those weights another model, other logits without a word.  (A pair renamed
    together names a file that is not there, and is read.)"""
    sidecar = timm_sidecar(path)
    if not sidecar.is_file():
        return {}
    spec = _read_json(sidecar)
    overlay = spec.get("pretrained_cfg_overlay")
    file = overlay.get("file") if isinstance(overlay, Mapping) else None
    other = isinstance(file, str) and file != path.name and (path.parent / file).is_file()
    return {} if other else spec


def read_class_names(source: str | os.PathLike) -> list[str] | None:
    """The class names kept with the weights at ``source`` (a file, a folder, or a Hugging
    Face Hub name), or None where there are none (see ``labels`` for where each format keeps them).

    In order: the weights file's own (a vitlab ``.safetensors``' metadata, a timm export's
    ``label_names``), ``classes.json`` beside it (a training run's), the ``id2label`` of a
    Hugging Face ``config.json`` beside it, the metadata of a folder's ``model.safetensors``.
    """
    path = Path(source)
    if not path.exists():
        path = resolve_hub_name(str(source)) or path  # a Hub name: its snapshot folder
        if not path.exists():
            return None
    folder = path if path.is_dir() else path.parent
    if path.is_file():
        own = _names_in_file(path)
        if own is not None:
            return own
    classes = folder / CLASSES_NAME
    if classes.is_file():
        return names_from_json(classes.read_text(errors="replace"), str(classes))
    config = folder / CONFIG_NAME
    if config.is_file():
        names = names_from_id2label(_read_json(config).get("id2label"))
        if names:
            return names
    if path.is_dir() and (path / HF_WEIGHTS[0]).is_file():
        return _names_in_file(path / HF_WEIGHTS[0])
    return None


def read_loss(source: str | os.PathLike) -> str | None:
    """The loss the weights at ``source`` (a file, a folder, or a Hugging Face Hub name) record they were
    trained with, "softmax_xent" or "sigmoid_xent" (what their outputs are probabilities of), or None where
    they record none (see ``labels``): a vitlab file's metadata (a folder's ``model.safetensors``), else the
    ``problem_type`` of a Hugging Face ``config.json`` beside it.  A training run records its own in its
    ``config.json`` (``optim.loss``), which ``vitlab.analysis.report.recorded_loss`` reads first."""
    path = Path(source)
    if not path.exists():
        path = resolve_hub_name(str(source)) or path  # a Hub name: its snapshot folder
        if not path.exists():
            return None
    weights = path / HF_WEIGHTS[0] if path.is_dir() else path
    if weights.suffix.lower() == ".safetensors" and weights.is_file():
        loss = read_safetensors_metadata(weights).get(LOSS_KEY)
        if loss is not None:
            return check_loss(loss, f"{weights}: metadata {LOSS_KEY}")  # a file edited by hand
    config = (path if path.is_dir() else path.parent) / CONFIG_NAME
    try:  # a training run's config.json beside its weights is no model's (and a broken one is the run's affair)
        folder_config = json.loads(config.read_text()) if config.is_file() else {}
    except (OSError, ValueError):
        return None
    if not isinstance(folder_config, dict) or "model_type" not in folder_config:
        return None
    return loss_of_problem_type(folder_config.get("problem_type"), f"{config}: problem_type")


def load_config(source: str | os.PathLike, name: str | None = None,
                weights_img_size: Pair | int | None = None) -> Architecture:
    """The architecture ``load_model(source, name=name, weights_img_size=...)`` builds, at the weights'
    own size and head: read from the config alone where vitlab's format stores one (no tensor is read),
    else from the loaded weights."""
    path = Path(source)
    weights = path / WEIGHTS_NAME if path.is_dir() else path
    if weights.suffix.lower() == ".safetensors" and weights.is_file():
        cfg = read_native_config(weights)
        if cfg is not None:
            check_named(name, cfg)
            check_recorded(cfg, {"weights_img_size": weights_img_size}, path)
            return cfg
    return load_model(source, name=name, weights_img_size=weights_img_size).cfg