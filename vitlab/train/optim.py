"""The optimiser: Adam (pre-training, paper Table 3) or SGD with momentum (fine-tuning,
Table 4), with weight decay on the kernels only.

What the official code does (google-research/big_vision, big_vision/optax.py ``make``):
the update is ``optax.chain(clip_by_global_norm, scale_by_adam, scale(lr),
add_decayed_weights(wd, mask=".*/kernel$"), scale_by_schedule(sched), scale(-1))``, i.e.

    w <- w - sched_t * (lr * adam_t + wd_bv * w)          for kernels
    w <- w - sched_t * lr * adam_t                        for everything else

Weight decay is decoupled (Loshchilov & Hutter) and multiplied by the schedule but *not*
by the base lr, and it touches only ``kernel`` parameters: the weights of dense and
convolution layers (head and pre-logits included); biases, LayerNorm scales and
offsets, position embeddings and the [class] token never decay.  big_vision's ViT
configs write the paper's "weight decay 0.1 at lr 1e-3" as ``wd = 0.0001``
(configs/vit_i1k.py: lr 0.001, wd 0.0001), so the paper's numbers are in units of the
lr: wd_bv = wd_paper * base_lr.  That is exactly PyTorch's AdamW, which multiplies
decayed weights by ``1 - lr_t * weight_decay`` with lr_t = base_lr * sched_t, so
``OptimConfig.weight_decay`` takes the paper's numbers directly.

SGD (fine-tuning) uses no weight decay in the paper; if asked for, torch's SGD adds it
to the gradient (L2, coupled), which with momentum is not the decoupled form above.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import OptimConfig

KERNEL_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d)


def split_decay(model: nn.Module, scope: str = "kernels") -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(decay, no_decay) trainable parameters.

    scope "kernels": the ``weight`` of every Linear/Conv module decays (the official
    ``.*/kernel$`` mask); "all": every parameter decays.
    """
    kernels: set[int] = set()
    for module in model.modules():
        if isinstance(module, KERNEL_MODULES) and getattr(module, "weight", None) is not None:
            kernels.add(id(module.weight))
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if scope == "all" or id(p) in kernels else no_decay).append(p)
    return decay, no_decay


def no_decay_names(model: nn.Module, scope: str = "kernels") -> list[str]:
    """Names of the parameters that do not decay (for logs and tests)."""
    _, no_decay = split_decay(model, scope)
    keep = {id(p) for p in no_decay}
    return [n for n, p in model.named_parameters() if id(p) in keep]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """Adam(W) or SGD over two parameter groups; the lr is set every step by the loop."""
    decay, no_decay = split_decay(model, cfg.wd_scope)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if cfg.optimizer == "adam":
        # eps 1e-8 is optax.scale_by_adam's default as well as torch's.
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=1e-8)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    raise ValueError(f"optimizer={cfg.optimizer!r}: allowed values are 'adam', 'sgd'")
