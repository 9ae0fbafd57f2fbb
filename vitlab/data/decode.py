"""One stored image to the uint8 pixels a batch needs, and no more.

``decode_image`` decodes a whole image (the in-memory sets, `predict`, reports).
``decode_crop`` is what a streaming reader does with each sample: it makes the image's
crop at the training size and hands it over as uint8, so that the per-pixel work left
(normalisation, flips, RandAugment, mixup) runs batched on the training device.

Decode less: a JPEG is decoded at 1/2, 1/4 or 1/8 of its size in the DCT domain
(Pillow's ``Image.draft``; big_vision decodes only the crop window, FFCV stores the
images pre-resized) whenever the reduced image still holds at least the output's pixels
across the crop, so the resampling that follows only ever shrinks.  The crop box itself
is drawn in the stored image's own pixels by ``transforms.sample_boxes``, the sampler of
the batched in-memory crop, so both paths draw the same distribution of boxes.
"""
from __future__ import annotations

import contextlib
import io
import os
import struct
import warnings
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from vitlab.config import ConfigError, to_pair
from vitlab.data.sources import DataError
from vitlab.data.transforms import sample_boxes

__all__ = ["DECODE_ERRORS", "SampleCrop", "decode_crop", "decode_crops", "decode_errors", "decode_image",
           "decode_sized", "draft_reduction", "opened", "to_rgb"]

# What PIL (and its plugins) raise for bad data: truncated, corrupt, unknown or unsupported.
DECODE_ERRORS = (OSError, SyntaxError, ValueError, TypeError, IndexError, KeyError, EOFError, struct.error,
                 ZeroDivisionError, OverflowError, MemoryError, RuntimeError, AttributeError, NotImplementedError,
                 UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning)

DRAFT_REDUCTIONS = (8, 4, 2)  # the scales libjpeg's DCT can decode at, largest first


def to_rgb(img: Image.Image) -> np.ndarray:
    """(H, W, 3) uint8 RGB of a decoded PIL image of any mode: the pixels as stored, EXIF orientation
    not applied (as torchvision's and timm's ImageFolder read them), by every reader of images.

    16-bit grayscale ("I;16*", and "I" as PNG's 16-bit files open) is scaled to 8 bits
    (v / 257, rounded: 65535 -> 255), where PIL's own conversion would clip everything
    above 255 to white.  Alpha is dropped (the colour stored under it is kept, as
    torchvision and timm do); palette, grayscale, bilevel and CMYK go through PIL's
    conversions.
    """
    if img.mode.startswith("I;16") or img.mode == "I":
        wide = np.asarray(img, dtype=np.int64 if img.mode == "I" else None).astype(np.float64)
        gray = np.clip(np.rint(np.clip(wide, 0, 65535) / 257.0), 0, 255).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    return np.array(img.convert("RGB"), dtype=np.uint8)  # a writable copy: torch.from_numpy wants one


@contextlib.contextmanager
def decode_errors(source) -> Iterator[None]:
    """Every failure of decoding ``source`` inside the block raised as one ``DataError``: not
    an image, truncated, corrupt, or over PIL's decompression-bomb limit
    (``Image.MAX_IMAGE_PIXELS``, refused before decoding).  The message names the file
    where ``source`` is a path."""
    where = f"{source}: " if isinstance(source, (str, os.PathLike)) else ""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    except FileNotFoundError as e:
        raise DataError(f"{where}no such file") from e
    except IsADirectoryError as e:
        raise DataError(f"{where}a folder, not an image file (a shell pattern names its images: {source}/*.jpg)") from e
    except DECODE_ERRORS as e:
        reason = str(e).splitlines()[0] if str(e) else ""
        if isinstance(e, UnidentifiedImageError):  # PIL names the file: the path again, or a file object's address
            reason = "cannot identify image file"
        if isinstance(e, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
            reason = f"{reason} (the decompression-bomb limit, PIL.Image.MAX_IMAGE_PIXELS)"
        raise DataError(f"{where}not a decodable image: {type(e).__name__}: {reason}") from e


@contextlib.contextmanager
def opened(source) -> Iterator[Image.Image]:
    """``Image.open(source)`` (a path or a file object), every failure of the decode inside
    the block raised as one ``DataError`` (``decode_errors``)."""
    with decode_errors(source), Image.open(source) as img:
        yield img


def decode_image(source, size: Optional[tuple[int, int]] = None) -> np.ndarray:
    """Decode an image file (path or file object) to an (H, W, 3) uint8 RGB array.

    size: (height, width) to resize to, bilinear (PIL); None keeps the stored size.
    Colour modes are converted as ``to_rgb`` describes.

    Raises:
        DataError: the data is not a decodable image (see ``opened``).
    """
    return decode_sized(source, size)[0]


def decode_sized(source, size: Optional[tuple[int, int]] = None) -> tuple[np.ndarray, tuple[int, int]]:
    """``decode_image``'s array and the (height, width) the image is stored at: what a crop of the
    resized copy takes its geometry from (``transforms.sample_boxes``'s ``source``)."""
    with opened(source) as img:
        img.load()  # the full decode, so truncated files fail here
        stored = (img.height, img.width)
        if size is not None and stored != tuple(size):
            array = to_rgb(img)
            return np.array(Image.fromarray(array).resize((size[1], size[0]), Image.BILINEAR)), stored
        return to_rgb(img), stored


CROP_KINDS = ("inception", "resize")


@dataclass(frozen=True)
class SampleCrop:
    """What a streaming reader makes of each stored image: uint8 pixels at ``size``.

    size:  (H, W) of the output.
    kind:  "inception": a random box of ``scale`` of the image's area with aspect ratio
           (w / h) in ``ratio``, drawn in the stored image's pixels (the official
           pre-training crop, ``transforms.sample_boxes``), resampled to ``size``;
           "resize": the whole image resized to ``size``.
    draft: decode JPEGs at reduced scale where that still covers the output (see the
           module doc); False always decodes at full size.

    The resampling is Pillow's bilinear filter, which low-pass filters when it shrinks.
    """

    size: tuple[int, int]
    kind: str = "resize"
    scale: tuple[float, float] = (0.05, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    draft: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", to_pair(self.size, "size"))
        if self.kind not in CROP_KINDS:
            raise ConfigError(f"kind={self.kind!r}: allowed values are {', '.join(map(repr, CROP_KINDS))}")


def draft_reduction(box_w: float, box_h: float, out_w: int, out_h: int) -> int:
    """The largest JPEG DCT reduction (8, 4, 2, else 1) at which a ``box_w x box_h`` box of
    the stored image still spans at least ``out_w x out_h`` pixels."""
    for reduction in DRAFT_REDUCTIONS:
        if box_w / reduction >= out_w and box_h / reduction >= out_h:
            return reduction
    return 1


def _file(source):
    return io.BytesIO(source) if isinstance(source, bytes) else source


def decode_crops(sources: Sequence, crop: SampleCrop, generator: Optional[torch.Generator] = None) -> list:
    """``crop`` made of each image in ``sources`` (encoded bytes, paths or file objects): an
    (H, W, 3) uint8 array, or the ``DataError`` saying why that image could not be decoded.

    generator: draws the inception boxes (a CPU generator; None: a fresh one, its default
        seed), all of them in one ``sample_boxes`` call over the images' stored sizes, read
        from their headers; unused for "resize".
    """
    out: list = [None] * len(sources)
    headers = []  # (index, lazily opened image): nothing decoded yet
    for i, source in enumerate(sources):
        try:
            with decode_errors(source):
                headers.append((i, Image.open(_file(source))))
        except DataError as e:
            out[i] = e
    sizes = torch.tensor([img.size for _, img in headers], dtype=torch.float32).view(-1, 2)  # (n, 2) W, H
    if crop.kind == "inception" and headers:
        boxes = torch.stack(sample_boxes(len(headers), sizes[:, 1], sizes[:, 0], crop.scale, crop.ratio,
                                         generator or torch.Generator())[:4], 1).tolist()
    else:
        boxes = [(0.0, 0.0, w, h) for w, h in sizes.tolist()]
    for (i, img), box in zip(headers, boxes):
        try:
            with decode_errors(sources[i]), img:
                out[i] = _crop(img, box, crop)
        except DataError as e:
            out[i] = e
    return out


def _crop(img: Image.Image, box: Sequence[float], crop: SampleCrop) -> np.ndarray:
    """(H, W, 3) uint8: the (x0, y0, w, h) ``box`` of the stored image resampled to ``crop.size``."""
    (out_h, out_w), (width, height) = crop.size, img.size
    x0, y0, w, h = box
    if crop.draft:
        reduction = draft_reduction(w, h, out_w, out_h)
        if reduction > 1:  # a no-op for formats other than JPEG
            img.draft("RGB", (width // reduction, height // reduction))
    sx, sy = img.width / width, img.height / height  # the decoded size over the stored one
    if img.mode != "RGB":
        img = Image.fromarray(to_rgb(img))
    return np.asarray(img.resize((out_w, out_h), Image.BILINEAR, box=(x0 * sx, y0 * sy, (x0 + w) * sx, (y0 + h) * sy)))


def decode_crop(source, crop: SampleCrop, generator: Optional[torch.Generator] = None) -> np.ndarray:
    """(H, W, 3) uint8: ``crop`` made of the image in ``source`` (its encoded bytes, a path
    or a file object); see ``decode_crops``.

    Raises:
        DataError: the data is not a decodable image (see ``decode_errors``).
    """
    result = decode_crops([source], crop, generator)[0]
    if isinstance(result, DataError):
        raise result
    return result
