"""The official Flax initialisers, written for PyTorch tensors.

The paper's code initialises dense kernels with Xavier-uniform (attention and MLP),
MLP biases with N(0, 1e-6), convolutions and the pre-logits layer with Flax's default
LeCun-normal (a truncated normal), position embeddings with N(0, 0.02), and the
[class] token and the classification head with zeros.
"""
from __future__ import annotations

import math

import torch
from torch import nn

# std of a standard normal truncated to [-2, 2]; Flax divides by it so that the
# truncated distribution has the requested variance.
_TRUNC_STD = 0.87962566103423978


@torch.no_grad()
def lecun_normal_(weight: torch.Tensor) -> torch.Tensor:
    """Flax's default kernel init: truncated normal with variance 1/fan_in."""
    fan_in = weight[0].numel()  # (out, in, *kernel) in PyTorch layout
    std = math.sqrt(1.0 / fan_in) / _TRUNC_STD
    if weight.is_meta:
        return weight
    # Redrawing the samples outside [-2, 2] gives exactly the truncated normal, and is
    # far faster on CPU than nn.init.trunc_normal_'s inverse-CDF method.
    weight.normal_()
    outside = weight.abs() > 2
    while outside.any():
        weight[outside] = torch.randn(int(outside.sum()), dtype=weight.dtype, device=weight.device)
        outside = weight.abs() > 2
    return weight.mul_(std)


@torch.no_grad()
def xavier_uniform_chunks_(weight: torch.Tensor, chunks: int) -> torch.Tensor:
    """Xavier-uniform on each of ``chunks`` row blocks, as if they were separate layers.

    A fused qkv matrix (3D, D) must be initialised like three (D, D) matrices, as the
    official code has them; Xavier on the fused matrix would see fan_out = 3D.
    """
    for part in weight.chunk(chunks, dim=0):
        nn.init.xavier_uniform_(part)
    return weight
