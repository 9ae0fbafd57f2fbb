"""A run's class names travel into every export that has a place for them, and `vitlab predict`
on the export prints them (not Hugging Face's LABEL_0 placeholders)."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

import vitlab
from vitlab.cli import main
from vitlab.weights import WeightsError, read_class_names, save_model

NAMES = ["tabby cat", "golden retriever", "goldfish"]
pytestmark = pytest.mark.filterwarnings("ignore::vitlab.weights.ConventionWarning")


@pytest.fixture
def run(tmp_path):
    """A training run's folder as `vitlab train` leaves it: model.safetensors and classes.json."""
    torch.manual_seed(0)
    model = vitlab.create_model("ViT-Ti/16", img_size=16, patch_size=8, width=16, depth=1, num_heads=2, mlp_dim=32,
                                num_classes=3)
    with torch.no_grad():  # a zero head would tie every class
        for p in model.parameters():
            p.normal_(std=0.3)
    folder = tmp_path / "run"
    folder.mkdir()
    save_model(model, folder / "model.safetensors")
    (folder / "classes.json").write_text(json.dumps(NAMES))
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(tmp_path / "x.png")
    return folder


def predicted(checkpoint, image, capsys) -> list[str]:
    """The class names `vitlab predict` prints for one image, best first."""
    assert main(["predict", "--checkpoint", str(checkpoint), str(image), "--json", "--no-fast"]) == 0
    return [t["class"] for t in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["top"]]


def test_convert_to_hf_writes_the_runs_names_and_predict_prints_them(run, tmp_path, capsys):
    assert main(["convert", str(run), str(tmp_path / "hf"), "--to", "hf"]) == 0
    capsys.readouterr()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["id2label"] == {"0": "tabby cat", "1": "golden retriever", "2": "goldfish"}
    assert config["label2id"] == {"tabby cat": 0, "golden retriever": 1, "goldfish": 2}
    own = predicted(run, tmp_path / "x.png", capsys)
    assert sorted(own) == sorted(NAMES)
    assert predicted(tmp_path / "hf", tmp_path / "x.png", capsys) == own


def test_transformers_reads_the_names_of_the_hf_export(run, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    assert main(["convert", str(run), str(tmp_path / "hf"), "--to", "hf"]) == 0
    hf = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf")
    assert [hf.config.id2label[i] for i in range(3)] == NAMES and hf.config.label2id["goldfish"] == 2


@pytest.mark.parametrize("fmt, out", [("vitlab", "v"), ("vitlab", "v.safetensors"), ("timm", "t.safetensors"),
                                      ("timm", "t.pth")])
def test_every_layout_with_a_place_carries_the_names(run, tmp_path, capsys, fmt, out):
    (tmp_path / out).parent.mkdir(exist_ok=True)
    assert main(["convert", str(run), str(tmp_path / out), "--to", fmt]) == 0
    capsys.readouterr()
    assert read_class_names(tmp_path / out) == NAMES
    assert sorted(predicted(tmp_path / out, tmp_path / "x.png", capsys)) == sorted(NAMES)
    if fmt == "timm":
        sidecar = json.loads((tmp_path / (out.split(".")[0] + ".timm.json")).read_text())
        assert sidecar["pretrained_cfg_overlay"]["label_names"] == NAMES  # timm's PretrainedCfg field


def test_an_npz_has_no_place_and_says_so(run, tmp_path, capsys):
    assert main(["convert", str(run), str(tmp_path / "o.npz"), "--to", "official"]) == 0
    assert "class names are not written" in capsys.readouterr().out


def test_a_new_head_drops_the_names_and_a_mismatch_is_refused(run, tmp_path, capsys):
    assert main(["convert", str(run), str(tmp_path / "hf"), "--to", "hf", "--num-classes", "5"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["id2label"] == {str(i): f"LABEL_{i}" for i in range(5)}
    (run / "classes.json").write_text(json.dumps(NAMES[:2]))
    assert main(["convert", str(run), str(tmp_path / "hf2"), "--to", "hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "2 class names" in err and "3 classes" in err
    with pytest.raises(WeightsError, match="2 class names for a model of 3 classes"):
        save_model(vitlab.load_model(run), tmp_path / "v", class_names=NAMES[:2])


def test_a_vitlab_folder_saved_again_without_names_keeps_none_of_the_earlier_weights(run, tmp_path):
    folder = tmp_path / "v"
    save_model(vitlab.load_model(run), folder, class_names=NAMES)
    assert read_class_names(folder) == NAMES
    # another head, no names: the earlier classes.json, read before the metadata, named its 5 classes by 3
    save_model(vitlab.load_model(run, num_classes=5), folder)
    assert read_class_names(folder) is None and not (folder / "classes.json").exists()


def test_an_hf_or_timm_save_into_a_vitlab_folder_keeps_none_of_its_files(run, tmp_path):
    """A folder save replaces the folder's model; the files a vitlab save kept beside the weights it wrote
    stayed: its classes.json, read before id2label, named the Hugging Face model's classes by the earlier
    ones; its config.json, beside timm's weights, made the folder a vitlab model whose keys are missing."""
    other = ["car", "bus", "van"]
    for fmt in ("hf", "timm"):
        folder = tmp_path / fmt
        save_model(vitlab.load_model(run), folder, class_names=NAMES)
        save_model(vitlab.load_model(run), folder, format=fmt, class_names=other)
        assert read_class_names(folder) == other and not (folder / "classes.json").exists()
        assert vitlab.load_model(folder).cfg.num_classes == 3


def test_a_vitlab_or_hf_save_over_a_timm_export_keeps_none_of_its_files(run, tmp_path, capsys):
    """timm's .timm.json beside the weights it described stayed when a vitlab or Hugging Face save replaced
    them: its label_names, read as the weights file's own, named the new model's classes by the earlier ones
    (`vitlab predict` printed them), for a folder and for a .safetensors file alike."""
    other = vitlab.load_model(run, num_classes=5)
    other.reset_classifier(3)  # another model of 3 classes, saved without names
    for fmt, target in (("vitlab", tmp_path / "v"), ("vitlab", tmp_path / "v.safetensors"), ("hf", tmp_path / "h")):
        written = save_model(vitlab.load_model(run), target, format="timm", class_names=NAMES)
        assert read_class_names(written) == NAMES
        written = save_model(other, target, format=fmt)
        assert read_class_names(written) != NAMES and read_class_names(target) != NAMES, (fmt, target)
        assert not written.with_name(written.stem + ".timm.json").exists()


def test_export_onnx_and_torch_export_carry_the_names(run, tmp_path, capsys):
    from vitlab.export import program_class_names

    assert main(["export", str(run), "--format", "torch-export", "--out", str(tmp_path / "m.pt2")]) == 0
    assert program_class_names(tmp_path / "m.pt2") == NAMES
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    assert main(["export", str(run), "--format", "onnx", "--out", str(tmp_path / "m.onnx")]) == 0
    meta = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).get_modelmeta()
    assert json.loads(meta.custom_metadata_map["id2label"]) == {"0": "tabby cat", "1": "golden retriever",
                                                                "2": "goldfish"}
    assert json.loads(meta.custom_metadata_map["label2id"])["goldfish"] == 2


def test_export_of_a_masked_patch_prediction_run_writes_its_features_without_names(run, tmp_path, capsys):
    # MPP trains no classifier: its ViT is saved with the head it was built with, which predict and eval refuse;
    # the export wrote that head with the run's class names, a program giving every image the same scores
    from vitlab.export import load_program, program_class_names

    (run / "config.json").write_text(json.dumps({"recipe": "mpp:target=color", "model": {"mpp": "color"}}))
    assert main(["export", str(run), "--format", "torch-export", "--out", str(tmp_path / "m.pt2"), "--check"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (f"{run}: pre-trained by masked patch prediction (model.mpp='color'), which trains no "
                        "classifier: written without its untrained head (num_classes=0)")
    assert program_class_names(tmp_path / "m.pt2") is None
    assert load_program(tmp_path / "m.pt2")(torch.rand(2, 3, 16, 16) * 2 - 1).shape == (2, 16)  # the features


def test_predict_refuses_class_names_that_do_not_match_the_heads_outputs(run, tmp_path, capsys):
    # a list shorter than the head failed on the first image with an IndexError traceback
    (tmp_path / "two.json").write_text(json.dumps(NAMES[:2]))
    assert main(["predict", "--checkpoint", str(run), str(tmp_path / "x.png"), "--classes",
                 str(tmp_path / "two.json")]) == 2
    assert capsys.readouterr().err.strip() == (f"vitlab predict: error: --classes {tmp_path / 'two.json'}: "
                                              "2 class names for a model of 3 classes")
    (run / "classes.json").write_text(json.dumps(NAMES[:2]))  # the names beside the weights: the same check
    assert main(["predict", "--checkpoint", str(run), str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.strip() == (f"vitlab predict: error: the class names kept with {run}: "
                                              "2 class names for a model of 3 classes")
    # a folder was "no such file"
    assert main(["predict", "--checkpoint", str(run), str(tmp_path / "x.png"), "--classes", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"vitlab predict: error: --classes {tmp_path}: a folder; expected a "
                                              "JSON file of class names")


@pytest.mark.filterwarnings("ignore:class names that more than one class bears")  # but where it is checked
def test_a_name_two_classes_bear_is_written_with_their_ids_in_every_export(run, tmp_path, capsys):
    """ImageNet-1k names two classes "crane" (the bird and the machine): label2id, a name -> one class, kept
    the last of them in the Hugging Face, ONNX and .pt2 exports, so that the other could not be looked up.
    Every export with a place for the names writes each such name with its class id now, and says so."""
    from vitlab.export import program_class_names

    (run / "classes.json").write_text(json.dumps(["crane", "goldfish", "crane"]))
    distinct = ["crane (0)", "goldfish", "crane (2)"]
    with pytest.warns(UserWarning, match=r"^class names that more than one class bears are written with their "
                                         r"class ids, so that each name is one class's: 'crane' \(0, 2\)$"):
        assert main(["convert", str(run), str(tmp_path / "hf"), "--to", "hf"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["id2label"] == {"0": "crane (0)", "1": "goldfish", "2": "crane (2)"}
    assert config["label2id"] == {"crane (0)": 0, "goldfish": 1, "crane (2)": 2}
    assert main(["convert", str(run), str(tmp_path / "t.safetensors"), "--to", "timm"]) == 0
    assert read_class_names(tmp_path / "t.safetensors") == distinct
    assert main(["export", str(run), "--out", str(tmp_path / "m.pt2")]) == 0
    assert program_class_names(tmp_path / "m.pt2") == distinct
    pytest.importorskip("onnxscript")
    assert main(["export", str(run), "--out", str(tmp_path / "m.onnx")]) == 0
    onnx = pytest.importorskip("onnx")
    meta = {p.key: p.value for p in onnx.load(str(tmp_path / "m.onnx")).metadata_props}
    assert json.loads(meta["label2id"]) == {"crane (0)": 0, "goldfish": 1, "crane (2)": 2}
    # vitlab's own keeps the run's list as it is: a list, no name -> class map
    assert main(["convert", str(run), str(tmp_path / "v"), "--to", "vitlab"]) == 0
    assert read_class_names(tmp_path / "v") == ["crane", "goldfish", "crane"]


def test_names_that_cannot_be_made_distinct_are_refused(run):
    from vitlab.weights.labels import distinct_names

    with pytest.raises(WeightsError, match=r"^class_names: 'a' name more than one class each"):
        distinct_names(["a", "a", "a (1)"])
