"""The shell commands a markdown file shows, and the checks that they work as written, without
running any of them: tests/test_readme.py (README.md) and tests/test_docs_commands.py (docs/*.md,
benchmarks/NOTES.md) drive them.

* ``vitlab ...`` (and ``torchrun/python ... -m vitlab ...``): parsed by the CLI's own parser;
  a train/finetune/sweep command's configuration is built (the recipe exists, every ``--set``
  field exists and takes its value); an experiment's name and ``--set`` keys exist.
* ``python benchmarks/X.py ...`` and ``python -m benchmarks.X ...``: the script exists and its
  command line accepts the arguments.  The script is not imported (it imports torch, and some
  of them put benchmarks/ on sys.path): its ``add_argument`` calls are read from its source and
  replayed on a fresh ``argparse`` parser, or, for an A/B script (``run_experiments(EXPERIMENTS,
  sys.argv[1:])``), the arguments must be keys of its ``EXPERIMENTS``.
* ``bash FILE``, ``python FILE.py``, ``.ci/run``, ``python -m pytest PATH``: the files exist
  (one outside the repository, ``../shared/tools/...``, is not looked for; ``.gpu/gpu_check.sh``
  is the copy ``bash benchmarks/gpu_check.sh prepare`` makes: PREPARED).

A placeholder (``W``, ``DATA``, ``N``, ``REV``, ``...``) stands for any valid value: a typed
flag's placeholder is read as a valid value, a placeholder recipe or experiment is not looked up.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import io
import itertools
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# ` (at 78d71ee)` after an inline span, or `# ... (at 78d71ee)` in a bash block's comment
AT_REV = re.compile(r"\(at ([0-9a-f]{7,40})\)")
# a placeholder the reader replaces: W, DATA, PATH, NAME, RUN, OUT.npz...
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*(\.\w+)?|\.\.\.")
SEPARATORS = {"&&", "||", ";", "|"}
# files a command writes before the docs run them: the path -> the tracked file it copies
PREPARED = {".gpu/gpu_check.sh": "benchmarks/gpu_check.sh"}


@dataclass
class Command:
    file: str  # relative to the repository root
    line: int
    argv: list[str]
    rev: str | None = None  # the revision it is shown as of: a historical command, not checked against today
    inline: bool = False  # an inline span, which may show a command's flag without its required arguments
    text: str = ""  # the shell text it came from

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}:{' '.join(self.argv)[:50]}"


def fenced(text: str, language: str) -> list[tuple[int, str]]:
    """The blocks of ```language, each with the line number of its first line."""
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1))
            for m in re.finditer(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)]


def unbracket(text: str) -> str:
    """Optional parts as shown, ``[--seed 1]`` and ``cifar10_scratch[:model=...]``: the first is checked as
    if given, the second, which elides its value, is left out; a value's brackets (``'sizes=[0]'``) stay.
    A described value, ``<trained weights>``, is a placeholder."""
    text = re.sub(r"<\w[\w ]*>", "VALUE", text)
    text = re.sub(r"\[(--[^\]]*)\]", r"\1", text)
    return re.sub(r"\[:[^\]]*\]", "", text)


def alternatives(word: str) -> list[str]:
    """``{vitlab,hf,timm}`` and ``sizes|compile``: the choices a reader picks among."""
    if re.fullmatch(r"\{[\w.-]+(,[\w.-]+)+\}", word):
        return word[1:-1].split(",")
    if re.fullmatch(r"[\w.-]+(\|[\w.-]+)+", word):
        return word.split("|")
    return [word]


def split_commands(line: str) -> list[list[str]]:
    """One shell line as the argv lists of its commands: comments dropped, ``&&``/``;``/``|`` chains split,
    ``NAME=value`` environment prefixes dropped, each choice among alternatives a command of its own."""
    words = [piece for word in shlex.split(unbracket(line), comments=True) for piece in re.split(r"(;)$", word)
             if piece]
    commands = []
    for sep, group in itertools.groupby(words, key=lambda w: w in SEPARATORS):
        group = list(group)
        while group and re.fullmatch(r"\w+=\S*", group[0]):
            group.pop(0)
        if not sep and group:
            commands += [list(argv) for argv in itertools.product(*map(alternatives, group))]
    return commands


def is_command(argv: list[str]) -> bool:
    """Whether these words are a command these checks know: vitlab, a benchmark, a file run."""
    return kind_of(argv) is not None


def kind_of(argv: list[str]) -> str | None:
    if vitlab_argv(argv) is not None:
        return "vitlab"
    if benchmark_of(argv) is not None:
        return "benchmark"
    if argv[0] in ("python", "python3") and len(argv) > 2 and argv[1:3] == ["-m", "pytest"]:
        return "pytest"
    if argv[0] == "bash" and len(argv) > 1 or argv[0] in ("python", "python3") and len(argv) > 1 \
            and argv[1].endswith(".py") or argv[0].startswith((".ci/", "./")):
        return "file"
    return None


COMMAND_WORDS = ("vitlab", "python", "python3", "bash", "torchrun")


def starts_a_command(text: str) -> bool:
    """Whether shell text starts with a command word (after ``NAME=value`` prefixes) and is no
    message (``vitlab train: error: ...`` is the command's output)."""
    first = text.split()
    while first and re.fullmatch(r"\w+=\S*", first[0]):
        first.pop(0)
    return bool(first) and first[0] in COMMAND_WORDS and not (first[0] == "vitlab" and first[1:2]
                                                               and first[1].endswith(":"))


def block_commands(lines: list[str], first: int, file: str, shell: bool = False) -> list[Command]:
    """The commands of consecutive code lines, the first numbered ``first``: ``\\`` continues a
    line, a ``$ `` prompt is dropped; a line that starts no command (output) is skipped, but in a
    ``shell`` block (```bash) every line is shell (``cd x && vitlab ...``)."""
    commands, number, pending = [], first, ""
    for i, line in enumerate(lines):
        if not pending:
            number = first + i
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line, pending = (pending + line).strip().removeprefix("$ "), ""
        if not (shell or starts_a_command(line)):
            continue
        comment = line.split("#", 1)[1] if "#" in line else ""
        rev = AT_REV.search(comment)
        commands += [Command(file, number, argv, rev and rev.group(1), text=line) for argv in split_commands(line)]
    return commands


def shell_commands(text: str, file: str, inline: bool = True) -> list[Command]:
    """Every command of ``text``'s code, each with its line: the lines of its fenced blocks and
    indented (4-space) blocks that start with a command (``vitlab``, ``python``, ``bash``,
    ``torchrun``), ``$ `` prompts dropped; and its inline spans that start with one (a bare
    ``vitlab eval`` names a command and is left to :func:`named_commands`).  A command marked
    ``(at REV)`` carries the revision."""
    commands = []
    outside = text.splitlines(keepends=True)  # the text with its fenced blocks blanked
    for start, block in fenced(text, r"\w*"):
        outside[start - 2:start + block.count("\n")] = ["\n"] * (block.count("\n") + 2)
        language = text.splitlines()[start - 2].removeprefix("```")
        if language in ("bash", "sh", "shell", "console", ""):
            commands += block_commands(block.splitlines(), start, file, shell=language in ("bash", "sh", "shell"))
    indented, previous = [], "\n"
    for number, line in enumerate(outside + ["\n"], 1):
        if line.startswith("    ") and (indented or not previous.strip()):
            indented.append(line)
        elif indented:
            commands += block_commands(indented, number - len(indented), file)
            indented = []
        previous = line
    outside = "".join(outside)
    for m in re.finditer(r"`((?:[^`\n]|\n(?!\s*\n))+)`(\s*\(at ([0-9a-f]{7,40})\))?", outside if inline else ""):
        span = " ".join(m.group(1).split())
        if not starts_a_command(span) or span.split()[0] == "vitlab" and len(span.split()) < 3:
            continue
        number = outside.count("\n", 0, m.start()) + 1
        commands += [Command(file, number, argv, m.group(3), inline=True, text=span) for argv in split_commands(span)]
    return sorted((c for c in commands if is_command(c.argv)), key=lambda c: c.line)


def unquoted_parentheses(text: str) -> bool:
    """Whether a shell would read ``(`` or ``)`` in ``text`` as syntax (a pattern left unquoted:
    ``--only infer/(a|b)$`` is a syntax error, ``--only 'infer/(a|b)$'`` a pattern)."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars="();<>|&")
    lexer.whitespace_split = True
    return any(set(token) <= set("();<>|&") and set(token) & set("()") for token in lexer)  # quoted: in a word


def named_commands(text: str) -> list[tuple[int, str]]:
    """The ``vitlab NAME`` spans that name a command, with their lines."""
    return [(number, m.group(1)) for number, line in enumerate(text.splitlines(), 1)
            for m in re.finditer(r"`vitlab ([\w-]+)`", line)]


def vitlab_argv(command: list[str]) -> list[str] | None:
    """The arguments of ``vitlab ...`` and ``... -m vitlab ...`` (torchrun, python)."""
    if command[0] == "vitlab":
        return command[1:]
    if "-m" in command[:-1] and command[command.index("-m") + 1] == "vitlab":
        return command[command.index("-m") + 2:]
    return None


def parse_or_fail(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """argparse's parse, its refusal (it exits) raised as an AssertionError that quotes it."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(argv)
    except SystemExit:
        raise AssertionError(f"{' '.join(argv)}: {err.getvalue().strip()}") from None


def is_placeholder(word: str | None) -> bool:
    return word is not None and PLACEHOLDER.fullmatch(word) is not None


class AndPlaceholders(list):
    """An argparse ``choices`` that also admits placeholders."""

    def __contains__(self, value):
        return is_placeholder(value) or super().__contains__(value)


def typed_or_placeholder(kind):
    def convert(text):
        return kind("1" if is_placeholder(text) else text)
    return convert


def lenient(parser: argparse.ArgumentParser, partial: bool) -> argparse.ArgumentParser:
    """``parser`` (and its commands') taking placeholders as values and refusing abbreviated flags
    (`--seed` for `--seeds`); ``partial``: no argument required (`vitlab eval --compile` shows a flag)."""
    for sub in [parser, *getattr(parser, "commands", {}).values()]:
        sub.allow_abbrev = False  # `--seed` for `--seeds` works, but names another flag than it shows
        for action in sub._actions:
            if action.type is not None and action.type is not str:
                action.type = typed_or_placeholder(action.type)
            if action.choices is not None and not isinstance(action.choices, dict):
                action.choices = AndPlaceholders(action.choices)
            if partial:
                action.required = False
    return parser


def check_vitlab(argv: list[str], partial: bool = False) -> argparse.Namespace:
    """A ``vitlab`` command line parses, and what it names exists: the recipe and ``--set`` fields of
    train/finetune/sweep (its config is built), the model of flops, the experiment and its settings.
    ``partial``: the command may lack its required arguments (an inline span showing a flag)."""
    from vitlab.cli import build_parser

    args = parse_or_fail(lenient(build_parser(), partial), argv)
    if args.command in ("train", "finetune", "sweep") and args.recipe and not is_placeholder(args.recipe):
        from vitlab.cli.train import resolve_config

        args.overrides = [o for o in args.overrides if o != "..."]  # `--set ...`: settings elided
        extra = {"model.init": args.init} if getattr(args, "init", None) else None
        resolve_config(args, extra)  # the recipe, its arguments and every flag build a valid config
    if args.command == "flops":
        from vitlab.models.registry import get_config

        get_config(args.model)
    if args.command == "experiment" and args.name and not is_placeholder(args.name):
        from vitlab import experiments
        from vitlab.cli.experiment import parse_settings

        assert args.name in {name for name, _, _ in experiments.describe()}, f"no experiment {args.name!r}"
        parse_settings(args.name, args.quick, args.set)
    return args


# benchmarks ------------------------------------------------------------------------------------

def benchmark_of(argv: list[str]) -> tuple[str, list[str]] | None:
    """``python benchmarks/X.py ARGS`` or ``python -m benchmarks.X ARGS``: (``benchmarks/X.py``, ARGS)."""
    if argv[0] not in ("python", "python3") or len(argv) < 2:
        return None
    if argv[1].startswith("benchmarks/") and argv[1].endswith(".py"):
        return argv[1], argv[2:]
    if argv[1] == "-m" and len(argv) > 2 and argv[2].startswith("benchmarks."):
        return argv[2].replace(".", "/") + ".py", argv[3:]
    return None


class Refused(Exception):
    pass


class ScriptParser(argparse.ArgumentParser):
    def error(self, message):
        raise Refused(message)


LITERAL_KWARGS = {"action", "nargs", "choices", "dest", "const"}


def parser_of_source(source: str, name: str) -> argparse.ArgumentParser:
    """The command line of a benchmark script, from its source: its ``add_argument`` calls replayed
    (their literal flags, ``action``, ``nargs``, ``choices``, ``dest``; ``type=int/float``), or, for
    an A/B script (a module-level ``EXPERIMENTS`` dict, its keys the arguments:
    ``run_experiments(EXPERIMENTS, sys.argv[1:])``), a choice among the keys of ``EXPERIMENTS``."""
    tree = ast.parse(source)
    parser = ScriptParser(prog=name, add_help=True, allow_abbrev=False)
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    add_argument = [c for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr == "add_argument"]
    experiments = [node.value for node in tree.body if isinstance(node, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == "EXPERIMENTS" for t in node.targets)]
    if experiments and not add_argument:  # run_experiments(EXPERIMENTS, sys.argv[1:]), or ab.py's own loop
        names = [k.value for d in experiments if isinstance(d, ast.Dict) for k in d.keys
                 if isinstance(k, ast.Constant)]
        assert names, f"{name}: EXPERIMENTS is no literal dict"
        parser.add_argument("experiments", nargs="*")  # choices=: argparse refuses none (bpo-9625)
        parser.experiments = names
        return parser
    for call in add_argument:
        flags = [ast.literal_eval(a) for a in call.args]
        kwargs = {}
        for kw in call.keywords:
            if kw.arg in LITERAL_KWARGS:
                with contextlib.suppress(ValueError):
                    kwargs[kw.arg] = ast.literal_eval(kw.value)
            if kw.arg == "type" and isinstance(kw.value, ast.Name) and kw.value.id in ("int", "float"):
                kwargs["type"] = {"int": int, "float": float}[kw.value.id]
        parser.add_argument(*flags, **kwargs)
    assert add_argument or "sys.argv" not in source, f"{name}: reads sys.argv without argparse: teach this its form"
    return parser


@cache
def benchmark_parser(path: str) -> argparse.ArgumentParser:
    return parser_of_source((ROOT / path).read_text(), path)


def check_benchmark(argv: list[str], source: str | None = None) -> None:
    """``python benchmarks/X.py ARGS``: X exists (or ``source`` is its text at a revision) and accepts ARGS."""
    path, args = benchmark_of(argv)
    if source is None:
        assert (ROOT / path).is_file(), f"{path} does not exist"
        parser = benchmark_parser(path)
    else:
        parser = parser_of_source(source, path)
    if args and args[0] in ("-h", "--help"):
        return
    try:
        parsed = parser.parse_args(args)
        unknown = [name for name in getattr(parsed, "experiments", [])
                   if name not in parser.experiments and not is_placeholder(name)]
        if unknown:
            raise Refused(f"unknown experiment {', '.join(unknown)}; choose among: {' '.join(parser.experiments)}")
    except Refused as err:
        raise AssertionError(f"{' '.join(argv)}: {path} refuses it: {err}") from None


def check_files(argv: list[str]) -> None:
    """``bash FILE``, ``python FILE.py``, ``.ci/run``, ``python -m pytest PATH...``: they exist."""
    kind = kind_of(argv)
    if kind == "pytest":
        for before, word in zip(argv[2:], argv[3:]):
            if not word.startswith("-") and before not in ("-m", "-k", "-p", "-n"):
                assert (ROOT / word.split("::")[0]).exists(), f"{word} does not exist"
    elif kind == "file":
        path = argv[0] if argv[0].startswith((".ci/", "./")) else argv[1]
        if path.startswith(("../", "/", "$")):  # outside the repository (../shared/tools): not its to keep
            return
        assert (ROOT / PREPARED.get(path, path)).is_file(), f"{PREPARED.get(path, path)} does not exist"


def check(command: list[str], partial: bool = False) -> None:
    """Every check this module knows, for one command of today (``partial``: see check_vitlab)."""
    kind = kind_of(command)
    if kind == "vitlab":
        check_vitlab(vitlab_argv(command), partial)
    elif kind == "benchmark":
        check_benchmark(command)
    else:
        check_files(command)
