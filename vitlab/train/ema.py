"""An exponential moving average of the weights (Polyak averaging).

The paper fine-tunes its largest models on ImageNet (Table 2) with "Polyak & Juditsky (1992)
averaging with a factor of 0.9999" (Sec. 4.1): after every optimiser step

    avg <- decay * avg + (1 - decay) * w

for every parameter; buffers are copied.  The average starts equal to the weights.
"""
from __future__ import annotations

import copy

import torch
from torch import nn


class EMA:
    """Holds ``module``: a copy of the model whose weights are the running average."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.module = copy.deepcopy(model).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module, weight: torch.Tensor | float = 1.0) -> None:
        """One step of the average; ``weight`` 0 (a tensor, decided on the device) leaves it as
        it was, buffers too: the trainer's step that was not applied (whose forward moved the
        model's batch statistics all the same)."""
        avg = list(self.module.parameters())
        cur = [p.detach() for p in model.parameters()]
        rate = (1.0 - self.decay) * weight
        # avg += rate * (cur - avg); a rate on the device is given once per tensor: as the one weight of
        # _foreach_lerp_ it would be read back to the host, a GPU's wait at every step
        torch._foreach_lerp_(avg, cur, [rate] * len(avg) if torch.is_tensor(rate) else rate)
        taken = weight > 0  # a device flag, or a bool
        for b_avg, b in zip(self.module.buffers(), model.buffers()):
            b_avg.copy_(torch.where(taken, b, b_avg) if torch.is_tensor(taken) else (b if taken else b_avg))

    def state_dict(self) -> dict:
        return {"decay": self.decay, "module": self.module.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.decay = state["decay"]
        self.module.load_state_dict(state["module"])
