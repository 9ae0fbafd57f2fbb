"""Which matrix-multiply kernel a CPU dense layer uses: a rule, or a stored calibration.

Two choices, both about CPUs (GPUs keep PyTorch's own kernels):

* ``fp32``: ``"aten"`` is what ``F.linear`` does (``addmm``, i.e. MKL's GEMM in the
  official CPU wheels); ``"onednn"`` calls oneDNN's matmul (``mkldnn._linear_pointwise``)
  on the plain weight.  MKL does not take its AVX-512 code path on AMD processors, while
  oneDNN's JIT kernels do, so on AMD x86 CPUs oneDNN is the faster kernel.
* ``bf16`` (what bf16 autocast's dense layers do): ``"bf16"`` is oneDNN's bf16 kernel;
  ``"fp32"`` rounds both operands to bf16 and multiplies them with the fp32 GEMM.  The
  product of two bf16 numbers is exact in fp32, so both compute the same values up to the
  order of the fp32 additions.  The bf16 kernel wins where the CPU has AMX, or is an AMD
  part with AVX512-BF16 (Zen 4 and later); an Intel CPU with AVX512-BF16 but no AMX runs it
  at about half its fp32 rate, and a CPU without AVX512-BF16 emulates it.

The rule (``rule_choice``) decides from the vendor and the CPU flags alone, so the same
command on the same machine always takes the same path.  ``vitlab calibrate`` times the
kernels once and stores the answer (``calibration_path()``), keyed by the CPU model and
the torch version; ``choose()`` prefers a stored calibration for this CPU to the rule.
Nothing is ever timed inside a run.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import torch

FP32_KERNELS = ("aten", "onednn")
BF16_KERNELS = ("bf16", "fp32")


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The kernels of CPU dense layers: ``fp32`` for fp32 inputs, ``bf16`` under bf16 autocast."""

    fp32: str = "aten"
    bf16: str = "bf16"

    def __post_init__(self) -> None:
        if self.fp32 not in FP32_KERNELS:
            raise ValueError(f"KernelChoice.fp32={self.fp32!r}: expected one of {', '.join(FP32_KERNELS)}")
        if self.bf16 not in BF16_KERNELS:
            raise ValueError(f"KernelChoice.bf16={self.bf16!r}: expected one of {', '.join(BF16_KERNELS)}")
        if self.fp32 == "onednn" and not torch.backends.mkldnn.is_available():
            raise ValueError("KernelChoice.fp32='onednn' needs a PyTorch built with oneDNN")


@dataclasses.dataclass(frozen=True)
class CpuInfo:
    vendor: str  # "AuthenticAMD", "GenuineIntel", or "" where unknown
    model: str
    flags: frozenset[str]

    @property
    def x86(self) -> bool:
        return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def cpu_info() -> CpuInfo:
    """Vendor, model name and feature flags of this CPU (from /proc/cpuinfo on Linux)."""
    vendor, model, flags = "", platform.processor(), frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return CpuInfo(vendor, model, flags)
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "vendor_id" and not vendor:
            vendor = value
        elif key == "model name" and value:
            model = value
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        if vendor and flags and model:
            break
    return CpuInfo(vendor, model, flags)


def rule_choice(info: CpuInfo | None = None) -> KernelChoice:
    """The kernels the CPU's vendor and features call for (see the module text)."""
    info = info or cpu_info()
    onednn = torch.backends.mkldnn.is_available()
    amd = info.vendor == "AuthenticAMD"
    fp32 = "onednn" if onednn and info.x86 and amd and "avx512f" in info.flags else "aten"
    if not info.x86:
        bf16 = "bf16"
    elif "amx_bf16" in info.flags or (amd and "avx512_bf16" in info.flags):
        bf16 = "bf16"
    else:  # Intel without AMX (half rate), or no AVX512-BF16 at all (emulated)
        bf16 = "fp32"
    return KernelChoice(fp32=fp32, bf16=bf16)


def calibration_path() -> Path:
    """Where ``vitlab calibrate`` stores its answer: ``$XDG_CACHE_HOME/vitlab/kernels.json``."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "vitlab" / "kernels.json"


def _calibration_key(info: CpuInfo) -> str:
    return f"{info.vendor} | {info.model} | torch {torch.__version__}"


def stored_choice(path: Path | None = None, info: CpuInfo | None = None) -> KernelChoice | None:
    """The calibration stored for this CPU and torch version, or None (none, or for another)."""
    path = path or calibration_path()
    info = info or cpu_info()
    try:
        entry = json.loads(path.read_text()).get(_calibration_key(info))
        return KernelChoice(**entry["choice"]) if entry else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def choose(path: Path | None = None) -> KernelChoice:
    """This CPU's kernels: its stored calibration where there is one, else the rule."""
    return stored_choice(path) or rule_choice()


def bf16_is_faster(device: torch.device | str) -> bool:
    """Whether training and inference in bf16 beat fp32 on ``device`` (``--precision auto``).

    On a CPU: only where the bf16 kernel is the chosen one; through the fp32 GEMM a bf16
    layer pays its conversions on top of fp32-rate matmuls.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return (device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            and choose().bf16 == "bf16")


# ----------------------------------------------------------------------------- calibration

# (rows, in, out): ViT-B/16 batch 8 MLP in and out, a CIFAR-size ViT batch 128 qkv
CALIBRATION_SHAPES = ((1576, 768, 3072), (1576, 3072, 768), (8320, 192, 576))


def _best_seconds(f, rounds: int) -> float:
    f()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - start)
    return best


def measure(rounds: int = 5) -> dict[str, float]:
    """GFLOP/s of each kernel at ``CALIBRATION_SHAPES`` (the sum of their times), this process's threads."""
    from .linear import onednn_linear  # the kernels as the fast path calls them

    totals = {"fp32/aten": 0.0, "fp32/onednn": 0.0, "bf16/bf16": 0.0, "bf16/fp32": 0.0}
    flops = 0
    with torch.no_grad():
        for rows, d_in, d_out in CALIBRATION_SHAPES:
            x, w, b = torch.randn(rows, d_in), torch.randn(d_out, d_in), torch.randn(d_out)
            xb, wb = x.bfloat16(), w.bfloat16()
            flops += 2 * rows * d_in * d_out
            totals["fp32/aten"] += _best_seconds(lambda: torch.addmm(b, x, w.t()), rounds)
            if torch.backends.mkldnn.is_available():
                totals["fp32/onednn"] += _best_seconds(lambda: onednn_linear(x, w, b), rounds)
            else:
                totals["fp32/onednn"] = float("inf")
            totals["bf16/bf16"] += _best_seconds(lambda: torch.nn.functional.linear(xb, wb), rounds)
            totals["bf16/fp32"] += _best_seconds(lambda: (xb.float() @ wb.float().t()).bfloat16(), rounds)
    return {k: flops / t / 1e9 for k, t in totals.items()}


def calibrate(path: Path | None = None, rounds: int = 5) -> tuple[KernelChoice, dict[str, float]]:
    """Time the kernels once, store the faster of each pair for this CPU and return it."""
    rates = measure(rounds)
    choice = KernelChoice(
        fp32="onednn" if rates["fp32/onednn"] > rates["fp32/aten"] else "aten",
        bf16="bf16" if rates["bf16/bf16"] > rates["bf16/fp32"] else "fp32",
    )
    path = path or calibration_path()
    info = cpu_info()
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    stored[_calibration_key(info)] = {
        "choice": dataclasses.asdict(choice), "gflops": {k: round(v, 1) for k, v in rates.items()},
        "threads": torch.get_num_threads(), "measured": time.strftime("%Y-%m-%d %H:%M"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(stored, indent=2) + "\n")
    tmp.replace(path)
    return choice, rates
