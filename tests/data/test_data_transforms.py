"""Tests for vitlab.data.transforms and vitlab.data.randaugment: batch augmentation ops."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageEnhance, ImageOps

from vitlab.config import ConfigError
from vitlab.data import randaugment, transforms
from vitlab.data.digits import load_digits_dataset
from vitlab.data.loader import BatchStream
from vitlab.data.memory import load_in_memory
from vitlab.data.transforms import (
    EvalTransform,
    TrainTransform,
    alternating_flip,
    build_transform,
    mixup_cutmix,
    one_hot_smooth,
    rand_augment,
    random_crop_with_padding,
    random_erasing,
    random_flip,
    random_resized_crop,
    resize,
    sample_boxes,
    to_float,
)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def batch(b: int = 8, h: int = 16, w: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (b, 3, h, w), generator=gen(seed), dtype=torch.uint8)


def to_pil(image_chw: torch.Tensor) -> Image.Image:
    return Image.fromarray(image_chw.permute(1, 2, 0).numpy())


def from_pil(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)


def test_to_float_range_is_exactly_minus_one_to_one():
    x = torch.tensor([0, 1, 127, 128, 254, 255], dtype=torch.uint8).view(1, 1, 1, 6)
    y = to_float(x)
    assert y.dtype == torch.float32
    assert y.flatten()[0].item() == -1.0 and y.flatten()[-1].item() == 1.0
    assert torch.all(y.flatten()[1:] > y.flatten()[:-1])


def test_flip_twice_is_identity_and_flips_some():
    x = batch(32)
    once = random_flip(x, gen(5))
    assert once.shape == x.shape and once.dtype == x.dtype
    assert torch.equal(random_flip(once, gen(5)), x)
    flipped = [(not torch.equal(once[i], x[i])) for i in range(32)]
    assert 0 < sum(flipped) < 32
    for i in range(32):
        assert torch.equal(once[i], x[i].flip(-1) if flipped[i] else x[i])


@pytest.mark.parametrize("out_size", [24, 10, (12, 20)])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_full_square_crop_equals_plain_resize(out_size, dtype):
    x = batch(4, 16, 16).to(dtype)
    crop = random_resized_crop(x, out_size, scale=(1.0, 1.0), ratio=(1.0, 1.0), generator=gen())
    plain = resize(x, out_size)
    assert crop.dtype == dtype and crop.shape == plain.shape
    if dtype == torch.uint8:  # exact halves (frequent at 2/3 scale) may round either way
        assert (crop.int() - plain.int()).abs().max() <= 1
    else:
        torch.testing.assert_close(crop, plain, atol=1e-3, rtol=0)


def test_crop_at_native_scale_is_an_exact_sub_block():
    x = torch.randn(6, 3, 8, 8, generator=gen())
    crop = random_resized_crop(x, 4, scale=(0.25, 0.25), ratio=(1.0, 1.0), generator=gen(1))
    assert crop.shape == (6, 3, 4, 4)
    for i in range(6):
        blocks = [x[i, :, y : y + 4, z : z + 4] for y in range(5) for z in range(5)]
        assert min((crop[i] - b).abs().max().item() for b in blocks) < 1e-5


def test_inception_crop_is_reproducible_and_varies_per_image():
    x = batch(16, 32, 32)
    a = random_resized_crop(x, 16, generator=gen(3))
    assert torch.equal(a, random_resized_crop(x, 16, generator=gen(3)))
    assert not torch.equal(a, random_resized_crop(x, 16, generator=gen(4)))
    assert a.shape == (16, 3, 16, 16) and a.dtype == torch.uint8


def recorded_boxes(monkeypatch) -> list:
    """The (x0, y0, w, h, found) of every ``sample_boxes`` call of the inception crop, as it draws them."""
    calls = []

    def recording(*args, **kwargs):
        calls.append(sample_boxes(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(transforms, "sample_boxes", recording)
    return calls


def in_memory_crops(data, monkeypatch, batches: int = 40, stored_sizes=True, scale=(0.05, 1.0)):
    """The crops of ``batches`` batches of 16 of an in-memory set, as training makes them, and their boxes."""
    calls = recorded_boxes(monkeypatch)
    stream = BatchStream(data.images, data.labels, 16, seed=3, stored_sizes=data.sizes if stored_sizes else None,
                         transform=build_transform(TrainTransform(num_classes=len(data.classes), image_size=16,
                                                                  crop_scale=scale, flip=False)))
    crops = []
    for _ in range(-(-batches // len(stream))):
        crops += [x for x, _ in stream]
    boxes = [torch.cat(parts) for parts in zip(*calls)]
    return torch.cat(crops), boxes


@pytest.mark.parametrize("stored", [(60, 80), (40, 80)])  # 4:3 and 2:1 landscape photos, held at 64x64
def test_an_in_memory_crop_draws_its_box_in_the_stored_image_s_geometry(make_folder, tmp_path, monkeypatch, stored):
    """Held in memory, the images are stretched to the training size; the box was drawn in that copy, so a 4:3
    photo's boxes spanned 1 to 16/9 of its own pixels (2:1's: 1.5 to 8/3), not the paper's 3/4 to 4/3 (as the
    streamed path, which crops the stored image, draws them)."""
    data = load_in_memory(make_folder(classes=2, per_class=8, size=stored), 64, cache_dir=tmp_path / "c", workers=1)
    assert data.images.shape[-2:] == (64, 64) and data.sizes.tolist() == [list(stored)] * 16
    _, (x0, y0, w, h, found) = in_memory_crops(data, monkeypatch)
    assert found.float().mean() > 0.9
    w, h = w[found], h[found]
    to_stored = (stored[1] / 64) / (stored[0] / 64)  # a box's aspect in the stored pixels over the copy's
    # rounded to the copy's pixels: the box drawn lies within half a pixel of each side
    assert ((w - 0.5) / (h + 0.5) * to_stored <= 4 / 3 + 1e-6).all()
    assert ((w + 0.5) / (h - 0.5) * to_stored >= 3 / 4 - 1e-6).all()
    aspect = w / h * to_stored
    assert (aspect < 0.85).any() and (aspect > 1.2).any()  # the whole range drawn
    assert ((w + 0.5) * (h + 0.5) >= 0.05 * 64 * 64).all() and ((w - 0.5) * (h - 0.5) <= 64 * 64).all()


@pytest.mark.parametrize("stored, held", [((32, 32), 32), ((32, 32), 48), ((8, 8), 24)])
def test_square_stored_images_crop_as_before_to_the_bit(make_folder, tmp_path, monkeypatch, stored, held):
    """CIFAR's 32x32 held at 32 or stretched to 48, and the digits' 8x8 at 24: their boxes' geometry is the
    same in the copy, which crops as it did without the stored sizes (the same draws, the same pixels)."""
    if stored == (8, 8):
        data = load_digits_dataset(held)
        data.images, data.labels, data.sizes = data.images[:64], data.labels[:64], data.sizes[:64]
    else:
        data = load_in_memory(make_folder(classes=2, per_class=32, size=stored), held, cache_dir=tmp_path / "c",
                              workers=1)
    assert data.sizes.tolist() == [list(stored)] * len(data)
    sized, sized_boxes = in_memory_crops(data, monkeypatch, batches=8)
    monkeypatch.undo()
    plain, plain_boxes = in_memory_crops(data, monkeypatch, batches=8, stored_sizes=False)
    assert torch.equal(sized, plain)
    assert all(torch.equal(a, b) for a, b in zip(sized_boxes, plain_boxes))


def test_crop_with_padding_is_a_crop_of_the_reflect_padded_image():
    x = batch(16, 8, 8)
    out = random_crop_with_padding(x, 2, generator=gen(2))
    assert out.shape == x.shape and out.dtype == x.dtype
    padded = F.pad(x.float(), (2, 2, 2, 2), mode="reflect")
    shifts = set()
    for i in range(16):
        match = [(dy, dx) for dy in range(5) for dx in range(5)
                 if torch.equal(padded[i, :, dy : dy + 8, dx : dx + 8], out[i].float())]
        assert match, f"image {i} is not a crop of the padded image"
        shifts.add(match[0])
    assert len(shifts) > 1
    assert torch.equal(random_crop_with_padding(x, 0, generator=gen()), x)


def test_resize_keeps_dtype_and_skips_same_size():
    x = batch(2, 16, 16)
    assert resize(x, 16) is x
    assert resize(x, (8, 12)).shape == (2, 3, 8, 12) and resize(x, 8).dtype == torch.uint8


def test_one_hot_smooth():
    t = one_hot_smooth(torch.tensor([3, 0]), 10, 0.1)
    assert t.shape == (2, 10) and t.dtype == torch.float32
    torch.testing.assert_close(t.sum(1), torch.ones(2))
    assert t[0, 3].item() == pytest.approx(0.91) and t[0, 0].item() == pytest.approx(0.01)
    assert torch.equal(one_hot_smooth(torch.tensor([1]), 3), torch.tensor([[0.0, 1.0, 0.0]]))


def test_mixup_mixes_images_and_targets_with_one_lambda():
    x = torch.randn(6, 3, 4, 4, generator=gen())
    t = one_hot_smooth(torch.arange(6), 6)
    mixed, soft = mixup_cutmix(x, t, 0.8, 0.0, 0.5, gen(1))
    torch.testing.assert_close(soft.sum(1), torch.ones(6))
    lam = soft[0, 0].item()
    assert 0 < lam < 1 and soft[0, 5].item() == pytest.approx(1 - lam)
    torch.testing.assert_close(mixed, lam * x + (1 - lam) * x.roll(1, 0))  # each with the one before it


@pytest.mark.parametrize("mixup, cutmix", [(0.8, 0.0), (0.0, 1.0)])
def test_no_image_of_an_odd_batch_is_mixed_with_itself(mixup, cutmix):
    # paired by mirrored positions (flip(0)), the middle image of an odd batch was its own partner: left
    # unmixed, with its one-hot target
    x = torch.arange(5, dtype=torch.float32).view(5, 1, 1, 1).expand(5, 3, 16, 16).contiguous()
    t = one_hot_smooth(torch.arange(5), 5)
    for seed in range(5):
        mixed, soft = mixup_cutmix(x, t, mixup, cutmix, 0.5, gen(seed))
        partner = soft.clone()
        partner[torch.arange(5), torch.arange(5)] = 0  # what each image took from another
        if (soft.diagonal() < 1).any():  # a draw that mixed (CutMix's box may fall outside the image)
            assert (partner.sum(1) > 0).all() and (partner.max(0).values > 0).all(), soft  # each gives once
            assert all(not torch.equal(mixed[i], x[i]) for i in range(5))


def test_cutmix_targets_match_pasted_area():
    x = torch.arange(6, dtype=torch.float32).view(6, 1, 1, 1).expand(6, 3, 16, 16).contiguous()
    t = one_hot_smooth(torch.arange(6), 6)
    for seed in range(5):
        mixed, soft = mixup_cutmix(x, t, 0.0, 1.0, 0.5, gen(seed))
        torch.testing.assert_close(soft.sum(1), torch.ones(6))
        own = (mixed[0] == 0).float().mean().item()  # image 0 is all zeros, its partner all fives
        assert soft[0, 0].item() == pytest.approx(own) and soft[0, 5].item() == pytest.approx(1 - own)


def test_mix_off_is_identity_and_mixup_needs_float():
    x, t = batch(4), one_hot_smooth(torch.arange(4), 4)
    assert mixup_cutmix(x, t, 0.0, 0.0, 0.5, gen())[0] is x
    with pytest.raises(TypeError, match="to_float"):
        mixup_cutmix(x, t, 0.8, 0.0, 0.5, gen())


def test_random_erasing():
    x = to_float(batch(16))
    assert torch.equal(random_erasing(x, 0.0, gen()), x)
    erased = random_erasing(x, 1.0, gen(1), value=0.0)
    assert erased.shape == x.shape
    for i in range(16):
        changed = (erased[i] != x[i]).any(0)
        rows, cols = changed.any(1).nonzero(), changed.any(0).nonzero()
        assert changed.any()
        box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
        # at most a third of the area, up to the rounding of the box sides
        assert box <= 16 * 16 / 3 * 1.25 and (erased[i][:, changed] == 0).all()


def test_rand_augment_shapes_determinism_and_identity():
    x = batch(32, 12, 20)
    a = rand_augment(x, 2, 9, generator=gen(7))
    assert a.shape == x.shape and a.dtype == torch.uint8
    assert torch.equal(a, rand_augment(x, 2, 9, generator=gen(7)))
    assert not torch.equal(a, x)
    assert torch.equal(rand_augment(x, 3, 9, generator=gen(7), ops=("identity",)), x)
    with pytest.raises(ValueError):
        rand_augment(x.float(), generator=gen())
    for magnitude in (-1, 10.5):  # the paper's 0-10 scale: beyond it the strengths extrapolate past any meaning
        with pytest.raises(ValueError, match=r"magnitude=.*: must be in \[0, 10\]"):
            rand_augment(x, 2, magnitude, generator=gen())
    with pytest.raises(ConfigError, match=r"randaug_magnitude=100: must be a number in \[0, 10\]"):
        TrainTransform(num_classes=10, randaug_ops=2, randaug_magnitude=100)


def test_rand_augment_takes_each_image_s_operation_from_the_host_generator():
    # with solarize at full magnitude every pixel is inverted: the images that were are those
    # whose drawn choice was solarize, drawn from the host generator where one is given
    from vitlab.data.draws import PartGenerators

    x = batch(64, 6, 6)
    inverted = lambda out: (out == 255 - x).flatten(1).all(1)  # noqa: E731
    for host in (None, gen(3)):
        out = rand_augment(x, 1, 10, generator=gen(7), ops=("identity", "solarize"), host_generator=host)
        expected = torch.randint(0, 2, (64,), generator=gen(7) if host is None else gen(3)) == 1
        assert torch.equal(inverted(out), expected) and 0 < expected.sum() < 64
    # a batch of parts, each with its host generator, chooses as each part does alone
    sizes, seeds = (40, 24), (5, 6)
    parts = PartGenerators([gen(1), gen(2)], sizes, hosts=[gen(s) for s in seeds])
    together = rand_augment(x, 2, 9, generator=parts, host_generator=parts.hosts)
    alone = [rand_augment(p, 2, 9, generator=gen(g), host_generator=gen(s))
             for p, g, s in zip(x.split(sizes), (1, 2), seeds)]
    assert torch.equal(together, torch.cat(alone))
    with pytest.raises(ValueError, match="one CPU generator per part"):
        PartGenerators([gen(1), gen(2)], sizes, hosts=[gen(5)])


def test_rand_augment_gives_each_image_its_own_operation_though_the_geometric_ones_warp_together():
    # one round over the five geometric operations and two others: every image is what its drawn
    # operation, at its drawn sign, makes of it alone
    ops = ("rotate", "shear_x", "shear_y", "translate_x", "translate_y", "solarize", "brightness")
    x = batch(48, 12, 10)
    out = rand_augment(x, 1, 7, generator=gen(4), ops=ops, host_generator=gen(9))
    choice = torch.randint(0, len(ops), (48,), generator=gen(9))
    sign = torch.where(torch.rand(48, generator=gen(4)) < 0.5, -1.0, 1.0)
    assert set(choice.tolist()) == set(range(len(ops)))  # every operation drawn at least once
    for i in range(48):
        alone = randaugment._OPS[ops[choice[i]]](x[i:i + 1], 0.7, sign[i:i + 1])
        assert torch.equal(out[i:i + 1], alone), (i, ops[choice[i]])


def _op(name, x, m, sign=1.0):
    return randaugment._OPS[name](x, m, torch.full((len(x),), sign))


def test_pointwise_ops_known_answers():
    x = torch.tensor([0, 100, 200, 255], dtype=torch.uint8).view(1, 1, 1, 4).expand(1, 3, 1, 4)
    assert _op("solarize", x, 0.5)[0, 0, 0].tolist() == [0, 100, 55, 0]  # threshold 128
    assert _op("posterize", x, 0.5)[0, 0, 0].tolist() == [0, 100, 200, 252]  # keep 6 bits
    assert _op("posterize", x, 1.0)[0, 0, 0].tolist() == [0, 96, 192, 240]  # keep 4 bits
    assert _op("brightness", x, 0.5, -1.0)[0, 0, 0].tolist() == [0, 55, 110, 140]  # factor 0.55


@pytest.mark.parametrize("magnitude", [0, 0.01, 1, 3, 7, 9, 10])
def test_solarize_inverts_the_pixels_its_threshold_names(magnitude):
    """At M the pixels >= 256 - 256 * M / 10 are inverted, timm's threshold (256 - int(256 * M / 10));
    where that is not a whole number the level below it was inverted too (25 at M = 9).  At M = 0
    (and below 1/256 of the scale) none: the threshold 256, compared with uint8 pixels, wrapped to 0
    and every pixel was inverted, the strongest solarize at the weakest magnitude."""
    levels = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16).expand(1, 3, 16, 16)
    inverted = (_op("solarize", levels, magnitude / 10) != levels)[0, 0].flatten().nonzero().flatten()
    assert inverted.tolist() == list(range(256 - int(256 * magnitude / 10), 256))


@pytest.mark.parametrize("name, pil", [
    ("autocontrast", ImageOps.autocontrast),
    ("equalize", ImageOps.equalize),
])
def test_histogram_ops_match_pil(name, pil):
    x = (batch(4, 16, 16) // 3 + 40).to(torch.uint8)  # narrow range so both ops do something
    ours = _op(name, x, 0.9)
    for i in range(4):
        assert (ours[i].int() - from_pil(pil(to_pil(x[i]))).int()).abs().max() <= 1


@pytest.mark.parametrize("name, enhancer", [
    ("color", ImageEnhance.Color),
    ("contrast", ImageEnhance.Contrast),
    ("brightness", ImageEnhance.Brightness),
    ("sharpness", ImageEnhance.Sharpness),
])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_enhance_ops_match_pil(name, enhancer, sign):
    x = batch(3, 10, 10)
    factor = 1 + 0.9 * 0.5 * sign
    ours = _op(name, x, 0.5, sign)
    for i in range(3):
        theirs = from_pil(enhancer(to_pil(x[i])).enhance(factor))
        assert (ours[i].int() - theirs.int()).abs().max() <= 2  # PIL rounds its grey levels


def test_geometric_ops_known_answers():
    x = batch(2, 8, 8)
    for name in ("rotate", "shear_x", "shear_y", "translate_x", "translate_y"):
        assert torch.equal(_op(name, x, 0.0), x)  # magnitude 0 is the identity
    m = 2 / (0.45 * 8)  # a shift of exactly 2 pixels
    moved = _op("translate_x", x, m)
    assert (moved[..., :6].int() - x[..., 2:].int()).abs().max() <= 1
    assert (moved[..., 6:] == 128).all()
    moved = _op("translate_y", x, m, -1.0)
    assert (moved[:, :, 2:].int() - x[:, :, :6].int()).abs().max() <= 1
    rotated = _op("rotate", x, 3.0)  # 90 degrees: a square image maps onto itself
    assert (rotated.int() - x.rot90(1, (2, 3)).int()).abs().max() <= 1 or \
           (rotated.int() - x.rot90(-1, (2, 3)).int()).abs().max() <= 1


def test_build_train_transform_pipeline():
    x, y = batch(8, 32, 32), torch.arange(8) % 10
    cfg = TrainTransform(num_classes=10, crop="pad", randaug_ops=2, mixup_alpha=0.8, cutmix_alpha=1.0,
                         label_smoothing=0.1, erase_prob=0.25)
    fn = build_transform(cfg)
    images, targets = fn(x, y, gen(1))
    assert images.shape == (8, 3, 32, 32) and images.dtype == torch.float32
    assert targets.shape == (8, 10)
    torch.testing.assert_close(targets.sum(1), torch.ones(8))
    again = fn(x, y, gen(1))
    assert torch.equal(images, again[0]) and torch.equal(targets, again[1])
    images, targets = build_transform(TrainTransform(num_classes=10, image_size=16))(x, y, gen())
    assert images.shape == (8, 3, 16, 16) and images.min() >= -1 and images.max() <= 1


def test_build_eval_transform():
    x, y = batch(4, 32, 32), torch.tensor([0, 1, 2, 3])
    images, targets = build_transform(EvalTransform(num_classes=4, image_size=48))(x, y, gen())
    assert images.shape == (4, 3, 48, 48)
    assert torch.equal(targets, torch.eye(4))
    images, _ = build_transform(EvalTransform(num_classes=4))(x, y, gen())
    assert torch.equal(images, to_float(x))


@pytest.mark.parametrize("cfg", [TrainTransform(num_classes=4, crop="pad"), EvalTransform(num_classes=4)],
                         ids=["train", "eval"])
def test_the_batch_transforms_take_uint8_pixels_only(cfg):
    """They scale pixels to [-1, 1] themselves (``to_float``): a float batch, already scaled (a [0, 1]
    batch, or this one in [-1, 1]), was scaled again, to about -1 everywhere, without a word."""
    with pytest.raises(TypeError, match=r"^images: expected uint8 pixels .* got torch.float32"):
        build_transform(cfg)(to_float(batch(4)), torch.arange(4), gen())


@pytest.mark.parametrize("kwargs, field", [
    (dict(crop="center"), "crop"),
    (dict(crop="inception"), "image_size"),
    (dict(crop="pad", mixup_alpha=-1.0), "mixup_alpha"),
    (dict(crop="pad", label_smoothing=1.0), "label_smoothing"),
    (dict(crop="pad", crop_scale=(0.5, 0.1)), "crop_scale"),
])
def test_train_transform_validation_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        TrainTransform(num_classes=10, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(crop="pad", crop_scale=(0.5, 1.0)), r"^crop_scale=\(0.5, 1.0\): shapes the inception crop, and crop='pad' is "
                                              r"another; set crop='inception', or leave it at \(0.05, 1.0\)$"),
    (dict(crop="none", crop_ratio=(0.5, 2.0)), r"^crop_ratio=\(0.5, 2.0\): shapes the inception crop, and crop='none'"),
    (dict(crop="pad", mixup_alpha=0.8, mix_switch_prob=0.9),
     r"^mix_switch_prob=0.9: chooses CutMix over mixup for a batch, and mixup_alpha=0.8, cutmix_alpha=0.0 leave no "
     r"choice; set both above 0, or leave it at 0.5$"),
])
def test_a_setting_of_a_method_not_in_use_is_refused(kwargs, match):
    # read by that method only: with another crop, or one way of mixing, it was accepted and did nothing
    with pytest.raises(ConfigError, match=match):
        TrainTransform(num_classes=10, **kwargs)
    assert TrainTransform(num_classes=10, image_size=8, crop_scale=(0.5, 1.0), crop_ratio=(0.5, 2.0)).crop_scale
    assert TrainTransform(num_classes=10, crop="pad", mixup_alpha=0.8, cutmix_alpha=1.0, mix_switch_prob=0.9)


def flipped_mask(out: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """(B,) bool: which outputs are the mirror images (asserting each is one or the other)."""
    mirrored = (out == images.flip(-1)).flatten(1).all(1)
    assert torch.all(mirrored | (out == images).flatten(1).all(1))
    return mirrored


def test_alternating_flip_mirrors_each_example_in_every_other_epoch():
    images = batch(1000, 4, 4)
    ids = torch.arange(1000) * 7 + 3
    first = flipped_mask(alternating_flip(images, ids, epoch=0), images)
    assert 400 < int(first.sum()) < 600  # a fair coin per example in the first epoch
    for epoch in range(1, 5):
        assert torch.equal(flipped_mask(alternating_flip(images, ids, epoch), images), first ^ bool(epoch % 2))
    other_seed = flipped_mask(alternating_flip(images, ids, epoch=0, seed=1), images)
    assert 0.3 < float((other_seed != first).float().mean()) < 0.7  # another seed, another pattern


def test_train_transform_alternate_flip_needs_example_ids():
    tf = build_transform(TrainTransform(num_classes=2, crop="none", flip=True, alternate_flip=True))
    x = batch(4, 8, 8)
    with pytest.raises(ValueError, match="example ids"):
        tf(x, torch.zeros(4, dtype=torch.long), gen())
    out, _ = tf(x, torch.zeros(4, dtype=torch.long), gen(), example_ids=torch.arange(4), epoch=1)
    assert torch.equal(out, to_float(alternating_flip(x, torch.arange(4), 1)))


def test_mixup_and_cutmix_draw_their_batch_numbers_from_the_host_generator():
    # on a GPU the batch's own numbers (method, lam, box) come from a CPU generator, so Python
    # never reads them back from the device: with one given, they depend on it alone
    from vitlab.data.transforms import mixup_cutmix

    images = torch.rand(6, 3, 8, 8)
    targets = torch.eye(6)

    def mixed(device_seed: int, host_seed: int) -> torch.Tensor:
        return mixup_cutmix(images, targets, 0.8, 1.0, 0.5, torch.Generator().manual_seed(device_seed),
                            host_generator=torch.Generator().manual_seed(host_seed))[1]

    for host_seed in range(4):
        assert torch.equal(mixed(0, host_seed), mixed(1, host_seed))
    assert len({tuple(mixed(0, s).flatten().tolist()) for s in range(8)}) > 1
    # without one, the generator's own draws as before (a CPU's generator is already on the host)
    plain = mixup_cutmix(images, targets, 0.8, 1.0, 0.5, torch.Generator().manual_seed(5))[1]
    assert torch.equal(plain, mixed(99, 5))


@pytest.mark.parametrize("crop", ["pad", "inception"])
def test_a_batch_of_parts_draws_what_each_part_draws_alone(crop):
    # the streamed path augments a micro-batch at once, each reader's part with its own
    # generator: every per-image augmentation gives what augmenting the parts one by one gives
    from vitlab.data.draws import PartGenerators

    tf = build_transform(TrainTransform(num_classes=5, crop=crop, image_size=(12, 12), flip=True, randaug_ops=2,
                                        erase_prob=0.5, label_smoothing=0.1))
    sizes, seeds = (3, 5, 1), (11, 12, 13)
    parts = [batch(n, 12, 12, seed=s) for n, s in zip(sizes, seeds)]
    labels = [torch.arange(n) % 5 for n in sizes]
    alone = [tf(x, y, gen(s), example_ids=torch.arange(len(y)), epoch=e)
             for x, y, s, e in zip(parts, labels, seeds, (0, 1, 0))]
    epochs = torch.cat([torch.full((n,), e) for n, e in zip(sizes, (0, 1, 0))])
    together = tf(torch.cat(parts), torch.cat(labels), PartGenerators([gen(s) for s in seeds], sizes),
                  example_ids=torch.cat([torch.arange(n) for n in sizes]), epoch=epochs, host_generator=gen(0))
    assert torch.equal(together[0], torch.cat([x for x, _ in alone]))
    assert torch.equal(together[1], torch.cat([y for _, y in alone]))
    # alternating flips follow each example's own epoch: one example at epochs 0 and 1 is mirrored once
    alternate = build_transform(TrainTransform(num_classes=5, crop="none", flip=True, alternate_flip=True))
    image = batch(1, 12, 12).expand(8, -1, -1, -1)
    x = alternate(image, torch.zeros(8, dtype=torch.long), PartGenerators([gen(1), gen(2)], sizes[:2]),
                  example_ids=torch.zeros(8, dtype=torch.long), epoch=epochs[:8])[0]
    assert torch.equal(x[:3], x[:1].expand(3, -1, -1, -1)) and torch.equal(x[3:], x[3:4].expand(5, -1, -1, -1))
    assert torch.equal(x[0], x[3].flip(-1)) and not torch.equal(x[0], x[3])


def test_per_batch_numbers_do_not_come_from_the_parts():
    from vitlab.data.draws import PartGenerators

    generators = PartGenerators([gen(1), gen(2)], (2, 3))
    with pytest.raises(ValueError, match="host_generator"):
        mixup_cutmix(torch.rand(5, 3, 4, 4), torch.eye(5), 0.8, 0.0, 0.5, generators)
    with pytest.raises(ValueError, match="one per part"):
        PartGenerators([gen(1)], (2, 3))
