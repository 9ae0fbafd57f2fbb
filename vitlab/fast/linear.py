"""The matrix multiplies of the fast path's dense layers, forward and backward."""
from __future__ import annotations

import torch


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by oneDNN's matmul on the plain weight (CPU, fp32 or bf16; no autograd)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
