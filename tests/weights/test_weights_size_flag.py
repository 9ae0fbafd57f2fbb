"""Weights that record neither their image size nor their heads: a 2x8 grid of 16 patches
(``helpers.sized_weights``) saved as an official .npz, a bare state dict and a timm file without its
.timm.json, read at ``weights_img_size`` and held to the same model saved in vitlab's layout, which
records its size; asked for its own size without it, the 16 positions were read as a 4x4 grid and
resampled to 2x8, in silence."""
import json

import pytest
import torch

from helpers.sized_weights import FLAG, LAYOUTS, SIZE, sized_model, write_sized_weights
from vitlab.cli import main
from vitlab.weights import WeightsError, load_config, load_model

HEADS = {"official": {}, "state-dict": {"num_heads": 2}, "timm": {"num_heads": 2}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return write_sized_weights(tmp_path_factory.mktemp("sized"))


def logits(model, size=SIZE):
    x = torch.randn(3, 3, *size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_2x8_grid_is_read_as_one_at_weights_img_size(layout, saved):
    file, _, ref = LAYOUTS[layout]
    path, heads = saved / file, HEADS[layout]
    reference = load_model(saved / ref)
    assert reference.cfg.img_size == SIZE
    model = load_model(path, weights_img_size=SIZE, **heads)
    assert model.cfg.img_size == SIZE
    torch.testing.assert_close(logits(model), logits(reference), rtol=0, atol=1e-5)
    # and resized from there, as the weights that record their size are
    torch.testing.assert_close(logits(load_model(path, weights_img_size=SIZE, img_size=(16, 64), **heads), (16, 64)),
                               logits(load_model(saved / ref, img_size=(16, 64)), (16, 64)), rtol=0, atol=1e-5)
    # nothing in the file tells a 2x8 grid from a 4x4 one: without a size the count is read as a square
    assert load_model(path, **heads).cfg.img_size == (16, 16)
    # asked for its own size, the 16 positions were read as 4x4 and resampled to 2x8, rows scrambled: refused
    with pytest.raises(WeightsError, match=r"16 patch positions: a 4x4 grid, or the 2x8 grid of img_size=\(8, 32\), "
                                           r"which the weights record nowhere; pass weights_img_size=\(height, width\)"
                                           r", the resolution the weights were trained at \(--weights-img-size HxW\)$"):
        load_model(path, img_size=SIZE, **heads)


def test_load_config_reads_the_size_given(saved):
    # the architecture a fine-tune plans with (its training size, its memory estimate) is the one it loads
    assert load_config(saved / "w.npz").img_size == (16, 16)
    assert load_config(saved / "w.npz", weights_img_size=SIZE).img_size == SIZE
    with pytest.raises(WeightsError, match=r"weights_img_size=16: the vitlab weights in .* record the resolution "
                                           r"they were trained at, 8x32"):
        load_config(saved / "ref.safetensors", weights_img_size=16)


def test_a_bare_state_dict_takes_its_grid_from_the_size_asked_for():
    # as the official, timm and Hugging Face readers do: a 2x6 grid (not a square count) was refused
    sd = sized_model().state_dict()
    sd["pos_embed.weight"] = sd["pos_embed.weight"][:, :13]
    assert load_model(sd, num_heads=2, img_size=(8, 24)).cfg.img_size == (8, 24)


def test_a_2d_table_refuses_a_size_of_another_grid():
    # the tables give the grid: weights_img_size of another one (16 patches too) was accepted and not read
    from vitlab.config import ViTConfig
    from vitlab.models import create_model

    sd = create_model(ViTConfig(img_size=SIZE, patch_size=4, width=16, depth=1, mlp_dim=32, num_heads=2,
                                num_classes=3, posemb="learned_2d")).state_dict()
    assert load_model(sd, num_heads=2, weights_img_size=SIZE).cfg.img_size == SIZE
    with pytest.raises(WeightsError, match=r"weights_img_size=16: the 2D position tables .* are of a 2x8 grid"):
        load_model(sd, num_heads=2, weights_img_size=16)


def test_a_bit_resnet_refuses_weights_img_size():
    # it has no position table; the field was refused as an unknown ResNetConfig field, with the list of them
    from test_weights_bit import bit_checkpoint

    with pytest.raises(WeightsError, match=r"^weights_img_size=32: a BiT ResNet has no position embeddings"):
        load_model(bit_checkpoint(0), weights_img_size=32)


# ----------------------------------------------------------------------------- the commands


def one_line_refusal(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"vitlab {command}: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("layout", ["state-dict", "timm"])
def test_convert_refuses_the_ambiguous_size_and_reads_the_given_one(layout, saved, tmp_path, capsys):
    file, heads, ref = LAYOUTS[layout]
    assert main(["convert", str(saved / file), str(tmp_path / "out"), *heads, "--img-size", FLAG]) == 2
    assert "--weights-img-size HxW" in one_line_refusal(capsys, "convert")
    assert not (tmp_path / "out").exists()
    assert main(["convert", str(saved / file), str(tmp_path / "out"), *heads, "--weights-img-size", FLAG]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["max_abs_logit_diff"] < 1e-6
    torch.testing.assert_close(logits(load_model(tmp_path / "out")), logits(load_model(saved / ref)),
                               rtol=0, atol=1e-5)
