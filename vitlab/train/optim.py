"""The optimiser: Adam (pre-training, paper Table 3) or SGD with momentum (fine-tuning,
Table 4), with weight decay on the kernels only; or, beyond the paper, Muon for the dense
layers inside the Transformer blocks with AdamW for everything else (``MuonAdamW``).

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

import math

import torch
from torch import nn
from torch.optim.adamw import adamw

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


def block_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The weights of the dense layers inside the Transformer blocks (qkv, proj, fc1, fc2):
    the hidden matrices Muon orthogonalises.  The patch embedding, the head, the pre-logits
    and every vector stay with AdamW, as in Muon's own recipe."""
    return [module.weight for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and "blocks" in name.split(".") and module.weight.requires_grad]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """Adam(W), SGD or Muon+AdamW over parameter groups; the lr is set every step by the loop."""
    decay, no_decay = split_decay(model, cfg.wd_scope)
    if cfg.optimizer == "muon":  # the decayed kernels split: the blocks' matrices to Muon, the rest to AdamW
        matrices = {id(p) for p in block_matrices(model)}
        groups = [{"params": [p for p in decay if id(p) in matrices], "weight_decay": cfg.weight_decay, "muon": True},
                  {"params": [p for p in decay if id(p) not in matrices], "weight_decay": cfg.weight_decay}]
    else:
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    groups = [g for g in groups + [{"params": no_decay, "weight_decay": 0.0}] if g["params"]]
    if cfg.optimizer == "muon":
        adamw_scale = (cfg.muon_adamw_lr or cfg.lr) / cfg.lr
        for g in groups:  # the loop's scheduled lr times lr_scale
            g["lr_scale"] = 1.0 if g.get("muon") else adamw_scale
        device = next(model.parameters()).device
        return MuonAdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), momentum=cfg.muon_momentum,
                         ns_dtype=newton_schulz_dtype(device))
    if cfg.optimizer == "adam":
        # eps 1e-8 is optax.scale_by_adam's default as well as torch's.
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=1e-8)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    raise ValueError(f"optimizer={cfg.optimizer!r}: allowed values are 'adam', 'sgd', 'muon'")


# Newton-Schulz coefficients of Muon's quintic iteration (Jordan et al., 2024): chosen to push
# every singular value into about [0.7, 1.2] in five steps rather than to converge to exactly 1.
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)


def orthogonalise(g: torch.Tensor, steps: int = 5, eps: float = 1e-7,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """About U V^T of each matrix ``g`` = U S V^T (the last two dims; a leading dim batches):
    ``steps`` quintic Newton-Schulz iterations computed in ``dtype``, returned in fp32."""
    a, b, c = NEWTON_SCHULZ
    x = g.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # iterate on the short side: X X^T is the smaller Gram matrix
        x = x.mT
    # the spectral norm is at most the Frobenius norm: start inside the unit ball
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).float()


def orthogonalise_flops(shape: tuple[int, int], steps: int = 5) -> int:
    """Multiply-adds x 2 of ``orthogonalise`` on one matrix of ``shape``: per iteration the Gram
    matrix (2 m^2 n), its square (2 m^3) and the product with X (2 m^2 n), m the short side."""
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m ** 3)


def muon_step_flops(model: nn.Module, steps: int = 5) -> int:
    """The FLOPs one Muon step spends orthogonalising ``model``'s block matrices: the compute
    Muon adds to a training step beyond the forward and backward passes (AdamW's elementwise
    update, like Muon's momentum, is not counted)."""
    return sum(orthogonalise_flops(tuple(p.shape), steps) for p in block_matrices(model))


def newton_schulz_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the device runs bf16 matmuls faster than fp32 (a GPU; a CPU where
    ``vitlab.fast.bf16_is_faster`` holds), else fp32: the iteration tolerates bf16 (Muon's
    reference implementation runs it so), and on the small matrices of a CIFAR-size ViT it is
    a sizeable share of the step."""
    from vitlab.fast import bf16_is_faster

    return torch.bfloat16 if bf16_is_faster(device) else torch.float32


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups marked ``muon=True``, AdamW on the others, in one optimiser, so the
    loop, the gradient scaler and checkpoints see one object with one set of groups.

    Muon (Jordan et al., 2024; Liu et al., 2025): Nesterov momentum on the gradient, then the
    update is its nearest semi-orthogonal matrix (``orthogonalise``), scaled by
    0.2 * sqrt(max(rows, cols)) so that its RMS matches a typical AdamW update's and the AdamW
    learning rate and weight decay carry over (``torch.optim.Muon``'s "match_rms_adamw").
    Matrices of one shape are orthogonalised together, as one batch: a ViT's blocks give a
    few large batched products in place of many small ones.  The AdamW groups are exactly
    ``torch.optim.AdamW``; both decay decoupled, as ``w *= 1 - lr * weight_decay``.  Sharded
    (FSDP) parameters are not supported: the orthogonalisation needs whole matrices.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 momentum: float = 0.95, ns_steps: int = 5, weight_decay: float = 0.0,
                 ns_dtype: torch.dtype = torch.float32):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, momentum=momentum, ns_steps=ns_steps,
                                      weight_decay=weight_decay, muon=False))
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            if group["muon"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("MuonAdamW: a muon=True group holds only 2-D weight matrices")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                (self._muon if group["muon"] else self._adamw)(params, group)
        return loss

    def _muon(self, params, group):
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        by_shape: dict[tuple, list] = {}
        for p in params:
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - mu)
            by_shape.setdefault((tuple(p.shape), p.device), []).append((p, p.grad.lerp(buf, mu)))  # Nesterov
        for (shape, _), pairs in by_shape.items():
            updates = orthogonalise(torch.stack([u for _, u in pairs]), group["ns_steps"], dtype=self.ns_dtype)
            for (p, _), update in zip(pairs, updates):
                p.mul_(1 - lr * wd)
                p.add_(update.to(p.dtype), alpha=-lr * 0.2 * math.sqrt(max(shape)))

    def _adamw(self, params, group):
        """torch's own AdamW update, through its functional form: the same arithmetic as
        ``torch.optim.AdamW``, with this optimiser's state."""
        states = [self.state[p] for p in params]
        for p, state in zip(params, states):
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
        beta1, beta2 = group["betas"]
        adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
              [s["step"] for s in states], amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
