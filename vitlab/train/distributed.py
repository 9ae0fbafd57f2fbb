"""One command from one process to many: ``torch.distributed`` when launched by torchrun.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK (and MASTER_ADDR/PORT); without them the run
is a single process and nothing here does anything.  When a process dies, torchrun
with ``--max-restarts N`` starts the whole group again with TORCHELASTIC_RESTART_COUNT
raised (``elastic_restart_count``), and the run continues from its last checkpoint.  Backend: NCCL on GPUs, gloo on CPU.
The model is wrapped in DDP (gradients all-reduced, averaged) or, with ``--fsdp``,
sharded with FSDP2's ``fully_shard`` (parameters, gradients and optimiser state split
over the processes; full state dicts gathered for checkpoints and the saved weights).
"""
from __future__ import annotations

import gc
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from vitlab.config import ConfigError
from vitlab.models.layers import Block
from vitlab.models.mpp import MaskedPatchPrediction


@dataclass(frozen=True)
class World:
    """This process's place in the run.  ``owns_group``: ``init_world`` created the process
    group for it, so ``shutdown(world)`` ends the group; a group the caller created is left alone."""

    rank: int
    size: int
    local_rank: int
    device: torch.device
    owns_group: bool = False
    processes_here: int = 1  # the processes on this host, which share its cores and memory

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """``values`` summed over the processes (what an evaluator given this world calls)."""
        return all_reduce_sum(values, self)


LAUNCH = "launch the processes with torchrun (torchrun --nproc_per_node=N -m vitlab ...), which sets it"


def env_number(name: str, default: int, least: int = 0) -> int:
    """The launch's environment variable ``name``, an integer >= ``least``; ``default`` where unset.
    Another value is refused naming the variable: int() said "invalid literal for int() with base 10:
    'x'", and WORLD_SIZE=0 failed as a division by zero, with a traceback."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < least:
        raise ConfigError(f"{name}={text!r} (environment): expected an integer >= {least}; {LAUNCH}")
    return value


def check_one_process(what: str) -> None:
    """Refuse a launch of several processes (torchrun's) for ``what``, a protocol that trains its runs one after
    another (a sweep, vtab, an experiment), before any work: every process ran it whole, writing its records
    and reports; a sweep's second run waited for the other processes without end, and vtab's other processes
    ended in a traceback on the weights rank 0 alone saves.  One run trains on several processes."""
    size = env_world_size()
    if size > 1:
        raise ConfigError(f"WORLD_SIZE={size} (environment): {what} runs its runs one after another in one process, "
                          "and under torchrun every process ran it whole; run it without torchrun, or train one run "
                          "on several processes: torchrun --nproc_per_node=N -m vitlab train (or finetune)")


def env_world_size() -> int:
    """The processes of the launch (``WORLD_SIZE``; 1 unset), with this process's ``RANK`` held to it
    before any group is joined: without one every process of a launch by hand took rank 0, and one of
    ``RANK`` >= ``WORLD_SIZE`` was never met, each waiting in the rendezvous for ranks that never came
    (the backend's timeout, half an hour)."""
    size = env_number("WORLD_SIZE", 1, least=1)
    if size > 1 and "RANK" not in os.environ:
        raise ConfigError(f"WORLD_SIZE={size} (environment) without RANK: each of the {size} processes needs its "
                          f"own rank, 0 to {size - 1}; {LAUNCH}")
    rank = env_number("RANK", 0)
    if rank >= size:
        raise ConfigError(f"RANK={rank} (environment): a rank of WORLD_SIZE={size} process(es) is 0 to {size - 1}; "
                          f"{LAUNCH}")
    return size


def env_rank() -> int:
    """This process's rank in the launch (``RANK``; 0 unset), held to ``WORLD_SIZE``."""
    env_world_size()
    return env_number("RANK", 0)


def local_rank() -> int:
    """This process's rank on its host (which of the host's GPUs it takes)."""
    return env_number("LOCAL_RANK", env_rank())


def processes_here() -> int:
    """The processes torchrun started on this host (``LOCAL_WORLD_SIZE``): they share its cores and memory."""
    return env_number("LOCAL_WORLD_SIZE", 1, least=1)


def check_rendezvous() -> None:
    """The address of the launch's rendezvous (``MASTER_ADDR``, ``MASTER_PORT``), which a process joining
    its group needs: a port of another form failed as "invalid literal for int()"."""
    if not os.environ.get("MASTER_ADDR"):
        raise ConfigError(f"MASTER_ADDR (environment) is not set: the processes of WORLD_SIZE={env_world_size()} "
                          f"meet at rank 0's host, named by it; {LAUNCH}")
    if "MASTER_PORT" not in os.environ:
        raise ConfigError(f"MASTER_PORT (environment) is not set: the port of rank 0's host at which the processes "
                          f"meet; {LAUNCH}")
    if not 1 <= env_number("MASTER_PORT", 0, least=1) <= 65535:
        raise ConfigError(f"MASTER_PORT={os.environ['MASTER_PORT']!r} (environment): a port is 1 to 65535; {LAUNCH}")


def local_world(device: torch.device) -> World:
    """The world of a process that joins no group: a command that scores, or a preview."""
    return World(rank=0, size=env_world_size(), local_rank=local_rank(), device=device,
                 processes_here=processes_here())


def init_world(device: torch.device) -> World:
    """Join the process group on ``device`` (``resolve.resolve_device``'s) if torchrun (or a test)
    set the environment; else 1 process.  The group joined here is the returned world's to end
    (``shutdown``); when one exists already, this process's place in it, which ``shutdown``
    leaves alone."""
    size, rank = env_world_size(), env_rank()
    device = torch.device(device)
    joined = size > 1 and not dist.is_initialized()
    if joined:
        check_rendezvous()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        restarts = elastic_restart_count()
        if restarts:
            # torchrun keeps one store over its restarts, holding the dead group's addresses under
            # the same keys: the new processes would connect to those (refused, or a hang). A
            # prefix per restart gives each group its own keys.
            store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=size))
            store = dist.PrefixStore(f"vitlab/restart-{restarts}", store)
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=size)
        else:
            dist.init_process_group(backend=backend, rank=rank, world_size=size)
    return World(rank=rank, size=size, local_rank=local_rank(), device=device, owns_group=joined,
                 processes_here=processes_here())


class SyncedBatchNorm(nn.BatchNorm2d):
    """A BatchNorm2d whose training forward, in a process group of several, normalises with the
    statistics of every process's micro-batch together, as one process normalises a micro-batch of
    their size, and moves the running statistics by them on every process alike.  Each process had
    normalised with its own share's: two processes of a CIFAR hybrid (BatchNorm stem) at batch B
    trained another model than one process at B.  torch's SyncBatchNorm takes GPUs only; this
    one all-reduces (``SumOverProcesses``) on any backend.  Evaluation, and a process alone, are
    BatchNorm2d's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        statistics = self.statistics
        if torch.compiler.is_compiling():  # the collectives run eagerly, between the compiled graphs
            statistics = torch.compiler.disable(statistics)  # (imported so: an eager run loads no compiler)
        mean, var, count = statistics(x)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), momentum)
                unbiased = var.detach() * count / (count - 1).clamp(min=1)  # as BatchNorm keeps it
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)
        y = (x.float() - mean[:, None, None]) * torch.rsqrt(var + self.eps)[:, None, None]
        if self.affine:
            y = y * self.weight[:, None, None] + self.bias[:, None, None]
        return y.to(x.dtype)

    def statistics(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(C,) mean and (C,) biased variance of every process's ``x`` together, in float32 (two passes:
        the variance about the common mean), and () the count of values per channel (on the device:
        nothing is read back)."""
        x = x.float()
        local = x.new_full((1,), x.numel() // x.shape[1])  # a fill on the device: no copy from the host to wait on
        sums = SumOverProcesses.apply(torch.cat([x.sum((0, 2, 3)), local]))
        count = sums[-1]
        mean = sums[:-1] / count
        var = SumOverProcesses.apply(((x - mean[:, None, None]) ** 2).sum((0, 2, 3))) / count
        return mean, var, count


class SumOverProcesses(torch.autograd.Function):
    """A tensor summed over the processes, whose gradient is summed over them too: each process's
    statistics feed every process's loss.  (torch.distributed.nn's all_reduce does so, deprecated.)"""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def sync_batch_norm(model: nn.Module) -> None:
    """Every BatchNorm2d of ``model`` made a ``SyncedBatchNorm`` in place: the same parameters, buffers and
    state-dict keys (the saved weights read as ever), the optimiser's and the weight average's as they were."""
    for module in model.modules():
        if type(module) is nn.BatchNorm2d:
            module.__class__ = SyncedBatchNorm


def wrap_model(model: nn.Module, world: World, fsdp: bool) -> nn.Module:
    """DDP or FSDP around ``model`` for a multi-process run, its BatchNorm layers synchronised
    (``SyncedBatchNorm``); the model itself otherwise."""
    if world.size == 1:
        return model
    sync_batch_norm(model)
    if fsdp:
        # FSDP2 (fully_shard): every Transformer block is one unit whose parameters are
        # gathered for its forward and backward and sharded again after; it runs on
        # CPU (gloo) as well as on GPUs, unlike the older FullyShardedDataParallel.
        # imported here: FSDP's modules load a good part of torch.distributed, which a
        # single-process run (nearly every run) never needs
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(world.device.type, (world.size,))
        for module in model.modules():
            if isinstance(module, Block):
                fully_shard(module, mesh=mesh)
        return fully_shard(model, mesh=mesh)  # the same object, its parameters now DTensor shards
    # masked patch prediction trains the ViT without its classifier, whose parameters get no gradient: DDP
    # waits for one of every parameter and stopped the second step ("Expected to have finished reduction")
    return DistributedDataParallel(model, device_ids=[world.device] if world.device.type == "cuda" else None,
                                   find_unused_parameters=isinstance(model, MaskedPatchPrediction))


def all_reduce_sum(values: list[float], world: World) -> list[float]:
    """Sum numbers over processes (evaluation counts)."""
    return _all_reduce_numbers(values, world, "SUM")


def all_reduce_min(values: list[float], world: World) -> list[float]:
    """The least of each number over the processes."""
    return _all_reduce_numbers(values, world, "MIN")


def _all_reduce_numbers(values: list[float], world: World, op: str) -> list[float]:
    if world.size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=world.device)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return t.tolist()


# the numbers an ``Agreement``'s calls carry besides its flag: every call sends as many, so that the
# call a refusing process makes in place of another's lines up with it
AGREED_NUMBERS = 3


class Agreement:
    """The collective calls of a phase every process of a run goes through together (its
    resolution), each carrying whether a process met a refusal: one that met it between two calls
    makes the next with it instead of leaving, and every process then stops with that refusal,
    named by the rank and host that met it (``RankRefused``).  A refusal of one host alone (more
    threads than its cores, data missing there, a memory refusal from its own figures) left the
    others in their next call until the backend's timeout, or failed them with a traceback.

        with Agreement(world) as agreement:
            ...; least = agreement.least([workers]); ...  # the phase's collective calls
        # on leaving: one more call, so that a refusal after the last is every process's too

    Inactive (no call made) for one process, without a process group, or when ``active`` is
    False (a preview)."""

    def __init__(self, world: World, active: bool = True) -> None:
        self.world = world
        self.active = active and world.size > 1 and dist.is_initialized()

    def least(self, values: list[float]) -> list[float]:
        """The least of each of ``values`` (at most ``AGREED_NUMBERS``) over the processes; as given
        when inactive.  Raises RankRefused where a process made this call with its refusal."""
        if not self.active:
            return values
        return self._call(values)[:len(values)]

    def _call(self, values: list[float], refusal: str | None = None) -> list[float]:
        """One call of every process: ``values`` padded to ``AGREED_NUMBERS``, after the first
        rank that refused (this one's, with ``refusal``; the world's size for none)."""
        if len(values) > AGREED_NUMBERS:
            raise ValueError(f"an agreement carries at most {AGREED_NUMBERS} numbers, got {len(values)}")
        world = self.world
        first = world.rank if refusal is not None else world.size
        refused, *least = all_reduce_min([float(first)] + [float(v) for v in values]
                                         + [float("inf")] * (AGREED_NUMBERS - len(values)), world)
        if refused < world.size:  # every process now gathers the refusals, and stops
            said = all_gather_objects(None if refusal is None else (socket.gethostname(), refusal), world)
            host, line = said[int(refused)]
            if all(s is not None and s[1] == line for s in said):  # every process met it: the config's, say
                raise RankRefused(line, everyone=True)
            raise RankRefused(f"rank {int(refused)} of {world.size} (host {host}): {line}")
        return least

    def __enter__(self) -> Agreement:
        return self

    def __exit__(self, kind, err, tb) -> bool:
        if not self.active or isinstance(err, RankRefused) or (err is not None and not isinstance(err, Exception)):
            return False  # no agreement, every process stopping already, or Ctrl-C
        if err is None:
            self._call([])  # the last call: a refusal met after the one before
            return False
        try:
            self._call([], refusal_line(err))
        except RankRefused as refused:
            # one line, the same on every process (printed once: ``rank_0_said``); met by all, each its own
            if isinstance(err, REFUSALS) and not refused.everyone:
                raise refused from err
        except Exception:  # noqa: BLE001 - the group itself failed (a process gone): this process's own error
            pass
        return False  # an error of another kind (a fault of the code): its traceback, the others told in one line


class RankRefused(ConfigError):
    """A refusal met by a process of a run, which every process stops with (``everyone``: every
    process met it)."""

    def __init__(self, line: str, everyone: bool = False) -> None:
        super().__init__(line)
        self.everyone = everyone


def refusal_line(err: BaseException) -> str:
    """What the command prints of ``err``: its message (``vitlab.extras.require``'s names the extra of a
    missing optional package); an error of another kind by its type too."""
    return str(err) if isinstance(err, REFUSALS) else f"{type(err).__name__}: {err}"


# what the command reports in one line (a config, input or data error, a missing optional package)
REFUSALS = (ValueError, OSError, FloatingPointError, ImportError)


def all_reduce_tensor(t: torch.Tensor, world: World) -> torch.Tensor:
    """``t`` summed over processes, in place on its device (no read back to the host)."""
    if world.size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_from_main(tensors: list[torch.Tensor], world: World) -> None:
    """Every process's ``tensors`` set, in place, to rank 0's."""
    if world.size > 1:
        for t in tensors:
            dist.broadcast(t, src=0)


def all_gather_objects(obj, world: World) -> list:
    """Every process's ``obj`` (picklable), in rank order."""
    if world.size == 1:
        return [obj]
    gathered = [None] * world.size
    dist.all_gather_object(gathered, obj)
    return gathered


def elastic_restart_count() -> int:
    """How many times torchrun (``--max-restarts``) has started this group again after a
    process of it failed; 0 on the first start and outside torchrun."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def post_error(line: str) -> None:
    """Rank 0 of a torchrun launch, having printed ``line`` (its error): post it in torchrun's store,
    where the other ranks look for it (``rank_0_said``).  Nothing outside torchrun or on failure."""
    try:
        if launched_rank() == 0 and (store := _agent_store(5.0)):
            store.set(_error_key(), line)
    except Exception:  # noqa: BLE001 - the store unreachable: the other ranks print their own
        pass


def rank_0_said(line: str, timeout_s: float = 10.0) -> bool:
    """Whether rank 0 of this torchrun launch posted ``line`` as its error (``post_error``), waited
    for up to ``timeout_s``: then it printed it, and another rank that met the same need not.  False
    on rank 0, outside torchrun, and where rank 0 posts nothing in time or another line (its error
    is another, or it has none: this rank's is its own)."""
    if launched_rank() in (None, 0):
        return False
    from datetime import timedelta

    try:
        store = _agent_store(timeout_s)
        if store is None:
            return False
        store.wait([_error_key()], timedelta(seconds=timeout_s))
        return store.get(_error_key()).decode() == line
    except Exception:  # noqa: BLE001 - no line in time, or the store unreachable
        return False


def launched_rank() -> int | None:
    """This process's rank in a launch of several processes; None outside one, and where the launch's
    variables are refused (``env_world_size``): that refusal is this process's own to print."""
    try:
        return env_rank() if env_world_size() > 1 else None
    except ConfigError:
        return None


def _agent_store(timeout_s: float):
    """A client of the store torchrun's agent keeps for its workers; None outside torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from datetime import timedelta

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def _error_key() -> str:
    return f"vitlab/error/restart-{elastic_restart_count()}"  # torchrun keeps its store over its restarts


def barrier(world: World) -> None:
    if world.size > 1:
        dist.barrier()


def shutdown(world: World, wait_for_others: bool = True) -> None:
    """Leave the process group ``world`` joined (``owns_group``), and free it, while the
    interpreter is still whole.

    DDP's reducer and FSDP's device mesh keep the group alive inside reference cycles; if
    those are only collected as the interpreter exits, gloo's worker threads die holding
    tensors and the process aborts ("terminate called without an active exception").
    Call this after the wrapped model is out of scope.  ``wait_for_others`` (a barrier)
    only on success: a rank that failed must not wait for ranks that will not come.
    A group that the caller created (not ``init_world``) is left alone.
    """
    if not (world.owns_group and dist.is_initialized()):
        return
    gc.collect()  # the model's cycles first: their last references to the group go
    if wait_for_others:
        dist.barrier()
    dist.destroy_process_group()
    gc.collect()
