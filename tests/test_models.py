"""The model package: registry, parameter counts, position embeddings, attention capture."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import vitlab
from vitlab.config import ConfigError, ViTConfig, replace
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


def test_what_is_not_a_config_is_refused_by_name():
    """A name where a config goes (count_parameters, model_flops) or neither (create_model) was
    "AttributeError: 'str' object has no attribute 'axial'"."""
    from vitlab.analysis.cost import model_flops

    for wrong in (None, 16, {"width": 32}):
        with pytest.raises(ConfigError, match=r"^name_or_config=.*: expected a registry name such as 'ViT-B/16', "
                                              rf"a ViTConfig or a ResNetConfig .*got a {type(wrong).__name__}$"):
            vitlab.create_model(wrong)
    for count in (count_parameters, model_flops):
        with pytest.raises(ConfigError, match=r"^cfg='ViT-B/16': expected a ViTConfig or a ResNetConfig \(vitlab"
                                              r"\.get_config\('ViT-B/16'\) gives one\), got a str$"):
            count("ViT-B/16")


def test_wrong_input_is_a_clear_error():
    model = vitlab.create_model(tiny())
    with pytest.raises(ValueError, match="img_size"):
        model(torch.randn(1, 3, 20, 20))
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        model(torch.randn(1, 1, 16, 16))
    with pytest.raises(ValueError, match=r"expected floating-point images .*, got torch.uint8"):
        model(torch.zeros(1, 3, 16, 16, dtype=torch.uint8))


def test_images_of_another_float_dtype_than_the_model_are_a_clear_error():
    # torch's own message spoke of the patch embedding's bias ("Input type (double) and bias type (float)")
    model = vitlab.create_model(tiny())
    for dtype in (torch.float64, torch.bfloat16):
        with pytest.raises(ValueError, match=rf"^expected images of the model's dtype torch.float32 .*, got {dtype}"):
            model(torch.randn(1, 3, 16, 16, dtype=dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts float32 and half inputs, not float64
        assert model(torch.randn(1, 3, 16, 16)).shape == model(torch.randn(1, 3, 16, 16, dtype=torch.bfloat16)).shape
        with pytest.raises(ValueError, match=r"got torch.float64"):
            model(torch.randn(1, 3, 16, 16, dtype=torch.float64))
    assert model.double()(torch.randn(1, 3, 16, 16, dtype=torch.float64)).dtype == torch.float64


def test_the_image_check_the_models_share_lives_in_a_module_of_its_own():
    # it lived in resnet.py, which a plain ViT had to import it from
    from vitlab.models import inputs, resnet, vit

    assert vit.check_images is resnet.check_images is inputs.check_images
    assert "check_images" not in resnet.__all__
    with pytest.raises(ValueError, match=r"^expected images of shape \(B, 3, H, W\), got \(3, 8, 8\)$"):
        inputs.check_images(torch.zeros(3, 8, 8), 3, torch.float32)


def test_images_that_are_no_tensor_and_a_model_that_is_no_module_are_refused_by_type():
    # a list of images failed on its missing .ndim, an array on .is_floating_point, a name on .modules()
    model = vitlab.create_model(tiny())
    for images in ([torch.zeros(1, 3, 16, 16)], np.zeros((1, 3, 16, 16), np.float32)):
        with pytest.raises(TypeError, match=r"^expected images as a torch.Tensor \(B, 3, H, W\), got a (list|ndarray)$"):
            model(images)
    with pytest.raises(TypeError, match="^capture_attention: model='ViT-B/16': expected a torch.nn.Module"):
        vitlab.capture_attention("ViT-B/16").__enter__()
    with pytest.raises(TypeError, match="^capture_attention: each=3: expected a function of one layer's map, or None"):
        vitlab.capture_attention(model, each=3).__enter__()


def test_non_square_images_and_patches():
    model = vitlab.create_model(tiny(img_size=(16, 24), patch_size=(4, 8)))
    assert model.cfg.grid_size == (4, 3)
    assert model(torch.randn(2, 3, 16, 24)).shape == (2, 5)


@pytest.mark.parametrize("fields", [{}, dict(classifier="gap", img_size=(16, 24)), dict(posemb_place="every_layer"),
                                    dict(posemb="learned_2d", img_size=(16, 24)), dict(dynamic_img_size=True),
                                    dict(axial=True, classifier="gap")])
def test_torch_fx_symbolic_trace_gives_the_models_graph_at_its_img_size(fields):
    """symbolic_trace failed on the input checks ('symbolically traced variables cannot be used as
    inputs to control flow'): it passes a Proxy, whose shape Python cannot compare."""
    model = vitlab.create_model(tiny(**fields)).eval()
    with torch.no_grad():
        model.head.weight.normal_()
    x = torch.randn(3, 3, *model.cfg.img_size)
    graph = torch.fx.symbolic_trace(model)
    torch.testing.assert_close(graph(x), model(x))
    assert any(node.target == "head" for node in graph.graph.nodes)  # its modules are the graph's calls


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
    model(torch.randn(2, 3, 16, 16))
    # after the position embeddings, after the attention output dense, after both MLP denses
    assert calls == ["pos_drop", "blocks.0.attn.proj_drop", "blocks.0.mlp.drop", "blocks.0.mlp.drop"]


def test_capture_attention_matches_the_fused_kernel():
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


def test_a_capture_inside_another_gives_the_outer_one_its_recording_back():
    # the inner block's end set every layer's recording to None: the caller's capture recorded no
    # more after an analysis call (vitlab.analysis.attention.collect_attention) inside it
    model = vitlab.create_model(tiny()).eval()
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad(), vitlab.capture_attention(model) as outer:
        model(x)
        with vitlab.capture_attention(model) as inner:
            model(x)
        model(x)
    assert len(outer) == 4 and len(inner) == 2
    assert all(m.recorded is None for m in model.modules() if isinstance(m, Attention))


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


def test_distance_bias_is_minus_slope_times_patch_distance():
    """A 2x3 grid after one [class] token: every head's bias is -slope x the Euclidean distance
    between the two patches, and 0 to and from [class]."""
    attn = Attention(tiny(img_size=(8, 12), patch_size=4, attn_bias="distance"))
    slopes = attn.distance_bias.log_slope.exp()
    torch.testing.assert_close(slopes, torch.tensor([2.0, 2.0 ** (-1 / 3), 2.0 ** (-5 / 3), 0.125]))
    bias = attn.distance_bias(torch.zeros(1, 4, 7, 8))
    where = [(y, x) for y in range(2) for x in range(3)]
    for i, (yi, xi) in enumerate(where):
        for j, (yj, xj) in enumerate(where):
            expected = -slopes * math.hypot(yi - yj, xi - xj)
            torch.testing.assert_close(bias[0, :, 1 + i, 1 + j], expected)
    assert bias[0, :, 0].abs().sum() == 0 and bias[0, :, :, 0].abs().sum() == 0
    # a square grid of another size (progressive resizing) gets its own distances; others are refused
    assert attn.distance_bias(torch.zeros(1, 4, 1 + 9, 8))[0, 0, 1, 9] == -2.0 * math.hypot(2, 2)
    with pytest.raises(ValueError, match="not the model's grid"):
        attn.distance_bias(torch.zeros(1, 4, 1 + 8, 8))


def test_distance_bias_slopes_learn_and_follow_the_input_size():
    torch.manual_seed(0)
    model = vitlab.create_model(tiny(attn_bias="distance", dynamic_img_size=True))
    with torch.no_grad():  # the zero-initialised head would stop every gradient behind it
        model.head.weight.normal_(std=0.5)
    for size in (16, 12):
        model.zero_grad()
        model(torch.randn(2, 3, size, size)).square().sum().backward()
        first, last = (b.attn.distance_bias.log_slope.grad for b in model.blocks)
        # the last block's patch tokens are never read ([class] is, and it attends without a penalty)
        assert first.abs().min() > 0 and last.abs().max() == 0
    with vitlab.capture_attention(model.eval()) as maps:  # the explicit path adds the same bias
        explicit = model(torch.randn(1, 3, 16, 16))
    assert maps[0].shape == (1, 4, 17, 17) and torch.isfinite(explicit).all()


def test_distance_bias_without_self_masks_each_patch_diagonal_only():
    """attn_bias="distance_no_self": the distance penalty, with -inf where a patch meets itself;
    [class] still attends to itself, and the slopes' gradient stays finite."""
    torch.manual_seed(0)
    cfg = tiny(img_size=(8, 12), patch_size=4, attn_bias="distance_no_self")
    attn = Attention(cfg)
    bias = attn.distance_bias(torch.zeros(1, 4, 7, 8))[0]
    reference = Attention(replace(cfg, attn_bias="distance")).distance_bias(torch.zeros(1, 4, 7, 8))[0]
    masked = torch.zeros(7, 7, dtype=torch.bool)
    masked[range(1, 7), range(1, 7)] = True
    assert torch.isneginf(bias[:, masked]).all() and torch.isfinite(bias[:, ~masked]).all()
    torch.testing.assert_close(bias[:, ~masked], reference[:, ~masked])
    model = vitlab.create_model(replace(cfg, img_size=16))
    with torch.no_grad():
        model.head.weight.normal_(std=0.5)
    model(torch.randn(2, 3, 16, 16)).square().sum().backward()
    grad = model.blocks[0].attn.distance_bias.log_slope.grad
    assert torch.isfinite(grad).all() and grad.abs().min() > 0
    with vitlab.capture_attention(model.eval()) as maps:
        model(torch.randn(1, 3, 16, 16))
    diagonal = maps[0][0].diagonal(dim1=-2, dim2=-1)  # (H, L)
    assert diagonal[:, 1:].abs().max() == 0 and (diagonal[:, 0] > 0).all()


def test_offset_bias_adds_one_learned_value_per_head_and_2d_offset():
    """attn_offsets=True: on top of the distance penalty, each head adds its table's value for the
    offset (dy, dx) between the two patches; zero to and from [class]; a smaller grid (progressive
    resizing) reads the same entries, and a larger one clamps its offsets to the table's edge."""
    cfg = tiny(img_size=(8, 12), patch_size=4, attn_bias="distance", attn_offsets=True)
    attn = Attention(cfg)
    table = attn.distance_bias.offset_bias  # (H, (2*2-1) * (2*3-1)), zero at the start
    assert table.shape == (4, 3 * 5) and table.abs().sum() == 0
    reference = Attention(replace(cfg, attn_offsets=False)).distance_bias
    q = torch.zeros(1, 4, 7, 8)
    torch.testing.assert_close(attn.distance_bias(q), reference(q))  # the same model until it learns
    with torch.no_grad():
        table.copy_(torch.randn_like(table))
    bias = attn.distance_bias(q) - reference(q)
    where = [(y, x) for y in range(2) for x in range(3)]
    for i, (yi, xi) in enumerate(where):
        for j, (yj, xj) in enumerate(where):
            torch.testing.assert_close(bias[0, :, 1 + i, 1 + j], table[:, (yi - yj + 1) * 5 + (xi - xj + 2)])
    assert bias[0, :, 0].abs().sum() == 0 and bias[0, :, :, 0].abs().sum() == 0
    square = Attention(tiny(img_size=12, patch_size=4, attn_bias="distance", attn_offsets=True)).distance_bias
    with torch.no_grad():
        square.offset_bias.copy_(torch.randn_like(square.offset_bias))
    plain = Attention(tiny(img_size=12, patch_size=4, attn_bias="distance")).distance_bias
    small, large = (square(torch.zeros(1, 4, 1 + n * n, 8)) - plain(torch.zeros(1, 4, 1 + n * n, 8)) for n in (2, 5))
    torch.testing.assert_close(small[0, :, 1, 4], square.offset_bias[:, (0 - 1 + 2) * 5 + (0 - 1 + 2)])  # (0,0)-(1,1)
    torch.testing.assert_close(large[0, :, 1, 25], square.offset_bias[:, 0])  # (0,0)-(4,4): clamped to (-2,-2)


def test_offset_bias_learns_and_needs_the_distance_penalty():
    torch.manual_seed(0)
    model = vitlab.create_model(tiny(attn_bias="distance_no_self", attn_offsets=True, dynamic_img_size=True))
    with torch.no_grad():
        model.head.weight.normal_(std=0.5)
    for size in (16, 12):
        model.zero_grad()
        model(torch.randn(2, 3, size, size)).square().sum().backward()
        grad = model.blocks[0].attn.distance_bias.offset_bias.grad
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    with pytest.raises(ConfigError, match="attn_offsets=True"):
        ViTConfig(attn_offsets=True)


@pytest.mark.parametrize("grid_side", [None, 3])
def test_distance_bias_of_kept_patches_is_the_whole_grids_bias_at_their_places(grid_side):
    """``positions`` (patch dropout): for any subset of the patches in any order, the bias among
    [class] and those patches is the whole grid's bias read at their places, on the model's grid
    and on a smaller square one (progressive resizing), -inf self-masks and offsets included."""
    torch.manual_seed(0)
    cfg = tiny(img_size=16, patch_size=4, attn_bias="distance_no_self", attn_offsets=True)
    bias = Attention(cfg).distance_bias
    with torch.no_grad():
        bias.offset_bias.normal_()
        bias.log_slope.add_(torch.randn_like(bias.log_slope))
    side = grid_side or 4
    whole = bias(torch.zeros(1, 4, 1 + side * side, 8))[0]  # (H, L, L)
    kept = torch.stack([torch.randperm(side * side)[:5] for _ in range(3)])  # (B, K): 3 images, 5 patches each
    positions = torch.stack([kept // side, kept % side], dim=-1)
    got = bias(torch.zeros(3, 4, 1 + 5, 8), positions)
    assert got.shape == (3, 4, 6, 6)
    for b in range(3):
        tokens = torch.cat([torch.tensor([0]), 1 + kept[b]])
        expected = whole[:, tokens][:, :, tokens]
        assert torch.equal(torch.isneginf(got[b]), torch.isneginf(expected))
        torch.testing.assert_close(got[b].masked_fill(got[b].isinf(), 0), expected.masked_fill(expected.isinf(), 0))


def test_patch_dropout_with_the_distance_penalty_attends_as_on_the_whole_grid_with_dropped_keys_masked():
    """A training forward with patch dropout gives each kept token what the model without it gives
    that token when the dropped patches are hidden from every attention (their keys at -inf):
    the penalty and the offsets act between the kept patches as at their places on the grid."""
    torch.manual_seed(0)
    cfg = tiny(img_size=16, patch_size=4, attn_bias="distance_no_self", attn_offsets=True, classifier="gap",
               patch_dropout=0.5)
    model = vitlab.create_model(cfg).train()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.distance_bias.offset_bias.normal_()
    x = torch.randn(2, 3, 16, 16)
    tokens, grid, positions = model.embed(x)
    assert tokens.shape == (2, 8, 32) and positions.shape == (2, 8, 2) and grid == (4, 4)
    got = model.run_blocks(tokens, grid, positions=positions)

    twin = vitlab.create_model(replace(cfg, patch_dropout=0.0)).eval()
    twin.load_state_dict(model.state_dict())
    kept = positions[..., 0] * 4 + positions[..., 1]  # (B, K) raster index
    hidden = torch.full((2, 1, 1, 16), float("-inf")).scatter(3, kept[:, None, None, :], 0.0)
    for block in twin.blocks:
        whole = block.attn.distance_bias.forward
        block.attn.distance_bias.forward = lambda q, positions=None, whole=whole: whole(q) + hidden
    full, _, none = twin.embed(x)
    assert none is None
    expected = torch.gather(twin.run_blocks(full, grid), 1, kept[..., None].expand(-1, -1, 32))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    larger = vitlab.create_model(replace(cfg, dynamic_img_size=True)).train()  # its offsets would need a wider table
    with pytest.raises(ValueError, match=r"patch grid \(5, 5\) of a training input is larger than the model's \(4, 4\)"):
        larger(torch.randn(1, 3, 20, 20))
    assert larger(torch.randn(1, 3, 12, 12)).shape == (1, 5)  # a smaller grid (progressive resizing) trains


def test_distance_bias_refuses_an_input_whose_grid_it_cannot_tell_from_its_length():
    """The penalty reads the grid from the sequence length: a 2x8 input of the 4x4 model's 16 patches
    was given the 4x4 grid's distances without a word, and a 3x5 one failed inside the attention."""
    model = vitlab.create_model(tiny(attn_bias="distance", dynamic_img_size=True))  # 16 px, 4 px patches: 4x4
    for size, grid in (((8, 32), r"\(2, 8\)"), ((12, 20), r"\(3, 5\)")):
        with pytest.raises(ValueError, match=rf"^input size \({size[0]}, {size[1]}\): attn_bias='distance' places the "
                                             rf"patches on the model's grid \(4, 4\) or a square one of another size, "
                                             rf"not {grid}$"):
            model(torch.randn(1, 3, *size))
    assert model(torch.randn(1, 3, 12, 12)).shape == (1, 5)  # a square grid of another size has its own distances
    rect = vitlab.create_model(tiny(img_size=(8, 24), attn_bias="distance", dynamic_img_size=True))  # 2x6
    with pytest.raises(ValueError, match=r"not \(6, 2\)$"):  # the model's 12 patches the other way round
        rect(torch.randn(1, 3, 24, 8))
    assert rect(torch.randn(1, 3, 12, 12)).shape == (1, 5)  # 3x3: square, and not the model's 12 patches


@pytest.mark.parametrize("attn_bias", ["distance", "distance_no_self"])
@pytest.mark.parametrize("fields", [dict(posemb="relative"), dict(axial=True, classifier="gap", posemb="learned_2d")])
def test_distance_bias_refuses_what_breaks_its_grid(fields, attn_bias):
    with pytest.raises(ConfigError, match=f"attn_bias='{attn_bias}'"):
        ViTConfig(**{"attn_bias": attn_bias, **fields})


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


@pytest.mark.parametrize("fields", [dict(classifier="gap"), dict(classifier="gap", posemb="none"), dict(classifier="token")])
@pytest.mark.parametrize("autocast", [False, True])
def test_the_token_stream_is_token_major_in_memory_from_the_first_block_to_the_last(fields, autocast):
    """The patch embedding's output enters the blocks contiguous, with or without [class] and
    position embeddings: a transposed view of the convolution's output would carry its
    channel-major strides through every residual sum, and every LayerNorm would copy it."""
    model = vitlab.create_model(tiny(**fields)).train()
    seen = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
    model.norm.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(torch.randn(2, 3, 16, 16)).sum().backward()
    assert seen == [True] * (len(model.blocks) + 1)


def test_two_d_embedding_concatenates_x_and_y():
    model = vitlab.create_model(tiny(posemb="learned_2d", classifier="gap"))
    table = model.pos_embed((4, 4))[0].reshape(4, 4, 32)
    torch.testing.assert_close(table[2, 3, :16], model.pos_embed.x[3])
    torch.testing.assert_close(table[2, 3, 16:], model.pos_embed.y[2])


@pytest.mark.parametrize("old, new", [((7, 7), (12, 12)), ((4, 4), (4, 6)), ((4, 6), (6, 4)), ((5, 3), (8, 9))])
def test_bilinear_resampling_equals_scipy_zoom_order_1(old, new):
    """Non-square grids too, each axis zoomed by its own factor (a fine-tune at HxW)."""
    scipy_ndimage = pytest.importorskip("scipy.ndimage")
    grid = torch.randn(*old, 5, dtype=torch.float64)
    ours = resample_grid(grid, new, "bilinear").numpy()
    reference = scipy_ndimage.zoom(grid.numpy(), (new[0] / old[0], new[1] / old[1], 1), order=1)
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


@pytest.mark.parametrize("kind", ["vit", "axial", "bit"])
def test_reset_classifier_keeps_the_models_dtype_and_config_and_checks_its_argument(tmp_path, kind):
    """The new head was made in torch's default dtype, so a ViT moved by .double() or to bf16 failed
    in its head's matmul; a BiT ResNet's config kept the old class count, so its save_model wrote
    weights load_model refused; reset_classifier(-1) failed in torch.empty, after nothing."""
    from vitlab.config import ResNetConfig

    cfg = (ResNetConfig(layers=(1,), width_factor=0.5, img_size=16, num_classes=3) if kind == "bit"
           else tiny(axial=kind == "axial", classifier="gap" if kind == "axial" else "token"))
    model = vitlab.create_model(cfg).double()
    model.reset_classifier(5)
    assert model(torch.zeros(1, 3, 16, 16, dtype=torch.float64)).dtype == torch.float64
    assert model.cfg.num_classes == 5
    assert vitlab.load_model(vitlab.save_model(model.float(), tmp_path / "m")).cfg.num_classes == 5
    for wrong in (-1, 2.5, "3"):
        with pytest.raises(ConfigError, match=rf"^num_classes={wrong!r}: must be an integer >= 0"):
            model.reset_classifier(wrong)
    assert model.cfg.num_classes == 5 and model(torch.zeros(1, 3, 16, 16)).shape == (1, 5)


def test_patch_dropout_trains_on_a_subset_of_the_same_tokens():
    """In training the encoder sees prefix + round(N * (1 - rate)) tokens, each an unchanged
    embedded patch; in evaluation the model equals one without patch dropout."""
    torch.manual_seed(0)
    cfg = ViTConfig(img_size=32, patch_size=4, width=32, depth=1, mlp_dim=64, num_heads=2, num_classes=3,
                    patch_dropout=0.25)
    model = vitlab.create_model(cfg)
    x = torch.randn(3, 3, 32, 32)
    model.eval()
    full, _, everywhere = model.embed(x)
    model.train()
    kept, _, positions = model.embed(x)
    assert everywhere is None and positions.shape == (3, 48, 2)
    assert kept.shape == (3, 1 + 48, 32)
    assert torch.equal(kept[:, 0], full[:, 0])  # the [class] token always stays
    for b in range(3):  # every kept token is one of this image's own patch tokens, none twice
        match = (kept[b, 1:, None, :] == full[b, None, 1:, :]).all(-1)
        assert match.sum(1).eq(1).all() and match.sum(0).le(1).all()
        assert torch.equal(match.float().argmax(1), positions[b, :, 0] * 8 + positions[b, :, 1])  # its place
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
