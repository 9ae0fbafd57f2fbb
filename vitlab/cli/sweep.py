"""`vitlab sweep`: choose the learning rate as the paper does (Appendix B.1.1), then retrain.

    vitlab sweep --recipe paper_finetune:dataset=cifar10 --init ViT-B_16.npz --data cifar10.tar.gz

1. For every learning rate of the grid (``--grid``, default the recipe's ``lr_grid``,
   Table 4's {0.001, 0.003, 0.01, 0.03}) train on the rest of the training set and
   measure top-1 on a held-out part (class-stratified, seeded): ``--holdout``, by default
   the recipe's ``data.val_split`` (as ``--set`` changes it), which for ``paper_finetune`` is the appendix's share
   per dataset (10% Pets and Flowers, 2% CIFAR, 1% ImageNet); 10% for a recipe without one.
2. Retrain with the best learning rate (of rates tied, the lowest) on the full training set (with ``--val-split``,
   that many examples are still held out for a final number; the default holds out none;
   ``--val-data`` scores the final run on a separate set, and only the final run).
3. Print one JSON line: every grid point's held-out accuracy, the chosen lr and the final
   run's summary (its weights' path included).
``--time-limit`` is each run's budget (the final run's too), so the sweep takes about (rates + 1)
times it.  Works with any recipe; ``--init`` makes it a fine-tuning sweep.  The sweep is
``vitlab.train.sweep.run_sweep``; this command resolves its config from the flags.
"""
from __future__ import annotations

import argparse
import json

from .train import add_common_arguments, resolve_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--init", help="pre-trained weights to fine-tune from: a file, a run folder or a Hugging Face "
                                  "Hub name (omit to train from scratch the model --model names)")
    p.add_argument("--grid", help="comma-separated learning rates (default: the recipe's lr_grid)")
    p.add_argument("--holdout", type=float, default=None,
                   help="fraction (or count) of the training set held out to compare the grid (default: the "
                        "recipe's data.val_split, Appendix B.1.1's per dataset for paper_finetune; else 0.1)")
    # the flags whose meaning a sweep changes: --lr, given, was shown as the final run's rate and unused
    add_common_arguments(p, default_recipe=None, helps={
        "lr": "refused: every run's rate is one of --grid's",
        "val_split": "examples the final run still holds out, for a final figure: a count or a fraction (default: "
                     "none; the grid is compared on --holdout)",
        "val_data": "a separate validation set that scores the final run, in any form --data takes (the grid is "
                    "compared on --holdout)",
        "time_limit": "fit each run's warm-up, decay and final evaluation into this wall-clock budget, the final "
                      "run's too: the sweep takes about (rates + 1) x MINUTES (every rate trains for the same time, "
                      "which comparing them needs)",
        "out": "output folder: a run per rate (lr_RATE), the final run (final), sweep.json and settings.json",
        "resume": "continue every run of the sweep (OUT/lr_RATE, OUT/final) as train --resume does, refused if "
                  "they were made with another init, optimiser, schedule, augmentation or arithmetic "
                  "(OUT/settings.json); a rate whose run diverged is counted lost again, and a final run that "
                  "diverged stops the sweep again, not trained (its folder's diverged.json), unless a setting "
                  "changed",
        "overwrite": "start every run of the sweep afresh (OUT/lr_RATE, OUT/final), their checkpoints deleted",
        "show_config": "print the plan as JSON (the grid, its hold-out, the final run's config) and exit"})


def parse_grid(text: str) -> tuple[float, ...]:
    """``--grid``'s comma-separated learning rates (``sweep`` and ``vtab``), each positive and once."""
    from vitlab.train.config import check_lr_grid

    try:
        grid = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--grid {text!r}: expected comma-separated learning rates, e.g. 0.001,0.003,0.01") from None
    check_lr_grid(grid, "--grid")
    return grid


def sweep_settings(args: argparse.Namespace):
    """(the config, the grid's hold-out) from the command's flags.  ``--val-split`` and ``--val-data`` are
    the final run's alone: the config goes to ``run_sweep`` without the first (its ``final_val_split``),
    and the hold-out is ``--holdout``, else the ``data.val_split`` of the recipe as --set changes it
    (a named validation set holds nothing out of the config it is set in), else 10%.  The config is
    resolved holding that out, as the grid's runs do, unless a validation set is named: an evaluation
    setting (--set run.eval_flip=true), which they read, was refused on a recipe that holds nothing out
    (``check_eval_changes_read``)."""
    from vitlab.config import ConfigError
    from vitlab.train.overrides import named_fields
    from vitlab.train.sweep import sweep_holdout

    from .train import config_changes

    # every run's rate is the grid's: --lr 0.5 was accepted, shown as the final run's by --show-config, and unused
    if args.lr is not None or "optim.lr" in named_fields(args.overrides):
        given = "--set optim.lr" if args.lr is None else f"--lr {args.lr:g}"
        raise ConfigError(f"{given}: a sweep trains every rate of its grid and retrains at the best; give the rates "
                          "with --grid")
    init = {"model.init": args.init} if args.init else {}
    recipe, changes = config_changes(argparse.Namespace(**{**vars(args), "val_split": None}), extra=init)
    holdout = sweep_holdout(args.holdout, changes.get("data.val_split", recipe.data.val_split))
    held = {} if changes.get("data.val_data", recipe.data.val_data) else {"data.val_split": holdout}  # one of them
    return resolve_config(argparse.Namespace(**{**vars(args), "val_split": None}), extra={**init, **held}), holdout


def run(args: argparse.Namespace) -> int:
    from vitlab.train.config import to_dict
    from vitlab.train.resolve import check_init_shown
    from vitlab.train.sweep import run_sweep, sweep_plan

    cfg, holdout = sweep_settings(args)
    grid = parse_grid(args.grid) if args.grid else ()
    if args.show_config:  # the plan: the grid, its hold-out, and the final run's config
        grid, _, final_cfg, holdout = sweep_plan(cfg, grid, holdout, args.val_split)
        check_init_shown(final_cfg)  # the init the runs refuse, as train's and finetune's --show-config refuse it
        print(json.dumps({"grid": grid, "holdout": holdout, "final": to_dict(final_cfg)}, indent=2))
        return 0
    report = run_sweep(cfg, grid, holdout, args.val_split, resume=args.resume, overwrite=args.overwrite,
                       verbose=not args.quiet, say=lambda line: print(line, flush=True))
    print(json.dumps(report), flush=True)
    return 0
