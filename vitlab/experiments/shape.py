"""Depth, width, MLP size and patch size scaled from one base model."""
from __future__ import annotations

from vitlab.analysis.cost import model_flops
from vitlab.analysis.plots import plot_lines
from vitlab.config import ViTConfig
from vitlab.experiments.common import train_vit, vit_overrides
from vitlab.experiments.tables import lines_of
from vitlab.models import create_model

TITLE = "scaling the model's shape: depth, width, MLP size, patch size"
PAPER = ("Fig. 8: depth helps most (up to 64 layers, diminishing after 16), width least; a smaller patch "
         "(longer sequence) helps without adding parameters")
SUMMARY = ("dimension", "value")
METRICS = ("val_top1", "gflops", "params_m", "steps", "wall_s")
QUICK = dict(steps=8)
# 8 models (base, depth/width/MLP x0.5 and x2, patch x0.5) x 3 seeds x 2 minutes = 48 minutes
DEFAULT = dict(img_size=32, val_split=5000, steps=100_000,
               time_limit=2.0, batch_size=128, lr=1e-3, width=128, depth=4, num_heads=2, mlp_dim=256, patch_size=4)


def variants(settings):
    yield "base", 1, {}
    for f in (0.5, 2):
        yield "depth", f, dict(depth=max(1, int(settings.depth * f)))
        yield "width", f, dict(width=int(settings.width * f), num_heads=max(1, int(settings.num_heads * f)))
        yield "mlp", f, dict(mlp_dim=int(settings.mlp_dim * f))
    yield "patch", 0.5, dict(patch_size=settings.patch_size // 2)


def run(settings, out):
    rows = []
    for seed in settings.new_seeds():
        for dim, f, change in variants(settings):
            over = vit_overrides(settings, **change)
            cfg = ViTConfig(**{k: v for k, v in over.items() if k != "name"}, num_classes=10)
            r = train_vit(settings, out / f"{dim}-{f}-s{seed}", seed, over)
            params = sum(p.numel() for p in create_model(cfg).parameters())
            rows.append(dict(dimension=dim, value=f, seed=seed, val_top1=r["val_top1"], gflops=model_flops(cfg) / 1e9,
                             params_m=params / 1e6, steps=r["steps"], wall_s=r["wall_s"]))
    return rows


def plot(table):
    base = [r for r in table if r["dimension"] == "base"]
    rows = table + [dict(b, dimension=d) for b in base for d in ("depth", "width", "mlp", "patch")]
    rows = [r for r in rows if r["dimension"] != "base"]
    return plot_lines(lines_of(rows, "gflops", "val_top1", "dimension"), "gflops", "val_top1",
                      "shape scaling from one base", logx=True)
