"""One optimiser step, in order (nothing else happens):

    K times: next micro-batch -> forward (autocast) -> loss / K (fp16: x the loss scale)
             -> backward (DDP all-reduces the gradients on the K-th only)
    loss not finite on any process? -> drop the gradients, report it (no update)
    fp16: unscale the gradients
    clip the global gradient norm -> not finite? -> drop them, report it (fp16: the
    scaler's overflow, its scale halves) -> optimiser step -> zero grads -> EMA update
"""
from __future__ import annotations

import itertools
import math
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F

from vitlab.eval.evaluator import autocast

from .distributed import all_reduce_sum

__all__ = ["StepResult", "autocast", "endless", "example_losses", "loss_fn", "train_step"]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor, kind: str) -> torch.Tensor:
    """Mean loss of (B, K) logits against (B, K) soft targets, computed in float32.

    softmax_xent: cross-entropy with soft targets (label smoothing, mixup);
    sigmoid_xent: per-class binary cross-entropy summed over classes (big_vision's
    choice for multi-label ImageNet-21k/JFT pre-training).
    """
    return example_losses(logits, targets, kind).mean()


def example_losses(logits: torch.Tensor, targets: torch.Tensor, kind: str) -> torch.Tensor:
    """(B,) the loss of each example (``loss_fn`` is their mean)."""
    logits = logits.float()
    if kind == "sigmoid_xent":
        return F.binary_cross_entropy_with_logits(logits, targets, reduction="none").sum(-1)
    return -(targets * F.log_softmax(logits, dim=-1)).sum(-1)


def _kept(batches: Iterator, taken: list) -> Iterator:
    """``batches``, each also appended to ``taken`` (for a retry of the step)."""
    for batch in batches:
        taken.append(batch)
        yield batch


def accumulate(s, batches: Iterator, size: int) -> tuple[float, float, int, list]:
    """Forward and backward of ``optim.accum_steps`` micro-batches: (mean loss, correct,
    examples, origins); ``origins`` holds, per micro-batch, where the stream took it from
    and the rows whose loss is not a finite number (what an error message names)."""
    cfg, K = s.cfg, s.cfg.optim.accum_steps
    loss_sum = correct = 0.0
    seen = 0
    origins = []
    for micro in range(K):
        x, targets = next(batches)
        position = stream_position(s.stream)
        if size != x.shape[-1]:
            x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True)
        sync = micro == K - 1 or s.world.size == 1
        with (nullcontext() if sync or not hasattr(s.trained, "no_sync") else s.trained.no_sync()):
            with autocast(s.world.device, cfg.run.precision):
                out = s.trained(x)
            if cfg.model.mpp is None:
                loss = loss_fn(out, targets, cfg.optim.loss)
                hits = float((out.detach().argmax(-1) == targets.argmax(-1)).sum())
            else:  # masked patch prediction: its own loss; "correct" counts images' worth of right patches
                loss = out.loss
                hits = x.shape[0] * mpp_accuracy(out)
            # fp16: the loss is scaled up so that small gradients do not flush to zero in half precision
            ((s.scaler.scale(loss) if s.scaler is not None else loss) / K).backward()
        loss_value = float(loss.detach())
        bad_rows = None
        if not math.isfinite(loss_value) and cfg.model.mpp is None:
            with torch.no_grad():
                finite = torch.isfinite(example_losses(out.detach(), targets, cfg.optim.loss))
            bad_rows = (~finite).nonzero().flatten().tolist()
        origins.append((position, bad_rows))
        loss_sum += loss_value / K
        correct += hits
        seen += x.shape[0]
    return loss_sum, correct, seen, origins


def stream_position(stream) -> tuple:
    """Where the micro-batch just taken came from: ("memory", epoch, batch) of a
    ``BatchStream``; ("stream", the readers' (epoch, samples read)) of a streamed set."""
    if hasattr(stream, "batch_indices"):
        return ("memory", stream.epoch, stream.position - 1)
    return ("stream", tuple(getattr(stream, "positions", ())))


def mpp_accuracy(out) -> float:
    """The share of corrupted patches whose predicted colour classes are right (0 for "pixels")."""
    if out.targets.is_floating_point():
        return 0.0
    return float((out.predictions.detach().argmax(-1) == out.targets).float().mean())


def endless(stream) -> Iterator:
    """The stream's micro-batches, epoch after epoch."""
    while True:
        yield from stream


@dataclass
class StepResult:
    loss: float        # the mean training loss of the step's examples (this process's)
    correct: float     # examples whose top-1 matched the target's
    seen: int          # examples
    grad_norm: float   # before clipping (NaN when the loss was not finite)
    nonfinite: str | None = None  # "loss" or "gradients": not finite, so the step was not applied
    overflow: bool = False        # fp16: the gradient scaler found an overflow and left the step out
    bad_ranks: tuple = ()         # the processes whose loss was not finite
    origins: list = field(default_factory=list)  # per micro-batch: (stream position, rows of non-finite loss)

    @property
    def applied(self) -> bool:
        """Whether the optimiser (and the EMA) took this step."""
        return self.nonfinite is None and not self.overflow


def train_step(s, batches: Iterator, lr: float, size: int) -> StepResult:
    """One optimiser step of the set-up ``s`` at learning rate ``lr`` on images of ``size`` pixels.

    A step whose loss (on any process) or gradients are not finite numbers is not applied:
    no optimiser or EMA update, its gradients dropped; the result says why, and the loop
    decides whether to stop (``run.on_nonfinite``).  Under fp16 the gradient scaler tells
    an overflow of the scaled gradients from a bad step: it leaves the step out and halves
    its scale (``overflow``), which is the scaler's normal working, not an error.

    A compiled model whose step fails (a compiler error, or a compiled kernel that refuses
    a new input size) is given up with a warning: the step is redone eagerly on the same
    micro-batches, and the run goes on eager.
    """
    cfg = s.cfg
    for group in s.optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    compiled = hasattr(s.trained, "_orig_mod")  # torch.compile's wrapper
    taken: list = []
    try:
        loss_sum, correct, seen, origins = accumulate(s, _kept(batches, taken) if compiled else batches, size)
    except Exception as err:  # noqa: BLE001 - any failure of the compiled step: eager decides
        if not compiled:
            raise
        first_line = (str(err).strip().splitlines() or [""])[0][:200]
        warnings.warn(f"torch.compile failed ({type(err).__name__}: {first_line}); training continues eager",
                      RuntimeWarning, stacklevel=2)
        s.trained = s.trained._orig_mod
        s.optimizer.zero_grad(set_to_none=True)
        loss_sum, correct, seen, origins = accumulate(s, itertools.chain(list(taken), batches), size)

    # every process must take the same decision, and another's loss may be the bad one
    bad_ranks = ranks_with_nonfinite(loss_sum, s.world)
    if bad_ranks:
        s.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_sum, correct, seen, float("nan"), nonfinite="loss", bad_ranks=bad_ranks,
                          origins=origins)
    if s.scaler is not None:
        s.scaler.unscale_(s.optimizer)  # the clipping and the check below see the true gradients
    grad_norm = gradient_norm(s, cfg.optim.clip_norm)  # the same on every process: the gradients are reduced
    if not math.isfinite(grad_norm):
        if s.scaler is not None:  # it finds the overflow too: no optimiser step, and the scale halves
            s.scaler.step(s.optimizer)
            s.scaler.update()
        s.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_sum, correct, seen, grad_norm, nonfinite=None if s.scaler else "gradients",
                          overflow=s.scaler is not None, origins=origins)
    if s.scaler is not None:
        s.scaler.step(s.optimizer)
        s.scaler.update()
    else:
        s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    if s.ema is not None:
        s.ema.update(s.model)
    return StepResult(loss_sum, correct, seen, grad_norm, origins=origins)


def ranks_with_nonfinite(value: float, world) -> tuple:
    """The ranks whose ``value`` is not a finite number (a collective call)."""
    flags = [0.0] * world.size
    flags[world.rank] = 0.0 if math.isfinite(value) else 1.0
    return tuple(rank for rank, flag in enumerate(all_reduce_sum(flags, world)) if flag)


def gradient_norm(s, clip_norm: float) -> float:
    """The global gradient norm, the gradients clipped to ``clip_norm`` first when it is > 0."""
    params = [p for p in s.trained.parameters() if p.requires_grad]
    # max_norm=inf measures without clipping (the gradients are multiplied by 1)
    norm = torch.nn.utils.clip_grad_norm_(params, clip_norm if clip_norm > 0 else float("inf"))
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: a DTensor over all shards
