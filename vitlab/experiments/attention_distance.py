"""Mean attention distance per head against depth, for ViT and for the hybrid."""
from __future__ import annotations

from vitlab.analysis.attention import effective_patch_size, model_attention_distance, patch_distances
from vitlab.analysis.plots import plot_distance_by_layer
from vitlab.data import stratified_sample
from vitlab.experiments.common import hybrid_overrides, load_images, load_trained, split, train_vit, vit_overrides

TITLE = "mean attention distance per head against network depth"
PAPER = ("Fig. 7 right, Fig. 11: some heads attend globally already in the lowest layers, others locally; "
         "the distance grows with depth; in the hybrid the lowest layers' local heads disappear")
SUMMARY = ("model", "layer")
METRICS = ("mean_distance", "min_head", "max_head", "uniform", "val_top1")
QUICK = dict(steps=15, images=64)
# the measurement's version (results.json's "version"; --resume takes no rows of another): 2, the probe
# drawn from every class (1, before: the held-out split's first images)
VERSION = 2
# 2 runs x 3 seeds x 10 minutes = 60 minutes
DEFAULT = dict(img_size=32, val_split=5000, steps=100_000,
               time_limit=10.0, batch_size=128, lr=1e-3, width=192, depth=6, num_heads=3, mlp_dim=384, patch_size=4,
               images=512)


def probe_indices(settings, labels):
    """The ``images`` held-out images the distances are measured on, drawn class-stratified (seed 0)
    from the held-out split, or all of it.  Not its first ones: a folder's images come class by class
    and the split's indices are sorted, so those were CIFAR-10's 500 held-out airplanes and 12 automobiles."""
    _, val_idx = split(settings, labels)
    count = settings.get("images", 64)
    return val_idx[stratified_sample(labels[val_idx], count, 0, "images")] if count < len(val_idx) else val_idx


def run(settings, out):
    images, labels, _ = load_images(settings)
    probe = images[probe_indices(settings, labels)].float() / 127.5 - 1
    rows = []
    for seed in settings.new_seeds():
        for name, over in (("ViT", vit_overrides(settings)), ("R+ViT", hybrid_overrides(settings))):
            r = train_vit(settings, out / f"{name}-s{seed}", seed, over)
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


def plot(table):
    models = {}
    for name in ("ViT", "R+ViT"):
        rs = [r for r in table if r["model"] == name]
        if rs:
            models[name] = ([r["layer"] for r in rs], [r["mean_distance"] for r in rs], [r["min_head"] for r in rs],
                            [r["max_head"] for r in rs], rs[0].get("uniform"))
    return plot_distance_by_layer(models)
