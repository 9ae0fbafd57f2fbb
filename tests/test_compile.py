"""``torch.compile`` with a change of input size (progressive resizing), forward and backward,
for the plain ViT and the hybrid, plain and under the fast layer: the compiled step equals eager.

Compiled as the trainer compiles (``vitlab/train/build.py``): ``dynamic=False``, one graph per
size.  With symbolic sizes, inductor's backward of the hybrid's root convolution asserted a
contiguous stride on its channels-last output after a size change (``expected size 4==4,
stride 2048==512 at dim=0``), once dynamo had seen a second size of the same code."""
from __future__ import annotations

import shutil

import pytest
import torch

import vitlab
import vitlab.fast as fast
from vitlab.config import ResNetConfig, ViTConfig

torch.set_num_threads(2)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                                   reason="inductor needs a C++ compiler on a CPU")]

MODELS = {
    "vit": ViTConfig(img_size=16, patch_size=4, width=32, depth=1, mlp_dim=64, num_heads=2, num_classes=3,
                     dynamic_img_size=True),
    "hybrid": ViTConfig(img_size=16, patch_size=1, width=32, depth=1, mlp_dim=64, num_heads=2, num_classes=3,
                        dynamic_img_size=True,
                        resnet=ResNetConfig(layers=(1,), img_size=16, norm="batch", width_factor=0.5)),
}


@pytest.mark.parametrize("optimized", [False, True], ids=["plain", "fast"])
@pytest.mark.parametrize("family", list(MODELS))
def test_compiled_training_survives_a_change_of_input_size(family, optimized):
    torch.manual_seed(0)
    model = vitlab.create_model(MODELS[family]).train()
    with torch.no_grad():
        model.head.weight.normal_()
    if optimized:
        fast.optimize(model)
    compiled = torch.compile(model, dynamic=False)
    for size in (8, 16, 8, 16):  # a graph per size
        x = torch.randn(4, 3, size, size)
        model.zero_grad()
        compiled(x).square().sum().backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(x).square().sum().backward()  # eager, the same batch (BatchNorm statistics move: compare grads)
        for g, want in zip(got, (p.grad for p in model.parameters())):
            torch.testing.assert_close(g, want, rtol=1e-3, atol=1e-4)
