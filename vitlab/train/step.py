"""One optimiser step, in order (nothing else happens, and nothing is read back to the host):

    K times: next micro-batch -> forward (autocast) -> loss / K (fp16: x the loss scale)
             -> backward (DDP all-reduces the gradients on the K-th only)
             -> under CUDA graphs, where a compiled call follows: the gradients copied out of
                the graph's memory (``HeldGradients``)
    fp16: unscale the gradients
    ``Update``: clip the global gradient norm
                skip = the loss on any process, or the gradient norm, is not finite   (a device flag)
                optimiser step told ``skip``: a skipped step moves no parameter and no optimiser state
                EMA update, weighted by ``1 - skip``
    skip: BatchNorm's running statistics put back as they were before the forward
    zero grads

``Update`` runs eagerly, or as one compiled graph (``run.compile_optimizer``): where the model
is CUDA-graphed, a step is then the model's graphs and this one, replayed.

Every number the step produces (loss, correct predictions, gradient norm, the flags) stays
on the device; ``StepResult.read`` brings them back, and the loop calls it every
``run.log_every`` steps (``numerics.NonFinite.check``): a non-finite step is never applied,
and is named, with its examples, a few steps late.  docs/reliability.md states the design.
"""
from __future__ import annotations

import itertools
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F

from vitlab.fast.compiled import failure_summary
from vitlab.fast.kernels import attention_backends, autocast

from .distributed import all_reduce_tensor
from .optim import TracedStep, skips_on_device

__all__ = ["HeldGradients", "StepResult", "Update", "autocast", "endless", "example_losses", "loss_fn", "train_step"]


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


@dataclass
class StepResult:
    """One step's numbers, as device tensors (``read`` brings them to the host)."""

    loss: torch.Tensor       # () the mean training loss of this process's examples
    correct: torch.Tensor    # () this process's examples whose top-1 matched the target's
    seen: int                # this process's examples
    grad_norm: torch.Tensor  # () before clipping
    bad_ranks: torch.Tensor  # (world size,) 1 where that process's loss was not finite
    skipped: torch.Tensor    # () 1: the update was left out (a non-finite loss or gradient norm)
    overflow: torch.Tensor | None = None  # () fp16: 1 where the scaler's overflow left the step out
    origins: list = field(default_factory=list)  # per micro-batch: (stream position, (B,) finite-loss rows or None)

    def flags(self) -> torch.Tensor:
        """(2,) [skipped, overflow] on the device: what the loop reads for many steps at once."""
        overflow = self.overflow if self.overflow is not None else torch.zeros_like(self.skipped)
        return torch.stack([self.skipped, overflow])

    def read(self) -> "CheckedStep":
        """The step's numbers on the host (a device-to-host read: the loop's log steps only)."""
        loss, grad_norm, skipped, overflow = torch.stack(
            [self.loss.float(), self.grad_norm.float(), *self.flags().float()]).tolist()
        bad_ranks = tuple(r for r, flag in enumerate(self.bad_ranks.tolist()) if flag)
        nonfinite = None
        if skipped and not overflow:
            nonfinite = "loss" if bad_ranks else "gradients"
        rows = [None if finite is None else (~finite).nonzero().flatten().tolist() for _, finite in self.origins]
        return CheckedStep(loss, grad_norm, nonfinite, bool(overflow), bad_ranks,
                           [(position, r) for (position, _), r in zip(self.origins, rows)])


@dataclass
class CheckedStep:
    """A step's numbers read back: what ``numerics.NonFinite`` reports about a bad step."""

    loss: float
    grad_norm: float
    nonfinite: str | None  # "loss" or "gradients": not finite, so the step was not applied
    overflow: bool         # fp16: the gradient scaler found an overflow and left the step out
    bad_ranks: tuple       # the processes whose loss was not finite
    origins: list          # per micro-batch: (stream position, rows whose loss was not finite)

    @property
    def applied(self) -> bool:
        return self.nonfinite is None and not self.overflow


def accumulate(setup, batches: Iterator, size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, int, list]:
    """Forward and backward of ``optim.accum_steps`` micro-batches: (mean loss, correct,
    examples, origins), the first two as device tensors; ``origins`` holds, per micro-batch,
    where the stream took it from and which of its rows had a finite loss (on the device)."""
    cfg, K = setup.cfg, setup.cfg.optim.accum_steps
    loss_sum = torch.zeros((), device=setup.world.device)
    correct = torch.zeros((), device=setup.world.device)
    seen = 0
    origins = []
    for micro in range(K):
        x, targets = next(batches)
        position = stream_position(setup.stream)
        if size != tuple(x.shape[-2:]):  # a progressive-resizing phase: (H, W) compared, a non-square run's too
            x = F.interpolate(x, size=size, mode="bilinear", antialias=True)
        sync = micro == K - 1 or setup.world.size == 1
        with (nullcontext() if sync or not hasattr(setup.trained, "no_sync") else setup.trained.no_sync()):
            with autocast(setup.world.device, setup.precision), attention_backends(cfg.run.gpu_attention):
                out = setup.trained(x)
            finite_rows = None
            if cfg.model.mpp is None:
                losses = example_losses(out, targets, cfg.optim.loss)
                loss = losses.mean()
                finite_rows = torch.isfinite(losses.detach())  # which examples a bad step names
                correct += top1_correct(out.detach(), targets)
            else:  # masked patch prediction: its own loss; "correct" counts images' worth of right patches
                loss = out.loss
                correct += x.shape[0] * mpp_accuracy(out)
            # fp16: the loss is scaled up so that small gradients do not flush to zero in half precision
            ((setup.scaler.scale(loss) if setup.scaler is not None else loss) / K).backward()
        if setup.held_gradients is not None:
            setup.held_gradients.take()
        loss_sum += loss.detach().float() / K
        origins.append((position, finite_rows))
        seen += x.shape[0]
    return loss_sum, correct, seen, origins


def top1_correct(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """() the examples whose top-1 class has the largest target weight: a one-hot, smoothed or
    mixed target's largest class, or any of a multi-hot (multi-label) target's labels, as
    big_vision's prec@1 counts them on multi-label sets."""
    picked = targets.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1)
    return (picked == targets.max(-1).values).sum()


def stream_position(stream) -> tuple:
    """Where the micro-batch just taken came from: ("memory", epoch, batch) of a
    ``BatchStream``; ("stream", the readers' (epoch, samples read)) of a streamed set."""
    if hasattr(stream, "batch_indices"):
        return ("memory", stream.epoch, stream.position - 1)
    return ("stream", tuple(getattr(stream, "positions", ())))


def mpp_accuracy(out) -> torch.Tensor:
    """() the share of corrupted patches whose predicted colour classes are right (0 for "pixels")."""
    if out.targets.is_floating_point():
        return torch.zeros((), device=out.targets.device)
    return (out.predictions.detach().argmax(-1) == out.targets).float().mean()


def endless(stream) -> Iterator:
    """The stream's micro-batches, epoch after epoch."""
    while True:
        yield from stream


def train_step(setup, batches: Iterator, lr: float, size: tuple[int, int]) -> StepResult:
    """One optimiser step of ``setup`` at learning rate ``lr`` on images of ``size`` (H, W) pixels.

    A step whose loss (on any process) or gradients are not finite numbers is not applied:
    the optimiser is told so on the device (``found_inf``) and moves nothing, the EMA is not
    updated, BatchNorm's running statistics are put back as they were before its forward, and
    the gradients are dropped; the result's flags say so, and the loop reads
    them at its next log step and decides whether to stop (``run.on_nonfinite``).  Under
    fp16 the gradient scaler tells an overflow of the scaled gradients from a bad step: the
    step is left out and its scale halves, which is the scaler's normal working.

    A compiled model whose step fails (a compiler error, or a compiled kernel that refuses
    a new input size) is given up with a warning: the step is redone eagerly on the same
    micro-batches, and the run goes on eager.  So is a compiled update (``Update``), alone.
    """
    for group in setup.optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    kept = setup.update.keep_statistics()  # the forward moves them before the step is known to be good
    compiled = hasattr(setup.trained, "_orig_mod")  # torch.compile's wrapper
    taken: list = []
    try:
        loss_sum, correct, seen, origins = accumulate(setup, _kept(batches, taken) if compiled else batches, size)
    except Exception as err:  # noqa: BLE001 - any failure of the compiled step: eager decides
        if not compiled:
            raise
        warnings.warn(f"torch.compile failed ({failure_summary(err)}); training continues eager", RuntimeWarning,
                      stacklevel=2)
        setup.trained = setup.trained._orig_mod
        setup.optimizer.zero_grad(set_to_none=True)
        loss_sum, correct, seen, origins = accumulate(setup, itertools.chain(list(taken), batches), size)

    # every process must take the same decision, and another's loss may be the bad one
    bad_ranks = torch.zeros(setup.world.size, device=setup.world.device)
    bad_ranks[setup.world.rank] = (~torch.isfinite(loss_sum)).float()
    bad_ranks = all_reduce_tensor(bad_ranks, setup.world)
    if setup.scaler is not None:
        setup.scaler.unscale_(setup.optimizer)  # the clipping and the check below see the true gradients
    grad_norm, skipped = setup.update(bad_ranks)  # the same on every process: the gradients are reduced
    setup.update.restore_statistics(kept, skipped)
    overflow = None
    if setup.scaler is not None:  # the scaler's own finding (an overflow of the scaled gradients) halves its scale
        overflow = (~torch.isfinite(grad_norm) & (bad_ranks.sum() == 0)).float()
        setup.scaler.update()
    setup.optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_sum, correct, seen, grad_norm, bad_ranks, skipped, overflow, origins)


class Update:
    """What a step does after its backward, on the device and reading nothing back: the global
    gradient norm, the gradients clipped to ``clip_norm`` (when > 0); ``skip`` = a non-finite
    loss on any process (``bad_ranks``) or gradient norm; the optimiser's step, left out where
    ``skip`` is set; the EMA's, weighted by ``1 - skip``.

    ``mode`` "off": eagerly, with torch's fused optimiser kernels (told ``found_inf``).  Else
    (``Resolved.compile_optimizer``) one function compiled in that mode, the optimiser's
    arithmetic traced (``optim.TracedStep``): under "reduce-overhead" one CUDA graph replayed,
    with no launch per parameter from the host; the learning rates are device tensors it reads,
    so a new rate compiles nothing.  It writes no gradient: the clipping's factor is applied
    as the gradients are read.  A compiled update that fails (it is compiled whole, before it
    runs) is given up with a warning and done eagerly, then and from then on.
    """

    def __init__(self, params, optimizer: torch.optim.Optimizer, ema, model: torch.nn.Module, clip_norm: float,
                 mode: str = "off"):
        self.params = [p for p in params if p.requires_grad]
        self.optimizer, self.ema, self.model, self.clip_norm = optimizer, ema, model, clip_norm
        self.statistics = running_statistics(model)
        self.compiled = None if mode == "off" else torch.compile(self.traced, mode=mode, fullgraph=True,
                                                                 dynamic=False)
        self.traced_step: TracedStep | None = None  # made at the first compiled call (a failure falls back)

    def __call__(self, bad_ranks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the gradient norm before clipping, 1 where the step was left out), device tensors."""
        if self.compiled is not None:
            try:
                return self.compiled_update(bad_ranks)
            except Exception as err:  # noqa: BLE001 - any failure of the compiled update: eager decides
                warnings.warn(f"torch.compile of the optimizer step failed ({failure_summary(err)}); the optimizer "
                              "step continues eager", RuntimeWarning, stacklevel=3)
                self.compiled = None
        return self.eager(bad_ranks)

    def eager(self, bad_ranks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        grad_norm = gradient_norm(self.params, self.clip_norm)
        skipped = ((bad_ranks.sum() > 0) | ~torch.isfinite(grad_norm)).float()
        if skips_on_device(self.optimizer):
            self.optimizer.found_inf = skipped
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
        elif not bool(skipped):  # an optimiser that cannot leave a step out on the device: the one host read
            self.optimizer.step()
        if self.ema is not None:
            self.ema.update(self.model, weight=1.0 - skipped)
        return grad_norm, skipped

    def keep_statistics(self) -> list[torch.Tensor]:
        """Copies of the running statistics (``running_statistics``), taken before a step's forward."""
        return [t.clone() for t in self.statistics]

    def restore_statistics(self, kept: list[torch.Tensor], skipped: torch.Tensor) -> None:
        """The running statistics as ``kept`` where the step was left out (decided on the device):
        its forward updated them, from the examples whose loss was not finite too."""
        if kept:
            left_out = skipped.bool()
            for t, before in zip(self.statistics, kept):
                t.copy_(torch.where(left_out, before, t))

    def compiled_update(self, bad_ranks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.traced_step is None:
            self.traced_step = TracedStep(self.optimizer)
            for t in [*self.ema.module.parameters(), *self.ema.module.buffers()] if self.ema is not None else ():
                torch._dynamo.mark_static_address(t)  # updated in place: one address for the CUDA graph
        self.traced_step.prepare()  # this step's learning rates, on the device
        with torch.no_grad():  # an inference graph: the updates are not recorded for autograd
            numbers = self.compiled(bad_ranks)
        # a CUDA graph's outputs live in its memory, which its next replay overwrites, and the
        # loop reads a step's numbers some steps later
        grad_norm, skipped = numbers.clone().unbind()
        return grad_norm, skipped

    def traced(self, bad_ranks: torch.Tensor) -> torch.Tensor:
        """What ``torch.compile`` traces: (2,) [the gradient norm, skipped]."""
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        skip = (bad_ranks.sum() > 0) | ~torch.isfinite(grad_norm)
        # torch's clip_grad_norm_'s factor, which it multiplies the gradients by in place
        factor = torch.clamp(self.clip_norm / (grad_norm + 1e-6), max=1.0) if self.clip_norm > 0 else None
        self.traced_step(skip, grad_scale=factor)
        if self.ema is not None:
            self.ema.update(self.model, weight=1.0 - skip.float())
        return torch.stack([grad_norm, skip.float()])


class HeldGradients:
    """The gradients moved, after each backward, into buffers of the run's own, one per
    parameter at a fixed address.

    Under CUDA graphs (torch.compile's "reduce-overhead") a backward's gradients are outputs of
    a CUDA graph, in torch's graph memory pool, and the next call of a compiled function after a
    backward starts a new "generation" of torch's CUDA-graph trees, which frees the previous
    one's outputs: the gradients too.  Two calls come after a backward: the update compiled on
    its own (``Update``, ``run.compile_optimizer``) and, under gradient accumulation, the next
    micro-batch's forward.  Copied here first (one foreach copy), the gradients outlive the
    pool; the next micro-batch's backward adds to them in place, and each buffer, marked static,
    is read by the compiled update where it lies, with no copy into the graph's inputs.
    ``zero_grad(set_to_none=True)`` lets go of them as before: the next step's first backward
    gives new gradients, copied in again."""

    def __init__(self, params):
        self.params = [p for p in params if p.requires_grad]
        self.buffers = [torch.zeros_like(p) for p in self.params]
        for buffer in self.buffers:
            torch._dynamo.mark_static_address(buffer)

    def take(self) -> None:
        """Each new gradient copied into its buffer, which becomes the parameter's gradient."""
        moved = [i for i, p in enumerate(self.params) if p.grad is not None and p.grad is not self.buffers[i]]
        if not moved:
            return
        with torch.no_grad():
            torch._foreach_copy_([self.buffers[i] for i in moved], [self.params[i].grad for i in moved])
        for i in moved:
            self.params[i].grad = self.buffers[i]


def running_statistics(model: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers a training forward updates: the running mean, variance and count of
    BatchNorm layers (the CIFAR hybrid's stem); none in a ViT."""
    return [t for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats
            for t in (m.running_mean, m.running_var, m.num_batches_tracked) if t is not None]


def gradient_norm(params: list, clip_norm: float) -> torch.Tensor:
    """() the global gradient norm of ``params``, their gradients clipped to ``clip_norm`` first
    when it is > 0 (on the device: nothing is read back)."""
    # max_norm=inf measures without clipping (the gradients are multiplied by 1)
    norm = torch.nn.utils.clip_grad_norm_(params, clip_norm if clip_norm > 0 else float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a DTensor over all shards
