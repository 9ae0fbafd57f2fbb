"""Every command docs/*.md and benchmarks/NOTES.md show works as written today, the standard being
that every figure comes with the command that reproduces it; tests/test_readme.py holds the README
to the same checks (tests/helpers/doc_commands.py).  Nothing is run, nothing is imported from
benchmarks/.  The commands: every line of a ```bash block; every line of a plain fenced block or
an indented (4-space) block, and every inline span, that starts with ``vitlab``, ``python``,
``bash`` or ``torchrun`` (``$ `` prompts dropped; a bare ```vitlab eval``` names a command, which
must exist; ``vitlab train: error ...`` is output).  Each is parametrized by its file and line:

* ``vitlab ...`` (also under ``torchrun``/``python -m``) parses with ``vitlab.cli.build_parser``;
  a train/finetune/sweep command's recipe exists and its ``--set FIELD=VALUE`` fields build a
  valid config (``vitlab.cli.train.resolve_config``); an experiment's name and ``--set`` keys
  exist.  An inline span may show a flag without the command's required arguments
  (```vitlab eval --compile```); a bash line may not.  A flag is spelled out (argparse would take
  ``--seed`` for ``--seeds``, a flag other than the one shown);
* ``python benchmarks/X.py ...`` / ``python -m benchmarks.X ...``: the script exists and its
  argparse flags (read from its source) or its A/B experiment names accept the words;
* ``bash FILE``, ``.ci/run``, ``python FILE.py``, ``python -m pytest PATH``: the files exist;
* no command leaves parentheses unquoted (``--only 'infer/(a|b)$'``: a shell reads them as syntax).

Besides the commands, what docs/ states that is cheap to check: the table of docs/models.md is
what ``vitlab models --markdown`` prints, every ``vitlab.x.y`` its code names (inline spans,
python blocks) exists, and every ``pip install -e ".[extra]"`` names an extra of pyproject.toml.
A figure's source, where the docs and the README name it, is there: every short revision
(seven hex digits: ``(c9e7a6c; ...``) is a commit, every bench record (``vm-20261126-0621.json``)
a file of benchmarks/results/.

Placeholders (``W``, ``DATA``, ``N``, ``REV``, ``NAME``, ``<trained weights>``, ``...``) are fine
as values; a placeholder recipe or experiment is not looked up.  ``[--seed 1]`` is checked as if
given; ``{a,b}`` and ``a|b`` are alternatives, each checked.

**Historical commands.**  A figure measured with a script or a flag that has since gone keeps
the command that measured it, marked with the revision it ran at: ``(at REV)`` right after the
inline span (```python benchmarks/ab.py peers` (at 78d71ee)``), or in the comment of its line in
a bash block (``# (at 78d71ee)``); REV is the last revision the command worked at.  Such a
command is left out of today's checks; instead REV must be a commit and a benchmark script's
arguments are checked against that script as it was at REV (read with git; skipped outside a
complete git checkout), and a marked command that works today must lose its mark.  A
``--before REV`` of a benchmark must be a commit too.
"""
import importlib
import re
import subprocess
from functools import cache

import pytest

from helpers.doc_commands import (ROOT, benchmark_of, check, check_benchmark, fenced, is_placeholder, kind_of,
                                  named_commands, shell_commands, unquoted_parentheses)
from helpers.project import pyproject

FILES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")) + ["benchmarks/NOTES.md"]
TEXTS = {f: (ROOT / f).read_text() for f in FILES}
COMMANDS = [c for f in FILES for c in shell_commands(TEXTS[f], f)]
TODAY = [c for c in COMMANDS if c.rev is None]
HISTORICAL = [c for c in COMMANDS if c.rev is not None]
NAMED = [(f, line, name) for f in FILES for line, name in named_commands(TEXTS[f])]


def test_the_docs_show_commands():
    assert {c.file for c in COMMANDS} >= {"docs/results.md", "docs/performance.md", "docs/training.md",
                                          "docs/scale.md", "docs/findings.md", "benchmarks/NOTES.md"}
    assert {kind_of(c.argv) for c in TODAY} >= {"vitlab", "benchmark", "file"}


@pytest.mark.parametrize("command", TODAY, ids=[c.id for c in TODAY])
def test_every_command_works_as_written(command):
    assert not unquoted_parentheses(command.text), f"unquoted parentheses: {command.text}"
    check(command.argv, partial=command.inline)


@pytest.mark.parametrize("where", NAMED, ids=[f"{f}:{line}:{name}" for f, line, name in NAMED])
def test_every_command_the_docs_name_exists(where):
    from vitlab.cli import COMMANDS as CLI

    assert where[2] in {name for name, _, _ in CLI}


def git(*args: str, stdin: str | None = None) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], input=stdin, capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


@pytest.fixture(scope="module")
def history():
    """The repository's history, or a skip where there is none to read (no git, a shallow clone)."""
    if (git("rev-parse", "--is-shallow-repository") or "").strip() != "false":
        pytest.skip("not a complete git checkout: the revisions cannot be read")
    return git


def named_revisions() -> set[str]:
    """The revisions the commands name: their ``(at REV)`` marks and the benchmarks' ``--before REV``."""
    revs = {c.rev for c in HISTORICAL}
    for c in TODAY:
        if benchmark_of(c.argv) and "--before" in c.argv[:-1]:
            revs.add(c.argv[c.argv.index("--before") + 1])
    return {rev for rev in revs if not is_placeholder(rev)}


def test_every_revision_the_commands_name_is_a_commit(history):
    revs = sorted(named_revisions())
    found = history("cat-file", "--batch-check", stdin="".join(f"{rev}^{{commit}}\n" for rev in revs))
    assert found is not None
    missing = [rev for rev, line in zip(revs, found.splitlines()) if line.endswith("missing")]
    assert not missing, f"no such commit: {missing}"


# a short revision in the text, seven hex digits with a letter and a digit among them (``(c9e7a6c; ...``,
# ``d834062``): the commit a figure's source is named by
SHORT_REVISION = re.compile(r"(?<![\w/-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7}(?![\w-])")
# a bench record, the source a figure is read from: ``vm-20261126-0621.json``, ``NVIDIA_H200-20261126-0837.json``
BENCH_RECORD = re.compile(r"\b(?:vm|NVIDIA_\w+?)-\d{8}-\d{4}\.json")
SOURCED = FILES + ["README.md"]
SOURCE_TEXTS = {**TEXTS, "README.md": (ROOT / "README.md").read_text()}


def test_every_revision_the_docs_name_is_a_commit(history):
    """A figure's source named by its commit (the run's code, the commit that recorded it) can be read."""
    revs = sorted({rev for f in SOURCED for rev in SHORT_REVISION.findall(SOURCE_TEXTS[f])})
    assert revs
    found = history("cat-file", "--batch-check", stdin="".join(f"{rev}^{{commit}}\n" for rev in revs))
    assert found is not None
    missing = [rev for rev, line in zip(revs, found.splitlines()) if line.endswith("missing")]
    assert not missing, f"no such commit: {missing}"


def test_every_bench_record_the_docs_name_exists():
    """A figure read from a bench record names a file of benchmarks/results/ (none renamed or dropped)."""
    named = {name for f in SOURCED for name in BENCH_RECORD.findall(SOURCE_TEXTS[f])}
    assert named
    missing = sorted(name for name in named if not (ROOT / "benchmarks" / "results" / name).is_file())
    assert not missing, f"no such record in benchmarks/results/: {missing}"


@pytest.mark.parametrize("command", HISTORICAL, ids=[c.id for c in HISTORICAL])
def test_every_historical_command_worked_at_its_revision(command, history):
    if benchmark_of(command.argv):  # the script as it was then accepts the words (vitlab's own parser is not rebuilt)
        path = benchmark_of(command.argv)[0]
        source = source_at(command.rev, path)
        assert source is not None, f"{path} is not in {command.rev}"
        check_benchmark(command.argv, source)


@cache
def source_at(rev: str, path: str) -> str | None:
    return git("show", f"{rev}:{path}")


def test_historical_commands_are_history():
    """A command marked historical that works today should lose its mark."""
    today = []
    for command in HISTORICAL:
        try:
            check(command.argv, partial=command.inline)
        except Exception:
            continue
        today.append(command.id)
    assert not today, f"marked (at REV) yet they work today: {today}"


# what else the docs state that is cheap to hold them to ------------------------------------------

DOCS = [f for f in FILES if f.startswith("docs/")]  # benchmarks/NOTES.md keeps the names of retired code


def test_the_models_table_is_what_vitlab_models_prints(capsys):
    """docs/models.md says "Reproduce with `vitlab models --markdown`": its table is that output."""
    from vitlab.cli import main

    assert main(["models", "--markdown"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    text = TEXTS["docs/models.md"]
    table = [line for line in text[text.index("| model | parameters |"):].splitlines() if line.startswith("|")]
    assert table == printed


def named_objects(text: str) -> set[str]:
    """Every dotted ``vitlab.x.y`` a page names in its code: inline spans and fenced python blocks."""
    code = re.findall(r"`([^`\n]+)`", text) + [block for _, block in fenced(text, "python")]
    return {name for span in code for name in re.findall(r"\bvitlab(?:\.\w+)+", span)}


@pytest.mark.parametrize("file", DOCS)
def test_every_vitlab_name_the_docs_give_exists(file):
    for name in sorted(named_objects(TEXTS[file])):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module, then its attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        for part in parts[cut:]:
            assert hasattr(obj, part), f"{file}: {name}: {'.'.join(parts[:cut])} has no {part}"
            obj = getattr(obj, part)


def test_every_extra_the_docs_name_exists():
    extras = pyproject()["project"]["optional-dependencies"]
    named = {extra for f in DOCS for extra in re.findall(r'pip install -e "\.\[(\w+)\]"', TEXTS[f])}
    assert named and named <= set(extras)
