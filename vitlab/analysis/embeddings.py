"""What the embeddings learned: principal components of the patch-embedding filters
(paper Fig. 7 left) and the similarity structure of position embeddings (Fig. 7 centre,
Fig. 10).  Pure functions: weights in, arrays out.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from vitlab.config import Pair, is_int

__all__ = [
    "filter_pca",
    "patch_embedding_pca",
    "cosine_similarity_grid",
    "position_embedding_table",
    "position_similarity",
]


def need_vit(model: nn.Module, why: str) -> None:
    """A Vision Transformer (a ViT, a hybrid, an Axial-ViT: a config with a patch size), or a
    ValueError naming the model and ``why`` the analysis needs one: a BiT ResNet's missing
    attribute named neither."""
    if not hasattr(getattr(model, "cfg", None), "patch_size"):
        raise ValueError(f"{type(model).__name__} is not a Vision Transformer{why}")


def filter_pca(filters: np.ndarray | torch.Tensor, k: int = 28) -> tuple[np.ndarray, np.ndarray]:
    """Principal components of a filter bank.

    filters: (D, C, P, Q): D filters, each a vector of length C*P*Q.
    Returns components (k, C, P, Q), unit-norm, ordered by decreasing variance, and the
    fraction of the total variance each explains (k,).  Filters are centred first.  The
    sign of a component is arbitrary; we make its largest-magnitude entry positive so the
    answer is deterministic.
    """
    if not is_int(k) or k < 1:  # a negative k ended in numpy's IndexError
        raise ValueError(f"k={k!r}: must be a positive integer (the number of components)")
    w = filters.detach().float().cpu().numpy() if isinstance(filters, torch.Tensor) else np.asarray(filters)
    if w.ndim != 4:
        raise ValueError(f"expected filters (D, C, P, Q), got shape {w.shape}")
    D, shape = w.shape[0], w.shape[1:]
    x = w.reshape(D, -1).astype(np.float64)
    x = x - x.mean(axis=0)
    k = min(k, min(x.shape))
    _, s, vt = np.linalg.svd(x, full_matrices=False)
    comps = vt[:k]
    signs = np.sign(comps[np.arange(k), np.abs(comps).argmax(axis=1)])
    comps = comps * signs[:, None]
    var = s**2
    explained = var[:k] / max(var.sum(), 1e-300)
    return comps.reshape(k, *shape), explained


def patch_embedding_pca(model: nn.Module, k: int = 28) -> tuple[np.ndarray, np.ndarray]:
    """``filter_pca`` of a ViT's linear patch embedding E (weight (D, C, P, P)): (k, C, P, P), (k,).

    For a hybrid, C is the ResNet's channel count and P is 1, so the components are not
    images; the plot refuses them."""
    need_vit(model, ": it has no patch or position embeddings to analyse")
    return filter_pca(model.patch_embed.weight, k)


def cosine_similarity_grid(table: np.ndarray | torch.Tensor, grid: Pair) -> np.ndarray:
    """table (gh*gw, D) in raster order -> (gh, gw, gh, gw): entry [i, j, r, c] is the cosine
    similarity between the embedding of patch (i, j) and that of patch (r, c)."""
    t = table.detach().float().cpu().numpy() if isinstance(table, torch.Tensor) else np.asarray(table)
    t = t.astype(np.float64)
    gh, gw = grid
    if t.ndim != 2 or t.shape[0] != gh * gw:
        raise ValueError(f"expected a table of {gh * gw} position embeddings (N, D), got shape {t.shape}")
    unit = t / np.clip(np.linalg.norm(t, axis=1, keepdims=True), 1e-12, None)
    return (unit @ unit.T).reshape(gh, gw, gh, gw)


def position_embedding_table(model: nn.Module) -> np.ndarray:
    """The learned position embeddings of the patches, (gh*gw, D), without the [class] entry.

    Works for 1D and 2D learned embeddings added at the stem (for 2D: the concatenated
    X and Y tables per patch); with one table per layer, the first layer's."""
    need_vit(model, ": it has no patch or position embeddings to analyse")
    cfg = model.cfg
    if cfg.posemb == "none":  # it was told of relative embeddings, which it has no more than absolute ones
        raise ValueError("posemb='none': the model has no position embeddings to compare, absolute or relative")
    if cfg.posemb == "relative":
        raise ValueError(
            f"posemb={cfg.posemb!r}: the model has no absolute position embeddings to compare "
            "(relative embeddings live inside the attention as offsets, not per patch)"
        )
    module = model.pos_embed if model.pos_embed is not None else model.layer_pos_embeds[0]
    with torch.no_grad():
        table = module(tuple(cfg.grid_size))  # (1, prefix + N, D)
    return table[0, cfg.num_prefix_tokens:].detach().float().cpu().numpy()


def position_similarity(model: nn.Module) -> np.ndarray:
    """Cosine similarity of every patch's position embedding to all others: (gh, gw, gh, gw)."""
    return cosine_similarity_grid(position_embedding_table(model), tuple(model.cfg.grid_size))
