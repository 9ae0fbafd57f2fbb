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


@torch.no_grad()
def whiten_patch_embedding_(patch_embed: nn.Conv2d, images: torch.Tensor, eps: float = 5e-4) -> nn.Conv2d:
    """Initialise a patch embedding from the data: its filters whiten the image patches.

    Each of the C*P*P principal directions of the patches in ``images`` (B, C, H, W, as
    the model sees them) becomes a filter scaled by 1/sqrt(eigenvalue + eps), so the
    first embeddings are decorrelated and of unit variance.  Directions are taken in
    +/- pairs (as airbench whitens its first convolution) so a following nonlinearity or
    LayerNorm sees both signs; filters beyond 2*C*P*P keep their random init.  The
    bias centres the embeddings on the patches' mean.  Not in the paper: it gives a
    model trained from scratch on a small budget a head start.
    """
    out = patch_embed.weight.shape[0]
    ph, pw = patch_embed.kernel_size
    patches = images.float().unfold(2, ph, ph).unfold(3, pw, pw)  # (B, C, gh, gw, ph, pw)
    patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, patch_embed.weight[0].numel())
    mean = patches.mean(0)
    centred = patches - mean
    cov = centred.T @ centred / max(len(centred) - 1, 1)
    eigvals, eigvecs = torch.linalg.eigh(cov.double())
    order = eigvals.argsort(descending=True)
    filters = (eigvecs[:, order] / (eigvals[order].clamp_min(0) + eps).sqrt()).T.float()  # (K, C*P*P)
    filters = torch.cat([filters, -filters])[:out]
    weight = patch_embed.weight.view(out, -1)
    weight[: len(filters)] = filters.to(weight)
    if patch_embed.bias is not None:
        patch_embed.bias.copy_(-(weight @ mean.to(weight)))
    return patch_embed
