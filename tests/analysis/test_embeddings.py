import numpy as np
import pytest
import torch

from vitlab.analysis.embeddings import (
    cosine_similarity_grid,
    filter_pca,
    patch_embedding_pca,
    position_embedding_table,
    position_similarity,
)
from vitlab.config import ViTConfig
from vitlab.models import create_model

TINY = ViTConfig(img_size=(12, 16), patch_size=4, width=32, depth=1, mlp_dim=64, num_heads=2, num_classes=3)


def test_pca_recovers_a_known_filter_bank():
    rng = np.random.default_rng(0)
    basis, _ = np.linalg.qr(rng.normal(size=(3 * 4 * 4, 3)))  # three orthonormal directions
    raw = rng.normal(size=(500, 3))
    q, _ = np.linalg.qr(raw - raw.mean(axis=0))  # zero-mean, uncorrelated columns
    coef = q * np.array([5.0, 2.0, 0.5])  # decreasing variance
    bank = (coef @ basis.T + 7.0).reshape(500, 3, 4, 4)  # + a constant mean filter, removed by centring
    comps, explained = filter_pca(bank, k=3)
    assert comps.shape == (3, 3, 4, 4) and explained.shape == (3,)
    flat = comps.reshape(3, -1)
    np.testing.assert_allclose(np.abs(flat @ basis), np.eye(3), atol=1e-8)  # same directions, in order
    np.testing.assert_allclose(explained, np.array([25.0, 4.0, 0.25]) / 29.25)
    assert explained[0] > explained[1] > explained[2]
    # deterministic sign: the largest-magnitude entry of each component is positive
    assert all(c[np.abs(c).argmax()] > 0 for c in flat)


def test_orthogonal_position_embeddings_give_identity_similarity():
    table = np.eye(6) * np.arange(1, 7)[:, None]  # orthogonal, different norms
    sim = cosine_similarity_grid(table, (2, 3))
    assert sim.shape == (2, 3, 2, 3)
    np.testing.assert_allclose(sim.reshape(6, 6), np.eye(6))


@pytest.mark.parametrize("posemb", ["learned_1d", "learned_2d"])
@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_smoke_on_tiny_models(posemb, classifier):
    torch.manual_seed(0)
    model = create_model(TINY, posemb=posemb, classifier=classifier)
    assert position_embedding_table(model).shape == (12, 32)
    sim = position_similarity(model)
    assert sim.shape == (3, 4, 3, 4)
    np.testing.assert_allclose(np.einsum("ijij->ij", sim), 1.0, atol=1e-6)
    comps, explained = patch_embedding_pca(model, k=28)
    assert comps.shape == (28, 3, 4, 4) and explained.shape == (28,)


def test_2d_embeddings_share_rows_and_columns():
    model = create_model(TINY, posemb="learned_2d")
    table = position_embedding_table(model).reshape(3, 4, 32)
    # 2D: X table in the first half is shared down each column
    np.testing.assert_allclose(table[0, :, :16], table[2, :, :16])


@pytest.mark.parametrize("posemb, says", [("none", "no position embeddings to compare, absolute or relative$"),
                                          ("relative", "no absolute position embeddings.*relative embeddings live")])
def test_models_without_absolute_embeddings_are_refused(posemb, says):
    """A model of none was told its relative embeddings live inside the attention: it has none."""
    with pytest.raises(ValueError, match=says) as err:
        position_similarity(create_model(TINY, posemb=posemb))
    assert posemb == "relative" or "relative embeddings live" not in str(err.value)


def test_a_bit_resnet_and_a_bad_k_are_refused_by_name():
    """They were "'BiTResNet' object has no attribute 'patch_embed'", "'ResNetConfig' object has no
    attribute 'posemb'" and, for k=-1, numpy's "IndexError: shape mismatch"."""
    from vitlab.config import ResNetConfig

    bit = create_model(ResNetConfig(layers=(1,), width_factor=0.5, img_size=32, num_classes=2))
    for analyse in (patch_embedding_pca, position_similarity):
        with pytest.raises(ValueError, match="^BiTResNet is not a Vision Transformer"):
            analyse(bit)
    for k in (0, -1, 2.5):
        with pytest.raises(ValueError, match=rf"^k={k!r}: must be a positive integer"):
            patch_embedding_pca(create_model(TINY), k=k)
