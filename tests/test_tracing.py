"""Every model the library builds traces: torch.fx.symbolic_trace (feature extraction by fx, in the eval and the
training mode), torch.jit.trace and torch.export each give the model's outputs, the plain model's and the
``vitlab.fast`` one's.

One case per registered family (the registry's ViT, hybrids, Axial-ViT and BiT ResNet, shrunk) and per option of
the configs that changes what the forward runs (``ViTConfig``'s and ``ResNetConfig``'s ablations, the CIFAR recipe's
models), and the masked-patch-prediction wrapper, which fx alone traces (``XFAIL`` says why).  A trace is taken on a
batch of 2 and run on a batch of 3: what it holds is the model's operators, not the example's sizes.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import vitlab.fast as fast
from vitlab.config import ResNetConfig, ViTConfig, replace
from vitlab.configs.cifar10_scratch import MODELS as CIFAR_MODELS
from vitlab.models.mpp import MaskedPatchPrediction, MppOutput
from vitlab.models.registry import build_model, get_config

torch.set_num_threads(2)

SMALL = dict(width=32, depth=2, mlp_dim=64, num_heads=4, num_classes=5)


def tiny(**fields) -> ViTConfig:
    return ViTConfig(**{**SMALL, "img_size": 16, "patch_size": 4, **fields})


def registered(name: str, img_size: int):
    """The registry's config of ``name`` at a small width, depth and input; a ResNet (BiT's, a hybrid's stem) of
    half the width, with one unit a stage."""
    cfg = get_config(name)
    small_resnet = dict(width_factor=0.5, img_size=img_size)
    if isinstance(cfg, ResNetConfig):
        return replace(cfg, layers=(1,) * len(cfg.layers), num_classes=5, **small_resnet)
    resnet = cfg.resnet and replace(cfg.resnet, layers=(1,) * len(cfg.resnet.layers), **small_resnet)
    return replace(cfg, **SMALL, img_size=img_size, resnet=resnet)


def cifar(model: str) -> ViTConfig:
    """The CIFAR recipe's model ``model`` (its ``model.overrides``) at a small width and depth, a stem of half
    the width."""
    fields = {**CIFAR_MODELS[model], **SMALL}
    if "resnet" in fields:
        fields["resnet"] = dict(fields["resnet"], width_factor=0.5)
    return ViTConfig(**fields)


CASES = {
    # the registry's families
    "ViT-B/16": registered("ViT-B/16", 32),
    "R50x1+ViT-B/16": registered("R50x1+ViT-B/16", 32),  # the hybrids' stem: SAME padding from the input's size
    "R50x1+ViT-B/32": registered("R50x1+ViT-B/32", 64),
    "Axial-ViT-B/16": registered("Axial-ViT-B/16", 32),
    "BiT-R50x1": registered("BiT-R50x1", 32),
    # the ViT's options
    "gap": tiny(classifier="gap"),
    "pre-logits": tiny(representation_size=16),
    "no-head": tiny(num_classes=0),
    "non-square": tiny(img_size=(16, 24), patch_size=(4, 8)),
    "posemb-none": tiny(posemb="none"),
    "posemb-2d": tiny(posemb="learned_2d", img_size=(16, 24)),
    "posemb-relative": tiny(posemb="relative"),
    "posemb-every-layer": tiny(posemb_place="every_layer"),
    "posemb-every-layer-2d": tiny(posemb="learned_2d", posemb_place="every_layer"),
    "posemb-every-layer-shared": tiny(posemb_place="every_layer_shared"),
    "posemb-every-layer-shared-2d": tiny(posemb="learned_2d", posemb_place="every_layer_shared"),
    "distance": tiny(attn_bias="distance"),
    "distance-no-self-offsets": tiny(attn_bias="distance_no_self", attn_offsets=True, img_size=(16, 24)),
    "dynamic-img-size": tiny(dynamic_img_size=True),
    "patch-dropout": tiny(patch_dropout=0.25),
    "patch-dropout-distance": tiny(patch_dropout=0.25, attn_bias="distance_no_self", attn_offsets=True),
    "dropout-drop-path": tiny(dropout=0.1, attention_dropout=0.1, drop_path=0.1),
    "exact-gelu-no-qkv-bias": tiny(gelu="exact", qkv_bias=False),
    "axial-2d": tiny(axial=True, classifier="gap", posemb="learned_2d", img_size=(16, 24)),
    "axial-no-posemb": tiny(axial=True, classifier="gap", posemb="none"),
    # the hybrid's stem and the BiT ResNet's options
    "hybrid-symmetric": tiny(patch_size=1, resnet=ResNetConfig(layers=(1,), width_factor=0.5, img_size=16,
                                                                padding="symmetric")),
    "hybrid-root-alone": tiny(patch_size=1, resnet=ResNetConfig(layers=(), width_factor=0.5, img_size=16)),
    "hybrid-no-root-pool": tiny(patch_size=1, resnet=ResNetConfig(layers=(1,), width_factor=0.5, img_size=16,
                                                                   root_kernel=3, root_stride=1, root_pool=False)),
    "bit-same": ResNetConfig(layers=(1, 1), width_factor=0.5, img_size=32, num_classes=5, padding="same"),
    "bit-batch-norm": ResNetConfig(layers=(1, 1), width_factor=0.5, img_size=32, num_classes=5, norm="batch"),
    "bit-no-root-pool": ResNetConfig(layers=(1,), width_factor=0.5, img_size=16, num_classes=5, root_pool=False),
    # the CIFAR recipe's models: the distance penalty with offsets and GAP; BatchNorm and GroupNorm stems
    "cifar-vit": cifar("vit"),
    "cifar-hybrid": cifar("hybrid"),
    "cifar-hybrid-bit": cifar("hybrid_bit"),
    # masked patch prediction's wrapper around a plain ViT
    "mpp-color": "color",
    "mpp-pixels": "pixels",
}

TRACERS = ("fx", "fx-train", "jit", "export")

# (case, tracer) pairs that cannot work: why, and the error they end in.  Masked patch prediction is a training
# objective: it draws the patches it corrupts, counted in Python numbers from the batch's sizes, and returns its
# loss, predictions and targets in an MppOutput; what is served after it is its ``vit``, a plain ViT, traced above.
MPP_JIT = ("torch.jit.trace gives the sizes as tensors, which the corruption's count cannot round(), and a traced "
           "function returns tensors, or tuples, lists and dicts of them: not an MppOutput", TypeError)
MPP_EXPORT = ("torch.export: torch.rand with a generator argument (None too) has no kernel for a symbolic batch, "
              "and an MppOutput is no pytree it returns", RuntimeError)
XFAIL = {(case, tracer): why for case in ("mpp-color", "mpp-pixels")
         for tracer, why in (("jit", MPP_JIT), ("export", MPP_EXPORT))}


def make(case: str) -> nn.Module:
    """The case's model with every parameter drawn at random (zero-initialised heads and norms would hide
    differences behind them), in eval mode."""
    torch.manual_seed(0)
    spec = CASES[case]
    model = MaskedPatchPrediction(build_model(tiny()), target=spec) if isinstance(spec, str) else build_model(spec)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.1)
    return model.eval()


def images(model: nn.Module, batch: int) -> torch.Tensor:
    cfg = model.cfg
    return torch.randn(batch, cfg.in_chans, *cfg.img_size, generator=torch.Generator().manual_seed(batch))


def fields(out):
    """A model's output as a tuple of tensors: MPP's ``MppOutput`` field by field."""
    if isinstance(out, MppOutput):
        return out.loss, out.predictions, out.targets, out.fate
    return out if isinstance(out, tuple) else (out,)


def traced(model: nn.Module, tracer: str, x: torch.Tensor):
    if tracer.startswith("fx"):
        return torch.fx.symbolic_trace(model)
    if tracer == "jit":
        return torch.jit.trace(model, x, check_trace=False)  # the test's own check is on another batch
    program = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=1)},))
    return program.module()


def params():
    for case, spec in CASES.items():
        for tracer in TRACERS:
            # the fast path: a BiT ResNet has none of the dense layers and encoder blocks it replaces, and fx traces
            # an optimised model's plain forward, in either mode
            speeds = ("plain",) if isinstance(spec, ResNetConfig) or tracer == "fx-train" else ("plain", "fast")
            for speed in speeds:
                why = XFAIL.get((case, tracer))
                marks = [pytest.mark.xfail(reason=why[0], raises=why[1], strict=True)] if why else []
                yield pytest.param(case, tracer, speed, marks=marks, id=f"{case}-{tracer}-{speed}")


@pytest.mark.parametrize("case, tracer, speed", params())
def test_a_traced_model_gives_the_models_outputs(case, tracer, speed):
    """torch.fx.symbolic_trace stopped at Python code on a Proxy's sizes ('symbolically traced variables cannot be
    used as inputs to control flow', a Proxy unpacked or rounded, a factory given one as a size): relative position
    embeddings and the distance penalty (the CIFAR recipe's ViT) chose their table or grid by the sequence's length,
    SAME padding (every hybrid's stem, a BiT ResNet's by ResNetConfig's default) branched on the input's size, patch
    dropout in training ("fx-train": the graph in the training mode, which fx's feature extraction traces too, run
    on the same random draws) counted and drew the kept patches by the sequence's sizes, and masked patch
    prediction counted its corrupted patches and unpacked its targets' shape."""
    plain = make(case)
    model = fast.optimize(copy.deepcopy(plain)) if speed == "fast" else plain
    train = tracer == "fx-train"
    x, y = images(plain, 2), images(plain, 3)
    model.train(train)
    plain.train(train)
    with torch.no_grad():
        graph = traced(model, tracer, x)
        torch.manual_seed(1)
        got = fields(graph(y))
        torch.manual_seed(1)
        expected = fields(plain(y))
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
