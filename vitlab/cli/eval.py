"""`vitlab eval`: top-1/top-5, per-class accuracy, confusion matrix and calibration of a checkpoint.

    vitlab eval --checkpoint runs/c10/model.safetensors --data cifar10-train.tar.gz --val-split 5000

Without ``--val-split`` the split of the checkpoint's training run is used when the
run's ``config.json`` sits beside the checkpoint and names the same data; otherwise the
whole data set is evaluated.  The run's split is refused where the data no longer counts the
examples the run's ``summary.json`` recorded (changed since: another split, which can hold
images the run trained on); ``--val-split`` then scores a split of the user's choosing.  Without ``--data``, a run that validated on a set of its
own (``data.val_data``) is scored on that set.  The numbers come from ``vitlab.eval.Evaluator``, the
evaluator the trainer runs.  The output is a few lines to read; with ``--json``, one JSON
line of every metric instead.  ``--compile`` scores through ``vitlab.fast.compile_for_inference``.
The data and its split come from ``vitlab.data.labelled.load_held_out``.  Each class of the data
is scored as the output of its name where the checkpoint names its classes (``classes.json``,
a Hugging Face ``id2label``): the data may hold them in another order, or some of them.  A
multi-label set (JFT-style shards) is scored by precision@1, big_vision's prec@1: the share of
images whose top-1 class is one of their labels (not their first label's top-1), with no
top-5, per-class accuracy or calibration.

``fewshot`` shares this command's data flags (``add_data_arguments``) and its note on unreadable images.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from vitlab.cli import add_img_size_argument, add_weights_arguments, load_weights, positive_count

from .train import add_fast_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="weights: vitlab .safetensors/dir, official .npz, timm, HF")
    add_weights_arguments(p)
    add_data_arguments(p, default_split="the training run's, else 0 (the whole set)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON line of every metric (per class, confusion, ECE) instead of the summary")
    p.add_argument("--bins", type=int, default=15, help="confidence bins of the expected calibration error")
    p.add_argument("--flip", action="store_true",
                   help="test-time flip: average each image's predicted probabilities with its mirror image's")
    p.add_argument("--shift", type=shift_pixels, default=0, metavar="PIXELS",
                   help="test-time translations: also average over each view shifted by PIXELS along each axis, "
                        "both ways (reflection fills the border, as the training pad-and-crop); several sizes "
                        "comma-separated (2,1); 0: none")
    p.add_argument("--diagonal", action="store_true",
                   help="with --shift: also the four diagonal translations of each size (the 3x3 grid of positions); "
                        "the summary gives the top-1 of each smaller set of views the larger one holds")
    p.add_argument("--compile", action="store_true",
                   help="score through vitlab.fast.compile_for_inference (frozen weights; CUDA graphs on a GPU): "
                        "the same scores, faster on a large set after a compilation of tens of seconds; a failed "
                        "compilation warns and runs eager")
    add_fast_argument(p)


def shift_pixels(text: str) -> int | tuple[int, ...]:
    """--shift's value: a number of pixels, or several comma-separated (checked against the
    images' size once the model is read)."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected pixels, e.g. 2, or sizes such as 2,1") from None
    return sizes[0] if len(sizes) == 1 else sizes


def check_diagonal(args: argparse.Namespace) -> None:
    """--diagonal names translations of --shift's sizes: refused without them, before any work."""
    from vitlab.config import ConfigError

    if args.diagonal and not args.shift:
        raise ConfigError("--diagonal adds diagonal translations of --shift's sizes: give --shift too, e.g. --shift 2")


def add_data_arguments(p: argparse.ArgumentParser, default_split: str) -> None:
    p.add_argument("--data", help="ImageFolder folder, .tar/.tar.gz archive, tar shards (a folder, "
                                  "'shards/shard-{000000..000009}.tar' or 'shards/*.tar'), a Hugging Face save_to_disk "
                                  "folder, parquet files, or 'digits' (default: the run's data; a run that validated "
                                  "on a set of its own, data.val_data, is scored on that set)")
    add_img_size_argument(p, "evaluation resolution; position embeddings are resampled")
    p.add_argument("--val-split", type=float, default=None,
                   help=f"held-out examples: a count, a fraction < 1, or 0 for all (default: {default_split})")
    p.add_argument("--split-seed", type=int, default=None,
                   help="seed of the stratified split (default: the run's, else 0)")
    p.add_argument("--batch-size", type=positive_count, default=128, help="images a forward pass (default: 128)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--cache-dir", default=None,
                   help="where decoded data sets are cached (default: the run's data.cache_dir, else ~/.cache/vitlab)")


def unread_note(skipped: int) -> str:
    """What a summary line adds where images were left out as unreadable (the warnings name them)."""
    return f"; {skipped} unreadable image(s) left out (see the warnings)" if skipped else ""


# ----------------------------------------------------------------------------- the command


def run(args: argparse.Namespace) -> int:
    from vitlab import fast
    from vitlab.analysis.report import recorded_loss
    from vitlab.data.labelled import load_held_out
    from vitlab.eval import Evaluator
    from vitlab.eval.features import check_tta_shift
    from vitlab.eval.metrics import check_num_bins
    from vitlab.train.legacy import recorded_section
    from vitlab.train.resolve import resolve_scoring, resolved_threads
    from vitlab.weights import read_class_names

    check_num_bins(args.bins, "--bins")  # before the checkpoint and the data are read
    check_diagonal(args)
    meta = trained_run_meta(args.checkpoint)
    resolved = resolve_scoring(args.device, fast_path=args.fast is not False)
    device = resolved.device
    model = load_weights(args, args.checkpoint).to(device).eval()
    if resolved.kernels is not None:
        fast.optimize(model, resolved.kernels)  # bf16 weights cast in each call: no copy held beside the model
    size = tuple(model.cfg.img_size)
    check_tta_shift(args.shift, size, "--shift")
    # a streamed run's held-out shards (pool=False): only those are decoded
    data = load_held_out(recorded_section(meta.get("recipe"), "data"), size, args.data, args.val_split,
                         args.split_seed, default_split=0.0, cache_dir=args.cache_dir, pool=False,
                         workers=resolved.decode_workers, results=meta.get("results"), run_name=args.checkpoint)
    # labels by name, as the model's outputs: a folder's classes in another order, or some of them
    labels, classes = data.held_for_model(meta.get("classes"), model.cfg.num_classes, read_class_names(args.checkpoint))
    # a multi-label set's labels (N, L) are scored by precision@1, which has no per-class report; the views
    # are averaged and ECE binned in the probabilities the run trained (a sigmoid_xent run's, class by class)
    evaluator = Evaluator(data.images[data.held], labels, batch_size=args.batch_size, device=device,
                          flip=args.flip, shift=args.shift, diagonal=args.diagonal, image_size=size,
                          loss=recorded_loss(meta), report_bins=None if labels.ndim == 2 else args.bins)
    # one batch shape (the last batch padded), compiled once; the views of test-time augmentation share it
    forward = fast.compile_for_inference(model, batch_size=args.batch_size, eager_on_failure=True) \
        if args.compile else None
    with resolved_threads(resolved):  # as a run's: PyTorch's own count counts no container's CPU quota
        report = evaluator.run(model, forward)
    print(f"{args.checkpoint}: {report['n']} images, {scored_part(data)}{unread_note(data.skipped)}", file=sys.stderr)
    print_report(args, report, data, classes)
    return 0


def trained_run_meta(checkpoint) -> dict:
    """What the checkpoint's run left beside it (``read_run_meta``), read before the checkpoint
    itself: a run that trained no classifier (masked patch prediction) is refused."""
    from vitlab.analysis.report import read_run_meta
    from vitlab.eval.evaluator import check_trained_classifier
    from vitlab.train.legacy import recorded_section

    meta = read_run_meta(checkpoint)
    check_trained_classifier(recorded_section(meta.get("recipe"), "model"), checkpoint)
    return meta


def scored_part(data) -> str:
    """The part of the set scored, in words: a fraction ("50% of 1797 examples") is no count."""
    if data.run_shards:
        return f"the run's held-out shards (val_split {data.split}, seed {data.seed})"
    if data.split == 0:
        return "all examples"
    part = f"{100 * data.split:g}%" if isinstance(data.split, float) else f"{data.split}"
    return f"held-out split ({part} of {len(data.labels)} examples, seed {data.seed})"


def print_report(args: argparse.Namespace, report: dict[str, Any], data, classes: list[str]) -> None:
    """The metrics: one JSON line with ``--json``, else the summary and the weakest classes (``classes``:
    the names of the model's outputs)."""
    import numpy as np

    if "prec1" in report:  # a multi-label set (``vitlab.eval.Evaluator``)
        print_multi_label_report(args, report, data, classes)
        return
    if args.json:
        print(json.dumps({"top1": report["top1"], "top5": report["top5"], "n": report["n"], "flip": args.flip,
                          "shift": args.shift, "diagonal": args.diagonal, "top1_views": report.get("top1_views"),
                          "ece": report["ece"], "classes": classes,
                          "per_class_accuracy": dict(zip(classes, report["per_class_accuracy"])),
                          "confusion_matrix": report["confusion_matrix"], "split": data.split,
                          "split_seed": data.seed, "skipped_images": data.skipped}))
        return
    print(f"top-1 {100 * report['top1']:.2f}%  top-5 {100 * report['top5']:.2f}%  "
          f"ECE ({args.bins} bins) {100 * report['ece']:.2f}%")
    if "top1_views" in report:
        print("top-1 by test-time views: " + ", ".join(
            f"{count} {100 * top1:.2f}%" for count, top1 in report["top1_views"].items()))
    worst = np.argsort([a if a is not None else 2.0 for a in report["per_class_accuracy"]])[:5]
    print("weakest classes: " + ", ".join(
        f"{classes[i]} {100 * report['per_class_accuracy'][i]:.1f}%" for i in worst
        if report["per_class_accuracy"][i] is not None))


def print_multi_label_report(args: argparse.Namespace, report: dict[str, Any], data, classes: list[str]) -> None:
    """A multi-label set's metrics: precision@1, the share of images whose top-1 class is one of
    their labels (big_vision's prec@1; no image has one label to count a top-1, a top-5, a
    per-class accuracy or a calibration against)."""
    if args.json:
        print(json.dumps({"prec1": report["prec1"], "n": report["n"], "flip": args.flip, "shift": args.shift,
                          "diagonal": args.diagonal, "prec1_views": report.get("prec1_views"), "classes": classes,
                          "split": data.split, "split_seed": data.seed, "skipped_images": data.skipped}))
        return
    print(f"prec@1 {100 * report['prec1']:.2f}% (multi-label: the top-1 class is one of the image's labels)")
    if "prec1_views" in report:
        print("prec@1 by test-time views: " + ", ".join(
            f"{count} {100 * prec1:.2f}%" for count, prec1 in report["prec1_views"].items()))
