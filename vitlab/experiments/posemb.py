"""Position embeddings: none / 1D / 2D / relative, added at the stem / every layer / every layer shared."""
from __future__ import annotations

from vitlab.analysis.plots import plot_bars
from vitlab.experiments.common import train_vit, vit_overrides
from vitlab.experiments.tables import bars_of

TITLE = "position embedding type and where it is added"
PAPER = ("Table 8 (ViT-B/16, ImageNet 5-shot linear): none 0.61382, 1D 0.64206, 2D 0.64001, relative 0.64032 "
         "at the stem; any embedding beats none by ~3 points, the kinds differ little")
SUMMARY = ("posemb", "place")
METRICS = ("val_top1", "steps", "wall_s")
QUICK = dict(steps=15)
# 8 settings x 3 seeds x 2.5 minutes = 60 minutes
DEFAULT = dict(img_size=32, val_split=5000, steps=100_000,
               time_limit=2.5, batch_size=128, lr=1e-3, width=192, depth=6, num_heads=3, mlp_dim=384, patch_size=4)
# relative embeddings are a bias inside every attention layer: only "stem" exists for them (as in Table 8)
SETTINGS = [("none", "stem")] + [(p, place) for p in ("learned_1d", "learned_2d")
                                 for place in ("stem", "every_layer", "every_layer_shared")] + [("relative", "stem")]


def run(settings, out):
    rows = []
    for seed in settings.new_seeds():
        for posemb, place in SETTINGS:
            over = vit_overrides(settings, posemb=posemb, posemb_place=place)
            r = train_vit(settings, out / f"{posemb}-{place}-s{seed}", seed, over)
            rows.append(dict(posemb=posemb, place=place, seed=seed, val_top1=r["val_top1"], steps=r["steps"],
                             wall_s=r["wall_s"]))
    return rows


def plot(table):
    return plot_bars(*bars_of(table, ["posemb", "place"], "val_top1"), ylabel="val_top1", title="position embeddings")
