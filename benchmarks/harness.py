"""What bench.py and figure12.py share: model factories, the timed loop, peak memory,
and running one measurement in a fresh Python process.

A measurement is described by a JSON-able dict (a "case") and runs in its own
subprocess (``python harness.py CASE_JSON``), so that one model's allocator state,
oneDNN caches or compiled kernels never leak into the next one's figures.  The
subprocess prints one JSON line, prefixed with ``RESULT``.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

# The models benchmarked, in the paper's words: (width, depth, mlp_dim, heads, patch, img, classes).
SPECS: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "ViT-B/16": (768, 12, 3072, 12, 16, 224, 1000),
    "ViT-B/32": (768, 12, 3072, 12, 32, 224, 1000),
    "ViT-L/16": (1024, 24, 4096, 16, 16, 224, 1000),
    "ViT-S/16": (384, 12, 1536, 6, 16, 224, 1000),
    "ViT-CIFAR": (192, 6, 768, 3, 4, 32, 10),  # a CIFAR-size ViT: 32 px, 4 px patches
}


# ----------------------------------------------------------------------------- models

def vitlab_config(spec: str, img_size: int | None = None):
    """vitlab's config of ``spec`` (or a BiT name), with exact GELU and no dropout, like the peers."""
    from vitlab.config import ViTConfig, replace
    from vitlab.models.registry import get_config

    if spec.startswith("BiT-"):
        cfg = get_config(spec)
        return cfg if img_size is None else replace(cfg, img_size=img_size)
    width, depth, mlp, heads, patch, img, classes = SPECS[spec]
    return ViTConfig(width=width, depth=depth, mlp_dim=mlp, num_heads=heads, patch_size=patch,
                     img_size=img_size or img, num_classes=classes, gelu="exact", name=spec)


def make_model(impl: str, spec: str, img_size: int | None = None):
    """(model, forward) for an implementation: 'vitlab', 'hf-sdpa', 'hf-eager' or 'timm'.

    ``forward(images) -> logits``; the architectures are the same: pre-LN ViT, [class]
    token head, exact GELU, no dropout, random weights.
    """
    if impl == "vitlab":
        from vitlab.models.registry import build_model

        model = build_model(vitlab_config(spec, img_size))
        return model, model
    width, depth, mlp, heads, patch, img, classes = SPECS[spec]
    img = img_size or img
    if impl.startswith("hf-"):
        from transformers import ViTConfig, ViTForImageClassification

        cfg = ViTConfig(hidden_size=width, num_hidden_layers=depth, num_attention_heads=heads,
                        intermediate_size=mlp, image_size=img, patch_size=patch, num_labels=classes,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, layer_norm_eps=1e-6)
        model = ViTForImageClassification._from_config(cfg, attn_implementation=impl[3:])
        return model, lambda x: model(pixel_values=x).logits
    if impl == "timm":
        from timm.models.vision_transformer import VisionTransformer

        model = VisionTransformer(img_size=img, patch_size=patch, embed_dim=width, depth=depth,
                                  num_heads=heads, mlp_ratio=mlp / width, num_classes=classes)
        return model, model
    raise ValueError(f"impl={impl!r}: allowed values are vitlab, hf-sdpa, hf-eager, timm, onnxruntime")


def peers_available(device: str) -> list[str]:
    """Peer implementations importable here."""
    peers = []
    try:
        import transformers  # noqa: F401

        peers += ["hf-sdpa", "hf-eager"]
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


@contextlib.contextmanager
def attention_path(explicit: bool) -> Iterator[None]:
    """Force vitlab's attention to the explicit path (True) or the fused kernel (False)."""
    import vitlab.models.layers as layers

    saved = layers.explicit_attention_is_faster
    layers.explicit_attention_is_faster = lambda q: explicit
    try:
        yield
    finally:
        layers.explicit_attention_is_faster = saved


# ----------------------------------------------------------------------------- memory

def _status(field: str) -> int:
    """A /proc/self/status field in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


class PeakMemory:
    """Peak memory above a baseline taken at ``reset()``.

    CPU: the resident set's high-water mark (VmHWM), which sees torch's and ONNX
    Runtime's allocations alike (tracemalloc does not); writing 5 to
    /proc/self/clear_refs resets the mark to the current RSS.  CUDA:
    torch.cuda.max_memory_allocated.
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.base = 0

    def reset(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass  # then the mark may include earlier transients
        self.base = _status("VmRSS")

    def peak(self) -> int:
        """Bytes above the baseline at the highest point since ``reset()``."""
        if self.device == "cuda":
            import torch

            return torch.cuda.max_memory_allocated() - self.base
        return _status("VmHWM") - self.base


def _page_faults() -> int:
    """Minor page faults of this process so far: memory mapped afresh and written."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# ----------------------------------------------------------------------------- timing

def time_loop(step: Callable[[], Any], sync: Callable[[], None], warmup: int, repeats: int,
              min_seconds: float, warm: Callable[[], None] = lambda: None) -> tuple[list[float], int]:
    """Seconds per call of ``step`` in each of ``repeats`` timed repeats, and calls per repeat.

    ``warmup`` untimed calls come first (compilation, allocator and oneDNN caches); the
    last warm-up call sets how many calls make a repeat last ``min_seconds``.  ``warm()``
    is called between the warm-ups and the timed repeats.
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


def summarize(times: list[float], per_call: int) -> dict[str, float]:
    """Items per second: median and min-max over repeats (the fastest repeat is the max)."""
    rates = sorted(per_call / t for t in times)
    return {"median": statistics.median(rates), "min": rates[0], "max": rates[-1], "repeats": len(rates)}


# ----------------------------------------------------------------------------- subprocesses

def run_case(case: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run ``case`` in a fresh interpreter; its result dict, or {'error': ...}."""
    cmd = [sys.executable, str(Path(__file__).resolve()), json.dumps(case)]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    threads = case.get("threads")
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
        return measure_model(case)
    raise ValueError(f"unknown case kind {kind!r}")


def _sync(device: str) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def measure_matmul(case: dict[str, Any]) -> dict[str, Any]:
    """Best FLOP/s of an n x n x n matmul: the machine's practical peak for the dtype (with
    ``via="fp32"``: the dtype's operands and result, the product by the fp32 GEMM)."""
    import torch

    n, device = case["size"], case["device"]
    dtype = getattr(torch, case["dtype"])
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    if case.get("via") == "fp32":  # bf16 operands and result, multiplied by the fp32 GEMM
        def product():
            return torch.mm(a.float(), b.float()).to(dtype)
    else:
        def product():
            return torch.mm(a, b)
    times, calls = time_loop(product, _sync(device), case["warmup"], case["repeats"], case["min_seconds"])
    best = min(times)
    return {"flops_per_s": 2 * n**3 / best, "median_flops_per_s": 2 * n**3 / statistics.median(times),
            "calls": calls}


def _onnx_session(case: dict[str, Any]):
    """An ONNX Runtime session of vitlab's model, exported once and cached on disk."""
    import onnxruntime as ort

    from vitlab.export import export_onnx
    from vitlab.models.registry import build_model

    spec, img = case["model"], case.get("img_size") or SPECS[case["model"]][5]
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

    from vitlab.analysis.cost import model_flops

    device, batch, impl = case["device"], case["batch"], case["impl"]
    spec, img = case["model"], case.get("img_size") or vitlab_config(case["model"]).img_size[0]
    amp = case["dtype"] == "bf16"
    torch.manual_seed(0)
    x = torch.randn(batch, 3, img, img, device=device)
    memory = PeakMemory(device)
    sync = _sync(device)
    held = contextlib.ExitStack()  # what stays open while the loop is timed

    if impl == "onnxruntime":
        if case["kind"] != "inference" or amp:
            raise ValueError("onnxruntime rows are fp32 inference only")
        session = _onnx_session(case)
        feed = {"images": x.cpu().numpy()}
        memory.reset()
        step = lambda: session.run(None, feed)  # noqa: E731
    else:
        model, forward = make_model("vitlab" if impl == "vitlab-packed" else impl, spec, img)
        model = model.to(device)
        if case.get("compile"):
            forward = torch.compile(forward)
        variant = case.get("variant")  # ab.py's fresh-process variants of vitlab's step
        if variant is not None and impl != "vitlab":
            raise ValueError(f"variant={variant!r} is for impl='vitlab', not {impl!r}")
        if variant == "stored":
            from vitlab.models.fused import store_activations

            held.enter_context(store_activations())
        elif variant == "explicit_attention":
            held.enter_context(attention_path(True))
        elif variant is not None:
            raise ValueError(f"variant={variant!r}: allowed values are stored, explicit_attention")
        if case["kind"] == "inference":
            model.eval()
            if impl == "vitlab-packed":  # packed at the first warm-up call, held to the end
                from vitlab.models import packed_weights

                held.enter_context(packed_weights(model))

            def step():
                with torch.inference_mode(), torch.autocast(device, torch.bfloat16, enabled=amp):
                    return forward(x)
            memory.reset()
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
            memory.reset()  # after the model, before the optimizer state appears

    faults_when_warm = []
    with held:
        times, calls = time_loop(step, sync, case["warmup"], case["repeats"], case["min_seconds"],
                                 warm=lambda: faults_when_warm.append(_page_faults()))
    result = summarize(times, batch)
    result["page_faults_per_call"] = (_page_faults() - faults_when_warm[0]) / (case["repeats"] * calls)
    result["peak_bytes"] = memory.peak()
    result["total_peak_bytes"] = (torch.cuda.max_memory_allocated() if device == "cuda"
                                  else _status("VmHWM"))  # the whole process, for budgets
    result["calls_per_repeat"] = calls
    flops = model_flops(vitlab_config(spec, img)) * (3 if case["kind"] == "train" else 1)
    result["flops_per_image"] = flops
    result["achieved_flops_per_s"] = flops * result["median"]
    return result


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    out = worker(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(out), flush=True)
