"""Tests for vitlab.models.resnet: SAME padding, weight standardisation, both ResNets."""
import math
import re

import pytest
import torch
import torch.nn.functional as F

from vitlab.config import ConfigError, ResNetConfig
from vitlab.models.resnet import (BiTResNet, Conv2dSame, ResNetFeatures, StdConv2d, conv2d_same, max_pool_same,
                                  pad_same, same_padding)

TINY = ResNetConfig(layers=(1, 1), num_classes=5, img_size=32)


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# (size, kernel, stride) -> (before, after), worked out by hand from TensorFlow's rule
# total = max((ceil(size / stride) - 1) * stride + kernel - size, 0), extra pixel after.
@pytest.mark.parametrize(
    "size, kernel, stride, expected",
    [
        (5, 3, 1, (1, 1)),
        (6, 3, 1, (1, 1)),
        (5, 3, 2, (1, 1)),  # out 3: 2*2 + 3 - 5 = 2
        (6, 3, 2, (0, 1)),  # out 3: 2*2 + 3 - 6 = 1, asymmetric
        (224, 7, 2, (2, 3)),  # the root conv at 224: 111*2 + 7 - 224 = 5
        (112, 3, 2, (0, 1)),  # the root max-pool at 224
        (7, 1, 2, (0, 0)),
    ],
)
def test_same_padding_matches_tensorflow_rule(size, kernel, stride, expected):
    assert same_padding(size, kernel, stride) == expected


@pytest.mark.parametrize("stride, pads", [(1, (1, 1, 1, 1)), (2, (0, 1, 1, 1))])
def test_same_conv_equals_explicit_pad_then_valid_conv(stride, pads):
    torch.manual_seed(0)
    conv = StdConv2d(2, 3, 3, stride, padding="same")
    x = torch.randn(1, 2, 5, 6)  # odd height, even width
    # F.pad order is (left, right, top, bottom); pads above come from the table in the test above
    expected = F.conv2d(F.pad(x, pads), conv.standardized_weight(), stride=stride)
    out = conv(x)
    assert out.shape == (1, 3, -(-5 // stride), -(-6 // stride))
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("kernel", [1, 3, 7])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("size", [(4, 4), (5, 8), (9, 7)])
def test_conv2d_same_shortcuts_equal_pad_then_valid_conv(kernel, stride, size):
    # conv2d_same slices before 1x1 convs and hands symmetric pads to the conv; the result
    # must equal the plain definition: pad by TensorFlow's rule, then a VALID convolution
    torch.manual_seed(0)
    x = torch.randn(2, 3, *size, dtype=torch.double, requires_grad=True)
    w = torch.randn(4, 3, kernel, kernel, dtype=torch.double, requires_grad=True)
    top, bottom = same_padding(size[0], kernel, stride)
    left, right = same_padding(size[1], kernel, stride)
    expected = F.conv2d(F.pad(x, (left, right, top, bottom)), w, stride=stride)
    out = conv2d_same(x, w, None, (stride, stride))
    torch.testing.assert_close(out, expected)
    g = torch.randn_like(out)  # the gradients too: the slicing route must scatter them back
    grads = torch.autograd.grad(out, (x, w), g)
    torch.testing.assert_close(grads, torch.autograd.grad(expected, (x, w), g))


def test_batch_norm_variant_swaps_norm_and_drops_standardisation():
    cfg = ResNetConfig(layers=(1, 1), img_size=32, norm="batch")
    stem = ResNetFeatures(cfg)
    convs = [m for m in stem.modules() if isinstance(m, torch.nn.Conv2d)]
    norms = [m for m in stem.modules() if isinstance(m, (torch.nn.GroupNorm, torch.nn.BatchNorm2d))]
    assert convs and all(type(m) is Conv2dSame for m in convs)
    assert norms and all(isinstance(m, torch.nn.BatchNorm2d) for m in norms)
    # same parameter count and names as the GroupNorm stem (norms have weight and bias either way)
    group = ResNetFeatures(ResNetConfig(layers=(1, 1), img_size=32))
    assert [k for k, _ in stem.named_parameters()] == [k for k, _ in group.named_parameters()]
    stem.train()
    y = stem(torch.randn(4, 3, 32, 32))
    assert y.shape == (4, cfg.out_channels, 32 // cfg.reduction, 32 // cfg.reduction)
    assert stem.gn_root.num_batches_tracked.item() == 1  # batch statistics were used and tracked
    with pytest.raises(ConfigError, match="norm"):
        ResNetConfig(norm="layer")


def test_symmetric_padding_is_pytorch_k_over_2():
    conv = StdConv2d(2, 3, 3, 2, padding="symmetric")
    x = torch.randn(1, 2, 6, 6)
    torch.testing.assert_close(conv(x), F.conv2d(x, conv.standardized_weight(), stride=2, padding=1))


@pytest.mark.parametrize("inside", [False, True])
def test_weight_standardisation_formula(inside):
    eps = 1e-5
    conv = StdConv2d(4, 3, 3, eps=eps, eps_inside_sqrt=inside)
    with torch.no_grad():  # a small kernel makes the place of eps visible
        conv.weight.copy_(torch.randn_like(conv.weight) * 1e-4 + 3e-4)
    w = conv.standardized_weight().double()
    raw = conv.weight.double().flatten(1)
    std = raw.std(dim=1, correction=0)
    expected = torch.sqrt(std**2 / (std**2 + eps)) if inside else std / (std + eps)
    torch.testing.assert_close(w.flatten(1).mean(dim=1), torch.zeros(3, dtype=torch.double), atol=1e-6, rtol=0)
    torch.testing.assert_close(w.flatten(1).std(dim=1, correction=0), expected, atol=1e-5, rtol=1e-5)
    # the two forms really differ at this scale (std 1e-4: ~0.91 vs ~0.03)
    assert (expected < 0.5).all() if inside else (expected > 0.85).all()


def test_hybrid_stem_parameter_count():
    stem = ResNetFeatures(ResNetConfig(layers=(3, 4, 9)))

    def unit(cin: int, f: int, proj: bool) -> int:  # convs have no bias; each GN has 2f or 8f
        return cin * f + 9 * f * f + 4 * f * f + 2 * f + 2 * f + 8 * f + (cin * 4 * f + 8 * f if proj else 0)

    formula, cin = 3 * 64 * 49 + 2 * 64, 64
    for i, units in enumerate((3, 4, 9)):
        for u in range(units):
            formula += unit(cin, 64 * 2**i, u == 0)
            cin = 4 * 64 * 2**i
    # R50+ViT-B/16 = ViT-B/16 with its 16x16x3 patch embedding swapped for a 1x1x1024 one
    vit_b16, hybrid = 86_567_656, 98_659_112
    from_totals = hybrid - (vit_b16 - (768 * 3 * 16 * 16 + 768) + (1024 * 768 + 768))
    assert formula == from_totals == 11_894_848
    assert n_params(stem) == formula
    assert stem.out_channels == 1024 and stem.reduction == 16


def test_bit_r50x1_parameter_count():
    # BiT-M R50x1 with a 1000-class head (timm resnetv2_50x1_bit, big_transfer BiT-M-R50x1)
    assert n_params(BiTResNet(ResNetConfig(layers=(3, 4, 6, 3)))) == 25_549_352


def test_hybrid_stem_keys_map_onto_official_npz_names():
    stem = ResNetFeatures(ResNetConfig(layers=(2, 1)))
    rule = re.compile(r"stages\.(\d+)\.units\.(\d+)\.(conv[123]|conv_proj|gn[123]|gn_proj)\.(weight|bias)")
    official = set()
    for key in stem.state_dict():
        m = rule.fullmatch(key)
        if m:
            s, u, name, kind = m.groups()
            leaf = "kernel" if name.startswith("conv") else {"weight": "scale", "bias": "bias"}[kind]
            official.add(f"block{int(s) + 1}/unit{int(u) + 1}/{name}/{leaf}")
        else:
            assert key in {"conv_root.weight", "gn_root.weight", "gn_root.bias"}, key
    assert "block1/unit1/conv_proj/kernel" in official  # 64 -> 256 channels needs a projection
    assert "block1/unit2/conv_proj/kernel" not in official
    assert "block2/unit1/gn_proj/scale" in official  # stride 2
    assert all(not k.endswith("conv1/bias") for k in official)  # StdConv has no bias


def test_hybrid_gn3_starts_at_zero():
    stem = ResNetFeatures(TINY)
    for stage in stem.stages:
        for unit in stage.units:
            assert torch.count_nonzero(unit.gn3.weight) == 0
            assert torch.all(unit.gn1.weight == 1)


@pytest.mark.parametrize("padding", ["same", "symmetric"])
def test_features_output_size_rounds_up(padding):
    stem = ResNetFeatures(ResNetConfig(layers=(1, 1), padding=padding)).eval()
    with torch.no_grad():
        out = stem(torch.randn(1, 3, 37, 30))
    assert stem.reduction == 8
    assert out.shape == (1, 512, 5, 4)  # ceil(37/8), ceil(30/8)


def _randomise_norms(model: torch.nn.Module) -> None:
    # gn3 starts at zero, which would give the branch before it exactly zero gradient
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.GroupNorm):
                m.weight.normal_(1.0, 0.2)


def test_features_forward_backward_reaches_every_parameter():
    torch.manual_seed(0)
    stem = ResNetFeatures(TINY)
    _randomise_norms(stem)
    out = stem(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, stem.out_channels, 4, 4)
    out.square().mean().backward()
    for name, p in stem.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_bit_forward_api_and_gradients():
    torch.manual_seed(0)
    model = BiTResNet(TINY)
    x = torch.randn(2, 3, 32, 32)
    logits = model(x)
    assert logits.shape == (2, 5) and torch.count_nonzero(logits) == 0  # zero head
    feats = model.forward_features(x)
    assert feats.shape == (2, 512, 4, 4) and (feats >= 0).all()  # after GN + ReLU
    torch.testing.assert_close(model.forward_head(feats, pre_logits=True), feats.mean(dim=(2, 3)))

    with torch.no_grad():
        model.head.conv.weight.normal_()
    model(x).square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_bit_names_images_it_cannot_read_as_the_vit_does():
    # torch's messages: "expected scalar type Byte but found Float" for uint8 images, the root's conv for float64
    model = BiTResNet(TINY)
    with pytest.raises(ValueError, match=r"^expected floating-point images \(pixels scaled to \[-1, 1\]"):
        model(torch.zeros(1, 3, 32, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"^expected images of the model's dtype torch.float32 .*, got torch.float64"):
        model(torch.zeros(1, 3, 32, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^expected images of shape \(B, 3, H, W\), got \(1, 1, 32, 32\)$"):
        model(torch.zeros(1, 1, 32, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts a float32 input
        assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 5)


def test_bit_names_and_classifier_reset():
    model = BiTResNet(TINY)
    keys = set(model.state_dict())
    for key in ("root.conv.weight", "body.block1.unit01.gn1.weight", "body.block1.unit01.downsample.weight",
                "body.block2.unit01.conv2.weight", "before_head.gn.bias", "head.conv.weight", "head.conv.bias"):
        assert key in keys, key
    model.reset_classifier(3)
    x = torch.randn(1, 3, 32, 32)
    assert model(x).shape == (1, 3) and torch.count_nonzero(model.head.conv.weight) == 0
    model.reset_classifier(0)
    assert model(x).shape == (1, 512)
    headless = BiTResNet(ResNetConfig(layers=(1, 1), num_classes=0))
    assert headless(x).shape == (1, 512)


@pytest.mark.parametrize("kernel, stride, pool, reduction", [(7, 2, True, 8), (3, 1, True, 4), (3, 1, False, 2), (5, 2, False, 4)])
def test_root_options_set_the_reduction(kernel, stride, pool, reduction):
    cfg = ResNetConfig(layers=(1, 1), root_kernel=kernel, root_stride=stride, root_pool=pool)
    assert cfg.reduction == reduction
    stem = ResNetFeatures(cfg).eval()
    assert stem.conv_root.kernel_size == (kernel, kernel) and stem.conv_root.stride == (stride, stride)
    with torch.no_grad():
        out = stem(torch.randn(1, 3, 33, 30))
    assert out.shape[-2:] == (-(-33 // reduction), -(-30 // reduction))
    bit = BiTResNet(ResNetConfig(layers=(1, 1), num_classes=5, root_kernel=kernel, root_stride=stride, root_pool=pool))
    assert ("pool" in dict(bit.root.named_children())) == pool


@pytest.mark.parametrize("field, value", [("root_kernel", 4), ("root_kernel", 0), ("root_stride", 3), ("root_pool", 1)])
def test_root_options_refuse_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        ResNetConfig(**{field: value})


@pytest.mark.parametrize("size", [(16, 16), (17, 17), (8, 9), (5, 4), (2, 3), (1, 1)])
@pytest.mark.parametrize("kernel, stride", [(3, 2), (3, 1), (2, 2), (5, 3)])
def test_max_pool_same_equals_minus_inf_pad_then_valid_pool(size, kernel, stride):
    # negative inputs (a zero pad would win the max where -inf must not), and ties (after a
    # ReLU: the gradient must go to the same element of each window)
    x = torch.randn(2, 4, *size, dtype=torch.float64)
    x[:, 2:] = x[:, 2:].clamp(min=0)
    x.requires_grad_(True)
    reference = F.max_pool2d(pad_same(x, (kernel, kernel), (stride, stride), value=-math.inf), kernel, stride)
    out = max_pool_same(x, kernel, stride)
    assert out.shape == reference.shape == (2, 4, -(-size[0] // stride), -(-size[1] // stride))
    assert torch.equal(out, reference)
    g = torch.randn_like(out)
    assert torch.equal(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(reference, x, g)[0])


def test_max_pool_same_returns_its_inputs_layout():
    x = torch.randn(2, 8, 16, 16)
    nchw = max_pool_same(x, 3, 2)
    channels_last = max_pool_same(x.contiguous(memory_format=torch.channels_last), 3, 2)
    assert nchw.is_contiguous()
    assert channels_last.is_contiguous(memory_format=torch.channels_last) and not channels_last.is_contiguous()
    assert torch.equal(nchw, channels_last)


@pytest.mark.parametrize("padding", ["symmetric", "same"])
def test_torch_fx_symbolic_trace_of_a_bit_resnet_gives_its_values(padding):
    """Tracing ended in the input check ('symbolically traced variables cannot be used as inputs to
    control flow'): a Proxy's shape cannot be compared.  SAME padding, computed from the input's size,
    stopped it at its branches on that size: each of its convolutions is one call in the graph."""
    torch.manual_seed(0)
    model = BiTResNet(ResNetConfig(layers=(1, 1), num_classes=4, img_size=32, padding=padding)).eval()
    _randomise_norms(model)
    with torch.no_grad():
        model.head.conv.weight.normal_()
    x = torch.randn(2, 3, 32, 32)
    graph = torch.fx.symbolic_trace(model)
    torch.testing.assert_close(graph(x), model(x))


@pytest.mark.parametrize("padding", ["same", "symmetric"])
def test_torch_jit_trace_of_the_stem_gives_its_values(padding):
    """With SAME padding (the hybrids') tracing ended in max_pool2d's "argument 'ceil_mode' must be
    bool, not Tensor": the sizes the padding is computed from are tensors under torch.jit.trace."""
    torch.manual_seed(0)
    model = ResNetFeatures(ResNetConfig(layers=(1,), img_size=16, padding=padding)).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(torch.jit.trace(model, x)(x), model(x))


@pytest.mark.parametrize("padding", ["same", "symmetric"])
def test_hybrid_root_pools_before_the_relu_with_the_same_result(padding):
    # ResNetFeatures applies the root ReLU after the max-pool; the official order is ReLU
    # then pool: values and gradients must agree exactly
    torch.manual_seed(0)
    model = ResNetFeatures(ResNetConfig(layers=(1,), img_size=16, padding=padding)).double()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64, requires_grad=True)

    def official_order(x):
        y = F.relu(model.gn_root(model.conv_root(x)))
        y = max_pool_same(y, 3, 2) if padding == "same" else F.max_pool2d(y, 3, 2, padding=1)
        for stage in model.stages:
            y = stage(y)
        return y

    out, reference = model(x), official_order(x)
    torch.testing.assert_close(out, reference, rtol=0, atol=0)
    g = torch.randn_like(out)
    params = [x, model.conv_root.weight, model.gn_root.weight]
    for a, b in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(reference, params, g)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
