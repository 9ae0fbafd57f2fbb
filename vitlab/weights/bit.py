"""BiT ResNet checkpoints (google-research/big_transfer ``BiT-{S,M}-R50x1.npz`` ... ``R152x4``).

The names are those ``bit_pytorch/models.py`` reads in ``ResNetV2.load_from`` and
``PreActBottleneck.load_from`` (prefix ``resnet/``; S counts blocks from 1, UU units from
01); vitlab's ``BiTResNet`` uses bit_pytorch's module names, so the map is mechanical::

    big_transfer .npz                                       vitlab BiTResNet             rearrangement
    resnet/root_block/standardized_conv2d/kernel            root.conv.weight             HWIO -> OIHW
    resnet/blockS/unitUU/a/standardized_conv2d/kernel       body.blockS.unitUU.conv1.weight   HWIO -> OIHW
    resnet/blockS/unitUU/b/standardized_conv2d/kernel       body.blockS.unitUU.conv2.weight   HWIO -> OIHW
    resnet/blockS/unitUU/c/standardized_conv2d/kernel       body.blockS.unitUU.conv3.weight   HWIO -> OIHW
    resnet/blockS/unitUU/{a,b,c}/group_norm/{gamma,beta}    body.blockS.unitUU.gn{1,2,3}.{weight,bias}  flattened
    resnet/blockS/unitUU/a/proj/standardized_conv2d/kernel  body.blockS.unitUU.downsample.weight  HWIO -> OIHW
    resnet/group_norm/{gamma,beta}                          before_head.gn.{weight,bias} flattened
    resnet/head/conv2d/{kernel,bias}                        head.conv.{weight,bias}      HWIO -> OIHW

Conventions (``registry.bit_config``, bit_pytorch's): symmetric padding, weight
standardisation ``(w - mean) / sqrt(var + 1e-10)``, GroupNorm(32) eps 1e-5, root pool
zero-pad 1 + VALID 3x3/2 max-pool.  The architecture is read from the arrays: units per
block, width factor (root channels / 64), input channels, classes.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
from torch import nn

from ..config import ConfigError, Pair, ResNetConfig, replace
from ..models.registry import bit_config
from .core import StateDict, WeightsError, atomic_write, build_loaded, to_tensor, width_factor_of
from .official import read_npz

PREFIX = "resnet/"
CONV: tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]] = (
    lambda a: a.transpose(3, 2, 0, 1), lambda a: a.transpose(2, 3, 1, 0))
NORM: tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]] = (
    lambda a: a.reshape(-1), lambda a: a.reshape(-1))
BIAS = NORM

TOP_MAP = [
    ("root_block/standardized_conv2d/kernel", "root.conv.weight", CONV),
    ("group_norm/gamma", "before_head.gn.weight", NORM),
    ("group_norm/beta", "before_head.gn.bias", NORM),
    ("head/conv2d/kernel", "head.conv.weight", CONV),
    ("head/conv2d/bias", "head.conv.bias", BIAS),
]
UNIT_MAP = [
    (f"{sub}/standardized_conv2d/kernel", f"conv{n}.weight", CONV) for n, sub in enumerate("abc", 1)
] + [
    (f"{sub}/group_norm/{tf}", f"gn{n}.{ours}", NORM)
    for n, sub in enumerate("abc", 1) for tf, ours in (("gamma", "weight"), ("beta", "bias"))
] + [("a/proj/standardized_conv2d/kernel", "downsample.weight", CONV)]


def is_bit(keys: Any) -> bool:
    return PREFIX + "root_block/standardized_conv2d/kernel" in set(keys)


def key_map(layers: tuple[int, ...]) -> list[tuple[str, str, Any]]:
    """(big_transfer name, vitlab name, kind) of a BiT with ``layers[s]`` units in block s+1."""
    table = [(PREFIX + b, v, k) for b, v, k in TOP_MAP]
    for s, units in enumerate(layers, 1):
        for u in range(1, units + 1):
            pre = f"block{s}/unit{u:02d}/"
            table += [(PREFIX + pre + b, f"body.block{s}.unit{u:02d}.{v}", k) for b, v, k in UNIT_MAP]
    return table


def _layers(names: Any) -> tuple[int, ...]:
    layers = []
    while True:
        s = len(layers) + 1
        units = sum(1 for k in names if re.fullmatch(rf"{PREFIX}block{s}/unit\d+/a/standardized_conv2d/kernel", k))
        if units == 0:
            return tuple(layers)
        layers.append(units)


def from_bit(arrays: Mapping[str, Any], **fields: Any) -> tuple[StateDict, ResNetConfig]:
    """big_transfer arrays -> (vitlab state dict, ResNetConfig with bit_pytorch's conventions)."""
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    if not is_bit(arrays):
        raise WeightsError(f"not a big_transfer BiT checkpoint: no '{PREFIX}root_block/standardized_conv2d/kernel'")
    layers = _layers(arrays)
    out: StateDict = {}
    used = set()
    for theirs, ours, (to_torch, _) in key_map(layers):
        if theirs in arrays:
            out[ours] = to_tensor(np.ascontiguousarray(to_torch(arrays[theirs])))
            used.add(theirs)
    out.update({k: to_tensor(v) for k, v in arrays.items() if k not in used})  # reported as unexpected
    root = arrays[PREFIX + "root_block/standardized_conv2d/kernel"]  # (7, 7, in, 64 * wf)
    head = arrays.get(PREFIX + "head/conv2d/kernel")
    units = 3 * sum(layers) + 2
    wf = width_factor_of(root.shape[-1])
    base = bit_config(f"R50x{wf}") if isinstance(wf, int) else bit_config("R50x1")
    try:
        cfg = replace(base, layers=layers, width_factor=wf, in_chans=root.shape[2], root_kernel=root.shape[0],
                      num_classes=head.shape[-1] if head is not None else 0, name=f"BiT-R{units}x{wf}", **fields)
    except ConfigError as e:
        raise WeightsError(f"the BiT architecture read from the arrays (blocks {layers}, root {root.shape}) "
                           f"with the fields given is not valid: {e}") from e
    return out, cfg


def load_bit(source: str | os.PathLike | Mapping[str, Any], img_size: Pair | int | None = None,
             num_classes: int | None = None, file_name: str | os.PathLike | None = None,
             **overrides: Any) -> nn.Module:
    """A vitlab ``BiTResNet`` (eval mode) holding a big_transfer ``.npz`` (path or arrays).

    ``num_classes`` different from the checkpoint's gives a zero head (BiT's fine-tuning
    set-up); ``img_size`` only sets the config (a ResNet takes any size); ``overrides``
    are ResNetConfig fields; ``file_name`` names arrays already read in errors.
    """
    arrays = read_npz(source) if isinstance(source, (str, os.PathLike)) else source
    state_dict, cfg = from_bit(arrays, **overrides)
    if num_classes is not None and cfg.num_classes == 0 and num_classes > 0:
        cfg = replace(cfg, num_classes=num_classes)  # a headless file given a head: fresh zeros
    file_name = source if isinstance(source, (str, os.PathLike)) else file_name
    where = f"the BiT checkpoint {file_name}" if file_name is not None else "the BiT checkpoint"
    return build_loaded(state_dict, cfg, img_size=img_size, num_classes=num_classes, source=where)


def to_bit(model: nn.Module) -> dict[str, np.ndarray]:
    """The big_transfer arrays of a vitlab ``BiTResNet`` (the inverse of ``from_bit``)."""
    cfg = model.cfg
    if not isinstance(cfg, ResNetConfig) or cfg.norm != "group":
        raise WeightsError("only a BiT ResNet with GroupNorm (a ResNetConfig model, norm='group') has a "
                           "big_transfer layout")
    sd = {k: v.detach().cpu().float().numpy() for k, v in model.state_dict().items()}
    out, used = {}, set()
    for theirs, ours, (_, to_tf) in key_map(cfg.layers):
        if ours in sd:
            out[theirs] = np.ascontiguousarray(to_tf(sd[ours]))
            used.add(ours)
    left = sorted(set(sd) - used)
    if left:
        raise WeightsError(f"no big_transfer name for: {', '.join(left)}")
    return out


def save_bit_npz(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write a vitlab BiT ResNet as a big_transfer .npz (float32), atomically."""
    arrays = to_bit(model)
    return atomic_write(path, lambda f: np.savez(f, **arrays))
