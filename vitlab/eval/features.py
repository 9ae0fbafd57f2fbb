"""Frozen-model forward passes in batches: representations and logits, with a cache.

The representation is what the paper's linear few-shot evaluation reads (Sec. 4.1,
"Metrics"): the pre-logits output when the model has a pre-logits layer, otherwise the
pooled encoder output ([class] token or global average of the patch tokens).  That is
exactly ``model.forward_head(model.forward_features(x), pre_logits=True)``.

Features depend only on (weights, images, preprocessing), so they are computed once
and cached: in memory, and optionally as ``.npz`` files named by a hash of a key the
caller builds from what the features depend on (see ``file_key``).
"""
from __future__ import annotations

import hashlib
import math
import os
import warnings
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vitlab.config import LOSSES, ConfigError, Pair, check_loss, is_shift, to_pair
from vitlab.data.transforms import resize, to_float
from vitlab.files import atomic_write
from vitlab.modes import evaluating

__all__ = ["extract_features", "predict_logits", "tta_views", "tta_view_count", "tta_view_prefixes", "check_tta_shift",
           "shift_sizes", "tta_averaged", "mean_probability", "class_probabilities", "LOSSES", "check_loss",
           "FeatureCache", "file_key"]

def _input_size(model: nn.Module, image_size: int | Pair | None) -> Pair:
    if image_size is not None:
        return to_pair(image_size, "image_size")
    return tuple(model.cfg.img_size)


@torch.inference_mode()
def _batched(model: nn.Module, images: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor],
             batch_size: int, image_size: int | Pair | None, device: str | torch.device | None) -> np.ndarray:
    if images.dtype != torch.uint8 or images.ndim != 4:
        raise ValueError(f"expected uint8 images (N, C, H, W), got {images.dtype} {tuple(images.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    size = _input_size(model, image_size)
    out = []
    with evaluating(model):
        for start in range(0, images.shape[0], batch_size):
            x = to_float(resize(images[start:start + batch_size].to(device), size))  # (b, C, h, w) in [-1, 1]
            out.append(fn(x).float().cpu().numpy())
    return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


def extract_features(model: nn.Module, images: torch.Tensor, batch_size: int = 128,
                     image_size: int | Pair | None = None, device: str | torch.device | None = None) -> np.ndarray:
    """uint8 images (N, C, H, W) -> float32 representations (N, F) of a frozen model.

    Images are resized (bilinear) to ``image_size`` (default: the model's ``img_size``)
    and scaled to [-1, 1].  F is ``representation_size`` if the model has pre-logits,
    else its width.
    """
    return _batched(model, images, lambda x: model.forward_head(model.forward_features(x), pre_logits=True),
                    batch_size, image_size, device)


Shift = int | tuple[int, ...]  # test-time translations: 0 (none), a number of pixels, or several numbers


def shift_sizes(shift: Shift) -> tuple[int, ...]:
    """The translation sizes ``shift`` names, in its order: () for 0, (s,) for s, or the tuple."""
    if isinstance(shift, (tuple, list)):
        return tuple(shift)
    return (shift,) if shift else ()


def check_tta_shift(shift: Shift, size: Pair, name: str = "shift") -> None:
    """Refuse a translation that reflection cannot fill: an integer in [0, min(size)), or a
    list of distinct integers in [1, min(size)).

    ``name`` is the option as the caller's user spells it (``--shift``, ``final_eval_shift``).
    """
    limit = min(size)
    if not is_shift(shift, limit):
        raise ConfigError(f"{name}={shift!r}: must be an integer in [0, {limit}), or distinct integers in "
                          f"[1, {limit}), for {size[0]}x{size[1]} images (reflection fills at most size - 1 pixels)")


def tta_view_count(flip: bool = False, shift: Shift = 0, diagonal: bool = False) -> int:
    """How many views ``tta_views`` makes (the cost of an evaluation, in passes): 1, 2, 5 or 10
    for one shift along the axes; 4 more positions per shift size, 4 more again with ``diagonal``."""
    return (1 + len(shift_sizes(shift)) * (8 if diagonal else 4)) * (2 if flip else 1)


def tta_view_prefixes(flip: bool = False, shift: Shift = 0, diagonal: bool = False) -> list[int]:
    """The view counts at which ``tta_views``'s list closes a set of its own: the image (1),
    with its mirror image (2), then after each shift size's axis translations and after its
    diagonal ones, e.g. [1, 2, 10, 18] for flip, shift 2 and diagonal.  The first k views of
    the list are each of these sets, so one pass scores all of them."""
    per_position = 2 if flip else 1
    counts, positions = [1, per_position], 1
    for _ in shift_sizes(shift):
        for _ in range(2 if diagonal else 1):
            positions += 4
            counts.append(positions * per_position)
    return sorted(set(counts))


def tta_views(x: torch.Tensor, flip: bool = False, shift: Shift = 0, diagonal: bool = False) -> list[torch.Tensor]:
    """The views of a test-time augmentation ensemble of a float batch (B, C, H, W).

    The batch itself comes first.  Each shift size s (``shift``: one, or several in order)
    adds the four translations by s pixels along each axis, both ways, and with ``diagonal``
    then the four by s along both axes at once (the 3x3 grid of positions s apart); the
    uncovered border is filled by reflection, as the training pad-and-crop fills it.  flip
    puts each view's mirror image (left-right) right after it: ``tta_view_count(flip, shift,
    diagonal)`` views, whose leading ones are the smaller sets (``tta_view_prefixes``).
    """
    views = [x]
    h, w = x.shape[-2:]
    if shift:
        check_tta_shift(shift, (h, w))
    for s in shift_sizes(shift):
        padded = F.pad(x, (s, s, s, s), mode="reflect")

        def moved(dy: int, dx: int) -> torch.Tensor:  # the content moves by (dy, dx)
            return padded[..., s - dy:s - dy + h, s - dx:s - dx + w]

        views += [moved(0, s), moved(0, -s), moved(s, 0), moved(-s, 0)]
        if diagonal:
            views += [moved(s, s), moved(s, -s), moved(-s, s), moved(-s, -s)]
    if flip:
        views = [v for view in views for v in (view, view.flip(-1))]
    return views


def tta_averaged(fn: Callable[[torch.Tensor], torch.Tensor], flip: bool = False, shift: Shift = 0,
                 diagonal: bool = False, loss: str = "softmax_xent") -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> the scores of the mean probability of fn(view) over ``tta_views(x, flip, shift, diagonal)``,
    the probabilities ``loss`` trained (``mean_probability``, as the Evaluator averages its views):
    "softmax_xent" (the default) the log of the mean softmax, a log-probability, so its argmax,
    top-k and cross-entropy are those of the ensemble; "sigmoid_xent" (a run's ``optim.loss``) the
    logit of each class's mean sigmoid, whose sigmoid is that mean (the mean softmax can rank the
    classes otherwise).  One forward pass per view; with a single view, ``fn`` itself.
    """
    check_loss(loss)
    if not flip and not shift:
        return fn

    def averaged(x: torch.Tensor) -> torch.Tensor:
        return mean_probability(*(fn(view) for view in tta_views(x, flip, shift, diagonal)), loss=loss)

    return averaged


def mean_probability(*logits: torch.Tensor, loss: str = "softmax_xent") -> torch.Tensor:
    """The scores of an ensemble of views whose probabilities are the views' mean probabilities, as
    the model was trained to give them (``loss``, a run's ``optim.loss``): of "softmax_xent",
    log(mean_i softmax(logits_i)), the ensemble's log-probabilities; of "sigmoid_xent", each
    class's own probability, sigmoid(z_k), averaged: the logit of the mean, log(p / (1 - p))
    (one view: its logits), whose sigmoid is that mean.  Either ranks the classes by it."""
    check_loss(loss)
    if loss == "sigmoid_xent":
        if len(logits) == 1:
            return logits[0].float()
        log_p, log_not_p = mean_sigmoid(torch.stack(logits))
        return log_p - log_not_p
    views = torch.stack([z.float().log_softmax(-1) for z in logits])
    return torch.logsumexp(views, dim=0) - math.log(len(logits))


def class_probabilities(*logits: torch.Tensor, loss: str = "softmax_xent") -> torch.Tensor:
    """Each class's probability from the logits (..., K) of one view or several, averaged as
    ``mean_probability`` averages them: under "softmax_xent" the (mean) softmax, which sums to 1;
    under "sigmoid_xent" each class's own (mean) sigmoid, which need not."""
    scores = mean_probability(*logits, loss=loss)
    return scores.sigmoid() if loss == "sigmoid_xent" else scores.softmax(-1)


def mean_sigmoid(views: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p, log(1 - p)) of p, the mean over ``views``' first dimension (V, ..., K) of each
    class's sigmoid probability, in log space."""
    z, log_views = views.float(), math.log(len(views))
    return (torch.logsumexp(F.logsigmoid(z), dim=0) - log_views,
            torch.logsumexp(F.logsigmoid(-z), dim=0) - log_views)


def predict_logits(model: nn.Module, images: torch.Tensor, batch_size: int = 128,
                   image_size: int | Pair | None = None, device: str | torch.device | None = None,
                   flip: bool = False, shift: Shift = 0, diagonal: bool = False,
                   loss: str = "softmax_xent") -> np.ndarray:
    """uint8 images (N, C, H, W) -> float32 logits (N, K), preprocessed as ``extract_features``.

    flip, shift, diagonal: average the predictions of each image's test-time views
          (``tta_averaged``: its mirror image; its translations by ``shift`` pixels); the
          result is then the ensemble's scores rather than raw logits.
    loss: the probabilities the views average, those the model was trained to give (a run's
          ``optim.loss``): "softmax_xent" (the default; the scores are log-probabilities) or
          "sigmoid_xent" (each class's own sigmoid; the scores are the logits of its mean).
          ``class_probabilities(torch.from_numpy(scores), loss=loss)`` gives the probabilities.
    """
    return _batched(model, images, tta_averaged(model, flip, shift, diagonal, loss), batch_size, image_size, device)


def file_key(path: str | os.PathLike) -> str:
    """A cheap identity of a file or folder for cache keys: absolute path, size and mtime; of a
    folder, its path and those of every file in it (weights copied over a run folder's own, in
    place, leave the folder's size and mtime as they were, and its cached features were read back)."""
    p = Path(path)
    if not p.exists():
        return str(path)  # e.g. a registry name or a built-in data source
    if p.is_dir():
        # surrogateescape: file names that are not UTF-8 hash as their bytes
        digest = hashlib.sha256()
        for file in sorted(f for f in p.iterdir() if f.is_file()):  # a Hub snapshot's links: their blobs
            st = file.stat()
            digest.update(f"\n{file.name}|{st.st_size}|{st.st_mtime_ns}".encode("utf-8", "surrogateescape"))
        return f"{p.resolve()}:{digest.hexdigest()[:16]}"
    st = p.stat()
    return f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}"


class FeatureCache:
    """Arrays computed once per key: kept in memory, and in ``directory`` as .npz if given.

        cache = FeatureCache("~/.cache/vitlab/features")
        feats = cache.get(("ckpt", file_key(ckpt), "data", ...), lambda: extract_features(...))
    """

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.directory = Path(directory).expanduser() if directory is not None else None
        self._memory: dict[str, np.ndarray] = {}
        self.hits = self.misses = 0

    @staticmethod
    def digest(key: tuple | str) -> str:
        return hashlib.sha256(repr(key).encode()).hexdigest()[:24]

    def get(self, key: tuple | str, compute: Callable[[], np.ndarray]) -> np.ndarray:
        name = self.digest(key)
        if name in self._memory:
            self.hits += 1
            return self._memory[name]
        path = self.directory / f"{name}.npz" if self.directory is not None else None
        value = self._read(path) if path is not None and path.is_file() else None
        if value is not None:
            self.hits += 1
        else:
            value = np.asarray(compute())
            self.misses += 1
            if path is not None:
                # readers never see a half-written file, and a failed write leaves none beside it
                atomic_write(path, lambda f: np.savez(f, features=value, key=np.array(repr(key))))
        self._memory[name] = value
        return value

    @staticmethod
    def _read(path: Path) -> np.ndarray | None:
        """The features kept in ``path``, or None (said in a warning) where the file is damaged: a
        cache is computed again, not a reason to fail (a truncated file raised zipfile's BadZipFile
        as a traceback, a garbled one numpy's "contains pickled (object) data")."""
        try:
            with np.load(path) as f:
                return f["features"]
        except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as err:
            warnings.warn(f"feature cache {path} is damaged ({err}); computing the features again")
            return None
