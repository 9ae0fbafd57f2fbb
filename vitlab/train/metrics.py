"""Where a run's numbers go: JSONL and CSV per logged step, TensorBoard when installed,
PNG curves at the end, and a progress line on stderr.

Only rank 0 writes.  Every record is a flat dict; the CSV's columns are fixed up front
(``COLUMNS``) so that rows logged with and without validation numbers line up.
"""
from __future__ import annotations

import csv
import io
import json
import math
import sys
import time
from pathlib import Path

from vitlab.files import atomic_write_text

COLUMNS = ("step", "epoch", "lr", "loss", "train_top1", "grad_norm", "val_loss", "val_top1", "val_top5",
           "val_top1_single", "val_top1_flip", "val_prec1", "val_prec1_single", "val_prec1_flip", "img_per_s",
           "data_wait", "elapsed_s", "skipped_steps", "overflow_steps", "loss_scale")


class MetricsWriter:
    """Writes records to ``out/metrics.jsonl`` and ``out/metrics.csv`` (and TensorBoard).

    The files are rewritten at the start with ``records``: a fresh run's (none) or those
    a resumed run's checkpoint holds, so steps logged after that checkpoint by a killed
    run are not listed twice, and an earlier run in the same folder does not leak in.
    They are replaced whole (``atomic_write``), then appended to: truncated and written in
    place, a full disk as a finished run was resumed left its log cut short, which the
    report (``vitlab inspect``) drew as the run's curves.
    """

    def __init__(self, out: str | Path, tensorboard: bool = True, records: list[dict] | None = None) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.records: list[dict] = list(records or [])
        table = io.StringIO()
        rows = csv.DictWriter(table, fieldnames=COLUMNS, extrasaction="ignore")
        rows.writeheader()
        rows.writerows(self.records)
        atomic_write_text(self.out / "metrics.jsonl", "".join(json.dumps(record) + "\n" for record in self.records))
        atomic_write_text(self.out / "metrics.csv", table.getvalue())
        self._jsonl = open(self.out / "metrics.jsonl", "a")
        self._csv_file = open(self.out / "metrics.csv", "a", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=COLUMNS, extrasaction="ignore")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out / "tensorboard"))
            except ImportError:  # tensorboard is optional
                self._tb = None

    def log(self, record: dict) -> None:
        self.records.append(record)
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        self._csv.writerow(record)
        self._csv_file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._jsonl.close()
        self._csv_file.close()
        if self._tb is not None:
            self._tb.close()


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_curves(records: list[dict], path: str | Path) -> Path | None:
    """Loss (train, val) and accuracy (train, val top-1/top-5, or a multi-label set's prec@1) against step, as a PNG."""
    # a Figure of its own, not pyplot: matplotlib.use("Agg") and pyplot's figures are the process's,
    # and a caller's notebook or GUI backend would be switched to Agg by a training run
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None

    def series(key: str) -> tuple[list, list]:
        rows = [r for r in records if isinstance(r.get(key), (int, float))]
        return [r["step"] for r in rows], [r[key] for r in rows]

    fig = Figure(figsize=(10, 4))
    ax_loss, ax_acc = fig.subplots(1, 2)
    for key, label in (("loss", "train"), ("val_loss", "validation")):
        xs, ys = series(key)
        if xs:
            ax_loss.plot(xs, ys, label=label, marker="o" if key.startswith("val") else None)
    ax_loss.set(xlabel="step", ylabel="cross-entropy", title="loss")
    for key, label in (("train_top1", "train top-1"), ("val_top1", "val top-1"), ("val_top5", "val top-5"),
                       ("val_prec1", "val prec@1")):
        xs, ys = series(key)
        if xs:
            ax_acc.plot(xs, ys, label=label, marker="o" if key.startswith("val") else None)
    ax_acc.set(xlabel="step", ylabel="accuracy", title="accuracy", ylim=(0, 1))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path


def format_duration(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class Progress:
    """A one-line progress bar on stderr: step, loss, images/s, ETA.

    On a terminal the line is redrawn with a carriage return; otherwise (a log file) a
    full line is printed at most every ``interval_s`` seconds.
    """

    def __init__(self, enabled: bool = True, interval_s: float = 10.0, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval_s = interval_s
        self._last = -math.inf  # the first line comes at once, however young the monotonic clock

    def update(self, step: int, total: int | None, loss: float | None, img_per_s: float, eta_s: float,
               extra: str = "") -> None:
        """``loss``: the last one read from the device, None before the first read ("loss -");
        a non-finite one shows as nan or inf.  ``total`` None: not known yet (a time limit still
        timing its first steps), shown as "?" with no ETA."""
        if not self.enabled:
            return
        now = time.monotonic()
        if not self.tty and now - self._last < self.interval_s and (total is None or step < total):
            return
        self._last = now
        width = 24
        filled = 0 if total is None else int(width * step / max(total, 1))
        bar = "#" * filled + "." * (width - filled)
        shown = "-" if loss is None else f"{loss:.4f}"
        eta = "-" if total is None else format_duration(eta_s)
        line = (f"[{bar}] {step}/{'?' if total is None else total} loss {shown} {img_per_s:,.0f} img/s "
                f"ETA {eta}{'  ' + extra if extra else ''}")
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line that stays (validation results, notes), without breaking the bar."""
        if not self.enabled:
            return
        self.stream.write(("\r\x1b[K" if self.tty else "") + text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
