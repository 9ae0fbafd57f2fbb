"""Masked patch prediction: the paper's self-supervised pre-training (Sec. 4.6, Appendix B.1.2).

    images -> patch embeddings (B, N, D)
      -> corrupt a fraction ``rate`` of each image's patches, at least one (50% in the paper):
         80% of them replaced by a learned [mask] embedding, 10% by the embedding of a
         random other patch of the batch, 10% left as they are
      -> [class] token, position embeddings, encoder, final LayerNorm (the ViT unchanged)
      -> a linear head on each corrupted patch's output predicts, as ``target``:
         "color"    its 3-bit mean colour: one of 512 classes (the paper's choice);
         "color4x4" the patch shrunk to 4x4 in 3-bit colour: 16 predictions of 512 classes;
         "pixels"   the whole patch, by L2 regression.

The backbone is an ordinary ``VisionTransformer``: after pre-training, ``model.vit`` is
saved and fine-tuned like any other ViT.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError, ViTConfig, is_number
from .vit import VisionTransformer

TARGETS = ("color", "color4x4", "pixels")
COLOR_BITS = 3
NUM_COLORS = 2 ** (3 * COLOR_BITS)  # 512
# What happens to a selected patch: replaced by [mask], by another patch, or kept.
MASKED, SWAPPED, KEPT = 1, 2, 3
SPLIT = (0.8, 0.1, 0.1)


# @torch.fx.wrap: torch.fx.symbolic_trace records a call of this function as one node of its graph; traced
# through, its counts of patches and of the batch's (Python numbers of the sizes) stopped it at a Proxy's size
@torch.fx.wrap
def corrupt_patches(patches: torch.Tensor, mask_token: torch.Tensor, rate: float,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Corrupt ``round(rate * N)`` patches of each image, at least one (module text).

    patches: (B, N, D); mask_token: (D,) or broadcastable to it.
    Returns the corrupted patches (B, N, D) and what happened to each patch (B, N): 0
    untouched (not selected), ``MASKED``, ``SWAPPED`` or ``KEPT`` (selected, left as is).
    """
    B, N, D = patches.shape
    count = max(1, round(rate * N))  # none: no patch to predict, and the head met an empty batch
    device = patches.device
    # a random rank per patch; the ``count`` lowest are selected: exactly ``count`` an image
    ranks = torch.rand(B, N, generator=generator, device=device).argsort(1).argsort(1)
    selected = ranks < count
    u = torch.rand(B, N, generator=generator, device=device)
    fate = torch.where(u < SPLIT[0], MASKED, torch.where(u < SPLIT[0] + SPLIT[1], SWAPPED, KEPT))
    fate = torch.where(selected, fate, 0)
    # another patch of the batch, anywhere (BERT's random token): an offset of 1 to B*N - 1 from
    # its own index, never itself (a lone patch, with no other, keeps its own)
    own = torch.arange(B * N, device=device).reshape(B, N)
    donors = (own + torch.randint(1, max(2, B * N), (B, N), generator=generator, device=device)) % (B * N)
    others = patches.reshape(B * N, D)[donors]
    out = torch.where((fate == MASKED).unsqueeze(-1), mask_token.reshape(1, 1, D).to(patches.dtype), patches)
    out = torch.where((fate == SWAPPED).unsqueeze(-1), others, out)
    return out, fate


def color_classes(rgb: torch.Tensor, bits: int = COLOR_BITS) -> torch.Tensor:
    """(..., 3) colours in [0, 1] -> (...) class indices: each channel quantised to ``bits`` bits, R major."""
    levels = 2 ** bits
    q = (rgb * levels).floor().clamp(0, levels - 1).long()
    return (q[..., 0] * levels + q[..., 1]) * levels + q[..., 2]


def patch_targets(images: torch.Tensor, patch_size: tuple[int, int], target: str,
                  value_range: tuple[float, float] = (-1.0, 1.0)) -> torch.Tensor:
    """The prediction target of every patch of ``images`` (B, 3, H, W) in ``value_range``.

    "color": (B, N) classes of the mean colour; "color4x4": (B, N, 16) classes of the 4x4
    average-pooled patch, row-major; "pixels": (B, N, ph * pw * 3), the patch in [0, 1],
    channel-last, row-major.
    """
    lo, hi = value_range
    x = (images.float() - lo) / (hi - lo)
    B, C, H, W = x.shape
    ph, pw = patch_size
    gh, gw = H // ph, W // pw
    if target == "color":
        mean = F.avg_pool2d(x, (ph, pw))  # (B, C, gh, gw)
        return color_classes(mean.flatten(2).transpose(1, 2))
    if target == "color4x4":
        small = F.avg_pool2d(x, (ph // 4, pw // 4))  # (B, C, 4 gh, 4 gw)
        cells = small.reshape(B, C, gh, 4, gw, 4).permute(0, 2, 4, 3, 5, 1)  # (B, gh, gw, 4, 4, C)
        return color_classes(cells.reshape(B, gh * gw, 16, C))
    if target == "pixels":
        cells = x.reshape(B, C, gh, ph, gw, pw).permute(0, 2, 4, 3, 5, 1)  # (B, gh, gw, ph, pw, C)
        return cells.reshape(B, gh * gw, ph * pw * C)
    raise ConfigError(f"target={target!r}: expected one of {', '.join(TARGETS)}")


def check_mpp(cfg: ViTConfig, target: str, name: str = "target", prefix: str = "") -> None:
    """That masked patch prediction of ``target`` can pre-train the ViT ``cfg`` (ConfigError naming
    ``name``, the target's setting, or the field of ``cfg``, ``prefix`` before its name): a training
    config checks this when it is built, before its data is read."""
    if target not in TARGETS:
        raise ConfigError(f"{name}={target!r}: expected one of {', '.join(TARGETS)}")
    if cfg.resnet is not None:
        raise ConfigError(f"{name}={target!r} needs a plain ViT: a hybrid's patches ({prefix}resnet) are ResNet "
                          "features, not image patches")
    if cfg.patch_dropout > 0:
        raise ConfigError(f"{prefix}patch_dropout={cfg.patch_dropout}: masked patch prediction ({name}={target!r}) "
                          "needs every patch; set it to 0")
    ph, pw = cfg.patch_size
    if target == "color4x4" and (ph % 4 or pw % 4):
        raise ConfigError(f"{name}='color4x4' needs patches divisible by 4, not {prefix}patch_size={ph}x{pw}")
    if target != "pixels" and cfg.in_chans != 3:
        raise ConfigError(f"{name}={target!r}: the colour classes are of RGB patches, and {prefix}in_chans="
                          f"{cfg.in_chans}; 'pixels' takes any channels")


@dataclasses.dataclass
class MppOutput:
    loss: torch.Tensor  # scalar
    predictions: torch.Tensor  # (S, ...) for the S corrupted patches of the batch
    targets: torch.Tensor  # (S, ...) classes, or pixels for "pixels"
    fate: torch.Tensor  # (B, N), see ``corrupt_patches``


class MaskedPatchPrediction(nn.Module):
    """A plain ViT with a [mask] embedding and a per-patch prediction head (module text)."""

    def __init__(self, vit: VisionTransformer, target: str = "color", rate: float = 0.5,
                 value_range: tuple[float, float] = (-1.0, 1.0)) -> None:
        super().__init__()
        cfg = vit.cfg
        check_mpp(cfg, target)
        if not (is_number(rate) and 0.0 < rate <= 1.0):
            raise ConfigError(f"rate={rate!r}: expected a fraction in (0, 1]")
        ph, pw = cfg.patch_size
        self.vit, self.target, self.rate, self.value_range = vit, target, rate, value_range
        self.mask_token = nn.Parameter(torch.zeros(cfg.width))
        nn.init.normal_(self.mask_token, std=0.02)
        outputs = {"color": NUM_COLORS, "color4x4": 16 * NUM_COLORS, "pixels": ph * pw * cfg.in_chans}[target]
        self.head = nn.Linear(cfg.width, outputs)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @property
    def cfg(self):
        """The backbone's ``ViTConfig``."""
        return self.vit.cfg

    def forward(self, images: torch.Tensor, generator: torch.Generator | None = None) -> MppOutput:
        vit = self.vit
        patches, grid = vit.patchify(images)
        corrupted, fate = corrupt_patches(patches, self.mask_token, self.rate, generator)
        tokens = vit.norm(vit.run_blocks(vit.embed_patches(corrupted, grid), grid))
        chosen = fate > 0
        predictions = self.head(tokens[:, vit.cfg.num_prefix_tokens:][chosen])  # (S, outputs)
        targets = patch_targets(images, vit.cfg.patch_size, self.target, self.value_range)[chosen]
        if self.target == "pixels":
            loss = F.mse_loss(predictions.float(), targets)
        else:
            predictions = predictions.reshape(targets.shape + (NUM_COLORS,))  # a Proxy's shape is no sequence to unpack
            loss = F.cross_entropy(predictions.float().reshape(-1, NUM_COLORS), targets.reshape(-1))
        return MppOutput(loss, predictions, targets, fate)
