"""`vitlab fewshot`: linear few-shot accuracy of a frozen model (paper Sec. 4.1, "Metrics").

    vitlab fewshot runs/b16/model.safetensors --data cifar10-train.tar.gz --shots 1 5 10 25 --seeds 3

The representation of every image is computed once and cached (in memory and in
``--feature-cache``), so any sweep over shots, seeds and regularisers reuses it.  The
evaluation split is the run's validation split (a streamed run's held-out shards; or
``--val-split``, default 10%), or, for a run that validated on a set of its own
(``data.val_data``) and without ``--data`` or ``--val-split``, that set whole; the k shots and
the held-out examples that choose the regulariser come from the rest (the run's training data).  The
output is a table; with ``--json``, one JSON line instead.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vitlab.cli import add_weights_arguments, load_weights, weights_read
from vitlab.cli.eval import add_data_arguments, unread_note


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="weights: vitlab .safetensors/dir, official .npz, timm, HF")
    add_weights_arguments(p)
    add_data_arguments(p, default_split="the training run's, else 0.1")
    p.add_argument("--shots", type=int, nargs="+", default=[1, 5, 10, 25], help="examples per class")
    p.add_argument("--seeds", type=int, default=3, help="random draws of the shots per shot count")
    p.add_argument("--holdout-per-class", type=int, default=10,
                   help="training examples per class, disjoint from the shots, that choose the regulariser")
    p.add_argument("--standardize", action="store_true",
                   help="scale each feature to unit variance over the shots before the fit, as big_vision's few-shot "
                        "evaluator does (default: the features as they are)")
    p.add_argument("--feature-cache", default=None,
                   help="folder for cached features (default: <cache-dir>/features); 'none' keeps them in memory only")
    p.add_argument("--json", action="store_true",
                   help="print one JSON line (per-seed accuracies and regularisers) instead of the table")


def run(args: argparse.Namespace) -> int:
    from vitlab.analysis.report import read_run_meta
    from vitlab.data.labelled import load_held_out
    from vitlab.eval.features import extract_features
    from vitlab.eval.fewshot import check_shots, fewshot_evaluate
    from vitlab.train.legacy import recorded_section
    from vitlab.train.resolve import resolve_scoring, resolved_threads

    check_flags(args)
    resolved = resolve_scoring(args.device, fast_path=False)  # features of the plain model
    device = resolved.device
    model = load_weights(args, args.checkpoint).to(device).eval()
    size = tuple(model.cfg.img_size)
    meta = read_run_meta(args.checkpoint)
    data = load_held_out(recorded_section(meta.get("recipe"), "data"), size, args.data, args.val_split,
                         args.split_seed, default_split=0.1, cache_dir=args.cache_dir, workers=resolved.decode_workers,
                         results=meta.get("results"), run_name=args.checkpoint)
    rest, held = data.rest.numpy(), data.held.numpy()
    if len(rest) == 0:
        raise ValueError("--val-split=0 leaves no training pool; few-shot needs a held-out evaluation split")
    y = (data.labels if data.label_sets is None else data.label_sets).numpy()  # a multi-label set's: refused
    check_shots(y[rest], args.shots, args.holdout_per_class, ("--shots", "--holdout-per-class"), y[held])

    cache = feature_cache(args)
    key = ("representation", FEATURES_VERSION, weights_key(args.checkpoint, weights_read(args)), size, data.key)
    with resolved_threads(resolved):
        feats = cache.get(key, lambda: extract_features(model, data.images, args.batch_size, device=device))
    source = "cache" if cache.hits else f"{len(data.images)} images"
    print(f"features {feats.shape[1]}-d from {source}; pool {len(rest)}, evaluation {len(held)} "
          f"({data.held_part()}), {len(data.classes)} classes{unread_note(data.skipped)}", file=sys.stderr)
    result = fewshot_evaluate(feats[rest], y[rest], feats[held], y[held], shots=args.shots, seeds=range(args.seeds),
                              holdout_per_class=args.holdout_per_class, standardize=args.standardize)
    if args.json:
        print(json.dumps({"fewshot": result.to_dict(), "seeds": args.seeds, "standardize": args.standardize,
                          "split": data.split, "val_data": data.val_data,
                          "split_seed": data.seed, "feature_dim": int(feats.shape[1]), "skipped_images": data.skipped}))
        return 0
    print_table(result)
    return 0


def check_flags(args: argparse.Namespace) -> None:
    """What can be refused before the model is loaded and the features extracted."""
    from vitlab.config import need_output_folder

    if args.seeds < 1:
        raise ValueError(f"--seeds={args.seeds}: must be >= 1")
    if args.feature_cache not in (None, "none"):
        need_output_folder("--feature-cache", args.feature_cache)


# bump when what a checkpoint's features are changes, for the same files: 2, a Hugging Face or timm
# source's input scaling is taken into the weights as they load (features cached before were of the
# weights fed vitlab's scaling)
FEATURES_VERSION = 2


def weights_key(checkpoint: str, read: dict | None = None) -> str:
    """What the features of ``checkpoint`` are cached under: its file's or folder's ``file_key``; a
    Hub name's, that of the snapshot it names now (one folder per revision): the name alone stays
    the same when the cache holds a newer revision, and the earlier one's features were read back.
    With how they are read where that is given (``read``: ``--weights-img-size``, ``--num-heads``, ``--name``):
    a table of 16 positions read as 2x8 or as 4x4 gives other features at the same image size, and so do
    other heads."""
    from vitlab.eval.features import file_key
    from vitlab.weights.hub import resolve_hub_name

    path = Path(checkpoint)
    key = file_key(path if path.exists() else resolve_hub_name(checkpoint) or checkpoint)
    return f"{key} read with {sorted(read.items())}" if read else key


def feature_cache(args: argparse.Namespace):
    """Where the features are kept: ``--feature-cache``, else <cache-dir>/features; in memory only for 'none'."""
    from vitlab.data.sources import default_cache_dir
    from vitlab.eval.features import FeatureCache

    if args.feature_cache == "none":
        return FeatureCache()
    base = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
    return FeatureCache(args.feature_cache or base / "features")


def print_table(result) -> None:
    """Accuracy (mean ± sd over the seeds) per shot count, each seed's, and the regularisers chosen."""
    import numpy as np

    print(f"{'shots':>5}  {'accuracy (mean ± sd)':>20}  per seed   [l2 chosen on held-out training examples]")
    for k in result.shots:
        per_seed = " ".join(f"{100 * a:.1f}" for a in result.accuracy[k])
        l2s = " ".join(f"2^{np.log2(v):.0f}" for v in result.l2[k])
        print(f"{k:>5}  {100 * result.mean(k):11.2f} ± {100 * result.std(k):5.2f}%  {per_seed}   [{l2s}]")
