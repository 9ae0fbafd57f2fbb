"""Keep freed host memory mapped in a training process (opt-in: ``run.retain_freed_memory``,
``vitlab train --retain-freed-memory``).

PyTorch's CPU tensors come from the C library's malloc.  glibc hands large freed blocks
back to the kernel (everything above an adaptive threshold of at most 32 MiB, and any
free space above 128 KiB-64 MiB at the top of the heap), so every training step maps the
same activations afresh and takes a page fault for each 4 KiB it first writes.  A
training process allocates the same sizes every step, so keeping the memory (what GPU
caching allocators do) saves those faults at the cost of a resident set that stays at
its peak.  Freed space is reused as malloc finds it, so the first steps may still map
some afresh.

It changes malloc for the whole process and for the rest of its life, which is why the
trainer leaves it off unless asked; ``python benchmarks/peers.py retain_memory`` measures
what it gains on a machine.
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
