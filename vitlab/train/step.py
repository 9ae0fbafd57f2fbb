"""One optimiser step, in order (nothing else happens):

    K times: next micro-batch -> forward (autocast) -> loss / K -> backward
             (DDP all-reduces the gradients on the K-th only)
    clip the global gradient norm -> optimiser step -> zero grads -> EMA update
"""
from __future__ import annotations

import itertools
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from vitlab.eval.evaluator import autocast

__all__ = ["StepResult", "autocast", "endless", "loss_fn", "train_step"]


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


def _kept(batches: Iterator, taken: list) -> Iterator:
    """``batches``, each also appended to ``taken`` (for a retry of the step)."""
    for batch in batches:
        taken.append(batch)
        yield batch


def accumulate(s, batches: Iterator, size: int) -> tuple[float, float, int]:
    """Forward and backward of ``optim.accum_steps`` micro-batches: (mean loss, correct, examples)."""
    cfg, K = s.cfg, s.cfg.optim.accum_steps
    loss_sum = correct = 0.0
    seen = 0
    for micro in range(K):
        x, targets = next(batches)
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
            (loss / K).backward()
        loss_sum += float(loss.detach()) / K
        correct += hits
        seen += x.shape[0]
    return loss_sum, correct, seen


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
    grad_norm: float   # before clipping; NaN without clipping


def train_step(s, batches: Iterator, lr: float, size: int) -> StepResult:
    """One optimiser step of the set-up ``s`` at learning rate ``lr`` on images of ``size`` pixels.

    A compiled model whose step fails (a compiler error, or a compiled kernel that refuses
    a new input size) is given up with a warning: the step is redone eagerly on the same
    micro-batches, and the run goes on eager.
    """
    cfg = s.cfg
    for group in s.optimizer.param_groups:
        group["lr"] = lr
    compiled = hasattr(s.trained, "_orig_mod")  # torch.compile's wrapper
    taken: list = []
    try:
        loss_sum, correct, seen = accumulate(s, _kept(batches, taken) if compiled else batches, size)
    except Exception as err:  # noqa: BLE001 - any failure of the compiled step: eager decides
        if not compiled:
            raise
        first_line = (str(err).strip().splitlines() or [""])[0][:200]
        warnings.warn(f"torch.compile failed ({type(err).__name__}: {first_line}); training continues eager",
                      RuntimeWarning, stacklevel=2)
        s.trained = s.trained._orig_mod
        s.optimizer.zero_grad(set_to_none=True)
        loss_sum, correct, seen = accumulate(s, itertools.chain(list(taken), batches), size)

    if cfg.optim.clip_norm > 0:
        params = [p for p in s.trained.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.clip_norm)  # FSDP: a DTensor over all shards
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    else:
        grad_norm = float("nan")
    s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    if s.ema is not None:
        s.ema.update(s.model)
    return StepResult(loss_sum, correct, seen, grad_norm)
