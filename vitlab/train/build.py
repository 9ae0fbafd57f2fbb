"""Everything a run builds once, before its first step: ``build(cfg) -> Setup``."""
from __future__ import annotations

import dataclasses
import functools
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from vitlab import fast
from vitlab.config import Architecture, ConfigError, ResNetConfig, ViTConfig, replace
from vitlab.fast.kernels import KernelChoice
from vitlab.eval.evaluator import Evaluator
from vitlab.eval.features import check_tta_shift
from vitlab.machine import Machine, cpu_info, memory_available, usable_cores

from .architecture import model_architecture
from .config import TrainConfig
from .distributed import World, env_world_size, init_world, pick_device, wrap_model
from .ema import EMA
from .inputs import HeldImages, Splits, build_splits, held_images, resolve_data, stream_splits
from .memory import retain_freed_memory
from .memory_estimate import (GB, Available, MemoryEstimate, RunShape, available_memory, estimate_memory,
                              fitting_settings, refusal, smallest_fitting_accum)
from .numerics import make_scaler
from .optim import build_optimizer
from .overrides import with_changes

BUILTIN_DATA = ("digits",)  # data sources that need no path (see vitlab/data/digits.py)


@dataclass(frozen=True)
class Resolved:
    """What the run's "auto" settings came to on this machine, decided once when the run is
    built and never read from the machine (or a stored calibration) again: the step and the
    evaluators use these values.  Written to the run's config.json and its first log line;
    a resumed run takes its checkpoint's, so that its arithmetic is the one it started with."""

    device: str
    precision: str        # "fp32", "bf16" or "fp16"
    kernels: KernelChoice | None  # the fast path's CPU kernels (None: plain model, or a GPU)
    bf16_matmuls: bool    # bf16 matmuls are the faster ones here (Muon's orthogonalisation)
    threads: int          # CPU threads of the process
    data: str             # "memory" or "stream"
    compile: str          # "off", or torch.compile's mode
    cpu: str              # the CPU's model name and class (what the kernel rule read)
    stream_workers: int = 0  # DataLoader workers per process reading a streamed training set
    decode_workers: int = 0  # processes decoding a data set into memory

    def record(self) -> dict:
        return dataclasses.asdict(self)  # the kernels too: asdict converts nested dataclasses

    def line(self) -> str:
        kernels = self.kernels.describe() if self.kernels else "plain"
        workers = (f"{self.stream_workers} stream workers" if self.data == "stream"
                   else f"{self.decode_workers} decode workers")
        return (f"resolved: device {self.device}, precision {self.precision}, kernels {kernels}, "
                f"threads {self.threads}, data {self.data} ({workers}), compile {self.compile}, cpu {self.cpu}")

    @staticmethod
    def from_record(record: dict) -> "Resolved":
        fields = dict(record)
        fields["kernels"] = KernelChoice(**fields["kernels"]) if fields.get("kernels") else None
        return Resolved(**{f.name: fields[f.name] for f in dataclasses.fields(Resolved) if f.name in fields})


@dataclass
class Setup:
    """Everything the loop needs, built once."""

    cfg: TrainConfig
    world: World
    splits: Splits
    model: nn.Module          # the bare model (what is saved)
    trained: nn.Module        # what the loop calls: DDP/FSDP/compiled around ``model``
    optimizer: torch.optim.Optimizer
    ema: EMA | None
    stream: object            # vitlab.data.BatchStream of micro-batches
    evaluator: Evaluator | None        # the periodic evaluations (None: no validation split)
    final_evaluator: Evaluator | None  # the last one, with ``run.final_eval_shift``'s views
    micro_batch: int
    img_size: tuple           # (H, W) the run evaluates at and, after any progressive_sizes, trains at
    resolved: Resolved        # the "auto" settings as decided for this run
    scaler: torch.amp.GradScaler | None = None  # fp16's gradient scaler (numerics.make_scaler)
    memory: MemoryEstimate | None = None  # the peak memory estimated before the run was built

    @property
    def precision(self) -> str:
        return self.resolved.precision

    @property
    def evaluated(self) -> nn.Module:
        """What the evaluators score: the weight average if on (under FSDP the sharded model)."""
        return self.ema.module if self.ema else self.model


def architecture(cfg: TrainConfig, num_classes: int | None = None) -> Architecture:
    """The architecture this run trains from scratch (progressive resizing makes its input
    size dynamic)."""
    return model_architecture(cfg.model, num_classes, dynamic_img_size=bool(cfg.data.progressive_sizes))


def check_can_run(cfg: TrainConfig, world_size: int = 1, need_data: bool = True) -> None:
    """What the values alone cannot tell: the launch's process count, and that the data
    and the initial weights exist.  ``build`` calls it before any work; the CLI earlier."""
    per_process = (1 if cfg.optim.accum_steps == "auto" else cfg.optim.accum_steps) * world_size
    if cfg.optim.batch_size % per_process:
        raise ConfigError(
            f"optim.batch_size={cfg.optim.batch_size} is not divisible by optim.accum_steps={cfg.optim.accum_steps}"
            f" x world_size={world_size} = {per_process}: every micro-batch must have the same size")
    if cfg.run.fsdp and world_size < 2:
        raise ConfigError("run.fsdp=True needs a distributed launch (torchrun --nproc_per_node=N); world_size is 1")
    if need_data:
        check_data(cfg)
    if cfg.model.init is not None and not Path(cfg.model.init).expanduser().exists():
        from vitlab.weights.hub import parse_hub_name

        if parse_hub_name(cfg.model.init) is None:  # a Hub name is looked up when the weights are loaded
            raise ConfigError(f"model.init={cfg.model.init!r}: no such file or folder")


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


FINETUNE_MODEL_FIELDS = ("dropout", "attention_dropout", "drop_path", "patch_dropout")


def make_model(cfg: TrainConfig, num_classes: int) -> nn.Module:
    """A fresh model, or ``model.init`` adapted for fine-tuning (paper Sec. 3.2): position
    embeddings interpolated to ``model.img_size`` and a new zero-initialised head."""
    from vitlab.models.registry import build_model

    if cfg.model.mpp is not None:  # self-supervised: the ViT inside a masked-patch-prediction wrapper
        from vitlab.models.mpp import MaskedPatchPrediction

        vit = build_model(architecture(cfg, num_classes)) if cfg.model.init is None else _fine_tuned(cfg, num_classes)
        return MaskedPatchPrediction(vit, target=cfg.model.mpp, rate=cfg.model.mpp_rate).train()
    if cfg.model.init is None:
        return build_model(architecture(cfg, num_classes))
    return _fine_tuned(cfg, num_classes)


def _fine_tuned(cfg: TrainConfig, num_classes: int) -> nn.Module:
    from vitlab.weights import load_model

    # the architecture is the checkpoint's; only the regularisation of the overrides applies
    regularisation = {k: v for k, v in cfg.model.overrides.items() if k in FINETUNE_MODEL_FIELDS}
    if cfg.data.progressive_sizes:
        regularisation["dynamic_img_size"] = True
    model = load_model(cfg.model.init, name=cfg.model.name, img_size=training_size(cfg), num_classes=num_classes,
                       keep_pre_logits=cfg.model.keep_pre_logits, **regularisation)
    model.reset_classifier(num_classes)  # always a fresh zero-initialised head (Sec. 3.2)
    return model.train()


# The paper fine-tunes at 384 px the models it pre-trained at 224 (Sec. 3.2, Table 4)
PAPER_PRETRAIN_SIZE, PAPER_FINETUNE_SIZE = 224, 384


def finetune_size(init_size: int, step: int) -> int:
    """The resolution of a fine-tune whose ``model.img_size`` is "auto", from an init trained at
    ``init_size``: the init's size times 384/224, as the paper goes from its 224-px pre-training
    to 384, at most 384 and never below the init's own, to the nearest multiple of ``step``
    (what the model cuts into patches: the patch size, times a hybrid's stem reduction).
    224 -> 384; 32 -> 48 (16-px patches); 16 -> 28 (4-px patches); 384 and up: its own."""
    scaled = min(PAPER_FINETUNE_SIZE, init_size * PAPER_FINETUNE_SIZE / PAPER_PRETRAIN_SIZE)
    return max(init_size, step * max(1, round(scaled / step)))


def size_step(arch: Architecture) -> int:
    """The multiple of pixels a model's input side must be: its patch size (times a hybrid's
    stem reduction); a ResNet's total stride."""
    if isinstance(arch, ResNetConfig):
        return arch.reduction
    return arch.patch_size[0] * (arch.resnet.reduction if arch.resnet is not None else 1)


@functools.lru_cache(maxsize=4)
def _init_architecture(init: str, name: str) -> Architecture:
    from vitlab.weights import load_config

    return load_config(init, name=name)


def init_architecture(cfg: TrainConfig) -> Architecture:
    """The architecture of ``model.init`` (at its own size, with its own head), read once per process."""
    return _init_architecture(cfg.model.init, cfg.model.name)


def training_size(cfg: TrainConfig) -> tuple[int, int]:
    """(H, W) the run trains at: ``model.img_size``; None: the model's (or the checkpoint's);
    "auto": a fine-tune's ``finetune_size`` of its checkpoint's (a non-square one keeps its
    own), from scratch the model's."""
    size = cfg.model.img_size
    if size not in (None, "auto"):
        return (size, size)
    if cfg.model.init is None:
        return tuple(architecture(cfg).img_size)
    arch = init_architecture(cfg)
    h, w = arch.img_size
    if size is None or h != w:
        return (h, w)
    side = finetune_size(h, size_step(arch))
    return (side, side)


def resolve_model(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with what its model section leaves to the init or to "auto" stated: a
    fine-tune's ``model.name`` is its init's model (the architecture is the checkpoint's,
    whatever the recipe names), and ``model.img_size="auto"`` the resolution it comes to
    (``training_size``).  What --show-config and the run's config.json state."""
    changes = {}
    if cfg.model.init is not None:
        name = getattr(init_architecture(cfg), "name", None)
        if name and name != cfg.model.name:
            changes["model.name"] = name
    if cfg.model.img_size == "auto":
        h, w = training_size(cfg)
        changes["model.img_size"] = h if h == w else None
    return with_changes(cfg, changes) if changes else cfg


def trained_architecture(cfg: TrainConfig) -> Architecture:
    """The architecture the run trains, from the config alone (a fine-tune: its init's, with
    the run's regularisation); its head and size are the init's, which a memory estimate
    need not follow (``memory_estimate.RunShape`` carries the training size)."""
    if cfg.model.init is None:
        return architecture(cfg)
    arch = init_architecture(cfg)
    regularisation = {k: v for k, v in cfg.model.overrides.items() if k in FINETUNE_MODEL_FIELDS}
    return replace(arch, **regularisation) if regularisation and isinstance(arch, ViTConfig) else arch


def run_shape(cfg: TrainConfig, img_size: tuple, resolved: Resolved, world_size: int = 1,
              held: HeldImages | None = None) -> RunShape:
    """What the memory of ``cfg``'s run depends on, as ``resolve`` decided it for this machine
    (``held``: the images it holds, default counted from its sources)."""
    streamed = resolved.data == "stream"
    held = held if held is not None else held_images(cfg, streamed, img_size)
    accum = 1 if cfg.optim.accum_steps == "auto" else cfg.optim.accum_steps
    kernels = resolved.kernels
    on_gpu = resolved.device.startswith("cuda")
    # the fast path takes over training on a GPU, and on a CPU where its kernel choice says so
    fast_path = cfg.run.fast and (on_gpu or bool(kernels and kernels.takes_over(True, resolved.precision == "bf16")))
    evaluated = held.val and cfg.model.mpp is None
    return RunShape(
        trained_architecture(cfg), micro_batch=max(1, cfg.optim.batch_size // (accum * world_size)),
        accum_steps=accum, img_size=tuple(img_size), precision=resolved.precision, device=resolved.device,
        fast=fast_path, explicit_attention_fp32=bool(kernels and kernels.attention == "explicit"),
        optimizer=cfg.optim.optimizer, momentum=cfg.optim.momentum, ema=cfg.optim.ema_decay > 0,
        mpp=cfg.model.mpp, mpp_rate=cfg.model.mpp_rate, train_images=held.train, val_images=held.val,
        decoded_images=held.decoded, data_copies=held.copies, decoded_from_source=held.from_source,
        eval_batch=min(cfg.run.eval_batch_size, held.val) if evaluated else 0, streamed=streamed,
        stream_workers=int(cfg.data.stream_workers) if streamed and cfg.data.stream_workers != "auto" else 0,
        shuffle_buffer=cfg.data.shuffle_buffer if streamed else 0)


def memory_preview(cfg: TrainConfig, available: Available | None = None) -> dict:
    """What --show-config states of ``cfg``'s run on this machine, without joining a process
    group, decoding data or building the model: its memory estimate's record, with the
    accumulation "auto" would choose, the memory available and whether the run fits.  The
    data is counted where it can be (else the record says why it is left out)."""
    world = World(rank=0, size=env_world_size(), local_rank=0, device=pick_device(cfg.run.device))
    cfg = resolve_model(cfg)
    img_size = training_size(cfg)
    held, note = HeldImages(0, 0, 0, 1), None
    streamed = False
    if cfg.data.source is None:
        note = "not counted: no data.source"
    else:
        try:
            cfg, _ = resolve_data(cfg, img_size)
            streamed = cfg.data.stream == "stream"
            held = held_images(cfg, streamed, img_size)
        except (ConfigError, OSError, ValueError) as err:  # DataError is a ValueError
            note = f"not counted: {err}"
    resolved = resolve(cfg, world, streamed)
    available = available or machine_memory(resolved.device)
    shape = run_shape(cfg, img_size, resolved, world.size, held)
    _, estimate = plan_memory(with_changes(cfg, {"run.memory_check": False}), shape, available, world.size)
    record = estimate.record()
    if note:
        record["data"] = note
    record["available_gb"] = {k: round(v / GB, 3) for k, v in (("host", available.host), ("gpu", available.gpu))
                              if v is not None}
    record["fits"] = available.fits(estimate)
    return record


def machine_memory(device: str) -> Available:
    """What this machine has free for a run on ``device``, shared by the processes torchrun
    started on it."""
    host, gpu = available_memory(device)
    return Available(host, gpu, processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def plan_memory(cfg: TrainConfig, shape: RunShape, available: Available, world_size: int = 1
                ) -> tuple[TrainConfig, MemoryEstimate]:
    """``cfg`` with ``optim.accum_steps="auto"`` decided (the largest micro-batch that fits),
    and its run's memory estimate; ``run.memory_check`` refuses a run that cannot fit, in
    one line naming settings that would (ConfigError)."""
    batch = cfg.optim.batch_size // world_size
    if cfg.optim.accum_steps == "auto":
        accum = smallest_fitting_accum(shape, batch, available)
        if accum is None:  # not even one image per micro-batch: the refusal below names what fits
            accum = batch if cfg.run.memory_check else 1
        cfg = with_changes(cfg, {"optim.accum_steps": accum})
        shape = shape.with_(micro_batch=batch // accum, accum_steps=accum)
    estimate = estimate_memory(shape)
    if cfg.run.memory_check and not available.fits(estimate):
        raise refusal(estimate, available, fitting_settings(shape, available, size_step(shape.arch), world_size))
    return cfg, estimate


def check_progressive_sizes(cfg: TrainConfig, img_size: tuple, model_cfg) -> None:
    """Refuse progressive-resizing phases the model cannot train at (ConfigError)."""
    phases = cfg.data.progressive_sizes

    def refuse(problem: str) -> None:
        raise ConfigError(f"data.progressive_sizes={phases!r}: {problem}")

    if phases and img_size[0] != img_size[1]:
        refuse(f"needs square training images, not {tuple(img_size)}")
    for size, _ in phases:
        if size >= img_size[0]:
            refuse(f"size {size} is not below the training size {img_size[0]}")
        if not model_cfg.divides_into_patches((size, size)):
            patch = model_cfg.patch_size
            refuse(f"size {size} does not divide into the model's {patch[0]}x{patch[1]} patches")


WHITEN_SAMPLE = 5000  # images whose patches estimate the covariance (48x48 for 4x4 RGB patches)


def whiten_from_data(model: nn.Module, splits, cfg: TrainConfig) -> None:
    """``model.patch_init="whiten"``: the patch embedding whitens the training images' patches."""
    from vitlab.data.transforms import to_float
    from vitlab.models.init import whiten_patch_embedding_

    vit = getattr(model, "vit", model)  # inside the MPP wrapper
    if getattr(vit, "stem", None) is not None or not hasattr(vit, "patch_embed"):
        raise ConfigError("model.patch_init='whiten': only a plain ViT's patch embedding reads image patches "
                          "(a hybrid's reads ResNet features); use 'lecun'")
    images = splits.train_images
    if images is None:  # streamed: the images of whole units (shards) drawn by the seed
        images = streamed_sample(splits.source, WHITEN_SAMPLE, cfg)
    generator = torch.Generator().manual_seed(cfg.run.seed)
    sample = torch.randperm(len(images), generator=generator)[:WHITEN_SAMPLE]
    whiten_patch_embedding_(vit.patch_embed, to_float(images[sample]).to(vit.patch_embed.weight.device))


def streamed_sample(source, count: int, cfg: TrainConfig) -> torch.Tensor:
    """uint8 images of whole units of a streamed ``source`` holding at least ``count`` samples
    (all of it when smaller), drawn by the run's seed and decoded at the training size."""
    from vitlab.data.memory import load_source_in_memory
    from vitlab.data.sources import DataError
    from vitlab.data.stream import hold_out

    try:
        _, source = hold_out(source, count, cfg.run.seed)
    except DataError:  # it would take every unit
        pass
    return load_source_in_memory(source, training_size(cfg), cfg.data.cache_dir, cfg.data.decode_workers).images


def mimetic_init(model: nn.Module, seed: int) -> None:
    """``model.attn_init="mimetic"``: every attention layer starts as trained ViTs' attention looks."""
    from vitlab.models.init import mimetic_attention_
    from vitlab.models.layers import Attention

    generator = torch.Generator().manual_seed(seed)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise ConfigError("model.attn_init='mimetic': the model has no ViT attention layer; use 'xavier'")
    for attn in layers:
        mimetic_attention_(attn, generator=generator)


@torch.no_grad()
def sincos_posemb_init(model: nn.Module) -> None:
    """``model.posemb_init="sincos"``: the learned 1D table starts as the 2D sin-cos table."""
    from vitlab.models.posemb import LearnedPosEmb1D, posemb_sincos_2d

    posemb = getattr(getattr(model, "vit", model), "pos_embed", None)
    if not isinstance(posemb, LearnedPosEmb1D):
        raise ConfigError("model.posemb_init='sincos': needs one learned 1D position embedding at the stem "
                          "(model posemb='learned_1d', posemb_place='stem'); use 'normal'")
    table = posemb.weight[0, posemb.num_prefix:]
    table.copy_(posemb_sincos_2d(posemb.grid, table.shape[-1])[0].to(table))


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)  # model initialisation and dropout; identical on every rank
    np.random.seed(seed)
    random.seed(seed)


def resolve(cfg: TrainConfig, world: World, streamed: bool) -> Resolved:
    """Every "auto" of ``cfg`` decided for this machine (the only place the run reads the
    CPU's features or a stored calibration)."""
    device = world.device
    auto_precision = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else \
        fast.cpu_precision() if device.type == "cpu" else "fp32"
    precision = auto_precision if cfg.run.precision == "auto" else cfg.run.precision
    kernels = None
    if cfg.run.fast:  # a GPU keeps PyTorch's kernels: the plain choice
        kernels = fast.choose() if device.type == "cpu" else KernelChoice()
    compile_mode = "off"
    if cfg.run.compile:
        # CUDA graphs replay a fixed-shape step without the host launching each kernel; a
        # run that changes its input size (progressive resizing) or spans processes keeps
        # the default mode
        graphs = device.type == "cuda" and not cfg.data.progressive_sizes and world.size == 1
        compile_mode = "reduce-overhead" if graphs else "default"
    return Resolved(device=str(device), precision=precision, kernels=kernels, bf16_matmuls=auto_precision == "bf16",
                    threads=cfg.run.threads or torch.get_num_threads(), data="stream" if streamed else "memory",
                    compile=compile_mode,  # the host less its GPUs: Machine.here() opens a CUDA context on each
                    cpu=Machine(cpu_info(), usable_cores(), memory_available()).cpu_line())


def build(cfg: TrainConfig) -> Setup:
    """The run's set-up.  It sets this process's thread count and seeds; ``train`` gives the
    caller's back when the run ends."""
    from vitlab.data.loader import BatchStream
    from vitlab.data.transforms import build_transform

    world = init_world(cfg.run.device)
    check_can_run(cfg, world.size)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    if cfg.run.retain_freed_memory and world.device.type == "cpu":
        retain_freed_memory()
    seed_everything(cfg.run.seed)

    cfg = resolve_model(cfg)  # the init's model and the "auto" resolution, as config.json states them
    img_size = training_size(cfg)
    check_tta_shift(cfg.run.final_eval_shift, img_size, "run.final_eval_shift")
    cfg, data_values = resolve_data(cfg, img_size)  # the data's "auto" values, decided once for the run
    streamed = cfg.data.stream == "stream"
    resolved = resolve(cfg, world, streamed)
    # before any data is decoded or any model built: the accumulation that fits, or a refusal
    cfg, memory = plan_memory(cfg, run_shape(cfg, img_size, resolved, world.size),
                              machine_memory(resolved.device), world.size)
    splits = stream_splits(cfg, img_size, world) if streamed else build_splits(cfg, img_size, world)
    num_classes = len(splits.classes)

    model = make_model(cfg, num_classes).to(world.device)
    if cfg.model.patch_init == "whiten":
        whiten_from_data(model, splits, cfg)
    if cfg.model.attn_init == "mimetic":
        mimetic_init(model, cfg.run.seed)
    if cfg.model.posemb_init == "sincos":
        sincos_posemb_init(model)
    check_progressive_sizes(cfg, img_size, model.cfg)
    model.train()
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

    batch, accum = cfg.optim.batch_size, cfg.optim.accum_steps
    if splits.train_count() < batch // accum:
        raise ConfigError(f"optim.batch_size={batch}: the training split has only {splits.train_count()} "
                          f"examples, fewer than one micro-batch step of {batch // accum}")
    micro_batch = batch // (accum * world.size)
    augment = cfg.augment.transform(num_classes, img_size)
    if streamed:  # readers make the crops; the rest of the augmentation runs on the device, as in memory
        from vitlab.data.stream import StreamLoader

        stream = StreamLoader(splits.source, micro_batch, augment=augment, seed=cfg.run.seed,
                              shuffle_buffer=cfg.data.shuffle_buffer, rank=world.rank, world_size=world.size,
                              workers=cfg.data.stream_workers, device=world.device, draft=cfg.data.draft)
        data_values["data.stream_workers"] = stream.workers  # fewer where the shards are too few (a warning says so)
    else:
        stream = BatchStream(
            splits.train_images, splits.train_labels, micro_batch, shuffle=True, seed=cfg.run.seed, drop_last=True,
            transform=build_transform(augment), device=world.device, rank=world.rank, world_size=world.size,
        )
    evaluator = final_evaluator = None
    if splits.val_labels is not None and cfg.model.mpp is None:  # MPP has no classifier to score
        def evaluator_with(shift: int) -> Evaluator:
            return Evaluator(splits.val_images, splits.val_labels, batch_size=cfg.run.eval_batch_size,
                             device=world.device, precision=resolved.precision, flip=cfg.run.eval_flip, shift=shift,
                             image_size=img_size, world=world)

        evaluator, final_evaluator = evaluator_with(0), evaluator_with(cfg.run.final_eval_shift)
    scaler = make_scaler(resolved.precision, world.device, cfg.run.loss_scale)
    cfg = with_changes(cfg, data_values)  # config.json states the values the run used
    resolved = dataclasses.replace(resolved, stream_workers=cfg.data.stream_workers,
                                   decode_workers=cfg.data.decode_workers)
    return Setup(cfg, world, splits, model, trained, optimizer, ema, stream, evaluator, final_evaluator, micro_batch,
                 tuple(img_size), resolved, scaler, memory)
