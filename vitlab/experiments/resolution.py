"""Fine-tuning at a higher resolution than pre-training, against fine-tuning at the same.

    vitlab experiment resolution

The paper's Figure 12 (inference speed and the largest batch against input size), once this
experiment's second part, is a benchmark: ``python benchmarks/figure12.py``.  The setting
``parts`` stays for the commands recorded with ``--set parts=finetune``.
"""
from __future__ import annotations

from vitlab.analysis.plots import plot_bars
from vitlab.experiments.common import train_vit, vit_overrides
from vitlab.experiments.tables import bars_of

TITLE = "fine-tune at a higher resolution vs the same"
PAPER = "Sec. 3.2: fine-tuning at a higher resolution than pre-training helps (Touvron et al.)"
SUMMARY = ("part", "model", "img_size", "method")
METRICS = ("val_top1",)
QUICK = dict(steps=16)
# 3 seeds x (pre 8 + 2 fine-tunes x 6 minutes) ~ 60 minutes
DEFAULT = dict(img_size=32, val_split=5000, steps=100_000, batch_size=128, lr=2e-3, width=192, depth=6, num_heads=3,
               mlp_dim=384, patch_size=4, pretrain_minutes=8.0, finetune_minutes=6.0)
# the fine-tuning resolution (None: 1.5x img_size); parts: "finetune", the only part left
OPTIONS = dict(finetune_size=None, parts="finetune")
UNUSED = dict(time_limit="pretrain_minutes and finetune_minutes are the runs' minutes "
                         "(--set pretrain_minutes=... --set finetune_minutes=...; 0: bounded by steps)")


def run(settings, out):
    parts = settings.get("parts")
    if (parts.split(",") if isinstance(parts, str) else list(parts)) != ["finetune"]:
        raise ValueError(f"parts={parts!r}: the resolution experiment is its fine-tuning part alone; Figure 12's "
                         "speed sweep is python benchmarks/figure12.py")
    return finetune(settings, out)


def finetune(settings, out) -> list[dict]:
    rows = []
    big = settings.get("finetune_size") or settings.img_size * 3 // 2
    for seed in settings.new_seeds():
        pre = train_vit(settings, out / f"pretrain-s{seed}", seed, vit_overrides(settings),
                        {"optim.steps": settings.steps, "run.time_limit": settings.get("pretrain_minutes", 0.0)})
        for size in (settings.img_size, big):
            r = train_vit(settings, out / f"finetune-{size}-s{seed}", seed, vit_overrides(settings), {
                "model.init": pre["weights"], "model.overrides": {}, "model.img_size": size,
                "optim.optimizer": "sgd", "optim.momentum": 0.9, "optim.lr": 0.01, "optim.weight_decay": 0.0,
                "optim.steps": max(1, settings.steps // 2), "run.time_limit": settings.get("finetune_minutes", 0.0)})
            rows.append(dict(part="finetune", model=f"ViT/{settings.patch_size} from {settings.img_size}px",
                             img_size=size, seed=seed, method="SGD fine-tune, held-out top-1", val_top1=r["val_top1"]))
    return rows


def plot(table):
    return plot_bars(*bars_of(table, ["img_size"], "val_top1"), ylabel="val_top1",
                     title="fine-tuned at each size (px), pre-trained at the first")
