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
zero-pad 1 + VALID 3x3/2 max-pool.  The architecture is the one the file names
(big_transfer's release names its files ``BiT-M-R50x1.npz``, ``BiT-S-R101x3.npz``, ...), else
the one the arrays imply: units per block, width factor (root channels / 64), with BiT's
7x7 root.  Input channels and classes are read from the arrays.  Every array is then
checked against that architecture, so that a mis-shaped root is refused like a
mis-shaped unit, in one error naming every missing, unexpected and mis-shaped key.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
from torch import nn

from ..config import ConfigError, Pair, ResNetConfig, replace
from ..files import atomic_write
from ..models.registry import RESNET_DEPTHS, bit_config
from .core import (StateDict, WeightsError, build_loaded, check_named, convention_differences, other_root, to_tensor,
                   warn_conventions, width_factor_of)
from .official import read_npz

# bit_pytorch's numerical conventions (``registry.bit_config``), with which a big_transfer .npz is read
CONVENTIONS: dict[str, Any] = {"padding": "symmetric", "ws_eps": 1e-10, "ws_eps_inside_sqrt": True, "gn_eps": 1e-5}
PREFIX = "resnet/"
ROOT = PREFIX + "root_block/standardized_conv2d/kernel"
# big_transfer's released files: BiT-M-R50x1.npz, BiT-S-R152x4.npz, BiT-M-R50x1-ILSVRC2012.npz
FILE_NAME = re.compile(r"BiT-[SML]-(?P<model>R(?P<depth>\d+)x\d+)(?:-[\w.]+)?\.npz")
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
    return ROOT in set(keys)


def named_model(file_name: str | os.PathLike) -> str | None:
    """The model a big_transfer file name names (``BiT-M-R50x1.npz`` -> ``R50x1``), or None."""
    match = FILE_NAME.fullmatch(Path(file_name).name)
    return match["model"] if match and int(match["depth"]) in RESNET_DEPTHS else None


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


def from_bit(arrays: Mapping[str, Any], named: str | None = None,
             **fields: Any) -> tuple[StateDict, ResNetConfig]:
    """big_transfer arrays -> (vitlab state dict, ResNetConfig with bit_pytorch's conventions).

    ``named``: the model the file names (``R50x1``); without it, the one the arrays imply.
    The config is never read off a single array's shape where BiT fixes it (the 7x7 root),
    so that ``check_state_dict`` holds every array against it.
    """
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    if not is_bit(arrays):
        raise WeightsError(f"not a big_transfer BiT checkpoint: no '{ROOT}'")
    out: StateDict = {}
    used = set()
    layers = _layers(arrays)
    for theirs, ours, (to_torch, _) in key_map(layers):
        if theirs in arrays:
            try:
                out[ours] = to_tensor(np.ascontiguousarray(to_torch(arrays[theirs])))
            except ValueError:  # not a 4-d kernel: kept as it is, and reported as mis-shaped
                out[ours] = to_tensor(arrays[theirs])
            used.add(theirs)
    out.update({k: to_tensor(v) for k, v in arrays.items() if k not in used})  # reported as unexpected
    root = arrays[ROOT]  # (7, 7, in, 64 * wf)
    if root.ndim != 4:
        raise WeightsError(f"{ROOT} has shape {root.shape}; big_transfer's root kernel is (7, 7, in, 64 * width)")
    head = arrays.get(PREFIX + "head/conv2d/kernel")
    if named is not None:
        base = bit_config(named)
    else:
        wf = width_factor_of(root.shape[-1])
        base = bit_config(f"R50x{wf}") if isinstance(wf, int) else bit_config("R50x1")
        base = replace(base, layers=layers, width_factor=wf, name=f"BiT-R{3 * sum(layers) + 2}x{wf}")
    try:
        cfg = replace(base, in_chans=root.shape[2], num_classes=head.shape[-1] if head is not None else 0, **fields)
    except ConfigError as e:
        raise WeightsError(f"the BiT architecture {base.name} (blocks {base.layers}, root {root.shape}) "
                           f"with the fields given is not valid: {e}") from e
    return out, cfg


def load_bit(source: str | os.PathLike | Mapping[str, Any], img_size: Pair | int | None = None,
             num_classes: int | None = None, file_name: str | os.PathLike | None = None,
             name: str | None = None, **overrides: Any) -> nn.Module:
    """A vitlab ``BiTResNet`` (eval mode) holding a big_transfer ``.npz`` (path or arrays).

    ``num_classes`` different from the checkpoint's gives a zero head (BiT's fine-tuning
    set-up); ``img_size`` only sets the config (a ResNet takes any size); ``overrides``
    are ResNetConfig fields; ``file_name`` names arrays already read in errors.  A file
    named as big_transfer names its files (``BiT-M-R50x1.npz``) must hold that model, and so
    must ``name`` (a registry name, ``BiT-R50x1``).
    """
    trained_at = overrides.pop("weights_img_size", None)
    if trained_at is not None:  # else refused as no ResNetConfig field, a list of the fields that are
        raise WeightsError(f"weights_img_size={trained_at}: a BiT ResNet has no position embeddings, and its weights "
                           "read the same whatever resolution they were trained at; leave it out")
    arrays = read_npz(source) if isinstance(source, (str, os.PathLike)) else source
    file_name = source if isinstance(source, (str, os.PathLike)) else file_name
    named = named_model(file_name) if file_name is not None else None
    state_dict, cfg = from_bit(arrays, named, **overrides)
    check_named(name, cfg)
    if num_classes is not None and cfg.num_classes == 0 and num_classes > 0:
        cfg = replace(cfg, num_classes=num_classes)  # a headless file given a head: fresh zeros
    where = f"the BiT checkpoint {file_name}" if file_name is not None else "the BiT checkpoint"
    return build_loaded(state_dict, cfg, img_size=img_size, num_classes=num_classes, source=where)


def to_bit(model: nn.Module) -> dict[str, np.ndarray]:
    """The big_transfer arrays of a vitlab ``BiTResNet`` (the inverse of ``from_bit``)."""
    cfg = model.cfg
    if not isinstance(cfg, ResNetConfig) or cfg.norm != "group":
        raise WeightsError("only a BiT ResNet with GroupNorm (a ResNetConfig model, norm='group') has a "
                           "big_transfer layout")
    other = other_root(cfg)
    if other:  # read back with BiT's root, the file was another model
        raise WeightsError(f"big_transfer's .npz cannot hold this model: {', '.join(other)} (the file records no "
                           "root, and is read back with BiT's 7x7/2 root and max-pool)")
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
    """Write a vitlab BiT ResNet as a big_transfer .npz (float32), atomically; conventions other than
    big_transfer's (``CONVENTIONS``), which the file is read back with, are warned about."""
    arrays = to_bit(model)
    warn_conventions(convention_differences(model.cfg, CONVENTIONS, "big_transfer"), "big_transfer")
    return atomic_write(path, lambda f: np.savez(f, **arrays))
