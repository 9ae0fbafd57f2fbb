"""``optim.accum_steps="auto"`` on a GPU: the micro-batch chosen by measuring a step's peak.
The choice is held to a brute-force reference with fake probes (no GPU needed); the wiring
through ``resolve`` with a fake probe standing in for the GPU's; the probe itself on a real
GPU is ``tests/test_cuda.py``'s."""
from __future__ import annotations

import contextlib
import json

import pytest
import torch

from vitlab.config import ConfigError
from vitlab.machine import Gpu, Machine
from vitlab.train import resolve as resolve_module
from vitlab.train.distributed import World
from vitlab.train.memory_estimate import GB, RunShape, estimate_memory, resident_state_bytes
from vitlab.train.memory_probe import SAFETY, fewest_fitting_accum, probe_model
from vitlab.train.overrides import with_changes
from vitlab.train.resolve import memory_record, run_memory_record, resolve

from .conftest import tiny_config

MB = 10**6


def linear_probe(per_example: int, base: int = 0, out_of_memory_above: int | None = None, calls: list | None = None):
    """A fake ``step_peak``: ``base + m * per_example`` bytes, or out of memory above a micro-batch."""
    def step_peak(micro_batch: int) -> int:
        if calls is not None:
            calls.append(micro_batch)
        if out_of_memory_above is not None and micro_batch > out_of_memory_above:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake)")
        return base + micro_batch * per_example
    return step_peak


def reference(batch: int, fits) -> int | None:
    """The fewest micro-batches whose micro-batch fits, by trying every divisor."""
    return next((k for k in range(1, batch + 1) if batch % k == 0 and fits(batch // k)), None)


@pytest.mark.parametrize("batch", [1, 7, 12, 96, 100, 128, 4096])
def test_the_fewest_micro_batches_that_fit_are_chosen_from_any_proposal(batch):
    counts = [k for k in range(1, batch + 1) if batch % k == 0]
    for largest in (1, 2, 5, 24, batch // 3 + 1, batch):  # the largest micro-batch the budget holds
        free = int((largest * MB + 0.5 * MB) / SAFETY)
        expected = reference(batch, lambda m: m <= largest)
        for proposed in (None, counts[0], counts[len(counts) // 2], counts[-1]):
            calls: list[int] = []
            choice = fewest_fitting_accum(batch, proposed, linear_probe(MB, calls=calls), free, state=0)
            assert choice.accum_steps == expected and choice.micro_batch == batch // expected
            assert all(batch % m == 0 for m in calls)  # never a micro-batch that does not divide the batch
            assert choice.step_peak == choice.micro_batch * MB and choice.fits
            assert set(choice.tried) == set(calls)


def test_the_optimiser_state_and_the_safety_margin_count_against_the_free_memory():
    free = 100 * MB
    # 8 MB per example: 90% of 100 MB holds 11 examples (96's divisor: 8), 5 beside 50 MB of optimiser state (4)
    assert fewest_fitting_accum(96, 1, linear_probe(8 * MB), free, state=0).micro_batch == 8
    choice = fewest_fitting_accum(96, 1, linear_probe(8 * MB), free, state=50 * MB)
    assert choice.micro_batch == 4 and choice.accum_steps == 24
    assert choice.needs == 4 * 8 * MB + 50 * MB <= SAFETY * free < 6 * 8 * MB + 50 * MB


def test_running_out_of_memory_at_a_candidate_moves_down():
    calls: list[int] = []
    # the arithmetic would admit 96 examples, but the step runs out of memory above 20
    choice = fewest_fitting_accum(96, 1, linear_probe(MB, out_of_memory_above=20, calls=calls), 1 << 40, state=0)
    assert choice.micro_batch == 16 and choice.accum_steps == 6
    assert calls[:4] == [96, 48, 32, 24] and choice.tried[24] is None and choice.tried[16] == 16 * MB
    # from a proposal that fits, going up stops at the first that runs out of memory
    calls.clear()
    assert fewest_fitting_accum(96, 12, linear_probe(MB, out_of_memory_above=20, calls=calls), 1 << 40,
                                state=0).micro_batch == 16
    assert calls == [8, 12, 16, 24]
    # a library that fails to allocate its workspace ran out of memory too; any other failure is the run's to see

    def failing(message):
        def step_peak(micro_batch):
            if micro_batch > 20:
                raise RuntimeError(message)
            return MB
        return step_peak

    assert fewest_fitting_accum(96, 1, failing("CUDA error: out of memory (cuBLAS)"), 1 << 40, 0).micro_batch == 16
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        fewest_fitting_accum(96, 1, failing("mat1 and mat2 shapes cannot be multiplied"), 1 << 40, 0)


def test_a_step_that_does_not_fit_at_micro_batch_1_is_refused_in_one_line():
    for probe, said in ((linear_probe(200 * MB), "(measured: the step 0.2 GB, the optimiser's state 0 MB)"),
                        (linear_probe(MB, out_of_memory_above=0), "(measured: the step ran out of memory)")):
        with pytest.raises(ConfigError) as err:
            fewest_fitting_accum(64, 4, probe, 100 * MB, state=0, settings=("--img-size 96",))
        message = str(err.value)
        assert "\n" not in message and message.startswith("run.memory_check: ")
        assert said in message and "more than 90% of the 0.1 GB free there" in message
        assert "micro-batch 1" in message and "settings that fit: --img-size 96" in message
        assert "--set run.memory_check=false" in message
    # without the check the run takes micro-batch 1
    choice = fewest_fitting_accum(64, 4, linear_probe(200 * MB), 100 * MB, state=0, check=False)
    assert (choice.accum_steps, choice.micro_batch, choice.fits) == (64, 1, False)


def test_the_state_counted_on_top_is_the_estimates_optimiser_and_weight_average(tmp_path):
    from vitlab.train.resolve import trained_architecture

    arch = trained_architecture(tiny_config(tmp_path))
    for optimizer, ema in (("adam", False), ("adam", True), ("sgd", True), ("muon", False)):
        shape = RunShape(arch, micro_batch=4, device="cuda", optimizer=optimizer, ema=ema, eval_batch=0)
        estimate = estimate_memory(shape)
        assert estimate.at == "the training step"
        assert resident_state_bytes(shape) == estimate.parts.get("optimizer", 0) + estimate.parts.get(
            "weight_average", 0)


# ----------------------------------------------------------------------------- through resolve


H100 = Gpu("NVIDIA H100 80GB HBM3", total_bytes=80 << 30, free_bytes=64 * MB, bf16=True, capability=(9, 0))


def gpu_world() -> World:
    return World(rank=0, size=1, local_rank=0, device=torch.device("cuda:0"))


def faked_gpu(monkeypatch, probe, opened: list):
    """``resolve`` on this host as if CUDA were here, its step probe replaced by ``probe``."""
    @contextlib.contextmanager
    def fake_step_probe(cfg, arch, img_size, precision, kernels, device):
        opened.append((tuple(img_size), precision, str(device)))
        yield probe

    monkeypatch.setattr(resolve_module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(resolve_module, "step_probe", fake_step_probe)


def test_a_gpu_runs_auto_accumulation_is_measured_once_and_recorded(tmp_path, monkeypatch):
    opened: list = []
    faked_gpu(monkeypatch, linear_probe(8 * MB), opened)  # 64 MB free: 90% holds micro-batch 4 with 16 MB of state
    cfg = with_changes(tiny_config(tmp_path / "run"), {"optim.accum_steps": "auto", "run.device": "cuda",
                                                      "run.precision": "bf16", "optim.batch_size": 32})
    machine = Machine.described(gpus=(H100,))
    shape_state = resident_state_bytes(RunShape(resolve_module.trained_architecture(cfg), 1, optimizer="adam"))
    resolved = resolve(cfg, gpu_world(), machine)
    expected = reference(32, lambda m: m * 8 * MB + shape_state <= SAFETY * 64 * MB)
    assert opened == [((8, 8), "bf16", "cuda:0")]  # one probe, the run's size and precision
    assert resolved.config.optim.accum_steps == resolved.accum_steps == expected > 1
    assert resolved.micro_batch == 32 // expected == resolved.memory.shape.micro_batch
    assert resolved.measured.micro_batch == resolved.micro_batch and resolved.measured.free == 64 * MB
    assert any("measured on the GPU" in note for note in resolved.notes)
    record = json.loads(json.dumps(run_memory_record(resolved)))  # what config.json holds
    assert record["micro_batch"] == record["measured"]["micro_batch"] == resolved.micro_batch
    assert record["measured"]["step_peak_gb"] == round(resolved.micro_batch * 8 * MB / GB, 3)
    shown = memory_record(resolved, machine, gpu_world())  # what --show-config prints
    assert shown["fits"] and shown["measured"]["accum_steps"] == expected
    # a resumed run keeps its saved accumulation: nothing measured
    again = resolve(cfg, gpu_world(), machine, saved=dict(resolved.record(), accum_steps=2))
    assert again.accum_steps == 2 and again.measured is None and len(opened) == 1
    # a count given is not measured either
    assert resolve(with_changes(cfg, {"optim.accum_steps": 4}), gpu_world(), machine).measured is None
    assert len(opened) == 1


def test_a_gpu_run_whose_step_does_not_fit_is_refused_and_a_cpu_run_is_never_measured(tmp_path, monkeypatch):
    opened: list = []
    faked_gpu(monkeypatch, linear_probe(MB, out_of_memory_above=0), opened)
    cfg = with_changes(tiny_config(tmp_path / "run"), {"optim.accum_steps": "auto", "run.device": "cuda"})
    with pytest.raises(ConfigError, match="run.memory_check: this run's training step needs more than the GPU has"):
        resolve(cfg, gpu_world(), Machine.described(gpus=(H100,)))
    preview = resolve(cfg, gpu_world(), Machine.described(gpus=(H100,)), preview=True)  # a preview is not refused
    assert preview.measured.micro_batch == 1 and not preview.measured.fits
    on_cpu = resolve(with_changes(cfg, {"run.device": "cpu"}), World(0, 1, 0, torch.device("cpu")),
                     Machine.described())
    assert on_cpu.measured is None and on_cpu.accum_steps == 1 and len(opened) == 2


def test_the_probes_model_is_the_one_the_run_trains(tmp_path):
    from vitlab.fast.modules import installed

    cfg = with_changes(tiny_config(tmp_path / "run"), {"run.fast": True})
    arch = resolve_module.trained_architecture(cfg)
    model = probe_model(cfg, arch, (12, 12), None, torch.device("cpu"))
    assert installed(model) and model.training and tuple(model.cfg.img_size) == (12, 12)
    plain = probe_model(with_changes(cfg, {"run.fast": False}), arch, (8, 8), None, torch.device("cpu"))
    assert not installed(plain)


def test_the_probes_model_has_the_fp8_layers_the_run_asks_for(tmp_path):
    # the probe measures the step the run will take: its fp8 layers, only those of run.fp8_layers, by
    # run.fp8_backend's arithmetic (the probe swapped all four layers of every block until 2026-11-28)
    from vitlab.fast import Float8Linear

    cfg = with_changes(tiny_config(tmp_path / "run"), {"run.precision": "bf16", "run.fp8": "rowwise",
                                                       "run.fp8_layers": ["mlp.fc1", "mlp.fc2"]})
    arch = resolve_module.trained_architecture(cfg)
    model = probe_model(cfg, arch, (12, 12), None, torch.device("cpu"))
    swapped = {name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1]: m for name, m in model.named_modules()
               if isinstance(m, Float8Linear)}
    assert set(swapped) == {"mlp.fc1", "mlp.fc2"}
    assert all(m.fp8_scaling == "rowwise" and m.fp8_backend == "vitlab" for m in swapped.values())


def test_a_cuda_graphed_run_measured_into_accumulating_counts_the_gradients_it_holds(tmp_path, monkeypatch):
    # compiled on one GPU with the update eager, a run holds its gradients (step.HeldGradients) only where it
    # accumulates: the state beside a candidate is the one of its own count, not of one micro-batch's step
    faked_gpu(monkeypatch, linear_probe(8 * MB), [])
    cfg = with_changes(tiny_config(tmp_path / "run"), {"optim.accum_steps": "auto", "run.device": "cuda",
                                                      "run.precision": "bf16", "optim.batch_size": 32,
                                                      "run.compile": True, "run.compile_optimizer": False})
    resolved = resolve(cfg, gpu_world(), Machine.described(gpus=(H100,)))
    assert resolved.compile == "reduce-overhead" and resolved.accum_steps > 1
    assert resolved.memory.shape.holds_gradients
    assert resolved.measured.state == resident_state_bytes(resolved.memory.shape)
    assert resolved.measured.state > resident_state_bytes(resolved.memory.shape.with_(accum_steps=1))
