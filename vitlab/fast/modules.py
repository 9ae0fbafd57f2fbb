"""The modules ``optimize`` installs, and how it installs and removes them.

Installation changes the class of an existing module in place (as
``torch.nn.utils.parametrize`` does), to a subclass that adds a faster forward:

* ``nn.Linear`` -> ``FastLinear``: its matmuls take the chosen CPU kernel
  (``linear.py``).  In CPU inference under bf16 autocast it casts its weight into a
  buffer the model's layers share (``Workspace``: autocast would allocate a fresh copy
  of every weight in every call), or, with ``hold_casts``, keeps the cast between calls
  until the parameter changes; the bf16 kernel then runs as oneDNN's matmul with the
  bias, and a following GELU, applied to its fp32 accumulator.
* ``Block`` -> ``FastBlock``: in training, LayerNorm and GELU outputs are recomputed in
  the backward instead of stored (``recompute.py``).  On a CPU in bf16, attention is two
  matmuls and a softmax: PyTorch's CPU flash-attention kernel has a slow bf16 backward
  and a bf16 forward slower than the matmuls at ViT shapes.  Without autograd on a CPU
  the block runs over chunks of whole images of at most ``CHUNK_ROWS`` tokens (every part of a
  block acts on each image alone, so the values are the same): its activations stay a
  few MB, where the allocator reuses memory instead of mapping fresh pages (each
  faulting on first touch) for every wide activation of a large batch.

The module keeps its identity, parameters, buffers, hooks and state-dict keys, so a
model can be optimised after weights are loaded, before or after DDP/FSDP wrapping, and
saved either way.  The options live on each installed module (``fast_options``).

A block takes its fused path only while its parts are the plain modules it was built
with and none of them carries a hook: a user who wraps ``attn.qkv`` in an adapter, swaps
``mlp.fc1`` for a quantised layer or hooks ``norm1`` gets the plain forward, calling
every module, with the rest of the fast path (the kernels of the ``FastLinear`` layers
it calls) still in place.  ``torch.compile`` traces the plain forward.
"""
from __future__ import annotations

import dataclasses
import threading

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module

from ..models import layers
from ..models.layers import Attention, Block, Mlp
from .kernels import KernelChoice
from .linear import linear, linear_forward, mode_for, onednn_linear
from .recompute import gelu_dense, layer_norm_dense, split_heads


class Workspace:
    """Scratch memory the installed layers of one model share, one buffer per thread.

    A layer casts its weight into it right before its matmul reads it, so one buffer of
    the largest weight's size serves every layer; threads running the same model each
    get their own.  Copies and pickles of a model start with an empty one.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` over this thread's buffer, valid until the next ``take``."""
        numel = shape.numel()
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
            buffer = self._local.buffer = torch.empty(numel, dtype=dtype)
        return buffer[:numel].view(shape)

    def __reduce__(self):
        return Workspace, ()

    def __deepcopy__(self, memo: dict) -> "Workspace":
        return Workspace()


@dataclasses.dataclass(frozen=True)
class FastOptions:
    """What ``optimize`` installed: the CPU kernels, whether training recomputes, and whether
    autocast inference keeps each layer's cast weight between calls (faster at small
    batches, for the memory of a cast copy of the model) instead of casting it into the
    shared ``workspace`` in every call."""

    kernels: KernelChoice
    recompute: bool = True
    hold_casts: bool = False
    workspace: Workspace = dataclasses.field(default_factory=Workspace, compare=False, repr=False)


class FastLinear(nn.Linear):
    """``nn.Linear`` whose matmuls take the chosen kernels (installed by ``optimize``)."""

    fast_options: FastOptions
    _held: tuple | None = None  # (key, weight or None, bias) cast for inference under autocast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.device.type != "cpu" or torch.compiler.is_compiling():
            self._held = None  # training changes the weights: drop what inference kept
            return linear(x, self.weight, self.bias, self.fast_options.kernels)
        return self.inference(x)

    def inference(self, x: torch.Tensor, gelu: str | None = None) -> torch.Tensor:
        """``self(x)`` on a CPU without autograd, then GELU (``approximate=gelu``) when given."""
        kernels = self.fast_options.kernels
        bf16_autocast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        if bf16_autocast and kernels.bf16 == "fp32":  # bf16 values held in fp32, for the fp32 GEMM
            weight, bias = self._cast(torch.float32)
            out = linear_forward(x, weight, bias, "widened", kernels, rounded=True)
        elif bf16_autocast and torch.backends.mkldnn.is_available():
            weight, bias = self._cast(torch.bfloat16)
            return onednn_linear(x.to(torch.bfloat16), weight, bias, gelu)
        elif mode_for(x, kernels) == "onednn":
            self._held = None
            return onednn_linear(x, self.weight, self.bias, gelu)
        else:
            self._held = None
            out = F.linear(x, self.weight, self.bias)  # autocast (of another dtype) casts as usual
        return out if gelu is None else torch.ops.aten.gelu_(out, approximate=gelu)

    def _cast(self, hold_in: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weight and bias rounded to bf16, held in ``hold_in``: the weight cast into the
        workspace in every call (or kept, with ``hold_casts``), the bias kept (it is small);
        kept copies are cast again when their parameter changes."""
        params = [p for p in (self.weight, self.bias) if p is not None]
        hold_weight = self.fast_options.hold_casts
        key = (hold_in, hold_weight, *((p.data_ptr(), p._version) for p in params))
        if self._held is None or self._held[0] != key:
            weight, bias = (None if p is None else p.detach().to(torch.bfloat16).to(hold_in)
                            for p in (self.weight if hold_weight else None, self.bias))
            self._held = (key, weight, bias)
        weight = self._held[1]
        if weight is None:
            weight = self.fast_options.workspace.take(self.weight.shape, hold_in)
            weight.copy_(self.weight.detach() if hold_in == torch.bfloat16 else self.weight.detach().to(torch.bfloat16))
        return weight, self._held[2]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_held", None)  # a cache, remade at the next call that wants it
        return state


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks
                or module._backward_hooks or module._backward_pre_hooks)


def _global_hooks() -> bool:
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
                or torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks)


class FastBlock(Block):
    """``Block`` whose training forward recomputes LayerNorm and GELU outputs in the backward."""

    fast_options: FastOptions

    def fusable(self) -> bool:
        """Whether the fused path computes exactly what the plain forward would, hooks included."""
        attn, mlp = self.attn, self.mlp
        parts = (self.norm1, self.norm2, attn, mlp, attn.qkv, attn.proj, mlp.fc1, mlp.fc2)
        return (type(self.norm1) is nn.LayerNorm and type(self.norm2) is nn.LayerNorm
                and type(attn) is Attention and type(mlp) is Mlp
                and all(type(m) in (nn.Linear, FastLinear) for m in (attn.qkv, attn.proj, mlp.fc1, mlp.fc2))
                and not any(_hooked(m) for m in parts) and not _global_hooks())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or not self.fusable():
            return super().forward(x)
        if not torch.is_grad_enabled():
            return self.inference(x)
        if not self.fast_options.recompute:
            return super().forward(x)
        kernels, attn, mlp = self.fast_options.kernels, self.attn, self.mlp
        q, k, v = split_heads(layer_norm_dense(x, self.norm1, attn.qkv, kernels), attn.num_heads)
        explicit = q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.requires_grad
        x = x + self.drop_path(attn.proj_drop(attn.proj(attn.attend(q, k, v, explicit=explicit))))
        h = layer_norm_dense(x, self.norm2, mlp.fc1, kernels)
        return x + self.drop_path(mlp.drop(gelu_dense(h, mlp.approximate, mlp.drop, mlp.fc2, kernels)))


    def inference(self, x: torch.Tensor) -> torch.Tensor:
        """The forward without autograd; on a CPU over chunks of at most ``CHUNK_ROWS`` tokens
        (module text: the allocator's fresh pages are a CPU cost, a GPU wants the whole batch)."""
        images, tokens = x.shape[0], x.shape[1]
        chunks = -(-images * tokens // CHUNK_ROWS)
        if chunks <= 1 or images == 1 or x.device.type != "cpu":
            return self.inference_chunk(x)
        return torch.cat([self.inference_chunk(part) for part in x.split(-(-images // chunks))])

    def inference_chunk(self, x: torch.Tensor) -> torch.Tensor:
        """The plain forward, each dense layer called for its inference product, the GELU
        applied as the first MLP layer writes its output."""
        attn, mlp = self.attn, self.mlp
        q, k, v = layers.split_heads(_inference(attn.qkv, self.norm1(x)), attn.num_heads)
        explicit = q.device.type == "cpu" and q.dtype == torch.bfloat16
        x = x + self.drop_path(attn.proj_drop(_inference(attn.proj, attn.attend(q, k, v, explicit=explicit))))
        h = mlp.drop(_inference(mlp.fc1, self.norm2(x), gelu=mlp.approximate))
        return x + self.drop_path(mlp.drop(_inference(mlp.fc2, h)))


# Tokens per chunk of a block's inference: a chunk's widest activation (tokens x mlp_dim)
# then stays within a few MB for the paper's widths, while its matmuls keep enough rows.
CHUNK_ROWS = 1024


def _inference(layer: nn.Linear, x: torch.Tensor, gelu: str | None = None) -> torch.Tensor:
    """``layer(x)`` (then GELU) without autograd, by the fast layer's inference product when it is one."""
    if isinstance(layer, FastLinear):
        return layer.inference(x, gelu)
    out = layer(x)
    return out if gelu is None else torch.ops.aten.gelu_(out, approximate=gelu)


_INSTALLED = {nn.Linear: FastLinear, Block: FastBlock}
_PLAIN = {fast: plain for plain, fast in _INSTALLED.items()}


def install(model: nn.Module, options: FastOptions) -> nn.Module:
    """Give every plain ``nn.Linear`` and ``Block`` of ``model`` (exact types) its fast class."""
    for module in model.modules():
        kind = type(module)
        if kind in _INSTALLED or kind in _PLAIN:
            module.__class__ = _INSTALLED.get(kind, kind)
            module.fast_options = options
    return model


def uninstall(model: nn.Module) -> nn.Module:
    """Give every installed module its plain class back, dropping what the fast path held."""
    for module in model.modules():
        plain = _PLAIN.get(type(module))
        if plain is not None:
            module.__class__ = plain
            for name in ("fast_options", "_held"):
                module.__dict__.pop(name, None)
    return model


def installed(model: nn.Module) -> FastOptions | None:
    """The options of the first installed module of ``model``, or None when none is installed."""
    for module in model.modules():
        if type(module) in _PLAIN:
            return module.fast_options
    return None
