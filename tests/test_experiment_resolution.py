"""The speed part of `vitlab experiment resolution` (the paper's Figure 12): the batch search,
the memory extrapolation, and the fresh-process measurement."""
import pytest

from vitlab.experiments import speed
from vitlab.experiments.common import Settings
from vitlab.experiments.resolution import _config_maker

GIB = 2**30


def test_largest_batch_binary_search():
    for true in (0, 1, 5, 64, 100, 1000):
        probes = []

        def fits(b, true=true):
            probes.append(b)
            return b <= true
        assert speed.largest_batch(fits) == true
        assert len(probes) <= 2 * max(true, 1).bit_length() + 2
    assert speed.largest_batch(lambda b: True, limit=300) == 300
    assert speed.largest_batch(lambda b: b <= 1000, start=32) == 1000
    assert speed.largest_batch(lambda b: b <= 10, start=32) == 10
    approx = speed.largest_batch(lambda b: b <= 1000, start=32, rel_tol=0.05)
    assert 950 <= approx <= 1000


def test_extrapolated_largest_batch():
    # 1 GiB after building the model, 0.25 GiB more at batch 2: 8 GiB holds (8 - 1) / 0.125 = 56
    assert speed.extrapolated_largest_batch(1.25 * GIB, 0.25 * GIB, 2, 8 * GIB) == 56
    assert speed.extrapolated_largest_batch(9 * GIB, 0.25 * GIB, 2, 8 * GIB) == 0
    # 1.5 GiB at batch 2 and 3 GiB at batch 8: 0.25 GiB per image over a 1 GiB base
    assert speed.line_fit_largest_batch(1.5 * GIB, 2, 3 * GIB, 8, 8 * GIB) == 28
    assert speed.line_fit_largest_batch(1.5 * GIB, 2, 1.4 * GIB, 8, 8 * GIB) is None
    assert speed.line_fit_largest_batch(1.5 * GIB, 2, 3 * GIB, 8, 8 * GIB, limit=20) == 20


def _fake_runs(monkeypatch, peak_at):
    """run_case answering from ``peak_at(batch)`` (bytes, or None for a failed run); the cases it saw."""
    seen = []

    def run_case(case, timeout=1800):
        seen.append(case)
        peak = peak_at(case["batch"])
        if peak is None:
            return {"error": "exit 1: boom"}
        return dict(median=10.0, min=9.0, max=11.0, threads=2, peak_bytes=peak, rise_bytes=0.25 * GIB)
    monkeypatch.setattr(speed, "run_case", run_case)
    return seen


def test_cpu_rows_extrapolate_from_peak_memory_and_say_so(monkeypatch):
    seen = _fake_runs(monkeypatch, lambda b: 1 * GIB + b * 0.25 * GIB)
    case = dict(device="cpu", batch=2, warmup=2, repeats=3, min_seconds=1.0)
    row = speed.measure(case, 8 * GIB, search=False, tolerance=0.05, limit=speed.LIMIT)
    assert row["img_per_s"] == 5.0 and row["img_per_s_total"] == 10.0  # per core: 2 threads
    assert row["largest_batch"] == 28 and "extrapolated to 8 GiB" in row["method"]
    assert "batch 2 and 8" in row["method"]
    assert [c["batch"] for c in seen] == [2, 8] and seen[1]["repeats"] == 1  # the probe is one untimed call

    # the larger batch took no more memory: the rise at one batch is all there is to go on
    _fake_runs(monkeypatch, lambda b: 1.25 * GIB)
    row = speed.measure(case, 8 * GIB, search=False, tolerance=0.05, limit=speed.LIMIT)
    assert row["largest_batch"] == 56 and row["method"].endswith("from the peak RSS at batch 2")

    _fake_runs(monkeypatch, lambda b: None)
    row = speed.measure(case, 8 * GIB, search=False, tolerance=0.05, limit=speed.LIMIT)
    assert "largest_batch" not in row and row["error"] == "exit 1: boom"


def test_cpu_search_runs_real_batches_against_the_budget(monkeypatch):
    seen = _fake_runs(monkeypatch, lambda b: 1 * GIB + b * 0.25 * GIB if b <= 40 else None)
    case = dict(device="cpu", batch=2, warmup=2, repeats=3, min_seconds=1.0)
    row = speed.measure(case, 8 * GIB, search=True, tolerance=0.0, limit=speed.LIMIT)
    assert row["largest_batch"] == 28 and "searched to 0%" in row["method"]
    assert all(c["repeats"] == 1 for c in seen[1:])


def test_sizes_the_patches_do_not_tile_are_refused_before_measuring(monkeypatch):
    monkeypatch.setattr(speed, "run_case", lambda case, timeout=1800: pytest.fail("measured"))
    with pytest.raises(ValueError, match="ViT-B/16 at 100 px"):
        speed.sweep({"BiT-R50x1": _config_maker("BiT-R50x1", None), "ViT-B/16": _config_maker("ViT-B/16", None)},
                    [224, 100], "cpu", batch=2, budget=8 * GIB)
    assert speed.model_config("ViT-B/16", 384).img_size == (384, 384)
    assert speed.model_config("ViT-B/16", 224).gelu == "exact"  # as benchmarks/harness.py builds it


def test_a_measurement_runs_in_a_fresh_process():
    from vitlab.config import config_to_dict

    tiny = _config_maker("tiny", Settings())(16)
    case = dict(config=config_to_dict(tiny), device="cpu", batch=2, threads=1, warmup=1, repeats=2, min_seconds=0.0)
    r = speed.run_case(case, timeout=120)
    assert r["threads"] == 1 and 0 < r["min"] <= r["median"] <= r["max"]
    assert r["peak_bytes"] > 0 and r["peak_bytes"] >= r["rise_bytes"] >= 0
    assert "error" in speed.run_case(dict(case, config=dict(case["config"], width=-1)), timeout=120)


def test_cuda_rows_take_the_search_from_the_measuring_process(monkeypatch):
    seen = []

    def run_case(case, timeout=1800):
        seen.append(case)
        return dict(median=300.0, min=290.0, max=310.0, threads=16, peak_bytes=GIB, rise_bytes=GIB // 2,
                    largest_batch=700)
    monkeypatch.setattr(speed, "run_case", run_case)
    rows = speed.sweep({"tiny": _config_maker("tiny", Settings())}, [16], "cuda", batch=32, budget=40 * GIB,
                       log=lambda line: None)
    assert seen[0]["largest"] == dict(budget=40 * GIB, tolerance=0.05, limit=speed.LIMIT) and len(seen) == 1
    (row,) = rows
    assert row["img_per_s"] == 300.0 and row["largest_batch"] == 700  # img/s, not per core
    assert row["method"] == "cuda, img/s; largest batch: runs under 40 GiB, searched to 5%"
