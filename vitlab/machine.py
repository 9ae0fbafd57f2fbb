"""The host a process runs on: its CPU, the cores it may use, the memory left, its GPUs.

    machine = Machine.here()        # read once: /proc/cpuinfo, the affinity mask, /proc/meminfo and cgroups, CUDA
    machine.cpu_line()              # "AMD EPYC (avx512_bf16, family/model 26/2)"
    machine.gpu("cuda:1")           # that card's name, memory, bf16 support and compute capability, or None

This module is the only reader of /proc/cpuinfo, /proc/meminfo, the control groups' memory
limits and CPU quotas, and the affinity mask; what depends on the host (the fast path's kernel rule, a run's
"auto" settings, the memory estimate, a record's machine line) asks it.  ``Machine.described``
builds a machine from a /proc/cpuinfo text, so that a test can hold a decision to any CPU on
any host.
"""
from __future__ import annotations

import dataclasses
import math
import os
import platform
from pathlib import Path

import torch

# ----------------------------------------------------------------------------- the CPU


@dataclasses.dataclass(frozen=True)
class CpuInfo:
    vendor: str  # "AuthenticAMD", "GenuineIntel", or "" where unknown
    model: str
    flags: frozenset[str]
    machine: str = dataclasses.field(default_factory=lambda: platform.machine().lower())
    family: int | None = None  # x86 "cpu family": AMD 25 is Zen 3/Zen 4, 26 is Zen 5
    model_number: int | None = None  # x86 "model" within the family

    @property
    def generation(self) -> str:
        """``family/model`` numbers, or "" where unknown: VMs often name every part "AMD EPYC"."""
        return f"{self.family}/{self.model_number}" if self.family is not None else ""

    @property
    def x86(self) -> bool:
        return self.machine in ("x86_64", "amd64", "i686", "x86")

    @property
    def arm(self) -> bool:
        return self.machine in ("aarch64", "arm64")


def cpu_info(path: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    """Vendor, model name, family/model numbers and feature flags of this CPU (from
    /proc/cpuinfo on Linux)."""
    try:
        text = path.read_text()
    except OSError:
        return CpuInfo("", platform.processor(), frozenset())
    return parse_cpuinfo(text)


def parse_cpuinfo(text: str, machine: str | None = None) -> CpuInfo:
    """The first processor of /proc/cpuinfo ``text``.  ``machine`` is the architecture that
    wrote it (``platform.machine()``, this one's, by default): the text does not say."""
    vendor, model, flags = "", platform.processor(), frozenset()
    numbers: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if not key and (vendor or flags):  # the end of the first processor's block
            break
        if key == "vendor_id" and not vendor:
            vendor = value
        elif key == "model name" and value:
            model = value
        elif key in ("cpu family", "model") and value.isdigit():
            numbers.setdefault(key, int(value))
        elif key in ("flags", "Features") and not flags:  # x86, aarch64
            flags = frozenset(value.split())
    machine = (machine or platform.machine()).lower()
    return CpuInfo(vendor, model, flags, machine, family=numbers.get("cpu family"), model_number=numbers.get("model"))


# The classes the fast path's kernel rule knows, from the most capable x86 part down; then
# Arm, then anything else.
CPU_CLASSES = ("amx", "avx512_bf16", "avx512", "avx2", "aarch64", "other")


def cpu_class(info: CpuInfo) -> str:
    """The class of a CPU by its features: ``amx`` (AMX-BF16), ``avx512_bf16`` (AVX-512 with
    AVX512-BF16, no AMX), ``avx512`` (AVX-512 without BF16), ``avx2`` (AVX2, no AVX-512),
    ``aarch64``, or ``other``."""
    if info.arm:
        return "aarch64"
    if not info.x86:
        return "other"
    for cls, flag in (("amx", "amx_bf16"), ("avx512_bf16", "avx512_bf16"), ("avx512", "avx512f"), ("avx2", "avx2")):
        if flag in info.flags:
            return cls
    return "other"


# ----------------------------------------------------------------------------- cores and memory


def usable_cores(cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int:
    """The CPU cores this process may run on: its affinity mask (where the OS has one), or fewer
    where a control group of the process has a CPU quota (``cgroup_cpu_limit``, rounded up: 2.5
    CPUs' time keeps a third core busy in part).  A container's CPU limit is one (docker --cpus,
    Kubernetes, systemd's CPUQuota): its mask is the host's, and threads or workers counted from
    the mask were throttled to the quota's time.  ``cgroup`` and ``root``: as for ``cgroup_memory_left``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_limit(cgroup, root)
    return max(1, cores if quota is None else min(cores, math.ceil(quota)))


def memory_available(meminfo: str = "/proc/meminfo", cgroup: str = "/proc/self/cgroup",
                     cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """The bytes of memory this process can still take: the host's ``MemAvailable``, or less
    where a control group of the process has a memory limit (``cgroup_memory_left``); None
    where neither is known (no /proc/meminfo or no such line, and no limit)."""
    host = None
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                host = int(line.split()[1]) * 1024  # the kernel writes kB
                break
    except (OSError, ValueError, IndexError):
        pass
    limited = cgroup_memory_left(cgroup, cgroup_root)
    return host if limited is None else limited if host is None else min(host, limited)


# a v1 cgroup's limit_in_bytes without a limit is the page counter's largest value (about 2**63)
_NO_CGROUP_LIMIT = 1 << 60


def cgroup_memory_left(cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """What the memory limits of this process's control groups still allow, or None where none
    has a limit: the least, over its cgroup and those above it, of the limit less what the group
    uses less the page cache it can drop (its inactive files).  A container's memory limit is one
    (Docker, Kubernetes, systemd): the kernel kills the process there, however much the host has.
    ``cgroup``: /proc/self/cgroup; ``root``: where the hierarchies are mounted (v2 at the root,
    v1's memory controller under ``memory/``).  Inside a container the path /proc/self/cgroup
    names may be the host's, not mounted there: the folders that exist on the way up are read."""
    left = []
    for v2, folder in _cgroup_folders(cgroup, root, "memory"):
        files = (("memory.max", "memory.current", "inactive_file") if v2 else
                 ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
        group = _cgroup_memory_left(folder, *files)
        if group is not None:
            left.append(group)
    return min(left) if left else None


def _cgroup_folders(cgroup: str, root: str, controller: str) -> list[tuple[bool, Path]]:
    """(whether v2, folder) of each control group of this process that ``controller`` ("memory",
    "cpu") may limit, its own first, then those above it, in each hierarchy /proc/self/cgroup
    (``cgroup``) names: v2's at ``root``, v1's under the folder the controller is mounted at there
    (named as /proc/self/cgroup names its hierarchy, "cpu,cpuacct", or by the controller alone);
    none where ``cgroup`` cannot be read."""
    try:
        lines = Path(cgroup).read_text().splitlines()
    except (OSError, ValueError):
        return []
    found = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2, the unified hierarchy
            folder = Path(root)
        elif controller in controllers.split(","):
            folder = next((Path(root) / name for name in (controllers, controller) if (Path(root) / name).is_dir()),
                          Path(root) / controller)
        else:
            continue
        parts = [p for p in path.strip().split("/") if p]
        found += [(controllers == "", folder.joinpath(*parts[:depth])) for depth in range(len(parts), -1, -1)]
    return found


def cgroup_cpu_limit(cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """The CPUs' worth of time the quotas of this process's control groups allow it (2.0 for
    a quota of 200 ms every 100 ms), the least over its cgroup and those above it, or None where
    none has a quota (or none can be read): v2's ``cpu.max``, v1's ``cpu.cfs_quota_us`` and
    ``cpu.cfs_period_us``.  Paths as for ``cgroup_memory_left``."""
    limits = []
    for v2, folder in _cgroup_folders(cgroup, root, "cpu"):
        try:
            if v2:
                quota, period = (folder / "cpu.max").read_text().split()[:2]
            else:
                quota, period = ((folder / name).read_text().strip() for name in ("cpu.cfs_quota_us",
                                                                                 "cpu.cfs_period_us"))
            if quota in ("max", "-1"):  # no quota
                continue
            quota, period = int(quota), int(period)
        except (OSError, ValueError):  # no such group here, or no quota file: the root's
            continue
        if quota > 0 and period > 0:
            limits.append(quota / period)
    return min(limits) if limits else None


def _cgroup_memory_left(folder: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        limit = (folder / limit_file).read_text().strip()
        if limit == "max" or int(limit) >= _NO_CGROUP_LIMIT:
            return None
        used = int((folder / usage_file).read_text())
    except (OSError, ValueError):  # no such group here, or no limit file: the root's
        return None
    inactive = 0
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key:
                inactive = int(value)
                break
    except (OSError, ValueError):
        pass
    return max(0, int(limit) - used + inactive)


# ----------------------------------------------------------------------------- the machine


# The lowest compute capability with fp8 tensor cores: Ada (8.9: L4, L40, RTX 40); Hopper (9.0: H100, H200) and later
FP8_CAPABILITY = (8, 9)


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str
    total_bytes: int
    free_bytes: int | None  # torch.cuda.mem_get_info when the machine was described; None: not measured
    bf16: bool              # the card computes in bf16 (compute capability 8.0 or later)
    capability: tuple[int, int] | None = None  # CUDA compute capability (major, minor); None: not known

    @property
    def fp8(self) -> bool:
        """Whether the card has fp8 tensor cores (compute capability 8.9 or later); unknown counts as no."""
        return self.capability is not None and tuple(self.capability) >= FP8_CAPABILITY

    def capability_line(self) -> str:
        """"NVIDIA A100-SXM4-80GB (compute capability 8.0)", for messages."""
        known = ".".join(map(str, self.capability)) if self.capability is not None else "unknown"
        return f"{self.name} (compute capability {known})"


def _gpu(index: int, measure_free: bool) -> Gpu:
    """CUDA device ``index`` as it is now.  Its free memory is measured only where asked:
    ``mem_get_info`` opens a CUDA context on the card, which a process keeps for its life."""
    props = torch.cuda.get_device_properties(index)
    free = int(torch.cuda.mem_get_info(index)[0]) if measure_free else None
    return Gpu(props.name, int(props.total_memory), free, props.major >= 8, (props.major, props.minor))


@dataclasses.dataclass(frozen=True)
class Machine:
    """A host as one process sees it."""

    cpu: CpuInfo
    cores: int                    # usable by this process (affinity, and a cgroup's CPU quota)
    memory_available: int | None  # host bytes (MemAvailable, or a cgroup limit's less), None where unknown
    gpus: tuple[Gpu, ...] = ()

    @staticmethod
    def here(gpu_index: int = 0) -> Machine:
        """This host, read once.  CUDA is queried only where ``torch.cuda.is_available()``,
        and the free memory of one card only, ``gpu_index`` (this process's: torchrun's
        ``LOCAL_RANK``), so that no process opens a context on another's card."""
        gpus = ()
        if torch.cuda.is_available():
            gpus = tuple(_gpu(i, measure_free=i == gpu_index) for i in range(torch.cuda.device_count()))
        return Machine(cpu_info(), usable_cores(), memory_available(), gpus)

    @staticmethod
    def described(cpuinfo: str = "", cores: int = 2, memory_available: int | None = 24 << 30,
                  gpus: tuple = (), arch: str = "x86_64") -> Machine:
        """A machine whose /proc/cpuinfo says ``cpuinfo`` (written on an ``arch`` host), on any host."""
        return Machine(parse_cpuinfo(cpuinfo, machine=arch), cores, memory_available, tuple(gpus))

    def cpu_line(self) -> str:
        """The CPU in one line for logs and records: "AMD EPYC (avx512_bf16, family/model 26/2)"."""
        generation = self.cpu.generation
        return (f"{self.cpu.model or 'unknown'} ({cpu_class(self.cpu)}"
                + (f", family/model {generation})" if generation else ")"))

    def gpu(self, device: torch.device | str) -> Gpu | None:
        """The GPU of ``device`` ("cuda" is card 0), or None for a CPU or a card this machine lacks."""
        device = torch.device(device)
        if device.type != "cuda":
            return None
        index = device.index or 0
        return self.gpus[index] if index < len(self.gpus) else None
