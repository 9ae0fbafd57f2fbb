"""``vitlab.machine``: the host described from /proc/cpuinfo and /proc/meminfo texts, its
cores and its GPUs; a described machine is the same on every host."""
from __future__ import annotations

import os

import pytest
import torch

from vitlab.machine import (CPU_CLASSES, CpuInfo, Gpu, Machine, cpu_class, cpu_info, memory_available, parse_cpuinfo,
                            usable_cores)

ZEN4_BLOCK = ("processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
              "model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n")
INTEL_AVX2 = ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 63\n"
              "model name\t: Intel(R) Xeon(R) CPU E5-2676 v3 @ 2.40GHz\nflags\t\t: fpu sse sse2 avx fma avx2\n\n")
GRAVITON = ("processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd sve bf16 i8mm\nCPU implementer\t: 0x41\n\n"
            "processor\t: 1\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd\n\n")
H100 = Gpu("NVIDIA H100 80GB HBM3", 80 << 30, 79 << 30, True, (9, 0))
T4 = Gpu("Tesla T4", 15 << 30, 14 << 30, False, (7, 5))


def test_cpu_info_reads_the_first_processors_family_and_model_numbers(tmp_path):
    (tmp_path / "cpuinfo").write_text(ZEN4_BLOCK.format(n=0) + ZEN4_BLOCK.format(n=1).replace(": 17", ": 99"))
    info = cpu_info(tmp_path / "cpuinfo")
    assert (info.vendor, info.model, info.family, info.model_number) == ("AuthenticAMD", "AMD EPYC", 25, 17)
    assert info.flags == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    assert info.generation == "25/17"


def test_parse_cpuinfo_reads_arm_features_and_has_no_family_there():
    info = parse_cpuinfo(GRAVITON, machine="aarch64")
    assert info.flags == {"fp", "asimd", "sve", "bf16", "i8mm"}  # the first processor's, not the second's
    assert info.arm and not info.x86 and info.family is None and info.generation == ""
    assert cpu_class(info) == "aarch64"


@pytest.mark.parametrize("text, arch, cls", [
    (ZEN4_BLOCK.format(n=0), "x86_64", "avx512_bf16"),
    (INTEL_AVX2, "x86_64", "avx2"),
    (INTEL_AVX2.replace(" avx2", ""), "x86_64", "other"),
    (ZEN4_BLOCK.format(n=0).replace("avx512_bf16", "amx_bf16"), "x86_64", "amx"),
    (ZEN4_BLOCK.format(n=0).replace(" avx512_bf16", ""), "x86_64", "avx512"),
    (ZEN4_BLOCK.format(n=0), "riscv64", "other"),  # x86 flags on another architecture say nothing
])
def test_cpu_class_from_the_flags_and_the_architecture(text, arch, cls):
    assert cpu_class(parse_cpuinfo(text, machine=arch)) == cls and cls in CPU_CLASSES


def test_cpu_line_names_the_model_the_class_and_the_family_and_model_numbers():
    assert Machine.described(ZEN4_BLOCK.format(n=0)).cpu_line() == "AMD EPYC (avx512_bf16, family/model 25/17)"
    assert Machine.described(GRAVITON, arch="aarch64").cpu_line().endswith(" (aarch64)")  # no numbers on Arm
    unnamed = Machine(CpuInfo("", "", frozenset(), "x86_64"), 1, None)
    assert unnamed.cpu_line() == "unknown (other)"


def test_a_described_machine_is_what_it_was_told():
    machine = Machine.described(INTEL_AVX2, cores=8, memory_available=None, gpus=[H100, T4])
    assert machine.cpu.vendor == "GenuineIntel" and machine.cpu.x86 and machine.cpu.generation == "6/63"
    assert (machine.cores, machine.memory_available, machine.gpus) == (8, None, (H100, T4))
    default = Machine.described()
    assert (default.cores, default.memory_available, default.gpus) == (2, 24 << 30, ())
    with pytest.raises(AttributeError):  # frozen: a machine read once stays as it was read
        default.cores = 4


def test_gpu_looks_a_device_up_by_its_index():
    machine = Machine.described(ZEN4_BLOCK.format(n=0), gpus=(H100, T4))
    assert machine.gpu("cuda") is H100 and machine.gpu("cuda:0") is H100  # "cuda" is card 0
    assert machine.gpu(torch.device("cuda", 1)) is T4 and machine.gpu("cuda:1").bf16 is False
    assert machine.gpu("cuda:2") is None  # a card this machine lacks
    assert machine.gpu("cpu") is None and machine.gpu(torch.device("cpu")) is None
    assert Machine.described().gpu("cuda") is None


def test_fp8_tensor_cores_come_with_compute_capability_8_9(monkeypatch):
    import types

    import vitlab.machine as machine_module

    assert H100.fp8 and not T4.fp8
    assert Gpu("NVIDIA L4", 24 << 30, None, True, (8, 9)).fp8
    assert not Gpu("NVIDIA A100", 80 << 30, None, True, (8, 0)).fp8
    assert not Gpu("unknown card", 1 << 30, None, True).fp8  # described without its capability: not assumed
    assert T4.capability_line() == "Tesla T4 (compute capability 7.5)"
    # a card read from CUDA carries its capability (the properties faked: no GPU needed)
    props = types.SimpleNamespace(name="NVIDIA L40S", total_memory=48 << 30, major=8, minor=9)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    card = machine_module._gpu(0, measure_free=False)
    assert card == Gpu("NVIDIA L40S", 48 << 30, None, True, (8, 9)) and card.fp8


def test_memory_available_reads_memavailable_in_bytes(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    no_cgroup = str(tmp_path / "none")  # this host's cgroups may have a limit of their own
    assert memory_available(str(meminfo), no_cgroup) == 20000000 * 1024
    assert memory_available(str(tmp_path / "none"), no_cgroup) is None  # no /proc: unknown
    meminfo.write_text("MemTotal:       24000000 kB\n")  # a kernel too old to write it
    assert memory_available(str(meminfo), no_cgroup) is None


def test_a_cgroup_memory_limit_bounds_the_memory_available(tmp_path):
    # in a container (Docker, Kubernetes) MemAvailable is the host's: the kernel kills a run at the
    # container's limit, however much the host still has
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       64000000 kB\nMemAvailable:   60000000 kB\n")
    host = 60000000 * 1024
    root, cgroup = tmp_path / "cgroup", tmp_path / "self-cgroup"
    job = root / "system.slice" / "job.scope"
    job.mkdir(parents=True)
    (job / "memory.max").write_text("4000000000\n")
    (job / "memory.current").write_text("1500000000\n")
    (job / "memory.stat").write_text("anon 1000000000\nfile 500000000\ninactive_file 300000000\n")
    cgroup.write_text("0::/system.slice/job.scope\n")

    def available(**paths):
        return memory_available(str(meminfo), str(cgroup), str(root), **paths)

    assert available() == 4000000000 - 1500000000 + 300000000  # the page cache it may drop is not in use
    (job / "memory.max").write_text("max\n")
    assert available() == host  # no limit: the host's
    (root / "system.slice" / "memory.max").write_text("2000000000\n")  # a lower limit above it
    (root / "system.slice" / "memory.current").write_text("1000000000\n")
    assert available() == 1000000000
    # cgroup v1, in a container that mounts its own group at the hierarchy's root
    cgroup.write_text("9:name=systemd:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    (root / "memory").mkdir()
    (root / "memory" / "memory.limit_in_bytes").write_text("8000000000\n")
    (root / "memory" / "memory.usage_in_bytes").write_text("3000000000\n")
    (root / "memory" / "memory.stat").write_text("inactive_file 5\ntotal_inactive_file 1000000000\n")
    assert available() == 6000000000
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert available() == host
    assert memory_available(str(tmp_path / "none"), str(cgroup), str(root)) is None
    (root / "memory" / "memory.limit_in_bytes").write_text("8000000000\n")
    assert memory_available(str(tmp_path / "none"), str(cgroup), str(root)) == 6000000000  # no /proc/meminfo
    assert memory_available(str(meminfo), str(tmp_path / "none"), str(root)) == host  # no /proc/self/cgroup


def test_a_cgroup_cpu_quota_bounds_the_usable_cores(tmp_path, monkeypatch):
    # a container limited to 2 CPUs (docker --cpus 2, a Kubernetes limit) on a 64-core host still has
    # all 64 in its affinity mask: threads and workers chosen from the mask were throttled to 2 CPUs' time
    root, cgroup = tmp_path / "cgroup", tmp_path / "self-cgroup"
    job = root / "system.slice" / "job.scope"
    job.mkdir(parents=True)
    cgroup.write_text("0::/system.slice/job.scope\n")
    mask = set(range(64))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: mask, raising=False)

    def cores():
        return usable_cores(str(cgroup), str(root))

    assert cores() == 64  # no limit file: the mask's
    (job / "cpu.max").write_text("max 100000\n")
    assert cores() == 64
    (job / "cpu.max").write_text("200000 100000\n")
    assert cores() == 2
    (job / "cpu.max").write_text("250000 100000\n")  # 2.5 CPUs: the third core is used in part
    assert cores() == 3
    (job / "cpu.max").write_text("20000 100000\n")  # a fifth of a CPU: still one thread
    assert cores() == 1
    (root / "system.slice" / "cpu.max").write_text("100000 100000\n")  # a lower limit above it
    assert cores() == 1
    (job / "cpu.max").write_text("800000 100000\n")
    assert cores() == 1
    (root / "system.slice" / "cpu.max").unlink()
    mask.difference_update(range(4, 64))  # a mask narrower than the quota: the mask's
    assert cores() == 4
    # cgroup v1 (the cpu controller mounted as "cpu,cpuacct"), in a container that mounts its own group at the root
    mask.update(range(64))
    cgroup.write_text("9:name=systemd:/docker/abc\n3:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    (root / "cpu,cpuacct").mkdir()
    (root / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no limit"
    (root / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    assert cores() == 64
    (root / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("400000\n")
    assert cores() == 4
    (root / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("garbage\n")  # unreadable: no limit known
    assert cores() == 64
    assert usable_cores(str(tmp_path / "none"), str(root)) == 64  # no /proc/self/cgroup


def test_here_is_this_process_on_this_host():
    machine = Machine.here()
    if hasattr(os, "sched_getaffinity"):
        assert machine.cores <= len(os.sched_getaffinity(0))
    assert machine.cores == usable_cores()
    assert machine.cores >= 1 and machine.cpu == cpu_info()
    assert machine.memory_available is None or machine.memory_available > 0
    assert len(machine.gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    for index, gpu in enumerate(machine.gpus):  # only this process's card is measured
        assert (0 < gpu.free_bytes <= gpu.total_bytes) if index == 0 else gpu.free_bytes is None
