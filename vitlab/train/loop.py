"""The training loop.  ``train(cfg)`` = ``setup`` (everything built once) + the step loop.

One optimiser step, in order (nothing else happens):

    lr = lr_at(step)                                   a pure function of the step
    K times: next micro-batch -> forward (autocast) -> loss / K -> backward
             (DDP all-reduces the gradients on the K-th only)
    clip the global gradient norm -> optimiser step -> zero grads -> EMA update

Every ``eval_every`` steps and at the end: top-1/top-5 on the held-out split.  Every
``ckpt_every`` steps and at the end: an atomic checkpoint from which ``resume`` continues
bit-exactly (model, optimiser, EMA, step, RNG states, data-stream position).

With ``time_limit`` the number of steps is not known up front: the first
``time_measure_steps`` steps (inside the warm-up) are timed, one evaluation is timed,
and the total is then fixed so that the decay ends, and the final evaluation is done,
by the deadline (``schedules.fit_steps_to_time``).
"""
from __future__ import annotations

import json
import math
import random
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vitlab.config import ConfigError
from vitlab.eval.features import check_tta_shift, mean_probability, tta_view_count, tta_views
from vitlab.models import bf16_matmul

from . import checkpoint as ckpt
from .config import TrainConfig, model_config, to_dict, validate, warmup_steps
from .distributed import World, all_reduce_sum, barrier, init_world, shutdown, wrap_model
from .ema import EMA
from .inputs import Splits, build_splits
from .memory import retain_freed_memory
from .metrics import MetricsWriter, Progress, plot_curves
from .optim import build_optimizer
from .schedules import fit_steps_to_time, input_size_at, lr_at, schedule_cost, step_cost


# ----------------------------------------------------------------------------- pieces


def loss_fn(logits: torch.Tensor, targets: torch.Tensor, kind: str) -> torch.Tensor:
    """Mean loss of (B, K) logits against (B, K) soft targets, computed in float32.

    softmax_xent: cross-entropy with soft targets (label smoothing, mixup);
    sigmoid_xent: per-class binary cross-entropy summed over classes (big_vision's
    choice for multi-label ImageNet-21k/JFT pre-training).
    """
    logits = logits.float()
    if kind == "sigmoid_xent":
        return F.binary_cross_entropy_with_logits(logits, targets, reduction="none").sum(-1).mean()
    return -(targets * F.log_softmax(logits, dim=-1)).sum(-1).mean()


def bf16_is_fast(device: torch.device) -> bool:
    """Whether the hardware computes in bf16 faster than in fp32.  On CPUs without AVX-512
    BF16 or AMX oneDNN emulates bf16, several times slower than fp32; with AVX-512 BF16 but
    no AMX its bf16 kernel may still be slower than the fp32 GEMM (half its rate on the
    Xeon VM), and a bf16 step then pays conversions on top of fp32-speed matmuls
    (``vitlab.models.bf16_matmul``)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return (device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            and bf16_matmul.bf16_kernel_is_faster())


def autocast(device: torch.device, precision: str):
    """bf16 autocast on CPU and GPU; fp32 runs plain; "auto" is bf16 where it is faster (``bf16_is_fast``)."""
    if precision == "auto":
        precision = "bf16" if bf16_is_fast(device) else "fp32"
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


@torch.no_grad()
def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, transform, *, batch_size: int,
             device: torch.device, precision: str = "fp32", world: World | None = None, flip: bool = False,
             shift: int = 0) -> dict:
    """Loss, top-1 and top-5 accuracy of ``model`` on uint8 ``images`` (N, 3, H, W).

    flip, shift: score the mean of the predicted probabilities of each image's test-time
    views (``vitlab.eval.features.tta_views``: its mirror image; its four
    translations by ``shift`` pixels).  With more than one view ``val_top1_single`` keeps
    the top-1 of the image alone, and with both ``val_top1_flip`` that of image + mirror.

    Distributed: rank r takes examples r, r + W, ...; all ranks run the same number of
    batches (the short ones padded and masked), so a sharded (FSDP) model works too.
    """
    world = world or World(0, 1, 0, device)
    was_training = model.training
    model.eval()
    n = labels.shape[0]
    mine = torch.arange(world.rank, n, world.size)
    per_rank = -(-n // world.size)
    valid = torch.ones(per_rank, dtype=torch.bool)
    if len(mine) < per_rank:  # pad with example 0, masked out below
        valid[len(mine):] = False
        mine = torch.cat([mine, mine.new_zeros(per_rank - len(mine))])
    loss_sum = top1 = top5 = top1_single = top1_flip = 0.0
    for start in range(0, per_rank, batch_size):
        idx, ok = mine[start:start + batch_size], valid[start:start + batch_size].to(device)
        x, targets = transform(images[idx].to(device), labels[idx].to(device), None)
        y = labels[idx].to(device)
        with autocast(device, precision):
            views = [model(view).float() for view in tta_views(x, flip, shift)]
        logits = views[0]
        if len(views) > 1:
            top1_single += float(((views[0].argmax(-1) == y) & ok).sum())
            if flip and shift:  # views[1] is the mirror image
                top1_flip += float(((mean_probability(*views[:2]).argmax(-1) == y) & ok).sum())
            logits = mean_probability(*views)
        loss = F.cross_entropy(logits, y, reduction="none")
        k = min(5, logits.shape[-1])
        topk = logits.topk(k, dim=-1).indices  # (b, k)
        hit = topk == y[:, None]
        loss_sum += float((loss * ok).sum())
        top1 += float((hit[:, 0] & ok).sum())
        top5 += float((hit.any(-1) & ok).sum())
    loss_sum, top1, top5, top1_single, top1_flip = all_reduce_sum([loss_sum, top1, top5, top1_single, top1_flip],
                                                                  world)
    model.train(was_training)
    result = {"val_loss": loss_sum / n, "val_top1": top1 / n, "val_top5": top5 / n}
    if flip or shift:
        result["val_top1_single"] = top1_single / n
    if flip and shift:
        result["val_top1_flip"] = top1_flip / n
    return result


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------- set-up


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
    eval_transform: object
    micro_batch: int
    img_size: tuple           # (H, W) the run evaluates at and, after any progressive_sizes, trains at


FINETUNE_MODEL_FIELDS = ("dropout", "attention_dropout", "drop_path", "patch_dropout")


def build_model(cfg: TrainConfig, num_classes: int) -> nn.Module:
    """A fresh model, or ``cfg.init`` adapted for fine-tuning (paper Sec. 3.2): position
    embeddings interpolated to ``img_size`` and a new zero-initialised head."""
    from vitlab.models.registry import build_model as build

    if cfg.init is None:
        return build(model_config(cfg, num_classes))
    from vitlab.weights import load_model

    # the architecture is the checkpoint's; only the regularisation of model_overrides applies
    regularisation = {k: v for k, v in cfg.model_overrides.items() if k in FINETUNE_MODEL_FIELDS}
    if cfg.progressive_sizes:
        regularisation["dynamic_img_size"] = True
    model = load_model(cfg.init, name=cfg.model, img_size=cfg.img_size, num_classes=num_classes,
                       keep_pre_logits=cfg.keep_pre_logits, **regularisation)
    model.reset_classifier(num_classes)  # always a fresh zero-initialised head (Sec. 3.2)
    return model.train()


def check_progressive_sizes(cfg: TrainConfig, img_size: tuple, model_cfg) -> None:
    """Refuse progressive-resizing phases the model cannot train at (ConfigError)."""
    def refuse(problem: str) -> None:
        raise ConfigError(f"progressive_sizes={cfg.progressive_sizes!r}: {problem}")

    if cfg.progressive_sizes and img_size[0] != img_size[1]:
        refuse(f"needs square training images, not {tuple(img_size)}")
    for size, _ in cfg.progressive_sizes:
        if size >= img_size[0]:
            refuse(f"size {size} is not below the training size {img_size[0]}")
        if not model_cfg.divides_into_patches((size, size)):
            patch = model_cfg.patch_size
            refuse(f"size {size} does not divide into the model's {patch[0]}x{patch[1]} patches")


def setup(cfg: TrainConfig) -> Setup:
    from vitlab.data.loader import BatchStream
    from vitlab.data.transforms import EvalTransform, TrainTransform, build_transform

    world = init_world(cfg.device)
    validate(cfg, world.size)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.retain_freed_memory and world.device.type == "cpu":
        retain_freed_memory()
    torch.manual_seed(cfg.seed)  # model initialisation and dropout; identical on every rank
    np.random.seed(cfg.seed)
    random.seed(cfg.seed)

    img_size = model_config(cfg).img_size if cfg.init is None or cfg.img_size is None else (cfg.img_size,) * 2
    if cfg.init is not None and cfg.img_size is None:
        from vitlab.weights import load_model

        img_size = load_model(cfg.init, name=cfg.model).cfg.img_size
    check_tta_shift(cfg.final_eval_shift, img_size, "final_eval_shift")
    splits = build_splits(cfg, img_size)
    num_classes = len(splits.classes)

    model = build_model(cfg, num_classes).to(world.device)
    check_progressive_sizes(cfg, img_size, model.cfg)
    model.train()
    ema = EMA(model, cfg.ema_decay) if cfg.ema_decay > 0 else None
    trained = wrap_model(model, world, cfg.fsdp)  # FSDP shards ``model`` in place
    optimizer = build_optimizer(model, cfg)
    if cfg.compile:
        # a size change (progressive resizing) recompiles with a symbolic size: measured no
        # slower than a static graph per size (benchmarks/ab.py hybrid_sizes)
        trained = torch.compile(trained)

    micro_batch = cfg.batch_size // (cfg.accum_steps * world.size)
    if len(splits.train_labels) < cfg.batch_size // cfg.accum_steps:
        raise ConfigError(f"batch_size={cfg.batch_size}: the training split has only {len(splits.train_labels)} "
                          f"examples, fewer than one micro-batch step of {cfg.batch_size // cfg.accum_steps}")
    train_tf = TrainTransform(
        num_classes=num_classes, image_size=img_size, crop=cfg.crop, crop_scale=tuple(cfg.crop_scale),
        crop_pad=cfg.crop_pad, flip=cfg.flip, alternate_flip=cfg.alternate_flip, randaug_ops=cfg.randaug_ops,
        randaug_magnitude=cfg.randaug_magnitude, mixup_alpha=cfg.mixup_alpha, cutmix_alpha=cfg.cutmix_alpha, label_smoothing=cfg.label_smoothing,
        erase_prob=cfg.erase_prob,
    )
    stream = BatchStream(
        splits.train_images, splits.train_labels, micro_batch, shuffle=True, seed=cfg.seed, drop_last=True,
        transform=build_transform(train_tf), device=world.device, rank=world.rank, world_size=world.size,
    )
    eval_tf = build_transform(EvalTransform(num_classes=num_classes, image_size=img_size))
    return Setup(cfg, world, splits, model, trained, optimizer, ema, stream, eval_tf, micro_batch, tuple(img_size))


def sharded(s: Setup) -> bool:
    return s.cfg.fsdp and s.world.size > 1


def _full(options_only: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=not options_only)


def model_state(s: Setup) -> dict:
    """The full (unsharded) state dict of the model; with FSDP a collective call whose
    result is complete on rank 0 only."""
    if sharded(s):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(s.model, options=_full())
    return s.model.state_dict()


def training_state(s: Setup, step: int, total_steps: int, records: list[dict], clock: dict | None = None) -> dict:
    """Everything ``resume`` needs to continue bit-exactly (collective under FSDP).

    ``clock``: the run's wall time so far and its measured evaluation time, so that a
    resumed ``--time-limit`` run keeps counting from where it stopped.
    """
    if sharded(s):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        optim_state = get_optimizer_state_dict(s.model, s.optimizer, options=_full())
    else:
        optim_state = s.optimizer.state_dict()
    return {
        "step": step,
        "total_steps": total_steps,
        "config": to_dict(s.cfg),
        "model": model_state(s),
        "optimizer": optim_state,
        "ema": s.ema.state_dict() if s.ema else None,
        "stream": s.stream.state_dict(),
        "rng": rng_state(),
        "records": records,
        "classes": s.splits.classes,
        "clock": clock or {},
    }


def restore(s: Setup, state: dict) -> tuple[int, int, list[dict]]:
    """Load a checkpoint into ``s``; returns (step, total_steps, metric records)."""
    if sharded(s):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(s.model, state["model"], options=_full(options_only=True))
        set_optimizer_state_dict(s.model, s.optimizer, state["optimizer"], options=_full(options_only=True))
    else:
        s.model.load_state_dict(state["model"])
        s.optimizer.load_state_dict(state["optimizer"])
    if s.ema is not None and state.get("ema"):
        s.ema.load_state_dict(state["ema"])
    s.stream.load_state_dict(state["stream"])
    set_rng_state(state["rng"])
    return int(state["step"]), int(state["total_steps"]), list(state.get("records", []))


def final_model(s: Setup) -> nn.Module | None:
    """The model to save: the EMA if on; under FSDP a fresh unsharded copy (rank 0 only)."""
    if not sharded(s):
        return s.ema.module if s.ema else s.model
    from vitlab.models.registry import build_model as build

    state = model_state(s)  # collective: every rank takes part
    if not s.world.is_main:
        return None
    model = build(s.model.cfg)
    model.load_state_dict(state)
    return model


# ----------------------------------------------------------------------------- the loop

# fields that fix the data order, the model or the optimiser state: a resumed run must keep them
RESUME_INVARIANTS = ("model", "model_overrides", "data", "val_split", "split_seed", "train_examples", "class_subset",
                     "batch_size", "accum_steps", "seed", "optimizer", "img_size", "init")


def train(cfg: TrainConfig, resume: bool = False, verbose: bool = True, overwrite: bool = False,
          started_at: float | None = None) -> dict:
    """Train as ``cfg`` says; returns the summary (also written to ``out/summary.json``).

    The summary holds the final validation metrics, the path of the final weights
    (``vitlab.weights.load_model`` reads them; class names in ``classes.json`` beside
    them), the number of steps, wall time and throughput.

    ``resume`` continues from the newest checkpoint in ``out/checkpoints``.  Without it, a
    folder holding an earlier run's checkpoints is refused, unless ``overwrite`` (then
    those checkpoints are deleted first).

    ``started_at``: the ``time.monotonic()`` at which a ``time_limit`` budget starts
    counting (default: now); the CLI passes its process's start, so that the budget is the
    command's whole wall time.
    """
    succeeded = False
    try:
        summary = _train(cfg, resume, verbose, overwrite, started_at)
        succeeded = True
    finally:
        bf16_matmul.release_scratch()
        shutdown(wait_for_others=succeeded)
    return summary


def _train(cfg: TrainConfig, resume: bool = False, verbose: bool = True, overwrite: bool = False,
           started_at: float | None = None) -> dict:
    """The body of ``train``; returns with the model out of scope, so the process group can go."""
    t_start = time.monotonic() if started_at is None else min(started_at, time.monotonic())
    deadline_s = cfg.time_limit * 60.0
    out = Path(cfg.out)
    ckpt_dir = out / "checkpoints"
    stale = not resume and ckpt.latest_checkpoint(ckpt_dir) is not None
    if stale and not overwrite:
        # a fresh run would rotate that run's checkpoints away and overwrite its weights
        raise ConfigError(f"out={str(out)!r} holds the checkpoints of an earlier run; continue it with --resume, "
                          "start afresh there with --overwrite, or choose another --out")
    s = setup(cfg)
    world = s.world
    main = world.is_main
    progress = Progress(enabled=verbose and main)
    if main and stale:
        shutil.rmtree(ckpt_dir)
    barrier(world)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        (out / "classes.json").write_text(json.dumps(s.splits.classes))

    step, total_steps, records = 0, cfg.steps, []
    fitted = cfg.time_limit <= 0  # whether total_steps is final
    eval_s, evals_timed = 0.0, 0  # mean duration of the periodic evaluations run so far, and their count
    latest = ckpt.latest_checkpoint(ckpt_dir) if resume else None
    remeasure_at = None  # a resumed time-limited run: the step from which the decay refits time again
    if latest is not None:
        state = ckpt.load_checkpoint(latest)
        saved = state.get("config", {})
        changed = [k for k in RESUME_INVARIANTS if k in saved and saved[k] != to_dict(cfg)[k]]
        if changed:
            raise ConfigError(f"--resume: {', '.join(f'{k}={getattr(cfg, k)!r} (checkpoint: {saved[k]!r})' for k in changed)}"
                              " differ from the checkpoint's run; an exact continuation needs the same values")
        step, total_steps, records = restore(s, state)
        fitted = True
        if cfg.time_limit > 0:  # time the steps again: the machine may differ (its first steps compile)
            remeasure_at = step + 2
        # the clock goes on from the checkpoint: the time between the stop and this restart,
        # and any steps made after the checkpoint, are not counted (they left no trace)
        clock = state.get("clock", {})
        t_start -= float(clock.get("elapsed_s", 0.0))
        eval_s = float(clock.get("eval_s", 0.0))
        evals_timed = int(clock.get("evals_timed", 1 if eval_s > 0 else 0))
        progress.message(f"resumed from {latest} at step {step}/{total_steps}, "
                         f"{(time.monotonic() - t_start) / 60:.1f} min into the run")
    elif resume:
        progress.message(f"--resume: no checkpoint in {ckpt_dir}; starting from step 0")
    writer = MetricsWriter(out, tensorboard=cfg.tensorboard, records=records) if main else None
    val_available = s.splits.val_labels is not None
    evaluated = s.ema.module if s.ema else s.model  # under FSDP: the sharded model, on every rank

    def run_eval(final: bool = False) -> dict:
        nonlocal eval_s, evals_timed
        if not val_available:
            return {}
        t_eval = time.monotonic()
        result = evaluate(evaluated, s.splits.val_images, s.splits.val_labels, s.eval_transform,
                          batch_size=cfg.eval_batch_size, device=world.device, precision=cfg.precision, world=world,
                          flip=cfg.eval_flip, shift=cfg.final_eval_shift if final else 0)
        if sharded(s):  # a forward without backward leaves FSDP's root parameters gathered
            s.model.reshard()
        if not final:
            # the time limit plans with the mean of all periodic evaluations so far: one alone,
            # timed for the first fit, is a noisy figure on a shared machine
            evals_timed += 1
            eval_s += (time.monotonic() - t_eval - eval_s) / evals_timed
        return result

    K = cfg.accum_steps
    params = [p for p in s.trained.parameters() if p.requires_grad]
    batches = iter(s.stream)
    window = {"loss": 0.0, "correct": 0.0, "seen": 0, "t": time.monotonic(), "steps": 0}
    t_measure, units_measure = None, 0.0
    sec_per_step = None
    # the final evaluation's cost, in periodic evaluations: it may add shifted views, and it
    # gets a quarter more as margin, because it is the longest single task and nothing after
    # it can absorb an overrun (CIFAR runs: 4.8-6.3x the periodic evaluation for 5x the
    # views, the highest on a host slowing down; one such run ended 6 s past its 30 minutes)
    final_eval_ratio = 1.25 * tta_view_count(cfg.eval_flip, cfg.final_eval_shift) / tta_view_count(cfg.eval_flip)
    # kept free for saving, plots and a slower last evaluation (saving and plots took ~1 s
    # of a 30-minute CIFAR run; 1% of the budget left 23 s unused there)
    reserve_s = 5.0 + 0.005 * deadline_s
    paused_s = 0.0  # time spent outside training steps so far
    # steps done in full-size steps (progressive resizing makes early steps cheaper): the
    # planner measures seconds per full-size step; a step that recompiles for a new size is
    # counted as a pause instead
    units, size_before = 0.0, None
    phases = tuple(tuple(p) for p in cfg.progressive_sizes)
    steps_cost = (lambda start, total: schedule_cost(start, total, phases, s.img_size)) if phases else None
    per_step = f"ms per {s.img_size[0]}-pixel step" if phases else "ms/step"
    refit_from, refit_at = None, 0  # (step, units, time, paused_s) where the second measurement starts
    # the same for the refits in the decay: over its first half, then over its third quarter
    decay_from, decay_at, decay_refits = None, 0, 0

    def fit_to_time(sec_per_step: float) -> int:
        total = fit_steps_to_time(
            budget_s=deadline_s, elapsed_s=time.monotonic() - t_start, step=step, sec_per_step=sec_per_step,
            eval_s=eval_s, final_eval_s=final_eval_ratio * eval_s, eval_every=cfg.eval_every, reserve_s=reserve_s,
            max_steps=cfg.steps, steps_cost=steps_cost)
        return int(all_reduce_sum([float(total)], world)[0] / world.size)  # ranks agree

    def refit_since(mark: tuple[int, float, float, float]) -> int:
        """Refit from the step time since ``mark`` = (step, units, time, paused_s), pauses excluded."""
        step0, units0, t0, paused0 = mark
        sec_per_step = (time.monotonic() - t0 - (paused_s - paused0)) / max(units - units0, 1e-9)
        total = fit_to_time(sec_per_step)
        progress.message(f"time limit: {sec_per_step * 1000:.0f} {per_step} over steps {step0}-{step} -> {total} steps")
        return total
    last_val: dict = {}
    rate, shown_loss, logged = 0.0, float("nan"), False  # for the progress line
    s.trained.train()
    while step < total_steps:
        warm = warmup_steps(cfg, total_steps)
        lr = lr_at(step, base_lr=cfg.lr, total_steps=total_steps, warmup_steps=warm, decay=cfg.decay, min_lr=cfg.min_lr)
        for group in s.optimizer.param_groups:
            group["lr"] = lr
        size = input_size_at(step, total_steps, phases, s.img_size)
        t_step = time.monotonic()

        for micro in range(K):
            try:
                x, targets = next(batches)
            except StopIteration:  # end of an epoch: the stream moves on to the next
                batches = iter(s.stream)
                x, targets = next(batches)
            if size != x.shape[-1]:
                x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True)
            sync = micro == K - 1 or world.size == 1
            with (nullcontext() if sync or not hasattr(s.trained, "no_sync") else s.trained.no_sync()):
                with autocast(world.device, cfg.precision):
                    logits = s.trained(x)
                loss = loss_fn(logits, targets, cfg.loss)
                (loss / K).backward()
            window["loss"] += float(loss.detach()) / K
            window["correct"] += float((logits.detach().argmax(-1) == targets.argmax(-1)).sum())
            window["seen"] += x.shape[0]

        if cfg.clip_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip_norm)  # FSDP: a DTensor over all shards
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        else:
            grad_norm = float("nan")
        s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=True)
        if s.ema is not None:
            s.ema.update(s.model)
        if size_before is not None and size != size_before:
            paused_s += time.monotonic() - t_step  # a compiled model compiles again (~1 min uncached)
        else:
            units += step_cost(size, s.img_size)
        size_before = size
        step += 1
        window["steps"] += 1

        # --- time budget: measure over the first steps and fit the schedule; measure again over
        # the rest of the warm-up (a steadier figure) and refit while the lr is still rising;
        # refit halfway through the decay (the warm-up's rate can be off by several percent on
        # a machine still settling) and at three quarters (a shared machine that sped up
        # after the halfway refit left a 30-minute run 95 s unused), early enough for the
        # rest of the decay to absorb the change; a slowdown after that is the guard's below
        if step == remeasure_at:  # a resumed run: both decay refits again, over the steps left
            decay_from, decay_refits, remeasure_at = (step, units, time.monotonic(), paused_s), 0, None
            decay_at = step + max((total_steps - step) // 2, cfg.time_measure_steps)
        if decay_from is not None and step == decay_at:
            total_steps, decay_refits = refit_since(decay_from), decay_refits + 1
            decay_from = (step, units, time.monotonic(), paused_s) if decay_refits < 2 else None
            decay_at = step + (total_steps - step) // 2
        if not fitted:
            if step == 2:  # the first steps pay for allocation and compilation
                t_measure, units_measure = time.monotonic(), units
            elif t_measure is not None and step == 2 + cfg.time_measure_steps:
                sec_per_step = (time.monotonic() - t_measure) / max(units - units_measure, 1e-9)
                last_val = run_eval()
                total_steps = fit_to_time(sec_per_step)
                refit_from = (step, units, time.monotonic(), paused_s)
                refit_at = max(warmup_steps(cfg, total_steps), step + 2 * cfg.time_measure_steps)
                progress.message(f"time limit {cfg.time_limit:g} min: {sec_per_step * 1000:.0f} {per_step}, "
                                 f"eval {eval_s:.1f} s -> {total_steps} steps "
                                 f"(warm-up {warmup_steps(cfg, total_steps)})")
            elif refit_from is not None and step == refit_at:
                total_steps, fitted = refit_since(refit_from), True
                decay_from, decay_at = (step, units, time.monotonic(), paused_s), step + (total_steps - step) // 2
            if total_steps <= step:
                total_steps, fitted = step, True

        # slower than measured (a busy machine): end here, still with a final evaluation and checkpoint,
        # keeping half the reserve for them (a run that kept none ended 4 s past its 30 minutes)
        if deadline_s > 0 and (fitted or refit_from is not None) and step < total_steps and all_reduce_sum(  # all ranks stop together
                [float(time.monotonic() - t_start > deadline_s - final_eval_ratio * eval_s - reserve_s / 2)], world)[0] > 0:
            progress.message(f"time limit reached at step {step}/{total_steps}: stopping before the schedule's end")
            total_steps = step

        # --- logging, evaluation, checkpoints
        is_last = step >= total_steps
        do_eval = val_available and (is_last or (cfg.eval_every and step % cfg.eval_every == 0))
        do_log = is_last or do_eval or step % cfg.log_every == 0
        t_pause = time.monotonic()
        if do_eval:
            last_val = run_eval(final=is_last)
        if do_log:
            now = time.monotonic()
            dt = now - window["t"]
            loss_avg, correct, seen = all_reduce_sum([window["loss"], window["correct"], float(window["seen"])], world)
            record = {
                "step": step, "epoch": round(step * cfg.batch_size / len(s.splits.train_labels), 3),
                "lr": lr, "loss": loss_avg / world.size / max(window["steps"], 1),
                "train_top1": correct / max(seen, 1), "grad_norm": grad_norm,
                "img_per_s": seen / max(dt, 1e-9), "elapsed_s": now - t_start,
            }
            if do_eval:
                record.update(last_val)
            if not math.isfinite(record["loss"]):
                raise FloatingPointError(f"step {step}: the training loss is {record['loss']}; lower the lr "
                                         "or check the data (the last checkpoint is still intact)")
            if writer is not None:
                writer.log(record)
            if do_eval:
                progress.message(f"step {step}: val top-1 {last_val['val_top1']:.4f} top-5 {last_val['val_top5']:.4f} "
                                 f"loss {last_val['val_loss']:.4f}")
            window = {"loss": 0.0, "correct": 0.0, "seen": 0, "t": time.monotonic(), "steps": 0}
        if do_log:
            rate, shown_loss, logged = record["img_per_s"], record["loss"], True
        elif not logged and window["steps"]:  # before the first log: this process's own numbers
            rate = window["seen"] * world.size / max(time.monotonic() - window["t"], 1e-9)
            shown_loss = window["loss"] / window["steps"]
        eta = (total_steps - step) * cfg.batch_size / rate if rate else 0.0
        progress.update(step, total_steps, shown_loss, rate, eta)
        if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or is_last:
            clock = {"elapsed_s": time.monotonic() - t_start, "eval_s": eval_s, "evals_timed": evals_timed}
            state = training_state(s, step, total_steps, writer.records if writer else [], clock)
            if main:
                ckpt.save_checkpoint(state, ckpt_dir, step, cfg.keep_ckpts)
            barrier(world)
        paused_s += time.monotonic() - t_pause  # evaluations, logging, checkpoints: not training time

    if not last_val and val_available:  # resumed a finished run: its summary still reports the metrics
        last_val = run_eval(final=True)
    progress.close()
    return finish(s, step, total_steps, last_val, t_start, writer)


def finish(s: Setup, step: int, total_steps: int, last_val: dict, t_start: float, writer) -> dict:
    """Save the final weights and the summary (rank 0); every rank returns the summary."""
    from vitlab.weights import save_model

    cfg, out = s.cfg, Path(s.cfg.out)
    model = final_model(s)
    wall = time.monotonic() - t_start
    records = writer.records if writer else []
    train_rows = [r for r in records if "img_per_s" in r]
    summary = {
        "recipe": cfg.recipe,
        "model": getattr(s.model.cfg, "name", None) or cfg.model,
        "steps": step,
        "planned_steps": total_steps,
        "val_top1": last_val.get("val_top1"),
        "val_top5": last_val.get("val_top5"),
        "val_loss": last_val.get("val_loss"),
        **{k: last_val[k] for k in ("val_top1_flip", "val_top1_single") if k in last_val},
        "train_loss": train_rows[-1]["loss"] if train_rows else None,
        "train_examples": int(len(s.splits.train_labels)),
        "val_examples": int(len(s.splits.val_labels)) if s.splits.val_labels is not None else 0,
        "skipped_images": s.splits.skipped,
        "wall_s": round(wall, 2),
        "images_per_s": round(step * cfg.batch_size / wall, 1),
        "world_size": s.world.size,
        "weights": None,
    }
    if s.world.is_main:
        weights = save_model(model, out / "model.safetensors")
        summary["weights"] = str(weights)
        summary["classes"] = str(out / "classes.json")
        if writer is not None:
            writer.close()
            plot = plot_curves(records, out / "curves.png")
            summary["curves"] = str(plot) if plot else None
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
