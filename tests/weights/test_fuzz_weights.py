"""A short fuzzing budget for the weight loaders (benchmarks/fuzz.py runs them longer):
a mutated file is refused with WeightsError or ConfigError, or loads, never anything else;
plus every input that once broke a loader, replayed."""
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fuzz  # noqa: E402

TARGETS = {"safetensors": 100, "npz": 100, "pt": 100}
FAST = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(autouse=True, scope="module")
def _quiet():
    fuzz.quiet()


@pytest.mark.parametrize("target", list(TARGETS))
def test_fuzz_short_budget(target, tmp_path_factory):
    workdir = tmp_path_factory.mktemp(target)

    @settings(FAST, max_examples=TARGETS[target])
    @given(st.randoms(use_true_random=False))
    def run(rng):
        fuzz.check(target, fuzz.mutate_from(target, rng), workdir)

    run()


@pytest.mark.parametrize("target", list(TARGETS))
def test_seeds_load(target, tmp_path):
    assert [fuzz.check(target, data, tmp_path) for data in fuzz.seeds(target)] == ["loaded"]


REGRESSIONS = [(t, p) for t in TARGETS for p in fuzz.corpus(t)]


@pytest.mark.parametrize("target, path", REGRESSIONS, ids=[f"{t}-{p.stem}" for t, p in REGRESSIONS])
def test_inputs_that_once_failed(target, path, tmp_path):
    fuzz.check(target, path.read_bytes(), tmp_path)
