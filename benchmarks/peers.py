"""vitlab against Hugging Face's ViT in one process: the quick check beside bench.py.

    python benchmarks/peers.py                     # every experiment
    python benchmarks/peers.py training inference  # some of them
    python benchmarks/peers.py profile            # where a bf16 CIFAR-size training step spends its time

bench.py gives the figures the README cites (a fresh process per figure, several rounds);
these interleave vitlab (the default path, ``vitlab.fast.optimize``), vitlab-plain and the
peers round after round in one process, every core, wall time, which answers "did this
change move vitlab against the peers?" in minutes.  ``retain_memory`` measures a setting of
the process, so it runs each figure in a fresh one.  Findings: benchmarks/NOTES.md.
"""
from __future__ import annotations

import statistics
import sys
from typing import Callable

import torch

from harness import compare, make_model, optimize_if_default, run_case, run_experiments, vitlab_config
from vitlab.fast.calibration import training_step
from vitlab.machine import usable_cores

IMPLS = ("vitlab", "vitlab-plain", "hf-sdpa", "hf-eager")


def _inputs(spec: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images at ``spec``'s size and labels among its classes."""
    cfg = vitlab_config(spec)
    return torch.randn(batch, 3, *cfg.img_size), torch.randint(0, cfg.num_classes, (batch,))


def _model(impl: str, spec: str):
    model, forward = make_model(impl, spec)
    return optimize_if_default(impl, model), forward


def _train_step(spec: str, batch: int, impl: str, amp: bool) -> Callable[[], None]:
    """One training step (forward, backward, AdamW) of ``impl`` on random data."""
    torch.manual_seed(0)
    x, y = _inputs(spec, batch)
    model, forward = _model(impl, spec)
    model.train()
    return training_step(forward, model.parameters(), x, y, amp)


def exp_training() -> None:
    """Training steps of bench.py's rows, fp32 and bf16 autocast: CIFAR-size ViT at batch 128,
    ViT-S/16 at batch 32."""
    torch.set_num_threads(usable_cores())
    for spec, batch, rounds in (("ViT-CIFAR", 128, 5), ("ViT-S/16", 32, 3)):
        for amp in (False, True):
            compare(f"training step, {spec}, batch {batch}, {'bf16 autocast' if amp else 'fp32'} (AdamW)",
                    {impl: _train_step(spec, batch, impl, amp) for impl in IMPLS}, rounds=rounds)


def exp_inference() -> None:
    """ViT-B/16 inference at batch 1, 8 and 32, fp32 and bf16 autocast, with the matmul peak of
    each dtype measured after it (the better of torch.mm and the fast path's kernel)."""
    torch.set_num_threads(usable_cores())
    models = {impl: _model(impl, "ViT-B/16") for impl in IMPLS}
    for model, _ in models.values():
        model.eval()
    for batch, rounds in ((1, 15), (8, 7), (32, 5)):
        for amp in (False, True):
            torch.manual_seed(0)
            x = torch.randn(batch, 3, 224, 224)

            def infer(forward: Callable[[torch.Tensor], torch.Tensor], amp: bool = amp) -> Callable[[], object]:
                def go() -> object:
                    with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=amp):
                        return forward(x)
                return go

            compare(f"inference, ViT-B/16, batch {batch}, {'bf16 autocast' if amp else 'fp32'}",
                    {impl: infer(forward) for impl, (_, forward) in models.items()}, rounds=rounds)
    from harness import PEAK_KERNELS, matmul_product

    for dtype, kernel in PEAK_KERNELS:
        product = matmul_product(dtype, kernel, 4096, "cpu")
        seconds = compare(f"4096^3 matmul, {dtype}, {PEAK_KERNELS[dtype, kernel]}", {kernel: product}, rounds=3)
        print(f"  {2 * 4096**3 / min(seconds[kernel]) / 1e9:.0f} GFLOP/s")
    from vitlab.analysis.cost import model_flops

    print(f"  ViT-B/16 is {model_flops(vitlab_config('ViT-B/16')) / 1e9:.1f} GFLOPs per image")


def exp_retain_memory() -> None:
    """Training steps in fresh processes with malloc's default thresholds against
    ``vitlab.train.memory.retain_freed_memory`` (opt-in for ``vitlab train``), for vitlab and
    the HF peers: the setting belongs to the process, so every implementation can have it.
    5 paired rounds in alternating order; img/s medians and page faults per step."""
    for spec, batch in (("ViT-CIFAR", 128), ("ViT-S/16", 32)):
        print(f"\nretain_memory: fp32 training step, {spec}, batch {batch}, fresh processes "
              f"(img/s, median of 5 rounds; page faults per step)")
        for impl in ("vitlab", "hf-sdpa", "hf-eager"):
            rates: dict[bool, list[float]] = {False: [], True: []}
            faults: dict[bool, list[float]] = {False: [], True: []}
            for round_ in range(5):
                for retain in ((False, True) if round_ % 2 == 0 else (True, False)):
                    case = dict(kind="train", impl=impl, model=spec, batch=batch, dtype="fp32", device="cpu",
                                threads=usable_cores(), warmup=3, repeats=5, min_seconds=1.0,
                                retain_memory=retain)
                    r = run_case(case, timeout=1800)
                    if "error" in r:
                        sys.exit(f"{impl} retain_memory={retain}: {r['error']}")
                    rates[retain].append(r["median"])
                    faults[retain].append(r["page_faults_per_call"])
            paired = [b / a for a, b in zip(rates[False], rates[True])]
            print(f"  {impl:9s} default {statistics.median(rates[False]):6.1f} img/s "
                  f"({statistics.median(faults[False]) / 1e3:5.1f}k faults)   retained "
                  f"{statistics.median(rates[True]):6.1f} ({statistics.median(faults[True]) / 1e3:5.1f}k)   "
                  f"retained/default {statistics.median(paired):.3f} ({min(paired):.3f}-{max(paired):.3f})",
                  flush=True)


def exp_profile() -> None:
    """Where a bf16 training step of the CIFAR-size ViT (batch 128) spends its time, vitlab
    against HF eager: self CPU time per step by operator (``torch.profiler``), matmuls summed."""
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(usable_cores())
    matmuls = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::")
    steps = 3
    for impl in ("vitlab", "hf-eager"):
        step = _train_step("ViT-CIFAR", 128, impl, amp=True)
        for _ in range(3):  # warm-up
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        ops = prof.key_averages()
        total = sum(op.self_cpu_time_total for op in ops) / steps / 1e3
        matmul = sum(op.self_cpu_time_total for op in ops if op.key.startswith(matmuls)) / steps / 1e3
        print(f"{impl}: {total:.0f} ms per step profiled, matmuls {matmul:.0f} ms ({matmul / total:.0%})")
        for op in sorted(ops, key=lambda op: -op.self_cpu_time_total)[:12]:
            print(f"    {op.key[:56]:56s} {op.self_cpu_time_total / steps / 1e3:7.1f} ms  x{op.count // steps}")


EXPERIMENTS = {"training": exp_training, "profile": exp_profile, "inference": exp_inference,
               "retain_memory": exp_retain_memory}

if __name__ == "__main__":
    sys.exit(run_experiments(EXPERIMENTS, sys.argv[1:], __doc__))
