"""The official Flax initialisers, written for PyTorch tensors, and the schemes not in the
paper that start a model trained from scratch elsewhere.

The paper's code initialises dense kernels with Xavier-uniform (attention and MLP),
MLP biases with N(0, 1e-6), convolutions and the pre-logits layer with Flax's default
LeCun-normal (a truncated normal), position embeddings with N(0, 0.02), and the
[class] token and the classification head with zeros.

The schemes of a whole built model (``model.patch_init``, ``model.attn_init`` and
``model.posemb_init`` of a training config): ``whiten_patches_``,
``mimetic_attention_init_`` and ``sincos_posemb_init_``.  Each refuses a model it cannot
apply to with a ``ConfigError`` naming that setting; ``check_schemes`` refuses the same from
the model's config, before the model is built.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..config import Architecture, ConfigError, ViTConfig
from .posemb import LearnedPosEmb1D, posemb_sincos_2d

# std of a standard normal truncated to [-2, 2]; Flax divides by it so that the
# truncated distribution has the requested variance.
_TRUNC_STD = 0.87962566103423978


@torch.no_grad()
def lecun_normal_(weight: torch.Tensor) -> torch.Tensor:
    """Flax's default kernel init: truncated normal with variance 1/fan_in."""
    fan_in = weight[0].numel()  # (out, in, *kernel) in PyTorch layout
    std = math.sqrt(1.0 / fan_in) / _TRUNC_STD
    if weight.is_meta:
        return weight
    # Redrawing the samples outside [-2, 2] gives exactly the truncated normal, and is
    # far faster on CPU than nn.init.trunc_normal_'s inverse-CDF method.
    weight.normal_()
    outside = weight.abs() > 2
    while outside.any():
        weight[outside] = torch.randn(int(outside.sum()), dtype=weight.dtype, device=weight.device)
        outside = weight.abs() > 2
    return weight.mul_(std)


@torch.no_grad()
def xavier_uniform_chunks_(weight: torch.Tensor, chunks: int) -> torch.Tensor:
    """Xavier-uniform on each of ``chunks`` row blocks, as if they were separate layers.

    A fused qkv matrix (3D, D) must be initialised like three (D, D) matrices, as the
    official code has them; Xavier on the fused matrix would see fan_out = 3D.
    """
    for part in weight.chunk(chunks, dim=0):
        nn.init.xavier_uniform_(part)
    return weight


@torch.no_grad()
def whiten_patch_embedding_(patch_embed: nn.Conv2d, images: torch.Tensor, eps: float = 5e-4) -> nn.Conv2d:
    """Initialise a patch embedding from the data: its filters whiten the image patches.

    Each of the C*P*P principal directions of the patches in ``images`` (B, C, H, W, as
    the model sees them) becomes a filter scaled by 1/sqrt(eigenvalue + eps), so the
    first embeddings are decorrelated and of unit variance.  Directions are taken in
    +/- pairs (as airbench whitens its first convolution) so a following nonlinearity or
    LayerNorm sees both signs; filters beyond 2*C*P*P keep their random init.  The
    bias centres the embeddings on the patches' mean.  Not in the paper: it gives a
    model trained from scratch on a small budget a head start.
    """
    out = patch_embed.weight.shape[0]
    ph, pw = patch_embed.kernel_size
    patches = images.float().unfold(2, ph, ph).unfold(3, pw, pw)  # (B, C, gh, gw, ph, pw)
    patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, patch_embed.weight[0].numel())
    mean = patches.mean(0)
    centred = patches - mean
    cov = centred.T @ centred / max(len(centred) - 1, 1)
    eigvals, eigvecs = torch.linalg.eigh(cov.double())
    order = eigvals.argsort(descending=True)
    filters = (eigvecs[:, order] / (eigvals[order].clamp_min(0) + eps).sqrt()).T.float()  # (K, C*P*P)
    filters = torch.cat([filters, -filters])[:out]
    weight = patch_embed.weight.view(out, -1)
    weight[: len(filters)] = filters.to(weight)
    if patch_embed.bias is not None:
        patch_embed.bias.copy_(-(weight @ mean.to(weight)))
    return patch_embed


@torch.no_grad()
def mimetic_attention_(attn: nn.Module, qk: float = 0.7, vo: float = 0.4,
                       generator: torch.Generator | None = None) -> nn.Module:
    """Initialise an attention layer as trained ViTs' attention looks (Trockman & Kolter, 2023).

    In pre-trained ViTs each head's query-key product W_q^T W_k is close to a positive
    multiple of the identity (a token attends to tokens like itself, and through the
    position embeddings to its neighbours) and the value-projection product W_o W_v close
    to a negative one.  Here W_q^T W_k starts as the rank-(D/H) part of qk*(Z + I) per head
    and W_o W_v as vo*(Z - I), Z with N(0, 1/D) entries, split between the two factors by
    an SVD.  Not in the paper: it gives a ViT trained from scratch on little data a start
    closer to a trained one, with no change to the architecture.
    """
    qkv, proj = attn.qkv.weight, attn.proj.weight  # (3D, D) and (D, D)
    width, head_dim = proj.shape[0], attn.head_dim
    eye = torch.eye(width, dtype=torch.float64)

    def noise() -> torch.Tensor:
        return torch.randn(width, width, generator=generator, dtype=torch.float64) / math.sqrt(width)

    q_rows, k_rows, v_rows = qkv.view(3, width, width).unbind(0)
    for h in range(attn.num_heads):
        u, s, vt = torch.linalg.svd(qk * (noise() + eye))
        root = s[:head_dim].sqrt()
        rows = slice(h * head_dim, (h + 1) * head_dim)
        q_rows[rows] = (u[:, :head_dim] * root).T.to(qkv)  # so that W_q^T W_k = U_k S_k V_k^T
        k_rows[rows] = (vt[:head_dim].T * root).T.to(qkv)
    u, s, vt = torch.linalg.svd(vo * (noise() - eye))
    # out = x W_v^T W_o^T: W_v^T = U sqrt(S) and W_o^T = sqrt(S) V^T give W_v^T W_o^T = vo*(Z - I)
    v_rows.copy_((u * s.sqrt()).T.to(qkv))
    proj.copy_((s.sqrt()[:, None] * vt).T.to(proj))
    return attn


WHITEN_NEEDS = ("model.patch_init='whiten': only a plain ViT's patch embedding reads image patches "
                "(a hybrid's reads ResNet features); use 'lecun'")
MIMETIC_NEEDS = "model.attn_init='mimetic': the model has no ViT attention layer; use 'xavier'"
SINCOS_NEEDS = ("model.posemb_init='sincos': needs one learned 1D position embedding at the stem "
                "(model posemb='learned_1d', posemb_place 'stem' or 'every_layer_shared'); use 'normal'")


def check_schemes(cfg: Architecture, patch_init: str = "lecun", attn_init: str = "xavier",
                  posemb_init: str = "normal") -> None:
    """That the initialisations named apply to the model ``cfg`` describes (ConfigError naming the
    setting), as the functions below check the built model: a training config checks this when it
    is built, where the built model was refused only after the run's data was read."""
    vit = isinstance(cfg, ViTConfig)
    if patch_init == "whiten" and not (vit and cfg.resnet is None):
        raise ConfigError(WHITEN_NEEDS)
    if attn_init == "mimetic" and not vit:
        raise ConfigError(MIMETIC_NEEDS)
    if posemb_init == "sincos":
        if not (vit and cfg.posemb == "learned_1d" and cfg.posemb_place != "every_layer"):
            raise ConfigError(SINCOS_NEEDS)
        if cfg.width % 4:
            raise ConfigError(f"model.posemb_init='sincos': the 2D sin-cos table has 4 parts per position, and "
                              f"width={cfg.width} is not divisible by 4; use 'normal'")


def backbone(model: nn.Module) -> nn.Module:
    """The ViT of ``model``: itself, or the one inside the MPP wrapper."""
    return getattr(model, "vit", model)


@torch.no_grad()
def whiten_patches_(model: nn.Module, images: torch.Tensor) -> nn.Module:
    """``model.patch_init="whiten"``: the patch embedding of ``model`` (a plain ViT, or one
    inside the MPP wrapper) whitens the patches of ``images``, float (B, C, H, W) as the model
    reads them (``vitlab.data.transforms.to_float`` of uint8 images); see
    ``whiten_patch_embedding_``."""
    vit = backbone(model)
    if getattr(vit, "stem", None) is not None or not hasattr(vit, "patch_embed"):
        raise ConfigError(WHITEN_NEEDS)
    if not images.is_floating_point():
        raise ValueError(f"images: {images.dtype}, not the float images the model reads; "
                         "convert uint8 images with vitlab.data.transforms.to_float")
    whiten_patch_embedding_(vit.patch_embed, images.to(vit.patch_embed.weight.device))
    return model


@torch.no_grad()
def mimetic_attention_init_(model: nn.Module, generator: torch.Generator | None = None) -> nn.Module:
    """``model.attn_init="mimetic"``: every attention layer of ``model`` starts as trained
    ViTs' attention looks (``mimetic_attention_``), their noise drawn in turn from ``generator``."""
    from .layers import Attention  # layers imports this module's initialisers

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise ConfigError(MIMETIC_NEEDS)
    for attn in layers:
        mimetic_attention_(attn, generator=generator)
    return model


@torch.no_grad()
def sincos_posemb_init_(model: nn.Module) -> nn.Module:
    """``model.posemb_init="sincos"``: the learned 1D position table of ``model`` (a ViT, or
    one inside the MPP wrapper) starts as the 2D sin-cos table; the [class] token's row keeps
    its draw."""
    posemb = getattr(backbone(model), "pos_embed", None)
    if not isinstance(posemb, LearnedPosEmb1D):
        raise ConfigError(SINCOS_NEEDS)
    table = posemb.weight[0, posemb.num_prefix:]
    table.copy_(posemb_sincos_2d(posemb.grid, table.shape[-1])[0].to(table))
    return model
