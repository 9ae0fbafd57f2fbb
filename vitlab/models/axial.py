"""Axial-ViT (paper Appendix D.6): attention along rows, then along columns.

Each of the ``depth`` layers is two ordinary pre-LN blocks (attention + MLP): the first
attends within every row of the patch grid, the second within every column, so a
patch reaches the whole grid in one layer at O(N * (gh + gw)) attention cost.

    image (B, C, H, W) -> patch embedding + position embedding (B, gh*gw, D)
      -> depth x [row block on (B*gh, gw, D), column block on (B*gw, gh, D)]
      -> LayerNorm -> mean over patches -> [pre-logits] -> zero-initialised head

Everything except the blocks is the ViT's own code: the class below inherits the
embedding, head and API of ``VisionTransformer`` and replaces only its blocks.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import Pair, ViTConfig
from .layers import Block
from .vit import VisionTransformer


def along_rows(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Apply a sequence block to every row of a grid: (B, gh, gw, D) -> (B, gh, gw, D)."""
    B, gh, gw, D = x.shape
    return block(x.reshape(B * gh, gw, D)).reshape(B, gh, gw, D)


def along_columns(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Apply a sequence block to every column of a grid: (B, gh, gw, D) -> (B, gh, gw, D)."""
    return along_rows(block, x.transpose(1, 2)).transpose(1, 2)


class AxialBlock(nn.Module):
    """One Axial-ViT layer: a row block (``row``) then a column block (``col``)."""

    def __init__(self, cfg: ViTConfig, drop_path: float = 0.0) -> None:
        super().__init__()
        self.row = Block(cfg, drop_path)
        self.col = Block(cfg, drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, gh, gw, D) -> (B, gh, gw, D)."""
        return along_columns(self.col, along_rows(self.row, x))


class AxialVisionTransformer(VisionTransformer):
    """Axial-ViT classifier: images (B, C, H, W) -> logits (B, num_classes).

    Same API as ``VisionTransformer``: ``forward_features`` returns the normalised patch
    tokens (B, gh*gw, D), ``forward_head(tokens, pre_logits=False)`` averages them
    (classifier "gap"), ``reset_classifier``, ``cfg``.  ``blocks[i].row`` and
    ``blocks[i].col`` are the two sub-blocks of layer i.
    """

    def __init__(self, cfg: ViTConfig) -> None:
        if not cfg.axial:
            raise ValueError("AxialVisionTransformer needs a config with axial=True")
        super().__init__(cfg)

    def make_block(self, cfg: ViTConfig, drop_path: float) -> nn.Module:
        return AxialBlock(cfg, drop_path)

    def run_blocks(self, x: torch.Tensor, grid: Pair, keep: list[torch.Tensor] | None = None,
                   positions: None = None) -> torch.Tensor:
        """Tokens (B, gh*gw, D) in raster order -> (B, gh*gw, D) after every axial layer.

        Appends each layer's output (B, gh*gw, D) to ``keep`` when given.  ``positions`` is
        always None: the rows and columns need every patch (the config refuses patch dropout).
        """
        B, N, D = x.shape
        x = x.reshape(B, grid[0], grid[1], D)
        for block in self.blocks:
            x = block(x)
            if keep is not None:
                keep.append(x.reshape(B, N, D))
        return x.reshape(B, N, D)
