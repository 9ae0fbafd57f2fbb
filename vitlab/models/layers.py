"""The Transformer encoder's parts: attention, MLP, pre-LayerNorm block (paper Eq. 2-3).

Plain PyTorch: every ``nn.LayerNorm`` and ``nn.Linear`` is called as a module, so hooks,
wrappers (LoRA-style adapters) and module swaps (quantisation) see every call.  Speed
lives in ``vitlab.fast``, which installs itself on top of these modules and can be undone.

Dropout follows the paper: after every dense layer except the qkv projection.  Attention
runs through ``scaled_dot_product_attention``; to inspect the model, ``capture_attention``
switches every layer to an explicit softmax that records the attention probabilities.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ViTConfig
from .init import xavier_uniform_chunks_
from .posemb import DistanceBias, RelativePosBias


class DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch per sample (not in the paper)."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rate == 0.0 or not self.training:
            return x
        keep = 1.0 - self.rate
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep


def split_heads(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value, each (B, H, L, D/H), as views of the fused (B, L, 3D) projection."""
    B, L, width3 = qkv.shape
    return qkv.view(B, L, 3, num_heads, width3 // (3 * num_heads)).permute(2, 0, 3, 1, 4).unbind(0)


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection.

    The official checkpoints store query, key and value as three (D, H, D/H) kernels;
    they are concatenated into one (3D, D) matrix so that one matmul produces all three.
    """

    def __init__(self, cfg: ViTConfig, seq_len: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.attn_drop = cfg.attention_dropout
        self.proj_drop = nn.Dropout(cfg.dropout)
        self.rel_pos = (
            RelativePosBias(seq_len, cfg.num_heads, cfg.head_dim) if cfg.posemb == "relative" else None
        )
        self.distance_bias = (
            DistanceBias(cfg.num_heads, cfg.num_prefix_tokens, cfg.grid_size, mask_self=cfg.attn_bias == "distance_no_self",
                         offsets=cfg.attn_offsets)
            if cfg.attn_bias != "none" else None
        )
        # When a list, every forward appends its attention probabilities (B, H, L, L).
        self.recorded: list[torch.Tensor] | None = None
        xavier_uniform_chunks_(self.qkv.weight, 3)
        nn.init.xavier_uniform_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)
        if self.qkv.bias is not None:
            nn.init.zeros_(self.qkv.bias)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, explicit: bool = False,
               positions: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + bias) v over (B, H, L, D/H) heads -> (B, L, D).

        explicit: two matmuls and a softmax instead of the fused kernel (the same values);
        always so while ``capture_attention`` records.  positions: the patch tokens' (row,
        column), (B, K, 2), when they are not the whole grid in raster order (patch dropout),
        for the distance penalty.
        """
        B, H, L, _ = q.shape
        bias = self.rel_pos(q * self.head_dim**-0.5) if self.rel_pos is not None else None
        if self.distance_bias is not None:
            bias = self.distance_bias(q, positions)
        if self.recorded is None and not explicit:
            drop = self.attn_drop if self.training else 0.0
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=drop)
        else:
            logits = (q * self.head_dim**-0.5) @ k.transpose(-2, -1)
            if bias is not None:
                logits = logits + bias
            probs = logits.softmax(dim=-1)
            if self.recorded is not None:
                self.recorded.append(probs.detach())
            out = F.dropout(probs, self.attn_drop, self.training) @ v
        return out.transpose(1, 2).reshape(B, L, H * self.head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = split_heads(self.qkv(x), self.num_heads)
        return self.proj_drop(self.proj(self.attend(q, k, v, positions=positions)))


class Mlp(nn.Module):
    """Dense -> GELU -> dropout -> dense -> dropout."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.width, cfg.mlp_dim)
        self.approximate = "tanh" if cfg.gelu == "tanh" else "none"  # F.gelu's argument
        self.fc2 = nn.Linear(cfg.mlp_dim, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(fc.weight)
            nn.init.normal_(fc.bias, std=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x), approximate=self.approximate)
        return self.drop(self.fc2(self.drop(h)))


class Block(nn.Module):
    """Pre-LN encoder block: x + MSA(LN(x)), then x + MLP(LN(x)).

    Acts on any (B, L, D) sequence, so Axial-ViT reuses it for rows and columns.
    ``seq_len`` is needed only for relative position embeddings; ``positions`` (B, K, 2),
    the patch tokens' places on the grid, only for a distance penalty on a sequence that is
    not the whole grid in raster order (patch dropout).
    """

    def __init__(self, cfg: ViTConfig, drop_path: float = 0.0, seq_len: int | None = None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.width, eps=cfg.ln_eps)
        self.attn = Attention(cfg, seq_len)
        self.norm2 = nn.LayerNorm(cfg.width, eps=cfg.ln_eps)
        self.mlp = Mlp(cfg)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x), positions))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class _Reducing(list):
    """A recording that keeps ``each(map)`` of every map instead of the map itself."""

    def __init__(self, each: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.each = each

    def append(self, probs: torch.Tensor) -> None:
        super().append(self.each(probs))


@contextlib.contextmanager
def capture_attention(model: nn.Module, each: Callable[[torch.Tensor], Any] | None = None
                      ) -> Iterator[list[torch.Tensor]]:
    """Record the attention probabilities of every attention layer of ``model``.

    Inside the ``with`` block each forward appends one (B, H, L, L) tensor per layer,
    in the order the layers run (for Axial-ViT: row, column, row, ...; there B counts
    rows or columns).  The fused kernel is back in use outside the block::

        with capture_attention(model) as maps:
            model(images)
        rollout = attention_rollout(maps)

    The maps of every layer are kept at once (a forward of ViT-L/16 at 384 px records about
    0.5 GB per image).  ``each``, a function of one layer's map, is called as that layer
    runs, and the list keeps what it returns instead of the map: memory for one layer's
    maps, reduced on the way (``vitlab.analysis.attention`` reduces so).
    """
    if not isinstance(model, nn.Module):  # a string or None failed on its missing modules()
        raise TypeError(f"capture_attention: model={model!r:.80}: expected a torch.nn.Module")
    if each is not None and not callable(each):
        raise TypeError(f"capture_attention: each={each!r:.80}: expected a function of one layer's map, or None")
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention layers to capture")
    recorded: list[torch.Tensor] = [] if each is None else _Reducing(each)
    # given back at the end, not cleared: a capture around this one (a caller's, around an
    # analysis call) records on after it
    outer = [layer.recorded for layer in layers]
    for layer in layers:
        layer.recorded = recorded
    try:
        yield recorded
    finally:
        for layer, before in zip(layers, outer):
            layer.recorded = before
