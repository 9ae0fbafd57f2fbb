"""`vitlab convert`: every export layout from one official checkpoint, read back with equal logits."""
import json

import numpy as np
import pytest

from test_weights_bit import bit_checkpoint
from test_weights_official import random_checkpoint
from test_weights_sources import big_vision_checkpoint
from vitlab.cli import main
from vitlab.config import ViTConfig
from vitlab.models.registry import build_model, create_model
from vitlab.weights import load_model, save_model


@pytest.mark.filterwarnings("ignore::vitlab.weights.ConventionWarning")
def test_convert_to_every_layout_and_back(tmp_path, capsys):
    np.savez(tmp_path / "c.npz", **random_checkpoint(0))
    outs = {"timm": "t.safetensors", "hf": "hf", "official": "o.npz", "vitlab": "v"}
    for fmt, out in outs.items():
        assert main(["convert", str(tmp_path / "c.npz"), str(tmp_path / out), "--to", fmt]) == 0
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert report["max_abs_logit_diff"] < 1e-5, fmt
    # and from an export to another: Hugging Face directory -> timm
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "t2.pth"), "--to", "timm"]) == 0


def test_convert_errors_are_one_line(tmp_path, capsys):
    ckpt = random_checkpoint(1, classifier="gap")
    np.savez(tmp_path / "g.npz", **ckpt)
    assert main(["convert", str(tmp_path / "g.npz"), str(tmp_path / "hf"), "--to", "hf"]) == 2
    assert "classifier='gap'" in capsys.readouterr().err


@pytest.mark.parametrize("out, layout, written", [
    ("w.npz", "timm", "a folder, or a .safetensors, .pth, .bin or .pt file"),
    ("w.pth", "vitlab", "a folder, or a .safetensors file"),
    ("w", "official", "a .npz file"),
    ("w.safetensors", "hf", "a folder"),
])
def test_convert_refuses_an_output_named_as_another_layout_s_file_before_reading(out, layout, written, tmp_path,
                                                                                 capsys):
    # the source does not exist: the output is checked first, so the message is the output's
    assert main(["convert", str(tmp_path / "absent.npz"), str(tmp_path / out), "--to", layout]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"vitlab convert: error: out={str(tmp_path / out)!r}: --to {layout} writes {written}"
    assert not (tmp_path / out).exists()


@pytest.mark.parametrize("layout", ["vitlab", "hf", "timm"])
def test_convert_into_a_training_runs_folder_is_refused_before_reading(layout, tmp_path, capsys):
    # `vitlab convert runs/b16 runs/b16 --to hf` replaced the run's config.json (its recipe) and its trained
    # model.safetensors, and said "wrote"
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"recipe": "demo", "optim": {"lr": 0.002}}))
    (run / "model.safetensors").write_bytes(b"the run's weights")
    assert main(["convert", str(tmp_path / "absent.npz"), str(run), "--to", layout]) == 2
    assert capsys.readouterr().err.strip() == (
        f"vitlab convert: error: {run}: its config.json is a training run's config, which saving a model there "
        "would replace, and the folder's model.safetensors with it; save into another folder")
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "model.safetensors"]
    assert (run / "model.safetensors").read_bytes() == b"the run's weights"


@pytest.mark.parametrize("layout, name", [("vitlab", "model.safetensors"), ("timm", "checkpoints/ckpt-00000003.pt"),
                                          ("official", "r.npz")])
def test_convert_to_a_file_in_a_training_runs_folder_is_refused_before_reading(layout, name, tmp_path, capsys):
    # `vitlab convert X runs/b16/model.safetensors` replaced the run's trained weights and said "wrote", where a
    # save into the folder itself was refused
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"recipe": "demo", "optim": {"lr": 0.002}}))
    (run / name).write_bytes(b"the run's weights")
    assert main(["convert", str(tmp_path / "absent.npz"), str(run / name), "--to", layout]) == 2
    assert capsys.readouterr().err.strip() == (
        f"vitlab convert: error: out={str(run / name)!r} lies in {run}, a training run's folder, whose files (its "
        "model.safetensors, checkpoints and records) it could replace; write it outside the run's folder")
    assert (run / name).read_bytes() == b"the run's weights"
    assert sorted(p.name for p in run.rglob("*")) == sorted(["checkpoints", "config.json", *name.split("/")[-1:]])


def test_convert_of_vitlab_weights_takes_their_recorded_resolution_only(tmp_path, capsys):
    # a vitlab file records the size it was trained at: --weights-img-size may repeat it, not contradict it
    save_model(build_model(ViTConfig(img_size=16, patch_size=4, width=32, depth=2, mlp_dim=48, num_heads=2,
                                     num_classes=5)), tmp_path / "run")
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "same"), "--weights-img-size", "16",
                 "--no-check"]) == 0
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "other"), "--weights-img-size", "32"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"vitlab convert: error: weights_img_size=32: the vitlab weights in {tmp_path / 'run'} record the "
                   "resolution they were trained at, 16x16; leave it out, or give that size (img_size= resizes the "
                   "weights)")
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("flag", ["--img-size", "--weights-img-size"])
@pytest.mark.parametrize("value", ["abc", "1x2x3", "0", "16x-4", "x16"])
def test_convert_refuses_a_size_that_is_not_one_in_one_line(flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        main(["convert", str(tmp_path / "absent.npz"), str(tmp_path / "out"), flag, value])
    assert refused.value.code == 2
    assert capsys.readouterr().err == (f"vitlab convert: error: argument {flag}: {value!r}: expected a positive size "
                                       "N or HxW, e.g. 384 or 384x512 (see vitlab convert --help)\n")


def test_convert_of_vitlab_weights_takes_their_recorded_heads_only(tmp_path, capsys):
    # a number of heads changes no shape: --num-heads 4 rewrote 2-head weights as a 4-head model, other logits
    save_model(build_model(ViTConfig(img_size=16, patch_size=4, width=32, depth=2, mlp_dim=48, num_heads=2,
                                     num_classes=5)), tmp_path / "run")
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "same"), "--num-heads", "2", "--no-check"]) == 0
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "other"), "--num-heads", "4"]) == 2
    assert capsys.readouterr().err.strip() == (f"vitlab convert: error: num_heads=4: the vitlab weights in "
                                               f"{tmp_path / 'run'} record the 2 attention heads they were trained "
                                               "with; leave it out, or give that number")
    assert not (tmp_path / "other").exists()


def test_a_name_given_with_weights_that_record_their_model_is_checked(tmp_path, capsys):
    # --name was dropped unread for weights that record their model (vitlab's, BiT's, big_vision's) while an
    # official .npz was held to it: ViT-Ti/16 weights converted with --name ViT-S/16 were written as they were
    from vitlab.weights import WeightsError, load_config

    save_model(create_model("ViT-Ti/16", img_size=16, num_classes=0), tmp_path / "run")
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "same"), "--name", "ViT-Ti_16", "--no-check"]) == 0
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "other"), "--name", "ViT-S/16"]) == 2
    assert capsys.readouterr().err.strip() == (
        "vitlab convert: error: the weights are not a ViT-S/16: width=192 (weights) vs 384 (ViT-S/16); mlp_dim=768 "
        "(weights) vs 1536 (ViT-S/16); num_heads=3 (weights) vs 6 (ViT-S/16)")
    assert not (tmp_path / "other").exists()
    with pytest.raises(WeightsError, match="not a ViT-S/16"):  # read from the file's config alone, too
        load_config(tmp_path / "run", name="ViT-S/16")
    with pytest.raises(WeightsError, match="not a BiT-R50x1: they hold a Vision Transformer"):
        load_model(tmp_path / "run", name="BiT-R50x1")
    bit = bit_checkpoint(0, (1, 2))
    assert load_model(bit).cfg.name == "BiT-R11x1"
    with pytest.raises(WeightsError, match=r"not a BiT-R50x1: layers=\(1, 2\) \(weights\) vs \(3, 4, 6, 3\)"):
        load_model(bit, name="BiT-R50x1")
    with pytest.raises(WeightsError, match="not a ViT-B/16: they hold a BiT ResNet, and ViT-B/16 is a Vision"):
        load_model(bit, name="ViT-B/16")
    with pytest.raises(WeightsError, match="not a ViT-B/16: width=32"):
        load_model(big_vision_checkpoint(1, "tok"), name="ViT-B/16")


@pytest.mark.parametrize("size", ["16x24", "8x32"])
def test_convert_to_official_at_a_non_square_size_reads_back_at_that_size(size, tmp_path, capsys):
    # an .npz records no resolution: read back without it, a 4x6 grid was refused after the file was written
    # ("not a square grid"), and the 2x8 grid of 8x32, 16 positions, was taken for a 4x4 grid
    np.savez(tmp_path / "c.npz", **random_checkpoint(0))  # 16x16, 4x4 patches
    # 8x32's 2x8 grid holds the 16 patches of c.npz's 4x4 one: which one c.npz holds is asked (it was read
    # as 4x4, as it is here, and a 2x8 one read so was resampled as 4x4 to 2x8 in silence)
    trained_at = ["--weights-img-size", "16"] if size == "8x32" else []
    convert = ["convert", str(tmp_path / "c.npz"), str(tmp_path / "o.npz"), "--to", "official", "--img-size", size]
    if trained_at:
        assert main(convert) == 2
        assert "or the 2x8 grid of img_size=(8, 32)" in capsys.readouterr().err
    assert main(convert + trained_at) == 0
    out = capsys.readouterr().out.strip().splitlines()
    h, w = map(int, size.split("x"))
    assert out[-2] == (f"an official .npz records no image size: read {tmp_path / 'o.npz'} with --weights-img-size "
                       f"{h}x{w} (load_model's weights_img_size=({h}, {w}))")
    assert json.loads(out[-1])["max_abs_logit_diff"] < 1e-5
    again = load_model(tmp_path / "o.npz", weights_img_size=(h, w))
    assert again.cfg.img_size == (h, w)


def test_convert_to_official_of_non_square_patches_reads_back_at_its_size(tmp_path, capsys):
    """A square 16-px image of 4x8 patches is a 4x2 grid of 8 positions, which an .npz holds without its size:
    the read-back took no size for a square image, was refused ('not a square grid') after the file was
    written, and the line saying which --weights-img-size reads it was not printed."""
    model = build_model(ViTConfig(img_size=16, patch_size=(4, 8), width=32, depth=1, mlp_dim=48, num_heads=2,
                                  num_classes=5))
    save_model(model, tmp_path / "run")
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "o.npz"), "--to", "official"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2] == (f"an official .npz records no image size: read {tmp_path / 'o.npz'} with --weights-img-size "
                       "16x16 (load_model's weights_img_size=(16, 16))")
    assert json.loads(out[-1])["max_abs_logit_diff"] < 1e-5


@pytest.mark.filterwarnings("ignore::vitlab.weights.ConventionWarning")
@pytest.mark.parametrize("layout, out", [("vitlab", "v"), ("hf", "hf"), ("timm", "t.safetensors")])
def test_convert_of_a_masked_patch_prediction_run_writes_no_untrained_head(layout, out, tmp_path, capsys):
    # MPP trains no classifier and saves its ViT with the zero head it was built with: predict and eval refuse
    # the run, but its conversion wrote that head with the run's class names, and predict of the converted
    # weights gave every image 10% of each class ("2", "3", "4" first); now a backbone, as --num-classes 0 writes
    run = tmp_path / "mpp"
    save_model(create_model(ViTConfig(img_size=16, patch_size=4, width=32, depth=1, mlp_dim=64, num_heads=4,
                                      num_classes=10)), run / "model.safetensors")
    (run / "config.json").write_text(json.dumps({"recipe": "mpp:target=color", "model": {"mpp": "color"}}))
    (run / "classes.json").write_text(json.dumps([str(i) for i in range(10)]))
    assert main(["convert", str(run), str(tmp_path / out), "--to", layout]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (f"{run}: pre-trained by masked patch prediction (model.mpp='color'), which trains no "
                        "classifier: written without its untrained head (num_classes=0); --num-classes N gives it "
                        "a new one")
    assert json.loads(lines[-1])["max_abs_logit_diff"] < 1e-5
    converted = load_model(str(tmp_path / out))
    assert converted.cfg.num_classes == 0 and not (tmp_path / out / "classes.json").exists()
    # a new head asked for is written, zero, without the run's class names, at any count (its own too)
    assert main(["convert", str(run), str(tmp_path / "new"), "--num-classes", "10"]) == 0
    assert "written with a new zero head of 10 classes" in capsys.readouterr().out
    assert load_model(str(tmp_path / "new")).cfg.num_classes == 10 and not (tmp_path / "new" / "classes.json").exists()
