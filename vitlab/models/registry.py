"""Every model of the paper as a named config, and ``create_model``.

Names follow the paper: ``ViT-B/16`` (size B, patch 16), ``R50x1+ViT-B/16`` (hybrid;
the number after the slash is the ResNet's total downsampling), ``Axial-ViT-B/16``,
``BiT-R152x4``.  The official code's spellings (``ViT-B_16``, ``R50+ViT-B_16``) are
accepted as aliases.
"""
from __future__ import annotations

import difflib
import re
from typing import Any, Callable

import torch
from torch import nn

from ..config import Architecture, ConfigError, ResNetConfig, ViTConfig, need_architecture, replace
from .axial import AxialVisionTransformer
from .resnet import BiTResNet
from .vit import VisionTransformer

# Paper Table 1, plus Ti and S from the official code (width, depth, mlp_dim, num_heads).
VIT_SIZES: dict[str, tuple[int, int, int, int]] = {
    "Ti": (192, 12, 768, 3),
    "S": (384, 12, 1536, 6),
    "B": (768, 12, 3072, 12),
    "L": (1024, 24, 4096, 16),
    "H": (1280, 32, 5120, 16),
}
PATCH_SIZES = (8, 14, 16, 32)
RESNET_DEPTHS: dict[int, tuple[int, ...]] = {
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
    200: (3, 24, 36, 3),
}
BIT_MODELS = ("R50x1", "R50x2", "R101x1", "R152x1", "R152x2", "R152x4", "R200x3")

_REGISTRY: dict[str, Callable[[], Architecture]] = {}


def register(name: str, make: Callable[[], Architecture]) -> None:
    if name in _REGISTRY:
        raise ValueError(f"model {name!r} is registered twice")
    _REGISTRY[name] = make


def vit_config(size: str, patch: int, **fields: Any) -> ViTConfig:
    width, depth, mlp_dim, heads = VIT_SIZES[size]
    return ViTConfig(width=width, depth=depth, mlp_dim=mlp_dim, num_heads=heads, patch_size=patch, **fields)


def hybrid_config(size: str, reduction: int, **fields: Any) -> ViTConfig:
    """R50x1 stem + ViT on 1x1 patches (paper Sec. 4.1).

    /32: the stage-4 output (option i); /16: stage 4 removed and its 3 blocks moved into
    stage 3, giving (3, 4, 9) (option ii, the official R50+ViT-B_16).
    """
    layers = {32: (3, 4, 6, 3), 16: (3, 4, 9)}[reduction]
    return vit_config(size, 1, resnet=ResNetConfig(layers=layers, width_factor=1), **fields)


def bit_config(name: str) -> ResNetConfig:
    depth, width = re.fullmatch(r"R(\d+)x(\d+)", name).groups()
    # BiT's own conventions (big_transfer): symmetric padding, eps inside the square
    # root of weight standardisation, PyTorch's GroupNorm eps.
    return ResNetConfig(
        layers=RESNET_DEPTHS[int(depth)], width_factor=int(width), name=f"BiT-{name}",
        padding="symmetric", ws_eps=1e-10, ws_eps_inside_sqrt=True, gn_eps=1e-5,
    )


def _register_all() -> None:
    for size in VIT_SIZES:
        for patch in PATCH_SIZES:
            name = f"ViT-{size}/{patch}"
            register(name, lambda s=size, p=patch, n=name: vit_config(s, p, name=n))
    for size in ("B", "L"):
        for reduction in (16, 32):
            name = f"R50x1+ViT-{size}/{reduction}"
            register(name, lambda s=size, r=reduction, n=name: hybrid_config(s, r, name=n))
    for patch in (16, 32):
        name = f"Axial-ViT-B/{patch}"
        register(name, lambda p=patch, n=name: vit_config("B", p, axial=True, classifier="gap", name=n))
    for bit in BIT_MODELS:
        register(f"BiT-{bit}", lambda b=bit: bit_config(b))


_register_all()


def canonical_name(name: str) -> str:
    """Map the official spellings onto registry names: ViT-B_16 -> ViT-B/16, R50+ -> R50x1+."""
    n = name.strip()
    n = re.sub(r"_(\d+)$", r"/\1", n)
    n = re.sub(r"^R50\+", "R50x1+", n)
    if re.fullmatch(r"R\d+x\d+", n):
        n = "BiT-" + n
    return n


# The registry's names in form, any size, patch or depth (ViT-B/16, R50x1+ViT-L/32, Axial-ViT-B/16,
# BiT-R50x1, the official ViT-B_16, R50+ViT-B_16), in any case: a model's name, right or mistyped.
NAME_FORM = re.compile(r"(?:R\d+(?:x\d+)?\+)?(?:Axial-)?ViT-[A-Za-z]+[/_]\d+|(?:BiT-)?R\d+x\d+", re.IGNORECASE)


def has_name_form(name: str) -> bool:
    """Whether ``name`` is written as the registry writes its names (``ViT-Ti/17``, ``vit-b/16``): such a
    name is meant as a model's, never as a Hugging Face Hub repository (org/name) it would also read as."""
    return canonical_name(name) in _REGISTRY or NAME_FORM.fullmatch(name.strip()) is not None


def unknown_model(name: str) -> str:
    """"unknown model 'ViT-Ti/17'. Did you mean 'ViT-Ti/16'? ..." for a name the registry lacks."""
    return f"unknown model {name!r}.{suggest(canonical_name(name))} `vitlab models` lists all {len(_REGISTRY)} names."


def closest_models(name: str, n: int = 3) -> list[str]:
    """Registry names closest to ``name`` (case-insensitive, by edit similarity), best first."""
    lower = {k.lower(): k for k in _REGISTRY}
    key = canonical_name(name).lower()
    if key in lower:
        return [lower[key]]
    return [lower[m] for m in difflib.get_close_matches(key, list(lower), n=n, cutoff=0.6)]


def suggest(name: str) -> str:
    """' Did you mean 'ViT-B/16'?' for a near miss, '' when nothing is close."""
    close = closest_models(name)
    if not close:
        return ""
    return f" Did you mean {' or '.join(map(repr, close))}?"


def list_models() -> list[str]:
    return list(_REGISTRY)


def get_config(name: str, **overrides: Any) -> Architecture:
    """The registered config for ``name`` with fields overridden."""
    if not isinstance(name, str):
        raise ConfigError(f"model name {name!r}: must be a string such as 'ViT-B/16'")
    key = canonical_name(name)
    if key not in _REGISTRY:
        raise ConfigError(unknown_model(name))
    return replace(_REGISTRY[key](), **overrides) if overrides else _REGISTRY[key]()


def build_model(cfg: Architecture) -> nn.Module:
    """Instantiate the module that ``cfg`` describes."""
    need_architecture(cfg)
    if isinstance(cfg, ResNetConfig):
        return BiTResNet(cfg)
    if cfg.axial:
        return AxialVisionTransformer(cfg)
    return VisionTransformer(cfg)


def create_model(name_or_config: str | Architecture, **overrides: Any) -> nn.Module:
    """Build a model by registry name or from a config, e.g.

        create_model("ViT-B/16", num_classes=10, img_size=384)
        create_model(ViTConfig(width=192, depth=6, num_heads=3, mlp_dim=768, patch_size=4, img_size=32))
    """
    if isinstance(name_or_config, str):
        cfg = get_config(name_or_config, **overrides)
    else:
        need_architecture(name_or_config, "name_or_config", also="a registry name such as 'ViT-B/16', ")
        cfg = replace(name_or_config, **overrides) if overrides else name_or_config
    return build_model(cfg)


def count_parameters(cfg: Architecture) -> int:
    """Parameters of the model ``cfg`` describes, counted without allocating memory."""
    with torch.device("meta"):
        model = build_model(cfg)
    return sum(p.numel() for p in model.parameters())
