"""timm ``vision_transformer`` state dicts.

timm's names are vitlab's except for two (vitlab named its modules after timm's, whose
uniform API it follows)::

    timm                         vitlab
    patch_embed.proj.{weight,bias}   patch_embed.{weight,bias}
    pos_embed                    pos_embed.weight
    cls_token, blocks.*, norm.*, pre_logits.fc.*, head.*   (same)

What timm can hold and the paper's model cannot is refused with the reason:
``fc_norm`` (timm's average-pooling models apply the final LayerNorm *after* pooling,
whereas the official "gap" classifier normalises every token and then averages), and
anything else unknown is reported as an unexpected key (layer scale ``ls1``, register
tokens, ``norm_pre``...).  Conventions: exact GELU, LayerNorm eps 1e-6, bicubic
position-embedding resampling (timm's ``resample_abs_pos_embed`` default).

Hybrids (``vision_transformer_hybrid.py``: ``vit_base_r50_s16_384``, ``vit_large_r50_s32_384``,
``vit_small_r26_s32_224``, root-only ``vit_tiny_r_s16_p8_384``) keep the ResNet inside the patch
embedding; its layout is timm's ``resnetv2.ResNetV2(preact=False, stem_type="same")``::

    timm                                                           vitlab
    patch_embed.backbone.stem.conv.weight                          stem.conv_root.weight
    patch_embed.backbone.stem.norm.{weight,bias}                   stem.gn_root.*
    patch_embed.backbone.{conv,norm}.*      (root only, no stages) stem.{conv_root,gn_root}.*
    patch_embed.backbone.stages.S.blocks.U.conv{1,2,3}.weight      stem.stages.S.units.U.conv{1,2,3}.weight
    patch_embed.backbone.stages.S.blocks.U.norm{1,2,3}.*           stem.stages.S.units.U.gn{1,2,3}.*
    patch_embed.backbone.stages.S.blocks.U.downsample.conv.weight  stem.stages.S.units.U.conv_proj.weight
    patch_embed.backbone.stages.S.blocks.U.downsample.norm.*       stem.stages.S.units.U.gn_proj.*

with timm's stem conventions: ``StdConv2dSame(eps=1e-8)``, i.e. ``(w - mean) / sqrt(var + 1e-8)``,
GroupNorm(32) eps 1e-5, SAME padding and a -inf padded SAME max-pool.

Non-square models (``img_size=(h, w)``, ``patch_size=(ph, pw)``) hold no size in their
state dict: a non-square grid needs ``weights_img_size=`` (or ``img_size=`` that size);
``dynamic_img_size=True`` models have the same keys and are loaded with that override
(vitlab resamples bicubically without antialiasing: equal to timm when upsampling).
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from torch import nn

from ..config import Pair
from .core import StateDict, WeightsError, build_loaded, infer_config, to_tensor

CONVENTIONS: dict[str, Any] = {"gelu": "exact", "ln_eps": 1e-6, "posemb_resample": "bicubic"}

# (timm name, vitlab name); every other key is the same in both.
RENAMES: list[tuple[str, str]] = [
    ("patch_embed.proj.weight", "patch_embed.weight"),
    ("patch_embed.proj.bias", "patch_embed.bias"),
    ("pos_embed", "pos_embed.weight"),
]


RESNET_CONVENTIONS: dict[str, Any] = {"padding": "same", "ws_eps": 1e-8, "ws_eps_inside_sqrt": True, "gn_eps": 1e-5}

# (timm regex, vitlab template) for the hybrid backbone, in timm's resnetv2 layout
HYBRID_RENAMES: list[tuple[str, str]] = [
    (r"patch_embed\.backbone\.(?:stem\.)?conv\.weight", "stem.conv_root.weight"),
    (r"patch_embed\.backbone\.(?:stem\.)?norm\.(weight|bias)", r"stem.gn_root.\1"),
    (r"patch_embed\.backbone\.stages\.(\d+)\.blocks\.(\d+)\.conv([123])\.weight", r"stem.stages.\1.units.\2.conv\3.weight"),
    (r"patch_embed\.backbone\.stages\.(\d+)\.blocks\.(\d+)\.norm([123])\.(weight|bias)", r"stem.stages.\1.units.\2.gn\3.\4"),
    (r"patch_embed\.backbone\.stages\.(\d+)\.blocks\.(\d+)\.downsample\.conv\.weight", r"stem.stages.\1.units.\2.conv_proj.weight"),
    (r"patch_embed\.backbone\.stages\.(\d+)\.blocks\.(\d+)\.downsample\.norm\.(weight|bias)", r"stem.stages.\1.units.\2.gn_proj.\3"),
]
# vitlab -> timm, for export (stages present: the "stem." level exists in timm's ResNetV2)
HYBRID_EXPORT: list[tuple[str, str]] = [
    (r"stem\.conv_root\.weight", "patch_embed.backbone.{stem}conv.weight"),
    (r"stem\.gn_root\.(weight|bias)", r"patch_embed.backbone.{stem}norm.\1"),
    (r"stem\.stages\.(\d+)\.units\.(\d+)\.conv([123])\.weight", r"patch_embed.backbone.stages.\1.blocks.\2.conv\3.weight"),
    (r"stem\.stages\.(\d+)\.units\.(\d+)\.gn([123])\.(weight|bias)", r"patch_embed.backbone.stages.\1.blocks.\2.norm\3.\4"),
    (r"stem\.stages\.(\d+)\.units\.(\d+)\.conv_proj\.weight", r"patch_embed.backbone.stages.\1.blocks.\2.downsample.conv.weight"),
    (r"stem\.stages\.(\d+)\.units\.(\d+)\.gn_proj\.(weight|bias)", r"patch_embed.backbone.stages.\1.blocks.\2.downsample.norm.\3"),
]


def is_timm(keys: Any) -> bool:
    return "patch_embed.proj.weight" in set(keys)


def _rename(key: str, table: list[tuple[str, str]]) -> str:
    for pattern, template in table:
        m = re.fullmatch(pattern, key)
        if m:
            return m.expand(template)
    return key


def from_timm(state_dict: Mapping[str, Any]) -> StateDict:
    """A timm ViT state dict renamed to vitlab keys."""
    if "fc_norm.weight" in state_dict:
        raise WeightsError(
            "this timm model has 'fc_norm': it applies the final LayerNorm after average pooling, while the "
            "paper's 'gap' classifier (vit_jax) normalises the tokens and then averages; vitlab implements "
            "only the latter, so these weights would compute a different function"
        )
    sd = {_rename(k, HYBRID_RENAMES) if k.startswith("patch_embed.backbone.") else k: to_tensor(v)
          for k, v in state_dict.items()}
    for theirs, ours in RENAMES:
        if theirs in sd:
            sd[ours] = sd.pop(theirs)
    return sd


def load_timm(state_dict: Mapping[str, Any], name: str | None = None, img_size: Pair | int | None = None,
              num_classes: int | None = None, keep_pre_logits: bool = False, **overrides: Any) -> nn.Module:
    """A vitlab model (eval mode) holding timm ViT weights; heads from ``name`` or ``num_heads=``.

    A [class] token means the "token" classifier (timm can also average next to a class
    token; the weights cannot tell, so pass ``classifier="gap"`` for such models).
    """
    sd = from_timm(state_dict)
    cfg = infer_config(sd, name=name, img_size_hint=img_size, resnet_fields=RESNET_CONVENTIONS,
                       **{**CONVENTIONS, **overrides})
    return build_loaded(sd, cfg, img_size=img_size, num_classes=num_classes, keep_pre_logits=keep_pre_logits,
                        source="the timm weights")
