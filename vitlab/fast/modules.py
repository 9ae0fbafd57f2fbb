"""The modules ``optimize`` installs, and how it installs and removes them.

Installation puts a new module in the place of every plain ``nn.Linear`` and ``Block``
of a model (as torchao's ``quantize_`` and IPEX's ``optimize`` do), and ``restore``
puts the plain ones back.  The installed module stands in for the plain one: it shares
its parameter, child and hook dictionaries (the same dictionary objects, so the same
``Parameter`` objects, state-dict keys and hooks, and a hook's handle removes it from
both), copies its other attributes, and keeps the plain module, unregistered, for
``restore``.  Its own state is its own attributes: ``fast_options`` and, on a dense
layer, ``held_casts`` (with ``inference_weights="hold"``).  Nothing writes into a parameter.

* ``nn.Linear`` -> ``FastLinear``: its matmuls take the chosen CPU kernel
  (``linear.py``).  In CPU inference under bf16 autocast the bf16 kernel runs as oneDNN's
  matmul with the bias, and a following GELU, applied to its fp32 accumulator, on the
  weight in bf16, obtained as ``FastOptions.inference_weights`` says: cast in every call
  into a buffer the model's layers share (``Workspace``; autocast would allocate a fresh
  copy of every weight in every call; a block run in chunks casts its weights once for
  all of them), or held as a cast copy between calls.
* ``Block`` -> ``FastBlock``: one forward, ``FastBlock.fused``, whose parts the mode
  chooses.  With autograd, LayerNorm and GELU outputs are recomputed in the backward
  instead of stored (``recompute.py``) and the dense products take ``linear.py``'s
  kernels with their backward; without, each dense layer's inference product.  On a CPU
  in bf16, attention is two matmuls and a softmax: PyTorch's CPU flash-attention kernel
  has a slow bf16 backward; without autograd the heads are first copied into contiguous
  blocks (``contiguous_attention``), since both the fused kernel and matmuls over strided
  head views are slower forwards at ViT shapes.  Without autograd on a CPU the block runs
  over chunks of whole images of about ``CHUNK_ROWS`` tokens, half as many in bf16 (every
  part of a block acts on each image alone, so the values are the same), each written into
  its rows of the output: its activations stay a few MB, where the allocator reuses memory
  instead of mapping fresh pages (each faulting on first touch) for every wide activation
  of a large batch, and keeps little of it.  Not while ``capture_attention`` records: its maps
  are one per layer, of the whole batch.

A block takes its fused path only while its parts are the plain modules it was built
with (and the installed dense layers) and no module inside it carries a hook: a user who
wraps ``attn.qkv`` in an adapter, swaps ``mlp.fc1`` for a quantised layer, hooks ``norm1``,
``mlp.drop`` (whose first call, on the GELU output, a training step makes inside
``gelu_dense``) or ``drop_path`` (which inference calls once per chunk of images), or sets
a part's ``forward`` (or ``attn.attend``) on the module itself or on its class
gets the plain forward, calling every module, with the rest of the fast path (the
kernels of the ``FastLinear`` layers it calls) still in place.  A dense layer whose weight
or bias is a tensor of a class of its own (torchao's ``quantize_`` leaves quantised weights
so, before or after ``optimize``) computes ``F.linear`` as that class does, and its block
the plain forward.  torch's eager-mode quantisation (``quantize_dynamic``) swaps modules
by their exact class and leaves a ``FastLinear`` as it is: it warns, naming ``restore``.
A hook registered for every module (``torch.nn.modules.module.register_module_forward_hook``
and its kin) cannot be seen through torch's public API: inside the fused path the LayerNorm
and dense layers, ``Attention`` and ``Mlp`` are computed as functions, so such a hook sees the
block, its dropout and drop-path modules and a relative position bias, not them
(``restore`` the model for a hook that must see every layer).  ``torch.compile`` and
``torch.jit.trace`` trace the plain forward, and torch.func's transforms (``vmap``, ``grad``) and torch dispatch modes
(``FlopCounterMode``) run it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from ..models.layers import Attention, Block, Mlp
from .kernels import KernelChoice
from .linear import linear, linear_forward, mode_for, onednn_linear
from .recompute import gelu_dense, layer_norm_dense, split_heads


_ALIGN = 64  # elements: a shared cast's place in the workspace starts on a cache line


class Workspace:
    """Scratch memory the installed layers of one model share, per thread.

    A layer casts its weight into it right before its matmul reads it (``cast``), so one
    buffer of the largest weight's size serves every layer; threads running the same model
    each get their own.  While a block runs its inference over chunks of images
    (``casts_shared_by_chunks``), each weight the block casts gets its own place in the
    buffer and is cast once for every chunk, not once per chunk: the buffer then grows to
    one block's dense weights.  Copies and pickles of a model start with an empty one.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def cast(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``weight`` rounded to bf16 and held in ``dtype``, over this thread's buffer: valid until
        the next ``cast``, or inside ``casts_shared_by_chunks`` until the block's chunks are done."""
        local = self._local
        shared = getattr(local, "shared", None)  # {id(weight): cast} while a block's chunks share casts
        key = id(weight)
        if shared is not None and key in shared:
            return shared[key]
        start = local.used if shared is not None else 0
        end = start + weight.numel()
        buffer = getattr(local, "buffer", None)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < end:
            # a cast already handed out keeps the old buffer alive through its own view
            buffer = local.buffer = torch.empty(end, dtype=dtype, device=weight.device)
        out = buffer[start:end].view(weight.shape)
        weight = weight.detach()  # keyed above by the parameter itself: a detached view is new in every call
        out.copy_(weight if dtype == torch.bfloat16 else weight.to(torch.bfloat16))
        if shared is not None:
            shared[key], local.used = out, -(-end // _ALIGN) * _ALIGN
        return out

    @contextlib.contextmanager
    def casts_shared_by_chunks(self) -> Iterator[None]:
        """Inside the block, each weight is cast once and its cast reused by every chunk."""
        local = self._local
        local.shared, local.used = {}, 0
        try:
            yield
        finally:
            local.shared = None

    def __reduce__(self):
        return Workspace, ()


# How a dense layer gets its bf16 weight in CPU bf16 autocast inference (FastOptions).
INFERENCE_WEIGHTS = ("cast", "hold")


@dataclasses.dataclass(frozen=True)
class FastOptions:
    """What ``optimize`` installed: the CPU kernels, whether training recomputes, and how a
    dense layer gets its bf16 weight in CPU bf16 autocast inference (``inference_weights``):

    * ``"cast"``: cast into the shared ``workspace`` in every call (once per block call where
      the block runs in chunks); nothing is kept: what ``vitlab eval`` and ``vitlab predict`` use;
    * ``"hold"``: a cast copy kept on the layer between calls (``held_casts``; cast again
      when the parameter changes, as torch counts a change: an edit through ``.data`` is
      none, so optimise again after one), for the memory of half the fp32 dense weights
      again: no cast per call, which pays at small batches only.
    """

    kernels: KernelChoice
    recompute: bool = True
    inference_weights: str = "cast"
    workspace: Workspace = dataclasses.field(default_factory=Workspace, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.recompute, bool):  # recompute="no" was taken as true
            raise TypeError(f"FastOptions.recompute={self.recompute!r}: expected True or False")
        if self.inference_weights not in INFERENCE_WEIGHTS:
            raise ValueError(f"FastOptions.inference_weights={self.inference_weights!r}: expected one of "
                             f"{', '.join(INFERENCE_WEIGHTS)}")


class HeldCasts:
    """A dense layer's weight and bias, with ``inference_weights="hold"``, rounded to
    bf16 for CPU inference, with the key (storage and version of each parameter) they
    were cast from.  A cache: copies and pickles of a model start empty."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.key: tuple | None = None
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def __reduce__(self):
        return HeldCasts, ()


# What an installed module adds to the plain module's attributes (``_stand_in``).
_OWN_ATTRIBUTES = ("plain", "fast_options", "held_casts")


def _stand_in(fast: nn.Module, plain: nn.Module) -> None:
    """Make ``fast`` stand in for ``plain``: the same parameter, buffer, child and hook
    dictionaries (a parameter replaced or a hook added or removed on either is so on
    both), plain's other attributes, and plain itself kept for ``_restored`` (not as a
    child: the parameters stay reachable by one path only)."""
    vars(fast).update(vars(plain))
    vars(fast)["plain"] = plain


def _restored(fast: nn.Module, own_attributes: tuple[str, ...] = _OWN_ATTRIBUTES) -> nn.Module:
    """The plain module ``fast`` stands in for, given what changed on ``fast`` (its mode, attributes)
    but for the installed module's ``own_attributes``."""
    plain = vars(fast)["plain"]
    vars(plain).update((k, v) for k, v in vars(fast).items() if k not in own_attributes)
    parametrized = tuple(fast.parametrizations) if parametrize.is_parametrized(fast) else ()
    if any(not isinstance(getattr(type(plain), name, None), property) for name in parametrized):
        # registered on the installed module (weight norm, say), the parametrization gave it a class of
        # torch's over its own, whose properties compute the tensors: the plain module gets the same over
        # its class (without, its weight was gone); removing the parametrization takes it off again
        made = {k: v for k, v in vars(type(fast)).items() if k not in ("__dict__", "__weakref__", "__doc__")}
        plain.__class__ = type(f"Parametrized{type(plain).__name__}", (type(plain),), made)
    return plain


class FastLinear(nn.Linear):
    """``nn.Linear`` whose matmuls take the chosen kernels, standing in for ``plain`` (``optimize``)."""

    def __init__(self, plain: nn.Linear, options: FastOptions) -> None:
        _stand_in(self, plain)  # in place of nn.Linear's __init__: plain's parameters, not new ones
        self.configure(options)

    def configure(self, options: FastOptions) -> None:
        self.fast_options = options
        self.held_casts = HeldCasts()

    def __setattr__(self, name: str, value) -> None:
        if name == "qconfig":
            # torch.ao.quantization's eager mode (quantize_dynamic, prepare, prepare_qat) sets this
            # on every module it visits, then swaps modules by their exact class: it finds no
            # nn.Linear here and gives the layer back in fp32, without a word of its own
            warnings.warn("vitlab.fast: torch.ao.quantization takes a FastLinear, the stand-in vitlab.fast.optimize "
                          "installs for an nn.Linear, for another class and leaves it unquantised: call "
                          "vitlab.fast.restore(model) before quantising (and optimize after: the fast path "
                          "leaves quantised layers as they are)", UserWarning, stacklevel=2)
        super().__setattr__(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.compiler.is_compiling() or not _plain_tensors(self)
                or not _takes_over(x, self.fast_options.kernels)):
            return F.linear(x, self.weight, self.bias)  # torch.compile traces the plain product
        return self.product(x)

    def product(self, x: torch.Tensor, gelu: str | None = None) -> torch.Tensor:
        """``self(x)``, then GELU (``approximate=gelu``) when given, by the chosen kernels: with
        autograd ``linear.py``'s products and their backward; without, the inference product,
        in CPU bf16 autocast on the weight rounded to bf16 (``inference_weights``), the bias
        and a GELU applied to oneDNN's fp32 accumulator."""
        kernels = self.fast_options.kernels
        if torch.is_grad_enabled():
            self.held_casts.clear()  # training changes the weights: drop what inference kept
            out = linear(x, self.weight, self.bias, kernels)
            return out if gelu is None else F.gelu(out, approximate=gelu)
        bf16_autocast = (x.device.type == "cpu" and torch.is_autocast_enabled("cpu")
                         and torch.get_autocast_dtype("cpu") == torch.bfloat16)
        if bf16_autocast and kernels.bf16 == "onednn":
            weight, bias = self._rounded(torch.bfloat16)
            return onednn_linear(x.to(torch.bfloat16), weight, bias, gelu)
        if bf16_autocast and kernels.bf16 == "widened":  # bf16 values held in fp32, for the fp32 GEMM
            weight, bias = self._rounded(torch.float32)
            out = linear_forward(x, weight, bias, "widened", kernels, rounded=True)
        elif mode_for(x, kernels) == "onednn":
            return onednn_linear(x, self.weight, self.bias, gelu)
        else:
            out = F.linear(x, self.weight, self.bias)  # autocast (of another dtype) casts as usual
        return out if gelu is None else torch.ops.aten.gelu_(out, approximate=gelu)

    def _rounded(self, hold_in: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weight and bias rounded to bf16, held in ``hold_in``: with ``inference_weights="cast"``
        both cast in every call (the weight into the workspace), nothing kept; with "hold" both
        kept, and cast again when a parameter changes as torch counts a change (its storage or
        version: an in-place edit through ``.data`` is no change to torch, nor to a kept copy)."""
        held, options = self.held_casts, self.fast_options
        if options.inference_weights == "cast":
            # the bias too: a kept copy went stale when the bias was edited through .data
            bias = None if self.bias is None else self.bias.detach().to(torch.bfloat16).to(hold_in)
            return options.workspace.cast(self.weight, hold_in), bias
        params = [p for p in (self.weight, self.bias) if p is not None]
        key = (hold_in, *((p.data_ptr(), p._version) for p in params))
        if held.key != key:
            held.weight, held.bias = (None if p is None else p.detach().to(torch.bfloat16).to(hold_in)
                                      for p in (self.weight, self.bias))
            held.key = key
        return held.weight, held.bias


def _takes_over(x: torch.Tensor, kernels: KernelChoice) -> bool:
    """Whether the fast path runs this call: always on a GPU; on a CPU where the kernel choice
    has the fast path take over this mode (autograd on or off) and precision, but for a float64
    input under autocast.  Never under torch.func's transforms (vmap, grad, jacrev): the fast
    path's autograd functions have no rules for them, and ended the call in torch's error; nor
    under a torch dispatch mode (``FlopCounterMode``, so ``vitlab.analysis.count_flops``; a
    memory tracker), which then watches the plain model's operators: FlopCounterMode counted
    oneDNN's matmul as no FLOPs.  Nor under ``torch.jit.trace``, which records the plain model's
    operators: it cannot record oneDNN's matmul and failed on it ('unsupported input list type')."""
    if torch.jit.is_tracing():
        return False
    if torch._C._are_functorch_transforms_active():  # what torch's autograd.Function.apply asks itself
        return False
    if is_in_torch_dispatch_mode():
        return False
    if x.device.type != "cpu":
        return True
    if x.dtype == torch.float64 and torch.is_autocast_enabled("cpu"):
        return False  # autocast leaves float64 as it is; the fast path's bf16 kernels computed it in bf16
    bf16 = x.dtype == torch.bfloat16 or (torch.is_autocast_enabled("cpu")
                                         and torch.get_autocast_dtype("cpu") == torch.bfloat16)
    return kernels.takes_over(torch.is_grad_enabled(), bf16)


def _plain_tensors(layer: nn.Linear) -> bool:
    """Whether the layer's weight and bias are plain tensors.  One of a tensor class of its own
    (torchao's ``quantize_`` leaves its quantised weights in the ``nn.Linear``) computes ``F.linear``
    by its own rules, which the fast kernels (oneDNN's matmul, the bf16 casts) would bypass."""
    return all(p is None or type(p) in _PLAIN_TENSORS for p in (layer.weight, layer.bias))


_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)


# The methods the fused path computes as functions, as their classes define them: one patched on
# the class (Attention.forward = ..., as scripts that read attention maps do) is one it would not call.
_DEFINED = {(cls, name): vars(cls)[name] for cls, name in
            ((Block, "forward"), (Attention, "forward"), (Attention, "attend"), (Mlp, "forward"))}


def _patched_classes() -> bool:
    return any(vars(cls).get(name) is not method for (cls, name), method in _DEFINED.items())


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks
                or module._backward_hooks or module._backward_pre_hooks)


# Tokens per chunk of a block's inference with fp32 dense layers, half as many with bf16 ones:
# a chunk's widest activation (tokens x mlp_dim) then stays within ~12 MB (fp32) and ~3 MB
# (bf16) for the paper's widths, while its matmuls keep enough rows.  In bf16 the smaller
# chunks are for the allocator: glibc keeps a block's freed temporaries in its heap, up to
# about twice the widest of them at its top and more in the holes between them, which at
# 2048-token chunks held ViT-B/16's bf16 batch-8 inference at twice a peer's peak memory.
CHUNK_ROWS = 1024


class FastBlock(Block):
    """``Block`` with one fused forward whose parts the mode chooses (module text), standing
    in for ``plain`` (``optimize``)."""

    def __init__(self, plain: Block, options: FastOptions) -> None:
        _stand_in(self, plain)  # in place of Block's __init__: plain's parts, not new ones
        self.configure(options)

    def configure(self, options: FastOptions) -> None:
        self.fast_options = options

    def fusable(self) -> bool:
        """Whether the fused path computes exactly what the plain forward would, hooks on its parts included."""
        attn, mlp = self.attn, self.mlp
        dense = (attn.qkv, attn.proj, mlp.fc1, mlp.fc2)
        # the MLP's dropout too: a training step applies its first call inside gelu_dense, by its rate;
        # a forward set on a part itself (module.forward = ...) is one the fused path would not call
        parts = (self.norm1, self.norm2, attn, mlp, mlp.drop, *dense)
        # a hook on any module inside: those the fused path calls as modules (drop-path, the attention's
        # dropout, a position bias) it calls once per chunk of images in inference, each with a part of the batch
        return (type(self.norm1) is nn.LayerNorm and type(self.norm2) is nn.LayerNorm
                and type(attn) is Attention and type(mlp) is Mlp
                and all(type(m) is FastLinear and _plain_tensors(m) for m in dense)
                and type(mlp.drop) is nn.Dropout and "attend" not in vars(attn)
                and not any("forward" in vars(m) for m in parts) and not _patched_classes()
                and not any(_hooked(m) for m in self.modules() if m is not self))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling() or not self.fusable() or not _takes_over(x, self.fast_options.kernels):
            return super().forward(x, positions)
        if positions is not None:  # patch dropout: a training step, in one piece
            return self.fused(x, positions=positions)
        # recording attention (capture_attention): one map of the whole batch per layer, as the plain model records
        # it, not one per chunk, which a reader of the maps took for layers
        chunks = _inference_chunks(x) if self.attn.recorded is None else 1
        if chunks == 1:
            return self.fused(x)
        # Without autograd on a CPU (the allocator's fresh pages are a CPU cost; a GPU wants the
        # whole batch): chunks of whole images, each one's result written into its rows of the output.
        parts = x.split(-(-x.shape[0] // chunks))
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, _dense_dtype(x)), device=x.device)
        with self.fast_options.workspace.casts_shared_by_chunks():
            for part, rows in zip(parts, out.split(parts[0].shape[0])):
                self.fused(part, out=rows)
        return out

    def fused(self, x: torch.Tensor, out: torch.Tensor | None = None,
              positions: torch.Tensor | None = None) -> torch.Tensor:
        """``Block.forward(x, positions)``'s values, the last residual sum written into ``out`` when given.

        With autograd (and ``recompute``) the LayerNorm -> dense and GELU -> dense pairs store
        their inputs, not the LayerNorm and GELU outputs; otherwise each dense layer's
        ``product``, which without autograd is its inference product, the GELU applied as the
        first MLP layer writes its output.
        """
        attn, mlp, kernels = self.attn, self.mlp, self.fast_options.kernels
        recompute = self.fast_options.recompute and torch.is_grad_enabled()
        if recompute:
            qkv = layer_norm_dense(x, self.norm1, attn.qkv, kernels)
        else:
            qkv = attn.qkv.product(_layer_norm(self.norm1, x))
        x = x + self.drop_path(attn.proj_drop(attn.proj.product(self.attend(qkv, positions))))
        if recompute:
            h = layer_norm_dense(x, self.norm2, mlp.fc1, kernels)
            y = gelu_dense(h, mlp.approximate, mlp.drop, mlp.fc2, kernels)
        else:
            h = mlp.drop(mlp.fc1.product(_layer_norm(self.norm2, x), gelu=mlp.approximate))
            y = mlp.fc2.product(h)
        return torch.add(x, self.drop_path(mlp.drop(y)), out=out)

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Multi-head attention of the (B, L, 3D) qkv projection -> (B, L, D): over contiguous
        copies of the heads in CPU bf16 without autograd (``contiguous_attention``), else over
        strided views of them (their copies and backward did not pay in a training step:
        benchmarks/NOTES.md, 2026-11-24 and -25), by two matmuls and a softmax where
        ``_explicit`` says so."""
        attn = self.attn
        if not torch.is_grad_enabled() and _contiguous_attention_applies(qkv, attn):
            drop = attn.attn_drop if attn.training else 0.0
            return contiguous_attention(qkv, attn.num_heads, attn.head_dim**-0.5, drop)
        q, k, v = split_heads(qkv, attn.num_heads)
        return attn.attend(q, k, v, explicit=_explicit(q, self.fast_options.kernels), positions=positions)


def _layer_norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def _dense_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the dense layers' outputs: autocast's on a CPU where it is on, else ``x``'s."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype


def _inference_chunks(x: torch.Tensor) -> int:
    """How many chunks of images a block's forward over ``x`` (B, L, D) runs in: without autograd
    on a CPU, enough for chunks of about ``CHUNK_ROWS`` tokens of 4-byte dense outputs, half as
    many of 2-byte ones; else 1."""
    images, tokens = x.shape[0], x.shape[1]
    if torch.is_grad_enabled() or x.device.type != "cpu" or images == 1:
        return 1
    per_chunk = CHUNK_ROWS * _dense_dtype(x).itemsize // 4
    return max(1, -(-images * tokens // per_chunk))


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


def _explicit(q: torch.Tensor, kernels: KernelChoice) -> bool:
    """Whether the block attends by two matmuls and a softmax: always in bf16 on a CPU
    (PyTorch's fused attention kernel is the slower one there, its backward most of all),
    in fp32 on a CPU where the kernel choice says so."""
    return q.device.type == "cpu" and (q.dtype == torch.bfloat16 or kernels.attention == "explicit")


def _contiguous_attention_applies(qkv: torch.Tensor, attn: Attention) -> bool:
    """Whether the block attends by ``contiguous_attention``: bf16 on a CPU, and no attention
    bias (relative or distance) or recording of the attention weights, which ``Attention.attend``
    handles."""
    return (qkv.device.type == "cpu" and qkv.dtype == torch.bfloat16
            and attn.rel_pos is None and attn.distance_bias is None and attn.recorded is None)


# The plain modules optimize replaces (exact types: a subclass may compute something else).
_FAST = {nn.Linear: FastLinear, Block: FastBlock}
_INSTALLED = (FastLinear, FastBlock)


def install(model: nn.Module, options: FastOptions) -> nn.Module:
    """Put a fast module in the place of every plain ``nn.Linear`` and ``Block`` of ``model``,
    and give those already installed ``options``.  Returns the model: ``model`` itself,
    unless it is a dense layer or a block, whose fast module is returned."""
    need_module(model, "optimize")
    stand_ins: dict[int, nn.Module] = {}  # one per plain module, wherever the model holds it

    def fast(module: nn.Module) -> nn.Module:
        if isinstance(module, _INSTALLED):
            module.configure(options)
            return module
        if type(module) not in _FAST:
            return module
        if id(module) not in stand_ins:
            stand_ins[id(module)] = _FAST[type(module)](module, options)
        return stand_ins[id(module)]

    _replace(model, fast)
    return fast(model)


def uninstall(model: nn.Module) -> nn.Module:
    """Put the plain module back in the place of every installed one; returns the model (the
    plain module when ``model`` itself is an installed one)."""
    need_module(model, "restore")
    def plain(module: nn.Module) -> nn.Module:
        return _restored(module) if isinstance(module, _INSTALLED) else module

    _replace(model, plain)
    return plain(model)


def options_by_module(model: nn.Module) -> dict[int, FastOptions]:
    """The options of every installed module of ``model``, by the module's ``id``."""
    return {id(module): module.fast_options for module in model.modules() if isinstance(module, _INSTALLED)}


def reinstate(model: nn.Module, before: dict[int, FastOptions]) -> nn.Module:
    """``model`` as ``options_by_module`` saw it: the installed modules it names with their options
    again, the others plain; returns the model (the plain module when ``model`` itself was not installed)."""
    def back(module: nn.Module) -> nn.Module:
        if not isinstance(module, _INSTALLED):
            return module
        if id(module) not in before:
            return _restored(module)
        module.configure(before[id(module)])
        return module

    _replace(model, back)
    return back(model)


def need_module(model, call: str) -> None:
    """Refuse what is not a module, by name (a string or None failed on its missing ``named_modules``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{call}: model={model!r:.80}: expected a torch.nn.Module (a model, a dense layer or an "
                        "encoder block)")


def _replace(model: nn.Module, new) -> None:
    """Set every submodule of ``model``, under each name it has, to ``new(submodule)``."""
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if not name:
            continue
        replacement = new(module)
        if replacement is not module:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, replacement)


def installed(model: nn.Module) -> FastOptions | None:
    """The options of the first installed module of ``model``, or None when none is installed."""
    for module in model.modules():
        if isinstance(module, _INSTALLED):
            return module.fast_options
    return None
