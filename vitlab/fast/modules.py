"""The modules ``optimize`` installs, and how it installs and removes them.

Installation changes the class of an existing module in place (as
``torch.nn.utils.parametrize`` does), to a subclass that adds a faster forward:

* ``nn.Linear`` -> ``FastLinear``: its matmuls take the chosen CPU kernel
  (``linear.py``).  In CPU inference under bf16 autocast the bf16 kernel runs as oneDNN's
  matmul with the bias, and a following GELU, applied to its fp32 accumulator, on the
  weight in bf16, obtained as ``FastOptions.inference_weights`` says: cast in every call
  into a buffer the model's layers share (``Workspace``; autocast would allocate a fresh
  copy of every weight in every call), held as a cast copy between calls, or packed into
  the fp32 weight's own bytes (``packing.py``) and unpacked before anything reads them.
* ``Block`` -> ``FastBlock``: in training, LayerNorm and GELU outputs are recomputed in
  the backward instead of stored (``recompute.py``).  On a CPU in bf16, attention is two
  matmuls and a softmax: PyTorch's CPU flash-attention kernel has a slow bf16 backward;
  in inference the heads are first copied into contiguous blocks (``contiguous_attention``),
  since both the fused kernel and matmuls over strided head views are slower forwards at
  ViT shapes.  Without autograd on a CPU the block runs over chunks of whole images of about
  ``CHUNK_ROWS`` tokens (every part of a block acts on each image alone, so the values are
  the same), each written into its rows of the output: its activations stay a few MB,
  where the allocator reuses memory instead of mapping fresh pages (each faulting on
  first touch) for every wide activation of a large batch.

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
from .packing import pack_, packable, packed_view, unpack_
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


# How a dense layer gets its bf16 weight in CPU bf16 autocast inference (FastOptions).
INFERENCE_WEIGHTS = ("cast", "hold", "pack")


@dataclasses.dataclass(frozen=True)
class FastOptions:
    """What ``optimize`` installed: the CPU kernels, whether training recomputes, and how a
    dense layer gets its bf16 weight in CPU bf16 autocast inference (``inference_weights``):

    * ``"cast"``: cast into the shared ``workspace`` in every call; nothing is kept;
    * ``"hold"``: a cast copy kept between calls (recast when the parameter changes), for
      the memory of half the fp32 weights again;
    * ``"pack"``: the bf16 weight written into the fp32 parameter's own bytes with the
      remainder that restores it exactly (``packing.py``): no per-call cast and no extra
      memory, for inference-only use.  Between a bf16 inference call and the next thing that
      goes through the module (``train()``, a forward with autograd or without autocast,
      ``state_dict``, ``load_state_dict``, ``.to()``, copies, pickles, ``restore``) the
      parameter's bytes hold the packed form: code that reads ``layer.weight`` directly then,
      such as an EMA update of an evaluated model, must unpack first (``unpack_weights``).
    """

    kernels: KernelChoice
    recompute: bool = True
    inference_weights: str = "cast"
    workspace: Workspace = dataclasses.field(default_factory=Workspace, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.inference_weights not in INFERENCE_WEIGHTS:
            raise ValueError(f"FastOptions.inference_weights={self.inference_weights!r}: expected one of "
                             f"{', '.join(INFERENCE_WEIGHTS)}")


class FastLinear(nn.Linear):
    """``nn.Linear`` whose matmuls take the chosen kernels (installed by ``optimize``)."""

    fast_options: FastOptions
    _held: tuple | None = None  # (key, weight or None, bias) cast for inference under autocast
    _packed: bool = False  # whether the weight's bytes hold the packed bf16 form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _takes_over(x, self.fast_options.kernels):
            self._held = None
            self.unpack()
            return F.linear(x, self.weight, self.bias)
        if torch.is_grad_enabled() or x.device.type != "cpu" or torch.compiler.is_compiling():
            self._held = None  # training changes the weights: drop what inference kept
            self.unpack()
            return linear(x, self.weight, self.bias, self.fast_options.kernels)
        return self.inference(x)

    def inference(self, x: torch.Tensor, gelu: str | None = None) -> torch.Tensor:
        """``self(x)`` on a CPU without autograd, then GELU (``approximate=gelu``) when given."""
        kernels = self.fast_options.kernels
        bf16_autocast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        if bf16_autocast and kernels.bf16 == "onednn":
            weight, bias = self._bf16_weights()
            return onednn_linear(x.to(torch.bfloat16), weight, bias, gelu)
        self.unpack()
        if bf16_autocast and kernels.bf16 == "widened":  # bf16 values held in fp32, for the fp32 GEMM
            weight, bias = self._cast(torch.float32)
            out = linear_forward(x, weight, bias, "widened", kernels, rounded=True)
        elif mode_for(x, kernels) == "onednn":
            self._held = None
            return onednn_linear(x, self.weight, self.bias, gelu)
        else:
            self._held = None
            out = F.linear(x, self.weight, self.bias)  # autocast (of another dtype) casts as usual
        return out if gelu is None else torch.ops.aten.gelu_(out, approximate=gelu)

    def _bf16_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weight and bias in bf16 for the bf16 kernel, the weight packed when the options say
        so and nothing else can see it (no hook on this layer, a weight of its own)."""
        if (self.fast_options.inference_weights == "pack" and getattr(self, "packs_weight", False)
                and not self.training and not _hooked(self) and not _global_hooks()):
            if not self._packed:
                if not packable(self.weight):
                    return self._cast(torch.bfloat16)
                pack_(self.weight)
                self._packed = True
            return packed_view(self.weight), self._cast_bias()
        self.unpack()
        return self._cast(torch.bfloat16)

    def unpack(self) -> None:
        """Give the weight its exact fp32 bytes back if this layer packed it."""
        if self._packed:
            unpack_(self.weight)
            self._packed = False

    def _cast_bias(self) -> torch.Tensor | None:
        """The bias in bf16, kept until the parameter changes (it is small)."""
        if self.bias is None:
            return None
        key = ("bias", self.bias.data_ptr(), self.bias._version)
        if self._held is None or self._held[0] != key:
            self._held = (key, None, self.bias.detach().to(torch.bfloat16))
        return self._held[2]

    def _cast(self, hold_in: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weight and bias rounded to bf16, held in ``hold_in``: the weight cast into the
        workspace in every call (or kept, with ``inference_weights="hold"``), the bias kept
        (it is small); kept copies are cast again when their parameter changes."""
        params = [p for p in (self.weight, self.bias) if p is not None]
        hold_weight = self.fast_options.inference_weights == "hold"
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

    # Everything that reads or replaces the parameters through the module sees the exact fp32 weight.
    def train(self, mode: bool = True) -> "FastLinear":
        self.unpack()
        return super().train(mode)

    def _apply(self, fn, recurse: bool = True):
        self.unpack()
        return super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        self.unpack()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        self.unpack()
        super()._load_from_state_dict(*args, **kwargs)

    def __getstate__(self) -> dict:
        self.unpack()
        state = self.__dict__.copy()
        for name in ("_held", "_packed"):
            state.pop(name, None)  # a cache, remade at the next call that wants it
        return state


def _takes_over(x: torch.Tensor, kernels: KernelChoice) -> bool:
    """Whether the fast path runs this call: always on a GPU; on a CPU where the kernel choice
    has the fast path take over this mode (autograd on or off) and precision."""
    if x.device.type != "cpu":
        return True
    bf16 = x.dtype == torch.bfloat16 or (torch.is_autocast_enabled("cpu")
                                         and torch.get_autocast_dtype("cpu") == torch.bfloat16)
    return kernels.takes_over(torch.is_grad_enabled(), bf16)


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks
                or module._backward_hooks or module._backward_pre_hooks)


def _global_hooks() -> bool:
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
                or torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks)


class FastBlock(Block):
    """``Block`` whose training forward recomputes LayerNorm and GELU outputs in the backward
    (unless ``recompute=False``) and, on a CPU in bf16, attends by two matmuls and a softmax."""

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
        if torch.compiler.is_compiling() or not self.fusable() or not _takes_over(x, self.fast_options.kernels):
            return super().forward(x)
        if not torch.is_grad_enabled():
            return self.inference(x)
        kernels, attn, mlp, recompute = self.fast_options.kernels, self.attn, self.mlp, self.fast_options.recompute
        qkv = layer_norm_dense(x, self.norm1, attn.qkv, kernels) if recompute else attn.qkv(self.norm1(x))
        # training attends over the strided head views (contiguous_attention's copies and its
        # backward did not pay in a training step: benchmarks/NOTES.md, 2026-11-24 and -25)
        q, k, v = split_heads(qkv, attn.num_heads)
        x = x + self.drop_path(attn.proj_drop(attn.proj(attn.attend(q, k, v, explicit=_explicit(q, kernels)))))
        if not recompute:
            return x + self.drop_path(mlp(self.norm2(x)))
        h = layer_norm_dense(x, self.norm2, mlp.fc1, kernels)
        return x + self.drop_path(mlp.drop(gelu_dense(h, mlp.approximate, mlp.drop, mlp.fc2, kernels)))


    def inference(self, x: torch.Tensor) -> torch.Tensor:
        """The forward without autograd; on a CPU over chunks of about ``CHUNK_ROWS`` tokens
        (module text: the allocator's fresh pages are a CPU cost, a GPU wants the whole batch),
        each chunk's result written straight into its rows of the output."""
        images, tokens = x.shape[0], x.shape[1]
        dense_dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
        chunks = -(-images * tokens * dense_dtype.itemsize // (4 * CHUNK_ROWS))
        if chunks <= 1 or images == 1 or x.device.type != "cpu":
            return self.inference_chunk(x)
        parts = x.split(-(-images // chunks))
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, dense_dtype), device=x.device)
        for part, rows in zip(parts, out.split(parts[0].shape[0])):
            self.inference_chunk(part, out=rows)
        return out

    def inference_chunk(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The plain forward, each dense layer called for its inference product, the GELU
        applied as the first MLP layer writes its output; the last residual sum into ``out``."""
        attn, mlp = self.attn, self.mlp
        qkv = _inference(attn.qkv, self.norm1(x))
        if _contiguous_attention_applies(qkv, attn):
            drop = attn.attn_drop if self.training else 0.0
            heads = contiguous_attention(qkv, attn.num_heads, attn.head_dim**-0.5, drop)
        else:
            q, k, v = layers.split_heads(qkv, attn.num_heads)
            heads = attn.attend(q, k, v, explicit=_explicit(q, self.fast_options.kernels))
        x = x + self.drop_path(attn.proj_drop(_inference(attn.proj, heads)))
        h = mlp.drop(_inference(mlp.fc1, self.norm2(x), gelu=mlp.approximate))
        return torch.add(x, self.drop_path(mlp.drop(_inference(mlp.fc2, h))), out=out)


def contiguous_attention(qkv: torch.Tensor, num_heads: int, scale: float, dropout: float = 0.0) -> torch.Tensor:
    """softmax(q k^T * scale) v of a (B, L, 3D) qkv projection -> (B, L, D) (inference; autograd works).

    The heads are copied once into contiguous (B*H, L, D/H) blocks and multiplied as batched
    matmuls with the scale applied to the accumulator: in bf16 on a CPU, batched matmuls over
    the strided views of ``split_heads`` and the fused attention kernel are both slower.
    ``dropout`` drops attention probabilities, as ``Attention.attend`` does in training.
    """
    B, L, width3 = qkv.shape
    head_dim = width3 // (3 * num_heads)
    q, k, v = (qkv.view(B, L, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
               .reshape(3, B * num_heads, L, head_dim).contiguous().unbind(0))  # one image: reshape can view
    scores = torch.empty(B * num_heads, L, L, dtype=qkv.dtype, device=qkv.device)
    scores.baddbmm_(q, k.transpose(1, 2), beta=0, alpha=scale)  # beta=0: the empty values are never read
    if torch.is_grad_enabled():
        probs = torch.softmax(scores, dim=-1)
    else:  # the probabilities over the scores (row by row, exact): one (B*H, L, L) buffer instead of two
        probs = torch.softmax(scores, dim=-1, out=scores)
    if dropout > 0.0:
        probs = F.dropout(probs, dropout)
    heads = torch.bmm(probs, v)  # (B*H, L, D/H)
    return heads.view(B, num_heads, L, head_dim).transpose(1, 2).reshape(B, L, num_heads * head_dim)


def _cpu_bf16(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.bfloat16


def _explicit(q: torch.Tensor, kernels: KernelChoice) -> bool:
    """Whether the block attends by two matmuls and a softmax: always in bf16 on a CPU
    (PyTorch's fused attention kernel is the slower one there, its backward most of all),
    in fp32 on a CPU where the kernel choice says so."""
    return q.device.type == "cpu" and (q.dtype == torch.bfloat16 or kernels.attention == "explicit")


def _contiguous_attention_applies(qkv: torch.Tensor, attn: Attention) -> bool:
    """Whether the block attends by ``contiguous_attention``: bf16 on a CPU, and no relative
    position bias or recording of the attention weights, which ``Attention.attend`` handles."""
    return _cpu_bf16(qkv) and attn.rel_pos is None and attn.recorded is None


# Tokens per chunk of a block's inference with fp32 dense layers (twice as many with 2-byte
# ones): a chunk's widest activation (tokens x mlp_dim) then stays within ~12 MB for the
# paper's widths, while its matmuls keep enough rows.
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
    unpack_weights(model)
    shared = _shared_parameters(model)
    for module in model.modules():
        kind = type(module)
        if kind in _INSTALLED or kind in _PLAIN:
            module.__class__ = _INSTALLED.get(kind, kind)
            module.fast_options = options
            if isinstance(module, FastLinear):  # a weight another module also reads is never packed
                module.packs_weight = id(module.weight) not in shared
    return model


def uninstall(model: nn.Module) -> nn.Module:
    """Give every installed module its plain class back, dropping what the fast path held."""
    unpack_weights(model)
    for module in model.modules():
        plain = _PLAIN.get(type(module))
        if plain is not None:
            module.__class__ = plain
            for name in ("fast_options", "_held", "_packed", "packs_weight"):
                module.__dict__.pop(name, None)
    return model


def unpack_weights(model: nn.Module) -> nn.Module:
    """Give every weight that ``inference_weights="pack"`` packed its exact fp32 bytes back."""
    for module in model.modules():
        if isinstance(module, FastLinear):
            module.unpack()
    return model


def _shared_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters that more than one place of ``model`` holds."""
    seen: set[int] = set()
    shared: set[int] = set()
    for _, param in model.named_parameters(remove_duplicate=False):
        (shared if id(param) in seen else seen).add(id(param))
    return shared


def installed(model: nn.Module) -> FastOptions | None:
    """The options of the first installed module of ``model``, or None when none is installed."""
    for module in model.modules():
        if type(module) in _PLAIN:
            return module.fast_options
    return None
