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


def set_lr_scales(groups: list[dict], cfg: OptimConfig) -> None:
    """Muon's groups: each one's ``lr_scale``, which the loop's scheduled lr is multiplied by
    (the AdamW part's optim.muon_adamw_lr / optim.lr).  Set again after a checkpoint's state is
    loaded: its groups carry the scale of the lr it was saved with, and a run resumed with
    another optim.lr would otherwise run the AdamW part at the old ratio, not at muon_adamw_lr."""
    adamw_scale = (cfg.muon_adamw_lr or cfg.lr) / cfg.lr
    for g in groups:
        g["lr_scale"] = 1.0 if g.get("muon") else adamw_scale


def build_optimizer(model: nn.Module, cfg: OptimConfig, bf16_matmuls: bool = False) -> torch.optim.Optimizer:
    """Adam(W), SGD or Muon+AdamW over parameter groups; the lr is set every step by the loop.

    Every one of them can leave a step out on the device: set ``optimizer.found_inf`` to a
    one-element tensor (1: leave it out) before ``step()``, and no parameter or state moves
    (torch's fused implementations honour it; ``MuonAdamW`` too).  The trainer decides
    there whether a step was finite without reading anything back to the host.
    bf16_matmuls: Muon orthogonalises in bf16 (the run resolved that bf16 matmuls are the
    faster ones on its device).
    """
    decay, no_decay = split_decay(model, cfg.wd_scope)
    if cfg.optimizer == "muon":  # the decayed kernels split: the blocks' matrices to Muon, the rest to AdamW
        matrices = {id(p) for p in block_matrices(model)}
        groups = [{"params": [p for p in decay if id(p) in matrices], "weight_decay": cfg.weight_decay, "muon": True},
                  {"params": [p for p in decay if id(p) not in matrices], "weight_decay": cfg.weight_decay}]
    else:
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    groups = [g for g in groups + [{"params": no_decay, "weight_decay": 0.0}] if g["params"]]
    if cfg.optimizer == "muon":
        set_lr_scales(groups, cfg)
        return MuonAdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), momentum=cfg.muon_momentum,
                         ns_dtype=torch.bfloat16 if bf16_matmuls else torch.float32)
    fused = fusable(model, cfg.optimizer)
    if cfg.optimizer == "adam":
        # eps 1e-8 is optax.scale_by_adam's default as well as torch's.
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=1e-8, fused=fused)
    if cfg.optimizer == "sgd":
        optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, fused=fused)
        if fused and cfg.momentum:
            # torch's first SGD step sets the buffer to the gradient; a zero buffer gives the same
            # first step (no dampening), and a first step left out then keeps a defined buffer
            for group in optimizer.param_groups:
                for p in group["params"]:
                    optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
        return optimizer
    raise ValueError(f"optimizer={cfg.optimizer!r}: allowed values are 'adam', 'sgd', 'muon'")


def fusable(model: nn.Module, optimizer: str) -> bool:
    """Whether torch's fused ``optimizer`` takes ``model``'s parameters: floating point, on a
    CPU or GPU; an FSDP-sharded model's DTensors only with Adam (fused SGD has no sharded form)."""
    params = [p for p in model.parameters() if p.requires_grad]
    plain = all(type(p.data) is torch.Tensor for p in params)
    return (bool(params) and (plain or optimizer == "adam")
            and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params))


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` can leave a step out on the device (``found_inf``): torch's fused
    implementations and ``MuonAdamW``; a foreach or single-tensor one cannot."""
    if isinstance(optimizer, MuonAdamW):
        return True
    return all(group.get("fused") for group in optimizer.param_groups)


def skip_requested(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The ``found_inf`` flag the trainer set on ``optimizer`` for this step, if any."""
    return getattr(optimizer, "found_inf", None)


# Newton-Schulz coefficients of Muon's quintic iteration (Jordan et al., 2024): chosen to push
# every singular value into about [0.7, 1.2] in five steps rather than to converge to exactly 1.
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)


def orthogonalise(g: torch.Tensor, steps: int = 5, eps: float = 1e-7,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """About U V^T of each matrix ``g`` = U S V^T (the last two dims; a leading dim batches):
    ``steps`` quintic Newton-Schulz iterations computed in ``dtype``, returned in fp32."""
    a, b, c = NEWTON_SCHULZ
    x = g.to(dtype)
    one = x.ndim == 2
    if one:
        x = x.unsqueeze(0)
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # iterate on the short side: X X^T is the smaller Gram matrix
        x = x.mT
    # the spectral norm is at most the Frobenius norm: start inside the unit ball
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        # a X + (b G + c G G) X, G = X X^T: the scaling and the sums ride in the products (baddbmm),
        # three kernels an iteration where the written-out form launches eight
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    x = x.mT if tall else x
    return (x[0] if one else x).float()


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


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups marked ``muon=True``, AdamW on the others, in one optimiser, so the
    loop, the gradient scaler and checkpoints see one object with one set of groups.

    Muon (Jordan et al., 2024; Liu et al., 2025): Nesterov momentum on the gradient, then the
    update is its nearest semi-orthogonal matrix (``orthogonalise``), scaled by
    0.2 * sqrt(max(rows, cols)) so that its RMS matches a typical AdamW update's and the AdamW
    learning rate and weight decay carry over (``torch.optim.Muon``'s "match_rms_adamw").
    Matrices of one shape up to a transpose are orthogonalised together, as one batch: a ViT's
    blocks give a few large batched products in place of many small ones.  The AdamW groups are exactly
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
        found_inf = skip_requested(self)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                (self._muon if group["muon"] else self._adamw)(params, group, found_inf)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # torch moves a loaded step count onto its parameter's device only in groups marked fused, which
        # these are not: a checkpoint read to the host left the AdamW part's counts there, and the fused
        # kernel on a GPU reads its count where the parameter is (as ``_adamw`` makes it)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p, {})
                if "step" in state:
                    state["step"] = state["step"].to(p.device)

    def _muon(self, params, group, found_inf: torch.Tensor | None):
        """``muon_update`` with this group's settings and this optimiser's momentum buffers."""
        for p in params:
            if not self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
        muon_update(params, [p.grad for p in params], [self.state[p]["momentum_buffer"] for p in params],
                    lr=group["lr"], weight_decay=group["weight_decay"], momentum=group["momentum"],
                    ns_steps=group["ns_steps"], ns_dtype=self.ns_dtype, skip=found_inf)

    def _adamw(self, params, group, found_inf: torch.Tensor | None):
        """torch's own AdamW update, through its functional form: the same arithmetic as
        ``torch.optim.AdamW``, with this optimiser's state (fused where torch has it, which
        also leaves a step out on ``found_inf``)."""
        states = [self.state[p] for p in params]
        fused = all(p.device.type in ("cpu", "cuda") for p in params)
        for p, state in zip(params, states):
            if not state:
                state["step"] = torch.tensor(0.0, device=p.device if fused else None)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
        beta1, beta2 = group["betas"]
        if found_inf is not None and not fused:
            raise ValueError("MuonAdamW: leaving a step out (found_inf) needs parameters torch's fused AdamW takes")
        adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
              [s["step"] for s in states], amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=False, fused=fused or None,
              found_inf=found_inf)


def muon_update(params: list, grads: list, bufs: list, *, lr: float | torch.Tensor, weight_decay: float,
                momentum: float, ns_steps: int, ns_dtype: torch.dtype, skip: torch.Tensor | None = None) -> None:
    """Muon's step (``MuonAdamW``): momentum, the Nesterov update, its orthogonalisation and the
    step, batched over the matrices of each shape up to a transpose (a block's two MLP layers
    together: ``orthogonalise`` iterates on a tall matrix's transpose anyway, so each matrix gets
    the same arithmetic); ``bufs`` (the momentum) and ``params`` are updated in place.  With
    ``skip`` set (a device flag), nothing moves.  ``lr``: a number, or a device tensor
    (``TracedStep``'s)."""
    by_shape: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        by_shape.setdefault((min(p.shape), max(p.shape), p.device), []).append(i)
    decay = 1 - lr * weight_decay
    skipping: dict[torch.device, tuple] = {}  # per device, once: the flag as a mask, and the decay it leaves
    for (rows, cols, device), which in by_shape.items():
        same, same_bufs = [params[i] for i in which], [bufs[i] for i in which]
        tall = [p.shape[0] > p.shape[1] for p in same]
        wide = lambda ts: [t.mT if t_tall else t for t, t_tall in zip(ts, tall)]  # noqa: E731  (rows, cols) views
        grad = torch.stack(wide([grads[i] for i in which]))  # (n, rows, cols)
        buf = torch.stack(wide(same_bufs))
        decay_here = decay
        if skip is not None:
            if device not in skipping:
                flag = skip.to(device).bool()
                skipping[device] = (flag, torch.where(flag, 1.0, decay))
            skip_here, decay_here = skipping[device]
            grad = grad.masked_fill(skip_here, 0.0)  # a NaN gradient must not reach the arithmetic
        new_buf = buf.lerp(grad, 1 - momentum)
        updates = orthogonalise(grad.lerp(new_buf, momentum), ns_steps, dtype=ns_dtype)  # Nesterov
        if skip is not None:
            new_buf = torch.where(skip_here, buf, new_buf)
            updates = updates.masked_fill(skip_here, 0.0)
        torch._foreach_copy_(same_bufs, wide(new_buf.unbind(0)))
        torch._foreach_mul_(same, decay_here)
        step = -lr * 0.2 * math.sqrt(cols)
        updates = updates.to(same[0].dtype)
        if isinstance(step, torch.Tensor):  # a rate on the device has no number to give as ``alpha``
            torch._foreach_add_(same, wide((updates * step).unbind(0)))
        else:
            torch._foreach_add_(same, wide(updates.unbind(0)), alpha=step)


# ----------------------------------------------------------------------------- the step compiled


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Create now the state each parameter's first step would create, as it would (zeros; AdamW's
    step count a 0 on the parameter's device, as its fused form keeps it): a compiled step
    (``TracedStep``) then finds every tensor it updates in place, and the eager step takes them
    over as its own.  Parameters that already have their state keep it."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if optimizer.state.get(p):
                continue
            if isinstance(optimizer, torch.optim.SGD) or group.get("muon"):
                if group["momentum"]:
                    optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
            else:
                optimizer.state[p].update(step=torch.zeros((), dtype=torch.float32, device=p.device),
                                          exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))


def _write_unless(skip: torch.Tensor, pairs) -> None:
    """Each (tensor, new value): the tensor takes its new value, unless ``skip`` is set."""
    for old, new in pairs:
        old.copy_(torch.where(skip, old, new))


def adamw_update(params: list, grads: list, states: list[dict], *, lr: torch.Tensor, betas: tuple, eps: float,
                 weight_decay: float, skip: torch.Tensor) -> None:
    """torch's AdamW step in plain tensor operations (torch.compile traces them; it does not trace
    the fused kernel the eager step runs), its scalars in float64 as the fused kernels compute
    them; ``states``: each parameter's step count and moments, updated in place with it.  Where
    ``skip`` is set, no parameter, moment or count moves."""
    beta1, beta2 = betas
    for p, grad, state in zip(params, grads, states):
        count = state["step"] + 1
        bias1 = 1 - beta1 ** count.double()
        bias2_sqrt = (1 - beta2 ** count.double()).sqrt()
        exp_avg = state["exp_avg"].lerp(grad, 1 - beta1)
        exp_avg_sq = state["exp_avg_sq"] * beta2 + (1 - beta2) * grad * grad
        new = p * (1 - lr * weight_decay) - (lr / bias1) * exp_avg / (exp_avg_sq.sqrt() / bias2_sqrt + eps)
        _write_unless(skip, ((p, new), (state["exp_avg"], exp_avg), (state["exp_avg_sq"], exp_avg_sq),
                             (state["step"], count)))


def sgd_update(params: list, grads: list, states: list[dict], *, lr: torch.Tensor, momentum: float,
               weight_decay: float, dampening: float, nesterov: bool, skip: torch.Tensor) -> None:
    """torch's SGD step in plain tensor operations (weight decay added to the gradient, then the
    momentum buffer, ``init_state``'s zeros at first); where ``skip`` is set, nothing moves."""
    for p, grad, state in zip(params, grads, states):
        if weight_decay:
            grad = grad + weight_decay * p
        if momentum:
            buf = state["momentum_buffer"] * momentum + (1 - dampening) * grad
            _write_unless(skip, ((state["momentum_buffer"], buf),))
            grad = grad + momentum * buf if nesterov else buf
        _write_unless(skip, ((p, p - lr * grad),))


class TracedStep:
    """``optimizer``'s step (AdamW, SGD or ``MuonAdamW``) as plain tensor operations, for
    ``torch.compile`` to trace into one graph: it traces neither torch's fused kernels nor
    ``Optimizer.step``, which breaks the graph on purpose.  It updates the optimiser's own state
    tensors (``init_state``), so a checkpoint or the eager step takes over where it stops.
    Unlike the eager step it

    - reads each group's learning rate from a device tensor, which ``prepare`` fills from the
      group's ``lr`` before each call: a new rate is a new value, not a new graph;
    - reads the gradients and writes none (``grad_scale``, the clipping's factor, is applied as
      they are read): a CUDA graph writes only tensors of a fixed address, and a step's
      gradients are new tensors;
    - leaves every parameter and state tensor as it was where ``skip`` (a device flag) is set,
      as the fused kernels' ``found_inf`` does.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        for group in optimizer.param_groups:
            if any(group.get(flag) for flag in ("amsgrad", "maximize", "nesterov", "dampening", "differentiable")):
                raise ValueError("TracedStep: amsgrad, maximize, nesterov, dampening and differentiable are not "
                                 "implemented")
        if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.SGD, MuonAdamW)):
            raise TypeError(f"TracedStep: no traced form of {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.rates = [torch.zeros((), dtype=torch.float64, device=group["params"][0].device)
                      for group in optimizer.param_groups]
        self.state = None  # the optimiser's state dict the groups below hold the tensors of
        self.groups: list[tuple] = []
        self.prepare()

    def prepare(self) -> None:
        """Before each call, eagerly: the groups' learning rates into the tensors the graph reads,
        and the state tensors taken again where ``load_state_dict`` replaced them."""
        if self.optimizer.state is not self.state:
            init_state(self.optimizer)
            self.state = self.optimizer.state
            self.groups = [self._group(group) for group in self.optimizer.param_groups]
            for rate, (_, params, states, _) in zip(self.rates, self.groups):
                for t in [rate, *params, *(v for s in states for v in s.values())]:
                    torch._dynamo.mark_static_address(t)  # updated in place: one address for the CUDA graph
        for rate, group in zip(self.rates, self.optimizer.param_groups):
            rate.fill_(group["lr"])

    def _group(self, group: dict) -> tuple:
        """(update, params, their states, the group's settings but the lr): what a call reads."""
        states = [self.optimizer.state.get(p, {}) for p in group["params"]]  # {}: SGD without momentum
        if group.get("muon"):
            settings = {k: group[k] for k in ("weight_decay", "momentum", "ns_steps")}
            return muon_update, group["params"], states, settings | {"ns_dtype": self.optimizer.ns_dtype}
        if isinstance(self.optimizer, torch.optim.SGD):
            return sgd_update, group["params"], states, {k: group[k] for k in ("momentum", "weight_decay",
                                                                                 "dampening", "nesterov")}
        return adamw_update, group["params"], states, {k: group[k] for k in ("betas", "eps", "weight_decay")}

    def __call__(self, skip: torch.Tensor, grad_scale: torch.Tensor | None = None) -> None:
        for rate, (update, params, states, settings) in zip(self.rates, self.groups):
            live = [i for i, p in enumerate(params) if p.grad is not None]
            grads = [params[i].grad if grad_scale is None else params[i].grad * grad_scale for i in live]
            if update is muon_update:
                bufs = [states[i]["momentum_buffer"] for i in live]
                update([params[i] for i in live], grads, bufs, lr=rate, skip=skip, **settings)
            else:
                update([params[i] for i in live], grads, [states[i] for i in live], lr=rate, skip=skip, **settings)
