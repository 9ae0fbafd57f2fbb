"""Mean attention distance per head against depth, for ViT and for the hybrid."""
from __future__ import annotations

from vitlab.experiments.common import (CIFAR, hybrid_overrides, load_images, load_trained, split, train_vit,
                                       vit_overrides)

TITLE = "mean attention distance per head against network depth"
PAPER = ("Fig. 7 right, Fig. 11: some heads attend globally already in the lowest layers, others locally; "
         "the distance grows with depth; in the hybrid the lowest layers' local heads disappear")
SUMMARY = ("model", "layer")
METRICS = ("mean_distance", "min_head", "max_head", "uniform", "val_top1")
QUICK = dict(steps=15, images=64)
# 2 runs x 3 seeds x 10 minutes = 60 minutes
DEFAULT = dict(data=CIFAR, img_size=32, val=5000, steps=100_000,
               minutes=10.0, batch=128, lr=1e-3, width=192, depth=6, heads=3, mlp=384, patch=4, images=512)


def run(s, out):
    from vitlab.analysis.attention import effective_patch_size, model_attention_distance, patch_distances

    images, labels, _ = load_images(s)
    _, val_idx = split(s, labels)
    probe = images[val_idx[: s.get("images", 64)]].float() / 127.5 - 1
    rows = []
    for seed in s.new_seeds():
        for name, over in (("ViT", vit_overrides(s)), ("R+ViT", hybrid_overrides(s))):
            r = train_vit(s, out / f"{name}-s{seed}", seed, over)
            model = load_trained(r)
            dist = model_attention_distance(model, probe)  # (layers, heads) in pixels
            # the distance of a head that attends to every patch alike: the yardstick for "local" and "global"
            grid = tuple(model.patch_grid(tuple(probe.shape[-2:])))
            uniform = float(patch_distances(grid, effective_patch_size(model)).mean())
            for layer, heads in enumerate(dist):
                rows.append(dict(model=name, layer=layer + 1, seed=seed, mean_distance=float(heads.mean()),
                                 min_head=float(heads.min()), max_head=float(heads.max()),
                                 uniform=uniform, heads=[float(h) for h in heads], val_top1=r["val_top1"]))
    return rows


def plot(table, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, marker in (("ViT", "o"), ("R+ViT", "s")):
        rs = [r for r in table if r["model"] == name]
        line, = ax.plot([r["layer"] for r in rs], [r["mean_distance"] for r in rs], marker=marker, label=f"{name} mean")
        ax.fill_between([r["layer"] for r in rs], [r["min_head"] for r in rs], [r["max_head"] for r in rs], alpha=0.2)
        if rs and rs[0].get("uniform"):
            ax.axhline(rs[0]["uniform"], color=line.get_color(), linestyle="--", linewidth=1,
                       label=f"{name}: uniform attention")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("layer")
    ax.set_ylabel("mean attention distance (pixels)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
