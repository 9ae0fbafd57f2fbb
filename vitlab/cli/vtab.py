"""`vitlab vtab`: the VTAB-1k protocol over a folder of task folders (paper Sec. 4.2, Appendix B.1.1).

    vitlab vtab --init runs/b16/model.safetensors --tasks vtab/ --out runs/vtab

The protocol is ``vitlab.train.vtab.run_vtab``; the tasks and their splits are
``vitlab.eval.vtab``'s.  For each task (a folder named after the task, with train/ and
test/, or VTAB-1k's own train800/ and val200/ with test/):

1. fine-tune on ``train[:800]`` with every learning rate of the grid (``--grid``; default
   the recipe's, Table 4's {0.001, 0.003, 0.01, 0.03}) and score each on ``train[800:1000]``;
2. fine-tune on all 1000 with the best one (of rates tied, the lowest; ``--select per-task``, the default), or with
   the one whose mean over the tasks' 200-example validation sets is best
   (``--select shared``: the paper used one setting for all tasks, chosen so);
3. score the final model on the task's test set.

Every run is the ``vtab1k`` recipe's: SGD with momentum 0.9, 2500 steps (``--steps``),
batch 512, cosine decay, no weight decay, clipping at norm 1, resolution 384 for a 224-px
init (scaled from another init's as ``vitlab/configs/paper_finetune.py`` says;
``--img-size``), inception crop and flip, but not where they change the task's labels: no flip for
dSprites location and orientation and sNORB azimuth, no crop for dSprites location, Clevr count and
distance, DMLab and KITTI distance (BiT's Supplementary F, whose pre-processing the paper follows).  The batch of 512 is accumulated over ``--accum-steps`` micro-batches,
by default as many as the memory of the device needs (``auto``: measured on the model).
The output: a table of each task's accuracy, its group's mean (Natural, Specialized,
Structured) and the mean over tasks, VTAB's alone (a ``--group`` task's means are apart), in ``OUT/vtab.json``
and as the last line of JSON.
With ``--resume`` the runs already finished (their ``summary.json``) are not run again, and a
run that was stopped goes on from its newest checkpoint (``run.ckpt_every``: the recipe's 500 steps);
a rate whose run diverged (its folder's ``diverged.json``, with the same config) is counted lost again, untrained,
and a final run that diverged stops the protocol again, untrained.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from vitlab.cli import add_img_size_argument, add_weights_img_size_argument

from .sweep import parse_grid
from .train import add_fast_argument, count_or_auto


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--init", required=True,
                   help="pre-trained weights: any format `vitlab` reads, or a Hugging Face Hub name")
    p.add_argument("--tasks", required=True, help="a folder of task folders (see `vitlab.eval.vtab`)")
    p.add_argument("--recipe", default="vtab1k", help="the recipe of every run (default vtab1k)")
    p.add_argument("--grid", help="comma-separated learning rates (default: the recipe's lr_grid)")
    p.add_argument("--select", choices=("per-task", "shared"), default="per-task",
                   help="the learning rate of the final runs: each task's best on its 200 validation examples, "
                        "or the one best on average over the tasks (the paper's one setting for all)")
    p.add_argument("--only", help="comma-separated task names: run these tasks only")
    p.add_argument("--group", action="append", default=[], metavar="FOLDER=GROUP",
                   help="the group of a task folder whose name is not a VTAB task (repeatable; its means are "
                        "apart from VTAB's)")
    p.add_argument("--examples", type=int, default=1000,
                   help="training examples per task (VTAB-1k: 1000, split 800/200 to choose the lr); a task's own "
                        "train800/ and val200/ are used as given")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the fixed order the splits are cut from")
    p.add_argument("--steps", type=int, help="optimiser steps of every run (default: the recipe's 2500)")
    p.add_argument("--batch-size", type=int, help="global batch (default: the recipe's 512)")
    p.add_argument("--accum-steps", type=count_or_auto, default="auto",
                   help="micro-batches per step: a number, or auto (the fewest that fit in memory)")
    add_img_size_argument(p, "fine-tuning resolution", "the recipe's, 384 for a 224-px init")
    add_weights_img_size_argument(p, "the --init weights")
    p.add_argument("--out", default="runs/vtab", help="output folder (default runs/vtab)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a field of the recipe, SECTION.FIELD=VALUE (repeatable); not one the protocol sets "
                        "in every run: optim.lr under a grid, model.init, data.source, data.train_examples, "
                        "data.val_split, run.out")
    add_fast_argument(p)
    p.add_argument("--resume", action="store_true",
                   help="keep the runs of OUT that finished, continue those that stopped from their checkpoints "
                        "(run.ckpt_every); run the rest, but a rate whose run diverged is counted lost again, and a "
                        "final run that diverged stops the protocol again, not trained (its folder's diverged.json), "
                        "unless a setting changed")
    p.add_argument("--overwrite", action="store_true",
                   help="train again the tasks' runs in OUT, finished or stopped (without it, or --resume, such an "
                        "OUT is refused)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def base_config(args: argparse.Namespace):
    """The recipe with the command's flags: every run of the protocol starts from it."""
    from vitlab.config import ConfigError
    from vitlab.configs import load_recipe
    from vitlab.train.overrides import parse_overrides
    from vitlab.train.vtab import PER_RUN_FIELDS

    cfg = load_recipe(args.recipe)
    changes = parse_overrides(cfg, args.overrides)
    # accepted and unused: --set optim.lr=0.5 trained the grid's rates, --set data.train_examples=500 --examples
    for name in sorted(PER_RUN_FIELDS.keys() & changes.keys()):
        if name != "optim.lr" or args.grid or changes.get("optim.lr_grid", cfg.optim.lr_grid):
            raise ConfigError(f"--set {name}: {PER_RUN_FIELDS[name]}; leave it out")
    changes.setdefault("data.cache_dir", str(Path(args.out) / "cache"))  # --set's was replaced by this one
    # the recipe's (or --set's) run.ckpt_every: a run that stops goes on from its checkpoint with --resume
    changes.update({"model.init": args.init, "run.eval_every": 0})
    for flag, name in (("steps", "optim.steps"), ("batch_size", "optim.batch_size"), ("img_size", "model.img_size"),
                       ("weights_img_size", "model.weights_img_size"), ("fast", "run.fast")):
        if getattr(args, flag) is not None:
            changes[name] = getattr(args, flag)
    return load_recipe(args.recipe, changes=changes)  # a recipe whose rates are per model: the init's


def task_groups(items: list[str]) -> dict[str, str]:
    """``--group FOLDER=GROUP`` flags as {folder: group}."""
    from vitlab.config import ConfigError

    groups = {}
    for item in items:
        folder, _, group = item.partition("=")
        if not group:
            raise ConfigError(f"--group {item!r}: expected FOLDER=natural|specialized|structured")
        groups[folder] = group
    return groups


def run(args: argparse.Namespace) -> int:
    from vitlab.eval.vtab import find_tasks, format_table, select_tasks
    from vitlab.train.vtab import run_vtab

    grid = parse_grid(args.grid) if args.grid else ()  # "abc" was float's own "could not convert string to float"
    tasks = find_tasks(args.tasks, task_groups(args.group))
    if args.only:
        tasks = select_tasks(tasks, [t.strip() for t in args.only.split(",") if t.strip()], args.tasks)
    report = run_vtab(base_config(args), tasks, args.out, examples=args.examples, split_seed=args.split_seed,
                      grid=grid, select=args.select, accum_steps=args.accum_steps, resume=args.resume,
                      verbose=not args.quiet, overwrite=args.overwrite)
    print(format_table(report["tasks"], report))
    print(json.dumps(report), flush=True)
    return 0
