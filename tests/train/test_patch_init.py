"""``model.patch_init="whiten"``: the patch embedding starts as a whitening of the data's patches."""
import pytest
import torch
from torch import nn

from vitlab.config import ConfigError
from vitlab.models.init import whiten_patch_embedding_
from vitlab.train.overrides import with_changes


def patch_rows(conv: nn.Conv2d, images: torch.Tensor) -> torch.Tensor:
    return conv(images).flatten(2).transpose(1, 2).reshape(-1, conv.out_channels)


def test_whitened_embeddings_are_decorrelated_with_unit_variance():
    torch.manual_seed(0)
    images = torch.randn(64, 3, 16, 16)
    images[:, 1] = 0.9 * images[:, 0] + 0.1 * images[:, 1] + 0.5  # correlated, off-centre channels
    conv = nn.Conv2d(3, 100, 4, 4)
    untouched = conv.weight[96:].clone()
    whiten_patch_embedding_(conv, images, eps=0.0)
    rows = patch_rows(conv, images).detach()
    first = rows[:, :48]
    assert torch.allclose(torch.cov(first.T), torch.eye(48), atol=1e-3)
    assert first.mean(0).abs().max() < 1e-4
    assert torch.allclose(rows[:, 48:96], -first, atol=1e-5)  # the +/- pairs
    assert torch.equal(conv.weight[96:], untouched)  # filters beyond 2 x 48 keep their init


def test_whiten_from_the_training_data_changes_only_the_patch_embedding(tiny):
    from vitlab.train.build import build

    plain, whitened = build(tiny()), build(with_changes(tiny("whiten"), {"model.patch_init": "whiten"}))
    for (name, a), (_, b) in zip(plain.model.named_parameters(), whitened.model.named_parameters()):
        assert torch.equal(a, b) != name.startswith("patch_embed"), name


def test_whiten_is_refused_where_it_cannot_apply(tiny):
    with pytest.raises(ConfigError, match="model.patch_init"):
        with_changes(tiny(), {"model.patch_init": "pca"})
    with pytest.raises(ConfigError, match="model.patch_init"):
        with_changes(tiny(), {"model.patch_init": "whiten", "model.init": "weights.safetensors"})
