"""Miniature reproductions of the paper's experiments (issue 22, section 3).

    vitlab experiment --list
    vitlab experiment NAME [--quick] [--out DIR] [--seeds N] [--data PATH] [--set key=value ...]

Each experiment is one module here (see ``common`` for the contract); ``run_experiment``
runs it over its seeds and writes ``results.json``, ``results.md``, ``figure.png`` and
``section.md`` (its ``docs/findings.md`` section) into the output folder.
"""
from __future__ import annotations

import difflib
import importlib
import json
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from vitlab.config import ConfigError, need_output_folder
from vitlab.configs import load_recipe
from vitlab.experiments.common import Settings, check_arms
from vitlab.experiments.tables import aggregate, machine, markdown_table, write_json
from vitlab.files import atomic_write_text
from vitlab.train.legacy import FORMER_SETTING_NAMES

DATA_RECIPE = "cifar10_scratch"  # the full-size forms' data: this recipe's data.source

# name -> module
EXPERIMENTS = {
    "data-scale": "data_scale",
    "compute": "compute",
    "transfer": "transfer",
    "posemb": "posemb",
    "posemb-similarity": "posemb_similarity",
    "head": "head",
    "shape": "shape",
    "optimiser": "optimiser",
    "attention-distance": "attention_distance",
    "mpp": "mpp",
    "resolution": "resolution",
}


def get(name: str):
    if name not in EXPERIMENTS:
        close = difflib.get_close_matches(str(name), list(EXPERIMENTS), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown experiment {name!r}.{hint} Choose from {', '.join(EXPERIMENTS)}")
    return importlib.import_module(f"vitlab.experiments.{EXPERIMENTS[name]}")


def defaults(name: str, quick: bool = False) -> dict:
    """Every setting of experiment ``name`` in its full-size or ``quick`` form, at its default:
    ``Settings``' fields, the experiment's ``OPTIONS``, then its ``DEFAULT`` or ``QUICK``.  The
    full-size forms train on the data of ``DATA_RECIPE`` unless they name their own (for
    ``cifar10_scratch`` an archive path relative to the repository root, as the README runs it)."""
    mod = get(name)
    values = Settings().as_dict()
    values["seeds"] = 1 if quick else 3
    if not quick:
        values["data"] = load_recipe(DATA_RECIPE).data.source
    values.update(getattr(mod, "OPTIONS", {}))
    values.update(mod.QUICK if quick else mod.DEFAULT)
    return values


def setting_name(name: str, key: str) -> str:
    """The setting ``key`` names in experiment ``name`` (a former name is mapped to today's); a
    ``ConfigError`` naming the close matches and every setting when it has none."""
    key = FORMER_SETTING_NAMES.get(key, key)
    known = set(defaults(name, quick=True)) | set(get(name).DEFAULT) | set(getattr(get(name), "OPTIONS", {}))
    if key not in known:
        close = difflib.get_close_matches(key, sorted(known), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"experiment {name}: unknown setting {key!r}.{hint} Its settings: {', '.join(sorted(known))}")
    return key


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, (list, tuple)):
        return "a non-empty list"
    return {int: "an integer", float: "a number", str: "a word", dict: "a dict"}.get(type(value), type(value).__name__)


def _expected(default: Any) -> str:
    items = {_kind(d) for d in default} if isinstance(default, (list, tuple)) else set()
    plural = {"an integer": "integers", "a number": "numbers", "a word": "words"}
    if len(items) == 1 and next(iter(items)) in plural:
        return f"a non-empty list of {plural[next(iter(items))]}"
    return _kind(default)


def _fits(value: Any, default: Any) -> bool:
    """Whether ``value`` has the shape of ``default``: a number for a number (an int for an int), a
    non-empty list of such items for a list, a record such as ["adam", 3e-3] item by item."""
    if default is None:
        return True
    if isinstance(default, (list, tuple)):
        if not isinstance(value, (list, tuple)) or not value:
            return False
        if not default:
            return True
        if len({_kind(d) for d in default}) > 1:  # a record: each place its own kind
            return len(value) == len(default) and all(map(_fits, value, default))
        return all(_fits(v, default[0]) for v in value)
    if isinstance(default, float) and not isinstance(value, bool):
        return isinstance(value, (int, float))
    return _kind(value) == _kind(default)


def _counts(value: Any) -> bool:
    """Whether ``value`` is a positive integer or a non-empty list of them."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return bool(items) and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in items)


def check_setting(name: str, key: str, value: Any) -> None:
    """An experiment's own setting (``sizes``, ``lrs``, ``budgets``...) must have the shape of its default
    in either form: these reach no TrainConfig check, so a malformed one ended in a TypeError deep in the
    experiment ("'int' object is not iterable"), a string iterated letter by letter, or, empty, in no runs
    and an empty table written over the folder's results."""
    if key in Settings.names():  # the trainer's own settings: its config names and checks them
        return
    forms = [d[key] for d in (defaults(name, False), defaults(name, True)) if key in d]
    if forms and not any(_fits(value, d) for d in forms):
        raise ConfigError(f"experiment {name}: {key}={value!r}: expected {_expected(forms[0])}, "
                          f"such as {json.dumps(forms[0])}")
    # a count (sizes, budgets, shots...), told by positive integers in every form: below 1 it ran into
    # whichever check of the trainer it broke first (sizes=[-1]: data.val_split's), which named neither it
    if forms and all(_counts(d) for d in forms) and not _counts(value):
        raise ConfigError(f"experiment {name}: {key}={value!r}: expected {_expected(forms[0])} above 0, "
                          f"such as {json.dumps(forms[0])}")


def unread(name: str, values: dict) -> dict:
    """The settings experiment ``name``'s runs do not read at ``values``, each with what decides instead:
    its module's ``UNUSED``, or its function ``unused(values)`` where that depends on the values."""
    mod = get(name)
    return dict(mod.unused(values) if hasattr(mod, "unused") else getattr(mod, "UNUSED", {}))


def settings(name: str, quick: bool = False, **changes) -> Settings:
    """The settings of one run of experiment ``name``: its defaults with ``changes`` (None: unset).
    A change to a setting its runs do not read is refused (``unread``): accepted, it did nothing
    while results.json and the section recorded it as the experiment's.  Every value of a list
    setting is checked as its runs' field (the module's ``ARMS``, ``check_arms``)."""
    values, changed = defaults(name, quick), {}
    for key, value in changes.items():
        if value is not None:
            key = setting_name(name, key)
            check_setting(name, key, value)
            values[key] = changed[key] = value
    unused = unread(name, values)
    for key, value in changed.items():
        if key in unused:
            raise ConfigError(f"experiment {name}: {key}={value!r}: its runs do not read it; {unused[key]}")
    s = Settings.from_dict(values)
    check_arms(name, s, getattr(get(name), "ARMS", {}))
    return s


def run_experiment(name: str, out: str | Path, quick: bool = False, command: str | None = None,
                   verbose: bool = True, **changes) -> dict:
    """Run experiment ``name`` into ``out``; returns {"rows", "table", "wall_s", "files"}."""
    from vitlab.train.distributed import check_one_process

    check_one_process("an experiment")
    mod = get(name)
    s = settings(name, quick, **changes)
    need_output_folder("out", out)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    earlier_rows = rows_of_earlier_seeds(name, out, s, quick) if s.resume else []
    s.earlier_rows = tuple(earlier_rows)
    t0 = time.monotonic()
    rows = earlier_rows + mod.run(s, out / "runs")
    wall = time.monotonic() - t0
    earlier = len(s.reused)
    keys = list(mod.SUMMARY)
    metrics = list(mod.metrics(rows) if hasattr(mod, "metrics") else mod.METRICS)
    table = aggregate(rows, keys, metrics)
    md = markdown_table(table, keys, metrics)
    meta = dict(experiment=name, version=version(mod), paper=mod.PAPER, quick=quick, settings=s.as_dict(),
                wall_s=round(wall, 1), runs_from_earlier_invocations=earlier, seeds_from_earlier_results=sorted(s.seeds_done),
                machine=machine(s.device), date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                command=command or f"vitlab experiment {name}" + (" --quick" if quick else ""),
                **(mod.notes(s, rows) if hasattr(mod, "notes") else {}))  # what the runs left out, and why
    record = dict(meta, table=table, rows=rows)
    write_json(out / "results.json", record)
    atomic_write_text(out / "results.md", results_markdown(record))
    files = {"json": out / "results.json", "markdown": out / "results.md"}
    figure = draw_figure(mod, table, out / "figure.png")
    if figure:
        files["figure"] = figure
    atomic_write_text(out / "section.md", section_markdown(record, figure=figure is not None))
    files["section"] = out / "section.md"
    if verbose:
        print(md)
        print(f"\n{name}: {wall:.1f} s; wrote " + ", ".join(str(p) for p in files.values()))
    return dict(rows=rows, table=table, wall_s=wall, files=files)


def table_markdown(record: dict) -> str:
    """The markdown table of a ``results.json`` record: its rows aggregated over seeds as its experiment
    groups and averages them (the record's own ``table`` is the same aggregate, written beside the rows)."""
    mod = get(record["experiment"])
    keys, rows = list(mod.SUMMARY), record["rows"]
    metrics = list(mod.metrics(rows) if hasattr(mod, "metrics") else mod.METRICS)
    return markdown_table(aggregate(rows, keys, metrics), keys, metrics)


def provenance(record: dict) -> list[str]:
    """The lines that say what made a record, where and when, from the record itself."""
    seeds_done = frozenset(record.get("seeds_from_earlier_results", ()))
    return [f"Command: `{record['command']}`  ", f"Machine: {record['machine']}  ",
            f"Date: {record['date']}, wall time {record['wall_s'] / 60:.1f} min, seeds {record['settings']['seeds']}"
            + resumed_note(seeds_done, record.get("runs_from_earlier_invocations", 0))]


def results_markdown(record: dict) -> str:
    """``results.md`` of a record: its table, and below it the command, machine and date (read alone, as the
    docs link it, it said neither what made it nor where nor when)."""
    return "\n".join([table_markdown(record), "", *provenance(record), ""])


def section_markdown(record: dict, figure: bool = True) -> str:
    """``section.md`` of a record, its ``docs/findings.md`` section: the experiment's title and paper
    figure, the record's provenance and table, and its figure (``figure.png`` beside it) where one was drawn.
    Rendered from the record alone, so a section can be written again from a stored ``results.json``."""
    name = record["experiment"]
    mod = get(name)
    section = [f"### {name}: {mod.TITLE}", "", f"Paper: {mod.PAPER}", "", *provenance(record), "",
               table_markdown(record), ""]
    if figure:
        section += [f"![{name}](figure.png)", ""]
    return "\n".join(section)


def draw_figure(mod, table: list[dict], path: Path) -> Path | None:
    """The experiment's figure of ``table`` written to ``path``, or None: it has none, or it
    could not be drawn (said in one line; a figure never fails the run).  Then an earlier
    invocation's figure at ``path`` is removed: left, it showed another table beside this one."""
    figure = None
    if hasattr(mod, "plot"):
        try:
            figure = mod.plot(table)
        except Exception as err:  # noqa: BLE001 - a missing matplotlib names its extra itself (MissingPackage)
            print(f"figure skipped: {err}", file=sys.stderr)
    if figure is None:
        path.unlink(missing_ok=True)
        return None
    figure.savefig(path, dpi=110)
    return path


def version(mod) -> int:
    """The version of an experiment's measurement: its module's ``VERSION``, raised where rows are no
    longer measured as before (a file without one is version 1)."""
    return getattr(mod, "VERSION", 1)


def rows_of_earlier_seeds(name: str, out: Path, settings: Settings, quick: bool) -> list[dict]:
    """The rows ``--resume`` takes from ``out/results.json`` instead of training again.

    An earlier invocation's file counts only if it ran the same experiment (another one's rows,
    written into the same folder, are not this one's, however alike their settings), measured as
    this version measures it (``version``), at the same size
    in the same form (``--quick`` or not; ``same_size``); its seeds 0..n-1 are then finished (the file is
    written once all of them are).  A seed's rows are taken only where ``out/runs`` holds none
    of that seed's run folders (``*-s<seed>``), as on a fresh checkout: where the folders are
    there, the run-by-run check (``finished_run``) decides, so a run retrained since still
    invalidates what was made from it."""
    try:
        earlier = json.loads((out / "results.json").read_text())
        finished = min(int(earlier["settings"].get("seeds")), settings.seeds)
        same = (earlier.get("experiment") == name and earlier.get("version", 1) == version(get(name))
                and earlier.get("quick") == quick
                and same_size(name, quick, earlier["settings"], settings))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    if not same:
        return []
    runs = out / "runs"
    missing = {seed for seed in range(finished) if not any(runs.glob(f"*-s{seed}"))}
    return [r for r in earlier.get("rows", []) if r.get("seed") in missing]


def same_size(name: str, quick: bool, recorded: dict, settings: Settings) -> bool:
    """Whether settings a ``results.json`` recorded describe the experiment ``settings`` describes, but
    for ``seeds`` and ``resume``.  They are read as today's: former names mapped
    (``FORMER_SETTING_NAMES``), a setting added since at its default (the value that run had), one the
    experiment no longer has left out."""
    recorded = {FORMER_SETTING_NAMES.get(k, k): v for k, v in recorded.items()}
    now, default = settings.as_dict(), defaults(name, quick)
    before = {k: recorded[k] if k in recorded else default.get(k) for k in now}
    for d in (before, now):
        for key in ("seeds", "resume"):
            d.pop(key, None)
    return json.loads(json.dumps(now)) == json.loads(json.dumps(before))


def resumed_note(seeds: frozenset, runs: int) -> str:
    """The section's note on what a resumed invocation did not train."""
    parts = []
    if seeds:
        parts.append(f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, sorted(seeds)))} "
                     "from the earlier results.json")
    if runs:
        parts.append(f"{runs} finished runs of an earlier invocation reused")
    return f" (resumed: {'; '.join(parts)})" if parts else ""


def describe(name: str | None = None) -> list[tuple[str, str, str]]:
    """(name, title, paper) of experiment ``name``, or of every experiment."""
    return [(n, get(n).TITLE, get(n).PAPER) for n in ([name] if name else EXPERIMENTS)]


def command_line(argv: list[str]) -> str:
    return "vitlab experiment " + " ".join(shlex.quote(a) for a in argv)
