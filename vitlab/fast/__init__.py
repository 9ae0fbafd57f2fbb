"""The fast path: an explicit, reversible layer of speed on top of the plain model.

    model = vitlab.create_model("ViT-B/16")      # plain PyTorch, the model you read
    vitlab.fast.optimize(model)                  # in place; returns the model
    vitlab.fast.restore(model)                   # the plain model again
    with vitlab.fast.optimized(model): ...       # optimize for the block only

(API contract; the implementation lands in modules.py.)
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

from .kernels import KernelChoice, bf16_is_faster, calibrate, choose, rule_choice


def optimize(model: nn.Module, kernels: KernelChoice | None = None, recompute: bool = True) -> nn.Module:
    return model


def restore(model: nn.Module) -> nn.Module:
    return model


def is_optimized(model: nn.Module) -> bool:
    return False


@contextlib.contextmanager
def optimized(model: nn.Module, **options) -> Iterator[nn.Module]:
    was = is_optimized(model)
    optimize(model, **options)
    try:
        yield model
    finally:
        if not was:
            restore(model)


__all__ = ["KernelChoice", "bf16_is_faster", "calibrate", "choose", "is_optimized", "optimize", "optimized",
           "restore", "rule_choice"]
