"""Position embeddings (paper Sec. 3.1 and Appendix D.4) and their resampling.

Three learned kinds live here: a 1D table over the token sequence, a 2D pair of row
and column tables, and the relative-attention bias.  ``resample_grid`` is the pure
function that adapts a learned grid to another resolution (paper Sec. 3.2).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Pair


def resample_grid(grid: torch.Tensor, new_size: Pair, mode: str = "bilinear") -> torch.Tensor:
    """Resize a grid of embeddings (h, w, D) to (H, W, D) by 2D interpolation.

    mode="bilinear" uses aligned corners, which is exactly what the official code's
    ``scipy.ndimage.zoom(order=1)`` computes; mode="bicubic" (corners not aligned)
    matches Hugging Face's on-the-fly interpolation.
    """
    if tuple(grid.shape[:2]) == tuple(new_size):
        return grid
    x = grid.permute(2, 0, 1).unsqueeze(0)  # (1, D, h, w)
    if not x.is_floating_point():
        x = x.float()
    align = mode == "bilinear"
    x = F.interpolate(x, size=tuple(new_size), mode=mode, align_corners=align)
    return x.squeeze(0).permute(1, 2, 0).to(grid.dtype)


def resample_table_1d(table: torch.Tensor, num_prefix: int, old_grid: Pair, new_grid: Pair,
                      mode: str = "bilinear") -> torch.Tensor:
    """Resample a learned 1D table (1, prefix + h*w, D) to a new patch grid.

    The prefix ([class]) embeddings are kept as they are; only the patch grid moves.
    """
    prefix, patches = table[:, :num_prefix], table[0, num_prefix:]
    if patches.shape[0] != old_grid[0] * old_grid[1]:
        raise ValueError(
            f"position embedding holds {patches.shape[0]} patch positions, "
            f"which is not the grid {old_grid[0]}x{old_grid[1]}"
        )
    grid = resample_grid(patches.reshape(*old_grid, -1), new_grid, mode)
    return torch.cat([prefix, grid.reshape(1, -1, grid.shape[-1])], dim=1)


class LearnedPosEmb1D(nn.Module):
    """One learned vector per token position: [class] (if any) then patches in raster order."""

    def __init__(self, num_prefix: int, grid: Pair, width: int, resample: str) -> None:
        super().__init__()
        self.num_prefix, self.grid, self.resample = num_prefix, grid, resample
        self.weight = nn.Parameter(torch.empty(1, num_prefix + grid[0] * grid[1], width))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, grid: Pair) -> torch.Tensor:
        """(1, prefix + gh*gw, D) for the requested patch grid."""
        if tuple(grid) == self.grid:
            return self.weight
        return resample_table_1d(self.weight, self.num_prefix, self.grid, grid, self.resample)


class LearnedPosEmb2D(nn.Module):
    """Separate row (Y) and column (X) tables of width D/2, concatenated per patch.

    Paper Appendix D.4: "we concatenate the X and Y embedding".  The [class] token,
    which has no row or column, gets its own learned vector of width D.
    """

    def __init__(self, num_prefix: int, grid: Pair, width: int, resample: str) -> None:
        super().__init__()
        self.num_prefix, self.grid, self.resample = num_prefix, grid, resample
        self.x = nn.Parameter(torch.empty(grid[1], width // 2))
        self.y = nn.Parameter(torch.empty(grid[0], width // 2))
        self.prefix = nn.Parameter(torch.empty(1, num_prefix, width)) if num_prefix else None
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)

    def _axis(self, table: torch.Tensor, trained: int, length: int) -> torch.Tensor:
        # the lengths compared are the config's, not the table's shape: torch.fx.symbolic_trace cannot branch on that
        if trained == length:
            return table
        # a 1D table is a (n, 1) grid; resample it along its one axis
        return resample_grid(table.unsqueeze(1), (length, 1), self.resample).squeeze(1)

    def forward(self, grid: Pair) -> torch.Tensor:
        gh, gw = grid
        x = self._axis(self.x, self.grid[1], gw).unsqueeze(0).expand(gh, gw, -1)
        y = self._axis(self.y, self.grid[0], gh).unsqueeze(1).expand(gh, gw, -1)
        table = torch.cat([x, y], dim=-1).reshape(1, gh * gw, -1)
        if self.prefix is not None:
            table = torch.cat([self.prefix, table], dim=1)
        return table


class RelativePosBias(nn.Module):
    """1D relative attention (paper Appendix D.4).

    Every offset between a query position and a key position, q - k, has a learned
    embedding.  An extra attention is computed with the original queries against these
    embeddings as keys; its logits are added as a bias to the content logits before the
    softmax.  Positions are the token indices ([class] first, then patches in raster
    order), so offsets range over -(L-1) .. L-1 for L tokens.
    """

    def __init__(self, seq_len: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.weight = nn.Parameter(torch.empty(2 * seq_len - 1, num_heads, head_dim))
        nn.init.normal_(self.weight, std=0.02)

    def table(self, seq_len: int) -> torch.Tensor:
        if seq_len == self.seq_len:
            return self.weight
        flat = self.weight.flatten(1).unsqueeze(1)  # (2L-1, 1, H*hd) as a grid
        flat = resample_grid(flat, (2 * seq_len - 1, 1), "bilinear").squeeze(1)
        return flat.view(2 * seq_len - 1, *self.weight.shape[1:])

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        """q: (B, H, L, hd), already scaled -> additive bias (B, H, L, L)."""
        # under torch.fx.symbolic_trace q's length is a Proxy, which the table's choice cannot branch on: the
        # traced graph is the model's at its img_size (VisionTransformer.patchify), so its length is the table's
        L = self.seq_len if isinstance(q, torch.fx.Proxy) else q.shape[2]
        logits = torch.einsum("bhqd,rhd->bhqr", q, self.table(L))  # (B, H, L, 2L-1)
        pos = torch.arange(L, device=q.device)
        offset = pos[:, None] - pos[None, :] + (L - 1)  # (L, L) index of q - k
        return logits.gather(-1, offset.expand(q.shape[0], q.shape[1], L, L))


class DistanceBias(nn.Module):
    """A learned 2D locality prior on attention: each head adds ``-slope_h * distance`` to its
    logits, where ``distance`` is the Euclidean distance between the query's and the key's
    patches on the patch grid, in patches (ALiBi's linear distance penalty, Press et al. 2022,
    over two dimensions).  Not in the paper.

    Each layer learns its heads' slopes (as logarithms, so they stay positive); they start
    log-spaced from 2 (a head that mostly sees a patch's neighbours) to 1/8 (a nearly global
    head), the spread that lets a small model on little data use locality from its first
    steps, as a convolution would, and unlearn it where the data says otherwise.  Prefix
    tokens ([class]) attend and are attended to without a penalty.  The penalty is a function
    of the grid, so it follows the input size (progressive resizing, a fine-tune at a higher
    resolution) with nothing to resample.

    ``mask_self``: a patch does not attend to itself (the diagonal masking of Lee et al.
    2021's locality self-attention): the residual already carries a token's own value, and
    the steepest heads would otherwise spend most of their weight there.  [class] still
    attends to itself.

    ``offsets``: each head also adds a learned value for every 2D offset between two patches
    (``offset_bias``, one row of (2h-1)(2w-1) values per head for the model's h x w grid, zero
    at the start: the penalty alone), as Swin's relative position bias does: the penalty is
    the same in every direction, the offsets let a head prefer one, as a convolution's taps
    do.  A smaller grid reads the entries of its offsets; a larger one clamps its offsets to
    the table's edge.
    """

    def __init__(self, num_heads: int, num_prefix: int, grid: Pair, mask_self: bool = False,
                 offsets: bool = False) -> None:
        super().__init__()
        self.num_prefix, self.grid, self.mask_self = num_prefix, tuple(grid), mask_self
        slopes = torch.logspace(1, -3, num_heads, base=2.0) if num_heads > 1 else torch.tensor([0.5])
        self.log_slope = nn.Parameter(slopes.log())
        # the model's own grid's distances, moved with the model; not state (they follow from the grid)
        self.register_buffer("grid_distance", self.distance(self.grid, torch.device("cpu")), persistent=False)
        if mask_self:  # the same grid's diagonal of patches, where the penalty puts -inf
            self.register_buffer("grid_self_mask", self.self_mask(self.grid_distance.shape[0], torch.device("cpu")),
                                 persistent=False)
        self.offset_bias = None
        if offsets:
            span = (2 * self.grid[0] - 1) * (2 * self.grid[1] - 1)
            self.offset_bias = nn.Parameter(torch.zeros(num_heads, span))
            self.register_buffer("grid_offset_index", self.offset_index(self.grid, torch.device("cpu")), persistent=False)

    def grid_of(self, tokens: int) -> Pair:
        """The patch grid of a sequence of ``tokens``: the model's, or a square one (progressive
        resizing and dynamic sizes keep square inputs square)."""
        patches = tokens - self.num_prefix
        if patches == self.grid[0] * self.grid[1]:
            return self.grid
        side = math.isqrt(patches)
        if side * side != patches:
            raise ValueError(f"attn_bias (distance penalty): a sequence of {patches} patches is not the model's grid "
                             f"{self.grid} nor a square one")
        return side, side

    def distance(self, grid: Pair, device: torch.device) -> torch.Tensor:
        """(L, L): the distance between the patches of every pair of tokens, 0 for a prefix token."""
        ys, xs = torch.meshgrid(torch.arange(grid[0], device=device), torch.arange(grid[1], device=device),
                                indexing="ij")
        where = torch.stack([ys.flatten(), xs.flatten()], dim=1).double()
        between = torch.cdist(where, where).float()  # (N, N)
        return F.pad(between, (self.num_prefix, 0, self.num_prefix, 0))

    def offset_index(self, grid: Pair, device: torch.device) -> torch.Tensor:
        """(L, L) long: each pair of patches' place in ``offset_bias`` (its offset, clamped to the
        model's grid), and one past the table's end for a pair with a prefix token (no bias)."""
        ys, xs = torch.meshgrid(torch.arange(grid[0], device=device), torch.arange(grid[1], device=device),
                                indexing="ij")
        ys, xs = ys.flatten(), xs.flatten()
        index = offset_table_index(self.grid, ys[:, None] - ys[None, :], xs[:, None] - xs[None, :])
        outside = (2 * self.grid[0] - 1) * (2 * self.grid[1] - 1)
        return F.pad(index, (self.num_prefix, 0, self.num_prefix, 0), value=outside)

    def self_mask(self, tokens: int, device: torch.device) -> torch.Tensor:
        """(L, L) bool: True where a patch token meets itself (a prefix token's diagonal stays False)."""
        return torch.diag(torch.arange(tokens, device=device) >= self.num_prefix)

    def forward(self, q: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """q: (B, H, L, hd) -> additive bias (1, H, L, L) in q's dtype; another grid than the
        model's (progressive resizing) has its distances computed for the call.  With
        ``positions``, the (row, column) of each patch token (B, L - prefix, 2) when they are
        not the whole grid in raster order (patch dropout): the bias of those tokens, (B, H, L, L)."""
        if positions is not None:
            return self.between(positions).to(q.dtype)  # the table in float32, as the offsets' gradient sums
        # under torch.fx.symbolic_trace q's length is a Proxy, which grid_of cannot branch on: the traced graph
        # is the model's at its img_size (VisionTransformer.patchify), on the model's grid
        grid = self.grid if isinstance(q, torch.fx.Proxy) else self.grid_of(q.shape[2])
        distance = self.grid_distance if grid == self.grid else self.distance(grid, q.device)
        bias = -self.log_slope.exp()[:, None, None] * distance
        if self.offset_bias is not None:
            index = self.grid_offset_index if grid == self.grid else self.offset_index(grid, q.device)
            bias = bias + F.pad(self.offset_bias, (0, 1))[:, index]
        if self.mask_self:  # masked_fill, not an infinite distance: the slopes' gradient stays finite
            mask = self.grid_self_mask if grid == self.grid else self.self_mask(distance.shape[0], q.device)
            bias = bias.masked_fill(mask, float("-inf"))
        return bias.unsqueeze(0).to(q.dtype)

    def between(self, positions: torch.Tensor) -> torch.Tensor:
        """The bias (B, H, L, L) among the prefix tokens and the patch tokens at ``positions``,
        (B, K, 2) long (row, column) on a grid no larger than the model's, K = L - prefix: the
        forward's values for those tokens, in any order, the places distinct.

        Between two patches the penalty, the offsets and the self-mask are all functions of
        the offset (dy, dx) alone (a patch meets itself at (0, 0) and nowhere else), so each
        head's whole bias is one value per offset (``bias_by_offset``), read once per pair.
        """
        dy = positions[:, :, None, 0] - positions[:, None, :, 0]  # (B, K, K)
        dx = positions[:, :, None, 1] - positions[:, None, :, 1]
        span = (2 * self.grid[0] - 1) * (2 * self.grid[1] - 1)
        prefix = (self.num_prefix, 0, self.num_prefix, 0)
        index = F.pad(offset_table_index(self.grid, dy, dx), prefix, value=span)  # (B, L, L); prefix: no bias
        B, L = index.shape[0], index.shape[1]
        table = self.bias_by_offset()  # (H, span + 1)
        H = table.shape[0]
        # gathered from the table expanded over the batch: the backward sums each image's pairs apart
        return table.expand(B, H, span + 1).gather(2, index.view(B, 1, L * L).expand(B, H, L * L)).view(B, H, L, L)

    def bias_by_offset(self) -> torch.Tensor:
        """(H, S + 1): each head's bias between two patches at each offset of the model's grid
        (S of them, ``offset_table_index``'s order), then 0 (a pair with a prefix token)."""
        gh, gw = self.grid
        dy, dx = torch.meshgrid(torch.arange(1 - gh, gh, device=self.log_slope.device),
                                torch.arange(1 - gw, gw, device=self.log_slope.device), indexing="ij")
        distance = (dy * dy + dx * dx).flatten().double().sqrt().float()  # as ``distance``: float64, then float32
        table = -self.log_slope.exp()[:, None] * distance
        if self.offset_bias is not None:
            table = table + self.offset_bias
        if self.mask_self:  # offset (0, 0): a patch and itself
            table = table.masked_fill(((dy == 0) & (dx == 0)).flatten(), float("-inf"))
        return F.pad(table, (0, 1))


def offset_table_index(grid: Pair, dy: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
    """The place of the offsets (dy, dx) in the offset table of a ``grid`` model's
    ``DistanceBias`` (row-major over dy, dx), offsets beyond the grid clamped to the table's edge."""
    gh, gw = grid
    return (dy.clamp(-(gh - 1), gh - 1) + gh - 1) * (2 * gw - 1) + dx.clamp(-(gw - 1), gw - 1) + gw - 1


def resize_offset_table(table: torch.Tensor, grid: Pair, new_grid: Pair) -> torch.Tensor:
    """A ``DistanceBias`` offset table (H, (2h-1)(2w-1)) of a ``grid`` model for a ``new_grid``
    model: each of the new grid's offsets takes the value the original gives it (the entry of
    that offset, clamped to the original table's edge), so the adapted model attends as the
    original does at that size."""
    dy, dx = torch.meshgrid(torch.arange(1 - new_grid[0], new_grid[0], device=table.device),
                            torch.arange(1 - new_grid[1], new_grid[1], device=table.device), indexing="ij")
    return table[:, offset_table_index(grid, dy.flatten(), dx.flatten())]


def posemb_sincos_2d(grid: Pair, width: int, temperature: float = 10_000.0) -> torch.Tensor:
    """big_vision's fixed 2D sin-cos position embedding (``models/vit.py: posemb_sincos_2d``), (1, h*w, D).

    Per patch (y, x) in raster order: [sin(x w), cos(x w), sin(y w), cos(y w)] with
    ``w_k = temperature ** -(k / (D/4 - 1))``, k < D/4.  Computed in float64, returned as float32.
    """
    if width % 4:
        raise ValueError(f"width={width}: the sin-cos 2D position embedding needs a multiple of 4")
    h, w = grid
    y, x = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij")
    omega = torch.arange(width // 4, dtype=torch.float64) / max(width // 4 - 1, 1)
    omega = 1.0 / temperature**omega
    y = y.flatten()[:, None] * omega[None]
    x = x.flatten()[:, None] * omega[None]
    table = torch.cat([torch.sin(x), torch.cos(x), torch.sin(y), torch.cos(y)], dim=1)
    return table.unsqueeze(0).float()
