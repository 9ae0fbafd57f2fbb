"""The loss a run trained with travels with its weights into every layout that has a place for it,
and `vitlab predict` and `eval` of the converted weights read it: a sigmoid_xent run's outputs are
each class's own sigmoid, as they were of the run (``vitlab.weights.labels``)."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

import vitlab
from vitlab.cli import main
from vitlab.weights import WeightsError, save_model

pytestmark = pytest.mark.filterwarnings("ignore::vitlab.weights.ConventionWarning")


def tiny_model(num_classes: int = 10):
    torch.manual_seed(0)
    model = vitlab.create_model("ViT-Ti/16", img_size=8, patch_size=4, width=16, depth=1, num_heads=2, mlp_dim=32,
                                num_classes=num_classes)
    with torch.no_grad():  # a zero head would tie every class
        for p in model.parameters():
            p.normal_(std=0.3)
    return model


@pytest.fixture
def sigmoid_run(tmp_path):
    """A run folder of optim.loss=sigmoid_xent (paper_pretrain's loss), trained on digits, as train leaves it:
    model.safetensors beside the run's config.json and classes.json."""
    folder = tmp_path / "run"
    folder.mkdir()
    save_model(tiny_model(), folder / "model.safetensors")
    (folder / "classes.json").write_text(json.dumps([str(i) for i in range(10)]))
    (folder / "config.json").write_text(json.dumps({"recipe": "test", "optim": {"loss": "sigmoid_xent"},
                                                    "data": {"source": "digits"}}))
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(tmp_path / "x.png")
    return folder


def predicted(checkpoint, image, capsys) -> list[dict]:
    """The top 10 of `vitlab predict --json` for one image."""
    assert main(["predict", "--checkpoint", str(checkpoint), str(image), "--json", "--top", "10", "--no-fast"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["top"]


def test_a_sigmoid_run_converted_to_hf_and_back_predicts_its_sigmoid_probabilities(sigmoid_run, tmp_path, capsys):
    """`vitlab convert` dropped the run's loss: predict of the Hugging Face folder, and of the vitlab folder
    converted back from it, printed the softmax of the logits (``prob``) where the run gives each class's
    own sigmoid (``sigmoid_prob``).  Now the Hugging Face config says problem_type multi_label_classification
    (what transformers' pipelines read as a sigmoid) and the vitlab file its metadata vitlab_loss."""
    image = tmp_path / "x.png"
    own = predicted(sigmoid_run, image, capsys)
    assert [set(t) for t in own] == [{"class", "sigmoid_prob"}] * 10
    assert main(["convert", str(sigmoid_run), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "back"), "--to", "vitlab"]) == 0
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "back.safetensors")]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["problem_type"] == "multi_label_classification"
    for converted in (tmp_path / "hf", tmp_path / "back", tmp_path / "back.safetensors"):
        top = predicted(converted, image, capsys)
        assert [t["class"] for t in top] == [t["class"] for t in own], converted
        assert [t.get("sigmoid_prob") for t in top] == pytest.approx([t["sigmoid_prob"] for t in own], abs=1e-5)
        assert vitlab.weights.read_loss(converted) == "sigmoid_xent"
    assert "problem_type" not in json.loads((tmp_path / "back" / "config.json").read_text())  # the model's config


def test_eval_of_the_converted_weights_gives_the_runs_numbers(sigmoid_run, tmp_path, capsys):
    """The views of --flip are averaged, and ECE binned, in the probabilities the run trained: of the
    Hugging Face export, in a softmax's, other numbers than the run's own."""
    assert main(["convert", str(sigmoid_run), str(tmp_path / "hf"), "--to", "hf"]) == 0
    capsys.readouterr()
    out = {}
    for checkpoint in (sigmoid_run, tmp_path / "hf"):
        assert main(["eval", "--checkpoint", str(checkpoint), "--data", "digits", "--val-split", "0", "--flip",
                     "--json", "--no-fast"]) == 0
        out[checkpoint] = json.loads(capsys.readouterr().out)
    run, hf = out[sigmoid_run], out[tmp_path / "hf"]
    assert (hf["top1"], hf["top5"], hf["ece"], hf["top1_views"]) == pytest.approx(
        (run["top1"], run["top5"], run["ece"], run["top1_views"]))


def test_an_hf_config_of_problem_type_multi_label_is_a_sigmoid_model(tmp_path, capsys):
    """A Hugging Face model (a folder, or the Hub's) whose config says problem_type
    multi_label_classification is scored as transformers' pipelines score it, a sigmoid per class."""
    model = tiny_model(3)
    save_model(model, tmp_path / "hf", format="hf")
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(tmp_path / "x.png")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "problem_type" not in config  # nothing said: a softmax
    assert [set(t) for t in predicted(tmp_path / "hf", tmp_path / "x.png", capsys)] == [{"class", "prob"}] * 3
    for problem_type, key in (("multi_label_classification", "sigmoid_prob"), ("single_label_classification", "prob"),
                              ("regression", "prob")):
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "problem_type": problem_type}))
        top = predicted(tmp_path / "hf", tmp_path / "x.png", capsys)
        assert [set(t) for t in top] == [{"class", key}] * 3, problem_type
    x = vitlab.data.transforms.to_float(torch.from_numpy(np.array(Image.open(tmp_path / "x.png"))).permute(2, 0, 1))
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "problem_type": "multi_label_classification"}))
    top = predicted(tmp_path / "hf", tmp_path / "x.png", capsys)
    with torch.no_grad():
        expected = model(x[None])[0].sigmoid().sort(descending=True).values
    assert [t["sigmoid_prob"] for t in top] == pytest.approx(expected.tolist(), abs=1e-5)


def test_timm_has_no_place_for_the_loss_and_convert_says_so(sigmoid_run, tmp_path, capsys):
    assert main(["convert", str(sigmoid_run), str(tmp_path / "t.safetensors"), "--to", "timm"]) == 0
    assert "its loss, sigmoid_xent, is not written: timm's files have no place for it" in capsys.readouterr().out
    top = predicted(tmp_path / "t.safetensors", tmp_path / "x.png", capsys)
    assert [set(t) for t in top] == [{"class", "prob"}] * 10


def test_a_new_head_or_a_run_of_softmax_writes_no_sigmoid(sigmoid_run, tmp_path, capsys):
    assert main(["convert", str(sigmoid_run), str(tmp_path / "new"), "--to", "hf", "--num-classes", "4"]) == 0
    assert "problem_type" not in json.loads((tmp_path / "new" / "config.json").read_text())
    (sigmoid_run / "config.json").write_text(json.dumps({"optim": {"loss": "softmax_xent"}}))
    assert main(["convert", str(sigmoid_run), str(tmp_path / "soft"), "--to", "hf"]) == 0
    config = json.loads((tmp_path / "soft" / "config.json").read_text())
    assert config["problem_type"] == "single_label_classification"
    with pytest.raises(WeightsError, match=r"^loss='focal': allowed values are 'softmax_xent', 'sigmoid_xent'$"):
        save_model(tiny_model(), tmp_path / "x", loss="focal")
    assert not (tmp_path / "x").exists()


def test_num_classes_of_the_heads_own_count_keeps_its_loss(sigmoid_run, tmp_path, capsys):
    """--num-classes of the count the head has keeps the trained head (a new one comes only for another count,
    as load_model gives it) and its class names, but dropped its loss as a new head's: the Hugging Face
    folder said no problem_type, and predict gave the softmax of logits trained as per-class sigmoids."""
    assert main(["convert", str(sigmoid_run), str(tmp_path / "hf"), "--to", "hf", "--num-classes", "10"]) == 0
    capsys.readouterr()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["problem_type"], config["id2label"]["3"]) == ("multi_label_classification", "3")
    image = tmp_path / "x.png"
    assert predicted(tmp_path / "hf", image, capsys) == predicted(sigmoid_run, image, capsys)


def test_export_records_the_problem_type(sigmoid_run, tmp_path, capsys):
    assert main(["export", str(sigmoid_run), "--format", "torch-export", "--out", str(tmp_path / "m.pt2")]) == 0
    extra = {"problem_type.json": ""}
    torch.export.load(tmp_path / "m.pt2", extra_files=extra)
    assert json.loads(extra["problem_type.json"]) == "multi_label_classification"
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    assert main(["export", str(sigmoid_run), "--format", "onnx", "--out", str(tmp_path / "m.onnx")]) == 0
    meta = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).get_modelmeta()
    assert meta.custom_metadata_map["problem_type"] == "multi_label_classification"


def test_transformers_reads_the_hf_exports_problem_type_as_a_sigmoid(tmp_path):
    transformers = pytest.importorskip("transformers")
    save_model(tiny_model(3), tmp_path / "hf", format="hf", loss="sigmoid_xent")
    hf = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf")
    assert hf.config.problem_type == "multi_label_classification"


def test_a_loss_of_no_kind_is_refused_naming_the_file(sigmoid_run, tmp_path, capsys):
    """A problem_type transformers does not know, or a vitlab_loss edited by hand, is refused in one line:
    taken for a softmax, the model's probabilities were printed as what it was not trained to give."""
    save_model(tiny_model(3), tmp_path / "hf", format="hf")
    config = tmp_path / "hf" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "problem_type": "multi_label"}))
    assert main(["predict", "--checkpoint", str(tmp_path / "hf"), str(tmp_path / "x.png"), "--no-fast"]) == 2
    assert capsys.readouterr().err == (f"vitlab predict: error: {config}: problem_type='multi_label': allowed values "
                                       "are 'regression', 'single_label_classification', "
                                       "'multi_label_classification', or none\n")
