"""The modules ``optimize`` installs, and how it installs and removes them.

Installation changes the class of an existing module in place (as
``torch.nn.utils.parametrize`` does), to a subclass that adds a faster forward:

* ``nn.Linear`` -> ``FastLinear``: its matmuls take the chosen CPU kernel
  (``linear.py``), and in inference under autocast it keeps its weight cast between calls
  (autocast casts every weight in every call otherwise) until the parameter changes.
* ``Block`` -> ``FastBlock``: in training, LayerNorm and GELU outputs are recomputed in
  the backward instead of stored (``recompute.py``), and on a CPU in bf16 attention is two
  matmuls and a softmax (PyTorch's CPU flash-attention kernel has a slow bf16 backward);
  without autograd, the GELU runs in place.

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

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module

from ..models.layers import Attention, Block, Mlp
from .kernels import KernelChoice
from .linear import linear, linear_forward, mode_for
from .recompute import gelu_dense, layer_norm_dense, split_heads


@dataclasses.dataclass(frozen=True)
class FastOptions:
    """What ``optimize`` installed: the CPU kernels, whether training recomputes, and whether
    autocast inference keeps its cast weights between calls (faster, for a cast copy's memory)."""

    kernels: KernelChoice
    recompute: bool = True
    hold_casts: bool = True


class FastLinear(nn.Linear):
    """``nn.Linear`` whose matmuls take the chosen kernels (installed by ``optimize``)."""

    fast_options: FastOptions
    _held: tuple | None = None  # (key, weight, bias) cast for inference under autocast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = self.fast_options.kernels
        if (torch.is_grad_enabled() or x.device.type != "cpu" or not torch.is_autocast_enabled("cpu")
                or not self.fast_options.hold_casts):
            self._held = None  # training (or fp32) changes the weights: drop what inference kept
            return linear(x, self.weight, self.bias, kernels)
        if torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)
        mode = mode_for(x, kernels)
        if mode == "widened":  # bf16 values held in fp32, for the fp32 GEMM
            weight, bias = self._cast(torch.bfloat16, torch.float32)
            return linear_forward(x, weight, bias, mode, kernels, rounded=True)
        weight, bias = self._cast(torch.get_autocast_dtype("cpu"), None)
        return F.linear(x, weight, bias)  # autocast casts x; weight and bias already have its dtype

    def _cast(self, dtype: torch.dtype, hold_in: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weight and bias rounded to ``dtype`` (held in ``hold_in``), cast again when they change."""
        params = [p for p in (self.weight, self.bias) if p is not None]
        key = (dtype, hold_in, *((p.data_ptr(), p._version) for p in params))
        if self._held is None or self._held[0] != key:
            weight, bias = (None if p is None else p.detach().to(dtype).to(hold_in or dtype)
                            for p in (self.weight, self.bias))
            self._held = (key, weight, bias)
        return self._held[1], self._held[2]

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
        """The plain forward, with the GELU written over the first MLP layer's output, which
        nothing else holds without autograd: one (tokens x mlp_dim) allocation less per block,
        whose fresh pages would each fault on first touch."""
        attn, mlp = self.attn, self.mlp
        x = x + self.drop_path(attn(self.norm1(x)))
        h = torch.ops.aten.gelu_(mlp.fc1(self.norm2(x)), approximate=mlp.approximate)
        return x + self.drop_path(mlp.drop(mlp.fc2(mlp.drop(h))))


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
