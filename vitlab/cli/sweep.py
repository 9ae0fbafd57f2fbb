"""`vitlab sweep`: choose the learning rate as the paper does (Appendix B.1.1), then retrain.

    vitlab sweep --recipe paper_finetune:dataset=cifar10 --init ViT-B_16.npz --data cifar10.tar.gz

1. For every learning rate of the grid (``--grid``, default the recipe's ``lr_grid``,
   Table 4's {0.001, 0.003, 0.01, 0.03}) train on the rest of the training set and
   measure top-1 on a held-out part (class-stratified, seeded): ``--holdout``, by default
   the recipe's ``data.val_split`` (as ``--set`` changes it), which for ``paper_finetune`` is the appendix's share
   per dataset (10% Pets and Flowers, 2% CIFAR, 1% ImageNet); 10% for a recipe without one.
2. Retrain with the best learning rate on the full training set (with ``--val-split``,
   that many examples are still held out for a final number; the default holds out none;
   ``--val-data`` scores the final run on a separate set, and only the final run).
3. Print one JSON line: every grid point's held-out accuracy, the chosen lr and the final
   run's summary (its weights' path included).
Works with any recipe; ``--init`` makes it a fine-tuning sweep.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .train import add_common_arguments, resolve_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--init", help="pre-trained weights to fine-tune from (omit to train from scratch)")
    p.add_argument("--grid", help="comma-separated learning rates (default: the recipe's lr_grid)")
    p.add_argument("--holdout", type=float, default=None,
                   help="fraction (or count) of the training set held out to compare the grid (default: the "
                        "recipe's data.val_split, Appendix B.1.1's per dataset for paper_finetune; else 0.1)")
    add_common_arguments(p, default_recipe=None)


DEFAULT_HOLDOUT = 0.1


def sweep_holdout(explicit: float | None, recipe_split: float | int) -> float | int:
    """What the grid is compared on: ``--holdout``, else the recipe's validation split, else 10%.
    None held out leaves nothing to compare (0 failed after the first rate's run, on its missing score)."""
    from vitlab.config import ConfigError

    if explicit == 0:
        raise ConfigError("--holdout 0: the grid is compared on a held-out part of the training set; give a count "
                          "(500) or a fraction (0.1)")
    value = explicit if explicit is not None else (recipe_split or DEFAULT_HOLDOUT)
    return int(value) if float(value).is_integer() and value >= 1 else value


def resolve_val_split(value: float | None) -> float | int:
    """The final run's ``data.val_split``: ``--val-split`` if given, else 0 (none held out)."""
    if value is None:
        return 0
    return int(value) if float(value).is_integer() and value >= 1 else value


def parse_grid(text: str) -> tuple[float, ...]:
    """``--grid``'s comma-separated learning rates (``sweep`` and ``vtab``), each positive and once."""
    from vitlab.train.config import check_lr_grid

    try:
        grid = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--grid {text!r}: expected comma-separated learning rates, e.g. 0.001,0.003,0.01") from None
    check_lr_grid(grid, "--grid")
    return grid


def sweep_plan(args: argparse.Namespace):
    """(the grid, one config per learning rate of it, the final run's config, the hold-out the
    grid is compared on) from the command's flags."""
    from vitlab.config import ConfigError
    from vitlab.configs import load_recipe
    from vitlab.train.overrides import parse_overrides, with_changes

    cfg = resolve_config(args, extra={"model.init": args.init} if args.init else {})
    if cfg.model.mpp is not None:  # the first rate's run trained, then the sweep ended on its missing score
        raise ConfigError(f"model.mpp={cfg.model.mpp!r}: a sweep compares its rates by their held-out top-1, and "
                          "masked patch prediction trains no classifier to score; sweep the fine-tune of its weights "
                          "(--init) instead")
    grid = parse_grid(args.grid) if args.grid else tuple(cfg.optim.lr_grid)
    if not grid:
        raise ConfigError("optim.lr_grid=(): the recipe has no learning-rate grid; pass --grid 0.001,0.003,...")
    # the recipe's split as --set changes it (--val-split is the final run's): a --set data.val_split was ignored
    recipe = load_recipe(args.recipe)
    holdout = sweep_holdout(args.holdout, parse_overrides(recipe, args.overrides).get("data.val_split",
                                                                                       recipe.data.val_split))
    base_out = Path(cfg.run.out)
    # the grid is compared on its hold-out of the training set; a --val-data set scores the final run only
    runs = [with_changes(cfg, {"optim.lr": lr, "data.val_split": holdout, "data.val_data": None,
                               "run.out": str(base_out / f"lr_{lr:g}")})
            for lr in grid]
    # the final retrain: the full training set, unless --val-split holds some out (not the recipe's split)
    final = with_changes(cfg, {"run.out": str(base_out / "final"), "data.val_split": resolve_val_split(args.val_split)})
    return grid, runs, final, holdout


def check_final_lr(final_cfg, best: float) -> None:
    """Refuse to ``--resume`` a final run made at another learning rate than the grid's best (a grid
    or hold-out changed since): the learning rate may change on resume, so its finished run was
    read back and reported as the retrain at the best rate."""
    from vitlab.config import ConfigError
    from vitlab.train.loop import held_by_earlier_run

    out = Path(final_cfg.run.out)
    if held_by_earlier_run(out) is None:
        return
    try:
        lr = json.loads((out / "config.json").read_text())["optim"]["lr"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # no record of its rate: train's own checks decide
    if f"{lr:g}" != f"{best:g}":
        raise ConfigError(f"--resume: {str(out)!r} holds the final run at lr {lr:g}, but the grid's best is now "
                          f"{best:g}; move that folder away to retrain it, or choose another --out")


def run(args: argparse.Namespace) -> int:
    from vitlab.train import train
    from vitlab.train.build import check_can_run
    from vitlab.train.distributed import env_world_size
    from vitlab.train.overrides import with_changes
    from vitlab.weights.core import atomic_write

    grid, runs, final_cfg, holdout = sweep_plan(args)
    if args.show_config:  # the plan: the grid, its hold-out, and the final run's config
        from vitlab.train.config import to_dict

        print(json.dumps({"grid": grid, "holdout": holdout, "final": to_dict(final_cfg)}, indent=2))
        return 0
    for r in runs + [final_cfg]:  # every run is checked before the first one starts
        check_can_run(r, env_world_size())

    scores = {}
    for r in runs:
        summary = train(r, resume=args.resume, overwrite=args.overwrite, verbose=not args.quiet)
        scores[f"{r.optim.lr:g}"] = summary["val_top1"]
        print(f"lr {r.optim.lr:g}: held-out top-1 {summary['val_top1']:.4f}", flush=True)
    best = max(grid, key=lambda lr: scores[f"{lr:g}"])
    if args.resume:
        check_final_lr(final_cfg, best)
    final = train(with_changes(final_cfg, {"optim.lr": best}), resume=args.resume, overwrite=args.overwrite,
                  verbose=not args.quiet)
    report = {"holdout": holdout, "holdout_top1": scores, "best_lr": best, "final": final}
    if final.get("weights") is not None:
        # beside the runs' folders, in the folder the command was given; written beside its place, then
        # renamed: written in place, a failure (a full disk) left an earlier sweep's report truncated
        text = json.dumps(report, indent=2).encode()
        atomic_write(Path(final_cfg.run.out).parent / "sweep.json", lambda f: f.write(text))
        print(json.dumps(report), flush=True)
    return 0
