"""A model in eval mode for the length of a block, and its caller's modes back after it.

What scores, inspects or traces a model runs it in eval mode: no dropout in a score, a map or a
traced graph.  The model is the caller's, and its modes are the caller's too, module by module:
one fine-tuning around a frozen backbone or a frozen normalisation holds that part in eval mode
while the rest trains.  ``model.train(was_training)`` would give the root's mode to every module
and set the frozen part training; ``evaluating`` puts back each module's own flag instead.

    with evaluating(model):
        logits = model(x)
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

__all__ = ["evaluating"]


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode inside the block; after it, every module in the mode it came in."""
    # each module's own flag: the root's alone cannot say which parts the caller held in eval mode
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        # the flag itself, not module.train(flag): train() recurses, and would overwrite the children's
        for module, training in modes:
            module.training = training
