"""The CIFAR recipe's hybrid (R14x1 stem + 3 ViT blocks): what its training step costs.

    python benchmarks/hybrid.py                    # every experiment
    python benchmarks/hybrid.py sizes

``sizes``: progressive resizing's premise, a training step on 32-pixel images against one
on 24-pixel images under ``torch.compile`` (one static graph each), and a 32-pixel step of
a model that dynamo recompiled with a symbolic size after seeing 24 (what
``torch.compile``'s default, and so the training loop, would do on a size change).
``compile``: ``torch.compile`` against eager, and the first compiled step's time.
Batch 256, every core, wall time, interleaved.  Findings: benchmarks/NOTES.md.
"""
from __future__ import annotations

import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from harness import compare, run_experiments
from vitlab.machine import usable_cores
from vitlab.models.registry import build_model


def _recipe_model(variant: str = "hybrid"):
    """The recipe's hybrid as ``vitlab train`` builds it (``hybrid``: BatchNorm stem; ``hybrid_bit``: BiT's)."""
    from vitlab.configs.cifar10_scratch import get_config
    from vitlab.train.build import architecture

    return build_model(architecture(get_config(variant), num_classes=10))


def _train_step(forward, x: torch.Tensor, y: torch.Tensor, opt: torch.optim.Optimizer) -> Callable[[], None]:
    def go() -> None:
        F.cross_entropy(forward(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return go


def exp_sizes() -> None:
    torch.set_num_threads(usable_cores())
    y = torch.randint(0, 10, (256,))
    steps = {}
    for label, size, dynamic in (("32 pixels (static)", 32, False), ("24 pixels (static)", 24, False),
                                 ("32 pixels after 24 (automatic dynamic)", 32, None)):
        torch.manual_seed(0)
        model = _recipe_model()
        assert model.cfg.dynamic_img_size  # the recipe has progressive_sizes
        forward = torch.compile(model, dynamic=dynamic)
        opt = torch.optim.AdamW(model.parameters())
        if dynamic is None:  # the first size it sees, so that 32 triggers the recompile
            _train_step(forward, torch.randn(256, 3, 24, 24), y, opt)()
        steps[label] = _train_step(forward, torch.randn(256, 3, size, size), y, opt)
    compare("hybrid R14x1-BN+ViT-CIFAR/1 training step by input size, torch.compile, batch 256 (AdamW)",
            steps, rounds=7)


def exp_compile() -> None:
    torch.set_num_threads(usable_cores())
    torch.manual_seed(0)
    eager, compiled = _recipe_model(), _recipe_model()
    forward = torch.compile(compiled)
    x, y = torch.randn(256, 3, 32, 32), torch.randint(0, 10, (256,))
    compiled_step = _train_step(forward, x, y, torch.optim.AdamW(compiled.parameters()))
    t = time.perf_counter()
    compiled_step()
    print(f"\ncompile: first training step of the compiled hybrid took {time.perf_counter() - t:.0f} s wall")
    compare("torch.compile, hybrid R14x1-BN+ViT-CIFAR/1, batch 256, training step (AdamW)",
            {"eager": _train_step(eager, x, y, torch.optim.AdamW(eager.parameters())),
             "torch.compile": compiled_step}, rounds=5)


EXPERIMENTS = {"sizes": exp_sizes, "compile": exp_compile}

if __name__ == "__main__":
    sys.exit(run_experiments(EXPERIMENTS, sys.argv[1:], __doc__))
