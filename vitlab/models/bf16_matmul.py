"""bf16 matmuls computed by the fp32 GEMM, on CPUs where that is the faster kernel.

Under bf16 autocast a dense layer rounds its input and weight to bf16, multiplies them
with fp32 accumulation and rounds the result to bf16.  The product of two bf16 numbers
is exact in fp32 (8 + 8 significant bits fit in 24), so the fp32 GEMM applied to the
bf16-rounded operands computes the same thing: the two differ only in the order in which
the fp32 accumulator adds its terms.  Which kernel is faster depends on the CPU.  On a
Zen 4 the bf16 dot-product instructions run at about twice the fp32 FMA rate; on the
Intel Xeon VM this project was measured on (AVX512-BF16, no AMX) oneDNN's bf16 kernel
runs at half the fp32 rate, 150-165 against 300-320 GFLOP/s, and rounding both
operands, multiplying in fp32 and rounding the result is 1.2-1.7x faster than the bf16
kernel at the layers' shapes, conversions included (``python benchmarks/ab.py
bf16_matmul``).

So on a CPU, under bf16 autocast, vitlab's dense layers (forward and backward) take the
faster of the two, found once per process by timing both on one layer-sized matmul
(``fp32_gemm_is_faster``).  What stays bf16 is what bf16 autocast is for: every
activation the dense layers produce, and every one they keep for the backward, is
stored in bf16, and the rounding happens where autocast's would.  ``VITLAB_BF16_MATMUL``
(``auto``, ``bf16`` or ``fp32``) or ``with bf16_matmul("bf16"):`` chooses by hand.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

PATHS = ("auto", "bf16", "fp32")
_chosen: str | None = None  # set by bf16_matmul(); None: the environment, then "auto"
_probed: bool | None = None  # the probe's answer, once per process


def _path() -> str:
    path = _chosen or os.environ.get("VITLAB_BF16_MATMUL", "auto")
    if path not in PATHS:
        raise ValueError(f"VITLAB_BF16_MATMUL={path!r}: expected one of {', '.join(PATHS)}")
    return path


@contextlib.contextmanager
def bf16_matmul(path: str) -> Iterator[None]:
    """Inside the block, CPU bf16 matmuls use ``path``: "bf16" (the bf16 kernel), "fp32" (the
    fp32 GEMM on bf16-rounded operands) or "auto" (whichever ``fp32_gemm_is_faster`` says)."""
    global _chosen
    if path not in PATHS:
        raise ValueError(f"bf16_matmul({path!r}): expected one of {', '.join(PATHS)}")
    before, _chosen = _chosen, path
    try:
        yield
    finally:
        _chosen = before


def _probe(rows: int = 1024, width: int = 768, rounds: int = 4) -> bool:
    a = torch.randn(rows, width).to(torch.bfloat16)
    w = torch.randn(width, width).to(torch.bfloat16)
    native = lambda: a @ w  # noqa: E731
    widened = lambda: (a.float() @ w.float()).to(torch.bfloat16)  # noqa: E731
    best = {native: float("inf"), widened: float("inf")}
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        for f in best:
            f()
        for _ in range(rounds):  # interleaved, minimum: robust to a busy neighbour
            for f in best:
                start = time.perf_counter()
                f()
                best[f] = min(best[f], time.perf_counter() - start)
    return best[widened] * 1.1 < best[native]


def _probe_once() -> bool:
    global _probed
    if _probed is None:
        _probed = _probe()
    return _probed


def fp32_gemm_is_faster() -> bool:
    """Whether this process's CPU bf16 matmuls go through the fp32 GEMM (see the module text)."""
    path = _path()
    return path == "fp32" if path != "auto" else _probe_once()


def bf16_kernel_is_faster() -> bool:
    """Whether this CPU's bf16 matmul kernel beats the fp32 GEMM (measured once, whatever
    ``bf16_matmul`` chooses): where it does not, bf16 autocast saves memory but not time."""
    return not _probe_once()


def widened(x: torch.Tensor) -> bool:
    """Whether a dense layer over ``x`` runs in bf16 autocast on a CPU whose fp32 GEMM is faster."""
    return (x.device.type == "cpu" and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16
            and not torch.compiler.is_compiling() and fp32_gemm_is_faster())


def bf16_values(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bf16, held in fp32 (the fp32 GEMM's operand)."""
    return t.to(torch.bfloat16).float()


_local = threading.local()  # .scratch: two flat fp32 buffers, one per slot


def _scratch(slot: int, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """A (contiguous, fp32) view of size ``shape`` of this thread's scratch buffer ``slot``.

    The fp32 operands and products of the widened matmuls live only until they are
    rounded to bf16, so two buffers, grown to the largest seen, serve every call.  Fresh
    allocations of their size (tens of MB) come from the kernel as new pages and fault on
    first touch, which cost as much as the conversions themselves.  They are held until
    ``release_scratch`` (the training loop calls it when it ends).
    """
    buffers = getattr(_local, "scratch", None)
    if buffers is None:
        buffers = _local.scratch = [torch.empty(0), torch.empty(0)]
    numel = math.prod(shape)
    if buffers[slot].numel() < numel:
        buffers[slot] = torch.empty(numel)
    return buffers[slot][:numel].view(shape)


def release_scratch() -> None:
    """Free this thread's scratch buffers (they are made again when next needed)."""
    _local.scratch = None


def _as_fp32(t: torch.Tensor, slot: int) -> torch.Tensor:
    """``bf16_values(t)`` written into scratch ``slot``."""
    if t.dtype != torch.bfloat16:
        t = t.to(torch.bfloat16)
    return _scratch(slot, t.shape).copy_(t)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
           rounded: bool = False) -> torch.Tensor:
    """bf16 autocast's ``F.linear(x, weight, bias)``, computed by the fp32 GEMM; no autograd.

    rounded: ``weight`` and ``bias`` hold bf16 values in fp32 already (``Dense`` keeps them
    so between inference calls), which saves rounding them in every call; such a weight
    may be packed for oneDNN (``torch._mkldnn`` layout), which saves the matmul library
    repacking it in every call.
    """
    with torch.autocast("cpu", enabled=False):
        rows = _as_fp32(x.reshape(-1, x.shape[-1]), 0)
        if weight.layout == torch._mkldnn:
            out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
            return out.to(torch.bfloat16).view(*x.shape[:-1], out.shape[-1])
        if not rounded:
            weight = bf16_values(weight)
            bias = bf16_values(bias) if bias is not None else None
        out = _scratch(1, (rows.shape[0], weight.shape[0]))
        if bias is not None:
            torch.addmm(bias, rows, weight.t(), out=out)
        else:
            torch.mm(rows, weight.t(), out=out)
        return out.to(torch.bfloat16).view(*x.shape[:-1], weight.shape[0])


def dense_backward(grad_out: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor,
                   needs_weight: bool, needs_bias: bool, needs_inputs: bool = True
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The gradients bf16 autocast's dense layer gets, computed by the fp32 GEMM: w.r.t. its
    bf16 input, its bf16 weight and its bf16 bias, each rounded to bf16 as the bf16 kernel's
    output is (autograd casts the weight's and bias's to the parameter's dtype)."""
    grad_rows = _as_fp32(grad_out.reshape(-1, grad_out.shape[-1]), 0)
    grad_weight = grad_bias = None
    if needs_weight:
        rows = _as_fp32(inputs.reshape(-1, inputs.shape[-1]), 1)
        grad_weight = (grad_rows.t() @ rows).to(torch.bfloat16)
    if needs_bias:
        grad_bias = grad_rows.sum(0).to(torch.bfloat16)
    if not needs_inputs:  # a frozen layer's input, such as the image
        return None, grad_weight, grad_bias
    # slot 1 is free again: the input's copy is dead once the weight gradient is made
    grad_inputs = torch.mm(grad_rows, bf16_values(weight), out=_scratch(1, (grad_rows.shape[0], weight.shape[1])))
    return grad_inputs.to(torch.bfloat16).view(*grad_out.shape[:-1], weight.shape[1]), grad_weight, grad_bias


class _WidenedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        inputs = x.to(torch.bfloat16)  # kept in bf16, as autocast keeps its cast input
        ctx.input_dtype = x.dtype
        ctx.save_for_backward(inputs, weight)
        return linear(inputs, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        inputs, weight = ctx.saved_tensors
        needs_x, needs_weight, needs_bias = ctx.needs_input_grad
        grad_x, grad_weight, grad_bias = dense_backward(grad_out, inputs, weight, needs_weight, needs_bias, needs_x)
        return None if grad_x is None else grad_x.to(ctx.input_dtype), grad_weight, grad_bias


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear`` with its backward (bf16 input kept, gradients as bf16 autocast's)."""
    if not torch.is_grad_enabled():
        return linear(x, weight, bias)
    return _WidenedLinear.apply(x, weight, bias)


def autocast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` under whatever autocast is active, by the fp32 GEMM where ``widened``."""
    return widened_linear(x, weight, bias) if widened(x) else F.linear(x, weight, bias)

