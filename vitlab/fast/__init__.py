"""The fast path: an explicit, reversible layer of speed on top of the plain model.

    model = vitlab.create_model("ViT-B/16")      # plain PyTorch, the model you read
    vitlab.fast.optimize(model)                  # in place; returns the model
    vitlab.fast.restore(model)                   # the plain model again
    with vitlab.fast.optimized(model): ...       # optimised inside the block only

``optimize`` puts faster modules in the place of the model's dense layers and encoder
blocks (``modules.py``): CPU matmuls by the kernel a rule or a stored calibration chooses
(``kernels.py``), LayerNorm and GELU outputs recomputed in the backward instead of
stored, inference over chunks of images with the bf16 weights cast into one shared
buffer or held.  The installed modules share the plain ones' parameters, state-dict keys
and hooks and keep their own state on themselves; nothing writes into a parameter.
Outputs and gradients equal the plain model's up to floating-point rounding
(``tests/test_fast.py``).  The design and its measurements: ``docs/performance.md``.

FP8 matmuls for training on GPUs that have them are a separate opt-in swap of the encoder
blocks' dense layers (``fp8.py``: ``install_fp8``, ``uninstall_fp8``), installed before
``optimize``; ``vitlab train --fp8`` asks for it.

Compiled inference with frozen weights, under CUDA graphs on a GPU, is a third opt-in
(``compiled.py``: ``compile_for_inference``), for weights that no longer change.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

from .compiled import CompiledInference, compile_for_inference
from .fp8 import FP8_BACKENDS, FP8_SCALINGS, Float8Linear, Fp8Swap, fp8_scaling, install_fp8, uninstall_fp8
from .kernels import KernelChoice, KernelUnavailable, check_runnable, choose, cpu_precision, rule_choice
from .modules import (INFERENCE_WEIGHTS, FastBlock, FastLinear, FastOptions, install, installed, need_module,
                      options_by_module, reinstate, uninstall)


def optimize(model: nn.Module, kernels: KernelChoice | None = None, recompute: bool = True,
             inference_weights: str = "cast") -> nn.Module:
    """Install the fast path on ``model`` in place and return it (``model`` itself, unless it is
    a dense layer or an encoder block: then the module standing in for it).

    kernels: the CPU kernels (default ``choose()``: this CPU's stored calibration, else the rule);
        a choice this machine cannot run is refused (``KernelUnavailable``, naming the missing feature).
    recompute: recompute LayerNorm and GELU outputs in the backward (less memory, same gradients).
    inference_weights: how a dense layer gets its bf16 weight in CPU bf16 autocast inference:
        "cast" it in every call into one buffer the layers share (the default, what ``vitlab
        eval`` and ``vitlab predict`` run), or "hold" a cast copy between calls, for half the
        dense weights' memory again (it saves the cast, which counts at small batches only),
        cast again when a parameter changes as torch counts it: not after an edit through
        ``.data``, which calls for ``optimize`` again.  Either way the parameters are only read.
    Optimising an optimised model replaces its options, on the same installed modules.
    """
    return install(model, FastOptions(check_runnable(kernels) if kernels else choose(), recompute, inference_weights))


def restore(model: nn.Module) -> nn.Module:
    """Undo ``optimize``: the plain modules back in their places (the same objects, parameters and
    hooks); returns the model (the plain module when ``model`` itself is an installed one)."""
    return uninstall(model)


def installed_options(model: nn.Module) -> FastOptions | None:
    """The options ``optimize`` installed on ``model``, or None."""
    need_module(model, "installed_options")
    return installed(model)


def is_optimized(model: nn.Module) -> bool:
    """Whether ``optimize`` has installed anything on ``model``."""
    need_module(model, "is_optimized")
    return installed(model) is not None


@contextlib.contextmanager
def optimized(model: nn.Module, kernels: KernelChoice | None = None, recompute: bool = True,
              inference_weights: str = "cast") -> Iterator[nn.Module]:
    """``optimize`` for the ``with`` block, which gets the optimised model; on exit the model is as
    it was: what was installed before with its options, the rest plain (a model optimised in part,
    its encoder alone, say, is so again)."""
    need_module(model, "optimized")
    before = options_by_module(model)
    model = optimize(model, kernels, recompute, inference_weights)
    try:
        yield model
    finally:
        reinstate(model, before)


__all__ = ["CompiledInference", "FP8_BACKENDS", "FP8_SCALINGS", "INFERENCE_WEIGHTS", "FastBlock", "FastLinear", "FastOptions",
           "Float8Linear", "Fp8Swap", "KernelChoice", "KernelUnavailable", "check_runnable", "choose",
           "compile_for_inference", "cpu_precision", "fp8_scaling", "install_fp8", "installed_options", "is_optimized",
           "optimize", "optimized", "restore", "rule_choice", "uninstall_fp8"]
