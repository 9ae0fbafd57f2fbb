"""Miniature reproductions of the paper's experiments (issue 22, section 3).

    vitlab experiment --list
    vitlab experiment NAME [--quick] [--out DIR] [--seeds N] [--data PATH] [--set key=value ...]

Each experiment is one module here (see ``common`` for the contract); ``run_experiment``
runs it over its seeds and writes ``results.json``, ``results.md``, ``figure.png`` and
``section.md`` (its ``docs/findings.md`` section) into the output folder.
"""
from __future__ import annotations

import importlib
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from vitlab.experiments.common import Settings, aggregate, machine, markdown_table, write_json

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
        raise ValueError(f"unknown experiment {name!r}: choose from {', '.join(EXPERIMENTS)}")
    return importlib.import_module(f"vitlab.experiments.{EXPERIMENTS[name]}")


def settings(name: str, quick: bool = False, **changes) -> Settings:
    mod = get(name)
    values = dict(mod.QUICK if quick else mod.DEFAULT)
    values.setdefault("seeds", 1 if quick else 3)
    values.update({k: v for k, v in changes.items() if v is not None})
    return Settings.from_dict(values)


def run_experiment(name: str, out: str | Path, quick: bool = False, command: str | None = None,
                   verbose: bool = True, **changes) -> dict:
    """Run experiment ``name`` into ``out``; returns {"rows", "table", "wall_s", "files"}."""
    mod = get(name)
    s = settings(name, quick, **changes)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    rows = mod.run(s, out / "runs")
    wall = time.monotonic() - t0
    earlier = len(s.reused)
    keys, metrics = list(mod.SUMMARY), list(mod.METRICS)
    table = aggregate(rows, keys, metrics)
    md = markdown_table(table, keys, metrics)
    meta = dict(experiment=name, paper=mod.PAPER, quick=quick, settings=s.as_dict(), wall_s=round(wall, 1),
                runs_from_earlier_invocations=earlier,
                machine=machine(), date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                command=command or f"vitlab experiment {name}" + (" --quick" if quick else ""))
    write_json(out / "results.json", dict(meta, table=table, rows=rows))
    (out / "results.md").write_text(md + "\n")
    files = {"json": out / "results.json", "markdown": out / "results.md"}
    figure = None
    if hasattr(mod, "plot"):
        try:
            figure = mod.plot(table, out / "figure.png")
        except Exception as err:  # noqa: BLE001 (a figure never fails the run)
            print(f"figure skipped: {err}", file=sys.stderr)
    if figure:
        files["figure"] = figure
    section = [f"### {name}: {mod.TITLE}", "", f"Paper: {mod.PAPER}", "",
               f"Command: `{meta['command']}`  ", f"Machine: {meta['machine']}  ",
               f"Date: {meta['date']}, wall time {wall / 60:.1f} min, seeds {s.seeds}"
               + (f" (resumed: {earlier} finished runs of an earlier invocation reused)" if earlier else ""),
               "", md, ""]
    if figure:
        section += [f"![{name}]({Path(figure).name})", ""]
    (out / "section.md").write_text("\n".join(section))
    files["section"] = out / "section.md"
    if verbose:
        print(md)
        print(f"\n{name}: {wall:.1f} s; wrote " + ", ".join(str(p) for p in files.values()))
    return dict(rows=rows, table=table, wall_s=wall, files=files)


def describe() -> list[tuple[str, str, str]]:
    """(name, title, paper) of every experiment."""
    return [(n, get(n).TITLE, get(n).PAPER) for n in EXPERIMENTS]


def command_line(argv: list[str]) -> str:
    return "vitlab experiment " + " ".join(shlex.quote(a) for a in argv)
