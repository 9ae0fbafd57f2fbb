"""The HTML report: self-contained, every section present, every figure renders in Chromium."""
import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib")

from vitlab.analysis.report import read_run_meta, write_report  # noqa: E402
from vitlab.config import ViTConfig  # noqa: E402
from vitlab.models import create_model  # noqa: E402

TINY = ViTConfig(img_size=16, patch_size=4, width=32, depth=2, mlp_dim=64, num_heads=2, num_classes=3,
                 name="ViT-tiny/4")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CHECK_SCRIPT = """<script>
window.addEventListener('load', () => {
  const imgs = Array.from(document.images);
  const out = document.createElement('pre');
  out.id = 'imgcheck';
  out.textContent = JSON.stringify(imgs.map(i => [i.alt, i.complete ? i.naturalWidth : 0]));
  document.body.appendChild(out);
});
</script></body>"""


def images(n=2):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 3, 24, 24), dtype=torch.uint8, generator=g)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    torch.manual_seed(0)
    run = tmp_path_factory.mktemp("run")
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 1.0 / (s + 1), "lr": 1e-3, **({"val_top1": 0.1 * s} if s % 2 else {})}) + "\n"
        for s in range(6)) + '{"step": 7, "loss"')  # a half-written last line is skipped
    (run / "config.json").write_text(json.dumps({"recipe": "tiny", "lr": 0.001, "steps": 6}))
    summary = {"val_top1": 0.5, "steps": 6, "val_top1_views": {"1": 0.4, "10": 0.5}}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "classes.json").write_text(json.dumps(["cat", "dog", "emu"]))
    meta = read_run_meta(run / "model.safetensors")
    assert meta["recipe"]["recipe"] == "tiny" and meta["classes"] == ["cat", "dog", "emu"]
    model = create_model(TINY)
    torch.nn.init.normal_(model.head.weight)  # a trained head: a zero one has no predictions to show
    out = write_report(model, images(), run / "report.html", run_dir=run, meta=meta)
    return out


def test_report_is_self_contained_and_complete(report):
    page = report.read_text()
    for anchor in ("card", "curves", "predictions", "rollout", "distance", "heads", "embeddings"):
        assert f'id="{anchor}"' in page
    for fig in ("Figures 6 and 14", "Figure 7 (right) and Figure 11", "Figure 7 (left, centre) and Figure 10"):
        assert fig in page.replace("FIGURE", "Figure")
    assert not re.search(r'(src|href)="(https?:)?//', page)  # no network requests
    assert "<script" not in page and "<link" not in page
    assert len(re.findall(r'src="data:image/png;base64,', page)) >= 7
    assert "emu" in page and "ViT-tiny/4" in page
    assert "1=0.4, 10=0.5" in page  # the summary's top-1 by test-time views


def test_models_without_the_figures_say_why():
    from vitlab.analysis.report import _attention_arrays, _section_embeddings

    page = _section_embeddings(create_model(TINY, posemb="relative", classifier="gap"))
    assert "no absolute position embeddings" in page
    axial = ViTConfig(img_size=16, patch_size=4, width=32, depth=1, mlp_dim=64, num_heads=2, num_classes=3,
                      classifier="gap", axial=True)
    with pytest.raises(ValueError, match="Axial-ViT attends along rows and columns"):
        _attention_arrays(create_model(axial), torch.zeros(1, 3, 16, 16))


def test_a_head_never_trained_shows_no_predictions():
    # an MPP-pretrained model's zero head was shown as "top predictions" of 1/K for every class
    from vitlab.analysis.report import build_report

    for model in (create_model(TINY), create_model(TINY, num_classes=0)):
        page = build_report(model, images())
        assert 'id="predictions"' in page and 'alt="image 2"' in page  # the inputs are shown all the same
        assert "%</span>" not in page and page.count("No predictions: ") == 1
    assert "is all zeros, never trained" in build_report(create_model(TINY), images())


def test_a_sigmoid_runs_predictions_are_its_per_class_sigmoid_probabilities():
    """A run trained with sigmoid_xent (its config.json's optim.loss, either layout) gives each class a
    probability of its own: the page showed the softmax of its logits, captioned as such, probabilities
    the model was not trained to give.  A run of softmax_xent, or weights without a run, as before."""
    from vitlab.analysis.report import _section_predictions, build_report, recorded_loss

    torch.manual_seed(0)
    model = create_model(TINY).eval()
    torch.nn.init.normal_(model.head.weight)
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        logits = model(x)
    shown = lambda page: [float(v) for v in re.findall(r"float:right'>([0-9.]+)%</span>", page)]
    for meta, loss in (({"recipe": {"optim": {"loss": "sigmoid_xent"}}}, "sigmoid_xent"),
                       ({"recipe": {"loss": "sigmoid_xent", "steps": 3}}, "sigmoid_xent"),  # a flat, older config
                       ({"recipe": {"optim": {"loss": "softmax_xent"}}}, "softmax_xent"), ({}, "softmax_xent")):
        assert recorded_loss(meta) == loss
        probs = logits.sigmoid() if loss == "sigmoid_xent" else logits.softmax(-1)
        page = _section_predictions(model, x, images(), None, recorded_loss(meta))
        expected = [round(100 * p, 1) for row in probs.sort(-1, descending=True).values.tolist() for p in row]
        assert shown(page) == pytest.approx(expected, abs=0.051), meta
        assert ("per-class sigmoid probabilities" in page and "need not sum to 1" in page) == (loss == "sigmoid_xent")
    assert not torch.allclose(logits.sigmoid(), logits.softmax(-1), atol=1e-2)
    page = build_report(model, images(), meta={"recipe": {"optim": {"loss": "sigmoid_xent"}}})
    assert "per-class sigmoid probabilities" in page
    with pytest.raises(ValueError, match=r"^run/config.json: optim.loss='focal': allowed values are 'softmax_xent', "):
        recorded_loss({"recipe": {"optim": {"loss": "focal"}}, "run_dir": "run"})  # a file edited by hand


def test_the_position_figure_of_a_model_with_a_table_per_block_says_whose_it_is():
    # posemb_place=every_layer: the figure showed the first block's table with a caption of the stem's
    from vitlab.analysis.report import _section_embeddings

    assert "the first of the 2 blocks' tables" in _section_embeddings(create_model(TINY, posemb_place="every_layer"))
    assert "blocks' tables" not in _section_embeddings(create_model(TINY, posemb_place="every_layer_shared"))


def test_attention_arrays_match_the_model_functions():
    from vitlab.analysis.attention import model_attention_distance, model_raw_attention, model_rollout
    from vitlab.analysis.report import _attention_arrays

    model = create_model(TINY)
    x = torch.randn(2, 3, 16, 16)
    rollout, distance, heads = _attention_arrays(model, x)
    np.testing.assert_allclose(rollout, model_rollout(model, x), atol=1e-6)
    np.testing.assert_allclose(distance, model_attention_distance(model, x), atol=1e-5)
    np.testing.assert_allclose(heads[1, 0], model_raw_attention(model, x[:1], layer=1, head=0)[0], atol=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian: apt-get install chromium)")
def test_every_figure_renders_in_chromium(report):
    checked = report.with_name("checked.html")
    checked.write_text(report.read_text().replace("</body>", CHECK_SCRIPT))
    profile = tempfile.mkdtemp()
    try:
        dom = subprocess.run(
            [CHROMIUM, *CHROME_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=10000", "--dump-dom",
             checked.as_uri()], capture_output=True, text=True, timeout=60).stdout
        shot = report.with_name("shot.png")
        subprocess.run([CHROMIUM, *CHROME_FLAGS, f"--user-data-dir={profile}", f"--screenshot={shot}",
                        "--window-size=1200,3000", report.as_uri()], capture_output=True, timeout=60)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    found = re.search(r'<pre id="imgcheck">(.*?)</pre>', dom, re.S)
    assert found, "the check script did not run: " + dom[-500:]
    widths = json.loads(found.group(1).replace("&quot;", '"'))
    assert len(widths) >= 7
    assert all(w > 0 for _, w in widths), widths
    from PIL import Image

    pixels = np.asarray(Image.open(shot).convert("L"), dtype=float)
    assert pixels.shape == (3000, 1200) and pixels.std() > 10  # a rendered page, not a blank one


def test_inspect_refuses_a_run_dir_without_a_training_log(tmp_path, capsys):
    # a mistyped --run-dir gave a report without curves and exit 0
    from PIL import Image

    from vitlab.cli import main
    from vitlab.weights import save_model

    save_model(create_model(TINY), tmp_path / "model.safetensors")
    Image.fromarray(images(1)[0].permute(1, 2, 0).numpy()).save(tmp_path / "x.png")
    (tmp_path / "a-file").write_text("kept")
    (tmp_path / "empty").mkdir()
    for run_dir, what in (("missing", "no such folder; expected a training run's folder (with metrics.jsonl)"),
                          ("a-file", "a file; expected a training run's folder (with metrics.jsonl)"),
                          ("empty", "holds no metrics.jsonl; expected a training run's folder (`vitlab train --out`)")):
        assert main(["inspect", str(tmp_path / "model.safetensors"), "--images", str(tmp_path / "x.png"),
                     "--run-dir", str(tmp_path / run_dir), "--out", str(tmp_path / "r.html")]) == 2
        assert capsys.readouterr().err.strip() == f"vitlab inspect: error: --run-dir {tmp_path / run_dir}: {what}"
    assert not (tmp_path / "r.html").exists()


def test_an_image_file_is_seen_alike_whatever_other_images_come_with_it(tmp_path):
    # files were resized to the first one's size before the model's: an image after a small one
    # was shown and scored as that small one's pixels, unlike `vitlab predict`'s view of it
    from PIL import Image

    from vitlab.analysis.report import _image_png, build_report
    from vitlab.data.decode import decode_image

    g = np.random.default_rng(0)
    Image.fromarray(g.integers(0, 256, (2, 3, 3), dtype=np.uint8)).save(tmp_path / "small.png")
    Image.fromarray(g.integers(0, 256, (90, 60, 3), dtype=np.uint8)).save(tmp_path / "big.png")
    model = create_model(TINY)
    torch.nn.init.normal_(model.head.weight)

    def shown(page, n):
        return re.search(rf'<img alt="image {n}" src="data:image/png;base64,([^"]+)"', page).group(1)

    alone = build_report(model, [tmp_path / "big.png"])
    after_small = build_report(model, [tmp_path / "small.png", tmp_path / "big.png"])
    assert shown(after_small, 2) == shown(alone, 1)
    as_predict_sees_it = torch.from_numpy(decode_image(tmp_path / "big.png", TINY.img_size)).permute(2, 0, 1)
    assert shown(alone, 1) == base64.b64encode(_image_png(as_predict_sees_it)).decode()


def test_the_report_replaces_an_earlier_report_only(tmp_path, capsys):
    # --out naming one of the images or the weights wrote the page over them and said "wrote"
    from PIL import Image

    from vitlab.analysis.report import write_report
    from vitlab.cli import main
    from vitlab.weights import save_model

    save_model(create_model(TINY), tmp_path / "model.safetensors")
    Image.fromarray(images(1)[0].permute(1, 2, 0).numpy()).save(tmp_path / "x.png")
    (tmp_path / "notes.txt").write_text("kept")
    kept = {name: (tmp_path / name).read_bytes() for name in ("model.safetensors", "x.png", "notes.txt")}
    for name in kept:
        out = tmp_path / name
        assert main(["inspect", str(tmp_path / "model.safetensors"), "--images", str(tmp_path / "x.png"),
                     "--out", str(out)]) == 2
        assert capsys.readouterr().err.strip() == (
            f"vitlab inspect: error: --out={str(out)!r} is a file that is not an earlier report (a page vitlab "
            "inspect wrote); the report replaces nothing else: name another file")
        with pytest.raises(ValueError, match="out_path=.* is a file that is not an earlier report"):
            write_report(create_model(TINY), images(1), out)
    assert {name: (tmp_path / name).read_bytes() for name in kept} == kept
    # an earlier report is replaced, as a second run of the same command expects
    for _ in range(2):
        assert main(["inspect", str(tmp_path / "model.safetensors"), "--images", str(tmp_path / "x.png"),
                     "--out", str(tmp_path / "report.html")]) == 0
    assert (tmp_path / "report.html").read_text().startswith("<!DOCTYPE html>")


@pytest.mark.parametrize("fmt, path", [("hf", "hf"), ("vitlab", "lone.safetensors"), ("timm", "timm.safetensors")])
def test_inspect_names_the_classes_predict_names(tmp_path, fmt, path):
    # the names kept in the weights (a Hugging Face id2label, a vitlab file's metadata, timm's
    # label_names) were not read: the predictions said "class 2" where predict says "emu"; and a
    # Hugging Face config.json was shown as the training recipe
    from PIL import Image

    from vitlab.cli import main
    from vitlab.weights import save_model

    model = create_model(TINY)
    torch.nn.init.normal_(model.head.weight)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the conventions an export to timm/hf cannot carry
        save_model(model, tmp_path / path, format=fmt, class_names=["cat", "dog", "emu"])
    Image.fromarray(images(1)[0].permute(1, 2, 0).numpy()).save(tmp_path / "x.png")
    assert main(["inspect", str(tmp_path / path), "--images", str(tmp_path / "x.png"),
                 "--out", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    shown = re.findall(r"<div>(\w+) <span style='float:right'>", page)
    assert len(shown) == 3 and set(shown) == {"cat", "dog", "emu"}
    assert "Training recipe" not in page


def test_a_model_in_bfloat16_gets_its_figures():
    # the images went in as float32 whatever the model's dtype: a bf16 model's report held, in place
    # of its predictions and attention figures, "expected images of the model's dtype torch.bfloat16"
    from vitlab.analysis.report import build_report

    model = create_model(TINY)
    torch.nn.init.normal_(model.head.weight)
    page = build_report(model.to(torch.bfloat16), images())
    assert "%</span>" in page and "dtype" not in page
    for alt in ("attention rollout", "attention distance", "attention per head"):
        assert f'<img alt="{alt}"' in page
    assert next(model.parameters()).dtype == torch.bfloat16


def test_the_attention_distance_axis_of_a_non_square_model_reaches_its_longer_side(monkeypatch):
    """The axis was capped at img_size[0]: a 8x32 model's ended at its height, 8 px, where its
    patches lie up to 28 px apart (the data beyond it took the axis instead)."""
    from vitlab.analysis import plots, report as report_module

    drawn = []
    real = plots.plot_attention_distance
    monkeypatch.setattr(report_module.plots, "plot_attention_distance",
                        lambda d, size: drawn.append((d, real(d, size))) or drawn[-1][1])
    model = create_model(ViTConfig(img_size=(8, 32), patch_size=4, width=32, depth=2, mlp_dim=64, num_heads=2,
                                   num_classes=3, name="ViT-tiny/4"))
    report_module.build_report(model, images())
    ((distance, fig),) = drawn
    assert fig.axes[0].get_ylim() == (0, 32) and distance.max() <= 32
    # a side, as before; the data beyond the image's size still fits
    assert real(np.full((2, 2), 10.0), 16).axes[0].get_ylim() == (0, 16)
    assert real(np.full((2, 2), 40.0), (16, 32)).axes[0].get_ylim()[1] >= 40


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_the_report_goes_into_a_pipe_or_device_named_as_out(tmp_path):
    # written beside and renamed over it, the page replaced a pipe (or, for root, /dev/null or
    # /dev/stdout) with a regular file; what reads the pipe got nothing
    import stat
    import threading

    from vitlab.analysis.report import write_report

    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    got = []
    reader = threading.Thread(target=lambda: got.append(pipe.read_text()), daemon=True)
    reader.start()
    write_report(create_model(TINY), images(1), pipe)
    reader.join(60)  # a guard: without the fix the reader waits for a writer that never comes
    assert stat.S_ISFIFO(pipe.stat().st_mode)
    assert got and got[0].startswith("<!DOCTYPE html>") and got[0].rstrip().endswith("</html>")
    (tmp_path / "empty.html").write_text("")  # an empty file holds nothing to lose
    (tmp_path / "link.html").symlink_to(tmp_path / "empty.html")
    write_report(create_model(TINY), images(1), tmp_path / "link.html")
    assert (tmp_path / "link.html").is_symlink() and "</html>" in (tmp_path / "empty.html").read_text()
    with pytest.raises(ValueError, match="out_path=.* is a folder; expected a file to write"):
        write_report(create_model(TINY), images(1), tmp_path)


def test_inspect_names_a_missing_image_before_it_loads_the_model(tmp_path, capsys, monkeypatch):
    # a mistyped image name stopped the report only once the model had been loaded (minutes for a large one)
    import vitlab.weights
    from vitlab.cli import main

    def not_to_be_loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the images were checked")

    monkeypatch.setattr(vitlab.weights, "load_model", not_to_be_loaded)
    (tmp_path / "folder").mkdir()
    for image, what in (("missing.png", "no such file"), ("folder", "a folder; expected image files")):
        assert main(["inspect", "weights", "--images", str(tmp_path / image), "--out", str(tmp_path / "r.html")]) == 2
        assert capsys.readouterr().err.strip() == f"vitlab inspect: error: {tmp_path / image}: {what}"


def test_a_failed_write_leaves_the_earlier_report_and_no_temporary_file(tmp_path, monkeypatch):
    # the page went to .NAME.<pid>.tmp, which a failure while writing it (a full disk) left behind
    from vitlab.analysis import report as report_module

    out = tmp_path / "report.html"
    out.write_text("<!DOCTYPE html><p>earlier</p><footer>Written by vitlab on 2026-11-29 12:00 UTC.</footer>")
    monkeypatch.setattr(report_module, "build_report", lambda *a, **k: "<!DOCTYPE html>\ud800")  # fails to encode
    with pytest.raises(UnicodeEncodeError):
        write_report(create_model(TINY), images(1), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]
    assert out.read_text() == "<!DOCTYPE html><p>earlier</p><footer>Written by vitlab on 2026-11-29 12:00 UTC.</footer>"


def test_class_names_not_one_per_class_of_the_model_are_refused(tmp_path, capsys):
    # a classes.json of other classes beside the weights (2 names for a model of 3 classes) labelled the
    # report's predictions, the first two classes by its names, where predict refuses it as not the model's
    from PIL import Image

    from vitlab.analysis.report import build_report
    from vitlab.cli import main
    from vitlab.weights import save_model

    model = create_model(TINY)
    torch.nn.init.normal_(model.head.weight)
    save_model(model, tmp_path / "model.safetensors")
    (tmp_path / "classes.json").write_text(json.dumps(["cat", "dog"]))
    Image.fromarray(images(1)[0].permute(1, 2, 0).numpy()).save(tmp_path / "x.png")
    assert main(["inspect", str(tmp_path / "model.safetensors"), "--images", str(tmp_path / "x.png"),
                 "--out", str(tmp_path / "r.html")]) == 2
    assert capsys.readouterr().err.strip() == (f"vitlab inspect: error: the class names kept with "
                                               f"{tmp_path / 'model.safetensors'}: 2 class names for a model of 3 classes")
    assert not (tmp_path / "r.html").exists()
    with pytest.raises(ValueError, match=r"^meta\['classes'\]: 4 class names for a model of 3 classes"):
        build_report(model, images(1), meta={"classes": ["cat", "dog", "emu", "gnu"]})
    # a model without a head names no classes: the names beside it are not read
    page = build_report(create_model(TINY, num_classes=0), images(1), meta={"classes": ["cat", "dog"]})
    assert "No predictions: the model has no classification head" in page
    save_model(create_model(TINY, num_classes=0), tmp_path / "model.safetensors")
    assert main(["inspect", str(tmp_path / "model.safetensors"), "--images", str(tmp_path / "x.png"),
                 "--out", str(tmp_path / "r.html")]) == 0


def test_an_empty_batch_of_images_is_refused_as_an_empty_list_is():
    # a tensor of no images gave a page whose attention section said "need at least one array to stack"
    from vitlab.analysis.report import build_report

    for none in ([], torch.zeros(0, 3, 16, 16, dtype=torch.uint8), np.zeros((0, 3, 16, 16), np.uint8)):
        with pytest.raises(ValueError, match="^no images given: the attention figures need at least one$"):
            build_report(create_model(TINY), none)


def test_an_html_page_the_report_did_not_write_is_kept(tmp_path, capsys):
    # any file that began as HTML was taken for an earlier report and replaced: a page of one's own
    # (a site's index.html) named as --out was lost
    from PIL import Image

    from vitlab.cli import main
    from vitlab.weights import save_model

    save_model(create_model(TINY), tmp_path / "model.safetensors")
    Image.fromarray(images(1)[0].permute(1, 2, 0).numpy()).save(tmp_path / "x.png")
    page = tmp_path / "index.html"
    page.write_text("<!DOCTYPE html>\n<html><body><p>my notes</p></body></html>\n")
    assert main(["inspect", str(tmp_path / "model.safetensors"), "--images", str(tmp_path / "x.png"),
                 "--out", str(page)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"vitlab inspect: error: --out={str(page)!r} is a file that is not an earlier report (a page vitlab "
        "inspect wrote); the report replaces nothing else: name another file")
    with pytest.raises(ValueError, match="out_path=.* is a file that is not an earlier report"):
        write_report(create_model(TINY), images(1), page)
    assert page.read_text() == "<!DOCTYPE html>\n<html><body><p>my notes</p></body></html>\n"
