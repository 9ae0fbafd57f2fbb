"""`vitlab eval`: top-1/top-5, per-class accuracy, confusion matrix and calibration of a checkpoint.

    vitlab eval --checkpoint runs/c10/model.safetensors --data cifar10-train.tar.gz --val-split 5000

Without ``--val-split`` the split of the checkpoint's training run is used when the
run's ``config.json`` sits beside the checkpoint and names the same data; otherwise the
whole data set is evaluated.  The numbers come from ``vitlab.eval.Evaluator``, the
evaluator the trainer runs.  The last line of output is JSON.

This module also holds the checkpoint/data helpers that ``fewshot`` and ``inspect`` share.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .train import add_fast_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="weights: vitlab .safetensors/dir, official .npz, timm, HF")
    add_data_arguments(p, default_split="the training run's, else 0 (the whole set)")
    p.add_argument("--json", action="store_true", help="put every metric (per class, confusion, ECE) in the JSON line")
    p.add_argument("--bins", type=int, default=15, help="confidence bins of the expected calibration error")
    p.add_argument("--flip", action="store_true",
                   help="test-time flip: average each image's predicted probabilities with its mirror image's")
    p.add_argument("--shift", type=int, default=0, metavar="PIXELS",
                   help="test-time translations: also average over each view shifted by PIXELS along each axis, "
                        "both ways (reflection fills the border, as the training pad-and-crop); 0: none")
    add_fast_argument(p)


def add_data_arguments(p: argparse.ArgumentParser, default_split: str) -> None:
    p.add_argument("--data", help="ImageFolder folder, .tar/.tar.gz archive, tar shards (a folder, "
                                  "'shards/shard-{000000..000009}.tar' or 'shards/*.tar'), a Hugging Face save_to_disk "
                                  "folder, parquet files, or 'digits' (default: the run's data)")
    p.add_argument("--img-size", type=int, default=None,
                   help="evaluation resolution; position embeddings are resampled (default: the model's)")
    p.add_argument("--val-split", type=float, default=None,
                   help=f"held-out examples: a count, a fraction < 1, or 0 for all (default: {default_split})")
    p.add_argument("--split-seed", type=int, default=None,
                   help="seed of the stratified split (default: the run's, else 0)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--cache-dir", default=None, help="where decoded data sets are cached (default: ~/.cache/vitlab)")


# ----------------------------------------------------------------------------- shared helpers


def pick_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def load_checkpoint(source: str, img_size: int | None, device: str, fast: bool = False):
    """(model in eval mode on ``device``, run metadata dict); ``fast``: ``vitlab.fast.optimize``d."""
    from vitlab.analysis.report import read_run_meta
    from vitlab.weights import load_model

    model = load_model(source, img_size=img_size).to(device).eval()
    if fast:
        from vitlab import fast as fast_path

        fast_path.optimize(model)
    return model, read_run_meta(source)


def run_data(meta: dict) -> dict:
    """The data section of the checkpoint's training config (either layout; {} without one)."""
    from vitlab.train.legacy import nested_dict

    recipe = meta.get("recipe")
    return dict(nested_dict(recipe).get("data") or {}) if isinstance(recipe, dict) else {}


def load_data(args: argparse.Namespace, meta: dict, image_size: tuple[int, int], held_out: tuple | None = None):
    """(images uint8 (N, 3, H, W), labels (N,), class names, data key, same_as_run) for
    ``args.data``; ``held_out``: only those held-out shards (``run_held_out``)."""
    from vitlab.data.labelled import load_labelled

    recipe = run_data(meta)
    data = args.data or recipe.get("source")
    if not data:
        raise ValueError("--data is needed: the checkpoint's run does not name its data")
    same_as_run = bool(recipe) and str(data) == str(recipe.get("source"))
    ds = load_labelled(data, image_size, cache_dir=args.cache_dir, held_out=held_out)
    images, labels, classes, key = ds.images, ds.labels, list(ds.classes), ds.key
    if same_as_run and recipe.get("class_subset"):
        from vitlab.train.inputs import select_classes

        images, labels, classes = select_classes(images, labels, classes, tuple(recipe["class_subset"]))
        key += "|" + ",".join(classes)
    return images, labels, classes, key, same_as_run


def run_held_out(args: argparse.Namespace, meta: dict) -> tuple | None:
    """(share, seed) of the shards a streamed training run held out, when ``args`` evaluate
    that run's own data with its split; else None."""
    recipe = run_data(meta)
    same_data = args.data is None or str(args.data) == str(recipe.get("source"))
    if recipe.get("stream") == "stream" and recipe.get("val_split") and same_data and args.val_split is None:
        return recipe["val_split"], int(args.split_seed if args.split_seed is not None else recipe.get("split_seed", 0))
    return None


def split_indices(labels, args: argparse.Namespace, meta: dict, same_as_run: bool, default: float):
    """(rest, held_out) index tensors; held_out is everything when the split is 0."""
    import torch

    from vitlab.data.splits import stratified_split

    recipe = run_data(meta)
    val_split = args.val_split
    seed = args.split_seed
    if val_split is None:
        val_split = float(recipe.get("val_split") or 0) if same_as_run and recipe.get("val_split") else default
    if seed is None:
        seed = int(recipe.get("split_seed", 0)) if same_as_run else 0
    if val_split < 0 or (val_split >= 1 and not float(val_split).is_integer()):
        raise ValueError(f"--val-split={val_split}: a count (integer >= 1), a fraction in (0, 1), or 0 for all")
    if val_split == 0:
        n = len(labels)
        return torch.arange(0), torch.arange(n), (0, seed)
    size = int(val_split) if val_split >= 1 else float(val_split)
    rest, held = stratified_split(labels, size, seed)
    return rest, held, (size, seed)


def model_input_size(model) -> tuple[int, int]:
    return tuple(model.cfg.img_size)


# ----------------------------------------------------------------------------- the command


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from vitlab.eval import Evaluator
    from vitlab.eval.features import check_tta_shift

    device = pick_device(args.device)
    model, meta = load_checkpoint(args.checkpoint, args.img_size, device, fast=args.fast is not False)
    size = model_input_size(model)
    check_tta_shift(args.shift, size, "--shift")
    held_out = run_held_out(args, meta)  # a streamed run's held-out shards: decode only those
    images, labels, classes, _, same = load_data(args, meta, size, held_out)
    if held_out is not None:
        held, (split, seed) = torch.arange(len(labels)), held_out
    else:
        _, held, (split, seed) = split_indices(labels, args, meta, same, default=0.0)
    run_classes = meta.get("classes")
    if isinstance(run_classes, list) and run_classes != classes:
        raise ValueError(f"the data's classes ({', '.join(classes[:5])}, ...) differ from the ones the checkpoint "
                         f"was trained on ({', '.join(map(str, run_classes[:5]))}, ...)")
    if model.cfg.num_classes != len(classes):
        raise ValueError(f"the model has {model.cfg.num_classes} outputs but the data has {len(classes)} classes")
    evaluator = Evaluator(images[held], labels[held], batch_size=args.batch_size, device=device, flip=args.flip,
                          shift=args.shift, image_size=size, report_bins=args.bins)
    report = evaluator.run(model)
    where = "all examples" if split == 0 else f"held-out split ({split} examples, seed {seed})"
    if held_out is not None:
        where = f"the run's held-out shards (val_split {split}, seed {seed})"
    print(f"{args.checkpoint}: {report['n']} images, {where}", file=sys.stderr)
    print(f"top-1 {100 * report['top1']:.2f}%  top-5 {100 * report['top5']:.2f}%  "
          f"ECE ({args.bins} bins) {100 * report['ece']:.2f}%")
    worst = np.argsort([a if a is not None else 2.0 for a in report["per_class_accuracy"]])[:5]
    print("weakest classes: " + ", ".join(
        f"{classes[i]} {100 * report['per_class_accuracy'][i]:.1f}%" for i in worst
        if report["per_class_accuracy"][i] is not None))
    out: dict[str, Any] = {"top1": report["top1"], "top5": report["top5"], "n": report["n"], "flip": args.flip,
                           "shift": args.shift}
    if args.json:
        out.update(ece=report["ece"], classes=classes,
                   per_class_accuracy=dict(zip(classes, report["per_class_accuracy"])),
                   confusion_matrix=report["confusion_matrix"], split=split, split_seed=seed)
    print(json.dumps(out))
    return 0
