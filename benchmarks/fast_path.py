"""What the fast layer (``vitlab.fast``) gives over the plain model, and what it costs.

    python benchmarks/fast_path.py                 # every experiment
    python benchmarks/fast_path.py recompute

``recompute``: training steps of the plain model, of ``optimize(model, recompute=False)``
and of ``optimize(model)`` (LayerNorm and GELU outputs recomputed in the backward), fp32
and bf16 autocast, with the bytes of activations each keeps for the backward.
``inference``: ViT-B/16 inference, plain against optimized, fp32 and bf16 autocast.
``inference_options``: ViT-B/16 inference of the optimized model with its block chunks
as large as the batch (``CHUNK_ROWS`` unbounded) and, in bf16, with each weight held cast
(``inference_weights="hold"``), against the default (cast in every call, what ``vitlab eval``
runs), with the page faults per call of each.
``kernels``: the training step of the plain model, of the fast model with each kernel choice
this CPU can run (fp32 matmul x attention x recompute; in bf16 the bf16 kernels), and of
Hugging Face's ViT (sdpa, eager): what ``kernels.RULES`` rests on, per CPU class.
``stream_layout``: the CIFAR recipe's CPU model (mean-pooled, no [class] token) optimized,
one bf16 training step at batch 128, with its patch tokens contiguous (the model today)
against a transposed view of the patch convolution's output (the model before 2026-11-28's
change), which kept channel-major strides through the whole residual stream.
Every core, wall time, interleaved.  Findings: benchmarks/NOTES.md.
"""
from __future__ import annotations

import copy
import sys
import types
from typing import Callable

import torch
import torch.nn.functional as F

import vitlab.fast
from harness import compare, make_model, run_experiments, vitlab_config
from vitlab.analysis.cost import SavedForBackward
from vitlab.fast.calibration import training_step
from vitlab.machine import usable_cores
from vitlab.models.registry import build_model

# label -> how the model is prepared: None leaves it plain, else optimize()'s keywords
VARIANTS: dict[str, dict | None] = {"plain": None, "optimized, stored": {"recompute": False},
                                    "optimized (default)": {}}


def _variants(spec: str) -> dict[str, torch.nn.Module]:
    """One copy of the same random model per variant (the fast layer's state lives on its modules)."""
    torch.manual_seed(0)
    base = build_model(vitlab_config(spec))
    models = {}
    for label, options in VARIANTS.items():
        model = copy.deepcopy(base)
        models[label] = model if options is None else vitlab.fast.optimize(model, **options)
    return models


def _saved_for_backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, amp: bool) -> int:
    """Bytes of the tensors autograd keeps for the backward of one step, parameters excluded."""
    with SavedForBackward(model) as kept:
        with torch.autocast("cpu", torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return kept.bytes


def _training_cases(rounds: tuple[int, int]):
    """(spec, batch, rounds, config, images, labels, bf16) for the two training rows of the
    bench, fp32 then bf16 autocast, every core."""
    torch.set_num_threads(usable_cores())
    for (spec, batch), n in zip((("ViT-CIFAR", 128), ("ViT-S/16", 32)), rounds):
        cfg = vitlab_config(spec)
        x, y = torch.randn(batch, 3, *cfg.img_size), torch.randint(0, cfg.num_classes, (batch,))
        for amp in (False, True):
            yield spec, batch, n, cfg, x, y, amp


def exp_recompute() -> None:
    for spec, batch, rounds, cfg, x, y, amp in _training_cases((5, 3)):
        models = _variants(spec)
        dtype = "bf16 autocast" if amp else "fp32"
        kept = {label: _saved_for_backward(m, x, y, amp) for label, m in models.items()}
        print(f"\n{spec}, batch {batch}, {dtype}: activations kept for the backward "
              + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in kept.items()))

        def step(model: torch.nn.Module, amp: bool = amp) -> Callable[[], None]:
            return training_step(model, model.parameters(), x, y, amp)
        compare(f"training step, {spec}, batch {batch}, {dtype} (AdamW)",
                {label: step(m) for label, m in models.items()}, rounds=rounds)


def exp_inference() -> None:
    torch.set_num_threads(usable_cores())
    models = {label: m.eval() for label, m in _variants("ViT-B/16").items() if label != "optimized, stored"}
    for batch, rounds in ((1, 15), (8, 5)):
        x = torch.randn(batch, 3, 224, 224)
        for amp in (False, True):
            def infer(model: torch.nn.Module, amp: bool = amp) -> Callable[[], torch.Tensor]:
                def go() -> torch.Tensor:
                    with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=amp):
                        return model(x)
                return go
            compare(f"ViT-B/16 inference, batch {batch}, {'bf16 autocast' if amp else 'fp32'}",
                    {label: infer(m) for label, m in models.items()}, rounds=rounds)


def _faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def exp_inference_options() -> None:
    from vitlab.fast import modules

    torch.set_num_threads(usable_cores())
    torch.manual_seed(0)
    model = build_model(vitlab_config("ViT-B/16")).eval()
    held = vitlab.fast.optimize(copy.deepcopy(model), inference_weights="hold")
    vitlab.fast.optimize(model)
    default_rows = modules.CHUNK_ROWS
    for batch, rounds in ((1, 11), (8, 5), (32, 3)):
        x = torch.randn(batch, 3, 224, 224)
        for amp in (False, True):
            faults: dict[str, list[int]] = {}

            def infer(m: torch.nn.Module, label: str, rows: int = default_rows) -> Callable[[], None]:
                def go() -> None:
                    modules.CHUNK_ROWS = rows
                    before = _faults()
                    with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=amp):
                        m(x)
                    faults.setdefault(label, []).append(_faults() - before)
                    modules.CHUNK_ROWS = default_rows
                return go

            variants = {"default": infer(model, "default"),
                        "one chunk per batch": infer(model, "one chunk per batch", rows=1 << 30)}
            if amp:
                variants["weights held cast"] = infer(held, "weights held cast")
            compare(f"ViT-B/16 inference, batch {batch}, {'bf16 autocast' if amp else 'fp32'}", variants,
                    rounds=rounds)
            print("  page faults per call (median): "
                  + ", ".join(f"{k} {sorted(v)[len(v) // 2]}" for k, v in faults.items()))


def exp_kernels() -> None:
    from vitlab.fast.kernels import BF16_KERNELS, FP32_KERNELS, KernelChoice, why_unavailable

    for spec, batch, rounds, cfg, x, y, amp in _training_cases((9, 5)):
        torch.manual_seed(0)
        base = build_model(cfg).train()
        plain = copy.deepcopy(base)
        steps = {"plain": training_step(plain, plain.parameters(), x, y, amp)}
        choices = ([KernelChoice(bf16=b) for b in BF16_KERNELS] if amp else
                   [KernelChoice(fp32=k, attention=a) for k in FP32_KERNELS for a in ("fused", "explicit")])
        for choice in choices:
            if why_unavailable(choice) is not None:
                continue
            for recompute in (True, False):
                model = vitlab.fast.optimize(copy.deepcopy(base), choice, recompute=recompute)
                label = (f"bf16 {choice.bf16}" if amp else f"fp32 {choice.fp32}, {choice.attention}")
                steps[f"{label}, {'recompute' if recompute else 'store'}"] = \
                    training_step(model, model.parameters(), x, y, amp)
        for peer in ("hf-sdpa", "hf-eager"):
            model, forward = make_model(peer, spec)
            steps[peer] = training_step(forward, model.train().parameters(), x, y, amp)
        compare(f"training step, {spec}, batch {batch}, {'bf16 autocast' if amp else 'fp32'} (AdamW)",
                steps, rounds=rounds)


def _transposed_view_patchify(model: torch.nn.Module, x: torch.Tensor):
    """``VisionTransformer.patchify`` as it was before the tokens were made contiguous."""
    x = model.patch_embed(x)
    return x.flatten(2).transpose(1, 2), (x.shape[-2], x.shape[-1])


def exp_stream_layout() -> None:
    from vitlab.configs import load_recipe
    from vitlab.train.architecture import model_architecture

    torch.set_num_threads(usable_cores())
    torch.manual_seed(0)
    base = build_model(model_architecture(load_recipe("cifar10_scratch:model=vit,device=cpu").model, num_classes=10))
    x, y = torch.randn(128, 3, 32, 32), torch.randint(0, 10, (128,))
    contiguous, transposed = copy.deepcopy(base), copy.deepcopy(base)
    transposed.patchify = types.MethodType(_transposed_view_patchify, transposed)
    steps = {label: training_step(m, m.parameters(), x, y, bf16=True)
             for label, m in (("contiguous tokens (today)", vitlab.fast.optimize(contiguous)),
                              ("a transposed view (before)", vitlab.fast.optimize(transposed)))}
    compare(f"training step, the CIFAR recipe's CPU model ({base.cfg.name}, mean-pooled), batch 128, bf16 autocast "
            "(AdamW)", steps, rounds=9)


EXPERIMENTS = {"kernels": exp_kernels, "recompute": exp_recompute, "inference": exp_inference,
               "inference_options": exp_inference_options, "stream_layout": exp_stream_layout}

if __name__ == "__main__":
    sys.exit(run_experiments(EXPERIMENTS, sys.argv[1:], __doc__))
