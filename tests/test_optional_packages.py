"""A missing optional package is one line: the command, the package, and the extra that brings it.

Each package is hidden from the import system (``sys.modules[name] = None`` makes ``import name``
raise ModuleNotFoundError, as on a machine without it)."""
import importlib
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers.project import pyproject
from vitlab.cli import main
from vitlab.extras import EXTRAS, MissingPackage, require

ROOT = Path(__file__).resolve().parents[1]


def hide(monkeypatch, package: str) -> None:
    """Make ``package`` and every submodule already imported unimportable for this test."""
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, package, None)


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "x.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(path)
    return str(path)


def test_every_optional_package_has_its_extra():
    extras = pyproject()["project"]["optional-dependencies"]
    for module, (package, extra) in EXTRAS.items():
        assert any(req.startswith(package) for req in extras[extra]), (module, extra)
        assert any(req.startswith(package) for req in extras["test"]), f"CI must install {package}"


@pytest.mark.parametrize("module", sorted(EXTRAS))
def test_require_names_the_extra(monkeypatch, module):
    hide(monkeypatch, module)
    with pytest.raises(MissingPackage) as info:
        require(module, "this feature")
    package, extra = EXTRAS[module]
    assert str(info.value) == f'this feature needs {package}, which is not installed: pip install -e ".[{extra}]"'


def test_demo_extra_brings_what_the_demo_imports():
    demo = pyproject()["project"]["optional-dependencies"]["demo"]
    assert {EXTRAS["sklearn"][0], EXTRAS["matplotlib"][0]} <= {req.split(">")[0].split("=")[0] for req in demo}


def test_plots_import_without_matplotlib(monkeypatch):
    hide(monkeypatch, "matplotlib")
    for name in ("vitlab.analysis.plots", "vitlab.analysis.report"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    plots = importlib.import_module("vitlab.analysis.plots")
    with pytest.raises(MissingPackage, match=r'pip install -e "\.\[plots\]"'):
        plots.plot_position_similarity(np.ones((2, 2, 2, 2)))


def test_an_experiment_without_matplotlib_skips_its_figure_naming_the_extra(monkeypatch, tmp_path, capsys):
    from vitlab.experiments import draw_figure, head

    hide(monkeypatch, "matplotlib")
    assert draw_figure(head, [{"classifier": "token", "lr": 0.001, "val_top1": 0.5}], tmp_path / "f.png") is None
    assert one_line(capsys) == ('figure skipped: drawing figures needs matplotlib, which is not installed: '
                                'pip install -e ".[plots]"')


def test_an_experiment_without_its_figure_leaves_no_earlier_figure_beside_its_results(monkeypatch, tmp_path, capsys):
    """An earlier invocation's figure.png stayed in the folder, showing another run's table beside this
    one's results.json (and git add results/NAME took it)."""
    from vitlab.experiments import draw_figure, head

    (tmp_path / "figure.png").write_bytes(b"an earlier run's figure")
    hide(monkeypatch, "matplotlib")
    assert draw_figure(head, [{"classifier": "token", "lr": 0.001, "val_top1": 0.5}], tmp_path / "figure.png") is None
    assert one_line(capsys).startswith("figure skipped: drawing figures needs matplotlib")
    assert os.listdir(tmp_path) == []


def test_demo_without_matplotlib_skips_the_report_in_one_line(monkeypatch, tmp_path, capsys):
    hide(monkeypatch, "matplotlib")
    assert main(["demo", "--out", str(tmp_path / "demo"), "--steps", "2", "--quiet",
                 "--set", "run.tensorboard=false"]) == 0
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if line.startswith("report:")]
    assert skipped == ['report: skipped: drawing figures needs matplotlib, which is not installed: '
                       'pip install -e ".[plots]"']
    assert (tmp_path / "demo" / "model.safetensors").is_file()


def test_demo_without_scikit_learn(monkeypatch, tmp_path, capsys):
    hide(monkeypatch, "sklearn")
    from vitlab.data import digits

    digits._digits.cache_clear()  # decoded earlier in this process: read again, without scikit-learn
    assert main(["demo", "--out", str(tmp_path / "demo"), "--quiet"]) == 2
    assert one_line(capsys) == ('vitlab demo: error: the digits data set needs scikit-learn, which is not '
                                'installed: pip install -e ".[demo]"')


def test_fewshot_without_scikit_learn(monkeypatch, tiny_checkpoint, capsys):
    hide(monkeypatch, "sklearn")
    from vitlab.data import digits

    digits._digits.cache_clear()
    assert main(["fewshot", tiny_checkpoint, "--data", "digits", "--feature-cache", "none"]) == 2
    assert 'pip install -e ".[demo]"' in one_line(capsys)


def test_inspect_without_matplotlib(monkeypatch, tiny_checkpoint, image, tmp_path, capsys):
    hide(monkeypatch, "matplotlib")
    assert main(["inspect", tiny_checkpoint, "--images", image, "--out", str(tmp_path / "r.html")]) == 2
    assert one_line(capsys) == ('vitlab inspect: error: the inspection report needs matplotlib, which is not '
                                'installed: pip install -e ".[plots]"')
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("package", ["onnx", "onnxscript"])
def test_onnx_export_without_onnx(monkeypatch, tiny_checkpoint, tmp_path, capsys, package):
    hide(monkeypatch, package)
    assert main(["export", tiny_checkpoint, "--format", "onnx", "--out", str(tmp_path / "m.onnx")]) == 2
    assert one_line(capsys) == (f'vitlab export: error: ONNX export needs {package}, which is not installed: '
                                'pip install -e ".[export]"')


def test_a_plain_import_of_an_optional_package_deep_inside_is_one_line_too(monkeypatch, capsys):
    """A command that imports an optional package without ``require`` still gets the line."""
    import vitlab.cli.models as models_cli

    hide(monkeypatch, "onnxruntime")

    def run(args):
        import onnxruntime  # noqa: F401

    monkeypatch.setattr(models_cli, "run", run)
    assert main(["models"]) == 2
    assert one_line(capsys) == ('vitlab models: error: this command needs onnxruntime, which is not installed: '
                                'pip install -e ".[export]"')


def test_an_optional_package_too_old_for_this_torch_is_not_said_to_be_absent(monkeypatch, tiny_checkpoint, tmp_path,
                                                                               capsys):
    """torch.onnx imports ``onnxscript._framework_apis.torch_2_11`` deep inside the export, which an onnxscript
    older than 0.6 lacks: the line said onnxscript "is not installed", beside a pip line that, the old one
    meeting the extra's floor, changed nothing."""
    import torch

    pytest.importorskip("onnxscript")
    part = "onnxscript._framework_apis.torch_2_11"

    def export_with_an_older_onnxscript(*args, **kwargs):  # what torch.onnx raises (its import is lazy, and cached)
        raise ModuleNotFoundError(f"No module named {part!r}", name=part)

    monkeypatch.setattr(torch.onnx, "export", export_with_an_older_onnxscript)
    assert main(["export", tiny_checkpoint, "--format", "onnx", "--out", str(tmp_path / "m.onnx")]) == 2
    line = one_line(capsys)
    assert line.startswith("vitlab export: error: this command needs onnxscript, which does not import (")
    assert "onnxscript._framework_apis.torch_2_11" in line and line.endswith('pip install -e ".[export]"')
