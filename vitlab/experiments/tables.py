"""An experiment's record: rows aggregated over seeds, its markdown table, the machine it ran
on, its JSON file, and the arrays its figure is drawn from (``vitlab.analysis.plots``)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import torch

from vitlab.files import atomic_write_text
from vitlab.machine import cpu_info, usable_cores


def aggregate(rows: list[dict], keys: Sequence[str], metrics: Sequence[str]) -> list[dict]:
    """Group rows by ``keys`` (in first-seen order); mean, std and n of each metric."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in keys), []).append(r)
    table = []
    for key, rs in groups.items():
        row = dict(zip(keys, key))
        row["n"] = len(rs)
        for m in metrics:
            vals = [float(r[m]) for r in rs if r.get(m) is not None]
            if vals:
                mean = sum(vals) / len(vals)
                row[m] = mean
                row[m + "_std"] = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
        table.append(row)
    return table


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def markdown_table(table: list[dict], keys: Sequence[str], metrics: Sequence[str]) -> str:
    cols = list(keys) + [m for m in metrics if any(m in r for r in table)] + ["n"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in table:
        cells = []
        for c in cols:
            if c in metrics and c in r:
                std = r[c + "_std"]
                # a metric the seeds cannot change (FLOPs, parameters) gets no spread
                spread = r.get("n", 1) > 1 and std > 1e-9 * abs(r[c])
                std_text = f"{std:.0f}" if std >= 100 else f"{std:.2g}"  # 160, not 1.6e+02
                cells.append(f"{r[c]:.4g} ± {std_text}" if spread else f"{r[c]:.4g}")
            else:
                cells.append(fmt(r.get(c, "")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def lines_of(table: list[dict], x: str, y: str, series: str | None) -> dict:
    """``plot_lines``' input: per value of ``series`` (one line when None), the rows' ``x``,
    mean ``y`` and its std, in order of ``x``; rows without ``y`` are left out."""
    names = [None] if series is None else list(dict.fromkeys(r[series] for r in table))
    lines = {}
    for name in names:
        rs = sorted((r for r in table if (series is None or r[series] == name) and r.get(y) is not None),
                    key=lambda r: r[x])
        if rs:
            lines[str(name)] = ([r[x] for r in rs], [r[y] for r in rs], [r.get(y + "_std", 0) for r in rs])
    return lines


def bars_of(table: list[dict], label_keys: Sequence[str], y: str) -> tuple[list[str], list[float], list[float]]:
    """``plot_bars``' input: a label per row ("a/b" of its ``label_keys``), mean ``y`` and its std."""
    labels = ["/".join(str(r[k]) for k in label_keys) for r in table]
    return labels, [r.get(y, 0) for r in table], [r.get(y + "_std", 0) for r in table]


def machine(device: str = "auto") -> str:
    """CPU model and the cores this process may use (``vitlab.machine``), and the GPU the runs trained on
    where they did (``device``, their run.device: "auto" a GPU where there is one; "cpu" none, though
    the machine has one)."""
    info = cpu_info()
    text = f"{info.model or info.machine}, {usable_cores()} cores"
    try:
        if device != "cpu" and torch.cuda.is_available():
            index = 0 if device == "auto" else torch.device(device).index or 0
            text += f", {torch.cuda.get_device_name(index)}"
    except Exception:  # noqa: BLE001
        pass
    return text


def write_json(path: Path, obj: Any) -> None:
    def default(o):
        try:
            return float(o)
        except (TypeError, ValueError):
            return str(o)

    # replaced whole: written in place, a full disk cut the earlier results.json short, whose rows --resume takes
    atomic_write_text(path, json.dumps(obj, indent=2, default=default))
