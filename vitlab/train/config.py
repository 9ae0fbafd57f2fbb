"""The training configuration: one frozen dataclass, recipes in ``vitlab/configs/*.py``.

A recipe is a plain Python function returning a ``TrainConfig`` (big_vision style);
the command line then overrides fields with ``--set field=value`` (or a dedicated flag)
and ``validate`` refuses an impossible combination, naming the field, before any data is
read or any model built.

Model fields are not copied here: ``model`` names a registry entry and
``model_overrides`` changes any of its ``ViTConfig`` fields (``--set model.width=256``).
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from vitlab.config import ConfigError, ViTConfig

OPTIMIZERS = ("adam", "sgd")
DECAYS = ("cosine", "linear", "constant")
PRECISIONS = ("auto", "fp32", "bf16")
LOSSES = ("softmax_xent", "sigmoid_xent")
WD_SCOPES = ("kernels", "all")
CROPS = ("inception", "pad", "none")
BUILTIN_DATA = ("digits",)  # data sources that need no path (see vitlab/data/digits.py)


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on.  Sizes are global (over all processes).

    model / model_overrides: a registry name and ``ViTConfig`` fields to change.
    init:        weights to start from (fine-tuning); None trains from scratch.  The
                 architecture is then the checkpoint's: of ``model_overrides`` only
                 dropout, attention_dropout and drop_path apply.
    keep_pre_logits: with ``init``, keep the pre-training pre-logits layer; the paper
                 removes the whole head before fine-tuning (Sec. 3.2).
    img_size:    training resolution (None: the model's).  Position embeddings of
                 ``init`` are interpolated to it (Sec. 3.2).
    data:        ImageFolder folder or .tar/.tar.gz, or a built-in source ("digits").
    train_examples: use only this many examples of the data (class-stratified; 0 = all),
                 the VTAB-1k protocol's 1000; ``val_split`` is then taken out of them.
    val_split:   held-out validation examples: a count (>= 1) or a fraction (< 1) of
                 the training set, class-stratified and fixed by ``split_seed``; 0: none.
    class_subset: train on these class names only (labels renumbered in this order).
    progressive_sizes: progressive resizing: ``((size, until), ...)`` trains on images
                 resized (antialiased) to ``size`` pixels until the fraction ``until`` of
                 the steps, then on the next phase's size, and after the last phase at
                 ``img_size``; e.g. ``((24, 0.5),)`` for 32-pixel CIFAR.  A smaller image
                 makes a cheaper step (a hybrid's cost goes with the pixel count); evaluation
                 stays at ``img_size``.  The model gets ``dynamic_img_size``.
    steps:       optimiser steps; with ``time_limit`` a ceiling, the real number is
                 fitted to the budget after measuring throughput.
    warmup:      linear warm-up: a number of steps (>= 1) or a fraction of ``steps`` (< 1).
    batch_size:  global batch per optimiser step; split into ``accum_steps`` micro-batches
                 on each of the world's processes.
    weight_decay: PyTorch/AdamW semantics: each step multiplies decayed weights by
                 (1 - lr_t * weight_decay).  See optim.py for how this maps onto the
                 official code's decoupled decay.
    wd_scope:    "kernels": only weight matrices and conv kernels decay (official
                 code); "all": every parameter.
    ema_decay:   exponential moving average of the weights (Polyak averaging, paper
                 B.1.1, factor 0.9999); 0 = off.  The average is what gets evaluated
                 and saved when on.
    lr_grid:     learning rates `vitlab sweep` tries (paper Table 4).
    time_limit:  minutes of wall time for the whole run (0 = no limit).
    eval_flip:   validation scores the mean of each image's and its mirror image's
                 predicted probabilities (test-time flip augmentation; twice the
                 evaluation cost); the single-view top-1 is logged beside it as
                 ``val_top1_single``.
    final_eval_shift: the final evaluation also averages each view's four translations
                 by this many pixels (``vitlab.eval.features.tta_views``; 5x that
                 evaluation's cost, which a time limit budgets for); the periodic ones do
                 not.  Its record then holds the centre view's ``val_top1_single`` and, with
                 eval_flip, the flip pair's ``val_top1_flip`` beside the ensemble's top-1.
    """

    recipe: str = "custom"
    # model
    model: str = "ViT-B/16"
    model_overrides: dict = field(default_factory=dict)
    init: Union[str, None] = None
    keep_pre_logits: bool = False
    pre_logits: bool = False
    img_size: Union[int, None] = None
    # data
    data: Union[str, None] = None
    val_split: float = 0.0
    split_seed: int = 0
    train_examples: int = 0
    class_subset: tuple = ()
    decode_workers: int = 2
    cache_dir: Union[str, None] = None
    # augmentation (vitlab.data.transforms.TrainTransform)
    crop: str = "inception"
    crop_scale: tuple = (0.05, 1.0)
    crop_pad: int = 4
    flip: bool = True
    alternate_flip: bool = False
    randaug_ops: int = 0
    randaug_magnitude: float = 9.0
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    label_smoothing: float = 0.0
    erase_prob: float = 0.0
    progressive_sizes: tuple = ()
    # optimisation
    optimizer: str = "adam"
    lr: float = 1e-3
    lr_grid: tuple = ()
    betas: tuple = (0.9, 0.999)
    momentum: float = 0.9
    weight_decay: float = 0.0
    wd_scope: str = "kernels"
    batch_size: int = 512
    accum_steps: int = 1
    steps: int = 1000
    warmup: float = 0
    decay: str = "cosine"
    min_lr: float = 0.0
    clip_norm: float = 1.0
    loss: str = "softmax_xent"
    ema_decay: float = 0.0
    # execution
    precision: str = "fp32"
    compile: bool = False
    fsdp: bool = False
    seed: int = 0
    device: str = "auto"
    threads: int = 0
    retain_freed_memory: bool = True  # CPU: malloc keeps freed memory for the next step (train/memory.py)
    # time, evaluation, logging, checkpoints
    time_limit: float = 0.0
    time_measure_steps: int = 10
    eval_every: int = 0
    eval_batch_size: int = 256
    eval_flip: bool = False
    final_eval_shift: int = 0
    log_every: int = 10
    tensorboard: bool = True
    ckpt_every: int = 0
    keep_ckpts: int = 2
    out: str = "runs/train"


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


def to_dict(cfg: TrainConfig) -> dict:
    """JSON-serialisable (tuples become lists)."""
    return dataclasses.asdict(cfg)


def from_dict(d: dict) -> TrainConfig:
    unknown = sorted(set(d) - set(field_names()))
    if unknown:
        raise ConfigError(f"unknown TrainConfig field(s) {', '.join(unknown)}")
    d = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    return TrainConfig(**d)


# ----------------------------------------------------------------------------- overrides


def _unknown_field(name: str) -> ConfigError:
    close = difflib.get_close_matches(name, field_names(), n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    return ConfigError(f"unknown field {name!r}.{hint} Fields: {', '.join(field_names())}")


# the type of the fields whose default is None, shown by an example value
OPTIONAL_TYPES = {"init": "", "img_size": 0, "data": "", "cache_dir": ""}


def _parse_value(text: str, default: Any) -> Any:
    """Turn command-line text into a value of the default's type."""
    if isinstance(default, bool):
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError("expected true or false")
    if isinstance(default, str):
        return text.strip()
    if text.strip().lower() in ("none", "null"):
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text  # a bare word: a string
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(default, tuple):
        if isinstance(value, str):
            value = tuple(v.strip() for v in value.split(",") if v.strip())
        elif isinstance(value, (list, tuple)):
            value = tuple(value)
        else:
            value = (value,)
    elif isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    return value


def apply_overrides(cfg: TrainConfig, assignments: list[str] | tuple[str, ...]) -> TrainConfig:
    """Apply ``field=value`` strings; ``model.<field>=value`` changes a ViTConfig field.

    Values are Python literals (``0.1``, ``(0.9, 0.95)``, ``None``) or bare words
    (``cosine``); tuples also accept ``0.9,0.95``.
    """
    changes: dict[str, Any] = {}
    model_overrides = dict(cfg.model_overrides)
    defaults = TrainConfig()
    for item in assignments:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected field=value")
        name, text = (s.strip() for s in item.split("=", 1))
        if name.startswith("model."):
            key = name[len("model."):]
            vit_fields = {f.name: f.default for f in dataclasses.fields(ViTConfig)}
            if key not in vit_fields:
                raise ConfigError(f"--set {name}: {key!r} is not a ViTConfig field; known: {', '.join(vit_fields)}")
            default = vit_fields[key]
            # sizes: "16" and "16,16" both mean (16, 16), which ViTConfig accepts as an int or a pair
            model_overrides[key] = _parse_value(text, None if key in ("img_size", "patch_size") else default)
            continue
        if name not in field_names() or name == "model_overrides":
            raise _unknown_field(name)
        default = getattr(defaults, name)
        if default is None:  # optional fields: "none" clears them
            if text.strip().lower() in ("none", "null"):
                changes[name] = None
                continue
            default = OPTIONAL_TYPES[name]
        try:
            changes[name] = _parse_value(text, default)
        except ValueError as err:
            raise ConfigError(f"{name}={text!r}: {err}") from None
    return dataclasses.replace(cfg, model_overrides=model_overrides, **changes)


def replace(cfg: TrainConfig, **changes: Any) -> TrainConfig:
    """``dataclasses.replace`` that names unknown fields."""
    for name in changes:
        if name not in field_names():
            raise _unknown_field(name)
    return dataclasses.replace(cfg, **changes)


# ----------------------------------------------------------------------------- validation


def _need(cond: bool, name: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"{name}={value!r}: {allowed}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def model_config(cfg: TrainConfig, num_classes: int | None = None) -> ViTConfig:
    """The ``ViTConfig`` this run trains (raises ConfigError naming a bad model field)."""
    from vitlab.config import replace as replace_model
    from vitlab.models.registry import get_config

    overrides = dict(cfg.model_overrides)
    new_name = overrides.pop("name", None)
    if cfg.img_size is not None:
        overrides["img_size"] = cfg.img_size
    if num_classes is not None:
        overrides["num_classes"] = num_classes
    if cfg.progressive_sizes:
        overrides["dynamic_img_size"] = True
    model_cfg = get_config(cfg.model, **overrides)
    if new_name is not None:
        model_cfg = replace_model(model_cfg, name=new_name)
    if cfg.pre_logits and cfg.init is None:
        model_cfg = replace_model(model_cfg, representation_size=model_cfg.width)
    if not isinstance(model_cfg, ViTConfig):
        raise ConfigError(f"model={cfg.model!r}: the training engine trains ViTConfig models only")
    return model_cfg


def warmup_steps(cfg: TrainConfig, total_steps: int) -> int:
    """``warmup`` as a step count: a fraction of ``total_steps`` when below 1."""
    if cfg.warmup < 1:
        return int(round(cfg.warmup * total_steps))
    return int(cfg.warmup)


def validate(cfg: TrainConfig, world_size: int = 1, need_data: bool = True) -> None:
    """Refuse an impossible configuration before any work starts (ConfigError names the field)."""
    choices = {
        "optimizer": OPTIMIZERS, "decay": DECAYS, "precision": PRECISIONS, "loss": LOSSES,
        "wd_scope": WD_SCOPES, "crop": CROPS,
    }
    for name, allowed in choices.items():
        value = getattr(cfg, name)
        _need(value in allowed, name, value, f"allowed values are {', '.join(map(repr, allowed))}")
    for f in dataclasses.fields(TrainConfig):  # a recipe's "no" would otherwise read as true
        if isinstance(f.default, bool):
            value = getattr(cfg, f.name)
            _need(isinstance(value, bool), f.name, value, "must be True or False")
    for name in ("batch_size", "accum_steps", "steps", "eval_batch_size", "log_every", "keep_ckpts",
                 "time_measure_steps"):
        value = getattr(cfg, name)
        _need(_is_int(value) and value > 0, name, value, "must be a positive integer")
    for name in ("eval_every", "ckpt_every", "train_examples", "decode_workers", "threads", "seed",
                 "split_seed", "randaug_ops", "crop_pad", "final_eval_shift"):
        value = getattr(cfg, name)
        _need(_is_int(value) and value >= 0, name, value, "must be an integer >= 0")
    for name in ("lr", "min_lr", "weight_decay", "clip_norm", "time_limit", "randaug_magnitude",
                 "mixup_alpha", "cutmix_alpha"):
        value = getattr(cfg, name)
        _need(_is_num(value) and value >= 0, name, value, "must be a number >= 0")
    _need(cfg.lr > 0, "lr", cfg.lr, "must be > 0")
    _need(isinstance(cfg.lr_grid, tuple) and all(_is_num(v) and v > 0 for v in cfg.lr_grid),
          "lr_grid", cfg.lr_grid, "expected positive learning rates, e.g. 0.001,0.003,0.01")
    _need(cfg.min_lr <= cfg.lr, "min_lr", cfg.min_lr, f"must not exceed lr={cfg.lr}")
    for name in ("label_smoothing", "ema_decay", "momentum", "erase_prob"):
        value = getattr(cfg, name)
        _need(_is_num(value) and 0 <= value < 1, name, value, "must lie in [0, 1)")
    _need(isinstance(cfg.betas, tuple) and len(cfg.betas) == 2 and all(_is_num(b) and 0 <= b < 1 for b in cfg.betas),
          "betas", cfg.betas, "expected two numbers in [0, 1), e.g. 0.9,0.999")
    _need(isinstance(cfg.crop_scale, tuple) and len(cfg.crop_scale) == 2
          and all(_is_num(s) for s in cfg.crop_scale) and 0 < cfg.crop_scale[1] <= 1
          and 0 <= cfg.crop_scale[0] <= cfg.crop_scale[1], "crop_scale", cfg.crop_scale, "expected (min, max) in (0, 1]")
    phases = cfg.progressive_sizes
    _need(isinstance(phases, (tuple, list)) and all(
        isinstance(p, (tuple, list)) and len(p) == 2 and _is_int(p[0]) and p[0] > 0 and _is_num(p[1]) and 0 < p[1] <= 1
        for p in phases) and all(a[1] < b[1] for a, b in zip(phases, phases[1:])),
        "progressive_sizes", phases, "expected ((size, until), ...): sizes in pixels, the fractions until in "
        "(0, 1] rising, e.g. [[24, 0.5]]")
    _need(_is_num(cfg.warmup) and cfg.warmup >= 0 and (cfg.warmup < 1 or float(cfg.warmup).is_integer()),
          "warmup", cfg.warmup, "a step count (integer >= 1) or a fraction of the steps in [0, 1)")
    _need(warmup_steps(cfg, cfg.steps) <= cfg.steps, "warmup", cfg.warmup, f"exceeds steps={cfg.steps}")
    _need(_is_num(cfg.val_split) and cfg.val_split >= 0 and (cfg.val_split < 1 or float(cfg.val_split).is_integer()),
          "val_split", cfg.val_split, "a count (integer >= 1), a fraction in (0, 1), or 0 for none")
    per_process = cfg.accum_steps * world_size
    if cfg.batch_size % per_process:
        raise ConfigError(
            f"batch_size={cfg.batch_size} is not divisible by accum_steps={cfg.accum_steps} x "
            f"world_size={world_size} = {per_process}: every micro-batch must have the same size"
        )
    if cfg.fsdp and cfg.ema_decay > 0:
        raise ConfigError("ema_decay>0 with fsdp=True: the weight average of a sharded model is not implemented")
    if cfg.fsdp and world_size < 2:
        raise ConfigError("fsdp=True needs a distributed launch (torchrun --nproc_per_node=N); world_size is 1")
    if not isinstance(cfg.model_overrides, dict):
        raise ConfigError(f"model_overrides={cfg.model_overrides!r}: expected a dict of ViTConfig fields")
    if cfg.img_size is not None:
        _need(_is_int(cfg.img_size) and cfg.img_size > 0, "img_size", cfg.img_size, "must be a positive integer")
    if cfg.init is None:  # with init the checkpoint's own config is checked when it is loaded
        model_config(cfg)  # unknown model, bad model field, img_size not divisible by the patch size
    if need_data:
        if cfg.data is None:
            raise ConfigError("data=None: give a data path (--data PATH: an ImageFolder folder or .tar/.tar.gz) "
                              f"or a built-in source ({', '.join(BUILTIN_DATA)})")
        if cfg.data not in BUILTIN_DATA and not Path(cfg.data).expanduser().exists():
            raise ConfigError(f"data={cfg.data!r}: no such file or folder")
    if cfg.init is not None and not Path(cfg.init).expanduser().exists():
        raise ConfigError(f"init={cfg.init!r}: no such file or folder")


# ----------------------------------------------------------------------------- recipes


def recipes_dir() -> Path:
    """``vitlab/configs/``: the recipes ship inside the package, so any install has them."""
    return Path(__file__).resolve().parents[1] / "configs"


def list_recipes() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.py") if not p.stem.startswith("_"))


def load_recipe(spec: str) -> TrainConfig:
    """``NAME`` or ``path/to/file.py``, optionally ``:key=value,key=value`` passed to
    its ``get_config`` (e.g. ``paper_finetune:dataset=cifar100``)."""
    name, _, arg_text = spec.partition(":")
    path = Path(name) if name.endswith(".py") else recipes_dir() / f"{name}.py"
    if not path.is_file():
        raise ConfigError(f"recipe={name!r}: no such recipe; known: {', '.join(list_recipes())}")
    module_spec = importlib.util.spec_from_file_location(f"vitlab_recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    kwargs = {}
    for item in filter(None, arg_text.split(",")):
        key, _, value = item.partition("=")
        kwargs[key.strip()] = value.strip()
    try:
        cfg = module.get_config(**kwargs)
    except (TypeError, ValueError) as err:  # an unknown or bad recipe argument
        raise ConfigError(f"recipe {spec!r}: {err}") from None
    if not isinstance(cfg, TrainConfig):
        raise ConfigError(f"recipe {spec!r}: get_config() returned {type(cfg).__name__}, not TrainConfig")
    return cfg
