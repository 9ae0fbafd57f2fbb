"""How fast vitlab.data feeds a training loop on this machine.

    python -m benchmarks.data_throughput [--archive PATH] [--batches 40]   # from the repo root

1. Decodes the CIFAR-10 training archive into RAM with ``load_in_memory`` into a fresh
   cache folder (first-time cost), then loads it again (cached cost).
2. Measures images/s of ``BatchStream`` at batch 256 with the CIFAR training transforms,
   warm-up batches excluded.
3. Runs a stand-in training step (matmuls sized to >= 0.5 CPU-s per batch of 256, about
   what a small ViT costs here) fed with and without the background prefetch thread,
   in interleaved rounds, to see whether overlapping augmentation with compute pays.

The streamed pipeline (JPEG tar shards decoded and augmented in DataLoader workers) is
measured by ``benchmarks/stream_throughput.py``.

Wall time depends on what else runs on the machine, so CPU seconds and the load average
are printed alongside.

OMP_WAIT_POLICY defaults to PASSIVE here: with the cores shared by other processes,
OpenMP's default spin-waiting made small batch ops 20-30x slower (measured: RandAugment
on 256 CIFAR images 1.7 s instead of 0.06 s at load average 9).  Run with
OMP_WAIT_POLICY=ACTIVE to see the default behaviour.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch loads OpenMP

import argparse  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from vitlab.data import BatchStream, TrainTransform, build_transform, load_in_memory  # noqa: E402

DEFAULT_ARCHIVE = "../shared/data/cifar10/cifar10-train.tar.gz"


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the decoding pool)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn):
    wall, cpu = time.perf_counter(), cpu_seconds()
    result = fn()
    return result, time.perf_counter() - wall, cpu_seconds() - cpu


def images_per_second(stream: BatchStream, batches: int, warmup: int = 3) -> tuple[float, float]:
    """(images per wall second, images per CPU second) after ``warmup`` batches."""
    it = iter(stream)
    for _ in range(warmup):
        next(it)
    n = 0

    def run() -> None:
        nonlocal n
        for _ in range(batches):
            n += next(it)[0].shape[0]

    _, wall, cpu = timed(run)
    return n / wall, n / cpu


def fake_step(x: torch.Tensor, weight: torch.Tensor, repeats: int) -> None:
    """Stand-in for forward+backward: matmuls on all intra-op threads, like a real step."""
    h = x.flatten(1).float()
    for _ in range(repeats):
        h = torch.tanh(h @ weight)


def train_step_cost(stream: BatchStream, steps: int, weight: torch.Tensor, repeats: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) per fake training step fed by ``stream``."""
    it = iter(stream)
    fake_step(next(it)[0], weight, repeats)  # warm-up

    def run() -> None:
        for _ in range(steps):
            fake_step(next(it)[0], weight, repeats)

    _, wall, cpu = timed(run)
    return wall / steps, cpu / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archive", default=DEFAULT_ARCHIVE)
    parser.add_argument("--batches", type=int, default=40, help="timed batches per transform")
    parser.add_argument("--steps", type=int, default=6, help="timed fake training steps per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of prefetch=0 / prefetch=2")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, load average {os.getloadavg()[0]:.1f}")

    cache = tempfile.mkdtemp(prefix="vitlab-bench-")
    try:
        data, wall, cpu = timed(lambda: load_in_memory(args.archive, cache_dir=cache, workers=2))
        print(f"decode first time : {wall:6.2f} s wall, {cpu:6.2f} s CPU  -> {tuple(data.images.shape)}")
        data, wall, cpu = timed(lambda: load_in_memory(args.archive, cache_dir=cache, workers=2))
        print(f"decode cached     : {wall:6.2f} s wall, {cpu:6.2f} s CPU")
    finally:
        shutil.rmtree(cache, ignore_errors=True)

    configs = {
        "pad-crop 4 + flip + to_float": TrainTransform(num_classes=10, crop="pad"),
        "  + RandAugment(2, 9)": TrainTransform(num_classes=10, crop="pad", randaug_ops=2),
        "  + RandAugment + mixup/cutmix + smoothing 0.1 + erasing 0.25": TrainTransform(
            num_classes=10, crop="pad", randaug_ops=2, mixup_alpha=0.8, cutmix_alpha=1.0,
            label_smoothing=0.1, erase_prob=0.25),
        "inception crop 32 + flip + to_float": TrainTransform(num_classes=10, image_size=32),
    }
    for name, cfg in configs.items():
        stream = BatchStream(data.images, data.labels, 256, seed=0, transform=build_transform(cfg))
        wall, cpu = images_per_second(stream, args.batches)
        print(f"BatchStream b=256 {name:<62s}: {wall:7.0f} img/s wall, {cpu:7.0f} img per CPU-s")

    cfg = configs["  + RandAugment(2, 9)"]
    weight = torch.randn(3 * 32 * 32, 3 * 32 * 32) / 55.0
    repeats = 1
    while train_step_cost(BatchStream(data.images, data.labels, 256, seed=0), 1, weight, repeats)[1] < 0.5:
        repeats *= 2  # until a step costs >= 0.5 CPU-s, i.e. <= ~1000 img/s on 2 cores
    # Interleaved rounds, so that a change in the machine's load hits both settings alike.
    for _ in range(args.rounds):
        for prefetch in (0, 2):
            stream = BatchStream(data.images, data.labels, 256, seed=0, transform=build_transform(cfg),
                                 prefetch=prefetch)
            wall, cpu = train_step_cost(stream, args.steps, weight, repeats)
            print(f"fake step fed by the RandAugment stream, prefetch={prefetch}: {256 / wall:5.0f} img/s "
                  f"({wall * 1000:.0f} ms wall, {cpu * 1000:.0f} ms CPU per step)")


if __name__ == "__main__":
    main()
