"""vit_jax checkpoints: vitlab must compute what the official Flax model computes.

The reference below is an independent numpy transcription of vit_jax's forward pass
(models_vit.py, models_resnet.py and the Flax layers they use), run in float64 on a dict
of random arrays in the official layout.  It shares no code with vitlab.
"""
import math

import numpy as np
import pytest
import scipy.ndimage
import scipy.special
import torch

from vitlab.models.registry import get_config
from vitlab.weights import WeightsError, infer_config, load_model, load_official_npz, save_official_npz
from vitlab.weights.core import meta_shapes

# float32 vitlab vs float64 reference differ by ~5e-6 here; 3e-5 (stricter than 1e-4) also
# catches a wrong LayerNorm/GroupNorm eps or weight-standardisation form, not only a wrong GELU
TOL = 3e-5

# ----------------------------------------------------------------- numpy reference


def layer_norm(x, scale, bias, eps=1e-6):  # flax.linen.LayerNorm, eps 1e-6
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * scale + bias


def gelu_tanh(x):  # flax.linen.gelu (approximate=True)
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def same_pads(size, kernel, stride):  # TensorFlow's SAME: out = ceil(size / stride), extra pixel after
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def pad_same(x, kernel, stride, value=0.0):  # x: NHWC
    (t, b), (l, r) = same_pads(x.shape[1], kernel, stride), same_pads(x.shape[2], kernel, stride)
    return np.pad(x, ((0, 0), (t, b), (l, r), (0, 0)), constant_values=value)


def conv_same(x, kernel, stride):  # x NHWC, kernel HWIO, SAME padding (flax.linen.Conv default)
    kh, kw = kernel.shape[:2]
    x = pad_same(x, kh, stride)
    oh, ow = (x.shape[1] - kh) // stride + 1, (x.shape[2] - kw) // stride + 1
    out = 0.0
    for i in range(kh):
        for j in range(kw):
            patch = x[:, i:i + stride * (oh - 1) + 1:stride, j:j + stride * (ow - 1) + 1:stride]
            out = out + np.einsum("nhwc,co->nhwo", patch, kernel[i, j])
    return out


# Numerical conventions of the stem; other sources (timm's hybrids) pass their own.
OFFICIAL = dict(ws_eps=1e-5, ws_inside_sqrt=False, gn_eps=1e-6, gelu="tanh")


def std_conv(x, kernel, stride=1, conv=OFFICIAL):  # models_resnet.StdConv: standardise over (H, W, in)
    w = kernel - kernel.mean(axis=(0, 1, 2))
    if conv["ws_inside_sqrt"]:  # timm StdConv2dSame: (w - mean) / sqrt(var + eps)
        w = w / np.sqrt(w.var(axis=(0, 1, 2)) + conv["ws_eps"])
    else:  # vit_jax: (w - mean) / (std + eps)
        w = w / (w.std(axis=(0, 1, 2)) + conv["ws_eps"])
    return conv_same(x, w, stride)


def group_norm(x, scale, bias, groups=32, eps=1e-6):  # flax.linen.GroupNorm defaults
    n, h, w, c = x.shape
    g = x.reshape(n, h, w, groups, c // groups)
    mean = g.mean(axis=(1, 2, 4), keepdims=True)
    var = (g**2).mean(axis=(1, 2, 4), keepdims=True) - mean**2
    g = (g - mean) / np.sqrt(var + eps)
    return g.reshape(n, h, w, c) * scale.reshape(-1) + bias.reshape(-1)


def max_pool_same(x, k=3, s=2):  # flax.linen.max_pool(padding='SAME'): pads with -inf
    x = pad_same(x, k, s, value=-np.inf)
    oh, ow = (x.shape[1] - k) // s + 1, (x.shape[2] - k) // s + 1
    out = np.full((x.shape[0], oh, ow, x.shape[3]), -np.inf)
    for i in range(k):
        for j in range(k):
            out = np.maximum(out, x[:, i:i + s * (oh - 1) + 1:s, j:j + s * (ow - 1) + 1:s])
    return out


def residual_unit(p, pre, x, features, stride, conv=OFFICIAL):  # models_resnet.ResidualUnit (v1, post-activation)
    relu = lambda v: np.maximum(v, 0)
    gn = lambda v, name: group_norm(v, p[pre + name + "/scale"], p[pre + name + "/bias"], eps=conv["gn_eps"])
    residual = x
    if x.shape[-1] != 4 * features or stride != 1:
        residual = gn(std_conv(x, p[pre + "conv_proj/kernel"], stride, conv), "gn_proj")
    y = relu(gn(std_conv(x, p[pre + "conv1/kernel"], 1, conv), "gn1"))
    y = relu(gn(std_conv(y, p[pre + "conv2/kernel"], stride, conv), "gn2"))
    y = gn(std_conv(y, p[pre + "conv3/kernel"], 1, conv), "gn3")
    return relu(residual + y)


def attention(p, pre, x):  # flax.linen.MultiHeadDotProductAttention, self-attention
    q = np.einsum("nld,dhk->nlhk", x, p[pre + "query/kernel"]) + p[pre + "query/bias"]
    k = np.einsum("nld,dhk->nlhk", x, p[pre + "key/kernel"]) + p[pre + "key/bias"]
    v = np.einsum("nld,dhk->nlhk", x, p[pre + "value/kernel"]) + p[pre + "value/bias"]
    q = q / np.sqrt(q.shape[-1])
    logits = np.einsum("nqhk,nshk->nhqs", q, k)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs = probs / probs.sum(-1, keepdims=True)
    out = np.einsum("nhqs,nshk->nqhk", probs, v)
    return np.einsum("nqhk,hkd->nqd", out, p[pre + "out/kernel"]) + p[pre + "out/bias"]


def gelu_exact(x):  # torch.nn.GELU() / F.gelu(approximate="none"): timm and Hugging Face
    return 0.5 * x * (1.0 + scipy.special.erf(x / math.sqrt(2.0)))


def official_forward(p, images, classifier, resnet_layers=(), conv=OFFICIAL):
    """vit_jax VisionTransformer.__call__(train=False); images NHWC float64."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    gelu = gelu_tanh if conv["gelu"] == "tanh" else gelu_exact
    x = images
    if "conv_root/kernel" in p:
        x = std_conv(x, p["conv_root/kernel"], 2, conv)
        x = np.maximum(group_norm(x, p["gn_root/scale"], p["gn_root/bias"], eps=conv["gn_eps"]), 0)
        x = max_pool_same(x)
        width = p["conv_root/kernel"].shape[-1]  # int(64 * width_factor)
        for s, units in enumerate(resnet_layers):
            for u in range(units):
                stride = 2 if s > 0 and u == 0 else 1
                x = residual_unit(p, f"block{s + 1}/unit{u + 1}/", x, width * 2**s, stride, conv)
    # patch embedding: a VALID conv with stride = kernel = patch, written as reshape + einsum
    P, Q = p["embedding/kernel"].shape[:2]
    n, h, w, c = x.shape
    x = x.reshape(n, h // P, P, w // Q, Q, c)
    x = np.einsum("nhpwqc,pqcd->nhwd", x, p["embedding/kernel"]) + p["embedding/bias"]
    x = x.reshape(n, -1, x.shape[-1])
    if classifier == "token":
        x = np.concatenate([np.tile(p["cls"], (n, 1, 1)), x], axis=1)
    x = x + p["Transformer/posembed_input/pos_embedding"]
    i = 0
    while f"Transformer/encoderblock_{i}/LayerNorm_0/scale" in p:
        b = f"Transformer/encoderblock_{i}/"
        y = layer_norm(x, p[b + "LayerNorm_0/scale"], p[b + "LayerNorm_0/bias"])
        x = x + attention(p, b + "MultiHeadDotProductAttention_1/", y)
        y = layer_norm(x, p[b + "LayerNorm_2/scale"], p[b + "LayerNorm_2/bias"])
        y = gelu(y @ p[b + "MlpBlock_3/Dense_0/kernel"] + p[b + "MlpBlock_3/Dense_0/bias"])
        x = x + y @ p[b + "MlpBlock_3/Dense_1/kernel"] + p[b + "MlpBlock_3/Dense_1/bias"]
        i += 1
    x = layer_norm(x, p["Transformer/encoder_norm/scale"], p["Transformer/encoder_norm/bias"])
    x = x[:, 0] if classifier == "token" else x.mean(axis=1)
    if "pre_logits/kernel" in p:
        x = np.tanh(x @ p["pre_logits/kernel"] + p["pre_logits/bias"])
    return x @ p["head/kernel"] + p["head/bias"]


# ------------------------------------------------------------------- random checkpoints


def random_checkpoint(seed, *, width=32, depth=2, heads=2, mlp=48, patch=4, grid=4, in_chans=3, classes=5,
                      classifier="token", rep=None, resnet_layers=(), root=64, hybrid=False):
    """A dict of random arrays with the names and shapes of a vit_jax checkpoint.

    patch and grid: an int (square) or (height, width); root: the hybrid root's channels,
    int(64 * width_factor); hybrid=True with no resnet_layers is the root-only stem.
    """
    (ph, pw), (gh, gw) = (patch, patch) if isinstance(patch, int) else patch, (grid, grid) if isinstance(grid, int) else grid
    rng = np.random.default_rng(seed)
    r = lambda *shape, s=0.3: (rng.standard_normal(shape) * s).astype(np.float32)
    one = lambda *shape: (1 + r(*shape, s=0.1)).astype(np.float32)
    p, hd = {}, width // heads
    feat = in_chans
    if resnet_layers or hybrid:
        p["conv_root/kernel"] = r(7, 7, in_chans, root)
        # old Flax (< 0.3.6) GroupNorm layout (1, 1, 1, C), as vit_jax's _fix_groupnorm expects
        p["gn_root/scale"], p["gn_root/bias"] = one(1, 1, 1, root), r(1, 1, 1, root, s=0.1)
        cin = root
        for s, units in enumerate(resnet_layers):
            mid = root * 2**s
            for u in range(units):
                pre = f"block{s + 1}/unit{u + 1}/"
                shapes = {"conv1": (1, 1, cin, mid), "conv2": (3, 3, mid, mid), "conv3": (1, 1, mid, 4 * mid)}
                if u == 0:
                    shapes["conv_proj"] = (1, 1, cin, 4 * mid)
                for conv, shape in shapes.items():
                    gn = conv.replace("conv", "gn")
                    p[pre + conv + "/kernel"] = r(*shape)
                    p[pre + gn + "/scale"], p[pre + gn + "/bias"] = one(shape[-1]), r(shape[-1], s=0.1)
                cin = 4 * mid
        feat = cin
    p["embedding/kernel"] = r(ph, pw, feat, width, s=0.3 / math.sqrt(ph * pw * feat) * 3)
    p["embedding/bias"] = r(width)
    if classifier == "token":
        p["cls"] = r(1, 1, width)
    p["Transformer/posembed_input/pos_embedding"] = r(1, gh * gw + (classifier == "token"), width)
    for i in range(depth):
        b = f"Transformer/encoderblock_{i}/"
        for ln in ("LayerNorm_0", "LayerNorm_2"):
            p[b + ln + "/scale"], p[b + ln + "/bias"] = one(width), r(width, s=0.1)
        a = b + "MultiHeadDotProductAttention_1/"
        for n in ("query", "key", "value"):
            p[a + n + "/kernel"], p[a + n + "/bias"] = r(width, heads, hd), r(heads, hd, s=0.1)
        p[a + "out/kernel"], p[a + "out/bias"] = r(heads, hd, width), r(width, s=0.1)
        p[b + "MlpBlock_3/Dense_0/kernel"], p[b + "MlpBlock_3/Dense_0/bias"] = r(width, mlp), r(mlp, s=0.1)
        p[b + "MlpBlock_3/Dense_1/kernel"], p[b + "MlpBlock_3/Dense_1/bias"] = r(mlp, width), r(width, s=0.1)
    p["Transformer/encoder_norm/scale"], p["Transformer/encoder_norm/bias"] = one(width), r(width, s=0.1)
    if rep:
        p["pre_logits/kernel"], p["pre_logits/bias"] = r(width, rep), r(rep, s=0.1)
    p["head/kernel"], p["head/bias"] = r(rep or width, classes), r(classes, s=0.1)
    return p


def images(seed, size, n=2, chans=3):
    return np.random.default_rng(seed).standard_normal((n, size, size, chans)).astype(np.float32)


def vitlab_logits(model, x_nhwc):
    with torch.no_grad():
        return model(torch.from_numpy(x_nhwc).permute(0, 3, 1, 2).contiguous()).double().numpy()


# ------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("classifier", ["token", "gap"])
@pytest.mark.parametrize("rep", [None, 7])
def test_npz_matches_official_forward(tmp_path, classifier, rep):
    ckpt = random_checkpoint(0, classifier=classifier, rep=rep)
    np.savez(tmp_path / "ckpt.npz", **ckpt)
    model = load_official_npz(tmp_path / "ckpt.npz")
    cfg = model.cfg
    assert not model.training
    assert (cfg.width, cfg.depth, cfg.num_heads, cfg.mlp_dim) == (32, 2, 2, 48)
    assert (cfg.patch_size, cfg.img_size) == ((4, 4), (16, 16))
    assert (cfg.classifier, cfg.representation_size, cfg.num_classes) == (classifier, rep, 5)
    assert (cfg.gelu, cfg.ln_eps, cfg.posemb_resample) == ("tanh", 1e-6, "bilinear")
    x = images(1, 16)
    np.testing.assert_allclose(vitlab_logits(model, x), official_forward(ckpt, x, classifier), atol=TOL, rtol=0)


def test_a_bfloat16_npz_is_read_as_its_numbers(tmp_path, capsys):
    """JAX writes bfloat16 parameters into an .npz as 2-byte void arrays (ml_dtypes' bfloat16 has no numpy
    code), the form of big_vision's bf16 files: reading one ended in torch.from_numpy's TypeError, a traceback
    of `vitlab predict`.  They are bfloat16's bits: the model computes with those numbers in float32."""
    from vitlab.cli import main

    ckpt = random_checkpoint(0)
    bits = {k: (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16) for k, v in ckpt.items()}
    np.savez(tmp_path / "bf16.npz", **{k: b.view("V2") for k, b in bits.items()})  # as np.savez writes bfloat16
    rounded = {k: (b.astype(np.uint32) << 16).view(np.float32) for k, b in bits.items()}
    x = images(1, 16)
    np.testing.assert_allclose(vitlab_logits(load_official_npz(tmp_path / "bf16.npz"), x),
                               official_forward(rounded, x, "token"), atol=TOL, rtol=0)
    np.savez(tmp_path / "f8.npz", **{**ckpt, "embedding/kernel": np.zeros((4, 4, 3, 32), np.uint8).view("V1")})
    assert main(["convert", str(tmp_path / "f8.npz"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == ("vitlab convert: error: embedding/kernel: an array of 1-byte items of no "
                                       "numeric type (|V1); vitlab reads float and integer arrays, and 2-byte ones "
                                       "as bfloat16 (as JAX writes them)\n")


def test_hybrid_npz_matches_official_forward(tmp_path):
    # 30 px: odd feature maps and asymmetric SAME padding in the root conv (2, 3), the
    # max-pool (1, 1) and the strided 3x3 (0, 1); the checkpoint's own size is 32
    size = 30
    ckpt = random_checkpoint(2, width=32, patch=1, grid=4, resnet_layers=(1, 1))
    np.savez(tmp_path / "hybrid.npz", **ckpt)
    model = load_model(tmp_path / "hybrid.npz", img_size=size)
    r = model.cfg.resnet
    assert (r.layers, r.width_factor) == ((1, 1), 1)
    assert (r.padding, r.ws_eps, r.ws_eps_inside_sqrt, r.gn_eps) == ("same", 1e-5, False, 1e-6)
    assert model.cfg.grid_size == (4, 4)  # ceil(30 / 8) = 4: no position-embedding resize needed
    x = images(3, size)
    np.testing.assert_allclose(vitlab_logits(model, x), official_forward(ckpt, x, "token", (1, 1)), atol=TOL, rtol=0)


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_resize_is_the_official_zoom(tmp_path, classifier):
    ckpt = random_checkpoint(4, classifier=classifier, depth=1)
    np.savez(tmp_path / "ckpt.npz", **ckpt)
    model = load_official_npz(tmp_path / "ckpt.npz", img_size=24)  # grid 4x4 -> 6x6
    # vit_jax checkpoint.load_pretrained: keep the [class] embedding, zoom the grid with order 1
    posemb = ckpt["Transformer/posembed_input/pos_embedding"]
    tok, grid = (posemb[:, :1], posemb[0, 1:]) if classifier == "token" else (posemb[:, :0], posemb[0])
    zoomed = scipy.ndimage.zoom(grid.reshape(4, 4, -1), (6 / 4, 6 / 4, 1), order=1)
    expected = np.concatenate([tok, zoomed.reshape(1, 36, -1)], axis=1)
    np.testing.assert_allclose(model.pos_embed.weight.detach().numpy(), expected, atol=1e-5, rtol=0)
    # and the whole model at the new resolution is the official model with that table
    x = images(5, 24)
    resized = {**ckpt, "Transformer/posembed_input/pos_embedding": expected}
    np.testing.assert_allclose(vitlab_logits(model, x), official_forward(resized, x, classifier), atol=TOL, rtol=0)


def test_new_head_follows_official_fine_tuning(tmp_path):
    ckpt = random_checkpoint(6, rep=7)
    np.savez(tmp_path / "ckpt.npz", **ckpt)
    model = load_official_npz(tmp_path / "ckpt.npz", num_classes=3)
    assert model.pre_logits is None and model.cfg.representation_size is None  # drop-head variant
    assert model.head.weight.shape == (3, 32) and not model.head.weight.any() and not model.head.bias.any()
    kept = load_official_npz(tmp_path / "ckpt.npz", num_classes=3, keep_pre_logits=True)
    assert kept.cfg.representation_size == 7 and kept.head.weight.shape == (3, 7)
    np.testing.assert_array_equal(kept.pre_logits.fc.weight.detach().numpy(), ckpt["pre_logits/kernel"].T)
    features = load_official_npz(ckpt, num_classes=0)
    assert isinstance(features.head, torch.nn.Identity)


@pytest.mark.parametrize("kind", ["token", "gap", "hybrid"])
def test_save_official_npz_round_trip(tmp_path, kind):
    ckpt = random_checkpoint(7, classifier="gap" if kind == "gap" else "token", rep=5,
                             patch=1 if kind == "hybrid" else 4, resnet_layers=(1,) if kind == "hybrid" else ())
    model = load_official_npz(ckpt)
    save_official_npz(model, tmp_path / "out.npz")
    with np.load(tmp_path / "out.npz") as npz:
        written = {k: npz[k] for k in npz.files}
    assert set(written) == set(ckpt)
    for k in ckpt:  # the old (1, 1, 1, C) GroupNorm layout comes back as today's (C,)
        np.testing.assert_array_equal(written[k], ckpt[k].reshape(written[k].shape), err_msg=k)
    again = load_official_npz(tmp_path / "out.npz")
    x = images(8, model.cfg.img_size[0])
    np.testing.assert_array_equal(vitlab_logits(again, x), vitlab_logits(model, x))


def test_npz_extra_and_missing_arrays_are_all_reported():
    ckpt = random_checkpoint(9, depth=2)
    del ckpt["Transformer/encoderblock_1/LayerNorm_2/bias"], ckpt["head/bias"]
    ckpt["Transformer/encoderblock_0/extra/kernel"] = np.zeros(3, np.float32)
    with pytest.raises(WeightsError) as err:
        load_official_npz(ckpt)
    msg = str(err.value)
    for key in ("blocks.1.norm2.bias", "head.bias", "Transformer/encoderblock_0/extra/kernel"):
        assert key in msg


def test_heads_come_from_the_kernels_and_names_are_checked():
    ckpt = random_checkpoint(10, depth=1)
    assert load_official_npz(ckpt).cfg.num_heads == 2
    with pytest.raises(WeightsError, match="num_heads=4 contradicts"):
        load_official_npz(ckpt, num_heads=4)
    with pytest.raises(WeightsError, match="not a ViT-B/16"):
        load_model(ckpt, name="ViT-B_16")  # the official spelling is accepted


def test_a_name_of_another_family_or_stem_is_refused():
    # a BiT ResNet's name for ViT weights was read for a ViT's fields: AttributeError, a traceback
    with pytest.raises(WeightsError, match="not a BiT-R50x1: they hold a Vision Transformer, and BiT-R50x1 is a BiT"):
        load_model(random_checkpoint(10, depth=1), name="BiT-R50x1")
    # R50x1+ViT-B/32 has every size of R50x1+ViT-B/16 but the stem's units ((3, 4, 6, 3), not (3, 4, 9)):
    # the stem was not compared, and the weights were named the other model; shapes alone (no memory held)
    # are enough, as the name is checked before a model is built
    shapes = {k: torch.zeros(()).expand(s) for k, s in meta_shapes(get_config("R50+ViT-B/32")).items()}
    assert infer_config(shapes, name="R50+ViT-B/32").name == "R50x1+ViT-B/32"
    with pytest.raises(WeightsError, match=r"not a R50x1\+ViT-B/16: resnet=\(3, 4, 6, 3\)x1 \(weights\) vs "
                                           r"\(3, 4, 9\)x1"):
        load_model(shapes, name="R50+ViT-B/16")
    with pytest.raises(WeightsError, match=r"resnet=\(3, 4, 6, 3\)x1 \(weights\) vs None \(ViT-B/32\)"):
        infer_config(shapes, name="ViT-B/32")
