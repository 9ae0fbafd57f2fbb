"""A training run's peak memory, estimated from its configuration before anything is built.

    shape = RunShape(arch, micro_batch=32, accum_steps=1, img_size=(384, 384), precision="bf16", ...)
    estimate = estimate_memory(shape)      # counted from the shapes alone: nothing allocated
    estimate.peak, estimate.parts, estimate.line()

What a step holds, by what holds it (bytes):

* the weights (fp32 master copies, also under autocast), their gradients, the optimiser's
  state (AdamW two moments, SGD its momentum, Muon a momentum per block matrix and AdamW's
  moments for the rest), the weight average (``optim.ema_decay``); under CUDA graphs with a
  compiled call after the backward, the buffers the gradients are copied into
  (``step.HeldGradients``), kept for the whole run beside the graphs' own gradients;
* under bf16/fp16 autocast, a half-precision copy of every weight: autocast casts each one
  once per forward and keeps the casts until the backward has used them;
* the activations a backward keeps, counted layer by layer as the code stores them
  (``activation_bytes``; ``tests/train/test_memory_estimate.py`` holds the count against
  what autograd saves, ``vitlab.analysis.cost.SavedForBackward``): the plain model keeps
  every LayerNorm and GELU output, the fast path (``vitlab.fast``) recomputes them; fused
  attention keeps the heads' outputs and a log-sum-exp, explicit attention (the fast path
  in bf16 on a CPU) the (heads, tokens, tokens) probabilities of every block.  On top of
  them, what is alive for a moment at the step's peak: the logits and probabilities of the
  block being computed, and the first gradients of the backward;
* what the allocator holds beyond those live tensors (``HEAP_SLACK`` and kin: malloc's heap
  on a CPU keeps what a step frees, fragmented);
* the micro-batch itself (uint8, its float copy and the augmentation's);
* the data held in memory (the decoded uint8 training and validation sets; a streamed
  training set holds its validation set and the readers' buffers); while it is decoded and
  split, two copies of it, three when it is decoded from its files in this run rather than
  read from the cache (the heap keeps the per-image arrays decoding made);
* an evaluation: the evaluation batch, the copies its test-time views make (flip, shifts), and
  one block's working set at a time;
* saving the weights at the end: three copies of them (``weights.save_model`` clones the
  state dict and serialises it twice, to checksum it), beside what the steps left in the heap;
* what any training process loads beyond an idle interpreter (``RUNTIME_BYTES``);
* under FSDP (``shards`` processes, ``run.fsdp``): each process holds its shards of the weights,
  gradients and optimiser state (``fsdp_units``), and at a step or an evaluation the units FSDP
  has gathered, the root one (everything but the blocks) and the blocks around the one computed
  (``gathered_bytes``); autocast's casts are of every weight still.  On a CPU malloc's heap keeps
  copies of the gathered blocks (``fsdp_heap_bytes``).  Rank 0 alone gathers the whole model and
  optimiser state into host memory for each checkpoint, and the model into an unsharded copy for
  the final weights: the estimate is rank 0's, ``others_host_peak`` each other process's host
  memory, and a host's check counts one of each.  Under DDP too rank 0 alone saves the final
  weights (their clone and serialisations): the others are counted without them.

The peak is the largest of four moments: decoding the data (before the model exists), a
training step, an evaluation and saving the weights (under FSDP a fifth, writing a
checkpoint).  On a GPU the model's side is counted against the GPU's
memory and the data against the host's.  The interpreter's own baseline (Python, PyTorch
and its libraries: 0.24 GB here) is not counted: it is in use before the run starts, so
the memory available then is what the run can still take.

The estimate does not follow every option: progressive resizing (smaller images first) is
counted at the full size.  A training step's blocks are counted on the patches
``patch_dropout`` keeps.  Its agreement
with measured peaks, within 25% on the configurations of ``benchmarks/memory_estimate.py``:
docs/training.md ("Memory").
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Optional

from vitlab.config import Architecture, ConfigError, ResNetConfig

GB = 1e9
FP32 = 4
# the share of the available memory a run may plan to use: the rest is the estimate's margin
# (it is within 25% of the measured peaks, docs/training.md) and the system's
HEADROOM = 0.9
# uint8 images a streaming reader's shuffle buffer holds, per decoded image: the payloads are
# encoded (JPEG: about a tenth of the decoded size); an upper bound for PNGs would be 1
ENCODED_SHARE = 0.25
# what a DataLoader worker process adds beyond the pages it shares with the training process
WORKER_PROCESS_BYTES = 150_000_000
# tokens per chunk of the fast path's CPU inference (vitlab.fast.modules.CHUNK_ROWS), 4-byte outputs
INFERENCE_CHUNK_ROWS = 1024
# What the allocator holds beyond a step's live tensors, as a factor on them.  A CPU's glibc
# malloc maps each block above its mmap threshold afresh and unmaps it when freed, but raises
# that threshold (up to 32 MB on 64-bit Linux) to the largest block it has freed: blocks below
# it come from a heap that keeps what is freed, and a step's many sizes fragment it.  Measured
# (benchmarks/memory_estimate.py): steps whose tensors are all small held 1.4-1.6x their live
# activations, steps of large tensors 1.1-1.2x.  A GPU's caching allocator rounds and caches
# blocks too; 1.1 there is an allowance, not a measurement.
MMAP_THRESHOLD_MAX = 32 << 20
HEAP_SLACK, MAPPED_SLACK, GPU_SLACK = 1.5, 1.15, 1.1
# Under FSDP on a CPU, copies of a unit (a block) malloc's heap keeps beyond the live tensors where the
# unit's buffers are below the mmap threshold (``fsdp_heap_bytes``): measured (2 processes, gloo, fp32
# and bf16, blocks of 3 to 28 MB, a few steps), it kept 3 to 5 unsharded copies of the blocks
FSDP_HEAP_KEPT = 4
# what a training process holds beyond an idle interpreter that imported torch, whatever the
# run: the libraries and kernels it loads (PIL, oneDNN's JIT code and primitive caches), the
# autograd graph's objects, the heap that decoding and splitting the data leave behind
RUNTIME_BYTES = 100_000_000
# what rank 0 alone holds: the final weights' clone and serialisation (any launch: rank 0 saves them), under FSDP
# the gathered checkpoint and the final weights' unsharded copy too
MAIN_ONLY = ("checkpoint_gathered", "weights_gathered", "weights_saved")


@dataclass(frozen=True)
class RunShape:
    """What a run's memory depends on, all known before its data is read or its model built
    (``vitlab.train.resolve.run_shape`` makes it from a resolved config)."""

    arch: Architecture          # the model trained, at its training size and with its head
    micro_batch: int            # examples of one forward and backward in one process
    accum_steps: int = 1
    img_size: tuple = (224, 224)
    precision: str = "fp32"     # resolved: "fp32", "bf16" or "fp16" (autocast)
    device: str = "cpu"         # "cpu", "cuda", "cuda:1", ...
    fast: bool = False          # the fast path installed (vitlab.fast.optimize)
    explicit_attention_fp32: bool = False  # its kernel choice attends by two matmuls in fp32 (CPU)
    optimizer: str = "adam"
    momentum: float = 0.9       # SGD's: no buffer without it
    ema: bool = False
    mpp: Optional[str] = None   # masked patch prediction's target
    mpp_rate: float = 0.5
    train_images: int = 0       # uint8 training images held in memory (0: streamed, or unknown)
    val_images: int = 0         # uint8 validation images held in memory
    decoded_images: int = 0     # the whole set as decoded, before the split (held twice while split)
    data_copies: int = 1        # copies of the decoded set the process keeps (digits: a cached one too)
    decoded_from_source: bool = False  # decoded from its files in this run, not read from the cache
    eval_batch: int = 256
    eval_flip: bool = False     # the evaluations score each image's mirror image too (run.eval_flip)
    eval_shifts: int = 0        # shift sizes of the final evaluation's views (run.final_eval_shift)
    eval_diagonal: bool = False  # ... with the diagonal shifts too (run.final_eval_diagonal)
    streamed: bool = False
    stream_workers: int = 0     # DataLoader worker processes reading a streamed training set
    shuffle_buffer: int = 0     # samples each streaming reader holds
    cuda_graphs: bool = False   # the model's step under CUDA graphs (torch.compile "reduce-overhead")
    update_compiled: bool = False  # the step after the backward compiled on its own (run.compile_optimizer)
    shards: int = 1             # FSDP's processes (run.fsdp): each holds a share of the weights and their state

    @property
    def sharded(self) -> bool:
        return self.shards > 1

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    def slack(self, tensor_bytes: int) -> float:
        """What the allocator holds per live byte of tensors of about ``tensor_bytes`` each."""
        if self.on_gpu:
            return GPU_SLACK
        return MAPPED_SLACK if tensor_bytes >= MMAP_THRESHOLD_MAX else HEAP_SLACK

    @property
    def holds_gradients(self) -> bool:
        """Whether the run copies each backward's gradients into buffers of its own, one per
        parameter, kept for the whole run (``step.HeldGradients``): under CUDA graphs, when a
        compiled call follows the backward (the update compiled apart, or the next micro-batch)."""
        return self.cuda_graphs and (self.update_compiled or self.accum_steps > 1)

    @property
    def half(self) -> bool:
        return self.precision in ("bf16", "fp16")

    @property
    def act_bytes(self) -> int:
        """Bytes per element of what the dense layers and convolutions output (autocast's dtype)."""
        return 2 if self.half else FP32

    @property
    def image_bytes(self) -> int:
        """One decoded uint8 image at the training size."""
        return 3 * self.img_size[0] * self.img_size[1]

    def with_(self, **changes) -> "RunShape":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimated peak and what holds it, in bytes (``parts`` of the peak's moment)."""

    peak: int
    at: str                     # "the training step", "an evaluation", "decoding the data", "saving the weights"
    parts: dict                 # bytes by holder, of the moment of the peak
    host_peak: int              # what the host's memory holds at its peak (all of it on a CPU)
    device_peak: int            # what the GPU's memory holds at its peak (0 on a CPU)
    shape: RunShape
    others_host_peak: Optional[int] = None  # host_peak of a process other than rank 0 (of DDP or FSDP)

    @property
    def each_other_host_peak(self) -> int:
        """The host's peak of each process other than rank 0: rank 0 alone saves the final weights, and
        under FSDP alone gathers them and the checkpoints (None, in an estimate made by hand: rank 0's)."""
        return self.host_peak if self.others_host_peak is None else self.others_host_peak

    def record(self) -> dict:
        """The estimate as --show-config and config.json state it (GB)."""
        s = self.shape
        record = {"peak_gb": round(self.peak / GB, 3), "at": self.at,
                  "parts_gb": {k: round(v / GB, 3) for k, v in self.parts.items()},
                  "micro_batch": s.micro_batch, "accum_steps": s.accum_steps, "img_size": list(s.img_size),
                  "tokens": tokens_per_image(s.arch, s.img_size), "precision": s.precision,
                  "fast": s.fast, "device": s.device}
        if s.on_gpu:
            record["host_peak_gb"] = round(self.host_peak / GB, 3)
            record["device_peak_gb"] = round(self.device_peak / GB, 3)
        if s.sharded:  # the peak is rank 0's; every other process's is this
            record["fsdp_processes"] = s.shards
            record["other_ranks_peak_gb"] = round(((self.device_peak if s.on_gpu else 0) + self.each_other_host_peak)
                                                  / GB, 3)
        return record

    def line(self) -> str:
        """One line: the peak, its moment and its largest parts."""
        largest = sorted(self.parts.items(), key=lambda kv: -kv[1])[:3]
        held = ", ".join(f"{name.replace('_', ' ')} {gb(size)}" for name, size in largest if size)
        s = self.shape
        sharded = f", rank 0 of {s.shards} under FSDP" if s.sharded else ""
        return (f"about {gb(self.peak)} at {self.at} ({held}; micro-batch {s.micro_batch} at "
                f"{s.img_size[0]}x{s.img_size[1]} px, {tokens_per_image(s.arch, s.img_size):,} tokens, {s.precision}"
                f"{sharded})")


def gb(size: float) -> str:
    return f"{size / GB:.1f} GB" if size >= 0.1 * GB else f"{size / 1e6:.0f} MB"


# ----------------------------------------------------------------------------- the model's side


def tokens_per_image(arch: Architecture, img_size: tuple, training: bool = False) -> int:
    """The encoder's sequence length at ``img_size`` (0 for a ResNet); ``training``: in a
    training step, which keeps the patches ``patch_dropout`` keeps."""
    if isinstance(arch, ResNetConfig):
        return 0
    (h, w), (ph, pw) = arch.feature_size_of(tuple(img_size)), arch.patch_size
    patches = (h // ph) * (w // pw)
    return arch.num_prefix_tokens + (arch.kept_patches(patches) if training else patches)


@functools.lru_cache(maxsize=16)
def parameter_counts(arch: Architecture) -> tuple[int, int]:
    """(all parameters, those of the encoder blocks' dense matrices: qkv, proj, fc1, fc2)."""
    from vitlab.models.registry import count_parameters

    total = count_parameters(arch)  # on the meta device: nothing allocated; once per architecture
    if isinstance(arch, ResNetConfig):
        return total, 0
    blocks = arch.depth * (2 if arch.axial else 1)
    return total, blocks * (4 * arch.width * arch.width + 2 * arch.width * arch.mlp_dim)


@functools.lru_cache(maxsize=16)
def fsdp_units(arch: Architecture, shards: int) -> tuple[int, int, int]:
    """Under FSDP over ``shards`` processes, as ``distributed.wrap_model`` shards the model (each
    encoder block a unit, the rest of the model the root unit): (the parameters one process holds,
    the root unit's, the largest block's).  FSDP splits every parameter along its first dimension
    into ``shards`` pieces of ceil(rows / shards) rows, the last ones padded: a process holds that
    many rows of each."""
    import torch

    from vitlab.models.layers import Block
    from vitlab.models.registry import build_model

    with torch.device("meta"):  # nothing allocated; once per architecture and process count
        model = build_model(arch)
    params = list(model.parameters())
    held = sum(-(-p.shape[0] // shards) * (p.numel() // p.shape[0]) if p.dim() else 1 for p in params)
    blocks = [sum(p.numel() for p in m.parameters()) for m in model.modules() if isinstance(m, Block)]
    return held, sum(p.numel() for p in params) - sum(blocks), max(blocks, default=0)


def held_parameters(shape: RunShape) -> int:
    """The parameters one process holds between steps: all of them, or under FSDP its shards."""
    return fsdp_units(shape.arch, shape.shards)[0] if shape.sharded else parameter_counts(shape.arch)[0]


def gathered_bytes(shape: RunShape, backward: bool = True) -> int:
    """What FSDP gathers beyond a process's shards at the peak of a forward (and backward): the
    root unit's parameters, which it keeps from the forward to the end of the backward, and their
    gradients, reduced last; around the block being computed, in the forward its parameters, its
    all-gather buffer and the previous block's, kept until this one's are copied out, and in the
    backward the next block's parameters (gathered ahead), the block's gradients, its
    reduce-scatter buffer and the previous block's, kept while that reduction is in flight.
    0 without FSDP."""
    if not shape.sharded:
        return 0
    _, root, unit = fsdp_units(shape.arch, shape.shards)
    return FP32 * (2 * root + 4 * unit if backward else root + 3 * unit)


def fsdp_heap_bytes(shape: RunShape) -> int:
    """On a CPU, what malloc's heap keeps of FSDP's gathers beyond the live tensors: at every step
    each unit's parameters and gradients are gathered into fresh tensors and buffers, between
    tensors that live on (the activations, the sharded gradients), and a unit whose buffers are
    below the heap's mmap threshold leaves about ``FSDP_HEAP_KEPT`` copies of itself there (under
    autocast, half as many of its weights' casts, made afresh at every forward too); a larger
    one's buffers are mapped and given back, and about one copy of its parameters' tensors is
    kept (module text).  0 on a GPU (its caching allocator reuses the same sizes: ``GPU_SLACK``)
    and without FSDP."""
    if not shape.sharded or shape.on_gpu:
        return 0
    _, root, unit = fsdp_units(shape.arch, shape.shards)
    blocks = parameter_counts(shape.arch)[0] - root
    unit_bytes = FP32 + (shape.act_bytes / 2 if shape.half else 0)  # per parameter: its fp32 copies, its casts

    def kept(params: int) -> float:  # what the heap keeps per parameter of a unit of ``params``
        return FSDP_HEAP_KEPT * unit_bytes if FP32 * params < MMAP_THRESHOLD_MAX else FP32

    return int(kept(root) * root + kept(unit) * blocks)


def optimizer_state_bytes(shape: RunShape, params: int, block_matrices: int) -> int:
    if shape.optimizer == "adam":
        return 2 * FP32 * params
    if shape.optimizer == "sgd":
        return FP32 * params if shape.momentum else 0
    # Muon: a momentum buffer per block matrix, AdamW's two moments for every other parameter
    return FP32 * block_matrices + 2 * FP32 * (params - block_matrices)


def resident_state_bytes(shape: RunShape) -> int:
    """What a run keeps on its device across steps beyond the weights and a step's own
    tensors: the optimiser's state, the weight average and the held gradients (a GPU's
    measured step has none of them)."""
    params, matrices = parameter_counts(shape.arch)
    return (optimizer_state_bytes(shape, params, matrices) + (FP32 * params if shape.ema else 0)
            + (FP32 * params if shape.holds_gradients else 0))


def _block_saved_per_token(shape: RunShape, seq_len: int) -> int:
    """Bytes one pre-LN encoder block keeps for its backward, per token (module text)."""
    arch, a = shape.arch, shape.act_bytes
    D, M, H = arch.width, arch.mlp_dim, arch.num_heads
    explicit = _explicit_attention(shape)
    kept = 2 * FP32 * D + 2 * 2 * FP32   # the residual stream into both LayerNorms (fp32), their mean and rstd
    if not shape.fast:
        kept += 2 * a * D                # both LayerNorm outputs (the fast path recomputes them)
        kept += a * M                    # the GELU output (recomputed too)
    kept += a * M                        # the first MLP layer's output
    kept += a * D                        # the heads' output, into the projection
    b = _attention_bytes(shape)
    kept += 3 * b * D                    # q, k and v (views of the projection, or the heads' copies)
    if explicit:
        kept += b * H * seq_len          # the attention probabilities, (heads, tokens, tokens) per image
    else:
        kept += FP32 * H                 # fused attention: one log-sum-exp per head
    if arch.attention_dropout and explicit:
        kept += H * seq_len              # the dropout mask (bool)
    if arch.posemb == "relative":        # the bias's einsum: the scaled query and its (heads, tokens, 2 tokens - 1)
        kept += 2 * a * D + a * H * (2 * seq_len - 1)  # logits against the offsets, and a copy of the query
    if arch.patch_dropout and arch.attn_bias != "none":
        kept += 8 * seq_len              # the kept patches' bias: its gather's int64 index, (tokens, tokens) per image
    if arch.dropout:                     # dropout masks after attention, GELU and the MLP (the
        kept += 2 * a * D + (M if shape.fast else a * M)  # fast path's GELU mask: bool)
    return kept


def _explicit_attention(shape: RunShape) -> bool:
    """Whether attention is two matmuls and a softmax that keeps its probabilities: the fast
    path's explicit form (``_fast_explicit_attention``), or torch's CPU kernel given a learned
    bias (``_math_path_attention``); else the fused kernel."""
    return _fast_explicit_attention(shape) or _math_path_attention(shape)


def _fast_explicit_attention(shape: RunShape) -> bool:
    """The fast path's attention by two matmuls: on a CPU in bf16, or in fp32 where its kernel
    choice says so."""
    return (shape.fast and not shape.on_gpu and not isinstance(shape.arch, ResNetConfig)
            and (shape.precision == "bf16" or shape.explicit_attention_fp32))


def _math_path_attention(shape: RunShape) -> bool:
    """torch's CPU attention kernel given a learned bias (the distance penalty, relative position
    embeddings): a float mask with a gradient takes its math path, which computes and keeps q, k,
    v and the probabilities in fp32 whatever the autocast (where the fast path does not attend
    explicitly)."""
    return not shape.on_gpu and _learned_attention_bias(shape.arch) and not _fast_explicit_attention(shape)


def _attention_bytes(shape: RunShape) -> int:
    """Bytes per element of the q, k and v attention keeps and of its probabilities: fp32 on the
    math path, else the activations'."""
    return FP32 if _math_path_attention(shape) else shape.act_bytes


def _learned_attention_bias(arch: Architecture) -> bool:
    return not isinstance(arch, ResNetConfig) and (arch.attn_bias != "none" or arch.posemb == "relative")


def _resnet_saved(shape: RunShape, cfg: ResNetConfig, img_size: tuple) -> tuple[int, int, int]:
    """(bytes kept per image, bytes kept per step, the largest feature map in fp32 bytes) of a
    ResNet.  Per image: each convolution's output twice (its norm's input and the activation
    the next layer reads), the max-pool's int64 indices, the input image.  Per step: a
    weight-standardised convolution's centred and standardised kernels (fp32; the second as
    autocast's cast under autocast)."""
    from vitlab.analysis.cost import resnet_layers

    a = shape.act_bytes
    per_image, kernels, largest = 3 * img_size[0] * img_size[1] * a, 0, 0
    for layer in resnet_layers(cfg, *img_size):
        elements = layer.out_h * layer.out_w * layer.cout
        if layer.kind == "pool":
            per_image += (8 + a) * elements
        else:
            per_image += 2 * a * elements
            kernels += layer.cin * layer.cout * layer.kernel**2
        largest = max(largest, elements * FP32)
    per_step = (FP32 + a) * kernels if cfg.norm == "group" else 0
    return per_image, per_step, largest


def activation_bytes(shape: RunShape) -> tuple[int, int]:
    """(bytes a forward keeps for the backward, bytes alive besides them at the step's peak)
    for one micro-batch of ``shape`` (module text)."""
    arch, B, a = shape.arch, shape.micro_batch, shape.act_bytes
    h, w = shape.img_size
    if isinstance(arch, ResNetConfig):
        kept, per_step, largest = _resnet_saved(shape, arch, (h, w))
        return B * kept + per_step, B * 3 * largest
    kept, per_step, stem_peak = 3 * h * w * a, 0, 0  # the image the patch embedding reads
    if arch.resnet is not None:              # the hybrid's stem
        stem, per_step, largest = _resnet_saved(shape, arch.resnet, (h, w))
        kept += stem
        # its backward comes last, when the encoder's tensors are gone: what it keeps and the
        # gradients of its largest feature maps
        stem_peak = B * (stem + 3 * largest) + per_step
    # the blocks' sequence: the patches patch_dropout keeps
    L, D, M, H = tokens_per_image(arch, (h, w), training=True), arch.width, arch.mlp_dim, arch.num_heads
    if arch.axial:  # each layer: a block over the rows, then one over the columns, of the patch grid
        gh, gw = (s // p for s, p in zip(arch.feature_size_of((h, w)), arch.patch_size))
        kept += arch.depth * (L * _block_saved_per_token(shape, gw) + L * _block_saved_per_token(shape, gh))
        seq = max(gh, gw)
    else:
        kept += arch.depth * L * _block_saved_per_token(shape, L)
        seq = L
    kept += FP32 * L * D                     # the last block's output, into the final LayerNorm
    if arch.classifier == "token" and not shape.half:
        kept += FP32 * L * D                 # the LayerNorm's output, whose [class] row the head reads (a view)
    if arch.dropout:                         # the mask of the dropout after the position embeddings, before any is dropped
        kept += FP32 * tokens_per_image(arch, (h, w)) * D
    if shape.mpp is not None:                # the prediction head on the corrupted patches
        outputs = {"color": 512, "color4x4": 16 * 512}.get(shape.mpp, 3 * arch.patch_size[0] * arch.patch_size[1])
        kept += int(shape.mpp_rate * L) * outputs * (a + 2 * FP32)
    # at the peak, besides the kept tensors: the gradients flowing back through the last block
    # (its MLP's widest tensors in fp32), and with explicit attention the probabilities'
    # gradient and the softmax's (the forward's logits and probabilities: one tensor less)
    transient = L * (2 * FP32 * M + 4 * FP32 * D)
    if _explicit_attention(shape):
        transient += 2 * _attention_bytes(shape) * H * seq * seq * (L // seq if arch.axial else 1)
    kept, transient = B * kept + per_step, B * transient
    return kept, max(transient, stem_peak - kept)


def stem_bytes(shape: RunShape) -> tuple[int, int]:
    """(bytes of ``activation_bytes``' kept ones that are a hybrid's ResNet stem's, the size of
    its largest feature map for the micro-batch); (0, 0) without a stem."""
    arch = shape.arch
    if isinstance(arch, ResNetConfig) or arch.resnet is None:
        return 0, 0
    per_image, per_step, largest = _resnet_saved(shape, arch.resnet, tuple(shape.img_size))
    return shape.micro_batch * per_image + per_step, shape.micro_batch * largest


def attention_probability_bytes(shape: RunShape) -> tuple[int, int]:
    """(bytes of ``activation_bytes`` that are explicit attention's (heads, tokens, tokens)
    tables, kept and at the peak; the size of one such table of the micro-batch)."""
    arch = shape.arch
    if not _explicit_attention(shape):
        return 0, 0
    a, H = _attention_bytes(shape), arch.num_heads
    L = tokens_per_image(arch, shape.img_size, training=True)
    if arch.axial:
        gh, gw = (s // p for s, p in zip(arch.feature_size_of(tuple(shape.img_size)), arch.patch_size))
        tables, kept = L // max(gh, gw) * max(gh, gw) ** 2, arch.depth * H * (gh * gw * gw + gw * gh * gh)
    else:
        tables, kept = L * L, arch.depth * H * L * L
    table = shape.micro_batch * a * H * tables
    return shape.micro_batch * a * kept + 2 * table, table


def widest_activation(shape: RunShape) -> int:
    """Bytes of the widest per-token activation of a micro-batch (an MLP's hidden layer), or a
    ResNet's largest feature map: the size of a step's typical tensor, for ``slack``."""
    arch = shape.arch
    if isinstance(arch, ResNetConfig):
        return shape.micro_batch * _resnet_saved(shape, arch, shape.img_size)[2]
    return (shape.micro_batch * tokens_per_image(arch, shape.img_size, training=True)
            * max(arch.mlp_dim, 3 * arch.width) * FP32)


def input_bytes(shape: RunShape) -> int:
    """The micro-batch: uint8, its float copy, the augmentation's intermediate and autocast's cast."""
    return shape.micro_batch * shape.image_bytes * (1 + 2 * FP32 + shape.act_bytes)


def evaluation_bytes(shape: RunShape) -> int:
    """An evaluation's working set: the float batch and its test-time views, and, one block at a
    time, its activations (the fast path's CPU inference runs a block over chunks of about 1,024
    tokens)."""
    arch, B, a = shape.arch, shape.eval_batch, shape.act_bytes
    batch = B * shape.image_bytes * (1 + evaluation_copies(shape) * FP32)
    if isinstance(arch, ResNetConfig):
        return batch + B * 3 * _resnet_saved(shape, arch, shape.img_size)[2]
    L, D, M, H = tokens_per_image(arch, shape.img_size), arch.width, arch.mlp_dim, arch.num_heads
    stem = B * 3 * _resnet_saved(shape, arch.resnet, shape.img_size)[2] if arch.resnet is not None else 0
    residual = 2 * FP32 * B * L * D          # a block's input and output
    chunked = shape.fast and not shape.on_gpu
    rows = max(L, INFERENCE_CHUNK_ROWS * FP32 // a) if chunked else B * L
    images = max(1, rows // L)
    working = rows * (3 * D + M + D) * a
    if chunked and shape.half:               # contiguous_attention: the scores, softmaxed in place
        working += images * H * L * L * a
    return batch + max(stem, residual + working)


def evaluation_copies(shape: RunShape) -> int:
    """Float copies of the evaluation batch alive at once, the final evaluation's views made
    (``vitlab.eval.features.tta_views``, all before the first is scored): the batch and a copy
    of it, one padded copy per shift size (the shifted views are views of it), and with flip a
    mirror image of every view."""
    views = 1 + shape.eval_shifts * (8 if shape.eval_diagonal else 4)
    return 2 + shape.eval_shifts + (views if shape.eval_flip else 0)


def estimate_memory(shape: RunShape) -> MemoryEstimate:
    """The peak memory of a run of ``shape`` (module text)."""
    params, matrices = parameter_counts(shape.arch)
    held = held_parameters(shape)  # this process's: all of them, or its FSDP shards
    weights = FP32 * held
    model = {"weights": weights, "optimizer": optimizer_state_bytes(shape, held, matrices * held // params),
             "weight_average": weights if shape.ema else 0,
             "held_gradients": FP32 * held if shape.holds_gradients else 0}
    kept, transient = activation_bytes(shape)
    # each kind of tensor with the allocator's slack for its size
    tables, table = attention_probability_bytes(shape)
    stem, feature_map = stem_bytes(shape)
    activations = int((kept + transient - tables - stem) * shape.slack(widest_activation(shape))
                      + tables * shape.slack(table) + stem * shape.slack(feature_map))
    gradients = FP32 * held
    # autocast keeps its cast of every weight until the backward has used it: under FSDP too, of each
    # gathered block (FSDP frees its gathered fp32 weights, not autocast's copies)
    casts = 2 * params if shape.half else 0
    # the backward frees the activations block by block as it fills the gradients: the step's
    # peak is the larger of the two ends, unless accumulated gradients are held all along
    if shape.accum_steps > 1 or gradients < activations + casts:
        step = {"gradients": gradients if shape.accum_steps > 1 else 0, "weight_casts": casts,
                "activations": activations}
    else:
        step = {"gradients": gradients}
    step["micro_batch"] = input_bytes(shape)
    if shape.sharded:
        step |= {"gathered_units": gathered_bytes(shape), "fsdp_heap": fsdp_heap_bytes(shape)}
    data = _data_bytes(shape)
    host = {"data": data, "runtime": RUNTIME_BYTES}
    decoded = shape.decoded_images * shape.image_bytes
    if shape.decoded_from_source:
        # decoding makes one small array per image, from malloc's heap, which keeps them once freed
        host["data_decoding_heap"] = decoded
    # decoded and split: the whole set, its split copies, any cached copy (the digits) and, decoded
    # from its files, the heap its per-image arrays left behind
    decoding = {"data_decoding": decoded * (1 + shape.data_copies + shape.decoded_from_source),
                "runtime": RUNTIME_BYTES}
    workers = {"stream_workers": _worker_bytes(shape)} if shape.stream_workers else {}
    evaluation = {"evaluation": evaluation_bytes(shape)}
    if shape.sharded:
        evaluation |= {"gathered_units": gathered_bytes(shape, backward=False), "fsdp_heap": fsdp_heap_bytes(shape)}
    moments = {
        "the training step": (model | step, host | workers),
        "an evaluation": (model | evaluation, host | workers),
        "decoding the data": ({}, decoding),
        "saving the weights": _saving(shape, model, step, host, FP32 * params),
    }
    if shape.sharded:  # rank 0 gathers the whole model and optimiser state into host memory to write them
        moments["writing a checkpoint"] = (model, host | {"checkpoint_gathered": FP32 * params + optimizer_state_bytes(
            shape, params, matrices)})
    totals = {at: _sides(shape, *sides) for at, sides in moments.items()}
    at = max(totals, key=lambda k: sum(totals[k]))
    device_peak = max(d for d, _ in totals.values())
    host_peak = max(h for _, h in totals.values())
    parts = {k: v for k, v in (moments[at][0] | moments[at][1]).items() if v}
    peak = sum(totals[at]) if not shape.on_gpu else device_peak + host_peak
    # the other processes' host memory, under DDP or FSDP: without what rank 0 alone gathers and writes (a
    # one-process run has none, and its check counts host_peak alone)
    others = max(_sides(shape, *({k: v for k, v in side.items() if k not in MAIN_ONLY} for side in sides))[1]
                 for sides in moments.values())
    return MemoryEstimate(peak, at, parts, host_peak, device_peak, shape, others)


def _sides(shape: RunShape, device_side: dict, host_side: dict) -> tuple[int, int]:
    """(bytes on the GPU, bytes in host memory) of a moment's parts; on a CPU all of them the host's."""
    device, host = sum(device_side.values()), sum(host_side.values())
    return (device, host) if shape.on_gpu else (0, device + host)


def _saving(shape: RunShape, model: dict, step: dict, host: dict, weights: int) -> tuple[dict, dict]:
    """(device side, host side) of the moment the final weights (``weights`` bytes) are saved:
    ``save_model`` clones the state dict and serialises it twice in memory (to checksum it);
    under FSDP rank 0 first gathers them into an unsharded copy of the model in host memory
    (``state.final_model``).  On a CPU the steps' small blocks stay in malloc's heap, and the
    clone takes its place there."""
    gathered = {"weights_gathered": weights} if shape.sharded else {}
    if shape.on_gpu:
        return model, host | gathered | {"weights_saved": 3 * weights}
    small = widest_activation(shape) < MMAP_THRESHOLD_MAX
    retained = {k: v for k, v in step.items() if k != "activations" or small}
    return model | retained, host | gathered | {"weights_saved": 2 * weights + max(0, weights - sum(retained.values()))}


def _data_bytes(shape: RunShape) -> int:
    held = (shape.train_images + shape.val_images) * shape.image_bytes * shape.data_copies
    if shape.streamed:  # the micro-batches the readers have handed over, ahead of the step
        held += 2 * max(1, shape.stream_workers) * shape.micro_batch * shape.image_bytes
        if not shape.stream_workers:  # reading in this process: its shuffle buffer too
            held += int(shape.shuffle_buffer * shape.image_bytes * ENCODED_SHARE)
    return held


def _worker_bytes(shape: RunShape) -> int:
    per_worker = (WORKER_PROCESS_BYTES + int(shape.shuffle_buffer * shape.image_bytes * ENCODED_SHARE)
                  + 2 * shape.micro_batch * shape.image_bytes)
    return shape.stream_workers * per_worker


# ----------------------------------------------------------------------------- what is available


@dataclass(frozen=True)
class Available:
    """The memory a run may take: the host's, and on a GPU the GPU's; ``processes`` running
    on this host share the host's (torchrun's LOCAL_WORLD_SIZE)."""

    host: Optional[int]
    gpu: Optional[int] = None
    processes: int = 1

    def fits(self, estimate: MemoryEstimate) -> bool:
        return self.shortfall(estimate) is None

    def shortfall(self, estimate: MemoryEstimate) -> Optional[str]:
        """None where ``estimate`` fits, else what there is, in words ("more than the ...")."""
        if estimate.shape.on_gpu and self.gpu is not None and estimate.device_peak > HEADROOM * self.gpu:
            return f"{gb(estimate.device_peak)} of it on the GPU, more than the {gb(self.gpu)} free there"
        # rank 0's and the others' (rank 0 alone saves the final weights; under FSDP gathers the checkpoints too)
        here = estimate.host_peak + estimate.each_other_host_peak * (self.processes - 1)
        if self.host is not None and here > HEADROOM * self.host:
            each = f"; {self.processes} processes on this host need {gb(here)}" if self.processes > 1 else ""
            where = f"{gb(estimate.host_peak)} of it in host memory, " if estimate.shape.on_gpu else ""
            return (f"{where}more than the {gb(self.host)} of memory available (MemAvailable, or what a cgroup "
                    f"limit leaves){each}")
        return None


def smallest_fitting_accum(shape: RunShape, batch: int, available: Available) -> Optional[int]:
    """The fewest micro-batches per step (a divisor of this process's ``batch``) whose
    micro-batch fits in ``available``: the largest micro-batch that fits; None if none does."""
    for accum in (k for k in range(1, batch + 1) if batch % k == 0):
        if available.fits(estimate_memory(shape.with_(micro_batch=batch // accum, accum_steps=accum))):
            return accum
    return None


def _largest(fits: Callable[[int], bool], low: int, high: int) -> Optional[int]:
    """The largest n in [low, high] with ``fits(n)`` (``fits`` falls as n grows); None for none."""
    if high < low or not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def smaller_size(img_size: tuple, n: int, step: int) -> tuple[int, int]:
    """An image size of ``img_size``'s shape whose shorter side is ``n`` times ``step`` px, the longer one the
    multiple of ``step`` nearest the same aspect (at most the run's): a square for a square run, and for a
    16x48 run 8x24, not the square 8x8 of its shorter side that the suggestion named."""
    h, w = img_size
    short, long = min(h, w), max(h, w)
    longer = min(long // step * step, step * max(1, round(n * long / short)))
    return (n * step, longer) if h <= w else (longer, n * step)


def fitting_settings(shape: RunShape, available: Available, size_step: int, world_size: int = 1) -> list[str]:
    """The settings, each on its own, that would make a run of ``shape`` fit: a global batch
    size at the same accumulation, the micro-batches per step at the same batch, an image
    size of the run's shape (``smaller_size``: each side a multiple of ``size_step``; the data decoded
    at it too), the evaluation's batch
    (an evaluation's peak: the training batch leaves it as it is), the streaming readers'
    processes (each holds its own shuffle buffer and interpreter)."""
    def fits(**changes) -> bool:
        return available.fits(estimate_memory(shape.with_(**changes)))

    found = []
    per_process = shape.micro_batch * shape.accum_steps
    micro = _largest(lambda m: fits(micro_batch=m), 1, shape.micro_batch - 1)
    if micro is not None:
        found.append(f"--batch-size {micro * shape.accum_steps * world_size}")
    fewest = smallest_fitting_accum(shape, per_process, available)
    if fewest is not None and fewest != shape.accum_steps:
        found.append(f"--accum-steps {fewest} (micro-batch {per_process // fewest})")
    size = _largest(lambda n: fits(img_size=smaller_size(shape.img_size, n, size_step)), 1,
                    min(shape.img_size) // size_step - (1 if min(shape.img_size) % size_step == 0 else 0))
    if size is not None:
        h, w = smaller_size(shape.img_size, size, size_step)
        found.append(f"--img-size {h}" if h == w else f"--img-size {h}x{w}")
    evaluated = _largest(lambda n: fits(eval_batch=n), 1, shape.eval_batch - 1)
    if evaluated is not None:
        found.append(f"--set run.eval_batch_size={evaluated}")
    workers = _largest(lambda n: fits(stream_workers=n), 0, shape.stream_workers - 1)
    if workers is not None:
        found.append(f"--set data.stream_workers={workers}")
    return found


def refusal(estimate: MemoryEstimate, available: Available, settings: list[str]) -> ConfigError:
    """The one-line error of a run that does not fit."""
    fits = (f"settings that fit: {', '.join(settings)}" if settings
            else "no batch size, accumulation, image size, evaluation batch or number of stream workers fits on its "
                 "own: train a smaller model or free memory")
    if any(s.startswith("--accum-steps") for s in settings):
        fits += " (--accum-steps auto picks the largest micro-batch that fits)"
    return ConfigError(f"run.memory_check: this run needs {estimate.line()}, {available.shortfall(estimate)}; {fits}; "
                       "to run anyway, --set run.memory_check=false")
