"""`vitlab fewshot`: linear few-shot accuracy of a frozen model (paper Sec. 4.1, "Metrics").

    vitlab fewshot runs/b16/model.safetensors --data cifar10-train.tar.gz --shots 1 5 10 25 --seeds 3

The representation of every image is computed once and cached (in memory and in
``--feature-cache``), so any sweep over shots, seeds and regularisers reuses it.  The
evaluation split is the run's validation split (or ``--val-split``, default 10%); the
k shots and the held-out examples that choose the regulariser come from the rest.  The
output is a table; with ``--json``, one JSON line instead.
"""
from __future__ import annotations

import argparse
import json
import sys

from vitlab.cli.eval import add_data_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="weights: vitlab .safetensors/dir, official .npz, timm, HF")
    add_data_arguments(p, default_split="the training run's, else 0.1")
    p.add_argument("--shots", type=int, nargs="+", default=[1, 5, 10, 25], help="examples per class")
    p.add_argument("--seeds", type=int, default=3, help="random draws of the shots per shot count")
    p.add_argument("--holdout-per-class", type=int, default=10,
                   help="training examples per class, disjoint from the shots, that choose the regulariser")
    p.add_argument("--feature-cache", default=None,
                   help="folder for cached features (default: <cache-dir>/features); 'none' keeps them in memory only")
    p.add_argument("--json", action="store_true",
                   help="print one JSON line (per-seed accuracies and regularisers) instead of the table")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import numpy as np

    from vitlab.cli.eval import load_checkpoint, load_data, model_input_size, pick_device, split_indices, unread_note
    from vitlab.data.sources import default_cache_dir
    from vitlab.eval.features import FeatureCache, extract_features, file_key
    from vitlab.eval.fewshot import fewshot_evaluate

    if args.seeds < 1:
        raise ValueError(f"--seeds={args.seeds}: must be >= 1")
    device = pick_device(args.device)
    model, meta = load_checkpoint(args.checkpoint, args.img_size, device)
    size = model_input_size(model)
    images, labels, classes, data_key, same, skipped = load_data(args, meta, size)
    rest, held, (split, seed) = split_indices(labels, args, meta, same, default=0.1)
    if len(rest) == 0:
        raise ValueError("--val-split=0 leaves no training pool; few-shot needs a held-out evaluation split")

    if args.feature_cache == "none":
        cache = FeatureCache()
    else:
        base = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
        cache = FeatureCache(args.feature_cache or base / "features")
    key = ("representation", file_key(args.checkpoint), size, data_key)
    feats = cache.get(key, lambda: extract_features(model, images, args.batch_size, device=device))
    source = "cache" if cache.hits else f"{len(images)} images"
    print(f"features {feats.shape[1]}-d from {source}; pool {len(rest)}, evaluation {len(held)} "
          f"(split {split}, seed {seed}), {len(classes)} classes{unread_note(skipped)}", file=sys.stderr)

    y = labels.numpy()
    result = fewshot_evaluate(feats[rest.numpy()], y[rest.numpy()], feats[held.numpy()], y[held.numpy()],
                              shots=args.shots, seeds=range(args.seeds), holdout_per_class=args.holdout_per_class)
    if args.json:
        print(json.dumps({"fewshot": result.to_dict(), "seeds": args.seeds, "split": split, "split_seed": seed,
                          "feature_dim": int(feats.shape[1]), "skipped_images": skipped}))
        return 0
    print(f"{'shots':>5}  {'accuracy (mean ± sd)':>20}  per seed   [l2 chosen on held-out training examples]")
    for k in result.shots:
        per_seed = " ".join(f"{100 * a:.1f}" for a in result.accuracy[k])
        l2s = " ".join(f"2^{np.log2(v):.0f}" for v in result.l2[k])
        print(f"{k:>5}  {100 * result.mean(k):11.2f} ± {100 * result.std(k):5.2f}%  {per_seed}   [{l2s}]")
    return 0
