"""Weights that record neither their image size nor their heads, read by every command that reads weights.

A 2x8 grid of 16 patches (``helpers.sized_weights``) saved as an official .npz, a bare state dict and a
timm file without its .timm.json was read as a 4x4 grid: `convert` alone had --weights-img-size, and
eval, predict, inspect, fewshot and export had no way to say the size (nor the heads of a state dict).
Each now takes --name, --num-heads and --weights-img-size (``vitlab.cli.add_weights_arguments``), and
every reading is held to the same model saved in vitlab's layout, which records its size."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from helpers.sized_weights import FLAG, LAYOUTS, SIZE, sized_model, write_sized_weights
from vitlab.cli import main
from vitlab.weights import WeightsError, load_config, load_model

HEADS = {"official": {}, "state-dict": {"num_heads": 2}, "timm": {"num_heads": 2}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = write_sized_weights(tmp_path_factory.mktemp("sized"))
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (24, 40, 3), dtype=np.uint8)).save(folder / "x.png")
    return folder


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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_eval_reads_the_weights_at_weights_img_size(layout, saved, capsys):
    file, heads, ref = LAYOUTS[layout]
    base = ["eval", "--data", "digits", "--val-split", "60", "--json", "--no-fast"]
    assert main(base + ["--checkpoint", str(saved / ref)]) == 0
    expected = json.loads(capsys.readouterr().out)
    assert main(base + ["--checkpoint", str(saved / file), *heads, "--img-size", FLAG]) == 2
    assert "--weights-img-size HxW" in one_line_refusal(capsys, "eval")  # not scored on a scrambled grid
    assert main(base + ["--checkpoint", str(saved / file), *heads, "--weights-img-size", FLAG]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["confusion_matrix"] == expected["confusion_matrix"] and got["n"] == 60
    assert got["top1"] == pytest.approx(expected["top1"]) and got["ece"] == pytest.approx(expected["ece"], abs=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_predict_reads_the_weights_at_weights_img_size_and_takes_img_size(layout, saved, capsys):
    file, heads, ref = LAYOUTS[layout]
    image = str(saved / "x.png")
    for size in ([], ["--img-size", "16x64"]):  # predict had no --img-size either
        assert main(["predict", "--checkpoint", str(saved / ref), "--json", "--no-fast", *size, image]) == 0
        expected = json.loads(capsys.readouterr().out)["top"]
        assert main(["predict", "--checkpoint", str(saved / file), *heads, "--weights-img-size", FLAG, "--json",
                     "--no-fast", *size, image]) == 0
        got = json.loads(capsys.readouterr().out)["top"]
        assert [t["class"] for t in got] == [t["class"] for t in expected]
        assert [t["prob"] for t in got] == pytest.approx([t["prob"] for t in expected], abs=2e-6)
    assert main(["predict", "--checkpoint", str(saved / file), *heads, "--img-size", FLAG, image]) == 2
    assert "--weights-img-size HxW" in one_line_refusal(capsys, "predict")


def test_predict_of_a_state_dict_takes_its_heads(saved, capsys):
    assert main(["predict", "--checkpoint", str(saved / "w.pth"), "--weights-img-size", FLAG, str(saved / "x.png")]) \
        == 2
    assert "(--name, --num-heads)" in one_line_refusal(capsys, "predict")
    assert main(["predict", "--checkpoint", str(saved / "w.pth"), "--name", "ViT-B/16", str(saved / "x.png")]) == 2
    assert "not a ViT-B/16" in one_line_refusal(capsys, "predict")
    with pytest.raises(SystemExit):  # a count of heads is a positive integer, refused as the flags are read
        main(["predict", "--checkpoint", str(saved / "w.pth"), "--num-heads", "0", str(saved / "x.png")])
    assert "argument --num-heads: '0': expected a positive integer" in one_line_refusal(capsys, "predict")


@pytest.mark.parametrize("layout", ["official", "timm"])
def test_fewshot_reads_the_weights_at_weights_img_size_and_caches_its_features_apart(layout, saved, tmp_path, capsys):
    file, heads, ref = LAYOUTS[layout]
    base = ["fewshot", "--data", "digits", "--val-split", "200", "--shots", "1", "--seeds", "1",
            "--holdout-per-class", "2", "--json", "--feature-cache", str(tmp_path)]
    assert main(base[:1] + [str(saved / ref)] + base[1:]) == 0
    expected = json.loads(capsys.readouterr().out)["fewshot"]
    # read as 4x4 at 16 px: the same file and size as the 2x8 grid resampled to 16 px below
    assert main(base[:1] + [str(saved / file), *heads, "--img-size", "16"] + base[1:]) == 0
    capsys.readouterr()
    assert main(base[:1] + [str(saved / file), *heads, "--weights-img-size", FLAG] + base[1:]) == 0
    assert json.loads(capsys.readouterr().out)["fewshot"] == expected
    assert main(base[:1] + [str(saved / file), *heads, "--weights-img-size", FLAG, "--img-size", "16"] + base[1:]) == 0
    captured = capsys.readouterr()
    assert "from 1797 images" in captured.err  # not the features of the 4x4 reading, cached under the file alone
    assert main(base[:1] + [str(saved / ref), "--img-size", "16"] + base[1:]) == 0
    assert json.loads(captured.out)["fewshot"] == json.loads(capsys.readouterr().out)["fewshot"]


def test_inspect_reads_the_weights_at_weights_img_size(saved, tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    import vitlab.analysis.report as report

    seen = []
    monkeypatch.setattr(report, "write_report", lambda model, *a, **k: seen.append(model) or tmp_path / "r.html")
    assert main(["inspect", str(saved / "w.npz"), "--images", str(saved / "x.png"), "--out", str(tmp_path / "r.html"),
                 "--weights-img-size", FLAG]) == 0
    assert seen[0].cfg.img_size == SIZE
    torch.testing.assert_close(logits(seen[0]), logits(load_model(saved / "ref.safetensors")), rtol=0, atol=1e-5)
    assert main(["inspect", str(saved / "w.npz"), "--images", str(saved / "x.png"), "--out", str(tmp_path / "r.html"),
                 "--img-size", FLAG]) == 2
    assert "--weights-img-size HxW" in one_line_refusal(capsys, "inspect")


def test_export_reads_the_weights_at_weights_img_size(saved, tmp_path, capsys, monkeypatch):
    import vitlab.export

    seen = []

    def export_program(model, out, size, **kw):
        seen.append((model, size))
        out.write_bytes(b"program")

    monkeypatch.setattr(vitlab.export, "export_program", export_program)
    out = tmp_path / "m.pt2"
    assert main(["export", str(saved / "t.safetensors"), "--num-heads", "2", "--weights-img-size", FLAG,
                 "--out", str(out)]) == 0
    assert "input (B, C, 8, 32)" in capsys.readouterr().out
    model, size = seen[0]
    assert tuple(size) == SIZE
    torch.testing.assert_close(logits(model), logits(load_model(saved / "timm-ref.safetensors")), rtol=0, atol=1e-5)
    # a registry name's random model reads no weights: the flag was not read
    assert main(["export", "ViT-Ti/16", "--weights-img-size", "224", "--out", str(out)]) == 2
    assert one_line_refusal(capsys, "export").strip() == (
        "vitlab export: error: --weights-img-size: how weights that do not record their model are read; "
        "'ViT-Ti/16' is a registry name, whose random weights are built at --img-size")


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


@pytest.mark.parametrize("command", ["eval", "predict", "inspect", "fewshot", "export", "convert", "train",
                                     "finetune", "sweep", "vtab"])
def test_every_command_that_reads_weights_takes_the_flag_in_one_form(command, capsys):
    from vitlab.cli import build_parser

    action = next(a for a in build_parser().commands[command]._actions if a.dest == "weights_img_size")
    assert action.option_strings == ["--weights-img-size"] and action.metavar == "N|HxW"
    assert action.type(FLAG) == SIZE and action.type("16") == 16
    with pytest.raises(SystemExit):
        main([command, "--weights-img-size", "16x"])
    assert "argument --weights-img-size: '16x': expected a positive size N or HxW" in one_line_refusal(capsys,
                                                                                                      command)
