"""Masked patch prediction pre-training then fine-tuning, against scratch at equal total time."""
from __future__ import annotations

from vitlab.experiments.common import CIFAR, plot_bars, train_vit, vit_overrides

TITLE = "masked patch prediction (self-supervised) pre-training vs training from scratch"
PAPER = ("Sec. 4.6: MPP pre-training of ViT-B/16 on JFT gives 79.9% ImageNet, +2% over scratch "
         "but 4% below supervised pre-training")
SUMMARY = ("run",)
METRICS = ("val_top1", "wall_s", "steps")
QUICK = dict(steps=20)
# 3 seeds x (MPP 6 + fine-tune 4 minutes, then scratch 10 minutes) = 60 minutes
DEFAULT = dict(data=CIFAR, img_size=32, val=5000, steps=100_000,
               batch=128, lr=2e-3, width=192, depth=6, heads=3, mlp=384, patch=4, pretrain_minutes=6.0,
               finetune_minutes=4.0)


def run(s, out):
    pre_min, ft_min = s.get("pretrain_minutes", 0.0), s.get("finetune_minutes", 0.0)
    half = max(1, s.steps // 2)
    rows = []
    for seed in range(s.seeds):
        pre = train_vit(s, out / f"mpp-s{seed}", seed, vit_overrides(s), {
            "model.mpp": s.get("target", "color"), "model.mpp_rate": 0.5, "optim.steps": half,
            "run.time_limit": pre_min})
        ft = train_vit(s, out / f"finetune-s{seed}", seed, vit_overrides(s), {
            "model.init": pre["weights"], "model.overrides": {}, "optim.steps": s.steps - half,
            "run.time_limit": ft_min})
        scratch = train_vit(s, out / f"scratch-s{seed}", seed, vit_overrides(s), {
            "run.time_limit": pre_min + ft_min})
        rows.append(dict(run="mpp+finetune", seed=seed, val_top1=ft["val_top1"], wall_s=pre["wall_s"] + ft["wall_s"],
                         steps=pre["steps"] + ft["steps"]))
        rows.append(dict(run="scratch", seed=seed, val_top1=scratch["val_top1"], wall_s=scratch["wall_s"],
                         steps=scratch["steps"]))
    return rows


def plot(table, path):
    return plot_bars(table, ["run"], "val_top1", path, "MPP pre-training vs scratch, equal total time")
