"""Deterministic, class-balanced subsets of a labelled data set.

``stratified_split`` holds out a validation set whose class proportions match the whole
set (the paper picks fine-tuning hyper-parameters on a small held-out part of each
training set, Appendix B.1.1).  ``few_per_class`` draws k examples per class, the training sets of the
few-shot evaluation and of VTAB-1k.  ``select_classes`` keeps the classes a run names
(``data.class_subset``).

Both draws use numpy's PCG64 generator seeded with ``seed``, whose streams are fixed across
platforms and versions, so a split can be named by its seed in a paper.
"""
from __future__ import annotations

import hashlib
import unicodedata
from typing import Mapping, Optional, Union

import numpy as np
import torch

from vitlab.config import ConfigError
from vitlab.data.sources import DataError

__all__ = ["stratified_split", "stratified_sample", "training_pool", "few_per_class", "select_classes", "same_spelling",
           "check_seed", "part_key", "split_key", "split_changes"]

Labels = Union[torch.Tensor, np.ndarray, list]


def _as_labels(labels: Labels) -> np.ndarray:
    array = labels.cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    if array.ndim != 1 or array.size == 0:
        raise DataError(f"labels: expected a non-empty 1-D array, got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.integer) or array.min() < 0:
        raise DataError("labels: expected non-negative integer class ids")
    return array.astype(np.int64)


def check_seed(seed, name: str = "seed") -> None:
    """A seed of PCG64, an integer >= 0 (numpy's own refusal, "expected non-negative integer",
    names neither the setting nor the value)."""
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise DataError(f"{name}={seed!r}: must be an integer >= 0")


def _proportional_counts(counts: np.ndarray, total: int) -> np.ndarray:
    """Split ``total`` over classes in proportion to ``counts`` (largest-remainder rounding).

    Exact shares give floor values first; the leftover units go to the largest
    fractional parts, ties broken by class id, so the result is deterministic and sums
    to ``total`` exactly.
    """
    exact = counts * total / counts.sum()
    alloc = np.floor(exact).astype(np.int64)
    leftover = total - int(alloc.sum())
    order = np.lexsort((np.arange(len(counts)), -(exact - alloc)))  # largest remainder first
    alloc[order[:leftover]] += 1
    return alloc


def stratified_split(labels: Labels, val_size: Union[int, float], seed: int,
                     name: str = "val_size") -> tuple[torch.Tensor, torch.Tensor]:
    """Split indices into train and validation sets with matching class proportions.

    labels:   (N,) integer class ids.
    val_size: number of validation examples (int) or a fraction of N in (0, 1).
    seed:     the split is a pure function of (labels, val_size, seed).
    name:     what the errors call ``val_size`` (the setting it came from, e.g. "data.val_split").

    Returns (train_idx, val_idx): sorted int64 tensors that partition range(N).  Each
    class gives round(val_size * count / N) examples (largest-remainder rounding), e.g.
    exactly 500 per class for CIFAR-10 with val_size=5000.

    Raises:
        DataError: val_size out of range, a negative seed, or a class would have no training example left.
    """
    check_seed(seed)
    y = _as_labels(labels)
    n = len(y)
    if isinstance(val_size, float) and not isinstance(val_size, bool):
        if not 0.0 < val_size < 1.0:
            raise DataError(f"{name}={val_size}: a fraction must lie in (0, 1)")
        n_val = int(round(val_size * n))
    elif isinstance(val_size, (int, np.integer)) and not isinstance(val_size, bool):
        n_val = int(val_size)
    else:
        raise DataError(f"{name}={val_size!r}: expected a count (int) or a fraction (float)")
    if not 0 < n_val < n:
        raise DataError(f"{name}={val_size}: takes {n_val} of the {n} examples; it must leave some on either side "
                        f"(1 to {n - 1}, or a fraction in (0, 1))")

    val = _drawn(y, n_val, seed, f"{name}={val_size}")
    train = np.setdiff1d(np.arange(n), val, assume_unique=True)
    return torch.from_numpy(train), torch.from_numpy(val)


def stratified_sample(labels: Labels, size: int, seed: int, name: str = "size") -> torch.Tensor:
    """Sorted int64 indices of ``size`` examples with the class proportions of the whole set:
    ``stratified_split``'s held-out part of the same size and seed, where a class may give
    every example it has (a training pool, ``data.train_examples``, keeps a small class whole;
    nothing is left on the other side to need one).

    Raises:
        DataError: ``size`` is not a count in 1..N-1, or a negative seed.
    """
    check_seed(seed)
    y = _as_labels(labels)
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or not 0 < size < len(y):
        raise DataError(f"{name}={size!r}: a count of examples in 1..{len(y) - 1} (0: all {len(y)})")
    return torch.from_numpy(_drawn(y, int(size), seed))


def training_pool(labels: Labels, examples: int, split_seed: int) -> torch.Tensor:
    """A run's pool of ``data.train_examples`` examples, which its ``data.val_split`` is then
    held out of: ``stratified_sample`` on the seed after ``split_seed``, so that the pool and
    the split are not one draw.  The one place it is drawn: a run's training and the eval or
    few-shot of its checkpoint must hold out the same examples."""
    return stratified_sample(labels, int(examples), split_seed + 1, "data.train_examples")


def _drawn(y: np.ndarray, total: int, seed: int, leave_some: str = "") -> np.ndarray:
    """Sorted indices of ``total`` examples drawn class by class in proportion; where
    ``leave_some`` (the setting, for the message) a class may not give all it has."""
    classes, counts = np.unique(y, return_counts=True)
    per_class = _proportional_counts(counts, total)
    rng = np.random.Generator(np.random.PCG64(seed))
    parts = []
    for c, count, k in zip(classes, counts, per_class):
        if leave_some and k >= count:
            raise DataError(f"{leave_some}: class id {c} has {count} example(s) and would give all {k} to the "
                            "held-out set, leaving none to train on; hold out fewer examples")
        members = np.flatnonzero(y == c)
        parts.append(members[rng.permutation(count)[:k]])
    return np.sort(np.concatenate(parts))


def few_per_class(labels: Labels, k: int, seed: int) -> torch.Tensor:
    """Sorted int64 indices of ``k`` examples of every class present in ``labels``.

    Raises:
        DataError: k < 1, a negative seed, or some class has fewer than k examples.
    """
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise DataError(f"k={k!r}: must be a positive integer")
    check_seed(seed)
    y = _as_labels(labels)
    classes, counts = np.unique(y, return_counts=True)
    short = [(int(c), int(n)) for c, n in zip(classes, counts) if n < k]
    if short:
        listed = ", ".join(f"class {c}: {n}" for c, n in short[:5])
        raise DataError(f"k={k}: {len(short)} class(es) have fewer than k examples ({listed})")
    rng = np.random.Generator(np.random.PCG64(seed))
    picked = [np.flatnonzero(y == c)[rng.permutation(n)[:k]] for c, n in zip(classes, counts)]
    return torch.from_numpy(np.sort(np.concatenate(picked)))


def select_classes(images: torch.Tensor, labels: torch.Tensor, classes: list[str], keep: tuple[str, ...]):
    """Only the classes named in ``keep``, relabelled 0..len(keep)-1 in that order.  Names are
    matched as spelt alike (``same_spelling``): a subset typed composed names a folder copied from a
    Mac, decomposed, and was refused as no such class."""
    spelt, wanted = same_spelling(list(classes)), same_spelling(list(keep))
    missing = [c for c, s in zip(keep, wanted) if s not in spelt]
    if missing:
        raise ConfigError(f"data.class_subset={keep!r}: no class(es) {', '.join(map(repr, missing))}; "
                          f"the data has {', '.join(classes)}")
    old_ids = torch.tensor([spelt.index(c) for c in wanted])
    mask = torch.isin(labels, old_ids)
    remap = torch.full((len(classes),), -1, dtype=torch.long)
    remap[old_ids] = torch.arange(len(keep))
    return images[mask], remap[labels[mask]], list(keep)


def part_key(ids: Union[torch.Tensor, np.ndarray]) -> str:
    """``"<count>-<hash>"``: the examples whose ``InMemoryDataset.ids`` (``memory.image_ids``: name, file size
    and class) are ``ids``, in any order.  A run records its split's parts by it (``split_key``), which eval, fewshot
    and --resume compare with theirs: the same count of other images (one swapped for another, shards packed
    again with another seed) gives another key, where counts alone were the same."""
    ordered = np.sort(np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64))
    return f"{len(ordered)}-{hashlib.sha256(ordered.tobytes()).hexdigest()[:16]}"


SPLIT_PARTS = (("train", "training"), ("held_out", "held-out"))  # a split_key's parts, and their names in words


def split_key(train: Optional[str], held_out: Optional[str]) -> dict:
    """What a run records of its split: each part's ``part_key`` (None: not named, such as a streamed run's
    training shards, which are never decoded)."""
    return {"train": train, "held_out": held_out}


def split_changes(now: Mapping, recorded: Mapping, whose: str = "the run's") -> list[str]:
    """How the parts of a ``split_key`` ``now`` differ from those ``recorded`` (``whose``), in words ([]: none
    does; a part either leaves unnamed is not compared)."""
    changes = []
    for part, words in SPLIT_PARTS:
        ours, theirs = now.get(part), recorded.get(part)
        if not isinstance(ours, str) or not isinstance(theirs, str) or ours == theirs:
            continue
        count, then = ours.partition("-")[0], theirs.partition("-")[0]
        changes.append(f"{words} {count} examples, {whose} {then}" if count != then else
                       f"{words} {count} examples, as many as {whose} but not all the same images")
    return changes


def same_spelling(names: list) -> list:
    """Class names as they are compared: composed (NFC).  A folder's name copied from a Mac is
    decomposed (NFD: macOS's file systems, zip and tar write it so), the same name written
    elsewhere composed, and the two spellings of one name differ as strings."""
    return [unicodedata.normalize("NFC", n) if isinstance(n, str) else n for n in names]
