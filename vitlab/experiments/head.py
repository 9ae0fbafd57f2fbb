"""[class] token against global average pooling, at two learning rates."""
from __future__ import annotations

from vitlab.experiments.common import CIFAR, plot_bars, train_vit, vit_overrides

TITLE = "classifier: [class] token vs global average pooling"
PAPER = ("Fig. 9: both reach the same accuracy, but GAP needs a lower learning rate "
         "(token 8e-4 and GAP 3e-4 match; GAP at 8e-4 is clearly worse)")
SUMMARY = ("classifier", "lr")
METRICS = ("val_top1", "steps", "wall_s")
QUICK = dict(steps=15, lrs=[3e-3, 1e-3])
# 4 settings x 3 seeds x 5 minutes = 60 minutes
DEFAULT = dict(data=CIFAR, img_size=32, val=5000, steps=100_000,
               minutes=5.0, batch=128, lr=2e-3, width=192, depth=6, heads=3, mlp=384, patch=4, lrs=[8e-4, 3e-4])


def run(s, out):
    rows = []
    for seed in s.new_seeds():
        for lr in s.get("lrs"):
            for classifier in ("token", "gap"):
                r = train_vit(s, out / f"{classifier}-{lr}-s{seed}", seed, vit_overrides(s, classifier=classifier),
                              {"optim.lr": lr})
                rows.append(dict(classifier=classifier, lr=lr, seed=seed, val_top1=r["val_top1"],
                                 steps=r["steps"], wall_s=r["wall_s"]))
    return rows


def plot(table, path):
    return plot_bars(table, ["classifier", "lr"], "val_top1", path, "[class] token vs GAP")
