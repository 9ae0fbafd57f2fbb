"""scikit-learn's handwritten digits as an ``InMemoryDataset``: a data set that needs no
download (1,797 grey 8x8 images of the digits 0-9, 17 grey levels; Alpaydin & Kaynak,
UCI), used by ``vitlab demo`` and by the tests.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from vitlab.config import to_pair
from vitlab.data.memory import InMemoryDataset
from vitlab.extras import require

NUM_DIGITS = 1797  # the images of the set: what a memory estimate counts without loading it


def load_digits_dataset(image_size: int | tuple[int, int] = 24) -> InMemoryDataset:
    """The 1,797 digits resized to ``image_size`` (int or (H, W); bilinear) as 3-channel uint8
    images: a non-square size stretches them, as a folder's images are resized to it.

    Returns images (1797, 3, H, W) uint8 in [0, 255] (ink is bright, as in the source) and
    labels 0-9 with classes "0".."9".
    """
    images, labels = _digits(to_pair(image_size, "image_size"))
    # named by their place: the set never changes; each is stored at 8x8 (what a crop's geometry is of)
    return InMemoryDataset(images=images.clone(), labels=labels.clone(), classes=[str(i) for i in range(10)],
                           ids=torch.arange(len(labels)), sizes=torch.full((len(labels), 2), 8, dtype=torch.int64))


@functools.lru_cache(maxsize=4)
def _digits(image_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoded once per process and size (scikit-learn's loader takes seconds)."""
    digits = require("sklearn.datasets", "the digits data set").load_digits()
    x = torch.from_numpy(digits.images).float().unsqueeze(1) * (255.0 / 16.0)  # (N, 1, 8, 8) in [0, 255]
    if image_size != (8, 8):
        x = F.interpolate(x, size=image_size, mode="bilinear", align_corners=False)
    images = x.round().clamp(0, 255).to(torch.uint8).expand(-1, 3, -1, -1).contiguous()
    return images, torch.from_numpy(digits.target).long()
