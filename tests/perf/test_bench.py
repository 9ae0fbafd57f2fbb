"""The benchmark machinery: subprocess protocol, timing, memory, tables."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

# The scripts import harness as a sibling, as Python does for a script run from its folder
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench  # noqa: E402
import harness  # noqa: E402


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


def test_a_peak_whose_window_could_not_be_started_is_not_measured_and_the_run_says_so(monkeypatch):
    """Where /proc/self/clear_refs could not be written (not Linux, a container that refuses it),
    reset_peak swallowed the error: the resident set's mark kept the model's build (and whatever the
    process had done before), and the row's peak memory counted it without a word."""
    real_open = open

    def refusing(path, *args, **kwargs):
        if str(path) == "/proc/self/clear_refs":
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(harness, "open", refusing, raising=False)
    assert harness.reset_peak("cpu") is None
    mem = harness.PeakMemory("cpu")
    mem.reset()
    assert mem.peak() is None
    case = dict(kind="inference", impl="vitlab", model="ViT-CIFAR", batch=2, dtype="fp32", device="cpu", warmup=1,
                repeats=1, min_seconds=0.0)
    result = harness.measure_model(case)
    assert result["peak_bytes"] is None and result["median"] > 0  # the speed is measured still

    def row(impl, peak):
        return {"id": f"infer/x/b8/fp32/{impl}", "impl": impl, "median": 30.0, "min": 29.0, "max": 31.0,
                "achieved_flops_per_s": 50e9, "flops_per_image": 1.0, "peak_bytes": peak, "round_medians": [30.0]}

    merged = bench.merge_rounds([row("vitlab", 2**20), row("vitlab", None)])
    assert merged["peak_bytes"] is None and bench.mib(merged) == "memory not measured"
    line = bench.table([merged, row("hf-sdpa", 2**21)], {"float32": 100e9}, ["vitlab", "hf-sdpa"])[1]
    assert (line[4], line[6], line[7]) == ("-", "memory not measured", "2")  # the ratio, vitlab MiB, best peer MiB


def test_the_in_process_ab_scripts_run_as_many_threads_as_the_process_has_cores(monkeypatch):
    """peers.py, kernels.py, fast_path.py and hybrid.py set torch's threads to os.cpu_count(): the
    host's CPUs, where a container's CPU quota or an affinity mask leaves the process fewer (bench.py,
    data_wait.py and a user's run take vitlab.machine.usable_cores)."""
    import os

    import fast_path
    import hybrid
    import kernels
    import peers

    class Set(Exception):  # stops an experiment once it has set its threads: nothing is timed
        pass

    def stop(threads):
        raise Set(threads)

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(torch, "set_num_threads", stop)
    monkeypatch.setattr(peers, "run_case", lambda case, timeout: stop(case["threads"]))  # its fresh processes
    for script in (peers, kernels, fast_path, hybrid):
        monkeypatch.setattr(script, "usable_cores", lambda *a, **k: 3, raising=False)
        for name, experiment in script.EXPERIMENTS.items():
            if (script, name) == (kernels, "choice") or (
                    (script, name) == (kernels, "packing") and not torch.backends.mkldnn.is_available()):
                continue  # sets no threads: it prints the kernel choice; needs oneDNN
            with pytest.raises(Set) as threads:
                experiment()
            assert threads.value.args == (3,), (script.__name__, name)


@pytest.mark.parametrize("kind", ["inference", "train"])
def test_what_the_fast_layer_allocates_when_applied_counts_in_vitlabs_peak(kind, monkeypatch):
    """The baseline is the built model before ``optimize``: memory the fast layer keeps from the
    moment it is applied is vitlab's, as a peer's own allocations are the peer's."""
    import mmap

    import vitlab.fast

    size, kept, real = 200_000_000, [], vitlab.fast.optimize  # well above a step of its own

    def optimize(model, **options):
        block = mmap.mmap(-1, size)  # fresh pages, touched: resident from here on
        for offset in range(0, size, mmap.PAGESIZE):
            block[offset] = 1
        kept.append(block)
        return real(model, **options)

    monkeypatch.setattr(vitlab.fast, "optimize", optimize)
    case = dict(kind=kind, impl="vitlab", model="ViT-CIFAR", batch=2, dtype="fp32", device="cpu", warmup=1,
                repeats=1, min_seconds=0.0)
    peak = harness.measure_model(case)["peak_bytes"]
    kept[0].close()
    # the block and the step's own, less what the process freed after the baseline (a collection of
    # earlier tests' objects: 37 KB in one order of the suite); the block not counted would leave a few MB
    assert peak > 0.9 * size


@pytest.mark.slow  # fresh interpreters: this one has imported everything already
@pytest.mark.parametrize("impl", ["vitlab", "hf-eager"])
def test_no_column_counts_an_import_in_its_peak(impl, tmp_path):
    """A module first imported after the baseline counts in the peak as resident memory: torch.optim
    imported torch._dynamo (about 70 MiB) as vitlab's process built its optimizer, where transformers
    had imported it in the peer's process before its baseline (vitlab's training rows, at 130 MiB
    against the peers' 60 at batch 2, carried it)."""
    if impl.startswith("hf-"):
        pytest.importorskip("transformers")
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json, sys\n"
        f"sys.path.insert(0, {str(Path(harness.__file__).parent)!r})\n"
        "import harness\n"
        "seen, real = [], harness.reset_peak\n"
        "harness.reset_peak = lambda device: seen.append(set(sys.modules)) or real(device)\n"
        "harness.worker(json.loads(sys.argv[1]))\n"
        "print('NEW ' + json.dumps(sorted(set(sys.modules) - seen[0])))\n")
    case = dict(kind="train", impl=impl, model="ViT-CIFAR", batch=1, dtype="fp32", device="cpu", warmup=1,
                repeats=1, min_seconds=0.0, threads=1)
    out = subprocess.run([sys.executable, str(probe), json.dumps(case)], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    new = json.loads(out.split("NEW ", 1)[1])
    assert not [m for m in new if m.startswith(("torch._dynamo", "sympy"))] and len(new) < 10, new


def test_time_loop_and_summary():
    calls = []
    times, per_repeat = harness.time_loop(lambda: calls.append(1), lambda: None, warmup=2, repeats=3,
                                          min_seconds=0.0)
    assert len(times) == 3 and per_repeat == 1 and len(calls) == 5
    s = harness.summarize([0.5, 0.25, 1.0], per_call=8)
    assert (s["min"], s["median"], s["max"]) == (8.0, 16.0, 32.0)


@pytest.mark.slow
def test_subprocess_protocol():
    case = dict(kind="matmul", device="cpu", dtype="float32", size=64, warmup=1, repeats=2, min_seconds=0.0,
                threads=1)
    assert harness.run_case(case, timeout=120)["flops_per_s"] > 0
    assert "error" in harness.run_case(dict(case, kind="nonsense"), timeout=120)


@pytest.mark.slow  # a fresh interpreter, whose exit is what removes the folder
def test_the_before_checkout_is_removed_when_the_script_ends(tmp_path):
    """bench.py --before extracted the revision's vitlab/ into a temporary folder and left it there,
    one more after every run."""
    script = ("import sys\n"
              f"sys.path.insert(0, {str(Path(harness.__file__).parent)!r})\n"
              "import harness\n"
              "path = harness.checkout('HEAD', 'bench.py')\n"
              "import os\n"
              "assert os.path.isfile(os.path.join(path, 'vitlab', '__init__.py'))\n"
              "print('CHECKOUT ' + path)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    path = Path(out.split("CHECKOUT ", 1)[1].strip())
    assert path.name.startswith("vitlab-before-") and not path.exists()


def test_before_refuses_to_compare_another_checkouts_vitlab_with_this_ones_revision(monkeypatch, tmp_path):
    """With vitlab imported from another folder (an editable install of another checkout), the
    'vitlab' column measured that code and 'vitlab-before' this checkout's REV: a ratio of two
    unrelated trees."""
    monkeypatch.setattr(bench, "vitlab_folder", lambda: str(tmp_path / "vitlab"), raising=False)
    with pytest.raises(SystemExit, match=r"^bench.py --before HEAD: the vitlab measured now is .*, not this "
                                         r"checkout's .*PYTHONPATH="):
        bench.main(["--before", "HEAD", "--list", "--only", "infer/ViT-B/16/b8/fp32/"])


def test_a_row_whose_worker_imported_another_vitlab_than_its_column_is_an_error(monkeypatch, tmp_path):
    """A 'vitlab-before' worker must run the revision's checkout, not the vitlab of this run."""
    now = str((Path(bench.__file__).resolve().parents[1] / "vitlab"))  # this checkout's, as the run imports it
    monkeypatch.setattr(bench, "vitlab_folder", lambda: now, raising=False)

    def run_case(case, timeout):
        if case["kind"] == "matmul":
            return {"flops_per_s": 1e9}
        return {"median": 1.0, "min": 1.0, "max": 1.0, "peak_bytes": 1, "flops_per_image": 1.0,
                "achieved_flops_per_s": 1.0, "vitlab_path": now}  # every worker imported this run's vitlab

    monkeypatch.setattr(bench, "run_case", run_case)
    assert bench.main(["--before", "HEAD", "--only", "infer/ViT-B/16/b8/fp32/vitlab", "--bf16", "no",
                       "--rounds", "1", "--out", str(tmp_path)]) == 0
    record = json.loads(next(tmp_path.glob("*.json")).read_text())
    errors = {r["impl"]: r.get("error") for r in record["results"]}
    assert errors["vitlab"] is None and errors["vitlab-plain"] is None
    assert errors["vitlab-before"].startswith(f"imported vitlab from {now}, not ")
    assert record["machine"]["vitlab"] == now


def test_each_run_exports_onnx_afresh_outside_the_repository(monkeypatch, tmp_path):
    """The ONNX Runtime column ran an export cached in benchmarks/results/.cache under the model's
    name alone: a later run, of other code, measured the export of the first (and the file, 330 MB for
    ViT-B/16, lay untracked in the repository)."""
    seen = []

    def run_case(case, timeout):
        if case["kind"] == "matmul":
            return {"flops_per_s": 1e9}
        seen.append(case["cache_dir"])
        return {"median": 1.0, "min": 1.0, "max": 1.0, "peak_bytes": 1, "flops_per_image": 1.0,
                "achieved_flops_per_s": 1.0}

    monkeypatch.setattr(bench, "run_case", run_case)
    monkeypatch.setattr(bench, "peers_available", lambda device: ["onnxruntime"])
    for _ in range(2):
        assert bench.main(["--only", "infer/ViT-B/16/b1/fp32/onnxruntime", "--bf16", "no", "--rounds", "1",
                           "--out", str(tmp_path)]) == 0
    repository = Path(bench.__file__).resolve().parents[1]
    assert len(seen) == 2 and seen[0] != seen[1]
    assert not any(Path(d).resolve().is_relative_to(repository) for d in seen)


def test_the_record_says_whether_vitlabs_kernels_came_from_a_stored_calibration(monkeypatch, tmp_path):
    """vitlab's columns run the kernels a user's run gets here: a stored ``vitlab calibrate`` answer,
    else the CPU class's rule.  The table's note named the kernels and not which, so a calibrated
    machine's figures read as the rule's."""
    import dataclasses

    from vitlab.fast import kernels
    from vitlab.machine import cpu_info

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    args = bench.parse_args(["--bf16", "no"])
    assert bench.machine(args)["fast_kernels_from"].startswith("the rule")
    path = kernels.calibration_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({kernels.calibration_key(cpu_info()): {
        "kernels": dataclasses.asdict(kernels.KernelChoice()), "precision": "fp32", "measured": "2026-11-29 04:00"}}))
    assert bench.machine(args)["fast_kernels_from"] == f"calibration {path}, 2026-11-29 04:00"


def test_every_cpu_row_runs_as_many_threads_as_the_process_has_cores(monkeypatch):
    """The default was os.cpu_count(): the host's CPUs, where a container's CPU quota or an affinity
    mask leaves the process fewer, so that every column ran oversubscribed, each as its thread pool
    copes with that (a user's run takes vitlab.machine.usable_cores)."""
    import vitlab.machine

    monkeypatch.setattr(vitlab.machine, "usable_cores", lambda *a, **k: 3)
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 64)
    peaks, cases = bench.build_cases(bench.parse_args(["--only", "infer/ViT-B/16/b8/fp32/", "--bf16", "no"]))
    assert {c["threads"] for c in peaks + cases} == {3}
    _, cases = bench.build_cases(bench.parse_args(["--only", "infer/ViT-B/16/b8/fp32/", "--bf16", "no",
                                                   "--threads", "2"]))
    assert {c["threads"] for c in cases} == {2}


def test_a_quick_run_keeps_its_record_out_of_the_tracked_results(monkeypatch, tmp_path):
    """A --quick run wrote its JSON into benchmarks/results/, tracked: each one an untracked file in the
    repository; it goes to results/quick/, which git ignores; full and --only runs, whose records the
    docs cite, and a run given --out are as they were."""
    def run_case(case, timeout):
        if case["kind"] == "matmul":
            return {"flops_per_s": 1e9}
        return {"median": 1.0, "min": 1.0, "max": 1.0, "peak_bytes": 1, "flops_per_image": 1.0,
                "achieved_flops_per_s": 1.0}

    results = Path(bench.__file__).resolve().parent / "results"
    assert bench.parse_args([]).out == bench.parse_args(["--only", "infer/"]).out == str(results)
    assert bench.parse_args(["--quick", "--out", str(tmp_path)]).out == str(tmp_path)
    assert bench.parse_args(["--quick", "--only", "infer/"]).out == str(results / "quick")
    ignored = subprocess.run(["git", "check-ignore", "-q", str(results / "quick" / "vm-20260101-0000.json")],
                             cwd=results)
    assert ignored.returncode == 0  # git ignores it (1: it does not)
    monkeypatch.setattr(bench, "run_case", run_case)
    monkeypatch.setattr(bench, "peers_available", lambda device: [])
    monkeypatch.setattr(bench, "HERE", tmp_path)
    assert bench.main(["--quick", "--only", "infer/ViT-B/16/b1/fp32/vitlab$", "--bf16", "no"]) == 0
    assert sorted(p.relative_to(tmp_path).parts[:2] for p in tmp_path.rglob("*.*")) == \
        [("results", "quick")] * 2  # the JSON and partial.md


def test_a_run_in_the_same_minute_as_another_keeps_the_others_record(monkeypatch, tmp_path):
    """The record was named by the minute: a second run within it overwrote the first's JSON."""
    def run_case(case, timeout):
        if case["kind"] == "matmul":
            return {"flops_per_s": 1e9}
        return {"median": float(len(case["id"])), "min": 1.0, "max": 1.0, "peak_bytes": 1, "flops_per_image": 1.0,
                "achieved_flops_per_s": 1.0}

    monkeypatch.setattr(bench, "run_case", run_case)
    monkeypatch.setattr(bench, "peers_available", lambda device: [])
    for row in ("infer/ViT-B/16/b1/fp32/vitlab$", "infer/ViT-B/16/b8/fp32/vitlab$"):
        assert bench.main(["--only", row, "--bf16", "no", "--rounds", "1", "--out", str(tmp_path)]) == 0
    records = sorted(tmp_path.glob("*.json"))
    assert len(records) == 2  # (two runs straddling a minute give two names either way)
    assert {json.loads(p.read_text())["args"]["only"] for p in records} == {"infer/ViT-B/16/b1/fp32/vitlab$",
                                                                          "infer/ViT-B/16/b8/fp32/vitlab$"}


def test_cases_and_table():
    args = bench.parse_args(["--quick", "--only", "infer/ViT-B/16/b8/fp32", "--bf16", "no"])
    peaks, cases = bench.build_cases(args)
    assert {p["dtype"] for p in peaks} == {"float32"}
    assert cases and all(c["id"].startswith("infer/ViT-B/16/b8/fp32/") for c in cases)
    assert cases[0]["impl"] == "vitlab" and cases[-1]["impl"] == "vitlab-plain"
    assert "vitlab-packed" not in {c["impl"] for c in cases}
    fake = [
        {"id": "infer/x/b8/fp32/vitlab", "impl": "vitlab", "median": 30.0, "min": 29.0, "max": 31.0,
         "achieved_flops_per_s": 50e9, "peak_bytes": 2**20, "round_medians": [30.0]},
        {"id": "infer/x/b8/fp32/hf-sdpa", "impl": "hf-sdpa", "median": 20.0, "min": 19.0, "max": 21.0,
         "achieved_flops_per_s": 30e9, "peak_bytes": 2**21, "round_medians": [20.0]},
        {"id": "infer/x/b8/fp32/hf-eager", "impl": "hf-eager", "error": "boom"},
    ]
    lines = bench.table(fake, {"float32": 100e9}, ["vitlab", "hf-sdpa", "hf-eager"])
    # a peer that failed in every round is not in the ratio, and the ratio says so: "best peer" was
    # silently the best of those that ran
    assert lines[1][4] == "1.50x vs hf-sdpa (hf-eager failed)"
    assert lines[0][5] == "MiB vitlab/best peer" and lines[1][5] == "0.50x"  # 1 MiB against hf-sdpa's 2
    assert lines[1][6] == "50%"
    assert "| infer/x/b8/fp32 |" in bench.markdown(lines)


def test_references_are_columns_but_never_the_best_peer():
    """vitlab-plain and ONNX Runtime are vitlab's own model: faster or not, the ratio is
    against the best peer only."""
    def result(impl, median):
        return {"id": f"infer/x/b1/fp32/{impl}", "impl": impl, "median": median, "min": median,
                "max": median, "achieved_flops_per_s": median * 1e9, "peak_bytes": 2**20,
                "round_medians": [median]}

    fake = [result("vitlab", 30.0), result("hf-sdpa", 20.0), result("vitlab-plain", 40.0),
            result("onnxruntime", 50.0)]
    by_impl = {r["impl"]: r for r in fake}
    assert bench.best_peer(by_impl)["impl"] == "hf-sdpa"
    assert bench.round_ratios(by_impl) == [1.5]
    line = bench.table(fake, {"float32": 100e9}, ["vitlab", "hf-sdpa", "vitlab-plain", "onnxruntime"])[1]
    assert line[3] == "40.0 (40.0-40.0)" and line[5] == "1.50x vs hf-sdpa"


def test_a_gpu_run_adds_the_vit_b16_training_row_and_no_cpu_serving_columns(monkeypatch):
    monkeypatch.setattr(harness, "peers_available", lambda device: ["hf-sdpa", "timm"])
    monkeypatch.setattr(bench, "peers_available", harness.peers_available)
    _, gpu = bench.build_cases(bench.parse_args(["--device", "cuda", "--only", "^train/"]))
    _, cpu = bench.build_cases(bench.parse_args(["--only", "^train/", "--bf16", "yes"]))
    assert {c["id"] for c in gpu} - {c["id"] for c in cpu} == {
        f"train/ViT-B/16/b128/{dtype}/{impl}" for dtype in ("fp32", "bf16")
        for impl in ("vitlab", "hf-sdpa", "timm", "vitlab-plain")}
    gpu_peaks, everything = bench.build_cases(bench.parse_args(["--device", "cuda"]))
    assert all(c["device"] == "cuda" and c["impl"] != "onnxruntime" for c in everything)
    assert [p["id"] for p in gpu_peaks] == ["peak/float32/aten", "peak/bfloat16/bf16"]


def test_inference_rows_take_the_devices_batches_and_timm_is_a_peer_on_a_gpu(monkeypatch):
    """CPU: ViT-B/16 at batch 1, 8 and 32; a GPU: 1, 64 and 256 (issue 51), with timm among the
    peers where it imports."""
    monkeypatch.setattr(bench, "peers_available", lambda device: ["hf-sdpa", "timm"])

    def batches(argv):
        return sorted({c["batch"] for c in bench.build_cases(bench.parse_args(argv + ["--only", "^infer/"]))[1]})

    assert batches(["--bf16", "no"]) == [1, 8, 32]
    assert batches(["--device", "cuda"]) == [1, 64, 256]
    rows = "infer/ViT-B/16/b(1|64|256)/bf16/(vitlab|timm)$"  # what benchmarks/gpu_check.sh's part B runs
    _, gpu = bench.build_cases(bench.parse_args(["--device", "cuda", "--compile", "--only", rows]))
    assert [(c["batch"], c["impl"]) for c in gpu] == [(b, impl) for b in (1, 64, 256) for impl in ("vitlab", "timm")]
    assert all(c["compile"] and c["dtype"] == "bf16" and c["kind"] == "inference" for c in gpu)


def test_list_prints_the_ids_and_measures_nothing(monkeypatch, capsys):
    monkeypatch.setattr(bench, "peers_available", lambda device: ["timm"])
    monkeypatch.setattr(bench, "run_case", lambda case, timeout: pytest.fail("--list measured " + case["id"]))
    assert bench.main(["--device", "cuda", "--list", "--only", "infer/ViT-B/16/b64/bf16"]) == 0
    assert capsys.readouterr().out.split() == ["peak/float32/aten", "peak/bfloat16/bf16",
                                               *(f"infer/ViT-B/16/b64/bf16/{impl}" for impl in ("vitlab", "timm", "vitlab-plain"))]


def test_model_sizes_come_from_the_registry():
    from vitlab.models.registry import get_config

    b16, registered = harness.vitlab_config("ViT-B/16"), get_config("ViT-B/16")
    assert (b16.width, b16.depth, b16.mlp_dim, b16.num_heads, b16.patch_size) == (
        registered.width, registered.depth, registered.mlp_dim, registered.num_heads, registered.patch_size)
    assert b16.gelu == "exact"  # the peers' GELU
    cifar, ti = harness.vitlab_config("ViT-CIFAR"), get_config("ViT-Ti/16")
    assert (cifar.width, cifar.mlp_dim, cifar.num_heads) == (ti.width, ti.mlp_dim, ti.num_heads)
    assert (cifar.depth, cifar.patch_size, cifar.img_size, cifar.num_classes) == (6, (4, 4), (32, 32), 10)
    assert harness.vitlab_config("ViT-B/16", 384).img_size == (384, 384)


@pytest.mark.parametrize("spec", ["ViT-CIFAR", "ViT-S/16", "ViT-B/16"])
def test_the_hf_peer_is_vitlabs_architecture(spec):
    """Like for like: the peer's config is the one vitlab's own Hugging Face export writes for the
    row's model (width, depth, heads, MLP, patch, image size, classes, LayerNorm eps, GELU, qkv bias)."""
    pytest.importorskip("transformers")
    from vitlab.weights.huggingface import to_huggingface

    ours, _ = harness.make_model("vitlab", spec)
    with warnings.catch_warnings():  # resampling position embeddings at another size: no bench row does
        warnings.simplefilter("ignore")
        expected = to_huggingface(ours)[1]
    for impl in ("hf-sdpa", "hf-eager"):
        peer, _ = harness.make_model(impl, spec)
        got = peer.config.to_dict()
        fields = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
                  "layer_norm_eps", "image_size", "patch_size", "num_channels", "qkv_bias", "hidden_dropout_prob",
                  "attention_probs_dropout_prob")
        assert {f: got[f] for f in fields} == {f: expected[f] for f in fields}
        assert peer.config.num_labels == ours.cfg.num_classes and peer.config._attn_implementation == impl[3:]
        assert sum(p.numel() for p in peer.parameters()) == sum(p.numel() for p in ours.parameters())


def test_the_bf16_weights_peer_is_a_column_of_the_bf16_inference_rows_and_runs_in_bf16(monkeypatch):
    """Hugging Face serves bf16 with the weights in bf16 (``dtype=torch.bfloat16``), not autocast over
    fp32 weights, which casts every weight in every call: a peer vitlab's bf16 inference is measured
    against too."""
    pytest.importorskip("transformers")
    import torch

    monkeypatch.setattr(bench, "peers_available", lambda device: ["hf-sdpa", "hf-sdpa" + harness.BF16_WEIGHTS])
    _, cases = bench.build_cases(bench.parse_args(["--bf16", "yes"]))
    held = {c["id"] for c in cases if c["impl"].endswith(harness.BF16_WEIGHTS)}
    assert held == {f"infer/ViT-B/16/b{b}/bf16/hf-sdpa-bf16w" for b in (1, 8, 32)}
    built, real = [], harness.make_model
    monkeypatch.setattr(harness, "make_model", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    case = dict(kind="inference", impl="hf-sdpa-bf16w", model="ViT-CIFAR", batch=2, dtype="bf16", device="cpu",
                warmup=1, repeats=1, min_seconds=0.0, threads=1)
    assert harness.measure_model(case)["median"] > 0
    model, forward = built[0]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="bf16 inference rows only"):
        harness.measure_model(dict(case, kind="train"))


def test_harness_leaves_sys_path_alone():
    import importlib

    before = list(sys.path)
    importlib.reload(harness)
    importlib.reload(bench)
    assert sys.path == before


def test_the_peak_of_each_dtype_is_the_best_of_its_kernels(monkeypatch):
    monkeypatch.setattr(bench, "onednn_available", lambda: True)
    args = bench.parse_args(["--only", "nothing", "--bf16", "yes"])
    peaks, _ = bench.build_cases(args)
    assert [(p["dtype"], p["kernel"]) for p in peaks] == [
        ("float32", "aten"), ("float32", "onednn"), ("bfloat16", "bf16"), ("bfloat16", "fp32")]
    # every kernel runs and gives a rate (tiny sizes: only that they run)
    for case in peaks:
        assert harness.measure_matmul(dict(case, size=64, warmup=1, repeats=1, min_seconds=0.0))["flops_per_s"] > 0
    # before the rows, then after: fp32 aten, onednn, bf16 kernel, fp32 GEMM on bf16
    rates = iter([190e9, 400e9, 300e9, 280e9,
                  200e9, 420e9, 310e9, 270e9])
    monkeypatch.setattr(bench, "run_case", lambda case, timeout: {"flops_per_s": next(rates)})
    found: dict[str, float] = {}
    bench.measure_peaks(peaks, found, 1.0, "before")
    bench.measure_peaks(peaks, found, 1.0, "after")
    assert found["float32"] == 420e9 and found["bfloat16"] == 310e9
    assert found["peak/float32/aten"] == 200e9 and found["peak/bfloat16/fp32"] == 280e9
    assert bench.peak_summary(found) == ("float32 420 by oneDNN matmul (torch.mm 200), "
                                         "bfloat16 310 by bf16 kernel (fp32 GEMM on bf16 operands 280)")
    # a row's share is of its dtype's best kernel: 210 GFLOP/s is 50% of the fp32 peak, not
    # 105% of torch.mm's
    row = {"id": "infer/x/b1/fp32/vitlab", "impl": "vitlab", "median": 1.0, "min": 1.0, "max": 1.0,
           "achieved_flops_per_s": 210e9, "peak_bytes": 1, "round_medians": [1.0]}
    assert bench.table([row], found, ["vitlab"])[1][4] == "50%"


def test_every_peak_kernel_computes_the_same_product():
    import torch

    def product(dtype, kernel):
        torch.manual_seed(0)  # the same matrices for every kernel
        return harness.matmul_product(dtype, kernel, 64, "cpu")().float()

    kernels = [k for k in harness.PEAK_KERNELS if k[1] != "onednn" or torch.backends.mkldnn.is_available()]
    for dtype, kernel in kernels:
        reference = product(dtype, "aten" if dtype == "float32" else "bf16")
        torch.testing.assert_close(product(dtype, kernel), reference,
                                   **({} if dtype == "float32" else dict(rtol=1e-2, atol=1e-1)))


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


def test_fp8_adds_columns_to_the_gpus_bf16_training_rows_only(monkeypatch):
    monkeypatch.setattr(harness, "peers_available", lambda device: ["hf-sdpa", "timm"])
    monkeypatch.setattr(bench, "peers_available", harness.peers_available)
    _, plain = bench.build_cases(bench.parse_args(["--device", "cuda"]))
    _, with_fp8 = bench.build_cases(bench.parse_args(["--device", "cuda", "--fp8", "tensorwise,rowwise"]))
    added = [c for c in with_fp8 if c not in plain]
    assert [c for c in with_fp8 if c in plain] == plain  # the other cases as they were, in their order
    train_rows = {f"train/{model}/b{batch}/bf16" for model, batch in bench.TRAIN + bench.TRAIN_GPU}
    assert {c["id"] for c in added} == {f"{row}/vitlab-fp8-{scaling}" for row in train_rows
                                        for scaling in ("tensorwise", "rowwise")}
    assert all(c["kind"] == "train" and c["dtype"] == "bf16" and c["device"] == "cuda" for c in added)
    row = [c["impl"] for c in with_fp8 if c["id"].startswith("train/ViT-B/16/b128/bf16/")]
    assert row[:3] == ["vitlab", "vitlab-fp8-tensorwise", "vitlab-fp8-rowwise"]  # beside the default path

    with pytest.raises(SystemExit, match=r"--fp8 tensorwise: fp8 matmuls are measured on a GPU .*--device cuda"):
        bench.parse_args(["--fp8", "tensorwise"])  # the CPU only emulates them
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cuda", "--fp8", "blockwise"])  # argparse names the scalings

    # --fp8-layers: the fp8 columns swap only those layers (the rest stay bf16); no other case changes
    _, mlp_only = bench.build_cases(bench.parse_args(["--device", "cuda", "--fp8", "tensorwise",
                                                      "--fp8-layers", "mlp.fc2,mlp.fc1"]))
    assert {tuple(c.get("fp8_layers", ())) for c in mlp_only if "fp8" in c["impl"]} == {("mlp.fc1", "mlp.fc2")}
    assert not any("fp8_layers" in c for c in mlp_only if "fp8" not in c["impl"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cuda", "--fp8-layers", "mlp.fc1"])  # without --fp8 it chooses nothing


def test_torchaos_fp8_columns_sit_beside_vitlabs_and_build_the_model_with_its_arithmetic(monkeypatch):
    monkeypatch.setattr(harness, "peers_available", lambda device: ["timm"])
    monkeypatch.setattr(bench, "peers_available", harness.peers_available)
    _, cases = bench.build_cases(bench.parse_args(["--device", "cuda", "--fp8", "tensorwise,torchao-tensorwise"]))
    row = [c["impl"] for c in cases if c["id"].startswith("train/ViT-B/16/b128/bf16/")]
    assert row[:3] == ["vitlab", "vitlab-fp8-tensorwise", "vitlab-fp8-torchao-tensorwise"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cuda", "--fp8", "te-tensorwise"])
    pytest.importorskip("torchao.float8")
    import vitlab.fast

    for impl, backend in (("vitlab-fp8-torchao-rowwise", "torchao"), ("vitlab-fp8-rowwise", "vitlab")):
        model, _ = harness.make_model(impl, "ViT-CIFAR")
        model = harness.optimize_if_default(impl, model, fp8_layers=("mlp.fc1", "mlp.fc2"))
        swapped = [m for m in model.modules() if isinstance(m, vitlab.fast.Float8Linear)]
        assert len(swapped) == 2 * len(model.blocks) and vitlab.fast.is_optimized(model)
        assert {(m.fp8_scaling, m.fp8_backend) for m in swapped} == {("rowwise", backend)}


def test_the_cudnn_attention_column_is_on_the_gpus_bf16_rows_and_measures_under_its_backends(monkeypatch):
    monkeypatch.setattr(harness, "peers_available", lambda device: ["timm"])
    monkeypatch.setattr(bench, "peers_available", harness.peers_available)
    _, plain = bench.build_cases(bench.parse_args(["--device", "cuda"]))
    _, cudnn = bench.build_cases(bench.parse_args(["--device", "cuda", "--attention", "cudnn"]))
    assert [c for c in cudnn if c in plain] == plain
    added = [c for c in cudnn if c not in plain]
    bf16_rows = {c["id"].rsplit("/", 1)[0] for c in plain if c["dtype"] == "bf16"}
    assert {c["id"] for c in added} == {f"{row}/vitlab-cudnn" for row in bf16_rows}
    assert {c["kind"] for c in added} == {"train", "inference"}
    with pytest.raises(SystemExit, match=r"--attention cudnn: .*--device cuda"):
        bench.parse_args(["--attention", "cudnn"])
    # the column is vitlab's default path (the fast layer, the trainer's step), its measurement under the backends
    assert "vitlab-cudnn" in harness.OWN_IMPLS
    model, _ = harness.make_model("vitlab-cudnn", "ViT-CIFAR")
    import vitlab.fast

    assert vitlab.fast.is_optimized(harness.optimize_if_default("vitlab-cudnn", model))
    orders = []
    monkeypatch.setattr(harness, "measure_model", lambda case: orders.append(torch._C._get_sdp_priority_order()))
    before = torch._C._get_sdp_priority_order()
    harness.worker({"kind": "train", "impl": "vitlab"})
    harness.worker({"kind": "train", "impl": "vitlab-cudnn"})
    from torch.nn.attention import SDPBackend

    cudnn_first = int(SDPBackend.CUDNN_ATTENTION.value)
    assert orders[0] == before and orders[1][0] == cudnn_first and sorted(orders[1]) == sorted(before)
    assert torch._C._get_sdp_priority_order() == before


def test_the_autotune_column_is_on_every_compiled_gpu_row_and_compiles_in_max_autotune(monkeypatch):
    monkeypatch.setattr(harness, "peers_available", lambda device: ["timm"])
    monkeypatch.setattr(bench, "peers_available", harness.peers_available)
    _, plain = bench.build_cases(bench.parse_args(["--device", "cuda", "--compile"]))
    _, tuned = bench.build_cases(bench.parse_args(["--device", "cuda", "--compile", "--autotune"]))
    assert [c for c in tuned if c in plain] == plain
    added = [c for c in tuned if c not in plain]
    assert {c["id"] for c in added} == {c["id"].rsplit("/", 1)[0] + "/vitlab-autotune" for c in plain
                                        if c["impl"] == "vitlab"}
    assert all(c["compile"] for c in added)
    for argv, named in ((["--autotune", "--compile"], "--device cpu"), (["--device", "cuda", "--autotune"],
                                                                       "not compiled")):
        with pytest.raises(SystemExit, match=rf"--autotune: .*{named}"):
            bench.parse_args(argv)
    # the column is vitlab's own (the fast layer); it trains as the trainer does, in the autotuned mode
    assert "vitlab-autotune" in harness.OWN_IMPLS
    model, _ = harness.make_model("vitlab-autotune", "ViT-CIFAR")
    import vitlab.fast

    assert vitlab.fast.is_optimized(harness.optimize_if_default("vitlab-autotune", model))
    gpu_train = {"kind": "train", "compile": True, "device": "cuda"}
    assert harness.trains_as_the_trainer("vitlab-autotune", gpu_train)
    assert harness.trainer_mode("vitlab-autotune") == "max-autotune" and harness.trainer_mode("vitlab") == \
        "reduce-overhead"
    modes = []
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kw: modes.append(mode) or fn)
    monkeypatch.setattr(harness, "trains_as_the_trainer", lambda impl, case: case["kind"] == "train")
    harness.compiled("vitlab-autotune", model, model, gpu_train)
    harness.compiled("vitlab", model, model, gpu_train)
    harness.compiled("timm", model, model, gpu_train | {"kind": "other"})
    assert modes == ["max-autotune", "reduce-overhead", None]


def test_a_compiled_before_column_compiles_as_that_revisions_vitlab_does(monkeypatch):
    """Under --compile the 'vitlab' column infers through compile_for_inference and, on a GPU, trains
    with the trainer's graphed step; 'vitlab-before' took torch.compile's default mode and the plain
    step even at a revision that has both, so 'vitlab / before' compared two ways of compiling."""
    import vitlab.fast

    calls = []
    monkeypatch.setattr(vitlab.fast, "compile_for_inference", lambda model, precision, **kw: calls.append("frozen"))
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kw: calls.append(mode or "default"))
    model, forward = harness.make_model("vitlab-before", "ViT-CIFAR")
    for impl in ("vitlab", "vitlab-before"):
        harness.compiled(impl, model, forward, {"kind": "inference", "dtype": "fp32", "batch": 2, "compile": True,
                                                "device": "cpu"})
    assert calls == ["frozen", "frozen"]
    gpu_train = {"kind": "train", "compile": True, "device": "cuda"}
    assert harness.trains_as_the_trainer("vitlab-before", gpu_train)
    assert not harness.trains_as_the_trainer("vitlab-plain", gpu_train)


def test_fp8_columns_are_vitlabs_own_with_their_ratio_to_the_best_peer():
    def result(impl, median):
        return {"id": f"train/x/b8/bf16/{impl}", "impl": impl, "median": median, "min": median, "max": median,
                "achieved_flops_per_s": median * 1e9, "peak_bytes": 2**20, "round_medians": [median]}

    fake = [result("vitlab", 30.0), result("vitlab-fp8-tensorwise", 45.0), result("vitlab-fp8-rowwise", 40.0),
            result("timm", 20.0)]
    assert bench.best_peer({r["impl"]: r for r in fake})["impl"] == "timm"
    lines = bench.table(fake, {"bfloat16": 100e9}, ["vitlab", "vitlab-fp8-tensorwise", "vitlab-fp8-rowwise", "timm"])
    assert lines[0][-2:] == ["vitlab-fp8-tensorwise/best peer", "vitlab-fp8-rowwise/best peer"]
    assert lines[1][5] == "1.50x vs timm" and lines[1][-2:] == ["2.25x (2.25-2.25)", "2.00x (2.00-2.00)"]


def test_an_fp8_impl_is_the_model_with_its_blocks_swapped_then_optimized():
    import vitlab.fast

    model, _ = harness.make_model("vitlab-fp8-rowwise", "ViT-CIFAR")
    model = harness.optimize_if_default("vitlab-fp8-rowwise", model)
    assert vitlab.fast.fp8_scaling(model) == "rowwise" and vitlab.fast.is_optimized(model)


def test_vitlabs_compiled_gpu_training_row_runs_the_trainers_step():
    """On a GPU, vitlab's compiled training columns take the trainer's step (the whole step in CUDA
    graphs); every other column, and every CPU row, the plain step."""
    gpu_train = {"kind": "train", "compile": True, "device": "cuda"}
    assert harness.trains_as_the_trainer("vitlab", gpu_train)
    assert harness.trains_as_the_trainer("vitlab-fp8-rowwise", gpu_train)
    for impl in ("timm", "hf-sdpa", "vitlab-plain"):
        assert not harness.trains_as_the_trainer(impl, gpu_train)
    for other in ({"device": "cpu"}, {"compile": False}, {"kind": "inference"}):
        assert not harness.trains_as_the_trainer("vitlab", gpu_train | other)


@pytest.mark.slow  # compiles
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="inductor needs a C++ compiler on a CPU")
def test_the_trainers_step_trains_as_the_peers_step():
    """``graphed_training_step`` (tried on a CPU, where inductor captures no CUDA graph) moves the
    weights as the plain step of forward, backward and torch's AdamW does, to rounding."""
    import copy

    import torch

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, _ = harness.make_model("vitlab", "ViT-CIFAR")
    twin, start = copy.deepcopy(model), copy.deepcopy(model.state_dict())
    x, labels = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    step = harness.graphed_training_step(model, torch.compile(model, mode="reduce-overhead"), x, labels, amp=False)
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-4, weight_decay=0.1)
    for _ in range(3):
        step()
        torch.nn.functional.cross_entropy(twin(x), labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for (name, got), expected in zip(model.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6, msg=name)
    assert any(not torch.equal(v, start[k]) for k, v in model.state_dict().items())  # the steps moved weights
    torch._dynamo.reset()
