"""retain_freed_memory: freed blocks stay mapped, so writing them again takes no page faults."""
import platform
import subprocess
import sys

import pytest

# Fills a 64 MiB tensor, frees it, fills another, and prints the page faults of the second
# fill.  64 MiB is above glibc's largest adaptive mmap threshold (32 MiB), so by default
# each tensor is a fresh mapping whose 16384 pages all fault when first written.
PROBE = """
import resource, sys, torch
from vitlab.train.memory import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(16 << 20).fill_(1.0)
before = faults()
torch.empty(16 << 20).fill_(1.0)
print(faults() - before)
"""


def second_fill_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="mallopt's thresholds are glibc's")
def test_freed_memory_is_reused_without_page_faults():
    assert second_fill_faults("default") > 10_000  # the 16384 pages of a fresh mapping
    assert second_fill_faults("retain") < 1_000
