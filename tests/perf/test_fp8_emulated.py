"""benchmarks/fp8_emulated.py: bf16 against fp8 at the same steps on a CPU, with the trainer's
refusal of fp8 there lifted for the script's own runs and put back."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import fp8_emulated  # noqa: E402
from vitlab.train import resolve as resolve_module  # noqa: E402


def test_each_variant_is_the_run_fields_it_names_and_bf16_comes_first():
    assert fp8_emulated.variant_changes("bf16") == {"run.fp8": "off"}
    assert fp8_emulated.variant_changes("rowwise") == {"run.fp8": "rowwise", "run.fp8_backend": "vitlab"}
    assert fp8_emulated.variant_changes("torchao-tensorwise") == {"run.fp8": "tensorwise", "run.fp8_backend": "torchao"}
    assert fp8_emulated.parse_args(["--variants", "bf16,torchao-rowwise"]).variants == ["bf16", "torchao-rowwise"]
    for bad in ("tensorwise,bf16", "bf16,blockwise"):
        with pytest.raises(SystemExit):
            fp8_emulated.parse_args(["--variants", bad])


def test_the_refusal_is_lifted_inside_and_back_after_even_on_an_error():
    refusal = resolve_module.check_fp8
    with pytest.raises(RuntimeError):
        with fp8_emulated.fp8_on_this_cpu():
            assert resolve_module.check_fp8 is not refusal
            resolve_module.check_fp8(None, None, None)  # lifted: refuses nothing
            raise RuntimeError("a run that fails")
    assert resolve_module.check_fp8 is refusal
