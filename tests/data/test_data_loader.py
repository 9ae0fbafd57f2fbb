"""Tests for vitlab.data.loader: reproducible, resumable, rank-sharded batch streams."""
import inspect
import itertools
from typing import get_type_hints

import pytest
import torch

from vitlab.data.loader import Batches, BatchStream, derive_seed
from vitlab.data.stream import StreamLoader
from vitlab.data.transforms import TrainTransform, build_transform

N = 50
IMAGES = torch.randint(0, 256, (N, 3, 8, 8), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
LABELS = torch.arange(N) % 5
AUGMENT = build_transform(TrainTransform(num_classes=5, crop="pad", crop_pad=2, randaug_ops=2,
                                         mixup_alpha=0.5, cutmix_alpha=1.0, label_smoothing=0.1))


def ids_of(stream, epochs=1):
    """Example ids (== positions in IMAGES) of every batch, per epoch."""
    out = []
    for _ in range(epochs):
        out.append([b[1].tolist() for b in stream])
    return out


def raw(**kwargs):
    return BatchStream(IMAGES, torch.arange(N), kwargs.pop("batch_size", 8), **kwargs)


def test_len_and_each_example_once_per_epoch():
    assert len(raw(drop_last=True)) == 6 and len(raw(drop_last=False)) == 7
    (epoch,) = ids_of(raw(drop_last=False))
    flat = [i for batch in epoch for i in batch]
    assert sorted(flat) == list(range(N)) and len(epoch[-1]) == 2
    (epoch,) = ids_of(raw(drop_last=True))
    assert len(epoch) == 6 and all(len(b) == 8 for b in epoch)


def test_epochs_differ_and_depend_only_on_seed():
    e0, e1 = ids_of(raw(seed=1), epochs=2)
    assert e0 != e1
    assert ids_of(raw(seed=1), epochs=2) == [e0, e1]
    assert ids_of(raw(seed=2))[0] != e0
    (ordered,) = ids_of(raw(shuffle=False, drop_last=False))
    assert [i for b in ordered for i in b] == list(range(N))


def test_batches_carry_images_and_labels():
    stream = BatchStream(IMAGES, LABELS, 8, seed=0)
    x, y = next(iter(stream))
    idx = stream.batch_indices(0, 0)
    assert torch.equal(x, IMAGES[idx]) and torch.equal(y, LABELS[idx])


def resumable(prefetch: int = 0) -> BatchStream:
    return BatchStream(IMAGES, LABELS, 8, seed=3, transform=AUGMENT, prefetch=prefetch)


@pytest.fixture(scope="module")
def straight():
    """Two epochs (2 x 6 batches) of an uninterrupted run."""
    stream = resumable()
    return [b for _ in range(2) for b in stream]


# (prefetch, batches consumed before the "crash"): start, mid-epoch, epoch end, next epoch.
@pytest.mark.parametrize("prefetch, stop_after", [(0, 0), (0, 4), (0, 6), (0, 9), (2, 4), (2, 9)])
def test_resume_is_bit_identical(straight, prefetch, stop_after):
    first = resumable(prefetch)
    batches = itertools.chain.from_iterable(first for _ in range(2))
    consumed = list(itertools.islice(batches, stop_after))
    state = first.state_dict()
    assert set(state) == {"epoch", "position", "seed"}
    del batches, first  # the run dies here

    resumed = resumable(prefetch)
    resumed.seed = 99  # the checkpoint, not the constructor, decides
    resumed.load_state_dict(state)
    rest = []
    while len(consumed) + len(rest) < len(straight):
        rest.extend(resumed)
    assert len(consumed) + len(rest) == len(straight)
    for (x, t), (x2, t2) in zip(consumed + rest, straight):
        assert torch.equal(x, x2) and torch.equal(t, t2)


def test_prefetch_matches_and_stops_cleanly():
    plain = [b for b in BatchStream(IMAGES, LABELS, 8, seed=1, transform=AUGMENT)]
    stream = BatchStream(IMAGES, LABELS, 8, seed=1, transform=AUGMENT, prefetch=2)
    fetched = list(stream)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(plain, fetched))
    for i, _ in enumerate(stream):  # leaving early must not hang or lose the position
        if i == 1:
            break
    assert stream.state_dict()["position"] == 2


def test_distributed_ranks_split_each_global_batch():
    world = 3
    streams = [BatchStream(IMAGES, torch.arange(N), 4, seed=5, rank=r, world_size=world) for r in range(world)]
    assert len({len(s) for s in streams}) == 1 and len(streams[0]) == N // 12
    single = BatchStream(IMAGES, torch.arange(N), 12, seed=5)  # the same global batches on one rank
    per_rank = [ids_of(s)[0] for s in streams]
    for step, global_batch in enumerate(ids_of(single)[0]):
        parts = [per_rank[r][step] for r in range(world)]
        assert sorted(sum(parts, [])) == sorted(global_batch)
        assert parts[1] == global_batch[1::world]  # strided
    seen = [i for r in range(world) for batch in per_rank[r] for i in batch]
    assert len(seen) == len(set(seen))  # disjoint across ranks


def test_argument_errors():
    with pytest.raises(ValueError, match="rank"):
        BatchStream(IMAGES, LABELS, 8, rank=2, world_size=2)
    with pytest.raises(ValueError, match="global batch"):
        BatchStream(IMAGES, LABELS, 64)
    with pytest.raises(ValueError, match="differ"):
        BatchStream(IMAGES, LABELS[:3], 8)


def test_alternate_flip_shows_every_example_both_ways_in_consecutive_epochs():
    tf = build_transform(TrainTransform(num_classes=N, crop="none", flip=True, alternate_flip=True))
    stream = BatchStream(IMAGES, torch.arange(N), 8, seed=2, transform=tf, drop_last=False)
    seen = []
    for _ in range(3):
        mirrored = {}
        for x, targets in stream:
            for image, example in zip(x, targets.argmax(-1).tolist()):
                plain = (image + 1) * 127.5
                mirrored[example] = bool(torch.allclose(plain, IMAGES[example].flip(-1).float(), atol=1e-3))
                assert mirrored[example] or torch.allclose(plain, IMAGES[example].float(), atol=1e-3)
        assert len(mirrored) == N
        seen.append(mirrored)
    assert all(seen[0][i] != seen[1][i] and seen[0][i] == seen[2][i] for i in range(N))
    assert 0 < sum(seen[0].values()) < N


@pytest.mark.parametrize("loader", [BatchStream, StreamLoader])
def test_both_loaders_are_the_batches_the_trainer_uses(loader):
    """In memory or streamed, the trainer iterates micro-batches and saves and restores the
    position: each loader has every method of ``Batches``, with its parameters and types."""
    assert issubclass(loader, Batches)
    for name in ("__iter__", "state_dict", "load_state_dict"):
        wanted, given = getattr(Batches, name), getattr(loader, name)
        assert list(inspect.signature(given).parameters) == list(inspect.signature(wanted).parameters), name
        assert get_type_hints(given) == get_type_hints(wanted), name
    assert isinstance(raw(), Batches)


def test_a_streamed_runs_position_is_refused_in_memory_naming_both():
    # `vitlab train --resume --stream memory` of a streamed run's checkpoint: a KeyError traceback
    stream = BatchStream(IMAGES, LABELS, 4)
    streamed = {"kind": "stream", "world_size": 1, "workers": 1, "ranks": [[[0, 4]]], "next_reader": [0]}
    with pytest.raises(ValueError, match="--resume: the checkpoint's data position is of a streamed run, this "
                                         "run holds its data in memory"):
        stream.load_state_dict(streamed)
    assert stream.state_dict()["epoch"] == 0 and stream.state_dict()["position"] == 0


def test_an_iterable_that_cannot_resume_is_not_batches():
    class Plain:
        def __iter__(self):
            yield from ()

        def state_dict(self) -> dict:
            return {}

    assert not isinstance(Plain(), Batches) and not isinstance([(IMAGES, LABELS)], Batches)


# ----------------------------------------------------------------------------- batches augmented in groups

GROUPABLE = build_transform(TrainTransform(num_classes=5, crop="pad", crop_pad=2, randaug_ops=2, label_smoothing=0.1))


def expected_batches(transform, seed: int, epoch: int, k: int, drop_last: bool = True, batch: int = 8):
    """The stream's documented draws, made by hand: batches in the epoch's order, each group of
    ``k`` augmented in one call seeded by the group's first batch (its position + 1)."""
    stream = BatchStream(IMAGES, LABELS, batch, seed=seed, drop_last=drop_last)
    order, out = stream._order(epoch), []
    for first in range(0, len(stream), k):
        slices = [stream.batch_indices(epoch, p) for p in range(first, min(first + k, len(stream)))]
        idx = torch.cat(slices)
        generator = torch.Generator().manual_seed(derive_seed(seed, epoch, first + 1, 0))
        group = {"batch_sizes": [len(one) for one in slices]} if len(slices) > 1 else {}
        x, t = transform(IMAGES[idx], LABELS[idx], generator, example_ids=idx, epoch=epoch, seed=seed, **group)
        out += list(zip(x.split([len(s) for s in slices]), t.split([len(s) for s in slices])))
    assert torch.equal(order[:8], stream.batch_indices(epoch, 0))
    return out


@pytest.mark.parametrize("k, drop_last", [(1, True), (3, True), (4, False), (10, True)])
@pytest.mark.parametrize("transform", [GROUPABLE, AUGMENT], ids=["unmixed", "mixed"])
def test_grouped_batches_are_the_documented_draws(k, drop_last, transform):
    """k = 1 is every batch drawn on its own seed, as before groups existed; k > 1 draws a group
    in one call on its first batch's seed, told the group's batch sizes, and splits it, the last
    group shorter."""
    stream = BatchStream(IMAGES, LABELS, 8, seed=4, transform=transform, drop_last=drop_last, augment_batches=k)
    for epoch in range(2):
        got, want = list(stream), expected_batches(transform, 4, epoch, k, drop_last)
        assert len(got) == len(want) == len(stream)
        for (x, t), (x2, t2) in zip(got, want):
            assert torch.equal(x, x2) and torch.equal(t, t2)


def test_groups_change_the_draws_not_the_examples():
    """Grouping keeps each batch's examples and their order (only the augmentation's draws are
    the group's), on every rank of a sharded run."""
    for rank in range(2):
        kwargs = dict(seed=5, drop_last=False, rank=rank, world_size=2)
        assert ids_of(raw(augment_batches=4, **kwargs), 2) == ids_of(raw(**kwargs), 2)
    plain = list(BatchStream(IMAGES, LABELS, 8, seed=5, transform=GROUPABLE))
    grouped = list(BatchStream(IMAGES, LABELS, 8, seed=5, transform=GROUPABLE, augment_batches=3))
    assert all(torch.equal(a[1], b[1]) for a, b in zip(plain, grouped))  # the same labels, batch by batch
    assert not torch.equal(plain[1][0], grouped[1][0])  # batch 1 is drawn on batch 0's seed now


def test_a_group_mixes_each_batch_within_itself_on_draws_of_its_own():
    """Mixup and CutMix pair each image with the one before it in its own batch (the first with
    the last), one weight per batch, in a group as alone: each batch's targets are lam x its
    smoothed labels + (1 - lam) x the same rolled by one, and the batches of a group drew
    different weights."""
    mixup_only = build_transform(TrainTransform(num_classes=5, crop="none", flip=False, mixup_alpha=1.0,
                                                label_smoothing=0.1))
    stream = BatchStream(IMAGES, LABELS, 8, seed=6, transform=mixup_only, augment_batches=4)
    weights = []
    for position, (x, t) in enumerate(stream):
        labels = LABELS[stream.batch_indices(0, position)]
        smooth = torch.nn.functional.one_hot(labels, 5).float() * 0.9 + 0.02
        row = next(j for j in range(8) if labels[j] != labels[j - 1])  # a pair of two labels tells the weight
        lam = float(t[row, labels[row]] - smooth[row - 1, labels[row]]) / float(smooth[row, labels[row]]
                                                                              - smooth[row - 1, labels[row]])
        torch.testing.assert_close(t, lam * smooth + (1 - lam) * smooth.roll(1, 0))
        plain = IMAGES[stream.batch_indices(0, position)].float() / 127.5 - 1
        torch.testing.assert_close(x, lam * plain + (1 - lam) * plain.roll(1, 0), atol=1e-5, rtol=1e-5)
        weights.append(round(lam, 6))
    assert len(weights) == len(stream) and len(set(weights[:4])) == 4  # one draw per batch of the first group


@pytest.mark.parametrize("stop_after", [1, 2, 3, 7])
def test_a_stream_resumed_inside_a_group_is_bit_identical(stop_after):
    def stream():
        return BatchStream(IMAGES, LABELS, 8, seed=3, transform=GROUPABLE, augment_batches=3)

    straight = [b for s in [stream()] for _ in range(2) for b in s]
    first = stream()
    consumed = list(itertools.islice(itertools.chain.from_iterable(first for _ in range(2)), stop_after))
    resumed = stream()
    resumed.load_state_dict(first.state_dict())
    rest = []
    while len(consumed) + len(rest) < len(straight):
        rest.extend(resumed)
    for (x, t), (x2, t2) in zip(consumed + rest, straight):
        assert torch.equal(x, x2) and torch.equal(t, t2)


def test_a_group_launches_the_augmentation_once():
    """What grouping is for: the host dispatches the augmentation's operators once per group, so a
    GPU step bound by launches gets its batches for a k-th of them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    for k in (1, 6):
        Count.calls = 0
        with Count():
            assert len(list(BatchStream(IMAGES, LABELS, 8, seed=1, transform=GROUPABLE, augment_batches=k))) == 6
        counts[k] = Count.calls
    assert counts[6] < counts[1] / 3, counts


def test_augment_batches_must_be_a_positive_count():
    with pytest.raises(ValueError, match="augment_batches=0"):
        BatchStream(IMAGES, LABELS, 8, augment_batches=0)
