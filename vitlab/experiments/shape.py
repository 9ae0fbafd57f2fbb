"""Depth, width, MLP size and patch size scaled from one base model."""
from __future__ import annotations

from vitlab.experiments.common import CIFAR, plot_lines, train_vit, vit_overrides

TITLE = "scaling the model's shape: depth, width, MLP size, patch size"
PAPER = ("Fig. 8: depth helps most (up to 64 layers, diminishing after 16), width least; a smaller patch "
         "(longer sequence) helps without adding parameters")
SUMMARY = ("dimension", "value")
METRICS = ("val_top1", "gflops", "params_m", "steps", "wall_s")
QUICK = dict(steps=8)
# 8 models (base, depth/width/MLP x0.5 and x2, patch x0.5) x 3 seeds x 2 minutes = 48 minutes
DEFAULT = dict(data=CIFAR, img_size=32, val=5000, steps=100_000,
               minutes=2.0, batch=128, lr=1e-3, width=128, depth=4, heads=2, mlp=256, patch=4)


def variants(s):
    yield "base", 1, {}
    for f in (0.5, 2):
        yield "depth", f, dict(depth=max(1, int(s.depth * f)))
        yield "width", f, dict(width=int(s.width * f), num_heads=max(1, int(s.heads * f)))
        yield "mlp", f, dict(mlp_dim=int(s.mlp * f))
    yield "patch", 0.5, dict(patch_size=s.patch // 2)


def run(s, out):
    from vitlab.analysis.cost import model_flops
    from vitlab.config import ViTConfig

    rows = []
    for seed in s.new_seeds():
        for dim, f, change in variants(s):
            over = vit_overrides(s, **change)
            cfg = ViTConfig(**{k: v for k, v in over.items() if k != "name"}, num_classes=10)
            r = train_vit(s, out / f"{dim}-{f}-s{seed}", seed, over)
            params = sum(p.numel() for p in __import__("vitlab").create_model(cfg).parameters())
            rows.append(dict(dimension=dim, value=f, seed=seed, val_top1=r["val_top1"], gflops=model_flops(cfg) / 1e9,
                             params_m=params / 1e6, steps=r["steps"], wall_s=r["wall_s"]))
    return rows


def plot(table, path):
    base = [r for r in table if r["dimension"] == "base"]
    rows = table + [dict(b, dimension=d) for b in base for d in ("depth", "width", "mlp", "patch")]
    rows = [r for r in rows if r["dimension"] != "base"]
    return plot_lines(rows, "gflops", "val_top1", "dimension", path, "shape scaling from one base", logx=True)
