"""Batches from in-memory tensors, reproducible to the bit and resumable mid-epoch.

The order of epoch ``e`` is a permutation seeded by (seed, e), and the augmentation of
batch ``p`` uses a generator seeded by (seed, e, p, rank), so every batch is a pure
function of (seed, epoch, position).  Resuming is then only a matter of restoring
those three numbers: no RNG state has to be saved, and prefetching ahead cannot shift
what later batches see.

Distributed training: every rank builds the same permutation and takes a strided slice
(``rank::world_size``) of each global batch of ``batch_size * world_size`` indices, so
ranks see disjoint examples and together exactly the global batch.
"""
from __future__ import annotations

import queue
import threading
from typing import Iterator, Optional, Protocol, Union, runtime_checkable

import numpy as np
import torch

from vitlab.data.transforms import BatchTransform

__all__ = ["Batches", "BatchStream", "DeviceStage", "derive_seed", "one_ahead"]

Batch = tuple[torch.Tensor, torch.Tensor]
_DONE = object()


def host_generator(device: torch.device, seed: int) -> dict:
    """``{"host_generator": ...}``, a CPU generator for a batch's own numbers, where the batch
    is augmented on a GPU (its draws there would be read back); nothing on a CPU, whose
    generator already lives on the host."""
    return {} if device.type == "cpu" else {"host_generator": torch.Generator().manual_seed(seed)}


def derive_seed(*numbers: int) -> int:
    """A 63-bit seed mixing non-negative ints well (numpy's SeedSequence hashing).

    Plain sums such as ``seed + epoch`` would make (seed=1, epoch=0) and (seed=0,
    epoch=1) share a stream.
    """
    return int(np.random.SeedSequence(list(numbers)).generate_state(1, dtype=np.uint64)[0] >> 1)


@runtime_checkable
class Batches(Protocol):
    """What the trainer uses of its micro-batches, in memory (``BatchStream``) or streamed
    (``vitlab.data.stream.StreamLoader``): iterating yields this process's (images, targets)
    micro-batches; ``state_dict()``, saved in a checkpoint, and ``load_state_dict`` make a
    resumed run go on with the batch after the last one taken before the checkpoint."""

    def __iter__(self) -> Iterator[Batch]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class BatchStream:
    """Iterate (images, targets) batches of an in-memory data set.

    images:     (N, C, H, W) tensor (uint8 for the transforms in ``transforms``); it may
                already live on the GPU, airbench-style.
    labels:     (N,) int64.
    batch_size: per-rank batch size.
    shuffle:    a fresh permutation per epoch; False walks 0..N-1 in order.
    seed:       with the epoch and position, fixes every batch and its augmentation.
    drop_last:  drop the final incomplete global batch (keep True for training, so every
                step has the same size and every rank the same number of steps).
    transform:  ``(uint8 batch, labels, generator, *, example_ids, epoch, seed) ->
                (batch, targets)``, e.g. from ``build_transform``; None yields the raw
                (images, labels).
    device:     where batches are moved before the transform runs; None keeps the
                images' device.
    rank, world_size: this process's share of each global batch.
    prefetch:   batches prepared ahead in a background thread (0 = none).  On a 2-core
                CPU this did not pay (see benchmarks/data_throughput.py); with a GPU
                it overlaps CPU-side work with the device's.
    augment_batches: consecutive batches gathered and augmented in one call of ``transform``,
                then split: the same work on the device in a k-th of the launches from the host,
                for a GPU step that is bound by them.  The group of batches ``g*k .. g*k+k-1``
                takes the seed of its first batch, so 1 gives every batch its own draws, as
                before, and a stream resumed inside a group makes the group again and goes on
                where it stopped.  The transform is told the group's batch sizes
                (``batch_sizes``), so that what works on a batch as a whole (mixup, CutMix)
                mixes each batch within itself, on draws of its own.
    stored_sizes: (N, 2) int64 each image's (height, width) as stored, before it was resized to
                H x W (``InMemoryDataset.sizes``), handed to ``transform`` with each batch as
                ``source_sizes``: an inception crop draws its boxes in the stored image's geometry,
                not the stretched copy's.  None: the images are as stored (nothing handed over).

    Iterating yields the rest of the current epoch and then advances to the next
    epoch, so ``for epoch ...: for x, y in stream: ...`` walks the epochs in turn.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        transform: Optional[BatchTransform] = None,
        device: Union[str, torch.device, None] = None,
        rank: int = 0,
        world_size: int = 1,
        prefetch: int = 0,
        augment_batches: int = 1,
        stored_sizes: Optional[torch.Tensor] = None,
    ) -> None:
        if images.shape[0] != labels.shape[0]:
            raise ValueError(f"images ({images.shape[0]}) and labels ({labels.shape[0]}) differ in length")
        if stored_sizes is not None and tuple(stored_sizes.shape) != (images.shape[0], 2):
            raise ValueError(f"stored_sizes: expected ({images.shape[0]}, 2), each image's stored (height, width); "
                             f"got {tuple(stored_sizes.shape)}")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}, world_size={world_size}: need 0 <= rank < world_size")
        if seed < 0:
            raise ValueError(f"seed={seed}: must be >= 0")
        if augment_batches < 1:
            raise ValueError(f"augment_batches={augment_batches}: must be >= 1")
        global_batch = batch_size * world_size
        if drop_last and images.shape[0] < global_batch:
            raise ValueError(
                f"{images.shape[0]} examples make no full global batch of {global_batch} "
                f"(batch_size={batch_size} x world_size={world_size}) with drop_last=True"
            )
        self.images = images
        self.labels = labels
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.transform = transform
        self.device = torch.device(device) if device is not None else images.device
        self.rank = rank
        self.world_size = world_size
        self.prefetch = prefetch
        self.augment_batches = augment_batches
        self.stored_sizes = stored_sizes
        self.epoch = 0
        self.position = 0  # batches of ``epoch`` already handed out

    def __len__(self) -> int:
        """Batches per epoch (the same on every rank)."""
        n, g = self.images.shape[0], self.batch_size * self.world_size
        return n // g if self.drop_last else -(-n // g)

    def state_dict(self) -> dict:
        """Where the stream stands: the next batch is ``position`` of ``epoch``."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where ``state_dict()`` was taken (same batch_size, world_size).

        Raises:
            ValueError: ``state`` is a streamed run's (``StreamLoader``'s).
        """
        if state.get("kind") == "stream":
            raise ValueError("--resume: the checkpoint's data position is of a streamed run, this run holds its data "
                             "in memory (resume with data.stream='stream')")
        self.epoch, self.position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])

    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of ``epoch``."""
        self.epoch, self.position = int(epoch), 0

    def _order(self, epoch: int) -> torch.Tensor:
        n = self.images.shape[0]
        if not self.shuffle:
            return torch.arange(n)
        generator = torch.Generator().manual_seed(derive_seed(self.seed, epoch, 0))
        return torch.randperm(n, generator=generator)

    def batch_indices(self, epoch: int, position: int) -> torch.Tensor:
        """(b,) int64 example indices of this rank's batch ``position`` of ``epoch``."""
        return self._slice(self._order(epoch), position)

    def _slice(self, order: torch.Tensor, position: int) -> torch.Tensor:
        g = self.batch_size * self.world_size
        return order[position * g : (position + 1) * g][self.rank :: self.world_size]

    def _make(self, order: torch.Tensor, epoch: int, position: int, count: int = 1) -> list[Batch]:
        """Batches ``position .. position + count - 1``, gathered and augmented in one go."""
        slices = [self._slice(order, p) for p in range(position, position + count)]
        sizes = [len(one) for one in slices]
        chosen = torch.cat(slices)
        idx = copy_without_a_wait(chosen, self.images.device)
        if self.device.type == "cuda" and self.images.device.type == "cpu":
            # gathered straight into pinned memory (one copy of the batch on the host, not two),
            # whose copy to the device does not block
            x = torch.empty((len(idx), *self.images.shape[1:]), dtype=self.images.dtype, pin_memory=True)
            torch.index_select(self.images, 0, idx, out=x)
            y = self.labels[idx].pin_memory()
        else:
            x, y = self.images[idx], self.labels[idx]
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        if self.transform is not None:
            idx = copy_without_a_wait(idx, self.device)  # the ids, for alternating flips
            batch_seed = derive_seed(self.seed, epoch, position + 1, self.rank)
            generator = torch.Generator(device=self.device).manual_seed(batch_seed)
            # a group's batch sizes, for what works on a batch as a whole (mixup, CutMix)
            group = {"batch_sizes": sizes} if count > 1 else {}
            if self.stored_sizes is not None:  # for the crop's geometry
                group["source_sizes"] = copy_without_a_wait(self.stored_sizes[chosen], self.device)
            x, y = self.transform(x, y, generator, example_ids=idx, epoch=epoch, seed=self.seed,
                                  **host_generator(self.device, batch_seed), **group)
        return list(zip(x.split(sizes), y.split(sizes)))

    def _batches(self, order: torch.Tensor, epoch: int, start: int) -> Iterator[Batch]:
        """Batches ``start ..`` of the epoch, made a group of ``augment_batches`` at a time; a
        group that began before ``start`` is made whole and its earlier batches passed over."""
        k = self.augment_batches
        for first in range(start - start % k, len(self), k):
            group = self._make(order, epoch, first, min(k, len(self) - first))
            yield from group[max(start - first, 0):]

    def __iter__(self) -> Iterator[Batch]:
        if self.position >= len(self):  # state taken after the last batch of an epoch
            self.epoch, self.position = self.epoch + 1, 0
        epoch, order = self.epoch, self._order(self.epoch)
        positions = range(self.position, len(self))
        batches = self._batches(order, epoch, self.position)
        if self.prefetch > 0:
            batches = _prefetched(batches, self.prefetch)
        batches = one_ahead(batches, DeviceStage(self.device))
        try:
            for position, batch in zip(positions, batches):
                self.position = position + 1  # before the yield: a checkpoint taken now resumes after it
                yield batch
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()
        if self.epoch == epoch and self.position >= len(self):
            self.epoch, self.position = epoch + 1, 0


def copy_without_a_wait(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; from the host to a GPU by a non-blocking copy from pinned
    memory, as a blocking one would make the host wait for the GPU's queued work."""
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class DeviceStage:
    """Where batches are made ready: on a CUDA device a side stream, so that copying and
    augmenting the next batch overlap the step that runs on the current stream; on other
    devices in line, on the caller's thread."""

    def __init__(self, device: Union[str, torch.device]) -> None:
        device = torch.device(device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def overlaps(self) -> bool:
        return self.stream is not None

    def run(self, fn, *args):
        """``fn(*args)``, its device work queued on the side stream."""
        if self.stream is None:
            return fn(*args)
        with torch.cuda.stream(self.stream):
            return fn(*args)

    def hand_over(self, item) -> None:
        """Let the current stream use ``item``'s tensors (a tuple's too): it waits for the side
        stream's work, and the memory is not reused before the current stream is done with it."""
        if self.stream is None:
            return
        current = torch.cuda.current_stream(self.stream.device)
        current.wait_stream(self.stream)
        for tensor in item if isinstance(item, (tuple, list)) else (item,):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda":
                tensor.record_stream(current)


def one_ahead(items: Iterator, stage: DeviceStage) -> Iterator:
    """``items``, each made on ``stage`` one ahead of the consumer where the stage overlaps
    (CUDA): while the consumer's step runs, the next item is copied and augmented."""
    if not stage.overlaps:
        yield from items
        return
    items = iter(items)
    try:
        ahead = stage.run(next, items, _DONE)
        while ahead is not _DONE:
            current = ahead
            stage.hand_over(current)
            ahead = stage.run(next, items, _DONE)
            yield current
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()


def _prefetched(items: Iterator, depth: int) -> Iterator:
    """Run ``items`` in a background thread, ``depth`` items ahead of the consumer.

    torch releases the GIL inside its kernels, so the thread's augmentation runs while
    the main thread computes.  Closing the returned generator stops the thread.
    """
    buffer: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                buffer.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def work() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as error:  # noqa: BLE001 - re-raised in the consumer
            put(error)

    thread = threading.Thread(target=work, name="BatchStream-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = buffer.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()
