"""vitlab against its peers, measured in the same run: throughput, memory, share of peak.

    python benchmarks/bench.py                 # everything, CPU (about 40 minutes on 2 cores)
    python benchmarks/bench.py --quick         # one round, few repeats: checks the machinery
    python benchmarks/bench.py --rounds 1 --only 'infer/ViT-B/16/b8/'
    python benchmarks/bench.py --only infer/ViT-B/16/b64 --device cuda --compile
    python benchmarks/bench.py --device cuda --only '^infer/' --list   # the rows' ids, nothing run
    python benchmarks/bench.py --device cuda --only '^train/.*/bf16/' --fp8 tensorwise,rowwise
    python benchmarks/bench.py --device cuda --compile --only 'train/ViT-B/16/' --fp8 tensorwise,torchao-tensorwise
    python benchmarks/bench.py --device cuda --compile --only '/bf16/' --attention cudnn
    python benchmarks/bench.py --device cuda --compile --only 'train/ViT-B/16/b128/bf16/' --autotune

Rows (paper architectures from ``vitlab.models.registry``, the same for every implementation,
each with its own random initialisation):
  infer  ViT-B/16 at 224, batch 1, 8, 32 (on a GPU 1, 64, 256): images/s of a forward pass
         (inference mode)
  train  ViT-S/16 at 224, batch 32; the CIFAR-size ViT (ViT-Ti's width, heads and MLP at
         depth 6, 32 px in 4 px patches, 10 classes) at batch 128; on a GPU also ViT-B/16
         at 224, batch 128: images/s of forward + backward + AdamW
each in fp32 and in bf16 autocast.  "vitlab" is the default path, the model under
``vitlab.fast.optimize``.  Peers: Hugging Face ViTForImageClassification with
attn_implementation "sdpa" and "eager" (in bf16 under autocast over fp32 weights, as vitlab's
column), in the bf16 inference rows also "hf-sdpa-bf16w", the sdpa model held in bf16 and fed
bf16 images, no autocast (Hugging Face's way to serve in bf16: ``dtype=torch.bfloat16``), and timm
when importable.  Two more columns are
references, not peers, and the ratio leaves them out: "vitlab-plain", the same model
without the fast layer (what ``--no-fast`` runs), and ONNX Runtime (CPU, fp32 inference)
running vitlab's export.  With ``--fp8`` (a GPU only) the bf16 training rows also run
"vitlab-fp8-tensorwise" and "vitlab-fp8-rowwise": the default path with the encoder blocks'
dense layers in fp8 (``vitlab.fast.install_fp8``, what ``run.fp8`` trains; "torchao-tensorwise"
and "torchao-rowwise" add "vitlab-fp8-torchao-...", the same layers by torchao's float8
arithmetic, ``run.fp8_backend=torchao``), and with
``--attention cudnn`` (a GPU only) every bf16 row runs "vitlab-cudnn", the default path with
cuDNN's fused attention put ahead of PyTorch's own order (what ``run.gpu_attention=cudnn``
trains with), and with ``--autotune`` (a GPU, compiled) every row runs "vitlab-autotune", the default
path compiled in inductor's max-autotune (what ``run.compile_autotune`` trains with; its minutes
of autotuning are compilation, outside the timed calls); each is a column with its ratio to the
best peer, vitlab's own, never the best peer.

Every (row, implementation) runs in a fresh subprocess (harness.py); warm-up calls are
excluded.  The list runs R times (--rounds, default 3), a row's implementations back to
back and in a rotated order each round, so that a slow minute on this shared machine
falls on all of them or on each in turn; a figure is the median of the R rounds' medians
with the min-max over all repeats, and the ratio vitlab / best peer is the median of the
rounds' ratios (each round's vitlab against the same round's figure of the peer that is
best over all rounds), with their range.  Peak memory is the rise of the process's
resident set above its level after the model was built, before vitlab's fast layer is
applied (CPU; VmHWM), or torch.cuda.max_memory_reserved above the reservation then (CUDA: a
CUDA graph's pool is reserved for its life and allocates nothing when replayed),
so that whatever the fast layer keeps counts; the table gives it as vitlab / best peer
beside the speed ratio, and in MiB.  A compiled row on a GPU takes its peak over the timed
calls, after the warm-up: compiling allocates for autotuning, which a process that finds its
graph in inductor's cache skips: vitlab's and timm's compiled ViT-B/16 inference is one graph
(the same FX-graph key, in separate caches).  So vitlab's compiled inference column runs what vitlab
offers for it, ``vitlab.fast.compile_for_inference`` (frozen weights, under CUDA graphs on a
GPU; "vitlab-before" too, at a revision that has it), and the peers and "vitlab-plain"
``torch.compile`` in its default mode.  Compiled training
is ``torch.compile`` in its default mode and torch's AdamW for the peers and "vitlab-plain"; on a
GPU vitlab's columns ("vitlab-before" at a revision that has it) take the step ``vitlab train --compile`` takes there
(``harness.graphed_training_step``: the model under CUDA graphs, the update compiled into a CUDA
graph of its own, the same arithmetic plus the non-finite check).

"% peak" is the achieved FLOP/s (analytic model FLOPs, multiply-add = 2, training = 3x
forward) over the machine's practical peak for the dtype: the best 4096^3 matmul (8192^3 on
a GPU) over every kernel that can compute it, measured before and after the model rows.  On
a CPU that is fp32 through torch.mm and through oneDNN's matmul, and bf16 through the bf16
kernel and through the fp32 GEMM on bf16 operands; the table's note names the kernel that
set each peak, so that no row, whichever kernel it takes, can pass its dtype's peak.

Writes benchmarks/results/<host or device>-<date>.json (-2, -3, ... after a run of the same
minute) and the table to
benchmarks/results/latest.md (a --quick or --only run: partial.md, leaving latest.md alone); a
--quick run writes into benchmarks/results/quick/, which git ignores, unless --out names a folder.
Run from the repository root with vitlab installed (``pip install -e .``).
"""
from __future__ import annotations

import argparse
import atexit
import datetime
import itertools
import json
import os
import platform
import re
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import (AUTOTUNE_IMPL, BF16_WEIGHTS, CUDNN_IMPL, FP8_IMPL_PREFIX, FP8_IMPLS, OWN_IMPLS, PEAK_KERNELS,
                     VARIANT_IMPLS, checkout, cpu_name, peers_available, run_case, vitlab_folder)

HERE = Path(__file__).resolve().parent
INFER = [("ViT-B/16", b) for b in (1, 8, 32)]
INFER_GPU = [("ViT-B/16", b) for b in (1, 64, 256)]  # the GPU goal's rows: a GPU's batches are larger
TRAIN = [("ViT-S/16", 32), ("ViT-CIFAR", 128)]
TRAIN_GPU = [("ViT-B/16", 128)]  # the GPU goal's row: ViT-B/16 training, bf16 model-FLOPs utilisation
DTYPES = ("fp32", "bf16")
REFERENCES = ("vitlab-plain", "vitlab-before", "onnxruntime")  # vitlab in other ways: columns, not peers
OWN_VITLAB = HERE.parent / "vitlab"  # the code --before REV compares with REV's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from vitlab.fast.kernels import GPU_ATTENTION

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 round, 1 warm-up, short repeats")
    p.add_argument("--only", default=None, metavar="PATTERN",
                   help="regular expression on row ids such as 'infer/ViT-B/16/b8/bf16/hf-sdpa'")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile every PyTorch model")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: every core this process may use, vitlab.machine.usable_cores)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per round (default 3)")
    p.add_argument("--rounds", type=int, default=None,
                   help="run the whole list this many times (default 3, quick 1), each time in fresh "
                        "processes, and take the median of the rounds")
    p.add_argument("--before", default=None, metavar="REV",
                   help="also run the vitlab of git revision REV (checked out into a temporary folder, "
                        "imported by its own worker processes) as the column 'vitlab-before', and report "
                        "vitlab / before per row: a regression check in the same run (the vitlab imported must be "
                        "this checkout's)")
    p.add_argument("--bf16", choices=("auto", "yes", "no"), default="auto",
                   help="bf16 rows: 'auto' runs them where the hardware has bf16 (CUDA, or a CPU "
                        "with AVX512-BF16/AMX); elsewhere bf16 is emulated and 10-100x slower")
    p.add_argument("--fp8", type=fp8_scalings, default=(), metavar="SCALINGS",
                   help="GPU: add the bf16 training rows' fp8 columns, e.g. tensorwise,rowwise "
                        "(vitlab.fast.install_fp8), torchao-tensorwise,torchao-rowwise for torchao's arithmetic "
                        "(run.fp8_backend=torchao)")
    p.add_argument("--fp8-layers", type=fp8_layers, default=None, metavar="LAYERS",
                   help="with --fp8: which of each block's dense layers the fp8 columns swap, e.g. mlp.fc1,mlp.fc2 "
                        "(default all four: attn.qkv,attn.proj,mlp.fc1,mlp.fc2; run.fp8_layers)")
    p.add_argument("--attention", choices=GPU_ATTENTION, default="torch",  # run.gpu_attention's values
                   help="GPU: 'cudnn' adds the bf16 rows' column vitlab-cudnn, vitlab with cuDNN's fused attention "
                        "put first (run.gpu_attention=cudnn; vitlab.fast.kernels.attention_backends)")
    p.add_argument("--autotune", action="store_true",
                   help="GPU, with --compile: add the column vitlab-autotune, vitlab compiled in inductor's "
                        "max-autotune (run.compile_autotune; minutes more compilation per row)")
    p.add_argument("--out", default=None, help="folder for the JSON and latest.md (default: benchmarks/results; "
                                                "for --quick, benchmarks/results/quick, which git ignores)")
    p.add_argument("--list", action="store_true", help="print the ids of the peaks and rows this command would "
                   "run (after --only) and exit, measuring nothing")
    args = p.parse_args(argv)
    if args.out is None:  # a quick run checks the machinery: its record, in the tracked folder, was one more
        args.out = str(HERE / "results" / "quick" if args.quick else HERE / "results")  # untracked file there
    if args.fp8_layers and not args.fp8:
        p.error("--fp8-layers chooses the layers of the fp8 columns: add --fp8 SCALINGS")
    if args.attention != "torch" and args.device != "cuda":
        raise SystemExit(f"bench.py --attention {args.attention}: a GPU's attention backends; add --device cuda "
                         f"(this run is on {args.device})")
    if args.autotune and (args.device != "cuda" or not args.compile):
        raise SystemExit("bench.py --autotune: a compiled GPU row's mode (inductor's Triton matmul templates); add "
                         f"--device cuda --compile (this run: --device {args.device}"
                         f"{' --compile' if args.compile else ', not compiled'})")
    if args.fp8 and args.device != "cuda":  # the CPU only emulates fp8 matmuls: nothing to measure
        raise SystemExit(f"bench.py --fp8 {','.join(args.fp8)}: fp8 matmuls are measured on a GPU of compute "
                         f"capability 8.9 or higher; add --device cuda (this run is on {args.device})")
    return args


def fp8_scalings(text: str) -> tuple[str, ...]:
    """An argparse type: a comma-separated list of fp8 scalings, each by vitlab's arithmetic or
    torchao's ("tensorwise,rowwise,torchao-tensorwise")."""
    allowed = tuple(impl[len(FP8_IMPL_PREFIX):] for impl in FP8_IMPLS)
    scalings = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if not scalings or any(s not in allowed for s in scalings):
        raise argparse.ArgumentTypeError(f"{text!r}: expected scalings among {', '.join(allowed)}, comma-separated")
    return scalings


def fp8_layers(text: str) -> tuple[str, ...]:
    """An argparse type: a comma-separated list of block dense layers ("mlp.fc1,mlp.fc2")."""
    from vitlab.fast.fp8 import check_fp8_layers

    try:
        return check_fp8_layers(tuple(v.strip() for v in text.split(",") if v.strip()), "--fp8-layers")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def build_cases(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """(peak matmul cases, model cases), each a JSON-able dict with an 'id'."""
    from vitlab import machine

    common = dict(
        device=args.device,
        # the cores this process may run on (its affinity mask, a container's CPU quota): the host's
        # count would run every column oversubscribed
        threads=args.threads or (machine.usable_cores() if args.device == "cpu" else None),
        warmup=1 if args.quick else 3,
        repeats=args.repeats,
        min_seconds=0.0 if args.quick else 1.0,
    )
    # 2048^3 under-read the CPU peak (models then showed > 100% of it): --quick keeps 4096
    size = 8192 if args.device == "cuda" else 4096
    dtypes = ("float32", "bfloat16") if bf16_wanted(args) else ("float32",)
    # every kernel that can compute a dtype's matmul here (a GPU: its own); the peak is a
    # best-of, so more repeats than a model row, that it is not under-read
    peaks = [dict(common, kind="matmul", dtype=dt, kernel=kernel, size=size, id=f"peak/{dt}/{kernel}",
                  repeats=max(common["repeats"], 7))
             for dt, kernel in PEAK_KERNELS
             if dt in dtypes and (args.device == "cpu" or kernel in ("aten", "bf16"))
             and (kernel != "onednn" or onednn_available())]
    peers = peers_available(args.device)
    dtypes = DTYPES if bf16_wanted(args) else ("fp32",)
    cases = []
    train = TRAIN + (TRAIN_GPU if args.device == "cuda" else [])
    infer = INFER_GPU if args.device == "cuda" else INFER
    for kind, rows in (("infer", infer), ("train", train)):
        for model, batch in rows:
            for dtype in dtypes:
                before = ["vitlab-before"] if args.before else []
                # fp8 matmuls run inside bf16 autocast, and only in training (vitlab.fast.fp8)
                fp8 = [FP8_IMPL_PREFIX + s for s in args.fp8] if kind == "train" and dtype == "bf16" else []
                cudnn = [CUDNN_IMPL] if args.attention == "cudnn" and dtype == "bf16" else []  # cuDNN: 16-bit only
                autotune = [AUTOTUNE_IMPL] if args.autotune else []
                for impl in ["vitlab"] + fp8 + cudnn + autotune + peers + ["vitlab-plain"] + before:
                    serving = impl == "onnxruntime"  # vitlab's export: fp32 CPU inference only
                    if serving and (kind == "train" or dtype != "fp32" or args.device != "cpu"):
                        continue
                    if impl.endswith(BF16_WEIGHTS) and (kind == "train" or dtype != "bf16"):
                        continue  # a model held in bf16: inference in bf16 only
                    cases.append(dict(
                        common, kind="inference" if kind == "infer" else "train", model=model,
                        batch=batch, dtype=dtype, impl=impl,
                        compile=args.compile and not serving,
                        cache_dir=getattr(args, "cache_dir", None),
                        id=f"{kind}/{model}/b{batch}/{dtype}/{impl}",
                    ))
                    if impl == "vitlab-before":
                        cases[-1].update(pythonpath=args.before_path)
                    if impl in fp8 and args.fp8_layers:
                        cases[-1].update(fp8_layers=list(args.fp8_layers))
    if args.only:
        cases = [c for c in cases if re.search(args.only, c["id"])]
    return peaks, cases


def onednn_available() -> bool:
    import torch

    return torch.backends.mkldnn.is_available()


def bf16_wanted(args: argparse.Namespace) -> bool:
    if args.bf16 != "auto":
        return args.bf16 == "yes"
    if args.device == "cuda":
        return True
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def machine(args: argparse.Namespace) -> dict:
    info = {"host": socket.gethostname(), "python": platform.python_version(), "device": args.device,
            "cpu": cpu_name(), "cpu_count": os.cpu_count(), "vitlab": vitlab_folder()}
    from vitlab.machine import usable_cores

    info["cores"] = usable_cores()  # the threads of the CPU rows unless --threads
    import torch

    from vitlab.fast import kernels
    from vitlab.machine import cpu_class, cpu_info

    cpu = cpu_info()
    info["cpu_class"] = cpu_class(cpu)  # what the kernel rule reads, with vendor and family/model
    info["cpu_vendor"] = cpu.vendor
    info["cpu_family_model"] = cpu.generation or "?"
    info["fast_kernels"] = kernels.choose().describe()
    # what a user's run here gets, and so vitlab's columns (their workers read the same file): a stored
    # `vitlab calibrate` answer where there is one, else the CPU class's rule
    stored = kernels.stored_choice(info=cpu)
    info["fast_kernels_from"] = (f"calibration {kernels.calibration_path()}, "
                                 f"{(kernels.stored_entry(info=cpu) or {}).get('measured', 'undated')}" if stored
                                 else f"the rule ({kernels.rule_for(cpu).measured or 'no figures: the plain kernels'})")
    info["torch"] = torch.__version__
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    for mod in ("transformers", "timm", "onnxruntime"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            pass
    return info


def check_now_is_this_checkout(args: argparse.Namespace) -> None:
    """--before compares this checkout's vitlab with its revision REV: the vitlab the run imports (an
    editable install can point at another checkout) must be this checkout's."""
    now, own = Path(vitlab_folder()), OWN_VITLAB.resolve()
    if now != own:
        raise SystemExit(f"bench.py --before {args.before}: the vitlab measured now is {now}, not this checkout's "
                         f"{own}, whose {args.before} would be the column vitlab-before; run with "
                         f"PYTHONPATH={own.parent} (or pip install -e {own.parent})")


def checked_source(case: dict, result: dict, now: str) -> dict:
    """``result``, or an error where its worker imported another vitlab than its column's: a
    'vitlab-before' row (a ``pythonpath``) the revision's checkout, every other row ``now``."""
    expected = Path(case["pythonpath"], "vitlab").resolve() if case.get("pythonpath") else Path(now)
    got = result.get("vitlab_path")
    if got is None or Path(got) == expected:
        return result
    return {"error": f"imported vitlab from {got}, not {expected}"}


def _loadavg() -> str:
    try:
        return open("/proc/loadavg").read().split(" ")[0]
    except OSError:
        return "?"


def fmt_rate(r: dict) -> str:
    if "error" in r:
        return "error"
    return f"{r['median']:.1f} ({r['min']:.1f}-{r['max']:.1f})"


def _row(case_id: str) -> str:
    return case_id.rsplit("/", 1)[0]


def best_peer(by_impl: dict[str, dict]) -> dict | None:
    """The peer with the highest median over all rounds (the one the row names)."""
    ok = [r for i, r in by_impl.items() if i not in OWN_IMPLS and "error" not in r]
    return max(ok, key=lambda r: r["median"], default=None)


def round_ratios(by_impl: dict[str, dict], against: str | None = None, ours: str = "vitlab") -> list[float]:
    """Each round's vitlab (or the implementation ``ours``) / best peer (or / the implementation
    ``against``), for rounds where both have a figure.

    The peer is the same in every round: the best over all rounds.  Taking each round's
    fastest peer instead would compare vitlab with the maximum of two noisy figures, which
    is biased upward when the peers are level (as HF's sdpa and eager are on the CIFAR-size
    rows): three level implementations with 10% noise would give vitlab about 0.95x.
    """
    best = by_impl.get(against) if against else best_peer(by_impl)
    mine = by_impl.get(ours, {}).get("round_medians", [])
    theirs = best.get("round_medians", []) if best else []
    return [m / peer for m, peer in zip(mine, theirs) if m is not None and peer is not None]


def mib(result: dict) -> str:
    """A result's peak memory, "N MiB"; "memory not measured" where its window could not be
    started (``harness.reset_peak``: the resident set's high-water mark could not be reset, and
    would have counted the model's build)."""
    return "memory not measured" if result["peak_bytes"] is None else f"{result['peak_bytes'] / 2**20:.0f} MiB"


def memory_ratio(ours: dict, best: dict | None) -> str:
    """vitlab's peak memory over the best peer's (the peak of each over its rounds), or "-"."""
    if not best or not best.get("peak_bytes") or ours.get("peak_bytes") is None:  # None: not measured
        return "-"
    return f"{ours['peak_bytes'] / best['peak_bytes']:.2f}x"


def table(results: list[dict], peaks: dict[str, float], impls: list[str]) -> list[list[str]]:
    """One line per (row, dtype): img/s of each implementation, vitlab / best peer in speed and in
    peak memory, % of peak, the two peaks in MiB.

    The speed ratio is the median of the rounds' paired ratios against the best peer
    (``round_ratios``), with their range when there are several; the memory ratio is of the
    peaks over all rounds, against the same peer.  A peer that failed in every round (a timeout,
    out of memory) is named beside the ratio: the best peer is then the best of the others.
    """
    rows: dict[str, dict[str, dict]] = {}
    for r in results:
        rows.setdefault(_row(r["id"]), {})[r["impl"]] = r
    header = ["row"] + [f"{i} img/s" for i in impls] + ["vitlab/best peer", "MiB vitlab/best peer", "vitlab % peak",
                                                          "vitlab MiB", "best peer MiB"]
    with_plain = "vitlab-plain" in impls
    if with_plain:  # the fast path against the model it speeds up: never below 1
        header.append("vitlab/plain")
    with_before = "vitlab-before" in impls
    if with_before:
        header.append("vitlab/before")
    variants = [i for i in impls if i in VARIANT_IMPLS]
    header += [f"{i}/best peer" for i in variants]
    lines = [header]
    for key, by_impl in rows.items():
        ours = by_impl.get("vitlab", {})
        best = best_peer(by_impl)
        ratios = round_ratios(by_impl)
        ratio = f"{statistics.median(ratios):.2f}x" if ratios else "-"
        if len(ratios) > 1:
            ratio += f" ({min(ratios):.2f}-{max(ratios):.2f})"
        peak = peaks.get("bfloat16" if key.endswith("bf16") else "float32")
        share = f"{100 * ours['achieved_flops_per_s'] / peak:.0f}%" if peak and "median" in ours else "-"
        mem = lambda r: mib(r).removesuffix(" MiB") if r and "peak_bytes" in r else "-"  # noqa: E731
        failed = [i for i, r in by_impl.items() if i not in OWN_IMPLS and "error" in r]  # in every round
        lines.append([key] + [fmt_rate(by_impl[i]) if i in by_impl else "" for i in impls]
                     + [ratio + (f" vs {best['impl']}" if best else "")
                        + (f" ({', '.join(failed)} failed)" if failed else ""), memory_ratio(ours, best), share,
                        mem(ours), mem(best)])
        if with_plain:
            plain = round_ratios(by_impl, against="vitlab-plain")
            lines[-1].append(f"{statistics.median(plain):.2f}x ({min(plain):.2f}-{max(plain):.2f})" if plain else "-")
        if with_before:
            then = round_ratios(by_impl, against="vitlab-before")
            lines[-1].append(f"{statistics.median(then):.2f}x ({min(then):.2f}-{max(then):.2f})" if then else "-")
        for impl in variants:  # "-" on the rows without them (fp8: inference; both: fp32)
            ratios = round_ratios(by_impl, ours=impl)
            lines[-1].append(f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
                             if ratios else "-")
    return lines


def print_table(lines: list[list[str]]) -> None:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    for line in lines:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)))


def markdown(lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(lines[0]) + " |", "|" + "---|" * len(lines[0])]
    out += ["| " + " | ".join(line) + " |" for line in lines[1:]]
    return "\n".join(out) + "\n"


def merge_rounds(rounds: list[dict]) -> dict:
    """One result from several rounds: median of the round medians, overall min and max;
    ``round_medians`` keeps each round's median (None where that round failed)."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return rounds[0]
    median = statistics.median(r["median"] for r in ok)
    return dict(ok[0], median=median, min=min(r["min"] for r in ok), max=max(r["max"] for r in ok),
                peak_bytes=None if any(r["peak_bytes"] is None for r in ok) else max(r["peak_bytes"] for r in ok),
                rounds=len(ok),
                achieved_flops_per_s=ok[0]["flops_per_image"] * median,
                round_medians=[r.get("median") for r in rounds])


def round_order(cases: list[dict], round_: int) -> list[dict]:
    """The cases of one round: rows in their order, each row's implementations rotated by
    ``round_`` so that none always runs first after the previous row."""
    rows: dict[str, list[dict]] = {}
    for case in cases:
        rows.setdefault(_row(case["id"]), []).append(case)
    order = []
    for group in rows.values():
        shift = round_ % len(group)
        order += group[shift:] + group[:shift]
    return order


def peak_summary(peaks: dict[str, float]) -> str:
    """'float32 420 by oneDNN matmul (torch.mm 190), bfloat16 ...': each dtype's peak in
    GFLOP/s, the kernel that set it, and the other kernels' best."""
    parts = []
    for dtype in ("float32", "bfloat16"):
        if dtype not in peaks:
            continue
        rates = {kernel: peaks[f"peak/{dtype}/{kernel}"] for dt, kernel in PEAK_KERNELS
                 if dt == dtype and f"peak/{dtype}/{kernel}" in peaks}
        best = max(rates, key=rates.get)
        others = ", ".join(f"{PEAK_KERNELS[dtype, k]} {r / 1e9:.0f}" for k, r in rates.items() if k != best)
        parts.append(f"{dtype} {peaks[dtype] / 1e9:.0f} by {PEAK_KERNELS[dtype, best]}"
                     + (f" ({others})" if others else ""))
    return ", ".join(parts)


def measure_peaks(peak_cases: list[dict], peaks: dict[str, float], timeout: float, when: str) -> None:
    """Update ``peaks`` with the best rates measured now: dtype -> FLOP/s, the best over its
    kernels (the peak "% peak" divides by), and each case id -> FLOP/s (one kernel's best)."""
    for case in peak_cases:
        r = run_case(case, timeout)
        if "error" in r:
            print(f"{case['id']} ({when}): {r['error']}")
            continue
        for key in (case["dtype"], case["id"]):
            peaks[key] = max(peaks.get(key, 0.0), r["flops_per_s"])
        print(f"{case['id'] + ' (' + when + ')':30s} {r['flops_per_s'] / 1e9:8.1f} GFLOP/s "
              f"(best of {case['repeats']}, {case['size']}^3 matmul, {PEAK_KERNELS[case['dtype'], case['kernel']]})")


def write_new(folder: Path, stem: str, text: str) -> Path:
    """``text`` written to ``folder/STEM.json``, or to ``STEM-2.json``, ``-3``, ... where that name is
    taken: a run in the same minute as another keeps the other's record."""
    for n in itertools.count(1):
        path = folder / (f"{stem}.json" if n == 1 else f"{stem}-{n}.json")
        try:
            with open(path, "x") as f:
                f.write(text)
            return path
        except FileExistsError:
            continue


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.before:
        check_now_is_this_checkout(args)
    args.before_path = checkout(args.before, "bench.py") if args.before else None
    # the ONNX Runtime column's export, made by its first worker, in a folder of this run's: an export
    # kept from an earlier run is of the code of that run
    args.cache_dir = tempfile.mkdtemp(prefix="vitlab-bench-")
    atexit.register(shutil.rmtree, args.cache_dir, ignore_errors=True)
    peak_cases, cases = build_cases(args)
    if args.list:
        print("\n".join(c["id"] for c in peak_cases + cases))
        return 0
    info = machine(args)
    timeout = 600 if args.quick else 1800
    print(f"{info.get('gpu') or info['cpu']} ({info['cpu_class']}, family/model {info.get('cpu_family_model')}), "
          f"{info['cores']} cores, torch {info['torch']}; vitlab {info['vitlab']}, fast path: {info['fast_kernels']} "
          f"({info['fast_kernels_from']}); "
          f"{len(cases)} configurations, each in a fresh process; load average {_loadavg()}")
    if not bf16_wanted(args):
        print("bf16 rows skipped: no bf16 hardware here (oneDNN reports none); --bf16 yes forces them")

    peaks: dict[str, float] = {}
    measure_peaks(peak_cases, peaks, timeout, "before")
    runs: dict[str, list[dict]] = {c["id"]: [] for c in cases}
    started = time.time()
    for round_ in range(args.rounds):
        for case in round_order(cases, round_):
            r = checked_source(case, run_case(case, timeout), info["vitlab"])
            r.update(loadavg=_loadavg())
            runs[case["id"]].append(r)
            status = r.get("error") or (f"{fmt_rate(r)} img/s, {mib(r)}, "
                                        f"{r['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s")
            tag = f" [round {round_ + 1}]" if args.rounds > 1 else ""
            print(f"{case['id']:44s} {status}{tag}", flush=True)
    results = [dict(merge_rounds(runs[c["id"]]), id=c["id"], impl=c["impl"], case=c) for c in cases]

    measure_peaks(peak_cases, peaks, timeout, "after")  # the better of before and after is kept
    impls = list(dict.fromkeys(c["impl"] for c in cases))
    lines = table(results, peaks, impls)
    print()
    print_table(lines)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    name = (info.get("gpu") or info["host"]).replace(" ", "_").replace("/", "_")
    record = {"machine": info, "args": vars(args), "peaks_flops_per_s": peaks, "results": results,
              "seconds": time.time() - started}
    path = write_new(out, f"{name}-{stamp}", json.dumps(record, indent=1))
    note = (f"{info.get('gpu') or info['cpu']} ({info['cpu_class']}, family/model {info.get('cpu_family_model')}), "
            f"{info['cores']} cores, torch {info['torch']}, fast path {info['fast_kernels']} "
            f"(by {info['fast_kernels_from'].replace(str(Path.home()), '~')}), "
            f"{'quick' if args.quick else 'full'} run {stamp} UTC; img/s median (min-max); "
            f"peak matmul GFLOP/s: " + peak_summary(peaks))
    command = "python benchmarks/bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    # latest.md is the README's table: a quick or partial run leaves it alone
    table_path = out / ("latest.md" if not (args.quick or args.only) else "partial.md")
    table_path.write_text(f"{note}\n\n`{command.strip()}`\n\n" + markdown(lines))
    print(f"\nwrote {path} and {table_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
