"""Exported models compute what the PyTorch model computes."""
from __future__ import annotations

import json
import re

import pytest
import torch

from vitlab.config import ResNetConfig, ViTConfig, replace
from vitlab.export import export_onnx, export_program, load_program
from vitlab.models.registry import build_model

TINY = ViTConfig(width=32, depth=2, mlp_dim=64, num_heads=4, num_classes=7, img_size=32, patch_size=8)


def _random_model(cfg):
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():  # the zero-initialised head would make every comparison trivial
        for p in model.parameters():
            p.normal_(std=0.1)
    return model


def test_onnx_runtime_matches_pytorch(tmp_path, caplog):
    import logging

    from vitlab.export import TORCHVISION_NOTICES

    ort = pytest.importorskip("onnxruntime")
    model = _random_model(TINY)
    level = logging.getLogger(TORCHVISION_NOTICES).level
    path = export_onnx(model, tmp_path / "vit.onnx")
    # no notice of torchvision's operators, which no vitlab model uses; the exporter's logger as it was
    assert not [r for r in caplog.records if "torchvision" in r.getMessage()]
    assert logging.getLogger(TORCHVISION_NOTICES).level == level
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (1, 3):  # the batch is dynamic
        x = torch.randn(batch, 3, 32, 32)
        got = session.run(None, {"images": x.numpy()})[0]
        with torch.no_grad():
            ref = model(x).numpy()
        assert got.shape == (batch, 7)
        assert abs(got - ref).max() < 1e-4


@pytest.mark.parametrize("cfg", [
    TINY,
    ResNetConfig(layers=(1, 1), num_classes=5, img_size=32),  # SAME padding computed from the input
], ids=["vit", "bit"])
def test_torch_export_reloads_and_matches(tmp_path, cfg):
    model = _random_model(cfg)
    export_program(model, tmp_path / "model.pt2")
    loaded = load_program(tmp_path / "model.pt2")
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(loaded(x), model(x), atol=1e-5)


def test_an_export_that_fails_while_writing_leaves_the_earlier_file_as_it_was(tmp_path, monkeypatch):
    """The exporters wrote in place of the file: a write cut short (a full disk, a kill) left half a
    program where a good one was."""
    import os

    model = _random_model(TINY)
    path = tmp_path / "model.pt2"
    export_program(model, path)
    good = path.read_bytes()

    def cut_short(program, f, **kwargs):
        with open(f, "wb") as out:
            out.write(good[:100])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch.export, "save", cut_short)
    with pytest.raises(OSError, match="No space left"):
        export_program(model, path)
    assert path.read_bytes() == good and os.listdir(tmp_path) == ["model.pt2"]  # nothing left beside it
    load_program(path)


def test_cli_export(tmp_path, capsys):
    from vitlab.cli import export as command

    parser = __import__("argparse").ArgumentParser()
    command.add_arguments(parser)
    out = tmp_path / "ti.pt2"
    args = parser.parse_args(["ViT-Ti/16", "--format", "torch-export", "--out", str(out), "--img-size", "32",
                              "--check"])
    assert command.run(args) == 0
    assert out.is_file()
    assert "max |exported - pytorch|" in capsys.readouterr().out
    from vitlab.export import read_preprocessing

    assert read_preprocessing(out)["image_size"] == [32, 32]  # the size exported, not the registry's 224


def test_export_takes_a_size_as_convert_does_n_or_hxw(tmp_path, capsys):
    # --img-size took N only: a non-square model could not be exported at another non-square size
    from vitlab.cli import main
    from vitlab.export import read_preprocessing
    from vitlab.weights import save_model

    save_model(_random_model(ViTConfig(width=32, depth=1, mlp_dim=64, num_heads=4, num_classes=3, img_size=(32, 48),
                                       patch_size=8)), tmp_path / "run")
    for size, expected in (("48x64", [48, 64]), ("40,24", [40, 24]), ("16", [16, 16])):
        out = tmp_path / f"m{size}.pt2"
        assert main(["export", str(tmp_path / "run"), "--out", str(out), "--img-size", size, "--check"]) == 0
        assert f"input (B, C, {expected[0]}, {expected[1]})" in capsys.readouterr().out
        assert read_preprocessing(out)["image_size"] == expected
    with pytest.raises(SystemExit) as refused:
        main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "m.pt2"), "--img-size", "16x-4"])
    assert refused.value.code == 2
    assert capsys.readouterr().err == ("vitlab export: error: argument --img-size: '16x-4': expected a positive size "
                                       "N or HxW, e.g. 384 or 384x512 (see vitlab export --help)\n")
    assert not (tmp_path / "m.pt2").exists()


def test_cli_export_checkpoint_fixed_batch(tmp_path, capsys):
    """A saved checkpoint goes through vitlab's loader; a fixed batch is baked into the program."""
    from vitlab.cli import main
    from vitlab.weights.native import save_model

    model = _random_model(TINY)
    save_model(model, tmp_path / "tiny.safetensors")
    out = tmp_path / "tiny.pt2"
    assert main(["export", str(tmp_path / "tiny.safetensors"), "--format", "torch-export", "--out", str(out),
                 "--batch", "3", "--check"]) == 0
    assert "batch 3" in capsys.readouterr().out
    with torch.no_grad():
        x = torch.randn(3, 3, 32, 32)
        assert torch.allclose(load_program(out)(x), model(x), atol=1e-5)


def test_export_cli_writes_beside_the_weights_without_out(tmp_path, capsys):
    """The README's `vitlab export runs/x --format onnx` (no --out): runs/x/model.onnx."""
    from vitlab.cli import main
    from vitlab.weights import save_model

    pytest.importorskip("onnxscript")
    run = tmp_path / "x"
    save_model(_random_model(TINY), run)
    assert main(["export", str(run), "--format", "onnx"]) == 0
    assert (run / "model.onnx").is_file() and str(run / "model.onnx") in capsys.readouterr().out
    assert main(["export", str(run / "model.safetensors"), "--format", "torch-export"]) == 0
    assert (run / "model.pt2").is_file()


def test_export_cli_takes_the_format_from_the_out_suffix_and_refuses_a_conflict(tmp_path, capsys):
    """`--out m.pt2` without --format is a torch.export program (it was an ONNX model named .pt2);
    a --format that contradicts the suffix is refused before the model is traced."""
    from vitlab.cli import main
    from vitlab.weights import save_model

    model = _random_model(TINY)
    save_model(model, tmp_path / "tiny.safetensors")
    assert main(["export", str(tmp_path / "tiny.safetensors"), "--out", str(tmp_path / "m.pt2")]) == 0
    assert "(torch-export," in capsys.readouterr().out
    with torch.no_grad():
        x = torch.randn(2, 3, 32, 32)
        assert torch.allclose(load_program(tmp_path / "m.pt2")(x), model(x), atol=1e-5)
    out = tmp_path / "n.pt2"
    assert main(["export", str(tmp_path / "tiny.safetensors"), "--format", "onnx", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (f"vitlab export: error: --out={str(out)!r}: --format onnx writes a .onnx "
                                               "file (.pt2 is torch-export's); name it .onnx, or leave --format out")
    assert not out.exists()


def test_export_cli_refuses_an_out_named_as_weights_and_leaves_them_as_they_were(tmp_path, capsys):
    """`vitlab export run/model.safetensors --out run/model.safetensors` (a suffix of neither format:
    ONNX) wrote the ONNX model over the weights it was made from; any weights suffix is refused now."""
    from vitlab.cli import main
    from vitlab.weights import save_model

    weights = tmp_path / "tiny.safetensors"
    save_model(_random_model(TINY), weights)
    before = weights.read_bytes()
    assert main(["export", str(weights), "--out", str(weights)]) == 2
    assert capsys.readouterr().err.strip() == (f"vitlab export: error: --out={str(weights)!r}: a .safetensors file is "
                                               "read as weights, not as an export; name it .onnx or .pt2")
    assert weights.read_bytes() == before
    assert main(["export", str(weights), "--format", "torch-export", "--out", str(tmp_path / "m.pth")]) == 2
    assert not (tmp_path / "m.pth").exists()


def test_export_cli_refuses_an_out_over_a_training_run_s_files(tmp_path, capsys):
    """`vitlab export runs/b16 --out runs/b16/config.json` (a suffix of neither format: ONNX) wrote the ONNX
    model over the run's config; in a run's folder an export is an .onnx or .pt2 file, which no run writes."""
    from vitlab.cli import main
    from vitlab.weights import save_model

    pytest.importorskip("onnxscript")
    run = tmp_path / "run"
    save_model(_random_model(TINY), run / "model.safetensors")
    config = json.dumps({"recipe": "demo", "optim": {"lr": 0.002}})
    for name in ("config.json", "summary.json", "curves.png"):
        (run / name).write_text(config)
        assert main(["export", str(run), "--out", str(run / name)]) == 2
        assert capsys.readouterr().err.strip() == (
            f"vitlab export: error: --out={str(run / name)!r} lies in {run}, a training run's folder, whose files "
            "(its model.safetensors, checkpoints and records) it could replace; name it .onnx or .pt2, or write it "
            "outside the run's folder")
        assert (run / name).read_text() == config
    assert main(["export", str(run)]) == 0  # the default, beside the run's weights
    assert (run / "model.onnx").is_file()


def test_export_cli_says_a_missing_weights_file_is_missing(tmp_path, capsys):
    """A weights file that is not there was taken for a registry name: "unknown model '.../x.safetensors'"."""
    from vitlab.cli import main

    missing = tmp_path / "runs" / "x.safetensors"
    assert main(["export", str(missing), "--out", str(tmp_path / "m.pt2")]) == 2
    assert capsys.readouterr().err.strip() == f"vitlab export: error: no such file or directory: {missing}"


def test_a_dynamic_batch_program_takes_any_batch(tmp_path):
    """The batch was bounded at 4096, which the .pt2 program checks at every call: a larger batch
    failed with "Guard failed: x.size()[0] <= 4096" (the export said "batch dynamic", any batch)."""
    cfg = ViTConfig(width=16, depth=1, mlp_dim=16, num_heads=2, num_classes=3, img_size=8, patch_size=4)
    model = _random_model(cfg)
    export_program(model, tmp_path / "model.pt2")
    x = torch.randn(4100, 3, 8, 8)
    with torch.no_grad():
        assert torch.allclose(load_program(tmp_path / "model.pt2")(x), model(x), atol=1e-5)


@pytest.mark.parametrize("batch", [1, 0, True, 2.0])
def test_an_example_batch_a_dynamic_export_cannot_trace_is_refused_by_name(tmp_path, batch):
    """batch=1 (the default dynamic batch) ended in torch.export's "Constraints violated (batch)!" traceback,
    and a batch that is no integer in torch.randn's TypeError."""
    with pytest.raises(ValueError, match=rf"^batch={batch!r}: "):
        export_program(_random_model(TINY), tmp_path / "model.pt2", batch=batch)
    assert not (tmp_path / "model.pt2").exists()
    export_program(_random_model(TINY), tmp_path / "one.pt2", batch=1, dynamic_batch=False)  # a fixed batch of 1


@pytest.mark.parametrize("export, suffix", [(export_onnx, ".onnx"), (export_program, ".pt2")])
@pytest.mark.parametrize("img_size", [(32, 48), 36])
def test_a_size_the_model_does_not_take_is_refused_by_name_before_tracing(tmp_path, export, suffix, img_size):
    """img_size=(32, 48) for a 32x32 model ended in torch.onnx's TorchExportError, a page of advice on
    torch.export, and in the model's own error from inside the trace for a program; 36 is no grid of 8x8
    patches, for a dynamic_img_size model too."""
    if export is export_onnx:
        pytest.importorskip("onnxscript")
    for cfg in (TINY, replace(TINY, dynamic_img_size=True)):
        if cfg.dynamic_img_size and img_size != 36:
            continue
        with pytest.raises(ValueError, match=re.escape(f"img_size={img_size!r}: ")):
            export(_random_model(cfg), tmp_path / f"m{suffix}", img_size=img_size)
        assert not (tmp_path / f"m{suffix}").exists()


def test_an_onnx_opset_the_exporter_cannot_reach_is_refused_not_replaced(tmp_path):
    """torch.onnx logs a failed conversion and keeps the graph at its own opset: opset=16 wrote an
    opset-18 model without a word."""
    pytest.importorskip("onnxscript")
    with pytest.raises(ValueError, match=r"^opset=16: torch.onnx could not write this model at that opset"):
        export_onnx(_random_model(TINY), tmp_path / "m.onnx", opset=16)
    assert not (tmp_path / "m.onnx").exists()


def test_export_cli_refuses_name_beside_a_registry_name(tmp_path, capsys):
    """`vitlab export ViT-Ti/16 --name ViT-S/16` exported a ViT-Ti/16: --name was ignored."""
    from vitlab.cli import main

    out = tmp_path / "m.pt2"
    assert main(["export", "ViT-Ti/16", "--name", "ViT-S/16", "--img-size", "32", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == ("vitlab export: error: --name='ViT-S/16': names the model of weights "
                                               "whose shapes do not give it; 'ViT-Ti/16' is a registry name already")
    assert not out.exists()


@pytest.mark.parametrize("suffix", [".onnx", ".pt2"])
def test_an_export_records_the_input_vitlab_predict_gives_the_model(tmp_path, capsys, monkeypatch, suffix):
    """An ONNX or .pt2 export stated no input preprocessing, and a deployer of the file without vitlab had
    to guess vitlab's p / 127.5 - 1 and its resize; the file states them now, and they are what predict does
    (an image wider and shorter than the model: shrunk along one side, stretched along the other)."""
    import numpy as np
    from PIL import Image

    from helpers.preprocessing import as_recorded, predict_input
    from vitlab.cli import main
    from vitlab.export import read_preprocessing
    from vitlab.weights import save_model

    if suffix == ".onnx":
        pytest.importorskip("onnxscript")
    save_model(_random_model(ViTConfig(width=32, depth=1, mlp_dim=64, num_heads=4, num_classes=3, img_size=(32, 48),
                                       patch_size=8)), tmp_path / "run")
    image = tmp_path / "x.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 75, 3), dtype=np.uint8)).save(image)
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / f"m{suffix}")]) == 0
    record = read_preprocessing(tmp_path / f"m{suffix}")
    assert record["image_size"] == [32, 48] and record["channel_order"] == "RGB"
    if suffix == ".onnx":
        with pytest.raises(ValueError, match=r"x\.png: neither a \.pt2 program nor an ONNX model"):
            read_preprocessing(image)
    torch.testing.assert_close(as_recorded(record, image), predict_input(tmp_path / "run", image, monkeypatch),
                               atol=1e-5, rtol=0)
    if suffix == ".onnx":  # where a deployer reads it: ONNX Runtime's custom metadata, one entry a field
        ort = pytest.importorskip("onnxruntime")
        meta = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).get_modelmeta()
        assert meta.custom_metadata_map["input_layout"] == "NCHW" and \
            json.loads(meta.custom_metadata_map["mean"]) == record["mean"]


@pytest.mark.parametrize("suffix", [".onnx", ".pt2"])
def test_an_export_states_how_an_image_is_decoded_and_an_earlier_export_without_it_reads(tmp_path, monkeypatch,
                                                                                         suffix):
    """The record said how the model's input is made from an image's pixels, not how the pixels are had: a
    deployer decoding as Hugging Face's load_image does (EXIF orientation applied) gave the model another input
    than predict for a rotated photo; ``decode`` states vitlab's rule, and an export made before it reads."""
    import numpy as np
    from PIL import Image, ImageOps

    from helpers.preprocessing import as_recorded, predict_input
    from vitlab.export import PREPROCESSING_FILE, read_preprocessing
    from vitlab.weights import save_model

    if suffix == ".onnx":
        pytest.importorskip("onnxscript")
    model = _random_model(ViTConfig(width=32, depth=1, mlp_dim=64, num_heads=4, num_classes=3, img_size=32,
                                    patch_size=8))
    save_model(model, tmp_path / "run")
    out = tmp_path / f"m{suffix}"
    (export_onnx if suffix == ".onnx" else export_program)(model, out)
    record = read_preprocessing(out)
    assert record["decode"] == ("Pillow's, the first frame, the pixels as stored: EXIF orientation not applied; "
                                "Image.convert('RGB'), alpha dropped (not composited); 16-bit grayscale to 8 bits "
                                "as v / 257, rounded")
    photo = Image.fromarray(np.random.default_rng(0).integers(0, 256, (24, 40, 3), dtype=np.uint8))
    exif = photo.getexif()
    exif[0x0112] = 6  # orientation: stored sideways, shown turned a quarter
    photo.save(tmp_path / "photo.jpg", exif=exif, quality=95)
    given = predict_input(tmp_path / "run", tmp_path / "photo.jpg", monkeypatch)
    torch.testing.assert_close(as_recorded(record, tmp_path / "photo.jpg"), given, atol=1e-5, rtol=0)
    turned = tmp_path / "turned.png"  # what load_image hands a processor
    ImageOps.exif_transpose(Image.open(tmp_path / "photo.jpg")).save(turned)
    assert not torch.allclose(as_recorded(record, turned), given, atol=0.1)

    earlier = {k: v for k, v in record.items() if k != "decode"}  # an export of before the field
    if suffix == ".onnx":
        import onnx

        proto = onnx.load(str(out))
        kept = [p for p in proto.metadata_props if p.key != "decode"]
        del proto.metadata_props[:]
        proto.metadata_props.extend(kept)
        onnx.save(proto, str(out))
    else:
        torch.export.save(torch.export.load(out), out, extra_files={PREPROCESSING_FILE: json.dumps(earlier)})
    assert read_preprocessing(out) == earlier


def test_export_check_without_onnxruntime_writes_nothing(tmp_path, capsys, monkeypatch):
    """`vitlab export ... --check` without onnxruntime wrote the ONNX file, then stopped at the check with
    the error; and without onnx or onnxscript it loaded the model (downloaded it, for a Hub name) first.
    Either is said before anything is loaded or written now."""
    import sys

    import vitlab.cli.export as command
    from vitlab.cli import main

    out = tmp_path / "m.onnx"
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # not installed
    assert main(["export", "ViT-Ti/16", "--img-size", "32", "--out", str(out), "--check"]) == 2
    assert capsys.readouterr().err.strip() == ('vitlab export: error: --check of an ONNX export needs onnxruntime, '
                                               'which is not installed: pip install -e ".[export]"')
    assert not out.exists() and list(tmp_path.iterdir()) == []
    monkeypatch.setitem(sys.modules, "onnxscript", None)
    monkeypatch.setattr(command, "_load", lambda *args: pytest.fail("the model was loaded"))
    assert main(["export", "ViT-Ti/16", "--out", str(out)]) == 2
    assert "ONNX export needs onnxscript, which is not installed" in capsys.readouterr().err


def test_export_names_the_weights_whose_class_names_do_not_match_the_head(tmp_path, capsys):
    """A classes.json of another count beside the weights was refused as "class_names: 2 class names for a
    model of 7 classes", the library's argument, which a user of the command never gave: the weights are named."""
    from vitlab.cli import main
    from vitlab.weights import save_model

    save_model(_random_model(TINY), tmp_path / "run")
    (tmp_path / "run" / "classes.json").write_text(json.dumps(["a", "b"]))
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "m.pt2")]) == 2
    assert capsys.readouterr().err.strip() == (f"vitlab export: error: {tmp_path / 'run'}: its 2 class names do not "
                                               "match the 7 classes of its head (a classes.json from another run?)")
    assert not (tmp_path / "m.pt2").exists()


def test_export_of_a_folder_that_is_not_there_says_so(tmp_path, capsys, monkeypatch):
    """`vitlab export run3`, a run folder mistyped, was taken for a registry name alone: "unknown model 'run3'"."""
    from vitlab.cli import main
    from vitlab.models.registry import list_models

    monkeypatch.chdir(tmp_path)
    assert main(["export", "run3"]) == 2
    assert capsys.readouterr().err.strip() == ("vitlab export: error: run3: no such file or folder, and unknown model "
                                               f"'run3'. `vitlab models` lists all {len(list_models())} names.")
    assert list(tmp_path.iterdir()) == []
