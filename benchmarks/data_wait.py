"""Does the data path keep pace with the model?  One training run from memory, one from JPEG shards.

    python -m benchmarks.data_wait                  # on a GPU: ViT-B/16 bf16 paper_pretrain, batch 128, 400 steps
    python -m benchmarks.data_wait --model ViT-Ti/16 --images 512 --steps 24 --log-every 8   # a CPU check

1. Writes ``--images`` ImageNet-like JPEGs (500x375, quality 90, 100 classes) and packs
   them into shards of 128, as ``data_throughput.py`` does (its ``write_shards``).
2. Trains ``vitlab train --recipe paper_pretrain:dataset=i21k`` twice on the same images:
   decoded into memory first (``--stream memory``), then streamed from the shards with the
   default (``auto``) workers.  Each run logs every ``--log-every`` steps.
3. Prints each run's windows (images/s, ``data_wait``), then one JSON line: the steady
   figures (the median over the windows after the first, which holds the workers' start)
   and the streamed run's images/s over the in-memory run's.

The goal of issue 42: streamed, ``data_wait`` <= 10% at the in-memory step rate.  On a GPU
``data_wait`` is the share of the step's time the device sat idle before its batch was
ready (CUDA events around the batch's arrival); on a CPU, the host's time getting it.
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

from benchmarks.data_throughput import write_shards
from vitlab.machine import usable_cores

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def train(name: str, data: list[str], out: Path, args: argparse.Namespace) -> dict:
    command = [sys.executable, "-m", "vitlab", "train", "--recipe", "paper_pretrain:dataset=i21k",
               "--model", args.model, "--val-split", "0", "--batch-size", str(args.batch), "--steps", str(args.steps),
               "--set", f"optim.warmup={max(1, args.steps // 40)}", "--set", f"run.log_every={args.log_every}",
               "--set", "run.tensorboard=false", "--quiet", "--out", str(out), "--overwrite", *data]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise SystemExit(f"data_wait.py: the {name} run failed:\n{done.stderr[-3000:]}")
    windows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    windows = [w for w in windows if w.get("data_wait") is not None]
    steady = windows[1:] or windows
    for w in windows:
        print(f"{name:>8} step {w['step']:>5}: {w['img_per_s']:8.1f} img/s, data_wait {100 * w['data_wait']:5.1f}%",
              flush=True)
    return {"img_per_s": round(statistics.median(w["img_per_s"] for w in steady), 1),
            "data_wait": round(statistics.median(w["data_wait"] for w in steady), 4), "windows": len(windows)}


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    from benchmarks.harness import cpu_name

    return cpu_name()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=4096)
    p.add_argument("--model", default="ViT-B/16")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--keep", metavar="FOLDER", help="write the images and shards here and keep them (default: a "
                                                     "temporary folder)")
    args = p.parse_args()
    cores = usable_cores()
    print(f"{device_name()}, {cores} usable cores", flush=True)
    with tempfile.TemporaryDirectory(prefix="vitlab-wait-") as tmp:
        root = Path(args.keep or tmp)
        images, shards = root / "images", root / "shards"
        if not shards.is_dir():
            t = time.perf_counter()
            write_shards(root, args.images, processes=cores)
            print(f"{args.images} JPEGs of 500x375 at quality 90 in shards of 128 ({time.perf_counter() - t:.0f} s)",
                  flush=True)
        memory = train("memory", ["--data", str(images), "--stream", "memory"], root / "run-memory", args)
        streamed = train("streamed", ["--data", str(shards)], root / "run-streamed", args)
    print(json.dumps({"device": device_name(), "cores": cores, "model": args.model, "batch": args.batch,
                      "steps": args.steps, "memory": memory, "streamed": streamed,
                      "streamed_over_memory": round(streamed["img_per_s"] / memory["img_per_s"], 3)}))


if __name__ == "__main__":
    main()
