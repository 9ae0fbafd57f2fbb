"""Every ViT-family source layout in: the rest of vit_jax, AugReg, big_vision, timm hybrids and
non-square timm models.  Each test builds random arrays with that source's names and shapes
and compares vitlab's logits with an independent float64 numpy forward of the source's model
(``test_weights_official``'s transcription of vit_jax, with the source's differences written
out here).  BiT has its own file, ``test_weights_bit``.
"""
import math

import numpy as np
import pytest
import torch

from test_weights_official import (OFFICIAL, TOL, attention, gelu_exact, gelu_tanh, layer_norm, official_forward,
                                   random_checkpoint, vitlab_logits)
from vitlab.weights import WeightsError, load_model, load_official_npz, save_official_npz
from vitlab.weights.bigvision import load_big_vision


def images(seed, size, n=2):
    h, w = (size, size) if isinstance(size, int) else size
    return np.random.default_rng(seed).standard_normal((n, h, w, 3)).astype(np.float32)


# ------------------------------------------------------------------- vit_jax: the rest


@pytest.mark.parametrize("root, layers", [(32, (1, 1)), (96, (1,)), (64, ())],
                         ids=["width-0.5", "width-1.5", "root-only"])
def test_any_width_factor_and_root_only_stem(tmp_path, root, layers):
    # int(64 * width_factor) channels in the root, as vit_jax; () is the R+ViT-Ti_16 stem (root, no stages)
    patch = 2 if not layers else 1
    ckpt = random_checkpoint(11, patch=patch, grid=4, root=root, resnet_layers=layers, hybrid=True)
    np.savez(tmp_path / "h.npz", **ckpt)
    model = load_model(tmp_path / "h.npz")
    r = model.cfg.resnet
    assert (r.layers, r.width_factor, r.root_width) == (layers, root / 64 if root % 64 else root // 64, root)
    size = model.cfg.img_size[0]
    assert size == 4 * patch * (4 if not layers else 4 * 2 ** (len(layers) - 1))
    x = images(12, size)
    np.testing.assert_allclose(vitlab_logits(model, x), official_forward(ckpt, x, "token", layers), atol=TOL, rtol=0)
    save_official_npz(model, tmp_path / "out.npz")  # and back out in the same layout
    with np.load(tmp_path / "out.npz") as npz:
        assert set(npz.files) == set(ckpt)


def test_non_square_image_and_patch(tmp_path):
    ckpt = random_checkpoint(13, patch=(4, 2), grid=(2, 5))  # 8 x 10 px, 10 positions: not a square
    with pytest.raises(WeightsError, match="not a square grid.*weights_img_size"):
        load_official_npz(ckpt)
    model = load_official_npz(ckpt, weights_img_size=(8, 10))
    assert (model.cfg.patch_size, model.cfg.img_size) == ((4, 2), (8, 10))
    x = images(14, (8, 10))
    np.testing.assert_allclose(vitlab_logits(model, x), official_forward(ckpt, x, "token"), atol=TOL, rtol=0)
    same = load_official_npz(ckpt, img_size=(8, 10))  # the requested size, when it fits the table, works too
    np.testing.assert_array_equal(vitlab_logits(same, x), vitlab_logits(model, x))


AUGREG = "Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_{}.npz"


def test_augreg_loads_by_file_name(tmp_path):
    # a Ti/16 fine-tuned at 48 px (a 3x3 grid, the name's res_48); then only 2 of its 12 blocks
    ckpt = random_checkpoint(15, width=192, depth=12, heads=3, mlp=768, patch=16, grid=3, classes=4)
    path = tmp_path / AUGREG.format(48)
    np.savez(path, **ckpt)
    model = load_model(path)
    assert (model.cfg.width, model.cfg.depth, model.cfg.num_heads, model.cfg.img_size) == (192, 12, 3, (48, 48))
    assert model.cfg.name == "ViT-Ti/16"
    short = {k: v for k, v in ckpt.items() if "encoderblock_" not in k or k.split("/")[1] in
             ("encoderblock_0", "encoderblock_1")}
    (tmp_path / "short").mkdir()
    np.savez(tmp_path / "short" / AUGREG.format(48), **short)
    with pytest.raises(WeightsError, match="AugReg name.*depth=2 \\(weights\\) vs 12"):
        load_model(tmp_path / "short" / AUGREG.format(48))
    with pytest.raises(WeightsError, match="weights_img_size=32"):  # res_32 contradicts the 3x3 table
        np.savez(tmp_path / AUGREG.format(32), **ckpt)
        load_model(tmp_path / AUGREG.format(32))


# --------------------------------------------------------------------------- big_vision
# Independent transcription of big_vision/models/vit.py (_Model.__call__, Encoder1DBlock,
# MlpBlock, posemb_sincos_2d) on arrays named as a big_vision checkpoint stores them.


def sincos_2d(h, w, width, temperature=10_000.0):  # big_vision posemb_sincos_2d
    y, x = np.mgrid[:h, :w]
    omega = np.arange(width // 4) / (width // 4 - 1)
    omega = 1.0 / temperature**omega
    y = np.einsum("m,d->md", y.flatten(), omega)
    x = np.einsum("m,d->md", x.flatten(), omega)
    return np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)[None]


def big_vision_forward(p, images, pool_type, prefix="params/"):
    p = {k[len(prefix):]: np.asarray(v, np.float64) for k, v in p.items() if k.startswith(prefix)}
    P, Q, c, D = p["embedding/kernel"].shape
    n, h, w, _ = images.shape
    x = images.reshape(n, h // P, P, w // Q, Q, c)
    x = np.einsum("nhpwqc,pqcd->nhwd", x, p["embedding/kernel"]) + p["embedding/bias"]
    x = x.reshape(n, -1, D)
    x = x + (p["pos_embedding"] if "pos_embedding" in p else sincos_2d(h // P, w // Q, D))  # before the cls
    if pool_type == "tok":
        x = np.concatenate([np.tile(p["cls"], (n, 1, 1)), x], axis=1)
    scan = "Transformer/encoderblock/LayerNorm_0/scale" in p
    depth = p["Transformer/encoderblock/LayerNorm_0/scale"].shape[0] if scan else \
        sum(k.endswith("LayerNorm_0/scale") for k in p)
    for i in range(depth):
        get = (lambda name: p["Transformer/encoderblock/" + name][i]) if scan else \
            (lambda name: p[f"Transformer/encoderblock_{i}/" + name])
        y = layer_norm(x, get("LayerNorm_0/scale"), get("LayerNorm_0/bias"))
        att = {f"a/{n}/{k}": get(f"MultiHeadDotProductAttention_0/{n}/{k}")
               for n in ("query", "key", "value", "out") for k in ("kernel", "bias")}
        x = x + attention(att, "a/", y)
        y = layer_norm(x, get("LayerNorm_1/scale"), get("LayerNorm_1/bias"))
        y = gelu_tanh(y @ get("MlpBlock_0/Dense_0/kernel") + get("MlpBlock_0/Dense_0/bias"))
        x = x + y @ get("MlpBlock_0/Dense_1/kernel") + get("MlpBlock_0/Dense_1/bias")
    x = layer_norm(x, p["Transformer/encoder_norm/scale"], p["Transformer/encoder_norm/bias"])
    x = x[:, 0] if pool_type == "tok" else x.mean(axis=1)
    if "pre_logits/kernel" in p:
        x = np.tanh(x @ p["pre_logits/kernel"] + p["pre_logits/bias"])
    return x @ p["head/kernel"] + p["head/bias"]


BV_BLOCK = {"MultiHeadDotProductAttention_1": "MultiHeadDotProductAttention_0", "LayerNorm_2": "LayerNorm_1",
            "MlpBlock_3": "MlpBlock_0"}


def big_vision_checkpoint(seed, pool_type, posemb="learn", scan=False, prefix="params/", grid=4, **kw):
    """Random arrays named and shaped as big_vision saves a ViT (random_checkpoint's values, renamed)."""
    ckpt = random_checkpoint(seed, classifier="token" if pool_type == "tok" else "gap", grid=grid, **kw)
    out = {}
    for k, v in ckpt.items():
        if k == "Transformer/posembed_input/pos_embedding":
            if posemb == "learn":
                out["pos_embedding"] = v[:, 1:] if pool_type == "tok" else v  # no position for the cls
            continue
        parts = k.split("/")
        if parts[1:2] and parts[1].startswith("encoderblock_"):
            parts[2] = BV_BLOCK.get(parts[2], parts[2])
        out["/".join(parts)] = v
    if scan:  # nn.scan stacks every block's arrays on a leading depth axis under encoderblock/
        blocks = sorted({k.split("/")[1] for k in out if k.startswith("Transformer/encoderblock_")})
        for name in {k.split("/", 2)[2] for k in out if k.startswith("Transformer/encoderblock_0/")}:
            out[f"Transformer/encoderblock/{name}"] = np.stack([out.pop(f"Transformer/{b}/{name}") for b in blocks])
    out = {prefix + k: v for k, v in out.items()}
    out["opt/state/ignored"] = np.zeros(3, np.float32)  # optimiser trees sit beside params/
    return out


@pytest.mark.parametrize("pool_type, posemb, scan, prefix", [
    ("tok", "learn", False, "params/"),
    ("gap", "learn", True, "params/"),
    ("tok", "sincos2d", True, "params/img/"),
    ("gap", "sincos2d", False, "params/"),
])
def test_big_vision_matches_its_forward(tmp_path, pool_type, posemb, scan, prefix):
    ckpt = big_vision_checkpoint(16, pool_type, posemb, scan, prefix, rep=6 if pool_type == "tok" else None)
    np.savez(tmp_path / "bv.npz", **ckpt)
    size = None if posemb == "learn" else 16  # a sincos2d table is computed for the size asked for
    model = load_model(tmp_path / "bv.npz", img_size=size)
    assert model.cfg.classifier == ("token" if pool_type == "tok" else "gap")
    assert (model.cfg.gelu, model.cfg.ln_eps, model.cfg.depth) == ("tanh", 1e-6, 2)
    x = images(17, 16)
    np.testing.assert_allclose(vitlab_logits(model, x), big_vision_forward(ckpt, x, pool_type, prefix),
                               atol=TOL, rtol=0)
    if posemb == "sincos2d":  # at another resolution the table is recomputed, as big_vision does
        x = images(18, (24, 20))
        # with weights_img_size too (convert --weights-img-size): the table was computed at 16 px and resampled
        for trained_at in ({}, {"weights_img_size": 16}):
            big = load_model(tmp_path / "bv.npz", img_size=(24, 20), **trained_at)
            np.testing.assert_allclose(vitlab_logits(big, x), big_vision_forward(ckpt, x, pool_type, prefix),
                                       atol=TOL, rtol=0)


def test_big_vision_unsupported_heads_are_named():
    ckpt = big_vision_checkpoint(19, "gap")
    ckpt["params/MAPHead_0/probe"] = np.zeros((1, 1, 32), np.float32)
    with pytest.raises(WeightsError, match="pool_type='map'.*MAPHead_0"):
        load_model(ckpt)
    with pytest.raises(WeightsError, match="pool_type='0'"):
        load_big_vision(big_vision_checkpoint(19, "gap"), pool_type="0")
    with pytest.raises(WeightsError, match="sincos2d.*img_size"):
        load_model(big_vision_checkpoint(19, "gap", posemb="sincos2d"))


def test_big_vision_mismatches_are_listed_together():
    ckpt = big_vision_checkpoint(20, "tok")
    del ckpt["params/Transformer/encoderblock_1/MlpBlock_0/Dense_1/bias"], ckpt["params/head/bias"]
    ckpt["params/Transformer/encoderblock_0/Extra_0/kernel"] = np.zeros(3, np.float32)
    with pytest.raises(WeightsError) as err:
        load_model(ckpt)
    for key in ("blocks.1.mlp.fc2.bias", "head.bias", "Transformer/encoderblock_0/Extra_0/kernel"):
        assert key in str(err.value)


# ------------------------------------------------------------------------- timm hybrids
# timm's vision_transformer_hybrid.py: the ResNet (resnetv2.ResNetV2, preact=False,
# stem_type="same") sits in patch_embed.backbone; StdConv2dSame(eps=1e-8), GroupNorm eps 1e-5.
TIMM_STEM = dict(ws_eps=1e-8, ws_inside_sqrt=True, gn_eps=1e-5, gelu="exact")


def to_timm_names(ckpt, root_only=False):
    """vit_jax arrays -> the keys and layouts of timm's state dict, written out as timm names them."""
    conv = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(3, 2, 0, 1)))
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))
    sd = {}
    for k, v in ckpt.items():
        parts = k.split("/")
        if k == "conv_root/kernel":
            sd["patch_embed.backbone." + ("" if root_only else "stem.") + "conv.weight"] = conv(v)
        elif parts[0] == "gn_root":
            sd["patch_embed.backbone." + ("" if root_only else "stem.") + "norm." +
               {"scale": "weight", "bias": "bias"}[parts[1]]] = t(v.reshape(-1))
        elif parts[0].startswith("block") and parts[1].startswith("unit"):
            s, u = int(parts[0][5:]) - 1, int(parts[1][4:]) - 1
            pre = f"patch_embed.backbone.stages.{s}.blocks.{u}."
            layer = {"conv1": "conv1", "conv2": "conv2", "conv3": "conv3", "conv_proj": "downsample.conv",
                     "gn1": "norm1", "gn2": "norm2", "gn3": "norm3", "gn_proj": "downsample.norm"}[parts[2]]
            leaf = {"kernel": "weight", "scale": "weight", "bias": "bias"}[parts[3]]
            sd[f"{pre}{layer}.{leaf}"] = conv(v) if parts[3] == "kernel" else t(v.reshape(-1))
    sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"] = conv(ckpt["embedding/kernel"]), t(ckpt["embedding/bias"])
    sd["cls_token"], sd["pos_embed"] = t(ckpt["cls"]), t(ckpt["Transformer/posembed_input/pos_embedding"])
    i = 0
    while f"Transformer/encoderblock_{i}/LayerNorm_0/scale" in ckpt:
        b, o = f"Transformer/encoderblock_{i}/", f"blocks.{i}."
        a = b + "MultiHeadDotProductAttention_1/"
        D = ckpt[a + "query/kernel"].shape[0]
        sd[o + "norm1.weight"], sd[o + "norm1.bias"] = t(ckpt[b + "LayerNorm_0/scale"]), t(ckpt[b + "LayerNorm_0/bias"])
        sd[o + "attn.qkv.weight"] = t(np.concatenate([ckpt[a + n + "/kernel"].reshape(D, D).T for n in ("query", "key", "value")]))
        sd[o + "attn.qkv.bias"] = t(np.concatenate([ckpt[a + n + "/bias"].reshape(-1) for n in ("query", "key", "value")]))
        sd[o + "attn.proj.weight"] = t(ckpt[a + "out/kernel"].reshape(D, D).T)
        sd[o + "attn.proj.bias"] = t(ckpt[a + "out/bias"])
        sd[o + "norm2.weight"], sd[o + "norm2.bias"] = t(ckpt[b + "LayerNorm_2/scale"]), t(ckpt[b + "LayerNorm_2/bias"])
        for n in (0, 1):
            sd[o + f"mlp.fc{n + 1}.weight"] = t(ckpt[b + f"MlpBlock_3/Dense_{n}/kernel"].T)
            sd[o + f"mlp.fc{n + 1}.bias"] = t(ckpt[b + f"MlpBlock_3/Dense_{n}/bias"])
        i += 1
    sd["norm.weight"], sd["norm.bias"] = t(ckpt["Transformer/encoder_norm/scale"]), t(ckpt["Transformer/encoder_norm/bias"])
    sd["head.weight"], sd["head.bias"] = t(ckpt["head/kernel"].T), t(ckpt["head/bias"])
    return sd


@pytest.mark.parametrize("layers", [(1, 1), ()], ids=["r-stages", "root-only"])
def test_timm_hybrid_matches_timm_conventions(layers):
    ckpt = random_checkpoint(21, patch=1 if layers else 2, grid=4, resnet_layers=layers, hybrid=True)
    sd = to_timm_names(ckpt, root_only=not layers)
    model = load_model(sd, num_heads=2)
    r = model.cfg.resnet
    assert (r.layers, r.ws_eps, r.ws_eps_inside_sqrt, r.gn_eps, model.cfg.gelu) == (layers, 1e-8, True, 1e-5, "exact")
    size = model.cfg.img_size[0]
    x = images(22, size)
    np.testing.assert_allclose(vitlab_logits(model, x), official_forward(ckpt, x, "token", layers, TIMM_STEM),
                               atol=TOL, rtol=0)


def test_timm_non_square_and_dynamic_size():
    ckpt = random_checkpoint(23, patch=(2, 4), grid=(3, 2))  # 6 x 8 px
    sd = to_timm_names(ckpt)
    with pytest.raises(WeightsError, match="weights_img_size"):
        load_model(sd, num_heads=2)
    exact = dict(OFFICIAL, gelu="exact")
    model = load_model(sd, num_heads=2, weights_img_size=(6, 8))
    x = images(24, (6, 8))
    np.testing.assert_allclose(vitlab_logits(model, x), official_forward(ckpt, x, "token", (), exact), atol=TOL, rtol=0)
    dynamic = load_model(sd, num_heads=2, weights_img_size=(6, 8), dynamic_img_size=True)
    np.testing.assert_allclose(vitlab_logits(dynamic, x), vitlab_logits(model, x), atol=1e-6, rtol=0)
    bigger = images(25, (12, 16))  # timm resample_abs_pos_embed: bicubic, corners not aligned
    grid = torch.from_numpy(ckpt["Transformer/posembed_input/pos_embedding"][0, 1:]).reshape(1, 3, 2, -1)
    grid = torch.nn.functional.interpolate(grid.permute(0, 3, 1, 2), size=(6, 4), mode="bicubic",
                                           align_corners=False).permute(0, 2, 3, 1).reshape(1, 24, -1)
    table = np.concatenate([ckpt["Transformer/posembed_input/pos_embedding"][:, :1], grid.numpy()], axis=1)
    resized = {**ckpt, "Transformer/posembed_input/pos_embedding": table}
    np.testing.assert_allclose(vitlab_logits(dynamic, bigger), official_forward(resized, bigger, "token", (), exact),
                               atol=TOL, rtol=0)


def test_timm_no_embed_class():
    # timm no_embed_class=True: positions for the patches only, the [class] token prepended afterwards
    ckpt = random_checkpoint(26, grid=3)
    sd = to_timm_names(ckpt)
    sd["pos_embed"] = sd["pos_embed"][:, 1:].clone()
    model = load_model(sd, num_heads=2)
    table = ckpt["Transformer/posembed_input/pos_embedding"].copy()
    table[:, 0] = 0.0  # the same function: a zero position for the [class] token
    x = images(27, 12)
    np.testing.assert_allclose(vitlab_logits(model, x),
                               official_forward({**ckpt, "Transformer/posembed_input/pos_embedding": table}, x,
                                                "token", (), dict(OFFICIAL, gelu="exact")), atol=TOL, rtol=0)


def test_timm_class_token_and_a_k_by_k_plus_2_grid_is_not_read_as_no_embed_class():
    # a [class] position and a 3x5 grid make 16 positions, which read as timm's no_embed_class 4x4 grid: given
    # img_size= its own size (the advice for non-square weights), the table was resampled from 4x4 and the
    # logits were another model's, silently
    ckpt = random_checkpoint(30, patch=2, grid=(3, 5))  # 6 x 10 px
    sd = to_timm_names(ckpt)
    with pytest.raises(WeightsError, match=r"16 positions: a 4x4 grid without a \[class\] position .* or a \[class\] "
                                           r"position and the 15 patches of img_size=\(6, 10\); pass weights_img_size"):
        load_model(sd, num_heads=2, img_size=(6, 10))
    model = load_model(sd, num_heads=2, weights_img_size=(6, 10))
    x = images(31, (6, 10))
    exact = dict(OFFICIAL, gelu="exact")
    np.testing.assert_allclose(vitlab_logits(model, x), official_forward(ckpt, x, "token", (), exact), atol=TOL, rtol=0)


def test_weights_img_size_is_the_config_size():
    # a hybrid trained at 30 px has the 4x4 grid of 32 px (SAME padding rounds up): the config keeps 30
    ckpt = random_checkpoint(28, patch=1, grid=4, resnet_layers=(1, 1), hybrid=True)
    model = load_official_npz(ckpt, weights_img_size=30)
    assert model.cfg.img_size == (30, 30) and model.cfg.grid_size == (4, 4)
    x = images(29, 30)
    np.testing.assert_allclose(vitlab_logits(model, x), official_forward(ckpt, x, "token", (1, 1)), atol=TOL, rtol=0)
    with pytest.raises(WeightsError, match="weights_img_size=48 means a 6x6 grid"):
        load_official_npz(ckpt, weights_img_size=48)


@pytest.mark.parametrize("value", [(16,), "a", (16, 0)])
def test_a_weights_img_size_that_is_no_size_is_refused_under_its_own_name(value):
    # the official and Hugging Face loaders named it img_size, the argument that resizes the weights
    from vitlab.config import ConfigError

    with pytest.raises(ConfigError, match=r"^weights_img_size="):
        load_official_npz(random_checkpoint(32), weights_img_size=value)
