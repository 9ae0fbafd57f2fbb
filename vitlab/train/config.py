"""The training configuration: plain nested dataclasses, recipes in ``vitlab/configs/*.py``.

    TrainConfig(recipe, model=ModelConfig(...), data=DataConfig(...), augment=AugmentConfig(...),
                optim=OptimConfig(...), run=RunConfig(...))

A recipe is a plain Python function returning a ``TrainConfig`` (big_vision style).
Every section checks its own values when it is built, and ``TrainConfig`` checks the
combinations across sections, so an impossible configuration raises ``ConfigError``
(naming the field, the value and what is allowed) before any data is read or any model
built.  What depends on the machine rather than on the values (the number of processes,
whether the data exists) is ``check_can_run``, which ``train`` calls before it starts.

The command line changes fields with ``--set section.field=value`` (``--set
optim.lr=0.01``); ``--set model.<ViTConfig field>=value`` changes the architecture
(``--set model.width=256``).  The flat names of earlier versions (``lr``, ``batch_size``,
``data``) are still accepted, through ``LEGACY_NAMES``: old checkpoints' and run folders'
configs load with ``from_dict``.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from vitlab.config import ConfigError, ResNetConfig, ViTConfig
from vitlab.data.transforms import CROPS, TrainTransform

OPTIMIZERS = ("adam", "sgd", "muon")
DECAYS = ("cosine", "linear", "constant")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
ON_NONFINITE = ("stop", "skip")
LOSSES = ("softmax_xent", "sigmoid_xent")
WD_SCOPES = ("kernels", "all")
BUILTIN_DATA = ("digits",)  # data sources that need no path (see vitlab/data/digits.py)


# ----------------------------------------------------------------------------- validation helpers


def need(ok: bool, name: str, value: Any, allowed: str) -> None:
    """The one way a value is refused: ``ConfigError("name=value: what is allowed")``."""
    if not ok:
        raise ConfigError(f"{name}={value!r}: {allowed}")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def need_choice(name: str, value: Any, allowed: tuple) -> None:
    need(value in allowed, name, value, f"allowed values are {', '.join(map(repr, allowed))}")


def need_int(name: str, value: Any, minimum: int) -> None:
    need(is_int(value) and value >= minimum, name, value,
         "must be a positive integer" if minimum == 1 else f"must be an integer >= {minimum}")


def need_number(name: str, value: Any, minimum: float = 0.0, below: float | None = None) -> None:
    if below is None:
        need(is_number(value) and value >= minimum, name, value, f"must be a number >= {minimum:g}")
    else:
        need(is_number(value) and minimum <= value < below, name, value, f"must lie in [{minimum:g}, {below:g})")


def need_count_or_fraction(name: str, value: Any, allowed: str) -> None:
    """A count (an integer >= 1) or a fraction in [0, 1)."""
    need(is_number(value) and value >= 0 and (value < 1 or float(value).is_integer()), name, value, allowed)


class Section:
    """A config section: ``prefix.field`` names its fields in errors; bools are checked for all."""

    prefix = ""

    def path(self, field_name: str) -> str:
        return f"{self.prefix}.{field_name}" if self.prefix else field_name

    def check_bools(self) -> None:
        for f in dataclasses.fields(self):  # a recipe's "no" would otherwise read as true
            if isinstance(f.default, bool):
                value = getattr(self, f.name)
                need(isinstance(value, bool), self.path(f.name), value, "must be True or False")


# ----------------------------------------------------------------------------- the sections


@dataclass(frozen=True)
class ModelConfig(Section):
    """What is trained.

    name:        a registry entry (``vitlab models``), e.g. "ViT-B/16".
    overrides:   ``ViTConfig`` fields to change in it, e.g. ``{"width": 256}``; a "name" key
                 renames the result.
    init:        weights to start from (fine-tuning); None trains from scratch.  The
                 architecture is then the checkpoint's: of ``overrides`` only the
                 regularisation (dropout, attention_dropout, drop_path, patch_dropout) applies.
    keep_pre_logits: with ``init``, keep the pre-training pre-logits layer; the paper
                 removes the whole head before fine-tuning (Sec. 3.2).
    pre_logits:  from scratch, add a pre-logits layer (dense + tanh of the model's width,
                 Sec. 3.1) to the head, as the paper's pre-training does.
    img_size:    training resolution (None: the model's).  Position embeddings of ``init``
                 are interpolated to it (Sec. 3.2).
    mpp:         self-supervised pre-training by masked patch prediction (Sec. 4.6): the
                 target, "color" (3-bit mean colour, the paper's), "color4x4" or "pixels";
                 None trains the classifier.  The labels are not used, there is no
                 evaluation, and the saved weights are the plain ViT (``vitlab.models.mpp``).
    mpp_rate:    the fraction of each image's patches corrupted (0.5 in the paper).
    patch_init:  from scratch, how the patch embedding starts: "lecun" (the official
                 LeCun normal) or "whiten" (its filters whiten the training images'
                 patches, ``vitlab.models.init.whiten_patch_embedding_``; not in the paper).
    attn_init:   from scratch, how the attention layers start: "xavier" (the official
                 Xavier-uniform) or "mimetic" (query-key products near +identity, value-output
                 near -identity, as in trained ViTs: ``vitlab.models.init.mimetic_attention_``;
                 not in the paper).
    posemb_init: from scratch, how a learned 1D position embedding starts: "normal" (the
                 official N(0, 0.02)) or "sincos" (big_vision's fixed 2D sin-cos table, which
                 makes neighbouring patches' embeddings alike from the first step; not in the paper).
    """

    prefix = "model"
    name: str = "ViT-B/16"
    overrides: dict = field(default_factory=dict)
    init: Optional[str] = None
    keep_pre_logits: bool = False
    pre_logits: bool = False
    img_size: Optional[int] = None
    mpp: Optional[str] = None
    mpp_rate: float = 0.5
    patch_init: str = "lecun"
    attn_init: str = "xavier"
    posemb_init: str = "normal"

    def __post_init__(self) -> None:
        from vitlab.models.mpp import TARGETS

        self.check_bools()
        need(isinstance(self.name, str), "model.name", self.name, "expected a registry name, e.g. ViT-B/16")
        need(self.mpp is None or self.mpp in TARGETS, "model.mpp", self.mpp,
             f"expected None or one of {', '.join(TARGETS)}")
        need_number("model.mpp_rate", self.mpp_rate, 0.0, below=1.0 + 1e-9)
        need(self.mpp_rate > 0, "model.mpp_rate", self.mpp_rate, "must be a fraction in (0, 1]")
        for name, allowed in FROM_SCRATCH_INITS.items():  # the first allowed value is the official init
            value = getattr(self, name)
            need(value in allowed, f"model.{name}", value, f"expected one of {', '.join(allowed)}")
            need(value == allowed[0] or self.init is None, f"model.{name}", value,
                 f"{value!r} initialises a model trained from scratch; with model.init the weights are loaded")
        need(isinstance(self.overrides, dict), "model.overrides", self.overrides, "expected a dict of ViTConfig fields")
        need(self.init is None or isinstance(self.init, str), "model.init", self.init, "expected a path or None")
        if self.img_size is not None:
            need_int("model.img_size", self.img_size, 1)
        if self.init is None:  # with init the checkpoint's own config is checked when it is loaded
            try:  # unknown model, bad model field, img_size not divisible by the patch size
                vit_config(self)
            except ConfigError as err:
                from vitlab.models.registry import canonical_name, list_models

                if canonical_name(self.name) not in list_models():
                    raise ConfigError(f"model.name={self.name!r}: {err}") from None
                raise ConfigError(f"model (name={self.name!r}, overrides, img_size): {err}") from None


# ModelConfig's initialisation options for a model trained from scratch: the official one first
FROM_SCRATCH_INITS = {"patch_init": ("lecun", "whiten"), "attn_init": ("xavier", "mimetic"),
                      "posemb_init": ("normal", "sincos")}
STREAM_MODES = ("auto", "memory", "stream")


@dataclass(frozen=True)
class DataConfig(Section):
    """Where the examples come from and how they are split.

    source:      ImageFolder folder or .tar/.tar.gz, a streamed set (tar shards: a folder,
                 brace pattern or glob; a Hugging Face ``save_to_disk`` folder; parquet
                 files), or a built-in source ("digits").
    val_split:   held-out validation examples: a count (>= 1) or a fraction (< 1) of
                 the training set, fixed by ``split_seed``; 0: none.  In memory the split is
                 class-stratified; a streamed set holds out whole units (shards) drawn by
                 ``split_seed`` until they hold that many examples.
    val_data:    a separate validation set (any form ``source`` takes; decoded into memory
                 at the evaluation size), instead of a held-out split (``val_split`` 0).
    split_seed:  seed of the split (and, plus one, of ``train_examples``' sample).
    train_examples: use only this many examples of the data (class-stratified; 0 = all),
                 the VTAB-1k protocol's 1000; ``val_split`` is then taken out of them.
    class_subset: train on these class names only (labels renumbered in this order).
    decode_workers: processes decoding the images into the in-memory cache; "auto": every
                 core of this process's share of the machine.
    cache_dir:   where decoded data sets are cached (None: ~/.cache/vitlab).
    progressive_sizes: progressive resizing: ``((size, until), ...)`` trains on images
                 resized (antialiased) to ``size`` pixels until the fraction ``until`` of
                 the steps, then on the next phase's size, and after the last phase at the
                 training resolution; e.g. ``((24, 0.5),)`` for 32-pixel CIFAR.  A smaller
                 image makes a cheaper step; evaluation stays at the full size.  The model
                 gets ``dynamic_img_size``.
    stream:      "memory" decodes the training set into RAM; "stream" reads it from disk in
                 DataLoader workers (``vitlab.data.stream``); "auto" streams the sets stored
                 to be streamed (shards, Hugging Face datasets, parquet), and folders whose
                 decoded size would exceed ``memory_limit_gb``.
    stream_workers: DataLoader worker processes per training process when streaming;
                 "auto": the cores per training process, less one (the training process's).
    shuffle_buffer: samples each streaming worker holds for shuffling (0: read in order).
    memory_limit_gb: the decoded size (N x 3 x H x W bytes) above which "auto" streams.
    draft:       streaming readers decode a JPEG at 1/2, 1/4 or 1/8 scale when that still
                 covers the crop's output (``vitlab.data.decode``); False: always full size.
    """

    prefix = "data"
    source: Optional[str] = None
    val_split: float = 0.0
    val_data: Optional[str] = None
    split_seed: int = 0
    train_examples: int = 0
    class_subset: tuple = ()
    decode_workers: int | str = "auto"
    cache_dir: Optional[str] = None
    progressive_sizes: tuple = ()
    stream: str = "auto"
    stream_workers: int | str = "auto"
    shuffle_buffer: int = 1000
    memory_limit_gb: float = 8.0
    draft: bool = True

    def __post_init__(self) -> None:
        self.check_bools()
        need_choice("data.stream", self.stream, STREAM_MODES)
        for name in ("stream_workers", "decode_workers"):
            value = getattr(self, name)
            if isinstance(value, str) and value.strip().isdigit():  # from the command line: --set data.x=3
                object.__setattr__(self, name, int(value))
            value = getattr(self, name)
            need(value == "auto" or (is_int(value) and value >= 0), self.path(name), value,
                 'expected "auto" or an integer >= 0')
        need_int("data.shuffle_buffer", self.shuffle_buffer, 0)
        need(is_number(self.memory_limit_gb) and self.memory_limit_gb > 0, "data.memory_limit_gb",
             self.memory_limit_gb, "expected a positive number of GB")
        for name in ("source", "val_data"):
            need(getattr(self, name) is None or isinstance(getattr(self, name), str), self.path(name),
                 getattr(self, name), "expected a path or None")
        need_count_or_fraction("data.val_split", self.val_split,
                               "a count (integer >= 1), a fraction in (0, 1), or 0 for none")
        need(not (self.val_data and self.val_split), "data.val_data", self.val_data,
             f"a validation set of its own, so data.val_split={self.val_split!r} must be 0 (one validation set)")
        for name in ("split_seed", "train_examples"):
            need_int(self.path(name), getattr(self, name), 0)
        need(isinstance(self.class_subset, tuple) and all(isinstance(c, str) for c in self.class_subset),
             "data.class_subset", self.class_subset, "expected a tuple of class names")
        phases = self.progressive_sizes
        need(isinstance(phases, (tuple, list)) and all(
            isinstance(p, (tuple, list)) and len(p) == 2 and is_int(p[0]) and p[0] > 0 and is_number(p[1])
            and 0 < p[1] <= 1 for p in phases) and all(a[1] < b[1] for a, b in zip(phases, phases[1:])),
            "data.progressive_sizes", phases, "expected ((size, until), ...): sizes in pixels, the fractions "
            "until in (0, 1] rising, e.g. [[24, 0.5]]")


@dataclass(frozen=True)
class AugmentConfig(Section):
    """Training augmentation: the fields of ``vitlab.data.transforms.TrainTransform`` other
    than the class count and the output size; ``TrainTransform`` checks them, and
    ``transform`` builds it for a run.

    crop:        "inception" (random resized crop, the official pipeline), "pad" (CIFAR's
                 reflect-pad by ``crop_pad`` pixels and crop back) or "none".
    crop_scale, crop_ratio: the inception crop's (min, max) area fraction and aspect ratio.
    crop_pad:    pixels of padding of the "pad" crop.
    flip:        random left-right mirroring.
    alternate_flip: with ``flip``, mirror each example in every other epoch instead of at random.
    randaug_ops, randaug_magnitude: RandAugment's N (0 = off) and M (0-10 scale).
    mixup_alpha, cutmix_alpha, mix_switch_prob: mixup / CutMix (0 = off) and, with both,
                 the probability of CutMix for a batch.
    label_smoothing: target mass spread uniformly over the classes.
    erase_prob:  random erasing probability per image (0 = off).
    """

    prefix = "augment"
    crop: str = "inception"
    crop_scale: tuple = (0.05, 1.0)
    crop_ratio: tuple = (3 / 4, 4 / 3)
    crop_pad: int = 4
    flip: bool = True
    alternate_flip: bool = False
    randaug_ops: int = 0
    randaug_magnitude: float = 9.0
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    mix_switch_prob: float = 0.5
    label_smoothing: float = 0.0
    erase_prob: float = 0.0

    def __post_init__(self) -> None:
        self.check_bools()
        need_choice("augment.crop", self.crop, CROPS)
        for name in ("crop_scale", "crop_ratio"):
            value = getattr(self, name)
            need(isinstance(value, tuple) and len(value) == 2 and all(is_number(v) for v in value),
                 self.path(name), value, "expected (min, max)")
        try:  # TrainTransform holds the rules; the size is a stand-in for the run's
            self.transform(num_classes=1, image_size=(1, 1))
        except ConfigError as err:
            raise ConfigError(f"augment.{err}") from None

    def transform(self, num_classes: int, image_size: tuple) -> TrainTransform:
        return TrainTransform(num_classes=num_classes, image_size=image_size, **dataclasses.asdict(self))


@dataclass(frozen=True)
class OptimConfig(Section):
    """The optimiser and its schedule.  Sizes are global (over all processes).

    optimizer:   "adam" (AdamW; pre-training, Table 3), "sgd" (momentum; fine-tuning, Table 4),
                 or "muon" (not in the paper: Muon on the dense layers inside the Transformer
                 blocks, AdamW with ``betas`` on the rest, one lr and weight decay; see optim.py).
    muon_momentum: Muon's Nesterov momentum (``optimizer="muon"``).
    muon_adamw_lr: with ``optimizer="muon"``, the peak lr of the AdamW part (patch embedding,
                 head, position table, vectors); None: ``lr``.  The schedule scales both alike.
    lr:          base learning rate: the peak of the schedule.
    lr_grid:     learning rates `vitlab sweep` tries (paper Table 4).
    betas:       Adam's (beta1, beta2).
    momentum:    SGD's momentum.
    weight_decay: PyTorch/AdamW semantics: each step multiplies decayed weights by
                 (1 - lr_t * weight_decay).  See optim.py for how this maps onto the
                 official code's decoupled decay.
    wd_scope:    "kernels": only weight matrices and conv kernels decay (official
                 code); "all": every parameter.
    batch_size:  global batch per optimiser step; split into ``accum_steps`` micro-batches
                 on each of the world's processes.
    accum_steps: micro-batches per optimiser step (gradient accumulation).
    steps:       optimiser steps; with ``run.time_limit`` a ceiling, the real number is
                 fitted to the budget after measuring throughput.
    warmup:      linear warm-up: a fraction of the steps (< 1), or a number of steps (>= 1)
                 for a schedule of ``steps`` steps, scaled in proportion when the schedule
                 is shorter: a smaller ``steps`` set without ``warmup`` (``--steps``), or a
                 total fitted to ``run.time_limit`` (``scaled_warmup``).
    decay:       "cosine", "linear" or "constant" after the warm-up.
    min_lr:      where the decay ends.
    clip_norm:   clip the global gradient norm to this (0 = off).
    loss:        "softmax_xent", or "sigmoid_xent" (per-class binary cross-entropy, the
                 official multi-label pre-training loss).
    ema_decay:   exponential moving average of the weights (Polyak averaging, paper
                 B.1.1, factor 0.9999); 0 = off.  The average is what gets evaluated
                 and saved when on.
    """

    prefix = "optim"
    optimizer: str = "adam"
    lr: float = 1e-3
    lr_grid: tuple = ()
    betas: tuple = (0.9, 0.999)
    momentum: float = 0.9
    muon_momentum: float = 0.95
    muon_adamw_lr: Optional[float] = None
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

    def __post_init__(self) -> None:
        self.check_bools()
        for name, allowed in (("optimizer", OPTIMIZERS), ("decay", DECAYS), ("loss", LOSSES), ("wd_scope", WD_SCOPES)):
            need_choice(self.path(name), getattr(self, name), allowed)
        for name in ("batch_size", "accum_steps", "steps"):
            need_int(self.path(name), getattr(self, name), 1)
        for name in ("lr", "min_lr", "weight_decay", "clip_norm"):
            need_number(self.path(name), getattr(self, name))
        need(self.lr > 0, "optim.lr", self.lr, "must be > 0")
        need(self.muon_adamw_lr is None or (is_number(self.muon_adamw_lr) and self.muon_adamw_lr > 0),
             "optim.muon_adamw_lr", self.muon_adamw_lr, "must be None (the lr) or > 0")
        need(self.muon_adamw_lr is None or self.optimizer == "muon", "optim.muon_adamw_lr", self.muon_adamw_lr,
             f"applies to optim.optimizer='muon' only (here {self.optimizer!r}); leave it None")
        need(self.min_lr <= self.lr, "optim.min_lr", self.min_lr, f"must not exceed optim.lr={self.lr}")
        for name in ("momentum", "muon_momentum", "ema_decay"):
            need_number(self.path(name), getattr(self, name), 0.0, below=1.0)
        need(isinstance(self.lr_grid, tuple) and all(is_number(v) and v > 0 for v in self.lr_grid),
             "optim.lr_grid", self.lr_grid, "expected positive learning rates, e.g. 0.001,0.003,0.01")
        need(isinstance(self.betas, tuple) and len(self.betas) == 2 and all(is_number(b) and 0 <= b < 1
                                                                            for b in self.betas),
             "optim.betas", self.betas, "expected two numbers in [0, 1), e.g. 0.9,0.999")
        need_count_or_fraction("optim.warmup", self.warmup, "a step count (integer >= 1) or a fraction of the steps "
                                                            "in [0, 1)")
        need(warmup_steps(self, self.steps) <= self.steps, "optim.warmup", self.warmup,
             f"exceeds optim.steps={self.steps}")
        if self.batch_size % self.accum_steps:
            raise ConfigError(f"optim.batch_size={self.batch_size} is not divisible by optim.accum_steps="
                              f"{self.accum_steps}: every micro-batch must have the same size")


@dataclass(frozen=True)
class RunConfig(Section):
    """How the run executes, evaluates, logs and saves.

    precision:   "fp32", "bf16" (autocast), "fp16" (autocast with a gradient scaler,
                 ``loss_scale``) or "auto": bf16 where it is faster (``vitlab.fast.bf16_is_faster``).
    loss_scale:  fp16: the gradient scaler's first loss scale.  A step whose scaled
                 gradients overflow is left out and the scale halves; after 2000 steps
                 without one it doubles (``torch.amp.GradScaler``).  Those steps are
                 counted as ``overflow_steps``, apart from ``on_nonfinite``'s.
    on_nonfinite: a step whose loss or gradients are NaN or infinite is never applied;
                 "stop" ends the run with the step, the examples of the batch and the
                 last good checkpoint named; "skip" leaves the step out (no optimiser or
                 EMA update), counts it (``skipped_steps`` in the metrics and summary)
                 and goes on.
    max_skipped_steps: with "skip", stop all the same once more steps than this are
                 skipped: a run that keeps producing NaNs has diverged.
    compile:     ``torch.compile`` the model.
    fsdp:        shard the model with FSDP (multi-process runs).
    fast:        apply ``vitlab.fast.optimize`` to the model (the saved weights are the same).
    seed:        model initialisation, dropout, data order and augmentation.
    device:      "auto", "cpu", "cuda", "cuda:1", ...
    threads:     CPU threads of this process (0: PyTorch's default).
    retain_freed_memory: CPU: malloc keeps freed memory for the next step instead of
                 handing it back to the kernel (``train/memory.py``); process-wide, so off
                 unless asked for.
    time_limit:  minutes of wall time for the whole run (0 = no limit).
    time_measure_steps: steps timed before the schedule is fitted to ``time_limit``.
    eval_every:  evaluate every this many steps (0: at the end only).
    eval_batch_size: the evaluation's batch size.
    eval_flip:   validation scores the mean of each image's and its mirror image's
                 predicted probabilities (twice the evaluation cost); the single-view
                 top-1 is logged beside it as ``val_top1_single``.
    final_eval_shift: the final evaluation also averages each view's four translations
                 by this many pixels (``vitlab.eval.features.tta_views``; 5x that
                 evaluation's cost, which a time limit budgets for); the periodic ones do
                 not.  Its record then holds the centre view's ``val_top1_single`` and, with
                 eval_flip, the flip pair's ``val_top1_flip`` beside the ensemble's top-1.
    log_every:   steps between metric records.
    tensorboard: also write TensorBoard events (when installed).
    ckpt_every:  steps between checkpoints (0: at the end only).
    keep_ckpts:  how many checkpoints to keep; with 2 or more a damaged newest one is
                 passed over on ``--resume`` for the one before it.
    out:         the run's folder: metrics, checkpoints, weights.
    """

    prefix = "run"
    precision: str = "fp32"
    loss_scale: float = 65536.0
    on_nonfinite: str = "stop"
    max_skipped_steps: int = 10
    compile: bool = False
    fsdp: bool = False
    fast: bool = True
    seed: int = 0
    device: str = "auto"
    threads: int = 0
    retain_freed_memory: bool = False
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

    def __post_init__(self) -> None:
        self.check_bools()
        need_choice("run.precision", self.precision, PRECISIONS)
        need_choice("run.on_nonfinite", self.on_nonfinite, ON_NONFINITE)
        need(is_number(self.loss_scale) and self.loss_scale > 0, "run.loss_scale", self.loss_scale,
             "must be a number > 0, e.g. 65536")
        for name in ("eval_batch_size", "log_every", "keep_ckpts", "time_measure_steps"):
            need_int(self.path(name), getattr(self, name), 1)
        for name in ("seed", "threads", "eval_every", "final_eval_shift", "ckpt_every", "max_skipped_steps"):
            need_int(self.path(name), getattr(self, name), 0)
        need_number("run.time_limit", self.time_limit)
        need(isinstance(self.out, str) and self.out != "", "run.out", self.out, "expected a folder")


SECTIONS = {"model": ModelConfig, "data": DataConfig, "augment": AugmentConfig, "optim": OptimConfig,
            "run": RunConfig}


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on: ``recipe`` (the name it was made by) and the
    sections model, data, augment, optim and run (see each for its fields)."""

    recipe: str = "custom"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            need(isinstance(getattr(self, name), cls), name, getattr(self, name), f"expected a {cls.__name__}")
        if self.run.fsdp and self.optim.ema_decay > 0:
            raise ConfigError("optim.ema_decay>0 with run.fsdp=True: the weight average of a sharded model is not "
                              "implemented")
        if self.run.fsdp and self.optim.optimizer == "muon":
            raise ConfigError("optim.optimizer='muon' with run.fsdp=True: Muon orthogonalises whole weight matrices, "
                              "FSDP shards them; use 'adam', or DDP (run.fsdp=false)")
        if self.run.fsdp and self.run.precision == "fp16":
            raise ConfigError("run.precision='fp16' with run.fsdp=True: the gradient scaler of a sharded model is not "
                              "implemented; use 'bf16'")


def field_names() -> list[str]:
    """Every settable field as ``section.field`` (and ``recipe``)."""
    return ["recipe"] + [f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


# ----------------------------------------------------------------------------- old flat names

# The flat field names of TrainConfig before the sections (checkpoints and run folders
# written then hold them).  Frozen: a new field gets no flat name.
LEGACY_NAMES = {
    "recipe": "recipe",
    "model": "model.name", "model_overrides": "model.overrides", "init": "model.init",
    "keep_pre_logits": "model.keep_pre_logits", "pre_logits": "model.pre_logits", "img_size": "model.img_size",
    "data": "data.source", "val_split": "data.val_split", "split_seed": "data.split_seed",
    "train_examples": "data.train_examples", "class_subset": "data.class_subset",
    "decode_workers": "data.decode_workers", "cache_dir": "data.cache_dir",
    "progressive_sizes": "data.progressive_sizes",
    **{name: f"augment.{name}" for name in (
        "crop", "crop_scale", "crop_pad", "flip", "alternate_flip", "randaug_ops", "randaug_magnitude",
        "mixup_alpha", "cutmix_alpha", "label_smoothing", "erase_prob")},
    **{name: f"optim.{name}" for name in (
        "optimizer", "lr", "lr_grid", "betas", "momentum", "weight_decay", "wd_scope", "batch_size", "accum_steps",
        "steps", "warmup", "decay", "min_lr", "clip_norm", "loss", "ema_decay")},
    **{name: f"run.{name}" for name in (
        "precision", "compile", "fsdp", "seed", "device", "threads", "retain_freed_memory", "time_limit",
        "time_measure_steps", "eval_every", "eval_batch_size", "eval_flip", "final_eval_shift", "log_every",
        "tensorboard", "ckpt_every", "keep_ckpts", "out")},
}


def is_flat(d: dict) -> bool:
    """Whether ``d`` is a config dict of the flat, pre-section layout."""
    return not any(isinstance(d.get(name), dict) for name in SECTIONS if name != "model") and not isinstance(
        d.get("model"), dict)


def nested_dict(d: dict) -> dict:
    """A config dict in the sectioned layout, whichever layout ``d`` is in (no checks)."""
    if not is_flat(d):
        return d
    nested: dict = {}
    for name, value in d.items():
        path = LEGACY_NAMES.get(name, name)
        if "." in path:
            section, key = path.split(".", 1)
            nested.setdefault(section, {})[key] = value
        else:
            nested[path] = value
    return nested


def _tuples(value: Any) -> Any:
    """JSON's lists back to the tuples the config holds, inside dicts (model overrides) too."""
    if isinstance(value, (list, tuple)):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def to_dict(cfg: TrainConfig) -> dict:
    """The sectioned dict, JSON-serialisable (tuples become lists on the way)."""
    return dataclasses.asdict(cfg)


def from_dict(d: dict) -> TrainConfig:
    """A ``TrainConfig`` from ``to_dict``'s output, or from an old flat config (``LEGACY_NAMES``)."""
    nested = nested_dict(d)
    unknown = [k for k in nested if k not in SECTIONS and k not in ("recipe", "resolved")]  # "resolved": a record
    for name, cls in SECTIONS.items():
        known = {f.name for f in dataclasses.fields(cls)}
        unknown += [f"{name}.{k}" for k in nested.get(name, {}) if k not in known]
    if unknown:
        raise ConfigError(f"unknown TrainConfig field(s) {', '.join(sorted(unknown))}")
    sections = {}
    for name, cls in SECTIONS.items():
        sections[name] = cls(**_tuples(nested.get(name, {})))
    return TrainConfig(recipe=nested.get("recipe", "custom"), **sections)


# ----------------------------------------------------------------------------- changing fields


def _unknown_field(name: str) -> ConfigError:
    names = field_names()
    close = difflib.get_close_matches(name, names + list(LEGACY_NAMES), n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    return ConfigError(f"unknown field {name!r}.{hint} Fields: {', '.join(names)}")


def resolve_name(name: str) -> str:
    """``section.field`` for a new or an old flat name (ConfigError for neither)."""
    if name in field_names():
        return name
    if name in LEGACY_NAMES:
        return LEGACY_NAMES[name]
    raise _unknown_field(name)


def replace(cfg: TrainConfig, changes: dict[str, Any]) -> TrainConfig:
    """``cfg`` with ``{"section.field": value}`` changed (old flat names accepted); the new
    sections check themselves.

    ``"model.<ViTConfig or ResNetConfig field>": value`` changes one field of the
    architecture (``model.overrides``).  A ``model.name`` of another model family (a BiT
    ResNet in a ViT recipe) leaves out what the recipe set for its own family and the new
    one has not (``fit_model_family``); what ``changes`` sets explicitly is kept, and
    refused when the model has no such field.
    """
    by_section: dict[str, dict] = {}
    architecture: dict[str, Any] = {}
    recipe = cfg.recipe
    for name, value in changes.items():
        key = name[len("model."):] if name.startswith("model.") else None
        if key is not None and key not in MODEL_FIELDS and key in ARCHITECTURE_FIELDS:
            architecture[key] = value
            continue
        path = resolve_name(name)
        if path == "recipe":
            recipe = value
            continue
        section, key = path.split(".", 1)
        by_section.setdefault(section, {})[key] = value
    by_section = fit_model_family(cfg, by_section)
    optim = by_section.get("optim", {})
    if "warmup" not in optim and is_int(optim.get("steps")) and optim["steps"] >= 1:  # a shorter run, same shape
        by_section["optim"] = {**optim, "warmup": scaled_warmup(cfg.optim.warmup, optim["steps"], cfg.optim.steps)}
    if architecture:
        model = by_section.setdefault("model", {})
        model["overrides"] = {**model.get("overrides", cfg.model.overrides), **architecture}
    sections = {name: dataclasses.replace(getattr(cfg, name), **values) for name, values in by_section.items()}
    return dataclasses.replace(cfg, recipe=recipe, **sections)


# What a ViT recipe sets that a BiT ResNet has not: the value that leaves it out
VIT_ONLY_FIELDS = {("model", "pre_logits"): False, ("model", "patch_init"): "lecun", ("model", "attn_init"): "xavier",
                   ("model", "posemb_init"): "normal", ("data", "progressive_sizes"): ()}


def model_family(name: str) -> type | None:
    """``ViTConfig`` or ``ResNetConfig``: the config class of a registry name (None: unknown)."""
    from vitlab.models.registry import get_config

    try:
        return type(get_config(name))
    except ConfigError:
        return None


def fit_model_family(cfg: TrainConfig, by_section: dict[str, dict]) -> dict[str, dict]:
    """``replace``'s changes by section, plus what a change of model family leaves out.

    A recipe is written for one family (every recipe here: the ViT).  When ``model.name``
    changes to another (``--model BiT-R50x1``), the recipe's architecture overrides that
    the new family has no field for (dropout, patch size, a hybrid's ``resnet``, a
    ``name``) and its ViT-only options (``VIT_ONLY_FIELDS``: the pre-logits layer, the
    ViT's initialisations, progressive resizing) are left out, unless ``by_section`` sets
    them: a value set explicitly is kept, and refused by the checks if the family has no
    such field.  Masked patch prediction (``model.mpp``) is the purpose of its recipe, not
    an option of it: it stays, and is refused for a ResNet.
    """
    model = by_section.get("model", {})
    new, old = model_family(model.get("name", cfg.model.name)), model_family(cfg.model.name)
    if new is None or old is None or new is old:
        return by_section
    by_section = {section: dict(values) for section, values in by_section.items()}
    model = by_section.setdefault("model", {})
    if "overrides" not in model:
        fields = {f.name for f in dataclasses.fields(new)} - {"name"}  # the recipe's name is its own model's
        model["overrides"] = {k: v for k, v in cfg.model.overrides.items() if k in fields}
    if new is ResNetConfig:
        for (section, key), off in VIT_ONLY_FIELDS.items():
            if key not in by_section.get(section, {}) and getattr(getattr(cfg, section), key) != off:
                by_section.setdefault(section, {})[key] = off
    return by_section


def get(cfg: TrainConfig, name: str) -> Any:
    """The value of ``section.field`` (or an old flat name)."""
    path = resolve_name(name)
    if path == "recipe":
        return cfg.recipe
    section, key = path.split(".", 1)
    return getattr(getattr(cfg, section), key)


# the type of the fields whose default is None, shown by an example value
OPTIONAL_TYPES = {"model.init": "", "model.img_size": 0, "data.source": "", "data.val_data": "",
                  "data.cache_dir": "", "optim.muon_adamw_lr": 0.0}


def parse_value(text: str, default: Any) -> Any:
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


MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}
# the architecture's fields, ``--set model.<field>=value``: a ViT's or a BiT ResNet's (their defaults give the type)
ARCHITECTURE_FIELDS = {f.name: f.default for cls in (ResNetConfig, ViTConfig) for f in dataclasses.fields(cls)}


def apply_overrides(cfg: TrainConfig, assignments: list[str] | tuple[str, ...]) -> TrainConfig:
    """``cfg`` with ``section.field=value`` strings applied (see ``parse_overrides``)."""
    return replace(cfg, parse_overrides(cfg, assignments))


def parse_overrides(cfg: TrainConfig, assignments: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``section.field=value`` strings (old flat names too) as ``replace``'s changes to
    ``cfg``; ``model.<ViTConfig or ResNetConfig field>=value`` changes the architecture
    (one entry of ``model.overrides``), ``model.overrides={}`` clears the recipe's.

    Values are Python literals (``0.1``, ``(0.9, 0.95)``, ``None``) or bare words
    (``cosine``); tuples also accept ``0.9,0.95``.  Nothing is checked but the names and
    the types: the changes are checked together, when ``replace`` builds the sections.
    """
    changes: dict[str, Any] = {}
    defaults = TrainConfig()
    for item in assignments:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected field=value")
        name, text = (s.strip() for s in item.split("=", 1))
        key = name[len("model."):] if name.startswith("model.") else None
        if key is not None and key not in MODEL_FIELDS:
            if key not in ARCHITECTURE_FIELDS:
                raise ConfigError(f"--set {name}: {key!r} is neither a model field ({', '.join(sorted(MODEL_FIELDS))})"
                                  f" nor a field of the architecture; ViTConfig's and ResNetConfig's: "
                                  f"{', '.join(ARCHITECTURE_FIELDS)}")
            # sizes: "16" and "16,16" both mean (16, 16), which the configs accept as an int or a pair
            default = None if key in ("img_size", "patch_size") else ARCHITECTURE_FIELDS[key]
            changes[f"model.{key}"] = parse_value(text, default)
            continue
        path = resolve_name(name)
        if path == "model.overrides":
            value = parse_value(text, None)
            if not isinstance(value, dict):
                raise ConfigError(f"--set {name}={text!r}: expected a dict such as {{}} (no overrides) or "
                                  "{'width': 256}; or set the fields one by one, --set model.<field>=value")
            changes[path] = value
            continue
        default = get(defaults, path)
        if default is None:  # optional fields: "none" clears them
            if text.strip().lower() in ("none", "null"):
                changes[path] = None
                continue
            default = OPTIONAL_TYPES[path]
        try:
            changes[path] = parse_value(text, default)
        except ValueError as err:
            raise ConfigError(f"{path}={text!r}: {err}") from None
    return changes


# ----------------------------------------------------------------------------- derived values


def vit_config(model: ModelConfig, num_classes: int | None = None, dynamic_img_size: bool = False) -> ViTConfig:
    """The ``ViTConfig`` (or, for ``BiT-*`` names, ``ResNetConfig``) a from-scratch model
    section builds (ConfigError names a bad field)."""
    from vitlab.config import replace as replace_model
    from vitlab.models.registry import get_config

    overrides = dict(model.overrides)
    new_name = overrides.pop("name", None)
    if model.img_size is not None:
        overrides["img_size"] = model.img_size
    if num_classes is not None:
        overrides["num_classes"] = num_classes
    bit = isinstance(get_config(model.name), ResNetConfig)
    if dynamic_img_size and not bit:
        overrides["dynamic_img_size"] = True
    model_cfg = get_config(model.name, **overrides)
    if new_name is not None:
        model_cfg = replace_model(model_cfg, name=new_name)
    if bit:  # the BiT baselines (paper Table 7)
        for field_name, value in (("model.pre_logits", model.pre_logits), ("model.mpp", model.mpp),
                                  ("data.progressive_sizes", dynamic_img_size)):
            if value:
                raise ConfigError(f"{field_name}={value!r}: a ViT feature; model.name={model.name!r} is a BiT "
                                  "ResNet (set it off: false / none / [])")
        return model_cfg
    if model.pre_logits and model.init is None:
        model_cfg = replace_model(model_cfg, representation_size=model_cfg.width)
    if not isinstance(model_cfg, ViTConfig):
        raise ConfigError(f"model.name={model.name!r}: the training engine trains ViTConfig and BiT ResNet models only")
    return model_cfg


def model_config(cfg: TrainConfig, num_classes: int | None = None) -> ViTConfig:
    """The ``ViTConfig`` this run trains from scratch."""
    return vit_config(cfg.model, num_classes, dynamic_img_size=bool(cfg.data.progressive_sizes))


def scaled_warmup(warmup: float, steps: int, recipe_steps: int) -> float:
    """The warm-up of a schedule of ``steps`` steps, given ``warmup`` for ``recipe_steps``.

    The rule: a fraction (< 1) is a fraction of any schedule; a count (>= 1) is the
    warm-up of ``recipe_steps`` steps and keeps its share of a shorter schedule, rounded
    and at least one step (the paper's 500 fine-tuning warm-up steps of 10,000 are 5 of
    100); a longer schedule keeps the count (the paper's 10k steps for any pre-training).
    """
    if warmup < 1 or steps >= recipe_steps:
        return warmup
    return max(1, int(round(warmup * steps / recipe_steps)))


def warmup_steps(optim: OptimConfig, total_steps: int) -> int:
    """``warmup`` as a step count in a schedule of ``total_steps`` steps (``scaled_warmup``:
    a fraction of it; a count scaled down with a schedule shorter than ``optim.steps``,
    as one fitted to ``run.time_limit``)."""
    if optim.warmup < 1:
        return int(round(optim.warmup * total_steps))
    return int(scaled_warmup(optim.warmup, total_steps, optim.steps))


def check_can_run(cfg: TrainConfig, world_size: int = 1, need_data: bool = True) -> None:
    """What the values alone cannot tell: the launch's process count, and that the data
    and the initial weights exist.  ``train`` calls it before any work; the CLI earlier."""
    per_process = cfg.optim.accum_steps * world_size
    if cfg.optim.batch_size % per_process:
        raise ConfigError(
            f"optim.batch_size={cfg.optim.batch_size} is not divisible by optim.accum_steps={cfg.optim.accum_steps}"
            f" x world_size={world_size} = {per_process}: every micro-batch must have the same size")
    if cfg.run.fsdp and world_size < 2:
        raise ConfigError("run.fsdp=True needs a distributed launch (torchrun --nproc_per_node=N); world_size is 1")
    if need_data:
        source = cfg.data.source
        if source is None:
            raise ConfigError("data.source=None: give a data path (--data PATH: an ImageFolder folder or "
                              f".tar/.tar.gz) or a built-in source ({', '.join(BUILTIN_DATA)})")
        for name, path in (("data.source", source), ("data.val_data", cfg.data.val_data)):
            if path is not None and path not in BUILTIN_DATA and not any(c in path for c in "{*?[") and \
                    not Path(path).expanduser().exists():
                raise ConfigError(f"{name}={path!r}: no such file or folder")
    if cfg.model.init is not None and not Path(cfg.model.init).expanduser().exists():
        from vitlab.weights.hub import parse_hub_name

        if parse_hub_name(cfg.model.init) is None:  # a Hub name is looked up when the weights are loaded
            raise ConfigError(f"model.init={cfg.model.init!r}: no such file or folder")


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
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"recipe {spec!r}: {err}") from None
    if not isinstance(cfg, TrainConfig):
        raise ConfigError(f"recipe {spec!r}: get_config() returned {type(cfg).__name__}, not TrainConfig")
    return cfg
