"""The benchmark machinery: subprocess protocol, timing, memory, batch search, tables."""
from __future__ import annotations

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench  # noqa: E402
import figure12  # noqa: E402
import harness  # noqa: E402


def test_largest_batch_binary_search():
    for true in (0, 1, 5, 64, 100, 1000):
        probes = []

        def fits(b, true=true):
            probes.append(b)
            return b <= true
        assert figure12.largest_batch(fits) == true
        assert len(probes) <= 2 * max(true, 1).bit_length() + 2
    assert figure12.largest_batch(lambda b: True, limit=300) == 300
    assert figure12.largest_batch(lambda b: b <= 1000, start=32) == 1000
    assert figure12.largest_batch(lambda b: b <= 10, start=32) == 10
    approx = figure12.largest_batch(lambda b: b <= 1000, start=32, rel_tol=0.05)
    assert 950 <= approx <= 1000


def test_extrapolated_largest_batch():
    gib = 2**30
    # 1 GiB after building the model, 0.25 GiB more at batch 2: 8 GiB holds (8 - 1) / 0.125 = 56
    assert figure12.extrapolated_largest_batch(1.25 * gib, 0.25 * gib, 2, 8 * gib) == 56
    assert figure12.extrapolated_largest_batch(9 * gib, 0.25 * gib, 2, 8 * gib) == 0
    # 1.5 GiB at batch 2 and 3 GiB at batch 8: 0.25 GiB per image over a 1 GiB base
    assert figure12.line_fit_largest_batch(1.5 * gib, 2, 3 * gib, 8, 8 * gib) == 28
    assert figure12.line_fit_largest_batch(1.5 * gib, 2, 1.4 * gib, 8, 8 * gib) is None


def test_peak_memory_sees_memory_outside_torch():
    import mmap

    mem = harness.PeakMemory("cpu")
    mem.reset()
    # fresh anonymous pages, touched one by one: a malloc'd array could be served from memory
    # an earlier test freed but the allocator kept resident, which raises no high-water mark
    size = 50_000_000
    block = mmap.mmap(-1, size)
    for offset in range(0, size, mmap.PAGESIZE):
        block[offset] = 1
    block.close()
    assert 45e6 < mem.peak() < 80e6


def test_time_loop_and_summary():
    calls = []
    times, per_repeat = harness.time_loop(lambda: calls.append(1), lambda: None, warmup=2, repeats=3,
                                          min_seconds=0.0)
    assert len(times) == 3 and per_repeat == 1 and len(calls) == 5
    s = harness.summarize([0.5, 0.25, 1.0], per_call=8)
    assert (s["min"], s["median"], s["max"]) == (8.0, 16.0, 32.0)


def test_subprocess_protocol():
    case = dict(kind="matmul", device="cpu", dtype="float32", size=64, warmup=1, repeats=2, min_seconds=0.0,
                threads=1)
    assert harness.run_case(case, timeout=120)["flops_per_s"] > 0
    assert "error" in harness.run_case(dict(case, kind="nonsense"), timeout=120)


def test_cases_and_table():
    args = bench.parse_args(["--quick", "--only", "infer/ViT-B/16/b8/fp32", "--bf16", "no"])
    peaks, cases = bench.build_cases(args)
    assert [p["dtype"] for p in peaks] == ["float32"]
    assert cases and all(c["id"].startswith("infer/ViT-B/16/b8/fp32/") for c in cases)
    assert cases[0]["impl"] == "vitlab"
    fake = [
        {"id": "infer/x/b8/fp32/vitlab", "impl": "vitlab", "median": 30.0, "min": 29.0, "max": 31.0,
         "achieved_flops_per_s": 50e9, "peak_bytes": 2**20, "round_medians": [30.0]},
        {"id": "infer/x/b8/fp32/hf-sdpa", "impl": "hf-sdpa", "median": 20.0, "min": 19.0, "max": 21.0,
         "achieved_flops_per_s": 30e9, "peak_bytes": 2**21, "round_medians": [20.0]},
        {"id": "infer/x/b8/fp32/hf-eager", "impl": "hf-eager", "error": "boom"},
    ]
    lines = bench.table(fake, {"float32": 100e9}, ["vitlab", "hf-sdpa", "hf-eager"])
    assert lines[1][4] == "1.50x vs hf-sdpa"
    assert lines[1][5] == "50%"
    assert "| infer/x/b8/fp32 |" in bench.markdown(lines)


def test_a_gpu_run_adds_the_vit_b16_training_row_and_no_cpu_serving_columns(monkeypatch):
    monkeypatch.setattr(harness, "peers_available", lambda device: ["hf-sdpa", "timm"])
    monkeypatch.setattr(bench, "peers_available", harness.peers_available)
    _, gpu = bench.build_cases(bench.parse_args(["--device", "cuda", "--only", "^train/"]))
    _, cpu = bench.build_cases(bench.parse_args(["--only", "^train/", "--bf16", "yes"]))
    assert {c["id"] for c in gpu} - {c["id"] for c in cpu} == {
        f"train/ViT-B/16/b128/{dtype}/{impl}" for dtype in ("fp32", "bf16") for impl in ("vitlab", "hf-sdpa", "timm")}
    _, everything = bench.build_cases(bench.parse_args(["--device", "cuda"]))
    assert all(c["device"] == "cuda" and c["impl"] not in ("onnxruntime", "vitlab-packed") for c in everything)


def test_the_bf16_peak_is_the_faster_of_the_bf16_kernel_and_the_fp32_gemm(monkeypatch):
    args = bench.parse_args(["--only", "nothing", "--bf16", "yes"])
    peaks, _ = bench.build_cases(args)
    assert [(p["id"], p.get("via")) for p in peaks] == [
        ("peak/float32", None), ("peak/bfloat16", None), ("peak/bfloat16/fp32-gemm", "fp32")]
    # both ways run and give a rate (tiny sizes: only that they run)
    for case in peaks[1:]:
        assert harness.measure_matmul(dict(case, size=64, warmup=1, repeats=1, min_seconds=0.0))["flops_per_s"] > 0
    rates = iter([300e9, 150e9, 280e9, 310e9, 160e9, 270e9])  # before the rows, then after
    monkeypatch.setattr(bench, "run_case", lambda case, timeout: {"flops_per_s": next(rates)})
    found: dict[str, float] = {}
    bench.measure_peaks(peaks, found, 1.0, "before")
    bench.measure_peaks(peaks, found, 1.0, "after")
    assert found["float32"] == 310e9 and found["bfloat16"] == 280e9
    assert found["peak/bfloat16"] == 160e9
    assert bench.peak_summary(found) == "float32 310, bfloat16 280 (bf16 kernel 160, fp32 GEMM 280)"


def _rounds(impl: str, medians: list) -> dict:
    """A merged result of one implementation whose rounds had these medians (None: failed)."""
    return dict(bench.merge_rounds([{"median": m, "min": m, "max": m, "peak_bytes": 1,
                                     "flops_per_image": 1.0} if m else {"error": "x"}
                                    for m in medians]), id=f"r/b1/fp32/{impl}", impl=impl)


def test_rounds_pair_each_round_and_rotate_the_order():
    args = bench.parse_args(["--only", "infer/ViT-B/16/b8/fp32/(vitlab|hf-[a-z]+)$", "--bf16", "no"])
    _, cases = bench.build_cases(args)
    impls = [c["impl"] for c in cases]
    assert impls == ["vitlab", "hf-sdpa", "hf-eager"]
    assert [c["impl"] for c in bench.round_order(cases, 1)] == ["hf-sdpa", "hf-eager", "vitlab"]
    assert [c["impl"] for c in bench.round_order(cases, 3)] == impls

    # sdpa is the best peer over the rounds (median 8 against eager's 7), so every round is
    # paired with sdpa: 10/8, 5/8, and round 3, where sdpa failed, has no ratio
    results = [_rounds("vitlab", [10, 5, 12]), _rounds("hf-sdpa", [8, 8, None]),
               _rounds("hf-eager", [7, 4, 10])]
    assert results[0]["median"] == 10 and results[1]["round_medians"] == [8, 8, None]
    assert bench.round_ratios({r["impl"]: r for r in results}) == [1.25, 0.625]
    line = bench.table(results, {}, ["vitlab", "hf-sdpa", "hf-eager"])[1]
    assert line[4] == "0.94x (0.62-1.25) vs hf-sdpa"


def test_ratio_is_not_biased_by_picking_each_rounds_fastest_peer():
    """Three level implementations whose figures swap by noise: vitlab / best peer is 1.0,
    where pairing each round with its fastest peer would give 10/11 in two rounds of three."""
    results = [_rounds("vitlab", [10, 10, 10]), _rounds("hf-sdpa", [11, 9, 10]),
               _rounds("hf-eager", [9, 11, 10])]
    by_impl = {r["impl"]: r for r in results}
    assert bench.best_peer(by_impl)["impl"] == "hf-sdpa"  # level medians: the first listed
    assert bench.round_ratios(by_impl) == [10 / 11, 10 / 9, 1.0]
    assert bench.table(results, {}, ["vitlab", "hf-sdpa", "hf-eager"])[1][4] == "1.00x (0.91-1.11) vs hf-sdpa"
