"""A short fuzzing budget for every untrusted-input reader: the image decoder, the archive
and shard readers, and the weight loaders (``tests/helpers/fuzz.py`` runs the same targets for
longer).  A mutated input is decoded, loaded or refused with vitlab's own error, never
anything else; every input that once broke a reader is replayed."""

import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import fuzz

# examples per target: a few seconds each on one core
TARGETS = {"image": 300, "archive": 60, "shard": 150, "safetensors": 100, "npz": 100, "pt": 100}
SEED_OUTCOMES = {"image": {"decoded"}, "archive": {"read/extracted"}, "shard": {"3 samples, 0 skipped"},
                 "safetensors": {"loaded"}, "npz": {"loaded"}, "pt": {"loaded"}}
FAST = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(autouse=True, scope="module")
def _quiet():
    level = logging.getLogger("vitlab").level
    fuzz.quiet()
    yield
    logging.getLogger("vitlab").setLevel(level)  # the tests after these read vitlab's warnings


@pytest.mark.parametrize("target", list(TARGETS))
def test_fuzz_short_budget(target, tmp_path_factory):
    workdir = tmp_path_factory.mktemp(target)

    @settings(FAST, max_examples=TARGETS[target])
    @given(st.randoms(use_true_random=False))
    def run(rng):
        fuzz.check(target, fuzz.mutate_from(target, rng), workdir)

    run()


@pytest.mark.parametrize("target", list(TARGETS))
def test_seeds_are_accepted(target, tmp_path):
    """The unmutated seeds decode or load, so the fuzzer starts from inputs that reach deep code."""
    assert {fuzz.check(target, data, tmp_path) for data in fuzz.seeds(target)} == SEED_OUTCOMES[target]


REGRESSIONS = [(t, p) for t in TARGETS for p in fuzz.corpus(t)]


@pytest.mark.parametrize("target, path", REGRESSIONS, ids=[f"{t}-{p.stem}" for t, p in REGRESSIONS])
def test_inputs_that_once_failed(target, path, tmp_path):
    fuzz.check(target, path.read_bytes(), tmp_path)
