"""How much of a device's matmul peak a training step uses: model-FLOPs utilisation (MFU).

MFU = achieved FLOP/s / peak FLOP/s, where the achieved rate is the model's analytic FLOPs
per image (``cost.model_flops``: matmuls and convolutions, multiply-add = 2; training = 3x the
forward) times the images per second the steps ran at, and the peak is measured, not read
from a data sheet: the best rate of a large square matmul on the same device
(``matmul_peak``), in the same process as the figure it divides.  Work beyond the model's
matmuls (recomputation in the backward, element-wise operations) counts for nothing.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, NamedTuple

import torch

__all__ = ["MatmulPeak", "matmul_peak", "mfu"]


def mfu(flops_per_image: float, images_per_s: float, peak_flops_per_s: float) -> float:
    """The share of ``peak_flops_per_s`` that ``images_per_s`` images of ``flops_per_image``
    FLOPs each amount to (0.25: a quarter of the peak)."""
    for name, value in (("flops_per_image", flops_per_image), ("images_per_s", images_per_s)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}={value}: must be a finite number >= 0")
    if not (math.isfinite(peak_flops_per_s) and peak_flops_per_s > 0):
        raise ValueError(f"peak_flops_per_s={peak_flops_per_s}: must be a finite number > 0")
    return flops_per_image * images_per_s / peak_flops_per_s


class MatmulPeak(NamedTuple):
    """FLOP/s of the fastest repeat (the peak) and of the median one, and products per repeat."""

    best: float
    median: float
    calls: int


def matmul_peak(device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16, size: int = 8192,
                warmup: int = 3, repeats: int = 10, min_seconds: float = 0.0,
                product: Callable[[], Any] | None = None) -> MatmulPeak:
    """The device's dense matmul peak: the best FLOP/s of ``size`` x ``size`` x ``size`` products.

    ``warmup`` untimed products come first (the library's kernel choice, the allocator); the
    last one sets how many products make a timed repeat last ``min_seconds`` (at least one),
    and the device is synchronised at the end of each repeat, so a GPU is timed on its own
    work.  ``product`` computes one such product another way (``benchmarks/harness.py``'s
    kernels); by default ``torch.mm`` of two random ``dtype`` matrices made on ``device``.

    The caller's process is left as it was: its random streams (the matrices come from a
    generator of their own), its grad mode and its thread count.
    """
    device = torch.device(device)
    if size < 1 or warmup < 0 or repeats < 1:
        raise ValueError(f"size={size}, warmup={warmup}, repeats={repeats}: size and repeats must be >= 1, "
                         "warmup >= 0")
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        if product is None:
            numbers = torch.Generator(device=device).manual_seed(0)
            a, b = (torch.randn(size, size, generator=numbers, device=device, dtype=dtype) for _ in range(2))
            product = lambda: torch.mm(a, b)  # noqa: E731
        one = 0.0  # no warm-up: one product a repeat
        for _ in range(warmup):
            started = time.perf_counter()
            product()
            sync()
            one = time.perf_counter() - started
        calls = max(1, int(min_seconds / one)) if one > 0 else 1
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(calls):
                product()
            sync()
            seconds.append((time.perf_counter() - started) / calls)
    flops, seconds = 2 * size**3, [max(s, 1e-12) for s in seconds]  # a timer that read no time
    return MatmulPeak(best=flops / min(seconds), median=flops / statistics.median(seconds), calls=calls)
