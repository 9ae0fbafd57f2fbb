"""Images/s per CPU core of the streamed training pipeline, at the code before and now, in one run.

    python -m benchmarks.data_throughput --before 4ae3fb8      # from the repo root; about 3 minutes on 2 cores
    python -m benchmarks.data_throughput --rounds 1 --images 384 --batches 4   # a quick check of the machinery
    python -m benchmarks.data_throughput --gather 15 --batch 128 --before REV       # the training process's cost per batch

1. Writes ``--images`` ImageNet-like JPEGs (500x375, quality 90: smooth colour fields plus
   sensor noise; ImageNet's typical size and compression) of 100 classes and packs them into
   tar shards of 128 (the shard format is the same at every revision).
2. For each revision ("now": this checkout; ``--before REV``: that revision's ``vitlab/``,
   extracted with ``git archive`` into a temporary folder, as ``bench.py --before`` does) and
   each worker count (1, and every usable core), a fresh process iterates that revision's
   ``StreamLoader`` with the paper's pre-training augmentation (inception crop of 5-100% of
   the area, flip, scaling to [-1, 1]) at 224 pixels, batch ``--batch``, on the CPU, until
   float batches ready for the model come out.  Warm-up batches are left out.
3. The list runs ``--rounds`` times, the revisions alternating, so that a change in the
   machine's load falls on both; a figure is the median over the rounds.

Reported per (revision, workers), from the CPU time of the processes (``/proc``):

* ``img_per_reader_cpu_s``: images per CPU-second of the DataLoader workers: the rate one
  core sustains, what a GPU run asks of its CPU (the figure FFCV publishes).  Before, the
  workers also augmented and scaled to float; now that work is the device's;
* ``img_per_cpu_s``: per CPU-second of the workers and the training process together: the
  cost when the device is this CPU (as here, where the "device" work runs on it too);
* ``img_per_s``: wall-clock images/s.

The last line is one JSON object with these and the ratios now / before.  Run it on a quiet
machine: every core is used.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import checkout, cpu_name
from vitlab.machine import usable_cores

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# run in a fresh process with PYTHONPATH at the revision's checkout: prints one JSON line
MEASURE = r"""
import inspect, json, os, sys, time
import torch
torch.set_num_threads(1)
from vitlab.data.stream import StreamLoader, open_source
from vitlab.data.transforms import TrainTransform, build_transform

shards, workers, batch, batches, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
source = open_source(shards)
augment = TrainTransform(num_classes=len(source.classes), image_size=(224, 224), crop="inception",
                         crop_scale=(0.05, 1.0), flip=True)
if "augment" in inspect.signature(StreamLoader).parameters:
    loader = StreamLoader(source, batch, augment=augment, workers=workers, shuffle_buffer=256)
else:  # before the readers made the crops: the whole transform ran in the workers
    loader = StreamLoader(source, batch, image_size=(224, 224), transform=build_transform(augment), workers=workers,
                          shuffle_buffer=256)
TICK = os.sysconf("SC_CLK_TCK")

def cpu_seconds():
    '''(utime + stime of this process, of every process under it: the DataLoader workers).'''
    pids, seconds = [os.getpid()], []
    while pids:
        pid = pids.pop()
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            seconds.append((int(fields[11]) + int(fields[12])) / TICK)
            for task in os.listdir(f"/proc/{pid}/task"):
                pids += [int(p) for p in open(f"/proc/{pid}/task/{task}/children").read().split()]
        except (OSError, ValueError):
            pass
    return seconds[0], sum(seconds[1:])

it = iter(loader)
for _ in range(warmup):
    x, y = next(it)
assert x.shape == (batch, 3, 224, 224) and x.dtype == torch.float32, (x.shape, x.dtype)
wall, (own, readers) = time.perf_counter(), cpu_seconds()
for _ in range(batches):
    x, y = next(it)
wall, (own_after, readers_after) = time.perf_counter() - wall, cpu_seconds()
own, readers, n = own_after - own, readers_after - readers, batch * batches
print(json.dumps({"img_per_s": n / wall, "img_per_cpu_s": n / (own + readers),
                  "img_per_reader_cpu_s": n / readers if workers else None}))
"""


# the training process's own cost per micro-batch gathered from ``parts`` readers: copying the
# parts in and augmenting them (on a GPU this is host time on the step's critical path; here,
# at 16 pixels, the per-pixel work is small and the per-call overhead shows)
GATHER = r"""
import inspect, json, sys, time
import torch
torch.set_num_threads(1)
from vitlab.data.stream import StreamLoader, open_source
from vitlab.data.transforms import TrainTransform

shards, parts, batch, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
source = open_source(shards)
augment = TrainTransform(num_classes=len(source.classes), image_size=(16, 16), crop="inception", flip=True)
loader = StreamLoader(source, batch, augment=augment, workers=0)
sizes = [batch // parts + (w < batch % parts) for w in range(parts)]
at_once = "parts" in inspect.signature(loader._on_device).parameters  # before: one part at a time, then a cat
# a part as a worker hands it over: its labels and ids as tensors before, as lists since
numbers = (lambda n: torch.zeros(n, dtype=torch.int64), torch.arange) if not at_once else (lambda n: [0] * n, range)
made = [(torch.randint(0, 256, (n, 16, 16, 3), dtype=torch.uint8), numbers[0](n), None, numbers[1](n), w, 0, 64)
        for w, n in enumerate(sizes)]


def gather():
    if at_once:
        return loader._on_device(made)
    xs, ys = zip(*(loader._on_device(part) for part in made))
    return torch.cat(xs), torch.cat(ys)


for _ in range(5):
    gather()
best = float("inf")
for _ in range(repeats):
    t = time.perf_counter()
    for _ in range(20):
        gather()
    best = min(best, (time.perf_counter() - t) / 20)
print(json.dumps({"ms_per_batch": best * 1e3}))
"""


# the training process's CPU time per reader's part of 9 images at 224 pixels received from a
# DataLoader worker (2 workers making parts without decoding, as the revision's readers hand
# them over): what each tensor a worker hands over costs (a file descriptor passed over a
# socket, with a handshake)
HANDOVER = r"""
import json, resource, sys
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset
import vitlab.data.stream as stream

torch.set_num_threads(1)
size, parts = 9, int(sys.argv[1])
pixels = np.zeros((224, 224, 3), dtype=np.uint8)
together = stream.parts_per_handover(size) if hasattr(stream, "parts_per_handover") else 1


class Parts(IterableDataset):
    def __iter__(self):
        while True:
            if not hasattr(stream, "_Handover"):  # before: a part at a time
                part = stream._Part(size, (224, 224), 0)
                for i in range(size):
                    part.add(pixels, i % 10, f"{i}.jpg")
                yield part.handed_out(0, 0, size)
                continue
            handover = stream._Handover(together, size, (224, 224))
            while not handover.full():
                part = handover.next_part(0)
                for i in range(size):
                    part.add(pixels, i % 10, f"{i}.jpg")
                handover.done(part, 0, size)
            yield handover.images, handover.parts, 0


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


best = float("inf")
for _ in range(3):
    it = iter(DataLoader(Parts(), batch_size=None, num_workers=2))
    for _ in range(10):
        next(it)
    start = cpu()
    for _ in range(parts // together):
        next(it)[0].view(-1)[::4096].sum()  # every page touched, as the copy to the device does
    best = min(best, (cpu() - start) / (parts // together * together))
    del it
print(json.dumps({"ms_per_part": best * 1e3}))
"""


def photo_like(rng: np.random.Generator, h: int = 375, w: int = 500) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    base = np.stack([np.sin(6 * xx * rng.uniform(0.5, 2) + c) * np.cos(4 * yy * rng.uniform(0.5, 2) + c)
                     for c in range(3)], -1)
    return np.clip(128 + 100 * base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)


def _write_image(job: tuple[int, str, int]) -> None:
    from PIL import Image

    i, folder, classes = job
    target = Path(folder) / f"class{i % classes:03d}"
    target.mkdir(parents=True, exist_ok=True)
    Image.fromarray(photo_like(np.random.default_rng(i))).save(target / f"{i:06d}.jpg", quality=90)


def write_shards(folder: Path, images: int, classes: int = 100, processes: int = 1) -> Path:
    """``images`` ImageNet-like JPEGs in ``classes`` class folders of ``folder / "images"``
    (image i seeded by i, written by ``processes`` processes), packed into shards of 128 in
    ``folder / "shards"``; that path."""
    from multiprocessing import Pool

    from vitlab.data.shards import pack_shards

    jobs = [(i, str(folder / "images"), classes) for i in range(images)]
    if processes > 1:
        with Pool(processes) as pool:
            pool.map(_write_image, jobs)
    else:
        for job in jobs:
            _write_image(job)
    pack_shards(folder / "images", folder / "shards", samples_per_shard=128)
    return folder / "shards"


def run_at(path: str, script: str, *argv, what: str) -> dict:
    """``script`` run in a fresh process with the revision at ``path`` first on the path:
    the JSON object of its last line."""
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script, *map(str, argv)], capture_output=True, text=True, env=env,
                          cwd=path, timeout=1800)
    if done.returncode:
        raise SystemExit(f"{what} at {path} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(path: str, shards: Path, workers: int, args: argparse.Namespace) -> dict:
    return run_at(path, MEASURE, shards, workers, args.batch, args.batches, args.warmup,
                  what=f"the measurement with {workers} worker(s)")


def handover_cost(path: str) -> float:
    return run_at(path, HANDOVER, 300, what="the handover measurement")["ms_per_part"]


def gather_cost(path: str, shards: Path, parts: int, batch: int) -> float:
    return run_at(path, GATHER, shards, parts, batch, 5, what="the gathering measurement")["ms_per_batch"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", metavar="REV", help="also measure git revision REV, in the same run")
    p.add_argument("--images", type=int, default=768, help="JPEGs written (default 768: six shards)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batches", type=int, default=10, help="timed batches per measurement")
    p.add_argument("--warmup", type=int, default=2, help="batches left out at the start of each measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", default=None, help="worker counts >= 1, e.g. 1,2 (default: 1 and every usable core)")
    p.add_argument("--gather", type=int, default=None, metavar="PARTS",
                   help="time instead the training process's cost per micro-batch of --batch images gathered "
                        "from PARTS readers (16 px: the per-call overhead) and its CPU time to receive one "
                        "part from a worker, at each revision")
    args = p.parse_args()
    cores = usable_cores()
    counts = [int(w) for w in args.workers.split(",")] if args.workers else sorted({1, cores})
    revisions = {"now": str(ROOT)}
    if args.before:
        revisions = {"before": checkout(args.before, "data_throughput.py"), **revisions}
    print(f"{cpu_name()}, {cores} usable cores, load average {os.getloadavg()[0]:.1f}", flush=True)
    rows: dict = {(rev, w): [] for rev in revisions for w in counts}
    if args.gather:
        with tempfile.TemporaryDirectory(prefix="vitlab-data-") as tmp:
            shards = write_shards(Path(tmp), 256, processes=cores)
            costs = {rev: [] for rev in revisions}
            handovers = {rev: [] for rev in revisions}
            for r in range(args.rounds):
                for rev in (list(revisions) if r % 2 == 0 else list(reversed(revisions))):
                    costs[rev].append(gather_cost(revisions[rev], shards, args.gather, args.batch))
                    handovers[rev].append(handover_cost(revisions[rev]))
                    print(f"round {r + 1}, {rev:>6}: {costs[rev][-1]:.3f} ms per micro-batch, {handovers[rev][-1]:.3f} "
                          "ms to receive a part", flush=True)
        gathered = {"cpu": cpu_name(), "parts": args.gather, "batch": args.batch, "before": args.before,
                    **{f"{rev}_ms_per_batch": round(min(c), 3) for rev, c in costs.items()},
                    **{f"{rev}_ms_per_part_received": round(min(c), 3) for rev, c in handovers.items()}}
        if args.before:
            for figure in ("ms_per_batch", "ms_per_part_received"):
                gathered[f"{figure}_before_over_now"] = round(gathered[f"before_{figure}"] / gathered[f"now_{figure}"], 2)
        print(json.dumps(gathered))
        return
    with tempfile.TemporaryDirectory(prefix="vitlab-data-") as tmp:
        t = time.perf_counter()
        shards = write_shards(Path(tmp), args.images, processes=cores)
        print(f"{args.images} JPEGs of 500x375 at quality 90 in shards of 128 ({time.perf_counter() - t:.0f} s)",
              flush=True)
        for r in range(args.rounds):
            order = list(revisions) if r % 2 == 0 else list(reversed(revisions))
            for w in counts:
                for rev in order:
                    result = measure(revisions[rev], shards, w, args)
                    rows[(rev, w)].append(result)
                    print(f"round {r + 1}, {rev:>6}, {w} worker(s): {result['img_per_s']:7.1f} img/s, "
                          f"{result['img_per_reader_cpu_s']:7.1f} img per reader CPU-s, "
                          f"{result['img_per_cpu_s']:7.1f} img per CPU-s in all", flush=True)
    summary: dict = {"cpu": cpu_name(), "cores": cores, "before": args.before, "batch": args.batch,
                     "image": "500x375 JPEG q90 -> inception crop + flip at 224", "rounds": args.rounds}
    for (rev, w), results in rows.items():
        summary[f"{rev}_workers_{w}"] = {k: round(statistics.median(r[k] for r in results), 1)
                                         for k in ("img_per_s", "img_per_cpu_s", "img_per_reader_cpu_s")}
    if args.before:
        for w in counts:
            now, before = summary[f"now_workers_{w}"], summary[f"before_workers_{w}"]
            summary[f"ratio_workers_{w}"] = {k: round(now[k] / before[k], 2) for k in now}
    summary["load_average_end"] = round(os.getloadavg()[0], 1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
