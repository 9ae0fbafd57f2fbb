"""The paper's Figure 12 (Appendix D.5): inference speed and the largest batch that fits,
across input sizes, for ViTs and BiT ResNets.

    python benchmarks/figure12.py                                  # CPU: 5 models, 224 to 512 px, batch 2
    python benchmarks/figure12.py --models ViT-B/16 --sizes 224 384 --budget-gib 16
    python benchmarks/figure12.py --device cuda --budget-gib 40    # batch 32, 224 to 512 px

Speed is images/s at a fixed batch through the fast path (``vitlab.fast.optimize`` with the
bf16 inference weights held cast, as ``vitlab eval`` runs it), per core on a CPU, as the paper's
"img/sec/core".  The largest batch is the largest whose forward pass fits a memory budget:

- CUDA: the budget is device memory (default: all of it) and the batch is found by
  doubling and bisection over real forward passes; an out-of-memory error means "does
  not fit".
- CPU: an over-budget run would swap rather than fail, and a search over real runs of
  ViT-L at 512 px would take hours, so memory is extrapolated along a line through two
  runs: the process's peak resident set at the speed run's batch and at 4x that batch,
  whose difference is the memory per image and whose intercept is the model, runtime
  and scratch space; the line is solved for the budget.  (The rise above the built model
  at one batch alone counts scratch and allocator slack as per-image memory; it is only
  the fallback for when the larger batch took no more memory.)  ``--search`` runs the
  real search on a CPU too.

Every measurement runs in a fresh Python process (``python benchmarks/figure12.py --case
CASE_JSON``, which prints one ``RESULT`` line), so that one model's allocator state, oneDNN
caches and peak memory never leak into the next one's figures.  The models are
``harness.vitlab_config``'s (exact GELU, no dropout), as in the bench table.  Writes
``<out>/figure12-<device>-<date>.json`` (the rows, the machine, the command) and its ``.png``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

from harness import peak, reset_peak, run_worker, time_loop, vitlab_config

HERE = Path(__file__).resolve().parent
MODELS = ("ViT-B/32", "ViT-B/16", "ViT-L/16", "BiT-R50x1", "BiT-R152x2")
SIZES = {"cpu": (224, 288, 384, 448, 512), "cuda": (224, 320, 384, 448, 512)}
GIB = 2**30
LIMIT = 1 << 14  # the largest batch any search or extrapolation reports
CPU_BUDGET_GIB = 8.0  # the default CPU budget: a machine of modest memory


# ----------------------------------------------------------------------------- the largest batch


def largest_batch(fits: Callable[[int], bool], limit: int = LIMIT, start: int = 1, rel_tol: float = 0.0) -> int:
    """The largest b in [0, limit] with fits(b), assuming fits is monotone (b=0 always fits).

    Doubles from ``start`` until the first failure, then bisects until the bracket is
    within ``rel_tol`` of its lower end (0: exact).  Returns the largest batch seen to fit.
    """
    lo, hi = 0, max(1, min(start, limit))  # a start above the limit: no probe or answer beyond it
    if fits(hi):
        while True:
            lo, hi = hi, min(hi * 2, limit + 1)
            if hi > limit or not fits(hi):
                break
            if hi == limit:
                return limit
    # else the start was too big: search below it
    while hi - lo > max(1, int(lo * rel_tol)):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def extrapolated_largest_batch(total: float, rise: float, batch: int, budget: float, limit: int = LIMIT) -> int:
    """Largest b with base + b * rise / batch <= budget, where base = total - rise (the
    peak memory in use at ``batch`` and its rise above the built model)."""
    base, per_image = total - rise, max(rise, 1.0) / batch
    return int(min(max(0.0, (budget - base) // per_image), limit))


def line_fit_largest_batch(peak_small: float, batch_small: int, peak_large: float, batch_large: int,
                           budget: float, limit: int = LIMIT) -> int | None:
    """Largest b under ``budget`` on the line through (batch, peak) at two batches, or None when
    the larger batch did not take more memory (then the line says nothing)."""
    per_image = (peak_large - peak_small) / (batch_large - batch_small)
    if per_image <= 0:
        return None
    base = peak_small - batch_small * per_image
    return int(min(max(0.0, (budget - base) // per_image), limit))


def memory_budget(device: str, gib: float | None = None) -> float:
    """Bytes a forward pass may use: ``gib`` when given, else all of the GPU's memory, or
    ``CPU_BUDGET_GIB`` on a CPU."""
    if gib is not None:
        return gib * GIB
    if device == "cuda":
        import torch

        return float(torch.cuda.get_device_properties(0).total_memory)
    return CPU_BUDGET_GIB * GIB


# ----------------------------------------------------------------------------- the sweep


def sweep(models: list[str], sizes: list[int], device: str, batch: int, budget: float,
          threads: int | None = None, repeats: int = 3, min_seconds: float = 1.0, search: bool = False,
          tolerance: float = 0.05, limit: int = LIMIT, log: Callable[[str], None] = print) -> list[dict]:
    """One row per (model, size): images/s and the largest batch under ``budget`` bytes."""
    from vitlab.config import ConfigError, config_to_dict

    cases = {}
    for name in models:
        for size in sizes:
            try:  # every config first: a size the patches do not tile fails now, not an hour in
                cfg = vitlab_config(name, size)
            except ConfigError as err:
                raise ValueError(f"--sizes: {name} at {size} px: {err}") from None
            cases[name, size] = dict(config=config_to_dict(cfg), device=device, batch=batch, threads=threads,
                                     repeats=repeats, min_seconds=min_seconds, warmup=2)
            if device == "cuda":  # the search runs in the measuring process: no new CUDA context per probe
                cases[name, size]["largest"] = dict(budget=budget, tolerance=tolerance, limit=limit)
    rows = []
    for (name, size), case in cases.items():
        row = dict(model=name, img_size=size, device=device, batch=batch, budget_bytes=budget)
        row.update(measure(case, budget, search, tolerance, limit))
        rows.append(row)
        log(f"{name:12s} {size:4d}px  " + (row.get("error") or (
            f"{row['img_per_s']:8.3g} img/s{'/core' if device == 'cpu' else ''}  "
            f"largest batch {'not measured' if row['largest_batch'] is None else row['largest_batch']}")))
    return rows


def measure(case: dict, budget: float, search: bool, tolerance: float, limit: int) -> dict:
    """A row's figures: the speed run, then on a CPU the memory probe or the search over runs."""
    speed = run_case(case)
    device, batch = case["device"], case["batch"]
    if "error" in speed:
        return dict(error=speed["error"], method=f"{device}: the run failed")
    threads = speed["threads"]
    row = dict(threads=threads, img_per_s_total=speed["median"], img_per_s_range=[speed["min"], speed["max"]],
               peak_bytes=speed["peak_bytes"], rise_bytes=speed["rise_bytes"])
    if device == "cuda":
        return dict(row, img_per_s=speed["median"], largest_batch=speed["largest_batch"],
                    method=f"cuda, img/s; largest batch: runs under {budget / GIB:.0f} GiB, "
                           f"searched to {tolerance:.0%}")
    row["img_per_s"] = speed["median"] / threads  # the paper's img/sec/core
    if speed["peak_bytes"] is None:  # harness.reset_peak: the mark would have counted the model's build
        return dict(row, largest_batch=None, method="cpu, img/s per core; largest batch not measured: the resident "
                                                     "set's peak could not be reset (/proc/self/clear_refs)")
    gib = f"{budget / GIB:.0f} GiB"
    if search:
        def fits(b: int) -> bool:
            r = run_case(dict(case, batch=b, warmup=1, repeats=1, min_seconds=0.0))
            return "error" not in r and r["peak_bytes"] <= budget

        return dict(row, largest_batch=largest_batch(fits, limit, start=batch, rel_tol=tolerance),
                    method=f"cpu, img/s per core; largest batch: runs under {gib}, searched to {tolerance:.0%}")
    # the line's second point: one untimed call at 4x the batch, in a process of its own
    probe = run_case(dict(case, batch=4 * batch, warmup=1, repeats=1, min_seconds=0.0))
    fit = None if "error" in probe else line_fit_largest_batch(
        speed["peak_bytes"], batch, probe["peak_bytes"], 4 * batch, budget, limit)
    if fit is not None:
        return dict(row, peak_bytes_at_4x=probe["peak_bytes"], largest_batch=fit,
                    method=f"cpu, img/s per core; largest batch extrapolated to {gib} from the peak RSS "
                           f"at batch {batch} and {4 * batch}")
    return dict(row, largest_batch=extrapolated_largest_batch(speed["peak_bytes"], speed["rise_bytes"], batch,
                                                              budget, limit),
                method=f"cpu, img/s per core; largest batch extrapolated to {gib} from the peak RSS at batch {batch}")


def run_case(case: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter; its result dict, or {'error': ...}."""
    import vitlab

    # the worker imports the vitlab this process runs, wherever that is
    here = str(Path(vitlab.__file__).resolve().parents[1])
    return run_worker([sys.executable, str(Path(__file__).resolve()), "--case", json.dumps(case)],
                      case.get("threads"), here, timeout)


def plot(rows: list[dict]):
    """The two panels of the paper's Figure 12 from the rows: images/s and the largest batch
    against input size, one line per model (dashed: the BiT ResNets); a matplotlib Figure."""
    from matplotlib.figure import Figure

    methods = [str(r.get("method", "")) for r in rows]
    cpu, extrapolated = any(m.startswith("cpu") for m in methods), any("extrapolated" in m for m in methods)
    fig = Figure(figsize=(10, 4))
    left, right = fig.subplots(1, 2)
    for model in dict.fromkeys(r["model"] for r in rows):
        points = sorted((r for r in rows if r["model"] == model and r.get("img_per_s") is not None),
                        key=lambda r: r["img_size"])
        style = "--" if str(model).startswith("BiT") else "-"
        left.plot([r["img_size"] for r in points], [r["img_per_s"] for r in points], style, marker="o", label=model)
        # a batch of 0 (the model alone is over budget) still gets a point on the log axis; one not measured none
        measured = [r for r in points if r["largest_batch"] is not None]
        right.plot([r["img_size"] for r in measured], [max(r["largest_batch"], 0.5) for r in measured], style,
                   marker="o", label=model)
    left.set(xlabel="input size (px)", ylabel="img/s per core" if cpu else "img/s", yscale="log",
             title="inference speed")
    right.set(xlabel="input size (px)", ylabel="largest batch", yscale="log",
              title="largest batch" + (", extrapolated from memory" if extrapolated else ""))
    left.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- the measuring process


def cuda_largest_batch(model, size: int, budget: float, tolerance: float, limit: int, start: int) -> int:
    """The largest batch whose forward pass runs and stays under ``budget`` bytes of device memory."""
    import torch

    def fits(b: int) -> bool:
        try:
            torch.cuda.reset_peak_memory_stats()
            with torch.inference_mode():
                model(torch.randn(b, 3, size, size, device="cuda"))
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() <= budget
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            torch.cuda.empty_cache()  # so that a failed probe's blocks do not crowd the next one

    return largest_batch(fits, limit, start=start, rel_tol=tolerance)


def worker(case: dict[str, Any]) -> dict[str, Any]:
    """One measurement (in its own process): images/s; the peak memory in use (the whole
    process's) and its rise above the built model; when ``case['largest']`` is given, the
    largest batch on CUDA."""
    import torch

    import vitlab.fast
    from vitlab.config import config_from_dict
    from vitlab.models.registry import build_model

    if case.get("threads"):
        torch.set_num_threads(case["threads"])
    device, batch = case["device"], case["batch"]
    cfg = config_from_dict(case["config"])
    size = cfg.img_size[0]
    torch.manual_seed(0)
    model = vitlab.fast.optimize(build_model(cfg).to(device).eval())  # as vitlab eval runs it
    x = torch.randn(batch, 3, size, size, device=device)

    def forward():
        with torch.inference_mode():
            return model(x)

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    base = reset_peak(device)
    times, _ = time_loop(forward, sync, case["warmup"], case["repeats"], case["min_seconds"])
    rates = sorted(batch / t for t in times)
    total = peak(device) if base is not None else None  # None: not measured (the mark kept the model's build)
    result = dict(median=statistics.median(rates), min=rates[0], max=rates[-1], threads=torch.get_num_threads(),
                  peak_bytes=total, rise_bytes=None if total is None else total - base)
    del x  # the search's probes start from the model alone
    if case.get("largest"):
        result["largest_batch"] = cuda_largest_batch(model, size, start=batch, **case["largest"])
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--models", nargs="+", default=list(MODELS),
                   help="registered names, or ViT-CIFAR (the bench's CIFAR-size ViT, 4 px patches)")
    p.add_argument("--sizes", nargs="+", type=int, default=None,
                   help="input sizes (default: 224 288 384 448 512 on a CPU, 224 320 384 448 512 on CUDA; "
                        "each a multiple of 32, so that every model's patches tile it)")
    p.add_argument("--batch", type=int, default=None, help="batch of the speed panel (default: 2 on a CPU, 32 on CUDA)")
    p.add_argument("--budget-gib", type=float, default=None,
                   help=f"memory budget (CPU: resident set, default {CPU_BUDGET_GIB:g} GiB; CUDA: the device's)")
    p.add_argument("--search", action="store_true", help="on a CPU, search over real runs instead of extrapolating")
    p.add_argument("--tolerance", type=float, default=0.05, help="the search's relative precision (default 0.05)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (default 3)")
    p.add_argument("--seconds", type=float, default=1.0, help="each repeat lasts at least this long (default 1)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default on a CPU: every core this process may use, vitlab.machine.usable_cores)")
    p.add_argument("--limit", type=int, default=LIMIT, help=f"the largest batch reported (default {LIMIT})")
    p.add_argument("--out", default=str(HERE / "results"), help="folder of the JSON record and the figure")
    p.add_argument("--case", help=argparse.SUPPRESS)  # a measuring process: one case, one RESULT line
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.case:
        print("RESULT " + json.dumps(worker(json.loads(args.case))), flush=True)
        return 0
    from bench import machine
    from vitlab.machine import usable_cores

    cpu = args.device == "cpu"
    sizes = args.sizes or list(SIZES[args.device])
    batch = args.batch or (2 if cpu else 32)
    budget = memory_budget(args.device, args.budget_gib)
    threads = args.threads or (usable_cores() if cpu else None)  # every core this process may use
    try:
        rows = sweep(args.models, sizes, args.device, batch, budget, threads, args.repeats, args.seconds,
                     args.search, args.tolerance, args.limit)
    except ValueError as err:
        print(f"figure12.py: error: {err}", file=sys.stderr)
        return 2
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"figure12-{args.device}-{stamp}.json"
    command = "python benchmarks/figure12.py " + " ".join(sys.argv[1:] if argv is None else argv)
    record = dict(machine=machine(args), date=stamp, command=command.strip(), rows=rows)
    path.write_text(json.dumps(record, indent=1))
    written = [path]
    try:
        plot(rows).savefig(path.with_suffix(".png"), dpi=120)
        written.append(path.with_suffix(".png"))
    except ImportError:
        print("figure skipped: matplotlib is not installed (pip install -e \".[plots]\")", file=sys.stderr)
    print("wrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
