"""What every model's forward checks of its input: the ViT (and hybrid) and the BiT ResNets
share it, so that each names images it cannot read in the same words."""
from __future__ import annotations

import torch

__all__ = ["check_images"]


def check_images(x: torch.Tensor, in_chans: int, weights: torch.dtype) -> None:
    """That ``x`` is a batch of images a model of ``in_chans`` channels and ``weights`` dtype reads
    (ValueError): torch's own messages speak of a convolution's bias or scalar type.  Under
    ``torch.fx.symbolic_trace`` there is nothing to check: its Proxy's shape is a symbol Python cannot compare."""
    if isinstance(x, torch.fx.Proxy):
        return
    if not isinstance(x, torch.Tensor):  # a list or an array failed on its missing .ndim
        raise TypeError(f"expected images as a torch.Tensor (B, {in_chans}, H, W), got a {type(x).__name__}")
    if x.ndim != 4 or x.shape[1] != in_chans:
        raise ValueError(f"expected images of shape (B, {in_chans}, H, W), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"expected floating-point images (pixels scaled to [-1, 1], as "
                         f"vitlab.data.transforms.to_float scales uint8 ones), got {x.dtype}")
    # one dtype comparison on the usual path (no sync). Autocast casts inputs to its dtype, except float64
    # ones (and float64 weights)
    if x.dtype != weights and (torch.float64 in (x.dtype, weights) or not torch.is_autocast_enabled(x.device.type)):
        raise ValueError(f"expected images of the model's dtype {weights} (under torch.autocast, any but "
                         f"float64), got {x.dtype}; convert them with .to({weights})")
