"""benchmarks/figure12.py, the paper's Figure 12: the batch search, the memory extrapolation,
and the fresh-process measurement."""
import json
import sys
from pathlib import Path

import pytest

# the scripts import harness as a sibling, as Python does for a script run from its folder
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import figure12 as speed  # noqa: E402

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


def test_the_search_from_a_batch_above_the_limit_reports_at_most_the_limit():
    # figure12.py --batch 64 --limit 32: the search started at 64 and gave back 64 (or what it found
    # below 64, 40 here) as the largest batch, above the limit it reports, and ran a probe of 64
    for true in (10, 32, 40, 1000):
        probes = []

        def fits(b, true=true):
            probes.append(b)
            return b <= true
        assert speed.largest_batch(fits, limit=32, start=64) == min(true, 32)
        assert max(probes) <= 32


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


def test_a_cpu_row_whose_peak_could_not_be_measured_says_so(monkeypatch):
    """Where the resident set's mark could not be reset (harness.reset_peak: /proc/self/clear_refs not
    writable) the row's peak counted the model's build, and its largest batch was extrapolated from it."""
    from vitlab.config import config_to_dict

    monkeypatch.setattr(speed, "reset_peak", lambda device: None)
    tiny = speed.vitlab_config("ViT-CIFAR", 16)
    case = dict(config=config_to_dict(tiny), device="cpu", batch=2, threads=1, warmup=1, repeats=1, min_seconds=0.0)
    measured = speed.worker(case)
    assert measured["peak_bytes"] is None and measured["rise_bytes"] is None and measured["median"] > 0

    monkeypatch.setattr(speed, "run_case", lambda case, timeout=1800: measured)
    lines = []
    (row,) = speed.sweep(["ViT-CIFAR"], [16], "cpu", batch=2, budget=8 * GIB, log=lines.append)
    assert row["largest_batch"] is None and row["img_per_s"] > 0
    assert row["method"].startswith("cpu, img/s per core; largest batch not measured: the resident set's peak")
    assert lines[0].endswith("largest batch not measured")
    pytest.importorskip("matplotlib")
    speed.plot([row])  # the speed is plotted, the batch left out


def test_cpu_search_runs_real_batches_against_the_budget(monkeypatch):
    seen = _fake_runs(monkeypatch, lambda b: 1 * GIB + b * 0.25 * GIB if b <= 40 else None)
    case = dict(device="cpu", batch=2, warmup=2, repeats=3, min_seconds=1.0)
    row = speed.measure(case, 8 * GIB, search=True, tolerance=0.0, limit=speed.LIMIT)
    assert row["largest_batch"] == 28 and "searched to 0%" in row["method"]
    assert all(c["repeats"] == 1 for c in seen[1:])


def test_sizes_the_patches_do_not_tile_are_refused_before_measuring(monkeypatch, capsys):
    monkeypatch.setattr(speed, "run_case", lambda case, timeout=1800: pytest.fail("measured"))
    with pytest.raises(ValueError, match="ViT-B/16 at 100 px"):
        speed.sweep(["BiT-R50x1", "ViT-B/16"], [224, 100], "cpu", batch=2, budget=8 * GIB)
    assert speed.main(["--models", "ViT-B/16", "--sizes", "100"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("figure12.py: error: --sizes: ViT-B/16 at 100 px")


@pytest.mark.slow
def test_a_measurement_runs_in_a_fresh_process():
    from vitlab.config import config_to_dict

    tiny = speed.vitlab_config("ViT-CIFAR", 16)
    case = dict(config=config_to_dict(tiny), device="cpu", batch=2, threads=1, warmup=1, repeats=2, min_seconds=0.0)
    r = speed.run_case(case, timeout=120)
    assert r["threads"] == 1 and 0 < r["min"] <= r["median"] <= r["max"]
    assert r["peak_bytes"] > 0 and r["peak_bytes"] >= r["rise_bytes"] >= 0
    assert "error" in speed.run_case(dict(case, config=dict(case["config"], width=-1)), timeout=120)


@pytest.mark.slow
def test_the_script_writes_a_row_per_model_and_size_and_its_figure(tmp_path):
    """What ``vitlab experiment resolution --quick`` checked of its speed part before it moved here."""
    argv = ["--models", "ViT-CIFAR", "--sizes", "16", "32", "--batch", "4", "--repeats", "1", "--seconds", "0",
            "--threads", "1", "--limit", "64", "--out", str(tmp_path)]
    assert speed.main(argv) == 0
    (record,) = tmp_path.glob("figure12-cpu-*.json")
    result = json.loads(record.read_text())
    assert result["command"] == "python benchmarks/figure12.py " + " ".join(argv)
    assert [(r["model"], r["img_size"]) for r in result["rows"]] == [("ViT-CIFAR", 16), ("ViT-CIFAR", 32)]
    for r in result["rows"]:
        assert r["img_per_s"] > 0 and 0 <= r["largest_batch"] <= 64
        assert "per core; largest batch extrapolated" in r["method"]
    pytest.importorskip("matplotlib")
    assert record.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_cuda_rows_take_the_search_from_the_measuring_process(monkeypatch):
    seen = []

    def run_case(case, timeout=1800):
        seen.append(case)
        return dict(median=300.0, min=290.0, max=310.0, threads=16, peak_bytes=GIB, rise_bytes=GIB // 2,
                    largest_batch=700)
    monkeypatch.setattr(speed, "run_case", run_case)
    rows = speed.sweep(["ViT-CIFAR"], [16], "cuda", batch=32, budget=40 * GIB, log=lambda line: None)
    assert seen[0]["largest"] == dict(budget=40 * GIB, tolerance=0.05, limit=speed.LIMIT) and len(seen) == 1
    (row,) = rows
    assert row["img_per_s"] == 300.0 and row["largest_batch"] == 700  # img/s, not per core
    assert row["method"] == "cuda, img/s; largest batch: runs under 40 GiB, searched to 5%"
