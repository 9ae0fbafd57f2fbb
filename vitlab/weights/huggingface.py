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
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from ..config import Pair, ViTConfig
from .core import StateDict, WeightsError, build_loaded, infer_config, to_tensor

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
    if "num_attention_heads" in hf_config:
        out["num_heads"] = int(hf_config["num_attention_heads"])
    if "layer_norm_eps" in hf_config:
        out["ln_eps"] = float(hf_config["layer_norm_eps"])
    act = hf_config.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
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
    cfg: ViTConfig = infer_config(sd, name=name, img_size_hint=img_size, **fields)
    return build_loaded(sd, cfg, img_size=img_size, num_classes=num_classes, keep_pre_logits=keep_pre_logits,
                        source="the Hugging Face weights")
