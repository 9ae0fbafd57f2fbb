"""ResNets with GroupNorm and weight-standardised convolutions.

Two models share the building blocks below:

* ``ResNetFeatures``: the stem of the paper's hybrids (Sec. 3.1, 4.1), built as vit_jax
  builds it (``models_vit.py`` root + ``models_resnet.py``): ResNet v1 post-activation
  bottlenecks, stride on the 3x3 conv, GroupNorm(32), SAME padding.
* ``BiTResNet``: the BiT baselines (Kolesnikov et al. 2020), a ResNet v2 (pre-activation)
  classifier laid out like big_transfer's ``bit_pytorch/models.py``.

Official vit_jax checkpoint keys of the hybrid stem map mechanically onto
``ResNetFeatures.state_dict()`` keys (S, U count from 1 in the npz, from 0 here)::

    conv_root/kernel               <->  conv_root.weight
    gn_root/{scale,bias}           <->  gn_root.{weight,bias}
    blockS/unitU/<conv>/kernel     <->  stages.{S-1}.units.{U-1}.<conv>.weight
    blockS/unitU/<gn>/{scale,bias} <->  stages.{S-1}.units.{U-1}.<gn>.{weight,bias}

with <conv> in conv1, conv2, conv3, conv_proj and <gn> in gn1, gn2, gn3, gn_proj.  Flax
kernels are HWIO: ``weight = torch.from_numpy(kernel).permute(3, 2, 0, 1)``.
"""
from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ResNetConfig
from .init import lecun_normal_
from .inputs import check_images

__all__ = ["Conv2dSame", "StdConv2d", "conv2d_same", "max_pool_same", "ResNetFeatures", "BiTResNet", "same_padding",
           "pad_same"]


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """(before, after) padding of TensorFlow's SAME rule along one axis.

    The output has ceil(size / stride) positions; any odd total goes after, so even inputs
    with stride 2 are padded asymmetrically, unlike PyTorch's symmetric ``padding=k//2``.
    """
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def pad_same(x: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int], value: float = 0.0) -> torch.Tensor:
    """Pad (B, C, H, W) so that a VALID conv/pool afterwards equals a SAME one."""
    top, bottom = same_padding(x.shape[-2], kernel[0], stride[0])
    left, right = same_padding(x.shape[-1], kernel[1], stride[1])
    if top == bottom == left == right == 0:
        return x
    return F.pad(x, (left, right, top, bottom), value=value)


# @torch.fx.wrap: torch.fx.symbolic_trace records a call of this function as one node of its graph; traced
# through, its padding's branches on the input's size stopped it (a Proxy's size is a symbol, not a number)
@torch.fx.wrap
def max_pool_same(x: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    """flax's ``nn.max_pool(padding="SAME")``: padding is -inf, so it never wins the max.

    Without building the padded tensor: the symmetric part of the SAME padding is
    PyTorch's own (implicit -inf) ``padding``, and a one-pixel excess at the end is
    ``ceil_mode``'s clipped last window.  Runs channels-last, which oneDNN's CPU pooling is faster in, and
    returns the input's layout (NCHW, or channels-last for a channels-last input).
    """
    (top, bottom), (left, right) = (same_padding(n, kernel, stride) for n in x.shape[-2:])
    if bottom - top > 1 or right - left > 1 or max(top, left) > kernel // 2:  # not for the usual 3x3/2
        return F.max_pool2d(pad_same(x, (kernel, kernel), (stride, stride), value=-math.inf), kernel, stride)
    nchw = x.is_contiguous()
    # bool(): under torch.jit.trace the sizes, and so this comparison, are tensors, which max_pool2d refuses
    out = F.max_pool2d(x.contiguous(memory_format=torch.channels_last), kernel, stride, padding=(top, left),
                       ceil_mode=bool(bottom > top or right > left))
    return out.contiguous() if nchw else out


@torch.fx.wrap  # as max_pool_same: its padding branches on the input's size
def conv2d_same(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                stride: tuple[int, int]) -> torch.Tensor:
    """``F.conv2d`` with TensorFlow SAME padding, by the cheapest route that gives the same sums.

    A 1x1 kernel never pads and, strided, reads every stride-th pixel only: slicing first
    is faster on CPU (oneDNN's strided 1x1 path is slow, forward and backward).
    Symmetric padding goes to the convolution itself (no padded copy); only the
    asymmetric stride-2 case pads explicitly.
    """
    kh, kw = weight.shape[-2:]
    if kh == kw == 1:
        if stride != (1, 1):
            x = x[:, :, :: stride[0], :: stride[1]]
        return F.conv2d(x, weight, bias)
    top, bottom = same_padding(x.shape[-2], kh, stride[0])
    left, right = same_padding(x.shape[-1], kw, stride[1])
    if top == bottom and left == right:
        return F.conv2d(x, weight, bias, stride, (top, left))
    return F.conv2d(F.pad(x, (left, right, top, bottom)), weight, bias, stride)


class Conv2dSame(nn.Conv2d):
    """Conv2d with a padding mode: "same" pads by TensorFlow's rule, computed from the
    input size at call time; "symmetric" is PyTorch's fixed ``kernel_size // 2``.

    LeCun-normal kernel init, as Flax's conv.  Subclasses change the kernel convolved
    through ``kernel()``.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, *,
                 padding: str = "same", bias: bool = False) -> None:
        if padding not in ("same", "symmetric"):
            raise ValueError(f"padding={padding!r}: allowed values are 'same', 'symmetric'")
        fixed = 0 if padding == "same" else kernel_size // 2
        super().__init__(in_channels, out_channels, kernel_size, stride, padding=fixed, bias=bias)
        self.same = padding == "same"
        lecun_normal_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def kernel(self) -> torch.Tensor:
        """The kernel actually convolved, (out, in, kh, kw)."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in, H, W) -> (B, out, ceil(H/stride), ceil(W/stride)) for odd kernels."""
        if self.same:
            return conv2d_same(x, self.kernel(), self.bias, self.stride)
        return F.conv2d(x, self.kernel(), self.bias, self.stride, self.padding)


class StdConv2d(Conv2dSame):
    """Conv2d whose kernel is standardised per output channel on every call.

    Two published forms, both population statistics over (in, kh, kw):
    vit_jax (models_resnet.weight_standardize): ``(w - mean) / (std + eps)``, eps 1e-5;
    BiT (bit_pytorch StdConv2d): ``(w - mean) / sqrt(var + eps)``, eps 1e-10.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        *,
        padding: str = "same",
        eps: float = 1e-5,
        eps_inside_sqrt: bool = False,
        bias: bool = False,
    ) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding=padding, bias=bias)
        self.eps = eps
        self.eps_inside_sqrt = eps_inside_sqrt

    def standardized_weight(self) -> torch.Tensor:
        """The kernel actually convolved: (out, in, kh, kw), zero mean per output channel."""
        dims = (1, 2, 3)
        if self.eps_inside_sqrt:
            var, mean = torch.var_mean(self.weight, dim=dims, keepdim=True, correction=0)
            return (self.weight - mean) / torch.sqrt(var + self.eps)
        std, mean = torch.std_mean(self.weight, dim=dims, keepdim=True, correction=0)
        return (self.weight - mean) / (std + self.eps)

    kernel = standardized_weight


def _conv(cfg: ResNetConfig, cin: int, cout: int, kernel: int, stride: int = 1) -> Conv2dSame:
    if cfg.norm == "batch":  # batch statistics already remove the kernel's scale and mean
        return Conv2dSame(cin, cout, kernel, stride, padding=cfg.padding)
    return StdConv2d(
        cin, cout, kernel, stride, padding=cfg.padding, eps=cfg.ws_eps, eps_inside_sqrt=cfg.ws_eps_inside_sqrt
    )


def _gn(cfg: ResNetConfig, channels: int) -> nn.GroupNorm | nn.BatchNorm2d:
    """The normalisation layer; named ``gn*`` after the official keys even when it is a BatchNorm."""
    if cfg.norm == "batch":
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(32, channels, eps=cfg.gn_eps)


def _unit_plan(cfg: ResNetConfig) -> list[list[tuple[int, int, int]]]:
    """(in_channels, bottleneck width, stride) of every unit, stage by stage.

    Stage i is 64 * width_factor * 2**i wide and outputs 4x that; only the first unit of
    stages after the first has stride 2 (the root already reduced by 4).
    """
    root = cfg.root_width  # int(64 * width_factor), as vit_jax
    plan, cin = [], root
    for i, units in enumerate(cfg.layers):
        mid = root * 2**i
        stage = [(cin, mid, 2 if i > 0 else 1)] + [(4 * mid, mid, 1)] * (units - 1)
        plan.append(stage)
        cin = 4 * mid
    return plan


class BottleneckV1(nn.Module):
    """Post-activation bottleneck (vit_jax ``ResidualUnit``).

    (B, cin, H, W) -> (B, 4*mid, ceil(H/stride), ceil(W/stride)).
    """

    def __init__(self, cfg: ResNetConfig, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        cout = 4 * mid
        self.conv1, self.gn1 = _conv(cfg, cin, mid, 1), _gn(cfg, mid)
        self.conv2, self.gn2 = _conv(cfg, mid, mid, 3, stride), _gn(cfg, mid)
        self.conv3, self.gn3 = _conv(cfg, mid, cout, 1), _gn(cfg, cout)
        nn.init.zeros_(self.gn3.weight)  # vit_jax: each unit starts as its shortcut
        self.conv_proj = self.gn_proj = None
        if stride != 1 or cin != cout:
            self.conv_proj, self.gn_proj = _conv(cfg, cin, cout, 1, stride), _gn(cfg, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.conv_proj is None else self.gn_proj(self.conv_proj(x))
        y = F.relu(self.gn1(self.conv1(x)))
        y = F.relu(self.gn2(self.conv2(y)))
        y = self.gn3(self.conv3(y))
        return F.relu(shortcut + y)


class ResNetStage(nn.Module):
    """A run of bottleneck units; ``units`` mirrors vit_jax's ``unit1..unitN``."""

    def __init__(self, cfg: ResNetConfig, plan: list[tuple[int, int, int]]) -> None:
        super().__init__()
        self.units = nn.ModuleList(BottleneckV1(cfg, *unit) for unit in plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.units:
            x = unit(x)
        return x


class ResNetFeatures(nn.Module):
    """The hybrid's ResNet stem: (B, in_chans, H, W) -> (B, out_channels, ceil(H/r), ceil(W/r)).

    Root: 7x7/2 StdConv, GroupNorm, ReLU, 3x3/2 max-pool (kernel, stride and pool set by
    ``cfg.root_*``); then one ``ResNetStage`` per entry of ``cfg.layers``.
    ``r = reduction``.  ``cfg.num_classes`` is ignored.
    """

    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.out_channels = cfg.out_channels
        self.reduction = cfg.reduction
        width = cfg.root_width
        self.conv_root = _conv(cfg, cfg.in_chans, width, cfg.root_kernel, cfg.root_stride)
        self.gn_root = _gn(cfg, width)
        self.stages = nn.ModuleList(ResNetStage(cfg, plan) for plan in _unit_plan(cfg))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gn_root(self.conv_root(x))
        # ReLU commutes with a max-pool padded with -inf (values and gradients), so pooling
        # first runs the ReLU on a quarter of the map
        if self.cfg.root_pool and self.cfg.padding == "same":
            x = max_pool_same(x, 3, 2)
        elif self.cfg.root_pool:
            x = F.max_pool2d(x, 3, 2, padding=1)
        x = F.relu(x)
        for stage in self.stages:
            x = stage(x)
        return x


class BottleneckV2(nn.Module):
    """Pre-activation bottleneck (BiT ``PreActBottleneck``), stride on the 3x3 conv.

    The projection shortcut reads the pre-activated input, as in ResNet v2.
    (B, cin, H, W) -> (B, 4*mid, ceil(H/stride), ceil(W/stride)).
    """

    def __init__(self, cfg: ResNetConfig, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        cout = 4 * mid
        self.gn1, self.conv1 = _gn(cfg, cin), _conv(cfg, cin, mid, 1)
        self.gn2, self.conv2 = _gn(cfg, mid), _conv(cfg, mid, mid, 3, stride)
        self.gn3, self.conv3 = _gn(cfg, mid), _conv(cfg, mid, cout, 1)
        self.downsample = _conv(cfg, cin, cout, 1, stride) if stride != 1 or cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.gn1(x))
        shortcut = x if self.downsample is None else self.downsample(y)
        y = self.conv1(y)
        y = self.conv2(F.relu(self.gn2(y)))
        y = self.conv3(F.relu(self.gn3(y)))
        return y + shortcut


class BiTResNet(nn.Module):
    """BiT ResNet v2 classifier: (B, in_chans, H, W) -> logits (B, num_classes).

    Parameter names follow big_transfer (``root.conv``, ``body.blockS.unitUU.*``,
    ``before_head.gn``, ``head.conv``).  The root pool is BiT's: zero-pad 1, then a VALID
    3x3/2 max-pool (its input is not yet activated, so this differs from -inf padding);
    ``cfg.padding`` governs the convolutions only, and BiT's own code is "symmetric".
    With ``num_classes == 0`` the head is the identity and ``forward`` returns the pooled
    features (B, num_features).
    """

    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_features = cfg.out_channels
        self.num_classes = cfg.num_classes
        root = OrderedDict(conv=_conv(cfg, cfg.in_chans, cfg.root_width, cfg.root_kernel, cfg.root_stride))
        if cfg.root_pool:
            root.update(pad=nn.ConstantPad2d(1, 0.0), pool=nn.MaxPool2d(3, 2))
        self.root = nn.Sequential(root)
        blocks = OrderedDict()
        for s, plan in enumerate(_unit_plan(cfg), start=1):
            units = OrderedDict((f"unit{u:02d}", BottleneckV2(cfg, *unit)) for u, unit in enumerate(plan, start=1))
            blocks[f"block{s}"] = nn.Sequential(units)
        self.body = nn.Sequential(blocks)
        self.before_head = nn.Sequential(OrderedDict(gn=_gn(cfg, self.num_features), relu=nn.ReLU()))
        self.head = self._new_head(cfg.num_classes)

    def _new_head(self, num_classes: int) -> nn.Module:
        if num_classes == 0:
            return nn.Identity()
        conv = nn.Conv2d(self.num_features, num_classes, kernel_size=1)
        nn.init.zeros_(conv.weight)  # BiT fine-tunes from a zero head
        nn.init.zeros_(conv.bias)
        return nn.Sequential(OrderedDict(conv=conv))

    def reset_classifier(self, num_classes: int) -> None:
        """Replace the head with a zero-initialised one for ``num_classes`` (0: no head)."""
        cfg = dataclasses.replace(self.cfg, num_classes=num_classes)  # checked before the model changes
        self.head = self._new_head(num_classes).to(self.before_head.gn.weight)  # same device and dtype
        # the config too: save_model writes it, and the saved weights must match the head it describes
        self.cfg, self.num_classes = cfg, num_classes

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, num_features, h, w), after the final GroupNorm + ReLU."""
        check_images(x, self.cfg.in_chans, self.root.conv.weight.dtype)
        return self.before_head(self.body(self.root(x)))

    def forward_head(self, feats: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """(B, C, h, w) -> logits (B, num_classes), or pooled features (B, C) if pre_logits."""
        pooled = feats.mean(dim=(2, 3), keepdim=True)
        if pre_logits:
            return pooled.flatten(1)
        return self.head(pooled).flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))
