"""Every "auto" of a run decided once, before anything is built: ``resolve(cfg, world, machine)``.

    machine = this_machine()                                   # the host, read once
    world = init_world(resolve_device(cfg.run.device, machine, local_rank()))
    resolved = resolve(cfg, world, machine)                    # frozen: nothing changes it after
    resolved.config        # cfg with every "auto" stated: what the run reads and config.json records
    resolved.line()        # the run's first log line

What is decided here, and by which rule:

* the device (``run.device="auto"``: this process's GPU where there is one, else the CPU);
* the precision (``run.precision="auto"``: bf16 on a GPU that supports it; on a CPU the
  kernel rule's or the stored calibration's answer, ``vitlab.fast.cpu_precision``; bf16 only
  where every process of the run came to it, ``agreed_arithmetic``), the
  fast path's CPU kernels (``vitlab.fast.choose``), torch.compile's mode and whether the step
  after the backward is compiled too (``compiles_optimizer``); fp8 matmuls
  (``run.fp8``) are refused on a device without fp8 tensor cores (``check_fp8``);
* the model a fine-tune trains (its init's) and its resolution (``model.img_size="auto"``:
  the init's size x 384/224, ``finetune_size``);
* whether the training set streams (``data.stream="auto"``: sets stored to be streamed, and
  folders that decode to more than ``data.memory_limit_gb``), the DataLoader workers
  (``data.stream_workers="auto"``: this process's cores less one, then as many as the
  shards and the micro-batch can feed, the fewest any process came to) and the decoding
  processes (``data.decode_workers="auto"``: this process's cores);
* the micro-batch (``optim.accum_steps="auto"``: the largest that fits) and the run's peak
  memory estimate, refusing a run that cannot fit (``run.memory_check``).  On a CUDA device
  (one process) the estimate proposes and a measurement decides: a throwaway model's training
  step is run at candidate micro-batches (``memory_probe``, ``step_measurement``); on a CPU
  the estimate is the rule.

A resumed run passes its checkpoint's record (``saved``): it keeps the precision, CPU
kernels, worker count and accumulation it started with, where this machine can run them, so
that its arithmetic and its data order are the ones it started with.

The machine is read only through ``machine`` (``vitlab.machine.Machine``): tests pass a
described one.  Recipes declare what they want per kind of device (``run.on_device``); they
never probe the machine.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from vitlab import fast
from vitlab.config import Architecture, ConfigError, Pair, ResNetConfig, ViTConfig, replace
from vitlab.eval.features import shift_sizes
from vitlab.fast.fp8 import torchao_float8
from vitlab.fast.kernels import KernelChoice, why_unavailable
from vitlab.machine import Machine
from vitlab.models.registry import get_config

from .architecture import architecture
from .checkpoint import latest_checkpoint
from .config import FINETUNE_MODEL_FIELDS, DataConfig, RunConfig, TrainConfig, to_dict
from .distributed import Agreement, World, local_rank, local_world
from .inputs import HeldImages, count_images, held_images, opened_source
from .memory_estimate import (GB, Available, MemoryEstimate, RunShape, estimate_memory, fitting_settings, gb, refusal,
                              resident_state_bytes, smallest_fitting_accum)
from .memory_probe import MeasuredChoice, StepPeak, fewest_fitting_accum, step_probe
from .overrides import with_changes

log = logging.getLogger(__name__)

# The paper fine-tunes at 384 px the models it pre-trained at 224 (Sec. 3.2, Table 4)
PAPER_PRETRAIN_SIZE, PAPER_FINETUNE_SIZE = 224, 384


@dataclass(frozen=True)
class Resolved:
    """What a run's "auto" settings came to on this machine, decided once when the run is
    built and never read from the machine (or a stored calibration) again.  Its record goes
    to the run's config.json and its checkpoints; a resumed run passes that record back to
    ``resolve``, so that its arithmetic is the one it started with."""

    config: TrainConfig   # the run's config with every "auto" stated (what the run reads)
    kernels: KernelChoice | None  # the fast path's CPU kernels (None: plain model)
    bf16_matmuls: bool    # bf16 matmuls are the faster ones here (Muon's orthogonalisation)
    threads: int          # CPU threads of the process
    compile: str          # "off", or torch.compile's mode
    cpu: str              # the CPU's model name and class (what the kernel rule read)
    img_size: Pair | None = None  # (H, W) the run trains at (None: a command that trains nothing)
    micro_batch: int = 0          # images per process per micro-batch
    memory: MemoryEstimate | None = None  # the run's peak memory, estimated before anything is built
    measured: MeasuredChoice | None = None  # a GPU's auto micro-batch, chosen by measuring its step
    notes: tuple[str, ...] = ()   # what the run says about its resolution (a resumed run's)
    uncounted: str = ""           # a preview's data the memory estimate leaves out, and why

    # what the config states, by the names the record and the run's first line use
    device = property(lambda self: self.config.run.device)
    precision = property(lambda self: self.config.run.precision)  # "fp32", "bf16" or "fp16"
    data = property(lambda self: self.config.data.stream)          # "memory" or "stream"
    stream_workers = property(lambda self: self.config.data.stream_workers)  # per process, streaming
    decode_workers = property(lambda self: self.config.data.decode_workers)  # decoding into memory
    accum_steps = property(lambda self: self.config.optim.accum_steps)      # micro-batches per step
    # the step after the backward compiled (run.compile_optimizer): "off", or the model's mode ("default" if eager)
    compile_optimizer = property(lambda self: "off" if self.config.run.compile_optimizer is not True
                                 else self.compile if self.compile != "off" else "default")

    RECORDED = ("device", "precision", "kernels", "bf16_matmuls", "threads", "data", "compile", "compile_optimizer",
                "cpu", "stream_workers", "decode_workers", "accum_steps")

    def record(self) -> dict:
        return {name: (dataclasses.asdict(self.kernels) if name == "kernels" and self.kernels else
                       getattr(self, name)) for name in self.RECORDED}

    def line(self) -> str:
        kernels = self.kernels.describe() if self.kernels else "plain"
        workers = (f"{self.stream_workers} stream workers" if self.data == "stream"
                   else f"{self.decode_workers} decode workers")
        run = self.config.run
        by = f" by {run.fp8_backend}" if run.fp8_backend != "vitlab" else ""
        fp8 = f" with fp8 {run.fp8} matmuls{by}" if run.fp8 != "off" else ""
        return (f"resolved: device {self.device}, precision {self.precision}{fp8}, kernels {kernels}, "
                f"threads {self.threads}, data {self.data} ({workers}), compile {self.compile} "
                f"(optimizer step {self.compile_optimizer}), cpu {self.cpu}")


def resolve(cfg: TrainConfig, world: World, machine: Machine, saved: dict | None = None, *,
            preview: bool = False) -> Resolved:
    """Every "auto" of ``cfg`` decided for ``machine`` and the launch ``world`` (whose device
    ``resolve_device`` chose), and ``saved`` (a resumed run's ``Resolved.record()``) kept.

    A config without ``data.source`` is a command that scores rather than trains (eval,
    fewshot): its device, precision, kernels and worker counts are resolved, nothing else
    (a preview still estimates the run's memory, the data left out).
    ``preview`` (--show-config): a data source that cannot be counted is left out of the
    memory estimate, with a note in its record, and no run is refused.

    Raises ConfigError: a run that cannot fit (``run.memory_check``), a device's option (fp8
    matmuls, a GPU's attention or autotuning) asked of another device (``check_device_options``,
    a preview too), a resumed fp16 run asked
    to continue without its loss scaler or the other way round, a resumed run asked by name for
    another precision than its checkpoint's.

    The processes of a run resolve together (``distributed.Agreement``; a preview and a run of one
    process make no collective call): each reads its own host, and a refusal met by one of them
    (more threads than its cores, its data missing, its memory short) is every process's, which
    stops with that one line naming the rank and host that met it (``RankRefused``), rather than
    waiting for that process in the next agreement until the backend's timeout.
    """
    with Agreement(world, active=not preview) as agreement:
        return resolve_together(cfg, world, machine, saved or {}, preview, agreement)


def check_saved_accum(batch_size: int, accum: int, world_size: int) -> None:
    """A resumed run's accumulation ("auto", the checkpoint's count kept) slices its batch into whole
    micro-batches on this launch's processes: a run of batch 36 in 4 micro-batches of 9, resumed on 2
    processes, took micro-batches of 36 // 8 = 4 and went on at batch 32 without a word, its positions
    in the data those of another batch."""
    if batch_size % (accum * world_size):
        divisors = [n for n in range(1, batch_size // accum + 1) if (batch_size // accum) % n == 0]
        raise ConfigError(f"--resume: optim.accum_steps=auto keeps the checkpoint's {accum} micro-batches a step, and "
                          f"optim.batch_size={batch_size} does not divide into {accum} x world_size={world_size} = "
                          f"{accum * world_size} equal micro-batches; resume on {', '.join(map(str, divisors[:-1]))}"
                          f"{' or ' if len(divisors) > 1 else ''}{divisors[-1]} process(es)")


def resolve_together(cfg: TrainConfig, world: World, machine: Machine, saved: dict, preview: bool,
                     agreement: Agreement) -> Resolved:
    """``resolve``'s work, its collective calls made through ``agreement``."""
    device = world.device
    precision, kernels, bf16_matmuls, notes = arithmetic(cfg, device, machine, saved)
    threads = thread_count(cfg.run.threads, machine.cores)
    cores = max(1, machine.cores // world.processes_here)  # this process's share of the host's cores
    decode = {"data.decode_workers": cores if cfg.data.decode_workers == "auto" else cfg.data.decode_workers}
    changes = dict(cfg.run.on_device.get(device.type, {}))  # the recipe's settings for this kind of device
    check_device_options(cfg, device, machine)
    # a resumed run's are its checkpoint's, every process's alike, but a checkpoint written before the
    # precision or bf16_matmuls was recorded leaves each process its own host's: agreed as afresh
    precision, bf16_matmuls, notes = agreed_arithmetic(cfg, precision, bf16_matmuls, notes, agreement)
    cfg = with_changes(cfg, changes | decode | recorded_paths(cfg) | {"run.device": str(device),
                                                                  "run.precision": precision})
    if cfg.data.source is None and not preview:  # a command that scores a model: its data in memory
        cfg = with_changes(cfg, {"data.stream": "memory", "data.stream_workers": 0, "run.compile_optimizer": False})
        return Resolved(cfg, kernels, bf16_matmuls, threads, "off", machine.cpu_line(), notes=notes)

    cfg = with_changes(cfg, model_changes(cfg))
    check_optimizer_fits_model(cfg)
    img_size = training_size(cfg)
    if cfg.optim.accum_steps == "auto" and "accum_steps" in saved:  # before the workers its micro-batch bounds
        check_saved_accum(cfg.optim.batch_size, saved["accum_steps"], world.size)
        cfg = with_changes(cfg, {"optim.accum_steps": saved["accum_steps"]})
    cfg, held, uncounted = data_decisions(cfg, world, cores, img_size, saved, preview, agreement)
    mode = compile_mode(cfg, world)
    cfg = with_changes(cfg, {"run.compile_optimizer": compiles_optimizer(cfg, mode)})
    resolved = Resolved(cfg, kernels, bf16_matmuls, threads, mode, machine.cpu_line(),
                        img_size=img_size, notes=notes, uncounted=uncounted)
    available = machine_memory(machine, resolved.device, world)
    available = least_available(available, agreement)
    with step_measurement(resolved, world) as step_peak:  # None: the estimate decides
        if step_peak is not None and available.gpu is None:  # a card whose free memory was not read
            available = dataclasses.replace(available, gpu=int(torch.cuda.mem_get_info(world.device)[0]))
        accum, memory, measured = plan_memory(cfg, run_shape(resolved, world.size, held), available, world.size,
                                              check=cfg.run.memory_check and not preview, step_peak=step_peak)
    if measured is not None:
        notes += (measured_line(measured),)
    if cfg.optim.accum_steps == "auto":
        accum, memory = most_micro_batches(accum, memory, cfg.optim.batch_size // world.size, agreement)
    micro_batch = cfg.optim.batch_size // (accum * world.size)
    cfg = with_changes(cfg, {"optim.accum_steps": accum})
    if resolved.data == "stream":
        workers = agreed_stream_workers(cfg, world, cores, saved, micro_batch, agreement)
        if workers != cfg.data.stream_workers:  # planned with more (the more memory): estimated again
            cfg = with_changes(cfg, {"data.stream_workers": workers})
            memory = estimate_memory(memory.shape.with_(stream_workers=workers))
    return dataclasses.replace(resolved, config=cfg, memory=memory, measured=measured, micro_batch=micro_batch,
                               notes=notes)


def data_decisions(cfg: TrainConfig, world: World, cores: int, img_size: Pair, saved: dict,
                   preview: bool, agreement: Agreement) -> tuple[TrainConfig, HeldImages, str]:
    """(``cfg`` with memory or stream and the DataLoader workers decided, the images the run
    holds in memory, why a preview could not count them or "").  Reads the data's index, never
    an image."""
    if cfg.data.source is None:  # a preview of a run whose data is not named yet
        return with_changes(cfg, {"data.stream": "memory", "data.stream_workers": 0}), HeldImages(0, 0, 0, 1), \
            "not counted: no data.source"
    try:
        streamed = streams(cfg, img_size)
        if streamed and cfg.data.augment_batches > 1:
            raise ConfigError(f"data.augment_batches={cfg.data.augment_batches}: groups batches of data held in "
                              "memory, and this run streams its data (data.stream); set data.augment_batches=1 "
                              "or data.stream=memory")
        unread = unread_data_settings(cfg, streamed)
        if unread:
            raise ConfigError(unread)
        changes = {"data.stream": "stream" if streamed else "memory"}
        if streamed:  # agreed before the memory is planned with them: each holds an interpreter
            changes["data.stream_workers"] = fewest_workers(stream_workers(cfg, world, cores, saved), agreement)
        elif cfg.data.stream_workers == "auto":
            changes["data.stream_workers"] = 0  # nothing streams: no DataLoader workers
        cfg = with_changes(cfg, changes)
        return cfg, held_images(cfg, streamed, img_size), ""
    except (ConfigError, OSError, ValueError) as err:  # DataError is a ValueError
        if not preview:
            raise
        cfg = with_changes(cfg, {"data.stream": "memory", "data.stream_workers": 0})
        return cfg, HeldImages(0, 0, 0, 1), f"not counted: {err}"


def preview(cfg: TrainConfig, machine: Machine | None = None) -> dict:
    """What --show-config prints: ``cfg`` as its run would state it (every "auto" resolved for
    this machine), the resolution's record and the memory estimate, as one JSON-ready dict;
    no process group joined, no data decoded, no model built.  An init that is not here yet (a Hub
    name, read as the run starts) leaves the config as given and the estimate out; weights here that
    cannot be read are refused, as the run refuses them (a text file named x.safetensors had been
    left out of the estimate alone, and the config shown as one that would run), and so is an init that is
    no file or folder here nor a Hub name (a mistyped path had been shown as a config that would run)."""
    check_init_shown(cfg)
    machine = machine or this_machine()
    world = local_world(resolve_device(cfg.run.device, machine, local_rank()))
    check_device_options(cfg, world.device, machine)  # refused as the run would be, not left out of the estimate below
    try:
        resolved = resolve(cfg, world, machine, preview=True)
    except (OSError, ValueError) as err:  # an init not here (FileNotFoundError), read as the run starts
        return to_dict(cfg) | {"memory_estimate": {"not_estimated": str(err)}}
    return to_dict(resolved.config) | {"resolved": resolved.record(),
                                       "memory_estimate": memory_record(resolved, machine, world)}


def check_init_shown(cfg: TrainConfig) -> None:
    """Refuse, for a --show-config (train's, finetune's, sweep's), the ``model.init`` its run refuses: weights here
    that cannot be read (``WeightsError``) and an init that is no file or folder here nor a Hub name (the run's
    line, ``check_init_named``); a Hub name is read as the run starts."""
    if cfg.model.init is not None and Path(cfg.model.init).expanduser().exists():
        init_architecture(cfg)
    elif cfg.model.init is not None:
        check_init_named(cfg.model.init, held_checkpoints=latest_checkpoint(Path(cfg.run.out) / "checkpoints")
                         is not None)


def resolve_scoring(device: str = "auto", fast_path: bool = True, machine: Machine | None = None) -> Resolved:
    """How a command that scores a model (eval, fewshot) runs: its device, CPU kernels and
    decoding processes, resolved as a run's are (in fp32)."""
    machine = machine or this_machine()
    world = local_world(resolve_device(device, machine, local_rank(), field="--device"))
    return resolve(TrainConfig(run=RunConfig(device=device, fast=fast_path)), world, machine)


def thread_count(asked: int, cores: int, name: str = "run.threads") -> int:
    """The CPU threads a process that may use ``cores`` cores runs in, ``asked`` (``name``: run.threads, or a
    command's flag) or, for 0, PyTorch's default at most the cores: the one rule of a run and of what
    ``vitlab calibrate`` times.  ``ConfigError`` for fewer than 0 or more than the cores: far above them,
    OpenMP's thread pool crashes the process (a segfault)."""
    if not 0 <= asked <= cores:
        raise ConfigError(f"{name}={asked}: this process may use {cores} core(s) here; give 1 to {cores}, "
                          "or 0 for PyTorch's default (at most those)")
    # PyTorch's default counts the affinity mask, not a container's CPU quota: 64 threads time-sliced on the
    # 2 CPUs a quota allows wait on one another at every parallel region
    return asked or min(torch.get_num_threads(), cores)


@contextmanager
def resolved_threads(resolved: Resolved) -> Iterator[None]:
    """The block run in ``resolved.threads`` CPU threads, as a run's steps are, and the caller's
    count given back after it: what a command that scores a model (eval, fewshot, predict, vtab's
    test sets) runs its forward passes in.  PyTorch's own count counts no container's CPU quota."""
    caller = torch.get_num_threads()
    torch.set_num_threads(resolved.threads)
    try:
        yield
    finally:
        torch.set_num_threads(caller)


# ----------------------------------------------------------------------------- the device and its arithmetic


def this_machine() -> Machine:
    """This host as this process sees it (``Machine.here``), the free memory read of its own GPU
    alone, torchrun's ``LOCAL_RANK``'s, whose device ``resolve_device`` gives it: what a run, its
    preview and a command that scores resolve for, so that none reads another's card (opening a CUDA
    context there) and estimates without its own."""
    return Machine.here(gpu_index=local_rank())


def resolve_device(name: str, machine: Machine, local_rank: int = 0, field: str = "run.device") -> torch.device:
    """``run.device`` (or ``--device``, named ``field`` in errors) as a device: "auto" is this
    process's GPU (``local_rank``) where the machine has one, else the CPU; "cuda" is this
    process's GPU.  A device the machine does not have is refused (ConfigError), and so is a process
    whose GPU it lacks: torchrun's second process of two on a host of one GPU took cuda:1 under
    "auto", and failed with CUDA's traceback ("invalid device ordinal")."""
    if name == "auto" and not machine.gpus:
        return torch.device("cpu")
    try:
        device = torch.device("cuda" if name == "auto" else name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigError(f"{field}={name!r}: expected auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and device.index is None:
        device = torch.device(f"cuda:{local_rank}")
        if machine.gpus and local_rank >= len(machine.gpus):
            count = len(machine.gpus)
            raise ConfigError(f"{field}={name!r}: this process's GPU is cuda:{local_rank} (LOCAL_RANK={local_rank}), "
                              f"and this machine has {count} GPU(s); launch at most {count} process(es) on it "
                              f"(torchrun --nproc_per_node={count}), or use cpu")
    if device.type == "cuda" and device.index >= len(machine.gpus):
        if machine.gpus:
            why = f"this machine has {len(machine.gpus)} GPU(s): cuda:0 to cuda:{len(machine.gpus) - 1}"
        else:
            build = "" if torch.backends.cuda.is_built() else ", a build without CUDA"
            why = f"no CUDA GPU here (torch {torch.__version__}{build})"
        raise ConfigError(f"{field}={name!r}: {why}; use cpu, or auto for a GPU where there is one")
    return device


def precision_rule(device: torch.device, machine: Machine) -> str:
    """What ``precision="auto"`` means on ``device``: bf16 on a GPU that supports it, on a CPU
    the kernel rule's or the stored calibration's answer; fp32 anywhere else."""
    if device.type == "cuda":
        gpu = machine.gpu(device)
        return "bf16" if gpu is not None and gpu.bf16 else "fp32"
    return fast.cpu_precision(machine.cpu) if device.type == "cpu" else "fp32"


def on_this_device(cfg: TrainConfig, device: torch.device, name: str):
    """The run field ``run.<name>`` as a run on ``device`` takes it: the recipe's setting for this
    kind of device (``run.on_device``), else the config's."""
    return cfg.run.on_device.get(device.type, {}).get(f"run.{name}", getattr(cfg.run, name))


def check_device_options(cfg: TrainConfig, device: torch.device, machine: Machine) -> None:
    """Refuse a run field that only some devices take, asked of a run that resolves to another
    (``check_fp8``, ``check_gpu_attention``, ``check_autotune``; ConfigError)."""
    check_fp8(cfg, device, machine)
    check_gpu_attention(cfg, device)
    check_autotune(cfg, device)


def check_gpu_attention(cfg: TrainConfig, device: torch.device) -> None:
    """Refuse a GPU attention backend (``run.gpu_attention`` other than "torch", the recipe's setting
    for this kind of device included) for a run that resolves to another device (ConfigError)."""
    choice = on_this_device(cfg, device, "gpu_attention")
    if choice != "torch" and device.type != "cuda":
        raise ConfigError(f"run.gpu_attention={choice!r} chooses among a CUDA GPU's attention kernels; this run "
                          f"resolves to {device}: set run.gpu_attention='torch'")


def check_autotune(cfg: TrainConfig, device: torch.device) -> None:
    """Refuse ``run.compile_autotune`` (the recipe's setting for this kind of device included) for
    a run that is not compiled, or that resolves to a device other than a CUDA GPU, where inductor
    would tune C++ templates instead, untried here (ConfigError)."""
    if not on_this_device(cfg, device, "compile_autotune"):
        return
    if device.type != "cuda":
        raise ConfigError(f"run.compile_autotune=True tunes a CUDA GPU's Triton matmul templates; this run resolves "
                          f"to {device}: set run.compile_autotune=false")
    if not on_this_device(cfg, device, "compile"):
        raise ConfigError("run.compile_autotune=True is a mode of torch.compile, and this run is not compiled: add "
                          "--compile (run.compile=true), or set run.compile_autotune=false")


def check_fp8(cfg: TrainConfig, device: torch.device, machine: Machine) -> None:
    """Refuse ``run.fp8`` (other than "off", the recipe's setting for this kind of device
    included) on a device without fp8 tensor cores: a CPU, where ``torch._scaled_mm`` only
    emulates them, or a GPU of compute capability below 8.9, where it fails (ConfigError, one
    line naming the field, what it needs and what the run resolves to)."""
    fp8 = on_this_device(cfg, device, "fp8")
    if fp8 == "off":
        return
    gpu = machine.gpu(device)
    if gpu is not None and gpu.fp8:
        if on_this_device(cfg, device, "fp8_backend") == "torchao":  # missing: refused before anything is built
            torchao_float8()
        return
    if gpu is not None:
        here = f"{device}, {gpu.capability_line()}"
    else:
        here = str(device) if device.type != "cuda" else f"{device}, a GPU this machine lacks"
    raise ConfigError(f"run.fp8={fp8!r} needs a CUDA GPU of compute capability 8.9 or higher (H100, H200, L4, "
                      f"RTX 40); this run resolves to {here}: set run.fp8='off' (--fp8 off) to train in bf16")


def arithmetic(cfg: TrainConfig, device: torch.device, machine: Machine, saved: dict
               ) -> tuple[str, KernelChoice | None, bool, tuple[str, ...]]:
    """(precision, the fast path's CPU kernels, whether bf16 matmuls are the faster ones, what a
    resumed run says): ``precision_rule`` for "auto", ``fast.choose`` for the kernels; a resumed
    run keeps its checkpoint's (a calibration stored since, or another machine's rule, would
    change its arithmetic), where they can run here."""
    rule = precision_rule(device, machine)
    precision = rule if cfg.run.precision == "auto" else cfg.run.precision
    kernels = (fast.choose(info=machine.cpu) if device.type == "cpu" else KernelChoice()) if cfg.run.fast else None
    if not saved:
        return precision, kernels, rule == "bf16", ()
    before, notes = saved.get("precision", precision), []
    if before != precision and "fp16" in (before, precision):  # the loss scaler's state cannot follow
        raise ConfigError(f"--resume: the checkpoint's run trained in {before}, this one resolves to {precision}; "
                          f"set --precision {before}")
    # a resumed run keeps the checkpoint's arithmetic: a precision asked by name was dropped without a word
    if cfg.run.precision != "auto" and before != cfg.run.precision:
        raise ConfigError(f"--resume: run.precision={cfg.run.precision!r} (checkpoint: {before!r}): a resumed run keeps "
                          f"the arithmetic it started with; set --precision {before} (or auto)")
    if saved.get("kernels") and kernels is not None:
        stored = KernelChoice(**saved["kernels"])
        reason = why_unavailable(stored, machine.cpu)
        if reason is None:
            kernels = stored
        elif stored != kernels:
            notes.append(f"--resume: the checkpoint's kernels cannot run here ({reason}); continuing with "
                         f"{kernels.describe()}")
    return before, kernels, saved.get("bf16_matmuls", rule == "bf16"), tuple(notes)


def agreed_arithmetic(cfg: TrainConfig, precision: str, bf16_matmuls: bool, notes: tuple[str, ...],
                      agreement: Agreement) -> tuple[str, bool, tuple[str, ...]]:
    """(precision, bf16 matmuls, notes) as every process of the run takes them (a collective call
    through ``agreement``; as given without one): each decides them from its own host's CPU, GPU and
    stored calibration.  ``run.precision="auto"`` is bf16 only where every process came to it (a
    host whose CPU emulates bf16 would set the pace of all, and config.json states one precision),
    and Muon orthogonalises in bf16 only where every process would: each process updates its
    own replica, and replicas orthogonalised in other precisions drift apart.  A resumed run's
    (its checkpoint's) are every process's alike, and agreed all the same where its checkpoint
    lacks them (one written before they were recorded), as a run's afresh are."""
    if not agreement.active:
        return precision, bf16_matmuls, notes
    auto = cfg.run.precision == "auto"
    in_bf16, matmuls = agreement.least([float(auto and precision == "bf16"), float(bf16_matmuls)])
    if auto and precision == "bf16" and not in_bf16:
        notes += ("run.precision=auto: fp32, as another process of the run came to (this one came to bf16)",)
        precision = "fp32"
    return precision, bf16_matmuls and bool(matmuls), notes


# torch.compile's modes that replay CUDA graphs ("max-autotune": with its matmul templates tuned)
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_mode(cfg: TrainConfig, world: World) -> str:
    """torch.compile's mode: on one GPU, CUDA graphs replay the step without the host launching
    each kernel (a progressive-resizing run records one graph per size: the model compiles
    again, for a fixed shape, at each change); a run that spans processes keeps the default
    mode.  ``run.compile_autotune`` (a GPU's, ``check_autotune``) asks each of the two in its
    max-autotune form."""
    if not cfg.run.compile:
        return "off"
    graphs = world.device.type == "cuda" and world.size == 1
    if cfg.run.compile_autotune:
        return "max-autotune" if graphs else "max-autotune-no-cudagraphs"
    return "reduce-overhead" if graphs else "default"


def compiles_optimizer(cfg: TrainConfig, mode: str) -> bool:
    """``run.compile_optimizer``: "auto" compiles the step after the backward (clipping, the
    optimiser, the EMA) exactly where the model is CUDA-graphed (``mode`` in
    ``CUDA_GRAPH_MODES``): there the host's launches of the eager update are what is left to
    save; never under fp16, whose gradient scaler works on the host around the step."""
    if cfg.run.compile_optimizer != "auto":
        return cfg.run.compile_optimizer
    return mode in CUDA_GRAPH_MODES and cfg.run.precision != "fp16"


# ----------------------------------------------------------------------------- the model and its size


def finetune_size(init_size: int, step: int) -> int:
    """The resolution of a fine-tune whose ``model.img_size`` is "auto", from an init trained at
    ``init_size``: the init's size times 384/224, as the paper goes from its 224-px pre-training
    to 384, at most 384 and never below the init's own, to the nearest multiple of ``step``
    (what the model cuts into patches: the patch size, times a hybrid's stem reduction).
    224 -> 384; 32 -> 48 (16-px patches); 16 -> 28 (4-px patches); 384 and up: its own."""
    scaled = min(PAPER_FINETUNE_SIZE, init_size * PAPER_FINETUNE_SIZE / PAPER_PRETRAIN_SIZE)
    return max(init_size, step * max(1, round(scaled / step)))


def size_step(arch: Architecture) -> int:
    """The multiple of pixels a model's input side must be: its patch size (times a hybrid's
    stem reduction); a ResNet's total stride."""
    if isinstance(arch, ResNetConfig):
        return arch.reduction
    return arch.patch_size[0] * (arch.resnet.reduction if arch.resnet is not None else 1)


def load_init(load: Callable[..., Any], init: str, name: str, **kw: Any) -> Any:
    """``load(init, **kw)`` (``load_model`` or ``load_config``) of a fine-tune's init, which is the model it
    is: ``name`` (``model.name``, the recipe's unless named) only gives the heads to weights that record
    them nowhere.  Always passed, it was held against the init as the model the weights must be: with the
    recipe's default, ``finetune --init ViT-L_16.npz`` was refused as 'not a ViT-B/16'.  A name given on the
    command line is checked by ``check_named_init``."""
    from vitlab.weights import HeadsUnknownError

    try:
        return load(init, **kw)
    except HeadsUnknownError:
        return load(init, name=name, **kw)


@functools.lru_cache(maxsize=4)
def _init_architecture(init: str, name: str, identity: str, weights_img_size: Pair | int | None) -> Architecture:
    from vitlab.weights import load_config

    return load_init(load_config, init, name, weights_img_size=weights_img_size)


def init_architecture(cfg: TrainConfig) -> Architecture:
    """The architecture of ``model.init`` (at its own size, with its own head), read once per process
    and file: by the path a run records (``recorded_init``) and the file's size and time, so that
    weights written since at that path are read again (cached by path alone, a fine-tune from new
    weights at 16 px trained at the 8 px of the earlier ones, its model built for them).  Read at
    ``model.weights_img_size`` where given, as the run loads it."""
    from vitlab.eval.features import file_key

    init = recorded_init(cfg.model.init)
    return _init_architecture(init, cfg.model.name, file_key(init), cfg.model.weights_img_size)


def init_model_name(cfg: TrainConfig) -> str | None:
    """The registry name of ``model.init``'s model, read from the file or folder: what a recipe
    whose rates are per model (Table 3) takes its row by when no model is named.  None: an
    architecture of no registry name, an init that is no file here (a Hub name, read as the run
    starts), or one that cannot be read (refused where the run reads it)."""
    from vitlab.weights import WeightsError

    if cfg.model.init is None or not Path(cfg.model.init).expanduser().exists():
        return None
    try:
        name = getattr(init_architecture(cfg), "name", None)
        get_config(name)  # a name of the registry (not the demo's ViT-demo/4)
        return name
    except (ConfigError, WeightsError):
        return None


def check_optimizer_fits_model(cfg: TrainConfig) -> None:
    """Refuse Muon (``optim.optimizer="muon"``) for a model without Transformer blocks: it orthogonalises the
    blocks' dense layers (``optim.block_matrices``) and leaves the rest to AdamW, and a BiT ResNet has no
    blocks, so its run was AdamW's throughout, recorded as Muon's (ConfigError)."""
    if cfg.optim.optimizer != "muon":
        return  # no init read for any other optimiser
    arch = trained_architecture(cfg)
    if isinstance(arch, ResNetConfig):
        raise ConfigError(f"optim.optimizer='muon': Muon orthogonalises the dense layers of a ViT's Transformer "
                          f"blocks, and {arch.name or cfg.model.name} is a BiT ResNet, which has none (every "
                          "parameter would train with AdamW); use 'adam' or 'sgd'")


def check_init_named(init: str, held_checkpoints: bool = False) -> None:
    """Refuse an init that is no file or folder: a name of the registry's form is a model, not weights
    (ViT-B/17, mistyped, was "no such file or folder" where load_model and export name the model it
    resembles; ViT-B/16 the same, with no word that a model name trains no pre-trained weights); a
    Hugging Face Hub name (org/name) is looked up when the weights are loaded.  ``held_checkpoints``: the
    run's folder holds a run's checkpoints, whose --resume needs the init all the same (said so: the
    checkpoint holds the weights, and the refusal read as a mistake)."""
    from vitlab.models.registry import canonical_name, has_name_form, list_models, unknown_model
    from vitlab.weights.hub import not_looked_up, parse_hub_name

    if has_name_form(init):
        if canonical_name(init) not in list_models():
            raise ConfigError(f"model.init={init!r}: no such file or folder, and {unknown_model(init)}")
        raise ConfigError(f"model.init={init!r}: names a model of the registry, not weights, and is no file or "
                          "folder; a fine-tune starts from weights (a file or folder, such as a run's "
                          "model.safetensors, or a Hugging Face Hub name org/name); to train "
                          f"{canonical_name(init)} from scratch, name it as the model, without an init "
                          f"(vitlab train --model {canonical_name(init)})")
    if parse_hub_name(init) is None:
        # the model is built as the init's (its architecture, resolution and head resolved from it, its weights
        # adapted) before a checkpoint's weights are loaded into it
        resuming = ("; --resume of the run whose checkpoints run.out holds needs its init all the same: the model "
                    "is built from the init (its architecture, resolution and head) before the checkpoint's weights "
                    "are loaded into it; put the init back at this path") if held_checkpoints else ""
        raise ConfigError(f"model.init={init!r}: no such file or folder{not_looked_up(init)}{resuming}")


def check_named_init(cfg: TrainConfig, name: str) -> None:
    """A model named with the init (``--model``) is the init's: a fine-tune trains its init's
    architecture, so another name was dropped without a word, while a recipe whose rates are per
    model (Table 3) had taken the named model's."""
    from vitlab.weights import WeightsError
    from vitlab.weights.core import check_named

    if not Path(cfg.model.init).expanduser().exists():  # a Hub name, or missing: named as the run starts
        return
    arch = init_architecture(cfg)
    if getattr(arch, "name", None) == name:
        return
    # the check a load makes of a name: a BiT's units and width (every BiT name passed for any BiT init), a
    # hybrid's stem without its img_size (R50+ViT-B/16 was refused for its own model at 384 px)
    try:
        check_named(name, arch)
        return
    except (ConfigError, WeightsError):  # not a registry name (only the init's own is the model), or another
        pass
    raise ConfigError(f"model.name={name!r}: model.init={cfg.model.init!r} holds "
                      f"{repr(arch.name) if getattr(arch, 'name', None) else 'a model of another shape'}; a "
                      "fine-tune trains its init's architecture: leave --model out, or name that one")


def training_size(cfg: TrainConfig) -> Pair:
    """(H, W) the run trains at: ``model.img_size``; None or "auto" from scratch: the model's;
    a fine-tune's None: its checkpoint's; a fine-tune's "auto": ``finetune_size`` of its
    checkpoint's (a non-square one keeps its own)."""
    size = cfg.model.img_size
    if size not in (None, "auto"):  # N or (H, W)
        return (size, size) if isinstance(size, int) else tuple(size)
    if cfg.model.init is None:
        return tuple(architecture(cfg).img_size)
    arch = init_architecture(cfg)
    h, w = arch.img_size
    if size is None or h != w:
        return (h, w)
    side = finetune_size(h, size_step(arch))
    return (side, side)


def model_changes(cfg: TrainConfig) -> dict:
    """What the model section leaves to the init or to "auto", stated: a fine-tune's
    ``model.name`` is its init's model (the architecture is the checkpoint's, whatever the
    recipe names; None where the init's has no name) and its ``model.overrides`` the
    regularisation it applies, and ``model.img_size="auto"`` the resolution it comes to.
    (A nameless init had been recorded as the recipe's model, with the recipe's architecture
    overrides: a model that was not trained.)"""
    changes = {}
    if cfg.model.init is not None:
        name = getattr(init_architecture(cfg), "name", None)
        applied = {k: v for k, v in cfg.model.overrides.items() if k in FINETUNE_MODEL_FIELDS}
        if name != cfg.model.name or applied != cfg.model.overrides:
            changes |= {"model.name": name, "model.overrides": applied}
    if cfg.model.img_size == "auto":
        h, w = training_size(cfg)
        changes["model.img_size"] = h if h == w else None
    return changes


def stated_model(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with its model section stated as a run would (``model_changes``) and its data's
    paths as a run records them (``recorded_paths``), nothing else resolved: how an experiment
    compares what it asks with what a finished run recorded."""
    changes = model_changes(cfg) | recorded_paths(cfg)
    return with_changes(cfg, changes) if changes else cfg


def recorded_paths(cfg: TrainConfig) -> dict:
    """``data.source``, ``data.val_data`` and ``model.init`` absolute (``vitlab.data.labelled.absolute_source``)
    where they are relative: the run's config.json and checkpoints record where its data and its init
    are, which an eval, fewshot or --resume run from another working folder reads (and ``same_data``
    matches to the user's spelling of it; an init recorded as typed could be named from no other folder:
    spelt from there it differed, spelt as recorded it was no file).  An init that is no file or folder
    (a Hugging Face Hub name) is recorded as given."""
    from vitlab.data.labelled import absolute_source

    changes = {f"data.{name}": absolute_source(value) for name in ("source", "val_data")
               if absolute_source(value := getattr(cfg.data, name)) != value}
    if (init := recorded_init(cfg.model.init)) != cfg.model.init:
        changes["model.init"] = init
    return changes


def recorded_init(init: str | None) -> str | None:
    """``model.init`` as a run records it: a file or folder by its absolute path, anything else as given."""
    from vitlab.data.labelled import absolute_source

    return absolute_source(init) if init is not None and Path(init).expanduser().exists() else init


def trained_architecture(cfg: TrainConfig, num_classes: int | None = None) -> Architecture:
    """The architecture the run trains, from the config alone (a fine-tune: its init's, with
    the run's regularisation), as ``vitlab.train.build.make_model`` builds it.

    num_classes: the run's class count: a fine-tune's init gets a new head of that many and no
        pre-logits layer unless ``model.keep_pre_logits`` (Sec. 3.2).  None keeps the init's head,
        which a memory estimate need not follow (nor the size: ``RunShape`` carries the training size)."""
    if cfg.model.init is None:
        return architecture(cfg, num_classes=num_classes)
    arch = init_architecture(cfg)
    regularisation = {k: v for k, v in cfg.model.overrides.items() if k in FINETUNE_MODEL_FIELDS}
    if regularisation and isinstance(arch, ViTConfig):
        arch = replace(arch, **regularisation)
    if num_classes is None:
        return arch
    arch = replace(arch, num_classes=num_classes)
    return arch if cfg.model.keep_pre_logits or not isinstance(arch, ViTConfig) else replace(arch, representation_size=None)


# ----------------------------------------------------------------------------- the data


def streams(cfg: TrainConfig, image_size: Pair) -> bool:
    """Whether the run streams its training set (``data.stream``; "auto": sets stored to be
    streamed, and folders whose decoded size exceeds ``data.memory_limit_gb``)."""
    from vitlab.data.stream import is_stream_source

    data = cfg.data
    if data.source == "digits":
        if data.stream == "stream":
            raise ConfigError("data.stream='stream': the built-in digits source is in memory only; use 'auto'")
        return False
    if data.stream != "auto":
        return data.stream == "stream"
    if is_stream_source(data.source):
        return True
    return count_images(data.source, data.cache_dir) * 3 * image_size[0] * image_size[1] > data.memory_limit_gb * 1e9


def unread_data_settings(cfg: TrainConfig, streamed: bool) -> str:
    """Why a data setting changed from its default is read nowhere by this run, or "": the
    streaming readers' settings (a number of stream workers too) on a run that holds its data in
    memory, and data.memory_limit_gb where it neither decides "auto" nor bounds a streamed set's
    held-out shards (data.val_split); they were accepted and did nothing.  The defaults are
    allowed: the fields are always there."""
    data, defaults = cfg.data, DataConfig()
    if not streamed:
        for name in ("shuffle_buffer", "draft"):
            value, default = getattr(data, name), getattr(defaults, name)
            if value != default:
                return (f"data.{name}={value!r}: read by a streamed training set's readers, and this run holds its "
                        f"data in memory (data.stream={data.stream!r}); leave it at {default!r}")
        # "auto" and 0 are what an in-memory run's config.json records (no DataLoader workers)
        if data.stream_workers not in ("auto", 0):
            return (f"data.stream_workers={data.stream_workers!r}: read by a streamed training set's readers, and this "
                    f"run holds its data in memory (data.stream={data.stream!r}); leave it at 'auto' or 0")
    limit, default = data.memory_limit_gb, defaults.memory_limit_gb
    if limit != default and data.stream != "auto" and not (streamed and data.val_split):
        return (f"data.memory_limit_gb={limit!r}: decides data.stream='auto' and bounds a streamed set's held-out "
                f"shards (data.val_split), and this run has data.stream={data.stream!r}"
                f"{'' if streamed else ' (in memory)'} without them; leave it at {default!r}")
    return ""


def stream_workers(cfg: TrainConfig, world: World, cores: int, saved: dict, micro_batch: int | None = None) -> int:
    """DataLoader workers per process for a streamed training set: as asked ("auto": this
    process's cores less one; a resumed run's own count, which its data order depends on),
    then as many as the training shards and the micro-batch can feed (``data.stream.fitting_workers``,
    the rule ``StreamLoader`` holds its workers to).  ``micro_batch``: None, the config's (with
    ``optim.accum_steps`` "auto", the whole batch: the most workers the run can have)."""
    from vitlab.data.stream import fitting_workers, hold_out

    data = cfg.data
    if data.stream_workers != "auto":
        asked = data.stream_workers
    else:
        asked = saved.get("stream_workers", cores - 1)
    source = opened_source(data.source, data.cache_dir)
    if data.val_split:
        source, _ = hold_out(source, data.val_split, data.split_seed)
    if micro_batch is None:
        accum = 1 if cfg.optim.accum_steps == "auto" else cfg.optim.accum_steps
        micro_batch = cfg.optim.batch_size // (accum * world.size)
    count, why_fewer = fitting_workers(source, asked, world.size, max(1, micro_batch))
    if why_fewer:
        log.warning("%s", why_fewer)
    return count


def fewest_workers(workers: int, agreement: Agreement) -> int:
    """The fewest DataLoader workers per process any process of the run came to (a collective
    call through ``agreement``; ``workers`` without one, and in a preview): reader w of rank k takes the
    shards' order from k x workers + w, every world size x workers, so processes that counted other
    cores (hosts of other sizes, other CPU quotas) read some shards twice and others never.  Taken
    before the memory is planned: a process planned with more workers than the run reads with was
    refused where the others were not, and they waited for it here."""
    least = int(agreement.least([float(workers)])[0])
    if least < workers:
        log.warning("data.stream_workers: %d DataLoader worker(s) per process, as another process of the run "
                    "came to (this one came to %d): every process reads the shards with one count", least, workers)
    return least


def agreed_stream_workers(cfg: TrainConfig, world: World, cores: int, saved: dict, micro_batch: int,
                          agreement: Agreement) -> int:
    """The DataLoader workers per process of a streamed run once its micro-batch is decided: no
    more than it feeds (``stream_workers``; they were planned with a micro-batch of the whole batch
    where ``optim.accum_steps`` was "auto", and the loader holds them to the micro-batch), and the
    fewest any process of the run came to (``fewest_workers``, again)."""
    workers = cfg.data.stream_workers
    if workers > micro_batch:  # each reader makes a part of every micro-batch
        workers = stream_workers(cfg, world, cores, saved, micro_batch)
    return fewest_workers(workers, agreement)


# ----------------------------------------------------------------------------- memory


def run_shape(resolved: Resolved, world_size: int, held: HeldImages) -> RunShape:
    """What the memory of ``resolved``'s run depends on (``held``: the images it holds in memory)."""
    cfg = resolved.config
    streamed = resolved.data == "stream"
    accum = 1 if cfg.optim.accum_steps == "auto" else cfg.optim.accum_steps
    kernels = resolved.kernels
    on_gpu = resolved.device.startswith("cuda")
    # the fast path takes over training on a GPU, and on a CPU where its kernel choice says so; with fp8
    # matmuls its blocks take the plain forward (vitlab.fast.fp8), which keeps what a plain block keeps
    fast_path = cfg.run.fast and cfg.run.fp8 == "off" and (
        on_gpu or bool(kernels and kernels.takes_over(True, resolved.precision == "bf16")))
    evaluated = held.val and cfg.model.mpp is None
    return RunShape(
        trained_architecture(cfg), micro_batch=max(1, cfg.optim.batch_size // (accum * world_size)),
        accum_steps=accum, img_size=tuple(resolved.img_size), precision=resolved.precision, device=resolved.device,
        fast=fast_path, explicit_attention_fp32=bool(kernels and kernels.attention == "explicit"),
        optimizer=cfg.optim.optimizer, momentum=cfg.optim.momentum, ema=cfg.optim.ema_decay > 0,
        mpp=cfg.model.mpp, mpp_rate=cfg.model.mpp_rate, train_images=held.train, val_images=held.val,
        decoded_images=held.decoded, data_copies=held.copies, decoded_from_source=held.from_source,
        eval_batch=min(cfg.run.eval_batch_size, held.val) if evaluated else 0, eval_flip=cfg.run.eval_flip,
        eval_shifts=len(shift_sizes(cfg.run.final_eval_shift)), eval_diagonal=cfg.run.final_eval_diagonal,
        streamed=streamed,
        stream_workers=resolved.stream_workers if streamed else 0,
        shuffle_buffer=cfg.data.shuffle_buffer if streamed else 0,
        cuda_graphs=resolved.compile in CUDA_GRAPH_MODES, update_compiled=resolved.compile_optimizer != "off",
        shards=world_size if cfg.run.fsdp else 1)


def machine_memory(machine: Machine, device: str, world: World) -> Available:
    """What ``machine`` has free for a run on ``device``, the host's shared by the processes
    torchrun started on it."""
    gpu = machine.gpu(torch.device(device))
    return Available(machine.memory_available, gpu.free_bytes if gpu is not None else None,
                     processes=world.processes_here)


def least_available(available: Available, agreement: Agreement) -> Available:
    """``available`` as the least any process of the run read: each reads its host's memory at its
    own moment and its own GPU's, and with ``optim.accum_steps`` "auto" one that read more chose fewer,
    larger micro-batches than another (a global batch sliced two ways), or was not refused where another
    was.  A collective call through ``agreement``; ``available`` itself without one."""
    if not agreement.active:
        return available
    unknown = float("inf")
    host, gpu = agreement.least([unknown if v is None else float(v) for v in (available.host, available.gpu)])
    return dataclasses.replace(available, host=None if host == unknown else int(host),
                               gpu=None if gpu == unknown else int(gpu))


def most_micro_batches(accum: int, memory: MemoryEstimate, batch: int,
                       agreement: Agreement) -> tuple[int, MemoryEstimate]:
    """(``optim.accum_steps="auto"`` as every process of the run takes it: the most micro-batches any
    of them planned, the smallest micro-batch, which fits wherever a larger one did; this process's
    estimate at that count).  ``batch``: a step's images per process.  A collective call through
    ``agreement``; ``accum`` and ``memory`` without one.  With the memory they agreed on, each process
    still estimates with its own host's kernels (``fast.choose``): one whose estimate was larger
    planned more, smaller micro-batches, and the processes sliced each global batch two ways."""
    most = -int(agreement.least([-float(accum)])[0])
    if most == accum:
        return accum, memory
    log.warning("optim.accum_steps=auto: %d micro-batches a step, as another process of the run planned (this one "
                "planned %d): every process slices the batch alike", most, accum)
    return most, estimate_memory(memory.shape.with_(micro_batch=batch // most, accum_steps=most))


def plan_memory(cfg: TrainConfig, shape: RunShape, available: Available, world_size: int = 1,
                check: bool = True, step_peak: StepPeak | None = None
                ) -> tuple[int, MemoryEstimate, MeasuredChoice | None]:
    """(``optim.accum_steps`` with "auto" decided: the largest micro-batch that fits, the run's
    memory estimate, the measurement that decided it or None); with ``check``, a run that
    cannot fit is refused in one line naming settings that would (ConfigError).

    ``step_peak`` (a GPU's, ``step_measurement``): the peak bytes of one training step at a
    micro-batch.  With it, the estimate's choice is where the measurement starts, and the
    measurement decides (``memory_probe.fewest_fitting_accum``): the GPU's side is held to the
    measured peak, the host's to the estimate."""
    batch = cfg.optim.batch_size // world_size
    accum, measured = cfg.optim.accum_steps, None
    if accum == "auto":
        proposed = smallest_fitting_accum(shape, batch, available)
        if step_peak is not None and available.gpu is not None:
            one = shape.with_(micro_batch=1, accum_steps=batch)
            sizes = [s for s in fitting_settings(one, available, size_step(shape.arch), world_size)
                     if s.startswith("--img-size")]  # at micro-batch 1 only a smaller image can help
            # the state beside each candidate's step: a CUDA-graphed run that accumulates holds its gradients too
            measured = fewest_fitting_accum(batch, proposed, step_peak, available.gpu,
                                            lambda accum: resident_state_bytes(shape.with_(accum_steps=accum)),
                                            check, tuple(sizes))
            accum = measured.accum_steps
            available = dataclasses.replace(available, gpu=None)  # the GPU's side is measured: the host's is left
        else:
            accum = proposed
        if accum is None:  # not even one image per micro-batch: the refusal below names what fits
            accum = batch if check else 1
        shape = shape.with_(micro_batch=batch // accum, accum_steps=accum)
    estimate = estimate_memory(shape)
    if check and not available.fits(estimate):
        raise refusal(estimate, available, fitting_settings(shape, available, size_step(shape.arch), world_size))
    return accum, estimate, measured


def step_measurement(resolved: Resolved, world: World) -> AbstractContextManager[StepPeak | None]:
    """What decides ``optim.accum_steps="auto"`` on this run's device: on a CUDA GPU, for a
    run of one process, a measured training step (``memory_probe.step_probe``, on a
    throwaway model; the process's GPU memory emptied on leaving); else None, the estimate.
    Runs of several processes keep the estimate: their processes would have to agree on one
    count, and DDP's buckets and FSDP's shards are not what one model's step holds."""
    cfg = resolved.config
    if (cfg.optim.accum_steps != "auto" or world.device.type != "cuda" or world.size > 1
            or not torch.cuda.is_available()):
        return nullcontext()
    return step_probe(cfg, trained_architecture(cfg), resolved.img_size, resolved.precision, resolved.kernels,
                      world.device)


def measured_line(measured: MeasuredChoice) -> str:
    """The run's note on its measured micro-batch."""
    proposed = measured.proposed_accum if measured.proposed_accum is not None else "none that fits"
    return (f"optim.accum_steps=auto: {measured.accum_steps} (micro-batch {measured.micro_batch}), measured "
            f"on the GPU (step peak {gb(measured.step_peak or 0)} + optimiser state {gb(measured.state)}, of "
            f"{gb(measured.free)} free; the estimate proposed {proposed})")


def run_memory_record(resolved: Resolved) -> dict:
    """The run's memory as config.json and --show-config state it: the estimate's record, with
    the measurement that chose the micro-batch as ``measured`` where there was one."""
    record = resolved.memory.record()
    if resolved.measured is not None:
        record["measured"] = resolved.measured.record()
    return record


def memory_record(resolved: Resolved, machine: Machine, world: World) -> dict:
    """What --show-config states of the run's memory: the estimate's record, the memory
    available here and whether the run fits."""
    available = machine_memory(machine, resolved.device, world)
    record = run_memory_record(resolved)
    if resolved.uncounted:
        record["data"] = resolved.uncounted
    record["available_gb"] = {k: round(v / GB, 3) for k, v in (("host", available.host), ("gpu", available.gpu))
                              if v is not None}
    if resolved.measured is not None:  # the GPU's side as measured, the host's as estimated
        host = dataclasses.replace(available, gpu=None)
        record["fits"] = resolved.measured.fits and host.fits(resolved.memory)
    else:
        record["fits"] = available.fits(resolved.memory)
    return record

