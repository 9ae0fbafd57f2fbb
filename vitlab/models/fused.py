"""LayerNorm -> dense and GELU -> dense with a lighter backward: the element-wise output
is recomputed from its input instead of being stored.

Autograd stores every dense layer's input for the weight gradient.  In a pre-LN block
two of those inputs are LayerNorm outputs and one is the GELU output, whose own inputs
(the residual stream, the first MLP dense's output) are stored anyway for their
backward.  Recomputing the three cheap element-wise results when the backward reaches
them drops 6 of the 16 (tokens x width) activations a block keeps for its backward
(fp32): about a third of a ViT's activation memory, at the cost of one LayerNorm and
one GELU forward per block in the backward.  The gradients are the same operations on
the same values as plain autograd's (``tests/test_models.py`` checks them bit for bit in
fp32).  ``split_heads`` gives attention its query, key and value as views of the fused
qkv projection and, in training, assembles their gradients in one pass.

Autocast: the forward calls ``F.linear`` under whatever autocast is active, as
``nn.Linear`` would; the backward, where autocast is off, does the matmuls in the dtype
of the incoming gradient (the dtype the forward's dense layer ran in).  Weight
gradients come back in that dtype and autograd casts them to the parameter's, as it
does after autocast's own weight cast.  On a CPU whose fp32 GEMM beats its bf16 kernel,
both directions compute bf16 autocast's matmuls by the fp32 GEMM (``bf16_matmul.py``).

``torch.compile`` makes its own choice of what to recompute, and tracing (export) has
no backward, so both get the plain modules (``recompute_wanted``); so does everything
inside ``with store_activations():``, which is how ``benchmarks/ab.py recompute``
compares the two.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from . import bf16_matmul
from .buffers import dense_into_buffer, gelu_of_own


_RECOMPUTE = True


def recompute_wanted() -> bool:
    """Whether a backward may follow this forward, in eager mode, with recomputation on."""
    return _RECOMPUTE and torch.is_grad_enabled() and not torch.compiler.is_compiling()


@contextlib.contextmanager
def store_activations() -> Iterator[None]:
    """Inside the block, store LayerNorm and GELU outputs for the backward as plain autograd does."""
    global _RECOMPUTE
    before, _RECOMPUTE = _RECOMPUTE, False
    try:
        yield
    finally:
        _RECOMPUTE = before


def _dense_forward(ctx, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` as ``nn.Linear`` would run it here, noting in ``ctx`` which GEMM it used."""
    ctx.widened = bf16_matmul.widened(inputs)
    return bf16_matmul.linear(inputs, weight, bias) if ctx.widened else F.linear(inputs, weight, bias)


def _dense_backward(ctx, grad_out: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor,
                    needs_weight: bool, needs_bias: bool
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``F.linear(inputs, weight, bias)`` w.r.t. inputs, weight and bias."""
    if ctx.widened:
        return bf16_matmul.dense_backward(grad_out, inputs, weight, needs_weight, needs_bias)
    dtype = grad_out.dtype
    grad_rows = grad_out.reshape(-1, grad_out.shape[-1])
    grad_weight = grad_rows.t() @ inputs.to(dtype).reshape(-1, inputs.shape[-1]) if needs_weight else None
    grad_bias = grad_rows.sum(0) if needs_bias else None
    grad_inputs = grad_out @ weight.to(dtype)
    return grad_inputs, grad_weight, grad_bias


class _LayerNormDense(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, eps, weight, bias):
        shape = (x.shape[-1],)
        normed, mean, rstd = torch.native_layer_norm(x, shape, norm_weight, norm_bias, eps)
        out = _dense_forward(ctx, normed, weight, bias)
        ctx.eps = eps
        ctx.save_for_backward(x, mean, rstd, norm_weight, norm_bias, weight)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, mean, rstd, norm_weight, norm_bias, weight = ctx.saved_tensors
        shape = (x.shape[-1],)
        normed = torch.native_layer_norm(x, shape, norm_weight, norm_bias, ctx.eps)[0]
        grad_normed, grad_weight, grad_bias = _dense_backward(ctx, grad_out, normed, weight,
                                                                 *ctx.needs_input_grad[4:6])
        grad_x, grad_norm_weight, grad_norm_bias = torch.ops.aten.native_layer_norm_backward(
            grad_normed.to(normed.dtype), x, shape, mean, rstd, norm_weight, norm_bias,
            [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]])
        return grad_x, grad_norm_weight, grad_norm_bias, None, grad_weight, grad_bias


class _GeluDense(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, approximate, drop, weight, bias):
        act = F.gelu(h, approximate=approximate)
        keep = None
        if drop > 0.0:  # the dropout mask is stored (one byte per element), not its output
            keep = torch.empty_like(act, dtype=torch.bool).bernoulli_(1.0 - drop)
            act = act * keep / (1.0 - drop)
        out = _dense_forward(ctx, act, weight, bias)
        ctx.approximate, ctx.drop = approximate, drop
        ctx.save_for_backward(h, keep, weight)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        h, keep, weight = ctx.saved_tensors
        act = F.gelu(h, approximate=ctx.approximate)
        if keep is not None:
            act = act * keep / (1.0 - ctx.drop)
        grad_act, grad_weight, grad_bias = _dense_backward(ctx, grad_out, act, weight,
                                                             *ctx.needs_input_grad[3:5])
        grad_act = grad_act.to(h.dtype)
        if keep is not None:
            grad_act = grad_act * keep / (1.0 - ctx.drop)
        grad_h = torch.ops.aten.gelu_backward(grad_act, h, approximate=ctx.approximate)
        return grad_h, None, None, grad_weight, grad_bias


def head_views(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value, each (B, H, L, D/H), as views of the fused (B, L, 3D) projection."""
    B, L, width3 = qkv.shape
    return qkv.view(B, L, 3, num_heads, width3 // (3 * num_heads)).permute(2, 0, 3, 1, 4).unbind(0)


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
    """``head_views`` whose backward, in training, writes the three gradients into the
    (B, L, 3, H, D/H) layout in one pass; autograd's own backward of the views stacks them
    (B, H, L, D/H)-major and then copies the permuted stack into place (``python
    benchmarks/ab.py split_heads``)."""
    return _SplitHeads.apply(qkv, num_heads) if recompute_wanted() else head_views(qkv, num_heads)


def layer_norm_dense(x: torch.Tensor, norm: nn.LayerNorm, dense: nn.Linear) -> torch.Tensor:
    """``dense(norm(x))``, storing x rather than norm(x) for the backward (in inference, written
    into a reused buffer when the model opened them: ``buffers.py``)."""
    if not recompute_wanted():
        return dense_into_buffer(norm(x), dense)
    return _LayerNormDense.apply(x, norm.weight, norm.bias, norm.eps, dense.weight, dense.bias)


def gelu_dense(h: torch.Tensor, approximate: str, dropout: nn.Dropout, dense: nn.Linear) -> torch.Tensor:
    """``dense(dropout(gelu(h)))``, storing h (and the dropout mask) rather than the GELU output."""
    if not recompute_wanted():
        return dense(dropout(gelu_of_own(h, approximate)))
    drop = dropout.p if dropout.training else 0.0
    return _GeluDense.apply(h, approximate, drop, dense.weight, dense.bias)
