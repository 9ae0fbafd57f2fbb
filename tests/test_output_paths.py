"""Every command that writes refuses an output it cannot write before its work, in one line that
names the flag: a folder where a file goes, a file where a folder goes, a place where nothing can
be made.  Each command is given a source that does not exist, so the output's refusal shows it is
checked first (it was the OS's bare "[Errno 21] Is a directory", after the model was loaded or
traced, or the features extracted)."""
import os

import pytest

from vitlab.cli import main
from vitlab.config import ConfigError, need_output_file, need_output_folder


def commands(tmp_path, out):
    missing = str(tmp_path / "missing.safetensors")
    return {
        "export": ["export", missing, "--out", str(out)],
        "convert": ["convert", missing, str(out), "--to", "official"],
        "inspect": ["inspect", missing, "--images", missing, "--out", str(out)],
        "pack-shards": ["pack-shards", str(tmp_path / "missing-folder"), str(out)],
        "fewshot": ["fewshot", missing, "--feature-cache", str(out)],
    }


def out_name(command: str) -> str:
    """A file name the command's output check passes to the place check: convert's --to official writes .npz,
    which export refuses as a name of weights."""
    return "out.onnx" if command == "export" else "out.npz"


# (command, what its output is, the flag its error names)
OUTPUTS = [("export", "file", "--out"), ("convert", "file", "out"), ("inspect", "file", "--out"),
           ("pack-shards", "folder", "out_dir"), ("fewshot", "folder", "--feature-cache")]


@pytest.mark.parametrize("command, kind, flag", OUTPUTS)
def test_an_output_of_the_wrong_kind_is_refused_first(tmp_path, capsys, command, kind, flag):
    if command == "inspect":
        pytest.importorskip("matplotlib")
    out = tmp_path / out_name(command)
    if kind == "file":
        out.mkdir()
        expected = f"{flag}='{out}' is a folder; expected a file to write"
    else:
        out.write_text("kept")
        expected = f"{flag}='{out}' is a file; expected a folder (a new one, or a run's)"
    assert main(commands(tmp_path, out)[command]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"vitlab {command}: error: {expected}"
    assert kind == "file" or out.read_text() == "kept"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where nothing can be made")
@pytest.mark.parametrize("command, kind, flag", OUTPUTS)
def test_an_output_where_nothing_can_be_written_is_refused_first(tmp_path, capsys, command, kind, flag):
    if command == "inspect":
        pytest.importorskip("matplotlib")
    out = f"/proc/x/{out_name(command)}"
    assert main(commands(tmp_path, out)[command]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"vitlab {command}: error: {flag}='{out}': nothing can be written in '/proc' (")
    assert err.endswith("); expected a writable folder") and len(err.splitlines()) == 1


def test_the_checks_accept_what_can_be_written(tmp_path):
    need_output_file("out", tmp_path / "new" / "deeper" / "model.onnx")  # folders made on the way
    need_output_file("out", tmp_path / "model.onnx")
    need_output_folder("out", tmp_path)  # an existing folder: a run's
    need_output_folder("out", tmp_path / "new" / "run")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match=r"out='.*a-file/run' lies under '.*a-file', a file; expected a folder"):
        need_output_folder("out", tmp_path / "a-file" / "run")
    with pytest.raises(ConfigError, match=r"out='.*a-file/model.onnx' lies under '.*a-file', a file; expected a "
                                          r"file in a folder"):
        need_output_file("out", tmp_path / "a-file" / "model.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # the checks leave nothing behind
