"""A/B experiments on vitlab's model: each compares variants of one thing, interleaved.

    python benchmarks/ab.py                    # every experiment
    python benchmarks/ab.py patchify qkv       # some of them

Made for a busy machine: the variants of an experiment alternate round after round in
one process with one thread, and the figure is the *CPU time of the thread*
(time.thread_time), which does not count time spent waiting for a core; the minimum
over rounds is reported beside the median.  Memory-bandwidth contention from other
processes still adds noise, so treat differences under ~5% as none.  The results are
in benchmarks/NOTES.md.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections import Counter
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

import harness  # noqa: F401  (puts the checkout on sys.path)
from harness import attention_path, vitlab_config
from vitlab.analysis.cost import SavedForBackward, model_flops
from vitlab.config import ViTConfig, replace
from vitlab.models.registry import build_model

SMALL = ViTConfig(width=384, depth=4, mlp_dim=1536, num_heads=6, patch_size=16, img_size=224, gelu="exact")
CIFAR = ViTConfig(width=192, depth=6, mlp_dim=768, num_heads=3, patch_size=4, img_size=32, num_classes=10,
                  gelu="exact")


def compare(name: str, variants: dict[str, Callable[[], object]], rounds: int = 7,
            clock: Callable[[], float] = time.thread_time) -> None:
    """Print ms per call of each variant: min and median over interleaved rounds.

    The default clock is the thread's CPU time (one thread, a busy machine); multi-threaded
    experiments pass ``time.perf_counter`` and need a quiet machine.
    """
    for fn in variants.values():  # warm up every variant first
        fn()
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for key, fn in variants.items():
            t = clock()
            fn()
            cpu[key].append(clock() - t)
    base = min(cpu[next(iter(variants))])
    what = "thread CPU" if clock is time.thread_time else "wall"
    print(f"\n{name}  ({what} ms per call, {rounds} interleaved rounds, {torch.get_num_threads()} thread(s))")
    for key, ts in cpu.items():
        print(f"  {key:34s} min {1e3 * min(ts):8.1f}  median {1e3 * statistics.median(ts):8.1f}  "
              f"min vs first {min(ts) / base:5.2f}x")


def exp_patchify() -> None:
    """Patch embedding: strided conv (oneDNN) against reshape + matmul."""
    conv = torch.nn.Conv2d(3, 768, 16, 16)
    x = torch.randn(32, 3, 224, 224)

    def as_matmul():
        B, C, H, W = x.shape
        p = x.view(B, C, H // 16, 16, W // 16, 16).permute(0, 2, 4, 1, 3, 5).reshape(B, -1, C * 256)
        return F.linear(p, conv.weight.view(768, -1), conv.bias)  # (B, N, D), no transpose after

    def as_conv():
        return conv(x).flatten(2).transpose(1, 2)

    def as_conv_channels_last():
        return conv(x.contiguous(memory_format=torch.channels_last)).flatten(2).transpose(1, 2)

    with torch.no_grad():
        assert torch.allclose(as_matmul(), as_conv(), atol=1e-4)
        compare("patchify ViT-B/16, batch 32, forward",
                {"conv2d (current)": as_conv, "reshape + linear": as_matmul,
                 "conv2d, channels_last input": as_conv_channels_last})


def exp_qkv() -> None:
    """Attention layouts: fused qkv viewed as strided q/k/v (current), made contiguous, or unbound."""
    B, L, D, H = 16, 197, 384, 6
    qkv = torch.nn.Linear(D, 3 * D)
    x = torch.randn(B, L, D, requires_grad=True)

    def strided():
        q, k, v = qkv(x).view(B, L, 3, H, D // H).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, L, D)

    def contiguous():
        q, k, v = qkv(x).view(B, L, 3, H, D // H).permute(2, 0, 3, 1, 4).contiguous()
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, L, D)

    def chunked():
        q, k, v = (t.view(B, L, H, D // H).transpose(1, 2) for t in qkv(x).chunk(3, dim=-1))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, L, D)

    for label, grad in (("forward", False), ("forward + backward", True)):
        def run(f):
            def go():
                out = f()
                if grad:
                    out.sum().backward()
            return go
        with torch.set_grad_enabled(grad):
            compare(f"attention core, ViT-S width, batch 16, {label}",
                    {"strided views (current)": run(strided), "contiguous q/k/v": run(contiguous),
                     "chunk + transpose": run(chunked)})


def _train_step(model, x, y, opt):
    def go():
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return go


def exp_compile() -> None:
    """torch.compile (inductor, CPU) against eager: inference and a training step."""
    torch.manual_seed(0)
    eager = build_model(SMALL).eval()
    compiled = torch.compile(build_model(SMALL).eval())
    x = torch.randn(4, 3, 224, 224)
    t = time.perf_counter()
    with torch.inference_mode():
        compiled(x)
    print(f"\ncompile: first call of the compiled ViT (4 blocks) took {time.perf_counter() - t:.0f} s wall")
    with torch.inference_mode():
        compare("torch.compile, ViT-S width x 4 blocks, batch 4, inference",
                {"eager": lambda: eager(x), "torch.compile": lambda: compiled(x)}, rounds=5)
    model_e, model_c = build_model(CIFAR), build_model(CIFAR)
    model_c = torch.compile(model_c)
    xs, ys = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    compare("torch.compile, CIFAR ViT, batch 64, training step (AdamW)",
            {"eager": _train_step(model_e, xs, ys, torch.optim.AdamW(model_e.parameters())),
             "torch.compile": _train_step(model_c, xs, ys, torch.optim.AdamW(model_c.parameters()))},
            rounds=5)


def exp_bf16() -> None:
    """bf16 inference: autocast against casting the weights, against fp32."""
    model = build_model(SMALL).eval()
    half = build_model(SMALL).eval().to(torch.bfloat16)
    x = torch.randn(2, 3, 224, 224)
    print(f"\noneDNN bf16 support on this CPU: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}")

    def autocast():
        with torch.autocast("cpu", torch.bfloat16):
            return model(x)

    with torch.inference_mode():
        compare("bf16, ViT-S width x 4 blocks, batch 2, inference",
                {"fp32": lambda: model(x), "bf16 autocast": autocast,
                 "bf16 weights (model.to)": lambda: half(x.bfloat16())}, rounds=3)


def _bf16_train_step(forward, x, y, opt, context: Callable[[], contextlib.AbstractContextManager]):
    """A bf16 autocast training step (forward and backward inside ``context()``), then AdamW."""
    def go():
        with context():
            with torch.autocast("cpu", torch.bfloat16):
                loss = F.cross_entropy(forward(x).float(), y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return go


def exp_attention_bf16() -> None:
    """bf16 autocast training on CPU: vitlab's explicit attention (its bf16 CPU path) against
    the flash kernel it replaced, beside Hugging Face (sdpa, eager); every core, wall time."""
    from harness import make_model

    torch.set_num_threads(os.cpu_count() or 1)
    for spec, batch, rounds in (("ViT-CIFAR", 128, 5), ("ViT-S/16", 32, 3)):
        torch.manual_seed(0)
        x, y = _inputs(spec, batch)
        steps = {}
        for impl in ("vitlab", "vitlab (flash kernel)", "hf-sdpa", "hf-eager"):
            model, forward = make_model(impl.split()[0], spec)
            flash = impl.endswith("(flash kernel)")
            steps[impl] = _bf16_train_step(forward, x, y, torch.optim.AdamW(model.parameters()),
                                           lambda flash=flash: attention_path(False) if flash else contextlib.nullcontext())
        compare(f"bf16 autocast training step, {spec}, batch {batch}", steps, rounds=rounds,
                clock=time.perf_counter)


def exp_bf16_matmul() -> None:
    """bf16 matmuls by the fp32 GEMM on bf16-rounded operands (``vitlab/models/bf16_matmul.py``)
    against the bf16 kernel: single matmuls of the layers' shapes, then bf16 autocast training
    steps and ViT-B/16 inference beside Hugging Face (sdpa, eager); every core, wall time."""
    from harness import make_model
    from vitlab.models.bf16_matmul import bf16_matmul

    torch.set_num_threads(os.cpu_count() or 1)
    for rows, inner, cols in ((4096, 4096, 4096), (8320, 192, 576), (8320, 768, 192), (6304, 384, 1536),
                              (6304, 1536, 384), (6304, 768, 2304)):
        a, w = torch.randn(rows, inner).bfloat16(), torch.randn(inner, cols).bfloat16()
        compare(f"matmul ({rows} x {inner}) @ ({inner} x {cols}), bf16 operands and result",
                {"bf16 kernel": lambda: a @ w,
                 "fp32 GEMM (round-trip casts)": lambda: (a.float() @ w.float()).bfloat16()},
                rounds=5, clock=time.perf_counter)
    rows_per_case = (("ViT-CIFAR", 128, 5, True), ("ViT-S/16", 32, 3, True), ("ViT-B/16", 8, 4, False))
    for spec, batch, rounds, train in rows_per_case:
        torch.manual_seed(0)
        x, y = _inputs(spec, batch)
        calls = {}
        for impl in ("vitlab", "vitlab (bf16 kernel)", "hf-sdpa", "hf-eager"):
            model, forward = make_model(impl.split()[0], spec)
            path = "bf16" if impl.endswith("(bf16 kernel)") else "auto"
            if train:
                call = _bf16_train_step(forward, x, y, torch.optim.AdamW(model.parameters()),
                                        lambda path=path: bf16_matmul(path))
            else:
                model.eval()

                def call(forward=forward, path=path):
                    with bf16_matmul(path), torch.inference_mode(), torch.autocast("cpu", torch.bfloat16):
                        forward(x)
            calls[impl] = call
        what = "training step" if train else "inference"
        compare(f"bf16 autocast {what}, {spec}, batch {batch}", calls, rounds=rounds, clock=time.perf_counter)


def exp_recompute() -> None:
    """Training steps with LayerNorm and GELU outputs recomputed in the backward (vitlab's
    default) against stored (``store_activations``), fp32 and bf16 autocast, every core,
    wall time; and the activations each keeps for the backward, counted by storage."""
    from vitlab.models.fused import store_activations

    torch.set_num_threads(os.cpu_count() or 1)
    for spec, batch, rounds in (("ViT-CIFAR", 128, 5), ("ViT-S/16", 32, 3)):
        for amp in (False, True):
            torch.manual_seed(0)
            x, y = _inputs(spec, batch)
            model = build_model(vitlab_config(spec))
            opt = torch.optim.AdamW(model.parameters())

            def step(stored: bool) -> None:
                with store_activations() if stored else contextlib.nullcontext():
                    with torch.autocast("cpu", torch.bfloat16, enabled=amp):
                        loss = F.cross_entropy(model(x).float(), y)
                    loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            saved = {}
            for label, stored in (("recomputed", False), ("stored", True)):
                with store_activations() if stored else contextlib.nullcontext():
                    saved[label] = _saved_for_backward(model, x, y, amp)
            dtype = "bf16 autocast" if amp else "fp32"
            print(f"\n{spec}, batch {batch}, {dtype}: activations kept for the backward "
                  + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in saved.items()))
            compare(f"training step, {spec}, batch {batch}, {dtype} (AdamW)",
                    {"recomputed": lambda: step(False), "stored": lambda: step(True)},
                    rounds=rounds, clock=time.perf_counter)


def _saved_for_backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, amp: bool) -> int:
    """Bytes of the tensors autograd keeps for the backward of one step, parameters excluded."""
    with SavedForBackward(model) as kept:
        with torch.autocast("cpu", torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return kept.bytes


def exp_inference_buffers() -> None:
    """ViT-B/16 fp32 inference, batch 32, 8 and 1: vitlab writing its qkv and MLP activations into
    one reused buffer each (the default) against fresh allocations, beside HF sdpa; every
    core, wall time; page faults per forward."""
    import resource

    from harness import make_model
    from vitlab.models.buffers import plain_inference

    torch.set_num_threads(os.cpu_count() or 1)
    for batch, rounds in ((32, 5), (8, 9), (1, 15)):
        torch.manual_seed(0)
        x = torch.randn(batch, 3, 224, 224)
        vitlab_model, _ = make_model("vitlab", "ViT-B/16")
        hf_model, hf_forward = make_model("hf-sdpa", "ViT-B/16")
        vitlab_model.eval(), hf_model.eval()
        faults: dict[str, list[int]] = {}

        def forward(name: str, fn: Callable[[], object], reuse: bool = True) -> Callable[[], None]:
            def go() -> None:
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                with torch.inference_mode(), contextlib.nullcontext() if reuse else plain_inference():
                    fn()
                faults.setdefault(name, []).append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            return go

        with torch.inference_mode():
            torch.testing.assert_close(vitlab_model(x), vitlab_model(x.clone()))
        compare(f"ViT-B/16 fp32 inference, batch {batch}", {
            "vitlab (reused buffers)": forward("vitlab (reused buffers)", lambda: vitlab_model(x)),
            "vitlab (fresh allocations)": forward("vitlab (fresh allocations)", lambda: vitlab_model(x), False),
            "hf-sdpa": forward("hf-sdpa", lambda: hf_forward(x)),
        }, rounds=rounds, clock=time.perf_counter)
        print("  page faults per forward (median): "
              + ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in faults.items()))


def exp_autocast_weights() -> None:
    """ViT-B/16 bf16 autocast inference, batch 1 and 8: vitlab's dense layers keeping their
    bf16 weights between calls (the default) against casting them in every call, as
    autocast does; every core, wall time."""
    from vitlab.models.buffers import plain_inference

    torch.set_num_threads(os.cpu_count() or 1)
    # two copies of one model: plain_inference drops the kept weights, so one model switched
    # back and forth would recast in every round
    kept = build_model(vitlab_config("ViT-B/16")).eval()
    plain = build_model(vitlab_config("ViT-B/16")).eval()
    plain.load_state_dict(kept.state_dict())

    def infer(x: torch.Tensor, keep: bool) -> Callable[[], torch.Tensor]:
        def go() -> torch.Tensor:
            with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16):
                if keep:
                    return kept(x)
                with plain_inference():
                    return plain(x)
        return go

    for batch, rounds in ((1, 15), (8, 5)):
        x = torch.randn(batch, 3, 224, 224)
        assert torch.equal(infer(x, True)(), infer(x, False)())
        compare(f"ViT-B/16 bf16 autocast inference, batch {batch}",
                {"weights cast once": infer(x, True), "weights cast per call": infer(x, False)},
                rounds=rounds, clock=time.perf_counter)


def exp_packed_weights() -> None:
    """ViT-B/16 fp32 inference at batch 1, 2 and 8: vitlab as it is against vitlab inside
    ``packed_weights`` (dense weights packed once for oneDNN), beside HF sdpa; every core,
    wall time; the packed copies' bytes."""
    from harness import make_model
    from vitlab.models import packed_weights

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    plain, _ = make_model("vitlab", "ViT-B/16")
    packed, _ = make_model("vitlab", "ViT-B/16")  # its own copy: the packs stay with it
    packed.load_state_dict(plain.state_dict())
    peer, peer_forward = make_model("hf-sdpa", "ViT-B/16")
    for model in (plain, packed, peer):
        model.eval()
    with packed_weights(packed):
        for batch, rounds in ((1, 15), (2, 9), (8, 5)):
            x = torch.randn(batch, 3, 224, 224)

            def infer(forward):
                def go():
                    with torch.inference_mode():
                        return forward(x)
                return go
            torch.testing.assert_close(infer(packed)(), infer(plain)(), rtol=1e-5, atol=1e-5)
            compare(f"ViT-B/16 fp32 inference, batch {batch}",
                    {"vitlab": infer(plain), "vitlab, packed_weights": infer(packed),
                     "hf-sdpa": infer(peer_forward)}, rounds=rounds, clock=time.perf_counter)
        packs = [m._packed[1] for m in packed.modules() if getattr(m, "_packed", None) is not None]
        size = sum(t.numel() * t.element_size() for t in packs)
        print(f"  packed copies: {len(packs)} weights, {size / 2**20:.0f} MiB")


def exp_bf16_packed() -> None:
    """ViT-B/16 bf16 autocast inference by the fp32 GEMM at batch 1, 8 and 32: vitlab holding
    its bf16-valued weights packed for oneDNN (the default since its first call has at most
    ``PACK_ROWS`` rows) against holding them plain, beside HF sdpa; every core, wall time."""
    from harness import make_model
    from vitlab.models import buffers

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    packed, _ = make_model("vitlab", "ViT-B/16")
    plain, _ = make_model("vitlab", "ViT-B/16")  # its own copy: the held layout stays with it
    plain.load_state_dict(packed.state_dict())
    peer, peer_forward = make_model("hf-sdpa", "ViT-B/16")
    for model in (packed, plain, peer):
        model.eval()

    def infer(forward, x):
        def go():
            with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16):
                return forward(x)
        return go

    one = torch.randn(1, 3, 224, 224)
    first = infer(packed, one)()  # the first call (197 rows) sets the held layout
    saved, buffers.PACK_ROWS = buffers.PACK_ROWS, 0
    try:
        torch.testing.assert_close(infer(plain, one)(), first, rtol=0.0, atol=0.0)
    finally:
        buffers.PACK_ROWS = saved
    print(f"  held layouts: packed {_held_layouts(packed)}, plain {_held_layouts(plain)}")
    for batch, rounds in ((1, 15), (8, 7), (32, 3)):
        x = torch.randn(batch, 3, 224, 224)
        compare(f"ViT-B/16 bf16 autocast inference, batch {batch}",
                {"vitlab, weights held packed": infer(packed, x), "vitlab, weights held plain": infer(plain, x),
                 "hf-sdpa": infer(peer_forward, x)}, rounds=rounds, clock=time.perf_counter)


def exp_dense_layers() -> None:
    """ViT-B/16's 48 dense layers alone (12 blocks x qkv, proj, fc1, fc2, each with its own
    weight, so read from memory as in a forward) at 197, 1576 and 6304 rows (batch 1, 8, 32):
    fp32 ``addmm`` into a reused output against oneDNN with the weight packed once, then the
    same with bf16 input and output (the fp32 GEMM path of bf16 inference); every core, wall
    time, minimum (each title gives the matmuls' GFLOP)."""
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    shapes = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]  # (in, out)
    layers = [[(torch.randn(n, k), torch.randn(n)) for k, n in shapes] for _ in range(12)]
    for rows, rounds in ((197, 7), (1576, 5), (6304, 3)):
        flops = 12 * sum(2 * rows * k * n for k, n in shapes)
        packed = [[torch.ops.mkldnn._reorder_linear_weight(w, rows) for w, _ in block] for block in layers]
        inputs = {k: torch.randn(rows, k) for k in (768, 3072)}
        bf16_inputs = {k: t.bfloat16() for k, t in inputs.items()}
        outs = {n: torch.empty(rows, n) for n in (768, 2304, 3072)}

        def plain(bf16: bool):
            def go():
                for block in layers:
                    for w, b in block:
                        x = inputs[w.shape[1]].copy_(bf16_inputs[w.shape[1]]) if bf16 else inputs[w.shape[1]]
                        out = torch.addmm(b, x, w.t(), out=outs[w.shape[0]])
                        if bf16:
                            out.bfloat16()
            return go

        def onednn(bf16: bool):
            def go():
                for block, packs in zip(layers, packed):
                    for (w, b), p in zip(block, packs):
                        x = inputs[w.shape[1]].copy_(bf16_inputs[w.shape[1]]) if bf16 else inputs[w.shape[1]]
                        out = torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], "")
                        if bf16:
                            out.bfloat16()
            return go

        for bf16 in (False, True):
            what = "bf16 in and out, fp32 GEMM" if bf16 else "fp32"
            compare(f"48 dense layers of ViT-B/16 at {rows} rows, {what} ({flops / 1e9:.0f} GFLOP)",
                    {"addmm": plain(bf16), "oneDNN, weights packed once": onednn(bf16)},
                    rounds=rounds, clock=time.perf_counter)


def _held_layouts(model: torch.nn.Module) -> dict[str, int]:
    """How many dense layers hold their autocast weight in each layout."""
    return dict(Counter(str(m._cast[1].layout) for m in model.modules() if getattr(m, "_cast", None) is not None))


def exp_attention_paths() -> None:
    """Where vitlab keeps the fused kernel: bf16 inference (ViT-B/16, batch 8, beside HF sdpa)
    and fp32 training (CIFAR-size ViT, batch 128), each against the explicit path; every
    core, wall time."""
    from harness import make_model

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    x, _ = _inputs("ViT-B/16", 8)
    model, forward = make_model("vitlab", "ViT-B/16")
    peer, peer_forward = make_model("hf-sdpa", "ViT-B/16")
    model.eval(), peer.eval()

    def infer(forward, explicit=None):
        def go():
            with attention_path(explicit) if explicit is not None else contextlib.nullcontext():
                with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16):
                    forward(x)
        return go
    compare("bf16 autocast inference, ViT-B/16, batch 8",
            {"vitlab (fused kernel, as is)": infer(forward), "vitlab (explicit)": infer(forward, True),
             "hf-sdpa": infer(peer_forward)}, rounds=5, clock=time.perf_counter)

    x, y = _inputs("ViT-CIFAR", 128)
    steps = {}
    for label, explicit in (("vitlab (fused kernel, as is)", False), ("vitlab (explicit)", True)):
        model, forward = make_model("vitlab", "ViT-CIFAR")
        step = _train_step(forward, x, y, torch.optim.AdamW(model.parameters()))

        def forced(step=step, explicit=explicit):
            with attention_path(explicit):
                step()
        steps[label] = forced
    compare("fp32 training step, CIFAR ViT, batch 128", steps, rounds=5, clock=time.perf_counter)


def exp_attention_fp32() -> None:
    """Attention alone, forward and backward, fp32: the CPU flash kernel on vitlab's strided
    q/k/v views against two matmuls and a softmax, at the CIFAR-size ViT's shapes (batch 128,
    65 tokens, 3 heads) and ViT-S/16's (batch 32, 197 tokens, 6 heads); one thread."""
    for batch, tokens, heads in ((128, 65, 3), (32, 197, 6)):
        torch.manual_seed(0)
        head_dim, width = 64, 64 * heads
        qkv = torch.randn(batch, tokens, 3 * width, requires_grad=True)
        grad = torch.randn(batch, tokens, width)

        def attend(explicit: bool) -> Callable[[], None]:
            def go() -> None:
                q, k, v = qkv.view(batch, tokens, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
                if explicit:
                    out = ((q * head_dim**-0.5) @ k.transpose(-2, -1)).softmax(-1) @ v
                else:
                    out = F.scaled_dot_product_attention(q, k, v)
                out.transpose(1, 2).reshape(batch, tokens, width).backward(grad)
                qkv.grad = None
            return go
        compare(f"fp32 attention forward + backward, batch {batch}, {tokens} tokens, {heads} heads",
                {"flash kernel": attend(False), "explicit": attend(True)}, rounds=15)


@contextlib.contextmanager
def _views_split() -> Iterator[None]:
    """Inside the block, attention splits qkv with plain views (autograd's own backward)."""
    from vitlab.models import layers
    from vitlab.models.fused import head_views

    fused_split = layers.split_heads
    layers.split_heads = head_views
    try:
        yield
    finally:
        layers.split_heads = fused_split


def exp_split_heads() -> None:
    """The qkv split's backward: one stack into the fused layout (``fused.split_heads``)
    against autograd's backward of the views (stack, then a permuted copy), in the
    attention alone (CIFAR-size shapes, one thread) and in the fp32 CIFAR-size training
    step (every core, wall)."""
    from vitlab.models import layers

    torch.manual_seed(0)
    batch, tokens, heads, head_dim = 128, 65, 3, 64
    qkv = torch.randn(batch, tokens, 3 * heads * head_dim, requires_grad=True)
    grad = torch.randn(batch, tokens, heads * head_dim)

    def attend(views: bool) -> Callable[[], None]:
        def go() -> None:
            with _views_split() if views else contextlib.nullcontext():
                q, k, v = layers.split_heads(qkv, heads)
                out = F.scaled_dot_product_attention(q, k, v)
                out.transpose(1, 2).reshape(batch, tokens, -1).backward(grad)
            qkv.grad = None
        return go
    compare("fp32 attention forward + backward, batch 128, 65 tokens, 3 heads",
            {"one stack (current)": attend(False), "autograd's views": attend(True)}, rounds=15)

    torch.set_num_threads(os.cpu_count() or 1)
    x, y = _inputs("ViT-CIFAR", 128)
    model = build_model(vitlab_config("ViT-CIFAR"))
    step = _train_step(model, x, y, torch.optim.AdamW(model.parameters()))

    def with_views() -> None:
        with _views_split():
            step()
    compare("fp32 training step, CIFAR-size ViT, batch 128 (AdamW)",
            {"one stack (current)": step, "autograd's views": with_views}, rounds=15, clock=time.perf_counter)


def exp_denormal() -> None:
    """Flush-to-zero of denormals in a training step (zero-initialised head: tiny gradients)."""
    torch.manual_seed(0)
    model = build_model(CIFAR)
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    step = _train_step(model, x, y, torch.optim.AdamW(model.parameters()))
    for _ in range(3):
        step()

    def flushed():
        torch.set_flush_denormal(True)
        step()
        torch.set_flush_denormal(False)

    compare("flush denormals, CIFAR ViT, batch 64, training step", {"default": step, "flush denormal": flushed})


def exp_adamw() -> None:
    """The optimizer step alone: AdamW's default (foreach) against fused=True, CIFAR ViT."""
    torch.manual_seed(0)
    model = build_model(CIFAR)
    F.cross_entropy(model(torch.randn(8, 3, 32, 32)), torch.randint(0, 10, (8,))).backward()
    params = list(model.parameters())
    for p in params:  # gradients everywhere (the zero head leaves the body's at 0 on step 1)
        p.grad = torch.randn_like(p) * 1e-3
    foreach = torch.optim.AdamW(params, foreach=True)
    fused = torch.optim.AdamW(params, fused=True)
    compare(f"AdamW step, CIFAR ViT ({sum(p.numel() for p in params) / 1e6:.1f}M parameters)",
            {"foreach (default)": foreach.step, "fused=True": fused.step}, rounds=15)


def exp_peers() -> None:
    """vitlab against Hugging Face (sdpa, eager) in one process: a training step and inference."""
    from harness import make_model

    torch.manual_seed(0)
    steps, steps_s16, infers = {}, {}, {}
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    xi, yi = torch.randn(8, 3, 224, 224), torch.randint(0, 1000, (8,))
    for impl in ("vitlab", "hf-sdpa", "hf-eager"):
        model, forward = make_model(impl, "ViT-CIFAR")
        steps[impl] = _train_step(forward, x, y, torch.optim.AdamW(model.parameters()))
        model_s, forward_s = make_model(impl, "ViT-S/16")
        steps_s16[impl] = _train_step(forward_s, xi, yi, torch.optim.AdamW(model_s.parameters()))
        model_i, forward_i = make_model(impl, "ViT-S/16")
        model_i.eval()
        infers[impl] = lambda f=forward_i: f(xi)
    compare("training step, CIFAR ViT, batch 64 (forward, backward, AdamW)", steps)
    compare("training step, ViT-S/16 at 224, batch 8", steps_s16, rounds=4)
    with torch.inference_mode():
        compare("inference, ViT-S/16, batch 8", infers, rounds=5)


def exp_b16_inference() -> None:
    """ViT-B/16 inference at batch 1, 8 and 32, fp32 and bf16 autocast, every core, wall time:
    vitlab against HF (sdpa, eager) in one process, with the matmul peak of each dtype."""
    from harness import make_model

    torch.set_num_threads(os.cpu_count() or 1)
    models = {impl: make_model(impl, "ViT-B/16") for impl in ("vitlab", "hf-sdpa", "hf-eager")}
    for model, _ in models.values():
        model.eval()
    for batch, rounds in ((1, 15), (8, 7), (32, 5)):
        for amp in (False, True):
            torch.manual_seed(0)
            x = torch.randn(batch, 3, 224, 224)

            def infer(forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], object]:
                def go() -> object:
                    with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=amp):
                        return forward(x)
                return go

            compare(f"inference, ViT-B/16, batch {batch}, {'bf16 autocast' if amp else 'fp32'}",
                    {impl: infer(forward) for impl, (_, forward) in models.items()}, rounds=rounds,
                    clock=time.perf_counter)
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(4096, 4096, dtype=dtype), torch.randn(4096, 4096, dtype=dtype)
        a @ b
        best = min(_wall(lambda: a @ b) for _ in range(3))
        print(f"  {dtype} matmul peak (4096^3) now: {2 * 4096**3 / best / 1e9:.0f} GFLOP/s")
    print(f"  ViT-B/16 is {model_flops(vitlab_config('ViT-B/16')) / 1e9:.1f} GFLOPs per image")


def _wall(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _inputs(spec: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images at ``spec``'s size and labels among its classes."""
    cfg = vitlab_config(spec)
    return torch.randn(batch, 3, *cfg.img_size), torch.randint(0, cfg.num_classes, (batch,))


def _peer_training(spec: str, batch: int, rounds: int) -> None:
    """A training step (forward, backward, AdamW), every core, wall time: vitlab against HF
    (sdpa, eager), fp32."""
    from harness import make_model

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    x, y = _inputs(spec, batch)
    steps = {}
    for impl in ("vitlab", "hf-sdpa", "hf-eager"):
        model, forward = make_model(impl, spec)
        steps[impl] = _train_step(forward, x, y, torch.optim.AdamW(model.parameters()))
    compare(f"training step, {spec}, batch {batch} (forward, backward, AdamW)", steps, rounds=rounds,
            clock=time.perf_counter)


def exp_cifar_training() -> None:
    """CIFAR-size ViT training step, batch 128: vitlab against HF (sdpa, eager)."""
    _peer_training("ViT-CIFAR", 128, rounds=5)


def exp_s16_training() -> None:
    """ViT-S/16 training step at 224, batch 32 (bench.py's row): vitlab against HF (sdpa, eager)."""
    _peer_training("ViT-S/16", 32, rounds=6)


def exp_retain_memory() -> None:
    """Training steps in fresh processes with malloc's default thresholds against
    ``vitlab.train.memory.retain_freed_memory`` (which ``vitlab train`` applies on CPU), for
    vitlab and the HF peers: the setting belongs to the process, so every implementation
    can have it.  Wall time, every core, paired rounds in alternating order."""
    from harness import run_case

    for spec, batch in (("ViT-CIFAR", 128), ("ViT-S/16", 32)):
        print(f"\nretain_memory: fp32 training step, {spec}, batch {batch}, fresh processes "
              f"(img/s, median of 5 rounds; page faults per step)")
        for impl in ("vitlab", "hf-sdpa", "hf-eager"):
            rates: dict[bool, list[float]] = {False: [], True: []}
            faults: dict[bool, list[float]] = {False: [], True: []}
            for round_ in range(5):
                for retain in ((False, True) if round_ % 2 == 0 else (True, False)):
                    case = dict(kind="train", impl=impl, model=spec, batch=batch, dtype="fp32", device="cpu",
                                warmup=3, repeats=5, min_seconds=1.0, retain_memory=retain)
                    r = run_case(case, timeout=1800)
                    if "error" in r:
                        sys.exit(f"{impl} retain_memory={retain}: {r['error']}")
                    rates[retain].append(r["median"])
                    faults[retain].append(r["page_faults_per_call"])
            paired = [b / a for a, b in zip(rates[False], rates[True])]
            print(f"  {impl:9s} default {statistics.median(rates[False]):6.1f} img/s "
                  f"({statistics.median(faults[False]) / 1e3:5.1f}k faults)   retained "
                  f"{statistics.median(rates[True]):6.1f} ({statistics.median(faults[True]) / 1e3:5.1f}k)   "
                  f"retained/default {statistics.median(paired):.3f} ({min(paired):.3f}-{max(paired):.3f})",
                  flush=True)


def exp_cifar_fresh() -> None:
    """The fp32 CIFAR-size training step (batch 128) as bench.py runs it, each figure in a
    fresh process: vitlab, vitlab storing its activations, vitlab with explicit attention,
    HF eager and HF sdpa; 4 rounds in rotated order, img/s median, and each variant's
    paired ratio to HF eager."""
    from harness import run_case

    variants = {"vitlab": ("vitlab", None), "vitlab, stored": ("vitlab", "stored"),
                "vitlab, explicit attention": ("vitlab", "explicit_attention"),
                "HF eager": ("hf-eager", None), "HF sdpa": ("hf-sdpa", None)}
    rates: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(4):
        for name in names[round_:] + names[:round_]:
            impl, variant = variants[name]
            case = dict(kind="train", impl=impl, model="ViT-CIFAR", batch=128, dtype="fp32", device="cpu",
                        warmup=3, repeats=5, min_seconds=1.0, variant=variant)
            r = run_case(case, timeout=1800)
            if "error" in r:
                sys.exit(f"{name}: {r['error']}")
            rates[name].append(r["median"])
    print("\ncifar_fresh: fp32 training step, CIFAR-size ViT, batch 128, fresh processes, 4 rounds")
    for name, rs in rates.items():
        paired = [a / b for a, b in zip(rs, rates["HF eager"])]
        print(f"  {name:28s} {statistics.median(rs):6.1f} img/s   / HF eager {statistics.median(paired):.3f} "
              f"({min(paired):.3f}-{max(paired):.3f})")


def _cifar_step_variants(variants: dict[str, ViTConfig]) -> None:
    """A CIFAR-size ViT training step, batch 256, every core, wall time, per model config."""
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    x, y = torch.randn(256, 3, 32, 32), torch.randint(0, 10, (256,))
    steps = {}
    for name, cfg in variants.items():
        model = build_model(cfg)
        steps[name] = _train_step(model, x, y, torch.optim.AdamW(model.parameters()))
    compare("training step, CIFAR ViT (MLP 384), batch 256", steps, rounds=5, clock=time.perf_counter)


def exp_patch_dropout() -> None:
    """patch_dropout 0.5 against none: a plain CIFAR-size ViT training step."""
    _cifar_step_variants({f"patch_dropout={rate}": replace(CIFAR, mlp_dim=384, patch_dropout=rate)
                          for rate in (0.0, 0.5)})


def exp_gelu() -> None:
    """Exact against tanh GELU: a CIFAR-size ViT training step."""
    _cifar_step_variants({f"{gelu} GELU": replace(CIFAR, gelu=gelu, mlp_dim=384) for gelu in ("exact", "tanh")})


def _hybrid_recipe_model(variant: str = "hybrid_bit"):
    """A CIFAR recipe hybrid (R14x1 stem + 3 blocks), as ``vitlab train`` builds it: by
    default with the BiT stem (GroupNorm), the one the NOTES' hybrid figures were taken on."""
    from vitlab.configs.cifar10_scratch import get_config
    from vitlab.train.config import model_config

    return build_model(model_config(get_config(variant), num_classes=10))


def exp_hybrid_root() -> None:
    """The hybrid's root: ReLU, -inf pad, pool (the official order, built as before) against
    pool then ReLU without the pad (vitlab's): the recipe's training step, batch 256."""
    import math

    from vitlab.models.resnet import ResNetFeatures, pad_same

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    model = _hybrid_recipe_model()
    stem = next(m for m in model.modules() if isinstance(m, ResNetFeatures))
    current = stem.forward

    def official_order(x):
        x = F.relu(stem.gn_root(stem.conv_root(x)))
        x = pad_same(x, (3, 3), (2, 2), value=-math.inf)
        x = F.max_pool2d(x.contiguous(memory_format=torch.channels_last), 3, 2).contiguous()
        for stage in stem.stages:
            x = stage(x)
        return x

    x, y = torch.randn(256, 3, 32, 32), torch.randint(0, 10, (256,))
    step = _train_step(model, x, y, torch.optim.AdamW(model.parameters()))

    def with_root(forward):
        def go():
            stem.forward = forward
            step()
        return go

    compare("hybrid R14x1+ViT-CIFAR/1 training step, batch 256",
            {"ReLU, pad, pool": with_root(official_order), "pool, ReLU (current)": with_root(current)},
            rounds=7, clock=time.perf_counter)


def exp_hybrid_compile() -> None:
    """torch.compile of the CIFAR recipe's hybrid: a training step, batch 256, every core."""
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    eager, compiled = _hybrid_recipe_model(), _hybrid_recipe_model()
    forward = torch.compile(compiled)
    x, y = torch.randn(256, 3, 32, 32), torch.randint(0, 10, (256,))
    t = time.perf_counter()
    _train_step(forward, x, y, torch.optim.AdamW(compiled.parameters()))()
    print(f"\ncompile: first training step of the compiled hybrid took {time.perf_counter() - t:.0f} s wall")
    compare("torch.compile, hybrid R14x1+ViT-CIFAR/1, batch 256, training step (AdamW)",
            {"eager": _train_step(eager, x, y, torch.optim.AdamW(eager.parameters())),
             "torch.compile": _train_step(forward, x, y, torch.optim.AdamW(compiled.parameters()))},
            rounds=5, clock=time.perf_counter)


def exp_hybrid_norm() -> None:
    """The CIFAR hybrid's stem normalisation, both under torch.compile: BiT's GroupNorm over
    weight-standardised convolutions against BatchNorm over plain ones (the recipe's)."""
    torch.set_num_threads(os.cpu_count() or 1)
    x, y = torch.randn(256, 3, 32, 32), torch.randint(0, 10, (256,))
    steps = {}
    for label, variant in (("GroupNorm + WS (hybrid_bit)", "hybrid_bit"), ("BatchNorm (hybrid)", "hybrid")):
        torch.manual_seed(0)
        model = _hybrid_recipe_model(variant)
        steps[label] = _train_step(torch.compile(model), x, y, torch.optim.AdamW(model.parameters()))
    compare("hybrid R14x1 stem norms, torch.compile, batch 256, training step (AdamW)", steps, rounds=7,
            clock=time.perf_counter)


def exp_hybrid_layout() -> None:
    """The recipe's hybrid (BatchNorm stem) under torch.compile: the stem in PyTorch's
    default NCHW layout against channels-last throughout (``max_pool_same`` keeps it)."""
    torch.set_num_threads(os.cpu_count() or 1)
    x, y = torch.randn(256, 3, 32, 32), torch.randint(0, 10, (256,))
    steps = {}
    for label, layout in (("NCHW (current)", torch.contiguous_format), ("channels-last stem", torch.channels_last)):
        torch.manual_seed(0)
        model = _hybrid_recipe_model("hybrid")
        stem_forward = model.stem.forward
        model.stem.forward = lambda t, f=stem_forward, m=layout: f(t.contiguous(memory_format=m))
        steps[label] = _train_step(torch.compile(model), x, y, torch.optim.AdamW(model.parameters()))
    compare("hybrid R14x1-BN stem layout, torch.compile, batch 256, training step (AdamW)", steps, rounds=7,
            clock=time.perf_counter)


def exp_hybrid_sizes() -> None:
    """Progressive resizing's premise: the recipe's hybrid (BatchNorm stem) under
    torch.compile, a training step on 32-pixel images against one on 24-pixel images, one
    static graph each, and a 32-pixel step of a model that dynamo recompiled with a symbolic
    size after seeing 24 (what ``torch.compile``'s default, and so the loop, does on a size
    change)."""
    torch.set_num_threads(os.cpu_count() or 1)
    y = torch.randint(0, 10, (256,))
    steps = {}
    for label, size, dynamic in (("32 pixels (static)", 32, False), ("24 pixels (static)", 24, False),
                                 ("32 pixels after 24 (automatic dynamic)", 32, None)):
        torch.manual_seed(0)
        model = _hybrid_recipe_model("hybrid")  # dynamic_img_size: the recipe has progressive_sizes
        assert model.cfg.dynamic_img_size
        forward = torch.compile(model, dynamic=dynamic)
        opt = torch.optim.AdamW(model.parameters())
        if dynamic is None:  # the first size it saw, so that 32 triggers the recompile
            _train_step(forward, torch.randn(256, 3, 24, 24), y, opt)()
        steps[label] = _train_step(forward, torch.randn(256, 3, size, size), y, opt)
    compare("hybrid R14x1-BN+ViT-CIFAR/1 training step by input size, torch.compile, batch 256 (AdamW)", steps,
            rounds=7, clock=time.perf_counter)


EXPERIMENTS = {
    "peers": exp_peers,
    "hybrid_sizes": exp_hybrid_sizes,
    "hybrid_norm": exp_hybrid_norm,
    "hybrid_layout": exp_hybrid_layout,
    "hybrid_root": exp_hybrid_root,
    "hybrid_compile": exp_hybrid_compile,
    "b16_inference": exp_b16_inference,
    "cifar_training": exp_cifar_training,
    "s16_training": exp_s16_training,
    "retain_memory": exp_retain_memory,
    "cifar_fresh": exp_cifar_fresh,
    "gelu": exp_gelu,
    "patch_dropout": exp_patch_dropout,
    "adamw": exp_adamw,
    "patchify": exp_patchify,
    "qkv": exp_qkv,
    "bf16": exp_bf16,
    "attention_bf16": exp_attention_bf16,
    "recompute": exp_recompute,
    "inference_buffers": exp_inference_buffers,
    "autocast_weights": exp_autocast_weights,
    "packed_weights": exp_packed_weights,
    "attention_paths": exp_attention_paths,
    "attention_fp32": exp_attention_fp32,
    "split_heads": exp_split_heads,
    "denormal": exp_denormal,
    "compile": exp_compile,
    "bf16_matmul": exp_bf16_matmul,
    "bf16_packed": exp_bf16_packed,
    "dense_layers": exp_dense_layers,
}

if __name__ == "__main__":
    torch.set_num_threads(1)
    names = sys.argv[1:] or list(EXPERIMENTS)
    unknown = [name for name in names if name not in EXPERIMENTS]
    if unknown:
        sys.exit(f"unknown experiment {', '.join(unknown)}; choose among: {' '.join(EXPERIMENTS)}")
    for name in names:
        EXPERIMENTS[name]()
