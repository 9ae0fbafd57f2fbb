"""Compiled inference: a frozen model as one graph, replayed without the host launching each kernel.

    infer = vitlab.fast.compile_for_inference(model, precision="bf16", batch_size=64)
    logits = infer(images)            # float images (N, C, H, W) on the model's device, any N

What a GPU serving loop or a repeated evaluation wants once the weights are final.  Two things
set it apart from ``torch.compile(model)``, which is what the peers' documentation offers:

* **Freezing** (inductor's ``freezing``): the weights become constants of the graph, so that
  what depends on them alone, above all the bf16 copies of the fp32 dense weights that autocast
  would cast again in every call, is computed once at compilation.
* **CUDA graphs** (inductor's ``triton.cudagraphs``, what ``mode="reduce-overhead"`` turns on)
  when the model is on a GPU: a call replays the recorded kernels in one launch.  At small
  batches a ViT's call is bound by the host launching its few hundred kernels, not by the GPU.

Both are set for this model's compilation only: the caller's inductor settings are as they were
after each call.  The model is only read: its parameters, buffers and modules are
untouched, and ``model(x)`` still runs eagerly.  The price of freezing: the graph keeps what it
computed from the weights at its first call (their bf16 copies, say), so compile again after
changing them.

With ``batch_size``, every call runs that one shape: a shorter batch is padded with zero
images (a ViT scores each image on its own, so the real images' outputs are unchanged) and a
longer one is scored in chunks, so that an evaluation's last, short batch does not compile a
second graph.  Without it, each new batch size compiles its own.  The outputs are copied out
of the CUDA graph's memory, which the next replay writes over.

With ``eager_on_failure`` (what `vitlab eval --compile` asks), a compilation that fails (no C++
compiler on a CPU, say) is given up with a warning and the model runs eagerly from then on, as
the trainer does with its compiled step; without it, the error is the caller's.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable

import torch
from torch import nn

from ..config import PRECISIONS, need_bool
from ..modes import evaluating
from .kernels import autocast
from .modules import need_module


class CompiledInference:
    """``model`` frozen and compiled for inference (``compile_for_inference``): call it on a float
    batch; it returns the model's output for each image, outside any graph's memory."""

    def __init__(self, model: nn.Module, precision: str = "fp32", batch_size: int | None = None,
                 eager_on_failure: bool = False, autotune: bool = False) -> None:
        need_module(model, "compile_for_inference")
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r}: expected one of {', '.join(PRECISIONS)}")
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"batch_size={batch_size!r}: expected a positive integer, or None for each call's own")
        need_bool("eager_on_failure", eager_on_failure)  # a string ("no") was taken by its truth
        need_bool("autotune", autotune)
        self.model, self.precision, self.batch_size = model, precision, batch_size
        self.eager_on_failure = eager_on_failure
        # imported here: torch's compiler stack costs an importer of vitlab.fast tens of MB it may never use
        import torch._inductor
        import torch._inductor.config as inductor_config

        self.inductor_config = inductor_config
        self.device = next(model.parameters()).device
        self.cuda_graphs = self.device.type == "cuda"
        if autotune and not self.cuda_graphs:
            raise ValueError(f"autotune=True tunes a CUDA GPU's Triton matmul templates; the model is on {self.device}")
        # on a GPU the options of torch.compile's mode "reduce-overhead" (CUDA graphs) or "max-autotune" (the
        # same, autotuned), as torch defines them, for this compilation alone; freezing is read while dynamo
        # traces, before a compilation's options apply, so each call sets it and puts the caller's back
        mode = "max-autotune" if autotune else "reduce-overhead"
        options = dict(torch._inductor.list_mode_options(mode)) if self.cuda_graphs else {"triton.cudagraphs": False}
        self.graph = torch.compile(model, dynamic=False, options=options)

    def _replay(self, x: torch.Tensor) -> torch.Tensor:
        if self.graph is None:  # given up (eager_on_failure)
            return self.model(x)
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # each call a new replay: the last outputs were copied
        try:
            return self.graph(x).clone()
        except Exception as err:  # noqa: BLE001 - any failure of the compiler: the caller chose eager
            if not self.eager_on_failure:
                raise
            warnings.warn(f"torch.compile failed ({failure_summary(err)}); inference continues eager",
                          RuntimeWarning, stacklevel=3)
            self.graph = None
            return self.model(x)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.ndim != 4 or not images.is_floating_point():
            raise ValueError(f"expected float images (N, C, H, W), got {images.dtype} {tuple(images.shape)}")
        if images.device != self.device:
            raise ValueError(f"images on {images.device}, the model on {self.device}: move them first")
        # a model already in eval mode is not walked at every call (the evaluators hand it over so)
        modes = evaluating(self.model) if self.model.training else contextlib.nullcontext()
        freezing = self.inductor_config.freezing
        self.inductor_config.freezing = True
        try:
            # Plain tensors in, whether or not the caller is in inference mode: the graph's guards tell
            # an inference tensor from a plain one, and one kind means one graph.
            with modes, torch.inference_mode(False), torch.no_grad(), autocast(self.device, self.precision):
                if images.is_inference():
                    images = images.clone()
                # one memory layout too: a strided view (a translated test-time view, say) would compile anew
                images = images.contiguous()
                if self.batch_size is None or images.shape[0] == self.batch_size:
                    return self._replay(images)
                return torch.cat([self._padded(chunk) for chunk in images.split(self.batch_size)])
        finally:
            self.inductor_config.freezing = freezing

    def _padded(self, chunk: torch.Tensor) -> torch.Tensor:
        n = chunk.shape[0]
        if n < self.batch_size:
            chunk = torch.cat([chunk, chunk.new_zeros((self.batch_size - n, *chunk.shape[1:]))])
        return self._replay(chunk)[:n]


def compile_for_inference(model: nn.Module, precision: str = "fp32", batch_size: int | None = None,
                          eager_on_failure: bool = False, autotune: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """``model`` frozen and compiled for inference: a function float images (N, C, H, W) -> outputs.

    precision: "fp32", or "bf16"/"fp16" autocast around each call.
    batch_size: the one batch every call runs (short batches padded, long ones chunked); None
        compiles each batch size met.
    eager_on_failure: a compilation that fails is given up with a warning, and the model runs eagerly.
    autotune: a model on a CUDA GPU compiled as torch.compile's "max-autotune" mode would (inductor
        times its Triton matmul templates against cuBLAS for each shape; minutes more compilation).
    Compilation happens at the first call of each shape; what it computes from the weights then (their
    bf16 copies, say) the graph keeps: compile again after changing them.
    """
    return CompiledInference(model, precision, batch_size, eager_on_failure, autotune)


def failure_summary(err: BaseException) -> str:
    """A failure's type and the first line of its message (for a warning line): those of the error
    behind it, where a wrapper raised it from one (dynamo's ``BackendCompilerFailed`` says only that a
    backend raised, on its first line)."""
    for _ in range(8):  # a chain's root, with a bound against a cycle
        inner = err.__cause__ or getattr(err, "inner_exception", None)
        if not isinstance(inner, BaseException):
            break
        err = inner
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"
