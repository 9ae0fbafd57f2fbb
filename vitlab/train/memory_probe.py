"""A GPU run's micro-batch chosen by measurement (``optim.accum_steps="auto"``).

    proposed = smallest_fitting_accum(shape, batch, available)      # the estimate's choice
    with step_probe(cfg, arch, img_size, precision, kernels, device) as step_peak:
        choice = fewest_fitting_accum(batch, proposed, step_peak, free, state)
    choice.accum_steps, choice.step_peak, choice.record()

``resolve.plan_memory`` calls it, once, when the run is resolved (before its data is decoded
or its model built), so the number is decided before training starts like every other "auto"
and config.json records it.

The rule: the fewest micro-batches per step (a divisor of the process's batch) whose
measured step peak, plus the optimiser's state, the weight average and, where a CUDA-graphed run
accumulates, its held gradients (which the probe does not build: counted from the parameters), is
at most ``SAFETY`` of the GPU's free memory.
The candidates start at the estimate's choice and go up (fewer, larger micro-batches) while
they fit, or down while they do not; a candidate that runs out of memory does not fit.

What is measured: ``torch.cuda.max_memory_allocated`` over a forward and backward of one
micro-batch, after a first one left its gradients in place, as they are when the next
micro-batch of an accumulated step runs.  The model is a throwaway one built as the run will
train it: the architecture at the training size, the run's precision (autocast), the fast
path and fp8 matmuls where the run has them, masked patch prediction's head; random images
and uniform targets.  The run's own model is never touched (it does not exist yet), and the
probe leaves the process's random streams as it found them and its GPU memory emptied
(``torch.cuda.empty_cache``, the peak statistics reset).  Not measured: torch.compile's
graphs (a compile per candidate), DDP's gradient buckets and FSDP's shards (``resolve``
measures single-process runs only), an evaluation (it keeps no gradients or activations);
``SAFETY``'s tenth is left for them and for the caching allocator's rounding.

On a CPU the estimate stays the rule: the host's memory is shared with the decoded data and
the rest of the system, malloc's heap keeps what a step frees, and a process's resident set
cannot be reset between candidates, so no reading of it in-process is a measurement to trust.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from vitlab import fast
from vitlab.config import Architecture, ConfigError, replace
from vitlab.fast.kernels import attention_backends, autocast

from .memory_estimate import gb
from .step import example_losses

# the share of the GPU's free memory a measured plan may use (module text)
SAFETY = 0.9

StepPeak = Callable[[int], int]  # micro-batch -> peak bytes of one training step; raises OutOfMemoryError


@dataclass(frozen=True)
class MeasuredChoice:
    """The micro-batch the measurement chose, and what it measured (bytes)."""

    accum_steps: int
    micro_batch: int
    step_peak: Optional[int]       # measured at ``micro_batch`` (None: out of memory there)
    state: int                     # the optimiser's state and the weight average, added to it
    free: int                      # the GPU's free memory when the run was resolved
    proposed_accum: Optional[int]  # the estimate's choice (None: it found none that fits)
    tried: dict = field(default_factory=dict)  # micro-batch -> measured peak (None: out of memory)

    @property
    def needs(self) -> Optional[int]:
        return None if self.step_peak is None else self.step_peak + self.state

    @property
    def fits(self) -> bool:
        return self.needs is not None and self.needs <= SAFETY * self.free

    def record(self) -> dict:
        """What --show-config and config.json state beside the estimate (GB)."""
        def rounded(size):
            return None if size is None else round(size / 1e9, 3)

        return {"micro_batch": self.micro_batch, "accum_steps": self.accum_steps,
                "step_peak_gb": rounded(self.step_peak), "optimizer_state_gb": rounded(self.state),
                "needs_gb": rounded(self.needs), "gpu_free_gb": rounded(self.free), "safety": SAFETY,
                "estimated_accum_steps": self.proposed_accum,
                "tried_gb": {str(m): rounded(peak) if peak is not None else "out of memory"
                             for m, peak in sorted(self.tried.items())}}


def fewest_fitting_accum(batch: int, proposed: Optional[int], step_peak: StepPeak, free: int,
                         state: int | Callable[[int], int], check: bool = True,
                         settings: tuple[str, ...] = ()) -> MeasuredChoice:
    """The fewest micro-batches per step, a divisor of this process's ``batch``, whose measured
    peak (``step_peak(micro_batch)``) plus ``state`` fits in ``SAFETY`` of ``free``: tried
    from the estimate's ``proposed`` count up to larger micro-batches while they fit, down
    while they do not (None: from micro-batch 1 up).  ``state``: bytes, or a function of the
    count of micro-batches giving them (the held gradients of a CUDA-graphed run that accumulates).
    Where even micro-batch 1 does not fit, ``check`` refuses the run in one line naming
    ``settings`` that would (ConfigError); without it, micro-batch 1 is taken."""
    counts = [k for k in range(1, batch + 1) if batch % k == 0]  # fewest micro-batches first
    tried: dict[int, Optional[int]] = {}
    state_at = state if callable(state) else (lambda accum: state)

    def fits(accum: int) -> bool:
        micro = batch // accum
        try:
            tried[micro] = step_peak(micro)
        except RuntimeError as err:  # torch.cuda.OutOfMemoryError, or a library's workspace not allocated
            if not isinstance(err, torch.cuda.OutOfMemoryError) and "out of memory" not in str(err).lower():
                raise
            tried[micro] = None
        return tried[micro] is not None and tried[micro] + state_at(accum) <= SAFETY * free

    i = counts.index(proposed) if proposed in counts else len(counts) - 1
    if fits(counts[i]):
        while i > 0 and fits(counts[i - 1]):
            i -= 1
    else:
        i += 1
        while i < len(counts) and not fits(counts[i]):
            i += 1
    if i == len(counts):  # not even one example per micro-batch
        choice = MeasuredChoice(batch, 1, tried.get(1), state_at(batch), free, proposed, tried)
        if check:
            raise measured_refusal(choice, settings)
        return choice
    micro = batch // counts[i]
    return MeasuredChoice(counts[i], micro, tried[micro], state_at(counts[i]), free, proposed, tried)


def measured_refusal(choice: MeasuredChoice, settings: tuple[str, ...]) -> ConfigError:
    """The one-line error of a GPU run whose step does not fit at micro-batch 1, measured."""
    needs = (f"{gb(choice.needs)} on the GPU at micro-batch 1 (measured: the step {gb(choice.step_peak)}, "
             f"the optimiser's state {gb(choice.state)})" if choice.needs is not None
             else "more than the GPU has at micro-batch 1 (measured: the step ran out of memory)")
    fits = (f"settings that fit: {', '.join(settings)}" if settings
            else "no accumulation fits: train a smaller model or at a smaller --img-size, or free GPU memory")
    return ConfigError(f"run.memory_check: this run's training step needs {needs}, more than {SAFETY:.0%} of the "
                       f"{gb(choice.free)} free there; {fits}; to run anyway, --set run.memory_check=false")


# ----------------------------------------------------------------------------- the probe on the GPU


@contextmanager
def step_probe(cfg, arch: Architecture, img_size: tuple, precision: str, kernels, device: torch.device
               ) -> Iterator[StepPeak]:
    """``step_peak(micro_batch)``: the peak bytes of one training step of the run ``cfg`` (a
    resolved ``TrainConfig`` whose model is ``arch``) at ``img_size`` on ``device``, on a
    throwaway model built at the first call (module text), less what the process held on the
    device before (the free memory it is held against already leaves that out).  On leaving, the
    model and its gradients are freed and the allocator's cache emptied; the random streams
    are restored."""
    built: list[nn.Module] = []
    held_before = torch.cuda.memory_allocated(device)

    def step_peak(micro_batch: int) -> int:
        try:
            if not built:
                built.append(probe_model(cfg, arch, img_size, kernels, device))
            model = built[0]
            model.zero_grad(set_to_none=True)
            images = torch.randn(micro_batch, arch.in_chans, *img_size, device=device)
            _forward_backward(model, images, cfg, precision, device)  # its gradients stay, as in accumulation
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            _forward_backward(model, images, cfg, precision, device)
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device) - held_before
        finally:  # also after running out of memory: the next candidate starts from the weights alone
            if built:
                built[0].zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

    with torch.random.fork_rng(devices=[device]):
        torch.manual_seed(0)
        try:
            yield step_peak
        finally:
            built.clear()
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)


def probe_model(cfg, arch: Architecture, img_size: tuple, kernels, device: torch.device) -> nn.Module:
    """A model as ``cfg``'s run trains it (``build.build``'s order: fp8 layers, then the fast
    path), initialised on ``device``, in training mode."""
    from vitlab.models.registry import build_model

    with torch.device(device):  # initialised where it runs: no host copy of the weights
        model = build_model(replace(arch, img_size=tuple(img_size)))
        if cfg.model.mpp is not None:
            from vitlab.models.mpp import MaskedPatchPrediction

            model = MaskedPatchPrediction(model, target=cfg.model.mpp, rate=cfg.model.mpp_rate)
        model = model.to(device).train()
        if cfg.run.fp8 != "off":
            fast.install_fp8(model, cfg.run.fp8, tuple(cfg.run.fp8_layers), cfg.run.fp8_backend)
        if cfg.run.fast:
            fast.optimize(model, kernels)
    return model


def _forward_backward(model: nn.Module, images: torch.Tensor, cfg, precision: str, device: torch.device) -> None:
    with autocast(device, precision), attention_backends(cfg.run.gpu_attention):
        out = model(images)
    if cfg.model.mpp is not None:
        loss = out.loss
    else:
        targets = torch.full(out.shape, 1.0 / out.shape[-1], device=device)
        loss = example_losses(out, targets, cfg.optim.loss).mean()
    loss.backward()
