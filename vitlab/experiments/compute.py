"""ViT, R+ViT hybrid and ResNet at matched training FLOPs."""
from __future__ import annotations

from vitlab.experiments.common import (CIFAR, hybrid_overrides, plot_lines, stem, train_resnet, train_vit,
                                       vit_overrides)

TITLE = "accuracy against total training compute (FLOPs as `vitlab flops` counts them)"
PAPER = ("Fig. 5: at equal pre-training compute ViT beats ResNets (2-4x less compute for the same "
         "transfer accuracy); hybrids lead at small budgets, the gap vanishes for larger models")
SUMMARY = ("model", "budget")
METRICS = ("val_top1", "train_eflops", "steps", "wall_s")
QUICK = dict(budgets=[10, 30], steps=30)
# budgets in steps of the plain ViT; 3 models x 3 budgets x 3 seeds; step-bounded, not time-limited: untimed (estimate ~60 minutes)
DEFAULT = dict(data=CIFAR, img_size=32, val=5000, budgets=[150, 300, 600],
               steps=600, batch=128, lr=2e-3, width=192, depth=6, heads=3, mlp=384, patch=4)


def forward_flops(overrides_or_resnet, resnet: bool = False) -> int:
    from vitlab.analysis.cost import model_flops
    from vitlab.config import ResNetConfig, ViTConfig

    if resnet:
        return model_flops(ResNetConfig(**dict(overrides_or_resnet, num_classes=10)))
    d = dict(overrides_or_resnet)
    d.pop("name", None)
    if isinstance(d.get("resnet"), dict):
        d["resnet"] = ResNetConfig(**d["resnet"])
    return model_flops(ViTConfig(**d, num_classes=10))


def run(s, out):
    vit, hybrid = vit_overrides(s), hybrid_overrides(s, depth=max(1, s.depth // 2))
    resnet = stem(s, s.get("resnet_layers", (1, 1) if s.digits else (1, 3, 2)))
    cost = {"ViT": forward_flops(vit), "R+ViT": forward_flops(hybrid), "ResNet": forward_flops(resnet, True)}
    rows = []
    for seed in s.new_seeds():
        for budget in s.get("budgets"):
            for model, c in cost.items():
                steps = max(1, round(budget * cost["ViT"] / c))
                sub = type(s)(**{**s.__dict__, "steps": steps, "minutes": 0.0})
                folder = out / f"{model}-{budget}-s{seed}"
                if model == "ResNet":
                    r = train_resnet(sub, folder, seed, resnet)
                else:
                    r = train_vit(sub, folder, seed, vit if model == "ViT" else hybrid)
                rows.append(dict(model=model, budget=budget, seed=seed, steps=r["steps"], val_top1=r["val_top1"],
                                 train_eflops=r["train_eflops"], wall_s=r["wall_s"], gflops_per_image=c / 1e9))
    return rows


def plot(table, path):
    return plot_lines(table, "train_eflops", "val_top1", "model", path, "accuracy vs training exaFLOPs", logx=True)
