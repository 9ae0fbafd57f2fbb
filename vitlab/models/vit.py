"""The Vision Transformer (paper Sec. 3.1, Eq. 1-4).

    image (B, C, H, W)
      -> [optional BiT ResNet stem: feature map (B, C', H/r, W/r)]       hybrid, Sec. 3.1
      -> patches projected to width D: (B, N, D), N = (H/P) * (W/P)        Eq. 1
      -> prepend the learned [class] token (classifier="token")
      -> add position embeddings, dropout                                 Eq. 1
      -> [training only, optional: keep a random subset of the patch tokens]
      -> depth x pre-LN blocks: x + MSA(LN(x)), x + MLP(LN(x))            Eq. 2-3
      -> LayerNorm; take the [class] token or average the patches          Eq. 4
      -> [optional pre-logits: dense + tanh]  -> zero-initialised linear head

Read top to bottom; the parts live in layers.py and posemb.py.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..config import Pair, ViTConfig, need_bool
from .init import lecun_normal_
from .inputs import check_images
from .layers import Block
from .posemb import LearnedPosEmb1D, LearnedPosEmb2D
from .resnet import ResNetFeatures


def make_posemb(cfg: ViTConfig) -> nn.Module | None:
    """The learned absolute embedding of ``cfg.posemb`` for the training grid (or None)."""
    if cfg.posemb == "learned_1d":
        return LearnedPosEmb1D(cfg.num_prefix_tokens, cfg.grid_size, cfg.width, cfg.posemb_resample)
    if cfg.posemb == "learned_2d":
        return LearnedPosEmb2D(cfg.num_prefix_tokens, cfg.grid_size, cfg.width, cfg.posemb_resample)
    return None  # "none", or "relative", which lives inside the attention layers


class PreLogits(nn.Module):
    """Dense + tanh: the hidden layer of the pre-training head (paper Sec. 3.1)."""

    def __init__(self, width: int, size: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, size)
        lecun_normal_(self.fc.weight)
        nn.init.zeros_(self.fc.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        if cfg.axial and type(self) is VisionTransformer:  # built here, the blocks were full attention
            raise ValueError("VisionTransformer(cfg): cfg.axial=True describes an Axial-ViT; build it with "
                             "vitlab.create_model(cfg) (or vitlab.models.axial.AxialVisionTransformer)")
        self.cfg = cfg
        D = cfg.width

        self.stem: nn.Module | None = None
        in_chans = cfg.in_chans
        if cfg.resnet is not None:
            self.stem = ResNetFeatures(cfg.resnet)
            in_chans = self.stem.out_channels
        self.patch_embed = nn.Conv2d(in_chans, D, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        lecun_normal_(self.patch_embed.weight)
        nn.init.zeros_(self.patch_embed.bias)

        self.cls_token = nn.Parameter(torch.zeros(1, 1, D)) if cfg.classifier == "token" else None

        # Where the position embeddings go (paper Table 8): once at the stem, before
        # every block with one table per block, or before every block with one table.
        self.pos_embed = make_posemb(cfg) if cfg.posemb_place != "every_layer" else None
        self.layer_pos_embeds = None
        if cfg.posemb_place == "every_layer" and cfg.posemb != "none":
            self.layer_pos_embeds = nn.ModuleList(make_posemb(cfg) for _ in range(cfg.depth))
        self.pos_drop = nn.Dropout(cfg.dropout)

        rates = [cfg.drop_path * i / max(cfg.depth - 1, 1) for i in range(cfg.depth)]
        self.blocks = nn.ModuleList(self.make_block(cfg, rate) for rate in rates)
        self.norm = nn.LayerNorm(D, eps=cfg.ln_eps)

        self.pre_logits = PreLogits(D, cfg.representation_size) if cfg.representation_size else None
        self.num_features = cfg.representation_size or D
        self.head = self._new_head(cfg.num_classes)

    def make_block(self, cfg: ViTConfig, drop_path: float) -> nn.Module:
        """One encoder layer; subclasses (Axial-ViT) build theirs here."""
        return Block(cfg, drop_path, seq_len=cfg.num_prefix_tokens + cfg.num_patches)

    def _new_head(self, num_classes: int) -> nn.Module:
        if num_classes == 0:
            return nn.Identity()
        head = nn.Linear(self.num_features, num_classes)
        nn.init.zeros_(head.weight)  # paper Sec. 3.2: a zero-initialised D x K layer
        nn.init.zeros_(head.bias)
        return head

    def reset_classifier(self, num_classes: int, pre_logits: bool = True) -> None:
        """Replace the head by a zero-initialised one for ``num_classes`` (0: no head), on the
        model's device and in its dtype; ``pre_logits=False`` removes the pre-logits layer too
        (the paper's fine-tuning removes the whole head, both layers: Sec. 3.2)."""
        need_bool("pre_logits", pre_logits)
        dropped = {} if pre_logits else {"representation_size": None}
        cfg = dataclasses.replace(self.cfg, num_classes=num_classes, **dropped)  # checked before the model changes
        if not pre_logits:
            self.pre_logits, self.num_features = None, cfg.width
        # a new module is made in torch's defaults: a model moved by .to(dtype or device) needs its head there too
        self.head = self._new_head(num_classes).to(self.norm.weight)
        self.cfg = cfg

    def patch_grid(self, img_size: Pair) -> Pair:
        """The patch grid an input of ``img_size`` produces."""
        h, w = self.cfg.feature_size_of(img_size)
        ph, pw = self.cfg.patch_size
        return (h // ph, w // pw)

    def _check_input(self, x: torch.Tensor) -> None:
        check_images(x, self.cfg.in_chans, self.patch_embed.weight.dtype)
        size = tuple(x.shape[-2:])
        if not self.cfg.dynamic_img_size and size != self.cfg.img_size:
            raise ValueError(
                f"input size {size} differs from img_size={self.cfg.img_size}; build the model for this "
                "size (position embeddings are resampled when loading weights) or set dynamic_img_size=True"
            )
        if not self.cfg.divides_into_patches(size):
            raise ValueError(f"input size {size} is not divisible into patches of {self.cfg.patch_size}")
        if self.cfg.attn_bias != "none":
            # the distance penalty reads its grid from the sequence length (DistanceBias.grid_of): another grid of the
            # model's patch count was read as the model's (silently wrong distances), another non-square one failed
            grid, own = self.patch_grid(size), self.cfg.grid_size
            if grid != own and (grid[0] != grid[1] or grid[0] * grid[1] == own[0] * own[1]):
                raise ValueError(f"input size {size}: attn_bias={self.cfg.attn_bias!r} places the patches on the "
                                 f"model's grid {own} or a square one of another size, not {grid}")

    def patchify(self, x: torch.Tensor) -> tuple[torch.Tensor, Pair]:
        """Images (B, C, H, W) -> patch embeddings (B, N, D), and the patch grid."""
        # torch.fx.symbolic_trace passes a Proxy, whose shape Python cannot compare or branch on:
        # the traced graph is the model's at its img_size (its input unchecked), its grid the config's
        traced = isinstance(x, torch.fx.Proxy)
        if not traced:
            self._check_input(x)
        if self.stem is not None:
            x = self.stem(x)
        x = self.patch_embed(x)  # (B, D, gh, gw)
        grid = self.patch_grid(self.cfg.img_size) if traced else (x.shape[-2], x.shape[-1])
        # One copy here into token-major memory: a transposed view would carry the convolution's
        # channel-major strides into every residual sum of the stream, where nothing else
        # (a [class] token's concatenation) makes it contiguous, and each LayerNorm would copy it.
        return x.flatten(2).transpose(1, 2).contiguous(), grid

    def embed_patches(self, x: torch.Tensor, grid: Pair) -> torch.Tensor:
        """Patch embeddings (B, N, D) -> tokens (B, prefix + N, D): [class] token, position embeddings, dropout."""
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        if self.pos_embed is not None:
            x = x + self.pos_embed(grid)
        return self.pos_drop(x)

    def embed(self, x: torch.Tensor) -> tuple[torch.Tensor, Pair, torch.Tensor | None]:
        """Images (B, C, H, W) -> tokens (B, prefix + K, D) with position embeddings, the patch grid,
        and where the K patch tokens lie on it: None when they are the whole grid in raster order
        (K = N), else their (row, column), (B, K, 2) (training with ``patch_dropout``)."""
        patches, grid = self.patchify(x)
        tokens = self.embed_patches(patches, grid)
        if self.training and self.cfg.patch_dropout > 0:
            tokens, positions = self.drop_patches(tokens, grid)
            return tokens, grid, positions
        return tokens, grid, None

    def drop_patches(self, x: torch.Tensor, grid: Pair) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep a random ``1 - patch_dropout`` of each sequence's patch tokens (prefix tokens stay),
        and give the kept ones' (row, column) on ``grid``, (B, K, 2).

        The kept tokens carry their position embeddings, and an attention bias of the grid
        (``attn_bias``) takes their positions, so their order does not matter; the encoder
        then costs less in proportion.
        """
        if self.cfg.attn_bias != "none" and any(g > m for g, m in zip(grid, self.cfg.grid_size)):
            raise ValueError(f"patch_dropout with attn_bias={self.cfg.attn_bias!r}: the patch grid {grid} of a training "
                             f"input is larger than the model's {self.cfg.grid_size}; train at img_size or below")
        prefix, patches = x[:, :self.cfg.num_prefix_tokens], x[:, self.cfg.num_prefix_tokens:]
        B, N, D = patches.shape
        # Under torch.fx.symbolic_trace B and N are Proxies: the count is the grid's, which kept_patches can round,
        # and torch.rand(B, N)'s draws are made by a method of the patches, which fx records (a factory it cannot)
        keep = self.cfg.kept_patches(grid[0] * grid[1])
        index = patches.new_empty((B, N), dtype=torch.float32).uniform_().argsort(dim=1)[:, :keep]
        patches = torch.gather(patches, 1, index.unsqueeze(-1).expand(B, keep, D))
        positions = torch.stack([index.div(grid[1], rounding_mode="floor"), index.remainder(grid[1])], dim=-1)
        return torch.cat([prefix, patches], dim=1), positions

    def run_blocks(self, x: torch.Tensor, grid: Pair, keep: list[torch.Tensor] | None = None,
                   positions: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder blocks; appends each block's output to ``keep`` when given.  ``positions``:
        the patch tokens' places on the grid when not all of it in raster order (``embed``)."""
        shared = self.pos_embed if self.cfg.posemb_place == "every_layer_shared" else None
        for i, block in enumerate(self.blocks):
            if self.layer_pos_embeds is not None:
                x = x + self.layer_pos_embeds[i](grid)
            elif shared is not None and i > 0:  # block 0 received it in embed()
                x = x + shared(grid)
            x = block(x, positions)
            if keep is not None:
                keep.append(x)
        return x

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> encoder output after the final LayerNorm, (B, prefix + N, D)
        (K kept patches instead of N in training with ``patch_dropout``)."""
        tokens, grid, positions = self.embed(x)
        return self.norm(self.run_blocks(tokens, grid, positions=positions))

    def forward_intermediates(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The token sequence (B, prefix + N, D) after every block, before the final LayerNorm."""
        keep: list[torch.Tensor] = []
        tokens, grid, positions = self.embed(x)
        self.run_blocks(tokens, grid, keep=keep, positions=positions)
        return keep

    def pool(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, prefix + N, D) -> (B, D): the [class] token, or the mean of the patch tokens."""
        if self.cfg.classifier == "token":
            return tokens[:, 0]
        return tokens[:, self.cfg.num_prefix_tokens:].mean(dim=1)

    def forward_head(self, tokens: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Encoder output -> logits (B, K), or the representation (B, F) when ``pre_logits``."""
        x = self.pool(tokens)
        if self.pre_logits is not None:
            x = self.pre_logits(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))
