"""Pre-train on five classes, fine-tune on the other five at a higher resolution, against scratch."""
from __future__ import annotations

from vitlab.analysis.plots import plot_bars
from vitlab.experiments.common import hybrid_overrides, train_vit
from vitlab.experiments.tables import bars_of

TITLE = "pre-train on five classes, fine-tune on the other five at 1.5x the resolution"
PAPER = ("Sec. 3.2 / 4.2: pre-training then fine-tuning at a higher resolution (position embeddings "
         "interpolated) beats training on the target task alone")
SUMMARY = ("run", "classes", "img_size")
METRICS = ("val_top1", "steps", "wall_s")
QUICK = dict(steps=20, val_split=200)
# results/transfer/transfer_cifar5.json was measured with this model (by experiments/transfer_cifar5.py, now this);
# 3 seeds x (10 + 5 + 5) minutes = 60 minutes
DEFAULT = dict(img_size=32, val_split=2500, steps=100_000,
               batch_size=256, lr=2e-3, pretrain_minutes=10.0, finetune_minutes=5.0, finetune_lr=0.01,
               model=dict(img_size=32, width=192, depth=6, num_heads=3, mlp_dim=384, gelu="exact", patch_size=1,
                          resnet=dict(layers=(1, 1), img_size=32), name="R8x1+ViT-CIFAR/1"))
# the fine-tuning resolution (None: 1.5x img_size)
OPTIONS = dict(finetune_size=None)
_MINUTES = ("pretrain_minutes and finetune_minutes are the runs' minutes "
            "(--set pretrain_minutes=... --set finetune_minutes=...; 0: bounded by steps)")


def unused(values: dict) -> dict:
    """The settings the runs do not read (``vitlab.experiments.unread``): time_limit; where the setting
    ``model`` pins the architecture (the full form), those ``hybrid_overrides`` builds it from otherwise,
    its resolution among them."""
    found = dict(time_limit=_MINUTES)
    model = values.get("model")
    if model:
        pinned = (f"the setting model pins the architecture ({model.get('name', 'its model')} at "
                  f"{model.get('img_size', values.get('img_size'))} px; finetune_size sets the fine-tuning's)")
        found.update({key: pinned for key in ("img_size", "width", "depth", "num_heads", "mlp_dim", "patch_size")})
    return found


CIFAR_FIRST = ("airplane", "automobile", "bird", "cat", "deer")
CIFAR_SECOND = ("dog", "frog", "horse", "ship", "truck")


def run(settings, out):
    digits = (("0", "1", "2", "3", "4"), ("5", "6", "7", "8", "9"))
    first, second = digits if settings.digits else (CIFAR_FIRST, CIFAR_SECOND)
    model = settings.get("model") or hybrid_overrides(settings)
    pre_size = model.get("img_size", settings.img_size)  # a pinned model's own: the pre-training's resolution
    big = settings.get("finetune_size") or pre_size * 3 // 2
    pre_min, ft_min = settings.get("pretrain_minutes", 0.0), settings.get("finetune_minutes", 0.0)
    ft_steps = max(1, settings.steps // 2) if not ft_min else settings.steps
    crop = {} if settings.digits else {"augment.crop": "pad", "augment.crop_pad": 6}
    rows = []
    for seed in settings.new_seeds():
        pre = train_vit(settings, out / f"pretrain-s{seed}", seed, model,
                        {"data.class_subset": first, "run.time_limit": pre_min})
        ft = train_vit(settings, out / f"finetune-s{seed}", seed, model, {
            "data.class_subset": second, "model.img_size": big, "model.overrides": {},
            "model.init": pre["weights"], "optim.optimizer": "sgd", "optim.momentum": 0.9,
            "optim.lr": settings.get("finetune_lr", 0.01 if not settings.digits else 0.03), "optim.weight_decay": 0.0,
            "optim.steps": ft_steps, "run.time_limit": ft_min, **crop})
        scratch = train_vit(settings, out / f"scratch-s{seed}", seed, model, {
            "data.class_subset": second, "model.img_size": big, "optim.steps": ft_steps, "run.time_limit": ft_min,
            **crop})
        for name, r, classes, size in (("pretrain", pre, first, pre_size), ("finetune", ft, second, big),
                                       ("scratch", scratch, second, big)):
            rows.append(dict(run=name, classes=",".join(classes), img_size=size, seed=seed, val_top1=r["val_top1"],
                             steps=r["steps"], wall_s=r["wall_s"]))
    return rows


def plot(table):
    return plot_bars(*bars_of(table, ["run", "img_size"], "val_top1"), ylabel="val_top1",
                     title="transfer to the other five classes")
