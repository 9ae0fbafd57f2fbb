"""Paper Figure 12 (Appendix D.5): inference speed and the largest batch that fits,
across input sizes, for ViTs and BiT ResNets.

    python benchmarks/figure12.py                             # CPU: 224 to 512 px, batch 2
    python benchmarks/figure12.py --sizes 224 256 --budget-gib 16
    python benchmarks/figure12.py --device cuda --sizes 224 320 384 448 512 --batch 64

Left panel: images/s (per core on CPU, as the paper's "img/sec/core") against input
size.  Right panel: the largest batch whose forward pass fits a memory budget.  On CUDA
the budget is device memory (default: all of it) and the batch is found by binary
search over real runs (an out-of-memory error means "does not fit").  On CPU an
over-budget run would swap rather than fail, and a search over real runs of ViT-L at
512 px would take hours, so memory is extrapolated along a line through two runs: the
process's peak resident set at the speed run's batch and at 4x that batch (one call),
whose difference is the memory per image and whose intercept is the model, runtime and
scratch space; the line is solved for the budget.  (The rise above the built model at one
batch alone, the earlier method, counts scratch and allocator slack as per-image memory
and gave erratic points.)  ``--search`` runs the real binary search on CPU too.

The in-process sweep of ``vitlab experiment resolution`` (vitlab/experiments/resolution.py)
measures the same two panels beside the fine-tuning-resolution comparison; this script
stays the careful one (fresh processes, memory extrapolation on CPU).

Every measurement runs in a fresh subprocess (harness.py).  Writes
benchmarks/results/figure12-<device>.json and figure12-<device>.png.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable

from harness import run_case, vitlab_config

HERE = Path(__file__).resolve().parent
MODELS = ("ViT-B/32", "ViT-B/16", "ViT-L/16", "BiT-R50x1", "BiT-R152x2")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--sizes", nargs="+", type=int, default=None,
                   help="input sizes (default: 224 288 384 448 512 on CPU, 224 320 384 448 512 on CUDA;"
                        " each a multiple of 32, so that every model's patches tile it)")
    p.add_argument("--batch", type=int, default=None, help="batch for the speed panel (CPU 2, CUDA 32)")
    p.add_argument("--budget-gib", type=float, default=None,
                   help="memory budget (CPU: resident set, default 8 GiB; CUDA: default the device's)")
    p.add_argument("--search", action="store_true", help="on CPU, binary search over real runs")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="binary search stops when the bracket is within this fraction (default 0.05)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(HERE / "results"))
    return p.parse_args(argv)


def largest_batch(fits: Callable[[int], bool], limit: int = 1 << 14, start: int = 1,
                  rel_tol: float = 0.0) -> int:
    """The largest b in [0, limit] with fits(b), assuming fits is monotone (b=0 always fits).

    Doubles from ``start`` until the first failure, then bisects until the bracket is
    within ``rel_tol`` of its lower end (0: exact).  Returns the largest batch seen to fit.
    """
    lo, hi = 0, max(1, start)
    if not fits(hi):  # the start was too big: search below it
        hi, lo = hi, 0
    else:
        while True:
            lo, hi = hi, min(hi * 2, limit + 1)
            if hi > limit or not fits(hi):
                break
            if hi == limit:
                return limit
    while hi - lo > max(1, int(lo * rel_tol)):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def extrapolated_largest_batch(total_peak: float, rise: float, batch: int, budget: float,
                               limit: int = 1 << 14) -> int:
    """Largest b with base + b * rise / batch <= budget, where base = total_peak - rise."""
    base, per_image = total_peak - rise, max(rise, 1.0) / batch
    return int(min(max(0.0, (budget - base) // per_image), limit))


def line_fit_largest_batch(peak_small: float, batch_small: int, peak_large: float, batch_large: int,
                           budget: float, limit: int = 1 << 14) -> int | None:
    """Largest b under ``budget`` on the line through (batch, peak) at two batches, or None when
    the larger batch did not take more memory (then the line says nothing)."""
    per_image = (peak_large - peak_small) / (batch_large - batch_small)
    if per_image <= 0:
        return None
    base = peak_small - batch_small * per_image
    return int(min(max(0.0, (budget - base) // per_image), limit))


def device_budget(args: argparse.Namespace) -> float:
    if args.budget_gib is not None:
        return args.budget_gib * 2**30
    if args.device == "cuda":
        import torch

        return float(torch.cuda.get_device_properties(0).total_memory)
    return 8 * 2**30


def measure(args: argparse.Namespace, model: str, size: int, batch: int, repeats: int,
            timed: bool = True) -> dict:
    """One fresh-process inference run; ``timed`` ones warm up twice and time repeats of at
    least a second, memory probes (the 4x-batch point, the batch search) one call after one."""
    case = dict(kind="inference", device=args.device, model=model, img_size=size, batch=batch,
                dtype="fp32", impl="vitlab", threads=args.threads, warmup=2 if timed else 1,
                repeats=repeats, min_seconds=1.0 if timed else 0.0)
    return run_case(case, timeout=1800)


def collect(args: argparse.Namespace) -> dict:
    """All measurements as a JSON-able dict (no plotting here)."""
    cpu = args.device == "cpu"
    sizes = args.sizes or ([224, 288, 384, 448, 512] if cpu else [224, 320, 384, 448, 512])
    batch = args.batch or (2 if cpu else 32)
    threads = args.threads or (os.cpu_count() if cpu else None)
    args.threads = threads
    budget = device_budget(args)
    for model in args.models:
        try:
            cfg = vitlab_config(model)
        except ValueError as err:  # the registry's ConfigError names the close matches
            raise SystemExit(f"--models {model}: {err}") from None
        patch = getattr(cfg, "patch_size", (1, 1))[0] if not model.startswith("BiT-") else 1  # BiT: any size
        bad = [size for size in sizes if size % patch]
        if bad:
            raise SystemExit(f"--sizes {' '.join(map(str, bad))}: {model} needs multiples of its "
                             f"patch size {patch}")
    record = {"device": args.device, "threads": threads, "batch": batch, "budget_bytes": budget,
              "sizes": sizes, "models": {}}
    for model in args.models:
        rows = record["models"][model] = []
        for size in sizes:
            speed = measure(args, model, size, batch, args.repeats)
            row = {"size": size}
            if "error" in speed:
                row["error"] = speed["error"]
            else:
                row["img_per_s"] = speed["median"]
                row["img_per_s_range"] = [speed["min"], speed["max"]]
                if cpu:
                    row["img_per_s_per_core"] = speed["median"] / threads
                row["peak_rss_bytes"] = speed["total_peak_bytes"]
                row["peak_rise_bytes"] = speed["peak_bytes"]
                if cpu and not args.search:
                    probe = measure(args, model, size, 4 * batch, 1, timed=False)
                    fit = None if "error" in probe else line_fit_largest_batch(
                        speed["total_peak_bytes"], batch, probe["total_peak_bytes"], 4 * batch, budget)
                    if fit is not None:
                        row["peak_rss_bytes_at_4x"] = probe["total_peak_bytes"]
                        row["largest_batch"] = fit
                        row["largest_batch_method"] = f"line through the peak RSS at batch {batch} and {4 * batch}"
                    else:
                        row["largest_batch"] = extrapolated_largest_batch(
                            speed["total_peak_bytes"], speed["peak_bytes"], batch, budget)
                        row["largest_batch_method"] = f"extrapolated from the peak RSS at batch {batch}"
            if "largest_batch" not in row and (not cpu or args.search):
                def fits(b: int) -> bool:
                    r = measure(args, model, size, b, 1, timed=False)
                    return "error" not in r and r["total_peak_bytes"] <= budget
                row["largest_batch"] = largest_batch(fits, start=batch, rel_tol=args.tolerance)
                row["largest_batch_method"] = f"binary search over runs, to {args.tolerance:.0%}"
            rows.append(row)
            print(f"{model:12s} {size:4d}px  " + (row.get("error") or
                  f"{row['img_per_s']:8.2f} img/s  largest batch {row.get('largest_batch', '-')}"), flush=True)
    return record


def plot(record: dict, path: Path) -> None:
    """Two panels as in the paper's Figure 12; arrays in, figure out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu = record["device"] == "cpu"
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for model, rows in record["models"].items():
        ok = [r for r in rows if "img_per_s" in r]
        style = "--" if model.startswith("BiT") else "-"
        key = "img_per_s_per_core" if cpu else "img_per_s"
        left.plot([r["size"] for r in ok], [r[key] for r in ok], style, marker="o", label=model)
        fit = [r for r in ok if "largest_batch" in r]
        right.plot([r["size"] for r in fit], [max(r["largest_batch"], 0.5) for r in fit], style, marker="o",
                   label=model)
    left.set(xlabel="input size (px)", ylabel="img/s per core" if cpu else "img/s", yscale="log",
             title=f"inference speed (batch {record['batch']})")
    right.set(xlabel="input size (px)", ylabel="largest batch", yscale="log",
              title=f"largest batch under {record['budget_bytes'] / 2**30:.0f} GiB")
    left.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    record = collect(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"figure12-{args.device}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
    plot(record, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
