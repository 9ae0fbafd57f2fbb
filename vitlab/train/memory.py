"""Keep freed host memory mapped in a training process.

PyTorch's CPU tensors come from the C library's malloc.  glibc hands large freed blocks
back to the kernel (everything above an adaptive threshold of at most 32 MiB, and any
free space above 128 KiB-64 MiB at the top of the heap), so every training step maps the
same activations afresh and takes a page fault for each 4 KiB it first writes: 30-110
thousand faults per step of the CIFAR-size ViT at batch 128 on the development VM.  A
training process allocates the same sizes every step, so keeping the memory (what GPU
caching allocators do) costs nothing but a resident set that stays at its peak.  Freed
space is reused as malloc finds it, so the first steps may still map some afresh; after
the warm-up a CIFAR-size step at batch 32 took 2.5 faults against 11,700 by default.

Measured with ``python benchmarks/ab.py retain_memory`` (fresh processes, fp32 training
steps of the CIFAR-size ViT and ViT-S/16): 1.05x and 1.07x for vitlab, 1.06-1.22x for
Hugging Face's ViT.  It is a property of the process, not of a model, so ``bench.py``
leaves it off for every implementation.
"""
from __future__ import annotations

import ctypes
import platform
import sys

# mallopt parameters, from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 1 << 30  # blocks up to 1 GiB come from the heap, whose free space is kept
TRIM_THRESHOLD = 2**31 - 1  # the largest value mallopt takes: never trim the heap's top


def retain_freed_memory() -> bool:
    """Make this process's malloc keep freed memory for reuse; False where that is not possible.

    Process-wide and for the rest of the process.  Only glibc on Linux has these knobs;
    elsewhere (macOS, musl, Windows) nothing changes.
    """
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; setting either fixes glibc's adaptive thresholds
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
