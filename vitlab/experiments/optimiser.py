"""Adam against SGD with momentum for the ResNet baseline."""
from __future__ import annotations

from vitlab.analysis.plots import plot_bars
from vitlab.experiments.common import stem, train_resnet
from vitlab.experiments.tables import bars_of

TITLE = "Adam vs SGD for the ResNet baseline"
PAPER = ("Table 7 (BiT ResNets pre-trained on JFT, few-shot and fine-tuned transfer): Adam pre-training "
         "transfers better than SGD on average, which is why the paper pre-trains ResNets with Adam")
SUMMARY = ("optimizer", "lr")
METRICS = ("val_top1", "wall_s")
QUICK = dict(steps=20, settings=[["adam", 3e-3], ["sgd", 0.05]])
# 4 runs x 3 seeds x 5 minutes = 60 minutes
DEFAULT = dict(img_size=32, val_split=5000, steps=100_000,
               time_limit=5.0, batch_size=128, settings=[["adam", 1e-3], ["adam", 3e-3], ["sgd", 0.03], ["sgd", 0.1]])
# the ResNet's units per stage (None: (1, 3, 2) on CIFAR, (1, 1) on the digits)
OPTIONS = dict(resnet_layers=None)
_RESNET = "it trains a ResNet, whose units per stage are resnet_layers (--set resnet_layers=[...])"
ARMS = dict(settings=("optim.optimizer", "optim.lr"))
UNUSED = dict(lr="each run's optimiser and learning rate are one of settings (--set 'settings=[[\"sgd\", 0.1]]')",
              width=_RESNET, depth=_RESNET, num_heads=_RESNET, mlp_dim=_RESNET, patch_size=_RESNET)


def run(settings, out):
    resnet = stem(settings, settings.get("resnet_layers") or ((1, 1) if settings.digits else (1, 3, 2)))
    rows = []
    for seed in settings.new_seeds():
        for opt, lr in settings.get("settings"):
            r = train_resnet(settings, out / f"{opt}-{lr}-s{seed}", seed, resnet, optimizer=opt, lr=lr)
            rows.append(dict(optimizer=opt, lr=lr, seed=seed, val_top1=r["val_top1"], wall_s=r["wall_s"]))
    return rows


def plot(table):
    return plot_bars(*bars_of(table, ["optimizer", "lr"], "val_top1"), ylabel="val_top1", title="ResNet: Adam vs SGD")
