"""`vitlab calibrate`: whole training and inference steps of the plain and fast models, timed
once on this machine, and what wins stored for every later run.

For each precision this CPU can run (fp32; bf16 where oneDNN has a bf16 kernel) and each
mode, the same random model runs plain and under every kernel choice that can run here
(``kernels.KernelChoice``: the dense-layer kernel of that precision, and in fp32 how the
blocks attend), in interleaved rounds, so that a slow moment falls on all of them alike:

    training:  the CIFAR-size ViT (ViT-Ti's width at depth 6, 32 px in 4 px patches),
               batch 128: forward, backward and AdamW
    inference: ViT-S/16 at 224 px, batch 8: a forward without autograd

The stored choice takes, per precision, the kernel whose steps were fastest over both
modes (the sum of the two steps' times relative to the plain model's), and leaves a mode
of a precision to the plain model where even that choice was slower than plain.
``precision="auto"`` then means bf16 where the best bf16 steps beat the best fp32 steps
in both modes.  Nothing is timed inside a run: a run reads the stored answer once, when it
is built (``kernels.choose``, ``kernels.cpu_precision``).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from vitlab.config import replace
from vitlab.files import atomic_write_text
from vitlab.machine import cpu_info
from vitlab.models.registry import build_model, get_config

from .kernels import (BF16_KERNELS, FP32_KERNELS, KERNEL_PRECISIONS, KernelChoice, calibration_file, calibration_key,
                      onednn_report, why_unavailable)
from .modules import FastOptions, install

# (name, registry model, overrides, batch): one workload per mode
WORKLOADS = {
    "training": ("ViT-CIFAR b128", "ViT-Ti/16", dict(depth=6, patch_size=4, img_size=32, num_classes=10), 128),
    "inference": ("ViT-S/16 b8", "ViT-S/16", dict(num_classes=1000), 8),
}


def candidates(precision: str) -> list[KernelChoice]:
    """Every kernel choice this machine can run that differs in ``precision``'s arithmetic."""
    if precision == "fp32":
        choices = [KernelChoice(fp32=k, attention=a) for k in FP32_KERNELS for a in ("fused", "explicit")]
    else:
        choices = [KernelChoice(bf16=k) for k in BF16_KERNELS]
    return [c for c in choices if why_unavailable(c) is None]


def _model(mode: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    _, name, overrides, batch = WORKLOADS[mode]
    cfg = replace(get_config(name), dropout=0.0, **overrides)
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):  # any weights time alike: the caller's random stream is left as it was
        model = build_model(cfg)
    x = torch.randn(batch, 3, *cfg.img_size, generator=generator)
    y = torch.randint(0, cfg.num_classes, (batch,), generator=generator)
    return model, x, y


def training_step(forward: Callable[[torch.Tensor], torch.Tensor], parameters, x: torch.Tensor, y: torch.Tensor,
                  bf16: bool) -> Callable[[], None]:
    """One training step as a call: ``forward(x)``'s logits (under CPU bf16 autocast when
    ``bf16``), cross-entropy against ``y``, backward, AdamW (what the benchmarks time too)."""
    optimizer = torch.optim.AdamW(parameters, lr=1e-4)

    def train() -> None:
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(forward(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return train


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str, bf16: bool) -> Callable[[], None]:
    if mode == "inference":
        model.eval()

        def infer() -> None:
            with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                model(x)
        return infer
    return training_step(model, model.parameters(), x, y, bf16)


def time_steps(steps: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Median seconds of each step over ``rounds`` interleaved rounds (one warm-up call each)."""
    for step in steps.values():
        step()
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        names = list(steps)[r % len(steps):] + list(steps)[:r % len(steps)]  # rotated: no fixed first place
        for name in names:
            start = time.perf_counter()
            steps[name]()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in seconds.items()}


def measure(rounds: int = 3, precisions: tuple[str, ...] | None = None,
            say: Callable[[str], None] = lambda line: None) -> dict[str, dict[str, dict[str, float]]]:
    """{precision: {mode: {"plain" or a choice's key: median seconds per step}}}."""
    precisions = precisions or tuple(p for p in KERNEL_PRECISIONS if p == "fp32" or onednn_report().bf16)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for precision in precisions:
        results[precision] = {}
        for mode in WORKLOADS:
            base, x, y = _model(mode)
            steps = {"plain": _step(copy.deepcopy(base), x, y, mode, precision == "bf16")}
            for choice in candidates(precision):
                model = install(copy.deepcopy(base), FastOptions(choice))
                steps[choice_key(choice, precision)] = _step(model, x, y, mode, precision == "bf16")
            results[precision][mode] = time_steps(steps, rounds)
            say(f"{precision} {mode} ({WORKLOADS[mode][0]}): " + ", ".join(
                f"{k} {v * 1e3:.0f} ms" for k, v in results[precision][mode].items()))
    return results


def choice_key(choice: KernelChoice, precision: str) -> str:
    return f"{choice.fp32}/{choice.attention}" if precision == "fp32" else choice.bf16


def decide(results: dict[str, dict[str, dict[str, float]]]) -> tuple[KernelChoice, str]:
    """The stored kernel choice and what ``precision="auto"`` means, from ``measure``'s times."""
    fields: dict = {"training": [], "inference": []}
    best_seconds: dict[str, dict[str, float]] = {}
    for precision, modes in results.items():
        keys = [k for k in next(iter(modes.values())) if k != "plain"]
        relative = {k: sum(modes[m][k] / modes[m]["plain"] for m in modes) for k in keys}
        best = min(keys, key=relative.__getitem__)
        if precision == "fp32":
            fields["fp32"], fields["attention"] = best.split("/")
        else:
            fields["bf16"] = best
        best_seconds[precision] = {}
        for mode, seconds in modes.items():
            fast_wins = seconds[best] <= seconds["plain"]
            if fast_wins:
                fields[mode].append(precision)
            best_seconds[precision][mode] = min(seconds[best], seconds["plain"])
    for mode in ("training", "inference"):  # a precision not measured keeps the fast path
        fields[mode] += [p for p in KERNEL_PRECISIONS if p not in results]
    bf16_faster = "bf16" in best_seconds and all(
        best_seconds["bf16"][m] < best_seconds["fp32"][m] for m in best_seconds["fp32"])
    return KernelChoice(**fields), "bf16" if bf16_faster else "fp32"


def calibrate(path: str | os.PathLike | None = None, rounds: int = 3,
              say: Callable[[str], None] = lambda line: None) -> tuple[KernelChoice, str, dict]:
    """Measure, decide, store for this CPU and torch version; returns (choice, auto precision, times)."""
    path = calibration_file(path)  # before the minutes of timing: a string failed after them, on its missing .parent
    results = measure(rounds, say=say)
    choice, precision = decide(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):  # read, updated and written by one calibrate at a time: the others' entries are kept
        try:
            stored = json.loads(path.read_text())
            stored = stored if isinstance(stored, dict) else {}
        except (OSError, ValueError):
            stored = {}
        stored[calibration_key(cpu_info())] = {
            "kernels": dataclasses.asdict(choice), "precision": precision,
            "seconds_per_step": results, "threads": torch.get_num_threads(),
            "measured": time.strftime("%Y-%m-%d %H:%M"),
        }
        # a temporary file of this calibrate's own renamed over it, the stored file's mode kept (``atomic_write``)
        atomic_write_text(path, json.dumps(stored, indent=2) + "\n")
    return choice, precision, results


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """The block run holding an exclusive lock on ``path``'s side file (``kernels.json.lock``, left
    in place): two calibrates at once (on hosts where $HOME is shared) each read the file, added their
    entry and wrote it back, and the one that wrote last lost the other's.  Where there are no such
    locks (no ``fcntl``: Windows; a file system that refuses them) the block runs unlocked."""
    fd = None
    try:
        import fcntl

        fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)  # released as the file is closed
    except (ImportError, OSError):
        pass
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)
