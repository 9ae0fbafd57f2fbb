"""Tests for vitlab.models.axial (paper Appendix D.6)."""
import pytest
import torch

from vitlab.config import ViTConfig
from vitlab.models.axial import AxialVisionTransformer, along_columns, along_rows

# a 4 x 6 patch grid: rows and columns differ in length, so a transposition shows up
TINY = ViTConfig(img_size=(16, 24), patch_size=4, width=32, depth=2, mlp_dim=64, num_heads=2,
                 num_classes=3, classifier="gap", axial=True, posemb="learned_2d")


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("posemb", ["learned_1d", "learned_2d", "none"])
def test_forward_backward_reaches_every_parameter(posemb):
    torch.manual_seed(0)
    cfg = ViTConfig(**{**TINY.__dict__, "posemb": posemb})
    model = AxialVisionTransformer(cfg)
    x = torch.randn(2, 3, 16, 24)
    tokens = model.forward_features(x)
    assert tokens.shape == (2, 24, 32)
    logits = model.forward_head(tokens)
    assert logits.shape == (2, 3) and torch.count_nonzero(logits) == 0  # zero-initialised head
    with torch.no_grad():
        model.head.weight.normal_()  # a zero head would stop every gradient behind it
    model(x).square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_row_block_mixes_only_rows_and_column_block_only_columns():
    torch.manual_seed(0)
    model = AxialVisionTransformer(ViTConfig(**{**TINY.__dict__, "depth": 1})).eval()
    block = model.blocks[0]
    grid = torch.randn(1, 4, 6, 32)
    poked = grid.clone()
    poked[0, 1, 2] += torch.randn(32)  # perturb the patch in row 1, column 2 (not by a constant: LN removes it)

    def changed(f):
        with torch.no_grad():
            return (f(grid) - f(poked)).abs().amax(dim=-1)[0] > 1e-6  # (gh, gw) mask

    rows = torch.zeros(4, 6, dtype=torch.bool)
    rows[1] = True
    cols = torch.zeros(4, 6, dtype=torch.bool)
    cols[:, 2] = True
    assert torch.equal(changed(lambda g: along_rows(block.row, g)), rows)
    assert torch.equal(changed(lambda g: along_columns(block.col, g)), cols)
    # row then column: one layer already reaches every patch
    assert changed(block).all()


def test_axial_layer_is_plain_blocks_on_rows_then_columns():
    torch.manual_seed(0)
    model = AxialVisionTransformer(ViTConfig(**{**TINY.__dict__, "depth": 1})).eval()
    block = model.blocks[0]
    grid = torch.randn(2, 4, 6, 32)
    with torch.no_grad():
        by_row = torch.stack([block.row(grid[:, i]) for i in range(4)], dim=1)  # each (B, gw, D)
        by_col = torch.stack([block.col(by_row[:, :, j]) for j in range(6)], dim=2)  # each (B, gh, D)
        tokens = model.run_blocks(grid.reshape(2, 24, 32), (4, 6))  # raster order
    torch.testing.assert_close(along_rows(block.row, grid), by_row)
    torch.testing.assert_close(tokens, by_col.reshape(2, 24, 32))


@pytest.mark.parametrize("posemb, posemb_params", [("learned_1d", 196 * 768), ("learned_2d", 2 * 14 * 384)])
def test_axial_vit_b16_parameter_count(posemb, posemb_params):
    D, M, depth, classes = 768, 3072, 12, 1000
    # LN 2D, qkv 3D^2+3D, out proj D^2+D, LN 2D, MLP DM+M + MD+D
    block = 2 * D + (3 * D * D + 3 * D) + (D * D + D) + 2 * D + (D * M + M) + (M * D + D)
    patch_embed, head, final_ln = 3 * 16 * 16 * D + D, D * classes + classes, 2 * D
    # the same formula with one block per layer, a [class] token and 197 positions is
    # the official ViT-B/16 count, which anchors it
    assert depth * block + patch_embed + D + 197 * D + final_ln + head == 86_567_656
    expected = 2 * depth * block + patch_embed + posemb_params + final_ln + head
    cfg = ViTConfig(classifier="gap", axial=True, posemb=posemb)
    with torch.device("meta"):  # count without allocating 170M parameters
        model = AxialVisionTransformer(cfg)
    assert n_params(model) == expected
    assert len(model.blocks) == depth


def test_api_heads_and_names():
    model = AxialVisionTransformer(ViTConfig(**{**TINY.__dict__, "representation_size": 16}))
    x = torch.randn(1, 3, 16, 24)
    assert model.cfg.axial and model.cfg.depth == 2
    assert model.forward_head(model.forward_features(x), pre_logits=True).shape == (1, 16)
    keys = set(model.state_dict())
    assert {"blocks.1.row.attn.qkv.weight", "blocks.1.col.mlp.fc2.bias", "norm.weight", "head.weight"} <= keys
    model.reset_classifier(5)
    assert model(x).shape == (1, 5) and model.cfg.num_classes == 5
    model.reset_classifier(0)
    assert model(x).shape == (1, 16)
    with pytest.raises(ValueError, match="axial"):
        AxialVisionTransformer(ViTConfig(**{**TINY.__dict__, "axial": False, "classifier": "token"}))


def test_the_docstring_names_the_position_embedding_the_registry_builds():
    from vitlab.models.registry import get_config

    axial_doc = ViTConfig.__doc__.split("axial:")[1]
    for name in ("Axial-ViT-B/16", "Axial-ViT-B/32"):
        cfg = get_config(name)
        assert cfg.axial and f'"{cfg.posemb}"' in axial_doc and name.split("/")[0] in axial_doc
    assert "2D grid of" not in axial_doc


def test_the_plain_class_refuses_an_axial_config_it_would_build_as_full_attention():
    from vitlab.models.vit import VisionTransformer
    from vitlab.models.registry import create_model

    cfg = ViTConfig(img_size=16, patch_size=4, width=16, depth=1, num_heads=2, mlp_dim=32, num_classes=3,
                    axial=True, classifier="gap")
    with pytest.raises(ValueError, match=r"cfg.axial=True describes an Axial-ViT; build it with vitlab.create_model"):
        VisionTransformer(cfg)
    assert type(create_model(cfg)) is AxialVisionTransformer
