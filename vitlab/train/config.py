"""The training configuration: five sections of frozen dataclasses, checked as they are built.

    TrainConfig(recipe, model=ModelConfig(...), data=DataConfig(...), augment=AugmentConfig(...),
                optim=OptimConfig(...), run=RunConfig(...))

Every section checks its own values when it is built, and ``TrainConfig`` checks the
combinations across sections, so an impossible configuration raises ``ConfigError``
(naming the field, the value and what is allowed) before any data is read or any model
built.  Each field has one line here; docs/training.md ("Every field") explains them at
length.

What this module does not do lives beside it: the recipes and ``load_recipe`` in
``vitlab/configs/``; changing fields by name and the ``--set`` language in
``overrides.py``; the flat names of earlier versions in ``legacy.py``; the architecture a
model section builds in ``architecture.py``; what depends on the machine rather than on
the values (the process count, whether the data exists) in ``build.check_can_run``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from vitlab.config import (LOSSES, PRECISIONS, SIZE_FORMS, ConfigError, ViTConfig, is_int, is_number, is_shift,
                           need, need_bool, need_choice, need_count_or_fraction, need_int, need_number, parse_size)
from vitlab.data.transforms import Augmentation, TrainTransform
from vitlab.fast.fp8 import BLOCK_DENSE, FP8_BACKENDS, FP8_SCALINGS, check_fp8_layers
from vitlab.fast.kernels import GPU_ATTENTION
from vitlab.models.init import check_schemes
from vitlab.models.mpp import TARGETS as MPP_TARGETS
from vitlab.models.mpp import check_mpp
from vitlab.models.registry import canonical_name, list_models

from .architecture import model_architecture
from .legacy import LEGACY_NAMES, nested_dict

OPTIMIZERS = ("adam", "sgd", "muon")
DECAYS = ("cosine", "linear", "constant")
ON_NONFINITE = ("stop", "skip")
WD_SCOPES = ("kernels", "all")
STREAM_MODES = ("auto", "memory", "stream")
DEVICE_TYPES = ("cpu", "cuda")
# the model fields a fine-tune may change: its regularisation (the architecture is its init's)
FINETUNE_MODEL_FIELDS = ("dropout", "attention_dropout", "drop_path", "patch_dropout")
# what resolve decides before a device's settings (run.on_device) are applied: set there, they were dropped
BEFORE_ON_DEVICE = ("run.device", "run.on_device", "run.precision", "run.threads", "data.decode_workers")
MAX_SEED = 2**32 - 1  # run.seed: numpy's global generator (np.random.seed) takes 32 bits
FP8_MODES = ("off", *FP8_SCALINGS)  # run.fp8: off, or one of vitlab.fast.fp8's scalings
# ModelConfig's initialisations of a model trained from scratch: the official one first
FROM_SCRATCH_INITS = {"patch_init": ("lecun", "whiten"), "attn_init": ("xavier", "mimetic"),
                      "posemb_init": ("normal", "sincos")}


class Section:
    """A config section: ``prefix.field`` names its fields in errors; bools are checked for all."""

    prefix = ""

    def path(self, field_name: str) -> str:
        return f"{self.prefix}.{field_name}" if self.prefix else field_name

    def need_default_unless(self, name: str, read: bool, why: str, instead: str = "") -> None:
        """Refuse ``name`` changed from its default where this config does not ``read`` it: it was
        accepted and did nothing.  The default is allowed, as every config has the field."""
        default = next(f.default for f in dataclasses.fields(self) if f.name == name)
        value = getattr(self, name)
        need(value == default or read, self.path(name), value,
             f"{why}; {instead + ', or ' if instead else ''}leave it at {default}")

    def check_bools(self) -> None:
        for f in dataclasses.fields(self):  # a recipe's "no" would otherwise read as true
            if isinstance(f.default, bool):
                need_bool(self.path(f.name), getattr(self, f.name))


def is_path(value: Any) -> bool:
    """A path given as text, not empty: ``Path("")`` is the working folder."""
    return isinstance(value, str) and value.strip() != ""


def check_lr_grid(grid: Any, name: str = "optim.lr_grid") -> None:
    """Positive learning rates, each once: a sweep's run of a rate is its folder ``lr_<rate>``, so a
    rate given twice (0.1,0.10) met its own finished run and was refused after the first one."""
    need(isinstance(grid, tuple) and all(is_number(v) and v > 0 for v in grid), name, grid,
         "expected positive learning rates, e.g. 0.001,0.003,0.01")
    # compared as the folder names spell them: 0.001 and 0.0010000001 are both lr_0.001, and the second
    # was scored as (with --resume) the first's finished run
    named = [f"{v:g}" for v in grid]
    twice = sorted({n for n in named if named.count(n) > 1}, key=float)
    need(not twice, name, grid, f"{', '.join(twice)} given more than once; each rate is one run")


def image_size_field(value: Any, name: str = "model.img_size") -> int | tuple[int, int]:
    """``model.img_size`` (or ``model.weights_img_size``, ``name``) as the config holds it: N, or (H, W) where
    the sides differ; given as an int, a pair (a recipe's tuple, a config file's list) or text, as --img-size
    takes it ("16x24")."""
    size = parse_size(value) if isinstance(value, str) else value
    pair = isinstance(size, (tuple, list)) and len(size) == 2 and all(is_int(v) and v >= 1 for v in size)
    auto = ', "auto" (a fine-tune: scaled from its init)' if name == "model.img_size" else ""
    need(pair or (is_int(size) and size >= 1), name, value, f"expected {SIZE_FORMS}{auto} or None")
    return size if is_int(size) else (size[0] if size[0] == size[1] else (size[0], size[1]))


@dataclass(frozen=True)
class ModelConfig(Section):
    """What is trained: a registry model, changed by ``overrides``, from scratch or from ``init``."""

    prefix = "model"
    name: Optional[str] = "ViT-B/16"        # a registry entry (`vitlab models`); a fine-tune's: its init's model,
                                            # None where that has no name
    overrides: dict = field(default_factory=dict)  # ViTConfig/ResNetConfig fields to change; "name" renames
    init: Optional[str] = None              # weights to fine-tune from (a file, folder or Hub name); None: scratch
    weights_img_size: Optional[int | tuple] = None  # with init: the resolution it was trained at, N or (H, W), where
                                            # its weights do not record it (None: theirs, else a square grid)
    keep_pre_logits: bool = False           # with init: keep its pre-logits layer (the paper removes it, Sec. 3.2)
    pre_logits: bool = False                # from scratch: a pre-logits layer in the head (Sec. 3.1)
    img_size: Optional[int | tuple | str] = None  # training resolution, N or (H, W) (None: the model's or init's;
                                            # "auto": the paper's fine-tuning rule, resolve.finetune_size); init's
                                            # posembs interpolated
    mpp: Optional[str] = None               # masked patch prediction's target (Sec. 4.6); None trains the classifier
    mpp_rate: float = 0.5                   # the fraction of each image's patches corrupted
    patch_init: str = "lecun"               # "lecun" (official) or "whiten" (the data's patches; not in the paper)
    attn_init: str = "xavier"               # "xavier" (official) or "mimetic" (not in the paper)
    posemb_init: str = "normal"             # "normal" (official) or "sincos" (big_vision's table; not in the paper)
    head_bias_init: Optional[float] = None  # the head's bias at the start, under optim.loss="sigmoid_xent"; None:
                                            # -ln K from scratch (big_vision's init_head_bias), 0 for a fine-tune

    def __post_init__(self) -> None:
        self.check_bools()
        # a fine-tune records its init's model, which may have no name (a ViTConfig of its own)
        need(isinstance(self.name, str) or (self.name is None and self.init is not None), "model.name", self.name,
             "expected a registry name, e.g. ViT-B/16")
        need(self.mpp is None or self.mpp in MPP_TARGETS, "model.mpp", self.mpp,
             f"expected None or one of {', '.join(MPP_TARGETS)}")
        need(is_number(self.mpp_rate) and 0 < self.mpp_rate <= 1, "model.mpp_rate", self.mpp_rate,
             "must be a fraction in (0, 1]")
        # read by masked patch prediction only: without model.mpp a changed rate was accepted and did nothing
        self.need_default_unless("mpp_rate", self.mpp is not None, "the fraction of patches masked patch prediction "
                                 "corrupts, and model.mpp=None trains the classifier", instead="set model.mpp")
        for name, allowed in FROM_SCRATCH_INITS.items():
            value = getattr(self, name)
            need(value in allowed, f"model.{name}", value, f"expected one of {', '.join(allowed)}")
            need(value == allowed[0] or self.init is None, f"model.{name}", value,
                 f"{value!r} initialises a model trained from scratch; with model.init the weights are loaded")
        need(self.head_bias_init is None or is_number(self.head_bias_init), "model.head_bias_init",
             self.head_bias_init, "expected a number, or None (-ln K from scratch under optim.loss='sigmoid_xent')")
        self.need_default_unless("head_bias_init", self.mpp is None, "the classifier head's bias at the start, and "
                                 f"masked patch prediction (model.mpp={self.mpp!r}) trains no classifier")
        # only loading model.init reads it: from scratch keep_pre_logits=true was accepted and did nothing
        need(not self.keep_pre_logits or self.init is not None, "model.keep_pre_logits", self.keep_pre_logits,
             "keeps model.init's pre-logits layer, and this model is trained from scratch (model.init=None); "
             "a pre-logits layer of its own is model.pre_logits")
        # and only a model built from scratch reads pre_logits: with model.init it was accepted and did nothing
        need(not self.pre_logits or self.init is None, "model.pre_logits", self.pre_logits,
             "adds a pre-logits layer to a model trained from scratch, and this one is fine-tuned from model.init, "
             "whose architecture it keeps; model.keep_pre_logits keeps the init's own")
        need(isinstance(self.overrides, dict) and all(isinstance(k, str) for k in self.overrides), "model.overrides",
             self.overrides, "expected a dict of ViTConfig fields by name")
        # the data decides these: the head was made for its classes whatever the field said, and the images are RGB
        need("num_classes" not in self.overrides, "model.num_classes", self.overrides.get("num_classes"),
             "the head has one output per class of the data (data.source, data.class_subset); leave it out")
        need(self.overrides.get("in_chans", 3) == 3, "model.in_chans", self.overrides.get("in_chans"),
             "the training images are decoded to 3 channels (RGB); leave it at 3")
        need(self.init is None or is_path(self.init), "model.init", self.init,
             "expected a path or None; an empty one would be the working folder")
        if self.img_size not in (None, "auto"):
            object.__setattr__(self, "img_size", image_size_field(self.img_size))
        if self.weights_img_size is not None:
            object.__setattr__(self, "weights_img_size",
                               image_size_field(self.weights_img_size, "model.weights_img_size"))
        # only loading model.init reads it: from scratch it was accepted and did nothing
        self.need_default_unless("weights_img_size", self.init is not None, "the resolution model.init's weights were "
                                 "trained at, and this model is trained from scratch (model.init=None)")
        if self.init is None:  # with init the checkpoint's own config is checked when it is loaded
            try:  # unknown model, bad model field, img_size not divisible by the patch size
                arch = model_architecture(self)
            except ConfigError as err:
                if canonical_name(self.name) not in list_models():
                    raise ConfigError(f"model.name={self.name!r}: {err}") from None
                # a recipe's overrides may rename the model (the demo's ViT-demo/4 is ViT-Ti/16's changed)
                built = f"{self.overrides['name']!r}: " if isinstance(self.overrides.get("name"), str) else ""
                raise ConfigError(f"model ({built}model.name={self.name!r} with model.overrides, model.img_size): "
                                  f"{err}") from None
            # what MPP and the initialisations need of the model: the built model was refused after the data was read
            if self.mpp is not None and isinstance(arch, ViTConfig):  # a BiT ResNet's mpp is refused above
                check_mpp(arch, self.mpp, name="model.mpp", prefix="model.")
                # MPP's head reads the encoder's patch tokens: a pre-logits layer was built, never trained, and saved
                name, value = (("model.pre_logits", True) if self.pre_logits
                               else ("model.representation_size", arch.representation_size))
                need(arch.representation_size is None, name, value, "a pre-logits layer is the classifier head's, and "
                     f"masked patch prediction (model.mpp={self.mpp!r}) predicts from the patch tokens, so it would "
                     "be saved untrained; leave it out")
            check_schemes(arch, self.patch_init, self.attn_init, self.posemb_init)


@dataclass(frozen=True)
class DataConfig(Section):
    """Where the examples come from, how they are split, decoded and streamed."""

    prefix = "data"
    source: Optional[str] = None            # a folder, archive, shards, HF dataset, parquet, or "digits"
    val_split: float = 0.0                  # held-out validation: a count (>= 1) or a fraction (< 1); 0: none
    val_data: Optional[str] = None          # a separate validation set instead of a held-out split
    split_seed: int = 0                     # seed of the split (and, plus one, of train_examples' sample)
    train_examples: int = 0                 # use only this many examples (class-stratified; 0: all)
    class_subset: tuple = ()                # train on these class names only, labels renumbered in this order
    decode_workers: int | str = "auto"      # processes decoding into the in-memory cache
    cache_dir: Optional[str] = None         # where decoded sets are cached (None: ~/.cache/vitlab)
    progressive_sizes: tuple = ()           # ((size, until), ...): smaller images until that fraction of the steps
    stream: str = "auto"                    # "memory", "stream" (from disk, in DataLoader workers) or "auto"
    stream_workers: int | str = "auto"      # DataLoader workers per training process when streaming
    shuffle_buffer: int = 1000              # samples each streaming worker holds for shuffling (0: in order)
    memory_limit_gb: float = 8.0            # the decoded size above which "auto" streams a folder
    draft: bool = True                      # streaming: decode a JPEG at 1/2, 1/4 or 1/8 scale when that suffices
    augment_batches: int = 1                # in memory: batches augmented in one call (a GPU's launches per batch / k)

    def __post_init__(self) -> None:
        self.check_bools()
        need_choice("data.stream", self.stream, STREAM_MODES)
        for name in ("stream_workers", "decode_workers"):
            value = getattr(self, name)
            need(value == "auto" or (is_int(value) and value >= 0), self.path(name), value,
                 'expected "auto" or an integer >= 0')
        for name in ("shuffle_buffer", "split_seed", "train_examples"):
            need_int(self.path(name), getattr(self, name), 0)
        need_int("data.augment_batches", self.augment_batches, 1)
        need(is_number(self.memory_limit_gb) and self.memory_limit_gb > 0, "data.memory_limit_gb",
             self.memory_limit_gb, "expected a positive number of GB")
        for name in ("source", "val_data", "cache_dir"):  # "" (--data "$UNSET") read the working folder
            need(getattr(self, name) is None or is_path(getattr(self, name)), self.path(name),
                 getattr(self, name), "expected a path or None; an empty one would be the working folder")
        need_count_or_fraction("data.val_split", self.val_split,
                               "a count (integer >= 1), a fraction in (0, 1), or 0 for none")
        need(not (self.val_data and self.val_split), "data.val_data", self.val_data,
             f"a validation set of its own, so data.val_split={self.val_split!r} must be 0 (one validation set)")
        need(isinstance(self.class_subset, tuple) and all(isinstance(c, str) for c in self.class_subset),
             "data.class_subset", self.class_subset, "expected a tuple of class names")
        phases = self.progressive_sizes
        need(isinstance(phases, (tuple, list)) and all(
            isinstance(p, (tuple, list)) and len(p) == 2 and is_int(p[0]) and p[0] > 0 and is_number(p[1])
            and 0 < p[1] <= 1 for p in phases) and all(a[1] < b[1] for a, b in zip(phases, phases[1:])),
            "data.progressive_sizes", phases, "expected ((size, until), ...): sizes in pixels, the fractions "
            "until in (0, 1] rising, e.g. [[24, 0.5]]")


@dataclass(frozen=True)
class AugmentConfig(Section, Augmentation):
    """Training augmentation: ``vitlab.data.transforms.Augmentation``'s fields and checks."""

    prefix = "augment"
    refuses_unread = False  # TrainConfig's check, over the forms of run.on_device too

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except ConfigError as err:
            raise ConfigError(f"augment.{err}") from None

    def transform(self, num_classes: int, image_size: tuple) -> TrainTransform:
        # a setting this form does not read (a recipe's GPU setting on a CPU run) at its default: it does nothing
        fields = dataclasses.asdict(self) | {name: Augmentation.__dataclass_fields__[name].default
                                             for name in self.unread_settings()}
        return TrainTransform(num_classes=num_classes, image_size=image_size, **fields)


@dataclass(frozen=True)
class OptimConfig(Section):
    """The optimiser and its schedule.  Sizes are global (over all processes)."""

    prefix = "optim"
    optimizer: str = "adam"                 # "adam" (AdamW, Table 3), "sgd" (Table 4), "muon" (not in the paper)
    lr: float = 1e-3                        # the peak of the schedule
    lr_grid: tuple = ()                     # the learning rates `vitlab sweep` tries (Table 4)
    betas: tuple = (0.9, 0.999)             # Adam's (beta1, beta2)
    momentum: float = 0.9                   # SGD's momentum
    muon_momentum: float = 0.95             # Muon's Nesterov momentum
    muon_adamw_lr: Optional[float] = None   # Muon: the peak lr of the AdamW part (None: lr)
    weight_decay: float = 0.0               # AdamW semantics: each step multiplies by (1 - lr_t * weight_decay)
    wd_scope: str = "kernels"               # "kernels": weight matrices and conv kernels decay (official); "all"
    batch_size: int = 512                   # global batch per optimiser step
    accum_steps: int | str = 1              # micro-batches per step (gradient accumulation); "auto": fewest that fit
    steps: int = 1000                       # optimiser steps; a ceiling under run.time_limit
    warmup: float = 0                       # linear warm-up: a fraction of the steps (< 1) or a step count
    decay: str = "cosine"                   # "cosine", "linear" or "constant" after the warm-up
    min_lr: float = 0.0                     # where the decay ends
    clip_norm: float = 1.0                  # clip the global gradient norm to this (0: off)
    loss: str = "softmax_xent"              # or "sigmoid_xent" (the official multi-label pre-training loss)
    ema_decay: float = 0.0                  # Polyak averaging of the weights (Sec. 4.1: 0.9999); 0: off

    def __post_init__(self) -> None:
        self.check_bools()
        for name, allowed in (("optimizer", OPTIMIZERS), ("decay", DECAYS), ("loss", LOSSES), ("wd_scope", WD_SCOPES)):
            need_choice(self.path(name), getattr(self, name), allowed)
        for name in ("batch_size", "steps"):
            need_int(self.path(name), getattr(self, name), 1)
        need(self.accum_steps == "auto" or (is_int(self.accum_steps) and self.accum_steps >= 1), "optim.accum_steps",
             self.accum_steps, 'expected a positive integer, or "auto" (the fewest micro-batches that fit in memory)')
        for name in ("lr", "min_lr", "weight_decay", "clip_norm"):
            need_number(self.path(name), getattr(self, name))
        need(self.lr > 0, "optim.lr", self.lr, "must be > 0")
        need(self.muon_adamw_lr is None or (is_number(self.muon_adamw_lr) and self.muon_adamw_lr > 0),
             "optim.muon_adamw_lr", self.muon_adamw_lr, "must be None (the lr) or > 0")
        need(self.muon_adamw_lr is None or self.optimizer == "muon", "optim.muon_adamw_lr", self.muon_adamw_lr,
             f"applies to optim.optimizer='muon' only (here {self.optimizer!r}); leave it None")
        # another optimiser's setting changed from its default was accepted and never read (Adam has no momentum)
        for name, owners in (("momentum", ("sgd",)), ("betas", ("adam", "muon")), ("muon_momentum", ("muon",))):
            self.need_default_unless(name, self.optimizer in owners, f"applies to optim.optimizer="
                                     f"{' or '.join(map(repr, owners))} only (here {self.optimizer!r})")
        need(self.min_lr <= self.lr, "optim.min_lr", self.min_lr, f"must not exceed optim.lr={self.lr}")
        # a constant schedule keeps the peak: a changed end was accepted and never reached
        self.need_default_unless("min_lr", self.decay != "constant", "where the decay ends, and optim.decay='constant' "
                                 "keeps optim.lr to the last step", instead="set optim.decay to 'cosine' or 'linear'")
        for name in ("momentum", "muon_momentum", "ema_decay"):
            need_number(self.path(name), getattr(self, name), 0.0, below=1.0)
        check_lr_grid(self.lr_grid)
        need(isinstance(self.betas, tuple) and len(self.betas) == 2 and all(is_number(b) and 0 <= b < 1
                                                                            for b in self.betas),
             "optim.betas", self.betas, "expected two numbers in [0, 1), e.g. 0.9,0.999")
        need_count_or_fraction("optim.warmup", self.warmup, "a step count (integer >= 1) or a fraction of the steps "
                                                            "in [0, 1)")
        need(self.warmup < 1 or self.warmup <= self.steps, "optim.warmup", self.warmup,
             f"exceeds optim.steps={self.steps}")
        if self.accum_steps != "auto" and self.batch_size % self.accum_steps:
            raise ConfigError(f"optim.batch_size={self.batch_size} is not divisible by optim.accum_steps="
                              f"{self.accum_steps}: every micro-batch must have the same size")


@dataclass(frozen=True)
class RunConfig(Section):
    """How the run executes, evaluates, logs and saves."""

    prefix = "run"
    precision: str = "fp32"                 # "fp32", "bf16", "fp16" (with a gradient scaler) or "auto"
    fp8: str = "off"                        # "tensorwise" or "rowwise": the blocks' dense layers in fp8 (GPUs of
                                            # compute capability 8.9+, under bf16; vitlab.fast.fp8); "off"
    fp8_layers: tuple = BLOCK_DENSE         # which of each block's dense layers run.fp8 puts in fp8 (the rest bf16)
    fp8_backend: str = "vitlab"             # whose arithmetic computes them: vitlab's own, or "torchao" (its float8
                                            # training recipe of the same name; the fp8 extra)
    gpu_attention: str = "torch"            # a GPU's fused attention: PyTorch's own order of backends ("torch"), or
                                            # cuDNN's first ("cudnn"; vitlab.fast.kernels.attention_backends)
    loss_scale: float = 65536.0             # fp16: the gradient scaler's first loss scale
    on_nonfinite: str = "stop"              # a NaN/inf step is never applied: "stop" the run, or "skip" it
    max_skipped_steps: int = 10             # with "skip": stop all the same after more skipped steps than this
    compile: bool = False                   # torch.compile the model
    compile_autotune: bool = False          # a GPU's compilation in inductor's max-autotune: Triton matmul templates
                                            # timed against cuBLAS for each shape, element-wise work fused into the
                                            # winner (minutes more compilation; check_autotune)
    compile_optimizer: bool | str = "auto"  # compile what follows the backward (clipping, the optimiser, EMA)
                                            # into one graph; "auto": where the model is CUDA-graphed
    fsdp: bool = False                      # shard the model with FSDP (multi-process runs)
    fast: bool = True                       # vitlab.fast.optimize the model (the saved weights are the same)
    seed: int = 0                           # initialisation, dropout, data order and augmentation
    device: str = "auto"                    # "auto", "cpu", "cuda", "cuda:1", ...
    on_device: dict = field(default_factory=dict)  # a recipe's changes for a kind of device it resolves to:
                                            # {"cuda": {"optim.batch_size": 256, ...}} (applied once, by resolve)
    threads: int = 0                        # CPU threads of this process (0: PyTorch's default, at most its cores)
    retain_freed_memory: bool = False       # CPU: malloc keeps freed memory for the next step (process-wide)
    memory_check: bool = True               # refuse a run whose estimated peak memory exceeds what is available
    time_limit: float = 0.0                 # minutes of wall time for the whole run (0: no limit)
    time_measure_steps: int = 10            # steps timed before the schedule is fitted to time_limit
    eval_every: int = 0                     # evaluate every this many steps (0: at the end only)
    eval_batch_size: int = 256              # the evaluation's batch size
    eval_flip: bool = False                 # score each image with its mirror image (twice the cost)
    final_eval_shift: int | tuple = 0       # the final evaluation also averages four shifts by this many pixels
                                            # (several sizes: a list, e.g. [2, 1])
    final_eval_diagonal: bool = False       # ... and four more per size, along both axes at once
    log_every: int = 10                     # steps between metric records
    tensorboard: bool = True                # also write TensorBoard events (when installed)
    ckpt_every: int = 0                     # steps between checkpoints (0: at the end only)
    keep_ckpts: int = 2                     # checkpoints kept; with 2 or more a damaged newest one is passed over
    out: str = "runs/train"                 # the run's folder: metrics, checkpoints, weights

    def __post_init__(self) -> None:
        self.check_bools()
        need_choice("run.precision", self.precision, ("auto", *PRECISIONS))
        need_choice("run.fp8", self.fp8, FP8_MODES)
        check_fp8_layers(self.fp8_layers, "run.fp8_layers")
        need_choice("run.fp8_backend", self.fp8_backend, FP8_BACKENDS)
        need_choice("run.gpu_attention", self.gpu_attention, GPU_ATTENTION)
        need(self.fp8 == "off" or self.precision in ("bf16", "auto"), "run.fp8", self.fp8,
             f"fp8 matmuls run inside bf16 autocast: set run.precision to 'bf16' or 'auto' (here {self.precision!r}), "
             "or run.fp8='off'")
        need_choice("run.on_nonfinite", self.on_nonfinite, ON_NONFINITE)
        need(self.compile_optimizer == "auto" or isinstance(self.compile_optimizer, bool), "run.compile_optimizer",
             self.compile_optimizer, 'expected "auto", True or False')
        for name, value, clash, why in (
                ("run.precision", self.precision, "fp16", "fp16's gradient scaler works on the host around the step"),
                ("run.fsdp", self.fsdp, True, "FSDP's gradients and parameters are shards")):
            need(self.compile_optimizer is not True or value != clash, "run.compile_optimizer", True,
                 f"not with {name}={clash!r} ({why}): set run.compile_optimizer to 'auto' or False")
        need(is_number(self.loss_scale) and self.loss_scale > 0, "run.loss_scale", self.loss_scale,
             "must be a number > 0, e.g. 65536")
        for name in ("eval_batch_size", "log_every", "keep_ckpts", "time_measure_steps"):
            need_int(self.path(name), getattr(self, name), 1)
        for name in ("seed", "threads", "eval_every", "ckpt_every", "max_skipped_steps"):
            need_int(self.path(name), getattr(self, name), 0)
        shift = self.final_eval_shift
        need(is_shift(shift), "run.final_eval_shift", shift,
             "expected pixels: an integer >= 0, or distinct integers > 0, e.g. [2, 1]")
        need(not self.final_eval_diagonal or shift, "run.final_eval_diagonal", True,
             "adds diagonal translations of run.final_eval_shift's sizes: set run.final_eval_shift too")
        # the seed also seeds numpy's global generator, which takes 32 bits (beyond them the run would fail
        # at its start with numpy's or torch's own overflow message, which names no field)
        need(self.seed <= MAX_SEED, "run.seed", self.seed, f"must be an integer in [0, 2**32 - 1 = {MAX_SEED}]")
        need_number("run.time_limit", self.time_limit)
        # read only with "skip": a changed one was accepted and did nothing
        self.need_default_unless("max_skipped_steps", self.on_nonfinite == "skip", "bounds the steps "
                                 "run.on_nonfinite='skip' leaves out, and this run stops at the first "
                                 f"(run.on_nonfinite={self.on_nonfinite!r})")
        # read only to fit the schedule to a time limit: without one a changed count was accepted and did nothing
        self.need_default_unless("time_measure_steps", self.time_limit > 0, "the steps timed to fit the schedule to "
                                 "run.time_limit, and this run has no time limit (0)", instead="set run.time_limit")
        need(isinstance(self.out, str) and self.out != "", "run.out", self.out, "expected a folder")
        need(isinstance(self.on_device, dict) and set(self.on_device) <= set(DEVICE_TYPES)
             and all(isinstance(changes, dict) for changes in self.on_device.values()), "run.on_device",
             self.on_device, f"expected {{device type: {{field: value}}}}, device types {', '.join(DEVICE_TYPES)}")
        for kind, changes in self.on_device.items():
            early = [n for n in changes if LEGACY_NAMES.get(n, n) in BEFORE_ON_DEVICE]
            need(not early, "run.on_device", self.on_device,
                 f"{', '.join(early)} for {kind}: decided before a device's settings apply (the device "
                 "chooses them), so a run kept its own; set them for every device, or with --set")
        # read by an fp16 run's gradient scaler alone: under another precision a changed scale was accepted and
        # did nothing (no recipe's device form changes the precision: BEFORE_ON_DEVICE)
        self.need_default_unless("loss_scale", self.precision == "fp16", "the first loss scale of an fp16 run's "
                                 f"gradient scaler, and run.precision={self.precision!r} scales no loss",
                                 instead="set run.precision to 'fp16'")
        # and these by fp8 matmuls alone (run.fp8 here, or in a device's form of the run): else they did nothing
        fp8 = self.fp8 != "off" or any(changes.get("run.fp8", "off") != "off" for changes in self.on_device.values())
        for name, what in (("fp8_layers", "which dense layers of each block run.fp8 puts in fp8"),
                           ("fp8_backend", "whose arithmetic computes run.fp8's matmuls")):
            self.need_default_unless(name, fp8, f"{what}, and this run has no fp8 matmuls (run.fp8='off')",
                                     instead="set run.fp8 (--fp8)")


# the run fields only the evaluations of held-out images read (build's Evaluator; check_eval_changes_read)
EVAL_FIELDS = ("eval_every", "eval_batch_size", "eval_flip", "final_eval_shift", "final_eval_diagonal")
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
        self.check_augment_settings_read()
        if self.model.mpp is not None:  # its own loss, on each corrupted patch: the classifier's settings did nothing
            for name, value, default in (("optim.loss", self.optim.loss, "softmax_xent"),
                                         ("augment.label_smoothing", self.augment.label_smoothing, 0.0)):
                need(value == default, name, value, f"a classifier's loss setting, and masked patch prediction "
                     f"(model.mpp={self.model.mpp!r}) trains no classifier: its loss is its own; leave it at "
                     f"{default!r}")
        # softmax's probabilities are the same with any bias added to every class (and so are its gradients)
        need(self.model.head_bias_init is None or self.optim.loss == "sigmoid_xent", "model.head_bias_init",
             self.model.head_bias_init, "starts the head's sigmoid probabilities (optim.loss='sigmoid_xent'), and "
             f"under optim.loss={self.optim.loss!r} the softmax is the same with any bias added to every class; "
             "leave it None")
        if self.run.fsdp and self.run.precision == "fp16":
            raise ConfigError("run.precision='fp16' with run.fsdp=True: the gradient scaler of a sharded model is not "
                              "implemented; use 'bf16'")

    def augment_forms(self) -> list[AugmentConfig]:
        """The augmentation this config trains with, then each device's form of it (``run.on_device``)."""
        return [self.augment] + [
            dataclasses.replace(self.augment, **{k.split(".", 1)[1]: v for k, v in changes.items()
                                                 if k.startswith("augment.")})
            for changes in self.run.on_device.values()]

    def check_augment_settings_read(self) -> None:
        """Refuse an augmentation setting that neither this config nor a device's form of it
        (``run.on_device``) reads: a recipe's GPU form may turn on the method that reads it (the
        CIFAR recipe's mixup and CutMix), where a check of this form alone refused it."""
        forms = self.augment_forms()
        unread = self.augment.unread_settings()
        for form in forms[1:]:
            unread = {name: why for name, why in unread.items() if name in form.unread_settings()}
        for name, why in unread.items():
            need(False, f"augment.{name}", getattr(self.augment, name), why)

    def check_eval_changes_read(self, recipe: TrainConfig, named: set[str] | dict) -> None:
        """Refuse an evaluation setting (``EVAL_FIELDS``; ``named``: the run fields changed) set to a value
        neither ``recipe`` (a device's form of it too) nor the field's default has, on a run that scores
        nothing: without held-out images (data.val_split=0, no data.val_data), or under masked patch
        prediction, it was accepted and did nothing.  The recipe's own values are not refused: vtab1k's
        final run holds nothing out and keeps the eval_every of its other runs."""
        if self.model.mpp is not None:
            why, instead = f"masked patch prediction (model.mpp={self.model.mpp!r}) trains no classifier to score", ""
        elif not (self.data.val_split or self.data.val_data):
            why = "this run holds no images out to score (data.val_split=0, data.val_data=None)"
            instead = "set data.val_split (--val-split) or data.val_data (--val-data), or "
        else:
            return
        for name in EVAL_FIELDS:
            value, default = getattr(self.run, name), RunConfig.__dataclass_fields__[name].default
            allowed = [default, getattr(recipe.run, name)] + [changes[f"run.{name}"] for changes in
                                                              recipe.run.on_device.values() if f"run.{name}" in changes]
            if name in named and value not in allowed:
                need(False, f"run.{name}", value, f"read by the evaluations of the held-out images, and {why}; "
                     f"{instead}leave it at {getattr(recipe.run, name)!r}")

    def check_augment_changes_read(self, recipe: TrainConfig, named: set[str] | dict) -> None:
        """Refuse ``augment.crop_pad`` or ``augment.randaug_magnitude`` (``named``: the augment fields
        changed) set to a value no form of ``recipe`` has, where no form of this config reads it:
        with another crop, or RandAugment off, it was accepted and did nothing.  A value of the
        recipe's (a device's form's too: the run applies it) is not refused, read or not."""
        for name in Augmentation.UNREAD_AGAINST_RECIPE:
            value = getattr(self.augment, name)
            if name not in named or value in {getattr(form, name) for form in recipe.augment_forms()}:
                continue
            if not any(form.settings_read()[name][0] for form in self.augment_forms()):
                why, recipes = self.augment.settings_read()[name][1], getattr(recipe.augment, name)
                need(False, f"augment.{name}", value, f"{why}, or leave it at the recipe's {recipes}")


# what a run's config.json records beside its config (resolve.Resolved, memory_estimate.MemoryEstimate)
RECORDS = ("resolved", "memory_estimate")


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
    """A ``TrainConfig`` from ``to_dict``'s output, or from an old flat config (``legacy.py``)."""
    nested = nested_dict(d)
    unknown = [k for k in nested if k not in SECTIONS and k not in ("recipe",) + RECORDS]
    for name, cls in SECTIONS.items():
        known = {f.name for f in dataclasses.fields(cls)}
        unknown += [f"{name}.{k}" for k in nested.get(name, {}) if k not in known]
    if unknown:
        raise ConfigError(f"unknown TrainConfig field(s) {', '.join(sorted(unknown))}")
    sections = {name: cls(**_tuples(nested.get(name, {}))) for name, cls in SECTIONS.items()}
    return TrainConfig(recipe=nested.get("recipe", "custom"), **sections)
