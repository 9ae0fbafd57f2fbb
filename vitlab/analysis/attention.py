"""What the attention looks at: mean attention distance (paper Fig. 7 right, Fig. 11),
attention rollout (Fig. 6, Fig. 14) and raw attention maps.

Two layers of functions:

* array functions take attention probabilities ``attn`` of shape (layers, B, heads, L, L)
  (L = prefix tokens + patches, rows are queries) and return arrays;
* model functions take a ViT and preprocessed images (B, C, H, W) (float, [-1, 1], the
  model's input size) and reduce each layer's attention as that layer runs
  (``reduce_attention``): they hold one layer's maps of a batch at a time, never every
  layer's (ViT-L/16 at 384 px records about 0.5 GB of maps per image, ViT-H/14 at 518 px
  about 4 GB).  ``collect_attention`` keeps every layer's maps, for those who want them.

Axial-ViT attends within rows and columns, so its maps are not (L, L) matrices over the
whole grid; its model functions raise a clear error.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vitlab.analysis.embeddings import need_vit
from vitlab.config import Pair, is_int, to_pair
from vitlab.models import capture_attention
from vitlab.modes import evaluating

__all__ = [
    "effective_patch_size",
    "collect_attention",
    "reduce_attention",
    "patch_distances",
    "mean_attention_distance",
    "layer_attention_distance",
    "attention_rollout",
    "rollout_layer",
    "token_to_grid",
    "upsample_maps",
    "model_attention_distance",
    "model_rollout",
    "model_raw_attention",
]


def effective_patch_size(model: nn.Module) -> Pair:
    """Pixels of the input image per patch: the patch size, times the ResNet stem's
    reduction for hybrids (a 1x1 patch of an R50 /16 feature map covers 16x16 pixels)."""
    cfg = model.cfg
    r = cfg.resnet.reduction if getattr(cfg, "resnet", None) is not None else 1
    return (cfg.patch_size[0] * r, cfg.patch_size[1] * r)


def _check_vit(model: nn.Module) -> None:
    need_vit(model, "; attention analysis needs one")
    if model.cfg.axial:
        raise ValueError(
            "Axial-ViT attends along rows and columns separately, so it has no (L, L) attention "
            "over the whole grid; attention distance and rollout are defined for ViT and hybrids"
        )


@torch.inference_mode()
def collect_attention(model: nn.Module, images: torch.Tensor) -> np.ndarray:
    """Attention probabilities of every layer: (layers, B, heads, L, L) float32.

    images: (B, C, H, W) float, preprocessed for the model.  The model runs in eval mode
    (no dropout) and is given back in its previous modes, module by module.  Every layer's
    maps are held at once: layers * B * heads * L^2 * 4 bytes (ViT-L/16 at 384 px: about
    0.5 GB per image); the model functions below reduce layer by layer instead.
    """
    _check_vit(model)
    with evaluating(model), capture_attention(model) as maps:
        model.forward_features(images)
        attn = torch.stack(list(maps)).float().cpu().numpy()
    return attn


def reduce_attention(model: nn.Module, images: torch.Tensor,
                     reduce: Callable[[int, np.ndarray], Any]) -> list:
    """Run ``model`` on ``images`` and call ``reduce(index, layer)`` with each layer's attention
    probabilities (B, heads, L, L), float32, as that layer runs; the list of what it returns,
    in the order of the layers.  Only one layer's maps of the batch are held at a time (the
    array is the model's own, alive until ``reduce`` returns: keep a reduction or a copy).

    The model runs in eval mode without gradients, and is given back in its previous modes
    and with its recording as it was, also when ``reduce`` raises.
    """
    _check_vit(model)
    if not callable(reduce):
        raise TypeError(f"reduce={reduce!r:.80}: expected a function of (index, layer's maps)")
    index = itertools.count()

    def each(probs: torch.Tensor) -> Any:
        return reduce(next(index), probs.float().cpu().numpy())

    with torch.inference_mode(), evaluating(model), capture_attention(model, each=each) as reduced:
        model.forward_features(images)
    return list(reduced)


def patch_distances(grid: Pair, patch_px: Pair) -> np.ndarray:
    """(N, N) Euclidean distances in pixels between patch centres, raster order (N = gh * gw)."""
    gh, gw = grid
    rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    centres = np.stack([(rows.ravel() + 0.5) * patch_px[0], (cols.ravel() + 0.5) * patch_px[1]], axis=1)
    return np.linalg.norm(centres[:, None, :] - centres[None, :, :], axis=-1)


def _as_layers(attn: np.ndarray | Sequence) -> np.ndarray:
    # not as float64 here: a copy of every layer at twice the size; each layer's reduction
    # takes one image at a time in float64
    attn = np.asarray(attn)
    if attn.ndim != 5 or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"expected attention of shape (layers, B, heads, L, L), got {attn.shape}")
    return attn


def _check_tokens(L: int, grid: Pair, num_prefix: int) -> None:
    if L != num_prefix + grid[0] * grid[1]:
        raise ValueError(f"attention over {L} tokens does not match {num_prefix} prefix + {grid} grid")


def layer_attention_distance(layer: np.ndarray, grid: Pair, patch_px: Pair, num_prefix: int) -> np.ndarray:
    """Mean attention distance of one layer's attention (B, heads, L, L), per image and head:
    (B, heads) in pixels, averaged over query patches (see ``mean_attention_distance``).
    Computed an image at a time in float64."""
    layer = np.asarray(layer)
    if layer.ndim != 4 or layer.shape[-1] != layer.shape[-2]:
        raise ValueError(f"expected one layer's attention of shape (B, heads, L, L), got {layer.shape}")
    _check_tokens(layer.shape[-1], grid, num_prefix)
    distances = patch_distances(grid, patch_px)
    out = np.empty(layer.shape[:2])
    for b, image in enumerate(layer):
        a = np.asarray(image[:, num_prefix:, num_prefix:], dtype=np.float64)  # patch queries -> patch keys
        a = a / np.clip(a.sum(axis=-1, keepdims=True), 1e-12, None)
        out[b] = (a * distances).sum(axis=-1).mean(axis=-1)
    return out


def mean_attention_distance(attn: np.ndarray, grid: Pair, patch_px: Pair, num_prefix: int) -> np.ndarray:
    """Attention-weighted mean distance in pixels, per layer and head: (layers, heads).

    For a query patch i, sum_j a_ij d_ij over key patches j, where d_ij is the distance
    between patch centres and a_ij is the attention renormalised over patch keys (the
    [class] rows and columns are left out).  Averaged over query patches and images;
    this is the "attention distance" of paper Sec. 4.5 (Fig. 7 right).
    """
    attn = _as_layers(attn)
    _check_tokens(attn.shape[-1], grid, num_prefix)
    out = np.empty((len(attn), attn.shape[2]))
    for i, layer in enumerate(attn):
        out[i] = layer_attention_distance(layer, grid, patch_px, num_prefix).mean(axis=0)
    return out


def attention_rollout(attn: np.ndarray) -> np.ndarray:
    """Joint attention through all layers (Abnar & Zuidema 2020): (B, L, L).

    Per layer: average the heads, add the identity for the residual connection and
    renormalise the rows, A_l = (mean_h attn_l + I) / row sums; then multiply through
    the layers, R = A_depth ... A_2 A_1.  Row i of R says how much of output token i
    comes from each input token.
    """
    attn = _as_layers(attn)
    rollout = np.broadcast_to(np.eye(attn.shape[-1]), (attn.shape[1],) + attn.shape[-2:]).copy()
    for layer in attn:
        rollout_layer(rollout, layer)
    return rollout


def rollout_layer(rollout: np.ndarray, layer: np.ndarray) -> np.ndarray:
    """One step of ``attention_rollout``: multiply the running product ``rollout`` (B, L, L)
    float64, the identity before the first layer, by one layer's attention (B, heads, L, L),
    in place, an image at a time in float64; gives ``rollout`` back."""
    eye = np.eye(layer.shape[-1])
    for b, image in enumerate(layer):
        a = np.asarray(image, dtype=np.float64).mean(axis=0) + eye  # (L, L)
        a = a / a.sum(axis=-1, keepdims=True)
        rollout[b] = a @ rollout[b]
    return rollout


def token_to_grid(matrix: np.ndarray, grid: Pair, num_prefix: int) -> np.ndarray:
    """From attention or rollout matrices (..., L, L), the map from the output token to the
    input patches: (..., gh, gw).  The output token is the [class] token when there is one
    (num_prefix > 0), otherwise the average over all patch tokens (the "gap" classifier)."""
    matrix = np.asarray(matrix)
    if num_prefix > 0:
        row = matrix[..., 0, num_prefix:]
    else:
        row = matrix[..., num_prefix:, num_prefix:].mean(axis=-2)  # average over patch queries
    return row.reshape(*matrix.shape[:-2], *grid)


def upsample_maps(maps: np.ndarray, size: int | Pair) -> np.ndarray:
    """(B, gh, gw) -> (B, H, W) by bilinear interpolation, to overlay on the images; ``size``
    (H, W), or one side for a square image."""
    size = to_pair(size, "size")  # an int was torch's "'int' object is not iterable"
    t = torch.as_tensor(np.asarray(maps, dtype=np.float32))[:, None]
    return F.interpolate(t, size=size, mode="bilinear", align_corners=False)[:, 0].numpy()


def _grid_of(model: nn.Module, images: torch.Tensor) -> Pair:
    return tuple(model.patch_grid(tuple(images.shape[-2:])))


def model_attention_distance(model: nn.Module, images: torch.Tensor, batch_size: int = 16) -> np.ndarray:
    """Mean attention distance in input pixels of a ViT over ``images``: (layers, heads)."""
    _check_vit(model)
    # refused here: the loop below would end in range()'s error or a division of None by 0
    if not is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: must be a positive integer")
    if len(images) == 0:
        raise ValueError("images: none given; the attention distance is a mean over at least one image")
    grid, patch, prefix = _grid_of(model, images), effective_patch_size(model), model.cfg.num_prefix_tokens

    def distance(index: int, layer: np.ndarray) -> np.ndarray:
        return layer_attention_distance(layer, grid, patch, prefix).sum(axis=0)  # over the batch's images

    total = sum(np.stack(reduce_attention(model, images[start:start + batch_size], distance))
                for start in range(0, len(images), batch_size))
    return total / len(images)


def model_rollout(model: nn.Module, images: torch.Tensor) -> np.ndarray:
    """Attention rollout from the output token to the patches: (B, gh, gw), rows sum over
    the grid to at most 1 (the rest stays on the [class] token)."""
    rollout = None

    def multiply(index: int, layer: np.ndarray) -> None:  # into the product, keeping none of the maps
        nonlocal rollout
        if rollout is None:
            rollout = np.broadcast_to(np.eye(layer.shape[-1]), (len(layer),) + layer.shape[-2:]).copy()
        rollout_layer(rollout, layer)

    reduce_attention(model, images, multiply)
    return token_to_grid(rollout, _grid_of(model, images), model.cfg.num_prefix_tokens)


def model_raw_attention(model: nn.Module, images: torch.Tensor, layer: int, head: int | None = None) -> np.ndarray:
    """Attention of one layer (negative counts from the end) and head (None: mean of heads)
    from the output token to the patches: (B, gh, gw)."""
    _check_vit(model)
    # checked before the model runs on the images, as integers: layer=1.5 was numpy's IndexError
    depth, heads = model.cfg.depth, model.cfg.num_heads
    has = f" (the model has {depth} layers of {heads} heads)"
    if not is_int(layer) or not -depth <= layer < depth:
        raise ValueError(f"layer={layer!r}: must be an integer from {-depth} to {depth - 1}{has}")
    if head is not None and (not is_int(head) or not 0 <= head < heads):
        raise ValueError(f"head={head!r}: must be an integer from 0 to {heads - 1}, or None{has}")
    keep = layer % depth

    def one(index: int, maps: np.ndarray) -> np.ndarray | None:  # (B, heads, L, L) -> (B, L, L)
        if index != keep:
            return None
        return maps.mean(axis=1) if head is None else maps[:, head].copy()

    a = reduce_attention(model, images, one)[keep]
    return token_to_grid(a, _grid_of(model, images), model.cfg.num_prefix_tokens)
