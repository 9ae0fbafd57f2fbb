"""`vitlab flops`: forward FLOPs of a model, and the compute of a training run."""
from __future__ import annotations

import argparse

from vitlab.cli import add_img_size_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="registry name, e.g. ViT-B/16 (see `vitlab models`)")
    add_img_size_argument(p, "input resolution")
    p.add_argument("--batch", type=int, default=None, help="images per step, for a training run's cost")
    p.add_argument("--steps", type=int, default=None, help="training steps, for a training run's cost")
    p.add_argument("--utilization", type=float, default=0.3,
                   help="fraction of the TPUv3 bf16 peak assumed for core-days (default 0.3)")
    p.add_argument("--breakdown", action="store_true", help="FLOPs of every component")


def figure(value: float) -> str:
    """A figure of the run's cost: two decimals from 10 up, else three significant digits; fixed
    decimals printed a run of this library's size (1e-5 exaFLOPs) as 0.00."""
    return f"{value:10.2f}" if value >= 10 else f"{value:10.3g}"


def run(args: argparse.Namespace) -> int:
    from vitlab.analysis.cost import core_days, flops_breakdown, training_flops
    from vitlab.config import replace
    from vitlab.models.registry import get_config

    cfg = get_config(args.model)
    if args.img_size is not None:  # the model's own checks: a positive size that cuts into whole patches
        cfg = replace(cfg, img_size=args.img_size)
    size = tuple(cfg.img_size)  # (H, W): its height alone gave a non-square size's figures at H x H
    # every flag is checked before the first line is printed: a refusal after the forward FLOPs
    # left half a report on stdout beside the error
    for flag, value in (("--batch", args.batch), ("--steps", args.steps)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: must be a positive integer")
    if not 0 < args.utilization <= 1:  # nan too; checked here as it is read only with --batch and --steps
        raise ValueError(f"--utilization {args.utilization:g}: must be a fraction of the peak in (0, 1], e.g. 0.3")
    if (args.batch is None) != (args.steps is None):
        raise ValueError("--batch and --steps go together: the cost of a run is steps x batch images")
    if args.batch is not None:
        exa = training_flops(cfg, args.steps, args.batch, size)
        days = core_days(exa, utilization=args.utilization)
    parts = flops_breakdown(cfg, size)
    flops = sum(parts.values())
    print(f"{args.model} at {size[0]}x{size[1]}, forward, one image (matmuls and convolutions):")
    print(f"  {flops / 2e9:10.2f} GMACs   (multiply-adds; what timm and most tables call 'FLOPs')")
    print(f"  {flops / 1e9:10.2f} GFLOPs  (multiply-add = 2 FLOPs; torch.utils.flop_counter, paper Table 6)")
    if args.breakdown:
        for name, value in parts.items():
            print(f"    {name:18s} {value / 1e9:10.3f} GFLOPs  {100 * value / flops:5.1f}%")
    if args.batch is not None:
        print(f"training, {args.steps:,} steps x {args.batch:,} images (forward + backward = 3x forward):")
        print(f"  {figure(exa)} exaFLOPs")
        print(f"  {figure(days)} TPUv3-core-days "  # the share as given: 0.325 was "32%"
              f"at {100 * args.utilization:.3g}% of the 61.5 TFLOP/s bf16 peak per core")
    return 0
