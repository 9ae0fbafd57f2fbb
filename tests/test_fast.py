"""The plain model is open to hooks, adapters and quantisation; ``vitlab.fast`` is a
reversible layer on top that computes what the plain model computes."""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import io
import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import vitlab
import vitlab.fast as fast
from vitlab.config import ResNetConfig, ViTConfig
from vitlab.fast import kernels as kernels_mod
from vitlab.fast.kernels import KernelChoice
from vitlab.machine import CpuInfo, cpu_class, parse_cpuinfo
from vitlab.models.layers import Block

torch.set_num_threads(2)
ONEDNN = torch.backends.mkldnn.is_available()


def runnable(choice: KernelChoice, **marks):
    """``choice`` as a test parameter that skips, naming the missing feature, where this machine
    cannot run it (``kernels.why_unavailable``: the CPU's features and oneDNN's own report)."""
    reason = kernels_mod.why_unavailable(choice)
    return pytest.param(choice, id=f"{choice.fp32}-{choice.bf16}-{choice.attention}",
                        marks=pytest.mark.skipif(reason is not None, reason=reason or ""))


def needs(choice: KernelChoice):
    """A skip mark for a test that forces ``choice``: it runs wherever the feature exists."""
    reason = kernels_mod.why_unavailable(choice)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


ONEDNN_BF16 = KernelChoice("onednn", "onednn")
# every dense-layer kernel of both precisions, and fp32 blocks that attend explicitly
CHOICES = [runnable(KernelChoice(fp32, bf16)) for fp32 in ("aten", "onednn") for bf16 in ("onednn", "widened")] + [
    runnable(KernelChoice("aten", "aten", "explicit"))]
# the choices whose bf16 inference casts weights itself (with "aten" autocast casts them)
CASTING = [c for c in CHOICES if c.values[0].bf16 != "aten"]


def tiny(**fields) -> ViTConfig:
    base = dict(img_size=16, patch_size=4, width=32, depth=2, mlp_dim=64, num_heads=4, num_classes=5)
    base.update(fields)
    return ViTConfig(**base)


def with_random_head(cfg) -> nn.Module:
    torch.manual_seed(0)
    model = vitlab.create_model(cfg)
    with torch.no_grad():  # the zero-initialised head would hide everything behind it
        model.head.weight.normal_(std=0.5)
    return model


DENSE_AND_NORM = (nn.Linear, nn.LayerNorm)


def count_hook_calls(model: nn.Module, run) -> tuple[dict[str, int], list[str]]:
    calls: dict[str, int] = {}
    names = []
    for name, module in model.named_modules():
        if isinstance(module, DENSE_AND_NORM):
            names.append(name)
            module.register_forward_hook(lambda m, i, o, n=name: calls.__setitem__(n, calls.get(n, 0) + 1))
    run()
    return calls, names


@pytest.mark.parametrize("optimized", [False, True], ids=["plain", "fast"])
@pytest.mark.parametrize("mode", ["train", "eval", "inference"])
def test_hooks_fire_on_every_layer_norm_and_dense_layer(mode, optimized):
    model = with_random_head(tiny())
    if optimized:
        fast.optimize(model)
    x = torch.randn(2, 3, 16, 16)

    def run():
        if mode == "train":
            model.train()
            model(x).sum().backward()
        elif mode == "eval":
            model.eval()
            model(x)
        else:
            model.eval()
            with torch.inference_mode():
                model(x)

    calls, names = count_hook_calls(model, run)
    assert len(names) == 2 * 2 + 4 * 2 + 2  # per block 2 norms, 4 dense; final norm and head
    assert calls == {name: 1 for name in names}


class Halve(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5


@pytest.mark.parametrize("mode", ["train", "inference"])
def test_a_hooked_or_replaced_mlp_dropout_sees_both_its_calls_and_computes_as_the_plain_model(mode):
    """Hooking ``mlp.drop`` is how one reads the MLP's GELU output: a fused training step applied its
    first call inside gelu_dense, so the hook saw the block's output alone, and a module in its place
    ended in an AttributeError on its missing rate ``p``."""
    x = torch.randn(2, 3, 16, 16)

    def run(optimized: bool):
        model = with_random_head(tiny(dropout=0.0))
        if optimized:
            fast.optimize(model)
        shapes = []
        model.blocks[0].mlp.drop.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape)))
        model.blocks[1].mlp.drop = Halve()
        with torch.set_grad_enabled(mode == "train"):
            return model.train(mode == "train")(x), shapes

    expected, expected_shapes = run(False)
    assert expected_shapes == [(2, 17, 64), (2, 17, 32)]
    logits, shapes = run(True)
    assert shapes == expected_shapes
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("where", ["attn.proj_drop", "drop_path", "attn.rel_pos", "attn.distance_bias"])
def test_a_hook_inside_a_block_sees_the_whole_batch_as_the_plain_model_passes_it(where, monkeypatch):
    """The modules a fused block calls as modules (the attention's output dropout, drop-path, a
    relative position bias or distance penalty) were called once per chunk of images in inference:
    a hook that kept their output (features[name] = output) kept the last chunk's images alone."""
    from vitlab.fast import modules

    monkeypatch.setattr(modules, "CHUNK_ROWS", 40)  # a few images of 17 tokens per chunk
    cfg = tiny(posemb="relative") if where == "attn.rel_pos" else tiny(attn_bias="distance")
    x = torch.randn(7, 3, 16, 16)

    def run(optimized: bool):
        model = with_random_head(cfg).eval()
        if optimized:
            fast.optimize(model)
        seen = []
        model.blocks[1].get_submodule(where).register_forward_hook(lambda m, i, o: seen.append(o))
        with torch.no_grad():
            return model(x), seen

    (expected, expected_seen), (logits, seen) = run(False), run(True)
    assert [o.shape for o in seen] == [o.shape for o in expected_seen]
    for o, e in zip(seen, expected_seen):
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("family", ["token", "axial"])
def test_captured_attention_is_one_map_per_layer_for_the_whole_batch_as_the_plain_model_records_it(family, bf16,
                                                                                                    monkeypatch):
    """An optimised block ran its inference in chunks of images and recorded one map per chunk: 6 maps of
    3, 3 and 1 images for 2 layers of 7 images, which analysis.collect_attention stacked as 6 layers where
    the chunks were of one size (and failed where not): the attention distance and rollout of chunks taken
    for layers."""
    from vitlab.fast import modules

    monkeypatch.setattr(modules, "CHUNK_ROWS", 40)  # a few images of 17 tokens per chunk
    cfg = FAMILIES[family]
    x = torch.randn(7, 3, *cfg.img_size)

    def maps(optimized: bool) -> list[torch.Tensor]:
        model = with_random_head(cfg).eval()
        if optimized:
            fast.optimize(model)
        with vitlab.capture_attention(model) as recorded, torch.no_grad(), \
                torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            model(x)
        return recorded

    expected, got = maps(False), maps(True)
    assert [m.shape for m in got] == [m.shape for m in expected]
    for m, e in zip(got, expected):
        torch.testing.assert_close(m.float(), e.float(), rtol=2e-2 if bf16 else 1e-5, atol=1e-2 if bf16 else 1e-6)


@pytest.mark.parametrize("mode", ["train", "inference"])
@pytest.mark.parametrize("where", ["norm1", "attn", "attn.qkv", "mlp"])
def test_a_forward_set_on_a_blocks_part_itself_is_called_as_the_plain_model_calls_it(where, mode):
    """``module.forward = ...`` on an instance (an ablation, a patched attention): the fused block
    computed its parts as functions and never called it, giving the unpatched model's logits."""
    x = torch.randn(2, 3, 16, 16)

    def run(optimized: bool):
        model = with_random_head(tiny())
        if optimized:
            fast.optimize(model)
        part = model.blocks[0].get_submodule(where)
        part.forward = lambda h, *args: 0.5 * type(part).forward(part, h, *args)
        with torch.set_grad_enabled(mode == "train"):
            return model.train(mode == "train")(x)

    torch.testing.assert_close(run(True), run(False), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["train", "inference"])
@pytest.mark.parametrize("where", ["Block.forward", "Attention.forward", "Attention.attend", "Mlp.forward"])
def test_a_method_patched_on_a_blocks_class_is_called_as_the_plain_model_calls_it(where, mode, bf16, monkeypatch):
    """``Attention.forward = ...`` on the class (as scripts that read attention maps patch timm's):
    the fused block computed its parts as functions and never called it (``Attention.attend`` in
    CPU bf16 inference), giving the unpatched model's logits, a third off the patched ones."""
    from vitlab.models import layers

    cls, name = where.split(".")
    cls = getattr(layers, cls)
    defined = getattr(cls, name)
    monkeypatch.setattr(cls, name, lambda self, *args, **kwargs: 0.5 * defined(self, *args, **kwargs))
    x = torch.randn(2, 3, 16, 16)

    def run(optimized: bool):
        model = with_random_head(tiny())
        if optimized:
            fast.optimize(model)
        with torch.set_grad_enabled(mode == "train"), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            return model.train(mode == "train")(x).float()

    expected, logits = run(False), run(True)
    assert (logits - expected).norm() < (3e-2 if bf16 else 1e-5) * expected.norm()


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # torch's, for the plain model's attention too
def test_torch_func_transforms_run_the_plain_forward_of_a_fast_model():
    """vmap and grad of a fast model (per-example gradients) ended in torch's 'In order to use an
    autograd.Function with functorch transforms ... it must override the setup_context'."""
    plain = with_random_head(tiny())
    model = fast.optimize(copy.deepcopy(plain))
    x = torch.randn(3, 3, 16, 16)

    def per_example_grads(m):
        params = {name: p.detach() for name, p in m.named_parameters()}
        loss = lambda p, xi: torch.func.functional_call(m, p, (xi[None],)).square().mean()  # noqa: E731
        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)

    expected, got = per_example_grads(plain), per_example_grads(model)
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(torch.func.vmap(lambda xi: model.eval()(xi[None]))(x), plain.eval()(x)[:, None],
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernels", CHOICES)
def test_flops_counted_on_a_fast_model_are_the_plain_models(kernels):
    """FlopCounterMode has no count for oneDNN's matmul: count_flops gave a fast model with oneDNN's
    fp32 kernel (the rule's on AMD Zen 4 and 5) about a fifth of its FLOPs."""
    from vitlab.analysis.cost import count_flops

    plain = with_random_head(tiny())
    model = fast.optimize(copy.deepcopy(plain), kernels)
    x = torch.randn(2, 3, 16, 16)
    for backward in (False, True):
        assert count_flops(model.train(), x, backward=backward) == count_flops(plain.train(), x, backward=backward)
    with torch.no_grad():
        assert count_flops(model.eval(), x) == count_flops(plain.eval(), x)


@pytest.mark.parametrize("kernels", CHOICES)
def test_torch_jit_trace_of_a_fast_model_records_the_plain_models_operators(kernels):
    """torch.jit.trace of a fast model with oneDNN's fp32 kernel (the rule's on AMD Zen 4 and 5)
    ended in torch's 'unsupported input list type: Scalar?': it cannot record oneDNN's matmul."""
    plain = with_random_head(tiny()).eval()
    model = fast.optimize(copy.deepcopy(plain), kernels)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        traced = torch.jit.trace(model, x)
        y = torch.randn(3, 3, 16, 16)  # another batch: the trace holds operators, not this input's values
        torch.testing.assert_close(traced(y), plain(y), rtol=1e-5, atol=1e-6)


def calls_seen_by_a_global_hook(run) -> collections.Counter:
    seen = collections.Counter()
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.update([type(m).__name__]))
    try:
        run()
    finally:
        handle.remove()
    return seen


@pytest.mark.parametrize("mode", ["train", "inference"])
def test_a_global_module_hook_sees_a_fused_block_as_one_call(mode):
    # torch has no public way to see a hook registered for every module, so the fast path
    # cannot step aside for one: a fused block computes its LayerNorm and dense layers,
    # Attention and Mlp as functions; restore() gives such a hook every layer again
    model = fast.optimize(with_random_head(tiny(depth=2)), KernelChoice())
    x = torch.randn(2, 3, 16, 16)

    def run():
        if mode == "train":
            model.train()(x).sum().backward()
        else:
            with torch.inference_mode():
                model.eval()(x)

    fused = calls_seen_by_a_global_hook(run)
    assert fused["FastBlock"] == 2 and fused["LayerNorm"] == 1 and fused["FastLinear"] == 1  # final norm, head
    assert fused["Dropout"] >= 2 and not {"Attention", "Mlp", "Linear", "Block"} & set(fused)
    model = fast.restore(model)
    plain = calls_seen_by_a_global_hook(run)
    assert (plain["Block"], plain["Attention"], plain["Mlp"], plain["LayerNorm"], plain["Linear"]) == (2, 2, 2, 5, 9)


class LoRA(nn.Module):
    """A low-rank adapter as PEFT writes one: the frozen layer plus a trainable B @ A."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.up.weight, std=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


@pytest.mark.parametrize("optimized", [False, True], ids=["plain", "fast"])
@pytest.mark.parametrize("where", ["attn.qkv", "mlp.fc1"])
def test_a_lora_wrapper_changes_the_output_in_train_and_eval(where, optimized):
    model = with_random_head(tiny(dropout=0.0))
    x = torch.randn(2, 3, 16, 16)
    before = {m: model.train(m == "train")(x).detach() for m in ("train", "eval")}
    block = model.blocks[0]
    parent, attr = (block.attn, "qkv") if where == "attn.qkv" else (block.mlp, "fc1")
    setattr(parent, attr, LoRA(getattr(parent, attr)))
    if optimized:
        fast.optimize(model)
    for mode in ("train", "eval"):
        model.train(mode == "train")
        out = model(x)
        assert not torch.allclose(out, before[mode], atol=1e-4), mode
        out.sum().backward()
        assert getattr(parent, attr).up.weight.grad.abs().sum() > 0
        # the delta alone explains the change: zero it and the model is the old one
        with torch.no_grad():
            saved = getattr(parent, attr).up.weight.clone()
            getattr(parent, attr).up.weight.zero_()
            torch.testing.assert_close(model(x), before[mode], rtol=1e-5, atol=1e-5)
            getattr(parent, attr).up.weight.copy_(saved)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_dynamic_int8_quantisation_stays_close_to_fp32():
    model = with_random_head(tiny(depth=2, width=64, mlp_dim=128)).eval()
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        expected = model(x)
    quantized = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)
    assert not any(type(m) is nn.Linear for m in quantized.modules())  # every dense layer swapped
    with torch.no_grad():
        got = quantized(x)
        assert (got - expected).norm() < 0.1 * expected.norm()
        # the fast path leaves quantised layers to themselves and gives the same logits
        torch.testing.assert_close(fast.optimize(quantized)(x), got, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torchs_eager_quantisation_of_an_optimized_model_says_it_leaves_the_dense_layers_as_they_are():
    """quantize_dynamic(model, {nn.Linear}) swaps modules by their exact class: on an optimized model
    it found no nn.Linear and gave back the fp32 model, its logits unchanged, without a word."""
    model = fast.optimize(with_random_head(tiny()).eval())
    with pytest.warns(UserWarning, match=r"takes a FastLinear.*leaves it unquantised.*"
                                         r"vitlab\.fast\.restore\(model\) before quantising"):
        quantized = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    assert type(quantized.blocks[0].attn.qkv) is fast.FastLinear  # torch's doing: the warning's reason
    assert not any(hasattr(m, "qconfig") for m in quantized.modules())  # torch's own attribute, set and removed
    # the way out the warning names: the plain model quantised, then optimized, without a warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = fast.restore(model)
        quantized = fast.optimize(torch.ao.quantization.quantize_dynamic(plain, {nn.Linear}, dtype=torch.qint8))
    assert not [w for w in caught if "vitlab" in str(w.message)]
    assert not any(isinstance(m, nn.Linear) for m in quantized.modules())


class Int8Weight(torch.Tensor):
    """A dense weight of its own tensor class, as torchao's ``quantize_`` leaves one in an
    ``nn.Linear``: ``F.linear`` multiplies by its values rounded to 255 levels."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            x, weight, *rest = args
            weight = weight.as_subclass(torch.Tensor)
            scale = weight.detach().abs().amax() / 127
            return func(x, (weight / scale).round() * scale, *rest, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)


def quantize_weights(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.weight = nn.Parameter(module.weight.detach().as_subclass(Int8Weight), requires_grad=False)
    return model


@pytest.mark.parametrize("kernels", CHOICES)
@pytest.mark.parametrize("order", ["quantized-then-optimized", "optimized-then-quantized"])
def test_a_dense_layer_whose_weight_is_a_tensor_subclass_computes_by_its_rules(order, kernels):
    """torchao's quantize_ keeps each nn.Linear and gives it a weight of a tensor class whose own
    F.linear computes the product: the fast kernels multiplied its raw values (oneDNN's matmul,
    the bf16 casts), skipping its arithmetic, or failed in torchao's NotImplementedError."""
    plain = quantize_weights(with_random_head(tiny()))
    model = with_random_head(tiny())
    model = (fast.optimize(quantize_weights(model), kernels) if order == "quantized-then-optimized"
             else quantize_weights(fast.optimize(model, kernels)))
    assert type(model.blocks[0].attn.qkv) is fast.FastLinear and type(model.head.weight) is Int8Weight
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        assert not torch.allclose(plain(x), with_random_head(tiny())(x), atol=1e-4)  # the rounding counts
    for mode, grad, bf16 in [("train", True, False), ("eval", False, False), ("eval", False, True),
                             ("train", True, True)]:
        with torch.set_grad_enabled(grad), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            expected = plain.train(mode == "train")(x).float()
            got = model.train(mode == "train")(x).float()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=f"{mode}, grad {grad}, bf16 {bf16}")
    with torch.inference_mode():
        torch.testing.assert_close(model.eval()(x), plain.eval()(x), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- equality

FAMILIES = {
    "token": tiny(),
    "gap": tiny(classifier="gap"),
    "pre-logits": tiny(representation_size=24),
    "posemb-2d-every-layer": tiny(posemb="learned_2d", posemb_place="every_layer"),
    "relative": tiny(posemb="relative", qkv_bias=False),
    "distance": tiny(attn_bias="distance"),
    "distance_no_self": tiny(attn_bias="distance_no_self"),
    "tanh-gelu": tiny(gelu="tanh", ln_eps=1e-6),
    "axial": tiny(axial=True, classifier="gap", posemb="learned_2d"),
    "hybrid": tiny(img_size=32, patch_size=1, resnet=ResNetConfig(layers=(1,), img_size=32, root_kernel=3,
                                                                     root_stride=1, root_pool=False), depth=1),
}


def loss_and_grads(model: nn.Module, x: torch.Tensor, bf16: bool):
    model.zero_grad()
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        loss = model(x).float().square().mean()
    loss.backward()
    return loss.detach(), [x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("kernels", CHOICES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fast_logits_and_gradients_equal_the_plain_models(family, kernels):
    cfg = FAMILIES[family]
    model = with_random_head(cfg).train()
    x = torch.randn(3, 3, *cfg.img_size)
    loss, grads = loss_and_grads(model, x, bf16=False)
    with torch.no_grad():
        logits = model.eval()(x)
    fast.optimize(model.train(), kernels)
    fast_loss, fast_grads = loss_and_grads(model, x, bf16=False)
    torch.testing.assert_close(fast_loss, loss, rtol=1e-5, atol=1e-7)
    for g, h in zip(grads, fast_grads):  # another GEMM sums in another order: tolerance on each tensor's scale
        torch.testing.assert_close(h, g, rtol=1e-4, atol=1e-5 * float(g.abs().max()) + 1e-7)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernels", CHOICES)
def test_fast_training_with_patch_dropout_and_the_distance_penalty_equals_the_plain_models(kernels):
    """The fused block takes the kept patches' places to the distance penalty as the plain one does."""
    cfg = tiny(img_size=(16, 20), attn_bias="distance_no_self", attn_offsets=True, patch_dropout=0.25)
    model = with_random_head(cfg).train()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.distance_bias.offset_bias.normal_()
    x = torch.randn(3, 3, *cfg.img_size)
    torch.manual_seed(1)  # the same patches dropped in both runs
    loss, grads = loss_and_grads(model, x, bf16=False)
    fast.optimize(model, kernels)
    torch.manual_seed(1)
    fast_loss, fast_grads = loss_and_grads(model, x, bf16=False)
    torch.testing.assert_close(fast_loss, loss, rtol=1e-5, atol=1e-7)
    for g, h in zip(grads, fast_grads):
        torch.testing.assert_close(h, g, rtol=1e-4, atol=1e-5 * float(g.abs().max()) + 1e-7)
    offsets = model.blocks[0].attn.distance_bias.offset_bias.grad
    assert offsets.abs().sum() > 0


@pytest.mark.parametrize("kernels", CHOICES)
@pytest.mark.parametrize("family", ["token", "relative", "distance", "distance_no_self", "axial"])
def test_fast_bf16_training_agrees_with_plain_autocast(family, kernels):
    cfg = FAMILIES[family]
    model = with_random_head(cfg).train()
    x = torch.randn(3, 3, *cfg.img_size)
    loss, grads = loss_and_grads(model, x, bf16=True)
    fast.optimize(model, kernels)
    fast_loss, fast_grads = loss_and_grads(model, x, bf16=True)
    torch.testing.assert_close(fast_loss, loss, rtol=2e-2, atol=0.0)
    # bf16 keeps about 3 significant digits; the order of additions differs between kernels
    flat = lambda gs: torch.cat([g.float().flatten() for g in gs])  # noqa: E731
    assert (flat(fast_grads) - flat(grads)).norm() < 3e-2 * flat(grads).norm()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("kernels", CHOICES)
@pytest.mark.parametrize("family", ["token", "relative", "tanh-gelu", "axial"])
def test_inference_in_chunks_of_images_equals_the_plain_forward(family, kernels, monkeypatch):
    from vitlab.fast import modules

    monkeypatch.setattr(modules, "CHUNK_ROWS", 40)  # a few images of 17 tokens per chunk
    chunk_sizes = []
    real_fused = modules.FastBlock.fused
    monkeypatch.setattr(modules.FastBlock, "fused",
                        lambda self, x, out=None: chunk_sizes.append(x.shape[0]) or real_fused(self, x, out))
    cfg = FAMILIES[family]
    model = with_random_head(cfg).eval()
    x = torch.randn(7, 3, *cfg.img_size)
    with torch.no_grad():
        logits = model(x)
        with torch.autocast("cpu", torch.bfloat16):
            bf16_logits = model(x).float()
        fast.optimize(model, kernels)
        torch.testing.assert_close(model(x), logits, rtol=1e-5, atol=1e-6)
        assert len(chunk_sizes) > cfg.depth and max(chunk_sizes) < x.shape[0] * (4 if family == "axial" else 1)
        with torch.autocast("cpu", torch.bfloat16):  # fused GELU, explicit attention, the choice's bf16 kernel
            fast_bf16 = model(x).float()
    assert (fast_bf16 - bf16_logits).norm() < 3e-2 * bf16_logits.norm()


@pytest.mark.parametrize("kernels", CASTING)
def test_a_block_run_in_chunks_casts_each_weight_once_for_all_its_chunks(kernels, monkeypatch):
    from vitlab.fast import modules

    monkeypatch.setattr(modules, "CHUNK_ROWS", 40)  # 7 images of 17 tokens: chunks of 2 images in bf16
    cfg = FAMILIES["token"]
    model = with_random_head(cfg).eval()
    x = torch.randn(7, 3, *cfg.img_size)
    before = {name: fp32_bits(p) for name, p in model.named_parameters()}
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        plain = model(x).float()
    fast.optimize(model, kernels)
    casts, reused = [], []
    real_cast = modules.Workspace.cast

    def cast(self, weight, dtype):
        shared = getattr(self._local, "shared", None)
        (reused if shared is not None and id(weight) in shared else casts).append(weight)
        return real_cast(self, weight, dtype)

    monkeypatch.setattr(modules.Workspace, "cast", cast)
    chunks = []
    real_fused = modules.FastBlock.fused
    monkeypatch.setattr(modules.FastBlock, "fused", lambda self, x, out=None: chunks.append(x.shape[0])
                        or real_fused(self, x, out))
    shared = bf16_infer(model, x)
    assert chunks == [2, 2, 2, 1] * cfg.depth
    blocks_dense = 4 * cfg.depth
    assert len(casts) == blocks_dense + 1  # every dense layer of the blocks once, then the head
    assert len(reused) == 3 * blocks_dense and all(any(w is c for c in casts) for w in reused)
    monkeypatch.setattr(modules.Workspace, "casts_shared_by_chunks", lambda self: contextlib.nullcontext())
    assert torch.equal(bf16_infer(model, x), shared)  # the same as casting again for every chunk
    assert (shared.float() - plain).norm() < 3e-2 * plain.norm()
    assert all(torch.equal(fp32_bits(p), before[name]) for name, p in fast.restore(model).named_parameters())


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("kernels", CHOICES)
def test_a_float64_model_under_bf16_autocast_computes_in_float64_as_the_plain_one(kernels, grad):
    """Autocast leaves float64 alone: the fast path's bf16 kernels gave bf16 logits ~1% away."""
    plain = with_random_head(tiny()).double()
    model = fast.optimize(copy.deepcopy(plain), kernels)
    x = torch.randn(3, 3, 16, 16, dtype=torch.float64)
    with torch.set_grad_enabled(grad), torch.autocast("cpu", torch.bfloat16):
        expected, got = plain(x), model(x)
    assert got.dtype == expected.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kernels", CHOICES)
def test_bf16_inference_equals_autocasts_rounding(kernels):
    torch.manual_seed(0)
    dense = nn.Linear(64, 48)
    x = torch.randn(2, 5, 64)
    exact = (x.bfloat16().double() @ dense.weight.bfloat16().double().t()
             + dense.bias.bfloat16().double())
    dense = fast.optimize(dense, kernels)  # a dense layer itself: the one standing in for it
    assert type(dense) is fast.FastLinear
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        out = dense(x)
    assert out.dtype == torch.bfloat16
    # one bf16 rounding of a sum computed in fp32 (the order of additions may differ)
    torch.testing.assert_close(out.double(), exact, rtol=8e-3, atol=1e-3)


def bf16_autocast_linear(x, dense):
    """What bf16 autocast's ``F.linear`` computes, in double: products of bf16-rounded operands."""
    return x.bfloat16().double() @ dense.weight.bfloat16().double().t() + dense.bias.bfloat16().double()


@pytest.mark.parametrize("kernels", CASTING)
def test_autocast_inference_casts_weights_into_one_shared_buffer_by_default(kernels):
    torch.manual_seed(0)
    model = fast.optimize(nn.Sequential(nn.Linear(6, 40), nn.Linear(40, 4)), kernels)
    x = torch.randn(3, 6)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        out = model(x)
    torch.testing.assert_close(out.double(), bf16_autocast_linear(bf16_autocast_linear(x, model[0]).bfloat16(),
                                                                  model[1]), rtol=8e-3, atol=1e-3)
    options = fast.installed_options(model)
    assert all(layer.held_casts.weight is None for layer in model)  # no weight kept beside the parameter
    buffer = options.workspace._local.buffer  # one buffer, the size of the largest weight, for every layer
    assert buffer.numel() == 240 and buffer.dtype == (torch.bfloat16 if kernels.bf16 == "onednn" else torch.float32)
    torch.testing.assert_close(buffer[:160].view(4, 40).float(), model[1].weight.bfloat16().float(), rtol=0, atol=0)


@needs(KernelChoice(bf16="onednn"))
def test_held_casts_are_kept_between_inference_calls_until_the_weights_change():
    torch.manual_seed(0)
    dense = fast.optimize(nn.Linear(6, 4), KernelChoice("aten", "onednn"), inference_weights="hold")
    x = torch.randn(3, 6)

    def infer():
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            return dense(x)

    torch.testing.assert_close(infer().double(), bf16_autocast_linear(x, dense), rtol=8e-3, atol=1e-3)
    held = dense.held_casts.weight
    assert held.dtype == torch.bfloat16 and torch.equal(held, dense.weight.bfloat16())
    infer()
    assert dense.held_casts.weight is held  # cast once, not per call
    with torch.no_grad():
        dense.weight.add_(1.0)  # an optimiser step changes the weights in place
    out = infer()
    assert dense.held_casts.weight is not held
    torch.testing.assert_close(out.double(), bf16_autocast_linear(x, dense), rtol=8e-3, atol=1e-3)
    dense(x).sum().backward()  # a training forward drops the copy
    assert dense.held_casts.weight is None and dense.held_casts.key is None


@pytest.mark.parametrize("kernels", CASTING)
def test_cast_inference_sees_an_edit_through_data_that_torch_does_not_count_as_a_change(kernels):
    """An edit through ``.data`` leaves the parameter's version as it was: the default "cast" keeps
    nothing, so it computes with the edited bias (its kept bias copy went stale); "hold" keeps its
    copies until optimised again, as documented."""
    model = fast.optimize(with_random_head(tiny()), kernels).eval()
    x = torch.randn(2, 3, 16, 16)
    bf16_infer(model, x)
    model.head.bias.data.add_(3.0)  # torch counts no change: the parameter's _version stays
    model.head.weight.data.mul_(2.0)
    close = lambda got, plain: (got - plain).float().norm() < 3e-2 * plain.float().norm()  # noqa: E731
    assert close(bf16_infer(model, x), bf16_infer(fast.restore(copy.deepcopy(model)), x))
    fast.optimize(model, kernels, inference_weights="hold")
    bf16_infer(model, x)
    model.head.bias.data.sub_(3.0)
    fast.optimize(model, kernels, inference_weights="hold")  # what an edit through .data calls for
    assert close(bf16_infer(model, x), bf16_infer(fast.restore(copy.deepcopy(model)), x))


def fp32_bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().view(torch.int32)


def bf16_infer(model, x):
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        return model(x)


@pytest.mark.parametrize("inference_weights", ["cast", "hold"])
@pytest.mark.parametrize("kernels", CASTING)
@pytest.mark.parametrize("family", ["token", "hybrid"])
def test_bf16_inference_reads_the_parameters_and_never_writes_them(family, kernels, inference_weights):
    cfg = FAMILIES[family]
    model = with_random_head(cfg).eval()
    x = torch.randn(3, 3, *cfg.img_size)
    before = {name: (p, p._version, fp32_bits(p)) for name, p in model.named_parameters()}
    cast = bf16_infer(fast.optimize(copy.deepcopy(model), kernels), x)
    fast.optimize(model, kernels, inference_weights=inference_weights)
    assert torch.equal(bf16_infer(model, x), cast)
    assert torch.equal(bf16_infer(model, x), cast)  # again: from the held casts with "hold"
    layers = [m for m in model.modules() if isinstance(m, fast.FastLinear)]
    held = [layer.held_casts.weight for layer in layers]
    if inference_weights == "hold":  # each layer holds its own rounded copy, as its attribute
        assert all(torch.equal(h.bfloat16(), layer.weight.bfloat16()) for h, layer in zip(held, layers))
    else:
        assert held == [None] * len(layers)
    assert list(model.state_dict()) == list(before)  # the held copies are no state
    with torch.no_grad():
        torch.testing.assert_close(model(x), fast.restore(copy.deepcopy(model))(x), rtol=1e-5, atol=1e-6)
    for name, p in fast.restore(model).named_parameters():
        param, version, bits = before[name]
        assert p is param and p._version == version and torch.equal(fp32_bits(p), bits)


def test_the_inference_commands_fast_model_never_writes_its_parameters_nor_keeps_a_copy(tmp_path):
    cfg = tiny()
    vitlab.save_model(with_random_head(cfg), tmp_path / "run")
    saved = vitlab.load_model(tmp_path / "run").state_dict()
    model = vitlab.load_model(tmp_path / "run").eval()
    fast.optimize(model)  # as vitlab eval and predict run it
    assert fast.is_optimized(model)
    versions = {name: p._version for name, p in model.named_parameters()}
    x = torch.randn(3, 3, *cfg.img_size)
    first = bf16_infer(model, x)
    assert {name: p._version for name, p in model.named_parameters()} == versions
    assert all(torch.equal(fp32_bits(p), fp32_bits(saved[name])) for name, p in model.named_parameters())
    assert torch.equal(bf16_infer(model, x), first)
    # no bf16 copy of the weights kept beside the model: the command's memory is the model's
    assert fast.installed_options(model).inference_weights == "cast"
    assert all(m.held_casts.weight is None for m in model.modules() if isinstance(m, fast.FastLinear))


def test_a_bad_inference_weights_option_is_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match="inference_weights='pack': expected one of cast, hold"):
        fast.optimize(nn.Linear(2, 2), inference_weights="pack")


def test_what_is_not_a_model_or_a_flag_is_refused_by_name_before_anything_is_installed():
    model = with_random_head(tiny())
    with pytest.raises(TypeError, match=r"^FastOptions.recompute='no': expected True or False"):
        fast.optimize(model, recompute="no")  # was taken as true
    assert not fast.is_optimized(model)
    for call in (fast.optimize, fast.restore):
        with pytest.raises(TypeError, match=rf"^{call.__name__}: model='ViT-B/16': expected a torch.nn.Module"):
            call("ViT-B/16")
    # the others of the layer's public calls too (each failed on the string's missing modules() or parameters())
    for call in (fast.is_optimized, fast.installed_options, fast.compile_for_inference,
                 lambda model: fast.optimized(model).__enter__()):
        with pytest.raises(TypeError, match=r": model='ViT-B/16': expected a torch.nn.Module"):
            call("ViT-B/16")


@pytest.mark.parametrize("kernels", CHOICES)
@pytest.mark.parametrize("family", ["token", "relative", "distance", "distance_no_self", "axial"])
def test_contiguous_attention_equals_the_plain_bf16_inference(family, kernels, monkeypatch):
    from vitlab.fast import modules

    calls = []
    real = modules.contiguous_attention
    monkeypatch.setattr(modules, "contiguous_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = FAMILIES[family]
    model = with_random_head(cfg).eval()
    x = torch.randn(5, 3, *cfg.img_size)
    plain = bf16_infer(model, x).float()
    fast.optimize(model, kernels)
    torch.testing.assert_close(bf16_infer(model, x).float(), plain, rtol=3e-2, atol=3e-2 * plain.abs().max().item())
    # an attention bias needs Attention.attend; the other families attend over contiguous heads
    assert (len(calls) > 0) == (family not in ("relative", "distance", "distance_no_self"))


@pytest.mark.parametrize("images", [1, 3])  # one image: the head reshape is a view, copied after
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_contiguous_attention_is_softmax_attention_with_or_without_autograd(dtype, images):
    from vitlab.fast.modules import contiguous_attention

    B, L, H, D = images, 17, 4, 8
    qkv = torch.randn(B, L, 3 * H * D).to(dtype)
    q, k, v = qkv.float().view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
    reference = (torch.softmax(q @ k.transpose(-1, -2) * D**-0.5, -1) @ v).transpose(1, 2).reshape(B, L, H * D)
    with torch.no_grad():  # the probabilities are written over the scores
        in_place = contiguous_attention(qkv, H, D**-0.5)
    with_autograd = contiguous_attention(qkv.clone().requires_grad_(), H, D**-0.5)
    assert torch.equal(in_place, with_autograd.detach())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(in_place.float(), reference, rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- recompute


def saved_bytes(model, x, bf16):
    from vitlab.analysis.cost import SavedForBackward

    model.zero_grad()
    with SavedForBackward(model) as kept:
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            loss = model(x).float().square().sum()
    loss.backward()
    return kept.bytes, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_recomputing_norms_and_gelu_keeps_less_for_the_same_gradients(bf16):
    model = with_random_head(tiny(gelu="exact", depth=3, width=48, mlp_dim=192, num_heads=3)).train()
    x = torch.randn(4, 3, 16, 16)
    aten = KernelChoice()
    fast.optimize(model, aten, recompute=False)
    stored, stored_grads = saved_bytes(model, x, bf16)
    fast.optimize(model, aten, recompute=True)
    kept, grads = saved_bytes(model, x, bf16)
    if not bf16:  # the same operations on the same values
        assert all(torch.equal(a, b) for a, b in zip(grads, stored_grads))
    # per block: 16 (tokens x width) activations stored, 10 when recomputing (fp32)
    assert kept < (0.72 if not bf16 else 0.8) * stored


def test_storing_instead_of_recomputing_still_attends_explicitly_in_cpu_bf16(monkeypatch):
    from vitlab.models import layers

    fused = []
    real = layers.F.scaled_dot_product_attention
    monkeypatch.setattr(layers.F, "scaled_dot_product_attention", lambda *a, **k: fused.append(1) or real(*a, **k))
    model = with_random_head(tiny(gelu="exact", depth=2, width=48, mlp_dim=192, num_heads=3)).train()
    x = torch.randn(4, 3, 16, 16)
    bf16 = KernelChoice()
    fast.optimize(model, bf16, recompute=True)
    _, recomputed = saved_bytes(model, x, bf16=True)
    fast.optimize(model, bf16, recompute=False)
    _, stored = saved_bytes(model, x, bf16=True)
    assert not fused  # the CPU's fused kernel has the slow bf16 backward
    for a, b in zip(stored, recomputed):  # the same bf16 operations, up to the order of additions
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())
    _, plain = saved_bytes(fast.restore(model), x, bf16=True)
    assert fused  # the plain model does use it
    for a, b in zip(stored, plain):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


def test_recompute_functions_pass_gradcheck():
    from vitlab.fast.recompute import gelu_dense, layer_norm_dense

    torch.manual_seed(0)
    norm = nn.LayerNorm(6, eps=1e-6).double()
    dense, dense2 = nn.Linear(6, 5).double(), nn.Linear(5, 4).double()
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    x = torch.randn(2, 3, 6, dtype=torch.double, requires_grad=True)
    params = (*norm.parameters(), *dense.parameters(), *dense2.parameters())
    aten = KernelChoice()

    def both(x, *_):
        return gelu_dense(layer_norm_dense(x, norm, dense, aten), "tanh", nn.Dropout(0.0), dense2, aten)

    assert torch.autograd.gradcheck(both, (x, *params))


@needs(KernelChoice(fp32="onednn"))
def test_onednn_linear_gradients_equal_autograds():
    from vitlab.fast.linear import linear

    torch.manual_seed(0)
    x = torch.randn(3, 7, 24, requires_grad=True)
    w = torch.randn(16, 24, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    g = torch.randn(3, 7, 16)
    out = linear(x, w, b, KernelChoice(fp32="onednn"))
    grads = torch.autograd.grad(out, (x, w, b), g)
    expected = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, torch.autograd.grad(expected, (x, w, b), g)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("used", [(0, 1, 2), (0, 2), (1,)], ids=["qkv", "q-v", "k"])
def test_split_heads_gradient_equals_autograds_views(used):
    from vitlab.fast.recompute import split_heads
    from vitlab.models.layers import split_heads as views

    torch.manual_seed(0)
    qkv = torch.randn(2, 5, 3 * 12)
    weights = [torch.randn(2, 4, 5, 3) for _ in range(3)]  # (B, H, L, D/H) for 4 heads

    def grad(split) -> torch.Tensor:
        x = qkv.clone().requires_grad_()
        parts = split(x, 4)
        sum((parts[i] * weights[i]).sum() for i in used).backward()
        return x.grad

    assert all(torch.equal(a, b) for a, b in zip(split_heads(qkv, 4), views(qkv, 4)))
    assert torch.equal(grad(split_heads), grad(views))


def test_gelu_dense_drops_out_with_the_mask_it_keeps():
    from vitlab.fast.recompute import gelu_dense

    torch.manual_seed(0)
    dense = nn.Linear(8, 3)
    h = torch.randn(5, 8, requires_grad=True)
    torch.manual_seed(7)
    out = gelu_dense(h, "none", nn.Dropout(0.25).train(), dense, KernelChoice())
    out.square().sum().backward()
    grads = h.grad.clone(), dense.weight.grad.clone()
    torch.manual_seed(7)  # the forward's only random draw is the mask
    keep = torch.empty(5, 8, dtype=torch.bool).bernoulli_(0.75)
    assert 0 < keep.sum() < keep.numel()
    h.grad, dense.weight.grad = None, None
    expected = dense(torch.nn.functional.gelu(h) * keep / 0.75)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grads[0], h.grad)
    torch.testing.assert_close(grads[1], dense.weight.grad)


@pytest.mark.parametrize("family", ["token", "relative"])
def test_fast_bf16_cpu_training_attends_explicitly_and_plain_uses_the_kernel(family, monkeypatch):
    import vitlab.models.layers as layers

    model = with_random_head(FAMILIES[family]).train()
    x = torch.randn(3, 3, 16, 16)
    seen = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(layers.F, "scaled_dot_product_attention",
                        lambda *a, **k: seen.append(a[0].dtype) or real_sdpa(*a, **k))
    loss, grads = loss_and_grads(model, x, bf16=True)
    assert seen and set(seen) == {torch.bfloat16}  # the plain model: the fused kernel
    seen.clear()
    fast.optimize(model, KernelChoice())  # whatever the matmuls, a bf16 training step attends explicitly
    fast_loss, fast_grads = loss_and_grads(model, x, bf16=True)
    assert seen == []  # the flash kernel's bf16 backward is slow on a CPU
    torch.testing.assert_close(fast_loss, loss, rtol=2e-2, atol=0.0)
    flat = lambda gs: torch.cat([g.float().flatten() for g in gs])  # noqa: E731
    assert (flat(fast_grads) - flat(grads)).norm() < 3e-2 * flat(grads).norm()


# ----------------------------------------------------------------------------- reversible, stateful


def test_restore_gives_back_the_plain_modules_with_the_same_parameters_and_hooks():
    model = with_random_head(tiny())
    params = {name: p for name, p in model.named_parameters()}
    calls = []
    model.blocks[0].norm1.register_forward_hook(lambda *a: calls.append(1))
    assert not fast.is_optimized(model)
    assert fast.optimize(model) is model and fast.is_optimized(model)
    assert type(model.blocks[0]).__name__ == "FastBlock" and type(model.head).__name__ == "FastLinear"
    assert isinstance(model.blocks[0], Block) and isinstance(model.head, nn.Linear)
    fast.restore(model)
    assert not fast.is_optimized(model)
    assert type(model.blocks[0]) is Block and type(model.head) is nn.Linear
    assert not any(hasattr(m, "fast_options") for m in model.modules())
    assert {name: p for name, p in model.named_parameters()} == params
    model(torch.randn(1, 3, 16, 16))
    assert calls == [1]
    with fast.optimized(model, KernelChoice()):
        assert fast.is_optimized(model)
    assert not fast.is_optimized(model)


def test_optimized_gives_back_a_partly_optimized_model_as_it_was():
    # it gave every installed module the options of the first and left installed what it had added: the encoder
    # alone optimised came out of the block with its head a FastLinear, and block 0's own kernels were block 1's
    model = with_random_head(tiny())
    model.blocks[0] = fast.optimize(model.blocks[0], KernelChoice(attention="explicit"))
    fast.optimize(model.blocks[1], KernelChoice())
    before = {name: (type(m), getattr(m, "fast_options", None)) for name, m in model.named_modules()}
    with fast.optimized(model, KernelChoice(fp32="onednn")) as optimized:
        assert optimized is model and type(model.head) is fast.FastLinear
        assert {m.fast_options.kernels.fp32 for m in model.modules() if hasattr(m, "fast_options")} == {"onednn"}
    assert {name: (type(m), getattr(m, "fast_options", None)) for name, m in model.named_modules()} == before
    assert model.blocks[0].fast_options.kernels.attention == "explicit"


def test_optimize_puts_modules_in_place_of_the_plain_ones_and_restore_puts_those_back():
    model = with_random_head(tiny(dropout=0.0))
    block, qkv = model.blocks[0], model.blocks[0].attn.qkv
    calls = []
    handle = qkv.register_forward_hook(lambda m, i, o: calls.append(type(m).__name__))
    x = torch.randn(2, 3, 16, 16)
    fast.optimize(model, KernelChoice())
    installed = model.blocks[0].attn.qkv
    assert type(qkv) is nn.Linear and type(block) is Block  # the plain modules keep their class
    assert type(installed) is fast.FastLinear and installed.weight is qkv.weight and installed.bias is qkv.bias
    assert model.blocks[0].attn is block.attn  # the block's parts are the plain block's own
    model.train()(x)
    assert calls == ["FastLinear"]  # the hook carried over: the block steps aside for the hooked layer
    handle.remove()  # its handle still removes it, from both
    model(x)
    assert calls == ["FastLinear"] and not qkv._forward_hooks
    installed.register_forward_hook(lambda m, i, o: calls.append(type(m).__name__))
    model.eval()
    with torch.no_grad():
        installed.weight.mul_(0.5)  # a change through the installed module is a change of the plain one
    assert fast.restore(model) is model
    assert model.blocks[0] is block and model.blocks[0].attn.qkv is qkv and not qkv.training  # its mode too
    model(x)
    assert calls == ["FastLinear", "Linear"]  # a hook added while installed stays
    assert not any(isinstance(m, (fast.FastLinear, fast.FastBlock)) for m in model.modules())


def test_restore_keeps_a_parametrization_registered_on_an_installed_layer():
    """torch's parametrize gives the installed layer a class of its own whose property computes the
    weight: the plain layer put back had neither that class nor its weight (AttributeError: 'weight')."""
    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return 2 * weight

    plain_model = with_random_head(tiny())
    model = fast.optimize(copy.deepcopy(plain_model))
    for m in (plain_model, model):
        parametrize.register_parametrization(m.blocks[0].mlp.fc1, "weight", Doubled())
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expected = plain_model(x)
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-6)
        fc1 = fast.restore(model).blocks[0].mlp.fc1
        assert isinstance(fc1, nn.Linear) and not isinstance(fc1, fast.FastLinear)
        torch.testing.assert_close(fc1.weight, 2 * fc1.parametrizations.weight.original)
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-6)
    assert list(model.state_dict()) == list(plain_model.state_dict())
    parametrize.remove_parametrizations(fc1, "weight")
    assert type(fc1) is nn.Linear


def test_a_shared_module_gets_one_module_in_its_place_under_every_name():
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    x = torch.randn(2, 4)
    expected = model(x)
    fast.optimize(model, KernelChoice())
    assert type(model[0]) is fast.FastLinear and model[2] is model[0]
    torch.testing.assert_close(model(x), expected)
    fast.restore(model)
    assert model[0] is shared and model[2] is shared


def test_the_fast_models_state_round_trips_through_save_load_copy_and_pickle(tmp_path):
    model = fast.optimize(with_random_head(tiny()), inference_weights="hold").eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        bf16_logits = model(x)  # the dense layers now hold cast weights (with a bf16 kernel of their own)
    with torch.no_grad():
        logits = model(x)
    plain = fast.restore(copy.deepcopy(model))
    assert list(model.state_dict()) == list(plain.state_dict())
    vitlab.save_model(model, tmp_path / "saved")
    loaded = vitlab.load_model(tmp_path / "saved")
    assert not fast.is_optimized(loaded)  # weights carry no speed settings
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model)),
                   fast.optimize(loaded, inference_weights="hold")):
        assert fast.installed_options(copied) == fast.installed_options(model)
        assert all(m.held_casts.key is None for m in copied.modules() if isinstance(m, fast.FastLinear))
        with torch.no_grad():
            torch.testing.assert_close(copied(x), logits, rtol=1e-6, atol=1e-6)
            with torch.autocast("cpu", torch.bfloat16):
                torch.testing.assert_close(copied(x), bf16_logits, rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert fast.is_optimized(torch.load(buffer, weights_only=False))


# ----------------------------------------------------------------------------- kernel choice
# Each class of CPU the rule knows, described as Linux's /proc/cpuinfo writes it for a part of
# that class.  A test gives the rule one of these, never the machine's own, so that what it
# expects is the same on every machine; a test that runs a class's kernels skips where this
# machine's features cannot run them (``needs``), the one place a test reads the machine.

X86_FLAGS = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht "
             "syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid pni pclmulqdq "
             "ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm "
             "abm fsgsbase bmi1 avx2 smep bmi2 erms invpcid adx smap clflushopt xsaveopt xsavec xgetbv1 xsaves")
AVX512_FLAGS = "avx512f avx512dq avx512cd avx512bw avx512vl"


def described_cpu(vendor: str, family: int, model: int, name: str, flags: str) -> CpuInfo:
    """The CpuInfo of an x86 part whose /proc/cpuinfo says this, on any machine."""
    text = "".join(f"processor\t: {n}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
                   f"model name\t: {name}\nflags\t\t: {flags}\n\n" for n in range(2))
    return parse_cpuinfo(text, machine="x86_64")


DESCRIBED = {  # the classes the rule has a path for; the AMD names as a VM gives them
    "zen3-avx2": described_cpu("AuthenticAMD", 25, 1, "AMD EPYC 7B13", f"{X86_FLAGS} sha_ni vaes vpclmulqdq"),
    "intel-avx512": described_cpu("GenuineIntel", 6, 85, "Intel(R) Xeon(R) Gold 6148 CPU @ 2.40GHz",
                                  f"{X86_FLAGS} {AVX512_FLAGS} clwb"),
    "intel-avx512-bf16": described_cpu("GenuineIntel", 6, 85, "Intel(R) Xeon(R) Platinum 8380H CPU @ 2.90GHz",
                                       f"{X86_FLAGS} {AVX512_FLAGS} clwb avx512_vnni avx512_bf16"),
    "sapphire-rapids-amx": described_cpu("GenuineIntel", 6, 143, "Intel(R) Xeon(R) Platinum 8480+",
                                         f"{X86_FLAGS} {AVX512_FLAGS} avx512ifma avx512vbmi avx512_vnni avx512_bf16 "
                                         "avx512_fp16 avx_vnni amx_bf16 amx_tile amx_int8"),
    "zen4": described_cpu("AuthenticAMD", 25, 17, "AMD EPYC", f"{X86_FLAGS} {AVX512_FLAGS} avx512ifma avx512vbmi "
                          "avx512_vbmi2 avx512_vnni avx512_bf16 avx512_bitalg avx512_vpopcntdq gfni vaes"),
    "zen5": described_cpu("AuthenticAMD", 26, 2, "AMD EPYC", f"{X86_FLAGS} {AVX512_FLAGS} avx512ifma avx512vbmi "
                          "avx512_vbmi2 avx512_vnni avx512_bf16 avx512_bitalg avx512_vpopcntdq avx512_vp2intersect "
                          "avx_vnni gfni vaes"),
}
AMD_ZEN3, AMD_ZEN4, AMD_ZEN5 = DESCRIBED["zen3-avx2"], DESCRIBED["zen4"], DESCRIBED["zen5"]
GRAVITON = parse_cpuinfo("processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm aes pmull "
                         "sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop sha3 sm3 sm4 asimddp sha512 "
                         "sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng"
                         "\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\n\n", machine="aarch64")
CPUS = {**DESCRIBED,
        "amd-next-family": dataclasses.replace(AMD_ZEN5, family=27, model_number=0),  # no figures yet
        "aarch64": GRAVITON}
FULL_ONEDNN = kernels_mod.OneDNNReport(available=True, bf16=True)
AVX2_ONEDNN = kernels_mod.OneDNNReport(available=True, bf16=False)

# cpu -> (class, the rule's kernels, what --precision auto means there)
RULE_OF = {
    "zen3-avx2": ("avx2", KernelChoice("aten", "aten", "explicit"), "fp32"),
    "intel-avx512": ("avx512", KernelChoice(), "fp32"),  # no figures: the plain model's arithmetic
    "intel-avx512-bf16": ("avx512_bf16", KernelChoice("aten", "widened"), "fp32"),
    "sapphire-rapids-amx": ("amx", KernelChoice(), "fp32"),
    "zen4": ("avx512_bf16", KernelChoice("onednn", "onednn", training=("bf16",)), "bf16"),
    "zen5": ("avx512_bf16", KernelChoice("onednn", "onednn"), "bf16"),
    "amd-next-family": ("avx512_bf16", KernelChoice(), "fp32"),
    "aarch64": ("aarch64", KernelChoice(), "fp32"),
}


@pytest.mark.parametrize("cpu", list(CPUS))
def test_the_kernel_rule_follows_the_cpu_class_and_vendor(cpu):
    cls, expected, precision = RULE_OF[cpu]
    assert cpu_class(CPUS[cpu]) == cls
    rule = kernels_mod.rule_for(CPUS[cpu])
    assert rule.kernels == expected and kernels_mod.rule_choice(CPUS[cpu], FULL_ONEDNN) == expected
    assert rule.precision == precision
    assert bool(rule.measured) == (expected != KernelChoice())


def as_if_this_machine_were(monkeypatch, info: CpuInfo | None = None, report=None) -> None:
    """Every reader of this machine's CPU (and of what its oneDNN can do) reads ``info`` (``report``)."""
    from vitlab.fast import calibration

    for module in (kernels_mod, calibration):  # calibration imported the functions by name
        if info is not None:
            monkeypatch.setattr(module, "cpu_info", lambda path=None: info)
        if report is not None:
            monkeypatch.setattr(module, "onednn_report", lambda: report)


@pytest.mark.parametrize("cpu", list(CPUS))
def test_choose_and_cpu_precision_follow_the_cpus_class(cpu, tmp_path, monkeypatch):
    _, expected, precision = RULE_OF[cpu]
    as_if_this_machine_were(monkeypatch, report=FULL_ONEDNN)
    nothing_stored = tmp_path / "kernels.json"
    # the CPU given, or read (as if this machine were that CPU): the same answer
    assert kernels_mod.choose(nothing_stored, CPUS[cpu]) == expected
    assert kernels_mod.cpu_precision(CPUS[cpu], nothing_stored) == precision
    as_if_this_machine_were(monkeypatch, CPUS[cpu])
    assert kernels_mod.choose(nothing_stored) == expected
    assert kernels_mod.cpu_precision(path=nothing_stored) == precision
    # a oneDNN that cannot build bf16 primitives there (ONEDNN_MAX_CPU_ISA=AVX2): never bf16
    as_if_this_machine_were(monkeypatch, report=AVX2_ONEDNN)
    assert kernels_mod.choose(nothing_stored) == dataclasses.replace(
        expected, bf16="aten" if expected.bf16 == "onednn" else expected.bf16)
    assert kernels_mod.cpu_precision(path=nothing_stored) == "fp32"


def infer(model: nn.Module, x: torch.Tensor, bf16: bool) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        return model.eval()(x).float()


@pytest.mark.parametrize("cpu", [pytest.param(cpu, marks=needs(RULE_OF[cpu][1])) for cpu in DESCRIBED])
def test_each_classes_kernels_run_here_where_the_hardware_can_and_take_over_the_modes_they_name(cpu, monkeypatch):
    from vitlab.fast import modules

    kernels = kernels_mod.rule_for(DESCRIBED[cpu]).kernels
    model = with_random_head(tiny())
    x = torch.randn(3, 3, 16, 16)
    plain = {bf16: (loss_and_grads(model.train(), x, bf16), infer(model, x, bf16)) for bf16 in (False, True)}
    fast.optimize(model, kernels)
    fused = []
    real_fused = modules.FastBlock.fused
    monkeypatch.setattr(modules.FastBlock, "fused", lambda *a, **k: fused.append(1) or real_fused(*a, **k))
    for bf16 in (False, True):
        (loss, grads), logits = plain[bf16]
        fused.clear()
        fast_loss, fast_grads = loss_and_grads(model.train(), x, bf16)
        assert bool(fused) == kernels.takes_over(training=True, bf16=bf16)
        fused.clear()
        fast_logits = infer(model, x, bf16)
        assert bool(fused) == kernels.takes_over(training=False, bf16=bf16)
        if not bf16:
            torch.testing.assert_close(fast_loss, loss, rtol=1e-5, atol=1e-7)
            for g, h in zip(grads, fast_grads):  # another GEMM sums in another order
                torch.testing.assert_close(h, g, rtol=1e-4, atol=1e-5 * float(g.abs().max()) + 1e-7)
            torch.testing.assert_close(fast_logits, logits, rtol=1e-5, atol=1e-6)
        else:  # bf16 keeps about 3 significant digits
            torch.testing.assert_close(fast_loss, loss, rtol=2e-2, atol=0.0)
            flat = lambda gs: torch.cat([g.float().flatten() for g in gs])  # noqa: E731
            assert (flat(fast_grads) - flat(grads)).norm() < 3e-2 * flat(grads).norm()
            assert (fast_logits - logits).norm() < 3e-2 * logits.norm()


def test_two_parts_a_vm_names_alike_are_told_apart_by_their_family_and_model_numbers():
    # in the rule and in stored calibrations (the numbers are read by ``vitlab.machine``: tests/test_machine.py)
    assert AMD_ZEN4.model == AMD_ZEN5.model == "AMD EPYC"
    assert kernels_mod.rule_for(AMD_ZEN4) != kernels_mod.rule_for(AMD_ZEN5)
    assert kernels_mod.calibration_key(AMD_ZEN4) != kernels_mod.calibration_key(AMD_ZEN5)


def test_the_rule_never_picks_a_kernel_onednn_says_it_cannot_build():
    # oneDNN held back (ONEDNN_MAX_CPU_ISA=AVX2, or a CPU whose flags promise more than oneDNN finds)
    assert kernels_mod.rule_choice(AMD_ZEN5, AVX2_ONEDNN) == KernelChoice("onednn", "aten")
    no_onednn = kernels_mod.OneDNNReport(available=False, bf16=False)
    assert kernels_mod.rule_choice(AMD_ZEN5, no_onednn) == KernelChoice("aten", "aten")


def test_a_forced_kernel_that_cannot_run_is_refused_naming_the_missing_feature(monkeypatch):
    reason = kernels_mod.why_unavailable(ONEDNN_BF16, AMD_ZEN3, AVX2_ONEDNN)
    assert reason.startswith("KernelChoice.bf16='onednn': oneDNN's bf16 matmul cannot run on this CPU (AMD EPYC 7B13)")
    assert "AVX-512 (avx512f" in reason and "\n" not in reason
    assert kernels_mod.why_unavailable(KernelChoice("onednn", "widened"), AMD_ZEN3, AVX2_ONEDNN) is None
    assert "Arm BF16" in kernels_mod.why_unavailable(ONEDNN_BF16, dataclasses.replace(GRAVITON, flags=frozenset()),
                                                   AVX2_ONEDNN)
    # through optimize(): one line, before anything is installed
    monkeypatch.setattr(kernels_mod, "onednn_report", lambda: AVX2_ONEDNN)
    model = with_random_head(tiny())
    with pytest.raises(fast.KernelUnavailable, match=r"^KernelChoice.bf16='onednn': oneDNN's bf16 matmul cannot run"):
        fast.optimize(model, ONEDNN_BF16)
    assert not fast.is_optimized(model)


def test_kernels_that_are_not_a_kernel_choice_are_refused_by_name_before_anything_is_installed():
    model = with_random_head(tiny())
    with pytest.raises(TypeError, match=r"^kernels='onednn': expected a KernelChoice"):
        fast.optimize(model, "onednn")
    assert not fast.is_optimized(model)


def test_the_fast_path_leaves_a_mode_it_loses_to_the_plain_forward(monkeypatch):
    from vitlab.fast import modules

    model = fast.optimize(with_random_head(tiny()), KernelChoice(training=("bf16",), inference=()))
    fused = []
    real_fused = modules.FastBlock.fused
    monkeypatch.setattr(modules.FastBlock, "fused", lambda *a, **k: fused.append(1) or real_fused(*a, **k))
    x = torch.randn(2, 3, 16, 16)
    model.train()(x).sum().backward()  # fp32 training: plain
    with torch.no_grad():
        model.eval()(x)                # inference: plain in both precisions
        with torch.autocast("cpu", torch.bfloat16):
            model(x)
    assert fused == []
    with torch.autocast("cpu", torch.bfloat16):  # bf16 training: taken
        model.train()(x)
    assert fused == [1, 1]
    with pytest.raises(ValueError, match="KernelChoice.training='bf16'"):
        KernelChoice(training="bf16")


def fake_steps(plain: float, per_choice: dict) -> dict:
    return {"plain": plain, **per_choice}


def test_a_calibration_times_whole_steps_stores_what_wins_and_is_preferred_to_the_rule(tmp_path, monkeypatch):
    from vitlab.fast import calibration

    path = tmp_path / "kernels.json"
    times = {  # seconds per step: fp32 loses in inference whatever the kernel; bf16 wins both modes
        "fp32": {"training": fake_steps(1.0, {"aten/fused": 1.1, "aten/explicit": 0.9, "onednn/fused": 0.95,
                                              "onednn/explicit": 0.92}),
                 "inference": fake_steps(1.0, {"aten/fused": 1.2, "aten/explicit": 1.05, "onednn/fused": 1.3,
                                               "onednn/explicit": 1.4})},
        "bf16": {"training": fake_steps(0.8, {"aten": 0.7, "onednn": 0.6, "widened": 0.9}),
                 "inference": fake_steps(0.5, {"aten": 0.45, "onednn": 0.3, "widened": 0.6})},
    }
    monkeypatch.setattr(calibration, "measure", lambda rounds=3, say=None: times)
    as_if_this_machine_were(monkeypatch, AMD_ZEN4, FULL_ONEDNN)
    choice, precision, measured = calibration.calibrate(path)
    # aten/explicit: 0.9 + 1.05 relative to plain, the least over both modes; it still loses in inference
    assert choice == KernelChoice("aten", "onednn", "explicit", training=("fp32", "bf16"), inference=("bf16",))
    assert precision == "bf16" and measured == times
    assert kernels_mod.stored_choice(path) == choice and kernels_mod.choose(path) == choice
    assert kernels_mod.cpu_precision(path=path) == "bf16"
    other_cpu = CpuInfo("GenuineIntel", "another CPU", frozenset())
    assert kernels_mod.stored_choice(path, other_cpu) is None  # another machine's answer is not used
    as_if_this_machine_were(monkeypatch, report=AVX2_ONEDNN)  # a choice it can no longer run
    assert kernels_mod.stored_choice(path) is None
    assert kernels_mod.cpu_precision(path=path) == "fp32"  # no bf16 kernel: never bf16
    path.write_text("{ not json")  # the rule of Zen 4, less the bf16 kernel this oneDNN cannot build
    with pytest.warns(UserWarning, match="kernels.json is damaged"):
        assert kernels_mod.choose(path) == KernelChoice("onednn", "aten", training=("bf16",))


def test_a_calibration_path_may_be_a_string(tmp_path, monkeypatch):
    # calibrate timed every step, minutes of them, and then failed on the string's missing .parent; choose and
    # cpu_precision failed on its missing .read_text
    from vitlab.fast import calibration

    times = {"fp32": {"training": fake_steps(1.0, {"aten/fused": 0.9, "aten/explicit": 1.1, "onednn/fused": 1.2,
                                                   "onednn/explicit": 1.3}),
                      "inference": fake_steps(1.0, {"aten/fused": 0.9, "aten/explicit": 1.1, "onednn/fused": 1.2,
                                                    "onednn/explicit": 1.3})}}
    monkeypatch.setattr(calibration, "measure", lambda rounds=3, say=None: times)
    as_if_this_machine_were(monkeypatch, AMD_ZEN4, FULL_ONEDNN)
    path = str(tmp_path / "cache" / "kernels.json")
    choice, precision, _ = calibration.calibrate(path)
    assert choice.fp32 == "aten" and choice.attention == "fused"
    assert kernels_mod.stored_choice(path) == kernels_mod.choose(path) == choice
    assert kernels_mod.cpu_precision(path=path) == precision


@pytest.mark.parametrize("text, why", [("{ not json", "JSONDecodeError"), ("[1, 2]", "a JSON list"),
                                       (b"\xff\xfe", "UnicodeDecodeError"), ("THIS_CPU: 3", "entry is not an object"),
                                       ('THIS_CPU: {"kernels": {"fp32": "mkl"}}', "fp32='mkl'"),
                                       ("THIS_CPU: {}", "KeyError: 'kernels'")])
def test_a_damaged_calibration_is_ignored_with_a_warning_naming_the_file(text, why, tmp_path, monkeypatch):
    # it was ignored without a word: a run took the rule's kernels and precision where the user had calibrated
    path = tmp_path / "kernels.json"
    key = json.dumps(kernels_mod.calibration_key(kernels_mod.cpu_info()))
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text("{" + text.replace("THIS_CPU", key) + "}" if "THIS_CPU" in text else text)
    with pytest.warns(UserWarning, match=f"stored calibration {path} is damaged .*{why}.*the kernel rule decides"):
        assert kernels_mod.choose(path) == kernels_mod.rule_choice()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path.write_text(json.dumps({"another CPU": {"kernels": {}}}))  # another machine's entries: nothing to say
        assert kernels_mod.choose(path) == kernels_mod.rule_choice()
        path.unlink()
        assert kernels_mod.choose(path) == kernels_mod.rule_choice()  # none stored: nothing to say
    monkeypatch.setattr(kernels_mod, "calibration_path", lambda: path)
    path.write_text("[]")
    from vitlab.cli import main
    with pytest.warns(UserWarning, match="stored calibration .* is damaged"):  # a run resolves as without one
        assert main(["train", "--recipe", "demo", "--data", "digits", "--show-config"]) == 0


def test_the_calibration_lives_under_an_absolute_xdg_cache_home_only(tmp_path, monkeypatch):
    # a relative XDG_CACHE_HOME was taken as given: each working folder stored and read its own
    # calibration; the XDG Base Directory spec says a relative one is ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    default = tmp_path / "home" / ".cache" / "vitlab" / "kernels.json"
    for value in ("", "cache", "./cache"):
        monkeypatch.setenv("XDG_CACHE_HOME", value)
        assert kernels_mod.calibration_path() == default
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert kernels_mod.calibration_path() == default
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernels_mod.calibration_path() == tmp_path / "xdg" / "vitlab" / "kernels.json"


def test_calibrate_stores_its_answer_through_a_temporary_file_of_its_own(tmp_path, monkeypatch):
    from vitlab.fast import calibration

    path = tmp_path / "kernels.json"
    times = {"fp32": {mode: fake_steps(1.0, {"aten/fused": 0.9}) for mode in ("training", "inference")}}
    monkeypatch.setattr(calibration, "measure", lambda rounds=3, say=None: times)
    # another calibrate writing at the same time (on another host, where $HOME is shared), at the fixed
    # name every calibrate used: its file was overwritten, and one renamed the other's into place
    (tmp_path / "kernels.tmp").write_text("another calibrate's, half written")
    choice, _, _ = calibration.calibrate(path)
    assert (tmp_path / "kernels.tmp").read_text() == "another calibrate's, half written"
    assert kernels_mod.stored_choice(path) == choice
    stored = path.read_text()

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    monkeypatch.setattr(Path, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        calibration.calibrate(path)
    assert path.read_text() == stored  # the stored answer as it was, and nothing left beside it but its lock
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels.json", "kernels.json.lock", "kernels.tmp"]


@pytest.mark.skipif(not hasattr(os, "umask") or os.name != "posix", reason="POSIX file modes and locks")
def test_calibrate_stores_under_a_lock_with_a_new_files_mode(tmp_path, monkeypatch):
    import fcntl

    from vitlab.fast import calibration

    path = tmp_path / "kernels.json"
    times = {"fp32": {mode: fake_steps(1.0, {"aten/fused": 0.9}) for mode in ("training", "inference")}}
    monkeypatch.setattr(calibration, "measure", lambda rounds=3, say=None: times)
    path.write_text(json.dumps({"another CPU": {"kernels": {}}}))
    real_replace, held = os.replace, []

    def replace(src, dst):  # while the file is replaced, another calibrate cannot take the lock
        with open(tmp_path / "kernels.json.lock", "a") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append(False)
            except BlockingIOError:
                held.append(True)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    # two calibrates at once (hosts sharing $HOME) each read the file, added their entry and wrote it
    # back: the one that wrote last lost the other's entry
    umask = os.umask(0o022)
    try:
        calibration.calibrate(path)
    finally:
        os.umask(umask)
    assert held == [True]
    assert "another CPU" in json.loads(path.read_text()) and kernels_mod.stored_entry(path) is not None
    # mkstemp's 0600 whatever the umask: a calibration in a shared cache was another user's to read
    assert path.stat().st_mode & 0o777 == 0o644
    path.chmod(0o640)  # a stored file's own mode is kept
    calibration.calibrate(path)
    assert path.stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize("report", [pytest.param(AVX2_ONEDNN, id="onednn-without-bf16"),
                                    pytest.param(FULL_ONEDNN, id="onednn-with-bf16", marks=needs(ONEDNN_BF16))])
def test_calibrate_runs_every_candidate_end_to_end_on_small_steps(report, tmp_path, monkeypatch):
    from vitlab.fast import calibration

    as_if_this_machine_were(monkeypatch, report=report)
    tiny_workload = dict(depth=1, width=32, num_heads=2, mlp_dim=64, patch_size=8, img_size=16, num_classes=3)
    monkeypatch.setattr(calibration, "WORKLOADS", {"training": ("tiny b4", "ViT-Ti/16", tiny_workload, 4),
                                                   "inference": ("tiny b2", "ViT-Ti/16", tiny_workload, 2)})
    lines = []
    choice, precision, seconds = calibration.calibrate(tmp_path / "k.json", rounds=1, say=lines.append)
    measured = ["fp32", "bf16"] if report.bf16 else ["fp32"]
    assert list(seconds) == measured and len(lines) == 2 * len(measured)
    for precision_times in seconds.values():
        for mode_times in precision_times.values():
            assert "plain" in mode_times and len(mode_times) >= 3 and all(t > 0 for t in mode_times.values())
    assert kernels_mod.why_unavailable(choice) is None and precision in measured
    assert kernels_mod.stored_choice(tmp_path / "k.json") == choice


def test_calibration_candidates_are_only_kernels_this_machine_can_run(monkeypatch):
    from vitlab.fast import calibration

    monkeypatch.setattr(kernels_mod, "onednn_report", lambda: AVX2_ONEDNN)
    assert [c.bf16 for c in calibration.candidates("bf16")] == ["aten", "widened"]
    assert {(c.fp32, c.attention) for c in calibration.candidates("fp32")} == {
        ("aten", "fused"), ("aten", "explicit"), ("onednn", "fused"), ("onednn", "explicit")}


def test_nothing_is_timed_when_a_model_is_optimised_or_run(monkeypatch):
    from vitlab.fast import calibration

    monkeypatch.setattr(calibration, "measure", lambda *a, **k: pytest.fail("timed inside a run"))
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: pytest.fail("timed inside a run"))
    model = fast.optimize(with_random_head(tiny()))
    with torch.autocast("cpu", torch.bfloat16):
        model(torch.randn(2, 3, 16, 16)).float().sum().backward()
    assert fast.cpu_precision() in ("fp32", "bf16")


def test_a_bad_kernel_name_is_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match="fp32='mkl'.*aten, onednn"):
        KernelChoice(fp32="mkl")
    with pytest.raises(ValueError, match="bf16='fp32'.*aten, onednn, widened"):
        KernelChoice(bf16="fp32")
    with pytest.raises(ValueError, match="attention='flash'.*fused, explicit"):
        KernelChoice(attention="flash")
    assert KernelChoice(**json.loads(json.dumps(dataclasses.asdict(KernelChoice())))) == KernelChoice()


def test_the_cudnn_attention_preference_reorders_torchs_backends_and_restores_them():
    from torch.nn.attention import SDPBackend

    from vitlab.fast.kernels import attention_backends

    before = torch._C._get_sdp_priority_order()
    with attention_backends("torch"):
        assert torch._C._get_sdp_priority_order() == before
    with attention_backends("cudnn"):
        order = torch._C._get_sdp_priority_order()
        assert order[0] == int(SDPBackend.CUDNN_ATTENTION.value) and sorted(order) == sorted(before)
        rest = [b for b in before if b != order[0]]
        assert [b for b in order[1:] if b in rest] == rest  # the others keep PyTorch's order after it
        assert torch.backends.cuda.cudnn_sdp_enabled()
    assert torch._C._get_sdp_priority_order() == before
    # a backend the caller turned off stays off inside, and the caller's state is back after: its order too
    # (torch's sdpa_kernel put back the enabled backends' order, the disabled ones last: flash turned off and on
    # again after a run's steps came after the math kernel)
    flash = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        with attention_backends("cudnn"):
            assert not torch.backends.cuda.flash_sdp_enabled()
        assert not torch.backends.cuda.flash_sdp_enabled()
        assert torch._C._get_sdp_priority_order() == before
    finally:
        torch.backends.cuda.enable_flash_sdp(flash)
        torch._C._set_sdp_priority_order(before)
    with pytest.raises(ValueError, match="gpu_attention='flash': expected one of torch, cudnn"):
        attention_backends("flash")


def test_a_runs_autocast_casts_the_weights_as_they_are_inside_an_outer_autocast():
    # torch keeps autocast's casts of the parameters until the outermost autocast ends: inside a caller's
    # (or train's own, turned off), a layer updated between two steps was read as its first cast
    from vitlab.fast.kernels import autocast

    layer = torch.nn.Linear(4, 2)
    x = torch.randn(3, 4)
    with torch.autocast("cpu", enabled=False):
        outputs = []
        for _ in range(2):
            with autocast(torch.device("cpu"), "bf16"):
                outputs.append(layer(x).float())
            with torch.no_grad():
                layer.weight.add_(1.0)
    expected = torch.nn.functional.linear(x, layer.weight.detach() - 1.0, layer.bias.detach())
    assert torch.allclose(outputs[1], expected, atol=0.05)
