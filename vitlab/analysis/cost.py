"""What a model costs: forward FLOPs from the config, whole training runs, and the
activation memory a backward pass keeps (``SavedForBackward``).

Convention: one multiply-add is 2 FLOPs, as in ``torch.utils.flop_counter`` and in the
paper's "exaFLOPs" (Table 6).  timm and many papers print *MACs* (multiply-adds) and
call them FLOPs; ViT-B/16 at 224 px is 17.6 GMACs = 35.1 GFLOPs here.

What is counted: every matrix multiplication and convolution (dense layers, the patch
embedding, ResNet convolutions, the two attention products Q K^T and A V, the relative
position einsum), exactly as ``FlopCounterMode`` counts them, so the two agree to the
FLOP (``tests/perf/test_cost.py``).  What is not: element-wise work (biases, residual
adds, softmax, LayerNorm/GroupNorm, GELU, weight standardisation, pooling,
interpolation of position embeddings).  For ViT-B/16 these add under 1%.

Training cost (paper Table 6 "exaFLOPs"): forward + backward is taken as 3x the
forward, times the images seen.  This reproduces the paper's figures: ViT-B/16 for 7
epochs of JFT-300M (303M images) at 224 px is 3 * 35.1e9 * 7 * 303e6 = 224 exaFLOPs,
as printed in Table 6.  Its BiT ResNets' figures are 3-4% below this count (R50x1: 50 against
52.0), which takes in the multiply-adds on the convolutions' zero padding, and the paper's not
(docs/models.md).
"""
from __future__ import annotations

from typing import Any, Iterator, NamedTuple

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from ..config import Architecture, Pair, ResNetConfig, ViTConfig, need_architecture, to_pair

__all__ = [
    "model_flops", "resnet_layers", "ResNetLayer", "flops_breakdown", "training_flops", "core_days", "count_flops",
    "SavedForBackward", "TPU_V3_CORE_BF16_FLOPS", "JFT_IMAGES",
]

# One TPUv3 core: 123 TFLOP/s per chip in bf16, two cores per chip.  The paper's
# compute figures (Table 2, "TPUv3-core-days") are in this unit.
TPU_V3_CORE_BF16_FLOPS = 61.5e12
# JFT-300M: "18k classes and 303M high-resolution images" (paper Sec. 4.1).
JFT_IMAGES = 303_000_000


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class ResNetLayer(NamedTuple):
    """One convolution (or the root's max-pool) of a ResNet, with the size of its output."""

    part: str    # "root", "stage1", ...
    kind: str    # "conv" or "pool"
    out_h: int
    out_w: int
    cin: int
    cout: int
    kernel: int


def resnet_layers(cfg: ResNetConfig, h: int, w: int) -> Iterator[ResNetLayer]:
    """The convolutions of the ResNet ``cfg`` on an (h, w) input, in order (the root's
    max-pool too), as FLOP counting and memory estimates walk them.

    Every convolution in vitlab's ResNets keeps ceil(size / stride) positions (SAME
    padding, or PyTorch's k//2 padding, which gives the same size for odd k).
    """
    root = cfg.root_width  # int(64 * width_factor), as the models build it
    h, w = _ceil_div(h, cfg.root_stride), _ceil_div(w, cfg.root_stride)
    yield ResNetLayer("root", "conv", h, w, cfg.in_chans, root, cfg.root_kernel)
    if cfg.root_pool:
        h, w = _ceil_div(h, 2), _ceil_div(w, 2)  # 3x3/2 max-pool
        yield ResNetLayer("root", "pool", h, w, root, root, 3)
    cin = root
    for i, units in enumerate(cfg.layers):
        mid, part = root * 2**i, f"stage{i + 1}"
        for u in range(units):
            stride = 2 if i > 0 and u == 0 else 1
            oh, ow = _ceil_div(h, stride), _ceil_div(w, stride)
            yield ResNetLayer(part, "conv", h, w, cin, mid, 1)
            yield ResNetLayer(part, "conv", oh, ow, mid, mid, 3)
            yield ResNetLayer(part, "conv", oh, ow, mid, 4 * mid, 1)
            if stride != 1 or cin != 4 * mid:  # projection shortcut
                yield ResNetLayer(part, "conv", oh, ow, cin, 4 * mid, 1)
            h, w, cin = oh, ow, 4 * mid


def _resnet_flops(cfg: ResNetConfig, h: int, w: int, head: bool) -> dict[str, int]:
    """Root conv, each stage, and (for BiT) the 1x1-conv head on pooled features."""
    out: dict[str, int] = {}
    for layer in resnet_layers(cfg, h, w):
        if layer.kind == "conv":
            flops = 2 * layer.out_h * layer.out_w * layer.cin * layer.cout * layer.kernel**2
            out[layer.part] = out.get(layer.part, 0) + flops
    if head and cfg.num_classes:
        out["head"] = 2 * cfg.out_channels * cfg.num_classes
    return out


def _block_flops(n_seq: int, seq_len: int, cfg: ViTConfig, relative: bool) -> dict[str, int]:
    """One pre-LN block applied to ``n_seq`` sequences of ``seq_len`` tokens."""
    L, D, M = seq_len, cfg.width, cfg.mlp_dim
    out = {
        "qkv": 2 * L * D * 3 * D,
        "attention": 2 * 2 * L * L * D,  # Q K^T and A V, all heads together
        "proj": 2 * L * D * D,
        "mlp": 2 * 2 * L * D * M,
    }
    if relative:  # einsum("bhqd,rhd->bhqr"): every query against 2L-1 offset embeddings
        out["relative_posemb"] = 2 * L * (2 * L - 1) * D
    return {k: n_seq * v for k, v in out.items()}


def _add(total: dict[str, int], part: dict[str, int], times: int = 1) -> None:
    for k, v in part.items():
        total[k] = total.get(k, 0) + times * v


def flops_breakdown(cfg: Architecture, img_size: int | Pair | None = None, training: bool = False) -> dict[str, int]:
    """Forward FLOPs of one image by component (multiply-add = 2), at ``img_size`` or cfg's;
    ``training``: in a training step, whose encoder sees only the patches ``patch_dropout`` keeps.

    Keys: BiT: root, stage1.., head.  ViT: [stem_root, stem_stage1..], patch_embed, qkv,
    attention, proj, mlp, [relative_posemb], [pre_logits], [head].
    """
    need_architecture(cfg)
    h, w = to_pair(img_size, "img_size") if img_size is not None else cfg.img_size
    if isinstance(cfg, ResNetConfig):
        return _resnet_flops(cfg, h, w, head=True)
    out: dict[str, int] = {}
    cin = cfg.in_chans
    if cfg.resnet is not None:
        out.update({f"stem_{k}": v for k, v in _resnet_flops(cfg.resnet, h, w, head=False).items()})
        (h, w), cin = cfg.feature_size_of((h, w)), cfg.resnet.out_channels
    (ph, pw), D = cfg.patch_size, cfg.width
    gh, gw = h // ph, w // pw
    if gh == 0 or gw == 0:
        raise ValueError(f"img_size={img_size}: smaller than one patch of {cfg.patch_size}")
    out["patch_embed"] = 2 * gh * gw * cin * ph * pw * D
    relative = cfg.posemb == "relative"
    if cfg.axial:  # each layer: a block over the gh rows, then one over the gw columns
        _add(out, _block_flops(gh, gw, cfg, relative), cfg.depth)
        _add(out, _block_flops(gw, gh, cfg, relative), cfg.depth)
    else:
        patches = cfg.kept_patches(gh * gw) if training else gh * gw
        _add(out, _block_flops(1, cfg.num_prefix_tokens + patches, cfg, relative), cfg.depth)
    features = D
    if cfg.representation_size:
        out["pre_logits"] = 2 * D * cfg.representation_size
        features = cfg.representation_size
    if cfg.num_classes:
        out["head"] = 2 * features * cfg.num_classes
    return out


def model_flops(cfg: Architecture, img_size: int | Pair | None = None, training: bool = False) -> int:
    """Forward FLOPs of one image (multiply-add = 2): matmuls and convolutions only.

    ``img_size`` defaults to the config's; any size works (the patch grid is floor(H/P)).
    ``training``: the forward of a training step (fewer tokens with ``patch_dropout``).
    """
    return sum(flops_breakdown(cfg, img_size, training).values())


def training_flops(cfg: Architecture, steps: int, batch: int, img_size: int | Pair | None = None) -> float:
    """Compute of a training run in exaFLOPs (1e18): 3 x forward x steps x batch.

    The backward pass costs about twice the forward (a gradient for the activations and
    one for the weights), hence the paper's factor 3 (Table 6).  The forward is a training
    step's: with ``patch_dropout``, of the patches it keeps.
    """
    if steps < 0 or batch < 0:
        raise ValueError(f"steps={steps}, batch={batch}: must be >= 0")
    return 3 * model_flops(cfg, img_size, training=True) * steps * batch / 1e18


def core_days(exaflops: float, flops_per_core: float = TPU_V3_CORE_BF16_FLOPS,
              utilization: float = 0.3) -> float:
    """Accelerator core-days for ``exaflops`` at a fraction ``utilization`` of the peak.

    The paper reports TPUv3-core-days (Table 2); dividing its Table 6 exaFLOPs by them
    gives the utilisation it achieved: ViT-H/14 (14 epochs, 4262 exaFLOPs, 2.5k
    core-days) ran at 4262e18 / (2500 * 86400 * 61.5e12) = 32% of the bf16 peak.
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization={utilization}: must be in (0, 1]")
    return exaflops * 1e18 / (flops_per_core * utilization) / 86400


def _sdpa_cpu_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _sdpa_cpu_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def count_flops(model: nn.Module, *inputs: Any, backward: bool = False) -> int:
    """FLOPs that ``torch.utils.flop_counter.FlopCounterMode`` measures for ``model(*inputs)``.

    ``FlopCounterMode`` has no formula for the CPU kernel of
    ``scaled_dot_product_attention`` (``_scaled_dot_product_flash_attention_for_cpu``)
    and silently counts it as 0; the formulas it uses for the GPU kernels are added
    for it here.  With ``backward`` the sum of the output is back-propagated too (with
    gradients on, under a caller's ``torch.no_grad`` as well); the gradients of the
    parameters and of the inputs are given back as they were (none, or the caller's), and so
    are the model's buffers (BatchNorm's running statistics) and the random streams.  It counts
    under a caller's ``torch.inference_mode`` too (the counter's module hooks met its tensors
    without an autograd history in an AttributeError), inputs made there read as copies.
    """
    aten = torch.ops.aten
    mapping = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_cpu_flops
        mapping[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _sdpa_cpu_backward_flops
    # set aside, not only put back after: the backward would add into an existing gradient in place
    leaves = [*model.parameters(), *(t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad)]
    if backward and not any(t.requires_grad for t in leaves):  # torch's own error came after the forward
        raise ValueError("backward=True: nothing requires a gradient (every parameter of the model is frozen and no "
                         "input requires grad), so there is no backward to count")
    caller_grads = [(t, t.grad) for t in leaves]
    # a forward in training mode takes the batch into BatchNorm's running statistics and draws
    # dropout from the caller's random streams: the statistics are put back, the streams forked
    buffers = [(b, b.clone()) for b in model.buffers()]
    cuda = sorted({t.device.index or 0 for t in (*model.parameters(), *inputs)
                   if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    grad_mode = backward or torch.is_grad_enabled()  # read before inference mode is left, which turns it on
    try:
        for p, _ in caller_grads:
            p.grad = None
        # a backward needs gradients on, under a caller's no_grad too; the modes are restored after
        with torch.inference_mode(False), torch.random.fork_rng(devices=cuda), torch.set_grad_enabled(grad_mode), \
                FlopCounterMode(display=False, custom_mapping=mapping) as counter:
            # a tensor made in inference mode cannot be saved for a backward: a normal copy is
            out = model(*(t.clone() if isinstance(t, torch.Tensor) and t.is_inference() else t for t in inputs))
            if backward:
                out.float().sum().backward()
    finally:
        for p, grad in caller_grads:
            p.grad = grad
        with torch.no_grad():
            for b, kept in buffers:
                b.copy_(kept)
    return counter.get_total_flops()


class SavedForBackward:
    """Bytes of the tensors autograd keeps for the backward of what runs inside the block.

    Each storage counts once (views of one tensor share it) and the model's parameters are
    left out, so the figure is the activation memory the backward will read::

        with SavedForBackward(model) as kept:
            loss = model(images).logsumexp(-1).sum()
        kept.bytes
    """

    def __init__(self, model: nn.Module) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._params:
            self._storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self) -> "SavedForBackward":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
