"""big_vision ViT checkpoints (google-research/big_vision, ``big_vision/models/vit.py``).

A big_vision checkpoint is a flattened tree whose parameters sit under ``params/``
(``params/img/`` for the image tower of a two-tower model such as LiT/SigLIP); other
top-level trees (``opt/...``) are optimiser state and are ignored.  Its ViT is vit_jax's
with other module names and three differences in what it computes; this module rewrites
the arrays into vit_jax's layout (``official.py``) so that one loader serves both::

    big_vision (under params/)                          vit_jax
    embedding/{kernel,bias}                             (same)
    cls                       (pool_type="tok" only)    (same)
    pos_embedding             (1, h*w, D)               Transformer/posembed_input/pos_embedding
                              ("learn"; absent for "sincos2d")        (1, [1 +] h*w, D)
    Transformer/encoderblock_i/                         Transformer/encoderblock_i/
      LayerNorm_0/*                                       LayerNorm_0/*
      MultiHeadDotProductAttention_0/*                    MultiHeadDotProductAttention_1/*
      LayerNorm_1/*                                       LayerNorm_2/*
      MlpBlock_0/Dense_{0,1}/*                            MlpBlock_3/Dense_{0,1}/*
    Transformer/encoderblock/<same>  (scan=True: every array stacked over depth on axis 0)
    Transformer/encoder_norm/*, pre_logits/*, head/*    (same)
    MAPHead_0/*               (pool_type="map")         refused: no MAP head in ViTConfig

What it computes differently, and how the rewrite keeps the function:

* The position embedding is added to the patches *before* the [class] token is
  prepended, so the [class] token has none: its row in the vit_jax table is zero.
* ``posemb="sincos2d"`` is a fixed table (no array in the checkpoint); it is computed for
  the grid of the resolution the model is loaded at (``posemb.posemb_sincos_2d``), which
  is what big_vision computes at that resolution.  ``dynamic_img_size`` would resample
  the table instead of recomputing it, so it is refused for these weights.
* ``pool_type``: "tok" is vitlab's "token", "gap" its "gap" (big_vision's encoder norms
  every token, then averages, as vit_jax); "0" (first token, no [class] token), "map"
  and "none" have no vitlab equivalent and are refused by name.  ``head_zeroinit`` only
  changes the initialisation, never a checkpoint.

Conventions are vit_jax's (tanh GELU, LayerNorm eps 1e-6, order-1 zoom resampling).
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np
from torch import nn

from ..config import Pair, to_pair
from ..models.posemb import posemb_sincos_2d
from .core import WeightsError
from .official import load_official_npz, read_npz

PREFIXES = ("params/img/", "params/")
# big_vision Encoder1DBlock sub-module -> vit_jax Encoder1DBlock sub-module
BLOCK_RENAMES = {
    "LayerNorm_0": "LayerNorm_0",
    "MultiHeadDotProductAttention_0": "MultiHeadDotProductAttention_1",
    "LayerNorm_1": "LayerNorm_2",
    "MlpBlock_0": "MlpBlock_3",
}
POOL_TYPES = {"tok": "token", "gap": "gap"}
UNSUPPORTED_POOLS = {
    "map": "a multi-head attention-pooling head (MAPHead_0)",
    "0": "reading the first patch token without a [class] token",
    "none": "no pooling (per-token outputs)",
}


def is_big_vision(keys: Any) -> bool:
    keys = set(keys)
    return any(p + "embedding/kernel" in keys for p in PREFIXES)


def to_official_layout(arrays: Mapping[str, Any], pool_type: str | None = None,
                       img_size: Pair | int | None = None) -> dict[str, np.ndarray]:
    """big_vision arrays -> the vit_jax arrays of the same function (see the module docstring).

    ``img_size`` is needed only when the checkpoint has no position table (sincos2d).
    Arrays the map does not know keep their names, so the loader reports them.
    """
    prefix = next(p for p in PREFIXES if p + "embedding/kernel" in arrays)
    params = {k[len(prefix):]: np.asarray(v) for k, v in arrays.items() if k.startswith(prefix)}
    if any(k.startswith("MAPHead_0/") for k in params):
        pool_type = pool_type or "map"
    has_cls = "cls" in params
    pool_type = pool_type or ("tok" if has_cls else "gap")
    if pool_type in UNSUPPORTED_POOLS:
        raise WeightsError(
            f"big_vision pool_type={pool_type!r} ({UNSUPPORTED_POOLS[pool_type]}) is not expressible in vitlab's "
            f"ViTConfig, whose classifier is 'token' ([class] token, big_vision 'tok') or 'gap' ('gap')"
        )
    if pool_type not in POOL_TYPES:
        raise WeightsError(f"pool_type={pool_type!r}: big_vision's values are 'tok', 'gap', 'map', '0', 'none'")
    if (pool_type == "tok") != has_cls:
        raise WeightsError(f"pool_type={pool_type!r} but the checkpoint {'has' if has_cls else 'has no'} "
                           "'cls' array: big_vision creates the [class] token for pool_type='tok' only")

    out: dict[str, np.ndarray] = {}
    for key, value in params.items():
        parts = key.split("/")
        if parts[0] == "Transformer" and parts[1] == "encoderblock":  # scan=True: stacked over depth
            for i in range(value.shape[0]):
                out["/".join(["Transformer", f"encoderblock_{i}", BLOCK_RENAMES.get(parts[2], parts[2])]
                             + parts[3:])] = value[i]
        elif parts[0] == "Transformer" and parts[1].startswith("encoderblock_"):
            out["/".join(parts[:2] + [BLOCK_RENAMES.get(parts[2], parts[2])] + parts[3:])] = value
        elif key == "pos_embedding":
            out["Transformer/posembed_input/pos_embedding"] = value
        else:
            out[key] = value

    width = params["embedding/kernel"].shape[-1]
    posemb_key = "Transformer/posembed_input/pos_embedding"
    if posemb_key not in out:  # posemb="sincos2d"
        if img_size is None:
            raise WeightsError(
                "this big_vision checkpoint has no 'pos_embedding' (posemb='sincos2d', computed, not stored): "
                "pass img_size= (or weights_img_size=) to compute it for that resolution (--img-size, "
                "--weights-img-size)"
            )
        (h, w), (ph, pw) = to_pair(img_size, "img_size"), params["embedding/kernel"].shape[:2]
        out[posemb_key] = posemb_sincos_2d((h // ph, w // pw), width).numpy()
    if has_cls:  # big_vision adds no position embedding to the [class] token
        table = out[posemb_key]
        out[posemb_key] = np.concatenate([np.zeros((1, 1, width), table.dtype), table], axis=1)
    return out


def load_big_vision(source: str | os.PathLike | Mapping[str, Any], pool_type: str | None = None,
                    img_size: Pair | int | None = None, num_classes: int | None = None,
                    keep_pre_logits: bool = False, file_name: str | os.PathLike | None = None,
                    **overrides: Any) -> nn.Module:
    """A vitlab model (eval mode) holding a big_vision ViT (``params/...`` arrays or an .npz).

    ``pool_type`` is big_vision's (not stored in the checkpoint): by default "tok" when
    there is a [class] token, else "gap".  A sincos2d checkpoint is built for ``img_size``
    (or ``weights_img_size``).  ``file_name`` names arrays already read in errors.
    Other arguments as ``load_official_npz``.
    """
    arrays = read_npz(source) if isinstance(source, (str, os.PathLike)) else source
    prefix = next((p for p in PREFIXES if p + "embedding/kernel" in arrays), None)
    if prefix is None:
        raise WeightsError("not a big_vision ViT checkpoint: no 'params/embedding/kernel' "
                           "(or 'params/img/embedding/kernel')")
    sincos = prefix + "pos_embedding" not in arrays
    if sincos and overrides.get("dynamic_img_size"):
        raise WeightsError("dynamic_img_size=True with a sincos2d big_vision checkpoint: vitlab would resample the "
                           "fixed table instead of recomputing it; load it at each img_size instead")
    # a sincos2d table is computed for the size the model is loaded at, as big_vision computes it for its
    # input (weights_img_size stands in for a missing img_size): computed at weights_img_size and then
    # resampled to img_size, it was another table, and the logits another model's
    size = img_size or overrides.get("weights_img_size")
    official = to_official_layout(arrays, pool_type, size)
    if sincos and size is not None:
        overrides["weights_img_size"] = size
    file_name = source if isinstance(source, (str, os.PathLike)) else file_name
    where = f"the big_vision checkpoint {file_name}" if file_name is not None else "the big_vision weights"
    return load_official_npz(official, img_size=img_size, num_classes=num_classes,
                             keep_pre_logits=keep_pre_logits, source=where, **overrides)
