"""Where a training step's time goes: the data path, the host's launches, the device.

    python benchmarks/step_profile.py --recipe cifar10_scratch:model=vit \
        --data ../shared/data/cifar10/cifar10-train.tar.gz                # on a GPU: the GPU recipe
    python benchmarks/step_profile.py --recipe demo --steps 6 --warmup 2  # a CPU check of the machinery

Builds the run as ``vitlab train`` would (``--set`` changes it), takes ``--warmup`` steps
(compilation, CUDA-graph capture), then measures, each over ``--steps`` steps:

1. ``trained``: the steps as the trainer takes them, with the host's seconds split into
   getting the next batch (the data path: indexing, copying, augmenting; on a GPU only
   launched, on a side stream) and the rest of ``train_step`` (the model's graphs, the
   optimiser, the EMA);
2. ``one_batch``: the same steps on one batch used again and again: the model and the
   optimiser alone;
3. ``update_only``: what follows the backward alone (clipping, the optimiser, the EMA:
   ``step.Update``), called again and again on one step's gradients: ``one_batch`` less this
   is the model's forward and backward;
4. ``data_only``: batches drawn and nothing trained: the data path alone.

A rate bounded by the host shows as ``trained``'s host seconds close to its wall seconds;
one bounded by the device as host seconds well under them.  Then ``torch.profiler`` over
``--profile-steps`` steps prints the device's kernels (CUDA) or the host's operators (CPU)
by total time, the device's kernel time per step, and that time by kind of kernel
(``KERNEL_KINDS``: matmuls, attention, normalisation, inductor's fused element-wise kernels,
the optimiser's multi-tensor kernels, copies).  One JSON line last.  Not a benchmark against a
peer: a map of the step, for deciding what to make faster.
"""
from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import time

import torch

from vitlab.configs import load_recipe
from vitlab.train.build import build
from vitlab.train.overrides import apply_overrides, with_changes
from vitlab.train.step import accumulate, endless, train_step

# A CUDA kernel's kind, by its name: the first pattern that matches (searched in the lowercased
# name; inductor names a fused kernel after the operators it holds, "triton_per_fused_native_layer_norm_0")
KERNEL_KINDS = (
    ("attention", r"flash|fmha|attention"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|s16816|h16816|matmul|^triton_tem_"),  # tem: a Triton template
    ("normalisation", r"layer_norm|layernorm|group_norm|batch_norm"),
    ("optimiser (multi-tensor)", r"multi_tensor|foreach|fused_adam|adam"),
    ("fused element-wise (inductor)", r"^triton_"),
    ("copies and fills", r"memcpy|memset|copy|fill|cat"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="cifar10_scratch:model=vit")
    p.add_argument("--data", default=None, help="the recipe's data.source (default: the recipe's own)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="as vitlab train --set")
    p.add_argument("--warmup", type=int, default=30, help="steps before any measurement (compilation, graphs)")
    p.add_argument("--steps", type=int, default=100, help="steps (or batches) per measurement")
    p.add_argument("--profile-steps", type=int, default=10, help="steps under torch.profiler (0: none)")
    p.add_argument("--rows", type=int, default=20, help="rows of the profiler's table")
    p.add_argument("--out", default="/tmp/step-profile", help="the run's folder (checkpoints are not written)")
    return p.parse_args(argv)


def config(args: argparse.Namespace):
    cfg = load_recipe(args.recipe)
    changes = {"run.out": args.out, "run.time_limit": 0.0, "run.tensorboard": False, "run.eval_every": 0,
               "optim.steps": args.warmup + 3 * args.steps + args.profile_steps + 10}
    if args.data:
        changes["data.source"] = args.data
    return apply_overrides(with_changes(cfg, changes), args.set)


class TimedBatches:
    """An iterator's items, with the host seconds spent getting them."""

    def __init__(self, items) -> None:
        self.items, self.seconds = items, 0.0

    def __iter__(self):
        return self

    def __next__(self):
        t = time.perf_counter()
        try:
            return next(self.items)
        finally:
            self.seconds += time.perf_counter() - t


def timed_calls(setup, call, steps: int) -> tuple[float, float]:
    """(host seconds, wall seconds) of ``steps`` calls of ``call``: the host's until its last
    launch, the wall's until the device has finished too."""
    sync = torch.cuda.synchronize if setup.world.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        call()
    host = time.perf_counter() - start
    sync()
    return host, time.perf_counter() - start


def measure(setup, batches, steps: int, size: int, train: bool = True) -> dict:
    """Wall and host seconds per step of ``steps`` steps (or batches drawn, ``train=False``)."""
    timed = TimedBatches(batches)
    host, wall = timed_calls(setup, (lambda: train_step(setup, timed, 1e-4, size)) if train else (lambda: next(timed)),
                             steps)
    batch = setup.cfg.optim.batch_size
    return {"ms_per_step": round(1e3 * wall / steps, 3), "img_per_s": round(steps * batch / wall, 1),
            "host_ms_per_step": round(1e3 * host / steps, 3),
            "data_host_ms_per_step": round(1e3 * timed.seconds / steps, 3)}


def kernel_kind(name: str) -> str:
    """The ``KERNEL_KINDS`` entry a kernel's name matches, or "other"."""
    lowered = name.lower()
    return next((kind for kind, pattern in KERNEL_KINDS if re.search(pattern, lowered)), "other")


def by_kind(kernels: list[tuple[str, float]], steps: int) -> dict[str, float]:
    """Milliseconds per step of each kind of kernel, from (name, microseconds) pairs; the largest first."""
    totals: dict[str, float] = {}
    for name, us in kernels:
        kind = kernel_kind(name)
        totals[kind] = totals.get(kind, 0.0) + us
    return {kind: round(us / 1e3 / steps, 3) for kind, us in sorted(totals.items(), key=lambda item: -item[1])}


def measure_update(setup, batches, steps: int, size: int) -> dict:
    """Wall milliseconds per call of what follows the backward (``setup.update``), on one step's
    gradients used again and again (each call moves the weights; the numbers do not matter here)."""
    setup.optimizer.zero_grad(set_to_none=True)
    accumulate(setup, batches, size)
    bad_ranks = torch.zeros(setup.world.size, device=setup.world.device)
    setup.update(bad_ranks)  # a compiled update's first call compiles
    host, wall = timed_calls(setup, lambda: setup.update(bad_ranks), steps)
    setup.optimizer.zero_grad(set_to_none=True)
    return {"ms_per_step": round(1e3 * wall / steps, 3), "host_ms_per_step": round(1e3 * host / steps, 3)}


def profile(setup, batches, steps: int, size: int, rows: int) -> dict:
    """The profiler's table over ``steps`` steps, printed; the device's kernel time per step."""
    cuda = setup.world.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            train_step(setup, batches, 1e-4, size)
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(table.table(sort_by=sort, row_limit=rows, max_name_column_width=60))
    if not cuda:
        return {}
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    # microseconds of kernels and copies, summed (work on the data path's side stream overlapping the
    # step's counts twice)
    busy = sum(e.time_range.elapsed_us() for e in kernels)
    kinds = by_kind([(e.name, e.time_range.elapsed_us()) for e in kernels], steps)
    print("device ms per step by kind of kernel:", ", ".join(f"{kind} {ms}" for kind, ms in kinds.items()))
    return {"device_kernel_ms_per_step": round(busy / 1e3 / steps, 3), "device_events_per_step": len(kernels) // steps,
            "device_ms_by_kind": kinds}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup = build(config(args))
    torch.set_num_threads(setup.resolved.threads)
    print(setup.resolved.line(), flush=True)
    size = setup.img_size[0]
    setup.trained.train()
    batches = endless(setup.stream)
    measure(setup, batches, args.warmup, size)
    report = {"recipe": args.recipe, "sets": args.set, "device": str(setup.world.device),
              "gpu": torch.cuda.get_device_name() if setup.world.device.type == "cuda" else None,
              "batch": setup.cfg.optim.batch_size, "torch": torch.__version__}
    report["trained"] = measure(setup, batches, args.steps, size)
    print("trained  ", report["trained"], flush=True)
    report["one_batch"] = measure(setup, itertools.repeat(next(batches)), args.steps, size)
    print("one_batch", report["one_batch"], flush=True)
    report["update_only"] = measure_update(setup, batches, args.steps, size)
    print("update_only", report["update_only"], flush=True)
    report["data_only"] = measure(setup, batches, args.steps, size, train=False)
    print("data_only", report["data_only"], flush=True)
    if args.profile_steps:
        report["profile"] = profile(setup, batches, args.profile_steps, size, args.rows)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
