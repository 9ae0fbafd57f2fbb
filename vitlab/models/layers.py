"""The Transformer encoder's parts: attention, MLP, pre-LayerNorm block (paper Eq. 2-3).

Dropout follows the paper: after every dense layer except the qkv projection.  The
attention uses ``scaled_dot_product_attention`` (when training in bf16 on a CPU, two
matmuls and a softmax, which are faster there: see ``explicit_attention_is_faster``); to
inspect the model, the context manager ``capture_attention`` switches every layer to an
explicit softmax that records the attention probabilities, and switches back on exit.
In training, each LayerNorm and the GELU hand their dense layer the input they came
from rather than their output, which is recomputed in the backward (``fused.py``).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ViTConfig
from .buffers import Dense
from .fused import gelu_dense, layer_norm_dense, split_heads
from .init import xavier_uniform_chunks_
from .posemb import RelativePosBias


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


def explicit_attention_is_faster(q: torch.Tensor) -> bool:
    """Whether two matmuls and a softmax beat ``scaled_dot_product_attention`` for ``q``.

    Only when training in bf16 on a CPU: PyTorch's CPU flash-attention kernel has a slow
    bf16 backward, so a CIFAR-size ViT's bf16 training step is 1.3x faster without it and
    ViT-S/16's 1.07x (``python benchmarks/ab.py attention_bf16``).  Its forward is fine
    (ViT-B/16 bf16 inference, batch 8: level or up to 2.6% faster with the kernel), and in
    fp32 the kernel wins (CIFAR-size training step 1.10x faster with it; ``python
    benchmarks/ab.py attention_paths``).  GPUs keep their fused kernels.
    """
    return q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.requires_grad


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection.

    The official checkpoints store query, key and value as three (D, H, D/H) kernels;
    they are concatenated into one (3D, D) matrix so that one matmul produces all three.
    """

    def __init__(self, cfg: ViTConfig, seq_len: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = Dense(cfg.width, 3 * cfg.width, bias=cfg.qkv_bias)
        self.proj = Dense(cfg.width, cfg.width)
        self.attn_drop = cfg.attention_dropout
        self.proj_drop = nn.Dropout(cfg.dropout)
        self.rel_pos = (
            RelativePosBias(seq_len, cfg.num_heads, cfg.head_dim) if cfg.posemb == "relative" else None
        )
        # When a list, every forward appends its attention probabilities (B, H, L, L).
        self.recorded: list[torch.Tensor] | None = None
        xavier_uniform_chunks_(self.qkv.weight, 3)
        nn.init.xavier_uniform_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)
        if self.qkv.bias is not None:
            nn.init.zeros_(self.qkv.bias)

    def forward(self, x: torch.Tensor, norm: nn.LayerNorm | None = None) -> torch.Tensor:
        """Attention over ``x``, or over ``norm(x)`` when a norm is given."""
        B, L, D = x.shape
        qkv = layer_norm_dense(x, norm, self.qkv) if norm is not None else self.qkv(x)
        q, k, v = split_heads(qkv, self.num_heads)
        bias = self.rel_pos(q * self.head_dim**-0.5) if self.rel_pos is not None else None
        if self.recorded is None and not explicit_attention_is_faster(q):
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
        out = out.transpose(1, 2).reshape(B, L, D)  # (B, L, H*hd)
        return self.proj_drop(self.proj(out))


class Mlp(nn.Module):
    """Dense -> GELU -> dropout -> dense -> dropout."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.fc1 = Dense(cfg.width, cfg.mlp_dim)
        self.approximate = "tanh" if cfg.gelu == "tanh" else "none"  # F.gelu's argument
        self.fc2 = Dense(cfg.mlp_dim, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(fc.weight)
            nn.init.normal_(fc.bias, std=1e-6)

    def forward(self, x: torch.Tensor, norm: nn.LayerNorm | None = None) -> torch.Tensor:
        """The MLP of ``x``, or of ``norm(x)`` when a norm is given."""
        h = layer_norm_dense(x, norm, self.fc1) if norm is not None else self.fc1(x)
        return self.drop(gelu_dense(h, self.approximate, self.drop, self.fc2))


class Block(nn.Module):
    """Pre-LN encoder block: x + MSA(LN(x)), then x + MLP(LN(x)).

    Acts on any (B, L, D) sequence, so Axial-ViT reuses it for rows and columns.
    ``seq_len`` is needed only for relative position embeddings.
    """

    def __init__(self, cfg: ViTConfig, drop_path: float = 0.0, seq_len: int | None = None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.width, eps=cfg.ln_eps)
        self.attn = Attention(cfg, seq_len)
        self.norm2 = nn.LayerNorm(cfg.width, eps=cfg.ln_eps)
        self.mlp = Mlp(cfg)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(x, self.norm1))
        return x + self.drop_path(self.mlp(x, self.norm2))


@contextlib.contextmanager
def capture_attention(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Record the attention probabilities of every attention layer of ``model``.

    Inside the ``with`` block each forward appends one (B, H, L, L) tensor per layer,
    in the order the layers run (for Axial-ViT: row, column, row, ...; there B counts
    rows or columns).  The default fused path is untouched outside the block::

        with capture_attention(model) as maps:
            model(images)
        rollout = attention_rollout(maps)
    """
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention layers to capture")
    recorded: list[torch.Tensor] = []
    for layer in layers:
        layer.recorded = recorded
    try:
        yield recorded
    finally:
        for layer in layers:
            layer.recorded = None
