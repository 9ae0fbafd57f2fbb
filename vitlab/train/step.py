"""One optimiser step, in order (nothing else happens):

    K times: next micro-batch -> forward (autocast) -> loss / K -> backward
             (DDP all-reduces the gradients on the K-th only)
    clip the global gradient norm -> optimiser step -> zero grads -> EMA update
"""
from __future__ import annotations

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
    """One optimiser step of the set-up ``s`` at learning rate ``lr`` on images of ``size`` pixels."""
    cfg, K = s.cfg, s.cfg.optim.accum_steps
    for group in s.optimizer.param_groups:
        group["lr"] = lr
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
