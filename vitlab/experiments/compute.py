"""ViT, R+ViT hybrid and ResNet at matched training FLOPs.

Every model trains with AdamW at the experiment's lr, as the paper's Fig. 5 models share one
optimiser.  ``ViT+Muon`` is the same ViT with the plain-ViT CIFAR recipe's optimiser and starting
points (``cifar10_scratch:model=vit``: Muon on the blocks' matrices, the patch embedding whitened,
the position table from sin-cos), without the recipe's 24-px phase so that every step costs the
same: it asks how much of the ViT's gap at a given compute is its optimisation.  Its budget counts
Muon's orthogonalisation as well as the forward and backward passes, so it trains fewer steps."""
from __future__ import annotations

import dataclasses

from vitlab.analysis.cost import model_flops
from vitlab.analysis.plots import plot_lines
from vitlab.config import ResNetConfig, ViTConfig
from vitlab.configs.cifar10_scratch import LEARNING_RATES, OPTIMIZERS, PATCH_INITS, POSEMB_INITS
from vitlab.experiments.common import (hybrid_overrides, optimiser_flops_per_step, stem, train_resnet, train_vit,
                                       vit_overrides)
from vitlab.experiments.tables import lines_of

TITLE = "accuracy against total training compute (FLOPs as `vitlab flops` counts them)"
PAPER = ("Fig. 5: at equal pre-training compute ViT beats ResNets (2-4x less compute for the same "
         "transfer accuracy); hybrids lead at small budgets, the gap vanishes for larger models")
SUMMARY = ("model", "budget")
METRICS = ("val_top1", "train_eflops", "steps", "wall_s")
QUICK = dict(budgets=[10, 30], steps=30)
# budgets in steps of the plain ViT; 4 models x 3 budgets x 3 seeds; step-bounded, not time-limited:
# about 40 minutes per seed on a 2-core Zen 4 (31 for the three AdamW models)
DEFAULT = dict(img_size=32, val_split=5000, budgets=[150, 300, 600],
               steps=600, batch_size=128, lr=2e-3, width=192, depth=6, num_heads=3, mlp_dim=384, patch_size=4)
# the ResNet's units per stage (None: (1, 3, 2) on CIFAR, (1, 1) on the digits)
OPTIONS = dict(resnet_layers=None)
UNUSED = dict(steps="each model's steps are its budget's (--set budgets=[...], in steps of the plain ViT, "
                    "converted by training FLOPs)",
              time_limit="the runs are bounded by their budgets' FLOPs, not by time (--set budgets=[...])")


def architecture(overrides_or_resnet, resnet: bool = False):
    """The ViTConfig (or ResNetConfig) of an experiment model's overrides, for counting its FLOPs."""
    if resnet:
        return ResNetConfig(**dict(overrides_or_resnet, num_classes=10))
    d = dict(overrides_or_resnet)
    d.pop("name", None)
    if isinstance(d.get("resnet"), dict):
        d["resnet"] = ResNetConfig(**d["resnet"])
    return ViTConfig(**d, num_classes=10)


def forward_flops(overrides_or_resnet, resnet: bool = False) -> int:
    return model_flops(architecture(overrides_or_resnet, resnet))


def vit_muon_changes() -> dict:
    """The plain-ViT recipe's optimiser, lr and starting points, as ``train_config`` changes."""
    return {"optim.optimizer": OPTIMIZERS["vit"], "optim.lr": LEARNING_RATES["vit"],
            "model.patch_init": PATCH_INITS["vit"], "model.posemb_init": POSEMB_INITS["vit"]}


def run(settings, out):
    vit, hybrid = vit_overrides(settings), hybrid_overrides(settings, depth=max(1, settings.depth // 2))
    resnet = stem(settings, settings.get("resnet_layers") or ((1, 1) if settings.digits else (1, 3, 2)))
    forward = {"ViT": forward_flops(vit), "ViT+Muon": forward_flops(vit), "R+ViT": forward_flops(hybrid),
               "ResNet": forward_flops(resnet, True)}
    # training FLOPs per image: 3 x forward (the paper's count), plus Muon's orthogonalisation
    cost = {model: 3 * f for model, f in forward.items()}
    cost["ViT+Muon"] += optimiser_flops_per_step(architecture(vit), "muon") / settings.batch_size
    rows = []
    for seed in range(settings.seeds):
        for budget in settings.get("budgets"):
            for model, c in cost.items():
                if settings.has_row(model=model, budget=budget, seed=seed):
                    continue
                steps = max(1, round(budget * cost["ViT"] / c))
                sub = dataclasses.replace(settings, steps=steps, time_limit=0.0)  # shares reused and earlier_rows
                folder = out / f"{model}-{budget}-s{seed}"
                if model == "ResNet":
                    r = train_resnet(sub, folder, seed, resnet)
                elif model == "ViT+Muon":
                    r = train_vit(sub, folder, seed, vit, vit_muon_changes())  # its train_eflops count Muon
                else:
                    r = train_vit(sub, folder, seed, vit if model == "ViT" else hybrid)
                rows.append(dict(model=model, budget=budget, seed=seed, steps=r["steps"], val_top1=r["val_top1"],
                                 train_eflops=r["train_eflops"], wall_s=r["wall_s"], gflops_per_image=forward[model] / 1e9))
    return rows


def plot(table):
    return plot_lines(lines_of(table, "train_eflops", "val_top1", "model"), "train_eflops", "val_top1",
                      "accuracy vs training exaFLOPs", logx=True)
