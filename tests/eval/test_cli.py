"""`vitlab eval` and `vitlab fewshot` end to end on a tiny saved model and the digits data."""
import json

import pytest
import torch

from vitlab.cli import main
from vitlab.config import ViTConfig
from vitlab.models import create_model

weights = pytest.importorskip("vitlab.weights")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = ViTConfig(img_size=16, patch_size=4, width=32, depth=1, mlp_dim=64, num_heads=2, num_classes=10,
                    representation_size=32, name="ViT-tiny")
    model = create_model(cfg)
    with torch.no_grad():
        model.head.weight.normal_(0, 0.3)
    run = tmp_path_factory.mktemp("run")
    weights.save_model(model, run / "model.safetensors")
    (run / "config.json").write_text(json.dumps({"recipe": "test", "data": "digits", "val_split": 300,
                                                 "split_seed": 1, "steps": 3}))
    (run / "classes.json").write_text(json.dumps([str(i) for i in range(10)]))
    (run / "summary.json").write_text(json.dumps({"val_top1": 0.1, "steps": 3}))
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 2.3 - 0.1 * s, "lr": 0.001 * s}) + "\n" for s in range(5)))
    return run


def last_json(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_uses_the_run_split(run_dir, capsys):
    assert main(["eval", "--checkpoint", str(run_dir / "model.safetensors"), "--json"]) == 0
    out = last_json(capsys)
    assert out["n"] == 300 and out["split"] == 300 and out["split_seed"] == 1
    assert 0 <= out["top1"] <= out["top5"] <= 1
    assert len(out["confusion_matrix"]) == 10 and sum(map(sum, out["confusion_matrix"])) == 300
    assert set(out["per_class_accuracy"]) == {str(i) for i in range(10)}


def test_eval_prints_json_only_when_asked(run_dir, capsys):
    base = ["eval", "--checkpoint", str(run_dir / "model.safetensors"), "--data", "digits", "--val-split", "0"]
    assert main(base) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == ["top-1", "weakest"]  # the summary to read, no JSON
    assert "1797 images, all examples" in captured.err
    assert main(base + ["--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1  # the JSON line alone
    out = json.loads(lines[0])
    assert out["n"] == 1797 and out["flip"] is False and out["skipped_images"] == 0
    assert out["top1"] == pytest.approx(float(captured.out.split()[1].rstrip("%")) / 100, abs=5e-5)


def test_eval_flip_scores_the_mirrored_pair(run_dir, capsys):
    import numpy as np

    from vitlab.data.digits import load_digits_dataset
    from vitlab.eval.features import predict_logits

    assert main(["eval", "--checkpoint", str(run_dir / "model.safetensors"), "--data", "digits",
                 "--val-split", "0", "--flip", "--json"]) == 0
    out = last_json(capsys)
    model = weights.load_model(run_dir / "model.safetensors")
    data = load_digits_dataset(16)
    expected = (predict_logits(model, data.images, flip=True).argmax(-1) == data.labels.numpy()).mean()
    single = (predict_logits(model, data.images).argmax(-1) == data.labels.numpy()).mean()
    assert out["flip"] is True and out["top1"] == pytest.approx(expected) and expected != single


def test_eval_shift_adds_translated_views_and_refuses_impossible_shifts(run_dir, capsys):
    from vitlab.data.digits import load_digits_dataset
    from vitlab.eval.features import predict_logits

    ckpt = str(run_dir / "model.safetensors")
    assert main(["eval", "--checkpoint", ckpt, "--data", "digits", "--val-split", "0", "--flip", "--shift", "2",
                 "--json"]) == 0
    out = last_json(capsys)
    model = weights.load_model(run_dir / "model.safetensors")
    data = load_digits_dataset(16)
    expected = (predict_logits(model, data.images, flip=True, shift=2).argmax(-1) == data.labels.numpy()).mean()
    assert out["shift"] == 2 and out["top1"] == pytest.approx(expected)
    for bad in ("-1", "16"):  # the model reads 16x16 inputs
        assert main(["eval", "--checkpoint", ckpt, "--data", "digits", "--shift", bad]) != 0
        assert f"--shift={bad}" in capsys.readouterr().err


def test_eval_diagonal_shifts_report_each_nested_set_and_refuse_bad_sizes(run_dir, capsys):
    from vitlab.data.digits import load_digits_dataset
    from vitlab.eval.features import predict_logits

    ckpt = str(run_dir / "model.safetensors")
    assert main(["eval", "--checkpoint", ckpt, "--data", "digits", "--val-split", "0", "--flip", "--shift", "2,1",
                 "--diagonal", "--json"]) == 0
    out = last_json(capsys)
    model = weights.load_model(run_dir / "model.safetensors")
    data = load_digits_dataset(16)
    labels = data.labels.numpy()
    top1 = lambda **views: (predict_logits(model, data.images, **views).argmax(-1) == labels).mean()
    assert out["top1"] == pytest.approx(top1(flip=True, shift=(2, 1), diagonal=True))
    assert out["top1_views"]["10"] == pytest.approx(top1(flip=True, shift=2))
    assert out["top1_views"]["18"] == pytest.approx(top1(flip=True, shift=2, diagonal=True))
    assert out["top1_views"]["1"] == pytest.approx(top1())
    assert main(["eval", "--checkpoint", ckpt, "--data", "digits", "--val-split", "0", "--shift", "1",
                 "--diagonal"]) == 0
    assert "top-1 by test-time views: 1 " in capsys.readouterr().out
    with pytest.raises(SystemExit):  # argparse's usage error, one line
        main(["eval", "--checkpoint", ckpt, "--data", "digits", "--shift", "2,x"])
    assert "argument --shift: '2,x': expected pixels" in capsys.readouterr().err
    for args, message in ((["--shift", "2,2"], "--shift=(2, 2)"), (["--shift", "1,16"], "--shift=(1, 16)"),
                          (["--diagonal"], "--diagonal adds diagonal translations")):
        assert main(["eval", "--checkpoint", ckpt, "--data", "digits", *args]) != 0
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


@pytest.mark.slow
def test_eval_compile_scores_every_view_as_eager_in_one_graph(run_dir, capsys, monkeypatch):
    # 1,797 images in batches of 128, each scored in 10 views: the last, short batch is padded to the
    # one compiled shape, and the scores are eager's
    import shutil

    from torch._dynamo.utils import counters

    from vitlab import fast

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("inductor needs a C++ compiler on a CPU")
    compiled = []
    original = fast.compile_for_inference
    monkeypatch.setattr(fast, "compile_for_inference", lambda *a, **kw: compiled.append(kw) or original(*a, **kw))
    base = ["eval", "--checkpoint", str(run_dir / "model.safetensors"), "--data", "digits", "--val-split", "0",
            "--flip", "--shift", "2", "--json"]
    assert main(base) == 0
    eager = last_json(capsys)
    torch._dynamo.reset()
    counters.clear()
    assert main(base + ["--compile"]) == 0
    got = last_json(capsys)
    assert compiled == [{"batch_size": 128, "eager_on_failure": True}]
    assert counters["stats"]["unique_graphs"] == 1
    assert got["top1"] == pytest.approx(eager["top1"], abs=1 / 1797)  # float rounding may move one image
    assert got["per_class_accuracy"].keys() == eager["per_class_accuracy"].keys()


def test_fewshot_caches_features(run_dir, tmp_path, capsys):
    args = ["fewshot", str(run_dir / "model.safetensors"), "--shots", "1", "5", "--seeds", "2",
            "--feature-cache", str(tmp_path / "feats"), "--json"]
    assert main(args) == 0
    out = last_json(capsys)
    assert set(out["fewshot"]) == {"1", "5"} and len(out["fewshot"]["5"]["per_seed"]) == 2
    assert out["feature_dim"] == 32
    assert len(list((tmp_path / "feats").glob("*.npz"))) == 1
    assert main(args) == 0  # second run reads the cached features
    assert last_json(capsys) == out


def test_fewshot_refuses_shots_the_pool_cannot_give_before_extracting_features(run_dir, tmp_path, capsys, monkeypatch):
    import vitlab.eval.features

    def never(*args, **kwargs):
        raise AssertionError("features extracted for a sweep that cannot run")

    monkeypatch.setattr(vitlab.eval.features, "extract_features", never)
    base = ["fewshot", str(run_dir / "model.safetensors"), "--feature-cache", str(tmp_path / "feats")]
    for extra, message in ((["--shots", "0"], "--shots 0: each must be a positive integer"),
                           (["--shots", "1", "10000"], "--shots 10000: with --holdout-per-class 10, every class needs "
                                                       "10010 examples in the training pool"),
                           (["--holdout-per-class", "0"], "--holdout-per-class 0: must be a positive integer")):
        assert main(base + extra) == 2
        assert f"vitlab fewshot: error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "feats").exists()
    assert main(["predict", "--checkpoint", str(run_dir / "model.safetensors"), "--top", "0", "x.png"]) == 2
    assert "vitlab predict: error: --top 0: must be a positive integer" in capsys.readouterr().err


def test_eval_names_bins_it_cannot_use(run_dir, capsys):
    assert main(["eval", "--checkpoint", str(run_dir / "model.safetensors"), "--data", "digits", "--bins", "0"]) == 2
    assert "--bins=0: must be a positive integer" in capsys.readouterr().err


def test_wrong_classes_are_refused(run_dir, capsys):
    assert main(["eval", "--checkpoint", str(run_dir / "model.safetensors"), "--data", str(run_dir)]) == 2


def test_eval_runs_the_evaluator_the_trainer_runs(run_dir, capsys, monkeypatch):
    # one evaluator, one interface: `vitlab eval` and the trainer's evaluations both call
    # vitlab.eval.Evaluator.run(model) -> dict
    import vitlab.eval
    import vitlab.train.build
    from vitlab.eval.evaluator import Evaluator

    assert vitlab.train.build.Evaluator is vitlab.eval.Evaluator is Evaluator
    runs = []
    original = Evaluator.run
    monkeypatch.setattr(Evaluator, "run", lambda self, model, forward=None: runs.append(self)
                        or original(self, model, forward))
    assert main(["eval", "--checkpoint", str(run_dir / "model.safetensors"), "--data", "digits",
                 "--val-split", "0", "--json"]) == 0
    out = last_json(capsys)
    assert len(runs) == 1 and runs[0].labels.shape[0] == out["n"] == 1797


def test_eval_and_predict_optimize_unless_no_fast(run_dir, capsys, monkeypatch):
    from vitlab import fast

    optimized = []
    original = fast.optimize
    monkeypatch.setattr(fast, "optimize", lambda model, *args, **kw: optimized.append(1) or original(model, *args, **kw))
    ckpt = str(run_dir / "model.safetensors")
    base = ["eval", "--checkpoint", ckpt, "--data", "digits", "--val-split", "0", "--json"]
    assert main(base) == 0
    fast_top1 = last_json(capsys)["top1"]
    assert main(base + ["--no-fast"]) == 0
    assert last_json(capsys)["top1"] == pytest.approx(fast_top1)
    assert optimized == [1]
    image = run_dir / "digit.png"
    from PIL import Image

    Image.new("RGB", (16, 16), (200, 10, 10)).save(image)
    assert main(["predict", "--checkpoint", ckpt, "--json", str(image)]) == 0
    assert main(["predict", "--checkpoint", ckpt, "--json", "--no-fast", str(image)]) == 0
    assert optimized == [1, 1]


def test_predict_on_a_file_that_is_no_image_is_one_line_naming_it(tmp_path, capsys):
    import vitlab
    from vitlab.cli import main

    weights = vitlab.save_model(vitlab.create_model(vitlab.ViTConfig(
        img_size=16, patch_size=4, width=32, depth=1, mlp_dim=64, num_heads=4, num_classes=3)), tmp_path / "m")
    fake = tmp_path / "notanimage.jpg"
    fake.write_text("a text file named .jpg")
    assert main(["predict", "--checkpoint", str(weights), str(fake)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vitlab predict: error:") and "notanimage.jpg" in err[0]
    from vitlab.data.sources import DataError

    with pytest.raises(DataError, match="notanimage.jpg"):  # --debug shows the traceback instead
        main(["--debug", "predict", "--checkpoint", str(weights), str(fake)])


def test_predict_names_a_missing_image_before_scoring_any(tmp_path, capsys):
    # a mistyped name among many stopped the command there, after the images before it were printed
    from PIL import Image

    import vitlab

    weights = vitlab.save_model(vitlab.create_model(vitlab.ViTConfig(
        img_size=16, patch_size=4, width=32, depth=1, mlp_dim=64, num_heads=4, num_classes=3)), tmp_path / "m")
    image = tmp_path / "red.png"
    Image.new("RGB", (16, 16), (200, 10, 10)).save(image)
    for missing, what in ((tmp_path / "typo.png", "no such file"), (tmp_path, "a folder; expected image files")):
        assert main(["predict", "--checkpoint", str(weights), str(image), str(missing)]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err == f"vitlab predict: error: {missing}: {what}\n"


def test_the_commands_check_image_files_under_a_name_of_their_own(tmp_path):
    # vitlab.cli.predict.check_images(paths) said whether files exist, where vitlab.models' check_images
    # checks a tensor's shape and dtype: one name, two meanings
    from vitlab.cli import predict

    assert not hasattr(predict, "check_images")
    with pytest.raises(FileNotFoundError, match="typo.png: no such file"):
        predict.check_image_files([str(tmp_path / "typo.png")])


def test_fewshot_prints_its_table_and_json_only_when_asked(run_dir, capsys):
    base = ["fewshot", str(run_dir / "model.safetensors"), "--shots", "1", "--seeds", "1", "--feature-cache", "none"]
    assert main(base) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[0] == "shots" and lines[1].split()[0] == "1" and len(lines) == 2  # no JSON line
    assert main(base + ["--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and set(json.loads(lines[0])["fewshot"]) == {"1"}


@pytest.mark.parametrize("command", [["eval", "--checkpoint"], ["fewshot", "--feature-cache", "none"]])
def test_a_cache_dir_that_is_a_file_is_named_by_its_flag(command, run_dir, tmp_path, capsys):
    """The decoded data's cache under a file was the OS's "[Errno 20] Not a directory: '<it>/arrays'",
    after the model was loaded; the file is left as it was."""
    a_file = tmp_path / "cache"
    a_file.write_text("kept")
    assert main([*command, str(run_dir), "--data", "digits", "--cache-dir", str(a_file)]) == 2
    assert capsys.readouterr().err.strip() == (f"vitlab {command[0]}: error: --cache-dir={str(a_file)!r} is a file; "
                                              "expected a folder (a new one, or a run's)")
    assert a_file.read_text() == "kept"


def test_a_training_runs_cache_dir_that_is_a_file_is_named_by_its_field(tmp_path):
    from vitlab.config import ConfigError
    from vitlab.train.build import check_data
    from vitlab.train.config import DataConfig, TrainConfig

    (tmp_path / "cache").write_text("kept")
    with pytest.raises(ConfigError, match=r"^data.cache_dir='.*cache' is a file; expected a folder"):
        check_data(TrainConfig(data=DataConfig(source="digits", cache_dir=str(tmp_path / "cache"))))


@pytest.mark.parametrize("split, words", [("0.5", "50% of 1797 examples"), ("300", "300 of 1797 examples")])
def test_eval_states_a_fractional_split_as_a_fraction(run_dir, capsys, split, words):
    # a fraction was printed as a count: "held-out split (0.5 examples, ...)"
    assert main(["eval", "--checkpoint", str(run_dir / "model.safetensors"), "--data", "digits",
                 "--val-split", split]) == 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert summary.endswith(f"images, held-out split ({words}, seed 1)")


def test_predict_refuses_a_file_that_is_no_image_before_printing_any_result(tmp_path, capsys):
    # the images before it were scored and printed, then the command stopped at it
    from PIL import Image

    import vitlab

    weights = vitlab.save_model(vitlab.create_model(vitlab.ViTConfig(
        img_size=16, patch_size=4, width=32, depth=1, mlp_dim=64, num_heads=4, num_classes=3)), tmp_path / "m")
    first, last = tmp_path / "a.png", tmp_path / "b.png"
    for image in (first, last):
        Image.new("RGB", (16, 16), (200, 10, 10)).save(image)
    fake = tmp_path / "notanimage.txt"
    fake.write_text("a text file")
    assert main(["predict", "--checkpoint", str(weights), str(first), str(fake), str(last)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and len(err) == 1 and err[0].startswith("vitlab predict: error:") and str(fake) in err[0]


def test_predict_refuses_a_model_without_a_head(tmp_path, capsys):
    # its features (width 32) were shown as the probabilities of 32 classes
    from PIL import Image

    import vitlab

    weights = vitlab.save_model(vitlab.create_model(vitlab.ViTConfig(
        img_size=16, patch_size=4, width=32, depth=1, mlp_dim=64, num_heads=4, num_classes=0)), tmp_path / "m")
    image = tmp_path / "red.png"
    Image.new("RGB", (16, 16), (200, 10, 10)).save(image)
    assert main(["predict", "--checkpoint", str(weights), str(image)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        f"vitlab predict: error: {weights}: the model has no head (num_classes=0): it gives features, not class "
        "scores; fine-tune it (vitlab finetune) for a classifier\n")


def test_predict_lists_equal_probabilities_lower_class_first(tiny_checkpoint, tmp_path, capsys):
    # a head still all zeros (as every head starts) gives each class 1/10: topk listed 8, 6, 7, 5, 9
    # where eval counts such an image as a prediction of class 0
    from PIL import Image

    image = tmp_path / "red.png"
    Image.new("RGB", (16, 16), (200, 10, 10)).save(image)
    assert main(["predict", "--checkpoint", tiny_checkpoint, "--json", "--top", "4", str(image)]) == 0
    top = json.loads(capsys.readouterr().out)["top"]
    assert [t["class"] for t in top] == ["0", "1", "2", "3"] and {t["prob"] for t in top} == {0.1}


@pytest.mark.parametrize("command", ["eval", "fewshot"])
def test_a_batch_size_below_one_is_refused_by_its_flag_before_the_data_is_read(command, run_dir, capsys,
                                                                              monkeypatch):
    # the batching refused it as "batch_size=0: must be >= 1", once the whole data set had been decoded
    import vitlab.data.labelled

    monkeypatch.setattr(vitlab.data.labelled, "load_labelled", lambda *a, **k: pytest.fail("the data was read"))
    checkpoint = str(run_dir / "model.safetensors")
    for size in ("0", "-3", "two"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, *(["--checkpoint", checkpoint] if command == "eval" else [checkpoint]), "--data", "digits",
                  "--batch-size", size])
        assert exit_info.value.code == 2
        assert f"vitlab {command}: error: argument --batch-size: '{size}': expected a positive integer" in \
            capsys.readouterr().err


def test_a_split_that_cannot_be_made_is_named_by_its_flag(run_dir, tmp_path, capsys):
    # the stratified split named it by its own argument: "val_size=0.1: takes 0 of the 5 examples"
    # for fewshot's default, which the user never typed
    from PIL import Image

    for name, count in (("a", 3), ("b", 2)):
        (tmp_path / "five" / name).mkdir(parents=True)
        for i in range(count):
            Image.new("RGB", (16, 16), (40 * i, 10, 10)).save(tmp_path / "five" / name / f"{i}.png")
    checkpoint = str(run_dir / "model.safetensors")
    assert main(["fewshot", checkpoint, "--data", str(tmp_path / "five"), "--feature-cache", "none"]) == 2
    assert "vitlab fewshot: error: --val-split=0.1: takes 0 of the 5 examples" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", checkpoint, "--data", "digits", "--val-split", "1797"]) == 2
    assert "vitlab eval: error: --val-split=1797: takes 1797 of the 1797 examples" in capsys.readouterr().err


def test_fewshot_computes_features_again_when_the_data_is_decoded_anew(run_dir, tmp_path, capsys, monkeypatch):
    """A new decoding (vitlab.data.memory.CACHE_VERSION: 4 read macOS's shards, which 3 cut short) is
    other images from the same files: the feature cache was keyed by the files alone, and fewshot read
    back the features of the images decoded before."""
    from PIL import Image

    import vitlab.data.memory

    for name in ("a", "b"):
        (tmp_path / "data" / name).mkdir(parents=True)
        for i in range(8):
            Image.new("RGB", (16, 16), (30 * i, 100 if name == "a" else 10, 10)).save(tmp_path / "data" / name / f"{i}.png")
    args = ["fewshot", str(run_dir / "model.safetensors"), "--data", str(tmp_path / "data"), "--val-split", "4",
            "--shots", "1", "--seeds", "1", "--holdout-per-class", "2", "--cache-dir", str(tmp_path / "cache"),
            "--feature-cache", str(tmp_path / "feats"), "--json"]
    assert main(args) == 0
    assert main(args) == 0 and "from cache" in capsys.readouterr().err  # the same decoding: read back
    monkeypatch.setattr(vitlab.data.memory, "CACHE_VERSION", vitlab.data.memory.CACHE_VERSION + 1)
    assert main(args) == 0
    assert "from 16 images" in capsys.readouterr().err
    assert len(list((tmp_path / "feats").glob("*.npz"))) == 2


def test_eval_fewshot_and_predict_score_in_the_threads_a_run_resolves(run_dir, tmp_path, capsys, monkeypatch):
    # a process that may use fewer cores than PyTorch's own count (a container's CPU quota: 2 CPUs of a
    # 64-core host) trains in at most those (resolve), while eval, fewshot and predict resolved the same count
    # and scored in PyTorch's own
    from PIL import Image

    from vitlab.machine import Machine

    monkeypatch.setattr(Machine, "here", staticmethod(lambda gpu_index=0: Machine.described(cores=1)))
    Image.new("RGB", (16, 16), (200, 30, 30)).save(tmp_path / "red.png")
    checkpoint = str(run_dir / "model.safetensors")
    commands = (["eval", "--checkpoint", checkpoint, "--data", "digits", "--val-split", "20"],
                ["fewshot", checkpoint, "--shots", "1", "--seeds", "1", "--feature-cache", "none"],
                ["predict", "--checkpoint", checkpoint, str(tmp_path / "red.png")])
    caller = torch.get_num_threads()
    seen = []
    hook = torch.nn.modules.module.register_module_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
    torch.set_num_threads(2)
    try:
        for args in commands:
            seen.clear()
            assert main(args) == 0, args[0]
            assert seen and set(seen) == {1}, args[0]  # the machine's one core, as a run resolves it
            assert torch.get_num_threads() == 2, args[0]  # the caller's given back
    finally:
        hook.remove()
        torch.set_num_threads(caller)
    capsys.readouterr()


def test_eval_scores_a_folder_s_classes_as_the_outputs_of_their_names(tmp_path, capsys):
    """A folder sorts its classes by name (eight, five, four, ...); a model trained on them in another
    order (zero, one, ...) was refused with its classes.json, and scored against the wrong outputs,
    without a word, where its names came with the weights alone (a Hugging Face export's id2label):
    12.67% for a model of 80%.  Each class is now the output of its name, in any order or a subset."""
    import numpy as np
    from PIL import Image

    from vitlab.data.digits import load_digits_dataset
    from vitlab.eval import Evaluator
    from vitlab.weights.huggingface import save_huggingface

    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    data = load_digits_dataset(16)
    every = list(range(0, 600, 3))
    some = [i for i in every if int(data.labels[i]) != 6]  # a subset: no sixes
    for folder, indices in (("every", every), ("some", some)):
        for i in indices:
            (tmp_path / folder / names[data.labels[i]]).mkdir(parents=True, exist_ok=True)
            image = Image.fromarray(data.images[i].permute(1, 2, 0).numpy())
            image.save(tmp_path / folder / names[data.labels[i]] / f"{i}.png")
    torch.manual_seed(0)  # the fixture's model has a pre-logits layer, which a Hugging Face export cannot hold
    model = create_model(ViTConfig(img_size=16, patch_size=4, width=32, depth=1, mlp_dim=64, num_heads=2,
                                   num_classes=10, gelu="exact", ln_eps=1e-12, posemb_resample="bicubic"))  # HF's
    with torch.no_grad():
        model.head.weight.normal_(0, 0.3)
    (tmp_path / "run").mkdir()
    weights.save_model(model, tmp_path / "run" / "model.safetensors")
    (tmp_path / "run" / "classes.json").write_text(json.dumps(names))
    save_huggingface(model, tmp_path / "hf", class_names=names)
    for folder, indices in (("every", every), ("some", some)):
        expected = Evaluator(data.images[indices], data.labels[indices]).run(model)
        for checkpoint in (tmp_path / "hf", tmp_path / "run" / "model.safetensors"):
            assert main(["eval", "--checkpoint", str(checkpoint), "--data", str(tmp_path / folder), "--json"]) == 0
            out = last_json(capsys)
            assert out["n"] == len(indices) and out["classes"] == names
            assert out["top1"] == pytest.approx(expected["top1"]) and out["top5"] == pytest.approx(expected["top5"])
            assert (out["per_class_accuracy"]["six"] is None) == (folder == "some")
            assert np.array(out["confusion_matrix"]).sum(axis=1).tolist() == np.bincount(
                data.labels[indices].numpy(), minlength=10).tolist()


@pytest.mark.parametrize("command", ["eval", "predict"])
@pytest.mark.parametrize("named", ["model.safetensors", ""])
def test_a_masked_patch_prediction_run_is_refused_a_score_of_its_untrained_head(tmp_path, capsys, command, named):
    # MPP pre-training saves its ViT with the zero head it was built with: eval scored it without a
    # word (on digits 11.11% top-1, the share of class 0, which every image was "predicted" as)
    from PIL import Image

    import vitlab

    run = tmp_path / "mpp"
    weights = vitlab.save_model(vitlab.create_model(vitlab.ViTConfig(
        img_size=16, patch_size=4, width=32, depth=1, mlp_dim=64, num_heads=4, num_classes=10)), run / "model.safetensors")
    (run / "config.json").write_text(json.dumps({"recipe": "mpp:target=color", "model": {"mpp": "color"},
                                                 "data": {"source": "digits", "val_split": 100}}))
    (run / "classes.json").write_text(json.dumps([str(i) for i in range(10)]))
    checkpoint = str(run / named) if named else str(run)
    image = tmp_path / "red.png"
    Image.new("RGB", (16, 16), (200, 10, 10)).save(image)
    args = ["eval", "--checkpoint", checkpoint] if command == "eval" else ["predict", "--checkpoint", checkpoint,
                                                                           str(image)]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        f"vitlab {command}: error: {checkpoint}: pre-trained by masked patch prediction (model.mpp='color'), which "
        "trains no classifier: its head is as it was built, so every image would get the same scores; fine-tune it "
        f"(vitlab finetune --init {checkpoint}) for a classifier, or probe its features (vitlab fewshot)\n")
    assert weights.exists()


def three_class_run(tmp_path):
    """A folder of 3 classes x 6 images and a run of a tiny ViT on it (its config, classes and weights; no summary):
    (the data, the run's folder, its data section)."""
    from PIL import Image

    data = tmp_path / "data"
    for c in range(3):
        (data / f"c{c}").mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (8, 8), (40 * i, 60 * c, 0)).save(data / f"c{c}" / f"{i}.png")
    torch.manual_seed(0)
    model = create_model(ViTConfig(img_size=16, patch_size=4, width=32, depth=1, mlp_dim=64, num_heads=2,
                                   num_classes=3, name="ViT-tiny"))
    run = tmp_path / "run"
    run.mkdir()
    weights.save_model(model, run / "model.safetensors")
    section = {"source": str(data), "val_split": 6, "stream": "memory", "cache_dir": str(tmp_path / "cache")}
    (run / "config.json").write_text(json.dumps({"recipe": "test", "data": section}))
    (run / "classes.json").write_text(json.dumps(["c0", "c1", "c2"]))
    return data, run, section


def test_eval_and_fewshot_refuse_the_runs_split_of_data_changed_since_it_trained(tmp_path, capsys):
    """A class folder deleted since the run trained: eval reported "held-out split (6 of 12 examples)"
    of a run that split 18, a split whose held-out part held images the run trained on, as its
    held-out accuracy; fewshot likewise.  Refused in one line, naming the run, the data and the counts;
    --data with --val-split scores a split of the user's choosing."""
    import shutil

    _, run, _ = three_class_run(tmp_path)
    (run / "summary.json").write_text(json.dumps({"steps": 2, "train_examples": 12, "val_examples": 6}))
    evaluate = ["eval", "--checkpoint", str(run), "--json"]
    assert main(evaluate) == 0 and last_json(capsys)["n"] == 6
    shutil.rmtree(tmp_path / "data" / "c2")
    assert main(evaluate) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"{run}: its data {tmp_path / 'data'} changed since it trained " \
        "(now training 6 examples, the run's 12)" in err and "give --data and --val-split" in err
    assert main(["fewshot", str(run), "--shots", "1", "--feature-cache", "none"]) == 2
    assert "changed since it trained" in capsys.readouterr().err
    assert main([*evaluate, "--data", str(tmp_path / "data"), "--val-split", "6"]) == 0  # the user's own split
    assert last_json(capsys)["n"] == 6


def test_eval_and_fewshot_refuse_the_runs_split_of_data_with_an_image_swapped_since(tmp_path, capsys):
    """An image of the run's data swapped for another since it trained (as many images): the counts its summary
    recorded were the same, and eval scored a split whose held-out part could hold images the run trained on as
    its held-out accuracy; fewshot likewise.  Refused in one line saying what changed (the summary's split_key)."""
    from PIL import Image

    from vitlab.train.config import DataConfig, TrainConfig
    from vitlab.train.inputs import build_splits

    data, run, section = three_class_run(tmp_path)
    splits = build_splits(TrainConfig(data=DataConfig(source=str(data), val_split=6, cache_dir=section["cache_dir"],
                                                      decode_workers=1)),
                          (16, 16))
    (run / "summary.json").write_text(json.dumps({"steps": 2, "train_examples": 12, "val_examples": 6,
                                                  "split_key": splits.split_key}))
    evaluate = ["eval", "--checkpoint", str(run), "--json"]
    assert main(evaluate) == 0 and last_json(capsys)["n"] == 6
    (data / "c1" / "2.png").unlink()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(data / "c1" / "7.png")
    assert main(evaluate) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"{run}: its data {data} changed since it trained (now " in err
    assert "as many as the run's but not all the same images" in err and "give --data and --val-split" in err
    assert main(["fewshot", str(run), "--shots", "1", "--feature-cache", "none"]) == 2
    assert "as many as the run's but not all the same images" in capsys.readouterr().err
    assert main([*evaluate, "--data", str(data), "--val-split", "6"]) == 0  # the user's own split


def test_eval_of_a_sigmoid_run_averages_and_calibrates_its_per_class_probabilities(run_dir, tmp_path, capsys):
    """A run trained with sigmoid_xent (paper_pretrain's loss) gives each class a probability of its
    own: eval averaged its views by their mean softmax probability and binned the softmax's
    confidence in its ECE, probabilities the model was not trained to give."""
    import shutil

    from vitlab.data.digits import load_digits_dataset
    from vitlab.eval import Evaluator

    run = tmp_path / "sigmoid"
    shutil.copytree(run_dir, run)
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "loss": "sigmoid_xent"}))  # the run's optim.loss
    assert main(["eval", "--checkpoint", str(run / "model.safetensors"), "--data", "digits", "--val-split", "0",
                 "--flip", "--json"]) == 0
    out = last_json(capsys)
    model, data = weights.load_model(run / "model.safetensors"), load_digits_dataset(16)
    scored = {loss: Evaluator(data.images, data.labels, flip=True, loss=loss, report_bins=15).run(model)
              for loss in ("sigmoid_xent", "softmax_xent")}
    assert (out["top1"], out["ece"]) == pytest.approx((scored["sigmoid_xent"]["top1"], scored["sigmoid_xent"]["ece"]))
    assert out["ece"] != pytest.approx(scored["softmax_xent"]["ece"])


def test_predict_of_a_sigmoid_run_prints_its_per_class_sigmoid_probabilities(tmp_path, capsys):
    """A run trained with sigmoid_xent (paper_pretrain's loss) gives each class a probability of its own:
    predict printed the softmax of its logits, probabilities the model was not trained to give, as if
    they were.  Now its sigmoid probabilities, named so (they need not sum to 1), also of its weights file copied
    alone (its metadata records the loss); weights saved with no loss say nothing of it and get the softmax."""
    import shutil

    import numpy as np
    from PIL import Image

    from vitlab.data.memory import decode_image
    from vitlab.data.transforms import to_float
    from vitlab.train.config import AugmentConfig, DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig
    from vitlab.train.loop import train

    cfg = TrainConfig(recipe="test", model=ModelConfig(name="ViT-Ti/16", overrides=dict(
                          img_size=8, patch_size=4, width=16, depth=1, num_heads=2, mlp_dim=32, name="ViT-tiny/4")),
                      data=DataConfig(source="digits", val_split=100), augment=AugmentConfig(crop="none", flip=False),
                      optim=OptimConfig(optimizer="adam", lr=3e-3, batch_size=32, steps=3, warmup=1,
                                        loss="sigmoid_xent"),
                      run=RunConfig(precision="fp32", eval_every=0, ckpt_every=0, threads=1, tensorboard=False,
                                    out=str(tmp_path / "run")))
    checkpoint = train(cfg, verbose=False)["weights"]
    image = tmp_path / "x.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(image)
    model = weights.load_model(checkpoint).eval()
    with torch.no_grad():
        logits = model(to_float(torch.from_numpy(decode_image(str(image), (8, 8))).permute(2, 0, 1)[None]))[0]
    assert not torch.allclose(logits.sigmoid(), logits.softmax(-1), atol=1e-3)  # the two do differ
    bare = tmp_path / "bare" / "model.safetensors"
    bare.parent.mkdir()
    shutil.copy(checkpoint, bare)
    plain = weights.save_model(model, tmp_path / "plain" / "model.safetensors")  # no loss recorded
    sigmoid, softmax = logits.sigmoid(), logits.softmax(-1)
    for path, key, expected in ((checkpoint, "sigmoid_prob", sigmoid), (bare, "sigmoid_prob", sigmoid),
                                (plain, "prob", softmax)):
        assert main(["predict", "--checkpoint", str(path), "--json", "--top", "10", "--no-fast", str(image)]) == 0
        top = json.loads(capsys.readouterr().out)["top"]
        assert [set(t) for t in top] == [{"class", key}] * 10, path
        assert [t[key] for t in top] == pytest.approx(expected.sort(descending=True).values.tolist(), abs=1e-6)
    assert sum(t["prob"] for t in top) == pytest.approx(1, abs=1e-4)
    assert main(["predict", "--checkpoint", str(checkpoint), "--no-fast", str(image)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"{image}  (sigmoid probabilities, each class its own: they need not sum to 1)")
    (bare.parent / "config.json").write_text(json.dumps({"optim": {"loss": "focal"}}))  # a config edited by hand
    assert main(["predict", "--checkpoint", str(bare), "--no-fast", str(image)]) == 2
    assert capsys.readouterr().err == (f"vitlab predict: error: {bare.parent / 'config.json'}: optim.loss='focal': "
                                       "allowed values are 'softmax_xent', 'sigmoid_xent'\n")
