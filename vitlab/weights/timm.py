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
"""
from __future__ import annotations

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


def is_timm(keys: Any) -> bool:
    return "patch_embed.proj.weight" in set(keys)


def from_timm(state_dict: Mapping[str, Any]) -> StateDict:
    """A timm ViT state dict renamed to vitlab keys."""
    if "fc_norm.weight" in state_dict:
        raise WeightsError(
            "this timm model has 'fc_norm': it applies the final LayerNorm after average pooling, while the "
            "paper's 'gap' classifier (vit_jax) normalises the tokens and then averages; vitlab implements "
            "only the latter, so these weights would compute a different function"
        )
    sd = {k: to_tensor(v) for k, v in state_dict.items()}
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
    cfg = infer_config(sd, name=name, **{**CONVENTIONS, **overrides})
    return build_loaded(sd, cfg, img_size=img_size, num_classes=num_classes, keep_pre_logits=keep_pre_logits,
                        source="the timm weights")
