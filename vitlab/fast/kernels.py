"""Which kernels the fast path's CPU blocks use: a rule per CPU class, or a stored calibration.

Three choices, all about CPUs (GPUs keep PyTorch's own kernels):

* ``fp32``, the matmul of an fp32 dense layer: ``"aten"`` is what ``F.linear`` does
  (``addmm``: MKL's GEMM in the official CPU wheels); ``"onednn"`` calls oneDNN's matmul
  (``mkldnn._linear_pointwise``) on the plain weight.  MKL does not take its AVX-512 code
  path on AMD processors, while oneDNN's JIT kernels do.
* ``bf16``, the matmul of a dense layer under bf16 autocast: ``"aten"`` is what autocast's
  ``F.linear`` does (the plain model's arithmetic); ``"onednn"`` calls oneDNN's bf16
  matmul directly, with the bias and a following GELU applied to its fp32 accumulator;
  ``"widened"`` rounds both operands to bf16 and multiplies them with the fp32 GEMM.  The
  product of two bf16 numbers is exact in fp32, so all three compute the same values up to
  the order of the fp32 additions.
* ``attention``, how a fast block attends in fp32: ``"fused"`` is the plain model's
  ``F.scaled_dot_product_attention``; ``"explicit"`` is two matmuls and a softmax.  (Under
  bf16 autocast on a CPU a fast block always attends explicitly: the fused kernel's bf16
  backward is the slow one on every CPU measured.)
* ``training`` and ``inference``: the precisions ("fp32", "bf16") in which the fast blocks
  and layers take over that mode at all.  Where a class's (or a calibration's) fast steps
  lost to the plain model's, that precision and mode are left to the plain forward: the
  fast path is never slower than the model it speeds up.

Whether a kernel *can* run is decided from the CPU's features and oneDNN's own report
(``torch.ops.mkldnn._is_mkldnn_bf16_supported``: false where oneDNN cannot build a bf16
primitive, such as on an AVX2-only CPU), never by trying it; ``check_runnable`` refuses
a forced kernel that cannot run with one line naming the missing feature.

Which kernels *win* is decided by the CPU's class (``vitlab.machine.cpu_class``; that
module reads the CPU) and a table of what was measured on each (``RULES``; the figures:
docs/performance.md).  A class with no figures gets the plain model's arithmetic.
``vitlab calibrate`` (``vitlab.fast.calibration``) times whole training and inference steps
of the plain and fast models once and stores what wins, keyed by the CPU model and the
torch version; ``choose()`` and ``cpu_precision()`` prefer a stored calibration to the
rule.  Nothing is ever timed inside a run, and a run reads the choice once, when it is built.
"""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from vitlab.config import PRECISIONS
from vitlab.machine import CpuInfo, cpu_class, cpu_info

FP32_KERNELS = ("aten", "onednn")
BF16_KERNELS = ("aten", "onednn", "widened")
ATTENTION = ("fused", "explicit")
KERNEL_PRECISIONS = ("fp32", "bf16")  # the precisions fast blocks have kernels for (fp16 runs the plain model)


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The kernels of a fast model's CPU blocks (module text); the defaults are the plain model's."""

    fp32: str = "aten"
    bf16: str = "aten"
    attention: str = "fused"
    training: tuple[str, ...] = ("fp32", "bf16")
    inference: tuple[str, ...] = ("fp32", "bf16")

    def __post_init__(self) -> None:
        for mode in ("training", "inference"):
            precisions = getattr(self, mode)
            if isinstance(precisions, str) or not set(precisions) <= set(KERNEL_PRECISIONS):
                raise ValueError(f"KernelChoice.{mode}={precisions!r}: expected a list of "
                                 f"{', '.join(KERNEL_PRECISIONS)}")
            object.__setattr__(self, mode, tuple(p for p in KERNEL_PRECISIONS if p in precisions))  # JSON gives lists
        for name, allowed in (("fp32", FP32_KERNELS), ("bf16", BF16_KERNELS), ("attention", ATTENTION)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"KernelChoice.{name}={value!r}: expected one of {', '.join(allowed)}")

    def describe(self) -> str:
        """One line for logs: ``fp32 onednn, bf16 onednn, attention fused``."""
        plain = [f"{p} {mode}" for mode in ("training", "inference") for p in KERNEL_PRECISIONS
                 if p not in getattr(self, mode)]
        return (f"fp32 {self.fp32}, bf16 {self.bf16}, attention {self.attention}"
                + (f", plain in {', '.join(plain)}" if plain else ""))

    def takes_over(self, training: bool, bf16: bool) -> bool:
        """Whether the fast path runs a step of this mode (autograd on) and precision."""
        return ("bf16" if bf16 else "fp32") in (self.training if training else self.inference)


class KernelUnavailable(ValueError):
    """A kernel was asked for that this machine cannot run."""


# ----------------------------------------------------------------------------- what can run here


@dataclasses.dataclass(frozen=True)
class OneDNNReport:
    """What this PyTorch's oneDNN says it can do on this CPU (it reads the CPU itself, and
    honours ``ONEDNN_MAX_CPU_ISA``)."""

    available: bool  # PyTorch was built with oneDNN
    bf16: bool       # oneDNN can build bf16 matmul primitives here


def onednn_report() -> OneDNNReport:
    available = torch.backends.mkldnn.is_available()
    return OneDNNReport(available, available and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def why_unavailable(choice: KernelChoice, info: CpuInfo | None = None,
                    report: OneDNNReport | None = None) -> str | None:
    """Why ``choice`` cannot run on this machine (naming the missing feature), or None if it can."""
    info, report = info or cpu_info(), report or onednn_report()
    if "onednn" in (choice.fp32, choice.bf16) and not report.available:
        field = "fp32" if choice.fp32 == "onednn" else "bf16"
        return f"KernelChoice.{field}='onednn' needs a PyTorch built with oneDNN, and this one is not"
    if choice.bf16 == "onednn" and not report.bf16:
        if info.x86 and "avx512f" not in info.flags:
            missing = "AVX-512 (avx512f; AVX512-BF16 or AMX-BF16 to run it at speed)"
        elif info.arm and "bf16" not in info.flags:
            missing = "the Arm BF16 extension (bf16)"
        else:  # the CPU has it, but oneDNN was told not to use it
            limit = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
            missing = f"an instruction set oneDNN is allowed to use (ONEDNN_MAX_CPU_ISA={limit})" if limit else \
                "bf16 support, which oneDNN reports it lacks here"
        return (f"KernelChoice.bf16='onednn': oneDNN's bf16 matmul cannot run on this CPU "
                f"({info.model or 'unknown model'}): it needs {missing}; use bf16='aten' or 'widened'")
    return None


def check_runnable(choice: KernelChoice) -> KernelChoice:
    """``choice``, or ``KernelUnavailable`` (one line naming the missing feature)."""
    if not isinstance(choice, KernelChoice):  # a name ("onednn") failed as "'str' object has no attribute 'fp32'"
        raise TypeError(f"kernels={choice!r:.80}: expected a KernelChoice (vitlab.fast.choose() gives this "
                        "CPU's, KernelChoice(fp32='onednn') names one), or None for this CPU's")
    reason = why_unavailable(choice)
    if reason is not None:
        raise KernelUnavailable(reason)
    return choice


# ----------------------------------------------------------------------------- the rule


@dataclasses.dataclass(frozen=True)
class Rule:
    """What wins on a class of CPU: its fast path's kernels, and what ``--precision auto`` means."""

    kernels: KernelChoice
    precision: str  # "bf16" only where bf16 steps were measured faster than fp32 ones
    measured: str   # where the figures behind it are, or "" for a class with none


PLAIN = Rule(KernelChoice(), "fp32", "")

# (class, vendor or "" for any, x86 family or None for any) -> rule; the figures behind
# each: docs/performance.md.  An AMD part of a family not listed has no figures: plain.
RULES: dict[tuple[str, str, int | None], Rule] = {
    # oneDNN's fp32 matmul runs at about twice MKL's rate on Zen 5 (MKL keeps to AVX2 on AMD)
    # and its bf16 kernel at 2-4x fp32; the fast blocks win every bench row.
    ("avx512_bf16", "AuthenticAMD", 26): Rule(KernelChoice("onednn", "onednn", "fused"), "bf16",
                                              "Zen 5 class, 2026-11-23 to 25"),
    # Zen 4 runs 512-bit work as two 256-bit halves: oneDNN's fp32 matmul gains little over
    # MKL's, enough for inference but not for an fp32 training step, which stays plain.
    ("avx512_bf16", "AuthenticAMD", 25): Rule(KernelChoice("onednn", "onednn", "fused", training=("bf16",)),
                                              "bf16", "Zen 4 class, 2026-11-26"),
    # Intel without AMX runs oneDNN's bf16 kernel at about half its fp32 rate: bf16 operands
    # go through the fp32 GEMM, and bf16 saves memory but not time.
    ("avx512_bf16", "GenuineIntel", None): Rule(KernelChoice("aten", "widened", "fused"), "fp32",
                                                "Intel Xeon VM, AVX512-BF16, no AMX, 2026-11-22/23"),
    # AVX2 only: every GEMM path runs at the same rate, and bf16 is emulated; at the CIFAR size
    # two matmuls and a softmax beat the fused attention kernel in a training step.
    ("avx2", "", None): Rule(KernelChoice("aten", "aten", "explicit"), "fp32",
                             "AMD Zen 3 (issue 41), and Zen 4 with oneDNN and ATen held to AVX2, 2026-11-26"),
}


def rule_for(info: CpuInfo | None = None) -> Rule:
    """The rule of this CPU's class (narrowed by vendor and x86 family where their figures differ)."""
    info = info or cpu_info()
    cls = cpu_class(info)
    for key in ((cls, info.vendor, info.family), (cls, info.vendor, None), (cls, "", None)):
        if key in RULES:
            return RULES[key]
    return PLAIN


def rule_choice(info: CpuInfo | None = None, report: OneDNNReport | None = None) -> KernelChoice:
    """The kernels the CPU's class calls for, less any oneDNN kernel that oneDNN says cannot run here."""
    choice, report = rule_for(info).kernels, report or onednn_report()
    if not report.available:
        choice = dataclasses.replace(choice, fp32="aten")
    if choice.bf16 == "onednn" and not report.bf16:
        choice = dataclasses.replace(choice, bf16="aten")
    return choice


# ----------------------------------------------------------------------------- stored calibrations


def calibration_path() -> Path:
    """Where ``vitlab calibrate`` stores its answer: ``$XDG_CACHE_HOME/vitlab/kernels.json``.

    A relative ``$XDG_CACHE_HOME`` is ignored, as the XDG Base Directory spec says: taken as given,
    each working folder had a calibration of its own, and the one stored was not found elsewhere."""
    root = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(root) if os.path.isabs(root) else Path.home() / ".cache") / "vitlab" / "kernels.json"


CALIBRATION_FORMAT = 3  # entries of other formats are ignored


def calibration_file(path: str | os.PathLike | None = None) -> Path:
    """``path`` as a ``Path`` (a string too: it failed on its missing ``read_text``), or ``calibration_path()``."""
    return Path(path) if path else calibration_path()


def calibration_key(info: CpuInfo) -> str:
    return f"v{CALIBRATION_FORMAT} | {info.vendor} | {info.model} | {info.generation} | torch {torch.__version__}"


def stored_entry(path: str | os.PathLike | None = None, info: CpuInfo | None = None) -> dict | None:
    """The calibration stored for this CPU and torch version, or None: none, another's, or
    damaged (said in a warning: the rule decides in its place, and ``vitlab calibrate`` stores
    it again)."""
    path = calibration_file(path)
    try:
        stored = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:  # UnicodeDecodeError and json's errors are ValueErrors
        return _damaged(path, f"{type(err).__name__}: {err}")
    if not isinstance(stored, dict):
        return _damaged(path, f"a JSON {type(stored).__name__}, not an object of calibrations")
    entry = stored.get(calibration_key(info or cpu_info()))
    return entry if entry is None or isinstance(entry, dict) else _damaged(path, "this CPU's entry is not an object")


def _damaged(path: Path, why: str) -> None:
    warnings.warn(f"stored calibration {path} is damaged ({why}); ignored: the kernel rule decides, and "
                  "`vitlab calibrate` stores a calibration again")
    return None


def stored_choice(path: str | os.PathLike | None = None, info: CpuInfo | None = None) -> KernelChoice | None:
    """The kernels stored for this CPU, if any and if this machine can still run them."""
    entry = stored_entry(path, info)
    try:
        choice = KernelChoice(**entry["kernels"]) if entry is not None else None
    except (KeyError, TypeError, ValueError) as err:
        return _damaged(calibration_file(path), f"this CPU's entry: {type(err).__name__}: {err}")
    return choice if choice is not None and why_unavailable(choice, info) is None else None


def choose(path: str | os.PathLike | None = None, info: CpuInfo | None = None) -> KernelChoice:
    """The kernels of this CPU (``info``, default ``cpu_info()``): its stored calibration where
    there is one, else the rule."""
    info = info or cpu_info()
    return stored_choice(path, info) or rule_choice(info)


def cpu_precision(info: CpuInfo | None = None, path: str | os.PathLike | None = None) -> str:
    """What ``precision="auto"`` means on this CPU (``info``, default ``cpu_info()``): the stored
    calibration's measured answer, else the rule's ("bf16" only on the classes where bf16 steps
    were measured faster), and never "bf16" where oneDNN has no bf16 kernel.  (A GPU's answer
    is the card's: bf16 where it supports it; that is for the run to decide, not the CPU's rule.)"""
    if not onednn_report().bf16:
        return "fp32"
    info = info or cpu_info()
    entry = stored_entry(path, info)
    if entry and entry.get("precision") in KERNEL_PRECISIONS:
        return entry["precision"]
    return rule_for(info).precision


def autocast(device: torch.device, precision: str):
    """bf16 or fp16 autocast on CPU and GPU; fp32 runs plain.  ``precision`` is a resolved one:
    "auto" is decided once, when a run or command is built (``vitlab.fast.cpu_precision`` on a CPU),
    never here, at every batch."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {', '.join(PRECISIONS)} (resolve 'auto' "
                         "when the run is built: vitlab.fast.cpu_precision on a CPU)")
    if precision in ("bf16", "fp16"):
        return _autocast_of_this_call(device.type, torch.bfloat16 if precision == "bf16" else torch.float16)
    return nullcontext()


@contextmanager
def _autocast_of_this_call(device_type: str, dtype: torch.dtype):
    """torch's autocast, whose casts of the parameters last no longer than the block.  torch keeps
    them (its cache) until the outermost autocast ends, and ``vitlab.train.train`` runs inside one
    (a caller's, turned off): every step then read the weights it cast at its first step, the
    zero head of step 0 among them, and a bf16 run trained nothing (its loss ln K throughout)."""
    try:
        with torch.autocast(device_type=device_type, dtype=dtype):
            yield
    finally:
        torch.clear_autocast_cache()


# How a GPU's fused attention is chosen (``run.gpu_attention``): "torch" leaves it to PyTorch's own
# order of backends (FlashAttention first); "cudnn" puts cuDNN's fused attention first, the others
# after it in PyTorch's order, so that a call cuDNN cannot serve falls back as before.
GPU_ATTENTION = ("torch", "cudnn")


def attention_backends(choice: str):
    """A context in which ``F.scaled_dot_product_attention`` prefers the backends of ``choice``
    (``GPU_ATTENTION``); on leaving it, PyTorch's order and enabled backends are as they were.
    Under ``torch.compile`` the order that counts is the one in force when the call is traced."""
    if choice not in GPU_ATTENTION:
        raise ValueError(f"gpu_attention={choice!r}: expected one of {', '.join(GPU_ATTENTION)}")
    if choice == "torch":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    enabled = {SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled(),
               SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled(),
               SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled()}
    order = torch._C._get_sdp_priority_order()
    others = [SDPBackend(value) for value in order if enabled.get(SDPBackend(value), False)]  # disabled ones stay off
    return _priority_kept(sdpa_kernel([SDPBackend.CUDNN_ATTENTION, *others], set_priority=True), order)


@contextmanager
def _priority_kept(context, order: list[int]):
    """``context``, after which PyTorch's order of attention backends is ``order`` again: torch's
    ``sdpa_kernel`` puts back the order of the backends enabled before it and appends the disabled
    ones, so that one the caller had turned off (flash, say) came after the math kernel once turned on."""
    try:
        with context:
            yield
    finally:
        torch._C._set_sdp_priority_order(order)
