"""Batch augmentations as tensor ops, and the per-batch transform the training loop calls.

Every function takes a whole (B, C, H, W) batch, draws per-image parameters from an
explicit ``torch.Generator`` and runs on the batch's device, so a batch's augmentation
is a pure function of (images, generator state) and costs a handful of kernel calls
instead of B Python-level PIL calls.  Random parameters are drawn on the generator's
device and then moved, so a CPU generator also drives a GPU batch.

Geometric ops accept uint8 or float batches and return the input dtype (uint8 results
are rounded).  The pipeline order of ``build_transform`` is:

    crop (inception or pad-and-crop) -> flip -> RandAugment (uint8) -> to_float
    -> random erasing -> mixup/cutmix,   labels -> smoothed one-hot targets

``to_float`` scales to [-1, 1] as the official code does (x / 127.5 - 1), not with
ImageNet mean/std.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

from vitlab.config import (ConfigError, is_number, need, need_bool, need_choice, need_int, need_number,
                           to_pair)
from vitlab.data import draws
from vitlab.data.randaugment import rand_augment

__all__ = [
    "to_float",
    "resize",
    "random_resized_crop",
    "random_flip",
    "random_crop_with_padding",
    "check_crop_pad",
    "rand_augment",
    "mixup_cutmix",
    "one_hot_smooth",
    "random_erasing",
    "Augmentation",
    "TrainTransform",
    "EvalTransform",
    "build_transform",
    "BatchTransform",
]

Size = Union[int, tuple[int, int]]
# (uint8 images, labels, generator, *, example_ids=None, epoch=0, seed=0) -> (inputs, targets);
# the keywords locate the batch in the data set and the stream's seed, for augmentations
# that follow an example across epochs (alternating flip); an in-memory set's batches also
# carry source_sizes, each image's stored (height, width), the inception crop's geometry
BatchTransform = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _uniform(shape: tuple[int, ...], generator: torch.Generator, device: torch.device,
             low: float = 0.0, high: float = 1.0) -> torch.Tensor:
    """U(low, high) samples drawn on the generator's device, returned on ``device``."""
    u = draws.rand(shape, generator)
    return (low + (high - low) * u).to(device)


def _as_float(images: torch.Tensor) -> torch.Tensor:
    return images if images.is_floating_point() else images.float()


def _like(result: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """Cast an interpolated float result back to the input's dtype."""
    if images.is_floating_point():
        return result.to(images.dtype)
    return result.round_().clamp_(0, 255).to(images.dtype)


def to_float(images: torch.Tensor) -> torch.Tensor:
    """uint8 (B, C, H, W) in [0, 255] -> float32 in [-1, 1] as x / 127.5 - 1 (vit_jax)."""
    if images.is_floating_point():
        return images.to(torch.float32) / 127.5 - 1.0  # out of place: a float input stays untouched
    return images.to(torch.float32).div_(127.5).sub_(1.0)  # the same arithmetic on the one new tensor


def resize(images: torch.Tensor, size: Size, antialias: bool = False) -> torch.Tensor:
    """Bilinear resize of a batch to ``size`` (int or (H, W)); the fine-tuning preprocessing.

    antialias: False matches ``tf.image.resize``'s default, which the official input
        pipeline uses; True low-pass filters first when shrinking.
    """
    h, w = to_pair(size, "size")
    if tuple(images.shape[-2:]) == (h, w):
        return images
    out = F.interpolate(_as_float(images), size=(h, w), mode="bilinear", align_corners=False, antialias=antialias)
    return _like(out, images)


def sample_boxes(
    batch: int, height, width, scale: tuple[float, float], ratio: tuple[float, float],
    generator: torch.Generator, attempts: int = 10, source: Optional[tuple[Any, Any]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-image boxes covering ``scale`` of the area with aspect ``ratio`` (w / h).

    Like torchvision's RandomResizedCrop sampling, all attempts drawn at once: area and
    log-aspect uniform, the first attempt that fits inside the image wins.  ``height`` and
    ``width`` are ints (one size for the batch) or (B,) tensors (a size per image: the
    streamed path samples each stored image's box in its own pixels).

    source: (height, width), ints or (B,) tensors, of the images that ``height`` x ``width``
        ones were resized from (stretched: the in-memory sets), or None (the same).  The
        boxes are then the source image's boxes (their area fraction and aspect in its
        pixels) drawn in the resized one's pixels: a box's aspect there is the source's
        times the stretch (W / W0) / (H / H0), which is 1 for an image not stretched, whose
        boxes are the same as without ``source``, to the bit.

    Returns (x0, y0, w, h, found), each (B,) float on the generator's device; ``found`` is
    False where no attempt fitted (those boxes are the whole image).
    """
    dev = generator.device

    def per_image(size) -> torch.Tensor:  # one size for all: filled on the device, no copy from the host
        if isinstance(size, torch.Tensor):
            return size.to(dev, torch.float32).expand(batch)
        return torch.full((batch,), float(size), device=dev)

    height, width = per_image(height), per_image(width)
    area = _uniform((batch, attempts), generator, dev, scale[0], scale[1]) * (height * width)[:, None]
    aspect = torch.exp(_uniform((batch, attempts), generator, dev, math.log(ratio[0]), math.log(ratio[1])))
    if source is not None:  # the source's aspect drawn; in the resized pixels it is stretched
        aspect = aspect * ((width * per_image(source[0])) / (height * per_image(source[1])))[:, None]
    w = torch.sqrt(area * aspect).round()
    h = torch.sqrt(area / aspect).round()
    fits = (w >= 1) & (h >= 1) & (w <= width[:, None]) & (h <= height[:, None])
    first = fits.int().argmax(dim=1, keepdim=True)  # index of the first attempt that fits
    found = fits.any(dim=1)
    w = torch.where(found, w.gather(1, first).squeeze(1), width)
    h = torch.where(found, h.gather(1, first).squeeze(1), height)
    x0 = torch.floor(_uniform((batch,), generator, dev) * (width - w + 1))
    y0 = torch.floor(_uniform((batch,), generator, dev) * (height - h + 1))
    return x0, y0, w, h, found


def random_resized_crop(
    images: torch.Tensor,
    out_size: Size,
    scale: tuple[float, float] = (0.05, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    *,
    generator: torch.Generator,
    source_sizes: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The "inception crop" of the official input pipeline, batched.

    Each image gets a box of ``scale`` of its area and aspect ratio in ``ratio``; the box
    is resampled bilinearly to ``out_size`` with one ``grid_sample`` call.  When no box
    fits in 10 attempts the whole image is used, as ``tf.image.sample_distorted_bounding_box``
    does.  Like ``tf.image.resize`` (no antialiasing) small boxes of large images alias.

    images: (B, C, H, W) uint8 or float.  Returns (B, C, *out_size), same dtype.
    source_sizes: (B, 2) each image's (height, width) before it was resized to H x W (the
        in-memory sets': ``InMemoryDataset.sizes``): the boxes' area fraction and aspect
        are then of that image (``sample_boxes``'s ``source``), not of the stretched copy.
        None: the images are as they were stored.
    """
    out_h, out_w = to_pair(out_size, "out_size")
    b, c, height, width = images.shape
    source = None if source_sizes is None else (source_sizes[:, 0], source_sizes[:, 1])
    x0, y0, w, h, _ = sample_boxes(b, height, width, scale, ratio, generator, source=source)
    # Normalised coordinates (align_corners=False) run from -1 at the left edge of pixel 0
    # to +1 at the right edge of pixel W-1; the box [x0, x0 + w) maps onto [-1, 1].
    theta = torch.zeros(b, 2, 3, device=generator.device)
    theta[:, 0, 0] = w / width
    theta[:, 0, 2] = (2 * x0 + w) / width - 1
    theta[:, 1, 1] = h / height
    theta[:, 1, 2] = (2 * y0 + h) / height - 1
    grid = F.affine_grid(theta.to(images.device), [b, c, out_h, out_w], align_corners=False)
    # "border" clamps sample points to the edge pixels, as F.interpolate does, so a
    # full-image box equals a plain resize.
    out = F.grid_sample(_as_float(images), grid, mode="bilinear", padding_mode="border", align_corners=False)
    return _like(out, images)


def random_flip(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Flip each image left-right with probability 1/2.  (B, C, H, W) -> same."""
    flip = _uniform((images.shape[0],), generator, images.device) < 0.5
    return torch.where(flip.view(-1, 1, 1, 1), images.flip(-1), images)


def alternating_flip(images: torch.Tensor, example_ids: torch.Tensor, epoch: Union[int, torch.Tensor],
                     seed: int = 0) -> torch.Tensor:
    """Flip each example in every other epoch: at random in epoch 0, the opposite in epoch 1.

    A derandomised flip (Jordan 2024, "94% on CIFAR-10 in 3.29 seconds"): with random flips
    an example is seen twice in the same orientation in half of consecutive epoch pairs;
    alternating shows both in every pair.  The epoch-0 choice is a hash of the example's
    index and ``seed``, so it is reproducible without saved state.
    images: (B, C, H, W); example_ids: (B,) int64 indices into the data set; epoch: the
    batch's, or (B,) each example's (a streamed batch gathers readers at different epochs).
    """
    flip = (_mix32(example_ids.to(images.device, torch.int64) + seed * 0x9E3779B9) >> 31).bool()
    if isinstance(epoch, torch.Tensor):
        flip ^= (epoch.to(images.device) % 2).bool()
    else:
        flip ^= bool(epoch % 2)
    return torch.where(flip.view(-1, 1, 1, 1), images.flip(-1), images)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: every input bit moves every output bit (int64 holds it;
    products that overflow wrap modulo 2**64, which the mask reduces modulo 2**32 exactly)."""
    x = x & 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & 0xFFFFFFFF
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _reflect(index: torch.Tensor, size: int) -> torch.Tensor:
    """Map indices in [-size+1, 2*size-2] into [0, size) by mirroring at the edges (no edge repeat)."""
    index = index.abs()
    return torch.where(index >= size, 2 * (size - 1) - index, index)


def check_crop_pad(pad: int, size: Size, name: str = "pad") -> None:
    """Refuse a reflect padding that images of ``size`` cannot give: 0 <= pad < min(H, W).

    ``name`` is the option as the caller's user spells it (``augment.crop_pad``)."""
    h, w = to_pair(size, "size")
    if not 0 <= pad < min(h, w):
        raise ConfigError(f"{name}={pad}: reflect padding needs 0 <= {name} < min(H, W) = {min(h, w)} for {h}x{w} "
                          "images")


def random_crop_with_padding(images: torch.Tensor, pad: int = 4, *, generator: torch.Generator) -> torch.Tensor:
    """CIFAR's pad-and-crop with reflection: reflect-pad by ``pad`` pixels, then crop back to
    H x W at random.  The ResNet papers' form pads with zeros; reflection (Wide ResNets',
    airbench's) fills the border with the image's own pixels.

    Implemented as a per-image shift of the sampling indices with reflection at the
    edges, which equals padding then cropping without building the padded batch.

    images: (B, C, H, W), any dtype; needs pad < H and pad < W (``check_crop_pad``).  Returns the same shape.
    """
    b, c, h, w = images.shape
    check_crop_pad(pad, (h, w))
    dy = draws.randint(-pad, pad + 1, (b, 1), generator).to(images.device)
    dx = draws.randint(-pad, pad + 1, (b, 1), generator).to(images.device)
    rows = _reflect(torch.arange(h, device=images.device) + dy, h)  # (B, H)
    cols = _reflect(torch.arange(w, device=images.device) + dx, w)  # (B, W)
    out = images.gather(2, rows.view(b, 1, h, 1).expand(b, c, h, w))
    return out.gather(3, cols.view(b, 1, 1, w).expand(b, c, h, w))


def one_hot_smooth(labels: torch.Tensor, num_classes: int, smoothing: float = 0.0) -> torch.Tensor:
    """(B,) int64 labels -> (B, num_classes) float32 targets that sum to 1.

    Label smoothing spreads ``smoothing`` uniformly over all classes (the true class
    keeps 1 - smoothing + smoothing / num_classes), as timm and big_vision do.
    """
    off = smoothing / num_classes
    targets = torch.full((labels.shape[0], num_classes), off, device=labels.device)
    return targets.scatter_(1, labels.view(-1, 1).long(), 1.0 - smoothing + off)


def _beta(alpha: float, generator: torch.Generator) -> float:
    # torch's Beta sampler takes no generator; seed numpy's from the generator instead so
    # the draw stays a function of the generator state.
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    return float(np.random.default_rng(seed).beta(alpha, alpha))


def mixup_cutmix(
    images: torch.Tensor,
    targets_onehot: torch.Tensor,
    mixup_alpha: float,
    cutmix_alpha: float,
    switch_prob: float,
    generator: torch.Generator,
    host_generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixup (Zhang et al. 2018) or CutMix (Yun et al. 2019), one of them per batch.

    Every image is mixed with the one before it in the batch, the first with the last
    (``roll(1, 0)``), with one weight lam ~ Beta(alpha, alpha) for the batch, as timm's batch
    mode does; timm pairs the mirrored positions (``flip(0)``), which leaves the middle image of
    an odd batch mixed with itself, unmixed with its one-hot target.  With
    both alphas > 0, CutMix is chosen with probability ``switch_prob``.  For CutMix lam is
    corrected to the pasted box's actual area.  An alpha of 0 disables that method.

    images:  (B, C, H, W) float (mixup) or any dtype (cutmix only).
    targets_onehot: (B, K) soft targets summing to 1; the result still sums to 1.
    host_generator: a CPU generator for the batch's own numbers (the method, lam, the box),
        which Python needs: drawn from a GPU's generator they would be read back from the
        device, and the batch would wait for it (``generator`` itself where it is a CPU's).
    Returns (mixed images, mixed targets).
    """
    if mixup_alpha <= 0 and cutmix_alpha <= 0:
        return images, targets_onehot
    host = host_generator if host_generator is not None else generator
    use_cutmix = _uniform((1,), host, host.device).item() < switch_prob
    if cutmix_alpha > 0 and (use_cutmix or mixup_alpha <= 0):
        lam = _beta(cutmix_alpha, host)
        _, _, h, w = images.shape
        cut = math.sqrt(1.0 - lam)
        cut_h, cut_w = int(h * cut), int(w * cut)
        cy = int(torch.randint(0, h, (1,), generator=host, device=host.device))
        cx = int(torch.randint(0, w, (1,), generator=host, device=host.device))
        y0, y1 = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, h)
        x0, x1 = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, w)
        mixed = images.clone()
        mixed[:, :, y0:y1, x0:x1] = images.roll(1, 0)[:, :, y0:y1, x0:x1]
        lam = 1.0 - (y1 - y0) * (x1 - x0) / (h * w)
    else:
        if not images.is_floating_point():
            raise TypeError("mixup needs float images; apply to_float first")
        lam = _beta(mixup_alpha, host)
        mixed = images * lam + images.roll(1, 0) * (1.0 - lam)
    return mixed, targets_onehot * lam + targets_onehot.roll(1, 0) * (1.0 - lam)


def random_erasing(
    images: torch.Tensor,
    prob: float,
    generator: torch.Generator,
    *,
    scale: tuple[float, float] = (0.02, 1 / 3),
    ratio: tuple[float, float] = (0.3, 3.3),
    value: Optional[float] = None,
) -> torch.Tensor:
    """Random Erasing (Zhong et al. 2020): with probability ``prob`` per image, replace a
    random box (``scale`` of the area, aspect in ``ratio``) with noise or a constant.

    images: (B, C, H, W) float, normally after ``to_float``.
    value:  None fills with N(0, 1) noise per pixel (timm's "pixel" mode); a number fills
            with that constant.
    """
    b, c, h, w = images.shape
    x0, y0, bw, bh, found = (t.to(images.device) for t in sample_boxes(b, h, w, scale, ratio, generator))
    erase = found & (_uniform((b,), generator, images.device) < prob)
    ys = torch.arange(h, device=images.device).view(1, h, 1)
    xs = torch.arange(w, device=images.device).view(1, 1, w)
    inside = (ys >= y0.view(-1, 1, 1)) & (ys < (y0 + bh).view(-1, 1, 1))
    inside = inside & (xs >= x0.view(-1, 1, 1)) & (xs < (x0 + bw).view(-1, 1, 1))
    mask = (inside & erase.view(-1, 1, 1)).unsqueeze(1)  # (B, 1, H, W)
    if value is None:
        fill = draws.randn(images.shape, generator).to(images.device, images.dtype)
    else:
        fill = torch.full((), value, dtype=images.dtype, device=images.device)
    return torch.where(mask, fill, images)


CROPS = ("inception", "pad", "none")


def _need_range(name: str, pair: Any, low: float, high: float) -> None:
    need(isinstance(pair, tuple) and len(pair) == 2 and all(is_number(v) for v in pair)
         and low <= pair[0] <= pair[1] <= high, name, pair, f"expected (min, max) with {low} <= min <= max <= {high}")


@dataclass(frozen=True)
class Augmentation:
    """What training augments, declared once: ``TrainTransform`` adds the class count and
    the output size, the training config's ``augment`` section adds its name.

    crop:         "inception" (random_resized_crop, the official pipeline), "pad" (CIFAR's
                  pad-and-crop by ``crop_pad`` pixels, padded by reflection, not zeros) or "none".
    crop_scale, crop_ratio: the inception crop's (min, max) area fraction and aspect ratio.
    flip:         random left-right mirroring; with ``alternate_flip``, each example is
                  mirrored in every other epoch instead (``alternating_flip``; needs the
                  stream's example ids, and flip).
    randaug_ops:  RandAugment N (0 = off); ``randaug_magnitude`` is M on the 0-10 scale.
                  Not in the paper; used by the DeiT/AugReg recipes for ViT without
                  large-scale pre-training.
    mixup_alpha, cutmix_alpha, mix_switch_prob: see ``mixup_cutmix`` (0 = off); with both,
                  the probability of CutMix for a batch.
    label_smoothing: mass spread uniformly over classes (0 = plain one-hot).
    erase_prob:   random erasing probability per image (0 = off).
    """

    crop: str = "inception"
    crop_scale: tuple[float, float] = (0.05, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    crop_pad: int = 4
    flip: bool = True
    alternate_flip: bool = False
    randaug_ops: int = 0
    randaug_magnitude: float = 9.0
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    mix_switch_prob: float = 0.5
    label_smoothing: float = 0.0
    erase_prob: float = 0.0

    def __post_init__(self) -> None:
        need_choice("crop", self.crop, CROPS)
        for name in ("crop_scale", "crop_ratio"):  # a list from JSON: the tuple a frozen config holds
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        _need_range("crop_scale", self.crop_scale, 0.0, 1.0)
        _need_range("crop_ratio", self.crop_ratio, 1e-6, math.inf)
        need(self.crop_scale[1] > 0, "crop_scale", self.crop_scale, "the largest area must be > 0")
        need_int("crop_pad", self.crop_pad, 0)
        for name in ("flip", "alternate_flip"):
            need_bool(name, getattr(self, name))
        need(self.flip or not self.alternate_flip, "alternate_flip", self.alternate_flip,
             "mirrors each example in every other epoch in place of flip's random mirroring, and needs flip=True "
             "(with flip=False nothing is mirrored)")
        need_int("randaug_ops", self.randaug_ops, 0)
        need(is_number(self.randaug_magnitude) and 0 <= self.randaug_magnitude <= 10, "randaug_magnitude",
             self.randaug_magnitude, "must be a number in [0, 10], RandAugment's scale (9 is the paper's for ImageNet)")
        for name in ("mixup_alpha", "cutmix_alpha"):
            need_number(name, getattr(self, name))
        for name in ("mix_switch_prob", "erase_prob"):
            value = getattr(self, name)
            need(is_number(value) and 0 <= value <= 1, name, value, "must be a probability in [0, 1]")
        need_number("label_smoothing", self.label_smoothing, 0.0, below=1.0)
        if self.refuses_unread:
            for name, why in self.unread_settings().items():
                need(False, name, getattr(self, name), why)

    # a training config's section refuses a setting no form of it reads, its devices' forms counted
    # (``TrainConfig``): a recipe's GPU form may turn on the method that reads it
    refuses_unread = True

    # refused where a value the recipe does not have is set (``TrainConfig.check_augment_changes_read``),
    # not against the default: a recipe's own value stays when its method is turned off (the demo's crop_pad
    # after crop=none, the CIFAR recipe's GPU magnitude after randaug_ops=0) and does nothing, unasked for
    UNREAD_AGAINST_RECIPE = ("crop_pad", "randaug_magnitude")

    def settings_read(self) -> dict[str, tuple[bool, str]]:
        """{field: (whether this form reads it, why not)} of the settings that one method alone
        reads: the inception crop's shape, the pad crop's padding, RandAugment's magnitude, the
        choice between mixup and CutMix."""
        inception = (self.crop == "inception",
                     f"shapes the inception crop, and crop={self.crop!r} is another; set crop='inception'")
        return {"crop_scale": inception, "crop_ratio": inception,
                "crop_pad": (self.crop == "pad", f"pads the pad-and-crop, and crop={self.crop!r} is another; "
                                                 "set crop='pad'"),
                "randaug_magnitude": (self.randaug_ops > 0, "is RandAugment's magnitude, and randaug_ops=0 turns "
                                                            "RandAugment off; set randaug_ops above 0"),
                "mix_switch_prob": (self.mixup_alpha > 0 and self.cutmix_alpha > 0,
                                    f"chooses CutMix over mixup for a batch, and mixup_alpha={self.mixup_alpha}, "
                                    f"cutmix_alpha={self.cutmix_alpha} leave no choice; set both above 0")}

    def unread_settings(self) -> dict[str, str]:
        """{field: why} of the settings changed from their defaults that only a method not in use
        reads (the inception crop's shape with another crop, the choice between mixup and CutMix
        without both): accepted, such a value did nothing."""
        unread = {}
        for name, (read, why) in self.settings_read().items():
            default = Augmentation.__dataclass_fields__[name].default
            if name not in self.UNREAD_AGAINST_RECIPE and getattr(self, name) != default and not read:
                unread[name] = f"{why}, or leave it at {default}"
        return unread


@dataclass(frozen=True, kw_only=True)
class TrainTransform(Augmentation):
    """Training augmentation (``Augmentation``'s fields), applied per batch by ``build_transform``.

    num_classes:  size of the soft targets.
    image_size:   output (H, W); required for crop="inception"; for "pad"/"none" the batch
                  is first resized to it if given.
    """

    num_classes: int
    image_size: Optional[Size] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        need_int("num_classes", self.num_classes, 1)
        if self.image_size is not None:
            object.__setattr__(self, "image_size", to_pair(self.image_size, "image_size"))
        if self.crop == "inception" and self.image_size is None:
            raise ConfigError("crop='inception' needs image_size (the output size of the crop)")


@dataclass(frozen=True)
class EvalTransform:
    """Evaluation preprocessing: plain resize to ``image_size`` (None keeps the size),
    scaling to [-1, 1] and one-hot targets."""

    num_classes: int
    image_size: Optional[Size] = None

    def __post_init__(self) -> None:
        need_int("num_classes", self.num_classes, 1)
        if self.image_size is not None:
            object.__setattr__(self, "image_size", to_pair(self.image_size, "image_size"))


def _check_pixels(images: torch.Tensor) -> None:
    # the transforms scale to [-1, 1] themselves: a float batch (already scaled) would be scaled twice
    if images.dtype != torch.uint8:
        raise TypeError(f"images: expected uint8 pixels (B, C, H, W) in [0, 255], which the transform scales to "
                        f"[-1, 1] itself; got {images.dtype}")


def _train(cfg: TrainTransform, images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator, *,
           example_ids: Optional[torch.Tensor] = None, epoch: int = 0, seed: int = 0,
           host_generator: Optional[torch.Generator] = None,
           batch_sizes: Optional[Sequence[int]] = None,
           source_sizes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    _check_pixels(images)
    if cfg.crop == "inception":  # boxes of the images as stored, where memory holds them stretched (source_sizes)
        images = random_resized_crop(images, cfg.image_size, cfg.crop_scale, cfg.crop_ratio, generator=generator,
                                     source_sizes=source_sizes)
    else:
        if cfg.image_size is not None:
            images = resize(images, cfg.image_size)
        if cfg.crop == "pad" and cfg.crop_pad > 0:
            images = random_crop_with_padding(images, cfg.crop_pad, generator=generator)
    if cfg.flip and cfg.alternate_flip:
        if example_ids is None:
            raise ValueError("alternate_flip needs the batch's example ids (BatchStream passes them)")
        images = alternating_flip(images, example_ids, epoch, seed)
    elif cfg.flip:
        images = random_flip(images, generator)
    if cfg.randaug_ops:
        # each image's choice of operation from a host generator where the batch has one: the
        # parts' own for a streamed batch (a part is augmented the same whoever gathers it)
        hosts = generator.hosts if isinstance(generator, draws.PartGenerators) else host_generator
        images = rand_augment(images, cfg.randaug_ops, cfg.randaug_magnitude, generator=generator,
                              host_generator=hosts)
    x = to_float(images)
    if cfg.erase_prob > 0:
        x = random_erasing(x, cfg.erase_prob, generator)
    targets = one_hot_smooth(labels.to(x.device), cfg.num_classes, cfg.label_smoothing)
    if batch_sizes is None or (cfg.mixup_alpha <= 0 and cfg.cutmix_alpha <= 0):
        return mixup_cutmix(x, targets, cfg.mixup_alpha, cfg.cutmix_alpha, cfg.mix_switch_prob, generator,
                            host_generator)
    # a group of batches made in one call (BatchStream's augment_batches): each batch mixed within
    # itself, on its own draws (in turn from the group's generators), as a batch made alone is
    mixed = [mixup_cutmix(xb, tb, cfg.mixup_alpha, cfg.cutmix_alpha, cfg.mix_switch_prob, generator, host_generator)
             for xb, tb in zip(x.split(list(batch_sizes)), targets.split(list(batch_sizes)))]
    return torch.cat([xb for xb, _ in mixed]), torch.cat([tb for _, tb in mixed])


def _eval(cfg: EvalTransform, images: torch.Tensor, labels: torch.Tensor,
          generator: Optional[torch.Generator] = None, **_location) -> tuple[torch.Tensor, torch.Tensor]:
    _check_pixels(images)
    if cfg.image_size is not None:
        images = resize(images, cfg.image_size)
    x = to_float(images)
    return x, one_hot_smooth(labels.to(x.device), cfg.num_classes)


def build_transform(cfg: Union[TrainTransform, EvalTransform]) -> BatchTransform:
    """The per-batch function ``(uint8 (B, 3, H, W), labels (B,), generator) ->
    (float32 (B, 3, h, w) in [-1, 1] (before erasing/mixing), (B, K) soft targets)``; other
    image dtypes are refused (TypeError)."""
    if isinstance(cfg, TrainTransform):
        return functools.partial(_train, cfg)
    if isinstance(cfg, EvalTransform):
        return functools.partial(_eval, cfg)
    raise ConfigError(f"build_transform: expected TrainTransform or EvalTransform, got {type(cfg).__name__}")
