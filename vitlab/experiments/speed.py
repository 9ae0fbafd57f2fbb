"""Inference speed and the largest batch that fits, across input sizes: the paper's Figure 12
(Appendix D.5), the speed part of ``vitlab experiment resolution``.

Speed is images/s at a fixed batch through the fast path (``vitlab.fast.optimize``), per
core on a CPU, as the paper's "img/sec/core".  The largest batch is the largest whose
forward pass fits a memory budget:

- CUDA: the budget is device memory (default: all of it) and the batch is found by
  doubling and bisection over real forward passes; an out-of-memory error means "does
  not fit".
- CPU: an over-budget run would swap rather than fail, and a search over real runs of
  ViT-L at 512 px would take hours, so memory is extrapolated along a line through two
  runs: the process's peak resident set at the speed run's batch and at 4x that batch,
  whose difference is the memory per image and whose intercept is the model, runtime
  and scratch space; the line is solved for the budget.  (The rise above the built model
  at one batch alone counts scratch and allocator slack as per-image memory; it is only
  the fallback for when the larger batch took no more memory.)  ``search=True`` runs the
  real search on a CPU too.

Every measurement runs in a fresh Python process (``python -m vitlab.experiments.speed
CASE_JSON``, which prints one ``RESULT`` line), so that one model's allocator state, oneDNN
caches and peak memory never leak into the next one's figures.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

GIB = 2**30
LIMIT = 1 << 14  # the largest batch any search or extrapolation reports
CPU_BUDGET_GIB = 8.0  # the default CPU budget: a machine of modest memory


def largest_batch(fits: Callable[[int], bool], limit: int = LIMIT, start: int = 1, rel_tol: float = 0.0) -> int:
    """The largest b in [0, limit] with fits(b), assuming fits is monotone (b=0 always fits).

    Doubles from ``start`` until the first failure, then bisects until the bracket is
    within ``rel_tol`` of its lower end (0: exact).  Returns the largest batch seen to fit.
    """
    lo, hi = 0, max(1, start)
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


def model_config(name: str, size: int):
    """A registered model at ``size`` px, with exact GELU and no dropout as
    benchmarks/harness.py builds it, so that these figures compare with the bench table's."""
    from vitlab.config import ResNetConfig, replace
    from vitlab.models.registry import get_config

    cfg = get_config(name, img_size=size)
    return cfg if isinstance(cfg, ResNetConfig) else replace(cfg, gelu="exact", dropout=0.0)


# ----------------------------------------------------------------------------- the sweep


def sweep(configs: dict[str, Callable[[int], Any]], sizes: list[int], device: str, batch: int, budget: float,
          threads: int | None = None, repeats: int = 3, min_seconds: float = 1.0, search: bool = False,
          tolerance: float = 0.05, limit: int = LIMIT, log: Callable[[str], None] = print) -> list[dict]:
    """One row per (model, size): images/s and the largest batch under ``budget`` bytes.

    ``configs`` maps a model's name to a function of the input size that returns its config.
    """
    from vitlab.config import ConfigError, config_to_dict

    cases = {}
    for name, make in configs.items():
        for size in sizes:
            try:  # every config first: a size the patches do not tile fails now, not an hour in
                cfg = make(size)
            except ConfigError as err:
                raise ValueError(f"speed_sizes: {name} at {size} px: {err}") from None
            cases[name, size] = dict(config=config_to_dict(cfg), device=device, batch=batch, threads=threads,
                                     repeats=repeats, min_seconds=min_seconds, warmup=2)
            if device == "cuda":  # the search runs in the measuring process: no new CUDA context per probe
                cases[name, size]["largest"] = dict(budget=budget, tolerance=tolerance, limit=limit)
    rows = []
    for (name, size), case in cases.items():
        row = dict(part="speed", model=name, img_size=size, seed=0, device=device, batch=batch, budget_bytes=budget)
        row.update(measure(case, budget, search, tolerance, limit))
        rows.append(row)
        log(f"{name:12s} {size:4d}px  " + (row.get("error") or (
            f"{row['img_per_s']:8.3g} img/s{'/core' if device == 'cpu' else ''}  "
            f"largest batch {row['largest_batch']}")))
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


def run_worker(cmd: list[str], threads: int | None = None, pythonpath: str | None = None,
               timeout: float = 1800) -> dict[str, Any]:
    """Run a measuring command in a fresh interpreter and return the dict of its ``RESULT``
    line, or {'error': ...}; ``pythonpath`` goes ahead of the installed packages."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def run_case(case: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter; its result dict, or {'error': ...}."""
    import vitlab

    # the worker imports the vitlab this process runs, wherever that is
    here = str(Path(vitlab.__file__).resolve().parents[1])
    return run_worker([sys.executable, "-m", "vitlab.experiments.speed", json.dumps(case)], case.get("threads"),
                      here, timeout)


def plot(table: list[dict], path: Path) -> Path | None:
    """The two panels of the paper's Figure 12 from the speed rows: images/s and the largest
    batch against input size, one line per model (dashed: the BiT ResNets)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    methods = [str(r.get("method", "")) for r in table]
    cpu, extrapolated = any(m.startswith("cpu") for m in methods), any("extrapolated" in m for m in methods)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for model in dict.fromkeys(r["model"] for r in table):
        rows = sorted((r for r in table if r["model"] == model and r.get("img_per_s") is not None),
                      key=lambda r: r["img_size"])
        style = "--" if str(model).startswith("BiT") else "-"
        left.plot([r["img_size"] for r in rows], [r["img_per_s"] for r in rows], style, marker="o", label=model)
        # a batch of 0 (the model alone is over budget) still gets a point on the log axis
        right.plot([r["img_size"] for r in rows], [max(r["largest_batch"], 0.5) for r in rows], style, marker="o",
                   label=model)
    left.set(xlabel="input size (px)", ylabel="img/s per core" if cpu else "img/s", yscale="log",
             title="inference speed")
    right.set(xlabel="input size (px)", ylabel="largest batch", yscale="log",
              title="largest batch" + (", extrapolated from memory" if extrapolated else ""))
    left.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- the measuring process


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak(device: str) -> int:
    """Start a new peak-memory window; the bytes in use now."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    try:  # 5 resets the resident set's high-water mark (VmHWM) to the current resident set
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # then the mark may include the model's build
    return _status("VmRSS")


def peak(device: str) -> int:
    """The highest memory in use since ``reset_peak``: on a CPU the resident set, which sees
    every allocation (torch's, oneDNN's scratch pads) where torch's own counters do not."""
    import torch

    return torch.cuda.max_memory_allocated() if device == "cuda" else _status("VmHWM")


def time_loop(step: Callable[[], Any], sync: Callable[[], None], warmup: int, repeats: int,
              min_seconds: float, warm: Callable[[], None] = lambda: None) -> tuple[list[float], int]:
    """Seconds per call of ``step`` in each of ``repeats`` timed repeats, and calls per repeat.

    ``warmup`` untimed calls come first (compilation, allocator and oneDNN caches); the
    last warm-up call sets how many calls make a repeat last ``min_seconds``.  ``warm()``
    is called between the warm-ups and the timed repeats.
    """
    last = 0.0
    for _ in range(warmup):
        t = time.perf_counter()
        step()
        sync()
        last = time.perf_counter() - t
    calls = max(1, int(min_seconds / last)) if last > 0 else 1
    warm()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            step()
        sync()
        times.append((time.perf_counter() - t) / calls)
    return times, calls


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
    model = vitlab.fast.optimize(build_model(cfg).to(device).eval(), inference_weights="pack")  # as vitlab eval runs it
    x = torch.randn(batch, 3, size, size, device=device)

    def forward():
        with torch.inference_mode():
            return model(x)

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    base = reset_peak(device)
    times, _ = time_loop(forward, sync, case["warmup"], case["repeats"], case["min_seconds"])
    rates = sorted(batch / t for t in times)
    total = peak(device)
    result = dict(median=statistics.median(rates), min=rates[0], max=rates[-1], threads=torch.get_num_threads(),
                  peak_bytes=total, rise_bytes=total - base)
    del x  # the search's probes start from the model alone
    if case.get("largest"):
        result["largest_batch"] = cuda_largest_batch(model, size, start=batch, **case["largest"])
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(worker(json.loads(sys.argv[1]))), flush=True)
