"""Fine-tuning at a higher resolution than pre-training, and speed / largest batch against
input size (the paper's Figure 12; the measuring is in ``speed``).

    vitlab experiment resolution                      # both parts
    vitlab experiment resolution --set parts=speed    # Figure 12 alone
    vitlab experiment resolution --set parts=speed --device cuda --set speed_budget_gib=40

Settings of the speed part (``--set KEY=VALUE``): speed_models, speed_sizes (default 224 288
384 448 512 on a CPU, 224 320 384 448 512 on CUDA), speed_batch (default 2 on a CPU, 32 on
CUDA), speed_budget_gib (default 8 on a CPU, all of the GPU's memory on CUDA), speed_search
(on a CPU, search over real runs instead of extrapolating), speed_tolerance (the search's
relative precision), speed_repeats and speed_seconds (timed repeats, each at least that
long), largest_limit (the largest batch reported).
"""
from __future__ import annotations

import os

from vitlab.experiments import speed
from vitlab.experiments.common import CIFAR, plot_bars, train_vit, vit_overrides

TITLE = "fine-tune at a higher resolution vs the same; speed and largest batch vs input size"
PAPER = ("Sec. 3.2: fine-tuning at a higher resolution than pre-training helps (Touvron et al.); "
         "Fig. 12: ViTs are as fast as ResNets of similar accuracy and their largest batch shrinks "
         "more slowly with input size (ViT-L/16 at 512 px still fits large batches)")
SUMMARY = ("part", "model", "img_size", "method")
METRICS = ("val_top1", "img_per_s", "largest_batch")
QUICK = dict(steps=16, speed_models=["tiny"], speed_sizes=[16, 32], speed_batch=4, speed_repeats=1,
             speed_seconds=0.0, largest_limit=64)
# 3 seeds x (pre 8 + 2 fine-tunes x 6 minutes) ~ 60 minutes, then the speed sweep: a fresh
# process per model and size, and on a CPU a second one for the memory probe
DEFAULT = dict(data=CIFAR, img_size=32, val=5000, steps=100_000,
               batch=128, lr=2e-3, width=192, depth=6, heads=3, mlp=384, patch=4, pretrain_minutes=8.0,
               finetune_minutes=6.0, parts=["finetune", "speed"],
               speed_models=["ViT-B/32", "ViT-B/16", "ViT-L/16", "BiT-R50x1", "BiT-R152x2"], speed_sizes=None,
               speed_batch=None, speed_budget_gib=None, speed_search=False, speed_tolerance=0.05, speed_repeats=3,
               speed_seconds=1.0, largest_limit=speed.LIMIT)
PARTS = ("finetune", "speed")


def run(s, out):
    parts = s.get("parts", PARTS)
    parts = parts.split(",") if isinstance(parts, str) else list(parts)
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"parts={parts!r}: allowed parts are {', '.join(PARTS)}")
    rows = []
    if "finetune" in parts:
        rows += finetune(s, out)
    if "speed" in parts:
        rows += speed_sweep(s)
    return rows


def finetune(s, out) -> list[dict]:
    rows = []
    big = s.get("finetune_size", s.img_size * 3 // 2)
    for seed in s.new_seeds():
        pre = train_vit(s, out / f"pretrain-s{seed}", seed, vit_overrides(s),
                        {"optim.steps": s.steps, "run.time_limit": s.get("pretrain_minutes", 0.0)})
        for size in (s.img_size, big):
            r = train_vit(s, out / f"finetune-{size}-s{seed}", seed, vit_overrides(s), {
                "model.init": pre["weights"], "model.overrides": {}, "model.img_size": size,
                "optim.optimizer": "sgd", "optim.momentum": 0.9, "optim.lr": 0.01, "optim.weight_decay": 0.0,
                "optim.steps": max(1, s.steps // 2), "run.time_limit": s.get("finetune_minutes", 0.0)})
            rows.append(dict(part="finetune", model=f"ViT/{s.patch} from {s.img_size}px", img_size=size, seed=seed,
                             method="SGD fine-tune, held-out top-1", val_top1=r["val_top1"]))
    return rows


def speed_sweep(s) -> list[dict]:
    """Figure 12's measurements, one row per model and input size (``speed.sweep``)."""
    import torch

    device = "cuda" if torch.cuda.is_available() and (s.device == "auto" or s.device.startswith("cuda")) else "cpu"
    cpu = device == "cpu"
    sizes = s.get("speed_sizes") or ([224, 288, 384, 448, 512] if cpu else [224, 320, 384, 448, 512])
    configs = {name: _config_maker(name, s) for name in s.get("speed_models")}
    return speed.sweep(configs, sizes, device, batch=s.get("speed_batch") or (2 if cpu else 32),
                       budget=speed.memory_budget(device, s.get("speed_budget_gib")),
                       threads=s.threads or (os.cpu_count() if cpu else None), repeats=s.get("speed_repeats", 3),
                       min_seconds=s.get("speed_seconds", 1.0), search=s.get("speed_search", False),
                       tolerance=s.get("speed_tolerance", 0.05), limit=s.get("largest_limit", speed.LIMIT))


def _config_maker(name: str, s):
    """size -> config: a registered model, or "tiny", the experiment's own small ViT."""
    if name != "tiny":
        return lambda size: speed.model_config(name, size)
    from vitlab.config import ViTConfig

    def tiny(size: int):
        over = vit_overrides(s, img_size=size)
        over.pop("name")
        return ViTConfig(**over, num_classes=10)

    return tiny


def plot(table, path):
    """Figure 12's two panels when the speed part ran; the fine-tuning accuracies as bars when it
    alone ran, or beside Figure 12 as ``finetune.png`` when both did."""
    tuned, timed = [r for r in table if r["part"] == "finetune"], [r for r in table if r["part"] == "speed"]
    bars = path.with_name("finetune.png") if timed else path
    drawn = plot_bars(tuned, ["img_size"], "val_top1", bars, "fine-tuned at each size (px), pre-trained at the first") \
        if tuned else None
    return speed.plot(timed, path) if timed else drawn
