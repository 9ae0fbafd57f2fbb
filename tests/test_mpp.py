"""Masked patch prediction (paper Sec. 4.6, Appendix B.1.2) against hand computations."""
from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.config import ConfigError, ResNetConfig, ViTConfig
from vitlab.models.mpp import (KEPT, MASKED, NUM_COLORS, SWAPPED, MaskedPatchPrediction, color_classes,
                               corrupt_patches, patch_targets)

torch.set_num_threads(2)


def tiny(**fields) -> ViTConfig:
    base = dict(img_size=16, patch_size=8, width=32, depth=1, mlp_dim=64, num_heads=4, num_classes=5)
    base.update(fields)
    return ViTConfig(**base)


def test_corruption_selects_the_rate_and_splits_80_10_10():
    g = torch.Generator().manual_seed(0)
    B, N, D = 64, 50, 4
    patches = torch.arange(B * N, dtype=torch.float32).reshape(B, N, 1).expand(B, N, D).contiguous()
    mask = torch.full((D,), -7.0)
    counts = torch.zeros(4)
    for _ in range(40):
        out, fate = corrupt_patches(patches, mask, 0.5, g)
        assert ((fate > 0).sum(1) == 25).all()  # exactly half of every image
        counts += torch.bincount(fate.flatten(), minlength=4).float()
        assert (out[fate == MASKED] == -7.0).all()
        assert torch.equal(out[(fate == 0) | (fate == KEPT)], patches[(fate == 0) | (fate == KEPT)])
        swapped = out[fate == SWAPPED][:, 0]
        assert ((swapped >= 0) & (swapped < B * N) & (swapped == swapped.round())).all()  # some real patch
    chosen = counts[1:].sum()
    assert chosen == 40 * B * 25
    shares = counts[1:] / chosen
    # 64,000 draws: the standard error of a 10% share is 0.12 percentage points
    assert abs(shares[MASKED - 1] - 0.8) < 0.01
    assert abs(shares[SWAPPED - 1] - 0.1) < 0.01 and abs(shares[KEPT - 1] - 0.1) < 0.01
    _, fate15 = corrupt_patches(patches, mask, 0.15, g)
    assert ((fate15 > 0).sum(1) == round(0.15 * N)).all()


def test_a_swapped_patch_takes_another_patch_of_the_batch():
    # the paper's "random other patch embedding": the donor was drawn from all B * N patches, itself
    # included, so in a batch of 4 patches a quarter of the "swapped" ones were left as they were
    g = torch.Generator().manual_seed(0)
    B, N = 2, 2
    patches = torch.arange(B * N, dtype=torch.float32).reshape(B, N, 1)
    donors = torch.zeros(B * N, B * N)
    for _ in range(2000):
        out, fate = corrupt_patches(patches, torch.tensor([-1.0]), 1.0, g)
        swapped = fate == SWAPPED
        donors[patches[swapped][:, 0].long(), out[swapped][:, 0].long()] += 1
    assert donors.diagonal().sum() == 0  # never itself
    others = donors[~torch.eye(B * N, dtype=torch.bool)]
    assert donors.sum() > 700 and others.min() > 0.6 * others.mean()  # any other patch, of either image
    _, fate1 = corrupt_patches(patches[:1, :1], torch.tensor([-1.0]), 1.0, g)  # one patch: no other to take
    assert fate1.shape == (1, 1)


def test_three_bit_colour_bins_of_known_colours():
    rgb = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0],
                        [0.124, 0.126, 0.5], [0.999, 0.5, 0.25]])
    # 8 levels per channel: floor(v * 8) clamped to 7; index = r * 64 + g * 8 + b
    assert color_classes(rgb).tolist() == [0, 511, 7 * 64, 7, 0 * 64 + 1 * 8 + 4, 7 * 64 + 4 * 8 + 2]


def test_patch_targets_of_a_painted_image():
    img = torch.zeros(1, 3, 16, 16)
    img[:, 0, :8, :8] = 1.0  # top-left patch red
    img[:, 2, :8, 8:] = 1.0  # top-right blue
    img[:, :, 8:, :8] = 0.5  # bottom-left grey
    img[:, 1, 8:, 8:12] = 1.0  # bottom-right: left half green -> mean green 0.5
    scaled = img * 2 - 1  # the model's [-1, 1] inputs
    color = patch_targets(scaled, (8, 8), "color")
    assert color.tolist() == [[7 * 64, 7, 4 * 64 + 4 * 8 + 4, 4 * 8]]
    small = patch_targets(scaled, (8, 8), "color4x4")
    assert small.shape == (1, 4, 16)
    assert (small[0, 0] == 7 * 64).all() and (small[0, 2] == 4 * 64 + 4 * 8 + 4).all()
    # bottom-right 4x4: columns 0-1 green (2 pixels of 8 wide -> the first two cells), 2-3 black
    assert small[0, 3].reshape(4, 4)[:, :2].eq(7 * 8).all() and small[0, 3].reshape(4, 4)[:, 2:].eq(0).all()
    pixels = patch_targets(scaled, (8, 8), "pixels")
    assert pixels.shape == (1, 4, 8 * 8 * 3)
    torch.testing.assert_close(pixels[0, 1].reshape(8, 8, 3), img[0, :, :8, 8:].permute(1, 2, 0))


@pytest.mark.parametrize("target", ["color", "color4x4", "pixels"])
def test_mpp_loss_trains_and_reads_only_corrupted_patches(target):
    torch.manual_seed(0)
    model = MaskedPatchPrediction(vitlab.create_model(tiny()), target=target)
    images = torch.rand(4, 3, 16, 16) * 2 - 1
    out = model(images, torch.Generator().manual_seed(1))
    selected = (out.fate > 0).sum().item()
    assert selected == 4 * 2  # half of 4 patches, 4 images
    assert out.predictions.shape[0] == out.targets.shape[0] == selected
    if target != "pixels":  # a zero head predicts uniformly: the loss is log(512)
        assert abs(out.loss.item() - torch.log(torch.tensor(float(NUM_COLORS))).item()) < 1e-4
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = out.loss.item()
    for _ in range(30):
        opt.zero_grad()
        loss = model(images, torch.Generator().manual_seed(1)).loss
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first
    assert model.mask_token.grad is not None and model.mask_token.grad.abs().sum() > 0


def test_mpp_refuses_what_it_cannot_pre_train():
    with pytest.raises(ConfigError, match="target='colour'"):
        MaskedPatchPrediction(vitlab.create_model(tiny()), target="colour")
    with pytest.raises(ConfigError, match="divisible by 4"):
        MaskedPatchPrediction(vitlab.create_model(tiny(patch_size=2)), target="color4x4")
    hybrid = tiny(img_size=32, patch_size=1, resnet=ResNetConfig(layers=(1,), img_size=32))
    with pytest.raises(ConfigError, match="plain ViT"):
        MaskedPatchPrediction(vitlab.create_model(hybrid))
    with pytest.raises(ConfigError, match="rate"):
        MaskedPatchPrediction(vitlab.create_model(tiny()), rate=0.0)


def test_a_rate_of_less_than_one_patch_corrupts_one():
    # round(0.1 * 4) = 0 patches: nothing to predict, and the head's empty batch failed in the forward
    _, fate = corrupt_patches(torch.zeros(3, 4, 2), torch.ones(2), 0.1, torch.Generator().manual_seed(0))
    assert ((fate > 0).sum(1) == 1).all()
    out = MaskedPatchPrediction(vitlab.create_model(tiny()), rate=0.1)(torch.rand(2, 3, 16, 16) * 2 - 1)
    assert out.predictions.shape[0] == 2 and torch.isfinite(out.loss)


def test_the_colour_targets_need_rgb_patches():
    # a grey model's colour classes failed as an IndexError in the targets; four channels read the first three
    for channels in (1, 4):
        with pytest.raises(ConfigError, match=rf"^target='color': the colour classes are of RGB patches, and "
                                              rf"in_chans={channels}; 'pixels' takes any channels$"):
            MaskedPatchPrediction(vitlab.create_model(tiny(in_chans=channels)))
    out = MaskedPatchPrediction(vitlab.create_model(tiny(in_chans=1)), target="pixels")(torch.rand(2, 1, 16, 16))
    assert out.targets.shape == (4, 64)
    with pytest.raises(ConfigError, match=r"^rate='0.5': expected a fraction in \(0, 1\]$"):  # was a TypeError
        MaskedPatchPrediction(vitlab.create_model(tiny()), rate="0.5")


def test_mpp_recipe_pre_trains_a_vit_that_fine_tuning_takes_unchanged(tmp_path):
    from vitlab.train import train
    from vitlab.configs import load_recipe
    from vitlab.train.overrides import with_changes
    from vitlab.weights import load_model

    tiny = dict(img_size=8, patch_size=4, width=16, depth=1, num_heads=2, mlp_dim=32, name="ViT-tiny/4")
    cfg = with_changes(load_recipe("mpp:target=color4x4"), {
        "model.name": "ViT-Ti/16", "model.overrides": tiny, "model.img_size": None, "data.source": "digits",
        "data.val_split": 100, "augment.crop": "none", "augment.flip": False, "optim.batch_size": 32,
        "optim.steps": 4, "optim.warmup": 1, "optim.lr": 1e-3, "run.precision": "fp32", "run.log_every": 2,
        "run.ckpt_every": 0, "run.threads": 1, "run.out": str(tmp_path / "mpp")})
    assert cfg.model.mpp == "color4x4" and cfg.model.mpp_rate == 0.5
    summary = train(cfg, verbose=False)
    assert summary["val_top1"] is None and summary["steps"] == 4 and summary["train_loss"] > 0
    backbone = load_model(summary["weights"])
    assert type(backbone).__name__ == "VisionTransformer" and backbone.cfg.patch_size == (4, 4)
    fine = with_changes(cfg, {"model.mpp": None, "model.init": summary["weights"], "optim.steps": 2,
                         "run.out": str(tmp_path / "ft")})
    result = train(fine, verbose=False)
    assert result["val_top1"] is not None


def test_mpp_config_names_the_allowed_targets():
    from vitlab.train.config import ModelConfig

    with pytest.raises(ConfigError, match="model.mpp='colour'.*color, color4x4, pixels"):
        ModelConfig(mpp="colour")
    with pytest.raises(ConfigError, match="model.mpp_rate"):
        ModelConfig(mpp="color", mpp_rate=0.0)


def test_mpp_experiment_targets_per_budget():
    from vitlab.experiments.common import Settings
    from vitlab.experiments.mpp import targets_at

    default = Settings(extra={"budgets": (3.0, 9.0)})
    assert targets_at(default, 3.0) == ("color", "color4x4", "pixels") and targets_at(default, 9.0) == ("color",)
    # one long budget alone would otherwise train all three targets
    chosen = Settings(extra={"budgets": (30.0,), "targets": "color"})
    assert targets_at(chosen, 30.0) == ("color",)
    assert targets_at(Settings(extra={"targets": ("pixels", "color")}), 0) == ("pixels", "color")
    with pytest.raises(ValueError, match="targets='colour'.*color, color4x4, pixels"):
        targets_at(Settings(extra={"targets": "colour"}), 0)
