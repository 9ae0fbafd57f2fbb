"""ViT against a BiT ResNet of similar cost, trained on growing subsets of the data."""
from __future__ import annotations

import sys
from typing import Sequence

import numpy as np

from vitlab.analysis.plots import plot_lines
from vitlab.config import ConfigError
from vitlab.data.splits import training_pool
from vitlab.eval.features import extract_features
from vitlab.eval.fewshot import fewshot_evaluate
from vitlab.experiments.common import (Settings, load_images, load_trained, split, stem, train_resnet, train_vit,
                                       vit_overrides)
from vitlab.experiments.tables import lines_of

TITLE = "ViT vs ResNet against pre-training data size: fine-tuned and linear few-shot accuracy"
PAPER = ("Fig. 3 and 4: ResNets win on small pre-training sets, ViT overtakes them from ~100M images "
         "(JFT subsets 9M-300M; ImageNet-21k vs ImageNet)")
SUMMARY = ("model", "examples")
METRICS = ("val_top1", "fewshot_5", "fewshot_10", "wall_s", "train_eflops")
QUICK = dict(sizes=[200, 600, 1400], steps=15, shots=[5, 10])
# 10 runs x 2 seeds x 600 steps: about 60 minutes on the 2-core CPU.  Bounded by steps, not
# minutes, so that every CPU trains the same runs and --resume can add seeds on another machine.
DEFAULT = dict(img_size=32, val_split=5000, seeds=2,
               sizes=[2000, 5000, 10000, 20000, 45000], steps=600, time_limit=0.0, batch_size=128, lr=2e-3,
               width=192, depth=6, num_heads=3, mlp_dim=384, patch_size=4, shots=[5, 10, 25])
# the ResNet baseline's units per stage (None: (1, 1, 1); (1,) on the digits) and width factor (None: 1; 0.5 on them)
OPTIONS = dict(resnet_layers=None, resnet_width=None)


def run(settings, out):
    images, labels, _ = load_images(settings)  # read once: every row's few-shot probe reads the same data
    total = len(labels)  # examples the data holds: the split's and the pool's
    over = [n for n in settings.get("sizes") if n + settings.val_split > total]
    if over:  # such a run trained on every example left and its row was labelled with the size asked
        raise ConfigError(f"experiment data-scale: sizes {over}: the data holds {total} examples, "
                          f"{total - settings.val_split} after val_split={settings.val_split}; sizes must not exceed that")
    shots = list(settings.get("shots", [5]))
    fits = fitting_shots(settings, labels, total, shots)
    left = not_evaluated(shots, fits)
    if left:  # evaluated at the rest; a k-shot column is blank at these sizes
        said = "; ".join(f"shots {ks} at {n} examples" for n, ks in left.items())
        print(f"data-scale: not evaluated, a pool's smallest class having fewer than k + 2 examples: {said}",
              file=sys.stderr)
    rows = []
    for seed in settings.new_seeds():
        for n in settings.get("sizes"):
            take = pool_size(settings, n, total)
            for model in ("ViT", "ResNet"):
                folder = out / f"{model}-{n}-s{seed}"
                if model == "ViT":
                    r = train_vit(settings, folder, seed, vit_overrides(settings), {"data.train_examples": take})
                else:
                    layers = settings.get("resnet_layers") or ((1,) if settings.digits else (1, 1, 1))
                    r = train_resnet(settings, folder, seed, stem(settings, layers, settings.get("resnet_width")),
                                     train_examples=take)
                accuracy = fewshot(load_trained(r), settings, images, labels, fits[n], take)
                rows.append(dict(model=model, examples=n, seed=seed, val_top1=r["val_top1"], steps=r["steps"],
                                 wall_s=r["wall_s"], train_eflops=r["train_eflops"], **accuracy))
    return rows


def pool_size(settings: Settings, n: int, total: int) -> int:
    """The data.train_examples of size ``n``'s runs (0: every example)."""
    return 0 if n + settings.val_split == total else n + settings.val_split


def smallest_class(settings: Settings, labels, train_examples: int = 0) -> int:
    """Examples of the smallest class in the few-shot pool of a run of ``train_examples``
    (``fewshot``'s: the training split of the run's pool)."""
    if train_examples:
        labels = labels[training_pool(labels, train_examples, 0)]
    train_idx, _ = split(settings, labels)
    return int(min(np.bincount(labels[train_idx].numpy())))


def fitting_shots(settings: Settings, labels, total: int, shots: Sequence[int]) -> dict:
    """size -> the ``shots`` its pool can evaluate: k-shot needs k + 2 examples of every class (k to
    fit, some held out).  Refused before any run where a size can evaluate none: that row had a
    few-shot figure at max(1, smallest // 3) shots, a count nobody asked for."""
    fits, smallest = {}, {}
    for n in settings.get("sizes"):
        smallest[n] = smallest_class(settings, labels, pool_size(settings, n, total))
        fits[n] = [k for k in shots if k + 2 <= smallest[n]]
    none = [n for n, f in fits.items() if not f]
    if none:
        most = ("" if len(none) == 1 else "at most ") + str(max(smallest[n] for n in none))
        raise ConfigError(f"experiment data-scale: sizes {none} can evaluate none of shots {list(shots)}: the "
                          f"smallest class of their few-shot pool has {most} examples "
                          "and a k-shot probe needs k + 2; give smaller shots or larger sizes")
    return fits


def not_evaluated(shots: Sequence[int], evaluated: dict) -> dict:
    """size -> the counts of ``shots`` not among ``evaluated[size]``, for the sizes that miss some: the one
    derivation of what ``run`` says before its runs (from ``fitting_shots``) and ``notes`` records (from the rows)."""
    left = {n: [k for k in shots if k not in done] for n, done in evaluated.items()}
    return {n: ks for n, ks in left.items() if ks}


def notes(settings: Settings, rows) -> dict:
    """results.json's record of the shot counts a size's pool was too small for (its columns blank)."""
    shots = settings.get("shots", [5])
    held = {n: {k for r in rows if r.get("examples") == n for k in shots if r.get(f"fewshot_{k}") is not None}
            for n in settings.get("sizes")}
    left = not_evaluated(shots, held)
    return dict(shots_not_evaluated={str(n): ks for n, ks in left.items()}) if left else {}


def fewshot(model, settings: Settings, images, labels, shots: Sequence[int] = (5,), train_examples: int = 0) -> dict:
    """Linear few-shot top-1 of frozen features of ``images`` (the experiment's data, ``load_images``):
    pool = the training split, evaluated on the held-out one.  Every shot count must fit the pool
    (``fitting_shots``)."""
    if train_examples:  # the run's pool, drawn as its data.train_examples drew it (the split's seed is 0)
        keep = training_pool(labels, train_examples, 0)
        images, labels = images[keep], labels[keep]
    train_idx, val_idx = split(settings, labels)
    model.eval()
    pool = extract_features(model, images[train_idx], image_size=settings.img_size)
    ev = extract_features(model, images[val_idx], image_size=settings.img_size)
    per_class = int(min(np.bincount(labels[train_idx].numpy())))
    if not shots or max(shots) + 2 > per_class:  # the run checks up front (fitting_shots)
        raise ValueError(f"shots={list(shots)}: the smallest class of the pool has {per_class} examples; "
                         "a k-shot probe needs k + 2")
    r = fewshot_evaluate(pool, labels[train_idx].numpy(), ev, labels[val_idx].numpy(), shots=shots, seeds=(0,),
                         holdout_per_class=min(10, max(1, per_class - max(shots) - 1)))
    return {f"fewshot_{k}": float(sum(v) / len(v)) for k, v in r.accuracy.items()}


def metrics(rows) -> list[str]:
    """METRICS with a few-shot column for every shot count the rows were evaluated at (``shots``, 5 and 10
    in METRICS): fixed, the default's 25-shot accuracy was in results.json's rows alone."""
    shots = sorted({int(k.split("_", 1)[1]) for r in rows for k in r if k.startswith("fewshot_")})
    return ["val_top1", *(f"fewshot_{k}" for k in shots), "wall_s", "train_eflops"]


def plot(table):
    return plot_lines(lines_of(table, "examples", "val_top1", "model"), "examples", "val_top1",
                      "accuracy vs training examples", logx=True)
