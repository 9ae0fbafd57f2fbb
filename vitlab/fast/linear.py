"""The matrix multiplies of the fast path's dense layers, forward and backward.

A dense layer's matmul runs in one of three modes, fixed at its forward:

* ``"aten"``: ``F.linear`` under whatever autocast is active, as ``nn.Linear`` runs it;
* ``"onednn"``: fp32 on a CPU whose chosen fp32 kernel is oneDNN's (``kernels.py``):
  the forward and both backward products go through oneDNN's matmul;
* ``"widened"``: bf16 autocast on a CPU whose chosen bf16 kernel is ``"widened"``: the
  input and weight are rounded to bf16 as autocast would round them, multiplied with the
  fp32 kernel, and the result rounded to bf16.  A product of two bf16 numbers is exact in
  fp32, so this is bf16 autocast's computation up to the order of the fp32 additions; the
  input kept for the backward and every gradient are bf16, as autocast's would be.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .kernels import KernelChoice


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  gelu: str | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by oneDNN's matmul on the plain weight (CPU, fp32 or bf16; no
    autograd); then ``F.gelu(.., approximate=gelu)`` when given, applied to the accumulator as
    the result is written (in bf16: before its rounding)."""
    if gelu is None:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "gelu", [], gelu)


def mode_for(x: torch.Tensor, kernels: KernelChoice) -> str:
    """Which of the three modes (module text) a dense layer over ``x`` runs in now."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return "aten"
    if torch.is_autocast_enabled("cpu"):
        bf16 = torch.get_autocast_dtype("cpu") == torch.bfloat16
        return "widened" if bf16 and kernels.bf16 == "widened" else "aten"
    return "onednn" if kernels.fp32 == "onednn" and x.dtype == torch.float32 else "aten"


def bf16_values(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` rounded to bf16, held in fp32 (the fp32 GEMM's operand)."""
    return None if t is None else t.to(torch.bfloat16).float()


def fp32_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: KernelChoice) -> torch.Tensor:
    """``x @ weight.T + bias`` in fp32 by the chosen fp32 kernel, autocast off."""
    if kernels.fp32 == "onednn":
        return onednn_linear(x, weight, bias)
    with torch.autocast("cpu", enabled=False):
        return F.linear(x, weight, bias)


def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mode: str,
                   kernels: KernelChoice, rounded: bool = False) -> torch.Tensor:
    """The forward product of ``mode``, without autograd.

    rounded: (widened) ``weight`` and ``bias`` already hold bf16 values in fp32.
    """
    if mode == "onednn":
        return onednn_linear(x, weight, bias)
    if mode == "widened":
        if not rounded:
            weight, bias = bf16_values(weight), bf16_values(bias)
        return fp32_gemm(bf16_values(x), weight, bias, kernels).to(torch.bfloat16)
    return F.linear(x, weight, bias)


def linear_backward(grad_out: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor, mode: str,
                    kernels: KernelChoice, needs_input: bool, needs_weight: bool, needs_bias: bool
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of the forward product w.r.t. its input, weight and bias.

    ``inputs`` is what the forward multiplied (for "widened", the bf16-rounded input).
    Autocast is off in the backward: "aten" multiplies in the gradient's dtype, as
    autocast's own backward does; the other modes use the fp32 kernel.
    """
    rows_of = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    if mode == "aten":
        dtype = grad_out.dtype
        grad_rows = rows_of(grad_out)
        grad_weight = grad_rows.t() @ rows_of(inputs.to(dtype)) if needs_weight else None
        grad_bias = grad_rows.sum(0) if needs_bias else None
        grad_inputs = grad_out @ weight.to(dtype) if needs_input else None
        return grad_inputs, grad_weight, grad_bias
    widened = mode == "widened"
    grad = grad_out.float() if widened else grad_out
    grad_rows = rows_of(grad)
    grad_inputs = grad_weight = grad_bias = None
    if needs_weight:  # (out, rows) x (in, rows)^T
        grad_weight = fp32_gemm(grad_rows.t(), rows_of(inputs.float() if widened else inputs).t(), None, kernels)
    if needs_bias:
        grad_bias = grad_rows.sum(0)
    if needs_input:  # (.., out) x (out, in)
        w = bf16_values(weight) if widened else weight
        grad_inputs = fp32_gemm(grad, w.t().contiguous(), None, kernels)
    if widened:  # bf16, as the bf16 kernel's results are
        grad_inputs, grad_weight, grad_bias = (None if g is None else g.to(torch.bfloat16)
                                               for g in (grad_inputs, grad_weight, grad_bias))
    return grad_inputs, grad_weight, grad_bias


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, mode, kernels):
        inputs = x.to(torch.bfloat16) if mode == "widened" else x  # kept in bf16, as autocast keeps its cast
        ctx.mode, ctx.kernels, ctx.input_dtype = mode, kernels, x.dtype
        ctx.save_for_backward(inputs, weight)
        return linear_forward(inputs, weight, bias, mode, kernels)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        inputs, weight = ctx.saved_tensors
        needs_x, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_x, grad_weight, grad_bias = linear_backward(grad_out, inputs, weight, ctx.mode, ctx.kernels,
                                                         needs_x, needs_weight, needs_bias)
        return (None if grad_x is None else grad_x.to(ctx.input_dtype)), grad_weight, grad_bias, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: KernelChoice) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the chosen kernels, with autograd."""
    mode = mode_for(x, kernels)
    if mode == "aten":
        return F.linear(x, weight, bias)
    if not torch.is_grad_enabled():
        return linear_forward(x, weight, bias, mode, kernels)
    return _Linear.apply(x, weight, bias, mode, kernels)
