"""Hugging Face ``ViTForImageClassification`` / ``ViTModel`` state dicts.

Two key layouts exist, both read here (``vit.`` is absent on a bare ``ViTModel``)::

    transformers >= 5                       transformers 4, hub files            vitlab
    vit.embeddings.cls_token                (same)                                cls_token
    vit.embeddings.position_embeddings      (same)                                pos_embed.weight
    vit.embeddings.patch_embeddings.projection.*  (same)                          patch_embed.*
    vit.layers.i.layernorm_before.*         vit.encoder.layer.i.layernorm_before.*  blocks.i.norm1.*
    vit.layers.i.attention.{q,k,v}_proj.*   vit.encoder.layer.i.attention.attention.{query,key,value}.*
                                                                                  blocks.i.attn.qkv.* (stacked q;k;v)
    vit.layers.i.attention.o_proj.*         vit.encoder.layer.i.attention.output.dense.*  blocks.i.attn.proj.*
    vit.layers.i.layernorm_after.*          vit.encoder.layer.i.layernorm_after.*   blocks.i.norm2.*
    vit.layers.i.mlp.fc1.*                  vit.encoder.layer.i.intermediate.dense.*  blocks.i.mlp.fc1.*
    vit.layers.i.mlp.fc2.*                  vit.encoder.layer.i.output.dense.*      blocks.i.mlp.fc2.*
    vit.layernorm.*                         (same)                                norm.*
    vit.pooler.dense.*                      (same)                                pre_logits.fc.*
    classifier.*                            (same)                                head.*

All linear weights are already (out, in) and the per-head order of HF's q/k/v rows is
vitlab's (row h*hd + j), so nothing is transposed.  The pooler (dense + tanh on the
[class] token) is exactly the official pre-logits layer; ``ViTForImageClassification``
does not use one, so a pooler next to a classifier is ignored, as HF ignores it.

Conventions: exact GELU, LayerNorm eps 1e-12, bicubic position-embedding interpolation
with unaligned corners (``ViTEmbeddings.interpolate_pos_encoding``); an HF config.json,
when given, supplies the heads, eps and activation.

Export (``save_huggingface``, ``save_model(..., format="hf")``) writes a directory that
``ViTForImageClassification.from_pretrained`` loads with no missing or unexpected keys:
``config.json`` and ``model.safetensors`` with the hub-file names (transformers 4's, which
transformers 5 also writes and reads), and ``preprocessor_config.json``, the image processor
of vitlab's input scaling.  A folder's image processor read in is taken into the weights
(``processor_scaling``, ``core.take_input_scaling``).  The conventions travel in the config, so the
logits stay equal: ``hidden_act`` "gelu" (exact) or "gelu_pytorch_tanh" (vit_jax's tanh
form), ``layer_norm_eps`` the model's, ``qkv_bias`` the model's.  What the class cannot
compute is refused: the "gap" classifier and a pre-logits layer (ViTForImageClassification
reads the [class] token and has no pooler), hybrids, other position embeddings.  One
difference stays, and is warned about only for ``posemb_resample="bilinear"`` models:
``interpolate_pos_encoding=True`` resamples bicubically.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import safetensors.torch
import torch
from torch import nn

from ..config import Pair, ViTConfig
from .core import (InputScaling, StateDict, WeightsError, atomic_write_set, build_loaded, infer_config,
                   input_preprocessing, require_plain_vit, to_tensor, warn_conventions)
from .labels import (CLASSES_NAME, PROBLEM_TYPES, check_class_names, check_loss, distinct_names, id2label,
                     label2id)
from .timm import sidecar_path

CONVENTIONS: dict[str, Any] = {"gelu": "exact", "ln_eps": 1e-12, "posemb_resample": "bicubic"}

# (HF name under the optional "vit." prefix, vitlab name)
BASE_MAP: list[tuple[str, str]] = [
    ("embeddings.cls_token", "cls_token"),
    ("embeddings.position_embeddings", "pos_embed.weight"),
    ("embeddings.patch_embeddings.projection.weight", "patch_embed.weight"),
    ("embeddings.patch_embeddings.projection.bias", "patch_embed.bias"),
    ("layernorm.weight", "norm.weight"),
    ("layernorm.bias", "norm.bias"),
    ("pooler.dense.weight", "pre_logits.fc.weight"),
    ("pooler.dense.bias", "pre_logits.fc.bias"),
]
HEAD_MAP: list[tuple[str, str]] = [("classifier.weight", "head.weight"), ("classifier.bias", "head.bias")]

# Per layer: the layer's prefix, (HF module, vitlab module) pairs, and q/k/v modules.
LAYOUT_V5 = (
    "layers.{}.",
    [("layernorm_before", "norm1"), ("attention.o_proj", "attn.proj"), ("layernorm_after", "norm2"),
     ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")],
    ("attention.q_proj", "attention.k_proj", "attention.v_proj"),
)
LAYOUT_V4 = (
    "encoder.layer.{}.",
    [("layernorm_before", "norm1"), ("attention.output.dense", "attn.proj"), ("layernorm_after", "norm2"),
     ("intermediate.dense", "mlp.fc1"), ("output.dense", "mlp.fc2")],
    ("attention.attention.query", "attention.attention.key", "attention.attention.value"),
)

# HF activation names -> vitlab's gelu field
ACTIVATIONS = {"gelu": "exact", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh"}


def is_huggingface(keys: Any) -> bool:
    keys = set(keys)
    return any(p + "embeddings.patch_embeddings.projection.weight" in keys for p in ("", "vit."))


def from_huggingface(state_dict: Mapping[str, Any]) -> StateDict:
    """An HF ViT state dict (either layout) renamed to vitlab keys.

    Keys the map does not know keep their names, so the loader reports them.
    """
    sd = {k: to_tensor(v) for k, v in state_dict.items()}
    base = "vit." if any(k.startswith("vit.") for k in sd) else ""
    if f"{base}layers.0.layernorm_before.weight" in sd:
        layer, modules, qkv = LAYOUT_V5
    elif f"{base}encoder.layer.0.layernorm_before.weight" in sd:
        layer, modules, qkv = LAYOUT_V4
    else:
        raise WeightsError("no Hugging Face ViT layer found ('layers.0.*' or 'encoder.layer.0.*')")
    if "classifier.weight" in sd:  # ViTForImageClassification reads the [class] token, never the pooler
        sd = {k: v for k, v in sd.items() if not k.startswith(f"{base}pooler.")}

    table = [(base + hf, ours) for hf, ours in BASE_MAP] + HEAD_MAP
    i = 0
    while (base + layer.format(i) + "layernorm_before.weight") in sd:
        pre = base + layer.format(i)
        table += [(f"{pre}{hf}.{p}", f"blocks.{i}.{ours}.{p}") for hf, ours in modules for p in ("weight", "bias")]
        for p in ("weight", "bias"):
            parts = [f"{pre}{m}.{p}" for m in qkv]
            if all(k in sd for k in parts):
                sd[f"blocks.{i}.attn.qkv.{p}"] = torch.cat([sd.pop(k) for k in parts])
        i += 1
    out = {ours: sd.pop(hf) for hf, ours in table if hf in sd}
    return {**out, **sd}  # leftovers are reported as unexpected by the loader


def config_overrides(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """ViTConfig fields that an HF ``config.json`` fixes and the weights cannot show."""
    out: dict[str, Any] = {}
    heads = hf_config.get("num_attention_heads")
    if heads is not None:
        if isinstance(heads, bool) or not isinstance(heads, int):
            raise WeightsError(f"num_attention_heads={heads!r} in the Hugging Face config: must be a positive integer")
        out["num_heads"] = heads
    eps = hf_config.get("layer_norm_eps")
    if eps is not None:
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise WeightsError(f"layer_norm_eps={eps!r} in the Hugging Face config: must be a number")
        out["ln_eps"] = float(eps)
    act = hf_config.get("hidden_act", "gelu")
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise WeightsError(f"hidden_act={act!r} in the Hugging Face config: vitlab supports {', '.join(ACTIVATIONS)}")
    out["gelu"] = ACTIVATIONS[act]
    if hf_config.get("pooler_act", "tanh") != "tanh":
        raise WeightsError(f"pooler_act={hf_config['pooler_act']!r}: vitlab's pre-logits layer is dense + tanh")
    return out


def load_huggingface(state_dict: Mapping[str, Any], hf_config: Mapping[str, Any] | None = None,
                     name: str | None = None, img_size: Pair | int | None = None,
                     num_classes: int | None = None, keep_pre_logits: bool = False, **overrides: Any) -> nn.Module:
    """A vitlab model (eval mode) holding HF ViT weights.

    The heads come from ``hf_config``, ``name`` (registry) or ``num_heads=``; the rest of
    the architecture from the shapes.  ``overrides`` are ViTConfig fields.
    """
    sd = from_huggingface(state_dict)
    fields = {**CONVENTIONS, **(config_overrides(hf_config) if hf_config else {}), **overrides}
    size, patch = (hf_config or {}).get("image_size"), (hf_config or {}).get("patch_size")
    non_square = lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and v[0] != v[1]  # noqa: E731
    if non_square(size) or non_square(patch):  # a non-square grid (of a square image too): the config says which
        height, width = size if isinstance(size, (list, tuple)) else (size, size)
        fields.setdefault("weights_img_size", (int(height), int(width)))
    cfg: ViTConfig = infer_config(sd, name=name, img_size_hint=img_size, **fields)
    return build_loaded(sd, cfg, img_size=img_size, num_classes=num_classes, keep_pre_logits=keep_pre_logits,
                        source="the Hugging Face weights")


PROCESSOR_NAME = "preprocessor_config.json"  # the image processor's config beside the weights


def processor_scaling(processor: Mapping[str, Any], where: str) -> InputScaling:
    """The input scaling of an image processor's config (``preprocessor_config.json``): its rescale
    (``do_rescale``, ``rescale_factor``) and normalisation (``do_normalize``, ``image_mean``,
    ``image_std``), each absent field ViTImageProcessor's default (1/255, mean and std 0.5)."""
    def field(name: str, default: Any) -> Any:
        value = processor.get(name)
        return default if value is None else value

    rescale = field("rescale_factor", 1 / 255) if field("do_rescale", True) else 1.0
    mean, std = (field("image_mean", 0.5), field("image_std", 0.5)) if field("do_normalize", True) else (0.0, 1.0)
    return InputScaling(mean, std, rescale, where, ("image_mean", "image_std", "rescale_factor"))


# ------------------------------------------------------------------------------ export

GELU_NAMES = {"exact": "gelu", "tanh": "gelu_pytorch_tanh"}  # vitlab gelu -> HF hidden_act


def _pair_or_int(pair: tuple[int, int]) -> int | list[int]:
    return pair[0] if pair[0] == pair[1] else list(pair)


def to_huggingface(model: nn.Module, class_names: Sequence[str] | None = None, loss: str | None = None
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict with HF hub names, config.json dict) of a vitlab ViT for ViTForImageClassification.

    ``class_names`` become ``id2label`` and ``label2id``; without them, Hugging Face's
    placeholders ``LABEL_0``, ``LABEL_1``, ...  ``loss`` (the ``optim.loss`` it was trained with)
    becomes ``problem_type`` (``labels.PROBLEM_TYPES``): transformers' pipelines give a
    "multi_label_classification" model's classes each their own sigmoid, as it was trained.
    """
    cfg = require_plain_vit(model.cfg, "Hugging Face ViTForImageClassification", hybrid=False)
    reasons = []
    if cfg.classifier != "token":
        reasons.append("classifier='gap' (ViTForImageClassification reads the [class] token)")
    if cfg.representation_size is not None:
        reasons.append(f"representation_size={cfg.representation_size} (ViTForImageClassification has no "
                       "pre-logits layer; load with num_classes=... to drop it, as fine-tuning does)")
    if reasons:
        raise WeightsError("Hugging Face ViTForImageClassification cannot hold this model: " + "; ".join(reasons))
    sd = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    layer, modules, qkv = LAYOUT_V4
    table = [("vit." + hf, ours) for hf, ours in BASE_MAP if not hf.startswith("pooler.")] + HEAD_MAP
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.depth):
        pre = "vit." + layer.format(i)
        table += [(f"{pre}{hf}.{p}", f"blocks.{i}.{ours}.{p}") for hf, ours in modules for p in ("weight", "bias")]
        for p in ("weight", "bias"):
            key = f"blocks.{i}.attn.qkv.{p}"
            if key in sd:
                for m, part in zip(qkv, sd.pop(key).chunk(3)):
                    out[f"{pre}{m}.{p}"] = part.clone()
    for hf, ours in table:
        if ours in sd:
            out[hf] = sd.pop(ours).clone()
    if sd:
        raise WeightsError(f"no Hugging Face name for: {', '.join(sorted(sd))}")
    if class_names is not None:
        names = distinct_names(check_class_names(class_names, cfg.num_classes, "class_names"))
    else:
        names = [f"LABEL_{i}" for i in range(cfg.num_classes)]
    config = {
        "architectures": ["ViTForImageClassification"], "model_type": "vit",
        "hidden_size": cfg.width, "num_hidden_layers": cfg.depth, "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.mlp_dim, "hidden_act": GELU_NAMES[cfg.gelu], "layer_norm_eps": cfg.ln_eps,
        "image_size": _pair_or_int(cfg.img_size), "patch_size": _pair_or_int(cfg.patch_size),
        "num_channels": cfg.in_chans, "qkv_bias": cfg.qkv_bias, "encoder_stride": cfg.patch_size[0],
        "hidden_dropout_prob": cfg.dropout, "attention_probs_dropout_prob": cfg.attention_dropout,
        "initializer_range": 0.02, "id2label": id2label(names), "label2id": label2id(names),
    }
    if loss is not None:
        config["problem_type"] = PROBLEM_TYPES[check_loss(loss, "loss")]
    if cfg.posemb_resample != "bicubic":
        warn_conventions([f"posemb_resample: the model resamples position embeddings {cfg.posemb_resample!r}, "
                          "Hugging Face's interpolate_pos_encoding=True bicubically (equal logits at the saved "
                          "img_size)"], "Hugging Face")
    return out, config


def image_processor(cfg: ViTConfig) -> dict[str, Any]:
    """``preprocessor_config.json`` of a ViTImageProcessor that gives the model what vitlab's models read
    (``core.input_preprocessing``): pixels p as p / 127.5 - 1 (rescaled by 1/255, mean and std 0.5), resized
    bilinearly to its size."""
    given = input_preprocessing(cfg)
    height, width = given["image_size"]
    return {"image_processor_type": "ViTImageProcessor", "do_resize": True,
            "resample": PIL_FILTERS[given["interpolation"]], "size": {"height": height, "width": width},
            "do_rescale": True, "rescale_factor": given["rescale_factor"], "do_normalize": True,
            "image_mean": given["mean"], "image_std": given["std"]}


PIL_FILTERS = {"bilinear": 2, "bicubic": 3}  # ViTImageProcessor's resample: PIL's filter numbers


def save_huggingface(model: nn.Module, path: str | os.PathLike, class_names: Sequence[str] | None = None,
                     loss: str | None = None) -> Path:
    """Write ``path/config.json``, ``path/preprocessor_config.json`` (``image_processor``) and
    ``path/model.safetensors`` for ``ViTForImageClassification.from_pretrained`` and ``AutoImageProcessor``."""
    tensors, config = to_huggingface(model, class_names, loss)
    path = Path(path)
    data = safetensors.torch.save(tensors, metadata={"format": "pt"})
    # as a set, the weights last: a failure between them left new weights beside the old config.json; a
    # vitlab save's classes.json goes, which described the weights replaced: read before id2label, it named
    # these classes by the earlier ones; and a folder's image processor is replaced, which described the
    # inputs of the weights replaced (load_model takes its scaling into the weights it reads); a timm export's
    # .timm.json goes too, whose label_names were read as the weights file's own
    text = json.dumps(config, indent=2, sort_keys=True)
    processor = json.dumps(image_processor(model.cfg), indent=2, sort_keys=True)
    return atomic_write_set([(path / "config.json", lambda f: f.write(text.encode())),
                             (path / PROCESSOR_NAME, lambda f: f.write(processor.encode())),
                             (path / "model.safetensors", lambda f: f.write(data))],
                            remove=[path / CLASSES_NAME, sidecar_path(path / "model.safetensors")])[-1]
