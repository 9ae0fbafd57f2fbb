"""The model package: registry, parameter counts, position embeddings, attention capture."""
from __future__ import annotations

import contextlib
import copy
import io

import numpy as np
import pytest
import torch
from torch import nn

import vitlab
from vitlab.config import ConfigError, ViTConfig
from vitlab.models.layers import Attention
from vitlab.models.posemb import resample_grid
from vitlab.models.registry import count_parameters, get_config, list_models

torch.set_num_threads(2)


def tiny(**fields) -> ViTConfig:
    base = dict(img_size=16, patch_size=4, width=32, depth=2, mlp_dim=64, num_heads=4, num_classes=5)
    base.update(fields)
    return ViTConfig(**base)


# Counts of the official code at 224 px, 1000 classes, token head, no pre-logits.
OFFICIAL_COUNTS = {
    "ViT-Ti/16": 5_717_416,
    "ViT-S/16": 22_050_664,
    "ViT-B/16": 86_567_656,
    "ViT-B/32": 88_224_232,
    "ViT-L/16": 304_326_632,
    "ViT-H/14": 632_045_800,
    "R50x1+ViT-B/16": 98_659_112,
}


@pytest.mark.parametrize("name,count", OFFICIAL_COUNTS.items())
def test_parameter_count_matches_official_code(name, count):
    assert count_parameters(get_config(name)) == count


def test_official_spellings_are_aliases():
    assert get_config("ViT-B_16") == get_config("ViT-B/16")
    assert get_config("R50+ViT-B_16") == get_config("R50x1+ViT-B/16")
    assert get_config("R152x4").name == "BiT-R152x4"


def test_hybrid_names_follow_the_paper():
    # /16 removes stage 4 and moves its blocks to stage 3; /32 keeps the stage-4 output
    b16, b32 = get_config("R50x1+ViT-B/16"), get_config("R50x1+ViT-B/32")
    assert b16.resnet.layers == (3, 4, 9) and b16.grid_size == (14, 14)
    assert b32.resnet.layers == (3, 4, 6, 3) and b32.grid_size == (7, 7)
    assert b16.patch_size == b32.patch_size == (1, 1)


def test_registry_covers_the_paper():
    names = set(list_models())
    for size in "Ti S B L H".split():
        for patch in (8, 14, 16, 32):
            assert f"ViT-{size}/{patch}" in names
    for bit in ("R50x1", "R50x2", "R101x1", "R152x1", "R152x2", "R152x4", "R200x3"):
        assert f"BiT-{bit}" in names
    assert {"Axial-ViT-B/16", "Axial-ViT-B/32", "R50x1+ViT-L/16", "R50x1+ViT-L/32"} <= names


def small_version(name: str):
    """The registered architecture at a small input; the largest ones with fewer layers.

    Their full size is pinned by the parameter-count tests on the meta device; building
    hundreds of millions of parameters here would take minutes on two cores for no
    extra coverage of the code.
    """
    cfg = get_config(name)
    if isinstance(cfg, vitlab.ResNetConfig):
        big = cfg.layers != (3, 4, 6, 3) or cfg.width_factor > 1  # all but R50x1: one unit per stage
        return vitlab.config.replace(cfg, img_size=32, num_classes=3,
                                     layers=(1,) * len(cfg.layers) if big else cfg.layers), 32
    big = count_parameters(cfg) > 150_000_000
    reduction = cfg.resnet.reduction if cfg.resnet else 1
    side = 2 * cfg.patch_size[0] * reduction
    return vitlab.config.replace(cfg, img_size=side, num_classes=3, depth=2 if big else cfg.depth), side


@pytest.mark.parametrize("name", list_models())
def test_every_registered_model_runs_forward_and_backward(name):
    cfg, side = small_version(name)
    torch.manual_seed(0)
    model = vitlab.create_model(cfg)
    # zero-initialised heads (and BiT's zero GroupNorm scales) would hide gradients upstream
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv2d)) and module.weight.abs().sum() == 0:
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.GroupNorm) and module.weight.abs().sum() == 0:
            nn.init.ones_(module.weight)
    logits = model(torch.randn(2, 3, side, side))
    assert logits.shape == (2, 3)
    logits.square().sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"parameters without gradient: {missing}"


def test_create_model_overrides_and_errors():
    m = vitlab.create_model("ViT-B/16", num_classes=10, img_size=384, depth=1)
    assert m.cfg.grid_size == (24, 24) and m.head.out_features == 10
    assert m.pos_embed.weight.shape == (1, 1 + 24 * 24, 768)
    with pytest.raises(ConfigError, match="unknown field"):
        vitlab.create_model("ViT-B/16", widht=3)
    with pytest.raises(ConfigError, match="unknown model"):
        vitlab.create_model("ViT-Q/16")
    with pytest.raises(ConfigError, match="num_heads"):
        tiny(num_heads=5)
    with pytest.raises(ConfigError, match="patch_size"):
        tiny(img_size=18)
    with pytest.raises(ConfigError, match="posemb"):
        tiny(posemb="sinusoidal")


def test_wrong_input_is_a_clear_error():
    model = vitlab.create_model(tiny())
    with pytest.raises(ValueError, match="img_size"):
        model(torch.randn(1, 3, 20, 20))
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        model(torch.randn(1, 1, 16, 16))


def test_non_square_images_and_patches():
    model = vitlab.create_model(tiny(img_size=(16, 24), patch_size=(4, 8)))
    assert model.cfg.grid_size == (4, 3)
    assert model(torch.randn(2, 3, 16, 24)).shape == (2, 5)


def test_head_is_zero_initialised_and_init_follows_official_code():
    torch.manual_seed(0)
    model = vitlab.create_model(tiny(width=64, mlp_dim=256, representation_size=16))
    assert model.head.weight.abs().sum() == 0 and model.head.bias.abs().sum() == 0
    assert model.cls_token.abs().sum() == 0
    assert model.pre_logits.fc.weight.shape == (16, 64)
    std = model.pos_embed.weight.std().item()
    assert 0.015 < std < 0.025
    block = model.blocks[0]
    bound = (6 / (64 + 64)) ** 0.5  # Xavier for each (D, D) part of the fused qkv
    for part in block.attn.qkv.weight.chunk(3):
        assert part.abs().max() <= bound and part.abs().max() > 0.9 * bound
    assert block.mlp.fc1.bias.abs().max() < 1e-5 and block.mlp.fc1.bias.abs().max() > 0


def test_dropout_sits_where_the_paper_puts_it():
    model = vitlab.create_model(tiny(dropout=0.5, depth=1))
    calls: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout):
            module.register_forward_hook(lambda m, i, o, n=name: calls.append(n))
    model.train()
    with torch.no_grad():  # with a backward ahead the GELU's dropout runs inside gelu_dense (tested below)
        model(torch.randn(2, 3, 16, 16))
    # after the position embeddings, after the attention output dense, after both MLP denses
    assert calls == ["pos_drop", "blocks.0.attn.proj_drop", "blocks.0.mlp.drop", "blocks.0.mlp.drop"]


def _loss_grads_and_saved_bytes(model, x, amp=False):
    """One backward: the loss, every gradient (parameters and input), and the bytes of the
    non-parameter tensors autograd kept for it."""
    from vitlab.analysis.cost import SavedForBackward

    model.zero_grad()
    x = x.clone().requires_grad_()
    with SavedForBackward(model) as kept:
        with torch.autocast("cpu", torch.bfloat16, enabled=amp):
            loss = model(x).float().square().sum()
    loss.backward()
    grads = [x.grad] + [p.grad for p in model.parameters()]
    return loss.detach(), grads, kept.bytes


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_recomputing_norms_and_gelu_gives_the_same_gradients_and_keeps_less(amp):
    from vitlab.models.fused import store_activations

    torch.manual_seed(0)
    model = vitlab.create_model(tiny(gelu="exact", depth=3, width=48, mlp_dim=192, num_heads=3))
    with torch.no_grad():  # the zero-initialised head would leave the gradients trivial
        model.head.weight.normal_()
    x = torch.randn(4, 3, 16, 16)
    loss, grads, kept = _loss_grads_and_saved_bytes(model, x, amp)
    with store_activations():
        stored_loss, stored_grads, stored_kept = _loss_grads_and_saved_bytes(model, x, amp)
    assert torch.equal(loss, stored_loss)
    for grad, stored in zip(grads, stored_grads):
        torch.testing.assert_close(grad, stored, rtol=0, atol=0)  # the same ops on the same values
    # per block: 16 (tokens x width) activations stored, 10 when recomputing (fp32)
    assert kept < (0.72 if not amp else 0.8) * stored_kept


def test_recompute_functions_pass_gradcheck():
    from vitlab.models.fused import gelu_dense, layer_norm_dense

    torch.manual_seed(0)
    norm = nn.LayerNorm(6, eps=1e-6).double()
    dense, dense2 = nn.Linear(6, 5).double(), nn.Linear(5, 4).double()
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    x = torch.randn(2, 3, 6, dtype=torch.double, requires_grad=True)
    params = (*norm.parameters(), *dense.parameters(), *dense2.parameters())

    def both(x, *_):
        return gelu_dense(layer_norm_dense(x, norm, dense), "tanh", nn.Dropout(0.0), dense2)

    assert torch.autograd.gradcheck(both, (x, *params))


@pytest.mark.parametrize("used", [(0, 1, 2), (0, 2), (1,)], ids=["qkv", "q-v", "k"])
def test_split_heads_gradient_equals_autograds_views(used):
    from vitlab.models.fused import split_heads, store_activations

    torch.manual_seed(0)
    qkv = torch.randn(2, 5, 3 * 12)
    weights = [torch.randn(2, 4, 5, 3) for _ in range(3)]  # (B, H, L, D/H) for 4 heads

    def grad(plain: bool) -> torch.Tensor:
        x = qkv.clone().requires_grad_()
        with store_activations() if plain else contextlib.nullcontext():
            parts = split_heads(x, num_heads=4)
        sum((parts[i] * weights[i]).sum() for i in used).backward()
        return x.grad

    expected = qkv.view(2, 5, 3, 4, 3).permute(2, 0, 3, 1, 4)
    assert all(torch.equal(a, b) for a, b in zip(split_heads(qkv, 4), expected))
    assert torch.equal(grad(plain=False), grad(plain=True))
    unused = [i for i in range(3) if i not in used]
    assert all(grad(plain=False).view(2, 5, 3, 12)[:, :, i].abs().sum() == 0 for i in unused)


def test_gelu_dense_drops_out_with_the_mask_it_keeps():
    from vitlab.models.fused import gelu_dense

    torch.manual_seed(0)
    dense = nn.Linear(8, 3)
    h = torch.randn(5, 8, requires_grad=True)
    torch.manual_seed(7)
    out = gelu_dense(h, "none", nn.Dropout(0.25).train(), dense)
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


def test_capture_attention_matches_the_fused_path():
    torch.manual_seed(0)
    model = vitlab.create_model(tiny(posemb="relative")).eval()
    x = torch.randn(3, 3, 16, 16)
    fused = model(x)
    with vitlab.capture_attention(model) as maps:
        explicit = model(x)
    torch.testing.assert_close(explicit, fused, atol=1e-5, rtol=1e-5)
    assert len(maps) == 2 and maps[0].shape == (3, 4, 17, 17)
    torch.testing.assert_close(maps[1].sum(-1), torch.ones(3, 4, 17))
    assert all(m.recorded is None for m in model.modules() if isinstance(m, Attention))


def test_bf16_cpu_attention_takes_the_explicit_path_and_agrees_with_the_kernel(monkeypatch):
    import vitlab.models.layers as layers

    torch.manual_seed(0)
    model = vitlab.create_model(tiny(posemb="relative")).train()
    with torch.no_grad():  # the zero-initialised head would leave the gradients trivial
        model.head.weight.normal_()
    x = torch.randn(3, 3, 16, 16)
    seen = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(layers.F, "scaled_dot_product_attention",
                        lambda *a, **k: seen.append(a[0].dtype) or real_sdpa(*a, **k))

    def loss_and_grads():
        model.zero_grad()
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(x).float().square().sum()
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    explicit_loss, explicit_grads = loss_and_grads()
    assert seen == []  # training in bf16 on a CPU never reached the flash kernel
    model(x)
    assert seen and set(seen) == {torch.float32}  # fp32 still does
    seen.clear()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        model(x)
    assert seen and set(seen) == {torch.bfloat16}  # and so does bf16 without a backward
    seen.clear()
    monkeypatch.setattr(layers, "explicit_attention_is_faster", lambda q: False)
    kernel_loss, kernel_grads = loss_and_grads()
    assert seen and set(seen) == {torch.bfloat16}
    torch.testing.assert_close(explicit_loss, kernel_loss, rtol=2e-2, atol=0.0)
    # bf16 rounding differs between the paths; the gradients agree to bf16's precision
    assert (explicit_grads - kernel_grads).norm() < 2e-2 * kernel_grads.norm()


def test_relative_bias_is_query_times_offset_embedding():
    torch.manual_seed(0)
    attn = Attention(tiny(posemb="relative"), seq_len=5)
    q = torch.randn(2, 4, 5, 8)
    bias = attn.rel_pos(q)
    table = attn.rel_pos.weight  # (2L-1, H, hd), index of offset q - k is (i - j) + L - 1
    for i in range(5):
        for j in range(5):
            expected = torch.einsum("bhd,hd->bh", q[:, :, i], table[i - j + 4])
            torch.testing.assert_close(bias[:, :, i, j], expected)


@pytest.mark.parametrize("posemb", ["none", "learned_1d", "learned_2d", "relative"])
@pytest.mark.parametrize("place", ["stem", "every_layer", "every_layer_shared"])
def test_position_embedding_variants(posemb, place):
    if posemb == "relative" and place != "stem":
        with pytest.raises(ConfigError, match="relative"):
            tiny(posemb=posemb, posemb_place=place)
        return
    cfg = tiny(posemb=posemb, posemb_place=place, depth=3)
    model = vitlab.create_model(cfg)
    tables = sum(p.numel() for n, p in model.named_parameters() if "pos_embed" in n)
    one = {"none": 0, "learned_1d": 17 * 32, "learned_2d": 4 * 16 + 4 * 16 + 32, "relative": 0}[posemb]
    assert tables == one * (3 if place == "every_layer" else 1)
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 5)


def test_without_position_embeddings_patches_are_a_set():
    """With no position embeddings and average pooling, the model cannot see patch order."""
    torch.manual_seed(0)
    model = vitlab.create_model(tiny(posemb="none", classifier="gap", num_classes=0)).eval()
    x = torch.randn(1, 3, 16, 16)
    swapped = x.clone()
    swapped[..., 0:4, 0:4], swapped[..., 8:12, 4:8] = x[..., 8:12, 4:8], x[..., 0:4, 0:4]
    torch.testing.assert_close(model(swapped), model(x), atol=1e-5, rtol=1e-5)
    model1d = vitlab.create_model(tiny(classifier="gap", num_classes=0)).eval()
    assert not torch.allclose(model1d(swapped), model1d(x), atol=1e-4)


def test_two_d_embedding_concatenates_x_and_y():
    model = vitlab.create_model(tiny(posemb="learned_2d", classifier="gap"))
    table = model.pos_embed((4, 4))[0].reshape(4, 4, 32)
    torch.testing.assert_close(table[2, 3, :16], model.pos_embed.x[3])
    torch.testing.assert_close(table[2, 3, 16:], model.pos_embed.y[2])


def test_bilinear_resampling_equals_scipy_zoom_order_1():
    scipy_ndimage = pytest.importorskip("scipy.ndimage")
    grid = torch.randn(7, 7, 5, dtype=torch.float64)
    ours = resample_grid(grid, (12, 12), "bilinear").numpy()
    reference = scipy_ndimage.zoom(grid.numpy(), (12 / 7, 12 / 7, 1), order=1)
    np.testing.assert_allclose(ours, reference, atol=1e-12)


def test_dynamic_size_equals_a_model_built_at_that_size():
    torch.manual_seed(0)
    dynamic = vitlab.create_model(tiny(dynamic_img_size=True)).eval()
    big = vitlab.create_model(tiny(img_size=24)).eval()
    state = dynamic.state_dict()
    state["pos_embed.weight"] = dynamic.pos_embed((6, 6)).detach()
    big.load_state_dict(state)
    x = torch.randn(2, 3, 24, 24)
    torch.testing.assert_close(dynamic(x), big(x))


def test_reset_classifier_and_pre_logits():
    model = vitlab.create_model(tiny(representation_size=8))
    model.reset_classifier(7)
    assert model.cfg.num_classes == 7 and model.head.weight.shape == (7, 8)
    tokens = model.forward_features(torch.randn(2, 3, 16, 16))
    rep = model.forward_head(tokens, pre_logits=True)
    assert rep.shape == (2, 8) and rep.abs().max() <= 1  # tanh
    assert len(model.forward_intermediates(torch.randn(1, 3, 16, 16))) == 2


def test_patch_dropout_trains_on_a_subset_of_the_same_tokens():
    """In training the encoder sees prefix + round(N * (1 - rate)) tokens, each an unchanged
    embedded patch; in evaluation the model equals one without patch dropout."""
    torch.manual_seed(0)
    cfg = ViTConfig(img_size=32, patch_size=4, width=32, depth=1, mlp_dim=64, num_heads=2, num_classes=3,
                    patch_dropout=0.25)
    model = vitlab.create_model(cfg)
    x = torch.randn(3, 3, 32, 32)
    model.eval()
    full, _ = model.embed(x)
    model.train()
    kept, _ = model.embed(x)
    assert kept.shape == (3, 1 + 48, 32)
    assert torch.equal(kept[:, 0], full[:, 0])  # the [class] token always stays
    for b in range(3):  # every kept token is one of this image's own patch tokens, none twice
        match = (kept[b, 1:, None, :] == full[b, None, 1:, :]).all(-1)
        assert match.sum(1).eq(1).all() and match.sum(0).le(1).all()
    twin = vitlab.create_model(vitlab.config.replace(cfg, patch_dropout=0.0))
    twin.load_state_dict(model.state_dict())
    model.eval(), twin.eval()
    with torch.no_grad():
        assert torch.equal(model(x), twin(x))
    model.train()
    model.forward_features(x).square().sum().backward()  # gradients reach the embedding through the gather
    assert model.patch_embed.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("fields", [dict(posemb="relative"), dict(posemb_place="every_layer"),
                                    dict(axial=True, classifier="gap", posemb="learned_2d"), dict(patch_dropout=1.0)])
def test_patch_dropout_refuses_what_needs_every_patch(fields):
    with pytest.raises(ConfigError, match="patch_dropout"):
        ViTConfig(**{"patch_dropout": 0.5, **fields})


@pytest.mark.parametrize("fields", [dict(), dict(axial=True, classifier="gap", posemb="learned_2d"),
                                    dict(posemb="relative", qkv_bias=False)])
def test_inference_reuses_one_buffer_per_wide_activation_and_changes_nothing(monkeypatch, fields):
    import vitlab.models.buffers as buffers
    import vitlab.models.fused as fused

    torch.manual_seed(0)
    model = vitlab.create_model(tiny(depth=3, **fields)).eval()
    with torch.no_grad():
        model.head.weight.normal_()
    x = torch.randn(2, 3, 16, 16)
    outputs: list[torch.Tensor] = []
    real = fused.dense_into_buffer
    monkeypatch.setattr(fused, "dense_into_buffer", lambda *a: outputs.append(real(*a)) or outputs[-1])
    with torch.inference_mode():
        logits = model(x)
        intermediates = model.forward_intermediates(x)
    qkv = [t for t in outputs if t.shape[-1] == 3 * 32]
    hidden = [t for t in outputs if t.shape[-1] == 64]
    assert len(qkv) == len(hidden) == len(outputs) // 2 > 0
    assert len({t.data_ptr() for t in qkv[: len(qkv) // 2]}) == 1  # one buffer for every block's qkv
    assert len({t.data_ptr() for t in hidden[: len(hidden) // 2]}) == 1
    assert buffers._local.buffers is None  # freed when the forward ends
    # the same numbers as fresh allocations, and no block output aliases a buffer
    outputs.clear()
    with torch.inference_mode(), buffers.plain_inference():
        assert torch.equal(model(x), logits)
        fresh = model.forward_intermediates(x)
    assert len({t.data_ptr() for t in outputs}) == len(outputs)  # every activation its own
    assert len({t.data_ptr() for t in intermediates}) == len(intermediates)
    for kept, expected in zip(intermediates, fresh):
        assert torch.equal(kept, expected)


def test_a_forward_with_autograd_or_autocast_allocates_as_usual():
    from vitlab.models.buffers import plain_inference, reuse_wanted

    x = torch.randn(2, 3)
    with torch.no_grad():
        assert reuse_wanted(x)
        with plain_inference():
            assert not reuse_wanted(x)
        with torch.autocast("cpu", torch.bfloat16):
            assert not reuse_wanted(x)
    assert not reuse_wanted(x)  # a backward may follow


@pytest.mark.parametrize("path", ["bf16", "fp32"])
def test_dense_keeps_its_autocast_weights_between_inference_calls_until_they_change(path):
    from vitlab.models.bf16_matmul import bf16_matmul
    from vitlab.models.buffers import Dense, plain_inference

    torch.manual_seed(0)
    dense = Dense(6, 4)
    x = torch.randn(3, 6)

    def autocast_linear():
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16), bf16_matmul(path):
            return dense(x), torch.nn.functional.linear(x, dense.weight, dense.bias)

    out, expected = autocast_linear()
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    kept = dense._cast[1]
    # the fp32 GEMM's copy holds the bf16 values in fp32, packed for oneDNN at a few rows
    assert kept.dtype == (torch.bfloat16 if path == "bf16" else torch.float32)
    packed = path == "fp32" and torch.backends.mkldnn.is_available()
    assert kept.layout == (torch._mkldnn if packed else torch.strided)
    assert torch.equal((kept.to_dense() if packed else kept).float(),
                       dense.weight.detach().to(torch.bfloat16).float())
    autocast_linear()
    assert dense._cast[1] is kept  # cast once, not per call
    with torch.no_grad():
        dense.weight.add_(1.0)  # an optimiser step changes the weights in place
    out, expected = autocast_linear()
    assert dense._cast[1] is not kept and torch.equal(out, expected)
    dense(x).sum().backward()  # a training forward drops the copy
    assert dense._cast is None
    with torch.no_grad():  # and without autocast there is nothing to keep
        assert torch.equal(dense(x), torch.nn.functional.linear(x, dense.weight, dense.bias))
    assert dense._cast is None
    autocast_linear()
    with plain_inference():  # casts per call, keeps nothing, and drops what it had
        out, expected = autocast_linear()
        assert dense._cast is None and torch.equal(out, expected)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_bf16_inference_by_the_fp32_gemm_packs_its_weights_for_a_first_call_with_few_rows(monkeypatch):
    from vitlab.models import buffers
    from vitlab.models.bf16_matmul import bf16_matmul

    torch.manual_seed(0)
    dense = [buffers.Dense(64, 48), buffers.Dense(64, 48)]
    dense[1].load_state_dict(dense[0].state_dict())
    monkeypatch.setattr(buffers, "PACK_ROWS", 8)
    few, many = torch.randn(2, 4, 64), torch.randn(3, 4, 64)  # 8 and 12 rows

    def infer(layer, x):
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16), bf16_matmul("fp32"):
            return layer(x)

    exact = [(x.to(torch.bfloat16).double() @ dense[0].weight.to(torch.bfloat16).double().t()
              + dense[0].bias.to(torch.bfloat16).double()).to(torch.bfloat16) for x in (few, many)]
    assert torch.equal(infer(dense[0], few), exact[0])  # first call: 8 rows, packed
    assert torch.equal(infer(dense[1], many), exact[1])  # first call: 12 rows, plain
    assert dense[0]._cast[1].layout == torch._mkldnn and dense[1]._cast[1].layout == torch.strided
    # the layout stays for other row counts, and both layouts compute the same products
    for x, expected in zip((few, many), exact):
        assert torch.equal(infer(dense[0], x), expected) and torch.equal(infer(dense[1], x), expected)
    assert dense[0]._cast[1].layout == torch._mkldnn


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
@pytest.mark.parametrize("fields", [dict(), dict(qkv_bias=False, axial=True, classifier="gap",
                                                 posemb="learned_2d")])
def test_packed_weights_give_the_plain_outputs_and_are_freed_at_the_end(fields):
    from vitlab.models import packed_weights, plain_inference
    from vitlab.models.buffers import Dense

    torch.manual_seed(0)
    model = vitlab.create_model(tiny(depth=2, **fields)).eval()
    with torch.no_grad():
        model.head.weight.normal_()
    dense = [m for m in model.modules() if isinstance(m, Dense)]
    x = torch.randn(3, 3, 16, 16)
    with torch.inference_mode():
        expected = model(x)
    with packed_weights(model) as same:
        assert same is model
        with torch.inference_mode():
            torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-6)
        packs = [layer._packed[1] for layer in dense]
        assert all(p.layout == torch._mkldnn for p in packs)  # every dense layer ran packed
        with torch.no_grad():
            torch.testing.assert_close(model(x[:1]), expected[:1], rtol=1e-5, atol=1e-6)  # other rows
            assert all(layer._packed[1] is p for layer, p in zip(dense, packs))  # packed once
            dense[0].weight.mul_(0.5)  # changed parameters are packed again
            changed = model(x)
            assert dense[0]._packed[1] is not packs[0]
        with plain_inference(), torch.no_grad():
            torch.testing.assert_close(model(x), changed, rtol=1e-5, atol=1e-6)
        # a training forward inside the block is plain autograd
        model(x).sum().backward()
        grads = [layer.weight.grad.clone() for layer in dense]
    model.zero_grad()
    model(x).sum().backward()
    for grad, layer in zip(grads, dense):
        torch.testing.assert_close(grad, layer.weight.grad)
    assert all(layer._packed is None and not layer._packing for layer in dense)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_a_model_holding_cast_or_packed_weights_can_be_copied_and_saved():
    from vitlab.models import packed_weights
    from vitlab.models.bf16_matmul import bf16_matmul
    from vitlab.models.buffers import Dense

    torch.manual_seed(0)
    model = vitlab.create_model(tiny(depth=1)).eval()
    with torch.no_grad():
        model.head.weight.normal_()
    x = torch.randn(2, 3, 16, 16)

    def bf16_logits(m):
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16), bf16_matmul("fp32"):
            return m(x)

    expected = bf16_logits(model)
    assert all(m._cast is not None for m in model.modules() if isinstance(m, Dense))  # held, packed
    with packed_weights(model):
        with torch.no_grad():
            fp32_expected = model(x)
        for copied in (copy.deepcopy(model), _saved_and_loaded(model)):
            layers = [m for m in copied.modules() if isinstance(m, Dense)]
            assert all(m._cast is None and m._packed is None and not m._packing for m in layers)
            assert torch.equal(bf16_logits(copied), expected)
            with torch.no_grad():
                torch.testing.assert_close(copied(x), fp32_expected, rtol=1e-5, atol=1e-6)


def _saved_and_loaded(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_packed_weights_refuse_a_model_without_dense_layers():
    from vitlab.models import packed_weights

    with pytest.raises(ValueError, match="no vitlab Dense layers"):
        with packed_weights(nn.Sequential(nn.Linear(2, 2))):
            pass
