"""The prepared GPU check's CIFAR-10 runs (benchmarks/gpu_check.sh part C) as a lent H200 would
build them: a device lent for 15 minutes is no place to find that a config check added since
refuses one of the variants its header plans (each new refusal is made on a CPU run's config)."""
from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


def header() -> str:
    """The script's leading comment, the '#' of each line taken off."""
    lines = []
    for line in SCRIPT.read_text().splitlines()[1:]:
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    return " ".join(lines)


def planned_variants() -> list[str]:
    """Every PART_C_SETS variant the header gives: the '|'-separated parts of each PART_C_SETS="..."
    and each quoted "|..." fragment to add, with $CPU_MODEL and the steps placeholders filled in."""
    text = header()
    cpu_model = re.search(r'CPU_MODEL="([^"]*)"', text).group(1)
    quoted = re.findall(r'PART_C_SETS="([^"]*)"', text) + re.findall(r'"(\|[^"]*)"', text)
    variants = {re.sub(r"\{STEPS1\}|\bS$", "100", part.strip().replace("$CPU_MODEL", cpu_model))
                for q in quoted for part in q.split("|")}
    return sorted(variants)


def test_the_header_plans_the_variants_this_test_builds():
    variants = planned_variants()
    # the recipe itself, and the planned changes of it: a parse that found none would pass every check below
    assert "" in variants and "--set run.compile_optimizer=true" in variants
    assert any(v.startswith("--fp8 tensorwise") and "--steps 100" in v for v in variants)
    assert any("model.width=192" in v for v in variants)
    assert len(variants) >= 7


@pytest.mark.parametrize("extra", planned_variants())
def test_each_planned_cifar_variant_builds_on_an_h200(extra, tmp_path):
    from vitlab.cli import build_parser
    from vitlab.config import ConfigError
    from vitlab.cli.train import resolve_config
    from vitlab.machine import Gpu, Machine
    from vitlab.train.distributed import World
    from vitlab.train.overrides import field_value
    from vitlab.train.resolve import resolve

    # the script's command, the data the built-in digits (the config is what is checked, not the images)
    argv = ["train", "--recipe", "cifar10_scratch:model=vit", "--data", "digits", "--time-limit", "3",
            *shlex.split(extra), "--out", str(tmp_path / "run"), "--overwrite"]
    args = build_parser().parse_args(argv)
    h200 = Gpu("NVIDIA H200", total_bytes=143 << 30, free_bytes=140 << 30, bf16=True, capability=(9, 0))
    machine = dataclasses.replace(Machine.described(cores=16, memory_available=120 << 30), gpus=(h200,))
    run = resolve(resolve_config(args), World(0, 1, 0, torch.device("cuda:0")), machine)
    cfg = run.config
    assert cfg.run.device.startswith("cuda") and cfg.model.name is not None
    # the variant's own settings took effect over the recipe's GPU form (later arguments win)
    for field, value in re.findall(r"--set (\S+)=(\S+)", extra):
        try:
            got = field_value(cfg, field)
        except ConfigError:  # the architecture's fields: model.overrides
            got = cfg.model.overrides[field.split(".", 1)[1]]
        assert str(got).lower() == value.lower() or float(got) == float(value), (field, got, value)
    if "--fp8" in extra:
        assert cfg.run.fp8 == "tensorwise" and cfg.optim.steps == 100
