"""Fine-tuning at a higher resolution than pre-training, and speed / largest batch against input size."""
from __future__ import annotations

import time

from vitlab.experiments.common import CIFAR, plot_lines, train_vit, vit_overrides

TITLE = "resolution: fine-tune at a higher resolution vs the same; speed and largest batch vs input size"
PAPER = ("Sec. 3.2: fine-tuning at a higher resolution than pre-training helps (Touvron et al.); "
         "Fig. 12: ViTs are as fast as ResNets of similar accuracy and their largest batch shrinks "
         "more slowly with input size (ViT-L/16 at 512 px still fits large batches)")
SUMMARY = ("part", "model", "img_size")
METRICS = ("val_top1", "img_per_s", "largest_batch")
QUICK = dict(steps=16, speed_models=["tiny"], speed_sizes=[16, 32], speed_batch=4, largest_limit=64)
# 3 seeds x (pre 8 + 2 fine-tunes x 6 minutes) ~ 60 minutes, plus the speed sweep (minutes)
DEFAULT = dict(data=CIFAR, img_size=32, val=5000, steps=100_000,
               batch=128, lr=2e-3, width=192, depth=6, heads=3, mlp=384, patch=4, pretrain_minutes=8.0,
               finetune_minutes=6.0, speed_models=["ViT-B/32", "ViT-B/16", "BiT-R50x1"], speed_sizes=[224, 288, 384],
               speed_batch=2, largest_limit=4096)


def run(s, out):
    rows = []
    big = s.get("finetune_size", s.img_size * 3 // 2)
    for seed in range(s.seeds):
        pre = train_vit(s, out / f"pretrain-s{seed}", seed, vit_overrides(s),
                        {"optim.steps": s.steps, "run.time_limit": s.get("pretrain_minutes", 0.0)})
        for size in (s.img_size, big):
            r = train_vit(s, out / f"finetune-{size}-s{seed}", seed, vit_overrides(s), {
                "model.init": pre["weights"], "model.overrides": {}, "model.img_size": size,
                "optim.optimizer": "sgd", "optim.momentum": 0.9, "optim.lr": 0.01, "optim.weight_decay": 0.0,
                "optim.steps": max(1, s.steps // 2), "run.time_limit": s.get("finetune_minutes", 0.0)})
            rows.append(dict(part="finetune", model=f"ViT/{s.patch} from {s.img_size}px", img_size=size, seed=seed,
                             val_top1=r["val_top1"]))
    rows += speed(s)
    return rows


def _build(name: str, size: int, s):
    import vitlab

    if name == "tiny":
        over = vit_overrides(s, img_size=size)
        over.pop("name")
        return vitlab.create_model(vitlab.ViTConfig(**over, num_classes=10))
    return vitlab.create_model(name, img_size=size, num_classes=1000)


def speed(s) -> list[dict]:
    """Inference images/s at a fixed batch, and (on CUDA) the largest batch whose forward fits."""
    import torch

    device = "cuda" if torch.cuda.is_available() and s.device in ("auto", "cuda") else "cpu"
    rows = []
    for name in s.get("speed_models"):
        for size in s.get("speed_sizes"):
            model = _build(name, size, s).to(device).eval()
            x = torch.randn(s.get("speed_batch"), 3, size, size, device=device)
            with torch.no_grad():
                model(x)
                if device == "cuda":
                    torch.cuda.synchronize()
                n, t0 = 0, time.perf_counter()
                while n < 3 or time.perf_counter() - t0 < 1.0:
                    model(x)
                    n += 1
                if device == "cuda":
                    torch.cuda.synchronize()
            ips = n * x.shape[0] / (time.perf_counter() - t0)
            if device == "cpu":
                ips /= max(1, torch.get_num_threads())  # the paper's img/sec/core
            rows.append(dict(part="speed", model=name, img_size=size, seed=0, img_per_s=ips, device=device,
                             largest_batch=largest_batch(model, size, device, s.get("largest_limit", 1024))
                             if device == "cuda" else None))
            del model
    return rows


def largest_batch(model, size: int, device: str, limit: int) -> int:
    """Doubling then bisection over real forward passes; an out-of-memory error means "does not fit"."""
    import torch

    def fits(b: int) -> bool:
        try:
            with torch.no_grad():
                model(torch.randn(b, 3, size, size, device=device))
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            torch.cuda.empty_cache()

    lo, hi = 0, 1
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > max(1, lo // 20):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def plot(table, path):
    return plot_lines([r for r in table if r["part"] == "speed"], "img_size", "img_per_s", "model", path,
                      "inference speed vs input size")
