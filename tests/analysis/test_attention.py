"""Attention analysis: known answers on hand-built matrices, then smoke runs on tiny models."""
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import vitlab

from vitlab.analysis.attention import (
    attention_rollout,
    collect_attention,
    effective_patch_size,
    mean_attention_distance,
    model_attention_distance,
    model_raw_attention,
    model_rollout,
    patch_distances,
    token_to_grid,
    upsample_maps,
)
from vitlab.config import ResNetConfig, ViTConfig
from vitlab.models import create_model

TINY = ViTConfig(img_size=(16, 24), patch_size=8, width=32, depth=3, mlp_dim=64, num_heads=2, num_classes=4)


def test_identity_attention_rolls_out_to_identity():
    L = 5
    attn = np.broadcast_to(np.eye(L), (4, 2, 3, L, L))  # 4 layers, 2 images, 3 heads
    np.testing.assert_allclose(attention_rollout(attn), np.broadcast_to(np.eye(L), (2, L, L)))


def test_rollout_of_one_layer_and_two_layers_by_hand():
    a = np.array([[0.5, 0.5], [0.0, 1.0]])
    # one layer: (a + I) / 2 (rows of a sum to 1, so rows of a + I sum to 2)
    one = (a + np.eye(2)) / 2
    np.testing.assert_allclose(attention_rollout(a[None, None, None]), one[None])
    # two layers, two heads averaging to a: product of the per-layer matrices
    heads = np.stack([[[1.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [0.0, 1.0]]])  # mean = a
    attn = np.stack([heads, heads])[:, None]  # (2, 1, 2, 2, 2)
    np.testing.assert_allclose(attention_rollout(attn)[0], one @ one)
    assert np.allclose(attention_rollout(attn).sum(-1), 1.0)


def test_mean_distance_by_hand():
    # grid 1 x 3, patch 4 px: centres at x = 2, 6, 10 -> distances 0, 4, 8 between patches
    np.testing.assert_allclose(patch_distances((1, 3), (4, 4)), [[0, 4, 8], [4, 0, 4], [8, 4, 0]])
    # prefix token 0 excluded; patch queries (rows 1..3) over patch keys (cols 1..3):
    #   q1: all on itself                      -> 0
    #   q2: 0.5 on p1, 0.5 on p3               -> 4
    #   q3: 0.2 on cls, 0.4 on p1, 0.4 on p3   -> renormalised 0.5/0.5 on p1 (8 px), p3 (0) -> 4
    a = np.array([
        [1.0, 0.0, 0.0, 0.0],
        [0.0, 1.0, 0.0, 0.0],
        [0.0, 0.5, 0.0, 0.5],
        [0.2, 0.4, 0.0, 0.4],
    ])
    head_b = np.eye(4)  # every patch attends to itself -> 0
    attn = np.stack([a, head_b])[None, None]  # (1 layer, 1 image, 2 heads, 4, 4)
    d = mean_attention_distance(attn, (1, 3), (4, 4), num_prefix=1)
    np.testing.assert_allclose(d, [[(0 + 4 + 4) / 3, 0.0]])


def test_token_to_grid_cls_and_gap():
    m = np.arange(25, dtype=float).reshape(1, 5, 5)
    np.testing.assert_array_equal(token_to_grid(m, (2, 2), 1), [[[1, 2], [3, 4]]])
    m4 = np.arange(16, dtype=float).reshape(1, 4, 4)
    np.testing.assert_allclose(token_to_grid(m4, (2, 2), 0), m4.mean(axis=1).reshape(1, 2, 2))
    assert upsample_maps(np.ones((2, 2, 3)), (8, 12)).shape == (2, 8, 12)


def test_upsample_takes_a_side_for_a_square_image_and_names_a_size_it_cannot():
    # an int was torch's "'int' object is not iterable"; a pair of floats or a 0 torch's own errors
    assert upsample_maps(np.ones((2, 2, 2)), 8).shape == (2, 8, 8)
    for size in ((8.5, 8), (0, 8), "8x8"):
        with pytest.raises(ValueError, match=re.escape(f"size={size!r}")):
            upsample_maps(np.ones((2, 2, 2)), size)


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_smoke_on_tiny_vit(classifier):
    torch.manual_seed(0)
    model = create_model(TINY, classifier=classifier)
    x = torch.randn(3, 3, 16, 24)
    attn = collect_attention(model, x)
    L = model.cfg.num_prefix_tokens + 6
    assert attn.shape == (3, 3, 2, L, L)
    np.testing.assert_allclose(attn.sum(-1), 1.0, atol=1e-5)
    d = model_attention_distance(model, x, batch_size=2)
    assert d.shape == (3, 2) and (d > 0).all() and (d < np.hypot(16, 24)).all()
    np.testing.assert_allclose(d, mean_attention_distance(attn, (2, 3), (8, 8), model.cfg.num_prefix_tokens),
                               rtol=1e-6)
    r = model_rollout(model, x)
    assert r.shape == (3, 2, 3) and (r >= 0).all() and (r.sum(axis=(1, 2)) <= 1 + 1e-6).all()
    raw = model_raw_attention(model, x, layer=-1, head=1)
    assert raw.shape == (3, 2, 3)
    with pytest.raises(ValueError, match="layers"):
        model_raw_attention(model, x, layer=5)


def _attention_by_hand(model, x):
    """Every layer's softmax(q k^T / sqrt(d) - slope * distance), the distance penalty and the masked
    diagonal written out from the grid here, run block by block: (layers, B, heads, L, L)."""
    cfg, prefix = model.cfg, model.cfg.num_prefix_tokens
    with torch.no_grad():
        h, grid, _ = model.embed(x)
        gh, gw = grid
        rows, cols = np.divmod(np.arange(gh * gw), gw)
        dist = np.zeros((h.shape[1],) * 2)
        dist[prefix:, prefix:] = np.hypot(rows[:, None] - rows[None], cols[:, None] - cols[None])
        maps = []
        for block in model.blocks:
            y = block.norm1(h)
            B, L, D = y.shape
            q, k, _ = block.attn.qkv(y).view(B, L, 3, cfg.num_heads, -1).permute(2, 0, 3, 1, 4)
            logits = (q @ k.transpose(-1, -2)).double() / np.sqrt(D // cfg.num_heads)
            bias = block.attn.distance_bias
            if bias is not None:
                logits = logits - bias.log_slope.exp().double()[:, None, None] * torch.from_numpy(dist)
                if bias.mask_self:
                    logits[..., range(prefix, L), range(prefix, L)] = -np.inf
            maps.append(logits.softmax(-1).numpy())
            h = block(h)
    return np.stack(maps)


@pytest.mark.parametrize("case", ["distance_no_self, non-square patches", "hybrid, gap"])
def test_the_analyses_agree_with_references_written_out(case):
    """Captured attention (after the CIFAR recipe's distance penalty and its masked diagonal), rollout
    (Abnar & Zuidema: heads averaged, identity added, rows renormalised, layers multiplied) and mean
    attention distance (patch queries and keys, in pixels) against loops over plain arrays, on a
    non-square grid with a batch of 3."""
    torch.manual_seed(0)
    if case.startswith("distance"):
        cfg = ViTConfig(img_size=(16, 40), patch_size=(8, 4), width=32, depth=3, mlp_dim=64, num_heads=4,
                        num_classes=3, attn_bias="distance_no_self")
    else:
        cfg = ViTConfig(img_size=(32, 64), patch_size=1, width=32, depth=2, mlp_dim=64, num_heads=2, num_classes=3,
                        classifier="gap", resnet=ResNetConfig(layers=(1, 1), width_factor=0.5))
    model = create_model(cfg)
    x = torch.rand(3, 3, *cfg.img_size) * 2 - 1
    attn, prefix = _attention_by_hand(model, x), cfg.num_prefix_tokens
    (gh, gw), (py, px) = model.patch_grid(cfg.img_size), effective_patch_size(model)
    assert (py, px) == ((8, 4) if prefix else (8, 8))  # the hybrid's 1x1 patches on its /8 feature map
    np.testing.assert_allclose(collect_attention(model, x), attn, atol=1e-5)
    L = attn.shape[-1]
    rollout = np.zeros((3, L, L))
    distance = np.zeros(attn.shape[0:1] + attn.shape[2:3])
    for b in range(3):
        r = np.eye(L)
        for layer in attn[:, b]:
            a = layer.mean(0) + np.eye(L)
            r = (a / a.sum(1, keepdims=True)) @ r
        rollout[b] = r
        for l, h, i in np.ndindex(attn.shape[0], attn.shape[2], gh * gw):
            row = attn[l, b, h, prefix + i, prefix:]
            for j in range(gh * gw):
                dy, dx = (i // gw - j // gw) * py, (i % gw - j % gw) * px
                distance[l, h] += row[j] / row.sum() * np.hypot(dy, dx) / (3 * gh * gw)
    # the output token: the [class] token's row, or (gap) the mean of the patch tokens' rows
    out = rollout[:, 0, prefix:] if prefix else rollout[:, prefix:, prefix:].mean(1)
    np.testing.assert_allclose(model_rollout(model, x), out.reshape(3, gh, gw), atol=1e-5)
    np.testing.assert_allclose(model_attention_distance(model, x, batch_size=2), distance, rtol=1e-4)


def test_hybrid_patch_size_in_pixels():
    cfg = ViTConfig(img_size=32, patch_size=1, width=32, depth=1, mlp_dim=64, num_heads=2, num_classes=2,
                    resnet=ResNetConfig(layers=(1, 1), width_factor=1))
    model = create_model(cfg)
    assert effective_patch_size(model) == (8, 8)  # reduction 8 x 1x1 patches
    d = model_attention_distance(model, torch.randn(1, 3, 32, 32))
    assert d.shape == (1, 2) and (d < 32 * np.sqrt(2)).all()


def test_axial_is_refused_clearly():
    cfg = ViTConfig(img_size=16, patch_size=4, width=32, depth=1, mlp_dim=64, num_heads=2, num_classes=2,
                    classifier="gap", axial=True)
    with pytest.raises(ValueError, match="Axial"):
        model_rollout(create_model(cfg), torch.randn(1, 3, 16, 16))


def test_attention_distance_refuses_a_batch_size_or_images_it_cannot_average_by_name():
    """It was range()'s "arg 3 must not be zero", and for no images or a negative batch size
    "unsupported operand type(s) for /: 'NoneType' and 'int'"."""
    cfg = ViTConfig(img_size=16, patch_size=4, width=32, depth=1, mlp_dim=64, num_heads=2, num_classes=2)
    model, images = create_model(cfg), torch.randn(2, 3, 16, 16)
    for batch_size in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=rf"^batch_size={batch_size!r}: must be a positive integer"):
            model_attention_distance(model, images, batch_size=batch_size)
    with pytest.raises(ValueError, match="^images: none given"):
        model_attention_distance(model, images[:0])


def test_raw_attention_refuses_a_layer_or_head_by_name_before_running_the_model(monkeypatch):
    # layer=1.5 ended in numpy's "only integers, slices ... are valid indices", layer=True was layer 1,
    # each after the model had run on every image
    import vitlab.analysis.attention as attention

    cfg = ViTConfig(img_size=16, patch_size=4, width=32, depth=2, mlp_dim=64, num_heads=2, num_classes=2)
    model, images = create_model(cfg), torch.randn(1, 3, 16, 16)
    for runs in ("collect_attention", "reduce_attention"):
        monkeypatch.setattr(attention, runs, lambda *a: pytest.fail("the model ran"))
    for layer, head, message in ((1.5, None, "layer=1.5: must be an integer from -2 to 1"),
                                 (True, None, "layer=True: must be an integer from -2 to 1"),
                                 (2, None, "layer=2: must be an integer from -2 to 1"),
                                 (0, 2, "head=2: must be an integer from 0 to 1, or None"),
                                 (0, 0.0, "head=0.0: must be an integer from 0 to 1, or None")):
        with pytest.raises(ValueError, match=rf"^{re.escape(message)} \(the model has 2 layers of 2 heads\)$"):
            attention.model_raw_attention(model, images, layer, head)


def _analyses_as_they_were(model, x, batch_size, layer, head):
    """The analyses before they reduced layer by layer, kept as the reference: every layer's maps
    stacked, the whole of them in float64."""
    grid, patch = model.patch_grid(tuple(x.shape[-2:])), effective_patch_size(model)
    prefix = model.cfg.num_prefix_tokens

    def collect(images):
        with torch.no_grad(), vitlab.capture_attention(model.eval()) as maps:
            model.forward_features(images)
        return torch.stack(list(maps)).float().numpy()

    def distance(attn):
        a = attn.astype(np.float64)[..., prefix:, prefix:]
        a = a / np.clip(a.sum(axis=-1, keepdims=True), 1e-12, None)
        return (a * patch_distances(grid, patch)).sum(axis=-1).mean(axis=(1, 3))

    attn = collect(x)
    batches = [x[start:start + batch_size] for start in range(0, len(x), batch_size)]
    total = sum(distance(collect(batch)) * len(batch) for batch in batches)
    L = attn.shape[-1]
    rollout = np.broadcast_to(np.eye(L), (len(x), L, L)).copy()
    for maps in attn.astype(np.float64):
        a = maps.mean(axis=1) + np.eye(L)
        rollout = a / a.sum(axis=-1, keepdims=True) @ rollout
    raw = attn[layer].mean(axis=1) if head is None else attn[layer][:, head]
    return (total / len(x), token_to_grid(rollout, grid, prefix), token_to_grid(raw, grid, prefix),
            distance(attn), attn)


@pytest.mark.parametrize("case", ["vit", "gap, non-square", "hybrid", "distance_no_self, non-square patches"])
def test_the_layer_by_layer_analyses_give_what_the_stacked_maps_gave(case):
    """The model functions reduce each layer as it runs (a layer's maps at a time); their results are
    the float64 computation over every layer's stacked maps, to rounding."""
    torch.manual_seed(0)
    cfg = {"vit": TINY,
           "gap, non-square": dataclasses.replace(TINY, classifier="gap"),
           "hybrid": ViTConfig(img_size=32, patch_size=1, width=32, depth=2, mlp_dim=64, num_heads=2, num_classes=3,
                               resnet=ResNetConfig(layers=(1, 1), width_factor=0.5)),
           "distance_no_self, non-square patches": ViTConfig(img_size=(16, 40), patch_size=(8, 4), width=32, depth=3,
                                                             mlp_dim=64, num_heads=4, num_classes=3,
                                                             attn_bias="distance_no_self")}[case]
    model = create_model(cfg)
    x = torch.rand(5, 3, *cfg.img_size) * 2 - 1
    for layer, head in ((-1, None), (1, 0)):
        distance, rollout, raw, distance_of_all, attn = _analyses_as_they_were(model, x, 2, layer, head)
        np.testing.assert_allclose(model_attention_distance(model, x, batch_size=2), distance, rtol=1e-9)
        np.testing.assert_allclose(model_rollout(model, x), rollout, rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(model_raw_attention(model, x, layer, head), raw, rtol=1e-6)
    # the array functions on the stacked maps, as before
    grid, prefix = model.patch_grid(cfg.img_size), cfg.num_prefix_tokens
    np.testing.assert_allclose(mean_attention_distance(attn, grid, effective_patch_size(model), prefix),
                               distance_of_all, rtol=1e-9)
    np.testing.assert_allclose(token_to_grid(attention_rollout(list(torch.from_numpy(attn))), grid, prefix), rollout,
                               rtol=1e-6, atol=1e-12)


def test_a_reduction_that_raises_leaves_the_model_as_it_was():
    from vitlab.analysis.attention import reduce_attention
    from vitlab.models.layers import Attention

    model = create_model(TINY).train()
    model.blocks[0].eval()  # a caller's frozen part stays frozen, the rest training

    def fails(index, layer):
        assert layer.shape == (2, 2, 7, 7) and layer.dtype == np.float32
        if index == 1:
            raise RuntimeError("reduction failed")
        return index

    with pytest.raises(RuntimeError, match="reduction failed"):
        reduce_attention(model, torch.randn(2, 3, 16, 24), fails)
    assert model.training and not model.blocks[0].training and model.blocks[1].training
    assert all(m.recorded is None for m in model.modules() if isinstance(m, Attention))
    # what each layer's reduction gives, in the order of the layers: rows of every map sum to 1
    sums = reduce_attention(model, torch.randn(2, 3, 16, 24), lambda index, layer: (index, layer.sum(-1)))
    assert [i for i, _ in sums] == [0, 1, 2] and np.allclose([s for _, s in sums], 1.0, atol=1e-5)
    with pytest.raises(TypeError, match=r"^reduce=None: expected a function of \(index, layer's maps\)$"):
        reduce_attention(model, torch.randn(2, 3, 16, 24), None)


_PEAK = """
import resource, sys, torch
from vitlab.analysis import attention
from vitlab.config import ViTConfig
from vitlab.models import create_model
torch.set_num_threads(1)
torch.manual_seed(0)
cfg = ViTConfig(img_size=384, patch_size=16, width=64, depth=int(sys.argv[2]), mlp_dim=64, num_heads=8, num_classes=2)
model, x = create_model(cfg), torch.rand(4, 3, 384, 384) * 2 - 1
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
{"distance": lambda: attention.model_attention_distance(model, x),
 "rollout": lambda: attention.model_rollout(model, x),
 "raw": lambda: attention.model_raw_attention(model, x, layer=-1)}[sys.argv[1]]()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in kB as Linux gives it")
@pytest.mark.parametrize("analysis", ["distance", "rollout", "raw"])
def test_the_model_analyses_hold_one_layer_of_maps_not_every_layer(analysis):
    """Memory for one layer's maps, whatever the depth: they stacked every layer's (B, heads, L, L) maps and
    copied them to float64 (ViT-L/16 at 384 px: about 0.5 GB of float32 maps per image, and 8 GB more of
    float64 for the 16 images of a batch), so a 24 GB machine was killed.  The peak's growth during the
    call (one layer's maps are 4 images x 8 heads x 577^2 tokens, 43 MB) at depth 8 is that at depth 2."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[2]),
                                                                      os.environ.get("PYTHONPATH")]))}
    grown = {depth: int(subprocess.run([sys.executable, "-c", _PEAK, analysis, str(depth)], env=env, check=True,
                                       capture_output=True, text=True).stdout) for depth in (2, 8)}
    assert grown[8] < 1.5 * grown[2] + 20_000, grown  # kB; 8 layers' maps alone were 340 MB
