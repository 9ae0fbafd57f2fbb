"""Inference without needless memory traffic: one buffer, reused by every block, for each
of the two widest activations of a CPU inference pass (the qkv projection, tokens x 3D,
and the MLP hidden layer, tokens x mlp_dim); and ``Dense``, a linear layer that keeps its
autocast copy of the weights between inference calls.

Why: glibc serves allocations above 32 MiB with fresh pages from the kernel, and the
first write to each page is a page fault.  ViT-B/16 at batch 32 allocates 12 qkv
outputs of 58 MiB and 12 MLP activations of 77 MiB per forward: about 460,000 faults,
a tenth of the forward's time.  The blocks run one after another and each consumes
both activations before the next block starts, so one buffer of each shape serves
them all; the projection is written into it (``torch.addmm(..., out=)``, the kernel
``F.linear`` calls) and the GELU runs in place.  The buffers live for one forward
(``reuse_buffers``, opened by the model around its blocks) and are freed after it.

Only where no autograd graph, autocast or compiler is involved: the training path keeps
its activations for the backward, autocast has no ``out=`` kernels, and
``torch.compile`` plans its own memory.

Autocast casts every weight to bf16 in every forward (its cache of casts lives for one
``autocast`` block): for ViT-B/16 that is reading 344 MB and writing 172 MB per call,
whatever the batch.  ``Dense`` keeps the cast weights (as bf16 values in fp32 where the
fp32 GEMM computes bf16's matmuls, ``bf16_matmul.py``; packed for oneDNN, as below, when
the first call has few rows) between calls when no backward can follow, recasts when the
parameters change (their version counters), and drops the copy at its next forward
outside autocast inference (a training step, an fp32 forward), so a training loop's
evaluation does not hold stale copies while it trains.

``with plain_inference():`` switches both off (fresh allocations, weights cast per call)
for measurements such as ``benchmarks/ab.py inference_buffers``, or where the memory of
the bf16 copies matters more than their time.

``with packed_weights(model):`` is for serving small batches on a CPU, and is asked for,
not automatic, because it holds a second copy of every dense weight.  ``F.linear`` hands
the weight to the matmul library, which copies it into its blocked layout in every call:
for 197 rows (ViT-B/16 at batch 1) that repacking is a sixth of the layer's time.  Inside
the block the dense layers keep the weight packed once in oneDNN's layout and multiply by
it (``torch.ops.mkldnn._linear_pointwise``), repacking only when the parameters change;
the copies are freed when the block ends.  ``python benchmarks/ab.py packed_weights``.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from . import bf16_matmul

_local = threading.local()  # .buffers: dict (shape, dtype) -> tensor while a forward is open
_PLAIN = False
# bf16 inference by the fp32 GEMM holds its weights packed for oneDNN when the first call
# since they changed has at most this many rows: 1.20x the dense layers' speed at 197 rows
# (ViT-B/16, batch 1), level at 1576, 0.95-0.99x at 6304 (``python benchmarks/ab.py dense_layers``)
PACK_ROWS = 1024


@contextlib.contextmanager
def plain_inference() -> Iterator[None]:
    """Inside the block, inference allocates every activation afresh and autocast casts
    the weights in every call, as plain PyTorch does; cast weights already kept are dropped."""
    global _PLAIN
    before, _PLAIN = _PLAIN, True
    try:
        yield
    finally:
        _PLAIN = before


def reuse_wanted(x: torch.Tensor) -> bool:
    """Whether a forward over ``x`` may write its wide activations into reused buffers."""
    return (not _PLAIN and x.device.type == "cpu" and not torch.is_grad_enabled()
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling())


@contextlib.contextmanager
def reuse_buffers(x: torch.Tensor) -> Iterator[None]:
    """Open one forward's buffers for ``x`` (a no-op where ``reuse_wanted`` is False, or nested)."""
    if getattr(_local, "buffers", None) is not None or not reuse_wanted(x):
        yield
        return
    _local.buffers = {}
    try:
        yield
    finally:
        _local.buffers = None


def _open_buffers() -> dict | None:
    buffers = getattr(_local, "buffers", None)
    return buffers if buffers is not None and not torch.is_grad_enabled() else None


@contextlib.contextmanager
def packed_weights(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, ``model``'s dense layers run CPU fp32 inference on weights packed once
    for oneDNN (a second copy of each, freed at the end); training, autocast and other devices
    inside the block run as usual.

    ``with packed_weights(model): logits = model(images)``
    """
    if not torch.backends.mkldnn.is_available():
        raise RuntimeError("packed_weights needs a PyTorch built with oneDNN (torch.backends.mkldnn)")
    layers = [m for m in model.modules() if isinstance(m, Dense)]
    if not layers:
        raise ValueError(f"packed_weights: {type(model).__name__} has no vitlab Dense layers to pack "
                         "(a BiT ResNet has none)")
    for layer in layers:
        layer._packing += 1
    try:
        yield model
    finally:
        for layer in layers:
            layer._packing -= 1
            if not layer._packing:
                layer._packed = None


def dense_into_buffer(x: torch.Tensor, dense: nn.Linear) -> torch.Tensor:
    """``dense(x)``; inside ``reuse_buffers``, written into the open buffer of its shape.

    The result is overwritten by the next call of the same shape: the caller consumes
    it before then.
    """
    buffers = _open_buffers()
    if buffers is None or x.dtype != dense.weight.dtype or getattr(dense, "_packing", 0):
        return dense(x)
    shape = (*x.shape[:-1], dense.out_features)
    key = (shape, x.dtype)
    if key not in buffers:
        buffers[key] = torch.empty(shape, dtype=x.dtype)
    out = buffers[key]
    rows = x.reshape(-1, x.shape[-1])
    if dense.bias is None:
        torch.mm(rows, dense.weight.t(), out=out.view(-1, shape[-1]))
    else:
        torch.addmm(dense.bias, rows, dense.weight.t(), out=out.view(-1, shape[-1]))
    return out


def gelu_of_own(h: torch.Tensor, approximate: str) -> torch.Tensor:
    """GELU of ``h``, an activation the caller owns: in place when no backward can follow."""
    if torch.is_grad_enabled():
        return F.gelu(h, approximate=approximate)
    return torch.ops.aten.gelu_(h, approximate=approximate)


class Dense(nn.Linear):
    """``nn.Linear`` that, in inference under autocast, casts its weight and bias once, and
    inside ``packed_weights`` multiplies fp32 CPU inputs by a weight packed once."""

    _cast: tuple[tuple, torch.Tensor, torch.Tensor | None] | None = None
    _packing = 0  # how many packed_weights blocks hold this layer
    _packed: tuple[tuple, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if torch.compiler.is_compiling():  # traced as the plain layer: the casts go into the graph
            return F.linear(x, self.weight, self.bias)
        if self._packing and self._packable(x):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight(x), self.bias, "none", [], "")
        if _PLAIN or torch.is_grad_enabled() or not torch.is_autocast_enabled(device):
            if self._cast is not None:
                self._cast = None
            return bf16_matmul.autocast_linear(x, self.weight, self.bias)
        if bf16_matmul.widened(x):  # bf16 values kept in fp32, for the fp32 GEMM
            rows = x.numel() // x.shape[-1]
            weight, bias = self.autocast_weights(torch.bfloat16, hold_in=torch.float32,
                                                 pack_for=rows if rows <= PACK_ROWS else None)
            return bf16_matmul.linear(x, weight, bias, rounded=True)
        weight, bias = self.autocast_weights(torch.get_autocast_dtype(device))
        return F.linear(x, weight, bias)  # autocast casts x; weight and bias already have its dtype

    def __getstate__(self) -> dict:
        # The cast and packed copies are caches, remade at the next call that wants them;
        # a packed one (oneDNN's opaque layout) cannot be copied or pickled at all, and a
        # copy made inside ``packed_weights`` is not one of the layers that block releases.
        state = self.__dict__.copy()
        for cache in ("_cast", "_packed", "_packing"):
            state.pop(cache, None)
        return state

    def _packable(self, x: torch.Tensor) -> bool:
        return (not _PLAIN and not torch.is_grad_enabled() and x.device.type == "cpu"
                and x.dtype == self.weight.dtype == torch.float32 and not torch.is_autocast_enabled("cpu"))

    def packed_weight(self, x: torch.Tensor) -> torch.Tensor:
        """The weight in oneDNN's layout, packed for ``x``'s row count at the first call since it
        last changed (other row counts use it as it is)."""
        key = (self.weight.data_ptr(), self.weight._version)
        if self._packed is None or self._packed[0] != key:
            rows = x.numel() // x.shape[-1]
            self._packed = (key, torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), rows))
        return self._packed[1]

    def autocast_weights(self, dtype: torch.dtype, hold_in: torch.dtype | None = None,
                         pack_for: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weight and bias rounded to ``dtype`` (and held in ``hold_in``, when given), cast at the
        first call since they last changed.

        pack_for: a row count; an fp32-held weight cast now is packed for oneDNN, tuned for that
        many rows (the layout is kept for every row count until the weights change).
        """
        params = [p for p in (self.weight, self.bias) if p is not None]
        key = (dtype, hold_in, *((p.data_ptr(), p._version) for p in params))
        if self._cast is None or self._cast[0] != key:
            weight, bias = (None if p is None else p.detach().to(dtype).to(hold_in or dtype)
                            for p in (self.weight, self.bias))
            if pack_for is not None and hold_in == torch.float32 and torch.backends.mkldnn.is_available():
                weight = torch.ops.mkldnn._reorder_linear_weight(weight, pack_for)
            self._cast = (key, weight, bias)
        return self._cast[1], self._cast[2]
