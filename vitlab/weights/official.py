"""The paper's released checkpoints: vit_jax ``.npz`` files (flattened Flax trees).

Names and layouts were read from google-research/vision_transformer: ``models_vit.py``
(module names, the hybrid root), ``models_resnet.py`` (units, StdConv), and
``checkpoint.py`` (``load_pretrained``: head reset, pre-logits drop, position-embedding
zoom; ``_fix_groupnorm``: old GroupNorm params are (1, 1, 1, C)).

The map between the two layouts, written out below, is (i = block, S/U = stage/unit
counted from 1 in Flax, from 0 in vitlab; D width, H heads, hd = D/H, M mlp_dim)::

    official                                        vitlab                       rearrangement
    cls                                     (1,1,D) cls_token                    as is
    embedding/kernel                    (P,P,C,D)   patch_embed.weight           HWIO -> OIHW
    embedding/bias                                  patch_embed.bias             as is
    Transformer/posembed_input/pos_embedding        pos_embed.weight             as is (1, prefix+N, D)
    Transformer/encoderblock_i/
      LayerNorm_0/{scale,bias}                      blocks.i.norm1.{weight,bias} as is
      MultiHeadDotProductAttention_1/
        {query,key,value}/kernel        (D,H,hd)    blocks.i.attn.qkv.weight     (D,H*hd).T, stacked q;k;v
        {query,key,value}/bias            (H,hd)    blocks.i.attn.qkv.bias       flattened, stacked
        out/kernel                      (H,hd,D)    blocks.i.attn.proj.weight    (H*hd,D).T
        out/bias                                    blocks.i.attn.proj.bias      as is
      LayerNorm_2/{scale,bias}                      blocks.i.norm2.{weight,bias} as is
      MlpBlock_3/Dense_0/{kernel,bias}    (D,M)     blocks.i.mlp.fc1.*           kernel.T
      MlpBlock_3/Dense_1/{kernel,bias}    (M,D)     blocks.i.mlp.fc2.*           kernel.T
    Transformer/encoder_norm/{scale,bias}           norm.{weight,bias}           as is
    pre_logits/{kernel,bias}                        pre_logits.fc.*              kernel.T
    head/{kernel,bias}                    (D,K)     head.*                       kernel.T
    conv_root/kernel                                stem.conv_root.weight        HWIO -> OIHW
    gn_root/{scale,bias}                            stem.gn_root.{weight,bias}   flattened
    blockS/unitU/{conv1,conv2,conv3,conv_proj}/kernel  stem.stages.S-1.units.U-1.<conv>.weight  HWIO -> OIHW
    blockS/unitU/{gn1,gn2,gn3,gn_proj}/{scale,bias}    stem.stages.S-1.units.U-1.<gn>.*         flattened

Numerical conventions of the Flax code, set on every loaded config: GELU with the tanh
approximation (``flax.linen.gelu`` default), LayerNorm and GroupNorm eps 1e-6 (Flax
defaults), StdConv ``(w - mean) / (std + 1e-5)`` over (H, W, in), SAME padding, -inf
padded max-pool; position embeddings resized with ``scipy.ndimage.zoom(order=1)``, which
is vitlab's "bilinear" resampling with aligned corners.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
from torch import nn

from ..config import Pair, ViTConfig
from ..files import atomic_write
from ..models.registry import VIT_SIZES
from .core import (StateDict, WeightsError, build_loaded, convention_differences, infer_config, numeric_array,
                   other_root, to_tensor, warn_conventions)

# Conventions of vit_jax, applied to every config read from an official checkpoint.
CONVENTIONS: dict[str, Any] = {"gelu": "tanh", "ln_eps": 1e-6, "posemb_resample": "bilinear"}
RESNET_CONVENTIONS: dict[str, Any] = {"padding": "same", "ws_eps": 1e-5, "ws_eps_inside_sqrt": False, "gn_eps": 1e-6}

# Old Flax optimizer checkpoints nest the parameters under this prefix.
KNOWN_PREFIXES = ("opt/target/",)

# ----------------------------------------------------------------- rearrangements
# Each kind is a pair (Flax array -> torch tensor, torch tensor -> Flax array).
Kind = tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]
AS_IS: Kind = (lambda a: a, lambda a: a)
DENSE: Kind = (lambda a: a.T, lambda a: a.T)  # (in, out) <-> (out, in)
CONV: Kind = (lambda a: a.transpose(3, 2, 0, 1), lambda a: a.transpose(2, 3, 1, 0))  # HWIO <-> OIHW
# GroupNorm params: Flax before 0.3.6 stored (1, 1, 1, C); now (C,), as vitlab.
NORM_1D: Kind = (lambda a: a.reshape(-1), lambda a: a.reshape(-1))

# (official name, vitlab name, kind): names relative to the encoder block i.
BLOCK_MAP: list[tuple[str, str, Kind]] = [
    ("LayerNorm_0/scale", "norm1.weight", AS_IS),
    ("LayerNorm_0/bias", "norm1.bias", AS_IS),
    ("LayerNorm_2/scale", "norm2.weight", AS_IS),
    ("LayerNorm_2/bias", "norm2.bias", AS_IS),
    ("MlpBlock_3/Dense_0/kernel", "mlp.fc1.weight", DENSE),
    ("MlpBlock_3/Dense_0/bias", "mlp.fc1.bias", AS_IS),
    ("MlpBlock_3/Dense_1/kernel", "mlp.fc2.weight", DENSE),
    ("MlpBlock_3/Dense_1/bias", "mlp.fc2.bias", AS_IS),
    ("MultiHeadDotProductAttention_1/out/bias", "attn.proj.bias", AS_IS),
]
ATTENTION = "MultiHeadDotProductAttention_1"
QKV = ("query", "key", "value")  # stacked in this order into attn.qkv (rows q, then k, then v)

TOP_MAP: list[tuple[str, str, Kind]] = [
    ("cls", "cls_token", AS_IS),
    ("embedding/kernel", "patch_embed.weight", CONV),
    ("embedding/bias", "patch_embed.bias", AS_IS),
    ("Transformer/posembed_input/pos_embedding", "pos_embed.weight", AS_IS),
    ("Transformer/encoder_norm/scale", "norm.weight", AS_IS),
    ("Transformer/encoder_norm/bias", "norm.bias", AS_IS),
    ("pre_logits/kernel", "pre_logits.fc.weight", DENSE),
    ("pre_logits/bias", "pre_logits.fc.bias", AS_IS),
    ("head/kernel", "head.weight", DENSE),
    ("head/bias", "head.bias", AS_IS),
    ("conv_root/kernel", "stem.conv_root.weight", CONV),
    ("gn_root/scale", "stem.gn_root.weight", NORM_1D),
    ("gn_root/bias", "stem.gn_root.bias", NORM_1D),
]

# names relative to blockS/unitU (official) and stem.stages.{S-1}.units.{U-1} (vitlab)
UNIT_MAP: list[tuple[str, str, Kind]] = [
    (f"{conv}/kernel", f"{conv}.weight", CONV) for conv in ("conv1", "conv2", "conv3", "conv_proj")
] + [
    (f"{gn}/{flax}", f"{gn}.{ours}", NORM_1D)
    for gn in ("gn1", "gn2", "gn3", "gn_proj")
    for flax, ours in (("scale", "weight"), ("bias", "bias"))
]


def key_map(depth: int, stem_units: list[int]) -> list[tuple[str, str, Kind]]:
    """The full (official, vitlab, kind) table of a ViT of ``depth`` blocks whose hybrid
    stem has ``stem_units[s]`` units in stage s (empty for a plain ViT).  Optional entries
    (cls, pre_logits, head, stem, conv_proj) are listed; absent arrays are skipped.
    Attention q/k/v, which fuse three arrays into one, are handled apart (see ``QKV``)."""
    table = list(TOP_MAP)
    for i in range(depth):
        table += [(f"Transformer/encoderblock_{i}/{o}", f"blocks.{i}.{v}", k) for o, v, k in BLOCK_MAP]
    for s, units in enumerate(stem_units):
        for u in range(units):
            table += [(f"block{s + 1}/unit{u + 1}/{o}", f"stem.stages.{s}.units.{u}.{v}", k) for o, v, k in UNIT_MAP]
    return table


def _count_prefixed(names: Any, template: str) -> int:
    n = 0
    while any(k.startswith(template.format(n)) for k in names):
        n += 1
    return n


def _layout(names: Any) -> tuple[int, list[int]]:
    """Depth and stem units per stage, read from the names of an official tree."""
    depth = _count_prefixed(names, "Transformer/encoderblock_{}/")
    stem_units = []
    while True:
        s = len(stem_units) + 1
        units = sum(1 for k in names if k.startswith(f"block{s}/unit") and k.endswith("/conv1/kernel"))
        if units == 0:
            return depth, stem_units
        stem_units.append(units)


# ------------------------------------------------------------------------ official -> vitlab


def from_official(arrays: Mapping[str, Any]) -> tuple[StateDict, int]:
    """Official arrays -> (vitlab state dict, number of heads).

    Arrays that the map does not know are kept under their own names, so that the
    loader reports them as unexpected instead of silently dropping them.
    """
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    for prefix in KNOWN_PREFIXES:
        if any(k.startswith(prefix) for k in arrays):
            arrays = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in arrays.items()}
    depth, stem_units = _layout(arrays)
    used: set[str] = set()
    out: StateDict = {}
    for official, ours, (to_torch, _) in key_map(depth, stem_units):
        if official in arrays:
            out[ours] = to_tensor(np.ascontiguousarray(to_torch(arrays[official])))
            used.add(official)
    heads = None
    for i in range(depth):
        att = f"Transformer/encoderblock_{i}/{ATTENTION}"
        kernels = [f"{att}/{n}/kernel" for n in QKV]
        biases = [f"{att}/{n}/bias" for n in QKV]
        if all(k in arrays for k in kernels):
            D, heads, hd = arrays[kernels[0]].shape  # (D, H, hd)
            # row h*hd + j of each (D, D) block is head h, channel j: the head-major order of vitlab's Attention
            qkv = [arrays[k].reshape(D, heads * hd).T for k in kernels]
            out[f"blocks.{i}.attn.qkv.weight"] = to_tensor(np.concatenate(qkv))
            used.update(kernels)
        if all(k in arrays for k in biases):
            out[f"blocks.{i}.attn.qkv.bias"] = to_tensor(np.concatenate([arrays[k].reshape(-1) for k in biases]))
            used.update(biases)
        out_kernel = f"{att}/out/kernel"
        if out_kernel in arrays:
            H, hd, D = arrays[out_kernel].shape
            out[f"blocks.{i}.attn.proj.weight"] = to_tensor(arrays[out_kernel].reshape(H * hd, D).T)
            used.add(out_kernel)
    out.update({k: to_tensor(v) for k, v in arrays.items() if k not in used})  # reported as unexpected
    if heads is None:
        raise WeightsError(f"no attention kernel '{ATTENTION}/query/kernel' found: not a vit_jax ViT checkpoint")
    return out, heads


def read_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All arrays of an .npz file, never unpickling anything, in numeric types (``core.numeric_array``:
    JAX's bfloat16 as float32)."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except FileNotFoundError:
        raise
    except Exception as e:  # zipfile.BadZipFile, ValueError (pickled object arrays), EOFError ...
        # numpy's own text for pickled data advises loading it unsafely, which is not ours to advise
        reason = str(e)
        if "Object arrays" in reason:
            reason = "an array in it holds Python objects, which are never unpickled"
        elif "pickle" in reason:
            reason = "not a zip archive of arrays (and pickled data is never loaded)"
        raise WeightsError(f"{path} is not a readable .npz file (truncated or corrupt?): {reason}") from e
    return {k: numeric_array(a, k) for k, a in arrays.items()}


def official_config(state_dict: StateDict, heads: int, **overrides: Any) -> ViTConfig:
    """The ViTConfig of converted official weights, with vit_jax's conventions."""
    return infer_config(state_dict, heads_from_weights=heads, resnet_fields=RESNET_CONVENTIONS,
                        **{**CONVENTIONS, **overrides})


# ----------------------------------------------------------------------------- AugReg names
# The AugReg release (Steiner et al. 2021, "How to train your ViT?") stores vit_jax .npz
# files whose names encode the model, the pre-training data and recipe, and, for
# fine-tuned files, the fine-tuning data and resolution, e.g.
#   S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0.npz                (upstream, 224 px)
#   R26_S_32-i21k-300ep-lr_0.001-aug_medium2-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_384.npz
# Model part: [R<depth>_ or R_ (root only)]<Ti|S|B|L|H>_<patch>.
AUGREG_NAME = re.compile(
    r"^(?:(?P<resnet>R\d*)_)?(?P<size>Ti|S|B|L|H)_(?P<patch>\d+)-(?P<pretrain>i1k|i21k)-(?P<epochs>\d+)ep"
    r"-lr_(?P<lr>[\d.e-]+)-aug_(?P<aug>[a-z]+\d*)-wd_(?P<wd>[\d.]+)-do_(?P<do>[\d.]+)-sd_(?P<sd>[\d.]+)"
    r"(?:--(?P<finetune>[a-z0-9_]+?)-steps_(?P<steps>\d+k?)-lr_(?P<ft_lr>[\d.e-]+)-res_(?P<res>\d+))?$"
)
RESNET_LAYERS = {"R": (), "R26": (2, 2, 2, 2), "R50": (3, 4, 6, 3)}


def parse_augreg_name(path: str | os.PathLike) -> dict[str, Any] | None:
    """The fields an AugReg file name encodes, or None if ``path`` is not named that way.

    ``img_size`` is ``res_N`` of fine-tuned files, else the 224 px of the pre-training.
    """
    stem = Path(path).name
    stem = stem[:-4] if stem.endswith(".npz") else stem
    m = AUGREG_NAME.match(stem)
    if m is None:
        return None
    out: dict[str, Any] = m.groupdict()
    out["img_size"] = int(out["res"]) if out["res"] else 224
    out["patch"] = int(out["patch"])
    return out


def _check_augreg(cfg: ViTConfig, fields: Mapping[str, Any], file: str) -> None:
    """Refuse weights whose shapes contradict the model their AugReg file name names."""
    width, depth, mlp_dim, heads = VIT_SIZES[fields["size"]]
    want: dict[str, Any] = {"width": width, "depth": depth, "mlp_dim": mlp_dim, "num_heads": heads}
    got: dict[str, Any] = {k: getattr(cfg, k) for k in want}
    if fields["resnet"] is None:
        want["patch_size"], got["patch_size"] = (fields["patch"],) * 2, cfg.patch_size
        want["hybrid"], got["hybrid"] = False, cfg.resnet is not None
    elif fields["resnet"] in RESNET_LAYERS:
        want["resnet layers"] = RESNET_LAYERS[fields["resnet"]]
        got["resnet layers"] = cfg.resnet.layers if cfg.resnet else None
    wrong = [f"{k}={got[k]} (weights) vs {v} (name)" for k, v in want.items() if got[k] != v]
    if wrong:
        raise WeightsError(f"{file}: the arrays contradict the model its AugReg name encodes: " + "; ".join(wrong))


def load_official_npz(path_or_dict: str | os.PathLike | Mapping[str, Any], img_size: Pair | int | None = None,
                      num_classes: int | None = None, keep_pre_logits: bool = False,
                      file_name: str | os.PathLike | None = None, source: str = "the official checkpoint",
                      **overrides: Any) -> nn.Module:
    """A vitlab model (eval mode) holding a vit_jax checkpoint.

    The architecture is read from the arrays (see ``core.infer_config``).  ``img_size``
    resizes the position embeddings as ``checkpoint.load_pretrained`` does (the [class]
    embedding kept, the grid zoomed with order 1).  A ``num_classes`` different from the
    checkpoint's gives a zero-initialised head and, unless ``keep_pre_logits``, drops the
    pre-logits layer, as the official fine-tuning default (representation_size=None) does.
    ``source`` names the weights in errors.  ``overrides`` are ViTConfig fields (e.g.
    dropout, dynamic_img_size), or ``weights_img_size`` (the checkpoint's own resolution, needed only for non-square grids).
    An AugReg file name (the path's, or ``file_name`` for arrays already read) supplies
    that resolution and is checked against the arrays.
    """
    if isinstance(path_or_dict, (str, os.PathLike)):
        arrays, file_name = read_npz(path_or_dict), path_or_dict
    else:
        arrays = path_or_dict
    augreg = parse_augreg_name(file_name) if file_name is not None else None
    if augreg is not None:
        overrides.setdefault("weights_img_size", augreg["img_size"])
    state_dict, heads = from_official(arrays)
    cfg = official_config(state_dict, heads, img_size_hint=img_size, **overrides)
    if augreg is not None:
        _check_augreg(cfg, augreg, str(file_name))
    if file_name is not None:
        source = f"{source} {file_name}"
    return build_loaded(state_dict, cfg, img_size=img_size, num_classes=num_classes,
                        keep_pre_logits=keep_pre_logits, source=source)


# ------------------------------------------------------------------------ vitlab -> official


def to_official(model: nn.Module) -> dict[str, np.ndarray]:
    """The official arrays of a vitlab ViT (the inverse of ``from_official``)."""
    cfg: ViTConfig = model.cfg
    if cfg.axial or cfg.posemb != "learned_1d" or cfg.posemb_place != "stem" or not cfg.qkv_bias:
        raise WeightsError(
            "only the paper's default ViT (learned 1D position embeddings at the stem, qkv bias, not axial) "
            f"has an official layout; this model has posemb={cfg.posemb!r}, posemb_place={cfg.posemb_place!r}, "
            f"qkv_bias={cfg.qkv_bias}, axial={cfg.axial}"
        )
    # the kernel's size is in its array; a root of another stride or without its pool read back as vit_jax's
    other = other_root(cfg.resnet, ("root_stride", "root_pool")) if cfg.resnet is not None else []
    if other:
        raise WeightsError(f"vit_jax's .npz cannot hold this model: the hybrid stem's {', '.join(other)} (the file "
                           "records no root stride or pool, and is read back with vit_jax's 7x7/2 root and max-pool)")
    sd = {k: v.detach().cpu().float().numpy() for k, v in model.state_dict().items()}
    stem_units = list(cfg.resnet.layers) if cfg.resnet else []
    out: dict[str, np.ndarray] = {}
    used: set[str] = set()
    for official, ours, (_, to_flax) in key_map(cfg.depth, stem_units):
        if ours in sd:
            out[official] = np.ascontiguousarray(to_flax(sd[ours]))
            used.add(ours)
    H, hd, D = cfg.num_heads, cfg.head_dim, cfg.width
    for i in range(cfg.depth):
        att = f"Transformer/encoderblock_{i}/{ATTENTION}"
        weights = np.split(sd[f"blocks.{i}.attn.qkv.weight"], 3)  # q, k, v: (D, D) each
        biases = np.split(sd[f"blocks.{i}.attn.qkv.bias"], 3)
        for n, w, b in zip(QKV, weights, biases):
            out[f"{att}/{n}/kernel"] = np.ascontiguousarray(w.T.reshape(D, H, hd))
            out[f"{att}/{n}/bias"] = b.reshape(H, hd)
        out[f"{att}/out/kernel"] = np.ascontiguousarray(sd[f"blocks.{i}.attn.proj.weight"].T.reshape(H, hd, D))
        used.update(f"blocks.{i}.attn.{p}" for p in ("qkv.weight", "qkv.bias", "proj.weight"))
    left = sorted(set(sd) - used)
    if left:
        raise WeightsError(f"no official name for: {', '.join(left)}")
    return out


def save_official_npz(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write ``model`` as a vit_jax .npz (float32); the file is replaced atomically."""
    arrays = to_official(model)
    cfg = model.cfg
    notes = convention_differences(cfg, {"gelu": "tanh", "ln_eps": 1e-6}, "vit_jax")
    if cfg.resnet is not None:
        notes += convention_differences(cfg.resnet, RESNET_CONVENTIONS, "vit_jax's ResNet stem")
    warn_conventions(notes, "vit_jax")
    # a file object, so that numpy does not append ".npz" to the temporary name
    return atomic_write(path, lambda f: np.savez(f, **arrays))
