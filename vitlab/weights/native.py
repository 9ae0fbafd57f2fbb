"""vitlab's own format: a safetensors file that carries its config.

A model is saved as its state dict in safetensors (no pickle, so loading runs no code)
with the config JSON in the file's metadata under ``"vitlab_config"``.  Saving to a
directory writes ``model.safetensors`` and also ``config.json`` beside it, the layout
the Hugging Face hub uses, so a directory can be inspected without reading the weights.
Every file is written atomically: a failed save never destroys an existing file.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any, Sequence

import safetensors
import safetensors.torch
import torch
from torch import nn

from ..config import (Architecture, ConfigError, Pair, ResNetConfig, config_from_json, config_to_json, replace,
                      to_pair)
from .bit import save_bit_npz
from .core import WeightsError, atomic_write_set, build_loaded, check_named, check_state_dict, meta_shapes
from .huggingface import save_huggingface
from .labels import CLASSES_KEY, CLASSES_NAME, LOSS_KEY, check_class_names, check_loss
from .official import save_official_npz
from .timm import save_timm, sidecar_path

CONFIG_KEY = "vitlab_config"
# sha256 of the config text and every tensor byte: safetensors itself has no checksum, so
# without it a flipped bit in a weight would load silently.  Files without it still load.
CHECKSUM_KEY = "vitlab_sha256"
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


FORMATS = ("vitlab", "official", "hf", "timm")
# the formats that write into a folder, and the suffixes that make their path a file instead
FOLDER_FORMATS = {"vitlab": (".safetensors",), "hf": (), "timm": (".safetensors", ".pth", ".bin", ".pt")}


def need_model_folder(path: str | os.PathLike, format: str) -> None:
    """Refuse a save into a folder whose ``config.json`` describes no model: a training run's (its
    recipe) or another program's.  The save replaced it and the folder's ``model.safetensors``, so
    ``vitlab convert runs/b16 runs/b16 --to hf`` lost the run's training config and trained weights.
    A model folder (vitlab's, Hugging Face's) is replaced, as documented."""
    path = Path(path)
    config = path / CONFIG_NAME
    if format not in FOLDER_FORMATS or path.suffix.lower() in FOLDER_FORMATS[format] or not config.is_file():
        return
    try:
        text = json.loads(config.read_text())
    except (OSError, ValueError):
        text = None
    if isinstance(text, dict) and (text.get("type") in ("ViTConfig", "ResNetConfig") or "model_type" in text):
        return
    what = "a training run's config" if _is_run_config(text) else "not a model's config"
    raise WeightsError(f"{path}: its {CONFIG_NAME} is {what}, which saving a model there would replace, and "
                       f"the folder's {WEIGHTS_NAME} with it; save into another folder")


def _is_run_config(text: Any) -> bool:
    return isinstance(text, dict) and "recipe" in text


def need_outside_run(name: str, path: str | os.PathLike, beside: Sequence[str] = ()) -> None:
    """Refuse a file to write in a training run's folder (its ``config.json`` a run's, with its recipe), or in a
    folder of it (``checkpoints/``): ``vitlab convert X runs/b16/model.safetensors`` replaced the run's trained
    weights, where a save into the folder itself is refused (``need_model_folder``), and ``vitlab export X --out
    runs/b16/config.json`` its config.  ``beside``: the suffixes of files no run writes, which may go there
    (an export's ``model.onnx`` beside the weights it was made from, ``vitlab export``'s default)."""
    path = Path(path)
    if path.suffix.lower() in beside:
        return
    for folder in (path.parent, path.parent.parent):
        try:
            text = json.loads((folder / CONFIG_NAME).read_text())
        except (OSError, ValueError):
            continue
        if _is_run_config(text):
            allowed = f"name it {' or '.join(beside)}, or " if beside else ""
            raise WeightsError(f"{name}={str(path)!r} lies in {folder}, a training run's folder, whose files (its "
                               f"{WEIGHTS_NAME}, checkpoints and records) it could replace; {allowed}write it "
                               "outside the run's folder")


def save_model(model: nn.Module, path: str | os.PathLike, format: str = "vitlab",
               class_names: Sequence[str] | None = None, loss: str | None = None) -> Path:
    """Save ``model`` (any vitlab model, which carries ``.cfg``) and return the weights file.

    format="vitlab": ``path`` ending in ``.safetensors`` is the file; any other path is a
        directory (created if needed) that receives ``model.safetensors`` and ``config.json``.
    format="official": a vit_jax ``.npz`` (a BiT ResNet: big_transfer's ``.npz``).
    format="hf": a directory for ``transformers.ViTForImageClassification.from_pretrained``.
    format="timm": timm's state dict (+ ``<stem>.timm.json``, the ``create_model`` arguments).
    Exports to libraries with other numerical conventions carry the conventions where the
    library takes them, and warn (``ConventionWarning``) where it cannot.
    ``class_names`` (one per class) go where the format has a place for them (``labels``):
    the vitlab file's metadata and a directory's ``classes.json``, Hugging Face's
    ``id2label``, timm's ``label_names``; a vit_jax ``.npz`` has none.  A directory saved without
    them in vitlab's layout, or in another, loses the ``classes.json`` of the weights it replaces
    (and in timm's, their ``config.json``).
    ``loss``, the ``optim.loss`` the model was trained with ("softmax_xent", "sigmoid_xent"), which says
    what its outputs are probabilities of, goes where the format has a place for it (``labels``): the
    vitlab file's metadata, Hugging Face's ``problem_type``; timm's and vit_jax's have none.  None: unknown,
    nothing is written (readers take a softmax).
    """
    cfg = getattr(model, "cfg", None)
    if cfg is None:
        raise TypeError(f"{type(model).__name__} has no .cfg: only vitlab models can be saved with their config")
    if format not in FORMATS:
        raise WeightsError(f"format={format!r}: allowed values are {', '.join(map(repr, FORMATS))}")
    if class_names is not None:
        class_names = check_class_names(class_names, cfg.num_classes, "class_names")
    if loss is not None:
        check_loss(loss, "loss")
    check_saved_model(model, cfg)
    need_model_folder(path, format)
    if format == "official":
        if isinstance(cfg, ResNetConfig):
            return save_bit_npz(model, path)
        return save_official_npz(model, path)
    if format == "hf":
        return save_huggingface(model, path, class_names, loss)
    if format == "timm":
        return save_timm(model, path, class_names)
    text = config_to_json(cfg)
    # clone: safetensors refuses tensors that share memory, and must not see views
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    extra = {CLASSES_KEY: json.dumps(class_names)} if class_names else {}
    data = _with_checksum(tensors, text, extra | ({LOSS_KEY: loss} if loss else {}))
    path = Path(path)
    if path.suffix == ".safetensors":
        # a timm export's .timm.json goes with the weights it described: its label_names, read as the file's
        # own, named these classes by the earlier ones
        return atomic_write_set([(path, lambda f: f.write(data))], remove=[sidecar_path(path)])[-1]
    files = [(path / CONFIG_NAME, lambda f: f.write(text.encode()))]
    if class_names:  # where a training run keeps them, and `vitlab predict` looks
        files.append((path / CLASSES_NAME, lambda f: f.write(json.dumps(class_names).encode())))
    # replaced as a set, the weights last; without names, an earlier save's classes.json goes: it
    # described the weights replaced, and read first it misnamed these classes (and so a timm export's sidecar)
    files.append((path / WEIGHTS_NAME, lambda f: f.write(data)))
    stale = [sidecar_path(path / WEIGHTS_NAME)] + ([] if class_names else [path / CLASSES_NAME])
    return atomic_write_set(files, remove=stale)[-1]


def check_saved_model(model: nn.Module, cfg: Architecture) -> None:
    """That ``model``'s weights are those of the model ``cfg`` describes, which every format records
    beside them: a head replaced by assignment (``model.head = nn.Linear(D, 3)``), an adapter wrapping
    a layer or a swapped norm was saved as a file no loader (vitlab's, transformers', timm's) could read."""
    try:
        check_state_dict(meta_shapes(cfg), model.state_dict(), "save_model: the model's weights")
    except WeightsError as err:
        lines = str(err).replace(" do not match the model:", " do not match the model its config (model.cfg) "
                                 "describes, which the file records:", 1)
        raise WeightsError(f"{lines}\n  model.reset_classifier(n) replaces the head and the config's num_classes "
                           "together; merge an adapter or a replaced layer into the plain modules before "
                           "saving") from None


def _data_offset(blob: bytes) -> int:
    """Where the tensor bytes of a serialised safetensors file start (after the JSON header)."""
    (header_len,) = struct.unpack("<Q", blob[:8])
    return 8 + header_len


def _digest(config_text: str, body: bytes | memoryview) -> str:
    h = hashlib.sha256(config_text.encode())
    h.update(body)
    return h.hexdigest()


def _with_checksum(tensors: dict[str, torch.Tensor], text: str, extra: dict[str, str] | None = None) -> bytes:
    # the tensor bytes do not depend on the metadata, so serialise, hash, then serialise again
    first = safetensors.torch.save(tensors, metadata={CONFIG_KEY: text})
    body = memoryview(first)[_data_offset(first):]
    metadata = {**(extra or {}), CONFIG_KEY: text, CHECKSUM_KEY: _digest(text, body)}
    data = safetensors.torch.save(tensors, metadata=metadata)
    assert memoryview(data)[_data_offset(data):] == body
    return data


def read_safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The metadata of a safetensors file, reading only its header (no tensor is allocated)."""
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except FileNotFoundError:
        raise
    except Exception as e:  # SafetensorError for truncated headers, bad offsets, ...
        raise WeightsError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e}") from e


def verify_checksum(path: str | os.PathLike, metadata: dict[str, str]) -> None:
    """Check the ``vitlab_sha256`` that ``save_model`` records (nothing to check without it)."""
    expected = metadata.get(CHECKSUM_KEY)
    if expected is None:
        return
    h = hashlib.sha256(metadata.get(CONFIG_KEY, "").encode())
    with open(path, "rb") as f:  # streamed: a multi-GB file is not held twice in memory
        head = f.read(8)
        if len(head) < 8:
            raise WeightsError(f"{path} is not a readable safetensors file (truncated or corrupt?): {len(head)} bytes")
        f.seek(_data_offset(head))
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    actual = h.hexdigest()
    if actual != expected:
        raise WeightsError(
            f"{path} is truncated or corrupt: its {CHECKSUM_KEY} is {expected[:16]}..., the bytes give "
            f"{actual[:16]}... (a flipped bit or a partial copy); copy the file again"
        )


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file, with a clear error if it is damaged.

    A file written by ``save_model`` carries a checksum, so a flipped bit anywhere in its
    tensors or config is an error too, not a silently different model.
    """
    metadata = read_safetensors_metadata(path)
    verify_checksum(path, metadata)
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except FileNotFoundError:
        raise
    except Exception as e:  # SafetensorError for truncated headers, bad offsets, ...
        raise WeightsError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e}") from e
    return tensors, metadata


def _parse_config(text: str, where: str) -> Architecture:
    try:
        return config_from_json(text)
    except (ValueError, TypeError) as e:  # json.JSONDecodeError and ConfigError are ValueErrors
        raise WeightsError(f"the vitlab config in {where} cannot be read: {e}") from e


def read_native(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], Architecture]:
    """(state dict, config) of a file or directory written by ``save_model``.

    The config inside the weights file wins over ``config.json``: it cannot go stale, and
    a training run directory may hold a ``config.json`` of its own.
    """
    path = Path(path)
    weights = path / WEIGHTS_NAME if path.is_dir() else path
    # the config is read and checked first: an absurd or malformed one is refused before
    # a single tensor is allocated
    metadata = read_safetensors_metadata(weights)
    if CONFIG_KEY in metadata:
        cfg = _parse_config(metadata[CONFIG_KEY], f"the metadata of {weights}")
    elif path.is_dir() and (path / CONFIG_NAME).is_file():
        try:
            text = (path / CONFIG_NAME).read_text()
        except UnicodeDecodeError as e:
            raise WeightsError(f"{path / CONFIG_NAME} is not UTF-8 JSON: {e}") from e
        cfg = _parse_config(text, str(path / CONFIG_NAME))
    else:
        raise WeightsError(f"{weights} has no '{CONFIG_KEY}' metadata: it was not written by vitlab's save_model")
    tensors, _ = read_safetensors(weights)
    return tensors, cfg


def read_native_config(path: str | os.PathLike) -> Architecture | None:
    """The config a safetensors file written by ``save_model`` carries, reading its header
    only (no tensor is read); None for a file without one."""
    metadata = read_safetensors_metadata(path)
    return _parse_config(metadata[CONFIG_KEY], f"the metadata of {path}") if CONFIG_KEY in metadata else None


def is_native(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory or safetensors file written by ``save_model``."""
    path = Path(path)
    if path.is_dir():
        try:
            config = json.loads((path / CONFIG_NAME).read_text())
        except (OSError, ValueError):
            return False
        # Hugging Face's config.json has "model_type"; vitlab's records its dataclass in "type"
        return isinstance(config, dict) and config.get("type") in ("ViTConfig", "ResNetConfig")
    return CONFIG_KEY in read_safetensors_metadata(path)


def check_recorded(cfg: Architecture, overrides: dict[str, Any], path: str | os.PathLike) -> None:
    """That ``overrides`` repeat, not contradict, what a vitlab file records about its weights: the
    size its position embeddings were saved for, and the heads its attention was trained with (a
    number of heads changes no shape, so another one loaded silently and computed other logits)."""
    trained_at = overrides.get("weights_img_size")
    if trained_at is not None and to_pair(trained_at, "weights_img_size") != cfg.img_size:
        raise WeightsError(f"weights_img_size={trained_at}: the vitlab weights in {path} record the resolution "
                           f"they were trained at, {cfg.img_size[0]}x{cfg.img_size[1]}; leave it out, or give "
                           "that size (img_size= resizes the weights)")
    heads = overrides.get("num_heads")
    if heads is not None and heads != getattr(cfg, "num_heads", heads):
        raise WeightsError(f"num_heads={heads}: the vitlab weights in {path} record the {cfg.num_heads} attention "
                           "heads they were trained with; leave it out, or give that number")


def load_native(path: str | os.PathLike, img_size: Pair | int | None = None, num_classes: int | None = None,
                keep_pre_logits: bool = False, name: str | None = None, **overrides: Any) -> nn.Module:
    """The model saved at ``path`` by ``save_model``, in eval mode.

    ``img_size`` and ``num_classes`` adapt it as ``core.adapt_state_dict`` describes;
    ``overrides`` are config fields (e.g. dropout, dynamic_img_size); ``weights_img_size`` and
    ``num_heads``, which other formats may need, are recorded in the file: only its values are accepted.
    ``name`` (a registry name) must be the recorded model's.
    """
    state_dict, cfg = read_native(path)
    check_named(name, cfg)
    check_recorded(cfg, overrides, path)
    overrides.pop("weights_img_size", None)  # not a config field: the size the weights were saved at
    if overrides:
        try:
            cfg = replace(cfg, **overrides)
        except ConfigError as e:
            raise WeightsError(str(e)) from e
    return build_loaded(state_dict, cfg, img_size=img_size, num_classes=num_classes,
                        keep_pre_logits=keep_pre_logits, source=f"the weights in {path}")
