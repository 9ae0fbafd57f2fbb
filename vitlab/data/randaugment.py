"""RandAugment (Cubuk et al. 2020) on uint8 image batches, as tensor ops.

Each image gets ``num_ops`` operations, each drawn uniformly (with replacement) from the
14 below, all at one global ``magnitude``.  Images that drew the same operation in the
same slot are processed together, and those that drew any of the five geometric ones
are warped together, each by its own affine map, so a batch costs at most 9 * num_ops
small calls (where each launches kernels on a GPU, fewer calls are less host time) and
runs on whatever device the batch lives on.  The grouping is done on the host: with a
CPU ``host_generator`` for the choices, a batch on a GPU is augmented without the host
waiting for the device.

Magnitude is on the paper's 0-10 scale (M=9 for ImageNet in the paper) and maps to
operation strengths as timm's "increasing" variant does (the ``inc1`` of DeiT's
``rand-m9-mstd0.5-inc1``), but for posterize: a larger magnitude is always a stronger
distortion.  As in the paper's RandAugment, and unlike timm's, every drawn operation is applied
(timm's each with probability 0.5) at the one magnitude (timm's ``mstd0.5`` draws it per
operation from N(M, 0.5)).  With ``m = magnitude / 10``:

    rotate                 +-30*m degrees        shear_x/y    +-0.3*m
    translate_x/y          +-0.45*m of the size  solarize     invert pixels >= 256 - 256*m
    posterize              keep 8 - int(4*m) bits (the paper's 4-8; timm's keeps 4 - int(4*m), down to 0)
    color/contrast/brightness/sharpness   blend factor max(0.1, 1 +- 0.9*m)
    identity, autocontrast, equalize      no magnitude

Signs are drawn per image with probability 1/2.  Geometric operations resample
bilinearly about the image centre and fill uncovered pixels with grey (128).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from vitlab.data import draws

__all__ = ["rand_augment", "RAND_AUGMENT_OPS"]

RAND_AUGMENT_OPS = (
    "identity", "autocontrast", "equalize", "rotate", "solarize", "color", "posterize",
    "contrast", "brightness", "sharpness", "shear_x", "shear_y", "translate_x", "translate_y",
)
FILL = 128.0


def _to_uint8(x: torch.Tensor) -> torch.Tensor:
    return x.round_().clamp_(0, 255).to(torch.uint8)


def _grayscale(x: torch.Tensor) -> torch.Tensor:
    """(b, 3, H, W) float -> (b, 1, H, W) luma with ITU-R 601 weights, as PIL's "L" mode."""
    return (0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3])


def _blend(x: torch.Tensor, degenerate: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """PIL ImageEnhance: degenerate + factor * (image - degenerate), per-image factor (b,)."""
    xf = x.float()
    return _to_uint8(degenerate + factor.view(-1, 1, 1, 1) * (xf - degenerate))


def _enhance_factor(m: float, sign: torch.Tensor) -> torch.Tensor:
    return (1.0 + 0.9 * m * sign).clamp_(min=0.1)


def _autocontrast(x: torch.Tensor, m: float, sign: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    lo = xf.amin(dim=(2, 3), keepdim=True)
    hi = xf.amax(dim=(2, 3), keepdim=True)
    flat = hi <= lo  # a constant channel is left as it is, as PIL does
    scale = torch.where(flat, torch.ones_like(hi), 255.0 / (hi - lo).clamp_(min=1.0))
    lo = torch.where(flat, torch.zeros_like(lo), lo)
    return ((xf - lo) * scale).clamp_(0, 255).to(torch.uint8)


def _equalize(x: torch.Tensor, m: float, sign: torch.Tensor) -> torch.Tensor:
    """Histogram equalisation per image and channel with PIL's lookup-table rule."""
    b, c, h, w = x.shape
    flat = x.reshape(b * c, h * w).long()
    # scatter_add rather than bincount, which reads its input's maximum back from a GPU
    hist = torch.zeros(b * c, 256, dtype=torch.int64, device=x.device).scatter_add_(1, flat, torch.ones_like(flat))
    # PIL spreads all pixels but those of the last occupied level over 255 steps.
    last = (hist > 0).long() * torch.arange(256, device=x.device)
    last_count = hist.gather(1, last.argmax(dim=1, keepdim=True))
    step = (hist.sum(dim=1, keepdim=True) - last_count) // 255
    before = hist.cumsum(dim=1) - hist  # pixels strictly below each level
    lut = ((before + step // 2) // step.clamp(min=1)).clamp_(max=255)
    lut = torch.where(step == 0, torch.arange(256, device=x.device).expand(b * c, 256), lut)
    return lut.gather(1, flat).to(torch.uint8).view(b, c, h, w)


def _solarize(x: torch.Tensor, m: float, sign: torch.Tensor) -> torch.Tensor:
    threshold = 256 - int(256 * min(m, 1.0))  # timm's: the first level >= 256 - 256 * m
    if threshold > 255:  # no level reaches it; 256 as a uint8 comparison would wrap to 0 and invert every pixel
        return x
    return torch.where(x >= threshold, 255 - x, x)


def _posterize(x: torch.Tensor, m: float, sign: torch.Tensor) -> torch.Tensor:
    bits = max(1, min(8, 8 - int(4 * m)))
    mask = (0xFF << (8 - bits)) & 0xFF
    return x & mask


def _color(x: torch.Tensor, m: float, sign: torch.Tensor) -> torch.Tensor:
    return _blend(x, _grayscale(x.float()), _enhance_factor(m, sign))


def _contrast(x: torch.Tensor, m: float, sign: torch.Tensor) -> torch.Tensor:
    mean = _grayscale(x.float()).mean(dim=(1, 2, 3), keepdim=True)
    return _blend(x, mean, _enhance_factor(m, sign))


def _brightness(x: torch.Tensor, m: float, sign: torch.Tensor) -> torch.Tensor:
    return _blend(x, torch.zeros((), device=x.device), _enhance_factor(m, sign))


def _sharpness(x: torch.Tensor, m: float, sign: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    # PIL's SMOOTH filter, 5 amid 1s, made on the device: writing the 5 into a GPU tensor
    # would copy it from the host and wait for the GPU
    kernel = F.pad(torch.full((1, 1), 5.0, device=x.device), (1, 1, 1, 1), value=1.0)
    kernel = (kernel / 13.0).expand(x.shape[1], 1, 3, 3)
    smooth = F.conv2d(xf, kernel, groups=x.shape[1])
    degenerate = xf.clone()
    degenerate[:, :, 1:-1, 1:-1] = smooth  # PIL keeps the one-pixel border unfiltered
    return _blend(x, degenerate, _enhance_factor(m, sign))


def _warp(x: torch.Tensor, matrix: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Resample with a per-image affine map from output to input pixel coordinates.

    matrix: (b, 2, 2) and shift: (b, 2) in pixels, (x, y) order, about the image centre.
    grid_sample wants the map in normalised coordinates, where x spans W/2 pixels per unit
    and y spans H/2, so the off-diagonal terms are rescaled by the aspect ratio.
    """
    b, c, h, w = x.shape
    theta = torch.empty(b, 2, 3, device=x.device)
    theta[:, 0, 0] = matrix[:, 0, 0]
    theta[:, 0, 1] = matrix[:, 0, 1] * (h / w)
    theta[:, 1, 0] = matrix[:, 1, 0] * (w / h)
    theta[:, 1, 1] = matrix[:, 1, 1]
    theta[:, 0, 2] = shift[:, 0] * (2.0 / w)
    theta[:, 1, 2] = shift[:, 1] * (2.0 / h)
    grid = F.affine_grid(theta, [b, c + 1, h, w], align_corners=False)
    # A channel of ones, warped with the image, says how much of each output pixel is covered.
    padded = torch.cat([x.float(), torch.ones(b, 1, h, w, device=x.device)], dim=1)
    warped = F.grid_sample(padded, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    image, cover = warped[:, :c], warped[:, c:]
    return _to_uint8(image + (1.0 - cover) * FILL)


# The geometric operations as affine maps: (m, per-image sign) -> (matrix (b, 2, 2), shift (b, 2)),
# so that every image of a round that drew one is warped in one ``_warp`` call (``rand_augment``).
Affine = Callable[[float, torch.Tensor, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]]


def _rotation(m: float, sign: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    angle = sign * math.radians(30.0 * m)
    cos, sin = torch.cos(angle), torch.sin(angle)
    matrix = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)
    return matrix, torch.zeros(len(sign), 2, device=sign.device)


def _shearing(axis: int) -> Affine:
    def affine(m: float, sign: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        matrix = torch.eye(2, device=sign.device).repeat(len(sign), 1, 1)
        matrix[:, axis, 1 - axis] = 0.3 * m * sign  # x_in = x + s*y (shear_x) or y_in = y + s*x
        return matrix, torch.zeros(len(sign), 2, device=sign.device)

    return affine


def _translation(axis: int) -> Affine:
    def affine(m: float, sign: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        size = shape[3] if axis == 0 else shape[2]
        shift = torch.zeros(len(sign), 2, device=sign.device)
        shift[:, axis] = 0.45 * m * size * sign
        return torch.eye(2, device=sign.device).repeat(len(sign), 1, 1), shift

    return affine


_AFFINE: dict[str, Affine] = {
    "rotate": _rotation, "shear_x": _shearing(0), "shear_y": _shearing(1),
    "translate_x": _translation(0), "translate_y": _translation(1),
}


def _geometric(affine: Affine) -> Callable[[torch.Tensor, float, torch.Tensor], torch.Tensor]:
    """The operation that warps a batch by ``affine``."""
    return lambda x, m, sign: _warp(x, *affine(m, sign, tuple(x.shape)))


_OPS: dict[str, Callable[[torch.Tensor, float, torch.Tensor], torch.Tensor]] = {
    "autocontrast": _autocontrast,
    "equalize": _equalize,
    "solarize": _solarize,
    "color": _color,
    "posterize": _posterize,
    "contrast": _contrast,
    "brightness": _brightness,
    "sharpness": _sharpness,
    **{name: _geometric(affine) for name, affine in _AFFINE.items()},
}


def rand_augment(
    images: torch.Tensor,
    num_ops: int = 2,
    magnitude: float = 9.0,
    *,
    generator: torch.Generator,
    ops: tuple[str, ...] = RAND_AUGMENT_OPS,
    host_generator: Optional[draws.Generator] = None,
) -> torch.Tensor:
    """Apply RandAugment to a batch.

    images:    (B, 3, H, W) uint8.
    num_ops:   N, operations per image.
    magnitude: M on the 0-10 scale (see the module docstring for the mapping).
    generator: source of all randomness; parameters are drawn on its device.
    ops:       the operations to choose from (default: all 14).
    host_generator: CPU generator(s) for each image's choice of operation, which the host
               reads to group the images; without one the choices come from ``generator``
               (read back once per round where it is a GPU's).

    Returns a new (B, 3, H, W) uint8 tensor.
    """
    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"rand_augment expects a (B, 3, H, W) uint8 batch, got {tuple(images.shape)} {images.dtype}")
    if not 0 <= magnitude <= 10:
        raise ValueError(f"magnitude={magnitude}: must be in [0, 10], RandAugment's scale")
    unknown = set(ops) - set(RAND_AUGMENT_OPS)
    if unknown:
        raise ValueError(f"ops: unknown operations {sorted(unknown)}; allowed: {RAND_AUGMENT_OPS}")
    m = magnitude / 10.0
    b = images.shape[0]
    chooser = host_generator if host_generator is not None else generator
    out = images.clone()
    for _ in range(num_ops):
        choice = draws.randint(0, len(ops), (b,), chooser).cpu()
        sign = draws.rand((b,), generator).to(images.device)
        sign = torch.where(sign < 0.5, -1.0, 1.0)
        # the images of each operation, grouped on the host: one copy of the order to the device
        order = torch.argsort(choice, stable=True)
        groups = torch.bincount(choice, minlength=len(ops)).tolist()
        warped, maps = [], []  # the geometric operations' images and maps: one warp for all of them
        for name, idx in zip(ops, order.to(images.device, non_blocking=True).split(groups)):
            if name == "identity" or not idx.numel():
                continue
            if name in _AFFINE:
                warped.append(idx)
                maps.append(_AFFINE[name](m, sign[idx], tuple(images.shape)))
            else:
                out[idx] = _OPS[name](out[idx], m, sign[idx])
        if warped:  # an image takes one operation per round: the warped ones are none of the above
            idx = torch.cat(warped)
            out[idx] = _warp(out[idx], torch.cat([a for a, _ in maps]), torch.cat([b for _, b in maps]))
    return out
