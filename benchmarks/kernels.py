"""The dense layers' matrix-multiply kernels on this CPU, at the layers' own shapes.

    python benchmarks/kernels.py                   # every experiment
    python benchmarks/kernels.py matmuls

``vitlab.fast`` picks one fp32 and one bf16 kernel per CPU (``vitlab/fast/kernels.py``: a
rule by vendor and flags, or what ``vitlab calibrate`` stored).  These experiments show the
evidence behind a choice: every kernel at the shapes of bench.py's rows, every core, wall
time, interleaved.  fp32: ``addmm`` (what ``F.linear`` does: MKL's GEMM) against oneDNN's
matmul on the plain weight (``vitlab.fast.linear.onednn_linear``).  bf16 operands and
result: the bf16 kernel against the fp32 GEMM on the same operands, casts included.
Findings: benchmarks/NOTES.md.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch

from harness import compare, run_experiments
from vitlab.machine import usable_cores

# (rows, in, out): a 4096^3 square, then the CIFAR-size ViT's qkv and MLP out at batch 128,
# ViT-S/16's MLP in and out at batch 32, ViT-B/16's qkv at batch 32 and MLP in at batch 1
SHAPES = ((4096, 4096, 4096), (8320, 192, 576), (8320, 768, 192), (6304, 384, 1536), (6304, 1536, 384),
          (6304, 768, 2304), (197, 768, 3072))
# ViT-B/16's four dense layers per block, (in, out)
B16_LAYERS = ((768, 2304), (768, 768), (768, 3072), (3072, 768))


def _kernels(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """Each way of computing ``F.linear(x, w, b)`` for fp32 ``x``: fp32 kernels and bf16 ones."""
    from vitlab.fast.linear import onednn_linear

    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
    ways = {"fp32 addmm": lambda: torch.addmm(b, x, w.t())}
    if torch.backends.mkldnn.is_available():
        ways["fp32 oneDNN"] = lambda: onednn_linear(x, w, b)
    ways["bf16 kernel"] = lambda: torch.nn.functional.linear(xb, wb, bb)
    ways["bf16 by the fp32 GEMM"] = lambda: torch.addmm(bb.float(), xb.float(), wb.float().t()).bfloat16()
    return ways


def exp_matmuls() -> None:
    """Single dense layers at ``SHAPES``, each kernel; GFLOP/s from the minimum."""
    torch.set_num_threads(usable_cores())
    torch.manual_seed(0)
    for rows, d_in, d_out in SHAPES:
        x, w, b = torch.randn(rows, d_in), torch.randn(d_out, d_in), torch.randn(d_out)
        with torch.no_grad():
            seconds = compare(f"dense layer ({rows} x {d_in}) -> {d_out}", _kernels(x, w, b), rounds=5)
        flops = 2 * rows * d_in * d_out
        print("  GFLOP/s: " + ", ".join(f"{k} {flops / min(t) / 1e9:.0f}" for k, t in seconds.items()))


def exp_dense_layers() -> None:
    """ViT-B/16's 48 dense layers alone (12 blocks, each layer its own weight, so read from
    memory as in a forward) at 197, 1576 and 6304 rows (batch 1, 8, 32), each kernel."""
    torch.set_num_threads(usable_cores())
    torch.manual_seed(0)
    layers = [[(torch.randn(n, k), torch.randn(n)) for k, n in B16_LAYERS] for _ in range(12)]
    for rows, rounds in ((197, 7), (1576, 5), (6304, 3)):
        inputs = {k: torch.randn(rows, k) for k in (768, 3072)}
        flops = 12 * sum(2 * rows * k * n for k, n in B16_LAYERS)
        per_layer = [[_kernels(inputs[w.shape[1]], w, b) for w, b in block] for block in layers]

        def all_layers(kernel: str) -> Callable[[], None]:
            def go() -> None:
                for block in per_layer:
                    for ways in block:
                        ways[kernel]()
            return go
        with torch.no_grad():
            seconds = compare(f"48 dense layers of ViT-B/16 at {rows} rows ({flops / 1e9:.0f} GFLOP)",
                              {k: all_layers(k) for k in per_layer[0][0]}, rounds=rounds)
        print("  GFLOP/s: " + ", ".join(f"{k} {flops / min(t) / 1e9:.0f}" for k, t in seconds.items()))


def exp_choice() -> None:
    """What ``vitlab.fast`` would use here: the rule, a stored calibration, and the final choice."""
    from vitlab.fast import kernels
    from vitlab.machine import cpu_class, cpu_info

    info = cpu_info()
    rule = kernels.rule_for(info)
    print(f"\n{info.vendor} {info.model}: class {cpu_class(info)}; oneDNN reports {kernels.onednn_report()}")
    print(f"  rule: {kernels.rule_choice(info).describe()}; --precision auto {rule.precision} "
          f"(figures: {rule.measured or 'none, the plain arithmetic'})")
    print(f"  stored ({kernels.calibration_path()}): {kernels.stored_choice(info=info)}")
    print(f"  chosen: {kernels.choose(info=info)}")


def exp_packing() -> None:
    """Whether holding weights packed in oneDNN's layout would pay: per training step the
    weights change, so a packed weight costs one reorder per layer per step.  Compares
    oneDNN's matmul on the plain weight (what the fast path does), on a weight packed once,
    and reorder + matmul (packing anew each step), at training and serving shapes."""
    from vitlab.fast.linear import onednn_linear

    if not torch.backends.mkldnn.is_available():
        print("packing: needs oneDNN")
        return
    torch.set_num_threads(usable_cores())
    torch.manual_seed(0)
    for rows, d_in, d_out in ((197, 768, 3072), (1576, 768, 3072), (1576, 3072, 768), (8320, 192, 576)):
        x, w, b = torch.randn(rows, d_in), torch.randn(d_out, d_in), torch.randn(d_out)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        with torch.no_grad():
            compare(f"dense layer ({rows} x {d_in}) -> {d_out}", {
                "oneDNN, plain weight": lambda: onednn_linear(x, w, b),
                "oneDNN, packed once": lambda: onednn_linear(x, packed, b),
                "oneDNN, packed anew": lambda: onednn_linear(x, torch.ops.mkldnn._reorder_linear_weight(w, rows), b),
                "addmm": lambda: torch.addmm(b, x, w.t()),
            }, rounds=9)


def exp_attention() -> None:
    """softmax(q k^T / sqrt(d)) v at ViT shapes, from the fused qkv projection to (B, L, D), no
    autograd: PyTorch's fused kernel (``scaled_dot_product_attention``, flash attention on a
    CPU), two matmuls and a softmax over the strided head views, and the fast path's
    ``contiguous_attention`` (heads copied once into contiguous blocks, the scale applied to
    the accumulator), fp32 and bf16; the fast path uses the last in bf16 (``vitlab/fast/modules.py``)."""
    from vitlab.fast.modules import contiguous_attention

    torch.set_num_threads(usable_cores())
    torch.manual_seed(0)
    # (images, heads, tokens): ViT-B/16 at batch 1 and at 10 (a bf16 chunk of 2048 tokens at most),
    # ViT-S/16 at 4, the CIFAR-size ViT at 16, ViT-B/16 at 384 px
    for images, heads, tokens in ((1, 12, 197), (10, 12, 197), (4, 6, 197), (16, 3, 65), (1, 12, 577)):
        for dtype in (torch.float32, torch.bfloat16):
            qkv = torch.randn(images, tokens, 3 * heads * 64).to(dtype)

            def views() -> tuple[torch.Tensor, ...]:  # as the model splits the fused projection
                return qkv.view(images, tokens, 3, heads, 64).permute(2, 0, 3, 1, 4).unbind(0)

            def merged(out: torch.Tensor) -> torch.Tensor:
                return out.transpose(1, 2).reshape(images, tokens, heads * 64)

            def explicit() -> torch.Tensor:
                q, k, v = views()
                return merged(((q * 64 ** -0.5) @ k.transpose(-2, -1)).softmax(-1) @ v)

            with torch.no_grad():
                compare(f"attention, {images} x {heads} heads x {tokens} tokens, {str(dtype)[6:]}",
                        {"fused kernel": lambda: merged(torch.nn.functional.scaled_dot_product_attention(*views())),
                         "two matmuls and a softmax": explicit,
                         "contiguous heads": lambda: contiguous_attention(qkv, heads, 64 ** -0.5)}, rounds=9)


EXPERIMENTS = {"attention": exp_attention, "choice": exp_choice, "matmuls": exp_matmuls, "dense_layers": exp_dense_layers,
               "packing": exp_packing}

if __name__ == "__main__":
    sys.exit(run_experiments(EXPERIMENTS, sys.argv[1:], __doc__))
