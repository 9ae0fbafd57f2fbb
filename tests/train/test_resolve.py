"""``resolve``: every "auto" of a run decided once, from the config and a described machine."""
import dataclasses
import json

import pytest
import torch

from vitlab.config import ConfigError
from vitlab.fast.kernels import KernelChoice
from vitlab.machine import Gpu, Machine
from vitlab.train.config import to_dict
from vitlab.train.distributed import World
from vitlab.train.overrides import with_changes
from vitlab.train.resolve import Resolved, finetune_size, resolve, resolve_device

from .conftest import tiny_config

H100 = Gpu("NVIDIA H100 80GB HBM3", total_bytes=80 << 30, free_bytes=79 << 30, bf16=True, capability=(9, 0))
A100 = Gpu("NVIDIA A100-SXM4-80GB", total_bytes=80 << 30, free_bytes=79 << 30, bf16=True, capability=(8, 0))
OLD_GPU = Gpu("Tesla V100", total_bytes=16 << 30, free_bytes=15 << 30, bf16=False, capability=(7, 0))


def world(device="cpu", size=1, processes_here=1) -> World:
    return World(rank=0, size=size, local_rank=0, device=torch.device(device), processes_here=processes_here)


def described(cores=8, gpus=(), memory=24 << 30) -> Machine:
    return Machine.described(cores=cores, memory_available=memory, gpus=gpus)


def auto_config(tmp_path, **changes):
    return with_changes(tiny_config(tmp_path / "run", **changes),
                        {"run.precision": "auto", "run.device": "auto", "data.decode_workers": "auto",
                         "data.stream_workers": "auto", "data.stream": "auto", "optim.accum_steps": "auto"})


def autos(record) -> list[str]:
    """The dotted names of the fields still holding "auto" in a config's dict."""
    found = []
    for section, values in record.items():
        if isinstance(values, dict):
            found += [f"{section}.{k}" for k, v in values.items() if v == "auto"]
    return found


def test_the_device_is_the_processs_gpu_where_the_machine_has_one():
    assert resolve_device("auto", described(gpus=(H100, H100)), local_rank=1) == torch.device("cuda:1")
    assert resolve_device("auto", described()) == torch.device("cpu")
    assert resolve_device("cuda", described(gpus=(H100,)), local_rank=0) == torch.device("cuda:0")
    assert resolve_device("cpu", described(gpus=(H100,))) == torch.device("cpu")


@pytest.mark.parametrize("name, machine_gpus, message", [
    ("cuda", (), r"run.device='cuda': no CUDA GPU here \(torch .*\); use cpu, or auto for a GPU where there is one"),
    ("cuda:2", (H100, H100), r"run.device='cuda:2': this machine has 2 GPU\(s\): cuda:0 to cuda:1; use cpu"),
    ("tpu", (), r"run.device='tpu': expected auto, cpu, cuda or cuda:N"),
    ("meta", (), r"run.device='meta': expected auto, cpu, cuda or cuda:N"),
])
def test_a_device_the_machine_does_not_have_is_refused_by_name(name, machine_gpus, message):
    with pytest.raises(ConfigError, match=message):
        resolve_device(name, described(gpus=machine_gpus))


@pytest.mark.parametrize("name", ["auto", "cuda"])
def test_a_process_whose_gpu_the_machine_lacks_is_refused_naming_its_local_rank(name):
    """torchrun's second process of two on a host of one GPU took cuda:1 under "auto" (and failed with CUDA's
    "invalid device ordinal" traceback); "cuda" was refused suggesting auto, which took the same card."""
    with pytest.raises(ConfigError, match=rf"^run.device='{name}': this process's GPU is cuda:1 \(LOCAL_RANK=1\), "
                                          r"and this machine has 1 GPU\(s\); launch at most 1 process\(es\) on it "
                                          r"\(torchrun --nproc_per_node=1\), or use cpu$"):
        resolve_device(name, described(gpus=(H100,)), local_rank=1)
    assert resolve_device(name, described(gpus=(H100, H100)), local_rank=1) == torch.device("cuda:1")


def test_every_auto_is_stated_and_the_asked_config_is_left_as_it_was(tmp_path):
    cfg = auto_config(tmp_path)
    asked = to_dict(cfg)
    resolved = resolve(cfg, world(), described(cores=8))
    assert to_dict(cfg) == asked  # nothing written back into the config given
    assert autos(to_dict(resolved.config)) == []
    assert set(autos(asked)) == {"data.decode_workers", "data.stream", "data.stream_workers", "optim.accum_steps",
                                 "run.precision", "run.device", "run.compile_optimizer"}
    stated = resolved.config
    assert stated.run.device == "cpu" and stated.run.precision == resolved.precision
    assert stated.data.stream == "memory" and stated.data.stream_workers == 0  # the digits are held in memory
    assert stated.data.decode_workers == 8 == resolved.decode_workers
    assert stated.optim.accum_steps == resolved.accum_steps == 1  # a tiny model fits at once
    assert resolved.micro_batch == cfg.optim.batch_size and resolved.img_size == (8, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.precision = "fp16"


def test_processes_on_one_host_share_its_cores(tmp_path):
    resolved = resolve(auto_config(tmp_path), world(size=2, processes_here=2), described(cores=8))
    assert resolved.decode_workers == 4 and resolved.micro_batch == 16  # batch 32 over two processes


def test_more_threads_than_the_process_may_use_cores_are_refused(tmp_path):
    # torch.set_num_threads(100000) then crashed the process at its first matmul, without a word
    assert resolve(with_changes(auto_config(tmp_path), {"run.threads": 8}), world(), described(cores=8)).threads == 8
    with pytest.raises(ConfigError, match=r"^run.threads=9: this process may use 8 core\(s\) here; give 1 to 8, "
                                          r"or 0 for PyTorch's default \(at most those\)$"):
        resolve(with_changes(auto_config(tmp_path), {"run.threads": 9}), world(), described(cores=8))


def test_calibrate_times_in_the_threads_a_run_resolves_and_refuses_as_it_does(tmp_path, monkeypatch, capsys):
    """`vitlab calibrate` and a run take one thread rule (``resolve.thread_count``): calibrate held its own
    copy, so a change to the run's (its default at most the cores) could leave the kernels timed in others."""
    import vitlab.machine
    from vitlab.cli import main
    from vitlab.fast import KernelChoice, calibration, kernels

    timed, given = [], []
    monkeypatch.setattr(calibration, "calibrate", lambda rounds=3, say=None: (
        timed.append(given[-1]) or (KernelChoice(), "fp32", {})))
    monkeypatch.setattr(kernels, "calibration_path", lambda: tmp_path / "kernels.json")
    monkeypatch.setattr(vitlab.machine, "usable_cores", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)  # PyTorch's default counts the affinity mask
    monkeypatch.setattr(torch, "set_num_threads", given.append)
    for threads in (0, 1):
        assert main(["calibrate", "--json", "--threads", str(threads)]) == 0
        cfg = with_changes(auto_config(tmp_path), {"run.threads": threads})
        assert timed[-1] == resolve(cfg, world(), described(cores=2)).threads == (threads or 2)
    capsys.readouterr()
    assert main(["calibrate", "--threads", "3"]) == 2
    with pytest.raises(ConfigError) as refused:
        resolve(with_changes(auto_config(tmp_path), {"run.threads": 3}), world(), described(cores=2))
    assert capsys.readouterr().err.strip() == "vitlab calibrate: error: " + str(refused.value).replace("run.threads",
                                                                                                    "--threads")


def test_pytorchs_default_threads_are_at_most_the_cores_the_process_may_use(tmp_path, monkeypatch):
    # PyTorch's default counts the affinity mask: in a container with a 2-CPU quota on a 64-core host,
    # 64 threads time-sliced on 2 CPUs
    default = with_changes(auto_config(tmp_path), {"run.threads": 0})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    assert resolve(default, world(), described(cores=2)).threads == 2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert resolve(default, world(), described(cores=8)).threads == 3  # below: PyTorch's own


def test_a_gpu_takes_bf16_where_it_has_it_and_the_recipes_settings_for_it(tmp_path):
    from vitlab.configs.cifar10_scratch import get_config

    recipe = with_changes(get_config("vit"), {"data.source": "digits", "data.val_split": 100,
                                              "run.out": str(tmp_path / "run")})
    on_gpu = resolve(recipe, world("cuda:0"), described(gpus=(H100,)))
    assert on_gpu.precision == "bf16" and on_gpu.bf16_matmuls and on_gpu.kernels is not None
    assert on_gpu.config.optim.batch_size == 512 and on_gpu.config.data.progressive_sizes == ()
    assert on_gpu.config.model.overrides["width"] == 384  # the GPU's larger plain ViT
    assert on_gpu.config.augment.randaug_ops == 2  # ... for its many more epochs
    assert on_gpu.compile == "reduce-overhead"  # one input shape: CUDA graphs
    assert resolve(recipe, world("cuda:0"), described(gpus=(OLD_GPU,))).precision == "fp32"
    on_cpu = resolve(recipe, world("cpu"), described())
    assert on_cpu.config.optim.batch_size == 128 and on_cpu.config.data.progressive_sizes == ((24, 0.5),)
    assert on_cpu.config.model.overrides["width"] == 192 and on_cpu.config.augment.randaug_ops == 0
    assert on_cpu.compile == "off"  # the plain ViT recipe compiles only on a GPU


def test_the_optimizer_step_is_compiled_where_the_model_is_cuda_graphed(tmp_path):
    def resolved(device="cuda:0", size=1, **changes):
        cfg = with_changes(auto_config(tmp_path), {"run.compile": True, **changes})
        return resolve(cfg, world(device, size=size, processes_here=size), described(gpus=(H100, H100)))

    graphed = resolved()
    assert graphed.compile == "reduce-overhead" and graphed.compile_optimizer == "reduce-overhead"
    assert graphed.config.run.compile_optimizer is True and graphed.record()["compile_optimizer"] == "reduce-overhead"
    assert "compile reduce-overhead (optimizer step reduce-overhead)" in graphed.line()
    # progressive resizing: one CUDA graph per size
    assert resolved(**{"data.progressive_sizes": ((4, 0.5),)}).compile_optimizer == "reduce-overhead"
    # auto: not where the model is not CUDA-graphed (a CPU, two processes, no compile), nor under
    # fp16, whose gradient scaler works on the host around the step
    for not_graphed in (resolved("cpu"), resolved(size=2), resolved(**{"run.compile": False}),
                        resolved(**{"run.precision": "fp16"})):
        assert not_graphed.config.run.compile_optimizer is False and not_graphed.compile_optimizer == "off"
    assert resolved(**{"run.compile_optimizer": False}).compile_optimizer == "off"  # turned off
    # asked for: in the model's mode, or torch.compile's default where the model stays eager
    assert resolved("cpu", **{"run.compile_optimizer": True}).compile_optimizer == "default"
    assert resolved(**{"run.compile": False, "run.compile_optimizer": True}).compile_optimizer == "default"
    with pytest.raises(ConfigError, match=r"run.compile_optimizer=True: not with run.precision='fp16'"):
        resolved(**{"run.precision": "fp16", "run.compile_optimizer": True})


def test_a_recipe_never_probes_the_machine(monkeypatch):
    from vitlab.configs import load_recipe

    def probe():
        raise AssertionError("a recipe asked whether a GPU is present")

    monkeypatch.setattr(torch.cuda, "is_available", probe)
    monkeypatch.setattr(torch.cuda, "device_count", probe)
    cfg = load_recipe("cifar10_scratch:model=vit")
    assert cfg.run.device == "auto" and cfg.run.on_device["cuda"]["optim.batch_size"] == 512


def test_a_users_changes_win_over_the_recipes_settings_for_the_device(tmp_path):
    from vitlab.configs import load_recipe
    from vitlab.train.overrides import apply_overrides

    recipe = with_changes(load_recipe("cifar10_scratch"), {"data.source": "digits", "data.val_split": 100,
                                                           "run.out": str(tmp_path / "run")})
    mine = ["augment.randaug_magnitude=9", "optim.batch_size=256", "model.width=512", "model.num_heads=16",
            "run.compile_optimizer=true", "run.final_eval_shift=2"]
    changed = apply_overrides(recipe, mine)
    on_gpu = resolve(changed, world("cuda:0"), described(gpus=(H100,))).config
    untouched = resolve(recipe, world("cuda:0"), described(gpus=(H100,))).config
    assert on_gpu.augment.randaug_magnitude == 9 and on_gpu.optim.batch_size == 256 and on_gpu.run.compile_optimizer
    assert on_gpu.run.final_eval_shift == 2
    assert (on_gpu.model.overrides["width"], on_gpu.model.overrides["num_heads"]) == (512, 16)
    # what the user left alone is still the recipe's GPU setting: its model's other fields, RandAugment's
    # operations, the learning rate scaled for the GPU's batch
    for name in ("depth", "mlp_dim", "attn_bias", "classifier"):
        assert on_gpu.model.overrides[name] == untouched.model.overrides[name]
    assert untouched.model.overrides["width"] == 384 and untouched.optim.batch_size == 512
    assert on_gpu.augment.randaug_ops == untouched.augment.randaug_ops == 2 and on_gpu.optim.lr == untouched.optim.lr
    on_cpu = resolve(changed, world("cpu"), described()).config
    assert on_cpu.augment.randaug_magnitude == 9 and on_cpu.optim.batch_size == 256
    assert on_cpu.model.overrides["width"] == 512 and on_cpu.model.overrides["depth"] == 6  # the CPU's model, changed
    # a model given whole replaces the device's one
    whole = with_changes(recipe, {"model.overrides": dict(recipe.model.overrides, depth=2)})
    assert resolve(whole, world("cuda:0"), described(gpus=(H100,))).config.model.overrides["depth"] == 2


def test_a_resumed_run_keeps_the_arithmetic_and_layout_it_started_with(tmp_path):
    cfg = auto_config(tmp_path)
    first = resolve(cfg, world(), described(cores=8))
    saved = dict(first.record(), precision="bf16", bf16_matmuls=True, accum_steps=2, decode_workers=3)
    again = resolve(cfg, world(), described(cores=2), saved=json.loads(json.dumps(saved)))
    assert again.precision == "bf16" == again.config.run.precision and again.bf16_matmuls
    assert again.accum_steps == 2 == again.config.optim.accum_steps and again.micro_batch == 16
    assert again.kernels == first.kernels
    with pytest.raises(ConfigError, match="--resume: the checkpoint's run trained in fp16.*--precision fp16"):
        resolve(cfg, world(), described(), saved=dict(saved, precision="fp16"))


def test_a_resumed_run_on_processes_its_accumulation_does_not_divide_is_refused(tmp_path):
    """optim.accum_steps=auto on --resume keeps the checkpoint's count: a run of batch 36 in 4 micro-batches of
    9, resumed on 2 processes, took micro-batches of 36 // 8 = 4, a batch of 32, without a word."""
    cfg = auto_config(tmp_path, batch_size=36)
    saved = json.loads(json.dumps(dict(resolve(cfg, world(), described()).record(), accum_steps=4)))
    assert resolve(cfg, world(), described(), saved=saved).micro_batch == 9
    with pytest.raises(ConfigError, match=r"^--resume: optim.accum_steps=auto keeps the checkpoint's 4 micro-batches "
                                          r"a step, and optim.batch_size=36 does not divide into 4 x world_size=2 = 8 "
                                          r"equal micro-batches; resume on 1, 3 or 9 process\(es\)$"):
        resolve(cfg, world(size=2), described(), saved=saved)
    assert resolve(cfg, world(size=3), described(), saved=saved).micro_batch == 3


def test_a_resumed_run_refuses_another_precision_asked_by_name(tmp_path):
    cfg = auto_config(tmp_path)
    saved = json.loads(json.dumps(dict(resolve(cfg, world(), described()).record(), precision="fp32")))
    # the checkpoint's fp32 was kept: --precision bf16 on --resume trained on in fp32 without a word
    with pytest.raises(ConfigError, match=r"^--resume: run.precision='bf16' \(checkpoint: 'fp32'\): a resumed run "
                                          r"keeps the arithmetic it started with; set --precision fp32 \(or auto\)$"):
        resolve(with_changes(cfg, {"run.precision": "bf16"}), world(), described(), saved=saved)
    assert resolve(with_changes(cfg, {"run.precision": "fp32"}), world(), described(), saved=saved).precision == "fp32"


def test_the_record_round_trips_through_json(tmp_path):
    resolved = resolve(auto_config(tmp_path), world(), described())
    record = json.loads(json.dumps(resolved.record()))
    assert set(record) == set(Resolved.RECORDED)
    assert KernelChoice(**record["kernels"]) == resolved.kernels


def test_a_run_that_cannot_fit_is_refused_by_the_machine_it_is_given(tmp_path):
    cfg = with_changes(auto_config(tmp_path), {"optim.accum_steps": 1})
    with pytest.raises(ConfigError, match="run.memory_check"):
        resolve(cfg, world(), described(memory=1 << 20))
    assert resolve(cfg, world(), described(memory=1 << 20), preview=True).memory.peak > 1 << 20


def test_finetune_size_scales_the_papers_384_by_the_inits_resolution():
    assert finetune_size(224, 16) == 384  # the paper: 224-px pre-training, 384-px fine-tuning
    assert finetune_size(32, 16) == 48    # 54.9 to the nearest multiple of 16
    assert finetune_size(16, 4) == 28     # the demo's model
    assert finetune_size(160, 16) == 272
    assert finetune_size(384, 16) == 384 and finetune_size(512, 16) == 512  # its own


def test_a_fine_tunes_size_is_its_inits_as_the_file_is_now(tmp_path):
    """The init's architecture was cached by its path for the process: weights at 16 px written where
    weights at 8 px had been read were fine-tuned at 8 px (their position embeddings cut to one patch)."""
    import vitlab
    from vitlab.train.resolve import init_architecture, training_size

    path = tmp_path / "w.safetensors"
    cfg = with_changes(tiny_config(tmp_path / "run"), {"model.init": str(path), "model.overrides": {}})
    for size, patch in ((8, 4), (16, 8)):
        vitlab.save_model(vitlab.create_model("ViT-Ti/16", img_size=size, patch_size=patch, width=16, depth=1,
                                              num_heads=2, mlp_dim=32, num_classes=10), path)
        assert init_architecture(cfg).img_size == (size, size) and training_size(cfg) == (size, size)


def test_build_leaves_the_processs_threads_and_random_streams_as_it_found_them(tmp_path):
    from vitlab.train.build import build

    threads = torch.get_num_threads()
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    setup = build(with_changes(tiny_config(tmp_path / "run"), {"run.threads": max(1, threads - 1) if threads > 1
                                                                 else 2}))
    assert torch.get_num_threads() == threads
    assert torch.equal(torch.rand(3), expected)  # the caller's stream, untouched by the model's initialisation
    torch.manual_seed(0)  # the run's seed: the state it starts its steps from follows the model's initialisation
    assert not torch.equal(setup.rng["torch"], torch.get_rng_state())


# ----------------------------------------------------------------------------- fp8 matmuls (run.fp8)


def test_fp8_is_refused_without_fp8_tensor_cores_and_taken_on_a_gpu_that_has_them(tmp_path):
    cfg = with_changes(auto_config(tmp_path), {"run.fp8": "tensorwise"})
    with pytest.raises(ConfigError) as refused:
        resolve(cfg, world("cpu"), described())
    message = str(refused.value)
    assert message.startswith("run.fp8='tensorwise' needs a CUDA GPU of compute capability 8.9 or higher")
    assert "this run resolves to cpu: set run.fp8='off'" in message and "\n" not in message
    with pytest.raises(ConfigError, match=r"resolves to cuda:0, NVIDIA A100-SXM4-80GB \(compute capability 8.0\)"):
        resolve(cfg, world("cuda:0"), described(gpus=(A100,)))
    unknown = dataclasses.replace(H100, capability=None)  # a card described without its capability: not assumed
    with pytest.raises(ConfigError, match=r"compute capability unknown"):
        resolve(cfg, world("cuda:0"), described(gpus=(unknown,)))
    with pytest.raises(ConfigError, match="resolves to cuda:1, a GPU this machine lacks"):
        resolve(cfg, world("cuda:1"), described(gpus=(H100,)))

    on_h100 = resolve(with_changes(cfg, {"run.fp8": "rowwise"}), world("cuda:0"), described(gpus=(H100,)))
    assert on_h100.config.run.fp8 == "rowwise" and on_h100.precision == "bf16"  # auto: bf16 around the fp8 layers
    assert "precision bf16 with fp8 rowwise matmuls" in on_h100.line()
    assert on_h100.memory.shape.fast is False  # the blocks take the plain forward: the estimate keeps their outputs
    assert resolve(auto_config(tmp_path), world("cuda:0"), described(gpus=(H100,))).memory.shape.fast is True


def test_cudnn_attention_is_a_gpus_choice_refused_for_a_cpu_run(tmp_path):
    from vitlab.train.resolve import preview

    cfg = with_changes(auto_config(tmp_path), {"run.gpu_attention": "cudnn"})
    with pytest.raises(ConfigError) as refused:
        resolve(cfg, world("cpu"), described())
    assert str(refused.value) == ("run.gpu_attention='cudnn' chooses among a CUDA GPU's attention kernels; this run "
                                  "resolves to cpu: set run.gpu_attention='torch'")
    with pytest.raises(ConfigError, match="run.gpu_attention='cudnn'"):
        preview(cfg, described())
    assert resolve(cfg, world("cuda:0"), described(gpus=(H100,))).config.run.gpu_attention == "cudnn"
    # a recipe's setting for GPUs is checked only where it applies
    on_gpus = with_changes(auto_config(tmp_path), {"run.on_device": {"cuda": {"run.gpu_attention": "cudnn"}}})
    assert resolve(on_gpus, world("cpu"), described()).config.run.gpu_attention == "torch"
    assert resolve(on_gpus, world("cuda:0"), described(gpus=(H100,))).config.run.gpu_attention == "cudnn"


def test_autotuning_is_a_compiled_gpu_runs_choice_with_or_without_cuda_graphs(tmp_path):
    from vitlab.train.resolve import preview

    def resolved(device="cuda:0", size=1, **changes):
        cfg = with_changes(auto_config(tmp_path), {"run.compile": True, "run.compile_autotune": True, **changes})
        return resolve(cfg, world(device, size=size, processes_here=size), described(gpus=(H100, H100)))

    graphed = resolved()  # one GPU: CUDA graphs, as "reduce-overhead" has them
    assert graphed.compile == "max-autotune" and graphed.compile_optimizer == "max-autotune"
    assert graphed.memory.shape.cuda_graphs and graphed.memory.shape.holds_gradients  # the graphs' rules hold
    assert resolved(size=2).compile == "max-autotune-no-cudagraphs"  # processes: no CUDA graphs, as "default"
    assert resolve(with_changes(auto_config(tmp_path), {"run.compile": True}), world("cuda:0"),
                   described(gpus=(H100,))).compile == "reduce-overhead"  # not asked: as before
    with pytest.raises(ConfigError) as refused:
        resolved("cpu")
    assert str(refused.value) == ("run.compile_autotune=True tunes a CUDA GPU's Triton matmul templates; this run "
                                  "resolves to cpu: set run.compile_autotune=false")
    with pytest.raises(ConfigError, match=r"^run.compile_autotune=True is a mode of torch.compile, and this run is "
                                          r"not compiled: add --compile"):
        resolved(**{"run.compile": False})
    with pytest.raises(ConfigError, match="run.compile_autotune=True tunes"):
        preview(with_changes(auto_config(tmp_path), {"run.compile": True, "run.compile_autotune": True}), described())
    # a recipe's setting for GPUs, its compile there included, is checked only where it applies
    on_gpus = with_changes(auto_config(tmp_path), {"run.on_device": {"cuda": {"run.compile": True,
                                                                             "run.compile_autotune": True}}})
    assert resolve(on_gpus, world("cpu"), described()).compile == "off"
    assert resolve(on_gpus, world("cuda:0"), described(gpus=(H100,))).compile == "max-autotune"


def test_torchaos_fp8_is_checked_for_where_fp8_runs_and_named_in_the_resolved_line(tmp_path, monkeypatch):
    import sys

    from vitlab.extras import MissingPackage

    cfg = with_changes(auto_config(tmp_path), {"run.fp8": "tensorwise", "run.fp8_backend": "torchao"})
    with pytest.raises(ConfigError, match="run.fp8='tensorwise' needs a CUDA GPU"):  # the device is refused first
        resolve(cfg, world("cpu"), described())
    pytest.importorskip("torchao.float8")
    on_h100 = resolve(cfg, world("cuda:0"), described(gpus=(H100,)))
    assert "precision bf16 with fp8 tensorwise matmuls by torchao" in on_h100.line()
    for name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as on a machine without it
    with pytest.raises(MissingPackage) as missing:
        resolve(cfg, world("cuda:0"), described(gpus=(H100,)))
    assert str(missing.value) == ("run.fp8_backend='torchao' needs torchao, which is not installed: "
                                  'pip install -e ".[fp8]"')
    assert "by torchao" not in resolve(with_changes(cfg, {"run.fp8_backend": "vitlab"}), world("cuda:0"),
                                       described(gpus=(H100,))).line()
    with pytest.raises(ConfigError, match="run.fp8_backend='te': allowed values are 'vitlab', 'torchao'"):
        with_changes(cfg, {"run.fp8_backend": "te"})


def test_fp8_runs_inside_bf16_autocast_and_names_its_choices(tmp_path):
    from vitlab.train.config import RunConfig

    for precision in ("fp32", "fp16"):
        with pytest.raises(ConfigError, match=f"run.fp8='rowwise'.*set run.precision to 'bf16' or 'auto' "
                                              f"\\(here '{precision}'\\)"):
            RunConfig(precision=precision, fp8="rowwise")
    with pytest.raises(ConfigError, match="run.fp8='blockwise'.*'off', 'tensorwise', 'rowwise'"):
        RunConfig(precision="bf16", fp8="blockwise")
    assert RunConfig().fp8 == "off"


def test_a_recipes_fp8_for_gpus_is_checked_only_where_it_applies(tmp_path):
    cfg = with_changes(auto_config(tmp_path), {"run.on_device": {"cuda": {"run.fp8": "tensorwise"}}})
    assert resolve(cfg, world("cpu"), described()).config.run.fp8 == "off"
    assert resolve(cfg, world("cuda:0"), described(gpus=(H100,))).config.run.fp8 == "tensorwise"
    with pytest.raises(ConfigError, match="run.fp8='tensorwise' needs a CUDA GPU"):
        resolve(cfg, world("cuda:0"), described(gpus=(A100,)))


def test_show_config_states_fp8_on_a_gpu_that_has_it_and_refuses_it_elsewhere(tmp_path):
    from vitlab.train.resolve import preview

    cfg = with_changes(auto_config(tmp_path), {"run.fp8": "tensorwise"})
    shown = json.loads(json.dumps(preview(cfg, described(gpus=(H100,)))))
    assert shown["run"]["fp8"] == "tensorwise" and shown["run"]["precision"] == "bf16"
    assert shown["resolved"]["device"] == "cuda:0" and shown["memory_estimate"]["fast"] is False
    with pytest.raises(ConfigError, match="run.fp8='tensorwise' needs a CUDA GPU .* resolves to cpu"):
        preview(cfg, described())


def test_a_preview_reads_the_free_memory_of_its_own_processs_gpu_as_the_run_does(tmp_path, monkeypatch):
    # torchrun's process 1 previewing (--show-config) resolved to cuda:1 and read card 0's free memory, opening
    # a CUDA context on another process's card, and estimated its run without its own card's memory
    import vitlab.machine
    from vitlab.train.memory_estimate import GB
    from vitlab.train.resolve import preview

    measured = []

    def card(index, measure_free):
        measured.extend([index] if measure_free else [])
        return dataclasses.replace(H100, free_bytes=(79 << 30) if measure_free else None)

    monkeypatch.setattr(vitlab.machine, "_gpu", card)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    shown = preview(with_changes(auto_config(tmp_path), {"optim.accum_steps": 1}))
    assert shown["resolved"]["device"] == "cuda:1" and measured == [1]
    assert shown["memory_estimate"]["available_gb"]["gpu"] == round((79 << 30) / GB, 3)  # its own card's


def test_a_streaming_setting_is_refused_on_a_run_that_holds_its_data_in_memory(tmp_path):
    # the readers' shuffle buffer and draft decoding stream only, and memory_limit_gb only decides "auto" (or
    # bounds a streamed set's held-out shards): on the in-memory digits they were accepted and did nothing
    for changes, message in (({"data.shuffle_buffer": 100}, r"data.shuffle_buffer=100: read by a streamed training "
                                                             r"set's readers, and this run holds its data in memory "
                                                             r"\(data.stream='auto'\); leave it at 1000"),
                             ({"data.draft": False}, r"data.draft=False: read by a streamed training set's readers"),
                             ({"data.stream": "memory", "data.memory_limit_gb": 2.0},
                              r"data.memory_limit_gb=2.0: decides data.stream='auto' and bounds a streamed set's "
                              r"held-out shards \(data.val_split\), and this run has data.stream='memory' \(in memory\) "
                              r"without them; leave it at 8.0")):
        with pytest.raises(ConfigError, match=rf"^{message}"):
            resolve(with_changes(auto_config(tmp_path), changes), world(), described())
    # the defaults, and a limit that decides "auto", are read or harmless
    assert resolve(with_changes(auto_config(tmp_path), {"data.memory_limit_gb": 2.0}), world(), described()).data \
        == "memory"


def test_a_number_of_stream_workers_is_refused_on_a_run_that_holds_its_data_in_memory(tmp_path):
    # DataLoader workers read a streamed training set only: data.stream_workers=4 on the in-memory digits was
    # accepted and did nothing; "auto" and 0 (what such a run records in its config.json) stay allowed
    with pytest.raises(ConfigError, match=r"^data.stream_workers=4: read by a streamed training set's readers, and "
                                          r"this run holds its data in memory \(data.stream='auto'\); leave it at "
                                          r"'auto' or 0"):
        resolve(with_changes(auto_config(tmp_path), {"data.stream_workers": 4}), world(), described())
    for workers in ("auto", 0):
        stated = resolve(with_changes(auto_config(tmp_path), {"data.stream_workers": workers}), world(), described())
        assert stated.data == "memory" and stated.config.data.stream_workers == 0


AGREE = """
import dataclasses, json, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[4])
from conftest import tiny_config
from vitlab.machine import Machine
from vitlab.train.distributed import World, shutdown
from vitlab.train.overrides import with_changes
from vitlab.train.resolve import resolve
rank, memory, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
cfg = with_changes(tiny_config(store + ".run", batch_size=256), {"optim.accum_steps": "auto", "model.overrides": dict(
    img_size=16, patch_size=2, width=64, depth=2, num_heads=2, mlp_dim=128, name="ViT-agree/2")})
world = World(rank=rank, size=2, local_rank=rank, device=torch.device("cpu"), processes_here=2)
print(resolve(cfg, world, Machine.described(cores=2, memory_available=memory)).config.optim.accum_steps)
shutdown(dataclasses.replace(world, owns_group=True))  # as a run ends it: left at once, gloo aborted one process
"""


@pytest.mark.slow
def test_the_processes_of_a_run_plan_one_micro_batch_with_the_least_memory_any_of_them_read(tmp_path):
    """Each process reads its host's available memory at its own moment (and its own GPU's free memory):
    with `--accum-steps auto` one that read more chose fewer, larger micro-batches than another, and the
    processes took different slices of each global batch (FSDP's gathers, one per micro-batch, then
    did not pair up).  Here 500 MB gives 1 micro-batch a step alone, 300 MB 4."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root, tests = Path(__file__).resolve().parents[2], str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", AGREE, str(rank), str(memory << 20), str(tmp_path / "store"),
                               tests], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, memory in ((0, 500), (1, 300))]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [int(out.split()[-1]) for out, _ in outs] == [4, 4]


AGREE_WORKERS = """
import dataclasses, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[4])
from conftest import tiny_config
from vitlab.machine import Machine
from vitlab.train.distributed import World, shutdown
from vitlab.train.resolve import resolve
rank, cores, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
cfg = tiny_config(store + ".run", data=sys.argv[5], val_split=0, **{"data.stream_workers": "auto"})
world = World(rank=rank, size=2, local_rank=0, device=torch.device("cpu"))  # one process on each of two hosts
resolved = resolve(cfg, world, Machine.described(cores=cores, memory_available=int(sys.argv[6]) << 20))
print(resolved.stream_workers, resolved.memory.shape.stream_workers, flush=True)
shutdown(dataclasses.replace(world, owns_group=True))  # as a run ends it: left at once, gloo aborted one process
"""


@pytest.mark.slow
@pytest.mark.parametrize("memory_mb", [24 << 10, 500])
def test_the_processes_of_a_streamed_run_read_with_one_count_of_workers(tmp_path, memory_mb):
    """Reader r of rank k takes the shards' order from k x workers + r, every world_size x workers: each
    process decided its own count from its host's cores, and with 4 workers on one host and 1 on the
    other, the second's reader started at the first's second and stepped by 2, reading shards the first
    read and leaving others unread, without a word.  The count is agreed before the memory is planned:
    each reader holds an interpreter, and in 500 MB the process that came to 4 was refused (its estimate
    0.7 GB) where the one that came to 1 fitted and waited for it in the agreement."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np
    from PIL import Image

    from vitlab.data.shards import pack_shards

    rng = np.random.default_rng(0)
    for c in range(3):
        (tmp_path / "folder" / f"c{c}").mkdir(parents=True)
        for i in range(16):
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(tmp_path / "folder" / f"c{c}" / f"{i}.png")
    pack_shards(tmp_path / "folder", tmp_path / "shards", samples_per_shard=6)  # 8 shards: 4 a process
    root, tests = Path(__file__).resolve().parents[2], str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", AGREE_WORKERS, str(rank), str(cores), str(tmp_path / "store"),
                               tests, str(tmp_path / "shards"), str(memory_mb)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for rank, cores in ((0, 8), (1, 2))]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [out.split()[-2:] for out, _ in outs] == [["1", "1"], ["1", "1"]]  # the least, and its memory


AGREE_ARITHMETIC = """
import dataclasses, json, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[3])
import vitlab.fast
from conftest import tiny_config
from vitlab.machine import Machine
from vitlab.train.distributed import World, shutdown
from vitlab.train.resolve import resolve
rank, store, saved = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[4])
vitlab.fast.cpu_precision = lambda info=None: "bf16" if rank == 0 else "fp32"  # each host's rule or calibration
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
cfg = tiny_config(store + ".run", **{"run.precision": "auto"})
world = World(rank=rank, size=2, local_rank=0, device=torch.device("cpu"))  # one process on each of two hosts
resolved = resolve(cfg, world, Machine.described(cores=2), saved)
print(resolved.precision, resolved.config.run.precision, resolved.bf16_matmuls)
shutdown(dataclasses.replace(world, owns_group=True))  # as a run ends it: left at once, gloo aborted one process
"""


@pytest.mark.slow
@pytest.mark.parametrize("saved", [{}, {"precision": "fp32"}])
def test_the_processes_of_a_run_train_in_one_arithmetic(tmp_path, saved):
    """Each process decided run.precision=auto, and whether Muon orthogonalises in bf16, from its own
    host's CPU and stored calibration: on two hosts of which one calls for bf16, one process trained in
    bf16 and the other in fp32 (config.json stating rank 0's), and Muon updated the two replicas in
    other precisions, so that they drifted apart.  A resumed run keeps its checkpoint's, and one written
    before bf16_matmuls was recorded (``saved`` without it) left each process its own host's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root, tests = Path(__file__).resolve().parents[2], str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", AGREE_ARITHMETIC, str(rank), str(tmp_path / "store"), tests,
                               json.dumps(saved)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [out.split()[-3:] for out, _ in outs] == [["fp32", "fp32", "False"]] * 2  # bf16 only where all are


AGREE_ACCUM = """
import dataclasses, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[3])
import vitlab.fast
from conftest import tiny_config
from vitlab.fast.kernels import KernelChoice
from vitlab.machine import Machine
from vitlab.train.distributed import World, shutdown
from vitlab.train.overrides import with_changes
from vitlab.train.resolve import resolve
rank, store = int(sys.argv[1]), sys.argv[2]
attention = "explicit" if rank == 1 else "fused"  # each host's kernels (its rule or calibration)
vitlab.fast.choose = lambda path=None, info=None: KernelChoice(attention=attention)
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
cfg = with_changes(tiny_config(store + ".run", batch_size=256), {"optim.accum_steps": "auto", "model.overrides": dict(
    img_size=16, patch_size=2, width=64, depth=2, num_heads=2, mlp_dim=128, name="ViT-agree/2")})
world = World(rank=rank, size=2, local_rank=0, device=torch.device("cpu"))  # one process on each of two hosts
resolved = resolve(cfg, world, Machine.described(cores=2, memory_available=215 << 20))
print(resolved.accum_steps, resolved.micro_batch, resolved.memory.shape.accum_steps, resolved.memory.shape.micro_batch)
shutdown(dataclasses.replace(world, owns_group=True))  # as a run ends it: left at once, gloo aborted one process
"""


@pytest.mark.slow
def test_the_processes_of_a_run_slice_the_batch_alike_where_their_estimates_differ(tmp_path):
    """With the memory agreed, each process still estimated its run with its own host's kernels: the
    one whose attention is the explicit kernel (its fp32 scores kept) planned 2 micro-batches of 64 in
    215 MB, the other 1 of 128, and the processes sliced each global batch two ways.  Every process
    takes the most any planned."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root, tests = Path(__file__).resolve().parents[2], str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", AGREE_ACCUM, str(rank), str(tmp_path / "store"), tests],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [out.split()[-4:] for out, _ in outs] == [["2", "64", "2", "64"]] * 2  # and each estimate at it


REFUSED_ON_ONE = """
import dataclasses, sys
from vitlab.machine import Machine
cores = int(sys.argv[1])
here = Machine.here
Machine.here = staticmethod(lambda gpu_index=0: dataclasses.replace(here(gpu_index), cores=cores))  # this host's
from vitlab.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("refused", ["threads", "out"])
def test_a_refusal_met_by_one_process_stops_every_process_with_its_line(tmp_path, refused):
    """A refusal of one host's alone, met by rank 1 as the run was resolved (run.threads above its
    cores) or before (its run folder holding an earlier run's weights): rank 1 left, and rank 0, in the
    resolution's next collective call, failed with gloo's 'Connection closed by peer' traceback (or waited
    for it until the backend's timeout).  Every process now stops with rank 1's line, printed once, as
    under torchrun (the test keeps the store torchrun's agent keeps, where rank 0 posts its error)."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    import torch.distributed as dist

    from vitlab.weights.native import WEIGHTS_NAME

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / WEIGHTS_NAME).write_bytes(b"")
    root = Path(__file__).resolve().parents[2]
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
               "TORCHELASTIC_RESTART_COUNT": "0"}
        cores = 1 if refused == "threads" and rank == 1 else 4
        out = earlier if refused == "out" and rank == 1 else tmp_path / "run"
        procs.append(subprocess.Popen([sys.executable, "-c", REFUSED_ON_ONE, str(cores), "train", "--recipe", "demo",
                                       "--data", "digits", "--steps", "2", "--set", "run.threads=2", "--out", str(out)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [2, 2], outs
    why = ("run.threads=2: this process may use 1 core(s) here" if refused == "threads"
           else f"run.out={str(earlier)!r} holds the weights of an earlier run")
    said = [[line for line in err.splitlines() if "error" in line or "Traceback" in line] for _, err in outs]
    assert len(said[0]) == 1 and said[1] == [], outs  # rank 0 prints it, rank 1 finds it posted
    assert said[0][0].startswith(f"vitlab train: error: rank 1 of 2 (host {socket.gethostname()}): {why}"), outs
