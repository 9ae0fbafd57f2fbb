"""What the benchmark scripts share: model factories, the timed loop, peak memory, running
one measurement in a fresh Python process, and the interleaved A/B comparison.

A measurement is described by a JSON-able dict (a "case") and runs in its own
subprocess (``python harness.py CASE_JSON``), so that one model's allocator state,
oneDNN caches or compiled kernels never leak into the next one's figures.  The
subprocess prints one JSON line, prefixed with ``RESULT``.

The scripts import this module as a sibling (Python puts a script's own folder first on
``sys.path``) and vitlab as an installed package (``pip install -e .``), so nothing here
edits ``sys.path``.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable


# ----------------------------------------------------------------------------- the machine and the code before


def cpu_name() -> str:
    """The CPU's model name (``vitlab.machine.cpu_info``), else the architecture."""
    import platform

    from vitlab.machine import cpu_info

    return cpu_info().model or platform.machine()


def checkout(rev: str, script: str) -> str:
    """The ``vitlab/`` of git revision ``rev`` in a temporary folder (``script --before REV``); its path.
    The folder is removed when this interpreter exits."""
    import atexit
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="vitlab-before-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    archive = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent.parent), "archive", rev, "vitlab"],
                             capture_output=True, check=False)
    if archive.returncode:
        raise SystemExit(f"{script} --before {rev}: git archive failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
    return str(root)


def vitlab_folder() -> str:
    """The folder of the vitlab package this interpreter imports (a worker's: its column's code)."""
    import vitlab

    return str(Path(vitlab.__file__).resolve().parent)


# ----------------------------------------------------------------------------- measuring tools


def proc_status(field: str) -> int:
    """A /proc/self/status field in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak(device: str) -> int | None:
    """Start a new peak-memory window; the bytes in use now.  On a GPU that is the memory torch
    reserves from the device once its cache of free blocks is given back: a CUDA graph's memory
    pool stays reserved for the graph's life, while its replays allocate nothing, so that torch's
    count of allocated bytes would miss a graphed step's activations (the peers' steps allocate
    theirs afresh each call, which the reserved count sees as well).  None on a CPU whose
    resident set's high-water mark cannot be reset (/proc/self/clear_refs not writable: not
    Linux, or a container that refuses it): the mark keeps what came before (the model's build),
    so this window has no peak of its own to measure."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_reserved()
    try:  # 5 resets the resident set's high-water mark (VmHWM) to the current resident set
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return proc_status("VmRSS")


def peak(device: str) -> int:
    """The highest memory in use since ``reset_peak``: on a CPU the resident set, which sees
    every allocation (torch's, oneDNN's scratch pads) where torch's own counters do not."""
    import torch

    return torch.cuda.max_memory_reserved() if device == "cuda" else proc_status("VmHWM")


def time_loop(step: Callable[[], Any], sync: Callable[[], None], warmup: int, repeats: int,
              min_seconds: float, warm: Callable[[], None] = lambda: None) -> tuple[list[float], int]:
    """Seconds per call of ``step`` in each of ``repeats`` timed repeats, and calls per repeat.

    ``warmup`` untimed calls come first (compilation, allocator and oneDNN caches); the
    last warm-up call sets how many calls make a repeat last ``min_seconds``.  ``warm()``
    is called between the warm-ups and the timed repeats.

    ``vitlab.analysis.utilization.matmul_peak`` (``measure_matmul``) times its products the same
    way; this loop stays here because a model row of ``bench.py --before`` runs under an older
    vitlab, which may not have that function.
    """
    last = 0.0
    for _ in range(warmup):
        t = time.perf_counter()
        step()
        sync()
        last = time.perf_counter() - t
    calls = max(1, int(min_seconds / last)) if last > 0 else 1
    warm()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            step()
        sync()
        times.append((time.perf_counter() - t) / calls)
    return times, calls


def run_worker(cmd: list[str], threads: int | None = None, pythonpath: str | None = None,
               timeout: float = 1800) -> dict[str, Any]:
    """Run a measuring command in a fresh interpreter and return the dict of its ``RESULT``
    line, or {'error': ...}; ``pythonpath`` goes ahead of the installed packages."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


# Implementations of vitlab's own model: "vitlab" is the default path (``vitlab.fast.optimize``),
# "vitlab-plain" the model as written, "vitlab-before" an earlier revision's (bench.py --before), "onnxruntime"
# its ONNX export, "vitlab-fp8-SCALING" the default path with the blocks' dense layers in fp8 (bench.py --fp8,
# what ``run.fp8`` trains; "vitlab-fp8-torchao-SCALING" by torchao's arithmetic, ``run.fp8_backend=torchao``),
# "vitlab-cudnn" the default path with cuDNN's fused attention put first (bench.py --attention cudnn, what
# ``run.gpu_attention=cudnn`` trains with), "vitlab-autotune" the default path compiled in inductor's
# max-autotune (bench.py --autotune, what ``run.compile_autotune`` trains with).
# Every other one is a peer.
FP8_IMPL_PREFIX = "vitlab-fp8-"
# "vitlab-fp8-SCALING" by vitlab's own arithmetic, "vitlab-fp8-torchao-SCALING" by torchao's (run.fp8_backend)
FP8_IMPLS = tuple(FP8_IMPL_PREFIX + backend + scaling for backend in ("", "torchao-")  # vitlab.fast.FP8_BACKENDS
                  for scaling in ("tensorwise", "rowwise"))  # vitlab.fast.FP8_SCALINGS
CUDNN_IMPL = "vitlab-cudnn"
AUTOTUNE_IMPL = "vitlab-autotune"
# vitlab's default path changed in one way: columns with their own ratio
VARIANT_IMPLS = (*FP8_IMPLS, CUDNN_IMPL, AUTOTUNE_IMPL)
# a peer's column with its weights in bf16 (``from_pretrained(..., dtype=torch.bfloat16)``, as Hugging Face's
# docs load a model for bf16 inference) and bf16 images, no autocast: bf16 inference rows only
BF16_WEIGHTS = "-bf16w"
OWN_IMPLS = ("vitlab", "vitlab-plain", "vitlab-before", "onnxruntime", *VARIANT_IMPLS)


# ----------------------------------------------------------------------------- models

def vitlab_config(spec: str, img_size: int | None = None):
    """The registry's config of ``spec``, with exact GELU and no dropout, like the peers.

    ``spec`` is a registered name ("ViT-B/16", "BiT-R50x1", ...) or "ViT-CIFAR": a CIFAR-size
    ViT, the registry's ViT-Ti (width 192, 3 heads, MLP 768) at depth 6 on 32 px images in
    4 px patches, with 10 classes.
    """
    from vitlab.config import ResNetConfig, replace
    from vitlab.models.registry import get_config

    if spec == "ViT-CIFAR":
        cfg = replace(get_config("ViT-Ti/16"), depth=6, patch_size=4, img_size=32, num_classes=10,
                      name="ViT-CIFAR")
    else:
        cfg = get_config(spec)
    if not isinstance(cfg, ResNetConfig):
        cfg = replace(cfg, gelu="exact", dropout=0.0)
    return cfg if img_size is None else replace(cfg, img_size=img_size)


def make_model(impl: str, spec: str, img_size: int | None = None):
    """(model, forward) for an implementation: 'vitlab', 'vitlab-plain', 'hf-sdpa', 'hf-eager' or 'timm'.

    ``forward(images) -> logits``; the architectures are the same: pre-LN ViT, [class]
    token head, exact GELU, no dropout, random weights.  'vitlab' and 'vitlab-plain' are the
    same plain model here; ``optimize_if_default`` then gives 'vitlab' the fast layer (what
    the trainer, ``vitlab eval`` and ``vitlab predict`` run) once it is on its device.
    """
    cfg = vitlab_config(spec, img_size)
    if impl in ("vitlab", "vitlab-plain", "vitlab-before", *VARIANT_IMPLS):  # "before": another checkout's, as it runs
        from vitlab.models.registry import build_model

        model = build_model(cfg)
        return model, model
    width, depth, mlp, heads = cfg.width, cfg.depth, cfg.mlp_dim, cfg.num_heads
    patch, img, classes = cfg.patch_size[0], cfg.img_size[0], cfg.num_classes
    if impl.startswith("hf-"):
        from transformers import ViTConfig, ViTForImageClassification

        from vitlab.weights.huggingface import GELU_NAMES

        # vitlab's conventions in HF's names, as vitlab's own export writes them (save_huggingface)
        hf_cfg = ViTConfig(hidden_size=width, num_hidden_layers=depth, num_attention_heads=heads,
                           intermediate_size=mlp, image_size=img, patch_size=patch, num_labels=classes,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, layer_norm_eps=cfg.ln_eps,
                           qkv_bias=cfg.qkv_bias, hidden_act=GELU_NAMES[cfg.gelu])
        attention = impl[3:].removesuffix(BF16_WEIGHTS)
        model = ViTForImageClassification._from_config(hf_cfg, attn_implementation=attention)
        return model, lambda x: model(pixel_values=x).logits
    if impl == "timm":
        from timm.models.vision_transformer import VisionTransformer

        model = VisionTransformer(img_size=img, patch_size=patch, embed_dim=width, depth=depth,
                                  num_heads=heads, mlp_ratio=mlp / width, num_classes=classes)
        return model, model
    raise ValueError(f"impl={impl!r}: allowed values are vitlab, vitlab-plain, {', '.join(VARIANT_IMPLS)}, hf-sdpa, "
                     "hf-eager, timm, onnxruntime")


def optimize_if_default(impl: str, model, kind: str = "train", fp8_layers: tuple[str, ...] | None = None):
    """Apply the fast layer to 'vitlab' and 'vitlab-before' (after ``.to(device)``) as that vitlab
    runs it: ``optimize(model)``, what the trainer, ``vitlab eval`` and ``vitlab predict`` run (bf16
    inference weights cast in every call into a shared buffer), or for ``kind="inference"`` of a
    revision that has it ``inference_weights="pack"`` (bf16 weights packed into the fp32 ones, what
    its commands ran until 2026-11-26).  A revision from before ``vitlab.fast`` runs its model as it is.
    'vitlab-fp8-SCALING': the blocks' dense layers (``fp8_layers`` of them, default all four) swapped
    to fp8 first, then ``optimize``, as the trainer builds a ``run.fp8`` run ('vitlab-fp8-torchao-SCALING':
    by torchao's arithmetic)."""
    if impl not in ("vitlab", "vitlab-before", *VARIANT_IMPLS):
        return model
    try:
        import vitlab.fast
    except ImportError:
        return model
    if impl in FP8_IMPLS:
        layers = {"layers": tuple(fp8_layers)} if fp8_layers else {}
        backend, _, scaling = impl[len(FP8_IMPL_PREFIX):].rpartition("-")
        if backend:  # a revision before run.fp8_backend has no torchao column to run
            layers["backend"] = backend
        vitlab.fast.install_fp8(model, scaling, **layers)
    options = {}
    if kind == "inference" and "pack" in getattr(vitlab.fast, "INFERENCE_WEIGHTS", ()):
        options["inference_weights"] = "pack"
    return vitlab.fast.optimize(model, **options)


def compiled(impl: str, model, forward, case: dict[str, Any]):
    """``forward`` compiled as each implementation's own documentation has it: ``torch.compile``
    (default mode) for the peers and for "vitlab-plain"; vitlab's inference through its own
    ``vitlab.fast.compile_for_inference`` (frozen weights, under CUDA graphs on a GPU, one batch
    size), where the revision has it; vitlab's training on a GPU as ``vitlab train --compile``
    compiles it there, in mode "reduce-overhead" (CUDA graphs; ``graphed_training_step``).
    "vitlab-autotune" the same in inductor's max-autotune (``run.compile_autotune``)."""
    import torch

    autotune = impl == AUTOTUNE_IMPL
    if impl in ("vitlab", "vitlab-before", CUDNN_IMPL, AUTOTUNE_IMPL) and case["kind"] == "inference":
        import vitlab.fast

        if hasattr(vitlab.fast, "compile_for_inference"):
            options = {"autotune": True} if autotune else {}
            return vitlab.fast.compile_for_inference(model, case["dtype"], batch_size=case["batch"], **options)
    if trains_as_the_trainer(impl, case):
        return torch.compile(forward, mode=trainer_mode(impl))
    return torch.compile(forward)


def trainer_mode(impl: str) -> str:
    """torch.compile's mode of vitlab's trainer on one GPU, as a column measures it: "max-autotune"
    for "vitlab-autotune" (``run.compile_autotune``), else "reduce-overhead"."""
    return "max-autotune" if impl == AUTOTUNE_IMPL else "reduce-overhead"


def trains_as_the_trainer(impl: str, case: dict[str, Any]) -> bool:
    """Whether a compiled training row runs vitlab's whole step in CUDA graphs, as its trainer does on
    one GPU (``graphed_training_step``): vitlab's own columns ("vitlab-before" too), on a GPU, at a revision
    that has it."""
    if impl not in ("vitlab", "vitlab-before", *VARIANT_IMPLS) or case["kind"] != "train" or not case.get("compile"):
        return False
    if case["device"] != "cuda":
        return False
    import vitlab.train.step

    return hasattr(vitlab.train.step, "HeldGradients")


def graphed_training_step(model, forward, x, labels, amp: bool, lr: float = 1e-4, weight_decay: float = 0.1,
                          mode: str = "reduce-overhead"):
    """A training step as ``vitlab train --compile`` takes it on one GPU (``forward`` compiled in mode
    "reduce-overhead"): the forward and backward replayed as CUDA graphs, the gradients held at
    fixed addresses (``step.HeldGradients``), and what follows the backward (the global gradient
    norm and the non-finite check, AdamW's update) compiled into a CUDA graph of its own
    (``step.Update``, ``run.compile_optimizer``, in ``mode``, the model's as the trainer resolves it):
    no launch per parameter from the host.  The
    arithmetic is the peers' step's (no clipping), plus the norm and the check."""
    import torch

    from vitlab.fast.kernels import autocast
    from vitlab.train.step import HeldGradients, Update

    # fused on a GPU, as the trainer builds it: the eager update a failed compilation falls back to
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=x.device.type == "cuda")
    update = Update(model.parameters(), optimizer, None, model, clip_norm=0.0, mode=mode)  # the model's, as resolved
    held = HeldGradients(model.parameters())
    no_bad_rank = torch.zeros(1, device=x.device)

    def step():
        with autocast(x.device, "bf16" if amp else "fp32"):
            loss = torch.nn.functional.cross_entropy(forward(x), labels)
        loss.backward()
        held.take()
        update(no_bad_rank)
        optimizer.zero_grad(set_to_none=True)

    return step


def peers_available(device: str) -> list[str]:
    """Peer implementations importable here (and ONNX Runtime, a way to serve vitlab, on CPU)."""
    peers = []
    try:
        import transformers  # noqa: F401

        peers += ["hf-sdpa", "hf-eager", "hf-sdpa" + BF16_WEIGHTS]
    except ImportError:
        pass
    try:
        import timm  # noqa: F401

        peers.append("timm")
    except ImportError:
        pass
    if device == "cpu":
        try:
            import onnxruntime  # noqa: F401

            peers.append("onnxruntime")
        except ImportError:
            pass
    return peers


# ----------------------------------------------------------------------------- memory

class PeakMemory:
    """Peak memory above a baseline taken at ``reset()``.

    CPU: the resident set's high-water mark (VmHWM), which sees torch's and ONNX
    Runtime's allocations alike (tracemalloc does not); writing 5 to
    /proc/self/clear_refs resets the mark to the current RSS.  CUDA:
    torch.cuda.max_memory_reserved, CUDA graphs' pools included (``reset_peak``).
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.base = 0

    def reset(self) -> None:
        self.base = reset_peak(self.device)

    def peak(self) -> int | None:
        """Bytes above the baseline at the highest point since ``reset()``; None where the
        window could not be started (``reset_peak``): not measured, rather than a figure that
        counts the model's build."""
        return None if self.base is None else peak(self.device) - self.base


def _page_faults() -> int:
    """Minor page faults of this process so far: memory mapped afresh and written."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# ----------------------------------------------------------------------------- timing

def summarize(times: list[float], per_call: int) -> dict[str, float]:
    """Items per second: median and min-max over repeats (the fastest repeat is the max)."""
    rates = sorted(per_call / t for t in times)
    return {"median": statistics.median(rates), "min": rates[0], "max": rates[-1], "repeats": len(rates)}


# ----------------------------------------------------------------------------- subprocesses

def run_case(case: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run ``case`` in a fresh interpreter; its result dict, or {'error': ...}.  A case's
    ``pythonpath`` is another checkout's vitlab (bench.py --before), ahead of the installed one."""
    return run_worker([sys.executable, str(Path(__file__).resolve()), json.dumps(case)], case.get("threads"),
                      case.get("pythonpath"), timeout)


def worker(case: dict[str, Any]) -> dict[str, Any]:
    """Dispatch a case to its measurement function (in this fresh process)."""
    import torch

    if case.get("threads"):
        torch.set_num_threads(case["threads"])
    if case.get("retain_memory"):  # off in bench.py: a setting of the process, not of a model
        from vitlab.train.memory import retain_freed_memory

        retain_freed_memory()
    kind = case["kind"]
    if kind == "matmul":
        return measure_matmul(case)
    if kind in ("inference", "train"):
        if case["impl"] != CUDNN_IMPL:
            return measure_model(case)
        from vitlab.fast.kernels import attention_backends

        with attention_backends("cudnn"):  # the whole measurement: compilation traces under it
            return measure_model(case)
    raise ValueError(f"unknown case kind {kind!r}")


def _sync(device: str) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


# The ways a peak case can multiply two n x n matrices: (dtype, kernel) -> description.
# fp32: "aten" is torch.mm (MKL's GEMM in the official CPU wheels, cuBLAS on a GPU),
# "onednn" oneDNN's matmul on the plain matrix (vitlab.fast.linear.onednn_linear).
# bf16: "bf16" is the bf16 kernel (torch.mm on bf16 matrices: oneDNN on a CPU); "fp32" takes
# the same bf16 operands through the fp32 GEMM and rounds the result to bf16, casts included
# (the product of two bf16 numbers is exact in fp32, so both compute the same values).
PEAK_KERNELS = {
    ("float32", "aten"): "torch.mm",
    ("float32", "onednn"): "oneDNN matmul",
    ("bfloat16", "bf16"): "bf16 kernel",
    ("bfloat16", "fp32"): "fp32 GEMM on bf16 operands",
}


def matmul_product(dtype: str, kernel: str, n: int, device: str) -> Callable[[], Any]:
    """A call computing one n x n x n product of ``dtype`` matrices by ``kernel`` (``PEAK_KERNELS``)."""
    import torch

    a = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
    b = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
    if (dtype, kernel) == ("float32", "onednn"):
        from vitlab.fast.linear import onednn_linear

        weight = b.t().contiguous()  # F.linear's layout: x @ weight.T == a @ b
        return lambda: onednn_linear(a, weight)
    if (dtype, kernel) == ("bfloat16", "fp32"):
        return lambda: torch.mm(a.float(), b.float()).bfloat16()
    if (dtype, kernel) in (("float32", "aten"), ("bfloat16", "bf16")):
        return lambda: torch.mm(a, b)
    raise ValueError(f"no peak kernel {kernel!r} for {dtype}: allowed {sorted(PEAK_KERNELS)}")


def measure_matmul(case: dict[str, Any]) -> dict[str, Any]:
    """Best FLOP/s of an n x n x n matmul of ``case['dtype']`` by ``case['kernel']``: the
    machine's practical peak for that dtype and kernel, timed by the library's
    ``matmul_peak``, which a training run's summary divides by on a GPU."""
    # imported here: a model row of bench.py --before imports this module under an older vitlab
    from vitlab.analysis.utilization import matmul_peak

    n, device = case["size"], case["device"]
    peak = matmul_peak(device, size=n, warmup=case["warmup"], repeats=case["repeats"],
                       min_seconds=case["min_seconds"],
                       product=matmul_product(case["dtype"], case.get("kernel", "aten"), n, device))
    return {"flops_per_s": peak.best, "median_flops_per_s": peak.median, "calls": peak.calls}


def _onnx_session(case: dict[str, Any]):
    """An ONNX Runtime session of vitlab's model, exported by the run's first such worker into the run's
    ``cache_dir`` (bench.py: a folder of its own, removed when it ends), which the others load."""
    import onnxruntime as ort

    from vitlab.export import export_onnx
    from vitlab.models.registry import build_model

    spec = case["model"]
    img = case.get("img_size") or vitlab_config(spec).img_size[0]
    cache = Path(case["cache_dir"]) / f"{spec.replace('/', '-')}-{img}.onnx"
    if not cache.exists():
        export_onnx(build_model(vitlab_config(spec, img)).eval(), cache, img)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = case.get("threads") or 0
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(cache), opts, providers=["CPUExecutionProvider"])


def measure_model(case: dict[str, Any]) -> dict[str, Any]:
    """Images per second and peak memory of inference or a training step."""
    import torch
    # A module first imported after the baseline counts in the peak: torch.optim imports torch._dynamo
    # (with sympy, about 70 MiB resident) as it builds its first optimizer, and transformers imports it
    # with itself, before a peer's baseline.  Imported here, it counts in no column.
    import torch._dynamo  # noqa: F401

    from vitlab.analysis.cost import model_flops

    device, batch, impl = case["device"], case["batch"], case["impl"]
    spec, img = case["model"], case.get("img_size") or vitlab_config(case["model"]).img_size[0]
    amp = case["dtype"] == "bf16"
    torch.manual_seed(0)
    x = torch.randn(batch, 3, img, img, device=device)
    memory = PeakMemory(device)
    sync = _sync(device)

    if impl == "onnxruntime":
        if case["kind"] != "inference" or amp:
            raise ValueError("onnxruntime rows are fp32 inference only")
        session = _onnx_session(case)
        feed = {"images": x.cpu().numpy()}
        memory.reset()
        step = lambda: session.run(None, feed)  # noqa: E731
    else:
        model, forward = make_model(impl, spec, img)
        model = model.to(device)
        if impl.endswith(BF16_WEIGHTS):  # the weights and the images in bf16, autocast off
            if case["kind"] != "inference" or not amp:
                raise ValueError(f"{impl}: a column of bf16 inference rows only")
            model, x, amp = model.to(torch.bfloat16), x.to(torch.bfloat16), False
        # The baseline: the model as built, before vitlab's fast layer, so that whatever the layer
        # allocates (at optimize or at its first call) counts, as every peer's own allocations do.
        memory.reset()
        model = optimize_if_default(impl, model, case["kind"], case.get("fp8_layers"))
        if case.get("compile"):
            forward = compiled(impl, model, forward, case)
        if case["kind"] == "inference":
            model.eval()

            def step():
                with torch.inference_mode(), torch.autocast(device, torch.bfloat16, enabled=amp):
                    return forward(x)
        elif trains_as_the_trainer(impl, case):
            model.train()
            labels = torch.randint(0, vitlab_config(spec).num_classes, (batch,), device=device)
            step = graphed_training_step(model, forward, x, labels, amp, mode=trainer_mode(impl))
        else:
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
            labels = torch.randint(0, vitlab_config(spec).num_classes, (batch,), device=device)

            def step():
                with torch.autocast(device, torch.bfloat16, enabled=amp):
                    loss = torch.nn.functional.cross_entropy(forward(x), labels)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

    faults_when_warm = []

    def warm():
        faults_when_warm.append(_page_faults())
        if case.get("compile") and device == "cuda":
            # the peak from here on: compiling afresh allocates for autotuning, which a process that
            # found the same graph in inductor's cache (a peer's identical model, compiled first) skips;
            # the baseline stays the model's, so that the CUDA graphs' pools, made while warming, count
            reset_peak(device)

    times, calls = time_loop(step, sync, case["warmup"], case["repeats"], case["min_seconds"], warm=warm)
    result = summarize(times, batch)
    result["page_faults_per_call"] = (_page_faults() - faults_when_warm[0]) / (case["repeats"] * calls)
    result["peak_bytes"] = memory.peak()
    result["total_peak_bytes"] = peak(device)  # the whole process, for budgets
    result["calls_per_repeat"] = calls
    flops = model_flops(vitlab_config(spec, img)) * (3 if case["kind"] == "train" else 1)
    result["flops_per_image"] = flops
    result["achieved_flops_per_s"] = flops * result["median"]
    result["vitlab_path"] = vitlab_folder()  # the code this column ran (bench.py checks a --before row's)
    return result


# ----------------------------------------------------------------------------- A/B in one process

def compare(name: str, variants: dict[str, Callable[[], object]], rounds: int = 7,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Print ms per call of each variant, min and median over interleaved rounds; return the times.

    The variants alternate round after round in this process, so that a slow minute on a
    shared machine falls on all of them.  ``clock=time.thread_time`` (with one thread) does
    not count time spent waiting for a core; memory-bandwidth contention still adds noise,
    so treat differences under ~5% as none.
    """
    for fn in variants.values():  # warm up every variant first
        fn()
    seconds: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for key, fn in variants.items():
            t = clock()
            fn()
            seconds[key].append(clock() - t)
    import torch

    base = min(seconds[next(iter(variants))])
    what = "thread CPU" if clock is time.thread_time else "wall"
    print(f"\n{name}  ({what} ms per call, {rounds} interleaved rounds, {torch.get_num_threads()} thread(s))")
    for key, ts in seconds.items():
        print(f"  {key:34s} min {1e3 * min(ts):8.1f}  median {1e3 * statistics.median(ts):8.1f}  "
              f"min vs first {min(ts) / base:5.2f}x", flush=True)
    return seconds


def run_experiments(experiments: dict[str, Callable[[], None]], argv: list[str], doc: str) -> int:
    """The command line of an A/B script: run the named experiments (all without names)."""
    if any(a in ("-h", "--help") for a in argv):
        print(doc.strip() + "\n\nexperiments: " + " ".join(experiments))
        return 0
    names = argv or list(experiments)
    unknown = [name for name in names if name not in experiments]
    if unknown:
        print(f"unknown experiment {', '.join(unknown)}; choose among: {' '.join(experiments)}", file=sys.stderr)
        return 2
    for name in names:
        experiments[name]()
    return 0


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    out = worker(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(out), flush=True)
