"""LayerNorm -> dense and GELU -> dense with a lighter backward: the element-wise output
is recomputed from its input instead of being stored.

Autograd stores every dense layer's input for the weight gradient.  In a pre-LN block
two of those inputs are LayerNorm outputs and one is the GELU output, whose own inputs
(the residual stream, the first MLP dense's output) are stored anyway for their
backward.  Recomputing the three cheap element-wise results when the backward reaches
them drops 6 of the 16 (tokens x width) activations a block keeps for its backward
(fp32): about a third of a ViT's activation memory, for one LayerNorm and one GELU
forward per block in the backward.  The gradients are the same operations on the same
values as plain autograd's.  The dense layers' matmuls go through ``linear.py``'s modes.

``split_heads`` gives attention its query, key and value as views of the fused qkv
projection and assembles their gradients in one pass into the (B, L, 3, H, D/H)
layout; autograd's own backward of the views stacks them (B, H, L, D/H)-major and then
copies the permuted stack into place.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..models.layers import split_heads as head_views
from .kernels import KernelChoice
from .linear import linear_backward, linear_forward, mode_for


def _kept_input(x: torch.Tensor, mode: str) -> torch.Tensor:
    # what the forward multiplies: autocast's "widened" mode keeps a bf16 copy
    return x.to(torch.bfloat16) if mode == "widened" else x


class _LayerNormDense(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, eps, weight, bias, mode, kernels):
        shape = (x.shape[-1],)
        normed, mean, rstd = torch.native_layer_norm(x, shape, norm_weight, norm_bias, eps)
        out = linear_forward(_kept_input(normed, mode), weight, bias, mode, kernels)
        ctx.eps, ctx.mode, ctx.kernels = eps, mode, kernels
        ctx.save_for_backward(x, mean, rstd, norm_weight, norm_bias, weight)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, mean, rstd, norm_weight, norm_bias, weight = ctx.saved_tensors
        shape = (x.shape[-1],)
        normed = torch.native_layer_norm(x, shape, norm_weight, norm_bias, ctx.eps)[0]
        grad_normed, grad_weight, grad_bias = linear_backward(
            grad_out, _kept_input(normed, ctx.mode), weight, ctx.mode, ctx.kernels, True, *ctx.needs_input_grad[4:6])
        grad_x, grad_norm_weight, grad_norm_bias = torch.ops.aten.native_layer_norm_backward(
            grad_normed.to(normed.dtype), x, shape, mean, rstd, norm_weight, norm_bias,
            [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]])
        return grad_x, grad_norm_weight, grad_norm_bias, None, grad_weight, grad_bias, None, None


class _GeluDense(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, approximate, drop, weight, bias, mode, kernels):
        act = F.gelu(h, approximate=approximate)
        keep = None
        if drop > 0.0:  # the dropout mask is stored (one byte per element), not its output
            keep = torch.empty_like(act, dtype=torch.bool).bernoulli_(1.0 - drop)
            act = act * keep / (1.0 - drop)
        out = linear_forward(_kept_input(act, mode), weight, bias, mode, kernels)
        ctx.approximate, ctx.drop, ctx.mode, ctx.kernels = approximate, drop, mode, kernels
        ctx.save_for_backward(h, keep, weight)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        h, keep, weight = ctx.saved_tensors
        act = F.gelu(h, approximate=ctx.approximate)
        if keep is not None:
            act = act * keep / (1.0 - ctx.drop)
        grad_act, grad_weight, grad_bias = linear_backward(
            grad_out, _kept_input(act, ctx.mode), weight, ctx.mode, ctx.kernels, True, *ctx.needs_input_grad[3:5])
        grad_act = grad_act.to(h.dtype)
        if keep is not None:
            grad_act = grad_act * keep / (1.0 - ctx.drop)
        grad_h = torch.ops.aten.gelu_backward(grad_act, h, approximate=ctx.approximate)
        return grad_h, None, None, grad_weight, grad_bias, None, None


class _SplitHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, num_heads):
        return head_views(qkv, num_heads)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_q, grad_k, grad_v):
        like = next(g for g in (grad_q, grad_k, grad_v) if g is not None)
        grads = [g if g is not None else torch.zeros_like(like) for g in (grad_q, grad_k, grad_v)]
        return torch.stack([g.transpose(1, 2) for g in grads], 2).flatten(2), None


def split_heads(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``models.layers.split_heads`` with the one-pass backward (module text)."""
    return _SplitHeads.apply(qkv, num_heads)


def layer_norm_dense(x: torch.Tensor, norm: torch.nn.LayerNorm, dense: torch.nn.Linear,
                     kernels: KernelChoice) -> torch.Tensor:
    """``dense(norm(x))``, storing x rather than norm(x) for the backward."""
    mode = mode_for(x, kernels)
    return _LayerNormDense.apply(x, norm.weight, norm.bias, norm.eps, dense.weight, dense.bias, mode, kernels)


def gelu_dense(h: torch.Tensor, approximate: str, dropout: torch.nn.Dropout, dense: torch.nn.Linear,
               kernels: KernelChoice) -> torch.Tensor:
    """``dense(dropout(gelu(h)))``, storing h (and the dropout mask) rather than the GELU output."""
    drop = dropout.p if dropout.training else 0.0
    return _GeluDense.apply(h, approximate, drop, dense.weight, dense.bias, mode_for(h, kernels), kernels)
