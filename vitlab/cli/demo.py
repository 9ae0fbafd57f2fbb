"""`vitlab demo`: train a small ViT on scikit-learn's handwritten digits, no download.

About a minute on 2 CPU cores (recipe: configs/demo.py).  Prints the validation
accuracy and the path of the saved weights, which `vitlab predict` and
``vitlab.weights.load_model`` read.
"""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    p.add_argument("--steps", type=int, help="optimiser steps (default: the recipe's)")
    p.add_argument("--seed", type=int, help="random seed")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a field of the demo recipe (repeatable)")
    p.add_argument("--quiet", action="store_true", help="no progress line")


def run(args: argparse.Namespace) -> int:
    from vitlab.train import train
    from vitlab.train.config import apply_overrides, load_recipe, replace, validate

    cfg = apply_overrides(load_recipe("demo"), args.overrides)
    changes = {"out": args.out}
    if args.steps is not None:
        changes["steps"] = args.steps
    if args.seed is not None:
        changes["seed"] = args.seed
    cfg = replace(cfg, **changes)
    validate(cfg)
    summary = train(cfg, verbose=not args.quiet)
    print(f"validation accuracy: {summary['val_top1']:.2%} (top-5 {summary['val_top5']:.2%}) on "
          f"{summary['val_examples']} held-out digits after {summary['steps']} steps in {summary['wall_s']:.0f} s")
    print(f"weights: {summary['weights']}")
    print(json.dumps(summary), flush=True)
    return 0
