"""Everything a run builds once, before its first step: ``build(cfg) -> Setup``; what its "auto"
settings come to is decided before, once, by ``resolve.resolve``."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from vitlab import fast
from vitlab.config import ConfigError, need, need_output_folder
from vitlab.data.loader import Batches
from vitlab.data.transforms import check_crop_pad
from vitlab.eval.evaluator import Evaluator
from vitlab.eval.features import check_tta_shift
from vitlab.machine import Machine
from vitlab.models.init import mimetic_attention_init_, sincos_posemb_init_, whiten_patches_

from . import checkpoint as ckpt
from .architecture import architecture
from .config import FINETUNE_MODEL_FIELDS, TrainConfig
from .distributed import World, init_world, local_rank, wrap_model
from .ema import EMA
from .inputs import Splits, build_splits, stream_splits, whitening_sample
from .numerics import make_scaler
from .optim import build_optimizer
from .resolve import (Resolved, check_init_named, init_architecture, load_init, resolve, resolve_device,
                      this_machine)
from .state import process_state, rank_seed, rng_state, set_process_state
from .step import HeldGradients, Update

BUILTIN_DATA = ("digits",)  # data sources that need no path (see vitlab/data/digits.py)


@dataclass
class Setup:
    """Everything the loop needs, built once."""

    cfg: TrainConfig          # as resolved: every "auto" stated
    world: World
    splits: Splits
    model: nn.Module          # the bare model (what is saved)
    trained: nn.Module        # what the loop calls: DDP/FSDP/compiled around ``model``
    optimizer: torch.optim.Optimizer
    ema: EMA | None
    stream: Batches           # the micro-batches: a BatchStream in memory, a StreamLoader streamed
    evaluator: Evaluator | None        # the periodic evaluations (None: no validation split)
    final_evaluator: Evaluator | None  # the last one, with ``run.final_eval_shift``'s (and diagonal's) views
    micro_batch: int
    img_size: tuple           # (H, W) the run evaluates at and, after any progressive_sizes, trains at
    resolved: Resolved        # the "auto" settings as decided for this run
    rng: dict                 # the random state the steps start from (state.rng_state)
    update: Update            # what follows the backward: clipping, the optimiser, the EMA (eager or compiled)
    scaler: torch.amp.GradScaler | None = None  # fp16's gradient scaler (numerics.make_scaler)
    fp8: fast.Fp8Swap | None = None  # the dense layers run.fp8 put in fp8 (None: off)
    held_gradients: HeldGradients | None = None  # the gradients out of a CUDA graph's memory (step.HeldGradients)

    @property
    def precision(self) -> str:
        return self.resolved.precision

    @property
    def memory(self):
        """The peak memory estimated before the run was built (``memory_estimate.MemoryEstimate``)."""
        return self.resolved.memory

    @property
    def evaluated(self) -> nn.Module:
        """What the evaluators score: the weight average if on (under FSDP the sharded model)."""
        return self.ema.module if self.ema else self.model


def check_can_run(cfg: TrainConfig, world_size: int = 1, need_data: bool = True) -> None:
    """What the values alone cannot tell: the launch's process count, and that the data
    and the initial weights exist.  ``build`` calls it before any work; the CLI earlier."""
    # every process needs whole micro-batches (an accumulation left to resolve is one that divides)
    per_process = (cfg.optim.accum_steps if isinstance(cfg.optim.accum_steps, int) else 1) * world_size
    if cfg.optim.batch_size % per_process:
        raise ConfigError(
            f"optim.batch_size={cfg.optim.batch_size} is not divisible by optim.accum_steps={cfg.optim.accum_steps}"
            f" x world_size={world_size} = {per_process}: every micro-batch must have the same size")
    if cfg.run.fsdp and world_size < 2:
        raise ConfigError("run.fsdp=True needs a distributed launch (torchrun --nproc_per_node=N); world_size is 1")
    if isinstance(cfg.optim.accum_steps, int):  # "auto": checked once resolve has decided it
        check_mixing(cfg, cfg.optim.batch_size // per_process, world_size)
    if need_data:
        check_data(cfg)
    need_output_folder("run.out", cfg.run.out)
    if need_data:
        check_out_outside_data(cfg)
    if cfg.model.init is not None and not Path(cfg.model.init).expanduser().exists():
        check_init_named(cfg.model.init, held_checkpoints=ckpt.latest_checkpoint(Path(cfg.run.out) / "checkpoints")
                         is not None)
    elif cfg.model.init is not None:
        check_init_kept(cfg)
        check_pre_logits_kept(cfg)


def check_pre_logits_kept(cfg: TrainConfig) -> None:
    """``model.keep_pre_logits`` keeps a layer the init has: of weights without one, it was accepted and the
    run trained a one-layer head all the same."""
    if cfg.model.keep_pre_logits and getattr(init_architecture(cfg), "representation_size", None) is None:
        raise ConfigError(f"model.keep_pre_logits=True: model.init={cfg.model.init!r} has no pre-logits layer to "
                          "keep; leave it false")


def check_init_kept(cfg: TrainConfig) -> None:
    """The run writes its weights elsewhere than its init: given its init's run folder as --out, a
    fine-tune (--overwrite) wrote over the weights it started from, which its --resume then read as the
    init (of another size, a fine-tune's "auto" resolution came out otherwise, and the run was refused)."""
    from vitlab.weights.native import WEIGHTS_NAME

    out, init = Path(cfg.run.out).expanduser().resolve(), Path(cfg.model.init).expanduser().resolve()
    if init in (out, out / WEIGHTS_NAME):
        raise ConfigError(f"model.init={cfg.model.init!r}: the weights run.out={cfg.run.out!r} holds, which this run "
                          "writes its own over; fine-tune them into another --out")


def check_mixing(cfg: TrainConfig, micro_batch: int, world_size: int) -> None:
    """Mixup and CutMix mix each image with another of its micro-batch: with one image a process,
    each was mixed with itself, and trained as without them."""
    mixing = [f"augment.{name}={getattr(cfg.augment, name)}" for name in ("mixup_alpha", "cutmix_alpha")
              if getattr(cfg.augment, name) > 0]
    if mixing and micro_batch < 2:
        raise ConfigError(f"{' and '.join(mixing)}: mix{'es' if len(mixing) == 1 else ''} each image with another "
                          f"of its micro-batch, and this run's is 1 image (optim.batch_size={cfg.optim.batch_size} over optim.accum_steps="
                          f"{cfg.optim.accum_steps} x {world_size} process(es)): each would be mixed with itself; "
                          "set a larger batch or fewer accumulation steps, or the alphas to 0")


def check_data(cfg: TrainConfig) -> None:
    """That the data is named and there: what a run checks first (before its output folder)."""
    source = cfg.data.source
    if source is None:
        raise ConfigError("data.source=None: give a data path (--data PATH: an ImageFolder folder or "
                          f".tar/.tar.gz) or a built-in source ({', '.join(BUILTIN_DATA)})")
    for name, path in (("data.source", source), ("data.val_data", cfg.data.val_data)):
        if path is not None and path not in BUILTIN_DATA and not any(c in path for c in "{*?[") and \
                not Path(path).expanduser().exists():
            raise ConfigError(f"{name}={path!r}: no such file or folder")
        check_folder_holds_data(name, path)
    if cfg.data.cache_dir is not None:  # a file there was the OS's "Not a directory: '<it>/arrays'"
        need_output_folder("data.cache_dir", cfg.data.cache_dir)


def check_out_outside_data(cfg: TrainConfig) -> None:
    """The run's folder lies outside its image folders: inside one it became a class of the data
    (FOLDER/runs/demo/curves.png is an image of class 'runs'), so the next run on that folder trained
    on one more class without a word, and an eval or --resume of this run met other data."""
    from vitlab.data.stream import is_stream_source

    out = Path(cfg.run.out).expanduser().resolve()
    for name, path in (("data.source", cfg.data.source), ("data.val_data", cfg.data.val_data)):
        folder = Path(path).expanduser() if path is not None and path not in BUILTIN_DATA else None
        if folder is None or not folder.is_dir() or is_stream_source(path):
            continue
        if out.is_relative_to(folder.resolve()):
            flag = {"data.source": "--data", "data.val_data": "--val-data"}[name]
            raise ConfigError(f"run.out={cfg.run.out!r} lies inside {name}={path!r} ({flag}), an image folder: "
                              "the run's files would be read as the data's (its curves.png an image) by the next run, "
                              "eval or --resume on it; choose an --out outside the data's folder")


DATA_FORMS = ("an ImageFolder (FOLDER/CLASS/IMAGE, images .jpg, .png, ...), a .tar/.tar.gz archive of one, "
              "tar shards (vitlab pack-shards), parquet files or a Hugging Face save_to_disk folder")


def check_folder_holds_data(name: str, path: str | None) -> None:
    """A folder named as data holds some: shards, parquet or a saved dataset, or an image in a
    class folder (the first found ends the look; the rest is checked as the data is read)."""
    from vitlab.data.sources import holds_class_images
    from vitlab.data.stream import is_stream_source

    folder = Path(path).expanduser() if path is not None else None
    if folder is None or not folder.is_dir() or is_stream_source(path) or holds_class_images(folder):
        return
    classes = [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")]
    what = f"its {len(classes)} class folder(s) hold no images" if classes else "the folder holds no data"
    flag = {"data.source": "--data", "data.val_data": "--val-data"}[name]
    raise ConfigError(f"{name}={path!r} ({flag}): {what}; it takes {DATA_FORMS}")


def check_class_count(cfg: TrainConfig, classes: list[str]) -> None:
    """A classifier is trained on two classes or more: with one, every prediction is right and
    the loss is 0 from the first step, so a run would report 100% while learning nothing.
    Masked patch prediction has no classifier: one folder of images is its data."""
    if cfg.model.mpp is not None or len(classes) >= 2:
        return
    named = ", ".join(repr(c) for c in classes) or "none"
    if cfg.data.class_subset:
        raise ConfigError(f"data.class_subset={cfg.data.class_subset!r}: keeps {len(classes)} class ({named}); "
                          "training a classifier needs at least 2")
    raise ConfigError(f"data.source={cfg.data.source!r} (--data): it has {len(classes)} class ({named}); training "
                      "a classifier needs at least 2 class folders (FOLDER/CLASS/IMAGE)")


def make_model(cfg: TrainConfig, num_classes: int, img_size: tuple) -> nn.Module:
    """A fresh model, or ``model.init`` adapted for fine-tuning (paper Sec. 3.2): position
    embeddings interpolated to ``model.img_size`` and a new zero-initialised head; its head's
    bias starts at ``head_bias``."""
    from vitlab.models.registry import build_model

    if cfg.model.mpp is not None:  # self-supervised: the ViT inside a masked-patch-prediction wrapper
        from vitlab.models.mpp import MaskedPatchPrediction

        vit = (build_model(architecture(cfg, num_classes)) if cfg.model.init is None
               else _fine_tuned(cfg, num_classes, img_size))
        return MaskedPatchPrediction(vit, target=cfg.model.mpp, rate=cfg.model.mpp_rate).train()
    model = build_model(architecture(cfg, num_classes)) if cfg.model.init is None else \
        _fine_tuned(cfg, num_classes, img_size)
    bias = head_bias(cfg, num_classes)
    if bias:  # every model's head starts at zero: only another bias is set (a ResNet's head is a 1x1 convolution)
        with torch.no_grad():
            [m for m in model.head.modules() if getattr(m, "bias", None) is not None][-1].bias.fill_(bias)
    return model


def head_bias(cfg: TrainConfig, num_classes: int) -> float:
    """The head's bias at the start of a run: ``model.head_bias_init``, by default -ln K for sigmoid
    cross-entropy from scratch and 0 otherwise.  big_vision starts its sigmoid pre-training there
    (configs/vit_i21k.py's init_head_bias=-10.0 for ImageNet-21k's 21,843 classes, mlp_mixer_i1k.py's
    -6.9 for ImageNet's 1,000): each class's probability is 1/(K+1), where a zero head put every
    one of thousands at 0.5, an initial loss of K ln 2.  Softmax is the same with any bias added to
    every class, and a fine-tune's head starts at zero (Sec. 3.2; big_vision's transfer sets none)."""
    if cfg.model.head_bias_init is not None:
        return float(cfg.model.head_bias_init)
    return -math.log(num_classes) if cfg.optim.loss == "sigmoid_xent" and cfg.model.init is None else 0.0


def _fine_tuned(cfg: TrainConfig, num_classes: int, img_size: tuple) -> nn.Module:
    from vitlab.weights import load_model

    # the architecture is the checkpoint's; only the regularisation of the overrides applies
    regularisation = {k: v for k, v in cfg.model.overrides.items() if k in FINETUNE_MODEL_FIELDS}
    if cfg.data.progressive_sizes:
        regularisation["dynamic_img_size"] = True
    model = load_init(load_model, cfg.model.init, cfg.model.name, img_size=img_size, num_classes=num_classes,
                      keep_pre_logits=cfg.model.keep_pre_logits, weights_img_size=cfg.model.weights_img_size,
                      **regularisation)
    # always a fresh zero-initialised head (Sec. 3.2), and no pre-logits unless kept: load_model drops them with a
    # head of another class count only, and an init of the data's count kept them
    if getattr(model, "pre_logits", None) is not None and not cfg.model.keep_pre_logits:
        model.reset_classifier(num_classes, pre_logits=False)
    else:
        model.reset_classifier(num_classes)
    return model.train()


def check_square_phases(cfg: TrainConfig, img_size: tuple) -> None:
    """Progressive resizing's phases are squares: a non-square run has none (refused before its data is read)."""
    phases = cfg.data.progressive_sizes
    need(not phases or img_size[0] == img_size[1], "data.progressive_sizes", phases,
         f"its phases are square images, and this run trains at {img_size[0]}x{img_size[1]}; leave it out "
         "(--set data.progressive_sizes=) or train at a square size")


def check_progressive_sizes(cfg: TrainConfig, img_size: tuple, model_cfg) -> None:
    """Refuse progressive-resizing phases the model cannot train at (ConfigError)."""
    phases = cfg.data.progressive_sizes

    def refuse(problem: str) -> None:
        raise ConfigError(f"data.progressive_sizes={phases!r}: {problem}")

    check_square_phases(cfg, img_size)
    for size, _ in phases:
        if size >= img_size[0]:
            refuse(f"size {size} is not below the training size {img_size[0]}")
        if not model_cfg.divides_into_patches((size, size)):
            patch = model_cfg.patch_size
            refuse(f"size {size} does not divide into the model's {patch[0]}x{patch[1]} patches")


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)  # model initialisation: identical on every rank
    np.random.seed(seed)
    random.seed(seed)


def build(cfg: TrainConfig, world: World | None = None, machine: Machine | None = None,
          saved: dict | None = None) -> Setup:
    """The run's set-up: ``cfg`` resolved once for ``machine`` (default: this host) and the
    launch ``world`` (default: joined here), with a resumed run's ``saved`` record kept
    (``resolve``), then its data, model, optimiser, loader and evaluators.

    It leaves the process's thread count and random streams as it found them: the run's
    own are ``setup.resolved.threads`` and ``setup.rng`` (the random state after the model
    was initialised from ``run.seed``), which ``train`` takes up for its steps."""
    from vitlab.data.loader import BatchStream
    from vitlab.data.transforms import build_transform

    machine = machine or this_machine()
    world = world or init_world(resolve_device(cfg.run.device, machine, local_rank()))
    check_can_run(cfg, world.size)
    # every "auto" decided, the memory planned, before any data is decoded or any model built
    resolved = resolve(cfg, world, machine, saved)
    cfg, img_size = resolved.config, resolved.img_size
    check_mixing(cfg, resolved.micro_batch, world.size)
    check_tta_shift(cfg.run.final_eval_shift, img_size, "run.final_eval_shift")
    if cfg.augment.crop == "pad":  # the pad-and-crop runs at the training size (before any progressive resize)
        check_crop_pad(cfg.augment.crop_pad, img_size, "augment.crop_pad")
    check_square_phases(cfg, img_size)
    caller = process_state()
    try:
        torch.set_num_threads(resolved.threads)
        seed_everything(cfg.run.seed)
        splits = stream_splits(cfg, img_size, world) if resolved.data == "stream" else build_splits(cfg, img_size, world)
        check_class_count(cfg, splits.classes)
        num_classes = len(splits.classes)
        model = make_model(cfg, num_classes, img_size).to(world.device)
        if cfg.model.patch_init == "whiten":
            whiten_patches_(model, whitening_sample(splits, cfg, img_size))
        if cfg.model.attn_init == "mimetic":
            mimetic_attention_init_(model, torch.Generator().manual_seed(cfg.run.seed))
        if cfg.model.posemb_init == "sincos":
            sincos_posemb_init_(model)
        if world.rank:  # the weights are every rank's; what is drawn from here on is this rank's own
            torch.manual_seed(rank_seed(cfg.run.seed, world.rank))
        rng = rng_state()
    finally:
        set_process_state(caller)
    check_progressive_sizes(cfg, img_size, model.cfg)
    model.train()
    # before the fast layer, whose blocks then leave the fp8 layers to themselves (vitlab.fast.fp8);
    # the swapped layers share the plain ones' parameters: the checkpoints hold the plain weights
    fp8 = (fast.install_fp8(model, cfg.run.fp8, tuple(cfg.run.fp8_layers), cfg.run.fp8_backend)
           if cfg.run.fp8 != "off" else None)
    if cfg.run.fast:  # in place and before any wrapper: DDP, FSDP and compile see the fast modules
        fast.optimize(model, resolved.kernels)
    ema = EMA(model, cfg.optim.ema_decay) if cfg.optim.ema_decay > 0 else None
    trained = wrap_model(model, world, cfg.run.fsdp)  # FSDP shards ``model`` in place
    optimizer = build_optimizer(model, cfg.optim, bf16_matmuls=resolved.bf16_matmuls)
    if cfg.run.compile:
        # one static graph per input size (progressive resizing has a few): with symbolic sizes,
        # inductor's backward of the hybrid's root convolution asserts a contiguous stride on a
        # channels-last output after a size change (tests/test_compile.py)
        trained = torch.compile(trained, dynamic=False, mode=resolved.compile)

    micro_batch = resolved.micro_batch
    # the whole batch, not a micro-batch: accumulated, a batch larger than the split drew its micro-batches across
    # epochs (examples twice in a batch), so that whether a run was accepted hung on accum_steps (auto: the memory)
    if splits.train_count() < cfg.optim.batch_size:
        raise ConfigError(f"optim.batch_size={cfg.optim.batch_size}: the training split has only "
                          f"{splits.train_count()} examples, fewer than one batch; give a batch of at most "
                          f"{splits.train_count()}")
    augment = cfg.augment.transform(num_classes, img_size)
    if resolved.data == "stream":  # readers make the crops; the rest of the augmentation runs on the device
        from vitlab.data.stream import StreamLoader

        stream = StreamLoader(splits.source, micro_batch, augment=augment, seed=cfg.run.seed,
                              shuffle_buffer=cfg.data.shuffle_buffer, rank=world.rank, world_size=world.size,
                              workers=resolved.stream_workers, device=world.device, draft=cfg.data.draft)
    else:
        stream = BatchStream(
            splits.train_images, splits.train_labels, micro_batch, shuffle=True, seed=cfg.run.seed, drop_last=True,
            transform=build_transform(augment), device=world.device, rank=world.rank, world_size=world.size,
            augment_batches=cfg.data.augment_batches, stored_sizes=splits.train_sizes,
        )
    evaluator = final_evaluator = None
    if splits.val_labels is not None and cfg.model.mpp is None:  # MPP has no classifier to score
        def evaluator_with(shift, diagonal: bool = False) -> Evaluator:
            return Evaluator(splits.val_images, splits.val_labels, batch_size=cfg.run.eval_batch_size,
                             device=world.device, precision=resolved.precision, flip=cfg.run.eval_flip, shift=shift,
                             diagonal=diagonal, loss=cfg.optim.loss, image_size=img_size, world=world)

        evaluator = evaluator_with(0)
        final_evaluator = evaluator_with(cfg.run.final_eval_shift, cfg.run.final_eval_diagonal)
    scaler = make_scaler(resolved.precision, world.device, cfg.run.loss_scale)
    update = Update(trained.parameters(), optimizer, ema, model, cfg.optim.clip_norm, resolved.compile_optimizer)
    # a compiled call after a CUDA-graphed backward frees its gradients: the compiled update's, or
    # the next micro-batch's forward; the memory estimate counts the buffers by the same rule
    # (a command that trains nothing has no estimate)
    holds = resolved.memory is not None and resolved.memory.shape.holds_gradients
    held = HeldGradients(trained.parameters()) if holds else None
    return Setup(cfg, world, splits, model, trained, optimizer, ema, stream, evaluator, final_evaluator, micro_batch,
                 tuple(img_size), resolved, rng, update, scaler, fp8, held)
