"""FP8 matmuls for training: an opt-in, reversible swap of the encoder blocks' dense layers.

    swap = install_fp8(model, "tensorwise")   # in place: every block's qkv, proj, fc1 and fc2
    swap.line()                               # which layers were swapped, which stay in bf16
    uninstall_fp8(model)                      # the plain nn.Linear modules back

What a run asks for with ``run.fp8`` (``vitlab.train``: bf16 autocast for the rest of the
model, and a GPU with fp8 tensor cores, compute capability 8.9 or later, or the run is
refused).  The swap itself runs anywhere: ``torch._scaled_mm`` computes on a CPU too
(emulated, slowly), which is how the tests check its values.

Only the encoder blocks' four dense layers are swapped, and only those whose input and output
features are multiples of 16 (``_scaled_mm``'s rule): they hold nearly all of a ViT's matmul
work.  The patch embedding, the head, a pre-logits layer and every other layer stay in bf16:
small layers whose casts would cost more than their fp8 product saves.

A swapped layer (``Float8Linear``) stands in for the plain one as ``vitlab.fast``'s installed
modules do (``modules._stand_in``): the same parameter, child and hook dictionaries, so the
same ``Parameter`` objects and state-dict keys (checkpoints hold the plain weights; an
optimiser, EMA copy or DDP wrapper built after the swap keeps working), the plain module kept
for ``uninstall_fp8``, and its own state attributes of its own (``fp8_scaling``, ``fp8_backend``,
``torchao_layer``).  Install it before ``vitlab.fast.optimize``: the fast blocks then see dense
layers that are not their own and take the plain block's forward, which calls each layer.

In a training forward (autograd on) the layer's product runs in fp8 with dynamic scaling: each
operand's largest magnitude (its amax) sets the scale that maps it onto the fp8 format's
largest value, the operands are cast (saturating) and ``_scaled_mm`` multiplies them into bf16;
the bias is added in bf16.  Two scalings:

* ``"tensorwise"``: one scale per tensor.  Input and weight in e4m3 (more mantissa), the
  output's gradient in e5m2 (more range); the backward reuses the forward's fp8 input and
  weight, which is all the layer keeps for it (1 byte an element).
* ``"rowwise"``: one scale per row of the left operand and per column of the right one, each
  taken along the dimension its product sums over; every operand in e4m3 with power-of-two
  scales (exact to apply), as torchao's rowwise recipe has them.  The weight's gradient sums
  over the tokens, so its operands are scaled again along the token axis: the layer keeps its
  input in bf16 for the backward, as bf16 autocast would.

Two implementations of that arithmetic (``backend``, ``run.fp8_backend``): ``"vitlab"``, the
functions below, and ``"torchao"``, torchao's float8 training layer (``convert_to_float8_training``
with the recipe of the same name; the ``fp8`` extra) computing the product inside the same
stand-in, so that the swap, its reversal, the state dict and the evaluations are the same for
both and a bench measures the two arithmetics alone.  On inputs bf16 holds exactly they agree
to rounding (tests/test_fp8.py); torchao casts a layer's input to autocast's dtype before
scaling it, this module scales it as it comes.  torchao's layer is built on the meta device from
the plain layer's shape and given the stand-in's parameter dictionary: it holds no weights of
its own and is no child of the model.  Since torchao 0.18 ``convert_to_float8_training`` also
patches inductor's Triton code for min/max, process-wide and for good (torchao's workaround for
a Triton fp8 store bug, numerically the same code): the one change to the process this option
brings that uninstalling does not undo.

Without autograd (the evaluations inside a run, ``vitlab eval``) the layer computes the plain
product, so that a run scores its weights as they will be scored once saved.  A NaN or an
infinity in an operand makes its scale, and so the product, non-finite: the step is caught as
any other non-finite step.  How fast it trains was measured once on a GPU; how well, emulated on
a CPU only (docs/performance.md).
"""
from __future__ import annotations

import dataclasses
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..config import ConfigError
from ..extras import require
from ..models.layers import Block
from .modules import FastLinear, _replace, _restored, _stand_in, need_module

FP8_SCALINGS = ("tensorwise", "rowwise")
FP8_BACKENDS = ("vitlab", "torchao")  # whose arithmetic computes the swapped layers' products (module text)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# _scaled_mm's rule on CUDA: the summed dimension and the output's columns are multiples of 16
ALIGN = 16
# The dense layers of an encoder block that are swapped, by their paths in the block
BLOCK_DENSE = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
# What a swapped layer adds to the plain module's attributes
_OWN_ATTRIBUTES = ("plain", "fp8_scaling", "fp8_backend", "torchao_layer")


# ----------------------------------------------------------------------------- the arithmetic


def quantize(t: torch.Tensor, dtype: torch.dtype, rowwise: bool,
             power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (R, C) cast to the fp8 ``dtype``, row-major whatever ``t``'s strides, and the scale
    that multiplies it back (what ``_scaled_mm`` takes): one for the tensor, or one per row
    ((R, 1), ``rowwise``).  Each scale maps the largest magnitude it covers onto the format's
    largest value; values beyond it saturate.  ``power_of_two``: the scale rounded down to a
    power of two, which multiplies without rounding."""
    largest = torch.finfo(dtype).max
    magnitude = t.abs()
    amax = (magnitude.amax(dim=1, keepdim=True) if rowwise else magnitude.amax()).float()
    # a NaN or infinite amax makes the scale, then the product, non-finite: the step is caught, not hidden
    scale = largest / amax.clamp(min=1e-12)
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    cast = (t.float() * scale).clamp(-largest, largest).to(dtype, memory_format=torch.contiguous_format)
    return cast, scale.reciprocal()


def scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b_rows: torch.Tensor, b_scale: torch.Tensor,
              fast_accum: bool) -> torch.Tensor:
    """``a @ b_rows.T`` in bf16 from fp8 operands given with the summed dimension last: ``a``
    (M, K) and ``b_rows`` (N, K), both row-major, so that ``b_rows.T`` is the column-major right
    operand cuBLAS's fp8 GEMM takes.  Scales: one each, or ``a``'s per row (M, 1) and
    ``b_rows``' per row (N, 1).  The layout and size rules are CUDA's, checked on every device, so
    that the CPU's emulation tests the products a GPU would run."""
    if not (a.is_contiguous() and b_rows.is_contiguous() and a.shape[1] == b_rows.shape[1]
            and a.shape[1] % ALIGN == 0 and b_rows.shape[0] % ALIGN == 0):
        raise RuntimeError(f"fp8 matmul: operands {tuple(a.shape)} and {tuple(b_rows.shape)} must be row-major "
                           f"with the summed (last) dimension and the second's rows multiples of {ALIGN}")
    b_scale = b_scale.reshape(1, -1) if b_scale.dim() else b_scale  # per column of the right operand
    return torch._scaled_mm(a, b_rows.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accum)


def pad_rows(t: torch.Tensor, multiple: int = ALIGN) -> torch.Tensor:
    """``t`` with zero rows appended up to a multiple of ``multiple`` (itself when it has that
    many): the weight's gradient sums over the tokens, whose count need not be a multiple of 16,
    and zero rows add nothing to the sum nor to an amax."""
    rows = t.shape[0]
    padded = -(-rows // multiple) * multiple
    if padded == rows:
        return t
    out = t.new_zeros((padded, *t.shape[1:]))
    out[:rows] = t
    return out


class _Float8Matmul(torch.autograd.Function):
    """``x @ weight.T`` of ``x`` (M, K) and ``weight`` (N, K) in fp8 (``scaling``), bf16 out."""

    @staticmethod
    def forward(ctx, x, weight, scaling):
        rowwise = scaling == "rowwise"
        # autocast off: the casts here are the fp8 ones, and no operand may be cast again
        with torch.autocast(x.device.type, enabled=False):
            x8, x_scale = quantize(x, E4M3, rowwise, power_of_two=rowwise)
            w8, w_scale = quantize(weight, E4M3, rowwise, power_of_two=rowwise)
            out = scaled_mm(x8, x_scale, w8, w_scale, fast_accum=True)
        ctx.scaling, ctx.dtypes = scaling, (x.dtype, weight.dtype)
        if rowwise:  # scaled again along the token axis in the backward: kept in bf16, as autocast keeps it
            ctx.save_for_backward(x.to(torch.bfloat16), weight)
        else:
            ctx.save_for_backward(x8, x_scale, w8, w_scale)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        needs_x, needs_weight = ctx.needs_input_grad[:2]
        # No autocast context here, unlike the forward: Dynamo traces this backward while it traces the
        # forward, and a context here left that trace believing autocast off after the layer (the next
        # fp8 layer then returned fp32; tests/test_fp8.py).  None of these operators is one autocast casts
        if ctx.scaling == "rowwise":
            grad_x, grad_weight = _rowwise_backward(grad, *ctx.saved_tensors, needs_x, needs_weight)
        else:
            grad_x, grad_weight = _tensorwise_backward(grad, *ctx.saved_tensors, needs_x, needs_weight)
        x_dtype, weight_dtype = ctx.dtypes
        return (None if grad_x is None else grad_x.to(x_dtype),
                None if grad_weight is None else grad_weight.to(weight_dtype), None)


def _tensorwise_backward(grad, x8, x_scale, w8, w_scale, needs_x, needs_weight):
    """(grad of x, grad of weight): grad (M, N) in e5m2 by one scale, against the forward's fp8
    operands; the weight's gradient sums over the tokens, padded to a multiple of 16."""
    g8, g_scale = quantize(grad, E5M2, rowwise=False)
    grad_x = scaled_mm(g8, g_scale, w8.t().contiguous(), w_scale, fast_accum=False) if needs_x else None
    grad_weight = None
    if needs_weight:
        grad_weight = scaled_mm(pad_rows(g8).t().contiguous(), g_scale, pad_rows(x8).t().contiguous(), x_scale,
                                fast_accum=False)
    return grad_x, grad_weight


def _rowwise_backward(grad, x, weight, needs_x, needs_weight):
    """(grad of x, grad of weight), each operand scaled per row along the dimension its product
    sums over: the output features for the input's gradient, the tokens for the weight's."""
    def cast(t):
        return quantize(t, E4M3, rowwise=True, power_of_two=True)

    grad_x = grad_weight = None
    if needs_x:  # (M, N) @ (N, K)
        grad_x = scaled_mm(*cast(grad), *cast(weight.t()), fast_accum=True)
    if needs_weight:  # (N, M) @ (M, K)
        grad_weight = scaled_mm(*cast(pad_rows(grad).t()), *cast(pad_rows(x).t()), fast_accum=True)
    return grad_x, grad_weight


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scaling: str) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its product in fp8 (``scaling``), with autograd; the
    result in autocast's dtype where autocast is on, else in ``x``'s."""
    device = x.device.type
    out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    rows = _Float8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, scaling).to(out_dtype)
    out = rows.reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias.to(out_dtype)


# ----------------------------------------------------------------------------- the swap


def torchao_float8() -> ModuleType:
    """``torchao.float8``, or MissingPackage (an ImportError naming the ``fp8`` extra): what
    ``run.fp8_backend="torchao"`` needs, asked where a run is resolved and where layers are swapped."""
    return require("torchao.float8", "run.fp8_backend='torchao'")


def torchao_float8_layer(layer: nn.Linear, scaling: str) -> nn.Linear:
    """torchao's float8 training layer for ``layer`` (``scaling``: its recipe of that name), built
    on the meta device and computing with ``layer``'s own parameter dictionary, whatever replaces a
    parameter there later.  MissingPackage without torchao (``torchao_float8``)."""
    float8 = torchao_float8()
    with torch.device("meta"):
        template = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    config = float8.Float8LinearConfig.from_recipe_name(scaling)
    product = float8.convert_to_float8_training(template, config=config)
    vars(product)["_parameters"] = vars(layer)["_parameters"]  # layer's weight and bias, not the template's
    return product


class Float8Linear(nn.Linear):
    """``nn.Linear`` whose training product runs in fp8 (``fp8_scaling``, by ``fp8_backend``'s
    arithmetic), standing in for ``plain`` (``install_fp8``)."""

    def __init__(self, plain: nn.Linear, scaling: str, backend: str = "vitlab") -> None:
        _stand_in(self, plain)  # in place of nn.Linear's __init__: plain's parameters, not new ones
        self.configure(scaling, backend)

    def configure(self, scaling: str, backend: str) -> None:
        """Compute with ``scaling`` by ``backend``'s arithmetic from now on."""
        # torchao's layer lives in __dict__, not _modules: no child, no second path to the parameters
        vars(self)["torchao_layer"] = torchao_float8_layer(self, scaling) if backend == "torchao" else None
        self.fp8_scaling, self.fp8_backend = scaling, backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # scored as the saved weights will be (module text)
            return F.linear(x, self.weight, self.bias)
        if self.torchao_layer is None:
            return fp8_linear(x, self.weight, self.bias, self.fp8_scaling)
        device = x.device.type  # torchao's layer reads CUDA's autocast alone: the input is cast here on any device
        return self.torchao_layer(x.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else x)


@dataclasses.dataclass(frozen=True)
class Fp8Swap:
    """What ``install_fp8`` did: the dense layers in fp8 and the blocks' dense layers it left
    in bf16, with why, by their names in the model."""

    scaling: str
    swapped: tuple[str, ...]
    kept: tuple[tuple[str, str], ...] = ()
    layers: tuple[str, ...] = BLOCK_DENSE  # the block layers asked for (``install_fp8``'s ``layers``)
    backend: str = "vitlab"  # whose arithmetic (``install_fp8``'s ``backend``)

    def line(self) -> str:
        """"fp8 tensorwise: 8 dense layers of the encoder blocks (qkv, proj, fc1, fc2); bf16: ...", for logs
        ("fp8 tensorwise by torchao: ..." with torchao's arithmetic)."""
        kept = "".join(f", {name} ({why})" for name, why in self.kept)
        kinds = ", ".join(path.rpartition(".")[2] for path in self.layers)
        by = f" by {self.backend}" if self.backend != "vitlab" else ""
        return (f"fp8 {self.scaling}{by}: {len(self.swapped)} dense layers of the encoder blocks ({kinds}); "
                f"bf16: the patch embedding, head and every other layer{kept}")


def install_fp8(model: nn.Module, scaling: str = "tensorwise", layers: tuple[str, ...] = BLOCK_DENSE,
                backend: str = "vitlab") -> Fp8Swap:
    """Put a ``Float8Linear`` in the place of every encoder block's dense layers named in
    ``layers`` (of qkv, proj, fc1 and fc2: ``BLOCK_DENSE``'s paths, all four by default) of
    ``model`` whose features are multiples of 16, in place, computing by ``backend``'s
    arithmetic (``FP8_BACKENDS``); layers swapped already take ``scaling`` and ``backend``, and
    those no longer named get their plain layer back.  Returns what was swapped and what was
    not.  Raises ValueError for an unknown scaling, backend or layer, or a model
    ``vitlab.fast.optimize`` has installed itself on (install fp8 first), TypeError for what is
    no module; MissingPackage for ``backend="torchao"`` without torchao: each before the model is touched."""
    if scaling not in FP8_SCALINGS:
        raise ValueError(f"install_fp8: scaling={scaling!r}: expected one of {', '.join(FP8_SCALINGS)}")
    if backend not in FP8_BACKENDS:
        raise ValueError(f"install_fp8: backend={backend!r}: expected one of {', '.join(FP8_BACKENDS)}")
    if backend == "torchao":
        torchao_float8()
    need_module(model, "install_fp8")
    layers = check_fp8_layers(layers)
    stand_ins: dict[int, nn.Module] = {}  # one per plain layer, wherever the model holds it
    swapped, kept, again = [], [], []
    for name, block in model.named_modules():
        if not isinstance(block, Block):
            continue
        for path in BLOCK_DENSE:
            layer, full = block.get_submodule(path), f"{name}.{path}" if name else path
            if isinstance(layer, FastLinear):
                raise ValueError(f"install_fp8: {full} is vitlab.fast's; install fp8 before vitlab.fast.optimize "
                                 "(vitlab.fast.restore the model first)")
            if path not in layers:  # left in bf16 as asked: a layer swapped before gets its plain one back
                if isinstance(layer, Float8Linear):
                    stand_ins.setdefault(id(layer), _restored(layer, _OWN_ATTRIBUTES))
                continue
            if isinstance(layer, Float8Linear):
                again.append(layer)  # configured once nothing is refused: a refusal leaves the model as it was
            elif type(layer) is not nn.Linear:  # an adapter or a quantised layer computes something else
                kept.append((full, f"a {type(layer).__name__}, not an nn.Linear"))
                continue
            elif layer.in_features % ALIGN or layer.out_features % ALIGN:
                kept.append((full, f"{layer.in_features} -> {layer.out_features} features, not multiples of {ALIGN}"))
                continue
            else:
                stand_ins.setdefault(id(layer), Float8Linear(layer, scaling, backend))
            swapped.append(full)
    for layer in again:
        layer.configure(scaling, backend)
    _replace(model, lambda module: stand_ins.get(id(module), module))
    return Fp8Swap(scaling, tuple(swapped), tuple(kept), layers, backend)


def check_fp8_layers(layers, name: str = "layers") -> tuple[str, ...]:
    """``layers`` (one path, or several) as a tuple of ``BLOCK_DENSE``'s paths, in their order;
    ConfigError (a ValueError) otherwise."""
    given = (layers,) if isinstance(layers, str) else layers
    if not isinstance(given, (tuple, list)) or not given or any(path not in BLOCK_DENSE for path in given):
        raise ConfigError(f"{name}={layers!r}: expected some of {', '.join(BLOCK_DENSE)}, e.g. mlp.fc1,mlp.fc2")
    return tuple(path for path in BLOCK_DENSE if path in given)


def uninstall_fp8(model: nn.Module) -> nn.Module:
    """Put the plain ``nn.Linear`` back in the place of every ``Float8Linear`` of ``model`` (the
    same objects, parameters and hooks); returns the model."""
    need_module(model, "uninstall_fp8")
    _replace(model, lambda module: _restored(module, _OWN_ATTRIBUTES) if isinstance(module, Float8Linear) else module)
    return model


def fp8_scaling(model: nn.Module) -> str | None:
    """The scaling of ``model``'s fp8 layers, or None where ``install_fp8`` swapped none."""
    need_module(model, "fp8_scaling")
    for module in model.modules():
        if isinstance(module, Float8Linear):
            return module.fp8_scaling
    return None
