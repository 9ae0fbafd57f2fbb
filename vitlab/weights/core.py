"""What every weight format shares once its keys are renamed to vitlab's.

Each format module (official, huggingface, timm, native) only renames and reshapes
arrays into a vitlab state dict.  From there the path is the same for all of them:

    infer_config(state_dict, ...)    the architecture, read off the array shapes
    check_state_dict(...)            every missing, unexpected and mis-shaped key at once
    adapt_state_dict(...)            new resolution (position embeddings), new head
    load_checked(model, state_dict)  the one place weights enter a model
"""
from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from ..config import Architecture, ConfigError, Pair, ResNetConfig, ViTConfig, replace, to_pair
from ..files import sync_folder, write_temporary
from ..models.posemb import (DistanceBias, LearnedPosEmb1D, LearnedPosEmb2D, RelativePosBias, resample_grid,
                             resample_table_1d, resize_offset_table)
from ..models.registry import PATCH_SIZES, VIT_SIZES, build_model, get_config

StateDict = dict[str, torch.Tensor]


class WeightsError(ValueError):
    """Weights that do not fit the model they are loaded into, or cannot be read."""


class HeadsUnknownError(WeightsError):
    """Weights that record their number of attention heads nowhere (a Hugging Face, timm or vitlab
    state dict without its config): a registry name or ``num_heads`` must give it."""


def to_tensor(array: Any) -> torch.Tensor:
    """A numpy array or tensor as a CPU tensor (numpy arrays are copied, never shared)."""
    if isinstance(array, torch.Tensor):
        return array.detach().cpu()
    return torch.from_numpy(np.array(numeric_array(np.asarray(array)), copy=True))


def numeric_array(array: np.ndarray, name: str = "an array") -> np.ndarray:
    """``array`` in a numeric type torch takes.  JAX writes bfloat16 parameters into an .npz as 2-byte void
    items (ml_dtypes' bfloat16 has no numpy type code; big_vision's bf16 files): their bits are read as
    bfloat16, widened to float32 exactly.  Items of another size and no numeric type are refused naming
    ``name`` (torch.from_numpy failed on them with a TypeError)."""
    if array.dtype.kind != "V":
        return array
    if array.dtype.itemsize == 2:
        return (array.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    raise WeightsError(f"{name}: an array of {array.dtype.itemsize}-byte items of no numeric type ({array.dtype.str}); "
                       "vitlab reads float and integer arrays, and 2-byte ones as bfloat16 (as JAX writes them)")


def atomic_write_set(files: Sequence[tuple[str | os.PathLike, Callable[[BinaryIO], Any]]],
                     remove: Sequence[str | os.PathLike] = ()) -> list[Path]:
    """Write several files that belong together (weights and their config) as one set.

    Every file is first written in full beside its path (``vitlab.files.write_temporary``); only
    when all are written do the files ``remove`` names (an old set's file the new one has not) go,
    and the new ones replace the old, renamed in the order given.  A failure or an interruption
    while writing (a full disk, an error serialising, Ctrl-C) leaves every old file as it was: one
    file at a time, a failure after the first had new weights beside the old config.  So does one
    while the files are renamed: each old file but the last is kept aside (a hard link, else a copy)
    until the last is in place, and put back on a failure, and a file that had none is removed.
    Callers give the weights file last: it is the set's commit, and once it is new every other file
    is too.  What no rename can cover is the process killed outright (SIGKILL, a power cut) between
    two renames: the files renamed by then are new, the rest old, and the kept copies
    (``.NAME.*.old``) lie beside them (a vitlab folder's weights carry their own config, which
    ``native`` reads before config.json).
    """
    staged: list[tuple[Path, str]] = []
    kept: list[tuple[Path, Path | None]] = []  # each path changed so far, and its old file kept aside (None: none)
    try:
        for path, write in files:
            staged.append((Path(path), write_temporary(Path(path), write)))
        for gone in map(Path, remove):
            if gone.exists():
                aside = _aside(gone)
                os.replace(gone, aside)
                kept.append((gone, aside))
        for i, (path, tmp) in enumerate(staged):
            last = i == len(staged) - 1  # its rename is the commit: nothing after it can fail
            old = _kept_copy(path) if not last and path.exists() else None
            if not last:
                kept.append((path, old))
            os.replace(tmp, path)
    except BaseException:
        for path, old in reversed(kept):  # the old set back, as far as the file system lets it be
            try:
                if old is not None:
                    os.replace(old, path)
                else:
                    path.unlink(missing_ok=True)
            except OSError:
                pass
        for _, tmp in staged:
            Path(tmp).unlink(missing_ok=True)
        raise
    for _, old in kept:
        if old is not None:
            old.unlink(missing_ok=True)
    for folder in dict.fromkeys(path.parent for path, _ in staged):
        sync_folder(folder)
    return [path for path, _ in staged]


def _aside(path: Path) -> Path:
    """A name beside ``path`` that no file has: where its old file is kept while a set is replaced."""
    while True:
        aside = path.with_name(f".{path.name}.{secrets.token_hex(6)}.old")
        if not aside.exists():
            return aside


def _kept_copy(path: Path) -> Path:
    """``path``'s file kept aside under a new name: a hard link (the same file, nothing copied), or
    a copy where the file system has no hard links."""
    aside = _aside(path)
    try:
        os.link(path, aside)
    except OSError:
        shutil.copy2(path, aside)
    return aside


# ---------------------------------------------------------------------------- checking


def check_state_dict(expected: Mapping[str, torch.Size], state_dict: Mapping[str, torch.Tensor],
                     source: str = "the weights") -> None:
    """Raise one ``WeightsError`` naming every missing, unexpected and mis-shaped key.

    ``expected`` maps each key of the model's state dict to its shape.  Reporting all
    problems at once matters: a wrong guess about the architecture usually shows up in
    dozens of keys, and the pattern (all blocks, only the head, ...) tells what is wrong.
    """
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    misshaped = [
        (k, tuple(state_dict[k].shape), tuple(expected[k]))
        for k in sorted(set(expected) & set(state_dict))
        if tuple(state_dict[k].shape) != tuple(expected[k])
    ]
    if not (missing or unexpected or misshaped):
        return
    lines = [f"{source} do not match the model:"]
    if missing:
        lines.append(f"  {len(missing)} missing key(s): " + ", ".join(missing))
    if unexpected:
        lines.append(f"  {len(unexpected)} unexpected key(s): " + ", ".join(unexpected))
    for key, got, want in misshaped:
        lines.append(f"  shape mismatch for {key}: weights {got}, model {want}")
    raise WeightsError("\n".join(lines))


def load_checked(model: nn.Module, state_dict: Mapping[str, torch.Tensor], source: str = "the weights") -> nn.Module:
    """Check ``state_dict`` against ``model`` (see ``check_state_dict``), then load it.

    Arrays are cast to the dtype of the parameter they replace.
    """
    own = model.state_dict()
    check_state_dict({k: v.shape for k, v in own.items()}, state_dict, source)
    model.load_state_dict({k: state_dict[k].to(own[k].dtype) for k in own}, strict=True)
    return model


def meta_shapes(cfg: Architecture) -> dict[str, torch.Size]:
    """The state-dict shapes of the model ``cfg`` describes, without allocating it."""
    with torch.device("meta"):
        model = build_model(cfg)
    return {k: v.shape for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- inference


def _count(state_dict: Mapping[str, Any], prefix: str, suffix: str) -> int:
    """How many consecutive i have ``f"{prefix}{i}{suffix}"`` in the state dict."""
    n = 0
    while f"{prefix}{n}{suffix}" in state_dict:
        n += 1
    return n


def _require(state_dict: Mapping[str, torch.Tensor], key: str, what: str) -> torch.Tensor:
    if key not in state_dict:
        raise WeightsError(f"cannot tell the {what}: the weights have no {key!r} (after renaming to vitlab keys)")
    return state_dict[key]


def width_factor_of(root_channels: int) -> int | float:
    """The width factor whose root vit_jax builds with ``root_channels``: ``int(64 * wf)`` channels.

    An int when the root is a multiple of 64 (R50x1, x2, ...), else the float root/64 (32 -> 0.5).
    """
    return root_channels // 64 if root_channels % 64 == 0 else root_channels / 64


def infer_resnet(state_dict: Mapping[str, torch.Tensor], **fields: Any) -> ResNetConfig | None:
    """The hybrid stem's ResNetConfig from ``stem.*`` shapes, or None for a plain ViT.

    A root without stages (vit_jax's R+ViT-Ti_16) gives ``layers=()``.
    """
    if "stem.conv_root.weight" not in state_dict:
        return None
    root = state_dict["stem.conv_root.weight"]  # (int(64 * width_factor), in_chans, k, k)
    layers = []
    while True:
        units = _count(state_dict, f"stem.stages.{len(layers)}.units.", ".conv1.weight")
        if units == 0:
            break
        layers.append(units)
    fields = {"root_kernel": root.shape[-1], **fields}
    try:
        # num_classes keeps its default: a stem ignores it, and so the config equals the registry's
        return ResNetConfig(layers=tuple(layers), width_factor=width_factor_of(root.shape[0]), in_chans=root.shape[1],
                            **fields)
    except ConfigError as e:
        raise WeightsError(f"the hybrid stem read from the weights (stem.conv_root.weight {tuple(root.shape)}, "
                           f"stages {layers}) is not valid: {e}") from e


# what a loader asks for where the weights do not record the resolution they were trained at,
# with the flag of the commands that read weights
TRAINED_AT = ("pass weights_img_size=(height, width), the resolution the weights were trained at "
              "(--weights-img-size HxW)")


def patch_grid(positions: int, patch_size: Pair, reduction: int, weights_img_size: Pair | int | None,
               img_size_hint: Pair | int | None, what: str) -> Pair:
    """The (h, w) patch grid of a position table holding ``positions`` patch positions.

    ``weights_img_size`` (the checkpoint's own resolution, when known: an AugReg file name,
    a timm model's img_size) decides; else the requested ``img_size`` if its grid has exactly
    that many positions (non-square checkpoints loaded at their size); else a square grid.  A
    square count that the requested non-square grid holds too (16: 4x4, or 2x8 at 32x128) is
    refused: read as a square, the 2x8 table was resampled as a 4x4 one, its rows scrambled.
    """
    def grid_of(size: Pair | int, name: str) -> Pair:
        h, w = to_pair(size, name)
        return (-(-h // reduction) // patch_size[0], -(-w // reduction) // patch_size[1])

    if weights_img_size is not None:
        grid = grid_of(weights_img_size, "weights_img_size")
        if grid[0] * grid[1] != positions:
            raise WeightsError(f"{what} holds {positions} patch positions, but weights_img_size={weights_img_size} "
                               f"means a {grid[0]}x{grid[1]} grid of {patch_size} patches")
        return grid
    side = int(round(positions ** 0.5))
    asked = grid_of(img_size_hint, "img_size") if img_size_hint is not None else None
    if asked is not None and asked[0] * asked[1] == positions:
        if side * side == positions and asked != (side, side):
            raise WeightsError(
                f"{what} holds {positions} patch positions: a {side}x{side} grid, or the {asked[0]}x{asked[1]} grid "
                f"of img_size={img_size_hint}, which the weights record nowhere; {TRAINED_AT}")
        return asked
    if side * side == positions:
        return (side, side)
    raise WeightsError(f"{what} holds {positions} patch positions, not a square grid; {TRAINED_AT}, or img_size= "
                       "that size")


def infer_config(state_dict: Mapping[str, torch.Tensor], *, name: str | None = None,
                 heads_from_weights: int | None = None, resnet_fields: Mapping[str, Any] | None = None,
                 weights_img_size: Pair | int | None = None, img_size_hint: Pair | int | None = None,
                 **fields: Any) -> ViTConfig:
    """The ViTConfig whose model has exactly the shapes of ``state_dict`` (vitlab keys).

    Read off the arrays: width, depth, mlp_dim, patch size, input channels, [class] token
    (-> classifier "token", else "gap"), representation_size, num_classes, qkv bias, the
    hybrid ResNet, and img_size = side of the (square) position grid x patch x reduction.
    The number of heads is not in the shapes of fused or per-head-flattened kernels: it
    comes from ``heads_from_weights`` (Flax's (D, H, hd) kernels show it),
    ``fields["num_heads"]`` (asked for) or the registry ``name``.  ``fields`` (conventions such as
    gelu and ln_eps, or user overrides) are applied last.
    """
    patch = _require(state_dict, "patch_embed.weight", "width and patch size")  # (D, C, ph, pw)
    width = patch.shape[0]
    depth = _count(state_dict, "blocks.", ".norm1.weight")
    if depth == 0:
        raise WeightsError("cannot tell the depth: the weights have no 'blocks.0.norm1.weight'")
    mlp_dim = _require(state_dict, "blocks.0.mlp.fc1.weight", "mlp_dim").shape[0]
    resnet = infer_resnet(state_dict, **(resnet_fields or {}))
    classifier = "token" if "cls_token" in state_dict else "gap"
    prefix = 1 if classifier == "token" else 0
    patch_size = (patch.shape[2], patch.shape[3])
    reduction = resnet.reduction if resnet else 1

    if "pos_embed.weight" in state_dict:
        posemb, positions = "learned_1d", state_dict["pos_embed.weight"].shape[1] - prefix
        grid = patch_grid(positions, patch_size, reduction, weights_img_size, img_size_hint,
                          f"pos_embed (after {prefix} [class] position)")
    elif "pos_embed.x" in state_dict:
        posemb, grid = "learned_2d", (state_dict["pos_embed.y"].shape[0], state_dict["pos_embed.x"].shape[0])
        # the tables give the grid: a size of another one was accepted unread
        if weights_img_size is not None and patch_grid(grid[0] * grid[1], patch_size, reduction, weights_img_size,
                                                       None, "pos_embed.y and .x") != grid:
            raise WeightsError(f"weights_img_size={weights_img_size}: the 2D position tables (pos_embed.y and "
                               f".x) are of a {grid[0]}x{grid[1]} grid of {patch_size} patches")
    else:
        raise WeightsError("cannot tell the image size: the weights have no position embedding 'pos_embed.weight'")
    img_size = (grid[0] * patch_size[0] * reduction, grid[1] * patch_size[1] * reduction)
    if weights_img_size is not None:  # checked against the tables by patch_grid
        img_size = to_pair(weights_img_size, "weights_img_size")

    asked = fields.pop("num_heads", None)
    if heads_from_weights is not None and asked is not None and asked != heads_from_weights:
        raise WeightsError(
            f"num_heads={asked} contradicts the weights, whose attention kernels have {heads_from_weights} heads"
        )
    heads = heads_from_weights or asked
    if name is not None:
        named = get_config(name)
        heads = heads or getattr(named, "num_heads", None)
        _check_against_registry(named, ViTConfig, width=width, depth=depth, mlp_dim=mlp_dim, patch_size=patch_size,
                                num_heads=heads, resnet=_stem(resnet))
        fields.setdefault("name", named.name)
    if heads is None:
        raise HeadsUnknownError(
            "the number of attention heads cannot be read from these weights: pass name= (a registry name "
            "such as 'ViT-B/16') or num_heads= (--name, --num-heads)"
        )
    if resnet is not None:
        resnet = dataclasses.replace(resnet, img_size=img_size)
    pre_logits = state_dict.get("pre_logits.fc.weight")
    head = state_dict.get("head.weight")
    try:
        cfg = ViTConfig(
            img_size=img_size, patch_size=patch_size, in_chans=resnet.in_chans if resnet else patch.shape[1],
            width=width, depth=depth, mlp_dim=mlp_dim, num_heads=heads,
            num_classes=head.shape[0] if head is not None else 0, classifier=classifier,
            representation_size=pre_logits.shape[0] if pre_logits is not None else None,
            posemb=posemb, qkv_bias="blocks.0.attn.qkv.bias" in state_dict, resnet=resnet,
        )
        cfg = replace(cfg, **fields) if fields else cfg
    except ConfigError as e:
        raise WeightsError(f"the architecture read from the weights, with the fields given, is not valid: {e}") from e
    return cfg if cfg.name else dataclasses.replace(cfg, name=guess_name(cfg))


FAMILIES = {ViTConfig: "Vision Transformer", ResNetConfig: "BiT ResNet"}


def _stem(resnet: ResNetConfig | None) -> str | None:
    """What a registry name says of a hybrid's stem (R50x1+...): its units per stage and width factor."""
    return None if resnet is None else f"{resnet.layers}x{resnet.width_factor}"


def _shape(cfg: Architecture) -> dict[str, Any]:
    """The fields a registry name fixes: a ViT's sizes, patch, heads and stem; a BiT's units and width."""
    if isinstance(cfg, ResNetConfig):
        return {"layers": cfg.layers, "width_factor": cfg.width_factor}
    return {"width": cfg.width, "depth": cfg.depth, "mlp_dim": cfg.mlp_dim, "patch_size": cfg.patch_size,
            "num_heads": cfg.num_heads, "resnet": _stem(cfg.resnet)}


def _check_against_registry(named: Architecture, family: type, **found: Any) -> None:
    """Refuse weights whose shapes contradict the registry config they are said to be: a model of
    another family (its fields were read as missing attributes), or other sizes, heads or stem
    (the stem was not compared: R50x1+ViT-B/32 weights were taken as an R50x1+ViT-B/16)."""
    if not isinstance(named, family):
        raise WeightsError(f"the weights are not a {named.name}: they hold a {FAMILIES[family]}, and "
                           f"{named.name} is a {FAMILIES[type(named)]}")
    expected = _shape(named)
    wrong = [f"{k}={v} (weights) vs {expected[k]} ({named.name})" for k, v in found.items() if v != expected[k]]
    if wrong:
        raise WeightsError(f"the weights are not a {named.name}: " + "; ".join(wrong))


def check_named(name: str | None, cfg: Architecture) -> None:
    """That the registry ``name`` a load was given is the model ``cfg`` (read from the weights) is,
    where the format records the architecture itself (vitlab's, BiT's): it was dropped unread."""
    if name is not None:
        _check_against_registry(get_config(name), type(cfg), **_shape(cfg))


def guess_name(cfg: ViTConfig) -> str | None:
    """The registry name of a plain ViT or R50 hybrid with these sizes, if there is one."""
    for size, dims in VIT_SIZES.items():
        if dims != (cfg.width, cfg.depth, cfg.mlp_dim, cfg.num_heads) or cfg.axial:
            continue
        square = cfg.patch_size[0] == cfg.patch_size[1]
        if cfg.resnet is None and square and cfg.patch_size[0] in PATCH_SIZES:
            return f"ViT-{size}/{cfg.patch_size[0]}"
        hybrid = {(3, 4, 9): 16, (3, 4, 6, 3): 32}
        if cfg.resnet is not None and cfg.resnet.width_factor == 1 and cfg.patch_size == (1, 1) \
                and cfg.resnet.layers in hybrid and size in ("B", "L"):
            return f"R50x1+ViT-{size}/{hybrid[cfg.resnet.layers]}"
    return None


# ---------------------------------------------------------------------------- adapting


def _resized_posembs(cfg: ViTConfig, new_cfg: ViTConfig, state_dict: StateDict) -> StateDict:
    """Every position-embedding table of ``state_dict`` resampled to ``new_cfg``'s grid.

    Walks the model's modules (built on the meta device, so free) to find the tables
    and their kind; the values go through the pure functions of ``models.posemb``.
    """
    with torch.device("meta"):
        model = build_model(cfg)
    grid, seq_len = new_cfg.grid_size, new_cfg.num_prefix_tokens + new_cfg.num_patches
    # in float32 at least: a bf16 or fp16 file's tables were resampled in their own dtype and rounded to it,
    # though the model that receives them is float32 (and computes them so with dynamic_img_size)
    table = lambda k: state_dict[k].to(torch.promote_types(state_dict[k].dtype, torch.float32))  # noqa: E731
    out: StateDict = {}
    for name, m in model.named_modules():
        key = f"{name}." if name else ""
        if isinstance(m, LearnedPosEmb1D):
            out[key + "weight"] = resample_table_1d(table(key + "weight"), m.num_prefix, m.grid, grid, m.resample)
        elif isinstance(m, LearnedPosEmb2D):
            # one table per axis, each a (n, 1) grid resampled along its length
            for axis, length in (("y", grid[0]), ("x", grid[1])):
                out[key + axis] = resample_grid(table(key + axis).unsqueeze(1), (length, 1), m.resample).squeeze(1)
        elif isinstance(m, RelativePosBias):
            rel = RelativePosBias(m.seq_len, *m.weight.shape[1:])
            rel.weight.data = table(key + "weight")
            out[key + "weight"] = rel.table(seq_len).detach()
        elif isinstance(m, DistanceBias) and m.offset_bias is not None:
            out[key + "offset_bias"] = resize_offset_table(table(key + "offset_bias"), m.grid, grid)
    return out


@torch.no_grad()
def adapt_state_dict(state_dict: StateDict, cfg: Architecture, *, img_size: Pair | int | None = None,
                     num_classes: int | None = None, keep_pre_logits: bool = False) -> tuple[StateDict, Architecture]:
    """Weights of a ``cfg`` model adapted to a new resolution and/or a new classifier.

    img_size: position embeddings are resampled to the new patch grid ([class] kept),
        with ``cfg.posemb_resample`` (the convention of the weights' source).
    num_classes: when it differs from ``cfg.num_classes`` the head is dropped (the model
        gets a zero-initialised one, paper Sec. 3.2), and so is the pre-logits layer unless
        ``keep_pre_logits``: vit_jax's ``checkpoint.load_pretrained`` drops ``pre_logits``
        when fine-tuning with ``representation_size=None`` (its default) and keeps it only
        when the fine-tuning config repeats the pre-training representation size.
    Returns the new state dict (without head keys if the head is new) and config.
    """
    is_vit = isinstance(cfg, ViTConfig)
    new_cfg = cfg
    if img_size is not None and to_pair(img_size, "img_size") != cfg.img_size:
        size = to_pair(img_size, "img_size")
        fields: dict[str, Any] = {"img_size": size}
        if is_vit and cfg.resnet is not None:
            fields["resnet"] = dataclasses.replace(cfg.resnet, img_size=size)
        try:
            new_cfg = replace(cfg, **fields)
        except ConfigError as e:
            raise WeightsError(f"cannot resize the weights to img_size={img_size}: {e}") from e
    out = dict(state_dict)
    if is_vit and new_cfg.grid_size != cfg.grid_size:
        out.update(_resized_posembs(cfg, new_cfg, state_dict))
    if num_classes is not None and num_classes != cfg.num_classes:
        fields = {"num_classes": num_classes}
        drop: tuple[str, ...] = ("head.",)
        if is_vit and not keep_pre_logits:
            fields["representation_size"] = None
            drop += ("pre_logits.",)
        new_cfg = replace(new_cfg, **fields)
        out = {k: v for k, v in out.items() if not k.startswith(drop)}
    return out, new_cfg


def build_loaded(state_dict: StateDict, cfg: Architecture, *, img_size: Pair | int | None = None,
                 num_classes: int | None = None, keep_pre_logits: bool = False,
                 source: str = "the weights") -> nn.Module:
    """Check ``state_dict`` against ``cfg``, adapt it, and return the loaded model in eval mode."""
    check_state_dict(meta_shapes(cfg), state_dict, source)
    state_dict, cfg = adapt_state_dict(state_dict, cfg, img_size=img_size, num_classes=num_classes,
                                       keep_pre_logits=keep_pre_logits)
    # the weights replace every initial value drawn here (a new head is zeros): drawn from the caller's
    # random stream, they would change what the caller draws next, by the size of the model loaded
    with torch.random.fork_rng(devices=[]):
        model = build_model(cfg)
    fresh = {k: v for k, v in model.state_dict().items() if k.startswith("head.") and k not in state_dict}
    return load_checked(model, {**state_dict, **fresh}, source).eval()


def with_new_head(model: nn.Module, num_classes: int, keep_pre_logits: bool = False) -> nn.Module:
    """``model``'s weights with a new zero-initialised head of ``num_classes`` (and no pre-logits layer unless
    ``keep_pre_logits``), as ``load_model(..., num_classes=)`` gives them: a new model, in eval mode."""
    return build_loaded(dict(model.state_dict()), model.cfg, num_classes=num_classes, keep_pre_logits=keep_pre_logits)


@dataclasses.dataclass(frozen=True)
class InputScaling:
    """How a source's models read uint8 pixels p: (p * rescale - mean) / std, per channel (a
    Hugging Face image processor's do_rescale and do_normalize, timm's pretrained_cfg mean and
    std).  ``where`` names the file that says so, for errors."""

    mean: Any
    std: Any
    rescale: Any = 1 / 255
    where: str = "the weights' config"
    names: tuple[str, str, str] = ("mean", "std", "rescale")  # the fields as the file spells them


# The input every vitlab model reads, which the exports state for the tools that run them: an RGB image
# resized whole to the model's size (vitlab.data.decode.decode_image, as predict and eval read images:
# Pillow's bilinear filter, which low-pass filters when it shrinks; the aspect ratio not kept, no crop),
# its pixels p as (p * INPUT_RESCALE - INPUT_MEAN) / INPUT_STD = p / 127.5 - 1 (vitlab.data.transforms.to_float).
# A source's other scaling is taken into the weights as they load (take_input_scaling), so this holds for all.
INPUT_RESCALE = 1 / 255
INPUT_MEAN = 0.5
INPUT_STD = 0.5
INPUT_INTERPOLATION = "bilinear"
INPUT_RESIZE = ("the whole image to image_size (height, width), its aspect ratio not kept, no crop; Pillow's "
                "bilinear filter, which low-pass filters when it shrinks")
# how vitlab.data.decode.to_rgb makes an image's pixels (docs/reliability.md), where readers differ: Hugging
# Face's load_image applies EXIF orientation, its image processors composite alpha onto white
INPUT_DECODE = ("Pillow's, the first frame, the pixels as stored: EXIF orientation not applied; Image.convert('RGB'), "
                "alpha dropped (not composited); 16-bit grayscale to 8 bits as v / 257, rounded")


def input_preprocessing(cfg: Architecture, img_size: Pair | None = None) -> dict[str, Any]:
    """What a model of ``cfg`` reads at ``img_size`` (default: its own), as exports record it: images
    (N, C, H, W), RGB, pixels p in 0..255 as ``(p * rescale_factor - mean) / std``, per channel, after
    the resize ``resize`` names (``interpolation``), of the image decoded as ``decode`` says."""
    h, w = img_size or cfg.img_size
    record: dict[str, Any] = {"image_size": [h, w], "input_layout": "NCHW"}
    if cfg.in_chans == 3:  # vitlab decodes every image as RGB
        record.update(channel_order="RGB", decode=INPUT_DECODE)
    return {**record, "rescale_factor": INPUT_RESCALE, "mean": [INPUT_MEAN] * cfg.in_chans,
            "std": [INPUT_STD] * cfg.in_chans, "interpolation": INPUT_INTERPOLATION, "resize": INPUT_RESIZE}


def _numbers(value: Any, count: int, field: str, where: str, positive: bool = False) -> list[float]:
    """``value`` as ``count`` numbers: one for all, or ``count`` of them (one per channel)."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    fits = len(values) in (1, count) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) and (v > 0 or not positive)
        for v in values)
    if not fits:
        kind = "positive numbers" if positive else "numbers"
        raise WeightsError(f"{where}: {field}={value!r}: expected {kind}, one for all or one per channel of the "
                           f"model's {count}" if count > 1 else f"{where}: {field}={value!r}: expected a {kind[:-1]}")
    return [float(v) for v in values] * (count if len(values) == 1 else 1)


def take_input_scaling(model: nn.Module, scaling: InputScaling | None) -> nn.Module:
    """``model`` reading vitlab's input, p / 127.5 - 1 (``vitlab.data.transforms.to_float``, the
    official scaling: mean and std 0.5), as its source read ``scaling``'s: the two differ by
    x -> a * x + b per channel, which the patch embedding takes into its kernel and bias,
    exactly (each patch meets the kernel once, no padding).  Without it a model trained on
    other inputs (ImageNet's mean and std: DeiT, DINO) was scored on vitlab's, without a word.
    """
    if scaling is None:
        return model
    cfg, where = model.cfg, scaling.where
    channels = cfg.in_chans
    mean = _numbers(scaling.mean, channels, scaling.names[0], where)
    std = _numbers(scaling.std, channels, scaling.names[1], where, positive=True)
    rescale = _numbers(scaling.rescale, 1, scaling.names[2], where, positive=True)[0]
    # the source's input from vitlab's x, whose pixels are p = 127.5 * (x + 1)
    a = torch.tensor([127.5 * rescale / s for s in std], dtype=torch.float64)
    b = torch.tensor([(127.5 * rescale - m) / s for m, s in zip(mean, std)], dtype=torch.float64)
    if (a - 1).abs().max() < 1e-6 and b.abs().max() < 1e-6:
        return model  # vitlab's own scaling: the weights as they are
    if getattr(cfg, "resnet", None) is not None:
        raise WeightsError(f"{where}: the model reads pixels scaled with mean {mean} and std {std} (of p * {rescale:g})"
                           "; vitlab's read p / 127.5 - 1, and a hybrid's ResNet stem (weight-standardised, padded) "
                           "cannot take the difference into its weights")
    embed = model.patch_embed
    with torch.no_grad():
        kernel = embed.weight.double()
        embed.bias.add_((kernel * b.view(1, -1, 1, 1)).sum((1, 2, 3)).to(embed.bias.dtype))
        embed.weight.copy_(kernel * a.view(1, -1, 1, 1))
    return model


# ------------------------------------------------------------------------------ exporting


class ConventionWarning(UserWarning):
    """An export whose target library computes with other numerical conventions than the model."""


def convention_differences(cfg: ViTConfig, target: Mapping[str, Any], library: str) -> list[str]:
    """One line per convention of ``cfg`` (gelu, ln_eps, ...) that ``library`` fixes differently."""
    out = []
    for field, theirs in target.items():
        ours = getattr(cfg, field)
        if ours != theirs:
            out.append(f"{field}: the model uses {ours!r}, {library} computes with {theirs!r}")
    return out


def warn_conventions(lines: list[str], library: str) -> None:
    """Say, once per export, how the written model will compute differently in ``library``."""
    if lines:
        warnings.warn(f"{library} will not reproduce this model's logits exactly: " + "; ".join(lines),
                      ConventionWarning, stacklevel=3)


# The root of every vit_jax and big_transfer ResNet, which their .npz files record nothing of (a hybrid's
# kernel size aside, which its array shows): a file is read back with it, whatever root wrote it
NPZ_ROOT: dict[str, Any] = {"root_kernel": 7, "root_stride": 2, "root_pool": True}


def other_root(resnet: ResNetConfig, fields: Sequence[str] = tuple(NPZ_ROOT)) -> list[str]:
    """``field=value`` for each of ``fields`` where ``resnet``'s root is not the one an .npz is read back with."""
    return [f"{k}={getattr(resnet, k)}" for k in fields if getattr(resnet, k) != NPZ_ROOT[k]]


def require_plain_vit(cfg: Architecture, library: str, *, hybrid: bool = True) -> ViTConfig:
    """Refuse what ``library``'s ViT cannot hold, naming every reason at once."""
    if not isinstance(cfg, ViTConfig):
        raise WeightsError(f"{library} has no layout for a {type(cfg).__name__} model (a ViT is needed)")
    reasons = []
    if cfg.axial:
        reasons.append("axial=True (Axial-ViT blocks)")
    if cfg.posemb != "learned_1d":
        reasons.append(f"posemb={cfg.posemb!r} (only learned 1D position embeddings)")
    if cfg.posemb_place != "stem":
        reasons.append(f"posemb_place={cfg.posemb_place!r} (only 'stem')")
    if cfg.attn_bias != "none":  # timm kept its parameters under vitlab's names: a file no reader could load
        reasons.append(f"attn_bias={cfg.attn_bias!r} (a learned distance prior in attention, which it has not)")
    if not hybrid and cfg.resnet is not None:
        reasons.append("a ResNet stem (hybrid)")
    if reasons:
        raise WeightsError(f"{library} cannot hold this model: " + "; ".join(reasons))
    return cfg
