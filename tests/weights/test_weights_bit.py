"""BiT (google-research/big_transfer) .npz checkpoints into vitlab's BiT ResNets.

The reference is an independent float64 numpy transcription of big_transfer's
``bit_pytorch/models.py`` forward (StdConv2d, PreActBottleneck, ResNetV2), run on random
arrays named and shaped as the released ``BiT-M-R50x1.npz`` files are (the names
``ResNetV2.load_from`` reads).  It shares no code with vitlab.
"""
import numpy as np
import pytest
import torch

from vitlab.weights import WeightsError, load_model
from vitlab.weights.bit import load_bit, save_bit_npz

TOL = 3e-5


def conv(x, kernel, stride=1, pad=0):  # x NHWC, kernel HWIO: torch.nn.Conv2d(padding=pad), symmetric
    kh, kw = kernel.shape[:2]
    x = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    oh, ow = (x.shape[1] - kh) // stride + 1, (x.shape[2] - kw) // stride + 1
    out = 0.0
    for i in range(kh):
        for j in range(kw):
            out = out + np.einsum("nhwc,co->nhwo", x[:, i:i + stride * (oh - 1) + 1:stride,
                                                     j:j + stride * (ow - 1) + 1:stride], kernel[i, j])
    return out


def std_conv(x, kernel, stride=1, pad=0):  # bit_pytorch StdConv2d: (w - m) / sqrt(v + 1e-10) over (in, kh, kw)
    m, v = kernel.mean(axis=(0, 1, 2)), kernel.var(axis=(0, 1, 2))
    return conv(x, (kernel - m) / np.sqrt(v + 1e-10), stride, pad)


def group_norm(x, gamma, beta, groups=32, eps=1e-5):  # torch.nn.GroupNorm(32, C) defaults
    n, h, w, c = x.shape
    g = x.reshape(n, h, w, groups, c // groups)
    g = (g - g.mean(axis=(1, 2, 4), keepdims=True)) / np.sqrt(g.var(axis=(1, 2, 4), keepdims=True) + eps)
    return g.reshape(n, h, w, c) * gamma.reshape(-1) + beta.reshape(-1)


relu = lambda v: np.maximum(v, 0)


def unit(p, pre, x, stride):  # PreActBottleneck.forward
    out = relu(group_norm(x, p[pre + "a/group_norm/gamma"], p[pre + "a/group_norm/beta"]))
    residual = x
    if pre + "a/proj/standardized_conv2d/kernel" in p:
        residual = std_conv(out, p[pre + "a/proj/standardized_conv2d/kernel"], stride)
    out = std_conv(out, p[pre + "a/standardized_conv2d/kernel"])
    out = relu(group_norm(out, p[pre + "b/group_norm/gamma"], p[pre + "b/group_norm/beta"]))
    out = std_conv(out, p[pre + "b/standardized_conv2d/kernel"], stride, pad=1)
    out = relu(group_norm(out, p[pre + "c/group_norm/gamma"], p[pre + "c/group_norm/beta"]))
    return std_conv(out, p[pre + "c/standardized_conv2d/kernel"]) + residual


def bit_forward(p, images, layers):
    """bit_pytorch ResNetV2.forward (eval); images NHWC."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = std_conv(images, p["resnet/root_block/standardized_conv2d/kernel"], 2, pad=3)
    x = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))  # ConstantPad2d(1, 0), then MaxPool2d(3, 2)
    oh, ow = (x.shape[1] - 3) // 2 + 1, (x.shape[2] - 3) // 2 + 1
    x = np.max([x[:, i:i + 2 * (oh - 1) + 1:2, j:j + 2 * (ow - 1) + 1:2] for i in range(3) for j in range(3)], axis=0)
    for s, units in enumerate(layers, 1):
        for u in range(1, units + 1):
            x = unit(p, f"resnet/block{s}/unit{u:02d}/", x, 2 if s > 1 and u == 1 else 1)
    x = relu(group_norm(x, p["resnet/group_norm/gamma"], p["resnet/group_norm/beta"]))
    x = x.mean(axis=(1, 2))
    return x @ p["resnet/head/conv2d/kernel"][0, 0] + p["resnet/head/conv2d/bias"]


def bit_checkpoint(seed, layers=(1, 2), width_factor=1, classes=5, in_chans=3, head=True):
    """Random arrays with big_transfer's names and shapes (HWIO kernels, (C,) GroupNorm params)."""
    rng = np.random.default_rng(seed)
    r = lambda *shape, s=0.3: (rng.standard_normal(shape) * s).astype(np.float32)
    root = 64 * width_factor
    p = {"resnet/root_block/standardized_conv2d/kernel": r(7, 7, in_chans, root)}
    cin = root
    for s, units in enumerate(layers, 1):
        mid = root * 2 ** (s - 1)
        for u in range(1, units + 1):
            pre = f"resnet/block{s}/unit{u:02d}/"
            for sub, (ci, co, k) in zip("abc", [(cin, mid, 1), (mid, mid, 3), (mid, 4 * mid, 1)]):
                p[pre + f"{sub}/standardized_conv2d/kernel"] = r(k, k, ci, co)
                p[pre + f"{sub}/group_norm/gamma"] = 1 + r(ci, s=0.1)  # pre-activation: norms the input
                p[pre + f"{sub}/group_norm/beta"] = r(ci, s=0.1)
            if u == 1:
                p[pre + "a/proj/standardized_conv2d/kernel"] = r(1, 1, cin, 4 * mid)
            cin = 4 * mid
    p["resnet/group_norm/gamma"], p["resnet/group_norm/beta"] = 1 + r(cin, s=0.1), r(cin, s=0.1)
    if head:
        p["resnet/head/conv2d/kernel"], p["resnet/head/conv2d/bias"] = r(1, 1, cin, classes), r(classes, s=0.1)
    return p


def images(seed, size, n=2):
    return np.random.default_rng(seed).standard_normal((n, size, size, 3)).astype(np.float32)


def logits(model, x):
    with torch.no_grad():
        return model(torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()).double().numpy()


@pytest.mark.parametrize("layers, size", [((1, 2), 32), ((2, 1, 1), 29)])
def test_bit_npz_matches_big_transfer_forward(tmp_path, layers, size):
    ckpt = bit_checkpoint(0, layers)
    np.savez(tmp_path / "tiny-bit.npz", **ckpt)  # a name that names no model: the arrays decide
    model = load_model(tmp_path / "tiny-bit.npz")
    cfg = model.cfg
    assert (cfg.layers, cfg.width_factor, cfg.num_classes, cfg.name) == (layers, 1, 5, f"BiT-R{3 * sum(layers) + 2}x1")
    assert (cfg.padding, cfg.ws_eps, cfg.ws_eps_inside_sqrt, cfg.gn_eps) == ("symmetric", 1e-10, True, 1e-5)
    x = images(1, size)
    ref = bit_forward(ckpt, x, layers)
    np.testing.assert_allclose(logits(model, x), ref, atol=TOL * max(1.0, np.abs(ref).max()), rtol=0)


def test_bit_width_factor_new_head_and_round_trip(tmp_path):
    ckpt = bit_checkpoint(2, (1,), width_factor=2)
    model = load_bit(ckpt, num_classes=3)  # BiT fine-tuning: a zero head
    assert model.cfg.width_factor == 2 and model.cfg.num_classes == 3 and not model.head.conv.weight.any()
    same = load_bit(ckpt)
    save_bit_npz(same, tmp_path / "out.npz")
    with np.load(tmp_path / "out.npz") as npz:
        written = {k: npz[k] for k in npz.files}
    assert set(written) == set(ckpt)
    for k in ckpt:
        np.testing.assert_array_equal(written[k], ckpt[k], err_msg=k)


def test_bit_mismatches_are_listed_together():
    ckpt = bit_checkpoint(3, (1, 1))
    del ckpt["resnet/block2/unit01/b/group_norm/beta"], ckpt["resnet/head/conv2d/bias"]
    ckpt["resnet/block1/unit01/d/standardized_conv2d/kernel"] = np.zeros((1, 1, 1, 1), np.float32)
    ckpt["resnet/group_norm/gamma"] = ckpt["resnet/group_norm/gamma"][:-32]
    with pytest.raises(WeightsError) as err:
        load_model(ckpt)
    msg = str(err.value)
    for key in ("body.block2.unit01.gn2.bias", "head.conv.bias", "resnet/block1/unit01/d/standardized_conv2d/kernel",
                "shape mismatch for before_head.gn.weight"):
        assert key in msg, key


def test_a_misshaped_root_is_refused_like_a_misshaped_unit():
    """BiT's root is 7x7: a (3, 3, 3, 64) root kernel does not make a 3x3 root, it is an error."""
    ckpt = bit_checkpoint(4, (1, 1))
    root = "resnet/root_block/standardized_conv2d/kernel"
    ckpt[root] = ckpt[root][2:5, 2:5]  # (3, 3, 3, 64)
    ckpt["resnet/block2/unit01/b/standardized_conv2d/kernel"] = np.zeros((1, 1, 128, 128), np.float32)
    with pytest.raises(WeightsError) as err:
        load_model(ckpt)
    msg = str(err.value)
    assert "shape mismatch for root.conv.weight: weights (64, 3, 3, 3), model (64, 3, 7, 7)" in msg
    assert "shape mismatch for body.block2.unit01.conv2.weight: weights (128, 128, 1, 1), model (128, 128, 3, 3)" in msg
    assert "missing" not in msg and "unexpected" not in msg
    ckpt["resnet/block2/unit01/b/standardized_conv2d/kernel"] = np.zeros((3, 3, 128, 128), np.float32)
    assert load_model(ckpt, root_kernel=3).root.conv.weight.shape == (64, 3, 3, 3)  # asked for: then it is one


def test_a_file_named_for_a_model_must_hold_it(tmp_path):
    """``BiT-M-R50x1.npz`` names big_transfer's R50x1 (blocks 3, 4, 6, 3): arrays of another
    model under that name are refused, every missing block named, not loaded as what they hold."""
    np.savez(tmp_path / "BiT-M-R50x1.npz", **bit_checkpoint(5, (1, 2)))
    with pytest.raises(WeightsError) as err:
        load_model(tmp_path / "BiT-M-R50x1.npz")
    msg = str(err.value)
    assert "BiT-M-R50x1.npz do not match the model" in msg
    for key in ("body.block1.unit03.conv1.weight", "body.block3.unit06.conv3.weight", "body.block4.unit03.gn3.bias"):
        assert key in msg, key
    from vitlab.weights.bit import named_model

    assert [named_model(n) for n in ("BiT-M-R50x1.npz", "BiT-S-R152x4.npz", "BiT-M-R101x3-ILSVRC2012.npz",
                                     "bit.npz", "BiT-M-R7x1.npz")] == ["R50x1", "R152x4", "R101x3", None, None]


def test_a_bit_of_another_root_or_conventions_is_not_written_as_big_transfer_s(tmp_path):
    """big_transfer's .npz holds arrays only, read back with BiT's 7x7/2 root and max-pool and its conventions:
    a BiT of a gentler root (root_stride=1 or no pool, for small images) was written and read back as
    another model, other logits without a word, and its other conventions were dropped unsaid (a ViT's
    .npz warns of them)."""
    from vitlab.config import ResNetConfig
    from vitlab.models.registry import build_model
    from vitlab.weights import ConventionWarning

    bit = dict(layers=(1, 1), num_classes=3, img_size=32, padding="symmetric", ws_eps=1e-10, ws_eps_inside_sqrt=True,
               gn_eps=1e-5)
    for fields, reason in ((dict(root_stride=1), "root_stride=1"), (dict(root_pool=False), "root_pool=False"),
                           (dict(root_kernel=3), "root_kernel=3")):
        with pytest.raises(WeightsError, match=rf"^big_transfer's \.npz cannot hold this model: {reason} \("):
            save_bit_npz(build_model(ResNetConfig(**bit, **fields)), tmp_path / "b.npz")
        assert not (tmp_path / "b.npz").exists()
    with pytest.warns(ConventionWarning, match=r"padding: the model uses 'same', big_transfer computes with "
                                               r"'symmetric'; gn_eps: the model uses 1e-06"):
        save_bit_npz(build_model(ResNetConfig(**{**bit, "padding": "same", "gn_eps": 1e-6})), tmp_path / "b.npz")
