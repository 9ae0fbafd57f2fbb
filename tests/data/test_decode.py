"""What a streaming reader makes of one image: the crop at the final size, decoded at reduced
JPEG scale where that covers it, with the distribution of the full decode."""
import io

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.data.decode import SampleCrop, decode_crop, decode_image, draft_reduction
from vitlab.data.sources import DataError
from vitlab.data.transforms import sample_boxes


def photo_like(rng, h=240, w=320, quality=90) -> bytes:
    """A JPEG like a photograph: smooth colour fields plus sensor noise."""
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    base = np.stack([np.sin(6 * xx * rng.uniform(0.5, 2) + c) * np.cos(4 * yy * rng.uniform(0.5, 2) + c)
                     for c in range(3)], -1)
    pixels = np.clip(128 + 100 * base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def crops(images, crop, repeats):
    """float64 (N, H, W, 3): ``repeats`` crops of each image, the k-th drawn from seed k."""
    return np.stack([decode_crop(data, crop, torch.Generator().manual_seed(k * 100 + i)).astype(np.float64)
                     for k in range(repeats) for i, data in enumerate(images)])


def test_draft_reduction_is_the_largest_that_covers():
    assert draft_reduction(448, 448, 224, 224) == 2
    assert draft_reduction(447, 900, 224, 224) == 1
    assert draft_reduction(1000, 900, 224, 224) == 4
    assert draft_reduction(4000, 3000, 224, 224) == 8
    assert draft_reduction(300, 200, 32, 32) == 4


def test_draft_decoded_crops_keep_the_pixel_statistics():
    rng = np.random.default_rng(0)
    images = [photo_like(rng) for _ in range(6)]
    crop = SampleCrop((48, 48), "inception")
    boxes = [sample_boxes(1, 240, 320, crop.scale, crop.ratio, torch.Generator().manual_seed(k * 100 + i))
             for k in range(20) for i in range(len(images))]
    reduced = [draft_reduction(float(w[0]), float(h[0]), 48, 48) for _, _, w, h, _ in boxes]
    assert np.mean([r > 1 for r in reduced]) > 0.5 and max(reduced) == 4  # most crops decode at 1/2 or 1/4
    draft = crops(images, crop, 20)
    full = crops(images, SampleCrop((48, 48), "inception", draft=False), 20)  # the same boxes, full decode
    assert abs(draft.mean() - full.mean()) < 0.5 and abs(draft.var() / full.var() - 1) < 0.01
    means, variances = (draft.mean((1, 2, 3)), full.mean((1, 2, 3))), (draft.var((1, 2, 3)), full.var((1, 2, 3)))
    assert np.abs(means[0] - means[1]).max() < 1.0  # grey levels
    assert np.abs(variances[0] / variances[1] - 1).max() < 0.03
    detail = [np.abs(np.diff(x, axis=2)).mean() for x in (draft, full)]  # neighbouring pixels' differences
    assert abs(detail[0] / detail[1] - 1) < 0.05
    assert np.abs(draft - full).mean() < 1.5


def coordinate_image(size=256, fmt="PNG", quality=100) -> bytes:
    """Red is the column and green the row: a crop's pixels tell where its box lay."""
    yy, xx = np.mgrid[0:size, 0:size]
    pixels = np.stack([xx, yy, np.full_like(xx, 128)], -1).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt, **({"quality": quality} if fmt == "JPEG" else {}))
    return out.getvalue()


def recovered_boxes(data: bytes, crop: SampleCrop, n: int) -> np.ndarray:
    """(n, 2): (area fraction, aspect w/h) of the boxes a 256x256 coordinate image's crops cover."""
    out = []
    for k in range(n):
        pixels = decode_crop(data, crop, torch.Generator().manual_seed(k)).astype(np.float64)
        size = crop.size[0]
        # the outer rows/columns sample half a step inside the box: extend by one output step
        w = (pixels[:, -1, 0].mean() - pixels[:, 0, 0].mean()) * size / (size - 1)
        h = (pixels[-1, :, 1].mean() - pixels[0, :, 1].mean()) * size / (size - 1)
        out.append((w * h / 256**2, w / h))
    return np.array(out)


def test_streamed_inception_crops_keep_scale_and_aspect_ranges():
    crop = SampleCrop((32, 32), "inception", scale=(0.05, 1.0), ratio=(3 / 4, 4 / 3))
    found = recovered_boxes(coordinate_image(), crop, 300)
    area, aspect = found[:, 0], found[:, 1]
    assert area.min() > 0.05 * 0.9 and area.max() < 1.02 and area.min() < 0.1 and area.max() > 0.9
    assert aspect.min() > 0.75 * 0.95 and aspect.max() < 4 / 3 * 1.05 and aspect.min() < 0.8 and aspect.max() > 1.25
    # the same distribution as the batched in-memory crop's sampler
    x0, y0, w, h, _ = sample_boxes(20000, 256, 256, crop.scale, crop.ratio, torch.Generator().manual_seed(1))
    reference = (w * h / 256**2).numpy()
    quantiles = np.linspace(0.05, 0.95, 10)
    assert np.abs(np.quantile(area, quantiles) - np.quantile(reference, quantiles)).max() < 0.08
    # decoding at reduced DCT scale leaves the boxes where they were (a smooth JPEG: a few grey levels of error)
    jpeg = coordinate_image(fmt="JPEG")
    with_draft = recovered_boxes(jpeg, crop, 60)
    without = recovered_boxes(jpeg, SampleCrop((32, 32), "inception", draft=False), 60)
    assert np.abs(with_draft - without).max() < 0.03


def test_sample_boxes_per_image_sizes_equal_one_size_for_all():
    g = [torch.Generator().manual_seed(3) for _ in range(2)]
    one = sample_boxes(16, 40, 60, (0.05, 1.0), (0.75, 4 / 3), g[0])
    each = sample_boxes(16, torch.full((16,), 40.0), torch.full((16,), 60.0), (0.05, 1.0), (0.75, 4 / 3), g[1])
    assert all(torch.equal(a, b) for a, b in zip(one, each))
    x0, y0, w, h, found = sample_boxes(3, torch.tensor([10.0, 100.0, 1.0]), torch.tensor([300.0, 100.0, 1.0]),
                                       (0.5, 1.0), (1.0, 1.0), torch.Generator().manual_seed(0))
    assert torch.all(x0 + w <= torch.tensor([300.0, 100.0, 1.0])) and torch.all(y0 + h <= torch.tensor([10, 100, 1]))
    assert not found[0] and found[1]  # a square of half a 10x300 image fits nowhere: the whole image


def test_resize_crop_and_modes():
    gray = io.BytesIO()
    Image.fromarray(np.full((40, 30), 200, np.uint8)).save(gray, format="JPEG")
    out = decode_crop(gray.getvalue(), SampleCrop((10, 12)))
    assert out.shape == (10, 12, 3) and out.dtype == np.uint8 and np.abs(out.astype(int) - 200).max() <= 2
    rgb = decode_image(io.BytesIO(coordinate_image(64)), (16, 16))
    assert np.abs(decode_crop(coordinate_image(64), SampleCrop((16, 16))).astype(int) - rgb).max() <= 1
    with pytest.raises(DataError, match="not a decodable image"):
        decode_crop(b"\xff\xd8 not a jpeg", SampleCrop((4, 4)))
