"""`vitlab vtab`: the VTAB-1k protocol over a folder of task folders (paper Sec. 4.2, Appendix B.1.1).

    vitlab vtab --init runs/b16/model.safetensors --tasks vtab/ --out runs/vtab

For each task (``vitlab.eval.vtab``: a folder named after the task, with train/ and test/,
or VTAB-1k's own train800/ and val200/ with test/):

1. fine-tune on ``train[:800]`` with every learning rate of the grid (``--grid``; default
   the recipe's, Table 4's {0.001, 0.003, 0.01, 0.03}) and score each on ``train[800:1000]``;
2. fine-tune on all 1000 with the best one (``--select per-task``, the default), or with
   the one whose mean over the tasks' 200-example validation sets is best
   (``--select shared``: the paper used one setting for all tasks, chosen so);
3. score the final model on the task's test set.

Every run is the ``vtab1k`` recipe's: SGD with momentum 0.9, 2500 steps (``--steps``),
batch 512, cosine decay, no weight decay, clipping at norm 1, resolution 384 for a 224-px
init (scaled from another init's as ``vitlab/configs/paper_finetune.py`` says;
``--img-size``).  The batch of 512 is accumulated over ``--accum-steps`` micro-batches,
by default as many as the memory of the device needs (``auto``: measured on the model).
The output: a table of each task's accuracy, its group's mean (Natural, Specialized,
Structured) and the mean over tasks, in ``OUT/vtab.json`` and as the last line of JSON.
With ``--resume`` the runs already finished (their ``summary.json``) are not run again.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .train import add_fast_argument


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
                   help="the group of a task folder whose name is not a VTAB task (repeatable)")
    p.add_argument("--examples", type=int, default=1000,
                   help="training examples per task (VTAB-1k: 1000, split 800/200 to choose the lr)")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the fixed order the splits are cut from")
    p.add_argument("--steps", type=int, help="optimiser steps of every run (default: the recipe's 2500)")
    p.add_argument("--batch-size", type=int, help="global batch (default: the recipe's 512)")
    p.add_argument("--accum-steps", default="auto",
                   help="micro-batches per step: a number, or auto (as many as the device's memory needs)")
    p.add_argument("--img-size", type=int, help="fine-tuning resolution (default: the recipe's, 384 for a 224-px init)")
    p.add_argument("--out", default="runs/vtab", help="output folder (default runs/vtab)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a field of the recipe, SECTION.FIELD=VALUE (repeatable)")
    add_fast_argument(p)
    p.add_argument("--resume", action="store_true", help="keep the runs of OUT that finished; run the rest")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def base_config(args: argparse.Namespace):
    """The recipe with the command's flags: every run of the protocol starts from it."""
    from vitlab.configs import load_recipe
    from vitlab.train.build import resolve_model
    from vitlab.train.overrides import parse_overrides, with_changes

    cfg = load_recipe(args.recipe)
    changes = parse_overrides(cfg, args.overrides)
    changes.update({"model.init": args.init, "data.train_examples": 0, "data.val_split": 0,
                    "data.cache_dir": str(Path(args.out) / "cache"), "run.eval_every": 0, "run.ckpt_every": 0})
    for flag, name in (("steps", "optim.steps"), ("batch_size", "optim.batch_size"), ("img_size", "model.img_size"),
                       ("fast", "run.fast")):
        if getattr(args, flag) is not None:
            changes[name] = getattr(args, flag)
    return resolve_model(with_changes(cfg, changes))  # the init's model, the resolution "auto" comes to


def activation_bytes_per_example(cfg) -> int:
    """Bytes a backward keeps per training example of the model ``cfg`` fine-tunes, measured on
    one example of the plain model (the fast path keeps less)."""
    import torch

    from vitlab.analysis.cost import SavedForBackward
    from vitlab.train.build import make_model, training_size

    model = make_model(cfg, num_classes=2).train()
    size = training_size(cfg)
    x = torch.zeros(1, 3, *size)
    with SavedForBackward(model) as kept:
        model(x).float().logsumexp(-1).sum()
    return kept.bytes


def available_bytes(device: str) -> int:
    """Free memory of ``device``: the GPU's, or the host's MemAvailable (8 GiB where unknown)."""
    from vitlab.train.memory_estimate import available_memory

    host, gpu = available_memory(device)
    return gpu if gpu is not None else host if host is not None else 8 << 30


def auto_accum_steps(batch: int, per_example: int, available: int, share: float = 0.5) -> int:
    """The fewest micro-batches, a divisor of ``batch``, whose activations fit in ``share`` of
    ``available`` bytes (the rest: weights, gradients, optimiser state, temporaries)."""
    for accum in (k for k in range(1, batch + 1) if batch % k == 0):
        if (batch // accum) * per_example <= share * available:
            return accum
    return batch


def resolve_accum_steps(args: argparse.Namespace, cfg, device: str) -> int:
    if args.accum_steps != "auto":
        if not args.accum_steps.isdigit() or int(args.accum_steps) < 1:
            raise ValueError(f"--accum-steps={args.accum_steps!r}: expected a positive integer or auto")
        return int(args.accum_steps)
    return auto_accum_steps(cfg.optim.batch_size, activation_bytes_per_example(cfg), available_bytes(device))


def evaluate_on(weights: str, folder: Path, cfg, device: str, precision: str) -> tuple[float, int]:
    """(top-1, images) of the weights on an ImageFolder view, at the resolution they were trained
    at, in the command's resolved ``precision``."""
    from vitlab.data.memory import load_in_memory
    from vitlab.eval.evaluator import Evaluator
    from vitlab.weights import load_model

    model = load_model(weights).to(device).eval()
    data = load_in_memory(folder, image_size=model.cfg.img_size, cache_dir=cfg.data.cache_dir,
                          workers=cfg.data.decode_workers)
    result = Evaluator(data.images, data.labels, batch_size=cfg.run.eval_batch_size, device=device,
                       precision=precision).run(model)
    return float(result["top1"]), int(result["n"])


class _ViewsHaveEmptyClasses:
    """A logging filter: a split view holds every class folder of its task, some empty by design."""

    def filter(self, record) -> bool:
        return "/splits/" not in str(record.args[0] if record.args else "") or "hold no images" not in record.msg


def run(args: argparse.Namespace) -> int:
    import logging

    quiet_views = _ViewsHaveEmptyClasses()
    logging.getLogger("vitlab.data.sources").addFilter(quiet_views)
    try:
        return _run(args)
    finally:
        logging.getLogger("vitlab.data.sources").removeFilter(quiet_views)


def _run(args: argparse.Namespace) -> int:
    import torch

    from vitlab import fast
    from vitlab.config import ConfigError
    from vitlab.eval.vtab import find_tasks, format_table, split_task, summarize
    from vitlab.train import train
    from vitlab.train.build import check_can_run
    from vitlab.train.overrides import with_changes

    groups = {}
    for item in args.group:
        folder, _, group = item.partition("=")
        if not group:
            raise ConfigError(f"--group {item!r}: expected FOLDER=natural|specialized|structured")
        groups[folder] = group
    tasks = find_tasks(args.tasks, groups)
    if args.only:
        wanted = [t.strip() for t in args.only.split(",") if t.strip()]
        unknown = [w for w in wanted if w not in {t.name for t in tasks}]
        if unknown:
            raise ConfigError(f"--only {', '.join(unknown)}: no such task in {args.tasks} "
                              f"({', '.join(t.name for t in tasks)})")
        tasks = [t for t in tasks if t.name in wanted]
    if args.examples < 5:
        raise ConfigError(f"--examples={args.examples}: must be at least 5 (a 4:1 split)")

    cfg = base_config(args)
    grid = tuple(float(v) for v in args.grid.split(",")) if args.grid else tuple(cfg.optim.lr_grid) or (cfg.optim.lr,)
    device = cfg.run.device if cfg.run.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    accum = resolve_accum_steps(args, cfg, device)
    precision = fast.auto_precision(device) if cfg.run.precision == "auto" else cfg.run.precision  # decided once
    cfg = with_changes(cfg, {"optim.accum_steps": accum})
    check_can_run(with_changes(cfg, {"data.source": "digits"}))  # the weights and the batch, before any run
    out = Path(args.out)
    say = (lambda text: None) if args.quiet else (lambda text: print(text, file=sys.stderr, flush=True))
    say(f"vtab: {len(tasks)} tasks, lr grid {', '.join(f'{lr:g}' for lr in grid)} ({args.select}), "
        f"{cfg.optim.steps} steps at batch {cfg.optim.batch_size} ({accum} micro-batches of "
        f"{cfg.optim.batch_size // accum}), {args.examples} examples per task")

    def fine_tune(source: Path, lr: float, run_out: Path) -> dict:
        done = run_out / "summary.json"
        if args.resume and done.is_file():
            return json.loads(done.read_text())
        run_cfg = with_changes(cfg, {"data.source": str(source), "optim.lr": lr, "run.out": str(run_out)})
        check_can_run(run_cfg)
        return train(run_cfg, overwrite=True, verbose=not args.quiet)

    splits, val = {}, {}
    for task in tasks:
        splits[task.name] = split_task(task, out / task.name / "splits", args.examples, args.split_seed)
        val[task.name] = {}
        if len(grid) > 1:  # one learning rate needs no choosing
            for lr in grid:
                summary = fine_tune(splits[task.name].sweep_train, lr, out / task.name / f"lr_{lr:g}")
                val[task.name][f"{lr:g}"], _ = evaluate_on(summary["weights"], splits[task.name].sweep_val, cfg,
                                                           device, precision)
                say(f"{task.name}: lr {lr:g}: top-1 {val[task.name][f'{lr:g}']:.4f} on its "
                    f"{splits[task.name].counts['val200']} validation examples")
    if args.select == "shared" and len(grid) > 1:
        shared = max(grid, key=lambda lr: sum(v[f"{lr:g}"] for v in val.values()))
    results = {}
    for task in tasks:
        views = splits[task.name]
        if len(grid) == 1:
            lr = grid[0]
        elif args.select == "shared":
            lr = shared
        else:
            lr = max(grid, key=lambda g: val[task.name][f"{g:g}"])
        final = fine_tune(views.train, lr, out / task.name / f"final_lr_{lr:g}")
        top1, n = evaluate_on(final["weights"], views.test, cfg, device, precision)
        results[task.name] = {"group": task.group, "lr": lr, "val_top1": val[task.name], "test_top1": top1,
                              "test_examples": n, "test_split": views.test_split,
                              "train_examples": views.counts["train1000"], "classes": len(views.classes),
                              "weights": final["weights"]}
        say(f"{task.name}: lr {lr:g}: test top-1 {top1:.4f} on {n} images ({views.test_split})")
    summary = summarize(results)
    report = {"protocol": {"recipe": cfg.recipe, "init": args.init, "grid": list(grid), "select": args.select,
                           "steps": cfg.optim.steps, "batch_size": cfg.optim.batch_size, "accum_steps": accum,
                           "img_size": cfg.model.img_size, "examples": args.examples, "split_seed": args.split_seed},
              "tasks": results, **summary}
    out.mkdir(parents=True, exist_ok=True)
    (out / "vtab.json").write_text(json.dumps(report, indent=2))
    print(format_table(results, summary))
    print(json.dumps(report), flush=True)
    return 0
