"""The from-scratch schemes of ``vitlab.models.init`` on whole models: what each changes, and
the models each refuses (the training config's ``model.*_init`` settings reach them through
``vitlab.train.build``; tests/train/test_patch_init.py and test_init_schemes.py)."""
from __future__ import annotations

import copy

import pytest
import torch

import vitlab
from vitlab.config import ConfigError, ResNetConfig, ViTConfig
from vitlab.models.init import (mimetic_attention_, mimetic_attention_init_, sincos_posemb_init_,
                                whiten_patch_embedding_, whiten_patches_)
from vitlab.models.layers import Attention
from vitlab.models.mpp import MaskedPatchPrediction
from vitlab.models.posemb import posemb_sincos_2d


RESNET = ResNetConfig(layers=(1,), img_size=32, num_classes=5)  # a model with neither patches nor attention


def tiny(**fields) -> ViTConfig:
    base = dict(img_size=16, patch_size=4, width=32, depth=2, mlp_dim=64, num_heads=4, num_classes=5)
    base.update(fields)
    return ViTConfig(**base)


def changed(before: torch.nn.Module, after: torch.nn.Module) -> set[str]:
    return {name for (name, a), (_, b) in zip(before.named_parameters(), after.named_parameters())
            if not torch.equal(a, b)}


def test_whiten_patches_whitens_the_patch_embedding_inside_the_mpp_wrapper():
    torch.manual_seed(0)
    model = MaskedPatchPrediction(vitlab.create_model(tiny()))
    plain = copy.deepcopy(model)
    images = torch.rand(32, 3, 16, 16) * 2 - 1
    images[:, 1] = 0.8 * images[:, 0] + 0.2 * images[:, 1]  # correlated channels
    whiten_patches_(model, images)
    assert changed(plain, model) == {"vit.patch_embed.weight", "vit.patch_embed.bias"}
    reference = whiten_patch_embedding_(copy.deepcopy(plain.vit.patch_embed), images)
    assert torch.equal(model.vit.patch_embed.weight, reference.weight)
    assert torch.equal(model.vit.patch_embed.bias, reference.bias)
    # along the 16 largest principal directions the patches' embeddings are centred, decorrelated
    # and of unit variance (but for eps)
    rows = model.vit.patch_embed(images).detach().flatten(2).transpose(1, 2).reshape(-1, 32)[:, :16]
    assert rows.mean(0).abs().max() < 1e-4
    assert torch.allclose(torch.cov(rows.T), torch.eye(16), atol=0.02)


def test_whiten_patches_refuses_a_hybrid_and_integer_images():
    hybrid = vitlab.create_model(tiny(img_size=32, patch_size=1, resnet=ResNetConfig(layers=(1,), img_size=32)))
    with pytest.raises(ConfigError, match=r"^model.patch_init='whiten': only a plain ViT's .* use 'lecun'$"):
        whiten_patches_(hybrid, torch.zeros(2, 3, 32, 32))
    with pytest.raises(ConfigError, match="model.patch_init='whiten'"):
        whiten_patches_(vitlab.create_model(RESNET), torch.zeros(2, 3, 32, 32))
    with pytest.raises(ValueError, match="images: torch.uint8"):
        whiten_patches_(vitlab.create_model(tiny()), torch.zeros(2, 3, 16, 16, dtype=torch.uint8))


def test_mimetic_attention_init_draws_each_layer_in_turn_from_the_generator():
    torch.manual_seed(0)
    model = vitlab.create_model(tiny())
    plain = copy.deepcopy(model)
    mimetic_attention_init_(model, torch.Generator().manual_seed(7))
    assert changed(plain, model) == {f"blocks.{i}.attn.{p}.weight" for i in range(2) for p in ("qkv", "proj")}
    generator = torch.Generator().manual_seed(7)  # the same draws, layer by layer
    for mine, reference in zip(model.modules(), plain.modules()):
        if isinstance(reference, Attention):
            mimetic_attention_(reference, generator=generator)
            assert torch.equal(mine.qkv.weight, reference.qkv.weight)
            assert torch.equal(mine.proj.weight, reference.proj.weight)


def test_mimetic_attention_init_refuses_a_model_without_attention():
    resnet = vitlab.create_model(RESNET)
    with pytest.raises(ConfigError, match=r"^model.attn_init='mimetic': the model has no ViT attention layer; "
                                          r"use 'xavier'$"):
        mimetic_attention_init_(resnet, torch.Generator())


def test_sincos_posemb_init_sets_the_patch_rows_and_keeps_the_class_token_row():
    model = MaskedPatchPrediction(vitlab.create_model(tiny()))
    plain = copy.deepcopy(model)
    sincos_posemb_init_(model)
    table = model.vit.pos_embed.weight
    assert changed(plain, model) == {"vit.pos_embed.weight"}
    assert torch.equal(table[0, 1:], posemb_sincos_2d((4, 4), 32)[0])
    assert torch.equal(table[0, :1], plain.vit.pos_embed.weight[0, :1])


@pytest.mark.parametrize("fields", [dict(posemb="learned_2d"), dict(posemb="none"), dict(posemb_place="every_layer")])
def test_sincos_posemb_init_refuses_any_other_position_embedding(fields):
    with pytest.raises(ConfigError, match=r"^model.posemb_init='sincos': needs one learned 1D position embedding"):
        sincos_posemb_init_(vitlab.create_model(tiny(**fields)))
