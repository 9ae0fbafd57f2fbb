"""What every experiment shares: the run settings, the training helpers, seeds and the writer.

An experiment is a module of this package with

    TITLE, PAPER   one line each: what it asks and which figure/table of the paper it mirrors
    DEFAULT, QUICK plain dicts of settings (``Settings`` fields plus the experiment's own)
    run(s, out) -> rows   trains/measures through the library, one row per (setting, seed)
    SUMMARY        the columns rows are grouped by; METRICS the columns averaged over seeds
    plot(table, path)     optional: a figure of the aggregated table

The runner (``vitlab.experiments.run_experiment``) writes ``out/results.json``,
``out/results.md`` (mean ± std over seeds), ``out/figure.png`` when matplotlib imports,
and ``out/section.md``: the findings section with the command, machine and wall time.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Sequence

DIGITS = "digits"
CIFAR = "../shared/data/cifar10/cifar10-train.tar.gz"  # relative to the repository root, as the README runs it


@dataclass
class Settings:
    """The knobs every experiment has; ``extra`` holds the experiment's own.

    data:        "digits" (scikit-learn's 8x8 digits, upsampled) or a CIFAR-like ImageFolder archive.
    img_size:    training resolution.
    val:         held-out examples (class-stratified, split seed 0): 5,000 on CIFAR-10.
    steps:       optimiser steps per run (a ceiling when ``minutes`` is set).
    minutes:     wall-time limit per run (0: none); the engine fits the schedule into it.
    batch, lr:   the ViT runs' batch and AdamW learning rate.
    width, depth, heads, mlp, patch: the base ViT.
    seeds:       runs per setting; tables report mean ± std.
    device, threads: where training runs ("auto": a GPU when there is one).
    resume:      reuse every run a previous invocation into the same folder finished with
                 exactly this run's config (``finished_run``), so that an interrupted
                 experiment, or one given more seeds, trains only what is missing.
    reused:      filled as the experiment runs: the folders of the runs ``resume`` reused.
    earlier_rows: the rows ``run_experiment`` took from the folder's ``results.json`` when
                 ``resume`` found finished seeds there (run folders are not kept in git, so on a
                 fresh checkout that file is the only record); ``seeds_done`` are their seeds.
                 Experiments loop over ``new_seeds()``; one that gains a setting (a model added to
                 ``compute``) loops over every seed and skips what ``has_row`` finds, so that
                 resuming trains the new setting for the finished seeds too.
    """

    data: str = DIGITS
    img_size: int = 16
    val: int = 300
    steps: int = 20
    minutes: float = 0.0
    batch: int = 64
    lr: float = 3e-3
    width: int = 32
    depth: int = 2
    heads: int = 2
    mlp: int = 64
    patch: int = 4
    seeds: int = 1
    device: str = "auto"
    threads: int = 0
    resume: bool = False
    extra: dict = field(default_factory=dict)
    reused: list = field(default_factory=list)
    earlier_rows: tuple = ()

    INTERNAL = ("extra", "reused", "earlier_rows")

    @classmethod
    def from_dict(cls, values: dict) -> "Settings":
        names = {f.name for f in fields(cls)} - set(cls.INTERNAL)
        known = {k: v for k, v in values.items() if k in names}
        return cls(**known, extra={k: v for k, v in values.items() if k not in names})

    def get(self, key: str, default: Any = None) -> Any:
        return self.extra.get(key, default)

    @property
    def seeds_done(self) -> frozenset:
        return frozenset(r["seed"] for r in self.earlier_rows)

    def new_seeds(self) -> list[int]:
        return [seed for seed in range(self.seeds) if seed not in self.seeds_done]

    def has_row(self, **keys: Any) -> bool:
        """Whether the earlier results the runner took (``earlier_rows``) hold a row with ``keys``."""
        return any(all(r.get(k) == v for k, v in keys.items()) for r in self.earlier_rows)

    @property
    def digits(self) -> bool:
        return self.data == DIGITS

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in self.INTERNAL}
        d.update(self.extra)
        return d


def parse_value(text: str) -> Any:
    """A ``--set`` value: a Python literal, true/false in any case, else the text itself."""
    import ast

    if text.lower() in ("true", "false"):  # "false" must not reach a setting as a truthy string
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


# ----------------------------------------------------------------------------- models


def vit_overrides(s: Settings, **changes: Any) -> dict:
    """The base ViT of an experiment as ``ViTConfig`` overrides (changes win)."""
    d = dict(img_size=s.img_size, patch_size=s.patch, width=s.width, depth=s.depth, num_heads=s.heads,
             mlp_dim=s.mlp, gelu="exact", name=f"ViT-w{s.width}d{s.depth}/{s.patch}")
    d.update(changes)
    return d


def stem(s: Settings, layers: Sequence[int] = (1,), width_factor: float | None = None) -> dict:
    """A small BiT-layout ResNet (BatchNorm) for the hybrid's stem / the ResNet baseline.

    Root 7x7/2 + max-pool /2, then ``layers`` units (each later stage /2): 16 px -> 4x4,
    32 px with (1, 3) -> 4x4, as the cifar10_scratch recipe's hybrid."""
    wf = width_factor if width_factor is not None else (0.5 if s.digits else 1)
    return dict(layers=tuple(layers), width_factor=wf, img_size=s.img_size, norm="batch")


def hybrid_overrides(s: Settings, layers: Sequence[int] | None = None, **changes: Any) -> dict:
    layers = layers if layers is not None else ((1,) if s.digits else (1, 3))
    return vit_overrides(s, patch_size=1, resnet=stem(s, layers), name=f"R+ViT-w{s.width}d{s.depth}/1", **changes)


# ----------------------------------------------------------------------------- training


def train_config(s: Settings, out: Path, seed: int, overrides: dict, changes: dict | None = None):
    """A ``TrainConfig`` for one run of an experiment: AdamW, cosine, pad-and-crop on CIFAR.

    Real data trains with ``precision="auto"``, as the recipes do (bf16 autocast where the CPU
    or GPU runs it faster than fp32, by the rule in ``vitlab.fast``), so a time-limited run
    gets the steps the hardware can give it; the digits of the quick forms train in fp32."""
    from vitlab.train.config import (AugmentConfig, DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig,
                                     replace)

    cfg = TrainConfig(
        recipe="experiment",
        model=ModelConfig(name="ViT-Ti/16", overrides=dict(overrides)),
        data=DataConfig(source=s.data, val_split=s.val, split_seed=0),
        augment=AugmentConfig(crop="none" if s.digits else "pad", flip=not s.digits),
        optim=OptimConfig(optimizer="adam", lr=s.lr, weight_decay=0.05, batch_size=s.batch, steps=s.steps,
                          warmup=0.05 if s.steps >= 20 else 1, decay="cosine", clip_norm=1.0),
        run=RunConfig(precision="fp32" if s.digits else "auto", eval_every=0, log_every=max(1, s.steps // 10),
                      ckpt_every=0, keep_ckpts=1,
                      threads=s.threads, device=s.device, seed=seed, time_limit=s.minutes, tensorboard=False,
                      fast=not s.digits, out=str(out)),
    )
    return replace(cfg, changes or {})


def train_vit(s: Settings, out: Path, seed: int, overrides: dict, changes: dict | None = None) -> dict:
    """Train one ViT (or hybrid) through ``vitlab.train.train``; the summary plus its FLOPs."""
    from vitlab.analysis.cost import training_flops
    from vitlab.train import train
    from vitlab.train.config import model_config

    cfg = train_config(s, out, seed, overrides, changes)
    summary = finished_run(cfg) if s.resume else None
    if summary is None:
        summary = train(cfg, verbose=False, overwrite=True)
    else:
        s.reused.append(cfg.run.out)
    try:
        mcfg = model_config(cfg, num_classes=10)
        summary["train_eflops"] = (training_flops(mcfg, summary["steps"], cfg.optim.batch_size)
                                   + optimiser_flops_per_step(mcfg, cfg.optim.optimizer) * summary["steps"] / 1e18)
    except Exception:  # noqa: BLE001 (fine-tuned runs: the architecture is the checkpoint's)
        summary["train_eflops"] = None
    return summary


def optimiser_flops_per_step(model_cfg, optimizer: str) -> int:
    """The matmul FLOPs an optimiser step adds to the forward and backward passes: Muon's
    orthogonalisation of the blocks' matrices; 0 for AdamW and SGD, whose elementwise updates
    the paper's count (3 x forward) leaves out as well."""
    if optimizer != "muon":
        return 0
    import torch

    from vitlab.models.registry import build_model
    from vitlab.train.optim import muon_step_flops

    with torch.device("meta"):  # shapes only
        model = build_model(model_cfg)
    return muon_step_flops(model)


def finished_run(cfg) -> dict | None:
    """The summary of a run of exactly ``cfg`` that finished in ``cfg.run.out``, or None.

    Finished: its summary and weights are there, and its saved config is ``cfg``.  The saved
    config is read back through ``from_dict``, so a field added since it was written counts
    at its default (the behaviour the run had) rather than as a difference.  A run that
    starts from other weights (``model.init``, a pre-training run's) counts only if those
    weights are older than its summary: a pre-training run trained again since invalidates
    the fine-tuning runs made from its previous weights."""
    from vitlab.config import ConfigError
    from vitlab.train.config import from_dict, to_dict

    def as_json(c) -> dict:
        return json.loads(json.dumps(to_dict(c)))

    out = Path(cfg.run.out)
    try:
        summary = json.loads((out / "summary.json").read_text())
        saved = from_dict(json.loads((out / "config.json").read_text()))
        finished = (out / "summary.json").stat().st_mtime
        if not Path(summary["weights"]).is_file():
            return None
        if cfg.model.init is not None and Path(cfg.model.init).stat().st_mtime >= finished:
            return None
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        return None
    return summary if same_values(as_json(cfg), as_json(saved)) else None


def same_values(asked, saved) -> bool:
    """Whether a saved config holds the values asked; one asked as "auto" matches the value
    the run resolved it to (``config.json`` states the resolved worker counts, for one)."""
    if isinstance(asked, dict) and isinstance(saved, dict):
        return asked.keys() == saved.keys() and all(same_values(asked[k], saved[k]) for k in asked)
    return asked == saved or asked == "auto"


def load_images(s: Settings, size: int | None = None):
    """(images uint8 (N, 3, H, W), labels, classes) of the experiment's data at ``size``."""
    size = size or s.img_size
    if s.digits:
        from vitlab.data.digits import load_digits_dataset

        d = load_digits_dataset(size)
    else:
        from vitlab.data import load_in_memory

        d = load_in_memory(s.data)
        if d.images.shape[-1] != size:
            import torch.nn.functional as F

            d.images = F.interpolate(d.images.float(), size=(size, size), mode="bilinear",
                                     antialias=True).round().clamp(0, 255).byte()
    return d.images, d.labels, d.classes


def split(s: Settings, labels):
    """The engine's held-out split: ``stratified_split(labels, val, split_seed=0)``."""
    from vitlab.data import stratified_split

    return stratified_split(labels, s.val, 0)


def train_resnet(s: Settings, out: Path, seed: int, resnet: dict, optimizer: str = "adam", lr: float | None = None,
                 train_examples: int = 0) -> dict:
    """Train a BiT-layout ResNet classifier through the same engine, data, split, augmentation
    and schedule as ``train_vit``: the paper's ResNet baselines (``resnet`` as ``stem`` builds it).
    SGD runs with momentum 0.9 and L2 weight decay 5e-4, the CIFAR ResNet standard."""
    layers = "x".join(str(n) for n in resnet.get("layers", ()))
    changes = {"model.name": "BiT-R50x1", "model.overrides": dict(resnet, name=f"BiT-R[{layers}]"),
               "optim.optimizer": optimizer, "optim.lr": lr if lr is not None else (s.lr if optimizer == "adam" else 0.1),
               "data.train_examples": int(train_examples)}
    if optimizer == "sgd":
        changes.update({"optim.weight_decay": 5e-4, "optim.wd_scope": "all"})
    return train_vit(s, out, seed, {}, changes)


def fewshot(model, s: Settings, shots: Sequence[int] = (5,), train_examples: int = 0) -> dict:
    """Linear few-shot top-1 of frozen features: pool = the training split, evaluated on the held-out one."""
    from vitlab.data import stratified_split
    from vitlab.eval.features import extract_features
    from vitlab.eval.fewshot import fewshot_evaluate

    images, labels, _ = load_images(s)
    if train_examples:
        _, keep = stratified_split(labels, int(train_examples), 1)
        images, labels = images[keep], labels[keep]
    train_idx, val_idx = split(s, labels)
    model.eval()
    pool = extract_features(model, images[train_idx], image_size=s.img_size)
    ev = extract_features(model, images[val_idx], image_size=s.img_size)
    per_class = int(min(__import__("numpy").bincount(labels[train_idx].numpy())))
    shots = [k for k in shots if k + 2 <= per_class] or [max(1, per_class // 3)]
    r = fewshot_evaluate(pool, labels[train_idx].numpy(), ev, labels[val_idx].numpy(), shots=shots, seeds=(0,),
                         holdout_per_class=min(10, max(1, per_class - max(shots) - 1)))
    return {f"fewshot_{k}": float(sum(v) / len(v)) for k, v in r.accuracy.items()}


def load_trained(summary: dict):
    """The model a ``train_vit``/``train_resnet`` run saved."""
    from vitlab.weights import load_model

    return load_model(summary["weights"])


# ----------------------------------------------------------------------------- seeds and tables


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


def machine() -> str:
    """CPU model and core count (from lscpu / /proc/cpuinfo) and the GPU when there is one."""
    import os
    import platform

    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{name}, {os.cpu_count()} cores"
    try:
        import torch

        if torch.cuda.is_available():
            text += f", {torch.cuda.get_device_name(0)}"
    except Exception:  # noqa: BLE001
        pass
    return text


def plot_lines(table: list[dict], x: str, y: str, series: str | None, path: Path, title: str = "",
               logx: bool = False) -> Path | None:
    """One line per value of ``series``: mean ``y`` against ``x`` with ± std bars."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    names = [None] if series is None else list(dict.fromkeys(r[series] for r in table))
    for name in names:
        rs = [r for r in table if (series is None or r[series] == name) and r.get(y) is not None]
        if not rs:
            continue
        rs.sort(key=lambda r: r[x])
        ax.errorbar([r[x] for r in rs], [r[y] for r in rs], yerr=[r.get(y + "_std", 0) for r in rs],
                    marker="o", capsize=3, label=str(name))
    if logx:
        from matplotlib.ticker import FuncFormatter

        ax.set_xscale("log")
        # within a decade matplotlib labels every minor tick and they overlap: label 2x and 5x only
        ax.xaxis.set_minor_formatter(FuncFormatter(
            lambda v, _: f"{v:g}" if v > 0 and round(v / 10 ** math.floor(math.log10(v))) in (2, 5) else ""))
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title, fontsize=9)
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bars(table: list[dict], label_keys: Iterable[str], y: str, path: Path, title: str = "") -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    label_keys = list(label_keys)
    labels = ["/".join(str(r[k]) for k in label_keys) for r in table]
    fig, ax = plt.subplots(figsize=(max(4, 0.6 * len(labels) + 1), 3.5))
    ax.bar(range(len(table)), [r.get(y, 0) for r in table], yerr=[r.get(y + "_std", 0) for r in table], capsize=3)
    ax.set_xticks(range(len(table)), labels, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel(y)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_json(path: Path, obj: Any) -> None:
    def default(o):
        try:
            return float(o)
        except (TypeError, ValueError):
            return str(o)

    path.write_text(json.dumps(obj, indent=2, default=default))
