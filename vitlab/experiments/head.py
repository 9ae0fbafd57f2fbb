"""[class] token against global average pooling, at two learning rates."""
from __future__ import annotations

from vitlab.analysis.plots import plot_bars
from vitlab.experiments.common import train_vit, vit_overrides
from vitlab.experiments.tables import bars_of

TITLE = "classifier: [class] token vs global average pooling"
PAPER = ("Fig. 9: both reach the same accuracy, but GAP needs a lower learning rate "
         "(token 8e-4 and GAP 3e-4 match; GAP at 8e-4 is clearly worse)")
SUMMARY = ("classifier", "lr")
METRICS = ("val_top1", "steps", "wall_s")
QUICK = dict(steps=15, lrs=[3e-3, 1e-3])
# 4 settings x 3 seeds x 5 minutes = 60 minutes
DEFAULT = dict(img_size=32, val_split=5000, steps=100_000,
               time_limit=5.0, batch_size=128, lr=2e-3, width=192, depth=6, num_heads=3, mlp_dim=384, patch_size=4,
               lrs=[8e-4, 3e-4])
ARMS = dict(lrs="optim.lr")
UNUSED = dict(lr="each run's learning rate is one of lrs (--set lrs=[...])")


def run(settings, out):
    rows = []
    for seed in settings.new_seeds():
        for lr in settings.get("lrs"):
            for classifier in ("token", "gap"):
                r = train_vit(settings, out / f"{classifier}-{lr}-s{seed}", seed,
                              vit_overrides(settings, classifier=classifier), {"optim.lr": lr})
                rows.append(dict(classifier=classifier, lr=lr, seed=seed, val_top1=r["val_top1"],
                                 steps=r["steps"], wall_s=r["wall_s"]))
    return rows


def plot(table):
    return plot_bars(*bars_of(table, ["classifier", "lr"], "val_top1"), ylabel="val_top1", title="[class] token vs GAP")
