"""The README's commands work as written: every shell command it shows is checked against the
CLI's parser (and a training command's configuration is built and checked), every
``pip install -e ".[extra]"`` names an extra of pyproject.toml, every file it runs exists,
and every ``vitlab.name`` of its Python examples exists.  `vitlab demo` itself runs in
tests/train/test_cli.py; the README cannot drift from the CLI unnoticed.  The checks of a command
are tests/helpers/doc_commands.py's, which tests/test_docs_commands.py applies to docs/."""
import re
import shlex
from pathlib import Path

import pytest

import vitlab
from helpers.doc_commands import check_vitlab, vitlab_argv
from helpers.project import pyproject

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def fenced(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


INLINE = re.findall(r"`(vitlab [^`]+)`", README)  # `vitlab eval` names a command; longer spans are commands


def shell_commands() -> list[list[str]]:
    """Every command of the README's bash blocks, and of its inline `vitlab ...` spans, as argv
    lists: continuation lines joined, comments dropped, ``&&`` chains split."""
    texts = [block.replace("\\\n", " ") for block in fenced("bash")]
    texts += [span for span in INLINE if len(span.split()) > 2 and "[" not in span and "|" not in span]
    commands = []
    for text in texts:
        for line in text.splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                commands.append(words[:cut])
                words = words[cut + 1:]
    return [c for c in commands if c]


COMMANDS = shell_commands()
VITLAB = [argv for argv in map(vitlab_argv, COMMANDS) if argv is not None]


def test_every_command_the_readme_names_exists():
    from vitlab.cli import COMMANDS as CLI

    assert {span.split()[1] for span in INLINE} <= {name for name, _, _ in CLI}


def test_the_readme_shows_the_commands_it_should():
    shown = {argv[0] for argv in VITLAB}
    assert {"demo", "train", "finetune", "sweep", "eval", "predict", "fewshot", "inspect", "export", "flops",
            "pack-shards"} <= shown
    assert ["pip", "install", "-e", ".[demo]"] in COMMANDS and ["vitlab", "demo"] in COMMANDS


@pytest.mark.parametrize("argv", VITLAB, ids=[" ".join(a)[:60] for a in VITLAB])
def test_every_vitlab_command_parses_and_configures(argv):
    check_vitlab(argv)  # it parses; a training command's recipe and flags build a valid config; flops' model exists


def test_every_extra_and_file_the_readme_names_exists():
    extras = pyproject()["project"]["optional-dependencies"]
    named = set(re.findall(r'pip install -e "\.\[(\w+)\]"', README))
    assert named and named <= set(extras)
    for command in COMMANDS:
        if command[0] == "python" and command[1].endswith(".py") or command[0] == "bash":
            assert (ROOT / command[1]).is_file(), command
        if command[:3] == ["python", "-m", "pytest"]:
            assert (ROOT / command[3]).is_dir()


def test_every_vitlab_name_in_the_python_examples_exists():
    names = {m for block in fenced("python") for m in re.findall(r"\bvitlab(?:\.\w+)+", block)}
    assert names
    for name in names:
        obj = vitlab
        for part in name.split(".")[1:]:
            obj = getattr(obj, part)  # AttributeError: the README names something vitlab lacks
