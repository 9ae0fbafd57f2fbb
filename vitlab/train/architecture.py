"""The architecture a training config's model section trains from scratch: a ``ViTConfig``,
or for the BiT baselines a ``ResNetConfig`` (``vitlab.config.Architecture``).

``ModelConfig`` checks itself by deriving it, so this module imports nothing of
``train/config.py`` (that would be a circle): ``ModelSection`` names what it reads.
``architecture`` gives a whole run's.
"""
from __future__ import annotations

from typing import Optional, Protocol

from vitlab.config import Architecture, ConfigError, ResNetConfig, ViTConfig, replace
from vitlab.models.registry import get_config


class ModelSection(Protocol):
    """The fields of ``vitlab.train.config.ModelConfig`` the architecture depends on."""

    name: str
    overrides: dict
    init: Optional[str]
    pre_logits: bool
    img_size: Optional[int | tuple | str]
    mpp: Optional[str]


def model_architecture(model: ModelSection, num_classes: int | None = None,
                       dynamic_img_size: bool = False) -> Architecture:
    """The architecture of a from-scratch model section: its registry name with its
    overrides, resolution and class count (ConfigError names a bad field)."""
    overrides = dict(model.overrides)
    new_name = overrides.pop("name", None)
    if model.img_size not in (None, "auto"):  # N or (H, W); "auto" not yet resolved: the model's own size
        overrides["img_size"] = model.img_size
    if num_classes is not None:
        overrides["num_classes"] = num_classes
    bit = isinstance(get_config(model.name), ResNetConfig)
    if dynamic_img_size and not bit:
        overrides["dynamic_img_size"] = True
    built = get_config(model.name, **overrides)
    if new_name is not None:
        built = replace(built, name=new_name)
    if bit:  # the BiT baselines (paper Table 7)
        for field_name, value in (("model.pre_logits", model.pre_logits), ("model.mpp", model.mpp),
                                  ("data.progressive_sizes", dynamic_img_size)):
            if value:
                raise ConfigError(f"{field_name}={value!r}: a ViT feature; model.name={model.name!r} is a BiT "
                                  "ResNet (set it off: false / none / [])")
        return built
    if model.pre_logits and model.init is None and built.representation_size is None:  # a size of its own is kept
        built = replace(built, representation_size=built.width)
    if not isinstance(built, ViTConfig):
        raise ConfigError(f"model.name={model.name!r}: the training engine trains ViTConfig and BiT ResNet models only")
    return built


def architecture(cfg, num_classes: int | None = None) -> Architecture:
    """The architecture a run (a ``TrainConfig``) trains from scratch: progressive resizing
    makes its input size dynamic."""
    return model_architecture(cfg.model, num_classes, dynamic_img_size=bool(cfg.data.progressive_sizes))
