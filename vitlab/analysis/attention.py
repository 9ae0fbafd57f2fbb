"""What the attention looks at: mean attention distance (paper Fig. 7 right, Fig. 11),
attention rollout (Fig. 6, Fig. 14) and raw attention maps.

Two layers of functions:

* array functions take attention probabilities ``attn`` of shape (layers, B, heads, L, L)
  (L = prefix tokens + patches, rows are queries) and return arrays;
* model functions take a ViT and preprocessed images (B, C, H, W) (float, [-1, 1], the
  model's input size), record the attention with ``capture_attention`` inside a context
  manager, and call the array functions.

Axial-ViT attends within rows and columns, so its maps are not (L, L) matrices over the
whole grid; its model functions raise a clear error.
"""
from __future__ import annotations

from typing import Sequence

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
    "patch_distances",
    "mean_attention_distance",
    "attention_rollout",
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
    (no dropout) and is given back in its previous modes, module by module.
    """
    _check_vit(model)
    with evaluating(model), capture_attention(model) as maps:
        model.forward_features(images)
        attn = torch.stack(list(maps)).float().cpu().numpy()
    return attn


def patch_distances(grid: Pair, patch_px: Pair) -> np.ndarray:
    """(N, N) Euclidean distances in pixels between patch centres, raster order (N = gh * gw)."""
    gh, gw = grid
    rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    centres = np.stack([(rows.ravel() + 0.5) * patch_px[0], (cols.ravel() + 0.5) * patch_px[1]], axis=1)
    return np.linalg.norm(centres[:, None, :] - centres[None, :, :], axis=-1)


def _as_layers(attn: np.ndarray | Sequence) -> np.ndarray:
    attn = np.asarray(attn, dtype=np.float64)
    if attn.ndim != 5 or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"expected attention of shape (layers, B, heads, L, L), got {attn.shape}")
    return attn


def mean_attention_distance(attn: np.ndarray, grid: Pair, patch_px: Pair, num_prefix: int) -> np.ndarray:
    """Attention-weighted mean distance in pixels, per layer and head: (layers, heads).

    For a query patch i, sum_j a_ij d_ij over key patches j, where d_ij is the distance
    between patch centres and a_ij is the attention renormalised over patch keys (the
    [class] rows and columns are left out).  Averaged over query patches and images;
    this is the "attention distance" of paper Sec. 4.5 (Fig. 7 right).
    """
    attn = _as_layers(attn)
    n = grid[0] * grid[1]
    if attn.shape[-1] != num_prefix + n:
        raise ValueError(f"attention over {attn.shape[-1]} tokens does not match {num_prefix} prefix + {grid} grid")
    a = attn[..., num_prefix:, num_prefix:]  # (layers, B, heads, N, N): patch queries -> patch keys
    a = a / np.clip(a.sum(axis=-1, keepdims=True), 1e-12, None)
    per_query = (a * patch_distances(grid, patch_px)).sum(axis=-1)  # (layers, B, heads, N)
    return per_query.mean(axis=(1, 3))


def attention_rollout(attn: np.ndarray) -> np.ndarray:
    """Joint attention through all layers (Abnar & Zuidema 2020): (B, L, L).

    Per layer: average the heads, add the identity for the residual connection and
    renormalise the rows, A_l = (mean_h attn_l + I) / row sums; then multiply through
    the layers, R = A_depth ... A_2 A_1.  Row i of R says how much of output token i
    comes from each input token.
    """
    attn = _as_layers(attn)
    L = attn.shape[-1]
    eye = np.eye(L)
    rollout = np.broadcast_to(eye, (attn.shape[1], L, L)).copy()
    for layer in attn:
        a = layer.mean(axis=1) + eye  # (B, L, L)
        a = a / a.sum(axis=-1, keepdims=True)
        rollout = a @ rollout
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
    grid, patch = _grid_of(model, images), effective_patch_size(model)
    total, count = None, 0
    for start in range(0, images.shape[0], batch_size):
        batch = images[start:start + batch_size]
        d = mean_attention_distance(collect_attention(model, batch), grid, patch, model.cfg.num_prefix_tokens)
        total = d * len(batch) if total is None else total + d * len(batch)
        count += len(batch)
    return total / count


def model_rollout(model: nn.Module, images: torch.Tensor) -> np.ndarray:
    """Attention rollout from the output token to the patches: (B, gh, gw), rows sum over
    the grid to at most 1 (the rest stays on the [class] token)."""
    attn = collect_attention(model, images)
    return token_to_grid(attention_rollout(attn), _grid_of(model, images), model.cfg.num_prefix_tokens)


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
    attn = collect_attention(model, images)  # (layers, B, heads, L, L)
    a = attn[layer].mean(axis=1) if head is None else attn[layer][:, head]
    return token_to_grid(a, _grid_of(model, images), model.cfg.num_prefix_tokens)
