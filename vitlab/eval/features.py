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
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from vitlab.config import Pair, to_pair
from vitlab.data.transforms import resize, to_float

__all__ = ["extract_features", "predict_logits", "flip_averaged", "mean_probability", "FeatureCache", "file_key"]


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
    was_training = model.training
    model.eval()
    try:
        out = []
        for start in range(0, images.shape[0], batch_size):
            x = to_float(resize(images[start:start + batch_size].to(device), size))  # (b, C, h, w) in [-1, 1]
            out.append(fn(x).float().cpu().numpy())
    finally:
        model.train(was_training)
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


def flip_averaged(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Test-time flip augmentation: x -> log of the mean of softmax(fn(x)) and softmax(fn(x
    mirrored left-right)).

    The result is a log-probability, so its argmax, top-k and cross-entropy are those of
    the two-view ensemble.  Costs a second forward pass.
    """
    def averaged(x: torch.Tensor) -> torch.Tensor:
        return mean_probability(fn(x), fn(x.flip(-1)))

    return averaged


def mean_probability(*logits: torch.Tensor) -> torch.Tensor:
    """log(mean_i softmax(logits_i)): the log-probabilities of an ensemble of views."""
    views = torch.stack([z.float().log_softmax(-1) for z in logits])
    return torch.logsumexp(views, dim=0) - math.log(len(logits))


def predict_logits(model: nn.Module, images: torch.Tensor, batch_size: int = 128,
                   image_size: int | Pair | None = None, device: str | torch.device | None = None,
                   flip: bool = False) -> np.ndarray:
    """uint8 images (N, C, H, W) -> float32 logits (N, K), preprocessed as ``extract_features``.

    flip: average each image's prediction with its mirror image's (``flip_averaged``); the
          result is then log-probabilities rather than raw logits.
    """
    return _batched(model, images, flip_averaged(model) if flip else model, batch_size, image_size, device)


def file_key(path: str | os.PathLike) -> str:
    """A cheap identity of a file or folder for cache keys: absolute path, size and mtime."""
    p = Path(path)
    if not p.exists():
        return str(path)  # e.g. a registry name or a built-in data source
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
        if path is not None and path.is_file():
            with np.load(path) as f:
                value = f["features"]
            self.hits += 1
        else:
            value = np.asarray(compute())
            self.misses += 1
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
                np.savez(tmp, features=value, key=np.array(repr(key)))
                os.replace(tmp, path)  # readers never see a half-written file
        self._memory[name] = value
        return value
