"""The learned position embeddings' similarity for different patch sizes and learning rates."""
from __future__ import annotations

import numpy as np

from vitlab.analysis.embeddings import position_similarity
from vitlab.analysis.plots import plot_bars, plot_position_similarity
from vitlab.experiments.common import load_trained, train_vit, vit_overrides
from vitlab.experiments.tables import bars_of

TITLE = "learned position-embedding similarity across patch sizes and learning rates"
PAPER = ("Fig. 7 centre, Fig. 10: the embeddings learn the 2D grid (near patches similar, row/column "
         "structure); the structure is clearer for some patch sizes and learning rates than others")
SUMMARY = ("patch", "lr")
METRICS = ("val_top1", "near", "far", "locality")
QUICK = dict(steps=8, patches=[2, 4], lrs=[3e-3, 1e-3])
# 4 runs x 3 seeds x 5 minutes = 60 minutes
DEFAULT = dict(img_size=32, val_split=5000, steps=100_000,
               time_limit=5.0, batch_size=128, width=192, depth=6, num_heads=3, mlp_dim=384, patches=[4, 8],
               lrs=[2e-3, 5e-4])
ARMS = dict(lrs="optim.lr", patches="model.patch_size")
UNUSED = dict(lr="each run's learning rate is one of lrs (--set lrs=[...])",
              patch_size="each run's patch size is one of patches (--set patches=[...])")


def locality(sim: np.ndarray) -> tuple[float, float]:
    """Mean cosine similarity to the 4-neighbours and to patches >= half the grid away."""
    gh, gw = sim.shape[:2]
    near, far = [], []
    for i in range(gh):
        for j in range(gw):
            for a in range(gh):
                for b in range(gw):
                    d = abs(a - i) + abs(b - j)
                    if d == 1:
                        near.append(sim[i, j, a, b])
                    elif d >= max(gh, gw) // 2 + 1 or (max(gh, gw) <= 2 and d == 2):
                        far.append(sim[i, j, a, b])
    return float(np.mean(near)), float(np.mean(far)) if far else float("nan")


def run(settings, out):
    rows = []
    for seed in settings.new_seeds():
        for patch in settings.get("patches"):
            for lr in settings.get("lrs"):
                folder = out / f"p{patch}-lr{lr}-s{seed}"
                r = train_vit(settings, folder, seed, vit_overrides(settings, patch_size=patch), {"optim.lr": lr})
                sim = position_similarity(load_trained(r))
                np.save(folder / "position_similarity.npy", sim)
                # seed 0's map is also kept beside the table: runs/ is scratch, not kept in git
                kept = [out.parent / f"similarity-p{patch}-lr{lr}.png"] if seed == 0 else []
                _figure(sim, [folder / "position_similarity.png", *kept], f"patch {patch}, lr {lr}, seed {seed}")
                near, far = locality(sim)
                rows.append(dict(patch=patch, lr=lr, seed=seed, val_top1=r["val_top1"], near=near, far=far,
                                 locality=near - far, similarity=str(folder / "position_similarity.npy")))
    return rows


def _figure(sim, paths, title: str):
    try:
        fig = plot_position_similarity(sim)
        fig.axes[0].set_title(f"Position embedding similarity: {title}", fontsize=10)
        for path in paths:
            fig.savefig(path, dpi=90)
    except ImportError:
        pass


def plot(table):
    return plot_bars(*bars_of(table, ["patch", "lr"], "locality"), ylabel="locality",
                     title="near minus far position-embedding similarity")
