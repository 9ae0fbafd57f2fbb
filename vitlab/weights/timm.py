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
tokens, ``norm_pre``...).  ``no_embed_class=True`` models (no position for the [class]
token) load with a zero [class] row, the same function.  Conventions: exact GELU, LayerNorm eps 1e-6, bicubic
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
state dict: a non-square grid needs ``weights_img_size=`` (or ``img_size=`` that size, except
for a (k, k + 2) grid, whose [class] and patch positions count a square, as no_embed_class's do);
``dynamic_img_size=True`` models have the same keys and are loaded with that override
(vitlab resamples bicubically without antialiasing: equal to timm when upsampling).

Export (``save_timm``, ``save_model(..., format="timm")``) writes the state dict under
timm's names (safetensors, or a torch file for .pth/.bin) and, beside it, ``<stem>.timm.json``:
the ``timm.create_model`` name and keyword arguments that build the same function
(``img_size``, ``patch_size``, widths, ``class_token``/``global_pool``/``fc_norm=False`` for
"gap", ``act_layer="gelu_tanh"`` for vit_jax's GELU), used as ``timm.create_model(spec["model_name"], pretrained=True,
pretrained_cfg_overlay=spec["pretrained_cfg_overlay"] | {"file": path}, **spec["kwargs"])``
(the overlay also states the head size, which timm's ``load_pretrained`` otherwise compares
with the named model's and drops when they differ, and the input vitlab's predict gives the model,
in the fields timm's eval transform is built from: ``data_config``).
Conventions timm's constructors cannot take (a LayerNorm eps other than 1e-6, the hybrid
stem's weight-standardisation and GroupNorm eps) are listed in the file's "notes" and
warned about (``ConventionWarning``).  vitlab's loader reads the JSON back when present, unless it names another
file there (its overlay's ``file``: x.pth and x.safetensors share x.timm.json).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import safetensors.torch
import torch
from torch import nn

from ..config import Pair, ViTConfig, to_pair
from ..models.registry import VIT_SIZES
from .core import (TRAINED_AT, InputScaling, StateDict, WeightsError, atomic_write_set, build_loaded,
                   convention_differences, infer_config, infer_resnet, input_preprocessing, require_plain_vit,
                   to_tensor, warn_conventions)
from .labels import CLASSES_NAME, check_class_names, distinct_names

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


def embed_class_position(sd: StateDict, weights_img_size: Pair | int | None = None,
                         img_size_hint: Pair | int | None = None) -> StateDict:
    """timm's ``no_embed_class=True``: the table holds patch positions only and the [class] token
    is prepended after it is added; that is vitlab's table with a zero [class] row.

    Recognised when the patch count is a square and one more is not (or, for a non-square
    grid, ``weights_img_size`` says so); the zero row is prepended.  A square of positions is
    also a [class] position and a (k, k + 2) grid (1 + 15 x 17 = 16 x 16): where ``img_size_hint``
    (the size asked for) has that grid, which the table is cannot be told, and it is refused.
    """
    table = sd.get("pos_embed.weight")
    if table is None or "cls_token" not in sd or table.ndim != 3:
        return sd
    n = table.shape[1]
    is_square = lambda k: k > 0 and int(round(k ** 0.5)) ** 2 == k
    no_embed_class = is_square(n) and not is_square(n - 1)
    if "patch_embed.weight" in sd:
        ph, pw = sd["patch_embed.weight"].shape[2:]
        # a hybrid's patches cut its stem's feature map (SAME padding: ceil); skipped, a hybrid's table was
        # judged by its count alone, and a 4x6 grid's 1 + 24 positions taken for a 5x5 no_embed_class one
        resnet = infer_resnet(sd)
        r = resnet.reduction if resnet is not None else 1
        patches = lambda size, what: (lambda h, w: (-(-h // r) // ph) * (-(-w // r) // pw))(*to_pair(size, what))
        if weights_img_size is not None:
            no_embed_class = n == patches(weights_img_size, "weights_img_size")
        elif no_embed_class and img_size_hint is not None and patches(img_size_hint, "img_size") == n - 1:
            # read as a square grid, these weights were silently another model at the asked size
            side = int(round(n ** 0.5))
            raise WeightsError(
                f"pos_embed holds {n} positions: a {side}x{side} grid without a [class] position (timm's "
                f"no_embed_class), or a [class] position and the {n - 1} patches of img_size={img_size_hint}; "
                f"{TRAINED_AT}")
    if no_embed_class:
        sd = {**sd, "pos_embed.weight": torch.cat([table.new_zeros(1, 1, table.shape[2]), table], dim=1)}
    return sd


def kwargs_overrides(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """ViTConfig fields fixed by timm ``create_model`` keyword arguments (as ``save_timm`` writes them)."""
    out: dict[str, Any] = {}
    if "num_heads" in kwargs:
        out["num_heads"] = int(kwargs["num_heads"])
    if "img_size" in kwargs:
        size = kwargs["img_size"]
        out["weights_img_size"] = tuple(size) if isinstance(size, (list, tuple)) else int(size)
    act = kwargs.get("act_layer", "gelu")
    if act not in TIMM_GELU:
        raise WeightsError(f"act_layer={act!r} in the timm arguments: vitlab supports {', '.join(TIMM_GELU)}")
    out["gelu"] = TIMM_GELU[act]
    if kwargs.get("global_pool") == "avg":
        if kwargs.get("fc_norm", True) is not False:
            raise WeightsError("global_pool='avg' with fc_norm: timm normalises after pooling; vitlab's 'gap' "
                               "normalises the tokens, then averages (fc_norm=False)")
        out["classifier"] = "gap"
    if kwargs.get("dynamic_img_size"):
        out["dynamic_img_size"] = True
    return out


def load_timm(state_dict: Mapping[str, Any], name: str | None = None, img_size: Pair | int | None = None,
              num_classes: int | None = None, keep_pre_logits: bool = False,
              timm_kwargs: Mapping[str, Any] | None = None, **overrides: Any) -> nn.Module:
    """A vitlab model (eval mode) holding timm ViT weights; heads from ``name``, ``num_heads=`` or
    ``timm_kwargs`` (the ``create_model`` arguments, e.g. the JSON ``save_timm`` writes).

    A [class] token means the "token" classifier.  timm can also average the patch tokens next to
    a [class] token (``global_pool="avg"``), which attends with them: vitlab's "gap" has no [class]
    token, so such weights are refused (the weights alone cannot tell; the ``.timm.json`` or
    ``classifier="gap"`` can).
    """
    if timm_kwargs:
        overrides = {**kwargs_overrides(timm_kwargs), **overrides}
    sd = embed_class_position(from_timm(state_dict), overrides.get("weights_img_size"), img_size)
    if overrides.get("classifier") == "gap" and "cls_token" in sd:
        # read as a "gap" model they were reported as mis-shaped, the advice once given here
        raise WeightsError("classifier='gap' with timm weights that have a [class] token (cls_token): timm averages "
                           "the patch tokens next to a [class] token that attends with them, and vitlab's 'gap' "
                           "model has no [class] token; these weights cannot be its")
    cfg = infer_config(sd, name=name, img_size_hint=img_size, resnet_fields=RESNET_CONVENTIONS,
                       **{**CONVENTIONS, **overrides})
    return build_loaded(sd, cfg, img_size=img_size, num_classes=num_classes, keep_pre_logits=keep_pre_logits,
                        source="the timm weights")


def pretrained_cfg_scaling(pretrained_cfg: Any, where: str) -> InputScaling | None:
    """The input scaling a timm ``pretrained_cfg`` (a Hub folder's config.json) or a ``.timm.json``'s
    ``pretrained_cfg_overlay`` states: ``(p / 255 - mean) / std``; None where it gives no mean and std."""
    if not isinstance(pretrained_cfg, Mapping) or None in (pretrained_cfg.get("mean"), pretrained_cfg.get("std")):
        return None
    return InputScaling(pretrained_cfg["mean"], pretrained_cfg["std"], 1 / 255, where)


# ------------------------------------------------------------------------------ export

TIMM_GELU = {"gelu": "exact", "gelu_tanh": "tanh"}  # timm act_layer -> vitlab gelu
SIZE_NAMES = {dims: name for name, dims in zip(("tiny", "small", "base", "large", "huge"), VIT_SIZES.values())}
# vitlab hybrid ResNet layers -> the piece of timm's model name (vision_transformer_hybrid.py)
HYBRID_NAMES = {(): "r_s16_p8", (2, 2, 2, 2): "r26_s32", (3, 4, 9): "r50_s16", (3, 4, 6, 3): "r50_s32"}
# The names timm registers (``@register_model`` in timm's vision_transformer.py and
# vision_transformer_hybrid.py).  Every one of them takes the architecture's keyword
# arguments over its own defaults, so any plain one builds any plain ViT; a hybrid's entry
# point fixes its ResNet's layers.
TIMM_VIT_NAMES = (
    "vit_tiny_patch16_224", "vit_tiny_patch16_384", "vit_small_patch32_224", "vit_small_patch32_384",
    "vit_small_patch16_224", "vit_small_patch16_384", "vit_small_patch8_224", "vit_base_patch32_224",
    "vit_base_patch32_384", "vit_base_patch16_224", "vit_base_patch16_384", "vit_base_patch8_224",
    "vit_large_patch32_224", "vit_large_patch32_384", "vit_large_patch16_224", "vit_large_patch16_384",
    "vit_large_patch14_224", "vit_huge_patch14_224",
)
TIMM_HYBRID_NAMES = (
    "vit_tiny_r_s16_p8_224", "vit_tiny_r_s16_p8_384", "vit_small_r26_s32_224", "vit_small_r26_s32_384",
    "vit_base_r26_s32_224", "vit_base_r50_s16_224", "vit_base_r50_s16_384", "vit_large_r50_s32_224",
    "vit_large_r50_s32_384",
)


def timm_model_name(cfg: ViTConfig) -> tuple[str | None, str | None]:
    """(a name timm registers that builds ``cfg`` with the exported keyword arguments, a
    note when it is not ``cfg``'s own name); (None, why) when timm has no constructor.

    The closest registered name is chosen: the same size, patch (or hybrid stem) and
    resolution if timm has it, else the same size and patch, else the same patch or stem,
    else any; the keyword arguments make the model exact either way.
    """
    size = SIZE_NAMES.get((cfg.width, cfg.depth, cfg.mlp_dim, cfg.num_heads))
    if cfg.resnet is not None:
        stem = HYBRID_NAMES.get(cfg.resnet.layers)
        if stem is None:
            return None, (f"timm registers no hybrid with ResNet layers {cfg.resnet.layers} (only "
                          f"{', '.join(map(str, HYBRID_NAMES))}): timm.create_model cannot build this model")
        own = f"vit_{size or 'custom'}_{stem}_{cfg.img_size[0]}"
        candidates = [n for n in TIMM_HYBRID_NAMES if f"_{stem}_" in n]
    else:
        own = f"vit_{size or 'custom'}_patch{cfg.patch_size[0]}_{cfg.img_size[0]}"
        candidates = list(TIMM_VIT_NAMES)
    if own in candidates:
        return own, None
    prefix, _, resolution = own.rpartition("_")

    def closeness(name: str) -> tuple:
        name_prefix, _, name_resolution = name.rpartition("_")
        piece = name_prefix.split("_", 2)[2]  # "patch16", "r50_s16"
        return (name_prefix == prefix, piece == prefix.split("_", 2)[2], name.startswith(f"vit_{size}_"),
                name_resolution == resolution, name_resolution == "224", "_base_" in name, "patch16" in name)

    chosen = max(candidates, key=closeness)  # the first of equals: the table's order
    return chosen, (f"timm registers no {own}; {chosen} builds this model with these keyword arguments "
                    "and the pretrained_cfg_overlay")


def to_timm(model: nn.Module, class_names: Sequence[str] | None = None
            ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(timm state dict, {"model_name", "kwargs", "pretrained_cfg_overlay", "notes"}) of a vitlab ViT.

    ``class_names`` go into the overlay as ``label_names``, the field of timm's
    ``PretrainedCfg`` that names the classes.
    """
    cfg = require_plain_vit(model.cfg, "timm's VisionTransformer")
    reasons = []
    if cfg.representation_size is not None:
        reasons.append(f"representation_size={cfg.representation_size} (timm's VisionTransformer has no "
                       "pre-logits layer; load with num_classes=... to drop it, as fine-tuning does)")
    if cfg.resnet is not None and (cfg.resnet.width_factor != 1 or cfg.resnet.norm != "group"
                                   or cfg.resnet.root_kernel != 7 or cfg.resnet.root_stride != 2
                                   or not cfg.resnet.root_pool):
        reasons.append("a hybrid stem other than timm's (_resnetv2: width factor 1, GroupNorm, 7x7/2 root, max-pool)")
    if reasons:
        raise WeightsError("timm cannot hold this model: " + "; ".join(reasons))
    sd = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    stem = "stem." if cfg.resnet is not None and cfg.resnet.layers else ""
    export = [(pattern, template.replace("{stem}", stem)) for pattern, template in HYBRID_EXPORT]
    for key, value in sd.items():
        if key.startswith("stem."):
            new = _rename(key, export)
            if new == key:
                raise WeightsError(f"no timm name for {key}")
            out[new] = value
        else:
            out[dict((ours, theirs) for theirs, ours in RENAMES).get(key, key)] = value
    kwargs: dict[str, Any] = {
        "img_size": list(cfg.img_size), "patch_size": list(cfg.patch_size), "in_chans": cfg.in_chans,
        "num_classes": cfg.num_classes, "embed_dim": cfg.width, "depth": cfg.depth, "num_heads": cfg.num_heads,
        "mlp_ratio": cfg.mlp_dim / cfg.width, "qkv_bias": cfg.qkv_bias,
        "class_token": cfg.classifier == "token", "global_pool": "token" if cfg.classifier == "token" else "avg",
        "fc_norm": False,
    }
    if cfg.gelu == "tanh":
        kwargs["act_layer"] = "gelu_tanh"
    if cfg.dynamic_img_size:
        kwargs["dynamic_img_size"] = True
    notes = convention_differences(cfg, {"ln_eps": 1e-6}, "timm (LayerNorm eps is fixed by its constructors)")
    if int(cfg.width * (cfg.mlp_dim / cfg.width)) != cfg.mlp_dim:
        notes.append(f"mlp_dim={cfg.mlp_dim}: timm's int(embed_dim * mlp_ratio) rounds to another width")
    if cfg.resnet is not None:
        notes += convention_differences(cfg.resnet, RESNET_CONVENTIONS, "timm's hybrid stem (StdConv2dSame eps 1e-8, "
                                        "GroupNorm eps 1e-5)")
    if cfg.posemb_resample != "bicubic":
        notes.append(f"posemb_resample: the model resamples position embeddings {cfg.posemb_resample!r}, timm "
                     "bicubically (equal logits at the saved img_size)")
    warn_conventions(notes, "timm")
    # timm's load_pretrained drops a head whose size differs from pretrained_cfg["num_classes"]:
    # the overlay states the file's own, so the written head is loaded, not replaced
    overlay = {"num_classes": cfg.num_classes, **data_config(cfg)}
    if class_names is not None:
        overlay["label_names"] = distinct_names(check_class_names(class_names, cfg.num_classes, "class_names"))
    name, why = timm_model_name(cfg)
    if why is not None:
        notes.append(why)
    return out, {"model_name": name, "kwargs": kwargs, "pretrained_cfg_overlay": overlay, "notes": notes}


def data_config(cfg: ViTConfig) -> dict[str, Any]:
    """The fields of timm's ``pretrained_cfg`` from which its ``resolve_data_config`` and ``create_transform``
    build the eval transform vitlab's predict applies (``core.input_preprocessing``): else the named model's
    own fill them in, ImageNet's mean and std for some, and for every ViT a centre crop of 0.9 of the image
    resized bicubically.  timm's eval transform resizes the image to input_size / crop_pct and centre-crops
    input_size; crop_mode "squash" resizes each side to its size (the aspect ratio not kept), so at crop_pct 1
    it is vitlab's bilinear resize of the whole image.  The test_ fields are those of ``use_test_size=True``."""
    given = input_preprocessing(cfg)
    size = [cfg.in_chans, *given["image_size"]]
    return {"input_size": size, "test_input_size": size, "crop_pct": 1.0, "test_crop_pct": 1.0, "crop_mode": "squash",
            "interpolation": given["interpolation"], "mean": given["mean"], "std": given["std"]}


def sidecar_path(path: str | os.PathLike) -> Path:
    """Where ``save_timm`` writes the create_model arguments of ``path``: ``<stem>.timm.json``."""
    path = Path(path)
    return path.with_name(path.stem + ".timm.json")


def save_timm(model: nn.Module, path: str | os.PathLike, class_names: Sequence[str] | None = None) -> Path:
    """Write timm's state dict to ``path`` (.safetensors, or a torch file for .pth/.bin) and
    ``<stem>.timm.json`` beside it; both atomically.  A directory gets ``model.safetensors``."""
    tensors, spec = to_timm(model, class_names)
    path, stale = Path(path), []
    if path.suffix not in (".safetensors", ".pth", ".bin", ".pt"):
        path.mkdir(parents=True, exist_ok=True)
        # the folder's model is replaced: the config.json (vitlab's or Hugging Face's; save_model refuses any
        # other) and classes.json of the weights replaced described them, and the folder read as that model
        stale = [path / "config.json", path / CLASSES_NAME]
        path = path / "model.safetensors"
    if path.suffix == ".safetensors":
        data = safetensors.torch.save(tensors, metadata={"format": "pt"})
        write_weights = lambda f: f.write(data)  # noqa: E731
    else:
        write_weights = lambda f: torch.save(tensors, f)  # noqa: E731
    spec["pretrained_cfg_overlay"]["file"] = path.name  # relative to the JSON: the files travel together
    # as a set, the weights last: a failure between them left new weights beside the old sidecar
    return atomic_write_set([(sidecar_path(path), lambda f: f.write(json.dumps(spec, indent=2).encode())),
                             (path, write_weights)], remove=stale)[-1]
