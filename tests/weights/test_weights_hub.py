"""Weights by Hugging Face Hub name, from the local Hugging Face cache (no network) or downloaded.

The cache is built here in huggingface_hub's layout from a random tiny ViTForImageClassification."""
import copy
import json
import shutil
import sys
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

transformers = pytest.importorskip("transformers")

from vitlab.cli import main  # noqa: E402
from vitlab.weights import WeightsError, load_model  # noqa: E402

REPO = "google/vit-tiny-random"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
LABELS = {0: "tabby cat", 1: "golden retriever", 2: "goldfish"}


@pytest.fixture(scope="module")
def hf_model():
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
                                 image_size=16, patch_size=4, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def write_snapshot(hf_model, cache, repo=REPO, commit=COMMIT):
    """``cache/models--org--name/{refs/main, snapshots/<commit>/}`` as huggingface_hub writes it."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    hf_model.save_pretrained(folder / "snapshots" / commit)
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    return folder / "snapshots" / commit


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # never the user's own cache
    return monkeypatch


def same_logits(model, hf_model):
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        return (model(x) - hf_model(pixel_values=x).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME"])
def test_load_model_finds_the_cached_snapshot_offline(hf_model, hub_env, tmp_path, variable):
    if variable == "HF_HUB_CACHE":
        write_snapshot(hf_model, tmp_path / "cache")
        hub_env.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    else:  # $HF_HOME/hub
        write_snapshot(hf_model, tmp_path / "home" / "hub")
        hub_env.setenv("HF_HOME", str(tmp_path / "home"))
    hub_env.setenv("HF_HUB_OFFLINE", "1")
    model = load_model(REPO)
    assert model.cfg.num_classes == 3 and same_logits(model, hf_model)
    assert same_logits(load_model(f"{REPO}@{COMMIT}"), hf_model)  # a commit names its snapshot


def test_predict_by_hub_name_prints_the_hub_labels(hf_model, hub_env, tmp_path, capsys):
    snapshot = write_snapshot(hf_model, tmp_path / "cache")
    hub_env.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    hub_env.setenv("HF_HUB_OFFLINE", "1")
    image = tmp_path / "x.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(image)
    assert main(["predict", "--checkpoint", REPO, str(image), "--json", "--top", "3", "--no-fast"]) == 0
    top = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["top"]
    assert sorted(t["class"] for t in top) == sorted(LABELS.values())
    # the same order as transformers' own prediction
    x = torch.from_numpy(np.array(Image.open(image).convert("RGB"))).permute(2, 0, 1)[None].float() / 127.5 - 1
    with torch.no_grad():
        best = hf_model(pixel_values=x).logits.argmax(-1).item()
    assert top[0]["class"] == LABELS[best]
    assert (snapshot / "config.json").is_file()


def test_a_hub_model_of_problem_type_multi_label_gives_its_sigmoid_probabilities(hf_model, hub_env, tmp_path, capsys):
    """A Hub model whose config says problem_type multi_label_classification gives each class its own
    sigmoid in transformers' pipelines: predict by its name printed the softmax of its logits."""
    multi = copy.deepcopy(hf_model)
    multi.config.problem_type = "multi_label_classification"
    write_snapshot(multi, tmp_path / "cache")
    hub_env.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    hub_env.setenv("HF_HUB_OFFLINE", "1")
    image = tmp_path / "x.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(image)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no image processor's config in this cache
        assert main(["predict", "--checkpoint", REPO, str(image), "--json", "--top", "3", "--no-fast"]) == 0
    top = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["top"]
    x = torch.from_numpy(np.array(Image.open(image).convert("RGB"))).permute(2, 0, 1)[None].float() / 127.5 - 1
    with torch.no_grad():
        expected = hf_model(pixel_values=x).logits[0].sigmoid().sort(descending=True).values
    assert [t["sigmoid_prob"] for t in top] == pytest.approx(expected.tolist(), abs=1e-5)


def an_image(folder) -> str:
    """An image to predict on: predict refuses a missing one before it looks for the weights."""
    path = folder / "x.png"
    Image.new("RGB", (16, 16), (200, 10, 10)).save(path)
    return str(path)


def test_not_cached_and_offline_is_one_error(hub_env, tmp_path, capsys):
    hub_env.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    hub_env.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WeightsError, match="HF_HUB_OFFLINE"):
        load_model(REPO)
    assert main(["predict", "--checkpoint", REPO, an_image(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and REPO in err and "Hugging Face cache" in err


def test_not_cached_without_huggingface_hub_names_the_extra(hub_env, tmp_path, capsys):
    hub_env.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    hub_env.setitem(sys.modules, "huggingface_hub", None)  # not installed
    assert main(["predict", "--checkpoint", REPO, an_image(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "huggingface_hub" in err and 'pip install -e ".[hub]"' in err


def test_a_mistyped_run_folder_without_huggingface_hub_is_no_such_folder_first(hub_env, tmp_path, capsys):
    """`vitlab finetune --init runs/dem` (for runs/demo) on an install without the hub extra said only that
    downloading runs/dem needs huggingface_hub: nothing said that no such folder is there.  (A folder runs
    here makes it a path: the next test.)"""
    hub_env.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    hub_env.setitem(sys.modules, "huggingface_hub", None)  # not installed
    hub_env.chdir(tmp_path)
    assert main(["predict", "--checkpoint", "runs/dem", an_image(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"vitlab predict: error: runs/dem: no such file or folder, nor a model in the Hugging Face cache "
        f"{tmp_path / 'empty'}; downloading it needs huggingface_hub, which is not installed: "
        'pip install -e ".[hub]"\n')


@pytest.mark.parametrize("command", [["eval", "--checkpoint", "runs/dem", "--data", "digits"],
                                     ["fewshot", "runs/dem", "--data", "digits"],
                                     ["inspect", "runs/dem", "--images", "x.png"],
                                     ["predict", "--checkpoint", "runs/dem", "x.png"],
                                     ["finetune", "--init", "runs/dem", "--data", "digits", "--out", "o"],
                                     ["export", "runs/dem", "--out", "m.onnx"]])
def test_a_mistyped_path_in_a_folder_here_is_no_such_file_not_a_hub_name(hub_env, tmp_path, capsys, monkeypatch,
                                                                         command):
    """`vitlab eval --checkpoint runs/dem` (for runs/demo) took runs/dem for a Hugging Face Hub name, as it
    has the form org/name: a download was attempted (over the network, its time-out with none) and the
    error was the Hub's.  A name whose org is a folder here is a path in it, refused as no such file without
    a look at the Hub, which hf-hub:runs/dem still names."""
    from vitlab.weights import hub

    hub_env.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    asked = []
    monkeypatch.setattr(hub, "download_snapshot", lambda *a, **k: asked.append(a))
    monkeypatch.setattr(hub, "fetch_processor", lambda *a, **k: asked.append(a))
    hub_env.chdir(tmp_path)
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    an_image(tmp_path)
    assert main(command) == 2
    assert asked == []  # no look at the Hub
    err = capsys.readouterr().err
    said = "(a path in the folder runs here, not looked up on the Hugging Face Hub; a Hub model of that name is " \
           "hf-hub:runs/dem)\n"
    assert err.startswith(f"vitlab {command[0]}: error: ") and err.endswith(said) and len(err.splitlines()) == 1
    assert "runs/dem" in err and "no such file or" in err and not (tmp_path / "o").exists()
    assert hub.parse_hub_name("runs/dem") is None and hub.parse_hub_name("hf-hub:runs/dem") == ("runs/dem", "main")
    assert hub.parse_hub_name("google/vit-base-patch16-224") == ("google/vit-base-patch16-224", "main")  # no folder


def fake_hub(hub, hub_env, tmp_path, remote):
    """huggingface_hub's download and metadata request, answered from the folder ``remote``; the
    names asked for, and the metadata requests, in order."""
    fetched, asked = [], []

    def fake_download(repo_id, filename, revision, cache_dir):
        assert repo_id == REPO and revision in ("main", COMMIT)
        fetched.append(filename)
        snapshot = tmp_path / "cache" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT
        if not (remote / filename).is_file():  # huggingface_hub notes in the cache that there is none
            (snapshot.parents[1] / ".no_exist" / COMMIT).mkdir(parents=True, exist_ok=True)
            (snapshot.parents[1] / ".no_exist" / COMMIT / filename).touch()
            raise hub.errors.EntryNotFoundError(f"{filename} is not in {repo_id}")
        snapshot.mkdir(parents=True, exist_ok=True)
        shutil.copy(remote / filename, snapshot / filename)
        refs = snapshot.parents[1] / "refs"
        refs.mkdir(exist_ok=True)
        (refs / "main").write_text(COMMIT)
        assert cache_dir == str(tmp_path / "cache")
        return str(snapshot / filename)

    hub_env.setattr(hub, "get_hf_file_metadata", lambda url, timeout: asked.append((url, timeout)))
    hub_env.setattr(hub, "hf_hub_download", fake_download)
    hub_env.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    return fetched, asked


def test_not_cached_is_downloaded_into_the_cache(hf_model, hub_env, tmp_path):
    """With huggingface_hub and a network: config.json, the image processor's config where there is
    one (here none) and the safetensors weights only, into the cache, after which the name resolves offline."""
    hub = pytest.importorskip("huggingface_hub")
    remote = tmp_path / "remote"
    hf_model.save_pretrained(remote)
    torch.save(hf_model.state_dict(), remote / "pytorch_model.bin")  # a second format, not to be fetched
    fetched, asked = fake_hub(hub, hub_env, tmp_path, remote)  # the one quick request first: is config.json there?
    assert same_logits(load_model(REPO), hf_model)
    assert fetched == ["config.json", "preprocessor_config.json", "model.safetensors"]
    assert len(asked) == 1 and asked[0][0].endswith(f"{REPO}/resolve/main/config.json") and asked[0][1] <= 5
    hub_env.setenv("HF_HUB_OFFLINE", "1")
    assert same_logits(load_model(REPO), hf_model) and len(fetched) == 3  # from the cache now


def test_a_download_brings_the_image_processor_s_scaling(hf_model, hub_env, tmp_path):
    """A repository whose image processor normalises with ImageNet's mean and std: its config is
    downloaded with the weights, and the model scores vitlab's input as transformers scores the
    processor's (only config.json and the weights were fetched, and the model read other inputs)."""
    from vitlab.data.transforms import to_float

    hub = pytest.importorskip("huggingface_hub")
    remote = tmp_path / "remote"
    hf_model.save_pretrained(remote)
    processor = transformers.ViTImageProcessor(image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225],
                                               do_resize=False)
    processor.save_pretrained(remote)
    fetched, _ = fake_hub(hub, hub_env, tmp_path, remote)
    pixels = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    inputs = processor(images=list(pixels.permute(0, 2, 3, 1).numpy()), return_tensors="pt").pixel_values
    with torch.no_grad():
        diff = (load_model(REPO)(to_float(pixels)) - hf_model(pixel_values=inputs).logits).abs().max()
    assert fetched == ["config.json", "preprocessor_config.json", "model.safetensors"] and diff < 1e-4


IMAGENET = dict(image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])


def test_a_cached_model_without_its_image_processor_s_config_fetches_it(hf_model, hub_env, tmp_path):
    """`ViTForImageClassification.from_pretrained` caches config.json and the weights, not the image
    processor's config: a model normalising with ImageNet's mean and std (DeiT) was then read as
    taking vitlab's inputs, without a word.  The config is fetched (for the snapshot's commit), once."""
    from vitlab.data.transforms import to_float

    hub = pytest.importorskip("huggingface_hub")
    remote = tmp_path / "remote"
    hf_model.save_pretrained(remote)
    processor = transformers.ViTImageProcessor(do_resize=False, **IMAGENET)
    processor.save_pretrained(remote)
    write_snapshot(hf_model, tmp_path / "cache")  # what from_pretrained left
    fetched, asked = fake_hub(hub, hub_env, tmp_path, remote)
    pixels = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    inputs = processor(images=list(pixels.permute(0, 2, 3, 1).numpy()), return_tensors="pt").pixel_values
    with torch.no_grad():
        diff = (load_model(REPO)(to_float(pixels)) - hf_model(pixel_values=inputs).logits).abs().max()
    assert diff < 1e-4 and fetched == ["preprocessor_config.json"]
    assert asked[0][0].endswith(f"{REPO}/resolve/{COMMIT}/preprocessor_config.json")
    load_model(REPO)
    assert fetched == ["preprocessor_config.json"]  # cached now


def test_a_cached_model_whose_repository_has_no_image_processor_asks_once(hf_model, hub_env, tmp_path):
    hub = pytest.importorskip("huggingface_hub")
    remote = tmp_path / "remote"
    hf_model.save_pretrained(remote)
    write_snapshot(hf_model, tmp_path / "cache")
    fetched, _ = fake_hub(hub, hub_env, tmp_path, remote)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none: the repository has no image processor, and the cache says so
        assert same_logits(load_model(REPO), hf_model) and same_logits(load_model(REPO), hf_model)
    assert fetched == ["preprocessor_config.json"]


def test_a_cached_model_without_its_image_processor_s_config_offline_says_so(hf_model, hub_env, tmp_path):
    write_snapshot(hf_model, tmp_path / "cache")
    hub_env.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    hub_env.setenv("HF_HUB_OFFLINE", "1")
    from vitlab.weights import read_class_names

    with pytest.warns(UserWarning, match=r"holds no preprocessor_config\.json .*HF_HUB_OFFLINE is set.*mean and std 0\.5") \
            as said:
        load_model(REPO)
        read_class_names(REPO)  # as predict does: said once
    assert len(said) == 1


def test_paths_and_registry_names_are_not_hub_names(tmp_path):
    from vitlab.weights.hub import parse_hub_name

    assert parse_hub_name("google/vit-base-patch16-224") == ("google/vit-base-patch16-224", "main")
    assert parse_hub_name("hf-hub:timm/vit_base_patch16_224.augreg_in21k") == ("timm/vit_base_patch16_224.augreg_in21k",
                                                                              "main")  # timm's spelling
    assert parse_hub_name("hf_hub:timm/vit_tiny_patch16_224@v2") == ("timm/vit_tiny_patch16_224", "v2")
    assert parse_hub_name("ViT-B/16") is None and parse_hub_name("R50+ViT-B_16") is None
    assert parse_hub_name("runs/model.safetensors") is None and parse_hub_name("/abs/path") is None
    (tmp_path / "org").mkdir()
    assert parse_hub_name(str(tmp_path / "org")) is None
    # every registry name has the registry's form, and the Hub's ViT repositories have not
    from vitlab.models.registry import has_name_form, list_models

    assert all(has_name_form(name) for name in list_models())
    for repo in ("google/vit-base-patch16-224", "google/vit-huge-patch14-224-in21k", "facebook/deit-tiny-patch16-224",
                 "WinKawaks/vit-tiny-patch16-224", "timm/vit_base_patch16_224.augreg_in21k", "google/vit-b-16"):
        assert not has_name_form(repo) and parse_hub_name(repo) == (repo, "main")


@pytest.mark.parametrize("name, close", [("ViT-Ti/17", "'ViT-Ti/16'"), ("vit-ti/16", "'ViT-Ti/16'"),
                                         ("Axial-ViT-B/17", "'Axial-ViT-B/16'"),
                                         ("R50+ViT-B/17", "'R50x1+ViT-B/16'")])
def test_a_mistyped_registry_name_is_an_unknown_model_not_a_hub_name(hub_env, tmp_path, capsys, name, close):
    """`vitlab predict --checkpoint ViT-Ti/17`, `vitlab export ViT-Ti/17` and load_model("ViT-Ti/17") took the
    name for a Hugging Face repository: a failed download (offline: "nor a model in the Hugging Face cache"),
    or "install the hub extra", where the user had mistyped a registry name."""
    from vitlab.weights.hub import parse_hub_name

    hub_env.setenv("HF_HUB_OFFLINE", "1")
    Image.new("RGB", (8, 8)).save(tmp_path / "x.png")
    assert parse_hub_name(name) is None
    assert main(["predict", "--checkpoint", name, str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"vitlab predict: error: {name}: no such file or folder, and unknown model {name!r}. "
                          f"Did you mean {close}") and len(err.splitlines()) == 1
    assert main(["export", name, "--out", str(tmp_path / "m.pt2")]) == 2
    assert capsys.readouterr().err.startswith(f"vitlab export: error: {name}: no such file or folder, and unknown "
                                              f"model {name!r}. Did you mean {close}")
    with pytest.raises(WeightsError, match="unknown model"):
        load_model(name)
    # a registry name given for weights is said to be one
    assert main(["predict", "--checkpoint", "ViT-Ti/16", str(tmp_path / "x.png")]) == 2
    assert "'ViT-Ti/16' names a model of the registry, not weights" in capsys.readouterr().err


NO_NETWORK = """
import json, sys, time
import huggingface_hub, torch, vitlab.weights, vitlab.data.memory  # noqa: E401,F401  (imports: before the clock)
from vitlab.cli import main
start = time.perf_counter()
code = main(["predict", "--checkpoint", sys.argv[1], "x.png"])
print(json.dumps({"code": code, "seconds": time.perf_counter() - start}))
"""


def test_not_cached_with_no_network_fails_at_once_in_one_line(tmp_path):
    """huggingface_hub installed, the Hub unreachable (a closed port): one line, no retry lines,
    and at once (huggingface_hub's own fallback retries for ~25 s, printing a line per try)."""
    import os
    import subprocess
    from pathlib import Path

    pytest.importorskip("huggingface_hub")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                        "HF_HUB_ETAG_TIMEOUT")}
    env.update(HF_HOME=str(tmp_path / "empty"), HF_ENDPOINT="http://127.0.0.1:9",
               PYTHONPATH=os.pathsep.join([str(root), env.get("PYTHONPATH", "")]))
    an_image(tmp_path)  # x.png in the command's folder
    done = subprocess.run([sys.executable, "-c", NO_NETWORK, REPO], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    err = done.stderr.strip().splitlines()
    assert result["code"] == 2 and len(err) == 1, done.stderr
    assert REPO in err[0] and "Hugging Face cache" in err[0] and "Retry" not in done.stderr
    # huggingface_hub's retries of a refused connection sleep 1 + 2 + 4 + 8 + 8 s; one request takes a
    # fraction of a second, a second or two on a busy machine
    assert result["seconds"] < 10, result


def test_the_hub_logger_is_as_it_was_after_a_failed_download(hub_env, tmp_path):
    import logging

    hub = pytest.importorskip("huggingface_hub")

    def unreachable(*args, **kwargs):
        logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
        raise ConnectionError("[Errno 111] Connection refused")

    hub_env.setattr(hub, "get_hf_file_metadata", unreachable)
    hub_env.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    logger = logging.getLogger("huggingface_hub")
    before = logger.level
    with pytest.raises(WeightsError, match="ConnectionError"):
        load_model(REPO)
    assert logger.level == before


def test_fewshot_by_hub_name_caches_the_features_of_the_revision_it_names(hf_model, hub_env, tmp_path, capsys):
    """The feature cache's key of a Hub name was the name: once the cache held a newer revision
    (refs/main moved on), fewshot read the earlier revision's features back."""
    cache = tmp_path / "cache"
    write_snapshot(hf_model, cache)
    hub_env.setenv("HF_HUB_CACHE", str(cache))
    hub_env.setenv("HF_HUB_OFFLINE", "1")
    base = ["fewshot", REPO, "--data", "digits", "--shots", "1", "--seeds", "2", "--holdout-per-class", "2", "--json"]

    def accuracies(*flags):
        assert main(base + list(flags)) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["fewshot"]

    cached = ["--feature-cache", str(tmp_path / "features")]
    first = accuracies(*cached)
    assert first == accuracies("--feature-cache", "none")
    newer, other = "89abcdef0123456789abcdef0123456789abcdef", copy.deepcopy(hf_model)
    with torch.no_grad():
        for p in other.parameters():
            p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(p.numel()))
    other.save_pretrained(cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / newer)
    (cache / f"models--{REPO.replace('/', '--')}" / "refs" / "main").write_text(newer)
    fresh = accuracies("--feature-cache", "none")
    assert fresh != first and accuracies(*cached) == fresh
    assert len(list((tmp_path / "features").glob("*.npz"))) == 2
