"""Tests for vitlab.data.splits: stratified validation splits and k-per-class subsets."""
import numpy as np
import pytest
import torch

from vitlab.data.sources import DataError
from vitlab.data.splits import few_per_class, stratified_split

CIFAR_LABELS = torch.arange(10).repeat_interleave(5000)  # 10 classes x 5000, like CIFAR-10 train


def test_cifar_5000_gives_500_per_class():
    train, val = stratified_split(CIFAR_LABELS, 5000, seed=0)
    assert train.dtype == val.dtype == torch.int64
    assert len(val) == 5000 and len(train) == 45000
    assert torch.bincount(CIFAR_LABELS[val]).tolist() == [500] * 10
    assert torch.equal(torch.sort(torch.cat([train, val])).values, torch.arange(50000))  # a partition
    assert torch.all(train[1:] > train[:-1]) and torch.all(val[1:] > val[:-1])  # sorted


def test_fraction_equals_count_and_is_deterministic():
    a = stratified_split(CIFAR_LABELS, 0.1, seed=3)
    b = stratified_split(CIFAR_LABELS.numpy(), 5000, seed=3)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])
    assert not torch.equal(a[1], stratified_split(CIFAR_LABELS, 5000, seed=4)[1])


def test_imbalanced_classes_split_proportionally():
    labels = np.repeat([0, 1, 2], [50, 30, 20])
    _, val = stratified_split(labels, 10, seed=0)
    assert np.bincount(labels[val.numpy()]).tolist() == [5, 3, 2]
    _, val = stratified_split(labels, 7, seed=0)  # exact shares 3.5, 2.1, 1.4: remainders go 0, 2
    assert np.bincount(labels[val.numpy()], minlength=3).tolist() == [4, 2, 1]


def test_split_errors():
    with pytest.raises(DataError, match="leaving none"):
        stratified_split([0, 0, 1], 2, seed=0)  # shares 1.33, 0.67: class 1 would give its only example
    with pytest.raises(DataError, match="val_size"):
        stratified_split(CIFAR_LABELS, 50000, seed=0)
    with pytest.raises(DataError, match="val_size"):
        stratified_split(CIFAR_LABELS, 1.5, seed=0)
    # numpy's own refusal of a negative seed ("expected non-negative integer") named neither
    with pytest.raises(DataError, match=r"^seed=-1: must be an integer >= 0$"):
        stratified_split(CIFAR_LABELS, 5000, seed=-1)


def test_few_per_class():
    idx = few_per_class(CIFAR_LABELS, 10, seed=1)
    assert idx.dtype == torch.int64 and len(idx) == 100
    assert torch.bincount(CIFAR_LABELS[idx]).tolist() == [10] * 10
    assert torch.all(idx[1:] > idx[:-1])
    assert torch.equal(idx, few_per_class(CIFAR_LABELS, 10, seed=1))
    assert not torch.equal(idx, few_per_class(CIFAR_LABELS, 10, seed=2))


def test_few_per_class_errors_on_small_class():
    with pytest.raises(DataError, match="class 1: 2"):
        few_per_class([0, 0, 0, 1, 1], 3, seed=0)
    with pytest.raises(DataError, match="k="):
        few_per_class([0, 1], 0, seed=0)
    with pytest.raises(DataError, match=r"^seed=-3: must be an integer >= 0$"):
        few_per_class([0, 1], 1, seed=-3)


def test_a_stratified_sample_may_keep_a_small_class_whole_and_is_the_split_s_held_part():
    from vitlab.data.splits import stratified_sample

    labels = torch.tensor([0] * 10 + [1])  # a class of one image: its proportional share of 6 rounds up to 1
    with pytest.raises(DataError, match=r"data.val_split=6: class id 1 has 1 example\(s\) and would give all 1 to the "
                                        r"held-out set, leaving none to train on"):
        stratified_split(labels, 6, 1, "data.val_split")
    # data.train_examples=6 is a training pool: keeping the one image is what it asks (it was refused as above)
    assert stratified_sample(labels, 6, 1, "data.train_examples").tolist()[-1] == 10
    assert len(stratified_sample(labels, 6, 1)) == 6
    balanced = torch.arange(30) % 3
    for size, seed in ((7, 0), (12, 5), (25, 2)):  # the same draw as before wherever the split allowed it
        assert torch.equal(stratified_sample(balanced, size, seed), stratified_split(balanced, size, seed)[1])
    with pytest.raises(DataError, match=r"data.train_examples=11: a count of examples in 1..10"):
        stratified_sample(labels, 11, 0, "data.train_examples")
