"""The fast path: an explicit, reversible layer of speed on top of the plain model.

    model = vitlab.create_model("ViT-B/16")      # plain PyTorch, the model you read
    vitlab.fast.optimize(model)                  # in place; returns the model
    vitlab.fast.restore(model)                   # the plain model again
    with vitlab.fast.optimized(model): ...       # optimised inside the block only

``optimize`` gives the model's dense layers and encoder blocks subclasses with faster
forwards (``modules.py``): CPU matmuls by the kernel a rule or a stored calibration
chooses (``kernels.py``), LayerNorm and GELU outputs recomputed in the backward instead
of stored, inference over chunks of images with the bf16 weights cast into one shared
buffer, held, or packed into the fp32 weights' own bytes (``packing.py``).  Parameters,
buffers, state-dict keys and hooks are untouched; outputs and gradients equal the plain
model's up to floating-point rounding (``tests/test_fast.py``).
The design and its measurements: ``docs/performance.md``.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

from .kernels import (KernelChoice, KernelUnavailable, auto_precision, bf16_is_faster, check_runnable, choose,
                      rule_choice)
from .modules import (INFERENCE_WEIGHTS, FastBlock, FastLinear, FastOptions, install, installed, uninstall,
                      unpack_weights)


def optimize(model: nn.Module, kernels: KernelChoice | None = None, recompute: bool = True,
             inference_weights: str = "cast") -> nn.Module:
    """Install the fast path on ``model`` in place and return it.

    kernels: the CPU kernels (default ``choose()``: this CPU's stored calibration, else the rule);
        a choice this machine cannot run is refused (``KernelUnavailable``, naming the missing feature).
    recompute: recompute LayerNorm and GELU outputs in the backward (less memory, same gradients).
    inference_weights: how a dense layer gets its bf16 weight in CPU bf16 autocast inference:
        "cast" it in every call into one buffer the layers share (the default: the parameters
        always hold their fp32 values), "hold" a cast copy between calls (for half the weights'
        memory again), or "pack" it into the fp32 weight's own bytes, exactly reversible, for
        inference-only use such as ``vitlab eval`` and ``vitlab predict`` (``FastOptions``
        says what reads the weights correctly while they are packed).
    Optimising an optimised model replaces its options.
    """
    return install(model, FastOptions(check_runnable(kernels) if kernels else choose(), recompute, inference_weights))


def restore(model: nn.Module) -> nn.Module:
    """Undo ``optimize``: every module is the plain one again (same parameters and hooks)."""
    return uninstall(model)


def installed_options(model: nn.Module) -> FastOptions | None:
    """The options ``optimize`` installed on ``model``, or None."""
    return installed(model)


def is_optimized(model: nn.Module) -> bool:
    """Whether ``optimize`` has installed anything on ``model``."""
    return installed(model) is not None


@contextlib.contextmanager
def optimized(model: nn.Module, kernels: KernelChoice | None = None, recompute: bool = True,
              inference_weights: str = "cast") -> Iterator[nn.Module]:
    """``optimize`` for the ``with`` block; on exit the model is as it was (options included)."""
    before = installed(model)
    optimize(model, kernels, recompute, inference_weights)
    try:
        yield model
    finally:
        if before is None:
            restore(model)
        else:
            install(model, before)


__all__ = ["INFERENCE_WEIGHTS", "FastBlock", "FastLinear", "FastOptions", "KernelChoice", "KernelUnavailable",
           "auto_precision", "bf16_is_faster", "check_runnable", "choose", "installed_options", "is_optimized", "optimize", "optimized", "restore",
           "rule_choice", "unpack_weights"]
