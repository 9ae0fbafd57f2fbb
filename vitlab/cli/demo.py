"""`vitlab demo`: train a small ViT on scikit-learn's handwritten digits, no download.

About a minute on 2 CPU cores (recipe: vitlab/configs/demo.py).  Prints the validation
accuracy and the path of the saved weights, which `vitlab predict` and
``vitlab.weights.load_model`` read, and writes an inspection report (matplotlib: the
``demo`` and ``plots`` extras; without it the report is skipped with one line saying so).
"""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    p.add_argument("--steps", type=int, help="optimiser steps (default: the recipe's)")
    p.add_argument("--seed", type=int, help="random seed")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a field of the demo recipe, SECTION.FIELD=VALUE (repeatable)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--no-report", action="store_true", help="skip the HTML inspection report")


def run(args: argparse.Namespace) -> int:
    from vitlab.configs import load_recipe
    from vitlab.train import train
    from vitlab.train.build import check_can_run
    from vitlab.train.loop import check_own_folder
    from vitlab.train.overrides import apply_overrides, with_changes

    cfg = apply_overrides(load_recipe("demo"), args.overrides)
    changes = {"run.out": args.out}
    if args.steps is not None:
        changes["optim.steps"] = args.steps
    if args.seed is not None:
        changes["run.seed"] = args.seed
    cfg = with_changes(cfg, changes)
    check_can_run(cfg)
    check_own_folder(cfg)  # another run's folder is kept from the overwrite below
    summary = train(cfg, overwrite=True, verbose=not args.quiet)  # the demo's folder is its own: rerunning replaces it
    print(f"validation accuracy: {summary['val_top1']:.2%} (top-5 {summary['val_top5']:.2%}) on "
          f"{summary['val_examples']} held-out digits after {summary['steps']} steps in {summary['wall_s']:.0f} s")
    print(f"weights: {summary['weights']}")
    if not args.no_report:
        from vitlab.extras import MissingPackage

        try:
            summary["report"] = str(write_demo_report(cfg, summary))
            print(f"report: {summary['report']} (attention maps, embeddings, curves; open it in a browser)")
        except MissingPackage as missing:  # the weights are saved; only the figures are left out
            summary["report"] = None
            print(f"report: skipped: {missing}")
    print(json.dumps(summary), flush=True)
    return 0


def write_demo_report(cfg, summary: dict):
    """The inspection report of the trained model on eight held-out digits."""
    from pathlib import Path

    from vitlab.analysis.report import read_run_meta, write_report
    from vitlab.train.config import from_dict
    from vitlab.train.inputs import build_splits
    from vitlab.weights import load_model

    model = load_model(summary["weights"])
    ran = from_dict(json.loads((Path(cfg.run.out) / "config.json").read_text()))  # as the run resolved it
    splits = build_splits(ran, model.cfg.img_size)
    # one example of each of the first eight classes, so the maps show different digits
    picks = [int((splits.val_labels == c).nonzero()[0]) for c in range(8)]
    meta = read_run_meta(summary["weights"])
    return write_report(model, splits.val_images[picks], Path(cfg.run.out) / "report.html",
                        run_dir=cfg.run.out, meta=meta)
