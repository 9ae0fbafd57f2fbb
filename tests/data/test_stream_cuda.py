"""The data path on a GPU: pinned memory, non-blocking copies and the next batch made on a side
stream hand over the same batches as the CPU path.  Skipped without a GPU (CI has none); run
them on a lent machine with ``python3 -m pytest -q tests/data/test_stream_cuda.py``."""
import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.data.loader import BatchStream
from vitlab.data.shards import pack_shards
from vitlab.data.stream import StreamLoader, open_source
from vitlab.data.transforms import TrainTransform, build_transform

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def shards(tmp_path):
    rng = np.random.default_rng(0)
    for c in range(3):
        (tmp_path / "folder" / f"c{c}").mkdir(parents=True)
        for i in range(16):
            Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(tmp_path / "folder" / f"c{c}" /
                                                                                    f"{i}.png")
    pack_shards(tmp_path / "folder", tmp_path / "shards", samples_per_shard=6)
    return open_source(str(tmp_path / "shards"))


def take(loader, n):
    it = iter(loader)
    return [tuple(t.cpu() for t in next(it)) for _ in range(n)]


def test_streamed_batches_on_the_gpu_equal_the_cpus(shards):
    kwargs = dict(image_size=16, seed=1, shuffle_buffer=8, workers=2)
    cpu, gpu = StreamLoader(shards, 8, **kwargs), StreamLoader(shards, 8, device="cuda", **kwargs)
    for (xc, yc), (xg, yg) in zip(take(cpu, 9), take(gpu, 9)):  # past an epoch (48 samples)
        assert torch.equal(xc, xg) and torch.equal(yc, yg)
    assert cpu.state_dict() == gpu.state_dict()  # the positions of the batches handed out, not of the one ahead


def test_streamed_augmentation_runs_on_the_gpu(shards):
    augment = TrainTransform(num_classes=3, image_size=(16, 16), crop="inception", mixup_alpha=0.8,
                             label_smoothing=0.1)
    loader = StreamLoader(shards, 8, augment=augment, seed=0, workers=2, device="cuda")
    x, y = next(iter(loader))
    assert x.device.type == "cuda" and x.dtype == torch.float32 and x.shape == (8, 3, 16, 16)
    assert torch.isfinite(x).all() and x.abs().max() <= 1.0 + 1e-6
    torch.testing.assert_close(y.sum(-1), torch.ones(8, device="cuda"))


def test_in_memory_batches_on_the_gpu_equal_the_cpus():
    images = torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8)
    labels = torch.arange(64) % 10
    cpu = BatchStream(images, labels, 16, seed=2)
    gpu = BatchStream(images, labels, 16, seed=2, device="cuda")
    grouped = BatchStream(images, labels, 16, seed=2, device="cuda", augment_batches=3)  # split on the side stream
    for (xc, yc), (xg, yg), (xs, ys) in zip(take(cpu, 4), take(gpu, 4), take(grouped, 4)):
        assert torch.equal(xc, xg) and torch.equal(yc, yg) and torch.equal(xc, xs) and torch.equal(yc, ys)
    transform = build_transform(TrainTransform(num_classes=10, crop="pad", image_size=8))
    x, y = next(iter(BatchStream(images, labels, 16, seed=2, transform=transform, device="cuda")))
    assert x.device.type == "cuda" and x.shape == (16, 3, 8, 8) and y.shape == (16, 10)


def test_augmenting_on_the_gpu_never_waits_for_the_device(shards):
    # every augmentation at once, in memory and streamed: an operation that reads a number back
    # from the GPU (item, nonzero, a blocking copy) raises under the sync debug mode
    augment = TrainTransform(num_classes=3, image_size=(16, 16), crop="inception", flip=True, alternate_flip=True,
                             randaug_ops=2, erase_prob=0.5, mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1)
    images = torch.randint(0, 256, (64, 3, 20, 20), dtype=torch.uint8)
    labels, transform = torch.arange(64) % 3, build_transform(augment)
    memory = BatchStream(images, labels, 16, seed=2, transform=transform, device="cuda")
    held_on_the_gpu = BatchStream(images.cuda(), labels.cuda(), 16, seed=2, transform=transform, device="cuda")
    streamed = StreamLoader(shards, 8, augment=augment, seed=0, workers=2, device="cuda")
    unmixed = build_transform(dataclasses.replace(augment, mixup_alpha=0.0, cutmix_alpha=0.0))
    grouped = BatchStream(images, labels, 8, seed=2, transform=unmixed, device="cuda", augment_batches=3)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for loader in (memory, held_on_the_gpu, streamed, grouped):
            batches = iter(loader)
            for _ in range(3):
                x, y = next(batches)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(x).all() and torch.allclose(y.sum(-1), torch.ones(8, device="cuda"))
