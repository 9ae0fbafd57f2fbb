"""A library call leaves its caller's process as it found it.

Each test takes a snapshot of what a library can change in its process without a word (torch's
threads, default dtype, grad and inference modes and autocast; the torch, numpy and Python random
streams; the matmul-precision and backend flags; inductor's and dynamo's settings; warnings'
filters and format; logging's handlers and levels; the environment, the working directory,
sys.path; matplotlib's backend), calls one public entry point as a user would, on a tiny model
and tiny data, and compares.  A model handed to the call keeps its train/eval mode, module by
module, and its parameters' requires_grad.

Where the library changes its process on purpose and says so (a model's initial weights are drawn
from torch's random stream, as every ``torch.nn`` module draws them; ``run.retain_freed_memory``
changes malloc for the rest of the process), the test names that exception and asserts the
documented behaviour instead.  What another package does to a process once, whoever calls it
first (scikit-learn's import, the start of torch's compiler), is done before the snapshot.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import random
import shutil
import sys
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import vitlab
from vitlab import fast
from vitlab.modes import evaluating

TINY = vitlab.ViTConfig(img_size=16, patch_size=4, width=32, depth=1, mlp_dim=64, num_heads=2, num_classes=3)


# ----------------------------------------------------------------------------- the snapshot


def digest(*parts) -> str:
    """A short name of a random stream's state, for a readable before -> after."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:12]


def random_streams() -> dict:
    """The three global random streams."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch random stream": digest(torch.get_rng_state().numpy().tobytes()),
        "numpy random stream": digest(name, keys.tobytes(), pos, has_gauss, cached),
        "python random stream": digest(random.getstate()),
        "cuda random streams": digest([t.numpy().tobytes() for t in torch.cuda.get_rng_state_all()])
        if torch.cuda.is_available() else None,
    }


def torch_flags() -> dict:
    """torch's process-wide switches: threads, dtype, autograd modes, autocast, matmul precision, backends."""
    return {
        "torch threads": torch.get_num_threads(),
        "torch default dtype": torch.get_default_dtype(),
        "torch default device": torch.get_default_device(),
        "grad enabled": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "cpu autocast": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "float32 matmul precision": torch.get_float32_matmul_precision(),
        "cuda matmul allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cuda matmul reduced-precision reductions": (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
                                                     torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction),
        "cudnn flags": (torch.backends.cudnn.enabled, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark,
                        torch.backends.cudnn.deterministic),
        "mkldnn enabled": torch.backends.mkldnn.enabled,
    }


def compiler_settings() -> dict:
    """inductor's and dynamo's settings, whole (compile_for_inference sets ``freezing`` and
    ``triton.cudagraphs`` for its own compilation only)."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    return {"inductor config": inductor_config.get_config_copy(), "dynamo config": dynamo_config.get_config_copy()}


def python_settings() -> dict:
    """warnings, logging, the environment, the working directory, the import path, numpy's error mode."""
    loggers = logging.Logger.manager.loggerDict
    return {
        "warnings filters": list(warnings.filters),
        "warnings format": (warnings.formatwarning, warnings.showwarning),
        "root logger": (logging.root.level, list(logging.root.handlers), logging.root.manager.disable),
        "vitlab logger": (logging.getLogger("vitlab").level, list(logging.getLogger("vitlab").handlers),
                          logging.getLogger("vitlab").propagate),
        # the levels of the loggers that exist now (a call may import modules that make new ones)
        "logger levels": {name: lg.level for name, lg in loggers.items() if isinstance(lg, logging.Logger)},
        "environment": dict(os.environ),
        "working directory": os.getcwd(),
        "sys.path": list(sys.path),
        "numpy error mode": np.geterr(),
    }


def matplotlib_backend():
    """The backend the caller chose (read raw: reading rcParams["backend"] would resolve it)."""
    try:
        import matplotlib
    except ImportError:
        return None
    return matplotlib.rcParams._get("backend")


def process_state() -> dict:
    return {**random_streams(), **torch_flags(), **compiler_settings(), **python_settings(),
            "matplotlib backend": matplotlib_backend()}


def model_state(model: torch.nn.Module) -> dict:
    return {"training modes": {name or "(the model)": m.training for name, m in model.named_modules()},
            "requires_grad": {name: p.requires_grad for name, p in model.named_parameters()}}


def differences(before: dict, after: dict) -> list[str]:
    """What changed between two snapshots, a line each: its name, before -> after."""
    lines = []
    for key, old in before.items():
        new = after[key]
        if key == "logger levels":
            new = {name: level for name, level in new.items() if name in old}
        if old != new:
            if isinstance(old, dict):
                changed = sorted(k for k in set(old) | set(new) if old.get(k, "<absent>") != new.get(k, "<absent>"))
                old, new = ({k: d.get(k, "<absent>") for k in changed} for d in (old, new))
            lines.append(f"{key}: {old!r:.300} -> {new!r:.300}")
    return lines


@contextlib.contextmanager
def leaves_process_as_found(*models: torch.nn.Module, changes: tuple[str, ...] = ()):
    """Asserts that the block changes nothing of ``process_state`` but the entries named in
    ``changes`` (the call's documented effects), and nothing of ``models``' modes."""
    before, modes = process_state(), [model_state(m) for m in models]
    yield
    after = process_state()
    for key in changes:
        before.pop(key), after.pop(key)
    changed = differences(before, after)
    assert not changed, "the call changed its process:\n" + "\n".join(changed)
    for model, mode in zip(models, modes):
        changed = differences(mode, model_state(model))
        assert not changed, "the call changed the model it was handed:\n" + "\n".join(changed)


@pytest.fixture
def caller():
    """A caller whose settings differ from what the library would set: more threads than the
    runs' one, and seeded streams."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)
    yield
    torch.set_num_threads(threads)


def tiny_model() -> torch.nn.Module:
    """A model as a caller hands it over between training steps: in training mode but for one frozen
    normalisation held in eval mode, one parameter frozen."""
    model = vitlab.create_model(TINY)
    with torch.no_grad():  # the zero-initialised head would make every output 0
        model.head.weight.normal_(std=0.1)
    model.cls_token.requires_grad_(False)  # a frozen parameter, which a call must leave frozen
    model.train()
    # modes mixed, as a caller fine-tuning around a frozen part holds them: a call that gives back
    # the root's mode to every module (model.train(was_training)) would set this one training
    model.blocks[0].norm1.eval()
    return model


def tiny_images(n: int = 12) -> torch.Tensor:
    return torch.randint(0, 256, (n, 3, TINY.img_size[0], TINY.img_size[1]), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0))


def test_the_snapshot_sees_a_change(caller):
    """The helper itself: each kind of change is seen."""
    model = tiny_model()
    with pytest.raises(AssertionError):
        with leaves_process_as_found():
            torch.rand(1)
    with pytest.raises(AssertionError):
        with leaves_process_as_found(model):
            model.eval()
    model = tiny_model()
    with pytest.raises(AssertionError):
        with leaves_process_as_found(model):
            model.train(model.training)  # the root's mode given to all: the frozen normalisation trains
    with pytest.raises(AssertionError), warnings.catch_warnings():
        with leaves_process_as_found():
            warnings.simplefilter("ignore")
    threads = torch.get_num_threads()
    try:
        with pytest.raises(AssertionError):
            with leaves_process_as_found():
                torch.set_num_threads(1)
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- models and weights


def test_create_model(caller):
    # the initial weights are drawn from torch's random stream, as every torch.nn module draws
    # them: torch.manual_seed(0) before create_model is how a user makes them reproducible
    with leaves_process_as_found(changes=("torch random stream",)):
        vitlab.create_model(TINY)
        vitlab.create_model("ViT-Ti/16", img_size=16, patch_size=8, width=16, depth=1, num_heads=2, mlp_dim=32)


FILE_NAMES = {"vitlab": "weights", "official": "weights.npz", "hf": "hf", "timm": "weights.pth"}
LOAD_ARGS = {"hf": {"num_heads": TINY.num_heads}}  # Hugging Face's config has no head count that vitlab reads


@pytest.mark.parametrize("format", list(FILE_NAMES))
def test_save_and_load_model(caller, tmp_path, format):
    model = tiny_model()
    with leaves_process_as_found(model):
        path = vitlab.save_model(model, tmp_path / FILE_NAMES[format], format=format)
        loaded = vitlab.load_model(path, **LOAD_ARGS.get(format, {}))
        vitlab.load_model(path, num_classes=5, **LOAD_ARGS.get(format, {}))  # a new, zero-initialised head
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


# ----------------------------------------------------------------------------- the fast path


def test_fast_optimize_and_restore(caller):
    model = tiny_model()
    x = torch.randn(2, 3, 16, 16)
    with leaves_process_as_found(model):
        fast.optimize(model)
        model(x).sum().backward()
        with torch.no_grad(), evaluating(model):  # inference too, as a caller runs it (its modes given back)
            model(x)
        fast.restore(model)
        with fast.optimized(model) as optimised:
            optimised(x)


def test_calibrate(caller, tmp_path, monkeypatch):
    from vitlab.fast import calibration

    # the workloads shrunk to a tiny model: what is measured here is what calibrating leaves behind
    tiny = dict(img_size=16, patch_size=4, width=32, depth=1, mlp_dim=64, num_heads=2, num_classes=3)
    monkeypatch.setattr(calibration, "WORKLOADS", {"training": ("tiny b4", "ViT-Ti/16", tiny, 4),
                                                   "inference": ("tiny b2", "ViT-Ti/16", tiny, 2)})
    with leaves_process_as_found():
        calibration.calibrate(tmp_path / "calibration.json", rounds=1)


@pytest.fixture
def compiler_started():
    """torch's compiler, started before the snapshot: its first compilation in a process sets
    environment variables of its own (TORCHINDUCTOR_CACHE_DIR, _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR)
    and puts setuptools' vendored packages on sys.path, whoever compiles first; the test measures
    what vitlab's call adds (compile_for_inference sets inductor's options for its model only)."""
    torch.compile(lambda x: x + 1)(torch.ones(2))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor needs a C++ compiler on a CPU")
def test_compile_for_inference(caller, compiler_started):
    model = tiny_model()
    x = torch.randn(3, 3, 16, 16)
    with leaves_process_as_found(model):
        infer = fast.compile_for_inference(model, batch_size=2)
        infer(x)


# ----------------------------------------------------------------------------- evaluation


def test_evaluator(caller):
    from vitlab.eval import Evaluator

    model, images = tiny_model(), tiny_images()
    labels = torch.arange(len(images)) % TINY.num_classes
    with leaves_process_as_found(model):
        Evaluator(images, labels, batch_size=5).run(model)
        Evaluator(images, labels, batch_size=5, flip=True, shift=1, report_bins=4).run(model)


def test_features_and_logits(caller):
    from vitlab.eval import extract_features, predict_logits

    model, images = tiny_model(), tiny_images()
    with leaves_process_as_found(model):
        extract_features(model, images, batch_size=5)
        predict_logits(model, images, batch_size=5)


def test_fewshot(caller):
    from vitlab.eval import extract_features
    from vitlab.eval.fewshot import fewshot_evaluate

    model, images = tiny_model(), tiny_images(40)
    labels = np.arange(len(images)) % 2
    with leaves_process_as_found(model):
        features = extract_features(model, images, batch_size=16)
        fewshot_evaluate(features[:30], labels[:30], features[30:], labels[30:], shots=(1, 2), seeds=(0, 1),
                         holdout_per_class=2)


# ----------------------------------------------------------------------------- analysis


def test_analysis(caller):
    from vitlab.analysis import attention, embeddings
    from vitlab.analysis.cost import count_flops
    from vitlab.data.transforms import to_float

    model = tiny_model()
    x = to_float(tiny_images(4))
    with leaves_process_as_found(model):
        attention.model_rollout(model, x)
        attention.model_attention_distance(model, x, batch_size=3)
        attention.model_raw_attention(model, x, layer=-1, head=0)
        embeddings.position_similarity(model)
        embeddings.patch_embedding_pca(model, k=4)
        embeddings.filter_pca(model.patch_embed.weight, k=4)
        count_flops(model, x)


def test_report(caller, tmp_path):
    pytest.importorskip("matplotlib")
    from vitlab.analysis.report import write_report

    model = tiny_model()
    with leaves_process_as_found(model):
        write_report(model, tiny_images(2), tmp_path / "report.html")


# ----------------------------------------------------------------------------- export


def test_export_program(caller, tmp_path):
    from vitlab.export import export_program, load_program

    model = tiny_model()
    with leaves_process_as_found(model):
        export_program(model, tmp_path / "model.pt2", class_names=["a", "b", "c"])
        load_program(tmp_path / "model.pt2")


def test_export_onnx(caller, tmp_path):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    from vitlab.export import export_onnx

    model = tiny_model()
    with leaves_process_as_found(model):
        export_onnx(model, tmp_path / "model.onnx")


# ----------------------------------------------------------------------------- data


def write_image_folder(root, classes=("a", "b"), per_class=3):
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = np.full((10, 10, 3), 40 * (c + i), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


@pytest.fixture
def sklearn_imported():
    """scikit-learn, which reads the digits, imported before the snapshot: its import sets environment
    variables (KMP_DUPLICATE_LIB_OK, KMP_INIT_AT_FORK) and warnings filters and draws from Python's
    random stream, once per process, whoever imports it first; the test measures what vitlab's call adds."""
    pytest.importorskip("sklearn.datasets")


def test_load_in_memory(caller, sklearn_imported, tmp_path):
    from vitlab.data.digits import load_digits_dataset
    from vitlab.data.memory import load_in_memory

    folder = write_image_folder(tmp_path / "images")
    with leaves_process_as_found():
        load_in_memory(folder, image_size=8, cache_dir=tmp_path / "cache", workers=0)
        load_in_memory(folder, image_size=8, cache_dir=tmp_path / "cache", workers=0)  # from the cache
        load_digits_dataset(8)


# ----------------------------------------------------------------------------- training


def tiny_run(out, **run):
    """The demo recipe, shrunk to a 2-step run of a ~5k-parameter ViT on the 8x8 digits."""
    from vitlab.configs import load_recipe
    from vitlab.train.overrides import with_changes

    cfg = load_recipe("demo")
    return with_changes(cfg, {"model.img_size": 8, "model.patch_size": 4, "model.width": 16, "model.depth": 1,
                              "model.num_heads": 2, "model.mlp_dim": 32, "data.val_split": 100,
                              "optim.batch_size": 16, "optim.steps": 2, "optim.warmup": 1, "run.threads": 1,
                              "run.eval_every": 0, "run.log_every": 1, "run.tensorboard": False,
                              "run.out": str(out), **{f"run.{k}": v for k, v in run.items()}})


@pytest.fixture
def caller_backend():
    """A caller that drew its figures with matplotlib's SVG backend (not the Agg a headless
    process falls back to, so that a switch to Agg shows)."""
    matplotlib = pytest.importorskip("matplotlib")
    backend = matplotlib.rcParams._get("backend")
    matplotlib.use("svg")
    yield
    matplotlib.rcParams["backend"] = backend


def test_train(caller, caller_backend, sklearn_imported, tmp_path, monkeypatch):
    from vitlab.train import loop, train

    retained = []
    monkeypatch.setattr(loop, "retain_freed_memory", lambda: retained.append(True))
    with leaves_process_as_found():
        summary = train(tiny_run(tmp_path / "run"), verbose=False)
    assert summary["steps"] == 2
    assert (tmp_path / "run" / "curves.png").stat().st_size > 0  # drawn without switching the caller's backend
    # malloc is left as it is unless the recipe asks (run.retain_freed_memory, off by default)
    assert retained == []


def test_run_sweep(caller, sklearn_imported, tmp_path):
    from vitlab.train.sweep import run_sweep

    with leaves_process_as_found():
        report = run_sweep(tiny_run(tmp_path / "sweep"), grid=(0.01, 0.1), verbose=False, say=lambda line: None)
    assert set(report["holdout_top1"]) == {"0.01", "0.1"} and report["final"]["steps"] == 2


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_train_called_with_autograd_off(caller, sklearn_imported, tmp_path, mode):
    """A caller whose autograd is off (scoring a model of its own, say) gets its run trained and its
    mode back: the run's first backward failed on a loss that required no gradient, after the data
    was decoded and the run's folder written."""
    from vitlab.train import train

    with getattr(torch, mode)():
        with leaves_process_as_found():
            summary = train(tiny_run(tmp_path / "run"), verbose=False)
        assert not torch.is_grad_enabled()
    assert summary["steps"] == 2 and summary["train_loss"] > 0


def test_train_called_under_autocast_trains_in_its_own_precision(caller, sklearn_imported, tmp_path):
    """An fp32 run called inside a caller's bf16 autocast trains in fp32, as its config.json says:
    it ran its steps and evaluations in the caller's bf16, other weights without a word."""
    from vitlab.train import train
    from vitlab.weights import load_model

    plain = train(tiny_run(tmp_path / "plain", precision="fp32"), verbose=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with leaves_process_as_found():
            inside = train(tiny_run(tmp_path / "inside", precision="fp32"), verbose=False)
        assert torch.is_autocast_enabled("cpu")
    a, b = load_model(plain["weights"]).state_dict(), load_model(inside["weights"]).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert inside["val_loss"] == plain["val_loss"]


def test_train_retain_freed_memory(caller, sklearn_imported, tmp_path, monkeypatch):
    """run.retain_freed_memory is documented as a process-wide choice of the run, for the rest
    of the process (vitlab/train/memory.py): train makes it once, on a CPU, and changes nothing
    else."""
    from vitlab.train import loop, train

    retained = []
    monkeypatch.setattr(loop, "retain_freed_memory", lambda: retained.append(True))
    with leaves_process_as_found():
        train(tiny_run(tmp_path / "run", retain_freed_memory=True), verbose=False)
    assert retained == [True]


def test_train_that_fails(caller, sklearn_imported, tmp_path, monkeypatch):
    """A run that fails in its steps (out of memory, say) gives the caller's process back too."""
    from vitlab.train import loop, train

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(loop, "train_step", out_of_memory)
    with leaves_process_as_found():
        with pytest.raises(RuntimeError, match="out of memory"):
            train(tiny_run(tmp_path / "run"), verbose=False)


# ----------------------------------------------------------------------------- the command, called in-process


def test_command_in_process(caller, sklearn_imported, tiny_checkpoint, tmp_path, capsys):
    """``vitlab.cli.main`` as a notebook or a test calls it: its one-line warning format is given back."""
    from vitlab.cli import main

    image = tmp_path / "image.png"
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(image)
    settings = ("model.img_size=8", "model.patch_size=4", "model.width=16", "model.depth=1", "model.num_heads=2",
                "model.mlp_dim=32", "run.threads=1", "run.eval_every=0", "run.tensorboard=false", "data.val_split=100")
    tiny = [*(arg for setting in settings for arg in ("--set", setting)), "--quiet"]
    with leaves_process_as_found():
        assert main(["predict", "--checkpoint", tiny_checkpoint, "--json", str(image)]) == 0
        assert main(["train", "--recipe", "demo", "--steps", "2", "--batch-size", "16", "--out", str(tmp_path / "run"),
                     *tiny]) == 0
    capsys.readouterr()
