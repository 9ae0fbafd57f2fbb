"""The analytic FLOP counter against torch's FlopCounterMode, and the paper's figures."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from vitlab.analysis.cost import (core_days, count_flops, flops_breakdown, model_flops, resnet_layers,
                                  training_flops)
from vitlab.config import ResNetConfig, ViTConfig
from vitlab.models.registry import build_model, get_config, list_models

TINY = dict(width=32, depth=2, mlp_dim=64, num_heads=4, num_classes=7, img_size=32, patch_size=8)
STEM = ResNetConfig(layers=(1, 1), width_factor=1)  # 64/128-wide stages, /8

CASES = {
    "token": ViTConfig(**TINY),
    "gap": ViTConfig(**TINY, classifier="gap"),
    "pre_logits": ViTConfig(**TINY, representation_size=24),
    "no_head": ViTConfig(**{**TINY, "num_classes": 0}),
    "posemb_none": ViTConfig(**TINY, posemb="none"),
    "posemb_2d_every_layer": ViTConfig(**TINY, posemb="learned_2d", posemb_place="every_layer"),
    "posemb_relative": ViTConfig(**TINY, posemb="relative"),
    "rect_patches": ViTConfig(**{**TINY, "img_size": (32, 48), "patch_size": (8, 4)}),
    "hybrid": ViTConfig(**{**TINY, "patch_size": 1}, resnet=STEM),
    "hybrid_odd_size": ViTConfig(**{**TINY, "patch_size": 1, "img_size": 36}, resnet=STEM),
    "axial": ViTConfig(**TINY, axial=True, classifier="gap", posemb="learned_2d"),
    "bit": ResNetConfig(layers=(1, 1, 1, 1), num_classes=5, img_size=40),
    "bit_symmetric": ResNetConfig(layers=(2, 1), num_classes=5, img_size=33, padding="symmetric"),
    "hybrid_small_root": ViTConfig(**{**TINY, "patch_size": 2},
                                   resnet=ResNetConfig(layers=(1,), root_kernel=3, root_stride=1)),
    "bit_no_pool": ResNetConfig(layers=(1, 1), num_classes=5, img_size=33, root_kernel=3, root_pool=False),
}


def _images(cfg, size=None):
    h, w = size or cfg.img_size
    return torch.randn(2, cfg.in_chans, h, w)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_flop_counter(name):
    """Equal to the FLOP: FlopCounterMode counts the same ops (matmuls and convs)."""
    cfg = CASES[name]
    model = build_model(cfg).eval()
    with torch.no_grad():
        measured = count_flops(model, _images(cfg))
    assert measured == 2 * model_flops(cfg)  # batch of 2


def test_math_attention_is_counted_alike():
    """The unfused attention (bmm, softmax, bmm), which FlopCounterMode knows, agrees."""
    cfg = CASES["posemb_relative"]
    model = build_model(cfg).eval()
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(_images(cfg))
    assert counter.get_total_flops() == 2 * model_flops(cfg)


def test_cpu_sdpa_is_invisible_to_plain_flop_counter():
    """Why count_flops exists: torch's counter has no formula for the CPU SDPA kernel.

    If this starts failing, torch has learned to count it and the mapping can go.
    """
    cfg = CASES["token"]
    model = build_model(cfg).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(_images(cfg))
    attention = 2 * flops_breakdown(cfg)["attention"]
    assert counter.get_total_flops() == 2 * model_flops(cfg) - attention


@pytest.mark.parametrize("name", ["token", "posemb_relative", "hybrid", "axial"])
def test_other_resolution(name):
    from vitlab.config import replace

    cfg = replace(CASES[name], dynamic_img_size=True)
    model = build_model(cfg).eval()
    with torch.no_grad():
        measured = count_flops(model, _images(cfg, (48, 64)))
    assert measured == 2 * model_flops(cfg, (48, 64))


@pytest.mark.parametrize("rate", [0.25, 0.5, 0.9])
def test_a_training_step_with_patch_dropout_counts_the_kept_patches(rate):
    """``training=True``: the forward of a training step, whose encoder sees the kept patches only
    (the summary's MFU reads it); evaluation, and the default, count every patch."""
    cfg = ViTConfig(**{**TINY, "patch_size": 4}, attn_bias="distance_no_self", patch_dropout=rate)
    model = build_model(cfg)
    with torch.no_grad():
        assert count_flops(model.train(), _images(cfg)) == 2 * model_flops(cfg, training=True)
        assert count_flops(model.eval(), _images(cfg)) == 2 * model_flops(cfg)
    assert model_flops(cfg, training=True) < model_flops(cfg) == model_flops(cfg, training=False)


def test_a_training_run_with_patch_dropout_costs_its_kept_patches():
    # training_flops counted every patch, as evaluation sees them: a run dropping half of each image's
    # patches (as the summary's MFU counts it) was put at nearly twice its compute
    cfg = ViTConfig(**{**TINY, "patch_size": 4}, patch_dropout=0.5)
    assert training_flops(cfg, steps=10, batch=8) == 3 * model_flops(cfg, training=True) * 10 * 8 / 1e18
    assert model_flops(cfg, training=True) < 0.6 * model_flops(cfg)


def test_backward_is_about_twice_forward():
    cfg = CASES["token"]
    model = build_model(cfg)
    total = count_flops(model, _images(cfg), backward=True)
    # 3x, except: the patch embedding's input needs no gradient (one conv fewer), and
    # the fused attention's backward recomputes Q K^T (5 products instead of 4)
    parts = {k: 2 * v for k, v in flops_breakdown(cfg).items()}  # batch of 2
    assert total == 3 * sum(parts.values()) - parts["patch_embed"] + parts["attention"] // 2


def test_vit_b16_reference_figures():
    cfg = get_config("ViT-B/16")
    assert model_flops(cfg) == 35_127_656_448  # 17.56 GMACs, as timm reports
    assert model_flops(cfg, 384) == pytest.approx(2 * 55.5e9, rel=0.01)  # timm: 55.5 GMACs at 384


@pytest.mark.parametrize(
    "name,epochs,exaflops",
    [("ViT-B/16", 7, 224), ("ViT-L/16", 7, 783), ("ViT-L/16", 14, 1567), ("ViT-H/14", 14, 4262),
     ("R50x1+ViT-B/16", 7, 274)],
)
def test_paper_table6_exaflops(name, epochs, exaflops):
    """Paper Table 6: pre-training compute on JFT-300M (303M images) at 224 px."""
    got = training_flops(get_config(name), steps=epochs, batch=303_000_000)
    assert got == pytest.approx(exaflops, rel=0.01)


def _padding_flops(cfg: ResNetConfig, size: int) -> int:
    """The FLOPs of a BiT ResNet's convolutions on its zero padding (k // 2 each side) at ``size`` px, a
    multiple of 32: each window's multiply-adds on positions outside the input, which XLA's cost analysis
    leaves out (HloCostAnalysis::HandleConvolution counts a window's valid positions only)."""
    def inside(n: int, out: int, k: int, stride: int) -> int:  # window positions on the input, one dimension
        return sum(0 <= o * stride - k // 2 + j < n for o in range(out) for j in range(k))

    padding, (h, w) = 0, (size, size)
    for layer in resnet_layers(cfg, size, size):
        if layer.kind == "conv" and layer.kernel > 1:  # the root's 7x7 and the units' 3x3s (1x1s have none)
            k, stride = layer.kernel, h // layer.out_h
            every = layer.out_h * layer.out_w * k * k
            padding += 2 * layer.cin * layer.cout * (every - inside(h, layer.out_h, k, stride)
                                                     * inside(w, layer.out_w, k, stride))
        h, w = layer.out_h, layer.out_w
    return padding


@pytest.mark.parametrize("name,epochs,exaflops", [
    ("BiT-R50x1", 7, 50), ("BiT-R50x2", 7, 199), ("BiT-R101x1", 7, 96), ("BiT-R152x1", 7, 141),
    ("BiT-R152x2", 7, 563), ("BiT-R152x2", 14, 1126), ("BiT-R200x3", 14, 3306)])
def test_paper_table6_bit_rows_leave_out_the_zero_padding(name, epochs, exaflops):
    """Table 6's ResNets are 3-4% below vitlab's count, which counts every multiply-add of a convolution
    as torch's FlopCounterMode does: the paper's leave out those on the zero padding (docs/models.md)."""
    cfg = get_config(name)
    got = training_flops(cfg, steps=epochs, batch=303_000_000)
    assert 1.03 < got / exaflops < 1.045
    unpadded = 3 * (model_flops(cfg) - _padding_flops(cfg, 224)) * epochs * 303_000_000 / 1e18
    assert unpadded == pytest.approx(exaflops, rel=0.01)


def test_core_days_reproduces_table2_utilisation():
    days = core_days(training_flops(get_config("ViT-H/14"), 14, 303_000_000), utilization=0.32)
    assert days == pytest.approx(2500, rel=0.02)  # paper Table 2: 2.5k TPUv3-core-days


def test_every_registered_model_has_a_count():
    for name in list_models():
        assert model_flops(get_config(name)) > 0
        assert model_flops(get_config(name), 320) > model_flops(get_config(name))


def test_saved_for_backward_counts_activation_storages_once_and_no_parameters():
    from vitlab.analysis.cost import SavedForBackward

    dense = torch.nn.Linear(8, 16)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedForBackward(dense) as kept:
        h = dense(x)           # keeps x (its weight is a parameter: not counted)
        out = torch.tanh(h)    # keeps its output
        loss = (out * out[:, :1]).sum()  # keeps out and a view of it: one storage
    assert kept.bytes == (4 * 8 + 4 * 16) * 4
    loss.backward()


def test_the_flops_command_refuses_sizes_and_counts_the_model_cannot_take(capsys):
    from vitlab.cli import main

    assert main(["flops", "ViT-B/16", "--img-size", "384"]) == 0
    assert capsys.readouterr().out.startswith("ViT-B/16 at 384x384")
    for extra, message in ((["--img-size", "225"], "img_size=(225, 225): the image (225x225) is not divisible by "
                                                   "patch_size=(16, 16) along height; allowed: a multiple of 16, "
                                                   "such as 224, 240"),
                           (["--batch", "0", "--steps", "10"], "--batch 0: must be a positive integer"),
                           # these came after the forward FLOPs were printed: half a report beside the error
                           (["--batch", "10"], "--batch and --steps go together: the cost of a run is steps x "
                                               "batch images"),
                           (["--batch", "10", "--steps", "10", "--utilization", "2"],
                            "--utilization 2: must be a fraction of the peak in (0, 1], e.g. 0.3"),
                           # without --batch and --steps these were taken without a word
                           (["--utilization", "0"], "--utilization 0: must be a fraction of the peak in (0, 1], "
                                                    "e.g. 0.3"),
                           (["--utilization", "nan"], "--utilization nan: must be a fraction of the peak in (0, 1], "
                                                      "e.g. 0.3")):
        assert main(["flops", "ViT-B/16", *extra]) == 2
        captured = capsys.readouterr()
        assert captured.err.strip() == f"vitlab flops: error: {message}" and captured.out == ""
    # a size that is none of the forms is argparse's refusal of the flag, as every command's --img-size
    with pytest.raises(SystemExit) as stopped:
        main(["flops", "ViT-B/16", "--img-size", "0"])
    captured = capsys.readouterr()
    assert stopped.value.code == 2 and captured.out == ""
    assert captured.err.strip().splitlines()[-1] == ("vitlab flops: error: argument --img-size: '0': expected a "
                                                     "positive size N or HxW, e.g. 384 or 384x512 (see vitlab flops --help)")


def test_the_flops_command_prints_a_small_run_and_a_utilization_as_they_are(capsys):
    """The run's figures were printed to fixed decimals: a run of this library's size (the README's
    experiments spend 1e-5 exaFLOPs) read "0.00 exaFLOPs" and "0.0 TPUv3-core-days", and
    --utilization 0.325 read "at 32%"."""
    from vitlab.cli import main

    assert main(["flops", "ViT-Ti/16", "--batch", "128", "--steps", "1000", "--utilization", "0.325"]) == 0
    lines = capsys.readouterr().out.splitlines()
    exa = training_flops(get_config("ViT-Ti/16"), 1000, 128)
    days = core_days(exa, utilization=0.325)
    assert exa < 0.005 and days < 0.05  # what fixed decimals showed as zero
    assert float(lines[-2].split()[0]) == pytest.approx(exa, rel=0.01) and lines[-2].endswith(" exaFLOPs")
    assert float(lines[-1].split()[0]) == pytest.approx(days, rel=0.01)
    assert " at 32.5% of the 61.5 TFLOP/s bf16 peak per core" in lines[-1]
    # a paper-size run keeps its figures
    assert main(["flops", "ViT-H/14", "--batch", "303000000", "--steps", "14", "--utilization", "0.32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert float(lines[-2].split()[0]) == pytest.approx(4262, rel=0.01)
    assert float(lines[-1].split()[0]) == pytest.approx(2500, rel=0.02)


def test_counting_a_backward_gives_the_caller_its_gradients_back():
    """count_flops(backward=True) between a caller's training steps left the count's gradients
    added into the model's: an optimiser step after it moved the weights by them."""
    model = build_model(ViTConfig(img_size=16, patch_size=4, width=32, depth=1, mlp_dim=64, num_heads=2,
                                  num_classes=3))
    x = torch.randn(2, 3, 16, 16)
    model(x).sum().backward()
    accumulated = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.head.bias.grad = None  # one parameter without a gradient, which stays without
    assert count_flops(model, x, backward=True) > 0
    assert model.head.bias.grad is None
    for name, p in model.named_parameters():
        if name != "head.bias":
            assert torch.equal(p.grad, accumulated[name]), name


def test_counting_a_backward_leaves_the_inputs_gradients_and_runs_under_no_grad_too():
    # the backward added into the gradient of an input that requires one (the caller's tensor), and
    # under torch.no_grad it ended in torch's "element 0 of tensors does not require grad"
    model = build_model(CASES["token"])
    x = _images(CASES["token"]).requires_grad_()
    assert count_flops(model, x, backward=True) > 0
    assert x.grad is None
    x = _images(CASES["token"])
    with_grad = count_flops(model, x, backward=True)
    with torch.no_grad():
        assert count_flops(model, x, backward=True) == with_grad
        assert not torch.is_grad_enabled()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("backward", [False, True])
def test_counting_a_training_step_leaves_the_models_statistics_and_the_random_stream(backward):
    # a count in training mode ran a forward like any other: a BatchNorm hybrid's running statistics
    # took the counted batch in (what the model evaluates with after), and dropout drew from the
    # caller's random stream
    cfg = ViTConfig(**{**TINY, "patch_size": 1, "dropout": 0.1}, resnet=ResNetConfig(layers=(1, 1), norm="batch"))
    model = build_model(cfg).train()
    before = {name: b.clone() for name, b in model.named_buffers()}
    x = _images(cfg)
    torch.manual_seed(0)
    expected = torch.rand(4)  # the caller's next draw
    torch.manual_seed(0)
    assert count_flops(model, x, backward=backward) > 0
    assert torch.equal(torch.rand(4), expected)
    for name, b in model.named_buffers():
        assert torch.equal(b, before[name]), name
    assert model.training


@pytest.mark.parametrize("backward", [False, True])
def test_counting_under_a_callers_inference_mode_counts_as_outside_it_and_leaves_the_mode(backward):
    # under torch.inference_mode the counter's module hooks met the forward's tensors without an autograd
    # history and the count ended in an AttributeError from torch's module tracker
    model = build_model(CASES["token"]).train()
    x = _images(CASES["token"])
    expected = count_flops(model, x, backward=backward)
    with torch.inference_mode():
        made_here = _images(CASES["token"])  # an inference tensor, which no backward can save
        assert count_flops(model, x, backward=backward) == expected
        assert count_flops(model, made_here, backward=backward) == expected
        assert torch.is_inference_mode_enabled() and not torch.is_grad_enabled()
    assert all(p.grad is None for p in model.parameters()) and model.training


def test_counting_the_backward_of_a_frozen_model_is_refused_by_name():
    # with no parameter nor input requiring a gradient, torch's "element 0 of tensors does not require
    # grad" came after the forward had run; an input that requires one has a backward to count
    model = build_model(CASES["token"]).requires_grad_(False)
    x = _images(CASES["token"])
    with pytest.raises(ValueError, match=r"^backward=True: nothing requires a gradient \(every parameter"):
        count_flops(model, x, backward=True)
    assert count_flops(model, x.clone().requires_grad_(), backward=True) > count_flops(model, x)
    assert not any(p.requires_grad for p in model.parameters())
