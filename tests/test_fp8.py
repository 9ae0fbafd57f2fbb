"""``vitlab.fast.fp8``: the blocks' dense layers in fp8, swapped in and out like the rest of
``vitlab.fast``.  ``torch._scaled_mm`` runs on a CPU (emulated), so the products, their
gradients and a short training run are checked here; the layout rules of CUDA's fp8 GEMM are
checked on every call (``scaled_mm``)."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vitlab
import vitlab.fast as fast
from vitlab.config import ViTConfig
from vitlab.fast.fp8 import E4M3, E5M2, Float8Linear, fp8_linear, pad_rows, quantize, scaled_mm
from vitlab.models.layers import Block

torch.set_num_threads(2)
SCALINGS = ("tensorwise", "rowwise")
# tokens (not a multiple of 16: the weight's gradient pads them), input and output features
M, K, N = 37, 64, 48


def tiny(**fields) -> ViTConfig:
    base = dict(img_size=16, patch_size=4, width=32, depth=2, mlp_dim=64, num_heads=4, num_classes=5)
    return ViTConfig(**(base | fields))


def model_of(cfg: ViTConfig) -> nn.Module:
    torch.manual_seed(0)
    model = vitlab.create_model(cfg)
    with torch.no_grad():  # the zero-initialised head would hide everything behind it
        model.head.weight.normal_(std=0.1)
    return model


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def bf16_values(*shape: int) -> torch.Tensor:
    """Random fp32 values that bf16 holds exactly: the rowwise backward keeps its input in bf16."""
    return torch.randn(*shape).bfloat16().float()


# ----------------------------------------------------------------------------- the arithmetic


def dequantized(t: torch.Tensor, dtype: torch.dtype, dim: int | None, power_of_two: bool = False) -> torch.Tensor:
    """``t`` cast to fp8 by a scale per slice along ``dim`` (None: one scale) that maps the slice's
    largest magnitude onto the format's largest value, and multiplied back, in float64: written
    here from the definition, apart from ``quantize``."""
    largest = torch.finfo(dtype).max
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = largest / amax.double()
    if power_of_two:
        scale = 2.0 ** torch.floor(torch.log2(scale))
    return (t.double() * scale).clamp(-largest, largest).to(dtype).double() / scale


@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_maps_each_amax_onto_the_formats_largest_value(rowwise, dtype):
    t = torch.randn(M, K) * torch.logspace(-3, 3, M)[:, None]  # rows of very different sizes
    cast, inverse = quantize(t.t(), dtype, rowwise)  # a transposed view: the cast is row-major all the same
    assert cast.dtype == dtype and cast.shape == (K, M) and cast.is_contiguous()
    assert inverse.shape == ((K, 1) if rowwise else ())
    largest = torch.finfo(dtype).max
    peaks = cast.float().abs().amax(dim=1) if rowwise else cast.float().abs().amax()
    assert torch.all(peaks == largest)  # each amax lands on the largest value exactly
    expected = dequantized(t.t(), dtype, 1 if rowwise else None)
    assert torch.allclose(cast.double() * inverse.double(), expected, rtol=1e-6, atol=0)


def test_power_of_two_scales_are_powers_of_two_and_never_overflow():
    t = torch.randn(M, K) * 3.7
    cast, inverse = quantize(t, E4M3, rowwise=True, power_of_two=True)
    exponent = torch.log2(inverse)
    assert torch.equal(exponent, exponent.round())
    assert cast.float().abs().amax() <= torch.finfo(E4M3).max
    assert torch.all(cast.float().abs().amax(dim=1) >= torch.finfo(E4M3).max / 2)  # rounded down by at most 2x


def test_scaled_mm_holds_every_device_to_cudas_layout_rules():
    a, a_scale = quantize(torch.randn(M, K), E4M3, rowwise=False)
    b, b_scale = quantize(torch.randn(N, K), E4M3, rowwise=False)
    assert scaled_mm(a, a_scale, b, b_scale, fast_accum=True).shape == (M, N)
    with pytest.raises(RuntimeError, match="row-major"):
        scaled_mm(a, a_scale, b.t().contiguous().t(), b_scale, fast_accum=True)  # the right operand column-major
    odd, odd_scale = quantize(torch.randn(N, 40), E4M3, rowwise=False)
    with pytest.raises(RuntimeError, match="multiples of 16"):
        scaled_mm(quantize(torch.randn(M, 40), E4M3, rowwise=False)[0], a_scale, odd, odd_scale, fast_accum=True)


def test_pad_rows_appends_zero_rows_up_to_a_multiple_of_16():
    t = torch.randn(M, 3).to(E5M2)
    padded = pad_rows(t)
    assert padded.shape == (48, 3) and padded.dtype == E5M2
    assert torch.equal(padded[:M].float(), t.float()) and not padded[M:].float().any()
    assert pad_rows(padded) is padded


@pytest.mark.parametrize("scaling", SCALINGS)
def test_the_product_is_that_of_the_fp8_operands(scaling):
    """Reference agreement: against the dequantised operands multiplied in float64, each scaled
    along the dimension the product sums over (rowwise) or as a whole."""
    torch.manual_seed(0)
    x, weight, bias = bf16_values(M, K), bf16_values(N, K), torch.randn(N)
    if scaling == "rowwise":
        want = dequantized(x, E4M3, 1, True) @ dequantized(weight, E4M3, 1, True).T
    else:
        want = dequantized(x, E4M3, None) @ dequantized(weight, E4M3, None).T
    got = fp8_linear(x, weight, bias, scaling)
    assert got.dtype == torch.float32  # no autocast: the input's dtype
    assert relative_error(got - bias, want) < 4e-3  # one rounding, to bf16 (8 bits)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_gradients_are_the_products_of_the_fp8_operands(scaling):
    torch.manual_seed(0)
    x, weight = bf16_values(M, K).requires_grad_(), bf16_values(N, K).requires_grad_()
    grad = bf16_values(M, N)
    fp8_linear(x, weight, None, scaling).backward(grad)
    if scaling == "rowwise":
        grad_x = dequantized(grad, E4M3, 1, True) @ dequantized(weight.detach(), E4M3, 0, True)
        grad_weight = dequantized(grad, E4M3, 0, True).T @ dequantized(x.detach(), E4M3, 0, True)
    else:
        g8 = dequantized(grad, E5M2, None)
        grad_x = g8 @ dequantized(weight.detach(), E4M3, None)
        grad_weight = g8.T @ dequantized(x.detach(), E4M3, None)
    assert x.grad.dtype == x.dtype and weight.grad.dtype == weight.dtype
    assert relative_error(x.grad, grad_x) < 4e-3  # one rounding, to bf16
    assert relative_error(weight.grad, grad_weight) < 4e-3


@pytest.mark.parametrize("scaling", SCALINGS)
def test_an_fp8_layer_agrees_with_its_bf16_layer_within_what_fp8_rounds(scaling):
    """Against the plain layer in bf16 autocast: e4m3 keeps 3 bits of mantissa (a value's rounding
    error up to 1/16), e5m2 2 bits; the errors of a product's terms mostly cancel."""
    torch.manual_seed(0)
    plain = nn.Linear(K, N)
    x = torch.randn(4, 9, K, requires_grad=True)  # any leading dimensions
    grad = torch.randn(4, 9, N)
    with torch.autocast("cpu", torch.bfloat16):
        want = plain(x)
    want.float().backward(grad)
    wanted = x.grad, plain.weight.grad, plain.bias.grad
    x.grad = plain.weight.grad = plain.bias.grad = None

    layer = Float8Linear(plain, scaling)
    with torch.autocast("cpu", torch.bfloat16):
        got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    got.float().backward(grad)
    assert relative_error(got.detach(), want.detach()) < 0.06
    bound = 0.06 if scaling == "rowwise" else 0.1  # tensorwise: the output's gradient in e5m2
    for mine, theirs in zip((x.grad, plain.weight.grad, plain.bias.grad), wanted):
        assert relative_error(mine, theirs) < bound


@pytest.mark.parametrize("scaling", SCALINGS)
def test_a_nan_or_an_infinity_makes_the_product_not_finite(scaling):
    layer = Float8Linear(nn.Linear(K, N), scaling)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(M, K, requires_grad=True)
        with torch.no_grad():
            x[3, 5] = bad
        out = layer(x)
        assert not torch.isfinite(out).all()
        assert not torch.isfinite(out[3]).all()  # the row that holds it, whatever the scaling


def test_without_autograd_the_layer_computes_the_plain_product():
    plain = nn.Linear(K, N)
    x = torch.randn(M, K)
    want = plain(x)
    layer = Float8Linear(plain, "tensorwise")
    with torch.no_grad():
        assert torch.equal(layer(x), want)


# ----------------------------------------------------------------------------- torchao's arithmetic


@pytest.mark.parametrize("scaling", SCALINGS)
def test_torchaos_recipes_compute_the_products_and_gradients_of_vitlabs_own(scaling):
    """Reference agreement between two implementations of the same arithmetic: torchao's
    float8 training recipe of each name against ``fp8_linear``, on inputs bf16 holds exactly
    (torchao's layer takes its input in autocast's dtype) under bf16 autocast."""
    pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    plain = nn.Linear(K, N)
    x = bf16_values(4, 9, K).requires_grad_()
    grad = torch.randn(4, 9, N)
    results = {}
    for backend in fast.FP8_BACKENDS:
        x.grad = plain.weight.grad = plain.bias.grad = None
        layer = Float8Linear(plain, scaling, backend)
        with torch.autocast("cpu", torch.bfloat16):
            out = layer(x)
        out.float().backward(grad)
        assert out.dtype == torch.bfloat16
        results[backend] = (out.detach(), x.grad, plain.weight.grad, plain.bias.grad)
    for mine, theirs in zip(results["vitlab"], results["torchao"]):
        assert relative_error(mine, theirs) < 1e-4  # the same fp8 operands; at most the bias's bf16 rounding apart


def test_torchaos_layer_computes_with_the_stand_ins_parameters_and_leaves_with_it(monkeypatch):
    pytest.importorskip("torchao.float8")
    import torchao.float8

    model = model_of(tiny())
    modules, keys = set(dict(model.named_modules())), list(model.state_dict())
    params = dict(model.named_parameters())
    swap = fast.install_fp8(model, "tensorwise", backend="torchao")
    assert swap.backend == "torchao" and "fp8 tensorwise by torchao: 8 dense layers" in swap.line()
    assert set(dict(model.named_modules())) == modules and list(model.state_dict()) == keys  # no child added
    assert all(p is params[name] for name, p in model.named_parameters())
    layer = model.blocks[0].mlp.fc1
    assert type(layer.torchao_layer).__module__.startswith("torchao.float8.")  # torchao's own layer
    assert isinstance(layer.torchao_layer, nn.Linear) and layer.torchao_layer.config == (
        torchao.float8.Float8LinearConfig.from_recipe_name("tensorwise"))
    assert layer.torchao_layer.weight is layer.weight  # no copy: the plain layer's parameter dictionary
    layer.weight = nn.Parameter(torch.zeros_like(layer.weight))  # replaced on the stand-in: torchao computes with it
    x = torch.randn(3, 32, requires_grad=True)
    assert torch.equal(layer(x), layer.bias.expand(3, -1))

    fast.install_fp8(model, "rowwise")  # vitlab's own again: torchao's layers are dropped
    assert all(m.torchao_layer is None and m.fp8_backend == "vitlab" for m in model.modules()
               if isinstance(m, Float8Linear))
    fast.install_fp8(model, "rowwise", backend="torchao")
    fast.uninstall_fp8(model)
    assert not any(hasattr(m, "torchao_layer") or isinstance(m, Float8Linear) for m in model.modules())
    with pytest.raises(ValueError, match="backend='te': expected one of vitlab, torchao"):
        fast.install_fp8(model, "tensorwise", backend="te")

    from vitlab.extras import MissingPackage

    for name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as on a machine without it
    with pytest.raises(MissingPackage, match=r'needs torchao, which is not installed: pip install -e "\.\[fp8\]"'):
        fast.install_fp8(model, "tensorwise", backend="torchao")
    assert not any(isinstance(m, Float8Linear) for m in model.modules())  # refused before the model is touched


@pytest.mark.slow  # compiles
@pytest.mark.parametrize("backend", ["vitlab", "torchao"])
def test_a_vit_with_either_backends_fp8_layers_compiles_to_one_graph(backend):
    """torch.compile traces the whole training forward and backward, the fp8 layers' casts and
    products included, without a graph break (``fullgraph``); the compiled loss and gradients
    are the eager ones (aot_eager: the traced graph run op by op; CPU inductor has no fp8
    code generation, a GPU's Triton has)."""
    if backend == "torchao":
        pytest.importorskip("torchao.float8")
    model = model_of(tiny()).train()
    fast.install_fp8(model, "tensorwise", backend=backend)
    images = torch.randn(4, 3, 16, 16)

    def loss_and_grad(forward):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16):
            loss = forward(images).float().square().mean()
        loss.backward()
        return loss.detach(), model.blocks[1].mlp.fc2.weight.grad

    compiled = loss_and_grad(torch.compile(model, backend="aot_eager", fullgraph=True))
    eager = loss_and_grad(model)
    for got, want in zip(compiled, eager):
        assert relative_error(got, want) < 1e-6  # the same operators in the same dtypes


@pytest.mark.slow  # compiles
@pytest.mark.parametrize("scaling", SCALINGS)
def test_under_torch_compile_autocast_still_holds_after_an_fp8_layer(scaling):
    """Dynamo traces the layer's backward while it traces the forward; an autocast context in
    that backward once left the trace believing autocast off after the layer, so that the next
    fp8 layer of a compiled model returned fp32 where it returns bf16 (every MLP's GELU then ran
    in fp32).  The operators autocast casts were cast all the same: the same model computed
    other values compiled than eager."""
    first, second = Float8Linear(nn.Linear(K, K), scaling), Float8Linear(nn.Linear(K, N), scaling)

    def step(x):
        return second(x + first(x))

    x = torch.randn(M + 11, K, requires_grad=True)  # 48 rows: the rowwise backward's token count needs no padding
    with torch.autocast("cpu", torch.bfloat16):
        eager, compiled = step(x), torch.compile(step, backend="eager", fullgraph=True)(x)
    assert eager.dtype == compiled.dtype == torch.bfloat16
    assert torch.equal(compiled, eager)


# ----------------------------------------------------------------------------- the swap


def test_only_the_blocks_dense_layers_with_features_in_multiples_of_16_are_swapped():
    model = model_of(tiny(mlp_dim=40, representation_size=32))
    swap = fast.install_fp8(model, "rowwise")
    assert swap.swapped == ("blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.1.attn.qkv", "blocks.1.attn.proj")
    assert [name for name, _ in swap.kept] == ["blocks.0.mlp.fc1", "blocks.0.mlp.fc2", "blocks.1.mlp.fc1",
                                              "blocks.1.mlp.fc2"]
    assert "32 -> 40 features, not multiples of 16" in dict(swap.kept)["blocks.0.mlp.fc1"]
    swapped = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert swapped == set(swap.swapped)
    assert type(model.head) is nn.Linear  # the head, the pre-logits and every layer outside the blocks stay
    assert not any(isinstance(m, Float8Linear) for m in model.pre_logits.modules())
    assert all(m.fp8_scaling == "rowwise" for m in model.modules() if isinstance(m, Float8Linear))
    assert "fp8 rowwise: 4 dense layers" in swap.line() and "blocks.1.mlp.fc2 (40 -> 32 features" in swap.line()


def test_install_then_uninstall_gives_back_the_same_modules_and_parameters():
    model = model_of(tiny())
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        plain_out = model(x)
    calls = []
    model.blocks[0].mlp.fc1.register_forward_hook(lambda *_: calls.append(1))  # hooked before the swap

    swap = fast.install_fp8(model, "tensorwise")
    assert len(swap.swapped) == 8 and not swap.kept
    assert list(model.state_dict()) == keys  # checkpoints hold the plain weights under the plain names
    assert all(p is params[name] for name, p in model.named_parameters())
    assert fast.fp8_scaling(model) == "tensorwise"
    model(x)
    assert calls == [1]  # the hook fires on the layer standing in
    with torch.no_grad():
        assert torch.equal(model(x), plain_out)  # without autograd: the plain product

    again = fast.install_fp8(model, "rowwise")  # installing again changes the scaling of the same layers
    assert again.swapped == swap.swapped and fast.fp8_scaling(model) == "rowwise"
    model.eval()  # a change made while swapped is the plain module's after
    assert fast.uninstall_fp8(model) is model
    assert all(module is modules[name] for name, module in model.named_modules())
    assert set(dict(model.named_modules())) == set(modules)
    assert all(p is params[name] for name, p in model.named_parameters())
    assert not model.blocks[0].attn.qkv.training and not hasattr(model.blocks[0].attn.qkv, "fp8_scaling")
    assert fast.fp8_scaling(model) is None


def test_only_the_layers_asked_for_go_to_fp8_and_the_others_come_back_plain():
    model = model_of(tiny())
    plain = {name: m for name, m in model.named_modules()}
    swap = fast.install_fp8(model, "tensorwise", layers=("mlp.fc2", "mlp.fc1"))
    assert swap.layers == ("mlp.fc1", "mlp.fc2") and not swap.kept
    assert swap.swapped == tuple(f"blocks.{i}.mlp.{fc}" for i in range(len(model.blocks)) for fc in ("fc1", "fc2"))
    assert "dense layers of the encoder blocks (fc1, fc2)" in swap.line()
    assert all(type(b.attn.qkv) is nn.Linear and type(b.mlp.fc1) is Float8Linear for b in model.blocks)
    every = fast.install_fp8(model, "rowwise")  # all four now; the MLP's the same stand-ins
    assert len(every.swapped) == 4 * len(model.blocks) and fast.fp8_scaling(model) == "rowwise"
    attention = fast.install_fp8(model, "rowwise", layers=("attn.qkv",))  # the others given back plain
    assert all(type(b.attn.qkv) is Float8Linear for b in model.blocks) and len(attention.swapped) == len(model.blocks)
    assert all(model.get_submodule(name) is plain[name] for name in plain if not name.endswith("attn.qkv"))
    for bad in ((), ("mlp.fc3",), "fc1"):
        with pytest.raises(ValueError, match=r"layers=.*: expected some of attn.qkv, attn.proj, mlp.fc1, mlp.fc2"):
            fast.install_fp8(model, "tensorwise", layers=bad)
    from vitlab.config import ConfigError
    from vitlab.train.config import RunConfig

    with pytest.raises(ConfigError, match=r"run.fp8_layers=\('mlp',\): expected some of"):
        RunConfig(fp8="tensorwise", fp8_layers=("mlp",))


def test_fp8_goes_under_the_fast_layer_which_leaves_its_blocks_to_the_plain_forward():
    model = model_of(tiny())
    fast.install_fp8(model, "tensorwise")
    fast.optimize(model)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    assert blocks and all(isinstance(b, fast.FastBlock) and not b.fusable() for b in blocks)
    assert type(model.head) is fast.FastLinear  # what fp8 leaves alone, the fast layer takes
    fast.restore(model)
    assert fast.fp8_scaling(model) == "tensorwise"  # each layer undoes its own
    fast.uninstall_fp8(model)
    assert not any(isinstance(m, (Float8Linear, fast.FastLinear, fast.FastBlock)) for m in model.modules())

    fast.optimize(model)
    with pytest.raises(ValueError, match="install fp8 before vitlab.fast.optimize"):
        fast.install_fp8(model, "tensorwise")
    with pytest.raises(ValueError, match="scaling='blockwise': expected one of tensorwise, rowwise"):
        fast.install_fp8(model_of(tiny()), "blockwise")


def test_a_refused_install_leaves_the_model_as_it_was():
    # the refusal met a fast layer after the swapped layers before it had taken the new scaling: block 0's
    # qkv in rowwise, block 1's in tensorwise, fp8_scaling saying rowwise
    model = model_of(tiny())
    fast.install_fp8(model, "tensorwise", layers=("attn.qkv",))
    fast.optimize(model)  # the other dense layers are the fast layer's
    modules = dict(model.named_modules())
    with pytest.raises(ValueError, match="blocks.0.attn.proj is vitlab.fast's"):
        fast.install_fp8(model, "rowwise")
    assert dict(model.named_modules()) == modules
    assert [m.fp8_scaling for m in model.modules() if isinstance(m, Float8Linear)] == ["tensorwise"] * 2
    with pytest.raises(TypeError, match="install_fp8: model='ViT-B/16': expected a torch.nn.Module"):
        fast.install_fp8("ViT-B/16")
    with pytest.raises(TypeError, match="uninstall_fp8: model=None: expected a torch.nn.Module"):
        fast.uninstall_fp8(None)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_a_tiny_vit_trains_with_fp8_matmuls(scaling):
    """A few steps of AdamW under bf16 autocast on one batch: the loss falls, every swapped
    layer gets a finite gradient, and the weights stay plain fp32 parameters."""
    model = model_of(tiny()).train()
    swap = fast.install_fp8(model, scaling)
    torch.manual_seed(1)
    images, labels = torch.randn(16, 3, 16, 16), torch.randint(0, 5, (16,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        with torch.autocast("cpu", torch.bfloat16):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        layers = [model.get_submodule(name) for name in swap.swapped]
        assert all(m.weight.grad is not None and torch.isfinite(m.weight.grad).all() for m in layers)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(p.dtype == torch.float32 for p in model.parameters())
