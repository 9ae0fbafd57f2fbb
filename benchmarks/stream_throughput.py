"""Images/s of the streamed pipeline alone (JPEG shards -> augmented 224-pixel batches) against
DataLoader workers, next to the images/s of a ViT-B/16 training step on the same machine.

    python -m benchmarks.stream_throughput [--images 768] [--workers 0,1,2] [--batch 64]   # from the repo root

1. Writes ``--images`` synthetic photographs-like JPEGs (smooth colour fields plus noise,
   about 500x375, quality 90: ImageNet's typical size and compression) into shards of 128
   with ``pack_shards``.
2. For each worker count, iterates ``vitlab.data.stream.StreamLoader`` with the paper's
   pre-training augmentation (inception crop 0.05-1, flip) at 224 pixels, batch ``--batch``,
   one warm-up batch excluded, and prints images/s.
3. Times ``--train-steps`` steps of ViT-B/16 (fp32, AdamW, batch ``--train-batch``) and prints
   its images/s: the pipeline keeps pace when its rate is above that.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402


def write_jpegs(root: Path, n: int, classes: int = 10) -> None:
    rng = np.random.default_rng(0)
    for i in range(n):
        folder = root / f"class{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        h, w = 375, 500
        yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
        base = np.stack([np.sin(6 * xx * rng.uniform(0.5, 2) + c) * np.cos(4 * yy * rng.uniform(0.5, 2) + c)
                         for c in range(3)], -1)
        pixels = np.clip(128 + 100 * base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.jpg", quality=90)


def pipeline_rate(shards: Path, workers: int, batch: int, batches: int) -> float:
    from vitlab.data.stream import StreamLoader, open_source
    from vitlab.data.transforms import TrainTransform, build_transform

    source = open_source(str(shards))
    transform = build_transform(TrainTransform(num_classes=len(source.classes), image_size=(224, 224),
                                               crop="inception", crop_scale=(0.05, 1.0), flip=True))
    loader = StreamLoader(source, batch, image_size=(224, 224), transform=transform, workers=workers,
                          shuffle_buffer=256)
    it = iter(loader)
    x, _ = next(it)  # warm-up: worker start, first shard opened
    assert x.shape == (batch, 3, 224, 224)
    t = time.monotonic()
    for _ in range(batches):
        next(it)
    return batches * batch / (time.monotonic() - t)


def vit_b16_rate(batch: int, steps: int) -> float:
    from vitlab.models.registry import build_model, get_config

    model = build_model(get_config("ViT-B/16", num_classes=1000)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(batch, 3, 224, 224), torch.randint(0, 1000, (batch,))

    def step() -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    t = time.monotonic()
    for _ in range(steps):
        step()
    return steps * batch / (time.monotonic() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=768)
    p.add_argument("--workers", default="0,1,2")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batches", type=int, default=8, help="timed batches per worker count")
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--train-steps", type=int, default=2)
    args = p.parse_args()
    from vitlab.data.shards import pack_shards

    results = {"cpu_count": os.cpu_count(), "load_avg_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as tmp:
        write_jpegs(Path(tmp) / "images", args.images)
        pack_shards(Path(tmp) / "images", Path(tmp) / "shards", samples_per_shard=128)
        for w in (int(v) for v in args.workers.split(",")):
            rate = pipeline_rate(Path(tmp) / "shards", w, args.batch, args.batches)
            results[f"pipeline_img_per_s_workers_{w}"] = round(rate, 1)
            print(f"pipeline, {w} worker(s): {rate:.1f} images/s", flush=True)
    rate = vit_b16_rate(args.train_batch, args.train_steps)
    results["vit_b16_train_img_per_s"] = round(rate, 2)
    results["load_avg_end"] = os.getloadavg()[0]
    print(f"ViT-B/16 training step (fp32, batch {args.train_batch}): {rate:.2f} images/s", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
