"""retain_freed_memory: freed blocks stay mapped, so writing them again takes no page faults."""
import platform
import resource
import subprocess
import sys

import pytest

# Fills and frees a 64 MiB tensor a few times, and prints the page faults of the last
# fill.  64 MiB is above glibc's largest adaptive mmap threshold (32 MiB), so by default
# each tensor is a fresh mapping whose 16384 pages all fault when first written.
PROBE = """
import resource, sys, torch
from vitlab.train.memory import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):  # the first cycles may leave small blocks in the freed space
    torch.empty(16 << 20).fill_(1.0)
before = faults()
torch.empty(16 << 20).fill_(1.0)
print(faults() - before)
"""


def last_fill_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def pages_of_64_mib() -> int:
    """How many pages a fresh 64 MiB mapping faults in: 4 KiB pages, or 2 MiB ones where
    the kernel backs every mapping with transparent huge pages."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            huge = "[always]" in f.read()
    except OSError:
        huge = False
    return (64 << 20) // ((2 << 20) if huge else resource.getpagesize())


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="mallopt's thresholds are glibc's")
def test_freed_memory_is_reused_without_page_faults():
    default, retained = last_fill_faults("default"), last_fill_faults("retain")
    assert default >= pages_of_64_mib() // 2  # a fresh mapping: (nearly) every page faults
    assert retained <= default // 10  # the freed block is reused as it is
