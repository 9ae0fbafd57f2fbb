"""Issue 50, Build 2: a run's peak memory estimated before it is built, a run that cannot fit
refused in one line naming what fits, ``--accum-steps auto``, a fine-tune's resolution
from its init, and a fine-tune's config naming its init's model."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vitlab import fast
from vitlab.analysis.cost import SavedForBackward
from vitlab.cli import main
from vitlab.config import ConfigError
from vitlab.fast.kernels import KernelChoice
from vitlab.models.registry import create_model
from vitlab.train import resolve
from vitlab.train.config import OptimConfig
from vitlab.train.overrides import with_changes
from vitlab.eval.features import shift_sizes, tta_views
from vitlab.train.memory_estimate import (GB, HEADROOM, RUNTIME_BYTES, Available, RunShape, activation_bytes,
                                          estimate_memory, evaluation_bytes, evaluation_copies, fitting_settings,
                                          parameter_counts, resident_state_bytes, smallest_fitting_accum)
from vitlab.train.step import autocast
from vitlab.weights import save_model

ROOT = Path(__file__).resolve().parents[2]
VIT = dict(img_size=32, patch_size=4, width=96, depth=2, num_heads=3, mlp_dim=384, num_classes=10)
HYBRID_BN = dict(img_size=32, patch_size=1, width=96, depth=2, num_heads=3, mlp_dim=192, num_classes=10,
                 resnet=dict(layers=(1, 2), img_size=32, norm="batch"))
HYBRID_GN = dict(HYBRID_BN, resnet=dict(layers=(1, 2), img_size=32, norm="group"))
ARCHITECTURES = {"vit": VIT, "vit-dropout": dict(VIT, dropout=0.1), "vit-gap": dict(VIT, classifier="gap"),
                 "vit-patch-dropout": dict(VIT, patch_dropout=0.5, dropout=0.1),
                 "vit-distance": dict(VIT, classifier="gap", attn_bias="distance_no_self", attn_offsets=True),
                 "vit-relative": dict(VIT, posemb="relative"),
                 "vit-distance-patch-dropout": dict(VIT, patch_dropout=0.25, classifier="gap", attn_bias="distance_no_self",
                                                    attn_offsets=True),
                 "hybrid-batchnorm": HYBRID_BN, "hybrid-groupnorm": HYBRID_GN}
# kernels that run on every CPU; "explicit" attends by two matmuls in fp32 too
PORTABLE = {"fused": KernelChoice("aten", "aten", "fused"), "explicit": KernelChoice("aten", "aten", "explicit")}


def saved_bytes(model, batch: int, precision: str) -> int:
    x = torch.randn(batch, 3, *model.cfg.img_size, generator=torch.Generator().manual_seed(0))
    with SavedForBackward(model) as kept:
        with autocast(torch.device("cpu"), precision):
            model(x)
    return kept.bytes


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("path", ["plain", "fused", "explicit"])
def test_the_counted_activations_are_what_autograd_keeps(name, precision, path):
    # per image: the difference between two batch sizes, so that what a step keeps once (autocast's
    # weight casts) cancels; the estimate counts those apart
    model = create_model("ViT-Ti/16", **ARCHITECTURES[name]).train()
    if path != "plain":
        fast.optimize(model, PORTABLE[path])
    measured = (saved_bytes(model, 6, precision) - saved_bytes(model, 2, precision)) / 4
    shape = RunShape(model.cfg, micro_batch=1, img_size=model.cfg.img_size, precision=precision, fast=path != "plain",
                     explicit_attention_fp32=path == "explicit")
    counted = (activation_bytes(shape.with_(micro_batch=6))[0] - activation_bytes(shape.with_(micro_batch=2))[0]) / 4
    assert counted == pytest.approx(measured, rel=0.1)


def test_a_weight_standardised_resnet_keeps_its_standardised_kernels_once_per_step():
    model = create_model("ViT-Ti/16", **HYBRID_GN).train()
    once = 2 * saved_bytes(model, 2, "fp32") - saved_bytes(model, 4, "fp32")  # what does not grow with the batch
    shape = RunShape(model.cfg, micro_batch=2, img_size=(32, 32))
    counted = 2 * activation_bytes(shape)[0] - activation_bytes(shape.with_(micro_batch=4))[0]
    assert counted == pytest.approx(once, rel=0.1)
    assert once > 4 * sum(p.numel() for n, p in model.stem.named_parameters() if "conv" in n)  # centred + standardised


def test_explicit_attention_keeps_the_probabilities_of_every_block():
    # the demo fine-tune of issue 50: patch 4 at 384 px is 9,217 tokens; bf16 on the fast path
    # keeps a (heads, tokens, tokens) table per block and image: 0.68 GB each
    arch = create_model("ViT-Ti/16", img_size=16, patch_size=4, width=64, depth=4, num_heads=4, mlp_dim=128).cfg
    shape = RunShape(arch, micro_batch=32, img_size=(384, 384), precision="bf16", fast=True)
    kept, _ = activation_bytes(shape)
    probabilities = 32 * 4 * 4 * 9217**2 * 2
    assert probabilities < kept < 1.1 * probabilities
    assert activation_bytes(shape.with_(precision="fp32"))[0] < kept / 20  # fused attention keeps none


def test_the_optimiser_state_follows_the_optimiser():
    arch = create_model("ViT-Ti/16", **VIT).cfg
    params = sum(p.numel() for p in create_model("ViT-Ti/16", **VIT).parameters())
    base = RunShape(arch, micro_batch=1, img_size=(32, 32))
    state = {opt: estimate_memory(base.with_(optimizer=opt)).parts.get("optimizer", 0)
             for opt in ("adam", "sgd", "muon")}
    assert state["adam"] == 8 * params and state["sgd"] == 4 * params
    assert 4 * params < state["muon"] < 8 * params
    assert "optimizer" not in estimate_memory(base.with_(optimizer="sgd", momentum=0.0)).parts


def test_gradients_held_out_of_cuda_graphs_are_counted_where_the_run_holds_them():
    """``step.HeldGradients`` keeps a float32 buffer per parameter for the whole run, under CUDA graphs
    when a compiled call follows the backward; the trainer builds them by the estimate's rule."""
    arch = create_model("ViT-Ti/16", **VIT).cfg
    params = sum(p.numel() for p in create_model("ViT-Ti/16", **VIT).parameters())
    graphed = RunShape(arch, micro_batch=64, img_size=(32, 32), device="cuda:0", cuda_graphs=True)
    holding = [graphed.with_(update_compiled=True), graphed.with_(accum_steps=2)]
    not_holding = [graphed, graphed.with_(cuda_graphs=False, update_compiled=True, accum_steps=2)]
    assert all(s.holds_gradients for s in holding) and not any(s.holds_gradients for s in not_holding)
    for shape in holding:
        estimate, without = estimate_memory(shape), estimate_memory(shape.with_(cuda_graphs=False))
        assert estimate.parts["held_gradients"] == 4 * params
        assert estimate.device_peak - without.device_peak == 4 * params
        assert resident_state_bytes(shape) - resident_state_bytes(shape.with_(cuda_graphs=False)) == 4 * params
    assert "held_gradients" not in estimate_memory(graphed).parts


def test_the_peak_is_the_largest_moment_and_a_gpu_counts_its_own_memory():
    arch = create_model("ViT-Ti/16", **VIT).cfg
    shape = RunShape(arch, micro_batch=64, img_size=(32, 32), train_images=200_000, decoded_images=200_000)
    estimate = estimate_memory(shape)
    assert estimate.at == "decoding the data"  # 200k images decoded and split: 1.2 GB, more than a step
    assert estimate.peak == 2 * 200_000 * 3 * 32 * 32 + RUNTIME_BYTES  # the whole set and its split copies
    on_gpu = estimate_memory(shape.with_(device="cuda:0"))
    assert on_gpu.device_peak < on_gpu.host_peak and on_gpu.device_peak > 0
    assert estimate_memory(shape.with_(micro_batch=128)).parts == estimate.parts  # the step is not the peak


@pytest.mark.parametrize("flip, shift, diagonal", [(False, 0, False), (True, 0, False), (False, 2, False),
                                                   (True, (2, 1), True)])
def test_an_evaluation_counts_the_float_copies_its_test_time_views_hold(flip, shift, diagonal):
    # the views are all made before the first is scored: with flip, shift 2 and diagonal, 9 mirror
    # images and a padded copy besides the batch, which an estimate of two float copies left out
    x = torch.zeros(8, 3, 64, 64)
    storages = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
                for v in tta_views(x, flip, shift, diagonal)}
    held = sum(storages.values()) / x.nbytes  # a padded copy is a little larger than the batch
    shape = RunShape(create_model("ViT-Ti/16", **VIT).cfg, micro_batch=1, img_size=(64, 64), eval_batch=8,
                     eval_flip=flip, eval_shifts=len(shift_sizes(shift)), eval_diagonal=diagonal)
    assert evaluation_copies(shape) - 1 == pytest.approx(held, rel=0.15)  # and the copy the float batch is made from
    plain = evaluation_bytes(shape.with_(eval_flip=False, eval_shifts=0, eval_diagonal=False))
    assert evaluation_bytes(shape) - plain == (evaluation_copies(shape) - 2) * x.nbytes


def test_a_run_counts_its_final_evaluations_views(demo_init, capsys):
    command = ["finetune", "--init", demo_init, "--data", "digits", "--img-size", "64", "--batch-size", "8",
               "--val-split", "500", "--set", "run.eval_batch_size=500", "--show-config"]
    shown = []
    for views in ([], ["--set", "run.eval_flip=true", "--set", "run.final_eval_shift=2",
                       "--set", "run.final_eval_diagonal=true"]):
        assert main(command + views) == 0
        shown.append(json.loads(capsys.readouterr().out)["memory_estimate"])
    assert shown[1]["at"] == "an evaluation"
    # 10 float copies more of the 500 images at 64 px: 9 mirror images and a padded copy
    grown = shown[1]["parts_gb"]["evaluation"] - shown[0]["parts_gb"]["evaluation"]
    assert grown == pytest.approx(10 * 500 * 3 * 64 * 64 * 4 / GB, abs=0.002)


# ----------------------------------------------------------------------------- what is available


def test_a_gpu_run_is_held_against_the_gpus_free_memory():
    arch = create_model("ViT-Ti/16", **VIT).cfg
    estimate = estimate_memory(RunShape(arch, micro_batch=4096, img_size=(32, 32), device="cuda:0"))
    plenty_of_host = Available(host=1 << 40, gpu=int(estimate.device_peak / 2))
    assert "on the GPU" in plenty_of_host.shortfall(estimate)
    assert Available(host=1 << 40, gpu=2 * estimate.device_peak).fits(estimate)
    # the host's memory is shared by the processes torchrun starts on it
    host_run = estimate_memory(RunShape(arch, micro_batch=64, img_size=(32, 32), train_images=100_000))
    assert Available(host=2 * host_run.host_peak).fits(host_run)
    assert not Available(host=2 * host_run.host_peak, processes=4).fits(host_run)


def test_auto_accumulation_takes_the_largest_micro_batch_that_fits():
    arch = create_model("ViT-Ti/16", **VIT).cfg
    shape = RunShape(arch, micro_batch=512, img_size=(32, 32))
    budget = Available(host=int(estimate_memory(shape.with_(micro_batch=100)).peak / 0.9))
    accum = smallest_fitting_accum(shape, 512, budget)
    assert accum == 8  # 512 / 8 = 64 fits, 512 / 4 = 128 does not
    assert smallest_fitting_accum(shape, 512, Available(host=1 << 20)) is None


# ----------------------------------------------------------------------------- under FSDP


def test_fsdp_counts_each_process_its_shards_and_the_units_it_gathers():
    """Under FSDP every process's estimate held the whole model's weights, gradients and optimiser
    state, and nothing of what FSDP gathers or of what rank 0 alone gathers to write a checkpoint
    and the final weights."""
    from vitlab.train.memory_estimate import fsdp_heap_bytes, fsdp_units

    arch = create_model("ViT-Ti/16", **VIT).cfg
    # a block: two LayerNorms 2 x 192, qkv 96x288 + 288, proj 96x96 + 96, fc1 96x384 + 384, fc2 384x96 + 96;
    # the root unit: [class] 96, patch embedding 96x3x4x4 + 96, position embeddings 65x96, LayerNorm 192,
    # head 10x96 + 10
    block, root = 192 + 27_936 + 9_312 + 192 + 37_248 + 36_960, 96 + 4_608 + 96 + 6_240 + 192 + 970
    params = root + 2 * block
    assert parameter_counts(arch)[0] == params == 235_882
    # FSDP splits every parameter's first dimension into pieces of ceil(rows / processes), the last padded:
    # two processes hold half of each block's and of the patch embedding's, 5 of the head's 10 rows each,
    # and the whole [class] token and position embeddings (one row each)
    held = block + 96 + 48 * 48 + 48 + 6_240 + 96 + 5 * 96 + 5
    assert fsdp_units(arch, 2) == (held, root, block) == (121_109, 12_202, 111_840)
    assert fsdp_units(arch, 3)[0] == 2 * 37_280 + 96 + 32 * 48 + 32 + 6_240 + 64 + 4 * 96 + 4

    gpu = RunShape(arch, micro_batch=256, img_size=(32, 32), device="cuda:0")
    one, sharded = estimate_memory(gpu), estimate_memory(gpu.with_(shards=2))
    assert sharded.at == one.at == "the training step"
    assert {k: sharded.parts[k] for k in ("weights", "optimizer", "gathered_units")} == {
        "weights": 4 * held, "optimizer": 8 * held, "gathered_units": 4 * (2 * root + 4 * block)}
    assert one.device_peak - sharded.device_peak == 12 * (params - held) - 4 * (2 * root + 4 * block)
    # rank 0 writes the final weights from an unsharded copy (4 bytes a parameter) cloned and serialised
    # twice (12), and gathers a checkpoint's weights and Adam's moments (12): the others hold none of them
    assert sharded.host_peak - sharded.others_host_peak == 16 * params
    assert sharded.record()["fsdp_processes"] == 2 and "rank 0 of 2 under FSDP" in sharded.line()
    assert "fsdp_processes" not in one.record() and "other_ranks_peak_gb" not in one.record()  # one process, DDP
    evaluation = estimate_memory(gpu.with_(shards=2, micro_batch=1, eval_batch=4096))
    assert evaluation.at == "an evaluation" and evaluation.parts["gathered_units"] == 4 * (root + 3 * block)
    # a host's processes: rank 0's and the others'
    host = Available(host=int((sharded.host_peak + sharded.others_host_peak) / 0.9) + 1, processes=2)
    assert host.fits(sharded) and not dataclasses.replace(host, processes=3).fits(sharded)

    # on a CPU the heap keeps about four copies of blocks below its mmap threshold, and under autocast two
    # of their casts too
    cpu = RunShape(arch, micro_batch=8, img_size=(32, 32), shards=2)
    assert estimate_memory(cpu).record()["parts_gb"].get("fsdp_heap", 0) == round(16 * params / GB, 3)
    assert fsdp_heap_bytes(cpu) == 16 * params and fsdp_heap_bytes(cpu.with_(precision="bf16")) == 20 * params
    assert fsdp_heap_bytes(cpu.with_(shards=1)) == 0 == fsdp_heap_bytes(gpu.with_(shards=2))


def test_under_ddp_a_hosts_other_processes_are_not_counted_rank_0s_save_of_the_weights():
    """Rank 0 alone saves the final weights (their clone and two serialisations): under DDP a host's check
    counted every process that save, and refused processes that fit.  One process is held to its estimate
    as before."""
    arch = create_model("ViT-Ti/16", **VIT).cfg
    params = parameter_counts(arch)[0]
    gpu = estimate_memory(RunShape(arch, micro_batch=64, img_size=(32, 32), device="cuda:0"))
    assert gpu.host_peak - gpu.each_other_host_peak == 12 * params  # on the host: the clone, two serialisations
    host = Available(host=int((gpu.host_peak + gpu.each_other_host_peak) / HEADROOM) + 1, processes=2)
    assert host.fits(gpu) and not dataclasses.replace(host, processes=3).fits(gpu)
    alone = Available(host=int(gpu.host_peak / HEADROOM) + 1)
    assert alone.fits(gpu) and not dataclasses.replace(alone, host=alone.host - 2).fits(gpu)
    # on a CPU the save's moment holds the heap the steps left, which every process keeps: the save's own
    # (two serialisations, the clone in the heap's place) is rank 0's alone
    cpu = estimate_memory(RunShape(arch, micro_batch=64, img_size=(32, 32)))
    assert cpu.at == "saving the weights" and "other_ranks_peak_gb" not in cpu.record()
    assert cpu.host_peak - cpu.each_other_host_peak == cpu.parts["weights_saved"] == 8 * params


def test_a_model_that_fits_only_sharded_is_run_under_fsdp(tmp_path):
    """A ViT-B/16 trained by 8 GPUs with 1 GB free each: every process was counted the whole model's
    weights, gradients and Adam's moments (1.4 GB), so that run.memory_check refused the FSDP run that
    fits (its shards 0.17 GB) and --accum-steps auto found no micro-batch for it."""
    from vitlab.machine import Gpu, Machine
    from vitlab.train.distributed import World

    gpu = Gpu("a GPU", total_bytes=2 << 30, free_bytes=1 << 30, bf16=True, capability=(9, 0))
    from .conftest import tiny_config

    cfg = with_changes(tiny_config(tmp_path / "run"), {
        "model.overrides": dict(img_size=32, patch_size=16, width=768, depth=12, num_heads=12, mlp_dim=3072),
        "optim.batch_size": 256, "optim.accum_steps": "auto", "run.device": "cuda:0", "run.fsdp": True})
    world = World(rank=0, size=8, local_rank=0, device=torch.device("cuda:0"), processes_here=8)
    machine = Machine.described(cores=16, memory_available=256 << 30, gpus=(gpu,))
    resolved = resolve.resolve(cfg, world, machine)
    assert resolved.accum_steps == 1 and resolved.memory.shape.shards == 8
    assert resolved.memory.device_peak < HEADROOM * (1 << 30)
    with pytest.raises(ConfigError, match="^run.memory_check: .* on the GPU, more than the 1.1 GB free there; no "):
        resolve.resolve(with_changes(cfg, {"run.fsdp": False}), world, machine)  # DDP: every process the whole model


# ----------------------------------------------------------------------------- the config and the run


def test_accum_steps_takes_auto_or_a_positive_integer():
    assert OptimConfig(accum_steps="auto").accum_steps == "auto"
    for bad in (0, "four", 1.5):
        with pytest.raises(ConfigError, match="optim.accum_steps"):
            OptimConfig(accum_steps=bad)
    with pytest.raises(SystemExit):
        main(["train", "--recipe", "demo", "--accum-steps", "0", "--show-config"])


@pytest.fixture
def demo_init(tmp_path):
    """A saved model as `vitlab demo` writes it: ViT-demo/4, 16 px, 4-px patches."""
    from vitlab.config import replace
    from vitlab.models.registry import get_config

    model = create_model(replace(get_config("ViT-Ti/16", img_size=16, patch_size=4, width=32, depth=1, num_heads=2,
                                            mlp_dim=64, num_classes=10), name="ViT-demo/4"))
    save_model(model, tmp_path / "demo")
    return str(tmp_path / "demo")


def test_a_finetune_states_its_inits_model_and_resolution(demo_init, tmp_path, capsys):
    # issue 50, input 1: show-config and config.json said the recipe's "ViT-B/16"
    assert main(["finetune", "--init", demo_init, "--data", "digits", "--show-config"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["model"]["name"] == "ViT-demo/4"
    assert shown["model"]["img_size"] == 28  # 16 x 384 / 224 to the nearest multiple of 4
    assert shown["memory_estimate"]["img_size"] == [28, 28] and shown["memory_estimate"]["peak_gb"] > 0
    out = tmp_path / "run"
    assert main(["finetune", "--init", demo_init, "--data", "digits", "--steps", "1", "--batch-size", "8",
                 "--out", str(out), "--quiet", "--set", "run.eval_every=0", "--set", "run.tensorboard=false"]) == 0
    written = json.loads((out / "config.json").read_text())
    assert written["model"]["name"] == "ViT-demo/4" and written["model"]["img_size"] == 28
    assert written["memory_estimate"]["tokens"] == 1 + 7 * 7
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == written["model"]["name"]


def test_an_img_size_given_overrides_the_finetune_rule(demo_init, capsys):
    assert main(["finetune", "--init", demo_init, "--data", "digits", "--img-size", "64", "--show-config"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["img_size"] == 64


def test_a_run_that_cannot_fit_is_refused_before_any_work_in_one_line(demo_init, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(resolve, "machine_memory", lambda *where: Available(host=4 * GB))
    out = tmp_path / "run"
    command = ["finetune", "--init", demo_init, "--data", "digits", "--steps", "10", "--batch-size", "32",
               "--img-size", "384", "--out", str(out)]
    assert main(command) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("vitlab finetune: error: run.memory_check:")
    assert "9,217 tokens" in err and "4.0 GB of memory available" in err
    for setting in ("--batch-size ", "--accum-steps ", "--img-size ", "run.memory_check=false"):
        assert setting in err
    assert not out.exists()  # refused before the run's folder, data or model
    # each setting named fits on its own
    accum = int(err.split("--accum-steps ")[1].split()[0])
    size = int(err.split("--img-size ")[1].split()[0].rstrip(","))
    for change in (["--accum-steps", str(accum)], ["--img-size", str(size)]):
        assert main([*command, *change, "--show-config"]) == 0
        shown = json.loads(capsys.readouterr().out)["memory_estimate"]
        assert shown["fits"] and shown["peak_gb"] * GB <= 0.9 * 4 * GB


def test_a_refusal_names_the_largest_evaluation_batch_and_stream_workers_that_fit():
    # an evaluation's peak, or the readers' processes, fit by no batch, accumulation or image size
    # of the training step that leaves the rest as it is: the refusal named none, or only a smaller image
    arch = create_model("ViT-Ti/16", **VIT).cfg
    evaluated = RunShape(arch, micro_batch=8, img_size=(32, 32), val_images=5000, eval_batch=5000, eval_flip=True)
    assert estimate_memory(evaluated).at == "an evaluation"
    budget = Available(host=int(estimate_memory(evaluated.with_(eval_batch=1000)).peak / HEADROOM) + 1)
    assert "--set run.eval_batch_size=1000" in fitting_settings(evaluated, budget, 4)
    streamed = RunShape(arch, micro_batch=8, img_size=(32, 32), streamed=True, stream_workers=8, shuffle_buffer=1000)
    budget = Available(host=int(estimate_memory(streamed.with_(stream_workers=3)).peak / HEADROOM) + 1)
    assert "--set data.stream_workers=3" in fitting_settings(streamed, budget, 4)
    assert not any("data.stream_workers" in s for s in fitting_settings(evaluated, budget, 4))  # nothing streams


def test_a_refusal_of_a_non_square_run_names_a_smaller_size_of_its_own_shape():
    """A 32x96 run too large for its memory was told of a square --img-size (what fits of the shorter side's),
    another shape than the run's, its longer side cut by two thirds; now its aspect at the largest that fits."""
    arch = create_model("ViT-Ti/16", **VIT).cfg
    for wide, kept in (((32, 96), "--img-size 16x48"), ((96, 32), "--img-size 48x16")):
        shape = RunShape(arch, micro_batch=64, img_size=wide)
        half = shape.with_(img_size=tuple(side // 2 for side in wide))
        budget = Available(host=int(estimate_memory(half).peak / HEADROOM) + 1)
        sizes = [s for s in fitting_settings(shape, budget, 4) if s.startswith("--img-size")]
        assert sizes == [kept]
        assert not budget.fits(estimate_memory(shape.with_(img_size=tuple(side * 5 // 8 for side in wide))))
    square = RunShape(arch, micro_batch=64, img_size=(32, 32))  # a square run: a square, written as one number
    budget = Available(host=int(estimate_memory(square.with_(img_size=(16, 16))).peak / HEADROOM) + 1)
    assert [s for s in fitting_settings(square, budget, 4) if s.startswith("--img-size")] == ["--img-size 16"]


def test_a_run_whose_evaluation_cannot_fit_is_refused_naming_its_batch(demo_init, capsys, monkeypatch):
    monkeypatch.setattr(resolve, "machine_memory", lambda *where: Available(host=GB // 2))
    command = ["finetune", "--init", demo_init, "--data", "digits", "--img-size", "64", "--batch-size", "8",
               "--val-split", "1000", "--set", "run.eval_batch_size=1000", "--set", "run.eval_flip=true",
               "--set", "run.final_eval_shift=2"]
    assert main(command) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "at an evaluation" in err and "--set run.eval_batch_size=" in err
    batch = err.split("--set run.eval_batch_size=")[1].split()[0].rstrip(",;")
    assert main([*command, "--set", f"run.eval_batch_size={batch}", "--show-config"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_estimate"]["fits"]
    assert main([*command, "--set", f"run.eval_batch_size={int(batch) + 1}", "--show-config"]) == 0
    assert not json.loads(capsys.readouterr().out)["memory_estimate"]["fits"]  # the largest that fits


class MicroBatchesUpTo(Available):
    """A described machine where a micro-batch of up to ``largest`` examples fits."""

    def __init__(self, largest: int) -> None:
        super().__init__(host=1 << 40)
        object.__setattr__(self, "largest", largest)

    def shortfall(self, estimate):
        return None if estimate.shape.micro_batch <= self.largest else "more than this machine has"


def test_auto_accumulation_is_recorded_and_the_check_can_be_skipped(tiny, monkeypatch):
    from vitlab.train import train

    monkeypatch.setattr(resolve, "machine_memory", lambda *where: MicroBatchesUpTo(8))
    cfg = tiny(batch_size=32, steps=1, accum_steps="auto", tensorboard=False)
    train(cfg, verbose=False)
    written = json.loads((Path(cfg.run.out) / "config.json").read_text())
    assert written["optim"]["accum_steps"] == 4 and written["memory_estimate"]["micro_batch"] == 8
    with pytest.raises(ConfigError, match="run.memory_check: .*--accum-steps 4 \\(micro-batch 8\\)"):
        train(tiny("refused", steps=1, tensorboard=False), verbose=False)
    assert not (Path(cfg.run.out).parent / "refused").exists()
    monkeypatch.setattr(resolve, "machine_memory", lambda *where: Available(host=1 << 20))
    train(with_changes(tiny("skipped", steps=1, tensorboard=False), {"run.memory_check": False}), verbose=False)


# ----------------------------------------------------------------------------- against the measured peak


IDLE = """
import sys, torch, vitlab.cli.train, vitlab.train.loop
if sys.argv[1] == "digits":
    import sklearn.datasets  # what the digits source loads (0.14 GB)
torch.ones(256, 256) @ torch.ones(256, 256)
print([int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0])
"""
RUN = """
import contextlib, io, json, sys
from vitlab.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    assert main(json.loads(sys.argv[1])) == 0
print([int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0])
"""
SMALL = ["--set", "model.patch_size=4", "--set", "model.width=64", "--set", "model.depth=2", "--set",
         "model.num_heads=2", "--set", "model.mlp_dim=256", "--set", "run.tensorboard=false", "--set", "run.threads=2",
         "--set", "data.decode_workers=0", "--steps", "3", "--quiet"]
MEASURED = {
    "vit-fp32-train-memory": ["train", "--recipe", "demo", "--img-size", "96", "--batch-size", "96",
                              "--precision", "fp32", *SMALL],
    "vit-bf16-train-streamed": ["train", "--recipe", "demo", "--img-size", "96", "--batch-size", "96",
                                "--precision", "bf16", "--stream", "stream", "--set", "data.stream_workers=0", *SMALL],
    "hybrid-bf16-train-memory": ["train", "--recipe", "cifar10_scratch:model=hybrid", "--img-size", "64",
                                 "--batch-size", "128", "--precision", "bf16", "--time-limit", "0", "--val-split", "200",
                                 "--set", "run.compile=false", "--set", "run.tensorboard=false",
                                 "--set", "data.decode_workers=0", "--set", "run.eval_batch_size=100", "--steps", "3",
                                 "--quiet"],
    "vit-bf16-finetune-memory": ["finetune", "--init", "DEMO", "--img-size", "96", "--batch-size", "64",
                                 "--set", "run.tensorboard=false", "--set", "data.decode_workers=0", "--steps", "3",
                                 "--quiet"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", MEASURED)
def test_the_estimate_is_within_a_quarter_of_the_measured_peak(name, tmp_path, demo_init):
    # the peak resident set of a run of a few steps in its own process, less that of an idle one
    # that imported the same (scikit-learn's loader of the digits too), against what the run
    # estimated before it built anything (its config.json)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               VITLAB_CACHE=str(tmp_path / "cache"))
    command = [a if a != "DEMO" else demo_init for a in MEASURED[name]] + ["--out", str(tmp_path / "run")]
    data = ["--data", "digits"]
    if "--stream" in command:  # a folder of PNGs, read from disk in the training process
        data = ["--data", str(digits_folder(tmp_path / "digits"))]
    idle = int(subprocess.run([sys.executable, "-c", IDLE, data[-1]], env=env, capture_output=True, text=True,
                              check=True).stdout)
    run = subprocess.run([sys.executable, "-c", RUN, json.dumps(command + data)], env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    measured = int(run.stdout.split()[-1]) - idle
    estimate = json.loads((tmp_path / "run" / "config.json").read_text())["memory_estimate"]["peak_gb"] * GB
    assert measured > 0.2 * GB  # large enough that what an import adds is noise
    assert estimate == pytest.approx(measured, rel=0.25), (estimate / GB, measured / GB)


RANK_RUN = RUN.replace("print(", "import os\nprint(os.environ['RANK'], ")
FSDP_RUN = ["train", "--recipe", "demo", "--data", "digits", "--img-size", "32", "--set", "model.patch_size=8",
            "--set", "model.width=512", "--set", "model.depth=6", "--set", "model.num_heads=8",
            "--set", "model.mlp_dim=2048", "--batch-size", "16", "--steps", "4", "--val-split", "100", "--fsdp",
            "--set", "run.threads=1", "--set", "run.tensorboard=false", "--set", "data.decode_workers=0", "--quiet"]


@pytest.mark.slow
def test_under_fsdp_the_estimate_bounds_every_processs_measured_peak(tmp_path):
    """Two processes (torchrun, gloo) train a model of large weights and small activations (19M
    parameters, 17 tokens) under FSDP.  The estimate counted each the whole model's state and nothing of
    what rank 0 gathers to write the checkpoint and the final weights: 0.58 GB, where rank 0 peaked at
    0.93 GB.  Bounds: the run's estimate (rank 0's, the largest) is at least every process's measured
    peak and at most 1.3 times the largest: the 25% the estimate keeps to elsewhere, with the spread of
    what malloc's heap keeps of FSDP's gathers (``fsdp_heap_bytes``); the other processes' estimate is
    within 30% of rank 1's peak, which varies from run to run with that heap (a clean CI run of 2026-11-29
    measured 0.51 GB against the estimate's 0.64: 1.25 times)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               VITLAB_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    idle = int(subprocess.run([sys.executable, "-c", IDLE, "digits"], env=env, capture_output=True, text=True,
                              check=True).stdout)
    script = tmp_path / "run.py"
    script.write_text(RANK_RUN)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script), json.dumps(FSDP_RUN + ["--out", str(tmp_path / "run")])],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    measured = dict(sorted((int(rank), int(peak) - idle) for rank, peak in
                           (line.split() for line in run.stdout.splitlines() if line.strip())))
    estimate = json.loads((tmp_path / "run" / "config.json").read_text())["memory_estimate"]
    peak, others = estimate["peak_gb"] * GB, estimate.get("other_ranks_peak_gb", estimate["peak_gb"]) * GB
    assert min(measured.values()) > 0.2 * GB
    assert max(measured.values()) <= peak <= 1.3 * max(measured.values()), (peak / GB, measured)
    assert others == pytest.approx(measured[1], rel=0.3), (others / GB, measured)


def digits_folder(root: Path) -> Path:
    """The digits as an ImageFolder of PNG files."""
    from PIL import Image

    from vitlab.data.digits import load_digits_dataset

    data = load_digits_dataset(8)
    for i, (image, label) in enumerate(zip(data.images, data.labels)):
        folder = root / data.classes[int(label)]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(folder / f"{i}.png")
    return root
